"""The int8 draft option changes speed and acceptance, never the output."""

from __future__ import annotations

import copy

import pytest
from slimspec import SpeculativeDecoder

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB


def test_int8_draft_is_exact(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(
        target, copy.deepcopy(draft), compression_ratio=0.3, draft_quantization="int8"
    )
    for p in prompts(2, TINY_VOCAB, seed=40):
        assert dec.generate(p, 20, stop_token_ids=[]).output_ids == target_greedy(target, p, 20)
    assert dec.stats.accepted > 0


def test_unknown_quantization(tiny_llama_pair):
    target, draft = tiny_llama_pair
    with pytest.raises(ValueError, match="draft_quantization"):
        SpeculativeDecoder.from_models(target, copy.deepcopy(draft), draft_quantization="int3")
