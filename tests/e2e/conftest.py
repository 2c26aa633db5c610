"""Fixtures of the end-to-end suite: the real node, its images, the user's path.

``node`` (package: up while tests/e2e runs, torn down after it): a
    :class:`~slimspec_testbed.node.node_cluster.NodeCluster` of two nodes — each with
    containerd, kubelet, kube-proxy and CNI in its own network namespace, joined by a
    link — and a control plane with scheduler and node lifecycle in the first node's
    namespace (``slimspec_testbed.node.node_cluster``).
``in_node`` (module): runs the module's tests in the node's network namespace, where
    pod and Service addresses and the API server are. Modules that talk to the cluster
    use it (``pytestmark = pytest.mark.usefixtures("in_node")``), and so do their
    module-scoped fixtures (pytest sets those up before function-scoped ones).
``kube`` (package): ``node.cluster``, the admin handle.
``models_pv`` (package): examples/namespace.yaml and the claim of
    examples/models-pvc.yaml, bound to a hostPath PersistentVolume holding the small
    real model (SmolLM2-135M) under ``models/<name>``; yields that path in the claim.
``operator_release`` (package): ``helm install`` of charts/slimspec with the built
    operator image into ``slimspec-system``, operator pod Running and Ready.
``prometheus`` (package): Prometheus in the cluster, finding the engines by pod
    discovery; yields its URL (a ClusterIP) for ``spec.prometheus.url``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.node_cluster import NodeCluster, running_node_cluster
from slimspec_testbed.scenarios.userpath import (
    CHART,
    MODELS_CLAIM,
    OPERATOR_NAMESPACE,
    PROMETHEUS_NAMESPACE,
    RELEASE,
    SERVICE_NAMESPACE,
    cluster_ip,
    models_volume,
    models_volume_dir,
    operator_values,
    prometheus_manifests,
    service_namespace,
    wait_pods_ready,
)
from slimspec_testbed.tools import REPO_ROOT, Helm, helm_env, tool_path

RESULTS = REPO_ROOT / "tests" / "e2e" / ".results"


def record(name: str, data: dict[str, Any]) -> None:
    """Measurements for the report (the suite's figures, not assertions)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    print(f"{name}: {json.dumps(data)[:2000]}")


@pytest.fixture(scope="package")
def node() -> Iterator[NodeCluster]:
    with running_node_cluster(nodes=2) as running:
        yield running


@pytest.fixture(scope="module")
def in_node(node: NodeCluster) -> Iterator[None]:
    node.check_alive()
    with node.entered():
        yield


@pytest.fixture(scope="package")
def kube(node: NodeCluster) -> KubeCluster:
    return node.cluster


@pytest.fixture(scope="package")
def models_pv(node: NodeCluster, small_real_model: Path) -> str:
    root = models_volume_dir(small_real_model)
    with node.entered():
        node.cluster.apply(models_volume(root))

        def bound() -> bool:
            out = node.cluster.kubectl(
                "get", "pvc", MODELS_CLAIM, "-n", SERVICE_NAMESPACE,
                "-o", "jsonpath={.status.phase}",
            )  # fmt: skip
            return out.stdout.strip() == "Bound"

        node.cluster.wait_for(bound, 60, f"PVC {MODELS_CLAIM} bound")
    return f"models/{small_real_model.name}"


@pytest.fixture(scope="package")
def helm_node(node: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    home = tmp_path_factory.mktemp("helm")
    return Helm(path=tool_path("helm"), env=helm_env(node.cluster.env, home))


@pytest.fixture(scope="package")
def operator_release(node: NodeCluster, helm_node: Helm) -> Iterator[str]:
    values = node.node_dir / "operator-values.yaml"
    values.write_text(yaml.safe_dump(operator_values(node.images)))
    with node.entered():
        node.cluster.apply(service_namespace())  # docs/deploy.md: before the install
        helm_node(
            "install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
            "-f", str(values), "--wait", "--timeout", "5m", timeout=360,
        )  # fmt: skip
        wait_pods_ready(
            node.cluster, OPERATOR_NAMESPACE, "app.kubernetes.io/name=slimspec-operator", 180
        )
    yield RELEASE
    with node.entered():
        helm_node("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, check=False)


@pytest.fixture(scope="package")
def prometheus(node: NodeCluster) -> str:
    with node.entered():
        node.cluster.apply(prometheus_manifests(node.images))
        wait_pods_ready(
            node.cluster, PROMETHEUS_NAMESPACE, "app.kubernetes.io/name=prometheus", 180
        )
        return f"http://{cluster_ip(node.cluster, PROMETHEUS_NAMESPACE, 'prometheus')}:9090"
