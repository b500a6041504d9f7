/* The arithmetic of the CUDA backend's misc family (cuda/op_misc.h): rmsnorm,
 * hc_mix, hc_pre, hc_post, rope_table, rope, swiglu, moe_combine, router,
 * engram_mix, embed, gather_rows, fp8_rows.  Written once (DS41_HD,
 * cuda/hd.h) for the kernels of cuda/k_misc.cu and their host emulation
 * cuda/emu_misc.c, so every rounding point and reduction order below is
 * what the kernels do.
 *
 * Rounding points.  Every fp32 product is DS41_FMUL (__fmul_rn on the
 * device: nvcc contracts a*b+c into an FMA across statements unless the
 * multiply is an intrinsic; the host build has -ffp-contract=off), every
 * double product DS41_DMUL.  Divisions and sqrt are IEEE on both sides
 * (nvcc's defaults -prec-div, -prec-sqrt).  exp / log1p / cos / sin are
 * evaluated in double and rounded once to fp32 as refmath.h says; on the
 * device they come from libdevice (hd.h: within one double ulp of glibc, so
 * the fp32 results agree except within a double ulp of an fp32 rounding
 * boundary; "bit-exact" below means bit for bit on the host emulation and
 * bit for bit on the device up to that).  NaN: an output is NaN exactly
 * where the reference's is, its sign and payload are not promised (the
 * device's arithmetic returns its canonical NaN, and a C compiler may
 * compute x - y as x + (-y)); the codecs and copies keep every bit.
 *
 * Block reductions (rmsnorm, hc_mix, engram_mix): the kernels run one block
 * of DS41_MISC_THREADS (256) threads per row (per row and copy for Engram).
 * Thread t sums the double terms of elements t, t + 256, t + 512, ... in
 * that order, starting from 0.0; then each warp's 32 partials combine by the
 * xor butterfly (offsets 16, 8, 4, 2, 1; lane i adds lane i ^ o), and the
 * 8 warp totals by the same butterfly over offsets 4, 2, 1
 * (ds41_misc_block_sum).  That order depends only on the reduction length,
 * never on M, the row's index or which block runs it: a row alone is the
 * same bits as the row in a batch.  The terms are exact (fp32 squares
 * rounded to fp32 first as the reference does, fp32 x fp32 products exact
 * in double, fp32 Engram terms), so a sum of n terms differs from the exact
 * sum by at most (n - 1) 2^-53 sum |term|: its fp32 rounding equals the
 * reference's exact sum rounded once except within that distance of an fp32
 * rounding boundary (then one fp32 ulp off), and bit for bit whenever the
 * double sum is exact (terms on a grid with fewer than 53 bits of range
 * between the grid and the total, which the tests use to pin the sequence;
 * a mean divides that sum by n in double before its fp32 rounding, which
 * equals the exact quotient rounded once except at a double rounding tie,
 * about 2^-29 of the cases).
 * The fast CPU backend has the same bound with its own order.
 *
 * Per op, what the kernel computes and its bound against the reference
 * (engine/backend/ops_ref.c):
 *  - rmsnorm: block sum of fp32(x^2) / n in double rounded to fp32 (ms), r =
 *    rsqrt(ms + eps) in double rounded once, y = bf16(w * fp32(x * r)).
 *    ms within the block-sum bound (normally bit-exact), so r within one
 *    fp32 ulp and y within one bf16 ulp; bit-exact when the sum is exact.
 *  - hc_mix: one block per row: the mean square as rmsnorm and the (2+hc)hc
 *    dot products fn_j . h, each a block sum of exact double products,
 *    rounded to fp32 and times r; then thread 0 runs ds41_hd_hc_sinkhorn,
 *    bit for bit the reference's ds41_rm_hc_sinkhorn (tested on many random
 *    inputs).  Mixes within the block-sum bound; bit-exact when the dots are
 *    (tests: fn on a coarse grid); the Sinkhorn's output moves with them.
 *  - hc_pre, hc_post: one thread per output element, the reference's short
 *    fp32 sums in copy order: bit-exact.
 *  - rope_table: one thread per (row, pair): angle fp32(fp32(pos) * f), cos
 *    and sin in double rounded once: bit-exact (ds41_rope_cos_sin).
 *  - rope: one thread per (row, head, pair), ds41_rope_apply's four products
 *    and two sums, bf16 write-back: bit-exact.
 *  - swiglu: one thread per element, clamps, silu in double, fp32 products,
 *    bf16: bit-exact (NaN passes through the clamps as in the reference).
 *  - moe_combine: one thread per (token, d): the fp32 sum from 0 in slot
 *    order, + shared, bf16 (ds41_rm_moe_combine_token): bit-exact.
 *  - router: one block per token: threads compute the scores
 *    sqrt(softplus(fp32(logit / temp))) and biased scores of experts t, t +
 *    256, ...; thread 0 then makes the decision with the reference's own
 *    scan (ds41_hd_router_pick: strict >, so ties go to the lower expert id;
 *    a NaN biased score is never chosen over a number, but a NaN that is the
 *    first untaken expert stays chosen, exactly as the reference's loop) and
 *    the weights' short sum in choice order: bit-exact, selection scores
 *    included.
 *  - engram_mix: one block per (token, copy): three block sums (the two
 *    means of squares and the sum of the terms fp32(fp32(h w) key)), the
 *    gate in the reference's sequence, then h = bf16(h + gate v) in place.
 *    Each sum within the block-sum bound, so the gate within a few fp32 ulps
 *    and h within one bf16 ulp; bit-exact when the sums are exact.
 *  - embed, gather_rows: copies: bit-exact.
 *  - fp8_rows: bf16(e4m3(q) * 2^(s - 127)) per element: bit-exact (the
 *    codecs below are tested exhaustively against engine/model/quant.c). */
#ifndef DS41_CUDA_NUM_MISC_H
#define DS41_CUDA_NUM_MISC_H

#include "cuda/hd.h"
#include "cuda/num_codec.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* Threads of a reducing block (and of every misc kernel's block). */
#define DS41_MISC_THREADS 256
#define DS41_MISC_WARPS (DS41_MISC_THREADS / 32)

/* Products that are never fused into an add. */
#ifdef __CUDA_ARCH__
#define DS41_FMUL(a, b) __fmul_rn((a), (b))
#define DS41_DMUL(a, b) __dmul_rn((a), (b))
#else
#define DS41_FMUL(a, b) ((a) * (b))
#define DS41_DMUL(a, b) ((a) * (b))
#endif

/* ---- elementwise functions (refmath.h: double evaluation, one rounding) ---------------------- */

DS41_HD float ds41_hd_exp(float x) {
    return (float)exp((double)x);
}
DS41_HD float ds41_hd_sqrt(float x) {
    return (float)sqrt((double)x);
}
DS41_HD float ds41_hd_rsqrt(float x) {
    return (float)(1.0 / sqrt((double)x));
}
DS41_HD float ds41_hd_sigmoid(float x) {
    return (float)(1.0 / (1.0 + exp(-(double)x)));
}
DS41_HD float ds41_hd_silu(float x) {
    return (float)((double)x / (1.0 + exp(-(double)x)));
}
DS41_HD float ds41_hd_softplus(float x) {
    if (x > 20.0f) return x;
    return (float)log1p(exp((double)x));
}

/* ---- block reduction ------------------------------------------------------------------------- */

/* The kernels' combination of a block's DS41_MISC_THREADS partials, in
 * place on v (the emulation's copy of it; the kernel does the same with
 * __shfl_xor_sync and one shared array of warp totals): returns the total. */
DS41_HD double ds41_misc_block_sum(double *v) {
    double t[32];
    for (int w = 0; w < DS41_MISC_WARPS; w++) {
        double *lane = v + 32 * w;
        for (int o = 16; o >= 1; o >>= 1) {
            for (int i = 0; i < 32; i++) t[i] = lane[i] + lane[i ^ o];
            for (int i = 0; i < 32; i++) lane[i] = t[i];
        }
    }
    /* Warp totals in lanes 0..7 of warp 0 (the rest 0.0, never reached by
     * the offsets 4, 2, 1). */
    double wt[DS41_MISC_WARPS];
    for (int w = 0; w < DS41_MISC_WARPS; w++) wt[w] = v[32 * w];
    for (int o = DS41_MISC_WARPS / 2; o >= 1; o >>= 1) {
        for (int i = 0; i < DS41_MISC_WARPS; i++) t[i] = wt[i] + wt[i ^ o];
        for (int i = 0; i < DS41_MISC_WARPS; i++) wt[i] = t[i];
    }
    return wt[0];
}

/* ---- rmsnorm ---------------------------------------------------------------------------------- */

/* A mean-square term: the square rounded to fp32 (§10.5), exact in double. */
DS41_HD double ds41_misc_sq_term(float x) {
    return (double)DS41_FMUL(x, x);
}

/* fp32 mean of squares from their double sum. */
DS41_HD float ds41_misc_mean(double sum, size_t n) {
    return (float)(sum / (double)n);
}

/* rsqrt(ms + eps) as the reference: the fp32 sum, then double 1/sqrt. */
DS41_HD float ds41_misc_rms_scale(float ms, float eps) {
    return ds41_hd_rsqrt(ms + eps);
}

DS41_HD float ds41_misc_rmsnorm_elem(uint16_t w, float x, float r) {
    const float t = DS41_FMUL(x, r);
    return ds41_hd_bf16_round(DS41_FMUL(ds41_hd_bf16_to_f32(w), t));
}

/* ---- hyper-connections ------------------------------------------------------------------------ */

/* A dot term of a mix function: exact in double. */
DS41_HD double ds41_misc_dot_term(float a, float b) {
    return DS41_DMUL((double)a, (double)b);
}

/* ds41_rm_hc_sinkhorn (engine/backend/refmath.c), the same fp32 sequence. */
DS41_HD void ds41_hd_hc_sinkhorn(const float *mix, const float *scale, const float *base, int hc, int iters,
                                 float eps, float *pre, float *post, float *c) {
    for (int i = 0; i < hc; i++) {
        const float t = DS41_FMUL(mix[i], scale[0]);
        pre[i] = ds41_hd_sigmoid(t + base[i]) + eps;
    }
    for (int i = 0; i < hc; i++) {
        const float t = DS41_FMUL(mix[hc + i], scale[1]);
        post[i] = DS41_FMUL(2.0f, ds41_hd_sigmoid(t + base[hc + i]));
    }
    for (int i = 0; i < hc * hc; i++) {
        const float t = DS41_FMUL(mix[2 * hc + i], scale[2]);
        c[i] = t + base[2 * hc + i];
    }
    for (int i = 0; i < hc; i++) {
        float *row = c + i * hc;
        float mx = row[0];
        for (int j = 1; j < hc; j++) mx = row[j] > mx ? row[j] : mx;
        float sum = 0.0f;
        for (int j = 0; j < hc; j++) {
            row[j] = ds41_hd_exp(row[j] - mx);
            sum = j ? sum + row[j] : row[j];
        }
        for (int j = 0; j < hc; j++) row[j] = row[j] / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int i = 0; i < hc; i++) {
                float s = c[i * hc];
                for (int j = 1; j < hc; j++) s = s + c[i * hc + j];
                const float d = s + eps;
                for (int j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / d;
            }
        }
        for (int j = 0; j < hc; j++) {
            float s = c[j];
            for (int i = 1; i < hc; i++) s = s + c[i * hc + j];
            const float d = s + eps;
            for (int i = 0; i < hc; i++) c[i * hc + j] = c[i * hc + j] / d;
        }
    }
}

/* hc_pre's element d of one token: h [hc][dim], p [hc]. */
DS41_HD float ds41_misc_hc_pre_elem(const float *h, const float *p, int hc, size_t dim, size_t d) {
    float acc = DS41_FMUL(p[0], h[d]);
    for (int c = 1; c < hc; c++) {
        const float t = DS41_FMUL(p[c], h[(size_t)c * dim + d]);
        acc = acc + t;
    }
    return ds41_hd_bf16_round(acc);
}

/* hc_post's element (j, d) of one token: cm [hc][hc], o [dim], pj = post[j]. */
DS41_HD float ds41_misc_hc_post_elem(const float *o, const float *h, float pj, const float *cm, int hc,
                                     size_t dim, int j, size_t d) {
    float s = DS41_FMUL(cm[j], h[d]);
    for (int i = 1; i < hc; i++) {
        const float t = DS41_FMUL(cm[i * hc + j], h[(size_t)i * dim + d]);
        s = s + t;
    }
    const float po = DS41_FMUL(pj, o[d]);
    return ds41_hd_bf16_round(po + s);
}

/* ---- rope ------------------------------------------------------------------------------------- */

/* ds41_rope_cos_sin's pair i: cs[0] = cos, cs[1] = sin of fp32(fp32(pos) f). */
DS41_HD void ds41_hd_rope_cos_sin(float f, uint64_t pos, float *cs) {
    const float ang = DS41_FMUL((float)pos, f);
    cs[0] = (float)cos((double)ang);
    cs[1] = (float)sin((double)ang);
}

/* ds41_rope_apply's pair (x[0], x[1]) with (c, s), in place. */
DS41_HD void ds41_hd_rope_pair(float *x, float c, float s, int inverse) {
    const float a = x[0], b = x[1];
    const float ac = DS41_FMUL(a, c), bs = DS41_FMUL(b, s), as = DS41_FMUL(a, s), bc = DS41_FMUL(b, c);
    float na, nb;
    if (!inverse) {
        na = ac - bs;
        nb = as + bc;
    } else {
        na = ac + bs;
        nb = bc - as;
    }
    x[0] = ds41_hd_bf16_round(na);
    x[1] = ds41_hd_bf16_round(nb);
}

/* ---- MoE ---------------------------------------------------------------------------------------- */

/* SwiGLU of one element (route: the row's weight or NULL). */
DS41_HD float ds41_misc_swiglu_elem(float gv, float uv, float limit, const float *route) {
    if (limit > 0.0f) {
        uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
        gv = gv > limit ? limit : gv;
    }
    float h = DS41_FMUL(ds41_hd_silu(gv), uv);
    if (route) h = DS41_FMUL(route[0], h);
    return ds41_hd_bf16_round(h);
}

/* ds41_rm_moe_combine_token's element d: the fp32 sum from 0 of the routed
 * rows in slot order, plus the shared expert's value, to bf16. */
DS41_HD float ds41_hd_moe_combine_elem(const float *oe, const uint32_t *slot, size_t n, float shared,
                                       size_t D, size_t d) {
    float y = 0.0f;
    for (size_t j = 0; j < n; j++) y = y + oe[(size_t)slot[j] * D + d];
    return ds41_hd_bf16_round(y + shared);
}

/* The router's score of one expert: sqrt(softplus(fp32(logit / temp))). */
DS41_HD float ds41_misc_router_score(float logit, float gate_temp) {
    return ds41_hd_sqrt(ds41_hd_softplus(logit / gate_temp));
}

/* The router's decision for one token, the reference's loop: k rounds, each
 * the first untaken expert replaced by every later untaken one whose biased
 * score is strictly greater (so ties keep the lower id); then the weights'
 * short sum in choice order.  taken [E] is scratch. */
DS41_HD void ds41_hd_router_pick(const float *score, const float *biased, unsigned char *taken, int E, int k,
                                 float route_scale, int32_t *sel, float *w) {
    for (int e = 0; e < E; e++) taken[e] = 0;
    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || biased[e] > biased[best])) best = e;
        taken[best] = 1;
        sel[i] = best;
        w[i] = score[best];
    }
    if (k > 1) {
        float sum = w[0];
        for (int i = 1; i < k; i++) sum = sum + w[i];
        const float d = sum + 1e-20f;
        for (int i = 0; i < k; i++) w[i] = w[i] / d;
    }
    for (int i = 0; i < k; i++) w[i] = DS41_FMUL(w[i], route_scale);
}

/* ---- Engram ------------------------------------------------------------------------------------ */

/* A term of the gate's dot product: fp32(fp32(h w) key), exact in double. */
DS41_HD double ds41_misc_engram_term(float h, float w, float key) {
    const float hw = DS41_FMUL(h, w);
    return (double)DS41_FMUL(hw, key);
}

/* The gate from the three sums' fp32 values (§6.4, the reference's order). */
DS41_HD float ds41_misc_engram_gate(float ms_h, float ms_k, float s, float eps, float dim_scale) {
    const float rstd = DS41_FMUL(ds41_hd_rsqrt(ms_h + eps), ds41_hd_rsqrt(ms_k + eps));
    const float sr = DS41_FMUL(s, rstd);
    const float dot = DS41_FMUL(sr, dim_scale);
    float a = fabsf(dot);
    if (a < 1e-6f) a = 1e-6f;
    return ds41_hd_sigmoid(copysignf(ds41_hd_sqrt(a), dot));
}

DS41_HD float ds41_misc_engram_update(float h, float gate, float v) {
    const float gv = DS41_FMUL(gate, v);
    return ds41_hd_bf16_round(h + gv);
}

/* ---- tables ------------------------------------------------------------------------------------- */

/* The rows a gather reads from its table: 1 + the largest index (0 for
 * none), so the op can name the weight bytes it reads (ds41_cuda_weight). */
DS41_HD size_t ds41_misc_rows_i32(const int32_t *ids, size_t n) {
    size_t r = 0;
    for (size_t i = 0; i < n; i++)
        if ((size_t)ids[i] + 1 > r) r = (size_t)ids[i] + 1;
    return r;
}
DS41_HD size_t ds41_misc_rows_i64(const int64_t *rows, size_t n) {
    size_t r = 0;
    for (size_t i = 0; i < n; i++)
        if ((size_t)rows[i] + 1 > r) r = (size_t)rows[i] + 1;
    return r;
}

/* An Engram table value: bf16(e4m3(q) * 2^(s - 127)). */
DS41_HD float ds41_misc_fp8_value(uint8_t q, uint8_t s) {
    return ds41_hd_bf16_round(DS41_FMUL(ds41_hd_e4m3_to_f32(q), ds41_hd_ue8m0_to_f32(s)));
}

#endif
