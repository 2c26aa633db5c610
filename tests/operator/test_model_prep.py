"""Model preparation (pure): which versions need a Job, what the Job runs, and how the
engine pods find what it prepared."""

from __future__ import annotations

from typing import Any

from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.rollout import manifests as m
from slimspec_operator.rollout.model_prep import (
    cache_claim,
    hub_path,
    job_state,
    prep_job,
    preparation,
)

from .helpers import body

HF_TARGET = {
    "source": "huggingface",
    "huggingface": {
        "id": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "revision": "main",
        "tokenSecret": {"name": "hf-token"},
    },
}
PVC_DRAFT = {"source": "pvc", "pvc": {"claimName": "drafts", "path": "smol"}}
OWNER = {"namespace": "ml", "ownerReferences": [{"uid": "uid-1"}]}


def svc(name: str = "chat", **spec: Any) -> SlimSpecService:
    b = body(**spec)
    b["metadata"]["name"] = name
    return SlimSpecService.from_body(b)


def hf_svc(**spec: Any) -> SlimSpecService:
    return svc(model={"version": "v2", "target": HF_TARGET, "draft": PVC_DRAFT}, **spec)


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_pvc_sources_without_calibration_need_no_preparation() -> None:
    s = svc()
    assert preparation(s) is None
    pod = m.deployment(s, 1)["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert all(v["name"] != "model-cache" for v in pod["volumes"])


def test_hub_download_runs_once_per_version_in_a_job_not_in_each_pod() -> None:
    s = hf_svc()
    prep = preparation(s)
    assert prep is not None and prep.artifact is None
    (download,) = prep.downloads
    assert download.path == hub_path("HuggingFaceTB/SmolLM2-135M-Instruct", "main")
    job = prep_job(s, prep, OWNER, "chat-engine", hf_endpoint="http://hub.internal")
    assert job["metadata"]["name"] == prep.job_name == f"chat-prep-{prep.key[:5]}"
    pod = job["spec"]["template"]["spec"]
    (fetch,) = pod["containers"]
    assert "initContainers" not in pod and pod["restartPolicy"] == "Never"
    assert fetch["command"] == ["slimspec", "fetch"]
    assert fetch["args"] == [
        "--hf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "--revision",
        "main",
        "--out",
        download.path,
    ]
    e = env(fetch)
    assert e["HF_HUB_OFFLINE"]["value"] == "0"  # the image's offline default, lifted here only
    assert e["HF_ENDPOINT"]["value"] == "http://hub.internal"
    assert e["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    assert fetch["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
    claim = {"claimName": "chat-model-cache"}
    assert {"name": "model-cache", "persistentVolumeClaim": claim} in pod["volumes"]
    # the Job's pods are not engines: no Service, PDB or scale selector counts them
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "slimspec-model-prep"
    assert job["spec"]["activeDeadlineSeconds"] == 7200

    # the engines read the snapshot from the cache claim, read-only, and fetch nothing
    pod = m.deployment(s, 3)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert env(c)["MODEL_PATH"]["value"] == download.path
    assert env(c)["DRAFT_MODEL_PATH"]["value"] == "/models/model-pvc-0/smol"
    assert "SLIMSPEC_CALIBRATION" not in env(c) and "initContainers" not in pod
    cache = {"claimName": "chat-model-cache", "readOnly": True}
    assert {"name": "model-cache", "persistentVolumeClaim": cache} in pod["volumes"]
    mount = {"name": "model-cache", "mountPath": "/models/cache", "readOnly": True}
    assert mount in c["volumeMounts"]
    assert "HF_TOKEN" not in env(c)  # only the download step sees the token


def test_calibration_runs_after_the_downloads_and_the_engines_load_its_artifact() -> None:
    s = hf_svc(calibration={"enabled": True, "args": ["--fit-tokens", "512"]})
    prep = preparation(s)
    assert prep is not None and prep.artifact == f"/models/cache/calibration/{prep.key}"
    pod = prep_job(s, prep, OWNER, "chat-engine")["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    (calibrate,) = pod["containers"]
    assert fetch["name"] == "fetch-target" and "HF_ENDPOINT" not in env(fetch)
    assert calibrate["command"] == ["slimspec", "calibrate"]
    assert calibrate["args"] == [
        "--target",
        prep.downloads[0].path,
        "--draft",
        "/models/model-pvc-0/smol",
        "--out",
        prep.artifact,
        "--corpus",
        "stdlib",
        "--device",
        "cuda",
        "--fit-tokens",
        "512",
    ]
    assert calibrate["resources"]["limits"]["nvidia.com/gpu"] == "1"  # the engine's compute
    draft_claim = {
        "name": "model-pvc-0",
        "persistentVolumeClaim": {"claimName": "drafts", "readOnly": True},
    }
    assert draft_claim in pod["volumes"]
    dep = m.deployment(s, 1)
    assert (
        env(dep["spec"]["template"]["spec"]["containers"][0])["SLIMSPEC_CALIBRATION"]["value"]
        == prep.artifact
    )
    annotations = dep["metadata"]["annotations"]
    assert annotations["slimspec.io/preparation-key"] == prep.key
    assert annotations["slimspec.io/calibration-artifact"] == prep.artifact


def test_calibration_alone_needs_a_preparation_too() -> None:
    prep = preparation(svc(calibration={"enabled": True}))
    assert prep is not None and prep.downloads == () and prep.artifact is not None


def test_the_key_follows_what_the_result_depends_on() -> None:
    def key(**spec: Any) -> str:
        prep = preparation(hf_svc(**spec))
        assert prep is not None
        return prep.key

    base = key()
    assert key(replicas=9) == base
    assert key(image="ghcr.io/slimspec/engine:0.2.0") == base  # a download is a download
    target = HF_TARGET | {"huggingface": {"id": HF_TARGET["huggingface"]["id"], "revision": "v2"}}
    other = preparation(svc(model={"version": "v2", "target": target, "draft": PVC_DRAFT}))
    assert other is not None and other.key != base
    on = key(calibration={"enabled": True})
    assert on != base
    assert key(calibration={"enabled": True}, image="ghcr.io/slimspec/engine:0.2.0") != on


def test_job_names_fit_a_label_value() -> None:
    prep = preparation(svc("c" * 52, calibration={"enabled": True}))
    assert prep is not None and len(prep.job_name) <= 63


def test_cache_claim() -> None:
    s = hf_svc(modelCache={"size": "100Gi", "storageClassName": "filestore"})
    claim = cache_claim(s, OWNER)
    assert claim is not None and claim["metadata"]["name"] == "chat-model-cache"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "100Gi"}},
        "storageClassName": "filestore",
    }
    given = hf_svc(modelCache={"claimName": "shared-models"})
    assert cache_claim(given, OWNER) is None
    prep = preparation(given)
    assert prep is not None
    volumes = prep_job(given, prep, OWNER, "x")["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["persistentVolumeClaim"] == {"claimName": "shared-models"}


def test_job_state() -> None:
    assert job_state(None) == ("Missing", "")
    assert job_state({"status": {}}) == ("Pending", "")
    assert job_state({"status": {"active": 1}}) == ("Running", "")
    done = {"conditions": [{"type": "Complete", "status": "True"}]}
    assert job_state({"status": done}) == ("Succeeded", "")
    failed = {
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "x"}
        ]
    }
    assert job_state({"status": failed}) == ("Failed", "BackoffLimitExceeded: x")
