"""Health that tells the truth and drains that drop nothing (real uvicorn, tiny models):
load retries and a liveness that fails when the engine cannot recover, the step
watchdog, tokenisation off the event loop, and the engine's side of a rollout drain."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from slimspec.server.health import HealthPolicy
from slimspec.server.service import ModelRef

from tests.server.conftest import APPS, TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def wait_for(pred, timeout: float = 30.0, every: float = 0.05):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if v := pred():
            return v
        time.sleep(every)
    raise AssertionError("condition not met in time")


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_failed_load_is_retried_with_backoff_and_reported(make_server, tiny) -> None:  # type: ignore[no-untyped-def]
    tiny.fail_loads["tiny-b"] = 2
    policy = HealthPolicy(load_attempts=3, load_backoff_s=0.2)
    model = ModelRef("tiny-b", "none", "v1", "float32")
    with make_server(model=model, health=policy) as base:
        assert httpx.get(f"{base}/readyz").status_code == 200
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert metric(base, "slimspec_model_load_failures_total") == 2
        r = httpx.post(f"{base}/infer", json={"input": "hi", "max_length": 2}, timeout=30)
        assert r.status_code == 200


def test_liveness_fails_when_the_load_never_succeeds(make_server, tiny) -> None:  # type: ignore[no-untyped-def]
    policy = HealthPolicy(load_attempts=2, load_backoff_s=0.1)
    model = ModelRef("missing-model", "none", "v1", "float32")
    with make_server(model=model, health=policy, wait_ready=False) as base:
        r = wait_for(lambda: (x := httpx.get(f"{base}/healthz")).status_code == 503 and x)
        assert "load failed" in r.json()["error"]
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 503 and "attempt 2 of 2" in ready.json()["error"]
        assert metric(base, "slimspec_model_load_failures_total") == 2


def test_watchdog_fails_liveness_on_a_hung_step(make_server, tiny) -> None:  # type: ignore[no-untyped-def]
    tiny.hang.clear()
    model = ModelRef("tiny-a-hang", "none", "v1", "float32")
    with make_server(model=model, health=HealthPolicy(step_watchdog_s=0.5), warmup=False) as base:
        assert httpx.get(f"{base}/healthz").status_code == 200
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(
                httpx.post, f"{base}/infer", json={"input": "x", "max_length": 3}, timeout=60
            )
            r = wait_for(lambda: (x := httpx.get(f"{base}/healthz")).status_code == 503 and x)
            assert "engine step" in r.json()["error"]
            tiny.hang.set()  # the step finishes: healthy again, the request is answered
            assert fut.result().status_code == 200
        assert httpx.get(f"{base}/healthz").status_code == 200


def test_tokenisation_does_not_block_probes(make_server) -> None:  # type: ignore[no-untyped-def]
    model = ModelRef("tiny-a-slowtok", "none", "v1", "float32")
    with make_server(model=model) as base, ThreadPoolExecutor(2) as ex:
        futs = [
            ex.submit(
                httpx.post, f"{base}/infer", json={"input": "long", "max_length": 2}, timeout=60
            )
            for _ in range(2)
        ]
        time.sleep(0.3)  # both are in the tokenizer now (1.5 s each)
        t0 = time.monotonic()
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 0.5
        assert [f.result().status_code for f in futs] == [200, 200]


def test_drain_while_loading_is_not_undone(make_server, tiny) -> None:  # type: ignore[no-untyped-def]
    tiny.load_delay_s["tiny-b"] = 1.5
    model = ModelRef("tiny-b", "none", "v1", "float32")
    try:
        with make_server(model=model, wait_ready=False) as base:
            r = httpx.post(f"{base}/admin/drain", json={"timeout_s": 5}, headers=AUTH, timeout=30)
            assert r.status_code == 200
            service = APPS[base].state.service
            wait_for(lambda: service.current is not None)  # the load finished
            time.sleep(0.1)
            ready = httpx.get(f"{base}/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            r = httpx.post(f"{base}/infer", json={"input": "hi", "max_length": 2}, timeout=30)
            assert r.status_code == 503
    finally:
        tiny.load_delay_s.clear()


def test_drain_finishes_in_flight_and_answers_until_propagated(make_server) -> None:  # type: ignore[no-untyped-def]
    """preStop order: readiness 503 at once; new requests still answered for delay_s;
    then refused; every request in flight (streams too) completes."""
    model = ModelRef("tiny-a-slow", "none", "v1", "float32")  # >= 20 ms a step
    with make_server(model=model) as base:
        n_tokens = 60  # >= 1.2 s each

        def plain(i: int) -> tuple[int, int]:
            r = httpx.post(
                f"{base}/infer",
                json={"input": f"drain {i}", "max_length": n_tokens, "include_input": False},
                timeout=120,
            )
            return r.status_code, r.json().get("completion_tokens", -1)

        def stream(i: int) -> tuple[int, int]:
            with httpx.stream(
                "POST",
                f"{base}/v1/completions",
                json={"prompt": f"s{i}", "max_tokens": n_tokens, "stream": True},
                timeout=120,
            ) as r:
                lines = [ln for ln in r.iter_lines() if ln]
            return r.status_code, int(lines[-1] == "data: [DONE]")

        with ThreadPoolExecutor(8) as ex:
            want = list(ex.map(plain, [0, 1, 2, 99]))  # greedy: the same again below
            in_flight = [ex.submit(plain, i) for i in range(3)]
            in_flight += [ex.submit(stream, i) for i in range(2)]
            time.sleep(0.3)
            drain = ex.submit(
                httpx.post,
                f"{base}/admin/drain",
                json={"timeout_s": 60, "delay_s": 1.0},
                headers=AUTH,
                timeout=120,
            )
            time.sleep(0.2)
            ready = httpx.get(f"{base}/readyz")
            assert ready.status_code == 503  # readiness flips first
            # kept-alive connections bypass the Service: each answer now closes its
            # connection so the client reconnects to a pod still in the endpoints
            assert ready.headers["connection"] == "close"
            assert plain(99) == want[3]  # still answered while endpoint removal propagates
            threading.Event().wait(1.0)  # the propagation delay has passed
            late = httpx.post(f"{base}/infer", json={"input": "late", "max_length": 2}, timeout=30)
            assert late.status_code == 503 and late.headers["Retry-After"]
            results = [f.result() for f in in_flight]
            assert results[:3] == want[:3]
            assert results[3:] == [(200, 1)] * 2  # streams ran to [DONE]
            assert drain.result().json()["status"] == "drained"
        assert httpx.get(f"{base}/healthz").status_code == 200  # draining is not dying
