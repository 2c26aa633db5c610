"""A new request's target prefill rides on the batch's verification forward
(decoding/grouped_forward.py), with the drafts made for it in the same step; outputs
stay the target's. fp32, tiny random models (the serving gain is in bench/serving.py)."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding import grouped_forward
from slimspec.decoding.grouped_forward import Group, forward_groups
from slimspec.decoding.kv import BatchKV, forward
from slimspec.decoding.rows import right_aligned
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB, tiny_pair

N_NEW = 20


def _cached(base, seqs):
    kv = BatchKV("cpu")
    ids, pos, real = right_aligned(seqs, [0] * len(seqs))
    forward(base, kv, ids, pos, real)
    return kv


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_one_grouped_forward_equals_a_forward_per_group(arch):
    target, _ = tiny_pair(arch, seed=21)
    assert grouped_forward.enable(target)
    base = target.get_decoder()
    old = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    new = (torch.tensor([[30, 31, 32], [33, 34, 35]]), torch.tensor([[6, 7, 8], [3, 4, 5]]))
    real = torch.ones(2, 3, dtype=torch.bool)
    fresh = right_aligned([[40, 41, 42, 43, 44, 45, 46], [47], [48, 49]], [0, 0, 0])
    # one forward per group, as before
    kv_a, kv_b = _cached(base, old), BatchKV("cpu")
    want_a = forward(base, kv_a, *new, real)
    want_b = forward(base, kv_b, *fresh)
    # the same groups in one forward
    kv_c, kv_d = _cached(base, old), BatchKV("cpu")
    got_a, got_b = forward_groups(base, [Group(kv_c, *new, real), Group(kv_d, *fresh)])
    torch.testing.assert_close(got_a, want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b[fresh[2]], want_b[fresh[2]], atol=1e-4, rtol=1e-4)
    for mine, theirs in ((kv_c, kv_a), (kv_d, kv_b)):
        assert torch.equal(mine.valid, theirs.valid)
        for x, y in zip(mine.cache.layers, theirs.cache.layers, strict=True):
            torch.testing.assert_close(x.keys, y.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(x.values, y.values, atol=1e-4, rtol=1e-4)
    # without a grouped step the wrapped attention is the model's own
    kv_e = _cached(base, old)
    torch.testing.assert_close(forward(base, kv_e, *new, real), want_a)


def _run_with_arrivals(dec, first, later, after_steps=2, first_chunks=None):
    """Run `first`, add `later` once the batch is decoding; every request's tokens
    (first_chunks: each request's tokens from its first step)."""
    got: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for r in first:
        dec.add_request(r)
    steps = 0
    while dec.has_work():
        for out in dec.step():
            if first_chunks is not None and out.request_id not in got:
                first_chunks[out.request_id] = len(out.new_token_ids)
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if steps == after_steps:
            for r in later:
                dec.add_request(r)
    return got, reasons


def test_arrivals_ride_on_the_verification_and_stay_exact(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    assert dec.fused_prefill
    ps = prompts(6, TINY_VOCAB, seed=31)  # lengths 1, 2, 5, 9, 17, 1
    first = [GenerationRequest(f"r{i}", ps[i], N_NEW) for i in (0, 1)]
    later = [GenerationRequest(f"r{i}", ps[i], N_NEW - i) for i in (2, 3, 4, 5)]
    one = GenerationRequest("one", ps[3], 1)  # finishes in the step that prefills it
    stop_at = target_greedy(target, ps[4], 1)[0]
    stop = GenerationRequest("stop", ps[4], N_NEW, stop_token_ids=frozenset({stop_at}))
    chunks: dict[str, int] = {}
    got, reasons = _run_with_arrivals(dec, first, [*later, one, stop], first_chunks=chunks)
    for r in [*first, *later, one]:
        assert got[r.request_id] == target_greedy(target, list(r.prompt_ids), r.max_new_tokens)
        assert reasons[r.request_id] == "length"
    assert got["stop"] == [stop_at] and reasons["stop"] == "stop"
    assert dec.stats.fused_prefills == len(later) + 2  # every arrival rode
    # ... and was drafted for in that same step: accepted drafts came with its first token
    assert max(chunks[r.request_id] for r in later) > 1
    assert not dec.has_work() and not dec._batch.rows


def test_seeded_arrival_samples_what_it_samples_alone(tiny_llama_pair):
    """Seeded sampling is keyed by position, so a request that rides (its first tokens
    verified in the forward that prefills it) gets the tokens it gets when it runs alone."""
    target, draft = tiny_llama_pair
    sp = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=1234)
    req = GenerationRequest("s", [7, 8, 9, 10], N_NEW, sp)
    alone = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=3).generate_batch([req])
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=3)
    busy = [GenerationRequest(f"b{i}", p, N_NEW) for i, p in enumerate(prompts(2, TINY_VOCAB))]
    got, _ = _run_with_arrivals(dec, busy, [req])
    assert dec.stats.fused_prefills == 1
    assert got["s"] == alone[0].output_ids


def test_off_switch_and_unsupported_attention_prefill_apart(tiny_llama_pair, monkeypatch):
    target, draft = tiny_llama_pair
    monkeypatch.setenv("SLIMSPEC_FUSED_PREFILL", "0")
    dec = SpeculativeDecoder.from_models(target, draft, num_draft_tokens=3)
    monkeypatch.delenv("SLIMSPEC_FUSED_PREFILL")
    eager_target, eager_draft = tiny_pair("llama", seed=11, attn="eager")
    eager = SpeculativeDecoder.from_models(eager_target, eager_draft, num_draft_tokens=3)
    assert not eager.fused_prefill
    ps = prompts(4, TINY_VOCAB, seed=41)
    for d, t in ((dec, target), (eager, eager_target)):
        first = [GenerationRequest(f"r{i}", ps[i], N_NEW) for i in (0, 1)]
        later = [GenerationRequest(f"r{i}", ps[i], N_NEW) for i in (2, 3)]
        got, _ = _run_with_arrivals(d, first, later)
        assert d.stats.fused_prefills == 0
        for r in first + later:
            assert got[r.request_id] == target_greedy(t, list(r.prompt_ids), N_NEW)
