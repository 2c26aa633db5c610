"""An idle operator leaves the API server alone: with 20 settled SlimSpecServices
it sends (almost) no request in a minute, as the API server itself counts them (a
FlowSchema that matches only the operator's ServiceAccount). Everything it needs
to know arrives through its watches; its timers fire (every second here) but
look only at what the last round left behind (bench/operator_scale.py measures
the same at 1, 100 and 300 resources)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from slimspec_testbed.cluster.handle import KubeCluster

from .conftest import OPERATOR_NS, Api, OperatorProcess, sample

pytestmark = pytest.mark.cluster

RESOURCES = 20
WINDOW_S = 60
# Per resource per minute. The old 10 s reconcile timer cost about 110; an idle
# resource now costs none, so what is left is the operator's own watches.
BOUND = 0.5
FLOW = "slimspec-operator-idle-test"
METRIC = "apiserver_flowcontrol_dispatched_requests_total"


@pytest.fixture
def counted(kube_cluster: KubeCluster) -> Iterator[None]:
    """A FlowSchema for the operator's ServiceAccount, on the priority level the
    built-in service-accounts schema would give it."""
    account = {"name": "slimspec-operator", "namespace": OPERATOR_NS}
    anything = ["*"]
    everything = dict(verbs=anything, apiGroups=anything, resources=anything)
    everything |= {"clusterScope": True, "namespaces": anything}
    flow = {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW},
        "spec": {
            "matchingPrecedence": 8000,
            "priorityLevelConfiguration": {"name": "workload-low"},
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [{"kind": "ServiceAccount", "serviceAccount": account}],
                    "resourceRules": [everything],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }
            ],
        },
    }
    kube_cluster.apply(flow)
    try:
        yield
    finally:
        kube_cluster.kubectl("delete", "flowschema", FLOW, "--ignore-not-found")


def requests_so_far(cluster: KubeCluster) -> float:
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(METRIC + "{") and f'flow_schema="{FLOW}"' in line
    )


def test_settled_resources_cost_no_api_requests(
    kube_cluster: KubeCluster, counted: None, operator: OperatorProcess, api: Api
) -> None:
    names = [f"idle-{i}" for i in range(RESOURCES)]
    for name in names:
        api.create(sample(name, replicas=1))

    def settled() -> bool:
        listed = api.apps.list_namespaced_deployment(api.ns).items
        deployments = {d.metadata.labels["app.kubernetes.io/instance"] for d in listed}
        statuses = [api.get(n).get("status") or {} for n in names]
        return deployments >= set(names) and all(
            s.get("observedGeneration") == 1 and "url" in s for s in statuses
        )

    api.wait(settled, timeout=90, what=f"{RESOURCES} resources reconciled")
    time.sleep(5)  # the Deployments' own status churn passes

    before = requests_so_far(kube_cluster)
    time.sleep(WINDOW_S)
    sent = requests_so_far(kube_cluster) - before
    per_resource_min = sent / RESOURCES / (WINDOW_S / 60)
    print(f"idle: {sent:.0f} requests in {WINDOW_S} s = {per_resource_min:.3f}/resource/min")
    assert per_resource_min <= BOUND, operator.log()[-3000:]
