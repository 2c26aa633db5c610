"""The official openai Python client, unchanged, against /v1 (tiny random models)."""

from __future__ import annotations

import httpx
import openai
import pytest
from slimspec.decoding.draft_context import resolve_draft_context
from slimspec.decoding.lookup import resolve_lookup_tokens


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-a"]
    # what the target's weights are served from: the tiny dense models, as loaded
    entry = models.data[0].model_dump()
    assert entry["target_quantization"] == "none" and entry["target_form"]
    # lookup drafts' most tokens, as the process's SLIMSPEC_LOOKUP_TOKENS (or the default) set
    assert entry["lookup_tokens"] == resolve_lookup_tokens(None) > 0
    # the draft's prompt window, as SLIMSPEC_DRAFT_CONTEXT (or the default) set
    assert entry["draft_context"] == resolve_draft_context(None)


def test_completion_and_stream_agree(client: openai.OpenAI) -> None:
    kw = dict(model="tiny-a", prompt="def f(x):", max_tokens=10, temperature=0)
    c = client.completions.create(**kw)
    text = c.choices[0].text
    assert c.choices[0].finish_reason in ("length", "stop")
    assert c.usage.prompt_tokens == len("def f(x):")
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert 1 <= c.usage.completion_tokens <= 10
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == (
        c.choices[0].finish_reason
    )
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == "def f(x):" + text


def test_chat_and_stream_with_usage(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    c = client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=0)
    answer = c.choices[0].message.content
    assert c.choices[0].message.role == "assistant" and c.model == "tiny-a"
    assert c.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model="x",
        messages=msgs,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == answer
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens


def test_stop_and_seed(client: openai.OpenAI) -> None:
    kw = dict(model="m", prompt="seed test", max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    assert a == b  # same seed, same sample
    # The tiny models are seeded and greedy decoding is exact: "xyz" always runs to
    # max_tokens without an EOS, so there is a stop sequence to cut at (no skip).
    prompt = "xyz"
    greedy = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    assert greedy.choices[0].finish_reason == "length" and len(text) >= 3, text
    stop = text[1:3]
    cut = client.completions.create(
        model="m", prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_errors_are_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="x", max_tokens=10**6)
    assert "max_tokens" in str(exc.value)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="m", messages=[])
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="m", prompt="x", n=17)  # above MAX_CHOICES


def test_raw_sse_format(server: str) -> None:
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        timeout=60,
        json={"prompt": "abc", "max_tokens": 3, "stream": True},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
