"""The runtime ConfigMap watcher against the real kube-apiserver test bed."""

from __future__ import annotations

import time

import httpx
import pytest
from slimspec.server.service import ModelRef

pytestmark = pytest.mark.cluster


def gauge(base: str, name: str) -> float | None:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def wait_gauge(base: str, name: str, value: float, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while gauge(base, name) != pytest.approx(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stayed {gauge(base, name)}, expected {value}")
        time.sleep(0.1)


def test_configmap_changes_apply_without_restart(
    kube_cluster, namespace, make_server, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from kubernetes import client

    monkeypatch.setenv("KUBECONFIG", str(kube_cluster.kubeconfig))
    core = client.CoreV1Api(kube_cluster.api_client())
    cm = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="svc-runtime"),
        data={"compression_ratio": "0.4", "quality_threshold": "0.9"},
    )
    core.create_namespaced_config_map(namespace, cm)
    model = ModelRef("tiny-a", "tiny-a-draft", "v1", "float32")
    with make_server(model=model, runtime_configmap="svc-runtime", namespace=namespace) as base:
        wait_gauge(base, "slimspec_compression_ratio", 0.4)
        wait_gauge(base, "slimspec_quality_threshold", 0.9)
        core.patch_namespaced_config_map(
            "svc-runtime", namespace, {"data": {"compression_ratio": "0.6"}}
        )
        wait_gauge(base, "slimspec_compression_ratio", 0.6)
        r = httpx.post(f"{base}/infer", json={"input": "hi", "max_length": 3}, timeout=60)
        assert r.json()["compression_ratio"] == pytest.approx(0.6)  # in force at the draft step
        # an invalid value is logged and ignored; the server keeps the last good one
        core.patch_namespaced_config_map(
            "svc-runtime", namespace, {"data": {"compression_ratio": "lots"}}
        )
        time.sleep(1.0)
        assert gauge(base, "slimspec_compression_ratio") == pytest.approx(0.6)
        assert httpx.get(f"{base}/readyz").status_code == 200
