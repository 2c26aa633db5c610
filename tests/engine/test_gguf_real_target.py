"""The default target served in its GGUF form (Q4_K/Q6_K blocks), on the real pair.

- Against the fp32 dequantised reference (the weights' exact values in fp32): the
  logits stay within a bound (the only rounding is the int8 activation quantisation,
  as in llama.cpp) and greedy text agrees; the figures are printed (-s) for the docs.
- Exactness for the served form, in bf16: speculative output equals target-only output
  with the same kernels, greedy and seeded, alone and inside a busy batch; the same
  seed twice gives the same text.
Marked slow: they load the real pair (about 3 GB of memory, ~1 min)."""

from __future__ import annotations

import gc

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import gguf_kernels, target_form
from slimspec.decoding.types import GenerationRequest, SamplingParams
from slimspec.weights.loading import load_causal_lm

from tests.engine.helpers import target_greedy, target_only

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gguf_kernels.load() is None, reason="no C compiler here"),
]

CODE = [
    'def quicksort(items):\n    """Sort a list with quicksort and return it."""\n',
    "import json\n\n\ndef load_config(path):\n    with open(path) as fh:\n",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n",
]
ENGLISH = "The history of the printing press begins in the fifteenth century, when"


@pytest.fixture(scope="module")
def served_target(real_model_pair):
    model, tok = load_causal_lm(real_model_pair.target, dtype="bfloat16")
    form = target_form.apply(model, "gguf", real_model_pair.target)
    assert form.quantization == "gguf" and "Q4_K" in form.detail and "Q6_K" in form.detail
    return model, tok


def test_logits_within_bound_of_the_fp32_dequantised_reference(real_model_pair):
    model, tok = load_causal_lm(real_model_pair.target, dtype="float32")
    reference, _ = load_causal_lm(real_model_pair.target, dtype="float32")
    target_form.apply(model, "gguf", real_model_pair.target)
    errors, agree, total = [], 0, 0
    with torch.no_grad():
        for text in [*CODE, ENGLISH]:
            ids = torch.tensor([tok(text)["input_ids"]])
            got, want = model(ids).logits[0, 1:], reference(ids).logits[0, 1:]
            # position 0 (the first token's outsized activations) is never sampled from
            errors.append((got - want).abs().amax(-1))
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += got.shape[0]
        greedy_len = 128
        ids = tok(CODE[0])["input_ids"]
        ours, theirs = (
            target_greedy(model, ids, greedy_len),
            target_greedy(reference, ids, greedy_len),
        )
    err = torch.cat(errors)
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    same_prefix = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), greedy_len
    )
    print(
        f"\nlogit error vs fp32 dequantised: max {err.max():.3f}, mean of per-position max "
        f"{err.mean():.3f}; top-1 agreement {agree}/{total}; greedy: first {same_prefix} of "
        f"{greedy_len} tokens identical, {equal} equal"
    )
    assert err.max() <= 2.0 and err.mean() <= 0.6
    assert agree >= 0.9 * total
    assert same_prefix >= 16
    del model, reference
    gc.collect()


def test_speculation_is_exact_for_the_served_form_in_bf16(served_target, real_model_pair):
    target, tok = served_target
    draft, _ = load_causal_lm(real_model_pair.draft, dtype="bfloat16")
    dec = SpeculativeDecoder.from_models(target, draft, tok, compression_ratio=0.5)
    assert dec.target_form.quantization == "gguf"
    prompts = [tok(p)["input_ids"] for p in CODE]
    greedy = [GenerationRequest(f"g{i}", p, 40) for i, p in enumerate(prompts)]
    assert [r.output_ids for r in dec.generate_batch(greedy)] == target_only(target, greedy)
    assert dec.stats.accepted > 0

    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42)
    one = [GenerationRequest("s", prompts[0], 32, seeded)]
    alone = dec.generate_batch(one)[0].output_ids
    again = dec.generate_batch(one)[0].output_ids
    busy = [
        GenerationRequest("b1", prompts[1], 32, SamplingParams(temperature=1.1, seed=7)),
        GenerationRequest("b2", prompts[2], 32),
        GenerationRequest("s", prompts[0], 32, seeded),
        GenerationRequest("b3", tok(ENGLISH)["input_ids"], 32, SamplingParams(temperature=0.6)),
    ]
    in_batch = dec.generate_batch(busy)[2].output_ids
    assert alone == again == in_batch == target_only(target, one)[0]
