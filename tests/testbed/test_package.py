"""The test bed is a package that tests and benchmarks import the same way: it works
without pytest and from any directory, and the benchmarks need no path edits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

IMPORT_ALL = """
import importlib, pkgutil, sys
import slimspec_testbed
for mod in pkgutil.walk_packages(slimspec_testbed.__path__, "slimspec_testbed."):
    if not mod.name.endswith("__main__"):
        importlib.import_module(mod.name)
print("pytest" in sys.modules)
"""


def test_package_imports_without_pytest(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("script", ["rollout.py", "tuning.py", "decode.py"])
def test_benchmark_starts_from_any_directory(script: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")


def test_no_path_edits_in_tests_or_benchmarks() -> None:
    edits = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("tests", "bench")
        for path in sorted((REPO / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "sys.path" in line and path != Path(__file__).resolve()
    ]
    assert edits == []
