"""`helm test`'s inference pod: rendered where it should be, and its client script,
exactly as rendered, gets a real answer from a real engine server.

The test bed has no kubelet, so the pod itself cannot run here: the API server
accepts it under the `restricted` Pod Security level (test_cluster.py's dry run of
the `full` values), and this module runs the pod's own command and environment as
a local process against the engine's real HTTP app (tiny random weights), with only
INFER_URL pointed at it. On a test bed with a real node, `helm test` runs the pod
for real against engines in the cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.conftest import TinyModels, running_server, tiny_config

from .conftest import Rendered, render

POD = "ss-slimspec-operator-test-inference"


def inference_pod(r: Rendered) -> dict[str, Any] | None:
    pods = [d for d in r.of_kind("Pod") if d["metadata"]["name"] == POD]
    return pods[0] if pods else None


def test_inference_test_targets_the_example_or_the_named_service() -> None:
    pod = inference_pod(render("--set", "example.enabled=true"))
    assert pod is not None
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["INFER_URL"] == "http://slimspec-example.slimspec-system.svc:8080/infer"

    named = render(
        "--set",
        "tests.inference.service=chat",
        "--set",
        "tests.inference.namespace=llm",
        "--set",
        "tests.inference.port=80",
    )
    pod = inference_pod(named)
    assert pod is not None
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["INFER_URL"] == "http://chat.llm.svc:80/infer"

    assert inference_pod(render()) is None  # nothing to send a request to
    assert (
        inference_pod(render("--set", "example.enabled=true", "--set", "tests.enabled=false"))
        is None
    )


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with running_server(tiny_config(TinyModels())) as base:
        yield base


def run_pod_command(
    pod: dict[str, Any], url: str, timeout_s: str = "20"
) -> subprocess.CompletedProcess[str]:
    """The container's command and env, run by this machine's python."""
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    env.update(INFER_URL=url, INFER_TIMEOUT_SECONDS=timeout_s)
    command = container["command"]
    assert command[:2] == ["python", "-c"]
    return subprocess.run(
        [sys.executable, "-c", command[2]],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inference_script_passes_against_a_real_engine(engine_url: str) -> None:
    pod = inference_pod(
        render("--set", "example.enabled=true", "--set", "tests.inference.maxLength=8")
    )
    assert pod is not None
    out = run_pod_command(pod, f"{engine_url}/infer")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("PASS"), out.stdout


def test_inference_script_fails_on_a_wrong_answer(engine_url: str) -> None:
    pod = inference_pod(render("--set", "example.enabled=true"))
    assert pod is not None
    out = run_pod_command(pod, f"{engine_url}/no-such-endpoint")  # 404: not retried
    assert out.returncode == 1 and "FAIL" in out.stdout, out.stdout + out.stderr
    out = run_pod_command(pod, "http://127.0.0.1:9/infer", timeout_s="1")  # nothing listens
    assert out.returncode == 1 and "FAIL" in out.stdout, out.stdout + out.stderr
