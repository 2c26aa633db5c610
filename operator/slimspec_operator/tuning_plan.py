"""One tuning tick of one resource as a pure plan (tuning's counterpart of rollout.py).

Input (`TickInput`): the resource's tuning blocks and status, this tick's metric
sample, what the controller remembers between ticks, and the clock. Output
(`TickPlan`): the status the tuner owns, the ratio to write to the runtime
ConfigMap, the replica count to set, the Events to post, and what to remember
for the next tick. The decisions themselves are tuner.decide (ratio) and
autoscaler.decide (replicas); tuning_tick.py carries the plan out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from . import autoscaler, tuner
from .conditions import format_time, get_condition, parse_time, set_condition
from .contract import format_ratio
from .queries import rate_window, render_query
from .rollout import Event
from .spec import TuningView
from .tuner import Change, Sample

CONDITION = "MetricsAvailable"
HISTORY_LIMIT = 20  # status.compression.history entries kept
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
    decision: tuner.Decision | None = None  # what the tuner decided (logs, tests)
    scale_decision: autoscaler.ScaleDecision | None = None


def controlling(view: TuningView) -> bool:
    """Tuning or the operator's own autoscaler is on: the tick queries and decides."""
    return view.tuning.enabled or view.scaling


def due(view: TuningView, last_tick: datetime | None, now: datetime) -> bool:
    """One evaluation per spec.tuning.intervalSeconds, however often the timer fires."""
    interval = view.tuning.interval_seconds - TIMER_JITTER_SECONDS
    return last_tick is None or (now - last_tick).total_seconds() >= interval


# ------------------------------------------------------------------ spec -> settings


def tuner_settings(view: TuningView) -> tuner.TunerSettings:
    t, c = view.tuning, view.compression
    return tuner.TunerSettings(
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


def scaled_object_for(view: TuningView, namespace: str, name: str, uid: str) -> dict[str, Any]:
    """The KEDA ScaledObject for autoscaling.mode=keda."""
    window = rate_window(view.tuning.interval_seconds)
    return autoscaler.scaled_object(
        name=name,
        namespace=namespace,
        owner_uid=uid,
        prometheus_url=view.prometheus.url,
        request_rate_query=render_query(view.tuning.queries.request_rate, namespace, name, window),
        settings=autoscaler_settings(view),
        polling_interval=max(1, round(view.tuning.interval_seconds)),
    )


# ------------------------------------------------------------------ status documents


def _time(value: Any) -> datetime | None:
    try:
        return parse_time(value) if isinstance(value, str) and value else None
    except ValueError:
        return None


def changes_from_status(compression: Mapping[str, Any]) -> list[Change]:
    """History entries as tuner Changes (oldest first).

    The load at the last raise is also kept in `lastRaise`, at a level the CRD
    does not prune, in case the history items' schema drops `requestRate`.
    """
    last_raise = compression.get("lastRaise") or {}
    out = []
    for h in compression.get("history") or []:
        t = _time(h.get("time"))
        if t is None:
            continue
        rate = h.get("requestRate")
        if rate is None and h.get("time") == last_raise.get("time"):
            rate = last_raise.get("requestRate")
        out.append(
            Change(
                time=t,
                from_ratio=float(h.get("from", 0.0)),
                to_ratio=float(h.get("to", 0.0)),
                reason=str(h.get("reason", "")),
                request_rate=float(rate) if rate is not None else None,
            )
        )
    return out


def _num(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def compression_status(
    old: Mapping[str, Any],
    ratio: float,
    decision: tuner.Decision,
    sample: Sample,
    now: datetime,
    dry_run: bool,
) -> dict[str, Any]:
    """status.compression after a decision: history grows only on a change."""
    history = list(old.get("history") or [])
    out: dict[str, Any] = {
        "ratio": ratio,
        "reason": old.get("reason", "Initial"),
        "history": history,
    }
    for key in ("lastChangeTime", "lastRaise"):
        if old.get(key):
            out[key] = old[key]
    if decision.changed and not dry_run:
        entry = {
            "time": format_time(now),
            "from": ratio,
            "to": decision.ratio,
            "reason": decision.reason,
            "requestRate": _num(sample.request_rate),
            "p99LatencySeconds": _num(sample.p99_latency),
        }
        if decision.reason == tuner.RAISED and sample.request_rate is not None:
            out["lastRaise"] = {"time": entry["time"], "requestRate": entry["requestRate"]}
        out.update(
            ratio=decision.ratio,
            reason=decision.reason,
            lastChangeTime=format_time(now),
            history=[*history, {k: v for k, v in entry.items() if v is not None}][-HISTORY_LIMIT:],
        )
    out["lastDecision"] = {
        "time": format_time(now),
        "reason": decision.reason,
        "message": decision.message,
        "dryRun": dry_run,
        **({"proposedRatio": decision.ratio} if dry_run and decision.changed else {}),
    }
    observed = {
        "p99LatencySeconds": _num(tuner.clean(sample.p99_latency)),
        "requestRate": _num(tuner.clean(sample.request_rate)),
        "keptAcceptance": _num(tuner.clean(sample.kept_acceptance)),
        "meanAcceptedLength": _num(tuner.clean(sample.mean_accepted_length)),
        "fallbackRate": _num(tuner.clean(sample.fallback_rate)),
    }
    out["observed"] = {k: v for k, v in observed.items() if v is not None}
    return out


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
    available, why, message = True, "MetricsOK", "Prometheus answered all queries"
    compression: Mapping[str, Any] = status.get("compression") or {}
    last_ratio_change = _time(compression.get("lastChangeTime"))

    decision = ratio_write = None
    if view.tuning.enabled:
        old = compression.get("ratio")
        ratio = float(old) if old is not None else view.compression.ratio
        decision = tuner.decide(
            samples,
            ratio,
            tuner_settings(view),
            now,
            changes_from_status(compression),
            last_replica_change,
        )
        if not decision.metrics_available:
            available, why, message = False, decision.metrics_reason, decision.metrics_message
        new_status["compression"] = compression_status(
            compression, ratio, decision, sample, now, inp.dry_run
        )
        if decision.changed:
            d = decision
            msg = f"compression ratio {ratio:g} -> {d.ratio:g} ({d.reason}): {d.message}"
            if inp.dry_run:
                events.append(Event("Normal", "DryRunCompression", msg))
            else:
                ratio_write = RatioWrite(
                    format_ratio(d.ratio), Event("Normal", "CompressionChanged", msg)
                )
                last_ratio_change = now

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
                events.append(Event("Normal", "DryRunScale", msg))
            else:
                scale_to = ScaleTo(scale.replicas, Event("Normal", "Scaled", msg))
                memory = replace(memory, last_replicas=scale.replicas, last_replica_change=now)
                auto_status["lastScaleTime"] = format_time(now)
        new_status["autoscaling"] = auto_status

    cond_status = "True" if available else "False"
    conditions = status.get("conditions") or []
    prior = get_condition(conditions, CONDITION)
    conditions = set_condition(
        conditions, CONDITION, cond_status, why, message, inp.generation, now
    )
    new_status["conditions"] = [c for c in conditions if c["type"] == CONDITION]
    if prior is None or prior.get("status") != cond_status:
        if available:
            events.append(Event("Normal", "MetricsAvailable", message))
        else:
            events.append(Event("Warning", "MetricsUnavailable", message))
    return TickPlan(memory, new_status, ratio_write, scale_to, tuple(events), decision, scale)
