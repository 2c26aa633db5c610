"""Plain data types shared by the decoder, the scheduler (server/scheduler.py) and the server.

They are the contract between the speculative loop (decoder.py) and everything
that drives it; keep them free of torch so the server layer can import them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy (as vLLM's sampling epsilon): dividing logits by a
# temperature like 1e-300 overflows to inf/NaN, and such a row would sample garbage or
# fail the batch it shares. The limit is far below any temperature that changes a sample.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature < GREEDY_TEMPERATURE (e.g. 0) means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature >= GREEDY_TEMPERATURE  # NaN is greedy too


# Most alternatives a position's log-probabilities list (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to decode. prompt_ids are already tokenized."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()  # e.g. EOS; generation ends after one
    # None: no log-probabilities; n >= 0: each emitted token's, with the n likeliest
    # alternatives at its position (decoding/logprobs.py).
    logprobs: int | None = None
    # llguidance grammar the output must follow (decoding/grammar.py); None: free text
    grammar: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's own distribution at its
    position (raw logits: before temperature, top-k and top-p), and the likeliest
    alternatives there as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestStats:
    """Per-request speculation statistics."""

    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    verify_steps: int = 0  # target forward passes after prefill
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = accepted at draft pos i
    drafted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    prefill_time_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt tokens whose prefill the prefix cache skipped
    # lookup drafts (lookup.py), apart from the draft model's figures above
    lookup_drafted: int = 0
    lookup_accepted: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target verification (accepted drafts + 1 bonus/correction)."""
        if self.verify_steps == 0:
            return 0.0
        return (self.accepted + self.verify_steps) / self.verify_steps

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class StepOutput:
    """What one scheduler step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" (stop token) | "length" | "cancelled"
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    cached_prompt_tokens: int = 0  # prompt tokens the prefix cache served (RequestStats)


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens only, without the prompt
    finish_reason: str
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked
