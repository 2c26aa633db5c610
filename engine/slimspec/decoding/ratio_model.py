"""What each compression ratio costs and buys: pure predictions from measured inputs.

A speculative step at ratio r drafts k tokens (k forwards of the draft body plus the
ratio's head) and verifies them in one target forward; it emits the accepted drafts
plus one token. So the decode rate at ratio r is

    rows * E[tokens | alpha_r, k] / (k * (body + head_r) + verify(rows * (k + 1)) + other)

with k the best k (as adaptive k picks it), verify the measured verification line,
and alpha_r the per-token acceptance at r. The shadow check measures kept_r, the share
of the full head's matches the ratio-r head keeps, so alpha_r = alpha_full * kept_r:
the ratio-r accepted length follows from the full head's through the same geometric
model adaptive k uses. Target-only decoding is one-token steps of every row (the
line at one token per row, plus `other`), so the speed-up is the decode rate over that.

`other` is the measured rest of a step: its wall time minus the draft phase and the
verification (admission and prefill, riding prefill's share of the verify forward,
sampling, bookkeeping, the shadow check). No ratio changes it, so it dilutes what a
cheaper head saves: without it the model predicted 1.18x for ratio 0.8 at 8 clients
where 1.07x was served.

Adaptive k may pick k = 0 (plain target steps) where drafting does not pay, as it
does at 8 clients on a 2-core CPU; then only every PROBE_EVERY-th step drafts (to
re-measure acceptance), and a ratio changes only those probes. The prediction runs
that mix, so the knob is predicted to do next to nothing there (the model that forced
k >= 1 predicted 1.18x for ratio 0.8 at 8 clients where 1.03x was served).

A larger ratio helps only where the head is a large share of the draft step and the
acceptance it loses costs less than the time it saves; `assess` says whether any
ratio beats ratio 0 by more than the model's uncertainty, and why not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from slimspec.decoding.adaptive import PROBE_EVERY, RelativeCosts, best_k, expected_tokens

MIN_UNCERTAINTY = 0.03  # relative: step-time noise the model cannot see (drift, contention)
PRIOR_KEPT_SE = 0.05  # standard error of a kept acceptance that was not measured here
MAX_ALPHA = 0.98  # as AcceptanceEstimate caps it

REASON_HELPS = "helps"
REASON_HEAD_SMALL = "head_share_small"
REASON_ACCEPTANCE = "acceptance_loss"
REASON_NOT_MEASURED = "not_measured"
REASONS = (REASON_HELPS, REASON_HEAD_SMALL, REASON_ACCEPTANCE, REASON_NOT_MEASURED)


@dataclass(frozen=True)
class StepCosts:
    """Measured costs of a step for the current batch: seconds per draft forward of the
    body, per ratio of the head, and the verification line (intercept s, slope s per
    verified token)."""

    rows: int
    body_s: float
    head_s: Mapping[float, float]
    verify_line: tuple[float, float]
    other_s: float = 0.0  # per step, neither draft nor verification (measured)
    single_s: float | None = None  # a plain one-token target step (k = 0), measured
    k_min: int = 1  # 0 where adaptive k may skip drafting (the engine's default)


@dataclass(frozen=True)
class Acceptance:
    """Per-token acceptance of the full head, and per ratio the kept share of it with
    its standard error (kept 1.0, se 0 at ratio 0)."""

    alpha_full: float
    kept: Mapping[float, float]
    kept_se: Mapping[float, float]


@dataclass(frozen=True)
class RatioPoint:
    """The prediction for one ratio."""

    ratio: float
    k: int
    accepted_length: float  # tokens per verification
    step_s: float
    tokens_per_s: float
    speedup: float  # over target-only
    speedup_low: float  # with kept at its lower bound (kept - 2 se)
    head_share: float  # head / (body + head) of a draft forward
    other_share: float = 0.0  # the step's time that is neither draft nor verification


@dataclass(frozen=True)
class Assessment:
    best: float  # the ratio to run; 0.0 when compression cannot help
    can_help: bool
    reason: str
    margin: float  # the relative uncertainty the decision used


def verify_seconds(line: tuple[float, float], tokens: int) -> float:
    return line[0] + line[1] * tokens


def plain_step_seconds(line: tuple[float, float], rows: int, single_s: float | None) -> float:
    """A one-token target step of `rows` rows: measured where it was, else off the line."""
    return verify_seconds(line, rows) if single_s is None else single_s


def best_k_rate(
    alpha: float,
    draft_s: float,
    line: tuple[float, float],
    rows: int,
    k_max: int,
    fixed_k: int | None = None,
    k_min: int = 1,
    single_s: float | None = None,
) -> tuple[int, float, float]:
    """(k, tokens per step per row, step seconds) at the k adaptive k would pick (the
    shared k-search, adaptive.best_k, in seconds: every row at acceptance alpha).

    k = 0 (only with k_min 0) is the steady mix adaptive k runs then: PROBE_EVERY plain
    target steps (single_s each; the line at one token when not measured) and one
    probe step at the best k >= 1, averaged per step."""
    single = plain_step_seconds(line, rows, single_s)
    costs = RelativeCosts(draft_s, line[1] * rows, single, verify=verify_seconds(line, rows))
    if fixed_k is not None:
        return fixed_k, expected_tokens(alpha, fixed_k), costs.step(fixed_k)
    k = best_k([alpha] * rows, costs, max(0, k_min), max(1, k_max))
    if k > 0:
        return k, expected_tokens(alpha, k), costs.step(k)
    probe = best_k([alpha] * rows, costs, 1, max(1, k_max))
    n = PROBE_EVERY
    length = (n + expected_tokens(alpha, probe)) / (n + 1)
    return 0, length, (n * costs.step(0) + costs.step(probe)) / (n + 1)


def target_only_rate(
    line: tuple[float, float], rows: int, other_s: float = 0.0, single_s: float | None = None
) -> float:
    """Tokens/s of plain decoding of `rows` rows: one-token steps (single_s each where
    measured, else read off the line), each with the same per-step rest `other_s`
    (admission, sampling, bookkeeping)."""
    step = plain_step_seconds(line, rows, single_s) + other_s
    return rows / step if step > 0 else 0.0


def _alpha(acc: Acceptance, kept: float) -> float:
    return min(MAX_ALPHA, max(0.0, acc.alpha_full * kept))


def predict(
    costs: StepCosts, acc: Acceptance, k_max: int, fixed_k: int | None = None
) -> dict[float, RatioPoint]:
    """The prediction for every ratio that has a head time (kept 1.0 where unknown)."""
    other = max(0.0, costs.other_s)
    base = target_only_rate(costs.verify_line, costs.rows, other, costs.single_s)
    out: dict[float, RatioPoint] = {}
    for r in sorted(costs.head_s):
        head = costs.head_s[r]
        draft = costs.body_s + head
        # A kept share above 1 (the subset head agreeing more often than the full one)
        # is a small-sample accident, not a gain to plan on: 1.26 from few shadowed
        # positions once predicted 2.55x at 0.95 against 1.57x at 0.9.
        kept = min(1.0, acc.kept.get(r, 1.0))
        # k as adaptive k picks it (it does not see `other`); the step pays `other` on top
        k, length, step = best_k_rate(
            _alpha(acc, kept), draft, costs.verify_line, costs.rows, k_max, fixed_k,
            costs.k_min, costs.single_s,
        )  # fmt: skip
        step += other
        rate = costs.rows * length / step if step > 0 else 0.0
        low_kept = max(0.0, kept - 2.0 * acc.kept_se.get(r, PRIOR_KEPT_SE if r > 0 else 0.0))
        _, low_len, low_step = best_k_rate(
            _alpha(acc, low_kept), draft, costs.verify_line, costs.rows, k_max, fixed_k,
            costs.k_min, costs.single_s,
        )  # fmt: skip
        low_step += other
        low_rate = costs.rows * low_len / low_step if low_step > 0 else 0.0
        out[r] = RatioPoint(
            ratio=r,
            k=k,
            accepted_length=length,
            step_s=step,
            tokens_per_s=rate,
            speedup=rate / base if base > 0 else 0.0,
            speedup_low=low_rate / base if base > 0 else 0.0,
            head_share=head / draft if draft > 0 else 0.0,
            other_share=other / step if step > 0 else 0.0,
        )
    return out


def assess(
    points: Mapping[float, RatioPoint],
    free_acceptance: Mapping[float, RatioPoint],
    margin: float = MIN_UNCERTAINTY,
) -> Assessment:
    """Whether a ratio > 0 beats ratio 0 by more than the uncertainty, and which to run.

    A ratio helps when even its lower bound (kept acceptance 2 standard errors down) is
    faster than ratio 0 by more than `margin`. `free_acceptance` is the same prediction
    with every kept share at 1: if no ratio helps even there, the head is too small a
    share of the step to matter (head_share_small); otherwise the acceptance lost is
    what eats the gain (acceptance_loss). The ratio to run is, of the ratios within
    the margin of the fastest, the smallest (the least acceptance at stake); 0.0 when
    nothing helps.
    """
    if 0.0 not in points:
        return Assessment(0.0, False, REASON_NOT_MEASURED, margin)
    s0 = points[0.0].speedup
    helps = [r for r, p in points.items() if r > 0 and p.speedup_low > s0 * (1 + margin)]
    if not helps:
        free = [r for r, p in free_acceptance.items() if r > 0 and p.speedup > s0 * (1 + margin)]
        reason = REASON_ACCEPTANCE if free else REASON_HEAD_SMALL
        return Assessment(0.0, False, reason, margin)
    top = max(p.speedup for p in points.values())
    near = [r for r, p in points.items() if r > 0 and p.speedup * (1 + margin) >= top]
    return Assessment(min([r for r in near if r in helps] or helps), True, REASON_HELPS, margin)


def kept_standard_error(kept: float, samples: int) -> float:
    """Binomial standard error of a kept share from `samples` shadowed positions."""
    if samples <= 0:
        return PRIOR_KEPT_SE
    p = min(1.0, max(0.0, kept))
    return math.sqrt(max(p * (1 - p), 0.25 / samples) / samples)


def material_change(old: Mapping[float, float], new: Mapping[float, float], rel: float) -> bool:
    """Whether any ratio's predicted speed-up moved by more than `rel` (relative), or the
    set of ratios changed: the decoder logs its predictions again then."""
    if set(old) != set(new):
        return True
    return any(abs(new[r] - old[r]) > rel * max(1e-9, abs(old[r])) for r in old)
