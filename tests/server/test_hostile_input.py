"""Hostile request bodies get a 4xx that names the problem, and the server keeps serving
(real uvicorn, tiny random models)."""

from __future__ import annotations

import json

import httpx
import pytest

HUGE_INT = "9" * 5000  # beyond Python's 4300-digit int parsing limit
BIG = "1" + "0" * 400  # an int far beyond a float


def body(prefix: str, value: str) -> str:
    return prefix + value + "}"


NESTED = "[" * 5000 + "1" + "]" * 5000


def post(base: str, path: str, raw: bytes | str) -> httpx.Response:
    content = raw.encode() if isinstance(raw, str) else raw
    return httpx.post(
        f"{base}{path}", content=content, timeout=60, headers={"Content-Type": "application/json"}
    )


def alive(base: str) -> None:
    r = httpx.post(f"{base}/infer", json={"input": "still ok", "max_length": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{base}/healthz").status_code == 200


CASES = [
    ("/infer", body('{"input": "hi", "max_length": ', HUGE_INT), 400, "digits"),
    ("/infer", body('{"input": "hi", "seed": ', HUGE_INT), 400, "digits"),
    ("/infer", body('{"input": "hi", "temperature": ', BIG), 422, "temperature"),
    ("/infer", body('{"input": "hi", "top_p": ', BIG), 422, "top_p"),
    ("/infer", '{"input": "hi", "temperature": 1e400}', 422, "temperature"),
    ("/v1/completions", body('{"prompt": "hi", "max_tokens": ', HUGE_INT), 400, ""),
    ("/v1/completions", body('{"prompt": "hi", "temperature": ', BIG), 422, ""),
    ("/v1/completions", body('{"prompt": "hi", "top_p": ', BIG), 422, "top_p"),
    ("/v1/completions", body('{"prompt": "hi", "seed": ', BIG), 422, "seed"),
    ("/v1/chat/completions", body('{"messages": [], "temperature": ', HUGE_INT), 400, ""),
    ("/infer", json.dumps({"input": "hi", "stop": ["x" * 10_000]}), 422, "stop"),
    ("/infer", json.dumps({"input": "hi", "stop": ["a"] * 1000}), 422, "stop"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": "y" * 10_000}), 422, "stop"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["b"] * 1000}), 422, "stop"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), CASES)
def test_hostile_bodies_are_4xx(server: str, path: str, body: str, status: int, needle: str):
    r = post(server, path, body)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert err["message"] and needle.lower() in err["message"].lower()
    alive(server)


def test_json_format_on_deeply_nested_output_is_422_not_500(server: str, monkeypatch):
    """format=json post-processing over model output that nests or never closes."""
    from slimspec.server import postprocess

    for text in (NESTED, "[" * 20_000, '{"a": ' * 5000):
        with pytest.raises(postprocess.OutputFormatError):
            postprocess.extract_json(text)
    assert postprocess.extract_json('noise {"a": [1, 2]} more') == {"a": [1, 2]}


def test_near_zero_temperature_is_greedy_over_http(server: str):
    greedy = httpx.post(
        f"{server}/infer", json={"input": "tiny t", "max_length": 8}, timeout=60
    ).json()
    for t in (1e-300, 5e-324, 1e-30, 1e-6):
        r = httpx.post(
            f"{server}/infer",
            json={"input": "tiny t", "max_length": 8, "temperature": t},
            timeout=60,
        )
        assert r.status_code == 200, (t, r.text)
        assert r.json()["output"] == greedy["output"], t
