"""Kopf glue: every trigger runs the same level-based reconcile.

Triggers, all watch-driven: a watch event of a SlimSpecService whose spec
(metadata.generation) this process has not reconciled yet (so: its creation,
every spec change, and each resource once after a start), a ratio the tuner
moved, and changes of the Deployments (readiness, replicas, generations: not
every status write) and Jobs it owns. A timer fires every
SLIMSPEC_RECONCILE_INTERVAL seconds per resource but reconciles only when the
last round asks for it (plan.timer_due): a rollout's ready deadline has come, the
round failed or was refused (a foreign object in the way: no watch sees it go),
or a drift resync is due (SLIMSPEC_RESYNC_INTERVAL, for hand edits of objects
the operator does not watch: Service, ServiceAccount, Role, RoleBinding,
PodDisruptionBudget). An idle resource therefore costs no API request between
resyncs. Nothing here decides anything.

No create/update/resume handlers: those make Kopf keep a copy of the whole spec
in an annotation (its diff base), and a spec the API server accepts could then
outgrow the 256 KiB that all annotations of an object may hold, after which the
operator could not handle it at all. Reconciling is level-based, so "the spec
changed" is all it needs to know, and metadata.generation says that.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import kopf

from slimspec_operator.contract import (
    FINALIZER,
    GROUP,
    KIND,
    MANAGED_BY_LABEL,
    MANAGER,
    PLURAL,
    VERSION,
)
from slimspec_operator.kube.client import ApiError, conflict_retries, shared
from slimspec_operator.metrics import RECONCILE_SECONDS, RECONCILE_TOTAL
from slimspec_operator.resource.spec import SlimSpecService, ratio_in_force
from slimspec_operator.rollout.observe import observe_deployment
from slimspec_operator.rollout.plan import (
    ObservedDeployment,
    Round,
    deployment_news,
    follow_up,
    timer_due,
)
from slimspec_operator.rollout.reconcile import reconcile

# How often the timer looks (in memory) whether a round is due; see timer_due.
RECONCILE_INTERVAL_S = float(os.environ.get("SLIMSPEC_RECONCILE_INTERVAL", "10"))
# A full round of an idle resource, for drift no watch sees (0: never).
RESYNC_INTERVAL_S = float(os.environ.get("SLIMSPEC_RESYNC_INTERVAL", "1800"))
# A hub mirror for the model preparation Jobs (HF_ENDPOINT), set by the cluster's
# admin for the whole operator: a per-resource endpoint would let whoever writes a
# SlimSpecService send the hub token of a Secret to a server of their choosing.
HF_ENDPOINT = os.environ.get("SLIMSPEC_HF_ENDPOINT") or None
# Spread every resource's engines over nodes unless its spec places them
# (pod_settings.with_node_spread); the chart's engineDefaults.spreadOverNodes.
SPREAD_OVER_NODES = os.environ.get("SLIMSPEC_SPREAD_OVER_NODES", "true").lower() not in (
    "0",
    "false",
    "no",
)

_written_ratio: dict[str, float] = {}  # uid -> ratio last written to the ConfigMap
_written_failed: dict[str, str | None] = {}  # uid -> status.failedTemplateHash last written
_reconciled_generation: dict[str, int] = {}  # uid -> metadata.generation last reconciled
_rounds: dict[str, Round] = {}  # uid -> what its last round left for the timer
_deployments: dict[str, ObservedDeployment] = {}  # Deployment uid -> as last seen


@dataclass
class _Turn:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # threads holding or waiting for the lock


_locks: dict[str, _Turn] = {}  # uid -> its turn, only while someone holds or waits
_locks_guard = threading.Lock()


@contextmanager
def _exclusive(uid: str) -> Iterator[None]:
    """One reconcile at a time per resource (timers and watches overlap). The entry
    goes when its last user leaves, so a deleted resource leaves nothing behind and
    the map holds only the resources being worked on now."""
    with _locks_guard:
        turn = _locks.setdefault(uid, _Turn())
        turn.users += 1
    try:
        with turn.lock:
            yield
    finally:
        with _locks_guard:
            turn.users -= 1
            if turn.users == 0:
                del _locks[uid]


def _forget(uid: str) -> None:
    """The resource is gone (or going): drop what this process remembers of it."""
    _written_ratio.pop(uid, None)
    _written_failed.pop(uid, None)
    _reconciled_generation.pop(uid, None)
    _rounds.pop(uid, None)


def now() -> datetime:
    return datetime.now(UTC)


def _ns_name(body: Mapping[str, Any]) -> tuple[str, str]:
    return body["metadata"]["namespace"], body["metadata"]["name"]


def _event_sink(
    fresh: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter
) -> Callable[[str, str, str], None]:
    def emit(type_: str, reason: str, message: str) -> None:
        logger.info(f"{reason}: {message}")
        raw = cast(kopf.RawBody, fresh)
        kopf.event(kopf.Body(raw), type=type_, reason=reason, message=message)

    return emit


def run(body: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> None:
    """Reconcile one resource; one at a time per resource (timers and watches overlap)."""
    uid = body["metadata"].get("uid", "")
    with _exclusive(uid):
        t0 = time.monotonic()
        try:
            kube = shared()
            for attempt in conflict_retries():
                with attempt:
                    # Re-read: the body a handler got may be older than the last status
                    # write, and after a conflict what we read is stale.
                    fresh = kube.get(KIND, *_ns_name(body))
                    if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                        _forget(uid)
                        return
                    at = now()
                    outcome = reconcile(
                        kube, fresh, at, _event_sink(fresh, logger), HF_ENDPOINT, SPREAD_OVER_NODES
                    )
                    plan = outcome.plan
                    wake = plan.wake_at if plan is not None else None
                    _rounds[uid] = Round(at, wake, outcome.refused, follow_up(plan))
                    failed = (fresh.get("status") or {}).get("failedTemplateHash")
                    _written_failed[uid] = plan.failed_hash if plan is not None else failed
                    _written_ratio[uid] = ratio_in_force(SlimSpecService.from_body(fresh))
                    _reconciled_generation[uid] = int(fresh["metadata"].get("generation") or 0)
                    RECONCILE_TOTAL.labels("ok").inc()
                if attempt.conflicted:  # someone wrote it meanwhile: plan again
                    RECONCILE_TOTAL.labels("conflict").inc()
        except ApiError as e:
            if e.status == 404 and shared().get(KIND, *_ns_name(body)) is None:
                return  # deleted while we worked on it; the GC removes the rest
            RECONCILE_TOTAL.labels("error").inc()
            _rounds[uid] = Round(now(), retry=True)
            raise kopf.TemporaryError(f"API error {e}", delay=2) from e
        except Exception:
            RECONCILE_TOTAL.labels("error").inc()
            _rounds[uid] = Round(now(), retry=True)
            raise
        finally:
            RECONCILE_SECONDS.observe(time.monotonic() - t0)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep Kopf's bookkeeping in annotations: status belongs to the API shape.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # Kopf timers (ours and the tuner's) need a finalizer so they stop before the
    # object goes; name it after us. Deleting while no operator runs waits for it.
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # only our own events at INFO
    settings.execution.max_workers = int(os.environ.get("SLIMSPEC_MAX_WORKERS", "8"))
    settings.watching.server_timeout = 300
    # Only our own Deployments and Jobs come down the watch streams (server-side).
    ours = f"{MANAGED_BY_LABEL}={MANAGER}"
    settings.watching.label_selectors["apps", "deployments"] = ours
    settings.watching.label_selectors["batch", "jobs"] = ours


def _spec_not_reconciled(body: kopf.Body, **_: Any) -> bool:
    """A spec this process has not reconciled yet (new resource, spec change, or
    the first event after a start); status-only events do not count."""
    meta = body.get("metadata", {})
    if meta.get("deletionTimestamp"):
        return False
    return _reconciled_generation.get(meta.get("uid", "")) != int(meta.get("generation") or 0)


@kopf.on.event(GROUP, VERSION, PLURAL, when=_spec_not_reconciled)
def on_change(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    try:
        run(body, logger)
    except kopf.TemporaryError as exc:  # event handlers are not retried: the timer is
        logger.warning(f"reconcile failed, retrying on the next timer tick: {exc}")


@kopf.timer(GROUP, VERSION, PLURAL, interval=RECONCILE_INTERVAL_S, initial_delay=1)
def on_timer(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """A deadline, a retry or a resync; otherwise nothing (no API request)."""
    uid = body.get("metadata", {}).get("uid", "")
    if timer_due(_rounds.get(uid), now(), RESYNC_INTERVAL_S):
        run(body, logger)


def _ratio_moved(body: kopf.Body, **_: Any) -> bool:
    """A status input of the round differs from what the last round wrote: the
    ratio in force (e.g. the tuner wrote status.compression.ratio: push it to the
    ConfigMap now), or status.failedTemplateHash (removed by hand to retry a
    rolled-back version)."""
    uid = body.get("metadata", {}).get("uid", "")
    failed = (body.get("status") or {}).get("failedTemplateHash")
    if uid in _written_failed and _written_failed[uid] != failed:
        return True
    try:
        ratio = ratio_in_force(SlimSpecService.from_body(body))
    except ValueError:  # pydantic: an object the API server let through but we cannot read
        return False
    return uid in _written_ratio and _written_ratio[uid] != ratio


@kopf.on.event(GROUP, VERSION, PLURAL, when=_ratio_moved)
def on_ratio(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    run(body, logger)


def _gone(body: kopf.Body, type: str | None = None, **_: Any) -> bool:
    """The resource is being deleted, or its deletion has landed."""
    return type == "DELETED" or bool(body.get("metadata", {}).get("deletionTimestamp"))


@kopf.on.event(GROUP, VERSION, PLURAL, when=_gone)
def on_gone(body: kopf.Body, **_: Any) -> None:
    """Forget the resource at once: no later round may run to notice it is gone
    (Kopf stops its timer), and a process that watches many short-lived resources
    must not keep one entry per resource it ever saw."""
    _forget(body.get("metadata", {}).get("uid", ""))


def _deployment_news(body: Mapping[str, Any], type: str | None) -> bool:
    """A Deployment event the plan cares about, remembered per Deployment: the
    controller's status writes that change nothing the plan reads start no round."""
    uid = body.get("metadata", {}).get("uid", "")
    if type == "DELETED":
        _deployments.pop(uid, None)
        return True
    seen = observe_deployment(body)
    news = deployment_news(_deployments.get(uid), seen)
    _deployments[uid] = seen
    return news


@kopf.on.event("apps", "v1", "deployments", labels={MANAGED_BY_LABEL: MANAGER})
def on_deployment(body: kopf.Body, logger: kopf.Logger, type: str | None = None, **_: Any) -> None:
    """A Deployment's readiness moves its resource on now."""
    if _deployment_news(body, type):
        _run_owner(body, logger)


@kopf.on.event("batch", "v1", "jobs", labels={MANAGED_BY_LABEL: MANAGER})
def on_job(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
    """A preparation Job's end moves its resource on now."""
    _run_owner(body, logger)


def _run_owner(body: kopf.Body, logger: kopf.Logger) -> None:
    owner = next(
        (
            ref
            for ref in body.get("metadata", {}).get("ownerReferences") or []
            if ref.get("kind") == KIND and ref.get("controller")
        ),
        None,
    )
    if owner is None:
        return
    ns = body["metadata"]["namespace"]
    run({"metadata": {"name": owner["name"], "namespace": ns, "uid": owner["uid"]}}, logger)
