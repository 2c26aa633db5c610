"""How fast speculative decoding of the default pair can get on this machine, from its
measured acceptance and step costs, against llama.cpp on the same GGUF files.

    .venv/bin/python bench/decode_ceiling.py [--quick] [--prompts 3] [--tokens 64]
                                             [--max-k 5] [--threads 2] [--draft-context N]

Decode speed is tokens per step over seconds per step. With the draft model drafting k
tokens, a step yields E(k) = 1 + a_1 + ... + a_k tokens on average (a_i: the share of
steps whose first i draft tokens were all accepted, measured) and costs k draft
forwards plus one verification of k + 1 rows (measured). However cheap the draft got,
a step would still cost its verification, so E(k) / verify(k + 1) bounds what any
draft kernel could reach at this acceptance (`free_draft_ceiling_tok_s`); nothing but a
draft the target agrees with more often lifts it. The draft's prompt window
(`--draft-context`, default the engine's) is part of that: a draft that sees only the
last tokens of a code prompt misses the names defined above them.

One run, single stream, greedy, lookup drafts off (they are model-free and their gain
depends on the text repeating itself), the target in its GGUF form (the default), the
draft as the engine serves it by default, fixed k = 1 .. --max-k, alternated prompt by
prompt with SlimSpec's target-only decode, the engine's default (adaptive k, lookup
drafts on) and llama.cpp's target-only and speculative decode (llama-server, as
bench/peers.py drives it). Code and English prompts of 250 tokens. Writes
bench/results/decode_ceiling.json and .png. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import decode as decode_bench  # bench/decode.py: prompts and timing loops
import peers  # bench/peers.py: llama-server driven the same way
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import target_form
from slimspec.weights.loading import load_causal_lm

RESULTS = peers.RESULTS
AIM_DECODE = 2.5  # issue 24's decode aim: x llama.cpp's best configuration


def spec_run(dec: SpeculativeDecoder, ids: list[int], n: int, k: int | None, lookup: int) -> dict:
    """One prompt at fixed k (None: adaptive), with its step accounting."""
    dec.set_num_draft_tokens(k)
    dec.set_lookup_tokens(lookup)
    r = decode_bench.slimspec(dec, [ids], n)
    s = dec.stats
    return {
        "tokens": n,
        "decode_s": n / r["decode_tok_s"],
        "e2e_s": n / r["e2e_tok_s"],
        "steps": s.target_forwards,
        "draft_s": s.draft_time_s,
        "draft_forwards": s.draft_forwards,
        "verify_s": s.target_time_s,
        "accepted_per_position": list(s.accepted_per_position),
        "drafted_per_position": list(s.drafted_per_position),
        "output": r["outputs"][0],
    }


def fixed_k_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Totals of one k over the prompts: tokens per step, the step's parts, the ceiling."""
    tokens = sum(r["tokens"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    verify_ms = 1000 * sum(r["verify_s"] for r in rows) / steps
    tokens_per_step = tokens / steps
    return {
        "decode_tok_s": tokens / sum(r["decode_s"] for r in rows),
        "tokens_per_step": tokens_per_step,
        "verify_ms_per_step": verify_ms,
        "draft_ms_per_forward": 1000
        * sum(r["draft_s"] for r in rows)
        / max(1, sum(r["draft_forwards"] for r in rows)),
        "free_draft_ceiling_tok_s": 1000 * tokens_per_step / verify_ms,
    }


def acceptance(rows: list[dict[str, Any]]) -> list[float]:
    """a_i over the prompts: the share of steps whose first i drafts were all kept."""
    kept: list[int] = []
    drafted: list[int] = []
    for r in rows:
        for acc, new in ((kept, r["accepted_per_position"]), (drafted, r["drafted_per_position"])):
            acc.extend([0] * (len(new) - len(acc)))
            for i, c in enumerate(new):
                acc[i] += c
    return [a / d if d else 0.0 for a, d in zip(kept, drafted, strict=False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    peers.common_args(p, prompts=3)
    p.add_argument("--max-k", type=int, default=5)
    p.add_argument(
        "--draft-context",
        type=int,
        default=None,
        help="the draft's prompt window (0: whole prompts; default: the engine's)",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "decode_ceiling.json")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompts, args.max_k = 8, 1, 2
    torch.set_num_threads(args.threads)
    target_dir, draft_dir, target_gguf, draft_gguf, binary = peers.pair_files()

    model, tok = load_causal_lm(target_dir, dtype="bfloat16")
    form = target_form.apply(model, "gguf", target_dir).describe()
    draft = load_causal_lm(draft_dir, dtype="bfloat16")[0]
    dec = SpeculativeDecoder.from_models(model, draft, tok, draft_context=args.draft_context)
    lookup = dec.lookup_tokens  # the engine's default, for its default configuration
    domains = {
        "code": decode_bench.code_prompts(tok, args.prompts, args.prompt_tokens),
        "english": decode_bench.english_prompts(tok, args.prompts, args.prompt_tokens),
    }
    ctx = args.prompt_tokens + args.tokens + 64
    llama = peers.LlamaServer(binary, target_gguf, args.threads, ctx, "-np", "1")
    llama_spec = peers.LlamaServer(
        binary, target_gguf, args.threads, ctx, "-np", "1", "-md", str(draft_gguf)
    )
    n = args.tokens
    ks = list(range(1, args.max_k + 1))
    configs: dict[str, Any] = {
        "llamacpp_target_only": lambda ids: peers.llama_single(llama, ids, n),
        "llamacpp_speculative": lambda ids: peers.llama_single(llama_spec, ids, n),
        "slimspec_target_only": lambda ids: peers.slimspec_target_only(model, ids, n),
        "slimspec_default": lambda ids: spec_run(dec, ids, n, None, lookup),
        **{f"k{k}": (lambda ids, k=k: spec_run(dec, ids, n, k, 0)) for k in ks},
    }
    for run in configs.values():  # warm-up: kernels built, weights faulted in
        run(domains["code"][0][:32])
    dec.rerank_now(timeout=120, freeze=True)  # no background re-rank inside a timed run
    dec.set_prefix_cache_on(False)  # every run prefills its prompt, as llama-server's

    result: dict[str, Any] = {
        "machine": peers.machine(args.threads),
        "settings": {
            "tokens": n,
            "prompt_tokens": args.prompt_tokens,
            "prompts_per_domain": args.prompts,
            "target": form,
            "draft_quantization": dec.draft_quantization,
            "compression_ratio": dec.compression_ratio,
            "draft_context": dec.draft_context,
            "default_lookup_tokens": lookup,
        },
        "domains": {},
    }
    for domain, prompts in domains.items():
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
        for i, ids in enumerate(prompts):
            order = list(configs) if i % 2 == 0 else list(reversed(configs))  # alternate
            for name in order:
                rows[name].append(configs[name](ids))
            want = rows["slimspec_target_only"][-1]["output"]
            same = all(rows[name][-1].get("output", want) == want for name in configs)
            assert same, f"{domain} prompt {i}: a speculative text differs from the target's"
            for name in configs:
                rows[name][-1].pop("output", None)
            print(f"{domain} prompt {i} done", flush=True)
        per_k = {k: fixed_k_summary(rows[f"k{k}"]) for k in ks}
        plain = {name: peers.summarise(rows[name]) for name in list(configs)[:4]}
        llama_best = max(plain["llamacpp_target_only"]["decode_tok_s"],
                         plain["llamacpp_speculative"]["decode_tok_s"])  # fmt: skip
        best_k = max(ks, key=lambda k: per_k[k]["decode_tok_s"])
        ceiling_k = max(ks, key=lambda k: per_k[k]["free_draft_ceiling_tok_s"])
        ceiling = per_k[ceiling_k]["free_draft_ceiling_tok_s"]
        result["domains"][domain] = {
            "acceptance_by_position": acceptance(rows[f"k{args.max_k}"]),
            "fixed_k": {str(k): v for k, v in per_k.items()},
            "configurations": plain,
            "llamacpp_best_decode_tok_s": llama_best,
            "best_fixed_k": best_k,
            "best_fixed_k_vs_llamacpp_best": per_k[best_k]["decode_tok_s"] / llama_best,
            "default_vs_llamacpp_best": plain["slimspec_default"]["decode_tok_s"] / llama_best,
            "free_draft_ceiling_tok_s": ceiling,
            "free_draft_ceiling_k": ceiling_k,
            "free_draft_ceiling_vs_llamacpp_best": ceiling / llama_best,
            "aim_decode_tok_s": AIM_DECODE * llama_best,
        }
        print(json.dumps({domain: result["domains"][domain]}, indent=1), flush=True)
    llama.stop()
    llama_spec.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = result["domains"]
    fig, axes = plt.subplots(1, len(domains), figsize=(6 * len(domains), 5.2), squeeze=False)
    for ax, (domain, d) in zip(axes[0], domains.items(), strict=False):
        ks = list(d["fixed_k"])
        x = range(len(ks))
        measured = [d["fixed_k"][k]["decode_tok_s"] for k in ks]
        ceiling = [d["fixed_k"][k]["free_draft_ceiling_tok_s"] for k in ks]
        ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured (this draft)")
        ax.bar([i + 0.2 for i in x], ceiling, 0.4, label="free draft (verification only)")
        ax.set_xticks(list(x), [f"k={k}" for k in ks])
        conf = d["configurations"]
        lines = (
            (d["aim_decode_tok_s"], "r", f"aim: {AIM_DECODE:g}x llama.cpp's best"),
            (d["llamacpp_best_decode_tok_s"], "k", "llama.cpp's best"),
            (conf["slimspec_target_only"]["decode_tok_s"], "g", "SlimSpec target-only"),
            (conf["slimspec_default"]["decode_tok_s"], "m", "SlimSpec default (lookup on)"),
        )
        for y, color, label in lines:
            ax.axhline(y, color=color, linestyle="--", linewidth=1, label=label)
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{domain}: acceptance " + " ".join(
            f"{a:.2f}" for a in d["acceptance_by_position"]))  # fmt: skip
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    window = result["settings"]["draft_context"] or "whole prompts"
    fig.suptitle(f"{result['machine']['cpu']}; the draft's prompt window: {window}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
