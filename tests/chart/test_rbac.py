"""Least privilege: the operator's rendered RBAC is exactly the expected rules.

The expected rules are the API calls the operator makes (its Kopf handlers and
kube.py); tests/chart/test_cluster.py proves that they are also enough, by
running the real operator with the chart's ServiceAccount token.
"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Rendered, render

Triple = tuple[str, str, str]

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
PEERING_NS = {("kopf.dev", "kopfpeerings"): ("get", "list", "watch", "patch")}
PEERING_CLUSTER = {("kopf.dev", "clusterkopfpeerings"): ("get", "list", "watch", "patch")}
KEDA = {
    ("keda.sh", "scaledobjects"): ("get", "create", "patch", "delete"),
    ("keda.sh", "triggerauthentications"): ("get", "create", "patch", "delete"),
}


def triples(rules: list[dict[str, Any]]) -> set[Triple]:
    out: set[Triple] = set()
    for rule in rules:
        assert "nonResourceURLs" not in rule
        assert "resourceNames" not in rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, res, verb))
    return out


def expand(*tables: dict[tuple[str, str], tuple[str, ...]]) -> set[Triple]:
    return {(g, r, v) for t in tables for (g, r), verbs in t.items() for v in verbs}


def no_wildcards(rules: list[dict[str, Any]]) -> None:
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule


@pytest.mark.parametrize(
    ("args", "extra_ns", "extra_cluster"),
    [
        ([], {}, {}),
        (["--set", "operator.peering.enabled=true"], PEERING_NS, PEERING_CLUSTER),
        (["--set", "rbac.keda=true"], KEDA, {}),
    ],
    ids=["default", "peering", "keda"],
)
def test_cluster_scope_rules_are_exact(
    args: list[str], extra_ns: dict, extra_cluster: dict
) -> None:
    r: Rendered = render(*args)
    assert not r.of_kind("Role") and not r.of_kind("RoleBinding")
    cr = r.one("ClusterRole")
    no_wildcards(cr["rules"])
    assert triples(cr["rules"]) == expand(NAMESPACED, CLUSTER, extra_ns, extra_cluster)
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
    assert triples(cr["rules"]) == expand(CLUSTER, NAMESPACES, PEERING_CLUSTER)
    roles = {d["metadata"]["namespace"]: d for d in r.of_kind("Role")}
    bindings = {d["metadata"]["namespace"]: d for d in r.of_kind("RoleBinding")}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for ns, role in roles.items():
        no_wildcards(role["rules"])
        assert triples(role["rules"]) == expand(NAMESPACED, PEERING_NS), ns
        assert bindings[ns]["roleRef"]["kind"] == "Role"
        assert bindings[ns]["subjects"][0]["namespace"] == "slimspec-system"


def test_namespace_scope_defaults_to_the_release_namespace() -> None:
    r = render("--set", "rbac.scope=namespace", namespace="inference")
    (role,) = r.of_kind("Role")
    assert role["metadata"]["namespace"] == "inference"
    args = r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=inference" in args


def test_rbac_create_false_renders_no_rbac() -> None:
    r = render("--set", "rbac.create=false")
    for kind in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"):
        assert not r.of_kind(kind)


def test_no_secret_reads_in_bulk_and_no_escalation_verbs() -> None:
    r = render("--set", "operator.peering.enabled=true", "--set", "rbac.keda=true")
    t = triples(r.one("ClusterRole")["rules"])
    assert {v for g, res, v in t if res == "secrets"} == {"create"}  # never read
    assert not {v for _, _, v in t} & {"escalate", "bind", "impersonate", "*"}
    assert not {res for _, res, _ in t} & {"clusterroles", "clusterrolebindings", "nodes", "pods"}
    # Deletion is the garbage collector's job (owner references), except for
    # superseded Deployments, the preparation Jobs of versions no longer in use, a
    # PodDisruptionBudget turned off and the KEDA ScaledObject.
    assert {(g, res) for g, res, v in t if v == "delete"} == {
        ("apps", "deployments"),
        ("batch", "jobs"),
        ("policy", "poddisruptionbudgets"),
        ("keda.sh", "scaledobjects"),
        ("keda.sh", "triggerauthentications"),
    }


def test_prometheus_secrets_are_readable_by_name_only() -> None:
    """spec.prometheus.auth: the operator may get the Secrets the chart lists, no other."""
    for scope in ("cluster", "namespace"):
        r = render(
            "--set",
            f"rbac.scope={scope}",
            "--set",
            "rbac.prometheusSecrets={prometheus-auth,prometheus-ca}",
        )
        role = r.one("ClusterRole") if scope == "cluster" else r.of_kind("Role")[0]
        secret_rules = [rule for rule in role["rules"] if "secrets" in rule["resources"]]
        named = [rule for rule in secret_rules if "resourceNames" in rule]
        assert named == [
            {
                "apiGroups": [""],
                "resources": ["secrets"],
                "resourceNames": ["prometheus-auth", "prometheus-ca"],
                "verbs": ["get"],
            }
        ], scope
        assert all(rule["verbs"] == ["create"] for rule in secret_rules if rule not in named)
