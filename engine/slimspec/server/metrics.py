"""Prometheus metrics of one engine process; names are fixed by docs/contracts.md.

Each app gets its own CollectorRegistry so several apps (tests, swap) never clash.
Decoder statistics are cumulative on the engine; `observe_step` turns them into
counter increments by diffing against the last values seen.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

from slimspec.decoding.engine import Engine
from slimspec.decoding.stats import DecoderStats
from slimspec.server.compression_metrics import CompressionMetrics

# The endpoints that generate: counted in slimspec_requests_total, watched in flight.
GENERATION_ENDPOINTS = ("/infer", "/v1/completions", "/v1/chat/completions")

log = logging.getLogger(__name__)

# 25 ms .. 30 s; dense between 50 ms and 5 s, where the chart's latency alerts are set,
# and steps of 10-20% up to 10 s: on CPU, p99 sits at 3-8 s, and the tuner judges a
# ratio change by p99 from these buckets, so coarse ones there hide 5-10% effects.
LATENCY_BUCKETS = (
    0.025,
    0.05,
    0.075,
    0.1,
    0.125,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    1.75,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    5.75,
    6.5,
    7.5,
    8.75,
    10.0,
    15.0,
    20.0,
    30.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ACCEPT_WINDOW = 64  # verify steps' worth of history for the mean accepted length


def since_last(last: dict[str, float], key: str, total: float) -> float:
    """How much a cumulative total grew since the last call for `key` (never below 0:
    a counter only goes up); remembers the total."""
    grew = max(0.0, float(total) - last.get(key, 0.0))
    last[key] = float(total)
    return grew


class _GpuCollector:
    """GPU utilisation and memory through NVML; only registered when a GPU is present."""

    def __init__(self, pynvml: Any, count: int) -> None:
        self._nvml = pynvml
        self._count = count

    def collect(self) -> Iterable[GaugeMetricFamily]:
        util = GaugeMetricFamily(
            "slimspec_gpu_utilization_ratio", "GPU utilisation, 0..1", labels=["gpu"]
        )
        mem = GaugeMetricFamily(
            "slimspec_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"]
        )
        for i in range(self._count):
            try:
                h = self._nvml.nvmlDeviceGetHandleByIndex(i)
                util.add_metric([str(i)], self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100)
                mem.add_metric([str(i)], float(self._nvml.nvmlDeviceGetMemoryInfo(h).used))
            except Exception:  # a GPU that vanished must not break /metrics
                continue
        yield util
        yield mem


def _gpu_collector() -> _GpuCollector | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception:
        return None
    return _GpuCollector(pynvml, count) if count > 0 else None


class Metrics:
    def __init__(self, enable_gpu: bool = True) -> None:
        r = self.registry = CollectorRegistry()
        self.latency = Histogram(
            "slimspec_request_latency_seconds",
            "End-to-end request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "slimspec_time_to_first_token_seconds",
            "Time to the first generated token",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "slimspec_requests_total", "Requests answered", ["endpoint", "code"], registry=r
        )
        # Exported at 0 from the start: an idle engine's request rate is then 0, not
        # an empty query result (which KEDA's trigger and the tuner read as "metrics
        # lost" and hold on).
        for endpoint in GENERATION_ENDPOINTS:
            self.requests.labels(endpoint=endpoint, code="200")
        self.generated = Counter("slimspec_generated_tokens_total", "Tokens generated", registry=r)
        self.drafted = Counter("slimspec_draft_tokens_total", "Draft tokens proposed", registry=r)
        self.accepted = Counter(
            "slimspec_accepted_tokens_total", "Draft tokens accepted by the target", registry=r
        )
        self.verify_steps = Counter(
            "slimspec_verify_steps_total", "Target verification passes", registry=r
        )
        self.mean_accepted = Gauge(
            "slimspec_mean_accepted_length",
            "Tokens emitted per verification over the recent window",
            registry=r,
        )
        self.compression_ratio = Gauge(
            "slimspec_compression_ratio", "Compression ratio in force", registry=r
        )
        self.quality_threshold = Gauge(
            "slimspec_quality_threshold", "Quality threshold in force", registry=r
        )
        self.kept_ratio = Gauge(
            "slimspec_acceptance_kept_ratio",
            "Shadow check: compressed / full head agreement",
            registry=r,
        )
        self.fallbacks = Counter(
            "slimspec_fallbacks_total", "Quality fallbacks", ["reason"], registry=r
        )
        self.queue_depth = Gauge(
            "slimspec_queue_depth", "Requests waiting for a batch slot", registry=r
        )
        self.batch_size = Histogram(
            "slimspec_batch_size", "Requests per decode step", buckets=BATCH_BUCKETS, registry=r
        )
        self.model_info = Info("slimspec_model", "Model being served", registry=r)
        # Where the engine's time goes, and how many prompts' target prefill rode on a
        # verification forward instead of a forward of its own (grouped_forward.py).
        self.engine_seconds = Counter(
            "slimspec_engine_seconds_total",
            "Engine compute time by phase (verify includes prefill that rode on it)",
            ["phase"],
            registry=r,
        )
        self.fused_prefills = Counter(
            "slimspec_fused_prefills_total",
            "Requests whose target prefill rode on a verification forward",
            registry=r,
        )
        # Lookup drafts (decoding/lookup.py): steps that verified copied tokens instead of
        # the draft's, and those tokens; not in the draft's counters above.
        self.lookup_verifications = Counter(
            "slimspec_lookup_verifications_total",
            "Per-request verifications of lookup drafts (tokens copied from earlier text)",
            registry=r,
        )
        self.lookup_drafted = Counter(
            "slimspec_lookup_draft_tokens_total",
            "Lookup draft tokens verified",
            registry=r,
        )
        self.lookup_accepted = Counter(
            "slimspec_lookup_accepted_tokens_total",
            "Lookup draft tokens the target accepted",
            registry=r,
        )
        # The prefix cache (decoding/prefix_cache.py): prompt tokens whose prefill was
        # skipped, lookups and hits, evictions, and the bytes held by the live engines.
        self.prefix_hit_tokens = Counter(
            "slimspec_prefix_cache_hit_tokens_total",
            "Prompt tokens whose prefill the prefix cache skipped",
            registry=r,
        )
        self.prefix_lookups = Counter(
            "slimspec_prefix_cache_lookups_total",
            "Prompts looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "slimspec_prefix_cache_hits_total",
            "Prompts that found at least one cached block",
            registry=r,
        )
        self.prefix_evictions = Counter(
            "slimspec_prefix_cache_evictions_total",
            "Prefix cache blocks evicted (least recently used first)",
            registry=r,
        )
        self.prefix_bytes = Gauge(
            "slimspec_prefix_cache_bytes",
            "Bytes of keys and values the prefix cache holds (all live engines)",
            registry=r,
        )
        self._prefix_bytes_by_engine: dict[int, int] = {}
        # Engine health and per-position acceptance.
        self.load_failures = Counter(
            "slimspec_model_load_failures_total",
            "Failed model loads (retried with back-off, then liveness fails)",
            registry=r,
        )
        self.position_drafted = Counter(
            "slimspec_draft_position_tokens_total",
            "Draft tokens verified at each draft position (1 = the first draft of a step)",
            ["position"],
            registry=r,
        )
        self.position_accepted = Counter(
            "slimspec_draft_position_accepted_total",
            "Draft tokens the target accepted at each draft position",
            ["position"],
            registry=r,
        )
        self.draft_head = Info(
            "slimspec_draft_head",
            "Draft head being served: calibrated by an artifact or the uncalibrated fallback",
            registry=r,
        )
        # what each compression ratio costs and buys, and the head's token ranking
        self.compression = CompressionMetrics(r)
        if enable_gpu and (gpu := _gpu_collector()) is not None:
            r.register(gpu)  # type: ignore[arg-type]
        self._last: dict[int, dict[str, float]] = {}
        self._window: collections.deque[tuple[float, float]] = collections.deque()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def set_model(self, version: str, target: str, draft: str) -> None:
        self.model_info.info({"version": version, "target": target, "draft": draft or "none"})

    def set_draft_head(self, engine: Engine) -> None:
        """slimspec_draft_head_info{calibrated, artifact} from the engine's calibration
        (calibrated false, artifact "" for an engine without a draft)."""
        head = engine.draft_head_info()
        calibrated = "true" if head is not None and head.calibrated else "false"
        self.draft_head.info({"calibrated": calibrated, "artifact": head.artifact if head else ""})

    def observe_step(self, engine: Engine, batch_size: int) -> None:
        """Called on the scheduler thread after each engine step."""
        self.batch_size.observe(batch_size)
        stats = engine.stats
        last = self._last.setdefault(id(engine), {})
        totals = {
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "verify_steps": stats.verify_steps,
            "draft_s": stats.draft_time_s,
            "verify_s": stats.target_time_s,
            "prefill_s": stats.prefill_time_s,
            "fused_prefills": stats.fused_prefills,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
            "prefix_lookups": stats.prefix_lookups,
            "prefix_hits": stats.prefix_hits,
            "prefix_evictions": stats.prefix_evictions,
            "lookup_verifications": stats.lookup_verifications,
            "lookup_drafted": stats.lookup_drafted,
            "lookup_accepted": stats.lookup_accepted,
        }
        deltas = {key: since_last(last, key, v) for key, v in totals.items()}
        self.drafted.inc(deltas["drafted"])
        self.accepted.inc(deltas["accepted"])
        self.verify_steps.inc(deltas["verify_steps"])
        for phase in ("draft", "verify", "prefill"):
            self.engine_seconds.labels(phase=phase).inc(deltas[f"{phase}_s"])
        self.fused_prefills.inc(deltas["fused_prefills"])
        self.prefix_hit_tokens.inc(deltas["prefix_hit_tokens"])
        self.prefix_lookups.inc(deltas["prefix_lookups"])
        self.prefix_hits.inc(deltas["prefix_hits"])
        self.prefix_evictions.inc(deltas["prefix_evictions"])
        self.lookup_verifications.inc(deltas["lookup_verifications"])
        self.lookup_drafted.inc(deltas["lookup_drafted"])
        self.lookup_accepted.inc(deltas["lookup_accepted"])
        self._prefix_bytes_by_engine[id(engine)] = stats.prefix_cache_bytes
        self.prefix_bytes.set(sum(self._prefix_bytes_by_engine.values()))
        if deltas["verify_steps"] > 0:
            self._window.append((deltas["accepted"], deltas["verify_steps"]))
            while sum(v for _, v in self._window) > ACCEPT_WINDOW and len(self._window) > 1:
                self._window.popleft()
            acc = sum(a for a, _ in self._window)
            ver = sum(v for _, v in self._window)
            recent = stats.recent_mean_accepted_length  # the decoder's own window
            self.mean_accepted.set(recent if recent > 0 else (acc + ver) / ver)
        for reason, count in stats.fallbacks.items():
            if (d := since_last(last, f"fallbacks:{reason}", count)) > 0:
                self.fallbacks.labels(reason=str(reason)).inc(d)
        self._observe_positions(stats, last)
        if stats.kept_acceptance is not None and stats.kept_acceptance > 0:
            self.kept_ratio.set(stats.kept_acceptance)
        self.compression_ratio.set(engine.compression_ratio)  # in force; 0.0 without a draft
        self.compression.observe(engine)

    def _observe_positions(self, stats: DecoderStats, last: dict[str, float]) -> None:
        """Per-position counters from the decoder's cumulative per-position lists."""
        for name, values, counter in (
            ("drafted_per_position", stats.drafted_per_position, self.position_drafted),
            ("accepted_per_position", stats.accepted_per_position, self.position_accepted),
        ):
            for i, v in enumerate(values):
                if (d := since_last(last, f"{name}:{i}", v)) > 0:
                    counter.labels(position=str(i + 1)).inc(d)

    def forget_engine(self, engine: Engine) -> None:
        """A retired engine (after a swap): its counters stop, its cache's bytes go."""
        self._last.pop(id(engine), None)
        self._prefix_bytes_by_engine.pop(id(engine), None)
        self.prefix_bytes.set(sum(self._prefix_bytes_by_engine.values()))
