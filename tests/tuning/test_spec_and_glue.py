"""Pure pieces of the glue: the spec view, query rendering, samples from results,
the status.compression document."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError
from slimspec_operator import prom, tuner
from slimspec_operator.prom import PromError
from slimspec_operator.queries import queries_for, rate_window, render_query, sample_from
from slimspec_operator.spec import TuningView
from slimspec_operator.tuning_plan import changes_from_status, compression_status, tuner_settings

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def test_defaults_match_the_agreed_resource_shape() -> None:
    v = TuningView.from_spec({})
    assert (v.compression.ratio, v.compression.min_ratio, v.compression.max_ratio) == (
        0.3,
        0.1,
        0.5,
    )
    t = v.tuning
    assert not t.enabled and t.interval_seconds == 60 and t.latency_target_seconds == 0.4
    assert (t.dead_band, t.cooldown_seconds, t.max_step, t.min_request_rate) == (
        0.1,
        120,
        0.05,
        0.1,
    )
    a = v.autoscaling
    assert (a.enabled, a.mode, a.min_replicas, a.max_replicas) == (False, "operator", 1, 4)
    assert a.target_requests_per_replica == 2.0 and a.stabilization_window_seconds == 300
    assert v.quality_control.threshold == 0.95


def test_camel_case_spec_and_partial_queries() -> None:
    v = TuningView.from_spec(
        {
            "model": {"version": "v1"},  # other fields are ignored
            "tuning": {"enabled": True, "queries": {"p99Latency": 'my_p99{a="{service}"}'}},
            "autoscaling": None,
        }
    )
    q = queries_for(v, "ns", "svc", scaling=False)
    assert q["p99Latency"] == 'my_p99{a="svc"}'
    assert 'namespace="ns",service="svc"' in q["requestRate"]
    assert "[120s]" in q["requestRate"]  # two 60 s intervals
    assert "queueDepth" not in q


def test_invalid_specs_are_rejected() -> None:
    with pytest.raises(ValidationError):
        TuningView.from_spec({"compression": {"minRatio": 0.6, "maxRatio": 0.5}})
    with pytest.raises(ValidationError):
        TuningView.from_spec({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})


def test_rate_window_and_render() -> None:
    assert rate_window(60) == "120s" and rate_window(2) == "10s"
    assert render_query('x{a="{namespace}"}[{window}]', "n", "s", "9s") == 'x{a="n"}[9s]'


def test_sample_from_results() -> None:
    s = sample_from(
        NOW,
        {
            "p99Latency": 0.5,
            "requestRate": 3.0,
            "keptAcceptance": PromError(prom.NO_DATA, "none"),
        },
    )
    assert s.error is None and s.p99_latency == 0.5 and s.kept_acceptance is None
    assert s.missing == {"keptAcceptance": prom.NO_DATA}
    down = sample_from(
        NOW, {"p99Latency": PromError(prom.UNREACHABLE, "refused"), "requestRate": 1.0}
    )
    assert down.error == (prom.UNREACHABLE, "refused")
    assert tuner.decide([down], 0.3, tuner.TunerSettings(), NOW).metrics_reason == prom.UNREACHABLE


def test_compression_status_and_history_round_trip() -> None:
    view = TuningView.from_spec({"tuning": {"enabled": True}})
    d = tuner.Decision(0.35, True, tuner.RAISED, "p99 high", True)
    sample = tuner.Sample(NOW, p99_latency=0.6, request_rate=4.0, kept_acceptance=math.nan)
    st = compression_status({}, 0.3, d, sample, NOW, dry_run=False)
    assert st["ratio"] == 0.35 and st["reason"] == tuner.RAISED
    assert st["lastChangeTime"] == "2026-01-01T12:00:00Z"
    assert st["history"] == [
        {
            "time": "2026-01-01T12:00:00Z",
            "from": 0.3,
            "to": 0.35,
            "reason": tuner.RAISED,
            "requestRate": 4.0,
            "p99LatencySeconds": 0.6,
        }
    ]
    assert "keptAcceptance" not in st["observed"]  # NaN is not written
    # The CRD may prune requestRate from history items: lastRaise still has it.
    pruned = {**st, "history": [{k: v for k, v in st["history"][0].items() if k != "requestRate"}]}
    (change,) = changes_from_status(pruned)
    assert change.request_rate == 4.0 and change.time == NOW
    assert tuner_settings(view).settle_after_scale == view.tuning.cooldown_seconds


def test_dry_run_changes_nothing_but_says_what_it_would_do() -> None:
    d = tuner.Decision(0.35, True, tuner.RAISED, "p99 high", True)
    st = compression_status({"ratio": 0.3}, 0.3, d, tuner.Sample(NOW), NOW, dry_run=True)
    assert st["ratio"] == 0.3 and st["history"] == []
    assert st["lastDecision"]["proposedRatio"] == 0.35 and st["lastDecision"]["dryRun"]


def test_history_is_bounded() -> None:
    d = tuner.Decision(0.35, True, tuner.RAISED, "", True)
    old = {"history": [{"time": "2026-01-01T00:00:00Z", "from": 0.3, "to": 0.3}] * 20}
    st = compression_status(old, 0.3, d, tuner.Sample(NOW), NOW, dry_run=False)
    assert len(st["history"]) == 20 and st["history"][-1]["to"] == 0.35
