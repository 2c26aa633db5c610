"""The operator at scale: 1, 100 and 300 SlimSpecServices on a real control plane.

    .venv/bin/python bench/operator_scale.py [--counts 1 100 300] [--spreads 1 10]
        [--probes 20] [--idle-s 120] [--rev REV] [--before REV --before-counts 100]
        [--update] [--out bench/results/operator_scale.json]

Real parts on loopback: kube-apiserver + etcd + kube-controller-manager (no node:
Deployments get ReplicaSets and Pending pods), a real Prometheus (the tuner's
queries go to it), and the operator as its own process (`python -m
slimspec_operator`, cluster-wide, default timers) under a ServiceAccount bound to
the chart's ClusterRole. Every resource has tuning on (the default 60 s interval)
against that Prometheus, which holds no engine series: each query is answered,
with no data.

Per run (a fresh operator; N resources in one namespace, or spread over
several, `--spreads`):
- burst: N resources created back to back (as `kubectl apply -f dir/`); for each,
  create -> its Deployment seen by a watch (burst_apply_to_deployment_*);
- settle: until the operator has worked through the burst's events (at most a
  few requests in 15 s besides the tuner's status writes: settle_after_burst_s);
- idle: then `--idle-s` seconds in which nothing changes:
  the operator's API requests, counted by the API server itself (a FlowSchema
  that matches only the operator's ServiceAccount;
  apiserver_flowcontrol_dispatched_requests_total), per resource per minute;
  the tuner's Prometheus queries, counted by Prometheus itself
  (prometheus_http_requests_total{handler="/api/v1/query"}), per tuning
  interval; the operator's resident memory (VmRSS, VmHWM from /proc);
- probes, with the N resources in place: `--probes` new resources, one at a
  time (apply -> Deployment: apply_to_deployment_*), then `--probes` model
  version changes of existing resources, one at a time, each to a version not
  seen before (-> that version's Deployment: version_change_*).
Results: JSON (one row per run) and a plot of the figures against N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from rich.progress import Progress
from slimspec_operator.contract import INSTANCE_LABEL, MANAGED_BY_LABEL, MANAGER, VERSION_LABEL
from slimspec_testbed.cluster.control_plane import running_cluster
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.prometheus import PrometheusServer, scrape_config
from slimspec_testbed.scenarios.resources import GROUP, PLURAL, VERSION, sample_service
from slimspec_testbed.tools import REPO_ROOT, run_checked, stop_process, tool_path

OPERATOR_NS = "slimspec-system"
OPERATOR_SA = "slimspec-operator"
FLOW_SCHEMA = "slimspec-operator-bench"
FLOW_SCHEMA_STATUS = "slimspec-operator-bench-status"
QUERY_HANDLER = "/api/v1/query"
TUNING_INTERVAL_S = 60
SERVICE_CIDR = "10.0.0.0/16"
SETTLE_QUIET_S = 15  # no new Deployment event for this long: settled


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 20 samples is the largest)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 1)) - 1))
    return round(ordered[rank], 3)


# ------------------------------------------------------------------ the cluster side


def operator_identity(cluster: KubeCluster, work: Path) -> Path:
    """CRD, the chart's operator ClusterRole bound to a ServiceAccount, and a
    FlowSchema that counts exactly that ServiceAccount's requests."""
    cluster.kubectl("apply", "-f", str(REPO_ROOT / "crds" / "slimspecservice.yaml"))
    established = ("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}")
    cluster.wait_for(lambda: cluster.kubectl(*established, check=False).returncode == 0, 60)
    chart = REPO_ROOT / "charts" / "slimspec"
    rendered = run_checked(
        [tool_path("helm"), "template", "rel", chart, "--set", "rbac.scope=cluster"],
        env=cluster.env,
    ).stdout
    (role,) = [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") == "ClusterRole"]
    role["metadata"] = {"name": OPERATOR_SA}
    cluster.create_namespace(OPERATOR_NS)
    everything = {
        "verbs": ["*"],
        "apiGroups": ["*"],
        "resources": ["*"],
        "clusterScope": True,
        "namespaces": ["*"],
    }
    status_writes = {
        "verbs": ["patch", "update"],
        "apiGroups": [GROUP],
        "resources": [f"{PLURAL}/status"],
        "namespaces": ["*"],
    }
    flows = [
        flow_schema(FLOW_SCHEMA_STATUS, 7900, {"resourceRules": [status_writes]}),
        flow_schema(
            FLOW_SCHEMA,
            7901,
            {
                "resourceRules": [everything],
                "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
            },
        ),
    ]
    cluster.apply([role, *flows])
    cluster.kubectl(
        "create", "clusterrolebinding", OPERATOR_SA, f"--clusterrole={OPERATOR_SA}",
        f"--serviceaccount={OPERATOR_NS}:{OPERATOR_SA}",
    )  # fmt: skip
    return cluster.service_account_kubeconfig(OPERATOR_NS, OPERATOR_SA)


def flow_schema(name: str, precedence: int, rule: dict[str, Any]) -> dict[str, Any]:
    """A FlowSchema for the operator's ServiceAccount: before the built-in
    service-accounts schema (9000), on the same priority level (workload-low)."""
    subject = {
        "kind": "ServiceAccount",
        "serviceAccount": {"name": OPERATOR_SA, "namespace": OPERATOR_NS},
    }
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "matchingPrecedence": precedence,
            "priorityLevelConfiguration": {"name": "workload-low"},
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [{"subjects": [subject], **rule}],
        },
    }


def operator_requests(cluster: KubeCluster) -> tuple[float, float]:
    """(all requests, status writes) of the operator's ServiceAccount so far, as the
    API server counts them."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    metric = "apiserver_flowcontrol_dispatched_requests_total"
    status = sum_samples(text, metric, FLOW_SCHEMA_STATUS)
    return sum_samples(text, metric, FLOW_SCHEMA) + status, status


def sum_samples(text: str, metric: str, label_value: str) -> float:
    """Sum of the samples of `metric` whose labels contain `label_value` (text format)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'"{label_value}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def prometheus_queries(prom: PrometheusServer) -> float:
    with urllib.request.urlopen(f"{prom.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum_samples(text, "prometheus_http_requests_total", QUERY_HANDLER)


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MB, from /proc."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    kb = lambda key: float(fields[key].split()[0])  # noqa: E731
    return round(kb("VmRSS") / 1024, 1), round(kb("VmHWM") / 1024, 1)


class DeploymentWatch:
    """First moment each (namespace, resource, model version) Deployment was seen."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.api = client.AppsV1Api(cluster.api_client())
        self.seen: dict[tuple[str, str, str], float] = {}
        self.last_event = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _record(self, dep: client.V1Deployment) -> None:
        meta = dep.metadata
        assert meta is not None
        labels = meta.labels or {}
        key = (str(meta.namespace), labels.get(INSTANCE_LABEL, ""), labels.get(VERSION_LABEL, ""))
        now = time.monotonic()
        self.seen.setdefault(key, now)
        self.last_event = now

    def _loop(self) -> None:
        selector = f"{MANAGED_BY_LABEL}={MANAGER}"
        while not self._stop.is_set():
            try:  # a stream the server ends (or breaks) is listed and watched again
                listed = self.api.list_deployment_for_all_namespaces(label_selector=selector)
                for dep in listed.items:
                    self._record(dep)
                stream = watch.Watch().stream(
                    self.api.list_deployment_for_all_namespaces,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,  # type: ignore[union-attr]
                    timeout_seconds=30,
                )
                for event in stream:
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._record(event["object"])
                    if self._stop.is_set():
                        break
            except (ApiException, urllib3.exceptions.HTTPError) as exc:
                print(f"deployment watch: {exc.__class__.__name__}; watching again", flush=True)
                time.sleep(0.5)

    def start(self) -> DeploymentWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait(self, key: tuple[str, str, str], timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while key not in self.seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Deployment for {key} in {timeout}s")
            time.sleep(0.005)
        return self.seen[key]

    def wait_quiet(self, quiet_s: float, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.last_event < quiet_s:
            if time.monotonic() > deadline:
                raise TimeoutError("Deployments did not settle")
            time.sleep(0.5)


@contextmanager
def operator_process(
    kubeconfig: Path, log: Path, checkout: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """The operator of this checkout, or of another one (its operator/ first on the path)."""
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout / "operator"),
                                                          env.get("PYTHONPATH")]))  # fmt: skip
    argv = [sys.executable, "-m", "slimspec_operator", "--standalone", "--metrics-port", "0",
            "--liveness", ""]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop_process(proc, 30)


# ------------------------------------------------------------------ one run


def warm_up(custom: client.CustomObjectsApi, deps: DeploymentWatch, prom_url: str) -> None:
    """One resource through the fresh operator (its watches are up), then gone."""
    custom.create_namespaced_custom_object(
        GROUP, VERSION, OPERATOR_NS, PLURAL, body("warm-up", OPERATOR_NS, prom_url)
    )
    deps.wait((OPERATOR_NS, "warm-up", "v1"))
    deadline = time.monotonic() + 60
    while not custom.get_namespaced_custom_object(  # type: ignore[index]
        GROUP, VERSION, OPERATOR_NS, PLURAL, "warm-up"
    )["metadata"].get("finalizers"):
        # Deleted before Kopf has put its finalizer on, Kopf would keep its timers.
        if time.monotonic() > deadline:
            raise TimeoutError("the warm-up resource got no finalizer")
        time.sleep(0.1)
    custom.delete_namespaced_custom_object(GROUP, VERSION, OPERATOR_NS, PLURAL, "warm-up")


def remaining(custom: client.CustomObjectsApi, namespace: str) -> int:
    found = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    return len(found["items"])  # type: ignore[index]


def body(name: str, namespace: str, prom_url: str, version: str = "v1") -> dict[str, Any]:
    b = sample_service(
        name,
        version,
        replicas=1,
        rollout={"readyTimeoutSeconds": 86400},  # no pods get ready: no rollback either
        prometheus={"url": prom_url, "timeoutSeconds": 5},
        tuning={"enabled": True, "intervalSeconds": TUNING_INTERVAL_S},
    )
    b["metadata"]["namespace"] = namespace
    return b


def operator_settled(cluster: KubeCluster, count: int, timeout: float = 900) -> float:
    """Seconds until the operator has worked through what a burst left it (its event
    backlog): in the last 15 s at most 3 + count/100 requests besides status writes
    (the tuner writes those at each slot's start, idle or not)."""
    t0 = time.monotonic()
    history: list[float] = []
    while time.monotonic() - t0 < timeout:
        total, status = operator_requests(cluster)
        history.append(total - status)
        if len(history) > 3 and history[-1] - history[-4] <= 3 + count / 100:
            return round(time.monotonic() - t0, 1)
        time.sleep(5)
    raise TimeoutError(f"the operator was still busy after {timeout:.0f} s")


def idle_window(cluster: KubeCluster, prom: PrometheusServer, idle_s: float) -> dict[str, float]:
    """The operator's requests (all, status writes) and the tuner's Prometheus queries
    over a window that starts just after a tuning slot was evaluated."""
    slot_offset = time.time() % TUNING_INTERVAL_S
    time.sleep((TUNING_INTERVAL_S - slot_offset + 10) % TUNING_INTERVAL_S)
    (r0, s0), q0, t0 = operator_requests(cluster), prometheus_queries(prom), time.monotonic()
    time.sleep(idle_s)
    (r1, s1), q1, t1 = operator_requests(cluster), prometheus_queries(prom), time.monotonic()
    return {"requests": r1 - r0, "status": s1 - s0, "queries": q1 - q0, "seconds": t1 - t0}


def run(
    cluster: KubeCluster,
    kubeconfig: Path,
    prom: PrometheusServer,
    count: int,
    namespaces: int,
    args: argparse.Namespace,
    progress: Progress,
    checkout: Path | None = None,
) -> dict[str, Any]:
    tag = f"s{count}x{namespaces}-{checkout.name if checkout else 'tree'}"
    spaces = [cluster.create_namespace(f"{tag}-{i}") for i in range(namespaces)]
    custom = client.CustomObjectsApi(cluster.api_client())
    deps = DeploymentWatch(cluster).start()
    row: dict[str, Any] = {"resources": count, "namespaces": namespaces}
    try:
        with operator_process(kubeconfig, args.work / f"operator-{tag}.log", checkout) as op:
            warm_up(custom, deps, prom.url)
            names = [(spaces[i % namespaces], f"svc-{i}") for i in range(count)]
            started: dict[tuple[str, str], float] = {}
            task = progress.add_task(f"{count} resources: create", total=count)
            for ns, name in names:
                started[(ns, name)] = time.monotonic()
                custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, body(name, ns, prom.url)
                )
                progress.advance(task)
            burst = [deps.wait((ns, n, "v1"), 600) - started[(ns, n)] for ns, n in names]
            row["burst_all_deployments_s"] = round(
                max(deps.seen[(ns, n, "v1")] for ns, n in names) - min(started.values()), 2
            )
            row["burst_apply_to_deployment_p50_s"] = percentile(burst, 0.5)
            row["burst_apply_to_deployment_p99_s"] = percentile(burst, 0.99)
            deps.wait_quiet(SETTLE_QUIET_S)
            row["settle_after_burst_s"] = operator_settled(cluster, count)

            progress.update(task, description=f"{count} resources: idle {args.idle_s:.0f} s")
            idle = idle_window(cluster, prom, args.idle_s)
            per_resource_min = count * idle["seconds"] / 60
            row["idle_window_s"] = round(idle["seconds"], 1)
            row["idle_api_requests"] = idle["requests"]
            row["idle_api_requests_per_resource_per_min"] = round(
                idle["requests"] / per_resource_min, 3
            )
            # Of which the status writes (the tuner's, one per evaluation).
            row["idle_status_writes_per_resource_per_min"] = round(
                idle["status"] / per_resource_min, 3
            )
            slots = idle["seconds"] / TUNING_INTERVAL_S
            row["tuner_queries_per_tick"] = round(idle["queries"] / slots, 1)
            row["operator_rss_mb"], row["operator_peak_rss_mb"] = rss_mb(op.pid)

            progress.update(task, description=f"{count} resources: probes")
            applies, changes = [], []
            for i in range(args.probes):
                ns, name = spaces[i % namespaces], f"probe-{i}"
                t0 = time.monotonic()
                custom.create_namespaced_custom_object(
                    GROUP, VERSION, ns, PLURAL, body(name, ns, prom.url)
                )
                applies.append(deps.wait((ns, name, "v1")) - t0)
            for i in range(args.probes):
                ns, name = names[(i * max(1, count // args.probes)) % count]
                version = f"p{i}"  # a new version each time: a new Deployment
                t0 = time.monotonic()
                patch = {"spec": {"model": {"version": version}}}
                custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, patch)
                changes.append(deps.wait((ns, name, version)) - t0)
            row["apply_to_deployment_p50_s"] = percentile(applies, 0.5)
            row["apply_to_deployment_p99_s"] = percentile(applies, 0.99)
            row["version_change_p50_s"] = percentile(changes, 0.5)
            row["version_change_p99_s"] = percentile(changes, 0.99)
            row["probes"] = args.probes
            row["operator_rss_mb_after_probes"] = rss_mb(op.pid)[0]
            progress.update(task, description=f"{count} resources: clean-up")
            for ns in spaces:  # the operator lifts its finalizers, then the namespaces go
                cluster.kubectl("delete", "namespace", ns, "--wait=false")
            cluster.wait_for(
                lambda: not any(remaining(custom, ns) for ns in spaces),
                timeout=600,
                what="resources deleted",
            )
            progress.remove_task(task)
    finally:
        deps.stop()
    return row


# ------------------------------------------------------------------ output


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, list[tuple[str, str]]]] = [
        ("apply / version change -> Deployment (s)", [
            ("apply_to_deployment_p50_s", "apply p50"),
            ("apply_to_deployment_p99_s", "apply p99"),
            ("version_change_p99_s", "version change p99"),
            ("burst_apply_to_deployment_p99_s", "burst create p99"),
        ]),
        ("idle API requests per resource per minute", [
            ("idle_api_requests_per_resource_per_min", "operator"),
        ]),
        ("operator resident memory (MB)", [
            ("operator_rss_mb", "after idle"),
            ("operator_peak_rss_mb", "peak"),
        ]),
        ("tuner Prometheus queries per tick", [("tuner_queries_per_tick", "queries")]),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    for ax, (title, series) in zip(axes, panels, strict=True):
        for spread, marker in ((1, "o"), (10, "s")):
            sel = [r for r in rows if r["namespaces"] == spread or r["resources"] == 1]
            sel = sorted(sel, key=lambda r: r["resources"])
            for key, label in series:
                xs = [r["resources"] for r in sel if key in r]
                ys = [r[key] for r in sel if key in r]
                ax.plot(xs, ys, marker=marker, label=f"{label}, {spread} ns")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("SlimSpecService resources")
        ax.legend(fontsize=7)
    fig.suptitle("SlimSpec operator at scale (real control plane, no node)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merged(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` rows with those of the same size and spread replaced by `new` ones."""
    key = lambda r: (r["resources"], r["namespaces"])  # noqa: E731
    fresh = {key(r): r for r in new}
    kept = [r for r in old if key(r) not in fresh]
    return sorted(kept + new, key=lambda r: (r["namespaces"] > 1, r["resources"]))


def commit_of(rev: str) -> str:
    argv = ["git", "-C", str(REPO_ROOT), "log", "-1", "--format=%h %s", rev]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


def checkout_of(rev: str, into: Path) -> Path:
    """operator/ of git revision `rev`, unpacked under `into`."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", rev, "operator"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def cpu_name() -> str:
    text = Path("/proc/cpuinfo").read_text()
    found = re.search(r"model name\s*:\s*(.+)", text)
    return f"{found.group(1).strip() if found else platform.machine()}, {os.cpu_count()} CPUs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 100, 300])
    ap.add_argument(
        "--spreads",
        type=int,
        nargs="+",
        default=[1, 10],
        help="namespaces the resources are spread over, one run each (1 resource: 1 only)",
    )
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=120)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench/results/operator_scale.json")
    ap.add_argument("--work", type=Path, help="keep logs here (default: a temporary dir)")
    ap.add_argument(
        "--rev",
        help="run the operator of this git revision (its operator/ taken with git "
        "archive; default: the working tree), so that the tree may change meanwhile",
    )
    ap.add_argument(
        "--before",
        metavar="REV",
        help="also run the operator of this git revision (its operator/ taken with "
        "git archive) for --before-counts resources; its rows go under 'before'",
    )
    ap.add_argument("--before-counts", type=int, nargs="+", default=[100])
    ap.add_argument(
        "--update",
        action="store_true",
        help="keep the other rows of an existing --out: replace only those measured now",
    )
    args = ap.parse_args()
    # The commits, not names that may move while this runs (HEAD, a branch).
    args.rev = args.rev and commit_of(args.rev).split()[0]
    args.before = args.before and commit_of(args.before).split()[0]

    plan = [(n, s) for s in args.spreads for n in args.counts if s == 1 or n > 1]
    before: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="operator-scale-") as tmp, Progress() as progress:
        args.work = args.work or Path(tmp)
        args.work.mkdir(parents=True, exist_ok=True)
        prom_dir = args.work / "prometheus"
        prom_dir.mkdir()
        prom = PrometheusServer(tool_path("prometheus"), prom_dir, scrape_config([]))
        prom.config["scrape_configs"] = []
        prom.start()
        try:
            # The test bed's /24 of Service IPs holds 254 Services: one per resource here.
            with running_cluster(
                apiserver_args=[f"--service-cluster-ip-range={SERVICE_CIDR}"]
            ) as cluster:
                kubeconfig = operator_identity(cluster, args.work)
                current = checkout_of(args.rev, args.work / "rev") if args.rev else None
                for count, spread in plan:
                    row = run(cluster, kubeconfig, prom, count, spread, args, progress, current)
                    progress.console.print(json.dumps(row))
                    rows.append(row)
                old = checkout_of(args.before, args.work / "before") if args.before else None
                for count in args.before_counts if old else ():
                    row = run(cluster, kubeconfig, prom, count, 1, args, progress, old)
                    row["operator"] = f"{args.before}: {commit_of(args.before)}"
                    progress.console.print(json.dumps(row))
                    before.append(row)
        finally:
            prom.stop()

    measured = {
        "operator_rev": commit_of(args.rev) if args.rev else "working tree",
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [f"{r['resources']} x {r['namespaces']} ns" for r in rows + before],
    }
    runs = [measured]
    if args.update and args.out.exists():
        old = json.loads(args.out.read_text())
        first = {  # a file from before runs were listed
            "operator_rev": old["setup"].get("operator_rev"),
            "rows": [f"{r['resources']} x {r['namespaces']} ns" for r in old["rows"]]
            + [f"{r['resources']} x {r['namespaces']} ns (before)" for r in old.get("before", [])],
        }
        runs = [*old["setup"].get("runs", [first]), measured]
        rows = merged(old.get("rows", []), rows)
        before = merged(old.get("before", []), before)
    out = {
        "rows": rows,
        **({"before": before} if before else {}),
        "aims_at_300": {
            "apply_to_deployment_p99_s": 2.0,
            "idle_api_requests_per_resource_per_min": "flat in N",
            "operator_rss_mb": 300,
            "tuner_queries_per_tick": "independent of N",
        },
        "setup": {
            "control_plane": "kube-apiserver + etcd + kube-controller-manager v1.36.3, no node",
            "runs": runs,
            "operator": "python -m slimspec_operator --standalone, cluster-wide, default "
            "timers (SLIMSPEC_RECONCILE_INTERVAL 10 s, SLIMSPEC_RESYNC_INTERVAL 1800 s, "
            "SLIMSPEC_TUNING_TICK_SECONDS 5 s), the chart's ClusterRole",
            "resources": "1 replica, PVC models, tuning on (intervalSeconds "
            f"{TUNING_INTERVAL_S}) against a real Prometheus with no engine series",
            "api_requests": "apiserver_flowcontrol_dispatched_requests_total of a "
            "FlowSchema matching only the operator's ServiceAccount",
            "prometheus_queries": 'prometheus_http_requests_total{handler="/api/v1/query"}',
            "probes": f"{args.probes} applies and {args.probes} version changes, one at a time",
            "idle_window_s": args.idle_s,
            "machine": f"{cpu_name()}, shared",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    plot(args.out.with_suffix(".png"), rows)
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
