"""The int8 draft option changes speed and acceptance, never the output."""

from __future__ import annotations

import copy

import pytest
import torch
from slimspec import SpeculativeDecoder

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB


def test_int8_draft_is_exact(tiny_llama_pair):
    target, draft = tiny_llama_pair
    # fixed k, no lookup drafts: every step drafts (adaptive k may skip drafting on a
    # busy machine, and then nothing is accepted)
    dec = SpeculativeDecoder.from_models(
        target,
        copy.deepcopy(draft),
        compression_ratio=0.3,
        draft_quantization="int8",
        num_draft_tokens=3,
        lookup_tokens=0,
    )
    for p in prompts(2, TINY_VOCAB, seed=40):
        assert dec.generate(p, 20, stop_token_ids=[]).output_ids == target_greedy(target, p, 20)
    assert dec.stats.accepted > 0


def test_unknown_quantization(tiny_llama_pair):
    target, draft = tiny_llama_pair
    with pytest.raises(ValueError, match="draft_quantization"):
        SpeculativeDecoder.from_models(target, copy.deepcopy(draft), draft_quantization="int3")


def test_auto_quantization_picks_int4_fused_on_cpu_for_bf16_llama(tiny_llama_pair):
    from slimspec.cpu import fused_draft

    target, draft = tiny_llama_pair
    bf16 = copy.deepcopy(draft).to(torch.bfloat16)
    dec = SpeculativeDecoder.from_models(target, bf16, draft_quantization="auto")
    want = "int4-fused" if fused_draft.int4pack_available() else None
    assert dec.draft_quantization == want
    for p in prompts(2, TINY_VOCAB, seed=43):
        assert dec.generate(p, 16, stop_token_ids=[]).output_ids == target_greedy(target, p, 16)


def test_auto_is_the_default_and_leaves_fp32_drafts_alone(tiny_llama_pair):
    """fp32 is the reference configuration: auto keeps its draft as loaded."""
    target, draft = tiny_llama_pair
    assert SpeculativeDecoder.from_models(target, draft).draft_quantization is None
    bf16 = copy.deepcopy(draft).to(torch.bfloat16)
    default = SpeculativeDecoder.from_models(target, bf16).draft_quantization
    assert (
        default
        == SpeculativeDecoder.from_models(
            target, bf16, draft_quantization="auto"
        ).draft_quantization
    )


def test_auto_quantization_leaves_unsupported_drafts_alone():
    from slimspec.cpu.draft_quantization import resolve_auto
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert resolve_auto(gpt2, torch.device("cpu")) is None
    assert resolve_auto(gpt2, torch.device("cuda")) is None
