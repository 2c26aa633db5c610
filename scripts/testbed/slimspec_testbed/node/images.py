"""The test bed's container images and its Docker daemon.

``scripts/testbed/images.sh`` builds the images (a Debian base from debootstrap, the
engine and operator from their own Dockerfiles, the node's pause image), tagged by a
hash of their inputs; ``scripts/testbed/dockerd.sh`` runs the Docker daemon that
builds and keeps them.

- ``image_tags()``: the tags the current checkout's sources need (``ImageTags``).
- ``docker_daemon()``: a context manager that makes sure the test bed's dockerd
  answers (starting it if needed, stopping it afterwards only if it started it) and
  yields a ``Docker`` handle: ``docker("run", ...)``, ``.image_exists(tag)``,
  ``.image_size(tag)``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from slimspec_testbed.errors import fail
from slimspec_testbed.tools import REPO_ROOT, cache_dir, run_checked

SCRIPTS = REPO_ROOT / "scripts" / "testbed"
DOCKER_CLI = Path("/usr/bin/docker")  # Debian's client, the daemon's version
BUILD_HINT = "run `bash scripts/testbed/images.sh` first (or `make test`)"
# Run with the engine image's python: what the engine's own loader decides at start
# (the native kernels on where the CPU has them, from SLIMSPEC_KERNELS_DIR).
KERNEL_LOADER_PROBE = (
    "import json; from slimspec.cpu import native_kernels as nk; "
    "print(json.dumps({'cpu_supported': nk.cpu_supported(), 'loaded': nk.load() is not None}))"
)


@dataclass(frozen=True)
class ImageTags:
    base: str
    engine: str
    operator: str
    pause: str
    prometheus: str
    keda: str


def image_tags() -> ImageTags:
    out = run_checked(["bash", SCRIPTS / "images.sh", "tags"], timeout=60).stdout
    tags = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return ImageTags(
        base=tags["BASE_IMAGE"],
        engine=tags["ENGINE_IMAGE"],
        operator=tags["OPERATOR_IMAGE"],
        pause=tags["PAUSE_IMAGE"],
        prometheus=tags["PROMETHEUS_IMAGE"],
        keda=tags["KEDA_IMAGE"],
    )


def docker_socket() -> Path:
    return cache_dir() / "docker" / "docker.sock"


@dataclass
class Docker:
    """The Docker client bound to the test bed's daemon."""

    env: dict[str, str]

    def __call__(
        self,
        *args: str | os.PathLike[str],
        check: bool = True,
        timeout: float = 300,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return run_checked(
            [DOCKER_CLI, *args], env=self.env, check=check, timeout=timeout, input=input
        )

    def image_exists(self, tag: str) -> bool:
        return self("image", "inspect", tag, check=False).returncode == 0

    def image_size(self, tag: str) -> int:
        """Bytes of the image's layers, as `docker images` counts them."""
        return int(self("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())

    def require(self, tag: str) -> None:
        if not self.image_exists(tag):
            fail(f"image {tag} is not built: {BUILD_HINT}", traceback=False)


def _answers(env: dict[str, str]) -> bool:
    if not DOCKER_CLI.exists():
        return False
    proc = subprocess.run(
        [DOCKER_CLI, "version"], env=env, capture_output=True, timeout=30, check=False
    )
    return proc.returncode == 0


@contextlib.contextmanager
def docker_daemon() -> Iterator[Docker]:
    env = dict(os.environ, DOCKER_HOST=f"unix://{docker_socket()}")
    started = False
    if not _answers(env):
        proc = run_checked(["bash", SCRIPTS / "dockerd.sh", "start"], check=False, timeout=120)
        if proc.returncode != 0:
            fail(f"the test bed's dockerd did not start:\n{proc.stdout}{proc.stderr}")
        started = True
    try:
        yield Docker(env)
    finally:
        if started:
            run_checked(["bash", SCRIPTS / "dockerd.sh", "stop"], check=False, timeout=120)
