"""Fixtures for the operator's cluster tests: CRD, least-privilege identity, and the
operator itself running as a real subprocess (`python -m slimspec_operator`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.scenarios.resources import sample_service as sample  # noqa: F401 (tests import it here)
from slimspec_testbed.tools import free_port

from tests.support.chart_rbac import chart_operator_role_all_modes

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "slimspecservice.yaml"
G, V, P = "slimspec.io", "v1alpha1", "slimspecservices"
OPERATOR_NS = "slimspec-system"
HASH = "slimspec.io/template-hash"


@pytest.fixture(scope="session")
def operator_kubeconfig(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """CRD installed; a ServiceAccount bound to exactly the chart's operator rules
    (tests/support/chart_rbac.py: the modes these tests run in, nothing else)."""
    kube_cluster.kubectl("apply", "-f", str(CRD))
    kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{P}.{G}", "--timeout=30s")
    role = chart_operator_role_all_modes(kube_cluster.env, "slimspec-operator")
    role_file = tmp_path_factory.mktemp("rbac") / "operator-role.yaml"
    role_file.write_text(yaml.safe_dump(role))
    kube_cluster.kubectl("apply", "-f", str(role_file))
    with contextlib.suppress(Exception):
        kube_cluster.create_namespace(OPERATOR_NS)
    kube_cluster.kubectl(
        "create",
        "clusterrolebinding",
        "slimspec-operator-test",
        "--clusterrole=slimspec-operator",
        f"--serviceaccount={OPERATOR_NS}:slimspec-operator",
        check=False,
    )
    return kube_cluster.service_account_kubeconfig(OPERATOR_NS, "slimspec-operator")


class OperatorProcess:
    """`python -m slimspec_operator --standalone -n <ns>` with fast timers."""

    def __init__(
        self, kubeconfig: Path, namespace: str | None, log: Path, extra: tuple[str, ...] = ()
    ) -> None:
        """namespace=None: cluster-wide. extra: more CLI flags (replacing --standalone)."""
        self.kubeconfig, self.namespace, self.log_path = kubeconfig, namespace, log
        self.extra = extra
        self.env: dict[str, str] = {}  # more environment (e.g. SLIMSPEC_HF_ENDPOINT)
        self.interval = "1"  # SLIMSPEC_RECONCILE_INTERVAL
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = dict(os.environ)
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            SLIMSPEC_RECONCILE_INTERVAL=self.interval,
            SLIMSPEC_TUNING_TICK_SECONDS="3600",  # the tuner has its own tests
            PYTHONUNBUFFERED="1",
        )
        env.update(self.env)
        argv = [
            sys.executable,
            "-m",
            "slimspec_operator",
            *(self.extra or ("--standalone",)),
            *(("--namespace", self.namespace) if self.namespace else ()),
            "--metrics-port",
            str(self.metrics_port),
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
        ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.read().decode()


@pytest.fixture
def operator(
    kube_cluster: KubeCluster, operator_kubeconfig: Path, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(operator_kubeconfig, namespace, tmp_path / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log ({namespace}) ---\n{op.log()[-6000:]}")
    # The chart's role was enough for everything it did.
    assert "forbidden: User" not in op.log(), "RBAC denial in the operator log"


class Api:
    """Admin-side reads and writes the tests make (the operator uses its own identity)."""

    def __init__(self, cluster: KubeCluster, namespace: str) -> None:
        self.cluster, self.ns = cluster, namespace
        self.client = cluster.api_client()
        self.custom = client.CustomObjectsApi(self.client)
        self.apps = client.AppsV1Api(self.client)
        self.core = client.CoreV1Api(self.client)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(G, V, self.ns, P, body)

    def get(self, name: str = "chat") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(G, V, self.ns, P, name)

    def patch_spec(self, spec: dict[str, Any], name: str = "chat") -> None:
        self.custom.patch_namespaced_custom_object(G, V, self.ns, P, name, {"spec": spec})

    def condition(self, type_: str, name: str = "chat") -> dict[str, Any]:
        for c in self.get(name).get("status", {}).get("conditions") or []:
            if c["type"] == type_:
                return c
        return {}

    def deployments(self, name: str = "chat") -> list[client.V1Deployment]:
        sel = f"app.kubernetes.io/instance={name}"
        return self.apps.list_namespaced_deployment(self.ns, label_selector=sel).items

    def service_selector(self, name: str = "chat") -> dict[str, str]:
        return self.core.read_namespaced_service(name, self.ns).spec.selector or {}

    def ready_pods_selected(self, name: str = "chat") -> int:
        sel = ",".join(f"{k}={v}" for k, v in self.service_selector(name).items())
        pods = self.core.list_namespaced_pod(self.ns, label_selector=sel).items
        return sum(
            1
            for p in pods
            if p.metadata.deletion_timestamp is None
            and any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        )

    def wait(self, fn: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
        return self.cluster.wait_for(fn, timeout=timeout, what=what)


@pytest.fixture
def api(kube_cluster: KubeCluster, namespace: str) -> Iterator[Api]:
    a = Api(kube_cluster, namespace)
    try:
        yield a
    finally:
        a.client.close()


class ServingMonitor:
    """Polls the Service's selection in the background and records every moment it
    selected zero ready pods (after it first had some)."""

    def __init__(self, api: Api, name: str = "chat", interval: float = 0.05) -> None:
        self.api, self.name, self.interval = api, name, interval
        self.samples = 0
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with self.api.cluster.api_client() as c:
            local = Api.__new__(Api)
            local.cluster, local.ns, local.client = self.api.cluster, self.api.ns, c
            local.core = client.CoreV1Api(c)
            while not self._stop.wait(self.interval):
                try:
                    sel = local.service_selector(self.name)
                    n = local.ready_pods_selected(self.name)
                except Exception as e:  # a transient API error is not a serving gap
                    print("monitor:", e)
                    continue
                self.samples += 1
                if n == 0:
                    self.violations.append(f"{time.time():.2f} selector {sel} has 0 ready pods")

    def __enter__(self) -> ServingMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def dump(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False)
