"""Target-only engine: plain autoregressive decoding behind the decoder's step API.

It is the "no speculation" baseline the benchmark compares against, and what the
server runs when no draft model is given. Each request keeps its own KV cache;
step() advances every active request by one token. It has no draft, so no compressed
head: it accepts the runtime settings and reports compression_ratio 0.0 (nothing of a
draft's scoring is removed: nothing is drafted), never the ratio it was sent.
"""

from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from slimspec.cpu.target_form import TargetForm, served_form
from slimspec.decoding.engine import NO_DRAFT_RATIO, DraftHeadInfo, Engine, eos_token_ids
from slimspec.decoding.grammar import allowed_tokens, mask_logits, new_matcher
from slimspec.decoding.logprobs import token_logprobs
from slimspec.decoding.ratio_monitor import RatioReport
from slimspec.decoding.sampling import coupled_choice, race_noise, sampling_tensors, warp_probs
from slimspec.decoding.stats import DecoderStats
from slimspec.decoding.types import (
    GenerationRequest,
    GenerationResult,
    RequestStats,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)


def choose_token(logits: torch.Tensor, sampling: SamplingParams, seed: int, position: int) -> int:
    """Next token from 1-D logits: greedy, or the Gumbel-max sample of the warped
    distribution under the noise of (seed, position), the rule the speculative decoder
    uses for seeded rows, so both engines give the same text for the same seed."""
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    temperature, top_k, top_p = sampling_tensors([sampling])
    probs = warp_probs(logits.unsqueeze(0), temperature, top_k, top_p)[0]
    noise = race_noise(seed, position, logits.shape[-1]).to(probs.device)
    return int(coupled_choice(probs, noise).item())


@dataclass
class _Seq:
    req: GenerationRequest
    cache: Any = None
    next_input: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    seed: int = 0  # the request's seed, or a random one (sampling requests)
    stats: RequestStats = field(default_factory=RequestStats)
    matcher: Any = None  # the request's grammar state (decoding/grammar.py), if any


class TargetOnlyEngine(Engine):
    """One-token-per-step decoding of the target model, step API compatible."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str = "cpu",
        prefill_chunk: int = 512,
        target_form: TargetForm | None = None,
    ) -> None:
        self.model = model.eval()
        # What the target's weights are served from (cpu/target_form.py): as loaded
        # unless the loader put them in another form.
        self.target_form = target_form or served_form(model)
        self.tokenizer = tokenizer
        self.device = device
        self.stats = DecoderStats()  # nothing is drafted: the counters stay at 0
        self.prefill_chunk = prefill_chunk  # most prompt tokens prefilled per step, all requests
        text_config = model.config.get_text_config()
        self._max_context: int | None = getattr(text_config, "max_position_embeddings", None)
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self._seqs: dict[str, _Seq] = {}
        self._lock = threading.Lock()
        # Prefill wants no logits: ask for the last position's only, where the model's
        # forward takes `logits_to_keep` (transformers' causal LMs do).
        takes = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._one_logit: dict[str, int] = {"logits_to_keep": 1} if takes else {}

    @property
    def max_context(self) -> int | None:
        return self._max_context

    # No draft: nothing to compress or check. The settings are accepted (the runtime
    # ConfigMap is the same for every engine of a service) and change nothing.
    @property
    def compression_ratio(self) -> float:
        return NO_DRAFT_RATIO

    @property
    def lookup_tokens(self) -> int:
        return 0  # every token is the target's own: nothing is drafted

    @property
    def draft_context(self) -> int:
        return 0  # no draft prefills anything

    def set_compression_ratio(self, ratio: float) -> None:
        pass

    def set_quality_threshold(self, threshold: float) -> None:
        pass

    def set_fallback_strategy(self, strategy: str) -> None:
        pass

    @property
    def ratio_report(self) -> RatioReport | None:
        return None

    def ranking_status(self) -> None:
        return None

    def draft_head_info(self) -> DraftHeadInfo | None:
        return None

    def stop_token_ids(self) -> frozenset[int]:
        return eos_token_ids(self.tokenizer, self.model)

    def check_grammar(self, grammar: str) -> None:
        allowed_tokens(new_matcher(grammar, self.tokenizer, self._vocab), self._vocab)

    def add_request(self, req: GenerationRequest) -> None:
        if not req.prompt_ids:
            raise ValueError("empty prompt")
        seed = req.sampling.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        matcher = None
        if req.grammar is not None:
            matcher = new_matcher(req.grammar, self.tokenizer, self._vocab)
        with self._lock:
            if req.request_id in self._seqs:
                raise ValueError(f"duplicate request id {req.request_id}")
            self._seqs[req.request_id] = _Seq(
                req=req, next_input=list(req.prompt_ids), seed=seed, matcher=matcher
            )

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._seqs.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def _forward(self, seq: _Seq, tokens: list[int], **kwargs: Any) -> Any:
        ids = torch.tensor([tokens], device=self.device)
        if seq.cache is None:
            from transformers import DynamicCache

            seq.cache = DynamicCache(config=self.model.config)
        # updated in place (transformers >= 5 names the argument `cache`)
        return self.model(input_ids=ids, cache=seq.cache, use_cache=True, **kwargs)

    @torch.inference_mode()
    def _prefill(self, seq: _Seq, n: int) -> None:
        """The next n prompt tokens into the request's cache (the last one is kept for the
        forward that samples the first new token). No logits are used, so the LM head
        runs on one position, not n: for the 1.5B target (151,936 x 1,536) that was
        ~0.55 s of a 250-token prompt on 2 CPU cores."""
        self._forward(seq, seq.next_input[:n], **self._one_logit)
        seq.next_input = seq.next_input[n:]

    @torch.inference_mode()
    def _advance(self, seq: _Seq) -> StepOutput:
        out = self._forward(seq, seq.next_input)
        if seq.output:
            seq.stats.verify_steps += 1
        position = len(seq.req.prompt_ids) + len(seq.output)
        logits = out.logits[0, -1]
        if seq.matcher is not None:  # decide among what the grammar allows
            logits = mask_logits(logits, allowed_tokens(seq.matcher, self._vocab))
        tok = choose_token(logits, seq.req.sampling, seq.seed, position)
        if seq.matcher is not None:
            seq.matcher.consume_token(tok)
        seq.output.append(tok)
        seq.next_input = [tok]
        lps: list[TokenLogprob] | None = None
        if seq.req.logprobs is not None:
            lps = token_logprobs(out.logits[0, -1:], [tok], seq.req.logprobs)
        rid = seq.req.request_id
        if tok in seq.req.stop_token_ids:
            return StepOutput(rid, [tok], True, "stop", lps)
        if len(seq.output) >= seq.req.max_new_tokens:
            return StepOutput(rid, [tok], True, "length", lps)
        return StepOutput(rid, [tok], False, None, lps)

    def step(self) -> list[StepOutput]:
        """One token for every request whose prompt is in; prompts are prefilled in chunks
        of at most prefill_chunk tokens per step in all, so a long one never stalls the
        others for long."""
        with self._lock:
            seqs = list(self._seqs.values())
        outs = []
        budget = self.prefill_chunk
        for seq in seqs:
            if len(seq.next_input) > 1:
                if budget <= 0:
                    continue
                n = min(len(seq.next_input) - 1, budget)
                self._prefill(seq, n)
                budget -= n
                if len(seq.next_input) > 1:
                    continue
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
        logprobs: int | None = None,
    ) -> GenerationResult:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        req = GenerationRequest(
            "generate",
            ids,
            max_new_tokens,
            sampling or SamplingParams(),
            frozenset(stop_token_ids),
            logprobs,
        )
        self.add_request(req)
        toks: list[int] = []
        lps: list[TokenLogprob] | None = None if logprobs is None else []
        reason = "length"
        while self.has_work():
            for o in self.step():
                toks.extend(o.new_token_ids)
                if lps is not None and o.logprobs is not None:
                    lps.extend(o.logprobs)
                if o.finished:
                    reason = o.finish_reason or reason
        return GenerationResult("generate", ids, toks, reason, RequestStats(), lps)

    def warmup(self) -> None:
        self.generate(self.tokenizer.encode("Hello") or [0], 2)
