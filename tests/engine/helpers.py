"""Shared helpers for the engine tests."""

from __future__ import annotations

import torch


@torch.inference_mode()
def target_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation: plain one-token-at-a-time decoding with a
    KV cache, no stop tokens (HF generate's min_new_tokens would suppress EOS)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[:, -1]
    out: list[int] = []
    for _ in range(n):
        tok = int(logits.argmax(dim=-1))
        out.append(tok)
        logits = model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[:, -1]
    return out


def prompts(n: int, vocab: int, seed: int = 0, lengths=(1, 2, 5, 9, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]
