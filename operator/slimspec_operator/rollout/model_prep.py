"""Model preparation: downloads and calibration, once per model version (pure).

When a source is `huggingface` or calibration is on, a version's engines do not
fetch anything themselves: a Job downloads the hub models into the model cache
volume (a PersistentVolumeClaim) and then runs `slimspec calibrate`, and only
when it has succeeded does the rollout create the version's Deployment, whose
pods mount the cache read-only. So all replicas of a version share one download
and one calibration, and a restart or a scale-up downloads nothing.

Layout of the cache volume (mounted at /models/cache everywhere):

    hub/<16 hex of repo@revision>/   one hub snapshot (shared by versions that use it)
    calibration/<preparation key>/   the calibration artifact of one preparation

The preparation key is a hash of everything the Job's result depends on (hub
sources, and with calibration: the model paths, the calibration settings, the
image and the device), so the same inputs are prepared once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from slimspec_operator.contract import GROUP, INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER, NAME_LABEL
from slimspec_operator.resource.spec import ModelSource, SecretKeyRef, SlimSpecService
from slimspec_operator.rollout.pod_settings import (
    container_security,
    engine_resources,
    placement,
    pod_metadata,
    pod_security,
)

Manifest = dict[str, Any]

MODELS_DIR = "/models"
CACHE_MOUNT = f"{MODELS_DIR}/cache"
CACHE_VOLUME = "model-cache"
PREP_NAME = "slimspec-model-prep"  # app.kubernetes.io/name of the Job's pods (not an engine)
KEY_ANNOTATION = f"{GROUP}/preparation-key"
ARTIFACT_ANNOTATION = f"{GROUP}/calibration-artifact"
BACKOFF_LIMIT = 2

State = Literal["Missing", "Pending", "Running", "Succeeded", "Failed"]


@dataclass(frozen=True)
class Download:
    role: str  # target | draft
    repo: str
    revision: str
    token: SecretKeyRef | None
    path: str  # where the snapshot lands (inside the pods)


@dataclass(frozen=True)
class Preparation:
    key: str  # 10 hex digits
    downloads: tuple[Download, ...]
    artifact: str | None  # calibration artifact directory, when calibration is on
    job_name: str


def _hash(value: Any, digits: int) -> str:
    canon = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:digits]


def hub_path(repo: str, revision: str) -> str:
    return f"{CACHE_MOUNT}/hub/{_hash(f'{repo}@{revision}', 16)}"


def job_name(name: str, key: str) -> str:
    # Job names are pod label values (63 at most); the resource's name has 52 at most.
    return f"{name}-prep-{key[:5]}"


def cache_claim_name(svc: SlimSpecService) -> str:
    return svc.spec.model_cache.claim_name or f"{svc.name}-model-cache"


def source_path(src: ModelSource, pvc_volumes: Mapping[str, str]) -> str:
    """Where a role's model directory is inside the pods (pvc_volumes: claim -> volume)."""
    if src.huggingface is not None:
        return hub_path(src.huggingface.id, src.huggingface.revision)
    assert src.pvc is not None  # the spec guarantees one of the two
    sub = src.pvc.path.strip("/")
    base = f"{MODELS_DIR}/{pvc_volumes[src.pvc.claim_name]}"
    return base + (f"/{sub}" if sub else "")


def pvc_volume_names(svc: SlimSpecService) -> dict[str, str]:
    """claim name -> volume name (`model-pvc-<i>`), one volume per claim."""
    out: dict[str, str] = {}
    for src in (svc.spec.model.target, svc.spec.model.draft):
        if src.pvc is not None and src.pvc.claim_name not in out:
            out[src.pvc.claim_name] = f"model-pvc-{len(out)}"
    return out


def preparation(svc: SlimSpecService) -> Preparation | None:
    """What the version's Job prepares; None when nothing needs preparing."""
    spec = svc.spec
    roles = (("target", spec.model.target), ("draft", spec.model.draft))
    downloads: dict[str, Download] = {}
    for role, src in roles:
        hf = src.huggingface
        if hf is not None:
            path = hub_path(hf.id, hf.revision)
            downloads.setdefault(path, Download(role, hf.id, hf.revision, hf.token_secret, path))
    calibrate = spec.calibration.enabled
    if not downloads and not calibrate:
        return None
    inputs: dict[str, Any] = {"hub": sorted((d.repo, d.revision) for d in downloads.values())}
    if calibrate:
        volumes = pvc_volume_names(svc)
        inputs["calibration"] = {
            "target": source_path(spec.model.target, volumes),
            "draft": source_path(spec.model.draft, volumes),
            "corpus": spec.calibration.corpus,
            "args": spec.calibration.args,
            "image": spec.image,
            "gpu": spec.resources.gpu > 0,
        }
    key = _hash(inputs, 10)
    artifact = f"{CACHE_MOUNT}/calibration/{key}" if calibrate else None
    return Preparation(key, tuple(downloads.values()), artifact, job_name(svc.name, key))


def cache_claim(svc: SlimSpecService, owner: Manifest) -> Manifest | None:
    """The cache PersistentVolumeClaim the operator creates; None when the spec names one."""
    mc = svc.spec.model_cache
    if mc.claim_name:
        return None
    spec: Manifest = {
        "accessModes": [mc.access_mode],
        "resources": {"requests": {"storage": str(mc.size)}},
    }
    if mc.storage_class_name:
        spec["storageClassName"] = mc.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {**owner, "name": cache_claim_name(svc)},
        "spec": spec,
    }


# ---------------------------------------------------------------- the Job


def _fetch_container(svc: SlimSpecService, d: Download, hf_endpoint: str | None) -> Manifest:
    env: list[Manifest] = [
        # The image is offline by default (HF_HUB_OFFLINE=1, so engines never reach
        # for a hub); the download step is the one place that must go online.
        {"name": "HF_HUB_OFFLINE", "value": "0"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
    ]
    if hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hf_endpoint})
    if d.token is not None:  # from the Secret at pod start; never in the manifest or a log
        ref = {"name": d.token.name, "key": d.token.key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return {
        "name": f"fetch-{d.role}",
        "image": svc.spec.image,
        "imagePullPolicy": svc.spec.image_pull_policy,
        "command": ["slimspec", "fetch"],
        "args": ["--hf", d.repo, "--revision", d.revision, "--out", d.path],
        "env": env,
        "volumeMounts": [
            {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": container_security(),
    }


def _calibrate_container(svc: SlimSpecService, prep: Preparation) -> Manifest:
    spec = svc.spec
    volumes = pvc_volume_names(svc)
    assert prep.artifact is not None
    args = [
        "--target",
        source_path(spec.model.target, volumes),
        "--draft",
        source_path(spec.model.draft, volumes),
        "--out",
        prep.artifact,
        "--corpus",
        spec.calibration.corpus,
        "--device",
        "cuda" if spec.resources.gpu > 0 else "cpu",
        *spec.calibration.args,
    ]
    mounts: list[Manifest] = [
        {"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    for vol in volumes.values():
        mounts.append({"name": vol, "mountPath": f"{MODELS_DIR}/{vol}", "readOnly": True})
    return {
        "name": "calibrate",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["slimspec", "calibrate"],
        "args": args,
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "HF_HOME", "value": "/tmp/hf"}],
        "volumeMounts": mounts,
        "resources": engine_resources(svc),
        "securityContext": container_security(),
    }


def prep_labels(name: str, key: str) -> dict[str, str]:
    return {
        NAME_LABEL: PREP_NAME,
        INSTANCE_LABEL: name,
        MANAGED_BY_LABEL: MANAGER,
        KEY_ANNOTATION: key,
    }


def prep_job(
    svc: SlimSpecService,
    prep: Preparation,
    owner: Manifest,
    service_account: str,
    hf_endpoint: str | None = None,
) -> Manifest:
    """The Job: one container per download, then calibration (steps run in order as
    init containers; the last one is the Job's container)."""
    spec = svc.spec
    steps = [_fetch_container(svc, d, hf_endpoint) for d in prep.downloads]
    if prep.artifact is not None:
        steps.append(_calibrate_container(svc, prep))
    r = spec.resources
    volumes: list[Manifest] = [
        {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache_claim_name(svc)}},
        {"name": "tmp", "emptyDir": {"sizeLimit": str(r.tmp_size)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(r.shm_size)}},
    ]
    if prep.artifact is not None:
        for claim, vol in pvc_volume_names(svc).items():
            pvc: Manifest = {"claimName": claim, "readOnly": True}
            volumes.append({"name": vol, "persistentVolumeClaim": pvc})
    labels = prep_labels(svc.name, prep.key)
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "serviceAccountName": service_account,
        "automountServiceAccountToken": False,  # the steps never call the API server
        "securityContext": pod_security(),
        **placement(svc, {}),
        "volumes": volumes,
        "containers": steps[-1:],
    }
    pod_spec.pop("topologySpreadConstraints", None)  # spreading is about the engines
    if len(steps) > 1:
        pod_spec["initContainers"] = steps[:-1]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            **owner,
            "name": prep.job_name,
            "labels": labels,
            "annotations": {KEY_ANNOTATION: prep.key},
        },
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "activeDeadlineSeconds": spec.model_cache.job_timeout_seconds,
            "template": {"metadata": pod_metadata(svc, labels, {}), "spec": pod_spec},
        },
    }


def job_state(job: Mapping[str, Any] | None) -> tuple[State, str]:
    """(state, short message) of a preparation Job as the API server reports it."""
    if job is None:
        return "Missing", ""
    status = job.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            return "Succeeded", ""
        if cond.get("type") == "Failed":
            why = cond.get("reason") or "Failed"
            text = (cond.get("message") or "").strip()
            return "Failed", f"{why}: {text}"[:256] if text else why
    return ("Running" if status.get("active") else "Pending"), ""
