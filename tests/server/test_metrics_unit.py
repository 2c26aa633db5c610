"""Metrics pieces that need no server: GPU gauges through a fake NVML, stats diffing."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

from slimspec.decoding.stats import DecoderStats
from slimspec.server.metrics import Metrics


class FakeNvml:
    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=40 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=1000 * (h + 1))


def test_gpu_gauges_only_with_a_gpu(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    text = Metrics().render().decode()
    assert 'slimspec_gpu_utilization_ratio{gpu="1"} 0.41' in text
    assert 'slimspec_gpu_memory_used_bytes{gpu="0"} 1000.0' in text
    assert "slimspec_gpu_" not in Metrics(enable_gpu=False).render().decode()


def test_observe_step_turns_cumulative_stats_into_counters() -> None:
    m = Metrics(enable_gpu=False)
    stats = DecoderStats(
        drafted=10,
        accepted=6,
        verify_steps=4,
        kept_acceptance=0.9,
        draft_time_s=0.5,
        target_time_s=1.0,
        prefill_time_s=0.25,
        fused_prefills=1,
        prefix_lookups=2,
        prefix_hits=1,
        prefix_hit_tokens=992,
        prefix_cache_bytes=4096,
    )
    stats.recent_accepted_lengths.extend([2.0, 3.0])
    eng = SimpleNamespace(
        stats=stats, compression_ratio=0.2, ratio_report=None, ranking_status=lambda: None
    )
    m.observe_step(eng, 3)
    stats.drafted, stats.accepted, stats.verify_steps = 14, 9, 6
    stats.draft_time_s, stats.target_time_s, stats.fused_prefills = 0.75, 1.5, 3
    stats.fallbacks["quality"] = 1
    stats.prefix_lookups, stats.prefix_hits, stats.prefix_hit_tokens = 3, 2, 1984
    stats.prefix_evictions, stats.prefix_cache_bytes = 5, 2048
    stats.lookup_verifications, stats.lookup_drafted, stats.lookup_accepted = 4, 40, 17
    m.observe_step(eng, 2)
    text = m.render().decode()
    assert "slimspec_draft_tokens_total 14.0" in text
    assert "slimspec_accepted_tokens_total 9.0" in text
    assert "slimspec_verify_steps_total 6.0" in text
    assert 'slimspec_engine_seconds_total{phase="draft"} 0.75' in text
    assert 'slimspec_engine_seconds_total{phase="verify"} 1.5' in text
    assert 'slimspec_engine_seconds_total{phase="prefill"} 0.25' in text
    assert "slimspec_fused_prefills_total 3.0" in text
    assert 'slimspec_fallbacks_total{reason="quality"} 1.0' in text
    assert "slimspec_mean_accepted_length 2.5" in text
    assert "slimspec_acceptance_kept_ratio 0.9" in text
    assert "slimspec_compression_ratio 0.2" in text
    assert "slimspec_batch_size_count 2.0" in text
    assert "slimspec_prefix_cache_hit_tokens_total 1984.0" in text
    assert "slimspec_prefix_cache_lookups_total 3.0" in text
    assert "slimspec_prefix_cache_hits_total 2.0" in text
    assert "slimspec_prefix_cache_evictions_total 5.0" in text
    assert "slimspec_prefix_cache_bytes 2048.0" in text
    assert "slimspec_lookup_verifications_total 4.0" in text
    assert "slimspec_lookup_draft_tokens_total 40.0" in text
    assert "slimspec_lookup_accepted_tokens_total 17.0" in text
    # a retired engine's cache no longer counts
    m.forget_engine(eng)
    assert "slimspec_prefix_cache_bytes 0.0" in m.render().decode()


def test_an_idle_engine_exports_zero_requests_not_nothing() -> None:
    # sum(rate(slimspec_requests_total[...])) is then 0 for an idle engine, where an
    # absent series would give an empty result that autoscalers read as metrics lost
    text = Metrics(enable_gpu=False).render().decode()
    for endpoint in ("/infer", "/v1/completions", "/v1/chat/completions"):
        assert f'slimspec_requests_total{{code="200",endpoint="{endpoint}"}} 0.0' in text
