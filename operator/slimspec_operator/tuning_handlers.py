"""Kopf timer that runs the tuner and the autoscaler for each SlimSpecService.

Thin glue: read the spec, query Prometheus (prom.py), decide (tuner.py,
autoscaler.py: pure), then write. Writes, all idempotent:

- status.compression, status.autoscaling and the MetricsAvailable condition,
  by server-side apply with our own field manager (the reconciler applies its
  own conditions with its own manager, so neither erases the other's);
- the runtime ConfigMap's `compression_ratio` key, at once, so engines pick the
  change up within seconds (the reconciler writes the same value later);
- spec.replicas through the scale subresource (autoscaling.mode=operator);
- a KEDA ScaledObject (autoscaling.mode=keda, when KEDA's CRD is installed);
- an Event per ratio or replica change.

State the decisions need beyond the resource itself (recent samples, scale
recommendations) lives in process memory; what must survive a restart
(last change times, change history) lives in status. A fresh process is
conservative: it needs new samples before moving anything.

Environment: SLIMSPEC_TUNING_TICK_SECONDS (timer period, default 5; each
resource is evaluated every spec.tuning.intervalSeconds), SLIMSPEC_TUNING_DRY_RUN=1
(decide and report, change nothing).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from . import autoscaler, tuner
from .conditions import format_time, get_condition, parse_time, set_condition
from .contract import (
    API_VERSION,
    GROUP,
    KEDA_API_VERSION,
    KEDA_GROUP,
    KEDA_KIND,
    KEDA_PLURAL,
    KEDA_VERSION,
    KIND,
    PLURAL,
    RATIO_KEY,
    TUNER_FIELD_MANAGER,
    VERSION,
    configmap_name,
    format_ratio,
)
from .prom import PromClient
from .queries import queries_for, rate_window, render_query, sample_from
from .spec import TuningView
from .tuner import Change, Sample

FIELD_MANAGER = TUNER_FIELD_MANAGER
CONDITION = "MetricsAvailable"
HISTORY_LIMIT = 20
SAMPLES_KEPT = 10
TICK_SECONDS = float(os.environ.get("SLIMSPEC_TUNING_TICK_SECONDS", "5"))
DRY_RUN = os.environ.get("SLIMSPEC_TUNING_DRY_RUN", "") in ("1", "true", "yes")

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ pure helpers


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


# ------------------------------------------------------------------ thin I/O


class KubeIO:
    """The few API calls the tuner makes, run off the event loop."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        if api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self._keda: bool | None = None

    async def apply_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        body: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND}
        body |= {"metadata": {"name": name, "namespace": ns}, "status": status}
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            ns,
            PLURAL,
            name,
            body,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    async def set_configmap_ratio(self, ns: str, name: str, text: str) -> bool:
        """Patch `<name>-runtime`'s compression_ratio; False when it does not exist yet."""
        body = {"data": {RATIO_KEY: text}}
        try:
            await asyncio.to_thread(
                self.core.patch_namespaced_config_map, configmap_name(name), ns, body
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def scale(self, ns: str, name: str, replicas: int) -> None:
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_scale,
            GROUP,
            VERSION,
            ns,
            PLURAL,
            name,
            {"spec": {"replicas": replicas}},
            field_manager=FIELD_MANAGER,
        )

    async def keda_installed(self) -> bool:
        """Discovery, not a CRD read: needs no extra RBAC. Cached once True."""
        if self._keda:
            return True
        try:
            res = await asyncio.to_thread(self.custom.get_api_resources, KEDA_GROUP, KEDA_VERSION)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        self._keda = any(r.name == KEDA_PLURAL for r in (res.resources or []))
        return self._keda

    async def apply_scaled_object(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object,
            KEDA_GROUP,
            KEDA_VERSION,
            meta["namespace"],
            KEDA_PLURAL,
            meta["name"],
            obj,
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    async def delete_scaled_object(self, ns: str, name: str) -> None:
        try:
            await asyncio.to_thread(
                self.custom.delete_namespaced_custom_object,
                KEDA_GROUP,
                KEDA_VERSION,
                ns,
                KEDA_PLURAL,
                name,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def event(
        self, obj: Mapping[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None:
        meta = obj["metadata"]
        now = datetime.now(UTC)
        ev = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{meta['name']}.{uuid.uuid4().hex[:12]}", namespace=meta["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION,
                kind=KIND,
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta.get("uid"),
            ),
            reason=reason,
            message=message[:1024],
            type=type_,
            source=client.V1EventSource(component=FIELD_MANAGER),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            reporting_component=FIELD_MANAGER,
            reporting_instance=os.environ.get("HOSTNAME", FIELD_MANAGER),
        )
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, meta["namespace"], ev)
        except ApiException as exc:  # an Event is best effort
            log.warning("could not post event %s: %s", reason, exc.reason)


# ------------------------------------------------------------------ one tick


@dataclass
class Memory:
    """Per-resource controller memory (lost on restart, by design)."""

    started: datetime
    samples: collections.deque[Sample] = field(
        default_factory=lambda: collections.deque(maxlen=SAMPLES_KEPT)
    )
    last_tick: datetime | None = None
    recommendations: tuple[autoscaler.Recommendation, ...] = ()
    last_replicas: int | None = None
    last_replica_change: datetime | None = None
    keda_applied: bool = False
    active: bool = False


async def tick(
    body: Mapping[str, Any],
    mem: Memory,
    kube: KubeIO,
    now: datetime,
    *,
    dry_run: bool = DRY_RUN,
    force: bool = False,
) -> dict[str, Any] | None:
    """One evaluation of one resource. Returns the status it applied (for tests/logs)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    status: Mapping[str, Any] = body.get("status") or {}
    ns, name = meta["namespace"], meta["name"]
    try:
        view = TuningView.from_spec(spec)
    except ValidationError as exc:
        log.warning("%s/%s: tuning spec not usable: %s", ns, name, exc)
        return None
    auto = view.autoscaling
    scaling = auto.enabled and auto.mode == "operator"
    interval = view.tuning.interval_seconds - 0.5  # timer jitter
    if not force and mem.last_tick and (now - mem.last_tick).total_seconds() < interval:
        return None
    mem.last_tick = now
    await _reconcile_keda(body, view, mem, kube)

    if not (view.tuning.enabled or scaling):
        if mem.active:  # switched off: give back the fields we own
            await kube.apply_status(ns, name, {})
            mem.active = False
        return None
    mem.active = True

    # Replica changes by anyone (us, KEDA, kubectl scale) start the settle window.
    if mem.last_replica_change is None:
        mem.last_replica_change = _time((status.get("autoscaling") or {}).get("lastScaleTime"))
    if mem.last_replicas is not None and mem.last_replicas != view.replicas:
        mem.last_replica_change = now
    mem.last_replicas = view.replicas

    async with PromClient(view.prometheus.url, view.prometheus.timeout_seconds) as prom:
        results = await prom.query_many(queries_for(view, ns, name, scaling))
    sample = sample_from(now, results)
    mem.samples.append(sample)

    new_status: dict[str, Any] = {}
    conditions = status.get("conditions") or []
    available, why, message = True, "MetricsOK", "Prometheus answered all queries"
    compression: Mapping[str, Any] = status.get("compression") or {}
    last_ratio_change = _time(compression.get("lastChangeTime"))

    if view.tuning.enabled:
        old = compression.get("ratio")
        ratio = float(old) if old is not None else view.compression.ratio
        decision = tuner.decide(
            list(mem.samples),
            ratio,
            tuner_settings(view),
            now,
            changes_from_status(compression),
            mem.last_replica_change,
        )
        if not decision.metrics_available:
            available, why, message = False, decision.metrics_reason, decision.metrics_message
        new_status["compression"] = compression_status(
            compression, ratio, decision, sample, now, dry_run
        )
        if decision.changed:
            await _announce_ratio(body, kube, ratio, decision, dry_run)
            if not dry_run:
                last_ratio_change = now

    if scaling:
        scale = autoscaler.decide(
            sample,
            view.replicas,
            autoscaler_settings(view),
            now,
            mem.recommendations,
            last_ratio_change,
            mem.started,
        )
        mem.recommendations = scale.recommendations
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
            if dry_run:
                await kube.event(body, "DryRunScale", msg)
            else:
                await kube.scale(ns, name, scale.replicas)
                await kube.event(body, "Scaled", msg)
                mem.last_replicas, mem.last_replica_change = scale.replicas, now
                auto_status["lastScaleTime"] = format_time(now)
        new_status["autoscaling"] = auto_status

    cond_status = "True" if available else "False"
    prior = get_condition(conditions, CONDITION)
    conditions = set_condition(
        conditions, CONDITION, cond_status, why, message, meta.get("generation"), now
    )
    new_status["conditions"] = [c for c in conditions if c["type"] == CONDITION]
    if prior is None or prior.get("status") != cond_status:
        kind = "Normal" if available else "Warning"
        await kube.event(
            body, "MetricsAvailable" if available else "MetricsUnavailable", message, kind
        )
    await kube.apply_status(ns, name, new_status)
    return new_status


async def _announce_ratio(
    body: Mapping[str, Any], kube: KubeIO, ratio: float, d: tuner.Decision, dry_run: bool
) -> None:
    meta = body["metadata"]
    msg = f"compression ratio {ratio:g} -> {d.ratio:g} ({d.reason}): {d.message}"
    if dry_run:
        await kube.event(body, "DryRunCompression", msg)
        return
    # Effective within seconds; the reconciler writes the same text on its next pass.
    found = await kube.set_configmap_ratio(meta["namespace"], meta["name"], format_ratio(d.ratio))
    if not found:
        msg += " (runtime ConfigMap not there yet; the reconciler will write it)"
    await kube.event(body, "CompressionChanged", msg)


async def _reconcile_keda(
    body: Mapping[str, Any], view: TuningView, mem: Memory, kube: KubeIO
) -> None:
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    want = view.autoscaling.enabled and view.autoscaling.mode == "keda"
    if not want:
        if mem.keda_applied:
            await kube.delete_scaled_object(ns, name)
            mem.keda_applied = False
        return
    if not await kube.keda_installed():
        if not mem.keda_applied:  # say it once per process, not every tick
            await kube.event(
                body,
                "KedaNotInstalled",
                f"autoscaling.mode=keda but the {KEDA_API_VERSION} {KEDA_KIND} API is not served",
                "Warning",
            )
            mem.keda_applied = True  # remembered as "reported"; nothing to delete
        return
    window = rate_window(view.tuning.interval_seconds)
    obj = autoscaler.scaled_object(
        name=name,
        namespace=ns,
        owner_uid=meta.get("uid", ""),
        prometheus_url=view.prometheus.url,
        request_rate_query=render_query(view.tuning.queries.request_rate, ns, name, window),
        settings=autoscaler_settings(view),
        polling_interval=max(1, round(view.tuning.interval_seconds)),
    )
    await kube.apply_scaled_object(obj)
    mem.keda_applied = True


# ------------------------------------------------------------------ kopf glue

_kube: KubeIO | None = None


def _io() -> KubeIO:
    global _kube
    if _kube is None:
        _kube = KubeIO()
    return _kube


@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_SECONDS)
async def tuning_timer(
    body: kopf.Body, uid: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    memories: dict[str, Memory] = memo.setdefault("slimspec_tuning", {})
    now = datetime.now(UTC)
    mem = memories.setdefault(uid, Memory(started=now))
    try:
        await tick(body, mem, _io(), now)
    except ApiException as exc:
        logger.warning("tuning: API error %s %s; retrying next tick", exc.status, exc.reason)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(uid: str, memo: kopf.Memo, **_: Any) -> None:
    memo.get("slimspec_tuning", {}).pop(uid, None)
