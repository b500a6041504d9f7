/* Random linear layers for the numeric tests of the linear ops (test_ops_fast.c,
 * test_cuda_linear.c): FP8 / FP4 / BF16 weights of any shape with their exact
 * dequantized values, bf16 inputs and their act_quant QDQ (for the error
 * bounds' sum of |x w|).  Header-only, like tap.h. */
#ifndef DS41_TESTS_LINEAR_DATA_H
#define DS41_TESTS_LINEAR_DATA_H

#include "engine/model/quant.h"
#include "engine/model/weights.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct lin_data {
    ds41_linear w;
    uint8_t *q, *sc;
    uint16_t *bf;
    float *x, *wd, *xq; /* input rows, dequantized weights, QDQ'd input rows */
    size_t M, N, K;
} lin_data;

/* Random weights with per-block magnitudes that differ by powers of two (the
 * ue8m0 scales vary across blocks), and M rows of bf16 inputs, every 7th
 * value 8x larger; urand gives [-1, 1). */
__attribute__((unused)) static void lin_data_make(ds41_linear_kind kind, size_t M, size_t N, size_t K,
                                                  double (*urand)(void), lin_data *d) {
    const size_t kb = (K + 31) / 32;
    float *w = malloc(N * K * sizeof *w + 1);
    for (size_t n = 0; n < N; n++)
        for (size_t k = 0; k < K; k++)
            w[n * K + k] = (float)(urand() * ldexp(1.0, -(int)((n / 32 + k / 32 + n) % 5)));
    memset(d, 0, sizeof *d);
    d->M = M, d->N = N, d->K = K;
    d->w.kind = kind;
    d->w.n = (int64_t)N;
    d->w.k = (int64_t)K;
    d->wd = malloc(N * K * sizeof *d->wd + 1);
    if (kind == DS41_LINEAR_FP8) {
        d->q = malloc(N * K + 1);
        d->sc = malloc(((N + 31) / 32) * kb + 1);
        ds41_quant_fp8_weight(w, N, K, d->q, d->sc);
        ds41_dequant_fp8_weight(d->q, d->sc, N, K, d->wd);
    } else if (kind == DS41_LINEAR_FP4) {
        d->q = malloc(N * ((K + 1) / 2) + 1);
        d->sc = malloc(N * kb + 1);
        ds41_quant_fp4_weight(w, N, K, d->q, d->sc);
        ds41_dequant_fp4_weight(d->q, d->sc, N, K, d->wd);
    } else {
        d->bf = malloc(N * K * sizeof *d->bf + 1);
        for (size_t i = 0; i < N * K; i++) {
            d->bf[i] = ds41_bf16_bits(w[i]);
            d->wd[i] = ds41_bf16_to_f32(d->bf[i]);
        }
        d->w.bf16 = d->bf;
    }
    if (kind != DS41_LINEAR_BF16) {
        d->w.q = d->q;
        d->w.scale = d->sc;
        d->w.scale_cols = (int64_t)kb;
    }
    free(w);
    d->x = malloc(M * K * sizeof *d->x + 1);
    d->xq = malloc(M * K * sizeof *d->xq + 1);
    for (size_t i = 0; i < M * K; i++)
        d->x[i] = ds41_bf16_round((float)(urand() * 2.0 * (i % 7 == 3 ? 8.0 : 1.0)));
    memcpy(d->xq, d->x, M * K * sizeof *d->xq);
    if (kind != DS41_LINEAR_BF16)
        for (size_t m = 0; m < M; m++) ds41_act_quant_qdq(d->xq + m * K, K);
}

__attribute__((unused)) static void lin_data_free(lin_data *d) {
    free(d->q);
    free(d->sc);
    free(d->bf);
    free(d->x);
    free(d->wd);
    free(d->xq);
}

#endif
