"""Every endpoint through real HTTP against uvicorn on loopback (tiny random models)."""

from __future__ import annotations

import re

import httpx
import pytest
from slimspec.server import slimspec_pb2

from tests.server.conftest import TOKEN

PB = "application/x-protobuf"


def post(base: str, path: str, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{base}{path}", timeout=60, **kw)


def test_health_and_ready(server: str) -> None:
    assert httpx.get(f"{server}/healthz").json() == {"status": "ok"}
    r = httpx.get(f"{server}/readyz")
    assert r.status_code == 200 and r.json()["model_version"] == "v1"


def test_infer_seed_contract(server: str) -> None:
    r = post(server, "/infer", json={"input": "Hello, world!", "max_length": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output"].startswith("Hello, world!")
    assert len(body["output"]) > len("Hello, world!")
    assert isinstance(body["latency_ms"], float) and body["latency_ms"] > 0
    assert body["compression_ratio"] == pytest.approx(0.3)
    assert body["model_version"] == "v1"
    assert body["prompt_tokens"] == 13
    assert 1 <= body["completion_tokens"] <= 8
    assert body["finish_reason"] in ("length", "stop")


def test_infer_is_deterministic_greedy_and_include_input(server: str) -> None:
    a = post(server, "/infer", json={"input": "abc", "max_length": 6}).json()
    b = post(server, "/infer", json={"input": "abc", "max_length": 6, "include_input": False})
    assert a["output"] == "abc" + b.json()["output"]


def test_infer_stop_sequence(server: str) -> None:
    full = post(server, "/infer", json={"input": "xyz", "max_length": 12, "include_input": False})
    # The tiny models are seeded and greedy decoding is exact: "xyz" always runs to
    # max_length without an EOS, so there is a stop sequence to cut at (no skip).
    text = full.json()["output"]
    assert full.json()["finish_reason"] == "length" and len(text) >= 4, text
    stop = text[2:4]
    r = post(
        server,
        "/infer",
        json={"input": "xyz", "max_length": 12, "include_input": False, "stop": [stop]},
    )
    assert r.status_code == 200
    assert r.json()["output"] == text[: text.find(stop)]
    assert r.json()["finish_reason"] == "stop"


def test_infer_protobuf_round_trip(server: str) -> None:
    req = slimspec_pb2.InferRequest(input="Hello, world!", max_length=6)
    r = post(
        server,
        "/infer",
        content=req.SerializeToString(),
        headers={"Content-Type": PB, "Accept": PB},
    )
    assert r.status_code == 200 and r.headers["content-type"] == PB
    resp = slimspec_pb2.InferResponse.FromString(r.content)
    as_json = post(server, "/infer", json={"input": "Hello, world!", "max_length": 6}).json()
    assert resp.output == as_json["output"]
    assert resp.model_version == "v1" and resp.completion_tokens == as_json["completion_tokens"]
    assert resp.compression_ratio == pytest.approx(0.3)
    # JSON in, protobuf out (content negotiation by Accept)
    r = post(server, "/infer", json={"input": "Hi", "max_length": 2}, headers={"Accept": PB})
    assert slimspec_pb2.InferResponse.FromString(r.content).output.startswith("Hi")


def test_protobuf_errors(server: str) -> None:
    h = {"Content-Type": PB}
    r = post(server, "/infer", content=b"\xff\xff\xff", headers=h)
    assert r.status_code == 400
    err = slimspec_pb2.ErrorResponse.FromString(r.content)
    assert err.error == "invalid_protobuf" and err.message
    unknown = (
        slimspec_pb2.InferRequest(input="hi").SerializeToString() + b"\xa0\x06\x01"
    )  # field 100
    r = post(server, "/infer", content=unknown, headers=h)
    assert r.status_code == 400 and b"unknown protobuf field" in r.content
    bad_utf8 = b"\x0a\x02\xc3\x28"  # field 1 (string) = invalid UTF-8
    assert post(server, "/infer", content=bad_utf8, headers=h).status_code == 400
    assert post(server, "/infer", content=b"", headers=h).status_code == 422  # input missing


BAD_INFER = [
    (b"{not json", 400, "malformed JSON"),
    (b"", 400, "empty body"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"input": "\xff\xfe"}', 400, "UTF-8"),
    (b'{"input": ""}', 422, "input"),
    (b'{"input": "   "}', 422, "non-whitespace"),
    (b'{"input": 5}', 422, "input"),
    (b'{"input": "hi", "max_length": 0}', 422, "max_length"),
    (b'{"input": "hi", "max_length": 100000}', 400, "max_length must be within"),
    (b'{"input": "hi", "max_length": "50"}', 422, "max_length"),
    (b'{"input": "hi", "max_length": 5.5}', 422, "max_length"),
    (b'{"input": "hi", "max_length": true}', 422, "max_length"),
    (b'{"input": "hi", "colour": "red"}', 422, "colour"),
    (b'{"input": "\\ud800"}', 422, "unicode"),
    (b'{"input": "hi", "temperature": -1}', 422, "temperature"),
    (b'{"input": "hi", "stop": ["a","b","c","d","e"]}', 422, "stop"),
    (b'{"input": "' + b"a" * 5000 + b'"}', 413, "characters"),
    (b'{"max_length": 5}', 422, "input"),
    (b"[" * 100_000, 400, "nested too deeply"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_INFER)
def test_infer_bad_input(server: str, body: bytes, status: int, needle: str) -> None:
    r = post(server, "/infer", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert needle.lower() in r.json()["error"]["message"].lower()


def test_bad_content_type_and_huge_body(server: str) -> None:
    r = post(server, "/infer", content=b"input=hi", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415
    r = post(server, "/infer", content=b"x" * 300_000, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    # and it still serves
    assert post(server, "/infer", json={"input": "ok", "max_length": 1}).status_code == 200


def test_metrics_exposes_contract_names(server: str) -> None:
    post(server, "/infer", json={"input": "metrics", "max_length": 4})
    text = httpx.get(f"{server}/metrics").text
    for name in [
        'slimspec_request_latency_seconds_bucket{endpoint="/infer",le="0.05"}',
        'slimspec_request_latency_seconds_bucket{endpoint="/infer",le="5.0"}',
        'slimspec_time_to_first_token_seconds_count{endpoint="/infer"}',
        'slimspec_requests_total{code="200",endpoint="/infer"}',
        "slimspec_generated_tokens_total",
        "slimspec_draft_tokens_total",
        "slimspec_accepted_tokens_total",
        "slimspec_verify_steps_total",
        "slimspec_mean_accepted_length",
        "slimspec_compression_ratio 0.3",
        "slimspec_quality_threshold 0.95",
        "slimspec_acceptance_kept_ratio",
        "slimspec_queue_depth",
        "slimspec_batch_size_bucket",
        'slimspec_model_info{draft="tiny-a-draft",target="tiny-a",version="v1"} 1.0',
    ]:
        assert name in text, name
    assert "slimspec_gpu_utilization_ratio" not in text  # no GPU here
    drafted = float(re.search(r"^slimspec_draft_tokens_total ([\d.e+]+)$", text, re.M).group(1))
    generated = re.search(r"^slimspec_generated_tokens_total ([\d.e+]+)$", text, re.M)
    assert drafted > 0 and float(generated.group(1)) > 0
    for phase in ("draft", "verify", "prefill"):
        line = rf'^slimspec_engine_seconds_total{{phase="{phase}"}} ([\d.e+-]+)$'
        assert float(re.search(line, text, re.M).group(1)) > 0, phase
    assert re.search(r"^slimspec_fused_prefills_total [\d.e+]+$", text, re.M)


def test_admin_auth(server: str) -> None:
    url = f"{server}/admin/runtime"
    r = httpx.get(url)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert httpx.get(url, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    for path in ("/admin/swap", "/admin/drain"):
        assert httpx.post(f"{server}{path}", json={}).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert httpx.post(f"{server}{path}", json={}, headers=bad).status_code == 403
    r = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["compression_ratio"] == 0.3


def test_admin_runtime_update_applies_and_shows_in_metrics(
    server: str, auth: dict[str, str]
) -> None:
    url = f"{server}/admin/runtime"
    r = httpx.put(url, json={"compression_ratio": 0.95, "colour": 1}, headers=auth)
    assert r.status_code == 422 and "colour" in r.text
    assert httpx.put(url, json={"compression_ratio": "x"}, headers=auth).status_code == 422
    r = httpx.put(url, json={"compression_ratio": 0.5, "quality_threshold": 0.9}, headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["compression_ratio"] == 0.5
    # applied at the next step: the engine reports it after one request
    body = post(server, "/infer", json={"input": "after", "max_length": 3}).json()
    assert body["compression_ratio"] == pytest.approx(0.5)
    text = httpx.get(f"{server}/metrics").text
    assert "slimspec_compression_ratio 0.5" in text
    assert "slimspec_quality_threshold 0.9" in text
    r = httpx.put(url, json={"blocked_words": ["zzz"], "compression_ratio": 0.3}, headers=auth)
    assert r.json()["blocked_words"] == ["zzz"]
    httpx.put(url, json={"blocked_words": [], "quality_threshold": 0.95}, headers=auth)


def test_admin_disabled_without_token(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(admin_token=None, model=_target_only()) as base:
        r = httpx.get(f"{base}/admin/runtime", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and "disabled" in r.json()["error"]["message"]


def _target_only():  # type: ignore[no-untyped-def]
    from slimspec.server.service import ModelRef

    return ModelRef(target="tiny-a", draft="none", version="base", dtype="float32")


def test_blocked_words_filter(make_server, auth) -> None:  # type: ignore[no-untyped-def]
    with make_server(model=_target_only()) as base:
        plain = post(base, "/infer", json={"input": "q", "max_length": 30, "include_input": False})
        # seeded tiny model, greedy: the answer to "q" always holds words (no skip)
        words = re.findall(r"\w+", plain.json()["output"])
        assert words, plain.json()["output"]
        httpx.put(f"{base}/admin/runtime", json={"blocked_words": [words[0]]}, headers=auth)
        r = post(base, "/infer", json={"input": "q", "max_length": 30, "include_input": False})
        out = r.json()["output"]
        assert "***" in out and not re.search(rf"(?<!\w){re.escape(words[0])}(?!\w)", out, re.I)


def test_target_only_reports_no_compression_in_force(make_server, auth) -> None:  # type: ignore[no-untyped-def]
    """Without a draft nothing is compressed: /infer, /metrics and the admin view say
    0.0 in force whatever ratio the runtime settings ask for (the setting is kept)."""
    with make_server(model=_target_only()) as base:
        r = httpx.put(f"{base}/admin/runtime", json={"compression_ratio": 0.5}, headers=auth)
        assert r.status_code == 200
        body = post(base, "/infer", json={"input": "hi", "max_length": 3}).json()
        assert body["compression_ratio"] == 0.0
        assert re.search(
            r"^slimspec_compression_ratio 0\.0$", httpx.get(f"{base}/metrics").text, re.M
        )
        view = httpx.get(f"{base}/admin/runtime", headers=auth).json()
        assert view["compression_ratio"] == 0.5 and view["compression_ratio_in_force"] == 0.0


def test_drain_then_503(make_server, auth) -> None:  # type: ignore[no-untyped-def]
    with make_server(model=_target_only()) as base:
        r = httpx.post(f"{base}/admin/drain", json={"timeout_s": 5}, headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "drained"
        assert httpx.get(f"{base}/readyz").status_code == 503
        r = post(base, "/infer", json={"input": "hi", "max_length": 2})
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert httpx.get(f"{base}/healthz").status_code == 200


def test_openapi_spec_lists_the_api(server: str) -> None:
    spec = httpx.get(f"{server}/openapi.json").json()
    for path in ("/infer", "/v1/completions", "/v1/chat/completions", "/v1/models", "/readyz"):
        assert path in spec["paths"], path
    body = spec["paths"]["/infer"]["post"]["requestBody"]["content"]
    assert {"application/json", PB} <= set(body)


def test_unknown_route_and_method(server: str) -> None:
    r = httpx.get(f"{server}/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]
    assert httpx.get(f"{server}/infer").status_code == 405


def test_swap_in_background_is_not_ready_meanwhile(make_server, auth, tiny) -> None:  # type: ignore[no-untyped-def]
    import time

    tiny.load_delay_s["tiny-b"] = 1.0
    with make_server(model=_target_only()) as base:
        body = {"target": "tiny-b", "draft": "none", "version": "v2", "wait": False}
        r = httpx.post(f"{base}/admin/swap", json=body, headers=auth, timeout=30)
        assert r.status_code == 202
        codes = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready = httpx.get(f"{base}/readyz")
            codes.append(ready.status_code)
            if ready.status_code == 200 and ready.json()["model_version"] == "v2":
                break
            time.sleep(0.01)
        tiny.load_delay_s.clear()
        assert 503 in codes and codes[-1] == 200
        # in-flight and new requests were served throughout; now the new version answers
        assert (
            post(base, "/infer", json={"input": "hi", "max_length": 2}).json()["model_version"]
            == "v2"
        )


def test_chunked_oversized_body_is_413(server: str) -> None:
    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(30):
            yield b"x" * 10_000

    for path in ("/infer", "/v1/completions"):
        r = httpx.post(
            f"{server}{path}",
            content=chunks(),
            timeout=30,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 413, (path, r.text)
