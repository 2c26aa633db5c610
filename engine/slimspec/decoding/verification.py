"""The verify phase: one target forward over every row's last token, drafts and siblings,
and the exact decision of what each row keeps (sampling.py, siblings.py decide)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slimspec.decoding.drafting import Proposal
from slimspec.decoding.grammar import mask_logits
from slimspec.decoding.grouped_forward import Group, forward_groups
from slimspec.decoding.kv import decoder_stack, forward
from slimspec.decoding.logprobs import token_logprobs
from slimspec.decoding.rows import RowBatch, RowOutcome
from slimspec.decoding.sampling import BatchSampling, full_vocab_q, greedy_tokens
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
    logits: torch.Tensor | None = None  # (B, 1+k+m, V) the target's, for log-probabilities

    def outcomes(self, proposal: Proposal, logprobs: Sequence[int | None] = ()) -> list[RowOutcome]:
        """Per row: the accepted drafts, then the sibling and the target's token after it
        on a sibling hit, else the target's token (the correction or the bonus).
        logprobs[i] (None: not wanted) asks for row i's emitted tokens' log-probabilities
        with that many alternatives each."""
        acc, nxt = self.num_accepted.tolist(), self.next_token.tolist()
        hit = self.sibling_hit.tolist()
        drafts, siblings = proposal.tokens.tolist(), proposal.siblings.tolist()
        out = []
        for i, a in enumerate(acc):
            # logits column of each emitted token: the chain's slots 0..a, or on a sibling
            # hit the break's slot a, then the sibling's own slot behind the chain
            if hit[i]:
                emitted = [*drafts[i][:a], siblings[i][a], nxt[i]]
                cols = [*range(a + 1), 1 + proposal.k + a]
            else:
                emitted = [*drafts[i][:a], nxt[i]]
                cols = list(range(a + 1))
            top = logprobs[i] if i < len(logprobs) else None
            lps = None
            if top is not None and self.logits is not None:
                lps = token_logprobs(self.logits[i, cols], emitted, top)
            out.append(RowOutcome(emitted, a, bool(hit[i]), lps))
        return out


class TargetVerifier:
    """The target model: scores a proposal in one forward and keeps what it accepts."""

    def __init__(self, target: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.base = decoder_stack(target)
        self.head = target.get_output_embeddings()
        self.softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        self.vocab = self.head.weight.shape[0]
        self._clock = clock  # seconds, after the device finished its queued work

    def verify(
        self, batch: RowBatch, proposal: Proposal, sampling: BatchSampling, want_argmax: bool
    ) -> Verdict:
        """Score the proposal for every row. The batch's last n_riding rows are new: their
        whole prompt and drafts go in as groups of their own (fresh caches) in the same
        forward (grouped_forward.py), read at the last k+1 positions."""
        t0 = self._clock()
        k, m = proposal.k, proposal.siblings.shape[1]
        n_all, dev = len(batch.rows), batch.device
        riding = batch.riding_groups(proposal.tokens[n_all - batch.n_riding :])
        b = n_all - batch.n_riding  # rows with a target cache
        cache_start = batch.target_kv.length
        last = torch.tensor([r.seq[-1] for r in batch.rows[:b]], device=dev).unsqueeze(1)
        ids = torch.cat([last, proposal.tokens[:b], proposal.siblings[:b]], dim=1)
        pos = tree_positions(batch.last_positions()[:b], k, m)
        real = torch.ones(b, k + 1 + m, dtype=torch.bool, device=dev)
        tree = tree_attention(k, m, dev) if m else None
        if riding:
            if m:
                raise RuntimeError("riding prefill does not take sibling drafts")
            mine = Group(batch.target_kv, ids, pos, real, tree)
            hidden, *new = forward_groups(self.base, [mine, *riding])
            hidden = torch.cat([hidden, *(h[:, -(k + 1) :] for h in new)])
        else:
            hidden = forward(self.base, batch.target_kv, ids, pos, real, tree)
        logits = self.head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        raw = logits  # log-probabilities report the target's own distribution
        if sampling.grammar is not None:  # constrained rows decide among what is allowed
            logits = mask_logits(logits, sampling.grammar.target_masks(logits.shape[1]))
        hit = torch.zeros(n_all, dtype=torch.bool, device=dev)
        argmax = None
        if sampling.all_greedy:
            argmax = greedy_tokens(logits)
            num_acc, hit, next_tok = verify_greedy_siblings(
                argmax, proposal.tokens, proposal.siblings
            )
        else:
            p = sampling.warp(logits)
            q = full_vocab_q(proposal.q, proposal.token_ids, self.vocab, n_all)
            num_acc, next_tok = sampling.verify(p, q, proposal.tokens)
            if want_argmax:
                argmax = greedy_tokens(logits)
        seconds = self._clock() - t0
        return Verdict(num_acc, next_tok, hit, argmax, cache_start, seconds, raw)

    def keep_accepted(self, batch: RowBatch, proposal: Proposal, verdict: Verdict) -> None:
        """The target cache keeps each row's last token and accepted drafts, and an
        accepted sibling's slot, which sits behind the chain's."""
        kv, b = batch.target_kv, len(batch.rows) - batch.n_riding
        kv.invalidate_tail(verdict.cache_start, verdict.num_accepted[:b] + 1)
        batch.land_riding(verdict.num_accepted[b:])  # the new rows' caches join
        if proposal.siblings.shape[1]:
            hit_rows = torch.nonzero(verdict.sibling_hit).squeeze(1)
            if hit_rows.numel():
                cols = verdict.cache_start + 1 + proposal.k + verdict.num_accepted[hit_rows]
                kv.mark_valid(hit_rows, cols)
