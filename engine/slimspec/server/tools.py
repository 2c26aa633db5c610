"""Tool calling on chat: tools rendered by the model's own chat template, the model's
tool-call output parsed into OpenAI `tool_calls`, and forced calls constrained by the
structured-output grammar machinery (decoding/grammar.py).

The served models write calls in the Hermes form their templates teach (Qwen2.5,
Hermes, many fine-tunes):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that does not render tools, or teaches another form, cannot be served
tools without a silent downgrade: such requests are refused (ToolSupport).

Modes (`tool_choice`): "none" renders no tools and parses nothing; "auto" renders them
and parses whatever the model writes (unconstrained: it may answer in text);
"required" and a named function constrain decoding to one call (or several, with
`parallel_tool_calls`) whose arguments follow the tool's JSON schema.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from slimspec.server.errors import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PROBE_NAME, _PROBE_RESULT = "slimspec_probe_fn", "slimspec_probe_result"

Mode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # the forced function (mode "function")

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, "invalid_value", message, param=param)


def check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools (OpenAI's {"type": "function", "function": {...}} form), with
    unique names; 400 otherwise. The pydantic model has checked each one's shape."""
    tools = tools or []
    names = [t["function"]["name"] for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _bad(f"tools: duplicate function name(s) {', '.join(dup)}", "tools")
    return tools


def parse_tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """`tool_choice` as OpenAI defines it: "none" | "auto" | "required" |
    {"type": "function", "function": {"name": ...}}; the default is "auto" with tools
    and "none" without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise _bad(f"tool_choice {value!r} needs tools", "tool_choice")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad("tool_choice.function.name must be a string", "tool_choice")
        if name not in {t["function"]["name"] for t in tools}:
            raise _bad(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolChoice("function", name)
    raise _bad(
        'tool_choice must be "none", "auto", "required" or {"type": "function", ...}',
        "tool_choice",
    )


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


Tags = tuple[str, str]  # the call block's opening and closing, as Lark terminals
TEXT_TAGS: Tags = (json.dumps(OPEN), json.dumps(CLOSE))


def tag_terminals(tokenizer: Any) -> Tags:
    """How the grammar must spell the call tags for this tokenizer: a tag that is one
    added token (Qwen2.5's <tool_call> is 151657) only matches as that token
    (llguidance's `<[id]>`), not as its text."""
    out = []
    for tag in (OPEN, CLOSE):
        ids = list(tokenizer.encode(tag, add_special_tokens=False))
        out.append(f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(tag))
    return out[0], out[1]


def forced_call_lark(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel: bool, tags: Tags = TEXT_TAGS
) -> str:
    """A Lark grammar (llguidance's dialect, JSON schemas inline) for what a forced
    choice allows: one Hermes call block, or several with `parallel`, whose JSON is
    {"name": <a permitted tool>, "arguments": <that tool's parameters>}."""
    chosen = [t for t in tools if choice.mode == "required" or t["function"]["name"] == choice.name]
    schema: dict[str, Any] = (
        _call_schema(chosen[0])
        if len(chosen) == 1
        else {"anyOf": [_call_schema(t) for t in chosen]}
    )
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return f'{start}\ncall: {tags[0]} "\\n" obj "\\n" {tags[1]}\nobj: %json {json.dumps(schema)}\n'


def auto_with_format_lark(
    format_schema: dict[str, Any], tools: list[dict[str, Any]], tags: Tags = TEXT_TAGS
) -> str:
    """`tool_choice: auto` beside a JSON `response_format`: the answer is either content
    in that format or tool calls, nothing else."""
    calls = forced_call_lark(tools, ToolChoice("required"), True, tags)
    return f"start: content | calls\ncontent: %json {json.dumps(format_schema)}\n" + calls.replace(
        "start: call", "calls: call", 1
    )


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template does with tools (probed by rendering, not by reading it)."""

    renders_tools: bool  # the tool list reaches the prompt
    renders_calls: bool  # earlier turns' calls reach the prompt
    renders_results: bool  # tool results (role "tool") reach the prompt
    hermes: bool  # it teaches the <tool_call> form parse_tool_calls reads

    def refusal(self) -> str | None:
        """Why tools cannot be served with this template (None: they can)."""
        if not self.renders_tools:
            return "the served model's chat template does not render tools"
        if not self.hermes:
            return (
                "the served model's chat template teaches a tool-call form this server "
                "does not parse (it reads <tool_call> JSON blocks)"
            )
        return None


_SUPPORT: weakref.WeakKeyDictionary[Any, ToolSupport] = weakref.WeakKeyDictionary()
_SUPPORT_LOCK = threading.Lock()


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        )
    except Exception:  # a template that rejects the probe does not support it
        return ""


def tool_support(tokenizer: Any) -> ToolSupport:
    """Probe the tokenizer's chat template once: render a made-up tool, call and result
    and see whether they reach the prompt."""
    with _SUPPORT_LOCK:
        if tokenizer in _SUPPORT:
            return _SUPPORT[tokenizer]
    if not getattr(tokenizer, "chat_template", None):
        support = ToolSupport(False, False, False, False)
    else:
        user = {"role": "user", "content": "hi"}
        tool = {
            "type": "function",
            "function": {"name": _PROBE_NAME, "parameters": {"type": "object", "properties": {}}},
        }
        with_tools = _render(tokenizer, [user], [tool])
        call = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}
            ],
        }
        result = {"role": "tool", "tool_call_id": "c0", "content": _PROBE_RESULT}
        with_calls = _render(tokenizer, [user, call, result])
        support = ToolSupport(
            renders_tools=_PROBE_NAME in with_tools,
            renders_calls=_PROBE_NAME in with_calls,
            renders_results=_PROBE_RESULT in with_calls,
            hermes=OPEN in with_tools,
        )
    with _SUPPORT_LOCK:
        _SUPPORT[tokenizer] = support
    return support


def template_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """An earlier assistant turn's OpenAI tool calls as templates expect them: the
    arguments as an object (OpenAI sends a JSON string; templates write them with
    `tojson`, which would quote the string)."""
    out = []
    for call in tool_calls:
        fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # else: the string as sent
                fn["arguments"] = json.loads(args) if args.strip() else {}
        out.append({**call, "function": fn})
    return out


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[dict[str, Any]]


def _new_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": obj["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        },
    }


_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def _bare_call(text: str, names: frozenset[str]) -> dict[str, Any] | None:
    """A whole answer that is one JSON call of a given tool, bare or in a ```json fence
    (what small models write when they skip the tags)."""
    m = _FENCED.fullmatch(text)
    body = m.group(1) if m else text.strip()
    if not body.startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    if not set(obj) <= {"name", "arguments", "parameters"}:
        return None
    return _new_call(obj)


def parse_tool_calls(text: str, names: frozenset[str] = frozenset()) -> ParsedOutput:
    """The model's output as content and tool calls. Text outside the call blocks is the
    content (None when blank). A block that is not a JSON call (or is cut short before
    its JSON ends) leaves the whole output as content: nothing the model wrote is lost.
    Without blocks, an answer that is nothing but one JSON call of a tool in `names`
    (bare or fenced) is that call."""
    if OPEN not in text:
        call = _bare_call(text, names) if names else None
        return ParsedOutput(None, [call]) if call else ParsedOutput(text, [])
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            call = _new_call(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
    rest = _BLOCK.sub("", text).strip()
    return ParsedOutput(rest or None, calls)


def safe_content_length(text: str) -> int:
    """How much of a streamed output can go out as content now: everything before a
    call block, and not a tail that may be the start of one ("<tool_c...")."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return len(text) - n
    return len(text)


class ToolStreamFilter:
    """One streamed choice: content goes out as it comes, up to a call block (or what
    may be the start of one); the held rest is parsed when the choice finishes."""

    def __init__(self, names: frozenset[str] = frozenset()) -> None:
        self.text = ""
        self.sent = 0
        self.names = names  # a bare JSON call of one of these is held back whole

    def piece(self, text: str | None) -> str:
        """The content to send now for this new piece."""
        self.text += text or ""
        if self.names and (not self.text.strip() or self.text.lstrip().startswith(("{", "`"))):
            return ""  # may be a bare call: decided when the choice ends
        n = safe_content_length(self.text)
        out = self.text[self.sent : n] if n > self.sent else ""
        self.sent = max(self.sent, n)
        return out

    def finish(self) -> ParsedOutput:
        """What the held rest is: tool calls, and any content around them."""
        held = self.text[self.sent :]
        if not held:
            return ParsedOutput(None, [])
        return parse_tool_calls(held, self.names if self.sent == 0 else frozenset())


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as stream deltas: each whole in one, with its index."""
    return [{"index": j, **c} for j, c in enumerate(calls)]
