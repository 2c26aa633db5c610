"""The GGUF block kernels (cpu/csrc/gguf_kernels.c) against gguf's own reference code.

Random blocks of every type with a kernel (Q4_K, Q6_K, Q8_0) are dequantised by the
`gguf` package (the code llama.cpp's converter ships); the kernels' matmul must equal
the float64 product of those weights with the int8-quantised activations (up to float32
rounding), the builds (amx, avx512-vnni, avx-vnni, avx2, portable) and the row, panel
and tile paths must agree bit for bit, and a row's output must not depend on how many
rows come with it (what makes verification exact in bf16)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from slimspec.cpu import gguf_kernels as gk

pytestmark = pytest.mark.skipif(gk.load() is None, reason="no C compiler here")
TYPES = (gk.Q4_K, gk.Q6_K, gk.Q8_0)


def random_blocks(ggml_type: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks: random bytes, with small positive fp16 scales."""
    rng = np.random.default_rng(seed)
    nb, bb = k // gk.BLOCK_VALUES[ggml_type], gk.BLOCK_BYTES[ggml_type]
    raw = rng.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)

    def halves(count: int) -> np.ndarray:
        values = np.abs(rng.standard_normal((n, nb, count))) * 0.01
        return values.astype(np.float16).view(np.uint8).reshape(n, nb, 2 * count)

    if ggml_type == gk.Q4_K:
        raw[:, :, 0:4] = halves(2)  # d, dmin
    elif ggml_type == gk.Q6_K:
        raw[:, :, 208:210] = halves(1)  # d (last)
    else:
        raw[:, :, 0:2] = halves(1)
        body = raw[:, :, 2:]
        body[body == 128] = 129  # ggml's Q8_0 values are within [-127, 127]
    return raw.reshape(n, nb * bb)


def dequantized(blocks: np.ndarray, ggml_type: int, k: int) -> np.ndarray:
    out = quants.dequantize(blocks, GGMLQuantizationType(ggml_type))
    return out.astype(np.float64).reshape(blocks.shape[0], k)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 512), (5, 33, 1536), (37, 17, 768)])
def test_matmul_equals_the_dequantised_product(ggml_type, m, n, k):
    blocks = random_blocks(ggml_type, n, k)
    w = dequantized(blocks, ggml_type, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    block = gk.ACTIVATION_BLOCK[ggml_type]
    q, dx, _ = gk.quantize_rows(x, block)
    x_hat = (q.double().reshape(m, k // block, block) * dx.double()[..., None]).reshape(m, k)
    want = x_hat.numpy() @ w.T
    got = gk.matmul(ggml_type, torch.from_numpy(blocks), k, x).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and the int8 activations are close to the float ones (the kernel's only rounding)
    exact = x.double().numpy() @ w.T
    assert np.abs(got - exact).max() <= 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("ggml_type", TYPES)
def test_simd_and_portable_paths_agree_bit_for_bit(ggml_type):
    if gk.path() in ("portable", "unavailable"):
        pytest.skip(f"this CPU runs the {gk.path()} path only")
    blocks = torch.from_numpy(random_blocks(ggml_type, 40, 1024, seed=3))
    # 1-4 rows, 5-7 (the offsets in row lanes; below the tiles), 9, 13 and 15 (a group
    # of 8 and a rest of 1, 5 and 7)
    for m in (1, 3, 5, 7, 9, 13, 15):
        x = torch.randn(m, 1024)
        simd = gk.matmul(ggml_type, blocks, 1024, x)
        assert torch.equal(simd, gk.matmul(ggml_type, blocks, 1024, x, scalar=True)), m


PANEL_TYPES = [gk.Q4_K, gk.Q6_K]


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("ggml_type", PANEL_TYPES)
def test_resident_panels_give_the_file_layouts_bits(ggml_type, scalar):
    """Q4_K and Q6_K repacked into resident 8-row panels (Q4_K_X8, Q6_K_X8) multiply to
    the bits of the file's layout (row path, its panels from 16 rows, tiles where built)
    at every row count, SIMD and portable, and a row's output does not depend on its
    batch mates. 48 rows give each of two threads a pair of panels (the AVX512 build's
    512-bit path from 5 activation rows, every count of its last token group) and a
    panel alone."""
    form = gk.PANEL_FORMS[ggml_type]
    blocks = torch.from_numpy(random_blocks(ggml_type, 48, 1024, seed=11))
    panels = gk.pack_panels(ggml_type, blocks, 1024)
    assert panels.shape == (48, 4 * gk.BLOCK_BYTES[form]) and panels.dtype == torch.uint8
    x = torch.randn(70, 1024, generator=torch.Generator().manual_seed(2)) * 3
    full = gk.matmul(form, panels, 1024, x, scalar=scalar)
    assert torch.equal(full, gk.matmul(ggml_type, blocks, 1024, x))
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
        got = gk.matmul(form, panels, 1024, x[:m], scalar=scalar)
        assert torch.equal(got, gk.matmul(ggml_type, blocks, 1024, x[:m])), m
        assert torch.equal(got, full[:m]), m
    with pytest.raises(ValueError, match="groups of 8"):
        gk.pack_panels(ggml_type, blocks[:12], 1024)
    with pytest.raises(ValueError, match="do not fit"):  # panels hold rows in eights
        gk.matmul(form, panels[:12], 1024, x[:2])


def test_panels_are_kept_by_the_avx2_family_builds_unless_switched_off(monkeypatch):
    assert gk.panels_wanted() == (gk.path() in ("avx2", "avx-vnni", "avx512-vnni"))
    monkeypatch.setenv(gk.PANELS_ENV, "0")
    assert not gk.panels_wanted()
    for ggml_type in PANEL_TYPES:
        blocks = torch.from_numpy(random_blocks(ggml_type, 8, 256, seed=13))
        layer = gk.GGUFLinear(ggml_type, blocks, 256, None, torch.float32)
        assert layer.ggml_type == ggml_type


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", PANEL_TYPES)
def test_a_layer_in_panels_computes_what_it_computes_from_the_files_layout(ggml_type, dtype):
    n = 40  # a pair of panels for each of two threads (the 512-bit path) and one alone
    blocks = torch.from_numpy(random_blocks(ggml_type, n, 512, seed=12))
    bias = torch.randn(n)
    kept = gk.GGUFLinear(ggml_type, blocks, 512, bias, dtype, panels=True)
    plain = gk.GGUFLinear(ggml_type, blocks, 512, bias, dtype, panels=False)
    assert kept.ggml_type == gk.PANEL_FORMS[ggml_type] and plain.ggml_type == ggml_type
    # Q4_K: 32 bytes more per 8 x 256 values; Q6_K: the file's size
    assert kept.nbytes() - plain.nbytes() == (n * 2 * 4 if ggml_type == gk.Q4_K else 0)
    odd = gk.GGUFLinear(ggml_type, blocks[:17], 512, None, dtype, panels=True)
    assert odd.ggml_type == ggml_type  # rows not in eights keep the file's layout
    for m in (1, 4, 19):
        x = (torch.randn(m, 512) * 4).to(dtype)
        assert torch.equal(kept(x), plain(x)), m


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_rows_output_does_not_depend_on_its_batch_mates(ggml_type):
    blocks = torch.from_numpy(random_blocks(ggml_type, 48, 512, seed=5))
    x = torch.randn(70, 512)  # more than one cache chunk of rows, partial row groups
    full = gk.matmul(ggml_type, blocks, 512, x)
    for lo, hi in [(0, 1), (3, 4), (5, 9), (31, 37), (66, 70)]:
        assert torch.equal(gk.matmul(ggml_type, blocks, 512, x[lo:hi]), full[lo:hi])


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantised_rows_are_ggmls_values(ggml_type):
    blocks = random_blocks(ggml_type, 20, 512, seed=7)
    ids = torch.tensor([[0, 19], [7, 7]])
    got = gk.dequantize_rows(ggml_type, torch.from_numpy(blocks), 512, ids)
    want = dequantized(blocks, ggml_type, 512).astype(np.float32)[ids.numpy()]
    assert got.shape == (2, 2, 512) and np.array_equal(got.numpy(), want)
    with pytest.raises(IndexError):
        gk.dequantize_rows(ggml_type, torch.from_numpy(blocks), 512, torch.tensor([20]))


def test_every_finite_fp16_scale_converts_exactly():
    """The fp16 block scales (F16C on the AVX2 build, a routine in portable C) become the
    float32 values numpy gives, for all 63,488 finite halves, subnormals included."""
    halves = np.arange(65536, dtype=np.uint16)
    halves = halves[np.isfinite(halves.view(np.float16))]
    raw = np.zeros((halves.size, 34), dtype=np.uint8)
    raw[:, 0:2] = halves.view(np.uint8).reshape(-1, 2)
    raw[:, 2] = 1  # value = d * 1
    got = gk.dequantize_rows(gk.Q8_0, torch.from_numpy(raw), 32, torch.arange(halves.size))
    want = halves.view(np.float16).astype(np.float32)
    assert np.array_equal(got[:, 0].numpy().view(np.uint32), want.view(np.uint32))


def reference_quantized(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_rows_q8 in numpy float32: dx = amax/127, q = rint(x * (127/amax))."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int8).reshape(m, k)
    bsum = q.reshape(m, k // 16, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q, (amax / np.float32(127)).astype(np.float32), bsum


@pytest.mark.parametrize("block", [32, 256])
def test_activation_quantisation_is_the_reference_bit_for_bit(block):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1024, generator=g) * torch.logspace(-3, 2, 1024)
    x[1, :256] = 0.0  # an all-zero block
    x[2, 7] = 2.5 * float(x[2, :block].abs().max())  # a block's amax at an odd place
    q, dx, bsum = gk.quantize_rows(x, block)
    want = reference_quantized(x.numpy(), block)
    assert np.array_equal(q.numpy(), want[0])
    assert np.array_equal(dx.numpy().view(np.uint32), want[1].view(np.uint32))
    assert np.array_equal(bsum.numpy(), want[2])


def test_q8_0_blocks_are_byte_for_byte_ggmls():
    w = torch.randn(24, 320) * 0.05
    w[3, :32] = 0.0  # an all-zero block: scale 0, values 0
    ours = gk.q8_0_blocks(w).numpy()
    theirs = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours, theirs)


def test_shapes_that_do_not_fit_are_refused():
    blocks = torch.from_numpy(random_blocks(gk.Q4_K, 4, 512))
    with pytest.raises(ValueError):
        gk.matmul(gk.Q4_K, blocks, 256, torch.randn(2, 256))  # row bytes of K=512
    with pytest.raises(ValueError):
        gk.quantize_rows(torch.randn(2, 100), 32)
    with pytest.raises(ValueError):
        gk.GGUFLinear(gk.Q4_K, blocks, 500, None, torch.float32)
    assert not gk.supported(2, 512)  # Q4_0: no kernel (auto serves such files dense)


def reference_attention(q, k, v, allowed):
    """Plain float64 softmax attention with grouped KV heads."""
    _, _, hq, d = q.shape
    group = hq // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)  # (B, Hq, L, d)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bthd,bhld->bhtl", q.double(), kk) * d**-0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhtl,bhld->bthd", scores.softmax(-1), vv)


def test_row_attention_matches_softmax_attention_and_is_row_independent():
    g = torch.Generator().manual_seed(0)
    b, t, hq, hkv, n_keys, d = 2, 5, 8, 2, 23, 64
    q = torch.randn(b, t, hq, d, generator=g)
    k = torch.randn(b, hkv, n_keys, d, generator=g)
    v = torch.randn(b, hkv, n_keys, d, generator=g)
    causal = torch.ones(t, n_keys, dtype=torch.bool).tril(n_keys - t).expand(b, t, n_keys).clone()
    causal[1, :, :4] = False  # holes in one row's cache (a batch's padding)
    got = gk.attention_rows(q, k, v, causal, d**-0.5)
    assert torch.allclose(got.double(), reference_attention(q, k, v, causal), atol=1e-5)
    # NULL mask = causal with the queries at the end
    plain = torch.ones(t, n_keys, dtype=torch.bool).tril(n_keys - t).expand(b, t, n_keys)
    assert torch.equal(
        gk.attention_rows(q, k, v, None, d**-0.5), gk.attention_rows(q, k, v, plain, d**-0.5)
    )
    # one query row alone gives the same bits as inside the block of five
    for row in range(t):
        alone = gk.attention_rows(q[:, row : row + 1], k, v, causal[:, row : row + 1], d**-0.5)
        assert torch.equal(alone, got[:, row : row + 1])


def test_row_attention_reads_bf16_and_strided_inputs_as_their_float_values():
    """bf16 q/k/v read as they are (q transposed as HF hands it over, d=128 and d=72 with
    a tail) and the output rounded to bf16 in C: the bits of the float32 computation
    on the same values, then torch's cast."""
    g = torch.Generator().manual_seed(4)
    for d in (128, 72):
        b, t, hq, hkv, n_keys = 2, 3, 6, 2, 17
        q = torch.randn(b, hq, t, d, generator=g).bfloat16().transpose(1, 2)  # (B, T, Hq, d)
        k = torch.randn(b, hkv, n_keys, d, generator=g).bfloat16()
        v = torch.randn(b, hkv, n_keys, d, generator=g).bfloat16()
        allowed = torch.rand(b, t, n_keys, generator=g) < 0.8
        want = gk.attention_rows(q.float().contiguous(), k.float(), v.float(), allowed, d**-0.5)
        got = gk.attention_rows(q, k, v, allowed, d**-0.5, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
        assert torch.equal(
            gk.attention_rows(q, k, v, None, 0.1),
            gk.attention_rows(q.float(), k.float(), v.float(), None, 0.1),
        )


def linear_layers(k: int, dtype: torch.dtype) -> list[gk.GGUFLinear]:
    """q/k/v-like layers: a wide Q4_K with a bias, a narrow Q6_K with one, a Q4_K without,
    and a Q6_K in resident panels where the build keeps them (rows in eights)."""
    g = torch.Generator().manual_seed(9)
    out = []
    for i, (t, n, bias) in enumerate(
        [(gk.Q4_K, 40, True), (gk.Q6_K, 9, True), (gk.Q4_K, 17, False), (gk.Q6_K, 16, False)]
    ):
        blocks = torch.from_numpy(random_blocks(t, n, k, seed=10 + i))
        b = torch.randn(n, generator=g) if bias else None
        out.append(gk.GGUFLinear(t, blocks, k, b, dtype))
    return out


def one_at_a_time(layer: gk.GGUFLinear, x: torch.Tensor, scalar: bool = False) -> torch.Tensor:
    """What GGUFLinear computed before the fused call: float matmul, bias add, cast."""
    rows = x.reshape(-1, layer.in_features)
    y = gk.matmul(layer.ggml_type, layer.blocks, layer.in_features, rows.float(), scalar=scalar)
    if layer.bias is not None:
        y += layer.bias
    return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 9, 37])
def test_one_call_for_several_layers_gives_each_layers_bits(dtype, m):
    k = 512
    layers = linear_layers(k, dtype)
    x = (torch.randn(1, m, k, generator=torch.Generator().manual_seed(m)) * 3).to(dtype)
    got = gk.linear_rows(x, layers)
    for layer, y in zip(layers, got, strict=True):
        want = one_at_a_time(layer, x)
        assert y.dtype == dtype and y.shape == want.shape and torch.equal(y, want)
        assert torch.equal(layer(x), want)
    portable = gk.linear_rows(x, layers, scalar=True)
    assert all(torch.equal(a, b) for a, b in zip(got, portable, strict=True))
    # rows with a stride (a slice of a wider tensor) are read where they are
    wide = torch.randn(m, 2 * k).to(dtype)
    assert torch.equal(layers[0](wide[:, k:]), one_at_a_time(layers[0], wide[:, k:].contiguous()))


def test_a_group_computes_its_members_together_and_never_hands_out_a_stale_output():
    layers = linear_layers(256, torch.bfloat16)
    group = gk.LinearGroup(layers)
    assert all(layer.group is not None and layer.group[0] is group for layer in layers)
    x = torch.randn(3, 256).bfloat16()
    outs = [layer(x) for layer in layers]
    assert all(torch.equal(y, one_at_a_time(m, x)) for m, y in zip(layers, outs, strict=True))
    # another tensor, or the same one written in place in between: computed afresh
    layers[0](x)
    x2 = torch.randn(3, 256).bfloat16()
    assert torch.equal(layers[1](x2), one_at_a_time(layers[1], x2))
    layers[0](x)
    x.mul_(2)
    assert torch.equal(layers[1](x), one_at_a_time(layers[1], x))
    x3 = torch.randn(2, 256).bfloat16()
    for layer in layers:  # once every member took its output, the group holds nothing
        layer(x3)
    assert group._pending.entry is None
    # a member called twice on the same input gets its output both times
    assert torch.equal(layers[2](x), layers[2](x))
    with torch.inference_mode():
        xi = torch.randn(2, 256).bfloat16()
        assert all(torch.equal(m(xi), one_at_a_time(m, xi)) for m in [layers[1], *layers])


def glue_weights(seed: int = 3) -> dict:
    """A small bf16 decoder layer's parts for gguf_kernels.layer_pre / layer_post:
    width 512, 2 query heads and 1 KV head of 76 values (RoPE with a tail past the
    last 8 values), attention output 256 wide, an MLP of 256 (Q4_K and Q6_K blocks)."""
    g = torch.Generator().manual_seed(seed)

    def layer(t: int, n: int, k: int, bias: bool, s: int) -> gk.GGUFLinear:
        blocks = torch.from_numpy(random_blocks(t, n, k, seed=s))
        return gk.GGUFLinear(
            t, blocks, k, torch.randn(n, generator=g) if bias else None, torch.bfloat16
        )

    qkv = [
        layer(gk.Q4_K, 152, 512, True, 20),
        layer(gk.Q6_K, 76, 512, True, 21),
        layer(gk.Q4_K, 76, 512, False, 22),
    ]
    return {
        "qkv": gk.LinearGroup(qkv),
        "o": layer(gk.Q4_K, 512, 256, False, 23),
        "gate_up": gk.LinearGroup(
            [layer(gk.Q4_K, 256, 512, False, 24), layer(gk.Q4_K, 256, 512, False, 25)]
        ),
        "down": layer(gk.Q6_K, 512, 256, False, 26),
        "norms": [(1 + 0.1 * torch.randn(512, generator=g)).bfloat16() for _ in range(2)],
    }


def glue_inputs(m: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(m, 512, generator=g) * 2).bfloat16()
    angles = torch.rand(m, 38, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16()
    sin = torch.cat([angles.sin(), angles.sin()], -1).bfloat16()
    attn = torch.randn(m, 256, generator=g).bfloat16()
    return h, cos, sin, attn


def glued_layer(w: dict, h, cos, sin, attn) -> list[torch.Tensor]:
    q, k, v = gk.layer_pre(h, w["norms"][0], 1e-6, w["qkv"], cos, sin)
    out = gk.layer_post(h, attn, w["o"], w["norms"][1], 1e-6, w["gate_up"], w["down"])
    return [q, k, v, out]


def torch_layer(w: dict, h, cos, sin, attn) -> list[torch.Tensor]:
    """The same steps as torch's bf16 tensor operations (transformers' modules)."""

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()

    def rope(x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], -1, 76)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return (x * c + torch.cat([-x[..., 38:], x[..., :38]], -1) * s).flatten(1)

    q, k, v = (one_at_a_time(m, norm(h, w["norms"][0])) for m in w["qkv"].members)
    mid = h + one_at_a_time(w["o"], attn)
    gate, up = (one_at_a_time(m, norm(mid, w["norms"][1])) for m in w["gate_up"].members)
    out = mid + one_at_a_time(w["down"], torch.nn.functional.silu(gate) * up)
    return [rope(q), rope(k), v, out]


def test_the_layer_glue_is_torchs_bf16_layer_row_by_row():
    """layer_pre / layer_post (the served target's norms, RoPE, residuals and SiLU MLP
    around its projections) give torch's bf16 layer up to the norms' sum order and
    SiLU's exp, and each row's values do not depend on the rows beside it."""
    w = glue_weights()
    h, cos, sin, attn = glue_inputs(7)
    got = glued_layer(w, h, cos, sin, attn)
    for a, b in zip(got, torch_layer(w, h, cos, sin, attn), strict=True):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        assert (a.float() - b.float()).abs().max() <= 0.03 * b.float().abs().max()
    for rows in (slice(0, 1), slice(2, 5), slice(6, 7)):
        alone = glued_layer(w, h[rows], cos[rows], sin[rows], attn[rows])
        assert all(torch.equal(a, b[rows]) for a, b in zip(alone, got, strict=True))
    with pytest.raises(ValueError):  # heads that do not divide the projection
        gk.layer_pre(h, w["norms"][0], 1e-6, w["qkv"], cos[:, :50], sin[:, :50])


def test_each_cpu_gets_the_widest_gguf_build_it_can_run():
    vnni = "flags\t\t: sse4_2 avx avx2 f16c fma avx512f avx512bw avx512vl avx512_vnni\n"
    zen2 = "flags\t\t: sse4_2 avx avx2 f16c fma\n"  # AMD Zen 1-3, Intel before Cascade Lake
    alder_lake = "flags\t\t: sse4_2 avx avx2 f16c fma avx_vnni\n"  # no AVX512
    assert gk.cflags(vnni) == gk.VNNI_CFLAGS
    sapphire_rapids = vnni.replace("\n", " avx_vnni amx_bf16 amx_tile amx_int8\n")
    assert gk.cflags(sapphire_rapids) == gk.AMX_CFLAGS
    assert gk.cflags(sapphire_rapids.replace(" amx_int8", "")) == gk.VNNI_CFLAGS
    assert gk.cflags(vnni.replace("\n", " avx_vnni\n")) == gk.VNNI_CFLAGS
    assert gk.cflags(alder_lake) == gk.AVX_VNNI_CFLAGS
    assert gk.cflags(vnni.replace(" avx512_vnni", "")) == gk.AVX2_CFLAGS
    assert gk.cflags(zen2) == gk.AVX2_CFLAGS
    assert gk.cflags("flags\t\t: sse4_2 avx\n") == gk.BASE_CFLAGS
    assert gk.cflags("") == gk.BASE_CFLAGS  # unknown CPU: the portable C


@pytest.mark.parametrize("build", ["portable", "avx2", "avx-vnni", "avx512-vnni"])
def test_every_narrower_build_gives_the_loaded_builds_bits(tmp_path, build):
    """The portable C (software fp16 conversion, scalar quantisation and kernels) and the
    narrower SIMD builds this CPU runs, each built beside the loaded library:
    quantisation, matmuls, fused layers, attention and the layer glue agree bit for bit, so a model
    served on one CPU gives the logits it gives on another."""
    from slimspec.cpu import clib

    names = [b[0] for b in gk.BUILDS]  # widest first
    _name, flags, needs, simd = gk.BUILDS[names.index(build)]
    wider = gk.path() in names and names.index(gk.path()) < names.index(build)
    runs_here = all(f in clib.cpu_flags() for f in needs)
    if not wider or not runs_here or clib.compiler() is None:
        pytest.skip(f"needs a compiler and a build wider than {build} loaded ({gk.path()})")
    path = tmp_path / f"{build}.so"
    clib.build(clib.compiler(), gk.SOURCE, flags, path)
    narrower = gk._bind(ctypes.CDLL(str(path)))
    assert narrower.simd_path() == simd
    halves = np.arange(65536, dtype=np.uint16)
    halves = halves[np.isfinite(halves.view(np.float16))]
    raw = np.zeros((halves.size, 34), dtype=np.uint8)
    raw[:, 0:2] = halves.view(np.uint8).reshape(-1, 2)
    raw[:, 2] = 1
    ids = np.arange(halves.size, dtype=np.int64)
    out = np.empty((halves.size, 32), dtype=np.float32)
    assert (
        narrower.gguf_dequant_rows(
            gk.Q8_0, raw.ctypes.data, 32, 34, ids.ctypes.data, halves.size, out.ctypes.data
        )
        == 0
    )
    want = halves.view(np.float16).astype(np.float32)
    assert np.array_equal(out[:, 0].view(np.uint32), want.view(np.uint32))
    layers = linear_layers(512, torch.bfloat16)
    x = (torch.randn(6, 512) * 5).bfloat16()
    x_many = (torch.randn(21, 512) * 5).bfloat16()  # Q4_K and Q6_K panels (from 16 rows)
    x_eight = (torch.randn(8, 512) * 5).bfloat16()  # AMX: Q4_K on tiles, Q6_K on rows
    x_wide = (torch.randn(40, 512) * 5).bfloat16()  # AMX: Q6_K's scale digits (from 32)
    q = torch.randn(1, 2, 4, 72).bfloat16()
    k, v = torch.randn(1, 2, 9, 72).bfloat16(), torch.randn(1, 2, 9, 72).bfloat16()
    # float32 out (no rounding to hide a last-bit difference): 6 query heads per KV head,
    # a head size with a tail past the last multiple of 8, and a row that sees no key
    qf = torch.randn(1, 3, 12, 76)
    kf, vf = torch.randn(1, 2, 11, 76), torch.randn(1, 2, 11, 76)
    allowed = torch.rand(1, 3, 11) > 0.3
    allowed[0, 0] = False
    glue = glue_weights()

    def results() -> list[torch.Tensor]:
        return [
            *gk.linear_rows(x, layers),
            *gk.linear_rows(x_many, layers),
            *gk.linear_rows(x_eight, layers),
            *gk.linear_rows(x_wide, layers),
            *gk.quantize_rows(x.float(), 32),
            *gk.quantize_rows(x.float(), 256),
            gk.attention_rows(q, k, v, None, 0.2, out_dtype=torch.bfloat16),
            gk.attention_rows(qf, kf, vf, allowed, 0.3),
            gk.attention_rows(qf, kf, vf, None, 0.3),
            *glued_layer(glue, *glue_inputs(5)),
            *glued_layer(glue, *glue_inputs(19, seed=1)),  # panels, tiles
        ]

    simd = results()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(gk._loaded, "lib", narrower)
        scalar = results()
    assert all(torch.equal(a, b) for a, b in zip(simd, scalar, strict=True))


GLUE_HARNESS = r"""
#include SOURCE
#include <stdio.h>
/* every bf16 gate value (NaN, infinities, subnormals included) through SiLU x up, the
   residual add and RMSNorm rows of several widths, folded into one hash */
int main(void) {
    enum { N = 65536 };
    static uint16_t gate[N], up[N], act[N], x[N], y[N], out[N];
    uint32_t h = 0;
    for (int u = 0; u < 4; u++) {
        for (int i = 0; i < N; i++) {
            gate[i] = (uint16_t)i;
            up[i] = (uint16_t)((i * 2654435761u >> 7) + u * 977);
            x[i] = (uint16_t)(i * 40503u + u);
        }
        silu_mul_bf16(gate, up, act, 0, N);
        add_bf16(x, up, y, 0, N);
        for (int r = 0; r < N / 1024; r++)
            rms_norm_row(x + 1024 * r, up + 1024 * r, 1000 + r % 24, 1e-6f, out + 1024 * r);
        for (int i = 0; i < N; i++) h = h * 31 + act[i] * 7 + y[i] * 13 + out[i];
    }
    printf("%08x\n", h);
    return 0;
}
"""


def test_the_glues_elementwise_steps_give_every_builds_bits(tmp_path):
    """SiLU x up, the residual add and RMSNorm (16 lanes in the AVX512 builds, 8 in AVX2,
    one at a time in the portable C) on every bf16 gate value: the same bits in every
    build this CPU runs. A layer's output alone would hide a flipped bf16 step behind
    the next projection's int8 quantisation."""
    import subprocess

    from slimspec.cpu import clib

    cc = clib.compiler()
    if cc is None:
        pytest.skip("needs a C compiler")
    src = tmp_path / "harness.c"
    src.write_text(GLUE_HARNESS.replace("SOURCE", f'"{gk.SOURCE}"'))
    hashes = {}
    for name, flags, needs, _simd in gk.BUILDS:
        if not all(f in clib.cpu_flags() for f in needs):
            continue
        exe = tmp_path / name
        subprocess.run([cc, *flags, str(src), "-o", str(exe), "-lm"], check=True, timeout=300)
        hashes[name] = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    assert "portable" in hashes and len(hashes) >= 2
    assert len(set(hashes.values())) == 1, hashes


def test_a_library_built_ahead_loads_without_a_compiler(monkeypatch, tmp_path):
    """The engine image: the build stage compiles for the source and flags, the runtime
    (no compiler, read-only) loads that library and compiles nothing."""
    from slimspec.cpu import clib

    shipped = tmp_path / "shipped"
    flags = gk.cflags()
    clib.build(clib.compiler(), gk.SOURCE, flags, shipped / clib.prebuilt_name(gk.SOURCE, flags))
    monkeypatch.setenv("SLIMSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv(clib.PREBUILT_DIR_ENV, str(shipped))
    monkeypatch.setattr(gk, "_loaded", {})
    assert clib.compiler() is None
    lib = gk.load()
    assert lib is not None and gk.self_check(lib)
    assert not (tmp_path / "cache").exists()  # nothing compiled
    monkeypatch.setattr(gk, "_loaded", {})
    monkeypatch.setenv(clib.PREBUILT_DIR_ENV, str(tmp_path / "elsewhere"))
    assert gk.load() is None  # neither a compiler nor a library of this source
