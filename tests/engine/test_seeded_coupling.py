"""Seeded sampling reproduces exactly: the speculative decoder returns what target-only
sampling with the same seed returns (the Gumbel-max coupling keyed by (seed, position)),
whatever k, the compression ratio or the batch. fp32, tiny models. Also: a hostile row
(a temperature that overflows the logits) never fails or changes its batch mates."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding import sampling as S
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import target_greedy, target_only

PROMPTS = [[5, 9, 11], [7], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41]]


def requests(seeds, sp: SamplingParams, n: int = 24) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}",
            PROMPTS[i % len(PROMPTS)],
            n,
            SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed),
        )
        for i, seed in enumerate(seeds)
    ]


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=20),
    ],
)
@pytest.mark.parametrize(("k", "ratio"), [(1, 0.0), (3, 0.3), (None, 0.8)])
def test_seeded_speculative_equals_seeded_target_only(tiny_llama_pair, sp, k, ratio):
    target, draft = tiny_llama_pair
    reqs = requests([11, 12345, 2**63 - 1, 0, 7], sp)
    want = target_only(target, reqs)
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=ratio, num_draft_tokens=k)
    got = [r.output_ids for r in dec.generate_batch(reqs)]
    assert got == want
    if k is not None:  # (adaptive k may choose plain target steps on a busy machine)
        assert dec.stats.accepted > 0  # the drafts were really used
    # one at a time, and in a batch with greedy and unseeded rows, the same again
    for i, r in enumerate(reqs[:2]):
        assert dec.generate_batch([r])[0].output_ids == want[i]
    mixed = [
        GenerationRequest("g", [8, 8], 9),
        GenerationRequest("u", [9, 9, 9], 13, SamplingParams(temperature=1.0)),
        *reqs,
    ]
    assert [r.output_ids for r in dec.generate_batch(mixed)[2:]] == want


def test_seeded_coupling_on_a_weak_draft_rejects_and_still_matches(tiny_weak_pair):
    target, draft = tiny_weak_pair
    reqs = requests(range(6), SamplingParams(temperature=1.0), n=30)
    want = target_only(target, reqs)
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.5, num_draft_tokens=4)
    assert [r.output_ids for r in dec.generate_batch(reqs)] == want
    assert 0 < dec.stats.accepted < dec.stats.drafted  # both branches of the rule ran


def test_different_seeds_give_different_samples(tiny_llama_pair):
    target, _ = tiny_llama_pair
    outs = target_only(target, requests(range(6), SamplingParams(temperature=1.0)))
    assert len({tuple(o) for o in outs}) > 1


HOSTILE = [1e-300, 5e-324, 1e-30, 1e-6, float("nan")]


@pytest.mark.parametrize("temperature", HOSTILE)
def test_near_zero_temperature_is_greedy_and_harms_no_batch_mate(tiny_llama_pair, temperature):
    target, draft = tiny_llama_pair
    normal = requests([3, 4], SamplingParams(temperature=1.0, top_p=0.95), n=16)
    greedy = GenerationRequest("g", [12, 13], 16)
    hostile = GenerationRequest("h", [5, 9, 11], 16, SamplingParams(temperature=temperature))
    hostile_tiny_p = GenerationRequest(
        "hp", [6, 6], 16, SamplingParams(temperature=1.0, top_p=1e-300, seed=5)
    )
    batch = [normal[0], hostile, greedy, hostile_tiny_p, normal[1]]
    alone = target_only(target, [normal[0], greedy, normal[1]])
    want_hostile = target_greedy(target, [5, 9, 11], 16)
    want_tiny_p = target_greedy(target, [6, 6], 16)  # top_p -> only the top token survives
    # target-only engine
    got = target_only(target, batch)
    assert got[1] == want_hostile and got[3] == want_tiny_p
    assert [got[0], got[2], got[4]] == alone
    # speculative engine, seeded rows coupled, so the mates equal the target-only run
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    res = [r.output_ids for r in dec.generate_batch(batch)]
    assert res[1] == want_hostile and res[3] == want_tiny_p
    assert [res[0], res[2], res[4]] == alone


def test_warp_never_returns_nan_rows():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [float("nan"), 0.0, 1.0]])
    temperature = torch.tensor([1e-300, 1.0, 1.0], dtype=torch.float64).float()
    p = S.warp_probs(logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert torch.isfinite(p).all()
    assert p[0].tolist() == [0.0, 0.0, 1.0]
    assert abs(float(p[1].sum()) - 1) < 1e-6
