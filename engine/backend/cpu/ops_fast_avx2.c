/* AVX2 kernels of the fast CPU backend (fast_kernels.h, cpu_backend.h), for x86-64 CPUs
 * with AVX2, FMA and F16C (Haswell and later, and AVX-512 CPUs without
 * AVX512_BF16/VBMI).  Compiled for that target with function attributes;
 * only called after cpuid said the CPU has it.
 *
 * Linear layers: a task decodes the weight rows of its columns into an fp32
 * panel (exact values, scales folded in: e4m3 codes through the fp16
 * conversion, e2m1 nibbles through a byte shuffle, bf16 by a shift) and runs
 * a 2-row x 4-column tile of 8-lane FMA accumulators over every row.  Each
 * output element is one 8-lane accumulator over K in order, then a fixed
 * horizontal tree, whatever the tile shape (the invariance rule).  A task
 * of at most 2 rows decodes 4 columns SLAB values at a time into an L1 slab
 * instead (slab_cols): the same values and order, so the same bits and the
 * same error bound (cpu_backend.h: exact products, fp32 accumulation).
 * Activations are the exact fp32 values in K order. */
#include "engine/backend/cpu/fast_kernels.h"

#include "engine/backend/refmath.h"

#if defined(__x86_64__)

#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

static float e2m1_mag[8] __attribute__((aligned(32)));

static void init(void) {
    for (int i = 0; i < 8; i++) e2m1_mag[i] = ds41_e2m1_table[i];
}

static inline float hsum8(__m256 v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

static size_t pad32(size_t K) {
    return (K + 31) / 32 * 32;
}

/* fp32 [Kp] exact values in K order, then codes and scale bytes (FP8/FP4). */
static size_t row_bytes(ds41_linear_kind kind, size_t K) {
    size_t b = pad32(K) * sizeof(float);
    if (kind != DS41_LINEAR_BF16) b += K + (K + 31) / 32;
    return (b + 63) & ~(size_t)63;
}

static size_t act_bytes(ds41_linear_kind kind, size_t K, size_t M) {
    return row_bytes(kind, K) * M;
}

static void pack_act(ds41_linear_kind kind, const float *x, size_t K, size_t M, size_t m, uint8_t *act) {
    (void)M;
    float *v = (float *)(act + m * row_bytes(kind, K));
    const size_t Kp = pad32(K);
    if (kind == DS41_LINEAR_BF16) {
        for (size_t k = 0; k < K; k++) v[k] = fast_bf16_round(x[k]);
    } else {
        uint8_t *codes = (uint8_t *)(v + Kp), *sb = codes + K;
        ds41_act_quant(x, K, codes, sb);
        for (size_t k = 0; k < K; k++) v[k] = ds41_e4m3_table[codes[k]] * fast_ue8m0(sb[k / 32]);
    }
    for (size_t k = K; k < Kp; k++) v[k] = 0.0f;
}

static size_t scratch_bytes(ds41_linear_kind kind, size_t rows, size_t K) {
    (void)kind;
    (void)rows;
    return FAST_COLS * pad32(K) * sizeof(float) + 64;
}

/* ---- weight decoding into an fp32 panel row [Kp] ------------------------------------- */

static void decode_bf16_row(const uint16_t *w, size_t K, float *out) {
    size_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + k)));
        _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(d, 16)));
    }
    for (; k < K; k++) out[k] = fast_f32_from_bits((uint32_t)w[k] << 16);
    for (; k < pad32(K); k++) out[k] = 0.0f;
}

/* e4m3 row with the 32x32 block scales of its group. */
static void decode_fp8_row(const uint8_t *q, const uint8_t *sc, size_t K, float *out) {
    const __m128i hmask = _mm_set1_epi16((short)0xBFFF);
    const __m256 k256 = _mm256_set1_ps(256.0f);
    size_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(q + k));
        const float s = fast_ue8m0(sc[k / 32]);
        /* NaN codes (and a NaN scale) take the table: the fp16 trick below
         * maps 0x7F to a number. */
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(raw, _mm256_set1_epi8(0x7F)),
                                                   _mm256_set1_epi8(0x7F))) != 0) {
            for (size_t i = 0; i < 32; i++) out[k + i] = ds41_e4m3_table[q[k + i]] * s;
            continue;
        }
        const __m256 sv = _mm256_set1_ps(s);
        for (size_t i = 0; i < 32; i += 8) {
            /* e4m3 -> fp16 bit pattern of value / 256: (b << 8) >> 1 (arithmetic)
             * puts the sign in bit 15 (and 14), exponent and mantissa in 13..7. */
            __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(q + k + i)));
            h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(h, 8), 1), hmask);
            const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(h), k256), sv);
            _mm256_storeu_ps(out + k + i, v);
        }
    }
    for (; k < K; k++) out[k] = ds41_e4m3_table[q[k]] * fast_ue8m0(sc[k / 32]);
    for (; k < pad32(K); k++) out[k] = 0.0f;
}

/* e2m1 row (low nibble first) with its per-32 scales. */
static void decode_fp4_row(const uint8_t *q, const uint8_t *sc, size_t K, float *out) {
    /* 2 * e2m1 as signed bytes (-0 -> 0: only the sign of an exact zero sum
     * could differ). */
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nib = _mm_set1_epi8(15);
    size_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + k / 2));
        const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
        const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
        const __m256 s = _mm256_set1_ps(0.5f * fast_ue8m0(sc[k / 32]));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0)), s));
        _mm256_storeu_ps(out + k + 8,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8))), s));
        _mm256_storeu_ps(out + k + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1)), s));
        _mm256_storeu_ps(out + k + 24,
                         _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8))), s));
    }
    for (; k < K; k++) out[k] = ds41_e2m1_table[(q[k / 2] >> ((k & 1) * 4)) & 15] * fast_ue8m0(sc[k / 32]);
    for (; k < pad32(K); k++) out[k] = 0.0f;
}

/* ---- the register tile (see ops_fast_avx512.c) ------------------------------------------ */

/* Adds to acc[r][c] the products of A rows r < R (stride lda) and W rows
 * c < C (stride ldw) over nq groups of 8 values, in order. */
static inline __attribute__((always_inline)) void tile_acc(const int R, const int C, const float *A,
                                                           size_t lda, const float *W, size_t ldw, size_t nq,
                                                           __m256 acc[2][4]) {
    for (size_t q = 0; q < nq; q++) {
        __m256 a[2];
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) a[r] = _mm256_loadu_ps(A + (size_t)r * lda + q * 8);
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const __m256 w = _mm256_loadu_ps(W + (size_t)c * ldw + q * 8);
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(a[r], w, acc[r][c]);
        }
    }
}

static inline __attribute__((always_inline)) void tile_zero(const int R, const int C, __m256 acc[2][4]) {
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
}

static inline __attribute__((always_inline)) void tile_out(const int R, const int C, __m256 acc[2][4],
                                                           float *y, size_t ldy, int out_bf16) {
#pragma GCC unroll 2
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            const float v = hsum8(acc[r][c]);
            y[(size_t)r * ldy + (size_t)c] = out_bf16 ? fast_bf16_round(v) : v;
        }
}

static inline __attribute__((always_inline)) void tile(const int R, const int C, const float *A, size_t lda,
                                                       const float *W, size_t ldw, size_t nq, float *y,
                                                       size_t ldy, int out_bf16) {
    __m256 acc[2][4];
    tile_zero(R, C, acc);
    tile_acc(R, C, A, lda, W, ldw, nq, acc);
    tile_out(R, C, acc, y, ldy, out_bf16);
}

static void run_tile(int R, int C, const float *A, size_t lda, const float *W, size_t ldw, size_t nq,
                     float *y, size_t ldy, int out_bf16) {
    switch (R * 16 + C) {
    case 0x11:
        tile(1, 1, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x12:
        tile(1, 2, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x13:
        tile(1, 3, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x14:
        tile(1, 4, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x21:
        tile(2, 1, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x22:
        tile(2, 2, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x23:
        tile(2, 3, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    case 0x24:
        tile(2, 4, A, lda, W, ldw, nq, y, ldy, out_bf16);
        break;
    default:
        break;
    }
}

/* Weight row n's values [k0, k0 + len) (k0 a multiple of 32) into dst,
 * zeros up to pad32(len): the same values a whole row's decode gives. */
static void decode_span(const ds41_linear *w, size_t n, size_t k0, size_t len, float *dst) {
    const size_t K = (size_t)w->k;
    switch (w->kind) {
    case DS41_LINEAR_BF16:
        decode_bf16_row(w->bf16 + n * K + k0, len, dst);
        break;
    case DS41_LINEAR_FP8:
        decode_fp8_row(w->q + n * K + k0, w->scale + (n / 32) * (size_t)w->scale_cols + k0 / 32, len, dst);
        break;
    case DS41_LINEAR_FP4:
        decode_fp4_row(w->q + n * fast_row_bytes(w) + k0 / 2, w->scale + n * (size_t)w->scale_cols + k0 / 32,
                       len, dst);
        break;
    default:
        memset(dst, 0, pad32(len) * sizeof *dst);
    }
}

/* Tasks of at most 2 rows (decode steps, MoE experts): 4 columns at a time
 * decoded SLAB values at a time into an L1 slab, not the task's whole panel
 * (32 rows of K fp32, far more than L1, written and read back for one row).
 * The values and each element's accumulator over K in order are the panel
 * path's: the same result bits (the invariance rule). */
#define SLAB 256
#define SLAB_AHEAD 8 /* rows ahead prefetched: later columns of this task or the next task */

static inline __attribute__((always_inline)) void slab_cols(const int R, const int C, const ds41_linear *w,
                                                            size_t n, const float *A, size_t lda, float *tmp,
                                                            float *y, size_t ldy, int out_bf16) {
    const size_t K = (size_t)w->k;
    const size_t bpv = w->kind == DS41_LINEAR_BF16  ? 4
                       : w->kind == DS41_LINEAR_FP8 ? 2
                                                    : 1; /* 2 x bytes per value */
    const char *base = w->kind == DS41_LINEAR_BF16 ? (const char *)w->bf16 : (const char *)w->q;
    const size_t rowb = w->kind == DS41_LINEAR_BF16 ? 2 * K : fast_row_bytes(w);
    __m256 acc[2][4];
    tile_zero(R, C, acc);
    for (size_t k0 = 0; k0 < K; k0 += SLAB) {
        const size_t len = K - k0 < SLAB ? K - k0 : SLAB;
        for (int c = 0; c < C; c++) {
            const char *ahead = base + (n + (size_t)c + SLAB_AHEAD) * rowb + k0 * bpv / 2;
            for (size_t b = 0; b < len * bpv / 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
            decode_span(w, n + (size_t)c, k0, len, tmp + (size_t)c * SLAB);
        }
        tile_acc(R, C, A + k0, lda, tmp, SLAB, pad32(len) / 8, acc);
    }
    tile_out(R, C, acc, y, ldy, out_bf16);
}

static void run_slab_cols(int R, int C, const ds41_linear *w, size_t n, const float *A, size_t lda,
                          float *tmp, float *y, size_t ldy, int out_bf16) {
#define SLAB_CASE(R_, C_)                                                                                    \
    case (R_)*16 + (C_):                                                                                     \
        slab_cols(R_, C_, w, n, A, lda, tmp, y, ldy, out_bf16);                                              \
        break;
    /* clang-format off */
    switch (R * 16 + C) {
        SLAB_CASE(1, 1) SLAB_CASE(1, 2) SLAB_CASE(1, 3) SLAB_CASE(1, 4)
        SLAB_CASE(2, 1) SLAB_CASE(2, 2) SLAB_CASE(2, 3) SLAB_CASE(2, 4)
    default:
        break;
    }
    /* clang-format on */
#undef SLAB_CASE
}

static void linear_cols(const ds41_linear *w, const uint8_t *act, size_t M, size_t m0, size_t m1, size_t n0,
                        size_t n1, float *y, int out_bf16, void *scratch, fast_prefetch *next) {
    (void)next; /* the slab path prefetches its own rows ahead */
    (void)M;
    const size_t K = (size_t)w->k, N = (size_t)w->n, Kp = pad32(K), act_stride = row_bytes(w->kind, K);
    float *panel = scratch;
    if (m1 - m0 <= 2) {
        for (size_t n = n0; n < n1; n += 4)
            run_slab_cols((int)(m1 - m0), (int)(n1 - n < 4 ? n1 - n : 4), w, n,
                          (const float *)(act + m0 * act_stride), act_stride / sizeof(float), panel,
                          y + m0 * N + n, N, out_bf16);
        return;
    }
    for (size_t n = n0; n < n1; n++) decode_span(w, n, 0, K, panel + (n - n0) * Kp);
    const size_t lda = act_stride / sizeof(float);
    for (size_t n = n0; n < n1; n += 4) {
        const int C = (int)(n1 - n < 4 ? n1 - n : 4);
        for (size_t m = m0; m < m1; m += 2) {
            const int R = (int)(m1 - m < 2 ? m1 - m : 2);
            run_tile(R, C, (const float *)(act + m * act_stride), lda, panel + (n - n0) * Kp, Kp, Kp / 8,
                     y + m * N + n, N, out_bf16);
        }
    }
}

/* ---- vector primitives ------------------------------------------------------------------ */

static inline double hsum4d(__m256d v) {
    const __m128d a = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(a, _mm_unpackhi_pd(a, a)));
}

/* Two 4-lane double accumulators over i % 8, then (0+1) and the tree; the
 * tail in scalar order after. */
static double dot64(const float *a, const float *b, size_t n) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        s0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + i)), _mm256_cvtps_pd(_mm_loadu_ps(b + i)), s0);
        s1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + i + 4)),
                             _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4)), s1);
    }
    double t = hsum4d(_mm256_add_pd(s0, s1));
    for (; i < n; i++) t += (double)a[i] * (double)b[i];
    return t;
}

static double sumsq64(const float *x, size_t n) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), q = _mm256_mul_ps(v, v);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(q)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1)));
    }
    double t = hsum4d(_mm256_add_pd(s0, s1));
    for (; i < n; i++) {
        const float q = x[i] * x[i];
        t += (double)q;
    }
    return t;
}

static void axpy64(double *y, float a, const float *x, size_t n) {
    const __m256d av = _mm256_set1_pd((double)a);
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        _mm256_storeu_pd(y + i,
                         _mm256_fmadd_pd(av, _mm256_cvtps_pd(_mm_loadu_ps(x + i)), _mm256_loadu_pd(y + i)));
    for (; i < n; i++) y[i] = __builtin_fma((double)a, (double)x[i], y[i]);
}

/* e4m3 -> exact fp32 (see ops_fast_avx512.c), 8 at a time. */
static void decode_ring_row(const uint8_t *row, size_t dim, float *out) {
    const __m256i fieldmask = _mm256_set1_epi32((int)0x87F00000u), m7f = _mm256_set1_epi32(0x7F);
    const __m256 nan = _mm256_set1_ps(__builtin_nanf("")), big = _mm256_set1_ps(0x1p120f);
    for (size_t i = 0; i < dim; i += 8) {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)));
        const __m256i bits = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 4), fieldmask);
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), big),
                                 _mm256_set1_ps(fast_ue8m0(row[dim + i / 32])));
        v = _mm256_blendv_ps(v, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(d, m7f), m7f)));
        _mm256_storeu_ps(out + i, v);
    }
}

static void decode_latent(const uint8_t *e, size_t dim, float *out) {
    const __m256 tab = _mm256_load_ps(e2m1_mag);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), seven = _mm256_set1_epi32(7),
                  eight = _mm256_set1_epi32(8);
    const uint8_t *sc = e + dim / 2;
    for (size_t i = 0; i < dim; i += 8) {
        uint32_t four;
        memcpy(&four, e + i / 2, 4);
        const __m128i b = _mm_cvtsi32_si128((int)four);
        const __m256i d = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)), shifts);
        const __m256 mag = _mm256_permutevar8x32_ps(tab, _mm256_and_si256(d, seven));
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(d, eight), 28);
        const __m256 v = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, _mm256_set1_ps(ds41_e4m3_table[sc[i / 16]])));
    }
}

static uint64_t read_sum(const void *p, size_t bytes) {
    const char *c = p;
    __m256i a = _mm256_setzero_si256(), b = a, d = a, e = a;
    for (size_t i = 0; i < bytes; i += 128) {
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(c + i)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(c + i + 32)));
        d = _mm256_xor_si256(d, _mm256_load_si256((const __m256i *)(c + i + 64)));
        e = _mm256_xor_si256(e, _mm256_load_si256((const __m256i *)(c + i + 96)));
    }
    a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(d, e));
    return (uint64_t)_mm256_extract_epi64(a, 0) ^ (uint64_t)_mm256_extract_epi64(a, 1) ^
           (uint64_t)_mm256_extract_epi64(a, 2) ^ (uint64_t)_mm256_extract_epi64(a, 3);
}

static float fma_burn(size_t iters, float seed) {
    __m256 s[12];
    for (int l = 0; l < 12; l++) s[l] = _mm256_set1_ps(seed + (float)l);
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (size_t i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int l = 0; l < 12; l++) s[l] = _mm256_fmadd_ps(s[l], a, b);
    __m256 t = s[0];
    for (int l = 1; l < 12; l++) t = _mm256_add_ps(t, s[l]);
    return hsum8(t);
}

static void exp_libm(const float *x, float *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = ds41_rm_exp(x[i]);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

const fast_kernels ds41__fast_avx2 = {
    .level = DS41_CPU_AVX2,
    .init = init,
    .act_bytes = act_bytes,
    .pack_act = pack_act,
    .pack_rows = 1,
    .scratch_bytes = scratch_bytes,
    .linear_cols = linear_cols,
    .dot = dot64,
    .sumsq = sumsq64,
    .axpy = axpy64,
    .exp = exp_libm,
    .decode_ring_row = decode_ring_row,
    .decode_latent = decode_latent,
    .read_sum = read_sum,
    .fma_burn = fma_burn,
    .fma_lanes = 8,
};

#endif
