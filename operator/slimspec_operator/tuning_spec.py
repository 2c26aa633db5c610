"""Typed view of the tuning-related parts of a SlimSpecService spec.

Only what the tuner and the autoscaler read: `compression`, `qualityControl`,
`prometheus`, `tuning`, `autoscaling` and `replicas`. The CRD (owned by the
operator's spec module) is the schema of record; these defaults mirror it so a
resource that omits a block still gets a well-defined controller.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# Label selector every default query uses. A ServiceMonitor adds `namespace` and
# `service` target labels by default; a hand-written scrape config must add them.
SELECTOR = 'namespace="{namespace}",service="{service}"'
# rate() window, substituted per resource: see rate_window().
RATE_WINDOW = "{window}"

DEFAULT_QUERIES: dict[str, str] = {
    "p99Latency": (
        "histogram_quantile(0.99, sum by (le) "
        f"(rate(slimspec_request_latency_seconds_bucket{{{SELECTOR}}}[{RATE_WINDOW}])))"
    ),
    "requestRate": f"sum(rate(slimspec_requests_total{{{SELECTOR}}}[{RATE_WINDOW}]))",
    "meanAcceptedLength": f"avg(slimspec_mean_accepted_length{{{SELECTOR}}})",
    # A labelled counter has no series until its first fallback: that is 0/s.
    "fallbackRate": (
        f"sum(rate(slimspec_fallbacks_total{{{SELECTOR}}}[{RATE_WINDOW}])) or vector(0)"
    ),
    # min over pods: the worst replica decides whether compression may grow.
    # `> 0` drops pods whose shadow check has not run yet (the gauge starts at 0).
    "keptAcceptance": f"min(slimspec_acceptance_kept_ratio{{{SELECTOR}}} > 0)",
    # Used by the autoscaler only when targetQueueDepth is set.
    "queueDepth": f"avg(slimspec_queue_depth{{{SELECTOR}}})",
}


def rate_window(interval_seconds: float) -> str:
    """rate() window for a decision interval: two intervals, at least 10 s.

    Scrape at least twice per decision interval, so the window holds 4+ scrapes.
    """
    return f"{max(10, round(2 * interval_seconds))}s"


def render_query(template: str, namespace: str, service: str, window: str = "2m") -> str:
    """Fill {namespace}/{service}/{window} (PromQL's own braces are left alone)."""
    for key, value in (("namespace", namespace), ("service", service), ("window", window)):
        template = template.replace("{" + key + "}", value)
    return template


class _Model(BaseModel):
    # Accept camelCase (the resource) and snake_case (Python callers); ignore
    # fields owned by other parts of the spec.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class CompressionSpec(_Model):
    ratio: float = Field(0.3, ge=0.0, le=0.95)
    min_ratio: float = Field(0.1, ge=0.0, le=0.95)
    max_ratio: float = Field(0.5, ge=0.0, le=0.95)

    @model_validator(mode="after")
    def _ordered(self) -> CompressionSpec:
        if self.min_ratio > self.max_ratio:
            raise ValueError(f"minRatio {self.min_ratio} > maxRatio {self.max_ratio}")
        return self


class QualityControlSpec(_Model):
    threshold: float = Field(0.95, ge=0.0, le=1.0)
    fallback_strategy: Literal["auto", "none"] = "auto"


class PrometheusSpec(_Model):
    url: str = "http://prometheus.monitoring:9090"
    timeout_seconds: float = Field(5.0, gt=0.0, le=60.0)


class QueriesSpec(_Model):
    p99_latency: str = DEFAULT_QUERIES["p99Latency"]
    request_rate: str = DEFAULT_QUERIES["requestRate"]
    mean_accepted_length: str = DEFAULT_QUERIES["meanAcceptedLength"]
    fallback_rate: str = DEFAULT_QUERIES["fallbackRate"]
    kept_acceptance: str = DEFAULT_QUERIES["keptAcceptance"]
    queue_depth: str = DEFAULT_QUERIES["queueDepth"]


class TuningSpec(_Model):
    enabled: bool = False
    interval_seconds: float = Field(60.0, ge=1.0)
    latency_target_seconds: float = Field(0.4, gt=0.0)
    # Fraction of the target: lower the ratio only when p99 < target * (1 - deadBand).
    dead_band: float = Field(0.1, ge=0.0, lt=1.0)
    cooldown_seconds: float = Field(120.0, ge=0.0)
    max_step: float = Field(0.05, gt=0.0, le=0.5)
    min_request_rate: float = Field(0.1, ge=0.0)
    queries: QueriesSpec = Field(default_factory=QueriesSpec)


class AutoscalingSpec(_Model):
    enabled: bool = False
    mode: Literal["operator", "keda"] = "operator"
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_requests_per_replica: float = Field(2.0, gt=0.0)
    target_queue_depth: float | None = Field(None, gt=0.0)
    stabilization_window_seconds: float = Field(300.0, ge=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        return self


class TuningView(_Model):
    """The slice of `spec` the tuning controllers read."""

    replicas: int = Field(1, ge=0)
    compression: CompressionSpec = Field(default_factory=CompressionSpec)
    quality_control: QualityControlSpec = Field(default_factory=QualityControlSpec)
    prometheus: PrometheusSpec = Field(default_factory=PrometheusSpec)
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> TuningView:
        """Parse a resource's `spec` (None/null blocks count as absent)."""
        clean = {k: v for k, v in (spec or {}).items() if v is not None}
        return cls.model_validate(clean)
