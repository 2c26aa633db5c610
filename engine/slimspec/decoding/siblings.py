"""Sibling drafts: one verification also checks the draft's runner-up at each depth.

Why: where the draft's top token is wrong, its second choice is often the target's
token. Where a verification costs about the same for a few more tokens (a GPU; not
the 2-core CPUs this was measured on, so the decoder leaves it off by default:
docs/engine.md, benchmark section), the runner-up at each of the first m depths
rides along as an extra leaf of a small tree: the chain x, c_1..c_k plus siblings
s_1..s_m, where s_j sits at the position of c_j and sees x, c_1..c_{j-1} and
itself, never c_j. When the chain breaks at depth j and s_j is the target's token
there, the step emits s_j and the target's token after s_j: one more token for no
extra draft forward.

Greedy rows only: the draft's runner-up is not a sample of q, so the rejection rule
for sampling rows would need a multi-candidate scheme (SpecTr); sampling batches
verify the plain chain. Pure decisions here; the decoder does the forwards.
"""

from __future__ import annotations

import os

import torch

from slimspec.decoding.sampling import verify_greedy


def tree_attention(k: int, m: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(1+k+m, 1+k+m) bool "may attend" among the new slots [x, c_1..c_k, s_1..s_m]."""
    if not 0 <= m <= k:
        raise ValueError(f"sibling depths m must be in [0, k={k}], got {m}")
    q = 1 + k + m
    allowed = torch.zeros(q, q, dtype=torch.bool, device=device)
    allowed[: k + 1, : k + 1] = torch.ones(k + 1, k + 1, dtype=torch.bool, device=device).tril()
    for j in range(1, m + 1):
        slot = k + j  # s_j
        allowed[slot, :j] = True  # x, c_1 .. c_{j-1}
        allowed[slot, slot] = True
    return allowed


def tree_positions(last_pos: torch.Tensor, k: int, m: int) -> torch.Tensor:
    """(B, 1+k+m) position ids: x at last_pos, c_j and s_j both at last_pos + j."""
    offsets = torch.cat([torch.arange(k + 1), torch.arange(1, m + 1)]).to(last_pos.device)
    return last_pos.unsqueeze(1) + offsets.unsqueeze(0)


def verify_greedy_siblings(
    target_argmax: torch.Tensor, drafts: torch.Tensor, siblings: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a chain plus sibling leaves.

    target_argmax: (B, 1+k+m) target argmax at each new slot [x, c_1..c_k, s_1..s_m];
    drafts: (B, k) chain; siblings: (B, m). Returns (num_accepted chain tokens (B,),
    hit (B,) bool: the sibling at the break was the target's token, next_token (B,)):
    the token after the last accepted one, which is the target's argmax after the
    sibling on a hit, else the usual correction or bonus.
    """
    k, m = drafts.shape[1], siblings.shape[1]
    num_acc, next_tok = verify_greedy(target_argmax[:, : k + 1], drafts)
    if m == 0:
        return num_acc, torch.zeros_like(num_acc, dtype=torch.bool), next_tok
    at = num_acc.clamp(max=m - 1).unsqueeze(1)
    sibling = siblings.gather(1, at).squeeze(1)
    after_sibling = target_argmax[:, k + 1 :].gather(1, at).squeeze(1)
    hit = (num_acc < m) & (sibling == next_tok)
    return num_acc, hit, torch.where(hit, after_sibling, next_tok)


def resolve_sibling_drafts(sibling_drafts: int | None) -> int:
    """How many depths also verify the draft's runner-up; None reads
    SLIMSPEC_SIBLING_DRAFTS, default 0 (it pays only where verifying a few more tokens is
    nearly free, as on a GPU)."""
    if sibling_drafts is None:
        sibling_drafts = int(os.environ.get("SLIMSPEC_SIBLING_DRAFTS", "0"))
    if not isinstance(sibling_drafts, int) or sibling_drafts < 0:
        raise ValueError(
            "sibling_drafts must be an int >= 0 or None (SLIMSPEC_SIBLING_DRAFTS, default 0), "
            f"got {sibling_drafts!r}"
        )
    return sibling_drafts
