"""One tuning tick of one resource as a pure plan (tuning's counterpart of rollout/plan.py).

Input (`TickInput`): the resource's tuning blocks and status, this tick's metric
sample, what the controller remembers between ticks, and the clock. Output
(`TickPlan`): the status the tuner owns, the ratio to write to the runtime
ConfigMap, the replica count to set, the Events to post, and what to remember
for the next tick. The decisions themselves are guards.decide (ratio) and
autoscaler.decide (replicas); tick.py carries the plan out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from slimspec_operator.contract import format_ratio
from slimspec_operator.kube.conditions import format_time, get_condition, set_condition
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.rollout.plan import Event
from slimspec_operator.tuning import autoscaler
from slimspec_operator.tuning.guards import decide
from slimspec_operator.tuning.predictions import effectiveness
from slimspec_operator.tuning.prometheus.errors import PromReason
from slimspec_operator.tuning.reasons import Condition, EventReason, Reason
from slimspec_operator.tuning.status import (
    changes_from_status,
    compression_status,
    effect_from_status,
)
from slimspec_operator.tuning.status import parse as _time
from slimspec_operator.tuning.types import Decision, Sample, TunerSettings

# Enough for a paired trial's window (cooldown / interval parts) at short intervals.
SAMPLES_KEPT = 64
TIMER_JITTER_SECONDS = 0.5


@dataclass(frozen=True)
class TickMemory:
    """What the controller remembers of one resource between ticks.

    Process memory, lost on restart by design: what must survive a restart (last
    change times, change history) lives in status. A fresh process is
    conservative: it needs new samples before moving anything.
    """

    started: datetime  # when this process began watching the resource
    samples: tuple[Sample, ...] = ()  # oldest first, at most SAMPLES_KEPT
    recommendations: tuple[autoscaler.Recommendation, ...] = ()
    last_replicas: int | None = None
    last_replica_change: datetime | None = None
    active: bool = False  # tuning or operator autoscaling was on at the last tick


@dataclass(frozen=True)
class TickInput:
    view: TuningView
    status: Mapping[str, Any]  # the resource's status as read
    generation: int | None  # metadata.generation, for the condition
    sample: Sample | None  # this tick's readings; None when nothing is controlled
    memory: TickMemory
    now: datetime
    dry_run: bool = False  # decide and report, change nothing


@dataclass(frozen=True)
class RatioWrite:
    text: str  # the runtime ConfigMap's compression_ratio
    event: Event  # announces the change once written


@dataclass(frozen=True)
class ScaleTo:
    replicas: int  # through the scale subresource
    event: Event  # announces the change once made


@dataclass(frozen=True)
class TickPlan:
    memory: TickMemory  # to remember for the next tick
    status: dict[str, Any] | None = None  # the tuner's status fields; None: write nothing
    ratio: RatioWrite | None = None
    scale: ScaleTo | None = None
    events: tuple[Event, ...] = ()  # posted after the writes and their own events
    decision: Decision | None = None  # what the tuner decided (logs, tests)
    scale_decision: autoscaler.ScaleDecision | None = None


def controlling(view: TuningView) -> bool:
    """Tuning or the operator's own autoscaler is on: the tick queries and decides."""
    return view.tuning.enabled or view.scaling


def due(view: TuningView, last_tick: datetime | None, now: datetime) -> bool:
    """One evaluation per spec.tuning.intervalSeconds, however often the timer fires."""
    interval = view.tuning.interval_seconds - TIMER_JITTER_SECONDS
    return last_tick is None or (now - last_tick).total_seconds() >= interval


def grid_slot(interval_s: float, at: datetime) -> int:
    """The evaluation slot `at` falls in: wall-clock time cut into intervals."""
    return int(at.timestamp() // interval_s)


def due_on_grid(
    view: TuningView, last_tick: datetime | None, started: datetime, now: datetime, timer_s: float
) -> bool:
    """One evaluation per spec.tuning.intervalSeconds, in step with every other
    resource of that interval: at the first timer firing of each wall-clock slot,
    so that all of them read the same Prometheus answers (tuning/prometheus/shared.py).
    A new resource waits for the start of a slot (its first `timer_s` seconds), but
    never longer than one interval."""
    interval = view.tuning.interval_seconds
    if last_tick is None:
        at_start = now.timestamp() % interval < timer_s
        return at_start or (now - started).total_seconds() >= interval
    return grid_slot(interval, now) > grid_slot(interval, last_tick)


# ------------------------------------------------------------------ spec -> settings


def tuner_settings(view: TuningView) -> TunerSettings:
    t, c = view.tuning, view.compression
    return TunerSettings(
        latency_target=t.latency_target_seconds,
        dead_band=t.dead_band,
        cooldown=t.cooldown_seconds,
        max_step=t.max_step,
        min_ratio=c.min_ratio,
        max_ratio=c.max_ratio,
        min_request_rate=t.min_request_rate,
        quality_threshold=view.quality_control.threshold,
        # The same settle time in both directions: one cooldown.
        settle_after_scale=t.cooldown_seconds,
    )


def autoscaler_settings(view: TuningView) -> autoscaler.AutoscalerSettings:
    a = view.autoscaling
    return autoscaler.AutoscalerSettings(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        target_requests_per_replica=a.target_requests_per_replica,
        target_queue_depth=a.target_queue_depth,
        stabilization_window=a.stabilization_window_seconds,
        settle_after_ratio=view.tuning.cooldown_seconds if view.tuning.enabled else 0.0,
    )


# ------------------------------------------------------------------ the tick


@dataclass(frozen=True)
class MetricsState:
    """What the MetricsAvailable condition says."""

    available: bool = True
    reason: str = Reason.METRICS_OK
    message: str = "Prometheus answered all queries"


@dataclass(frozen=True)
class RatioPlan:
    decision: Decision
    compression: dict[str, Any]  # status.compression
    write: RatioWrite | None  # the ConfigMap write, when the ratio changed for real
    events: tuple[Event, ...]
    effective: tuple[str, str, str] | None  # CompressionEffective; None: no reading
    metrics: MetricsState | None  # why the metrics were unusable; None: they were fine


@dataclass(frozen=True)
class ScalePlan:
    decision: autoscaler.ScaleDecision
    autoscaling: dict[str, Any]  # status.autoscaling
    scale: ScaleTo | None
    events: tuple[Event, ...]
    metrics: MetricsState | None


def plan_tick(inp: TickInput) -> TickPlan:
    """Everything one tick does, decided from its inputs alone: the ratio, the
    replicas, then the conditions that report both."""
    view, mem, now = inp.view, inp.memory, inp.now
    if not controlling(view):
        # Switched off: give back the fields we own (an empty apply), once.
        return TickPlan(replace(mem, active=False), status={} if mem.active else None)
    sample = inp.sample
    if sample is None:
        raise ValueError("a tick that controls the resource needs a metrics sample")

    # Replica changes by anyone (us, KEDA, kubectl scale) start the settle window.
    last_replica_change = mem.last_replica_change
    if last_replica_change is None:
        last_replica_change = _time((inp.status.get("autoscaling") or {}).get("lastScaleTime"))
    if mem.last_replicas is not None and mem.last_replicas != view.replicas:
        last_replica_change = now
    memory = replace(
        mem,
        samples=(*mem.samples, sample)[-SAMPLES_KEPT:],
        last_replicas=view.replicas,
        last_replica_change=last_replica_change,
        active=True,
    )
    compression: Mapping[str, Any] = inp.status.get("compression") or {}
    last_ratio_change = _time(compression.get("lastChangeTime"))

    new_status: dict[str, Any] = {}
    events: list[Event] = []
    problems: list[MetricsState | None] = []
    ratio = None
    if view.tuning.enabled:
        ratio = plan_ratio(inp, memory.samples, sample, last_replica_change)
        new_status["compression"] = ratio.compression
        events += ratio.events
        problems.append(ratio.metrics)
        if ratio.write is not None:
            last_ratio_change = now
    scale = None
    if view.scaling:
        scale = plan_scale(inp, sample, last_ratio_change)
        memory = replace(memory, recommendations=scale.decision.recommendations)
        if scale.scale is not None:
            memory = replace(memory, last_replicas=scale.scale.replicas, last_replica_change=now)
        new_status["autoscaling"] = scale.autoscaling
        events += scale.events
        problems.append(scale.metrics)

    # The first problem found is the one MetricsAvailable reports.
    metrics = next((m for m in problems if m is not None), MetricsState())
    conditions, condition_events = plan_conditions(
        inp, metrics, ratio.effective if ratio is not None else None
    )
    new_status["conditions"] = conditions
    return TickPlan(
        memory,
        new_status,
        ratio.write if ratio is not None else None,
        scale.scale if scale is not None else None,
        (*events, *condition_events),
        ratio.decision if ratio is not None else None,
        scale.decision if scale is not None else None,
    )


def plan_ratio(
    inp: TickInput,
    samples: tuple[Sample, ...],
    sample: Sample,
    last_replica_change: datetime | None,
) -> RatioPlan:
    """The tuner's decision on this tick and what it writes: status.compression, the
    ConfigMap's ratio and the Events that announce a change or a verdict."""
    view, now = inp.view, inp.now
    compression: Mapping[str, Any] = inp.status.get("compression") or {}
    old = compression.get("ratio")
    ratio = float(old) if old is not None else view.compression.ratio
    settings = tuner_settings(view)
    d = decide(
        samples,
        ratio,
        settings,
        now,
        changes_from_status(compression),
        last_replica_change,
        effect_from_status(compression),
    )
    metrics = None
    if not d.metrics_available:
        metrics = MetricsState(False, d.metrics_reason, d.metrics_message)
    effective = None
    if sample.error is None:  # Prometheus down says nothing about compression
        effective = effectiveness(
            sample.predictions,
            settings.min_ratio,
            settings.max_ratio,
            settings.min_predicted_gain,
            settings.near_tie,
        )
    msg = f"compression ratio {ratio:g} -> {d.ratio:g} ({d.reason}): {d.message}"
    events = dry_run_events(inp, d.changed, EventReason.DRY_RUN_COMPRESSION, msg)
    write = None
    if d.changed and not inp.dry_run:
        # A revert is announced under its own reason, as a warning.
        event = Event("Normal", EventReason.COMPRESSION_CHANGED, msg)
        if d.verdict is not None:
            # a paired trial's kept move is a change made on its verdict
            event = Event("Normal" if d.verdict.keep else "Warning", d.reason, msg)
        write = RatioWrite(format_ratio(d.ratio), event)
    elif not d.changed and d.verdict is not None and not inp.dry_run:
        # a paired trial not kept is already back at its old ratio: no change to write
        kind = "Warning" if not d.verdict.keep and d.verdict.trial.paired else "Normal"
        events.append(Event(kind, d.reason, d.verdict.message))
    doc = compression_status(compression, ratio, d, sample, now, inp.dry_run)
    return RatioPlan(d, doc, write, tuple(events), effective, metrics)


def plan_scale(inp: TickInput, sample: Sample, last_ratio_change: datetime | None) -> ScalePlan:
    """The operator's autoscaler on this tick: status.autoscaling, the replicas to set
    and the Event that announces them."""
    view, mem, now = inp.view, inp.memory, inp.now
    d = autoscaler.decide(
        sample,
        view.replicas,
        autoscaler_settings(view),
        now,
        mem.recommendations,
        last_ratio_change,
        mem.started,
    )
    metrics = None
    if not d.metrics_available:
        message = (sample.error or ("", "no usable request-rate reading"))[1]
        metrics = MetricsState(False, d.reason, message)
    old = inp.status.get("autoscaling") or {}
    doc: dict[str, Any] = {"desiredReplicas": d.replicas, "reason": d.reason, "message": d.message}
    if old.get("lastScaleTime"):
        doc["lastScaleTime"] = old["lastScaleTime"]
    msg = f"replicas {view.replicas} -> {d.replicas}: {d.message}"
    events = dry_run_events(inp, d.changed, EventReason.DRY_RUN_SCALE, msg)
    scale = None
    if d.changed and not inp.dry_run:
        scale = ScaleTo(d.replicas, Event("Normal", EventReason.SCALED, msg))
        doc["lastScaleTime"] = format_time(now)
    return ScalePlan(d, doc, scale, tuple(events), metrics)


def dry_run_events(inp: TickInput, changed: bool, reason: str, message: str) -> list[Event]:
    """A dry run announces the change it would have made, and makes none."""
    return [Event("Normal", reason, message)] if changed and inp.dry_run else []


def plan_conditions(
    inp: TickInput, metrics: MetricsState, effective: tuple[str, str, str] | None
) -> tuple[list[dict[str, Any]], tuple[Event, ...]]:
    """The conditions the tuner owns (MetricsAvailable; CompressionEffective while
    tuning) and the Events of their flips."""
    now, generation = inp.now, inp.generation
    events: list[Event] = []
    cond_status = "True" if metrics.available else "False"
    conditions = inp.status.get("conditions") or []
    prior = get_condition(conditions, Condition.METRICS_AVAILABLE)
    conditions = set_condition(
        conditions,
        Condition.METRICS_AVAILABLE,
        cond_status,
        metrics.reason,
        metrics.message,
        generation,
        now,
    )
    if prior is None or prior.get("status") != cond_status:
        if metrics.available:
            events.append(Event("Normal", EventReason.METRICS_AVAILABLE, metrics.message))
        else:
            events.append(Event("Warning", EventReason.METRICS_UNAVAILABLE, metrics.message))
    owned = {Condition.METRICS_AVAILABLE}
    if inp.view.tuning.enabled:
        owned.add(Condition.COMPRESSION_EFFECTIVE)
        was = get_condition(conditions, Condition.COMPRESSION_EFFECTIVE)
        if effective is None:  # no reading: keep what the last one said
            effective = (
                (was["status"], was.get("reason", ""), was.get("message", ""))
                if was is not None
                else ("Unknown", PromReason.NO_DATA, "no metrics read yet")
            )
        conditions = set_condition(
            conditions, Condition.COMPRESSION_EFFECTIVE, *effective, generation, now
        )
        flipped = was is None or was.get("status") != effective[0]
        if flipped and effective[0] == "False":
            events.append(Event("Warning", EventReason.COMPRESSION_INEFFECTIVE, effective[2]))
        elif flipped and effective[0] == "True" and was is not None:
            events.append(Event("Normal", EventReason.COMPRESSION_EFFECTIVE, effective[2]))
    return [c for c in conditions if c["type"] in owned], tuple(events)
