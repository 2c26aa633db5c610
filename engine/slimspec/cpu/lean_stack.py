"""The decoder stack of a target served from blocks, run as one loop over its glued
layers (lean_layers.py) without the framework's per-layer and model-level work.

Why: with the layers glued, a one-row step of the 1.5B target is ~30 ms of native
products on a fast-memory CPU, and what transformers does around them per layer (the
decoder layer's module call and keyword wrappers, the attention interface lookup, the
mask sliced and compared again, cos/sin expanded again: 28 times a step) cost ~3 ms of
a ~34 ms step on a 2-core AMD EPYC Zen 4 (docs/engine.md). `LeanStack` does that work
once per forward: the model's own `create_causal_mask` and rotary embedding, the mask
read into "may attend" once, cos/sin laid out once, then per layer the same native
calls in the same order (gguf_kernels.layer_pre, the cache's own update,
attention_rows, layer_post), so every value is bit for bit what the per-layer path
gives (tests compare).

Anything else runs the model's own forward: inputs given as embeddings, hidden states
or attentions asked for, other keyword arguments (a grouped step's, a deprecated
name), hooks on the layers, training, an attention implementation other than the row
attention, a layer that is not glued or not the lean one any more (lean_layers.undo).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

from slimspec.cpu import gguf_kernels, rowwise_attention
from slimspec.cpu.lean_layers import LeanLayer
from slimspec.cpu.target_attention import allowed_keys
from slimspec.decoding.kv import NativeRooms

STACKS = {"Qwen2Model", "LlamaModel"}
# the row attention, alone or wrapped for grouped forwards (decoding/grouped_forward.py)
ROW_ATTENTION = {rowwise_attention.NAME, "slimspec_grouped_" + rowwise_attention.NAME}
# keyword arguments the stack takes when they ask for nothing beyond the last hidden state
QUIET = {"output_attentions", "output_hidden_states", "return_dict"}
STEP_ROWS = 64  # at most this many new rows (verification's): every layer in one call


def _inert(hook: Any) -> bool:
    """transformers' output-capturing hook: installed on the layers by the first call
    that asks for hidden states and kept, it records only while such a call runs."""
    return getattr(hook, "__qualname__", "").endswith("<locals>.output_capturing_hook")


class LeanStack:
    """A decoder stack's forward as its glued layers compute it, minus the dispatch."""

    FILLS_CACHES_ONLY = True  # forward takes caches_only (decoding/kv.py fill_caches)

    def __init__(self, base: Any) -> None:  # a decoder stack that fits()
        self.base = base
        self.original = base.forward  # the class's forward, bound to the stack
        self.decoder_layers: list[nn.Module] = list(base.layers[: base.config.num_hidden_layers])
        self.create_mask = sys.modules[type(base).__module__].create_causal_mask
        # Qwen2 returns no cache when none is used; Llama returns what it was given
        self.cache_always = type(base).__name__ == "LlamaModel"
        # the one-call step's layers (gguf_kernels.StepLayer) for these leans, and the
        # cache rooms they point at
        self._step: tuple[list[LeanLayer], Any] | None = None
        self._rooms = NativeRooms(0)

    @staticmethod
    def fits(base: nn.Module) -> bool:
        config = getattr(base, "config", None)
        layers = getattr(base, "layers", None)
        family = sys.modules.get(type(base).__module__)
        return (
            type(base).__name__ in STACKS
            and config is not None
            and layers is not None
            and len(layers) >= config.num_hidden_layers
            and all(isinstance(vars(layer).get("lean"), LeanLayer) for layer in layers)
            and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)
            and not getattr(base, "has_sliding_layers", False)
            and getattr(config, "is_causal", True)
            and config.num_attention_heads % config.num_key_value_heads == 0
            and hasattr(family, "create_causal_mask")
        )

    def _lean_layers(
        self, input_ids: Any, inputs_embeds: Any, kwargs: dict[str, Any]
    ) -> list[LeanLayer] | None:
        """The layers' lean forwards when this call is one the loop computes as the
        model would, else None. Read on every call: lean_layers.use_for/undo or a
        hook on a layer change what the model would do."""
        base, config = self.base, self.base.config
        if (
            input_ids is None
            or inputs_embeds is not None
            or base.training
            or config._attn_implementation not in ROW_ATTENTION
            or config.output_attentions
            or config.output_hidden_states
            or not config.return_dict
            or any(key not in QUIET for key in kwargs)
            or kwargs.get("output_attentions")
            or kwargs.get("output_hidden_states")
            or kwargs.get("return_dict") is False
            or torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks
        ):
            return None
        leans = []
        for layer in self.decoder_layers:
            lean = vars(layer).get("lean")
            if (
                not isinstance(lean, LeanLayer)
                or not lean.glued
                or any(not _inert(hook) for hook in layer._forward_hooks.values())
                or layer._forward_pre_hooks
                or lean.norm_in.weight.dtype != torch.bfloat16
                or lean.norm_post.weight.dtype != torch.bfloat16
            ):
                return None
            leans.append(lean)
        return leans

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        caches_only: bool = False,
        **kwargs: Any,
    ) -> Any:
        """The stack's forward. caches_only (the engine's prefills, decoding/kv.py
        fill_caches): the caller reads only the cache, so the last layer stops after its
        keys and values (its attention, o and MLP: ~3% of a 28-layer forward) and
        last_hidden_state is None. The model's own forward, where it runs instead,
        ignores it and computes everything."""
        leans = self._lean_layers(input_ids, inputs_embeds, kwargs)
        base = self.base
        h = None if leans is None else base.embed_tokens(input_ids)
        if (
            leans is None
            or h is None
            or h.dim() != 3
            or h.dtype != torch.bfloat16
            or not gguf_kernels.native_input(h)
        ):  # the model's own forward (it embeds the ids again: a rare path)
            return self.original(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                **kwargs,
            )
        if use_cache is None:
            use_cache = base.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=base.config)
        if position_ids is None:
            seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(h.shape[1], device=h.device) + seen).unsqueeze(0)
        mask = self.create_mask(
            config=base.config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        cos, sin = base.rotary_emb(h, position_ids)
        b, t, width = h.shape
        # what each glued layer would lay out for itself
        cos = cos.expand(b, t, -1).reshape(b * t, -1).contiguous()
        sin = sin.expand(b, t, -1).reshape(b * t, -1).contiguous()
        rows = h.reshape(b * t, width).contiguous()
        cache_kwargs = {"position_ids": position_ids, "use_cache": use_cache}
        allowed: dict[int, torch.Tensor | None] = {}  # by key count: one read of the mask

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            n_keys = k.shape[2]
            if n_keys not in allowed:
                allowed[n_keys] = allowed_keys(mask, t, n_keys)
            return gguf_kernels.attention_rows(
                q.transpose(1, 2), k, v, allowed[n_keys], float(scale), out_dtype=torch.bfloat16
            )

        kept = cache if use_cache or self.cache_always else None
        if not caches_only and use_cache and b * t <= STEP_ROWS:
            out = self._step_in_one_call(leans, rows, b, t, cos, sin, mask, cache)
            if out is not None:
                hidden = base.norm(out.view(b, t, width))
                return BaseModelOutputWithPast(last_hidden_state=hidden, cache=kept)
        if caches_only and use_cache and cache is not None:
            *leans, last = leans
            for lean in leans:
                rows = lean.glued_rows(rows, b, t, cos, sin, cache, cache_kwargs, attend)
            last.glued_kv(rows, b, t, cos, sin, cache, cache_kwargs)
            return BaseModelOutputWithPast(last_hidden_state=None, cache=kept)
        for lean in leans:
            rows = lean.glued_rows(rows, b, t, cos, sin, cache, cache_kwargs, attend)
        hidden = base.norm(rows.view(b, t, width))
        return BaseModelOutputWithPast(last_hidden_state=hidden, cache=kept)

    def _step_in_one_call(
        self,
        leans: list[LeanLayer],
        rows: torch.Tensor,
        b: int,
        t: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Any,
        cache: Any,
    ) -> torch.Tensor | None:
        """Every layer of a few-row step in one native call (gguf_kernels.layers_step)
        that writes the new keys and values into the cache layers' spare room
        (kv.NativeRooms); the last layer's output rows, or None where the cache does not
        fit that path (the per-layer loop runs instead).

        Why: at a few rows the torch work around each layer's three native calls (the
        cache's update, new tensors, the calls' arguments) was ~2.5-4 ms of a ~25 ms
        target forward on the 2-core Zen 5. The same calls in the same order: the same
        bits (tests compare)."""
        if cache is None or not leans:
            return None
        config, attn = self.base.config, leans[0].attn
        heads = (config.num_attention_heads, config.num_key_value_heads, attn.head_dim)
        if (
            self._step is None
            or len(self._step[0]) != len(leans)
            or any(a is not c for a, c in zip(self._step[0], leans, strict=True))
        ):
            made = [lean.step_layer() for lean in leans]
            self._step = (list(leans), (gguf_kernels.StepLayer * len(made))(*made))
            self._rooms = NativeRooms(len(leans))
        layers = self._step[1]
        n = cache.get_seq_length()
        if not self._rooms.reserve(cache, t, n, layers, (b, heads[1], heads[2])):
            return None
        widest = max(lean.gate_up.sizes[0] for lean in leans)
        allowed = allowed_keys(mask, t, n + t)
        out = gguf_kernels.layers_step(rows, b, t, layers, widest, cos, sin, heads, n, allowed)
        self._rooms.grown(cache, t)
        return out


def use_for(model: nn.Module) -> bool:
    """Give the decoder stack of `model` (its layers made lean first) a lean forward;
    returns whether it got one."""
    for module in model.modules():
        if LeanStack.fits(module) and not isinstance(getattr(module, "lean", None), LeanStack):
            lean = LeanStack(module)
            vars(module).update(lean=lean, forward=lean.forward)  # looked up on the instance
            return True
    return False


def undo(model: nn.Module) -> bool:
    """Give the decoder stack its class's forward back (for comparisons)."""
    for module in model.modules():
        if isinstance(getattr(module, "lean", None), LeanStack):
            del vars(module)["forward"], vars(module)["lean"]
            return True
    return False
