/* Quantization codecs (REFERENCE.md §1, §2.1).  See quant.h for the contract.
 *
 * Exactness notes.
 *  - All encoders work on the fp32 bit pattern with integer arithmetic, so the
 *    rounding does not depend on the FPU rounding mode or on library calls.
 *  - The only floating-point operations are single multiplications and
 *    divisions whose fp32 rounding IS the reference's (amax * recip, x / s,
 *    amax / 6, value * scale); each is its own statement.  Nothing here has
 *    the shape a*b+c, and it must stay that way: a fused multiply-add would
 *    skip a rounding.  GCC only contracts in GNU modes (-std=gnu*, where
 *    -ffp-contract=fast is the default); ds41 builds with -std=c17, which makes
 *    GCC use -ffp-contract=off (checked with gcc 12 -march=haswell: no vfmadd
 *    for a*b+c under -std=c17, vfmadd under -std=gnu17).  GCC does not
 *    implement the STDC FP_CONTRACT pragma (and warns about it under -Wall),
 *    so it is given to clang only, whose default is -ffp-contract=on. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "engine/model/quant.h"

#include <math.h>
#include <string.h>

/* ---- helpers ------------------------------------------------------------ */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static size_t ceil_div(size_t a, size_t b) {
    return a / b + (a % b != 0);
}

static size_t min_size(size_t a, size_t b) {
    return a < b ? a : b;
}

/* max |x[i]| over n >= 1 elements; NaN if any element is NaN (as torch's
 * amax), so that a NaN block gets a NaN scale instead of a silent one. */
static float abs_max(const float *x, size_t n) {
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax || isnan(a)) amax = a;
        if (isnan(amax)) break;
    }
    return amax;
}

/* max(amax, floor) that lets NaN through (torch clamp_min). */
static float floor_amax(float amax, float floor) {
    return amax < floor ? floor : amax;
}

/* FP4 nibbles: element 2i low, 2i+1 high.  put_nibble must be called for
 * even i before i+1 (the even write clears the high half). */
static void put_nibble(uint8_t *packed, size_t i, uint8_t code) {
    if (i % 2 == 0)
        packed[i / 2] = code & 0x0F;
    else
        packed[i / 2] = (uint8_t)(packed[i / 2] | ((code & 0x0F) << 4));
}

static uint8_t get_nibble(const uint8_t *packed, size_t i) {
    uint8_t b = packed[i / 2];
    return i % 2 == 0 ? (b & 0x0F) : (uint8_t)(b >> 4);
}

/* ---- bf16 --------------------------------------------------------------- */

uint16_t ds41_bf16_bits(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    /* Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to
     * even; a carry into the exponent is the correct next binade (or inf). */
    uint32_t lsb = (u >> 16) & 1u;
    u += 0x7FFFu + lsb;
    return (uint16_t)(u >> 16);
}

float ds41_bf16_to_f32(uint16_t b) {
    return f32_from_bits((uint32_t)b << 16);
}

float ds41_bf16_round(float x) {
    return ds41_bf16_to_f32(ds41_bf16_bits(x));
}

/* ---- e4m3fn ------------------------------------------------------------- */

/* clang-format off */
const float ds41_e4m3_table[256] = {
    /* 0x00: subnormal m*2^-9 */
    0.0f, 0x1p-9f, 0x1p-8f, 0x1.8p-8f, 0x1p-7f, 0x1.4p-7f, 0x1.8p-7f, 0x1.cp-7f,
    /* 0x08: (1+m/8)*2^-6 */
    0x1p-6f, 0x1.2p-6f, 0x1.4p-6f, 0x1.6p-6f, 0x1.8p-6f, 0x1.ap-6f, 0x1.cp-6f, 0x1.ep-6f,
    /* 0x10: (1+m/8)*2^-5 */
    0x1p-5f, 0x1.2p-5f, 0x1.4p-5f, 0x1.6p-5f, 0x1.8p-5f, 0x1.ap-5f, 0x1.cp-5f, 0x1.ep-5f,
    /* 0x18: (1+m/8)*2^-4 */
    0x1p-4f, 0x1.2p-4f, 0x1.4p-4f, 0x1.6p-4f, 0x1.8p-4f, 0x1.ap-4f, 0x1.cp-4f, 0x1.ep-4f,
    /* 0x20: (1+m/8)*2^-3 */
    0x1p-3f, 0x1.2p-3f, 0x1.4p-3f, 0x1.6p-3f, 0x1.8p-3f, 0x1.ap-3f, 0x1.cp-3f, 0x1.ep-3f,
    /* 0x28: (1+m/8)*2^-2 */
    0x1p-2f, 0x1.2p-2f, 0x1.4p-2f, 0x1.6p-2f, 0x1.8p-2f, 0x1.ap-2f, 0x1.cp-2f, 0x1.ep-2f,
    /* 0x30: (1+m/8)*2^-1 */
    0x1p-1f, 0x1.2p-1f, 0x1.4p-1f, 0x1.6p-1f, 0x1.8p-1f, 0x1.ap-1f, 0x1.cp-1f, 0x1.ep-1f,
    /* 0x38: (1+m/8)*2^0 */
    0x1p0f, 0x1.2p0f, 0x1.4p0f, 0x1.6p0f, 0x1.8p0f, 0x1.ap0f, 0x1.cp0f, 0x1.ep0f,
    /* 0x40: (1+m/8)*2^1 */
    0x1p1f, 0x1.2p1f, 0x1.4p1f, 0x1.6p1f, 0x1.8p1f, 0x1.ap1f, 0x1.cp1f, 0x1.ep1f,
    /* 0x48: (1+m/8)*2^2 */
    0x1p2f, 0x1.2p2f, 0x1.4p2f, 0x1.6p2f, 0x1.8p2f, 0x1.ap2f, 0x1.cp2f, 0x1.ep2f,
    /* 0x50: (1+m/8)*2^3 */
    0x1p3f, 0x1.2p3f, 0x1.4p3f, 0x1.6p3f, 0x1.8p3f, 0x1.ap3f, 0x1.cp3f, 0x1.ep3f,
    /* 0x58: (1+m/8)*2^4 */
    0x1p4f, 0x1.2p4f, 0x1.4p4f, 0x1.6p4f, 0x1.8p4f, 0x1.ap4f, 0x1.cp4f, 0x1.ep4f,
    /* 0x60: (1+m/8)*2^5 */
    0x1p5f, 0x1.2p5f, 0x1.4p5f, 0x1.6p5f, 0x1.8p5f, 0x1.ap5f, 0x1.cp5f, 0x1.ep5f,
    /* 0x68: (1+m/8)*2^6 */
    0x1p6f, 0x1.2p6f, 0x1.4p6f, 0x1.6p6f, 0x1.8p6f, 0x1.ap6f, 0x1.cp6f, 0x1.ep6f,
    /* 0x70: (1+m/8)*2^7 */
    0x1p7f, 0x1.2p7f, 0x1.4p7f, 0x1.6p7f, 0x1.8p7f, 0x1.ap7f, 0x1.cp7f, 0x1.ep7f,
    /* 0x78: (1+m/8)*2^8 */
    0x1p8f, 0x1.2p8f, 0x1.4p8f, 0x1.6p8f, 0x1.8p8f, 0x1.ap8f, 0x1.cp8f, NAN,
    /* 0x80: subnormal m*2^-9 */
    -0.0f, -0x1p-9f, -0x1p-8f, -0x1.8p-8f, -0x1p-7f, -0x1.4p-7f, -0x1.8p-7f, -0x1.cp-7f,
    /* 0x88: (1+m/8)*2^-6 */
    -0x1p-6f, -0x1.2p-6f, -0x1.4p-6f, -0x1.6p-6f, -0x1.8p-6f, -0x1.ap-6f, -0x1.cp-6f, -0x1.ep-6f,
    /* 0x90: (1+m/8)*2^-5 */
    -0x1p-5f, -0x1.2p-5f, -0x1.4p-5f, -0x1.6p-5f, -0x1.8p-5f, -0x1.ap-5f, -0x1.cp-5f, -0x1.ep-5f,
    /* 0x98: (1+m/8)*2^-4 */
    -0x1p-4f, -0x1.2p-4f, -0x1.4p-4f, -0x1.6p-4f, -0x1.8p-4f, -0x1.ap-4f, -0x1.cp-4f, -0x1.ep-4f,
    /* 0xA0: (1+m/8)*2^-3 */
    -0x1p-3f, -0x1.2p-3f, -0x1.4p-3f, -0x1.6p-3f, -0x1.8p-3f, -0x1.ap-3f, -0x1.cp-3f, -0x1.ep-3f,
    /* 0xA8: (1+m/8)*2^-2 */
    -0x1p-2f, -0x1.2p-2f, -0x1.4p-2f, -0x1.6p-2f, -0x1.8p-2f, -0x1.ap-2f, -0x1.cp-2f, -0x1.ep-2f,
    /* 0xB0: (1+m/8)*2^-1 */
    -0x1p-1f, -0x1.2p-1f, -0x1.4p-1f, -0x1.6p-1f, -0x1.8p-1f, -0x1.ap-1f, -0x1.cp-1f, -0x1.ep-1f,
    /* 0xB8: (1+m/8)*2^0 */
    -0x1p0f, -0x1.2p0f, -0x1.4p0f, -0x1.6p0f, -0x1.8p0f, -0x1.ap0f, -0x1.cp0f, -0x1.ep0f,
    /* 0xC0: (1+m/8)*2^1 */
    -0x1p1f, -0x1.2p1f, -0x1.4p1f, -0x1.6p1f, -0x1.8p1f, -0x1.ap1f, -0x1.cp1f, -0x1.ep1f,
    /* 0xC8: (1+m/8)*2^2 */
    -0x1p2f, -0x1.2p2f, -0x1.4p2f, -0x1.6p2f, -0x1.8p2f, -0x1.ap2f, -0x1.cp2f, -0x1.ep2f,
    /* 0xD0: (1+m/8)*2^3 */
    -0x1p3f, -0x1.2p3f, -0x1.4p3f, -0x1.6p3f, -0x1.8p3f, -0x1.ap3f, -0x1.cp3f, -0x1.ep3f,
    /* 0xD8: (1+m/8)*2^4 */
    -0x1p4f, -0x1.2p4f, -0x1.4p4f, -0x1.6p4f, -0x1.8p4f, -0x1.ap4f, -0x1.cp4f, -0x1.ep4f,
    /* 0xE0: (1+m/8)*2^5 */
    -0x1p5f, -0x1.2p5f, -0x1.4p5f, -0x1.6p5f, -0x1.8p5f, -0x1.ap5f, -0x1.cp5f, -0x1.ep5f,
    /* 0xE8: (1+m/8)*2^6 */
    -0x1p6f, -0x1.2p6f, -0x1.4p6f, -0x1.6p6f, -0x1.8p6f, -0x1.ap6f, -0x1.cp6f, -0x1.ep6f,
    /* 0xF0: (1+m/8)*2^7 */
    -0x1p7f, -0x1.2p7f, -0x1.4p7f, -0x1.6p7f, -0x1.8p7f, -0x1.ap7f, -0x1.cp7f, -0x1.ep7f,
    /* 0xF8: (1+m/8)*2^8 */
    -0x1p8f, -0x1.2p8f, -0x1.4p8f, -0x1.6p8f, -0x1.8p8f, -0x1.ap8f, -0x1.cp8f, -NAN,
};
/* clang-format on */

float ds41_e4m3_to_f32(uint8_t b) {
    return ds41_e4m3_table[b];
}

/* Round the integer `sig` right by `shift` bits (1 <= shift <= 31), nearest,
 * ties to even. */
static uint32_t shift_rne(uint32_t sig, unsigned shift) {
    uint32_t kept = sig >> shift;
    uint32_t rem = sig & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (kept & 1u))) kept++;
    return kept;
}

uint8_t ds41_e4m3_from_f32(float v) {
    uint32_t u = f32_bits(v);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7F;  /* NaN */
    if (a >= 0x43E00000u) return sign | 0x7E; /* |v| >= 448 incl. inf: the clamp */
    uint32_t exp = a >> 23;                   /* biased fp32 exponent */
    if (exp >= 121) {
        /* |v| in [2^-6, 448): e4m3 normal, biased exponent exp - 120 in 1..15.
         * Dropping 20 mantissa bits; a mantissa carry (m = 8) moves into the
         * exponent field, which is the correct next binade.  448 = 0x7E is
         * representable, so nothing below it rounds past it. */
        uint32_t code = ((exp - 120u) << 3) | ((a >> 20) & 7u);
        uint32_t rem = a & 0xFFFFFu;
        if (rem > 0x80000u || (rem == 0x80000u && (code & 1u))) code++;
        return (uint8_t)(sign | code);
    }
    /* |v| < 2^-6: the subnormal grid m * 2^-9.  m = RNE(|v| * 2^9) with |v| =
     * sig * 2^(exp-150), so m = sig >> (141 - exp) rounded.  m = 8 is code
     * 0x08 = 2^-6, the smallest normal, so no special case.  For shift >= 25
     * (|v| < 2^-10, and fp32 subnormals) sig < 2^24 is below half: zero. */
    if (exp == 0) return sign;
    unsigned shift = 141u - exp;
    if (shift >= 25) return sign;
    uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
    return (uint8_t)(sign | shift_rne(sig, shift));
}

/* ---- ue8m0 -------------------------------------------------------------- */

float ds41_ue8m0_to_f32(uint8_t b) {
    if (b == 255) return NAN;
    if (b == 0) return 0x1p-127f; /* fp32 subnormal 0x00400000 */
    return f32_from_bits((uint32_t)b << 23);
}

uint8_t ds41_ue8m0_scale_byte(float amax, float recip) {
    float t = amax * recip;
    uint32_t bits = f32_bits(t);
    uint32_t e = (bits >> 23) & 0xFFu;
    uint32_t m = bits & 0x7FFFFFu;
    if (e == 0xFFu) return DS41_UE8M0_NAN; /* t inf or NaN */
    int k = (int)e - 127 + (m != 0);
    if (k > 127) return DS41_UE8M0_NAN; /* would need 2^128 */
    return (uint8_t)(k + 127);
}

/* ---- e2m1 --------------------------------------------------------------- */

const float ds41_e2m1_table[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

float ds41_e2m1_to_f32(uint8_t code) {
    return ds41_e2m1_table[code & 0x0F];
}

uint8_t ds41_e2m1_from_f32(float v) {
    uint8_t sign = signbit(v) ? 8 : 0;
    float a = fabsf(v);
    uint8_t mag;
    /* "<=" at a threshold stays down, "<" goes up: ties to the even code. */
    if (a <= 0.25f)
        mag = 0;
    else if (a < 0.75f)
        mag = 1;
    else if (a <= 1.25f)
        mag = 2;
    else if (a < 1.75f)
        mag = 3;
    else if (a <= 2.5f)
        mag = 4;
    else if (a < 3.5f)
        mag = 5;
    else if (a <= 5.0f)
        mag = 6;
    else
        mag = 7; /* (5, inf] and NaN: saturate */
    return (uint8_t)(sign | mag);
}

/* ---- per-element steps of the block quantizers -------------------------- */

/* e4m3(clamp(x / s)); the clamp is inside ds41_e4m3_from_f32. */
static uint8_t fp8_code(float x, float s) {
    float v = x / s;
    return ds41_e4m3_from_f32(v);
}

/* e2m1(clamp(fp32(x / s), -6, 6)); the clamp keeps NaN. */
static uint8_t fp4_code(float x, float s) {
    float v = x / s;
    if (v > DS41_E2M1_MAX)
        v = DS41_E2M1_MAX;
    else if (v < -DS41_E2M1_MAX)
        v = -DS41_E2M1_MAX;
    return ds41_e2m1_from_f32(v);
}

static uint8_t fp8_block_scale(const float *x, size_t len) {
    float amax = floor_amax(abs_max(x, len), DS41_FP8_AMAX_FLOOR);
    return ds41_ue8m0_scale_byte(amax, DS41_FP8_RECIP);
}

static uint8_t fp4_ue8m0_block_scale(const float *x, size_t len) {
    float amax = floor_amax(abs_max(x, len), DS41_FP4_AMAX_FLOOR);
    return ds41_ue8m0_scale_byte(amax, DS41_FP4_RECIP);
}

static uint8_t fp4_e4m3_block_scale(const float *x, size_t len) {
    float amax = floor_amax(abs_max(x, len), DS41_FP4_E4M3_AMAX_FLOOR);
    float s = amax / 6.0f;
    return ds41_e4m3_from_f32(s);
}

/* ---- activations -------------------------------------------------------- */

void ds41_act_quant(const float *x, size_t n, uint8_t *q, uint8_t *scale) {
    for (size_t b0 = 0, bi = 0; b0 < n; b0 += DS41_QUANT_BLOCK, bi++) {
        size_t len = min_size(DS41_QUANT_BLOCK, n - b0);
        uint8_t sb = fp8_block_scale(x + b0, len);
        float s = ds41_ue8m0_to_f32(sb);
        scale[bi] = sb;
        for (size_t i = 0; i < len; i++) q[b0 + i] = fp8_code(x[b0 + i], s);
    }
}

void ds41_act_quant_qdq(float *x, size_t n) {
    for (size_t b0 = 0; b0 < n; b0 += DS41_QUANT_BLOCK) {
        size_t len = min_size(DS41_QUANT_BLOCK, n - b0);
        float s = ds41_ue8m0_to_f32(fp8_block_scale(x + b0, len));
        for (size_t i = 0; i < len; i++) {
            float value = ds41_e4m3_to_f32(fp8_code(x[b0 + i], s));
            float product = value * s;
            x[b0 + i] = ds41_bf16_round(product);
        }
    }
}

void ds41_fp4_act_quant_ue8m0(const float *x, size_t n, uint8_t *packed, uint8_t *scale) {
    for (size_t b0 = 0, bi = 0; b0 < n; b0 += DS41_QUANT_BLOCK, bi++) {
        size_t len = min_size(DS41_QUANT_BLOCK, n - b0);
        uint8_t sb = fp4_ue8m0_block_scale(x + b0, len);
        float s = ds41_ue8m0_to_f32(sb);
        scale[bi] = sb;
        for (size_t i = 0; i < len; i++) put_nibble(packed, b0 + i, fp4_code(x[b0 + i], s));
    }
}

void ds41_fp4_act_quant_ue8m0_qdq(float *x, size_t n) {
    for (size_t b0 = 0; b0 < n; b0 += DS41_QUANT_BLOCK) {
        size_t len = min_size(DS41_QUANT_BLOCK, n - b0);
        float s = ds41_ue8m0_to_f32(fp4_ue8m0_block_scale(x + b0, len));
        for (size_t i = 0; i < len; i++) {
            float value = ds41_e2m1_to_f32(fp4_code(x[b0 + i], s));
            float product = value * s;
            x[b0 + i] = ds41_bf16_round(product);
        }
    }
}

void ds41_fp4_act_quant_e4m3(const float *x, size_t n, uint8_t *packed, uint8_t *scale) {
    for (size_t b0 = 0, bi = 0; b0 < n; b0 += DS41_FP4_E4M3_BLOCK, bi++) {
        size_t len = min_size(DS41_FP4_E4M3_BLOCK, n - b0);
        uint8_t sb = fp4_e4m3_block_scale(x + b0, len);
        float s = ds41_e4m3_to_f32(sb);
        scale[bi] = sb;
        for (size_t i = 0; i < len; i++) put_nibble(packed, b0 + i, fp4_code(x[b0 + i], s));
    }
}

void ds41_fp4_act_quant_e4m3_qdq(float *x, size_t n) {
    for (size_t b0 = 0; b0 < n; b0 += DS41_FP4_E4M3_BLOCK) {
        size_t len = min_size(DS41_FP4_E4M3_BLOCK, n - b0);
        float s = ds41_e4m3_to_f32(fp4_e4m3_block_scale(x + b0, len));
        for (size_t i = 0; i < len; i++) {
            float value = ds41_e2m1_to_f32(fp4_code(x[b0 + i], s));
            float product = value * s;
            x[b0 + i] = ds41_bf16_round(product);
        }
    }
}

void ds41_dequant_fp4_e4m3_1x16(const uint8_t *packed, const uint8_t *scale, size_t n, float *out) {
    for (size_t i = 0; i < n; i++) {
        float s = ds41_e4m3_to_f32(scale[i / DS41_FP4_E4M3_BLOCK]);
        out[i] = ds41_e2m1_to_f32(get_nibble(packed, i)) * s;
    }
}

/* ---- weights ------------------------------------------------------------ */

void ds41_quant_fp8_weight(const float *w, size_t N, size_t K, uint8_t *q, uint8_t *scale) {
    size_t kblocks = ceil_div(K, DS41_QUANT_BLOCK);
    for (size_t n0 = 0, bn = 0; n0 < N; n0 += DS41_QUANT_BLOCK, bn++) {
        size_t rows = min_size(DS41_QUANT_BLOCK, N - n0);
        for (size_t k0 = 0, bk = 0; k0 < K; k0 += DS41_QUANT_BLOCK, bk++) {
            size_t cols = min_size(DS41_QUANT_BLOCK, K - k0);
            float amax = 0.0f;
            for (size_t r = 0; r < rows; r++) {
                float row_max = abs_max(w + (n0 + r) * K + k0, cols);
                if (row_max > amax || isnan(row_max)) amax = row_max;
                if (isnan(amax)) break;
            }
            amax = floor_amax(amax, DS41_FP8_AMAX_FLOOR);
            uint8_t sb = ds41_ue8m0_scale_byte(amax, DS41_FP8_RECIP);
            float s = ds41_ue8m0_to_f32(sb);
            scale[bn * kblocks + bk] = sb;
            for (size_t r = 0; r < rows; r++) {
                size_t base = (n0 + r) * K + k0;
                for (size_t c = 0; c < cols; c++) q[base + c] = fp8_code(w[base + c], s);
            }
        }
    }
}

void ds41_dequant_fp8_weight(const uint8_t *q, const uint8_t *scale, size_t N, size_t K, float *out) {
    size_t kblocks = ceil_div(K, DS41_QUANT_BLOCK);
    for (size_t n = 0; n < N; n++) {
        const uint8_t *srow = scale + (n / DS41_QUANT_BLOCK) * kblocks;
        for (size_t k = 0; k < K; k++) {
            float s = ds41_ue8m0_to_f32(srow[k / DS41_QUANT_BLOCK]);
            out[n * K + k] = ds41_e4m3_to_f32(q[n * K + k]) * s;
        }
    }
}

void ds41_quant_fp4_weight(const float *w, size_t N, size_t K, uint8_t *packed, uint8_t *scale) {
    size_t row_bytes = ceil_div(K, 2);
    size_t row_scales = ceil_div(K, DS41_QUANT_BLOCK);
    for (size_t n = 0; n < N; n++)
        ds41_fp4_act_quant_ue8m0(w + n * K, K, packed + n * row_bytes, scale + n * row_scales);
}

void ds41_dequant_fp4_weight(const uint8_t *packed, const uint8_t *scale, size_t N, size_t K, float *out) {
    size_t row_bytes = ceil_div(K, 2);
    size_t row_scales = ceil_div(K, DS41_QUANT_BLOCK);
    for (size_t n = 0; n < N; n++) {
        const uint8_t *prow = packed + n * row_bytes;
        const uint8_t *srow = scale + n * row_scales;
        for (size_t k = 0; k < K; k++) {
            float s = ds41_ue8m0_to_f32(srow[k / DS41_QUANT_BLOCK]);
            out[n * K + k] = ds41_e2m1_to_f32(get_nibble(prow, k)) * s;
        }
    }
}

void ds41_dequant_fp8_rows_1x32(const uint8_t *q, const uint8_t *scale, size_t rows, size_t cols,
                                float *out) {
    size_t row_scales = ceil_div(cols, DS41_QUANT_BLOCK);
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *srow = scale + r * row_scales;
        for (size_t c = 0; c < cols; c++) {
            float s = ds41_ue8m0_to_f32(srow[c / DS41_QUANT_BLOCK]);
            out[r * cols + c] = ds41_e4m3_to_f32(q[r * cols + c]) * s;
        }
    }
}
