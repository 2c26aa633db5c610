"""Target-only engine: plain autoregressive decoding behind the decoder's step API.

It is the "no speculation" baseline the benchmark compares against, and what the
server runs when no draft model is given. Each request keeps its own KV cache;
step() advances every active request by one token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from slimspec.decoding.types import (
    GenerationRequest,
    GenerationResult,
    RequestStats,
    SamplingParams,
    StepOutput,
)


def choose_token(
    logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None
) -> int:
    """Next token from 1-D logits: greedy, or temperature/top-k/top-p sampling."""
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p
        keep[0] = True
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[idx[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen).item())


@dataclass
class _Seq:
    req: GenerationRequest
    cache: Any = None
    next_input: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    gen: torch.Generator | None = None
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class BaselineStats:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    fallbacks: int = 0


class TargetOnlyEngine:
    """One-token-per-step decoding of the target model, step API compatible."""

    def __init__(self, model: Any, tokenizer: Any, device: str = "cpu") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = device
        self.compression_ratio = 0.0
        self.quality_threshold = 0.95
        self.fallback_strategy = "auto"
        self.stats = BaselineStats()
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Lock()

    # runtime settings: accepted and reported, nothing to compress without a draft
    def set_compression_ratio(self, r: float) -> None:
        self.compression_ratio = float(r)

    def set_quality_threshold(self, t: float) -> None:
        self.quality_threshold = float(t)

    def set_fallback_strategy(self, s: str) -> None:
        self.fallback_strategy = s

    def add_request(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        gen = None
        if not req.sampling.greedy:
            gen = torch.Generator(device="cpu")
            if req.sampling.seed is not None:
                gen.manual_seed(req.sampling.seed)
            else:
                gen.seed()
        with self._lock:
            if req.request_id in self._seqs:
                raise ValueError(f"duplicate request id {req.request_id}")
            self._seqs[req.request_id] = _Seq(req=req, next_input=list(req.prompt_ids), gen=gen)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._seqs.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._seqs)

    @torch.inference_mode()
    def _advance(self, seq: _Seq) -> StepOutput:
        ids = torch.tensor([seq.next_input], device=self.device)
        if seq.cache is None:
            from transformers import DynamicCache

            seq.cache = DynamicCache(config=self.model.config)
        # updated in place (transformers >= 5 names the argument `cache`)
        out = self.model(input_ids=ids, cache=seq.cache, use_cache=True)
        if seq.output:
            seq.stats.verify_steps += 1
        tok = choose_token(out.logits[0, -1], seq.req.sampling, seq.gen)
        seq.output.append(tok)
        seq.next_input = [tok]
        if tok in seq.req.stop_token_ids:
            return StepOutput(seq.req.request_id, [tok], True, "stop")
        if len(seq.output) >= seq.req.max_new_tokens:
            return StepOutput(seq.req.request_id, [tok], True, "length")
        return StepOutput(seq.req.request_id, [tok], False)

    def step(self) -> list[StepOutput]:
        with self._lock:
            seqs = list(self._seqs.values())
        outs = []
        for seq in seqs:
            o = self._advance(seq)
            if o.finished:
                self.cancel(seq.req.request_id)
            outs.append(o)
        return outs

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> GenerationResult:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        req = GenerationRequest(
            "generate", ids, max_new_tokens, sampling or SamplingParams(), frozenset(stop_token_ids)
        )
        self.add_request(req)
        toks: list[int] = []
        reason = "length"
        while self.has_work():
            for o in self.step():
                toks.extend(o.new_token_ids)
                if o.finished:
                    reason = o.finish_reason or reason
        return GenerationResult("generate", ids, toks, reason, RequestStats())

    def warmup(self) -> None:
        self.generate(self.tokenizer.encode("Hello") or [0], 2)
