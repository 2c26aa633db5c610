"""The node's tear-down leaves nothing behind, and a killed run does not break the next.

Each test brings up a node of its own (``scripts/testbed/node.sh``) on a separate
image store holding only the pause image, runs a container in the node's cgroups as
a pod would, and then kills what a crash kills: the process that owned the node (its
watchdog tears the node down), or everything but the container and its shim (the
next ``up`` tears the old node down). Afterwards no process of the old node runs, its
cgroups and network namespace are gone (interfaces, iptables rules and mounts with
it), and the host's own settings are untouched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from slimspec_testbed.node.images import image_tags
from slimspec_testbed.node.node_cluster import NODE_SCRIPT, RUN_PREFIX, read_state

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SYSCTLS = ("kernel/panic", "kernel/panic_on_oops", "vm/overcommit_memory")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return dict(
        os.environ,
        SLIMSPEC_NODE_STORE=str(tmp_path / "store"),
        SLIMSPEC_NODE_IMAGES="pause",
    )


@pytest.fixture
def owner() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "900"])
    yield proc
    proc.kill()
    proc.wait()


def node_sh(env: dict[str, str], *args: str, timeout: float = 300) -> str:
    proc = subprocess.run(
        ["bash", str(NODE_SCRIPT), *args], env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def up(env: dict[str, str], owner_pid: int) -> Path:
    node_dir = Path(tempfile.mkdtemp(prefix=RUN_PREFIX))
    node_sh(env, "up", str(node_dir), str(owner_pid))
    return node_dir


def run_pod_like_container(env: dict[str, str], node_dir: Path) -> list[int]:
    """A container of the pause image in the node's cgroups; its and its shim's PIDs."""
    state = read_state(node_dir)
    pause = f"docker.io/{image_tags().pause}"
    ctr = ["ctr", "-a", str(node_dir / "containerd.sock"), "-n", "k8s.io"]
    node_sh(env, "exec", str(node_dir), *ctr, "run", "-d", "--cgroup",
            f"/{state['CGROUP']}/pod-test", pause, "pod-test")  # fmt: skip
    tasks = node_sh(env, "exec", str(node_dir), *ctr, "tasks", "ls")
    (pid,) = [int(line.split()[1]) for line in tasks.splitlines() if line.startswith("pod-test")]
    shim = int(Path(f"/proc/{pid}/stat").read_text().split()[3])  # its parent
    return [pid, shim]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "(zombie)" not in _status(pid)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "(zombie)"


def netns_users(inode: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(os.stat(proc / "ns" / "net").st_ino) == inode:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def assert_gone(
    node_dir: Path, state: dict[str, str], pids: list[int], running: Path | None = None
) -> None:
    """Nothing of the node in `state` is left; `running`: another node up meanwhile."""
    assert not node_dir.exists()
    assert not any(alive(p) for p in [int(state["HOLDER_PID"]), *pids])
    # A freed namespace's inode number can be handed to the next one: then the old
    # namespace is gone by definition.
    if running is None or read_state(running)["NETNS_INODE"] != state["NETNS_INODE"]:
        assert netns_users(state["NETNS_INODE"]) == []
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{state['CGROUP']}"))
    # The bridge and its rules lived in the node's namespace only.
    assert subprocess.run(["ip", "link", "show", "cni0"], capture_output=True).returncode != 0
    assert subprocess.run(["iptables", "-t", "nat", "-S", "KUBE-SERVICES"],
                          capture_output=True).returncode != 0  # fmt: skip


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_the_watchdog_tears_down_a_node_whose_owner_died(
    env: dict[str, str], owner: subprocess.Popen[bytes]
) -> None:
    before = {key: Path(f"/proc/sys/{key}").read_text() for key in SYSCTLS}
    node_dir = up(env, owner.pid)
    state = read_state(node_dir)
    pids = run_pod_like_container(env, node_dir)
    # Inside, kubelet's expected values; outside, the host's own.
    inside = node_sh(env, "exec", str(node_dir), "cat", "/proc/sys/kernel/panic")
    assert inside.strip() == "10"
    assert {key: Path(f"/proc/sys/{key}").read_text() for key in SYSCTLS} == before
    owner.kill()
    t0 = time.monotonic()
    wait(lambda: not node_dir.exists(), 120, "the watchdog's tear-down")
    print(f"tear-down after the owner died: {time.monotonic() - t0:.1f}s")
    assert_gone(node_dir, state, pids)


def test_the_next_run_cleans_up_after_a_killed_one(
    env: dict[str, str], owner: subprocess.Popen[bytes]
) -> None:
    node_dir = up(env, owner.pid)
    state = read_state(node_dir)
    pids = run_pod_like_container(env, node_dir)
    # A hard crash: owner, watchdog and containerd die at once; the container and its
    # shim survive (re-parented), and the image store still lists the container.
    for name in ("watchdog.pid", "containerd.pid"):
        os.kill(int((node_dir / name).read_text()), signal.SIGKILL)
    owner.kill()
    owner.wait()
    assert all(alive(p) for p in pids)
    second = subprocess.Popen(["sleep", "900"])
    try:
        t0 = time.monotonic()
        new_dir = up(env, second.pid)
        print(f"next up, with the clean-up: {time.monotonic() - t0:.1f}s")
        assert_gone(node_dir, state, pids, running=new_dir)
        sock = str(new_dir / "containerd.sock")
        listed = node_sh(env, "exec", str(new_dir), "ctr", "-a", sock, "-n", "k8s.io",
                         "containers", "ls", "-q")  # fmt: skip
        assert listed.strip() == "", "the killed run's container is still in the store"
        node_sh(env, "down", str(new_dir))
        assert not new_dir.exists()
    finally:
        second.kill()
        second.wait()
