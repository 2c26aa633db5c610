"""Unit tests of the pure replica decision and the KEDA ScaledObject builder."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from slimspec_operator.tuning.autoscaler import AutoscalerSettings, Recommendation, decide
from slimspec_operator.tuning.keda import scaled_object
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.types import Sample

T0 = datetime(2026, 1, 1, tzinfo=UTC)
S = AutoscalerSettings(
    min_replicas=1,
    max_replicas=4,
    target_requests_per_replica=2.0,
    stabilization_window=300,
    settle_after_ratio=120,
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def load(t: float, rate: float | None, depth: float | None = None) -> Sample:
    return Sample(time=at(t), request_rate=rate, queue_depth=depth)


def test_scales_up_at_once_and_clamps_to_max() -> None:
    d = decide(load(0, 5.0), 1, S, at(0), observing_since=at(0))
    assert d.changed and d.replicas == 3 and d.reason == Reason.SCALED_UP
    d = decide(load(0, 50.0), 1, S, at(0), observing_since=at(0))
    assert d.replicas == 4


def test_exact_multiple_does_not_round_up() -> None:
    d = decide(load(0, 4.0), 2, S, at(0), observing_since=at(0))
    assert not d.changed and d.replicas == 2


def test_scale_down_waits_for_the_window_and_uses_its_highest_recommendation() -> None:
    recs: tuple[Recommendation, ...] = ()
    replicas = 4
    history = []
    # 8 req/s for a while, then 1 req/s.
    for t in range(0, 900, 30):
        rate = 8.0 if t < 300 else 1.0
        d = decide(load(t, rate), replicas, S, at(t), recs, observing_since=at(0))
        recs, replicas = d.recommendations, d.replicas
        history.append((t, replicas, d.reason))
    first_down = next(t for t, r, _ in history if r < 4)
    assert first_down >= 300 + 300  # the window of high recommendations had to pass
    assert replicas == 1
    assert all(r.time >= at(870 - 300) for r in recs)  # pruned to the window


def test_fresh_memory_never_scales_down() -> None:
    # An operator restart: one low reading, no history. The window is not covered.
    d = decide(load(1000, 0.5), 3, S, at(1000), (), observing_since=at(1000))
    assert not d.changed and d.reason == Reason.HOLD_STABILISING


@pytest.mark.parametrize(
    "sample",
    [
        None,
        Sample(time=T0, error=("PrometheusUnreachable", "refused")),
        Sample(time=T0, request_rate=math.nan),
        Sample(time=T0, request_rate=None),
    ],
)
def test_holds_on_missing_data(sample: Sample | None) -> None:
    d = decide(sample, 3, S, at(1000), observing_since=at(0))
    assert not d.changed and d.replicas == 3 and not d.metrics_available


def test_bounds_changed_moves_into_them() -> None:
    d = decide(load(0, 0.0), 7, S, at(0))
    assert d.changed and d.replicas == 4 and d.reason == Reason.OUTSIDE_BOUNDS
    d = decide(None, 0, S, at(0))
    assert d.replicas == 1


def test_min_replicas_floor() -> None:
    recs = tuple(Recommendation(at(t), 1) for t in range(0, 400, 30))
    d = decide(load(400, 0.0), 2, S, at(400), recs, observing_since=at(0))
    assert d.changed and d.replicas == 1


def test_scale_down_waits_after_a_ratio_change_scale_up_does_not() -> None:
    recs = tuple(Recommendation(at(t), 1) for t in range(0, 400, 30))
    d = decide(
        load(400, 0.5), 3, S, at(400), recs, last_ratio_change=at(350), observing_since=at(0)
    )
    assert not d.changed and d.reason == Reason.SETTLING_AFTER_RATIO_CHANGE
    d = decide(
        load(400, 7.0), 3, S, at(400), recs, last_ratio_change=at(350), observing_since=at(0)
    )
    assert d.changed and d.replicas == 4


def test_queue_depth_rule() -> None:
    s = AutoscalerSettings(min_replicas=1, max_replicas=8, target_queue_depth=4.0)
    d = decide(load(0, 0.5, depth=10.0), 2, s, at(0), observing_since=at(0))
    assert d.replicas == 5  # 2 pods * 10 queued / 4 per pod
    d = decide(load(0, 0.5, depth=None), 2, s, at(0), observing_since=at(0))
    assert not d.changed and not d.metrics_available


def test_scaled_object_shape() -> None:
    so = scaled_object(
        name="svc",
        namespace="ns",
        owner_uid="uid-1",
        prometheus_url="http://prom:9090",
        request_rate_query="sum(rate(x[2m]))",
        settings=S,
    )
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "slimspec.io/v1alpha1",
        "kind": "SlimSpecService",
        "name": "svc",
    }
    trig = so["spec"]["triggers"][0]
    assert trig["type"] == "prometheus"
    assert all(isinstance(v, str) for v in trig["metadata"].values())
    assert trig["metadata"]["threshold"] == "2"
    assert so["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert so["spec"]["minReplicaCount"] == 1 and so["spec"]["maxReplicaCount"] == 4
