"""Serving benchmark: batching off vs on, 1/4/8/16 concurrent clients, real model pair.

One process loads the pair once and serves it over real HTTP on loopback (uvicorn
in a thread); closed-loop clients (httpx, asyncio) send /infer requests for a fixed
window per configuration. Requests still running when a window ends are abandoned
(the client disconnects, the server cancels them) and counted apart, so every run
is bounded in time. Batching "off" is max_batch_size=1 (one request at a time);
"on" is max_batch_size=16. The seed's before/after table compares target-only
decoding one at a time (before) with speculative decoding + batching (after) at 8
clients.

    .venv/bin/python bench/serving.py --window 30 --max-new-tokens 24
writes bench/results/serving.json and serving.png (about 12 minutes on a quiet 2-core
machine; --quick: 8 s windows, 1 and 8 clients, a few minutes, to check the script).
The ratio effect: with batching on at 8 clients, the same load at each of --ratios,
alternated --ratio-repeats times, each after an untimed --settle window, beside the
engine's own predicted speed-up per ratio read from /metrics at the end of each window
(--ratio-only runs just that). The fused-prefill effect: the same 8 clients with new
prompts' prefill riding on the verification forward (the default) and apart, alternated
(--no-prefill-ab skips it).

--workload code|chat sends what users send instead of the eight short prompts
(bench/workloads.py: 250-1,000-token code through /v1/completions, or English passages
with a question through /v1/chat/completions, 128 new tokens), speculative and
target-only both with batching on, at 1 and 8 clients; each run also records where the
engine's time went (slimspec_engine_seconds_total shares). --target-quantization picks
the target's form (gguf: its GGUF blocks, none: dense).

    .venv/bin/python bench/serving.py --workload code --ratio-clients 1,8 \
        --out bench/results/serving_code.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import workloads  # bench/workloads.py: the request mixes

# What the clients send (main() sets it from --workload); each request's token limit is
# the run's max_new.
REQUESTS: list[workloads.Request] = workloads.short_requests(24)


@dataclass
class RunResult:
    mode: str
    clients: int
    completed: int
    abandoned: int
    rejected: int
    window_s: float
    qps: float
    tokens_per_s: float
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    mean_latency_s: float | None
    engine_time_shares: dict[str, float] | None = None  # slimspec_engine_seconds_total


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


async def run_clients(base: str, clients: int, window_s: float, max_new: int) -> dict[str, Any]:
    lat: list[float] = []
    toks = 0
    abandoned = rejected = 0
    end = time.monotonic() + window_s

    async def client(i: int) -> None:
        nonlocal toks, abandoned, rejected
        n = 0
        async with httpx.AsyncClient(timeout=None) as http:
            while (left := end - time.monotonic()) > 0:
                req = REQUESTS[(i + n * clients) % len(REQUESTS)]
                body = dict(req.body)
                body["max_length" if req.path == "/infer" else "max_tokens"] = max_new
                n += 1
                t0 = time.monotonic()
                try:
                    r = await asyncio.wait_for(
                        http.post(f"{base}{req.path}", json=body), timeout=left
                    )
                except TimeoutError:
                    abandoned += 1
                    return
                if r.status_code == 429:
                    rejected += 1
                    await asyncio.sleep(0.2)
                    continue
                r.raise_for_status()
                lat.append(time.monotonic() - t0)
                doc = r.json()
                toks += (
                    doc["usage"]["completion_tokens"]
                    if "usage" in doc
                    else doc["completion_tokens"]
                )

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return {
        "lat": lat,
        "toks": toks,
        "abandoned": abandoned,
        "rejected": rejected,
        "elapsed": time.monotonic() - t0,
    }


def metric_values(base: str, name: str, text: str | None = None) -> dict[str, float]:
    """label text -> value of one metric family on /metrics ('' for an unlabelled one);
    `text`: an exposition already fetched."""
    if text is None:
        text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


def set_ratio(app: Any, ratio: float) -> None:
    app.state.service.update_settings({"compression_ratio": ratio})


def generated_tokens(base: str) -> float:
    return step_counters(base)["generated"]


STEP_COUNTERS = {
    "generated": "slimspec_generated_tokens_total",
    "drafted": "slimspec_draft_tokens_total",
    "accepted": "slimspec_accepted_tokens_total",
    "verify_steps": "slimspec_verify_steps_total",
    "lookup_verifications": "slimspec_lookup_verifications_total",
    "lookup_accepted": "slimspec_lookup_accepted_tokens_total",
}


def step_counters(base: str) -> dict[str, float]:
    """The engine's token and step counters (0 where absent), from one scrape."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {k: metric_values(base, name, text).get("", 0.0) for k, name in STEP_COUNTERS.items()}


def ratio_window(base: str, app: Any, ratio: float, window_s: float, settle_s: float,
                 max_new: int, clients: int = 8) -> dict[str, Any]:  # fmt: skip
    """`clients` at one ratio: an untimed settle window first (the first steps after a
    switch build the new head's kernels and refill the acceptance estimate), then the
    timed one, with the engine's acceptance over it and its prediction at its end."""
    set_ratio(app, ratio)
    if settle_s > 0:
        asyncio.run(run_clients(base, clients, settle_s, max_new))
        wait_idle(app)
    c0 = step_counters(base)
    mode = f"speculative, batching on, ratio {ratio}"
    res = measure(base, app, mode, clients, window_s, max_new)
    d = {k: v - c0[k] for k, v in step_counters(base).items()}
    return {
        "tokens_per_s": res.tokens_per_s,
        "p99_s": res.p99_s,
        "completed": res.completed,
        "acceptance": round(d["accepted"] / d["drafted"], 4) if d["drafted"] else None,
        "drafted_per_verify_step": round(d["drafted"] / d["verify_steps"], 3)
        if d["verify_steps"]
        else None,
        # per-request verifications of lookup drafts: a share of all of them
        "lookup_share": round(d["lookup_verifications"] / (verifies), 3)
        if (verifies := d["verify_steps"] + d["lookup_verifications"])
        else None,
        "predicted_speedup": metric_values(base, "slimspec_ratio_predicted_speedup"),
    }


def ratio_effect_runs(
    base: str, app: Any, ratios: list[float], repeats: int, window_s: float, settle_s: float,
    max_new: int, clients: int = 8,
) -> dict[str, Any]:  # fmt: skip
    """The ratios alternated `repeats` times (drift hits each alike); per ratio the mean
    tokens/s over its windows, and measured vs predicted effect relative to the first."""
    runs: dict[float, list[dict[str, Any]]] = {r: [] for r in ratios}
    # Untimed: the first window after loading ran at 8.4 tokens/s where every later one
    # ran at 17-20 (1 client): the engine's estimates start from priors, and the first
    # requests pay one-time work. Every ratio's head gets built here as well.
    for r in ratios:
        set_ratio(app, r)
        asyncio.run(run_clients(base, clients, max(settle_s, window_s / len(ratios)), max_new))
        wait_idle(app)
    for _ in range(repeats):
        for r in ratios:
            runs[r].append(ratio_window(base, app, r, window_s, settle_s, max_new, clients))
    key = lambda r: f'{{ratio="{r}"}}'  # noqa: E731
    out: dict[str, Any] = {}
    ref = ratios[0]
    ref_tps = statistics.fmean(w["tokens_per_s"] for w in runs[ref])
    for r in ratios:
        tps = statistics.fmean(w["tokens_per_s"] for w in runs[r])
        # the engine's prediction for r over its prediction for the reference, each read
        # at the end of r's own windows (the prediction of the traffic r served)
        pred = [
            w["predicted_speedup"].get(key(r), 0) / w["predicted_speedup"].get(key(ref), 1)
            for w in runs[r]
            if w["predicted_speedup"].get(key(ref))
        ]
        out[repr(r)] = {
            "tokens_per_s": round(tps, 3),
            "tokens_per_s_windows": [w["tokens_per_s"] for w in runs[r]],
            "p99_s": max((w["p99_s"] or 0) for w in runs[r]),
            "acceptance": [w["acceptance"] for w in runs[r]],
            "drafted_per_verify_step": [w["drafted_per_verify_step"] for w in runs[r]],
            "lookup_share": [w["lookup_share"] for w in runs[r]],
            "measured_vs_first": round(tps / ref_tps, 3) if ref_tps else None,
            "predicted_vs_first": round(statistics.fmean(pred), 3) if pred else None,
        }
    out["predicted_speedup"] = runs[ratios[-1]][-1]["predicted_speedup"]
    out["settle_s"], out["repeats"], out["clients"] = settle_s, repeats, clients
    last = out[repr(ratios[-1])]
    # one ratio alone compares nothing: no error (0 would read as a perfect prediction)
    if len(ratios) > 1 and last["measured_vs_first"] and last["predicted_vs_first"]:
        # |predicted - measured| / measured, for the last ratio's effect on the first's
        err = (
            abs(last["predicted_vs_first"] - last["measured_vs_first"]) / last["measured_vs_first"]
        )
        out["prediction_error"] = round(err, 4)
    return out


def prefill_effect_runs(
    base: str, app: Any, decoder: Any, repeats: int, window_s: float, max_new: int
) -> dict[str, Any]:
    """8 clients with new prompts' prefill riding on the verification forward and apart,
    alternated `repeats` times; tokens/s, p99 and the prefill share of the wall time."""
    runs: dict[bool, list[dict[str, float | None]]] = {False: [], True: []}
    for _ in range(repeats):
        for on in (False, True):
            decoder.set_fused_prefill(on)
            p0 = decoder.stats.prefill_time_s
            res = measure(base, app, f"speculative, batching on, fused prefill {on}", 8,
                          window_s, max_new)  # fmt: skip
            share = (decoder.stats.prefill_time_s - p0) / res.window_s
            runs[on].append({"tokens_per_s": res.tokens_per_s, "p99_s": res.p99_s,
                             "prefill_share": round(share, 3)})  # fmt: skip
    decoder.set_fused_prefill(True)
    out: dict[str, Any] = {}
    for on, windows in runs.items():
        out["on" if on else "off"] = {
            "tokens_per_s": round(statistics.fmean(w["tokens_per_s"] or 0 for w in windows), 3),
            "windows": windows,
        }
    off = out["off"]["tokens_per_s"]
    out["gain"] = round(out["on"]["tokens_per_s"] / off, 3) if off else None
    return out


def wait_idle(app: Any, timeout: float = 120) -> None:
    """Abandoned requests are cancelled at the server's next step; wait for that."""
    service = app.state.service
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.scheduler.in_flight == 0 for s in [service.current, *service._retired] if s):
            return
        time.sleep(0.1)


def engine_seconds(base: str) -> dict[str, float]:
    """phase -> seconds of the engine's compute so far (slimspec_engine_seconds_total)."""
    out = {}
    for labels, v in metric_values(base, "slimspec_engine_seconds_total").items():
        out[labels.split('"')[1] if '"' in labels else labels] = v
    return out


def flush_prefix_caches(app: Any) -> None:
    """Empty every engine's prefix cache (same size): the windows send the same distinct
    prompts, so a window would otherwise start with the earlier windows' prefixes stored
    and measure the cache rather than what it is set to compare."""
    service = app.state.service
    for session in [service.current, *service._retired]:
        if session is None:
            continue
        engine = session.scheduler.engine
        cache = getattr(getattr(engine, "_batch", None), "prefix_cache", None)
        if cache is not None:
            engine.set_prefix_cache_mb(cache.max_bytes / 2**20)


def measure(
    base: str, app: Any, mode: str, clients: int, window_s: float, max_new: int
) -> RunResult:
    wait_idle(app)
    flush_prefix_caches(app)
    tok0, sec0 = generated_tokens(base), engine_seconds(base)
    raw = asyncio.run(run_clients(base, clients, window_s, max_new))
    wait_idle(app)
    # Server-side count: includes the partial work of requests abandoned at the window's end.
    raw["toks"] = generated_tokens(base) - tok0
    spent = {k: v - sec0.get(k, 0.0) for k, v in engine_seconds(base).items()}
    busy = sum(spent.values())
    lat, el = raw["lat"], raw["elapsed"]
    res = RunResult(
        mode=mode,
        clients=clients,
        completed=len(lat),
        abandoned=raw["abandoned"],
        rejected=raw["rejected"],
        window_s=round(el, 2),
        qps=round(len(lat) / el, 4),
        tokens_per_s=round(raw["toks"] / el, 3),
        p50_s=percentile(lat, 50),
        p95_s=percentile(lat, 95),
        p99_s=percentile(lat, 99),
        mean_latency_s=statistics.fmean(lat) if lat else None,
        engine_time_shares={k: round(v / busy, 3) for k, v in spent.items()} if busy else None,
    )
    print(json.dumps(res.__dict__), flush=True)
    return res


def start_server(cfg: Any) -> tuple[str, Any, Any]:
    import uvicorn
    from slimspec.server.app import create_app

    app = create_app(cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True).start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while True:
        try:
            r = httpx.get(f"{base}/readyz", timeout=5)
            if r.status_code == 200:
                return base, app, server
            if r.json().get("status") == "failed":
                raise SystemExit(r.text)
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def set_batch(app: Any, size: int) -> None:
    """In-process switch of the scheduler's batch limit (the bench owns the process)."""
    service = app.state.service
    service.sched_config = replace(service.sched_config, max_batch_size=size)
    service.current.scheduler.config = service.sched_config


def cpuinfo_field(name: str) -> str | None:
    """The first /proc/cpuinfo line's value for `name` ("model name", "cpu family"...)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor()


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (a VM's "AMD EPYC" says
    neither Zen 4 nor Zen 5: family 25 or 26) and the flags that pick the engine's
    kernels (the model name alone reads the same on Intel machines with and without
    AMX)."""
    from slimspec.cpu import clib

    flags = clib.cpu_flags()
    extras = [f for f in ("avx512_vnni", "amx_int8", "avx2") if f in flags]
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    numbers = f"family {family} model {model}; " if family and model else ""
    return f"{cpu_model()} ({numbers}{', '.join(extras) or 'no AVX2'})"


def plot(results: list[RunResult], ratio_effect: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for mode, style in (("speculative, batching off", "o--"), ("speculative, batching on", "o-")):
        rs = [r for r in results if r.mode == mode]
        xs = [r.clients for r in rs]
        a.plot(xs, [r.tokens_per_s for r in rs], style, label=mode)
        b.plot(xs, [r.p99_s or 0 for r in rs], style, label=mode)
    a.set(xlabel="concurrent clients", ylabel="aggregate tokens/s", title="Throughput")
    b.set(xlabel="concurrent clients", ylabel="p99 latency (s)", title="p99 latency")
    per_ratio = {k: v for k, v in ratio_effect.items() if isinstance(v, dict) and "p99_s" in v}
    xs = [float(k) for k in per_ratio]
    c.plot(xs, [v["measured_vs_first"] for v in per_ratio.values()], "o-", label="measured")
    c.plot(xs, [v["predicted_vs_first"] for v in per_ratio.values()], "s--", label="predicted")
    c.set(xlabel="compression ratio", ylabel=f"tokens/s vs ratio {xs[0] if xs else 0:g}",
          title="The ratio at 8 clients, batching on")  # fmt: skip
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--draft-quantization",
        default="auto",
        help="none | auto | int4-fused | ... (engine option)",
    )
    p.add_argument(
        "--target-quantization", default="auto", help="auto | gguf | int8 | none (engine option)"
    )
    p.add_argument("--workload", default="short", choices=workloads.WORKLOADS,
                   help="what clients send (bench/workloads.py); code and chat: 250-1000 "
                   "token prompts, and the defaults become 128 new tokens, 1 and 8 clients, "
                   "batching on, 180 s windows, target-only batching on too")  # fmt: skip
    p.add_argument("--clients", default="1,4,8,16")
    p.add_argument("--window", type=float, default=None, help="seconds per run (30, or 180)")
    p.add_argument("--batching", default="off,on", help="scheduler modes to sweep")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 24 (short), 128")
    p.add_argument("--batch-on", type=int, default=16)
    p.add_argument("--no-baseline", action="store_true", help="skip the target-only runs")
    p.add_argument("--ratios", default="0.0,0.8", help="ratios for the ratio effect at 8 clients")
    p.add_argument("--ratio-repeats", type=int, default=2, help="alternations of --ratios")
    p.add_argument("--settle", type=float, default=8.0, help="untimed seconds after a switch")
    p.add_argument("--ratio-only", action="store_true", help="only the ratio effect at 8 clients")
    p.add_argument("--ratio-clients", default="8",
                   help="client counts for the ratio effect (e.g. 1,8)")  # fmt: skip
    p.add_argument("--gain-repeats", type=int, default=2,
                   help="extra alternated off/on windows at 8 clients (headline gain)")  # fmt: skip
    p.add_argument("--no-prefill-ab", action="store_true",
                   help="skip the fused-prefill on/off comparison at 8 clients")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="8 s windows, 1 and 8 clients")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = p.parse_args(argv)
    realistic = args.workload != "short"
    if args.max_new_tokens is None:
        args.max_new_tokens = 128 if realistic else 24
    if args.window is None:
        args.window = 180.0 if realistic else 30.0
    if realistic:  # long requests: the sweep that answers what users see
        args.clients = "1,8" if args.clients == "1,4,8,16" else args.clients
        args.batching = "on" if args.batching == "off,on" else args.batching
        args.gain_repeats, args.no_prefill_ab = 0, True
    if args.quick:
        args.window, args.clients, args.ratio_repeats, args.settle = 8.0, "1,8", 1, 4.0
        args.gain_repeats = 0
    levels = [int(c) for c in args.clients.split(",")]

    from slimspec.server.app import ServerConfig
    from slimspec.server.baseline import TargetOnlyEngine
    from slimspec.server.loading import default_loader, has_draft
    from slimspec.server.scheduler import SchedulerConfig
    from slimspec.server.service import Limits, ModelRef

    loaded: dict[str, Any] = {}

    def loader(ref: ModelRef) -> Any:
        # the target-only baseline reuses the decoder's target weights: one load for all runs
        if not has_draft(ref):
            dec = loaded["spec"]
            return TargetOnlyEngine(dec.target, dec.tokenizer)
        loaded["spec"] = default_loader(ref)
        return loaded["spec"]

    cfg = ServerConfig(
        model=ModelRef(
            args.target,
            args.draft,
            "bench",
            args.dtype,
            "cpu",
            draft_quantization=None
            if args.draft_quantization == "none"
            else args.draft_quantization,
            target_quantization=args.target_quantization,
        ),
        scheduler=SchedulerConfig(max_batch_size=1, max_queue=256, batch_wait_s=0.01),
        limits=Limits(request_timeout_s=3600),
        loader=loader,
        enable_gpu_metrics=False,
    )
    load_before = os.getloadavg()
    t0 = time.monotonic()
    base, app, _server = start_server(cfg)
    print(f"loaded and warmed in {time.monotonic() - t0:.0f}s", flush=True)
    global REQUESTS
    REQUESTS = workloads.requests_for(args.workload, loaded["spec"].tokenizer, args.max_new_tokens)
    target_form = loaded["spec"].target_form.describe()

    results: list[RunResult] = []
    sweep = {"off": (1, "speculative, batching off"),
             "on": (args.batch_on, "speculative, batching on")}  # fmt: skip
    for size, mode in () if args.ratio_only else [sweep[b] for b in args.batching.split(",")]:
        set_batch(app, size)
        for c in levels:
            results.append(measure(base, app, mode, c, args.window, args.max_new_tokens))
    # The headline gain: more windows of batching off and on at 8 clients, alternated,
    # so drift on a shared machine hits both alike (the sweep's windows count too).
    gain_windows: dict[str, list[float]] = {"off": [], "on": []}
    if 8 in levels and not args.ratio_only:
        for r in results:
            if r.clients == 8:
                gain_windows["on" if r.mode.endswith("on") else "off"].append(r.tokens_per_s)
        for _ in range(args.gain_repeats):
            for size, key in ((1, "off"), (args.batch_on, "on")):
                set_batch(app, size)
                mode = f"speculative, batching {key} (repeat)"
                w = measure(base, app, mode, 8, args.window, args.max_new_tokens)
                gain_windows[key].append(w.tokens_per_s)
    ratio_effect: dict[str, Any] = {}
    other_ratio_effects: dict[str, Any] = {}
    if 8 in levels or args.ratio_only:
        set_batch(app, args.batch_on)
        ratios = [float(x) for x in args.ratios.split(",")]
        for c in sorted(int(x) for x in args.ratio_clients.split(",")):
            effect = ratio_effect_runs(
                base, app, ratios, args.ratio_repeats, args.window, args.settle,
                args.max_new_tokens, c,
            )  # fmt: skip
            effect["best"] = metric_values(base, "slimspec_ratio_best").get("")
            effect["can_help"] = metric_values(base, "slimspec_compression_can_help").get("")
            if c == 8:
                ratio_effect = effect
            else:
                other_ratio_effects[f"ratio_effect_{c}_clients"] = effect
        set_ratio(app, 0.3)
    prefill_effect: dict[str, Any] = {}
    if 8 in levels and not args.ratio_only and not args.no_prefill_ab:
        set_batch(app, args.batch_on)
        prefill_effect = prefill_effect_runs(
            base, app, loaded["spec"], args.ratio_repeats, args.window, args.max_new_tokens
        )
    baseline: list[RunResult] = []
    if not args.no_baseline and not args.ratio_only:
        app.state.service.swap(replace(cfg.model, draft="none", version="target-only"))
        size, key = (args.batch_on, "on") if realistic else (1, "off")
        set_batch(app, size)
        for c in (1, 8):
            baseline.append(
                measure(base, app, f"target-only, batching {key}", c, args.window,
                        args.max_new_tokens)
            )  # fmt: skip

    def find(mode: str, c: int) -> RunResult | None:
        return next((r for r in results + baseline if r.mode == mode and r.clients == c), None)

    on8, off1 = find("speculative, batching on", 8), find("speculative, batching off", 1)
    before = find("target-only, batching off", 8) or find("target-only, batching off", 1)
    only_on = {c: find("target-only, batching on", c) for c in (1, 8)}
    spec_on = {c: find("speculative, batching on", c) for c in (1, 8)}
    vs_target_only = {}
    for c in (1, 8):
        spec, alone = spec_on[c], only_on[c]
        if spec and alone and alone.tokens_per_s:
            ratio = round(spec.tokens_per_s / alone.tokens_per_s, 3)
            vs_target_only[f"speculative_vs_target_only_{c}_clients"] = ratio
    mean_off = statistics.fmean(gain_windows["off"]) if gain_windows["off"] else 0.0
    summary: dict[str, Any] = {
        "throughput_gain_8_clients": round(statistics.fmean(gain_windows["on"]) / mean_off, 3)
        if mean_off and gain_windows["on"]
        else None,
        "throughput_8_clients_windows": gain_windows,
        "throughput_gain_8_clients_vs_one_client": round(on8.tokens_per_s / off1.tokens_per_s, 3)
        if on8 and off1 and off1.tokens_per_s
        else None,
        "p99_latency_s_8_clients": on8.p99_s if on8 else None,
        "ratio_effect_8_clients": ratio_effect,
        **other_ratio_effects,
        "ratio_prediction_error_8_clients": ratio_effect.get("prediction_error"),
        "fused_prefill_effect_8_clients": prefill_effect,
        **vs_target_only,
    }
    if before and on8:
        summary["seed_table"] = {
            "columns": [
                "metric",
                "before (target-only, one at a time)",
                "after (speculative + batching)",
                "improvement",
            ],
            "rows": [
                [
                    "mean latency (ms)",
                    round((before.mean_latency_s or 0) * 1000),
                    round((on8.mean_latency_s or 0) * 1000),
                    f"{100 * (1 - (on8.mean_latency_s or 0) / (before.mean_latency_s or 1)):.1f}%",
                ],
                [
                    "QPS",
                    before.qps,
                    on8.qps,
                    f"{100 * (on8.qps / before.qps - 1):.0f}%" if before.qps else None,
                ],
                ["tokens/s", before.tokens_per_s, on8.tokens_per_s, None],
            ],
            "clients": 8,
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        **summary,
        "settings": {
            "target": args.target,
            "draft": args.draft,
            "dtype": args.dtype,
            "draft_quantization": args.draft_quantization,
            "target_quantization": args.target_quantization,
            "target_form": target_form,
            "workload": args.workload,
            "prompt_tokens": sorted({r.prompt_tokens for r in REQUESTS}),
            "distinct_requests": len(REQUESTS),
            "device": "cpu",
            "window_s": args.window,
            "max_new_tokens": args.max_new_tokens,
            "batch_on": args.batch_on,
            "cpus": os.cpu_count(),
            "cpu_model": cpu_name(),
            "machine": platform.machine(),
            "note": "shared 2-core machine; other jobs may have run concurrently",
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "runs": [r.__dict__ for r in results + baseline],
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    plot(results, ratio_effect, out.with_suffix(".png"))
    print(json.dumps(summary, indent=2))
    app.state.service.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
