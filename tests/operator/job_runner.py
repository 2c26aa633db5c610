"""Run a Job the operator made, for real, on this machine, and report it done.

The test bed has no kubelet that runs containers, so a cluster test takes the Job
the operator created from the API server and runs each of its containers in order
(init containers, then the container) as a local process: the command from the
manifest (`slimspec ...` -> this checkout's venv), its arguments and environment
(`value` as written, `valueFrom.secretKeyRef` read from the Secret, as the kubelet
would), starting from the image's own environment (Dockerfile.engine's ENV), with
the pod's mount paths mapped onto local directories. Then `finish_job` marks the
Job's pod Succeeded, as a kubelet would, and the real Job controller completes it.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client

from .conftest import ROOT, Api

VENV_BIN = Path(sys.executable).parent


def image_env() -> dict[str, str]:
    """The ENV of Dockerfile.engine's runtime stage (what every container starts with)."""
    text = (ROOT / "Dockerfile.engine").read_text()
    runtime = text[text.rindex("FROM ") :]
    env: dict[str, str] = {}
    for block in re.findall(r"^ENV\s+((?:.*\\\n)*.*)$", runtime, flags=re.M):
        for key, value in re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", block.replace("\\\n", " ")):
            env[key] = value
    return env


def remap(text: str, paths: Mapping[str, str]) -> str:
    for pod_path in sorted(paths, key=len, reverse=True):
        if text == pod_path or text.startswith(pod_path + "/"):
            return paths[pod_path] + text[len(pod_path) :]
    return text


def container_env(api: Api, c: Mapping[str, Any], paths: Mapping[str, str]) -> dict[str, str]:
    env = {k: remap(v, paths) for k, v in image_env().items() if k != "PATH"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"
    env["HOME"] = paths.get("/tmp", "/tmp")
    for item in c.get("env") or []:
        if "value" in item:
            env[item["name"]] = remap(item["value"], paths)
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        secret = api.core.read_namespaced_secret(ref["name"], api.ns)
        env[item["name"]] = base64.b64decode(secret.data[ref["key"]]).decode()
    return env


def run_job(
    api: Api, job: Mapping[str, Any], paths: Mapping[str, str], timeout: float = 900
) -> list[subprocess.CompletedProcess[str]]:
    """Run the Job's containers in order; raises AssertionError at the first failure."""
    pod = job["spec"]["template"]["spec"]
    done = []
    for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
        command = [str(VENV_BIN / c["command"][0]), *c["command"][1:]]
        argv = command + [remap(a, paths) for a in c.get("args") or []]
        out = subprocess.run(
            argv,
            env=container_env(api, c, paths),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert out.returncode == 0, f"{c['name']}: {argv}\n{out.stderr[-4000:]}"
        done.append(out)
    return done


def finish_job(api: Api, name: str, node: str) -> dict[str, Any]:
    """Mark the Job's pod Succeeded (as its kubelet would); returns the completed Job."""
    batch = client.BatchV1Api(api.client)
    pods = api.wait(
        lambda: api.core.list_namespaced_pod(api.ns, label_selector=f"job-name={name}").items,
        what=f"pod of Job {name}",
    )
    pod = pods[0]
    if not pod.spec.node_name:
        target = client.V1ObjectReference(kind="Node", name=node)
        binding = client.V1Binding(
            metadata=client.V1ObjectMeta(name=pod.metadata.name), target=target
        )
        api.core.create_namespaced_binding(api.ns, binding, _preload_content=False)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    term = {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
    statuses = [
        {
            "name": c.name,
            "image": c.image,
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "state": {"terminated": term},
        }
        for c in pod.spec.containers
    ]
    status = {"phase": "Succeeded", "containerStatuses": statuses}
    api.core.patch_namespaced_pod_status(pod.metadata.name, api.ns, {"status": status})

    def complete() -> dict[str, Any] | None:
        job = api.client.sanitize_for_serialization(batch.read_namespaced_job(name, api.ns))
        conds = (job.get("status") or {}).get("conditions") or []
        return (
            job if any(c["type"] == "Complete" and c["status"] == "True" for c in conds) else None
        )

    return api.wait(complete, timeout=60, what=f"Job {name} complete")
