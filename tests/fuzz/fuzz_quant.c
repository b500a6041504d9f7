/* Fuzz target for engine/quant: the input bytes are read as fp32 values (any
 * bit pattern: NaN, inf, subnormals) and every codec and block quantizer is
 * checked against the independent references of tests/quant_ref.h.  A
 * mismatch aborts, so the fuzzer reports it; nothing here may trip ASan or
 * UBSan either.
 *
 * Layout: byte 0 picks the weight row count (1..4), the rest is floats (at
 * most MAX_FLOATS; trailing bytes that do not fill a float are ignored). */
#include "engine/model/quant.h"
#include "tests/quant_ref.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FLOATS 1024

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(int ok, const char *what, size_t i) {
    if (!ok) {
        fprintf(stderr, "fuzz_quant: %s fails at index %zu\n", what, i);
        abort();
    }
}

/* Code c agrees with the reference code want; when the block scale is NaN
 * only "is a NaN code" is required (the sign of x / NaN is not specified). */
static int same_e4m3(uint8_t c, uint8_t want, int nan_scale) {
    return nan_scale ? (c & 0x7F) == 0x7F : c == want;
}

static int same_e2m1(uint8_t c, uint8_t want, int nan_scale) {
    return nan_scale ? (c & 7) == 7 : c == want;
}

static uint8_t nibble(const uint8_t *p, size_t i) {
    return (uint8_t)((p[i / 2] >> (4 * (i % 2))) & 15);
}

static void check_scalars(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        check(ds41_e4m3_from_f32(v) == ref_e4m3_encode(v), "e4m3 encode", i);
        check(ds41_e2m1_from_f32(v) == ref_e2m1_encode(v), "e2m1 encode", i);
        check(ds41_bf16_bits(v) == ref_bf16_bits(v), "bf16 rounding", i);
        float a = fabsf(v);
        check(ds41_ue8m0_scale_byte(a, DS41_FP8_RECIP) == ref_ue8m0_byte(a, DS41_FP8_RECIP), "ue8m0 fp8", i);
        check(ds41_ue8m0_scale_byte(a, DS41_FP4_RECIP) == ref_ue8m0_byte(a, DS41_FP4_RECIP), "ue8m0 fp4", i);
    }
}

/* FP8 1x32 activations: codes and scales against the reference, and
 * qdq == dequant(quant). */
static void check_act(const float *x, size_t n, float *y, float *d, uint8_t *q, uint8_t *s) {
    ds41_act_quant(x, n, q, s);
    for (size_t b = 0; b * 32 < n; b++) {
        size_t len = n - b * 32 < 32 ? n - b * 32 : 32;
        uint8_t sb = ref_ue8m0_byte(ref_amax_floored(x + 32 * b, len, 1, 1e-4f), DS41_FP8_RECIP);
        check(s[b] == sb, "act_quant scale", b);
        double sv = ref_ue8m0_value(sb);
        for (size_t i = 32 * b; i < 32 * b + len; i++)
            check(same_e4m3(q[i], ref_e4m3_encode((float)((double)x[i] / sv)), sb == 255), "act_quant code",
                  i);
    }
    memcpy(y, x, n * sizeof *x);
    ds41_act_quant_qdq(y, n);
    ds41_dequant_fp8_rows_1x32(q, s, 1, n, d);
    for (size_t i = 0; i < n; i++) check(ref_same(y[i], d[i]), "act_quant_qdq == dequant", i);
}

static void check_fp4(const float *x, size_t n, float *y, float *d, uint8_t *p, uint8_t *s) {
    ds41_fp4_act_quant_ue8m0(x, n, p, s);
    for (size_t b = 0; b * 32 < n; b++) {
        size_t len = n - b * 32 < 32 ? n - b * 32 : 32;
        uint8_t sb = ref_ue8m0_byte(ref_amax_floored(x + 32 * b, len, 1, 0x1.8p-124f), DS41_FP4_RECIP);
        check(s[b] == sb, "fp4 ue8m0 scale", b);
        double sv = ref_ue8m0_value(sb);
        for (size_t i = 32 * b; i < 32 * b + len; i++)
            check(same_e2m1(nibble(p, i), ref_e2m1_encode((float)((double)x[i] / sv)), sb == 255),
                  "fp4 ue8m0 code", i);
    }
    if (n % 2) check((p[n / 2] >> 4) == 0, "fp4 ue8m0 odd tail nibble", n);
    memcpy(y, x, n * sizeof *x);
    ds41_fp4_act_quant_ue8m0_qdq(y, n);
    ds41_dequant_fp4_weight(p, s, 1, n, d);
    for (size_t i = 0; i < n; i++) check(ref_same(y[i], d[i]), "fp4 ue8m0 qdq == dequant", i);

    ds41_fp4_act_quant_e4m3(x, n, p, s);
    for (size_t b = 0; b * 16 < n; b++) {
        size_t len = n - b * 16 < 16 ? n - b * 16 : 16;
        float a = ref_amax_floored(x + 16 * b, len, 1, 0x1.8p-7f);
        uint8_t sb = ref_e4m3_encode((float)((double)a / 6.0));
        check(s[b] == sb, "fp4 e4m3 scale", b);
        double sv = ref_e4m3_value(sb);
        for (size_t i = 16 * b; i < 16 * b + len; i++)
            check(same_e2m1(nibble(p, i), ref_e2m1_encode((float)((double)x[i] / sv)), isnan(sv)),
                  "fp4 e4m3 code", i);
    }
    memcpy(y, x, n * sizeof *x);
    ds41_fp4_act_quant_e4m3_qdq(y, n);
    ds41_dequant_fp4_e4m3_1x16(p, s, n, d);
    for (size_t i = 0; i < n; i++) check(ref_same(y[i], d[i]), "fp4 e4m3 qdq == dequant", i);
}

static void check_weights(const float *w, size_t N, size_t K, float *d, uint8_t *q, uint8_t *s) {
    size_t kb = (K + 31) / 32;
    ds41_quant_fp8_weight(w, N, K, q, s);
    ds41_dequant_fp8_weight(q, s, N, K, d);
    for (size_t bn = 0; bn * 32 < N; bn++)
        for (size_t bk = 0; bk < kb; bk++) {
            double amax = 0;
            int has_nan = 0;
            for (size_t r = bn * 32; r < N && r < bn * 32 + 32; r++)
                for (size_t c = bk * 32; c < K && c < bk * 32 + 32; c++) {
                    double a = fabs((double)w[r * K + c]);
                    has_nan |= isnan(a);
                    if (a > amax) amax = a;
                }
            float fa = has_nan ? NAN : (amax < 1e-4 ? 1e-4f : (float)amax);
            uint8_t sb = ref_ue8m0_byte(fa, DS41_FP8_RECIP);
            check(s[bn * kb + bk] == sb, "fp8 weight scale", bn * kb + bk);
            double sv = ref_ue8m0_value(sb);
            for (size_t r = bn * 32; r < N && r < bn * 32 + 32; r++)
                for (size_t c = bk * 32; c < K && c < bk * 32 + 32; c++) {
                    size_t i = r * K + c;
                    uint8_t want = ref_e4m3_encode((float)((double)w[i] / sv));
                    check(same_e4m3(q[i], want, sb == 255), "fp8 weight code", i);
                    check(ref_same(d[i], (float)(ref_e4m3_value(q[i]) * sv)), "fp8 weight dequant", i);
                }
        }

    size_t row_bytes = (K + 1) / 2;
    ds41_quant_fp4_weight(w, N, K, q, s);
    ds41_dequant_fp4_weight(q, s, N, K, d);
    for (size_t r = 0; r < N; r++)
        for (size_t g = 0; g < kb; g++) {
            size_t len = K - g * 32 < 32 ? K - g * 32 : 32;
            uint8_t sb =
                ref_ue8m0_byte(ref_amax_floored(w + r * K + 32 * g, len, 1, 0x1.8p-124f), DS41_FP4_RECIP);
            check(s[r * kb + g] == sb, "fp4 weight scale", r * kb + g);
            double sv = ref_ue8m0_value(sb);
            for (size_t c = 32 * g; c < 32 * g + len; c++) {
                uint8_t code = nibble(q + r * row_bytes, c);
                uint8_t want = ref_e2m1_encode((float)((double)w[r * K + c] / sv));
                check(same_e2m1(code, want, sb == 255), "fp4 weight code", r * K + c);
                check(ref_same(d[r * K + c], (float)(ref_e2m1_value(code) * sv)), "fp4 weight dequant",
                      r * K + c);
            }
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    size_t rows = 1 + data[0] % 4;
    size_t n = (size - 1) / 4;
    if (n > MAX_FLOATS) n = MAX_FLOATS;
    float *x = malloc((n ? n : 1) * sizeof *x);
    float *y = malloc((n ? n : 1) * sizeof *y);
    float *d = malloc((n ? n : 1) * sizeof *d);
    uint8_t *q = malloc(n ? n : 1);
    uint8_t *s = malloc(n ? n : 1);
    if (!x || !y || !d || !q || !s) abort();
    if (n) memcpy(x, data + 1, n * sizeof *x);

    check_scalars(x, n);
    check_act(x, n, y, d, q, s);
    check_fp4(x, n, y, d, q, s);
    size_t K = n / rows;
    check_weights(x, rows, K, d, q, s);

    free(x);
    free(y);
    free(d);
    free(q);
    free(s);
    return 0;
}
