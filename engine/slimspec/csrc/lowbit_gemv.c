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
// = 4) or 0..255 (bits = 8). Layout (built by native_lowbit.py), N a multiple of
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

// Per row m and group g: xq (int8), xs = max|x| / 127 and xsum = xs * sum of xq (the
// sum of the quantised activations, not of x: with asymmetric weights the low term
// would otherwise add the activations' rounding error times the group's offset).
static void quantize_rows(const uint16_t *x, int64_t m_rows, int64_t k, int8_t *xq, float *xs,
                          float *xsum) {
    int64_t groups = k / GROUP;
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *src = x + m * k + g * GROUP;
            float v[GROUP];
            float amax = 0.0f;
            for (int j = 0; j < GROUP; j++) {
                v[j] = bf16_to_f32(src[j]);
                float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
            }
            float scale = amax / 127.0f;
            float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int8_t *dst = xq + m * k + g * GROUP;
            int32_t isum = 0;
            for (int j = 0; j < GROUP; j++) {
                dst[j] = (int8_t)lrintf(v[j] * inv);
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
    const uint16_t *bias, uint16_t *y, int64_t n_out) {
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
            y[(m0 + i) * n_out + n0 + r] = f32_to_bf16(v);
        }
    }
}

// y (m_rows, n_out) = x (m_rows, k) @ W.T (+ bias); k a multiple of 64, n_out of 4,
// bits 4 or 8. Returns 0, -1 when the scratch buffers cannot be allocated, -2 for
// bad arguments.
int lowbit_gemm_bf16(const uint16_t *x, int64_t m_rows, int64_t k, const uint8_t *wq,
                     const float *scale, const float *low, int64_t n_out,
                     const uint16_t *bias, uint16_t *y, int bits) {
    if ((bits != 4 && bits != 8) || k % GROUP || n_out % ROWS || m_rows < 1) return -2;
    int64_t groups = k / GROUP;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(m_rows * k + 64));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(m_rows * groups));
    if (!xq || !xs || !xsum) {
        free(xq);
        free(xs);
        free(xsum);
        return -1;
    }
    quantize_rows(x, m_rows, k, xq, xs, xsum);
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
    block_rows(B, wblk, sblk, lblk, blk * ROWS, k, xq, xs, xsum, m0, MC, bias, y, n_out)
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
