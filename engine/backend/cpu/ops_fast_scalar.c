/* Scalar kernels of the fast CPU backend (fast_kernels.h, cpu_backend.h): portable C,
 * used where neither AVX2 nor AVX-512 is available and as the baseline the
 * SIMD kernels are tested against.
 *
 * Linear: the packed activation of a row is its exact values in K order
 * (fp32; for FP8/FP4 the quantized values times their 1x32 scales), followed
 * by room for the quantizer's codes.  A task decodes each weight row of its
 * columns once into fp32 (scales folded in: exact) and takes the dot product
 * with every row: eight interleaved fp32 partial sums, then a fixed tree. */
#include "engine/backend/cpu/fast_kernels.h"

#include "engine/backend/refmath.h"

#include <math.h>
#include <stdlib.h>

/* Eight lanes k % 8, combined ((0+1)+(2+3))+((4+5)+(6+7)). */
static float dot8(const float *a, const float *b, size_t n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) {
            const float p = a[i + (size_t)l] * b[i + (size_t)l];
            s[l] = s[l] + p;
        }
    for (int l = 0; i < n; i++, l++) {
        const float p = a[i] * b[i];
        s[l] = s[l] + p;
    }
    const float s01 = s[0] + s[1], s23 = s[2] + s[3], s45 = s[4] + s[5], s67 = s[6] + s[7];
    const float lo = s01 + s23, hi = s45 + s67;
    return lo + hi;
}

static size_t row_bytes(ds41_linear_kind kind, size_t K) {
    size_t b = K * sizeof(float);
    if (kind != DS41_LINEAR_BF16) b += K + (K + 31) / 32; /* codes + scale bytes */
    return (b + 63) & ~(size_t)63;
}

static size_t act_bytes(ds41_linear_kind kind, size_t K, size_t M) {
    return row_bytes(kind, K) * M;
}

static void pack_act(ds41_linear_kind kind, const float *x, size_t K, size_t M, size_t m, uint8_t *act) {
    (void)M;
    float *v = (float *)(act + m * row_bytes(kind, K));
    if (kind == DS41_LINEAR_BF16) {
        for (size_t k = 0; k < K; k++) v[k] = fast_bf16_round(x[k]);
        return;
    }
    uint8_t *codes = (uint8_t *)(v + K), *sb = codes + K;
    ds41_act_quant(x, K, codes, sb);
    for (size_t k = 0; k < K; k++) v[k] = ds41_e4m3_table[codes[k]] * fast_ue8m0(sb[k / 32]);
}

static size_t scratch_bytes(ds41_linear_kind kind, size_t rows, size_t K) {
    (void)kind;
    (void)rows;
    return K * sizeof(float);
}

/* Weight row n as exact fp32 values. */
static void decode_row(const ds41_linear *w, size_t n, float *out) {
    const size_t K = (size_t)w->k;
    switch (w->kind) {
    case DS41_LINEAR_BF16:
        for (size_t k = 0; k < K; k++) out[k] = fast_f32_from_bits((uint32_t)w->bf16[n * K + k] << 16);
        break;
    case DS41_LINEAR_FP8: {
        const uint8_t *q = w->q + n * K, *sc = w->scale + (n / 32) * (size_t)w->scale_cols;
        for (size_t k = 0; k < K; k++) out[k] = ds41_e4m3_table[q[k]] * fast_ue8m0(sc[k / 32]);
        break;
    }
    case DS41_LINEAR_FP4: {
        const uint8_t *q = w->q + n * fast_row_bytes(w), *sc = w->scale + n * (size_t)w->scale_cols;
        for (size_t k = 0; k < K; k++)
            out[k] = ds41_e2m1_table[(q[k / 2] >> ((k & 1) * 4)) & 15] * fast_ue8m0(sc[k / 32]);
        break;
    }
    default:
        for (size_t k = 0; k < K; k++) out[k] = 0.0f;
    }
}

static void linear_cols(const ds41_linear *w, const uint8_t *act, size_t M, size_t m0, size_t m1, size_t n0,
                        size_t n1, float *y, int out_bf16, void *scratch, fast_prefetch *next) {
    (void)next; /* no software prefetch at this level */
    (void)M;
    const size_t K = (size_t)w->k, N = (size_t)w->n, act_stride = row_bytes(w->kind, K);
    float *wrow = scratch;
    for (size_t n = n0; n < n1; n++) {
        decode_row(w, n, wrow);
        for (size_t m = m0; m < m1; m++) {
            const float v = dot8((const float *)(act + m * act_stride), wrow, K);
            y[m * N + n] = out_bf16 ? fast_bf16_round(v) : v;
        }
    }
}

static double dot64(const float *a, const float *b, size_t n) {
    double s[4] = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++) s[l] += (double)a[i + (size_t)l] * (double)b[i + (size_t)l];
    for (int l = 0; i < n; i++, l++) s[l] += (double)a[i] * (double)b[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static double sumsq64(const float *x, size_t n) {
    double s[4] = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; l++) {
            const float q = x[i + (size_t)l] * x[i + (size_t)l];
            s[l] += (double)q;
        }
    for (int l = 0; i < n; i++, l++) {
        const float q = x[i] * x[i];
        s[l] += (double)q;
    }
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static void axpy64(double *y, float a, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += (double)a * (double)x[i];
}

static void decode_ring_row(const uint8_t *row, size_t dim, float *out) {
    for (size_t i = 0; i < dim; i++) out[i] = ds41_e4m3_table[row[i]] * fast_ue8m0(row[dim + i / 32]);
}

static void decode_latent(const uint8_t *e, size_t dim, float *out) {
    const uint8_t *sc = e + dim / 2;
    for (size_t i = 0; i < dim; i++)
        out[i] = ds41_e2m1_table[(e[i / 2] >> ((i & 1) * 4)) & 15] * ds41_e4m3_table[sc[i / 16]];
}

static void init(void) {}

static uint64_t read_sum(const void *p, size_t bytes) {
    const uint64_t *q = p;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i < bytes / 8; i += 4) {
        a ^= q[i];
        b ^= q[i + 1];
        c ^= q[i + 2];
        d ^= q[i + 3];
    }
    return a ^ b ^ c ^ d;
}

/* Twelve independent chains; fmaf is a single instruction where the
 * hardware has FMA (glibc dispatches at run time). */
static float fma_burn(size_t iters, float seed) {
    float s[12];
    for (int l = 0; l < 12; l++) s[l] = seed + (float)l;
    const float a = 0.999999f, b = 1e-7f;
    for (size_t i = 0; i < iters; i++)
        for (int l = 0; l < 12; l++) s[l] = fmaf(s[l], a, b);
    float t = 0;
    for (int l = 0; l < 12; l++) t += s[l];
    return t;
}

static void exp_libm(const float *x, float *out, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = ds41_rm_exp(x[i]);
}

const fast_kernels ds41__fast_scalar = {
    .level = DS41_CPU_SCALAR,
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
    .fma_lanes = 1,
};
