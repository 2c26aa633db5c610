"""Attention for a target served from blocks (target_form.py), one query row at a time.

Why: with int8-quantised activations, a last-bit difference in one layer's output can
flip a rounding step in the next layer's activation quantisation and move the logits
visibly. SDPA (and any GEMM over all query rows at once) chooses its blocking by the
number of rows, so verifying k+1 positions, or a batch, would give a position other
logits than it gets alone. gguf_kernels.attention_rows computes every (row, head) with
one fixed order over the keys, so a position's logits do not depend on what is verified
beside it, and speculative output equals target-only output with the same kernels.

Registered as a transformers attention implementation; the fused prefill
(decoding/grouped_forward.py) wraps it like SDPA. It hands to SDPA only what it does
not cover (dropout, training, softcapping, sliding windows, attention sinks).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from slimspec.cpu import gguf_kernels
from slimspec.cpu.target_attention import allowed_keys, sdpa_only

NAME = "slimspec_rowwise"


def rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function contract: query (B, Hq, T, d), key/value (B, Hkv, L, d)
    -> ((B, T, Hq, d), None)."""
    t, d = query.shape[2], query.shape[3]
    if sdpa_only(module, query, key, dropout, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    allowed = allowed_keys(attention_mask, t, key.shape[2])  # None on several queries: causal
    scale = d**-0.5 if scaling is None else float(scaling)
    out = gguf_kernels.attention_rows(
        query.transpose(1, 2), key, value, allowed, scale, out_dtype=query.dtype
    )
    return out, None


def use_for(model: Any) -> None:
    """Switch a model to rowwise_attention (its masks stay the ones SDPA would get)."""
    AttentionInterface.register(NAME, rowwise_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.config._attn_implementation = NAME  # the setter recurses into sub-configs
