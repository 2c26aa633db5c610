"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries and the
completions API's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` lists.

A token's `bytes` are its raw bytes (a byte-level BPE token may hold part of a UTF-8
character), its `token` string their lossy UTF-8 reading, as OpenAI returns them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from typing import Any

from slimspec.decoding.types import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: bytes that are printable Latin-1 spell
    themselves, the other 68 are spelled with the characters from U+0100 on, in byte
    order (the table every byte-level BPE tokenizer uses; transformers keeps its copy
    in a module that moves between versions)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes a token stands for."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    decoder = _byte_decoder()
    if piece and all(c in decoder for c in piece):  # byte-level BPE (GPT-2, Qwen, Llama 3)
        return bytes(decoder[c] for c in piece)
    if m := _BYTE_TOKEN.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker


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
