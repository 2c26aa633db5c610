"""Verdicts on exact means over alternated windows (tuning/verdict.py), and the
false-move rate of the rule on A/A sequences (noise and drift, no effect), the
figure docs/tuning.md states."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from slimspec_operator.tuning import verdict as vd
from slimspec_operator.tuning.verdict import Point, Window

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TICK = 60.0  # seconds between two samples (intervalSeconds)
PARTS, SPAN = 2, 120.0  # confirmations, cooldown: the tuner's defaults
TOKENS = 600.0  # generated per tick (3 clients, ~3.5 s requests of 40 tokens)


def at(i: float) -> datetime:
    return T0 + timedelta(seconds=TICK * i)


def series(per_token: Callable[[int], float], ticks: int, start: int = 0) -> list[Point]:
    """Cumulative totals from each tick's mean latency per token."""
    lat, tok, out = 1000.0, 5000.0, [Point(at(start), 1000.0, 5000.0, 3.5, 1.0)]
    for i in range(start + 1, start + ticks + 1):
        tok += TOKENS
        lat += TOKENS * per_token(i)
        out.append(Point(at(i), lat, tok, 3.5, 1.0))
    return out


def test_a_window_is_the_exact_mean_from_the_totals() -> None:
    pts = series(lambda i: 0.080 if i <= 2 else 0.090, 6)
    w = vd.window(pts, 0.3, at(0), PARTS, SPAN)  # the tick of the switch is left out
    assert w is not None and w.start == at(1) and w.end == at(3)
    assert w.parts == pytest.approx((0.080, 0.090))
    assert w.mean == pytest.approx(0.085)
    # not before it has `parts` parts over `span` seconds
    assert vd.window(pts[:3], 0.3, at(0), PARTS, SPAN) is None
    # the window before a move ends at the last tick
    last = vd.window(pts, 0.3, None, PARTS, SPAN, latest=True)
    assert last is not None and (last.start, last.end) == (at(4), at(6))
    assert last.mean == pytest.approx(0.090)


def test_a_window_starts_anew_after_a_gap_or_a_counter_reset() -> None:
    pts = series(lambda i: 0.08, 8)
    gap = [*pts[:3], Point(at(3), None, None), *pts[4:]]
    w = vd.window(gap, 0.3, at(0), PARTS, SPAN)
    assert w is not None and w.start == at(4)
    # a pod's counters restart at tick 2: the totals fall, then grow again from there
    drop_l, drop_t = (pts[2].latency_s or 0.0) - 10.0, (pts[2].tokens or 0.0) - 100.0
    reset = [
        *pts[:2],
        *[
            Point(p.time, (p.latency_s or 0.0) - drop_l, (p.tokens or 0.0) - drop_t)
            for p in pts[2:]
        ],
    ]
    w = vd.window(reset, 0.3, at(0), PARTS, SPAN)
    assert w is not None and w.start == at(2) and w.mean == pytest.approx(0.08)
    idle = [*pts[:2], Point(at(2), pts[1].latency_s, pts[1].tokens), *pts[3:]]
    w = vd.window(idle, 0.3, at(0), PARTS, SPAN)  # a tick without tokens is no part
    assert w is not None and len(w.parts) >= PARTS


def win(ratio: float, parts: tuple[float, ...], p99: float = 3.5, rate: float = 1.0) -> Window:
    return Window(ratio, T0, T0, sum(parts) / len(parts), parts, p99, rate)


def test_better_worse_and_held() -> None:
    a1, a2 = win(0.3, (0.100, 0.102)), win(0.3, (0.101, 0.099))
    faster = vd.compare(a1, win(0.4, (0.090, 0.091)), a2)
    assert faster.effect == pytest.approx(-0.1, abs=0.01) and faster.dof == 3
    assert vd.rule(faster, 0.1, 0.2)[0] == vd.BETTER
    slower = vd.compare(a1, win(0.4, (0.110, 0.112)), a2)
    assert vd.rule(slower, 0.1, 0.2)[0] == vd.WORSE
    same = vd.compare(a1, win(0.4, (0.101, 0.100)), a2)
    assert vd.rule(same, 0.1, 0.2)[0] == vd.HELD
    # the floor: a 1 % effect is held however quiet the windows
    quiet = vd.compare(win(0.3, (0.1, 0.1)), win(0.4, (0.099, 0.099)), win(0.3, (0.1, 0.1)))
    assert quiet.margin == vd.DEFAULT_FLOOR and vd.rule(quiet, 0.1, 0.2)[0] == vd.HELD
    # noisy windows widen the margin: the same 10 % is not enough there
    noisy = vd.compare(win(0.3, (0.08, 0.12)), win(0.4, (0.07, 0.11)), win(0.3, (0.12, 0.08)))
    assert vd.rule(noisy, 0.1, 0.2)[0] == vd.HELD
    # faster on the mean with p99 well up: held; faster with the load fallen: the load
    tail = vd.compare(a1, win(0.4, (0.090, 0.091), p99=4.5), a2)
    assert vd.rule(tail, 0.1, 0.2)[0] == vd.HELD
    lighter = vd.compare(a1, win(0.4, (0.090, 0.091), rate=0.8), a2)
    assert vd.rule(lighter, 0.1, 0.2)[0] == vd.WITH_LOAD


def test_a_ratio_against_itself_is_held() -> None:
    # A/A: the same ratio on both sides (or one that changes nothing) measures the
    # same: held, however quiet or noisy the windows
    for parts in ((0.1, 0.1), (0.09, 0.11), (0.08, 0.12, 0.1)):
        same = vd.compare(win(0.3, parts), win(0.3, parts), win(0.3, parts))
        assert same.effect == pytest.approx(0.0) and vd.rule(same, 0.1, 0.2)[0] == vd.HELD


def test_linear_drift_cancels() -> None:
    # The machine slows 1 % a tick and the ratio does nothing: before/after alone
    # reads +3 % (a revert); before/after/before again reads nothing.
    pts = series(lambda i: 0.08 * (1 + 0.01 * i), 9)
    before = vd.window(pts[:4], 0.3, None, PARTS, SPAN, latest=True)
    after = vd.window(pts, 0.4, at(3), PARTS, SPAN)
    again = vd.window(pts, 0.3, at(6), PARTS, SPAN)
    assert before and after and again
    assert after.mean / before.mean - 1 > 0.025
    p = vd.compare(before, after, again)
    assert abs(p.effect) < 1e-3 and vd.rule(p, 0.1, 0.2)[0] == vd.HELD


# ------------------------------------------------------------------ A/A


def aa_rates(
    trials: int, seed: int, noise: float, walk: float, parts: int = PARTS
) -> tuple[float, float]:
    """(false keeps, false reverts) per trial on A/A sequences, through the tuner's own
    windows: each tick's mean per token = base x (1 + drift + noise x N(0, 1)), the
    drift a random walk of `walk` per tick (the machine's slow wander), the ratio
    doing nothing. A trial: `parts` ticks before, the switch, one tick of settling
    and `parts` at the new ratio, the switch back, one tick and `parts` again."""
    rng = random.Random(seed)
    keeps = reverts = 0
    n = 3 * parts + 3
    for _ in range(trials):
        drift = [0.0]
        for _ in range(n):
            drift.append(drift[-1] + rng.gauss(0.0, walk))
        noise_at = [rng.gauss(0.0, noise) for _ in range(n + 1)]
        pts = series(lambda i: 0.08 * (1 + drift[i] + noise_at[i]), n)  # noqa: B023
        move, back = parts, 2 * parts + 1  # ticks of the two switches
        before = vd.window(pts[: move + 1], 0.3, None, parts, 0.0, latest=True)
        after = vd.window(pts, 0.4, at(move), parts, 0.0)
        again = vd.window(pts, 0.3, at(back), parts, 0.0)
        assert before and after and again
        what, _ = vd.rule(vd.compare(before, after, again), 0.1, 0.2)
        keeps += what == vd.BETTER
        reverts += what == vd.WORSE
    return keeps / trials, reverts / trials


# A tick's mean per token at 3 clients: ~50 requests a minute whose latencies spread
# ~20 %: 3 % per tick. The drift: this machine moved 3.5 % over a 17-minute run with
# the ratio fixed; a random walk of 1 % a tick is worse than that.
NOISE, WALK = 0.03, 0.01


def test_a_a_windows_rarely_move_at_the_documented_rate() -> None:
    # docs/tuning.md: a false keep (the only false *move*: a trial not kept is
    # already back at its old ratio) in 2.5 % of A/A trials, 2.6 % with the drift,
    # and as many false "worse" verdicts, which move nothing
    keeps, reverts = aa_rates(4000, seed=7, noise=NOISE, walk=WALK)
    assert keeps <= 0.03 and reverts <= 0.03
    quiet_keeps, quiet_reverts = aa_rates(4000, seed=8, noise=NOISE, walk=0.0)
    assert quiet_keeps <= 0.03 and quiet_reverts <= 0.03  # t's 2.5 % on each side


def test_a_real_effect_is_seen() -> None:
    # the same noise, the new ratio 8 % faster: kept in most trials
    rng = random.Random(3)
    kept = 0
    for _ in range(400):
        shift = [rng.gauss(0.0, NOISE) for _ in range(10)]
        pts = series(lambda i: 0.08 * (0.92 if 3 <= i <= 5 else 1.0) * (1 + shift[i]), 9)  # noqa: B023
        before = vd.window(pts[:3], 0.3, None, PARTS, 0.0, latest=True)
        after = vd.window(pts, 0.4, at(2), PARTS, 0.0)
        again = vd.window(pts, 0.3, at(5), PARTS, 0.0)
        assert before and after and again
        kept += vd.rule(vd.compare(before, after, again), 0.1, 0.2)[0] == vd.BETTER
    assert kept / 400 > 0.5
    assert math.isinf(vd.t975(0)) and vd.t975(3) == pytest.approx(3.182)
