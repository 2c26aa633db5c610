"""Output post-processing: stop sequences, output format, blocked-word filters.

Pure functions over strings, shared by /infer, the OpenAI routes and streaming.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OUTPUT_FORMATS = ("text", "json")


def apply_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Cut text before the earliest stop sequence; (text, whether one was found)."""
    cut = min((i for s in stops if s and (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of text that could be the start of a stop sequence.

    Streaming must hold those back until the next tokens show whether a stop follows.
    """
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold


@dataclass(frozen=True)
class FilterRules:
    """Blocked words, replaced case-insensitively as whole words."""

    blocked_words: tuple[str, ...] = ()
    replacement: str = "***"

    @property
    def active(self) -> bool:
        return bool(self.blocked_words)


def parse_blocked_words(raw: str | Sequence[str] | None) -> tuple[str, ...]:
    """Comma/newline separated list (or a list) -> cleaned, de-duplicated words."""
    if raw is None:
        return ()
    items = re.split(r"[,\n]", raw) if isinstance(raw, str) else list(raw)
    return tuple(dict.fromkeys(w.strip() for w in items if w and w.strip()))


def apply_filters(text: str, rules: FilterRules) -> str:
    if not rules.active:
        return text
    words = sorted(rules.blocked_words, key=len, reverse=True)
    pattern = r"(?<!\w)(?:" + "|".join(re.escape(w) for w in words) + r")(?!\w)"
    return re.sub(pattern, rules.replacement, text, flags=re.IGNORECASE)


def filter_holdback(text: str, rules: FilterRules) -> int:
    """Characters after the last word boundary: a blocked word may still be growing there."""
    if not rules.active:
        return 0
    m = re.search(r"\w+$", text)
    return len(m.group(0)) if m else 0


def safe_emit_length(text: str, stops: Sequence[str], rules: FilterRules) -> int:
    """How many leading characters of the text so far can be streamed now."""
    n = len(text) - max(stop_holdback(text, stops), filter_holdback(text, rules))
    # A trailing U+FFFD is usually half of a multi-byte character still being decoded.
    while n > 0 and text[n - 1] == "\ufffd":
        n -= 1
    return n


class OutputFormatError(ValueError):
    pass


def extract_json(text: str) -> Any:
    """The first complete JSON object or array in text (models often add prose around it)."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                value, _ = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                continue
            return value
    raise OutputFormatError("model output contains no valid JSON object or array")


def format_output(text: str, fmt: str) -> Any:
    if fmt == "text":
        return text
    if fmt == "json":
        return extract_json(text)
    raise OutputFormatError(f"unknown output format {fmt!r}; use one of {OUTPUT_FORMATS}")
