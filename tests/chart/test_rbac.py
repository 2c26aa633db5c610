"""Least privilege: the operator's rendered RBAC is exactly the expected rules.

The expected rules are the API calls the operator makes (its Kopf handlers and
kube/client.py); tests/chart/test_cluster.py proves that they are enough and that the
operator uses them (the real operator with the chart's ServiceAccount token, its
requests read back from the API server's audit log). The default is namespace
scope: nothing the operator may write reaches beyond the watched namespaces.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Rendered, render

# (API group, resource, verb, resource name or "*" for any)
Grant = tuple[str, str, str, str]

NAMESPACED: dict[tuple[str, str], tuple[str, ...]] = {
    ("slimspec.io", "slimspecservices"): ("get", "list", "watch", "patch"),
    ("slimspec.io", "slimspecservices/status"): ("patch",),
    ("slimspec.io", "slimspecservices/scale"): ("patch",),
    ("slimspec.io", "slimspecservices/finalizers"): ("update",),
    ("apps", "deployments"): ("get", "list", "watch", "create", "patch", "delete"),
    ("", "services"): ("get", "create", "patch"),
    ("", "configmaps"): ("get", "list", "watch", "create", "patch"),
    ("", "serviceaccounts"): ("get", "create", "patch"),
    ("rbac.authorization.k8s.io", "roles"): ("get", "create", "patch"),
    ("rbac.authorization.k8s.io", "rolebindings"): ("get", "create", "patch"),
    ("policy", "poddisruptionbudgets"): ("get", "create", "patch", "delete"),
    ("batch", "jobs"): ("get", "list", "watch", "create", "delete"),
    ("", "persistentvolumeclaims"): ("get", "create"),
    ("", "secrets"): ("create",),
    ("", "events"): ("create",),
}
CLUSTER: dict[tuple[str, str], tuple[str, ...]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): ("list", "watch"),
}
NAMESPACES = {("", "namespaces"): ("list", "watch")}
PEERING_NS = {("kopf.dev", "kopfpeerings"): ("list", "watch")}
PEERING_CLUSTER = {("kopf.dev", "clusterkopfpeerings"): ("list", "watch")}
KEDA = {
    ("keda.sh", "scaledobjects"): ("get", "create", "patch", "delete"),
    ("keda.sh", "triggerauthentications"): ("get", "create", "patch", "delete"),
}
PEERING_NAME = "ss-slimspec-operator"  # release "ss": its own peering object only
PEERING_NS_OWN = {("kopf.dev", "kopfpeerings", "patch", PEERING_NAME)}
PEERING_CLUSTER_OWN = {("kopf.dev", "clusterkopfpeerings", "patch", PEERING_NAME)}


def triples(rules: list[dict[str, Any]]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        assert "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or ["*"]:
                        out.add((group, res, verb, name))
    return out


def expand(*tables: dict[tuple[str, str], tuple[str, ...]]) -> set[Grant]:
    return {(g, r, v, "*") for t in tables for (g, r), verbs in t.items() for v in verbs}


def no_wildcards(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule


@pytest.mark.parametrize(
    ("args", "extra_cluster", "own"),
    [
        ([], {}, set()),
        (["--set", "operator.peering.enabled=true"], PEERING_CLUSTER, PEERING_CLUSTER_OWN),
        (["--set", "rbac.keda=true"], KEDA, set()),
    ],
    ids=["plain", "peering", "keda"],
)
def test_cluster_scope_rules_are_exact(args: list[str], extra_cluster: dict, own: set) -> None:
    r: Rendered = render("--set", "rbac.scope=cluster", *args)
    assert not r.of_kind("Role") and not r.of_kind("RoleBinding")
    cr = r.one("ClusterRole")
    no_wildcards(cr["rules"])
    assert triples(cr["rules"]) == expand(NAMESPACED, CLUSTER, extra_cluster) | own
    crb = r.one("ClusterRoleBinding")
    assert crb["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": cr["metadata"]["name"],
    }
    sa = r.one("ServiceAccount")
    assert crb["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "slimspec-system"}
    ]


def test_namespace_scope_uses_roles_per_watched_namespace() -> None:
    r = render(
        "--set",
        "rbac.scope=namespace",
        "--set",
        "rbac.watchNamespaces={team-a,team-b}",
        "--set",
        "operator.peering.enabled=true",
    )
    cr = r.one("ClusterRole")
    # Only Kopf's cluster-scoped reads stay cluster-wide.
    assert triples(cr["rules"]) == expand(CLUSTER, NAMESPACES)
    roles = {d["metadata"]["namespace"]: d for d in r.of_kind("Role")}
    bindings = {d["metadata"]["namespace"]: d for d in r.of_kind("RoleBinding")}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for ns, role in roles.items():
        no_wildcards(role["rules"])
        assert triples(role["rules"]) == expand(NAMESPACED, PEERING_NS) | PEERING_NS_OWN, ns
        assert bindings[ns]["roleRef"]["kind"] == "Role"
        assert bindings[ns]["subjects"][0]["namespace"] == "slimspec-system"


def test_default_is_namespace_scope_in_the_release_namespace() -> None:
    """Least privilege by default: writes only in the release namespace, and the only
    cluster-wide rules are Kopf's reads of CRDs and namespaces."""
    r = render(namespace="inference")
    (role,) = r.of_kind("Role")
    assert role["metadata"]["namespace"] == "inference"
    assert triples(role["rules"]) == expand(NAMESPACED)
    assert triples(r.one("ClusterRole")["rules"]) == expand(CLUSTER, NAMESPACES)
    args = r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=inference" in args


def test_rbac_create_false_renders_no_rbac() -> None:
    r = render("--set", "rbac.create=false")
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
        assert not r.of_kind(kind)


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_no_token_minting_secret_reads_or_escalation(scope: str) -> None:
    r = render(
        "--set",
        f"rbac.scope={scope}",
        "--set",
        "operator.peering.enabled=true",
        "--set",
        "rbac.keda=true",
    )
    t: set[Grant] = set()
    for doc in r.of_kind("ClusterRole") + r.of_kind("Role"):
        t |= triples(doc["rules"])
    assert {v for g, res, v, _ in t if res == "secrets"} == {"create"}  # never read
    # No tokens for other ServiceAccounts, no impersonation, no RBAC escalation.
    assert not {res for _, res, _, _ in t} & {
        "serviceaccounts/token",
        "clusterroles",
        "clusterrolebindings",
        "nodes",
        "pods",
        "pods/exec",
        "users",
        "groups",
    }
    assert not {v for _, _, v, _ in t} & {"escalate", "bind", "impersonate", "*"}
    # Deletion is the garbage collector's job (owner references), except for
    # superseded Deployments, the preparation Jobs of versions no longer in use, a
    # PodDisruptionBudget turned off and the KEDA objects.
    assert {(g, res) for g, res, v, _ in t if v == "delete"} == {
        ("apps", "deployments"),
        ("batch", "jobs"),
        ("policy", "poddisruptionbudgets"),
        ("keda.sh", "scaledobjects"),
        ("keda.sh", "triggerauthentications"),
    }


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_prometheus_secrets_are_readable_by_name_only(scope: str) -> None:
    """spec.prometheus.auth: the operator may get the Secrets the chart lists, no other."""
    r = render(
        "--set", f"rbac.scope={scope}", "--set", "rbac.prometheusSecrets={prom-auth,prom-ca}"
    )
    t: set[Grant] = set()
    for doc in r.of_kind("ClusterRole") + r.of_kind("Role"):
        t |= triples(doc["rules"])
    assert {(v, name) for _, res, v, name in t if res == "secrets"} == {
        ("create", "*"),
        ("get", "prom-auth"),
        ("get", "prom-ca"),
    }
