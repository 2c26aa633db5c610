"""The API server itself rejects bad SlimSpecService specs (CRD schema + CEL),
with messages that say what is wrong. Server-side dry run: nothing is stored."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from slimspec_testbed.cluster import KubeCluster

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
    ("spec.model.target.pvc.path", "../etc", "path must not contain '..'"),
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


@pytest.mark.parametrize(
    ("path", "value", "message"), CASES, ids=[f"{p}={v!r}"[:60] for p, v, _ in CASES]
)
def test_invalid_spec_rejected_by_api_server(
    kube_cluster: KubeCluster, operator_kubeconfig: object, namespace: str, path, value, message
):
    body = _set(sample(), path, value)
    out = kube_cluster.kubectl(
        "create",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        input=yaml.safe_dump(body),
        check=False,
    )
    assert out.returncode != 0, f"accepted: {body}"
    assert message in out.stderr, out.stderr


def test_valid_minimal_spec_accepted_with_defaults(
    kube_cluster: KubeCluster, operator_kubeconfig: object, namespace: str
):
    out = kube_cluster.kubectl(
        "create",
        "--dry-run=server",
        "-n",
        namespace,
        "-o",
        "yaml",
        "-f",
        "-",
        input=yaml.safe_dump(sample()),
    )
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
    from slimspec_operator import manifests as m
    from slimspec_operator.spec import SlimSpecService

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
