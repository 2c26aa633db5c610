"""Prepacked oneDNN linears for a bf16 target on CPU (target_packing.py).

Packing changes how fast the target verifies k+1 tokens, never what it computes
beyond bf16 rounding: a packed linear equals F.linear within bf16 tolerance, the
decoder packs only bf16/fp16 CPU targets (fp32 exactness checks compare plain
linears), and greedy speculative output equals the packed target's own greedy
decoding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import target_packing
from torch import nn

from tests.engine.helpers import (
    assert_equal_up_to_bf16_ties,
    prompts,
    target_greedy_with_logits,
)
from tests.support.tiny_models import TINY_VOCAB, noisy_copy, tiny_model

pytestmark = pytest.mark.skipif(
    not target_packing.packing_available(torch.bfloat16),
    reason="torch build lacks oneDNN bf16 linear",
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (2, 5, 64)])
def test_packed_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=bias).to(torch.bfloat16)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    want = lin(x)
    got = target_packing.PackedLinear(lin)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)


def test_pack_target_replaces_linears_and_frees_untied_weights():
    model = tiny_model("llama", seed=3).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert target_packing.pack_target(model) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    head = model.get_output_embeddings()
    assert isinstance(head, target_packing.PackedLinear)
    # untied head: the plain copy is gone, its shape still readable
    assert head.weight.shape == plain.get_output_embeddings().weight.shape
    assert head.weight.untyped_storage().nbytes() <= 2
    ids = torch.tensor([[5, 9, 14, 30, 7]])
    with torch.inference_mode():
        a, b = plain(ids).logits.float(), model(ids).logits.float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)


def test_tied_head_keeps_the_shared_embedding():
    model = tiny_model("llama", seed=4).to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight  # tie
    before = model.model.embed_tokens.weight.clone()
    target_packing.pack_target(model)
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_decoder_packs_bf16_cpu_targets_only(monkeypatch):
    t32 = tiny_model("llama", seed=5)
    dec = SpeculativeDecoder.from_models(t32, noisy_copy(t32), compression_ratio=0.0)
    assert dec.target_packed is False  # fp32: plain linears, exactness compares like with like
    with pytest.raises(ValueError, match="bf16/fp16 target on CPU"):
        SpeculativeDecoder.from_models(t32, noisy_copy(t32), pack_target=True)
    t16 = tiny_model("llama", seed=5).to(torch.bfloat16)
    dec = SpeculativeDecoder.from_models(t16, noisy_copy(t16), compression_ratio=0.0)
    assert dec.target_packed is True
    assert isinstance(dec.target.get_output_embeddings(), target_packing.PackedLinear)
    monkeypatch.setenv("SLIMSPEC_PACK_TARGET", "0")
    t16b = tiny_model("llama", seed=5).to(torch.bfloat16)
    assert SpeculativeDecoder.from_models(t16b, noisy_copy(t16b)).target_packed is False


@pytest.mark.parametrize("k", [None, 2, 5])
def test_packed_bf16_greedy_equals_packed_target_greedy(k):
    """Verification of k+1 tokens through packed linears picks the tokens the packed
    target picks one at a time, up to bf16 ties: on AMX CPUs oneDNN computes each row
    of a packed GEMM alike and the outputs are identical; on AVX-512 ones (1536x8960:
    up to 6e-5 apart) an exact tie can break the other way. The CI-sized figure of
    exactness is the fp32 suite."""
    target = tiny_model("llama", seed=6).to(torch.bfloat16)
    draft = noisy_copy(target, noise=0.05)
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=k)
    assert dec.target_packed
    for p in prompts(4, TINY_VOCAB, seed=61):
        got = dec.generate(p, 24, stop_token_ids=[]).output_ids
        want, logits = target_greedy_with_logits(dec.target, p, 24)
        assert_equal_up_to_bf16_ties(got, want, logits)
    assert dec.stats.accepted > 0
