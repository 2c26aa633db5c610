"""The PromQL the tuner and the autoscaler read (pure): the built-in templates,
their rendering for one resource, and the query results as one tuner `Sample`."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from .prom import PromError
from .tuner import Sample

if TYPE_CHECKING:
    from .spec import TuningView

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

# Query name -> Sample field.
FIELDS = {
    "p99Latency": "p99_latency",
    "requestRate": "request_rate",
    "keptAcceptance": "kept_acceptance",
    "meanAcceptedLength": "mean_accepted_length",
    "fallbackRate": "fallback_rate",
    "queueDepth": "queue_depth",
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


def queries_for(view: TuningView, namespace: str, name: str, scaling: bool) -> dict[str, str]:
    """The rendered queries one tick runs (queue depth only for the autoscaler's rule)."""
    q = view.tuning.queries
    templates = {
        "p99Latency": q.p99_latency,
        "requestRate": q.request_rate,
        "keptAcceptance": q.kept_acceptance,
        "meanAcceptedLength": q.mean_accepted_length,
        "fallbackRate": q.fallback_rate,
    }
    if scaling and view.autoscaling.target_queue_depth is not None:
        templates["queueDepth"] = q.queue_depth or DEFAULT_QUERIES["queueDepth"]
    window = rate_window(view.tuning.interval_seconds)
    return {k: render_query(v, namespace, name, window) for k, v in templates.items()}


def sample_from(now: datetime, results: Mapping[str, float | PromError]) -> Sample:
    """A tuner Sample from query results; any transport error spoils the sample."""
    values: dict[str, float | None] = {}
    missing: dict[str, str] = {}
    error: tuple[str, str] | None = None
    for name, res in results.items():
        if isinstance(res, PromError):
            if res.transport and error is None:
                error = (res.reason, res.message)
            missing[name] = res.reason
            values[FIELDS[name]] = None
        else:
            values[FIELDS[name]] = res
    return Sample(time=now, error=error, missing=missing, **values)  # type: ignore[arg-type]
