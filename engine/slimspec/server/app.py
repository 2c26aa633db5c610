"""The FastAPI app: wiring of routes, error handlers, metrics middleware, lifecycle."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from slimspec.server import admin, infer, openai_api
from slimspec.server.errors import (
    ApiError,
    api_error_handler,
    error_response,
    http_exception_handler,
    validation_error_handler,
)
from slimspec.server.loading import default_loader
from slimspec.server.metrics import Metrics
from slimspec.server.postprocess import FilterRules
from slimspec.server.runtime_config import ConfigMapWatcher, RuntimeSettings
from slimspec.server.scheduler import SchedulerConfig
from slimspec.server.service import EngineService, Limits, Loader, ModelRef

log = logging.getLogger(__name__)

GENERATION_ENDPOINTS = ("/infer", "/v1/completions", "/v1/chat/completions")


@dataclass
class ServerConfig:
    model: ModelRef
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: Limits = field(default_factory=Limits)
    settings: RuntimeSettings = field(default_factory=RuntimeSettings)
    filters: FilterRules = field(default_factory=FilterRules)
    admin_token: str | None = None
    runtime_configmap: str | None = None
    namespace: str | None = None
    served_model_name: str | None = None  # id in /v1/models; default: the target name
    loader: Loader | None = None
    warmup: bool = True
    load_in_background: bool = True  # False: load before serving (tests, benchmarks)
    enable_gpu_metrics: bool = True


class RequestMetricsMiddleware:
    """Pure ASGI: body size limit, and latency/status metrics that also cover streams."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        service: EngineService = self.state.service
        limit = service.limits.max_body_bytes
        headers = dict(scope.get("headers") or [])
        clen = headers.get(b"content-length")
        if clen is not None and clen.isdigit() and int(clen) > limit:
            await self._reject(scope, receive, send, limit)
            return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise ApiError(413, "body_too_large", f"body exceeds {limit} bytes")
            return msg

        if path not in GENERATION_ENDPOINTS:
            await self.app(scope, limited_receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_wrapper(msg: Any) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, limited_receive, send_wrapper)
        finally:
            m = service.metrics
            m.requests.labels(endpoint=path, code=str(status)).inc()
            if status < 400:
                m.latency.labels(endpoint=path).observe(time.perf_counter() - t0)

    async def _reject(self, scope: Any, receive: Any, send: Any, limit: int) -> None:
        req = Request(scope, receive)
        resp = error_response(req, ApiError(413, "body_too_large", f"body exceeds {limit} bytes"))
        await resp(scope, receive, send)


def create_app(cfg: ServerConfig) -> FastAPI:
    metrics = Metrics(enable_gpu=cfg.enable_gpu_metrics)
    service = EngineService(
        loader=cfg.loader or default_loader,
        ref=cfg.model,
        sched_config=cfg.scheduler,
        limits=cfg.limits,
        metrics=metrics,
        settings=cfg.settings,
        filters=cfg.filters,
        warmup=cfg.warmup,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if cfg.load_in_background:
            threading.Thread(target=service.load_initial, name="model-load", daemon=True).start()
        else:
            await asyncio.to_thread(service.load_initial)
        watcher = None
        if cfg.runtime_configmap:
            watcher = ConfigMapWatcher(
                cfg.runtime_configmap,
                cfg.namespace or "default",
                apply=service.update_settings,
            ).start()
        app.state.watcher = watcher
        try:
            yield
        finally:
            if watcher is not None:
                watcher.stop()
            service.shutdown()

    app = FastAPI(
        title="SlimSpec engine",
        version="0.1.0",
        summary="Speculative decoding with a compressed draft head",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.config = cfg
    app.add_middleware(RequestMetricsMiddleware, state=app.state)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", summary="Readiness: model loaded and warmed, not swapping")
    async def readyz() -> Response:
        body = {"status": service.state, "model_version": None, "error": service.error}
        if service.current is not None:
            body["model_version"] = service.current.ref.version
        return JSONResponse(body, 200 if service.ready else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_route() -> Response:
        cur = service.current
        total = sum(s.scheduler.queue_depth for s in [cur, *service._retired] if s)
        metrics.queue_depth.set(total)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(infer.router)
    app.include_router(openai_api.router)
    app.include_router(admin.router)
    return app
