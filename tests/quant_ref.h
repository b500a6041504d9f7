/* Independent reference codecs for the quantization tests (test_quant.c and
 * the quant fuzz target).  They are written from REFERENCE.md §1 by a
 * different route than engine/model/quant.c: values come from the formulas in
 * double via ldexp, and encoders search every code for the nearest value
 * (ties to the even code) instead of manipulating bit patterns, so an error in
 * one is unlikely to be repeated in the other. */
#ifndef DS41_TESTS_QUANT_REF_H
#define DS41_TESTS_QUANT_REF_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

__attribute__((unused)) static uint32_t ref_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

__attribute__((unused)) static float ref_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Bitwise equality, or both NaN. */
__attribute__((unused)) static int ref_same(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return ref_bits(a) == ref_bits(b);
}

/* §1.1: value of an e4m3fn byte (NaN for 0x7F/0xFF). */
__attribute__((unused)) static double ref_e4m3_value(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double mag;
    if (e == 15 && m == 7) return s ? -NAN : NAN;
    if (e == 0)
        mag = ldexp((double)m, -9);
    else
        mag = ldexp(1.0 + m / 8.0, e - 7);
    return s ? -mag : mag;
}

/* Index of the nearest entry of the ascending table vals[0..n) to a >= 0,
 * ties to the even index. */
__attribute__((unused)) static int ref_nearest_even(const double *vals, int n, double a) {
    int best = 0;
    double best_d = fabs(a - vals[0]);
    for (int i = 1; i < n; i++) {
        double d = fabs(a - vals[i]);
        if (d < best_d || (d == best_d && (i % 2 == 0))) {
            best = i;
            best_d = d;
        }
    }
    return best;
}

/* §1.1 encode: clamp to +-448, nearest code, ties to even; NaN -> 0x7F|sign. */
__attribute__((unused)) static uint8_t ref_e4m3_encode(float v) {
    uint8_t sign = signbit(v) ? 0x80 : 0;
    if (isnan(v)) return sign | 0x7F;
    double a = fabs((double)v);
    if (a > 448.0) a = 448.0;
    double vals[127];
    for (int i = 0; i < 127; i++) vals[i] = ref_e4m3_value((uint8_t)i);
    return (uint8_t)(sign | ref_nearest_even(vals, 127, a));
}

/* §1.3 encode: nearest of the 8 magnitudes after clamping to 6, ties to the
 * even code (which is exactly the threshold table of §1.3); NaN -> +-6 as
 * documented in quant.h. */
__attribute__((unused)) static uint8_t ref_e2m1_encode(float v) {
    static const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    uint8_t sign = signbit(v) ? 8 : 0;
    if (isnan(v)) return sign | 7;
    double a = fabs((double)v);
    if (a > 6.0) a = 6.0;
    return (uint8_t)(sign | ref_nearest_even(mags, 8, a));
}

/* bf16 RNE by comparing the two bf16 neighbours in double (overflow: the
 * neighbour past 0x7F7F counts as 2^128, i.e. inf). */
__attribute__((unused)) static uint16_t ref_bf16_bits(float x) {
    uint32_t u = ref_bits(x);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40);
    uint32_t lo = u & 0xFFFF0000u;
    if (lo == u) return (uint16_t)(u >> 16);
    double a = fabs((double)x);
    double lo_v = fabs((double)ref_from_bits(lo));
    uint32_t hi = lo + 0x10000u;
    double hi_v = (hi & 0x7FFFFFFFu) == 0x7F800000u ? ldexp(1.0, 128) : fabs((double)ref_from_bits(hi));
    double dlo = a - lo_v, dhi = hi_v - a;
    if (dlo < dhi || (dlo == dhi && ((lo >> 16) & 1) == 0)) return (uint16_t)(lo >> 16);
    return (uint16_t)(hi >> 16);
}

/* §1.2 steps 2-4 via frexp: t = fp32(amax * recip) (the double product of two
 * floats is exact, its conversion rounds once); byte = 127 + ceil(log2 t).
 * t == 0 -> 0; t subnormal -> 1 (the reference's bit rule, documented in
 * quant.h); t inf/NaN or needing 2^128 -> 255. */
__attribute__((unused)) static uint8_t ref_ue8m0_byte(float amax, float recip) {
    float t = (float)((double)amax * (double)recip);
    t = fabsf(t);
    if (isnan(t) || isinf(t)) return 255;
    if (t == 0.0f) return 0;
    if (t < 0x1p-126f) return 1;
    int e;
    float f = frexpf(t, &e); /* t = f * 2^e, f in [0.5, 1) */
    int k = f == 0.5f ? e - 1 : e;
    if (k > 127) return 255;
    return (uint8_t)(k + 127);
}

/* 2^(b-127), NaN for 255. */
__attribute__((unused)) static float ref_ue8m0_value(uint8_t b) {
    return b == 255 ? NAN : (float)ldexp(1.0, b - 127);
}

/* max |x[i * stride]| for i < n, in double, NaN if any element is NaN
 * (torch's amax propagates NaN), then floored like torch's clamp_min. */
__attribute__((unused)) static float ref_amax_floored(const float *x, size_t n, size_t stride, float floor) {
    double amax = 0;
    for (size_t i = 0; i < n; i++) {
        double a = fabs((double)x[i * stride]);
        if (isnan(a)) return NAN;
        if (a > amax) amax = a;
    }
    return amax < (double)floor ? floor : (float)amax;
}

/* e2m1 magnitude/sign value of a 4-bit code. */
__attribute__((unused)) static double ref_e2m1_value(uint8_t c) {
    static const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    double m = mags[c & 7];
    return (c & 8) ? -m : m;
}

#endif
