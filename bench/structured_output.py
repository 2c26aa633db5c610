"""What constraining decoding costs: free text vs `json_object` vs a strict JSON schema,
the speculative engine and the target-only engine side by side, in one process.

    .venv/bin/python bench/structured_output.py [--new-tokens 64] [--reps 2] [--quick]

The default pair and engine (the target from its GGUF, the int4 draft), greedy, one
request at a time (chat-templated prompts asking for JSON). Per mode: decode tokens/s,
tokens emitted per target step, and the share of the step spent computing grammar
masks. `structured_cost_ratio_*`: tokens/s constrained over free, per engine.

Writes bench/results/structured_output.json and .png. Not a test: figures depend on the
machine; every ratio is from this one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

# Run as a script, this folder is first on the module path: the sibling benches' parts.
import serving as serving_bench  # bench/serving.py: the CPU's name
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding import grammar as grammar_mod
from slimspec.decoding.grammar import json_schema_grammar
from slimspec.decoding.types import GenerationRequest, SamplingParams
from slimspec.server import baseline as baseline_mod
from slimspec.server.baseline import TargetOnlyEngine
from slimspec.weights.registry import DEFAULT_PAIR

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

PROMPTS = [
    "Describe a fictional person as JSON with their name, age, city and three hobbies.",
    "Give a JSON record for a book: title, author, year, and a list of genres.",
    "Return a JSON object describing a weather report for two cities.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


class MaskClock:
    """Seconds spent computing grammar masks (wraps grammar.allowed_tokens)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = grammar_mod.allowed_tokens

    def __enter__(self) -> MaskClock:
        def timed(matcher: Any, n_vocab: int) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return self._inner(matcher, n_vocab)
            finally:
                self.seconds += time.perf_counter() - t0

        grammar_mod.allowed_tokens = timed  # type: ignore[assignment]
        baseline_mod.allowed_tokens = timed  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        grammar_mod.allowed_tokens = self._inner  # type: ignore[assignment]
        baseline_mod.allowed_tokens = self._inner  # type: ignore[assignment]


def run(engine: Any, prompts: list[list[int]], grammar: str | None, n_new: int) -> dict[str, Any]:
    """Each prompt alone; tokens/s over the decode (prefill excluded by timing the
    steps after the first token)."""
    tokens = 0
    seconds = mask_s = 0.0
    steps = 0
    with MaskClock() as masks:
        for i, ids in enumerate(prompts):
            req = GenerationRequest(
                f"b{i}", ids, n_new, SamplingParams(), frozenset(), None, grammar
            )
            engine.add_request(req)
            first_at = None
            n = 0
            mask_before = 0.0
            while engine.has_work():
                outs = engine.step()
                now = time.perf_counter()
                for o in outs:
                    if o.new_token_ids and first_at is None:
                        first_at = now
                        mask_before += masks.seconds
                        continue  # the first token ends the prefill
                    n += len(o.new_token_ids)
                    steps += 1
            assert first_at is not None
            tokens += n
            seconds += time.perf_counter() - first_at
            mask_s += masks.seconds - mask_before
            masks.seconds = 0.0
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_step": tokens / max(steps, 1),
        "mask_share": mask_s / seconds,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 tokens, 1 rep, 1 prompt")
    args = ap.parse_args(argv)
    n_new, reps, prompts_text = args.new_tokens, args.reps, PROMPTS
    if args.quick:
        n_new, reps, prompts_text = 16, 1, PROMPTS[:1]
    pair = DEFAULT_PAIR
    dec = SpeculativeDecoder.from_pretrained(target=pair.target, draft=pair.draft)
    tok = dec.tokenizer
    print(f"CPU: {serving_bench.cpu_name()}; target {dec.target_form.describe()}", flush=True)
    dec.warmup()
    base = TargetOnlyEngine(dec.target, tok, target_form=dec.target_form)
    prompts = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for p in prompts_text
    ]
    modes = {
        "free": None,
        "json_object": json_schema_grammar({"type": "object"}),
        "json_schema": json_schema_grammar(SCHEMA),
    }
    for g in modes.values():  # compiled against the tokenizer first, as the server does
        if g is not None:
            dec.check_grammar(g)
            base.check_grammar(g)
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {
        e: {m: [] for m in modes} for e in ("slimspec", "target_only")
    }
    for rep in range(reps):
        for mode, g in modes.items():  # alternated, so drift hits every mode alike
            for name, eng in (("slimspec", dec), ("target_only", base)):
                r = run(eng, prompts, g, n_new)
                rows[name][mode].append(r)
                print(
                    f"rep {rep} {name:11s} {mode:11s} {r['tokens_per_s']:.2f} tok/s "
                    f"{r['tokens_per_step']:.2f} tok/step mask {r['mask_share']:.1%}",
                    flush=True,
                )
    summary: dict[str, Any] = {}
    for name in rows:
        for mode in modes:
            runs = rows[name][mode]
            summary[f"{name}_{mode}_tokens_per_s"] = statistics.median(
                r["tokens_per_s"] for r in runs
            )
            summary[f"{name}_{mode}_tokens_per_step"] = statistics.median(
                r["tokens_per_step"] for r in runs
            )
            summary[f"{name}_{mode}_mask_share"] = statistics.median(r["mask_share"] for r in runs)
        for mode in ("json_object", "json_schema"):
            summary[f"structured_cost_ratio_{name}_{mode}"] = (
                summary[f"{name}_{mode}_tokens_per_s"] / summary[f"{name}_free_tokens_per_s"]
            )
    for mode in modes:
        summary[f"speedup_vs_target_only_{mode}"] = (
            summary[f"slimspec_{mode}_tokens_per_s"] / summary[f"target_only_{mode}_tokens_per_s"]
        )
    out = {
        "cpu": serving_bench.cpu_name(),
        "threads": torch.get_num_threads(),
        "target_form": dec.target_form.describe(),
        "new_tokens": n_new,
        "reps": reps,
        "prompts": len(prompts),
        **summary,
        "runs": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured_output.json").write_text(json.dumps(out, indent=2))
    plot(summary, RESULTS / "structured_output.png")
    print(json.dumps(summary, indent=2))
    return 0


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["free", "json_object", "json_schema"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, name in enumerate(("slimspec", "target_only")):
        vals = [summary[f"{name}_{m}_tokens_per_s"] for m in modes]
        ax.bar([x + i * width for x in range(len(modes))], vals, width, label=name)
    ax.set_xticks([x + width / 2 for x in range(len(modes))], modes)
    ax.set_ylabel("decode tokens/s (greedy, one request)")
    ax.set_title("What constraining costs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
