"""Fixtures of the end-to-end suite: the real node, its images, the user's path.

``node`` (package: up while tests/e2e runs, torn down after it): a
    :class:`~slimspec_testbed.node.node_cluster.NodeCluster` — containerd, kubelet, kube-proxy, CNI,
    and a control plane with scheduler and node lifecycle, in the node's own network
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
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.node_cluster import NodeCluster, running_node_cluster
from slimspec_testbed.scenarios.userpath import (
    CHART,
    MODELS_CLAIM,
    OPERATOR_NAMESPACE,
    RELEASE,
    SERVICE_NAMESPACE,
    models_volume,
    models_volume_dir,
    operator_values,
    service_namespace,
    wait_pods_ready,
)
from slimspec_testbed.tools import Helm, helm_env, tool_path


@pytest.fixture(scope="package")
def node() -> Iterator[NodeCluster]:
    with running_node_cluster() as running:
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
