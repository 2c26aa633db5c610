"""Operator latency on the real test-bed control plane (etcd + kube-apiserver +
kube-controller-manager on loopback; pods made Running/Ready by the test bed's
pod driver, which plays kubelet).

    .venv/bin/python bench/rollout.py [--runs 5] [--out bench/results/rollout.json]

Measures, per run, with the operator running as a subprocess at its default
reconcile interval:
- apply_to_deployment_s: `kubectl apply` of a SlimSpecService until its engine
  Deployment exists;
- apply_to_ready_s: until status Ready=True (pods marked ready as they appear);
- rollout_s: `kubectl patch` of spec.model.version until the rollout is complete
  (Service switched to the new version, old Deployment deleted,
  Progressing=RolloutComplete), with the new pods marked ready as they appear.
Medians are reported with all samples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from slimspec_testbed.control_plane import running_cluster
from slimspec_testbed.resources import GROUP, PLURAL, VERSION, sample_service
from slimspec_testbed.tools import free_port

ROOT = Path(__file__).resolve().parents[1]


def poll(fn, timeout: float = 60, interval: float = 0.02) -> float:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if fn():
            return time.monotonic()
        time.sleep(interval)
    raise TimeoutError("benchmark step timed out")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def one_run(cluster, custom, apps, driver, ns: str, name: str) -> dict[str, float]:
    sel = f"app.kubernetes.io/instance={name}"

    def obj() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)

    def deployments() -> list[Any]:
        return apps.list_namespaced_deployment(ns, label_selector=sel).items

    out: dict[str, float] = {}
    with driver.start(ns, sel, ready=True, interval=0.05):
        t0 = time.monotonic()
        cluster.kubectl(
            "apply", "-n", ns, "-f", "-", input=yaml.safe_dump(sample_service(name, "v1"))
        )
        out["apply_to_deployment_s"] = poll(deployments) - t0
        out["apply_to_ready_s"] = (
            poll(lambda: condition(obj(), "Ready").get("status") == "True") - t0
        )
        poll(lambda: condition(obj(), "Progressing").get("reason") == "RolloutComplete")

        t1 = time.monotonic()
        patch = json.dumps({"spec": {"model": {"version": "v2"}}})
        cluster.kubectl("patch", "-n", ns, f"{PLURAL}/{name}", "--type=merge", "-p", patch)

        def done() -> bool:
            o = obj()
            return (
                (o.get("status") or {}).get("servedVersion") == "v2"
                and condition(o, "Progressing").get("reason") == "RolloutComplete"
                and len(deployments()) == 1
            )

        out["rollout_s"] = poll(done) - t1
    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rollout.json")
    args = ap.parse_args()

    samples: dict[str, list[float]] = {
        "apply_to_deployment_s": [],
        "apply_to_ready_s": [],
        "rollout_s": [],
    }
    with running_cluster() as cluster:
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "slimspecservice.yaml"))
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}", "--timeout=30s"
        )
        ns = cluster.create_namespace("bench")
        env = dict(cluster.env, PYTHONUNBUFFERED="1", SLIMSPEC_TUNING_TICK_SECONDS="3600")
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "slimspec-operator-bench.log"
        live = free_port()
        with log_path.open("wb") as log:
            op = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "slimspec_operator",
                    "--standalone",
                    "-n",
                    ns,
                    "--metrics-port",
                    "0",
                    "--liveness",
                    f"http://127.0.0.1:{live}/healthz",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        api = cluster.api_client()
        custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
        driver = cluster.pod_driver()
        try:
            # Operator start-up is not part of the measurement: wait for its liveness
            # endpoint (up once Kopf runs), then a moment for the watches to open.
            poll(lambda: _http_ok(f"http://127.0.0.1:{live}/healthz"), timeout=60, interval=0.2)
            time.sleep(2)
            for i in range(args.runs):
                run = one_run(cluster, custom, apps, driver, ns, f"bench-{i}")
                for k, v in run.items():
                    samples[k].append(v)
                print(f"run {i}: " + ", ".join(f"{k}={v:.3f}" for k, v in run.items()), flush=True)
        finally:
            op.terminate()
            op.wait(15)
            api.close()

    result: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    result["samples"] = {k: [round(x, 3) for x in v] for k, v in samples.items()}
    result["runs"] = args.runs
    result["setup"] = {
        "control_plane": "etcd + kube-apiserver + kube-controller-manager v1.36.3 on loopback",
        "pods": "test-bed pod driver marks pods Running/Ready every 50 ms (plays kubelet)",
        "operator": "python -m slimspec_operator --standalone, default intervals "
        f"(SLIMSPEC_RECONCILE_INTERVAL={os.environ.get('SLIMSPEC_RECONCILE_INTERVAL', '10')})",
        "replicas": 2,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared with other builds",
        "note": "kubectl start-up is inside apply_to_deployment_s and rollout_s",
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
