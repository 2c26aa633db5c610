"""One level-based reconciliation: observe, plan (pure), execute, write status.

Safe to run any number of times, from any handler, after a restart: every
input is read from the cluster and every write is an idempotent apply.

Two ways a round ends without writing anything but status (Degraded says why,
an Event says it once):
- an object the round would write exists and belongs to someone else
  (kube/ownership.py): reason ResourceConflict;
- the API server refuses an object built from the spec (400/422, e.g. an
  affinity it cannot parse): reason InvalidSpec with the server's message. The
  next timer round tries again (`Outcome.refused`), so fixing the spec (or the
  operator) or removing the foreign object heals it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from slimspec_operator.contract import KIND, OPERATOR_FIELD_MANAGER, configmap_name
from slimspec_operator.kube.client import ApiError, Kube
from slimspec_operator.kube.conditions import format_time, get_condition
from slimspec_operator.kube.ownership import (
    RESOURCE_CONFLICT,
    conflict_message,
    conflicts,
    owned_by,
)
from slimspec_operator.metrics import ACTIONS_TOTAL, ROLLOUT_IN_PROGRESS, ROLLOUTS_TOTAL
from slimspec_operator.resource.spec import SlimSpecService, ratio_in_force
from slimspec_operator.rollout import manifests as m
from slimspec_operator.rollout.model_prep import (
    KEY_ANNOTATION,
    PREP_NAME,
    Preparation,
    cache_claim,
    cache_claim_name,
    job_state,
    prep_job,
    preparation,
)
from slimspec_operator.rollout.observe import Found, observe
from slimspec_operator.rollout.plan import (
    ApplyDeployment,
    DeleteDeployment,
    Desired,
    Observed,
    Plan,
    ScaleDeployment,
    SwitchService,
    plan_rollout,
)
from slimspec_operator.rollout.pod_settings import with_node_spread
from slimspec_operator.rollout.reasons import Condition, Reason
from slimspec_operator.rollout.status import (
    PrepStatus,
    build_status,
    compression_patch,
    refused,
)

EventSink = Callable[[str, str, str], None]  # (type, reason, message)

_EVENT_METRIC: dict[str, str] = {
    Reason.ROLLOUT_STARTED: "started",
    Reason.TRAFFIC_SWITCHED: "switched",
    Reason.ROLLOUT_COMPLETE: "completed",
    Reason.ROLLED_BACK: "rolled_back",
}
MESSAGE_LIMIT = 512  # a server's refusal in a condition: enough to name the field


@dataclass(frozen=True)
class Outcome:
    """What a round did: its plan (None: the spec could not be read) and whether it
    was refused (a foreign object in the way, a spec the server refuses), so that
    nothing but status was written and a later round must try again."""

    plan: Plan | None
    refused: bool = False


def _owner_meta(svc: SlimSpecService) -> dict[str, Any]:
    return {
        "namespace": svc.namespace,
        "labels": m.common_labels(svc.name),
        "ownerReferences": [m.owner_reference(svc.name, svc.metadata.uid)],
    }


def writable_names(svc: SlimSpecService, prep: Preparation | None) -> list[tuple[str, str]]:
    """(kind, name) of every object a round may create or change (the admin Secret is
    create-only under a UID-bearing name: manifests.admin_secret_name)."""
    engine = m.engine_account_name(svc.name)
    names = [
        ("Service", m.service_name(svc.name)),
        ("ConfigMap", configmap_name(svc.name)),
        ("ServiceAccount", engine),
        ("Role", engine),
        ("RoleBinding", engine),
        ("Deployment", m.deployment_name(svc.name, m.desired_template_hash(svc))),
    ]
    if svc.spec.disruption_budget.enabled:
        names.append(("PodDisruptionBudget", m.disruption_budget_name(svc.name)))
    if prep is not None:
        names.append(("Job", prep.job_name))
        if not svc.spec.model_cache.claim_name:
            names.append(("PersistentVolumeClaim", cache_claim_name(svc)))
    return names


def desired_of(svc: SlimSpecService, prep: PrepStatus | None = None) -> Desired:
    return Desired(
        template_hash=m.desired_template_hash(svc),
        version=svc.spec.model.version,
        replicas=svc.spec.replicas,
        ready_timeout_s=float(svc.spec.rollout.ready_timeout_seconds),
        prepared=prep is None or prep.state == "Succeeded",
        preparation_failed=prep.message or "Failed" if prep and prep.state == "Failed" else None,
    )


def _write_status(
    kube: Kube, meta: Mapping[str, Any], status: Mapping[str, Any], rv: str | None
) -> str | None:
    """The reconciler's status, conditional on `rv` (kube.apply_status)."""
    return kube.apply_status(meta, status, manager=OPERATOR_FIELD_MANAGER, resource_version=rv)


def _apply_support_objects(kube: Kube, svc: SlimSpecService) -> None:
    kube.create(m.admin_secret(svc, secrets.token_urlsafe(32)))  # once; never rotated here
    kube.apply(m.service_account(svc))
    kube.apply(m.role(svc))
    kube.apply(m.role_binding(svc))
    kube.apply(m.runtime_configmap(svc))
    pdb = m.disruption_budget(svc)
    if pdb is not None:
        kube.apply(pdb)
        return
    # Turned off: remove ours, if there is one (someone else's of that name stays).
    name = m.disruption_budget_name(svc.name)
    existing = kube.get("PodDisruptionBudget", svc.namespace, name)
    if existing is not None and owned_by(existing, svc.metadata.uid):
        kube.delete("PodDisruptionBudget", svc.namespace, name)


def _prepare(
    kube: Kube, svc: SlimSpecService, prep: PrepStatus, found: Found, hf_endpoint: str | None
) -> bool:
    """Create the cache claim and the preparation Job when missing; True if the Job was
    created now."""
    owner = _owner_meta(svc)
    claim = cache_claim(svc, owner)
    if claim is not None and not any(
        k == "PersistentVolumeClaim" and o is not None for k, _, o in found
    ):
        kube.create(claim)  # created once: a claim's size and class are fixed
    if prep.state != "Missing":
        return False
    account = m.engine_account_name(svc.name)
    kube.create(prep_job(svc, prep.prep, owner, account, hf_endpoint))
    return True


def _drop_unused_jobs(kube: Kube, svc: SlimSpecService, keep: set[str]) -> None:
    """Preparation Jobs of templates that no longer exist (a finished rollout's old one)."""
    for job in kube.owned("Job", svc.namespace, svc.name, svc.metadata.uid):
        meta = job["metadata"]
        if (meta.get("labels") or {}).get("app.kubernetes.io/name") != PREP_NAME:
            continue
        if (meta.get("annotations") or {}).get(KEY_ANNOTATION) not in keep:
            kube.delete("Job", svc.namespace, meta["name"])


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


def _degraded_changed(status_in: Mapping[str, Any], reason: str, message: str) -> bool:
    cond = get_condition(status_in.get("conditions"), Condition.DEGRADED) or {}
    return (cond.get("status"), cond.get("reason"), cond.get("message")) != (
        "True",
        reason,
        message,
    )


def _refuse(
    kube: Kube,
    meta: Mapping[str, Any],
    status_in: Mapping[str, Any],
    status: Mapping[str, Any],
    reason: str,
    message: str,
    now: datetime,
    emit: EventSink | None,
) -> None:
    """Write status saying why nothing was done; tell it in an Event when it is news."""
    gen = int(meta.get("generation") or 0)
    if emit is not None and _degraded_changed(status_in, reason, message):
        emit("Warning", reason, message)
    _write_status(
        kube, meta, refused(status, reason, message, gen, now), meta.get("resourceVersion")
    )


def short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


def reconcile(
    kube: Kube,
    body: Mapping[str, Any],
    now: datetime,
    emit: EventSink | None = None,
    hf_endpoint: str | None = None,
    spread_over_nodes: bool = True,
) -> Outcome:
    """Bring the cluster in line with `body`; raises ApiError 409 when the object
    changed since `body` was read (the caller re-reads and runs again).
    `spread_over_nodes`: the operator's default placement (pod_settings.with_node_spread)."""
    meta = body["metadata"]
    status_in: Mapping[str, Any] = body.get("status") or {}
    try:
        svc = SlimSpecService.from_body(body)
    except ValidationError as exc:  # stored under an older CRD, say; the CRD refuses it now
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        text = short(f"spec cannot be read: {where}: {first.get('msg', '')}")
        _refuse(kube, meta, status_in, status_in, Reason.INVALID_SPEC, text, now, emit)
        return Outcome(None, refused=True)
    if spread_over_nodes:
        svc = with_node_spread(svc)
    rv: str | None = meta.get("resourceVersion")
    prep_spec = preparation(svc)
    found: Found = [
        (kind, name, kube.get(kind, svc.namespace, name))
        for kind, name in writable_names(svc, prep_spec)
    ]
    observed = observe(kube, svc, now, found)
    prep: PrepStatus | None = None
    if prep_spec is not None:
        job = next((o for k, _, o in found if k == "Job"), None)
        prep = PrepStatus(prep_spec, *job_state(job))
        if prep.state == "Missing" and any(
            d.preparation_key == prep_spec.key for d in observed.deployments
        ):  # its Job is gone (deleted by hand), but a Deployment runs on what it made
            prep = PrepStatus(prep_spec, "Succeeded")
    plan = plan_rollout(desired_of(svc, prep), observed)
    status = build_status(svc, plan, observed, now, prep)

    taken = conflicts(found, svc.metadata.uid)
    if taken:
        if any(c.kind == "Service" for c in taken):
            status.pop("url", None)  # that URL reaches someone else's pods
        text = conflict_message(taken)
        _refuse(kube, meta, status_in, status, RESOURCE_CONFLICT, text, now, emit)
        return Outcome(plan, refused=True)

    try:
        _apply_support_objects(kube, svc)
        if prep is not None and _prepare(kube, svc, prep, found, hf_endpoint) and emit:
            emit("Normal", Reason.PREPARING_MODEL, f"started Job {prep.prep.job_name}")
        seed = compression_patch(svc, ratio_in_force(svc), format_time(now))
        if seed is not None:
            patch: dict[str, Any] = {"status": {"compression": seed}}
            if rv:
                patch["metadata"] = {"resourceVersion": rv}
            rv = kube.merge_patch(KIND, svc.namespace, svc.name, patch, "status")["metadata"].get(
                "resourceVersion"
            )
        if plan.failed_hash and plan.failed_hash != observed.failed_hash:
            # Record the failure before deleting the Deployment, so a crash in
            # between cannot make the next round start the same rollout again.
            rv = _write_status(kube, meta, status, rv)
        _execute(kube, svc, plan, observed)
    except ApiError as exc:
        if exc.status not in (400, 422):
            raise
        text = short(f"the API server refused an object built from the spec: {exc.message}")
        current = dict(meta, resourceVersion=rv)
        _refuse(kube, current, status_in, status, Reason.INVALID_SPEC, text, now, emit)
        return Outcome(plan, refused=True)
    keep = {d.preparation_key for d in observed.deployments} | ({prep.prep.key} if prep else set())
    _drop_unused_jobs(kube, svc, keep)
    # The events report the actions just taken: tell them even if the status
    # write below loses a race (the re-plan will not take those actions again).
    for ev in plan.events:
        if ev.reason in _EVENT_METRIC:
            ROLLOUTS_TOTAL.labels(_EVENT_METRIC[ev.reason]).inc()
        if emit is not None:
            emit(ev.type, ev.reason, ev.message)
    failed = plan.degraded
    news = _degraded_changed(status_in, failed.reason, failed.message)
    if emit and failed.reason == Reason.PREPARATION_FAILED and news:
        emit("Warning", failed.reason, failed.message)
    _write_status(kube, meta, status, rv)

    ROLLOUT_IN_PROGRESS.labels(svc.namespace, svc.name).set(1 if plan.rollout_version else 0)
    return Outcome(plan)
