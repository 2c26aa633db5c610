"""The two images, built for real by scripts/testbed/images.sh, run with Docker.

The engine image's runtime stage has no C compiler and carries the native kernels
compiled in its build stage; they load with the ABI the engine binds, and where the
CPU has the instructions they are compiled for (AVX512-VNNI), they pass the engine's
own self-checks. The engine answers /infer on the small real model (SmolLM2-135M
drafting for itself) mounted read-only, as uid 10001 with no network but loopback.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from slimspec_testbed.node.images import (
    KERNEL_LOADER_PROBE,
    Docker,
    ImageTags,
    docker_daemon,
    image_tags,
)
from slimspec_testbed.scenarios.userpath import models_volume_dir
from slimspec_testbed.tools import REPO_ROOT, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KERNEL_CHECK = REPO_ROOT / "scripts" / "image" / "native_kernels.py"
KERNELS_DIR = "/opt/slimspec/kernels"


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    with docker_daemon() as running:
        yield running


@pytest.fixture(scope="module")
def tags(docker: Docker) -> ImageTags:
    found = image_tags()
    for tag in (found.engine, found.operator):
        docker.require(tag)
    return found


def test_image_sizes_and_users(
    docker: Docker, tags: ImageTags, record_property: pytest.RecordProperty
) -> None:
    for name, tag in (("engine", tags.engine), ("operator", tags.operator)):
        size = docker.image_size(tag)
        record_property(f"{name}_image_bytes", size)
        print(f"{name} image {tag}: {size / 1e9:.2f} GB")
        user = docker("image", "inspect", "--format", "{{.Config.User}}", tag).stdout.strip()
        assert user == "10001:10001", (name, user)
    # The operator image stays small: no torch in it.
    assert docker.image_size(tags.operator) < 600e6
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    out = docker("run", "--rm", "--network", "none", "--entrypoint", "python", tags.operator,
                 "-c", probe)  # fmt: skip
    assert out.stdout.strip() == "True"
    out = docker("run", "--rm", "--network", "none", tags.operator, "--help")
    assert "usage" in out.stdout.lower()


def test_engine_kernels_compiled_at_build_time_load_without_a_compiler(
    docker: Docker, tags: ImageTags
) -> None:
    proc = docker(
        "run", "-i", "--rm", "--network", "none", "--entrypoint", "python", tags.engine,
        "-", "check", KERNELS_DIR, input=KERNEL_CHECK.read_text(), timeout=300,
    )  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["libraries"], report
    assert report["compilers_on_path"] == [], "the runtime stage must not carry a compiler"
    # the GGUF kernels ship for every x86-64 CPU (AMX, AVX512-VNNI, AVX-VNNI, AVX2, portable): this
    # CPU's build is there and passes its self-check
    assert report["gguf_for_this_cpu"] in report["gguf_libraries"], report
    assert report["gguf_self_check"] is True, report
    if report["cpu_supported"]:
        assert report["self_check"] is True, report
    else:
        # Loaded and bound, not run: executing them here would be an illegal instruction.
        assert report["self_check"] is None
        print(f"kernels loaded and bound, not run: no AVX512-VNNI nor AVX2 here ({report})")


def test_the_engine_in_the_image_loads_the_shipped_kernels(docker: Docker, tags: ImageTags) -> None:
    """No compiler at run time: the engine's own loader finds the library of its source
    in SLIMSPEC_KERNELS_DIR (read-only root: nothing is compiled or written)."""
    proc = docker(
        "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp",
        "--entrypoint", "python", tags.engine, "-c", KERNEL_LOADER_PROBE, timeout=300,
    )  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["loaded"] is report["cpu_supported"], report


def test_engine_image_answers_infer_on_the_small_pair(
    docker: Docker, tags: ImageTags, small_real_model: Path
) -> None:
    models = models_volume_dir(small_real_model)
    port = free_port()
    name = f"slimspec-e2e-engine-{port}"
    model = f"/models/models/{small_real_model.name}"
    docker(
        "run", "-d", "--rm", "--name", name, "--network", "host",
        "-v", f"{models}:/models:ro", "--tmpfs", "/tmp", "--read-only",
        "-e", f"MODEL_PATH={model}", "-e", f"DRAFT_MODEL_PATH={model}",
        "-e", "OMP_NUM_THREADS=1",
        tags.engine, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--device", "cpu",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            running = docker("inspect", "--format", "{{.State.Running}}", name, check=False)
            assert running.stdout.strip() == "true", docker("logs", name, check=False).stderr
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, docker("logs", name, check=False).stderr[-3000:]
            time.sleep(1)
        resp = httpx.post(
            f"{base}/infer", json={"input": "The capital of France is", "max_length": 8},
            timeout=120,
        )  # fmt: skip
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert isinstance(body["output"], str) and body["output"]
        assert body["latency_ms"] > 0
        assert 0 <= body["compression_ratio"] <= 0.95
    finally:
        docker("rm", "-f", name, check=False)
