"""The API server itself rejects bad SlimSpecService specs (CRD schema + CEL),
with messages that say what is wrong, and accepts the legal edge cases next to each
rule. Server-side dry run: nothing is stored. Every case runs on the test bed's
pinned kube-apiserver and on the oldest one the chart supports (``crd_server``,
tests/support/crd_fixtures.py), so the chart's kubeVersion floor is true.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from slimspec_testbed.cluster.handle import KubeCluster

from tests.support.crd_fixtures import CrdServer

from .conftest import sample

pytestmark = pytest.mark.cluster


def _set(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    *parents, leaf = path.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return body


_DELETE = object()
_DOTDOT = "path must not have a '..' segment"
_BOTH = "pvc and huggingface are mutually exclusive"
_CLAIM = "pvc.claimName: Invalid value"
_REVISION = "spec.model.target.huggingface.revision: Invalid value"
_IMAGE = "spec.image: Invalid value"


def _hf(**fields: str) -> dict[str, Any]:
    return {"source": "huggingface", "huggingface": {"id": "Qwen/Qwen2.5-1.5B", **fields}}


CASES = [
    ("spec.model", _DELETE, "spec.model: Required value"),
    ("spec.model.version", _DELETE, "spec.model.version: Required value"),
    ("spec.model.version", "v 1", "spec.model.version: Invalid value"),
    ("spec.model.target.source", "s3", 'spec.model.target.source: Unsupported value: "s3"'),
    ("spec.model.draft.pvc", _DELETE, "source: pvc needs the pvc field"),
    (
        "spec.model.target",
        {"source": "huggingface"},
        "source: huggingface needs the huggingface field",
    ),
    ("spec.model.target.pvc.path", "../etc", _DOTDOT),
    ("spec.model.target.pvc.path", "models/../../etc", _DOTDOT),
    ("spec.model.draft.pvc.path", "models/..", _DOTDOT),
    ("spec.model.draft.pvc.path", "..", _DOTDOT),
    (
        "spec.model.target",
        {"source": "pvc", "pvc": {"claimName": "m"}, "huggingface": {"id": "a/b"}},
        _BOTH,
    ),
    (
        "spec.model.draft",
        {"source": "huggingface", "pvc": {"claimName": "m"}, "huggingface": {"id": "a/b"}},
        _BOTH,
    ),
    ("spec.model.target.pvc.claimName", "Models", _CLAIM),
    ("spec.model.target.pvc.claimName", "models_v2", _CLAIM),
    ("spec.model.target.pvc.claimName", "-models", _CLAIM),
    ("spec.model.draft.pvc.claimName", "m" * 254, "spec.model.draft.pvc.claimName: Too long"),
    ("spec.model.target", _hf(revision="$(HOME)"), _REVISION),
    ("spec.model.target", _hf(revision="main; rm -rf /"), _REVISION),
    ("spec.model.target", _hf(revision="v1..v2"), _REVISION),
    ("spec.model.target", _hf(revision=" main"), _REVISION),
    ("spec.image", " ghcr.io/slimspec/engine:0.1.0", _IMAGE),
    ("spec.image", "ghcr.io/slimspec/engine:0.1.0 ", _IMAGE),
    ("spec.image", "ghcr.io/slimspec/my engine:0.1.0", _IMAGE),
    ("spec.image", "ghcr.io/SlimSpec/engine", _IMAGE),
    ("spec.image", "engine:", _IMAGE),
    ("spec.image", "engine@sha256:abc", _IMAGE),
    ("spec.image", "$(IMAGE)", _IMAGE),
    ("spec.image", "a" * 300 * 1024, "spec.image: Too long"),
    ("spec.tuning", {"queries": {"p99Latency": "x" * 1025}}, "p99Latency: Too long"),
    ("spec.tuning", {"queries": {"queueDepth": "x" * 1025}}, "queueDepth: Too long"),
    ("spec.prometheus", {"url": "http://" + "p" * 1018}, "spec.prometheus.url: Too long"),
    ("spec.resources", {"memory": "1" * 65}, "spec.resources.memory: Too long"),
    ("spec.compression", {"ratio": 0.6}, "compression must satisfy minRatio <= ratio <= maxRatio"),
    (
        "spec.compression",
        {"ratio": 0.3, "minRatio": 0.4},
        "compression must satisfy minRatio <= ratio <= maxRatio",
    ),
    ("spec.compression", {"ratio": 0.99, "maxRatio": 0.99}, "should be less than or equal to 0.95"),
    ("spec.compression", {"ratio": -0.1, "minRatio": -0.1}, "should be greater than or equal to 0"),
    ("spec.qualityControl", {"threshold": 1.5}, "spec.qualityControl.threshold: Invalid value"),
    ("spec.qualityControl", {"fallbackStrategy": "maybe"}, 'Unsupported value: "maybe"'),
    ("spec.batching", {"maxBatchSize": 257}, "should be less than or equal to 256"),
    ("spec.batching", {"maxBatchSize": 0}, "should be greater than or equal to 1"),
    ("spec.replicas", -1, "spec.replicas: Invalid value"),
    ("spec.resources", {"memory": "lots"}, "memory must be a positive Kubernetes quantity"),
    ("spec.resources", {"cpu": "-1"}, "cpu must be a positive Kubernetes quantity"),
    ("spec.resources", {"gpu": -1}, "spec.resources.gpu: Invalid value"),
    ("spec.service", {"type": "Ingress"}, 'spec.service.type: Unsupported value: "Ingress"'),
    ("spec.service", {"port": 70000}, "spec.service.port: Invalid value"),
    ("spec.imagePullPolicy", "Sometimes", 'Unsupported value: "Sometimes"'),
    ("spec.rollout", {"readyTimeoutSeconds": 0}, "spec.rollout.readyTimeoutSeconds: Invalid"),
    ("spec.prometheus", {"url": "prometheus:9090"}, "spec.prometheus.url: Invalid value"),
    ("spec.tuning", {"maxStep": 0}, "spec.tuning.maxStep: Invalid value"),
    ("spec.tuning", {"deadBand": 2}, "spec.tuning.deadBand: Invalid value"),
    (
        "spec.autoscaling",
        {"minReplicas": 5, "maxReplicas": 2},
        "autoscaling must satisfy minReplicas <= maxReplicas",
    ),
    ("spec.autoscaling", {"mode": "hpa"}, 'spec.autoscaling.mode: Unsupported value: "hpa"'),
    ("metadata.name", "1chat", "metadata.name must be a DNS-1035 label"),
    ("metadata.name", "c" * 53, "metadata.name must be at most 52 characters"),
]

# The pod settings, model cache, calibration and Prometheus credentials.
CASES += [
    ("spec.resources", {"gpu": 2}, "gpu must be 0 or 1"),
    ("spec.resources", {"shmSize": "lots"}, "shmSize must be a positive Kubernetes quantity"),
    ("spec.resources", {"limits": {"memory": "0"}}, "limits.memory must be a positive"),
    (
        "spec.pod",
        {"labels": {"app.kubernetes.io/instance": "other"}},
        "pod.labels must not set app.kubernetes.io/name",
    ),
    ("spec.pod", {"tolerations": [{"operator": "Maybe"}]}, 'Unsupported value: "Maybe"'),
    ("spec.pod", {"priorityClassName": "High Priority"}, "priorityClassName: Invalid value"),
    (
        "spec.engine",
        {"env": [{"name": "MODEL_PATH", "value": "/elsewhere"}]},
        "engine.env must not set a variable the operator sets",
    ),
    ("spec.engine", {"lookupTokens": 65}, "spec.engine.lookupTokens: Invalid value"),
    ("spec.engine", {"lookupTokens": -1}, "spec.engine.lookupTokens: Invalid value"),
    (
        "spec.engine",
        {"env": [{"name": "SLIMSPEC_LOOKUP_TOKENS", "value": "4"}]},
        "engine.env must not set a variable the operator sets",
    ),
    ("spec.engine", {"draftContext": 40000}, "spec.engine.draftContext: Invalid value"),
    ("spec.engine", {"draftContext": -1}, "spec.engine.draftContext: Invalid value"),
    (
        "spec.engine",
        {"env": [{"name": "SLIMSPEC_DRAFT_CONTEXT", "value": "0"}]},
        "engine.env must not set a variable the operator sets",
    ),
    (
        "spec.disruptionBudget",
        {"maxUnavailable": 1, "minAvailable": 1},
        "set maxUnavailable or minAvailable, not both",
    ),
    (
        "spec.disruptionBudget",
        {"maxUnavailable": "half"},
        "maxUnavailable must be a non-negative number or a percentage",
    ),
    ("spec.modelCache", {"accessMode": "ReadOnlyMany"}, 'Unsupported value: "ReadOnlyMany"'),
    ("spec.calibration", {"corpus": "$(HOME)"}, "spec.calibration.corpus: Invalid value"),
    (
        "spec.model.target",
        _hf(tokenSecret={"name": "Not_A_Name"}),  # type: ignore[arg-type]
        "tokenSecret.name: Invalid value",
    ),
    (
        "spec.prometheus",
        {"auth": {"type": "digest", "secretName": "prom"}},
        'Unsupported value: "digest"',
    ),
    ("spec.prometheus", {"tls": {"caKey": "ca.crt"}}, "spec.prometheus.tls.caSecretName: Required"),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), CASES, ids=[f"{p}={v!r}"[:60] for p, v, _ in CASES]
)
def test_invalid_spec_rejected_by_api_server(crd_server: CrdServer, path, value, message):
    body = _set(sample(), path, value)
    out = crd_server.dry_run_create(body)
    assert out.returncode != 0, f"accepted on {crd_server.version}: {str(body)[:2000]}"
    assert message in out.stderr, out.stderr[:3000]


_SHA = "0123456789abcdef" * 4
# Legal values next to each rule: a rule that is too strict breaks real users.
ACCEPTED = [
    ("spec.model.target.pvc.path", "models/qwen..v2"),
    ("spec.model.target.pvc.path", "..hidden/v2.."),
    ("spec.model.target.pvc.path", "/models/qwen2.5/..."),
    ("spec.model.draft.pvc.path", "a/./b/"),
    ("spec.model.target.pvc.claimName", "models.v2-cache"),
    ("spec.model.target.pvc.claimName", "m" * 253),
    ("spec.model.target", _hf(revision="refs/pr/1")),
    ("spec.model.target", _hf(revision="v2.0.1+build_7")),
    ("spec.model.target", _hf(revision=_SHA[:40])),
    ("spec.image", "nginx"),
    ("spec.image", "localhost:5000/engine"),
    ("spec.image", "[::1]:5000/team/engine:v1"),
    ("spec.image", "registry.example.com:5000/team/slim_spec__engine:0.1.0-rc.1"),
    ("spec.image", f"ghcr.io/slimspec/engine@sha256:{_SHA}"),
    ("spec.image", f"ghcr.io/slimspec/engine:0.1.0@sha256:{_SHA}"),
    ("spec.tuning", {"queries": {"p99Latency": "x" * 1024}}),
    ("spec.prometheus", {"url": "https://" + "p" * 1016}),
    ("spec.resources", {"memory": "1" * 64, "cpu": "500m"}),
]

ACCEPTED += [
    ("spec.resources", {"gpu": 0, "limits": {"cpu": "500m"}, "shmSize": "64Mi"}),
    ("spec.disruptionBudget", {"maxUnavailable": "25%"}),
    ("spec.disruptionBudget", {"minAvailable": 0}),
    ("spec.engine", {"env": [{"name": "SLIMSPEC_DTYPE", "value": "float16"}]}),
    ("spec.pod", {"labels": {"app.kubernetes.io/part-of": "llm"}}),
]


@pytest.mark.parametrize(("path", "value"), ACCEPTED, ids=[f"{p}={v!r}"[:60] for p, v in ACCEPTED])
def test_legal_edge_cases_accepted(crd_server: CrdServer, path: str, value: Any) -> None:
    body = _set(sample(), path, value)
    out = crd_server.dry_run_create(body)
    assert out.returncode == 0, f"refused on {crd_server.version}: {out.stderr[:2000]}"
    stored = yaml.safe_load(out.stdout)
    node: Any = stored
    for key in path.split("."):
        node = node[key]
    want = value if not isinstance(value, dict) else {**node, **value}
    assert node == want


def test_api_server_reports_its_version(crd_server: CrdServer) -> None:
    """The cases ran on the versions they claim (the floor is Chart.yaml's kubeVersion:
    tests/chart/test_metadata.py)."""
    out = crd_server.cluster.kubectl("version", "-o", "json")
    server = json.loads(out.stdout)["serverVersion"]["gitVersion"]
    assert server == crd_server.version


def test_valid_minimal_spec_accepted_with_defaults(crd_server: CrdServer) -> None:
    out = crd_server.dry_run_create(sample())
    assert out.returncode == 0, out.stderr
    spec = yaml.safe_load(out.stdout)["spec"]
    assert spec["compression"] == {"ratio": 0.3, "minRatio": 0.1, "maxRatio": 0.5}
    assert spec["batching"]["maxBatchSize"] == 8
    assert spec["qualityControl"] == {"threshold": 0.95, "fallbackStrategy": "auto"}
    assert spec["autoscaling"]["mode"] == "operator" and spec["tuning"]["enabled"] is False
    assert spec["rollout"]["readyTimeoutSeconds"] == 600


def test_built_manifests_pass_api_server_validation(
    kube_cluster: KubeCluster, operator_kubeconfig: object, namespace: str
):
    """Every builder's output, for a huggingface target (init container + cache) and
    a CPU-only pod, is accepted by the real API server (server-side dry run)."""
    from slimspec_operator.resource.spec import SlimSpecService
    from slimspec_operator.rollout import manifests as m

    body = sample(
        resources={"gpu": 0, "memory": "2Gi", "cpu": "500m"},
        service={"port": 80, "type": "NodePort"},
    )
    body["spec"]["model"]["target"] = {
        "source": "huggingface",
        "huggingface": {"id": "Qwen/Qwen2.5-1.5B-Instruct", "revision": "main"},
    }
    body["metadata"].update(namespace=namespace, uid="0b3e2c1a-0000-4000-8000-000000000001")
    svc = SlimSpecService.from_body(body)
    objs = [
        m.deployment(svc, 2),
        m.service(svc, m.desired_template_hash(svc)),
        m.runtime_configmap(svc),
        m.service_account(svc),
        m.role(svc),
        m.role_binding(svc),
        m.admin_secret(svc, "t0ken"),
    ]
    for obj in objs:
        out = kube_cluster.kubectl(
            "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False
        )
        assert out.returncode == 0, f"{obj['kind']}: {out.stderr}"
