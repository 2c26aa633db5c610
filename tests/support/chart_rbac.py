"""The operator's RBAC rules exactly as the Helm chart renders them (one source of truth).

Tests that run the operator under a least-privilege identity take its ClusterRole from
`helm template charts/slimspec`, so the role users install is the role under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from slimspec_testbed.tools import run_checked, tool_path

CHART = Path(__file__).resolve().parents[2] / "charts" / "slimspec"


def chart_cluster_role(env: dict[str, str], name: str, *sets: str) -> dict[str, Any]:
    """The chart's operator ClusterRole (with these `--set` values), renamed to name."""
    argv: list[Any] = [tool_path("helm"), "template", "rel", CHART]
    for s in sets:
        argv += ["--set", s]
    out = run_checked(argv, env=env).stdout
    (role,) = [d for d in yaml.safe_load_all(out) if d and d.get("kind") == "ClusterRole"]
    role["metadata"] = {"name": name}
    return role


def chart_operator_role_all_modes(env: dict[str, str], name: str) -> dict[str, Any]:
    """One ClusterRole with the rules the chart grants in the modes the operator tests
    use: cluster scope with peering (namespaced rules, CRD reads, ClusterKopfPeerings)
    plus the namespace list/watch that rbac.scope=namespace adds for --namespace runs.
    Nothing outside what some chart configuration grants."""
    role = chart_cluster_role(env, name, "operator.peering.enabled=true")
    ns_scoped = chart_cluster_role(env, name, "rbac.scope=namespace")
    for rule in ns_scoped["rules"]:
        if rule not in role["rules"]:
            role["rules"].append(rule)
    return role
