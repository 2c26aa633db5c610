"""Calibration corpora (draft_head/corpus.py): the mixed default and the held-out texts."""

from __future__ import annotations

from slimspec.draft_head.corpus import heldout_texts, interleaved_ids, mixed_texts


class CharTokenizer:
    """One token per character; a chat template like the real ones render."""

    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 1000 for c in text]}

    def apply_chat_template(self, msgs: list[dict[str, str]], tokenize: bool = False) -> str:
        return "".join(f"<|{m['role']}|>{m['content']}" for m in msgs)


def test_mixed_corpus_has_code_prose_and_chat_and_leaves_the_heldout_out():
    texts = mixed_texts(CharTokenizer(), 60_000)
    assert {"python", "prose", "chat"} <= set(texts)  # always there (stdlib, docstrings)
    assert all(0 < len(t) <= 60_000 // 6 for t in texts.values())
    assert "<|user|>Write this in Python:" in texts["chat"]
    assert "<|assistant|>```python" in texts["chat"]
    held = heldout_texts(5_000)
    for name, text in held.items():
        assert text[:200] not in "".join(texts.values()), name


def test_interleaved_ids_sample_every_source_in_any_prefix():
    ids = interleaved_ids(CharTokenizer(), {"a": "a" * 10, "b": "b" * 10}, chunk=4)
    assert ids[:8] == [ord("a")] * 4 + [ord("b")] * 4
    assert len(ids) == 20
