"""Model sources and calibration in the cluster, for real: the operator (real process,
chart RBAC) makes one preparation Job per version on the real API server; the Job's
containers run here as the kubelet would run them (job_runner.py): `slimspec fetch`
downloads a real model (SmolLM2-135M) from a stand-in hub on loopback that checks the
token, `slimspec calibrate` calibrates it; the real Job controller completes the Job;
the operator then makes the engines' Deployment, and a real engine started with that
Deployment's environment serves the calibrated head."""

from __future__ import annotations

import contextlib
import hashlib
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import free_port

from tests.support.hub_standin import HubStandIn

from .conftest import Api, OperatorProcess, sample
from .job_runner import VENV_BIN, container_env, finish_job, image_env, remap, run_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKEN = "hf_test_9c1d0e5f7a"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def hub(small_real_model: Path) -> Iterator[HubStandIn]:
    with HubStandIn({REPO: small_real_model}, token=TOKEN) as h:
        yield h


@pytest.fixture
def prep_operator(
    operator_kubeconfig: Path, namespace: str, tmp_path: Path, hub: HubStandIn
) -> Iterator[OperatorProcess]:
    op = OperatorProcess(operator_kubeconfig, namespace, tmp_path / "operator.log")
    op.env["SLIMSPEC_HF_ENDPOINT"] = hub.url  # the cluster's hub mirror
    op.start()
    try:
        yield op
    finally:
        op.stop()
        print(f"--- operator log ---\n{op.log()[-6000:]}")
    assert "forbidden: User" not in op.log(), "RBAC denial in the operator log"


def _job(api: Api) -> dict[str, Any]:
    batch = client.BatchV1Api(api.client)

    def made() -> dict[str, Any] | None:
        items = batch.list_namespaced_job(api.ns, label_selector="app.kubernetes.io/instance=chat")
        return api.client.sanitize_for_serialization(items.items[0]) if items.items else None

    return api.wait(made, what="preparation Job")


def _paths(tmp_path: Path, small_real_model: Path) -> dict[str, str]:
    """Where the pods' mounts are on this machine: the cache claim, /tmp, and the
    `models` claim (holding SmolLM2 under smol/) for pvc sources."""
    claim = tmp_path / "models-claim"
    claim.mkdir()
    (claim / "smol").symlink_to(small_real_model)
    for d in ("cache", "tmp", "engine-cache"):
        (tmp_path / d).mkdir()
    return {
        "/models/cache": str(tmp_path / "cache"),
        "/models/model-pvc-0": str(claim),
        "/tmp": str(tmp_path / "tmp"),
        "/var/cache/slimspec": str(tmp_path / "engine-cache"),
    }


def test_hub_model_downloaded_once_per_version_with_the_token(
    prep_operator: OperatorProcess,
    api: Api,
    namespace: str,
    hub: HubStandIn,
    kube_cluster: KubeCluster,
    small_real_model: Path,
    tmp_path: Path,
) -> None:
    api.core.create_namespaced_secret(
        namespace,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="hf-token"), string_data={"token": TOKEN}
        ),
    )
    target = {
        "source": "huggingface",
        "huggingface": {"id": REPO, "tokenSecret": {"name": "hf-token"}},
    }
    draft = {"source": "pvc", "pvc": {"claimName": "models", "path": "smol"}}
    model = {"version": "v1", "target": target, "draft": draft}
    api.create(sample(replicas=2, model=model, resources={"gpu": 0, "memory": "2Gi", "cpu": "1"}))

    job = _job(api)
    api.wait(lambda: api.condition("Progressing").get("reason") == "PreparingModel")
    assert api.deployments() == []  # no engine before its model is there
    (entry,) = api.get()["status"]["models"]
    assert entry["state"] in ("Pending", "Running") and entry["calibration"] == "Disabled"
    claim = api.core.read_namespaced_persistent_volume_claim("chat-model-cache", namespace)
    assert claim.spec.access_modes == ["ReadWriteMany"]
    assert claim.metadata.owner_references[0].name == "chat"

    paths = _paths(tmp_path, small_real_model)
    (fetch,) = job["spec"]["template"]["spec"]["containers"]
    out = remap(fetch["args"][fetch["args"].index("--out") + 1], paths)

    # The image alone is offline (HF_HUB_OFFLINE=1): that is why the step lifts it.
    offline = container_env(api, {"env": []}, paths) | {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    assert image_env()["HF_HUB_OFFLINE"] == "1"
    argv = [str(VENV_BIN / "slimspec"), "fetch", "--hf", REPO, "--out", str(tmp_path / "offline")]
    refused = subprocess.run(argv, env=offline, capture_output=True, text=True, check=False)
    assert refused.returncode != 0 and not hub.requests

    (ran,) = run_job(api, job, paths)
    assert Path(ran.stdout.strip()) == Path(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert sha256(Path(out) / name) == sha256(small_real_model / name), name
    assert hub.requests and all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
    assert TOKEN not in ran.stdout + ran.stderr  # the token is never printed
    assert TOKEN not in str(job)  # nor written into the Job (a secretKeyRef)
    weights = [p for m, p, _ in hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert len(weights) == 1

    finish_job(api, job["metadata"]["name"], kube_cluster.node_name)
    (dep,) = api.wait(lambda: api.deployments() or None, what="engine Deployment after the Job")
    assert dep.spec.replicas == 2
    pod = api.client.sanitize_for_serialization(dep.spec.template)["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert remap(env["MODEL_PATH"], paths) == out  # what the Job downloaded
    assert "HF_TOKEN" not in env and "initContainers" not in pod  # engines download nothing
    cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert cache["persistentVolumeClaim"] == {"claimName": "chat-model-cache", "readOnly": True}
    api.wait(lambda: api.get()["status"]["models"][0]["state"] == "Succeeded")
    assert len(hub.requests) == len(set(hub.requests))  # and nothing fetched twice

    # a failed Job: the served version keeps serving, Degraded says why
    api.patch_spec(
        {
            "model": {
                **model,
                "version": "v2",
                "target": {
                    **target,
                    "huggingface": {
                        "id": REPO,
                        "revision": "v2",
                        "tokenSecret": {"name": "hf-token"},
                    },
                },
            }
        }
    )
    batch = client.BatchV1Api(api.client)
    job2 = api.wait(
        lambda: next(
            (
                j
                for j in batch.list_namespaced_job(namespace).items
                if j.metadata.name != job["metadata"]["name"]
            ),
            None,
        ),
        what="the new version's Job",
    )
    pods = api.wait(
        lambda: (
            api.core.list_namespaced_pod(
                namespace, label_selector=f"job-name={job2.metadata.name}"
            ).items
        )
    )
    batch.patch_namespaced_job(job2.metadata.name, namespace, {"spec": {"backoffLimit": 0}})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    term = {"exitCode": 2, "reason": "Error", "startedAt": now, "finishedAt": now}
    for p in pods:
        status = {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "fetch-target",
                    "image": "x",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "state": {"terminated": term},
                }
            ],
        }
        api.core.patch_namespaced_pod_status(p.metadata.name, namespace, {"status": status})
    cond = api.wait(
        lambda: (c := api.condition("Degraded")).get("reason") == "PreparationFailed" and c,
        timeout=60,
        what="Degraded=PreparationFailed",
    )
    assert "v2" in cond["message"]
    assert [d.metadata.name for d in api.deployments()] == [dep.metadata.name]
    assert api.get()["status"]["servedVersion"] == "v1"

    # back to v1: the failed version's Job is no longer used by anything and goes
    hub_v1 = {"id": REPO, "revision": "main", "tokenSecret": {"name": "hf-token"}}
    api.patch_spec({"model": {**model, "target": {**target, "huggingface": hub_v1}}})
    api.wait(
        lambda: (
            [j.metadata.name for j in batch.list_namespaced_job(namespace).items]
            == [job["metadata"]["name"]]
        ),
        what="the unused Job deleted, v1's kept",
    )
    api.wait(lambda: api.condition("Degraded").get("status") == "False", what="Degraded cleared")


@contextlib.contextmanager
def _serve(env: dict[str, str], args: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    argv = [str(VENV_BIN / "slimspec"), *args, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            raise AssertionError(f"engine not ready: {log.read_text()[-4000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_calibration_runs_once_per_version_and_the_engines_serve_its_head(
    operator: OperatorProcess,
    api: Api,
    namespace: str,
    kube_cluster: KubeCluster,
    small_real_model: Path,
    tmp_path: Path,
) -> None:
    source = {"source": "pvc", "pvc": {"claimName": "models", "path": "smol"}}
    model = {"version": "v1", "target": source, "draft": source}
    fast = ["--count-chars", "50000", "--fit-tokens", "256", "--eval-tokens", "128",
            "--seq-len", "64", "--lowrank-rows", "2048"]  # fmt: skip
    resources = {"gpu": 0, "memory": "2Gi", "cpu": "1"}
    api.create(
        sample(
            replicas=1,
            model=model,
            resources=resources,
            calibration={"enabled": True, "args": fast},
        )
    )
    job = _job(api)
    (calibrate,) = job["spec"]["template"]["spec"]["containers"]
    assert calibrate["command"] == ["slimspec", "calibrate"]
    assert "--device" in calibrate["args"] and "cpu" in calibrate["args"]
    artifact_pod_path = calibrate["args"][calibrate["args"].index("--out") + 1]
    # the Job is created before the status patch that lists the model: wait for it
    # (reading it at once failed once in CI with no "models" yet)
    api.wait(
        lambda: (
            (api.get().get("status", {}).get("models") or [{}])[0].get("calibration") == "Pending"
        ),
        what="calibration Pending in the status",
    )

    paths = _paths(tmp_path, small_real_model)
    run_job(api, job, paths)
    artifact = Path(remap(artifact_pod_path, paths))
    assert (artifact / "calibration.json").is_file() and (artifact / "head.safetensors").is_file()
    finish_job(api, job["metadata"]["name"], kube_cluster.node_name)

    (dep,) = api.wait(lambda: api.deployments() or None, what="engine Deployment")
    api.wait(lambda: api.get()["status"]["models"][0]["calibration"] == "Calibrated")
    (entry,) = api.get()["status"]["models"]
    assert entry["artifact"] == artifact_pod_path and entry["state"] == "Succeeded"
    c = api.client.sanitize_for_serialization(dep.spec.template)["spec"]["containers"][0]
    env_items = {e["name"]: e for e in c["env"]}
    assert env_items["SLIMSPEC_CALIBRATION"]["value"] == artifact_pod_path
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/models/cache"]["readOnly"] is True

    # The engine, started with the Deployment's container (ConfigMap values resolved,
    # mount paths mapped here), serves the calibrated head and says so.
    cm = api.core.read_namespaced_config_map("chat-runtime", namespace).data
    env = container_env(api, {"env": [e for e in c["env"] if "value" in e]}, paths)
    for e in c["env"]:
        ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
        if ref:
            env[e["name"]] = cm[ref["key"]]
    env.pop("SLIMSPEC_ADMIN_TOKEN_FILE", None)
    env.pop("SLIMSPEC_RUNTIME_CONFIGMAP", None)  # no API server credentials in this process
    env |= {"SLIMSPEC_DTYPE": "float32", "HF_HUB_OFFLINE": "1"}
    args = [a for a in c["args"] if a not in ("--host", "0.0.0.0", "--port", "8080")]
    log = tmp_path / "engine.log"
    with (
        _serve(env, [*args, "--no-warmup"], log) as url,
        urllib.request.urlopen(f"{url}/metrics", timeout=10) as r,
    ):
        metrics = r.read().decode()
    line = next(m for m in metrics.splitlines() if m.startswith("slimspec_draft_head_info"))
    assert 'calibrated="true"' in line and f'artifact="{artifact}"' in line, line
    assert re.search(
        rf"draft head: calibrated, artifact {re.escape(str(artifact))}", log.read_text()
    )
