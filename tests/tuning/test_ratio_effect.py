"""Unit tests of the trial verdicts and back-off (tuning/trials.py) and of the
prediction helpers (tuning/predictions.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from slimspec_operator.tuning import predictions as rp
from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.trials import Basis, Outcome, Trial, judge, with_backoff
from slimspec_operator.tuning.types import TunerSettings

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def trial(basis: str = Basis.PREDICTED, frm: float = 0.3, to: float = 0.35) -> Trial:
    return Trial(at(0), frm, to, basis, p99_before=0.5, rate_before=4.0)


def verdict(t: Trial, p99s: list[float], rate: float = 4.0, changed: bool = False) -> fx.Verdict:
    return judge(
        t, p99s, rate, at(300), 0.4, tolerance=0.1, load_band=0.1, replicas_changed=changed
    )


@pytest.mark.parametrize(
    ("p99s", "rate", "outcome"),
    [
        ([0.6, 0.62], 4.0, Outcome.WORSE),  # +22 %, same load
        ([0.6, 0.62], 3.0, Outcome.WORSE),  # slower and fewer done: a closed loop slowed down
        ([0.6, 0.62], 5.0, Outcome.INCONCLUSIVE),  # more load would explain it
        ([0.4, 0.41], 4.0, Outcome.IMPROVED),
        ([0.4, 0.41], 4.5, Outcome.IMPROVED),  # faster with more load: clearly better
        ([0.4, 0.41], 3.0, Outcome.INCONCLUSIVE),  # less load would explain it
        ([0.52, 0.48], 4.0, Outcome.NEUTRAL),
    ],
)
def test_outcomes(p99s: list[float], rate: float, outcome: str) -> None:
    assert verdict(trial(), p99s, rate).outcome == outcome


def test_what_is_kept_depends_on_why_the_change_was_made() -> None:
    # A predicted or safe-side change stays unless it made latency worse.
    assert verdict(trial(), [0.52, 0.5]).keep
    assert not verdict(trial(), [0.7, 0.7]).keep
    assert verdict(trial(Basis.ENGINES_CANNOT_HELP, 0.3, 0.2), [0.5, 0.5]).keep
    # A raise tried without predictions must show a gain.
    assert not verdict(trial(Basis.MEASURED), [0.5, 0.5]).keep
    assert not verdict(trial(Basis.MEASURED), [0.7, 0.7], rate=6.0).keep  # inconclusive
    assert verdict(trial(Basis.MEASURED), [0.4, 0.4]).keep
    # A measured lowering (the safe side) stays when neutral.
    assert verdict(trial(Basis.MEASURED, 0.3, 0.2), [0.5, 0.5]).keep


def test_headroom_is_given_back_only_when_the_target_is_crossed() -> None:
    t = Trial(at(0), 0.4, 0.3, Basis.HEADROOM, p99_before=0.3, rate_before=4.0)
    rose = verdict(t, [0.36, 0.37])  # +22 %, still under the 0.4 s target
    assert rose.outcome == Outcome.WORSE and rose.keep
    crossed = verdict(t, [0.42, 0.43])
    assert crossed.outcome == Outcome.BREACHED and not crossed.keep


def test_a_replica_change_makes_any_trial_inconclusive() -> None:
    v = verdict(trial(), [0.9, 0.9], changed=True)
    assert v.outcome == Outcome.INCONCLUSIVE and v.keep
    assert "replica" in v.message


def test_small_steps_that_add_up_to_worse_undo_the_whole_chain() -> None:
    first = Trial(at(0), 0.3, 0.35, Basis.PREDICTED, p99_before=0.5, rate_before=4.0)
    second = first.next(at(300), 0.4, p99=0.53, rate=4.0)  # +6 % on the first step: kept
    assert second.origin == (0.3, 0.5, 4.0) and second.from_ratio == 0.35
    v = verdict(second, [0.56, 0.56])  # +6 % again, +12 % since 0.3
    assert v.outcome == Outcome.WORSE and not v.keep and v.revert_to == 0.3
    assert "first step" in v.message
    alone = verdict(first, [0.53, 0.53])
    assert alone.keep and alone.revert_to is None


def test_the_verdict_message_says_what_was_seen() -> None:
    v = verdict(trial(), [0.6, 0.62])
    assert "0.3 -> 0.35" in v.message and "+22%" in v.message and "0.500s -> 0.610s" in v.message


def test_backoff_doubles_per_repeat_up_to_a_cap_and_is_per_move() -> None:
    b1 = with_backoff((), 0.3, fx.UP, at(0), Outcome.WORSE, 600, 4)
    assert [(b.count, b.until) for b in b1] == [(1, at(600))]
    assert fx.blocked(b1, 0.3, fx.UP, at(599)) is not None
    assert fx.blocked(b1, 0.3, fx.UP, at(600)) is None
    assert fx.blocked(b1, 0.3, fx.DOWN, at(1)) is None  # the other direction is free
    assert fx.blocked(b1, 0.35, fx.UP, at(1)) is None  # and so is another start
    b2 = with_backoff(b1, 0.3, fx.UP, at(700), Outcome.WORSE, 600, 4)
    assert [(b.count, b.until) for b in b2] == [(2, at(700 + 1200))]
    b3 = with_backoff(b2, 0.3, fx.UP, at(2000), Outcome.WORSE, 600, 4)
    b4 = with_backoff(b3, 0.3, fx.UP, at(5000), Outcome.WORSE, 600, 4)
    assert b4[-1].count == 4 and b4[-1].until == at(5000 + 2400)  # capped at 4 x 600 s
    other = with_backoff(b4, 0.2, fx.UP, at(5000), Outcome.NEUTRAL, 600, 4)
    assert len(other) == 2
    # Long expired entries are forgotten (their count with them).
    assert fx.pruned(other, at(5000 + 2400 + 2400), 600, 4) == ()


def test_memory_learns_the_faster_direction() -> None:
    mem = fx.EffectMemory(trial=trial())
    worse = mem.learnt(verdict(trial(), [0.7, 0.7]))
    assert worse.faster == fx.DOWN and worse.trial is None and worse.faster_time == at(300)
    better = worse.learnt(verdict(trial(), [0.3, 0.3]))
    assert better.faster == fx.UP
    same = better.learnt(verdict(trial(), [0.5, 0.5]))
    assert same.faster == fx.UP  # a neutral verdict teaches nothing
    assert same.faster_known(at(400), 200) == fx.UP
    assert same.faster_known(at(400 + 3600), 200) is None  # old findings expire


# ------------------------------------------------------------------ predictions

GRID = [0.0, 0.3, 0.6, 0.9]


def test_speedup_is_interpolated_inside_the_exported_ratios_only() -> None:
    p = Predictions(speedup={0.0: 2.0, 0.3: 2.3, 0.6: 2.2, 0.9: 1.6})
    assert rp.speedup_at(p, 0.15) == pytest.approx(2.15)
    assert rp.speedup_at(p, 0.3) == pytest.approx(2.3)
    assert rp.speedup_at(p, 0.95) is None
    assert rp.predicted_gain(p, 0.0, 0.3) == pytest.approx(0.15)


def test_fastest_prefers_the_lowest_ratio_among_near_ties() -> None:
    p = Predictions(speedup={0.0: 2.0, 0.3: 2.3, 0.6: 2.32, 0.9: 1.6})
    assert rp.fastest(p, 0.1, 0.8, near_tie=0.01) == pytest.approx(0.3)  # 0.9 % apart
    assert rp.fastest(p, 0.1, 0.8, near_tie=0.0) == pytest.approx(0.6)
    assert rp.fastest(p, 0.1, 0.8, 0.01, allowed=lambda r: r < 0.2) == pytest.approx(0.1)
    # 2 % apart is no tie at the default band: the faster ratio, not the lower
    q = Predictions(speedup={0.0: 2.0, 0.3: 2.3, 0.6: 2.346, 0.9: 1.6})
    assert rp.fastest(q, 0.1, 0.8, TunerSettings().near_tie) == pytest.approx(0.6)
    assert rp.candidates(p, 0.1, 0.8) == [0.1, 0.3, 0.6, 0.8]


def test_kept_acceptance_at_a_ratio_errs_on_the_safe_side() -> None:
    p = Predictions(kept={0.3: 0.99, 0.6: 0.93})
    assert rp.kept_at(p, 0.45) == 0.93
    assert rp.kept_at(p, 0.3) == 0.99
    assert rp.kept_at(p, 0.7) is None


def test_effectiveness_condition() -> None:
    tie = TunerSettings().near_tie
    assert rp.effectiveness(None, 0.1, 0.5, 0.03, tie)[:2] == ("Unknown", Reason.NO_PREDICTIONS)
    helps = Predictions(speedup={0.0: 2.0, 0.3: 2.3, 0.6: 2.4}, can_help=True)
    status, reason, message = rp.effectiveness(helps, 0.1, 0.5, 0.03, tie)
    assert (status, reason) == ("True", Reason.PREDICTED_GAIN) and "ratio 0.5" in message
    wide = rp.effectiveness(helps, 0.1, 0.5, 0.03, 0.03)
    assert "ratio 0.3" in wide[2]  # 2.30x is within 3 % of 2.37x at 0.5
    small = Predictions(
        speedup={0.0: 2.0, 0.3: 1.95, 0.6: 1.9}, head_share={0.0: 0.07, 0.6: 0.03}, can_help=False
    )
    status, reason, message = rp.effectiveness(small, 0.1, 0.5, 0.03, tie)
    assert (status, reason) == ("False", Reason.HEAD_SHARE_TOO_SMALL) and "7%" in message
    said = Predictions(can_help=False, reason="SomethingElse")
    assert rp.effectiveness(said, 0.1, 0.5, 0.03, tie)[1] == "SomethingElse"
    # The engines say it can help, but not inside these bounds.
    outside = Predictions(speedup={0.0: 2.0, 0.3: 2.0, 0.9: 2.5}, can_help=True)
    assert rp.effectiveness(outside, 0.1, 0.3, 0.03, tie)[:2] == ("False", Reason.NO_PREDICTED_GAIN)
