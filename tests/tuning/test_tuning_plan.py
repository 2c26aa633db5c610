"""Unit tests of one tuning tick as a pure plan (tuning/plan.py plan_tick): plain
inputs, no cluster, no Prometheus. The same ticks run against the real API server
and a real Prometheus in test_handlers_cluster.py."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.rollout.plan import Event
from slimspec_operator.tuning.plan import (
    SAMPLES_KEPT,
    TickInput,
    TickMemory,
    TickPlan,
    controlling,
    due,
    plan_tick,
)
from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.types import Sample

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def view(**spec: Any) -> TuningView:
    base: dict[str, Any] = {
        "tuning": {"enabled": True, "intervalSeconds": 10, "cooldownSeconds": 60},
    }
    return TuningView.from_spec(base | spec)


GRID = [round(0.05 * i, 2) for i in range(20)]
HELPS = Predictions(speedup={r: 1.5 + r for r in GRID}, can_help=True)  # higher is faster
CANNOT = Predictions(
    speedup={r: 2.0 - r for r in GRID}, head_share=dict.fromkeys(GRID, 0.05), can_help=False
)


def reading(
    t: float,
    p99: float | None = 0.6,
    rate: float | None = 5.0,
    kept: float | None = 0.99,
    pred: Predictions | None = HELPS,
) -> Sample:
    return Sample(
        time=at(t), p99_latency=p99, request_rate=rate, kept_acceptance=kept, predictions=pred
    )


def run(
    v: TuningView,
    samples: list[Sample],
    status: dict[str, Any] | None = None,
    memory: TickMemory | None = None,
    dry_run: bool = False,
) -> TickPlan:
    """Tick once per sample, carrying memory and status over as the executor would."""
    mem = memory or TickMemory(started=T0)
    status = dict(status or {})
    plan = None
    for s in samples:
        plan = plan_tick(TickInput(v, status, 1, s, mem, s.time, dry_run))
        mem = plan.memory
        status |= plan.status or {}
    assert plan is not None
    return plan


def reason(plan: TickPlan) -> str:
    assert plan.status is not None
    return plan.status["compression"]["lastDecision"]["reason"]


def condition(plan: TickPlan, kind: str = "MetricsAvailable") -> dict[str, Any]:
    assert plan.status is not None
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == kind]
    return cond


def test_two_samples_over_target_raise_by_one_step_and_announce_it() -> None:
    first = run(view(), [reading(0)])
    assert reason(first) == Reason.HOLD_CONFIRMING and first.ratio is None
    plan = run(view(), [reading(0), reading(10)])
    assert plan.status is not None
    comp = plan.status["compression"]
    assert comp["ratio"] == pytest.approx(0.35) and comp["reason"] == Reason.ABOVE_TARGET
    assert comp["lastChangeTime"] == "2026-01-01T12:00:10Z"
    assert comp["history"][-1]["from"] == 0.3 and comp["history"][-1]["to"] == 0.35
    assert plan.ratio is not None and plan.ratio.text == "0.35"  # the ConfigMap's text
    assert plan.ratio.event.reason == "CompressionChanged"
    assert plan.scale is None  # ratio tuning never touches replicas
    assert len(plan.memory.samples) == 2 and plan.memory.active


def test_prometheus_down_holds_says_why_once_and_writes_nothing_else() -> None:
    down = Sample(time=at(0), error=(PromReason.UNREACHABLE, "connection refused"))
    plan = run(view(), [down], status={"compression": {"ratio": 0.4}})
    assert plan.status is not None
    assert plan.status["compression"]["ratio"] == 0.4
    assert plan.ratio is None and plan.scale is None
    cond = condition(plan)
    assert (cond["status"], cond["reason"]) == ("False", PromReason.UNREACHABLE)
    assert plan.events == (Event("Warning", "MetricsUnavailable", "connection refused"),)
    # Still down on the next tick: no new Event (the condition did not flip).
    again = plan_tick(
        TickInput(view(), plan.status, 1, replace(down, time=at(10)), plan.memory, at(10))
    )
    assert again.events == ()


def test_no_series_is_no_data() -> None:
    empty = Sample(time=at(0), missing={"requestRate": PromReason.NO_DATA})
    plan = run(view(), [empty])
    assert condition(plan)["reason"] == PromReason.NO_DATA
    assert reason(plan) == PromReason.NO_DATA and plan.ratio is None


def test_dead_band_holds() -> None:
    plan = run(view(), [reading(0, p99=0.38), reading(10, p99=0.37)])
    assert reason(plan) == Reason.HOLD_BAND and plan.ratio is None
    assert condition(plan)["status"] == "True"


def test_a_change_is_measured_through_the_cooldown_then_confirmed_and_the_next_follows() -> None:
    plan = run(view(), [reading(0), reading(10), reading(20), reading(30)])
    assert reason(plan) == Reason.HOLD_MEASURING and plan.ratio is None
    assert plan.status is not None
    trial = plan.status["compression"]["trial"]
    assert (trial["from"], trial["to"], trial["basis"]) == (0.3, 0.35, "predicted")
    # Cooldown (60 s) passed and two samples since: p99 did not get worse, kept.
    judged = run(view(), [reading(t) for t in (0, 10, 20, 30, 70, 80)])
    assert reason(judged) == Reason.CONFIRMED and judged.ratio is None
    assert judged.status is not None
    comp = judged.status["compression"]
    assert "trial" not in comp and comp["lastTrial"]["kept"] is True
    assert [e.reason for e in judged.events] == [Reason.CONFIRMED]
    nxt = run(view(), [reading(t) for t in (0, 10, 20, 30, 70, 80, 90)])
    assert nxt.ratio is not None and nxt.ratio.text == "0.4"


def test_a_change_that_made_latency_worse_is_reverted_with_a_warning() -> None:
    samples = [reading(0), reading(10), reading(70, p99=0.8), reading(80, p99=0.8)]
    plan = run(view(), samples)
    assert plan.ratio is not None and plan.ratio.text == "0.3"
    assert plan.ratio.event.type == "Warning"
    assert plan.ratio.event.reason == Reason.REVERTED_WORSE
    assert plan.status is not None
    comp = plan.status["compression"]
    assert comp["reason"] == Reason.REVERTED_WORSE and comp["history"][-1]["to"] == 0.3
    assert comp["lastTrial"]["outcome"] == "Worse" and comp["lastTrial"]["kept"] is False
    (backoff,) = comp["backoff"]
    assert (backoff["from"], backoff["direction"]) == (0.3, "up")
    assert backoff["until"] == "2026-01-01T12:11:20Z"  # 10 cooldowns later
    # Later, still over target: the same raise is not tried again yet.
    again = run(view(), [*samples, reading(150), reading(160)])
    assert reason(again) == Reason.HOLD_BACKING_OFF and again.ratio is None


def test_compression_effective_condition_follows_the_predictions() -> None:
    plan = run(view(), [reading(0)])
    assert condition(plan, "CompressionEffective")["status"] == "True"
    assert plan.status is not None
    preds = plan.status["compression"]["predictions"]
    assert preds["canHelp"] is True and preds["speedupAtRatio"] == pytest.approx(1.8)
    assert preds["ratios"][0] == {"ratio": 0.0, "speedup": 1.5}
    cannot = run(view(), [reading(0), reading(10, pred=CANNOT)])
    cond = condition(cannot, "CompressionEffective")
    assert (cond["status"], cond["reason"]) == ("False", "HeadShareTooSmall")
    assert "CompressionIneffective" in [e.reason for e in cannot.events]
    assert cannot.ratio is not None and cannot.ratio.text == "0.2"  # toward the lowest
    assert reason(cannot) == Reason.CANNOT_HELP
    none = run(view(), [reading(0, pred=None)])
    assert condition(none, "CompressionEffective")["status"] == "Unknown"
    assert none.status is not None and "predictions" not in none.status["compression"]
    # Prometheus down says nothing about compression: the condition stands.
    down = Sample(time=at(20), error=(PromReason.UNREACHABLE, "refused"))
    held = run(view(), [reading(0), reading(10, pred=CANNOT), down])
    assert condition(held, "CompressionEffective")["status"] == "False"


def test_without_predictions_one_step_is_tried_down_first() -> None:
    plan = run(view(), [reading(0, pred=None), reading(10, pred=None)])
    assert plan.ratio is not None and plan.ratio.text == "0.2"
    assert plan.status is not None
    assert plan.status["compression"]["trial"]["basis"] == "measured"


def test_quality_below_threshold_steps_down_at_once() -> None:
    plan = run(view(), [reading(0, p99=0.6, kept=0.9)])
    assert plan.status is not None
    assert plan.status["compression"]["reason"] == Reason.QUALITY_GUARD
    assert plan.ratio is not None and plan.ratio.text == "0.2"  # 2 * maxStep


def test_dry_run_reports_and_changes_nothing() -> None:
    plan = run(view(), [reading(0, kept=0.9)], status={"compression": {"ratio": 0.3}}, dry_run=True)
    assert plan.status is not None
    comp = plan.status["compression"]
    assert comp["ratio"] == 0.3 and comp["lastDecision"]["proposedRatio"] == pytest.approx(0.2)
    assert plan.ratio is None
    assert [e.reason for e in plan.events] == ["DryRunCompression", "MetricsAvailable"]
    assert "trial" not in comp  # nothing changed, so nothing is measured


def test_scale_up_sets_replicas_and_starts_the_ratios_settle_window() -> None:
    auto = {"enabled": True, "maxReplicas": 4, "targetRequestsPerReplica": 2}
    plan = run(view(autoscaling=auto), [reading(0, rate=5.0)])
    assert plan.scale is not None and plan.scale.replicas == 3
    assert plan.scale.event.reason == "Scaled"
    assert plan.status is not None
    assert plan.status["autoscaling"]["reason"] == Reason.SCALED_UP
    assert plan.status["autoscaling"]["lastScaleTime"] == "2026-01-01T12:00:00Z"
    assert plan.memory.last_replicas == 3 and plan.memory.last_replica_change == at(0)
    # Next tick (the spec now says 3): p99 is over target, but the ratio settles first.
    nxt = plan_tick(
        TickInput(
            view(autoscaling=auto, replicas=3), plan.status, 1, reading(10), plan.memory, at(10)
        )
    )
    assert reason(nxt) == Reason.SETTLING_AFTER_SCALE and nxt.scale is None


def test_someone_elses_replica_change_also_starts_the_settle_window() -> None:
    plan = run(view(), [reading(0)])
    nxt = plan_tick(
        TickInput(view(replicas=2), plan.status or {}, 1, reading(10), plan.memory, at(10))
    )
    assert nxt.memory.last_replica_change == at(10)
    assert reason(nxt) == Reason.SETTLING_AFTER_SCALE


def test_a_fresh_process_takes_the_last_scale_time_from_status() -> None:
    status = {"autoscaling": {"lastScaleTime": "2026-01-01T11:59:30Z"}}
    plan = run(view(), [reading(0), reading(10)], status=status)
    assert reason(plan) == Reason.SETTLING_AFTER_SCALE  # 40 s after the scale, cooldown 60 s


def test_switched_off_gives_back_its_fields_once() -> None:
    on = run(view(), [reading(0)])
    off = plan_tick(TickInput(view(tuning={"enabled": False}), {}, 1, None, on.memory, at(10)))
    assert off.status == {} and not off.memory.active  # an empty apply drops our fields
    again = plan_tick(TickInput(view(tuning={"enabled": False}), {}, 1, None, off.memory, at(20)))
    assert again.status is None  # nothing to write
    assert not controlling(view(tuning={"enabled": False}))


def test_memory_keeps_the_last_samples_only() -> None:
    plan = run(view(), [reading(10 * i, p99=0.38) for i in range(SAMPLES_KEPT + 3)])
    assert len(plan.memory.samples) == SAMPLES_KEPT
    assert plan.memory.samples[-1].time == at(10 * (SAMPLES_KEPT + 2))


def test_one_evaluation_per_interval() -> None:
    v = view()  # intervalSeconds 10
    assert due(v, None, at(0))
    assert not due(v, at(0), at(5))
    assert due(v, at(0), at(9.6))  # timer jitter
