"""Unit tests of the pure ratio decision (tt.decide), one decision at a time.

Closed-loop traces (a plant whose p99 is a function of the ratio, where a
higher ratio helps, hurts or does nothing) are in test_closed_loop.py; the
trial verdicts, back-off and prediction helpers in test_ratio_effect.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from slimspec_operator.contract import format_ratio
from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning.guards import decide
from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.trials import Basis, EffectMemory, Outcome, Trial
from slimspec_operator.tuning.types import Change, Sample, TunerSettings

T0 = datetime(2026, 1, 1, tzinfo=UTC)
S = TunerSettings(
    latency_target=0.4,
    dead_band=0.1,
    cooldown=120,
    max_step=0.05,
    min_ratio=0.1,
    max_ratio=0.5,
    min_request_rate=0.1,
    quality_threshold=0.95,
    confirmations=2,
    settle_after_scale=120,
)
GRID = [round(0.05 * i, 2) for i in range(20)]  # 0.0 ... 0.95
HELPS = Predictions(speedup={r: 1.5 + r for r in GRID}, can_help=True)  # higher is faster
HURTS = Predictions(speedup={r: 2.0 - r for r in GRID}, can_help=True)  # lower is faster
FLAT = Predictions(speedup=dict.fromkeys(GRID, 2.0), can_help=True)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sample(
    t: float,
    p99: float | None,
    rate: float = 5.0,
    kept: float | None = 0.99,
    pred: Predictions | None = None,
) -> Sample:
    return Sample(
        time=at(t), p99_latency=p99, request_rate=rate, kept_acceptance=kept, predictions=pred
    )


def trace(p99s: list[float | None], **kw) -> list[Sample]:
    return [sample(60 * i, p, **kw) for i, p in enumerate(p99s)]


# ------------------------------------------------------------------ predictions


def test_predicted_faster_higher_ratio_raises_by_max_step() -> None:
    d = decide(trace([0.5, 0.6], pred=HELPS), 0.3, S, at(60))
    assert d.changed and d.reason == Reason.ABOVE_TARGET
    assert d.ratio == pytest.approx(0.35)
    assert d.effect.trial is not None and d.effect.trial.basis == Basis.PREDICTED
    assert d.effect.trial.p99_before == pytest.approx(0.55)  # mean of the confirming samples


def test_predicted_faster_lower_ratio_lowers_even_though_p99_is_high() -> None:
    # The default CPU engine: the int4 draft's head is cheap, a larger ratio is slower.
    d = decide(trace([0.6, 0.6], pred=HURTS), 0.3, S, at(60))
    assert d.changed and d.ratio == pytest.approx(0.2) and d.ratio < 0.3


def test_no_ratio_predicted_faster_holds_instead_of_guessing() -> None:
    at_best = Predictions(speedup={r: 2.0 - abs(r - 0.3) for r in GRID}, can_help=True)
    d = decide(trace([0.6, 0.6], pred=at_best), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.NO_PREDICTED_GAIN
    assert "capacity" in d.message


def test_a_lower_ratio_predicted_no_slower_is_taken_in_the_dead_band() -> None:
    d = decide(trace([0.38, 0.38], pred=FLAT), 0.3, S, at(60))
    assert d.changed and d.reason == Reason.NO_SLOWER and d.ratio == pytest.approx(0.2)


def test_gain_below_the_minimum_is_not_worth_a_move() -> None:
    tiny = Predictions(speedup={r: 2.0 + 0.01 * r for r in GRID}, can_help=True)
    d = decide(trace([0.6, 0.6], pred=tiny), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.NO_PREDICTED_GAIN


def test_compression_cannot_help_goes_to_min_and_never_raises() -> None:
    cannot = Predictions(
        speedup={r: 2.0 - 0.3 * r for r in GRID},
        head_share={r: 0.08 * (1 - r) for r in GRID},
        can_help=False,
    )
    d = decide(trace([0.6, 0.6], pred=cannot), 0.3, S, at(60))
    assert d.changed and d.reason == Reason.CANNOT_HELP and d.ratio == pytest.approx(0.2)
    d = decide(trace([0.6, 0.6], pred=cannot), 0.1, S, at(60))
    assert not d.changed and d.reason == Reason.CANNOT_HELP
    # Where the engines name a best ratio, that one (it may be over minRatio).
    at_best = Predictions(speedup=cannot.speedup, can_help=False, best=0.2)
    d = decide(trace([0.6, 0.6], pred=at_best), 0.3, S, at(60))
    assert d.changed and d.ratio == pytest.approx(0.2)
    d = decide(trace([0.6, 0.6], pred=at_best), 0.2, S, at(60))
    assert not d.changed and d.reason == Reason.CANNOT_HELP
    # Some ratio in bounds may look faster by a hair: the engines' verdict stands.
    noisy = Predictions(speedup={r: 2.0 + 0.05 * r for r in GRID}, can_help=False, best=0.0)
    d = decide(trace([0.6, 0.6], pred=noisy), 0.3, S, at(60))
    assert d.changed and d.ratio == pytest.approx(0.2)
    # A step down predicted slower than a near tie (1.9 % here) is not taken either:
    # no gain is proven either way, and the ratio changes only speed.
    slower = Predictions(speedup={r: 2.0 + 0.4 * r for r in GRID}, can_help=False, best=0.0)
    d = decide(trace([0.6, 0.6], pred=slower), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.CANNOT_HELP and "not lowering" in d.message
    # Even with no per-ratio figures at all, the flag alone holds the ratio low.
    flag_only = Predictions(can_help=False, reason="HeadShareTooSmall")
    d = decide(trace([0.6, 0.6], pred=flag_only), 0.1, S, at(60))
    assert not d.changed and "HeadShareTooSmall" in d.message


def test_a_ratio_whose_measured_kept_acceptance_is_low_is_not_a_target() -> None:
    pred = Predictions(
        speedup={r: 1.5 + r for r in GRID},
        kept={r: (0.99 if r <= 0.3 else 0.9) for r in GRID},
        can_help=True,
    )
    d = decide(trace([0.6, 0.6], pred=pred), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.NO_PREDICTED_GAIN


def test_lowering_for_headroom_holds_when_the_prediction_crosses_the_target() -> None:
    # p99 0.3 s under the band; 0.2 is predicted 1.7/1.8 as fast: about 0.318 s, fine.
    d = decide(trace([0.3, 0.3], pred=HELPS), 0.3, S, at(60))
    assert d.changed and d.reason == Reason.BELOW_TARGET
    # Steeper: 0.2 predicted at 5/7 the speed of 0.3 -> about 0.42 s, over the target.
    steep = Predictions(speedup={r: 1.0 + 20 * r for r in GRID}, can_help=True)
    d = decide(trace([0.3, 0.3], pred=steep), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.HOLD_WOULD_BREACH


# ------------------------------------------------------------------ no predictions


def test_without_predictions_one_step_is_tried_down_first() -> None:
    d = decide(trace([0.5, 0.6]), 0.3, S, at(60))
    assert d.changed and d.reason == Reason.ABOVE_TARGET and d.ratio == pytest.approx(0.2)
    assert d.effect.trial is not None and d.effect.trial.basis == Basis.MEASURED


def test_without_predictions_the_direction_measured_faster_goes_first_and_only() -> None:
    up = EffectMemory(faster=fx.UP, faster_time=at(0))
    d = decide(trace([0.6, 0.6]), 0.3, S, at(60), effect=up)
    assert d.changed and d.ratio == pytest.approx(0.35)
    # At max, knowing up is faster: no probe downward.
    d = decide(trace([0.6, 0.6]), 0.5, S, at(60), effect=up)
    assert not d.changed and d.reason == Reason.HOLD_AT_MAX
    # At min, knowing down is faster: never a raise.
    down = EffectMemory(faster=fx.DOWN, faster_time=at(0))
    d = decide(trace([0.6, 0.6]), 0.1, S, at(60), effect=down)
    assert not d.changed and d.reason == Reason.HOLD_AT_MIN


def test_without_predictions_at_min_a_raise_is_tried() -> None:
    d = decide(trace([0.6, 0.6]), 0.1, S, at(60))
    assert d.changed and d.ratio == pytest.approx(0.15)


def test_unknown_quality_blocks_raises_only() -> None:
    up = EffectMemory(faster=fx.UP, faster_time=at(0))
    d = decide(trace([0.9, 0.9], kept=None), 0.3, S, at(60), effect=up)
    assert not d.changed and d.reason == Reason.HOLD_QUALITY_UNKNOWN
    d = decide(trace([0.9, 0.9], kept=None, pred=HELPS), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.HOLD_QUALITY_UNKNOWN
    down = decide(trace([0.1, 0.1], kept=None), 0.3, S, at(60))
    assert down.changed and down.ratio == pytest.approx(0.2)


def test_a_raise_from_the_full_head_is_judged_on_the_engines_kept_acceptance() -> None:
    # At ratio 0 no subset is checked, so there is no kept-acceptance reading; the
    # engines' measurement at the ratio raised to decides, and blocks when it is low.
    from_zero = replace(S, min_ratio=0.0)
    measured = replace(HELPS, kept={r: 0.97 for r in GRID if r > 0})
    d = decide(trace([0.9, 0.9], kept=None, pred=measured), 0.0, from_zero, at(60))
    assert d.changed and d.reason == Reason.ABOVE_TARGET and d.ratio == pytest.approx(0.05)
    low = replace(HELPS, kept={r: 0.4 for r in GRID if r > 0})
    d = decide(trace([0.9, 0.9], kept=None, pred=low), 0.0, from_zero, at(60))
    assert not d.changed and d.reason == Reason.NO_PREDICTED_GAIN
    d = decide(trace([0.9, 0.9], kept=None, pred=HELPS), 0.0, from_zero, at(60))
    assert not d.changed and d.reason == Reason.HOLD_QUALITY_UNKNOWN


# ------------------------------------------------------------------ trials


def _trial(basis: str = Basis.PREDICTED, frm: float = 0.3, to: float = 0.35) -> EffectMemory:
    return EffectMemory(trial=Trial(at(0), frm, to, basis, p99_before=0.5, rate_before=5.0))


def test_a_change_is_measured_through_the_cooldown_then_judged() -> None:
    eff = _trial()
    changes = [Change(at(0), 0.3, 0.35, Reason.ABOVE_TARGET, 5.0)]
    d = decide([sample(60, 0.7), sample(100, 0.7)], 0.35, S, at(100), changes, effect=eff)
    assert not d.changed and d.reason == Reason.HOLD_MEASURING
    # Samples taken before the cooldown ended do not count.
    samples = [sample(60, 0.7), sample(120, 0.7)]
    d = decide(samples, 0.35, S, at(120), changes, effect=eff)
    assert not d.changed and d.reason == Reason.HOLD_MEASURING
    d = decide([*samples, sample(180, 0.7)], 0.35, S, at(180), changes, effect=eff)
    assert d.changed and d.reason == Reason.REVERTED_WORSE and d.ratio == pytest.approx(0.3)
    assert d.verdict is not None and d.verdict.outcome == Outcome.WORSE
    assert d.effect.trial is None and d.effect.faster == fx.DOWN
    (b,) = d.effect.backoffs
    assert (b.from_ratio, b.direction, b.until) == (0.3, fx.UP, at(180 + 1200))


def test_a_change_that_helped_is_confirmed() -> None:
    samples = [sample(120, 0.3), sample(180, 0.32)]
    d = decide(samples, 0.35, S, at(180), effect=_trial())
    assert not d.changed and d.reason == Reason.CONFIRMED
    assert d.verdict is not None and d.verdict.outcome == Outcome.IMPROVED and d.verdict.keep
    assert d.effect.trial is None and d.effect.last == d.verdict and d.effect.faster == fx.UP


def test_a_measured_raise_that_did_nothing_is_reverted() -> None:
    samples = [sample(120, 0.5), sample(180, 0.51)]
    d = decide(samples, 0.35, S, at(180), effect=_trial(Basis.MEASURED))
    assert d.changed and d.reason == Reason.REVERTED_NO_GAIN and d.ratio == pytest.approx(0.3)


def test_a_backed_off_move_is_not_retried_until_the_back_off_ends() -> None:
    samples = [sample(120, 0.5), sample(180, 0.51)]
    d = decide(samples, 0.35, S, at(180), effect=_trial(Basis.MEASURED))
    changes = [Change(at(180), 0.35, 0.3, d.reason, 5.0)]
    mem = EffectMemory(backoffs=d.effect.backoffs, faster=fx.UP, faster_time=at(0))
    later = [sample(1000, 0.6), sample(1060, 0.6)]
    held = decide(later, 0.3, S, at(1060), changes, effect=mem)
    assert not held.changed and held.reason == Reason.HOLD_BACKING_OFF
    done = [sample(1380, 0.6), sample(1440, 0.6)]
    assert decide(done, 0.3, S, at(1440), changes, effect=mem).changed


def test_a_trial_for_a_ratio_no_longer_in_force_is_dropped() -> None:
    d = decide(trace([0.38, 0.38]), 0.45, S, at(60), effect=_trial())
    assert d.reason == Reason.HOLD_BAND and d.effect.trial is None


def test_the_quality_guard_ends_a_trial() -> None:
    d = decide(trace([0.9, 0.9], kept=0.9), 0.35, S, at(60), effect=_trial())
    assert d.reason == Reason.QUALITY_GUARD and d.effect.trial is None


# ------------------------------------------------------------------ the guards


def test_single_breach_is_not_enough() -> None:
    d = decide(trace([0.35, 0.9], pred=HELPS), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.HOLD_CONFIRMING


def test_lowers_for_headroom_faster_than_it_raises() -> None:
    d = decide(trace([0.1, 0.1]), 0.4, S, at(60))
    assert d.changed and d.reason == Reason.BELOW_TARGET
    assert d.ratio == pytest.approx(0.3)  # 2 * max_step
    assert d.effect.trial is not None and d.effect.trial.basis == Basis.HEADROOM


@pytest.mark.parametrize("p99", [0.37, 0.4, 0.361])
def test_dead_band_holds(p99: float) -> None:
    d = decide(trace([p99, p99], pred=HELPS), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.HOLD_BAND


def test_cooldown_blocks_then_releases() -> None:
    changes = [Change(at(0), 0.25, 0.3, Reason.ABOVE_TARGET, 5.0)]
    samples = trace([0.6, 0.6, 0.6], pred=HELPS)
    d = decide(samples, 0.3, S, at(119), changes)
    assert not d.changed and d.reason == Reason.HOLD_COOLDOWN
    d = decide(samples, 0.3, S, at(120), changes)
    assert d.changed and d.ratio == pytest.approx(0.35)


def test_bounds_are_respected() -> None:
    faster_up = EffectMemory(faster=fx.UP, faster_time=at(0))
    up = decide(trace([0.9, 0.9]), 0.48, S, at(60), effect=faster_up)
    assert up.ratio == pytest.approx(0.5)
    at_max = decide(trace([0.9, 0.9], pred=HELPS), 0.5, S, at(60))
    assert not at_max.changed and at_max.reason == Reason.NO_PREDICTED_GAIN
    down = decide(trace([0.01, 0.01]), 0.15, S, at(60))
    assert down.ratio == pytest.approx(0.1)
    at_min = decide(trace([0.01, 0.01]), 0.1, S, at(60))
    assert not at_min.changed and at_min.reason == Reason.HOLD_AT_MIN


def test_ratio_outside_new_bounds_is_clamped_at_once() -> None:
    d = decide([], 0.8, S, at(0), effect=_trial())
    assert (
        d.changed
        and d.ratio == 0.5
        and d.reason == Reason.OUTSIDE_BOUNDS
        and d.effect.trial is None
    )


def test_no_samples_holds_and_reports_unavailable() -> None:
    d = decide([], 0.3, S, at(0))
    assert not d.changed and not d.metrics_available and d.metrics_reason == PromReason.NO_DATA


def test_prometheus_error_holds_with_its_reason_and_keeps_the_trial() -> None:
    bad = Sample(time=at(120), error=("PrometheusUnreachable", "connection refused"))
    d = decide([*trace([0.9, 0.9]), bad], 0.35, S, at(120), effect=_trial())
    assert not d.changed and not d.metrics_available
    assert d.metrics_reason == "PrometheusUnreachable"
    assert "connection refused" in d.metrics_message
    assert d.effect.trial is not None  # judged once the metrics are back


def test_nan_latency_with_traffic_is_unavailable() -> None:
    s = Sample(time=at(60), p99_latency=math.nan, request_rate=3.0, missing={})
    d = decide([sample(0, 0.9), s], 0.3, S, at(60))
    assert not d.changed and not d.metrics_available


def test_nan_request_rate_is_unavailable() -> None:
    s = Sample(time=at(0), p99_latency=0.9, request_rate=math.nan, missing={"requestRate": "NaN"})
    d = decide([s], 0.3, S, at(0))
    assert not d.metrics_available and d.metrics_reason == "NaN"


def test_gap_resets_confirmation() -> None:
    samples = [sample(0, 0.9), Sample(time=at(60), error=("Timeout", "t")), sample(120, 0.9)]
    d = decide(samples, 0.3, S, at(120))
    assert not d.changed and d.reason == Reason.HOLD_CONFIRMING


def test_low_traffic_holds_but_metrics_are_available() -> None:
    d = decide(trace([0.9, math.nan], rate=0.05), 0.3, S, at(60))
    assert not d.changed and d.reason == Reason.HOLD_LOW_TRAFFIC and d.metrics_available


def test_never_raises_below_quality_threshold_and_steps_down_fast() -> None:
    changes = [Change(at(50), 0.25, 0.3, Reason.ABOVE_TARGET, 5.0)]  # cooldown would block
    d = decide(trace([0.9, 0.9], kept=0.9, pred=HELPS), 0.3, S, at(60), changes)
    assert d.changed and d.reason == Reason.QUALITY_GUARD
    assert d.ratio == pytest.approx(0.2)


def test_settles_after_replica_change() -> None:
    d = decide(trace([0.9, 0.9], pred=HELPS), 0.3, S, at(60), last_replica_change=at(0))
    assert not d.changed and d.reason == Reason.SETTLING_AFTER_SCALE
    later = trace([0.9, 0.9, 0.9], pred=HELPS)
    assert decide(later, 0.3, S, at(120), last_replica_change=at(0)).changed


def test_a_replica_change_during_a_trial_makes_it_inconclusive() -> None:
    samples = [sample(240, 0.8), sample(300, 0.8)]
    d = decide(samples, 0.35, S, at(300), last_replica_change=at(60), effect=_trial())
    assert d.verdict is not None and d.verdict.outcome == Outcome.INCONCLUSIVE
    assert not d.changed and d.effect.backoffs == ()  # a predicted move stays; no back-off


def test_no_lowering_right_after_a_raise_while_load_is_the_same() -> None:
    changes = [Change(at(0), 0.3, 0.35, Reason.ABOVE_TARGET, 5.0)]
    # 0.34 s: under the dead band (0.36) but not by twice it (0.32).
    samples = [sample(180, 0.34, rate=5.0), sample(240, 0.34, rate=5.0)]
    d = decide(samples, 0.35, S, at(240), changes)
    assert not d.changed and d.reason == Reason.HOLD_LOAD_NOT_LOWER
    # The load fell: lowering is now right.
    samples = [sample(180, 0.34, rate=2.0), sample(240, 0.34, rate=2.0)]
    assert decide(samples, 0.35, S, at(240), changes).changed
    # Latency far under target (twice the dead band): the raise is not needed.
    samples = [sample(180, 0.3, rate=5.0), sample(240, 0.3, rate=5.0)]
    assert decide(samples, 0.35, S, at(240), changes).changed
    # Long after the raise, lowering is allowed whatever the load.
    samples = [sample(1200, 0.34), sample(1260, 0.34)]  # window: 10 cooldowns
    assert decide(samples, 0.35, S, at(1260), changes).changed


def test_format_ratio() -> None:
    assert format_ratio(0.1 + 0.2) == "0.3"
    assert format_ratio(0.35) == "0.35"


def test_noise_inside_the_band_never_moves() -> None:
    p99s = [0.38 + 0.015 * math.sin(i) for i in range(50)]
    for pred in (None, HELPS, HURTS):
        samples = trace(p99s, pred=pred)
        for i in range(len(samples)):
            d = decide(samples[: i + 1], 0.1 if pred is HURTS else 0.3, S, at(60 * i))
            assert not d.changed, d
