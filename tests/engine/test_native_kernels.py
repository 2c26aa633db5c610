"""The native int4/int8/bf16 draft kernels (native_kernels.py, csrc/draft_kernels.c).

They only feed the draft, so they are checked for what they compute (against a float
reference of the same quantisation, and close to the unquantised product), for how
they are built and for falling back cleanly where they cannot run. Exactness of the
decoder's output with them is in test_draft_fast_fused.py.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import pytest
import torch
from slimspec.cpu import native_kernels as nl

LIB = nl.load()
needs_lib = pytest.mark.skipif(
    LIB is None, reason="no AVX512-VNNI/AVX2 CPU or C compiler for the native kernels"
)
needs_bf16 = pytest.mark.skipif(
    not nl.bf16_available(), reason="no AVX512-BF16 CPU for the native bf16-weight kernel"
)


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """load() deciding anew, building into an empty cache."""
    monkeypatch.setattr(nl, "_loaded", {})
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path))
    return tmp_path


def unpack(packed: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """Inverse of nl.pack, written from the layout comment in csrc/draft_kernels.c:
    [n / 16][g][p][n % 16][i]; 8 bits: u[4p + i]; 4 bits: u[4p + i] in the low nibble,
    u[32 + 4p + i] in the high one."""
    groups = k // nl.GROUP
    blocks = packed.view(-1, groups, 2 * bits, 16, 4).permute(0, 3, 1, 2, 4)
    rows = blocks.reshape(-1, groups, 8 * bits)[:n]  # (N, G, group bytes), padding dropped
    if bits == 4:
        rows = torch.cat([rows & 0x0F, rows >> 4], dim=-1)
    return rows.reshape(n, k)


@pytest.mark.parametrize("bits", nl.QUANT_BITS)
def test_quantize_and_pack_round_trip(bits):
    w = torch.randn(12, 128) * 0.1
    u, scale, low = nl.quantize(w, bits)
    assert int(u.max()) <= 2**bits - 1
    # the kernel stores scale and low as float16: they must be float16 values already
    assert torch.equal(scale.half().float(), scale) and torch.equal(low.half().float(), low)
    back = (u.float().view(12, 2, 64) * scale[..., None] + low[..., None]).view(12, 128)
    assert (back - w).abs().max() <= scale.max() / 2 + 1e-6  # within half a step
    assert torch.equal(unpack(nl.pack(u, bits), bits, 12, 128), u)


@needs_lib
@pytest.mark.parametrize("bits", nl.QUANT_BITS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 17])
def test_kernel_matches_reference(bits, m):
    """Every activation-row chunk size (int8: 4 rows, int4: 8), a bias, N = 4 mod 16 (a
    padded int4 block) and an odd group count."""
    gen = torch.Generator().manual_seed(10 * bits + m)
    w = torch.randn(52, 320, generator=gen) * 0.05
    bias = torch.randn(52, generator=gen).bfloat16()
    x = (torch.randn(m, 320, generator=gen) * 3).bfloat16()
    lin = nl.NativeLowBitLinear(w, bias, LIB, bits)
    u, scale, low = nl.quantize(w, bits)
    want = nl.reference(x, u, scale, low) + bias.float()
    got = lin(x.view(1, m, 320))
    assert got.shape == (1, m, 52) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), want, rtol=8e-3, atol=1e-2)


@needs_lib
@pytest.mark.parametrize("bits", nl.QUANT_BITS)
@pytest.mark.parametrize("rows", [4, 20, 48, 52])
def test_a_prefix_of_rows_is_the_full_products_prefix(bits, rows):
    """The subset head scores the first `rows` outputs (a multiple of 4 that may end
    inside a 16-row block): those columns of the full product, nothing written past
    them."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(52, 128, generator=gen) * 0.05
    bias = torch.randn(52, generator=gen).bfloat16()
    x = torch.randn(9, 128, generator=gen).bfloat16()
    lin = nl.NativeLowBitLinear(w, bias, LIB, bits)
    full = lin(x)
    assert torch.equal(lin.fused(x, rows=rows), full[:, :rows])
    residual = torch.ones(9, rows, dtype=torch.bfloat16)
    added = lin.fused(x, rows=rows, residual=residual)
    assert added is residual
    torch.testing.assert_close(added.float(), 1 + full[:, :rows].float(), rtol=1e-2, atol=1e-2)


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_bf16_kernel_matches_the_float_product(m):
    """bf16 weights: the float product of the bf16 weights and inputs, up to the bf16
    rounding of the output (every row-chunk size, a bias, N = 4 mod 8, odd groups)."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(52, 320, generator=gen) * 0.05
    bias = torch.randn(52, generator=gen).bfloat16()
    x = (torch.randn(m, 320, generator=gen) * 3).bfloat16()
    got = nl.NativeLowBitLinear(w, bias, LIB, 16)(x)
    want = x.float() @ w.bfloat16().float().T + bias.float()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


@needs_bf16
def test_bf16_kernel_prologues():
    """RMSNorm and SiLU-gate prologues with bf16 weights match torch's bf16 ops."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=gen) * 0.05
    lin = nl.NativeLowBitLinear(w, None, LIB, 16)
    h = (torch.randn(3, 128, generator=gen) * 4).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(128, generator=gen)).bfloat16()
    normed = torch.nn.functional.rms_norm(h, (128,), norm_w, 1e-6)  # bf16, as the draft
    want = torch.nn.functional.linear(normed, w.bfloat16()).float()
    got = lin.fused(h, norm=norm_w, eps=1e-6).float()
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)
    gu = torch.randn(2, 128, generator=gen).bfloat16()
    lin_down = nl.NativeLowBitLinear(w[:, :64], None, LIB, 16)
    act = torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:]
    want = torch.nn.functional.linear(act, w[:, :64].bfloat16()).float()
    torch.testing.assert_close(
        lin_down.fused(gu, silu_gate=True).float(), want, rtol=0.02, atol=0.02
    )


@needs_lib
@pytest.mark.parametrize(("bits", "tolerance"), [(4, 0.12), (8, 0.015)])
def test_kernel_is_close_to_the_float_product(bits, tolerance):
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(256, 512, generator=gen) * 0.05
    x = torch.randn(2, 512, generator=gen).bfloat16()
    got = nl.NativeLowBitLinear(w, None, LIB, bits)(x).float()
    exact = x.float() @ w.T
    assert (got - exact).norm() / exact.norm() < tolerance


@needs_lib
def test_rejects_shapes_and_bits_it_cannot_take():
    with pytest.raises(ValueError, match="K % 64"):
        nl.NativeLowBitLinear(torch.randn(8, 96), None, LIB, 4)
    with pytest.raises(ValueError, match="N % 4"):
        nl.NativeLowBitLinear(torch.randn(6, 64), None, LIB, 8)
    with pytest.raises(ValueError, match="bits"):
        nl.NativeLowBitLinear(torch.randn(8, 64), None, LIB, 2)
    with pytest.raises(ValueError, match="bits"):
        nl.quantize(torch.randn(8, 64), 16)


def test_cpu_flags_are_read_from_cpuinfo():
    flags = "flags\t\t: fpu avx512f avx512bw avx512vl avx512_vnni f16c fma sse\n"
    assert nl.cpu_supported("processor\t: 0\n" + flags)
    assert not nl.cpu_supported(flags.replace(" avx512_vnni", ""))
    assert not nl.cpu_supported("processor\t: 0\n")
    assert not nl.cpu_has_bf16(flags)
    assert nl.cpu_has_bf16(flags.replace(" sse", " avx512_bf16 sse"))


def test_each_cpu_gets_the_widest_build_it_can_run():
    avx512 = "flags\t\t: avx2 avx512f avx512bw avx512vl avx512_vnni f16c fma\n"
    zen2 = "flags\t\t: sse4_2 avx avx2 f16c fma\n"  # AMD Zen 1-3, Intel Haswell..Ice Lake client
    assert nl.build_for(avx512) == ("avx512-vnni", nl.CFLAGS)
    sapphire = avx512.replace("\n", " amx_tile amx_int8 amx_bf16\n")
    assert nl.build_for(sapphire) == ("amx", nl.AMX_CFLAGS)
    assert nl.build_for(zen2) == ("avx2", nl.AVX2_CFLAGS)
    assert nl.build_for(avx512.replace(" avx512_vnni", "")) == ("avx2", nl.AVX2_CFLAGS)
    assert nl.cpu_supported(zen2)
    assert nl.build_for("flags\t\t: sse4_2 avx\n") is None
    assert nl.cflags(zen2) != nl.cflags(avx512)  # two libraries, two cache names


def build_beside(path: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """Another build of the kernels' source, compiled and bound beside the loaded one."""
    cc = nl._compiler()
    assert cc is not None and LIB is not None
    nl._build(cc, path, flags)
    return nl._bind(ctypes.CDLL(str(path)))


AVX512_BUILD = nl.cpu_supported() and nl.build_for()[0] in ("amx", "avx512-vnni")  # type: ignore[index]


@pytest.mark.skipif(
    not AVX512_BUILD, reason="needs an AVX512-VNNI CPU to run both builds side by side"
)
@pytest.mark.parametrize("bits", nl.QUANT_BITS)
def test_the_avx2_build_computes_the_avx512_builds_bits(fresh_load, bits):
    """Same int8 activations, exact integer sums, the same float update per output:
    an AVX2 node and an AVX512 node give a draft the same products."""
    avx2 = build_beside(fresh_load / "avx2.so", nl.AVX2_CFLAGS)
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(72, 320, generator=gen) * 0.05
    bias = torch.randn(72, generator=gen).bfloat16()
    for m in (1, 3, 4, 5, 9):
        x = torch.randn(m, 320, generator=gen).bfloat16()
        want = nl.NativeLowBitLinear(w, bias, LIB, bits)(x)
        assert torch.equal(nl.NativeLowBitLinear(w, bias, avx2, bits)(x), want)


@pytest.mark.skipif(
    not nl.cpu_supported() or nl.build_for()[0] != "amx",  # type: ignore[index]
    reason="needs a CPU with AMX to run the tile path beside the AVX512-VNNI build",
)
@pytest.mark.parametrize("bits", nl.QUANT_BITS)
def test_the_amx_tiles_give_the_avx512_builds_bits(fresh_load, bits):
    """From 16 activation rows (a prefill) the AMX build multiplies by tiles; its
    integers and float steps are the vpdpbusd path's, so a draft's prefill is the same
    on an AMX node as on any AVX512-VNNI node: with the RMSNorm and SiLU-gate
    prologues, a residual add, a bias, a partial last block and partial row groups."""
    vnni = build_beside(fresh_load / "vnni.so", nl.CFLAGS)
    gen = torch.Generator().manual_seed(bits)
    w = torch.randn(52, 320, generator=gen) * 0.05  # 3 blocks of 16 rows and one of 4
    bias = torch.randn(52, generator=gen).bfloat16()
    norm = (1 + 0.1 * torch.randn(320, generator=gen)).bfloat16()
    tiles, vec = (nl.NativeLowBitLinear(w, bias, lib, bits) for lib in (LIB, vnni))
    for m in (15, 16, 17, 40, 64):
        x = torch.randn(m, 320, generator=gen).bfloat16()
        gate_up = torch.randn(m, 640, generator=gen).bfloat16()
        assert torch.equal(tiles(x), vec(x))
        assert torch.equal(tiles.fused(x, norm=norm, eps=1e-6), vec.fused(x, norm=norm, eps=1e-6))
        assert torch.equal(tiles.fused(gate_up, silu_gate=True), vec.fused(gate_up, silu_gate=True))
        h = torch.randn(m, 52, generator=gen).bfloat16()
        got, want = h.clone(), h.clone()
        tiles.fused(x, residual=got)
        vec.fused(x, residual=want)
        assert torch.equal(got, want)


def test_switched_off_by_environment(fresh_load, monkeypatch):
    monkeypatch.setenv(nl.ENV_SWITCH, "0")
    assert nl.load() is None


def test_a_failing_build_falls_back_with_a_warning(fresh_load, monkeypatch, caplog):
    monkeypatch.setattr(nl, "cpu_supported", lambda cpuinfo=None: True)
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger=nl.__name__):
        assert nl.load() is None
    assert "build or load failed" in caplog.text
    assert not list(fresh_load.glob("kernels/*.so"))


@needs_lib
def test_builds_once_into_the_cache(fresh_load):
    lib = nl.load()
    assert lib is not None and nl.load() is lib
    built = list((fresh_load / "kernels").glob("draft_kernels-*.so"))
    assert [p.name for p in built] == [nl.library_path(nl._compiler()).name]


@needs_lib
def test_a_library_built_ahead_loads_without_a_compiler(fresh_load, monkeypatch, tmp_path):
    """The engine image: the library compiled in the build stage under prebuilt_name(),
    no compiler on PATH at run time."""
    shipped = tmp_path / "shipped"
    nl._build(nl._compiler(), shipped / nl.prebuilt_name())
    (shipped / "draft_kernels-src-0123456789abcdef.so").write_bytes(b"another source")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    assert nl._compiler() is None
    monkeypatch.setenv(nl.PREBUILT_DIR_ENV, str(shipped))
    lib = nl.load()
    assert lib is not None and not list(fresh_load.glob("kernels/*.so"))  # nothing compiled
    w = torch.randn(32, 128) * 0.05
    x = torch.randn(3, 128).bfloat16()
    u, scale, low = nl.quantize(w, 4)
    got = nl.NativeLowBitLinear(w, None, lib, 4)(x).float()
    torch.testing.assert_close(got, nl.reference(x, u, scale, low), rtol=8e-3, atol=1e-2)


def test_no_compiler_and_no_library_for_this_source_falls_back(fresh_load, monkeypatch, tmp_path):
    """A folder holding only a library of another source (another weight layout) is not
    used: the drafts fall back to aten's kernels."""
    monkeypatch.setattr(nl, "cpu_supported", lambda cpuinfo=None: True)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "draft_kernels-src-0123456789abcdef.so").write_bytes(b"another source")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv(nl.PREBUILT_DIR_ENV, str(shipped))
    assert nl.load() is None


@needs_lib
@pytest.mark.parametrize("m", [1, 3])
def test_rmsnorm_prologue_and_residual_epilogue(m):
    """qkv = W @ rmsnorm(h) and h += W @ x in one call each, as the layer uses them."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(64, 128, generator=gen) * 0.05
    lin = nl.NativeLowBitLinear(w, None, LIB, 8)
    h = (torch.randn(m, 128, generator=gen) * 4).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(128, generator=gen)).bfloat16()
    normed = torch.nn.functional.rms_norm(h.float(), (128,), norm_w.float(), 1e-6)
    got = lin.fused(h, norm=norm_w, eps=1e-6).float()
    torch.testing.assert_close(got, lin(normed.bfloat16()).float(), rtol=0.02, atol=0.02)
    assert (got - normed @ w.T).norm() / (normed @ w.T).norm() < 0.015

    x = torch.randn(m, 128, generator=gen).bfloat16()
    residual = torch.randn(m, 64, generator=gen).bfloat16()
    want = residual.float() + lin(x).float()
    out = lin.fused(x, residual=residual)
    assert out is residual  # added in place
    torch.testing.assert_close(out.float(), want, rtol=0.01, atol=0.02)
    with pytest.raises(ValueError, match="residual"):
        lin.fused(x, residual=torch.zeros(m, 64))


@needs_lib
def test_silu_gate_prologue():
    """down(silu(gate) * up) from the gate|up output in one call."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(32, 192, generator=gen) * 0.05
    lin = nl.NativeLowBitLinear(w, None, LIB, 8)
    gu = torch.randn(2, 384, generator=gen).bfloat16()
    act = torch.nn.functional.silu(gu[:, :192].float()) * gu[:, 192:].float()
    got = lin.fused(gu, silu_gate=True).float()
    u, scale, low = nl.quantize(w, 8)
    torch.testing.assert_close(got, nl.reference(act, u, scale, low), rtol=0.02, atol=0.02)
    # int8 activations and weights: the reference itself is ~1.5% off the float product
    assert (got - act @ w.T).norm() / (act @ w.T).norm() < 0.02
    with pytest.raises(ValueError, match="input width"):
        lin.fused(gu[:, :192], silu_gate=True)


@needs_lib
def test_rope_matches_hf():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    m, heads, d = 3, 5, 32
    x = torch.randn(m, (heads + 2) * d, generator=gen).bfloat16()  # 5 roped heads, 2 not
    angles = torch.rand(m, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([angles.sin()] * 2, -1).bfloat16()
    heads_x = x.float().view(m, heads + 2, d)[:, :heads].transpose(0, 1)  # (H, m, d)
    want, _ = apply_rotary_pos_emb(heads_x, heads_x, cos.float(), sin.float(), unsqueeze_dim=0)
    got = x.clone()
    nl.rope_(LIB, got, heads, d, cos, sin)
    got = got.float().view(m, heads + 2, d)
    torch.testing.assert_close(got[:, :heads].transpose(0, 1), want, rtol=0.01, atol=0.02)
    assert torch.equal(got[:, heads:], x.float().view(m, heads + 2, d)[:, heads:])


@needs_lib
@pytest.mark.parametrize("t", [1, 4, 16])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 4, 16), (14, 2, 64), (8, 2, 128)])
def test_attention_matches_reference(t, hq, hkv, d):
    """GQA, holes in the cache (masked keys), ragged rows, a key count not a multiple
    of 16; q read from a wider qkv row as the layer passes it."""
    gen = torch.Generator().manual_seed(t * hq + d)
    b, n_keys = 2, 45
    qkv = torch.randn(b * t, (hq + 2 * hkv) * d, generator=gen).bfloat16()
    k = torch.randn(b, hkv, n_keys, d, generator=gen).bfloat16()
    v = torch.randn(b, hkv, n_keys, d, generator=gen).bfloat16()
    allowed = torch.rand(b, t, n_keys, generator=gen) > 0.4
    allowed[:, :, -t:] |= torch.eye(t, dtype=torch.bool)  # every query sees itself
    q = qkv[:, : hq * d].reshape(b, t, hq, d).transpose(1, 2)
    want = nl.attention_reference(q, k, v, allowed, d**-0.5)
    got = nl.attention(LIB, qkv, hq, k, v, allowed, d**-0.5).view(b, t, -1)
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)
    # keys and values read in place from a cache's room (heads 60 slots apart): the same bits
    room_k, room_v = torch.zeros(b, hkv, 60, d).bfloat16(), torch.zeros(b, hkv, 60, d).bfloat16()
    room_k[:, :, :n_keys], room_v[:, :, :n_keys] = k, v
    view_k, view_v = room_k[:, :, :n_keys], room_v[:, :, :n_keys]
    assert nl.kv_rows(view_k)[0] is view_k and nl.kv_rows(view_k)[1] == 60
    in_room = nl.attention(LIB, qkv, hq, view_k, view_v, allowed, d**-0.5).view(b, t, -1)
    assert torch.equal(in_room, got)
