"""KEDA for real on the two nodes (slimspec_testbed.scenarios.keda): KEDA's operator
and external-metrics API server built from its Go module, registered through the API
server's aggregation layer; a SlimSpecService with ``autoscaling.mode: keda`` gets the
ScaledObject the operator writes, KEDA's HPA scales the resource through its scale
subresource from the in-cluster Prometheus's request rate — 1 replica to 2 under 4
clients and back under a trickle, every request counted, and the operator never
writing ``replicas`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from slimspec_operator.contract import API_VERSION, KIND, TUNER_FIELD_MANAGER
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.node_cluster import NodeCluster
from slimspec_testbed.scenarios.keda import (
    install_keda,
    keda_mode,
    replica_writers,
    scaled_object,
    scaled_object_ready,
    uninstall_keda,
)
from slimspec_testbed.scenarios.scaling import (
    apply_and_wait,
    autoscaled_service,
    delete_service,
    scale_cycle,
)
from slimspec_testbed.scenarios.userpath import SERVICE_NAMESPACE, cluster_ip, wait_until

from .conftest import record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.usefixtures("in_node", "operator_release"),
]

NAME = "scale-keda"


@pytest.fixture(scope="module")
def keda(in_node: None, node: NodeCluster, kube: KubeCluster) -> Iterator[None]:
    install_keda(kube, node.images)
    yield
    uninstall_keda(kube, node.images)


@pytest.fixture(scope="module")
def scaled(
    keda: None, node: NodeCluster, kube: KubeCluster, models_pv: str, prometheus: str
) -> Iterator[dict[str, Any]]:
    body = keda_mode(autoscaled_service(node.images, models_pv, prometheus, name=NAME))
    apply_and_wait(kube, body)
    wait_until(lambda: scaled_object_ready(kube, NAME), 180, "ScaledObject Ready", 1.0)
    yield body
    delete_service(kube, NAME)


def test_the_scaled_object_targets_the_service_and_keda_made_its_hpa(
    kube: KubeCluster, scaled: dict[str, Any]
) -> None:
    so = scaled_object(kube, NAME)
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": API_VERSION, "kind": KIND, "name": NAME}
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    with kube.api_client() as api:
        hpa: Any = client.AutoscalingV2Api(api).read_namespaced_horizontal_pod_autoscaler(
            f"keda-hpa-{NAME}", SERVICE_NAMESPACE
        )
    assert hpa.spec.scale_target_ref.kind == KIND
    assert (hpa.spec.min_replicas, hpa.spec.max_replicas) == (1, 2)
    # the HPA reads KEDA's metric through the aggregation layer
    assert hpa.spec.metrics[0].type == "External"


def test_keda_adds_a_replica_under_load_and_removes_it_dropping_nothing(
    kube: KubeCluster, scaled: dict[str, Any]
) -> None:
    base_url = f"http://{cluster_ip(kube, SERVICE_NAMESPACE, NAME)}:8080"
    result = scale_cycle(kube, NAME, base_url, clients=4)
    record(
        "keda_scale_cycle", {k: v for k, v in result.items() if k not in ("timeline", "latencies")}
    )
    assert not result["failures"], result["failures"]
    assert result["scale_failed_requests"] == 0
    assert result["scale_up_requests"]["requests"] > 0
    assert result["scale_down_requests"]["requests"] > 0
    replicas = [row["spec_replicas"] for row in result["timeline"]]
    assert 2 in replicas and replicas[-1] == 1, replicas
    assert max(r for r in replicas if r is not None) == 2
    # KEDA's HPA set replicas; the operator's own autoscaler never did
    writers = replica_writers(kube, NAME)
    assert writers and TUNER_FIELD_MANAGER not in writers, writers
