"""The decoder layers of a target served from blocks (target_form.py), run without the
framework's per-module dispatch.

Why: on 2 cores the 1.5B Qwen2 target's one-row forward spent ~17 of ~63 ms outside
the native kernels, part of it (~2 ms) in dispatch: a layer calls 12 modules (norms,
attention, MLP, five projections, the activation), each through nn.Module's call
machinery, the keyword-deprecation wrappers and the projection groups' bookkeeping;
the rest is torch's elementwise kernels and the model-level work. `LeanLayer` runs
the layer's tensor operations in the same order with the same functions (the norm
class's own forward, the model file's RoPE, the attention implementation the config
names, the cache's update, one native call per projection group), so every value is
bit for bit what the modules give (tests compare); only the dispatch around them goes.
The decoder layer itself stays a module (hooks that record hidden states still fire).

In bfloat16 with a SiLU MLP (the served target) the layer goes further ("glued"):
everything but the attention runs in two native calls (gguf_kernels.layer_pre: norm,
q/k/v, RoPE; layer_post: o, residual, norm, MLP, residual), removing the ~45 small
torch operations a layer spends around its projections (one-row step of the 1.5B
target: ~60 -> ~54 ms). Its arithmetic is torch's bf16 operation by operation except
the norms' sum order and SiLU's exp, so a value can sit a bf16 step from the modules'
(tests bound the logits' difference); every row is computed on its own in one fixed
order, so verification stays exact: speculative and target-only runs use this path.

Layers of any other shape, calls the lean path does not cover (training, attention
weights asked for, activations the kernels do not take) run the original forward.
lean_stack.py runs the glued layers of a whole decoder stack in one loop
(`LeanLayer.glued_rows`), without the decoder layers' module calls.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from slimspec.cpu import gguf_kernels
from slimspec.cpu.gguf_kernels import GGUFLinear, LinearGroup

# The layer families whose forward LeanLayer reproduces (transformers' Qwen2 and Llama:
# pre-norm attention with RoPE, then a gated MLP, each added to the residual).
LAYERS = {"Qwen2DecoderLayer", "LlamaDecoderLayer"}
NORMS = {"Qwen2RMSNorm", "LlamaRMSNorm"}
SILU = {"SiLUActivation", "SiLU"}


def _group_of(members: list[Any]) -> LinearGroup | None:
    """The LinearGroup that holds exactly these projections, in this order, or None."""
    if not all(isinstance(m, GGUFLinear) and m.group is not None for m in members):
        return None
    group = members[0].group[0]
    return group if group.members == members else None


class LeanLayer:
    """A decoder layer's forward as its modules compute it, minus their dispatch."""

    def __init__(self, layer: Any) -> None:  # a decoder layer that fits()
        attn, mlp = layer.self_attn, layer.mlp
        self.attn: Any = attn
        self.original = layer.forward  # the class's forward, bound to the layer
        self.norm_in, self.norm_post = layer.input_layernorm, layer.post_attention_layernorm
        self.norm = type(self.norm_in).forward
        qkv = _group_of([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _group_of([mlp.gate_proj, mlp.up_proj])
        assert qkv is not None and gate_up is not None, "checked by fits()"
        self.qkv, self.gate_up = qkv, gate_up
        self.o: GGUFLinear = attn.o_proj
        self.down: GGUFLinear = mlp.down_proj
        self.act = mlp.act_fn
        # the whole layer but its attention in two native calls (gguf_kernels.layer_pre
        # and layer_post) where its arithmetic is theirs: RMSNorms and SiLU
        self.glued = (
            type(self.act).__name__ in SILU
            and all(hasattr(n, "variance_epsilon") for n in (self.norm_in, self.norm_post))
            and attn.head_dim % 2 == 0
        )
        family = sys.modules[type(attn).__module__]
        self.rope = family.apply_rotary_pos_emb
        self.eager = family.eager_attention_forward
        # Qwen2's attention passes its sliding window (None on full-attention layers)
        self.extra = (
            {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
        )

    @staticmethod
    def fits(layer: nn.Module) -> bool:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        family = sys.modules.get(type(attn).__module__)
        norms = (
            getattr(layer, "input_layernorm", None),
            getattr(layer, "post_attention_layernorm", None),
        )
        return (
            type(layer).__name__ in LAYERS
            and attn is not None
            and mlp is not None
            and all(type(n).__name__ in NORMS for n in norms)
            and type(norms[0]) is type(norms[1])
            and _group_of([attn.q_proj, attn.k_proj, attn.v_proj]) is not None
            and _group_of([mlp.gate_proj, mlp.up_proj]) is not None
            and isinstance(attn.o_proj, GGUFLinear)
            and isinstance(mlp.down_proj, GGUFLinear)
            and hasattr(family, "apply_rotary_pos_emb")
            and hasattr(family, "eager_attention_forward")
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        attn = self.attn
        if (
            position_embeddings is None
            or "past_key_values" in kwargs
            or kwargs.get("output_attentions")
            or attn.training
            or not gguf_kernels.native_input(hidden_states)
        ):
            return self.original(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        # what the layer hands its attention module beyond the named arguments
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        cos, sin = position_embeddings
        if self._glue_fits(hidden_states, cos, sin):
            return self._glued(hidden_states, attention_mask, cache, cos, sin, kwargs)
        residual = hidden_states
        x = self.norm(self.norm_in, hidden_states)
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        q, k, v = (y.view(hidden_shape).transpose(1, 2) for y in self.qkv.outputs(x))
        q, k = self.rope(q, k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        out = self._attention(q, k, v, attention_mask, kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        hidden_states = residual + self.o.native(out)
        residual = hidden_states
        x = self.norm(self.norm_post, hidden_states)
        gate, up = self.gate_up.outputs(x)
        return residual + self.down.native(self.act(gate) * up)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        attn = self.attn
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            attn.config._attn_implementation, self.eager
        )
        out, _ = interface(
            attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **self.extra, **kwargs
        )
        return out

    def _glue_fits(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        bf16, d = torch.bfloat16, self.attn.head_dim
        return (
            self.glued
            and x.dtype == cos.dtype == sin.dtype == bf16
            and self.norm_in.weight.dtype == self.norm_post.weight.dtype == bf16
            and x.dim() == 3
            and cos.shape == sin.shape
            and cos.dim() == 3
            and cos.shape[0] in (1, x.shape[0])
            and cos.shape[1:] == (x.shape[1], d)
        )

    def _glued(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        b, t, width = hidden_states.shape
        rows = self.glued_rows(
            hidden_states.reshape(b * t, width).contiguous(),
            b,
            t,
            cos.expand(b, t, -1).reshape(b * t, -1).contiguous(),
            sin.expand(b, t, -1).reshape(b * t, -1).contiguous(),
            cache,
            kwargs,
            lambda q, k, v, _scale: self._attention(q, k, v, attention_mask, kwargs),
        )
        return rows.view(b, t, width)

    def step_layer(self) -> gguf_kernels.StepLayer:
        """This glued layer as gguf_kernels.layers_step reads it (made once)."""
        made = vars(self).get("_step")
        if made is None:
            made = gguf_kernels.step_layer(
                self.qkv,
                self.o,
                self.gate_up,
                self.down,
                (self.norm_in.weight, self.norm_post.weight),
                (self.norm_in.variance_epsilon, self.norm_post.variance_epsilon),
                self.attn.scaling,
            )
            self._step = made
        return made

    def glued_kv(
        self,
        rows: torch.Tensor,
        b: int,
        t: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Any,
        cache_kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's first native call and the cache's update: q (b, Hq, t, d) and the
        keys and values the attention reads (the cache's, with these rows appended).
        On its own it is a prefill's last layer, whose outputs nobody reads
        (lean_stack.LeanStack.forward with caches_only)."""
        attn = self.attn
        q, k, v = gguf_kernels.layer_pre(
            rows, self.norm_in.weight, self.norm_in.variance_epsilon, self.qkv, cos, sin
        )
        q, k, v = (y.view(b, t, -1, attn.head_dim).transpose(1, 2) for y in (q, k, v))
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=cache_kwargs)
        return q, k, v

    def glued_rows(
        self,
        rows: torch.Tensor,
        b: int,
        t: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: Any,
        cache_kwargs: dict[str, Any],
        attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    ) -> torch.Tensor:
        """The layer with everything but its attention in two native calls
        (gguf_kernels.layer_pre and layer_post): torch's bf16 arithmetic step by step,
        but for the norms' sum order and SiLU's exp, each row on its own.

        rows (b*t, width) and cos/sin (b*t, head_dim) bf16, contiguous; attend(q, k, v,
        scale) with q (b, Hq, t, d), k/v (b, Hkv, L, d) after the cache's update and the
        layer's attention scaling -> (b, t, Hq, d).
        Returns the layer's output rows (b*t, width)."""
        q, k, v = self.glued_kv(rows, b, t, cos, sin, cache, cache_kwargs)
        out = attend(q, k, v, self.attn.scaling).reshape(b * t, -1).contiguous()
        return gguf_kernels.layer_post(
            rows,
            out,
            self.o,
            self.norm_post.weight,
            self.norm_post.variance_epsilon,
            self.gate_up,
            self.down,
        )


def use_for(model: nn.Module) -> int:
    """Give every decoder layer that fits a lean forward; returns how many got one."""
    count = 0
    for module in model.modules():
        if LeanLayer.fits(module) and not isinstance(getattr(module, "lean", None), LeanLayer):
            lean = LeanLayer(module)
            # nn.Module's call looks the forward up on the instance first
            vars(module).update(lean=lean, forward=lean.forward)
            count += 1
    return count


def undo(model: nn.Module) -> int:
    """Give the layers their modules' forward back (for comparisons); returns how many."""
    count = 0
    for module in model.modules():
        lean = getattr(module, "lean", None)
        if isinstance(lean, LeanLayer):
            del vars(module)["forward"], vars(module)["lean"]  # the class's forward again
            count += 1
    return count
