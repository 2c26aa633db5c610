// Matmuls straight from GGUF weight blocks (the target in its weights' own form).
//
// Why: the default target ships as Q4_K_M GGUF blocks (Q4_K, Q6_K, ...). Dequantised to
// bf16 it reads about three times the bytes a verification needs; here each weight
// block is unpacked in registers and multiplied with int8-quantised activation rows
// (the same scheme llama.cpp's CPU backend uses: activations in blocks of 256 for the
// K-quants, 32 for the 32-wide types), so a step reads the file's bytes once.
//
// Exactness across batch shapes: every output y[m][n] is computed by the same sequence
// of operations whatever M is and however rows are grouped: integer sums inside a
// block (exact), then float FMAs block by block in a fixed order (Q4_K and Q6_K: one
// accumulator per output, one integer total per block; Q8_0: 8 lanes added in a fixed
// order, see "Lanes" below), the same in every code path. So a position's logits do
// not depend on how many rows are verified beside it, nor on whether its rows went
// through the row path (up to 8 activation rows per unpacked weight row) or the
// panels (8 weight rows repacked, for many activation rows), and the portable, AVX2
// and VNNI builds give bit-identical results (tests/engine/test_gguf_kernels.py builds
// and compares them). Build with -ffp-contract=off so the compiler cannot fuse the
// float update differently in different places.
//
// Builds (gguf_kernels.BUILDS picks by CPU flags): AVX2 + FMA + F16C; the same code
// with 256-bit VNNI where the CPU has it (AVX512-VNNI with VL: Intel since Cascade
// Lake, AMD Zen 4; AVX-VNNI: Intel client CPUs since Alder Lake), one vpdpwssd or
// vpdpbusd for a multiply-add pair (DPWSSD256 below); portable C elsewhere. 512-bit
// registers measured no faster than these (the integer multiplies are the bound, and
// 512-bit work takes a vector port away on Intel), so there is no zmm code outside the
// AMX build: the VNNI build plus int8 tiles for Q4_K and Q6_K from 8 or 10 rows
// (Intel since Sapphire Rapids; "AMX tiles" below), the same bits again.
//
// Layouts (ggml's, as the GGUF file stores them; one weight row is K/QK values' blocks):
//   Q4_K (256 values, 144 B): fp16 d, fp16 dmin, 12 B packed 6-bit scales/mins, 128 B
//         nibbles; value = d*sc*q - dmin*m, q in 0..15, 8 sub-blocks of 32.
//   Q6_K (256 values, 210 B): 128 B low nibbles, 64 B high 2-bit pairs, 16 int8 scales,
//         fp16 d; value = d*sc*(q-32), q in 0..63, 16 sub-blocks of 16.
//   Q8_0 (32 values, 34 B): fp16 d, 32 int8; value = d*q.
//   Q4_K_X8 (ours, not ggml's; 8 weight rows x 256 values, 1184 B): the same Q4_K values
//         repacked once at load into a panel of 8 weight rows ("Resident panels" below).
//   Q6_K_X8 (ours; 8 weight rows x 256 values, 1680 B, the file's size): Q6_K the same way.
// Activations: q8 (M, K) int8 in [-127, 127], dx (M, K/block) float scales,
// bsum (M, K/16) int16 sums of 16 consecutive q8 values (the K-quants' offset terms).
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q6_K = 14 };  // ggml_type values
enum { TYPE_Q4_K_X8 = 1012 };  // Q4_K in resident 8-row panels (q4k_x8): no ggml type
enum { TYPE_Q6_K_X8 = 1014 };  // Q6_K in resident 8-row panels (q6k_x8): no ggml type
enum { QK_K = 256, QK8_0 = 32, ROW_GROUP = 8, M_CHUNK = 32, PREFETCH_BYTES = 2048 };

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
} block_q4_K;
typedef struct {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
} block_q6_K;
typedef struct {
    uint16_t d;
    int8_t qs[32];
} block_q8_0;
// One 256-value block of 8 weight rows of Q4_K: qs[sb][gp][r] holds values 4gp..4gp+3 of
// sub-block sb of row r in its low nibbles and values 4gp+16..4gp+19 in its high ones
// (q4k_pack_x8), the rows' 6-bit scales and mins a byte each, d and dmin as in the file.
typedef struct {
    uint8_t qs[8][4][8][4];
    uint8_t sc[8][8], mn[8][8];  // [sub-block][row]
    uint16_t d[8], dmin[8];
} q4k_x8;
// One 256-value block of 8 weight rows of Q6_K, sub-block sb = values 16sb..16sb+15 in
// four groups of 4 (g = 0..3): ql[sb][j][r] holds the low nibbles of groups j (low) and
// j + 2 (high) of row r, qh[sb][r] the high 2 bits of groups 0..3 at bits 0, 2, 4, 6
// (q6k_pack_x8); the rows' int8 scales in pairs of sub-blocks, d as in the file.
typedef struct {
    uint8_t ql[16][2][8][4];
    uint8_t qh[16][8][4];
    int8_t sc[8][8][2];  // [sub-block pair][row][sub-block 2p, 2p + 1]
    uint16_t d[8];
} q6k_x8;
static inline int is_x8(int type) { return type == TYPE_Q4_K_X8 || type == TYPE_Q6_K_X8; }

#if defined(__F16C__)
// fp16 -> fp32 is exact, so the hardware conversion gives the software routine's bits.
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

int block_values(int type) {
    return type == TYPE_Q8_0 ? QK8_0
           : (type == TYPE_Q4_K || type == TYPE_Q6_K || is_x8(type)) ? QK_K
                                                                               : 0;
}

int block_bytes(int type) {
    switch (type) {
        case TYPE_Q8_0: return (int)sizeof(block_q8_0);
        case TYPE_Q4_K: return (int)sizeof(block_q4_K);
        case TYPE_Q6_K: return (int)sizeof(block_q6_K);
        case TYPE_Q4_K_X8: return (int)sizeof(q4k_x8) / 8;  // per weight row
        case TYPE_Q6_K_X8: return (int)sizeof(q6k_x8) / 8;
        default: return 0;
    }
}

// Activation block size a weight type is multiplied with.
int activation_block(int type) { return type == TYPE_Q8_0 ? QK8_0 : QK_K; }

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion.
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Quantise one block of `block` (32 or 256) values, float32 (x_bf16 == 0) or bfloat16
// (read exactly as float32): dx = amax / 127, q = round-to-even(x * 127 / amax) in
// [-127, 127], bsum[g] = sum of q[16g .. 16g + 15]. The AVX2 code does the same float
// operations per value (max is exact, cvtps2dq rounds to even as lrintf does).
static void quantize_block(const void *x, int x_bf16, int block, int8_t *q, float *dx,
                           int16_t *bsum) {
    float xf[QK_K];
    if (x_bf16) {
        const uint16_t *h = (const uint16_t *)x;
        for (int i = 0; i < block; i++) xf[i] = bf16_to_float(h[i]);
    } else {
        memcpy(xf, x, sizeof(float) * (size_t)block);
    }
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8)
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xf + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *dx = amax / 127.0f;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (int i = 0; i < block; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++) {
            const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xf + i + 8 * j), vid));
            v[j] = _mm256_max_epi32(_mm256_min_epi32(r, hi), lo);
        }
        // packs interleave the 128-bit lanes; the permute puts the 32 values back in order
        const __m256i p16a = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i), p8);
    }
#else
    float amax = 0.0f;
    for (int i = 0; i < block; i++) amax = fmaxf(amax, fabsf(xf[i]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    *dx = amax / 127.0f;
    for (int i = 0; i < block; i++) {
        int v = (int)lrintf(xf[i] * id);
        q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
#endif
    for (int g = 0; g < block / 16; g++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += q[g * 16 + i];
        bsum[g] = (int16_t)s;
    }
}

// The blocks of M rows (row stride lda values) shared among the calling team's threads.
static void quantize_team(const void *x, int x_bf16, int64_t M, int64_t K, int64_t lda,
                          int block, int8_t *q, float *dx, int16_t *bsum) {
    const int64_t nb = K / block, esize = x_bf16 ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t m = i / nb, b = i % nb;
        quantize_block((const char *)x + (m * lda + b * block) * esize, x_bf16, block,
                       q + m * K + b * block, dx + i, bsum + m * (K / 16) + b * (block / 16));
    }
}

// Quantise M rows of K floats (row stride lda) to int8 in blocks of `block` values.
int quantize_rows_q8(const float *x, int64_t M, int64_t K, int64_t lda, int block, int8_t *q,
                     float *dx, int16_t *bsum) {
    if ((block != 32 && block != 256) || K % block) return -1;
#pragma omp parallel if (M * (K / block) > 1)
    quantize_team(x, 0, M, K, lda, block, q, dx, bsum);
    return 0;
}

// Lanes (Q8_0): the AVX2 code keeps 8 float accumulators per output; lane j of a
// 32-value chunk sums values 4j..4j+3. Each block adds its exact integer lane sums
// times (activation scale x weight scale) with one FMA per lane, and the 8 lanes are
// added in one fixed order at the end. The portable code does the same lane by lane
// (fmaf), so both paths give the same bits.
#define LANES 8

static inline float lanes_total(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// The 12 packed bytes of a Q4_K block -> 8 6-bit scales (u[0], u[1]) and 8 6-bit mins
// (u[2], u[3]), a byte each, in four 32-bit words (llama.cpp's unpacking).
static inline void q4k_scale_words(const uint8_t *s, uint32_t u[4]) {
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    u[0] = a & m6;
    u[1] = (c & m4) | (((a >> 6) & m2) << 4);
    u[2] = b & m6;
    u[3] = ((c >> 4) & m4) | (((b >> 6) & m2) << 4);
}

static inline void q4k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    uint32_t u[4];
    q4k_scale_words(s, u);
    memcpy(sc, u, 8);
    memcpy(mn, u + 2, 8);
}

// ---------------------------------------------------------------- portable paths

// Q4_K's order (all builds): per block the exact integers S = sum over the 8 sub-blocks
// of scale x (32-value dot) and Mn = sum of min x (the sub-block's activation sum), then
// acc = fma(S, dx*d, acc), acc = fma(-Mn, dx*dmin, acc), block after block. One float
// accumulator per output, so a row-in-lanes panel (below) gives the same bits.
static void q4k_row_scalar(const block_q4_K *w, int64_t nb, const int8_t *q, const float *dx,
                           const int16_t *bsum, float *out) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t sc[8], mn[8];
        q4k_scales(w[b].scales, sc, mn);
        const int8_t *qb = q + b * QK_K;
        const int16_t *bs = bsum + b * 16;
        int32_t s = 0, m = 0;
        for (int sb = 0; sb < 8; sb++) {
            const uint8_t *qs = w[b].qs + 32 * (sb / 2);
            const int shift = 4 * (sb & 1);
            int32_t dot = 0;
            for (int i = 0; i < 32; i++) dot += ((qs[i] >> shift) & 0xF) * qb[32 * sb + i];
            s += sc[sb] * dot;
            m += mn[sb] * (bs[2 * sb] + bs[2 * sb + 1]);
        }
        acc = fmaf((float)s, dx[b] * half_to_float(w[b].d), acc);
        acc = fmaf(-(float)m, dx[b] * half_to_float(w[b].dmin), acc);
    }
    *out = acc;
}

// Row r (0..7) of a run of Q4_K_X8 panels (nb blocks): q4k_row_scalar's integers and
// float steps, read from the panel layout.
static void q4k_x8_row_scalar(const q4k_x8 *p, int64_t nb, int r, const int8_t *q,
                              const float *dx, const int16_t *bsum, float *out) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const q4k_x8 *pb = p + b;
        const int8_t *qb = q + b * QK_K;
        const int16_t *bs = bsum + b * 16;
        int32_t s = 0, m = 0;
        for (int sb = 0; sb < 8; sb++) {
            int32_t dot = 0;
            for (int gp = 0; gp < 4; gp++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t v = pb->qs[sb][gp][r][i];
                    dot += (v & 0xF) * qb[32 * sb + 4 * gp + i] + (v >> 4) * qb[32 * sb + 4 * gp + 16 + i];
                }
            s += pb->sc[sb][r] * dot;
            m += pb->mn[sb][r] * (bs[2 * sb] + bs[2 * sb + 1]);
        }
        acc = fmaf((float)s, dx[b] * half_to_float(pb->d[r]), acc);
        acc = fmaf(-(float)m, dx[b] * half_to_float(pb->dmin[r]), acc);
    }
    *out = acc;
}

// N Q4_K weight rows (N % 8 == 0, K % 256 == 0, row_bytes each) -> N / 8 runs of K / 256
// q4k_x8 panels (the same values; done once when a target is loaded).
int q4k_pack_x8(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, uint8_t *out) {
    const int64_t nb = K / QK_K;
    if (N % 8 || K % QK_K || row_bytes != nb * (int64_t)sizeof(block_q4_K)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 8)
        for (int64_t b = 0; b < nb; b++) {
            q4k_x8 *p = (q4k_x8 *)out + n0 / 8 * nb + b;
            for (int r = 0; r < 8; r++) {
                const block_q4_K *x = (const block_q4_K *)(w + (n0 + r) * row_bytes) + b;
                uint8_t v[256];
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 32; i++) {
                        v[64 * c + i] = x->qs[32 * c + i] & 0xF;
                        v[64 * c + 32 + i] = x->qs[32 * c + i] >> 4;
                    }
                for (int sb = 0; sb < 8; sb++)
                    for (int gp = 0; gp < 4; gp++)
                        for (int i = 0; i < 4; i++)
                            p->qs[sb][gp][r][i] = (uint8_t)(v[32 * sb + 4 * gp + i] |
                                                            v[32 * sb + 4 * gp + 16 + i] << 4);
                uint8_t sc[8], mn[8];
                q4k_scales(x->scales, sc, mn);
                for (int sb = 0; sb < 8; sb++) p->sc[sb][r] = sc[sb], p->mn[sb][r] = mn[sb];
                p->d[r] = x->d;
                p->dmin[r] = x->dmin;
            }
        }
    return 0;
}

// A Q6_K block's 256 values 0..63 in order.
static void q6k_values(const block_q6_K *w, uint8_t *v) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w->ql + 64 * h, *qh = w->qh + 32 * h;
        for (int l = 0; l < 32; l++) {
            v[128 * h + l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
            v[128 * h + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            v[128 * h + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            v[128 * h + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

// Q6_K's order (all builds): per block the exact integer S = sum over the 16 sub-blocks
// of scale x (16-value dot of the 6-bit values 0..63) - 32 x sum of scale x (the
// sub-block's activation sum), then acc = fma(S, dx*d, acc), block after block.
static void q6k_row_scalar(const block_q6_K *w, int64_t nb, const int8_t *q, const float *dx,
                           const int16_t *bsum, float *out) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *qb = q + b * QK_K;
        const int16_t *bs = bsum + b * 16;
        uint8_t v[QK_K];
        q6k_values(w + b, v);
        int32_t s = 0, o = 0;
        for (int sb = 0; sb < 16; sb++) {
            int32_t dot = 0;
            for (int i = 16 * sb; i < 16 * sb + 16; i++) dot += v[i] * qb[i];
            s += w[b].scales[sb] * dot;
            o += w[b].scales[sb] * bs[sb];
        }
        acc = fmaf((float)(s - 32 * o), dx[b] * half_to_float(w[b].d), acc);
    }
    *out = acc;
}

// Value 16sb + 4g + i of row r of a Q6_K_X8 panel block (0..63).
static inline int q6k_x8_value(const q6k_x8 *p, int sb, int g, int r, int i) {
    const int lo = (p->ql[sb][g & 1][r][i] >> (4 * (g >> 1))) & 0xF;
    return lo | ((p->qh[sb][r][i] >> (2 * g)) & 3) << 4;
}

// Row r (0..7) of a run of Q6_K_X8 panels (nb blocks): q6k_row_scalar's integers and
// float step, read from the panel layout.
static void q6k_x8_row_scalar(const q6k_x8 *p, int64_t nb, int r, const int8_t *q,
                              const float *dx, const int16_t *bsum, float *out) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const q6k_x8 *pb = p + b;
        const int8_t *qb = q + b * QK_K;
        const int16_t *bs = bsum + b * 16;
        int32_t s = 0, o = 0;
        for (int sb = 0; sb < 16; sb++) {
            int32_t dot = 0;
            for (int g = 0; g < 4; g++)
                for (int i = 0; i < 4; i++) dot += q6k_x8_value(pb, sb, g, r, i) * qb[16 * sb + 4 * g + i];
            const int sc = pb->sc[sb / 2][r][sb % 2];
            s += sc * dot;
            o += sc * bs[sb];
        }
        acc = fmaf((float)(s - 32 * o), dx[b] * half_to_float(pb->d[r]), acc);
    }
    *out = acc;
}

// N Q6_K weight rows (N % 8 == 0, K % 256 == 0, row_bytes each) -> N / 8 runs of K / 256
// q6k_x8 panels (the same values, the same bytes; done once when a target is loaded).
int q6k_pack_x8(const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes, uint8_t *out) {
    const int64_t nb = K / QK_K;
    if (N % 8 || K % QK_K || row_bytes != nb * (int64_t)sizeof(block_q6_K)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += 8)
        for (int64_t b = 0; b < nb; b++) {
            q6k_x8 *p = (q6k_x8 *)out + n0 / 8 * nb + b;
            for (int r = 0; r < 8; r++) {
                const block_q6_K *x = (const block_q6_K *)(w + (n0 + r) * row_bytes) + b;
                uint8_t v[QK_K];
                q6k_values(x, v);
                for (int sb = 0; sb < 16; sb++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t *u = v + 16 * sb + i;  // groups at u[0], u[4], u[8], u[12]
                        p->ql[sb][0][r][i] = (uint8_t)((u[0] & 0xF) | (u[8] & 0xF) << 4);
                        p->ql[sb][1][r][i] = (uint8_t)((u[4] & 0xF) | (u[12] & 0xF) << 4);
                        p->qh[sb][r][i] = (uint8_t)(u[0] >> 4 | (u[4] >> 4) << 2 | (u[8] >> 4) << 4 |
                                                    (u[12] >> 4) << 6);
                    }
                for (int sb = 0; sb < 16; sb++) p->sc[sb / 2][r][sb % 2] = x->scales[sb];
                p->d[r] = x->d;
            }
        }
    return 0;
}

static void q80_row_scalar(const block_q8_0 *w, int64_t nb, const int8_t *q, const float *dx,
                           float *out) {
    float acc[LANES] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const float dd = dx[b] * half_to_float(w[b].d);
        for (int j = 0; j < LANES; j++) {
            int32_t s = 0;
            for (int i = 4 * j; i < 4 * j + 4; i++) s += w[b].qs[i] * q[b * 32 + i];
            acc[j] = fmaf((float)s, dd, acc[j]);
        }
    }
    *out = lanes_total(acc);
}

#if defined(__AVX2__)
// ---------------------------------------------------------------- AVX2 paths
// The row path: one weight row against ROWS activation rows (a compile-time 1..8, so
// the accumulators stay in registers): the weight's nibbles are unpacked once per 32
// values and multiplied with each row (vpmaddubsw u8 x s8 -> s16, vpmaddwd -> s32);
// the K-quants' int32 lanes are totalled per block (one reduction tree for all rows)
// and the float steps run with the activation rows in the lanes.
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 8

// acc + pairwise sums of a * b (int16 -> int32 lanes): one vpdpwssd where the CPU has a
// 256-bit VNNI (AVX512-VNNI with VL, or AVX-VNNI), else vpmaddwd + vpaddd; the same ints.
// Likewise the sums of 4 products u8 x s8 into int32 lanes: one vpdpbusd, else
// vpmaddubsw + vpmaddwd (the pairs cannot saturate int16 here: |w|, |x| <= 127).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SIMD_PATH_AVX2 4
#define DPWSSD256(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#define DPBUSD256(a, b) _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
#define DPBUSD256_ACC(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define SIMD_PATH_AVX2 3
#define DPWSSD256(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#define DPBUSD256(a, b) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b)
#define DPBUSD256_ACC(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#else
#define SIMD_PATH_AVX2 2
#define DPWSSD256(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define DPBUSD256(a, b) _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
#define DPBUSD256_ACC(acc, a, b) _mm256_add_epi32(acc, DPBUSD256(a, b))
#endif

ALWAYS_INLINE float hsum_lanes(__m256 v) {
    float a[LANES];
    _mm256_storeu_ps(a, v);
    return lanes_total(a);
}

// Byte masks for vpshufb: broadcast int16 element j of a 128-bit lane to all 8 places.
static const uint8_t SPREAD16[8][32] __attribute__((aligned(32))) = {
#define S16(j) {2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1}
    S16(0), S16(1), S16(2), S16(3), S16(4), S16(5), S16(6), S16(7)
#undef S16
};
#define SPREAD(j) _mm256_load_si256((const __m256i *)SPREAD16[j])
// ... and element 2j of the low lane to the low lane, element 2j+1 to the high lane.
static const uint8_t SPREAD_PAIR[4][32] __attribute__((aligned(32))) = {
#define S6(j) {4 * j, 4 * j + 1, 4 * j, 4 * j + 1, 4 * j, 4 * j + 1, 4 * j, 4 * j + 1, \
               4 * j, 4 * j + 1, 4 * j, 4 * j + 1, 4 * j, 4 * j + 1, 4 * j, 4 * j + 1, \
               4 * j + 2, 4 * j + 3, 4 * j + 2, 4 * j + 3, 4 * j + 2, 4 * j + 3, 4 * j + 2, 4 * j + 3, \
               4 * j + 2, 4 * j + 3, 4 * j + 2, 4 * j + 3, 4 * j + 2, 4 * j + 3, 4 * j + 2, 4 * j + 3}
    S6(0), S6(1), S6(2), S6(3)
#undef S6
};
#define SPREAD6(j) _mm256_load_si256((const __m256i *)SPREAD_PAIR[j])

// Lane i: the total of the i-th argument's 8 int32 lanes (exact).
ALWAYS_INLINE __m256i tree8(__m256i a, __m256i b, __m256i c, __m256i d, __m256i e, __m256i f,
                            __m256i g, __m256i h) {
    const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(e, f), _mm256_hadd_epi32(g, h));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                            _mm256_permute2x128_si256(ab, cd, 0x31));
}

// The totals of s[r]'s 8 int32 lanes (exact) for r < R, in lane r (lanes past R are
// never stored).
ALWAYS_INLINE __m256i lane_totals1(const __m256i *s, const int R) {
    if (R == 1) {
        const __m256i h = _mm256_hadd_epi32(s[0], s[0]);
        const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        return _mm256_castsi128_si256(_mm_hadd_epi32(t, t));
    }
    const __m256i z = _mm256_setzero_si256();
#define S(i) ((i) < R ? s[i] : z)
    if (R <= 4) {  // half a tree: the 4 totals in the low 128 bits
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(S(0), S(1)), _mm256_hadd_epi32(S(2), S(3)));
        const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        return _mm256_castsi128_si256(t);
    }
    return tree8(S(0), S(1), S(2), S(3), S(4), S(5), S(6), S(7));
#undef S
}

// The totals of s[r]'s and m[r]'s 8 int32 lanes (exact) for r < R: lane r of *st
// and of *mt. One reduction tree carries both while R <= 4.
ALWAYS_INLINE void lane_totals(const __m256i *s, const __m256i *m, const int R, __m256i *st,
                               __m256i *mt) {
    const __m256i z = _mm256_setzero_si256();
    if (R == 1) {  // [S, M, S, M] in the low 128 bits, spread to lane 0 of each
        const __m256i h = _mm256_hadd_epi32(s[0], m[0]);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        t = _mm_hadd_epi32(t, t);
        *st = _mm256_castsi128_si256(t);
        *mt = _mm256_castsi128_si256(_mm_shuffle_epi32(t, 1));
        return;
    }
#define S(i) ((i) < R ? s[i] : z)
#define M(i) ((i) < R ? m[i] : z)
    if (R <= 4) {
        const __m256i both = tree8(S(0), S(1), S(2), S(3), M(0), M(1), M(2), M(3));
        *st = both;
        *mt = _mm256_permute2x128_si256(both, both, 0x11);
    } else {
        *st = lane_totals1(s, R);
        *mt = lane_totals1(m, R);
    }
#undef S
#undef M
}

// The activation scales of rows 0..R-1 for block b, lane r = dx[r * ndx + b].
ALWAYS_INLINE __m256 row_scales(const float *dx, int64_t ndx, int64_t b, const int R) {
    if (R == 1) return _mm256_set1_ps(dx[b]);  // lanes past R are never stored
#define X(r) ((r) < R ? dx[(r) * ndx + b] : 0.0f)
    return _mm256_setr_ps(X(0), X(1), X(2), X(3), X(4), X(5), X(6), X(7));
#undef X
}

// The activation side of one group of 2..8 rows, per 256-value block with the rows in
// the lanes, built once per call (row_lanes_build): the rows' scales for the float
// steps, and their sub-block sums as int16 pairs, so that from 5 rows the K-quants'
// offset totals (Q4_K's mins, Q6_K's -32s) come out in the row lanes with one vpdpwssd
// per pair of sub-blocks instead of a second reduction tree and a multiply per row
// (5 rows cost 1.25x 4 rows in the 1.5B target's forward before). The same integers.
typedef struct {
    float dx[8];         // lane r: row r's activation scale (0 past the group's rows)
    int32_t s32[4][8];   // [pair p][row]: 32-value sums 2p, 2p + 1 (int16 pair)
    int32_t s16[8][8];   // [pair p][row]: 16-value sums 2p, 2p + 1 (int16 pair)
} row_lanes;
enum { LANES_MIN_ROWS = 5 };  // from here the offsets in lanes; below, per-row multiplies

static inline int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// One block's 16-value sums bs[0..15] as the int16 pair of 32-value sums 2p, 2p + 1 (a
// 32-value sum, |.| <= 32 x 127, fits an int16): the operand the Q4_K mins pair with.
static inline int32_t sums32_pair(const int16_t *bs, int p) {
    return (int32_t)((uint32_t)(uint16_t)(bs[4 * p + 2] + bs[4 * p + 3]) << 16 |
                     (uint16_t)(bs[4 * p] + bs[4 * p + 1]));
}

static void row_lanes_build(const float *dx, const int16_t *bsum, int64_t K, int R,
                            row_lanes *L) {
    const int64_t nb = K / QK_K, nbs = K / 16;
    memset(L, 0, (size_t)nb * sizeof *L);
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < R; r++) {
            const int16_t *bs = bsum + r * nbs + b * 16;
            L[b].dx[r] = dx[r * nb + b];
            for (int p = 0; p < 8; p++) L[b].s16[p][r] = load_i32(bs + 2 * p);
            for (int p = 0; p < 4; p++) L[b].s32[p][r] = sums32_pair(bs, p);
        }
}

// The rows' scales of block b: from the lanes where built, else gathered.
ALWAYS_INLINE __m256 block_scales(const row_lanes *L, const float *dx, int64_t ndx, int64_t b,
                                  const int R) {
    return R > 1 && L ? _mm256_load_ps(L[b].dx) : row_scales(dx, ndx, b, R);
}

ALWAYS_INLINE void q4k_rows_avx2(const block_q4_K *w, int64_t nb, const int ROWS,
                                 const int8_t *q, int64_t K, const float *dx,
                                 const int16_t *bsum, const row_lanes *L, float *out,
                                 int64_t ldo) {
    const int lanes = ROWS >= LANES_MIN_ROWS && L;
    __m256 acc = _mm256_setzero_ps();  // lane r: activation row r
    const __m256i low4 = _mm256_set1_epi8(0xF);
    const int64_t ndx = K / QK_K, nbs = K / 16;
    for (int64_t b = 0; b < nb; b++) {
        uint32_t u[4];
        q4k_scale_words(w[b].scales, u);
        // scales as int16 in both 128-bit lanes (one vpshufb broadcasts one), and the
        // mins as int16 pairs (m0,m0,m1,m1,...): one vpmaddwd with the 16 bsums
        const __m128i sm8 = _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm8));
        const __m128i mn8 = _mm_unpackhi_epi64(sm8, sm8);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
        __m256i s32[MAX_ROWS], m32[MAX_ROWS];
        for (int r = 0; r < ROWS; r++) s32[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(w[b].qs + 32 * c));
            const __m256i lo = _mm256_and_si256(bits, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
            const __m256i sclo = _mm256_shuffle_epi8(scales, SPREAD(2 * c));
            const __m256i schi = _mm256_shuffle_epi8(scales, SPREAD(2 * c + 1));
            for (int r = 0; r < ROWS; r++) {
                const int8_t *x = q + r * K + b * QK_K + 64 * c;
                s32[r] = DPWSSD256(
                    s32[r], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)), sclo);
                s32[r] = DPWSSD256(
                    s32[r], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))), schi);
            }
        }
        const __m256 xs = block_scales(L, dx, ndx, b, ROWS);
        const __m256 d = _mm256_set1_ps(half_to_float(w[b].d));
        const __m256 dmin = _mm256_set1_ps(half_to_float(w[b].dmin));
        __m256i st, mt;
        if (lanes) {  // the mins' pairs (words m0..m7 as dwords) against the rows' sums
            const __m256i mp = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(mn8));
            mt = _mm256_setzero_si256();
            mt = DPWSSD256(mt, _mm256_shuffle_epi32(mp, 0x00), _mm256_load_si256((const __m256i *)L[b].s32[0]));
            mt = DPWSSD256(mt, _mm256_shuffle_epi32(mp, 0x55), _mm256_load_si256((const __m256i *)L[b].s32[1]));
            mt = DPWSSD256(mt, _mm256_shuffle_epi32(mp, 0xAA), _mm256_load_si256((const __m256i *)L[b].s32[2]));
            mt = DPWSSD256(mt, _mm256_shuffle_epi32(mp, 0xFF), _mm256_load_si256((const __m256i *)L[b].s32[3]));
            st = lane_totals1(s32, ROWS);
        } else {
            for (int r = 0; r < ROWS; r++)
                m32[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(bsum + r * nbs + b * 16)), mins);
            lane_totals(s32, m32, ROWS, &st, &mt);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st), _mm256_mul_ps(xs, d), acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mt), _mm256_mul_ps(xs, dmin), acc);
    }
    float a[LANES];
    _mm256_storeu_ps(a, acc);
    for (int r = 0; r < ROWS; r++) out[r * ldo] = a[r];
}

ALWAYS_INLINE void q6k_rows_avx2(const block_q6_K *w, int64_t nb, const int ROWS,
                                 const int8_t *q, int64_t K, const float *dx,
                                 const int16_t *bsum, const row_lanes *L, float *out,
                                 int64_t ldo) {
    const int lanes = ROWS >= LANES_MIN_ROWS && L;
    __m256 acc = _mm256_setzero_ps();  // lane r: activation row r
    const __m256i low4 = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
    const int64_t ndx = K / QK_K, nbs = K / 16;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w[b].scales));
        __m256i s32[MAX_ROWS];
        for (int r = 0; r < ROWS; r++) s32[r] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w[b].ql + 64 * h, *qh = w[b].qh + 32 * h;
            const __m256i a = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i bb = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            __m256i v[4], scv[4];
            v[0] = _mm256_or_si256(_mm256_and_si256(a, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
            v[1] = _mm256_or_si256(_mm256_and_si256(bb, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bb, 4), low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4));
            // values 0-15 of part j use sc[2j], 16-31 sc[2j+1]: one vpshufb of this half's scales
            const __m256i sch = h ? _mm256_permute2x128_si256(scales16, scales16, 0x11)
                                  : _mm256_permute2x128_si256(scales16, scales16, 0x00);
            for (int j = 0; j < 4; j++) scv[j] = _mm256_shuffle_epi8(sch, SPREAD6(j));
            for (int r = 0; r < ROWS; r++) {
                const int8_t *x = q + r * K + b * QK_K + 128 * h;
                for (int j = 0; j < 4; j++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
                    s32[r] = DPWSSD256(s32[r], _mm256_maddubs_epi16(v[j], xv), scv[j]);
                }
            }
        }
        __m256i st;
        if (lanes) {  // the scales' pairs against the rows' 16-value sums: the -32 offsets
            __m256i ot = _mm256_setzero_si256();
            for (int p = 0; p < 8; p++)
                ot = DPWSSD256(ot, _mm256_permutevar8x32_epi32(scales16, _mm256_set1_epi32(p)),
                               _mm256_load_si256((const __m256i *)L[b].s16[p]));
            st = _mm256_sub_epi32(lane_totals1(s32, ROWS), _mm256_slli_epi32(ot, 5));
        } else {
            for (int r = 0; r < ROWS; r++) {
                const __m256i bs = _mm256_loadu_si256((const __m256i *)(bsum + r * nbs + b * 16));
                const __m256i o32 = _mm256_madd_epi16(bs, scales16);  // the -32 offsets
                s32[r] = _mm256_sub_epi32(s32[r], _mm256_slli_epi32(o32, 5));
            }
            st = lane_totals1(s32, ROWS);
        }
        const __m256 dd = _mm256_mul_ps(block_scales(L, dx, ndx, b, ROWS), _mm256_set1_ps(half_to_float(w[b].d)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st), dd, acc);
    }
    float a[LANES];
    _mm256_storeu_ps(a, acc);
    for (int r = 0; r < ROWS; r++) out[r * ldo] = a[r];
}

ALWAYS_INLINE void q80_rows_avx2(const block_q8_0 *w, int64_t nb, const int ROWS,
                                 const int8_t *q, int64_t K, const float *dx, float *out,
                                 int64_t ldo) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    const int64_t ndx = K / QK8_0;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)w[b].qs);
        const __m256i aw = _mm256_sign_epi8(wv, wv);  // |w| as u8 (w >= -127 in Q8_0)
        const float d = half_to_float(w[b].d);
        for (int r = 0; r < ROWS; r++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(q + r * K + b * QK8_0));
            const __m256i p = DPBUSD256(aw, _mm256_sign_epi8(xv, wv));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dx[r * ndx + b] * d), acc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) out[r * ldo] = hsum_lanes(acc[r]);
}

// fn(..., R) with R the compile-time constant 1..8 equal to `rows` (rows or heads)
#define BY_ROWS(fn, rows, ...)                   \
    switch (rows) {                              \
        case 8: fn(__VA_ARGS__, 8); break;       \
        case 7: fn(__VA_ARGS__, 7); break;       \
        case 6: fn(__VA_ARGS__, 6); break;       \
        case 5: fn(__VA_ARGS__, 5); break;       \
        case 4: fn(__VA_ARGS__, 4); break;       \
        case 3: fn(__VA_ARGS__, 3); break;       \
        case 2: fn(__VA_ARGS__, 2); break;       \
        default: fn(__VA_ARGS__, 1); break;      \
    }

// fn(..., T) with T the compile-time constant 1..6 equal to `tokens` (the activation rows
// of one panel pass: PANEL_TOKENS, X16_TOKENS)
#define BY_TOKENS(fn, tokens, ...)               \
    switch (tokens) {                            \
        case 6: fn(__VA_ARGS__, 6); break;       \
        case 5: fn(__VA_ARGS__, 5); break;       \
        case 4: fn(__VA_ARGS__, 4); break;       \
        case 3: fn(__VA_ARGS__, 3); break;       \
        case 2: fn(__VA_ARGS__, 2); break;       \
        default: fn(__VA_ARGS__, 1); break;      \
    }

static void q4k_avx2(const block_q4_K *w, int64_t nb, int rows, const int8_t *q, int64_t K,
                     const float *dx, const int16_t *bsum, const row_lanes *L, float *out,
                     int64_t ldo) {
#define Q4K(w_, nb_, q_, K_, dx_, bs_, L_, out_, ldo_, R) q4k_rows_avx2(w_, nb_, R, q_, K_, dx_, bs_, L_, out_, ldo_)
    BY_ROWS(Q4K, rows, w, nb, q, K, dx, bsum, L, out, ldo)
}
static void q6k_avx2(const block_q6_K *w, int64_t nb, int rows, const int8_t *q, int64_t K,
                     const float *dx, const int16_t *bsum, const row_lanes *L, float *out,
                     int64_t ldo) {
#define Q6K(w_, nb_, q_, K_, dx_, bs_, L_, out_, ldo_, R) q6k_rows_avx2(w_, nb_, R, q_, K_, dx_, bs_, L_, out_, ldo_)
    BY_ROWS(Q6K, rows, w, nb, q, K, dx, bsum, L, out, ldo)
}
static void q80_avx2(const block_q8_0 *w, int64_t nb, int rows, const int8_t *q, int64_t K,
                     const float *dx, float *out, int64_t ldo) {
#define Q80(w_, nb_, q_, K_, dx_, out_, ldo_, R) q80_rows_avx2(w_, nb_, R, q_, K_, dx_, out_, ldo_)
    BY_ROWS(Q80, rows, w, nb, q, K, dx, out, ldo)
}

// ---------------------------------------------------------------- K-quant panels
// Many activation rows (prefill, batched verification): 8 weight rows are unpacked once
// per call into a panel with the weight rows in the lanes (llama.cpp's repacked-Q4_K
// idea, built on the fly so the weights keep the file's layout and size), and
// PANEL_TOKENS activation rows at a time run over it with one vpdpbusd per 4 values x 8
// weight rows; a sub-block's scale is applied once per sub-block (vpmulld), where the
// row path needs a second multiply per 32 values. The integers and the float steps per
// output are the order above, so the bits are those of the row path. On a 2-core Xeon
// (AVX512-VNNI): Q4_K 194-225 -> 390-425 GOP/s at 256 rows, Q6_K 210 -> 395.
// PANEL_MIN_M: from this many activation rows the panels take over. A lone 8960x1536
// Q4_K gains from 8 rows on (0.94 vs 1.05 ms), but the 1.5B target's whole forward,
// with its narrow k/v projections and the panels' repacking, is as fast or faster on
// the row path up to 12 rows (8 rows: 145 vs 166 ms; 12 rows: 207 vs 210 ms).
enum { PANEL_ROWS = 8, PANEL_TOKENS = 6, PANEL_MIN_M = 16 };

typedef struct {
    uint8_t w[8][8][PANEL_ROWS][4];  // [sub-block][4-value group][weight row]: values 0..15
    int32_t sc[8][PANEL_ROWS];       // sub-block scales
    int16_t mn[8][PANEL_ROWS][2];    // sub-block mins, twice (pairs for vpdpwssd)
    float d[PANEL_ROWS], dmin[PANEL_ROWS];
} q4k_panel;

// 32 values of 8 weight rows (a[r]) -> o[g] = values 4g..4g+3 of rows 0..7 (an 8x8
// transpose of 4-byte groups).
ALWAYS_INLINE void transpose_groups(const __m256i *a, __m256i *o) {
    const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(a[4], a[5]), t5 = _mm256_unpackhi_epi32(a[4], a[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(a[6], a[7]), t7 = _mm256_unpackhi_epi32(a[6], a[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    _mm256_store_si256(o + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
    _mm256_store_si256(o + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
    _mm256_store_si256(o + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
    _mm256_store_si256(o + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
    _mm256_store_si256(o + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
    _mm256_store_si256(o + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
    _mm256_store_si256(o + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
    _mm256_store_si256(o + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
}

// s[t] += sc x (the dot of `groups` 4-value groups w[0..groups-1] of the panel's 8
// weight rows with activation row t's values from x + t * K), for t < T: one vpdpbusd
// per group and row, one vpmulld per row for the sub-block's scale.
ALWAYS_INLINE void add_scaled_dots(const uint8_t (*w)[PANEL_ROWS][4], const int groups,
                                   const int8_t *x, int64_t K, const int T, __m256i sc,
                                   __m256i *s) {
    __m256i dot[PANEL_TOKENS];
    for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
    for (int g = 0; g < groups; g++) {
        const __m256i wv = _mm256_load_si256((const __m256i *)w[g]);
        for (int t = 0; t < T; t++)
            dot[t] = DPBUSD256_ACC(dot[t], wv, _mm256_set1_epi32(load_i32(x + t * K + 4 * g)));
    }
    for (int t = 0; t < T; t++) s[t] = _mm256_add_epi32(s[t], _mm256_mullo_epi32(dot[t], sc));
}

// Weight rows w[0..nr-1] (nr <= 8, row stride row_bytes; the rest zero) -> nb panels.
static void q4k_pack_panel(const uint8_t *w, int64_t row_bytes, int nr, int64_t nb,
                           q4k_panel *p) {
    const __m256i low4 = _mm256_set1_epi8(0xF);
    for (int64_t b = 0; b < nb; b++) {
        q4k_panel *pb = p + b;
        __m256i v[8][PANEL_ROWS];  // [sub-block][row]: 32 values
        for (int r = 0; r < PANEL_ROWS; r++) {
            if (r >= nr) {
                for (int sb = 0; sb < 8; sb++) v[sb][r] = _mm256_setzero_si256();
                for (int sb = 0; sb < 8; sb++) pb->sc[sb][r] = pb->mn[sb][r][0] = pb->mn[sb][r][1] = 0;
                pb->d[r] = pb->dmin[r] = 0.0f;
                continue;
            }
            const block_q4_K *x = (const block_q4_K *)(w + r * row_bytes) + b;
            for (int c = 0; c < 4; c++) {
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
                v[2 * c][r] = _mm256_and_si256(bits, low4);
                v[2 * c + 1][r] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
            }
            uint8_t sc[8], mn[8];
            q4k_scales(x->scales, sc, mn);
            for (int sb = 0; sb < 8; sb++) {
                pb->sc[sb][r] = sc[sb];
                pb->mn[sb][r][0] = pb->mn[sb][r][1] = mn[sb];
            }
            pb->d[r] = half_to_float(x->d);
            pb->dmin[r] = half_to_float(x->dmin);
        }
        for (int sb = 0; sb < 8; sb++) transpose_groups(v[sb], (__m256i *)pb->w[sb]);
    }
}

// Q6_K the same way: 16 sub-blocks of 16 values (0..63), one vpmulld per 16 values.
typedef struct {
    uint8_t w[16][4][PANEL_ROWS][4];  // [sub-block][4-value group][weight row]
    int32_t sc[16][PANEL_ROWS];       // sub-block scales
    int16_t sc2[8][PANEL_ROWS][2];    // scales in pairs (2p, 2p+1) for the offsets' vpdpwssd
    float d[PANEL_ROWS];
} q6k_panel;

static void q6k_pack_panel(const uint8_t *w, int64_t row_bytes, int nr, int64_t nb,
                           q6k_panel *p) {
    const __m256i low4 = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nb; b++) {
        q6k_panel *pb = p + b;
        __m256i v[8][PANEL_ROWS];  // [32-value chunk][row]
        for (int r = 0; r < PANEL_ROWS; r++) {
            if (r >= nr) {
                for (int k = 0; k < 8; k++) v[k][r] = _mm256_setzero_si256();
                for (int sb = 0; sb < 16; sb++) pb->sc[sb][r] = pb->sc2[sb / 2][r][sb % 2] = 0;
                pb->d[r] = 0.0f;
                continue;
            }
            const block_q6_K *x = (const block_q6_K *)(w + r * row_bytes) + b;
            for (int h = 0; h < 2; h++) {
                const __m256i a = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
                const __m256i bb = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
                __m256i *o = &v[4 * h][0];
                o[0 * PANEL_ROWS + r] = _mm256_or_si256(
                    _mm256_and_si256(a, low4), _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
                o[1 * PANEL_ROWS + r] = _mm256_or_si256(
                    _mm256_and_si256(bb, low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
                o[2 * PANEL_ROWS + r] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
                o[3 * PANEL_ROWS + r] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(bb, 4), low4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4));
            }
            for (int sb = 0; sb < 16; sb++) pb->sc[sb][r] = pb->sc2[sb / 2][r][sb % 2] = x->scales[sb];
            pb->d[r] = half_to_float(x->d);
        }
        // chunk k's group j is value group 8k + j: sub-block 2k + j / 4, group j % 4
        for (int k = 0; k < 8; k++) transpose_groups(v[k], (__m256i *)pb->w[2 * k]);
    }
}

ALWAYS_INLINE void q6k_panel_rows(const q6k_panel *p, int64_t nb, const int T, const int8_t *q,
                                  int64_t K, const float *dx, const int16_t *bsum, float *out) {
    const int64_t ndx = K / QK_K, nbs = K / 16;
    __m256 acc[PANEL_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q6k_panel *pb = p + b;
        __m256i s[PANEL_TOKENS], o[PANEL_TOKENS];
        for (int t = 0; t < T; t++) s[t] = o[t] = _mm256_setzero_si256();
        for (int sb = 0; sb < 16; sb++)
            add_scaled_dots(pb->w[sb], 4, q + b * QK_K + 16 * sb, K, T,
                            _mm256_load_si256((const __m256i *)pb->sc[sb]), s);
        for (int pr = 0; pr < 8; pr++) {
            const __m256i sc2 = _mm256_load_si256((const __m256i *)pb->sc2[pr]);
            for (int t = 0; t < T; t++)
                o[t] = DPWSSD256(o[t], sc2, _mm256_set1_epi32(load_i32(bsum + t * nbs + b * 16 + 2 * pr)));
        }
        const __m256 d = _mm256_load_ps(pb->d);
        for (int t = 0; t < T; t++) {
            const __m256i st = _mm256_sub_epi32(s[t], _mm256_slli_epi32(o[t], 5));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st),
                                     _mm256_mul_ps(_mm256_set1_ps(dx[t * ndx + b]), d), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + t * PANEL_ROWS, acc[t]);
}

// T (compile-time 1..PANEL_TOKENS) activation rows against a panel: out[t * 8 + lane].
ALWAYS_INLINE void q4k_panel_rows(const q4k_panel *p, int64_t nb, const int T, const int8_t *q,
                                  int64_t K, const float *dx, const int16_t *bsum, float *out) {
    const int64_t ndx = K / QK_K, nbs = K / 16;
    __m256 acc[PANEL_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q4k_panel *pb = p + b;
        __m256i s[PANEL_TOKENS], m[PANEL_TOKENS];
        for (int t = 0; t < T; t++) s[t] = m[t] = _mm256_setzero_si256();
        for (int sb = 0; sb < 8; sb++) {
            add_scaled_dots(pb->w[sb], 8, q + b * QK_K + 32 * sb, K, T,
                            _mm256_load_si256((const __m256i *)pb->sc[sb]), s);
            const __m256i mn = _mm256_load_si256((const __m256i *)pb->mn[sb]);
            for (int t = 0; t < T; t++)
                m[t] = DPWSSD256(m[t], mn, _mm256_set1_epi32(load_i32(bsum + t * nbs + b * 16 + 2 * sb)));
        }
        const __m256 d = _mm256_load_ps(pb->d), dmin = _mm256_load_ps(pb->dmin);
        for (int t = 0; t < T; t++) {
            const __m256 xs = _mm256_set1_ps(dx[t * ndx + b]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_mul_ps(xs, d), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m[t]), _mm256_mul_ps(xs, dmin), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + t * PANEL_ROWS, acc[t]);
}

// A panel of `type` (Q4_K or Q6_K) against T <= PANEL_TOKENS activation rows.
static void panel_tokens(int type, const void *p, int64_t nb, int T, const int8_t *q, int64_t K,
                         const float *dx, const int16_t *bsum, float *out) {
#define P4(p_, nb_, q_, K_, dx_, bs_, out_, R) q4k_panel_rows(p_, nb_, R, q_, K_, dx_, bs_, out_)
#define P6(p_, nb_, q_, K_, dx_, bs_, out_, R) q6k_panel_rows(p_, nb_, R, q_, K_, dx_, bs_, out_)
    _Static_assert(PANEL_TOKENS == 6, "BY_TOKENS has a case for each count");
    if (type == TYPE_Q4_K) {
        BY_TOKENS(P4, T, (const q4k_panel *)p, nb, q, K, dx, bsum, out)
    } else {
        BY_TOKENS(P6, T, (const q6k_panel *)p, nb, q, K, dx, bsum, out)
    }
#undef P4
#undef P6
}
#endif

#if defined(__AMX_INT8__) && defined(__AVX512F__)
#define AMX_PATH 5  // simd_path() where the tiles run (the AMX section below)
static int amx_usable(void);
#endif
int simd_path(void) {
#if defined(AMX_PATH)
    if (amx_usable()) return AMX_PATH;  // else this build runs as the VNNI one
#endif
#if defined(__AVX2__)
    return SIMD_PATH_AVX2;
#else
    return 0;
#endif
}

// One weight row against `rows` (<= ROW_GROUP) activation rows; out[r * ldo]. lanes:
// the group's row_lanes (AVX2 builds, K-quants) or NULL.
static void weight_row(int type, const uint8_t *wrow, int64_t K, int rows, const int8_t *q,
                       const float *dx, const int16_t *bsum, const void *lanes, float *out,
                       int64_t ldo, int scalar) {
    const int64_t nb = K / block_values(type), ndx = K / activation_block(type);
#if defined(__AVX2__)
    if (!scalar) {
        switch (type) {
            case TYPE_Q4_K: q4k_avx2((const block_q4_K *)wrow, nb, rows, q, K, dx, bsum, lanes, out, ldo); return;
            case TYPE_Q6_K: q6k_avx2((const block_q6_K *)wrow, nb, rows, q, K, dx, bsum, lanes, out, ldo); return;
            case TYPE_Q8_0: q80_avx2((const block_q8_0 *)wrow, nb, rows, q, K, dx, out, ldo); return;
        }
    }
#endif
    (void)scalar;
    (void)lanes;
    for (int r = 0; r < rows; r++) {
        const int8_t *qr = q + r * K;
        const float *dr = dx + r * ndx;
        const int16_t *br = bsum + r * (K / 16);
        switch (type) {
            case TYPE_Q4_K: q4k_row_scalar((const block_q4_K *)wrow, nb, qr, dr, br, out + r * ldo); break;
            case TYPE_Q6_K: q6k_row_scalar((const block_q6_K *)wrow, nb, qr, dr, br, out + r * ldo); break;
            case TYPE_Q8_0: q80_row_scalar((const block_q8_0 *)wrow, nb, qr, dr, out + r * ldo); break;
        }
    }
}

// One weight matrix of a call: N rows of GGUF blocks of `type` (row_bytes each), an
// optional float32 bias added to every output (one float add, as torch's y += bias).
typedef struct {
    int32_t type, reserved;
    const uint8_t *w;
    int64_t N, row_bytes;
    const float *bias;
} gguf_weight;

static int weight_fits(const gguf_weight *wt, int64_t K) {
    const int bv = block_values(wt->type);
    return bv && K % bv == 0 && K % activation_block(wt->type) == 0 &&
           wt->row_bytes == K / bv * block_bytes(wt->type) &&
           (!is_x8(wt->type) || wt->N % 8 == 0);
}

// y[i] = v (+ bias, one float add) as float32 (y_bf16 == 0) or rounded to bfloat16.
static inline void put_output(void *y, int y_bf16, int64_t i, float v, const float *bias) {
    if (bias) v = v + *bias;
    if (y_bf16)
        ((uint16_t *)y)[i] = float_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

#if defined(__AVX2__)
// put_output for the 8 outputs y[i .. i + 7] (bias: 8 floats or NULL) with the same
// float add and the same rounding, 8 at a time: at hundreds of activation rows the
// per-value stores took a fifth of a Q4_K product on the tiles.
ALWAYS_INLINE void put_outputs8(void *y, int y_bf16, int64_t i, __m256 v, const float *bias) {
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    if (!y_bf16) {
        _mm256_storeu_ps((float *)y + i, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    h = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7fc0), nan);
    // 8 int32 <= 0xffff -> 8 uint16: packs work per 128-bit lane, then the two halves meet
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + i), _mm256_castsi256_si128(packed));
}
#endif

#if defined(__AVX2__)
// weight_rows for Q4_K and Q6_K by panels of 8 weight rows (all M activation rows per
// panel). Returns 0 when there is no memory for a panel (the caller takes the row path).
static int rows_by_panels(const gguf_weight *wt, int64_t n0, int64_t n1, int64_t K, int64_t M,
                          const int8_t *q, const float *dx, const int16_t *bsum, void *y,
                          int64_t ldy, int y_bf16) {
    const int64_t nb = K / QK_K, nbs = K / 16;
    const int q4 = wt->type == TYPE_Q4_K;
    void *p = aligned_alloc(32, (size_t)nb * (q4 ? sizeof(q4k_panel) : sizeof(q6k_panel)));
    if (!p) return 0;
    float out[PANEL_TOKENS * PANEL_ROWS];
    for (int64_t n = n0; n < n1; n += PANEL_ROWS) {
        const int nr = (int)(n1 - n < PANEL_ROWS ? n1 - n : PANEL_ROWS);
        const uint8_t *w = wt->w + n * wt->row_bytes;
        if (q4)
            q4k_pack_panel(w, wt->row_bytes, nr, nb, p);
        else
            q6k_pack_panel(w, wt->row_bytes, nr, nb, p);
        for (int64_t m = 0; m < M; m += PANEL_TOKENS) {
            const int T = (int)(M - m < PANEL_TOKENS ? M - m : PANEL_TOKENS);
            panel_tokens(wt->type, p, nb, T, q + m * K, K, dx + m * nb, bsum + m * nbs, out);
            for (int t = 0; t < T; t++) {
                if (nr == PANEL_ROWS) {
                    put_outputs8(y, y_bf16, (m + t) * ldy + n, _mm256_loadu_ps(out + t * PANEL_ROWS),
                                 wt->bias ? wt->bias + n : NULL);
                    continue;
                }
                for (int r = 0; r < nr; r++)
                    put_output(y, y_bf16, (m + t) * ldy + n + r, out[t * PANEL_ROWS + r],
                               wt->bias ? wt->bias + n + r : NULL);
            }
        }
    }
    free(p);
    return 1;
}

// ------------------------------------------- resident panels (Q4_K_X8, Q6_K_X8)
// The K-quant panels above, kept: a Q4_K or Q6_K target's weights are repacked once at
// load into 8-row panels with the bits still packed (q4k_x8: 1184 B per 8 x 256 values
// against 1152 in the file; q6k_x8: 1680 B, the file's size), so every product, from
// one activation row on, runs one vpdpbusd per 4 values x 8 weight rows and one vpmulld
// per sub-block for 8 weight rows, where the row path spends a vpmaddubsw and a
// vpdpwssd per 32 values and row. The integers and the float steps per output are
// q4k_row_scalar's and q6k_row_scalar's, so the bits are those of every other path. On
// a 2-core AMD EPYC Zen 4: an 8960x1536 Q4_K from cache 1 row 0.20 -> 0.08 ms, 3 rows
// 0.31 -> 0.15, 8 rows 0.56 -> 0.34; a 1536x8960 Q6_K from memory 1 / 3 / 5 / 8 rows
// 0.25 / 0.35 / 0.52 / 0.76 -> 0.19 / 0.25 / 0.30 / 0.45 ms, the 151936x1536 Q6_K head
// 4.6 / 5.2 / 7.3 / 10.5 -> 4.3 / 4.4 / 4.6 / 7.4 ms.
enum { X8_TOKENS = 8 };
// Each panel block asks for the block X8_PREFETCH_BYTES ahead: the hardware's prefetch
// alone left the stream short (the 1.5B target's forward at 1 / 3 / 5 / 8 rows on a
// 2-core Zen 4, min of 8 alternated: 2 KB ahead 29.0 / 31.2 / 37.9 / 53.4 ms, 6 KB 26.7 /
// 27.8 / 34.3 / 49.3, 8 KB 26.4 / 26.9 / 33.2 / 50.1; a Q6_K head alone was at 0.6x the
// row path's speed without it).
enum { X8_PREFETCH_BYTES = 6144 };

// A panel block's bytes X8_PREFETCH_BYTES ahead (past a weight's end: prefetches do not fault).
#define PREFETCH_AHEAD(pb)                                  \
    for (int i_ = 0; i_ < (int)sizeof *(pb); i_ += 64)      \
        _mm_prefetch((const char *)(pb) + X8_PREFETCH_BYTES + i_, _MM_HINT_T0);

// T (compile-time 1..8) activation rows against a run of nb panels: out[t * 8 + row].
ALWAYS_INLINE void q4k_x8_rows(const q4k_x8 *p, int64_t nb, const int T, const int8_t *q,
                               int64_t K, const float *dx, const int16_t *bsum, float *out) {
    const int64_t ndx = K / QK_K, nbs = K / 16;
    const __m256i low4 = _mm256_set1_epi8(0xF);
    __m256 acc[X8_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q4k_x8 *pb = p + b;
        PREFETCH_AHEAD(pb)
        __m256i s[X8_TOKENS], m[X8_TOKENS];
        for (int t = 0; t < T; t++) s[t] = m[t] = _mm256_setzero_si256();
        for (int sb = 0; sb < 8; sb++) {
            __m256i dot[X8_TOKENS];
            for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
            for (int gp = 0; gp < 4; gp++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)pb->qs[sb][gp]);
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int t = 0; t < T; t++) {
                    const int8_t *x = q + t * K + b * QK_K + 32 * sb + 4 * gp;
                    dot[t] = DPBUSD256_ACC(dot[t], lo, _mm256_set1_epi32(load_i32(x)));
                    dot[t] = DPBUSD256_ACC(dot[t], hi, _mm256_set1_epi32(load_i32(x + 16)));
                }
            }
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)pb->sc[sb]));
            const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)pb->mn[sb]));
            const __m256i mn2 = _mm256_or_si256(mn, _mm256_slli_epi32(mn, 16));  // (m, m) pairs
            for (int t = 0; t < T; t++) {
                s[t] = _mm256_add_epi32(s[t], _mm256_mullo_epi32(dot[t], sc));
                m[t] = DPWSSD256(m[t], mn2, _mm256_set1_epi32(load_i32(bsum + t * nbs + b * 16 + 2 * sb)));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb->d));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb->dmin));
        for (int t = 0; t < T; t++) {
            const __m256 xs = _mm256_set1_ps(dx[t * ndx + b]);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), _mm256_mul_ps(xs, d), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m[t]), _mm256_mul_ps(xs, dmin), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + t * 8, acc[t]);
}

// The same for Q6_K_X8: per 16-value sub-block the low nibbles and high bits of 4 groups
// x 8 weight rows are joined (the Q6_K row path's shifts and masks), then one vpdpbusd
// per group and activation row and one vpmulld for the sub-block's scale; the -32
// offsets come from the scales' pairs against the rows' 16-value sums (one vpdpwssd per
// pair of sub-blocks), as in q6k_row_scalar: S = sum sc x dot - 32 x sum sc x bsum.
ALWAYS_INLINE void q6k_x8_rows(const q6k_x8 *p, int64_t nb, const int T, const int8_t *q,
                               int64_t K, const float *dx, const int16_t *bsum, float *out) {
    const int64_t ndx = K / QK_K, nbs = K / 16;
    const __m256i low4 = _mm256_set1_epi8(0xF), high2 = _mm256_set1_epi8(0x30);
    __m256 acc[X8_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q6k_x8 *pb = p + b;
        PREFETCH_AHEAD(pb)
        __m256i s[X8_TOKENS], o[X8_TOKENS];
        for (int t = 0; t < T; t++) s[t] = o[t] = _mm256_setzero_si256();
        for (int pr = 0; pr < 8; pr++) {
            const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)pb->sc[pr]));
            for (int e = 0; e < 2; e++) {
                const int sb = 2 * pr + e;
                const __m256i sc = e ? _mm256_srai_epi32(sc2, 16) : _mm256_srai_epi32(_mm256_slli_epi32(sc2, 16), 16);
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)pb->ql[sb][0]);
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)pb->ql[sb][1]);
                const __m256i h = _mm256_loadu_si256((const __m256i *)pb->qh[sb]);
                const __m256i v[4] = {
                    _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), high2)),
                    _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), high2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, high2)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                    _mm256_and_si256(_mm256_srli_epi16(h, 2), high2)),
                };
                __m256i dot[X8_TOKENS];
                for (int t = 0; t < T; t++) dot[t] = _mm256_setzero_si256();
                for (int g = 0; g < 4; g++)
                    for (int t = 0; t < T; t++) {
                        const int8_t *x = q + t * K + b * QK_K + 16 * sb + 4 * g;
                        dot[t] = DPBUSD256_ACC(dot[t], v[g], _mm256_set1_epi32(load_i32(x)));
                    }
                for (int t = 0; t < T; t++) s[t] = _mm256_add_epi32(s[t], _mm256_mullo_epi32(dot[t], sc));
            }
            for (int t = 0; t < T; t++)
                o[t] = DPWSSD256(o[t], sc2, _mm256_set1_epi32(load_i32(bsum + t * nbs + b * 16 + 2 * pr)));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb->d));
        for (int t = 0; t < T; t++) {
            const __m256i st = _mm256_sub_epi32(s[t], _mm256_slli_epi32(o[t], 5));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(st), _mm256_mul_ps(_mm256_set1_ps(dx[t * ndx + b]), d), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + t * 8, acc[t]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Two adjacent panels (16 weight rows) in the lanes of 512-bit registers: the same
// integers and float steps per output lane as q4k_x8_rows and q6k_x8_rows, so the same
// bits, with one vpdpbusd per 4 values x 16 weight rows. Why: where a core runs 512-bit
// integer multiply-adds at the 256-bit ones' rate (AMD Zen 5, 2-core EPYC of this
// project's bench: 7.5 G vpdpbusd a second per thread at either width) that is twice the
// products per instruction, and each broadcast activation word and each sub-block's
// scale multiply serves 16 weight rows instead of 8. The 1.5B target's whole forward
// there (min of 8 alternated with the 8-row path, same logits): 250 rows 1208 -> 724 ms,
// 16 rows 78 -> 58, 8 rows 43 -> 38.5, 5 rows 30 -> 28; at 1-3 rows it was slower (22 ->
// 29 ms at 1: the pair reads two runs of weights side by side, and there the stream
// from memory is what limits), hence WIDE_MIN_M. Where AMX tiles run there are no
// panels (the tiles read the file's layout); not measured on Intel CPUs without AMX.
#define WIDE_PANELS 1
enum { X16_TOKENS = 6 };
#ifndef WIDE_MIN_M
#define WIDE_MIN_M 5  // from this many activation rows (A/B: -DWIDE_MIN_M=...)
#endif

#ifndef WIDE_PREFETCH_BYTES
#define WIDE_PREFETCH_BYTES X8_PREFETCH_BYTES
#endif
// The block WIDE_PREFETCH_BYTES ahead in both runs of a pair of panels (pc = pa + run),
// past the pair's end the next pair's (at pa + 2 run): read side by side, the two runs
// are two streams, and the first blocks of the second run are needed as soon as the
// first run's.
#define PREFETCH_PAIR(pa_, b_, size_, nb_)                                                  \
    {                                                                                       \
        const int64_t run_ = (int64_t)(size_) * (nb_), x_ = (b_) * (int64_t)(size_) + WIDE_PREFETCH_BYTES; \
        const char *f_ = (const char *)(pa_) + x_ + (x_ < run_ ? 0 : run_);                 \
        for (int i_ = 0; i_ < (int)(size_); i_ += 64) {                                      \
            _mm_prefetch(f_ + i_, _MM_HINT_T0);                                             \
            _mm_prefetch(f_ + run_ + i_, _MM_HINT_T0);                                      \
        }                                                                                   \
    }

// acc += the multiply-adds of w with the int32 at p broadcast to every lane, the
// broadcast folded into the instruction ({1to16}). Why: GCC 12 emits a separate
// vpbroadcastd for _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(...)) (it folds the
// broadcast for vpaddd, not for the VNNI instructions), and on the Zen 5 those took ~10%
// of the Q4_K pair kernel's time: the real target's Q4_K linears at 250 rows, 10 rounds
// alternated, 1.05-1.12x with the folded form over two runs, same bits.
typedef int32_t __attribute__((may_alias)) i32_alias;
#define DPBUSD_BCAST(acc, w, p) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias *)(p)))
#define DPWSSD_BCAST(acc, w, p) \
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const i32_alias *)(p)))

ALWAYS_INLINE __m512i join256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}
ALWAYS_INLINE __m256i join128(const void *lo, const void *hi) {
    return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)hi), _mm_loadu_si128((const __m128i *)lo));
}
ALWAYS_INLINE __m128i join64(const void *lo, const void *hi) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)lo), _mm_loadl_epi64((const __m128i *)hi));
}

// The 8 rows' mins of sub-blocks 2p and 2p + 1 interleaved as bytes: widened to int16,
// each row's (m_2p, m_2p+1) pair meets the activation row's pair of 32-value sums in one
// vpdpwssd.
ALWAYS_INLINE __m128i min_pairs(const uint8_t *even, const uint8_t *odd) {
    return _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)even), _mm_loadl_epi64((const __m128i *)odd));
}

// T (compile-time 1..X16_TOKENS) activation rows against the runs of nb panels at pa
// (weight rows 0..7) and pc (rows 8..15): out[t * 16 + row]; s32 holds the rows'
// 32-value sums (sums32_rows). The integers are q4k_x8_rows', taken in another order
// (integer sums do not depend on it), so the float steps and the bits are its: each
// sub-block's dot as two chains (low and high nibbles: 12 independent vpdpbusd chains
// keep both multiply pipes busy where 6 chains of ~4 cycles' latency could not), and
// the mins' term after the sub-blocks in pairs of them (4 vpdpwssd a block, and no
// register held for it through the sub-blocks). Against the one-chain, mins-beside
// version on the 2-core Zen 5, 250 rows, 12 rounds alternated: the Q4_K gate
// (1536 x 8960) 1.10-1.12x, the Q4_K down (8960 x 1536) 1.09-1.14x, same bits.
ALWAYS_INLINE void q4k_x16_rows(const q4k_x8 *pa, const q4k_x8 *pc, int64_t nb, const int T,
                                const int8_t *q, int64_t K, const float *dx,
                                const int16_t *s32, float *out) {
    const int64_t ndx = K / QK_K, n32 = K / 32;
    const __m512i low4 = _mm512_set1_epi8(0xF);
    __m512 acc[X16_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q4k_x8 *a = pa + b, *c = pc + b;
        PREFETCH_PAIR(pa, b, sizeof *a, nb)
        __m512i s[X16_TOKENS];
        for (int t = 0; t < T; t++) s[t] = _mm512_setzero_si512();
        for (int sb = 0; sb < 8; sb++) {
            __m512i dlo[X16_TOKENS], dhi[X16_TOKENS];
            for (int t = 0; t < T; t++) dlo[t] = dhi[t] = _mm512_setzero_si512();
            for (int gp = 0; gp < 4; gp++) {
                const __m512i v = join256(a->qs[sb][gp], c->qs[sb][gp]);
                const __m512i lo = _mm512_and_si512(v, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int t = 0; t < T; t++) {
                    const int8_t *x = q + t * K + b * QK_K + 32 * sb + 4 * gp;
                    DPBUSD_BCAST(dlo[t], lo, x);
                    DPBUSD_BCAST(dhi[t], hi, x + 16);
                }
            }
            const __m512i sc = _mm512_cvtepu8_epi32(join64(a->sc[sb], c->sc[sb]));
            for (int t = 0; t < T; t++)
                s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(_mm512_add_epi32(dlo[t], dhi[t]), sc));
        }
        __m512i mp[4];
        for (int p = 0; p < 4; p++)
            mp[p] = _mm512_cvtepu8_epi16(_mm256_set_m128i(min_pairs(c->mn[2 * p], c->mn[2 * p + 1]),
                                                          min_pairs(a->mn[2 * p], a->mn[2 * p + 1])));
        const __m512 d = _mm512_cvtph_ps(join128(a->d, c->d));
        const __m512 dmin = _mm512_cvtph_ps(join128(a->dmin, c->dmin));
        for (int t = 0; t < T; t++) {
            __m512i m = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++)
                DPWSSD_BCAST(m, mp[p], s32 + t * n32 + b * 8 + 2 * p);
            const __m512 xs = _mm512_set1_ps(dx[t * ndx + b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(xs, d), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(xs, dmin), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * 16, acc[t]);
}

ALWAYS_INLINE void q6k_x16_rows(const q6k_x8 *pa, const q6k_x8 *pc, int64_t nb, const int T,
                                const int8_t *q, int64_t K, const float *dx,
                                const int16_t *bsum, float *out) {
    const int64_t ndx = K / QK_K, nbs = K / 16;
    const __m512i low4 = _mm512_set1_epi8(0xF), high2 = _mm512_set1_epi8(0x30);
    __m512 acc[X16_TOKENS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q6k_x8 *a = pa + b, *c = pc + b;
        PREFETCH_PAIR(pa, b, sizeof *a, nb)
        __m512i s[X16_TOKENS], o[X16_TOKENS];
        for (int t = 0; t < T; t++) s[t] = o[t] = _mm512_setzero_si512();
        for (int pr = 0; pr < 8; pr++) {
            const __m512i sc2 = _mm512_cvtepi8_epi16(join128(a->sc[pr], c->sc[pr]));
            for (int e = 0; e < 2; e++) {
                const int sb = 2 * pr + e;
                const __m512i sc = e ? _mm512_srai_epi32(sc2, 16) : _mm512_srai_epi32(_mm512_slli_epi32(sc2, 16), 16);
                const __m512i l0 = join256(a->ql[sb][0], c->ql[sb][0]);
                const __m512i l1 = join256(a->ql[sb][1], c->ql[sb][1]);
                const __m512i h = join256(a->qh[sb], c->qh[sb]);
                const __m512i v[4] = {
                    _mm512_or_si512(_mm512_and_si512(l0, low4), _mm512_and_si512(_mm512_slli_epi16(h, 4), high2)),
                    _mm512_or_si512(_mm512_and_si512(l1, low4), _mm512_and_si512(_mm512_slli_epi16(h, 2), high2)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low4), _mm512_and_si512(h, high2)),
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                                    _mm512_and_si512(_mm512_srli_epi16(h, 2), high2)),
                };
                __m512i dot[X16_TOKENS];
                for (int t = 0; t < T; t++) dot[t] = _mm512_setzero_si512();
                for (int g = 0; g < 4; g++)
                    for (int t = 0; t < T; t++) {
                        const int8_t *x = q + t * K + b * QK_K + 16 * sb + 4 * g;
                        DPBUSD_BCAST(dot[t], v[g], x);
                    }
                for (int t = 0; t < T; t++) s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(dot[t], sc));
            }
            for (int t = 0; t < T; t++)
                DPWSSD_BCAST(o[t], sc2, bsum + t * nbs + b * 16 + 2 * pr);
        }
        const __m512 d = _mm512_cvtph_ps(join128(a->d, c->d));
        for (int t = 0; t < T; t++) {
            const __m512i st = _mm512_sub_epi32(s[t], _mm512_slli_epi32(o[t], 5));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(st), _mm512_mul_ps(_mm512_set1_ps(dx[t * ndx + b]), d), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * 16, acc[t]);
}
#endif

#if defined(WIDE_PANELS)
// The M activation rows' 32-value sums (K / 32 int16 a row, each the sum of two of the
// 16-value sums in bsum) for q4k_x16_rows, in a buffer the calling thread keeps for its
// next call; NULL when it cannot grow.
static const int16_t *sums32_rows(const int16_t *bsum, int64_t M, int64_t K) {
    static __thread int16_t *buf;
    static __thread int64_t cap;
    const int64_t n = M * (K / 32);
    if (n > cap) {
        int16_t *grown = (int16_t *)realloc(buf, sizeof *grown * (size_t)n);
        if (!grown) return NULL;
        buf = grown;
        cap = n;
    }
    for (int64_t i = 0; i < n; i++) buf[i] = (int16_t)(bsum[2 * i] + bsum[2 * i + 1]);
    return buf;
}
#endif

// Weight rows n0..n1-1 (multiples of 8) of a Q4_K_X8 or Q6_K_X8 weight against M
// activation rows.
static void rows_x8(const gguf_weight *wt, int64_t n0, int64_t n1, int64_t K, int64_t M,
                    const int8_t *q, const float *dx, const int16_t *bsum, void *y, int64_t ldy,
                    int y_bf16) {
    const int q4 = wt->type == TYPE_Q4_K_X8;
    const int64_t nb = K / QK_K, nbs = K / 16, run = 8 * wt->row_bytes;
    float out[X8_TOKENS * 8];
#if defined(WIDE_PANELS)
    float out16[X16_TOKENS * 16];
    const int wide = M >= WIDE_MIN_M && n1 - n0 >= 16;
    const int16_t *s32 = wide && q4 ? sums32_rows(bsum, M, K) : NULL;
#endif
    for (int64_t n = n0; n < n1; n += 8) {
        const uint8_t *p = wt->w + n / 8 * run;
#if defined(WIDE_PANELS)
        if (n + 16 <= n1 && wide && (s32 || !q4)) {
            const uint8_t *p2 = p + run;
            for (int64_t m = 0; m < M; m += X16_TOKENS) {
                const int T = (int)(M - m < X16_TOKENS ? M - m : X16_TOKENS);
                const int8_t *qm = q + m * K;
                const float *dm = dx + m * nb;
#define W4(s_, T_) q4k_x16_rows((const q4k_x8 *)p, (const q4k_x8 *)p2, nb, T_, qm, K, dm, s_, out16)
#define W6(b_, T_) q6k_x16_rows((const q6k_x8 *)p, (const q6k_x8 *)p2, nb, T_, qm, K, dm, b_, out16)
                _Static_assert(X16_TOKENS == 6, "BY_TOKENS has a case for each count");
                if (q4) {
                    BY_TOKENS(W4, T, s32 + m * (K / 32))
                } else {
                    BY_TOKENS(W6, T, bsum + m * nbs)
                }
#undef W4
#undef W6
                for (int t = 0; t < T; t++)
                    for (int h = 0; h < 2; h++)
                        put_outputs8(y, y_bf16, (m + t) * ldy + n + 8 * h,
                                     _mm256_loadu_ps(out16 + t * 16 + 8 * h),
                                     wt->bias ? wt->bias + n + 8 * h : NULL);
            }
            n += 8;  // the second panel is done too
            continue;
        }
#endif
        for (int64_t m = 0; m < M; m += X8_TOKENS) {
            const int T = (int)(M - m < X8_TOKENS ? M - m : X8_TOKENS);
            const int8_t *qm = q + m * K;
            const float *dm = dx + m * nb;
            const int16_t *bm = bsum + m * nbs;
#define X4(p_, nb_, q_, K_, dx_, bs_, out_, R) q4k_x8_rows((const q4k_x8 *)p_, nb_, R, q_, K_, dx_, bs_, out_)
#define X6(p_, nb_, q_, K_, dx_, bs_, out_, R) q6k_x8_rows((const q6k_x8 *)p_, nb_, R, q_, K_, dx_, bs_, out_)
            if (q4) {
                BY_ROWS(X4, T, p, nb, qm, K, dm, bm, out)
            } else {
                BY_ROWS(X6, T, p, nb, qm, K, dm, bm, out)
            }
#undef X4
#undef X6
            for (int t = 0; t < T; t++)
                put_outputs8(y, y_bf16, (m + t) * ldy + n, _mm256_loadu_ps(out + t * 8),
                             wt->bias ? wt->bias + n : NULL);
        }
    }
}
#endif

#if defined(__AMX_INT8__) && defined(__AVX512F__)
// ---------------------------------------------------------- AMX tiles (Q4_K, Q6_K)
// Intel CPUs since Sapphire Rapids multiply int8 tiles: one tdpbusd is a 16 x 16 block
// of dots of up to 64 values (u8 x s8 -> int32), 16 weight rows (tile A) against 16
// activation rows (tile B: the same values in groups of 4). The dots' integers and then
// the float steps are those of the panels above, with the activation rows in the lanes
// instead of the weight rows: the same bits.
//   Q4_K folds its 6-bit sub-block scales into the weights: sc = 8 hi + lo (3 bits
//   each), and nibble x lo, nibble x hi (<= 105) are u8, so two tiles of 64 values
//   (lo, hi) per 64 values give S = dot(lo) + 8 dot(hi) for the whole block: exactly
//   the panels' sum of sc x sub-block dot, with 2 tile stores a block and no multiply.
//   Q6_K's scales are signed 8-bit and do not fold into u8: up to 31 rows one tile per
//   16-value sub-block, each stored and scaled (vpmulld); from 32 rows the scales'
//   base-8 digits fold into signed bytes (three tiles per 64 values, tdpbssd).
// The activation rows are packed once per call (tile_acts_team); the weights block by
// block as 16 rows reach it, used at once while in L1 for every 16 activation rows (a
// repacked copy kept resident would cost ~3.5x the 4-bit bytes).
#include <sys/syscall.h>
#include <unistd.h>
enum { AMX_ROWS = 16 };
// From this many activation rows the tiles take over (-D to measure): below, packing
// the weights costs more than the tiles save. The 1.5B target's layers on a 2-core
// Xeon with AMX, all 28 against the rows path: Q4_K gate/up 46 vs 52 ms at 7 rows,
// 48 vs 48 at 6; Q6_K's head (151936 x 1536) 22 vs 20 ms at 10 rows, even at 11-12,
// 23 vs 26 at 13, while the Q6_K down projections (K = 8960) gain from 10. With the
// row lanes (5+ rows) the whole forward at 7 rows took 94 ms on the rows path against
// 99 with Q4_K on the tiles, at 8 rows 101 against 104: the tiles from 8.
#ifndef AMX_MIN_M_Q4K
#define AMX_MIN_M_Q4K 8
#endif
#ifndef AMX_MIN_M_Q6K
#define AMX_MIN_M_Q6K 10
#endif
// From this many rows Q6_K's scales are folded into the weights (three digit tiles), below
// one tile per sub-block: a Q6_K 1536 x 8960 on 2 threads, sub-blocks vs digits: 0.92 vs
// 1.30 ms at 16 rows, 1.44 vs 1.44 at 32, 2.54 vs 2.03 at 64, 10.6 vs 6.1 at 256.
#ifndef AMX_DIGITS_MIN_M_Q6K
#define AMX_DIGITS_MIN_M_Q6K 32
#endif
static int tiles_take(int type, int64_t M) {
    return (type == TYPE_Q4_K && M >= AMX_MIN_M_Q4K) || (type == TYPE_Q6_K && M >= AMX_MIN_M_Q6K);
}

// Linux hands a thread the 8 KB tile state only once the process has asked for it.
static int amx_state = -1;  // -1: not asked yet, 0: refused, 1: granted
static int amx_usable(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) {
        // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (asking twice is harmless)
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

// Eight tiles of 16 rows x 64 bytes, except for Q6_K (width 16): A tiles 1 and 4 hold 16
// weight rows x 16 values and B tiles 2 and 5 the 4 groups of 4 values of 16 activation
// rows. C tiles (int32, 16 x 16) are 0 and 3 for Q6_K, 0 and 1 for Q4_K.
static void amx_configure(int width) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    for (int set = 0; width < 64 && set < 2; set++) {
        c.colsb[3 * set + 1] = (uint16_t)width;
        c.rows[3 * set + 2] = (uint8_t)(width / 4);
    }
    _tile_loadconfig(&c);
}

// 16 activation rows (T <= 16 real, the rest zero) of one 256-value block: tile B for
// any width (value groups of 4 in order, each group's 16 rows x 4 bytes: 64 bytes) and
// the lane vectors of the offset terms and of the float steps.
typedef struct {
    int8_t x[64][AMX_ROWS][4];  // [value group][activation row][4 values]
    int32_t bs16[8][AMX_ROWS];  // [pair][row]: 16-value sums 2p, 2p + 1 (int16 pair)
    int32_t bs32[4][AMX_ROWS];  // [pair][row]: 32-value sums 2p, 2p + 1 (int16 pair)
    float dx[AMX_ROWS];
} tile_acts;

static void pack_acts_block(const int8_t *q, int64_t K, const float *dx, const int16_t *bsum,
                            int T, int64_t b, tile_acts *a) {
    const int64_t ndx = K / QK_K, nbs = K / 16;
    memset(a, 0, sizeof *a);
    for (int t = 0; t < T; t++) {
        const int8_t *x = q + t * K + b * QK_K;
        const int16_t *bs = bsum + t * nbs + b * 16;
        for (int g = 0; g < 64; g++) memcpy(a->x[g][t], x + 4 * g, 4);
        for (int pr = 0; pr < 8; pr++) a->bs16[pr][t] = load_i32(bs + 2 * pr);
        // Q4_K's Mn = sum over the pairs of min x sum, the same integer as the panels'
        // four 16-value terms
        for (int pr = 0; pr < 4; pr++) a->bs32[pr][t] = sums32_pair(bs, pr);
        a->dx[t] = dx[t * ndx + b];
    }
}

// The tile layout of all M activation rows (chunks of 16 rows, then blocks), or NULL
// where no weight of the call takes the tiles (or there is no memory: the panels run).
static tile_acts *tile_acts_alloc(int count, const gguf_weight *wts, int64_t K, int64_t M,
                                  int scalar) {
    int tiles = 0;
    for (int i = 0; i < count; i++) tiles |= tiles_take(wts[i].type, M);
    if (scalar || !tiles || !amx_usable()) return NULL;
    const int64_t chunks = (M + AMX_ROWS - 1) / AMX_ROWS;
    return aligned_alloc(64, (size_t)(chunks * (K / QK_K)) * sizeof(tile_acts));
}

// Each thread of the team packs its share of (chunk, block) pairs; ends with a barrier.
static void tile_acts_team(const int8_t *q, const float *dx, const int16_t *bsum, int64_t K,
                           int64_t M, tile_acts *a) {
    const int64_t nb = K / QK_K, chunks = (M + AMX_ROWS - 1) / AMX_ROWS;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < chunks * nb; i++) {
        const int64_t m = i / nb * AMX_ROWS, b = i % nb;
        const int T = (int)(M - m < AMX_ROWS ? M - m : AMX_ROWS);
        pack_acts_block(q + m * K, K, dx + m * (K / QK_K), bsum + m * (K / 16), T, b, a + i);
    }
}

typedef struct {
    uint8_t lo[4][AMX_ROWS][64];  // [64 values][weight row][value]: nibble x (scale & 7)
    uint8_t hi[4][AMX_ROWS][64];  // ... nibble x (scale >> 3)
    int32_t mn[AMX_ROWS][4];      // [weight row]: mins of sub-blocks 2p, 2p + 1 (int16 pair)
    float d[AMX_ROWS], dmin[AMX_ROWS];
} q4k_tile_block;

// Block b of weight rows w[0..nr-1] (nr <= 16; the rest zero) as a tile block. The byte
// products in 16-bit lanes: the low byte's product (<= 105) carries nothing upwards.
static void q4k_pack_tiles(const uint8_t *w, int64_t row_bytes, int nr, int64_t b,
                           q4k_tile_block *pb) {
    const __m512i low4 = _mm512_set1_epi8(0xF), low3 = _mm512_set1_epi16(7);
    for (int r = 0; r < AMX_ROWS; r++) {
        if (r >= nr) {
            for (int c = 0; c < 4; c++) {
                _mm512_store_si512(pb->lo[c][r], _mm512_setzero_si512());
                _mm512_store_si512(pb->hi[c][r], _mm512_setzero_si512());
                pb->mn[r][c] = 0;
            }
            pb->d[r] = pb->dmin[r] = 0.0f;
            continue;
        }
        const block_q4_K *x = (const block_q4_K *)(w + r * row_bytes) + b;
        uint8_t sc[8], mn[8];
        q4k_scales(x->scales, sc, mn);
        const __m512i sc16 = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        for (int c = 0; c < 4; c++) {
            // values 64c..64c+63: the chunk's low nibbles, then its high ones
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            const __m512i v = _mm512_and_si512(
                _mm512_inserti64x4(_mm512_castsi256_si512(bits), _mm256_srli_epi16(bits, 4), 1), low4);
            // the scale of sub-block 2c in the first 16 lanes, 2c + 1 in the last 16
            const __m512i pick = _mm512_set_epi64(
                0x0001000100010001LL * (2 * c + 1), 0x0001000100010001LL * (2 * c + 1),
                0x0001000100010001LL * (2 * c + 1), 0x0001000100010001LL * (2 * c + 1),
                0x0001000100010001LL * (2 * c), 0x0001000100010001LL * (2 * c),
                0x0001000100010001LL * (2 * c), 0x0001000100010001LL * (2 * c));
            const __m512i s = _mm512_permutexvar_epi16(pick, sc16);
            _mm512_store_si512(pb->lo[c][r], _mm512_mullo_epi16(v, _mm512_and_si512(s, low3)));
            _mm512_store_si512(pb->hi[c][r], _mm512_mullo_epi16(v, _mm512_srli_epi16(s, 3)));
            pb->mn[r][c] = (int32_t)((uint32_t)mn[2 * c + 1] << 16 | mn[2 * c]);
        }
        pb->d[r] = half_to_float(x->d);
        pb->dmin[r] = half_to_float(x->dmin);
    }
}

// acc[r][t] += one block of 16 weight rows against 16 packed activation rows (the tile
// numbers must be literals: they are pasted into the instructions).
static void q4k_tile_step(const q4k_tile_block *pb, const tile_acts *xb, int nr,
                          float (*acc)[AMX_ROWS]) {
    int32_t dots[2][AMX_ROWS][AMX_ROWS] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < 4; c += 2) {
        _tile_loadd(2, pb->lo[c], 64);
        _tile_loadd(3, pb->hi[c], 64);
        _tile_loadd(4, xb->x[16 * c], 64);
        _tile_dpbusd(0, 2, 4);
        _tile_dpbusd(1, 3, 4);
        _tile_loadd(5, pb->lo[c + 1], 64);
        _tile_loadd(6, pb->hi[c + 1], 64);
        _tile_loadd(7, xb->x[16 * c + 16], 64);
        _tile_dpbusd(0, 5, 7);
        _tile_dpbusd(1, 6, 7);
    }
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    const __m512 xs = _mm512_load_ps(xb->dx);
    __m512i bs[4];  // loaded once: the stores to acc below may alias them for the compiler
    for (int pr = 0; pr < 4; pr++) bs[pr] = _mm512_load_si512(xb->bs32[pr]);
    for (int r = 0; r < nr; r++) {
        const __m512i s = _mm512_add_epi32(_mm512_load_si512(dots[0][r]),
                                           _mm512_slli_epi32(_mm512_load_si512(dots[1][r]), 3));
        __m512i m = _mm512_setzero_si512();
        for (int pr = 0; pr < 4; pr++)
            m = _mm512_dpwssd_epi32(m, _mm512_set1_epi32(pb->mn[r][pr]), bs[pr]);
        __m512 ac = _mm512_load_ps(acc[r]);
        ac = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(xs, _mm512_set1_ps(pb->d[r])), ac);
        ac = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m),
                              _mm512_mul_ps(xs, _mm512_set1_ps(pb->dmin[r])), ac);
        _mm512_store_ps(acc[r], ac);
    }
}

// Q6_K: 16 sub-blocks of 16 values (0..63, u8), int8 scales; S = sum of scale x dot -
// 32 x sum of scale x (the sub-block's activation sum), as the panels.
typedef struct {
    uint8_t w[16][AMX_ROWS][16];  // [sub-block][weight row][value]: 0..63
    int32_t sc[AMX_ROWS][16];     // [weight row][sub-block] scale
    int32_t sc2[AMX_ROWS][8];     // ... scales of sub-blocks 2p and 2p + 1 (int16 pair)
    float d[AMX_ROWS];
} q6k_tile_block;

static void q6k_pack_tiles(const uint8_t *w, int64_t row_bytes, int nr, int64_t b,
                           q6k_tile_block *pb) {
    const __m256i low4 = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
    for (int r = 0; r < AMX_ROWS; r++) {
        if (r >= nr) {
            for (int sb = 0; sb < 16; sb++) {
                _mm_store_si128((__m128i *)pb->w[sb][r], _mm_setzero_si128());
                pb->sc[r][sb] = pb->sc2[r][sb / 2] = 0;
            }
            pb->d[r] = 0.0f;
            continue;
        }
        const block_q6_K *x = (const block_q6_K *)(w + r * row_bytes) + b;
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
            const __m256i bb = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
            __m256i v[4];  // 32-value chunks 4h..4h+3 (sub-blocks 8h + 2j, 8h + 2j + 1)
            v[0] = _mm256_or_si256(_mm256_and_si256(a, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(hb, two), 4));
            v[1] = _mm256_or_si256(
                _mm256_and_si256(bb, low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), two), 4));
            v[2] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), two), 4));
            v[3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(bb, 4), low4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), two), 4));
            for (int j = 0; j < 4; j++) {
                _mm_store_si128((__m128i *)pb->w[8 * h + 2 * j][r], _mm256_castsi256_si128(v[j]));
                _mm_store_si128((__m128i *)pb->w[8 * h + 2 * j + 1][r],
                                _mm256_extracti128_si256(v[j], 1));
            }
        }
        for (int sb = 0; sb < 16; sb++) pb->sc[r][sb] = x->scales[sb];
        for (int pr = 0; pr < 8; pr++)
            pb->sc2[r][pr] = (int32_t)((uint32_t)(uint16_t)(int16_t)x->scales[2 * pr + 1] << 16 |
                                       (uint16_t)(int16_t)x->scales[2 * pr]);
        pb->d[r] = half_to_float(x->d);
    }
}

// One sub-block's 16 x 16 dots into dots[sb].
#define SUB_BLOCK_TILE(tc, ta, tb, sb)             \
    do {                                           \
        _tile_zero(tc);                            \
        _tile_loadd(ta, pb->w[sb], 16);            \
        _tile_loadd(tb, xb->x[4 * (sb)], 64);      \
        _tile_dpbusd(tc, ta, tb);                  \
        _tile_stored(tc, dots[sb], 64);            \
    } while (0)

static void q6k_tile_step(const q6k_tile_block *pb, const tile_acts *xb, int nr,
                          float (*acc)[AMX_ROWS]) {
    int32_t dots[16][AMX_ROWS][AMX_ROWS] __attribute__((aligned(64)));
    for (int sb = 0; sb < 16; sb += 2) {
        SUB_BLOCK_TILE(0, 1, 2, sb);
        SUB_BLOCK_TILE(3, 4, 5, sb + 1);
    }
    const __m512 xs = _mm512_load_ps(xb->dx);
    for (int r = 0; r < nr; r++) {
        __m512i s = _mm512_setzero_si512(), o = _mm512_setzero_si512();
        for (int sb = 0; sb < 16; sb++) {
            const __m512i dot = _mm512_load_si512(dots[sb][r]);
            s = _mm512_add_epi32(s, _mm512_mullo_epi32(dot, _mm512_set1_epi32(pb->sc[r][sb])));
        }
        for (int pr = 0; pr < 8; pr++)
            o = _mm512_dpwssd_epi32(o, _mm512_set1_epi32(pb->sc2[r][pr]),
                                    _mm512_load_si512(xb->bs16[pr]));
        const __m512i st = _mm512_sub_epi32(s, _mm512_slli_epi32(o, 5));
        __m512 ac = _mm512_load_ps(acc[r]);
        ac = _mm512_fmadd_ps(_mm512_cvtepi32_ps(st), _mm512_mul_ps(xs, _mm512_set1_ps(pb->d[r])), ac);
        _mm512_store_ps(acc[r], ac);
    }
}
#undef SUB_BLOCK_TILE

// Q6_K from AMX_DIGITS_MIN_M_Q6K rows: q = u - 32 in [-32, 31] and each scale written in
// three balanced base-8 digits, sc = e0 + 8 e1 + 64 e2 with e in [-3, 4], so q x e (in
// [-128, 124]) is a signed byte: three signed tiles of 64 values per 64 values
// (tdpbssd) give S = C0 + 8 C1 + 64 C2 = the sum of sc x sub-block dot, the same integer
// as above, with no offset term, three tile stores a block and one multiply. Packing
// the three digit copies costs more than the sub-block layout, which stays below.
enum { Q6K_DIGITS = 3 };
typedef struct {
    int8_t w[Q6K_DIGITS][4][AMX_ROWS][64];  // [digit][64 values][weight row][value]
    float d[AMX_ROWS];
} q6k_digit_block;

static void q6k_pack_digits(const uint8_t *w, int64_t row_bytes, int nr, int64_t b,
                           q6k_digit_block *pb) {
    const __m512i low4 = _mm512_set1_epi8(0xF), two = _mm512_set1_epi8(3),
                  off = _mm512_set1_epi8(32), odd = _mm512_set1_epi16((short)0xFF00);
    const __m256i three = _mm256_set1_epi16(3), seven = _mm256_set1_epi16(7);
    for (int r = 0; r < AMX_ROWS; r++) {
        if (r >= nr) {
            for (int e = 0; e < Q6K_DIGITS; e++)
                for (int c = 0; c < 4; c++) _mm512_store_si512(pb->w[e][c][r], _mm512_setzero_si512());
            pb->d[r] = 0.0f;
            continue;
        }
        const block_q6_K *x = (const block_q6_K *)(w + r * row_bytes) + b;
        // the 16 scales' digits as words (lanes 0-15; 16-31 unused)
        __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
        __m512i dig[Q6K_DIGITS];
        for (int e = 0; e < Q6K_DIGITS; e++) {
            const __m256i de = _mm256_sub_epi16(_mm256_and_si256(_mm256_add_epi16(s, three), seven), three);
            s = _mm256_srai_epi16(_mm256_sub_epi16(s, de), 3);
            dig[e] = _mm512_castsi256_si512(de);
        }
        for (int h = 0; h < 2; h++) {
            // values 128h..128h+63 (chunk 2h) and 128h+64..128h+127 (chunk 2h + 1)
            const __m512i a = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(x->ql + 64 * h))),
                _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32)), 1);
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
            const __m512i hh = _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
            const __m512i v[2] = {
                _mm512_or_si512(_mm512_and_si512(a, low4),
                                _mm512_slli_epi16(_mm512_and_si512(hh, two), 4)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low4),
                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hh, 4), two), 4))};
            for (int j = 0; j < 2; j++) {
                const int c = 2 * h + j;  // 64 values: sub-blocks 4c..4c+3, one a 128-bit lane
                const __m512i q = _mm512_sub_epi8(v[j], off), qodd = _mm512_and_si512(q, odd);
                const __m512i pick = _mm512_inserti64x4(
                    _mm512_inserti32x4(_mm512_set1_epi16((short)(4 * c)),
                                       _mm_set1_epi16((short)(4 * c + 1)), 1),
                    _mm256_inserti128_si256(_mm256_set1_epi16((short)(4 * c + 2)),
                                            _mm_set1_epi16((short)(4 * c + 3)), 1), 1);
                for (int e = 0; e < Q6K_DIGITS; e++) {
                    // a byte's product with its lane's digit: the low byte of the word
                    // product for even bytes; odd bytes alone in their word's high byte
                    const __m512i de = _mm512_permutexvar_epi16(pick, dig[e]);
                    _mm512_store_si512(
                        pb->w[e][c][r],
                        _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAULL, _mm512_mullo_epi16(q, de),
                                               _mm512_mullo_epi16(qodd, de)));
                }
            }
        }
        pb->d[r] = half_to_float(x->d);
    }
}

static void q6k_digit_step(const q6k_digit_block *pb, const tile_acts *xb, int nr,
                          float (*acc)[AMX_ROWS]) {
    int32_t dots[Q6K_DIGITS][AMX_ROWS][AMX_ROWS] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int c = 0; c < 4; c += 2) {
        _tile_loadd(6, xb->x[16 * c], 64);
        _tile_loadd(3, pb->w[0][c], 64);
        _tile_loadd(4, pb->w[1][c], 64);
        _tile_loadd(5, pb->w[2][c], 64);
        _tile_dpbssd(0, 3, 6);
        _tile_dpbssd(1, 4, 6);
        _tile_dpbssd(2, 5, 6);
        _tile_loadd(7, xb->x[16 * c + 16], 64);
        _tile_loadd(3, pb->w[0][c + 1], 64);
        _tile_loadd(4, pb->w[1][c + 1], 64);
        _tile_loadd(5, pb->w[2][c + 1], 64);
        _tile_dpbssd(0, 3, 7);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 7);
    }
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    _tile_stored(2, dots[2], 64);
    const __m512 xs = _mm512_load_ps(xb->dx);
    for (int r = 0; r < nr; r++) {
        const __m512i st = _mm512_add_epi32(
            _mm512_load_si512(dots[0][r]),
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots[1][r]), 3),
                             _mm512_slli_epi32(_mm512_load_si512(dots[2][r]), 6)));
        __m512 ac = _mm512_load_ps(acc[r]);
        ac = _mm512_fmadd_ps(_mm512_cvtepi32_ps(st), _mm512_mul_ps(xs, _mm512_set1_ps(pb->d[r])), ac);
        _mm512_store_ps(acc[r], ac);
    }
}

// v[i] <- column i of the 16 x 16 floats whose rows v holds (unpacks within 128-bit
// lanes, then lane shuffles).
static inline void transpose16(__m512 *v) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    // v[4i + j], lane L: column 4L + j of rows 4i..4i+3
    for (int i = 0; i < 4; i++) {
        v[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        v[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        v[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        v[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(v[8 * i + j], v[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(v[8 * i + j], v[8 * i + 4 + j], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        v[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        v[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    }
}

// weight_rows for Q4_K and Q6_K by AMX tiles: 16 weight rows at a time, block by block
// (each packed once, while it stays in L1) against the packed activation rows `a`, 16
// at a time. Returns 0 without memory (the caller goes on).
static int rows_by_tiles(const gguf_weight *wt, int64_t n0, int64_t n1, int64_t K, int64_t M,
                         const tile_acts *a, void *y, int64_t ldy, int y_bf16) {
    const int64_t nb = K / QK_K, chunks = (M + AMX_ROWS - 1) / AMX_ROWS;
    const int q4 = wt->type == TYPE_Q4_K;
    const int digits = !q4 && M >= AMX_DIGITS_MIN_M_Q6K;
    union {
        q4k_tile_block q4;
        q6k_tile_block q6;
        q6k_digit_block q6d;
    } pack __attribute__((aligned(64))), *p = &pack;  // one block of 16 weight rows
    float(*acc)[AMX_ROWS][AMX_ROWS] = aligned_alloc(64, (size_t)chunks * sizeof *acc);
    if (!acc) return 0;
    amx_configure(q4 || digits ? 64 : 16);
    for (int64_t n = n0; n < n1; n += AMX_ROWS) {
        const int nr = (int)(n1 - n < AMX_ROWS ? n1 - n : AMX_ROWS);
        const uint8_t *w = wt->w + n * wt->row_bytes;
        memset(acc, 0, (size_t)chunks * sizeof *acc);
        // the next 16 rows' bytes (contiguous) asked for now: the pack reads a block of
        // 16 rows at a time between tile products, too few misses at once to stream
        // from memory (the 1.5B target's gate/up at 16 rows: 60 -> 45 ms a forward)
        const int64_t ahead = n1 < n + 2 * AMX_ROWS ? n1 : n + 2 * AMX_ROWS;
        for (const uint8_t *pf = w + AMX_ROWS * wt->row_bytes; pf < wt->w + ahead * wt->row_bytes;
             pf += 64)
            _mm_prefetch((const char *)pf, _MM_HINT_T0);
        for (int64_t b = 0; b < nb; b++) {
            if (q4)
                q4k_pack_tiles(w, wt->row_bytes, nr, b, &p->q4);
            else if (digits)
                q6k_pack_digits(w, wt->row_bytes, nr, b, &p->q6d);
            else
                q6k_pack_tiles(w, wt->row_bytes, nr, b, &p->q6);
            for (int64_t c = 0; c < chunks; c++) {
                if (q4)
                    q4k_tile_step(&p->q4, a + c * nb + b, nr, acc[c]);
                else if (digits)
                    q6k_digit_step(&p->q6d, a + c * nb + b, nr, acc[c]);
                else
                    q6k_tile_step(&p->q6, a + c * nb + b, nr, acc[c]);
            }
        }
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t m = c * AMX_ROWS;
            const int T = (int)(M - m < AMX_ROWS ? M - m : AMX_ROWS);
            // acc[c] holds the weight rows in its rows: each activation row's outputs are
            // a column, transposed into rows where all 16 weight rows are real
            if (nr == AMX_ROWS) {
                __m512 v[AMX_ROWS];
                for (int r = 0; r < AMX_ROWS; r++) v[r] = _mm512_load_ps(acc[c][r]);
                transpose16(v);
                for (int t = 0; t < T; t++) {
                    const float *bias = wt->bias ? wt->bias + n : NULL;
                    put_outputs8(y, y_bf16, (m + t) * ldy + n, _mm512_castps512_ps256(v[t]), bias);
                    put_outputs8(y, y_bf16, (m + t) * ldy + n + 8,
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[t]), 1)),
                                 bias ? bias + 8 : NULL);
                }
                continue;
            }
            // (else) gathered 8 at a time
            const __m256i column = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                      _mm256_set1_epi32(AMX_ROWS));
            for (int t = 0; t < T; t++) {
                int r = 0;
                for (; r + 8 <= nr; r += 8)
                    put_outputs8(y, y_bf16, (m + t) * ldy + n + r,
                                 _mm256_i32gather_ps(&acc[c][r][t], column, 4),
                                 wt->bias ? wt->bias + n + r : NULL);
                for (; r < nr; r++)
                    put_output(y, y_bf16, (m + t) * ldy + n + r, acc[c][r][t],
                               wt->bias ? wt->bias + n + r : NULL);
            }
        }
    }
    _tile_release();
    free(acc);
    return 1;
}
#else
typedef struct tile_acts tile_acts;  // no tiles in this build: never allocated
static tile_acts *tile_acts_alloc(int count, const gguf_weight *wts, int64_t K, int64_t M,
                                  int scalar) {
    (void)count, (void)wts, (void)K, (void)M, (void)scalar;
    return NULL;
}
static void tile_acts_team(const int8_t *q, const float *dx, const int16_t *bsum, int64_t K,
                           int64_t M, tile_acts *a) {
    (void)q, (void)dx, (void)bsum, (void)K, (void)M, (void)a;
}
#endif

// Weight rows n0..n1-1 of `wt` against all M activation rows: y[m * ldy + n] as float32
// (y_bf16 == 0) or rounded to bfloat16. `tiles`: the rows packed for AMX tiles, or NULL.
static void weight_rows(const gguf_weight *wt, int64_t n0, int64_t n1, int64_t K, int64_t M,
                        const int8_t *q, const float *dx, const int16_t *bsum,
                        const tile_acts *tiles, void *y, int64_t ldy, int y_bf16, int scalar) {
#if defined(AMX_PATH)
    if (tiles && tiles_take(wt->type, M) &&
        rows_by_tiles(wt, n0, n1, K, M, tiles, y, ldy, y_bf16))
        return;
#else
    (void)tiles;
#endif
    if (is_x8(wt->type)) {
#if defined(__AVX2__)
        if (!scalar) {
            rows_x8(wt, n0, n1, K, M, q, dx, bsum, y, ldy, y_bf16);
            return;
        }
#endif
        const int64_t nb = K / QK_K, run = 8 * wt->row_bytes;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m = 0; m < M; m++) {
                const uint8_t *p = wt->w + n / 8 * run;
                const int8_t *qm = q + m * K;
                const float *dm = dx + m * nb;
                const int16_t *bm = bsum + m * (K / 16);
                float v;
                if (wt->type == TYPE_Q4_K_X8)
                    q4k_x8_row_scalar((const q4k_x8 *)p, nb, (int)(n % 8), qm, dm, bm, &v);
                else
                    q6k_x8_row_scalar((const q6k_x8 *)p, nb, (int)(n % 8), qm, dm, bm, &v);
                put_output(y, y_bf16, m * ldy + n, v, wt->bias ? wt->bias + n : NULL);
            }
        return;
    }
#if defined(__AVX2__)
    if (!scalar && (wt->type == TYPE_Q4_K || wt->type == TYPE_Q6_K) && M >= PANEL_MIN_M &&
        rows_by_panels(wt, n0, n1, K, M, q, dx, bsum, y, ldy, y_bf16))
        return;
#endif
    const int64_t ndx = K / activation_block(wt->type);
    float tmp[ROW_GROUP];
    void *lanes = NULL;  // row_lanes of each group of ROW_GROUP rows, where they pay
#if defined(__AVX2__)
    int64_t lanes_stride = 0;
    if (!scalar && M >= LANES_MIN_ROWS && M <= M_CHUNK &&
        (wt->type == TYPE_Q4_K || wt->type == TYPE_Q6_K)) {
        lanes_stride = K / QK_K;
        lanes = aligned_alloc(32, (size_t)(((M + ROW_GROUP - 1) / ROW_GROUP) * lanes_stride) * sizeof(row_lanes));
        for (int64_t m = 0; lanes && m < M; m += ROW_GROUP)
            row_lanes_build(dx + m * ndx, bsum + m * (K / 16), K, (int)(M - m < ROW_GROUP ? M - m : ROW_GROUP),
                            (row_lanes *)lanes + m / ROW_GROUP * lanes_stride);
    }
#endif
    // Activation rows in chunks that stay in cache while the weight rows pass by.
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t mc = M - m0 < M_CHUNK ? M - m0 : M_CHUNK;
        const char *pf = (const char *)wt->w + n0 * wt->row_bytes;
        const char *const pf_end = (const char *)wt->w + n1 * wt->row_bytes;
        for (int64_t n = n0; n < n1; n++) {
#if defined(__AVX2__)
            // the weight bytes PREFETCH_BYTES past the next row asked for ahead of use: at
            // one activation row the stream from memory is what limits (a Q4_K 8960x1536
            // on one thread: 0.91 -> 0.74 ms)
            const char *target = (const char *)wt->w + (n + 1) * wt->row_bytes + PREFETCH_BYTES;
            if (target > pf_end) target = pf_end;
            for (; pf < target; pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
#else
            (void)pf;
            (void)pf_end;
#endif
            for (int64_t r0 = 0; r0 < mc; r0 += ROW_GROUP) {
                const int rows = (int)(mc - r0 < ROW_GROUP ? mc - r0 : ROW_GROUP);
                const int64_t m = m0 + r0;
#if defined(__AVX2__)
                const void *gl = lanes ? (const row_lanes *)lanes + m / ROW_GROUP * lanes_stride : NULL;
#else
                const void *gl = NULL;
#endif
                weight_row(wt->type, wt->w + n * wt->row_bytes, K, rows, q + m * K,
                           dx + m * ndx, bsum + m * (K / 16), gl, tmp, 1, scalar);
                for (int r = 0; r < rows; r++)
                    put_output(y, y_bf16, (m + r) * ldy + n, tmp[r], wt->bias ? wt->bias + n : NULL);
            }
        }
    }
    free(lanes);
}

// The weights' rows shared among the calling team's threads in contiguous runs of
// about equal bytes (no barrier at the end: the caller's region ends there).
static void matmul_team(int count, const gguf_weight *wts, int64_t K, int64_t M,
                        const int8_t *q, const float *dx, const int16_t *bsum,
                        const tile_acts *tiles, void *const *ys, const int64_t *ldys,
                        int y_bf16, int scalar) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += wts[i].N * wts[i].row_bytes;
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
    int64_t off = 0;
    for (int i = 0; i < count; i++) {
        const int64_t rb = wts[i].row_bytes, size = wts[i].N * rb;
        if (hi > off && lo < off + size) {  // rows whose first byte lies in [lo, hi)
            int64_t a = lo > off ? (lo - off + rb - 1) / rb : 0;
            int64_t b = hi < off + size ? (hi - off + rb - 1) / rb : wts[i].N;
            if (is_x8(wts[i].type)) {  // whole panels of 8 rows (N % 8 == 0)
                a = (a + 7) / 8 * 8;
                b = (b + 7) / 8 * 8;
            }
            if (b > a)
                weight_rows(&wts[i], a, b, K, M, q, dx, bsum, tiles, ys[i], ldys[i], y_bf16, scalar);
        }
        off += size;
    }
}

// y (M, N) float, row stride ldy: y[m][n] = x[m] . W[n] for N weight rows of GGUF blocks
// of `type` (row_bytes each) and M activation rows quantised by quantize_rows_q8 with
// activation_block(type). scalar != 0 forces the portable path (tests).
int gguf_matmul(int type, const uint8_t *w, int64_t N, int64_t K, int64_t row_bytes,
                const int8_t *q, const float *dx, const int16_t *bsum, int64_t M, float *y,
                int64_t ldy, int scalar) {
    const gguf_weight wt = {type, 0, w, N, row_bytes, NULL};
    if (!weight_fits(&wt, K)) return -1;
    void *ys[1] = {y};
    const int64_t ldys[1] = {ldy};
    tile_acts *tiles = tile_acts_alloc(1, &wt, K, M, scalar);
#pragma omp parallel
    {
        if (tiles) tile_acts_team(q, dx, bsum, K, M, tiles);  // ends with a barrier
        matmul_team(1, &wt, K, M, q, dx, bsum, tiles, ys, ldys, 0, scalar);
    }
    free(tiles);
    return 0;
}

// Whether 1..8 weights all take K-value activation rows quantised with one block size.
static int linears_fit(int count, const gguf_weight *wts, int64_t K) {
    if (count < 1 || count > 8) return 0;
    for (int i = 0; i < count; i++)
        if (!weight_fits(&wts[i], K) || activation_block(wts[i].type) != activation_block(wts[0].type))
            return 0;
    return 1;
}

// Inside a parallel region: x (M rows of K values, row stride lda, float32 or bfloat16
// with x_bf16) quantised once into q, dx, bsum (and the tiles where given), then ys[i]
// (M, wts[i].N), contiguous, = x . W_i (+ bias_i), float32 or rounded to bfloat16
// (y_bf16); ends with a barrier, so the whole team may read ys next.
static void linears_team(const void *x, int x_bf16, int64_t M, int64_t K, int64_t lda,
                         int count, const gguf_weight *wts, void *const *ys, int y_bf16,
                         tile_acts *tiles, int8_t *q, float *dx, int16_t *bsum, int scalar) {
    int64_t ldys[8];
    for (int i = 0; i < count; i++) ldys[i] = wts[i].N;
    quantize_team(x, x_bf16, M, K, lda, activation_block(wts[0].type), q, dx, bsum);  // + barrier
    if (tiles) tile_acts_team(q, dx, bsum, K, M, tiles);                            // + barrier
    matmul_team(count, wts, K, M, q, dx, bsum, tiles, ys, ldys, y_bf16, scalar);
#pragma omp barrier
}

// The linear layers that read the same input x (M rows of K values, row stride lda,
// float32 or bfloat16 with x_bf16) in one parallel region: x is quantised once into q
// (M, K), dx (M, K / block), bsum (M, K / 16), then ys[i] (M, wts[i].N), contiguous, =
// x . W_i (+ bias_i), float32 or rounded to bfloat16 (y_bf16). Every value is the one
// quantize_rows_q8 and gguf_matmul (then the bias add and the cast) give.
int gguf_linear(const void *x, int x_bf16, int64_t M, int64_t K, int64_t lda, int count,
                const gguf_weight *wts, void *const *ys, int y_bf16, int8_t *q, float *dx,
                int16_t *bsum, int scalar) {
    if (!linears_fit(count, wts, K)) return -1;
    tile_acts *tiles = tile_acts_alloc(count, wts, K, M, scalar);
#pragma omp parallel
    linears_team(x, x_bf16, M, K, lda, count, wts, ys, y_bf16, tiles, q, dx, bsum, scalar);
    free(tiles);
    return 0;
}

// out (n, K) float: the dequantised rows `ids` of W (the embedding lookup of a tied
// or quantised token table), value for value as ggml dequantises them.
int gguf_dequant_rows(int type, const uint8_t *w, int64_t K, int64_t row_bytes,
                      const int64_t *ids, int64_t n, float *out) {
    const int bv = block_values(type);
    if (!bv || is_x8(type) || K % bv || row_bytes != K / bv * block_bytes(type))
        return -1;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        float *y = out + i * K;
        for (int64_t b = 0; b < K / bv; b++) {
            if (type == TYPE_Q4_K) {
                const block_q4_K *x = (const block_q4_K *)row + b;
                uint8_t sc[8], mn[8];
                q4k_scales(x->scales, sc, mn);
                const float d = half_to_float(x->d), dmin = half_to_float(x->dmin);
                for (int c = 0; c < 4; c++) {
                    const float d1 = d * sc[2 * c], m1 = dmin * mn[2 * c];
                    const float d2 = d * sc[2 * c + 1], m2 = dmin * mn[2 * c + 1];
                    for (int l = 0; l < 32; l++) *y++ = d1 * (x->qs[32 * c + l] & 0xF) - m1;
                    for (int l = 0; l < 32; l++) *y++ = d2 * (x->qs[32 * c + l] >> 4) - m2;
                }
            } else if (type == TYPE_Q6_K) {
                const block_q6_K *x = (const block_q6_K *)row + b;
                const float d = half_to_float(x->d);
                for (int h = 0; h < 2; h++) {
                    const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
                    const int8_t *sc = x->scales + 8 * h;
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        y[l] = d * sc[is] * (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                        y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                        y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                        y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                    }
                    y += 128;
                }
            } else {
                const block_q8_0 *x = (const block_q8_0 *)row + b;
                const float d = half_to_float(x->d);
                for (int l = 0; l < 32; l++) *y++ = d * x->qs[l];
            }
        }
    }
    return 0;
}

// ---------------------------------------------------------------- attention, row by row
// Softmax attention of T query rows (grouped KV heads) computed one (row, head) at a
// time with a fixed order over the keys: a row's output does not depend on how many
// rows come with it (a GEMM over all rows at once picks its blocking by their count,
// and the int8 activations of the next layer turn its last-bit differences into
// different logits). q (B, T, Hq, d); k, v (B, Hkv, L, d); allowed (B, T, L) or NULL
// for causal with the T queries the last T of the L keys; out (B, T, Hq, d).

// A row of d values of a float32 (bf16 == 0) or bfloat16 tensor as float32 (exact).
// e^x as Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial):
// within 2 ulp, and the vector form below computes the same operations.
#define EXP_MAX 88.3762626647949f
static inline float exp_cephes(float x) {
    x = fminf(fmaxf(x, -EXP_MAX), EXP_MAX);
    const float fx = floorf(x * 1.44269504088896341f + 0.5f);
    x = x - fx * 0.693359375f;
    x = x - fx * -2.12194440e-4f;
    const float z = x * x;
    float y = 1.9875691500E-4f;
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)fx + 127) << 23;
    float p;
    memcpy(&p, &bits, 4);
    return y * p;
}

#if defined(__AVX2__)
ALWAYS_INLINE __m256 exp_cephes8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-EXP_MAX)), _mm256_set1_ps(EXP_MAX));
    const __m256 fx = _mm256_floor_ps(
        _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.0f));
    const __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}
#endif

static inline const float *row_f32(const void *base, int64_t offset, int bf16, int64_t d,
                                   float *buf) {
    if (!bf16) return (const float *)base + offset;
    const uint16_t *h = (const uint16_t *)base + offset;
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i))), 16)));
#endif
    for (; i < d; i++) buf[i] = bf16_to_float(h[i]);
    return buf;
}

// Dot products and updates in one fixed order on every build: 8 lanes (lane l takes
// the elements l, l+8, l+16, ... with one FMA each), the lanes added as below, then the
// elements past the last multiple of 8 one by one (multiply, then add). The portable C
// emulates the lanes, so a row's attention has the same bits on every build.
#if defined(__AVX2__)
ALWAYS_INLINE float dot_lanes_total(__m256 acc) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
}
#endif

static inline float dot_f32(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float s;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    s = dot_lanes_total(acc);
#else
    float acc[8] = {0};
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    const float h0 = acc[0] + acc[4], h1 = acc[1] + acc[5], h2 = acc[2] + acc[6], h3 = acc[3] + acc[7];
    s = (h0 + h2) + (h1 + h3);
#endif
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy_f32(float *y, float a, const float *x, int64_t d) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 av = _mm256_set1_ps(a);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#else
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) y[i + l] = fmaf(a, x[i + l], y[i + l]);
#endif
    for (; i < d; i++) y[i] += a * x[i];
}

#if defined(__AVX2__)
// Eight values of row `row` from element i as float32 (bfloat16 read exactly).
ALWAYS_INLINE __m256 load8_f32(const void *base, int64_t row, int bf16, int64_t i) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + row + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The scores of GN query rows against one key row: dot_f32's operations for each, with
// the key's vectors loaded once for all of them.
ALWAYS_INLINE void group_scores(const float *const *qr, const int GN, const void *k, int64_t krow,
                                int bf16, int64_t d, float scale, float *out) {
    __m256 acc[8];
    for (int g = 0; g < GN; g++) acc[g] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m256 kv = load8_f32(k, krow, bf16, i);
        for (int g = 0; g < GN; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qr[g] + i), kv, acc[g]);
    }
    for (int g = 0; g < GN; g++) {
        float s = dot_lanes_total(acc[g]);
        for (int64_t e = i; e < d; e++) {
            const float kf = bf16 ? bf16_to_float(((const uint16_t *)k)[krow + e]) : ((const float *)k)[krow + e];
            s += qr[g][e] * kf;
        }
        out[g] = scale * s;
    }
}

// o[g][i..i+8*CH) = sum over the live keys j, in key order, of p[g][j] * v_j (one FMA
// each, from 0): axpy_f32's operations, with the GN outputs held in registers.
ALWAYS_INLINE void group_values(float *const *o, const int GN, const int CH, const float *const *p,
                                const uint8_t *const *live, const uint8_t *all_live, const void *v,
                                int64_t vh, int64_t vsl, int bf16, int64_t L, int64_t i) {
    __m256 acc[8][2];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CH; c++) acc[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        if (all_live[j] == 0) continue;  // no head sees this key
        __m256 vv[2];
        for (int c = 0; c < CH; c++) vv[c] = load8_f32(v, vh + j * vsl, bf16, i + 8 * c);
        for (int g = 0; g < GN; g++) {
            if (all_live[j] == 1 && !live[g][j]) continue;  // some heads see it: ask each
            const __m256 pv = _mm256_set1_ps(p[g][j]);
            for (int c = 0; c < CH; c++) acc[g][c] = _mm256_fmadd_ps(pv, vv[c], acc[g][c]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CH; c++) _mm256_storeu_ps(o[g] + i + 8 * c, acc[g][c]);
}

#if defined(__AVX512F__)
ALWAYS_INLINE __m512 load16_f32(const void *base, int64_t row, int bf16, int64_t i) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + row + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// group_values with 16 lanes a vector (AVX512 builds): each element's sum is still its
// own chain of FMAs in key order, so the bits are group_values'.
ALWAYS_INLINE void group_values16(float *const *o, const int GN, const float *const *p,
                                  const uint8_t *const *live, const uint8_t *all_live,
                                  const void *v, int64_t vh, int64_t vsl, int bf16, int64_t L,
                                  int64_t i) {
    __m512 acc[8][2];
    for (int g = 0; g < GN; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        if (all_live[j] == 0) continue;  // no head sees this key
        const __m512 v0 = load16_f32(v, vh + j * vsl, bf16, i);
        const __m512 v1 = load16_f32(v, vh + j * vsl, bf16, i + 16);
        for (int g = 0; g < GN; g++) {
            if (all_live[j] == 1 && !live[g][j]) continue;  // some heads see it: ask each
            const __m512 pv = _mm512_set1_ps(p[g][j]);
            acc[g][0] = _mm512_fmadd_ps(pv, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(pv, v1, acc[g][1]);
        }
    }
    for (int g = 0; g < GN; g++) {
        _mm512_storeu_ps(o[g] + i, acc[g][0]);
        _mm512_storeu_ps(o[g] + i + 16, acc[g][1]);
    }
}
// group_scores for two keys at once, key j in lanes 0-7 and key j + 1 in lanes 8-15 of
// each head's accumulator (qd: each head's q row with every 8 values written twice):
// every key keeps dot_f32's lanes, FMAs and lane additions, so the bits are
// group_scores'.
ALWAYS_INLINE void group_scores_pair(const float *const *qr, const float *const *qd,
                                     const int GN, const void *k, int64_t krow0, int64_t krow1,
                                     int bf16, int64_t d, float scale, float *out0, float *out1) {
    __m512 acc[8];
    for (int g = 0; g < GN; g++) acc[g] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        const __m512 kv = _mm512_castpd_ps(_mm512_insertf64x4(
            _mm512_castpd256_pd512(_mm256_castps_pd(load8_f32(k, krow0, bf16, i))),
            _mm256_castps_pd(load8_f32(k, krow1, bf16, i)), 1));
        for (int g = 0; g < GN; g++) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qd[g] + 2 * i), kv, acc[g]);
    }
    for (int g = 0; g < GN; g++) {
        // dot_lanes_total in each half: (lanes 0-3) + (4-7), then + the pair 2 apart, then
        // + the neighbour
        __m512 h = _mm512_add_ps(acc[g], _mm512_shuffle_f32x4(acc[g], acc[g], _MM_SHUFFLE(2, 3, 0, 1)));
        h = _mm512_add_ps(h, _mm512_permute_ps(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm512_add_ps(h, _mm512_permute_ps(h, _MM_SHUFFLE(2, 3, 0, 1)));
        float s0 = _mm512_cvtss_f32(h), s1 = _mm_cvtss_f32(_mm512_extractf32x4_ps(h, 2));
        for (int64_t e = i; e < d; e++) {
            const float k0 = bf16 ? bf16_to_float(((const uint16_t *)k)[krow0 + e]) : ((const float *)k)[krow0 + e];
            const float k1 = bf16 ? bf16_to_float(((const uint16_t *)k)[krow1 + e]) : ((const float *)k)[krow1 + e];
            s0 += qr[g][e] * k0;
            s1 += qr[g][e] * k1;
        }
        out0[g] = scale * s0;
        out1[g] = scale * s1;
    }
}
#define SCORES2(qr_, qd_, k_, kr0_, kr1_, bf_, d_, sc_, o0_, o1_, GN) \
    group_scores_pair(qr_, qd_, GN, k_, kr0_, kr1_, bf_, d_, sc_, o0_, o1_)
#define VALUES32(o_, p_, s_, al_, v_, vh_, vsl_, bf_, L_, i_, GN) \
    group_values16(o_, GN, p_, s_, al_, v_, vh_, vsl_, bf_, L_, i_)
#endif

#define SCORES(qr_, k_, kr_, bf_, d_, sc_, out_, GN) group_scores(qr_, GN, k_, kr_, bf_, d_, sc_, out_)
#define VALUES2(o_, p_, s_, al_, v_, vh_, vsl_, bf_, L_, i_, GN) \
    group_values(o_, GN, 2, p_, s_, al_, v_, vh_, vsl_, bf_, L_, i_)
#define VALUES1(o_, p_, s_, al_, v_, vh_, vsl_, bf_, L_, i_, GN) \
    group_values(o_, GN, 1, p_, s_, al_, v_, vh_, vsl_, bf_, L_, i_)
#endif

// The largest of s[0..n): what `if (s[j] > m) m = s[j]` from -inf gives (a NaN is
// passed over: vmaxps returns its second operand then), 16 lanes at a time on AVX512.
static inline float scores_max(const float *s, int64_t n) {
    float m = -INFINITY;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(_mm512_loadu_ps(s + j), mv);
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; j < n; j++)
        if (s[j] > m) m = s[j];
    return m;
}

// For each of GN heads (compile-time 1..8): which of keys 0..n-1 it sees (a score above
// -inf in a head that sees any) and the sum of their probabilities, added in key order;
// the GN sums side by side in registers (held in memory, each add waited on the last
// one's store: ~20% of a 1,000-row prefill's attention on the Zen 5).
static inline __attribute__((always_inline)) void live_sums(float *const *sc, float *const *pb,
                                                            const float *mx, uint8_t *const *lvw,
                                                            int64_t n, float *sum, const int GN) {
    float s[8];
    int any[8];
    for (int g = 0; g < GN; g++) {
        s[g] = 0.0f;
        any[g] = mx[g] != -INFINITY;
    }
    for (int64_t j = 0; j < n; j++)
        for (int g = 0; g < GN; g++) {
            const int on = any[g] && sc[g][j] != -INFINITY;
            lvw[g][j] = (uint8_t)on;
            if (on) s[g] += pb[g][j];
        }
    for (int g = 0; g < GN; g++) sum[g] = s[g];
}
#define LIVE(sc_, pb_, mx_, lv_, n_, sum_, GN) live_sums(sc_, pb_, mx_, lv_, n_, sum_, GN)

// q, k, v float32 or bfloat16 (in_bf16; bfloat16 values are read exactly as float32, so
// the result is the float32 computation's) with the last dimension contiguous and the
// other strides given in elements: q (b, t, h), k and v (b, h, l); out (B, T, Hq, d)
// contiguous, float32 or rounded to bfloat16 (out_bf16); allowed (b, t) strides asb, ast
// (0 where broadcast), keys contiguous.
int attention_rows(const void *q, const void *k, const void *v, int in_bf16, int64_t qsb,
                   int64_t qst, int64_t qsh, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb,
                   int64_t vsh, int64_t vsl, const uint8_t *allowed, int64_t asb, int64_t ast,
                   int64_t B, int64_t T,
                   int64_t Hq, int64_t Hkv, int64_t L, int64_t d, float scale, void *out,
                   int out_bf16) {
    if (Hkv <= 0 || Hq % Hkv || T > L) return -2;
    const int64_t G = Hq / Hkv, ls = L > 0 ? L : 1;
    int failed = 0;
#pragma omp parallel
    {
        // per query head of a group: scores and probabilities (2 L), its q row and its
        // output (2 d), which keys it sees (L bytes); one key or value row (d); the keys
        // seen by all, some or none of the group (L bytes)
        const size_t floats = (size_t)(G * (2 * ls + 2 * d) + d + 2 * G * d);
        float *s = (float *)malloc(sizeof(float) * floats + (size_t)((G + 1) * ls));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(3) schedule(static, 1)
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                    if (!s) continue;
                    // The query heads that share this key/value head go through the keys
                    // together (each key and value row read once for the group, the
                    // heads' sums independent); each (row, head) keeps the operation
                    // sequence it has alone, so the bits do not depend on the grouping.
                    float *kvbuf = s + G * (2 * ls + 2 * d);
                    uint8_t *all_live = (uint8_t *)(s + floats);
                    float *qdup = kvbuf + d;  // G rows of 2 d: q rows, 8 values twice
                    const float *qr[G];
                    float *o[G], *sc[G], *pb[G];
                    uint8_t *lvw[G];
                    float mx[G], sum[G];
                    const int64_t kh = b * ksb + kvh * ksh, vh = b * vsb + kvh * vsh;
                    const uint8_t *ok = allowed ? allowed + b * asb + t * ast : NULL;
                    const int64_t last = L - T + t;  // causal: keys 0..last
                    // the keys a loop below visits: past `last` a causal row sees none
                    const int64_t Lk = ok ? L : last + 1;
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t h = kvh * G + g;
                        float *own = s + g * (2 * ls + 2 * d);
                        sc[g] = own;
                        pb[g] = own + ls;
                        qr[g] = row_f32(q, b * qsb + t * qst + h * qsh, in_bf16, d, own + 2 * ls);
                        o[g] = own + 2 * ls + d;
                        lvw[g] = all_live + (g + 1) * ls;
                    }
#if defined(__AVX512F__)
                    const float *qd[G];
                    for (int64_t g = 0; g < G; g++) {
                        float *row = qdup + g * 2 * d;
                        for (int64_t e = 0; e + 8 <= d; e += 8) {
                            memcpy(row + 2 * e, qr[g] + e, 8 * sizeof(float));
                            memcpy(row + 2 * e + 8, qr[g] + e, 8 * sizeof(float));
                        }
                        qd[g] = row;
                    }
#else
                    (void)qdup;
#endif
                    for (int64_t j = 0; j < Lk; j++) {
                        const int seen = ok ? ok[j] != 0 : j <= last;
                        if (!seen) {
                            for (int64_t g = 0; g < G; g++) sc[g][j] = -INFINITY;
                            continue;
                        }
#if defined(__AVX512F__)
                        // the next key seen too: both in one pass
                        if (j + 1 < Lk && (ok ? ok[j + 1] != 0 : j + 1 <= last)) {
                            for (int64_t g0 = 0; g0 < G; g0 += 8) {
                                float part0[8], part1[8];
                                const int gn = (int)(G - g0 < 8 ? G - g0 : 8);
                                BY_ROWS(SCORES2, gn, qr + g0, qd + g0, k, kh + j * ksl,
                                        kh + (j + 1) * ksl, in_bf16, d, scale, part0, part1)
                                for (int g = 0; g < gn; g++) {
                                    sc[g0 + g][j] = part0[g];
                                    sc[g0 + g][j + 1] = part1[g];
                                }
                            }
                            j++;
                            continue;
                        }
#endif
#if defined(__AVX2__)
                        for (int64_t g0 = 0; g0 < G; g0 += 8) {
                            float part[8];
                            const int gn = (int)(G - g0 < 8 ? G - g0 : 8);
                            BY_ROWS(SCORES, gn, qr + g0, k, kh + j * ksl, in_bf16, d, scale, part)
                            for (int g = 0; g < gn; g++) sc[g0 + g][j] = part[g];
                        }
#else
                        const float *kr = row_f32(k, kh + j * ksl, in_bf16, d, kvbuf);
                        for (int64_t g = 0; g < G; g++) sc[g][j] = scale * dot_f32(qr[g], kr, d);
#endif
                    }
                    for (int64_t g = 0; g < G; g++) mx[g] = scores_max(sc[g], Lk);
                    // probabilities in key order; a head that sees no key keeps zeros,
                    // as SDPA's -inf rows
                    // (e^x by Cephes' expf, 8 lanes at a time where the build has them:
                    // the same operations either way; a -inf score gives 0, unused)
                    for (int64_t g = 0; g < G; g++) {
                        if (mx[g] == -INFINITY) continue;
                        int64_t j = 0;
#if defined(__AVX2__)
                        const __m256 m8 = _mm256_set1_ps(mx[g]);
                        for (; j + 8 <= Lk; j += 8)
                            _mm256_storeu_ps(pb[g] + j,
                                             exp_cephes8(_mm256_sub_ps(_mm256_loadu_ps(sc[g] + j), m8)));
#endif
                        for (; j < Lk; j++) pb[g][j] = exp_cephes(sc[g][j] - mx[g]);
                    }
                    for (int64_t g0 = 0; g0 < G; g0 += 8) {
                        const int gn = (int)(G - g0 < 8 ? G - g0 : 8);
#if defined(__AVX2__)
                        BY_ROWS(LIVE, gn, sc + g0, pb + g0, mx + g0, lvw + g0, Lk, sum + g0)
#else
                        live_sums(sc + g0, pb + g0, mx + g0, lvw + g0, Lk, sum + g0, gn);
#endif
                    }
                    // all_live[j]: 0 when no head sees key j, 2 when all do, else 1 (bit 0:
                    // some head does, bit 1: every head so far does)
                    memset(all_live, 2, (size_t)Lk);
                    for (int64_t g = 0; g < G; g++) {
                        const uint8_t *restrict lv = lvw[g];  // not all_live: vectorised
                        uint8_t *restrict al = all_live;
                        for (int64_t j = 0; j < Lk; j++) al[j] = (uint8_t)((al[j] & (2 * lv[j] | 1)) | lv[j]);
                    }
                    for (int64_t j = 0; j < Lk; j++)
                        if (all_live[j] == 3) all_live[j] = 2;
#if defined(__AVX2__)
                    int64_t i = 0;
                    for (int64_t g0 = 0; g0 < G; g0 += 8) {
                        const int gn = (int)(G - g0 < 8 ? G - g0 : 8);
                        int64_t e = 0;
#if defined(__AVX512F__)
                        if (gn <= 6)  // two 16-lane vectors per head fit the 32 registers
                            for (; e + 32 <= d; e += 32)
                                BY_ROWS(VALUES32, gn, o + g0, (const float *const *)(pb + g0),
                                         (const uint8_t *const *)(lvw + g0),
                                         all_live, v, vh, vsl, in_bf16, Lk, e)
#endif
                        if (gn <= 6)  // two vectors per head still fit the registers
                            for (; e + 16 <= d; e += 16)
                                BY_ROWS(VALUES2, gn, o + g0, (const float *const *)(pb + g0),
                                         (const uint8_t *const *)(lvw + g0),
                                         all_live, v, vh, vsl, in_bf16, Lk, e)
                        for (; e + 8 <= d; e += 8)
                            BY_ROWS(VALUES1, gn, o + g0, (const float *const *)(pb + g0),
                                     (const uint8_t *const *)(lvw + g0),
                                     all_live, v, vh, vsl, in_bf16, Lk, e)
                        i = e;
                    }
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t e = i; e < d; e++) o[g][e] = 0.0f;
                    if (i < d)  // the elements past the last multiple of 8, as axpy_f32's tail
                        for (int64_t j = 0; j < Lk; j++) {
                            if (!all_live[j]) continue;
                            const float *vr = row_f32(v, vh + j * vsl, in_bf16, d, kvbuf);
                            for (int64_t g = 0; g < G; g++)
                                if (lvw[g][j])
                                    for (int64_t e = i; e < d; e++) o[g][e] += pb[g][j] * vr[e];
                        }
#else
                    for (int64_t g = 0; g < G; g++)
                        for (int64_t e = 0; e < d; e++) o[g][e] = 0.0f;
                    for (int64_t j = 0; j < Lk; j++) {
                        if (!all_live[j]) continue;
                        const float *vr = row_f32(v, vh + j * vsl, in_bf16, d, kvbuf);
                        for (int64_t g = 0; g < G; g++)
                            if (lvw[g][j]) axpy_f32(o[g], pb[g][j], vr, d);
                    }
#endif
                    for (int64_t g = 0; g < G; g++) {
                        const int64_t at = ((b * T + t) * Hq + kvh * G + g) * d;
                        if (mx[g] != -INFINITY) {
                            const float inv = 1.0f / sum[g];
                            for (int64_t e = 0; e < d; e++) o[g][e] *= inv;
                        }
                        if (out_bf16)
                            for (int64_t e = 0; e < d; e++)
                                ((uint16_t *)out)[at + e] = float_to_bf16(o[g][e]);
                        else
                            memcpy((float *)out + at, o[g], sizeof(float) * (size_t)d);
                    }
                }
        free(s);
    }
    return failed ? -1 : 0;
}

// The float32 form with contiguous q (B, T, Hq, d), k and v (B, Hkv, L, d).
int attention_rows_f32(const float *q, const float *k, const float *v, const uint8_t *allowed,
                       int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t L, int64_t d,
                       float scale, float *out) {
    return attention_rows(q, k, v, 0, T * Hq * d, Hq * d, d, Hkv * L * d, L * d, d,
                          Hkv * L * d, L * d, d, allowed, T * L, L, B, T, Hq, Hkv, L, d, scale, out, 0);
}

// ---------------------------------------------------------------- decoder layer glue
// A pre-norm decoder layer (transformers' Qwen2 and Llama: RMSNorm, q/k/v, RoPE,
// attention, o, residual; RMSNorm, gate/up, SiLU x up, down, residual) in bfloat16,
// around its attention (which stays the caller's: its cache and its masks):
// layer_pre is the norm, the q/k/v projections and RoPE; layer_post the o projection,
// both residual adds, the second norm and the MLP, each in one parallel region.
// Why: on 2 cores the target's one-row forward spent ~14 of ~75 ms in the ~45 small
// torch operations a layer runs around its projections. Every elementwise step is
// torch's on bfloat16 tensors (float32 arithmetic, then round-to-nearest-even to bf16,
// tensor op by tensor op); the norm's mean of squares adds 8 partial sums in a fixed
// order and SiLU uses expf, so a value can sit one bf16 step from the modules' (tests
// bound it). Each row is computed from its own values only, in one fixed order, so a
// position's hidden states do not depend on how many rows go through beside it.

// The elementwise steps, 8 values at a time where the CPU has AVX2 and one at a time
// elsewhere, with the same float operations in the same order (no fused multiply-adds:
// -ffp-contract=off), so every build gives the same bits.
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

static inline uint16_t bf16_mul(uint16_t a, uint16_t b) {
    return float_to_bf16(bf16_to_float(a) * bf16_to_float(b));
}

static inline uint16_t bf16_add(uint16_t a, uint16_t b) {
    return float_to_bf16(bf16_to_float(a) + bf16_to_float(b));
}

// SiLU(g) rounded to bf16, times u, rounded to bf16.
static inline uint16_t silu_times(float g, float u) {
    return float_to_bf16(round_bf16(g / (1.0f + exp_cephes(-g))) * u);
}

#if defined(__AVX2__)
ALWAYS_INLINE __m256 load_bf16x8(const uint16_t *p) { return load8_f32(p, 0, 1, 0); }
ALWAYS_INLINE void store_bf16x8(uint16_t *p, __m256 v) { put_outputs8(p, 1, 0, v, NULL); }
ALWAYS_INLINE __m256 round_bf16x8(__m256 v) {
    uint16_t h[8];
    store_bf16x8(h, v);
    return load_bf16x8(h);
}

#endif

#if defined(__AVX512F__)
// 16-lane forms for the AVX512 builds: float_to_bf16's integer steps in registers (the
// 8-lane round trip goes through memory), the same bits lane for lane.
ALWAYS_INLINE __m512i bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(h, nan, _mm512_set1_epi32(0x7fc0));
}
ALWAYS_INLINE __m512 load_bf16x16(const uint16_t *p) { return load16_f32(p, 0, 1, 0); }
ALWAYS_INLINE void store_bf16x16(uint16_t *p, __m512 v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
ALWAYS_INLINE __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
ALWAYS_INLINE __m512 exp_cephes16(__m512 x) {  // exp_cephes8's operations
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-EXP_MAX)), _mm512_set1_ps(EXP_MAX));
    const __m512 fx = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), x), _mm512_set1_ps(1.0f));
    const __m512i n = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
    return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(n, 23)));
}
#endif

// y[i] = x[i] + o[i] (bf16), values i0..i1-1.
static void add_bf16(const uint16_t *x, const uint16_t *o, uint16_t *y, int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(__AVX512F__)
    for (; i + 16 <= i1; i += 16)
        store_bf16x16(y + i, _mm512_add_ps(load_bf16x16(x + i), load_bf16x16(o + i)));
#endif
#if defined(__AVX2__)
    for (; i + 8 <= i1; i += 8)
        store_bf16x8(y + i, _mm256_add_ps(load_bf16x8(x + i), load_bf16x8(o + i)));
#endif
    for (; i < i1; i++) y[i] = bf16_add(x[i], o[i]);
}

// act[i] = SiLU(gate[i]) x up[i], each rounded to bf16 as torch's bf16 tensors.
static void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *act, int64_t i0,
                          int64_t i1) {
    int64_t i = i0;
#if defined(__AVX512F__)
    for (; i + 16 <= i1; i += 16) {
        const __m512 g = load_bf16x16(gate + i);
        const __m512 e = exp_cephes16(_mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u))));
        const __m512 s = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store_bf16x16(act + i, _mm512_mul_ps(s, load_bf16x16(up + i)));
    }
#endif
#if defined(__AVX2__)
    for (; i + 8 <= i1; i += 8) {
        const __m256 g = load_bf16x8(gate + i);
        const __m256 e = exp_cephes8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
        const __m256 s = round_bf16x8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        store_bf16x8(act + i, _mm256_mul_ps(s, load_bf16x8(up + i)));
    }
#endif
    for (; i < i1; i++) act[i] = silu_times(bf16_to_float(gate[i]), bf16_to_float(up[i]));
}

// y = RMSNorm(x) for one row of K bf16 values: x * (1 / sqrt(mean(x^2) + eps)) rounded
// to bf16, times the bf16 weight, rounded to bf16. The squares go into 8 partial sums
// (value i into sum i % 8), added in lanes_total's order.
static void rms_norm_row(const uint16_t *x, const uint16_t *w, int64_t K, float eps,
                         uint16_t *y) {
    float part[LANES] = {0};
    int64_t i = 0;
#if defined(__AVX2__)
    __m256 acc = _mm256_setzero_ps();
    for (; i + LANES <= K; i += LANES) {
        const __m256 v = load_bf16x8(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    _mm256_storeu_ps(part, acc);
#endif
    for (; i < K; i++) {
        const float v = bf16_to_float(x[i]);
        part[i % LANES] += v * v;
    }
    const float r = 1.0f / sqrtf(lanes_total(part) / (float)K + eps);
    i = 0;
#if defined(__AVX512F__)
    const __m512 vr16 = _mm512_set1_ps(r);
    for (; i + 16 <= K; i += 16) {
        const __m512 n = round_bf16x16(_mm512_mul_ps(load_bf16x16(x + i), vr16));
        store_bf16x16(y + i, _mm512_mul_ps(load_bf16x16(w + i), n));
    }
#endif
#if defined(__AVX2__)
    const __m256 vr = _mm256_set1_ps(r);
    for (; i + 8 <= K; i += 8) {
        const __m256 n = round_bf16x8(_mm256_mul_ps(load_bf16x8(x + i), vr));
        store_bf16x8(y + i, _mm256_mul_ps(load_bf16x8(w + i), n));
    }
#endif
    for (; i < K; i++) y[i] = bf16_mul(w[i], float_to_bf16(bf16_to_float(x[i]) * r));
}

// RoPE on one head of d values in place: x * cos + rotate_half(x) * sin, each product
// and the sum rounded to bf16 (rotate_half: [-x2, x1]).
static void rope_head(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t d) {
    const int64_t half = d / 2;
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= half; i += 8) {
        const __m256 a = load_bf16x8(x + i), b = load_bf16x8(x + i + half);
        const __m256 lo = _mm256_add_ps(
            round_bf16x8(_mm256_mul_ps(a, load_bf16x8(cos + i))),
            round_bf16x8(_mm256_mul_ps(_mm256_xor_ps(b, sign), load_bf16x8(sin + i))));
        const __m256 hi = _mm256_add_ps(
            round_bf16x8(_mm256_mul_ps(b, load_bf16x8(cos + i + half))),
            round_bf16x8(_mm256_mul_ps(a, load_bf16x8(sin + i + half))));
        store_bf16x8(x + i, lo);
        store_bf16x8(x + i + half, hi);
    }
#endif
    for (; i < half; i++) {
        const uint16_t a = x[i], b = x[i + half];
        x[i] = bf16_add(bf16_mul(a, cos[i]), bf16_mul(b ^ 0x8000u, sin[i]));
        x[i + half] = bf16_add(bf16_mul(b, cos[i + half]), bf16_mul(a, sin[i + half]));
    }
}

enum { CHUNK = 2048 };  // elementwise values a thread takes at a time (a multiple of 8)

// h (M, K) bf16 -> qkv[0..2] (M, N_i) bf16: RMSNorm (norm_w, eps) into xn (M, K), the
// three projections, then RoPE (cos, sin: (M, d) bf16) on every d-value head of the
// first two. q, dx, bsum: room for M x K quantised values. Returns -1 where a weight
// does not fit K or a projection is not whole heads.
int layer_pre(const uint16_t *h, int64_t M, int64_t K, const uint16_t *norm_w, float eps,
              const gguf_weight *wts, void *const *qkv, const uint16_t *cos,
              const uint16_t *sin, int64_t d, uint16_t *xn, int8_t *q, float *dx,
              int16_t *bsum, int scalar) {
    if (!linears_fit(3, wts, K) || d < 2 || d % 2 || wts[0].N % d || wts[1].N % d) return -1;
    tile_acts *tiles = tile_acts_alloc(3, wts, K, M, scalar);
    const int64_t hq = wts[0].N / d, hk = wts[1].N / d;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) rms_norm_row(h + m * K, norm_w, K, eps, xn + m * K);
        linears_team(xn, 1, M, K, K, 3, wts, qkv, 1, tiles, q, dx, bsum, scalar);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * (hq + hk); i++) {
            const int64_t m = i / (hq + hk), j = i % (hq + hk);
            uint16_t *x = j < hq ? (uint16_t *)qkv[0] + (m * hq + j) * d
                                 : (uint16_t *)qkv[1] + (m * hk + j - hq) * d;
            rope_head(x, cos + m * d, sin + m * d, d);
        }
    }
    free(tiles);
    return 0;
}

// The rest of the layer: out (M, K) bf16 = h + o(attn); then out += down(SiLU(gate) x
// up) of RMSNorm(out) (post_w, eps), every step rounded to bf16 as torch's bf16
// tensors. attn (M, Ka) bf16; wts: o, gate, up, down (gate and up of width I).
// Scratch: xn (M, K) and mid (3 x M x I) bf16; q, dx, bsum: room for M x max(Ka, K, I).
int layer_post(const uint16_t *h, const uint16_t *attn, int64_t M, int64_t K, int64_t Ka,
               const gguf_weight *wts, const uint16_t *post_w, float eps, uint16_t *out,
               uint16_t *xn, uint16_t *mid, int8_t *q, float *dx, int16_t *bsum, int scalar) {
    const gguf_weight *o = wts, *gate_up = wts + 1, *down = wts + 3;
    const int64_t I = gate_up[0].N;
    if (o->N != K || gate_up[1].N != I || down->N != K || !linears_fit(1, o, Ka) ||
        !linears_fit(2, gate_up, K) || !linears_fit(1, down, I))
        return -1;
    tile_acts *t_o = tile_acts_alloc(1, o, Ka, M, scalar);
    tile_acts *t_gu = tile_acts_alloc(2, gate_up, K, M, scalar);
    tile_acts *t_d = tile_acts_alloc(1, down, I, M, scalar);
    uint16_t *gate = mid, *up = mid + M * I, *act = mid + 2 * M * I;
    void *o_out[1] = {xn}, *gu_out[2] = {gate, up}, *d_out[1] = {xn};
#pragma omp parallel
    {
        linears_team(attn, 1, M, Ka, Ka, 1, o, o_out, 1, t_o, q, dx, bsum, scalar);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            add_bf16(h, xn, out, m * K, (m + 1) * K);
            rms_norm_row(out + m * K, post_w, K, eps, xn + m * K);
        }
        linears_team(xn, 1, M, K, K, 2, gate_up, gu_out, 1, t_gu, q, dx, bsum, scalar);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < (M * I + CHUNK - 1) / CHUNK; c++)
            silu_mul_bf16(gate, up, act, c * CHUNK, c * CHUNK + CHUNK < M * I ? c * CHUNK + CHUNK : M * I);
        linears_team(act, 1, M, I, I, 1, down, d_out, 1, t_d, q, dx, bsum, scalar);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < (M * K + CHUNK - 1) / CHUNK; c++)
            add_bf16(out, xn, out, c * CHUNK, c * CHUNK + CHUNK < M * K ? c * CHUNK + CHUNK : M * K);
    }
    free(t_o);
    free(t_gu);
    free(t_d);
    return 0;
}

// One decoder layer of layers_step: its weights (q, k, v; o, gate, up, down), norms,
// the attention's scale, and this step's cache room for its keys and values,
// (B, Hkv, *_room_rows, d) bf16 with slots [0, n) filled.
typedef struct {
    const gguf_weight *qkv, *post;
    const uint16_t *in_norm, *post_norm;
    float in_eps, post_eps, scale;
    uint16_t *k_room, *v_room;
    int64_t k_room_rows, v_room_rows;
} step_layer;

// The scratch layers_step carves, in bytes: M rows' q, k, v and attention outputs,
// the norms' and the MLP's intermediates (I: the widest gate), a second output
// buffer, and the activation quantisation's room (64-byte aligned parts).
static int64_t step_parts(int64_t M, int64_t K, int64_t Hq, int64_t Hkv, int64_t d, int64_t I,
                          int64_t sizes[10]) {
    int64_t widest = K > Hq * d ? K : Hq * d;
    if (I > widest) widest = I;
    const int64_t bf = (int64_t)sizeof(uint16_t);
    const int64_t part[10] = {bf * M * Hq * d, bf * M * Hkv * d, bf * M * Hkv * d,
                              bf * M * Hq * d, bf * M * K,       bf * 3 * M * I,
                              bf * M * K,      M * widest,       4 * (M * widest / 32 + 1),
                              2 * (M * widest / 16 + 1)};
    int64_t total = 0;
    for (int i = 0; i < 10; i++) {
        sizes[i] = (part[i] + 63) / 64 * 64;
        total += sizes[i];
    }
    return total + 64;
}

int64_t layers_step_scratch(int64_t M, int64_t K, int64_t Hq, int64_t Hkv, int64_t d, int64_t I) {
    int64_t sizes[10];
    return step_parts(M, K, Hq, Hkv, d, I, sizes);
}

// T new rows of each of B batch rows through n_layers layers in one call: h (B*T, K)
// bf16 (not changed) -> out (B*T, K), the last layer's output. Per layer: layer_pre, the
// new keys and values copied into the room's slots [n, n + T), attention_rows over
// slots [0, n + T) (allowed (B, T, n + T) uint8 with strides asb / ast, or NULL:
// causal), layer_post. The calls and copies of the per-layer loop (lean_stack.py), so
// its bits. Why: at a few rows the torch work around a layer's three calls (the cache's
// update, new tensors, the calls' arguments) was ~2.5-4 ms of a ~25 ms 28-layer target
// forward on the 2-core Zen 5. scratch: layers_step_scratch(B*T, K, Hq, Hkv, d, I)
// bytes, I the widest gate. Returns 0, or -2 for weights, rooms or scratch that do not
// fit.
int layers_step(const uint16_t *h, int64_t B, int64_t T, int64_t K, int64_t n_layers,
                const step_layer *layers, const uint16_t *cos, const uint16_t *sin, int64_t Hq,
                int64_t Hkv, int64_t d, int64_t n, const uint8_t *allowed, int64_t asb,
                int64_t ast, uint16_t *out, uint8_t *scratch, int64_t scratch_bytes) {
    const int64_t M = B * T, L = n + T;
    int64_t I = 0;
    for (int64_t i = 0; i < n_layers; i++) {
        const step_layer *ly = layers + i;
        if (ly->qkv[0].N != Hq * d || ly->qkv[1].N != Hkv * d || ly->qkv[2].N != Hkv * d ||
            ly->k_room_rows < L || ly->v_room_rows < L)
            return -2;
        if (ly->post[1].N > I) I = ly->post[1].N;
    }
    int64_t sizes[10];
    if (step_parts(M, K, Hq, Hkv, d, I, sizes) > scratch_bytes) return -2;
    uint8_t *at = (uint8_t *)(((uintptr_t)scratch + 63) / 64 * 64), *part[10];
    for (int i = 0; i < 10; i++) {
        part[i] = at;
        at += sizes[i];
    }
    uint16_t *qb = (uint16_t *)part[0], *kb = (uint16_t *)part[1], *vb = (uint16_t *)part[2];
    uint16_t *attn = (uint16_t *)part[3], *xn = (uint16_t *)part[4], *mid = (uint16_t *)part[5];
    uint16_t *other = (uint16_t *)part[6];
    int8_t *q8 = (int8_t *)part[7];
    float *dx = (float *)part[8];
    int16_t *bsum = (int16_t *)part[9];
    // the layers' outputs alternate between out and other, the last one landing in out
    uint16_t *bufs[2] = {n_layers % 2 ? out : other, n_layers % 2 ? other : out};
    const uint16_t *x = h;
    int rc = 0;
    for (int64_t i = 0; rc == 0 && i < n_layers; i++) {
        const step_layer *ly = layers + i;
        void *qkv_out[3] = {qb, kb, vb};
        if (layer_pre(x, M, K, ly->in_norm, ly->in_eps, ly->qkv, qkv_out, cos, sin, d, xn, q8, dx,
                      bsum, 0))
            return -2;
        for (int64_t m = 0; m < M; m++) {
            const int64_t b = m / T, t = m % T;
            for (int64_t g = 0; g < Hkv; g++) {
                memcpy(ly->k_room + ((b * Hkv + g) * ly->k_room_rows + n + t) * d,
                       kb + (m * Hkv + g) * d, sizeof(uint16_t) * (size_t)d);
                memcpy(ly->v_room + ((b * Hkv + g) * ly->v_room_rows + n + t) * d,
                       vb + (m * Hkv + g) * d, sizeof(uint16_t) * (size_t)d);
            }
        }
        rc = attention_rows(qb, ly->k_room, ly->v_room, 1, T * Hq * d, Hq * d, d,
                            Hkv * ly->k_room_rows * d, ly->k_room_rows * d, d,
                            Hkv * ly->v_room_rows * d, ly->v_room_rows * d, d, allowed, asb, ast,
                            B, T, Hq, Hkv, L, d, ly->scale, attn, 1);
        if (rc) break;
        uint16_t *y = bufs[i % 2];
        if (layer_post(x, attn, M, K, Hq * d, ly->post, ly->post_norm, ly->post_eps, y, xn, mid,
                       q8, dx, bsum, 0))
            return -2;
        x = y;
    }
    return rc;
}
