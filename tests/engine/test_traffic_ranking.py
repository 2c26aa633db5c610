"""The head follows the traffic (draft_head/traffic.py, traffic_store.py): pure ranking
decisions, persistence, the swap between steps, and exactness before and after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.draft_head.artifact import CalibrationArtifact
from slimspec.draft_head.head import DraftHead, HeadConfig, fit_activation_aware
from slimspec.draft_head.traffic import (
    PROMPT_WEIGHT,
    TrafficRanking,
    blended_ranking,
    coverage,
    inverse,
    rerank_due,
    zipf_prior,
)
from slimspec.draft_head.traffic_store import (
    default_counts_path,
    load_counts,
    resolve_counts_path,
    save_counts,
)

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB


def test_tokens_seen_in_traffic_enter_the_subset_and_the_rest_keeps_its_order():
    v = 50_000
    cal = torch.arange(v)  # calibration: token id order
    counts = torch.zeros(v, dtype=torch.float64)
    counts[[40_000, 45_000]] = 3.0  # traffic emitted two tokens the calibration ranked last
    new = blended_ranking(zipf_prior(cal), counts, cal, first=[1])
    assert new[0] == 1  # special tokens stay in front
    rank_of = inverse(new)
    assert rank_of[40_000] < 5000 and rank_of[45_000] < 5000  # inside a 10% subset now
    rest = [int(t) for t in new.tolist() if t not in (1, 40_000, 45_000)]
    assert rest == sorted(rest)  # everything else keeps the calibration order: prefix-stable
    # no traffic: the calibration ranking exactly
    assert torch.equal(
        blended_ranking(zipf_prior(cal), torch.zeros(v, dtype=torch.float64), cal), cal
    )


def test_traffic_outweighs_the_calibration_prior_as_it_grows():
    v = 500
    cal = torch.arange(v)
    counts = torch.zeros(v, dtype=torch.float64)
    counts[400:] = 1000.0  # a lot of traffic on the 100 tokens calibration ranked last
    new = blended_ranking(zipf_prior(cal), counts, cal)
    assert set(range(400, 500)) <= set(new[:105].tolist())  # only the prior's very top stays above


def test_coverage_and_when_to_rerank():
    ranking = torch.tensor([3, 1, 0, 2])
    rank_of = inverse(ranking)
    assert coverage(torch.tensor([3, 1, 0, 2]), rank_of, 2) == 0.5
    assert coverage(torch.tensor([], dtype=torch.long), rank_of, 2) == 1.0
    assert rerank_due(300, 0.9, 10.0, False)
    assert not rerank_due(300, 0.9, 10.0, True)  # one at a time
    assert not rerank_due(100, 0.5, 10.0, False)  # too few new tokens
    assert not rerank_due(300, 0.9, 0.5, False)  # too soon after the last
    assert not rerank_due(300, 0.999, 10.0, False)  # the subset covers the traffic
    assert rerank_due(9000, 0.999, 10.0, False)  # periodic


def test_counts_round_trip_and_bad_files_are_ignored(tmp_path: Path):
    p = tmp_path / "c.safetensors"
    counts = torch.arange(10, dtype=torch.float64)
    save_counts(p, counts, 123.0)
    got, at = load_counts(p, 10)
    assert torch.equal(got, counts) and at == 123.0
    assert load_counts(p, 11) is None  # another vocabulary
    p.write_bytes(b"not a safetensors file")
    assert load_counts(p, 10) is None
    assert load_counts(tmp_path / "missing", 10) is None


def test_counts_path_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("SLIMSPEC_TRAFFIC_COUNTS", raising=False)
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))
    assert resolve_counts_path(None, None, 10) is None  # in-memory models: nothing persisted
    assert (
        resolve_counts_path(None, "/m/qwen 0.5b/", 10)
        == tmp_path / "traffic/qwen_0.5b-10.safetensors"
    )
    assert default_counts_path("x", 5).parent == tmp_path / "traffic"
    assert resolve_counts_path("none", "x", 10) is None
    monkeypatch.setenv("SLIMSPEC_TRAFFIC_COUNTS", str(tmp_path / "f"))
    assert resolve_counts_path(None, "x", 10) == tmp_path / "f"


def test_reranked_head_keeps_low_rank_rows_with_their_tokens():
    torch.manual_seed(0)
    w = torch.randn(64, 16)
    h = torch.randn(256, 16)
    ranking = torch.randperm(64)
    a, b = fit_activation_aware(w.index_select(0, ranking)[:32], h, 8)
    head = DraftHead(w, ranking, a=a, b=b)
    new_ranking = torch.cat([ranking[32:], ranking[:32]])  # the low-rank rows' tokens move out
    new = blended_ranking(zipf_prior(ranking), torch.zeros(64, dtype=torch.float64), new_ranking)
    re = head.reranked(new)
    assert re is not head and torch.equal(head.ranking, ranking)  # the old head is untouched
    cfg = HeadConfig(32, 8)
    x = torch.randn(5, 16)
    # tokens that stayed in the low-rank rows get the same logits as before
    old_logits = dict(zip(head.token_ids(cfg).tolist(), head.logits(x, cfg).T, strict=True))
    for tok, col in zip(re.token_ids(cfg).tolist(), re.logits(x, cfg).T, strict=True):
        if tok in old_logits:
            assert torch.allclose(col, old_logits[tok], atol=1e-5)
    # full-rank subsets are exact rows of the head whatever the ranking
    full = HeadConfig(64, None)
    assert torch.allclose(re.logits(x, full), (x @ w.T)[:, re.token_ids(full)], atol=1e-5)


def _bad_ranking(target, p: list[int], n: int) -> CalibrationArtifact:
    produced = set(target_greedy(target, p, n))
    order = [t for t in range(TINY_VOCAB) if t not in produced] + sorted(produced)
    return CalibrationArtifact(torch.tensor(order))


def test_rerank_swaps_between_steps_and_output_stays_exact(tiny_llama_pair):
    """fp32 greedy output equals plain greedy before and after a re-rank; the re-rank
    puts the tokens the target emits inside the subset of the ratio in force."""
    target, draft = tiny_llama_pair
    p = prompts(1, TINY_VOCAB, seed=41, lengths=(7,))[0]
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.8, num_draft_tokens=3,
        calibration=_bad_ranking(target, p, 60), fallback_strategy="none",
    )  # fmt: skip
    traffic = dec._compressed.traffic
    traffic.min_new_tokens = 10**9  # no re-rank during the first request
    want = target_greedy(target, p, 60)
    before_head = dec.head
    assert dec.generate(p, 60, stop_token_ids=[]).output_ids == want
    cover_before = dec.ranking_status().coverage
    # a 96-token vocabulary: let 60 tokens of traffic outweigh the calibration prior
    traffic.min_new_tokens, traffic.min_interval_s, traffic.prior_tokens = 16, 0.0, 1
    assert traffic.maybe_start(dec.head, dec.head_config().subset_size)
    assert traffic._thread is not None and not traffic._thread.daemon  # exit waits for it
    traffic.wait(30)
    # ready, but swapped in only at the start of the next step
    assert dec.head is before_head and dec.ranking_status().source == "calibration"
    assert dec.generate(p, 60, stop_token_ids=[]).output_ids == want
    status = dec.ranking_status()
    assert status.source == "traffic" and status.reranks >= 1
    assert dec.head is not before_head
    # the subset now holds the most frequent emitted tokens: as much coverage as any
    # subset of its size could have of what was emitted
    size = dec.head_config().subset_size
    emitted = torch.tensor(list(traffic.recent))
    best = float(torch.bincount(emitted).sort(descending=True).values[:size].sum()) / len(emitted)
    assert cover_before < 0.2 < best - 0.05 <= status.coverage
    assert dec.stats.acceptance_rate > 0


def test_counts_persist_for_the_next_decoder(tiny_llama_pair, tmp_path: Path):
    target, draft = tiny_llama_pair
    p = prompts(1, TINY_VOCAB, seed=42, lengths=(5,))[0]
    path = tmp_path / "counts.safetensors"
    art = _bad_ranking(target, p, 40)
    kw = dict(compression_ratio=0.8, num_draft_tokens=2, calibration=art, traffic_counts=path)
    dec = SpeculativeDecoder.from_models(target, draft, **kw)
    dec._compressed.traffic.min_new_tokens = 16
    dec._compressed.traffic.min_interval_s = 0.0
    dec._compressed.traffic.prior_tokens = 1
    dec.generate(p, 40, stop_token_ids=[])
    dec._compressed.traffic.wait(30)
    assert path.is_file()
    fresh = SpeculativeDecoder.from_models(target, draft, **kw)  # a restart / new replica
    assert fresh.generate(p, 40, stop_token_ids=[]).output_ids == target_greedy(target, p, 40)
    assert fresh.ranking_status().source == "traffic"
    saved, _ = load_counts(path, TINY_VOCAB)
    assert fresh._compressed.traffic.total >= float(saved.sum()) > 0  # it started from them


def test_rerank_can_be_switched_off(tiny_llama_pair, monkeypatch: pytest.MonkeyPatch):
    target, draft = tiny_llama_pair
    monkeypatch.setenv("SLIMSPEC_HEAD_RERANK", "0")
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.5)
    traffic: TrafficRanking = dec._compressed.traffic
    traffic.min_new_tokens, traffic.min_interval_s = 1, 0.0
    dec.generate(prompts(1, TINY_VOCAB, seed=3)[0], 30, stop_token_ids=[])
    assert dec.ranking_status().reranks == 0 and traffic.total == 0
    with pytest.raises(ValueError):
        SpeculativeDecoder.from_models(target, draft, rerank_from_traffic="yes")


def test_prompts_count_at_a_lower_weight_and_warmup_not_at_all(tiny_llama_pair):
    """A request's prompt is evidence of its domain before anything is emitted: its
    distinct tokens are counted (once each, at PROMPT_WEIGHT, outside the coverage
    window); the warm-up's are not."""
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.5)
    traffic: TrafficRanking = dec._compressed.traffic
    traffic.min_new_tokens = 10**9  # counting only
    dec.warmup()
    warm, warm_recent = traffic.counts.clone(), len(traffic.recent)
    assert float(warm.sum()) == 0 and warm_recent == 0  # neither prompts nor tokens
    p = prompts(1, TINY_VOCAB, seed=44, lengths=(9,))[0]
    p = p + p[:3]  # repeated tokens count once: which words, not how often
    out = dec.generate(p, 1, stop_token_ids=[]).output_ids  # one emitted token
    want = torch.zeros(TINY_VOCAB, dtype=torch.float64)
    want[sorted(set(p))] = PROMPT_WEIGHT
    want[out[-1]] += 1.0
    assert torch.allclose(traffic.counts - warm, want)
    # the coverage window holds what the target emitted, not the prompt
    assert len(traffic.recent) == warm_recent + 1 and traffic.recent[-1] == out[-1]


def test_rerank_now_swaps_a_traffic_ranked_head_in_and_can_freeze_it(tiny_llama_pair):
    """The benchmarks' last re-rank: on everything counted, swapped in on return, and
    frozen (no counting, no re-rank) when asked; output stays the target's."""
    target, draft = tiny_llama_pair
    p = prompts(1, TINY_VOCAB, seed=45, lengths=(7,))[0]
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.8, num_draft_tokens=3,
        calibration=_bad_ranking(target, p, 40), fallback_strategy="none",
    )  # fmt: skip
    traffic = dec._compressed.traffic
    traffic.min_new_tokens, traffic.prior_tokens = 10**9, 1  # never due by itself
    want = target_greedy(target, p, 40)
    assert dec.generate(p, 40, stop_token_ids=[]).output_ids == want
    before = dec.head
    assert dec.ranking_status().reranks == 0
    assert dec.rerank_now(timeout=30, freeze=True)
    assert dec.head is not before and dec.ranking_status().source == "traffic"
    counted = float(traffic.total)
    assert dec.generate(p, 40, stop_token_ids=[]).output_ids == want
    assert float(traffic.total) == counted and dec.ranking_status().reranks == 1
    assert not dec.rerank_now(timeout=30)  # frozen: nothing more to swap in
