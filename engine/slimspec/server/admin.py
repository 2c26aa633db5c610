"""Admin routes (bearer token): runtime settings, hot model swap, drain.

No token configured -> every admin route answers 403 "disabled"; a missing token
-> 401; a wrong one -> 403. Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from dataclasses import asdict, replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from slimspec.server.errors import ApiError
from slimspec.server.runtime_config import parse_settings
from slimspec.server.schemas import AdminDrainRequest, AdminSwapRequest
from slimspec.server.service import EngineService

log = logging.getLogger(__name__)
router = APIRouter(prefix="/admin")


def check_bearer(configured: str | None, header: str | None) -> None:
    """Pure decision: raise the right ApiError unless the header carries the token."""
    if not configured:
        raise ApiError(
            403, "admin_disabled", "admin API disabled: no SLIMSPEC_ADMIN_TOKEN configured"
        )
    if not header:
        raise ApiError(401, "unauthorized", "missing Authorization: Bearer <token> header")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "Authorization header must be 'Bearer <token>'")
    if not hmac.compare_digest(token.strip().encode(), configured.encode()):
        raise ApiError(403, "forbidden", "invalid admin token")


def require_admin(request: Request) -> None:
    check_bearer(request.app.state.config.admin_token, request.headers.get("authorization"))


def _runtime_view(service: EngineService) -> dict[str, Any]:
    cur = service.current
    return {
        **asdict(service.settings),
        "compression_ratio_in_force": service.compression_ratio(),
        "blocked_words": list(service.filters.blocked_words),
        "model_version": cur.ref.version if cur else None,
        "state": service.state,
        "max_batch_size": service.sched_config.max_batch_size,
    }


@router.get("/runtime", dependencies=[Depends(require_admin)])
async def get_runtime(request: Request) -> dict[str, Any]:
    return _runtime_view(request.app.state.service)


@router.put("/runtime", dependencies=[Depends(require_admin)])
async def put_runtime(request: Request) -> dict[str, Any]:
    service: EngineService = request.app.state.service
    try:
        data = await request.json()
    except Exception:
        raise ApiError(400, "invalid_json", "body must be a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "body must be a JSON object")
    blocked = data.pop("blocked_words", None)
    updates, errors = parse_settings(data, strict_keys=True)
    if blocked is not None and (
        not isinstance(blocked, list) or not all(isinstance(w, str) for w in blocked)
    ):
        errors.append("blocked_words must be a list of strings")
    if errors:
        raise ApiError(422, "invalid_request", "; ".join(errors))
    service.update_settings(updates)
    if blocked is not None:
        from slimspec.server.postprocess import parse_blocked_words

        service.filters = replace(service.filters, blocked_words=parse_blocked_words(blocked))
    log.info("runtime settings updated via admin API: %s", sorted(updates))
    return _runtime_view(service)


@router.post("/swap", dependencies=[Depends(require_admin)])
async def swap(body: AdminSwapRequest, request: Request) -> JSONResponse:
    service: EngineService = request.app.state.service
    base = service.current.ref if service.current else service.initial_ref
    ref = replace(
        base,
        target=body.target,
        draft=body.draft,
        version=body.version,
        dtype=body.dtype or base.dtype,
        device=body.device or base.device,
    )

    def run() -> dict[str, Any]:
        try:
            return service.swap(ref)
        except RuntimeError as exc:
            if "already in progress" in str(exc):
                raise ApiError(409, "conflict", str(exc)) from None
            raise ApiError(500, "swap_failed", f"swap failed, old model kept: {exc}") from None
        except Exception as exc:
            log.exception("swap failed")
            raise ApiError(500, "swap_failed", f"swap failed, old model kept: {exc}") from None

    if body.wait:
        return JSONResponse({"status": "swapped", **await asyncio.to_thread(run)})
    if service.state == "swapping":
        raise ApiError(409, "conflict", "a swap is already in progress")

    def background() -> None:
        try:
            run()
        except ApiError as exc:
            service.error = exc.message

    threading.Thread(target=background, name="swap", daemon=True).start()
    return JSONResponse({"status": "swapping", "version": ref.version}, 202)


@router.post("/drain", dependencies=[Depends(require_admin)])
async def drain(request: Request) -> dict[str, Any]:
    service: EngineService = request.app.state.service
    raw = await request.body()
    try:
        body = AdminDrainRequest.model_validate_json(raw) if raw.strip() else AdminDrainRequest()
    except Exception as exc:
        raise ApiError(422, "invalid_request", f"bad drain request: {exc}") from None
    done = await asyncio.to_thread(service.drain, body.timeout_s)
    return {"status": "drained" if done else "timeout", "state": service.state}
