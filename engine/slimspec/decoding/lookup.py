"""Lookup drafts: propose what followed the sequence's own last tokens earlier on.

Why: text repeats itself. Code recalls names, calls and docstrings from above; prose
repeats phrases; a greedy continuation falls into loops. Where the row's last n
tokens occurred before, what followed them then is a draft that costs no forward at
all (prompt lookup decoding, as transformers' `prompt_lookup_num_tokens`, vLLM's
n-gram proposer, llama.cpp's lookup). On the 2-core machines the draft model's k
forwards are a third of a step, so a step that verifies a lookup instead skips them.

The decoder takes a lookup step only where its expected tokens per unit of time beat
the draft's (`choose_lookup`), from acceptances measured per match length n. Those
are learnt on every step, lookup or not: after a draft step the emitted tokens show
what the lookup would have kept (`LookupAcceptance.observe_counterfactual`).

Exactness: a lookup draft is a deterministic proposal, q = a point mass on the
proposed token. Greedy and seeded (coupled) rows accept a token iff it is the
target's own choice; rejection-sampling rows accept it with probability p(token) and
otherwise sample norm(max(p - q, 0)) (sampling.py), so output stays the target's.
Pure decisions and a per-row index; the decoder does the forwards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slimspec.decoding.adaptive import (
    AcceptanceEstimate,
    RelativeCosts,
    expected_tokens,
    step_rate,
    step_tokens,
)
from slimspec.decoding.settings import count_setting

MAX_NGRAM = 8  # longest suffix matched; matches this long mostly repeat for many tokens
DEFAULT_LOOKUP_TOKENS = 12  # most tokens a lookup proposes (the cost model picks fewer)
ENV = "SLIMSPEC_LOOKUP_TOKENS"

# Per-token acceptance by match length n (1 .. MAX_NGRAM), measured on the default
# pair's greedy continuations of 250-token code and English prompts (docs/engine.md,
# "Lookup drafts"); the decoder's own counts take over within a few steps.
PRIOR_ALPHA = (0.44, 0.56, 0.68, 0.71, 0.7, 0.7, 0.7, 0.95)


def resolve_lookup_tokens(lookup_tokens: int | None, env: Mapping[str, str] | None = None) -> int:
    """The most tokens a lookup draft proposes; 0 turns lookup drafts off. None reads
    SLIMSPEC_LOOKUP_TOKENS from env (default: the process's; DEFAULT_LOOKUP_TOKENS where
    unset)."""
    env = os.environ if env is None else env
    return count_setting(lookup_tokens, env, "lookup_tokens", ENV, DEFAULT_LOOKUP_TOKENS, "off")


@dataclass
class NgramIndex:
    """For each n in 1..MAX_NGRAM: every n-gram of a sequence -> where the token after
    its latest occurrence sits. Grown as the sequence grows (`sync`), O(MAX_NGRAM) per
    token, so a lookup is MAX_NGRAM dict probes however long the sequence."""

    after: list[dict[tuple[int, ...], int]] = field(
        default_factory=lambda: [{} for _ in range(MAX_NGRAM)]
    )
    indexed: int = 0  # tokens of the sequence seen so far

    def sync(self, seq: Sequence[int]) -> None:
        """Index the tokens appended since the last call (seq only ever grows)."""
        for j in range(max(1, self.indexed), len(seq)):
            # the n-gram ending just before j is (so far, latest) followed by seq[j]
            for n in range(1, min(MAX_NGRAM, j) + 1):
                self.after[n - 1][tuple(seq[j - n : j])] = j
        self.indexed = len(seq)

    def continuation(self, seq: Sequence[int], length: int) -> tuple[list[int], int]:
        """(draft, n): what followed the longest earlier occurrence of seq's last n
        tokens, `length` tokens long, and n (0 and [] without a match). A continuation
        that runs into the sequence's end goes on copying from its own start, so a
        repeating pattern extends itself."""
        self.sync(seq)
        end = len(seq)
        for n in range(min(MAX_NGRAM, end - 1), 0, -1):
            start = self.after[n - 1].get(tuple(seq[end - n :]))
            if start is None:
                continue
            out: list[int] = []
            for i in range(length):
                at = start + i
                out.append(seq[at] if at < end else out[at - end])
            return out, n
        return [], 0


@dataclass
class LookupAcceptance:
    """Per-token acceptance of lookup drafts by match length n (decayed counts)."""

    by_n: list[AcceptanceEstimate] = field(
        default_factory=lambda: [AcceptanceEstimate.seeded(a) for a in PRIOR_ALPHA]
    )

    def alpha(self, n: int) -> float:
        """Acceptance of a draft from an n-token match (0 for no match)."""
        return 0.0 if n <= 0 else self.by_n[min(n, MAX_NGRAM) - 1].alpha

    def observe(self, n: int, accepted: int, drafted: int) -> None:
        """A verified lookup draft from an n-token match: `accepted` of `drafted` kept."""
        if n > 0 and drafted > 0:
            self.by_n[min(n, MAX_NGRAM) - 1].update(accepted, drafted)

    def observe_counterfactual(self, n: int, draft: Sequence[int], emitted: Sequence[int]) -> None:
        """After a step without the lookup: the row emitted `emitted`; `draft` is what the
        lookup would have proposed. It would have kept the common prefix; where all of
        the emitted tokens match, only that many are known (no rejection seen)."""
        if n <= 0 or not draft or not emitted:
            return
        kept = 0
        for d, e in zip(draft, emitted, strict=False):
            if d != e:
                break
            kept += 1
        seen = min(len(draft), len(emitted))
        # update() counts a rejection when accepted < drafted
        self.by_n[min(n, MAX_NGRAM) - 1].update(kept, kept + 1 if kept < seen else kept)


def lookup_step_rate(alphas: Sequence[float], length: int, costs: RelativeCosts) -> float:
    """Expected tokens per unit of time of a lookup step: every row verifies `length`
    lookup tokens (alpha 0: a row without a match gets the target's token only), no
    draft forward."""
    tokens = sum(expected_tokens(a, length) for a in alphas)
    return tokens / max(1e-12, costs.verify + length * costs.verify_per_token)


def choose_lookup(
    lookup_alphas: Sequence[float],
    draft_alphas: Sequence[float],
    draft_k: int,
    costs: RelativeCosts,
    max_tokens: int,
) -> int:
    """How many lookup tokens this step verifies, 0 for a draft step: the length with
    the most expected tokens per unit of time, if that beats the draft step's.

    In a batch, a lookup step also needs every row to expect at least as many tokens
    from its lookup draft as from the draft's k: every row verifies the same length,
    and rows without a good match wasted most of it (measured on 8 rows of mixed
    prompts: 8-token matches kept 312 of 317 tokens while rows without a match or with
    a 1-token one verified 674 tokens for 32, and the batch served 36 tokens/s against
    40.5 with the draft alone). Such rows' strong matches swap in instead (`swaps`)."""
    if max_tokens <= 0 or not any(a > 0 for a in lookup_alphas):
        return 0
    draft_tokens = [step_tokens(a, draft_k) for a in draft_alphas]
    best_len, best = 0, step_rate(draft_alphas, draft_k, costs)
    for length in range(1, max_tokens + 1):
        if len(lookup_alphas) > 1 and any(
            expected_tokens(a, length) < d for a, d in zip(lookup_alphas, draft_tokens, strict=True)
        ):
            continue
        rate = lookup_step_rate(lookup_alphas, length, costs)
        if rate > best + 1e-12:
            best_len, best = length, rate
    return best_len


@dataclass(frozen=True)
class LookupPlan:
    """Every row's lookup draft for a step, before the decision: max_tokens long ([]
    without a match), and the match length n it came from (0: none)."""

    drafts: list[list[int]]
    ns: list[int]

    def cut(self, length: int) -> list[list[int]]:
        return [d[:length] for d in self.drafts]


class LookupDrafts:
    """The decoder's lookup drafts: each step's plan, the decision against the draft
    step, and the acceptance learnt from what the rows emitted."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.acceptance = LookupAcceptance()

    def plan(self, seqs: Sequence[Sequence[int]], indexes: Sequence[NgramIndex]) -> LookupPlan:
        drafts, ns = [], []
        for seq, index in zip(seqs, indexes, strict=True):
            draft, n = index.continuation(seq, self.max_tokens)
            drafts.append(draft)
            ns.append(n)
        return LookupPlan(drafts, ns)

    def choose(
        self,
        plan: LookupPlan,
        draft_alphas: Sequence[float],
        draft_k: int,
        costs: RelativeCosts,
        max_tokens: int,
    ) -> int:
        """Lookup tokens this step verifies (0: the draft step), at most max_tokens."""
        return choose_lookup(
            self.alphas(plan), draft_alphas, draft_k, costs, min(max_tokens, self.max_tokens)
        )

    def swaps(
        self,
        plan: LookupPlan,
        k: int,
        draft_alphas: Sequence[float],
        compares_tokens: Sequence[bool],
    ) -> list[bool]:
        """In a draft step of k drafts: the rows that verify their lookup draft instead,
        where it is expected to keep more of its k tokens than the draft's (rows whose
        verification compares tokens only: greedy and seeded ones)."""
        return [
            ok and 0 < k <= len(d) and expected_tokens(lk, k) > expected_tokens(a, k)
            for d, lk, a, ok in zip(
                plan.drafts, self.alphas(plan), draft_alphas, compares_tokens, strict=True
            )
        ]

    def alphas(self, plan: LookupPlan) -> list[float]:
        """Each row's lookup acceptance, by its match length."""
        return [self.acceptance.alpha(n) for n in plan.ns]

    def learn(
        self,
        plan: LookupPlan,
        verified: Sequence[int],
        accepted: Sequence[int],
        emitted: Sequence[Sequence[int]],
    ) -> None:
        """After the step: the acceptance of the rows that verified `verified[i]` > 0 of
        their lookup draft's tokens, else what it would have kept of the tokens they
        emitted."""
        for i, n in enumerate(plan.ns):
            if verified[i] > 0:
                self.acceptance.observe(n, accepted[i], verified[i])
            else:
                self.acceptance.observe_counterfactual(n, plan.drafts[i], emitted[i])
