"""Log-probabilities: the speculative engine reports, for every emitted token, what the
target-only engine reports for the same text (the target's raw distribution at that
position), in fp32, greedy and seeded sampling, alone and in a ragged batch, with
sibling drafts and with riding prefill."""

from __future__ import annotations

import math

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.logprobs import token_logprobs
from slimspec.decoding.types import GenerationRequest, SamplingParams, TokenLogprob
from slimspec.server.baseline import TargetOnlyEngine

from tests.engine.helpers import prompts
from tests.support.tiny_models import TINY_VOCAB, tiny_pair

N_NEW = 20
TOP = 5


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", noise=0.15, seed=21)


def reference(target, reqs: list[GenerationRequest]) -> dict[str, list[TokenLogprob]]:
    """The target-only engine, one request at a time (its own numbers, its own path)."""
    eng = TargetOnlyEngine(target, tokenizer=None)
    out: dict[str, list[TokenLogprob]] = {}
    for r in reqs:
        eng.add_request(r)
        got: list[TokenLogprob] = []
        while eng.has_work():
            for o in eng.step():
                assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
                got.extend(o.logprobs)
        out[r.request_id] = got
    return out


def assert_same(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    assert [t.token_id for t in got] == [t.token_id for t in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)


def requests(sampling: SamplingParams, seed: int = 3) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"r{i}", p, N_NEW, sampling, frozenset(), TOP)
        for i, p in enumerate(prompts(5, TINY_VOCAB, seed=seed))
    ]


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7)],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("siblings", [0, 4])
def test_speculative_logprobs_equal_the_target_only_engines(pair, sampling, siblings):
    target, draft = pair
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.5, num_draft_tokens=4, sibling_drafts=siblings
    )
    reqs = requests(sampling)
    results = dec.generate_batch(reqs)  # ragged batch, drafts accepted and rejected
    want = reference(target, reqs)
    assert dec.stats.accepted > 0  # some tokens came from accepted drafts
    for r, res in zip(reqs, results, strict=True):
        assert res.logprobs is not None and len(res.logprobs) == len(res.output_ids)
        assert [t.token_id for t in res.logprobs] == res.output_ids
        assert_same(res.logprobs, want[r.request_id])


def test_riding_prefill_rows_report_logprobs(pair):
    """Requests that join while others decode have their prompt prefilled inside the
    verification forward; their first tokens' numbers come from that forward."""
    target, draft = pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    assert dec.fused_prefill
    reqs = requests(SamplingParams(), seed=5)
    dec.add_request(reqs[0])
    dec.step()
    dec.step()
    for r in reqs[1:]:
        dec.add_request(r)
    while dec.has_work():
        dec.step()
    assert dec.stats.fused_prefills > 0
    want = reference(target, reqs)
    for r in reqs:
        res = dec.pop_result(r.request_id)
        assert res is not None and res.logprobs is not None
        assert_same(res.logprobs, want[r.request_id])


def test_no_logprobs_unless_asked(pair):
    target, draft = pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3)
    res = dec.generate(prompts(1, TINY_VOCAB)[0], 8, stop_token_ids=[])
    assert res.logprobs is None


def test_token_logprobs_is_a_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    out = token_logprobs(logits, [1, 3], top=2)
    z = math.log(sum(math.exp(v) for v in (2.0, 1.0, 0.0, -1.0)))
    assert out[0].logprob == pytest.approx(1.0 - z)
    assert [i for i, _ in out[0].top] == [0, 1]
    assert out[0].top[0][1] == pytest.approx(2.0 - z)
    assert out[1].logprob == pytest.approx(-math.log(4))
    assert token_logprobs(logits, [0, 0], top=0)[0].top == ()
