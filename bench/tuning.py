"""Latency-driven compression tuning, end to end, with a plot.

Real parts on loopback: kube-apiserver (+etcd, controller-manager), the tuning
controller as a kopf process, `slimspec serve` on SmolLM2-135M watching its
runtime ConfigMap, a real Prometheus scraping it, and HTTP load.

Scenario:
  warm-up   1 client, tuning off; the baseline p99 is measured
  calm      tuning on, target = TARGET_FACTOR x baseline: p99 is under it, the
            ratio walks down to minRatio (the safe side)
  surge     SURGE_CLIENTS clients: p99 crosses the target, the ratio rises
  outage    Prometheus stopped mid-surge: the tuner holds, MetricsAvailable=False
  resume    Prometheus back: decisions resume
  calm      1 client again: p99 falls under the band, the ratio comes back down

Writes bench/results/tuning.json (every 1 s sample, phase marks, the change
history from status) and bench/results/tuning.png.

Run: .venv/bin/python bench/tuning.py [--quick] [--crd PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kubernetes import client
from slimspec_testbed.control_plane import running_cluster
from slimspec_testbed.models import small_real_model
from slimspec_testbed.prometheus import PrometheusServer, scrape_config, scrape_job
from slimspec_testbed.resources import GROUP, PLURAL, VERSION, service_manifest
from slimspec_testbed.tools import REPO_ROOT, free_port, tool_path
from slimspec_testbed.tuning_scenario import (
    LoadGen,
    Recorder,
    engine_process,
    service_spec,
    tuner_process,
    wait_ready,
)

SVC = "chat"
NS = "bench-tuning"
TARGET_FACTOR = 1.6
SURGE_CLIENTS = 6
RESULTS = REPO_ROOT / "bench" / "results"


def prom_query(url: str):
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    scale = 0.5 if args.quick else 1.0
    t_start = time.monotonic()
    model = str(small_real_model())
    work = Path(tempfile.mkdtemp(prefix="bench-tuning-"))
    with running_cluster() as cluster:
        crd = args.crd or str(REPO_ROOT / "crds" / "slimspecservice.yaml")
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", crd)
        cluster.kubectl("wait", "--for=condition=Established", "crd/slimspecservices.slimspec.io")
        cluster.create_namespace(NS)
        api = cluster.api_client()
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        core.create_namespaced_config_map(
            NS,
            client.V1ConfigMap(
                metadata=client.V1ObjectMeta(name=f"{SVC}-runtime"),
                data={
                    "compression_ratio": "0.3",
                    "quality_threshold": "0.5",
                    "fallback_strategy": "none",
                },
            ),
        )
        port = free_port()
        engine = engine_process(port, NS, SVC, str(cluster.kubeconfig), work, model).start()
        engine_url = f"http://127.0.0.1:{port}"
        target = f"127.0.0.1:{port}"
        config = scrape_config([target], "1s")
        config["scrape_configs"] = [scrape_job(target, NS, SVC)]
        (work / "prom").mkdir()
        prom = PrometheusServer(tool_path("prometheus"), work / "prom", config)
        tuner = tuner_process(NS, cluster.env, work)
        load = LoadGen(engine_url, workers=1)
        try:
            wait_ready(f"{engine_url}/readyz", engine, timeout=300)
            log("engine ready", t_start)
            prom.start()
            spec = service_spec(
                prom.url,
                enabled=False,
                intervalSeconds=5,
                cooldownSeconds=10,
                latencyTargetSeconds=1.0,
            )
            manifest = service_manifest(SVC, NS, **spec)
            custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, manifest)
            q = spec["tuning"]["queries"]
            p99_q = q["p99Latency"].replace("{namespace}", NS).replace("{service}", SVC)
            rate_q = q["requestRate"].replace("{namespace}", NS).replace("{service}", SVC)
            query = prom_query(prom.url)
            rec = Recorder(api, NS, SVC, engine_url, query, p99_q, rate_q)
            tuner.start()
            load.start()
            rec.start()

            rec.mark("warm-up (1 client, tuning off)")
            time.sleep(45 * scale)
            samples = []
            for _ in range(5):
                v = query(p99_q)
                if v is not None:
                    samples.append(v)
                time.sleep(1)
            baseline = statistics.median(samples)
            target_s = round(TARGET_FACTOR * baseline, 3)
            log(f"baseline p99 {baseline:.3f}s -> target {target_s}s", t_start)
            patch = {"spec": {"tuning": {"enabled": True, "latencyTargetSeconds": target_s}}}
            custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, SVC, patch)

            rec.mark("calm (1 client)")
            time.sleep(60 * scale)
            rec.mark(f"surge ({SURGE_CLIENTS} clients)")
            load.workers = SURGE_CLIENTS - 1
            load.start()  # adds clients to the one already running
            time.sleep(70 * scale)
            rec.mark("Prometheus stopped")
            prom.stop()
            time.sleep(30 * scale)
            rec.mark("Prometheus back")
            prom.start()
            time.sleep(30 * scale)
            rec.mark("calm (1 client)")
            load.stop()
            load = LoadGen(engine_url, workers=1).start()
            time.sleep(120 * scale)
            rec.mark("end")
            rec.stop()
            body = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, SVC)
        finally:
            load.stop()
            tuner.stop()
            prom.stop()
            engine.stop()
        (work / "tuner.tail.log").write_text(tuner.log(20000))
    points = [asdict(p) for p in rec.points]
    return {
        "scenario": __doc__.split("Writes")[0].strip(),
        "model": "SmolLM2-135M-Instruct (self-drafting), float32, CPU, max batch 4",
        "baseline_p99_seconds": baseline,
        "latency_target_seconds": target_s,
        "tuning": spec["tuning"] | {"enabled": True, "latencyTargetSeconds": target_s},
        "phases": rec.events,
        "history": body.get("status", {}).get("compression", {}).get("history", []),
        "points": points,
        "requests": {"errors": load.errors},
        "workdir": str(work),
    }


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = data["points"]
    t = [p["t"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    ax1.plot(t, [p["p99"] for p in pts], label="p99 latency (Prometheus, 30 s window)")
    ax1.axhline(data["latency_target_seconds"], color="red", ls="--", label="target")
    lower = data["latency_target_seconds"] * (1 - data["tuning"]["deadBand"])
    ax1.axhline(lower, color="orange", ls=":", label="target - dead band")
    ax1.set_ylabel("seconds")
    ax1r = ax1.twinx()
    ax1r.plot(t, [p["request_rate"] for p in pts], color="gray", alpha=0.5, label="req/s")
    ax1r.set_ylabel("requests/s")
    ax2.step(t, [p["status_ratio"] for p in pts], where="post", label="status.compression.ratio")
    ax2.plot(
        t, [p["engine_ratio"] for p in pts], ".", ms=3, label="engine /metrics compression_ratio"
    )
    ax2.set_ylabel("compression ratio")
    ax2.set_xlabel("time (s)")
    for ax in (ax1, ax2):
        for start, end in _spans(pts, lambda p: p["metrics_available"] == "False"):
            ax.axvspan(start, end, color="red", alpha=0.12)
        for tp, _name in data["phases"]:
            ax.axvline(tp, color="k", lw=0.5, alpha=0.4)
    for tp, name in data["phases"]:
        ax2.text(tp, ax2.get_ylim()[1], name, rotation=90, va="top", fontsize=7)
    ax1.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    ax1.set_title("SlimSpec tuner: p99 vs target drives compression_ratio (red: Prometheus down)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Headline figures from the recorded points and the status history."""
    pts, hist = data["points"], data["history"]
    down = _spans(pts, lambda p: p["metrics_available"] == "False")
    held = [p["status_ratio"] for p in pts if p["metrics_available"] == "False"]
    lags = []
    for i in range(1, len(pts)):
        new, old = pts[i]["status_ratio"], pts[i - 1]["status_ratio"]
        if new is not None and old is not None and new != old:
            later = [p for p in pts[i:] if p["engine_ratio"] == new]
            if later:
                lags.append(round(later[0]["t"] - pts[i]["t"], 2))
    return {
        "ratio_changes_up": sum(1 for h in hist if h["to"] > h["from"]),
        "ratio_changes_down": sum(1 for h in hist if h["to"] < h["from"]),
        "ratio_range": [min(h["to"] for h in hist), max(h["to"] for h in hist)] if hist else None,
        "metrics_unavailable_spans_s": [[a, b] for a, b in down],
        "ratio_constant_while_unavailable": len(set(held)) <= 1,
        "engine_apply_lag_s": {
            "median": statistics.median(lags) if lags else None,
            "max": max(lags) if lags else None,
            "note": "status change seen -> engine /metrics shows it (1 s sampling)",
        },
        "request_errors": data["requests"]["errors"],
    }


def _spans(pts: list[dict[str, Any]], pred) -> list[tuple[float, float]]:
    spans, start = [], None
    for p in pts:
        if pred(p) and start is None:
            start = p["t"]
        elif not pred(p) and start is not None:
            spans.append((start, p["t"]))
            start = None
    if start is not None:
        spans.append((start, pts[-1]["t"]))
    return spans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="half-length phases")
    ap.add_argument("--crd", help="CRD file to apply (default: crds/slimspecservice.yaml)")
    ap.add_argument("--plot-only", action="store_true", help="re-plot the saved JSON")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "tuning.json"
    data = json.loads(out.read_text()) if args.plot_only else run(args)
    data["summary"] = summarize(data)
    out.write_text(json.dumps(data, indent=1))
    plot(data, RESULTS / "tuning.png")
    print(f"wrote {out} and {RESULTS / 'tuning.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
