"""One tuning tick of one resource: read the metrics, plan (plan.py), carry it out.

The I/O half of tuning, as rollout/reconcile.py is for rollouts. Writes, all idempotent,
with the tuner's own field manager, in this order:

1. the tuner's status (status.compression, status.autoscaling and the
   MetricsAvailable condition) by server-side apply (kube.apply_status, as the
   reconciler writes its own), conditional on the resourceVersion the plan was
   made from: a write that landed since (a user's status edit, the reconciler)
   is never overwritten from a stale read. On a conflict the tick reads the
   resource again and plans again (kube.conflict_retries), before it has
   changed anything else;
2. the runtime ConfigMap's `compression_ratio`, at once, so engines pick the
   change up within seconds (the reconciler writes the same text later);
3. spec.replicas through the scale subresource (autoscaling.mode=operator);
4. the plan's Events.

Before them, a KEDA ScaledObject is applied or deleted (autoscaling.mode=keda,
when KEDA's API is served).

Environment: SLIMSPEC_TUNING_DRY_RUN=1 (decide and report, change nothing).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

from pydantic import ValidationError

from slimspec_operator.contract import (
    API_VERSION,
    KEDA_API_VERSION,
    KEDA_AUTH_KIND,
    KEDA_KIND,
    KEDA_PLURAL,
    KIND,
    RATIO_KEY,
    TUNER_FIELD_MANAGER,
    configmap_name,
)
from slimspec_operator.kube.client import ApiError, Kube, conflict_retries
from slimspec_operator.kube.conditions import format_time
from slimspec_operator.kube.ownership import RESOURCE_CONFLICT, owned_by
from slimspec_operator.resource.queries import BY_NAME, QueryDef
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.rollout.plan import Event
from slimspec_operator.tuning.keda import (
    scaled_object_for,
    trigger_auth_name,
    trigger_authentication,
    with_trigger_auth,
)
from slimspec_operator.tuning.plan import (
    TickInput,
    TickMemory,
    TickPlan,
    controlling,
    due,
    due_on_grid,
    grid_slot,
    plan_tick,
)
from slimspec_operator.tuning.prometheus.auth import run_queries
from slimspec_operator.tuning.prometheus.errors import PromError
from slimspec_operator.tuning.prometheus.queries import (
    Answer,
    answer_of,
    queries_for,
    rate_window,
    sample_from,
    shareable,
)
from slimspec_operator.tuning.prometheus.shared import SharedReads
from slimspec_operator.tuning.reasons import EventReason
from slimspec_operator.tuning.types import Sample

DRY_RUN = os.environ.get("SLIMSPEC_TUNING_DRY_RUN", "") in ("1", "true", "yes")
NO_CONFIGMAP = " (runtime ConfigMap not there yet; the reconciler will write it)"

log = logging.getLogger(__name__)


@dataclass
class Memory:
    """Per-resource controller memory, kept by the Kopf glue between ticks."""

    started: datetime
    state: TickMemory = field(init=False)  # what the decisions remember
    last_tick: datetime | None = None
    keda_applied: bool = False  # a ScaledObject was applied (or its absence reported)
    keda_conflict_reported: bool = False  # a foreign KEDA object of our name, said once

    def __post_init__(self) -> None:
        self.state = TickMemory(started=self.started)


async def tick(
    body: Mapping[str, Any],
    mem: Memory,
    kube: Kube,
    now: datetime,
    *,
    dry_run: bool = DRY_RUN,
    force: bool = False,
    shared: SharedReads | None = None,
    timer_s: float | None = None,
) -> dict[str, Any] | None:
    """One evaluation of one resource. Returns the status it applied (for tests/logs).

    With `timer_s` (the period of the timer that calls it) evaluations keep to the
    wall-clock grid that every resource shares (plan.due_on_grid), and with `shared`
    the built-in queries are read once for all resources (prometheus/shared.py)."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    view = _view(body)
    if view is None:
        return None
    if timer_s is not None:
        is_due = due_on_grid(view, mem.last_tick, mem.started, now, timer_s)
    else:
        is_due = due(view, mem.last_tick, now)
    if not (force or is_due):
        return None
    log.debug("%s/%s: evaluating", ns, name)
    mem.last_tick = now
    await asyncio.to_thread(reconcile_keda, kube, body, view, mem)

    for attempt in conflict_retries():
        with attempt:
            if attempt.retry:  # changed since `body` was read: plan again from what is there
                log.debug("%s/%s: changed since read; planning the tick again", ns, name)
                fresh = await asyncio.to_thread(kube.get, KIND, ns, name)
                if fresh is None or (again := _view(fresh)) is None:
                    return None
                body, meta, view = fresh, fresh["metadata"], again
            sample = None
            if controlling(view):
                sample = await read_sample(view, ns, name, now, kube, shared)
            status = body.get("status") or {}
            inp = TickInput(view, status, meta.get("generation"), sample, mem.state, now, dry_run)
            plan = plan_tick(inp)
            if plan.status is not None:
                await asyncio.to_thread(
                    kube.apply_status, meta, plan.status, manager=TUNER_FIELD_MANAGER
                )
    mem.state = plan.memory
    await asyncio.to_thread(carry_out, kube, body, plan)
    return plan.status if plan.memory.active else None


def _view(body: Mapping[str, Any]) -> TuningView | None:
    try:
        return TuningView.from_spec(body.get("spec"))
    except ValidationError as exc:
        meta = body["metadata"]
        log.warning("%s/%s: tuning spec not usable: %s", meta["namespace"], meta["name"], exc)
        return None


async def read_sample(
    view: TuningView,
    namespace: str,
    name: str,
    now: datetime,
    kube: Kube | None = None,
    shared: SharedReads | None = None,
) -> Sample:
    """The tick's queries (scalars and per-label vectors), with the resource's
    Prometheus credentials (prometheus/auth.py). With `shared`, the built-in ones
    come from the grouped queries all resources share; its own templates run alone."""
    queries = queries_for(view, namespace, name, view.scaling)
    common: dict[str, QueryDef] = {}
    if shared is not None:
        common = {k: BY_NAME[k] for k in queries if shareable(view, BY_NAME[k])}
    own = {k: q for k, q in queries.items() if k not in common}
    labels = {k: BY_NAME[k].vector_label for k in own}
    scalars = {k: q for k, q in own.items() if labels[k] is None}
    vectors = {k: (q, label) for k, q in own.items() if (label := labels[k]) is not None}
    numbers: dict[str, float | PromError] = {}
    per_label: dict[str, dict[str, float] | PromError] = {}
    if own:
        numbers, per_label = await run_queries(kube, namespace, view.prometheus, scalars, vectors)
    if shared is not None and common:
        window = rate_window(view.tuning.interval_seconds)
        slot = grid_slot(view.tuning.interval_seconds, now)
        grouped = await shared.answers(kube, view.prometheus, namespace, common, window, slot)
        for key, query in common.items():
            answer: Answer | PromError = answer_of(
                query, grouped[key], namespace, name, queries[key]
            )
            if query.vector_label is None:  # answer_of answers as the query is shaped
                numbers[key] = cast(float | PromError, answer)
            else:
                per_label[key] = cast(dict[str, float] | PromError, answer)
    return sample_from(now, numbers, per_label)


def carry_out(kube: Kube, body: Mapping[str, Any], plan: TickPlan) -> None:
    """Everything after the status write: ConfigMap, scale, Events."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    if plan.ratio is not None:
        event = plan.ratio.event
        written = write_ratio(kube, ns, name, plan.ratio.text, meta.get("uid", ""))
        if written == MISSING:
            event = replace(event, message=event.message + NO_CONFIGMAP)
        elif written == NOT_OWNED:
            text = f" (not written: ConfigMap {configmap_name(name)} is not owned by this {KIND})"
            event = Event("Warning", RESOURCE_CONFLICT, event.message + text)
        post_event(kube, body, event)
    if plan.scale is not None:
        patch = {"spec": {"replicas": plan.scale.replicas}}
        kube.merge_patch(KIND, ns, name, patch, "scale", manager=TUNER_FIELD_MANAGER)
        post_event(kube, body, plan.scale.event)
    for event in plan.events:
        post_event(kube, body, event)


WRITTEN, MISSING, NOT_OWNED = "written", "missing", "not owned"


def write_ratio(kube: Kube, namespace: str, name: str, text: str, uid: str) -> str:
    """Patch the runtime ConfigMap's ratio where this resource (uid) owns it, as the
    reconciler does (kube/ownership.py): WRITTEN, MISSING (not there yet) or NOT_OWNED (someone
    else's object of that name: never adopted). The patch carries the resourceVersion
    read, so an object replaced in between is not written either (409)."""
    cm = configmap_name(name)
    found = kube.get("ConfigMap", namespace, cm)
    if found is None:
        return MISSING
    if not owned_by(found, uid):
        return NOT_OWNED
    version = found["metadata"].get("resourceVersion")
    patch = {"metadata": {"resourceVersion": version}, "data": {RATIO_KEY: text}}
    try:
        kube.merge_patch("ConfigMap", namespace, cm, patch, manager=TUNER_FIELD_MANAGER)
    except ApiError as exc:
        if exc.status == 404:
            return MISSING
        raise
    return WRITTEN


def post_event(kube: Kube, body: Mapping[str, Any], event: Event) -> None:
    """A core/v1 Event about the resource; best effort (a failure is only logged)."""
    meta = body["metadata"]
    stamp = format_time(datetime.now(UTC))
    involved = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "namespace": meta["namespace"],
        "uid": meta.get("uid"),
    }
    manifest = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{uuid.uuid4().hex[:12]}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {k: v for k, v in involved.items() if v is not None},
        "reason": event.reason,
        "message": event.message[:1024],
        "type": event.type,
        "source": {"component": TUNER_FIELD_MANAGER},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
        "reportingComponent": TUNER_FIELD_MANAGER,
        "reportingInstance": os.environ.get("HOSTNAME", TUNER_FIELD_MANAGER),
    }
    try:
        kube.create(manifest)
    except ApiError as exc:
        log.warning("could not post event %s: %s", event.reason, exc.message)


def reconcile_keda(kube: Kube, body: Mapping[str, Any], view: TuningView, mem: Memory) -> None:
    """The ScaledObject exists exactly while autoscaling.mode=keda (and KEDA is served)."""
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    if not view.keda:
        if mem.keda_applied:
            uid = meta.get("uid", "")
            _delete_owned(kube, KEDA_KIND, ns, name, uid)
            _delete_owned(kube, KEDA_AUTH_KIND, ns, trigger_auth_name(name), uid)
            mem.keda_applied = False
        return
    if not kube.serves(KEDA_API_VERSION, KEDA_PLURAL):
        if not mem.keda_applied:  # say it once per process, not every tick
            api = f"{KEDA_API_VERSION} {KEDA_KIND}"
            message = f"autoscaling.mode=keda but the {api} API is not served"
            post_event(kube, body, Event("Warning", EventReason.KEDA_NOT_INSTALLED, message))
            mem.keda_applied = True  # remembered as "reported"; nothing to delete
        return
    uid = meta.get("uid", "")
    obj = with_trigger_auth(scaled_object_for(view, ns, name, uid), view.prometheus, name)
    auth = trigger_authentication(view.prometheus, ns, name, uid)
    if not _may_write(kube, body, [obj] + ([auth] if auth else []), mem):
        return
    if auth is not None:
        kube.apply(auth, manager=TUNER_FIELD_MANAGER)
    kube.apply(obj, manager=TUNER_FIELD_MANAGER)
    mem.keda_applied = True


def _may_write(
    kube: Kube, body: Mapping[str, Any], objs: list[dict[str, Any]], mem: Memory
) -> bool:
    """Never adopt a KEDA object of that name made by someone else (kube/ownership.py)."""
    uid = body["metadata"].get("uid", "")
    for obj in objs:
        meta = obj["metadata"]
        found = kube.get(obj["kind"], meta["namespace"], meta["name"])
        if found is not None and not owned_by(found, uid):
            if not mem.keda_conflict_reported:
                text = f"{obj['kind']} {meta['name']} exists and is not owned by this {KIND}"
                post_event(kube, body, Event("Warning", RESOURCE_CONFLICT, text))
                mem.keda_conflict_reported = True
            return False
    mem.keda_conflict_reported = False
    return True


def _delete_owned(kube: Kube, kind: str, namespace: str, name: str, uid: str) -> None:
    found = kube.get(kind, namespace, name)
    if found is not None and owned_by(found, uid):
        kube.delete(kind, namespace, name)
