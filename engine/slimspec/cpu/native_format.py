"""The native kernels' weight format, and float32 references of what they compute.

Weights are asymmetric groups of GROUP inputs (w ~= u * scale + low, u in 0..2^bits-1),
stored in blocks of ROWS rows so that every thread reads one contiguous stream
(csrc/draft_kernels.c describes the bytes). The references are the self-checks'
and tests' ground truth, not fallbacks.
"""

from __future__ import annotations

import torch

GROUP = 64  # inputs per quantisation group (weights and activations)
ROWS = 4  # weight rows per block of bf16 weights; callers' row counts are multiples of it
LOWBIT_ROWS = 16  # rows per block of int4/int8 weights: one int32 lane each in a vpdpbusd
QUANT_BITS = (4, 8)  # quantised weights


def block_rows(bits: int) -> int:
    """Weight rows per block of the kernel's layout for these weights."""
    return LOWBIT_ROWS if bits in QUANT_BITS else ROWS


def quantize(
    weight: torch.Tensor, bits: int, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric groups along K: (u uint8 (N, K) in 0..2^bits-1, scale, low (N, K/group))
    with w ~= u * scale + low. scale and low are values of float16 (the kernel stores
    them so), and u is rounded against those."""
    if bits not in QUANT_BITS:
        raise ValueError(f"quantize takes bits in {QUANT_BITS}, got {bits}")
    w = weight.detach().float()
    n, k = w.shape
    top = float(2**bits - 1)
    wg = w.view(n, k // group, group)
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((high - low) / top).clamp_min(1e-7).half().float()
    low = low.half().float()
    u = torch.round((wg - low[..., None]) / scale[..., None]).clamp(0, top).to(torch.uint8)
    return u.view(n, k), scale, low


def blocked(t: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """(N, G, ...) -> (ceil(N/rows), G, rows, ...), contiguous, N padded with zeros to a
    multiple of rows: the kernel reads a block's group g together."""
    n = t.shape[0]
    pad = -n % rows
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape((n + pad) // rows, rows, *t.shape[1:]).transpose(1, 2).contiguous()


def unblocked(t: torch.Tensor) -> torch.Tensor:
    """blocked's inverse, padding rows included: (B, G, rows, ...) -> (B * rows, G, ...)."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], t.shape[1], *t.shape[3:])


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One of the kernel's tensors (pack's or blocked's weights, a scale or a low) with
    its rows taken in the order `index` (indices into its rows, padding rows included)
    and blocked again: the rows move as they were quantised (each row's groups are its
    own), nothing is requantised."""
    packed = t.dim() == 5  # pack's (B, G, p, 16, i)
    rows = unblocked(t.transpose(2, 3) if packed else t)
    out = blocked(rows.index_select(0, index), t.shape[3] if packed else t.shape[2])
    return out.transpose(2, 3).contiguous() if packed else out


def pack(u: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """(N, K) weights in 0..2^bits-1 -> the kernel's bytes: blocks of 16 rows (zero rows
    pad N), a group of a block as 64-byte vectors of 16 rows x 4 bytes. 8 bits: byte i
    of row r in vector p is u[r][4p + i]; 4 bits: u[r][4p + i] | u[r][32 + 4p + i] << 4."""
    n, k = u.shape
    g = u.view(n, k // group, group)
    if bits == 4:
        g = g[..., : group // 2] | (g[..., group // 2 :] << 4)
    vectors = g.reshape(n, k // group, -1, 4)  # (N, G, p, i)
    return blocked(vectors, LOWBIT_ROWS).transpose(2, 3).contiguous()  # (N/16, G, p, 16, i)


def reference(
    x: torch.Tensor, u: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group: int = GROUP
) -> torch.Tensor:
    """What the kernel computes, in float32: activations quantised to int8 per group
    (x * (1 / scale), rounded half to even, as the C code) times the dequantised weights.
    The check for the kernel, not a fallback."""
    xf = x.float()
    m, k = xf.shape
    xg = xf.view(m, k // group, group)
    xs = xg.abs().amax(dim=-1) / 127.0
    inv = torch.where(xs > 0, 1.0 / xs, torch.zeros_like(xs))
    x_deq = (torch.round(xg * inv[..., None]) * xs[..., None]).view(m, k)
    n = u.shape[0]
    w_deq = (u.float().view(n, k // group, group) * scale[..., None] + low[..., None]).view(n, k)
    return x_deq @ w_deq.T


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Float32 grouped-query attention: q (B, Hq, T, d), k/v (B, Hkv, L, d), allowed
    (B, T, L) -> (B, T, Hq*d)."""
    b, hq, t, d = q.shape
    rep = hq // k.shape[1]
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(1, 2).reshape(b, t, hq * d)
