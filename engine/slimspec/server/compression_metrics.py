"""Metrics of what each compression ratio costs and buys, and of the head's ranking.

Names and labels are fixed by docs/contracts.md: the operator's tuner reads them. The
engine's RatioReport (decoding/ratio_monitor.py) and RankingStatus
(draft_head/traffic.py) are read on the scheduler thread after each step; gauges
change only when the decoder made a new report.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from slimspec.decoding.engine import Engine
from slimspec.decoding.ratio_model import REASON_NOT_MEASURED, REASONS
from slimspec.decoding.ratio_monitor import RatioReport

SOURCES = ("calibration", "traffic")


def ratio_label(ratio: float) -> str:
    """A ratio as the runtime ConfigMap writes compression_ratio: the shortest decimal."""
    return repr(round(float(ratio), 6))


class CompressionMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.speedup = Gauge(
            "slimspec_ratio_predicted_speedup",
            "Predicted decode tokens/s at this ratio over predicted target-only tokens/s",
            ["ratio"],
            registry=r,
        )
        self.kept = Gauge(
            "slimspec_ratio_kept_acceptance",
            "Shadow check: kept acceptance measured at this ratio",
            ["ratio"],
            registry=r,
        )
        self.head_share = Gauge(
            "slimspec_draft_head_share",
            "Share of a draft step spent in the head at this ratio",
            ["ratio"],
            registry=r,
        )
        self.best = Gauge(
            "slimspec_ratio_best", "Ratio with the highest predicted speed-up", registry=r
        )
        self.can_help = Gauge(
            "slimspec_compression_can_help",
            "1 when a ratio > 0 is predicted faster than ratio 0 beyond the model's uncertainty",
            registry=r,
        )
        self.can_help_info = Gauge(
            "slimspec_compression_can_help_info",
            "Why compression can or cannot help (1 on the current reason)",
            ["reason"],
            registry=r,
        )
        self.ranking_age = Gauge(
            "slimspec_head_ranking_age_seconds",
            "Age of the data behind the head's token ranking",
            registry=r,
        )
        self.coverage = Gauge(
            "slimspec_head_ranking_coverage",
            "Share of recently emitted tokens inside the subset of the ratio in force",
            registry=r,
        )
        self.reranks = Counter(
            "slimspec_head_reranks_total", "Re-rankings of the head from traffic", registry=r
        )
        self.source = Gauge(
            "slimspec_head_ranking_source_info",
            "Where the head's token ranking comes from (1 on the current source)",
            ["source"],
            registry=r,
        )
        self._built_at: float | None = None
        self.ranking_age.set_function(
            lambda: time.time() - self._built_at if self._built_at is not None else 0.0
        )
        self._report: RatioReport | None = None
        self._reranks = 0
        self._set_reason(REASON_NOT_MEASURED)

    def _set_reason(self, reason: str) -> None:
        for r in REASONS:
            self.can_help_info.labels(reason=r).set(1.0 if r == reason else 0.0)

    def observe(self, engine: Engine) -> None:
        """After a step: export the engine's latest report and ranking status (an engine
        without a draft has neither)."""
        report = engine.ratio_report
        if report is not None and report is not self._report:
            self._report = report
            for ratio, point in report.points.items():
                label = ratio_label(ratio)
                self.speedup.labels(ratio=label).set(point.speedup)
                self.head_share.labels(ratio=label).set(point.head_share)
            for ratio, kept in report.kept_measured.items():
                self.kept.labels(ratio=ratio_label(ratio)).set(kept)
            self.best.set(report.assessment.best)
            self.can_help.set(1.0 if report.assessment.can_help else 0.0)
            self._set_reason(report.assessment.reason)
        status = engine.ranking_status()
        if status is not None:
            self._built_at = status.built_at
            self.coverage.set(status.coverage)
            if status.reranks > self._reranks:
                self.reranks.inc(status.reranks - self._reranks)
            self._reranks = status.reranks
            for s in SOURCES:
                self.source.labels(source=s).set(1.0 if s == status.source else 0.0)
