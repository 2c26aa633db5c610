"""Prepacked oneDNN linears for a bf16/fp16 target on CPU.

Why: verification runs the target over k+1 tokens, and a plain bf16 `nn.Linear` on
CPU re-lays out its weight on every call of 2+ tokens, while one reordered once into
oneDNN's blocked layout (`mkldnn._reorder_linear_weight`, the packing torch.compile's
CPU freezing uses) costs about the same for 1 to 16 tokens: that is what makes
speculation pay on CPU (measurements: docs/engine.md, benchmark section).
pack_target also switches the target's attention to target_attention.py's native
small-query kernel.

Only for bf16/fp16 on CPU: fp32 keeps plain linears, so the fp32 exactness checks
compare like with like. Output stays the target's: verification is exact for the
logits the (packed) target computes.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)


def packing_available(dtype: torch.dtype) -> bool:
    """True when this torch build packs and runs a `dtype` linear through oneDNN."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 32, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 32, dtype=dtype),
            torch.ops.mkldnn._reorder_linear_weight(w),
            None,
            "none",
            [],
            "",
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return bool(torch.allclose(y.float(), torch.full((2, 16), 32.0)))


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives in oneDNN's blocked layout (inference only).

    `weight` stays readable (the decoder reads its shape, dtype and device); pack_linears
    swaps it for a one-element expanded placeholder unless another module shares it
    (tied embeddings), which frees the plain copy.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self._bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self._packed, self._bias, "none", [], ""
        )
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module, keep_weights: set[int] | None = None) -> int:
    """Replace every CPU bf16/fp16 `nn.Linear` in `model` by a PackedLinear, in place.

    Weights not in keep_weights (ids of tensors still used elsewhere, e.g. tied
    embeddings) are replaced by a one-element expanded placeholder so the original copy
    is freed and the packed copy is the only one kept. Returns how many linears were packed.
    """
    keep = keep_weights or set()
    count = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            w = child.weight
            if w.device.type != "cpu" or w.dtype not in PACKABLE_DTYPES:
                continue
            packed = PackedLinear(child)
            if id(w) not in keep:
                # Free the plain copy; keep shape/dtype/device readable for callers.
                packed.weight = nn.Parameter(w.detach().new_zeros(1).expand(w.shape), False)
            setattr(module, child_name, packed)
            count += 1
    return count


def pack_target(model: Any) -> int:
    """Pack a causal LM's linears (decoder layers and LM head) for multi-token verification,
    and give its SDPA attention the native small-query kernel (target_attention.py).

    The LM head keeps its weight when tied to the input embeddings (one copy is shared).
    """
    from slimspec.cpu import target_attention

    keep: set[int] = set()
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None:
        keep.add(id(emb.weight))
    count = pack_linears(model, keep)
    if count:
        target_attention.use_for(model)
    return count


def maybe_pack_target(model: Any, pack: bool | None) -> bool:
    """Pack the target (pack_target) where asked, or by default (None) where it runs: a
    bf16/fp16 target on CPU with oneDNN, unless SLIMSPEC_PACK_TARGET=0. Returns whether it
    did; pack=True where it cannot run is a ValueError."""
    weight = model.get_output_embeddings().weight
    usable = weight.device.type == "cpu" and packing_available(weight.dtype)
    if pack is None:
        pack = usable and os.environ.get("SLIMSPEC_PACK_TARGET", "1") != "0"
    elif pack and not usable:
        raise ValueError(
            f"pack_target=True needs a bf16/fp16 target on CPU with oneDNN, got "
            f"{weight.dtype} on {weight.device}"
        )
    if pack:
        pack_target(model)
    return bool(pack)
