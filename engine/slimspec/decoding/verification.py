"""The verify phase: one target forward over every row's last token, drafts and siblings,
and the exact decision of what each row keeps (sampling.py, siblings.py decide)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slimspec.decoding.drafting import Proposal
from slimspec.decoding.grouped_forward import Group, forward_groups
from slimspec.decoding.kv import forward
from slimspec.decoding.rows import RowBatch, RowOutcome
from slimspec.decoding.sampling import BatchSampling, full_vocab_q
from slimspec.decoding.siblings import tree_attention, tree_positions, verify_greedy_siblings


@dataclass
class Verdict:
    """What the target decided for every row of a proposal."""

    num_accepted: torch.Tensor  # (B,) chain drafts accepted
    next_token: torch.Tensor  # (B,) the correction, the bonus, or the token after a sibling
    sibling_hit: torch.Tensor  # (B,) bool: the sibling at the break was the target's token
    target_argmax: torch.Tensor | None  # (B, 1+k+m) when asked for (the shadow check)
    cache_start: int  # target cache column of the verification's first slot
    seconds: float  # the phase's time
    first_tokens: list[int]  # the riding rows' first tokens (after their prompts)

    def outcomes(self, proposal: Proposal) -> list[RowOutcome]:
        """Per row: the accepted drafts, then the sibling and the target's token after it
        on a sibling hit, else the target's token (the correction or the bonus)."""
        acc, nxt = self.num_accepted.tolist(), self.next_token.tolist()
        hit = self.sibling_hit.tolist()
        drafts, siblings = proposal.tokens.tolist(), proposal.siblings.tolist()
        out = []
        for i, a in enumerate(acc):
            if hit[i]:
                emitted = [*drafts[i][:a], siblings[i][a], nxt[i]]
            else:
                emitted = [*drafts[i][:a], nxt[i]]
            out.append(RowOutcome(emitted, a, bool(hit[i])))
        return out


class TargetVerifier:
    """The target model: scores a proposal in one forward and keeps what it accepts."""

    def __init__(self, target: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        self.head = target.get_output_embeddings()
        self.softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        self.vocab = self.head.weight.shape[0]
        self._clock = clock  # seconds, after the device finished its queued work

    def verify(
        self,
        batch: RowBatch,
        proposal: Proposal,
        sampling: BatchSampling,
        want_argmax: bool,
        riding: Sequence[Group] = (),
        riding_sampling: BatchSampling | None = None,
    ) -> Verdict:
        """Score the proposal. `riding` groups (new whole prompts, right-aligned, with
        their own caches) share the forward (grouped_forward.py); their last position
        gives each its first token, chosen as riding_sampling says."""
        t0 = self._clock()
        k, m = proposal.k, proposal.siblings.shape[1]
        b, dev = len(batch.rows), batch.device
        cache_start = batch.target_kv.length
        last = torch.tensor([r.seq[-1] for r in batch.rows], device=dev).unsqueeze(1)
        ids = torch.cat([last, proposal.tokens, proposal.siblings], dim=1)
        pos = tree_positions(batch.last_positions(), k, m)
        real = torch.ones(b, k + 1 + m, dtype=torch.bool, device=dev)
        tree = tree_attention(k, m, dev) if m else None
        first: list[int] = []
        if riding:
            assert riding_sampling is not None
            mine = Group(batch.target_kv, ids, pos, real, tree)
            hidden, *prompts = forward_groups(self.base, [mine, *riding])
            last = torch.cat([h[:, -1:] for h in prompts])  # (n, 1, d)
            first = self._first_tokens(self._logits(last), riding_sampling)
        else:
            hidden = forward(self.base, batch.target_kv, ids, pos, real, tree)
        logits = self._logits(hidden)
        hit = torch.zeros(b, dtype=torch.bool, device=dev)
        argmax = None
        if sampling.all_greedy:
            argmax = logits.argmax(dim=-1)
            num_acc, hit, next_tok = verify_greedy_siblings(
                argmax, proposal.tokens, proposal.siblings
            )
        else:
            p = sampling.warp(logits)
            q = full_vocab_q(proposal.q, proposal.token_ids, self.vocab, b)
            num_acc, next_tok = sampling.verify(p, q, proposal.tokens)
            if want_argmax:
                argmax = logits.argmax(dim=-1)
        seconds = self._clock() - t0
        return Verdict(num_acc, next_tok, hit, argmax, cache_start, seconds, first)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _first_tokens(self, logits: torch.Tensor, sampling: BatchSampling) -> list[int]:
        """Each new row's token after its prompt, as a verification of zero drafts would
        choose it (argmax, or sampled with the row's position-keyed randomness)."""
        if sampling.all_greedy:
            return logits[:, 0].argmax(dim=-1).tolist()
        sampling = sampling.with_noise(1, self.vocab)
        no_drafts = torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
        q = torch.zeros(logits.shape[0], 0, self.vocab, device=logits.device)
        _, token = sampling.verify(sampling.warp(logits), q, no_drafts)
        return token.tolist()

    def keep_accepted(self, batch: RowBatch, proposal: Proposal, verdict: Verdict) -> None:
        """The target cache keeps each row's last token and accepted drafts, and an
        accepted sibling's slot, which sits behind the chain's."""
        kv = batch.target_kv
        kv.invalidate_tail(verdict.cache_start, verdict.num_accepted + 1)
        if proposal.siblings.shape[1]:
            hit_rows = torch.nonzero(verdict.sibling_hit).squeeze(1)
            if hit_rows.numel():
                cols = verdict.cache_start + 1 + proposal.k + verdict.num_accepted[hit_rows]
                kv.mark_valid(hit_rows, cols)
