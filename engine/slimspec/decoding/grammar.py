"""Constrained decoding (structured output) with llguidance, exact under speculation.

A constrained request carries a grammar (llguidance's serialised form, made from a JSON
schema, a regex or Lark). Its row keeps an llguidance matcher at the state after its
output. In a step the matcher walks along the row's drafts: at each depth it gives the
tokens the grammar allows next, which mask the draft's scores (so it proposes tokens
the target can accept) and then the target's logits at every verified position. The
target's decisions (greedy, coupled or rejection sampling) are made on the masked
logits, so the output follows the constrained target distribution exactly: a draft the
grammar refuses has probability 0 and is rejected like any other, and masking the
draft changes only what it proposes, never the verification (its q stays what it
sampled from). After the step the matcher rolls back the drafts and takes the emitted
tokens. llguidance is the grammar engine vLLM and SGLang use: masks in microseconds
per token, rollback for speculation, and no dependencies.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
_TOKENIZERS: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()  # built once even when two threads ask at once


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: bytes that are printable Latin-1 spell
    themselves, the other 68 are spelled with the characters from U+0100 on, in byte
    order (the table every byte-level BPE tokenizer uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


_BYTES = _byte_decoder()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw bytes a token stands for."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return b""
    if piece and all(c in _BYTES for c in piece):  # byte-level BPE (GPT-2, Qwen, Llama 3)
        return bytes(_BYTES[c] for c in piece)
    if m := _BYTE_TOKEN.fullmatch(piece):
        return bytes([int(m.group(1), 16)])
    return str(piece).replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker


class _TokenList:
    """llguidance's generic tokenizer interface, for tokenizers its Hugging Face reader
    does not know (it reads byte-level BPE and SentencePiece tokenizer.json files)."""

    def __init__(self, tokenizer: Any, n_vocab: int) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        known = len(tokenizer)
        self.tokens = [token_bytes(tokenizer, i) if i < known else b"" for i in range(n_vocab)]
        # special tokens and the model's spare ids are never text
        self.special_token_ids = sorted({*tokenizer.all_special_ids, *range(known, n_vocab)})
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        s = text if isinstance(text, str) else text.decode("utf-8", "replace")
        return list(self._tokenizer.encode(s, add_special_tokens=False))


def ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """llguidance's view of the tokenizer, over the model's n_vocab ids (built once per
    tokenizer: about a second for a 150k vocabulary)."""
    import llguidance
    import llguidance.hf

    with _TOKENIZERS_LOCK:
        per_vocab = _TOKENIZERS.setdefault(tokenizer, {})
        if n_vocab not in per_vocab:
            try:
                per_vocab[n_vocab] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)
            except ValueError:
                wrapper = llguidance.TokenizerWrapper(_TokenList(tokenizer, n_vocab))
                per_vocab[n_vocab] = llguidance.LLTokenizer(wrapper)
        return per_vocab[n_vocab]


def json_schema_grammar(schema: dict[str, Any] | str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_json_schema(schema))


def regex_grammar(regex: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_regex(regex))


def lark_grammar(lark: str) -> str:
    """llguidance's Lark dialect (JSON schemas inline with `%json {...}`)."""
    import llguidance

    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def grammar_error(grammar: str) -> str:
    """Why a grammar cannot be used ("" when it can)."""
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(grammar))


def new_matcher(grammar: str, tokenizer: Any, n_vocab: int) -> Any:
    """A matcher at the grammar's start; ValueError for a grammar that does not compile."""
    import llguidance

    if tokenizer is None:
        raise ValueError("a grammar needs the engine's tokenizer")
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer, n_vocab), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"grammar does not compile: {matcher.get_error()}")
    return matcher


def allowed_tokens(matcher: Any, n_vocab: int) -> torch.Tensor:
    """(n_vocab,) bool: what the grammar allows next (everything, for a matcher in an
    error state: a broken matcher must not turn the row's logits into NaN)."""
    import llguidance.torch as llt
    import numpy as np

    bits = llt.allocate_token_bitmask(1, n_vocab)
    llt.fill_next_token_bitmask(matcher, bits, 0)
    # bit t % 32 of int32 word t // 32, little-endian: numpy unpacks it in 0.2 ms (the
    # same in torch ops takes 20 ms for a 150k vocabulary)
    flat = np.unpackbits(bits[0].numpy().view(np.uint8), bitorder="little")
    allowed = torch.from_numpy(flat[:n_vocab].astype(bool))
    if not allowed.any():
        log.warning("grammar allows nothing (%s): row left unconstrained", matcher.get_error())
        return torch.ones(n_vocab, dtype=torch.bool)
    return allowed


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits where the grammar refuses a token: -inf (same shape)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


class StepGrammar:
    """The constrained rows of one step: masks along their drafts, then the update.

    matchers[i] is row i's matcher (None: unconstrained). masks[j] (B, V) is what each
    row may emit at depth j, given the drafts before it."""

    def __init__(self, matchers: Sequence[Any | None], vocab: int) -> None:
        self.matchers = list(matchers)
        self.vocab = vocab
        self.consumed = [0] * len(self.matchers)  # drafts each matcher walked along
        self.on_path = [True] * len(self.matchers)  # every draft so far was allowed
        self.masks: list[torch.Tensor] = []

    def _mask_now(self) -> torch.Tensor:
        allowed = torch.ones(len(self.matchers), self.vocab, dtype=torch.bool)
        for i, m in enumerate(self.matchers):
            if m is not None:
                allowed[i] = allowed_tokens(m, self.vocab)
        self.masks.append(allowed)
        return allowed

    def draft_logits(self, logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The draft's scores over its subset token_ids at this depth, with what the
        grammar refuses at -inf (rows where it allows none of the subset: unmasked, the
        target refuses their draft)."""
        allowed = self._mask_now()[:, token_ids.cpu()].to(logits.device)
        usable = allowed.any(dim=1, keepdim=True)
        return logits.masked_fill(~allowed & usable, float("-inf"))

    def take_drafts(self, tokens: torch.Tensor) -> None:
        """Walk each matcher along this depth's drafts (B,) while they are allowed."""
        for i, t in enumerate(tokens.tolist()):
            m = self.matchers[i]
            if m is not None and self.on_path[i]:
                if m.try_consume_tokens([int(t)]) == 1:
                    self.consumed[i] += 1
                else:
                    self.on_path[i] = False

    def target_masks(self, width: int) -> torch.Tensor:
        """(B, width, V) the masks of the verified positions 0..width-1 (positions after a
        refused draft get the last reachable state's mask: they are never accepted)."""
        while len(self.masks) < width:
            self._mask_now()
        return torch.stack(self.masks[:width], dim=1)

    def finish(self, emitted: Sequence[Sequence[int]]) -> None:
        """Back to the state before the drafts, then along what each row emitted."""
        for i, m in enumerate(self.matchers):
            if m is None:
                continue
            m.rollback(self.consumed[i])
            for t in emitted[i]:
                if m.is_stopped():  # the grammar is complete: what follows is the row's end
                    break
                if not m.consume_token(int(t)):
                    log.warning("grammar refused an emitted token: %s", m.get_error())
                    break


class GrammarRows:
    """Each constrained request's matcher, by request id (created on its first step)."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.tokenizer = tokenizer
        self.vocab = vocab
        self._matchers: dict[str, Any] = {}

    def check(self, grammar: str | None) -> None:
        """ValueError for a grammar this engine cannot follow; compiles it against the
        tokenizer (its first mask: seconds for the first JSON grammar of a large
        vocabulary, cached after that)."""
        if grammar is not None:
            allowed_tokens(new_matcher(grammar, self.tokenizer, self.vocab), self.vocab)

    def step(
        self, request_ids: Sequence[str], grammars: Sequence[str | None]
    ) -> StepGrammar | None:
        """This step's constraint of the batch's rows (None: no row is constrained);
        matchers of requests no longer in the batch are dropped."""
        live = set(request_ids)
        for rid in [r for r in self._matchers if r not in live]:
            del self._matchers[rid]
        if all(g is None for g in grammars):
            return None
        matchers = []
        for rid, g in zip(request_ids, grammars, strict=True):
            if g is not None and rid not in self._matchers:
                self._matchers[rid] = new_matcher(g, self.tokenizer, self.vocab)
            matchers.append(self._matchers.get(rid) if g is not None else None)
        return StepGrammar(matchers, self.vocab)
