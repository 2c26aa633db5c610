"""Greedy exactness on tiny random models: output == the target's own greedy decoding."""

from __future__ import annotations

import threading

import pytest
from slimspec import SpeculativeDecoder
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB, tiny_pair

N_NEW = 24


def _req(i, p, n=N_NEW):
    return GenerationRequest(f"r{i}", p, n)


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.8, 0.95])
@pytest.mark.parametrize("k", [1, 3, None])
def test_single_request_equals_target_greedy(tiny_llama_pair, ratio, k):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=ratio, num_draft_tokens=k)
    for p in prompts(3, TINY_VOCAB, seed=1):
        res = dec.generate(p, N_NEW, stop_token_ids=[])
        assert res.output_ids == target_greedy(target, p, N_NEW)
        assert res.finish_reason == "length"
        assert res.stats.verify_steps >= 1


@pytest.mark.parametrize("batch", [2, 5])
@pytest.mark.parametrize("k", [2, 5])
def test_batch_ragged_equals_target_greedy(tiny_llama_pair, batch, k):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.5, num_draft_tokens=k)
    ps = prompts(batch, TINY_VOCAB, seed=batch + k)
    # different lengths of output too, so rows leave at different steps
    reqs = [_req(i, p, N_NEW - 3 * i) for i, p in enumerate(ps)]
    results = dec.generate_batch(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.output_ids == target_greedy(target, req.prompt_ids, req.max_new_tokens)
    assert not dec.has_work()


def test_weak_draft_many_rejections(tiny_weak_pair):
    target, draft = tiny_weak_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, num_draft_tokens=4)
    ps = prompts(3, TINY_VOCAB, seed=7)
    results = dec.generate_batch([_req(i, p) for i, p in enumerate(ps)])
    for p, res in zip(ps, results, strict=True):
        assert res.output_ids == target_greedy(target, p, N_NEW)
    assert dec.stats.acceptance_rate < 0.5  # the test really exercised rejections


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("llama", "eager")])
def test_other_architectures(arch, attn):
    target, draft = tiny_pair(arch, seed=11, attn=attn)
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    ps = prompts(3, TINY_VOCAB, seed=3)
    results = dec.generate_batch([_req(i, p) for i, p in enumerate(ps)])
    for p, res in zip(ps, results, strict=True):
        assert res.output_ids == target_greedy(target, p, N_NEW)


def test_step_api_join_cancel_and_leave(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    ps = prompts(4, TINY_VOCAB, seed=5)
    got: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    dec.add_request(_req(0, ps[0]))
    dec.add_request(_req(1, ps[1]))
    steps = 0
    while dec.has_work():
        for out in dec.step():
            assert out.request_id not in finished, "a finished request must leave immediately"
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        steps += 1
        if steps == 2:
            dec.add_request(_req(2, ps[2]))  # joins mid-run
            dec.add_request(_req(3, ps[3]))
        if steps == 3:
            dec.cancel("r1")
    assert finished["r1"] == "cancelled"
    for i in (0, 2, 3):
        assert finished[f"r{i}"] == "length"
        assert got[f"r{i}"] == target_greedy(target, ps[i], N_NEW)
    r = dec.pop_result("r0")
    assert r is not None and r.output_ids == got["r0"]


def test_stop_token_ends_request(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, num_draft_tokens=4)
    p = prompts(1, TINY_VOCAB, seed=9)[0]
    ref = target_greedy(target, p, N_NEW)
    stop = ref[7]
    res = dec.generate(p, N_NEW, stop_token_ids=[stop])
    assert res.finish_reason == "stop"
    assert res.output_ids == ref[: ref.index(stop) + 1]


def test_kv_rollback_keeps_exactly_the_sequence(tiny_weak_pair):
    """After every step: valid target slots == len(seq) - 1, valid draft slots == draft_seen."""
    target, draft = tiny_weak_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, num_draft_tokens=4)
    ps = prompts(3, TINY_VOCAB, seed=2, lengths=(3, 8, 1))
    for i, p in enumerate(ps):
        dec.add_request(_req(i, p, 40))
    sp = SamplingParams(temperature=1.0, seed=3)  # sampling rows drop the bonus when all accept
    dec.add_request(GenerationRequest("s", ps[0], 40, sp))
    rejected_any = False
    while dec.has_work():
        dec.step()
        batch = dec._batch
        if batch.rows:
            valid_t = batch.target_kv.valid.sum(dim=1).tolist()
            valid_d = batch.draft_kv.valid.sum(dim=1).tolist()
            for row, vt, vd in zip(batch.rows, valid_t, valid_d, strict=True):
                assert vt == len(row.seq) - 1
                assert vd == row.draft_seen
            rejected_any |= bool((~batch.target_kv.valid).any())
    assert rejected_any
    assert dec._batch.target_kv.batch_size == 0


def test_ratio_switch_mid_generation_and_from_another_thread(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, num_draft_tokens=3)
    ps = prompts(2, TINY_VOCAB, seed=4)
    for i, p in enumerate(ps):
        dec.add_request(_req(i, p, 40))
    got: dict[str, list[int]] = {}
    ratios = [0.0, 0.9, 0.5, 0.2, 0.95]
    n = 0
    while dec.has_work():
        th = threading.Thread(target=dec.set_compression_ratio, args=(ratios[n % len(ratios)],))
        th.start()
        for out in dec.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        th.join()
        n += 1
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == target_greedy(target, p, 40)
    assert dec.compression_ratio in ratios


def test_compaction_keeps_outputs(tiny_weak_pair):
    target, draft = tiny_weak_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, num_draft_tokens=6)
    ps = prompts(2, TINY_VOCAB, seed=8, lengths=(2, 11))
    results = dec.generate_batch([_req(i, p, 60) for i, p in enumerate(ps)])
    for p, res in zip(ps, results, strict=True):
        assert res.output_ids == target_greedy(target, p, 60)
    assert dec.stats.batch_steps > 0


def test_draft_cost_sample_leaves_out_the_catch_up_forward():
    from slimspec.decoding.adaptive import draft_forward_seconds

    assert draft_forward_seconds(0.3, 3, None) == pytest.approx(0.1)
    # 3 forwards in 0.5 s, the first fed a backlog and took 0.3 s: one more token = 0.1 s
    assert draft_forward_seconds(0.5, 3, 0.3) == pytest.approx(0.1)
    assert draft_forward_seconds(0.4, 1, 0.4) is None  # only the catch-up forward ran
    assert draft_forward_seconds(0.0, 0, None) is None


def test_adaptive_skip_is_exact_for_greedy_and_seeded_sampling(tiny_weak_pair, monkeypatch):
    """Plain target steps (k = 0) keep greedy output exact and, since a seeded row's token
    at a position comes from that position's noise whatever the schedule, seeded sampling
    equal to target-only sampling."""
    from slimspec.decoding import decoder as decoder_module
    from slimspec.server.baseline import TargetOnlyEngine

    target, draft = tiny_weak_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0)
    dec._cost.draft_ratio = 0.9  # a draft nearly as slow as the target: skipping should win
    ps = prompts(2, TINY_VOCAB, seed=21)
    results = dec.generate_batch([_req(i, p, 40) for i, p in enumerate(ps)])
    for p, res in zip(ps, results, strict=True):
        assert res.output_ids == target_greedy(target, p, 40)
    assert dec.stats.draft_forwards < dec.stats.batch_steps  # some steps did not draft
    assert dec.stats.drafted > 0  # ... and probing drafted again
    sp = SamplingParams(temperature=1.0, seed=1)
    dec.stats = type(dec.stats)()
    schedule = iter([0, 2, 0, 0, 3, 1] * 20)  # plain steps mixed with drafting ones
    monkeypatch.setattr(decoder_module, "choose_batch_k", lambda *a, **kw: next(schedule))
    got = dec.generate_batch([GenerationRequest("s", ps[0], 30, sp)])[0].output_ids
    assert 0 < dec.stats.draft_forwards < dec.stats.batch_steps
    base = TargetOnlyEngine(target, tokenizer=None)
    want = base.generate(ps[0], 30, sp).output_ids
    assert got == want
