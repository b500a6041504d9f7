/* The arithmetic of the CUDA backend's linear layers (ops linear and
 * linear_batch, engine/backend/ops.h), written once for the kernels
 * (cuda/k_linear.cu) and their host emulation (cuda/emu_linear.c).
 *
 * Decomposition (both sides).  An output y[m][n] is computed by one warp of
 * 32 lanes from the K products of row m and weight row n.  K is cut into
 * chunks: for FP8 / FP4 weights the 32-wide scale blocks (chunk c = block
 * kb, K elements 32c .. 32c+31), for BF16 weights 8 elements (16 bytes of
 * weight, DS41_LIN_BF16_CHUNK).  Lane l takes chunks c = l, l + 32, l + 64,
 * ... in that order (so a warp reads 32 consecutive chunks of the weight
 * row at once: coalesced), keeps one partial, and the 32 partials are
 * combined by the xor butterfly ds41_lin_tree_* (the kernel's
 * __shfl_xor_sync with offsets 16, 8, 4, 2, 1, each lane adding its own
 * value first; fp32 / double addition is commutative, so every lane ends
 * with the same value).  The order depends only on K: never on M, the row's
 * place in the batch, the grid or which warp runs it (batch invariance).
 * The trailing chunk of a K that is not a multiple of its width is simply
 * shorter.  Every fp32 operation is one correctly rounded IEEE operation
 * (__fadd_rn / __fmul_rn / __fmaf_rn on the device, so nvcc never contracts
 * or reorders; the host build has -ffp-contract=off and fmaf is correctly
 * rounded), so kernel and emulation agree bit for bit.
 *
 * The variants, per out kind (u = 2^-24, S = sum_k |x_k w_k| of the exact
 * (dequantized) values; bounds are against the reference op,
 * engine/backend/ops_ref.c, before the output's bf16 rounding, which adds
 * at most one bf16 ulp):
 *
 *  FP8 / FP4, DS41_OUT_BF16 (every FP8 / FP4 linear off the indexer path):
 *    activations act_quant'ed per 1x32 (ds41_lin_act_quant_block, as
 *    ds41_act_quant) into e4m3 codes + ue8m0 bytes.  Chunk (block) partial
 *    b = fp32 sum of the code products a_i w_i in i order from 0
 *    (ds41_lin_q_block; each product of an e4m3 and an e4m3 / e2m1 value is
 *    exact in fp32, so the fma is a plain add); lane step acc = acc + b *
 *    fp32(sa * sw) (ds41_lin_q_step; the scale product is a power of two),
 *    then the tree, then bf16.  Roundings a product passes through (the
 *    first add onto a lane's 0 and any add of a lane that holds no block
 *    are exact; the scale products are powers of two, exact outside fp32
 *    underflow): at most min(K,32) - 1 in its block, ceil(nkb/32) - 1
 *    along the lane, ceil(log2 min(nkb,32)) in the tree; the reference's
 *    are 1 (fp32 block sum) + nkb - 1 (its chain).  So
 *      |y - ref| <= d u S (1 + 2^-10) + 1 bf16 ulp,
 *      d = min(K,32) - 1 + ceil(nkb/32) - 1 + ceil(log2 min(nkb,32)) + nkb,
 *    below the fast CPU path's 2 (K + 2) u S for every K >= 1 (test
 *    cuda_linear checks both, with nkb = ceil(K/32)).
 *  FP8 / FP4, DS41_OUT_BF16_EXACT (and any *_EXACT): the reference itself.
 *    Block partial in double (ds41_lin_q_block_f64: products are multiples
 *    of 2^-18 (2^-10 for FP4) below 2^18, so 32 of them sum exactly in any
 *    order), fp32(sum), t = fp32(b * fp32(sa * sw)), and the reference's
 *    chain acc = acc + t over kb = 0, 1, 2, ... (not the tree: the kernel
 *    walks the lanes' t values in block order with __shfl_sync).  Error 0:
 *    bit-equal to the reference.  The output is bf16 for every FP8 / FP4
 *    out kind, as in the reference.
 *  BF16, DS41_OUT_BF16 / DS41_OUT_F32 (the fp32 matmuls: gate, head, ...):
 *    chunk of 8: acc = fma(x_k, w_k, acc) in k order on the lane's one
 *    partial, then the tree.  With bf16 inputs (the contract) every
 *    product is exact in fp32, so a product passes through at most
 *    min(K, 8 ceil(K/256)) - 1 roundings on its lane and ceil(log2
 *    min(ceil(K/8),32)) in the tree; the reference rounds once:
 *      |y - ref| <= d u S (1 + 2^-10) (+ 1 bf16 ulp for DS41_OUT_BF16),
 *      d = min(K, 8 ceil(K/256)) + ceil(log2 min(ceil(K/8), 32)),
 *    below 2 (K + 2) u S for every K >= 1.
 *  BF16, DS41_OUT_BF16_EXACT / DS41_OUT_F32_EXACT: fp32(exact sum), the
 *    reference bit for bit.  Each lane sums its products (exact in double:
 *    24 x 8 significant bits) in double in the order above, together with
 *    the sum of their magnitudes; both go through the double tree; then
 *    refmath's fast path (ds41_lin_fast_round: the double sum with the
 *    a-priori bound (K + 2) 2^-52 sum|t|; if both ends of the interval round
 *    to the same non-zero fp32, that is the correctly rounded exact sum),
 *    else the exact fixed-point accumulator (ds41_lin_xacc, a port of
 *    refmath's ds41_xacc) over the K terms in k order (on the device, lane
 *    0 of the warp; the decision is warp-uniform).  Error 0.
 *
 * Non-finite values follow the reference's operations (a NaN code or scale
 * makes NaN; the exact paths give NaN / inf by IEEE addition rules). */
#ifndef DS41_CUDA_NUM_LINEAR_H
#define DS41_CUDA_NUM_LINEAR_H

#include "cuda/hd.h"
#include "cuda/num_codec.h"

#include <stddef.h>
#include <stdint.h>

#include <math.h>
#include <string.h>

#define DS41_LIN_LANES 32     /* a warp */
#define DS41_LIN_QBLOCK 32    /* FP8 / FP4 chunk: one ue8m0 scale block of K */
#define DS41_LIN_BF16_CHUNK 8 /* BF16 chunk: 16 bytes of weight */
#define DS41_LIN_KIND_FP8 1   /* = DS41_LINEAR_FP8 */
#define DS41_LIN_KIND_FP4 2   /* = DS41_LINEAR_FP4 */
#define DS41_LIN_KIND_BF16 3  /* = DS41_LINEAR_BF16 */

/* One linear of a call, as the kernels read it (device pointers): the
 * weight, the input rows, the output rows and the scratch of the
 * quantized activations (act: codes [M][nkb*32], row stride ds41_lin_kp,
 * then the ue8m0 bytes [M][nkb]). */
typedef struct ds41_lin_desc {
    const uint8_t *q;
    const uint8_t *scale;
    const uint16_t *bf16;
    const float *x;
    float *y;
    uint8_t *act;
    int64_t n, k, scale_cols, M;
    int32_t kind;
    int32_t exact; /* the out kind is *_EXACT */
    int32_t out_bf16;
    int32_t pad_;
} ds41_lin_desc;

/* Host halves of the double bit casts (the device uses its intrinsics). */
#ifndef __CUDA_ARCH__
static inline uint64_t ds41_lin_host_f64_bits(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
}
static inline double ds41_lin_host_f64_from_bits(uint64_t u) {
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}
#endif

/* ---- fp32 / double operations, one rounding each ------------------------------------------- */

#ifdef __CUDA_ARCH__
#define DS41_LIN_RN(device, host) (device)
#else
#define DS41_LIN_RN(device, host) (host)
#endif
DS41_HD float ds41_lin_add(float a, float b) {
    return DS41_LIN_RN(__fadd_rn(a, b), a + b);
}
DS41_HD float ds41_lin_mul(float a, float b) {
    return DS41_LIN_RN(__fmul_rn(a, b), a * b);
}
DS41_HD float ds41_lin_fma(float a, float b, float c) {
    return DS41_LIN_RN(__fmaf_rn(a, b, c), fmaf(a, b, c));
}
DS41_HD double ds41_lin_dadd(double a, double b) {
    return DS41_LIN_RN(__dadd_rn(a, b), a + b);
}
DS41_HD double ds41_lin_dmul(double a, double b) {
    return DS41_LIN_RN(__dmul_rn(a, b), a * b);
}
DS41_HD float ds41_lin_div(float a, float b) {
    return DS41_LIN_RN(__fdiv_rn(a, b), a / b);
}

/* act_quant of one 1x32 block of len <= 32 bf16 values (ds41_act_quant):
 * amax = max(max|x|, 1e-4) with NaN winning, s = 2^k from fp32(amax / 448)
 * rounded up, codes e4m3(x / s).  Returns the scale byte. */
DS41_HD uint8_t ds41_lin_act_quant_block(const float *x, int len, uint8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < len; i++) {
        const uint32_t a = ds41_hd_f32_bits(x[i]) & 0x7FFFFFFFu;
        if (a > 0x7F800000u) {
            amax = ds41_hd_f32_from_bits(a);
            break;
        }
        if (a > ds41_hd_f32_bits(amax)) amax = ds41_hd_f32_from_bits(a);
    }
    if (amax < 1e-4f) amax = 1e-4f; /* NaN compares false: kept */
    const uint8_t sb = ds41_hd_ue8m0_scale_byte(amax, 0x1.24924ap-9f);
    const float s = ds41_hd_ue8m0_to_f32(sb);
    for (int i = 0; i < len; i++) q[i] = ds41_hd_e4m3_from_f32(ds41_lin_div(x[i], s));
    return sb;
}

/* ---- FP8 / FP4 chunks ------------------------------------------------------------------------ */

/* Code value i of a weight block: FP8 byte i, or FP4 nibble i (element 2j
 * low, 2j+1 high) of the block's 16 bytes. */
DS41_HD float ds41_lin_wval(const uint8_t *wb, int fp4, int i) {
    if (fp4) return ds41_hd_e2m1_to_f32((uint8_t)((wb[i >> 1] >> ((i & 1) * 4)) & 15u));
    return ds41_hd_e4m3_to_f32(wb[i]);
}

/* Fast block partial: fp32 sum of the len code products in i order. */
DS41_HD float ds41_lin_q_block(const uint8_t *wb, int fp4, const uint8_t *ab, int len) {
    float s = 0.0f;
    for (int i = 0; i < len; i++) s = ds41_lin_fma(ds41_hd_e4m3_to_f32(ab[i]), ds41_lin_wval(wb, fp4, i), s);
    return s;
}

/* Exact block partial: the code products' sum in double (exact in any order). */
DS41_HD double ds41_lin_q_block_f64(const uint8_t *wb, int fp4, const uint8_t *ab, int len) {
    double s = 0.0;
    for (int i = 0; i < len; i++)
        s = ds41_lin_dadd(
            s, ds41_lin_dmul((double)ds41_hd_e4m3_to_f32(ab[i]), (double)ds41_lin_wval(wb, fp4, i)));
    return s;
}

/* The block's scaled contribution t = b * fp32(sa * sw). */
DS41_HD float ds41_lin_q_scaled(float b, uint8_t sa, uint8_t sw) {
    return ds41_lin_mul(b, ds41_lin_mul(ds41_hd_ue8m0_to_f32(sa), ds41_hd_ue8m0_to_f32(sw)));
}

/* One lane step (fast): acc + b * fp32(sa * sw). */
DS41_HD float ds41_lin_q_step(float acc, float b, uint8_t sa, uint8_t sw) {
    return ds41_lin_add(acc, ds41_lin_q_scaled(b, sa, sw));
}

/* ---- BF16 chunks ------------------------------------------------------------------------------- */

/* acc = fma(x_k, w_k, acc) for the len values of a chunk, in k order. */
DS41_HD float ds41_lin_bf16_chunk(float acc, const float *x, const uint16_t *w, int len) {
    for (int i = 0; i < len; i++) acc = ds41_lin_fma(x[i], ds41_hd_bf16_to_f32(w[i]), acc);
    return acc;
}

/* The exact variant: *s += x_k w_k, *a += |x_k w_k| in double, k order. */
DS41_HD void ds41_lin_bf16_chunk_f64(double *s, double *a, const float *x, const uint16_t *w, int len) {
    for (int i = 0; i < len; i++) {
        const double t = ds41_lin_dmul((double)x[i], (double)ds41_hd_bf16_to_f32(w[i]));
        *s = ds41_lin_dadd(*s, t);
        *a = ds41_lin_dadd(*a, t < 0.0 ? -t : t);
    }
}

/* ---- the combine tree --------------------------------------------------------------------------- */

/* The warp's xor butterfly on 32 lane values (in place; every lane ends with
 * the result): for o = 16, 8, 4, 2, 1, lane l takes v[l] + v[l ^ o]. */
DS41_HD float ds41_lin_tree_f32(float *v) {
    for (int o = DS41_LIN_LANES / 2; o > 0; o >>= 1) {
        float t[DS41_LIN_LANES];
        for (int l = 0; l < DS41_LIN_LANES; l++) t[l] = ds41_lin_add(v[l], v[l ^ o]);
        for (int l = 0; l < DS41_LIN_LANES; l++) v[l] = t[l];
    }
    return v[0];
}
DS41_HD double ds41_lin_tree_f64(double *v) {
    for (int o = DS41_LIN_LANES / 2; o > 0; o >>= 1) {
        double t[DS41_LIN_LANES];
        for (int l = 0; l < DS41_LIN_LANES; l++) t[l] = ds41_lin_dadd(v[l], v[l ^ o]);
        for (int l = 0; l < DS41_LIN_LANES; l++) v[l] = t[l];
    }
    return v[0];
}

/* ---- exact sums (a port of engine/backend/refmath.c's accumulator) ------------------------------ */

DS41_HD uint64_t ds41_lin_f64_bits(double d) {
    return (uint64_t)DS41_LIN_RN(__double_as_longlong(d), ds41_lin_host_f64_bits(d));
}
DS41_HD double ds41_lin_f64_from_bits(uint64_t u) {
    return DS41_LIN_RN(__longlong_as_double((long long)u), ds41_lin_host_f64_from_bits(u));
}
DS41_HD int ds41_lin_clz64(uint64_t x) {
    return DS41_LIN_RN(__clzll((long long)x), __builtin_clzll(x));
}
DS41_HD int ds41_lin_finite(double d) {
    return ((ds41_lin_f64_bits(d) >> 52) & 0x7FFu) != 0x7FFu;
}
/* The next double towards +inf (up) or -inf, for finite d. */
DS41_HD double ds41_lin_next(double d, int up) {
    uint64_t u = ds41_lin_f64_bits(d);
    if ((u << 1) == 0) return ds41_lin_f64_from_bits(up ? 1u : (UINT64_C(1) << 63) | 1u);
    if ((u >> 63) == (up ? 0u : 1u))
        u++;
    else
        u--;
    return ds41_lin_f64_from_bits(u);
}

/* refmath's fast path: s the double sum of n exact terms, a the double sum
 * of their magnitudes.  1 and *out = the correctly rounded exact sum when
 * the interval s +- (n+2) 2^-52 a, pushed one double outward, rounds to one
 * non-zero fp32; 0: use the exact accumulator. */
DS41_HD int ds41_lin_fast_round(double s, double a, int64_t n, float *out) {
    if (!ds41_lin_finite(s) || !ds41_lin_finite(a)) return 0;
    if (a == 0.0) {
        *out = 0.0f;
        return 1;
    }
    const double e = ds41_lin_dmul(ds41_lin_dmul((double)(n + 2), 0x1p-52), a);
    if (!ds41_lin_finite(e)) return 0;
    const float flo = (float)ds41_lin_next(ds41_lin_dadd(s, -e), 0);
    const float fhi = (float)ds41_lin_next(ds41_lin_dadd(s, e), 1);
    if (flo != fhi || flo == 0.0f) return 0;
    *out = flo;
    return 1;
}

/* The exact accumulator: bit i of the fixed-point integer weighs 2^(i-1074),
 * 32 value bits per int64 limb, carries propagated once at the end (fewer
 * than 2^30 terms per sum keep every limb below 2^62). */
#define DS41_LIN_XLIMBS 68
typedef struct ds41_lin_xacc {
    int64_t limb[DS41_LIN_XLIMBS];
    int nan, pinf, ninf;
} ds41_lin_xacc;

DS41_HD void ds41_lin_xacc_init(ds41_lin_xacc *a) {
    for (int i = 0; i < DS41_LIN_XLIMBS; i++) a->limb[i] = 0;
    a->nan = a->pinf = a->ninf = 0;
}

DS41_HD void ds41_lin_xacc_add(ds41_lin_xacc *a, double x) {
    const uint64_t bits = ds41_lin_f64_bits(x);
    const int neg = (int)(bits >> 63);
    int e = (int)((bits >> 52) & 0x7FFu);
    uint64_t m = bits & ((UINT64_C(1) << 52) - 1u);
    if (e == 0x7FF) {
        if (m)
            a->nan = 1;
        else if (neg)
            a->ninf = 1;
        else
            a->pinf = 1;
        return;
    }
    if (e == 0) {
        if (!m) return;
        e = 1;
    } else {
        m |= UINT64_C(1) << 52;
    }
    const int b = e - 1, i = b >> 5, s = b & 31;
    const int64_t p0 = (int64_t)((m << s) & 0xFFFFFFFFu);
    const int64_t p1 = (int64_t)((s ? (m >> (32 - s)) : (m >> 32)) & 0xFFFFFFFFu);
    const int64_t p2 = (int64_t)(s ? (m >> (64 - s)) : 0u);
    const int64_t sg = neg ? -1 : 1;
    a->limb[i] += sg * p0;
    a->limb[i + 1] += sg * p1;
    a->limb[i + 2] += sg * p2;
}

/* Carries: limbs [0, top) end in [0, 2^32), the top limb keeps the sign. */
DS41_HD void ds41_lin_xacc_norm(ds41_lin_xacc *a) {
    int64_t carry = 0;
    for (int i = 0; i < DS41_LIN_XLIMBS - 1; i++) {
        const int64_t v = a->limb[i] + carry;
        const int64_t low = (int64_t)((uint64_t)v & 0xFFFFFFFFu);
        carry = (v - low) / ((int64_t)1 << 32);
        a->limb[i] = low;
    }
    a->limb[DS41_LIN_XLIMBS - 1] += carry;
}

/* m * 2^e (+ sticky below) rounded to fp32 RNE on the fp32 grid, m != 0. */
DS41_HD float ds41_lin_round_f32(uint64_t m, int e, int sticky) {
    const int lz = ds41_lin_clz64(m);
    m <<= lz;
    e -= lz;
    if (sticky) m |= 1u;
    const int top = e + 63;
    const int lsb = top - 23 > -149 ? top - 23 : -149;
    const int shift = lsb - e;
    uint64_t keep;
    int up;
    if (shift < 64) {
        keep = m >> shift;
        const uint64_t rem = m & ((UINT64_C(1) << shift) - 1u), half = UINT64_C(1) << (shift - 1);
        up = rem > half || (rem == half && (keep & 1u));
    } else if (shift == 64) {
        keep = 0;
        up = m > (UINT64_C(1) << 63);
    } else {
        keep = 0;
        up = 0;
    }
    keep += (uint64_t)up;
    return ldexpf((float)keep, lsb);
}

/* The exact sum rounded once to fp32 (an exact zero is +0; NaN or both
 * infinities: NaN; one infinity: it). */
DS41_HD float ds41_lin_xacc_round(ds41_lin_xacc *a) {
    if (a->nan || (a->pinf && a->ninf)) return ds41_hd_f32_from_bits(0x7FC00000u);
    if (a->pinf) return ds41_hd_f32_from_bits(0x7F800000u);
    if (a->ninf) return ds41_hd_f32_from_bits(0xFF800000u);
    ds41_lin_xacc_norm(a);
    int t = DS41_LIN_XLIMBS - 1;
    while (t >= 0 && a->limb[t] == 0) t--;
    if (t < 0) return 0.0f;
    int sign = 1;
    if (a->limb[t] < 0) {
        sign = -1;
        for (int i = 0; i < DS41_LIN_XLIMBS; i++) a->limb[i] = -a->limb[i];
        ds41_lin_xacc_norm(a);
        t = DS41_LIN_XLIMBS - 1;
        while (t >= 0 && a->limb[t] == 0) t--;
    }
    const uint64_t l0 = (uint64_t)a->limb[t];
    const uint64_t l1 = t >= 1 ? (uint64_t)a->limb[t - 1] : 0u;
    const uint64_t l2 = t >= 2 ? (uint64_t)a->limb[t - 2] : 0u;
    const int hb = 63 - ds41_lin_clz64(l0);
    const uint64_t m = (l0 << (63 - hb)) | (l1 << (31 - hb)) | (l2 >> (hb + 1));
    int st = (l2 & ((UINT64_C(1) << (hb + 1)) - 1u)) != 0u;
    for (int i = 0; !st && i <= t - 3; i++) st = a->limb[i] != 0;
    const int e = 32 * t + hb - 63 - 1074;
    const float r = ds41_lin_round_f32(m, e, st);
    return sign < 0 ? -r : r;
}

/* fp32(exact sum of x_k w_k), k < K, by the exact accumulator (k order). */
DS41_HD float ds41_lin_xdot_bf16(const float *x, const uint16_t *w, int64_t K) {
    ds41_lin_xacc a;
    ds41_lin_xacc_init(&a);
    for (int64_t k = 0; k < K; k++) ds41_lin_xacc_add(&a, (double)x[k] * (double)ds41_hd_bf16_to_f32(w[k]));
    return ds41_lin_xacc_round(&a);
}

/* ---- shapes and outputs ---------------------------------------------------------------------- */

DS41_HD int64_t ds41_lin_nkb(int64_t K) {
    return (K + DS41_LIN_QBLOCK - 1) / DS41_LIN_QBLOCK;
}
/* Row stride of the quantized activation codes (whole blocks). */
DS41_HD int64_t ds41_lin_kp(int64_t K) {
    return ds41_lin_nkb(K) * DS41_LIN_QBLOCK;
}
DS41_HD int64_t ds41_lin_row_bytes(int32_t kind, int64_t K) {
    return kind == DS41_LIN_KIND_FP4 ? (K + 1) / 2 : K;
}
/* Weight bytes of block kb of row n, and its scale byte. */
DS41_HD const uint8_t *ds41_lin_wblock(const ds41_lin_desc *d, int64_t n, int64_t kb) {
    const int fp4 = d->kind == DS41_LIN_KIND_FP4;
    return d->q + n * ds41_lin_row_bytes(d->kind, d->k) + kb * (fp4 ? DS41_LIN_QBLOCK / 2 : DS41_LIN_QBLOCK);
}
DS41_HD uint8_t ds41_lin_wscale(const ds41_lin_desc *d, int64_t n, int64_t kb) {
    return d->scale[(d->kind == DS41_LIN_KIND_FP4 ? n : n / 32) * d->scale_cols + kb];
}
DS41_HD int ds41_lin_len(int64_t K, int64_t k0, int width) {
    return K - k0 < width ? (int)(K - k0) : width;
}
DS41_HD float ds41_lin_out(float v, int out_bf16) {
    return out_bf16 ? ds41_hd_bf16_round(v) : v;
}

/* One work item of the act_quant kernel: block kb of row m of d. */
DS41_HD void ds41_lin_act_item(const ds41_lin_desc *d, int64_t m, int64_t kb) {
    const int64_t K = d->k, nkb = ds41_lin_nkb(K), kp = ds41_lin_kp(K);
    const int64_t k0 = kb * DS41_LIN_QBLOCK;
    const int len = ds41_lin_len(K, k0, DS41_LIN_QBLOCK);
    uint8_t *codes = d->act + m * kp + k0;
    d->act[d->M * kp + m * nkb + kb] = ds41_lin_act_quant_block(d->x + m * K + k0, len, codes);
    for (int i = len; i < DS41_LIN_QBLOCK; i++) codes[i] = 0; /* padding, never read */
}

#endif
