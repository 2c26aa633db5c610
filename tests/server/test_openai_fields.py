"""What OpenAI clients send beyond the basics, through the official client (tiny random
models, fp32): log-probabilities equal to the target-only engine's, `n` choices, and
fields that are honoured, ignored (caller descriptions) or refused with a 400 naming
them (never a silent downgrade)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from slimspec.server.service import ModelRef

from tests.server.conftest import running_server, tiny_config

CHAT = [{"role": "user", "content": "tell me abc"}]


def client_for(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return client_for(server)


@pytest.fixture(scope="module")
def target_only(tiny) -> Iterator[openai.OpenAI]:
    ref = ModelRef(target="tiny-a", draft="none", version="base", dtype="float32")
    with running_server(tiny_config(tiny, model=ref)) as base:
        yield client_for(base)


def test_models_list_says_the_target_only_engine_looks_nothing_up(target_only) -> None:
    entry = target_only.models.list().data[0].model_dump()
    assert entry["lookup_tokens"] == 0
    assert entry["draft_context"] == 0


def entries(resp) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [
        (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
        for e in resp.choices[0].logprobs.content
    ]


def assert_close(got, want) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lp, top), (_, wlp, wtop) in zip(got, want, strict=True):
        assert lp == pytest.approx(wlp, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in wtop]
        assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=1e-4)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}])
def test_chat_logprobs_equal_the_target_only_engines(client, target_only, sampling) -> None:
    kw = dict(model="m", messages=CHAT, max_tokens=12, logprobs=True, top_logprobs=3, **sampling)
    spec = client.chat.completions.create(**kw)
    ref = target_only.chat.completions.create(**kw)
    assert spec.choices[0].message.content == ref.choices[0].message.content
    got = entries(spec)
    assert got, "no tokens"
    assert "".join(t for t, _, _ in got) == spec.choices[0].message.content
    assert all(lp <= 0 and len(top) == 3 for _, lp, top in got)
    assert_close(got, entries(ref))
    first = spec.choices[0].logprobs.content[0]
    assert bytes(first.bytes) == first.token.encode("utf-8")


def test_streamed_logprobs_are_the_same_as_the_whole_answers(client) -> None:
    kw = dict(model="m", messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = entries(client.chat.completions.create(**kw))
    streamed = []
    for ch in client.chat.completions.create(**kw, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            for e in ch.choices[0].logprobs.content:
                streamed.append(
                    (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                )
    assert_close(streamed, whole)


def test_completion_logprobs_and_offsets(client) -> None:
    c = client.completions.create(model="m", prompt="xyz", max_tokens=10, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    text = c.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.tokens) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    # greedy: the chosen token is the likeliest one
    assert all(
        max(d.values()) == pytest.approx(v)
        for d, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    stop = text[2:4]
    cut = client.completions.create(
        model="m", prompt="xyz", max_tokens=10, temperature=0, logprobs=0, stop=[stop]
    )
    kept = cut.choices[0].logprobs.tokens
    assert cut.choices[0].text == text[: text.find(stop)]
    assert "".join(kept).startswith(cut.choices[0].text) and len(kept) <= text.find(stop) + 1


def test_n_choices_seeded_and_reproducible(client) -> None:
    kw = dict(model="m", prompt="seed test", max_tokens=12, temperature=1.0, seed=42)
    one = client.completions.create(**kw)
    three = client.completions.create(**kw, n=3)
    again = client.completions.create(**kw, n=3)
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]  # each choice reproducible
    assert texts[0] == one.choices[0].text  # choice 0 is the n = 1 answer
    assert len(set(texts)) > 1  # distinct streams
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens > one.usage.completion_tokens
    chat = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=2, stream=True
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for ch in chat:
        for c in ch.choices:
            by_index[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    whole = client.chat.completions.create(
        model="m", messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=2
    )
    assert finished == {0, 1}
    assert [by_index[0], by_index[1]] == [c.message.content for c in whole.choices]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        # the tiny models' chat template does not render tools: refused, not ignored
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"colour": "red"}, "colour"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ],
)
def test_output_changing_fields_are_refused_by_name(server, extra, field) -> None:
    body = {"messages": CHAT, "max_tokens": 4, **extra}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u1", "metadata": {"k": "v"}, "store": False},
        {"response_format": {"type": "text"}, "presence_penalty": 0, "logit_bias": {}},
        {"tool_choice": "none", "tools": []},
        # tools rendered nowhere and nothing parsed: fine even for a template without tools
        {"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]},
    ],
)
def test_neutral_and_descriptive_fields_are_accepted(server, extra) -> None:
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_completion_combinations_that_are_refused(client) -> None:
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="m", prompt="x", max_tokens=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="m", prompt="x", max_tokens=3, echo=True, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="response_format"):  # chat's field
        client.completions.create(
            model="m",
            prompt="x",
            max_tokens=3,
            extra_body={"response_format": {"type": "json_object"}},
        )
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="m", prompt="x", max_tokens=3, suffix="end")
    tool_turn = [
        *CHAT,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]
    with pytest.raises(openai.BadRequestError, match="tool_calls"):
        client.chat.completions.create(model="m", messages=tool_turn, max_tokens=3)


def test_invalid_tool_definitions_are_refused(server) -> None:
    for tool in (
        {"type": "function", "function": {"name": "has space"}},
        {"type": "retrieval"},
        {"type": "function", "function": {"name": "f", "colour": "red"}},
    ):
        body = {"messages": CHAT, "max_tokens": 2, "tools": [tool]}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert 400 <= r.status_code < 500 and "tools" in r.text, r.text


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client) -> None:
    system = "You are a careful assistant. Answer briefly and exactly. " * 2  # ~114 tokens
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 96 <= cached < again.usage.prompt_tokens  # whole blocks, never the last token
    stream = client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == cached
