"""Test bed tools: binary lookup, free ports, subprocesses and helm.

Binaries come from ``scripts/testbed/install.sh`` (cached under ``$SLIMSPEC_CACHE``,
default ``~/.cache/slimspec``); pinned versions live in ``scripts/testbed/versions.sh``.
A missing binary is a :class:`~slimspec_testbed.errors.TestbedError` (a failure, never
a skip, in the tests) naming the command to run.

- ``tool_path(name, k8s_version=None)``: absolute path of ``kube-apiserver``, ``etcd``,
  ``helm``, ``kubectl``, ``prometheus``, ``promtool``, ... (Kubernetes binaries of
  ``k8s_version`` when given, else of the pinned K8S_VERSION)
- ``run_checked(argv, env=..., check=True, timeout=120, input=None, cwd=None)``:
  ``CompletedProcess`` (text); on failure ``subprocess.CalledProcessError`` with stderr
  and the command in the message.
- :class:`Helm`: helm bound to one environment (``helm_env`` gives it its own
  cache/config/data dirs); ``helm("install", "rel", chart_dir, "-n", ns)``.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from slimspec_testbed.errors import fail

# The package is installed editable only, so the checkout is three levels up.
REPO_ROOT = Path(__file__).resolve().parents[3]
VERSIONS_FILE = REPO_ROOT / "scripts" / "testbed" / "versions.sh"
INSTALL_HINT = "run `bash scripts/testbed/install.sh` first (or `make test`)"


def cache_dir() -> Path:
    """The same cache root as scripts/lib.sh computes."""
    if os.environ.get("SLIMSPEC_CACHE"):
        return Path(os.environ["SLIMSPEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "slimspec"


def pinned_versions() -> dict[str, str]:
    """KEY=VALUE pairs of scripts/testbed/versions.sh."""
    out: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key] = value.strip().strip("\"'")
    return out


def venv_bin() -> Path:
    return Path(os.environ.get("SLIMSPEC_VENV", REPO_ROOT / ".venv")) / "bin"


def tool_path(name: str, k8s_version: str | None = None) -> Path:
    """Absolute path of a test bed binary, or a TestbedError saying how to get it.

    ``k8s_version``: a Kubernetes binary of that version instead of the pinned
    K8S_VERSION (the supported floor, K8S_FLOOR_VERSION, built by install-floor.sh).
    """
    hint = INSTALL_HINT
    if name in ("kube-apiserver", "kube-controller-manager"):
        version = k8s_version or pinned_versions()["K8S_VERSION"]
        path = cache_dir() / "k8s" / version / name
        if version == pinned_versions().get("K8S_FLOOR_VERSION"):
            hint = "run `bash scripts/testbed/install-floor.sh` first (or `make test`)"
    elif name in ("etcd", "etcdctl"):
        path = venv_bin() / name
    else:
        path = cache_dir() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        fail(f"test bed binary {name!r} not found at {path}: {hint}", traceback=False)
    return path


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_checked(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 120,
    input: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """subprocess.run with text output; a failure message that includes stderr."""
    proc = subprocess.run(
        [str(a) for a in argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        cmd = " ".join(str(a) for a in argv)
        raise subprocess.CalledProcessError(
            proc.returncode, cmd, proc.stdout, f"{proc.stderr}\n(command: {cmd})"
        )
    return proc


@dataclass
class Helm:
    """helm bound to one kubeconfig; call it like a function."""

    path: Path
    env: dict[str, str]

    def __call__(
        self, *args: str | os.PathLike[str], check: bool = True, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        return run_checked([self.path, *args], env=self.env, check=check, timeout=timeout)


def helm_env(base: dict[str, str], home: Path) -> dict[str, str]:
    """Own cache/config/data dirs so tests never touch ~/.config/helm."""
    env = dict(base)
    for var, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        env[var] = str(home / sub)
    return env


def stop_process(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited after `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
