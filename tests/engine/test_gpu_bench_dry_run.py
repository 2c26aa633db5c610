"""bench/gpu.py's CPU dry run: the GPU benchmark's code paths on tiny shapes and models,
so the one command a GPU machine runs is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two subprocesses that load torch and transformers

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_dry_run_writes_its_results(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_dry_run.json").read_text())
    assert doc["dry_run"] and doc["device"] == "cpu"
    rows = doc["head_microbench"]["by_rows"]
    assert set(rows) == {"1", "8", "32"}
    assert set(rows["1"]["seconds"]) == {"0.0", "0.5", "0.8", "0.95"}
    assert all(s > 0 for r in rows.values() for s in r["seconds"].values())
    dec = doc["decode"]
    assert dec["target_only_tok_s"] > 0 and dec["hf_assisted_e2e_tok_s"] > 0
    assert set(dec["speedup_vs_target"]) == {"0.0", "0.5", "0.8", "0.95"}
    assert set(dec["slimspec"]["predicted"]) >= {"0.0", "0.8"}
    assert (tmp_path / "gpu_dry_run.png").is_file()
    # without a GPU the full run refuses with a pointer to the dry run
    if "cuda" not in doc["device"]:
        full = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "gpu.py"), "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert full.returncode == 2 and "--dry-run" in full.stderr
