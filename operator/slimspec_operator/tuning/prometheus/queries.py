"""The PromQL the tuner and the autoscaler read (pure): the built-in templates,
their rendering for one resource, and the query results as one tuner `Sample`.

Most queries answer one number. The engines' per-ratio predictions answer one
series per `ratio` label (aggregated over the service's pods), and why
compression can or cannot help one series per `reason` label (pods per reason);
`VECTOR_LABELS` names those, and `vector_values` reads their answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from slimspec_operator.resource.queries import DEFAULT_QUERIES
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.tuning.predictions import ACCEPTANCE_LOSS, HEAD_SHARE_TOO_SMALL, Predictions
from slimspec_operator.tuning.prometheus.errors import BAD_RESPONSE, NO_DATA, PromError
from slimspec_operator.tuning.types import Sample

# The engines' reasons (label of slimspec_compression_can_help_info) as
# condition reasons; `helps` and `not_measured` say nothing about a "cannot".
ENGINE_REASONS = {
    "head_share_small": HEAD_SHARE_TOO_SMALL,
    "acceptance_loss": ACCEPTANCE_LOSS,
}
ENGINE_NOT_A_REASON = frozenset({"helps", "not_measured", ""})

# Queries answering one series per value of a label: query name -> label.
VECTOR_LABELS = {
    "predictedSpeedup": "ratio",
    "ratioKeptAcceptance": "ratio",
    "draftHeadShare": "ratio",
    "compressionCanHelpReason": "reason",
}
PREDICTION_QUERIES = (
    "predictedSpeedup",
    "ratioKeptAcceptance",
    "draftHeadShare",
    "bestRatio",
    "compressionCanHelp",
    "compressionCanHelpReason",
    "headRankingAge",
    "headRankingCoverage",
)

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
    if view.tuning.enabled:
        templates |= {
            "predictedSpeedup": q.predicted_speedup,
            "ratioKeptAcceptance": q.ratio_kept_acceptance,
            "draftHeadShare": q.draft_head_share,
            "bestRatio": q.best_ratio,
            "compressionCanHelp": q.compression_can_help,
            "compressionCanHelpReason": q.compression_can_help_reason,
            "headRankingAge": q.head_ranking_age,
            "headRankingCoverage": q.head_ranking_coverage,
        }
    window = rate_window(view.tuning.interval_seconds)
    return {k: render_query(v, namespace, name, window) for k, v in templates.items()}


def vector_values(data: Mapping[str, Any], label: str, promql: str) -> dict[str, float]:
    """An instant-vector answer (`data` of /api/v1/query) as {label value: number}.

    A series without the label is keyed "". NaN/Inf series are left out; no
    series left is NoData.
    """
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PromError(BAD_RESPONSE, f"result type {data.get('resultType')!r} for {promql!r}")
    out: dict[str, float] = {}
    for series in data["result"]:
        try:
            key = str((series.get("metric") or {}).get(label, ""))
            value = float(series["value"][1])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PromError(BAD_RESPONSE, f"unreadable series {series!r}") from exc
        if math.isfinite(value):
            out[key] = value
    if not out:
        raise PromError(NO_DATA, f"no series for {promql!r}")
    return out


def sample_from(
    now: datetime,
    results: Mapping[str, float | PromError],
    vectors: Mapping[str, Mapping[str, float] | PromError] | None = None,
) -> Sample:
    """A tuner Sample from query results; any transport error spoils the sample.

    The prediction queries' answers (numbers in `results`, per-label values in
    `vectors`) become `Sample.predictions`; their absence is no error.
    """
    values: dict[str, float | None] = {}
    missing: dict[str, str] = {}
    error: tuple[str, str] | None = None
    found: dict[str, Any] = {}
    for name, res in [*results.items(), *(vectors or {}).items()]:
        if isinstance(res, PromError):
            if res.transport and error is None:
                error = (res.reason, res.message)
            missing[name] = res.reason
            if name in FIELDS:
                values[FIELDS[name]] = None
        elif name in FIELDS:
            values[FIELDS[name]] = res  # type: ignore[assignment]
        else:
            found[name] = res
    predictions = predictions_from(found) if error is None else None
    return Sample(
        time=now,
        error=error,
        missing=missing,
        predictions=predictions,
        **values,  # type: ignore[arg-type]
    )


def predictions_from(found: Mapping[str, Any]) -> Predictions | None:
    """The prediction queries' answers as Predictions; None when the engines export none."""

    def by_ratio(name: str) -> dict[float, float]:
        out = {}
        for label, value in (found.get(name) or {}).items():
            try:
                out[float(label)] = value
            except ValueError:
                continue  # not a ratio: ignore the series
        return out

    speedup = by_ratio("predictedSpeedup")
    can_help = found.get("compressionCanHelp")
    if not speedup and can_help is None:
        return None
    helps = None if can_help is None else can_help >= 0.5
    reason = None
    if helps is False:
        pods = {k: v for k, v in (found.get("compressionCanHelpReason") or {}).items() if v > 0}
        why = [k for k in sorted(pods, key=lambda k: -pods[k]) if k not in ENGINE_NOT_A_REASON]
        reason = ENGINE_REASONS.get(why[0], why[0]) if why else None
    return Predictions(
        speedup=speedup,
        kept=by_ratio("ratioKeptAcceptance"),
        head_share=by_ratio("draftHeadShare"),
        best=found.get("bestRatio"),
        can_help=helps,
        reason=reason,
        ranking_age=found.get("headRankingAge"),
        ranking_coverage=found.get("headRankingCoverage"),
    )
