"""The compressed draft head: a frequency-ranked vocabulary subset, optionally low-rank.

A head configuration is (V', r): score only the V' most frequent tokens, with the
full weight rows (r = None) or with a rank-r factorisation W[:V'] ~ B[:V', :r] A[:r].
All tensors are precomputed once and ordered so that every configuration is a
slice: switching the ratio at run time never reloads or refits anything.

Cost (multiply-adds per scored hidden state): full head d*V, subset d*V',
low-rank r*(d + V'). compression_ratio = 1 - cost / (d*V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimspec.cpu import native_kernels

MAX_COMPRESSION_RATIO = 0.95


def check_ratio(ratio: float) -> float:
    """Validate a compression ratio (0..0.95) and return it as float."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ValueError(
            f"compression_ratio must be a number in [0, {MAX_COMPRESSION_RATIO}], got {ratio!r}"
        )
    r = float(ratio)
    if not (0.0 <= r <= MAX_COMPRESSION_RATIO):
        raise ValueError(f"compression_ratio must be in [0, {MAX_COMPRESSION_RATIO}], got {r}")
    return r


def check_vocab_size(vocab_size: int | None) -> int | None:
    """vocab_size = upper bound on how many tokens the draft head scores (None = no bound)."""
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(
            "vocab_size is an upper bound on the draft's scored vocabulary and must be "
            f"a positive int, got {vocab_size!r}"
        )
    return vocab_size


def inverse(ranking: torch.Tensor) -> torch.Tensor:
    """rank_of[token] = its position in the ranking."""
    rank_of = torch.empty_like(ranking)
    rank_of[ranking] = torch.arange(ranking.shape[0], device=ranking.device)
    return rank_of


@dataclass(frozen=True)
class HeadConfig:
    """One concrete compressed head."""

    subset_size: int  # V'
    rank: int | None  # None = full-rank rows of the original head

    def cost(self, hidden: int) -> int:
        if self.rank is None:
            return hidden * self.subset_size
        return self.rank * (hidden + self.subset_size)

    def ratio(self, hidden: int, vocab: int) -> float:
        return 1.0 - self.cost(hidden) / float(hidden * vocab)


def subset_size_for_ratio(ratio: float, vocab: int, min_size: int = 1) -> int:
    """Largest full-rank subset whose cost stays within (1 - ratio) of the full head."""
    return max(min_size, min(vocab, int((1.0 - check_ratio(ratio)) * vocab)))


class DraftHead:
    """Scores draft hidden states with a (compressed) head.

    ranking: (V,) token ids, most frequent first (special tokens forced in front).
    weight: (V, d) the draft's original LM head. Optional low-rank factors fitted
    on the ranked rows: a (r_max, d) and b (V_lr, r_max), with b's row i for token
    ranking[i].
    """

    def __init__(
        self,
        weight: torch.Tensor,
        ranking: torch.Tensor,
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        self.vocab, self.hidden = weight.shape
        if ranking.shape != (self.vocab,):
            raise ValueError(
                f"ranking must list all {self.vocab} token ids, got shape {tuple(ranking.shape)}"
            )
        self.full_weight = weight
        self.full_bias = bias
        self.ranking = ranking.to(device=weight.device, dtype=torch.long)
        # Rows in ranked order, so a subset is a prefix slice (a view, no copy).
        self.ranked_weight = weight.index_select(0, self.ranking).contiguous()
        self.ranked_bias = bias.index_select(0, self.ranking) if bias is not None else None
        self.a = (
            a.to(device=weight.device, dtype=weight.dtype).contiguous() if a is not None else None
        )
        self.b = (
            b.to(device=weight.device, dtype=weight.dtype).contiguous() if b is not None else None
        )

        # the ranked rows in low bits, see use_low_bit
        self._low_bit: native_kernels.NativeLowBitLinear | None = None
        self._low_bit_bits = 8

    def use_low_bit(self, bits: int = 8) -> bool:
        """Score full-rank subsets with `bits`-bit copies of the ranked rows through the
        native kernels (native_kernels.py) where they run; returns whether it does.

        Why: for a quantised draft the subset head is the second-largest read of a draft
        step, and int8 rows halve it, int4 rows quarter it (docs/engine.md). The
        rows are blocked in rank order, so every subset is a prefix of the blocks and switching
        the ratio still refits nothing. Low-rank
        configurations and `full_logits` (the shadow check's reference) stay as they
        are. The draft samples from what it scores, so the output stays exact.
        """
        lib = native_kernels.load()
        if (
            lib is None
            or self.ranked_weight.device.type != "cpu"
            or self.hidden % native_kernels.GROUP
        ):
            return False
        w = torch.nn.functional.pad(self.ranked_weight.float(), (0, 0, 0, self._pad_rows))
        self._low_bit = native_kernels.NativeLowBitLinear(w, self._padded_bias(), lib, bits)
        self._low_bit_bits = bits
        return True

    @property
    def _pad_rows(self) -> int:  # zero rows after the vocabulary in the low-bit copy
        return -self.vocab % native_kernels.ROWS

    def _padded_bias(self) -> torch.Tensor | None:
        bias = self.ranked_bias
        return None if bias is None else torch.nn.functional.pad(bias.float(), (0, self._pad_rows))

    def _low_bit_from(self, old: DraftHead) -> None:
        """use_low_bit's copy for this ranking, moved from `old`'s (the same weights in
        another ranking): each row was quantised on its own, so this is the copy
        use_low_bit would build, in a fraction of its time (no requantising)."""
        assert old._low_bit is not None
        pad = torch.arange(self.vocab, self.vocab + self._pad_rows, device=old.ranking.device)
        index = torch.cat([inverse(old.ranking)[self.ranking], pad]).cpu()
        self._low_bit = old._low_bit.with_rows(index, self._padded_bias())
        self._low_bit_bits = old._low_bit_bits

    @property
    def low_bit_bits(self) -> int | None:
        """The bits of the ranked rows' native copy (use_low_bit), None without one."""
        return self._low_bit_bits if self._low_bit is not None else None

    @property
    def max_rank(self) -> int:
        return 0 if self.a is None else self.a.shape[0]

    @property
    def low_rank_rows(self) -> int:
        return 0 if self.b is None else self.b.shape[0]

    def supports(self, cfg: HeadConfig) -> bool:
        if not (1 <= cfg.subset_size <= self.vocab):
            return False
        if cfg.rank is None:
            return True
        return cfg.rank <= self.max_rank and cfg.subset_size <= self.low_rank_rows

    def token_ids(self, cfg: HeadConfig) -> torch.Tensor:
        """Token ids scored by cfg, in the order of logits(...)'s last dimension."""
        return self.ranking[: cfg.subset_size]

    def logits(self, hidden: torch.Tensor, cfg: HeadConfig) -> torch.Tensor:
        """(..., d) -> (..., V') logits over token_ids(cfg)."""
        hidden = hidden.to(self.ranked_weight.dtype)  # e.g. an fp32 int8-quantised draft body
        n = cfg.subset_size
        if cfg.rank is None and self._low_bit is not None:
            block = native_kernels.ROWS
            rows = -(-n // block) * block  # whole blocks of rows, the padding sliced off
            flat = hidden.reshape(-1, self.hidden)
            out = self._low_bit.fused(flat, rows=rows)[:, :n]
            return out.reshape(*hidden.shape[:-1], n)
        if cfg.rank is None:
            if n == self.vocab and self.ranked_bias is None:
                out = hidden @ self.ranked_weight.T
            else:
                out = torch.nn.functional.linear(
                    hidden,
                    self.ranked_weight[:n],
                    None if self.ranked_bias is None else self.ranked_bias[:n],
                )
            return out
        assert self.a is not None and self.b is not None
        out = low_rank_logits(hidden, self.a, self.b[:n], cfg.rank)
        if self.ranked_bias is not None:
            out = out + self.ranked_bias[:n]
        return out

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the original head over the full vocabulary (original token order)."""
        hidden = hidden.to(self.full_weight.dtype)
        return torch.nn.functional.linear(hidden, self.full_weight, self.full_bias)

    def argmax_by_config(self, hidden: torch.Tensor, cfgs: list[HeadConfig]) -> list[torch.Tensor]:
        """(..., d) -> per config, (...) the token ids that head would pick. Full-rank
        subsets are prefixes of the ranked rows, so one scoring of all rows serves them
        all (the shadow check measures every ratio at the cost of one); low-rank
        configurations are scored on their own (they are cheap)."""
        full = self.logits(hidden, HeadConfig(self.vocab, None))
        out = []
        for cfg in cfgs:
            if cfg.rank is None:
                out.append(self.ranking[full[..., : cfg.subset_size].argmax(dim=-1)])
            else:
                out.append(self.ranking[self.logits(hidden, cfg).argmax(dim=-1)])
        return out

    def reranked(self, ranking: torch.Tensor) -> DraftHead:
        """A new head over the same weights with another token ranking (the old one is
        left as it is, so the decoder can swap the whole object between steps).

        Low-rank rows follow their tokens; a token that enters the low-rank rows without
        a fitted row gets the least-squares row b = w A^+ (its head row projected on the
        fitted components). Low-bit rows are moved along if this head had them."""
        ranking = ranking.to(device=self.ranking.device, dtype=torch.long)
        a = b = None
        if self.a is not None and self.b is not None:
            n = self.low_rank_rows
            old_pos = torch.full((self.vocab,), -1, dtype=torch.long, device=ranking.device)
            old_pos[self.ranking[:n]] = torch.arange(n, device=ranking.device)
            pos = old_pos[ranking[:n]]
            b = torch.empty_like(self.b)
            have = pos >= 0
            b[have] = self.b[pos[have]]
            if not bool(have.all()):
                pinv = torch.linalg.pinv(self.a.float())  # (d, r_max)
                rows = self.full_weight.index_select(0, ranking[:n][~have]).float()
                b[~have] = (rows @ pinv).to(b.dtype)
            a = self.a
        head = DraftHead(self.full_weight, ranking, a=a, b=b, bias=self.full_bias)
        if self._low_bit is not None:
            head._low_bit_from(self)
        return head

    def full_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (...) token ids the ratio-0 head of this draft picks: the shadow
        check's reference. With low-bit rows (use_low_bit) that is their full set, which
        is what ratio 0 scores, and reads a quarter of the original bf16 head."""
        if self._low_bit is not None:
            full = self.logits(hidden, HeadConfig(self.vocab, None))
            return self.ranking[full.argmax(dim=-1)]
        return self.full_logits(hidden).argmax(dim=-1)


def fit_activation_aware(
    weight: torch.Tensor,
    hidden_states: torch.Tensor,
    max_rank: int,
    damp: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-rank W ~ B A minimising E_h ||W h - B A h||^2 over calibration states.

    With C = E[h h^T] = L L^T, the error is ||(W - BA) L||_F^2, whose optimum is
    the truncated SVD of W L: W L ~ U_r S_r V_r^T, so B = U_r S_r, A = V_r^T L^-1.
    Plain SVD of W ignores that hidden states occupy a few directions and loses
    most of the agreement; this fit keeps it. Components are nested: the first r
    rows of A / columns of B are the optimum for every r <= max_rank.
    weight: (V, d); hidden_states: (N, d). Returns a (max_rank, d), b (V, max_rank).
    """
    w = weight.double()
    h = hidden_states.double()
    d = w.shape[1]
    cov = h.T @ h / max(1, h.shape[0])
    cov = cov + damp * cov.diagonal().mean().clamp_min(1e-12) * torch.eye(d, dtype=cov.dtype)
    chol = torch.linalg.cholesky(cov)
    u, s, vh = torch.linalg.svd(w @ chol, full_matrices=False)
    r = min(max_rank, s.shape[0])
    b = u[:, :r] * s[:r]
    # A = V_r^T L^-1  <=>  A L = V_r^T  <=>  L^T A^T = V_r
    a = torch.linalg.solve_triangular(chol.T, vh[:r].T, upper=True).T
    return a.float(), b.float()


def low_rank_logits(
    hidden: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int
) -> torch.Tensor:
    """(..., d) -> (..., rows of b): the rank-`rank` prefix of the nested factors, B_r A_r h."""
    return (hidden @ a[:rank].T) @ b[:, :rank].T


def low_rank_kl(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    hidden_states: torch.Tensor,
    rank: int,
) -> float:
    """Mean KL(softmax(W h) || softmax(B_r A_r h)) over the given states (nats)."""
    with torch.no_grad():
        teacher = torch.log_softmax(hidden_states @ weight.T, dim=-1)
        student = torch.log_softmax(low_rank_logits(hidden_states, a, b, rank), dim=-1)
        return float((teacher.exp() * (teacher - student)).sum(-1).mean())


def distill_low_rank(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    hidden_states: torch.Tensor,
    ranks: list[int],
    steps: int = 60,
    lr: float = 1e-3,
    batch: int = 256,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine nested low-rank factors by a short distillation from the full head.

    Minimises, summed over `ranks` (so every prefix slice stays usable), the KL from
    the full head's distribution softmax(W h) to the low-rank one softmax(B_r A_r h)
    on calibration states, with Adam from the activation-aware fit. That fit spreads
    the rank over the whole logit vector; the distillation moves it to the top of the
    distribution, which is what decides the draft's choice. Returns new (a, b).
    """
    g = torch.Generator().manual_seed(seed)
    a = a.detach().clone().float().requires_grad_(True)
    b = b.detach().clone().float().requires_grad_(True)
    w = weight.detach().float()
    h_all = hidden_states.detach().float()
    opt = torch.optim.Adam([a, b], lr=lr)
    with torch.enable_grad(), torch.inference_mode(False):
        for _ in range(steps):
            idx = torch.randint(0, h_all.shape[0], (min(batch, h_all.shape[0]),), generator=g)
            h = h_all[idx]
            with torch.no_grad():
                teacher = torch.softmax(h @ w.T, dim=-1)
            loss = torch.zeros(())
            for r in ranks:
                student = torch.log_softmax(low_rank_logits(h, a, b, r), dim=-1)
                loss = loss - (teacher * student).sum(-1).mean()  # cross-entropy = KL + const
            opt.zero_grad()
            loss.backward()
            opt.step()
    return a.detach(), b.detach()
