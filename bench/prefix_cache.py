"""Prefix cache benchmark: a chat workload with a shared ~1,000-token system prompt, the
cache on vs off in one process, and llama.cpp's server on the same GGUF beside it.

    .venv/bin/python bench/prefix_cache.py [--quick] [--system-tokens 1000] [--clients 8]
                                           [--turns 2] [--reps 2] [--chat-off] [--threads 2]

One run on the default pair (the default engine: the target from its Q4_K_M GGUF, the
int4 draft), loaded once:

1. nothing repeats (engine level, before the server starts): batches of
   `--no-repeat-clients` (4) unique `--no-repeat-tokens` (200) prompts, cache on and off
   alternated (`--no-repeat-reps` each; every run its own prompts, so nothing is ever
   found), decode + prefill tokens/s.
   `prefix_cache_no_repeat_ratio` = tokens/s on / off; the time spent copying blocks into
   the cache is reported beside it (`store_share`).
2. the repeated prefix, one client over HTTP (streamed /v1/completions): the system
   prompt plus a new question each time, cache off and on alternated (`--reps` each,
   after one request that fills the cache). `prefix_cache_ttft_gain` = median time to
   first token off / on.
3. chat, `--clients` conversations at once, `--turns` turns each (each turn's prompt:
   the system prompt, the earlier turns with the model's own replies, a new question):
   aggregate completion tokens/s and time to first token, cache on (filled with the
   system prompt first, as a running server has it), cache off with `--chat-off` (slow:
   every turn prefills its whole prompt), and llama-server
   (`-np clients`, its own prompt cache on: each slot keeps its last prompt) on the
   same GGUF and the same token ids.

Writes bench/results/prefix_cache.json. Not a test: figures depend on the machine; every
ratio is from this one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Run as a script, this folder is first on the module path: the sibling benches' parts.
import decode as decode_bench  # bench/decode.py: the code corpus
import httpx
import peers as peers_bench  # bench/peers.py: llama-server
import serving as serving_bench  # bench/serving.py: the in-process server
import torch
from slimspec import SpeculativeDecoder
from slimspec.cpu import target_form
from slimspec.decoding.prefix_cache import DEFAULT_MB
from slimspec.decoding.types import GenerationRequest
from slimspec.server.app import ServerConfig
from slimspec.server.scheduler import SchedulerConfig
from slimspec.server.service import Limits, ModelRef
from slimspec.weights.registry import DEFAULT_PAIR, PAIRS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

SYSTEM_HEAD = (
    "You are a careful coding assistant for the project whose code follows. Answer "
    "questions about it briefly and exactly.\n\n"
)
QUESTIONS = [
    "What does the first function above do? One sentence.",
    "Which module-level names does this code define? List three.",
    "Is there any error handling in this code? Answer briefly.",
    "Suggest one small improvement to the code above.",
    "What would a good unit test for the first function check?",
    "Which standard library modules does the code import?",
    "Summarise the code above in one line.",
    "Name one edge case the code might not handle.",
    "What is the return type of the first function?",
    "Rewrite the first function's docstring in one sentence.",
    "Which function above is the longest?",
    "Does the code use any global state? Answer briefly.",
]
FOLLOW_UPS = [
    "And why is that?",
    "Can you give a one-line example?",
    "Say it again in fewer words.",
]


# ------------------------------------------------------------------ clients
def slimspec_stream(base: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One streamed /v1/completions request: time to first text, total time, tokens."""
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, parts, tokens, prompt_tokens = None, [], 0, 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = int(obj["usage"]["completion_tokens"])
                prompt_tokens = int(obj["usage"]["prompt_tokens"])
            for choice in obj.get("choices", []):
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(choice["text"])
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total,
            "tokens": tokens, "prompt_tokens": prompt_tokens, "text": "".join(parts)}  # fmt: skip


def llama_stream(base: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed llama-server /completion request (token ids, greedy, its prompt
    cache on: a slot reuses the longest common prefix of its last prompt)."""
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "stream": True,
            "cache_prompt": True, "seed": 0}  # fmt: skip
    t0 = time.perf_counter()
    ttft, parts, tokens, cached = None, [], 0, 0
    with httpx.stream("POST", f"{base}/completion", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            obj = json.loads(line[6:])
            if obj.get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(obj["content"])
            if obj.get("stop"):
                tokens = int(obj.get("tokens_predicted", 0))
                cached = int(obj.get("tokens_cached", 0))
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total,
            "tokens": tokens, "prompt_tokens": len(ids), "llama_tokens_cached": cached,
            "text": "".join(parts)}  # fmt: skip


Send = Callable[[list[dict[str, str]]], dict[str, Any]]


def chat_load(send: Send, system: str, clients: int, turns: int) -> dict[str, Any]:
    """`clients` conversations at once, `turns` turns each; every turn's prompt is the
    system prompt, the earlier turns (with the replies this server gave) and a new
    question. Aggregate completion tokens/s and time to first token."""
    rows: list[dict[str, Any]] = []

    def conversation(c: int) -> None:
        messages = [{"role": "system", "content": system}]
        for t in range(turns):
            question = QUESTIONS[c % len(QUESTIONS)] if t == 0 else FOLLOW_UPS[(t - 1) % 3]
            messages.append({"role": "user", "content": f"[{c}] {question}"})
            r = send(messages)
            messages.append({"role": "assistant", "content": r["text"]})
            rows.append({**r, "turn": t})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(conversation, range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rows)
    ttfts = [r["ttft_s"] for r in rows]
    return {
        "requests": len(rows),
        "wall_s": round(wall, 2),
        "tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_first_turn_mean_s": statistics.fmean(r["ttft_s"] for r in rows if r["turn"] == 0),
        "ttft_later_turns_mean_s": (
            statistics.fmean(r["ttft_s"] for r in rows if r["turn"] > 0) if turns > 1 else None
        ),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rows),
    }


# ------------------------------------------------------------------ phases
def no_repeat(dec: SpeculativeDecoder, windows: list[list[int]], clients: int, reps: int,
              max_new: int) -> dict[str, Any]:  # fmt: skip
    """Batches of unique prompts, cache on and off alternated; every run gets prompts of
    its own, so the cache never finds anything and only costs its stores."""
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for i in range(2 * reps):
        mode = ("off", "on")[i % 2] if (i // 2) % 2 == 0 else ("on", "off")[i % 2]
        dec.set_prefix_cache_on(mode == "on")
        batch = windows[i * clients : (i + 1) * clients]
        reqs = [GenerationRequest(f"nr{i}-{j}", p, max_new) for j, p in enumerate(batch)]
        before = dec.stats.as_dict()
        t0 = time.perf_counter()
        results = dec.generate_batch(reqs)
        wall = time.perf_counter() - t0
        after = dec.stats.as_dict()
        tokens = sum(len(r.output_ids) for r in results)
        row = {
            "wall_s": round(wall, 3),
            "tok_s": tokens / wall,
            "hits": after["prefix_hits"] - before["prefix_hits"],
            "store_s": round(after["prefix_store_s"] - before["prefix_store_s"], 4),
        }
        runs[mode].append(row)
        print(f"no-repeat run {i} cache {mode}: {row}", flush=True)
    dec.set_prefix_cache_on(True)
    on = sum(r["tok_s"] for r in runs["on"]) / reps
    off = sum(r["tok_s"] for r in runs["off"]) / reps
    store_share = sum(r["store_s"] for r in runs["on"]) / sum(r["wall_s"] for r in runs["on"])
    return {"runs": runs, "tok_s_on": on, "tok_s_off": off, "ratio": on / off,
            "store_share": store_share}  # fmt: skip


def repeated_prefix(dec: SpeculativeDecoder, base: str, template: Callable[[str], str],
                    reps: int, max_new: int) -> dict[str, Any]:  # fmt: skip
    """One client: the system prompt and a new question each time, cache off and on
    alternated (after one request that fills the cache with the system prompt)."""
    dec.set_prefix_cache_on(True)
    slimspec_stream(base, template("Hello."), 4)  # fills the cache
    rows: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for i in range(2 * reps):
        mode = ("off", "on")[i % 2]
        dec.set_prefix_cache_on(mode == "on")
        r = slimspec_stream(base, template(QUESTIONS[i % len(QUESTIONS)]), max_new)
        rows[mode].append({k: v for k, v in r.items() if k != "text"})
        print(f"repeated prefix {i} cache {mode}: {rows[mode][-1]}", flush=True)
    dec.set_prefix_cache_on(True)
    out: dict[str, Any] = {"runs": rows}
    for mode in ("on", "off"):
        out[f"ttft_{mode}_median_s"] = statistics.median(r["ttft_s"] for r in rows[mode])
        out[f"tok_s_{mode}"] = sum(r["tokens"] for r in rows[mode]) / sum(
            r["total_s"] for r in rows[mode]
        )
    out["ttft_gain"] = out["ttft_off_median_s"] / out["ttft_on_median_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="short prompts, to check the script")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--no-repeat-tokens", type=int, default=200)
    p.add_argument("--no-repeat-clients", type=int, default=4)
    p.add_argument("--no-repeat-reps", type=int, default=1)
    p.add_argument(
        "--chat-off", action="store_true", help="also the chat with the cache off (slow on a CPU)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--chat-only", action="store_true", help="only the chat part (3.)")
    p.add_argument("--pair", default=DEFAULT_PAIR.name, help="a registry pair (small: a check)")
    p.add_argument("--out", type=Path, default=RESULTS / "prefix_cache.json")
    args = p.parse_args(argv)
    if args.quick:
        args.system_tokens, args.clients, args.turns, args.reps = 200, 2, 2, 1
        args.max_new_tokens, args.no_repeat_tokens, args.no_repeat_clients = 8, 64, 2
    torch.set_num_threads(args.threads)
    from slimspec.weights.fetch import fetch_pair

    pair = PAIRS[args.pair]
    target_dir, _ = fetch_pair(pair.name)
    target_gguf = target_form.find_gguf(target_dir)
    dec = SpeculativeDecoder.from_pretrained(
        target=pair.target, draft=pair.draft, prefix_cache_mb=DEFAULT_MB
    )
    tok = dec.tokenizer
    print(f"CPU: {serving_bench.cpu_name()}; target {dec.target_form.describe()}", flush=True)
    dec.warmup()

    code = [t for ids in decode_bench.code_prompts(tok, 12, 4000) for t in ids]
    system = SYSTEM_HEAD + tok.decode(code[: args.system_tokens])

    def template(question: str) -> str:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return str(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    # 1. nothing repeats: windows of the code corpus after the system prompt's part
    n = args.no_repeat_tokens
    rest = code[args.system_tokens :]
    runs = 2 * args.no_repeat_reps * args.no_repeat_clients
    windows = [rest[i * n : (i + 1) * n] for i in range(runs)]
    assert all(len(w) == n for w in windows), "the code corpus is too short for these runs"
    nothing_repeats: dict[str, Any] = {}
    if not args.chat_only:
        nothing_repeats = no_repeat(
            dec, windows, args.no_repeat_clients, args.no_repeat_reps, args.max_new_tokens
        )

    # 2. and 3. over HTTP
    cfg = ServerConfig(
        model=ModelRef("bench-target", "bench-draft", "bench", "bfloat16", "cpu"),
        scheduler=SchedulerConfig(max_batch_size=args.clients, max_queue=256, batch_wait_s=0.01),
        limits=Limits(request_timeout_s=3600),
        loader=lambda ref: dec,
        enable_gpu_metrics=False,
        warmup=False,
    )
    base, _app, _server = serving_bench.start_server(cfg)
    repeated: dict[str, Any] = {}
    if not args.chat_only:
        repeated = repeated_prefix(dec, base, template, args.reps, args.max_new_tokens)

    def chat_text(messages: list[dict[str, str]]) -> str:
        return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def slim_send(messages: list[dict[str, str]]) -> dict[str, Any]:
        return slimspec_stream(base, chat_text(messages), args.max_new_tokens)

    chat: dict[str, Any] = {"clients": args.clients, "turns": args.turns}
    if args.chat_off:
        dec.set_prefix_cache_on(False)
        chat["slimspec_cache_off"] = chat_load(slim_send, system, args.clients, args.turns)
        print(f"chat, cache off: {chat['slimspec_cache_off']}", flush=True)
    dec.set_prefix_cache_mb(DEFAULT_MB)  # a fresh cache ...
    slimspec_stream(base, template("Hello."), 4)  # ... that holds the system prompt
    hits0 = dec.stats.prefix_hit_tokens
    chat["slimspec_cache_on"] = chat_load(slim_send, system, args.clients, args.turns)
    chat["slimspec_cache_on"]["hit_tokens"] = dec.stats.prefix_hit_tokens - hits0
    print(f"chat, cache on: {chat['slimspec_cache_on']}", flush=True)
    if not args.no_llamacpp and target_gguf is not None:
        binary = peers_bench.llamacpp_bin()
        ctx = (args.system_tokens + 400 + args.turns * (args.max_new_tokens + 60)) * args.clients
        llama = peers_bench.LlamaServer(
            binary, target_gguf, args.threads, ctx, "-np", str(args.clients)
        )

        def llama_send(messages: list[dict[str, str]]) -> dict[str, Any]:
            ids = tok(chat_text(messages), add_special_tokens=False)["input_ids"]
            return llama_stream(llama.base, ids, args.max_new_tokens)

        try:
            llama_send([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}])
            chat["llamacpp"] = chat_load(llama_send, system, args.clients, args.turns)
            print(f"chat, llama.cpp: {chat['llamacpp']}", flush=True)
        finally:
            llama.stop()

    on = chat["slimspec_cache_on"]
    result: dict[str, Any] = {
        "pair": pair.name,
        "machine": {
            "cpu": serving_bench.cpu_name(),
            "threads": args.threads,
            "python": platform.python_version(),
            "target_form": dec.target_form.describe(),
            "draft_quantization": dec.draft_quantization,
        },
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "cache_mb": DEFAULT_MB,
        "block_tokens": dec.prefix_cache.block_tokens if dec.prefix_cache else None,
        "nothing_repeats": nothing_repeats,
        "repeated_prefix_one_client": repeated,
        "chat": chat,
    }
    if not args.chat_only:
        result["prefix_cache_ttft_gain"] = repeated["ttft_gain"]
        result["prefix_cache_no_repeat_ratio"] = nothing_repeats["ratio"]
    if "slimspec_cache_off" in chat:
        off = chat["slimspec_cache_off"]
        result["prefix_cache_chat_tok_s_gain"] = on["tok_s"] / off["tok_s"]
        result["prefix_cache_chat_ttft_gain"] = off["ttft_mean_s"] / on["ttft_mean_s"]
    if "llamacpp" in chat:
        result["prefix_cache_chat_vs_llamacpp_tok_s"] = on["tok_s"] / chat["llamacpp"]["tok_s"]
        result["prefix_cache_chat_vs_llamacpp_ttft"] = (
            chat["llamacpp"]["ttft_mean_s"] / on["ttft_mean_s"]
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith("prefix_cache_")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
