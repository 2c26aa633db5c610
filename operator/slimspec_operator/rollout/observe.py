"""What the reconciler reads from the cluster, as the rollout plan's input.

`observe` is the one read (the Deployments this resource owns and the Service it
selects with); `observe_deployment` and `service_hash` turn the API's objects
into the plan's plain types (pure).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from slimspec_operator.contract import HASH_LABEL, VERSION_LABEL
from slimspec_operator.kube.client import Kube
from slimspec_operator.kube.conditions import parse_time
from slimspec_operator.kube.ownership import owned_by
from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.rollout.model_prep import ARTIFACT_ANNOTATION, KEY_ANNOTATION
from slimspec_operator.rollout.plan import Observed, ObservedDeployment

Found = list[tuple[str, str, dict[str, Any] | None]]  # (kind, name, object or None)


def observe(kube: Kube, svc: SlimSpecService, now: datetime, found: Found) -> Observed:
    deps = kube.owned_deployments(svc.namespace, svc.name, svc.metadata.uid)
    service = next((o for k, _, o in found if k == "Service"), None)
    if service is not None and not owned_by(service, svc.metadata.uid):
        service = None  # someone else's: its selector says nothing about our versions
    return Observed(
        deployments=tuple(observe_deployment(d) for d in deps),
        service_hash=service_hash(service),
        failed_hash=svc.status.get("failedTemplateHash"),
        failed_version=svc.status.get("failedVersion"),
        now=now,
    )


def observe_deployment(d: Mapping[str, Any]) -> ObservedDeployment:
    meta, spec, status = d["metadata"], d.get("spec") or {}, d.get("status") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    created = meta.get("creationTimestamp")
    return ObservedDeployment(
        name=meta["name"],
        template_hash=labels.get(HASH_LABEL, ""),
        version=labels.get(VERSION_LABEL, ""),
        replicas=int(spec.get("replicas", 1)),
        ready_replicas=int(status.get("readyReplicas") or 0),
        current_replicas=int(status.get("replicas") or 0),
        created_at=parse_time(created) if created else datetime.now().astimezone(),
        generation=int(meta.get("generation") or 0),
        observed_generation=int(status.get("observedGeneration") or 0),
        preparation_key=annotations.get(KEY_ANNOTATION, ""),
        artifact=annotations.get(ARTIFACT_ANNOTATION, ""),
    )


def service_hash(service: Mapping[str, Any] | None) -> str | None:
    if not service:
        return None
    return ((service.get("spec") or {}).get("selector") or {}).get(HASH_LABEL)
