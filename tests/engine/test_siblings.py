"""Sibling drafts: the tree layout and decision are right, and greedy output stays the
target's own greedy decoding when runner-ups are verified alongside the chain."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.siblings import tree_attention, tree_positions, verify_greedy_siblings
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB, tiny_pair

N_NEW = 24


def test_tree_attention_layout():
    a = tree_attention(3, 2)
    # slots: 0 = x, 1..3 = c_1..c_3, 4 = s_1, 5 = s_2
    assert a[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert a[:4, 4:].any().item() is False  # the chain never sees a sibling
    assert a[4].tolist() == [True, False, False, False, True, False]  # s_1: x and itself
    assert a[5].tolist() == [True, True, False, False, False, True]  # s_2: x, c_1, itself
    assert tree_attention(4, 0).equal(torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="sibling depths"):
        tree_attention(2, 3)


def test_tree_positions():
    pos = tree_positions(torch.tensor([10, 3]), 3, 2)
    assert pos.tolist() == [[10, 11, 12, 13, 11, 12], [3, 4, 5, 6, 4, 5]]


def test_verify_greedy_siblings_cases():
    drafts = torch.tensor([[5, 6, 7]] * 4)
    sibs = torch.tensor([[50, 60]] * 4)
    # target argmax at [x, c1, c2, c3, s1, s2]
    t = torch.tensor(
        [
            [5, 6, 7, 9, 1, 2],  # all chain accepted: bonus 9, no hit
            [50, 0, 0, 0, 8, 0],  # break at depth 1, target wants 50 = s_1: hit, then 8
            [5, 61, 0, 0, 0, 4],  # break at depth 2, target wants 61 != s_2: no hit
            [5, 6, 70, 0, 0, 0],  # break at depth 3, beyond the m = 2 sibling depths
        ]
    )
    acc, hit, nxt = verify_greedy_siblings(t, drafts, sibs)
    assert acc.tolist() == [3, 0, 1, 2]
    assert hit.tolist() == [False, True, False, False]
    assert nxt.tolist() == [9, 8, 61, 70]
    acc0, hit0, nxt0 = verify_greedy_siblings(t[:, :4], drafts, sibs[:, :0])
    assert acc0.tolist() == [3, 0, 1, 2] and not hit0.any() and nxt0.tolist() == [9, 50, 61, 70]


@pytest.fixture(scope="module")
def noisy_pair():
    """A draft that often misses at top-1 but has the target's token second."""
    return tiny_pair("llama", noise=0.15, seed=21)


@pytest.mark.parametrize("k", [1, 3, 6, None])
@pytest.mark.parametrize("siblings", [1, 8])
def test_greedy_with_siblings_equals_target(noisy_pair, k, siblings):
    target, draft = noisy_pair
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.3, num_draft_tokens=k, sibling_drafts=siblings
    )
    for p in prompts(4, TINY_VOCAB, seed=2):
        res = dec.generate(p, N_NEW, stop_token_ids=[])
        assert res.output_ids == target_greedy(target, p, N_NEW)
    if k is not None:  # the runner-up was really used (adaptive k may stop drafting)
        assert dec.stats.sibling_hits > 0


def test_batched_ragged_with_siblings(noisy_pair):
    target, draft = noisy_pair
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.5, num_draft_tokens=4, sibling_drafts=4
    )
    ps = prompts(5, TINY_VOCAB, seed=9)
    reqs = [GenerationRequest(f"r{i}", p, N_NEW - 3 * i) for i, p in enumerate(ps)]
    for req, res in zip(reqs, dec.generate_batch(reqs), strict=True):
        assert res.output_ids == target_greedy(target, req.prompt_ids, req.max_new_tokens)
    assert dec.stats.sibling_hits > 0
    # emitted tokens per verification count the accepted sibling
    assert dec.stats.accepted <= dec.stats.drafted


def test_sampling_rows_ignore_siblings(noisy_pair):
    """Seeded sampling output does not depend on the sibling setting (greedy-only)."""
    target, draft = noisy_pair
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
    outs = []
    for siblings in (0, 8):
        dec = SpeculativeDecoder.from_models(
            target, draft, compression_ratio=0.3, num_draft_tokens=3, sibling_drafts=siblings
        )
        req = GenerationRequest("s", prompts(1, TINY_VOCAB, seed=4)[0], N_NEW, sampling=sp)
        outs.append(dec.generate_batch([req])[0].output_ids)
        assert dec.stats.sibling_hits == 0
    assert outs[0] == outs[1]


def test_sibling_option_errors_and_auto(noisy_pair, monkeypatch):
    target, draft = noisy_pair
    with pytest.raises(ValueError, match="sibling_drafts"):
        SpeculativeDecoder.from_models(target, draft, sibling_drafts=-1)
    # off unless asked for; the env var sets it
    assert SpeculativeDecoder.from_models(target, draft).sibling_drafts == 0
    monkeypatch.setenv("SLIMSPEC_SIBLING_DRAFTS", "3")
    assert SpeculativeDecoder.from_models(target, draft).sibling_drafts == 3
