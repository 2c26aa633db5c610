"""Faster draft forwards: weight-only int8 quantisation of the draft (an engine option,
separate from compression_ratio; the target is never touched, so output stays exact)."""

from __future__ import annotations

from typing import Any

import torch

QUANTIZATIONS = ("int8",)


def quantize_draft(model: Any, mode: str) -> Any:
    """Dynamic int8 quantisation of the draft's transformer Linear layers (CPU).

    The LM head is left alone: the compressed head (head.py) reads its weight.
    Dynamic int8 kernels run in float32, so the draft is converted to float32 first.
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(f"draft_quantization must be one of {QUANTIZATIONS} or None, got {mode!r}")
    from torch.ao.quantization import quantize_dynamic

    model = model.float()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    qbase = quantize_dynamic(base, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    assert qbase is base
    return model
