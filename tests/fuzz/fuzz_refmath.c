/* Fuzz target for engine/refmath: the reductions' fast paths (double sum
 * with an error bound, the provably-exact second chance) must always give
 * what the exact accumulator gives, and the accumulator must agree with an
 * independent int128 oracle where one applies.  A mismatch aborts.
 *
 * Layout: byte 0 = mode (low 2 bits) and divisor seed; the rest is read as
 * doubles (mode 0: raw bit patterns, any value; mode 1: the same mapped onto
 * multiples of 2^-60 below 2^50, for the int128 oracle) or as fp32 pairs
 * (mode 2: dot products; mode 3: means of squares). */
#include "engine/backend/refmath.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TERMS 512

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static void check(float got, float want, const char *what) {
    if (isnan(got) && isnan(want)) return;
    if (fbits(got) != fbits(want)) {
        fprintf(stderr, "fuzz_refmath: %s: got %a, want %a\n", what, (double)got, (double)want);
        abort();
    }
}

static float exact(const double *t, size_t n) {
    ds41_xacc a;
    ds41_xacc_init(&a);
    for (size_t i = 0; i < n; i++) ds41_xacc_add(&a, t[i]);
    return ds41_xacc_round(&a);
}

__extension__ typedef __int128 i128;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int mode = data[0] & 3;
    const uint64_t div = 1 + (data[0] >> 2) * 97;
    data++;
    size--;
    static double t[MAX_TERMS];
    static float x[MAX_TERMS], y[MAX_TERMS];
    if (mode <= 1) {
        size_t n = size / 8 < MAX_TERMS ? size / 8 : MAX_TERMS;
        for (size_t i = 0; i < n; i++) {
            uint64_t b;
            memcpy(&b, data + 8 * i, 8);
            memcpy(&t[i], &b, 8);
            if (mode == 1) {
                /* k * 2^-60 with |k| < 2^110: exactly a double when k has <= 53 bits */
                int e = (int)(b >> 56) % 110 - 60;
                double m = (double)((b >> 4) & ((UINT64_C(1) << 40) - 1));
                t[i] = ldexp(m, e < -20 ? -60 : e - 40) * ((b & 1) ? -1.0 : 1.0);
            }
        }
        const float want = exact(t, n);
        check(ds41_xsum_f64(t, n), want, "xsum_f64");
        if (mode == 1) {
            i128 s = 0;
            for (size_t i = 0; i < n; i++) s += (i128)ldexp(t[i], 60);
            float oracle = ldexpf((float)s, -60);
            if (!(oracle == 0 && want == 0)) check(want, oracle, "xacc vs int128");
            ds41_xacc a;
            ds41_xacc_init(&a);
            for (size_t i = 0; i < n; i++) ds41_xacc_add(&a, t[i]);
            (void)ds41_xacc_round_div(&a, div); /* defined for any input */
        }
        return 0;
    }
    size_t n = size / 8 < MAX_TERMS ? size / 8 : MAX_TERMS;
    for (size_t i = 0; i < n; i++) {
        memcpy(&x[i], data + 8 * i, 4);
        memcpy(&y[i], data + 8 * i + 4, 4);
    }
    if (mode == 2) {
        for (size_t i = 0; i < n; i++) t[i] = (double)x[i] * (double)y[i];
        check(ds41_xdot_f32(x, y, n), exact(t, n), "xdot_f32");
        for (size_t i = 0; i < n; i++) t[i] = (double)x[i];
        check(ds41_xsum_f32(x, n), exact(t, n), "xsum_f32");
        return 0;
    }
    if (n == 0) return 0;
    ds41_xacc a;
    ds41_xacc_init(&a);
    for (size_t i = 0; i < n; i++) {
        const float sq = x[i] * x[i];
        ds41_xacc_add(&a, (double)sq);
    }
    check(ds41_mean_sq_f32(x, n), ds41_xacc_round_div(&a, n), "mean_sq_f32");
    return 0;
}
