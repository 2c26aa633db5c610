"""Pod settings on the real API server: the Deployment carries the placement, pod
metadata, limits, scratch sizes and extras of the spec; the PodDisruptionBudget
exists; a spec the API server accepts but the Deployment cannot be built from is
reported as Degraded/InvalidSpec once, not retried hot."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator

import pytest
from kubernetes import client
from slimspec_testbed.cluster.handle import KubeCluster

from .conftest import Api, OperatorProcess, sample
from .test_pod_settings import ENGINE, POD

pytestmark = pytest.mark.cluster

RESOURCES = {
    "gpu": 0,
    "memory": "2Gi",
    "cpu": "1",
    "limits": {"cpu": "2", "memory": "3Gi"},
    "shmSize": "512Mi",
    "tmpSize": "256Mi",
    "cacheSize": "2Gi",
}


@pytest.fixture
def classes(kube_cluster: KubeCluster) -> Iterator[None]:
    """The PriorityClass and RuntimeClass the pods name (admission refuses pods naming
    ones that do not exist)."""
    with kube_cluster.api_client() as c:
        sched, node = client.SchedulingV1Api(c), client.NodeV1Api(c)
        meta = client.V1ObjectMeta(name="inference-high")
        with contextlib.suppress(client.ApiException):
            sched.create_priority_class(client.V1PriorityClass(metadata=meta, value=1000))
        rc = client.V1RuntimeClass(metadata=client.V1ObjectMeta(name="nvidia"), handler="nvidia")
        with contextlib.suppress(client.ApiException):
            node.create_runtime_class(rc)
    yield


def test_engines_without_placement_get_the_default_spread_over_nodes(
    operator: OperatorProcess, api: Api, namespace: str
) -> None:
    api.create(sample(replicas=2))
    (dep,) = api.wait(lambda: api.deployments() or None, what="engine Deployment")
    (spread,) = api.client.sanitize_for_serialization(dep.spec.template)["spec"][
        "topologySpreadConstraints"
    ]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "chat"


def test_deployment_and_pdb_carry_the_pod_settings(
    classes: None, operator: OperatorProcess, api: Api, namespace: str
) -> None:
    api.create(sample(replicas=2, pod=POD, engine=ENGINE, resources=RESOURCES))
    (dep,) = api.wait(lambda: api.deployments() or None, what="engine Deployment")
    template = api.client.sanitize_for_serialization(dep.spec.template)
    pod = template["spec"]
    assert pod["nodeSelector"] == POD["nodeSelector"]
    assert pod["tolerations"] == POD["tolerations"]
    assert pod["affinity"] == POD["affinity"]
    assert pod["priorityClassName"] == "inference-high"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    zone = pod["topologySpreadConstraints"][0]
    assert zone["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "chat"
    assert template["metadata"]["labels"]["team"] == "search"
    assert (
        template["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"]
        == "false"
    )
    c = pod["containers"][0]
    assert c["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "3Gi"},
    }
    assert c["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert c["envFrom"] == ENGINE["envFrom"]
    assert c["args"][-2:] == ["--num-draft-tokens", "4"]
    empty = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
    assert empty == {
        "tmp": {"sizeLimit": "256Mi"},
        "cache": {"sizeLimit": "2Gi"},
        "dshm": {"medium": "Memory", "sizeLimit": "512Mi"},
    }
    # the ReplicaSet's pods pass admission with these settings (the classes exist)
    pods = api.wait(
        lambda: (
            api.core.list_namespaced_pod(
                namespace, label_selector="app.kubernetes.io/instance=chat"
            ).items
            or None
        ),
        what="engine pods",
    )
    assert pods[0].spec.priority == 1000

    policy = client.PolicyV1Api(api.client)
    pdb = api.wait(lambda: policy.read_namespaced_pod_disruption_budget("chat", namespace))
    assert pdb.spec.max_unavailable == 1
    assert pdb.spec.selector.match_labels == {
        "app.kubernetes.io/name": "slimspec-engine",
        "app.kubernetes.io/instance": "chat",
    }
    assert pdb.metadata.owner_references[0].name == "chat"
    api.patch_spec({"disruptionBudget": {"enabled": False}})
    api.wait(
        lambda: not policy.list_namespaced_pod_disruption_budget(namespace).items,
        what="PDB removed when turned off",
    )


BAD_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Sometimes"}]}]
        }
    }
}


def _reconciles(operator: OperatorProcess) -> dict[str, float]:
    text = operator.get("/metrics", operator.metrics_port)
    found = re.findall(r'slimspec_operator_reconcile_total\{result="(\w+)"\} ([0-9.e+]+)', text)
    return {k: float(v) for k, v in found}


def test_a_deployment_the_api_server_refuses_sets_invalid_spec(
    operator: OperatorProcess, api: Api, namespace: str
) -> None:
    api.create(sample(replicas=1, pod={"affinity": BAD_AFFINITY}))
    cond = api.wait(
        lambda: (c := api.condition("Degraded")).get("reason") == "InvalidSpec" and c,
        what="Degraded=InvalidSpec",
    )
    assert cond["status"] == "True"
    assert '"Sometimes": not a valid selector operator' in cond["message"], cond["message"]
    assert len(cond["message"]) <= 512
    assert api.condition("Progressing")["reason"] == "InvalidSpec"
    assert api.deployments() == []
    before = _reconciles(operator)
    time.sleep(3.5)  # >= 3 timer rounds: each tries once, none retries hot or fails
    after = _reconciles(operator)
    assert after.get("error", 0) == before.get("error", 0) == 0
    assert after["ok"] - before["ok"] <= 6, (before, after)
    events = [
        e
        for e in api.core.list_namespaced_event(namespace).items
        if e.reason == "InvalidSpec" and e.involved_object.name == "chat"
    ]
    assert len(events) == 1 and (events[0].count or 1) == 1
    # fixed: the next round builds it
    api.patch_spec({"pod": {"affinity": None}})
    api.wait(lambda: api.deployments() or None, what="Deployment after the fix")
    api.wait(lambda: api.condition("Degraded").get("status") == "False", what="Degraded cleared")
