"""Adaptive number of draft tokens per request (pure decisions)."""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per verification with k drafts and i.i.d. acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_k(
    alpha: float,
    draft_cost: float,
    k_min: int = 1,
    k_max: int = 8,
    verify_cost_per_token: float = 0.0,
    single_cost: float = 1.0,
) -> int:
    """k maximising expected tokens per unit time.

    Time of a step = k * draft_cost + 1 + k * verify_cost_per_token, in units of a
    multi-token verification (draft_cost = draft forward / verification). k = 0
    (allowed when k_min == 0) is a plain one-token target step costing single_cost:
    worth it when acceptance is too low for drafting to pay.
    """
    best_k, best = k_min, -1.0
    for k in range(k_min, k_max + 1):
        if k == 0:
            rate = 1.0 / max(1e-6, single_cost)
        else:
            cost = k * draft_cost + 1.0 + k * verify_cost_per_token
            rate = expected_tokens(alpha, k) / cost
        if rate > best + 1e-12:
            best_k, best = k, rate
    return best_k


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

    @property
    def alpha(self) -> float:
        # Truncated-geometric MLE: accepted / (accepted + rejections); capped below 1.
        return min(0.98, self.accepted / max(1e-9, self.accepted + self.rejected))
