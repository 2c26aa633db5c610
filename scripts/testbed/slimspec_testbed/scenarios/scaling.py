"""Scaling on the real nodes, shared by tests/e2e/test_scaling.py and bench/scaling.py.

``autoscaled_service``: an examples/ SlimSpecService on the small pair with
``autoscaling.mode: operator`` reading the in-cluster Prometheus. ``scale_cycle``:
clients through the Service take it from 1 replica to 2 (load) and back (a trickle),
every request counted. ``drain_under_load``: ``kubectl drain`` of a node that holds
one of two replicas while clients send requests; the PodDisruptionBudget must refuse
a second eviction while the evicted replica is away. ``Timeline`` samples the replica
count and the ready pods (with their nodes) once a second for the report and the plot.
Call everything inside ``NodeCluster.entered()``.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from kubernetes import client
from kubernetes.client.rest import ApiException

from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.node.images import ImageTags
from slimspec_testbed.scenarios.resources import service_from_example
from slimspec_testbed.scenarios.userpath import (
    ENGINE_SELECTOR,
    SERVICE_NAMESPACE,
    LoadClients,
    Result,
    get_service,
    pod_ready,
    pods,
    summary,
    wait_until,
)

ENGINE_READY_S = 600  # a pod's first start on a loaded 2-core machine


def autoscaled_service(
    images: ImageTags,
    model_path: str,
    prometheus_url: str,
    *,
    name: str = "scale",
    target_requests_per_replica: float = 0.5,
    max_replicas: int = 2,
    stabilization_window_s: int = 30,
    interval_s: int = 2,
) -> dict[str, Any]:
    """One replica to start; the operator's autoscaler (no tuning) on the request rate.
    The target is far from both loads scale_cycle sends (4 back-to-back clients: 2-20
    requests/s on a busy or a quiet 2-core machine; the trickle: under 0.2/s), so
    neither hovers at the threshold."""
    body = service_from_example(images, model_path, name=name, replicas=1)
    spec = body["spec"]
    spec["prometheus"] = {"url": prometheus_url, "timeoutSeconds": 3}
    spec["tuning"] = {"enabled": False, "intervalSeconds": interval_s}
    spec["autoscaling"] = {
        "enabled": True,
        "mode": "operator",
        "minReplicas": 1,
        "maxReplicas": max_replicas,
        "targetRequestsPerReplica": target_requests_per_replica,
        "stabilizationWindowSeconds": stabilization_window_s,
    }
    return body


def fixed_replicas(body: dict[str, Any], replicas: int) -> dict[str, Any]:
    """The same service with autoscaling off and `replicas` set by hand."""
    out = copy.deepcopy(body)
    out["spec"]["autoscaling"] = {**out["spec"]["autoscaling"], "enabled": False}
    out["spec"]["replicas"] = replicas
    return out


def selector(name: str) -> str:
    return f"{ENGINE_SELECTOR},app.kubernetes.io/instance={name}"


def live_pods(kube: KubeCluster, name: str) -> list[Any]:
    """The resource's engine pods that are not terminating."""
    found = pods(kube, SERVICE_NAMESPACE, selector(name))
    return [p for p in found if p.metadata.deletion_timestamp is None]


def apply_and_wait(kube: KubeCluster, body: dict[str, Any]) -> None:
    """kubectl apply of a SlimSpecService; returns once one of its engine pods is Ready."""
    name = body["metadata"]["name"]
    kube.apply(body)
    wait_until(
        lambda: [p for p in live_pods(kube, name) if pod_ready(p)],
        ENGINE_READY_S,
        f"{name}: one engine pod ready",
    )


def wait_one_per_node(kube: KubeCluster, name: str, replicas: int) -> None:
    """Until `replicas` engine pods are Ready, each on a node of its own."""

    def spread() -> bool:
        ready = [p for p in live_pods(kube, name) if pod_ready(p)]
        return len(ready) == replicas and len({p.spec.node_name for p in ready}) == replicas

    wait_until(spread, ENGINE_READY_S, f"{name}: {replicas} replicas on {replicas} nodes", 1.0)


def delete_service(kube: KubeCluster, name: str) -> None:
    kube.kubectl("delete", "slimspecservice", name, "-n", SERVICE_NAMESPACE, "--wait=true",
                 timeout=300, check=False)  # fmt: skip


def served_requests(pod: Any) -> float:
    """slimspec_requests_total of one engine pod, read at its IP."""
    text = httpx.get(f"http://{pod.status.pod_ip}:8080/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("slimspec_requests_total{")
    )


@dataclass
class Sample:
    t: float  # time.monotonic()
    spec_replicas: int | None
    ready: dict[str, str]  # ready pod -> node
    pods: int  # every engine pod, terminating ones included


@dataclass
class Timeline:
    """Samples the resource once a second in a thread (started inside the namespace)."""

    kube: KubeCluster
    name: str
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _sample(self) -> Sample:
        spec = get_service(self.kube, self.name).get("spec") or {}
        every = pods(self.kube, SERVICE_NAMESPACE, selector(self.name))
        ready = {p.metadata.name: p.spec.node_name for p in every if pod_ready(p)}
        return Sample(time.monotonic(), spec.get("replicas"), ready, len(every))

    def _run(self) -> None:
        while not self._stop.is_set():
            # a missed sample is a gap in the plot, nothing more
            with contextlib.suppress(Exception):
                self.samples.append(self._sample())
            self._stop.wait(1.0)

    def start(self) -> Timeline:
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Timeline:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
        return self

    def rows(self, t0: float) -> list[dict[str, Any]]:
        return [
            {
                "t": round(s.t - t0, 1),
                "spec_replicas": s.spec_replicas,
                "ready": len(s.ready),
                "ready_nodes": sorted(set(s.ready.values())),
                "pods": s.pods,
            }
            for s in self.samples
        ]


def latency_rows(results: list[Result], t0: float) -> list[dict[str, Any]]:
    return [
        {"t": round(r.start - t0, 2), "latency_s": round(r.end - r.start, 3), "ok": r.ok}
        for r in results
    ]


def milestones(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """From a scale cycle's timeline: when the spec first asked for a second replica
    and when a second engine pod was first Ready (seconds since the load started).
    Between Ready and serving lies the clients' reconnection: a kept-alive connection
    reaches the new pod once the engine closes it at its max age (10 s by default)."""
    asked = next((r["t"] for r in rows if (r["spec_replicas"] or 0) >= 2), None)
    ready = next((r["t"] for r in rows if r["ready"] >= 2), None)
    return {"replica_asked_s": asked, "replica_ready_s": ready}


def _failed(results: list[Result]) -> list[str]:
    return [f"{r.kind}: {r.detail}" for r in results if not r.ok]


def scale_cycle(
    kube: KubeCluster,
    name: str,
    base_url: str,
    *,
    clients: int = 4,
    trickle_think_s: float = 6.0,
    hold_s: float = 10.0,
) -> dict[str, Any]:
    """From 1 replica: `clients` back-to-back clients until a second replica serves,
    then one client `trickle_think_s` apart until the resource is back to 1 replica.
    Scale-up time: load start -> the added pod Ready and counting requests it served
    (milestones: when it was asked for and Ready);
    scale-down time: load dropped -> one engine pod left (the other drained and gone)."""
    (first,) = wait_until(lambda: live_pods(kube, name), 60, f"{name}: one engine pod")
    timeline = Timeline(kube, name).start()
    t0 = time.monotonic()
    heavy = LoadClients(base_url, clients=clients).start()
    light: LoadClients | None = None
    try:

        def added_serves() -> bool:
            ready = [p for p in live_pods(kube, name) if pod_ready(p)]
            new = [p for p in ready if p.metadata.name != first.metadata.name]
            return bool(new) and all(served_requests(p) > 0 for p in new)

        wait_until(added_serves, ENGINE_READY_S, f"{name}: a second replica serving", 1.0)
        t_up = time.monotonic()
        nodes = sorted({p.spec.node_name for p in live_pods(kube, name)})
        time.sleep(hold_s)  # both replicas under load
        light = LoadClients(base_url, clients=1, think_s=trickle_think_s).start()
        heavy.stop()
        t_idle = time.monotonic()

        def one_left() -> bool:
            every = pods(kube, SERVICE_NAMESPACE, selector(name))
            spec = get_service(kube, name)["spec"]
            return spec.get("replicas") == 1 and len(every) == 1 and pod_ready(every[0])

        wait_until(one_left, 600, f"{name}: back to one replica", 1.0)
        t_down = time.monotonic()
        time.sleep(hold_s)  # requests right after the drained pod is gone count too
    finally:
        heavy.stop()
        if light is not None:
            light.stop()
        timeline.stop()
    up = heavy.snapshot()
    down = light.snapshot() if light is not None else []
    status = (get_service(kube, name).get("status") or {}).get("autoscaling") or {}
    rows = timeline.rows(t0)
    return {
        "clients": clients,
        "trickle_think_s": trickle_think_s,
        **milestones(rows),
        "scale_up_s": round(t_up - t0, 1),
        "scale_down_s": round(t_down - t_idle, 1),
        "nodes_at_two_replicas": nodes,
        "requests_total": len(up) + len(down),
        "scale_up_requests": summary(up),
        "scale_down_requests": summary(down),
        "scale_failed_requests": len(_failed(up)) + len(_failed(down)),
        "failures": (_failed(up) + _failed(down))[:10],
        "last_autoscaling_status": status,
        "timeline": rows,
        "latencies": latency_rows(up + down, t0),
    }


def _dry_run_evict(kube: KubeCluster, pod: Any) -> int:
    """HTTP status of an eviction of `pod` that changes nothing (dryRun): 201 allowed,
    429 refused by a PodDisruptionBudget."""
    body = client.V1Eviction(
        metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=SERVICE_NAMESPACE),
        delete_options=client.V1DeleteOptions(dry_run=["All"]),
    )
    with kube.api_client() as api:
        try:
            client.CoreV1Api(api).create_namespaced_pod_eviction(
                pod.metadata.name, SERVICE_NAMESPACE, body
            )
        except ApiException as exc:
            return int(exc.status)
    return 201


def drain_under_load(
    kube: KubeCluster, name: str, base_url: str, node_name: str, *, clients: int = 4
) -> dict[str, Any]:
    """`kubectl drain node_name` while `clients` clients send requests through the
    Service; the resource must run 2 replicas, one of them on `node_name`. While the
    evicted replica is away, a (dry-run) eviction of the other one must be refused by
    the PodDisruptionBudget. Ends with the node uncordoned."""
    before = {p.metadata.name: p.spec.node_name for p in live_pods(kube, name)}
    timeline = Timeline(kube, name).start()
    load = LoadClients(base_url, clients=clients).start()
    t0 = time.monotonic()
    refusals: list[int] = []
    try:
        load.wait_for_requests(2 * clients, 300)
        drain = kube.kubectl(
            "drain", node_name, "--ignore-daemonsets", "--delete-emptydir-data",
            "--timeout=600s", timeout=660,
        )  # fmt: skip
        t_drained = time.monotonic()
        # The evicted replica's replacement is starting on the other node: the budget
        # (maxUnavailable 1) has no room for a second disruption until it is Ready.
        while True:
            now = live_pods(kube, name)
            ready = [p for p in now if pod_ready(p)]
            if len(ready) >= 2 or time.monotonic() - t_drained > ENGINE_READY_S:
                break
            survivors = [p for p in ready if p.metadata.name in before]
            if survivors:
                refusals.append(_dry_run_evict(kube, survivors[0]))
            time.sleep(2.0)
        t_back = time.monotonic()
        time.sleep(10)  # requests after the replacement joined count too
    finally:
        load.stop()
        timeline.stop()
        kube.kubectl("uncordon", node_name, check=False)
    after = {p.metadata.name: p.spec.node_name for p in live_pods(kube, name) if pod_ready(p)}
    results = load.snapshot()
    return {
        "clients": clients,
        "drained_node": node_name,
        "pods_before": before,
        "pods_after": after,
        "drain_s": round(t_drained - t0, 1),
        "replacement_ready_s": round(t_back - t_drained, 1),
        "drain_output": drain.stdout[-1500:],
        "second_eviction_statuses": refusals,
        "requests_total": len(results),
        "drain_requests": summary(results),
        "drain_failed_requests": len(_failed(results)),
        "failures": _failed(results)[:10],
        "timeline": timeline.rows(t0),
        "latencies": latency_rows(results, t0),
    }
