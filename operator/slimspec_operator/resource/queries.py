"""The PromQL templates the tuner and the autoscaler read, as the resource's
spec.tuning.queries defaults (pure data; tuning/prometheus/queries.py renders them).
"""

from __future__ import annotations

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
    # The engines' predictions, one series per ratio: mean over pods for the
    # speed-up and the head share, the worst pod for kept acceptance.
    "predictedSpeedup": f"avg by (ratio) (slimspec_ratio_predicted_speedup{{{SELECTOR}}})",
    "ratioKeptAcceptance": f"min by (ratio) (slimspec_ratio_kept_acceptance{{{SELECTOR}}})",
    "draftHeadShare": f"avg by (ratio) (slimspec_draft_head_share{{{SELECTOR}}})",
    "bestRatio": f"avg(slimspec_ratio_best{{{SELECTOR}}})",
    # min over the pods that have measured (a pod exports 0 with the reason
    # not_measured until its first prediction): helps only if every one says so.
    "compressionCanHelp": (
        f"min(slimspec_compression_can_help{{{SELECTOR}}} unless on (instance) "
        f'(slimspec_compression_can_help_info{{{SELECTOR},reason="not_measured"}} == 1))'
    ),
    # Pods per reason (helps, head_share_small, acceptance_loss, not_measured).
    "compressionCanHelpReason": (
        f"sum by (reason) (slimspec_compression_can_help_info{{{SELECTOR}}} == 1)"
    ),
    "headRankingAge": f"max(slimspec_head_ranking_age_seconds{{{SELECTOR}}})",
    "headRankingCoverage": f"min(slimspec_head_ranking_coverage{{{SELECTOR}}})",
}
