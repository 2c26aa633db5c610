"""pytest fixtures: tiny random causal LMs built in-process (fixed seeds, no files).

A pair shares the vocabulary: the draft is either a noisy copy of the target
(high acceptance, exercises long accepted runs) or an independent smaller model
(low acceptance, exercises rejections).
"""

from __future__ import annotations

import copy

import pytest

TINY_VOCAB = 96


def tiny_config(
    arch: str = "llama",
    vocab: int = TINY_VOCAB,
    hidden: int = 64,
    layers: int = 2,
    seed_scale: float = 0.2,
):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=seed_scale,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **kw):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def noisy_copy(model, noise: float = 0.02, seed: int = 1):
    """A draft that mostly agrees with the target: its weights plus Gaussian noise."""
    import torch

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft.eval()


def tiny_pair(arch: str = "llama", noise: float = 0.05, seed: int = 0, attn: str = "sdpa"):
    target = tiny_model(arch, seed=seed, attn=attn)
    return target, noisy_copy(target, noise=noise, seed=seed + 1)


@pytest.fixture(scope="session")
def tiny_llama_pair():
    """(target, draft): tiny Llama target and a noisy copy as draft."""
    return tiny_pair("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_pair():
    return tiny_pair("qwen2", seed=3)


@pytest.fixture(scope="session")
def tiny_weak_pair():
    """(target, draft) with an independent, smaller draft: low acceptance."""
    target = tiny_model("llama", seed=5)
    draft = tiny_model("llama", seed=6, hidden=32, layers=1)
    return target, draft
