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

SAMPLES_KEPT = 10
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


def plan_tick(inp: TickInput) -> TickPlan:
    """Everything one tick does, decided from its inputs alone."""
    view, mem, now, status = inp.view, inp.memory, inp.now, inp.status
    if not controlling(view):
        # Switched off: give back the fields we own (an empty apply), once.
        return TickPlan(replace(mem, active=False), status={} if mem.active else None)
    sample = inp.sample
    if sample is None:
        raise ValueError("a tick that controls the resource needs a metrics sample")

    # Replica changes by anyone (us, KEDA, kubectl scale) start the settle window.
    last_replica_change = mem.last_replica_change
    if last_replica_change is None:
        last_replica_change = _time((status.get("autoscaling") or {}).get("lastScaleTime"))
    if mem.last_replicas is not None and mem.last_replicas != view.replicas:
        last_replica_change = now
    samples = (*mem.samples, sample)[-SAMPLES_KEPT:]
    memory = replace(
        mem,
        samples=samples,
        last_replicas=view.replicas,
        last_replica_change=last_replica_change,
        active=True,
    )

    new_status: dict[str, Any] = {}
    events: list[Event] = []
    available, message = True, "Prometheus answered all queries"
    why: str = Reason.METRICS_OK
    compression: Mapping[str, Any] = status.get("compression") or {}
    last_ratio_change = _time(compression.get("lastChangeTime"))

    decision = ratio_write = None
    effective: tuple[str, str, str] | None = None
    if view.tuning.enabled:
        old = compression.get("ratio")
        ratio = float(old) if old is not None else view.compression.ratio
        settings = tuner_settings(view)
        decision = decide(
            samples,
            ratio,
            settings,
            now,
            changes_from_status(compression),
            last_replica_change,
            effect_from_status(compression),
        )
        if not decision.metrics_available:
            available, why, message = False, decision.metrics_reason, decision.metrics_message
        new_status["compression"] = compression_status(
            compression, ratio, decision, sample, now, inp.dry_run
        )
        if sample.error is None:  # Prometheus down says nothing about compression
            effective = effectiveness(
                sample.predictions,
                settings.min_ratio,
                settings.max_ratio,
                settings.min_predicted_gain,
            )
        d = decision
        if d.changed:
            msg = f"compression ratio {ratio:g} -> {d.ratio:g} ({d.reason}): {d.message}"
            if inp.dry_run:
                events.append(Event("Normal", EventReason.DRY_RUN_COMPRESSION, msg))
            else:
                # A revert is announced under its own reason, as a warning.
                event = Event("Normal", EventReason.COMPRESSION_CHANGED, msg)
                if d.verdict is not None:
                    event = Event("Warning", d.reason, msg)
                ratio_write = RatioWrite(format_ratio(d.ratio), event)
                last_ratio_change = now
        elif d.verdict is not None and not inp.dry_run:
            events.append(Event("Normal", d.reason, d.verdict.message))

    scale = scale_to = None
    if view.scaling:
        scale = autoscaler.decide(
            sample,
            view.replicas,
            autoscaler_settings(view),
            now,
            mem.recommendations,
            last_ratio_change,
            mem.started,
        )
        memory = replace(memory, recommendations=scale.recommendations)
        if not scale.metrics_available and available:
            available, why = False, scale.reason
            message = (sample.error or ("", "no usable request-rate reading"))[1]
        old_auto = status.get("autoscaling") or {}
        auto_status = {
            "desiredReplicas": scale.replicas,
            "reason": scale.reason,
            "message": scale.message,
        }
        if old_auto.get("lastScaleTime"):
            auto_status["lastScaleTime"] = old_auto["lastScaleTime"]
        if scale.changed:
            msg = f"replicas {view.replicas} -> {scale.replicas}: {scale.message}"
            if inp.dry_run:
                events.append(Event("Normal", EventReason.DRY_RUN_SCALE, msg))
            else:
                scale_to = ScaleTo(scale.replicas, Event("Normal", EventReason.SCALED, msg))
                memory = replace(memory, last_replicas=scale.replicas, last_replica_change=now)
                auto_status["lastScaleTime"] = format_time(now)
        new_status["autoscaling"] = auto_status

    cond_status = "True" if available else "False"
    conditions = status.get("conditions") or []
    prior = get_condition(conditions, Condition.METRICS_AVAILABLE)
    conditions = set_condition(
        conditions, Condition.METRICS_AVAILABLE, cond_status, why, message, inp.generation, now
    )
    if prior is None or prior.get("status") != cond_status:
        if available:
            events.append(Event("Normal", EventReason.METRICS_AVAILABLE, message))
        else:
            events.append(Event("Warning", EventReason.METRICS_UNAVAILABLE, message))
    owned = {Condition.METRICS_AVAILABLE}
    if view.tuning.enabled:
        owned.add(Condition.COMPRESSION_EFFECTIVE)
        was = get_condition(conditions, Condition.COMPRESSION_EFFECTIVE)
        if effective is None:  # no reading: keep what the last one said
            effective = (
                (was["status"], was.get("reason", ""), was.get("message", ""))
                if was is not None
                else ("Unknown", PromReason.NO_DATA, "no metrics read yet")
            )
        conditions = set_condition(
            conditions, Condition.COMPRESSION_EFFECTIVE, *effective, inp.generation, now
        )
        flipped = was is None or was.get("status") != effective[0]
        if flipped and effective[0] == "False":
            events.append(Event("Warning", EventReason.COMPRESSION_INEFFECTIVE, effective[2]))
        elif flipped and effective[0] == "True" and was is not None:
            events.append(Event("Normal", EventReason.COMPRESSION_EFFECTIVE, effective[2]))
    new_status["conditions"] = [c for c in conditions if c["type"] in owned]
    return TickPlan(memory, new_status, ratio_write, scale_to, tuple(events), decision, scale)
