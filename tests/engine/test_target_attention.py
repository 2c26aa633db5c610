"""The packed target's small-query attention (target_attention.py).

It must compute SDPA's attention (within bf16 rounding) for what it covers, hand
everything else to SDPA unchanged (fp32 above all, so the fp32 exactness checks are
untouched), and keep the packed target's greedy speculative output equal to the
packed target's own greedy decoding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import native_kernels, target_packing
from slimspec.cpu import target_attention as ta
from slimspec.decoding import grouped_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tests.engine.helpers import assert_equal_up_to_bf16_ties, prompts, target_greedy_with_logits
from tests.support.tiny_models import TINY_VOCAB, tiny_model

needs_lib = pytest.mark.skipif(
    native_kernels.load() is None, reason="no AVX512-VNNI/AVX2 CPU or C compiler for the kernels"
)
needs_packing = pytest.mark.skipif(
    not target_packing.packing_available(torch.bfloat16),
    reason="oneDNN packs bf16 linears only with AVX512 or AVX-NE-CONVERT",
)


class _Attn(torch.nn.Module):
    """What HF's attention functions read from the calling module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.eval()


def _case(t: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, n_keys, d = 2, 6, 2, 40, 64
    q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n_keys, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n_keys, d, generator=gen).to(dtype)
    allowed = torch.rand(b, 1, t, n_keys, generator=gen) > 0.3
    allowed[..., -t:] |= torch.eye(t, dtype=torch.bool)  # every query sees itself
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return _Attn(hq // hkv), q, k, v, allowed, additive


@needs_lib
@pytest.mark.parametrize("t", [1, 5, 16])
@pytest.mark.parametrize("bool_mask", [False, True])
def test_equals_sdpa_within_bf16(t, bool_mask):
    """GQA, holes in the cache, additive or boolean 4D masks, 1 to 16 queries."""
    module, q, k, v, allowed, additive = _case(t, torch.bfloat16, seed=t)
    mask = allowed if bool_mask else additive
    want, _ = sdpa_attention_forward(module, q, k, v, additive, scaling=0.125)
    got, weights = ta.small_query_attention(module, q, k, v, mask, scaling=0.125)
    assert weights is None and got.shape == want.shape == (2, t, 6, 64)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_lib
def test_one_query_without_a_mask_sees_every_key():
    module, q, k, v, _, _ = _case(1, torch.bfloat16)
    want, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)
    got, _ = ta.small_query_attention(module, q, k, v, None, scaling=0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "case",
    ["fp32", "long query", "no mask on several queries", "sliding window", "odd head size"],
)
def test_hands_what_it_does_not_cover_to_sdpa_unchanged(case, monkeypatch):
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    module, q, k, v, _, mask = _case(20 if case == "long query" else 4, dtype)
    kwargs = {"scaling": 0.125}
    if case == "no mask on several queries":
        mask = None
    if case == "sliding window":
        kwargs["softcap"] = None  # a None softcap is no softcap: still native
        kwargs["sliding_window"] = 8
    if case == "odd head size":
        q, k, v = q[..., :40], k[..., :40], v[..., :40]
    calls = []
    monkeypatch.setattr(
        ta, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or ("sdpa", None)
    )
    assert ta.small_query_attention(module, q, k, v, mask, **kwargs)[0] == "sdpa"
    assert calls == [1]


@needs_lib
@needs_packing
def test_pack_target_switches_only_sdpa_models():
    model = tiny_model("qwen2", seed=4).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    target_packing.pack_target(model)
    assert model.config._attn_implementation == ta.NAME
    ids = torch.tensor([[5, 9, 14, 30, 7, 3]])
    with torch.inference_mode():
        a, b = plain(ids).logits.float(), model(ids).logits.float()
    torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    eager = tiny_model("qwen2", seed=4, attn="eager").to(torch.bfloat16)
    assert not ta.use_for(eager) and eager.config._attn_implementation == "eager"


@needs_lib
@needs_packing
def test_speculative_greedy_equals_the_packed_targets_own_greedy():
    """With the native attention in the packed target, greedy speculative output is the
    packed target's own greedy decoding (bf16: up to near-ties, as test_cpu_pack)."""
    target = tiny_model("qwen2", seed=5).to(torch.bfloat16)
    draft = tiny_model("qwen2", seed=6).to(torch.bfloat16)
    dec = SpeculativeDecoder.from_models(target, draft, None, num_draft_tokens=4, pack_target=True)
    # the native attention, wrapped so new prompts' prefill can ride on verification
    assert dec.fused_prefill
    assert target.config._attn_implementation == grouped_forward.PREFIX + ta.NAME
    for p in prompts(3, TINY_VOCAB, seed=7):
        got = dec.generate(p, 20, stop_token_ids=[]).output_ids
        want, logits = target_greedy_with_logits(target, p, 20)
        assert_equal_up_to_bf16_ties(got, want, logits)
