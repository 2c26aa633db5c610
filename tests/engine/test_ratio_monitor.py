"""The decoder's measurements per ratio (ratio_monitor.py, the shadow check across
ratios) and their export (server/compression_metrics.py)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.quality import RATIO_LADDER, RatioKept
from slimspec.decoding.ratio_monitor import (
    HeadTimes,
    RatioMonitor,
    cache_flush,
    describe,
    time_heads,
)
from slimspec.decoding.types import GenerationRequest, SamplingParams
from slimspec.draft_head.head import DraftHead, HeadConfig
from slimspec.server.metrics import Metrics

from tests.engine.helpers import prompts
from tests.support.tiny_models import TINY_VOCAB


def test_head_times_interpolate_in_rows_and_follow_the_online_scale():
    ht = HeadTimes()
    ht.set_micro(1, {0.0: 0.010, 0.8: 0.002})
    ht.set_micro(8, {0.0: 0.024, 0.8: 0.004})
    assert ht.at(1)[0.0] == pytest.approx(0.010)
    assert ht.at(4)[0.0] == pytest.approx(0.016)
    assert ht.at(15)[0.0] == pytest.approx(0.038)  # linear beyond the largest measured batch
    for _ in range(100):  # in service the head at 0.8 takes twice the micro-timing
        ht.refine(1, 0.8, 0.004)
    assert ht.scaled(1)[0.0] == pytest.approx(0.020, rel=0.05)


def test_every_timed_head_run_starts_from_a_flushed_cache(monkeypatch):
    # In service a draft forward streams the body through the caches between two head
    # calls; timed back to back, a small head would read warm rows (half its service time
    # on a Xeon) and the one online scale could not fit the small and the full head.
    head = DraftHead(torch.randn(64, 16), torch.randperm(64))
    events: list[str] = []
    real_logits = head.logits
    monkeypatch.setattr(
        head, "logits", lambda h, cfg: events.append("score") or real_logits(h, cfg)
    )
    flush = cache_flush(head)
    assert flush is not None  # a CPU head
    ticks = iter(range(1000))

    def clock() -> float:
        events.append("clock")
        return float(next(ticks))

    def flushed() -> None:
        events.append("flush")
        flush()

    cfgs = {0.0: HeadConfig(64, None), 0.5: HeadConfig(32, None)}
    out = time_heads(head, cfgs, 2, clock, reps=2, flush=flushed)
    timed = ["flush", "clock", "score", "clock"]
    assert events == (["score"] + timed * 2) * 2  # one untimed warm call per ratio
    assert out == {0.0: 1.0, 0.5: 1.0}


def test_body_time_is_a_forward_without_its_head():
    m = RatioMonitor()
    m.heads.set_micro(1, dict.fromkeys(RATIO_LADDER, 0.001))
    for _ in range(30):
        m.observe(1, 0.0, forward_s=0.013, head_s=0.001, accepted=[2], k=3)
    assert m.body_seconds(1) == pytest.approx(0.012)
    assert m.body_seconds(4) == pytest.approx(0.012)  # nearest measured batch size
    assert m.refresh(0.0, None, {}, {}, 8, None) is None  # no verification line yet


def test_ratio_kept_windows_per_ratio():
    rk = RatioKept((0.0, 0.5, 0.9), window=8)
    rk.add({0.5: [True, True], 0.9: [False, True]}, [True, True])
    assert rk.measured() == {0.5: (1.0, 2), 0.9: (0.5, 2)}
    rk.reset()
    assert rk.measured() == {}


def test_decoder_reports_every_ratio_after_warmup(tiny_llama_pair, caplog):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, shadow_every=1)
    assert dec.ratio_report is None
    with caplog.at_level(logging.INFO, logger="slimspec.ratios"):
        dec.warmup()
    rep = dec.ratio_report
    assert rep is not None and set(rep.points) == set(RATIO_LADDER)
    assert "ratio predictions" in caplog.text  # logged at start
    assert all(p.speedup > 0 and 0 <= p.head_share <= 1 for p in rep.points.values())
    # serving at ratio 0, the shadow check still measures the other ratios
    for p in prompts(3, TINY_VOCAB, seed=7):
        dec.generate(p, 40, stop_token_ids=[])
    rep = dec.ratio_report
    assert set(rep.kept_measured) == {r for r in RATIO_LADDER if r > 0}
    assert all(0 <= k <= 1.5 for k in rep.kept_measured.values())
    assert "best" in describe(rep)


def test_metrics_export_the_report(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.5, shadow_every=1)
    m = Metrics(enable_gpu=False)
    before = m.render().decode()
    assert 'slimspec_compression_can_help_info{reason="not_measured"} 1.0' in before
    assert "slimspec_ratio_predicted_speedup{" not in before
    dec.warmup()
    dec.generate(prompts(1, TINY_VOCAB, seed=9)[0], 40, stop_token_ids=[])
    m.observe_step(dec, 1)
    text = m.render().decode()
    for label in ("0.0", "0.3", "0.5", "0.95"):
        assert f'slimspec_ratio_predicted_speedup{{ratio="{label}"}}' in text
        assert f'slimspec_draft_head_share{{ratio="{label}"}}' in text
    assert 'slimspec_ratio_kept_acceptance{ratio="0.8"}' in text
    assert "slimspec_ratio_best " in text and "slimspec_compression_can_help " in text
    assert 'slimspec_compression_can_help_info{reason="not_measured"} 0.0' in text
    assert 'slimspec_head_ranking_source_info{source="calibration"} 1.0' in text
    assert "slimspec_head_ranking_coverage " in text
    assert "slimspec_head_reranks_total 0.0" in text
    age = next(
        ln for ln in text.splitlines() if ln.startswith("slimspec_head_ranking_age_seconds ")
    )
    assert float(age.split()[1]) >= 0


def test_the_rest_of_a_step_is_a_running_estimate_per_batch_size():
    m = RatioMonitor()
    assert m.other_seconds(1) == 0.0  # nothing measured: the model adds nothing
    for _ in range(40):
        m.observe(1, 0.0, forward_s=0.013, head_s=0.001, accepted=[2], k=3, other_s=0.005)
    m.observe(1, 0.0, forward_s=0.013, head_s=0.001, accepted=[2], k=3, other_s=-1e-4)
    assert m.other_seconds(1) == pytest.approx(0.004, rel=0.01)  # negative jitter reads 0
    assert m.other_seconds(6) == pytest.approx(0.004, rel=0.01)  # nearest measured batch size


def test_decoder_measures_the_rest_of_a_step_and_predicts_with_it(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, shadow_every=1)
    dec.warmup()
    for p in prompts(2, TINY_VOCAB, seed=11):
        dec.generate(p, 40, stop_token_ids=[])
    monitor = dec._compressed.monitor
    rep = dec._compressed.refresh(dec._settings.snapshot())  # a report from the latest estimate
    assert rep is not None and monitor.other
    other = monitor.other_seconds(rep.rows)
    assert other > 0.0  # a real step does more than draft and verify (sampling, upkeep)
    # the report's predictions pay it: each point's step holds it, and its share is it
    for p in rep.points.values():
        assert p.other_share == pytest.approx(other / p.step_s)
        assert 0.0 < p.other_share < 1.0


def test_the_time_between_steps_while_rows_decode_is_part_of_a_step(tiny_llama_pair, monkeypatch):
    # Serving, the scheduler delivers tokens and updates metrics between two steps:
    # time the served rate pays per step, so the rest of a step includes it. Idle
    # time with nothing decoding does not count.
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3)
    dec.warmup()
    gaps: list[float] = []
    real = dec._speculate

    def spy(started: float, gap: float):
        gaps.append(gap)
        return real(started, gap)

    monkeypatch.setattr(dec, "_speculate", spy)
    prompt = prompts(1, TINY_VOCAB, seed=13)[0]
    dec.add_request(GenerationRequest("a", prompt, 40, SamplingParams(), frozenset()))
    dec.step()
    time.sleep(0.05)
    dec.step()
    assert gaps[0] == 0.0 and gaps[1] >= 0.05
    while dec.has_work():
        dec.step()
    gaps.clear()
    time.sleep(0.05)
    dec.add_request(GenerationRequest("b", prompt, 40, SamplingParams(), frozenset()))
    dec.step()
    assert gaps == [0.0]


def test_a_joining_row_starts_from_the_acceptance_the_decoder_measured(tiny_llama_pair):
    # A fixed 0.67 prior made adaptive k skip drafting for short requests of a pair
    # that accepts far more: the row's own estimate came too late to matter.
    target, draft = tiny_llama_pair
    # fixed k, no lookup drafts: the acceptance measured is then the same on every run
    # (adaptive choices follow timings; under load it once measured 0.705, near the prior)
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.0, num_draft_tokens=3, lookup_tokens=0
    )
    first, second = prompts(2, TINY_VOCAB, seed=17)
    dec.generate(first, 40, stop_token_ids=[])
    measured = dec._compressed.monitor.acceptance.alpha
    assert abs(measured - 2 / 3) > 0.05  # a measurement, not the prior
    made = []
    prior = dec._batch.acceptance_prior
    dec._batch.acceptance_prior = lambda: made.append((est := prior(), est.alpha)) or est
    dec.add_request(GenerationRequest("next", second, 8))
    row = None
    while row is None and dec.has_work():
        dec.step()
        row = next((r for r in dec._batch.rows if r.req.request_id == "next"), None)
    assert row is not None and len(made) == 1 and row.est is made[0][0]
    assert made[0][1] == pytest.approx(measured)
