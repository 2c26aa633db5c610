"""Compressed head: ratio arithmetic, activation-aware fit, calibration artifact round trip."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.calibrate import main
from slimspec.cpu import native_kernels
from slimspec.draft_head.artifact import (
    find_artifact,
    load_artifact,
    ranking_from_counts,
    save_artifact,
)
from slimspec.draft_head.calibrate import calibrate
from slimspec.draft_head.head import DraftHead, HeadConfig, check_ratio, fit_activation_aware

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB


@pytest.mark.parametrize("bad", [-0.01, 0.951, 1.0, "0.3", True, None, float("nan")])
def test_ratio_out_of_range_is_a_value_error(bad):
    with pytest.raises(ValueError, match="compression_ratio"):
        check_ratio(bad)


def test_head_config_cost_and_ratio():
    d, v = 100, 1000
    assert HeadConfig(v, None).ratio(d, v) == 0.0
    assert HeadConfig(200, None).ratio(d, v) == pytest.approx(0.8)
    assert HeadConfig(1000, 10).ratio(d, v) == pytest.approx(1 - 10 * 1100 / 100_000)


def test_subset_logits_are_the_full_logits_of_ranked_tokens():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 8, generator=g)
    ranking = torch.randperm(50, generator=g)
    head = DraftHead(w, ranking)
    h = torch.randn(3, 8, generator=g)
    cfg = HeadConfig(20, None)
    full = h @ w.T
    assert torch.allclose(head.logits(h, cfg), full[:, head.token_ids(cfg)], atol=1e-5)


@pytest.mark.skipif(native_kernels.load() is None, reason="no native kernels on this CPU")
@pytest.mark.parametrize(("bits", "error"), [(8, 0.03), (4, 0.2)])
def test_low_bit_subset_rows_track_the_bf16_head(monkeypatch, bits, error):
    """int8 / int4 ranked rows (use_low_bit): every subset size (not only multiples of
    the row blocks) scores the same tokens, within the bits' error of the bf16 head;
    low-rank configurations are left as they were; no native kernels, no switch."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(203, 128, generator=g) * 0.05).bfloat16()
    ranking = torch.randperm(203, generator=g)
    a, b = torch.randn(16, 128, generator=g), torch.randn(203, 16, generator=g)
    head = DraftHead(w, ranking, a=a, b=b)
    h = torch.randn(3, 128, generator=g).bfloat16()
    want = {n: head.logits(h, HeadConfig(n, None)).float() for n in (1, 6, 100, 203)}
    low_rank = head.logits(h, HeadConfig(100, 8))
    assert head.use_low_bit(bits)
    for n, ref in want.items():
        got = head.logits(h, HeadConfig(n, None)).float()
        assert got.shape == (3, n)
        assert (got - ref).norm() / ref.norm() < error
    assert torch.equal(head.logits(h, HeadConfig(100, 8)), low_rank)
    monkeypatch.setattr(native_kernels, "load", lambda: None)
    assert not DraftHead(w, ranking).use_low_bit(8)


@pytest.mark.skipif(native_kernels.load() is None, reason="no native kernels on this CPU")
@pytest.mark.parametrize("bits", [4, 8])
def test_a_reranked_heads_low_bit_rows_are_the_ones_quantising_gives(bits):
    """A re-rank moves the quantised rows (each row quantised on its own) instead of
    quantising the head again: the copy, its padding rows (203 is not a multiple of the
    4-row blocks) and bias included, is exactly use_low_bit's for the new ranking."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(203, 128, generator=g) * 0.05).bfloat16()
    bias = torch.randn(203, generator=g).bfloat16()
    head = DraftHead(w, torch.randperm(203, generator=g), bias=bias)
    assert head.use_low_bit(bits)
    new_ranking = torch.randperm(203, generator=g)
    moved = head.reranked(new_ranking)
    fresh = DraftHead(w, new_ranking, bias=bias)
    assert fresh.use_low_bit(bits) and moved.low_bit_bits == bits
    a, b = moved._low_bit, fresh._low_bit
    for x, y in ((a.packed, b.packed), (a.scale, b.scale), (a.low, b.low), (a.bias, b.bias)):
        assert torch.equal(x, y)
    h = torch.randn(5, 128, generator=g).bfloat16()
    for n in (1, 7, 203):
        assert torch.equal(
            moved.logits(h, HeadConfig(n, None)), fresh.logits(h, HeadConfig(n, None))
        )


def test_full_argmax_is_the_ratio_0_head_of_the_draft():
    """The shadow check's reference: the original head's pick, or with low-bit rows the
    pick of all of them (what ratio 0 scores), in token ids, for (B, k, d) states."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(203, 128, generator=g) * 0.05).bfloat16()
    ranking = torch.randperm(203, generator=g)
    head = DraftHead(w, ranking)
    h = torch.randn(2, 3, 128, generator=g).bfloat16()
    assert torch.equal(head.full_argmax(h), head.full_logits(h).argmax(-1))
    if head.use_low_bit(8):
        full = head.logits(h, HeadConfig(203, None))
        assert full.shape == (2, 3, 203)
        assert torch.equal(head.full_argmax(h), ranking[full.argmax(-1)])


def _agreement(w, a, b, h):
    return ((h @ w.T).argmax(1) == ((h @ a.T) @ b.T).argmax(1)).float().mean().item()


def test_activation_aware_fit_beats_plain_svd():
    g = torch.Generator().manual_seed(1)
    d, v, n = 64, 400, 4000
    w = torch.randn(v, d, generator=g)
    # Hidden states live mostly in a few directions that are NOT W's top singular directions.
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    scales = torch.cat([torch.full((6,), 10.0), torch.full((d - 6,), 0.05)])
    h = (torch.randn(n, d, generator=g) * scales) @ basis.T
    a, b = fit_activation_aware(w, h[: n // 2], max_rank=8)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    plain_a, plain_b = vh[:8], u[:, :8] * s[:8]
    aa = _agreement(w, a, b, h[n // 2 :])
    plain = _agreement(w, plain_a, plain_b, h[n // 2 :])
    assert aa > 0.9, aa
    assert aa > plain + 0.3, (aa, plain)
    # nested ranks: a prefix of the factors is the fit for a smaller rank
    assert _agreement(w, a[:6], b[:, :6], h[n // 2 :]) > 0.85


def test_distillation_lowers_held_out_kl_and_keeps_prefixes_usable():
    """A short distillation from the full head lowers the held-out KL of the activation-aware
    fit at every nested rank. (Argmax agreement need not follow on this synthetic head,
    which is why calibrate() keeps distilled factors only when agreement rises.)"""
    from slimspec.draft_head.head import distill_low_rank, low_rank_kl

    g = torch.Generator().manual_seed(2)
    d, v, n = 48, 300, 3000
    w = torch.randn(v, d, generator=g)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    scales = torch.linspace(3.0, 0.3, d)
    h = (torch.randn(n, d, generator=g) * scales) @ basis.T
    fit, held = h[:2000], h[2000:]
    a, b = fit_activation_aware(w, fit, max_rank=16)
    a2, b2 = distill_low_rank(a, b, w, fit, ranks=[4, 8, 16], steps=150, lr=3e-3)
    for r in (4, 8, 16):
        assert low_rank_kl(a2, b2, w, held, r) < 0.9 * low_rank_kl(a, b, w, held, r), r
    assert a2.shape == a.shape and b2.shape == b.shape


def test_calibrate_with_distillation_records_and_keeps_only_gains(tiny_llama_pair):
    target, draft = tiny_llama_pair
    corpus = _self_generated_corpus(target, seed=0)
    held_out = _self_generated_corpus(target, seed=1)
    art = calibrate(
        draft, corpus, held_out, target=target, seq_len=64, distill_steps=20, log=lambda m: None
    )
    info = art.meta["distillation"]
    assert info["steps"] == 20
    assert info["kept"] == (
        info["mean_lowrank_agreement_after"] > info["mean_lowrank_agreement_before"]
    )
    assert art.table and art.table[0]["compression_ratio"] == 0.0


def test_ranking_puts_special_tokens_first_then_frequency():
    from collections import Counter

    r = ranking_from_counts(Counter({5: 10, 3: 7, 9: 7}), 12, first=[1, 5])
    assert r.tolist()[:5] == [1, 5, 3, 9, 0]
    assert sorted(r.tolist()) == list(range(12))


@torch.inference_mode()
def _self_generated_corpus(model, n_seqs=6, length=96, seed=0):
    """Token streams sampled from the target itself (the 'target's own generations' corpus)."""
    torch.manual_seed(seed)
    start = torch.randint(3, TINY_VOCAB, (n_seqs, 2))
    out = model.generate(
        start,
        attention_mask=torch.ones_like(start),
        do_sample=True,
        top_k=0,
        max_new_tokens=length,
        min_new_tokens=length,
        pad_token_id=0,
    )
    return out.flatten().tolist()


@pytest.fixture(scope="module")
def tiny_artifact(tiny_llama_pair):
    target, draft = tiny_llama_pair
    corpus = _self_generated_corpus(target, seed=0)
    held_out = _self_generated_corpus(target, seed=1)
    return calibrate(draft, corpus, held_out, target=target, seq_len=64, log=lambda m: None)


def test_calibration_table_and_round_trip(tiny_artifact, tmp_path):
    art = tiny_artifact
    assert art.a is not None and art.b is not None
    ratios = [row["compression_ratio"] for row in art.table]
    assert ratios[0] == 0.0 and ratios == sorted(ratios)
    first = art.table[0]
    assert first["subset_size"] == TINY_VOCAB and first["rank"] is None and first["kept"] == 1.0
    assert all(row["head_ratio"] >= row["compression_ratio"] - 1e-9 for row in art.table)
    assert any(c["rank"] is not None for c in art.candidates)
    save_artifact(art, tmp_path / "cal")
    back = load_artifact(tmp_path / "cal")
    assert torch.equal(back.ranking, art.ranking)
    assert torch.allclose(back.a, art.a) and torch.allclose(back.b, art.b)
    assert back.table == art.table and back.candidates == art.candidates
    for r in (0.0, 0.3, 0.7, 0.95):
        assert back.config_for(r, 64) == art.config_for(r, 64)


def test_decoder_with_artifact_low_rank_head_is_exact(tiny_llama_pair, tiny_artifact, tmp_path):
    target, draft = tiny_llama_pair
    art = tiny_artifact
    # Force low-rank heads: keep only low-rank candidates.
    art_lr = type(art)(
        art.ranking, art.a, art.b, [c for c in art.candidates if c["rank"]], [], art.meta
    )
    save_artifact(art_lr, tmp_path / "lr")
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=0.5, num_draft_tokens=3, calibration=tmp_path / "lr"
    )
    assert dec.head_config().rank is not None
    for p in prompts(2, TINY_VOCAB, seed=12):
        assert dec.generate(p, 20, stop_token_ids=[]).output_ids == target_greedy(target, p, 20)
    # switching the ratio is a slice: same tensors, new config
    before = dec.head.a.data_ptr()
    dec.set_compression_ratio(0.9)
    assert dec.head_config().cost(64) < HeadConfig(TINY_VOCAB, None).cost(64) * 0.11
    assert dec.head.a.data_ptr() == before


def test_artifact_found_next_to_draft(tmp_path, tiny_artifact):
    assert find_artifact(tmp_path) is None
    save_artifact(tiny_artifact, tmp_path / "slimspec-calibration")
    assert find_artifact(tmp_path) == tmp_path / "slimspec-calibration"


def test_artifact_for_another_vocabulary_is_rejected(tiny_llama_pair, tiny_artifact):
    target, draft = tiny_llama_pair
    wrong = type(tiny_artifact)(torch.arange(TINY_VOCAB - 1), None, None, [], [], {})
    with pytest.raises(ValueError, match="calibration artifact ranks"):
        SpeculativeDecoder.from_models(target, draft, calibration=wrong)


def test_calibrate_cli_missing_draft(tmp_path, capsys):
    assert main(["--draft", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
