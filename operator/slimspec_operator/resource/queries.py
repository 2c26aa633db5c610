"""The one registry of the PromQL the tuner and the autoscaler read (pure data).

Each `QueryDef` says everything about one query: its name (the key under
spec.tuning.queries), its built-in template, who needs it (which ticks run it),
what its answer fills (a `Sample` field or a `Predictions` field) and, for a
query answering one series per label value, that label. The spec model
(resource/spec.py: `QueriesSpec`), the query planner and the reading of answers
(tuning/prometheus/queries.py) are derived from it; tests/operator/test_spec.py
checks that the CRD names exactly these queries.

It lives with the resource, not with the tuner, because its names and defaults
are part of the resource's API (the CRD), and the resource layer imports nothing
above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic.alias_generators import to_snake

# Label selector every default query uses. A ServiceMonitor adds `namespace` and
# `service` target labels by default; a hand-written scrape config must add them.
SELECTOR = 'namespace="{namespace}",service="{service}"'
# rate() window, substituted per resource: see rate_window().
RATE_WINDOW = "{window}"
# The grouped form of a built-in query answers for every SlimSpecService at once, one
# series per (namespace, service): the tuner runs it once per tick for all resources
# that keep the built-in template (tuning/prometheus/shared.py). {scope} is filled
# with `service!=""`, or with the namespace too where credentials are per namespace.
GROUP_SELECTOR = "{scope}"
BY = "namespace, service"


class Need(StrEnum):
    """Which ticks run a query."""

    CONTROL = "control"  # every tick that controls the resource (tuning or autoscaling)
    QUEUE_SCALING = "queueScaling"  # the operator's autoscaler with targetQueueDepth set
    TUNING = "tuning"  # tuning enabled: the engines' predictions


class Into(StrEnum):
    """Which reading an answer fills."""

    SAMPLE = "sample"  # a field of tuning.types.Sample
    PREDICTIONS = "predictions"  # a field of tuning.predictions.Predictions


@dataclass(frozen=True)
class QueryDef:
    name: str  # key under spec.tuning.queries (camelCase, as in the CRD)
    template: str  # the built-in PromQL ({namespace}, {service}, {window} filled per resource)
    need: Need
    into: Into
    field: str  # the Sample / Predictions field the answer fills
    vector_label: str | None = None  # one series per value of this label; None: one number
    grouped: str = ""  # the built-in query for all resources at once, by (namespace, service)
    absent: float | None = None  # the answer when a resource has no series (else NoData)

    @property
    def attribute(self) -> str:
        """The spec model's (snake_case) attribute of this query."""
        return to_snake(self.name)


P99_LATENCY = QueryDef(
    "p99Latency",
    "histogram_quantile(0.99, sum by (le) "
    f"(rate(slimspec_request_latency_seconds_bucket{{{SELECTOR}}}[{RATE_WINDOW}])))",
    Need.CONTROL,
    Into.SAMPLE,
    "p99_latency",
    grouped=f"histogram_quantile(0.99, sum by ({BY}, le) "
    f"(rate(slimspec_request_latency_seconds_bucket{{{GROUP_SELECTOR}}}[{RATE_WINDOW}])))",
)
REQUEST_RATE = QueryDef(
    "requestRate",
    f"sum(rate(slimspec_requests_total{{{SELECTOR}}}[{RATE_WINDOW}]))",
    Need.CONTROL,
    Into.SAMPLE,
    "request_rate",
    grouped=f"sum by ({BY}) (rate(slimspec_requests_total{{{GROUP_SELECTOR}}}[{RATE_WINDOW}]))",
)
MEAN_ACCEPTED_LENGTH = QueryDef(
    "meanAcceptedLength",
    f"avg(slimspec_mean_accepted_length{{{SELECTOR}}})",
    Need.CONTROL,
    Into.SAMPLE,
    "mean_accepted_length",
    grouped=f"avg by ({BY}) (slimspec_mean_accepted_length{{{GROUP_SELECTOR}}})",
)
FALLBACK_RATE = QueryDef(
    "fallbackRate",
    # A labelled counter has no series until its first fallback: that is 0/s.
    f"sum(rate(slimspec_fallbacks_total{{{SELECTOR}}}[{RATE_WINDOW}])) or vector(0)",
    Need.CONTROL,
    Into.SAMPLE,
    "fallback_rate",
    grouped=f"sum by ({BY}) (rate(slimspec_fallbacks_total{{{GROUP_SELECTOR}}}[{RATE_WINDOW}]))",
    absent=0.0,
)
KEPT_ACCEPTANCE = QueryDef(
    "keptAcceptance",
    # min over pods: the worst replica decides whether compression may grow.
    # `> 0` drops pods whose shadow check has not run yet (the gauge starts at 0).
    f"min(slimspec_acceptance_kept_ratio{{{SELECTOR}}} > 0)",
    Need.CONTROL,
    Into.SAMPLE,
    "kept_acceptance",
    grouped=f"min by ({BY}) (slimspec_acceptance_kept_ratio{{{GROUP_SELECTOR}}} > 0)",
)
QUEUE_DEPTH = QueryDef(
    "queueDepth",
    f"avg(slimspec_queue_depth{{{SELECTOR}}})",
    Need.QUEUE_SCALING,
    Into.SAMPLE,
    "queue_depth",
    grouped=f"avg by ({BY}) (slimspec_queue_depth{{{GROUP_SELECTOR}}})",
)
# The engines' predictions, one series per ratio: mean over pods for the
# speed-up and the head share, the worst pod for kept acceptance.
PREDICTED_SPEEDUP = QueryDef(
    "predictedSpeedup",
    f"avg by (ratio) (slimspec_ratio_predicted_speedup{{{SELECTOR}}})",
    Need.TUNING,
    Into.PREDICTIONS,
    "speedup",
    vector_label="ratio",
    grouped=f"avg by ({BY}, ratio) (slimspec_ratio_predicted_speedup{{{GROUP_SELECTOR}}})",
)
RATIO_KEPT_ACCEPTANCE = QueryDef(
    "ratioKeptAcceptance",
    f"min by (ratio) (slimspec_ratio_kept_acceptance{{{SELECTOR}}})",
    Need.TUNING,
    Into.PREDICTIONS,
    "kept",
    vector_label="ratio",
    grouped=f"min by ({BY}, ratio) (slimspec_ratio_kept_acceptance{{{GROUP_SELECTOR}}})",
)
DRAFT_HEAD_SHARE = QueryDef(
    "draftHeadShare",
    f"avg by (ratio) (slimspec_draft_head_share{{{SELECTOR}}})",
    Need.TUNING,
    Into.PREDICTIONS,
    "head_share",
    vector_label="ratio",
    grouped=f"avg by ({BY}, ratio) (slimspec_draft_head_share{{{GROUP_SELECTOR}}})",
)
BEST_RATIO = QueryDef(
    "bestRatio",
    f"avg(slimspec_ratio_best{{{SELECTOR}}})",
    Need.TUNING,
    Into.PREDICTIONS,
    "best",
    grouped=f"avg by ({BY}) (slimspec_ratio_best{{{GROUP_SELECTOR}}})",
)
COMPRESSION_CAN_HELP = QueryDef(
    "compressionCanHelp",
    # min over the pods that have measured (a pod exports 0 with the reason
    # not_measured until its first prediction): helps only if every one says so.
    f"min(slimspec_compression_can_help{{{SELECTOR}}} unless on (instance) "
    f'(slimspec_compression_can_help_info{{{SELECTOR},reason="not_measured"}} == 1))',
    Need.TUNING,
    Into.PREDICTIONS,
    "can_help",
    grouped=f"min by ({BY}) (slimspec_compression_can_help{{{GROUP_SELECTOR}}} "
    "unless on (instance) "
    f'(slimspec_compression_can_help_info{{{GROUP_SELECTOR},reason="not_measured"}} == 1))',
)
COMPRESSION_CAN_HELP_REASON = QueryDef(
    "compressionCanHelpReason",
    # Pods per reason (helps, head_share_small, acceptance_loss, not_measured).
    f"sum by (reason) (slimspec_compression_can_help_info{{{SELECTOR}}} == 1)",
    Need.TUNING,
    Into.PREDICTIONS,
    "reason",
    vector_label="reason",
    grouped=f"sum by ({BY}, reason) (slimspec_compression_can_help_info{{{GROUP_SELECTOR}}} == 1)",
)
HEAD_RANKING_AGE = QueryDef(
    "headRankingAge",
    f"max(slimspec_head_ranking_age_seconds{{{SELECTOR}}})",
    Need.TUNING,
    Into.PREDICTIONS,
    "ranking_age",
    grouped=f"max by ({BY}) (slimspec_head_ranking_age_seconds{{{GROUP_SELECTOR}}})",
)
HEAD_RANKING_COVERAGE = QueryDef(
    "headRankingCoverage",
    f"min(slimspec_head_ranking_coverage{{{SELECTOR}}})",
    Need.TUNING,
    Into.PREDICTIONS,
    "ranking_coverage",
    grouped=f"min by ({BY}) (slimspec_head_ranking_coverage{{{GROUP_SELECTOR}}})",
)

# Cumulative totals, read at every tick: between two ticks their differences give the
# exact mean latency per generated token (no bucket, no rate() extrapolation), the
# measure a speed move's paired verdict judges on (tuning/verdict.py).
LATENCY_SUM = QueryDef(
    "latencySum",
    f"sum(slimspec_request_latency_seconds_sum{{{SELECTOR}}})",
    Need.TUNING,
    Into.SAMPLE,
    "latency_sum",
    grouped=f"sum by ({BY}) (slimspec_request_latency_seconds_sum{{{GROUP_SELECTOR}}})",
)
GENERATED_TOKENS = QueryDef(
    "generatedTokens",
    f"sum(slimspec_generated_tokens_total{{{SELECTOR}}})",
    Need.TUNING,
    Into.SAMPLE,
    "generated_tokens",
    grouped=f"sum by ({BY}) (slimspec_generated_tokens_total{{{GROUP_SELECTOR}}})",
)

# In the CRD's order.
QUERIES: tuple[QueryDef, ...] = (
    P99_LATENCY,
    REQUEST_RATE,
    MEAN_ACCEPTED_LENGTH,
    FALLBACK_RATE,
    KEPT_ACCEPTANCE,
    QUEUE_DEPTH,
    PREDICTED_SPEEDUP,
    RATIO_KEPT_ACCEPTANCE,
    DRAFT_HEAD_SHARE,
    BEST_RATIO,
    COMPRESSION_CAN_HELP,
    COMPRESSION_CAN_HELP_REASON,
    HEAD_RANKING_AGE,
    HEAD_RANKING_COVERAGE,
    LATENCY_SUM,
    GENERATED_TOKENS,
)
BY_NAME: dict[str, QueryDef] = {q.name: q for q in QUERIES}
# name -> built-in template (the chart's and the docs' tests render these).
DEFAULT_QUERIES: dict[str, str] = {q.name: q.template for q in QUERIES}
