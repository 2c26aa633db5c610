"""Which OpenAI request fields the server honours, ignores or refuses: never a silent
downgrade.

A field that changes what must be produced is honoured (a field of the request model
in schemas.py) or, unless it carries its neutral value, refused with a 400 that names
it. Fields that only describe the caller are ignored and named in a log line. A field
this server does not know at all is refused too: it may be a new OpenAI option whose
effect a client relies on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from slimspec.server.errors import ApiError

# Describe the caller or the billing, not the output.
DESCRIPTIVE = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "parallel_tool_calls",  # (a chat field) on completions: only with tools, refused
    }
)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _zero(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v == 0)


def _is(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in neutral


# Output-changing fields this server does not do, with the value that changes nothing
# (accepted) and why anything else is refused.
NOT_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # (chat honours it: a field of its request model; the completions API has none)
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        "response_format is a chat completions field",
    ),
    # (chat honours them: fields of its request model)
    "tools": (_empty, "tools are a chat completions field"),
    "tool_choice": (_is("none", "auto"), "tool_choice is a chat completions field"),
    "functions": (_empty, "functions is the legacy form of tools: use tools"),
    "function_call": (_is("none", "auto"), "function_call is the legacy form: use tool_choice"),
    "logit_bias": (_empty, "logit_bias is not supported"),
    "presence_penalty": (_zero, "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (_zero, "frequency_penalty is not supported (only 0)"),
    "repetition_penalty": (_is(1, 1.0), "repetition_penalty is not supported (only 1)"),
    "min_p": (_zero, "min_p is not supported (only 0)"),
    "min_tokens": (_zero, "min_tokens is not supported (only 0)"),
    "ignore_eos": (_is(False), "ignore_eos is not supported"),
    "suffix": (_empty, "suffix (insertion) is not supported"),
    "audio": (_empty, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only the text modality is served"),
    "prediction": (_empty, "predicted outputs are not supported"),
    "reasoning_effort": (_empty, "reasoning_effort is not supported by the served models"),
    "verbosity": (_empty, "verbosity is not supported by the served models"),
    "web_search_options": (_empty, "web search is not supported"),
}


def check_extra_fields(extra: Mapping[str, Any] | None) -> list[str]:
    """The request's fields that are not honoured: ApiError 400 naming the first one
    that would change the output; otherwise the descriptive ones (to be logged)."""
    ignored: list[str] = []
    refused: list[tuple[str, str]] = []
    for name, value in (extra or {}).items():
        if name in DESCRIPTIVE:
            ignored.append(name)
        elif name in NOT_SUPPORTED:
            neutral, why = NOT_SUPPORTED[name]
            if not neutral(value):
                refused.append((name, why))
        else:
            refused.append((name, f"unknown field '{name}' (this server does not know it)"))
    if refused:
        names = ", ".join(n for n, _ in refused)
        detail = "; ".join(why for _, why in refused)
        raise ApiError(
            400, "unsupported_field", f"unsupported field(s) {names}: {detail}", param=refused[0][0]
        )
    return ignored
