"""Shared namespaces: the operator never adopts, changes or deletes an object that its
resource does not own, on the real API server with the chart's RBAC."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from .conftest import Api, G, OperatorProcess, P, V, sample

pytestmark = pytest.mark.cluster


def _theirs(namespace: str) -> list[dict[str, Any]]:
    """A Service, ConfigMap and Role someone else made under the names the operator uses."""
    meta = {"namespace": namespace, "labels": {"owner": "payments"}}
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {**meta, "name": "chat"},
            "spec": {"selector": {"app": "payments"}, "ports": [{"port": 443, "name": "https"}]},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {**meta, "name": "chat-runtime"},
            "data": {"db": "postgres://payments"},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {**meta, "name": "chat-engine"},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
        },
    ]


def _read(api: Api, namespace: str) -> dict[str, Any]:
    rbac = client.RbacAuthorizationV1Api(api.client)
    objs = {
        "svc": api.core.read_namespaced_service("chat", namespace),
        "cm": api.core.read_namespaced_config_map("chat-runtime", namespace),
        "role": rbac.read_namespaced_role("chat-engine", namespace),
    }
    return {k: api.client.sanitize_for_serialization(v) for k, v in objs.items()}


def test_pre_existing_objects_are_left_alone_and_survive_deletion(
    operator: OperatorProcess, api: Api, namespace: str
) -> None:
    api.cluster.apply(_theirs(namespace), namespace)
    before = _read(api, namespace)

    api.create(sample(replicas=1))
    cond = api.wait(
        lambda: (c := api.condition("Degraded")).get("reason") == "ResourceConflict" and c,
        what="Degraded=ResourceConflict",
    )
    assert cond["status"] == "True"
    for text in ("Service chat", "ConfigMap chat-runtime", "Role chat-engine"):
        assert text in cond["message"], cond["message"]
    assert api.condition("Progressing")["reason"] == "ResourceConflict"
    assert "url" not in api.get()["status"]  # http://chat... would reach the payments pods

    time.sleep(3.5)  # >= 3 reconcile rounds (SLIMSPEC_RECONCILE_INTERVAL=1)
    assert _read(api, namespace) == before  # byte for byte, resourceVersion included
    assert api.deployments() == []  # and nothing else was written either
    with pytest.raises(ApiException) as absent:
        api.core.read_namespaced_service_account("chat-engine", namespace)
    assert absent.value.status == 404
    events = [
        e
        for e in api.core.list_namespaced_event(namespace).items
        if e.reason == "ResourceConflict" and e.involved_object.name == "chat"
    ]
    assert len(events) == 1 and events[0].type == "Warning"  # said once, not every round
    assert (events[0].count or 1) == 1

    api.custom.delete_namespaced_custom_object(G, V, namespace, P, "chat")
    api.wait(lambda: not api.custom.list_namespaced_custom_object(G, V, namespace, P)["items"])
    time.sleep(2)  # the garbage collector has had its chance
    assert _read(api, namespace) == before


def test_one_foreign_object_stops_the_whole_round_until_it_is_gone(
    operator: OperatorProcess, api: Api, namespace: str
) -> None:
    (_, cm, _) = _theirs(namespace)
    api.cluster.apply([cm], namespace)
    api.create(sample(replicas=1))
    api.wait(lambda: api.condition("Degraded").get("reason") == "ResourceConflict")
    assert api.deployments() == []
    api.core.delete_namespaced_config_map("chat-runtime", namespace)
    (dep,) = api.wait(lambda: api.deployments() or None, what="Deployment once the way is clear")
    api.wait(lambda: api.condition("Degraded").get("status") == "False", what="Degraded cleared")
    data = api.core.read_namespaced_config_map("chat-runtime", namespace).data
    assert data["compression_ratio"] == "0.3"
    assert dep.metadata.owner_references[0].name == "chat"
