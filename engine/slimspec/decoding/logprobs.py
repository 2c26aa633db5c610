"""Log-probabilities of emitted tokens, from the logits the target computed anyway.

A speculative step's verification forward already holds the target's logits at every
emitted position, so the speculative engine and the target-only one report the same
numbers: log-softmax of the raw logits (before temperature, top-k and top-p, as vLLM's
default), in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slimspec.decoding.types import TokenLogprob


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits (n, V): row i is the distribution that chose chosen[i]; top: how many
    likeliest alternatives to list per position (0: none)."""
    if not chosen:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(list(chosen), device=lp.device).unsqueeze(1)
    picked = lp.gather(1, idx).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(int(t), float(v)) for t, v in zip(chosen, picked, strict=True)]
    values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return [
        TokenLogprob(int(t), float(v), tuple(zip(i, tv, strict=True)))
        for t, v, i, tv in zip(chosen, picked, ids.tolist(), values.tolist(), strict=True)
    ]
