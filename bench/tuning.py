"""The tuner on real engines where the compression knob helps and where it hurts.

Real parts on loopback: kube-apiserver (+etcd, controller-manager), the operator
as a kopf process, `slimspec serve` on the default Qwen2.5-Coder pair (1.5B target,
0.5B draft, bf16, its calibration artifact) watching its runtime ConfigMap and
exporting what each ratio costs and buys, a real Prometheus scraping it, and HTTP
load from a fixed number of clients.

Engine configurations, one after the other:
  helps   the default CPU engine (the target from its GGUF blocks, int4 draft with
          its head as int8 rows), the serving bench's eight short prompts, 3
          clients: the target verifies from 4-bit blocks, so the draft is a large
          share of a step, and the head keeps its acceptance on them, so a larger
          ratio makes drafting cheaper
  helps-from-off   the same, on a service deployed with compression off (ratio 0)
  helps-bf16   the draft in bf16 (bf16-fused), code traffic: its 151936 x 896 head
          is a larger share of a slower draft step (the configuration of the runs
          before the target's own form)
  hurts   the default CPU engine serving Perl, a language the head was not ranked
          on, with re-ranking off (the issue's Go case): the subset misses tokens
          the target emits, so a larger ratio costs acceptance
  aa      A/A: the target alone, where the ratio cannot matter

Each configuration, under constant load, from its start ratio (0.3, the default,
unless it says otherwise):
  warm-up    tuning off, the start ratio: the engine measures and predicts
  baseline   tuning off, the start ratio: latency measured
  tuning     tuning on, bounds [0, 0.95], target below the baseline p99, so the
             tuner wants a faster service and moves as the predictions say
  re-check   tuning off again (back at the start ratio): latency measured again
  paired     only where the tuner settled on another ratio: tuning off, the start
             ratio (A) and the settled one (B) in alternated windows ABBA BAAB

Figures (bench/results/tuning.json, plot tuning.png):
  tuner_latency_gain_when_knob_helps   mean latency per generated token at the start
                                       ratio / at the settled one - 1, from the paired
                                       windows (0 where the tuner ended where it
                                       started; `gain_unpaired`: the fixed phases'
                                       mean request latency / the tuned half's - 1)
  tuner_never_worse_when_knob_hurts    the tuner never raised the ratio there and
                                       its latency was not worse than fixed (+5 %)

  tuner_moves_in_a_a_run               (config aa) changes the tuner kept where the
                                       ratio cannot matter (aim 0), with every verdict
  tuner_latency_gain_when_knob_helps_runs   the gain of each run, with --merge

Run: .venv/bin/python bench/tuning.py [--quick] [--configs helps,hurts,aa] [--out DIR]
     [--merge] [--plot-only] [--resume WORKDIR]
     (configs: helps, helps-from-off, helps-bf16, hurts, aa; --resume takes the
     configurations an interrupted run finished from its work directory)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import serving as serving_bench  # bench/serving.py: cpu_name
import workloads  # bench/workloads.py: the serving bench's short prompts
from kubernetes import client
from slimspec.draft_head.corpus import heldout_texts
from slimspec_testbed.cluster.control_plane import running_cluster
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.models import real_model_pair
from slimspec_testbed.prometheus import PrometheusServer, scrape_config, scrape_job
from slimspec_testbed.scenarios.resources import (
    GROUP,
    PLURAL,
    VERSION,
    controlled_by,
    service_manifest,
)
from slimspec_testbed.scenarios.tuning import (
    LoadGen,
    Recorder,
    engine_process,
    service_spec,
    tuner_process,
    wait_ready,
)
from slimspec_testbed.tools import REPO_ROOT, free_port, tool_path

SVC = "chat"
RESULTS = REPO_ROOT / "bench" / "results"
CLIENTS = 3
PROMPT = "Write a Python function that returns the n-th Fibonacci number."
MAX_LENGTH = 24
ENGINE_THREADS = 2  # the Qwen pair on one thread is too slow for a few-minute phase
FIXED_RATIO = 0.3  # the default: baseline and re-check run at it
TARGET_FACTOR = 0.8  # latency target = this x baseline p99: the tuner wants faster
NOT_WORSE = 0.05  # "never worse": tuned mean latency within 5 % of fixed
CONFIGS: dict[str, dict[str, Any]] = {
    "helps": {
        "what": "Qwen2.5-Coder pair, the default CPU engine: target from its Q4_K GGUF "
        "blocks, int4 draft (head int8 rows), adaptive k; the serving bench's eight short "
        "prompts, 3 clients",
        "engine": {"dtype": "bfloat16", "draft_quantization": "auto", "num_draft_tokens": None},
        # On the Xeon with the K-quant panels 0.3 -> 0.9 served +5.8% at 3 clients and
        # +5.0% at 1 on these prompts (bench/results/serving_ratio_from_default_intel.json;
        # one repeated prompt: under 3 %), and 3 clients complete about three times the
        # requests a window: less noise.
        "prompts": "short",
        "clients": 3,
        # one trial straight to the predicted best: its whole effect in one verdict,
        # which is what stands above the paired windows' margin (3 % at least)
        "max_step": 0.6,
    },
    "helps-from-off": {
        "what": "as helps, on a service deployed with compression off (ratio 0): the "
        "tuner may turn it on",
        "engine": {"dtype": "bfloat16", "draft_quantization": "auto", "num_draft_tokens": None},
        # the same runs predicted 0 -> 0.9 at +10 % (1 client) and +12 % (3 clients)
        "prompts": "short",
        "clients": 3,
        "start_ratio": 0.0,
        "max_step": 0.9,
    },
    "helps-bf16": {
        "what": "Qwen2.5-Coder 1.5B target, 0.5B draft in bf16 (bf16-fused), adaptive k",
        "engine": {
            "dtype": "bfloat16",
            "draft_quantization": "bf16-fused",
            "num_draft_tokens": None,
        },
    },
    "hurts": {
        "what": "Qwen2.5-Coder pair, int4 draft (auto, the CPU default), adaptive k; Perl "
        "traffic (a language the head was not ranked on), re-ranking off",
        "engine": {"dtype": "bfloat16", "draft_quantization": "auto", "num_draft_tokens": None},
        "env": {"SLIMSPEC_HEAD_RERANK": "0"},  # the calibration ranking stays in force
        "prompts": "perl",
    },
    "aa": {
        "what": "A/A: the Qwen2.5-Coder 1.5B target alone (no draft), where the ratio "
        "cannot matter; tuning on for 20 minutes",
        "engine": {"dtype": "bfloat16", "num_draft_tokens": None},
        "draft": "none",
        "tuning_s": 1200,
    },
}
HELPS = ("helps", "helps-from-off", "helps-bf16")  # runs where the knob should pay
PROMPT_CHARS = 400  # a held-out prompt: about this many characters, whole lines
N_PROMPTS = 12
# Paired verdicts need whole windows (2 ticks spanning >= the cooldown) of A, B and A
# again: a 600 s phase fits several trials at a 15 s interval and a 60 s cooldown.
PHASES = {"warm-up": 60, "baseline": 60, "tuning": 600, "re-check": 60}
QUICK = {"warm-up": 30, "baseline": 25, "tuning": 100, "re-check": 25}
VERDICTS = ("ChangeConfirmed", "RevertedLatencyWorse", "RevertedNoGain", "Inconclusive")
# After the re-check, where the tuner settled on another ratio: the start ratio (A) and
# the settled one (B) in alternated windows, tuning off. ABBA BAAB: each half cancels a
# drift linear in time, the two halves a quadratic one.
PAIRED_ORDER = "ABBABAAB"
PAIRED_WINDOW_S, QUICK_PAIRED_WINDOW_S = 45, 20
PAIRED_SETTLE_S = 8  # requests that finish this soon after a switch are left out


def heldout_prompts(domain: str) -> list[str]:
    """N_PROMPTS snippets of whole lines spread over a held-out domain's text."""
    text = heldout_texts(400_000)[domain]
    step = max(1, len(text) // N_PROMPTS)
    out = []
    for i in range(N_PROMPTS):
        start = text.find("\n", i * step) + 1
        end = text.find("\n", start + PROMPT_CHARS)
        out.append(text[start : end if end > 0 else None])
    return out


def prom_query(url: str) -> Callable[[str], float | None]:
    import urllib.parse
    import urllib.request

    def query(promql: str) -> float | None:
        data = urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(f"{url}/api/v1/query?{data}", timeout=3) as resp:
                result = json.loads(resp.read())["data"]["result"]
        except OSError:
            return None
        value = float(result[0]["value"][1]) if result else None
        return None if value is None or value != value else value  # NaN -> None

    return query


def log(msg: str, t0: float) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)


def latency_stats(load: LoadGen, start: float, end: float) -> dict[str, Any]:
    """Client-side latency of the requests that finished in [start, end]."""
    xs = sorted(s for t, s in load.latencies if start <= t <= end)
    if not xs:
        return {"requests": 0}
    return {
        "requests": len(xs),
        "mean_s": round(statistics.fmean(xs), 4),
        "median_s": round(statistics.median(xs), 4),
        "p90_s": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 4),
    }


def run_config(
    cluster: KubeCluster, name: str, phases: dict[str, float], quick: bool, work: Path
) -> dict[str, Any]:
    t0 = time.monotonic()
    ns = f"bench-tuning-{name}"
    cluster.create_namespace(ns)
    api = cluster.api_client()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    data = {
        "compression_ratio": str(FIXED_RATIO),
        "quality_threshold": "0.5",
        "fallback_strategy": "none",
    }
    meta = client.V1ObjectMeta(name=f"{SVC}-runtime")
    cfg = CONFIGS[name]
    start_ratio = cfg.get("start_ratio", FIXED_RATIO)
    data["compression_ratio"] = str(start_ratio)
    core.create_namespaced_config_map(ns, client.V1ConfigMap(metadata=meta, data=data))
    port, pair = free_port(), real_model_pair()
    if "tuning_s" in cfg and not quick:
        phases = {**phases, "tuning": cfg["tuning_s"]}
    draft = cfg.get("draft", str(pair.draft))
    engine = engine_process(
        port, ns, SVC, str(cluster.kubeconfig), work, str(pair.target), draft=draft,
        name=f"engine-{name}", threads=ENGINE_THREADS, extra_env=cfg.get("env"),
        **cfg["engine"],
    )  # fmt: skip
    url, target = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    config = scrape_config([target], "1s")
    config["scrape_configs"] = [scrape_job(target, ns, SVC)]
    shutil.rmtree(work / f"prom-{name}", ignore_errors=True)  # an interrupted try's (--resume)
    (work / f"prom-{name}").mkdir()
    prom = PrometheusServer(tool_path("prometheus"), work / f"prom-{name}", config)
    tuner = tuner_process(ns, cluster.env, work)
    tuner.log_path = work / f"tuner-{name}.log"
    prompts = [PROMPT]
    if cfg.get("prompts") == "short":
        prompts = workloads.SHORT_PROMPTS
    elif "prompts" in cfg:
        prompts = heldout_prompts(cfg["prompts"])
    clients = cfg.get("clients", CLIENTS)
    load = LoadGen(url, workers=clients, max_length=MAX_LENGTH, prompts=prompts)
    spec = service_spec(
        "http://127.0.0.1:1",  # replaced below, once Prometheus has its port
        window="15s",
        enabled=False,
        intervalSeconds=5 if quick else 15,
        cooldownSeconds=20 if quick else 60,  # a verdict's window: >= the p99 window
        maxStep=cfg.get("max_step", 0.2 if quick else 0.1),
        latencyTargetSeconds=100.0,
    )
    spec["compression"] = {"ratio": start_ratio, "minRatio": 0.0, "maxRatio": 0.95}
    marks: dict[str, tuple[float, float]] = {}
    paired: list[tuple[float, float, float]] = []  # (ratio, start, end) of each window
    target_s, body = 0.0, {}
    try:
        engine.start()
        wait_ready(f"{url}/readyz", engine, timeout=400)
        log(f"{name}: engine ready", t0)
        prom.start()
        spec["prometheus"]["url"] = prom.url
        made = custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, service_manifest(SVC, ns, **spec)
        )
        # the ConfigMap becomes the resource's, as the reconciler would have made it (the
        # tuner writes only to objects its resource controls)
        owner = {"metadata": {"ownerReferences": controlled_by(made)}}
        core.patch_namespaced_config_map(f"{SVC}-runtime", ns, owner)
        q = spec["tuning"]["queries"]
        p99_q = q["p99Latency"].replace("{namespace}", ns).replace("{service}", SVC)
        rate_q = q["requestRate"].replace("{namespace}", ns).replace("{service}", SVC)
        query = prom_query(prom.url)
        rec = Recorder(api, ns, SVC, url, query, p99_q, rate_q)
        tuner.start()
        load.start()
        rec.start()
        baseline_p99: list[float] = []
        for phase, seconds in phases.items():
            rec.mark(phase)
            start = time.monotonic()
            if phase == "tuning":
                target_s = round(TARGET_FACTOR * statistics.median(baseline_p99), 3)
                log(f"{name}: baseline p99 {statistics.median(baseline_p99):.3f}s", t0)
                patch = {"spec": {"tuning": {"enabled": True, "latencyTargetSeconds": target_s}}}
                custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, SVC, patch)
            elif phase == "re-check":
                patch = {"spec": {"tuning": {"enabled": False}}}
                custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, SVC, patch)
                # The ConfigMap is the bench's (the reconciler, which would write the
                # spec's ratio back, leaves an object it does not own alone): put the
                # fixed ratio back for the re-check, as the reconciler would.
                fixed = {"data": {"compression_ratio": str(start_ratio)}}
                core.patch_namespaced_config_map(f"{SVC}-runtime", ns, fixed)
            while time.monotonic() - start < seconds:
                time.sleep(1)
                half_way = time.monotonic() - start > seconds / 2
                if phase == "baseline" and half_way and (v := query(p99_q)) is not None:
                    baseline_p99.append(v)
            marks[phase] = (start, time.monotonic())
            if phase == "tuning":  # the tuner's status, before tuning off gives it back
                body = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, SVC)
            log(f"{name}: {phase} done", t0)
        settled = settled_ratio(body)
        if settled is not None and abs(settled - start_ratio) > 1e-9:
            rec.mark("paired")
            seconds = QUICK_PAIRED_WINDOW_S if quick else PAIRED_WINDOW_S
            for ab in PAIRED_ORDER:
                r = start_ratio if ab == "A" else settled
                ratio_data = {"data": {"compression_ratio": str(r)}}
                core.patch_namespaced_config_map(f"{SVC}-runtime", ns, ratio_data)
                start = time.monotonic()
                time.sleep(seconds)
                paired.append((r, start, time.monotonic()))
            log(f"{name}: paired {start_ratio:g} / {settled:g} done", t0)
        rec.stop()
    finally:
        load.stop()
        tuner.stop()
        prom.stop()
        engine.stop()
    summary = summarize_config(name, rec, load, marks, body, target_s, start_ratio)
    summary |= paired_gain(load, paired, start_ratio, summary)
    return {**summary, "clients": clients, "max_step": spec["tuning"]["maxStep"]}


def settled_ratio(body: dict[str, Any]) -> float | None:
    """The ratio the tuner had settled on when tuning stopped: the one in status, or,
    with a trial under way, the ratio it started from (its last kept one)."""
    comp = (body.get("status") or {}).get("compression") or {}
    trial = comp.get("trial")
    if trial:
        return float(trial["from"])
    return float(comp["ratio"]) if comp.get("ratio") is not None else None


def paired_gain(
    load: LoadGen,
    windows: list[tuple[float, float, float]],
    start_ratio: float,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """The gain from alternated windows of the start ratio and the settled one: mean
    latency per generated token (sum of latencies / sum of tokens of the requests
    served at the window's ratio) at the start ratio over that at the settled one,
    minus 1, with its standard error from the spread of the windows' means. No
    windows (the tuner ended where it started): no move, a gain of 0.
    `gain_unpaired` keeps the comparison of the fixed phases with the tuned half."""
    out: dict[str, Any] = {"gain_unpaired": summary["gain"]}
    if not windows:
        out |= {"gain": 0.0, "gain_basis": "no move: the tuner ended at the start ratio"}
        return out
    parts = []
    for ratio, a, b in windows:
        recs = [
            x for x in load.served
            if a + PAIRED_SETTLE_S <= x[0] <= b and abs(x[3] - ratio) < 1e-6
        ]  # fmt: skip
        tokens, seconds = sum(x[2] for x in recs), sum(x[1] for x in recs)
        parts.append({
            "ratio": ratio, "requests": len(recs), "tokens": tokens, "seconds": round(seconds, 3),
            "s_per_token": round(seconds / tokens, 5) if tokens else None,
        })  # fmt: skip

    def pooled(at_start: bool) -> tuple[float, list[float]]:
        mine = [p for p in parts if (abs(p["ratio"] - start_ratio) < 1e-9) == at_start]
        means = [p["s_per_token"] for p in mine if p["s_per_token"]]
        tokens = sum(p["tokens"] for p in mine)
        seconds = sum(p["seconds"] for p in mine)
        return seconds / tokens, means

    (a, a_means), (b, b_means) = pooled(True), pooled(False)
    va = statistics.variance(a_means) / len(a_means)  # of the pooled means, roughly
    vb = statistics.variance(b_means) / len(b_means)
    se = math.sqrt(va / b**2 + vb * a**2 / b**4)  # of a / b, to first order
    out |= {
        "gain": round(a / b - 1.0, 4),
        "gain_se": round(se, 4),
        "gain_basis": f"alternated windows {PAIRED_ORDER} of the start ratio (A) and the "
        "settled one (B), tuning off: mean latency per generated token",
        "paired_s_per_token": {"start": round(a, 5), "settled": round(b, 5)},
        "paired_windows": parts,
    }
    return out


def summarize_config(
    name: str,
    rec: Recorder,
    load: LoadGen,
    marks: dict[str, tuple[float, float]],
    body: dict[str, Any],
    target_s: float,
    start_ratio: float,
) -> dict[str, Any]:
    status = body.get("status") or {}
    comp = status.get("compression") or {}
    # Judge the tuned ratio on the second half of the tuning phase (after the moves).
    t_start, t_end = marks["tuning"]
    tuned = latency_stats(load, (t_start + t_end) / 2, t_end)
    settle = 10.0  # skip the first seconds of a fixed phase: the ratio is being applied
    fixed = [latency_stats(load, a + settle, b) for a, b in (marks["baseline"], marks["re-check"])]
    fixed_mean = statistics.fmean(f["mean_s"] for f in fixed if f.get("requests"))
    tuning_pts = [p for p in rec.points if p.phase == "tuning" and p.status_ratio is not None]
    ratios = [p.status_ratio for p in tuning_pts]
    # each verdict once, when the last decision's reason turns to it
    reasons = [p.reason for p in tuning_pts]
    turned = [r for i, r in enumerate(reasons) if r in VERDICTS and (i == 0 or reasons[i - 1] != r)]
    changes = sum(1 for a, b in itertools.pairwise(ratios) if abs(a - b) > 1e-9)
    effective = next(
        (c for c in status.get("conditions") or [] if c["type"] == "CompressionEffective"), {}
    )
    return {
        "what": CONFIGS[name]["what"],
        "latency_target_seconds": target_s,
        "fixed_ratio": start_ratio,
        "fixed": fixed,
        "tuned": tuned,
        "gain": round(fixed_mean / tuned["mean_s"] - 1.0, 4) if tuned.get("requests") else None,
        "ratio_end": ratios[-1] if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "raised": any(r > start_ratio + 1e-9 for r in ratios),
        "phase_seconds": {k: round(b - a, 1) for k, (a, b) in marks.items()},
        "verdicts": {v: turned.count(v) for v in VERDICTS},
        "moves_kept": turned.count("ChangeConfirmed"),
        "ratio_changes": changes,
        "compression_effective": {k: effective.get(k) for k in ("status", "reason", "message")},
        "predictions": comp.get("predictions"),
        "history": comp.get("history", []),
        "last_trial": comp.get("lastTrial"),
        "phases": rec.events,
        "points": [asdict(p) for p in rec.points],
        "t0": rec.t0,
        "requests": {"done": load.done, "errors": load.errors},
        "latencies": [(round(t - rec.t0, 2), round(s, 4)) for t, s in load.latencies],
    }


def figures(configs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    helps = [n for n in HELPS if n in configs]
    if helps:
        c = configs[helps[0]]
        out["tuner_latency_gain_when_knob_helps"] = c["gain"]
        out["tuner_raised_when_knob_helps"] = c["raised"]
    if "hurts" in configs:
        c = configs["hurts"]
        not_worse = c["gain"] is not None and c["gain"] >= -NOT_WORSE
        out["tuner_never_worse_when_knob_hurts"] = (not c["raised"]) and not_worse
        out["tuner_raised_when_knob_hurts"] = c["raised"]
        out["latency_change_when_knob_hurts"] = c["gain"]
    if "aa" in configs:
        c = configs["aa"]
        out["tuner_moves_in_a_a_run"] = c["moves_kept"]
        out["a_a_verdicts"] = c["verdicts"]
        out["a_a_ratio_changes"] = c["ratio_changes"]
        out["a_a_tuning_s"] = c["phase_seconds"]["tuning"]
    return out


def ratio_prediction_errors(results: Path) -> dict[str, Any]:
    """The engines' predicted ratio effect against the served one, from every saved
    `bench/serving.py` ratio run (alternated windows of two ratios): each run's
    |predicted - measured| / measured per client count, and the worst at 8 clients."""
    runs = []
    for path in sorted(results.glob("serving*.json")):
        doc = json.loads(path.read_text())
        settings = doc.get("settings", {})
        for key, effect in doc.items():
            if not key.startswith("ratio_effect_") or not isinstance(effect, dict):
                continue
            if effect.get("prediction_error") is None:
                continue
            ratios = [k for k in effect if k[:1].isdigit()]  # in the order they ran
            runs.append({
                "file": path.name, "clients": effect.get("clients"), "ratios": ratios,
                "measured": effect[ratios[-1]]["measured_vs_first"],
                "predicted": effect[ratios[-1]]["predicted_vs_first"],
                "error": effect["prediction_error"], "cpu": settings.get("cpu_model"),
            })  # fmt: skip
    eight = [r["error"] for r in runs if r["clients"] == 8]
    return {
        "ratio_prediction_error_8_clients": max(eight) if eight else None,
        "ratio_prediction_errors": runs,
    }


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["configs"])
    fig, axes = plt.subplots(2, len(names), figsize=(7 * len(names), 7), squeeze=False)
    for col, name in enumerate(names):
        c = data["configs"][name]
        pts = c["points"]
        t = [p["t"] for p in pts]
        top, bottom = axes[0][col], axes[1][col]
        lat = c["latencies"]
        top.plot([x for x, _ in lat], [y for _, y in lat], ".", ms=2, alpha=0.4, label="request")
        top.plot(t, [p["p99"] for p in pts], label="p99 (Prometheus, 15 s window)")
        top.axhline(c["latency_target_seconds"], color="red", ls="--", label="target (tuning)")
        top.set_ylabel("seconds")
        what = textwrap.fill(f"knob {name}: {c['what']}", 70)
        top.set_title(f"{what}\ngain vs fixed {c['fixed_ratio']:g}: {c['gain']}", fontsize=9)
        bottom.step(t, [p["status_ratio"] for p in pts], where="post", label="status ratio")
        bottom.plot(t, [p["engine_ratio"] for p in pts], ".", ms=2, label="engine ratio")
        bottom.set_ylabel("compression ratio")
        bottom.set_xlabel("time (s)")
        bottom.set_ylim(-0.02, 1.0)
        for ax in (top, bottom):
            for tp, phase in c["phases"]:
                ax.axvline(tp, color="k", lw=0.5, alpha=0.4)
                if ax is bottom:
                    ax.text(tp, 0.97, phase, rotation=90, va="top", fontsize=7)
            ax.legend(loc="upper left", fontsize=7)
    fig.suptitle("SlimSpec tuner: moves the ratio only where the engine predicts it pays")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases, bigger steps")
    ap.add_argument("--configs", default="helps,hurts", help="which configurations to run")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for tuning.json/png")
    ap.add_argument("--crd", help="CRD file to apply (default: crds/slimspecservice.yaml)")
    ap.add_argument("--plot-only", action="store_true", help="re-plot the saved JSON")
    ap.add_argument(
        "--resume",
        type=Path,
        help="work directory of an interrupted run: the configurations it finished "
        "(config-NAME.json there) are taken from it, not run again",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the saved configurations not run now, and add this run's gain where the "
        "knob helps to the saved list of runs (tuner_latency_gain_when_knob_helps_runs)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "tuning.json"
    if args.plot_only:
        data = json.loads(out.read_text())
    else:
        names = [n for n in args.configs.split(",") if n]
        phases = QUICK if args.quick else PHASES
        work = args.resume or Path(tempfile.mkdtemp(prefix="bench-tuning-"))
        # each finished configuration is saved at once: a run stopped later keeps it
        configs: dict[str, Any] = {
            n: json.loads((work / f"config-{n}.json").read_text())
            for n in names
            if (work / f"config-{n}.json").exists()
        }
        with running_cluster() as cluster:
            crd = args.crd or str(REPO_ROOT / "crds" / "slimspecservice.yaml")
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", crd)
            crd_name = "crd/slimspecservices.slimspec.io"
            cluster.kubectl("wait", "--for=condition=Established", crd_name)
            for name in names:
                if name in configs:
                    print(f"{name}: taken from {work}", flush=True)
                    continue
                configs[name] = run_config(cluster, name, phases, args.quick, work)
                saved = work / f"config-{name}.json"
                saved.write_text(json.dumps(configs[name], indent=1))
                print(f"{name}: saved {saved}", flush=True)
        data = {
            "scenario": __doc__.split("Figures")[0].strip(),
            "quick": args.quick,
            "clients": CLIENTS,  # configurations may set their own (per config)
            "max_length": MAX_LENGTH,
            "phases_s": phases,
            "configs": configs,
            "workdir": str(work),
        }
    runs_key, detail_key = "tuner_latency_gain_when_knob_helps_runs", "knob_helps_runs"
    runs: list[float] = []
    detail: list[dict[str, Any]] = []
    if (args.merge and out.exists()) or args.plot_only:
        saved = data if args.plot_only else json.loads(out.read_text())
        runs = list(saved.get("figures", {}).get(runs_key, []))
        detail = list(saved.get("figures", {}).get(detail_key, []))
        data["configs"] = {**saved.get("configs", {}), **data["configs"]}
    ran_now = [] if args.plot_only else [n for n in HELPS if n in args.configs.split(",")]
    for name in ran_now:  # each helps run adds its gain, and what it ran on
        c = data["configs"][name]
        runs.append(c["gain"])
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        detail.append({"config": name, "gain": c["gain"], "gain_se": c.get("gain_se"),
                       "gain_unpaired": c.get("gain_unpaired"), "what": c["what"],
                       "clients": c["clients"], "ratio_end": c["ratio_end"],
                       "fixed_mean_s": [f.get("mean_s") for f in c["fixed"]],
                       "tuned_mean_s": c["tuned"].get("mean_s"), "history": c["history"],
                       "cpu": serving_bench.cpu_name(), "utc": when})  # fmt: skip
    data["figures"] = {**figures(data["configs"]), **ratio_prediction_errors(RESULTS)}
    if runs:
        data["figures"][runs_key] = runs
        data["figures"][detail_key] = detail
        # the runs whose gain comes from the paired windows (those before had none), by
        # configuration, in the order they ran
        paired_runs: dict[str, list[float]] = {}
        for d in detail:
            if "gain_unpaired" in d:
                paired_runs.setdefault(d["config"], []).append(d["gain"])
        data["figures"][runs_key + "_paired"] = paired_runs
    out.write_text(json.dumps(data, indent=1))
    plot(data, args.out / "tuning.png")
    print(json.dumps(data["figures"], indent=1))
    print(f"wrote {out} and {args.out / 'tuning.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
