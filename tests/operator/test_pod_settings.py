"""Placement, pod metadata, resources, extra env/args, scratch volumes and the
disruption budget: the spec's pod settings land in the engine pod (pure)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.resource.spec_pod import RESERVED_ENV, RESERVED_LABELS
from slimspec_operator.rollout import manifests as m
from slimspec_operator.rollout.pod_settings import with_node_spread

from .helpers import body
from .test_crd import CRD

SPEC = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

POD = {
    "labels": {"team": "search", "app.kubernetes.io/part-of": "llm"},
    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat"}},
                    },
                }
            ]
        }
    },
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
        },
        {
            "maxSkew": 2,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"team": "search"}},
        },
    ],
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}],
}
ENGINE = {
    "env": [
        {"name": "SLIMSPEC_DTYPE", "value": "float16"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "engine-extra"}, "prefix": "X_"}],
    "args": ["--num-draft-tokens", "4"],
}


def svc(**spec: Any) -> SlimSpecService:
    return SlimSpecService.from_body(body(**spec))


def pod_of(s: SlimSpecService) -> dict[str, Any]:
    return m.deployment(s, 1)["spec"]["template"]


def test_placement_and_metadata_reach_the_pod() -> None:
    template = pod_of(svc(pod=POD))
    pod = template["spec"]
    assert pod["nodeSelector"] == POD["nodeSelector"]
    assert pod["tolerations"] == POD["tolerations"]
    assert pod["affinity"] == POD["affinity"]
    assert pod["priorityClassName"] == "inference-high"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    zone, host = pod["topologySpreadConstraints"]
    # no selector given: this resource's engine pods are what is spread
    assert zone["labelSelector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "slimspec-engine",
            "app.kubernetes.io/instance": "chat",
        }
    }
    assert host["labelSelector"] == {"matchLabels": {"team": "search"}}  # given: kept
    labels, annotations = template["metadata"]["labels"], template["metadata"]["annotations"]
    assert labels["team"] == "search" and labels["app.kubernetes.io/part-of"] == "llm"
    assert labels["app.kubernetes.io/name"] == "slimspec-engine"  # the operator's kept
    assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
    assert annotations["prometheus.io/scrape"] == "true"


def test_no_settings_add_nothing() -> None:
    pod = pod_of(svc())["spec"]
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "topologySpreadConstraints",
        "priorityClassName",
        "runtimeClassName",
        "imagePullSecrets",
    ):
        assert key not in pod
    assert "envFrom" not in pod["containers"][0]


def test_engines_spread_over_nodes_by_default_softly() -> None:
    spread = with_node_spread(svc())
    (constraint,) = pod_of(spread)["spec"]["topologySpreadConstraints"]
    assert constraint == {
        "labelSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "slimspec-engine",
                "app.kubernetes.io/instance": "chat",
            }
        },
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        # a drain of one of two nodes must still place the evicted replica
        "whenUnsatisfiable": "ScheduleAnyway",
    }
    assert m.desired_template_hash(spread) != m.desired_template_hash(svc())
    assert with_node_spread(svc()) == spread  # the same every round: no rollout loop


@pytest.mark.parametrize(
    "pod",
    [
        {"topologySpreadConstraints": POD["topologySpreadConstraints"][:1]},
        {"affinity": POD["affinity"]},
        {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}},
    ],
)
def test_the_users_own_engine_placement_replaces_the_default_spread(pod: dict[str, Any]) -> None:
    own = svc(pod=pod)
    assert with_node_spread(own) is own


@pytest.mark.parametrize("mode", ["ReadWriteOnce", "ReadWriteOncePod"])
def test_a_one_node_model_cache_keeps_the_engines_together(mode: str) -> None:
    one_node = svc(modelCache={"accessMode": mode})
    assert with_node_spread(one_node) is one_node


def test_node_affinity_alone_keeps_the_default_spread() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["cpu"]}]}]}}}  # fmt: skip
    pod = pod_of(with_node_spread(svc(pod={"affinity": affinity})))["spec"]
    assert pod["affinity"] == affinity
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"


def test_settings_change_the_template_hash() -> None:
    base = m.desired_template_hash(svc())
    assert m.desired_template_hash(svc(pod={"nodeSelector": {"a": "b"}})) != base
    assert m.desired_template_hash(svc(engine={"args": ["--dtype", "float16"]})) != base


def test_engine_extras_come_after_the_operators() -> None:
    c = pod_of(svc(engine=ENGINE))["spec"]["containers"][0]
    names = [e["name"] for e in c["env"]]
    assert names[-2:] == ["SLIMSPEC_DTYPE", "HF_TOKEN"]
    assert c["env"][-1]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert c["envFrom"] == ENGINE["envFrom"]
    assert c["args"][0] == "serve" and c["args"][-2:] == ["--num-draft-tokens", "4"]


def test_limits_and_scratch_sizes() -> None:
    resources = {
        "gpu": 1,
        "memory": "24Gi",
        "cpu": "4",
        "limits": {"cpu": "8", "memory": "30Gi"},
        "shmSize": "8Gi",
        "tmpSize": "2Gi",
        "cacheSize": "10Gi",
    }
    pod = pod_of(svc(resources=resources))["spec"]
    c = pod["containers"][0]
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "24Gi"},
        "limits": {"cpu": "8", "memory": "30Gi", "nvidia.com/gpu": "1"},
    }
    empty = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
    assert empty["dshm"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert empty["tmp"] == {"sizeLimit": "2Gi"} and empty["cache"] == {"sizeLimit": "10Gi"}


def test_more_than_one_gpu_is_refused() -> None:
    with pytest.raises(ValidationError, match="gpu must be 0 or 1"):
        svc(resources={"gpu": 2})


def test_reserved_labels_and_env_names_are_the_ones_the_operator_sets() -> None:
    """The CRD's CEL lists and spec_pod's lists name exactly what the builders set."""
    template = pod_of(svc(calibration={"enabled": True}))
    set_env = {e["name"] for e in template["spec"]["containers"][0]["env"]}
    assert set(RESERVED_ENV) == set_env
    deployment = m.deployment(svc(), 1)
    assert set(RESERVED_LABELS) == set(deployment["spec"]["template"]["metadata"]["labels"])
    crd_text = yaml.safe_dump(SPEC)
    for name in (*RESERVED_ENV, *RESERVED_LABELS):
        assert f"'{name}'" in crd_text, name
    with pytest.raises(ValidationError, match="must not set MODEL_PATH"):
        svc(engine={"env": [{"name": "MODEL_PATH", "value": "/x"}]})
    with pytest.raises(ValidationError, match=r"app\.kubernetes\.io/instance"):
        svc(pod={"labels": {"app.kubernetes.io/instance": "other"}})


def test_disruption_budget_covers_every_engine_pod() -> None:
    pdb = m.disruption_budget(svc())
    assert pdb is not None
    assert pdb["metadata"]["name"] == "chat"
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert pdb["spec"] == {
        "selector": {
            "matchLabels": {
                "app.kubernetes.io/name": "slimspec-engine",
                "app.kubernetes.io/instance": "chat",
            }
        },
        "maxUnavailable": 1,
    }
    assert (
        m.disruption_budget(svc(disruptionBudget={"minAvailable": "50%"}))["spec"]["minAvailable"]
        == "50%"
    )
    assert m.disruption_budget(svc(disruptionBudget={"enabled": False})) is None
    with pytest.raises(ValidationError, match="not both"):
        svc(disruptionBudget={"minAvailable": 1, "maxUnavailable": 1})


def test_status_url() -> None:
    assert m.status_url(svc(service={"port": 80})) == "http://chat.ml.svc:80"


def test_target_quantization_reaches_the_engine_and_bad_values_are_refused() -> None:
    def env_of(s: SlimSpecService) -> dict[str, Any]:
        return {e["name"]: e.get("value") for e in pod_of(s)["spec"]["containers"][0]["env"]}

    assert env_of(svc())["SLIMSPEC_TARGET_QUANTIZATION"] == "auto"
    model = {**body()["spec"]["model"], "targetQuantization": "int8"}
    chosen = svc(model=model)
    assert env_of(chosen)["SLIMSPEC_TARGET_QUANTIZATION"] == "int8"
    # another form is another pod template: a rollout, like a version change
    assert pod_of(chosen) != pod_of(svc())
    with pytest.raises(ValidationError, match="targetQuantization"):
        svc(model={**model, "targetQuantization": "int4"})
    assert SPEC["properties"]["model"]["properties"]["targetQuantization"]["enum"] == [
        "auto", "gguf", "int8", "none"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("field", "variable", "default", "bad"),
    [
        ("prefixCacheMB", "SLIMSPEC_PREFIX_CACHE_MB", (0, 65536, 256), (-1, 70000)),
        ("lookupTokens", "SLIMSPEC_LOOKUP_TOKENS", (0, 64, 12), (-1, 65, "many")),
        ("draftContext", "SLIMSPEC_DRAFT_CONTEXT", (0, 32768, 64), (-1, 40000, "all")),
    ],
)
def test_engine_settings_reach_the_engine_and_bad_values_are_refused(
    field: str, variable: str, default: tuple[int, int, int], bad: tuple[Any, ...]
) -> None:
    def env_of(s: SlimSpecService) -> dict[str, Any]:
        return {e["name"]: e.get("value") for e in pod_of(s)["spec"]["containers"][0]["env"]}

    assert env_of(svc())[variable] == str(default[2])  # (minimum, maximum, default)
    off = svc(engine={field: 0})
    assert env_of(off)[variable] == "0"
    assert pod_of(off) != pod_of(svc())  # another value is another pod template: a rollout
    for b in bad:
        with pytest.raises(ValidationError, match=field):
            svc(engine={field: b})
    with pytest.raises(ValidationError, match="must not set"):
        svc(engine={"env": [{"name": variable, "value": "1"}]})
    schema = SPEC["properties"]["engine"]["properties"][field]
    assert (schema["minimum"], schema["maximum"], schema["default"]) == default
