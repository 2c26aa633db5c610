"""The chart's own documentation: the README's values table is generated from
values.yaml and values.schema.json and up to date, every value is described, and
NOTES.txt points only at things a user of the packaged chart has (no repository
paths) and at a manifest the API server accepts."""

from __future__ import annotations

import re
import sys
import uuid

import pytest
import yaml
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import Helm, run_checked

from .conftest import CHART, REPO

SCRIPT = REPO / "scripts" / "chart-values-table.py"


def test_values_table_is_up_to_date() -> None:
    out = run_checked([sys.executable, SCRIPT, "--check"], check=False)
    assert out.returncode == 0, out.stderr


def test_every_value_is_described() -> None:
    readme = (CHART / "README.md").read_text()
    table = readme.split("<!-- values-table:start -->")[1].split("<!-- values-table:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) > 50
    cells = [re.split(r"(?<!\\)\|", row.strip().strip("|")) for row in rows]
    assert {len(c) for c in cells} == {4}  # key, type, default, description
    undescribed = [c[0] for c in cells if not c[3].strip()]
    assert undescribed == [], "add a comment above these keys in values.yaml"


def test_readme_states_the_defaults() -> None:
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f"| `{values['rbac']['scope']}` (default) |" in readme
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    floor = re.fullmatch(r">=(\d+\.\d+)\.0-0", chart["kubeVersion"])
    assert floor and f"Kubernetes | {floor[1]} or newer" in readme


@pytest.mark.cluster
def test_notes_have_no_dead_links_and_a_valid_example(
    helm: Helm, kube_cluster: KubeCluster, namespace: str
) -> None:
    kube_cluster.kubectl("apply", "-f", str(CHART / "crds" / "slimspecservice.yaml"))
    out = helm(
        "install",
        f"notes-{uuid.uuid4().hex[:5]}",
        str(CHART),
        "-n",
        namespace,
        "--dry-run=server",
        "--set",
        "example.enabled=true",
    ).stdout
    notes = out.split("NOTES:", 1)[1]
    # Nothing the packaged chart does not ship: no repository files.
    assert not re.search(r"examples/|docs/|charts/|\.md\b|-f [\w./-]+\.ya?ml", notes), notes
    assert f"kubectl -n {namespace} wait --for=condition=Ready ssvc/chat" in notes
    crd = yaml.safe_load((CHART / "crds" / "slimspecservice.yaml").read_text())
    assert "ssvc" in crd["spec"]["names"]["shortNames"]
    # The inline manifest is a SlimSpecService the API server accepts.
    manifest = notes.split("<<EOF\n", 1)[1].split("  EOF", 1)[0]
    body = yaml.safe_load("\n".join(line.removeprefix("  ") for line in manifest.splitlines()))
    assert body["kind"] == "SlimSpecService"
    kube_cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(body)
    )
