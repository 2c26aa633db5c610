"""Peer benchmark: llama.cpp and SlimSpec on the same GGUF files, prompts and threads.

    .venv/bin/python bench/peers.py [--quick] [--tokens 64] [--prompt-tokens 250]
                                    [--prompts 2] [--clients 8] [--threads 2]

One run on the default pair (Qwen2.5-Coder-1.5B target, 0.5B draft, both Q4_K_M GGUF as
fetched). llama.cpp is built once from the pinned llama-cpp-python sdist
(scripts/bench/install-llamacpp.sh, cached outside the repo) and driven through
llama-server (prompt as token ids, greedy, EOS ignored, no prompt cache), so both sides
get the same prompt ids. Single stream, alternated prompt by prompt (code prompts from
the standard library, English from the KJV), each configuration once per prompt:

- llama.cpp target-only (llama-server -np 1)
- llama.cpp speculative (llama-server -md <draft GGUF>, its draft settings)
- SlimSpec target-only, target in its GGUF form (target_quantization=gguf)
- SlimSpec speculative, target gguf (the default engine: int4-fused draft where it runs,
  lookup drafts on)
- the same without lookup drafts (lookup_tokens=0: every step drafts with the draft model)
- SlimSpec speculative, target none (dense bf16; packed with oneDNN where it runs)

The speculative gguf runs' text is checked against the target-only gguf run's, token for
token (`same_as_target_only`). llama-server at this pin speculates with a draft model
only (its n-gram lookup lives in the `llama-lookup` example, not the server).

Decode tokens/s (generated tokens over the time after the prompt) and end to end (with
the prompt). Then serving: `--clients` concurrent clients with unique prompts against
llama-server -np <clients> (continuous batching) and against SlimSpec's server (gguf
target), aggregate completion tokens/s over the same requests. Writes
bench/results/peers.json and peers.png. Not a test: figures depend on the machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Run as a script, this folder is first on the module path: the sibling benches' parts.
import decode as decode_bench  # bench/decode.py: prompts and timing loops
import httpx
import serving as serving_bench  # bench/serving.py: the in-process server
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import gguf_kernels, target_form
from slimspec.server.app import ServerConfig
from slimspec.server.scheduler import SchedulerConfig
from slimspec.server.service import Limits, ModelRef
from slimspec.weights.loading import load_causal_lm
from slimspec.weights.registry import DEFAULT_PAIR

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INSTALL = ROOT / "scripts" / "bench" / "install-llamacpp.sh"


def llamacpp_bin() -> Path:
    out = subprocess.run(["bash", str(INSTALL)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def common_args(p: argparse.ArgumentParser, prompts: int) -> None:
    """The options every same-files bench against llama.cpp takes."""
    p.add_argument("--quick", action="store_true", help="a few tokens, to check the script")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=250)
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per domain")
    p.add_argument("--threads", type=int, default=2)


def pair_files() -> tuple[Path, Path, Path, Path, Path]:
    """The default pair's directories and GGUF files (fetched if missing), and the
    folder of llama.cpp's binaries (built once)."""
    from slimspec.weights.fetch import fetch_pair

    target_dir, draft_dir = fetch_pair(DEFAULT_PAIR.name)
    target_gguf, draft_gguf = target_form.find_gguf(target_dir), target_form.find_gguf(draft_dir)
    assert target_gguf is not None and draft_gguf is not None, "the fetch keeps the GGUFs"
    binary = llamacpp_bin()
    print(f"llama.cpp: {binary}; CPU: {serving_bench.cpu_name()}", flush=True)
    return target_dir, draft_dir, target_gguf, draft_gguf, binary


def machine(threads: int) -> dict[str, Any]:
    return {
        "cpu": serving_bench.cpu_name(),
        "threads": threads,
        "python": platform.python_version(),
        "gguf_kernel_path": gguf_kernels.path(),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """llama-server on loopback; stopped on exit."""

    def __init__(self, binary: Path, model: Path, threads: int, ctx: int, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "-t", str(threads), "-tb", str(threads),
               "-c", str(ctx), "--no-warmup", *extra]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit("llama-server did not become healthy in 300 s")

    def complete(self, prompt: list[int] | str, n: int) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                "cache_prompt": False, "seed": 0}  # fmt: skip
        r = httpx.post(f"{self.base}/completion", json=body, timeout=3600)
        r.raise_for_status()
        return dict(r.json())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def llama_single(server: LlamaServer, prompt: list[int], n: int) -> dict[str, float]:
    """Decode time from llama.cpp's own timings; end to end is the request's wall time
    (as SlimSpec's is), since the timings leave out work such as the draft's prefill."""
    t0 = time.perf_counter()
    t = server.complete(prompt, n)["timings"]
    wall_s = time.perf_counter() - t0
    decode_s = t["predicted_ms"] / 1000
    return {
        "tokens": t["predicted_n"],
        "decode_s": decode_s,
        "e2e_s": wall_s,
        "timings_e2e_s": decode_s + t["prompt_ms"] / 1000,
    }


def slimspec_target_only(model: Any, prompt: list[int], n: int) -> dict[str, Any]:
    r = decode_bench.target_only(model, [prompt], n)
    return {
        "tokens": n,
        "decode_s": n / r["decode_tok_s"],
        "e2e_s": n / r["e2e_tok_s"],
        "output": r["outputs"][0],
    }


def slimspec_spec(
    dec: SpeculativeDecoder, prompt: list[int], n: int, lookup_tokens: int
) -> dict[str, Any]:
    dec.set_lookup_tokens(lookup_tokens)
    r = decode_bench.slimspec(dec, [prompt], n)
    return {
        "tokens": n,
        "decode_s": n / r["decode_tok_s"],
        "e2e_s": n / r["e2e_tok_s"],
        "accepted_length": r["mean_accepted_length"],
        "tokens_per_step": r["tokens_per_step"],
        "lookup_steps": r["lookup_verifications"],
        "output": r["outputs"][0],
    }


def summarise(rows: list[dict[str, float]]) -> dict[str, float]:
    tokens = sum(r["tokens"] for r in rows)
    out = {
        "decode_tok_s": tokens / sum(r["decode_s"] for r in rows),
        "e2e_tok_s": tokens / sum(r["e2e_s"] for r in rows),
        "runs": len(rows),
    }
    if rows and "accepted_length" in rows[0]:
        out["mean_accepted_length"] = statistics.mean(r["accepted_length"] for r in rows)
        out["tokens_per_step"] = statistics.mean(r["tokens_per_step"] for r in rows)
        out["lookup_steps"] = sum(r["lookup_steps"] for r in rows)
    if rows and "same_as_target_only" in rows[0]:
        out["same_as_target_only"] = all(r["same_as_target_only"] for r in rows)
    if rows and "timings_e2e_s" in rows[0]:  # llama.cpp's own account, for comparison
        out["timings_e2e_tok_s"] = tokens / sum(r["timings_e2e_s"] for r in rows)
    return out


def serve_load(post: Any, prompts: list[str], clients: int) -> dict[str, float]:
    """Every prompt once, `clients` at a time: aggregate completion tokens/s."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = list(pool.map(post, prompts))
    wall = time.perf_counter() - t0
    return {
        "tokens": sum(tokens),
        "wall_s": wall,
        "tok_s": sum(tokens) / wall,
        "requests": len(prompts),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common_args(p, prompts=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.prompts, args.requests_per_client = 8, 1, 1
        args.clients = min(args.clients, 2)
    torch.set_num_threads(args.threads)
    target_dir, draft_dir, target_gguf, draft_gguf, binary = pair_files()

    tok = load_causal_lm(target_dir, dtype="bfloat16")[1]
    domains = {"code": decode_bench.code_prompts(tok, args.prompts, args.prompt_tokens)}
    english = decode_bench.english_prompts(tok, args.prompts, args.prompt_tokens)
    if english and not args.quick:
        domains["english"] = english

    ctx = args.prompt_tokens + args.tokens + 64
    llama = LlamaServer(binary, target_gguf, args.threads, ctx, "-np", "1")
    llama_spec = LlamaServer(
        binary, target_gguf, args.threads, ctx, "-np", "1", "-md", str(draft_gguf)
    )

    def load_target(form: str) -> Any:
        model, _ = load_causal_lm(target_dir, dtype="bfloat16")
        print(
            f"SlimSpec target {form}: {target_form.apply(model, form, target_dir).describe()}",
            flush=True,
        )
        return model

    own = load_target("gguf")
    dense = load_target("none")
    spec_own = SpeculativeDecoder.from_models(
        own, load_causal_lm(draft_dir, dtype="bfloat16")[0], tok
    )
    spec_dense = SpeculativeDecoder.from_models(
        dense, load_causal_lm(draft_dir, dtype="bfloat16")[0], tok
    )
    lookup = spec_own.lookup_tokens  # the default (SLIMSPEC_LOOKUP_TOKENS), A/B'd with 0
    configs = {
        "llamacpp_target_only": lambda ids: llama_single(llama, ids, args.tokens),
        "llamacpp_speculative": lambda ids: llama_single(llama_spec, ids, args.tokens),
        "slimspec_target_only_gguf": lambda ids: slimspec_target_only(own, ids, args.tokens),
        "slimspec_speculative_gguf": lambda ids: slimspec_spec(spec_own, ids, args.tokens, lookup),
        "slimspec_speculative_gguf_no_lookup": lambda ids: slimspec_spec(
            spec_own, ids, args.tokens, 0
        ),
        "slimspec_speculative_none": lambda ids: slimspec_spec(
            spec_dense, ids, args.tokens, lookup
        ),
    }
    # warm-up: one short run of each (first calls build kernels, fault in weights)
    for run in configs.values():
        run(domains["code"][0][:32])
    # then the heads' traffic ranking built once and frozen: a background re-rank (seconds
    # on these cores) would otherwise land inside whichever timed run follows
    for spec in (spec_own, spec_dense):
        spec.rerank_now(timeout=120, freeze=True)
        # every run prefills its whole prompt, as llama-server's (cache_prompt false):
        # spec_own runs each prompt twice (lookup drafts on and off)
        spec.set_prefix_cache_on(False)
    single: dict[str, dict[str, Any]] = {}
    for domain, prompts in domains.items():
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for i, ids in enumerate(prompts):
            order = list(configs) if i % 2 == 0 else list(reversed(configs))  # alternate
            for name in order:
                rows[name].append(configs[name](ids))
            # exactness in every run: the gguf speculative runs' text is the gguf
            # target-only run's (same kernels)
            want = rows["slimspec_target_only_gguf"][-1]["output"]
            for name in order:
                row = rows[name][-1]
                if name.startswith("slimspec_speculative_gguf"):
                    row["same_as_target_only"] = row["output"] == want
                row.pop("output", None)
                print(f"{domain} prompt {i} {name}: {row}", flush=True)
        single[domain] = {name: summarise(r) for name, r in rows.items()}
    llama_spec.stop()
    configs.clear()
    spec_dense = dense = None  # free the dense target before serving
    gc.collect()

    # Serving: unique prompts (other parts of the code and English sources).
    n_req = args.clients * args.requests_per_client
    texts = [tok.decode(ids) for d in domains.values() for ids in d]
    more = decode_bench.code_prompts(tok, 6, args.prompt_tokens)
    texts += [tok.decode(ids[::-1][: args.prompt_tokens]) for ids in more]  # distinct texts
    texts = (texts * (n_req // max(1, len(texts)) + 1))[:n_req]
    texts = [f"# request {i}\n{t}" for i, t in enumerate(texts)]  # unique prompts
    llama.stop()
    llama_batch = LlamaServer(
        binary, target_gguf, args.threads, ctx * args.clients, "-np", str(args.clients)
    )

    def llama_post(text: str) -> int:
        return int(llama_batch.complete(text, args.tokens)["tokens_predicted"])

    spec_own.set_lookup_tokens(lookup)
    spec_own.set_prefix_cache_on(True)  # serving as deployed (unique prompts: no hits)
    served = serve_slimspec(spec_own, args)

    def slim_post(text: str) -> int:
        body = {"prompt": text, "max_tokens": args.tokens, "temperature": 0}
        r = httpx.post(f"{served}/v1/completions", json=body, timeout=3600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    serving = {"clients": args.clients, "requests": n_req}
    serving["llamacpp"] = serve_load(llama_post, texts, args.clients)
    serving["slimspec"] = serve_load(slim_post, texts, args.clients)
    llama_batch.stop()

    code = single["code"]
    best_llama = max(
        ("llamacpp_target_only", "llamacpp_speculative"), key=lambda k: code[k]["e2e_tok_s"]
    )
    result: dict[str, Any] = {
        "machine": machine(args.threads),
        "llamacpp": {
            "llama_cpp_python": os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.16"),
            "bin": str(binary),
        },
        "settings": {
            "tokens": args.tokens,
            "prompt_tokens": args.prompt_tokens,
            "prompts_per_domain": args.prompts,
            "slimspec_draft_context": spec_own.draft_context,
        },
        "single_stream": single,
        "serving": serving,
    }
    for domain, rows in single.items():
        llama_best_e2e = max(
            rows["llamacpp_target_only"]["e2e_tok_s"], rows["llamacpp_speculative"]["e2e_tok_s"]
        )
        llama_best_decode = max(
            rows["llamacpp_target_only"]["decode_tok_s"],
            rows["llamacpp_speculative"]["decode_tok_s"],
        )
        ours = [v for name, v in rows.items() if name.startswith("slimspec_speculative")]
        ours_e2e = max(v["e2e_tok_s"] for v in ours)
        ours_decode = max(v["decode_tok_s"] for v in ours)
        result[f"speedup_vs_llamacpp_best_e2e_{domain}"] = ours_e2e / llama_best_e2e
        result[f"speedup_vs_llamacpp_best_decode_{domain}"] = ours_decode / llama_best_decode
        result[f"lookup_drafts_decode_gain_{domain}"] = (
            rows["slimspec_speculative_gguf"]["decode_tok_s"]
            / rows["slimspec_speculative_gguf_no_lookup"]["decode_tok_s"]
        )
        result[f"target_only_gguf_vs_llamacpp_target_only_{domain}"] = (
            rows["slimspec_target_only_gguf"]["decode_tok_s"]
            / rows["llamacpp_target_only"]["decode_tok_s"]
        )
    result["speedup_vs_llamacpp_best_e2e"] = result["speedup_vs_llamacpp_best_e2e_code"]
    result["speedup_vs_llamacpp_best_decode"] = result["speedup_vs_llamacpp_best_decode_code"]
    result["llamacpp_best_configuration_code"] = best_llama
    result["serving_speedup_vs_llamacpp_8_clients"] = (
        serving["slimspec"]["tok_s"] / serving["llamacpp"]["tok_s"]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(
        json.dumps(
            {
                k: v
                for k, v in result.items()
                if k.startswith(("speedup", "serving_", "target_only"))
            },
            indent=2,
        )
    )
    return 0


def serve_slimspec(dec: SpeculativeDecoder, args: argparse.Namespace) -> str:
    """SlimSpec's server (in process) on the already loaded gguf-target decoder."""
    engine = dec

    cfg = ServerConfig(
        model=ModelRef("bench-target", "bench-draft", "bench", "bfloat16", "cpu"),
        scheduler=SchedulerConfig(max_batch_size=args.clients, max_queue=256, batch_wait_s=0.01),
        limits=Limits(request_timeout_s=3600),
        loader=lambda ref: engine,
        enable_gpu_metrics=False,
    )
    base, _app, _server = serving_bench.start_server(cfg)
    return str(base)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(result["single_stream"])
    fig, axes = plt.subplots(1, len(domains) + 1, figsize=(5 * (len(domains) + 1), 4))
    for ax, domain in zip(axes, domains, strict=False):
        rows = result["single_stream"][domain]
        names = list(rows)
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [rows[n]["decode_tok_s"] for n in names], 0.4, label="decode")
        ax.bar([i + 0.2 for i in x], [rows[n]["e2e_tok_s"] for n in names], 0.4, label="end to end")
        labels = [n.replace("_", " ") for n in names]
        ax.set_xticks(list(x), labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"single stream, {domain}")
        ax.legend(fontsize=7)
    s = result["serving"]
    axes[-1].bar(
        ["llama.cpp\nserver", "SlimSpec\nserve"], [s["llamacpp"]["tok_s"], s["slimspec"]["tok_s"]]
    )
    axes[-1].set_title(f"{s['clients']} clients, unique prompts")
    axes[-1].set_ylabel("aggregate tokens/s")
    fig.suptitle(result["machine"]["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
