"""What API users rely on: OpenAI-shaped errors the official client maps to the right
exception class, the served model name, the optional API key, seeded sampling that
reproduces through the openai client, the context length, per-position acceptance."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from slimspec.server.service import Limits, ModelRef

KEY = "sk-test-0123456789"


def client(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def test_errors_have_openai_shape_and_client_classes(server: str) -> None:
    c = client(server)
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model="m", prompt="x", max_tokens=10**6)
    assert exc.value.code == "max_tokens_exceeded" and exc.value.param == "max_tokens"
    assert exc.value.type == "invalid_request_error"
    with pytest.raises(openai.UnprocessableEntityError) as exc2:
        c.completions.create(model="m", prompt="x", temperature=9.0)
    assert exc2.value.param == "temperature" and exc2.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")  # unknown route: 404
    r = httpx.post(f"{server}/infer", json={"input": "hi", "top_p": 0}, timeout=30)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "top_p",
        "invalid_value",
    )


def test_served_model_name(make_server, tiny) -> None:  # type: ignore[no-untyped-def]
    with make_server(served_model_name="coder-1.5b") as base:
        c = client(base)
        assert [m.id for m in c.models.list().data] == ["coder-1.5b"]
        out = c.completions.create(model="coder-1.5b", prompt="abc", max_tokens=3, temperature=0)
        assert out.model == "coder-1.5b"
    from slimspec.server.openai_api import model_name

    assert model_name("/models/qwen/qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-1.5b-instruct"
    assert model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id stays
    assert model_name("qwen2.5-coder-1.5b-instruct") == "qwen2.5-coder-1.5b-instruct"


def test_api_key_on_inference_routes(make_server) -> None:  # type: ignore[no-untyped-def]
    with make_server(api_key=KEY) as base:
        with pytest.raises(openai.AuthenticationError) as exc:
            client(base, "wrong").completions.create(model="m", prompt="x", max_tokens=2)
        assert exc.value.code == "invalid_api_key" and KEY not in str(exc.value.body)
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").models.list()
        ok = client(base, KEY).completions.create(model="m", prompt="x", max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        r = httpx.post(f"{base}/infer", json={"input": "hi", "max_length": 2}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(
            f"{base}/infer",
            json={"input": "hi", "max_length": 2},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert r.status_code == 200
        # probes and metrics stay open
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(f"{base}{path}").status_code == 200
        assert (
            'slimspec_requests_total{code="401",endpoint="/infer"}'
            in httpx.get(f"{base}/metrics").text
        )


def test_api_key_from_file_and_env(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from slimspec.cli import read_api_key

    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    assert read_api_key({"SLIMSPEC_API_KEY_FILE": str(f), "SLIMSPEC_API_KEY": "other"}) == KEY
    assert read_api_key({"SLIMSPEC_API_KEY": " k "}) == "k"
    assert read_api_key({"SLIMSPEC_API_KEY": " "}) is None
    assert read_api_key({}, str(f)) == KEY


def test_seed_reproduces_through_the_openai_client_across_batches(server: str) -> None:
    """Same seed, same prompt -> same text, alone or among concurrent requests."""
    from concurrent.futures import ThreadPoolExecutor

    c = client(server)
    kw = dict(model="m", prompt="seeded", max_tokens=24, temperature=1.0, top_p=0.95)
    alone = [c.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)]
    assert len(set(alone)) > 1  # the seeds matter

    def one(i: int) -> str:
        if i % 2:
            return c.completions.create(**{**kw, "prompt": f"noise {i}"}).choices[0].text
        return c.completions.create(**kw, seed=1 + (i // 2) % 3).choices[0].text

    with ThreadPoolExecutor(6) as ex:
        together = list(ex.map(one, range(6)))
    assert [together[0], together[2], together[4]] == alone


def test_seeded_text_equals_target_only_server(make_server) -> None:  # type: ignore[no-untyped-def]
    body = {"input": "same text", "max_length": 20, "temperature": 0.8, "seed": 42}
    with make_server() as spec:
        a = httpx.post(f"{spec}/infer", json=body, timeout=60).json()["output"]
    with make_server(model=ModelRef("tiny-a", "none", "base", "float32")) as base:
        b = httpx.post(f"{base}/infer", json=body, timeout=60).json()["output"]
    assert a == b


def test_context_length_is_a_clear_400(make_server) -> None:  # type: ignore[no-untyped-def]
    limits = Limits(max_new_tokens=600, max_input_tokens=600, max_input_chars=4000)
    with make_server(limits=limits) as base:  # the tiny models hold 512 positions
        r = httpx.post(f"{base}/infer", json={"input": "x" * 500, "max_length": 100}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded"
        assert err["param"] == "max_length" and "512" in err["message"]
        r = httpx.post(f"{base}/infer", json={"input": "x" * 520}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        # a default max_tokens shrinks to what is left of the context
        c = client(base)
        out = c.completions.create(model="m", prompt="y" * 500, temperature=0)
        assert out.usage.prompt_tokens + out.usage.completion_tokens <= 512
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(model="m", prompt="y" * 500, max_tokens=100)
        assert exc.value.code == "context_length_exceeded"


def test_per_position_acceptance_metric(server: str) -> None:
    httpx.post(f"{server}/infer", json={"input": "positions", "max_length": 24}, timeout=60)
    text = httpx.get(f"{server}/metrics").text
    drafted = dict(
        re.findall(r'^slimspec_draft_position_tokens_total\{position="(\d+)"\} (\S+)$', text, re.M)
    )
    accepted = dict(
        re.findall(
            r'^slimspec_draft_position_accepted_total\{position="(\d+)"\} (\S+)$', text, re.M
        )
    )
    assert "1" in drafted and float(drafted["1"]) > 0
    for pos, n in accepted.items():
        assert float(n) <= float(drafted[pos])
    # position i+1 is drafted only in steps that drafted position i
    ds = [float(drafted[str(i)]) for i in range(1, len(drafted) + 1)]
    assert ds == sorted(ds, reverse=True)
    total = re.search(r"^slimspec_draft_tokens_total (\S+)$", text, re.M)
    assert float(total.group(1)) == pytest.approx(sum(ds))
