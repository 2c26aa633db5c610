"""Pure sampling and verification decisions (no model, no state).

Everything random takes its noise as an argument, so a decision is a pure function
of (logits, params, noise): seeded runs reproduce, and tests can feed chosen noise.
Two exact verification rules:

- Rejection sampling (Leviathan et al. 2023 / Chen et al. 2023), for unseeded rows:
  accept draft token d with probability min(1, p(d)/q(d)); at the first rejection
  sample from norm(max(p - q, 0)); if all k are accepted, sample a bonus from p.
- The Gumbel-max coupling, for seeded rows: each position has its own noise, keyed
  by (seed, position); the token at a position is argmax(p / E) with E ~ Exp(1) per
  token (argmax(log p + Gumbel), written with one log). The draft proposes
  argmax(q / E) with the same E; a draft token is accepted iff it equals the target's
  choice, and at the first mismatch the target's choice is emitted. Every emitted
  token is the target's own choice under that noise, so a seeded request gives
  exactly what target-only decoding with that seed gives, whatever k or the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from slimspec.decoding.types import GREEDY_TEMPERATURE, SamplingParams

if TYPE_CHECKING:
    from slimspec.decoding.grammar import StepGrammar

# Shape conventions: B rows (requests), k draft positions, V vocabulary.


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit, the first one on ties (as argmax).

    Why not argmax: on CPU torch's argmax over a bf16 vocabulary row is ~4x slower than
    max's indices (0.55 vs 0.13 ms for 151,936 logits), and a step takes one per draft
    token and one per verification; both return the first maximal index.
    """
    return logits.max(dim=-1).indices


def warp_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, per row.

    logits: (B, ..., V); temperature/top_k/top_p: (B,). top_k <= 0 and top_p >= 1
    mean off. Rows with temperature below GREEDY_TEMPERATURE get a one-hot on the
    argmax (greedy), so the verification rules below reduce to exact greedy matching
    for them; so does a row whose warped probabilities are not finite, so that one
    row's values can never turn into NaN samples or fail its batch.
    """
    logits = logits.float()
    b = logits.shape[0]
    view = (b,) + (1,) * (logits.dim() - 1)
    sampled = temperature >= GREEDY_TEMPERATURE
    greedy = (~sampled).view(view)
    t = torch.where(sampled, temperature, torch.ones_like(temperature)).float()
    scaled = logits / t.view(view)
    v = logits.shape[-1]
    need_k = bool(((top_k > 0) & (top_k < v)).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            ranks = torch.arange(v, device=logits.device)
            k_eff = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).view(view)
            remove |= ranks >= k_eff
        if need_p:
            probs_sorted = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            remove |= mass_before >= top_p.float().view(view)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(scaled, dim=-1)
    greedy = greedy | ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs (N, V) with u (N,) in [0, 1) -> indices (N,).

    Zero-probability entries are never chosen (searchsorted over the CDF with
    right=True skips flat steps).
    """
    cdf = torch.cumsum(probs.float(), dim=-1)
    total = cdf[:, -1:]
    target = (u.float().unsqueeze(-1) * total).clamp_max(total * (1 - 1e-7))
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)


def verify_greedy(
    target_argmax: torch.Tensor, draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    target_argmax: (B, k+1) target's argmax after each prefix; draft_tokens: (B, k).
    Returns (num_accepted (B,), next_token (B,)): the correction at the first
    mismatch, or the bonus token when all k match.
    """
    k = draft_tokens.shape[1]
    match = (target_argmax[:, :k] == draft_tokens).int()
    num_accepted = torch.cumprod(match, dim=1).sum(dim=1)
    next_token = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return num_accepted, next_token


def verify_rejection(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection-sampling verification.

    p: (B, k+1, V) target probabilities (warped); q: (B, k, V) the distribution
    each draft token was actually sampled from, over the full vocabulary (zero
    outside a compressed head's subset); draft_tokens: (B, k); u_accept: (B, k);
    u_sample: (B,) or (B, k+1) (one per position; the one at the first rejection, or
    at k for the bonus, is used). Returns (num_accepted (B,), next_token (B,)).
    """
    b, k = draft_tokens.shape
    idx = draft_tokens.unsqueeze(-1)
    p_d = p[:, :k].gather(-1, idx).squeeze(-1)
    q_d = q.gather(-1, idx).squeeze(-1)
    # u < p/q  <=>  u*q < p  (q_d > 0 because d was sampled from q)
    accept = (u_accept * q_d < p_d).int()
    num_accepted = torch.cumprod(accept, dim=1).sum(dim=1)
    rows = torch.arange(b, device=p.device)
    p_next = p[rows, num_accepted]
    q_pad = torch.cat([q, q.new_zeros(b, 1, q.shape[-1])], dim=1)  # position k: sample from p
    residual = (p_next - q_pad[rows, num_accepted]).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q numerically (only reachable through rounding): fall back to p itself
    dist = torch.where(mass > 1e-12, residual, p_next)
    if u_sample.dim() == 2:
        u_sample = u_sample.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    next_token = sample_from_probs(dist, u_sample)
    return num_accepted, next_token


def coupled_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) over the last dim: the Gumbel-max sample of probs under
    Exp(1) noise (log p - log E = log p + Gumbel). Zero-probability tokens never win;
    a one-hot (greedy) row gives its argmax whatever the noise."""
    return (probs.float() / noise).argmax(dim=-1)


def verify_coupled(
    p: torch.Tensor, noise: torch.Tensor, draft_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max coupled verification.

    p: (B, k+1, V) target probabilities (warped); noise: (B, k+1, V) the Exp(1) noise
    of each position (race_noise); draft_tokens: (B, k), proposed as
    coupled_choice(q, noise). Accept while a draft equals the target's choice; the
    target's choice follows (the correction, or the bonus when all k match).
    """
    return verify_greedy(coupled_choice(p, noise), draft_tokens)


_MASK64 = (1 << 64) - 1

# Streams of position-keyed randomness (see uniform() and race_noise()).
STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_RACE = 0, 1, 2, 3


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) keyed by (seed, absolute token position, stream).

    Keying randomness by position (not by call order) makes a seeded request's
    output independent of k, of adaptive timing and of what else is in the batch:
    each emitted token is decided by the same three numbers whatever the schedule.
    """
    x = _splitmix64((seed & _MASK64) ^ _splitmix64(position * 4 + stream))
    return (x >> 11) * (1.0 / (1 << 53))


def race_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """(vocab,) float32 Exp(1) noise keyed by (seed, absolute token position): the same
    on every run, in every engine and whatever the schedule (generated on the CPU)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_splitmix64((seed & _MASK64) ^ _splitmix64(position * 4 + STREAM_RACE)))
    return -torch.log(torch.rand(vocab, generator=gen))


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) tensors for a list of SamplingParams."""
    temperature = torch.tensor([float(s.temperature) for s in params], device=device)
    top_k = torch.tensor([int(s.top_k) for s in params], device=device, dtype=torch.long)
    top_p = torch.tensor([float(s.top_p) for s in params], device=device)
    return temperature, top_k, top_p


def full_vocab_q(
    q_subset: Sequence[torch.Tensor], token_ids: torch.Tensor, vocab: int, rows: int
) -> torch.Tensor:
    """(rows, k, vocab) float32: the distribution each draft token was sampled from, over the
    full vocabulary. q_subset[j] (rows, V') is over token_ids (V',); zero elsewhere, so
    a compressed head's q is exact for verify_rejection."""
    q = torch.zeros(rows, len(q_subset), vocab, dtype=torch.float32, device=token_ids.device)
    for j, qs in enumerate(q_subset):
        q[:, j].index_copy_(1, token_ids, qs.float())
    return q


@dataclass(frozen=True)
class BatchSampling:
    """How each row of a batched step chooses tokens, and its randomness.

    seeds[i] is None for a greedy row. A sampling row's randomness is keyed by its seed
    and the absolute position of the token it decides (starts[i] = the position of the
    row's first new token this step), so it does not depend on the schedule.
    coupled[i]: the row asked for a seed, so it samples by the Gumbel-max coupling
    (reproducible, equal to target-only sampling); other sampling rows use rejection
    sampling with a random seed. noise: (B, n, V) Exp(1) noise of positions
    start .. start+n-1 for coupled rows (ones elsewhere), from with_noise().
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: tuple[int | None, ...]
    starts: tuple[int, ...]
    all_greedy: bool
    device: torch.device
    coupled: tuple[bool, ...] = ()
    noise: torch.Tensor | None = None
    grammar: StepGrammar | None = None  # when a row is constrained (decoding/grammar.py)

    @classmethod
    def for_rows(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int | None],
        starts: Sequence[int],
        device: torch.device,
    ) -> BatchSampling:
        temperature, top_k, top_p = sampling_tensors(params, device)
        greedy = all(p.greedy for p in params)
        coupled = tuple(not p.greedy and p.seed is not None for p in params)
        return cls(temperature, top_k, top_p, tuple(seeds), tuple(starts), greedy, device, coupled)

    @property
    def any_coupled(self) -> bool:
        return any(self.coupled)

    @property
    def coupled_mask(self) -> torch.Tensor:
        return torch.tensor(self.coupled, dtype=torch.bool, device=self.device)

    def with_noise(self, n: int, vocab: int) -> BatchSampling:
        """This step's Exp(1) noise for n positions of every coupled row (drafting and
        verification share it)."""
        if not self.any_coupled:
            return self
        noise = torch.ones(len(self.seeds), n, vocab)
        for i, (seed, start) in enumerate(zip(self.seeds, self.starts, strict=True)):
            if self.coupled[i] and seed is not None:
                for j in range(n):
                    noise[i, j] = race_noise(seed, start + j, vocab)
        return replace(self, noise=noise.to(self.device))

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)

    def uniforms(self, offset: int, n: int, stream: int) -> torch.Tensor:
        """(B, n) uniforms for positions start+offset .. +n-1 of each rejection-sampling
        row (0 for greedy and coupled rows)."""
        u = torch.zeros(len(self.seeds), n, dtype=torch.float64)
        for i, (seed, start) in enumerate(zip(self.seeds, self.starts, strict=True)):
            if seed is not None and not self.coupled[i]:
                base = start + offset
                u[i] = torch.tensor([uniform(seed, base + j, stream) for j in range(n)])
        return u.to(self.device)

    def draft_choice(self, q: torch.Tensor, depth: int, token_ids: torch.Tensor) -> torch.Tensor:
        """(B,) indices into the head's subset: the draft's token at this depth. Greedy rows
        take the argmax, rejection rows sample q, coupled rows take argmax(q / noise)
        with the noise of the token ids the head scored."""
        idx = sample_from_probs(q, self.uniforms(depth, 1, STREAM_DRAFT)[:, 0])
        if self.noise is not None:
            coupled = coupled_choice(q, self.noise[:, depth].index_select(-1, token_ids))
            idx = torch.where(self.coupled_mask, coupled, idx)
        return idx

    def verify(
        self, p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_accepted, next_token) per row: rejection sampling, or the coupling for
        coupled rows. p: (B, k+1, V); q: (B, k, V) as verify_rejection wants."""
        k = draft_tokens.shape[1]
        u_acc = self.uniforms(0, k, STREAM_ACCEPT)
        u_res = self.uniforms(0, k + 1, STREAM_RESIDUAL)
        num_acc, next_tok = verify_rejection(p, q, draft_tokens, u_acc, u_res)
        if self.noise is not None:
            acc_c, next_c = verify_coupled(p, self.noise[:, : k + 1], draft_tokens)
            mask = self.coupled_mask
            num_acc = torch.where(mask, acc_c, num_acc)
            next_tok = torch.where(mask, next_c, next_tok)
        return num_acc, next_tok
