"""scripts/testbed/node.sh's clean-up of runs that were killed half way.

An image import (`node.sh import`, run by scripts/test.sh) killed before its own
clean-up leaves a /tmp/slimspec-node-import-* folder with neither an owner nor a state
file; `node.sh up` (every node test) must clear it and start, not fail on it (it once
exited 2 there, failing every real-node test that came after)."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from slimspec_testbed.tools import REPO_ROOT

NODE_SH = REPO_ROOT / "scripts" / "testbed" / "node.sh"


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_imports_folder_is_cleared_and_does_not_fail_cleanup() -> None:
    killed = Path(tempfile.mkdtemp(prefix="slimspec-node-import-"))
    (killed / "containerd.pid").write_text(f"{dead_pid()}\n")
    bare = Path(tempfile.mkdtemp(prefix="slimspec-node-"))  # killed before recording
    try:
        proc = subprocess.run(["bash", str(NODE_SH), "cleanup"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert not killed.exists()
    finally:
        subprocess.run(["rm", "-rf", str(killed), str(bare)], check=False)


def test_a_live_imports_folder_is_left_alone() -> None:
    live = Path(tempfile.mkdtemp(prefix="slimspec-node-import-"))
    sleeper = subprocess.Popen(["sleep", "30"])
    (live / "containerd.pid").write_text(f"{sleeper.pid}\n")
    try:
        proc = subprocess.run(["bash", str(NODE_SH), "cleanup"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert live.exists()
    finally:
        sleeper.kill()
        subprocess.run(["rm", "-rf", str(live)], check=False)
