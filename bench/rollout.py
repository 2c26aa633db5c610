"""Rollouts on the real node: apply -> first token through the Service, and a model
version change under load.

    .venv/bin/python bench/rollout.py [--runs 2] [--clients 4] [--replicas 2]
        [--out bench/results/rollout.json]

Everything is real (slimspec_testbed.node.node_cluster): kubelet + containerd + kube-proxy, the
operator installed by helm from its built image, engine pods from the built engine
image on the small real model (SmolLM2-135M drafting for itself, CPU) mounted from a
PersistentVolume, requests through the Service's ClusterIP.

Measured:
- apply_to_first_token_s: `kubectl apply` of examples/slimspecservice-minimal.yaml
  (small pair, `--replicas` replicas) until the first /infer through the Service
  returns a token (image already in the node's runtime; model load and warm-up
  included);
- per rollout: `--clients` clients post /infer (4 tokens) back to back through the
  Service, each on its own keep-alive connection; after a steady-state window the
  model version changes; rollout_under_load_s runs from `kubectl apply` until the new
  version serves alone (old pods drained and gone). Every failed request counts
  (refused, reset, timeout, 5xx, other), over the whole run; p50/p99 latency during
  the rollout against the steady state before it.
Results: JSON (medians over runs, every sample) and a plot of request latency over
time with the rollout windows and the failures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from slimspec_testbed.models import small_real_model
from slimspec_testbed.node.node_cluster import NodeCluster, running_node_cluster
from slimspec_testbed.scenarios.resources import service_from_example, with_version
from slimspec_testbed.scenarios.userpath import (
    CHART,
    ENGINE_SELECTOR,
    OPERATOR_NAMESPACE,
    RELEASE,
    SERVICE_NAMESPACE,
    LoadClients,
    Result,
    cluster_ip,
    latencies,
    models_volume,
    models_volume_dir,
    operator_values,
    percentile,
    served,
    summary,
    wait_pods_ready,
    wait_until,
)
from slimspec_testbed.tools import Helm, helm_env, tool_path

ROOT = Path(__file__).resolve().parents[1]
NAME = "chat"
STEADY_S = 30
AFTER_S = 5


def first_token(url: str, timeout: float) -> float:
    """Seconds until /infer through the Service returns a token."""
    t0 = time.monotonic()

    def answered() -> bool:
        resp = httpx.post(f"{url}/infer", json={"input": "Hello", "max_length": 1}, timeout=30)
        return resp.status_code == 200 and bool(resp.json().get("output"))

    wait_until(answered, timeout, "the first token through the Service", interval=0.2)
    return time.monotonic() - t0


def rollout_run(
    node: NodeCluster, body: dict[str, Any], version: str, url: str, clients: int, t_ref: float
) -> tuple[dict[str, Any], list[Result]]:
    kube = node.cluster
    load = LoadClients(url, clients=clients).start()
    try:
        load.wait_for_requests(2 * clients, 300)
        steady_from = time.monotonic()
        time.sleep(STEADY_S)
        t0 = time.monotonic()
        kube.apply(with_version(body, version))
        wait_until(lambda: served(kube, NAME, version), 900, f"{version} served alone")
        t1 = time.monotonic()
        time.sleep(AFTER_S)
    finally:
        load.stop()
    results = load.snapshot()
    steady, during = latencies(load.between(steady_from, t0)), latencies(load.between(t0, t1))
    s = summary(results)
    failed = [r for r in results if not r.ok]
    return {
        "version": version,
        "rollout_under_load_s": round(t1 - t0, 2),
        "rollout_window_s": [round(t0 - t_ref, 2), round(t1 - t_ref, 2)],
        "requests_total": s["requests"],
        "requests_during_rollout": len(load.between(t0, t1)),
        "failed_requests": s["failed"],
        "failures_by_kind": {k: v for k, v in s["by_kind"].items() if k != "ok"},
        # When failures happened, from the rollout's start (a client retries after
        # 0.2 s on its own connection, so one stuck connection fails many times).
        "failure_window_s": [
            round(min(r.start for r in failed) - t0, 2),
            round(max(r.end for r in failed) - t0, 2),
        ]
        if failed
        else None,
        "first_failure_of_each_kind": s["first_failure_of_each_kind"],
        "latency_steady_p50_s": percentile(steady, 0.5),
        "latency_steady_p99_s": percentile(steady, 0.99),
        "latency_rollout_p50_s": percentile(during, 0.5),
        "latency_rollout_p99_s": percentile(during, 0.99),
    }, results


def plot(path: Path, points: list[tuple[float, float, bool]], windows: list[list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (start, end) in enumerate(windows):
        ax.axvspan(start, end, color="tab:orange", alpha=0.2, label="rollout" if i == 0 else None)
    ok = [(t, lat) for t, lat, good in points if good]
    bad = [(t, lat) for t, lat, good in points if not good]
    if ok:
        ax.scatter(*zip(*ok, strict=True), s=6, color="tab:blue", label="request (ok)")
    if bad:
        ax.scatter(*zip(*bad, strict=True), s=18, color="tab:red", marker="x", label="failed")
    ax.set_xlabel("time since the first rollout run started (s)")
    ax.set_ylabel("request latency (s)")
    ax.set_title("/infer through the Service during model version changes (real node)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout.json")
    args = ap.parse_args()

    model = small_real_model()
    with running_node_cluster() as node, node.entered():
        kube = node.cluster
        kube.apply(models_volume(models_volume_dir(model)))
        values = node.node_dir / "operator-values.yaml"
        values.write_text(yaml.safe_dump(operator_values(node.images)))
        helm = Helm(path=tool_path("helm"), env=helm_env(kube.env, node.node_dir / "helm"))
        helm("install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
             "-f", str(values), "--wait", "--timeout", "5m", timeout=360)  # fmt: skip

        body = service_from_example(
            node.images, f"models/{model.name}", name=NAME, replicas=args.replicas
        )
        t0 = time.monotonic()
        kube.apply(body)
        ip = wait_until(lambda: cluster_ip(kube, SERVICE_NAMESPACE, NAME), 120, "the Service")
        url = f"http://{ip}:8080"
        apply_to_first_token = (time.monotonic() - t0) + first_token(url, 900)
        wait_pods_ready(kube, SERVICE_NAMESPACE, f"{ENGINE_SELECTOR}", 900, count=args.replicas)

        runs, points = [], []
        t_ref = time.monotonic()
        for i in range(args.runs):
            run, results = rollout_run(node, body, f"v{i + 2}", url, args.clients, t_ref)
            print(json.dumps(run), flush=True)
            runs.append(run)
            points += [(r.start - t_ref, r.end - r.start, r.ok) for r in results]

    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    out = {
        "apply_to_first_token_s": round(apply_to_first_token, 2),
        "rollout_under_load_s": round(med("rollout_under_load_s"), 2),
        "rollout_failed_requests": sum(r["failed_requests"] for r in runs),
        "clients": args.clients,
        "requests_total": sum(r["requests_total"] for r in runs),
        "requests_during_rollouts": sum(r["requests_during_rollout"] for r in runs),
        "latency_steady_p50_s": med("latency_steady_p50_s"),
        "latency_steady_p99_s": med("latency_steady_p99_s"),
        "latency_rollout_p50_s": med("latency_rollout_p50_s"),
        "latency_rollout_p99_s": med("latency_rollout_p99_s"),
        "runs": runs,
        "setup": {
            "node": "real: kubelet + containerd 1.6 + runc + CNI bridge + kube-proxy (iptables), "
            "control plane with scheduler and node lifecycle, Kubernetes v1.36.3",
            "operator": "helm install charts/slimspec, built operator image",
            "engine": f"built engine image, {model.name} drafting for itself, CPU, bfloat16",
            "replicas": args.replicas,
            "request": "/infer, 4 new tokens, one keep-alive connection per client",
            "steady_state_window_s": STEADY_S,
            "node_timings_s": {k: round(v, 1) for k, v in node.timings.items()},
            "machine": f"{platform.machine()}, 2 CPUs shared with other builds",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    plot(args.out.with_suffix(".png"), points, [r["rollout_window_s"] for r in runs])
    print(json.dumps({k: v for k, v in out.items() if k not in ("runs", "setup")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
