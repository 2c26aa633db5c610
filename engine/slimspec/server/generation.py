"""Turning a prompt into text through the scheduler: shared by every generation route.

`text_deltas` drives one request and yields text pieces as they become safe to
show (stop sequences and blocked words are applied before anything leaves), then
a final piece with the finish reason. Non-streaming routes just join the pieces.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from slimspec.decoding.types import SamplingParams, TokenLogprob
from slimspec.server.errors import ApiError
from slimspec.server.postprocess import FilterRules, apply_filters, apply_stop, safe_emit_length
from slimspec.server.scheduler import QueueFull
from slimspec.server.service import EngineService, Served, ServiceUnavailable


@dataclass
class GenParams:
    max_new_tokens: int
    sampling: SamplingParams
    stops: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; n: each token's, with n alternatives
    grammar: str | None = None  # structured output (decoding/grammar.py)


@dataclass
class GenState:
    """What a finished (or running) generation produced, for responses and metrics.

    With log-probabilities asked for, `logprobs` holds those of the tokens whose text
    has been released so far (a piece's tokens are appended before it is yielded) and
    `token_starts` where each one's text starts in the output."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_starts: list[int] = field(default_factory=list)


@dataclass
class _TokenText:
    """Tokens decoded but not yet released, with where each one's text ends."""

    pending: list[tuple[TokenLogprob, int, int]] = field(default_factory=list)  # lp, start, end
    end: int = 0

    async def add(self, tok: Any, ids: list[int], new: list[TokenLogprob]) -> None:
        """ids already holds the new tokens at its end; their text ends from decoding."""
        first = len(ids) - len(new)
        for j, lp in enumerate(new):
            text = await asyncio.to_thread(
                tok.decode, ids[: first + j + 1], skip_special_tokens=True
            )
            self.pending.append((lp, self.end, len(text)))
            self.end = len(text)

    def release(self, state: GenState, upto: int | None) -> None:
        """Tokens whose text ends by upto (None: all) go to the state, in order."""
        while self.pending and (upto is None or self.pending[0][2] <= upto):
            lp, start, _ = self.pending.pop(0)
            state.logprobs.append(lp)
            state.token_starts.append(start)

    def release_cut(self, state: GenState, cut: int) -> None:
        """After a stop sequence cut the text at `cut`: the tokens that made any of it."""
        while self.pending and self.pending[0][1] < cut:
            self.release(state, self.pending[0][2])


def check_max_tokens(n: int | None, default: int, limit: int, name: str) -> int:
    n = default if n is None else n
    if not 1 <= n <= limit:
        raise ApiError(
            400, "max_tokens_exceeded", f"{name} must be within 1..{limit}, got {n}", param=name
        )
    return n


def acquire(service: EngineService) -> Served:
    try:
        return service.served()
    except ServiceUnavailable as exc:
        raise ApiError(503, "unavailable", str(exc), retry_after=exc.retry_after_s) from None


async def tokenize(
    service: EngineService, served: Served, text: str, special: bool = True
) -> list[int]:
    """The prompt's token ids, encoded on a worker thread: a long prompt must not hold
    the event loop (health probes time out after a second)."""
    lim = service.limits
    if len(text) > lim.max_input_chars:
        raise ApiError(
            413,
            "input_too_long",
            f"input has {len(text)} characters; the limit is {lim.max_input_chars}",
        )
    tok = served.tokenizer
    ids = list(await asyncio.to_thread(tok.encode, text, add_special_tokens=special))
    if not ids:
        raise ApiError(400, "empty_prompt", "input encodes to no tokens")
    if len(ids) > lim.max_input_tokens:
        raise ApiError(
            413,
            "input_too_long",
            f"input has {len(ids)} tokens; the limit is {lim.max_input_tokens}",
        )
    return ids


def fit_context(served: Served, n_prompt: int, max_new: int, explicit: bool, name: str) -> int:
    """max_new within the model's context: a default shrinks to what is left; an explicit
    value that does not fit (or a prompt that fills the context) is a 400."""
    ctx = served.max_context
    if ctx is None or n_prompt + max_new <= ctx:
        return max_new
    room = ctx - n_prompt
    if room >= 1 and not explicit:
        return room
    raise ApiError(
        400,
        "context_length_exceeded",
        f"the prompt ({n_prompt} tokens) and {name} ({max_new}) exceed the model's context "
        f"of {ctx} tokens",
        param=name if room >= 1 else "prompt",
    )


def chat_prompt(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """The tokenizer's chat template (with the tools, when given), or a plain transcript
    when it has none (tools are refused before that: tools.py)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


async def text_deltas(
    service: EngineService,
    served: Served,
    prompt_ids: list[int],
    params: GenParams,
    state: GenState,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> AsyncGenerator[str, None]:
    """Yield output text pieces; state.finish_reason is set when the iterator ends.

    Raises ApiError 429 when the queue is full, 503 when draining, 504 on deadline.
    """
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    try:
        served, handle = service.submit(
            served,
            prompt_ids,
            params.max_new_tokens,
            params.sampling,
            loop,
            logprobs=params.logprobs,
            grammar=params.grammar,
        )
    except QueueFull as exc:
        raise ApiError(429, "overloaded", str(exc), retry_after=exc.retry_after_s) from None
    except ServiceUnavailable as exc:
        raise ApiError(503, "unavailable", str(exc), retry_after=exc.retry_after_s) from None
    service.metrics.queue_depth.set(served.scheduler.queue_depth)
    tok = served.tokenizer
    filters: FilterRules = service.filters
    ids: list[int] = []
    emitted = 0
    tokens = _TokenText() if params.logprobs is not None else None
    watcher = None
    if is_disconnected is not None:

        async def watch() -> None:
            while not handle.finished:
                if await is_disconnected():
                    handle.cancel()
                    return
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
    try:
        async for out in handle.outputs():
            if out.new_token_ids and state.ttft_s is None:
                state.ttft_s = time.monotonic() - t0
            state.cached_tokens = max(state.cached_tokens, out.cached_prompt_tokens)
            kept = [i for i, t in enumerate(out.new_token_ids) if t not in served.stop_ids]
            ids.extend(out.new_token_ids[i] for i in kept)
            state.completion_tokens += len(out.new_token_ids)
            if tokens is not None and out.logprobs is not None:
                await tokens.add(tok, ids, [out.logprobs[i] for i in kept])
            text = await asyncio.to_thread(tok.decode, ids, skip_special_tokens=True)
            cut, hit = apply_stop(text, params.stops)
            if hit:
                handle.cancel()  # no need to decode further
                state.finish_reason = "stop"
                if tokens is not None:
                    tokens.release_cut(state, len(cut))
                piece = apply_filters(cut[emitted:], filters)
                state.text += piece
                if piece:
                    yield piece
                return
            if out.finished:
                reason = out.finish_reason or "length"
                if reason == "timeout":
                    raise ApiError(
                        504,
                        "timeout",
                        "request exceeded its time limit "
                        f"({service.limits.request_timeout_s:.0f} s)",
                    )
                state.finish_reason = reason
                if tokens is not None:
                    tokens.release(state, None)
                piece = apply_filters(text[emitted:], filters)
            else:
                n = safe_emit_length(text, params.stops, filters)
                if n <= emitted:
                    continue
                if tokens is not None:
                    tokens.release(state, n)
                piece = apply_filters(text[emitted:n], filters)
                emitted = n
            state.text += piece
            if piece:
                yield piece
            if out.finished:
                return
    except ValueError as exc:  # the engine refused the request (add_request)
        raise ApiError(400, "engine_refused", f"request refused by the engine: {exc}") from None
    except RuntimeError as exc:  # engine failure, delivered by the scheduler
        raise ApiError(500, "engine_error", str(exc)) from None
    finally:
        if not handle.finished:
            handle.cancel()
        if watcher is not None:
            watcher.cancel()
        service.metrics.generated.inc(state.completion_tokens)


async def generate_text(
    service: EngineService,
    served: Served,
    prompt_ids: list[int],
    params: GenParams,
    is_disconnected: Callable[[], Awaitable[bool]] | None = None,
) -> GenState:
    state = GenState(prompt_tokens=len(prompt_ids))
    async for _ in text_deltas(service, served, prompt_ids, params, state, is_disconnected):
        pass
    return state
