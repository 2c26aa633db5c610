"""Tool calling's decisions (server/tools.py): reading the model's call blocks, what a
stream may show before a call, tool_choice, the forced-call grammar (compiled and
walked by llguidance) and how templates are probed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from slimspec.decoding.grammar import grammar_error, lark_grammar
from slimspec.server.errors import ApiError
from slimspec.server.tools import (
    TEXT_TAGS,
    ToolChoice,
    ToolStreamFilter,
    auto_with_format_lark,
    check_tools,
    forced_call_lark,
    parse_tool_calls,
    parse_tool_choice,
    safe_content_length,
    tag_terminals,
    template_tool_calls,
    tool_support,
)

from tests.server.conftest import char_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_parse_calls_content_and_ids() -> None:
    out = parse_tool_calls("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert out.content == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [
        {"city": "Paris"},
        {"city": "Oslo"},
    ]
    assert {c["function"]["name"] for c in out.tool_calls} == {"get_weather"}
    ids = [c["id"] for c in out.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert all(c["type"] == "function" for c in out.tool_calls)


def test_parse_only_a_call_has_no_content() -> None:
    out = parse_tool_calls(CALL)
    assert out.content is None and len(out.tool_calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        "plain answer, no call",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "argum',  # cut short (max_tokens)
    ],
)
def test_what_is_not_a_call_stays_content(text: str) -> None:
    out = parse_tool_calls(text)
    assert out.content == text and out.tool_calls == []


def test_an_unclosed_but_complete_block_is_a_call() -> None:
    out = parse_tool_calls(CALL.removesuffix("</tool_call>"))
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"]


def test_stream_holds_back_a_call_and_its_possible_start() -> None:
    assert safe_content_length("Hello <tool_c") == len("Hello ")
    assert safe_content_length("a < b") == len("a < b")
    assert safe_content_length("x" + CALL) == 1
    f = ToolStreamFilter()
    pieces = [
        "Sure",
        ". <",
        'tool_call>\n{"name": "get_weather", ',
        '"arguments": {}}\n</tool_call>',
    ]
    shown = "".join(f.piece(p) for p in pieces)
    assert shown == "Sure. "
    parsed = f.finish()
    assert parsed.content is None
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]
    g = ToolStreamFilter()  # a "<" that turned out to be text is released at the end
    assert g.piece("1 <") == "1 " and g.finish().content == "<"


def test_tool_choice_forms() -> None:
    tools = check_tools([WEATHER, TIME])
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", tools).forced
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools)
    assert named == ToolChoice("function", "get_time") and named.forced
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "x"}):
        with pytest.raises(ApiError) as e:
            parse_tool_choice(bad, tools)
        assert e.value.status_code == 400 and e.value.param == "tool_choice"
    with pytest.raises(ApiError, match="needs tools"):
        parse_tool_choice("required", [])
    with pytest.raises(ApiError, match="duplicate"):
        check_tools([WEATHER, WEATHER])


def _walk(grammar: str, text: str) -> tuple[bool, bool]:
    """(every byte accepted, grammar complete) for text, byte by byte."""
    import llguidance

    class Bytes:  # a tokenizer whose tokens are the 256 bytes (and an EOS)
        def __init__(self) -> None:
            self.eos_token_id = 256
            self.bos_token_id = None
            self.tokens = [bytes([b]) for b in range(256)] + [b""]
            self.special_token_ids = [256]

        def __call__(self, s: Any) -> list[int]:
            return list(s.encode() if isinstance(s, str) else s)

    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    ok = all(m.consume_token(b) for b in text.encode())
    return ok and not m.is_error(), m.is_accepting()


def test_forced_call_grammar_allows_exactly_the_schema() -> None:
    tools = check_tools([WEATHER, TIME])
    one = lark_grammar(forced_call_lark(tools, ToolChoice("function", "get_weather"), False))
    assert grammar_error(one) == ""
    compact = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    assert _walk(one, compact) == (True, True)
    assert _walk(one, compact.replace("get_weather", "get_time"))[0] is False  # not chosen
    assert _walk(one, compact.replace('{"city":"Paris"}', "{}"))[0] is False  # city required
    assert _walk(one, compact + "\n" + compact)[0] is False  # not parallel
    many = lark_grammar(forced_call_lark(tools, ToolChoice("required"), True))
    two = compact + '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
    assert _walk(many, two) == (True, True)
    assert _walk(many, "Sure: " + compact)[0] is False  # a forced answer is calls only


def test_auto_with_a_response_format_is_that_format_or_calls() -> None:
    g = lark_grammar(auto_with_format_lark({"type": "object"}, check_tools([WEATHER])))
    assert _walk(g, '{"a":1}') == (True, True)
    assert _walk(g, '<tool_call>\n{"name":"get_weather","arguments":{"city":"x"}}\n</tool_call>')[1]
    assert _walk(g, "free text")[0] is False


def test_earlier_calls_reach_templates_as_objects() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert template_tool_calls(calls)[0]["function"]["arguments"] == {"x": 1}
    kept = [{"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]
    assert template_tool_calls(kept)[0]["function"]["arguments"] == "{oops"


def test_a_template_without_tools_is_probed_as_such() -> None:
    tok = char_tokenizer()
    support = tool_support(tok)
    assert not support.renders_tools and not support.renders_calls
    assert support.renders_results  # "tool: <result>" like any other role
    assert "does not render tools" in (support.refusal() or "")
    hermes = char_tokenizer()
    hermes.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
        "Call as <tool_call>...</tool_call>{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>"
        "{% endfor %}\n{% endfor %}"
    )
    support = tool_support(hermes)
    assert support.renders_tools and support.renders_calls and support.hermes
    assert support.renders_results
    assert support.refusal() is None


def test_call_tags_are_text_unless_the_tokenizer_has_them_as_tokens() -> None:
    assert tag_terminals(char_tokenizer()) == TEXT_TAGS  # spelled character by character
    lark = forced_call_lark(check_tools([TIME]), ToolChoice("required"), False, ("<[7]>", "<[8]>"))
    assert lark.startswith('start: call\ncall: <[7]> "\\n" obj "\\n" <[8]>')


def test_a_whole_answer_that_is_one_json_call_of_a_tool_is_that_call() -> None:
    names = frozenset({"get_weather"})
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (call, f"```json\n{call}\n```", f"\n```\n{call}\n```\n"):
        out = parse_tool_calls(text, names)
        assert out.content is None and len(out.tool_calls) == 1, text
        assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    for text in (
        call.replace("get_weather", "get_time"),  # not one of the tools
        '{"name": "get_weather", "arguments": {}, "note": 1}',  # more than a call
        f"Here: {call}",  # an answer that mentions a call
    ):
        assert parse_tool_calls(text, names).tool_calls == [], text
    assert parse_tool_calls(call).tool_calls == []  # no tools: it is an answer
    f = ToolStreamFilter(names)
    assert f.piece(" ") == "" and f.piece("```json\n") == "" and f.piece(call + "```") == ""
    assert [c["function"]["name"] for c in f.finish().tool_calls] == ["get_weather"]
    g = ToolStreamFilter(names)
    assert g.piece('{"a": 1}') == "" and g.finish().content == '{"a": 1}'
