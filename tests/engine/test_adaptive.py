"""Adaptive k's cost model (adaptive.py: VerifyCost, relative_costs): pure decisions."""

from __future__ import annotations

import pytest
from slimspec.decoding.adaptive import RelativeCosts, VerifyCost, choose_k, relative_costs


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
    free = choose_k(0.75, 0.19, 1, 8)
    dear = choose_k(0.75, 0.19, 1, 8, verify_cost_per_token=0.1)
    assert (free, dear) == (3, 2)
    assert choose_k(0.9, 0.19, 1, 8, verify_cost_per_token=0.1) < choose_k(0.9, 0.19, 1, 8)
