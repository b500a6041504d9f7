/* Quantization codecs: bf16, FP8 e4m3fn, UE8M0 scales, FP4 e2m1, and the
 * block quantizers built from them (REFERENCE.md §1, §2.1, §10.1).
 *
 * This is the numerics base of ds41: every function here is exact, i.e. it
 * reproduces the reference's rounding bit for bit, and is independent of the
 * floating-point environment as far as C allows (the default rounding mode
 * and no flush-to-zero are assumed; ds41 never changes either).
 *
 * Conventions shared by the block functions below:
 *  - Blocks run along the last (contiguous) dimension.  The model only uses
 *    lengths that are multiples of the block, but every function is defined
 *    for any length: a trailing partial block is quantized on its own (its
 *    amax taken over the elements it has).  Output sizes are therefore given
 *    as ceil(n/block) scales and ceil(n/2) packed FP4 bytes; for lengths that
 *    are multiples of the block these are exactly n/block and n/2.
 *  - n == 0 (or N == 0 / K == 0) does nothing and touches no pointer.
 *  - Pointers must not be NULL otherwise and buffers must have the documented
 *    sizes; inputs and outputs must not overlap (except the in-place *_qdq
 *    functions, which only use x).  The caller owns every buffer.
 *  - Non-finite input is never undefined behaviour.  A block whose amax is
 *    NaN gets a NaN scale (ue8m0 byte 255 / e4m3 byte 0x7F) and dequantizes to
 *    NaN as a whole; see each function for infinities.
 *  - FP4 packing: element 2i is the low nibble of byte i, element 2i+1 the
 *    high nibble.  With an odd length the last high nibble is written as 0.
 */
#ifndef DS41_ENGINE_QUANT_H
#define DS41_ENGINE_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* ---- constants (REFERENCE §1.2, §1.5) ----------------------------------- */

/* amax floors applied before choosing a scale. */
#define DS41_FP8_AMAX_FLOOR 1e-4f          /* FP8 activations, FP8 weights */
#define DS41_FP4_AMAX_FLOOR 0x1.8p-124f    /* 6 * 2^-126: FP4 with UE8M0 scales */
#define DS41_FP4_E4M3_AMAX_FLOOR 0x1.8p-7f /* 6 * 2^-9 = 0.01171875: FP4 with e4m3 scales */

/* fp32 reciprocals multiplied into amax to pick a UE8M0 scale (not a division). */
#define DS41_FP8_RECIP 0x1.24924ap-9f /* fp32(1/448) = 0.0022321429569274187 */
#define DS41_FP4_RECIP 0x1.555556p-3f /* fp32(1/6)   = 0.1666666716337204 */

#define DS41_E4M3_MAX 448.0f /* largest finite e4m3fn value */
#define DS41_E2M1_MAX 6.0f   /* largest e2m1 value */

/* Block sizes used by the model. */
#define DS41_QUANT_BLOCK 32    /* FP8 act 1x32, FP4 1x32, weights 32x32 */
#define DS41_FP4_E4M3_BLOCK 16 /* compressed-KV FP4 with e4m3 scales */

/* UE8M0 byte meaning "no scale": NaN. */
#define DS41_UE8M0_NAN 255

/* ---- bf16 ---------------------------------------------------------------- */

/* fp32 -> bf16 bit pattern, round to nearest, ties to even.  Overflow rounds
 * to +-inf, infinities stay infinite, subnormals round on the same grid (no
 * flush), and a NaN stays a NaN with its sign and quiet bit set (its upper
 * payload bits are kept). */
uint16_t ds41_bf16_bits(float x);

/* bf16 bit pattern -> fp32 (exact). */
float ds41_bf16_to_f32(uint16_t b);

/* fp32 rounded to the nearest bf16 value, returned as fp32 (the reference's
 * bf16(x)). */
float ds41_bf16_round(float x);

/* ---- FP8 e4m3fn (§1.1) --------------------------------------------------- */

/* Decode table: ds41_e4m3_table[b] is the value of byte b; 0x7F and 0xFF are
 * NaN (positive and negative), 0x80 is -0.0. */
extern const float ds41_e4m3_table[256];

/* Byte -> value (the table above). */
float ds41_e4m3_to_f32(uint8_t b);

/* fp32 -> e4m3fn byte: clamp to [-448, 448] (so +-inf and every overflow give
 * +-448), then round to nearest, ties to even on the 3-bit mantissa, including
 * the subnormal grid of step 2^-9 below 2^-6: |v| <= 2^-10 gives zero (2^-10
 * itself ties to 0).  The sign of a zero result is the sign of v.  NaN gives
 * 0x7F with v's sign bit (0x7F or 0xFF). */
uint8_t ds41_e4m3_from_f32(float v);

/* ---- UE8M0 scales (§1.2) ------------------------------------------------- */

/* Byte -> 2^(b-127); b = 0 gives 2^-127 (an fp32 subnormal, exact), b = 255
 * gives NaN. */
float ds41_ue8m0_to_f32(uint8_t b);

/* Scale byte for a block, §1.2 steps 2-4, from an amax that the caller has
 * ALREADY floored (step 1; use DS41_*_AMAX_FLOOR) and the reciprocal of the
 * format's maximum (DS41_FP8_RECIP or DS41_FP4_RECIP):
 *   t = fp32(amax * recip); E, M = exponent and mantissa fields of t;
 *   k = E - 127 + (M != 0); return k + 127.
 * i.e. the power of two rounded UP from t, taken from t's bit pattern exactly
 * as the reference does.  The sign of t is ignored (amax should be >= 0).
 * Edge cases, all defined:
 *   - t == 0 (amax 0, not floored) -> byte 0 (2^-127);
 *   - t an fp32 subnormal (only reachable with an unfloored amax) -> byte 1
 *     (2^-126), as the bit rule gives; not the tight ceil(log2 t);
 *   - t infinite or NaN (amax inf/NaN), or t > 2^127 so that 2^128 would be
 *     needed -> DS41_UE8M0_NAN (255): UE8M0 has no larger value, and a
 *     clipped scale would silently change the block.  With the two standard
 *     reciprocals and a finite amax this never happens (largest bytes: 247
 *     for FP8, 253 for FP4). */
uint8_t ds41_ue8m0_scale_byte(float amax, float recip);

/* ---- FP4 e2m1 (§1.3) ----------------------------------------------------- */

/* Decode table: 0,0.5,1,1.5,2,3,4,6,-0,-0.5,-1,-1.5,-2,-3,-4,-6. */
extern const float ds41_e2m1_table[16];

/* Code (low 4 bits of `code`; the high bits are ignored) -> value. */
float ds41_e2m1_to_f32(uint8_t code);

/* fp32 -> 4-bit code (0..15) by the §1.3 thresholds on |v|: 0.25, 0.75, 1.25,
 * 1.75, 2.5, 3.5, 5.0; strictly above a threshold takes the upper code, exactly
 * at one goes up only for 0.75, 1.75 and 3.5 (ties to the even code).  The
 * sign bit (bit 3) is v's sign bit, so -0.0 gives code 8.  The input is meant
 * to be clamped to [-6, 6] already; larger magnitudes (including +-inf)
 * saturate to +-6 (code 7 / 15), which is what the clamp would give.  NaN
 * (never produced by the model's clamped paths unless the block itself holds
 * NaN) gives +-6 with NaN's sign bit, like a saturating hardware conversion;
 * the block functions below make such blocks NaN through their scale anyway. */
uint8_t ds41_e2m1_from_f32(float v);

/* ---- activations (§2.1, §1.5, §1.6) --------------------------------------
 * x holds bf16-representable values (the functions do not round x to bf16
 * first; with other values they quantize the given fp32 values). */

/* FP8 activation quantization, act_quant(x, 32, "ue8m0"): per 1x32 block,
 * amax = max(max|x|, 1e-4), s = 2^k via ds41_ue8m0_scale_byte(amax,
 * DS41_FP8_RECIP), q = e4m3(clamp(x / s, +-448)) with a true fp32 division.
 * q[n] receives the e4m3 codes, scale[ceil(n/32)] the UE8M0 bytes.  The
 * dequantized values are ds41_dequant_fp8_rows_1x32(q, scale, 1, n, out). */
void ds41_act_quant(const float *x, size_t n, uint8_t *q, uint8_t *scale);

/* The same quantization applied in place (act_quant(..., inplace=True)):
 * x[i] <- bf16(e4m3value(q[i]) * s).  The product is exact and representable
 * in bf16 except that it overflows to +-inf when the block's amax is within
 * an e4m3 rounding step of FLT_MAX, as in the reference. */
void ds41_act_quant_qdq(float *x, size_t n);

/* FP4 activation quantization with UE8M0 scales, block 32 (§1.5, indexer q and
 * index keys): amax = max(max|x|, 6*2^-126), s = 2^k via
 * ds41_ue8m0_scale_byte(amax, DS41_FP4_RECIP), v = clamp(fp32(x / s), -6, 6),
 * code = e2m1(v).  packed[ceil(n/2)] receives the codes (nibble order above),
 * scale[ceil(n/32)] the UE8M0 bytes.  Dequantize with
 * ds41_dequant_fp4_weight(packed, scale, 1, n, out). */
void ds41_fp4_act_quant_ue8m0(const float *x, size_t n, uint8_t *packed, uint8_t *scale);

/* In place: x[i] <- bf16(e2m1value * s) (exact). */
void ds41_fp4_act_quant_ue8m0_qdq(float *x, size_t n);

/* FP4 activation quantization with e4m3 scales, block 16 (§1.5, compressed KV
 * latent): amax = max(max|x|, 6*2^-9), s = e4m3(fp32(amax / 6.0f)) (a true
 * division, then the saturating RNE e4m3 cast; s is in [2^-9, 448] and not in
 * general a power of two), v = clamp(fp32(x / s), -6, 6), code = e2m1(v).
 * packed[ceil(n/2)] receives the codes, scale[ceil(n/16)] the e4m3 scale
 * bytes.  Dequantize with ds41_dequant_fp4_e4m3_1x16. */
void ds41_fp4_act_quant_e4m3(const float *x, size_t n, uint8_t *packed, uint8_t *scale);

/* In place: x[i] <- bf16(e2m1value * s) (exact: 2 x 4 significant bits). */
void ds41_fp4_act_quant_e4m3_qdq(float *x, size_t n);

/* Dequantize ds41_fp4_act_quant_e4m3 output: out[i] = e2m1value(code i) *
 * e4m3value(scale[i/16]), fp32, exact.  A NaN scale byte gives NaN. */
void ds41_dequant_fp4_e4m3_1x16(const uint8_t *packed, const uint8_t *scale, size_t n, float *out);

/* ---- weights (§1.4) ------------------------------------------------------
 * w / out are [N][K] fp32 row-major.  Dequantization is exact in fp32: an
 * e4m3 or e2m1 value times 2^(b-127) needs at most 4 significant bits whose
 * lowest lies at or above 2^-136 (e4m3 2^-9 times 2^-127), so it never
 * underflows.  It overflows to +-inf only when the exact value exceeds
 * FLT_MAX, which needs a scale byte >= 247 (e4m3) or >= 253 (e2m1); the
 * quantizers produce such bytes only for blocks whose amax is within a
 * rounding step of FLT_MAX (e.g. FLT_MAX -> q 256, s 2^120 -> inf), as the
 * reference would.  A scale byte 255 (NaN) dequantizes its block to NaN. */

/* FP8 weight: one UE8M0 scale per 32x32 block, scale[ceil(N/32)][ceil(K/32)]
 * row-major (edge blocks are partial); per block amax = max(max|w|, 1e-4),
 * byte = ds41_ue8m0_scale_byte(amax, DS41_FP8_RECIP), q[N][K] = e4m3(w / s). */
void ds41_quant_fp8_weight(const float *w, size_t N, size_t K, uint8_t *q, uint8_t *scale);

/* Inverse: out[n][k] = e4m3value(q[n][k]) * 2^(scale[n/32][k/32] - 127). */
void ds41_dequant_fp8_weight(const uint8_t *q, const uint8_t *scale, size_t N, size_t K, float *out);

/* FP4 weight (routed experts): per row, one UE8M0 scale per 32 consecutive K
 * (scale[N][ceil(K/32)]); amax = max(max|w|, 6*2^-126), byte =
 * ds41_ue8m0_scale_byte(amax, DS41_FP4_RECIP), code = e2m1(clamp(w / s, -6,
 * 6)).  packed is [N][ceil(K/2)] (the checkpoint's [N, K/2] I8 tensor; the
 * model has K % 32 == 0). */
void ds41_quant_fp4_weight(const float *w, size_t N, size_t K, uint8_t *packed, uint8_t *scale);

/* Inverse: out[n][k] = e2m1value(code) * 2^(scale[n][k/32] - 127). */
void ds41_dequant_fp4_weight(const uint8_t *packed, const uint8_t *scale, size_t N, size_t K, float *out);

/* FP8 rows with 1x32 scales (Engram tables [rows, 256] with [rows, 8], and
 * ds41_act_quant output): out[r][c] = e4m3value(q[r][c]) * 2^(scale[r][c/32]
 * - 127), scale is [rows][ceil(cols/32)]. */
void ds41_dequant_fp8_rows_1x32(const uint8_t *q, const uint8_t *scale, size_t rows, size_t cols, float *out);

#endif
