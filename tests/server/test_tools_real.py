"""Tool calling through the official `openai` client on the default real pair
(Qwen2.5-Coder 1.5B target, 0.5B draft, the engine `slimspec serve` builds), whose
chat template renders tools and teaches the <tool_call> form: forced calls follow the
tool's schema, streamed calls equal whole ones, the model's own (auto) call is parsed,
and a tool's result goes back into the conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from slimspec.server.service import ModelRef

from tests.server.conftest import running_server, tiny_config

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(tiny: Any, real_model_pair: Any) -> Iterator[openai.OpenAI]:
    ref = ModelRef(
        target=str(real_model_pair.target), draft=str(real_model_pair.draft), version="q"
    )
    with running_server(tiny_config(tiny, model=ref, loader=None), ready_timeout=600) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def _args(call: Any) -> dict[str, Any]:
    value = json.loads(call.function.arguments)
    assert isinstance(value, dict)
    return value


def test_a_named_tool_choice_gives_a_call_that_follows_the_schema(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(
        model="m",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        parallel_tool_calls=False,  # (with it, this model goes on to call for other cities)
        temperature=0,
        max_tokens=80,
    )
    c = resp.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    assert c.message.content is None
    (call,) = c.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    args = _args(call)
    assert set(args) <= {"city", "unit"} and isinstance(args["city"], str)
    assert "paris" in args["city"].lower()
    assert args.get("unit", "celsius") in ("celsius", "fahrenheit")

    stream = client.chat.completions.create(
        model="m",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    chunks = list(stream)
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"]  # type: ignore[union-attr]
    assert json.loads(deltas[0].function.arguments) == args  # type: ignore[union-attr, arg-type]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_picks_one_of_the_tools(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    (call,) = resp.choices[0].message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")
    schema = (WEATHER if call.function.name == "get_weather" else CLOCK)["function"]
    assert set(schema["parameters"]["required"]) <= set(_args(call))  # type: ignore[index]


def test_the_models_own_call_and_the_tools_answer(
    client: openai.OpenAI, real_model_pair: Any
) -> None:
    resp = client.chat.completions.create(
        model="m",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        temperature=0,
        max_tokens=80,
    )
    msg = resp.choices[0].message
    # auto: the model chose to call (greedy, so it always does on these weights)
    assert resp.choices[0].finish_reason == "tool_calls", msg.content
    (call,) = msg.tool_calls or []
    assert call.function.name == "get_weather" and "city" in _args(call)
    stream = client.chat.completions.create(
        model="m",
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    chunks = list(stream)
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [  # type: ignore[union-attr]
        (call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    turn = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": '{"temperature_c": 31, "sky": "clear"}',
        },
    ]
    answer = client.chat.completions.create(
        model="m",
        messages=turn,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        temperature=0,
        max_tokens=40,
    )
    # the call and its result reached the prompt through the model's own template, the
    # arguments as an object (OpenAI sends them as a JSON string)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model_pair.target)
    turn[1]["tool_calls"][0]["function"]["arguments"] = _args(call)  # type: ignore[index]
    text = tok.apply_chat_template(
        turn, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert "<tool_response>" in text and '"temperature_c": 31' in text
    assert f'"arguments": {json.dumps(_args(call))}' in text
    # the conversation so far was served from the prefix cache
    assert answer.usage.prompt_tokens_details is not None
    assert (answer.usage.prompt_tokens_details.cached_tokens or 0) >= 16
