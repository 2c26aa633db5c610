"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries and the
completions API's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists.

A token's `bytes` are its raw bytes (a byte-level BPE token may hold part of a UTF-8
character), its `token` string their lossy UTF-8 reading, as OpenAI returns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from slimspec.decoding.grammar import token_bytes
from slimspec.decoding.types import TokenLogprob


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer: Any, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or stream delta's) `logprobs` object."""
    content = []
    for lp in lps:
        e = _entry(tokenizer, lp.token_id, lp.logprob)
        e["top_logprobs"] = [_entry(tokenizer, t, v) for t, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Any, lps: Sequence[TokenLogprob], starts: Sequence[int], offset: int = 0
) -> dict[str, Any]:
    """A completion choice's (or stream chunk's) `logprobs` object; starts: where each
    token's text starts in the output, offset: the text before the output (echo)."""

    def text(t: int) -> str:
        return token_bytes(tokenizer, t).decode("utf-8", "replace")

    return {
        "tokens": [text(lp.token_id) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": [offset + s for s in starts],
    }
