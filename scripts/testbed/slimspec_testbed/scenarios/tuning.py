"""Real parts for the end-to-end tuning scenario, shared by tests/tuning/test_e2e.py
and bench/tuning.py: an engine process, a load generator, the tuning
controller as a kopf process, and a recorder of what happened over time."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kubernetes import client

from slimspec_testbed.prometheus import metric_value
from slimspec_testbed.scenarios.resources import GROUP, PLURAL, VERSION
from slimspec_testbed.tools import REPO_ROOT, stop_process

PYTHON = str(Path(sys.executable))


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


@dataclass
class Process:
    """A child process with its output in a log file; stopped with SIGTERM."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, timeout: float = 15) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, timeout)
        self.proc = None


def engine_process(
    port: int,
    namespace: str,
    service: str,
    kubeconfig: str,
    workdir: Path,
    model: str,
    *,
    draft: str | None = None,
    dtype: str = "float32",
    draft_quantization: str | None = None,
    num_draft_tokens: int | None = 3,
    max_batch_size: int = 4,
    name: str = "engine",
    threads: int = 1,
    extra_env: Mapping[str, str] | None = None,
) -> Process:
    """`slimspec serve` on loopback, watching the `<service>-runtime` ConfigMap.

    By default the model drafts for itself in float32, with 3 draft tokens: draft =
    target here, so adaptive k would find drafting never pays and stop drafting;
    then the shadow check never measures kept acceptance and the tuner (rightly) holds.
    """
    env = dict(os.environ)
    env |= {
        "KUBECONFIG": kubeconfig,
        "SLIMSPEC_RUNTIME_CONFIGMAP": f"{service}-runtime",
        "POD_NAMESPACE": namespace,
        "OMP_NUM_THREADS": str(threads),  # default 1: two cores shared with the control plane
    }
    env |= dict(extra_env or {})
    argv = [PYTHON, "-m", "slimspec", "serve", "--target", model, "--draft", draft or model]
    argv += ["--dtype", dtype, "--device", "cpu", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--max-batch-size", str(max_batch_size)]
    argv += ["--log-level", "warning"]
    if draft_quantization is not None:
        argv += ["--draft-quantization", draft_quantization]
    if num_draft_tokens is not None:
        argv += ["--num-draft-tokens", str(num_draft_tokens)]
    return Process(argv, env, workdir / f"{name}.log")


def tuner_process(namespace: str, env: dict[str, str], workdir: Path) -> Process:
    """The operator (reconciler + tuning handlers) for one namespace.

    Falls back to the tuning handlers alone in a bare kopf process when the
    operator's entry point is not installed.
    """
    env = dict(env) | {"SLIMSPEC_TUNING_TICK_SECONDS": "1"}
    if importlib.util.find_spec("slimspec_operator.main") is not None:
        argv = [PYTHON, "-m", "slimspec_operator", "--standalone", "--namespace", namespace]
        argv += ["--liveness", "", "--metrics-port", "0"]
    else:
        argv = [PYTHON, "-m", "kopf", "run", "--standalone", "--namespace", namespace]
        argv += ["-m", "slimspec_operator.tuning.handlers"]
    return Process(argv, env, workdir / "tuner.log")


def wait_ready(url: str, proc: Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"process exited:\n{proc.log()}")
        try:
            http_get(url, timeout=2)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    raise TimeoutError(f"{url} not ready in {timeout}s:\n{proc.log()}")


class LoadGen:
    """`workers` threads posting /infer requests back to back; each finished
    request's (completion time on the monotonic clock, seconds taken) is kept, and
    in `served` its generated tokens and the ratio the engine says it served at."""

    def __init__(
        self,
        base_url: str,
        workers: int = 2,
        max_length: int = 4,
        prompts: Sequence[str] = ("The capital of France is",),
    ) -> None:
        """`prompts` are sent in turn (shared by all workers)."""
        if not prompts:
            raise ValueError("LoadGen needs at least one prompt")
        self.url = f"{base_url}/infer"
        self.bodies = [json.dumps({"input": p, "max_length": max_length}) for p in prompts]
        self._next = itertools.count()
        self.workers = workers
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.done = 0
        self.errors = 0
        self.latencies: list[tuple[float, float]] = []
        # (completion time, seconds, completion tokens, ratio served at)
        self.served: list[tuple[float, float, int, float]] = []

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            body = self.bodies[next(self._next) % len(self.bodies)]
            headers = {"Content-Type": "application/json"}
            req = urllib.request.Request(self.url, body.encode(), headers)
            start = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    answer = json.loads(resp.read())
                self.done += 1
                end = time.monotonic()
                tokens, ratio = answer["completion_tokens"], answer["compression_ratio"]
                self.latencies.append((end, end - start))
                self.served.append((end, end - start, tokens, ratio))
            except (urllib.error.URLError, OSError):
                self.errors += 1
                time.sleep(0.5)

    def start(self) -> LoadGen:
        for _ in range(self.workers):
            t = threading.Thread(target=self._loop, daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(130)


@dataclass
class Point:
    t: float
    status_ratio: float | None
    configmap_ratio: float | None
    engine_ratio: float | None
    p99: float | None
    request_rate: float | None
    metrics_available: str | None
    reason: str | None
    phase: str


@dataclass
class Recorder:
    """Samples the resource, ConfigMap, engine /metrics and Prometheus once a second."""

    api: client.ApiClient
    namespace: str
    service: str
    engine_url: str
    prom_query: Callable[[str], float | None]
    p99_query: str
    rate_query: str
    phase: str = "start"
    points: list[Point] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.events.append((round(time.monotonic() - self.t0, 2), phase))

    def body(self) -> dict[str, Any]:
        custom = client.CustomObjectsApi(self.api)
        body = custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, self.service
        )
        return cast(dict[str, Any], body)

    def snapshot(self) -> Point:
        body = self.body()
        status = body.get("status") or {}
        comp = status.get("compression") or {}
        cond: dict[str, Any] = next(
            (c for c in status.get("conditions") or [] if c["type"] == "MetricsAvailable"), {}
        )
        cm = client.CoreV1Api(self.api).read_namespaced_config_map(
            f"{self.service}-runtime", self.namespace
        )
        try:
            engine = metric_value(
                http_get(f"{self.engine_url}/metrics"), "slimspec_compression_ratio"
            )
        except (urllib.error.URLError, OSError):
            engine = None
        return Point(
            t=round(time.monotonic() - self.t0, 2),
            status_ratio=comp.get("ratio"),
            configmap_ratio=float((cm.data or {})["compression_ratio"]),
            engine_ratio=engine,
            p99=self.prom_query(self.p99_query),
            request_rate=self.prom_query(self.rate_query),
            metrics_available=cond.get("status"),
            reason=(comp.get("lastDecision") or {}).get("reason"),
            phase=self.phase,
        )

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.points.append(self.snapshot())
            except Exception as exc:  # keep recording through transient errors
                self.events.append((round(time.monotonic() - self.t0, 2), f"recorder: {exc}"))

    def start(self) -> Recorder:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)

    def wait(self, predicate: Callable[[Point], bool], timeout: float, what: str) -> Point:
        deadline = time.monotonic() + timeout
        last: Point | None = None
        while time.monotonic() < deadline:
            last = self.snapshot()
            if predicate(last):
                return last
            time.sleep(1)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last: {last}")


def service_spec(prom_url: str, window: str = "30s", **tuning: Any) -> dict[str, Any]:
    """Tuning settings sized for a short run: decisions every 3 s, 6 s cooldown.

    The engine answers in seconds on a shared CPU, so the latency queries use a
    `window` (default 30 s: enough finished requests for a p99) instead of the
    default. A change is judged on samples taken a cooldown after it, so a run
    that wants sound verdicts sets `cooldownSeconds` to at least the window.
    """
    sel = 'namespace="{namespace}",service="{service}"'
    return {
        "replicas": 1,
        "compression": {"ratio": 0.3, "minRatio": 0.1, "maxRatio": 0.5},
        "qualityControl": {"threshold": 0.5, "fallbackStrategy": "none"},
        "prometheus": {"url": prom_url, "timeoutSeconds": 2},
        "tuning": {
            "enabled": True,
            "intervalSeconds": 3,
            "cooldownSeconds": 6,
            "maxStep": 0.05,
            "deadBand": 0.1,
            "minRequestRate": 0.01,
            "latencyTargetSeconds": 0.05,
            "queries": {
                "p99Latency": "histogram_quantile(0.99, sum by (le) (rate("
                f"slimspec_request_latency_seconds_bucket{{{sel}}}[{window}])))",
                "requestRate": f"sum(rate(slimspec_requests_total{{{sel}}}[{window}]))",
            },
            **tuning,
        },
    }
