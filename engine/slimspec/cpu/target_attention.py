"""Small-query attention for the packed bf16 target on CPU, through the native kernel.

Why: verification runs the target over k+1 <= 16 new tokens against a few hundred
cached ones, where native_kernels.attention (float32 scores and softmax, the same
kernel the fused drafts use) takes well under half of SDPA's time on CPU
(measurements: docs/engine.md, benchmark section).

It is registered as a transformers attention implementation and only used by the
packed target (target_packing.pack_target), so the engine's target-only runs use it too.
It hands everything it does not cover back to SDPA unchanged: fp32 (so the fp32
exactness checks compare like with like), prefill (more than SMALL_QUERY queries),
no mask on several queries, head sizes the kernel does not take, softcapping,
sliding windows, attention sinks, dropout, training. In bf16 the verifier's logits
can move by a rounding step against SDPA's, which is the same kind of difference as
verifying several tokens at once (docs/engine.md: exactness is tested in fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from slimspec.cpu import native_kernels

NAME = "slimspec_small_query"
SMALL_QUERY = 16  # at most this many new tokens: the native kernel


def allowed_keys(mask: torch.Tensor | None, t: int, n_keys: int) -> torch.Tensor | None:
    """(B, T, L) bool "may attend" from HF's 4D mask (bool, or additive with 0 = allowed),
    or None where the mask does not say (no mask on more than one query)."""
    if mask is None:
        return None if t > 1 else torch.ones(1, 1, n_keys, dtype=torch.bool)
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None
    mask = mask[:, 0, :, :n_keys]
    return mask if mask.dtype == torch.bool else mask == 0


def sdpa_only(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    dropout: float,
    kwargs: dict[str, Any],
) -> bool:
    """True for calls no native attention here covers: not on CPU, heads not grouped
    evenly, dropout, training, softcapping, sliding windows or attention sinks."""
    return bool(
        query.device.type != "cpu"
        or query.shape[1] % key.shape[1]
        or dropout
        or module.training
        or any(kwargs.get(name) is not None for name in ("softcap", "sliding_window", "s_aux"))
    )


def small_query_attention(
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
    b, hq, t, d = query.shape
    lib = native_kernels.load()
    unsupported = (
        query.dtype != torch.bfloat16
        or t > SMALL_QUERY
        or d % 16
        or d > 256
        or sdpa_only(module, query, key, dropout, kwargs)
    )
    allowed = None if lib is None or unsupported else allowed_keys(attention_mask, t, key.shape[2])
    if lib is None or allowed is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    allowed = allowed.expand(b, t, key.shape[2])
    scale = d**-0.5 if scaling is None else float(scaling)
    q_rows = query.transpose(1, 2).reshape(b * t, hq * d)
    out = native_kernels.attention(lib, q_rows, hq, key, value, allowed, scale)
    return out.view(b, t, hq, d), None


def use_for(model: Any) -> bool:
    """Switch a CPU model that uses SDPA to small_query_attention where the native
    kernels run (it still hands non-bf16 calls to SDPA); returns whether it did."""
    config = model.config
    if native_kernels.load() is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, small_query_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA would get
    config._attn_implementation = NAME  # the setter recurses into sub-configs
    return True
