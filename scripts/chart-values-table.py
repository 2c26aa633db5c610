"""Writes the values table of charts/slimspec/README.md from the chart's own files:
every leaf of values.schema.json is a row, with its type (the schema), its default
(values.yaml) and its description (the comment right above the key in values.yaml).

    python scripts/chart-values-table.py          rewrite the table in the README
    python scripts/chart-values-table.py --check  exit 1 if the README's table differs

tests/chart/test_readme.py runs the check, so the table cannot drift from the values.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "slimspec"
README = CHART / "README.md"
START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):")
LONG_DEFAULT = 60  # longer defaults: "see values.yaml"


def comments(values_text: str) -> dict[str, str]:
    """Dotted key path -> the comment block right above that key (blank lines cut it)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in values_text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip().removeprefix("-- "))
            continue
        match = KEY_LINE.match(line)
        if match is None:  # a list item or a continuation line
            pending = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        out[".".join(key for _, key in stack)] = " ".join(pending)
        pending = []
    return out


def leaves(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    props = schema.get("properties")
    if not props:
        return [(path, schema)]
    out: list[tuple[str, dict[str, Any]]] = []
    for key, sub in props.items():
        out += leaves(sub, f"{path}.{key}" if path else key)
    return out


def lookup(values: Any, path: str) -> tuple[bool, Any]:
    for key in path.split("."):
        if not isinstance(values, dict) or key not in values:
            return False, None
        values = values[key]
    return True, values


def schema_type(schema: dict[str, Any]) -> str:
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def rows() -> list[tuple[str, str, str, str]]:
    values_text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(values_text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    described = comments(values_text)
    out = []
    for path, sub in leaves(schema):
        present, default = lookup(values, path)
        if not present:
            continue  # schema-only keys (e.g. Helm's `global`)
        text = json.dumps(default)
        shown = f"`{text}`" if len(text) <= LONG_DEFAULT else "see values.yaml"
        desc = described.get(path) or sub.get("description", "")
        out.append((path, schema_type(sub), shown, desc.replace("|", "\\|")))
    return out


def table() -> str:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | {d} | {desc} |" for k, t, d, desc in rows()]
    return "\n".join(lines)


def render(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    current = README.read_text()
    wanted = render(current)
    if argv[1:] == ["--check"]:
        if current != wanted:
            print(f"{README}: values table out of date: run python {argv[0]}", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
