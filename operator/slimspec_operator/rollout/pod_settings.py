"""The spec's pod settings as pieces of a pod template (pure).

Placement (node selector, tolerations, affinity, spread, priority, runtime class,
pull secrets), the user's pod labels and annotations under the operator's own,
the engine container's resources and extra env/envFrom/args, and the size-limited
scratch volumes (/tmp, the engine cache, /dev/shm). manifests.py assembles the
engine pod from these; model_prep.py gives the preparation Job the same placement.
"""

from __future__ import annotations

from typing import Any

from slimspec_operator.resource.spec import SlimSpecService

Manifest = dict[str, Any]

GPU_RESOURCE = "nvidia.com/gpu"
SHM_DIR = "/dev/shm"
ENGINE_UID = 10001  # the image's non-root user


def _non_root() -> Manifest:
    """What the pod and each of its containers both say: the image's non-root user,
    the runtime's default seccomp profile."""
    identity = {"runAsUser": ENGINE_UID, "runAsGroup": ENGINE_UID}
    return {"runAsNonRoot": True, **identity, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> Manifest:
    """The restricted Pod Security Standard, for every container the operator makes."""
    locked = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True}
    return {**_non_root(), **locked, "capabilities": {"drop": ["ALL"]}}


def pod_security() -> Manifest:
    return {**_non_root(), "fsGroup": ENGINE_UID}


# Soft: one engine per node where the scheduler can, but a pod is never left Pending
# for it (a drain of one of two nodes must still place the evicted replica).
NODE_SPREAD: Manifest = {
    "maxSkew": 1,
    "topologyKey": "kubernetes.io/hostname",
    "whenUnsatisfiable": "ScheduleAnyway",
}


def with_node_spread(svc: SlimSpecService) -> SlimSpecService:
    """`svc` with the operator's default spread over nodes (NODE_SPREAD), unless its
    spec.pod places the engines relative to each other already (spread constraints,
    pod affinity or anti-affinity of its own: the user's choice), or its model cache
    is a one-node volume (ReadWriteOnce/ReadWriteOncePod: a replica spread to another
    node could not mount it)."""
    pod = svc.spec.pod
    affinity = pod.affinity
    if (
        pod.topology_spread_constraints
        or (
            affinity is not None
            and (affinity.pod_affinity is not None or affinity.pod_anti_affinity is not None)
        )
        or svc.spec.model_cache.access_mode != "ReadWriteMany"
    ):
        return svc
    spread_pod = pod.model_copy(update={"topology_spread_constraints": [dict(NODE_SPREAD)]})
    return svc.model_copy(update={"spec": svc.spec.model_copy(update={"pod": spread_pod})})


def placement(svc: SlimSpecService, engine_selector: Manifest) -> Manifest:
    """Pod-spec fields that decide where and how the pods run (only those set).

    `engine_selector` (matchLabels of the engine pods) fills the labelSelector of a
    topology spread constraint that has none: spreading "these pods" is what one
    means here, and a constraint without a selector would count no pods at all.
    """
    pod = svc.spec.pod
    out: Manifest = {}
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in pod.tolerations
        ]
    if pod.affinity is not None:
        affinity = pod.affinity.model_dump(by_alias=True, exclude_none=True)
        if affinity:
            out["affinity"] = affinity
    if pod.topology_spread_constraints:
        out["topologySpreadConstraints"] = [
            {"labelSelector": {"matchLabels": dict(engine_selector)}, **c}
            for c in pod.topology_spread_constraints
        ]
    if pod.priority_class_name:
        out["priorityClassName"] = pod.priority_class_name
    if pod.runtime_class_name:
        out["runtimeClassName"] = pod.runtime_class_name
    if pod.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": s.name} for s in pod.image_pull_secrets]
    return out


def pod_metadata(
    svc: SlimSpecService, labels: dict[str, str], annotations: dict[str, str]
) -> Manifest:
    """The user's pod labels and annotations with the operator's on top (they win)."""
    pod = svc.spec.pod
    return {
        "labels": {**pod.labels, **labels},
        "annotations": {**pod.annotations, **annotations},
    }


def engine_resources(svc: SlimSpecService) -> Manifest:
    """Requests cpu+memory; limits memory (the request unless set), cpu only if set, GPUs."""
    r = svc.spec.resources
    limits: Manifest = {"memory": str(r.limits.memory if r.limits.memory is not None else r.memory)}
    if r.limits.cpu is not None:
        limits["cpu"] = str(r.limits.cpu)
    if r.gpu > 0:
        limits[GPU_RESOURCE] = str(r.gpu)
    return {"requests": {"cpu": str(r.cpu), "memory": str(r.memory)}, "limits": limits}


def extra_env(svc: SlimSpecService) -> list[Manifest]:
    """The user's variables, after the operator's (the CRD refuses the operator's names)."""
    return [e.model_dump(by_alias=True, exclude_none=True) for e in svc.spec.engine.env]


def extra_env_from(svc: SlimSpecService) -> list[Manifest]:
    return [e.model_dump(by_alias=True, exclude_none=True) for e in svc.spec.engine.env_from]


def extra_args(svc: SlimSpecService) -> list[str]:
    return list(svc.spec.engine.args)


def scratch_volumes(svc: SlimSpecService, cache_dir: str) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, engine mounts) for /tmp, the engine cache and /dev/shm, each size-limited.

    An emptyDir without a limit can fill the node's disk (or, for /dev/shm, its
    memory) and get every pod on it evicted; /dev/shm is in memory and counts
    against the container's memory limit.
    """
    r = svc.spec.resources
    volumes = [
        {"name": "tmp", "emptyDir": {"sizeLimit": str(r.tmp_size)}},
        {"name": "cache", "emptyDir": {"sizeLimit": str(r.cache_size)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(r.shm_size)}},
    ]
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": cache_dir},
        {"name": "dshm", "mountPath": SHM_DIR},
    ]
    return volumes, mounts
