"""Dynamic batching: one scheduler thread drives an engine's step() for all requests.

The engine (a StepEngine: SpeculativeDecoder, or the target-only baseline) owns the
tensors and decodes every admitted request a little per step(); the scheduler decides who is
admitted (up to max_batch_size, with a short wait window so concurrent arrivals
start together), enforces deadlines and cancellations between steps, runs queued
control calls (runtime settings) between steps, and hands each StepOutput to the
asyncio side through loop.call_soon_threadsafe. A request that finishes leaves
the batch at once; the others keep stepping.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slimspec.decoding.engine import StepEngine
from slimspec.decoding.types import GenerationRequest, StepOutput

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The bounded wait queue is full; the caller should answer 429."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("server is at capacity, retry later")
        self.retry_after_s = retry_after_s


class NotAccepting(Exception):
    """The scheduler is draining or stopped; the caller should answer 503."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8  # requests decoded together per step, 1..256
    max_queue: int = 64  # requests waiting for a batch slot before 429
    batch_wait_s: float = 0.01  # idle -> first step: wait this long for company

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= 256:
            raise ValueError("max_batch_size must be within 1..256")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.batch_wait_s < 0:
            raise ValueError("batch_wait_s must be >= 0")


@dataclass
class RequestHandle:
    """The asyncio side of one request: StepOutputs arrive on `queue`."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    deadline: float | None  # time.monotonic() seconds
    queue: asyncio.Queue[StepOutput | BaseException] = field(default_factory=asyncio.Queue)
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished: bool = False
    scheduler: Scheduler | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def cancel(self) -> None:
        if not self.finished and self.scheduler is not None:
            self.scheduler.cancel(self.request_id)

    async def outputs(self):  # -> AsyncIterator[StepOutput]
        """Yield StepOutputs until the request finishes; re-raise engine errors."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


def pick_admissions(n_active: int, n_pending: int, max_batch_size: int) -> int:
    """How many pending requests join the batch now (pure)."""
    return max(0, min(n_pending, max_batch_size - n_active))


def retry_after_seconds(queue_len: int, max_batch_size: int, mean_request_s: float) -> int:
    """A rough Retry-After: time for the queue ahead to drain through the batch (pure)."""
    waves = queue_len / max(1, max_batch_size) + 1
    return max(1, min(60, round(waves * max(mean_request_s, 0.1))))


class Scheduler:
    """Owns one engine; a background thread steps it while there is work."""

    def __init__(
        self,
        engine: StepEngine,
        config: SchedulerConfig | None = None,
        on_step: Callable[[int, float], None] | None = None,
        on_finish: Callable[[RequestHandle, StepOutput], None] | None = None,
        name: str = "slimspec-scheduler",
    ) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self._on_step = on_step  # (batch_size, step_seconds), on the scheduler thread
        self._on_finish = on_finish
        self._cond = threading.Condition()
        self._pending: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[str, RequestHandle] = {}
        self._cancel: set[str] = set()
        self._calls: list[Callable[[], None]] = []
        self._accepting = True
        self._stopping = False
        self._mean_request_s = 1.0
        self._step_started: float | None = None  # monotonic; None between steps
        self.failed_steps = 0  # consecutive engine steps that raised
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # --- caller side (any thread) -------------------------------------------

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._active)

    def step_running_s(self) -> float:
        """How long the engine step in progress has been running (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def alive(self) -> bool:
        """The scheduler thread runs (or has not been started yet)."""
        return self._thread.is_alive() or self._thread.ident is None

    def submit(
        self,
        req: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        deadline: float | None = None,
    ) -> RequestHandle:
        handle = RequestHandle(request=req, loop=loop, deadline=deadline, scheduler=self)
        with self._cond:
            if not self._accepting or self._stopping:
                raise NotAccepting("server is draining; not accepting new requests")
            if len(self._pending) >= self.config.max_queue + self._free_slots():
                raise QueueFull(
                    retry_after_seconds(
                        len(self._pending), self.config.max_batch_size, self._mean_request_s
                    )
                )
            self._pending.append(handle)
            self._cond.notify_all()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._cancel.add(request_id)
            self._cond.notify_all()

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Run fn on the scheduler thread before the next step (e.g. a new ratio)."""
        with self._cond:
            self._calls.append(fn)
            self._cond.notify_all()

    def stop_accepting(self) -> None:
        with self._cond:
            self._accepting = False

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is pending or active; True if that happened in time."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._active:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=0.05 if left is None else min(left, 0.05))
        return True

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._accepting = False
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- scheduler thread ---------------------------------------------------

    def _free_slots(self) -> int:
        return max(0, self.config.max_batch_size - len(self._active))

    def _deliver(self, handle: RequestHandle, item: StepOutput | BaseException) -> None:
        if isinstance(item, StepOutput):
            if item.new_token_ids and handle.first_token_at is None:
                handle.first_token_at = time.monotonic()
            if item.finished:
                handle.finished = True
                if self._on_finish is not None:
                    try:
                        self._on_finish(handle, item)
                    except Exception:  # metrics must never break decoding
                        log.exception("on_finish hook failed")
        else:
            handle.finished = True
        with contextlib.suppress(RuntimeError):  # the client's event loop is gone
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)

    def _finish(self, handle: RequestHandle, reason: str) -> None:
        self._deliver(handle, StepOutput(handle.request_id, [], True, reason))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._pending or self._active or self._calls or self._cancel or self._stopping
                ):
                    self._cond.wait()
                if self._stopping and not self._active and not self._pending:
                    return
                # An idle engine waits a moment so requests arriving together share a batch.
                if not self._active and self._pending and self.config.batch_wait_s > 0:
                    end = time.monotonic() + self.config.batch_wait_s
                    while (
                        len(self._pending) < self.config.max_batch_size
                        and (left := end - time.monotonic()) > 0
                        and not self._stopping
                    ):
                        self._cond.wait(left)
                calls, self._calls = self._calls, []
                cancels, self._cancel = self._cancel, set()
                admitted = []
                for _ in range(
                    pick_admissions(
                        len(self._active), len(self._pending), self.config.max_batch_size
                    )
                ):
                    admitted.append(self._pending.popleft())
                # Cancelled while still queued: answer without touching the engine.
                for h in [h for h in self._pending if h.request_id in cancels]:
                    self._pending.remove(h)
                    self._finish(h, "cancelled")
                self._cond.notify_all()
            self._step_once(calls, cancels, admitted)

    def _step_once(
        self, calls: list[Callable[[], None]], cancels: set[str], admitted: list[RequestHandle]
    ) -> None:
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("control call failed")
        now = time.monotonic()
        for h in admitted:
            if h.request_id in cancels:
                self._finish(h, "cancelled")
                continue
            try:
                self.engine.add_request(h.request)
            except Exception as exc:  # bad request for this engine; others go on
                log.exception("add_request failed")
                self._deliver(h, exc)
                continue
            self._active[h.request_id] = h
        for rid, h in list(self._active.items()):
            reason = None
            if rid in cancels:
                reason = "cancelled"
            elif h.deadline is not None and now >= h.deadline:
                reason = "timeout"
            if reason is not None:
                self._drop(rid)
                self._finish(h, reason)
        if not self._active:
            self._notify()
            return
        batch = len(self._active)
        t0 = time.perf_counter()
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.failed_steps += 1
            log.exception("engine step failed; failing the current batch")
            for rid, h in list(self._active.items()):
                self._drop(rid)
                self._deliver(h, RuntimeError(f"generation failed: {exc}"))
            self._notify()
            return
        finally:
            self._step_started = None
        self.failed_steps = 0
        dt = time.perf_counter() - t0
        for out in outputs:
            owner = self._active.get(out.request_id)
            if owner is None:  # cancelled/timed out already
                continue
            if out.finished:
                del self._active[out.request_id]
                took = time.monotonic() - owner.submitted_at
                self._mean_request_s = 0.8 * self._mean_request_s + 0.2 * took
            self._deliver(owner, out)
        if self._on_step is not None:
            try:
                self._on_step(batch, dt)
            except Exception:
                log.exception("on_step hook failed")
        self._notify()

    def _drop(self, rid: str) -> None:
        self._active.pop(rid, None)
        try:
            self.engine.cancel(rid)
        except Exception:
            log.exception("engine cancel failed")

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()
