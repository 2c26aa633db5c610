"""Pure output post-processing: stop sequences, filters, formats, streaming hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from slimspec.server.postprocess import (
    FilterRules,
    OutputFormatError,
    apply_filters,
    apply_stop,
    format_output,
    parse_blocked_words,
    safe_emit_length,
    stop_holdback,
)


def test_apply_stop_cuts_at_earliest() -> None:
    assert apply_stop("abc END def STOP", ["STOP", "END"]) == ("abc ", True)
    assert apply_stop("abc", ["x"]) == ("abc", False)
    assert apply_stop("abc", []) == ("abc", False)


def test_stop_holdback_keeps_partial_match() -> None:
    assert stop_holdback("hello E", ["END"]) == 1
    assert stop_holdback("hello EN", ["END"]) == 2
    assert stop_holdback("hello", ["END"]) == 0


def test_filters_whole_words_case_insensitive() -> None:
    rules = FilterRules(("darn", "heck"))
    assert apply_filters("Darn it, what the HECK; darned", rules) == "*** it, what the ***; darned"
    assert apply_filters("x", FilterRules()) == "x"


def test_parse_blocked_words() -> None:
    assert parse_blocked_words(" a, b\nc,,a ") == ("a", "b", "c")
    assert parse_blocked_words(None) == ()


def test_format_output_json() -> None:
    assert format_output('Sure: {"a": [1, 2]} done', "json") == {"a": [1, 2]}
    assert format_output("plain", "text") == "plain"
    with pytest.raises(OutputFormatError):
        format_output("no json here {", "json")
    with pytest.raises(OutputFormatError):
        format_output("x", "yaml")


@given(st.text(max_size=60), st.lists(st.text(min_size=1, max_size=4), max_size=3), st.data())
def test_streaming_equals_whole(text: str, stops: list[str], data: st.DataObject) -> None:
    """Emitting safe prefixes as text grows, then the rest, gives the one-shot result."""
    rules = FilterRules(("bad",))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=5)))
    emitted, out = 0, ""
    for c in [*cuts, len(text)]:
        prefix = text[:c]
        cut, hit = apply_stop(prefix, stops)
        if hit:
            out += apply_filters(cut[emitted:], rules)
            break
        n = safe_emit_length(prefix, stops, rules) if c < len(text) else len(prefix)
        if n > emitted:
            out += apply_filters(prefix[emitted:n], rules)
            emitted = n
    whole, _ = apply_stop(text, stops)
    assert out == apply_filters(whole, rules)
