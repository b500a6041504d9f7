/* Tests for engine/quant.{h,c}: the codecs of REFERENCE.md §1 and the block
 * quantizers of §1.4-1.5 and §2.1.  Expected values are either literals
 * derived by hand in the comments, or come from the independent references in
 * tests/quant_ref.h. */
#include "engine/model/quant.h"
#include "tests/quant_ref.h"
#include "tests/tap.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- small utilities ----------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng_next(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static float rng_uniform(void) { /* [0, 1) */
    return (float)(rng_next() >> 40) * 0x1p-24f;
}

/* A random finite bf16 value with magnitude around 2^e (e +- 4), random sign. */
static float rng_bf16_near(int e) {
    float v = ldexpf(1.0f + rng_uniform(), e - 4 + (int)(rng_next() % 9));
    if (rng_next() & 1) v = -v;
    return ds41_bf16_round(v);
}

static float ulp_up(float x) {
    return nextafterf(x, INFINITY);
}

static float ulp_down(float x) {
    return nextafterf(x, -INFINITY);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        printf("Bail out! out of memory\n");
        exit(1);
    }
    return p;
}

/* ---- e4m3 ---------------------------------------------------------------- */

static void test_e4m3_decode(void) {
    int bad = -1;
    for (int b = 0; b < 256 && bad < 0; b++) {
        double want = ref_e4m3_value((uint8_t)b);
        float t = ds41_e4m3_table[b], f = ds41_e4m3_to_f32((uint8_t)b);
        if (!ref_same(t, (float)want) || !ref_same(f, (float)want)) bad = b;
        if (isnan(want) && (!signbit(t) != !(b & 0x80))) bad = b;
    }
    TAP_CHECK(bad < 0, "all 256 e4m3 codes decode to the §1.1 formula (first bad code %d)", bad);
    TAP_CHECK(ds41_e4m3_to_f32(0x7E) == 448.0f && ds41_e4m3_to_f32(0x08) == 0x1p-6f &&
                  ds41_e4m3_to_f32(0x01) == 0x1p-9f && ds41_e4m3_to_f32(0xFE) == -448.0f,
              "e4m3 landmarks: 0x7E=448, 0x08=2^-6, 0x01=2^-9, 0xFE=-448");
    TAP_CHECK(isnan(ds41_e4m3_to_f32(0x7F)) && isnan(ds41_e4m3_to_f32(0xFF)) &&
                  signbit(ds41_e4m3_to_f32(0x80)) && ds41_e4m3_to_f32(0x80) == 0.0f,
              "0x7F/0xFF are NaN, 0x80 is -0.0");
}

static void test_e4m3_roundtrip(void) {
    int bad = -1;
    for (int b = 0; b < 256 && bad < 0; b++) {
        if ((b & 0x7F) == 0x7F) continue;
        if (ds41_e4m3_from_f32(ds41_e4m3_to_f32((uint8_t)b)) != b) bad = b;
    }
    TAP_CHECK(bad < 0, "encode(decode(b)) == b for all 254 non-NaN codes (first bad code %d)", bad);
    TAP_CHECK(ds41_e4m3_from_f32(ds41_e4m3_to_f32(0x7F)) == 0x7F &&
                  ds41_e4m3_from_f32(ds41_e4m3_to_f32(0xFF)) == 0xFF,
              "both NaN codes stay NaN with their sign");
    TAP_CHECK(ds41_e4m3_from_f32(NAN) == 0x7F && ds41_e4m3_from_f32(-NAN) == 0xFF &&
                  ds41_e4m3_from_f32(ref_from_bits(0x7F800001u)) == 0x7F,
              "NaN inputs (quiet, negative, signalling) give 0x7F|sign");
    TAP_CHECK(ds41_e4m3_from_f32(0.0f) == 0x00 && ds41_e4m3_from_f32(-0.0f) == 0x80,
              "+0 -> 0x00, -0 -> 0x80");
    TAP_CHECK(ds41_e4m3_from_f32(-1e-30f) == 0x80 && ds41_e4m3_from_f32(-0x1p-10f) == 0x80 &&
                  ds41_e4m3_from_f32(1e-30f) == 0x00 && ds41_e4m3_from_f32(0x1p-149f) == 0x00,
              "values rounding to zero keep their sign");
}

static void test_e4m3_ties(void) {
    /* Normal range, binade [1,2), step 1/8: */
    TAP_CHECK(ds41_e4m3_from_f32(1.0625f) == 0x38, "1.0625 (mid 1.0|1.125) -> 1.0 (even m=0)");
    TAP_CHECK(ds41_e4m3_from_f32(1.1875f) == 0x3A, "1.1875 (mid 1.125|1.25) -> 1.25 (even m=2)");
    TAP_CHECK(ds41_e4m3_from_f32(ulp_up(1.0625f)) == 0x39 && ds41_e4m3_from_f32(ulp_down(1.1875f)) == 0x39,
              "just past the midpoints -> 1.125 (0x39)");
    TAP_CHECK(ds41_e4m3_from_f32(-1.0625f) == 0xB8 && ds41_e4m3_from_f32(-1.1875f) == 0xBA,
              "negative ties mirror the positive ones");
    /* Top binade [256, 448], step 32 (384 m=4, 416 m=5, 448 m=6):
     * 432 = mid(416, 448) -> 448 (even m=6); 400 = mid(384, 416) -> 384 (m=4). */
    TAP_CHECK(ds41_e4m3_from_f32(432.0f) == 0x7E, "432 (mid 416|448) -> 448");
    TAP_CHECK(ds41_e4m3_from_f32(400.0f) == 0x7C, "400 (mid 384|416) -> 384");
    /* Subnormal range, grid 2^-9 below 2^-6. */
    TAP_CHECK(ds41_e4m3_from_f32(0x1p-10f) == 0x00, "2^-10 (mid 0|2^-9) -> 0");
    TAP_CHECK(ds41_e4m3_from_f32(ulp_up(0x1p-10f)) == 0x01, "just above 2^-10 -> 2^-9 (0x01)");
    TAP_CHECK(ds41_e4m3_from_f32(0x1.8p-9f) == 0x02, "3*2^-10 (mid 2^-9|2*2^-9) -> 2*2^-9 (0x02)");
    TAP_CHECK(ds41_e4m3_from_f32(0x1.4p-8f) == 0x02, "5*2^-10 (mid 2|3 units) -> 2 units (0x02)");
    TAP_CHECK(ds41_e4m3_from_f32(0x1.cp-8f) == 0x04, "7*2^-10 (mid 3|4 units) -> 4 units (0x04)");
    TAP_CHECK(ds41_e4m3_from_f32(0x1.ep-7f) == 0x08, "15*2^-10 (mid 7 units|2^-6) -> 2^-6 (0x08)");
    TAP_CHECK(ds41_e4m3_from_f32(ulp_down(0x1.ep-7f)) == 0x07, "just below 15*2^-10 -> 7*2^-9 (0x07)");
    TAP_CHECK(ds41_e4m3_from_f32(0x1.1p-6f) == 0x08, "2^-6 * 1.0625 (first normal tie) -> 2^-6");

    /* Every adjacent pair of non-negative codes: the midpoint ties to the even
     * code, one fp32 ulp either side goes to the nearer code; both signs. */
    int bad = -1;
    for (int c = 0; c < 0x7E && bad < 0; c++) {
        float lo = ds41_e4m3_to_f32((uint8_t)c), hi = ds41_e4m3_to_f32((uint8_t)(c + 1));
        float mid = (float)(((double)lo + (double)hi) / 2); /* exact in fp32 */
        int even = (c % 2 == 0) ? c : c + 1;
        for (int s = 0; s < 2; s++) {
            float sg = s ? -1.0f : 1.0f;
            uint8_t sb = s ? 0x80 : 0;
            if (ds41_e4m3_from_f32(sg * lo) != (sb | c) || ds41_e4m3_from_f32(sg * hi) != (sb | (c + 1)) ||
                ds41_e4m3_from_f32(sg * mid) != (sb | even) ||
                ds41_e4m3_from_f32(sg * ulp_down(mid)) != (sb | c) ||
                ds41_e4m3_from_f32(sg * ulp_up(mid)) != (sb | (c + 1)))
                bad = c | (s << 8);
        }
    }
    TAP_CHECK(bad < 0, "all 125 midpoints tie to even, +-1 ulp go to the nearer code (first bad: code %d%s)",
              bad < 0 ? -1 : bad & 0xFF, bad >= 256 ? " negative" : "");
}

static void test_e4m3_saturation(void) {
    TAP_CHECK(ds41_e4m3_from_f32(448.0f) == 0x7E && ds41_e4m3_from_f32(ulp_up(448.0f)) == 0x7E,
              "448 and just above -> 448");
    TAP_CHECK(ds41_e4m3_from_f32(449.0f) == 0x7E && ds41_e4m3_from_f32(464.0f) == 0x7E &&
                  ds41_e4m3_from_f32(480.0f) == 0x7E,
              "449, 464 (would tie to 480 unclamped), 480 -> 448");
    TAP_CHECK(ds41_e4m3_from_f32(1e30f) == 0x7E && ds41_e4m3_from_f32(FLT_MAX) == 0x7E &&
                  ds41_e4m3_from_f32(INFINITY) == 0x7E,
              "1e30, FLT_MAX, +inf -> 448 (0x7E)");
    TAP_CHECK(ds41_e4m3_from_f32(-449.0f) == 0xFE && ds41_e4m3_from_f32(-1e30f) == 0xFE &&
                  ds41_e4m3_from_f32(-INFINITY) == 0xFE,
              "-449, -1e30, -inf -> -448 (0xFE)");
    TAP_CHECK(ds41_e4m3_from_f32(447.0f) == 0x7E && ds41_e4m3_from_f32(ulp_down(432.0f)) == 0x7D,
              "447 -> 448; just below 432 -> 416");
}

static void test_e4m3_random(void) {
    int bad = 0;
    uint32_t first = 0;
    for (int i = 0; i < 300000; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i % 2) { /* concentrate half of the samples on |v| in [2^-12, 2^10) */
            uint32_t e = 127 - 12 + (uint32_t)(rng_next() % 22);
            u = (u & 0x807FFFFFu) | (e << 23);
        }
        float v = ref_from_bits(u);
        if (ds41_e4m3_from_f32(v) != ref_e4m3_encode(v)) {
            if (!bad) first = u;
            bad++;
        }
    }
    TAP_CHECK(bad == 0,
              "300000 random fp32 patterns encode like the nearest-code search (%d bad, first 0x%08X)", bad,
              first);
}

/* ---- e2m1 ---------------------------------------------------------------- */

static void test_e2m1(void) {
    static const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    int bad = -1;
    for (int c = 0; c < 16 && bad < 0; c++)
        if (!ref_same(ds41_e2m1_table[c], want[c]) || !ref_same(ds41_e2m1_to_f32((uint8_t)c), want[c]) ||
            !ref_same(ds41_e2m1_to_f32((uint8_t)(c | 0xF0)), want[c]))
            bad = c;
    TAP_CHECK(bad < 0, "e2m1 table and decode match §1.3, high bits ignored (first bad %d)", bad);

    bad = -1;
    for (int c = 0; c < 16 && bad < 0; c++)
        if (ds41_e2m1_from_f32(want[c]) != c) bad = c;
    TAP_CHECK(bad < 0, "every e2m1 value encodes to its own code, -0 -> 8 (first bad %d)", bad);

    /* threshold, code just below, code at, code just above (§1.3). */
    static const struct {
        float t;
        uint8_t below, at, above;
    } th[7] = {
        {0.25f, 0, 0, 1}, /* stays down to 0 */
        {0.75f, 1, 2, 2}, /* goes up to 1.0 */
        {1.25f, 2, 2, 3}, /* stays at 1.0 */
        {1.75f, 3, 4, 4}, /* goes up to 2.0 */
        {2.5f, 4, 4, 5},  /* stays at 2.0 */
        {3.5f, 5, 6, 6},  /* goes up to 4.0 */
        {5.0f, 6, 6, 7},  /* stays at 4.0 */
    };
    for (int i = 0; i < 7; i++) {
        float t = th[i].t;
        int ok = ds41_e2m1_from_f32(ulp_down(t)) == th[i].below && ds41_e2m1_from_f32(t) == th[i].at &&
                 ds41_e2m1_from_f32(ulp_up(t)) == th[i].above &&
                 ds41_e2m1_from_f32(-ulp_down(t)) == (8 | th[i].below) &&
                 ds41_e2m1_from_f32(-t) == (8 | th[i].at) &&
                 ds41_e2m1_from_f32(-ulp_up(t)) == (8 | th[i].above);
        TAP_CHECK(ok, "e2m1 threshold %g: below -> %d, at -> %d, above -> %d (both signs)", (double)t,
                  th[i].below, th[i].at, th[i].above);
    }
    TAP_CHECK(ds41_e2m1_from_f32(0.0f) == 0 && ds41_e2m1_from_f32(-0.0f) == 8 &&
                  ds41_e2m1_from_f32(-1e-30f) == 8,
              "zero keeps its sign: +0 -> 0, -0 -> 8, -tiny -> 8");
    TAP_CHECK(ds41_e2m1_from_f32(6.5f) == 7 && ds41_e2m1_from_f32(INFINITY) == 7 &&
                  ds41_e2m1_from_f32(-1e30f) == 15 && ds41_e2m1_from_f32(-INFINITY) == 15,
              "outside [-6,6] saturates to +-6");
    TAP_CHECK(ds41_e2m1_from_f32(NAN) == 7 && ds41_e2m1_from_f32(-NAN) == 15, "NaN -> +-6 with its sign bit");

    int nbad = 0;
    uint32_t first = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i % 2) u = (u & 0x807FFFFFu) | ((uint32_t)(127 - 4 + rng_next() % 8) << 23);
        float v = ref_from_bits(u);
        if (ds41_e2m1_from_f32(v) != ref_e2m1_encode(v)) {
            if (!nbad) first = u;
            nbad++;
        }
    }
    TAP_CHECK(nbad == 0, "200000 random fp32 encode like the nearest-code search (%d bad, first 0x%08X)",
              nbad, first);
}

/* ---- ue8m0 --------------------------------------------------------------- */

static void test_ue8m0_decode(void) {
    int bad = -1;
    for (int b = 0; b < 255 && bad < 0; b++)
        if (ds41_ue8m0_to_f32((uint8_t)b) != (float)ldexp(1.0, b - 127)) bad = b;
    TAP_CHECK(bad < 0, "ue8m0 bytes 0..254 decode to 2^(b-127) (first bad %d)", bad);
    TAP_CHECK(ds41_ue8m0_to_f32(0) == 0x1p-127f && ds41_ue8m0_to_f32(0) > 0.0f,
              "byte 0 is 2^-127 (fp32 subnormal), not 0");
    TAP_CHECK(isnan(ds41_ue8m0_to_f32(255)), "byte 255 is NaN");
}

static void test_ue8m0_constants(void) {
    volatile float one = 1.0f, c448 = 448.0f, c6 = 6.0f;
    TAP_CHECK(DS41_FP8_RECIP == one / c448 && ref_bits(DS41_FP8_RECIP) == 0x3B124925u &&
                  DS41_FP8_RECIP == (float)0.0022321429569274187,
              "DS41_FP8_RECIP is fp32(1/448) = 0.0022321429569274187");
    TAP_CHECK(DS41_FP4_RECIP == one / c6 && ref_bits(DS41_FP4_RECIP) == 0x3E2AAAABu &&
                  DS41_FP4_RECIP == (float)0.1666666716337204,
              "DS41_FP4_RECIP is fp32(1/6) = 0.1666666716337204");
    TAP_CHECK(DS41_FP8_AMAX_FLOOR == (float)1e-4 && DS41_FP4_AMAX_FLOOR == ldexpf(6.0f, -126) &&
                  DS41_FP4_E4M3_AMAX_FLOOR == ldexpf(6.0f, -9),
              "amax floors: 1e-4, 6*2^-126, 6*2^-9");
}

static void test_ue8m0_scale(void) {
    /* amax 0 floored to 1e-4: t = fp32(1e-4 * 0.00223214) = 2.2321e-7;
     * 2^-23 = 1.19e-7 < t <= 2^-22 = 2.38e-7 -> k = -22 -> byte 105. */
    TAP_CHECK(ds41_ue8m0_scale_byte(DS41_FP8_AMAX_FLOOR, DS41_FP8_RECIP) == 105,
              "FP8 floor 1e-4 -> 2^-22 (byte 105)");
    /* FP4 floor 6*2^-126: t = 2^-126 * fp32(6 * 0.16666667163) = 2^-126 *
     * (1 + 3e-8) -> rounds to exactly 2^-126 (M = 0) -> k = -126 -> byte 1. */
    TAP_CHECK(ds41_ue8m0_scale_byte(DS41_FP4_AMAX_FLOOR, DS41_FP4_RECIP) == 1,
              "FP4 floor 6*2^-126 -> 2^-126 (byte 1)");
    TAP_CHECK(ds41_ue8m0_scale_byte(ulp_up(DS41_FP4_AMAX_FLOOR), DS41_FP4_RECIP) == 2,
              "just above 6*2^-126 -> 2^-125 (byte 2)");
    TAP_CHECK(ds41_ue8m0_scale_byte(ulp_down(DS41_FP4_AMAX_FLOOR), DS41_FP4_RECIP) == 1,
              "just below 6*2^-126 (unfloored) -> 2^-126 (byte 1)");
    /* Unfloored inputs: t == 0 -> byte 0; t subnormal -> the bit rule's k = -126. */
    TAP_CHECK(ds41_ue8m0_scale_byte(0.0f, DS41_FP8_RECIP) == 0 &&
                  ds41_ue8m0_scale_byte(-0.0f, DS41_FP4_RECIP) == 0,
              "unfloored amax 0 -> byte 0 (2^-127)");
    TAP_CHECK(ds41_ue8m0_scale_byte(0x1p-140f, DS41_FP4_RECIP) == 1 &&
                  ds41_ue8m0_scale_byte(0x1p-120f, DS41_FP8_RECIP) == 1,
              "subnormal t (unfloored) -> byte 1 per the bit rule");
    /* amax = 3.0, FP8: t = 3 * 0.00223214 = 0.0066964 in (2^-8, 2^-7] -> byte 120. */
    TAP_CHECK(ds41_ue8m0_scale_byte(3.0f, DS41_FP8_RECIP) == 120, "FP8 amax 3.0 -> 2^-7 (byte 120)");
    /* amax = 6.0, FP4: t = fp32(6 * 0.16666667163) = fp32(1 + 3e-8) = 1 -> byte 127. */
    TAP_CHECK(ds41_ue8m0_scale_byte(6.0f, DS41_FP4_RECIP) == 127, "FP4 amax 6.0 -> 2^0 (byte 127)");

    /* Exact powers: amax = 448*2^k gives t = 2^k exactly because
     * fp32(448 * fp32(1/448)) = fp32(1 + 4.5e-8) = 1; one ulp above goes to
     * 2^(k+1), one below stays. */
    int bad = 999;
    for (int k = -22; k <= 119 && bad == 999; k++) {
        float a = ldexpf(448.0f, k);
        if (ds41_ue8m0_scale_byte(a, DS41_FP8_RECIP) != k + 127 ||
            ds41_ue8m0_scale_byte(ulp_up(a), DS41_FP8_RECIP) != k + 128 ||
            ds41_ue8m0_scale_byte(ulp_down(a), DS41_FP8_RECIP) != k + 127)
            bad = k;
    }
    TAP_CHECK(bad == 999,
              "FP8: amax 448*2^k -> 2^k exactly, +1 ulp -> 2^(k+1), k = -22..119 (first bad k %d)", bad);
    bad = 999;
    for (int k = -126; k <= 125 && bad == 999; k++) {
        float a = ldexpf(6.0f, k);
        if (ds41_ue8m0_scale_byte(a, DS41_FP4_RECIP) != k + 127 ||
            ds41_ue8m0_scale_byte(ulp_up(a), DS41_FP4_RECIP) != k + 128 ||
            ds41_ue8m0_scale_byte(ulp_down(a), DS41_FP4_RECIP) != k + 127)
            bad = k;
    }
    TAP_CHECK(bad == 999, "FP4: amax 6*2^k -> 2^k exactly, +1 ulp -> 2^(k+1), k = -126..125 (first bad k %d)",
              bad);
    /* Huge: FLT_MAX/448 = 2^128/2^8.81 = 2^119.2 -> k 120 (247);
     * FLT_MAX/6 = 2^125.4 -> k 126 (253). */
    TAP_CHECK(ds41_ue8m0_scale_byte(FLT_MAX, DS41_FP8_RECIP) == 247 &&
                  ds41_ue8m0_scale_byte(FLT_MAX, DS41_FP4_RECIP) == 253,
              "amax FLT_MAX -> 2^120 (FP8, byte 247) / 2^126 (FP4, byte 253)");
    TAP_CHECK(ds41_ue8m0_scale_byte(INFINITY, DS41_FP8_RECIP) == 255 &&
                  ds41_ue8m0_scale_byte(NAN, DS41_FP4_RECIP) == 255,
              "amax inf or NaN -> byte 255 (NaN scale)");
    TAP_CHECK(ds41_ue8m0_scale_byte(FLT_MAX, 1.0f) == 255 && ds41_ue8m0_scale_byte(0x1p127f, 1.0f) == 254,
              "t = 2^127 -> 254; t above 2^127 (needs 2^128) -> 255");

    int nbad = 0;
    uint32_t first = 0;
    for (int i = 0; i < 200000; i++) {
        float a = ref_from_bits((uint32_t)rng_next() & 0x7FFFFFFFu);
        if (isnan(a)) continue;
        float r = (i & 1) ? DS41_FP8_RECIP : DS41_FP4_RECIP;
        if (ds41_ue8m0_scale_byte(a, r) != ref_ue8m0_byte(a, r)) {
            if (!nbad) first = ref_bits(a);
            nbad++;
        }
    }
    TAP_CHECK(nbad == 0,
              "200000 random amax agree with 127 + ceil(log2(fp32(amax*R))) via frexp (%d bad, first 0x%08X)",
              nbad, first);
}

/* ---- bf16 ---------------------------------------------------------------- */

static void test_bf16(void) {
    /* 1 + 2^-8 is the midpoint of 1.0 (0x3F80, even) and 1 + 2^-7 (0x3F81). */
    TAP_CHECK(ds41_bf16_bits(1.0f + 0x1p-8f) == 0x3F80, "tie 1+2^-8 rounds down to even 0x3F80");
    /* 1 + 3*2^-8: midpoint of 0x3F81 (odd) and 0x3F82 (even). */
    TAP_CHECK(ds41_bf16_bits(1.0f + 0x1.8p-7f) == 0x3F82, "tie 1+3*2^-8 rounds up to even 0x3F82");
    TAP_CHECK(ds41_bf16_bits(ulp_up(1.0f + 0x1p-8f)) == 0x3F81 &&
                  ds41_bf16_bits(ulp_down(1.0f + 0x1.8p-7f)) == 0x3F81,
              "one ulp off a tie goes to the nearer value");
    TAP_CHECK(ds41_bf16_bits(-(1.0f + 0x1p-8f)) == 0xBF80 && ds41_bf16_bits(-(1.0f + 0x1.8p-7f)) == 0xBF82,
              "negative ties mirror the positive ones");
    TAP_CHECK(ds41_bf16_bits(NAN) == 0x7FC0 && ds41_bf16_bits(-NAN) == 0xFFC0 &&
                  ds41_bf16_bits(ref_from_bits(0x7F800001u)) == 0x7FC0 &&
                  ds41_bf16_bits(ref_from_bits(0xFF80FFFFu)) == 0xFFC0 &&
                  ds41_bf16_bits(ref_from_bits(0x7FFFFFFFu)) == 0x7FFF,
              "NaN stays a quiet NaN with its sign (payload only in low bits too)");
    TAP_CHECK(ds41_bf16_bits(INFINITY) == 0x7F80 && ds41_bf16_bits(-INFINITY) == 0xFF80,
              "infinities stay infinite");
    TAP_CHECK(ds41_bf16_bits(FLT_MAX) == 0x7F80 && ds41_bf16_bits(ref_from_bits(0x7F7F8000u)) == 0x7F80 &&
                  ds41_bf16_bits(ref_from_bits(0x7F7F7FFFu)) == 0x7F7F && ds41_bf16_bits(-FLT_MAX) == 0xFF80,
              "overflow: FLT_MAX and the last tie round to inf, below it stays 0x7F7F");
    TAP_CHECK(ds41_bf16_bits(ref_from_bits(0x00008000u)) == 0x0000 &&
                  ds41_bf16_bits(ref_from_bits(0x00018000u)) == 0x0002 &&
                  ds41_bf16_bits(ref_from_bits(0x007FFFFFu)) == 0x0080,
              "subnormals round on the same grid (ties to even, carry into the normal range)");
    TAP_CHECK(ds41_bf16_bits(-0.0f) == 0x8000 && ds41_bf16_to_f32(0x8000) == 0.0f &&
                  signbit(ds41_bf16_to_f32(0x8000)),
              "-0 round-trips");
    TAP_CHECK(ds41_bf16_to_f32(0x3F81) == 1.0f + 0x1p-7f &&
                  ds41_bf16_round(1.0f + 0x1.8p-7f) == 1.0f + 0x1p-6f,
              "bf16_to_f32 / bf16_round values");

    int bad = 0;
    uint32_t first = 0;
    for (int i = 0; i < 300000; i++) {
        uint32_t u = (uint32_t)rng_next();
        if (i % 3 == 0) u = (u & 0xFFFF0000u) | 0x8000u; /* exact ties */
        float x = ref_from_bits(u);
        if (ds41_bf16_bits(x) != ref_bf16_bits(x) ||
            !ref_same(ds41_bf16_round(x), ref_from_bits((uint32_t)ref_bf16_bits(x) << 16))) {
            if (!bad) first = u;
            bad++;
        }
    }
    TAP_CHECK(
        bad == 0,
        "300000 random fp32 (a third exact ties) round like the neighbour comparison (%d bad, first 0x%08X)",
        bad, first);
    bad = -1;
    for (uint32_t b = 0; b < 65536 && bad < 0; b++) {
        float f = ds41_bf16_to_f32((uint16_t)b);
        if (!isnan(f) && ds41_bf16_bits(f) != b) bad = (int)b;
    }
    TAP_CHECK(bad < 0, "every non-NaN bf16 pattern round-trips (first bad %d)", bad);
}

/* ---- activation quantization: hand-derived vectors ----------------------- */

static void test_act_quant_hand(void) {
    /* Block 0, amax 3.0: t = fp32(3 * 0.0022321430) = 0.0066964 in (2^-8, 2^-7]
     * -> s = 2^-7, byte 127-7 = 120; x/s = 128*x exactly. */
    float x[96] = {0};
    uint8_t want_q[96] = {0};
    float want_v[96] = {0};
    /* clang-format off */
    x[0] = 3.0f;             want_q[0] = 0x7C; want_v[0] = 3.0f;              /* 384 = 1.5*2^8: e 15 m 4 */
    x[1] = -1.5f;            want_q[1] = 0xF4; want_v[1] = -1.5f;             /* -192 = -1.5*2^7: e 14 m 4 */
    x[2] = 0x1p-7f;          want_q[2] = 0x38; want_v[2] = 0x1p-7f;           /* 1.0 */
    x[3] = 0x1p-16f;         want_q[3] = 0x01; want_v[3] = 0x1p-16f;          /* 2^-9: min subnormal */
    x[4] = 0x1p-17f;         want_q[4] = 0x00; want_v[4] = 0.0f;              /* 2^-10: ties to 0 */
    x[5] = 0x1.8p-16f;       want_q[5] = 0x02; want_v[5] = 0x1p-15f;          /* 3*2^-10 -> 2*2^-9 (even) */
    x[6] = 0x1.1p-7f;        want_q[6] = 0x38; want_v[6] = 0x1p-7f;           /* 1.0625 -> 1.0 */
    x[7] = 0x1.3p-7f;        want_q[7] = 0x3A; want_v[7] = 0x1.4p-7f;         /* 1.1875 -> 1.25 */
    x[8] = 0.10009765625f;   want_q[8] = 0x55; want_v[8] = 0.1015625f;        /* bf16(0.1): 12.8125 -> 13 = 1.625*8 */
    x[9] = -0.0f;            want_q[9] = 0x80; want_v[9] = -0.0f;             /* sign of zero kept */
    x[10] = 2.9375f;         want_q[10] = 0x7C; want_v[10] = 3.0f;            /* 376 -> 384 (step 32) */
    x[11] = 2.875f;          want_q[11] = 0x7C; want_v[11] = 3.0f;            /* 368 = mid(352 m3, 384 m4) -> 384 */
    x[12] = -2.625f;         want_q[12] = 0xFA; want_v[12] = -2.5f;           /* -336 = mid(320 m2, 352 m3) -> -320 */
    /* Block 1 all zero: amax floored to 1e-4 -> byte 105 (2^-22), codes 0. */
    /* Block 2, amax 57: t = 57/448 = 0.127 in (2^-3, 2^-2] -> s = 2^-2 (byte 125);
     * x/s = 4x. 57 -> 228 -> 224 (step 16, 1.75*128: e 14 m 6 = 0x76). */
    x[64] = 57.0f;           want_q[64] = 0x76; want_v[64] = 56.0f;
    x[65] = -0.25f;          want_q[65] = 0xB8; want_v[65] = -0.25f;          /* -1.0 */
    x[66] = 0x1p-11f;        want_q[66] = 0x01; want_v[66] = 0x1p-11f;        /* 2^-9 */
    x[67] = 0x1p-12f;        want_q[67] = 0x00; want_v[67] = 0.0f;            /* 2^-10 -> 0 */
    x[68] = -0x1p-12f;       want_q[68] = 0x80; want_v[68] = -0.0f;           /* -2^-10 -> -0 */
    x[69] = 0x1.04p-11f;     want_q[69] = 0x01; want_v[69] = 0x1p-11f;        /* 1.015625*2^-9 -> 2^-9 */
    const uint8_t want_s[3] = {120, 105, 125};
    /* clang-format on */

    uint8_t q[96], s[3];
    memset(q, 0xAA, sizeof q);
    memset(s, 0xAA, sizeof s);
    ds41_act_quant(x, 96, q, s);
    TAP_CHECK(
        memcmp(s, want_s, 3) == 0,
        "act_quant scales: amax 3 -> 2^-7 (120), zeros -> 2^-22 (105), amax 57 -> 2^-2 (125); got %u %u %u",
        s[0], s[1], s[2]);
    int bad = -1;
    for (int i = 0; i < 96 && bad < 0; i++)
        if (q[i] != want_q[i]) bad = i;
    TAP_CHECK(bad < 0,
              "act_quant codes match the hand derivation (first bad index %d: got 0x%02X want 0x%02X)", bad,
              bad < 0 ? 0 : q[bad], bad < 0 ? 0 : want_q[bad]);

    float y[96];
    memcpy(y, x, sizeof y);
    ds41_act_quant_qdq(y, 96);
    bad = -1;
    for (int i = 0; i < 96 && bad < 0; i++)
        if (!ref_same(y[i], want_v[i])) bad = i;
    TAP_CHECK(bad < 0, "act_quant_qdq values match the hand derivation (first bad index %d)", bad);

    float z[32] = {0};
    uint8_t zq[32], zs;
    ds41_act_quant(z, 32, zq, &zs);
    int allzero = 1;
    for (int i = 0; i < 32; i++) allzero &= zq[i] == 0;
    ds41_act_quant_qdq(z, 32);
    for (int i = 0; i < 32; i++) allzero &= ref_bits(z[i]) == 0;
    TAP_CHECK(allzero && zs == 105, "act_quant all-zero block: scale byte 105, codes 0, qdq stays +0");
}

static void test_fp4_ue8m0_hand(void) {
    /* amax 3.0: t = fp32(3 * 0.16666667163) = fp32(0.5 + 1.5e-8) = 0.5 (half
     * ulp at 0.5 is 3e-8) -> k = -1, s = 0.5 (byte 126); v = 2x. */
    float x[64] = {0};
    uint8_t want_c[64] = {0};
    /* clang-format off */
    x[0] = 3.0f;          want_c[0] = 7;    /* 6 */
    x[1] = 1.5f;          want_c[1] = 5;    /* 3 */
    x[2] = 0.375f;        want_c[2] = 2;    /* 0.75 ties up -> 1.0 */
    x[3] = 0.125f;        want_c[3] = 0;    /* 0.25 ties down -> 0 */
    x[4] = -0.625f;       want_c[4] = 0xA;  /* -1.25 ties down -> -1.0 */
    x[5] = 0.875f;        want_c[5] = 4;    /* 1.75 ties up -> 2.0 */
    x[6] = 1.25f;         want_c[6] = 4;    /* 2.5 ties down -> 2.0 */
    x[7] = 1.75f;         want_c[7] = 6;    /* 3.5 ties up -> 4.0 */
    x[8] = 2.5f;          want_c[8] = 6;    /* 5.0 ties down -> 4.0 */
    x[9] = 2.515625f;     want_c[9] = 7;    /* 5.03125 -> 6 */
    x[10] = -0.0f;        want_c[10] = 8;   /* -0 */
    x[11] = 0.1259765625f; want_c[11] = 1;  /* 0.251953125 -> 0.5 */
    x[12] = -3.0f;        want_c[12] = 0xF; /* -6 */
    /* block 1 (x[32..63]) all zero: amax floored to 6*2^-126 -> 2^-126 (byte 1). */
    uint8_t want_p[32];
    /* clang-format on */
    for (int i = 0; i < 32; i++) want_p[i] = (uint8_t)(want_c[2 * i] | (want_c[2 * i + 1] << 4));
    /* e.g. want_p[0] = 0x57 (x0 = code 7 low, x1 = code 5 high) */
    uint8_t p[32], s[2];
    memset(p, 0xAA, sizeof p);
    ds41_fp4_act_quant_ue8m0(x, 64, p, s);
    TAP_CHECK(s[0] == 126 && s[1] == 1,
              "fp4 ue8m0 scales: amax 3 -> 2^-1 (126), zeros -> 2^-126 (1); got %u %u", s[0], s[1]);
    TAP_CHECK(want_p[0] == 0x57 && memcmp(p, want_p, 32) == 0,
              "fp4 ue8m0 packed codes match the hand derivation (byte0 0x%02X)", p[0]);
    float y[64];
    memcpy(y, x, sizeof y);
    ds41_fp4_act_quant_ue8m0_qdq(y, 64);
    int bad = -1;
    for (int i = 0; i < 64 && bad < 0; i++) {
        float want = ds41_e2m1_table[want_c[i]] * (i < 32 ? 0.5f : 0x1p-126f);
        if (!ref_same(y[i], want)) bad = i;
    }
    TAP_CHECK(bad < 0, "fp4 ue8m0 qdq = code value * s (first bad %d)", bad);
    int zero_ok = 1;
    for (int i = 32; i < 64; i++) zero_ok &= ref_bits(y[i]) == 0;
    TAP_CHECK(zero_ok, "fp4 ue8m0 all-zero block stays +0");
}

static void test_fp4_e4m3_hand(void) {
    /* Block 0, amax 5.0: 5/6 = fp32 0.8333333; e4m3 grid in [0.5,1) has step
     * 1/16: 0.8125 (m 5) and 0.875 (m 6); 0.8333 is nearer 0.8125 = 13/16 ->
     * scale byte (6<<3)|5 = 0x35.  v = fp32(x / 0.8125). */
    float x[64] = {0};
    uint8_t want_c[64] = {0};
    float want_v[64] = {0};
    /* clang-format off */
    x[0] = 5.0f;        want_c[0] = 7;     want_v[0] = 4.875f;    /* 6.15 -> clamp 6 */
    x[1] = -5.0f;       want_c[1] = 15;    want_v[1] = -4.875f;
    x[2] = 2.0f;        want_c[2] = 4;     want_v[2] = 1.625f;    /* 2.46 -> 2 */
    x[3] = 2.03125f;    want_c[3] = 4;     want_v[3] = 1.625f;    /* exactly 2.5 -> down to 2 */
    x[4] = 2.046875f;   want_c[4] = 5;     want_v[4] = 2.4375f;   /* 2.519 -> 3 */
    x[5] = 0.609375f;   want_c[5] = 2;     want_v[5] = 0.8125f;   /* exactly 0.75 -> up to 1 */
    x[6] = 0.203125f;   want_c[6] = 0;     want_v[6] = 0.0f;      /* exactly 0.25 -> 0 */
    x[7] = 0.2109375f;  want_c[7] = 1;     want_v[7] = 0.40625f;  /* 0.2596 -> 0.5 */
    x[8] = -1.421875f;  want_c[8] = 0xC;   want_v[8] = -1.625f;   /* exactly -1.75 -> -2 */
    x[9] = 4.0625f;     want_c[9] = 6;     want_v[9] = 3.25f;     /* exactly 5.0 -> 4 */
    x[10] = 2.84375f;   want_c[10] = 6;    want_v[10] = 3.25f;    /* exactly 3.5 -> 4 */
    x[11] = -0.0f;      want_c[11] = 8;    want_v[11] = -0.0f;
    x[12] = 1.0f;       want_c[12] = 2;    want_v[12] = 0.8125f;  /* 1.23 -> 1 */
    x[13] = 1.015625f;  want_c[13] = 2;    want_v[13] = 0.8125f;  /* exactly 1.25 -> 1 */
    /* Block 1 (16..31) all zero: amax floored to 6*2^-9, 6*2^-9/6 = 2^-9 -> 0x01. */
    /* Block 2, amax 3000: 3000/6 = 500 -> e4m3 clamp 448 (0x7E); 3000/448 =
     * 6.7 -> clamp 6 -> 6*448 = 2688; 100/448 = 0.223 -> 0. */
    x[32] = 3000.0f;    want_c[32] = 7;    want_v[32] = 2688.0f;
    x[33] = 100.0f;     want_c[33] = 0;    want_v[33] = 0.0f;
    x[34] = -336.0f;    want_c[34] = 0xA;  want_v[34] = -448.0f;  /* exactly -0.75 -> ties up to -1 */
    /* Block 3, amax 5.625: 5.625/6 = 0.9375 exactly = 1.875*2^-1 (e 6 m 7 ->
     * 0x37).  1/0.9375 is inexact, so these ties show that v is a true
     * division: x*fp32(1/s) would give 1.2500001 and 5.0000005 and round up. */
    x[48] = 5.625f;     want_c[48] = 7;    want_v[48] = 5.625f;   /* exactly 6 */
    x[49] = 1.171875f;  want_c[49] = 2;    want_v[49] = 0.9375f;  /* exactly 1.25 -> 1 */
    x[50] = 4.6875f;    want_c[50] = 6;    want_v[50] = 3.75f;    /* exactly 5.0 -> 4 */
    x[51] = -2.34375f;  want_c[51] = 0xC;  want_v[51] = -1.875f;  /* exactly -2.5 -> -2 */
    const uint8_t want_s[4] = {0x35, 0x01, 0x7E, 0x37};
    /* clang-format on */

    uint8_t p[32], s[4];
    memset(p, 0xAA, sizeof p);
    ds41_fp4_act_quant_e4m3(x, 64, p, s);
    TAP_CHECK(memcmp(s, want_s, 4) == 0,
              "fp4 e4m3 scales: amax 5 -> 0.8125 (0x35), zeros -> 2^-9 (0x01), amax 3000 -> 448 (0x7E), amax "
              "5.625 -> 0.9375 (0x37); got 0x%02X 0x%02X 0x%02X 0x%02X",
              s[0], s[1], s[2], s[3]);
    int bad = -1;
    for (int i = 0; i < 64 && bad < 0; i++)
        if ((uint8_t)((p[i / 2] >> (4 * (i % 2))) & 15) != want_c[i]) bad = i;
    TAP_CHECK(bad < 0, "fp4 e4m3 codes match the hand derivation (first bad index %d)", bad);
    float y[64];
    memcpy(y, x, sizeof y);
    ds41_fp4_act_quant_e4m3_qdq(y, 64);
    bad = -1;
    for (int i = 0; i < 64 && bad < 0; i++)
        if (!ref_same(y[i], want_v[i])) bad = i;
    TAP_CHECK(bad < 0, "fp4 e4m3 qdq values match the hand derivation (first bad index %d)", bad);
    float d[64];
    ds41_dequant_fp4_e4m3_1x16(p, s, 64, d);
    bad = -1;
    for (int i = 0; i < 64 && bad < 0; i++)
        if (!ref_same(d[i], want_v[i])) bad = i;
    TAP_CHECK(bad < 0, "dequant_fp4_e4m3_1x16 gives the same values (first bad index %d)", bad);
    int zero_ok = 1;
    for (int i = 16; i < 32; i++) zero_ok &= want_c[i] == 0 && ref_bits(y[i]) == 0;
    TAP_CHECK(zero_ok, "fp4 e4m3 all-zero block: codes 0, qdq stays +0");
}

/* ---- activation quantization: random vectors vs the reference ------------ */

/* Reference FP8 act quant of one block via quant_ref.h. */
static void ref_act_block(const float *x, size_t len, uint8_t *q, uint8_t *sb) {
    float a = ref_amax_floored(x, len, 1, 1e-4f);
    *sb = ref_ue8m0_byte(a, DS41_FP8_RECIP);
    float s = ref_ue8m0_value(*sb);
    for (size_t i = 0; i < len; i++) q[i] = ref_e4m3_encode((float)((double)x[i] / (double)s));
}

static void test_act_quant_random(void) {
    enum { N = 32 * 64 };
    float *x = xmalloc(N * sizeof *x), *y = xmalloc(N * sizeof *y), *d = xmalloc(N * sizeof *d);
    uint8_t q[N], s[N / 32], rq[N], rs[N / 32];
    int bad = -1, bad_s = -1, same_qdq = 1, idem = 1;
    for (int trial = 0; trial < 20; trial++) {
        for (int i = 0; i < N; i++) x[i] = rng_bf16_near((i / 32) % 40 - 25);
        if (trial == 0)
            for (int i = 0; i < 32; i++) x[i] = 0.0f;
        ds41_act_quant(x, N, q, s);
        for (int b = 0; b < N / 32; b++) ref_act_block(x + 32 * b, 32, rq + 32 * b, rs + b);
        for (int i = 0; i < N && bad < 0; i++)
            if (q[i] != rq[i]) bad = i;
        for (int b = 0; b < N / 32 && bad_s < 0; b++)
            if (s[b] != rs[b]) bad_s = b;
        memcpy(y, x, N * sizeof *x);
        ds41_act_quant_qdq(y, N);
        ds41_dequant_fp8_rows_1x32(q, s, 1, N, d);
        for (int i = 0; i < N; i++) same_qdq &= ref_same(y[i], d[i]) && ref_same(y[i], ds41_bf16_round(y[i]));
        memcpy(d, y, N * sizeof *y);
        ds41_act_quant_qdq(d, N);
        for (int i = 0; i < N; i++) idem &= ref_same(d[i], y[i]);
    }
    TAP_CHECK(bad_s < 0,
              "act_quant scales of random bf16 blocks (2^-29..2^18) match the reference (first bad block %d)",
              bad_s);
    TAP_CHECK(bad < 0, "act_quant codes of random bf16 blocks match the reference (first bad %d)", bad);
    TAP_CHECK(same_qdq, "act_quant_qdq == dequant_fp8_rows_1x32(act_quant), and is bf16");
    TAP_CHECK(idem, "act_quant_qdq is idempotent");

    /* fp4 variants: quant + dequant == qdq, and codes match the references. */
    uint8_t p[N / 2], s16[N / 16];
    int ok_ue = 1, ok_e4 = 1, codes_ue = 1, codes_e4 = 1;
    for (int trial = 0; trial < 20; trial++) {
        for (int i = 0; i < N; i++) x[i] = rng_bf16_near((i / 32) % 40 - 25);
        ds41_fp4_act_quant_ue8m0(x, N, p, s);
        ds41_dequant_fp4_weight(p, s, 1, N, d);
        memcpy(y, x, N * sizeof *x);
        ds41_fp4_act_quant_ue8m0_qdq(y, N);
        for (int i = 0; i < N; i++) ok_ue &= ref_same(y[i], d[i]);
        for (int b = 0; b < N / 32; b++) {
            float a = ref_amax_floored(x + 32 * b, 32, 1, 0x1.8p-124f);
            uint8_t sb = ref_ue8m0_byte(a, DS41_FP4_RECIP);
            codes_ue &= s[b] == sb;
            for (int i = 32 * b; i < 32 * b + 32; i++) {
                float v = (float)((double)x[i] / (double)ref_ue8m0_value(sb));
                codes_ue &= ((p[i / 2] >> (4 * (i % 2))) & 15) == ref_e2m1_encode(v);
            }
        }
        ds41_fp4_act_quant_e4m3(x, N, p, s16);
        ds41_dequant_fp4_e4m3_1x16(p, s16, N, d);
        memcpy(y, x, N * sizeof *x);
        ds41_fp4_act_quant_e4m3_qdq(y, N);
        for (int i = 0; i < N; i++) ok_e4 &= ref_same(y[i], d[i]);
        for (int b = 0; b < N / 16; b++) {
            float a = ref_amax_floored(x + 16 * b, 16, 1, 0x1.8p-7f);
            uint8_t sb = ref_e4m3_encode((float)((double)a / 6.0));
            codes_e4 &= s16[b] == sb;
            double sv = ref_e4m3_value(sb);
            for (int i = 16 * b; i < 16 * b + 16; i++) {
                float v = (float)((double)x[i] / sv);
                codes_e4 &= ((p[i / 2] >> (4 * (i % 2))) & 15) == ref_e2m1_encode(v);
            }
        }
    }
    TAP_CHECK(codes_ue, "fp4_act_quant_ue8m0 scales and codes match the reference on random bf16");
    TAP_CHECK(ok_ue, "fp4_act_quant_ue8m0_qdq == dequant(fp4_act_quant_ue8m0)");
    TAP_CHECK(codes_e4, "fp4_act_quant_e4m3 scales and codes match the reference on random bf16");
    TAP_CHECK(ok_e4, "fp4_act_quant_e4m3_qdq == dequant_fp4_e4m3_1x16(fp4_act_quant_e4m3)");
    free(x);
    free(y);
    free(d);
}

static void test_act_quant_edges(void) {
    /* A block holding NaN gets a NaN scale and dequantizes to NaN entirely. */
    float x[64];
    for (int i = 0; i < 64; i++) x[i] = 1.0f;
    x[5] = NAN;
    uint8_t q[64], s[2];
    ds41_act_quant(x, 64, q, s);
    int ok = s[0] == 255 && s[1] == ds41_ue8m0_scale_byte(1.0f, DS41_FP8_RECIP);
    for (int i = 0; i < 32; i++) ok &= (q[i] & 0x7F) == 0x7F;
    ds41_act_quant_qdq(x, 64);
    for (int i = 0; i < 32; i++) ok &= isnan(x[i]);
    for (int i = 32; i < 64; i++) ok &= x[i] == 1.0f;
    TAP_CHECK(ok, "a NaN poisons only its own FP8 block (scale 255, codes NaN, qdq NaN)");

    for (int i = 0; i < 64; i++) x[i] = 1.0f;
    x[40] = -INFINITY;
    float y[64];
    memcpy(y, x, sizeof y);
    uint8_t p[32], s16[4];
    ds41_fp4_act_quant_ue8m0(x, 64, p, s);
    ds41_fp4_act_quant_ue8m0_qdq(y, 64);
    ok = s[1] == 255 && s[0] == ds41_ue8m0_scale_byte(1.0f, DS41_FP4_RECIP) && y[0] == 1.0f;
    for (int i = 32; i < 64; i++) ok &= isnan(y[i]);
    TAP_CHECK(ok, "an infinity gives its FP4 ue8m0 block a NaN scale (qdq NaN), other blocks intact");
    memcpy(y, x, sizeof y);
    ds41_fp4_act_quant_e4m3(x, 64, p, s16);
    ds41_fp4_act_quant_e4m3_qdq(y, 64);
    /* Block 2 (32..47): amax inf -> inf/6 -> e4m3 clamp 448 (0x7E); -inf/448
     * -> clamp -6 -> -2688; 1/448 -> 0.  Block 0: amax 1 -> 1/6 = 0.1667 on
     * the step-1/64 grid of [1/8, 1/4) -> 0.171875 = 1.375*2^-3 (e 4 m 3 = 0x23); 1/0.171875 = 5.8
     * -> 6 -> 1.03125. */
    ok = s16[2] == 0x7E && s16[0] == 0x23 && y[40] == -2688.0f && y[41] == 0.0f && y[0] == 1.03125f;
    TAP_CHECK(ok, "FP4 e4m3 with -inf: scale saturates at 448, -inf -> -6*448, others intact");

    /* Partial trailing blocks are quantized on their own: z = 32 x 100 then
     * 8 x 6.
     * FP8 (n 40): 100/448 = 0.223 in (2^-3, 2^-2] -> 125, 100*4 = 400 ties to
     * 384 (0x7C); 6/448 = 0.0134 in (2^-7, 2^-6] -> 121, 6*64 = 384 (0x7C).
     * FP4 ue8m0 (n 39, odd): 100/6 = 16.7 -> 2^5 (132); 6 -> 2^0 (127);
     * elements 32..37 = code 7 -> bytes 16..18 = 0x77, element 38 -> low
     * nibble of byte 19, high nibble 0 -> 0x07.
     * FP4 e4m3 (n 40, blocks 16/16/8): 100/6 = 16.67 -> 16 (0x58, step 2);
     * 6/6 = 1.0 -> 0x38. */
    float z[40];
    for (int i = 0; i < 40; i++) z[i] = i < 32 ? 100.0f : 6.0f;
    uint8_t zq[40], zs[2], zp[20], z16[3];
    ds41_act_quant(z, 40, zq, zs);
    ok = zs[0] == 125 && zs[1] == 121 && zq[0] == 0x7C && zq[39] == 0x7C;
    TAP_CHECK(ok, "act_quant n=40: trailing 8-element block has its own scale (125, 121; got %u %u)", zs[0],
              zs[1]);
    memset(zp, 0xAA, sizeof zp);
    ds41_fp4_act_quant_ue8m0(z, 39, zp, zs);
    ok = zs[0] == 132 && zs[1] == 127 && zp[16] == 0x77 && zp[18] == 0x77 && zp[19] == 0x07;
    TAP_CHECK(ok, "fp4 ue8m0 n=39: scales 132/127, last byte 0x07 (high nibble cleared; got 0x%02X)", zp[19]);
    ds41_fp4_act_quant_e4m3(z, 40, zp, z16);
    ok = z16[0] == 0x58 && z16[1] == 0x58 && z16[2] == 0x38;
    TAP_CHECK(ok, "fp4 e4m3 n=40: scales 0x58 0x58 0x38 (got 0x%02X 0x%02X 0x%02X)", z16[0], z16[1], z16[2]);
    float zz[3] = {1, 2, 3};
    uint8_t untouched = 0x5A;
    ds41_act_quant(zz, 0, &untouched, &untouched);
    ds41_act_quant_qdq(zz, 0);
    TAP_CHECK(untouched == 0x5A && zz[0] == 1.0f, "n = 0 writes nothing");
}

/* ---- weights ------------------------------------------------------------- */

static void test_fp8_weight(void) {
    enum { N = 70, K = 45 }; /* partial blocks on both edges: 3 x 2 blocks */
    float *w = xmalloc(N * K * sizeof *w), *out = xmalloc(N * K * sizeof *out);
    uint8_t *q = xmalloc(N * K);
    uint8_t s[3 * 2];
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            int blk = (n / 32) * 2 + k / 32;
            /* fp32 (not only bf16) values, block magnitudes 2^(3*blk-8) */
            float v = ldexpf(rng_uniform() * 2.0f - 1.0f, 3 * blk - 8);
            w[n * K + k] = v;
        }
    w[69 * K + 44] = 0.0f;
    ds41_quant_fp8_weight(w, N, K, q, s);
    ds41_dequant_fp8_weight(q, s, N, K, out);
    int bad_s = -1, bad = -1, distinct = 1;
    for (int bn = 0; bn < 3; bn++)
        for (int bk = 0; bk < 2; bk++) {
            double amax = 0;
            for (int n = bn * 32; n < N && n < bn * 32 + 32; n++)
                for (int k = bk * 32; k < K && k < bk * 32 + 32; k++)
                    amax = fmax(amax, fabs((double)w[n * K + k]));
            float a = fmaxf((float)amax, 1e-4f);
            if (s[bn * 2 + bk] != ref_ue8m0_byte(a, DS41_FP8_RECIP) && bad_s < 0) bad_s = bn * 2 + bk;
            for (int j = 0; j < bn * 2 + bk; j++) distinct &= s[j] != s[bn * 2 + bk];
        }
    for (int n = 0; n < N && bad < 0; n++)
        for (int k = 0; k < K && bad < 0; k++) {
            float sv = ref_ue8m0_value(s[(n / 32) * 2 + k / 32]);
            uint8_t c = ref_e4m3_encode((float)((double)w[n * K + k] / (double)sv));
            float want = (float)(ref_e4m3_value(c) * (double)sv); /* exact */
            if (q[n * K + k] != c || !ref_same(out[n * K + k], want)) bad = n * K + k;
        }
    TAP_CHECK(bad_s < 0,
              "fp8 weight 70x45: 3x2 block scales (edge blocks partial) match the reference (first bad %d)",
              bad_s);
    TAP_CHECK(distinct, "fp8 weight: blocks of different magnitude get different scales (%u %u %u %u %u %u)",
              s[0], s[1], s[2], s[3], s[4], s[5]);
    TAP_CHECK(bad < 0, "fp8 weight quant -> dequant equals per-element QDQ (first bad index %d)", bad);

    /* A NaN scale byte dequantizes its block to NaN, others unaffected. */
    s[1] = 255;
    ds41_dequant_fp8_weight(q, s, N, K, out);
    int ok = isnan(out[0 * K + 40]) && isnan(out[31 * K + 32]) && !isnan(out[0]) && !isnan(out[32 * K + 40]);
    TAP_CHECK(ok, "fp8 weight dequant: scale byte 255 -> NaN block");
    /* Exactness at the extremes: code 0x01 (2^-9) with byte 0 is 2^-136. */
    uint8_t q1 = 0x01, s0 = 0;
    float o1;
    ds41_dequant_fp8_weight(&q1, &s0, 1, 1, &o1);
    TAP_CHECK(o1 == 0x1p-136f, "fp8 dequant 2^-9 * 2^-127 = 2^-136 exactly (no underflow)");
    free(w);
    free(out);
    free(q);
}

static void test_fp4_weight(void) {
    /* Nibble order: amax 6 -> s = 1; 6 -> 7, 0.5 -> 1, -1 -> 0xA, 4 -> 6. */
    float w[32] = {6.0f, 0.5f, -1.0f, 4.0f};
    uint8_t p[16], s;
    ds41_quant_fp4_weight(w, 1, 32, p, &s);
    TAP_CHECK(s == 127 && p[0] == 0x17 && p[1] == 0x6A && p[2] == 0x00,
              "fp4 nibble order: element 0 in the low nibble (0x17, 0x6A), scale 2^0");

    enum { N = 7, K = 96 };
    float *x = xmalloc(N * K * sizeof *x), *out = xmalloc(N * K * sizeof *out);
    uint8_t *pk = xmalloc(N * K / 2);
    uint8_t sc[N * 3];
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) x[n * K + k] = ldexpf(rng_uniform() * 2.0f - 1.0f, n * 3 + k / 32 - 10);
    ds41_quant_fp4_weight(x, N, K, pk, sc);
    ds41_dequant_fp4_weight(pk, sc, N, K, out);
    int bad = -1, bad_s = -1;
    for (int n = 0; n < N; n++)
        for (int g = 0; g < 3; g++) {
            uint8_t sb =
                ref_ue8m0_byte(ref_amax_floored(x + n * K + 32 * g, 32, 1, 0x1.8p-124f), DS41_FP4_RECIP);
            if (sc[n * 3 + g] != sb && bad_s < 0) bad_s = n * 3 + g;
            for (int k = 32 * g; k < 32 * g + 32 && bad < 0; k++) {
                double sv = ref_ue8m0_value(sb);
                uint8_t c = ref_e2m1_encode((float)((double)x[n * K + k] / sv));
                uint8_t got = (pk[n * K / 2 + k / 2] >> (4 * (k % 2))) & 15;
                if (got != c || !ref_same(out[n * K + k], (float)(ref_e2m1_value(c) * sv))) bad = n * K + k;
            }
        }
    TAP_CHECK(bad_s < 0, "fp4 weight 7x96 scales [N][K/32] match the reference (first bad %d)", bad_s);
    TAP_CHECK(bad < 0, "fp4 weight quant -> dequant equals per-element QDQ (first bad %d)", bad);
    int distinct = sc[0] != sc[1] && sc[1] != sc[2] && sc[0] != sc[3];
    TAP_CHECK(distinct, "fp4 weight: groups of different magnitude get different scales");
    sc[4] = 255;
    ds41_dequant_fp4_weight(pk, sc, N, K, out);
    TAP_CHECK(isnan(out[1 * K + 32]) && isnan(out[1 * K + 63]) && !isnan(out[1 * K + 31]) &&
                  !isnan(out[1 * K + 64]),
              "fp4 weight dequant: scale byte 255 -> NaN group only");
    free(x);
    free(out);
    free(pk);
}

static void test_rows_1x32(void) {
    enum { R = 3, C = 256 };
    float x[R * C], out[R * C], y[C];
    uint8_t q[R * C], s[R * 8];
    for (int i = 0; i < R * C; i++) x[i] = rng_bf16_near((i / 32) % 12 - 6);
    for (int r = 0; r < R; r++) ds41_act_quant(x + r * C, C, q + r * C, s + r * 8);
    ds41_dequant_fp8_rows_1x32(q, s, R, C, out);
    int ok = 1;
    for (int r = 0; r < R; r++) {
        memcpy(y, x + r * C, sizeof y);
        ds41_act_quant_qdq(y, C);
        for (int c = 0; c < C; c++) ok &= ref_same(out[r * C + c], y[c]);
    }
    TAP_CHECK(ok, "dequant_fp8_rows_1x32 [3,256]+[3,8] equals per-row act_quant QDQ");
    s[8 + 3] = 255;
    ds41_dequant_fp8_rows_1x32(q, s, R, C, out);
    TAP_CHECK(isnan(out[C + 96]) && isnan(out[C + 127]) && !isnan(out[C + 95]) && !isnan(out[C + 128]) &&
                  !isnan(out[3]),
              "rows_1x32: scale byte 255 -> NaN for its 32 columns only");
}

int main(void) {
    test_e4m3_decode();
    test_e4m3_roundtrip();
    test_e4m3_ties();
    test_e4m3_saturation();
    test_e4m3_random();
    test_e2m1();
    test_ue8m0_decode();
    test_ue8m0_constants();
    test_ue8m0_scale();
    test_bf16();
    test_act_quant_hand();
    test_fp4_ue8m0_hand();
    test_fp4_e4m3_hand();
    test_act_quant_random();
    test_act_quant_edges();
    test_fp8_weight();
    test_fp4_weight();
    test_rows_1x32();
    return tap_done();
}
