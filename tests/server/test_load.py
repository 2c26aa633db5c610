"""Concurrency through real HTTP: batching exactness, overload, deadlines, client
disconnects, and a hot swap under load without a failed request."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from slimspec.server.scheduler import SchedulerConfig
from slimspec.server.service import Limits, ModelRef

from tests.server.conftest import APPS

PROMPTS = [
    ("Hello, world!", 12),
    ("def f(x):", 20),
    ("a", 5),
    ("The quick brown fox", 16),
    ("import os\n", 9),
    ("1 2 3 4", 14),
]


def infer(base: str, text: str, n: int, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{base}/infer", json={"input": text, "max_length": n, **kw}, timeout=120)


def test_batched_requests_get_exactly_what_they_get_alone(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(scheduler=SchedulerConfig(max_batch_size=8, batch_wait_s=0.05)) as base:
        alone = [infer(base, p, n).json()["output"] for p, n in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            together = list(ex.map(lambda pn: infer(base, *pn).json()["output"], PROMPTS))
        sizes = httpx.get(f"{base}/metrics").text
    assert together == alone
    # they really shared steps: some step ran with more than one request
    count_gt1 = [
        ln for ln in sizes.splitlines() if ln.startswith('slimspec_batch_size_bucket{le="1.0"}')
    ]
    total = [ln for ln in sizes.splitlines() if ln.startswith("slimspec_batch_size_count")]
    assert float(count_gt1[0].split()[-1]) < float(total[0].split()[-1])


def test_overload_answers_429_with_retry_after(make_server) -> None:  # type: ignore[no-untyped-def]
    cfg = SchedulerConfig(max_batch_size=1, max_queue=1, batch_wait_s=0)
    slow = ModelRef("tiny-a-slow", "none", "v1", "float32")  # 40 tokens take >= 0.8 s
    with make_server(scheduler=cfg, model=slow) as base:
        with ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda i: infer(base, f"load {i}", 40), range(8)))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) == {200, 429}, codes
        assert codes.count(200) >= 2
        r429 = next(r for r in rs if r.status_code == 429)
        assert int(r429.headers["Retry-After"]) >= 1
        assert "capacity" in r429.json()["error"]["message"]
        assert infer(base, "still alive", 2).status_code == 200
        text = httpx.get(f"{base}/metrics").text
        assert 'slimspec_requests_total{code="429",endpoint="/infer"}' in text


def test_deadline_gives_504(make_server) -> None:  # type: ignore[no-untyped-def]
    limits = Limits(max_new_tokens=4000, max_input_tokens=400, request_timeout_s=0.3)
    with make_server(limits=limits, model=ModelRef("tiny-a-slow", "none", "v1", "float32")) as base:
        r = infer(base, "slow", 4000)
        assert r.status_code == 504 and "time limit" in r.json()["error"]["message"]
        assert infer(base, "fast", 1).status_code == 200


def test_client_disconnect_cancels_generation(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(model=ModelRef("tiny-a-slow", "none", "v1", "float32")) as base:
        sched = APPS[base].state.service.current.scheduler
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/infer", json={"input": "x", "max_length": 256}, timeout=0.5)
        deadline = time.monotonic() + 10
        while sched.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sched.in_flight == 0  # cancelled well before 256 tokens
        # streaming: close the stream after the first chunk
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            timeout=30,
            json={"prompt": "x", "max_tokens": 256, "stream": True},
        ) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 10
        while sched.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sched.in_flight == 0


def test_hot_swap_under_load_drops_nothing(make_server, auth) -> None:  # type: ignore[no-untyped-def]
    with make_server() as base:
        alone_b = None
        results: list[tuple[int, str]] = []
        stop = threading.Event()

        def client(i: int) -> None:
            while not stop.is_set():
                r = infer(base, f"swap {i}", 8)
                results.append((r.status_code, r.json().get("model_version", r.text)))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        r = httpx.post(
            f"{base}/admin/swap",
            headers=auth,
            timeout=120,
            json={"target": "tiny-b", "draft": "tiny-b-draft", "version": "v2"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["previous_version"] == "v1"
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        codes = [c for c, _ in results]
        assert codes and all(c == 200 for c in codes), [x for x in results if x[0] != 200]
        versions = [v for _, v in results]
        assert "v1" in versions and versions[-1] == "v2"
        assert httpx.get(f"{base}/readyz").json()["model_version"] == "v2"
        assert 'version="v2"' in httpx.get(f"{base}/metrics").text
        # the new model really serves: same as tiny-b alone
        alone_b = infer(base, "Hello", 6).json()
        assert alone_b["model_version"] == "v2"
        service = APPS[base].state.service
        deadline = time.monotonic() + 10
        while service._retired and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not service._retired  # old model freed
        bad = httpx.post(
            f"{base}/admin/swap",
            headers=auth,
            timeout=60,
            json={"target": "missing", "version": "v3"},
        )
        assert bad.status_code == 500 and "old model kept" in bad.json()["error"]["message"]
        assert infer(base, "Hello", 2).json()["model_version"] == "v2"
