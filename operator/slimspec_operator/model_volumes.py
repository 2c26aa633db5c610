"""Where the engine pods find the target and draft weights (pure).

`source: pvc`: the claim mounted read-only under /models (one volume per claim,
shared by both roles when they use the same claim). `source: huggingface`: an init
container runs `slimspec fetch` into a per-pod cache volume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec import ModelSource, SlimSpecService

Manifest = dict[str, Any]

MODELS_DIR = "/models"
CACHE_MOUNT = f"{MODELS_DIR}/cache"


@dataclass
class ModelVolumes:
    paths: dict[str, str] = field(default_factory=dict)  # role (target/draft) -> directory
    volumes: list[Manifest] = field(default_factory=list)
    mounts: list[Manifest] = field(default_factory=list)  # for the engine container
    init_containers: list[Manifest] = field(default_factory=list)  # without securityContext


def _fetch_container(svc: SlimSpecService, role: str, repo: str, revision: str) -> Manifest:
    return {
        "name": f"fetch-{role}",
        "image": svc.spec.image,
        "imagePullPolicy": svc.spec.image_pull_policy,
        "command": ["slimspec", "fetch"],
        "args": ["--hf", repo, "--revision", revision, "--out", f"{CACHE_MOUNT}/{role}"],
        "env": [{"name": "HF_HOME", "value": f"{CACHE_MOUNT}/.hf"}],
        "volumeMounts": [
            {"name": "model-cache", "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
    }


def model_volumes(svc: SlimSpecService) -> ModelVolumes:
    out = ModelVolumes()
    claims: dict[str, str] = {}  # claim name -> volume name; one volume per claim
    roles: list[tuple[str, ModelSource]] = [
        ("target", svc.spec.model.target),
        ("draft", svc.spec.model.draft),
    ]
    for role, src in roles:
        if src.source == "pvc" and src.pvc is not None:
            vol = claims.get(src.pvc.claim_name)
            if vol is None:
                vol = f"model-pvc-{len(claims)}"
                claims[src.pvc.claim_name] = vol
                claim = {"claimName": src.pvc.claim_name, "readOnly": src.pvc.read_only}
                out.volumes.append({"name": vol, "persistentVolumeClaim": claim})
                mount = {"name": vol, "mountPath": f"{MODELS_DIR}/{vol}"}
                out.mounts.append(mount | {"readOnly": src.pvc.read_only})
            sub = src.pvc.path.strip("/")
            out.paths[role] = f"{MODELS_DIR}/{vol}" + (f"/{sub}" if sub else "")
        elif src.source == "huggingface" and src.huggingface is not None:
            hf = src.huggingface
            out.paths[role] = f"{CACHE_MOUNT}/{role}"
            out.init_containers.append(_fetch_container(svc, role, hf.id, hf.revision))
    if out.init_containers:
        out.volumes.append({"name": "model-cache", "emptyDir": {}})
        out.mounts.append({"name": "model-cache", "mountPath": CACHE_MOUNT})
    return out
