"""Exactness on real models (fp32, CPU). Marked slow: they load real weights."""

from __future__ import annotations

import copy

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import target_greedy

pytestmark = pytest.mark.slow

CODE_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\n\nfor root, dirs, files in os.walk('.'):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]


@pytest.fixture(scope="module")
def smol_pair(small_real_lm):
    """SmolLM2-135M as target; a truncated copy (first 2/3 of the layers) as draft."""
    model, tok = small_real_lm
    draft = copy.deepcopy(model)
    n = len(draft.model.layers)
    draft.model.layers = draft.model.layers[: (2 * n) // 3]
    draft.config.num_hidden_layers = len(draft.model.layers)
    return model, draft, tok


@pytest.mark.parametrize("ratio,k", [(0.0, 3), (0.5, None), (0.8, 4)])
def test_smollm_batch_greedy_equals_target(smol_pair, ratio, k):
    target, draft, tok = smol_pair
    dec = SpeculativeDecoder.from_models(
        target, draft, tok, compression_ratio=ratio, num_draft_tokens=k
    )
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in CODE_PROMPTS]
    reqs = [GenerationRequest(f"r{i}", p, 32) for i, p in enumerate(ids)]
    results = dec.generate_batch(reqs)
    for p, res in zip(ids, results, strict=True):
        assert res.output_ids == target_greedy(target, p, 32)
    if k is None:
        # Adaptive k: this truncated draft accepts ~8% of its tokens at ratio 0.5, so
        # after a few probes the decoder rightly takes plain target steps; "accepted >
        # 0" over its ~15-25 probe drafts failed by chance (~30%), so check it probed.
        assert dec.stats.drafted > 0
    else:  # drafts were really used: the draft's, or lookup drafts swapped in for them
        assert dec.stats.accepted + dec.stats.lookup_accepted > 0


def test_smollm_text_api_and_sampling(smol_pair):
    target, draft, tok = smol_pair
    dec = SpeculativeDecoder.from_models(target, draft, tok, compression_ratio=0.3)
    res = dec.generate("def add(a, b):\n", 16, SamplingParams(temperature=0.8, seed=5))
    again = dec.generate("def add(a, b):\n", 16, SamplingParams(temperature=0.8, seed=5))
    assert res.output_ids == again.output_ids
    assert isinstance(dec.decode(res.output_ids), str)


def test_qwen_pair_fp32_greedy_equals_target(real_model_pair):
    dec = SpeculativeDecoder.from_pretrained(
        target=str(real_model_pair.target),
        draft=str(real_model_pair.draft),
        dtype="float32",
        device="cpu",
        compression_ratio=0.5,
        num_draft_tokens=None,
        # adaptive k, but always drafting: in fp32 a multi-token verify costs more than a
        # one-token step, so the timing-driven skip (k = 0) may otherwise draft too
        # rarely for the acceptance check below (seen: 5 drafts in 19 steps)
        adaptive_skip=False,
        # the draft model's proposals only: lookup drafts (copied from the text, chosen
        # by measured cost) took steps from it in a CI run (9 drafts, 39 lookup tokens)
        lookup_tokens=0,
    )
    ids = dec.encode(CODE_PROMPTS[2])
    with torch.inference_mode():
        ref = target_greedy(dec.target, ids, 24)
    res = dec.generate(ids, 24, stop_token_ids=[])
    assert res.output_ids == ref
    assert res.stats.drafted >= 10
    assert res.stats.mean_accepted_length > 1.5  # the real draft does agree often


def test_seed_constructor_form(small_real_model, monkeypatch):
    """SpeculativeDecoder(small_model_path=..., compression_ratio=0.3, vocab_size=100000)."""
    monkeypatch.setenv("MODEL_PATH", str(small_real_model))  # target from MODEL_PATH
    dec = SpeculativeDecoder(
        small_model_path=str(small_real_model),
        compression_ratio=0.3,
        vocab_size=100000,
        dtype="float32",
        device="cpu",
        num_draft_tokens=3,
    )
    assert dec.compression_ratio == 0.3
    ids = dec.encode(CODE_PROMPTS[0])
    res = dec.generate(ids, 12, stop_token_ids=[])
    assert res.output_ids == target_greedy(dec.target, ids, 12)
    assert res.stats.mean_accepted_length > 2  # draft == target: almost everything accepted
