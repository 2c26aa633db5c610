"""The queries one tick runs and their answers as one tuner `Sample` (pure).

Everything about a query comes from the registry (resource/queries.py): which
ticks need it, what its answer fills, and whether it answers one number or one
series per label value (the engines' per-ratio predictions per `ratio`, why
compression can or cannot help per `reason`); `vector_values` reads the latter.

A built-in query also has a grouped form that answers for every resource at once
(`grouped_query`); `split_grouped` cuts its answer by (namespace, service) and
`answer_of` gives one resource exactly what its own query would have answered.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from slimspec_operator.resource.queries import (
    BEST_RATIO,
    BY_NAME,
    COMPRESSION_CAN_HELP,
    COMPRESSION_CAN_HELP_REASON,
    DRAFT_HEAD_SHARE,
    HEAD_RANKING_AGE,
    HEAD_RANKING_COVERAGE,
    PREDICTED_SPEEDUP,
    QUERIES,
    RATIO_KEPT_ACCEPTANCE,
    Into,
    Need,
    QueryDef,
)
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.tuning.predictions import Predictions
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason
from slimspec_operator.tuning.reasons import Reason
from slimspec_operator.tuning.types import Sample

# The engines' reasons (label of slimspec_compression_can_help_info) as
# condition reasons; `helps` and `not_measured` say nothing about a "cannot".
ENGINE_REASONS = {
    "head_share_small": Reason.HEAD_SHARE_TOO_SMALL,
    "acceptance_loss": Reason.ACCEPTANCE_LOSS,
}
ENGINE_NOT_A_REASON = frozenset({"helps", "not_measured", ""})


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


def needed(view: TuningView, scaling: bool) -> tuple[QueryDef, ...]:
    """The queries one tick runs (queue depth only for the autoscaler's rule)."""
    needs = {Need.CONTROL}
    if scaling and view.autoscaling.target_queue_depth is not None:
        needs.add(Need.QUEUE_SCALING)
    if view.tuning.enabled:
        needs.add(Need.TUNING)
    return tuple(q for q in QUERIES if q.need in needs)


def queries_for(view: TuningView, namespace: str, name: str, scaling: bool) -> dict[str, str]:
    """The rendered queries one tick runs: name -> PromQL."""
    window = rate_window(view.tuning.interval_seconds)
    return {
        q.name: render_query(view.tuning.queries.template(q), namespace, name, window)
        for q in needed(view, scaling)
    }


Answer = float | dict[str, float]  # one number, or {label value: number}
Grouped = dict[tuple[str, str], Answer]  # by (namespace, service)
UNSCOPED = 'service!=""'


def shareable(view: TuningView, query: QueryDef) -> bool:
    """The resource runs the built-in query (not its own template), so the grouped
    form answers for it too."""
    return bool(query.grouped) and view.tuning.queries.template(query) == query.template


def grouped_query(query: QueryDef, window: str, namespace: str | None = None) -> str:
    """The grouped PromQL: every service, or every service of `namespace`."""
    scope = UNSCOPED if namespace is None else f'namespace="{namespace}",{UNSCOPED}'
    return query.grouped.replace("{scope}", scope).replace("{window}", window)


def split_grouped(data: Mapping[str, Any], query: QueryDef, promql: str) -> Grouped:
    """A grouped answer (`data` of /api/v1/query) by (namespace, service): numbers for
    a scalar query (NaN kept: `answer_of` reports it as the resource's own query
    would), {label value: number} for a vector query (NaN/Inf left out)."""
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PromError(
            PromReason.BAD_RESPONSE, f"result type {data.get('resultType')!r} for {promql!r}"
        )
    out: Grouped = {}
    for series in data["result"]:
        try:
            metric = series.get("metric") or {}
            key = (str(metric.get("namespace", "")), str(metric.get("service", "")))
            value = float(series["value"][1])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PromError(PromReason.BAD_RESPONSE, f"unreadable series {series!r}") from exc
        if query.vector_label is None:
            out[key] = value
        elif math.isfinite(value):
            per_label = out.setdefault(key, {})
            assert isinstance(per_label, dict)
            per_label[str(metric.get(query.vector_label, ""))] = value
    return out


def answer_of(
    query: QueryDef, grouped: Grouped | PromError, namespace: str, name: str, promql: str
) -> Answer | PromError:
    """One resource's answer from the grouped one, as its own query `promql` would
    have answered it (the same values, the same errors)."""
    if isinstance(grouped, PromError):
        return grouped
    found = grouped.get((namespace, name))
    if found is None or found == {}:
        if query.absent is not None:
            return query.absent
        return PromError(PromReason.NO_DATA, f"no series for {promql!r}")
    if isinstance(found, float) and not math.isfinite(found):
        return PromError(PromReason.NOT_A_NUMBER, f"{promql!r} = {found}")
    return found


def vector_values(data: Mapping[str, Any], label: str, promql: str) -> dict[str, float]:
    """An instant-vector answer (`data` of /api/v1/query) as {label value: number}.

    A series without the label is keyed "". NaN/Inf series are left out; no
    series left is NoData.
    """
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PromError(
            PromReason.BAD_RESPONSE, f"result type {data.get('resultType')!r} for {promql!r}"
        )
    out: dict[str, float] = {}
    for series in data["result"]:
        try:
            key = str((series.get("metric") or {}).get(label, ""))
            value = float(series["value"][1])
        except (AttributeError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise PromError(PromReason.BAD_RESPONSE, f"unreadable series {series!r}") from exc
        if math.isfinite(value):
            out[key] = value
    if not out:
        raise PromError(PromReason.NO_DATA, f"no series for {promql!r}")
    return out


def sample_from(
    now: datetime,
    results: Mapping[str, float | PromError],
    vectors: Mapping[str, Mapping[str, float] | PromError] | None = None,
) -> Sample:
    """A tuner Sample from query results (by query name); any transport error
    spoils the sample.

    The prediction queries' answers (numbers in `results`, per-label values in
    `vectors`) become `Sample.predictions`; their absence is no error.
    """
    values: dict[str, float | None] = {}
    missing: dict[str, str] = {}
    error: tuple[str, str] | None = None
    found: dict[QueryDef, Any] = {}
    for name, res in [*results.items(), *(vectors or {}).items()]:
        query = BY_NAME[name]
        if isinstance(res, PromError):
            if res.transport and error is None:
                error = (res.reason, res.message)
            missing[name] = res.reason
            if query.into is Into.SAMPLE:
                values[query.field] = None
        elif query.into is Into.SAMPLE:
            values[query.field] = res  # type: ignore[assignment]
        else:
            found[query] = res
    predictions = predictions_from(found) if error is None else None
    return Sample(
        time=now,
        error=error,
        missing=missing,
        predictions=predictions,
        **values,  # type: ignore[arg-type]
    )


def predictions_from(found: Mapping[QueryDef, Any]) -> Predictions | None:
    """The prediction queries' answers as Predictions; None when the engines export none."""

    def by_ratio(query: QueryDef) -> dict[float, float]:
        out = {}
        for label, value in (found.get(query) or {}).items():
            try:
                out[float(label)] = value
            except ValueError:
                continue  # not a ratio: ignore the series
        return out

    speedup = by_ratio(PREDICTED_SPEEDUP)
    can_help = found.get(COMPRESSION_CAN_HELP)
    if not speedup and can_help is None:
        return None
    helps = None if can_help is None else can_help >= 0.5
    reason = None
    if helps is False:
        pods = {k: v for k, v in (found.get(COMPRESSION_CAN_HELP_REASON) or {}).items() if v > 0}
        why = [k for k in sorted(pods, key=lambda k: -pods[k]) if k not in ENGINE_NOT_A_REASON]
        reason = ENGINE_REASONS.get(why[0], why[0]) if why else None
    return Predictions(
        speedup=speedup,
        kept=by_ratio(RATIO_KEPT_ACCEPTANCE),
        head_share=by_ratio(DRAFT_HEAD_SHARE),
        best=found.get(BEST_RATIO),
        can_help=helps,
        reason=reason,
        ranking_age=found.get(HEAD_RANKING_AGE),
        ranking_coverage=found.get(HEAD_RANKING_COVERAGE),
    )
