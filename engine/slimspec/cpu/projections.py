"""The fused draft's projections: weights in int8, int4 or bf16 behind one call.

Each takes (..., K) activations in bfloat16 and returns (..., N): the native kernels
(native_kernels.NativeLowBitLinear) where they run, else aten's weight-only kernels
or a bf16 F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimspec.cpu import native_kernels
from slimspec.cpu.native_kernels import NativeLowBitLinear

INT4_GROUP = 64


class Int8Linear:
    """y = x @ (q * scale).T + bias with q int8 (N, K) and one scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8)
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.out_features = w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.q, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class DenseLinear:
    """y = x @ W.T + bias with W kept in bfloat16 (the "bf16-fused" draft: no quantisation,
    only the fused projections and the lean forward)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.w = weight.detach().to(dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.out_features = self.w.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.bias)


class Int4Linear:
    """y = x @ W.T with W in asymmetric int4 groups along K (tinygemm layout, CPU kernel)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP):
        w = weight.detach().float()
        n, k = w.shape
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp_min(1e-8)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 2)
        # The kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale.
        zero = lo + 8.0 * scale
        self.scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.group = group
        self.out_features = n

    @staticmethod
    def fits(weight: torch.Tensor, group: int = INT4_GROUP) -> bool:
        n, k = weight.shape
        return k % group == 0 and n % 16 == 0  # the packing kernel needs N % 16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, x.shape[-1]), self.packed, self.group, self.scale_zero
        )
        return y.reshape(*lead, self.out_features)


Projection = Int8Linear | Int4Linear | NativeLowBitLinear | DenseLinear


def low_bit_projection(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, bits: int
) -> Projection:
    """A projection with `bits`-bit weights (16: bf16): the native kernels where they
    run and the shape fits (native_kernels.py: faster than aten's and oneDNN's on a CPU
    without AMX); else bf16 through F.linear for 16, aten's int4 kernel for 4 (where
    the shape allows: tiny test models may not) or its int8 kernel."""
    lib = native_kernels.load()
    if bits == 16:
        if lib is not None and native_kernels.bf16_available() and NativeLowBitLinear.fits(weight):
            return NativeLowBitLinear(weight, bias, lib, 16)
        return DenseLinear(weight, bias, dtype)
    if lib is not None and NativeLowBitLinear.fits(weight):
        return NativeLowBitLinear(weight, bias, lib, bits)
    if bits == 4 and bias is None and Int4Linear.fits(weight):
        return Int4Linear(weight, dtype)
    return Int8Linear(weight, bias, dtype)
