"""POST /infer: {"input", "max_length"} -> {"output", "latency_ms", "compression_ratio"},
with JSON or Protobuf bodies.

`max_length` is the most NEW tokens to generate (1..--max-new-tokens); `output`
starts with the input unless include_input is false.
The body is parsed by hand so that every malformed case gets a clear 4xx.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from slimspec.decoding.types import SamplingParams
from slimspec.server import slimspec_pb2
from slimspec.server.errors import PROTOBUF, ApiError, validation_message, wants_protobuf
from slimspec.server.generation import (
    GenParams,
    acquire,
    check_max_tokens,
    generate_text,
    tokenize,
)
from slimspec.server.postprocess import OutputFormatError, format_output
from slimspec.server.schemas import InferRequest, InferResponse

router = APIRouter()


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, "invalid_encoding", f"body is not valid UTF-8 (byte {exc.start})"
        ) from None
    if not text.strip():
        raise ApiError(400, "invalid_json", "empty body; send a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "invalid_json", f"malformed JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "body must be a JSON object")
    return data


def parse_protobuf_body(raw: bytes) -> dict[str, Any]:
    from google.protobuf.unknown_fields import UnknownFieldSet

    msg = slimspec_pb2.InferRequest()
    try:
        msg.ParseFromString(raw)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, "invalid_protobuf", f"malformed InferRequest protobuf: {exc}") from None
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        nums = sorted({f.field_number for f in unknown})
        raise ApiError(400, "invalid_request", f"unknown protobuf field number(s) {nums}")
    data: dict[str, Any] = {"input": msg.input}
    for f in ("max_length", "temperature", "top_p", "seed", "include_input"):
        if msg.HasField(f):
            data[f] = getattr(msg, f)
    if msg.stop:
        data["stop"] = list(msg.stop)
    return data


def parse_infer(raw: bytes, content_type: str) -> InferRequest:
    ctype = content_type.split(";")[0].strip().lower()
    if ctype == PROTOBUF:
        data = parse_protobuf_body(raw)
    elif ctype in ("application/json", "") or ctype.endswith("+json"):
        data = parse_json_body(raw)
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"Content-Type {ctype!r} not supported; use application/json or {PROTOBUF}",
        )
    try:
        return InferRequest.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", validation_message(exc.errors())) from None


@router.post(
    "/infer",
    response_model=InferResponse,
    summary="Generate a continuation",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": InferRequest.model_json_schema()},
                PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
async def infer(request: Request) -> Response:
    t0 = time.perf_counter()
    service = request.app.state.service
    body = parse_infer(await request.body(), request.headers.get("content-type", ""))
    max_new = check_max_tokens(body.max_length, 50, service.limits.max_new_tokens, "max_length")
    served = acquire(service)
    prompt_ids = tokenize(service, served, body.input)
    params = GenParams(
        max_new_tokens=max_new,
        sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed),
        stops=list(body.stop or []),
    )
    state = await generate_text(service, served, prompt_ids, params, request.is_disconnected)
    if state.ttft_s is not None:
        service.metrics.ttft.labels(endpoint="/infer").observe(state.ttft_s)
    text = body.input + state.text if body.include_input else state.text
    try:
        output = format_output(state.text, body.format) if body.format != "text" else text
    except OutputFormatError as exc:
        raise ApiError(422, "output_format", str(exc)) from None
    resp = InferResponse(
        output=output,
        latency_ms=round((time.perf_counter() - t0) * 1000, 2),
        compression_ratio=service.compression_ratio(),
        model_version=served.ref.version,
        prompt_tokens=len(prompt_ids),
        completion_tokens=state.completion_tokens,
        finish_reason=state.finish_reason or "length",
    )
    if wants_protobuf(request):
        if body.format != "text":
            resp.output = json.dumps(output)
        pb = slimspec_pb2.InferResponse(**resp.model_dump())
        return Response(pb.SerializeToString(), media_type=PROTOBUF)
    return JSONResponse(resp.model_dump())
