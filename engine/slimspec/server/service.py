"""The serving core behind the routes: the loaded model, its scheduler, swap and drain.

A `Served` is one loaded model version with its own scheduler thread. Requests
are bound to the Served that was current when they were submitted, so a hot swap
replaces `current` atomically while in-flight requests finish on the old one;
the old one is stopped and freed once idle.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimspec.decoding.engine import Engine
from slimspec.decoding.types import GenerationRequest, SamplingParams
from slimspec.server.health import EngineCondition, HealthPolicy, liveness_problem
from slimspec.server.metrics import Metrics
from slimspec.server.middleware import InFlight
from slimspec.server.postprocess import FilterRules
from slimspec.server.runtime_config import RuntimeSettings
from slimspec.server.scheduler import (
    NotAccepting,
    RequestHandle,
    Scheduler,
    SchedulerConfig,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRef:
    target: str
    draft: str | None  # None/"none": target-only decoding
    version: str = "unversioned"
    dtype: str = "bfloat16"
    device: str = "cpu"
    draft_quantization: str | None = "auto"  # None = the draft as loaded; cpu/draft_quantization.py
    target_quantization: str = "auto"  # the target's weight form; cpu/target_form.py
    num_draft_tokens: int | None = None  # None = adaptive k
    prefill_chunk: int = 512  # most prompt tokens prefilled per engine step


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 1024  # upper bound for max_length / max_tokens
    max_input_tokens: int = 8192
    max_input_chars: int = 200_000
    max_body_bytes: int = 2_000_000
    request_timeout_s: float = 300.0
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    header_timeout_s: float = 10.0  # a request's headers must arrive within this
    # A kept-alive connection older than this is closed after its next answer, so
    # clients reconnect through the Service and reach new replicas (0: never).
    max_connection_age_s: float = 10.0


Loader = Callable[[ModelRef], Engine]


class ServiceUnavailable(Exception):
    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def apply_settings_to_engine(engine: Engine, s: RuntimeSettings) -> None:
    """Push settings into the engine; runs on the scheduler thread between steps."""
    engine.set_compression_ratio(s.compression_ratio)
    engine.set_quality_threshold(s.quality_threshold)
    engine.set_fallback_strategy(s.fallback_strategy)


@dataclass
class Served:
    ref: ModelRef
    engine: Engine
    scheduler: Scheduler
    stop_ids: frozenset[int]
    loaded_at: float = field(default_factory=time.time)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_context(self) -> int | None:
        """Most tokens (prompt + generated) a request may hold, when the engine knows it."""
        n = self.engine.max_context
        return n if n is not None and n > 0 else None


class EngineService:
    def __init__(
        self,
        loader: Loader,
        ref: ModelRef,
        sched_config: SchedulerConfig,
        limits: Limits,
        metrics: Metrics,
        settings: RuntimeSettings,
        filters: FilterRules | None = None,
        warmup: bool = True,
        health: HealthPolicy | None = None,
    ) -> None:
        self.loader = loader
        self.initial_ref = ref
        self.sched_config = sched_config
        self.limits = limits
        self.metrics = metrics
        self.settings = settings
        self.filters = filters or FilterRules()
        self.warmup = warmup
        self.health = health or HealthPolicy()
        self.current: Served | None = None
        self.state = "starting"  # starting | loading | ready | swapping | draining | failed
        self.error: str | None = None
        self.swaps = 0
        self.draining = False  # once set, nothing (a finished load or swap) makes it ready
        self.accepting = True  # false once a drain stops taking new requests
        self.in_flight = InFlight()  # generation requests still sending their answer
        self._stop = threading.Event()
        self._swap_lock = threading.Lock()
        self._retired: list[Served] = []
        metrics.quality_threshold.set(settings.quality_threshold)

    # --- lifecycle ----------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.current is not None and not self.draining

    def liveness_problem(self) -> str | None:
        """Why the process cannot recover (liveness fails), or None."""
        served = self.current
        sched = served.scheduler if served is not None else None
        return liveness_problem(
            EngineCondition(
                state=self.state,
                scheduler_alive=sched.alive if sched is not None else True,
                step_running_s=sched.step_running_s() if sched is not None else 0.0,
                failed_steps=sched.failed_steps if sched is not None else 0,
            ),
            self.health,
        )

    def _build(self, ref: ModelRef) -> Served:
        t0 = time.perf_counter()
        engine = self.loader(ref)
        apply_settings_to_engine(engine, self.settings)
        if self.warmup:
            engine.warmup()
        sched = Scheduler(
            engine,
            self.sched_config,
            on_step=lambda batch, dt: self._on_step(engine, batch),
            name=f"scheduler-{ref.version}",
        ).start()
        log.info(
            "loaded %s (target=%s draft=%s) in %.1fs",
            ref.version,
            ref.target,
            ref.draft,
            time.perf_counter() - t0,
        )
        return Served(ref=ref, engine=engine, scheduler=sched, stop_ids=engine.stop_token_ids())

    def load_initial(self) -> None:
        """Blocking first load, retried with back-off (run it in a thread; /readyz says
        503 meanwhile). After the last failed attempt the state is "failed", and
        liveness fails so that the pod is restarted."""
        attempts = self.health.load_attempts
        for attempt in range(1, attempts + 1):
            self.state = "draining" if self.draining else "loading"
            try:
                served = self._build(self.initial_ref)
            except Exception as exc:
                self.metrics.load_failures.inc()
                self.error = f"model load failed (attempt {attempt} of {attempts}): {exc}"
                if attempt == attempts or self._stop.is_set():
                    log.exception("model load failed; giving up: %s", self.error)
                    self.state = "failed"
                    return
                wait = self.health.backoff_s(attempt)
                log.exception("%s; retrying in %.0f s", self.error, wait)
                if self._stop.wait(wait):
                    self.state = "failed"
                    return
                continue
            self.error = None
            self._activate(served)
            if self.draining:  # a drain that came during the load stays in force
                served.scheduler.stop_accepting()
            self.state = "draining" if self.draining else "ready"
            return

    def _activate(self, served: Served) -> None:
        self.current = served
        r = served.ref
        self.metrics.set_model(r.version, r.target, r.draft or "none")
        self.metrics.compression_ratio.set(served.engine.compression_ratio)
        self.metrics.set_draft_head(served.engine)

    def swap(self, ref: ModelRef, drain_timeout_s: float = 600.0) -> dict[str, Any]:
        """Load `ref` beside the current model, warm it, switch, retire the old one.

        Blocking; raises RuntimeError when a swap is already running, and the load's
        exception when the new model fails (the old one keeps serving).
        """
        if not self._swap_lock.acquire(blocking=False):
            raise RuntimeError("a swap is already in progress")
        try:
            prev_state = self.state
            self.state = "swapping"
            try:
                new = self._build(ref)
            except Exception:
                self.state = "draining" if self.draining else prev_state
                raise
            old = self.current
            self._activate(new)  # new requests go to the new model from here on
            self.swaps += 1
            self.state = "draining" if self.draining else "ready"
        finally:
            self._swap_lock.release()
        if old is not None:
            old.scheduler.stop_accepting()
            self._retired.append(old)
            threading.Thread(target=self._retire, args=(old, drain_timeout_s), daemon=True).start()
        return {
            "version": ref.version,
            "target": ref.target,
            "draft": ref.draft,
            "previous_version": old.ref.version if old else None,
        }

    def _retire(self, old: Served, timeout: float) -> None:
        old.scheduler.wait_idle(timeout)
        old.scheduler.stop()
        self.metrics.forget_engine(old.engine)
        self._retired.remove(old)
        del old
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:
            pass
        log.info("retired previous model version")

    def drain(self, timeout_s: float, delay_s: float = 0.0) -> bool:
        """Readiness turns 503 at once; new requests are still answered for delay_s (while
        endpoint removal reaches every proxy), then refused; then wait until in-flight
        requests, streams included, have sent their last byte. True if all finished
        within timeout_s (counted after the delay)."""
        self.draining = True
        if self.state != "failed":
            self.state = "draining"
        if delay_s > 0:
            self._stop.wait(delay_s)
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        for s in [self.current, *self._retired]:
            if s is not None:
                s.scheduler.stop_accepting()
        ok = True
        for s in [self.current, *self._retired]:
            if s is not None:
                ok = s.scheduler.wait_idle(max(0.0, deadline - time.monotonic())) and ok
        while self.in_flight.count > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        return ok and self.in_flight.count == 0

    def shutdown(self) -> None:
        self._stop.set()
        for s in [self.current, *self._retired]:
            if s is not None:
                s.scheduler.stop(timeout=2.0)

    # --- settings -----------------------------------------------------------

    def update_settings(self, updates: dict[str, Any]) -> RuntimeSettings:
        self.settings = new = self.settings.merged(updates)
        self.metrics.quality_threshold.set(new.quality_threshold)
        served = self.current
        if served is not None:
            eng = served.engine

            def apply() -> None:
                apply_settings_to_engine(eng, new)
                # the gauge shows what is in force (0.0 without a draft), not what was asked
                self.metrics.compression_ratio.set(eng.compression_ratio)

            served.scheduler.call_between_steps(apply)
        return new

    def compression_ratio(self) -> float:
        """The ratio in force: the serving engine's (0.0 without a draft); the setting
        while no model is loaded."""
        served = self.current
        return served.engine.compression_ratio if served else self.settings.compression_ratio

    # --- requests -----------------------------------------------------------

    def served(self) -> Served:
        if not self.accepting:
            raise ServiceUnavailable("server is draining; retry on another replica", 1)
        if self.current is None:
            msg = self.error or "model is still loading"
            raise ServiceUnavailable(msg, 10)
        return self.current

    def submit(
        self,
        served: Served,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        timeout_s: float | None = None,
        logprobs: int | None = None,
        grammar: str | None = None,
    ) -> tuple[Served, RequestHandle]:
        """Queue a request (QueueFull -> 429 upstream); follows a swap that raced it."""
        timeout = min(timeout_s or self.limits.request_timeout_s, self.limits.request_timeout_s)
        req = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_token_ids=served.stop_ids,
            logprobs=logprobs,
            grammar=grammar,
        )
        for _ in range(3):
            try:
                return served, served.scheduler.submit(req, loop, time.monotonic() + timeout)
            except NotAccepting:
                nxt = self.served()
                if nxt is served:
                    raise ServiceUnavailable("server is draining; retry later", 1) from None
                served = nxt
        raise ServiceUnavailable("model is being swapped; retry", 1)

    # --- metric hooks (scheduler thread) ------------------------------------

    def _on_step(self, engine: Engine, batch: int) -> None:
        self.metrics.observe_step(engine, batch)
        self.metrics.queue_depth.set(
            sum(s.scheduler.queue_depth for s in [self.current, *self._retired] if s)
        )
