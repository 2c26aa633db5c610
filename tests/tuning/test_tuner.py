"""Unit tests of the pure ratio decision (tuner.decide)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from slimspec_operator import tuner
from slimspec_operator.contract import format_ratio
from slimspec_operator.tuner import Change, Sample, TunerSettings, decide

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


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sample(t: float, p99: float | None, rate: float = 5.0, kept: float | None = 0.99) -> Sample:
    return Sample(time=at(t), p99_latency=p99, request_rate=rate, kept_acceptance=kept)


def trace(p99s: list[float | None], **kw) -> list[Sample]:
    return [sample(60 * i, p, **kw) for i, p in enumerate(p99s)]


def test_raises_by_max_step_after_confirmations() -> None:
    d = decide(trace([0.5, 0.6]), 0.3, S, at(60))
    assert d.changed and d.reason == tuner.RAISED
    assert d.ratio == pytest.approx(0.35)
    assert d.metrics_available


def test_single_breach_is_not_enough() -> None:
    d = decide(trace([0.35, 0.9]), 0.3, S, at(60))
    assert not d.changed and d.reason == tuner.HOLD_CONFIRMING


def test_lowers_faster_than_it_raises() -> None:
    d = decide(trace([0.1, 0.1]), 0.4, S, at(60))
    assert d.changed and d.reason == tuner.LOWERED
    assert d.ratio == pytest.approx(0.3)  # 2 * max_step


@pytest.mark.parametrize("p99", [0.37, 0.4, 0.361])
def test_dead_band_holds(p99: float) -> None:
    d = decide(trace([p99, p99]), 0.3, S, at(60))
    assert not d.changed and d.reason == tuner.HOLD_BAND


def test_cooldown_blocks_then_releases() -> None:
    changes = [Change(at(0), 0.25, 0.3, tuner.RAISED, 5.0)]
    samples = trace([0.6, 0.6, 0.6])
    d = decide(samples, 0.3, S, at(119), changes)
    assert not d.changed and d.reason == tuner.HOLD_COOLDOWN
    d = decide(samples, 0.3, S, at(120), changes)
    assert d.changed and d.ratio == pytest.approx(0.35)


def test_bounds_are_respected() -> None:
    up = decide(trace([0.9, 0.9]), 0.48, S, at(60))
    assert up.ratio == pytest.approx(0.5)
    at_max = decide(trace([0.9, 0.9]), 0.5, S, at(60))
    assert not at_max.changed and at_max.reason == tuner.HOLD_AT_MAX
    down = decide(trace([0.01, 0.01]), 0.15, S, at(60))
    assert down.ratio == pytest.approx(0.1)
    at_min = decide(trace([0.01, 0.01]), 0.1, S, at(60))
    assert not at_min.changed and at_min.reason == tuner.HOLD_AT_MIN


def test_ratio_outside_new_bounds_is_clamped_at_once() -> None:
    d = decide([], 0.8, S, at(0))
    assert d.changed and d.ratio == 0.5 and d.reason == tuner.BOUNDS


def test_no_samples_holds_and_reports_unavailable() -> None:
    d = decide([], 0.3, S, at(0))
    assert not d.changed and not d.metrics_available and d.metrics_reason == tuner.NO_METRICS


def test_prometheus_error_holds_with_its_reason() -> None:
    bad = Sample(time=at(120), error=("PrometheusUnreachable", "connection refused"))
    d = decide([*trace([0.9, 0.9]), bad], 0.3, S, at(120))
    assert not d.changed and not d.metrics_available
    assert d.metrics_reason == "PrometheusUnreachable"
    assert "connection refused" in d.metrics_message


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
    assert not d.changed and d.reason == tuner.HOLD_CONFIRMING


def test_low_traffic_holds_but_metrics_are_available() -> None:
    d = decide(trace([0.9, math.nan], rate=0.05), 0.3, S, at(60))
    assert not d.changed and d.reason == tuner.HOLD_LOW_TRAFFIC and d.metrics_available


def test_never_raises_below_quality_threshold_and_steps_down_fast() -> None:
    changes = [Change(at(50), 0.25, 0.3, tuner.RAISED, 5.0)]  # cooldown would block
    d = decide(trace([0.9, 0.9], kept=0.9), 0.3, S, at(60), changes)
    assert d.changed and d.reason == tuner.QUALITY_GUARD
    assert d.ratio == pytest.approx(0.2)


def test_unknown_quality_blocks_raise_only() -> None:
    up = decide(trace([0.9, 0.9], kept=None), 0.3, S, at(60))
    assert not up.changed and up.reason == tuner.HOLD_QUALITY_UNKNOWN
    down = decide(trace([0.1, 0.1], kept=None), 0.3, S, at(60))
    assert down.changed and down.ratio == pytest.approx(0.2)


def test_settles_after_replica_change() -> None:
    d = decide(trace([0.9, 0.9]), 0.3, S, at(60), last_replica_change=at(0))
    assert not d.changed and d.reason == tuner.HOLD_SETTLING
    d = decide(trace([0.9, 0.9, 0.9]), 0.3, S, at(120), last_replica_change=at(0))
    assert d.changed


def test_no_lowering_right_after_a_raise_while_load_is_the_same() -> None:
    changes = [Change(at(0), 0.3, 0.35, tuner.RAISED, 5.0)]
    # 0.34 s: under the dead band (0.36) but not by twice it (0.32).
    samples = [sample(180, 0.34, rate=5.0), sample(240, 0.34, rate=5.0)]
    d = decide(samples, 0.35, S, at(240), changes)
    assert not d.changed and d.reason == tuner.HOLD_LOAD_NOT_LOWER
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


def _run_closed_loop(load: list[float], s: TunerSettings, noise: list[float]) -> list[float]:
    """Simulate an engine whose p99 grows with load and falls with the ratio."""
    ratio, samples, changes, ratios = 0.3, [], [], []
    for i, (rps, eps) in enumerate(zip(load, noise, strict=True)):
        now = at(60 * i)
        p99 = 0.1 * rps * (1.0 - 0.8 * ratio) + eps
        samples.append(Sample(now, p99, rps, 0.99))
        d = decide(samples[-5:], ratio, s, now, changes)
        if d.changed:
            changes.append(Change(now, ratio, d.ratio, d.reason, rps))
            ratio = d.ratio
        ratios.append(ratio)
    return ratios


def test_no_oscillation_over_a_scripted_trace() -> None:
    # Quiet, then a load surge (p99 over target), then quiet again; +-3% noise.
    load = [3.0] * 10 + [5.5] * 30 + [3.0] * 30
    noise = [0.012 * math.sin(i * 2.3) for i in range(len(load))]
    ratios = _run_closed_loop(load, S, noise)
    quiet, surge, after = ratios[:10], ratios[10:40], ratios[40:]
    assert quiet[-1] == 0.1  # low latency: went to the safe side
    assert surge == sorted(surge) and surge[-1] > 0.3  # only up while p99 > target
    assert surge[-10:] == [surge[-1]] * 10  # settled under sustained load, no flapping
    assert after == sorted(after, reverse=True) and after[-1] == 0.1  # only down after


def test_noise_inside_the_band_never_moves() -> None:
    p99s = [0.38 + 0.015 * math.sin(i) for i in range(50)]
    samples = trace(p99s)
    ratio = 0.3
    for i in range(len(samples)):
        d = decide(samples[: i + 1], ratio, S, at(60 * i))
        assert not d.changed, d


def _changes_on_a_steep_plant(s: TunerSettings) -> int:
    """Steady load; one ratio step moves p99 across the whole dead band."""
    ratio, samples, changes = 0.3, [], []
    for i in range(60):
        now = at(60 * i)
        p99 = 0.42 if ratio < 0.325 else 0.34
        samples.append(Sample(now, p99, 5.0, 0.99))
        d = decide(samples[-5:], ratio, s, now, changes)
        if d.changed:
            changes.append(Change(now, ratio, d.ratio, d.reason, 5.0))
            ratio = d.ratio
    return len(changes)


def test_reversal_guard_stops_flapping_on_a_steep_plant() -> None:
    from dataclasses import replace

    unguarded = _changes_on_a_steep_plant(replace(S, reversal_window_cooldowns=0))
    guarded = _changes_on_a_steep_plant(S)
    assert unguarded >= 25  # without the guard: a change every other cooldown
    # With it: a raise, then one probe of the lower ratio per reversal window.
    assert guarded <= 8
