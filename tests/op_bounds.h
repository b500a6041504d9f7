/* What a backend's op may differ from the reference by, for the op tests of every backend
 * (tests/test_ops_fast.c: the fast CPU levels; tests/gpu/op_check.c: any backend through its
 * memory, the CUDA one on a device): the random inputs they draw and the comparisons with the
 * bounds the fast path documents (engine/backend/cpu/cpu_backend.h "Numerics"), kept in one
 * place so that every backend is held to the same ones. */
#ifndef DS41_TESTS_OP_BOUNDS_H
#define DS41_TESTS_OP_BOUNDS_H

#include "engine/model/quant.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

static uint64_t bounds_rng = 0x9e3779b97f4a7c15ull;

__attribute__((unused)) static double urand(void) { /* [-1, 1) */
    bounds_rng = bounds_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(bounds_rng >> 11) / 4503599627370496.0 - 1.0;
}

__attribute__((unused)) static float bfr(double x) {
    return ds41_bf16_round((float)x);
}

/* bf16 values of magnitude up to `scale`, every 7th up to 8 x scale. */
__attribute__((unused)) static void fill_bf16(float *x, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) x[i] = bfr(urand() * scale * (i % 7 == 3 ? 8.0 : 1.0));
}

/* |a - b| within the fp32 accumulation bound of K exact products (sum of
 * magnitudes s) and, for bf16 outputs, one bf16 ulp. */
__attribute__((unused)) static int within(float a, float b, double s, size_t K, int bf16_out) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    double tol = 2.0 * (double)(K + 2) * 0x1p-24 * s;
    if (bf16_out) tol += fmax(fabs((double)a), fabs((double)b)) * 0x1p-7;
    return fabs((double)a - (double)b) <= tol + 1e-30;
}

/* mag[m][n] = sum_k |xq[m][k] wd[n][k]|: the magnitude sum within() scales the accumulation
 * bound by (xq: the activations as the linear multiplies them, wd: the dequantized weights). */
__attribute__((unused)) static void linear_magnitudes(const float *xq, const float *wd, size_t M, size_t N,
                                                      size_t K, double *mag) {
    for (size_t m = 0; m < M; m++)
        for (size_t n = 0; n < N; n++) {
            double s = 0;
            for (size_t k = 0; k < K; k++) s += fabs((double)xq[m * K + k] * wd[n * K + k]);
            mag[m * N + n] = s;
        }
}

/* max |a - b| / max |b| over n values <= tol (the layer check's measure). */
__attribute__((unused)) static int rel_close(const float *a, const float *b, size_t n, double tol,
                                             double *got) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) != isnan(b[i])) {
            *got = INFINITY;
            return 0;
        }
        num = fmax(num, fabs((double)a[i] - b[i]));
        den = fmax(den, fabs((double)b[i]));
    }
    *got = den > 0 ? num / den : num;
    return *got <= tol;
}

#endif
