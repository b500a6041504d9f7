/* ds41_refmath: the canonical arithmetic of the engine's reference mode
 * (REFERENCE.md §10).
 *
 * Reductions.  Every reduction of the reference mode (dot products, means of
 * squares, softmax denominators, PV sums, head sums) is the EXACT sum of its
 * terms, rounded once to fp32 with round-to-nearest-even (§10.2).  The terms
 * handed in are doubles that the caller has formed exactly (an fp32 x fp32
 * product needs at most 48 significant bits, so it is exact in double).  The
 * accumulator below holds the sum as a fixed-point integer wide enough for
 * every finite double (2^-1074 .. 2^1024), so no term is ever rounded; the
 * single rounding to fp32 happens at the end and looks at every bit of the
 * exact value (no double rounding through a double intermediate).
 *
 * Special values (decisions shared with the numpy reference,
 * tests/reference/README.md "Decisions"):
 *  - an exact sum equal to zero is +0.0, whatever the signs of the terms;
 *  - a non-zero exact value too small for fp32 rounds to a signed zero or
 *    subnormal on the 2^-149 grid, too large rounds to +-inf;
 *  - non-finite terms follow IEEE addition: a NaN term or +inf and -inf
 *    together give NaN, otherwise an infinity gives that infinity.
 *
 * Elementwise functions (§10.5): exp, log1p, sqrt, rsqrt, sigmoid, silu,
 * softplus, cos, sin and pow are evaluated in double from the fp32 argument
 * with the C library and rounded once to fp32:
 *   sigmoid(x) = 1 / (1 + exp(-x)), silu(x) = x / (1 + exp(-x)),
 *   softplus(x) = x if x > 20 else log1p(exp(x)), rsqrt(x) = 1 / sqrt(x).
 *
 * Everything here is pure and thread-safe.  The build uses
 * -ffp-contract=off, so no multiply-add is ever fused (§10.6). */
#ifndef DS41_ENGINE_REFMATH_H
#define DS41_ENGINE_REFMATH_H

#include <stddef.h>
#include <stdint.h>

/* ---- exact accumulator ---------------------------------------------------- */

/* 32 value bits per limb, kept in int64 so that 2^30 terms can be added
 * before carries must be propagated.  Bit i of the fixed-point integer has
 * weight 2^(i - 1074); a double's 53-bit significand at most reaches bit
 * 2098, which needs limb 65, plus room for carries and the sign. */
#define DS41_XACC_LIMBS 68

typedef struct ds41_xacc {
    int64_t limb[DS41_XACC_LIMBS];
    int lo, hi;       /* limbs touched since the last reset: [lo, hi] (lo > hi: none) */
    uint32_t pending; /* terms added since carries were last propagated */
    uint8_t nan, pinf, ninf;
} ds41_xacc;

/* Start an empty (zero) sum.  Must be called once before the first use; the
 * finishing functions leave the accumulator reset for reuse. */
void ds41_xacc_init(ds41_xacc *a);

/* Add one term exactly.  Any double is allowed (subnormals, +-0, inf, NaN). */
void ds41_xacc_add(ds41_xacc *a, double x);

/* The exact sum rounded once to fp32 (RNE; see the special values above).
 * Resets the accumulator to zero. */
float ds41_xacc_round(ds41_xacc *a);

/* fp32(exact sum / n) rounded once (RNE), n >= 1.  Resets the accumulator. */
float ds41_xacc_round_div(ds41_xacc *a, uint64_t n);

/* ---- reductions built on it ------------------------------------------------- */

/* fp32(exact sum of t[i]) for exact double terms (e.g. fp32 products).
 *
 * All the reductions below first try a fast path: the plain double sum with
 * an a-priori error bound; when every value within the bound rounds to the
 * same fp32 that is the exact answer (rounding is monotonic), otherwise they
 * redo the sum with the exact accumulator.  The result is always the exact
 * sum rounded once. */
float ds41_xsum_f64(const double *t, size_t n);

/* fp32(exact sum of x[i]). */
float ds41_xsum_f32(const float *x, size_t n);

/* fp32(exact sum of a[i] * b[i]): each product is exact in double. */
float ds41_xdot_f32(const float *a, const float *b, size_t n);

/* The same with b given as bf16 bit patterns (weights straight from the
 * checkpoint; the bf16 -> fp32 conversion is exact). */
float ds41_xdot_f32_bf16(const float *a, const uint16_t *b, size_t n);

/* The fast path those reductions share, for callers that form the double sum
 * themselves (vectorized kernels): s is a double sum of n exact terms in any
 * order and abs_sum the double sum of their magnitudes.  Returns 1 and the
 * exact sum rounded once in *out when the error bound (n + 2) 2^-52 abs_sum
 * leaves a single non-zero fp32 candidate, or every term is zero (+0); 0
 * when the caller must take the exact route (e.g. ds41_xdot_f32_bf16). */
int ds41_xsum_try_round(double s, double abs_sum, size_t n, float *out);

/* Mean of squares as §10.5: each square rounded to fp32 first, then
 * fp32(exact sum / n).  n >= 1. */
float ds41_mean_sq_f32(const float *x, size_t n);

/* ---- elementwise functions (double evaluation, one rounding) ------------- */

float ds41_rm_exp(float x);
float ds41_rm_sqrt(float x);
float ds41_rm_rsqrt(float x);
float ds41_rm_sigmoid(float x);
float ds41_rm_silu(float x);
float ds41_rm_softplus(float x);

/* Rope frequencies of one layer (§2.6, §10.5): f[0 .. rd/2-1] with
 *   e_i = fp32(fp32(2i) / fp32(rd)), p_i = fp32(pow(fp32(base), e_i)),
 *   f_i = fp32(1 / p_i);
 * and, when original_seq_len > 0 (YaRN), with low/high from §2.6 in double,
 *   ramp_i = clamp(fp32(fp32(i - low) / fp32(max(high - low, 1e-3))), 0, 1),
 *   smooth_i = fp32(1 - ramp_i),
 *   f_i = fp32(fp32(fp32(f_i / factor) * fp32(1 - smooth_i)) + fp32(f_i * smooth_i))
 * (factor as fp32).  rd must be even and >= 2. */
void ds41_rope_freqs(int rd, double base, int64_t original_seq_len, double factor, double beta_fast,
                     double beta_slow, float *f);

/* cos and sin of the angle fp32(fp32(pos) * f_i) for every pair, evaluated
 * in double and rounded: cs[2i] = cos, cs[2i+1] = sin, i < n_pairs. */
void ds41_rope_cos_sin(const float *f, int n_pairs, uint64_t pos, float *cs);

/* Rotate the n_pairs adjacent pairs (x[2i], x[2i+1]) in place (§10.6):
 *   forward (a, b) -> (fp32(a c) - fp32(b s), fp32(a s) + fp32(b c)),
 *   inverse (a, b) -> (fp32(a c) + fp32(b s), fp32(b c) - fp32(a s)),
 * each result rounded to bf16 (the write-back). */
void ds41_rope_apply(float *x, int n_pairs, const float *cs, int inverse);

/* Compressor pooling of one completed group (§2.9): ckv and csc hold the
 * group's fp32 kv and gate scores slot by slot ([ratio][hd]); per channel a
 * softmax over the ratio scores (shifted by their maximum, so no exp
 * overflows: exp in double rounded to fp32, the sum a short fp32 sum in slot
 * order), the kv weighted by it and summed in slot order, rounded to bf16
 * into pooled[hd].  ex: ratio floats of scratch.  Shared by every CPU
 * backend's compress_pool op (engine/backend/ops.h). */
void ds41_rm_compress_pool(const float *ckv, const float *csc, int ratio, size_t hd, float *ex,
                           float *pooled);

/* The MoE combine of one token (§2.6, fp32 per §1.7): out[d] = bf16(y[d] +
 * shared[d]) with y[d] the fp32 sum, from 0, of oe[slot[j]*D + d] over
 * j < n in that order (the token's routed outputs in increasing expert id).
 * out is the accumulator, so no scratch.  Shared by every CPU backend's
 * moe_combine op. */
void ds41_rm_moe_combine_token(const float *oe, const uint32_t *slot, size_t n, const float *shared, size_t D,
                               float *out);

/* Hyper-connection mixes of one token (REFERENCE §2.5), in the reference's
 * fp32 expression order: pre = sigmoid(mix*scale0 + base) + eps, post =
 * 2 sigmoid(...), comb = Sinkhorn-normalised exp of the hc x hc block (row
 * softmax + eps, then `iters` alternating row/column normalisations).  mix
 * holds (2 + hc) * hc values; c receives comb [hc][hc].  Shared by every CPU
 * backend so the mixes are the same bits everywhere. */
void ds41_rm_hc_sinkhorn(const float *mix, const float *scale, const float *base, int hc, int iters, float eps,
                         float *pre, float *post, float *c);

#endif
