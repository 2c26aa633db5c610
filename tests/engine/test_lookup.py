"""Lookup drafts (decoding/lookup.py): the n-gram index, the learnt acceptance, the
decision against the draft step, and exactness through the whole decoder (fp32, tiny
models): greedy output is the target's greedy decoding and seeded sampling is the
target's seeded sampling, with lookup steps really taken."""

from __future__ import annotations

import pytest
from slimspec import SpeculativeDecoder
from slimspec.decoding.adaptive import PROBE_EVERY, RelativeCosts
from slimspec.decoding.lookup import (
    MAX_NGRAM,
    LookupAcceptance,
    LookupDrafts,
    NgramIndex,
    choose_lookup,
    resolve_lookup_tokens,
)
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import target_greedy, target_only

COSTS = RelativeCosts(draft=0.25, verify_per_token=0.1, single=1.0)


def test_continuation_follows_the_longest_latest_match():
    seq = [1, 2, 3, 9, 9, 2, 3, 4, 5, 7, 1, 2, 3]
    draft, n = NgramIndex().continuation(seq, 3)
    # [1, 2, 3] occurred at the start (followed by 9); [2, 3] also later (followed by 4):
    # the longest match wins over the latest shorter one
    assert (draft, n) == ([9, 9, 2], 3)
    draft, n = NgramIndex().continuation([*seq, 8], 2)
    assert (draft, n) == ([], 0)  # 8 never occurred before


def test_a_match_near_the_end_extends_its_own_pattern():
    seq = [5, 6, 7, 5, 6, 7, 5]
    draft, n = NgramIndex().continuation(seq, 7)
    assert n == 4 and draft == [6, 7, 5, 6, 7, 5, 6]


def test_the_index_grows_with_the_sequence():
    index, seq = NgramIndex(), [1, 2, 3]
    assert index.continuation(seq, 2) == ([], 0)
    seq += [4, 1, 2]
    assert index.continuation(seq, 2) == ([3, 4], 2)
    seq += [3, 5, 1, 2]  # now [1, 2] was last followed by 3 again, [2] too
    assert index.continuation(seq, 3) == ([3, 5, 1], 2)
    assert index.indexed == len(seq)
    assert all(len(key) == n for n, d in enumerate(index.after, 1) for key in d)
    assert len(index.after) == MAX_NGRAM


def test_counterfactual_acceptance_counts_only_what_the_step_showed():
    est = LookupAcceptance()
    before = est.by_n[2].accepted, est.by_n[2].rejected
    est.observe_counterfactual(3, [4, 5, 6, 7], [4, 5])  # both emitted matched: no rejection
    after = est.by_n[2]
    assert after.accepted == pytest.approx(before[0] * after.decay + 2)
    assert after.rejected == pytest.approx(before[1] * after.decay)
    lo = est.alpha(3)
    est.observe_counterfactual(3, [4, 5, 6], [8, 5, 6])  # rejected at once
    assert est.alpha(3) < lo
    assert est.alpha(0) == 0.0 and est.alpha(50) == est.by_n[MAX_NGRAM - 1].alpha


def test_choice_beats_the_draft_step_or_drafts():
    # a long reliable match: verify many lookup tokens instead of drafting
    assert choose_lookup([0.95], [0.7], 3, COSTS, 12) >= 8
    # a poor match against a good draft: draft
    assert choose_lookup([0.3], [0.9], 4, COSTS, 12) == 0
    # no match anywhere, or lookup off: draft
    assert choose_lookup([0.0, 0.0], [0.1, 0.1], 1, COSTS, 12) == 0
    assert choose_lookup([0.95], [0.1], 1, COSTS, 0) == 0
    # the cap holds
    assert choose_lookup([0.98], [0.1], 1, COSTS, 5) == 5


def test_resolve_lookup_tokens(monkeypatch):
    monkeypatch.setenv("SLIMSPEC_LOOKUP_TOKENS", "0")
    assert resolve_lookup_tokens(None) == 0
    monkeypatch.setenv("SLIMSPEC_LOOKUP_TOKENS", "many")
    with pytest.raises(ValueError, match="SLIMSPEC_LOOKUP_TOKENS"):
        resolve_lookup_tokens(None)
    with pytest.raises(ValueError, match="lookup_tokens"):
        resolve_lookup_tokens(-1)
    assert resolve_lookup_tokens(5) == 5


@pytest.fixture
def forced_lookup(monkeypatch):
    """Every step with a match anywhere verifies 3 lookup tokens (the decision is tested
    above; here the lookup steps' verification is)."""

    def choose(self, plan, draft_alphas, draft_k, costs, max_tokens):
        return min(3, max_tokens) if any(plan.ns) else 0

    monkeypatch.setattr(LookupDrafts, "choose", choose)


# repeating prompts: their matches hold for a while, then break
LOOPS = [[5, 9, 11, 5, 9, 11, 5, 9], [7, 8, 7, 8, 7], [3, 4, 5, 6, 3, 4, 5], [40, 41, 40]]


@pytest.mark.parametrize("k", [2, None])
def test_greedy_with_lookup_steps_equals_target_greedy(tiny_llama_pair, forced_lookup, k):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=k)
    reqs = [GenerationRequest(f"r{i}", p, 30 - 4 * i) for i, p in enumerate(LOOPS)]
    results = dec.generate_batch(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.output_ids == target_greedy(target, req.prompt_ids, req.max_new_tokens)
    st = dec.stats
    assert st.lookup_verifications > 0 and 0 < st.lookup_accepted < st.lookup_drafted
    assert st.draft_forwards > 0  # draft steps between them: the draft caught up its backlog
    assert sum(r.stats.lookup_drafted for r in results) == st.lookup_drafted
    # alone, one at a time: the same
    assert dec.generate_batch([reqs[1]])[0].output_ids == results[1].output_ids


def test_seeded_sampling_with_lookup_steps_equals_target_only(tiny_llama_pair, forced_lookup):
    target, draft = tiny_llama_pair
    reqs = [
        GenerationRequest(f"s{i}", p, 24, SamplingParams(temperature=0.8, seed=100 + i))
        for i, p in enumerate(LOOPS)
    ]
    want = target_only(target, reqs)
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=2)
    assert [r.output_ids for r in dec.generate_batch(reqs)] == want
    assert dec.stats.lookup_verifications > 0
    mixed = [GenerationRequest("g", [8, 8, 8], 9), *reqs]  # inside a batch: the same
    assert [r.output_ids for r in dec.generate_batch(mixed)[1:]] == want


def test_lookup_off_runs_no_lookup_step(tiny_llama_pair, forced_lookup):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=2, lookup_tokens=0)
    res = dec.generate(LOOPS[0], 16, stop_token_ids=[])
    assert res.output_ids == target_greedy(target, LOOPS[0], 16)
    assert dec.stats.lookup_verifications == 0 and dec.lookup_tokens == 0
    dec.set_lookup_tokens(4)
    dec.generate(LOOPS[0], 16, stop_token_ids=[])
    assert dec.stats.lookup_verifications > 0


@pytest.fixture
def forced_swaps(monkeypatch):
    """Draft steps only, and in them every row with a match (that compares tokens)
    verifies its lookup draft instead of the draft's."""

    def choose(self, plan, draft_alphas, draft_k, costs, max_tokens):
        return 0

    def swaps(self, plan, k, draft_alphas, compares_tokens):
        return [bool(n) and ok and k > 0 for n, ok in zip(plan.ns, compares_tokens, strict=True)]

    monkeypatch.setattr(LookupDrafts, "choose", choose)
    monkeypatch.setattr(LookupDrafts, "swaps", swaps)


def test_rows_swapping_in_lookup_drafts_stay_exact(tiny_llama_pair, forced_swaps):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=3)
    greedy = [GenerationRequest(f"g{i}", p, 28 - 3 * i) for i, p in enumerate(LOOPS)]
    results = dec.generate_batch(greedy)
    for req, res in zip(greedy, results, strict=True):
        assert res.output_ids == target_greedy(target, req.prompt_ids, req.max_new_tokens)
    st = dec.stats
    # swapped rows verified lookup drafts while the draft served the others
    assert st.lookup_verifications > 0 and st.lookup_accepted > 0 and st.verify_steps > 0
    assert st.draft_forwards == 3 * st.batch_steps  # every step was a draft step
    # seeded rows swap too, unseeded (rejection-sampled) rows never do; seeded output
    # is still target-only sampling's
    seeded = [
        GenerationRequest(f"s{i}", p, 20, SamplingParams(temperature=0.9, seed=7 + i))
        for i, p in enumerate(LOOPS)
    ]
    want = target_only(target, seeded)
    before = dec.stats.lookup_verifications
    unseeded = GenerationRequest("u", LOOPS[0], 20, SamplingParams(temperature=0.9))
    got = dec.generate_batch([*seeded, unseeded])
    assert [r.output_ids for r in got[:-1]] == want
    assert got[-1].stats.lookup_drafted == 0 and got[-1].stats.verify_steps > 0
    assert dec.stats.lookup_verifications > before


def test_swaps_need_a_draft_as_long_as_k():
    drafts = LookupDrafts(max_tokens=3)
    plan = drafts.plan([[1, 2, 3, 1, 2], [4, 5, 6, 7]], [NgramIndex(), NgramIndex()])
    assert plan.ns == [2, 0] and plan.drafts == [[3, 1, 2], []]
    drafts.acceptance.by_n[1].accepted = 1e6  # a sure match
    assert drafts.swaps(plan, 3, [0.1, 0.1], [True, True]) == [True, False]
    assert drafts.swaps(plan, 4, [0.1, 0.1], [True, True]) == [False, False]  # too short
    assert drafts.swaps(plan, 3, [0.1, 0.1], [False, True]) == [False, False]  # rejection row


def test_a_batch_lookup_step_needs_every_row_to_gain():
    # one sure match and one row without any: alone the sure row would verify a long
    # lookup draft; beside the other row (which would verify the same length for
    # nothing) the batch drafts, and the sure row swaps its lookup in
    assert choose_lookup([0.98], [0.6], 2, COSTS, 12) >= 8
    assert choose_lookup([0.98, 0.0], [0.6, 0.6], 2, COSTS, 12) == 0
    assert choose_lookup([0.98, 0.9], [0.6, 0.6], 2, COSTS, 12) >= 8


def test_the_draft_still_drafts_every_few_steps_where_lookup_always_wins(
    tiny_llama_pair, monkeypatch
):
    # lookup steps everywhere: the rows' draft estimates would never move again, so a
    # row that has not drafted for PROBE_EVERY steps drafts once
    def choose(self, plan, draft_alphas, draft_k, costs, max_tokens):
        return min(2, max_tokens)

    monkeypatch.setattr(LookupDrafts, "choose", choose)
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=2, shadow_every=10**6)
    res = dec.generate(LOOPS[0], 60, stop_token_ids=[])
    assert res.output_ids == target_greedy(target, LOOPS[0], 60)
    st = dec.stats
    draft_steps = st.batch_steps - st.lookup_verifications
    assert st.lookup_verifications > 0
    assert draft_steps >= st.batch_steps // (PROBE_EVERY + 1) and st.draft_forwards > 0
