"""Scaling on the two real nodes: the operator's autoscaler under real traffic, and a
node drain under load.

    .venv/bin/python bench/scaling.py [--clients 4] [--trickle-think 6] [--no-keda]
        [--out bench/results/scaling.json]

Everything is real (slimspec_testbed.node.node_cluster with two nodes, each its own
kubelet + containerd + kube-proxy): the operator installed by helm from its built
image, Prometheus in the cluster finding the engines by pod discovery, engine pods
from the built engine image on the small real model (SmolLM2-135M drafting for
itself, CPU), requests through the Service's ClusterIP
(slimspec_testbed.scenarios.scaling).

Measured:
- scale_up_s: `--clients` clients start posting /infer (4 tokens) back to back ->
  the replica the autoscaler added (autoscaling.mode operator, targetRequestsPerReplica
  0.5, maxReplicas 2) is Ready and has served requests;
- scale_down_s: the load drops to one client every `--trickle-think` seconds -> one
  engine pod left (stabilisation window 30 s, the removed pod drained and gone);
- drain: `kubectl drain` of the second node while `--clients` clients send requests
  to 2 replicas (one per node); the replacement starts on the first node;
- keda_*: the same load cycle on a resource in autoscaling.mode keda (KEDA built
  from its Go module: the ScaledObject the operator writes, KEDA's HPA on the
  external metric through the aggregation layer); `--no-keda` skips it.
Every failed request counts (refused, reset, timeout, 5xx, other). Results: JSON
and a plot of replicas, ready pods and request latency over time.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path
from typing import Any

import serving as serving_bench  # bench/serving.py: cpu_name
import yaml
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.models import small_real_model
from slimspec_testbed.node.images import ImageTags
from slimspec_testbed.node.node_cluster import running_node_cluster
from slimspec_testbed.scenarios.keda import (
    install_keda,
    keda_mode,
    replica_writers,
    scaled_object_ready,
)
from slimspec_testbed.scenarios.scaling import (
    apply_and_wait,
    autoscaled_service,
    delete_service,
    drain_under_load,
    fixed_replicas,
    scale_cycle,
    wait_one_per_node,
)
from slimspec_testbed.scenarios.userpath import (
    CHART,
    OPERATOR_NAMESPACE,
    PROMETHEUS_NAMESPACE,
    RELEASE,
    SERVICE_NAMESPACE,
    cluster_ip,
    models_volume,
    models_volume_dir,
    operator_values,
    prometheus_manifests,
    wait_pods_ready,
    wait_until,
)
from slimspec_testbed.tools import Helm, helm_env, tool_path

ROOT = Path(__file__).resolve().parents[1]
NAME = "scale"
KEDA_NAME = "scale-keda"


def plot(path: Path, runs: list[tuple[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6), sharex="col")
    for col, (title, run) in enumerate(runs):
        top, bottom = axes[0][col], axes[1][col]
        rows = run["timeline"]
        t = [r["t"] for r in rows]
        if "spec_replicas" in rows[0]:
            top.step(t, [r["spec_replicas"] for r in rows], where="post", label="spec.replicas")
        top.step(t, [r["ready"] for r in rows], where="post", label="ready engine pods")
        top.step(t, [r["pods"] for r in rows], where="post", linestyle=":", label="engine pods")
        top.set_ylabel("pods")
        top.set_title(title)
        top.legend(loc="upper right")
        ok = [(p["t"], p["latency_s"]) for p in run["latencies"] if p["ok"]]
        bad = [(p["t"], p["latency_s"]) for p in run["latencies"] if not p["ok"]]
        if ok:
            bottom.scatter(*zip(*ok, strict=True), s=4, label="request (ok)")
        if bad:
            bottom.scatter(*zip(*bad, strict=True), s=18, color="tab:red", marker="x",
                           label="failed")  # fmt: skip
        bottom.set_xlabel("seconds since the load started")
        bottom.set_ylabel("request latency (s)")
        bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def keda_cycle(
    kube: KubeCluster, images: ImageTags, model_path: str, prometheus: str, args: Any
) -> dict[str, Any]:
    """KEDA installed, a resource in autoscaling.mode keda, the same load cycle."""
    install_keda(kube, images)
    body = keda_mode(autoscaled_service(images, model_path, prometheus, name=KEDA_NAME))
    apply_and_wait(kube, body)
    wait_until(lambda: scaled_object_ready(kube, KEDA_NAME), 180, "ScaledObject Ready", 1.0)
    url = f"http://{cluster_ip(kube, SERVICE_NAMESPACE, KEDA_NAME)}:8080"
    result = scale_cycle(kube, KEDA_NAME, url, clients=args.clients,
                         trickle_think_s=args.trickle_think)  # fmt: skip
    return {**result, "replica_writers": sorted(replica_writers(kube, KEDA_NAME))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--trickle-think", type=float, default=6.0)
    ap.add_argument("--no-keda", action="store_true", help="skip the KEDA-mode cycle")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scaling.json")
    args = ap.parse_args()

    model = small_real_model()
    with running_node_cluster(nodes=2) as node, node.entered():
        kube = node.cluster
        kube.apply(models_volume(models_volume_dir(model)))
        values = node.node_dir / "operator-values.yaml"
        values.write_text(yaml.safe_dump(operator_values(node.images)))
        helm = Helm(path=tool_path("helm"), env=helm_env(kube.env, node.node_dir / "helm"))
        helm("install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
             "-f", str(values), "--wait", "--timeout", "5m", timeout=360)  # fmt: skip
        kube.apply(prometheus_manifests(node.images))
        wait_pods_ready(kube, PROMETHEUS_NAMESPACE, "app.kubernetes.io/name=prometheus", 180)
        prometheus = f"http://{cluster_ip(kube, PROMETHEUS_NAMESPACE, 'prometheus')}:9090"

        body = autoscaled_service(node.images, f"models/{model.name}", prometheus, name=NAME)
        apply_and_wait(kube, body)
        url = f"http://{cluster_ip(kube, SERVICE_NAMESPACE, NAME)}:8080"
        cycle = scale_cycle(kube, NAME, url, clients=args.clients,
                            trickle_think_s=args.trickle_think)  # fmt: skip
        print(json.dumps({k: v for k, v in cycle.items() if k not in ("timeline", "latencies")}))

        kube.apply(fixed_replicas(body, 2))
        wait_one_per_node(kube, NAME, 2)
        drain = drain_under_load(kube, NAME, url, node.nodes[1].name, clients=args.clients)
        print(json.dumps({k: v for k, v in drain.items() if k not in ("timeline", "latencies")}))
        keda: dict[str, Any] | None = None
        if not args.no_keda:
            delete_service(kube, NAME)
            keda = keda_cycle(kube, node.images, f"models/{model.name}", prometheus, args)
            print(json.dumps({k: v for k, v in keda.items() if k not in ("timeline", "latencies")}))
        timings = {k: round(v, 1) for k, v in node.timings.items()}

    out = {
        "scale_up_s": cycle["scale_up_s"],
        "scale_down_s": cycle["scale_down_s"],
        "scale_failed_requests": cycle["scale_failed_requests"],
        "drain_failed_requests": drain["drain_failed_requests"],
        "clients": args.clients,
        "requests_total": cycle["requests_total"]
        + drain["requests_total"]
        + (keda["requests_total"] if keda else 0),
        "replica_asked_s": cycle["replica_asked_s"],
        "replica_ready_s": cycle["replica_ready_s"],
        "drain_s": drain["drain_s"],
        "drain_replacement_ready_s": drain["replacement_ready_s"],
        "second_eviction_statuses": drain["second_eviction_statuses"],
        "nodes_at_two_replicas": cycle["nodes_at_two_replicas"],
        **(
            {
                "keda_scale_up_s": keda["scale_up_s"],
                "keda_scale_down_s": keda["scale_down_s"],
                "keda_scale_failed_requests": keda["scale_failed_requests"],
                "keda_replica_writers": keda["replica_writers"],
            }
            if keda
            else {}
        ),
        "scale_cycle": cycle,
        "drain": drain,
        "keda_cycle": keda,
        "setup": {
            "nodes": "two real nodes (kubelet + containerd 1.6 + runc + CNI bridge + "
            "kube-proxy each, joined by a veth link), one control plane, Kubernetes v1.36.3",
            "operator": "helm install charts/slimspec, built operator image",
            "autoscaling": body["spec"]["autoscaling"],
            "prometheus": "in the cluster, Kubernetes pod discovery, 2 s scrapes",
            "engine": f"built engine image, {model.name} drafting for itself, CPU",
            "request": "/infer, 4 new tokens, one keep-alive connection per client",
            "trickle_think_s": args.trickle_think,
            "node_timings_s": timings,
            "cpu": serving_bench.cpu_name(),
            "machine": f"{platform.machine()}, 2 CPUs shared by both nodes",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    runs = [
        ("operator autoscaler: load, then a trickle", cycle),
        ("drain of the second node", drain),
    ]
    if keda:
        runs.append(("KEDA (HPA on its external metric)", keda))
    plot(args.out.with_suffix(".png"), runs)
    summary = {
        k: v for k, v in out.items() if k not in ("scale_cycle", "drain", "keda_cycle", "setup")
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
