"""The control plane is real: schema validation, controllers, RBAC, GC."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from slimspec_testbed.cluster import control_plane
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.cluster.pods import PodDriver
from slimspec_testbed.tools import pinned_versions

pytestmark = pytest.mark.cluster

GROUP = "testbed.slimspec.dev"

CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["ratio"],
                                "properties": {
                                    "ratio": {"type": "number", "minimum": 0, "maximum": 0.95}
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_server_is_the_pinned_kubernetes_build(kube_cluster: KubeCluster) -> None:
    with kube_cluster.api_client() as api:
        info = client.VersionApi(api).get_code()
    assert info.git_version == pinned_versions()["K8S_VERSION"]


def test_kubectl_uses_cluster_env(kube_cluster: KubeCluster, namespace: str) -> None:
    out = kube_cluster.kubectl("get", "namespace", namespace, "-o", "name").stdout
    assert out.strip() == f"namespace/{namespace}"
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    assert "configmap/c created" in kube_cluster.apply(cm, namespace)
    got = kube_cluster.kubectl("get", "cm", "c", "-n", namespace, "-o", "jsonpath={.data.k}")
    assert got.stdout == "v"


def test_stale_workdirs_of_dead_runs_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=control_plane.WORKDIR_PREFIX))
    (stale / "owner.pid").write_text(str(dead.pid))
    live = Path(tempfile.mkdtemp(prefix=control_plane.WORKDIR_PREFIX))
    (live / "owner.pid").write_text(str(os.getpid()))
    control_plane.remove_stale_workdirs()
    assert not stale.exists()
    assert live.exists()
    shutil.rmtree(live)


def _widget(name: str, ratio: object) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"ratio": ratio},
    }


def test_crd_schema_rejects_invalid_object(kube_cluster: KubeCluster, namespace: str) -> None:
    with kube_cluster.api_client() as api:
        ext = client.ApiextensionsV1Api(api)
        try:
            ext.create_custom_resource_definition(CRD)
        except ApiException as exc:
            if exc.status != 409:  # already there from an earlier test in this session
                raise
        custom = client.CustomObjectsApi(api)

        def established() -> bool:
            crd = ext.read_custom_resource_definition(CRD["metadata"]["name"])
            return any(
                c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
            )

        kube_cluster.wait_for(established, what="CRD established")
        create = kube_cluster.wait_for(
            lambda: custom.create_namespaced_custom_object(
                GROUP, "v1", namespace, "widgets", _widget("ok", 0.3)
            ),
            what="valid Widget accepted",
        )
        assert create["spec"]["ratio"] == 0.3
        with pytest.raises(ApiException) as err:
            custom.create_namespaced_custom_object(
                GROUP, "v1", namespace, "widgets", _widget("bad", 2)
            )
    assert err.value.status == 422
    # Readable: names the field and the rule. (v1.36.3 prints a float bound as "0".)
    assert "spec.ratio" in err.value.body
    assert "should be less than or equal to" in err.value.body


def _deployment(name: str, replicas: int, image: str) -> client.V1Deployment:
    labels = {"app": name}
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[client.V1Container(name="main", image=image)]),
            ),
        ),
    )


def _available(dep: client.V1Deployment) -> str | None:
    for cond in dep.status.conditions or []:
        if cond.type == "Available":
            return str(cond.status)
    return None


def test_deployment_rollout_with_pod_driver(
    kube_cluster: KubeCluster, namespace: str, pod_driver: PodDriver
) -> None:
    with kube_cluster.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment(namespace, _deployment("web", 2, "example/web:1"))
        pods = kube_cluster.wait_for(
            lambda: (
                [p for p in core.list_namespaced_pod(namespace, label_selector="app=web").items]
                if len(core.list_namespaced_pod(namespace, label_selector="app=web").items) == 2
                else None
            ),
            what="ReplicaSet to create 2 pods",
        )
        assert all(p.status.phase == "Pending" for p in pods)  # no kubelet: nothing runs them
        assert len(apps.list_namespaced_replica_set(namespace).items) == 1
        assert _available(apps.read_namespaced_deployment("web", namespace)) != "True"

        assert sorted(pod_driver.mark(namespace, "app=web")) == sorted(
            p.metadata.name for p in pods
        )
        dep = kube_cluster.wait_deployment_available(namespace, "web")
        assert dep.status.ready_replicas == 2

        # A rolling update completes while a background driver plays kubelet.
        with pod_driver.start(namespace, "app=web") as handle:
            patch = {"spec": {"template": {"spec": {"containers": [
                {"name": "main", "image": "example/web:2"}
            ]}}}}  # fmt: skip
            apps.patch_namespaced_deployment("web", namespace, patch)
            kube_cluster.wait_for(
                lambda: (
                    apps.read_namespaced_deployment("web", namespace).status.observed_generation
                    == 2
                ),
                what="deployment controller to observe generation 2",
            )
            kube_cluster.wait_deployment_available(namespace, "web")
            kube_cluster.wait_for(
                lambda: (
                    {
                        p.spec.containers[0].image
                        for p in core.list_namespaced_pod(namespace, label_selector="app=web").items
                    }
                    == {"example/web:2"}
                ),
                what="old pods to be gone",
            )
        assert handle.errors == []
        assert len(apps.list_namespaced_replica_set(namespace).items) == 2


def test_service_gets_endpoints_of_ready_pods(
    kube_cluster: KubeCluster, namespace: str, pod_driver: PodDriver
) -> None:
    with kube_cluster.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        disc = client.DiscoveryV1Api(api)
        apps.create_namespaced_deployment(namespace, _deployment("svc", 1, "example/svc:1"))
        core.create_namespaced_service(
            namespace,
            client.V1Service(
                metadata=client.V1ObjectMeta(name="svc"),
                spec=client.V1ServiceSpec(
                    selector={"app": "svc"}, ports=[client.V1ServicePort(port=80)]
                ),
            ),
        )
        kube_cluster.wait_for(
            lambda: core.list_namespaced_pod(namespace, label_selector="app=svc").items,
            what="pod created",
        )
        pod_driver.mark(namespace, "app=svc")

        def ready_endpoints() -> list[str]:
            slices = disc.list_namespaced_endpoint_slice(
                namespace, label_selector="kubernetes.io/service-name=svc"
            ).items
            return [
                addr
                for s in slices
                for e in s.endpoints or []
                if e.conditions and e.conditions.ready
                for addr in e.addresses
            ]

        addrs = kube_cluster.wait_for(ready_endpoints, what="ready endpoint in EndpointSlice")
        pod = core.list_namespaced_pod(namespace, label_selector="app=svc").items[0]
        assert addrs == [pod.status.pod_ip]
        assert pod.spec.node_name == kube_cluster.node_name


def test_not_ready_pods_keep_deployment_unavailable(
    kube_cluster: KubeCluster, namespace: str, pod_driver: PodDriver
) -> None:
    with kube_cluster.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment(namespace, _deployment("sick", 1, "example/sick:1"))
        kube_cluster.wait_for(
            lambda: core.list_namespaced_pod(namespace, label_selector="app=sick").items,
            what="pod created",
        )
        assert pod_driver.mark(namespace, "app=sick", ready=False)
        pod = core.list_namespaced_pod(namespace, label_selector="app=sick").items[0]
        assert pod.status.phase == "Running"
        time.sleep(1.5)  # give the controllers time to (wrongly) count it
        dep = apps.read_namespaced_deployment("sick", namespace)
        assert not dep.status.ready_replicas
        assert _available(dep) == "False"


def test_service_account_without_rights_is_forbidden(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    token = kube_cluster.service_account_token(namespace, "nobody")
    with kube_cluster.api_client(token=token) as api:
        core = client.CoreV1Api(api)
        with pytest.raises(ApiException) as err:
            core.list_namespaced_config_map(namespace)
        assert err.value.status == 403
        assert f"system:serviceaccount:{namespace}:nobody" in err.value.body

        rbac = client.RbacAuthorizationV1Api(kube_cluster.api_client())
        rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "read-cm"},
                "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "read-cm"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                            "name": "read-cm"},
                "subjects": [{"kind": "ServiceAccount", "name": "nobody",
                              "namespace": namespace}],
            },
        )  # fmt: skip
        rbac.api_client.close()
        kube_cluster.wait_for(lambda: core.list_namespaced_config_map(namespace), what="access")
        with pytest.raises(ApiException) as err:  # still only what the Role grants
            core.list_namespaced_secret(namespace)
        assert err.value.status == 403


def test_service_account_kubeconfig_works_with_kubectl(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    kubeconfig = kube_cluster.service_account_kubeconfig(namespace, "viewer")
    proc = kube_cluster.kubectl(
        f"--kubeconfig={kubeconfig}", "get", "pods", "-n", namespace, check=False
    )
    assert proc.returncode != 0
    assert "forbidden" in proc.stderr.lower()


def test_owner_reference_garbage_collection(kube_cluster: KubeCluster, namespace: str) -> None:
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        parent = core.create_namespaced_config_map(
            namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="parent"))
        )
        owner = client.V1OwnerReference(
            api_version="v1", kind="ConfigMap", name="parent", uid=parent.metadata.uid
        )
        core.create_namespaced_config_map(
            namespace,
            client.V1ConfigMap(
                metadata=client.V1ObjectMeta(name="child", owner_references=[owner])
            ),
        )
        core.delete_namespaced_config_map("parent", namespace)

        def child_gone() -> bool:
            try:
                core.read_namespaced_config_map("child", namespace)
            except ApiException as exc:
                return exc.status == 404
            return False

        kube_cluster.wait_for(child_gone, timeout=30, what="garbage collector to delete child")


def test_namespace_with_running_pods_is_deleted(
    kube_cluster: KubeCluster, pod_driver: PodDriver
) -> None:
    """The reaper plays kubelet for terminating pods, so namespaces do go away."""
    ns = kube_cluster.create_namespace()
    with kube_cluster.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        apps.create_namespaced_deployment(ns, _deployment("gone", 2, "example/gone:1"))
        kube_cluster.wait_for(
            lambda: len(core.list_namespaced_pod(ns).items) == 2, what="2 pods created"
        )
        pod_driver.mark(ns)
        kube_cluster.wait_deployment_available(ns, "gone")
        core.delete_namespace(ns)  # graceful: pods get a deletionTimestamp first

        def gone() -> bool:
            try:
                core.read_namespace(ns)
            except ApiException as exc:
                return exc.status == 404
            return False

        kube_cluster.wait_for(gone, timeout=60, what=f"namespace {ns} to be deleted")
