"""The set-up scripts' exit status: CI trusts `make test`'s, so a failed step (pytest
included) must fail the whole command, also when a caller does `step ... || rc=$?`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "scripts" / "lib.sh"


def run_bash(body: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = f'source "{LIB}"\n{body}\n'
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "SLIMSPEC_CACHE": str(tmp_path)},
        timeout=30,
    )


@pytest.mark.parametrize("code", [1, 3])
def test_failed_step_keeps_its_status_under_or(code, tmp_path):
    # scripts/test.sh runs pytest exactly like this
    res = run_bash(f"rc=0\nstep pytest bash -c 'exit {code}' || rc=$?\necho rc=$rc", tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"rc={code}" in res.stdout
    assert f"FAILED (exit {code})" in res.stdout


def test_failed_step_stops_a_script(tmp_path):
    res = run_bash("step one false\necho not-reached", tmp_path)
    assert res.returncode == 1
    assert "not-reached" not in res.stdout


def test_passing_step_reports_its_time(tmp_path):
    res = run_bash("step one true\necho after", tmp_path)
    assert res.returncode == 0
    assert "<== one took" in res.stdout and "after" in res.stdout
