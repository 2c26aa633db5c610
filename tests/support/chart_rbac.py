"""The operator's RBAC rules exactly as the Helm chart renders them (one source of truth).

Tests that run the operator under a least-privilege identity take its rules from
`helm template charts/slimspec`, so the role users install is the role under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from slimspec_testbed.tools import run_checked, tool_path

CHART = Path(__file__).resolve().parents[2] / "charts" / "slimspec"


def chart_rbac_docs(env: dict[str, str], *sets: str) -> list[dict[str, Any]]:
    """The chart's ClusterRoles and Roles (with these `--set` values)."""
    argv: list[Any] = [tool_path("helm"), "template", "rel", CHART]
    for s in sets:
        argv += ["--set", s]
    out = run_checked(argv, env=env).stdout
    return [d for d in yaml.safe_load_all(out) if d and d.get("kind") in ("ClusterRole", "Role")]


def chart_cluster_role(env: dict[str, str], name: str, *sets: str) -> dict[str, Any]:
    """The chart's operator ClusterRole in cluster scope (rbac.scope=cluster, then
    these `--set` values), renamed to name: every rule the operator holds there."""
    docs = chart_rbac_docs(env, "rbac.scope=cluster", *sets)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    role["metadata"] = {"name": name}
    return role


# The peering object the operator tests run with (`--peering slimspec-operator`): the
# chart lets the operator write only its own peering object.
TEST_PEERING = "slimspec-operator"


def chart_operator_role_all_modes(env: dict[str, str], name: str) -> dict[str, Any]:
    """One ClusterRole with the rules the chart grants in the modes the operator tests
    use: cluster scope with peering (namespaced rules, CRD reads, ClusterKopfPeerings)
    plus the namespace-scope rules (namespace list/watch for --namespace runs, the
    KopfPeering rules), peering object TEST_PEERING. Nothing outside what some chart
    configuration grants."""
    peering = ("operator.peering.enabled=true", f"operator.peering.name={TEST_PEERING}")
    role = chart_cluster_role(env, name, *peering)
    for doc in chart_rbac_docs(env, "rbac.scope=namespace", *peering):
        for rule in doc["rules"]:
            if rule not in role["rules"]:
                role["rules"].append(rule)
    return role


def bind_to_operator_account(rbac: Any, namespace: str, role_name: str) -> None:
    """Bind ClusterRole `role_name` in `namespace` to ServiceAccount `operator`, the
    identity the least-privilege tests run the operator's client as."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "operator", "namespace": namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role_name,
        },
        "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": namespace}],
    }
    rbac.create_namespaced_role_binding(namespace, binding)
