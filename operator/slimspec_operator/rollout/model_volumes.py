"""Where the engine pods find the target and draft weights (pure).

`source: pvc`: the claim mounted under /models (one volume per claim, shared by
both roles when they use the same claim; read-only unless the spec says
otherwise). `source: huggingface`, and the calibration artifact: the model cache
claim, mounted read-only at /models/cache, where the version's preparation Job
(model_prep.py) has put them before the Deployment exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.rollout.model_prep import (
    CACHE_MOUNT,
    CACHE_VOLUME,
    MODELS_DIR,
    Preparation,
    cache_claim_name,
    pvc_volume_names,
    source_path,
)

Manifest = dict[str, Any]


@dataclass
class ModelVolumes:
    paths: dict[str, str] = field(default_factory=dict)  # role (target/draft) -> directory
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)  # for the engine container
    calibration: str | None = None  # the artifact directory, when the operator calibrated


def model_volumes(svc: SlimSpecService, prep: Preparation | None) -> ModelVolumes:
    out = ModelVolumes()
    claims = pvc_volume_names(svc)
    for role, src in (("target", svc.spec.model.target), ("draft", svc.spec.model.draft)):
        out.paths[role] = source_path(src, claims)
    for src in (svc.spec.model.target, svc.spec.model.draft):
        if src.pvc is None:
            continue
        vol = claims[src.pvc.claim_name]
        if any(v["name"] == vol for v in out.volumes):
            continue
        claim = {"claimName": src.pvc.claim_name, "readOnly": src.pvc.read_only}
        out.volumes.append({"name": vol, "persistentVolumeClaim": claim})
        mount = {"name": vol, "mountPath": f"{MODELS_DIR}/{vol}", "readOnly": src.pvc.read_only}
        out.mounts.append(mount)
    if prep is not None:
        cache: Manifest = {"claimName": cache_claim_name(svc), "readOnly": True}
        out.volumes.append({"name": CACHE_VOLUME, "persistentVolumeClaim": cache})
        out.mounts.append({"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT, "readOnly": True})
        out.calibration = prep.artifact
    return out
