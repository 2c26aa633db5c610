// Low-bit-weight x int8-activation matrix products for the draft (AVX512-VNNI).
//
// Why: on CPUs without AMX, aten's _weight_int4pack_mm_for_cpu dequantises every
// weight to float before multiplying and runs compute-bound at ~16 GB/s of int4 with
// 2 threads (a 0.5B draft's MLP: ~10 ms a token), and _weight_int8pack_mm costs ~100 us
// a call for the small attention projections. Quantising the few activation rows to
// int8 (one scale per group of 64, as llama.cpp's Q8 blocks) lets vpdpbusd multiply 64
// unsigned weights by 64 signed activations in one instruction, so the product runs
// at about the speed of reading the weights.
//
// Weights: asymmetric groups of 64 inputs, w = u * scale + low with u in 0..15 (bits
// = 4) or 0..255 (bits = 8). Layout (built by native_kernels.py), N a multiple of
// ROWS = 4: rows come in blocks of 4 stored group by group, so a block is one
// contiguous stream: wq[n / 4][g][n % 4] holds the group's bytes (bits = 8: u[j];
// bits = 4: 32 bytes, byte j = u[j] | u[j + 32] << 4); scale and low are
// [n / 4][g][n % 4] floats.
// y[m][n] = sum_g scale * xs[m][g] * sum_j u[j] * xq[m][j] + low * xs[m][g] * sum_j xq[m][j]
// (+ bias[n]): the dequantised activations times the dequantised weights. Inputs and outputs are bfloat16; int32 within a group, float across.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 64
#define MCHUNK 4            // activation rows per pass over a weight block
#define ROWS 4              // weight rows per block
#define PREFETCH_BYTES 1024 // software prefetch distance in the weight stream

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

// The matmul's input row m as float, after the optional prologue:
// RMSNORM: x * rsqrt(mean(x^2) + eps) * norm_w (Llama/Qwen2 RMSNorm; x has k columns);
// SILU_GATE: silu(x[:k]) * x[k:2k] (the MLP's gate/up output; x has 2k columns).
static void input_row(const uint16_t *x, int64_t m, int64_t k, int prologue,
                      const uint16_t *norm_w, float eps, float *v) {
    if (prologue == PROLOGUE_SILU_GATE) {
        const uint16_t *gate = x + m * 2 * k, *up = gate + k;
        for (int64_t j = 0; j < k; j++) {
            float g = bf16_to_f32(gate[j]);
            v[j] = g / (1.0f + expf(-g)) * bf16_to_f32(up[j]);
        }
        return;
    }
    const uint16_t *src = x + m * k;
    for (int64_t j = 0; j < k; j++) v[j] = bf16_to_f32(src[j]);
    if (prologue == PROLOGUE_RMSNORM) {
        double ss = 0.0;
        for (int64_t j = 0; j < k; j++) ss += (double)v[j] * v[j];
        float r = 1.0f / sqrtf((float)(ss / (double)k) + eps);
        for (int64_t j = 0; j < k; j++) v[j] = v[j] * r * bf16_to_f32(norm_w[j]);
    }
}

// Per row m and group g: xq (int8), xs = max|v| / 127 and xsum = xs * sum of xq (the
// sum of the quantised activations, not of v: with asymmetric weights the low term
// would otherwise add the activations' rounding error times the group's offset).
static void quantize_rows(const uint16_t *x, int64_t m_rows, int64_t k, int prologue,
                          const uint16_t *norm_w, float eps, float *v, int8_t *xq, float *xs,
                          float *xsum) {
    int64_t groups = k / GROUP;
    for (int64_t m = 0; m < m_rows; m++) {
        input_row(x, m, k, prologue, norm_w, eps, v);
        for (int64_t g = 0; g < groups; g++) {
            const float *src = v + g * GROUP;
            float amax = 0.0f;
            for (int j = 0; j < GROUP; j++) {
                float a = fabsf(src[j]);
                amax = a > amax ? a : amax;
            }
            float scale = amax / 127.0f;
            float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int8_t *dst = xq + m * k + g * GROUP;
            int32_t isum = 0;
            for (int j = 0; j < GROUP; j++) {
                dst[j] = (int8_t)lrintf(src[j] * inv);
                isum += dst[j];
            }
            xs[m * groups + g] = scale;
            xsum[m * groups + g] = scale * (float)isum;
        }
    }
}

// 64 unsigned weights of one group, in input order, as bytes.
static inline __attribute__((always_inline)) __m512i load_group(const uint8_t *p,
                                                               const int bits) {
    if (bits == 8) return _mm512_loadu_si512((const void *)p);
    __m256i packed = _mm256_loadu_si256((const __m256i *)p);
    __m256i mask = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(packed, mask);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// ROWS weight rows x mc activation rows: ROWS * mc independent accumulators, so the
// float multiply-add chains overlap instead of waiting on one another. The block's
// weights are one contiguous stream (see the layout above), which the hardware
// prefetcher follows; the software prefetch runs a few groups ahead of it.
static inline __attribute__((always_inline)) void block_rows(
    const int bits, const uint8_t *wblk, const float *sblk, const float *lblk, int64_t n0, int64_t k,
    const int8_t *xq, const float *xs, const float *xsum, int64_t m0, const int64_t mc,
    const uint16_t *bias, uint16_t *y, int64_t n_out, int accumulate) {
    const int64_t group_bytes = GROUP * bits / 8;
    int64_t groups = k / GROUP;
    __m512 acc[ROWS][MCHUNK];
    float zterm[ROWS][MCHUNK];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < MCHUNK; i++) {
            acc[r][i] = _mm512_setzero_ps();
            zterm[r][i] = 0.0f;
        }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = wblk + g * ROWS * group_bytes;
        for (int64_t line = 0; line < ROWS * group_bytes; line += 64)
            _mm_prefetch((const char *)(wg + PREFETCH_BYTES + line), _MM_HINT_T0);
        __m512i xv[MCHUNK];
        float xsg[MCHUNK], xsumg[MCHUNK];
        for (int64_t i = 0; i < mc; i++) {
            int64_t m = m0 + i;
            xv[i] = _mm512_loadu_si512((const void *)(xq + m * k + g * GROUP));
            xsg[i] = xs[m * groups + g];
            xsumg[i] = xsum[m * groups + g];
        }
        for (int r = 0; r < ROWS; r++) {
            __m512i w = load_group(wg + r * group_bytes, bits);
            float s = sblk[g * ROWS + r], lo = lblk[g * ROWS + r];
            for (int64_t i = 0; i < mc; i++) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv[i]);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(s * xsg[i]),
                                            acc[r][i]);
                zterm[r][i] += lo * xsumg[i];
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float b = bias ? bf16_to_f32(bias[n0 + r]) : 0.0f;
        for (int64_t i = 0; i < mc; i++) {
            float v = _mm512_reduce_add_ps(acc[r][i]) + zterm[r][i] + b;
            uint16_t *dst = y + (m0 + i) * n_out + n0 + r;
            *dst = f32_to_bf16(accumulate ? bf16_to_f32(*dst) + v : v);
        }
    }
}

// y (m_rows, n_out) = prologue(x) (m_rows, k) @ W.T (+ bias), or y += that when
// accumulate (a residual add in place); k a multiple of 64, n_out of 4, bits 4 or 8.
// Returns 0, -1 when the scratch buffers cannot be allocated, -2 for bad arguments.
int lowbit_gemm_bf16(const uint16_t *x, int64_t m_rows, int64_t k, const uint8_t *wq,
                     const float *scale, const float *low, int64_t n_out,
                     const uint16_t *bias, uint16_t *y, int bits, int prologue,
                     const uint16_t *norm_w, float eps, int accumulate) {
    if ((bits != 4 && bits != 8) || k % GROUP || n_out % ROWS || m_rows < 1) return -2;
    if (prologue < PROLOGUE_NONE || prologue > PROLOGUE_SILU_GATE) return -2;
    if (prologue == PROLOGUE_RMSNORM && !norm_w) return -2;
    int64_t groups = k / GROUP;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(m_rows * k + 64));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *v = (float *)malloc(sizeof(float) * (size_t)k);
    if (!xq || !xs || !xsum || !v) {
        free(xq);
        free(xs);
        free(xsum);
        free(v);
        return -1;
    }
    quantize_rows(x, m_rows, k, prologue, norm_w, eps, v, xq, xs, xsum);
    free(v);
    int64_t blocks = n_out / ROWS;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *wblk = wq + blk * ROWS * (k * bits / 8);
        const float *sblk = scale + blk * ROWS * groups;
        const float *lblk = low + blk * ROWS * groups;
        for (int64_t m0 = 0; m0 < m_rows; m0 += MCHUNK) {
            int64_t mc = m_rows - m0 < MCHUNK ? m_rows - m0 : MCHUNK;
            // Constant bits and mc let the compiler keep the accumulators in registers.
#define BLOCK(B, MC) \
    block_rows(B, wblk, sblk, lblk, blk * ROWS, k, xq, xs, xsum, m0, MC, bias, y, n_out, \
               accumulate)
            if (bits == 4) {
                switch (mc) {
                    case 1: BLOCK(4, 1); break;
                    case 2: BLOCK(4, 2); break;
                    case 3: BLOCK(4, 3); break;
                    default: BLOCK(4, 4); break;
                }
            } else {
                switch (mc) {
                    case 1: BLOCK(8, 1); break;
                    case 2: BLOCK(8, 2); break;
                    case 3: BLOCK(8, 3); break;
                    default: BLOCK(8, 4); break;
                }
            }
#undef BLOCK
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

// 16 bf16 values -> 16 floats.
static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
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

// Softmax attention for a few query tokens with grouped KV heads (decode steps):
// q[(b*T + t) * q_stride + h*d + j]; k, v (B, Hkv, L, d) contiguous; allowed (B, T, L)
// bytes (every query allows at least one key); out (B, T, Hq*d). Query head h reads KV
// head h / (Hq / Hkv), as HF's repeat_kv. Scores, softmax and sums in float32;
// d a multiple of 16. Returns 0, -1 when scratch cannot be allocated, -2 bad arguments.
int attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                   const uint8_t *allowed, int64_t b_rows, int64_t hq, int64_t hkv, int64_t t_len,
                   int64_t l_len, int64_t d, float scale, uint16_t *out) {
    if (d % 16 || d > 256 || hkv < 1 || hq % hkv || l_len < 1) return -2;
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
        const uint16_t *kb = k + (b * hkv + kvh) * l_len * d;
        const uint16_t *vb = v + (b * hkv + kvh) * l_len * d;
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
