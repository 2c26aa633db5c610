"""The draft phase: propose k tokens per row, one draft forward per depth.

A drafter has two methods, as transformers' CandidateGenerator: `propose` returns a
Proposal, and `keep_accepted` learns how much of it the target kept (here: the draft
cache keeps the accepted drafts, the rest become holes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from slimspec.decoding.kv import forward
from slimspec.decoding.rows import RowBatch
from slimspec.decoding.sampling import STREAM_DRAFT, BatchSampling, sample_from_probs
from slimspec.draft_head.artifact import CalibrationArtifact
from slimspec.draft_head.head import DraftHead, HeadConfig, subset_size_for_ratio


@dataclass
class Proposal:
    """What the draft phase proposes for every row of the batch."""

    tokens: torch.Tensor  # (B, k) the drafted chain
    siblings: torch.Tensor  # (B, m) the draft's runner-up at the first m depths (greedy)
    q: list[torch.Tensor]  # sampling batches: per depth, (B, V') what the token was drawn from
    token_ids: torch.Tensor  # (V',) the token ids the head scored, in q's order
    cache_start: int  # draft cache column of the first drafted token's slot
    seconds: float  # the phase's time
    catch_up_s: float | None  # the first forward's time, when it also fed a backlog
    shadow_argmax: list[torch.Tensor] = field(default_factory=list)  # per depth (B,)
    shadow_hidden: list[torch.Tensor] = field(default_factory=list)  # per depth (B, d)

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


class Drafter(Protocol):
    def propose(
        self, batch: RowBatch, k: int, sampling: BatchSampling, ratio: float, shadow: bool
    ) -> Proposal:
        """k tokens per row at this compression ratio (shadow: keep what the quality
        check needs)."""
        ...

    def keep_accepted(self, batch: RowBatch, proposal: Proposal, accepted: torch.Tensor) -> None:
        """After verification: the target accepted accepted[b] of row b's drafts."""
        ...


class HeadDrafter:
    """A draft model whose LM head is the compressed DraftHead."""

    def __init__(
        self,
        draft: Any,
        head: DraftHead,
        calibration: CalibrationArtifact | None,
        vocab_cap: int | None,
        sibling_drafts: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.base = draft.get_decoder() if hasattr(draft, "get_decoder") else draft.model
        self.head = head
        self.calibration = calibration
        self.vocab_cap = vocab_cap
        self.sibling_drafts = sibling_drafts
        self._clock = clock  # seconds, after the device finished its queued work

    def head_config(self, ratio: float) -> HeadConfig:
        """The concrete head used at a ratio: the calibration's choice (a subset by the
        formula without one), capped at vocab_cap tokens, within what the head holds."""
        if ratio == 0.0:
            cfg = HeadConfig(self.head.vocab, None)
        elif self.calibration is not None:
            cfg = self.calibration.config_for(ratio, self.head.hidden)
        else:
            cfg = HeadConfig(subset_size_for_ratio(ratio, self.head.vocab), None)
        if self.vocab_cap is not None and cfg.subset_size > self.vocab_cap:
            cfg = HeadConfig(self.vocab_cap, cfg.rank)
        if not self.head.supports(cfg):
            cfg = HeadConfig(min(cfg.subset_size, self.head.vocab), None)
        return cfg

    def propose(
        self, batch: RowBatch, k: int, sampling: BatchSampling, ratio: float, shadow: bool
    ) -> Proposal:
        cfg = self.head_config(ratio)
        token_ids = self.head.token_ids(cfg)
        # Greedy batches also propose the draft's runner-up at the first m depths.
        m = min(k, self.sibling_drafts) if sampling.all_greedy and len(token_ids) > 1 else 0
        t0 = self._clock()
        b, kv = len(batch.rows), batch.draft_kv
        inp, inp_pos, inp_real = batch.draft_backlog()  # first feed what the draft has not seen
        backlog = inp.shape[1]
        cache_start = kv.length + backlog
        last_pos = batch.last_positions()
        drafts: list[torch.Tensor] = []
        siblings: list[torch.Tensor] = []
        q_subset: list[torch.Tensor] = []
        shadow_argmax: list[torch.Tensor] = []
        shadow_hidden: list[torch.Tensor] = []
        first_s = 0.0
        for j in range(k):
            if j == 1:
                first_s = self._clock() - t0
            hidden = forward(self.base, kv, inp, inp_pos, inp_real)[:, -1]
            logits = self.head.logits(hidden, cfg)
            if j < m:
                top2 = logits.topk(2, dim=-1).indices
                idx = top2[:, 0]
                siblings.append(token_ids[top2[:, 1]])
            elif sampling.all_greedy:
                idx = logits.argmax(dim=-1)
            else:
                q = sampling.warp(logits)
                idx = sample_from_probs(q, sampling.uniforms(j, 1, STREAM_DRAFT)[:, 0])
                q_subset.append(q)
            tok = token_ids[idx]
            drafts.append(tok)
            if shadow:  # the full head scores these after verification, outside the timing
                shadow_argmax.append(token_ids[logits.argmax(dim=-1)])
                shadow_hidden.append(hidden.clone())
            inp = tok.unsqueeze(1)
            inp_pos = (last_pos + 1 + j).unsqueeze(1)
            inp_real = torch.ones(b, 1, dtype=torch.bool, device=batch.device)
        # k = 0: a plain target step; the draft catches up on the backlog next time
        empty = torch.zeros(b, 0, dtype=torch.long, device=batch.device)
        tokens = torch.stack(drafts, dim=1) if drafts else empty
        sibling_tokens = torch.stack(siblings, dim=1) if siblings else empty
        seconds = self._clock() - t0
        return Proposal(
            tokens,
            sibling_tokens,
            q_subset,
            token_ids,
            cache_start,
            seconds,
            catch_up_s=first_s if backlog > 2 else None,
            shadow_argmax=shadow_argmax,
            shadow_hidden=shadow_hidden,
        )

    def keep_accepted(self, batch: RowBatch, proposal: Proposal, accepted: torch.Tensor) -> None:
        k = proposal.k
        if k == 0:
            return
        batch.draft_kv.invalidate_tail(proposal.cache_start, accepted)
        # The draft cache now holds each row's sequence up to its last accepted draft.
        for r, a in zip(batch.rows, accepted.tolist(), strict=True):
            r.draft_seen = len(r.seq) + min(a, k - 1)
