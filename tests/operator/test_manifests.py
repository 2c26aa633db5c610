from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.rollout import manifests as m

from .helpers import body


def svc(**kw):
    return SlimSpecService.from_body(body(**kw))


def env_of(dep):
    return {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_deployment_named_by_template_hash_with_contract_labels():
    s = svc()
    dep = m.deployment(s, replicas=2)
    h = m.desired_template_hash(s)
    assert dep["metadata"]["name"] == f"chat-{h}"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels == {
        "app.kubernetes.io/name": "slimspec-engine",
        "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/managed-by": "slimspec-operator",
        "slimspec.io/model-version": "v1",
        "slimspec.io/template-hash": h,
    }
    sel = dep["spec"]["selector"]["matchLabels"]
    assert all(labels[k] == v for k, v in sel.items())
    assert dep["spec"]["replicas"] == 2
    owner = dep["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-1" and owner["controller"] is True
    assert owner["kind"] == "SlimSpecService"


def test_engine_container_contract():
    dep = m.deployment(svc(), 1)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": "1"}
    # every emptyDir is size-limited; /dev/shm is one in memory
    empty = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
    assert empty == {
        "tmp": {"sizeLimit": "1Gi"},
        "cache": {"sizeLimit": "4Gi"},
        "dshm": {"medium": "Memory", "sizeLimit": "1Gi"},
    }
    mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["tmp"] == "/tmp"
    secret = next(v["secret"] for v in pod["volumes"] if "secret" in v)
    assert secret["secretName"] == "chat-admin-uid-1"  # the resource's UID in the name
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "16Gi"}
    sc = c["securityContext"]
    assert sc["runAsUser"] == 10001 and sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # a drain may wait for the longest request (the engine's request timeout, 300 s)
    assert pod["terminationGracePeriodSeconds"] > 300
    assert c["livenessProbe"]["timeoutSeconds"] >= 2  # a busy engine answers probes late
    assert "/admin/drain" in c["lifecycle"]["preStop"]["exec"]["command"][-1]
    env = env_of(dep)
    assert env["MODEL_VERSION"]["value"] == "v1"
    assert env["MODEL_PATH"]["value"] == "/models/model-pvc-0/qwen-1.5b"
    assert env["DRAFT_MODEL_PATH"]["value"] == "/models/model-pvc-0/qwen-0.5b"
    assert env["SLIMSPEC_RUNTIME_CONFIGMAP"]["value"] == "chat-runtime"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    ref = env["COMPRESSION_RATIO"]["valueFrom"]["configMapKeyRef"]
    assert ref == {"name": "chat-runtime", "key": "compression_ratio"}
    assert env["SLIMSPEC_DEVICE"]["value"] == "cuda"
    assert env["SLIMSPEC_MAX_BATCH_SIZE"]["value"] == "8"
    assert c["args"] == [
        "serve",
        "--host",
        "0.0.0.0",
        "--port",
        "8080",
        "--max-queue",
        "64",
        "--batch-wait-ms",
        "5",
    ]
    assert pod["serviceAccountName"] == "chat-engine"
    # one volume for the shared claim, mounted read-only
    pvcs = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert pvcs == [
        {"name": "model-pvc-0", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    ]


def test_cpu_only_has_no_gpu_limit():
    dep = m.deployment(svc(resources={"gpu": 0, "memory": "4Gi", "cpu": 1}), 1)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert c["resources"]["requests"]["cpu"] == "1"
    assert env_of(dep)["SLIMSPEC_DEVICE"]["value"] == "cpu"


def test_hash_changes_with_version_and_image_not_with_ratio_or_replicas():
    base = m.desired_template_hash(svc())
    assert m.desired_template_hash(svc()) == base  # stable
    assert m.desired_template_hash(svc(replicas=7)) == base
    assert m.desired_template_hash(svc(compression={"ratio": 0.45, "maxRatio": 0.5})) == base
    assert m.desired_template_hash(svc(qualityControl={"threshold": 0.5})) == base
    v2 = body()["spec"]["model"] | {"version": "v2"}
    assert m.desired_template_hash(svc(model=v2)) != base
    assert m.desired_template_hash(svc(image="x:2")) != base


def test_service_selects_one_template_hash():
    s = svc(service={"port": 80, "type": "NodePort"})
    out = m.service(s, "abc")
    assert out["metadata"]["name"] == "chat"
    assert out["spec"]["selector"]["slimspec.io/template-hash"] == "abc"
    assert out["spec"]["ports"][0] == {
        "name": "http",
        "port": 80,
        "targetPort": "http",
        "protocol": "TCP",
    }
    assert out["spec"]["type"] == "NodePort"


def test_runtime_configmap_ratio_in_force():
    cm = m.runtime_configmap(svc(compression={"ratio": 0.1}))
    assert cm["metadata"]["name"] == "chat-runtime"
    assert cm["data"] == {
        "compression_ratio": "0.1",
        "quality_threshold": "0.95",
        "fallback_strategy": "auto",
    }
    tuned = body(tuning={"enabled": True})
    tuned["status"] = {"compression": {"ratio": 0.42}}
    assert m.runtime_configmap(SlimSpecService.from_body(tuned))["data"]["compression_ratio"] == (
        "0.42"
    )
    tuned["status"] = {"compression": {"ratio": 0.9}}  # outside the spec's bounds: clamped
    assert m.runtime_configmap(SlimSpecService.from_body(tuned))["data"]["compression_ratio"] == (
        "0.5"
    )


def test_engine_role_reads_only_its_configmap():
    s = svc()
    role = m.role(s)
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["chat-runtime"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    rb = m.role_binding(s)
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "chat-engine", "namespace": "ml"}]
    assert m.selector_string("chat") == (
        "app.kubernetes.io/name=slimspec-engine,app.kubernetes.io/instance=chat"
    )
