"""Adaptive number of draft tokens: pure decisions, and the cost model they read.

k maximises expected tokens per unit of time. Acceptance comes from each row's
decayed counts (AcceptanceEstimate); time comes from the steps so far (CostModel):
verification seconds against the number of tokens verified, and a draft forward over
the batch's one-token verification.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_COUNTS = 3  # distinct verified-token counts before the verification line gets a slope
PROBE_EVERY = 8  # a row that chose k = 0 this many steps in a row drafts once to re-measure


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verification with k drafts and i.i.d. acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def draft_forward_seconds(draft_s: float, k: int, catch_up_s: float | None) -> float | None:
    """Time of one more draft token, from a draft phase of k forwards that took draft_s.

    catch_up_s is the first forward's time when it also fed a backlog (tokens emitted
    by k = 0 steps): that forward says nothing about the marginal draft token, so it is
    left out, and with k = 1 the phase gives no sample at all (None). Counting it made
    drafting look dear after a few k = 0 steps and kept k at 0 for good.
    """
    if k <= 0:
        return None
    if catch_up_s is None:
        return draft_s / k
    if k == 1:
        return None
    return max(0.0, draft_s - catch_up_s) / (k - 1)


@dataclass
class AcceptanceEstimate:
    """Decayed counts of accepted vs rejected draft tokens -> per-token acceptance alpha."""

    accepted: float = 2.0  # prior: alpha = 0.67 from 3 pseudo-observations
    rejected: float = 1.0
    decay: float = 0.9

    def update(self, num_accepted: int, num_drafted: int) -> None:
        rejected = 1.0 if num_accepted < num_drafted else 0.0
        self.accepted = self.accepted * self.decay + num_accepted
        self.rejected = self.rejected * self.decay + rejected

    @classmethod
    def seeded(cls, alpha: float, weight: float = 3.0) -> AcceptanceEstimate:
        """A joining row's estimate: it starts at `alpha` (the decoder's acceptance so
        far) with the fixed prior's weight, so the row's own steps take over as fast.

        Why: started at the fixed 0.67, the rows of a pair that accepts 0.87 drafted in
        few steps of their life; on 24-token requests at 3 clients most steps were
        plain target steps, so a cheaper head changed few steps (ratio 0 -> 0.9 served
        +3-7% where the ratio model, which drafts every step, predicted +5-9%).
        Started here, the steps draft as the model says (0 -> 0.9: +9.3% served, +8%
        predicted) at the same rate as before at the default ratio (26.1 tokens/s both).
        """
        a = min(0.98, max(0.0, alpha))
        return cls(accepted=a * weight, rejected=(1.0 - a) * weight)

    @property
    def alpha(self) -> float:
        # Truncated-geometric MLE: accepted / (accepted + rejections); capped below 1.
        return min(0.98, self.accepted / max(1e-9, self.accepted + self.rejected))


@dataclass
class VerifyCost:
    """Seconds of a target forward against the number of tokens it verifies (rows x
    tokens each): an EMA per observed count and a robust line through them (`line`).

    Why: on CPU, verifying more tokens is not free, so the k that maximises tokens per
    second depends on the slope. One-token target steps (k = 0) are kept apart in
    `single_s`: they may take another kernel path (a packed oneDNN linear can be slower
    at one row than at five), so they do not bend the line. Figures: docs/engine.md,
    benchmark section.
    """

    decay: float = 0.8
    by_tokens: dict[int, float] = field(default_factory=dict)
    single_s: float | None = None  # a running average over every batch size
    single_by_rows: dict[int, float] = field(default_factory=dict)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe(self, tokens: int, seconds: float) -> None:
        self.by_tokens[tokens] = self._ema(self.by_tokens.get(tokens), seconds)

    def observe_single(self, seconds: float, rows: int | None = None) -> None:
        self.single_s = self._ema(self.single_s, seconds)
        if rows is not None:
            self.single_by_rows[rows] = self._ema(self.single_by_rows.get(rows), seconds)

    def single_seconds(self, rows: int) -> float | None:
        """A plain one-token step of `rows` rows as measured at that batch size (an
        8-row step takes about twice a 1-row one here, so another size's is no guide)."""
        return self.single_by_rows.get(rows)

    def line(self) -> tuple[float, float] | None:
        """(intercept >= 0, slope >= 0) in seconds and seconds per token; None before any
        timing. Flat through the mean until MIN_COUNTS token counts were seen, then
        Theil-Sen (median of pairwise slopes): one slow outlier step must not tilt the
        line and pin k at 1."""
        if not self.by_tokens:
            return None
        pts = sorted(self.by_tokens.items())
        if len(pts) < MIN_COUNTS:
            return statistics.fmean(y for _, y in pts), 0.0
        slopes = [
            (y2 - y1) / (t2 - t1) for i, (t1, y1) in enumerate(pts) for t2, y2 in pts[i + 1 :]
        ]
        slope = max(0.0, statistics.median(slopes))  # more tokens never cost less
        intercept = statistics.median(y - slope * t for t, y in pts)
        if intercept < 0:  # physically a forward has a fixed cost; refit through 0
            return 0.0, statistics.median(y / t for t, y in pts)
        return intercept, slope


def one_token_seconds(line: tuple[float, float] | None, rows: int) -> float | None:
    """A verification of one token per row for `rows` rows, read off a VerifyCost line:
    the unit of `RelativeCosts` (None without a line or a positive time)."""
    if line is None:
        return None
    seconds = line[0] + line[1] * rows
    return seconds if seconds > 0 else None


@dataclass(frozen=True)
class RelativeCosts:
    """What a step costs, in any one unit of time (`relative_costs`: the batch's
    one-token verification, so `verify` is 1): a draft forward over the batch, each
    drafted token's share of the verification on top of `verify`, and a plain one-token
    target step (k = 0)."""

    draft: float
    verify_per_token: float
    single: float
    verify: float = 1.0

    def step(self, k: int) -> float:
        """A step of k drafts per row: k draft forwards and the verification of k + 1
        tokens per row (k = 0: a plain target step)."""
        if k == 0:
            return self.single
        return k * self.draft + self.verify + k * self.verify_per_token


def best_k(alphas: Sequence[float], costs: RelativeCosts, k_min: int, k_max: int) -> int:
    """The k in k_min..k_max with the most expected tokens per unit of time over the rows
    (ties: the smaller k): the one k-search, for adaptive k (`choose_batch_k`) and the
    ratio model's predictions (ratio_model.py).

    One draft forward per depth serves every row and every row verifies k + 1 tokens,
    so the batch shares one cost and the rows' acceptances add up:
    sum_rows E[tokens | alpha_row, k] / costs.step(k); k = 0 emits one token per row.
    """
    chosen, best = k_min, -1.0
    for k in range(k_min, k_max + 1):
        rate = step_rate(alphas, k, costs)
        if rate > best + 1e-12:
            chosen, best = k, rate
    return chosen


def step_tokens(alpha: float, k: int) -> float:
    """Expected tokens a row emits from a step of k drafts (k = 0: the one target token)."""
    return 1.0 if k == 0 else expected_tokens(alpha, k)


def step_rate(alphas: Sequence[float], k: int, costs: RelativeCosts) -> float:
    """Expected tokens per unit of time of a step of k drafts over rows of these
    acceptances (`best_k` searches k by it; lookup.py weighs lookup steps against it)."""
    return sum(step_tokens(a, k) for a in alphas) / max(1e-12, costs.step(k))


def relative_costs(
    line: tuple[float, float] | None,
    rows: int,
    draft_ratio: float,
    single_s: float | None,
    single_prior: float = 0.75,
) -> RelativeCosts:
    """Turn a verification line (seconds vs rows x tokens) into `RelativeCosts`.

    The unit is the line at one token per row (`one_token_seconds`); verifying k + 1
    tokens per row then costs 1 + k * verify_per_token. draft_ratio is already a draft
    forward over that unit; single is a k = 0 step over it (single_prior until one was
    timed).
    """
    unit = one_token_seconds(line, rows)
    if line is None or unit is None:
        return RelativeCosts(draft_ratio, 0.0, single_prior)
    single = single_prior if single_s is None else single_s / unit
    return RelativeCosts(draft_ratio, line[1] * rows / unit, single)


def choose_batch_k(
    alphas: Sequence[float],
    idle_steps: Sequence[int],
    costs: RelativeCosts,
    k_min: int,
    k_max: int,
    probe_every: int = PROBE_EVERY,
) -> int:
    """Adaptive k for the batch: `best_k` over the rows' acceptances. (The largest of the
    rows' own choices over-drafted for every row that accepts less, and a batched
    verification pays for each of those tokens.) k = 0 (a plain target step, one token
    per row) only where k_min allows it and no row is due to probe: a row that chose 0
    for probe_every steps drafts, to re-measure its acceptance with the k drafting
    would use rather than a lone token.
    """
    lo = k_min
    if lo == 0 and any(idle >= probe_every for idle in idle_steps):
        lo = 1
    return best_k(alphas, costs, max(lo, 0), k_max)


class CostModel:
    """What a step costs, learnt from the steps so far: the verification line
    (VerifyCost) and draft_ratio, an EMA of a draft forward over the batch's one-token
    verification."""

    def __init__(self, draft_ratio: float = 0.3) -> None:
        self.verify = VerifyCost()
        self.draft_ratio = draft_ratio

    def marginal_seconds(self, tokens: int, cap: float) -> float:
        """What `tokens` more slots add to a target forward, by the verification line's
        slope (at most cap): the riding prompts' share of a verification."""
        line = self.verify.line()
        return 0.0 if line is None or tokens <= 0 else min(cap, line[1] * tokens)

    def relative_costs(self, rows: int) -> RelativeCosts:
        """The k-search's cost inputs for a batch of `rows` rows."""
        single = self.verify.single_seconds(rows)
        single = self.verify.single_s if single is None else single
        return relative_costs(self.verify.line(), rows, self.draft_ratio, single)

    def observe_verification(self, target_s: float, tokens: int) -> None:
        """A verification of lookup drafts (lookup.py): a point on the line, and no
        draft phase to learn from."""
        if target_s > 0 and tokens > 0:
            self.verify.observe(tokens, target_s)

    def observe(
        self,
        draft_s: float,
        target_s: float,
        k: int,
        catch_up_s: float | None,
        tokens: int,
        rows: int,
        riding_tokens: int = 0,
    ) -> None:
        """One step's timing: a draft phase of k forwards (catch_up_s: see
        draft_forward_seconds) and a verification of `tokens` tokens over `rows` rows,
        whose forward also carried `riding_tokens` slots of new prompts (they are tokens
        of the forward like any other, so they count on the line)."""
        if target_s <= 0:
            return
        if k == 0:
            if riding_tokens:
                self.verify.observe(tokens + riding_tokens, target_s)
            else:
                self.verify.observe_single(target_s, rows)
            return
        self.verify.observe(tokens + riding_tokens, target_s)
        per_forward = draft_forward_seconds(draft_s, k, catch_up_s)
        unit = one_token_seconds(self.verify.line(), rows)
        if per_forward is not None and unit is not None:
            self.draft_ratio = 0.8 * self.draft_ratio + 0.2 * per_forward / unit
