"""Default model loader: the speculative decoder for a target/draft pair, the
target-only baseline when no draft is given (or the decoder is unavailable)."""

from __future__ import annotations

import logging
from typing import Any

from slimspec.server.service import ModelRef

log = logging.getLogger(__name__)

NO_DRAFT = ("", "none", "null")


def has_draft(ref: ModelRef) -> bool:
    return ref.draft is not None and ref.draft.strip().lower() not in NO_DRAFT


def default_loader(ref: ModelRef) -> Any:
    from slimspec.weights.loading import load_causal_lm, resolve_device

    device = str(resolve_device(ref.device))
    if has_draft(ref):
        try:
            from slimspec.decoding.decoder import SpeculativeDecoder
        except ImportError as exc:
            log.warning("speculative decoder unavailable (%s); serving target-only", exc)
        else:
            return SpeculativeDecoder.from_pretrained(
                target=ref.target,
                draft=ref.draft,
                dtype=ref.dtype,
                device=device,
                draft_quantization=ref.draft_quantization,
                num_draft_tokens=ref.num_draft_tokens,
            )
    from slimspec.server.baseline import TargetOnlyEngine

    model, tok = load_causal_lm(ref.target, dtype=ref.dtype, device=device)
    return TargetOnlyEngine(model, tok, device=device)
