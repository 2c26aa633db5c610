"""SlimSpecService bodies the tests and benchmarks create (one definition each): a
sample for the node-less operator tests, the tuning scenario's, and an examples/ file
pointed at the small model pair for the real node (tests/e2e, bench/rollout.py)."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from slimspec_operator.contract import API_VERSION, GROUP, PLURAL, VERSION
from slimspec_operator.rollout.manifests import owner_reference

from slimspec_testbed.node.images import ImageTags
from slimspec_testbed.tools import REPO_ROOT

__all__ = [
    "GROUP",
    "PLURAL",
    "VERSION",
    "sample_service",
    "service_from_example",
    "service_manifest",
    "with_version",
]


def sample_service(name: str = "chat", version: str = "v1", **spec: Any) -> dict[str, Any]:
    """Two replicas of a pair on a PVC (no kubelet runs the pods, so nothing loads it);
    ``spec`` keys replace the top-level defaults. No namespace: the caller's applies."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "SlimSpecService",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "model": {
                "version": version,
                "target": {"source": "pvc", "pvc": {"claimName": "models", "path": "t"}},
                "draft": {"source": "pvc", "pvc": {"claimName": "models", "path": "d"}},
            },
        },
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def service_manifest(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """SmolLM2-135M as target and draft (the tuning scenario's engine serves it locally)."""
    src = {"source": "huggingface", "huggingface": {"id": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    return {
        "apiVersion": API_VERSION,
        "kind": "SlimSpecService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"version": "v1", "target": src, "draft": src}, **spec},
    }


def service_from_example(
    images: ImageTags,
    model_path: str,
    *,
    name: str = "chat",
    version: str = "v1",
    replicas: int = 1,
    example: str = "slimspecservice-minimal.yaml",
    namespace: str = "llm",
    claim: str = "slimspec-models",
) -> dict[str, Any]:
    """An examples/ SlimSpecService on the small pair (the model drafting for itself),
    with the built engine image and CPU-sized resources (no GPU on this node)."""
    body = yaml.safe_load((REPO_ROOT / "examples" / example).read_text())
    body["metadata"] = {"name": name, "namespace": namespace}
    spec = body["spec"]
    spec["replicas"] = replicas
    spec["image"] = images.engine
    spec["imagePullPolicy"] = "Never"
    spec["model"]["version"] = version
    for role in ("target", "draft"):
        spec["model"][role]["pvc"]["path"] = model_path
        spec["model"][role]["pvc"]["claimName"] = claim
    spec["resources"] = {"gpu": 0, "memory": "2Gi", "cpu": "100m"}
    # A shared 2-core machine can take minutes to start a pod: keep a slow start
    # from being rolled back as a failed version.
    spec["rollout"] = {"readyTimeoutSeconds": 1800}
    return body


def with_version(body: dict[str, Any], version: str) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["spec"]["model"]["version"] = version
    return out


def controlled_by(owner: dict[str, Any]) -> list[dict[str, Any]]:
    """ownerReferences naming `owner` (a SlimSpecService as the API server returned it) as
    controller, as the reconciler puts them on the objects it makes (what the operator
    checks before it writes to one: slimspec_operator/kube/ownership.py)."""
    return [owner_reference(owner["metadata"]["name"], owner["metadata"]["uid"])]
