"""Sampling through the whole decoder follows the target distribution; a wrong rule fails.

Both exact rules are checked: rejection sampling (unseeded requests) and the Gumbel-max
coupling (seeded requests)."""

from __future__ import annotations

import pytest
import torch
from slimspec import SpeculativeDecoder
from slimspec.decoding import sampling as S
from slimspec.decoding.types import GenerationRequest, SamplingParams

from tests.engine.test_sampling import _wrong_rule
from tests.support.tiny_models import tiny_model

V = 16
N = 3000
PROMPT = [3, 7, 5]


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_model("llama", seed=21, vocab=V, seed_scale=0.5)
    draft = tiny_model("llama", seed=22, vocab=V, hidden=32, layers=1, seed_scale=0.5)
    return target, draft


@torch.inference_mode()
def _exact_joint(target, sp: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """P(x1, x2) of the target under the warped distribution, by enumeration."""
    params = S.sampling_tensors([sp])

    def dist(seq):
        logits = target(torch.tensor([seq])).logits[:, -1]
        return S.warp_probs(logits, *params)[0]

    p1 = dist(prompt)
    joint = torch.zeros(V, V)
    for x1 in range(V):
        if p1[x1] > 0:
            joint[x1] = p1[x1] * dist([*prompt, x1])
    return joint


def _speculative_joint(
    target, draft, sp: SamplingParams, ratio: float, seeded: bool, prompt: list[int] = PROMPT
) -> torch.Tensor:
    dec = SpeculativeDecoder.from_models(
        target, draft, compression_ratio=ratio, num_draft_tokens=2, prefill_batch=256
    )
    reqs = [
        GenerationRequest(
            f"s{i}",
            prompt,
            2,
            SamplingParams(sp.temperature, sp.top_k, sp.top_p, i if seeded else None),
        )
        for i in range(N)
    ]
    counts = torch.zeros(V, V)
    for res in dec.generate_batch(reqs):
        x1, x2 = res.output_ids
        counts[x1, x2] += 1
    return counts / N, dec.stats


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def _noise_threshold(joint: torch.Tensor) -> float:
    """TV that plain sampling of N draws from the exact joint stays under (mean + 5 sd)."""
    g = torch.Generator().manual_seed(0)
    tvs = []
    for _ in range(40):
        idx = torch.multinomial(joint.flatten(), N, replacement=True, generator=g)
        emp = torch.bincount(idx, minlength=V * V).float().view(V, V) / N
        tvs.append(_tv(emp, joint))
    t = torch.tensor(tvs)
    return (t.mean() + 5 * t.std()).item()


def _wrong_coupling(p, noise, draft_tokens):
    """Negative control for the coupling: accept every draft (the output then follows the
    draft's distribution where it proposed)."""
    choice = S.coupled_choice(p, noise)
    k = draft_tokens.shape[1]
    return torch.full((p.shape[0],), k, dtype=torch.long), choice[:, k]


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
@pytest.mark.parametrize(
    "sp,ratio",
    [
        (SamplingParams(temperature=1.0), 0.5),
        (SamplingParams(temperature=1.5, top_k=10, top_p=0.95), 0.0),
    ],
)
def test_sampled_outputs_follow_target_distribution(
    small_vocab_pair, sp, ratio, seeded, monkeypatch
):
    stats = _follows_exact_joint(small_vocab_pair, sp, ratio, seeded, monkeypatch)
    assert 0 < stats.accepted < stats.drafted  # acceptances and rejections both happened


def _follows_exact_joint(pair, sp, ratio, seeded, monkeypatch, prompt=PROMPT):
    """The speculative joint of two sampled tokens is within sampling noise of the exact
    one, and (negative control) the same check catches a wrong acceptance rule; the
    good run's stats."""
    target, draft = pair
    joint = _exact_joint(target, sp, prompt)
    threshold = _noise_threshold(joint)
    emp, stats = _speculative_joint(target, draft, sp, ratio, seeded, prompt)
    tv = _tv(emp, joint)
    assert tv < threshold, (tv, threshold)
    if seeded:
        monkeypatch.setattr(S, "verify_coupled", _wrong_coupling)
    else:
        monkeypatch.setattr(S, "verify_rejection", _wrong_rule)
    tv_bad = _tv(_speculative_joint(target, draft, sp, ratio, seeded, prompt)[0], joint)
    assert tv_bad > threshold, (tv_bad, threshold)
    return stats


def test_seeded_runs_reproduce(tiny_llama_pair):
    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    a = dec.generate([5, 9, 11], 30, sp, stop_token_ids=[]).output_ids
    b = dec.generate([5, 9, 11], 30, sp, stop_token_ids=[]).output_ids
    c = dec.generate([5, 9, 11], 30, SamplingParams(0.9, 0, 0.95, 99), stop_token_ids=[]).output_ids
    assert a == b
    assert a != c


def test_seeded_output_independent_of_k_and_batch(tiny_llama_pair):
    """Randomness is keyed by (seed, position): the schedule does not change a seeded output."""
    target, draft = tiny_llama_pair
    sp = SamplingParams(temperature=1.0, seed=77)
    outs = []
    for k in (1, 2, 5, None):
        dec = SpeculativeDecoder.from_models(
            target, draft, compression_ratio=0.3, num_draft_tokens=k
        )
        others = [GenerationRequest(f"o{i}", [9 + i] * (i + 1), 7 + i) for i in range(k or 3)]
        mine = GenerationRequest("mine", [5, 9, 11], 30, sp)
        res = dec.generate_batch([*others, mine])
        outs.append(res[-1].output_ids)
    assert all(o == outs[0] for o in outs), outs


def test_mixed_greedy_and_sampling_batch(tiny_llama_pair):
    from tests.engine.helpers import target_greedy

    target, draft = tiny_llama_pair
    dec = SpeculativeDecoder.from_models(target, draft, compression_ratio=0.3, num_draft_tokens=3)
    reqs = [
        GenerationRequest("g", [4, 8, 15], 20),
        GenerationRequest("s", [16, 23, 42], 20, SamplingParams(temperature=1.0, seed=7)),
    ]
    res = dec.generate_batch(reqs)
    assert res[0].output_ids == target_greedy(target, [4, 8, 15], 20)
    assert len(res[1].output_ids) == 20


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
def test_lookup_drafts_follow_target_distribution(small_vocab_pair, seeded, monkeypatch):
    """Steps that verify lookup drafts (a point mass q on each copied token) keep the
    target's distribution; the same negative controls must fail."""
    from slimspec.decoding.lookup import LookupDrafts

    def always(self, plan, draft_alphas, draft_k, costs, max_tokens):
        return min(2, max_tokens) if any(plan.ns) else 0

    monkeypatch.setattr(LookupDrafts, "choose", always)
    # [3, 8] proposes 10 (p 0.41), 3: the rule is wrong where it matters
    sp, prompt = SamplingParams(temperature=1.0), [3, 8, 10, 3, 8]
    stats = _follows_exact_joint(small_vocab_pair, sp, 0.3, seeded, monkeypatch, prompt)
    # every request's first step verifies a lookup draft; both branches of the rule ran
    assert stats.lookup_verifications >= N and 0 < stats.lookup_accepted < stats.lookup_drafted
