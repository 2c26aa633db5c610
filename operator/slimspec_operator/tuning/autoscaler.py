"""Replica count from load: a pure function (KEDA's ScaledObject: keda.py).

`decide(...)` follows the HPA's shape: a raw recommendation
ceil(requestRate / targetRequestsPerReplica) (and, when set, the queue-depth
rule), clamped to [minReplicas, maxReplicas]; scale up at once; scale down only
to the highest recommendation seen over the stabilisation window, and only once
the window is covered by observations (so an operator restart never scales down
on a fresh, empty memory).

Interaction with ratio tuning: scale-down waits `settle_after_ratio` seconds
after a ratio change (the latency drop may be the ratio's doing); scale-up is
never delayed (overload is worse than a fight). The tuner, in turn, holds the
ratio for a while after any replica change (types.TunerSettings.settle_after_scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.types import Sample, clean


@dataclass(frozen=True)
class Recommendation:
    """The replica count one tick found right; the largest of the stabilization
    window's recommendations is the one acted on (scaling down waits for it)."""

    time: datetime
    replicas: int


@dataclass(frozen=True)
class AutoscalerSettings:
    min_replicas: int = 1
    max_replicas: int = 4
    target_requests_per_replica: float = 2.0
    target_queue_depth: float | None = None
    stabilization_window: float = 300.0
    settle_after_ratio: float = 120.0


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    changed: bool
    reason: str
    message: str
    metrics_available: bool
    # Recommendations to keep for the next call (pruned to the window).
    recommendations: tuple[Recommendation, ...] = ()


def recommend(sample: Sample, replicas: int, s: AutoscalerSettings) -> int | None:
    """Raw, clamped replica recommendation for one sample; None if data is missing."""
    rate = clean(sample.request_rate)
    if sample.error is not None or rate is None:
        return None
    want = math.ceil(rate / s.target_requests_per_replica - 1e-9)
    if s.target_queue_depth is not None:
        depth = clean(sample.queue_depth)
        if depth is None:
            return None
        # Average depth per pod scales inversely with the pod count.
        want = max(want, math.ceil(max(replicas, 1) * depth / s.target_queue_depth - 1e-9))
    return min(max(want, s.min_replicas), s.max_replicas)


def decide(
    sample: Sample | None,
    replicas: int,
    settings: AutoscalerSettings,
    now: datetime,
    recommendations: tuple[Recommendation, ...] = (),  # the last decision's, as it gave them
    last_ratio_change: datetime | None = None,
    observing_since: datetime | None = None,
) -> ScaleDecision:
    """Replica count to set. `observing_since`: when this controller started watching."""
    s = settings
    window = timedelta(seconds=s.stabilization_window)
    kept = tuple(r for r in recommendations if now - r.time <= window)
    if replicas < s.min_replicas or replicas > s.max_replicas:
        new = min(max(replicas, s.min_replicas), s.max_replicas)
        msg = f"replicas {replicas} outside [{s.min_replicas}, {s.max_replicas}]"
        return ScaleDecision(new, True, Reason.OUTSIDE_BOUNDS, msg, sample is not None, kept)

    want = recommend(sample, replicas, s) if sample is not None else None
    if want is None:
        reason = sample.error[0] if sample is not None and sample.error else PromReason.NO_DATA
        msg = "holding: no usable load metrics"
        return ScaleDecision(replicas, False, reason, msg, False, kept)
    kept = (*kept, Recommendation(now, want))

    if want > replicas:
        rate = clean(sample.request_rate) if sample else None
        msg = f"{rate:.3g} req/s needs {want} replicas"
        return ScaleDecision(want, True, Reason.SCALED_UP, msg, True, kept)

    # Scale down to the highest recommendation over the window, once the window
    # is covered by observations.
    stable = max(r.replicas for r in kept)
    if stable >= replicas:
        if want < replicas:
            msg = f"recommendation {want}; highest over the window is {stable}"
            return ScaleDecision(replicas, False, Reason.HOLD_STABILISING, msg, True, kept)
        return ScaleDecision(
            replicas, False, Reason.HOLD_STEADY, f"recommendation {want}", True, kept
        )
    start = observing_since or (kept[0].time if kept else now)
    if now - start < window:
        msg = f"recommendation {want}; window not yet covered ({(now - start).seconds}s)"
        return ScaleDecision(replicas, False, Reason.HOLD_STABILISING, msg, True, kept)
    if last_ratio_change is not None:
        since = (now - last_ratio_change).total_seconds()
        if since < s.settle_after_ratio:
            msg = f"ratio changed {since:.0f}s ago; not scaling down yet"
            return ScaleDecision(
                replicas, False, Reason.SETTLING_AFTER_RATIO_CHANGE, msg, True, kept
            )
    msg = f"highest recommendation over {s.stabilization_window:g}s is {stable}"
    return ScaleDecision(stable, True, Reason.SCALED_DOWN, msg, True, kept)
