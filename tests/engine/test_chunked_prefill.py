"""Chunked prefill: a long prompt is prefilled a bounded number of tokens per step, in
between the decode steps of the other requests, and the output stays exact (fp32)."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.types import GenerationRequest
from slimspec.server.baseline import TargetOnlyEngine

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB

CHUNK = 8


@pytest.fixture
def widest_forwards():  # type: ignore[no-untyped-def]
    """widest_forwards(module) -> the number of tokens of every forward of module, until
    the test ends."""
    handles = []

    def watch(module: torch.nn.Module) -> list[int]:
        seen, handle = _record(module)
        handles.append(handle)
        return seen

    yield watch
    for h in handles:
        h.remove()


def _record(module: torch.nn.Module):  # type: ignore[no-untyped-def]
    seen: list[int] = []

    def hook(_m, args, kwargs):  # type: ignore[no-untyped-def]
        ids = kwargs.get("input_ids", args[0] if args else None)
        emb = kwargs.get("inputs_embeds")
        seen.append(int((ids if ids is not None else emb).shape[1]))

    return seen, module.register_forward_pre_hook(hook, with_kwargs=True)


def test_speculative_chunked_prefill_is_exact_and_bounded(tiny_llama_pair, widest_forwards):
    target, draft = tiny_llama_pair
    # (no lookup drafts: a verification of 12 copied tokens is 13 wide, wider than
    # this chunk, and no prompt tokens)
    dec = SpeculativeDecoder.from_models(
        target,
        draft,
        compression_ratio=0.3,
        num_draft_tokens=3,
        prefill_chunk=CHUNK,
        lookup_tokens=0,
    )
    widths = widest_forwards(dec._verifier.base)
    ps = prompts(3, TINY_VOCAB, seed=5, lengths=(1, 37, 100))
    reqs = [GenerationRequest(f"r{i}", p, 12) for i, p in enumerate(ps)]
    results = dec.generate_batch(reqs)
    assert max(widths) <= CHUNK  # no forward took more prompt tokens than the chunk
    for p, res in zip(ps, results, strict=True):
        assert res.output_ids == target_greedy(target, p, 12)


def test_a_long_prompt_does_not_stall_decoding_rows(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.3, num_draft_tokens=2, prefill_chunk=CHUNK
    )
    short = GenerationRequest("short", [5, 6, 7], 200)
    dec.add_request(short)
    dec.step()
    long_prompt = prompts(1, TINY_VOCAB, seed=9, lengths=(161,))[0]
    dec.add_request(GenerationRequest("long", long_prompt, 5))
    steps_until_long_emits = 0
    while True:
        outs = {o.request_id: o for o in dec.step()}
        steps_until_long_emits += 1
        assert outs["short"].new_token_ids  # the decoding row moved on in every step
        if "long" in outs:
            break
    assert steps_until_long_emits >= 160 // CHUNK
    dec.cancel("short")
    while dec.has_work():
        dec.step()
    assert dec.pop_result("long").output_ids == target_greedy(target, long_prompt, 5)


def test_target_only_chunked_prefill_is_exact_and_bounded(tiny_llama_pair, widest_forwards):
    target, _ = tiny_llama_pair
    eng = TargetOnlyEngine(target, tokenizer=None, prefill_chunk=CHUNK)
    widths = widest_forwards(target.get_decoder())
    ps = prompts(3, TINY_VOCAB, seed=6, lengths=(2, 30, 75))
    out: dict[str, list[int]] = {}
    eng.add_request(GenerationRequest("short", [9, 9], 30))
    for _ in range(2):
        eng.step()
    for i, p in enumerate(ps):
        eng.add_request(GenerationRequest(f"r{i}", p, 10))
    while eng.has_work():
        outs = eng.step()
        assert any(o.request_id == "short" for o in outs) or "short" in out
        for o in outs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                out[o.request_id + ":done"] = []
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == target_greedy(target, p, 10)
    widths.clear()
    eng.add_request(GenerationRequest("again", ps[2], 3))
    while eng.has_work():
        eng.step()
    assert max(widths) <= CHUNK
