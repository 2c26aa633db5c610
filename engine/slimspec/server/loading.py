"""Default model loader: the speculative decoder for a target/draft pair, the
target-only baseline when no draft is given."""

from __future__ import annotations

import logging

from slimspec.decoding.engine import Engine
from slimspec.server.service import ModelRef

log = logging.getLogger(__name__)

NO_DRAFT = ("", "none", "null")


def has_draft(ref: ModelRef) -> bool:
    return ref.draft is not None and ref.draft.strip().lower() not in NO_DRAFT


def default_loader(ref: ModelRef) -> Engine:
    from slimspec.weights.loading import load_causal_lm, resolve_device, resolve_model_path

    device = resolve_device(ref.device)
    if has_draft(ref):
        from slimspec.decoding.decoder import SpeculativeDecoder

        return SpeculativeDecoder.from_pretrained(
            target=ref.target,
            draft=ref.draft,
            dtype=ref.dtype,
            device=device,
            draft_quantization=ref.draft_quantization,
            target_quantization=ref.target_quantization,
            num_draft_tokens=ref.num_draft_tokens,
            prefill_chunk=ref.prefill_chunk,
            # None: $SLIMSPEC_PREFIX_CACHE_MB (slimspec serve sets it), else the default
            prefix_cache_mb=getattr(ref, "prefix_cache_mb", None),
        )
    from slimspec.cpu import target_form
    from slimspec.server.baseline import TargetOnlyEngine

    model, tok = load_causal_lm(ref.target, dtype=ref.dtype, device=device)
    form = target_form.apply(model, ref.target_quantization, resolve_model_path(ref.target))
    log.info("target weights: %s", form.describe())
    return TargetOnlyEngine(
        model, tok, device=str(device), prefill_chunk=ref.prefill_chunk, target_form=form
    )
