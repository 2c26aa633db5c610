"""The chart's RBAC is what the operator uses, nothing more: the real operator runs
with a token of the ServiceAccount the chart created, through a service's life
(create, pods ready, a model rollout, delete), on its own API server with an audit
log; every request it made is read back from that log.

- every request was allowed (no 403);
- every permission the chart grants was used, or is listed in NOT_EXERCISED with
  the reason this scenario cannot use it (and where it is exercised instead).

Server-side apply of an object that does not exist yet is one PATCH answered 201,
which the API server authorizes as patch and create: such a PATCH counts for both.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from slimspec_testbed.cluster.control_plane import running_cluster
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import Helm, helm_env, tool_path

from .conftest import CHART
from .test_cluster import FORBIDDEN, ChartOperator, rendered

pytestmark = pytest.mark.cluster

G, V, P = "slimspec.io", "v1alpha1", "slimspecservices"
Use = tuple[str, str, str]  # (API group, resource[/subresource], verb)

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
  - level: Metadata
    userGroups: ["system:serviceaccounts"]
  - level: None
"""

# Granted but not used by this scenario, and why.
NOT_EXERCISED: dict[Use, str] = {
    ("slimspec.io", "slimspecservices/scale", "patch"): (
        "the operator's autoscaler (needs Prometheus data): "
        "tests/tuning/test_handlers_cluster.py runs it with exactly the chart's rules"
    ),
    ("slimspec.io", "slimspecservices/finalizers", "update"): (
        "not a call: the OwnerReferencesPermissionEnforcement admission plugin "
        "(OpenShift) checks it when the operator sets blockOwnerDeletion"
    ),
    ("", "configmaps", "list"): (
        "held because the engines' Role grants it (RBAC lets the operator grant only what it holds)"
    ),
    ("", "configmaps", "watch"): "held because the engines' Role grants it",
    ("policy", "poddisruptionbudgets", "delete"): (
        "a PodDisruptionBudget turned off (disruptionBudget.enabled: false): "
        "tests/operator/test_cluster_pod_settings.py"
    ),
    ("batch", "jobs", "get"): (
        "model preparation, only with a huggingface source or calibration: "
        "tests/operator/test_cluster_model_prep.py"
    ),
    ("batch", "jobs", "create"): "model preparation: tests/operator/test_cluster_model_prep.py",
    ("batch", "jobs", "delete"): (
        "the preparation Job of a version no longer in use: "
        "tests/operator/test_cluster_model_prep.py"
    ),
    ("", "persistentvolumeclaims", "get"): (
        "the model cache claim, with model preparation: tests/operator/test_cluster_model_prep.py"
    ),
    ("", "persistentvolumeclaims", "create"): "the model cache claim, with model preparation",
    ("", "events", "create"): (
        "Kopf's warnings and the tuner's events: none in a clean run "
        "(tests/tuning/test_handlers_cluster.py sees the tuner's)"
    ),
}


@dataclass
class Audited:
    cluster: KubeCluster
    log: Path


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Audited]:
    """A control plane of its own whose API server logs every ServiceAccount's requests."""
    root = tmp_path_factory.mktemp("audit")
    policy = root / "policy.yaml"
    policy.write_text(AUDIT_POLICY)
    args = [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={root / 'audit.log'}",
        "--audit-log-format=json",
    ]
    with running_cluster(apiserver_args=args) as cluster:
        yield Audited(cluster, root / "audit.log")


def audited_uses(log: Path, username: str) -> tuple[set[Use], list[str]]:
    """(what the user did, each request refused) from the API server's audit log."""
    uses: set[Use] = set()
    refused: list[str] = []
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["user"]["username"] != username or event["stage"] != "ResponseComplete":
            continue
        ref = event.get("objectRef")
        if ref is None:  # discovery (/api, /apis, /version): every user may read it
            continue
        resource = ref.get("resource", "")
        if ref.get("subresource"):
            resource += "/" + ref["subresource"]
        group, verb = ref.get("apiGroup", ""), event["verb"]
        code = (event.get("responseStatus") or {}).get("code", 0)
        if code == 403:
            refused.append(f"{verb} {group}/{resource} {ref.get('name', '')}")
            continue
        uses.add((group, resource, verb))
        if verb == "patch" and code == 201:  # server-side apply created it
            uses.add((group, resource, "create"))
    return uses, refused


def granted(docs: list[dict[str, Any]]) -> set[Use]:
    return {
        (group, res, verb)
        for doc in docs
        if doc["kind"] in ("ClusterRole", "Role")
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for res in rule["resources"]
        for verb in rule["verbs"]
    }


def run_service_life(cluster: KubeCluster, namespace: str, name: str) -> None:
    """Create (the chart's example), pods ready, roll out v2, delete."""
    driver = cluster.pod_driver()
    with cluster.api_client() as api:
        custom = client.CustomObjectsApi(api)
        apps = client.AppsV1Api(api)

        def status() -> dict[str, Any]:
            obj = custom.get_namespaced_custom_object(G, V, namespace, P, name)
            return dict(obj.get("status") or {})

        def deployments() -> list[Any]:
            sel = f"app.kubernetes.io/instance={name}"
            return list(apps.list_namespaced_deployment(namespace, label_selector=sel).items)

        def condition(kind: str) -> tuple[str, str]:
            for c in status().get("conditions") or []:
                if c["type"] == kind:
                    return c["status"], c.get("reason", "")
            return "", ""

        def ready() -> bool:
            return condition("Ready")[0] == "True"

        with driver.start(namespace, f"app.kubernetes.io/instance={name}"):
            cluster.wait_for(ready, timeout=90, what="Ready=True")
            custom.patch_namespaced_custom_object(
                G, V, namespace, P, name, {"spec": {"model": {"version": "v2"}}}
            )
            cluster.wait_for(
                lambda: status().get("servedVersion") == "v2" and len(deployments()) == 1,
                timeout=120,
                what="v2 serving and the v1 Deployment deleted",
            )
            cluster.wait_for(
                lambda: condition("Progressing") == ("False", "RolloutComplete"),
                timeout=60,
                what="the rollout settled",
            )
        custom.delete_namespaced_custom_object(G, V, namespace, P, name)

        def gone() -> bool:
            try:
                custom.get_namespaced_custom_object(G, V, namespace, P, name)
            except client.ApiException as e:
                if e.status == 404:
                    return True
                raise
            return False

        # Kopf releases the finalizer once no timer of the resource runs; with one in
        # flight (the reconcile timer ticks every second here) it checks again only
        # after its cancellation polling period (60 s by default).
        cluster.wait_for(gone, timeout=100, what="the resource deleted (finalizer removed)")


@pytest.mark.parametrize("scope", ["namespace", "cluster"])
def test_operator_uses_exactly_the_charts_rbac(
    scope: str, audited: Audited, tmp_path: Path
) -> None:
    cluster = audited.cluster
    namespace = f"rbac-{scope}-{uuid.uuid4().hex[:5]}"
    cluster.create_namespace(namespace)
    release = f"op-{uuid.uuid4().hex[:6]}"
    args = [
        "--set",
        f"rbac.scope={scope}",
        "--set",
        "operator.peering.enabled=true",
        "--set",
        "example.enabled=true",
        "--set",
        "tests.enabled=false",
    ]
    helm = Helm(path=tool_path("helm"), env=helm_env(cluster.env, tmp_path / "helm"))
    helm("install", release, str(CHART), "-n", namespace, *args)
    r = rendered(release, namespace, *args)
    dep = r.one("Deployment")
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = cluster.service_account_kubeconfig(namespace, sa, create=False)
    # One tuning tick (at start), so that fewer timer runs hold up the delete below
    # (see run_service_life); the tuner's own calls are covered by the tuning tests.
    op = ChartOperator(
        dep["spec"]["template"]["spec"]["containers"][0]["args"],
        kubeconfig,
        tmp_path / "operator.log",
        tuning_tick="3600",
    )
    try:
        run_service_life(cluster, namespace, "slimspec-example")
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log()[-5000:]}")
        helm("uninstall", release, "-n", namespace, "--wait", "--timeout", "60s", check=False)
        cluster.delete_namespace(namespace)
    denied = [line for line in op.log().splitlines() if FORBIDDEN.search(line)]
    assert not denied, "\n".join(line[:400] for line in denied[:5])

    uses, refused = audited_uses(audited.log, f"system:serviceaccount:{namespace}:{sa}")
    assert refused == []
    grants = granted(r.docs)
    assert uses <= grants, f"used without a grant: {sorted(uses - grants)}"
    assert set(NOT_EXERCISED) <= grants, "NOT_EXERCISED lists a permission no longer granted"
    unused = grants - uses - set(NOT_EXERCISED)
    assert not unused, f"granted but never used (drop it, or say why): {sorted(unused)}"
