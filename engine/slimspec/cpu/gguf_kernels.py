"""Linear layers and embedding lookups straight from GGUF weight blocks (csrc/gguf_kernels.c).

`GGUFLinear` keeps a weight as the file ships it (Q4_K, Q6_K or Q8_0 blocks, one row of
blocks per output feature) and multiplies int8-quantised activation rows with it inside
the kernel; `GGUFEmbedding` dequantises only the looked-up rows. `q8_0_blocks` makes
Q8_0 blocks from a dense weight: the `int8` target form of a model that comes as
safetensors.

The C source is compiled on first use (slimspec.cpu.clib): with AVX2/FMA (every x86-64
CPU of the last decade), using VNNI's multiply-adds where the CPU has them
(AVX512-VNNI or AVX-VNNI) and AMX tiles for many rows where it has those (Intel since
Sapphire Rapids), else as portable C; `path()` names the build so the
engine's log says which one runs. Every output value is computed by the same sequence
of operations whatever the number of rows and whichever build runs, so verifying k+1
positions or a batch gives each position the logits it gets alone, on any of these
CPUs (the header of the C file says how).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from slimspec.cpu import clib
from slimspec.cpu.native_kernels import LAYER_STEP_FIELDS

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "gguf_kernels.c"
BASE_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
AVX2_CFLAGS = (*BASE_CFLAGS, "-mavx2", "-mfma", "-mf16c")
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
VNNI_CFLAGS = (*AVX2_CFLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
VNNI_CPU_FLAGS = (*AVX2_CPU_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512_vnni")
AMX_CFLAGS = (*VNNI_CFLAGS, "-mamx-tile", "-mamx-int8")
AMX_CPU_FLAGS = (*VNNI_CPU_FLAGS, "amx_tile", "amx_int8")
AVX_VNNI_CFLAGS = (*AVX2_CFLAGS, "-mavxvnni")
AVX_VNNI_CPU_FLAGS = (*AVX2_CPU_FLAGS, "avx_vnni")
# (path name, flags, the CPU flags the build needs, simd_path()): the first the CPU has wins
BUILDS = (
    ("amx", AMX_CFLAGS, AMX_CPU_FLAGS, 5),
    ("avx512-vnni", VNNI_CFLAGS, VNNI_CPU_FLAGS, 4),
    ("avx-vnni", AVX_VNNI_CFLAGS, AVX_VNNI_CPU_FLAGS, 3),
    ("avx2", AVX2_CFLAGS, AVX2_CPU_FLAGS, 2),
    ("portable", BASE_CFLAGS, (), 0),
)
ENV_SWITCH = "SLIMSPEC_GGUF_KERNELS"  # 0: never load (tests of the fallback)

# ggml_type values with a kernel (gguf.GGMLQuantizationType), and their block shapes.
Q8_0, Q4_K, Q6_K = 8, 12, 14
# Q4_K and Q6_K repacked at load into resident panels of 8 weight rows (csrc: q4k_x8,
# q6k_x8; no ggml types): the same values, 1184 bytes per 8 x 256 of them for Q4_K (148
# a row's block), 1680 for Q6_K (210, the file's size)
Q4_K_X8, Q6_K_X8 = 1012, 1014
BLOCK_VALUES = {Q8_0: 32, Q4_K: 256, Q6_K: 256, Q4_K_X8: 256, Q6_K_X8: 256}
BLOCK_BYTES = {Q8_0: 34, Q4_K: 144, Q6_K: 210, Q4_K_X8: 148, Q6_K_X8: 210}
ACTIVATION_BLOCK = {Q8_0: 32, Q4_K: 256, Q6_K: 256, Q4_K_X8: 256, Q6_K_X8: 256}
TYPE_NAMES = {
    Q8_0: "Q8_0",
    Q4_K: "Q4_K",
    Q6_K: "Q6_K",
    Q4_K_X8: "Q4_K in 8-row panels",
    Q6_K_X8: "Q6_K in 8-row panels",
}
PANEL_FORMS = {Q4_K: Q4_K_X8, Q6_K: Q6_K_X8}  # a file's type -> its resident panels
PANEL_PACKERS = {Q4_K: "q4k_pack_x8", Q6_K: "q6k_pack_x8"}  # ... and the C that packs them
PANELS_ENV = "SLIMSPEC_GGUF_PANELS"  # 0: keep Q4_K and Q6_K in the file's layout (A/B runs)
# the builds that multiply from resident panels (the AVX2 family; AMX tiles read the
# file's layout, the portable build gains nothing from it)
PANEL_BUILDS = (2, 3, 4)

# Activation and output dtypes the native calls read and write as they are.
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_loaded: dict[str, Any] = {}


def cflags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The flags this CPU's build uses: AVX2/FMA/F16C (every x86-64 CPU of the last
    decade) with VNNI where the CPU has it (AVX512-VNNI: Intel since Cascade Lake, AMD
    Zen 4, its resident panels' pairs in 512-bit registers; AVX-VNNI: Intel client CPUs
    since Alder Lake), else portable C."""
    flags = clib.cpu_flags(cpuinfo)
    return next(b[1] for b in BUILDS if all(f in flags for f in b[2]))


class _Weight(ctypes.Structure):
    """gguf_weight in the C file: one weight matrix of a gguf_linear call."""

    _fields_ = [
        ("type", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("w", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class StepLayer(ctypes.Structure):
    """step_layer in the C file: one decoder layer of a layers_step call (its weights,
    norms and attention scale; its cache room, set per step)."""

    _fields_ = [
        ("qkv", ctypes.POINTER(_Weight)),
        ("post", ctypes.POINTER(_Weight)),
        *LAYER_STEP_FIELDS,
    ]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quantize_rows_q8.argtypes = [p, i64, i64, i64, i32, p, p, p]
    lib.quantize_rows_q8.restype = i32
    lib.gguf_matmul.argtypes = [i32, p, i64, i64, i64, p, p, p, i64, p, i64, i32]
    lib.gguf_matmul.restype = i32
    lib.gguf_dequant_rows.argtypes = [i32, p, i64, i64, p, i64, p]
    lib.gguf_dequant_rows.restype = i32
    lib.attention_rows_f32.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, p]
    lib.attention_rows_f32.restype = i32
    lib.attention_rows.argtypes = [p, p, p, i32, *[i64] * 9, p, *[i64] * 8, ctypes.c_float, p, i32]
    lib.attention_rows.restype = i32
    weights, ptrs = ctypes.POINTER(_Weight), ctypes.POINTER(ctypes.c_void_p)
    lib.gguf_linear.argtypes = [p, i32, i64, i64, i64, i32, weights, ptrs, i32, p, p, p, i32]
    lib.gguf_linear.restype = i32
    f32 = ctypes.c_float
    lib.layer_pre.argtypes = [p, i64, i64, p, f32, weights, ptrs, p, p, i64, p, p, p, p, i32]
    lib.layer_pre.restype = i32
    lib.layer_post.argtypes = [p, p, i64, i64, i64, weights, p, f32, p, p, p, p, p, p, i32]
    lib.layer_post.restype = i32
    lib.layers_step_scratch.argtypes = [i64] * 6
    lib.layers_step_scratch.restype = i64
    lib.layers_step.argtypes = [
        *(p, i64, i64, i64, i64, ctypes.POINTER(StepLayer), p, p, i64, i64, i64, i64),
        *(p, i64, i64, p, p, i64),
    ]
    lib.layers_step.restype = i32
    lib.simd_path.argtypes = []
    lib.simd_path.restype = i32
    for pack in (getattr(lib, name) for name in PANEL_PACKERS.values()):
        pack.argtypes = [p, i64, i64, i64, p]
        pack.restype = i32
    return lib


def load() -> ctypes.CDLL | None:
    """The compiled library, or None where it cannot be had (decided once, logged)."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load_uncached()
        return _loaded["lib"]


def _load_uncached() -> ctypes.CDLL | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    flags = cflags()
    path, cc = clib.prebuilt(SOURCE, flags), clib.compiler()
    if path is None and cc is None:
        log.warning(
            "GGUF kernels unavailable: no C compiler on PATH and no library built ahead for "
            "this source in $%s",
            clib.PREBUILT_DIR_ENV,
        )
        return None
    try:
        if path is None:
            assert cc is not None
            path = clib.library_path(SOURCE, cc, flags)
            if not path.exists():
                clib.build(cc, SOURCE, flags, path)
        lib = _bind(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("GGUF kernels unavailable: %s", getattr(exc, "stderr", None) or exc)
        return None
    if not self_check(lib):
        log.warning("GGUF kernels unavailable: the self-check disagreed with the reference")
        return None
    return lib


def self_check(lib: ctypes.CDLL) -> bool:
    """A Q8_0 product of a few rows against the float product of the dequantised
    weights and activations (a wrong build or a miscompiled path fails it)."""
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(24, 256, generator=g), torch.randn(3, 256, generator=g)
    blocks = q8_0_blocks(weight)
    b3 = blocks.reshape(24, 8, 34)
    w = b3[:, :, 2:].contiguous().view(torch.int8).float()
    w = (w * b3[:, :, :2].contiguous().view(torch.float16).float()).reshape(24, 256)
    q = torch.empty(3, 256, dtype=torch.int8)
    dx = torch.empty(3, 8, dtype=torch.float32)
    bsum = torch.empty(3, 16, dtype=torch.int16)
    y = torch.empty(3, 24, dtype=torch.float32)
    x = x.contiguous()
    if lib.quantize_rows_q8(_ptr(x), 3, 256, 256, 32, _ptr(q), _ptr(dx), _ptr(bsum)):
        return False
    rc = lib.gguf_matmul(
        Q8_0, _ptr(blocks), 24, 256, 272, _ptr(q), _ptr(dx), _ptr(bsum), 3, _ptr(y), 24, 0
    )
    x_hat = (q.float().reshape(3, 8, 32) * dx[..., None]).reshape(3, 256)
    ok = rc == 0 and bool(torch.allclose(y, x_hat @ w.T, rtol=1e-4, atol=1e-3))
    return ok and _k_quants_match_the_portable_path(lib)


def _k_quants_match_the_portable_path(lib: ctypes.CDLL) -> bool:
    """Q4_K and Q6_K at 17 activation rows (the panels, or AMX tiles where the build has
    them) give the bits of the same library's portable path: random blocks with small
    fp16 scales, one weight group and a partial one."""
    rng = np.random.default_rng(0)
    k, n, m = 512, 20, 17
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32) * 3)
    q = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // 256, dtype=torch.float32)
    bsum = torch.empty(m, k // 16, dtype=torch.int16)
    if lib.quantize_rows_q8(_ptr(x), m, k, k, 256, _ptr(q), _ptr(dx), _ptr(bsum)):
        return False
    for ggml_type, scale_at in ((Q4_K, (0, 4)), (Q6_K, (208, 210))):
        bb = BLOCK_BYTES[ggml_type]
        raw = rng.integers(0, 256, size=(n, k // 256, bb), dtype=np.uint8)
        halves = (np.abs(rng.standard_normal((n, k // 256, (scale_at[1] - scale_at[0]) // 2)))
                  * 0.01).astype(np.float16)  # fmt: skip
        raw[:, :, scale_at[0] : scale_at[1]] = halves.view(np.uint8).reshape(n, k // 256, -1)
        blocks = torch.from_numpy(raw.reshape(n, -1))
        # and its resident panels (16 of the 20 rows)
        forms = [
            (ggml_type, blocks),
            (PANEL_FORMS[ggml_type], _pack_x8(lib, ggml_type, blocks[:16], k)),
        ]
        ys = []
        for form, data in forms:
            rows = data.shape[0]
            for scalar in (0, 1):
                y = torch.empty(m, rows, dtype=torch.float32)
                args = (_ptr(q), _ptr(dx), _ptr(bsum), m, _ptr(y), rows, scalar)
                if lib.gguf_matmul(form, _ptr(data), rows, k, data.shape[1], *args):
                    return False
                ys.append(y[:, :16])
        if not all(torch.equal(ys[0], y) for y in ys[1:]):
            return False
    return True


def _pack_x8(lib: ctypes.CDLL, ggml_type: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    n = blocks.shape[0]
    blocks = blocks.contiguous()
    form = PANEL_FORMS[ggml_type]
    out = torch.empty(n, k // BLOCK_VALUES[form] * BLOCK_BYTES[form], dtype=torch.uint8)
    pack = getattr(lib, PANEL_PACKERS[ggml_type])
    if pack(_ptr(blocks), n, k, blocks.shape[1], _ptr(out)):
        raise ValueError(
            f"{TYPE_NAMES[ggml_type]} panels need rows of 256-value blocks in groups of 8, "
            f"got {n} rows of {blocks.shape[1]} bytes"
        )
    return out


def pack_panels(ggml_type: int, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """Q4_K or Q6_K weight rows (N, K/256*bytes) uint8, N a multiple of 8 -> the same
    values as resident 8-row panels (PANEL_FORMS[ggml_type]): what GGUFLinear keeps where
    panels_wanted()."""
    return _pack_x8(_require(), ggml_type, blocks, k)


def panels_wanted() -> bool:
    """Whether Q4_K and Q6_K weights are served from resident 8-row panels here: a build
    of the AVX2 family is loaded and SLIMSPEC_GGUF_PANELS is not 0."""
    lib = load()
    return (
        lib is not None
        and lib.simd_path() in PANEL_BUILDS
        and os.environ.get(PANELS_ENV, "1") != "0"
    )


def path() -> str:
    """Which build the loaded library is: 'amx', 'avx512-vnni', 'avx-vnni', 'avx2', 'portable',
    or 'unavailable'."""
    lib = load()
    if lib is None:
        return "unavailable"
    return next((b[0] for b in BUILDS if b[3] == lib.simd_path()), "portable")


def supported(ggml_type: int, k: int) -> bool:
    """True when a weight of this ggml type with rows of k values has a kernel."""
    return ggml_type in BLOCK_VALUES and k % BLOCK_VALUES[ggml_type] == 0


def _ptr(t: torch.Tensor | np.ndarray) -> int:
    return int(t.data_ptr()) if isinstance(t, torch.Tensor) else int(t.ctypes.data)


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q8 int8 (M, K), dx float (M, K/block), bsum int16 (M, K/16)) of float rows x (M, K)."""
    lib = _require()
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    dx = torch.empty(m, k // block, dtype=torch.float32)
    bsum = torch.empty(m, k // 16, dtype=torch.int16)
    rc = lib.quantize_rows_q8(_ptr(x), m, k, k, block, _ptr(q), _ptr(dx), _ptr(bsum))
    if rc:
        raise ValueError(f"cannot quantise rows of {k} values in blocks of {block}")
    return q, dx, bsum


def matmul(
    ggml_type: int,
    blocks: torch.Tensor,
    k: int,
    x: torch.Tensor,
    *,
    scalar: bool = False,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x (M, K) float @ W.T -> (M, N) float32, W the (N, row_bytes) uint8 blocks.

    `quantized` reuses quantize_rows(x, ACTIVATION_BLOCK[type]); `scalar` forces the
    portable path (tests compare both)."""
    lib = _require()
    n, row_bytes = blocks.shape
    q, dx, bsum = quantized or quantize_rows(x, ACTIVATION_BLOCK[ggml_type])
    m = q.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = lib.gguf_matmul(
        ggml_type, _ptr(blocks), n, k, row_bytes, _ptr(q), _ptr(dx), _ptr(bsum), m, _ptr(y), n,
        int(scalar),
    )  # fmt: skip
    if rc:
        raise ValueError(f"GGUF matmul: type {ggml_type}, K={k}, row bytes {row_bytes} do not fit")
    return y


def dequantize_rows(
    ggml_type: int, blocks: torch.Tensor, k: int, ids: torch.Tensor
) -> torch.Tensor:
    """The float32 rows `ids` (any shape) of W, as ggml dequantises them -> (*ids.shape, K)."""
    lib = _require()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    n_rows = blocks.shape[0]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n_rows):
        raise IndexError(f"token id out of range for an embedding of {n_rows} rows")
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    rc = lib.gguf_dequant_rows(
        ggml_type, _ptr(blocks), k, blocks.shape[1], _ptr(flat), flat.numel(), _ptr(out)
    )
    if rc:
        raise ValueError(f"GGUF dequantise: type {ggml_type}, K={k} do not fit")
    return out.reshape(*ids.shape, k)


def attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Softmax attention one (row, head) at a time: q (B, T, Hq, d), k and v (B, Hkv, L,
    d), allowed (B, T, L) bool or None for causal (the queries are the last T keys)
    -> (B, T, Hq, d) float32, or its values rounded to `out_dtype` (bfloat16). A row's
    output is the same whatever T is. bfloat16 inputs are read as they are (their
    float32 values), any strides with the last dimension contiguous."""
    lib = _require()
    dtype = q.dtype if q.dtype == k.dtype == v.dtype and q.dtype in _NATIVE_DTYPES else None
    if dtype is None:
        q, k, v = q.float(), k.float(), v.float()
        dtype = torch.float32
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    b, t, hq, d = q.shape
    hkv, n_keys = k.shape[1], k.shape[2]
    mask = None
    if allowed is not None:
        mask = allowed.expand(b, t, n_keys)
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
    out_bf16 = out_dtype == torch.bfloat16
    out = torch.empty(b, t, hq, d, dtype=torch.bfloat16 if out_bf16 else torch.float32)
    rc = lib.attention_rows(
        _ptr(q), _ptr(k), _ptr(v), int(dtype == torch.bfloat16), *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], None if mask is None else _ptr(mask),
        *((0, 0) if mask is None else mask.stride()[:2]),
        b, t, hq, hkv, n_keys, d, float(scale), _ptr(out), int(out_bf16),
    )  # fmt: skip
    if rc:
        raise RuntimeError(
            f"row attention failed (code {rc}): Hq={hq}, Hkv={hkv}, T={t}, L={n_keys}"
        )
    return out if out_bf16 or out_dtype == torch.float32 else out.to(out_dtype)


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """Dense (N, K) weight -> (N, K/32*34) uint8 Q8_0 blocks, byte for byte what ggml's
    quantiser writes (scale amax/127 stored as fp16, values rounded half away from
    zero with the float32 scale): the `int8` target form."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 values, got {k}")
    w = weight.detach().float().reshape(n, k // 32, 32)
    d = w.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = w * inv
    q = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    out[:, :, :2] = d.half().view(torch.uint8).reshape(n, k // 32, 2)
    out[:, :, 2:] = q.view(torch.uint8)
    return out.reshape(n, k // 32 * 34)


_recent = threading.local()  # this thread's last quantised activation rows


def _shared(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rows(rows, block), reused when the projections that read the same
    activations (q, k, v; gate, up) ask for it in turn. The entry holds the rows
    themselves, so their memory cannot be reused by another tensor while it is cached,
    and the version counter catches an in-place change."""
    # Inference-mode tensors keep no version counter; the projections that share an
    # input are called one after the other on it, with nothing writing it in between.
    version = -1 if rows.is_inference() else rows._version
    key = (rows.data_ptr(), version, tuple(rows.shape), rows.stride(), rows.dtype, block)
    cached = getattr(_recent, "entry", None)
    if cached is not None and cached[0] == key:
        return cached[2]
    quantized = quantize_rows(rows, block)
    _recent.entry = (key, rows, quantized)
    return quantized


def _require() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the GGUF kernels could not be built or loaded here (see the log)")
    return lib


_scratch = threading.local()  # this thread's buffers for the quantised activations


def _scratch_buffers(m: int, k: int, block: int) -> tuple[int, int, int]:
    """Pointers to room for (q8 (M, K), dx (M, K/block), bsum (M, K/16)), reused."""
    need = m * k
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < 2 * need + 256:
        # q8: need bytes; dx: <= need/32 floats; bsum: need/16 int16 (64-byte aligned parts)
        buf = torch.empty(2 * need + 256, dtype=torch.uint8)
        _scratch.buf = buf
    base = _ptr(buf)
    q = (base + 63) // 64 * 64
    dx = (q + need + 63) // 64 * 64
    bsum = (dx + need // block * 4 + 63) // 64 * 64
    return q, dx, bsum


def linear_rows(
    x: torch.Tensor, layers: list[GGUFLinear], *, scalar: bool = False
) -> list[torch.Tensor]:
    """[x @ W_i.T (+ bias_i)] for GGUFLinear layers with the same input width and
    activation block, in x's dtype (float32 or bfloat16), from one native call that
    quantises x once and multiplies all weights in one parallel region: each value is
    the one layer(x) gives alone."""
    weights = (_Weight * len(layers))(*[layer.native_weight for layer in layers])
    sizes = tuple(layer.out_features for layer in layers)
    return _linear(x, layers[0].in_features, layers[0].ggml_type, weights, sizes, scalar)


def _linear(
    x: torch.Tensor, k: int, ggml_type: int, weights: Any, sizes: tuple[int, ...], scalar: bool
) -> list[torch.Tensor]:
    lib = _loaded.get("lib") or _require()
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if rows.stride(-1) != 1 or (m > 1 and rows.stride(0) < k):
        rows = rows.contiguous()
    q, dx, bsum = _scratch_buffers(m, k, ACTIVATION_BLOCK[ggml_type])
    dtype = x.dtype
    outs = [torch.empty(m, n, dtype=dtype) for n in sizes]
    ys = (ctypes.c_void_p * len(outs))(*[y.data_ptr() for y in outs])
    bf16 = int(dtype == torch.bfloat16)
    rc = lib.gguf_linear(
        rows.data_ptr(), bf16, m, k, rows.stride(0), len(sizes), weights, ys, bf16, q, dx, bsum,
        int(scalar),
    )  # fmt: skip
    if rc:
        raise ValueError(f"GGUF linear: weights of K={k} that do not fit or mix activation blocks")
    return [y.view(*lead, n) for y, n in zip(outs, sizes, strict=True)]


def _glue_scratch(values: int) -> torch.Tensor:
    """This thread's reused bf16 room for a layer call's intermediates (>= values)."""
    buf = getattr(_scratch, "glue", None)
    if buf is None or buf.numel() < values:
        buf = torch.empty(values, dtype=torch.bfloat16)
        _scratch.glue = buf
    return buf


def layer_pre(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv: LinearGroup,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> list[torch.Tensor]:
    """A decoder layer's start in one native call: RMSNorm of h (M, K) bf16, the q/k/v
    projections (M, N_i) bf16, and RoPE (cos, sin (M, d) bf16) on the q and k heads
    (csrc: layer_pre; values as torch's bf16 operations, up to the norm's sum order)."""
    lib = _loaded.get("lib") or _require()
    m, k = h.shape
    d = cos.shape[-1]
    xn = _glue_scratch(m * k)
    q, dx, bsum = _scratch_buffers(m, k, 32)
    outs = [torch.empty(m, n, dtype=torch.bfloat16) for n in qkv.sizes]
    ys = (ctypes.c_void_p * len(outs))(*[y.data_ptr() for y in outs])
    rc = lib.layer_pre(
        h.data_ptr(), m, k, norm_weight.data_ptr(), eps, qkv.weights, ys, cos.data_ptr(),
        sin.data_ptr(), d, xn.data_ptr(), q, dx, bsum, 0,
    )  # fmt: skip
    if rc:
        raise ValueError(f"layer_pre: weights that do not fit K={k} or heads of {d}")
    return outs


def layer_post(
    h: torch.Tensor,
    attn: torch.Tensor,
    o: GGUFLinear,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: LinearGroup,
    down: GGUFLinear,
) -> torch.Tensor:
    """A decoder layer's end in one native call: h + o(attn), then + down(SiLU(gate) x
    up) of its RMSNorm; h (M, K) and attn (M, Ka) bf16 -> (M, K) bf16 (csrc:
    layer_post)."""
    lib = _loaded.get("lib") or _require()
    m, k = h.shape
    ka, inter = attn.shape[1], gate_up.sizes[0]
    glue = _glue_scratch(m * k + 3 * m * inter)
    q, dx, bsum = _scratch_buffers(m, max(k, ka, inter), 32)
    weights = (_Weight * 4)(o.native_weight, *gate_up.weights, down.native_weight)
    out = torch.empty(m, k, dtype=torch.bfloat16)
    base = glue.data_ptr()
    rc = lib.layer_post(
        h.data_ptr(), attn.data_ptr(), m, k, ka, weights, norm_weight.data_ptr(), eps,
        out.data_ptr(), base, base + 2 * m * k, q, dx, bsum, 0,
    )  # fmt: skip
    if rc:
        raise ValueError(f"layer_post: weights that do not fit K={k}, {ka} or {inter}")
    return out


def step_layer(
    qkv: LinearGroup,
    o: GGUFLinear,
    gate_up: LinearGroup,
    down: GGUFLinear,
    norms: tuple[torch.Tensor, torch.Tensor],
    eps: tuple[float, float],
    scale: float,
) -> StepLayer:
    """A glued layer as layers_step reads it (the weights of layer_pre and layer_post,
    the input and post-attention norms' weights (bf16) and epsilons, the attention's
    scale); its cache room is set per step. The struct keeps its weight arrays alive."""
    post = (_Weight * 4)(o.native_weight, *gate_up.weights, down.native_weight)
    layer = StepLayer()
    layer.qkv = ctypes.cast(qkv.weights, ctypes.POINTER(_Weight))
    layer.post = ctypes.cast(post, ctypes.POINTER(_Weight))
    layer.in_norm, layer.post_norm = norms[0].data_ptr(), norms[1].data_ptr()
    layer.in_eps, layer.post_eps, layer.scale = eps[0], eps[1], scale
    return layer


def layers_step(
    h: torch.Tensor,
    b: int,
    t: int,
    layers: Any,
    widest_gate: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: tuple[int, int, int],
    n: int,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Rows h (b*t, K) bf16 through every layer of `layers` (a ctypes array of StepLayer
    whose rooms hold n cached slots and room for t more) in one native call: each
    layer's layer_pre, its new keys and values into its room, attention_rows over the
    n + t slots (allowed (b, t, n + t) bool, None: causal), layer_post. heads: (Hq, Hkv,
    head_dim). Returns the last layer's output rows (b*t, K) bf16, bit for bit the
    per-layer calls' (lean_layers.LeanLayer.glued_rows)."""
    lib = _loaded.get("lib") or _require()
    m, k = h.shape
    hq, hkv, d = heads
    need = int(lib.layers_step_scratch(m, k, hq, hkv, d, widest_gate))
    buf = getattr(_scratch, "step", None)
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=torch.uint8)
        _scratch.step = buf
    mask, asb, ast = None, 0, 0
    if allowed is not None:
        mask = allowed.expand(b, t, n + t)
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        asb, ast = mask.stride()[:2]
    out = torch.empty(m, k, dtype=torch.bfloat16)
    rc = lib.layers_step(
        h.data_ptr(), b, t, k, len(layers), layers, cos.data_ptr(), sin.data_ptr(), hq, hkv, d,
        n, None if mask is None else mask.data_ptr(), asb, ast, out.data_ptr(), buf.data_ptr(),
        buf.numel(),
    )  # fmt: skip
    if rc:
        raise RuntimeError(f"layers_step failed (code {rc}): K={k}, heads {heads}, n={n}, t={t}")
    return out


def native_input(x: torch.Tensor) -> bool:
    """Whether the native kernels take x as it is (float32 or bfloat16 on the CPU)."""
    return x.dtype in _NATIVE_DTYPES and x.device.type == "cpu"


class LinearGroup:
    """GGUFLinear layers that read the same input (q/k/v; gate/up): the first one called
    computes every member's output in one native call (one activation quantisation, one
    parallel region) and the others take theirs when called on the same tensor. Any
    other call computes afresh, so a member's output is always layer(x)'s."""

    def __init__(self, members: list[GGUFLinear]) -> None:
        first = members[0]
        block = ACTIVATION_BLOCK[first.ggml_type]
        if any(
            m.in_features != first.in_features or ACTIVATION_BLOCK[m.ggml_type] != block
            for m in members
        ):
            raise ValueError("a group's layers must share the input width and activation block")
        self.members = members
        self.weights = (_Weight * len(members))(*[m.native_weight for m in members])
        self.sizes = tuple(m.out_features for m in members)
        self._pending = threading.local()
        for i, member in enumerate(members):
            member.group = (self, i)

    def outputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every member's output for x (native_input(x)) from one native call."""
        first = self.members[0]
        return _linear(x, first.in_features, first.ggml_type, self.weights, self.sizes, False)

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        # Inference-mode tensors keep no version counter; the members are called one
        # after the other on the same input with nothing writing it in between.
        version = -1 if x.is_inference() else x._version
        entry = getattr(self._pending, "entry", None)
        if entry is not None and entry[0] is x and entry[1] == version:
            y = entry[2][index]
            if y is not None:
                entry[2][index] = None
                if all(out is None for out in entry[2]):  # all handed out: hold no input
                    self._pending.entry = None
                return y
        first = self.members[0]
        outs: list[torch.Tensor | None] = list(
            _linear(x, first.in_features, first.ggml_type, self.weights, self.sizes, False)
        )
        y = outs[index]
        assert y is not None
        outs[index] = None
        self._pending.entry = (x, version, outs)
        return y


class GGUFLinear(nn.Module):
    """y = x @ W.T (+ bias) with W kept as GGUF blocks (inference only).

    Q4_K and Q6_K blocks are kept as resident 8-row panels (Q4_K_X8, Q6_K_X8: the same
    values) where `panels` (default: panels_wanted()) and the rows come in eights.
    `weight` is a one-element expanded placeholder that only reports the shape, dtype
    and device callers read (the decoder reads the head's shape and dtype)."""

    def __init__(
        self,
        ggml_type: int,
        blocks: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        panels: bool | None = None,
    ) -> None:
        super().__init__()
        if not supported(ggml_type, in_features):
            raise ValueError(f"no GGUF kernel for type {ggml_type} with rows of {in_features}")
        n, row_bytes = blocks.shape
        expected = in_features // BLOCK_VALUES[ggml_type] * BLOCK_BYTES[ggml_type]
        if blocks.dtype != torch.uint8 or row_bytes != expected:
            raise ValueError(f"blocks must be uint8 (N, {expected}), got {tuple(blocks.shape)}")
        if ggml_type in PANEL_FORMS.values() and n % 8:
            raise ValueError(f"{TYPE_NAMES[ggml_type]} hold rows in eights, got {n} rows")
        wanted = panels_wanted() if panels is None else panels
        if ggml_type in PANEL_FORMS and n % 8 == 0 and wanted:
            ggml_type, blocks = PANEL_FORMS[ggml_type], pack_panels(ggml_type, blocks, in_features)
            row_bytes = blocks.shape[1]
        self.ggml_type = ggml_type
        self.in_features = in_features
        self.out_features = n
        self.blocks = blocks.contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.weight = nn.Parameter(torch.zeros(1, dtype=dtype).expand(n, in_features), False)
        self.native_weight = _Weight(
            ggml_type,
            0,
            _ptr(self.blocks),
            n,
            row_bytes,
            None if self.bias is None else _ptr(self.bias),
        )
        self._weight_ref = ctypes.byref(self.native_weight)
        self._sizes = (n,)
        self.group: tuple[LinearGroup, int] | None = None  # set by LinearGroup

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """This layer's output for x (native_input(x)) from the native kernels."""
        return _linear(x, self.in_features, self.ggml_type, self._weight_ref, self._sizes, False)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native_input(x):
            if self.group is not None:
                return self.group[0].output(self.group[1], x)
            return self.native(x)
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        block = ACTIVATION_BLOCK[self.ggml_type]
        y = matmul(
            self.ggml_type, self.blocks, self.in_features, rows, quantized=_shared(rows, block)
        )
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def nbytes(self) -> int:
        return self.blocks.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        name = TYPE_NAMES[self.ggml_type]
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={name}"


class GGUFEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks: a lookup dequantises only the rows it needs."""

    def __init__(
        self, ggml_type: int, blocks: torch.Tensor, embedding_dim: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if not supported(ggml_type, embedding_dim):
            raise ValueError(f"no GGUF kernel for type {ggml_type} with rows of {embedding_dim}")
        self.ggml_type = ggml_type
        self.blocks = blocks
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.weight = nn.Parameter(
            torch.zeros(1, dtype=dtype).expand(blocks.shape[0], embedding_dim), False
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.ggml_type, self.blocks, self.embedding_dim, ids)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={TYPE_NAMES[self.ggml_type]}"
