/* The codecs of engine/model/quant.h as host+device functions (cuda/hd.h),
 * bit for bit: bf16, e4m3fn, e2m1 and ue8m0, both ways.  Shared by every op
 * family of the CUDA backend (cuda/num_*.h); tests/test_cuda_linear.c,
 * test_cuda_attn.c and test_cuda_misc.c check them exhaustively against
 * quant.c. */
#ifndef DS41_CUDA_NUM_CODEC_H
#define DS41_CUDA_NUM_CODEC_H

#include "cuda/hd.h"

#include <stdint.h>

/* fp32 product rounded once (never fused into a neighbouring add). */
DS41_HD float ds41_hd_fmul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

/* fp32 -> bf16 bits (RNE), NaN kept with its quiet bit set. */
DS41_HD uint16_t ds41_hd_bf16_bits(float x) {
    uint32_t u = ds41_hd_f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u); /* nearest, ties to even; a carry is the next binade */
    return (uint16_t)(u >> 16);
}

DS41_HD float ds41_hd_bf16_to_f32(uint16_t b) {
    return ds41_hd_f32_from_bits((uint32_t)b << 16);
}

/* fp32 -> nearest bf16 value (RNE), NaN kept with its quiet bit set. */
DS41_HD float ds41_hd_bf16_round(float x) {
    uint32_t u = ds41_hd_f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ds41_hd_f32_from_bits((u | 0x00400000u) & 0xFFFF0000u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return ds41_hd_f32_from_bits(u & 0xFFFF0000u);
}

/* e4m3fn byte -> value; 0x7F / 0xFF are NaN (signed quiet NaN, as the table). */
DS41_HD float ds41_hd_e4m3_to_f32(uint8_t b) {
    const uint32_t s = (uint32_t)(b >> 7) << 31, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15u && m == 7u) return ds41_hd_f32_from_bits(s | 0x7FC00000u);
    if (e == 0u) return ds41_hd_f32_from_bits(s | ds41_hd_f32_bits((float)m * 0x1p-9f));
    return ds41_hd_f32_from_bits(s | ((e + 120u) << 23) | (m << 20));
}

/* e2m1 code (low 4 bits) -> value: 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives. */
DS41_HD float ds41_hd_e2m1_to_f32(uint8_t code) {
    const uint32_t s = (uint32_t)((code >> 3) & 1u) << 31, e = (code >> 1) & 3u, m = code & 1u;
    if (e == 0u) return ds41_hd_f32_from_bits(s | (m ? 0x3F000000u : 0u));
    return ds41_hd_f32_from_bits(s | ((e + 126u) << 23) | (m << 22));
}

/* 2^(b - 127); 0 -> 2^-127 (subnormal), 255 -> NaN. */
DS41_HD float ds41_hd_ue8m0_to_f32(uint8_t b) {
    if (b == 255) return ds41_hd_f32_from_bits(0x7FC00000u);
    if (b == 0) return ds41_hd_f32_from_bits(0x00400000u);
    return ds41_hd_f32_from_bits((uint32_t)b << 23);
}

/* fp32 -> e4m3fn byte: clamp to +-448, RNE on the normal and subnormal
 * grids, NaN -> 0x7F with v's sign (ds41_e4m3_from_f32). */
DS41_HD uint8_t ds41_hd_e4m3_from_f32(float v) {
    const uint32_t u = ds41_hd_f32_bits(v);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint8_t)(sign | 0x7F);
    if (a >= 0x43E00000u) return (uint8_t)(sign | 0x7E);
    const uint32_t exp = a >> 23;
    if (exp >= 121u) {
        uint32_t code = ((exp - 120u) << 3) | ((a >> 20) & 7u);
        const uint32_t rem = a & 0xFFFFFu;
        if (rem > 0x80000u || (rem == 0x80000u && (code & 1u))) code++;
        return (uint8_t)(sign | code);
    }
    if (exp == 0u) return sign;
    const uint32_t shift = 141u - exp;
    if (shift >= 25u) return sign;
    const uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
    uint32_t kept = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (kept & 1u))) kept++;
    return (uint8_t)(sign | kept);
}

/* The ue8m0 byte of a floored amax: 2^ceil(log2 fp32(amax * recip)) from the
 * bit pattern (ds41_ue8m0_scale_byte). */
DS41_HD uint8_t ds41_hd_ue8m0_scale_byte(float amax, float recip) {
    const uint32_t bits = ds41_hd_f32_bits(ds41_hd_fmul(amax, recip));
    const uint32_t e = (bits >> 23) & 0xFFu, m = bits & 0x7FFFFFu;
    if (e == 0xFFu) return 255;
    const int k = (int)e - 127 + (m != 0u);
    if (k > 127) return 255;
    return (uint8_t)(k + 127);
}

/* fp32 -> e2m1 code (ds41_e2m1_from_f32): the magnitude code counts the
 * thresholds |v| passes (0.25 0.75 1.25 1.75 2.5 3.5 5); exactly at one, the
 * odd ones (0.75, 1.75, 3.5) go up (ties to the even code); NaN saturates to
 * 7; the sign bit is v's. */
DS41_HD uint8_t ds41_hd_e2m1_from_f32(float v) {
    const float th[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const uint32_t u = ds41_hd_f32_bits(v);
    const float a = ds41_hd_f32_from_bits(u & 0x7FFFFFFFu);
    uint8_t mag = (u & 0x7FFFFFFFu) > 0x7F800000u ? 7 : 0;
    for (int i = 0; i < 7; i++)
        if (a > th[i] || (a == th[i] && (i & 1))) mag = (uint8_t)(i + 1);
    return (uint8_t)((u >> 31 ? 8 : 0) | mag);
}

#endif
