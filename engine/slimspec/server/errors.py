"""One error type for every route, rendered as JSON `{"error": {...}}` (OpenAI's shape)
or as a protobuf ErrorResponse when the client asked for protobuf."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

PROTOBUF = "application/x-protobuf"


class ApiError(StarletteHTTPException):
    """An HTTPException so that FastAPI's body parsing passes it through unchanged."""

    def __init__(
        self, status: int, kind: str, message: str, retry_after: int | None = None
    ) -> None:
        super().__init__(status, message)
        self.status = status
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


def wants_protobuf(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    ctype = request.headers.get("content-type", "")
    if PROTOBUF in accept:
        return True
    return PROTOBUF in ctype and "application/json" not in accept


def error_response(request: Request, exc: ApiError) -> Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    if exc.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    if request.url.path == "/infer" and wants_protobuf(request):
        from slimspec.server import slimspec_pb2

        body = slimspec_pb2.ErrorResponse(error=exc.kind, message=exc.message)
        return Response(body.SerializeToString(), exc.status, headers, media_type=PROTOBUF)
    content = {"error": {"type": exc.kind, "code": exc.kind, "message": exc.message}}
    return JSONResponse(content, exc.status, headers)


def validation_message(errors: list[Any]) -> str:
    """Pydantic errors -> one readable line per problem, naming the field."""
    parts = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        msg = e.get("msg", "invalid value")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    kind = (
        "invalid_json"
        if any(e.get("type") == "json_invalid" for e in errors)
        else "invalid_request"
    )
    status = 400 if kind == "invalid_json" else 422
    return error_response(request, ApiError(status, kind, validation_message(errors)))


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Framework errors (404, 405, unparsable bodies) in the same error shape."""
    assert isinstance(exc, StarletteHTTPException)
    kinds = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in detail:
        detail = "body could not be parsed (is it valid UTF-8 JSON?)"
    err = ApiError(exc.status_code, kinds.get(exc.status_code, "error"), detail)
    resp = error_response(request, err)
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp
