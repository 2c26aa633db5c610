"""The draft phase: propose k tokens per row, one draft forward per depth.

A drafter has two methods, as transformers' CandidateGenerator: `propose` returns a
Proposal, and `keep_accepted` learns how much of it the target kept (here: the draft
cache keeps the accepted drafts, the rest become holes). The decoder holds its drafter
as a `Drafter` and drives it through these two methods only. Which head the draft
scores with (re-ranked from traffic between steps, a concrete config per ratio) is
`HeadInUse`, which the drafter, the decoder and the compressed-head bookkeeping share.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from slimspec.decoding.kv import decoder_stack, forward
from slimspec.decoding.rows import RowBatch
from slimspec.decoding.sampling import BatchSampling, greedy_tokens
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
    head_s: float | None = None  # the head's share of `seconds` (None: not timed)
    shadow_argmax: list[torch.Tensor] = field(default_factory=list)  # per depth (B,)
    shadow_hidden: list[torch.Tensor] = field(default_factory=list)  # per depth (B, d)
    lookup: bool = False  # the tokens came from lookup.py: no draft forward ran
    swapped: tuple[bool, ...] = ()  # rows whose drafts were replaced by lookup drafts

    def from_lookup(self, row: int) -> bool:
        """Whether this row's drafts are lookup drafts (a lookup step, or swapped in)."""
        return self.lookup or (row < len(self.swapped) and self.swapped[row])

    @property
    def k(self) -> int:
        return self.tokens.shape[1]


def lookup_proposal(
    batch: RowBatch, drafts: list[list[int]], sampling: BatchSampling, seconds: float
) -> Proposal:
    """A proposal of lookup drafts (lookup.py), one equally long list per row ([] for a
    row without a match: it repeats its last token, which the target rarely keeps).
    A lookup draft is no sample: q is a point mass on each proposed token, which the
    rejection rule needs (sampling.py); greedy and coupled rows compare tokens only."""
    k = max(len(d) for d in drafts)
    rows = [d if d else [r.seq[-1]] * k for d, r in zip(drafts, batch.rows, strict=True)]
    tokens = torch.tensor(rows, dtype=torch.long, device=batch.device).view(len(rows), k)
    token_ids, index = torch.unique(tokens, return_inverse=True)
    q: list[torch.Tensor] = []
    if not sampling.all_greedy:
        eye = torch.eye(len(token_ids), device=batch.device)
        q = [eye[index[:, j]] for j in range(k)]
    empty = torch.zeros(len(rows), 0, dtype=torch.long, device=batch.device)
    return Proposal(tokens, empty, q, token_ids, batch.draft_kv.length, seconds, None, lookup=True)


def swap_in_lookup(proposal: Proposal, drafts: list[list[int]], swap: list[bool]) -> Proposal:
    """The draft step's proposal with the rows in `swap` proposing their lookup drafts
    (k tokens each) instead: in a batch, the draft forwards serve the other rows anyway,
    and where a row's earlier text predicts it better, it verifies that. Only for rows
    whose verification compares tokens (greedy, seeded): q stays the draft's."""
    tokens = proposal.tokens.clone()
    for i, on in enumerate(swap):
        if on:
            tokens[i] = torch.tensor(drafts[i][: proposal.k], dtype=tokens.dtype)
    return replace(proposal, tokens=tokens, swapped=tuple(swap))


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


class HeadInUse:
    """The compressed head the draft scores with, and the concrete head at each ratio.

    `head` is replaced as one object when a re-ranked head is swapped in between steps
    (compression.py), so every ratio's slices change together."""

    def __init__(
        self, head: DraftHead, calibration: CalibrationArtifact | None, vocab_cap: int | None
    ) -> None:
        self.head = head
        self.calibration = calibration
        self.vocab_cap = vocab_cap

    def config(self, ratio: float) -> HeadConfig:
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


class HeadDrafter:
    """A draft model whose LM head is the compressed DraftHead in use."""

    def __init__(
        self,
        draft: Any,
        heads: HeadInUse,
        sibling_drafts: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.base = decoder_stack(draft)
        self.heads = heads
        self.sibling_drafts = sibling_drafts
        self._clock = clock  # seconds, after the device finished its queued work
        # The head is timed apart on CPU only: on a GPU that would mean a sync per forward.
        self.time_head = heads.head.ranked_weight.device.type == "cpu"

    def propose(
        self, batch: RowBatch, k: int, sampling: BatchSampling, ratio: float, shadow: bool
    ) -> Proposal:
        cfg = self.heads.config(ratio)
        head = self.heads.head  # one object for the whole step (a re-rank swaps it between steps)
        token_ids = head.token_ids(cfg)
        # Greedy batches also propose the draft's runner-up at the first m depths.
        # (Not for constrained rows: a sibling's own slot would need its grammar state.)
        greedy = sampling.all_greedy and sampling.grammar is None
        m = min(k, self.sibling_drafts) if greedy and len(token_ids) > 1 else 0
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
        first_s = head_s = 0.0
        for j in range(k):
            if j == 1:
                first_s = self._clock() - t0
            hidden = forward(self.base, kv, inp, inp_pos, inp_real)[:, -1]
            if self.time_head:
                th = time.perf_counter()
                logits = head.logits(hidden, cfg)
                head_s += time.perf_counter() - th
            else:
                logits = head.logits(hidden, cfg)
            if sampling.grammar is not None:  # propose what the grammar allows
                logits = sampling.grammar.draft_logits(logits, token_ids)
            if j < m:
                top2 = logits.topk(2, dim=-1).indices
                idx = top2[:, 0]
                siblings.append(token_ids[top2[:, 1]])
            elif sampling.all_greedy:
                idx = greedy_tokens(logits)
            else:
                q = sampling.warp(logits)
                idx = sampling.draft_choice(q, j, token_ids)
                q_subset.append(q)
            tok = token_ids[idx]
            drafts.append(tok)
            if sampling.grammar is not None:
                sampling.grammar.take_drafts(tok)
            if shadow:  # the full head scores these after verification, outside the timing
                shadow_argmax.append(token_ids[greedy_tokens(logits)])
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
            head_s=head_s if self.time_head and k > 0 else None,
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
