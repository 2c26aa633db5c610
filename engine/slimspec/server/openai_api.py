"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models.

Defaults follow the OpenAI API: temperature 1, top_p 1; max_tokens 16 for
completions, 256 for chat (both capped by --max-new-tokens). The `model` field
is accepted whatever it says; responses name the model actually served (the
configured served model name, or the target's name: model_name()).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from slimspec.decoding.types import SamplingParams
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
from slimspec.server.schemas import ChatCompletionRequest, CompletionRequest
from slimspec.server.service import EngineService, Served

router = APIRouter(prefix="/v1")


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


def _params(service: EngineService, body: Any, default_max: int) -> GenParams:
    n = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_new = check_max_tokens(
        n,
        min(default_max, service.limits.max_new_tokens),
        service.limits.max_new_tokens,
        "max_tokens",
    )
    temp = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    return GenParams(
        max_new,
        SamplingParams(temperature=temp, top_p=top_p, seed=body.seed),
        list(body.stop or []),
    )


def _usage(state: GenState) -> dict[str, int]:
    return {
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "total_tokens": state.prompt_tokens + state.completion_tokens,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _observe_ttft(service: EngineService, endpoint: str, state: GenState) -> None:
    if state.ttft_s is not None:
        service.metrics.ttft.labels(endpoint=endpoint).observe(state.ttft_s)


async def _stream(
    request: Request,
    service: EngineService,
    served: Served,
    prompt_ids: list[int],
    params: GenParams,
    make_chunk: Any,  # (delta text | None, finish_reason | None) -> dict
    include_usage: bool,
    endpoint: str,
    prefix: str = "",
) -> Response:
    state = GenState(prompt_tokens=len(prompt_ids))
    gen = text_deltas(service, served, prompt_ids, params, state)
    # Pull the first piece before answering, so 429/503 are real status codes.
    try:
        first: str | None = await gen.__anext__()
    except StopAsyncIteration:
        first = None

    async def body() -> AsyncIterator[str]:
        try:
            yield _sse(make_chunk(None, None, first_chunk=True))
            if prefix:
                yield _sse(make_chunk(prefix, None))
            if first:
                yield _sse(make_chunk(first, None))
            async for piece in gen:
                yield _sse(make_chunk(piece, None))
            yield _sse(make_chunk(None, state.finish_reason or "length"))
            if include_usage:
                yield _sse({**make_chunk(None, None), "choices": [], "usage": _usage(state)})
            yield "data: [DONE]\n\n"
        except ApiError as exc:  # e.g. deadline after the stream started
            yield _sse(error_body(exc))
        finally:
            await gen.aclose()  # cancels the request when the client went away
            _observe_ttft(service, endpoint, state)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


@router.post("/completions", summary="OpenAI-compatible text completion")
async def completions(body: CompletionRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    params = _params(service, body, 16)
    served = acquire(service)
    assert isinstance(body.prompt, str)
    prompt_ids = await _prompt_ids(service, served, body.prompt, params, body, special=True)
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model_id(request, served)
    echo = body.prompt if body.echo else ""

    def chunk(text: str | None, finish: str | None, first_chunk: bool = False) -> dict[str, Any]:
        choices = (
            []
            if first_chunk
            else [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        )
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
        }

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await _stream(
            request,
            service,
            served,
            prompt_ids,
            params,
            chunk,
            include_usage,
            "/v1/completions",
            echo,
        )
    state = await generate_text(service, served, prompt_ids, params, request.is_disconnected)
    _observe_ttft(service, "/v1/completions", state)
    out = chunk(echo + state.text, state.finish_reason or "length")
    out["usage"] = _usage(state)
    return JSONResponse(out)


@router.post("/chat/completions", summary="OpenAI-compatible chat completion")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service: EngineService = request.app.state.service
    params = _params(service, body, 256)
    served = acquire(service)
    try:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt = await asyncio.to_thread(chat_prompt, served.tokenizer, messages)
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

    def chunk(text: str | None, finish: str | None, first_chunk: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first_chunk else {}
        if text:
            delta["content"] = text
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return await _stream(
            request,
            service,
            served,
            prompt_ids,
            params,
            chunk,
            include_usage,
            "/v1/chat/completions",
        )
    state = await generate_text(service, served, prompt_ids, params, request.is_disconnected)
    _observe_ttft(service, "/v1/chat/completions", state)
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": state.text},
                    "logprobs": None,
                    "finish_reason": state.finish_reason or "length",
                }
            ],
            "usage": _usage(state),
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
            }
        )
    return {"object": "list", "data": data}
