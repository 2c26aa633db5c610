"""The `draft_quantization` option: faster draft forwards (separate from
compression_ratio; the target is never touched, so output stays exact).

- "auto", the default: "int4-fused" where it runs and pays (see resolve_auto), else none.
- "int8": torch dynamic quantisation of the draft's nn.Linear layers (runs in float32;
  any architecture).
- "int8-fused": a hand-written Llama/Qwen2 draft forward with per-channel int8
  weights, fused q/k/v and gate/up projections and `aten._weight_int8pack_mm`
  (fused_draft.py); bfloat16 activations.
- "int4-fused": the same forward with the MLP weights in int4 groups of 64 (attention
  stays int8): the fastest draft step on CPU, at slightly lower acceptance.
- "bf16-fused": the same forward with every weight in bfloat16 (no quantisation, so
  the draft proposes what the bf16 draft proposes; only the framework overhead goes).
"""

from __future__ import annotations

from typing import Any

import torch

QUANTIZATIONS = ("int8", "int8-fused", "int4-fused", "bf16-fused")
# The subset head's rows in the bits of the fused draft's MLP: its second-largest read a
# step. int4 rows: a draft step 12.8 -> 12.1 ms, decode +5% (code) / +3% (English) with
# no loss of acceptance (the 0.5B draft at ratio 0.3, Intel Xeon with AMX, 8 prompts
# alternated; docs/engine.md).
HEAD_BITS = {"int8-fused": 8, "int4-fused": 4}
AUTO = "auto"  # the default: see resolve_auto


def resolve_auto(model: Any, device: torch.device) -> str | None:
    """What draft_quantization="auto" means for this draft on this device: "int4-fused"
    for a bf16/fp16 Llama/Qwen2 draft on CPU where its kernels run, else None (the draft
    as loaded).

    An fp32 draft stays as loaded: fp32 is the reference configuration (exactness is
    checked in it), so auto leaves its numerics alone; the fused drafts compute in bf16.
    """
    if device.type != "cpu":
        return None  # the fused kernels used here are the CPU ones
    if model.get_output_embeddings().weight.dtype == torch.float32:
        return None
    from slimspec.cpu.fused_draft import check_supported

    try:
        check_supported(model, "int4-fused")
    except ValueError:
        return None
    return "int4-fused"


def quantize_draft(model: Any, mode: str) -> Any:
    """Return the draft to use for `mode` (may be a new object; the LM head is kept as is).

    The LM head is left alone: the compressed head (draft_head/head.py) reads its weight.
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(
            f"draft_quantization must be one of {QUANTIZATIONS}, {AUTO!r} or None, got {mode!r}"
        )
    if mode in ("int8-fused", "int4-fused", "bf16-fused"):
        from slimspec.cpu.fused_draft import FusedDraft

        return FusedDraft(model, mode)
    from torch.ao.quantization import quantize_dynamic

    # Dynamic int8 kernels run in float32, so the draft is converted to float32 first.
    model = model.float()
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    qbase = quantize_dynamic(base, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    assert qbase is base
    return model
