"""Native CPU kernels for the fused drafts (AVX512-VNNI or AVX2), built on first use.

- `NativeLowBitLinear`: int4/int8-weight matmuls (and bf16-weight ones where the CPU
  has AVX512-BF16), optionally with the RMSNorm or SiLU gate before them and the
  residual add after them in the same call;
- `attention`: small-query grouped attention (also the packed target's,
  target_attention.py); `rope_` exposes the RoPE the layer calls use, for its test;
- `draft_layer_pre` / `draft_layer_post`: a whole draft layer in two calls around
  the torch KV-cache update (fused_draft.FusedDraftBase._native_layers);
  `draft_layers_step`: a few-token step's layers in one call that writes the new keys
  and values into the cache's spare room (decoding/kv.py GrowingLayer.reserve).

Why: on a CPU without AMX, aten's low-bit kernels dequantise every weight before
multiplying (compute-bound) or cost much per call, while quantising the few activation
rows to int8 lets vpdpbusd (AVX512-VNNI) or vpmaddubsw + vpmaddwd (AVX2) multiply at
about the speed of reading the weights (how: csrc/draft_kernels.c; measurements:
docs/engine.md, benchmark section). `cflags()` picks the build for the CPU: AVX512-VNNI
where it has it (Intel since Cascade Lake, AMD Zen 4), else AVX2/FMA/F16C (every
x86-64 CPU of the last decade), so no such CPU is left on aten's kernels.

The C file is compiled once per source and compiler into $SLIMSPEC_CACHE/kernels with
the system C compiler (no torch headers) and loaded with ctypes; a library built ahead
of time for this very source in $SLIMSPEC_KERNELS_DIR (the engine image's, whose
runtime has no compiler) is loaded instead. It links libgomp by soname, so it shares
torch's OpenMP runtime and thread count. Where it cannot run (no AVX512-VNNI, neither
a compiler nor a prebuilt library, a failed self-check, or SLIMSPEC_NATIVE_KERNELS=0)
`load()` returns None and the drafts use aten's kernels (and the target SDPA).
Either build computes the same int8 products; the bf16-weight kernel is AVX512-BF16
only. The
drafts' numerics only move acceptance; the target uses only the attention kernel,
whose bf16 rounding differs from SDPA's as multi-token verification's does (fp32
targets keep SDPA), so the fp32 output stays exact.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, TypedDict

import torch

from slimspec.cpu import clib
from slimspec.cpu.native_format import (
    GROUP,
    QUANT_BITS,
    ROWS,
    attention_reference,
    block_rows,
    blocked,
    pack,
    quantize,
    reference,
    take_rows,
)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "draft_kernels.c"
BITS = (*QUANT_BITS, 16)  # 16: bf16 weights, where the CPU has AVX512-BF16
CFLAGS = (  # the AVX512-VNNI build
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mf16c",
    "-mfma",
    "-fopenmp",
)
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
# the AVX512-VNNI build plus AMX tiles for prefill-sized products (the same bits)
AMX_CFLAGS = (*CFLAGS, "-mamx-tile", "-mamx-int8")
AMX_CPU_FLAGS = (*REQUIRED_CPU_FLAGS, "amx_tile", "amx_int8")
AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
# (name, flags, the CPU flags the build needs), the first that the CPU has wins
BUILDS = (
    ("amx", AMX_CFLAGS, AMX_CPU_FLAGS),
    ("avx512-vnni", CFLAGS, REQUIRED_CPU_FLAGS),
    ("avx2", AVX2_CFLAGS, AVX2_CPU_FLAGS),
)
BF16_CPU_FLAG = "avx512_bf16"
ENV_SWITCH = "SLIMSPEC_NATIVE_KERNELS"
# Libraries compiled ahead of time for this source (the engine image's build stage; its
# runtime stage has no compiler), named by prebuilt_name().
PREBUILT_DIR_ENV = clib.PREBUILT_DIR_ENV
PROLOGUE_RMSNORM, PROLOGUE_SILU_GATE = 1, 2  # csrc/draft_kernels.c

_lock = threading.Lock()


class _Decided(TypedDict, total=False):
    lib: ctypes.CDLL | None  # load()
    bf16: bool  # bf16_available()


_loaded: _Decided = {}


def build_for(cpuinfo: str | None = None) -> tuple[str, tuple[str, ...]] | None:
    """(name, compiler flags) of the build this CPU runs, or None where none can."""
    flags = clib.cpu_flags(cpuinfo)
    for name, cflags, needed in BUILDS:
        if all(f in flags for f in needed):
            return name, cflags
    return None


def cflags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The compiler flags of this CPU's build (the AVX512 ones where none runs)."""
    found = build_for(cpuinfo)
    return CFLAGS if found is None else found[1]


def path() -> str:
    """Which build the drafts run here ('amx', 'avx512-vnni', 'avx2'), or 'off' (aten)."""
    found = build_for()
    return found[0] if found is not None and load() is not None else "off"


def cpu_supported(cpuinfo: str | None = None) -> bool:
    """True when the CPU has what one of the builds is compiled for."""
    return build_for(cpuinfo) is not None


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU also has AVX512-BF16 (the bf16-weight kernel's vdpbf16ps)."""
    return BF16_CPU_FLAG in clib.cpu_flags(cpuinfo)


def _compiler() -> str | None:
    return clib.compiler()


def library_path(cc: str, flags: tuple[str, ...] | None = None) -> Path:
    """Where the build for this source, compiler and flags (default: this CPU's) lives
    (a new source builds anew)."""
    return clib.library_path(SOURCE, cc, cflags() if flags is None else flags)


def prebuilt_name(flags: tuple[str, ...] | None = None) -> str:
    """The file name of an ahead-of-time build of this source and flags (default: this
    CPU's; clib.prebuilt_name)."""
    return clib.prebuilt_name(SOURCE, cflags() if flags is None else flags)


def _prebuilt() -> Path | None:
    return clib.prebuilt(SOURCE, cflags())


def _build(cc: str, out: Path, flags: tuple[str, ...] | None = None) -> None:
    clib.build(cc, SOURCE, cflags() if flags is None else flags, out)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.lowbit_gemm_bf16.argtypes = [p, i64, i64, p, p, p, i64, p, p, i32, i32, p, f32, i32]
    lib.lowbit_gemm_bf16.restype = i32
    lib.rope_bf16.argtypes = [p, i64, i64, i64, i64, p, p]
    lib.rope_bf16.restype = None
    lib.attention_bf16.argtypes = [p, i64, p, p, i64, i64, p, i64, i64, i64, i64, i64, i64, f32, p]
    lib.attention_bf16.restype = i32
    desc = ctypes.POINTER(ProjDesc)
    lib.draft_layer_pre.argtypes = [p, i64, i64, desc, p, f32, p, p, i64, i64, i64, p, p, p]
    lib.draft_layer_pre.restype = i32
    lib.draft_layer_post.argtypes = [
        *(p, i64, i64, p, i64, p, p, i64, i64, p, i64, i64, i64, f32),
        *(desc, p, f32, desc, desc),
    ]
    lib.draft_layer_post.restype = i32
    lib.draft_layers_step.argtypes = [
        *(p, i64, i64, i64, ctypes.POINTER(DraftLayer), p, p, i64, i64, i64, i64, p)
    ]
    lib.draft_layers_step.restype = i32
    return lib


def check_rc(rc: int, what: str) -> None:
    """Raise for a kernel call's nonzero return (-1: scratch allocation, -2: arguments)."""
    if rc != 0:
        raise RuntimeError(f"native {what} failed (code {rc})")


class ProjDesc(ctypes.Structure):
    """csrc/draft_kernels.c's proj_t: one projection's weights, for the layer calls."""

    _fields_ = (
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("low", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("bits", ctypes.c_int64),
    )


# What a one-call step's layer struct holds after its weights, in both C files
# (draft_layer_t, step_layer): norms, epsilons, the attention's scale, and the cache room
# for its keys and values (kv.NativeRooms sets the room fields).
LAYER_STEP_FIELDS = (
    ("in_norm", ctypes.c_void_p),
    ("post_norm", ctypes.c_void_p),
    ("in_eps", ctypes.c_float),
    ("post_eps", ctypes.c_float),
    ("scale", ctypes.c_float),
    ("k_room", ctypes.c_void_p),
    ("v_room", ctypes.c_void_p),
    ("k_room_rows", ctypes.c_int64),
    ("v_room_rows", ctypes.c_int64),
)


class DraftLayer(ctypes.Structure):
    """csrc/draft_kernels.c's draft_layer_t: one layer's weights for draft_layers_step,
    and the step's cache room for its keys and values (set per step)."""

    _fields_ = (
        ("qkv", ProjDesc),
        ("o", ProjDesc),
        ("gate_up", ProjDesc),
        ("down", ProjDesc),
        *LAYER_STEP_FIELDS,
    )


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot run here (decided once)."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load_uncached()
        return _loaded["lib"]


def bf16_available() -> bool:
    """True when `load()` works and its bf16-weight kernel runs here (the AVX512 build
    on a CPU with AVX512-BF16, and it agreed with the reference)."""
    lib = load()
    with _lock:
        if "bf16" not in _loaded:
            avx512 = cflags() in (CFLAGS, AMX_CFLAGS)
            _loaded["bf16"] = bool(
                lib is not None and avx512 and cpu_has_bf16() and _self_check(lib, 16)
            )
            if lib is not None and not _loaded["bf16"]:
                log.info("native bf16-weight kernel off: no AVX512-BF16 (or its self-check)")
        return bool(_loaded["bf16"])


def _load_uncached() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if not cpu_supported():
        log.info(
            "native low-bit kernels off: the CPU has neither %s nor %s",
            REQUIRED_CPU_FLAGS,
            AVX2_CPU_FLAGS,
        )
        return None
    path, cc = _prebuilt(), _compiler()
    if path is None and cc is None:
        log.info(
            "native low-bit kernels off: no C compiler (cc, gcc or clang) on PATH and no "
            "library built ahead for this source in $%s",
            PREBUILT_DIR_ENV,
        )
        return None
    try:
        if path is None:
            assert cc is not None
            path = library_path(cc)
            if not path.exists():
                _build(cc, path)
        lib = _bind(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning(
            "native low-bit kernels off: build or load failed: %s",
            getattr(exc, "stderr", None) or exc,
        )
        return None
    if not (all(_self_check(lib, b) for b in QUANT_BITS) and _attention_self_check(lib)):
        log.warning("native low-bit kernels off: the self-check disagreed with the reference")
        return None
    log.info("native low-bit kernels: the %s build", (build_for() or ("?",))[0])
    return lib


class NativeLowBitLinear:
    """y = x @ W.T (+ bias) with W in asymmetric int4 or int8 groups of 64, or in bf16
    (bits=16), through csrc/draft_kernels.c. Build only with a library from `load()`
    (and for 16 bits only where `bf16_available()`); see `fits`."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, lib: ctypes.CDLL, bits: int
    ) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if not self.fits(weight):
            raise ValueError(f"weight shape {tuple(weight.shape)}: need K % 64 == N % 4 == 0")
        self.bits = bits
        if bits == 16:
            n, k = weight.shape
            w16 = weight.detach().to(torch.bfloat16).view(torch.int16)
            self.packed = blocked(w16.reshape(n, k // GROUP, GROUP))
            self.scale = self.low = None
        else:
            u, scale, low = quantize(weight, bits)
            self.packed = pack(u, bits)
            rows = block_rows(bits)
            self.scale, self.low = blocked(scale.half(), rows), blocked(low.half(), rows)
        self._finish(bias, weight.shape[0], weight.shape[1], lib.lowbit_gemm_bf16)

    def with_rows(self, index: torch.Tensor, bias: torch.Tensor | None) -> NativeLowBitLinear:
        """This layer with its output rows taken in the order `index` (indices into its
        rows; a multiple of 4 of them) and this bias: the quantised rows move as they are
        (each row's groups are its own), so it is the layer of the reordered weight,
        without quantising again (a re-ranked head: ~1 s -> a fraction on 2 cores)."""
        if index.numel() % ROWS:
            raise ValueError(f"row count {index.numel()} is not a multiple of {ROWS}")
        new = object.__new__(NativeLowBitLinear)
        new.bits = self.bits
        new.packed = take_rows(self.packed, index)
        new.scale = None if self.scale is None else take_rows(self.scale, index)
        new.low = None if self.low is None else take_rows(self.low, index)
        new._finish(bias, index.numel(), self.in_features, self._fn)
        return new

    def _finish(self, bias: torch.Tensor | None, n: int, k: int, fn: Any) -> None:
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
        self.out_features, self.in_features = n, k
        self._fn = fn
        # for the whole-layer calls; the tensors it points into live as long as self
        self.desc = ProjDesc(
            self.packed.data_ptr(),
            None if self.scale is None else self.scale.data_ptr(),
            None if self.low is None else self.low.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            self.out_features,
            self.in_features,
            self.bits,
        )

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        return weight.shape[1] % GROUP == 0 and weight.shape[0] % ROWS == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.fused(x.reshape(-1, self.in_features))
        return y.reshape(*lead, self.out_features)

    def fused(
        self,
        x: torch.Tensor,
        *,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
        silu_gate: bool = False,
        residual: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> torch.Tensor:
        """(M, K) -> (M, N) with the neighbouring small ops done inside the kernel call:
        norm: RMSNorm of x with this weight first; silu_gate: x is (M, 2K) gate|up and
        the input is silu(gate) * up; residual: add into this contiguous bf16 (M, N)
        tensor in place and return it; rows: only the first `rows` outputs (a multiple
        of 4: the weights' first blocks), (M, rows)."""
        n_out = self.out_features if rows is None else rows
        if not (0 < n_out <= self.out_features and n_out % ROWS == 0):
            raise ValueError(f"rows must be a multiple of {ROWS} in 1..{self.out_features}")
        x = x.to(torch.bfloat16).contiguous()
        m = x.shape[0]
        if x.shape[1] != self.in_features * (2 if silu_gate else 1):
            raise ValueError(f"input width {x.shape[1]} does not fit {self.in_features}")
        prologue = PROLOGUE_SILU_GATE if silu_gate else PROLOGUE_RMSNORM if norm is not None else 0
        if norm is not None:
            norm = norm.to(torch.bfloat16).contiguous()
        if residual is None:
            y = torch.empty(m, n_out, dtype=torch.bfloat16)
        else:
            if residual.dtype != torch.bfloat16 or not residual.is_contiguous():
                raise ValueError("residual must be a contiguous bfloat16 tensor")
            if tuple(residual.shape) != (m, n_out):
                raise ValueError(f"residual shape {tuple(residual.shape)} != {(m, n_out)}")
            y = residual
        desc = self.desc
        rc = self._fn(
            x.data_ptr(),
            m,
            self.in_features,
            desc.w,
            desc.scale,
            desc.low,
            n_out,
            desc.bias,
            y.data_ptr(),
            self.bits,
            prologue,
            None if norm is None else norm.data_ptr(),
            eps,
            int(residual is not None),
        )
        check_rc(rc, "low-bit kernel")
        return y


def rope_(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    n_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """RoPE in place on the first n_heads heads of each row of x (M, width) contiguous
    bf16; cos, sin (M, head_dim) contiguous bf16."""
    lib.rope_bf16(
        x.data_ptr(), x.shape[0], x.shape[1], n_heads, head_dim, cos.data_ptr(), sin.data_ptr()
    )


def kv_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A (B, H, L, d) key or value tensor as the attention kernels read it, and the rows
    between its heads: itself where each head's L x d values are contiguous and the
    heads evenly spaced (a contiguous tensor: L; a view of a cache's room: more),
    else a contiguous copy."""
    _, h, n, d = t.shape
    s = t.stride()
    if s[3] == 1 and s[2] == d and s[1] % d == 0 and s[1] >= n * d and s[0] == h * s[1]:
        return t, s[1] // d
    return t.contiguous(), n


def attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    n_q_heads: int,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Grouped-query softmax attention for a few query tokens (draft decode steps).

    q (B*T, width): row b*T + t holds the T query tokens' heads first (head h at
    h*d); k, v (B, Hkv, L, d) bf16; allowed (B, T, L) bool, every query allowing a
    key. Returns (B*T, Hq*d) bf16, the layout the output projection reads.
    """
    b, hkv, n_keys, d = k.shape
    t = allowed.shape[1]
    q, allowed = q.contiguous(), allowed.contiguous()
    (k, k_rows), (v, v_rows) = kv_rows(k), kv_rows(v)
    out = torch.empty(b * t, n_q_heads * d, dtype=torch.bfloat16)
    rc = lib.attention_bf16(
        q.data_ptr(),
        q.shape[1],
        k.data_ptr(),
        v.data_ptr(),
        k_rows,
        v_rows,
        allowed.data_ptr(),
        b,
        n_q_heads,
        hkv,
        t,
        n_keys,
        d,
        scale,
        out.data_ptr(),
    )
    check_rc(rc, "attention kernel")
    return out


def _self_check(lib: ctypes.CDLL, bits: int) -> bool:
    """The kernel on a small random case (every row-chunk size) against `reference`
    (bits=16: against the float product of the bf16 weights)."""
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(48, 192, generator=gen) * 0.05
    bias = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(7, 192, generator=gen).bfloat16()
    if bits == 16:
        want = x.float() @ w.bfloat16().float().T + bias.float()
    else:
        u, scale, low = quantize(w, bits)
        want = reference(x, u, scale, low) + bias.float()
    got = NativeLowBitLinear(w, bias, lib, bits)(x).float()
    return bool(torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()))


def _attention_self_check(lib: ctypes.CDLL) -> bool:
    """Native attention against `attention_reference` on a small masked GQA case."""
    gen = torch.Generator().manual_seed(1)
    b, hq, hkv, t, n_keys, d = 2, 4, 2, 3, 37, 32
    q = torch.randn(b, t, hq, d, generator=gen).bfloat16()
    k = torch.randn(b, hkv, n_keys, d, generator=gen).bfloat16()
    v = torch.randn(b, hkv, n_keys, d, generator=gen).bfloat16()
    allowed = torch.rand(b, t, n_keys, generator=gen) > 0.3
    allowed[..., 0] = True
    want = attention_reference(q.transpose(1, 2), k, v, allowed, 0.2)
    got = attention(lib, q.reshape(b * t, hq * d), hq, k, v, allowed, 0.2).view(b, t, -1)
    return bool(torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2))
