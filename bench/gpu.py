"""GPU benchmark: decode comparison and the draft-head micro-benchmark, one command.

    .venv/bin/python bench/gpu.py                 # on a machine with one CUDA GPU (< 8 min)
    .venv/bin/python bench/gpu.py --dry-run       # CPU, tiny shapes and tiny models (~1 min)

1. Draft-head micro-benchmark at real shapes: a 4096 x 128256 bf16 head (a Llama-3-8B
   sized LM head; random weights, which is fine for timing) scoring 1, 8 and 32 hidden
   states at ratio 0 (all rows) and at ratios 0.5, 0.8 and 0.95 (a prefix of the ranked
   rows, as the engine slices it), timed with CUDA events.
2. Decode comparison, bf16, greedy: target-only, Hugging Face assisted generation, and
   SlimSpec at several ratios, on code prompts from the standard library, with the
   engine's per-ratio predictions beside the measured tokens/s. With real weights
   (`--models real`, the default: the registry's default pair, which must be in the
   model cache, since a GPU machine here reaches no hub) the acceptance is real; with
   `--models random` (the same shapes, random weights) only the step costs mean
   anything, since a random draft agrees with a random target by chance only.
Writes bench/results/gpu.json (and gpu.png). Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
HEAD_RATIOS = (0.0, 0.5, 0.8, 0.95)
DECODE_RATIOS = (0.0, 0.5, 0.8, 0.95)
HEAD_ROWS = (1, 8, 32)


# ---------------------------------------------------------------- timing
def timer(device: torch.device):
    """A function that runs fn `iters` times and returns seconds per call."""

    def run(fn, iters: int) -> float:
        fn()  # warm-up (kernel selection, allocations)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1000 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    return run


# ---------------------------------------------------------------- 1. head micro-benchmark
def head_microbench(
    hidden: int, vocab: int, device: torch.device, iters: int, log: Any
) -> dict[str, Any]:
    from slimspec.draft_head.head import DraftHead, HeadConfig, subset_size_for_ratio

    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, torch.bfloat16)
    head = DraftHead(weight, torch.randperm(vocab, generator=g).to(device))
    run = timer(device)
    out: dict[str, Any] = {"shape": [hidden, vocab], "dtype": "bfloat16", "by_rows": {}}
    for rows in HEAD_ROWS:
        h = torch.randn(rows, hidden, generator=g).to(device, torch.bfloat16)
        per: dict[str, float] = {}
        for r in HEAD_RATIOS:
            cfg = HeadConfig(subset_size_for_ratio(r, vocab) if r > 0 else vocab, None)
            with torch.inference_mode():
                per[repr(r)] = run(lambda c=cfg, x=h: head.logits(x, c), iters)
        gain = {k: per["0.0"] / v for k, v in per.items()}
        out["by_rows"][str(rows)] = {"seconds": per, "speedup_vs_ratio_0": gain}
        log(f"head {hidden}x{vocab}, {rows} rows: " + ", ".join(
            f"r{k} {1e6 * v:.0f} us ({gain[k]:.2f}x)" for k, v in per.items()
        ))  # fmt: skip
    return out


# ---------------------------------------------------------------- 2. decode comparison
def tiny_pair(device: torch.device) -> tuple[Any, Any, None]:
    """A tiny Llama target and a noisy copy as draft (the dry run's models)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.std().clamp_min(1e-3))
    return target.to(device), draft.to(device), None


def real_pair(device: torch.device, random_weights: bool) -> tuple[Any, Any, Any]:
    from slimspec.weights.loading import load_causal_lm, resolve_model_path
    from slimspec.weights.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    if not random_weights:
        target, tok = load_causal_lm(DEFAULT_TARGET, dtype="bfloat16", device=device)
        draft, _ = load_causal_lm(DEFAULT_DRAFT, dtype="bfloat16", device=device)
        return target, draft, tok
    from transformers import AutoConfig, AutoModelForCausalLM

    models = []
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        cfg = AutoConfig.from_pretrained(resolve_model_path(name))
        models.append(AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device))
    return models[0].eval(), models[1].eval(), None


def code_prompts(tok: Any, n: int, tokens: int, vocab: int) -> list[list[int]]:
    from slimspec.draft_head.artifact import stdlib_text

    if tok is None:  # tiny or random models: token ids of a fixed pseudo-random text
        g = torch.Generator().manual_seed(1)
        return [torch.randint(3, vocab, (tokens,), generator=g).tolist() for _ in range(n)]
    text = stdlib_text(200_000, stride=11)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return [ids[i * 4 * tokens : i * 4 * tokens + tokens] for i in range(n)]


@torch.inference_mode()
def target_only(model: Any, prompts: list[list[int]], n: int, device: torch.device) -> float:
    from transformers import DynamicCache

    total = 0.0
    for ids in prompts:
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([ids], device=device), past_key_values=cache).logits[:, -1]
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            tok = logits.argmax(dim=-1, keepdim=True)
            logits = model(tok, past_key_values=cache).logits[:, -1]
        sync(device)
        total += time.perf_counter() - t0
    return (n - 1) * len(prompts) / total


@torch.inference_mode()
def hf_assisted(target: Any, draft: Any, prompts: list[list[int]], n: int, device) -> float:
    total = 0.0
    for ids in prompts:
        inp = torch.tensor([ids], device=device)
        sync(device)
        t0 = time.perf_counter()
        target.generate(
            inp, attention_mask=torch.ones_like(inp), assistant_model=draft, do_sample=False,
            max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
        )  # fmt: skip
        sync(device)
        total += time.perf_counter() - t0
    return n * len(prompts) / total


def slimspec_runs(target, draft, tok, prompts, n, device, log) -> dict[str, Any]:
    from slimspec import SpeculativeDecoder

    dec = SpeculativeDecoder.from_models(target, draft, tok, draft_quantization=None)
    dec.warmup()
    out: dict[str, Any] = {}
    for r in DECODE_RATIOS:
        dec.set_compression_ratio(r)
        dec.stats = type(dec.stats)()
        t0 = time.perf_counter()
        for ids in prompts:
            dec.generate(ids, n, stop_token_ids=[])
        total = time.perf_counter() - t0
        s = dec.stats
        out[repr(r)] = {
            "decode_tok_s": n * len(prompts) / max(1e-9, total - s.prefill_time_s),
            "e2e_tok_s": n * len(prompts) / total,
            "mean_accepted_length": s.mean_accepted_length,
            "draft_step_ms": 1000 * s.draft_time_s / max(1, s.draft_forwards),
            "verify_step_ms": 1000 * s.target_time_s / max(1, s.target_forwards),
        }
        log(f"slimspec r{r}: {out[repr(r)]}")
    rep = dec.ratio_report
    if rep is not None:
        out["predicted"] = {
            repr(r): {"speedup": p.speedup, "head_share": p.head_share, "k": p.k}
            for r, p in rep.points.items()
        }
        out["assessment"] = {
            "best": rep.assessment.best,
            "can_help": rep.assessment.can_help,
            "reason": rep.assessment.reason,
        }
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, tiny models")
    ap.add_argument("--models", choices=["real", "random"], default="real")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.dry_run:
        device = torch.device("cpu")
        hidden, vocab, iters, n, n_prompts = 64, 1000, 5, 12, 1
    else:
        if not torch.cuda.is_available():
            print(
                "no CUDA GPU here: run with --dry-run to check the script on CPU", file=sys.stderr
            )
            return 2
        device = torch.device("cuda")
        hidden, vocab, iters, n, n_prompts = 4096, 128256, 200, args.tokens, args.prompts
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dry_run": args.dry_run,
        "models": "tiny" if args.dry_run else args.models,
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    log(f"draft-head micro-benchmark on {doc['device']}")
    doc["head_microbench"] = head_microbench(hidden, vocab, device, iters, log)
    if args.dry_run:
        target, draft, tok = tiny_pair(device)
    else:
        target, draft, tok = real_pair(device, args.models == "random")
    vocab_t = target.get_output_embeddings().weight.shape[0]
    prompts = code_prompts(tok, n_prompts, 32 if args.dry_run else 160, vocab_t)
    log("target-only")
    base = target_only(target, prompts, n, device)
    log("HF assisted")
    assisted = hf_assisted(target, draft, prompts, n, device)
    log("SlimSpec")
    spec = slimspec_runs(target, draft, tok, prompts, n, device, log)
    doc["decode"] = {
        "new_tokens": n,
        "prompts": len(prompts),
        "target_only_tok_s": base,
        "hf_assisted_e2e_tok_s": assisted,
        "hf_assisted_vs_target": assisted / base,
        "slimspec": spec,
        "speedup_vs_target": {
            r: v["decode_tok_s"] / base
            for r, v in spec.items()
            if isinstance(v, dict) and "decode_tok_s" in v
        },
    }
    doc["seconds"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_dry_run" if args.dry_run else "gpu"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, out / f"{name}.png")
    one_row = doc["head_microbench"]["by_rows"]["1"]["speedup_vs_ratio_0"]
    summary = {"device": doc["device"], "seconds": doc["seconds"]}
    summary["head_speedup_r0.8_1_row"] = one_row["0.8"]
    summary["speedup_vs_target"] = doc["decode"]["speedup_vs_target"]
    print(json.dumps(summary, indent=1))
    return 0


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for rows, v in doc["head_microbench"]["by_rows"].items():
        ratios = [float(r) for r in v["seconds"]]
        a.plot(ratios, [1e6 * s for s in v["seconds"].values()], "o-", label=f"{rows} rows")
    a.set(xlabel="compression ratio", ylabel="µs per head call", title="draft head (bf16)")
    a.legend()
    sp = doc["decode"]["speedup_vs_target"]
    b.bar(list(sp), list(sp.values()), color="tab:blue")
    b.axhline(1.0, color="k", lw=1)
    b.axhline(doc["decode"]["hf_assisted_vs_target"], color="tab:red", ls="--", label="HF assisted")
    b.set(xlabel="compression ratio", ylabel="decode speed-up vs target-only", title="SlimSpec")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
