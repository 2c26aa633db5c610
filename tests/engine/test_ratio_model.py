"""What each ratio costs and buys (decoding/ratio_model.py): pure predictions."""

from __future__ import annotations

import pytest
from slimspec.decoding.ratio_model import (
    REASON_ACCEPTANCE,
    REASON_HEAD_SMALL,
    REASON_HELPS,
    REASON_NOT_MEASURED,
    Acceptance,
    StepCosts,
    assess,
    best_k_rate,
    kept_standard_error,
    material_change,
    predict,
    target_only_rate,
)

RATIOS = (0.0, 0.3, 0.5, 0.8, 0.9, 0.95)
VERIFY = (0.160, 0.004)  # a packed 1.5B target: ~0.16 s a verification, a little per token


def head_times(full_s: float) -> dict[float, float]:
    """A subset head's time is about its share of the rows (memory-bound)."""
    return {r: full_s * (1 - r) + 1e-5 for r in RATIOS}


def acceptance(kept: dict[float, float], se: float = 0.01) -> Acceptance:
    return Acceptance(0.75, {0.0: 1.0, **kept}, {0.0: 0.0, **{r: se for r in kept}})


KEPT = {0.3: 1.0, 0.5: 0.99, 0.8: 0.97, 0.9: 0.96, 0.95: 0.94}


def decide(costs: StepCosts, acc: Acceptance):
    pts = predict(costs, acc, k_max=8)
    free = predict(costs, Acceptance(acc.alpha_full, {}, {r: 0.0 for r in RATIOS}), k_max=8)
    return pts, assess(pts, free)


def test_head_heavy_bf16_draft_a_larger_ratio_helps():
    # bf16 draft: 40 ms of body, a 16 ms full head (docs/engine.md's profile)
    costs = StepCosts(1, 0.040, head_times(0.016), VERIFY)
    pts, a = decide(costs, acceptance(KEPT))
    assert pts[0.8].speedup > pts[0.0].speedup * 1.05
    assert pts[0.0].head_share == pytest.approx(0.016 / 0.056, rel=1e-3)
    assert a.can_help and a.reason == REASON_HELPS and a.best > 0.0
    # and the speed-up is over target-only: speculation pays at every ratio here
    assert all(p.speedup > 1.0 for p in pts.values())


def test_int4_draft_with_a_small_head_cannot_help():
    # int4 draft: a ~1 ms head of a ~13 ms step; the cheaper head buys under 1%
    costs = StepCosts(1, 0.012, head_times(0.001), VERIFY)
    pts, a = decide(costs, acceptance(KEPT))
    assert not a.can_help and a.best == 0.0
    assert a.reason == REASON_HEAD_SMALL
    assert pts[0.95].speedup < pts[0.0].speedup  # the acceptance it loses costs more


def test_acceptance_loss_reason_when_a_free_head_would_help():
    costs = StepCosts(1, 0.040, head_times(0.016), VERIFY)
    lossy = acceptance({r: 0.80 for r in KEPT if r > 0})
    _, a = decide(costs, lossy)
    assert not a.can_help and a.reason == REASON_ACCEPTANCE and a.best == 0.0


def test_uncertain_kept_acceptance_does_not_count_as_help():
    """The same head-heavy draft, but the kept shares rest on a handful of samples: the
    lower bound no longer beats ratio 0 by the margin."""
    costs = StepCosts(1, 0.040, head_times(0.016), VERIFY)
    _, sure = decide(costs, acceptance(KEPT, se=0.005))
    _, unsure = decide(costs, acceptance(KEPT, se=0.08))
    assert sure.can_help and not unsure.can_help


def test_best_is_the_smallest_of_the_near_fastest_ratios():
    costs = StepCosts(1, 0.040, head_times(0.016), VERIFY)
    pts, a = decide(costs, acceptance(dict.fromkeys(KEPT, 1.0), se=0.0))
    top = max(p.speedup for p in pts.values())
    assert pts[a.best].speedup * (1 + a.margin) >= top
    assert all(pts[r].speedup * (1 + a.margin) < top for r in pts if 0 < r < a.best)


def test_batch_size_changes_the_prediction():
    """At 8 rows the verification is dearer (more tokens), so the draft step is a
    smaller share of a step and the head matters less."""
    one = predict(StepCosts(1, 0.04, head_times(0.016), (0.16, 0.004)), acceptance(KEPT), 8)
    eight = predict(StepCosts(8, 0.05, head_times(0.018), (0.16, 0.004)), acceptance(KEPT), 8)
    gain = lambda p: p[0.8].speedup / p[0.0].speedup  # noqa: E731
    assert gain(eight) < gain(one)
    assert target_only_rate((0.16, 0.004), 8) == pytest.approx(8 / 0.192)


def test_a_kept_share_above_one_is_not_a_gain_to_plan_on():
    """A shadow estimate above 1 from few positions (seen: 1.26 at 0.95) predicts no more
    than full acceptance, so it cannot make a ratio look far faster than its neighbours
    and pull the tuner's best ratio to it."""
    costs = StepCosts(1, 0.040, head_times(0.016), VERIFY)
    noisy = {**KEPT, 0.9: 1.0, 0.95: 1.26}
    pts, a = decide(costs, acceptance(noisy, se=0.1))
    capped, a_capped = decide(costs, acceptance({**noisy, 0.95: 1.0}, se=0.1))
    assert pts[0.95].speedup == pytest.approx(capped[0.95].speedup)
    assert a.best == a_capped.best
    assert pts[0.95].speedup < pts[0.9].speedup * 1.05  # a head saving only, no jump
    assert pts[0.95].accepted_length == pytest.approx(pts[0.9].accepted_length)


def test_best_k_follows_the_cost_model():
    k, length, step = best_k_rate(0.9, 0.005, (0.1, 0.0), 1, 8)
    assert length == pytest.approx((1 - 0.9**9) / 0.1)
    assert k == 8 and step == pytest.approx(0.14)
    k, _, _ = best_k_rate(0.3, 0.05, (0.1, 0.0), 1, 8)
    assert k == 1
    assert best_k_rate(0.9, 0.005, (0.1, 0.0), 1, 8, fixed_k=3)[0] == 3


def test_the_ratio_model_predicts_the_k_adaptive_k_picks():
    """One k-search: for the same measured costs the prediction runs the k the engine
    would choose, on a sloped line and several rows too."""
    from slimspec.decoding.adaptive import choose_batch_k, one_token_seconds, relative_costs

    line = (0.070, 0.008)
    for rows, alpha, draft_s in [(1, 0.75, 0.015), (4, 0.9, 0.01), (8, 0.5, 0.03)]:
        unit = one_token_seconds(line, rows)
        assert unit is not None
        costs = relative_costs(line, rows, draft_s / unit, None)
        adaptive = choose_batch_k([alpha] * rows, [0] * rows, costs, 1, 8)
        assert best_k_rate(alpha, draft_s, line, rows, 8)[0] == adaptive
    # and with plain target steps allowed (the engine's default, k_min 0)
    chosen = set()
    for rows, alpha, draft_s in [(1, 0.75, 0.015), (8, 0.5, 0.03), (8, 0.3, 0.08)]:
        unit = one_token_seconds(line, rows)
        assert unit is not None
        single = 0.9 * unit
        costs = relative_costs(line, rows, draft_s / unit, single)
        adaptive = choose_batch_k([alpha] * rows, [0] * rows, costs, 0, 8)
        k = best_k_rate(alpha, draft_s, line, rows, 8, k_min=0, single_s=single)[0]
        assert k == adaptive
        chosen.add(k)
    assert 0 in chosen and len(chosen) > 1


def test_not_measured_without_ratio_zero():
    assert assess({}, {}).reason == REASON_NOT_MEASURED


def test_kept_standard_error_and_material_change():
    assert kept_standard_error(0.9, 0) > kept_standard_error(0.9, 100) > 0
    assert kept_standard_error(1.0, 400) > 0  # never claims certainty
    assert not material_change({0.0: 2.0, 0.8: 2.1}, {0.0: 2.02, 0.8: 2.1}, 0.05)
    assert material_change({0.0: 2.0, 0.8: 2.1}, {0.0: 2.0, 0.8: 2.5}, 0.05)
    assert material_change({0.0: 2.0}, {0.0: 2.0, 0.8: 2.1}, 0.05)


def test_the_rest_of_a_step_dilutes_what_a_cheaper_head_buys():
    # The same bf16 profile, with a measured 60 ms per step that is neither draft
    # nor verification (prefill, sampling, upkeep): the gain from 0.8 shrinks.
    bare = StepCosts(8, 0.040, head_times(0.016), VERIFY)
    diluted = StepCosts(8, 0.040, head_times(0.016), VERIFY, other_s=0.060)
    p_bare = predict(bare, acceptance(KEPT), 8)
    p_dil = predict(diluted, acceptance(KEPT), 8)
    gain_bare = p_bare[0.8].tokens_per_s / p_bare[0.0].tokens_per_s
    gain_dil = p_dil[0.8].tokens_per_s / p_dil[0.0].tokens_per_s
    assert 1.0 < gain_dil < gain_bare
    # the step pays it once, at its own k: step = bare step + other
    for r in (0.0, 0.8):
        assert p_dil[r].k == p_bare[r].k
        assert p_dil[r].step_s == pytest.approx(p_bare[r].step_s + 0.060)
        assert p_dil[r].other_share == pytest.approx(0.060 / p_dil[r].step_s)
    assert p_bare[0.0].other_share == 0.0
    # target-only steps pay it too: the speed-up is over the served baseline
    assert target_only_rate(VERIFY, 8, 0.060) == pytest.approx(8 / (0.160 + 0.032 + 0.060))


def test_where_drafting_does_not_pay_the_knob_changes_only_the_probes():
    """8 rows, a slow draft and a modest acceptance: adaptive k (k_min 0) runs plain
    target steps with a probe every PROBE_EVERY steps, so every ratio predicts about
    the target-only speed. Forcing k >= 1 there predicted a large ratio effect the
    engine never serves (1.18x predicted vs 1.03x measured at 8 clients)."""
    from slimspec.decoding.adaptive import PROBE_EVERY, expected_tokens

    heads = head_times(0.030)
    acc = acceptance(KEPT)
    forced = predict(StepCosts(8, 0.120, heads, VERIFY, 0.02), acc, 8)
    skip = predict(StepCosts(8, 0.120, heads, VERIFY, 0.02, single_s=0.19, k_min=0), acc, 8)
    assert forced[0.0].k >= 1 and forced[0.8].speedup > forced[0.0].speedup * 1.04
    assert all(p.k == 0 for p in skip.values())
    assert skip[0.8].speedup == pytest.approx(skip[0.0].speedup, rel=0.03)
    assert 0.85 < skip[0.0].speedup < 1.0  # the probes cost a little, nothing else
    # the mix: PROBE_EVERY plain steps and one probe at the best k >= 1, per step
    draft = 0.120 + heads[0.0]
    k_probe, probe_len, probe_step = best_k_rate(0.75, draft, VERIFY, 8, 8)
    _, length, step = best_k_rate(0.75, draft, VERIFY, 8, 8, k_min=0, single_s=0.19)
    assert k_probe >= 1 and probe_len == pytest.approx(expected_tokens(0.75, k_probe))
    assert length == pytest.approx((PROBE_EVERY + probe_len) / (PROBE_EVERY + 1))
    assert step == pytest.approx((PROBE_EVERY * 0.19 + probe_step) / (PROBE_EVERY + 1))
    # and the baseline is the measured plain step when there is one
    assert target_only_rate(VERIFY, 8, 0.02, 0.19) == pytest.approx(8 / 0.21)


def test_where_drafting_pays_k_min_zero_changes_nothing():
    costs = StepCosts(1, 0.040, head_times(0.016), VERIFY)
    skip = StepCosts(1, 0.040, head_times(0.016), VERIFY, k_min=0)
    for r, p in predict(costs, acceptance(KEPT), 8).items():
        q = predict(skip, acceptance(KEPT), 8)[r]
        assert q.k == p.k >= 1 and q.speedup == pytest.approx(p.speedup)
