"""Scaling on the two real nodes, under real traffic through the Service, every
request counted (slimspec_testbed.scenarios.scaling):

- the operator's autoscaler (``autoscaling.mode: operator``, the in-cluster
  Prometheus's request rate) takes the resource from 1 replica to 2 under 4
  back-to-back clients and back to 1 under a trickle: 0 failed, the scale-down
  included (the removed pod drains what it holds);
- the two replicas land on different nodes (the operator's default spread);
- ``kubectl drain`` of the second node while 4 clients send requests: 0 failed, the
  PodDisruptionBudget refuses a second eviction while the evicted replica is away,
  and the replacement runs on the other node.

KEDA's mode is tests/e2e/test_keda.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from slimspec_operator.contract import TUNER_FIELD_MANAGER
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.node_cluster import NodeCluster
from slimspec_testbed.scenarios.keda import replica_writers
from slimspec_testbed.scenarios.scaling import (
    apply_and_wait,
    autoscaled_service,
    delete_service,
    drain_under_load,
    fixed_replicas,
    scale_cycle,
    wait_one_per_node,
)
from slimspec_testbed.scenarios.userpath import (
    SERVICE_NAMESPACE,
    cluster_ip,
)

from .conftest import record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.usefixtures("in_node", "operator_release"),
]

NAME = "scale"


@pytest.fixture(scope="module")
def scaled(
    in_node: None, node: NodeCluster, kube: KubeCluster, models_pv: str, prometheus: str
) -> Iterator[dict[str, Any]]:
    body = autoscaled_service(node.images, models_pv, prometheus, name=NAME)
    apply_and_wait(kube, body)
    yield body
    delete_service(kube, NAME)


@pytest.fixture(scope="module")
def base_url(in_node: None, kube: KubeCluster, scaled: dict[str, Any]) -> str:
    return f"http://{cluster_ip(kube, SERVICE_NAMESPACE, NAME)}:8080"


def test_load_adds_a_replica_and_a_trickle_removes_it_dropping_nothing(
    node: NodeCluster, kube: KubeCluster, scaled: dict[str, Any], base_url: str
) -> None:
    result = scale_cycle(kube, NAME, base_url, clients=4)
    record("scale_cycle", {k: v for k, v in result.items() if k not in ("timeline", "latencies")})
    assert not result["failures"], result["failures"]
    assert result["scale_failed_requests"] == 0
    assert result["scale_up_requests"]["requests"] > 0
    assert result["scale_down_requests"]["requests"] > 0
    # the spec went 1 -> 2 -> 1, written by the operator's autoscaler
    replicas = [row["spec_replicas"] for row in result["timeline"]]
    assert 2 in replicas and replicas[-1] == 1, replicas
    assert max(r for r in replicas if r is not None) == 2  # maxReplicas held
    assert result["last_autoscaling_status"].get("desiredReplicas") == 1
    # through the scale subresource, and no one else did
    assert replica_writers(kube, NAME) == {TUNER_FIELD_MANAGER}
    # the default spread put the two replicas on the two nodes
    assert result["nodes_at_two_replicas"] == sorted(n.name for n in node.nodes)


def test_a_drain_under_load_drops_nothing_and_the_budget_holds(
    node: NodeCluster, kube: KubeCluster, scaled: dict[str, Any], base_url: str
) -> None:
    kube.apply(fixed_replicas(scaled, 2))
    wait_one_per_node(kube, NAME, 2)
    drained = node.nodes[1].name
    result = drain_under_load(kube, NAME, base_url, drained, clients=4)
    record("drain", {k: v for k, v in result.items() if k not in ("timeline", "latencies")})
    assert result["drain_failed_requests"] == 0, result["failures"]
    assert result["drain_requests"]["requests"] > 0
    # the budget (maxUnavailable 1) refused a second eviction while one replica was away
    statuses = result["second_eviction_statuses"]
    assert statuses and statuses[0] == 429 and set(statuses[:-1]) <= {429}, statuses
    # the evicted replica runs again, on the node that was not drained
    assert len(result["pods_after"]) == 2
    assert set(result["pods_after"].values()) == {node.nodes[0].name}
    assert "evicting pod" in result["drain_output"] or "evicted" in result["drain_output"]
