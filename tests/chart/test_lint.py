"""hadolint on both Dockerfiles and checkov on the chart's rendered manifests and
the Dockerfiles: clean, or each skip justified in place (checkov.io/skipN
annotations in the chart templates, with a reason). chart-testing's `ct lint` on
the chart.

checkov is slow to start (~10 s), so it runs once per session over every values
variant; it lives in its own pinned tool venv (scripts/install-linters.sh).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from slimspec_testbed.tools import cache_dir, run_checked, venv_bin

from .conftest import REPO, VARIANTS, helm_bin, helm_template

DOCKERFILES = ("Dockerfile.engine", "Dockerfile.operator")


def checkov_bin() -> Path:
    """checkov from its own pinned tool venv; scripts/install-linters.sh makes it
    (idempotent: seconds when cached), so a fresh CI machine needs no extra step."""
    path = cache_dir() / "tools" / "checkov" / "bin" / "checkov"
    run_checked(["bash", REPO / "scripts" / "install-linters.sh"], timeout=600)
    if not path.exists():
        pytest.fail(f"checkov not found at {path} after scripts/install-linters.sh", pytrace=False)
    return path


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_clean(dockerfile: str) -> None:
    out = run_checked(
        [venv_bin() / "hadolint", "--config", REPO / ".hadolint.yaml", REPO / dockerfile],
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "", out.stdout + out.stderr


@pytest.fixture(scope="session")
def checkov_report(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("checkov")
    (root / "k8s").mkdir()
    (root / "docker").mkdir()
    for name, args in VARIANTS.items():
        (root / "k8s" / f"{name}.yaml").write_text(helm_template(*args).stdout)
    for name in DOCKERFILES:
        shutil.copy(REPO / name, root / "docker" / name)
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE")
    out = run_checked(
        [
            checkov_bin(),
            "-d",
            root,
            "--framework",
            "kubernetes",
            "dockerfile",
            "--output",
            "json",
            "--skip-download",
            "--soft-fail",
        ],
        env=env,
        timeout=300,
    )
    report = json.loads(out.stdout)
    return report if isinstance(report, list) else [report]


def by_framework(report: list[dict[str, Any]], framework: str) -> dict[str, Any]:
    (found,) = [r for r in report if r["check_type"] == framework]
    return found


@pytest.mark.parametrize("framework", ["kubernetes", "dockerfile"])
def test_checkov_has_no_failed_checks(framework: str, checkov_report: list) -> None:
    result = by_framework(checkov_report, framework)
    failed = [
        f"{c['check_id']} {c['check_name']} ({c['resource']})"
        for c in result["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(failed)
    assert result["summary"]["passed"] >= 10, result["summary"]
    assert result["summary"]["parsing_errors"] == 0


def test_checkov_skips_are_justified(checkov_report: list) -> None:
    k8s = by_framework(checkov_report, "kubernetes")
    skipped = k8s["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} <= {
        "CKV_K8S_38",  # operator needs its SA token
        "CKV_K8S_43",  # digest optional (operator.image.digest)
        "CKV_K8S_15",  # pinned tag, IfNotPresent
        "CKV_K8S_8",  # one-shot helm test pod: no probes
        "CKV_K8S_9",
    }
    for c in skipped:
        reason = (c.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason) > 15, (c["check_id"], reason)


def test_ct_lint_clean(tmp_path: Path) -> None:
    """chart-testing's `ct lint` (built by scripts/install-linters.sh): Chart.yaml
    against ct's schema (yamale), yamllint on Chart.yaml and values.yaml with ct's
    rules, and helm lint. Maintainer names are not looked up (no GitHub API here)
    and there is no version-bump check (it compares against a git remote)."""
    run_checked(["bash", REPO / "scripts" / "install-linters.sh"], timeout=900)
    ct = cache_dir() / "tools" / "ct"
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["PATH"] = os.pathsep.join([str(ct / "bin"), str(helm_bin().parent), env["PATH"]])
    for var, sub in (("HELM_CACHE_HOME", "c"), ("HELM_CONFIG_HOME", "cf"), ("HELM_DATA_HOME", "d")):
        env[var] = str(tmp_path / sub)
    out = run_checked(
        [
            ct / "bin" / "ct",
            "lint",
            "--charts",
            "charts/slimspec",
            "--chart-yaml-schema",
            ct / "etc" / "chart_schema.yaml",
            "--lint-conf",
            ct / "etc" / "lintconf.yaml",
            "--validate-maintainers=false",
            "--check-version-increment=false",
        ],
        env=env,
        cwd=REPO,
        check=False,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "All charts linted successfully" in out.stdout
    assert "Validation success" in out.stdout  # the Chart.yaml schema check ran
