"""One target forward over several groups of rows, each against its own KV cache.

Why: a new request's prompt used to get a target forward of its own before it joined
the batch. On CPU a forward's fixed cost is reading the weights (~130-160 ms for a
1.5B bf16 target, a few ms per extra token), so at 8 clients that separate prefill
was about a quarter of the wall time. Here the prompts ride on the batch's
verification forward: every group's tokens are packed into one sequence, so the
linear layers (nearly all of the cost) run once over the real tokens of all groups
and no group is padded to another's width; only attention is done per group, against
that group's cache and with its own mask (docs/engine.md, "Where a batched step goes").

How, without a model forward of our own: the forward gets the packed ids and
positions, a `GroupedStep` as its cache and as a keyword argument (`KWARG`), which the
models pass down to the attention function. The attention modules of the supported
models (Llama, Qwen2/3, Mistral) append their new keys and values through
`cache.update`; `GroupedStep.update` unpacks them into each group's cache, and the
attention function installed by `enable` runs the model's own attention (SDPA or the
native small-query kernel) once per group with that group's mask. Without the keyword
argument, that function is the model's own attention, unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from slimspec.decoding.kv import BatchKV, new_cache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
PREFIX = "slimspec_grouped_"  # + the attention implementation it wraps
KWARG = "slimspec_grouped_step"
WRAPPABLE = ("sdpa", "slimspec_small_query", "slimspec_rowwise")


@dataclass(frozen=True)
class Group:
    """Rows that share a cache: (B, q) ids, positions and which slots are real, and the
    (q, q) new-slot visibility (causal when None)."""

    kv: BatchKV
    ids: torch.Tensor
    pos: torch.Tensor
    real: torch.Tensor
    new_allowed: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.ids.numel()


class GroupedStep:
    """The forward's cache and attention mask at once: it unpacks each layer's new keys
    and values into the groups' caches and keeps the groups' full keys and values for
    that layer's attention."""

    def __init__(self, groups: Sequence[Group], masks: list[torch.Tensor], config: Any) -> None:
        self.shapes = [tuple(g.ids.shape) for g in groups]
        self.masks = masks
        self.caches = [g.kv.cache if g.kv.cache is not None else new_cache(config) for g in groups]
        self.layer_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """(1, heads, T, d) packed over the groups -> per group (B, heads, q, d)."""
        out, start = [], 0
        heads, d = packed.shape[1], packed.shape[-1]
        for b, q in self.shapes:
            part = packed[0, :, start : start + b * q].reshape(heads, b, q, d)
            out.append(part.transpose(0, 1).contiguous())
            start += b * q
        return out

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache.update's contract: append this layer's new keys/values (per group here)."""
        self.layer_kv[layer_idx] = [
            cache.update(k, v, layer_idx)
            for cache, k, v in zip(self.caches, self.unpack(key), self.unpack(value), strict=True)
        ]
        return key, value  # the attention function reads layer_kv instead


def per_group_attention(inner: Callable[..., Any]) -> Callable[..., Any]:
    """An attention function that is `inner`, except when given a GroupedStep (KWARG):
    then it runs `inner` once per group and packs the outputs back into one sequence."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        step = kwargs.pop(KWARG, None)
        if step is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        outs = []
        for q, (k, v), mask in zip(
            step.unpack(query), step.layer_kv[module.layer_idx], step.masks, strict=True
        ):
            o, _ = inner(module, q, k, v, mask, **kwargs)  # (B, q, heads, d)
            outs.append(o.reshape(1, -1, *o.shape[2:]))
        return torch.cat(outs, dim=1), None

    return attention


def enable(model: Any) -> bool:
    """Let `model` run grouped forwards (forward_groups); returns whether it can. Only for
    the model types whose attention is known to go through cache.update and pass the
    mask on untouched, and an attention implementation that takes 4D masks."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl.startswith(PREFIX):
        return True
    if getattr(text, "model_type", None) not in SUPPORTED_MODEL_TYPES or impl not in WRAPPABLE:
        return False
    name = PREFIX + impl
    AttentionInterface.register(name, per_group_attention(ALL_ATTENTION_FUNCTIONS[impl]))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = name  # the setter recurses into sub-configs
    return True


def enable_where_wanted(model: Any, wanted: bool | None) -> bool:
    """enable() unless turned off (wanted=False, or by default SLIMSPEC_FUSED_PREFILL=0,
    for A/B runs); returns whether grouped forwards are on."""
    if wanted is None:
        wanted = os.environ.get("SLIMSPEC_FUSED_PREFILL", "1") != "0"
    return bool(wanted) and enable(model)


def forward_groups(base: Any, groups: Sequence[Group]) -> list[torch.Tensor]:
    """Run the decoder stack `base` (enabled) over every group's new slots in one forward;
    each group's cache is updated in place. Returns each group's last hidden states
    (B, q, d)."""
    dtype = base.get_input_embeddings().weight.dtype
    masks = [g.kv.mask_for(g.real, dtype, g.new_allowed) for g in groups]
    step = GroupedStep(groups, masks, base.config)
    ids = torch.cat([g.ids.reshape(1, -1) for g in groups], dim=1)
    pos = torch.cat([g.pos.reshape(1, -1) for g in groups], dim=1)
    placeholder = torch.zeros(1, 1, 1, 1, dtype=dtype, device=ids.device)  # masks: per group
    out = base(
        input_ids=ids,
        attention_mask=placeholder,
        position_ids=pos,
        cache=step,
        use_cache=True,
        **{KWARG: step},
    )
    hidden, start = out.last_hidden_state, 0
    result = []
    for g, cache in zip(groups, step.caches, strict=True):
        g.kv.after_forward(cache, g.real)
        b, q = g.ids.shape
        result.append(hidden[0, start : start + b * q].reshape(b, q, -1))
        start += b * q
    return result
