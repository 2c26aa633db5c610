"""One error type for every route, rendered as JSON in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, or as a protobuf ErrorResponse when
the client asked for protobuf. `type` is OpenAI's class of error (from the status),
`code` says exactly what went wrong, `param` names the request field (or null)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

PROTOBUF = "application/x-protobuf"


# OpenAI's error types by status; the official clients pick the exception class from
# the status (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 422
# UnprocessableEntityError, 429 RateLimitError, 5xx InternalServerError, ...).
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return ERROR_TYPES.get(status, "invalid_request_error")


class ApiError(StarletteHTTPException):
    """An HTTPException so that FastAPI's body parsing passes it through unchanged.
    kind is the error's `code`; param the request field it is about."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        retry_after: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(status, message)
        self.status = status
        self.kind = kind
        self.message = message
        self.retry_after = retry_after
        self.param = param


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
    return JSONResponse(error_body(exc), exc.status, headers)


def error_body(exc: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": exc.message,
            "type": error_type(exc.status),
            "param": exc.param,
            "code": exc.kind,
        }
    }


def _loc(e: Any) -> str:
    return ".".join(str(p) for p in e.get("loc", ()) if p != "body")


def validation_message(errors: list[Any]) -> str:
    """Pydantic errors -> one readable line per problem, naming the field."""
    parts = []
    for e in errors:
        loc = _loc(e)
        msg = e.get("msg", "invalid value")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def validation_param(errors: list[Any]) -> str | None:
    """The field of the first pydantic error (OpenAI's `param`)."""
    for e in errors:
        if loc := _loc(e):
            return loc
    return None


def invalid(errors: list[Any]) -> ApiError:
    """422 for pydantic validation errors."""
    return ApiError(
        422, "invalid_value", validation_message(errors), param=validation_param(errors)
    )


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request, exc)


async def validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(request, ApiError(400, "invalid_json", validation_message(errors)))
    return error_response(request, invalid(errors))


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Framework errors (404, 405, unparsable bodies) in the same error shape."""
    assert isinstance(exc, StarletteHTTPException)
    kinds = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in detail:
        detail = "body could not be parsed (is it valid UTF-8 JSON?)"
    err = ApiError(exc.status_code, kinds.get(exc.status_code, "error"), detail)
    resp = error_response(request, err)
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp
