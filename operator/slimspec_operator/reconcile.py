"""One level-based reconciliation: observe, plan (pure), execute, write status.

Safe to run any number of times, from any handler, after a restart: every
input is read from the cluster and every write is an idempotent apply.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from . import manifests as m
from .conditions import format_time
from .contract import API_VERSION, KIND
from .kube import Kube, observe_deployment, service_hash
from .metrics import ACTIONS_TOTAL, ROLLOUT_IN_PROGRESS, ROLLOUTS_TOTAL
from .rollout import (
    ApplyDeployment,
    DeleteDeployment,
    Desired,
    Observed,
    Plan,
    ScaleDeployment,
    SwitchService,
    plan_rollout,
)
from .spec import SlimSpecService, ratio_in_force
from .status import build_status, compression_patch

EventSink = Callable[[str, str, str], None]  # (type, reason, message)

_EVENT_METRIC = {
    "RolloutStarted": "started",
    "TrafficSwitched": "switched",
    "RolloutComplete": "completed",
    "RolledBack": "rolled_back",
}


def _apply_support_objects(kube: Kube, svc: SlimSpecService) -> None:
    kube.create(m.admin_secret(svc, secrets.token_urlsafe(32)))  # once; never rotated here
    kube.apply(m.service_account(svc))
    kube.apply(m.role(svc))
    kube.apply(m.role_binding(svc))
    kube.apply(m.runtime_configmap(svc))


def observe(kube: Kube, svc: SlimSpecService, now: datetime) -> Observed:
    deps = kube.owned_deployments(svc.namespace, svc.name, svc.metadata.uid)
    service = kube.get("Service", svc.namespace, m.service_name(svc.name))
    return Observed(
        deployments=tuple(observe_deployment(d) for d in deps),
        service_hash=service_hash(service),
        failed_hash=svc.status.get("failedTemplateHash"),
        failed_version=svc.status.get("failedVersion"),
        now=now,
    )


def desired_of(svc: SlimSpecService) -> Desired:
    return Desired(
        template_hash=m.desired_template_hash(svc),
        version=svc.spec.model.version,
        replicas=svc.spec.replicas,
        ready_timeout_s=float(svc.spec.rollout.ready_timeout_seconds),
    )


def _write_status(
    kube: Kube, svc: SlimSpecService, status: Mapping[str, Any], resource_version: str | None
) -> str | None:
    """Apply the reconciler's status; returns the new resourceVersion.

    The resourceVersion makes the write conditional (409 on a mismatch): status
    was computed from what we read, and a blind apply would put back a field
    someone removed meanwhile (`kubectl patch --subresource=status` dropping
    failedTemplateHash to retry a rollout).
    """
    meta: dict[str, Any] = {"name": svc.name, "namespace": svc.namespace}
    if resource_version:
        meta["resourceVersion"] = resource_version
    body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "status": dict(status)}
    return kube.apply(body, subresource="status").get("metadata", {}).get("resourceVersion")


def _execute(kube: Kube, svc: SlimSpecService, plan: Plan, observed: Observed) -> None:
    ns = svc.namespace
    selected = observed.service_hash
    for action in plan.actions:
        ACTIONS_TOTAL.labels(type(action).__name__).inc()
        match action:
            case ApplyDeployment(replicas=r):
                kube.apply(m.deployment(svc, r))
            case ScaleDeployment(name=n, replicas=r):
                kube.merge_patch("Deployment", ns, n, {"spec": {"replicas": r}})
            case SwitchService(template_hash=h):
                kube.apply(m.service(svc, h))
                selected = h
            case DeleteDeployment(name=n):
                kube.delete("Deployment", ns, n)
    if selected is not None and not any(isinstance(a, SwitchService) for a in plan.actions):
        kube.apply(m.service(svc, selected))  # keep port/type in line with the spec


def reconcile(
    kube: Kube, body: Mapping[str, Any], now: datetime, emit: EventSink | None = None
) -> Plan:
    """Bring the cluster in line with `body`; raises ApiError 409 when the object
    changed since `body` was read (the caller re-reads and runs again)."""
    svc = SlimSpecService.from_body(body)
    rv: str | None = body.get("metadata", {}).get("resourceVersion")
    _apply_support_objects(kube, svc)
    seed = compression_patch(svc, ratio_in_force(svc), format_time(now))
    if seed is not None:
        patch: dict[str, Any] = {"status": {"compression": seed}}
        if rv:
            patch["metadata"] = {"resourceVersion": rv}
        rv = kube.merge_patch(KIND, svc.namespace, svc.name, patch, "status")["metadata"].get(
            "resourceVersion"
        )

    observed = observe(kube, svc, now)
    plan = plan_rollout(desired_of(svc), observed)
    status = build_status(svc, plan, observed, now)
    if plan.failed_hash and plan.failed_hash != observed.failed_hash:
        # Record the failure before deleting the Deployment, so a crash in
        # between cannot make the next round start the same rollout again.
        rv = _write_status(kube, svc, status, rv)
    _execute(kube, svc, plan, observed)
    # The events report the actions just taken: tell them even if the status
    # write below loses a race (the re-plan will not take those actions again).
    for ev in plan.events:
        if ev.reason in _EVENT_METRIC:
            ROLLOUTS_TOTAL.labels(_EVENT_METRIC[ev.reason]).inc()
        if emit is not None:
            emit(ev.type, ev.reason, ev.message)
    _write_status(kube, svc, status, rv)

    ROLLOUT_IN_PROGRESS.labels(svc.namespace, svc.name).set(1 if plan.rollout_version else 0)
    return plan
