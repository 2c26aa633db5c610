"""Latency-driven choice of the compression ratio: a pure function.

`decide(samples, ratio, settings, now, changes, last_replica_change)` looks at the
most recent metric samples and the record of past ratio changes and returns the
ratio to use next and why. No I/O, no clock: the caller passes `now`.

Direction: a larger ratio makes drafting cheaper (lower latency) but may cost
acceptance; a smaller one is the safe side, so it may move faster.

- p99 above target           -> raise by `max_step` (slow, aggressive side),
  only when the kept acceptance is known and at least the quality threshold.
- p99 below target*(1-band)  -> lower by `down_step_factor * max_step` (faster).
- kept acceptance < threshold -> lower fast, ignoring cooldown (quality guard).
- otherwise hold: dead band, cooldown, too little traffic, missing/NaN data,
  settling after a replica change, or a recent raise that neither a lower load
  nor a p99 under target*(1-2*band) says is no longer needed (anti-flap).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .contract import DEFAULT_QUALITY_THRESHOLD

# Reasons (CamelCase, used in status, Events and the MetricsAvailable condition).
RAISED = "LatencyAboveTarget"
LOWERED = "LatencyBelowTarget"
QUALITY_GUARD = "QualityBelowThreshold"
BOUNDS = "OutsideBounds"
HOLD_BAND = "WithinDeadBand"
HOLD_COOLDOWN = "Cooldown"
HOLD_LOW_TRAFFIC = "LowTraffic"
HOLD_SETTLING = "SettlingAfterScale"
HOLD_CONFIRMING = "AwaitingConfirmation"
HOLD_QUALITY_UNKNOWN = "QualityUnknown"
HOLD_AT_MAX = "AtMaxRatio"
HOLD_AT_MIN = "AtMinRatio"
HOLD_LOAD_NOT_LOWER = "LoadNotLower"
NO_METRICS = "NoData"


def clean(value: float | None) -> float | None:
    """NaN/inf readings count as missing."""
    if value is None or not math.isfinite(value):
        return None
    return value


@dataclass(frozen=True)
class Sample:
    """One evaluation's metric readings. None = no data or NaN for that query."""

    time: datetime
    p99_latency: float | None = None
    request_rate: float | None = None
    kept_acceptance: float | None = None
    mean_accepted_length: float | None = None
    fallback_rate: float | None = None
    queue_depth: float | None = None
    # Set when Prometheus could not be asked at all (unreachable, timeout,
    # HTTP or query error): (reason, message). Readings are then meaningless.
    error: tuple[str, str] | None = None
    # Per-query reason for a missing required reading ("NoData", "NotANumber").
    missing: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """One past ratio change (status.compression.history entry)."""

    time: datetime
    from_ratio: float
    to_ratio: float
    reason: str
    request_rate: float | None = None  # load when the change was made


@dataclass(frozen=True)
class TunerSettings:
    latency_target: float = 0.4
    dead_band: float = 0.1  # fraction of the target
    cooldown: float = 120.0  # seconds between changes
    max_step: float = 0.05
    min_ratio: float = 0.1
    max_ratio: float = 0.5
    min_request_rate: float = 0.1
    quality_threshold: float = DEFAULT_QUALITY_THRESHOLD
    # Lowering is the safe side, so it may move faster than raising.
    down_step_factor: float = 2.0
    # Consecutive samples that must agree before a latency-driven move.
    confirmations: int = 2
    # No latency-driven move this long after a replica change (capacity first).
    settle_after_scale: float = 120.0
    # A lower move right after a raise needs the load to have fallen by
    # `dead_band` since that raise, or p99 under target*(1 - 2*dead_band),
    # for this many cooldowns (anti-flap).
    reversal_window_cooldowns: float = 10.0


@dataclass(frozen=True)
class Decision:
    ratio: float
    changed: bool
    reason: str
    message: str
    metrics_available: bool
    metrics_reason: str = "MetricsOK"
    metrics_message: str = ""


def _round(ratio: float) -> float:
    return round(ratio, 4)


def _hold(ratio: float, reason: str, message: str) -> Decision:
    return Decision(ratio, changed=False, reason=reason, message=message, metrics_available=True)


def _unavailable(ratio: float, reason: str, message: str) -> Decision:
    return Decision(
        ratio,
        changed=False,
        reason=reason,
        message=f"holding at {ratio:g}: {message}",
        metrics_available=False,
        metrics_reason=reason,
        metrics_message=message,
    )


def _move(ratio: float, new: float, reason: str, message: str) -> Decision:
    return Decision(
        ratio=_round(new),
        changed=_round(new) != _round(ratio),
        reason=reason,
        message=message,
        metrics_available=True,
    )


def metrics_problem(sample: Sample | None) -> tuple[str, str] | None:
    """Why the latest sample cannot be used, or None when it can."""
    if sample is None:
        return NO_METRICS, "no metrics sample taken yet"
    if sample.error is not None:
        return sample.error
    if clean(sample.request_rate) is None:
        reason = sample.missing.get("requestRate", NO_METRICS)
        return reason, "request rate query returned no usable value"
    return None


def decide(
    samples: Sequence[Sample],
    ratio: float,
    settings: TunerSettings,
    now: datetime,
    changes: Sequence[Change] = (),
    last_replica_change: datetime | None = None,
) -> Decision:
    """Next compression ratio. `samples` and `changes` are oldest first."""
    s = settings
    low, high = s.min_ratio, s.max_ratio
    if ratio < low or ratio > high:
        new = min(max(ratio, low), high)
        return _move(ratio, new, BOUNDS, f"ratio {ratio:g} outside [{low:g}, {high:g}]")

    latest = samples[-1] if samples else None
    problem = metrics_problem(latest)
    if problem is not None or latest is None:
        return _unavailable(ratio, *(problem or (NO_METRICS, "")))
    kept = clean(latest.kept_acceptance)
    down_step = s.max_step * s.down_step_factor

    # Quality guard: safety first, ignores cooldown and traffic.
    if kept is not None and kept < s.quality_threshold:
        if ratio <= low:
            return _hold(ratio, HOLD_AT_MIN, f"kept acceptance {kept:.3f} below threshold, at min")
        new = max(low, ratio - down_step)
        return _move(
            ratio, new, QUALITY_GUARD, f"kept acceptance {kept:.3f} < {s.quality_threshold:g}"
        )

    rate = clean(latest.request_rate) or 0.0
    if rate < s.min_request_rate:
        return _hold(
            ratio, HOLD_LOW_TRAFFIC, f"request rate {rate:.3g}/s < {s.min_request_rate:g}/s"
        )
    p99 = clean(latest.p99_latency)
    if p99 is None:
        reason = latest.missing.get("p99Latency", NO_METRICS)
        return _unavailable(ratio, reason, "p99 latency query returned no usable value")

    if last_replica_change is not None:
        since = (now - last_replica_change).total_seconds()
        if since < s.settle_after_scale:
            return _hold(
                ratio,
                HOLD_SETTLING,
                f"replicas changed {since:.0f}s ago; letting them settle",
            )
    last = changes[-1] if changes else None
    if last is not None:
        since = (now - last.time).total_seconds()
        if since < s.cooldown:
            return _hold(ratio, HOLD_COOLDOWN, f"last change {since:.0f}s ago")

    lower_edge = s.latency_target * (1.0 - s.dead_band)
    recent = _recent_p99(samples, s.confirmations)
    if all(x > s.latency_target for x in recent):
        direction = "up"
    elif all(x < lower_edge for x in recent):
        direction = "down"
    elif p99 > s.latency_target or p99 < lower_edge:
        return _hold(
            ratio, HOLD_CONFIRMING, f"p99 {p99:.3f}s; waiting for {s.confirmations} samples"
        )
    else:
        return _hold(
            ratio,
            HOLD_BAND,
            f"p99 {p99:.3f}s within [{lower_edge:.3f}, {s.latency_target:g}]s",
        )
    if len(recent) < s.confirmations:
        return _hold(
            ratio, HOLD_CONFIRMING, f"p99 {p99:.3f}s; waiting for {s.confirmations} samples"
        )

    if direction == "up":
        if kept is None:
            return _hold(ratio, HOLD_QUALITY_UNKNOWN, "no kept-acceptance reading; not raising")
        if ratio >= high:
            return _hold(ratio, HOLD_AT_MAX, f"p99 {p99:.3f}s above target, at max")
        new = min(high, ratio + s.max_step)
        return _move(ratio, new, RAISED, f"p99 {p99:.3f}s > target {s.latency_target:g}s")

    if ratio <= low:
        return _hold(ratio, HOLD_AT_MIN, f"p99 {p99:.3f}s below target, at min")
    # Headroom of twice the dead band: the raise is clearly no longer needed.
    far_below = p99 < s.latency_target * (1.0 - 2.0 * s.dead_band)
    blocker = None if far_below else _recent_raise_still_needed(changes, rate, s, now)
    if blocker is not None:
        return _hold(
            ratio,
            HOLD_LOAD_NOT_LOWER,
            f"raised to {blocker.to_ratio:g} at {blocker.time:%H:%M:%S} under load "
            f"{blocker.request_rate} req/s; load now {rate:.3g} req/s",
        )
    new = max(low, ratio - down_step)
    return _move(ratio, new, LOWERED, f"p99 {p99:.3f}s < {lower_edge:.3f}s")


def _recent_p99(samples: Sequence[Sample], count: int) -> list[float]:
    """p99 of the last `count` samples, stopping at the first gap (error or no reading)."""
    out: list[float] = []
    for x in reversed(samples):
        p99 = clean(x.p99_latency)
        if len(out) == count or x.error is not None or p99 is None:
            break
        out.append(p99)
    return out


def _recent_raise_still_needed(
    changes: Sequence[Change], rate: float, s: TunerSettings, now: datetime
) -> Change | None:
    """A recent latency raise whose load has not fallen since: lowering would undo it."""
    window = timedelta(seconds=s.cooldown * s.reversal_window_cooldowns)
    for c in reversed(changes):
        if now - c.time > window:
            return None
        if c.reason != RAISED:
            continue
        if c.request_rate is None or rate > c.request_rate * (1.0 - s.dead_band):
            return c
        return None
    return None
