"""Shared helpers for the chart, Dockerfile and monitoring tests.

Everything here runs the real tools: helm (v3, from the test bed), promtool,
hadolint, checkov. Tests that need the API server are marked ``cluster``.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from slimspec_testbed.tools import run_checked, tool_path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slimspec"
VALUES_DIR = Path(__file__).parent / "values"
CONTRACTS = REPO / "docs" / "contracts.md"
DASHBOARD = CHART / "dashboards" / "slimspec-overview.json"

# Values variants every structural test runs against (name -> helm args).
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "full": ["-f", str(VALUES_DIR / "full.yaml")],
    "namespaced": ["-f", str(VALUES_DIR / "namespaced.yaml")],
}


@dataclass
class Rendered:
    docs: list[dict[str, Any]]
    text: str

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.of_kind(kind)
        assert len(found) == 1, f"expected one {kind}, got {len(found)}"
        return found[0]


def helm_bin() -> Path:
    return tool_path("helm")


def helm_template(
    *args: str,
    release: str = "ss",
    namespace: str = "slimspec-system",
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    return run_checked(
        [helm_bin(), "template", release, str(CHART), "-n", namespace, *args], check=check
    )


def render(*args: str, release: str = "ss", namespace: str = "slimspec-system") -> Rendered:
    text = helm_template(*args, release=release, namespace=namespace).stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    return Rendered(docs, text)


def pod_specs(rendered: Rendered) -> Iterable[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every workload and bare pod in the render."""
    for doc in rendered.docs:
        if doc["kind"] == "Pod":
            yield doc["metadata"]["name"], doc["spec"]
        elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def prometheus_rule_groups(rendered: Rendered) -> dict[str, Any]:
    """The PrometheusRule's spec, which is a plain Prometheus rules file."""
    return rendered.one("PrometheusRule")["spec"]


def contract_metrics() -> set[str]:
    """Metric names the engine promises in docs/contracts.md (its metric table)."""
    names: set[str] = set()
    for line in CONTRACTS.read_text().splitlines():
        if line.startswith("| `slimspec_"):
            names.update(re.findall(r"`(slimspec_[a-z0-9_]+)`", line.split("|")[1]))
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in the dashboard."""
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


@pytest.fixture(scope="session")
def rendered_variants() -> dict[str, Rendered]:
    return {name: render(*args) for name, args in VARIANTS.items()}
