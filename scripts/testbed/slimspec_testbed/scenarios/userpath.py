"""The user's path on the real node, shared by tests/e2e and bench/rollout.py.

What a user does, with the test bed's images and model: a hostPath PersistentVolume
holding the model (``models_volume``), ``helm install`` of the chart with the built
operator image (``operator_values``), an ``examples/`` SlimSpecService pointed at the
small model pair (``service_from_example``), and clients sending requests through the
Service's ClusterIP (``LoadClients``), every failure counted by kind. Call the
cluster-facing helpers inside ``NodeCluster.entered()``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client

from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.images import ImageTags
from slimspec_testbed.scenarios.resources import GROUP, PLURAL, VERSION
from slimspec_testbed.tools import REPO_ROOT, cache_dir

EXAMPLES = REPO_ROOT / "examples"
CHART = REPO_ROOT / "charts" / "slimspec"
OPERATOR_NAMESPACE = "slimspec-system"
SERVICE_NAMESPACE = "llm"  # examples/namespace.yaml
RELEASE = "slimspec"
MODELS_CLAIM = "slimspec-models"  # examples/models-pvc.yaml
MODELS_PV = "slimspec-models-testbed"
ENGINE_UID = 10001
ENGINE_SELECTOR = "app.kubernetes.io/name=slimspec-engine"


# ------------------------------------------------------------------ the model volume


def models_volume_dir(model: Path) -> Path:
    """A copy of a fetched model under ``<cache>/node/pv/models/<name>``, owned by the
    engines' uid; the PV's root. Made once per model build: the cache's own files
    belong to whoever fetched them (root, weights mode 0600)."""
    root = cache_dir() / "node" / "pv"
    dest = root / "models" / model.name
    marker = ".slimspec-complete.json"
    if (
        not (dest / marker).exists()
        or (dest / marker).read_bytes() != (model / marker).read_bytes()
    ):
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    for path in [root, root / "models", dest, *dest.rglob("*")]:
        os.chown(path, ENGINE_UID, ENGINE_UID)
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


def service_namespace() -> dict[str, Any]:
    """examples/namespace.yaml: the services' namespace (restricted Pod Security)."""
    namespace: dict[str, Any] = yaml.safe_load((EXAMPLES / "namespace.yaml").read_text())
    namespace["metadata"]["name"] = SERVICE_NAMESPACE
    return namespace


def models_volume(root: Path) -> list[dict[str, Any]]:
    """The services' namespace, a hostPath PV at ``root`` and the claim of
    examples/models-pvc.yaml bound to it (read-only, no storage class)."""
    namespace = service_namespace()
    docs = list(yaml.safe_load_all((EXAMPLES / "models-pvc.yaml").read_text()))
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    pvc["metadata"]["namespace"] = SERVICE_NAMESPACE
    pvc["spec"] |= {
        "accessModes": ["ReadOnlyMany"],
        "storageClassName": "",
        "volumeName": MODELS_PV,
    }
    pvc["spec"]["resources"]["requests"]["storage"] = "1Gi"
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": MODELS_PV},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(root), "type": "Directory"},
            "claimRef": {"namespace": SERVICE_NAMESPACE, "name": MODELS_CLAIM},
        },
    }
    return [namespace, pv, pvc]


# ------------------------------------------------------------------ operator and service


def operator_values(images: ImageTags, tuning_tick_seconds: float = 1) -> dict[str, Any]:
    """Chart values: the built operator image (never pulled), the services' namespace
    watched (as docs/deploy.md installs it; the namespace must exist first), quicker
    tuning ticks."""
    repo, tag = images.operator.split(":")
    return {
        # keda: the operator may write ScaledObjects (tests/e2e/test_keda.py)
        "rbac": {"watchNamespaces": [SERVICE_NAMESPACE], "keda": True},
        "operator": {
            "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
            "extraEnv": [
                {"name": "SLIMSPEC_TUNING_TICK_SECONDS", "value": str(tuning_tick_seconds)}
            ],
        },
    }


def get_service(kube: KubeCluster, name: str) -> dict[str, Any]:
    with kube.api_client() as api:
        obj: Any = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, SERVICE_NAMESPACE, PLURAL, name
        )
    return dict(obj)


def pods(kube: KubeCluster, namespace: str, selector: str) -> list[Any]:
    """V1Pod objects (typed Any: the client's fields are all Optional)."""
    with kube.api_client() as api:
        return list(
            client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector).items
        )


def pod_ready(pod: Any) -> bool:
    conds = {c.type: c.status for c in (pod.status.conditions or [])}
    return (
        pod.metadata.deletion_timestamp is None
        and pod.status.phase == "Running"
        and conds.get("Ready") == "True"
    )


def wait_pods_ready(
    kube: KubeCluster, namespace: str, selector: str, timeout: float, count: int = 1
) -> list[Any]:
    def ready() -> list[Any]:
        found = [p for p in pods(kube, namespace, selector) if pod_ready(p)]
        return found if len(found) >= count else []

    return kube.wait_for(ready, timeout, f"{count} ready pod(s) {selector} in {namespace}")


def served(kube: KubeCluster, name: str, version: str) -> bool:
    """The version serves and nothing else of the resource runs (rollout finished)."""
    status = get_service(kube, name).get("status") or {}
    if status.get("servedVersion") != version or status.get("rolloutVersion"):
        return False
    sel = f"{ENGINE_SELECTOR},app.kubernetes.io/instance={name}"
    versions = {
        p.metadata.labels.get("slimspec.io/model-version")
        for p in pods(kube, SERVICE_NAMESPACE, sel)
    }
    return versions == {version}


def cluster_ip(kube: KubeCluster, namespace: str, name: str) -> str:
    with kube.api_client() as api:
        svc: Any = client.CoreV1Api(api).read_namespaced_service(name, namespace)
    return str(svc.spec.cluster_ip)


# ------------------------------------------------------------------ load through the Service


FAILURE_KINDS = ("refused", "reset", "timeout", "http_5xx", "http_4xx", "other")


@dataclass
class Result:
    start: float  # time.monotonic()
    end: float
    ok: bool
    kind: str  # "ok" or one of FAILURE_KINDS
    detail: str = ""


def _classify(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "refused"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ReadError | httpx.WriteError | httpx.RemoteProtocolError):
        return "reset"
    return "other"


@dataclass
class LoadClients:
    """``clients`` threads, each with its own keep-alive HTTP client (as an SDK
    would), posting short /infer requests to ``base_url`` back to back (or
    ``think_s`` apart: a lighter load).

    Every request is recorded with its outcome: a connection refused, a reset or
    closed connection, a timeout, a 5xx or another status all count as failures."""

    base_url: str
    clients: int = 4
    max_length: int = 4
    timeout_s: float = 300.0  # the engine's own default request timeout
    prompt: str = "The capital of France is"
    think_s: float = 0.0
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _worker(self, index: int) -> None:
        body = {"input": f"{self.prompt} ({index})", "max_length": self.max_length}
        with httpx.Client(base_url=self.base_url, timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    resp = http.post("/infer", json=body)
                    code = resp.status_code
                    if code == 200 and "output" in resp.json():
                        res = Result(t0, time.monotonic(), True, "ok")
                    else:
                        kind = "http_5xx" if code >= 500 else "http_4xx"
                        res = Result(t0, time.monotonic(), False, kind, f"{code} {resp.text[:200]}")
                except Exception as exc:  # every failure is a data point
                    res = Result(t0, time.monotonic(), False, _classify(exc), repr(exc)[:200])
                with self._lock:
                    self.results.append(res)
                if not res.ok:
                    time.sleep(0.2)  # a client backs off a little, then tries again
                elif self.think_s:
                    self._stop.wait(self.think_s)

    def start(self) -> LoadClients:
        for i in range(self.clients):
            thread = threading.Thread(target=self._worker, args=(i,), name=f"load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> LoadClients:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 10)
        return self

    def snapshot(self) -> list[Result]:
        with self._lock:
            return list(self.results)

    def between(self, start: float, end: float) -> list[Result]:
        return [r for r in self.snapshot() if r.start >= start and r.start < end]

    def wait_for_requests(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(r.ok for r in self.snapshot()) < count:
            if time.monotonic() > deadline:
                got = summary(self.snapshot())
                raise TimeoutError(f"fewer than {count} requests succeeded in {timeout}s: {got}")
            time.sleep(0.2)


def summary(results: list[Result]) -> dict[str, Any]:
    kinds = Counter(r.kind for r in results)
    failed = [r for r in results if not r.ok]
    first: dict[str, str] = {}
    for r in failed:
        first.setdefault(r.kind, r.detail)
    return {
        "requests": len(results),
        "failed": len(failed),
        "by_kind": dict(kinds),
        "first_failure_of_each_kind": first,
    }


def latencies(results: list[Result]) -> list[float]:
    return sorted(r.end - r.start for r in results if r.ok)


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def wait_until(fn: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


# ------------------------------------------------------------------ in-cluster Prometheus


PROMETHEUS_NAMESPACE = "monitoring"


def prometheus_manifests(images: ImageTags, interval: str = "2s") -> list[dict[str, Any]]:
    """Prometheus in the cluster with examples/prometheus/prometheus.yml (Kubernetes
    pod discovery, the relabelling the chart's PodMonitor does) and the example rules;
    RBAC to list and watch pods, as the example's header asks for."""
    config = yaml.safe_load((EXAMPLES / "prometheus" / "prometheus.yml").read_text())
    config["global"] |= {"scrape_interval": interval, "evaluation_interval": interval}
    rules = (EXAMPLES / "prometheus" / "slimspec-rules.yaml").read_text()
    name, ns = "prometheus", PROMETHEUS_NAMESPACE
    labels = {"app.kubernetes.io/name": "prometheus"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": ns}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "slimspec-testbed-prometheus"},
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "slimspec-testbed-prometheus"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "slimspec-testbed-prometheus",
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns},
            "data": {"prometheus.yml": yaml.safe_dump(config), "slimspec-rules.yaml": rules},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "serviceAccountName": name,
                        "securityContext": {"runAsUser": 65534, "runAsGroup": 65534,
                                            "runAsNonRoot": True, "fsGroup": 65534},
                        "containers": [
                            {
                                "name": "prometheus",
                                "image": images.prometheus,
                                "imagePullPolicy": "Never",
                                "args": [
                                    "--config.file=/etc/prometheus/prometheus.yml",
                                    "--storage.tsdb.path=/prometheus",
                                    "--web.listen-address=:9090",
                                ],
                                "ports": [{"name": "web", "containerPort": 9090}],
                                "readinessProbe": {"httpGet": {"path": "/-/ready", "port": "web"},
                                                   "periodSeconds": 2},
                                "volumeMounts": [
                                    {"name": "config", "mountPath": "/etc/prometheus"},
                                    {"name": "data", "mountPath": "/prometheus"},
                                ],
                            }
                        ],
                        "volumes": [
                            {"name": "config", "configMap": {"name": name}},
                            {"name": "data", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "selector": labels,
                "ports": [{"name": "web", "port": 9090, "targetPort": "web"}],
            },
        },
    ]  # fmt: skip


def prometheus_query(url: str, promql: str) -> list[dict[str, Any]]:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    resp.raise_for_status()
    return list(resp.json()["data"]["result"])
