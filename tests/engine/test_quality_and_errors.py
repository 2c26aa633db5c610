"""Quality control (shadow check + auto fallback) and clear errors for bad inputs."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding.quality import (
    REASON_QUALITY,
    fallback_decision,
    kept_share,
    next_lower_ratio,
)
from slimspec.decoding.types import GenerationRequest
from slimspec.draft_head.artifact import CalibrationArtifact
from slimspec.draft_head.head import check_vocab_size
from slimspec.weights.loading import check_same_vocabulary

from tests.engine.helpers import prompts, target_greedy
from tests.support.tiny_models import TINY_VOCAB, tiny_model


def test_fallback_decision_pure():
    ladder = [0.0, 0.3, 0.5, 0.8]
    assert next_lower_ratio(0.8, ladder) == 0.5
    assert next_lower_ratio(0.3, ladder) == 0.0
    assert kept_share(9, 10) == 0.9 and kept_share(0, 0) == 1.0
    args = dict(threshold=0.95, strategy="auto", current_ratio=0.8, ladder=ladder, min_samples=64)
    assert fallback_decision(0.9, 100, **args) == 0.5
    assert fallback_decision(0.96, 100, **args) is None
    assert fallback_decision(0.5, 10, **args) is None  # not enough evidence yet
    assert fallback_decision(0.5, 100, **{**args, "strategy": "none"}) is None
    assert fallback_decision(0.5, 100, **{**args, "current_ratio": 0.0}) is None


def _bad_ranking_artifact(target, prompt_ids):
    """A ranking that puts the tokens the target actually produces last: subsets miss them."""
    produced = set(target_greedy(target, prompt_ids, 40))
    order = [t for t in range(TINY_VOCAB) if t not in produced] + sorted(produced)
    return CalibrationArtifact(torch.tensor(order), meta={"note": "deliberately bad"})


@pytest.mark.parametrize("strategy", ["auto", "none"])
def test_fallback_triggers_and_output_stays_exact(tiny_llama_pair, strategy):
    target, draft = tiny_llama_pair
    p = prompts(1, TINY_VOCAB, seed=30, lengths=(6,))[0]
    dec = SpeculativeDecoder.from_models(
        target,
        draft,
        compression_ratio=0.8,
        num_draft_tokens=3,
        calibration=_bad_ranking_artifact(target, p),
        quality_threshold=0.95,
        fallback_strategy=strategy,
        shadow_every=1,
        shadow_min_samples=12,
    )
    res = dec.generate(p, 40, stop_token_ids=[])
    assert res.output_ids == target_greedy(target, p, 40)
    assert dec.stats.shadow_samples > 0
    assert dec.stats.kept_acceptance is not None
    if strategy == "auto":
        assert dec.stats.fallbacks[REASON_QUALITY] >= 1
        assert dec.compression_ratio < 0.8
        assert dec.requested_compression_ratio == 0.8
    else:
        assert not dec.stats.fallbacks
        assert dec.compression_ratio == 0.8
    # re-sending the same ratio keeps a fallback; a new value resets it
    in_force = dec.compression_ratio
    dec.set_compression_ratio(0.8)
    assert dec.compression_ratio == in_force
    dec.set_compression_ratio(0.7)
    assert dec.compression_ratio == 0.7 == dec.requested_compression_ratio


def test_good_head_does_not_fall_back(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(
        target,
        draft,
        compression_ratio=0.1,
        num_draft_tokens=3,
        shadow_every=1,
        shadow_min_samples=12,
        quality_threshold=0.5,
    )
    dec.generate(prompts(1, TINY_VOCAB, seed=31)[0], 40, stop_token_ids=[])
    assert not dec.stats.fallbacks
    assert dec.stats.kept_acceptance >= 0.5


def test_settings_validation(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft)
    with pytest.raises(ValueError, match="compression_ratio"):
        dec.set_compression_ratio(0.99)
    with pytest.raises(ValueError, match="threshold"):
        dec.set_quality_threshold(1.5)
    with pytest.raises(ValueError, match="fallback_strategy"):
        dec.set_fallback_strategy("sometimes")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeDecoder.from_models(target, draft, num_draft_tokens=0)
    with pytest.raises(ValueError, match="compression_ratio"):
        SpeculativeDecoder.from_models(target, draft, compression_ratio=-0.1)
    dec.set_quality_threshold(0.8)
    assert dec.quality_threshold == 0.8
    assert dec.fallback_strategy == "auto"


@pytest.mark.parametrize("bad", [0, -5, 2.5, "100000", True])
def test_vocab_size_nonsense(bad):
    with pytest.raises(ValueError, match="vocab_size"):
        check_vocab_size(bad)


def test_vocab_size_caps_the_scored_subset(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, vocab_size=10)
    assert dec.head_config().subset_size == 10
    p = prompts(1, TINY_VOCAB, seed=33)[0]
    assert dec.generate(p, 16, stop_token_ids=[]).output_ids == target_greedy(target, p, 16)
    big = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.0, vocab_size=10**6)
    assert big.head_config().subset_size == TINY_VOCAB


def test_mismatched_vocab_is_rejected():
    target = tiny_model("llama", seed=0)
    draft = tiny_model("llama", seed=1, vocab=TINY_VOCAB + 32)
    with pytest.raises(ValueError, match="vocabularies differ"):
        SpeculativeDecoder.from_models(target, draft)


def test_mismatched_tokenizers_are_rejected():
    class Tok:
        def __init__(self, vocab):
            self._v = vocab

        def get_vocab(self):
            return self._v

    check_same_vocabulary(Tok({"a": 0, "b": 1}), Tok({"a": 0, "b": 1}))
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_same_vocabulary(Tok({"a": 0, "b": 1}), Tok({"a": 1, "b": 0}))


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SpeculativeDecoder(
            small_model_path=str(tmp_path / "no-draft"),
            target_model_path=str(tmp_path / "no-target"),
            dtype="float32",
            device="cpu",
        )


def test_bad_requests(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.add_request(GenerationRequest("e", [], 4))
    with pytest.raises(ValueError, match="out of range"):
        dec.add_request(GenerationRequest("o", [TINY_VOCAB + 5], 4))
    res = dec.generate([4, 5], 0)
    assert res.output_ids == [] and res.finish_reason == "length"
    with pytest.raises(ValueError, match="no tokenizer"):
        dec.generate("text prompt", 4)
