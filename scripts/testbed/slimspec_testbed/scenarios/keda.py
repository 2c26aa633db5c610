"""KEDA on the real nodes: its operator and external-metrics API server, built from
its Go module (install.sh keda), installed from the project's own minimal manifests
(config/minimal, rendered at build time) with three changes the test bed needs:

- the images are the locally built one (never pulled);
- no leader election (one replica each; quicker to start);
- the metrics API server reaches the operator's gRPC service at its ClusterIP, with
  the authority set to the Service's DNS name (the name in KEDA's own certificate):
  the test bed has no cluster DNS.

``install_keda`` applies it and waits until the external metrics API is Available
through the API server's aggregation layer. Call it inside ``NodeCluster.entered()``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from slimspec_operator.contract import KEDA_GROUP, KEDA_PLURAL, KEDA_VERSION

from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.images import ImageTags
from slimspec_testbed.scenarios.userpath import (
    SERVICE_NAMESPACE,
    cluster_ip,
    get_service,
    wait_pods_ready,
    wait_until,
)
from slimspec_testbed.tools import cache_dir, fail, pinned_versions

KEDA_NAMESPACE = "keda"
EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"
OPERATOR_SERVICE = "keda-operator"
ADAPTER = "keda-metrics-apiserver"
GRPC_PORT = 9666
READY_S = 300  # the operator makes its certificates first; kubelet then mounts them


def manifests_file() -> Path:
    return cache_dir() / "keda" / pinned_versions()["KEDA_VERSION"] / "keda.yaml"


def keda_manifests(images: ImageTags) -> list[dict[str, Any]]:
    path = manifests_file()
    if not path.is_file():
        fail(f"{path} missing: run `bash scripts/testbed/install.sh keda` (or `make test`)")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    out = []
    for doc in docs:
        doc = copy.deepcopy(doc)
        if doc["kind"] == "Deployment":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            container["image"] = images.keda
            container["imagePullPolicy"] = "Never"
            container["args"] = [
                "--leader-elect=false" if a == "--leader-elect" else a for a in container["args"]
            ]
        out.append(doc)
    return out


def _adapter_args(doc: dict[str, Any], operator_ip: str) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    container["args"] = [
        *container["args"],
        f"--metrics-service-address={operator_ip}:{GRPC_PORT}",
        f"--metrics-service-grpc-authority={OPERATOR_SERVICE}.{KEDA_NAMESPACE}.svc",
    ]
    return doc


def api_service_available(kube: KubeCluster, name: str = EXTERNAL_METRICS_API) -> bool:
    with kube.api_client() as api:
        svc: Any = client.ApiregistrationV1Api(api).read_api_service(name)
    conditions = (svc.status.conditions if svc.status else None) or []
    return any(c.type == "Available" and c.status == "True" for c in conditions)


def _apply(kube: KubeCluster, docs: list[dict[str, Any]]) -> None:
    # Server-side, as KEDA's docs install it: its CRDs are too big for the
    # last-applied annotation a client-side apply writes.
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                 input=yaml.safe_dump_all(docs), timeout=120)  # fmt: skip


def install_keda(kube: KubeCluster, images: ImageTags) -> None:
    """KEDA's operator and metrics API server Ready, the external metrics API served."""
    docs = keda_manifests(images)
    is_adapter = [d["kind"] == "Deployment" and d["metadata"]["name"] == ADAPTER for d in docs]
    _apply(kube, [d for d, a in zip(docs, is_adapter, strict=True) if not a])
    operator_ip = cluster_ip(kube, KEDA_NAMESPACE, OPERATOR_SERVICE)
    _apply(
        kube, [_adapter_args(d, operator_ip) for d, a in zip(docs, is_adapter, strict=True) if a]
    )
    wait_pods_ready(kube, KEDA_NAMESPACE, "app=keda-operator", READY_S)
    wait_pods_ready(kube, KEDA_NAMESPACE, f"app={ADAPTER}", READY_S)
    wait_until(
        lambda: api_service_available(kube),
        READY_S,
        f"APIService {EXTERNAL_METRICS_API} Available",
        2.0,
    )


def keda_mode(body: dict[str, Any]) -> dict[str, Any]:
    """The same SlimSpecService with autoscaling.mode keda."""
    out = copy.deepcopy(body)
    out["spec"]["autoscaling"]["mode"] = "keda"
    return out


def scaled_object(kube: KubeCluster, name: str) -> dict[str, Any]:
    """The ScaledObject the operator wrote for SlimSpecService `name`."""
    with kube.api_client() as api:
        obj: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
            KEDA_GROUP, KEDA_VERSION, SERVICE_NAMESPACE, KEDA_PLURAL, name
        )
    return dict(obj)


def scaled_object_ready(kube: KubeCluster, name: str) -> bool:
    """KEDA took the ScaledObject up (its Ready condition; its HPA exists then)."""
    conditions = (scaled_object(kube, name).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def replica_writers(kube: KubeCluster, name: str) -> set[str]:
    """Field managers that set the SlimSpecService's spec.replicas through its scale
    subresource (KEDA's HPA: kube-controller-manager; the operator's own autoscaler:
    slimspec-tuner)."""
    fields = get_service(kube, name)["metadata"].get("managedFields") or []
    return {
        f["manager"]
        for f in fields
        if f.get("subresource") == "scale"
        and "f:replicas" in ((f.get("fieldsV1") or {}).get("f:spec") or {})
    }


def uninstall_keda(kube: KubeCluster, images: ImageTags) -> None:
    text = yaml.safe_dump_all(keda_manifests(images))
    kube.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=text,
                 check=False, timeout=120)  # fmt: skip
