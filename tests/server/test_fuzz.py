"""Fuzz the request schemas over real HTTP: whatever the body, never a 5xx, and the
server keeps serving. Values mix valid and hostile ones so that both the
validation paths and the generation path are exercised (generation kept short)."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slimspec.server import slimspec_pb2

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
text = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=30)
small = st.integers(-2, 3)


def maybe(value: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(value, junk)


infer_body = st.fixed_dictionaries(
    {"input": maybe(text)},
    optional={
        "max_length": maybe(small),
        "temperature": maybe(st.floats(-1, 3)),
        "top_p": maybe(st.floats(-0.5, 1.5)),
        "seed": maybe(st.integers(-5, 2**64)),
        "stop": maybe(st.lists(text, max_size=5)),
        "include_input": maybe(st.booleans()),
        "format": maybe(st.sampled_from(["text", "json", "xml"])),
        "extra": junk,
    },
)
completion_body = st.fixed_dictionaries(
    {"prompt": maybe(st.one_of(text, st.lists(text, max_size=2)))},
    optional={
        "max_tokens": maybe(small),
        "temperature": maybe(st.floats(-1, 3)),
        "stream": maybe(st.booleans()),
        "stop": maybe(st.one_of(text, st.lists(text, max_size=5))),
        "seed": maybe(st.integers(-(2**64), 2**64)),
        "n": maybe(small),
        "echo": maybe(st.booleans()),
    },
)
message = st.fixed_dictionaries(
    {
        "role": maybe(st.sampled_from(["user", "system", "assistant", "robot"])),
        "content": maybe(text),
    }
)
chat_body = st.fixed_dictionaries(
    {"messages": maybe(st.lists(message, max_size=3))},
    optional={"max_tokens": maybe(small), "stream": maybe(st.booleans()), "top_p": junk},
)

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
        assert r.json()["error"]["message"]


@FUZZ
@given(body=infer_body)
def test_fuzz_infer(server: str, body: dict) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    check(
        httpx.post(
            f"{server}/infer", content=raw, timeout=60, headers={"Content-Type": "application/json"}
        )
    )


@FUZZ
@given(raw=st.binary(max_size=64))
def test_fuzz_raw_bytes(server: str, raw: bytes) -> None:
    for ctype in ("application/json", "application/x-protobuf"):
        check(
            httpx.post(f"{server}/infer", content=raw, timeout=60, headers={"Content-Type": ctype})
        )
    check(
        httpx.post(
            f"{server}/v1/chat/completions",
            content=raw,
            timeout=60,
            headers={"Content-Type": "application/json"},
        )
    )


@FUZZ
@given(inp=text, n=st.integers(0, 2**32 - 1), temp=st.floats(width=32, allow_nan=True))
def test_fuzz_protobuf_fields(server: str, inp: str, n: int, temp: float) -> None:
    msg = slimspec_pb2.InferRequest(
        input=inp, max_length=min(n, 3) if n % 2 else n, temperature=temp
    )
    check(
        httpx.post(
            f"{server}/infer",
            content=msg.SerializeToString(),
            timeout=60,
            headers={"Content-Type": "application/x-protobuf"},
        )
    )


@FUZZ
@given(body=completion_body)
def test_fuzz_completions(server: str, body: dict) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    check(
        httpx.post(
            f"{server}/v1/completions",
            content=raw,
            timeout=60,
            headers={"Content-Type": "application/json"},
        )
    )


@FUZZ
@given(body=chat_body)
def test_fuzz_chat(server: str, body: dict) -> None:
    raw = json.dumps(body, allow_nan=True).encode()
    check(
        httpx.post(
            f"{server}/v1/chat/completions",
            content=raw,
            timeout=60,
            headers={"Content-Type": "application/json"},
        )
    )


def test_still_serving_after_fuzz(server: str) -> None:
    r = httpx.post(f"{server}/infer", json={"input": "ok", "max_length": 2}, timeout=60)
    assert r.status_code == 200
