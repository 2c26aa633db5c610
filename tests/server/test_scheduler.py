"""The batching scheduler against a scripted engine (no model): admission, queue bound,
cancellation, deadlines, control calls, and engine failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from slimspec.decoding.types import GenerationRequest, StepOutput
from slimspec.server.scheduler import (
    NotAccepting,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    pick_admissions,
    retry_after_seconds,
)


class CountingEngine:
    """Emits token i at step i for every active request; records batch sizes."""

    def __init__(self, step_s: float = 0.0, fail_on: str | None = None) -> None:
        self.active: dict[str, tuple[GenerationRequest, int]] = {}
        self.batches: list[int] = []
        self.step_s = step_s
        self.fail_on = fail_on
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def add_request(self, req: GenerationRequest) -> None:
        self.active[req.request_id] = (req, 0)

    def cancel(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> list[StepOutput]:
        time.sleep(self.step_s)
        self.batches.append(len(self.active))
        if self.fail_on and self.fail_on in self.active:
            raise ValueError("boom")
        outs = []
        for rid, (req, n) in list(self.active.items()):
            n += 1
            done = n >= req.max_new_tokens
            outs.append(StepOutput(rid, [n], done, "length" if done else None))
            if done:
                del self.active[rid]
            else:
                self.active[rid] = (req, n)
        return outs


def req(rid: str, n: int) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2], n)


async def drain(handle) -> tuple[list[int], str]:  # type: ignore[no-untyped-def]
    toks, reason = [], ""
    async for o in handle.outputs():
        toks += o.new_token_ids
        reason = o.finish_reason or reason
    return toks, reason


def test_pure_helpers() -> None:
    assert pick_admissions(2, 10, 4) == 2
    assert pick_admissions(4, 10, 4) == 0
    assert pick_admissions(0, 1, 4) == 1
    assert 1 <= retry_after_seconds(100, 8, 2.0) <= 60
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch_size=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_batch_size=257)


@pytest.mark.asyncio
async def test_concurrent_requests_share_steps_and_leave_independently() -> None:
    eng = CountingEngine()
    s = Scheduler(eng, SchedulerConfig(max_batch_size=4, batch_wait_s=0.05)).start()
    loop = asyncio.get_running_loop()
    try:
        hs = [s.submit(req(f"r{i}", n), loop) for i, n in enumerate([2, 5, 9])]
        results = await asyncio.gather(*(drain(h) for h in hs))
    finally:
        s.stop()
    assert [r[0] for r in results] == [[1, 2], [1, 2, 3, 4, 5], list(range(1, 10))]
    assert max(eng.batches) == 3  # they ran together
    assert eng.batches[-1] == 1  # the long one kept going alone


@pytest.mark.asyncio
async def test_batch_size_limit_and_queue_bound() -> None:
    eng = CountingEngine(step_s=0.01)
    s = Scheduler(eng, SchedulerConfig(max_batch_size=2, max_queue=1, batch_wait_s=0)).start()
    loop = asyncio.get_running_loop()
    try:
        hs = [s.submit(req(f"r{i}", 20), loop) for i in range(3)]  # 2 slots + 1 queued
        with pytest.raises(QueueFull) as exc:
            s.submit(req("r9", 1), loop)
        assert exc.value.retry_after_s >= 1
        await asyncio.gather(*(drain(h) for h in hs))
    finally:
        s.stop()
    assert max(eng.batches) == 2


@pytest.mark.asyncio
async def test_cancel_and_deadline() -> None:
    eng = CountingEngine(step_s=0.01)
    s = Scheduler(eng, SchedulerConfig(max_batch_size=4, batch_wait_s=0)).start()
    loop = asyncio.get_running_loop()
    try:
        a = s.submit(req("a", 10_000), loop)
        b = s.submit(req("b", 10_000), loop, deadline=time.monotonic() + 0.2)
        c = s.submit(req("c", 5), loop)
        await asyncio.sleep(0.1)
        a.cancel()
        ra, rb, rc = await asyncio.wait_for(asyncio.gather(drain(a), drain(b), drain(c)), 10)
    finally:
        s.stop()
    assert ra[1] == "cancelled" and rb[1] == "timeout" and rc == ([1, 2, 3, 4, 5], "length")
    assert not eng.active


@pytest.mark.asyncio
async def test_control_calls_run_between_steps_and_drain() -> None:
    eng = CountingEngine(step_s=0.01)
    s = Scheduler(eng, SchedulerConfig(batch_wait_s=0)).start()
    loop = asyncio.get_running_loop()
    ran = threading.Event()
    try:
        h = s.submit(req("a", 30), loop)
        s.call_between_steps(ran.set)
        s.stop_accepting()
        with pytest.raises(NotAccepting):
            s.submit(req("b", 1), loop)
        await drain(h)
        assert await asyncio.to_thread(s.wait_idle, 5)
    finally:
        s.stop()
    assert ran.is_set()


@pytest.mark.asyncio
async def test_engine_failure_fails_batch_but_scheduler_survives() -> None:
    eng = CountingEngine(fail_on="bad")
    s = Scheduler(eng, SchedulerConfig(batch_wait_s=0.02)).start()
    loop = asyncio.get_running_loop()
    try:
        h = s.submit(req("bad", 3), loop)
        with pytest.raises(RuntimeError, match="generation failed"):
            await drain(h)
        eng.active.clear()
        ok = await drain(s.submit(req("good", 3), loop))
    finally:
        s.stop()
    assert ok == ([1, 2, 3], "length")
