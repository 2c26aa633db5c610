"""draft_quantization="int8-fused" / "int4-fused": a hand-written low-bit draft forward
(fused_draft.py).

It changes draft speed and acceptance, never the output: greedy output must equal
the target's own greedy decoding (fp32 targets), single and batched, on tiny
Llama/Qwen2 pairs and on SmolLM2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import fused_draft, native_kernels, projections
from slimspec.cpu.fused_draft import FusedDraft
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB

pytestmark = pytest.mark.skipif(
    not fused_draft.int8pack_available(), reason="torch lacks aten._weight_int8pack_mm"
)
MODES = ["int8-fused", "bf16-fused"] + (["int4-fused"] if fused_draft.int4pack_available() else [])
NATIVE = native_kernels.load() is not None
KERNELS = ["aten"] + (["native"] if NATIVE else [])  # native: AVX512-VNNI and a C compiler


@pytest.fixture
def kernels(request, monkeypatch):
    """Build fused drafts with the native low-bit kernels, or with aten's only."""
    if request.param == "aten":
        monkeypatch.setattr(native_kernels, "load", lambda: None)
    return request.param


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pair", ["tiny_llama_pair", "tiny_qwen2_pair", "tiny_weak_pair"])
def test_fused_draft_greedy_equals_target(pair, mode, request):
    target, draft = request.getfixturevalue(pair)
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.3, draft_quantization=mode
    )
    assert isinstance(dec.draft, FusedDraft)
    for p in prompts(3, TINY_VOCAB, seed=41):
        assert dec.generate(p, 20, stop_token_ids=[]).output_ids == target_greedy(target, p, 20)


@pytest.mark.parametrize("kernels", KERNELS, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_fused_draft_batched_fixed_k(tiny_llama_pair, mode, kernels):
    """Ragged batch, rejections and cache compaction through the fused forward."""
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.0, num_draft_tokens=4, draft_quantization=mode
    )
    ps = prompts(5, TINY_VOCAB, seed=42)
    reqs = [GenerationRequest(f"r{i}", p, 24) for i, p in enumerate(ps)]
    for p, res in zip(ps, dec.generate_batch(reqs), strict=True):
        assert res.output_ids == target_greedy(target, p, 24)
    assert dec.stats.accepted > 0  # the noisy-copy draft still agrees after int8


def prompt_hidden(base, seed: int, length: int) -> torch.Tensor:
    """Final hidden states of one prompt through a (fused or HF) base model, fresh cache."""
    from slimspec.decoding.kv import BatchKV
    from transformers import DynamicCache

    ids = torch.tensor([prompts(1, TINY_VOCAB, seed=seed, lengths=(length,))[0]])
    real = torch.ones_like(ids, dtype=torch.bool)
    with torch.inference_mode():
        out = base(
            input_ids=ids,
            attention_mask=BatchKV("cpu").mask_for(real, torch.float32),
            position_ids=torch.arange(ids.shape[1]).unsqueeze(0),
            cache=DynamicCache(config=base.config),
            use_cache=True,
        )
    return out.last_hidden_state.float()


@pytest.mark.parametrize("kernels", KERNELS, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_fused_draft_tracks_the_original(tiny_qwen2_pair, mode, kernels):
    """The low-bit forward approximates the original draft (q/k/v biases, GQA, RoPE)."""
    _, draft = tiny_qwen2_pair
    base = draft.get_decoder()
    fused = FusedDraft(draft, mode).get_decoder()
    layer = fused.layers[0]
    if mode == "int4-fused":  # the tiny MLP shapes do take the int4 path
        want = {"aten": projections.Int4Linear, "native": native_kernels.NativeLowBitLinear}
        assert isinstance(layer.gate_up, want[kernels])
    if kernels == "native" and mode != "bf16-fused":
        assert (layer.gate_up.bits, layer.qkv.bits) == (4 if mode == "int4-fused" else 8, 8)
    outs = [prompt_hidden(b, seed=43, length=9) for b in (base, fused)]
    cos = torch.nn.functional.cosine_similarity(outs[0].flatten(), outs[1].flatten(), dim=0)
    assert cos > (0.99 if mode == "int8-fused" else 0.97)


def test_fused_draft_sampling_is_seeded(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, draft_quantization="int8-fused")
    p = prompts(1, TINY_VOCAB, seed=44)[0]
    sp = SamplingParams(temperature=0.9, seed=3)
    a = dec.generate(p, 16, sp, stop_token_ids=[]).output_ids
    assert a == dec.generate(p, 16, sp, stop_token_ids=[]).output_ids
    assert len(a) == 16


def test_fused_draft_rejects_unsupported_model_type(tiny_llama_pair):
    from transformers import GPT2Config, GPT2LMHeadModel

    target, _ = tiny_llama_pair
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"int8-fused.*'gpt2'"):
        SpeculativeDecoder.from_models(target, gpt2, draft_quantization="int8-fused")


def test_fused_draft_needs_the_int8_kernel(tiny_llama_pair, monkeypatch):
    target, draft = tiny_llama_pair
    monkeypatch.setattr(fused_draft, "int8pack_available", lambda: False)
    with pytest.raises(ValueError, match="_weight_int8pack_mm"):
        SpeculativeDecoder.from_models(target, draft, draft_quantization="int8-fused")


def test_int4_draft_needs_an_int4_kernel(tiny_llama_pair, monkeypatch):
    target, draft = tiny_llama_pair
    monkeypatch.setattr(fused_draft, "int4pack_available", lambda: False)
    monkeypatch.setattr(native_kernels, "load", lambda: None)
    with pytest.raises(ValueError, match=r"_weight_int4pack_mm_for_cpu.*AVX512-VNNI"):
        SpeculativeDecoder.from_models(target, draft, draft_quantization="int4-fused")


@pytest.mark.skipif(not NATIVE, reason="no AVX512-VNNI/AVX2 CPU or C compiler for the kernels")
def test_int4_draft_runs_on_the_native_kernel_alone(tiny_llama_pair, monkeypatch):
    """Without aten's int4 kernel the int4 draft still builds (native kernel) and is exact."""
    target, draft = tiny_llama_pair
    monkeypatch.setattr(fused_draft, "int4pack_available", lambda: False)
    dec = SpeculativeDecoder.from_models(target, draft, draft_quantization="int4-fused")
    p = prompts(1, TINY_VOCAB, seed=45)[0]
    assert dec.generate(p, 16, stop_token_ids=[]).output_ids == target_greedy(target, p, 16)


@pytest.mark.skipif(not NATIVE, reason="needs the native low-bit kernels")
@pytest.mark.parametrize(
    ("mode", "bits"), [("int8-fused", 8), ("int4-fused", 4), ("bf16-fused", None)]
)
def test_the_subset_head_is_scored_in_the_drafts_mlp_bits(tiny_qwen2_pair, mode, bits):
    """An int4 draft reads its head's rows in int4 too (its second-largest read), an int8
    draft in int8; the bf16 one keeps the bf16 head. Still exact."""
    target, draft = tiny_qwen2_pair
    dec = SpeculativeDecoder.from_models(target, draft, draft_quantization=mode)
    assert dec.head.low_bit_bits == bits
    p = prompts(1, TINY_VOCAB, seed=46)[0]
    assert dec.generate(p, 16, stop_token_ids=[]).output_ids == target_greedy(target, p, 16)


def test_fused_draft_leaves_the_model_alone(tiny_llama_pair):
    _, draft = tiny_llama_pair
    before = copy.deepcopy(draft.state_dict())
    FusedDraft(draft)
    after = draft.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fused_draft_smollm_equals_target(small_real_lm, mode):
    """SmolLM2-135M (fp32) as target, its own low-bit copy as draft (shared fixture:
    FusedDraft only reads the weights)."""
    model, tok = small_real_lm
    dec = SpeculativeDecoder.from_models(
        model, model, tok, compression_ratio=0.5, num_draft_tokens=4, draft_quantization=mode
    )
    texts = ["def fibonacci(n):\n    ", "The quick brown fox", "import os\n\nfor root in"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    reqs = [GenerationRequest(f"r{i}", p, 32) for i, p in enumerate(ids)]
    for p, res in zip(ids, dec.generate_batch(reqs), strict=True):
        assert res.output_ids == target_greedy(model, p, 32)
    # a low-bit copy of the target itself should agree most of the time
    assert dec.stats.mean_accepted_length > 2.5


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (14, 2)])
def test_grouped_attention_equals_sdpa(t, hq, hkv):
    """The small-query attention equals SDPA with GQA, holes in the cache included."""
    torch.manual_seed(t + hq)
    b, n, d = 3, 37, 16
    q = torch.randn(b, hq, t, d)
    k, v = torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d)
    allowed = torch.rand(b, 1, t, n) > 0.3
    allowed[..., -t:] |= torch.eye(t, dtype=torch.bool)  # every query sees itself
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=0.25, enable_gqa=hq != hkv
    )
    got = fused_draft.grouped_attention(q, k, v, allowed, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_draft_same_hidden_state_either_attention_path(tiny_qwen2_pair, monkeypatch):
    """A prompt longer than SMALL_QUERY goes through SDPA, a short one through
    grouped_attention; the fused forward gives the same states either way (bf16-fused,
    fp32 activations would differ only in rounding)."""
    _, draft = tiny_qwen2_pair
    fused = FusedDraft(draft, "bf16-fused").get_decoder()
    outs = []
    for small in (16, 0):
        monkeypatch.setattr(fused_draft, "SMALL_QUERY", small)
        outs.append(prompt_hidden(fused, seed=44, length=12))
    torch.testing.assert_close(outs[0], outs[1], atol=0.05, rtol=0.02)


@pytest.mark.skipif(not NATIVE, reason="no AVX512-VNNI/AVX2 CPU or C compiler for the kernels")
@pytest.mark.parametrize("length", [1, 9, 40])
@pytest.mark.parametrize("mode", ["int4-fused", "bf16-fused"])
def test_native_layers_track_the_torch_layers(tiny_qwen2_pair, length, mode):
    """With native projections the fused draft runs whole layers through the native
    kernels (norms, RoPE, attention, SiLU, residuals); it tracks the same projections
    driven by torch ops. 40 tokens take the SDPA prefill path."""
    if mode == "bf16-fused" and not native_kernels.bf16_available():
        pytest.skip("no AVX512-BF16: the bf16-fused draft keeps torch's bf16 matmuls")
    _, draft = tiny_qwen2_pair
    native = FusedDraft(draft, mode).get_decoder()
    torch_glue = FusedDraft(draft, mode).get_decoder()
    assert native._lib is not None
    torch_glue._lib = None
    a, b = (prompt_hidden(m, seed=46, length=length) for m in (native, torch_glue))
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.995


def test_native_layers_only_with_native_projections(tiny_qwen2_pair, monkeypatch):
    _, draft = tiny_qwen2_pair
    bf16 = FusedDraft(draft, "bf16-fused").get_decoder()
    assert (bf16._lib is not None) == native_kernels.bf16_available()
    monkeypatch.setattr(native_kernels, "bf16_available", lambda: False)
    bf16 = FusedDraft(draft, "bf16-fused").get_decoder()
    assert bf16._lib is None and isinstance(bf16.layers[0].qkv, projections.DenseLinear)
    monkeypatch.setattr(native_kernels, "load", lambda: None)
    assert FusedDraft(draft, "int4-fused").get_decoder()._lib is None


@pytest.mark.parametrize("length", [1, 9, 40])
@pytest.mark.parametrize("glue", ["native", "torch"])
def test_a_draft_prefill_that_fills_only_the_caches_leaves_what_a_forward_leaves(
    tiny_qwen2_pair, length, glue
):
    """fill_caches (the engine's prefills): the fused draft's last layer stops after its
    keys and values, and the cache holds what a full forward leaves, bit for bit, on
    the native layers and on the torch glue (40 tokens: the SDPA prefill path)."""
    from slimspec.decoding.kv import BatchKV, fill_caches, forward

    _, draft = tiny_qwen2_pair
    base = FusedDraft(draft, "int8-fused").get_decoder()
    if glue == "torch":
        base._lib = None
    elif base._lib is None:
        pytest.skip("no native kernels here")
    ids = torch.tensor([prompts(1, TINY_VOCAB, seed=47, lengths=(length,))[0]])
    pos = torch.arange(length).unsqueeze(0)
    real = torch.ones_like(ids, dtype=torch.bool)
    full, filled = BatchKV("cpu"), BatchKV("cpu")
    with torch.inference_mode():
        forward(base, full, ids, pos, real)
        fill_caches(base, filled, ids, pos, real)
    assert full.cache is not None and filled.cache is not None
    assert len(full.cache.layers) == len(filled.cache.layers) == len(base.layers)
    for a, b in zip(full.cache.layers, filled.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.skipif(not NATIVE, reason="no AVX512-VNNI/AVX2 CPU or C compiler for the kernels")
@pytest.mark.parametrize("mode", ["int8-fused", "int4-fused"])
def test_a_draft_step_in_one_native_call_gives_the_two_call_paths_bits(
    tiny_qwen2_pair, mode, monkeypatch
):
    """Few-token steps run every layer in one native call that writes the new keys and
    values into the cache's room (draft_layers_step); what the decoder does to its draft
    (two rows with a padding hole prefilled, steps of 1 and 3 tokens, a rejection rolled
    back, rows compacted, rooms outgrown) gives the two-call path's hidden states and
    caches bit for bit, and the room is used (no prefill or copy per step)."""
    from slimspec.decoding import kv as kv_module
    from slimspec.decoding.kv import BatchKV, forward

    if mode == "int4-fused" and not fused_draft.int4pack_available():
        pytest.skip("no int4 kernel")
    _, draft = tiny_qwen2_pair
    one, two = (FusedDraft(draft, mode).get_decoder() for _ in range(2))
    assert one._step_layers is not None
    two._step_layers = None  # the two-call loop
    monkeypatch.setattr(kv_module, "GROW_MIN", 1)  # rooms made anew every few steps
    grown: list[int] = []
    real_grown = kv_module.GrowingLayer.grown
    monkeypatch.setattr(
        kv_module.GrowingLayer, "grown", lambda self, t: (grown.append(t), real_grown(self, t))
    )

    def run(base) -> tuple[list[torch.Tensor], BatchKV]:
        kv, outs = BatchKV("cpu"), []
        ids = torch.tensor([[0, 5, 9, 11, 13], [7, 8, 3, 4, 6]])
        real = torch.tensor([[False, True, True, True, True], [True] * 5])
        pos = torch.tensor([[0, 0, 1, 2, 3], [0, 1, 2, 3, 4]])
        ones = torch.ones(2, 3, dtype=torch.bool)
        with torch.inference_mode():
            outs.append(forward(base, kv, ids, pos, real))
            for j in range(3):
                step = torch.tensor([[14 + j], [9 + j]])
                outs.append(forward(base, kv, step, pos[:, -1:] + 1 + j, ones[:, :1]))
            outs.append(
                forward(
                    base,
                    kv,
                    torch.tensor([[3, 4, 5], [6, 7, 8]]),
                    pos[:, -1:] + torch.arange(4, 7),
                    ones,
                )
            )
            kv.invalidate_tail(kv.length - 3, torch.tensor([1, 3]))
            outs.append(
                forward(base, kv, torch.tensor([[2], [1]]), torch.tensor([[6], [10]]), ones[:, :1])
            )
            kv.compact()
            outs.append(
                forward(base, kv, torch.tensor([[4], [2]]), torch.tensor([[7], [11]]), ones[:, :1])
            )
        return outs, kv

    (got, kv_one), n_grown = run(one), len(grown)
    (want, kv_two) = run(two)
    assert n_grown == 6 * len(one.layers) and len(grown) == n_grown  # the two-call run: none
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(kv_one.valid, kv_two.valid)
    for a, b in zip(kv_one.cache.layers, kv_two.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
