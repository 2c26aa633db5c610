"""A hand-written weight-only int8 (or int4-MLP) draft forward for Llama/Qwen2 decoders.

Why: the draft only proposes tokens, so it may be approximate, but its step time
decides the speed-up. Framework modules (one nn.Linear per projection, dynamic
activation quantisation, generic attention dispatch) cost more than the matmuls
at batch 1-4. This forward keeps int8 weights, fuses q/k/v and gate/up into one
matmul each, and calls low-bit kernels directly with activations in bfloat16. With
mlp_bits=4 the MLP weights (most of a layer's bytes) are int4 groups of 64: the draft
step is bound by memory traffic, so halving those bytes buys much more step time than
it costs agreement with the bf16 draft's argmax (figures: docs/engine.md, benchmark
section).

Kernels: where the CPU has AVX512-VNNI and a C compiler is present, the native ones of
native_kernels.py (asymmetric groups of 64 for int4 and int8, activations quantised to
int8 per group); else aten's `_weight_int4pack_mm_for_cpu` (int4 groups of 64) and
`_weight_int8pack_mm` (per-output-channel int8).

It is a drop-in for the draft's base model as the decoder calls it (decoding/kv.forward):
`base(input_ids=, attention_mask=4D additive mask, position_ids=, cache=DynamicCache)`
returning an object with `.last_hidden_state`; the cache is the decoder's batched
KV cache with holes (decoding/kv.py), updated through `cache.update`, so roll-back,
compaction and row selection work unchanged. The target is never touched, so the
output stays exact.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from slimspec.cpu import native_kernels
from slimspec.cpu.native_kernels import NativeLowBitLinear
from slimspec.cpu.projections import Projection, low_bit_projection
from slimspec.decoding.kv import NativeRooms

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
FUSED_BITS = {"int8-fused": 8, "int4-fused": 4, "bf16-fused": 16}  # mode -> MLP weight bits


def int8pack_available() -> bool:
    """True when this torch build has a working CPU/GPU `_weight_int8pack_mm`."""
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:
        a = torch.ones(1, 32, dtype=torch.bfloat16)
        w = torch.ones(8, 32, dtype=torch.int8)
        op(a, w, torch.ones(8, dtype=torch.bfloat16))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def int4pack_available() -> bool:
    """True when this torch build has the CPU int4 weight-only kernels."""
    pack = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    mm = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    if pack is None or mm is None:
        return False
    try:
        packed = pack(torch.zeros(16, 64, dtype=torch.int32), 2)
        mm(torch.ones(1, 64, dtype=torch.bfloat16), packed, 64, torch.ones(1, 16, 2).bfloat16())
    except (RuntimeError, NotImplementedError):
        return False
    return True


def check_supported(model: Any, mode: str = "int8-fused") -> None:
    """Raise ValueError naming why the fused int8 draft cannot run this model."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    cfg = cfg or model.config
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"draft_quantization={mode!r} supports model types {SUPPORTED_MODEL_TYPES}, "
            f"got {mtype!r}; use draft_quantization='int8' or None for this draft"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"{mode} draft needs hidden_act='silu', got {cfg.hidden_act!r}")
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{mode} draft supports full attention only (use_sliding_window)")
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{mode} draft does not support mlp_bias=True")
    if mode != "bf16-fused" and not int8pack_available():
        raise ValueError(
            f"draft_quantization={mode!r} needs torch.ops.aten._weight_int8pack_mm, "
            f"which this torch build ({torch.__version__}) lacks; use 'int8' or None"
        )
    if mode == "int4-fused" and not int4pack_available() and native_kernels.load() is None:
        raise ValueError(
            "draft_quantization='int4-fused' needs torch.ops.aten._weight_int4pack_mm_for_cpu "
            f"(this torch build, {torch.__version__}, lacks it) or the native AVX512-VNNI or AVX2 "
            "kernels (native_kernels.py: not available on this CPU/compiler); use 'int8-fused'"
        )


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
            for b, lin in zip(biases, linears, strict=True)
        ]
    )


class _Layer:
    def __init__(self, layer: Any, dtype: torch.dtype, mlp_bits: int) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.head_dim = attn.head_dim
        self.n_q = attn.q_proj.out_features // self.head_dim
        self.n_kv = attn.k_proj.out_features // self.head_dim
        self.scaling = float(attn.scaling)
        # Attention projections stay 8-bit under an int4 MLP: int4 there cost more
        # accepted length than it saved time (docs/engine.md, benchmark section).
        attn_bits = 16 if mlp_bits == 16 else 8
        self.qkv: Projection = low_bit_projection(
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
            dtype,
            attn_bits,
        )
        self.o: Projection = low_bit_projection(
            attn.o_proj.weight, attn.o_proj.bias, dtype, attn_bits
        )
        self.inter = mlp.gate_proj.out_features
        self.gate_up = low_bit_projection(
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, dtype, mlp_bits
        )
        self.down = low_bit_projection(mlp.down_proj.weight, None, dtype, mlp_bits)
        self.in_norm = layer.input_layernorm.weight.detach().to(dtype)
        self.post_norm = layer.post_attention_layernorm.weight.detach().to(dtype)
        self.eps = float(layer.input_layernorm.variance_epsilon)


SMALL_QUERY = 16  # at most this many query tokens: the explicit attention below


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention for a few query tokens with grouped KV heads, without SDPA.

    q (B, Hq, T, D); k, v (B, Hkv, L, D); allowed (B, 1, T, L) bool, every row with a
    True (a padding query sees itself). Query head h reads KV head h // (Hq / Hkv), as
    HF's repeat_kv. Why: for a few queries on CPU, two small matmuls cost a fraction of
    SDPA's flash kernel, and the draft runs one per layer per token (figures:
    docs/engine.md, benchmark section). Scores and softmax in float32.
    """
    b, hq, t, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, g * t, d), k.transpose(-1, -2))
    scores = scores.view(b, hkv, g, t, n).float() * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype).view(b, hkv, g * t, n)
    return torch.matmul(probs, v).view(b, hq, t, d)


class NativeProjections(NamedTuple):
    """One layer's projections when all of them run on the native kernels."""

    qkv: NativeLowBitLinear
    o: NativeLowBitLinear
    gate_up: NativeLowBitLinear
    down: NativeLowBitLinear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedDraftBase:
    """The draft's base model as int8 fused projections (callable like the HF base model)."""

    FILLS_CACHES_ONLY = True  # __call__ takes caches_only (decoding/kv.py fill_caches)

    def __init__(self, base: Any, dtype: torch.dtype, mlp_bits: int = 8) -> None:
        self.config = base.config
        self.dtype = dtype
        # Embeddings stay in the draft dtype: a lookup is cheap and often tied to the head.
        self.embed = base.get_input_embeddings()
        self.rotary = base.rotary_emb  # the model's own RoPE (scaling variants included)
        self.layers = [_Layer(layer, dtype, mlp_bits) for layer in base.layers]
        self.norm = base.norm.weight.detach().to(dtype)
        self.eps = float(base.norm.variance_epsilon)
        # Whole layers through the native kernels (norms, RoPE, attention, SiLU and the
        # residual adds inside 2 kernel calls) when every projection is native.
        self._native = self._native_projections()
        self._lib = native_kernels.load() if self._native is not None else None
        self._step_layers = self._one_call_layers()
        self._rooms = NativeRooms(len(self.layers))  # the rooms _step_layers points at

    def _native_projections(self) -> list[NativeProjections] | None:
        """Every layer's projections when all are native and every head fits the kernels
        (which read and write bfloat16 activations); else None."""
        if self.dtype != torch.bfloat16:
            return None
        layers = []
        for lyr in self.layers:
            qkv, o, gate_up, down = lyr.qkv, lyr.o, lyr.gate_up, lyr.down
            if (
                not isinstance(qkv, NativeLowBitLinear)
                or not isinstance(o, NativeLowBitLinear)
                or not isinstance(gate_up, NativeLowBitLinear)
                or not isinstance(down, NativeLowBitLinear)
                or lyr.head_dim % 16
            ):
                return None
            layers.append(NativeProjections(qkv, o, gate_up, down))
        return layers

    def _one_call_layers(self) -> ctypes.Array[native_kernels.DraftLayer] | None:
        """Every layer's weights as draft_layers_step reads them (the rooms are set per
        step), where the layers run natively with one shape of heads; else None."""
        if self._native is None or len({(y.n_q, y.n_kv, y.head_dim) for y in self.layers}) != 1:
            return None
        out = (native_kernels.DraftLayer * len(self.layers))()
        for dst, lyr, p in zip(out, self.layers, self._native, strict=True):
            dst.qkv, dst.o, dst.gate_up, dst.down = (x.desc for x in p)
            dst.in_norm, dst.post_norm = lyr.in_norm.data_ptr(), lyr.post_norm.data_ptr()
            dst.in_eps = dst.post_eps = lyr.eps
            dst.scale = lyr.scaling
        return out

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        use_cache: bool = True,
        caches_only: bool = False,
    ) -> SimpleNamespace:
        """caches_only (a prefill, decoding/kv.py fill_caches): the last layer stops after
        updating the cache and last_hidden_state is None."""
        h = self.embed(input_ids).to(self.dtype)
        b, q, _ = h.shape
        cos, sin = self.rotary(h, position_ids)
        # Boolean "may attend" mask: the additive float mask's min would overflow in bf16.
        mask = attention_mask == 0
        last = len(self.layers) - 1 if caches_only else None
        if self._lib is not None:
            h = h.contiguous()
            if last is not None or not self._step_in_one_call(self._lib, h, cos, sin, mask, cache):
                h = self._native_layers(self._lib, h, cos, sin, mask, cache, last)
            if last is not None:
                return SimpleNamespace(last_hidden_state=None)
            h = F.rms_norm(h, (h.shape[-1],), self.norm, self.eps)
            return SimpleNamespace(last_hidden_state=h)
        cos, sin = cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)
        for i, lyr in enumerate(self.layers):
            x = F.rms_norm(h, (h.shape[-1],), lyr.in_norm, lyr.eps)
            qkv = lyr.qkv(x).view(b, q, lyr.n_q + 2 * lyr.n_kv, lyr.head_dim).transpose(1, 2)
            # RoPE on the q and k heads in one pass (fewer small ops per layer)
            qk = qkv[:, : lyr.n_q + lyr.n_kv]
            qk = qk * cos + _rotate_half(qk) * sin
            qs, ks = qk[:, : lyr.n_q], qk[:, lyr.n_q :]
            vs = qkv[:, lyr.n_q + lyr.n_kv :]
            ks, vs = cache.update(ks.contiguous(), vs.contiguous(), i)
            if i == last:
                return SimpleNamespace(last_hidden_state=None)
            if q <= SMALL_QUERY:
                a = grouped_attention(qs, ks, vs, mask, lyr.scaling)
            else:  # prefill: SDPA's blocked kernel wins on long queries
                a = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=lyr.scaling, enable_gqa=lyr.n_q != lyr.n_kv
                )
            h = h + lyr.o(a.transpose(1, 2).reshape(b, q, -1))
            x = F.rms_norm(h, (h.shape[-1],), lyr.post_norm, lyr.eps)
            gu = lyr.gate_up(x)
            h = h + lyr.down(F.silu(gu[..., : lyr.inter]) * gu[..., lyr.inter :])
        h = F.rms_norm(h, (h.shape[-1],), self.norm, self.eps)
        return SimpleNamespace(last_hidden_state=h)

    def _step_in_one_call(
        self,
        lib: ctypes.CDLL,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
    ) -> bool:
        """A few-token step's layers in one native call (draft_layers_step), h (B, T,
        hidden) updated in place and the new keys and values written into the cache
        layers' spare room (kv.GrowingLayer.reserve); False where the step or the cache
        does not fit that path (the two-call loop runs instead; a room reserve made
        anew on the way holds the same keys and values).

        Why: at one token the torch work around the two calls of each layer (the cache's
        update, three new tensors, ~35 arguments through ctypes) was ~2.3 ms of a ~9.6 ms
        draft forward (24 layers) on the 2-core Zen 5. Same kernels, same order, same bits.
        """
        layers, b, q = self._step_layers, h.shape[0], h.shape[1]
        if layers is None or q > SMALL_QUERY:
            return False
        allowed = mask[:, 0].contiguous()  # (B, T, n + T)
        n = allowed.shape[-1] - q
        lyr = self.layers[0]
        if not self._rooms.reserve(cache, q, n, layers, (b, lyr.n_kv, lyr.head_dim)):
            return False
        cos2 = cos.to(self.dtype).reshape(b * q, -1).contiguous()
        sin2 = sin.to(self.dtype).reshape(b * q, -1).contiguous()
        rc = lib.draft_layers_step(
            *(h.data_ptr(), b, q, len(self.layers), layers, cos2.data_ptr(), sin2.data_ptr()),
            *(lyr.n_q, lyr.n_kv, lyr.head_dim, n, allowed.data_ptr()),
        )
        native_kernels.check_rc(rc, "draft step")
        self._rooms.grown(cache, q)
        return True

    def _native_layers(
        self,
        lib: ctypes.CDLL,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        last: int | None = None,
    ) -> torch.Tensor:
        """The decoder layers through the native kernels, h (B, T, hidden) updated in place
        (last: a layer index to stop at after its cache update, h then not final).

        Why: at one token per row the fused forward's ~35 small torch ops a layer (norms,
        RoPE, slicing, the attention's matmuls and softmax, SiLU, residual adds) cost
        about as much as its matmuls; here a layer is two kernel calls (q/k/v with its
        norm and RoPE; attention, o, the MLP and both residual adds) around the torch
        cache update. Prefill (more than SMALL_QUERY tokens) runs SDPA for attention.
        """
        native = self._native
        if native is None:
            raise RuntimeError("the native layer path needs native projections")
        b, q, _ = h.shape
        rows = h.view(b * q, -1)
        cos2 = cos.to(self.dtype).reshape(b * q, -1).contiguous()
        sin2 = sin.to(self.dtype).reshape(b * q, -1).contiguous()
        allowed = mask[:, 0].contiguous()  # (B, T, L)
        bf16 = torch.bfloat16
        for i, (lyr, p) in enumerate(zip(self.layers, native, strict=True)):
            nq, nkv, d = lyr.n_q, lyr.n_kv, lyr.head_dim
            q_rows = torch.empty(b * q, nq * d, dtype=bf16)
            k_new = torch.empty(b, nkv, q, d, dtype=bf16)
            v_new = torch.empty(b, nkv, q, d, dtype=bf16)
            rc = lib.draft_layer_pre(
                *(rows.data_ptr(), b, q, ctypes.byref(p.qkv.desc), lyr.in_norm.data_ptr()),
                *(lyr.eps, cos2.data_ptr(), sin2.data_ptr(), nq, nkv, d),
                *(q_rows.data_ptr(), k_new.data_ptr(), v_new.data_ptr()),
            )
            native_kernels.check_rc(rc, "draft layer")
            ks, vs = cache.update(k_new, v_new, i)
            if i == last:
                break
            if q <= SMALL_QUERY:
                (ks, k_rows), (vs, v_rows) = native_kernels.kv_rows(ks), native_kernels.kv_rows(vs)
                rc = lib.draft_layer_post(
                    *(rows.data_ptr(), b, q, q_rows.data_ptr(), nq, ks.data_ptr()),
                    *(vs.data_ptr(), k_rows, v_rows, allowed.data_ptr(), nkv, ks.shape[2], d),
                    lyr.scaling,
                    *(ctypes.byref(p.o.desc), lyr.post_norm.data_ptr(), lyr.eps),
                    *(ctypes.byref(p.gate_up.desc), ctypes.byref(p.down.desc)),
                )
                native_kernels.check_rc(rc, "draft layer")
                continue
            # prefill: SDPA's blocked kernel wins on long queries
            a = F.scaled_dot_product_attention(
                q_rows.view(b, q, nq, d).transpose(1, 2),
                ks,
                vs,
                attn_mask=mask,
                scale=lyr.scaling,
                enable_gqa=nq != nkv,
            )
            p.o.fused(a.transpose(1, 2).reshape(b * q, -1), residual=rows)
            gu = p.gate_up.fused(rows, norm=lyr.post_norm, eps=lyr.eps)
            p.down.fused(gu, silu_gate=True, residual=rows)
        return h


class FusedDraft:
    """What the decoder keeps as `self.draft`: the fused base plus the original LM head.

    Holding no reference to the original layers lets their bf16/fp32 weights be freed.
    """

    def __init__(self, model: Any, mode: str = "int8-fused") -> None:
        if mode not in FUSED_BITS:
            raise ValueError(f"FusedDraft mode must be one of {sorted(FUSED_BITS)}, got {mode!r}")
        check_supported(model, mode)
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        # bf16 activations even for an fp32 draft: the int8 kernel is several times slower
        # with fp32 inputs on CPU, and draft numerics only affect acceptance, never the output.
        dtype = torch.bfloat16
        self.config = model.config
        self.mode = mode
        self._base = FusedDraftBase(base, dtype, mlp_bits=FUSED_BITS[mode])
        self._head = model.get_output_embeddings()

    def get_decoder(self) -> FusedDraftBase:
        return self._base

    def get_output_embeddings(self) -> torch.nn.Module:
        return self._head

    def eval(self) -> FusedDraft:
        return self
