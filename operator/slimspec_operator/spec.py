"""Typed, defaulted view of a SlimSpecService resource (pure).

The CRD schema is what rejects bad specs at the API server; these models only
give the code typed access with the same defaults, so a resource that came
through the API server always parses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "slimspec.io"
VERSION = "v1alpha1"
KIND = "SlimSpecService"
PLURAL = "slimspecservices"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_IMAGE = "ghcr.io/slimspec/engine:0.1.0"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class PvcSource(_Model):
    claim_name: str
    path: str = ""
    read_only: bool = True


class HuggingFaceSource(_Model):
    id: str
    revision: str = "main"


class ModelSource(_Model):
    source: Literal["pvc", "huggingface"]
    pvc: PvcSource | None = None
    huggingface: HuggingFaceSource | None = None


class ModelSpec(_Model):
    version: str
    target: ModelSource
    draft: ModelSource


class CompressionSpec(_Model):
    ratio: float = 0.3
    min_ratio: float = 0.1
    max_ratio: float = 0.5


class QualityControlSpec(_Model):
    threshold: float = 0.95
    fallback_strategy: Literal["auto", "none"] = "auto"


class BatchingSpec(_Model):
    max_batch_size: int = 8
    max_wait_ms: int = 5
    max_queue: int = 64


class ResourcesSpec(_Model):
    gpu: int = 1
    memory: str | int = "16Gi"  # Kubernetes quantities; the CRD allows int-or-string
    cpu: str | int = "2"


class ServiceSpec(_Model):
    port: int = 8080
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class RolloutSpec(_Model):
    ready_timeout_seconds: int = 600


class PrometheusSpec(_Model):
    url: str = "http://prometheus.monitoring:9090"
    timeout_seconds: float = 5


class AutoscalingSpec(_Model):
    enabled: bool = False
    mode: Literal["operator", "keda"] = "operator"
    min_replicas: int = 1
    max_replicas: int = 4
    target_requests_per_replica: float = 2.0
    target_queue_depth: float | None = None
    stabilization_window_seconds: int = 300


class TuningSpec(_Model):
    # Read by the tuner; kept loose here so the tuner can own its details.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    enabled: bool = False


class SlimSpecServiceSpec(_Model):
    replicas: int = 1
    image: str = DEFAULT_IMAGE
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    model: ModelSpec
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    quality_control: QualityControlSpec = Field(default_factory=QualityControlSpec)
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec)
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)


class Meta(_Model):
    name: str
    namespace: str = "default"
    uid: str = ""
    generation: int = 0


class SlimSpecService(_Model):
    """The parts of the resource the reconciler reads."""

    metadata: Meta
    spec: SlimSpecServiceSpec
    status: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> SlimSpecService:
        return cls.model_validate(
            {
                "metadata": dict(body.get("metadata") or {}),
                "spec": dict(body.get("spec") or {}),
                "status": dict(body.get("status") or {}),
            }
        )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


def ratio_in_force(svc: SlimSpecService) -> float:
    """The compression ratio the engines should use now.

    Tuning off: the spec's ratio. Tuning on: the tuner's status.compression.ratio
    (the spec's until the tuner has written one), clamped to the spec's bounds
    so narrowing them takes effect at once.
    """
    c = svc.spec.compression
    if not svc.spec.tuning.enabled:
        return c.ratio
    current = (svc.status.get("compression") or {}).get("ratio")
    if current is None:
        return c.ratio
    return min(max(float(current), c.min_ratio), c.max_ratio)
