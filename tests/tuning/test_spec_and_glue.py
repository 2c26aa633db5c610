"""Pure pieces of the glue: the spec view, query rendering, samples from results,
the status.compression document."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError
from slimspec_operator.resource.queries import QUERIES
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.tuning import guards
from slimspec_operator.tuning import trials as fx
from slimspec_operator.tuning import types as tt
from slimspec_operator.tuning.plan import tuner_settings
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason
from slimspec_operator.tuning.prometheus.queries import (
    queries_for,
    rate_window,
    render_query,
    sample_from,
    vector_values,
)
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.status import (
    changes_from_status,
    compression_status,
    effect_from_status,
    effect_status,
)
from slimspec_operator.tuning.trials import BackOff, Basis, EffectMemory, Outcome, Trial, Verdict

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
    assert q["predictedSpeedup"] == (
        'avg by (ratio) (slimspec_ratio_predicted_speedup{namespace="ns",service="svc"})'
    )
    assert {r.name for r in QUERIES if r.vector_label} <= set(q)
    off = queries_for(TuningView.from_spec({}), "ns", "svc", scaling=True)
    assert "predictedSpeedup" not in off  # the autoscaler alone reads no predictions


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
            "keptAcceptance": PromError(PromReason.NO_DATA, "none"),
        },
    )
    assert s.error is None and s.p99_latency == 0.5 and s.kept_acceptance is None
    assert s.missing == {"keptAcceptance": PromReason.NO_DATA}
    down = sample_from(
        NOW, {"p99Latency": PromError(PromReason.UNREACHABLE, "refused"), "requestRate": 1.0}
    )
    assert down.error == (PromReason.UNREACHABLE, "refused")
    assert (
        guards.decide([down], 0.3, tt.TunerSettings(), NOW).metrics_reason == PromReason.UNREACHABLE
    )


def test_vector_answers_and_predictions() -> None:
    data = {
        "resultType": "vector",
        "result": [
            {"metric": {"ratio": "0.0"}, "value": [1, "2.0"]},
            {"metric": {"ratio": "0.3"}, "value": [1, "2.4"]},
            {"metric": {"ratio": "0.95"}, "value": [1, "NaN"]},  # dropped
        ],
    }
    assert vector_values(data, "ratio", "q") == {"0.0": 2.0, "0.3": 2.4}
    with pytest.raises(PromError) as info:
        vector_values({"resultType": "vector", "result": []}, "ratio", "q")
    assert info.value.reason == PromReason.NO_DATA
    with pytest.raises(PromError) as info:
        vector_values({"resultType": "scalar", "result": [1, "1"]}, "ratio", "q")
    assert info.value.reason == PromReason.BAD_RESPONSE
    s = sample_from(
        NOW,
        {"p99Latency": 0.5, "requestRate": 3.0, "bestRatio": 0.3, "compressionCanHelp": 1.0},
        {
            "predictedSpeedup": {"0.0": 2.0, "0.3": 2.4, "junk": 9.0},
            "ratioKeptAcceptance": PromError(PromReason.NO_DATA, "not measured yet"),
            "compressionCanHelpReason": {"helps": 2.0},
        },
    )
    assert s.predictions is not None and s.error is None
    assert s.predictions.speedup == {0.0: 2.0, 0.3: 2.4} and s.predictions.kept == {}
    assert s.predictions.best == 0.3 and s.predictions.can_help is True
    assert s.predictions.reason is None
    cannot = sample_from(
        NOW,
        {"requestRate": 3.0, "compressionCanHelp": 0.0},  # one measured pod says no
        {"compressionCanHelpReason": {"head_share_small": 1.0, "helps": 1.0}},
    )
    assert cannot.predictions is not None and cannot.predictions.can_help is False
    assert cannot.predictions.reason == "HeadShareTooSmall"
    loss = sample_from(
        NOW,
        {"requestRate": 3.0, "compressionCanHelp": 0.0},
        {"compressionCanHelpReason": {"acceptance_loss": 2.0, "not_measured": 1.0}},
    )
    assert loss.predictions is not None and loss.predictions.reason == "AcceptanceLossOutweighsGain"
    # Every pod still measuring: the can-help query has no series, nothing is known.
    unmeasured = sample_from(
        NOW,
        {"requestRate": 3.0, "compressionCanHelp": PromError(PromReason.NO_DATA, "")},
        {"compressionCanHelpReason": {"not_measured": 2.0}},
    )
    assert unmeasured.predictions is None
    none = sample_from(NOW, {"requestRate": 3.0}, {"predictedSpeedup": PromError("NoData", "")})
    assert none.predictions is None


def test_effect_memory_round_trips_through_status() -> None:
    trial = Trial(NOW, 0.3, 0.35, Basis.PREDICTED, 0.5, 4.0)
    chained = trial.next(NOW, 0.4, 0.52, 4.1)
    verdict = Verdict(trial, NOW, Outcome.WORSE, False, 0.6, 4.0, "worse", 0.3)
    mem = EffectMemory(
        trial=chained,
        last=verdict,
        backoffs=(BackOff(0.3, fx.UP, NOW, 2, Outcome.WORSE),),
        faster=fx.DOWN,
        faster_time=NOW,
    )
    doc = effect_status(mem)
    assert doc["trial"]["originRatio"] == 0.3 and doc["backoff"][0]["direction"] == "up"
    assert (
        doc["lastTrial"]["outcome"] == Outcome.WORSE
        and doc["measuredFaster"]["direction"] == "down"
    )
    back = effect_from_status(doc)
    assert back.trial == chained and back.backoffs == mem.backoffs
    assert back.faster == fx.DOWN and back.faster_time == NOW
    assert back.last is not None and back.last.outcome == Outcome.WORSE and not back.last.keep
    assert effect_from_status({"trial": {"time": "garbage"}, "backoff": [{"from": 1}]}) == (
        EffectMemory()
    )


def test_compression_status_and_history_round_trip() -> None:
    view = TuningView.from_spec({"tuning": {"enabled": True}})
    d = tt.Decision(0.35, True, Reason.ABOVE_TARGET, "p99 high", True)
    sample = tt.Sample(NOW, p99_latency=0.6, request_rate=4.0, kept_acceptance=math.nan)
    st = compression_status({}, 0.3, d, sample, NOW, dry_run=False)
    assert st["ratio"] == 0.35 and st["reason"] == Reason.ABOVE_TARGET
    assert st["lastChangeTime"] == "2026-01-01T12:00:00Z"
    assert st["history"] == [
        {
            "time": "2026-01-01T12:00:00Z",
            "from": 0.3,
            "to": 0.35,
            "reason": Reason.ABOVE_TARGET,
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
    d = tt.Decision(0.35, True, Reason.ABOVE_TARGET, "p99 high", True)
    st = compression_status({"ratio": 0.3}, 0.3, d, tt.Sample(NOW), NOW, dry_run=True)
    assert st["ratio"] == 0.3 and st["history"] == []
    assert st["lastDecision"]["proposedRatio"] == 0.35 and st["lastDecision"]["dryRun"]


def test_history_is_bounded() -> None:
    d = tt.Decision(0.35, True, Reason.ABOVE_TARGET, "", True)
    old = {"history": [{"time": "2026-01-01T00:00:00Z", "from": 0.3, "to": 0.3}] * 20}
    st = compression_status(old, 0.3, d, tt.Sample(NOW), NOW, dry_run=False)
    assert len(st["history"]) == 20 and st["history"][-1]["to"] == 0.35
