"""The operator against a real API server: create, status, scale, runtime ratio,
printer columns, metrics, delete (garbage collection)."""

from __future__ import annotations

import time

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.cluster.pods import PodDriver

from .conftest import HASH, Api, OperatorProcess, sample

pytestmark = pytest.mark.cluster

SELECTOR = "app.kubernetes.io/instance=chat"


def resource_versions(api: Api, namespace: str) -> dict[str, str]:
    out = {
        "ssvc": api.get()["metadata"]["resourceVersion"],
        "svc": api.core.read_namespaced_service("chat", namespace).metadata.resource_version,
        "cm": api.core.read_namespaced_config_map(
            "chat-runtime", namespace
        ).metadata.resource_version,
    }
    for d in api.deployments():
        out[d.metadata.name] = d.metadata.resource_version
    return out


def test_create_builds_objects_with_owner_refs_and_delete_collects_them(
    kube_cluster: KubeCluster, operator: OperatorProcess, api: Api, namespace: str
):
    created = api.create(sample(replicas=2))
    uid = created["metadata"]["uid"]
    (dep,) = api.wait(lambda: api.deployments() or None, what="engine Deployment")
    h = dep.metadata.labels[HASH]
    assert dep.metadata.name == f"chat-{h}"
    assert dep.spec.replicas == 2
    (owner,) = dep.metadata.owner_references
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "SlimSpecService",
        "chat",
        uid,
        True,
    )
    pod = dep.spec.template.spec
    c = pod.containers[0]
    assert c.readiness_probe.http_get.path == "/readyz"
    assert c.liveness_probe.http_get.path == "/healthz"
    assert c.resources.limits["nvidia.com/gpu"] == "1"
    assert c.security_context.run_as_user == 10001
    assert c.security_context.read_only_root_filesystem is True
    assert c.security_context.capabilities.drop == ["ALL"]
    assert pod.security_context.seccomp_profile.type == "RuntimeDefault"
    assert c.lifecycle.pre_stop._exec.command[0] == "python"
    env = {e.name: e for e in c.env}
    assert env["SLIMSPEC_RUNTIME_CONFIGMAP"].value == "chat-runtime"
    assert env["POD_NAMESPACE"].value_from.field_ref.field_path == "metadata.namespace"
    assert env["MODEL_VERSION"].value == "v1"

    svc = api.wait(lambda: api.core.read_namespaced_service("chat", namespace))
    assert svc.spec.selector[HASH] == h
    assert svc.spec.ports[0].port == 8080 and svc.spec.ports[0].target_port == "http"
    cm = api.core.read_namespaced_config_map("chat-runtime", namespace)
    assert cm.data == {
        "compression_ratio": "0.3",
        "quality_threshold": "0.95",
        "fallback_strategy": "auto",
    }
    for obj in (svc, cm):
        assert obj.metadata.owner_references[0].uid == uid
    sa = api.core.read_namespaced_service_account("chat-engine", namespace)
    assert sa.metadata.owner_references[0].uid == uid
    assert pod.service_account_name == "chat-engine"

    # the engines' identity can read its ConfigMap and nothing else
    token = kube_cluster.service_account_token(namespace, "chat-engine", create=False)
    with kube_cluster.api_client(token) as engine_api:
        core = client.CoreV1Api(engine_api)
        assert core.read_namespaced_config_map("chat-runtime", namespace).data
        # the engine's watcher lists+watches with a field selector (resourceNames allow it)
        sel = "metadata.name=chat-runtime"
        assert len(core.list_namespaced_config_map(namespace, field_selector=sel).items) == 1
        with pytest.raises(ApiException) as denied:
            core.read_namespaced_config_map("kube-root-ca.crt", namespace)
        assert denied.value.status == 403

    api.wait(
        lambda: api.get()["metadata"].get("finalizers") == ["slimspec.io/finalizer"],
        what="Kopf's finalizer, under our name",
    )
    t0 = time.monotonic()
    api.custom.delete_namespaced_custom_object(
        "slimspec.io", "v1alpha1", namespace, "slimspecservices", "chat"
    )

    def all_gone() -> bool:
        deps = api.deployments()
        svcs = api.core.list_namespaced_service(namespace).items
        cms = [
            c
            for c in api.core.list_namespaced_config_map(namespace).items
            if c.metadata.name == "chat-runtime"
        ]
        return not deps and not svcs and not cms

    api.wait(all_gone, timeout=60, what="garbage collection of owned objects")
    print(f"garbage collection took {time.monotonic() - t0:.1f}s")


def test_status_conditions_printer_columns_scale_and_ratio(
    kube_cluster: KubeCluster,
    operator: OperatorProcess,
    api: Api,
    namespace: str,
    pod_driver: PodDriver,
):
    api.create(sample(replicas=2))
    api.wait(
        lambda: api.condition("Progressing").get("reason") == "WaitingForReady",
        what="Progressing=WaitingForReady",
    )
    assert api.condition("Ready")["status"] == "False"
    with pod_driver.start(namespace, SELECTOR):
        # Ready turns True with the first ready replica (PartiallyReady): wait for all
        api.wait(
            lambda: api.condition("Ready").get("reason") == "AllReplicasReady",
            what="Ready=True, AllReplicasReady",
        )
        assert api.condition("Ready")["status"] == "True"
        st = api.get()["status"]
        assert st["readyReplicas"] == 2 and st["replicas"] == 2
        assert st["servedVersion"] == "v1" and "rolloutVersion" not in st
        assert st["selector"] == (
            "app.kubernetes.io/name=slimspec-engine,app.kubernetes.io/instance=chat"
        )
        assert st["observedGeneration"] == api.get()["metadata"]["generation"]
        assert api.condition("Degraded")["status"] == "False"
        assert api.condition("Progressing")["reason"] == "RolloutComplete"

        # level-based and idempotent: more reconcile rounds change nothing
        api.wait(lambda: api.condition("Progressing").get("reason") == "RolloutComplete")
        before = resource_versions(api, namespace)
        time.sleep(3.5)  # >= 3 timer rounds (SLIMSPEC_RECONCILE_INTERVAL=1)
        assert resource_versions(api, namespace) == before

        out = kube_cluster.kubectl("get", "ssvc", "chat", "-n", namespace).stdout
        header, row = out.splitlines()
        assert header.split() == [
            "NAME",
            "READY",
            "VERSION",
            "SERVING",
            "RATIO",
            "REPLICAS",
            "AVAILABLE",
            "URL",
            "AGE",
        ]
        url = f"http://chat.{namespace}.svc:8080"
        assert row.split()[:8] == ["chat", "True", "v1", "v1", "0.3", "2", "2", url]
        assert st["url"] == url

        # scale subresource -> Deployment replicas, no new Deployment
        (dep,) = api.deployments()
        kube_cluster.kubectl("scale", "ssvc/chat", "-n", namespace, "--replicas=3")
        api.wait(lambda: api.deployments()[0].spec.replicas == 3, what="Deployment at 3")
        api.wait(lambda: api.get()["status"].get("readyReplicas") == 3, what="3 ready")
        assert [d.metadata.name for d in api.deployments()] == [dep.metadata.name]

        ready_since = api.condition("Ready")["lastTransitionTime"]
        # ratio change -> ConfigMap only; the Deployment (template) stays
        api.patch_spec({"compression": {"ratio": 0.45}})
        api.wait(
            lambda: (
                api.core.read_namespaced_config_map("chat-runtime", namespace).data[
                    "compression_ratio"
                ]
                == "0.45"
            ),
            what="ratio in the ConfigMap",
        )
        api.wait(lambda: api.get()["status"]["compression"]["ratio"] == 0.45)
        assert [d.metadata.name for d in api.deployments()] == [dep.metadata.name]
        # Ready held the whole time: its transition time did not move
        assert api.condition("Ready")["lastTransitionTime"] == ready_since

    # the operator's own endpoints
    operator.get("/healthz", operator.liveness_port)  # 200, or urlopen raises
    metrics = operator.get("/metrics", operator.metrics_port)
    assert 'slimspec_operator_reconcile_total{result="ok"}' in metrics
    events = api.core.list_namespaced_event(namespace).items
    assert any(e.reason == "Creating" and e.involved_object.name == "chat" for e in events)


def test_tuned_ratio_reaches_configmap_without_waiting_for_the_timer(
    operator_kubeconfig, api: Api, namespace: str, tmp_path
):
    """Tuning on: the reconciler seeds status.compression from the spec, then follows
    what the tuner writes there (here: the test, as the tuner would), clamped to the
    spec's bounds, pushing it to the ConfigMap on the status event, not the timer."""
    op = OperatorProcess(operator_kubeconfig, namespace, tmp_path / "op.log")
    op.interval = "60"
    op.start()
    try:
        api.create(sample(replicas=1, tuning={"enabled": True}))
        api.wait(lambda: (api.get().get("status") or {}).get("compression"), what="seed")
        seed = api.get()["status"]["compression"]
        assert seed["ratio"] == 0.3 and seed["reason"] == "Initial"
        (dep,) = api.wait(lambda: api.deployments() or None)
        time.sleep(2)  # let Deployment events (which also trigger reconciles) die down

        def cm_ratio() -> str:
            return api.core.read_namespaced_config_map("chat-runtime", namespace).data[
                "compression_ratio"
            ]

        for written, expected in ((0.42, "0.42"), (0.9, "0.5")):
            patch = {"status": {"compression": {"ratio": written, "reason": "LatencyLow"}}}
            api.custom.patch_namespaced_custom_object_status(
                "slimspec.io", "v1alpha1", namespace, "slimspecservices", "chat", patch
            )
            api.wait(lambda e=expected: cm_ratio() == e, timeout=5, what=f"ConfigMap {expected}")
        assert [d.metadata.name for d in api.deployments()] == [dep.metadata.name]
    finally:
        op.stop()
        print(op.log()[-3000:])


def test_drift_is_repaired(operator: OperatorProcess, api: Api, namespace: str):
    """Level-based: objects deleted or edited by hand come back as the spec says."""
    api.create(sample(replicas=1))
    (dep,) = api.wait(lambda: api.deployments() or None, what="Deployment")
    api.wait(lambda: api.core.read_namespaced_service("chat", namespace))
    h = dep.metadata.labels[HASH]
    api.apps.delete_namespaced_deployment(dep.metadata.name, namespace)
    api.core.patch_namespaced_service("chat", namespace, {"spec": {"selector": {HASH: "x"}}})
    api.core.patch_namespaced_config_map(
        "chat-runtime", namespace, {"data": {"compression_ratio": "0.9"}}
    )

    def repaired() -> bool:
        deps = api.deployments()
        cm = api.core.read_namespaced_config_map("chat-runtime", namespace)
        return (
            [d.metadata.name for d in deps] == [dep.metadata.name]
            and deps[0].metadata.uid != dep.metadata.uid
            and api.service_selector()[HASH] == h
            and cm.data["compression_ratio"] == "0.3"
        )

    api.wait(repaired, timeout=20, what="Deployment, Service selector and ConfigMap restored")
