/* The canonical arithmetic (REFERENCE.md §10): exact sums rounded once,
 * means, special values, rope frequencies and rotation, elementwise
 * functions. */
#include "engine/model/quant.h"
#include "engine/backend/refmath.h"
#include "tests/float_bits.h"
#include "tests/tap.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next64(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}


static float naive_sum(const double *t, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += t[i];
    return (float)s;
}

/* Independent oracle for terms that are multiples of 2^-60 below 2^60: the
 * sum is an exact 128-bit integer; the compiler's int128 -> float conversion
 * rounds it correctly (RNE), and scaling by 2^-60 is exact (no underflow in
 * the range used). */
__extension__ typedef __int128 i128;
static float oracle_sum(const double *t, size_t n) {
    i128 s = 0;
    for (size_t i = 0; i < n; i++) s += (i128)ldexp(t[i], 60);
    return ldexpf((float)s, -60);
}

static double rand_term(void) {
    /* A random double in +-[2^-8, 2^50) with a random 53-bit significand,
     * a multiple of 2^-60; sometimes a float-aligned or tie-making value. */
    int e = (int)(next64() % 58) - 8;
    double m = (double)(next64() >> 11) / 9007199254740992.0; /* [0, 1) */
    double v = ldexp(1.0 + m, e);
    switch (next64() % 6) {
    case 0: v = (double)(float)v; break;          /* an fp32 value */
    case 1: v = ldexp(1.0, e); break;             /* a power of two (half-ulp builder) */
    default: break;
    }
    return next64() & 1 ? -v : v;
}

static void test_sums(void) {
    /* Naive double summation loses the low term; the exact sum does not:
     * 1 + 2^-24 + 2^-80 is just above the tie between 1 and 1 + 2^-23. */
    double t1[] = {1.0, 0x1p-24, 0x1p-80};
    TAP_CHECK(same(sum_of(t1, 3), 1.0f + 0x1p-23f) && same(naive_sum(t1, 3), 1.0f),
              "exact sum breaks a double-rounding tie upward where naive double summation gives 1.0");
    double t2[] = {1.0, 0x1p-24, -0x1p-80};
    TAP_CHECK(same(sum_of(t2, 3), 1.0f), "a residual just below the tie rounds down");
    double t3[] = {1e30, 1.0, -1e30};
    TAP_CHECK(same(sum_of(t3, 3), 1.0f) && same(naive_sum(t3, 3), 0.0f), "cancellation keeps the small term");
    double t4[] = {1.0, 0x1p-24};
    TAP_CHECK(same(sum_of(t4, 2), 1.0f), "an exact tie rounds to even (down)");
    double t5[] = {1.0 + 0x1p-23, 0x1p-24};
    TAP_CHECK(same(sum_of(t5, 2), 1.0f + 0x1p-22f), "an exact tie rounds to even (up)");

    /* Special values (shared decisions with the numpy reference). */
    double z1[] = {1.0, -1.0};
    double z2[] = {-0.0, -0.0};
    TAP_CHECK(same(sum_of(z1, 2), 0.0f) && same(sum_of(z2, 2), 0.0f) && same(sum_of(z2, 0), 0.0f),
              "an exact zero is +0 (also for -0 terms and no terms)");
    double u1[] = {-0x1p-200};
    TAP_CHECK(same(sum_of(u1, 1), -0.0f), "a negative value below half the smallest subnormal rounds to -0");
    double u2[] = {0x1p-149, 0x1p-150};
    double u3[] = {0x1p-150, 0x1p-180};
    TAP_CHECK(same(sum_of(u2, 2), 0x1p-148f) && same(sum_of(u3, 2), 0x1p-149f),
              "subnormal grid: 1.5 units ties to even (2), just above half a unit rounds up");
    double o1[] = {0x1p127, 0x1p127};
    double o2[] = {(double)FLT_MAX, 0x1p103};
    double o3[] = {(double)FLT_MAX, 0x1p102};
    TAP_CHECK(isinf(sum_of(o1, 2)) && isinf(sum_of(o2, 2)) && same(sum_of(o3, 2), FLT_MAX),
              "overflow: 2^128 and FLT_MAX + half ulp round to inf, less stays FLT_MAX");
    double n1[] = {1.0, NAN};
    double n2[] = {INFINITY, -INFINITY};
    double n3[] = {INFINITY, 5.0, 1e300};
    TAP_CHECK(isnan(sum_of(n1, 2)) && isnan(sum_of(n2, 2)) && sum_of(n3, 3) == INFINITY,
              "non-finite terms follow IEEE addition");
    double big[] = {1e308, 1e308, -1e308, -1e308, 3.0};
    TAP_CHECK(same(sum_of(big, 5), 3.0f), "intermediate sums beyond the double range stay exact");
    double tiny[] = {0x1p-1074, 0x1p-1074, -0x1p-1073, 0x1p-100};
    TAP_CHECK(same(sum_of(tiny, 4), 0x1p-100f), "double subnormal terms are exact");

    /* Random sums against the int128 oracle, including long ones. */
    int ok = 1;
    size_t bad_case = 0;
    double t[300];
    for (size_t c = 0; c < 20000 && ok; c++) {
        size_t n = 1 + next64() % (c % 10 == 0 ? 300 : 12);
        for (size_t i = 0; i < n; i++) t[i] = rand_term();
        /* Sometimes cancel everything but a tail, to reach small results. */
        if (c % 7 == 0 && n >= 4) {
            t[n - 1] = 0;
            double s = 0;
            for (size_t i = 0; i + 2 < n; i++) s += t[i];
            t[n - 2] = -s;
        }
        float want = oracle_sum(t, n), got = sum_of(t, n);
        if (!same(want, got) && !(want == 0 && got == 0)) {
            ok = 0;
            bad_case = c;
        }
    }
    TAP_CHECK(ok, "20000 random sums (up to 300 terms) equal the int128 oracle (first bad: %zu)",
                               bad_case);

    /* Many terms: carries are propagated before a limb could overflow. */
    ds41_xacc a;
    ds41_xacc_init(&a);
    for (int i = 0; i < 3000000; i++) ds41_xacc_add(&a, 4294967295.0);
    for (int i = 0; i < 3000000; i++) ds41_xacc_add(&a, -4294967295.0);
    ds41_xacc_add(&a, 0.25);
    TAP_CHECK(same(ds41_xacc_round(&a), 0.25f), "6 million large terms cancel exactly");
    TAP_CHECK(same(ds41_xacc_round(&a), 0.0f), "the accumulator is reset after rounding");

    /* The fast paths (double sum + error bound) fall back to the exact
     * accumulator when the bound straddles a rounding boundary. */
    float f1[3] = {1.0f, 0x1p-24f, 0x1p-80f};
    float f2[3] = {1.0f, 0x1p-24f, -0x1p-80f};
    float f3[2] = {1.0f, -1.0f};
    float f4[2] = {-0x1p-149f, 0x1p-149f * 0.0f};
    TAP_CHECK(same(ds41_xsum_f32(f1, 3), 1.0f + 0x1p-23f) && same(ds41_xsum_f32(f2, 3), 1.0f) &&
                  same(ds41_xsum_f32(f3, 2), 0.0f) && same(ds41_xsum_f32(f4, 2), -0x1p-149f),
              "xsum_f32 on ties, cancellation and subnormals equals the exact rule");
    float f5[2] = {1.0f, 0x1p-24f}, f6[2] = {1.0f + 0x1p-23f, 0x1p-24f};
    float f7[3] = {0x1p-24f, 1.0f, 0x1p-24f}; /* exact, not a tie: 1 + 2^-23 */
    TAP_CHECK(same(ds41_xsum_f32(f5, 2), 1.0f) && same(ds41_xsum_f32(f6, 2), 1.0f + 0x1p-22f) &&
                  same(ds41_xsum_f32(f7, 3), 1.0f + 0x1p-23f),
              "exact double sums on an fp32 tie round to even (the provably-exact second chance)");
    ok = 1;
    for (size_t c = 0; c < 20000 && ok; c++) {
        size_t n = 1 + next64() % (c % 10 == 0 ? 300 : 12);
        float fx[300], fy[300];
        uint16_t by[300];
        for (size_t i = 0; i < n; i++) {
            fx[i] = (float)rand_term();
            fy[i] = c % 3 == 0 ? 1.0f : (float)(rand_term() / 1024.0);
            by[i] = ds41_bf16_bits(fy[i]);
            t[i] = (double)fx[i] * (double)fy[i];
        }
        if (c % 5 == 0 && n >= 2) { /* provoke ties: a float plus half its ulp */
            fx[0] = 1.0f;
            fy[0] = 1.0f;
            fx[1] = 0x1p-24f;
            fy[1] = 1.0f;
            for (size_t i = 2; i < n; i++) fx[i] = (float)ldexp(fx[i], -90);
            for (size_t i = 0; i < n; i++) t[i] = (double)fx[i] * (double)fy[i];
        }
        ok &= same(ds41_xdot_f32(fx, fy, n), sum_of(t, n));
        ok &= same(ds41_xsum_f64(t, n), sum_of(t, n));
        for (size_t i = 0; i < n; i++) t[i] = (double)fx[i] * (double)ds41_bf16_to_f32(by[i]);
        ok &= same(ds41_xdot_f32_bf16(fx, by, n), sum_of(t, n));
        if (!ok) bad_case = c;
    }
    TAP_CHECK(ok, "20000 random dot products (fast path or fallback) equal the exact accumulator (first bad: %zu)",
              bad_case);

    /* Dot products of fp32 vectors: products are exact in double. */
    float x[3] = {16777216.0f, 1.0f, -16777216.0f}, y[3] = {3.0f, 0.5f, 3.0f};
    TAP_CHECK(same(ds41_xdot_f32(x, y, 3), 0.5f), "dot product with cancellation");
    uint16_t yb[3] = {ds41_bf16_bits(3.0f), ds41_bf16_bits(0.5f), ds41_bf16_bits(3.0f)};
    TAP_CHECK(same(ds41_xdot_f32_bf16(x, yb, 3), 0.5f), "dot product against bf16 weights");
}

static void test_means(void) {
    ds41_xacc a;
    ds41_xacc_init(&a);
    ds41_xacc_add(&a, 1.0);
    TAP_CHECK(same(ds41_xacc_round_div(&a, 3), 1.0f / 3.0f), "1/3 rounds once");
    /* (2^24 + 1) / 2 = 2^23 + 0.5 -> tie -> even 2^23 (8388608).  A residual
     * below the quotient's bits must break such ties: (2^24 + 1 + 2^-30)/2. */
    ds41_xacc_add(&a, 16777217.0);
    float t1 = ds41_xacc_round_div(&a, 2);
    ds41_xacc_add(&a, 16777217.0);
    ds41_xacc_add(&a, 0x1p-30);
    float t2 = ds41_xacc_round_div(&a, 2);
    TAP_CHECK(same(t1, 8388608.0f) && same(t2, 8388609.0f), "division ties and the sticky residual");
    ds41_xacc_add(&a, -7.0);
    TAP_CHECK(same(ds41_xacc_round_div(&a, 5120), -7.0f / 5120.0f), "negative mean over 5120");
    float x[4] = {1.0f, 2.0f, 3.0f, 4.0f};
    TAP_CHECK(same(ds41_mean_sq_f32(x, 4), 7.5f), "mean of squares");
    int okm = 1;
    for (int c = 0; c < 5000 && okm; c++) {
        float v[64];
        size_t n = 1 + next64() % 64;
        for (size_t i = 0; i < n; i++) v[i] = (float)rand_term();
        if (c % 4 == 0) v[0] = 0x1p-70f;
        ds41_xacc_init(&a);
        for (size_t i = 0; i < n; i++) {
            float sq = v[i] * v[i];
            ds41_xacc_add(&a, (double)sq);
        }
        okm &= same(ds41_mean_sq_f32(v, n), ds41_xacc_round_div(&a, n));
    }
    TAP_CHECK(okm, "mean of squares: the fast path agrees with the exact accumulator");
    float y[2] = {1.0f + 0x1p-12f, 0.0f};
    /* square = 1 + 2^-11 + 2^-24 rounds to fp32 first: 1 + 2^-11 (tie? no:
     * 2^-24 is exactly half an ulp of [1,2) -> even), then /2. */
    TAP_CHECK(same(ds41_mean_sq_f32(y, 2), (1.0f + 0x1p-11f) / 2.0f), "squares are rounded to fp32 before summing");
    int ok = 1;
    for (int c = 0; c < 2000 && ok; c++) {
        double t[8];
        size_t n = 1 + next64() % 8;
        for (size_t i = 0; i < n; i++) t[i] = rand_term();
        uint64_t d = 1 + next64() % 30000;
        ds41_xacc_init(&a);
        for (size_t i = 0; i < n; i++) ds41_xacc_add(&a, t[i]);
        float got = ds41_xacc_round_div(&a, d);
        /* Oracle: exact int128 sum S (in units of 2^-60); q = floor(|S| * 2^k / d)
         * with a sticky bit, k chosen so q has >= 64 bits of room. */
        i128 s = 0;
        for (size_t i = 0; i < n; i++) s += (i128)ldexp(t[i], 60);
        if (s == 0) {
            ok = same(got, 0.0f);
            continue;
        }
        int neg = s < 0;
        unsigned __int128 mag = neg ? (unsigned __int128)(-s) : (unsigned __int128)s;
        int k = 0;
        while (mag < ((unsigned __int128)1 << 100)) {
            mag <<= 1;
            k++;
        }
        unsigned __int128 q = mag / d, r = mag % d;
        q = (q << 1) | (r != 0); /* sticky bit below */
        float want = ldexpf((float)q, -60 - k - 1);
        ok = same(got, neg ? -want : want);
    }
    TAP_CHECK(ok, "2000 random exact sums divided by 1..30000 equal the int128 oracle");
}

static void test_elementwise(void) {
    TAP_CHECK(ds41_rm_sigmoid(0.0f) == 0.5f && ds41_rm_silu(0.0f) == 0.0f, "sigmoid(0) = 0.5, silu(0) = 0");
    TAP_CHECK(same(ds41_rm_softplus(21.0f), 21.0f) && same(ds41_rm_softplus(20.0f), (float)log1p(exp(20.0))),
              "softplus returns x above 20 and log1p(exp(x)) at 20");
    TAP_CHECK(same(ds41_rm_rsqrt(4.0f), 0.5f) && same(ds41_rm_rsqrt(2.0f), (float)(1.0 / sqrt(2.0))),
              "rsqrt is 1/sqrt in double, rounded once");
    TAP_CHECK(same(ds41_rm_exp(1.0f), (float)exp(1.0)) && same(ds41_rm_sqrt(2.0f), (float)sqrt(2.0)),
              "exp and sqrt are the double functions rounded once");
    TAP_CHECK(same(ds41_rm_silu(3.0f), (float)(3.0 / (1.0 + exp(-3.0)))), "silu = x / (1 + exp(-x)) in double");
}

static void test_rope(void) {
    /* Released compressed layers: base 160000, orig 65536, factor 16, beta 32/1:
     * low 15, high 25 (§2.6) -> pairs 0..15 keep the plain frequency, pairs
     * 25..31 are divided by 16, pairs between blend. */
    float f[32], plain[32];
    ds41_rope_freqs(64, 160000.0, 0, 16.0, 32.0, 1.0, plain);
    ds41_rope_freqs(64, 160000.0, 65536, 16.0, 32.0, 1.0, f);
    int ok_plain = plain[0] == 1.0f;
    for (int i = 0; i < 32; i++) {
        float e = (float)(2 * i) / 64.0f;
        ok_plain &= same(plain[i], 1.0f / (float)pow(160000.0, (double)e));
    }
    TAP_CHECK(ok_plain, "plain frequencies f_i = fp32(1 / fp32(pow(base, fp32(2i/64))))");
    int ok_low = 1, ok_high = 1, ok_mid = 1;
    for (int i = 0; i <= 15; i++) ok_low &= same(f[i], plain[i]);
    for (int i = 25; i < 32; i++) ok_high &= same(f[i], plain[i] / 16.0f);
    for (int i = 16; i < 25; i++) ok_mid &= f[i] < plain[i] && f[i] > plain[i] / 16.0f;
    TAP_CHECK(ok_low && ok_high && ok_mid, "YaRN at the released constants: low 15, high 25");
    /* ramp at i = 20: (20-15)/10 = 0.5 -> f/16 * 0.5 + f * 0.5 */
    float r20 = (plain[20] / 16.0f) * 0.5f + plain[20] * 0.5f;
    TAP_CHECK(same(f[20], r20), "blend at the ramp midpoint");

    float cs[32 * 2];
    ds41_rope_cos_sin(plain, 32, 0, cs);
    int ok0 = 1;
    for (int i = 0; i < 32; i++) ok0 &= cs[2 * i] == 1.0f && cs[2 * i + 1] == 0.0f;
    TAP_CHECK(ok0, "position 0 rotates by nothing");
    ds41_rope_cos_sin(plain, 32, 12345, cs);
    TAP_CHECK(same(cs[2], (float)cos((double)(12345.0f * plain[1]))), "angle fp32(fp32(t) * f), cos in double");
    float x[64], y[64];
    for (int i = 0; i < 64; i++) x[i] = ds41_bf16_round((float)((int)(next64() % 2001) - 1000) / 250.0f);
    memcpy(y, x, sizeof x);
    ds41_rope_apply(y, 32, cs, 0);
    int rounded = 1;
    for (int i = 0; i < 64; i++) rounded &= same(y[i], ds41_bf16_round(y[i]));
    float a = x[2], b = x[3], c = cs[2], s = cs[3];
    float ac = a * c, bs = b * s, as = a * s, bc = b * c;
    TAP_CHECK(rounded && same(y[2], ds41_bf16_round(ac - bs)) && same(y[3], ds41_bf16_round(as + bc)),
              "rope: (a c - b s, a s + b c) with products rounded, bf16 write-back");
    ds41_rope_apply(y, 32, cs, 1);
    float worst = 0;
    for (int i = 0; i < 64; i++) {
        float d = fabsf(y[i] - x[i]) / (fabsf(x[i]) + 0.1f);
        worst = d > worst ? d : worst;
    }
    TAP_CHECK(worst < 0.05f, "inverse rope undoes rope up to bf16 rounding (worst %g)", (double)worst);
}

int main(void) {
    test_sums();
    test_means();
    test_elementwise();
    test_rope();
    return tap_done();
}
