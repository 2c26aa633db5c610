"""The chart on the real API server (test bed: etcd + kube-apiserver +
kube-controller-manager, no kubelet).

- rendered manifests pass server-side dry-run, then `helm install`, `helm
  upgrade` (cluster -> namespace scope), `helm test` and `helm uninstall` for
  real. The Prometheus Operator CRDs (ServiceMonitor, PodMonitor,
  PrometheusRule) are not in a bare cluster: the vendored ones from
  tests/fixtures/prometheus-operator/ are applied first, so the monitoring
  objects are validated against their real schemas.
- the chart's RBAC is enough: the real operator process runs with a token of
  the ServiceAccount the chart created, with the arguments of the chart's
  Deployment, and reconciles the chart's example SlimSpecService without a
  single Forbidden, in cluster scope and in namespace scope.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import Helm, free_port

from .conftest import (
    CHART,
    REPO,
    VALUES_DIR,
    Rendered,
    dashboard_exprs,
    helm_template,
    prometheus_rule_groups,
    render,
)
from .test_monitoring import metric_names

pytestmark = pytest.mark.cluster

PROM_CRDS = REPO / "tests" / "fixtures" / "prometheus-operator"
G, V, P = "slimspec.io", "v1alpha1", "slimspecservices"


@pytest.fixture(scope="module")
def crds(kube_cluster: KubeCluster) -> None:
    """The chart's CRD and the Prometheus Operator's, established."""
    kube_cluster.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    kube_cluster.kubectl("apply", "--server-side", "-f", str(PROM_CRDS))
    kube_cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        f"crd/{P}.{G}",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
    )


def rendered(release: str, namespace: str, *args: str) -> Rendered:
    text = helm_template(*args, release=release, namespace=namespace).stdout
    return Rendered([d for d in yaml.safe_load_all(text) if d], text)


@pytest.mark.parametrize("variant", ["default", "full", "namespaced"])
def test_server_side_dry_run(
    variant: str, kube_cluster: KubeCluster, crds: None, namespace: str
) -> None:
    args: list[str] = [] if variant == "default" else ["-f", str(VALUES_DIR / f"{variant}.yaml")]
    if variant == "namespaced":
        args += ["--set", f"rbac.watchNamespaces={{{namespace}}}"]
    r = rendered(f"dry-{variant}", namespace, *args)
    # The strictest Pod Security level, enforced: the operator pod and the
    # helm test pod must pass it.
    kube_cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    proc = kube_cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=r.text
    )
    # Every object was accepted by the API server's validation (and its CRD
    # schemas for ServiceMonitor, PodMonitor, PrometheusRule, SlimSpecService).
    assert proc.stdout.count("(server dry run)") == len(r.docs), proc.stdout
    assert "PodSecurity" not in proc.stderr, proc.stderr


def _objects(kube_cluster: KubeCluster, namespace: str, release: str) -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    kinds = (
        "deployment,service,serviceaccount,networkpolicy,configmap,role,rolebinding,"
        "servicemonitors.monitoring.coreos.com,podmonitors.monitoring.coreos.com,"
        "prometheusrules.monitoring.coreos.com,slimspecservices.slimspec.io"
    )
    out = kube_cluster.kubectl(
        "get",
        kinds,
        "-n",
        namespace,
        "-l",
        "app.kubernetes.io/managed-by=Helm",
        "-o",
        "jsonpath={range .items[*]}{.kind}/{.metadata.name}{'\\n'}{end}",
    ).stdout
    for line in out.split():
        kind, name = line.split("/", 1)
        names.setdefault(kind, set()).add(name)
    cluster_out = kube_cluster.kubectl(
        "get",
        "clusterrole,clusterrolebinding",
        "-l",
        f"app.kubernetes.io/instance={release}",
        "-o",
        "jsonpath={range .items[*]}{.kind}/{.metadata.name}{'\\n'}{end}",
    ).stdout
    for line in cluster_out.split():
        kind, name = line.split("/", 1)
        names.setdefault(kind, set()).add(name)
    return names


class HookPodFinisher:
    """Plays the kubelet for `helm test`: there is no kubelet in the test bed, so
    the test pod's container cannot run; once the API server has accepted the
    hook pod, mark it Succeeded through the status subresource."""

    def __init__(self, cluster: KubeCluster, namespace: str, name: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.seen: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.cluster.api_client() as api:
            core = client.CoreV1Api(api)
            while not self._stop.wait(0.2):
                try:
                    pod = core.read_namespaced_pod(self.name, self.namespace)
                except ApiException:
                    continue
                self.seen = api.sanitize_for_serialization(pod)
                core.patch_namespaced_pod_status(
                    self.name, self.namespace, {"status": {"phase": "Succeeded"}}
                )
                return

    def __enter__(self) -> HookPodFinisher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_helm_install_upgrade_test_uninstall(
    helm: Helm, kube_cluster: KubeCluster, crds: None, namespace: str
) -> None:
    release = f"ss-{uuid.uuid4().hex[:6]}"
    full = str(VALUES_DIR / "full.yaml")
    out = helm("install", release, str(CHART), "-n", namespace, "-f", full).stdout
    assert "STATUS: deployed" in out
    assert "SlimSpecHighInferenceLatency (p99 > 0.5s for 5m)" in out  # NOTES.txt
    op = f"{release}-slimspec-operator"
    names = _objects(kube_cluster, namespace, release)
    assert names["Deployment"] == {op}
    assert names["ServiceAccount"] == {op}
    assert names["ClusterRole"] == {op} and names["ClusterRoleBinding"] == {op}
    assert names["ServiceMonitor"] == {op}
    assert names["PodMonitor"] and names["PrometheusRule"] and names["SlimSpecService"]
    assert "Role" not in names
    with kube_cluster.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        rules_before = rbac.read_cluster_role(op).rules

    # Upgrade: namespace scope for this namespace only, no monitoring.
    out = helm(
        "upgrade",
        release,
        str(CHART),
        "-n",
        namespace,
        "--set",
        "rbac.scope=namespace",
        "--set",
        f"rbac.watchNamespaces={{{namespace}}}",
    ).stdout
    assert "STATUS: deployed" in out and "REVISION: 2" in out
    names = _objects(kube_cluster, namespace, release)
    assert names["Role"] == {op} and names["RoleBinding"] == {op}
    assert "ServiceMonitor" not in names and "SlimSpecService" not in names
    with kube_cluster.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        rules_after = rbac.read_cluster_role(op).rules
        assert len(rules_after) < len(rules_before)
        dep = client.AppsV1Api(api).read_namespaced_deployment(op, namespace)
        assert f"--namespace={namespace}" in dep.spec.template.spec.containers[0].args

    # helm test: the hook pod is accepted by the API server (securityContext,
    # probes, resources) and helm reports the result.
    test_pod = f"{op}-test-health"
    with HookPodFinisher(kube_cluster, namespace, test_pod) as finisher:
        out = helm("test", release, "-n", namespace, "--timeout", "60s").stdout
    assert f"TEST SUITE:     {test_pod}" in out and "Phase:          Succeeded" in out
    assert finisher.seen["metadata"]["annotations"]["helm.sh/hook"] == "test"

    helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s")
    assert _objects(kube_cluster, namespace, release) == {}
    # Helm never deletes CRDs from crds/: SlimSpecServices of other releases survive.
    kube_cluster.kubectl("get", f"crd/{P}.{G}")


# ------------------------------------------------------------ operator + chart RBAC


class ChartOperator:
    """The real operator process, with the chart Deployment's arguments and the
    chart ServiceAccount's token (health and metrics on free loopback ports)."""

    def __init__(
        self, args: list[str], kubeconfig: Path, log: Path, tuning_tick: str = "2"
    ) -> None:
        self.health_port, self.metrics_port = free_port(), free_port()
        argv = []
        for a in args:
            if a.startswith("--liveness="):
                a = f"--liveness=http://127.0.0.1:{self.health_port}/healthz"
            elif a.startswith("--metrics-port="):
                a = f"--metrics-port={self.metrics_port}"
            argv.append(a)
        self.argv = [sys.executable, "-m", "slimspec_operator", *argv]
        self.log_path = log
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
        env.update(SLIMSPEC_RECONCILE_INTERVAL="1", SLIMSPEC_TUNING_TICK_SECONDS=tuning_tick)
        with log.open("wb") as f:
            self.proc = subprocess.Popen(
                self.argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def get(self, port: int, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# RBAC denials as the API server words them ('User "..." cannot list resource
# "x"') and Kopf's warning when it lacks a permission. (Not every 403: in a
# shared test cluster a cluster-wide operator may also meet namespaces of other
# tests being terminated, which the API server refuses with 403 too.)
FORBIDDEN = re.compile(r"cannot \w+ resource|Not enough permissions", re.I)


@pytest.fixture
def chart_operator_run(
    helm: Helm, kube_cluster: KubeCluster, crds: None, namespace: str, tmp_path: Path
) -> Iterator[Any]:
    started: list[tuple[str, ChartOperator]] = []

    def run(scope: str) -> ChartOperator:
        release = f"op-{uuid.uuid4().hex[:6]}"
        args = ["--set", "example.enabled=true", "--set", "tests.enabled=false"]
        if scope == "namespace":
            # Namespace scope with Kopf peering: the chart's KopfPeering object
            # and the peering rules of its Role are exercised too.
            args += ["--set", "rbac.scope=namespace"]
            args += ["--set", f"rbac.watchNamespaces={{{namespace}}}"]
            args += ["--set", "operator.peering.enabled=true"]
        helm("install", release, str(CHART), "-n", namespace, *args)
        r = rendered(release, namespace, *args)
        dep = r.one("Deployment")
        sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
        container = dep["spec"]["template"]["spec"]["containers"][0]
        # Token of the chart's own ServiceAccount (TokenRequest API): the
        # operator gets exactly the chart's RBAC, nothing more.
        kubeconfig = kube_cluster.service_account_kubeconfig(namespace, sa, create=False)
        op = ChartOperator(container["args"], kubeconfig, tmp_path / f"operator-{scope}.log")
        started.append((release, op))
        return op

    yield run
    for release, op in started:
        # SlimSpecServices first, while the operator still runs with a valid
        # token: it removes Kopf's finalizer. (Uninstalling the chart first would
        # delete the operator's ServiceAccount and leave the finalizer behind.)
        kube_cluster.kubectl(
            "delete", f"{P}.{G}", "--all", "-n", namespace, "--wait", "--timeout=30s", check=False
        )
        op.stop()
        print(f"--- operator log ---\n{op.log()[-5000:]}")
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s", check=False)


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_operator_reconciles_the_example_with_the_charts_rbac(
    scope: str, chart_operator_run: Any, kube_cluster: KubeCluster, namespace: str, pod_driver: Any
) -> None:
    op: ChartOperator = chart_operator_run(scope)
    name = "slimspec-example"
    with kube_cluster.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        rbac = client.RbacAuthorizationV1Api(api)
        # Everything the operator makes for the example resource appears.
        deps = kube_cluster.wait_for(
            lambda: (
                apps.list_namespaced_deployment(
                    namespace, label_selector=f"app.kubernetes.io/instance={name}"
                ).items
            ),
            timeout=60,
            what="the example's engine Deployment",
        )
        assert deps[0].metadata.owner_references[0].kind == "SlimSpecService"
        kube_cluster.wait_for(
            lambda: core.read_namespaced_service(name, namespace), what="Service", timeout=30
        )
        cm = core.read_namespaced_config_map(f"{name}-runtime", namespace)
        assert cm.data["compression_ratio"] == "0.3"
        core.read_namespaced_service_account(f"{name}-engine", namespace)
        rbac.read_namespaced_role(f"{name}-engine", namespace)
        rbac.read_namespaced_role_binding(f"{name}-engine", namespace)
        uid = custom.get_namespaced_custom_object(G, V, namespace, P, name)["metadata"]["uid"]
        assert core.read_namespaced_secret(f"{name}-admin-{uid[:8]}", namespace).data["token"]
        assert client.PolicyV1Api(api).read_namespaced_pod_disruption_budget(name, namespace)

        # Pods become ready (the test bed's stand-in kubelet): the status says Ready.
        with pod_driver.start(namespace, f"app.kubernetes.io/instance={name}"):

            def ready() -> bool:
                obj = custom.get_namespaced_custom_object(G, V, namespace, P, name)
                conds = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}
                return conds.get("Ready", {}).get("status") == "True"

            kube_cluster.wait_for(ready, timeout=90, what="Ready=True on the example")

        # The tuner ran at least once with the same identity (events, status).
        time.sleep(3)
        # Deleting the resource completes: the operator removes Kopf's finalizer.
        kube_cluster.kubectl("delete", f"{P}.{G}", name, "-n", namespace, "--wait", "--timeout=30s")
    status, _ = op.get(op.health_port, "/healthz")
    assert status == 200
    _, metrics = op.get(op.metrics_port, "/metrics")
    assert 'slimspec_operator_reconcile_total{result="ok"}' in metrics
    # Every operator metric the dashboard and the alerts query is exported.
    exported = set()
    for fam in text_string_to_metric_families(metrics):
        exported |= {fam.name, f"{fam.name}_total", f"{fam.name}_bucket"}
    rules = [
        r["expr"]
        for g in prometheus_rule_groups(render("--set", "monitoring.prometheusRule.enabled=true"))[
            "groups"
        ]
        for r in g["rules"]
    ]
    queried = {
        m
        for e in [*rules, *(e for _, e in dashboard_exprs())]
        for m in metric_names(e)
        if m.startswith("slimspec_operator_")
    }
    assert queried and queried <= exported, queried - exported
    assert op.proc.poll() is None, op.log()[-3000:]
    denied = [line for line in op.log().splitlines() if FORBIDDEN.search(line)]
    assert not denied, "\n".join(line[:400] for line in denied[:5])
