"""SlimSpecService bodies the tests and benchmarks create (one definition each)."""

from __future__ import annotations

import copy
from typing import Any

GROUP, VERSION, PLURAL = "slimspec.io", "v1alpha1", "slimspecservices"


def sample_service(name: str = "chat", version: str = "v1", **spec: Any) -> dict[str, Any]:
    """Two replicas of a pair on a PVC (no kubelet runs the pods, so nothing loads it);
    ``spec`` keys replace the top-level defaults. No namespace: the caller's applies."""
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
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
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SlimSpecService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"version": "v1", "target": src, "draft": src}, **spec},
    }
