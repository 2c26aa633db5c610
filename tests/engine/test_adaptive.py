"""Adaptive k and its cost model (adaptive.py: best_k, VerifyCost, relative_costs): pure."""

from __future__ import annotations

import pytest
from slimspec.decoding.adaptive import (
    AcceptanceEstimate,
    RelativeCosts,
    VerifyCost,
    best_k,
    choose_batch_k,
    expected_tokens,
    relative_costs,
)


def one_row_k(
    alpha: float, draft: float, k_min: int = 1, per_token: float = 0.0, single: float = 1.0
) -> int:
    return best_k([alpha], RelativeCosts(draft, per_token, single), k_min, 8)


def test_verify_line_through_the_observed_token_counts():
    vc = VerifyCost()
    assert vc.line() is None
    vc.observe(5, 0.110)
    vc.observe(9, 0.142)  # measured here: 5 vs 9 tokens on the packed 1.5B target
    assert vc.line() == (pytest.approx(0.126), 0.0)  # flat until three counts were seen
    vc.observe(7, 0.126)
    intercept, slope = vc.line()
    assert slope == pytest.approx(0.008)
    assert intercept == pytest.approx(0.070)


def test_one_slow_step_does_not_tilt_the_line():
    """A 302 ms outlier among 150-180 ms steps (seen here) once made k stick at 1."""
    vc = VerifyCost()
    for tokens, seconds in [(2, 0.176), (3, 0.302), (4, 0.155), (5, 0.160), (6, 0.155)]:
        vc.observe(tokens, seconds)
    intercept, slope = vc.line()
    assert slope < 0.005
    assert 0.15 < intercept + slope < 0.18


def test_verify_line_is_an_ema_per_count_never_sloping_down_or_below_zero():
    vc = VerifyCost(decay=0.5)
    vc.observe(3, 0.2)
    vc.observe(3, 0.1)
    assert vc.by_tokens[3] == pytest.approx(0.15)
    vc.observe(8, 0.12)  # noise: more tokens timed faster
    vc.observe(12, 0.11)
    assert vc.line()[1] == 0.0
    steep = VerifyCost()
    for tokens in (4, 8, 16):  # compute-bound: time grows faster than linearly from 0
        steep.observe(tokens, 0.001 * tokens**2)
    intercept, slope = steep.line()
    assert intercept == 0.0 and slope == pytest.approx(0.008)


def test_one_token_steps_stay_off_the_line():
    vc = VerifyCost()
    vc.observe(5, 0.11)
    vc.observe_single(0.17)
    assert vc.line() == (pytest.approx(0.11), 0.0)
    assert vc.single_s == pytest.approx(0.17)


def test_one_token_steps_are_kept_per_batch_size():
    """A plain step of 8 rows costs about twice one of 1 row: the k-search and the
    ratio predictions read the measured step of the batch size at hand."""
    from slimspec.decoding.adaptive import CostModel

    cm = CostModel()
    cm.verify.observe(2, 0.10)
    cm.verify.observe(4, 0.14)
    cm.verify.observe(16, 0.40)
    cm.observe(0.0, 0.20, 0, None, 8, 8)  # a k = 0 step of 8 rows
    cm.observe(0.0, 0.09, 0, None, 1, 1)  # then one of 1 row
    assert cm.verify.single_seconds(8) == pytest.approx(0.20)
    assert cm.verify.single_seconds(1) == pytest.approx(0.09)
    assert cm.verify.single_seconds(4) is None
    unit8 = cm.verify.line()[0] + cm.verify.line()[1] * 8
    assert cm.relative_costs(8).single == pytest.approx(0.20 / unit8)
    # an unmeasured size falls back to the running average over every size
    unit4 = cm.verify.line()[0] + cm.verify.line()[1] * 4
    assert cm.verify.single_s == pytest.approx(0.8 * 0.20 + 0.2 * 0.09)
    assert cm.relative_costs(4).single == pytest.approx(cm.verify.single_s / unit4)


def test_relative_costs_in_units_of_a_one_token_verification():
    assert relative_costs(None, 1, 0.2, None) == RelativeCosts(0.2, 0.0, 0.75)
    costs = relative_costs((0.070, 0.008), 1, 0.19, 0.156)
    assert costs.verify_per_token == pytest.approx(0.008 / 0.078)
    assert costs.single == pytest.approx(2.0)
    # two rows: the unit is a one-token step of both, each draft token adds two tokens
    two = relative_costs((0.070, 0.008), 2, 0.19, None)
    assert two.verify_per_token == pytest.approx(0.016 / 0.086)
    assert two.single == 0.75


def test_dear_verification_means_fewer_drafts():
    """With the draft at 0.19 of a step and acceptance 0.75, free verification says
    k = 3; at the slope measured here (~0.1 of a step per token) k = 2 is faster."""
    free = one_row_k(0.75, 0.19)
    dear = one_row_k(0.75, 0.19, per_token=0.1)
    assert (free, dear) == (3, 2)
    assert one_row_k(0.9, 0.19, per_token=0.1) < one_row_k(0.9, 0.19)


def test_one_row_k():
    assert expected_tokens(0.5, 1) == 1.5
    assert one_row_k(0.95, 0.1) >= 5  # cheap draft, high acceptance: draft far
    assert one_row_k(0.3, 0.5) == 1
    assert one_row_k(0.3, 0.5, k_min=0, single=0.7) == 0  # drafting does not pay
    assert one_row_k(0.9, 0.1, k_min=0, single=0.7) > 0


def test_batch_k_maximises_the_whole_batch_rate_not_the_best_row():
    """One eager row and seven reluctant ones: the largest of the rows' choices would
    draft deep for all eight and pay every extra verified token eight times."""
    costs = RelativeCosts(draft=0.05, verify_per_token=0.08, single=1.0)
    alphas = [0.95] + [0.4] * 7
    k = choose_batch_k(alphas, [0] * 8, costs, 1, 8)
    own = [one_row_k(a, 0.05, per_token=0.08) for a in alphas]
    assert k < max(own)

    def rate(k: int) -> float:
        return sum(expected_tokens(a, k) for a in alphas) / (1 + k * (0.05 + 0.08))

    assert rate(k) == max(rate(j) for j in range(1, 9))
    # one row: its own choice; k = 0 unless a row is due to probe
    assert choose_batch_k([0.7], [0], costs, 1, 8) == one_row_k(0.7, 0.05, per_token=0.08)
    bad = RelativeCosts(draft=2.0, verify_per_token=0.5, single=1.0)
    assert choose_batch_k([0.1, 0.1], [0, 0], bad, 0, 8) == 0
    assert choose_batch_k([0.1, 0.1], [0, 8], bad, 0, 8) == 1


def test_a_seeded_estimate_starts_at_the_decoders_acceptance_and_yields_to_the_row():
    assert AcceptanceEstimate.seeded(2 / 3).alpha == pytest.approx(AcceptanceEstimate().alpha)
    seeded = AcceptanceEstimate.seeded(0.9)
    assert seeded.alpha == pytest.approx(0.9)
    # Where drafting pays at 0.9 and not at the fixed prior, the seeded row drafts at once.
    costs = RelativeCosts(0.5, 0.2, 1.0)
    assert best_k([AcceptanceEstimate().alpha], costs, 0, 8) == 0
    assert best_k([seeded.alpha], costs, 0, 8) >= 2
    # The seed weighs as little as the fixed prior: one step of a row that accepts
    # nothing brings it below the fixed prior's 0.67.
    seeded.update(0, 4)
    assert seeded.alpha < 0.67
