"""The FastAPI app: wiring of routes, error handlers, metrics middleware, lifecycle."""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from slimspec.server import admin, infer, openai_api
from slimspec.server.errors import (
    ApiError,
    api_error_handler,
    http_exception_handler,
    validation_error_handler,
)
from slimspec.server.health import HealthPolicy
from slimspec.server.loading import default_loader
from slimspec.server.metrics import Metrics
from slimspec.server.middleware import RequestGuard
from slimspec.server.postprocess import FilterRules
from slimspec.server.runtime_config import ConfigMapWatcher, RuntimeSettings
from slimspec.server.scheduler import SchedulerConfig
from slimspec.server.service import EngineService, Limits, Loader, ModelRef

log = logging.getLogger(__name__)


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
    served_model_name: str | None = None  # id in /v1/models; default: model_name(target)
    api_key: str | None = None  # required on the inference routes when set
    health: HealthPolicy = field(default_factory=HealthPolicy)
    loader: Loader | None = None
    warmup: bool = True
    load_in_background: bool = True  # False: load before serving (tests, benchmarks)
    enable_gpu_metrics: bool = True


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
        health=cfg.health,
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
    app.add_middleware(RequestGuard, state=app.state)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)

    @app.get("/healthz", summary="Liveness: 503 when the engine cannot recover")
    async def healthz() -> Response:
        problem = service.liveness_problem()
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "error": problem}, 503)

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
