"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models.

Defaults follow the OpenAI API: temperature 1, top_p 1; max_tokens 16 for
completions, 256 for chat (both capped by --max-new-tokens). The `model` field
is accepted whatever it says; responses name the model actually served (the
configured served model name, or the target's name: model_name()). `n` choices are
rows of the same batch; `logprobs` come from the target's verification forward; tools
go through the model's chat template and its calls come back as `tool_calls` (tools.py).
Fields that are not honoured are refused or, when they only describe the caller,
ignored (openai_fields.py); docs/api.md lists them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slimspec.decoding.grammar import grammar_error, json_schema_grammar, lark_grammar
from slimspec.decoding.types import SamplingParams, TokenLogprob
from slimspec.server.errors import ApiError, error_body
from slimspec.server.generation import (
    GenParams,
    GenState,
    acquire,
    chat_prompt,
    check_max_tokens,
    fit_context,
    generate_text,
    text_deltas,
    tokenize,
)
from slimspec.server.logprob_format import chat_logprobs, completion_logprobs
from slimspec.server.openai_fields import check_extra_fields
from slimspec.server.schemas import (
    INT64,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
)
from slimspec.server.service import EngineService, Served
from slimspec.server.tools import (
    ToolStreamFilter,
    auto_with_format_lark,
    check_tools,
    forced_call_lark,
    parse_tool_calls,
    parse_tool_choice,
    tag_terminals,
    template_tool_calls,
    tool_call_deltas,
    tool_support,
)

router = APIRouter(prefix="/v1")
log = logging.getLogger(__name__)


def model_name(target: str) -> str:
    """The default model id: a local model directory's name, not its filesystem path;
    a registry name or hub id as given."""
    path = Path(target).expanduser()
    if target.startswith(("/", ".", "~")) or path.is_dir():
        return path.resolve().name or target
    return target


def model_id(request: Request, served: Served) -> str:
    name = request.app.state.config.served_model_name
    return name or model_name(served.ref.target)


def _explicit_max(body: Any) -> bool:
    return body.max_tokens is not None or body.max_completion_tokens is not None


async def _prompt_ids(
    service: EngineService, served: Served, text: str, params: GenParams, body: Any, special: bool
) -> list[int]:
    ids = await tokenize(service, served, text, special=special)
    params.max_new_tokens = fit_context(
        served, len(ids), params.max_new_tokens, _explicit_max(body), "max_tokens"
    )
    return ids


def _params(service: EngineService, body: Any, default_max: int, logprobs: int | None) -> GenParams:
    n = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_new = check_max_tokens(
        n,
        min(default_max, service.limits.max_new_tokens),
        service.limits.max_new_tokens,
        "max_tokens",
    )
    temp = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    top_k = max(0, body.top_k or 0)
    return GenParams(
        max_new,
        SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=body.seed),
        list(body.stop or []),
        logprobs,
    )


def _check_fields(body: Any, route: str) -> None:
    """400 for a field that would change the output and is not honoured; the ones that
    only describe the caller are named in a log line."""
    ignored = check_extra_fields(body.model_extra)
    if ignored:
        log.info("%s: ignored field(s) that describe the caller: %s", route, ", ".join(ignored))


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a chat `response_format` asks for (None: free text); 400 for one
    that is malformed."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = (response_format or {}).get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                "invalid_value",
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
    else:
        raise ApiError(
            400,
            "invalid_value",
            f"response_format type {kind!r}: use text, json_object or json_schema",
            param="response_format",
        )
    return schema


def _compiled(make: Callable[[], str], param: str) -> str:
    """A grammar from `make`; 400 naming `param` when it does not compile."""
    try:
        grammar = make()
    except ValueError as exc:
        grammar, error = "", str(exc)
    else:
        error = grammar_error(grammar)
    if error and not error.startswith("WARNING"):
        raise ApiError(400, "invalid_schema", f"{param}: {error}", param=param)
    return grammar


def response_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar a chat `response_format` asks for (None: free text); 400 for one that
    is malformed or does not compile."""
    schema = response_schema(response_format)
    if schema is None:
        return None
    return _compiled(lambda: json_schema_grammar(schema), "response_format")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, decoding and answer."""

    tools: list[dict[str, Any]]  # rendered by the template ([]: none)
    parse: bool  # read tool calls out of the output
    grammar: str | None  # decoding constraint (tools and/or response_format)
    param: str  # the field a grammar that fails to compile is blamed on

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


def tool_plan(body: ChatCompletionRequest, tokenizer: Any) -> ToolPlan:
    """tools, tool_choice and response_format together; 400 for what cannot be served
    as asked (runs on a worker thread: it probes the template and compiles grammars)."""
    tools = check_tools([t.model_dump(exclude_none=True) for t in body.tools or []])
    named = body.tool_choice
    choice = parse_tool_choice(
        named.model_dump() if isinstance(named, NamedToolChoice) else named, tools
    )
    support = tool_support(tokenizer)
    for i, m in enumerate(body.messages):
        if m.function_call is not None:
            raise ApiError(
                400,
                "unsupported_field",
                "function_call (the legacy form) is not supported: use tool_calls",
                param=f"messages.{i}.function_call",
            )
        tool_result = m.role == "tool" and not support.renders_results
        if (m.tool_calls and not support.renders_calls) or tool_result:
            param = f"messages.{i}.tool_calls" if m.tool_calls else f"messages.{i}.role"
            raise ApiError(
                400,
                "unsupported_field",
                f"{param}: the served model's chat template does not render tool calls "
                "or tool results",
                param=param,
            )
    if choice.mode == "none":
        return ToolPlan([], False, response_grammar(body.response_format), "response_format")
    if (why := support.refusal()) is not None:
        raise ApiError(400, "unsupported_field", f"tools: {why}", param="tools")
    parallel = body.parallel_tool_calls is not False
    if choice.forced:  # the answer is calls: a response_format has nothing to shape
        lark = forced_call_lark(tools, choice, parallel, tag_terminals(tokenizer))
        return ToolPlan(tools, True, _compiled(lambda: lark_grammar(lark), "tools"), "tools")
    schema = response_schema(body.response_format)
    if schema is None:  # auto: the model decides, unconstrained
        return ToolPlan(tools, True, None, "tools")
    lark = auto_with_format_lark(schema, tools, tag_terminals(tokenizer))
    return ToolPlan(tools, True, _compiled(lambda: lark_grammar(lark), "tools"), "tools")


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (ValueError for content they cannot)."""
    out = []
    for m in body.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def chat_message(text: str, finish: str, plan: ToolPlan) -> tuple[dict[str, Any], str]:
    """A whole choice's message and finish reason ("tool_calls" when it called any)."""
    if not plan.parse:
        return {"role": "assistant", "content": text}, finish
    parsed = parse_tool_calls(text, plan.names)
    if not parsed.tool_calls:
        return {"role": "assistant", "content": text}, finish
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    return message, "tool_calls"


def per_choice(params: GenParams, n: int) -> list[GenParams]:
    """One GenParams per choice (each a row of the batch). With a seed, choice i samples
    under seed + i: every choice is reproducible and choice 0 is the n = 1 answer."""
    out = []
    for i in range(n):
        sampling = params.sampling
        if sampling.seed is not None and i:
            sampling = replace(sampling, seed=(sampling.seed + i) % INT64)
        out.append(replace(params, sampling=sampling, stops=list(params.stops)))
    return out


def _usage(states: list[GenState]) -> dict[str, Any]:
    prompt = states[0].prompt_tokens
    completion = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # the prompt tokens whose prefill the prefix cache skipped (all choices share it)
        "prompt_tokens_details": {"cached_tokens": max(s.cached_tokens for s in states)},
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _observe_ttft(service: EngineService, endpoint: str, state: GenState) -> None:
    if state.ttft_s is not None:
        service.metrics.ttft.labels(endpoint=endpoint).observe(state.ttft_s)


async def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _generate_all(
    service: EngineService,
    served: Served,
    prompt_ids: list[int],
    choices: list[GenParams],
    request: Request,
) -> list[GenState]:
    """Every choice at once (rows of the same batch); one failing cancels the rest."""
    tasks = [
        asyncio.create_task(generate_text(service, served, prompt_ids, p, request.is_disconnected))
        for p in choices
    ]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        await _cancel_all(tasks)
        raise


Released = tuple[list[TokenLogprob], list[int]]  # log-probabilities and text starts


@dataclass(frozen=True)
class ChunkPart:
    """What one stream chunk (or a whole choice) says: the text piece, the finish reason,
    the released log-probabilities (None: not asked for); first: the opening chunk."""

    index: int
    text: str | None = None
    finish: str | None = None
    lps: Released | None = None
    first: bool = False


class _Released:
    """Which of a choice's released log-probabilities a stream has sent."""

    def __init__(self, states: list[GenState]) -> None:
        self.states = states
        self.sent = [0] * len(states)

    def take(self, i: int) -> Released:
        st, a = self.states[i], self.sent[i]
        self.sent[i] = len(st.logprobs)
        return st.logprobs[a:], st.token_starts[a:]


async def _first_piece(gen: AsyncIterator[str]) -> str | None:
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None


async def _stream(
    request: Request,
    service: EngineService,
    served: Served,
    prompt_ids: list[int],
    choices: list[GenParams],
    make_chunk: Callable[[ChunkPart], dict[str, Any] | None],
    include_usage: bool,
    endpoint: str,
    prefix: str = "",
) -> Response:
    states = [GenState(prompt_tokens=len(prompt_ids)) for _ in choices]
    gens = [
        text_deltas(service, served, prompt_ids, p, st)
        for p, st in zip(choices, states, strict=True)
    ]
    # Pull each choice's first piece before answering (all submitted at once), so
    # 429/503 are real status codes.
    starts = [asyncio.create_task(_first_piece(g)) for g in gens]
    try:
        firsts: list[str | None] = list(await asyncio.gather(*starts))
    except BaseException:
        await _cancel_all(starts)
        for g in gens:
            await g.aclose()
        raise
    wants_logprobs = choices[0].logprobs is not None
    released = _Released(states)

    def piece_chunk(i: int, text: str | None, finish: str | None) -> str:
        """The chunk's SSE event ("" when make_chunk holds it back: its log-probabilities
        then go with the choice's next chunk)."""
        before = released.sent[i]
        lps = released.take(i) if wants_logprobs else None
        out = make_chunk(ChunkPart(i, text, finish, lps))
        if out is None:
            assert finish is None, "a finishing chunk is always sent"
            released.sent[i] = before
            return ""
        return _sse(out)

    async def body() -> AsyncIterator[str]:
        queue: asyncio.Queue[tuple[int, str | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for piece in gens[i]:
                    await queue.put((i, piece, None))
                await queue.put((i, None, None))
            except Exception as exc:  # delivered to the stream as an error event
                await queue.put((i, None, exc))

        pumps: list[asyncio.Task[None]] = []
        try:
            for i in range(len(choices)):
                first_chunk = make_chunk(ChunkPart(i, first=True))
                if first_chunk is not None:
                    yield _sse(first_chunk)
                if prefix:  # the echoed prompt (echo refuses logprobs)
                    yield _sse(make_chunk(ChunkPart(i, prefix)) or {})
                if firsts[i] and (event := piece_chunk(i, firsts[i], None)):
                    yield event
            pumps = [asyncio.create_task(pump(i)) for i in range(len(choices))]
            running = len(choices)
            while running:
                i, piece, exc = await queue.get()
                if exc is not None:
                    raise exc
                if piece is None:
                    running -= 1
                    yield piece_chunk(i, None, states[i].finish_reason or "length")
                elif event := piece_chunk(i, piece, None):
                    yield event
            if include_usage:
                usage = make_chunk(ChunkPart(0)) or {}
                yield _sse({**usage, "choices": [], "usage": _usage(states)})
            yield "data: [DONE]\n\n"
        except ApiError as exc:  # e.g. deadline after the stream started
            yield _sse(error_body(exc))
        finally:
            await _cancel_all(pumps)
            for g in gens:
                await g.aclose()  # cancels the requests when the client went away
            for st in states:
                _observe_ttft(service, endpoint, st)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


@router.post("/completions", summary="OpenAI-compatible text completion")
async def completions(body: CompletionRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    _check_fields(body, "/v1/completions")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise ApiError(
            400, "unsupported_field", "best_of other than n is not supported", param="best_of"
        )
    if body.echo and body.logprobs is not None:
        raise ApiError(
            400,
            "unsupported_field",
            "logprobs with echo (the prompt's log-probabilities) is not supported",
            param="echo",
        )
    params = _params(service, body, 16, body.logprobs)
    served = acquire(service)
    assert isinstance(body.prompt, str)
    prompt_ids = await _prompt_ids(service, served, body.prompt, params, body, special=True)
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_id(request, served)
    echo = body.prompt if body.echo else ""
    tok = served.tokenizer

    def lp_object(lps: Released | None) -> dict[str, Any] | None:
        return None if lps is None else completion_logprobs(tok, lps[0], lps[1], len(echo))

    def chunk(p: ChunkPart) -> dict[str, Any] | None:
        if p.first and p.index:
            return None  # one opening chunk for all choices
        choices = (
            []
            if p.first
            else [
                {
                    "index": p.index,
                    "text": p.text or "",
                    "logprobs": lp_object(p.lps),
                    "finish_reason": p.finish,
                }
            ]
        )
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    choices = per_choice(params, n)
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await _stream(
            request,
            service,
            served,
            prompt_ids,
            choices,
            chunk,
            include_usage,
            "/v1/completions",
            echo,
        )
    states = await _generate_all(service, served, prompt_ids, choices, request)
    for st in states:
        _observe_ttft(service, "/v1/completions", st)
    out = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                "text": echo + st.text,
                "logprobs": lp_object((st.logprobs, st.token_starts))
                if body.logprobs is not None
                else None,
                "finish_reason": st.finish_reason or "length",
            }
            for i, st in enumerate(states)
        ],
        "usage": _usage(states),
    }
    return JSONResponse(out)


@router.post("/chat/completions", summary="OpenAI-compatible chat completion")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    _check_fields(body, "/v1/chat/completions")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(
            400, "invalid_value", "top_logprobs needs logprobs: true", param="top_logprobs"
        )
    params = _params(service, body, 256, body.logprobs_top)
    served = acquire(service)
    plan = await asyncio.to_thread(tool_plan, body, served.tokenizer)
    params.grammar = plan.grammar
    if params.grammar is not None:
        try:  # compiled here, on a worker thread, not inside a batch step
            await asyncio.to_thread(served.engine.check_grammar, params.grammar)
        except ValueError as exc:
            raise ApiError(
                400, "invalid_schema", f"{plan.param}: {exc}", param=plan.param
            ) from None
    try:
        messages = template_messages(body)
        prompt = await asyncio.to_thread(chat_prompt, served.tokenizer, messages, plan.tools)
    except ValueError as exc:
        raise ApiError(422, "invalid_value", str(exc), param="messages") from None
    except Exception as exc:  # a template may raise on unusual role orders
        raise ApiError(
            422, "invalid_messages", f"chat template failed: {exc}", param="messages"
        ) from None
    prompt_ids = await _prompt_ids(service, served, prompt, params, body, special=False)
    cid, created, model = (
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        model_id(request, served),
    )
    tok = served.tokenizer

    choices = per_choice(params, body.n or 1)
    held = [ToolStreamFilter(plan.names) for _ in choices] if plan.parse else None

    def chunk(p: ChunkPart) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if p.first else {}
        finish = p.finish
        if held is None or p.first:
            if p.text:
                delta["content"] = p.text
        else:  # content up to a tool call block; the calls when the choice ends
            shown = held[p.index].piece(p.text)
            if finish is not None:
                parsed = held[p.index].finish()
                shown += parsed.content or ""
                if parsed.tool_calls:
                    delta["tool_calls"] = tool_call_deltas(parsed.tool_calls)
                    finish = "tool_calls"
            if shown:
                delta["content"] = shown
            if not delta and finish is None:
                return None
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": p.index,
                    "delta": delta,
                    "logprobs": None if p.lps is None else chat_logprobs(tok, p.lps[0]),
                    "finish_reason": finish,
                }
            ],
        }

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await _stream(
            request,
            service,
            served,
            prompt_ids,
            choices,
            chunk,
            include_usage,
            "/v1/chat/completions",
        )
    states = await _generate_all(service, served, prompt_ids, choices, request)
    out_choices = []
    for i, st in enumerate(states):
        _observe_ttft(service, "/v1/chat/completions", st)
        message, finish = chat_message(st.text, st.finish_reason or "length", plan)
        out_choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(tok, st.logprobs) if body.logprobs else None,
                "finish_reason": finish,
            }
        )
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": out_choices,
            "usage": _usage(states),
        }
    )


@router.get("/models", summary="OpenAI-compatible model list")
async def models(request: Request) -> dict[str, Any]:
    service: EngineService = request.app.state.service
    served = service.current
    data = []
    if served is not None:
        data.append(
            {
                "id": model_id(request, served),
                "object": "model",
                "created": int(served.loaded_at),
                "owned_by": "slimspec",
                "version": served.ref.version,
                # The target's weight form in force (gguf | int8 | none) and its detail.
                "target_quantization": served.engine.target_form.quantization,
                "target_form": served.engine.target_form.detail,
                # lookup drafts' most tokens (0: off, and always without a draft)
                "lookup_tokens": served.engine.lookup_tokens,
                # the most prompt tokens the draft prefills (0: whole prompts, and
                # always without a draft)
                "draft_context": served.engine.draft_context,
            }
        )
    return {"object": "list", "data": data}
