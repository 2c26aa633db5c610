"""Sample resources shared by the operator's unit tests."""

from __future__ import annotations

import copy
from typing import Any

BASE: dict[str, Any] = {
    "apiVersion": "slimspec.io/v1alpha1",
    "kind": "SlimSpecService",
    "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 3},
    "spec": {
        "replicas": 2,
        "image": "ghcr.io/slimspec/engine:0.1.0",
        "model": {
            "version": "v1",
            "target": {"source": "pvc", "pvc": {"claimName": "models", "path": "qwen-1.5b"}},
            "draft": {"source": "pvc", "pvc": {"claimName": "models", "path": "qwen-0.5b"}},
        },
    },
}


def body(**spec_overrides: Any) -> dict[str, Any]:
    b = copy.deepcopy(BASE)
    b["spec"].update(spec_overrides)
    return b
