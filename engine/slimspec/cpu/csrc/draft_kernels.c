// Low-bit-weight x int8-activation matrix products for the draft, and bf16-weight
// products (AVX512-BF16) for the unquantised "bf16-fused" draft. Why they exist:
// native_kernels.py. The activation rows are quantised to int8 (one scale per group of
// 64, as llama.cpp's Q8 blocks) so that vpdpbusd multiplies 64 unsigned weights by 64
// signed activations in one instruction. One source, two builds (native_kernels.py
// picks by CPU): AVX512-VNNI, and AVX2 (+FMA, F16C) with vpmaddubsw + vpmaddwd in
// place of vpdpbusd on the same weight layout (no bf16-weight kernel there).
//
// Weights: asymmetric groups of 64 inputs, w = u * scale + low with u in 0..15 (bits
// = 4) or 0..255 (bits = 8); bits = 16: the bf16 weights themselves. Layout (built by
// native_format.py): rows come in blocks stored group by group, so a block is one
// contiguous stream. bits = 4 and 8: blocks of LOWBIT_ROWS = 16 rows (N padded with
// zero rows to a multiple of 16); a group of a block is 64-byte vectors of 16 rows x 4
// bytes, so one vpdpbusd with 4 activations broadcast advances all 16 rows (one int32
// lane each) by 4 inputs. bits = 8: 16 vectors, byte 4r + i of vector p = u[r][4p + i]
// for row r of the block; bits = 4: 8 vectors, byte 4r + i of vector p = u[r][4p + i] |
// u[r][32 + 4p + i] << 4. scale and low are [n / 16][g][n % 16] fp16 (half the bytes
// of float: with int4 a group's metadata is 4 bytes on 32 of weights instead of 8).
// bits = 16: blocks of ROWS = 4 rows (N a multiple of 4), [n / 4][g][n % 4][64 bf16].
// y[m][n] = sum_g scale * xs[m][g] * sum_j u[j] * xq[m][j] + low * xs[m][g] * sum_j xq[m][j]
// (+ bias[n]): the dequantised activations times the dequantised weights. Inputs and
// outputs are bfloat16; int32 within a group, float across.

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 64
#define MCHUNK 4            // activation rows per pass over a bf16 weight block
#define ROWS 4              // weight rows per bf16 block
#define LOWBIT_ROWS 16      // weight rows per low-bit block: one int32 lane each
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024 // software prefetch distance in the weight stream
#endif
#define QUANTIZE_TEAM_MIN_M 16  // from this many rows the threads quantise them together

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return (uint16_t)(bits >> 16);
}


enum { PROLOGUE_NONE = 0, PROLOGUE_RMSNORM = 1, PROLOGUE_SILU_GATE = 2 };

// y[m][n0 + r] = v (+ bias), or += v when accumulating (a residual add in place).
static inline void store_out(uint16_t *y, int64_t n_out, int64_t m, int64_t n, float v,
                             const uint16_t *bias, int accumulate) {
    v += bias ? bf16_to_f32(bias[n]) : 0.0f;
    uint16_t *dst = y + m * n_out + n;
    *dst = f32_to_bf16(accumulate ? bf16_to_f32(*dst) + v : v);
}

static inline __attribute__((always_inline)) void prefetch_group(const uint8_t *wg,
                                                                 int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch((const char *)(wg + PREFETCH_BYTES + line), _MM_HINT_T0);
}


#if defined(__AVX512VNNI__)
// ------------------------------------------------------------- AVX512-VNNI (+ BF16)
#define HAVE_BF16_KERNEL 1
#define LOWBIT_MCHUNK 8  // activation rows per pass over a low-bit block

// 16 bf16 values -> 16 floats.
static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 floats -> 16 bf16, rounded to nearest even (finite inputs).
static inline void store16_bf16(uint16_t *p, __m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// exp for x <= 0 (softmax after subtracting the max): 2^n * p(r), |r| <= ln2/2,
// degree-5 polynomial; relative error ~2e-7.
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.69314718f), x);
    __m512 p = _mm512_set1_ps(1.0f / 120.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// The matmul's input row m as float, after the optional prologue (k a multiple of 16):
// RMSNORM: x * rsqrt(mean(x^2) + eps) * norm_w (Llama/Qwen2 RMSNorm; x has k columns);
// SILU_GATE: silu(x[:k]) * x[k:2k] (the MLP's gate/up output; x has 2k columns).
static void input_row(const uint16_t *x, int64_t m, int64_t k, int prologue,
                      const uint16_t *norm_w, float eps, float *v) {
    if (prologue == PROLOGUE_SILU_GATE) {
        const uint16_t *gate = x + m * 2 * k, *up = gate + k;
        const __m512 one = _mm512_set1_ps(1.0f);
        for (int64_t j = 0; j < k; j += 16) {
            __m512 g = load16_bf16(gate + j);
            // sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, e = exp(-|g|) <= 1
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
            __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
            __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
            __m512 sig = _mm512_mask_mul_ps(r, neg, r, e);
            _mm512_storeu_ps(v + j, _mm512_mul_ps(_mm512_mul_ps(g, sig), load16_bf16(up + j)));
        }
        return;
    }
    const uint16_t *src = x + m * k;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        __m512 a = load16_bf16(src + j);
        ss = _mm512_fmadd_ps(a, a, ss);
        _mm512_storeu_ps(v + j, a);
    }
    if (prologue == PROLOGUE_RMSNORM) {
        __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)k + eps));
        for (int64_t j = 0; j < k; j += 16)
            _mm512_storeu_ps(v + j, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(v + j), r),
                                                  load16_bf16(norm_w + j)));
    }
}

// Per row m and group g: xq (int8), xs = max|v| / 127 and xsum = xs * sum of xq (the
// sum of the quantised activations, not of v: with asymmetric weights the low term
// would otherwise add the activations' rounding error times the group's offset).
// Rounding is to nearest even (the default MXCSR mode), as native_format.reference.
static void quantize_rows(const uint16_t *x, int64_t m_rows, int64_t k, int prologue,
                          const uint16_t *norm_w, float eps, float *v, int8_t *xq, float *xs,
                          float *xsum) {
    int64_t groups = k / GROUP;
    for (int64_t m = 0; m < m_rows; m++) {
        input_row(x, m, k, prologue, norm_w, eps, v);
        for (int64_t g = 0; g < groups; g++) {
            const float *src = v + g * GROUP;
            __m512 a[4], amax = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                a[c] = _mm512_loadu_ps(src + 16 * c);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(a[c]));
            }
            float scale = _mm512_reduce_max_ps(amax) / 127.0f;
            __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            int8_t *dst = xq + m * k + g * GROUP;
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(a[c], inv));
                isum = _mm512_add_epi32(isum, q);
                _mm_storeu_si128((__m128i *)(dst + 16 * c), _mm512_cvtsepi32_epi8(q));
            }
            xs[m * groups + g] = scale;
            xsum[m * groups + g] = scale * (float)_mm512_reduce_add_epi32(isum);
        }
    }
}

// The input rows after the prologue, rounded to bf16 (the bf16-weight path).
static void bf16_rows(const uint16_t *x, int64_t m_rows, int64_t k, int prologue,
                      const uint16_t *norm_w, float eps, float *v, uint16_t *xb) {
    for (int64_t m = 0; m < m_rows; m++) {
        input_row(x, m, k, prologue, norm_w, eps, v);
        for (int64_t j = 0; j < k; j += 16) store16_bf16(xb + m * k + j, _mm512_loadu_ps(v + j));
    }
}

// 16 results of row m (one block of outputs, the first `valid` of them real) plus the
// bias, stored as bf16, or added to what y holds (a residual add in place).
static inline void store_block16(uint16_t *y, int64_t n_out, int64_t m, int64_t n0, int valid,
                                 __m512 v, const uint16_t *bias, int accumulate) {
    __mmask16 keep = valid >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1);
    uint16_t *dst = y + m * n_out + n0;
    if (bias)
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n0)), 16)));
    if (accumulate)
        v = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, dst)), 16)),
                          v);
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_mask_storeu_epi16(dst, keep, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// Low-bit weights, 16 rows per block: per group, each activation row's 64 int8s meet
// the block in 16 vpdpbusd (4 broadcast activations each, every lane its own row)
// summed in int32, then one conversion and two multiply-adds for all 16 rows. (A layout
// with a row's inputs across the lanes spends most of its instructions on per-group
// float work and horizontal sums instead: ~2x slower at 8 activation rows.) bits = 4:
// a group is 8 vectors, the low nibbles meeting inputs 4p.., the high ones 32 + 4p..;
// bits = 8: 16 vectors, vector p meeting inputs 4p...
static inline __attribute__((always_inline)) void block_lowbit(
    const int bits, const uint8_t *wblk, const uint16_t *sblk, const uint16_t *lblk,
    int64_t n0, int valid, int64_t k, const int8_t *xq, const float *xs, const float *xsum,
    int64_t m0, const int64_t mc, const uint16_t *bias, uint16_t *y, int64_t n_out,
    int accumulate) {
    int64_t groups = k / GROUP;
    const int64_t group_bytes = LOWBIT_ROWS * GROUP * bits / 8;
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 acc[LOWBIT_MCHUNK];
    for (int i = 0; i < LOWBIT_MCHUNK; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = wblk + g * group_bytes;
        prefetch_group(wg, group_bytes);
        __m512i dot[LOWBIT_MCHUNK];
        for (int i = 0; i < LOWBIT_MCHUNK; i++) dot[i] = _mm512_setzero_si512();
        for (int p = 0; p < 2 * bits; p++) {  // 64-byte vectors per group of the block
            __m512i w = _mm512_loadu_si512((const void *)(wg + 64 * p));
            __m512i lo = bits == 4 ? _mm512_and_si512(w, nib) : w;
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
            for (int64_t i = 0; i < mc; i++) {
                const int8_t *xg = xq + (m0 + i) * k + g * GROUP + 4 * p;
                int32_t a;
                memcpy(&a, xg, 4);
                dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(a));
                if (bits == 4) {
                    memcpy(&a, xg + 32, 4);
                    dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(a));
                }
            }
        }
        __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sblk + g * LOWBIT_ROWS)));
        __m512 l16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lblk + g * LOWBIT_ROWS)));
        for (int64_t i = 0; i < mc; i++) {
            int64_t mg = (m0 + i) * groups + g;
            __m512 sx = _mm512_mul_ps(s16, _mm512_set1_ps(xs[mg]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), sx, acc[i]);
            acc[i] = _mm512_fmadd_ps(l16, _mm512_set1_ps(xsum[mg]), acc[i]);
        }
    }
    for (int64_t i = 0; i < mc; i++)
        store_block16(y, n_out, m0 + i, n0, valid, acc[i], bias, accumulate);
}

#if defined(__AMX_INT8__)
// ---------------------------------------------- AMX tiles (Intel since Sapphire Rapids)
// From DRAFT_AMX_MIN_M activation rows (prefill) a block of 16 weight rows meets 16
// activation rows per group in one tile product: the group's 16 x 64 int8 activations
// are tile A as quantize_rows left them (row stride k), the block's group is tile B as
// it is stored (bits = 8: vector p holds inputs 4p..4p+3 of the 16 rows, which is B's
// layout; bits = 4: its nibbles spread to bytes first, low ones rows 0-7, high ones
// 8-15), and tdpbsud (signed x unsigned) leaves each activation row's 16 dots in a row
// of C: the integers block_lowbit's vpdpbusd sums give, with the same float steps after,
// so the tiles change no bit. Below that many rows the spread costs more than it saves.
#include <sys/syscall.h>
#include <unistd.h>
#ifndef DRAFT_AMX_MIN_M
#define DRAFT_AMX_MIN_M 16
#endif

// Linux hands a thread the 8 KB tile state only once the process has asked for it.
static int draft_amx_state = -1;  // -1: not asked yet, 0: refused, 1: granted
static int draft_amx_usable(void) {
    int s = __atomic_load_n(&draft_amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (asking twice is harmless)
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&draft_amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

// Tiles 0 and 1: C (16 x 16 int32), 2 and 4: A, 3 and 5: B, all 16 rows x 64 bytes.
static void draft_amx_configure(void) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

// Group g's float steps for activation rows m0..m0+T-1 from its stored dots, as
// block_lowbit's.
static inline __attribute__((always_inline)) void tile_group_floats(
    const int32_t (*dots)[LOWBIT_ROWS], const uint16_t *sblk, const uint16_t *lblk, int64_t g,
    int64_t groups, const float *xs, const float *xsum, int64_t m0, int T, __m512 *acc) {
    const __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sblk + g * LOWBIT_ROWS)));
    const __m512 l16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lblk + g * LOWBIT_ROWS)));
    for (int i = 0; i < T; i++) {
        const int64_t mg = (m0 + i) * groups + g;
        const __m512 sx = _mm512_mul_ps(s16, _mm512_set1_ps(xs[mg]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[i])), sx, acc[i]);
        acc[i] = _mm512_fmadd_ps(l16, _mm512_set1_ps(xsum[mg]), acc[i]);
    }
}

// One block of 16 weight rows against all m_rows activation rows (xq readable up to a
// multiple of 16 rows). wbuf: the block's groups as tiles B, 1 KB a group (bits = 4).
static void block_lowbit_tiles(int bits, const uint8_t *wblk, const uint16_t *sblk,
                               const uint16_t *lblk, int64_t n0, int valid, int64_t k,
                               const int8_t *xq, const float *xs, const float *xsum,
                               int64_t m_rows, const uint16_t *bias, uint16_t *y, int64_t n_out,
                               int accumulate, uint8_t *wbuf) {
    const int64_t groups = k / GROUP;
    const uint8_t *wt = wblk;
    if (bits == 4) {
        const __m512i nib = _mm512_set1_epi8(0x0f);
        for (int64_t g = 0; g < groups; g++)
            for (int p = 0; p < 8; p++) {
                const __m512i w = _mm512_loadu_si512((const void *)(wblk + g * 512 + 64 * p));
                _mm512_store_si512(wbuf + g * 1024 + 64 * p, _mm512_and_si512(w, nib));
                _mm512_store_si512(wbuf + g * 1024 + 64 * (8 + p),
                                   _mm512_and_si512(_mm512_srli_epi16(w, 4), nib));
            }
        wt = wbuf;
    }
    int32_t dots[2][16][LOWBIT_ROWS] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < m_rows; m0 += 16) {
        const int T = (int)(m_rows - m0 < 16 ? m_rows - m0 : 16);
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        const int8_t *xa = xq + m0 * k;
        // two groups at a time in two accumulators: one group's float steps run while
        // the tile unit multiplies the next
        int64_t g = 0;
        for (; g + 2 <= groups; g += 2) {
            _tile_zero(0);
            _tile_loadd(2, xa + g * GROUP, k);
            _tile_loadd(3, wt + g * 1024, 64);
            _tile_dpbsud(0, 2, 3);
            _tile_zero(1);
            _tile_loadd(4, xa + (g + 1) * GROUP, k);
            _tile_loadd(5, wt + (g + 1) * 1024, 64);
            _tile_dpbsud(1, 4, 5);
            _tile_stored(0, dots[0], 64);
            tile_group_floats((const int32_t(*)[LOWBIT_ROWS])dots[0], sblk, lblk, g, groups, xs,
                              xsum, m0, T, acc);
            _tile_stored(1, dots[1], 64);
            tile_group_floats((const int32_t(*)[LOWBIT_ROWS])dots[1], sblk, lblk, g + 1, groups,
                              xs, xsum, m0, T, acc);
        }
        if (g < groups) {
            _tile_zero(0);
            _tile_loadd(2, xa + g * GROUP, k);
            _tile_loadd(3, wt + g * 1024, 64);
            _tile_dpbsud(0, 2, 3);
            _tile_stored(0, dots[0], 64);
            tile_group_floats((const int32_t(*)[LOWBIT_ROWS])dots[0], sblk, lblk, g, groups, xs,
                              xsum, m0, T, acc);
        }
        for (int i = 0; i < T; i++)
            store_block16(y, n_out, m0 + i, n0, valid, acc[i], bias, accumulate);
    }
}
#endif

// bf16 weights: vdpbf16ps multiplies 32 bf16 pairs into 16 float lanes.
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline)) void
block_bf16(const uint16_t *wblk, int64_t n0, int64_t k, const uint16_t *xb, int64_t m0,
           const int64_t mc, const uint16_t *bias, uint16_t *y, int64_t n_out, int accumulate) {
    int64_t groups = k / GROUP;
    __m512 acc[ROWS][MCHUNK];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < MCHUNK; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *wg = wblk + g * ROWS * GROUP;
        prefetch_group((const uint8_t *)wg, ROWS * GROUP * 2);
        __m512i x0[MCHUNK], x1[MCHUNK];
        for (int64_t i = 0; i < mc; i++) {
            const uint16_t *xr = xb + (m0 + i) * k + g * GROUP;
            x0[i] = _mm512_loadu_si512((const void *)xr);
            x1[i] = _mm512_loadu_si512((const void *)(xr + 32));
        }
        for (int r = 0; r < ROWS; r++) {
            __m512i w0 = _mm512_loadu_si512((const void *)(wg + r * GROUP));
            __m512i w1 = _mm512_loadu_si512((const void *)(wg + r * GROUP + 32));
            for (int64_t i = 0; i < mc; i++) {
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)w0, (__m512bh)x0[i]);
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)w1, (__m512bh)x1[i]);
            }
        }
    }
    for (int64_t i = 0; i < mc; i++)
        for (int r = 0; r < ROWS; r++)
            store_out(y, n_out, m0 + i, n0 + r, _mm512_reduce_add_ps(acc[r][i]), bias,
                      accumulate);
}

// Constant mc lets the compiler keep the accumulators in registers.
#define BY_CHUNK(CALL)                 \
    switch (mc) {                      \
        case 1: CALL(1); break;        \
        case 2: CALL(2); break;        \
        case 3: CALL(3); break;        \
        default: CALL(MCHUNK); break;  \
    }

#define BY_LOWBIT_CHUNK(CALL)                \
    switch (mc) {                      \
        case 1: CALL(1); break;        \
        case 2: CALL(2); break;        \
        case 3: CALL(3); break;        \
        case 4: CALL(4); break;        \
        case 5: CALL(5); break;        \
        case 6: CALL(6); break;        \
        case 7: CALL(7); break;        \
        default: CALL(LOWBIT_MCHUNK); break; \
    }

__attribute__((target("avx512bf16"))) static void gemm_bf16_blocks(
    const uint16_t *xb, int64_t m_rows, int64_t k, const uint16_t *w, int64_t n_out,
    const uint16_t *bias, uint16_t *y, int accumulate) {
    int64_t blocks = n_out / ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint16_t *wblk = w + blk * ROWS * k;
        for (int64_t m0 = 0; m0 < m_rows; m0 += MCHUNK) {
            int64_t mc = m_rows - m0 < MCHUNK ? m_rows - m0 : MCHUNK;
#define CALL(MC) block_bf16(wblk, blk * ROWS, k, xb, m0, MC, bias, y, n_out, accumulate)
            BY_CHUNK(CALL)
#undef CALL
        }
    }
}

// Softmax attention for a few query tokens with grouped KV heads (decode steps):
// q[(b*T + t) * q_stride + h*d + j]; k, v (B, Hkv, L, d), each head's L rows of d values
// contiguous and k_rows / v_rows rows apart (L when the tensor is contiguous; a KV cache
// with spare room behind its slots has more: decoding/kv.py); allowed (B, T, L)
// bytes (every query allows at least one key); out (B, T, Hq*d). Query head h reads KV
// head h / (Hq / Hkv), as HF's repeat_kv. Scores, softmax and sums in float32;
// d a multiple of 16. Returns 0, -1 when scratch cannot be allocated, -2 bad arguments.
int attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                   int64_t k_rows, int64_t v_rows, const uint8_t *allowed, int64_t b_rows,
                   int64_t hq, int64_t hkv, int64_t t_len, int64_t l_len, int64_t d, float scale,
                   uint16_t *out) {
    if (d % 16 || d > 256 || hkv < 1 || hq % hkv || l_len < 1 || k_rows < l_len || v_rows < l_len)
        return -2;
    int64_t group = hq / hkv, tasks = b_rows * hq;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / hq, h = task % hq, kvh = h / group;
        float *p = (float *)malloc(sizeof(float) * (size_t)(l_len + 16));
        if (!p) {
            failed = 1;
            continue;
        }
        const uint16_t *kb = k + (b * hkv + kvh) * k_rows * d;
        const uint16_t *vb = v + (b * hkv + kvh) * v_rows * d;
        for (int64_t t = 0; t < t_len; t++) {
            const uint16_t *qr = q + (b * t_len + t) * q_stride + h * d;
            const uint8_t *ok = allowed + (b * t_len + t) * l_len;
            __m512 qv[16];
            for (int64_t c = 0; c < d / 16; c++) qv[c] = load16_bf16(qr + 16 * c);
            float mx = -INFINITY;
            for (int64_t l = 0; l < l_len; l++) {
                if (!ok[l]) {
                    p[l] = -INFINITY;
                    continue;
                }
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < d / 16; c++)
                    acc = _mm512_fmadd_ps(qv[c], load16_bf16(kb + l * d + 16 * c), acc);
                p[l] = _mm512_reduce_add_ps(acc) * scale;
                mx = p[l] > mx ? p[l] : mx;
            }
            __m512 sum = _mm512_setzero_ps(), mxv = _mm512_set1_ps(mx);
            int64_t l = 0;
            for (; l + 16 <= l_len; l += 16) {
                __m512 s = _mm512_loadu_ps(p + l);
                __mmask16 keep = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                __m512 e = _mm512_maskz_mov_ps(keep, exp_nonpositive(_mm512_sub_ps(s, mxv)));
                _mm512_storeu_ps(p + l, e);
                sum = _mm512_add_ps(sum, e);
            }
            float total = _mm512_reduce_add_ps(sum);
            for (; l < l_len; l++) {
                p[l] = p[l] == -INFINITY ? 0.0f : expf(p[l] - mx);
                total += p[l];
            }
            float inv = total > 0.0f ? 1.0f / total : 0.0f;  // no allowed key: zeros
            __m512 o[16];
            for (int64_t c = 0; c < d / 16; c++) o[c] = _mm512_setzero_ps();
            for (int64_t j = 0; j < l_len; j++) {
                if (p[j] == 0.0f) continue;  // masked (or underflowed) keys
                __m512 w = _mm512_set1_ps(p[j] * inv);
                for (int64_t c = 0; c < d / 16; c++)
                    o[c] = _mm512_fmadd_ps(w, load16_bf16(vb + j * d + 16 * c), o[c]);
            }
            uint16_t *dst = out + (b * t_len + t) * hq * d + h * d;
            float tmp[16];
            for (int64_t c = 0; c < d / 16; c++) {
                _mm512_storeu_ps(tmp, o[c]);
                for (int j = 0; j < 16; j++) dst[16 * c + j] = f32_to_bf16(tmp[j]);
            }
        }
        free(p);
    }
    return failed ? -1 : 0;
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ------------------------------------------------------------------ AVX2 + FMA + F16C
// Every x86-64 CPU of the last decade (AMD Zen 1-3, Intel since Haswell). The same
// layout and the same arithmetic as the AVX512 path: vpmaddubsw multiplies the unsigned
// weights by the signed activations in pairs (int16) and vpmaddwd adds the pairs into
// int32 lanes, which is vpdpbusd split in two. int16 cannot overflow: |u * x| <= 15 *
// 127 per product, so a pair is <= 3810 and eight pairs summed before widening <= 30480
// (int8 weights are split into their two nibbles for this, the high one weighted 16).
// A 64-byte vector of a block holds rows 0-7 in its first 32 bytes and rows 8-15 in
// the others: each half-block is one pass with eight int32 lanes. The per-group float
// update is the AVX512 path's, lane for lane, so both paths give the same products.

#define LOWBIT_MCHUNK 4  // activation rows per pass: 16 ymm registers hold 4 rows' sums

static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 floats -> 8 bf16, rounded to nearest even (finite inputs).
static inline __m128i to8_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(bits, 16), _mm256_setzero_si256());
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));  // lanes 0, 2
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

static inline __m256 abs8(__m256 v) {
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
}

// exp for x <= 0, as the AVX512 path's (2^n built in the exponent bits: n >= -126).
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.69314718f), x);
    __m256 p = _mm256_set1_ps(1.0f / 120.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The matmul's input row m as float after the optional prologue (see the AVX512 path).
static void input_row(const uint16_t *x, int64_t m, int64_t k, int prologue,
                      const uint16_t *norm_w, float eps, float *v) {
    const __m256 zero = _mm256_setzero_ps();
    if (prologue == PROLOGUE_SILU_GATE) {
        const uint16_t *gate = x + m * 2 * k, *up = gate + k;
        const __m256 one = _mm256_set1_ps(1.0f);
        for (int64_t j = 0; j < k; j += 8) {
            __m256 g = load8_bf16(gate + j);
            __m256 e = exp_nonpositive(_mm256_sub_ps(zero, abs8(g)));
            __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
            __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(r, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
            _mm256_storeu_ps(v + j, _mm256_mul_ps(_mm256_mul_ps(g, sig), load8_bf16(up + j)));
        }
        return;
    }
    const uint16_t *src = x + m * k;
    __m256 ss = zero;
    for (int64_t j = 0; j < k; j += 8) {
        __m256 a = load8_bf16(src + j);
        ss = _mm256_fmadd_ps(a, a, ss);
        _mm256_storeu_ps(v + j, a);
    }
    if (prologue == PROLOGUE_RMSNORM) {
        __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)k + eps));
        for (int64_t j = 0; j < k; j += 8)
            _mm256_storeu_ps(v + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(v + j), r),
                                                  load8_bf16(norm_w + j)));
    }
}

// As the AVX512 path's quantize_rows: the same int8 values, scales and sums.
static void quantize_rows(const uint16_t *x, int64_t m_rows, int64_t k, int prologue,
                          const uint16_t *norm_w, float eps, float *v, int8_t *xq, float *xs,
                          float *xsum) {
    int64_t groups = k / GROUP;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lanes
    for (int64_t m = 0; m < m_rows; m++) {
        input_row(x, m, k, prologue, norm_w, eps, v);
        for (int64_t g = 0; g < groups; g++) {
            const float *src = v + g * GROUP;
            __m256 a[8], amax = _mm256_setzero_ps();
            for (int c = 0; c < 8; c++) {
                a[c] = _mm256_loadu_ps(src + 8 * c);
                amax = _mm256_max_ps(amax, abs8(a[c]));
            }
            float scale = hmax8(amax) / 127.0f;
            __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
            __m256i q[8], isum = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(a[c], inv));
                isum = _mm256_add_epi32(isum, q[c]);
            }
            int8_t *dst = xq + m * k + g * GROUP;
            for (int c = 0; c < 8; c += 4) {  // saturating packs, as vpmovsdb
                __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[c], q[c + 1]),
                                               _mm256_packs_epi32(q[c + 2], q[c + 3]));
                _mm256_storeu_si256((__m256i *)(dst + 8 * c), _mm256_permutevar8x32_epi32(b, order));
            }
            xs[m * groups + g] = scale;
            xsum[m * groups + g] = scale * (float)hsum8_epi32(isum);
        }
    }
}

// 8 results of row m (the first `valid` of them real) plus the bias, stored as bf16 or
// added to what y holds; the same rounding as store_out.
static inline void store_block8(uint16_t *y, int64_t n_out, int64_t m, int64_t n0, int valid,
                                __m256 v, const uint16_t *bias, int accumulate) {
    uint16_t *dst = y + m * n_out + n0;
    if (valid >= 8) {
        if (bias) v = _mm256_add_ps(v, load8_bf16(bias + n0));
        if (accumulate) v = _mm256_add_ps(load8_bf16(dst), v);
        _mm_storeu_si128((__m128i *)dst, to8_bf16(v));
        return;
    }
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int r = 0; r < valid; r++) store_out(y, n_out, m, n0 + r, t[r], bias, accumulate);
}

// Low-bit weights, 16 rows per block as two passes of 8 (see the section comment).
static inline __attribute__((always_inline)) void block_lowbit(
    const int bits, const uint8_t *wblk, const uint16_t *sblk, const uint16_t *lblk,
    int64_t n0, int valid, int64_t k, const int8_t *xq, const float *xs, const float *xsum,
    int64_t m0, const int64_t mc, const uint16_t *bias, uint16_t *y, int64_t n_out,
    int accumulate) {
    const int64_t groups = k / GROUP;
    const int64_t group_bytes = LOWBIT_ROWS * GROUP * bits / 8;
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i sixteen = _mm256_set1_epi16(16);
    for (int h = 0; h < 2 && 8 * h < valid; h++) {
        __m256 acc[LOWBIT_MCHUNK];
        for (int i = 0; i < LOWBIT_MCHUNK; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = wblk + g * group_bytes;
            if (h == 0) prefetch_group(wg, group_bytes);
            wg += 32 * h;
            const int8_t *xg = xq + g * GROUP;
            __m256i dot[LOWBIT_MCHUNK];
            for (int i = 0; i < LOWBIT_MCHUNK; i++) dot[i] = _mm256_setzero_si256();
            // int16 sums over 4 vectors (bits 4: 8 pairs) or 8 (bits 8: 8 pairs a nibble)
            const int span = bits == 4 ? 4 : 8;
            for (int p0 = 0; p0 < 2 * bits; p0 += span) {
                __m256i lo16[LOWBIT_MCHUNK], hi16[LOWBIT_MCHUNK];
                for (int i = 0; i < LOWBIT_MCHUNK; i++) lo16[i] = hi16[i] = _mm256_setzero_si256();
                for (int p = p0; p < p0 + span; p++) {
                    __m256i w = _mm256_loadu_si256((const __m256i *)(wg + 64 * p));
                    __m256i lo = _mm256_and_si256(w, nib);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
                    for (int64_t i = 0; i < mc; i++) {
                        const int8_t *xr = xg + (m0 + i) * k + 4 * p;
                        int32_t a;
                        memcpy(&a, xr, 4);
                        __m256i av = _mm256_set1_epi32(a);
                        if (bits == 4) {  // high nibbles meet inputs 32 + 4p..
                            int32_t b;
                            memcpy(&b, xr + 32, 4);
                            lo16[i] = _mm256_add_epi16(
                                lo16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo, av),
                                                          _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b))));
                        } else {  // u = lo + 16 * hi, both meeting inputs 4p..
                            lo16[i] = _mm256_add_epi16(lo16[i], _mm256_maddubs_epi16(lo, av));
                            hi16[i] = _mm256_add_epi16(hi16[i], _mm256_maddubs_epi16(hi, av));
                        }
                    }
                }
                for (int64_t i = 0; i < mc; i++) {
                    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(lo16[i], ones));
                    if (bits == 8)
                        dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(hi16[i], sixteen));
                }
            }
            __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sblk + g * LOWBIT_ROWS + 8 * h)));
            __m256 l8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(lblk + g * LOWBIT_ROWS + 8 * h)));
            for (int64_t i = 0; i < mc; i++) {
                int64_t mg = (m0 + i) * groups + g;
                __m256 sx = _mm256_mul_ps(s8, _mm256_set1_ps(xs[mg]));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), sx, acc[i]);
                acc[i] = _mm256_fmadd_ps(l8, _mm256_set1_ps(xsum[mg]), acc[i]);
            }
        }
        for (int64_t i = 0; i < mc; i++)
            store_block8(y, n_out, m0 + i, n0 + 8 * h, valid - 8 * h, acc[i], bias, accumulate);
    }
}

#define BY_LOWBIT_CHUNK(CALL)          \
    switch (mc) {                      \
        case 1: CALL(1); break;        \
        case 2: CALL(2); break;        \
        case 3: CALL(3); break;        \
        default: CALL(LOWBIT_MCHUNK); break; \
    }

// Softmax attention for a few query tokens (see the AVX512 path for the arguments).
int attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                   int64_t k_rows, int64_t v_rows, const uint8_t *allowed, int64_t b_rows,
                   int64_t hq, int64_t hkv, int64_t t_len, int64_t l_len, int64_t d, float scale,
                   uint16_t *out) {
    if (d % 16 || d > 256 || hkv < 1 || hq % hkv || l_len < 1 || k_rows < l_len || v_rows < l_len)
        return -2;
    int64_t group = hq / hkv, tasks = b_rows * hq, chunks = d / 8;
    int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t b = task / hq, h = task % hq, kvh = h / group;
        float *p = (float *)malloc(sizeof(float) * (size_t)(l_len + 8));
        if (!p) {
            failed = 1;
            continue;
        }
        const uint16_t *kb = k + (b * hkv + kvh) * k_rows * d;
        const uint16_t *vb = v + (b * hkv + kvh) * v_rows * d;
        for (int64_t t = 0; t < t_len; t++) {
            const uint16_t *qr = q + (b * t_len + t) * q_stride + h * d;
            const uint8_t *ok = allowed + (b * t_len + t) * l_len;
            __m256 qv[32];
            for (int64_t c = 0; c < chunks; c++) qv[c] = load8_bf16(qr + 8 * c);
            float mx = -INFINITY;
            for (int64_t l = 0; l < l_len; l++) {
                if (!ok[l]) {
                    p[l] = -INFINITY;
                    continue;
                }
                __m256 acc = _mm256_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    acc = _mm256_fmadd_ps(qv[c], load8_bf16(kb + l * d + 8 * c), acc);
                p[l] = hsum8(acc) * scale;
                mx = p[l] > mx ? p[l] : mx;
            }
            __m256 sum = _mm256_setzero_ps(), mxv = _mm256_set1_ps(mx);
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            int64_t l = 0;
            for (; l + 8 <= l_len; l += 8) {
                __m256 s = _mm256_loadu_ps(p + l);
                __m256 keep = _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ);
                __m256 e = _mm256_and_ps(keep, exp_nonpositive(_mm256_sub_ps(s, mxv)));
                _mm256_storeu_ps(p + l, e);
                sum = _mm256_add_ps(sum, e);
            }
            float total = hsum8(sum);
            for (; l < l_len; l++) {
                p[l] = p[l] == -INFINITY ? 0.0f : expf(p[l] - mx);
                total += p[l];
            }
            float inv = total > 0.0f ? 1.0f / total : 0.0f;  // no allowed key: zeros
            __m256 o[32];
            for (int64_t c = 0; c < chunks; c++) o[c] = _mm256_setzero_ps();
            for (int64_t j = 0; j < l_len; j++) {
                if (p[j] == 0.0f) continue;  // masked (or underflowed) keys
                __m256 w = _mm256_set1_ps(p[j] * inv);
                for (int64_t c = 0; c < chunks; c++)
                    o[c] = _mm256_fmadd_ps(w, load8_bf16(vb + j * d + 8 * c), o[c]);
            }
            uint16_t *dst = out + (b * t_len + t) * hq * d + h * d;
            for (int64_t c = 0; c < chunks; c++) _mm_storeu_si128((__m128i *)(dst + 8 * c), to8_bf16(o[c]));
        }
        free(p);
    }
    return failed ? -1 : 0;
}

#else
#error "build with -mavx512vnni (and its AVX512 flags) or with -mavx2 -mfma -mf16c"
#endif  // AVX512-VNNI or AVX2

// y (m_rows, n_out) = prologue(x) (m_rows, k) @ W.T (+ bias), or y += that when
// accumulate (a residual add in place); k a multiple of 64, n_out of 4 (the first
// n_out rows of the packed weights), bits 4, 8 or 16 (16 only where the CPU has
// AVX512-BF16: native_kernels.py checks).
// Returns 0, -1 when the scratch buffers cannot be allocated, -2 for bad arguments.
int lowbit_gemm_bf16(const uint16_t *x, int64_t m_rows, int64_t k, const uint8_t *wq,
                     const uint16_t *scale, const uint16_t *low, int64_t n_out,
                     const uint16_t *bias, uint16_t *y, int bits, int prologue,
                     const uint16_t *norm_w, float eps, int accumulate) {
    if ((bits != 4 && bits != 8 && bits != 16) || k % GROUP || n_out % ROWS || m_rows < 1)
        return -2;
    if (prologue < PROLOGUE_NONE || prologue > PROLOGUE_SILU_GATE) return -2;
    if (prologue == PROLOGUE_RMSNORM && !norm_w) return -2;
    if (bits != 16 && (!scale || !low)) return -2;
    int64_t groups = k / GROUP;
    float *v = (float *)malloc(sizeof(float) * (size_t)k);
    if (!v) return -1;
    if (bits == 16) {
#if defined(HAVE_BF16_KERNEL)
        uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)(m_rows * k * 2 + 64));
        if (!xb) {
            free(v);
            return -1;
        }
        bf16_rows(x, m_rows, k, prologue, norm_w, eps, v, xb);
        free(v);
        gemm_bf16_blocks(xb, m_rows, k, (const uint16_t *)wq, n_out, bias, y, accumulate);
        free(xb);
        return 0;
#else
        free(v);
        return -2;  // the AVX2 build has no bf16-weight kernel
#endif
    }
    // rows padded to a multiple of 16: the tiles read whole 16-row groups
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(((m_rows + 15) / 16 * 16) * k + 64));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(m_rows * groups));
    if (!xq || !xs || !xsum) {
        free(xq);
        free(xs);
        free(xsum);
        free(v);
        return -1;
    }
    if (m_rows < QUANTIZE_TEAM_MIN_M) {
        quantize_rows(x, m_rows, k, prologue, norm_w, eps, v, xq, xs, xsum);
    } else {  // prefill: each thread its own rows (the SiLU gate's exp is not cheap)
        const int64_t width = prologue == PROLOGUE_SILU_GATE ? 2 * k : k;
        int failed = 0;
#pragma omp parallel
        {
            float *vt = (float *)malloc(sizeof(float) * (size_t)k);
            const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t r0 = m_rows * t / nt, r1 = m_rows * (t + 1) / nt;
            if (!vt) {
#pragma omp atomic write
                failed = 1;
            } else if (r1 > r0) {
                quantize_rows(x + r0 * width, r1 - r0, k, prologue, norm_w, eps, vt, xq + r0 * k,
                              xs + r0 * groups, xsum + r0 * groups);
            }
            free(vt);
        }
        if (failed) {
            free(xq);
            free(xs);
            free(xsum);
            free(v);
            return -1;
        }
    }
    free(v);
    int64_t blocks = (n_out + LOWBIT_ROWS - 1) / LOWBIT_ROWS;
#if defined(__AMX_INT8__)
    if (m_rows >= DRAFT_AMX_MIN_M && draft_amx_usable()) {
        int failed = 0;
#pragma omp parallel
        {
            uint8_t *wbuf = bits == 4 ? (uint8_t *)aligned_alloc(64, (size_t)(groups * 1024)) : NULL;
            if (bits == 4 && !wbuf) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp barrier
            int none;  // every thread takes the loop below, or none does
#pragma omp atomic read
            none = failed;
            if (!none) {
                draft_amx_configure();
#pragma omp for schedule(static)
                for (int64_t blk = 0; blk < blocks; blk++) {
                    const int64_t n0 = blk * LOWBIT_ROWS;
                    block_lowbit_tiles(bits, wq + blk * LOWBIT_ROWS * (k * bits / 8),
                                       scale + blk * LOWBIT_ROWS * groups,
                                       low + blk * LOWBIT_ROWS * groups, n0,
                                       (int)(n_out - n0 < LOWBIT_ROWS ? n_out - n0 : LOWBIT_ROWS),
                                       k, xq, xs, xsum, m_rows, bias, y, n_out, accumulate, wbuf);
                }
                _tile_release();
            }
            free(wbuf);
        }
        free(xq);
        free(xs);
        free(xsum);
        return failed ? -1 : 0;
    }
#endif
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *wblk = wq + blk * LOWBIT_ROWS * (k * bits / 8);
        const uint16_t *sblk = scale + blk * LOWBIT_ROWS * groups;
        const uint16_t *lblk = low + blk * LOWBIT_ROWS * groups;
        int64_t n0 = blk * LOWBIT_ROWS;
        int valid = (int)(n_out - n0 < LOWBIT_ROWS ? n_out - n0 : LOWBIT_ROWS);
        for (int64_t m0 = 0; m0 < m_rows; m0 += LOWBIT_MCHUNK) {
            int64_t mc = m_rows - m0 < LOWBIT_MCHUNK ? m_rows - m0 : LOWBIT_MCHUNK;
            // constant bits and mc: the compiler keeps the accumulators in registers
#define CALL4(MC) block_lowbit(4, wblk, sblk, lblk, n0, valid, k, xq, xs, xsum, m0, MC, \
                               bias, y, n_out, accumulate)
#define CALL8(MC) block_lowbit(8, wblk, sblk, lblk, n0, valid, k, xq, xs, xsum, m0, MC, \
                               bias, y, n_out, accumulate)
            if (bits == 4) {
                BY_LOWBIT_CHUNK(CALL4)
            } else {
                BY_LOWBIT_CHUNK(CALL8)
            }
#undef CALL4
#undef CALL8
        }
    }
    free(xq);
    free(xs);
    free(xsum);
    return 0;
}

// RoPE in place on the first n_heads heads of each of m_rows rows (row stride `stride`
// elements, head_dim d): x * cos + rotate_half(x) * sin, cos/sin (m_rows, d) bf16, as
// HF's apply_rotary_pos_emb.
void rope_bf16(uint16_t *x, int64_t m_rows, int64_t stride, int64_t n_heads, int64_t d,
               const uint16_t *cos, const uint16_t *sin) {
    int64_t half = d / 2;
    for (int64_t m = 0; m < m_rows; m++) {
        const uint16_t *c = cos + m * d, *s = sin + m * d;
        for (int64_t h = 0; h < n_heads; h++) {
            uint16_t *row = x + m * stride + h * d;
            for (int64_t j = 0; j < half; j++) {
                float x1 = bf16_to_f32(row[j]), x2 = bf16_to_f32(row[j + half]);
                row[j] = f32_to_bf16(x1 * bf16_to_f32(c[j]) - x2 * bf16_to_f32(s[j]));
                row[j + half] =
                    f32_to_bf16(x2 * bf16_to_f32(c[j + half]) + x1 * bf16_to_f32(s[j + half]));
            }
        }
    }
}
// ---- whole draft layers in two calls (fused_draft.FusedDraftBase._native_layers)
//
// Why: one call per projection, plus RoPE, attention and the torch ops that move q, k
// and v between them, add call overhead that is a sizeable share of a layer at one
// token. In a prefill the KV-cache update stays in torch between the two halves (the
// decoder's batched cache with holes, decoding/kv.py); a few-token step runs every layer
// in one call that writes into the cache's spare room (draft_layers_step).

// One projection's weights as native_kernels.NativeLowBitLinear holds them.
typedef struct {
    const uint8_t *w;
    const uint16_t *scale, *low, *bias;
    int64_t n, k, bits;
} proj_t;

static int proj_gemm(const proj_t *p, const uint16_t *x, int64_t m, int prologue,
                     const uint16_t *norm_w, float eps, uint16_t *y, int accumulate) {
    return lowbit_gemm_bf16(x, m, p->k, p->w, p->scale, p->low, p->n, p->bias, y, (int)p->bits,
                            prologue, norm_w, eps, accumulate);
}

// First half, M = B*T rows of h (M, hidden): qkv = W_qkv @ rmsnorm(h), RoPE on the q and
// k heads (cos, sin (M, d)); q_out (M, nq*d) as the attention reads it, k_out and v_out
// (B, nkv, T, d) as the KV cache stores them. Returns 0, -1 out of memory, -2 bad shapes.
static int layer_pre_rows(const uint16_t *h, int64_t b, int64_t t, const proj_t *qkv,
                          const uint16_t *norm_w, float eps, const uint16_t *cos,
                          const uint16_t *sin, int64_t nq, int64_t nkv, int64_t d,
                          uint16_t *q_out, uint16_t *k_out, int64_t k_rows, uint16_t *v_out,
                          int64_t v_rows);

int draft_layer_pre(const uint16_t *h, int64_t b, int64_t t, const proj_t *qkv,
                    const uint16_t *norm_w, float eps, const uint16_t *cos, const uint16_t *sin,
                    int64_t nq, int64_t nkv, int64_t d, uint16_t *q_out, uint16_t *k_out,
                    uint16_t *v_out) {
    return layer_pre_rows(h, b, t, qkv, norm_w, eps, cos, sin, nq, nkv, d, q_out, k_out, t, v_out, t);
}

// draft_layer_pre with k_out / v_out's heads k_rows / v_rows rows of d apart (a cache
// room's spare slots: draft_layers_step).
static int layer_pre_rows(const uint16_t *h, int64_t b, int64_t t, const proj_t *qkv,
                          const uint16_t *norm_w, float eps, const uint16_t *cos,
                          const uint16_t *sin, int64_t nq, int64_t nkv, int64_t d,
                          uint16_t *q_out, uint16_t *k_out, int64_t k_rows, uint16_t *v_out,
                          int64_t v_rows) {
    int64_t m = b * t, width = (nq + 2 * nkv) * d;
    if (qkv->n != width || b < 1 || t < 1) return -2;
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(m * width));
    if (!buf) return -1;
    int rc = proj_gemm(qkv, h, m, PROLOGUE_RMSNORM, norm_w, eps, buf, 0);
    if (rc == 0) {
        rope_bf16(buf, m, width, nq + nkv, d, cos, sin);
        for (int64_t row = 0; row < m; row++) {
            int64_t bi = row / t, ti = row % t;
            const uint16_t *src = buf + row * width;
            memcpy(q_out + row * nq * d, src, sizeof(uint16_t) * (size_t)(nq * d));
            for (int64_t hh = 0; hh < nkv; hh++) {
                memcpy(k_out + ((bi * nkv + hh) * k_rows + ti) * d, src + (nq + hh) * d,
                       sizeof(uint16_t) * (size_t)d);
                memcpy(v_out + ((bi * nkv + hh) * v_rows + ti) * d, src + (nq + nkv + hh) * d,
                       sizeof(uint16_t) * (size_t)d);
            }
        }
    }
    free(buf);
    return rc;
}

// Second half, h (M, hidden) updated in place: attention of q (M, nq*d) over the cache
// k, v (B, nkv, L, d) (heads k_rows / v_rows rows apart, as attention_bf16) where
// allowed (B, T, L); h += W_o @ a; then the MLP,
// h += W_down @ (silu(gate) * up) with gate|up = W_gate_up @ rmsnorm(h).
int draft_layer_post(uint16_t *h, int64_t b, int64_t t, const uint16_t *q, int64_t nq,
                     const uint16_t *k, const uint16_t *v, int64_t k_rows, int64_t v_rows,
                     const uint8_t *allowed, int64_t nkv,
                     int64_t l_len, int64_t d, float scale, const proj_t *o,
                     const uint16_t *post_norm, float eps, const proj_t *gate_up,
                     const proj_t *down) {
    int64_t m = b * t;
    if (o->k != nq * d || down->k * 2 != gate_up->n || o->n != down->n) return -2;
    uint16_t *a = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(m * nq * d));
    uint16_t *gu = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(m * gate_up->n));
    int rc = (!a || !gu) ? -1 : 0;
    if (rc == 0) rc = attention_bf16(q, nq * d, k, v, k_rows, v_rows, allowed, b, nq, nkv, t, l_len, d,
                                     scale, a);
    if (rc == 0) rc = proj_gemm(o, a, m, PROLOGUE_NONE, NULL, 0.0f, h, 1);
    if (rc == 0) rc = proj_gemm(gate_up, h, m, PROLOGUE_RMSNORM, post_norm, eps, gu, 0);
    if (rc == 0) rc = proj_gemm(down, gu, m, PROLOGUE_SILU_GATE, NULL, 0.0f, h, 1);
    free(a);
    free(gu);
    return rc;
}

// One decoder layer of a draft_layers_step: its weights, and this step's cache room for
// its keys and values, (B, nkv, *_room_rows, d) with slots [0, n) filled.
typedef struct {
    proj_t qkv, o, gate_up, down;
    const uint16_t *in_norm, *post_norm;
    float in_eps, post_eps, scale;
    uint16_t *k_room, *v_room;
    int64_t k_room_rows, v_room_rows;
} draft_layer_t;

// A few-token step through all n_layers layers in one call: per layer draft_layer_pre's
// work with the new keys and values written straight into the room's slots [n, n + t),
// then draft_layer_post's over slots [0, n + t) (allowed (B, T, n + t)). The same calls
// in the same order as the two-call path, so the same bits. Why: at one token the torch
// work between the two calls (the cache's update, new tensors, the calls' arguments) was
// ~2.3 ms of a ~9.6 ms draft forward (24 layers) on the 2-core Zen 5.
int draft_layers_step(uint16_t *h, int64_t b, int64_t t, int64_t n_layers,
                      const draft_layer_t *layers, const uint16_t *cos, const uint16_t *sin,
                      int64_t nq, int64_t nkv, int64_t d, int64_t n, const uint8_t *allowed) {
    uint16_t *q = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(b * t * nq * d));
    int rc = q ? 0 : -1;
    for (int64_t i = 0; rc == 0 && i < n_layers; i++) {
        const draft_layer_t *ly = layers + i;
        if (ly->k_room_rows < n + t || ly->v_room_rows < n + t) {
            rc = -2;
            break;
        }
        rc = layer_pre_rows(h, b, t, &ly->qkv, ly->in_norm, ly->in_eps, cos, sin, nq, nkv, d, q,
                            ly->k_room + n * d, ly->k_room_rows, ly->v_room + n * d,
                            ly->v_room_rows);
        if (rc == 0)
            rc = draft_layer_post(h, b, t, q, nq, ly->k_room, ly->v_room, ly->k_room_rows,
                                  ly->v_room_rows, allowed, nkv, n + t, d, ly->scale, &ly->o,
                                  ly->post_norm, ly->post_eps, &ly->gate_up, &ly->down);
    }
    free(q);
    return rc;
}
