"""Typed, defaulted view of a SlimSpecService resource (pure).

One pydantic model per block of the CRD (crds/slimspecservice.yaml), with the
CRD's defaults, bounds and rules: the CRD is the contract and rejects bad specs at
the API server, so a resource that came through it always parses, and
tests/operator/test_crd.py checks that the two agree field by field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
    model_validator,
)
from pydantic.alias_generators import to_camel

from slimspec_operator.contract import DEFAULT_QUALITY_THRESHOLD, MAX_RATIO, FallbackStrategy
from slimspec_operator.resource.queries import QUERIES, QueryDef
from slimspec_operator.resource.spec_pod import (
    DNS_SUBDOMAIN,
    SECRET_KEY,
    CalibrationSpec,
    DisruptionBudgetSpec,
    EngineSpec,
    ModelCacheSpec,
    PodSpec,
    RequiredDnsName,
    ResourcesSpec,
)

DEFAULT_IMAGE = "ghcr.io/slimspec/engine:0.1.0"

# The CRD's patterns (crds/slimspecservice.yaml says why each is what it is).
IMAGE_PATTERN = (
    r"^((([a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])(\.([a-zA-Z0-9]|[a-zA-Z0-9]"
    r"[-a-zA-Z0-9]*[a-zA-Z0-9]))*|\[[0-9a-fA-F:]+\])(:[0-9]+)?/)?[a-z0-9]+(([._]|__|-+)"
    r"[a-z0-9]+)*(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?"
    r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
GIT_REF = r"^[A-Za-z0-9_]([-A-Za-z0-9_+]|[./][-A-Za-z0-9_+])*$"
DOTDOT_SEGMENT = re.compile(r"(^|/)[.][.](/|$)")

Ratio = Annotated[float, Field(ge=0.0, le=MAX_RATIO)]
Query = Annotated[str, StringConstraints(max_length=1024)]


class _Model(BaseModel):
    # Accept camelCase (the resource) and snake_case (Python callers); ignore
    # fields this view does not model (Kopf's annotations, future fields).
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class PvcSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
    path: str = Field("", max_length=1024)
    read_only: bool = True

    @model_validator(mode="after")
    def _inside_volume(self) -> PvcSource:
        if DOTDOT_SEGMENT.search(self.path):
            raise ValueError("path must not have a '..' segment (it would leave the volume)")
        return self


class SecretKeyRef(_Model):
    name: RequiredDnsName
    key: str = Field("token", min_length=1, max_length=253, pattern=SECRET_KEY)


class HuggingFaceSource(_Model):
    id: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*(/[A-Za-z0-9][-A-Za-z0-9_.]*)?$",
    )
    revision: str = Field("main", min_length=1, max_length=256, pattern=GIT_REF)
    token_secret: SecretKeyRef | None = None


class ModelSource(_Model):
    source: Literal["pvc", "huggingface"]
    pvc: PvcSource | None = None
    huggingface: HuggingFaceSource | None = None

    @model_validator(mode="after")
    def _has_its_block(self) -> ModelSource:
        if getattr(self, self.source) is None:
            raise ValueError(f"source: {self.source} needs the {self.source} field")
        if self.pvc is not None and self.huggingface is not None:
            raise ValueError("pvc and huggingface are mutually exclusive")
        return self


class ModelSpec(_Model):
    version: str = Field(
        min_length=1, max_length=63, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
    )
    target: ModelSource
    draft: ModelSource
    # The engine's SLIMSPEC_TARGET_QUANTIZATION (engine/slimspec/cpu/target_form.py).
    target_quantization: Literal["auto", "gguf", "int8", "none"] = "auto"


class CompressionSpec(_Model):
    ratio: Ratio = 0.3
    min_ratio: Ratio = 0.1
    max_ratio: Ratio = 0.5

    @model_validator(mode="after")
    def _ordered(self) -> CompressionSpec:
        if not self.min_ratio <= self.ratio <= self.max_ratio:
            raise ValueError(
                "compression must satisfy minRatio <= ratio <= maxRatio "
                f"({self.min_ratio} <= {self.ratio} <= {self.max_ratio})"
            )
        return self


class QualityControlSpec(_Model):
    threshold: float = Field(DEFAULT_QUALITY_THRESHOLD, ge=0.0, le=1.0)
    fallback_strategy: FallbackStrategy = "auto"


class BatchingSpec(_Model):
    max_batch_size: int = Field(8, ge=1, le=256)
    max_wait_ms: int = Field(5, ge=0, le=10000)
    max_queue: int = Field(64, ge=1, le=100000)


class ServiceSpec(_Model):
    port: int = Field(8080, ge=1, le=65535)
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"


class RolloutSpec(_Model):
    ready_timeout_seconds: int = Field(600, ge=1, le=86400)


# Keys of spec.prometheus.auth's Secret: `token` (bearer), `username`/`password` (basic).
TOKEN_KEY = "token"
USERNAME_KEY = "username"
PASSWORD_KEY = "password"


class PrometheusAuth(_Model):
    type: Literal["bearer", "basic"]
    secret_name: RequiredDnsName


class PrometheusTls(_Model):
    ca_secret_name: RequiredDnsName
    ca_key: str = Field("ca.crt", min_length=1, max_length=253, pattern=SECRET_KEY)


class PrometheusSpec(_Model):
    url: str = Field("http://prometheus.monitoring:9090", max_length=1024, pattern=r"^https?://")
    timeout_seconds: float = Field(5.0, gt=0.0, le=60.0)
    auth: PrometheusAuth | None = None
    tls: PrometheusTls | None = None


class QueryTemplates(_Model):
    """spec.tuning.queries: one PromQL template per entry of the query registry
    (resource/queries.py); unset = the built-in one. The fields are made from the
    registry (`QueriesSpec`), so a query is named in one place."""

    def template(self, query: QueryDef) -> str:
        """The template in force (an empty override means the built-in one)."""
        return str(getattr(self, query.attribute)) or query.template


if TYPE_CHECKING:
    QueriesSpec = QueryTemplates
else:
    QueriesSpec = create_model(
        "QueriesSpec",
        __base__=QueryTemplates,
        **{q.attribute: (Query, q.template) for q in QUERIES},
    )


class TuningSpec(_Model):
    enabled: bool = False
    interval_seconds: int = Field(60, ge=1, le=3600)
    latency_target_seconds: float = Field(0.4, gt=0.0)
    # Fraction of the target: lower the ratio only when p99 < target * (1 - deadBand).
    dead_band: float = Field(0.1, ge=0.0, le=1.0)
    cooldown_seconds: int = Field(120, ge=0, le=86400)
    max_step: float = Field(0.05, gt=0.0, le=MAX_RATIO)
    min_request_rate: float = Field(0.1, ge=0.0)
    queries: QueriesSpec = Field(default_factory=QueriesSpec)


class AutoscalingSpec(_Model):
    enabled: bool = False
    mode: Literal["operator", "keda"] = "operator"
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(4, ge=1, le=1000)
    target_requests_per_replica: float = Field(2.0, gt=0.0)
    target_queue_depth: float | None = Field(None, gt=0.0)
    stabilization_window_seconds: int = Field(300, ge=0, le=3600)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                "autoscaling must satisfy minReplicas <= maxReplicas "
                f"({self.min_replicas} > {self.max_replicas})"
            )
        return self


class TuningView(_Model):
    """The blocks of `spec` the tuner and the autoscaler read.

    The tuner parses only these, so a spec it does not otherwise understand
    still gets a well-defined tuning controller.
    """

    replicas: int = Field(1, ge=0, le=1000)
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    quality_control: QualityControlSpec = Field(default_factory=QualityControlSpec)
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec)
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> TuningView:
        """Parse a resource's `spec` (None/null blocks count as absent)."""
        clean = {k: v for k, v in (spec or {}).items() if v is not None}
        return cls.model_validate(clean)

    @property
    def scaling(self) -> bool:
        """The operator's own autoscaler sets the replicas (not KEDA)."""
        return self.autoscaling.enabled and self.autoscaling.mode == "operator"

    @property
    def keda(self) -> bool:
        return self.autoscaling.enabled and self.autoscaling.mode == "keda"


class SlimSpecServiceSpec(TuningView):
    """The whole spec: the tuning blocks plus the model and the engine pods."""

    image: str = Field(DEFAULT_IMAGE, min_length=1, max_length=512, pattern=IMAGE_PATTERN)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    model: ModelSpec
    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    pod: PodSpec = Field(default_factory=PodSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    disruption_budget: DisruptionBudgetSpec = Field(default_factory=DisruptionBudgetSpec)
    model_cache: ModelCacheSpec = Field(default_factory=ModelCacheSpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)


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
