/* The attention family's arithmetic, written once for the kernels
 * (cuda/k_attn.cu) and their host emulation (cuda/emu_attn.c): the ops
 * act_quant_fp8, index_query, kv_pack, compress_pool, index_scores,
 * index_blocks, index_topk, sparse_attn and attend (engine/backend/ops.h).
 *
 * Every fp32 operation is one call of the helpers below (ds41_na_fmul ...),
 * which are the C operators on the host (the build has -ffp-contract=off)
 * and the _rn intrinsics on the device, so nvcc never fuses a multiply-add
 * that the reference rounds twice.  Products of two fp32 values are exact in
 * double, so every "double sum" below is a sum of exact terms, rounded once
 * to fp32 at the end; its error against the reference's exact sum is at most
 * (n - 1) 2^-53 sum |terms| before that rounding (recursive summation), i.e.
 * the fp32 result is the reference's except within that distance of an fp32
 * rounding boundary (cpu_backend.h, "Numerics"; the same class of difference
 * the fast CPU path has).
 *
 * Per op, the decomposition and order (the kernels' thread mapping, which
 * the emulation repeats loop for loop) and the error against the reference:
 *  - act_quant_fp8, index_query, kv_pack: one thread per quantization block
 *    (32 values; 16 for the latent's e4m3 scales), the reference's codecs
 *    element by element (engine/model/quant.c): bit for bit, error 0.
 *  - compress_pool: one thread per (group, channel): max, exp in double, the
 *    short fp32 sum and the weighted fp32 sum in slot order exactly as
 *    ds41_rm_compress_pool: bit for bit (up to the device's double exp, hd.h).
 *  - index_scores: one warp per (row, entry); per head the dot q_h . K_t as
 *    32 lane partial double sums (lane l takes elements l, l+32, ...
 *    ascending) combined by the xor butterfly 16, 8, 4, 2, 1
 *    (ds41_na_xor_tree); then the reference's fp32 / bf16 steps; the head
 *    sum a double sum in head order.  Error: the two double sums' bound
 *    above (dim and n_heads terms), so scores equal the reference's except
 *    within (dim + 1) 2^-53 of the magnitude sum of a rounding boundary:
 *    "error 0 given the same inputs" in the sense of cpu_backend.h.
 *  - index_blocks, index_topk: decisions with no floating-point reduction
 *    but the block max (sequential, NaN winning, as the reference).  The
 *    ranking is torch.topk's total order (descending, NaN first, equal
 *    scores by lower index, -0 == +0) encoded as one 64-bit key per element
 *    (ds41_na_rank_key64: larger key = ranked first, all keys distinct); the
 *    top n are the elements whose key is >= the n-th largest key, found by
 *    an 8-pass most-significant-digit radix select over 8-bit digits with
 *    integer histograms (exact counts), then written ascending by a
 *    compaction in index order.  So the selection is exactly the
 *    reference's for the same scores (error 0).
 *  - sparse_attn / attend: one block per (query row, group of heads); per
 *    chunk of 64 rows (ATTN_CHUNK of the reference, §10.7) and per head:
 *    z_j = fp32(q_h . kv_j) * scale with the dot as 32 lane partials + xor
 *    butterfly as above; the running max, corr = fp32(exp(mx - m_new)),
 *    p_j = fp32(exp(z_j - m_new)), pb_j = bf16(p_j), psum = double sum of
 *    p_j in row order, den = fp32(den * corr) + fp32(psum), and per channel
 *    d acc = fp32(acc * corr) + fp32(double sum over j in row order of pb_j
 *    kv_j[d]); out = bf16(acc / (den + fp32(exp(sink - mx)))).  The
 *    reference's sequence of fp32 operations; the only differences are the
 *    three double sums (hd, 64 and 64 terms), bounded as above, and the
 *    bf16 output then equals the reference's except where one of them sits
 *    within that distance of a rounding boundary.  The fast CPU path has the
 *    same order except for its dot products' lane split. */
#ifndef DS41_CUDA_NUM_ATTN_H
#define DS41_CUDA_NUM_ATTN_H

#include "cuda/hd.h"
#include "cuda/num_codec.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define DS41_NA_CHUNK 64 /* rows per online-softmax step (the reference's ATTN_CHUNK) */
#define DS41_NA_WARP 32

/* ---- rounding-explicit arithmetic ------------------------------------------ */

/* fp32 a OP b rounded once: the C operator on the host, the _rn intrinsic
 * (never contracted) on the device. */
#ifdef __CUDA_ARCH__
#define DS41_NA_FOP(name, op, intrinsic)                                                                     \
    DS41_HD float name(float a, float b) {                                                                   \
        return intrinsic(a, b);                                                                              \
    }
#else
#define DS41_NA_FOP(name, op, intrinsic)                                                                     \
    DS41_HD float name(float a, float b) {                                                                   \
        return a op b;                                                                                       \
    }
#endif
DS41_NA_FOP(ds41_na_fmul, *, __fmul_rn)
DS41_NA_FOP(ds41_na_fadd, +, __fadd_rn)
DS41_NA_FOP(ds41_na_fsub, -, __fsub_rn)
DS41_NA_FOP(ds41_na_fdiv, /, __fdiv_rn)
#undef DS41_NA_FOP

/* s + a * b in double with a * b exact (fp32 operands): a fused multiply-add
 * rounds the same value once, so contraction cannot change it. */
DS41_HD double ds41_na_dacc(double s, float a, float b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(s, __dmul_rn((double)a, (double)b));
#else
    return s + (double)a * (double)b;
#endif
}
DS41_HD double ds41_na_dadd(double a, double b) {
#ifdef __CUDA_ARCH__
    return __dadd_rn(a, b);
#else
    return a + b;
#endif
}
/* fp32(exp(double(x))): ds41_rm_exp (libdevice's exp on the device, hd.h). */
DS41_HD float ds41_na_exp(float x) {
    return (float)exp((double)x);
}

DS41_HD int ds41_na_isnan(float x) {
    return (ds41_hd_f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u;
}

/* ---- codecs: cuda/num_codec.h ---- */

/* One step of a block's amax: |x| replaces it when larger or NaN, and a NaN
 * stays (quant.c abs_max). */
DS41_HD float ds41_na_amax_step(float amax, float x) {
    if (ds41_na_isnan(amax)) return amax;
    const float a = ds41_hd_f32_from_bits(ds41_hd_f32_bits(x) & 0x7FFFFFFFu);
    return (a > amax || ds41_na_isnan(a)) ? a : amax;
}
/* max(amax, floor) letting NaN through (torch clamp_min). */
DS41_HD float ds41_na_floor(float amax, float fl) {
    return amax < fl ? fl : amax;
}

/* e2m1(clamp(fp32(x / s), -6, 6)). */
DS41_HD uint8_t ds41_na_fp4_code(float x, float s) {
    float v = ds41_na_fdiv(x, s);
    if (v > 6.0f)
        v = 6.0f;
    else if (v < -6.0f)
        v = -6.0f;
    return ds41_hd_e2m1_from_f32(v);
}

/* ---- the step quantizers: one block of a row each ------------------------------- */

#define DS41_NA_FP8_FLOOR 1e-4f
#define DS41_NA_FP8_RECIP 0x1.24924ap-9f
#define DS41_NA_FP4_FLOOR 0x1.8p-124f
#define DS41_NA_FP4_RECIP 0x1.555556p-3f
#define DS41_NA_FP4_E4M3_FLOOR 0x1.8p-7f

/* act_quant block b of a row of n values (ds41_act_quant): codes into
 * q[b*32 ..], the scale byte into scale[b]. */
DS41_HD void ds41_na_act_quant_block(const float *x, size_t n, size_t b, uint8_t *q, uint8_t *scale) {
    const size_t b0 = b * 32, len = n - b0 < 32 ? n - b0 : 32;
    float amax = 0.0f;
    for (size_t i = 0; i < len; i++) amax = ds41_na_amax_step(amax, x[b0 + i]);
    const uint8_t sb = ds41_hd_ue8m0_scale_byte(ds41_na_floor(amax, DS41_NA_FP8_FLOOR), DS41_NA_FP8_RECIP);
    const float s = ds41_hd_ue8m0_to_f32(sb);
    scale[b] = sb;
    for (size_t i = 0; i < len; i++) q[b0 + i] = ds41_hd_e4m3_from_f32(ds41_na_fdiv(x[b0 + i], s));
}

/* FP4 1x32 ue8m0 QDQ of block b of x[n], in place (ds41_fp4_act_quant_ue8m0_qdq). */
DS41_HD void ds41_na_fp4_qdq_block(float *x, size_t n, size_t b) {
    const size_t b0 = b * 32, len = n - b0 < 32 ? n - b0 : 32;
    float amax = 0.0f;
    for (size_t i = 0; i < len; i++) amax = ds41_na_amax_step(amax, x[b0 + i]);
    const float s =
        ds41_hd_ue8m0_to_f32(ds41_hd_ue8m0_scale_byte(ds41_na_floor(amax, DS41_NA_FP4_FLOOR), DS41_NA_FP4_RECIP));
    for (size_t i = 0; i < len; i++)
        x[b0 + i] = ds41_hd_bf16_round(ds41_na_fmul(ds41_hd_e2m1_to_f32(ds41_na_fp4_code(x[b0 + i], s)), s));
}

/* FP4 codes of block b (bsz values) of x[n] with the scale s into packed
 * nibbles (element 2i low, 2i+1 high; bsz even, so a block owns its bytes). */
DS41_HD void ds41_na_fp4_pack(const float *x, size_t n, size_t b0, size_t len, float s, uint8_t *packed) {
    for (size_t i = 0; i < len; i += 2) {
        const uint8_t lo = ds41_na_fp4_code(x[b0 + i], s);
        const uint8_t hi = b0 + i + 1 < n ? ds41_na_fp4_code(x[b0 + i + 1], s) : 0;
        packed[(b0 + i) / 2] = (uint8_t)((lo & 15u) | ((hi & 15u) << 4));
    }
}

/* Latent block b (16 values, e4m3 scale) of ds41_fp4_act_quant_e4m3. */
DS41_HD void ds41_na_latent_block(const float *x, size_t n, size_t b, uint8_t *packed, uint8_t *scale) {
    const size_t b0 = b * 16, len = n - b0 < 16 ? n - b0 : 16;
    float amax = 0.0f;
    for (size_t i = 0; i < len; i++) amax = ds41_na_amax_step(amax, x[b0 + i]);
    const uint8_t sb = ds41_hd_e4m3_from_f32(ds41_na_fdiv(ds41_na_floor(amax, DS41_NA_FP4_E4M3_FLOOR), 6.0f));
    scale[b] = sb;
    ds41_na_fp4_pack(x, n, b0, len, ds41_hd_e4m3_to_f32(sb), packed);
}

/* Index key block b (32 values, ue8m0 scale) of ds41_fp4_act_quant_ue8m0. */
DS41_HD void ds41_na_key_block(const float *x, size_t n, size_t b, uint8_t *packed, uint8_t *scale) {
    const size_t b0 = b * 32, len = n - b0 < 32 ? n - b0 : 32;
    float amax = 0.0f;
    for (size_t i = 0; i < len; i++) amax = ds41_na_amax_step(amax, x[b0 + i]);
    const uint8_t sb = ds41_hd_ue8m0_scale_byte(ds41_na_floor(amax, DS41_NA_FP4_FLOOR), DS41_NA_FP4_RECIP);
    scale[b] = sb;
    ds41_na_fp4_pack(x, n, b0, len, ds41_hd_ue8m0_to_f32(sb), packed);
}

/* ---- compressor pooling: one (group, channel) ----------------------------------- */

/* ds41_rm_compress_pool for channel ch of one group (ckv, csc [ratio][hd]). */
DS41_HD float ds41_na_pool_channel(const float *ckv, const float *csc, int ratio, size_t hd, size_t ch) {
    float mx = csc[ch];
    for (int t = 1; t < ratio; t++) mx = csc[(size_t)t * hd + ch] > mx ? csc[(size_t)t * hd + ch] : mx;
    float sum = 0.0f;
    for (int t = 0; t < ratio; t++) {
        const float ex = ds41_na_exp(ds41_na_fsub(csc[(size_t)t * hd + ch], mx));
        sum = t ? ds41_na_fadd(sum, ex) : ex;
    }
    float acc = 0.0f;
    for (int t = 0; t < ratio; t++) {
        const float ex = ds41_na_exp(ds41_na_fsub(csc[(size_t)t * hd + ch], mx));
        const float term = ds41_na_fmul(ckv[(size_t)t * hd + ch], ds41_na_fdiv(ex, sum));
        acc = t ? ds41_na_fadd(acc, term) : term;
    }
    return ds41_hd_bf16_round(acc);
}

/* ---- packed rows: value i ------------------------------------------------------- */

/* A window-ring row (dim e4m3 codes, then ue8m0 per 32). */
DS41_HD float ds41_na_ring_value(const uint8_t *row, size_t dim, size_t i) {
    return ds41_na_fmul(ds41_hd_e4m3_to_f32(row[i]), ds41_hd_ue8m0_to_f32(row[dim + i / 32]));
}
/* A compressed entry's latent (dim/2 bytes of e2m1, then e4m3 per 16). */
DS41_HD float ds41_na_latent_value(const uint8_t *e, size_t dim, size_t i) {
    return ds41_na_fmul(ds41_hd_e2m1_to_f32((uint8_t)(e[i / 2] >> ((i & 1) * 4))),
                        ds41_hd_e4m3_to_f32(e[dim / 2 + i / 16]));
}
/* An index key (dim/2 bytes of e2m1, then ue8m0 per 32); k points at the
 * key part of the entry (entry + latent_bytes). */
DS41_HD float ds41_na_key_value(const uint8_t *k, size_t dim, size_t i) {
    return ds41_na_fmul(ds41_hd_e2m1_to_f32((uint8_t)(k[i / 2] >> ((i & 1) * 4))),
                        ds41_hd_ue8m0_to_f32(k[dim / 2 + i / 32]));
}
DS41_HD float ds41_na_row_value(const uint8_t *row, int is_window, size_t dim, size_t i) {
    return is_window ? ds41_na_ring_value(row, dim, i) : ds41_na_latent_value(row, dim, i);
}

/* ---- warp dot products ---------------------------------------------------------- */

/* Lane l's partial of a dot product of n terms: elements l, l+32, ...
 * ascending, in double from 0. */
DS41_HD double ds41_na_lane_dot_f32(const float *a, const float *b, size_t n, unsigned lane) {
    double s = 0.0;
    for (size_t i = lane; i < n; i += DS41_NA_WARP) s = ds41_na_dacc(s, a[i], b[i]);
    return s;
}

/* The kernels' __shfl_xor_sync butterfly (offsets 16, 8, 4, 2, 1) over 32
 * lane values, as the host runs it: lane l adds lane l^o's value; a + b ==
 * b + a, so every lane ends with the same bits, returned. */
DS41_HD double ds41_na_xor_tree(double *v) {
    for (unsigned o = DS41_NA_WARP / 2; o; o >>= 1) {
        double t[DS41_NA_WARP];
        for (unsigned l = 0; l < DS41_NA_WARP; l++) t[l] = ds41_na_dadd(v[l], v[l ^ o]);
        for (unsigned l = 0; l < DS41_NA_WARP; l++) v[l] = t[l];
    }
    return v[0];
}

/* ---- index scores ---------------------------------------------------------------- */

/* bf16(relu(bf16(fp32(dot))) * w) of one head (relu keeps NaN). */
DS41_HD float ds41_na_index_term(double dot, float w) {
    const float s = ds41_hd_bf16_round((float)dot);
    const float r = ds41_na_isnan(s) ? s : (s > 0.0f ? s : 0.0f);
    return ds41_hd_bf16_round(ds41_na_fmul(r, w));
}

/* ---- decisions -------------------------------------------------------------------- */

/* torch.topk's order as an unsigned key, larger first: NaN above
 * everything (all NaN equal), then descending values, -0 == +0. */
DS41_HD uint32_t ds41_na_rank_key(float s) {
    uint32_t u = ds41_hd_f32_bits(s);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFFFFFu;
    if ((u & 0x7FFFFFFFu) == 0) u = 0; /* -0 ranks as +0 */
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
/* With the index: equal scores rank the lower index first; distinct keys. */
DS41_HD uint64_t ds41_na_rank_key64(float s, uint32_t i) {
    return ((uint64_t)ds41_na_rank_key(s) << 32) | (uint64_t)(0xFFFFFFFFu - i);
}

/* One step of the radix select: among the elements whose key agrees with
 * prefix above digit d (d = 7 .. 0, 8 bits each), hist[256] counts digit
 * values; the r-th largest (1-based) lies in the bin this returns, and r
 * becomes its rank inside that bin. */
DS41_HD unsigned ds41_na_select_bin(const uint32_t *hist, uint32_t *r) {
    uint32_t cum = 0;
    for (unsigned b = 256; b-- > 0;) {
        if (cum + hist[b] >= *r) {
            *r -= cum;
            return b;
        }
        cum += hist[b];
    }
    return 0; /* not reached: r <= the elements counted */
}
/* Does key agree with prefix on the digits above d? */
DS41_HD int ds41_na_select_match(uint64_t key, uint64_t prefix, unsigned d) {
    return d == 7 || (key >> (8 * (d + 1))) == prefix;
}

/* Candidate block max step (NaN wins; the last NaN is kept, as the reference). */
DS41_HD float ds41_na_block_max_step(float mx, float s) {
    return (s > mx || ds41_na_isnan(s)) ? s : mx;
}

/* ---- attention rows ---------------------------------------------------------------- */

/* Where the rows a query attends are (device pointers only): either a step
 * (ds41_attn_step, its metadata arrays shipped to the device) or one query's
 * explicit lists (ds41_attn_rows). */
typedef struct ds41_na_attn_src {
    int lists; /* 1: window/comp pointer lists below (one query) */
    const uint8_t *const *window;
    size_t n_window;
    const uint8_t *const *comp;
    size_t n_comp;
    /* a step */
    uint32_t window_size, block;
    const uint8_t *chunk;
    const uint8_t *const *rings;
    const size_t *row_item;
    const uint64_t *row_pos;
    const size_t *item_row0;
    const uint64_t *item_pos0;
    const int32_t *sel;
    const uint32_t *count;
    size_t sel_stride;
    const uint8_t *const *pages;
    const size_t *row_table;
    uint32_t per;
    size_t ring_row_bytes, entry_bytes;
} ds41_na_attn_src;

/* Row m's window rows (*nw, ring_row_bytes format) and compressed rows (*nc). */
DS41_HD void ds41_na_attn_counts(const ds41_na_attn_src *s, size_t m, size_t *nw, size_t *nc) {
    if (s->lists) {
        *nw = s->n_window;
        *nc = s->n_comp;
        return;
    }
    const size_t it = s->row_item[m];
    const uint64_t W = s->window_size;
    if (s->block) {
        const uint64_t p0 = s->item_pos0[it];
        *nw = (size_t)(p0 - (p0 > W ? p0 - W : 0)) + s->block;
        *nc = 0;
        return;
    }
    const uint64_t a = s->row_pos[m], first = a + 1 > W ? a + 1 - W : 0;
    *nw = (size_t)(a - first + 1);
    *nc = s->sel ? s->count[m] : 0;
}

/* Row idx (< nw + nc, the canonical order of §10.7) of query m. */
DS41_HD const uint8_t *ds41_na_attn_row(const ds41_na_attn_src *s, size_t m, size_t idx, size_t nw) {
    if (s->lists) return idx < nw ? s->window[idx] : s->comp[idx - nw];
    const size_t it = s->row_item[m], rb = s->ring_row_bytes;
    const uint64_t W = s->window_size, p0 = s->item_pos0[it];
    if (idx >= nw) {
        const size_t t = (size_t)s->sel[m * s->sel_stride + (idx - nw)];
        return s->pages[s->row_table[m] + t / s->per] + (size_t)(t % s->per) * s->entry_bytes;
    }
    if (s->block) {
        const uint64_t start = p0 > W ? p0 - W : 0, nring = p0 - start;
        if (idx < nring) return s->rings[it] + (size_t)((start + idx) % W) * rb;
        return s->chunk + (s->item_row0[it] + (idx - (size_t)nring)) * rb;
    }
    const uint64_t a = s->row_pos[m], first = a + 1 > W ? a + 1 - W : 0, pos = first + idx;
    return pos >= p0 ? s->chunk + (s->item_row0[it] + (size_t)(pos - p0)) * rb
                     : s->rings[it] + (size_t)(pos % W) * rb;
}

/* The online softmax's per-chunk head state update (the scalar steps):
 * m_new from the chunk's z (sequential max, NaN never wins), corr. */
DS41_HD float ds41_na_chunk_max(float mx, const float *z, size_t nc) {
    float m_new = mx;
    for (size_t j = 0; j < nc; j++)
        if (z[j] > m_new) m_new = z[j];
    return m_new;
}
/* p = fp32(exp(z - m_new)) (the denominator's term) and *pb its bf16
 * rounding (the PV product's weight, §10.7). */
DS41_HD float ds41_na_prob(float z, float m_new, float *pb) {
    const float p = ds41_na_exp(ds41_na_fsub(z, m_new));
    *pb = ds41_hd_bf16_round(p);
    return p;
}
/* den = fp32(den * corr) + fp32(double sum of p in row order). */
DS41_HD float ds41_na_den_update(float den, float corr, const float *p, size_t nc) {
    double ps = 0.0;
    for (size_t j = 0; j < nc; j++) ps = ds41_na_dadd(ps, (double)p[j]);
    return ds41_na_fadd(ds41_na_fmul(den, corr), (float)ps);
}
/* acc = fp32(acc * corr) + fp32(pv), pv the double sum over the chunk. */
DS41_HD float ds41_na_acc_update(float acc, float corr, double pv) {
    return ds41_na_fadd(ds41_na_fmul(acc, corr), (float)pv);
}
/* out = bf16(acc / (den + fp32(exp(sink - mx)))). */
DS41_HD float ds41_na_attn_out(float acc, float den, float sink, float mx) {
    const float d = ds41_na_fadd(den, ds41_na_exp(ds41_na_fsub(sink, mx)));
    return ds41_hd_bf16_round(ds41_na_fdiv(acc, d));
}

#endif
