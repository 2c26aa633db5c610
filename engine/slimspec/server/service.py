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

from slimspec.decoding.types import GenerationRequest, SamplingParams
from slimspec.server.metrics import Metrics
from slimspec.server.postprocess import FilterRules
from slimspec.server.runtime_config import RuntimeSettings
from slimspec.server.scheduler import (
    Engine,
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
    num_draft_tokens: int | None = None  # None = adaptive k


@dataclass(frozen=True)
class Limits:
    max_new_tokens: int = 1024  # upper bound for max_length / max_tokens
    max_input_tokens: int = 8192
    max_input_chars: int = 200_000
    max_body_bytes: int = 2_000_000
    request_timeout_s: float = 300.0


Loader = Callable[[ModelRef], Engine]


class ServiceUnavailable(Exception):
    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def stop_token_ids(engine: Engine) -> frozenset[int]:
    """EOS ids of the tokenizer and the model's generation config (chat models end on several)."""
    ids: set[int] = set()
    explicit = getattr(engine, "stop_token_ids", None)
    if explicit:
        ids.update(int(i) for i in explicit)
    tok = getattr(engine, "tokenizer", None)
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    for model_attr in ("target", "target_model", "model"):
        cfg = getattr(getattr(engine, model_attr, None), "generation_config", None)
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(i) for i in eos)
    return frozenset(ids)


def apply_settings_to_engine(engine: Engine, s: RuntimeSettings) -> None:
    """Push settings into the decoder; runs on the scheduler thread between steps."""
    if hasattr(engine, "set_compression_ratio"):
        engine.set_compression_ratio(s.compression_ratio)
    if hasattr(engine, "set_quality_threshold"):
        engine.set_quality_threshold(s.quality_threshold)
    if hasattr(engine, "set_fallback_strategy"):
        engine.set_fallback_strategy(s.fallback_strategy)
    elif hasattr(engine, "fallback_strategy"):
        engine.fallback_strategy = s.fallback_strategy


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
    ) -> None:
        self.loader = loader
        self.initial_ref = ref
        self.sched_config = sched_config
        self.limits = limits
        self.metrics = metrics
        self.settings = settings
        self.filters = filters or FilterRules()
        self.warmup = warmup
        self.current: Served | None = None
        self.state = "starting"  # starting | loading | ready | swapping | draining | failed
        self.error: str | None = None
        self.swaps = 0
        self._swap_lock = threading.Lock()
        self._retired: list[Served] = []
        metrics.set_settings(settings.compression_ratio, settings.quality_threshold)

    # --- lifecycle ----------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.current is not None

    def _build(self, ref: ModelRef) -> Served:
        t0 = time.perf_counter()
        engine = self.loader(ref)
        apply_settings_to_engine(engine, self.settings)
        if self.warmup and hasattr(engine, "warmup"):
            engine.warmup()
        sched = Scheduler(
            engine,
            self.sched_config,
            on_step=lambda eng, b, dt: self._on_step(eng, b),
            name=f"scheduler-{ref.version}",
        ).start()
        log.info(
            "loaded %s (target=%s draft=%s) in %.1fs",
            ref.version,
            ref.target,
            ref.draft,
            time.perf_counter() - t0,
        )
        return Served(ref=ref, engine=engine, scheduler=sched, stop_ids=stop_token_ids(engine))

    def load_initial(self) -> None:
        """Blocking first load (run it in a thread; /readyz says 503 meanwhile)."""
        self.state = "loading"
        try:
            served = self._build(self.initial_ref)
        except Exception as exc:
            log.exception("model load failed")
            self.state, self.error = "failed", f"model load failed: {exc}"
            return
        self._activate(served)
        self.state = "ready"

    def _activate(self, served: Served) -> None:
        self.current = served
        r = served.ref
        self.metrics.set_model(r.version, r.target, r.draft or "none")

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
                self.state = prev_state
                raise
            old = self.current
            self._activate(new)  # new requests go to the new model from here on
            self.swaps += 1
            self.state = "ready" if prev_state != "draining" else "draining"
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

    def drain(self, timeout_s: float) -> bool:
        """Stop taking work, wait for in-flight requests; True if all finished in time."""
        self.state = "draining"
        served = self.current
        if served is None:
            return True
        served.scheduler.stop_accepting()
        ok = served.scheduler.wait_idle(timeout_s)
        for old in list(self._retired):
            ok = old.scheduler.wait_idle(timeout_s) and ok
        return ok

    def shutdown(self) -> None:
        for s in [self.current, *self._retired]:
            if s is not None:
                s.scheduler.stop(timeout=2.0)

    # --- settings -----------------------------------------------------------

    def update_settings(self, updates: dict[str, Any]) -> RuntimeSettings:
        self.settings = new = self.settings.merged(updates)
        self.metrics.set_settings(new.compression_ratio, new.quality_threshold)
        served = self.current
        if served is not None:
            eng = served.engine
            served.scheduler.call_between_steps(lambda: apply_settings_to_engine(eng, new))
        return new

    def compression_ratio(self) -> float:
        served = self.current
        r = getattr(served.engine, "compression_ratio", None) if served else None
        return float(r) if isinstance(r, int | float) else self.settings.compression_ratio

    # --- requests -----------------------------------------------------------

    def served(self) -> Served:
        if self.state == "draining":
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
    ) -> tuple[Served, RequestHandle]:
        """Queue a request (QueueFull -> 429 upstream); follows a swap that raced it."""
        timeout = min(timeout_s or self.limits.request_timeout_s, self.limits.request_timeout_s)
        req = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_token_ids=served.stop_ids,
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
