"""Pure sampling/verification decisions: the rejection rule is exact; a wrong rule fails."""

from __future__ import annotations

import pytest
import torch
from slimspec.decoding import sampling as S


def _params(b, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((b,), float(temperature)),
        torch.full((b,), int(top_k), dtype=torch.long),
        torch.full((b,), float(top_p)),
    )


def test_warp_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]])
    p = S.warp_probs(logits, *_params(1, temperature=0.0))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("vocab", [17, 30387, 151936])
def test_greedy_tokens_are_argmaxs_first_maximum_on_ties(vocab):
    """Greedy decisions take max's indices (faster than argmax on bf16); on the many
    ties of bf16 logits they must be argmax's tokens, or a greedy run would change."""
    g = torch.Generator().manual_seed(vocab)
    few_values = torch.randint(-3, 4, (5, vocab), generator=g).bfloat16()
    few_values[1, ::3] = float("-inf")
    for logits in (few_values, torch.randn(5, vocab, generator=g).bfloat16(), few_values.float()):
        assert torch.equal(S.greedy_tokens(logits), logits.argmax(dim=-1))
    assert S.greedy_tokens(torch.tensor([[1.0, 5.0, 5.0, 2.0]])).tolist() == [1]


def test_warp_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = S.warp_probs(logits, *_params(1, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = S.warp_probs(logits, *_params(1, top_p=0.7))  # 0.5 < 0.7 -> keep 0.3 too
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = S.warp_probs(logits, *_params(1, top_p=0.5))  # first token alone reaches 0.5
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    p = S.warp_probs(logits, *_params(1, temperature=2.0))
    expect = torch.softmax(logits / 2.0, dim=-1)
    assert torch.allclose(p, expect)


def test_warp_per_row_params():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    p = S.warp_probs(
        logits, torch.tensor([1.0, 0.0]), torch.tensor([2, 0]), torch.tensor([1.0, 1.0])
    )
    assert torch.allclose(p[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert p[1].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sample_from_probs_inverse_cdf_skips_zeros():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 4)
    idx = S.sample_from_probs(probs, torch.tensor([0.0, 0.49, 0.5, 0.999999]))
    assert idx.tolist() == [1, 1, 3, 3]


def test_verify_greedy_cases():
    t = torch.tensor([[4, 5, 6, 7], [4, 9, 6, 7], [1, 5, 6, 7]])
    d = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 5, 6]])
    acc, nxt = S.verify_greedy(t, d)
    assert acc.tolist() == [3, 1, 0]
    assert nxt.tolist() == [7, 9, 1]


def _emitted_first_token(p, q, n, rule, gen):
    """Run draft-then-verify n times with k=1; return the histogram of the first emitted token."""
    v = p.shape[-1]
    pb = p.expand(n, 2, v)
    qb = q.expand(n, 1, v)
    d = torch.multinomial(q[0, 0].expand(n, v), 1, generator=gen)  # (n, 1)
    u = torch.rand(n, 2, generator=gen)
    acc, nxt = rule(pb, qb, d, u[:, :1], u[:, 1])
    first = torch.where(acc > 0, d[:, 0], nxt)
    return torch.bincount(first, minlength=v).float() / n


def _wrong_rule(p, q, draft_tokens, u_accept, u_sample):
    """Negative control: on rejection, resample from p instead of the residual max(p - q, 0)."""
    b, k = draft_tokens.shape
    idx = draft_tokens.unsqueeze(-1)
    p_d = p[:, :k].gather(-1, idx).squeeze(-1)
    q_d = q.gather(-1, idx).squeeze(-1)
    acc = torch.cumprod((u_accept * q_d < p_d).int(), dim=1).sum(dim=1)
    rows = torch.arange(b)
    if u_sample.dim() == 2:
        u_sample = u_sample.gather(1, acc.unsqueeze(1)).squeeze(1)
    return acc, S.sample_from_probs(p[rows, acc], u_sample)


def test_rejection_rule_matches_target_distribution_and_wrong_rule_fails():
    gen = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    q0 = torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5, 0.0])  # mass where p has none
    p = torch.stack([p0, p0]).unsqueeze(0)
    q = q0.view(1, 1, -1)
    n = 40_000
    good = _emitted_first_token(p, q, n, S.verify_rejection, gen)
    bad = _emitted_first_token(p, q, n, _wrong_rule, gen)
    tv_good = 0.5 * (good - p0).abs().sum().item()
    tv_bad = 0.5 * (bad - p0).abs().sum().item()
    assert tv_good < 0.01, tv_good
    assert tv_bad > 0.05, tv_bad


def test_rejection_with_identical_distributions_always_accepts():
    p = torch.full((3, 4, 5), 0.2)
    q = torch.full((3, 3, 5), 0.2)
    d = torch.tensor([[0, 1, 2]] * 3)
    acc, _ = S.verify_rejection(p, q, d, torch.full((3, 3), 0.999), torch.zeros(3))
    assert acc.tolist() == [3, 3, 3]


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_rule_greedy_rows_reduce_to_greedy(k):
    logits_t = torch.randn(2, k + 1, 7, generator=torch.Generator().manual_seed(k))
    t_arg = logits_t.argmax(-1)
    d = t_arg[:, :k].clone()
    d[1, 0] = (d[1, 0] + 1) % 7  # row 1 rejects at position 0
    p = S.warp_probs(logits_t, *_params(2, temperature=0.0))
    q = torch.zeros(2, k, 7).scatter(-1, d.unsqueeze(-1), 1.0)
    acc, nxt = S.verify_rejection(p, q, d, torch.rand(2, k), torch.rand(2))
    acc_g, nxt_g = S.verify_greedy(t_arg, d)
    assert acc.tolist() == acc_g.tolist()
    assert nxt.tolist() == nxt_g.tolist()
