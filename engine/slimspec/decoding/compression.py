"""The decoder's compressed head over time: the shadow check, what each ratio costs and
buys (ratio_monitor.py), and the head following the traffic (draft_head/traffic.py).

Called on the step thread only: before a step (swap in a re-ranked head, as one
object, so every ratio's slices change together), after verification (the shadow
check), and after a step (count emitted tokens, record timings, refresh the report).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from slimspec.decoding.adaptive import CostModel, draft_forward_seconds
from slimspec.decoding.drafting import HeadInUse, Proposal
from slimspec.decoding.quality import REASON_QUALITY, ShadowCheck
from slimspec.decoding.ratio_monitor import RatioMonitor, RatioReport
from slimspec.decoding.settings import DecoderSettings, StepSettings
from slimspec.decoding.stats import DecoderStats
from slimspec.decoding.types import StepOutput
from slimspec.decoding.verification import Verdict
from slimspec.draft_head.artifact import CalibrationArtifact
from slimspec.draft_head.head import HeadConfig
from slimspec.draft_head.traffic import RankingStatus, TrafficRanking

ENV_RERANK = "SLIMSPEC_HEAD_RERANK"  # "0" keeps the calibration ranking


def resolve_rerank(option: bool | None) -> bool:
    if option is None:
        return os.environ.get(ENV_RERANK, "1").strip().lower() not in ("0", "false", "off")
    if not isinstance(option, bool):
        raise ValueError(f"rerank_from_traffic must be a bool or None, got {option!r}")
    return option


def prior_kept(calibration: CalibrationArtifact | None) -> dict[float, float]:
    """Kept acceptance per ratio as calibration measured it (the prior until measured)."""
    if calibration is None:
        return {}
    return {
        round(float(row["compression_ratio"]), 2): float(row.get("kept", 1.0))
        for row in calibration.table
        if "compression_ratio" in row
    }


class CompressedHead:
    """The shadow check, the ratio report and the traffic ranking of one decoder."""

    def __init__(
        self,
        heads: HeadInUse,
        settings: DecoderSettings,
        cost: CostModel,
        shadow: ShadowCheck,
        traffic: TrafficRanking,
        calibration: CalibrationArtifact | None,
        k_min: int = 1,
    ) -> None:
        self.heads = heads
        self.k_min = k_min  # 0: adaptive k may skip drafting (the predictions model it)
        self.settings = settings
        self.cost = cost
        self.shadow = shadow
        self.traffic = traffic
        self.monitor = RatioMonitor()
        self._prior_kept = prior_kept(calibration)
        self._guard_judged = True  # the guard has had min_samples since its last reset

    @property
    def report(self) -> RatioReport | None:
        return self.monitor.report

    def ranking_status(self) -> RankingStatus:
        cfg = self.heads.config(self.settings.ratio)
        return self.traffic.status(cfg.subset_size)

    # ----------------------------------------------------------------- step thread
    def before_step(self) -> None:
        """Swap in a re-ranked head. The fallback window judged the old ranking, so it
        starts anew, but at most once per window's evidence: after a reset the guard
        always gets min_samples samples of the new ranking before the next reset, so
        frequent re-ranks can never keep it from falling back."""
        new = self.traffic.take_ready()
        if new is not None:
            self.heads.head = new
            self.shadow.by_ratio.reset()
            if self._guard_judged:
                self.shadow.monitor.reset()
                self._guard_judged = False

    def shadow_check(
        self, proposal: Proposal, verdict: Verdict, s: StepSettings, stats: DecoderStats
    ) -> None:
        """Score the full head's ranked rows on this step's draft positions (one call for
        all k, after the timed phases): every ratio's kept acceptance, and the fallback
        decision for the ratio in force."""
        if verdict.target_argmax is None:
            return
        head = self.heads.head
        hidden = torch.stack(proposal.shadow_hidden, dim=1)
        target = verdict.target_argmax[:, : proposal.k]
        ratios = [r for r in self.shadow.by_ratio.ratios]
        cfgs = [HeadConfig(head.vocab, None)] + [self.heads.config(r) for r in ratios]
        full, *others = head.argmax_by_config(hidden, cfgs)
        self.shadow.check_ratios(dict(zip(ratios, others, strict=True)), full, target)
        if s.ratio <= 0:
            return
        kept, new = self.shadow.check(
            torch.stack(proposal.shadow_argmax, dim=1),
            full,
            target,
            s.threshold,
            s.strategy,
            s.ratio,
        )
        stats.kept_acceptance = kept
        stats.shadow_samples = self.shadow.monitor.total_samples
        if new is not None or self.shadow.monitor.samples >= self.shadow.min_samples:
            self._guard_judged = True
        if new is not None:
            self.settings.fall_back(s.ratio, new)
            stats.record_fallback(REASON_QUALITY)

    def after_step(
        self,
        rows: int,
        s: StepSettings,
        proposal: Proposal,
        accepted: Sequence[int],
        outputs: Sequence[StepOutput],
        other_s: float | None = None,
    ) -> None:
        k = proposal.k
        # a lookup step ran no draft: nothing in it for the ratio model
        if not proposal.lookup:
            forward = draft_forward_seconds(proposal.seconds, k, proposal.catch_up_s)
            head = proposal.head_s / k if proposal.head_s is not None and k > 0 else None
            if self.monitor.observe(rows, s.ratio, forward, head, accepted, k, other_s):
                self.refresh(s)
        self.traffic.observe([t for o in outputs for t in o.new_token_ids])
        cfg = self.heads.config(s.ratio)
        self.traffic.maybe_start(self.heads.head, cfg.subset_size)

    def count_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Newly admitted requests' prompts: evidence of the traffic's vocabulary."""
        for ids in prompts:
            self.traffic.observe_prompt(ids)

    def refresh(self, s: StepSettings) -> RatioReport | None:
        return self.monitor.refresh(
            s.ratio,
            self.cost.verify.line(),
            self.shadow.by_ratio.measured(),
            self._prior_kept,
            s.max_draft_tokens,
            s.fixed_k,
            self.k_min,
            self.cost.verify.single_seconds(self.monitor.rows),
        )

    def measure_heads(self, clock: Callable[[], float], s: StepSettings) -> Any:
        """Micro-time every ratio's head (warm-up), then make the first report."""
        self.monitor.measure_heads(self.heads.head, self.heads.config, clock)
        return self.refresh(s)
