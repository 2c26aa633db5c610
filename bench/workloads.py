"""Request mixes for the serving benchmark: what users send, not eight short prompts.

- `short`: the eight prompts of 3-15 tokens `serving.py` has always sent to /infer
  (flatters batching: prefill is nothing and every row decodes at once);
- `code`: /v1/completions on Python source of 250 to 1,000 tokens (lengths cycled),
  each request a different place of a different standard-library file, so no two share
  a prefix beyond a few tokens (repeated prompts are the prefix cache's benchmark);
- `chat`: /v1/chat/completions, a system prompt and a user turn holding an English
  passage of 250 to 1,000 tokens with a question about it (the system prompt is the
  one prefix requests share, as in a real chat service).

Every request asks for `max_new` tokens at temperature 0. The texts are cut by the
target's tokenizer, so a "500-token" prompt is 500 of its tokens plus the template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SHORT_PROMPTS = [
    "def fibonacci(n):",
    "Write a Python function that checks whether a string is a palindrome.",
    "import json\n\ndef load_config(path):",
    "class Stack:\n    def __init__(self):",
    "Explain what a hash map is in one sentence.",
    "def quicksort(items):",
    "# Read a CSV file and print the sum of the second column\n",
    "Hello, world!",
]
WORKLOADS = ("short", "code", "chat")
LENGTHS = (250, 500, 1000)  # prompt tokens, cycled
N_REQUESTS = 24  # distinct requests per mix; clients cycle through them
CHAT_SYSTEM = "You are a helpful assistant. Answer in plain prose."
CHAT_QUESTIONS = (
    "Summarise the passage above in a few sentences.",
    "Who are the people in the passage above, and what do they do?",
    "What is the main point of the passage above?",
)


@dataclass(frozen=True)
class Request:
    path: str  # endpoint
    body: dict[str, Any]
    prompt_tokens: int  # the text's tokens, before any chat template


def short_requests(max_new: int) -> list[Request]:
    return [Request("/infer", {"input": p, "max_length": max_new}, 0) for p in SHORT_PROMPTS]


def _pieces(texts: list[str], tok: Any, n: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """n token slices of the given lengths (cycled), each from another text and, when
    the texts run out, from further into them: no two slices overlap."""
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    out: list[list[int]] = []
    offsets = [0] * len(ids)
    i = 0
    while len(out) < n:
        want = lengths[len(out) % len(lengths)]
        j = i % len(ids)
        i += 1
        if offsets[j] + want <= len(ids[j]):
            out.append(ids[j][offsets[j] : offsets[j] + want])
            offsets[j] += want
        elif i > 50 * n:
            raise ValueError(f"not enough text for {n} prompts of up to {max(lengths)} tokens")
    return out


def code_requests(tok: Any, max_new: int, n: int = N_REQUESTS) -> list[Request]:
    from slimspec.draft_head.artifact import stdlib_py_files

    texts = []
    for f in sorted(stdlib_py_files(), key=lambda p: str(p)):
        text = f.read_text(errors="replace")
        start = text.find("\ndef ")  # code, not the licence header
        if start >= 0 and len(text) - start > 20_000:
            texts.append(text[start + 1 :])
        if len(texts) == n:
            break
    out = []
    for ids in _pieces(texts, tok, n, LENGTHS):
        prompt = tok.decode(ids)
        body = {"prompt": prompt, "max_tokens": max_new, "temperature": 0}
        out.append(Request("/v1/completions", body, len(ids)))
    return out


def chat_requests(tok: Any, max_new: int, n: int = N_REQUESTS) -> list[Request]:
    import decode as decode_bench  # bench/decode.py: the English corpus

    lines = decode_bench.kjv_lines()
    if not lines:
        raise SystemExit("the English corpus (bench/decode.py kjv_lines) is not available")
    chunk = len(lines) // n
    texts = [" ".join(lines[i * chunk : (i + 1) * chunk]) for i in range(n)]
    out = []
    for i, ids in enumerate(_pieces(texts, tok, n, LENGTHS)):
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        messages = [
            {"role": "system", "content": CHAT_SYSTEM},
            {"role": "user", "content": f"{tok.decode(ids)}\n\n{question}"},
        ]
        body = {"messages": messages, "max_tokens": max_new, "temperature": 0}
        out.append(Request("/v1/chat/completions", body, len(ids)))
    return out


def requests_for(workload: str, tok: Any, max_new: int) -> list[Request]:
    if workload == "short":
        return short_requests(max_new)
    if workload == "code":
        return code_requests(tok, max_new)
    if workload == "chat":
        return chat_requests(tok, max_new)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
