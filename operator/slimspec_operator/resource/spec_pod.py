"""The spec's blocks about the engine pods themselves (pure, pydantic): compute,
placement and metadata, the engine container's extras, the disruption budget, the
model cache and calibration.

Same rules as spec.py: one model per CRD block with the CRD's defaults and bounds
(tests/operator/test_spec.py compares them field by field). The Kubernetes types
the CRD leaves open (affinity terms, topology spread constraints, env valueFrom)
are plain dicts here: the API server validates them when the operator applies the
Deployment, and a refusal becomes Degraded with reason InvalidSpec.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"

# Pod labels the operator selects its pods by, and engine variables it sets: the
# CRD refuses them in pod.labels / engine.env (rollout/manifests.py sets exactly these).
RESERVED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "slimspec.io/model-version",
    "slimspec.io/template-hash",
)
RESERVED_ENV = (
    "PORT",
    "MODEL_PATH",
    "DRAFT_MODEL_PATH",
    "SLIMSPEC_TARGET_QUANTIZATION",
    "SLIMSPEC_PREFIX_CACHE_MB",
    "SLIMSPEC_LOOKUP_TOKENS",
    "SLIMSPEC_DRAFT_CONTEXT",
    "MODEL_VERSION",
    "COMPRESSION_RATIO",
    "QUALITY_THRESHOLD",
    "FALLBACK_STRATEGY",
    "SLIMSPEC_DEVICE",
    "SLIMSPEC_MAX_BATCH_SIZE",
    "SLIMSPEC_ADMIN_TOKEN_FILE",
    "SLIMSPEC_RUNTIME_CONFIGMAP",
    "SLIMSPEC_CACHE",
    "SLIMSPEC_CALIBRATION",
    "POD_NAMESPACE",
)


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


# A Kubernetes quantity (int-or-string in the CRD; its CEL rule checks the syntax).
Quantity = Annotated[
    Annotated[str, StringConstraints(max_length=64)] | int,
    Field(json_schema_extra={"maxLength": 64}),
]
IntOrPercent = Annotated[
    Annotated[str, StringConstraints(max_length=8, pattern=r"^[0-9]+%$")]
    | Annotated[int, Field(ge=0)],
    Field(json_schema_extra={"maxLength": 8}),
]
DnsName = Annotated[str, StringConstraints(max_length=253, pattern=DNS_SUBDOMAIN)]
RequiredDnsName = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)
]


class LimitsSpec(_Model):
    cpu: Quantity | None = None
    memory: Quantity | None = None


class ResourcesSpec(_Model):
    gpu: int = Field(1, ge=0, le=16)
    memory: Quantity = "16Gi"
    cpu: Quantity = "2"
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    shm_size: Quantity = "1Gi"
    tmp_size: Quantity = "1Gi"
    cache_size: Quantity = "4Gi"

    @model_validator(mode="after")
    def _one_device(self) -> ResourcesSpec:
        if self.gpu > 1:
            raise ValueError(
                "gpu must be 0 or 1: the engine runs the target and the draft on one device "
                "and cannot split a model across GPUs, so more would be reserved and idle"
            )
        return self


class Toleration(_Model):
    key: str | None = Field(None, max_length=317)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=63)
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class AffinitySpec(_Model):
    node_affinity: dict[str, Any] | None = None
    pod_affinity: dict[str, Any] | None = None
    pod_anti_affinity: dict[str, Any] | None = None


class SecretName(_Model):
    name: RequiredDnsName


class PodSpec(_Model):
    labels: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, max_length=64
    )
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, max_length=64
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: AffinitySpec | None = None
    topology_spread_constraints: list[dict[str, Any]] = Field(default_factory=list, max_length=16)
    priority_class_name: DnsName | None = None
    runtime_class_name: DnsName | None = None
    image_pull_secrets: list[SecretName] = Field(default_factory=list, max_length=16)

    @model_validator(mode="after")
    def _own_labels(self) -> PodSpec:
        taken = sorted(set(self.labels) & set(RESERVED_LABELS))
        if taken:
            raise ValueError(f"pod.labels must not set {', '.join(taken)}")
        return self


class EnvVar(_Model):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _not_ours(self) -> EnvVar:
        if self.name in RESERVED_ENV:
            raise ValueError(f"engine.env must not set {self.name}: the operator sets it")
        return self


class ObjectRef(_Model):
    name: str = Field(max_length=253)
    optional: bool | None = None


class EnvFromSource(_Model):
    prefix: str | None = Field(None, max_length=253)
    config_map_ref: ObjectRef | None = None
    secret_ref: ObjectRef | None = None


class EngineSpec(_Model):
    # The engine's SLIMSPEC_PREFIX_CACHE_MB (engine/slimspec/decoding/prefix_cache.py).
    prefix_cache_mb: int = Field(256, ge=0, le=65536, alias="prefixCacheMB")
    # The engine's SLIMSPEC_LOOKUP_TOKENS (engine/slimspec/decoding/lookup.py).
    lookup_tokens: int = Field(12, ge=0, le=64)
    # The engine's SLIMSPEC_DRAFT_CONTEXT (engine/slimspec/decoding/draft_context.py).
    draft_context: int = Field(64, ge=0, le=32768)
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=16)
    args: list[Annotated[str, StringConstraints(max_length=1024)]] = Field(
        default_factory=list, max_length=64
    )


class DisruptionBudgetSpec(_Model):
    enabled: bool = True
    max_unavailable: IntOrPercent | None = None
    min_available: IntOrPercent | None = None

    @model_validator(mode="after")
    def _one_of(self) -> DisruptionBudgetSpec:
        if self.max_unavailable is not None and self.min_available is not None:
            raise ValueError("disruptionBudget: set maxUnavailable or minAvailable, not both")
        return self


class ModelCacheSpec(_Model):
    claim_name: DnsName | None = None
    size: Quantity = "50Gi"
    storage_class_name: DnsName | None = None
    access_mode: Literal["ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"] = "ReadWriteMany"
    job_timeout_seconds: int = Field(7200, ge=60, le=172800)


class CalibrationSpec(_Model):
    enabled: bool = False
    corpus: str = Field("stdlib", min_length=1, max_length=1024, pattern=r"^[-._/a-zA-Z0-9]+$")
    args: list[Annotated[str, StringConstraints(max_length=256)]] = Field(
        default_factory=list, max_length=32
    )
