"""Status the reconciler owns, computed from the plan and what it observed (pure).

The tuner owns status.compression and the MetricsAvailable condition; this
module never writes those, so the two writers do not fight (conditions is a
map-list keyed by type, and the reconciler applies only its own entries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from slimspec_operator.kube.conditions import set_condition
from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.rollout.manifests import selector_string, status_url
from slimspec_operator.rollout.model_prep import Preparation, State, job_name
from slimspec_operator.rollout.plan import Observed, Plan
from slimspec_operator.rollout.reasons import Condition, Reason

OWNED_CONDITIONS = (Condition.READY, Condition.PROGRESSING, Condition.DEGRADED)
# Status fields the reconciler owns (server-side apply: a field it leaves out of a
# write is removed, so a write that cannot compute them carries the old values).
OWNED_FIELDS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "selector",
    "url",
    "models",
    "servedVersion",
    "rolloutVersion",
    "templateHash",
    "failedTemplateHash",
    "failedVersion",
)


@dataclass(frozen=True)
class PrepStatus:
    """The desired template's model preparation, as observed."""

    prep: Preparation
    state: State
    message: str = ""


def build_status(
    svc: SlimSpecService,
    plan: Plan,
    observed: Observed,
    now: datetime,
    prep: PrepStatus | None = None,
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = list(svc.status.get("conditions") or [])
    gen = svc.metadata.generation
    serving = next((d for d in observed.deployments if d.template_hash == plan.serving_hash), None)
    ready = serving.ready_replicas if serving else 0
    current = serving.current_replicas if serving else 0
    want = svc.spec.replicas
    if want == 0:
        ready_c = (False, Reason.SCALED_TO_ZERO, "spec.replicas is 0")
    elif serving is None:
        ready_c = (False, Reason.NOT_SERVING, "no version is serving yet")
    elif ready >= want:
        ready_c = (
            True,
            Reason.ALL_REPLICAS_READY,
            f"{ready}/{want} replicas of {serving.version} ready",
        )
    elif ready > 0:  # serving, with less capacity than asked for (scaling up, pod lost)
        ready_c = (
            True,
            Reason.PARTIALLY_READY,
            f"{ready}/{want} replicas of {serving.version} ready",
        )
    else:
        ready_c = (False, Reason.NO_READY_REPLICAS, f"0/{want} replicas of {serving.version} ready")
    conditions = set_condition(conditions, Condition.READY, *ready_c, gen, now)
    pc, dc = plan.progressing, plan.degraded
    conditions = set_condition(
        conditions, Condition.PROGRESSING, pc.status, pc.reason, pc.message, gen, now
    )
    conditions = set_condition(
        conditions, Condition.DEGRADED, dc.status, dc.reason, dc.message, gen, now
    )

    status: dict[str, Any] = {
        "observedGeneration": gen,
        "replicas": current,
        "readyReplicas": ready,
        "selector": selector_string(svc.name),
        "url": status_url(svc),
        "conditions": [c for c in conditions if c["type"] in OWNED_CONDITIONS],
    }
    models = models_status(svc, plan, observed, prep)
    if models:
        status["models"] = models
    if plan.serving_version is not None:
        status["servedVersion"] = plan.serving_version
    if plan.serving_hash is not None:
        status["templateHash"] = plan.serving_hash
    if plan.rollout_version is not None:
        status["rolloutVersion"] = plan.rollout_version
    if plan.failed_hash is not None:
        status["failedTemplateHash"] = plan.failed_hash
        status["failedVersion"] = plan.failed_version
    return status


def compression_patch(svc: SlimSpecService, ratio: float, now_text: str) -> dict[str, Any] | None:
    """status.compression seed the reconciler writes, or None when the tuner's value stands.

    Tuning off: the ratio in force is the spec's, mirrored here for `kubectl get`.
    Tuning on: only initialise when the tuner has not written anything yet.
    """
    current: Mapping[str, Any] = svc.status.get("compression") or {}
    if svc.spec.tuning.enabled:
        if current.get("ratio") is not None:
            return None
        reason = Reason.INITIAL
    else:
        if current.get("ratio") is not None and float(current["ratio"]) == ratio:
            return None
        reason = Reason.SPEC
    return {"ratio": ratio, "reason": reason, "lastChangeTime": now_text}


def models_status(
    svc: SlimSpecService, plan: Plan, observed: Observed, prep: PrepStatus | None
) -> list[dict[str, Any]]:
    """status.models: the preparation of the served template and of the desired one."""
    out: list[dict[str, Any]] = []
    served = next((d for d in observed.deployments if d.template_hash == plan.serving_hash), None)
    if (
        served is not None
        and served.preparation_key
        and (prep is None or served.preparation_key != prep.prep.key)
    ):
        entry = {
            "version": served.version,
            "key": served.preparation_key,
            "job": job_name(svc.name, served.preparation_key),
            "state": "Succeeded",
            "calibration": "Calibrated" if served.artifact else "Disabled",
        }
        out.append(entry | ({"artifact": served.artifact} if served.artifact else {}))
    if prep is not None:
        p = prep.prep
        state = "Pending" if prep.state == "Missing" else prep.state
        entry = {"version": svc.spec.model.version, "key": p.key, "job": p.job_name, "state": state}
        if p.artifact is None:
            entry["calibration"] = "Disabled"
        else:
            entry["calibration"] = "Calibrated" if state == "Succeeded" else "Pending"
            entry["artifact"] = p.artifact
        if prep.message:
            entry["message"] = prep.message
        out.append(entry)
    return out


def refused(
    status: Mapping[str, Any], reason: str, message: str, generation: int, now: datetime
) -> dict[str, Any]:
    """`status` (the reconciler's fields) with the round refused: Degraded=True and
    Progressing=False with `reason`; Ready left as it was computed or last written."""
    out = {k: v for k, v in status.items() if k in OWNED_FIELDS}
    conditions: list[dict[str, Any]] = list(status.get("conditions") or [])
    if not any(c.get("type") == Condition.READY for c in conditions):
        conditions = set_condition(
            conditions, Condition.READY, False, reason, "not reconciled", generation, now
        )
    conditions = set_condition(
        conditions, Condition.PROGRESSING, False, reason, message, generation, now
    )
    conditions = set_condition(
        conditions, Condition.DEGRADED, True, reason, message, generation, now
    )
    out["conditions"] = [c for c in conditions if c["type"] in OWNED_CONDITIONS]
    out["observedGeneration"] = generation
    return out
