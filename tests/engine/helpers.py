"""Shared helpers for the engine tests."""

from __future__ import annotations

import torch


@torch.inference_mode()
def target_greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation: plain one-token-at-a-time decoding with a
    KV cache, no stop tokens (HF generate's min_new_tokens would suppress EOS)."""
    return target_greedy_with_logits(model, prompt, n)[0]


@torch.inference_mode()
def target_greedy_with_logits(
    model, prompt: list[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """target_greedy plus the float logits each token was chosen from."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[:, -1]
    out: list[int] = []
    seen: list[torch.Tensor] = []
    for _ in range(n):
        tok = int(logits.argmax(dim=-1))
        out.append(tok)
        seen.append(logits[0].float())
        logits = model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[:, -1]
    return out, seen


def assert_equal_up_to_bf16_ties(got: list[int], want: list[int], logits: list[torch.Tensor]):
    """Equal, or the first difference is a token the reference scored within a few bf16
    ulps of its own choice: multi-token verification may round differently from one
    token at a time (kernel accumulation order is the CPU's choice), which can flip an
    exact or near tie but nothing more. Tokens after a flip continue a different text,
    so only the first difference is judged."""
    if got == want:
        return
    assert len(got) == len(want), (got, want)
    i = next(j for j in range(len(got)) if got[j] != want[j])
    lg = logits[i]
    tol = float(lg.abs().max()) * 2.0**-5  # ~4 ulps of bf16 at the largest logit
    gap = float(lg[want[i]] - lg[got[i]])
    assert gap <= tol, f"token {i}: {got[i]} scored {gap:.4f} below {want[i]} (tol {tol:.4f})"


def prompts(n: int, vocab: int, seed: int = 0, lengths=(1, 2, 5, 9, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


def target_only(target, reqs) -> list[list[int]]:
    """The target-only engine (server/baseline.py) on these requests, batched."""
    from slimspec.server.baseline import TargetOnlyEngine

    eng = TargetOnlyEngine(target, tokenizer=None)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[r.request_id] for r in reqs]


def run_steps(dec, reqs, later=(), after_steps=2):  # type: ignore[no-untyped-def]
    """Every request's tokens; `later` arrive once the batch has decoded a few steps."""
    got: dict[str, list[int]] = {r.request_id: [] for r in [*reqs, *later]}
    for r in reqs:
        dec.add_request(r)
    steps = 0
    while dec.has_work():
        for out in dec.step():
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
        if steps == after_steps:
            for r in later:
                dec.add_request(r)
    return got
