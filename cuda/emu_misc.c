/* Host emulation of the misc family's kernels (cuda/k_misc.cu): the same
 * decomposition (a block of DS41_MISC_THREADS threads per reduced row, its
 * per-thread partials and their butterfly, one thread per output element
 * elsewhere) over the same arithmetic (cuda/num_misc.h), run when the op is
 * called.  Metadata is read through its device copy (ds41_cuda_meta),
 * weights through their placed copy (ds41_cuda_weight), temporaries from
 * ds41_cuda_scratch, exactly as the kernels get them. */
#include "cuda/cuda_ctx.h"
#include "cuda/num_misc.h"
#include "cuda/op_misc.h"

#include <string.h>

/* The fake device runs the compute stream's earlier work before an
 * emulated op computes (cuda/emu_enter.h). */
#include "cuda/emu_enter.h"
#define EMU_ENTER(c) ds41_cuda_emu_enter(c)

/* Every data pointer an emulated op touches must be device memory on the
 * fake device (cuda/emu_enter.h); c is the op's context. */
#define EMU_DEV(p) ds41_cuda_emu_check(c, (p), 1, #p)

static ds41_cuda_ctx *enter(const ds41_ops *self) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    EMU_ENTER(c);
    c->stats.op_calls++;
    return c;
}

/* The block of one reduced row: thread t's partial over elements t, t + 256,
 * ... (term(i) for i < n), then the butterfly. */
#define BLOCK_SUM(out, n, term)                                                                              \
    do {                                                                                                     \
        double part_[DS41_MISC_THREADS];                                                                     \
        for (size_t t_ = 0; t_ < DS41_MISC_THREADS; t_++) {                                                  \
            double a_ = 0.0;                                                                                 \
            for (size_t i = t_; i < (n); i += DS41_MISC_THREADS) a_ += (term);                               \
            part_[t_] = a_;                                                                                  \
        }                                                                                                    \
        (out) = ds41_misc_block_sum(part_);                                                                  \
    } while (0)

void ds41_cuda_emu_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n,
                           float eps, float *y) {
    ds41_cuda_ctx *c = enter(self);
    const uint16_t *wd = ds41_cuda_weight(c, w, n * sizeof *w);
    EMU_DEV(x);
    EMU_DEV(y);
    EMU_DEV(wd);
    c->stats.weight_bytes += n * 2;
    for (size_t m = 0; m < M; m++) {
        const float *xr = x + m * n;
        double s;
        BLOCK_SUM(s, n, ds41_misc_sq_term(xr[i]));
        const float r = ds41_misc_rms_scale(ds41_misc_mean(s, n), eps);
        for (size_t i = 0; i < n; i++) y[m * n + i] = ds41_misc_rmsnorm_elem(wd[i], xr[i], r);
    }
}

void ds41_cuda_emu_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,
                          const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters,
                          float hc_eps, float *pre, float *post, float *comb) {
    ds41_cuda_ctx *c = enter(self);
    const size_t n = (size_t)hc * dim, n_mix = (size_t)(2 + hc) * (size_t)hc;
    const float *fnd = ds41_cuda_weight(c, fn, n_mix * n * sizeof *fn);
    const float *scd = ds41_cuda_weight(c, scale, 3 * sizeof *scale);
    const float *based = ds41_cuda_weight(c, base, n_mix * sizeof *base);
    EMU_DEV(h);
    EMU_DEV(pre);
    EMU_DEV(post);
    EMU_DEV(comb);
    EMU_DEV(fnd);
    EMU_DEV(based);
    c->stats.weight_bytes += ((uint64_t)n_mix * n + (uint64_t)n_mix + 3) * sizeof(float);
    c->stats.flops += 2 * (uint64_t)M * (uint64_t)(n_mix + 1) * n;
    /* The kernel's shared array of mixes, one row at a time. */
    float *mix = ds41_cuda_scratch(c, n_mix * sizeof *mix);
    for (size_t m = 0; m < M; m++) {
        const float *hr = h + m * n;
        double s;
        BLOCK_SUM(s, n, ds41_misc_sq_term(hr[i]));
        const float r = ds41_misc_rms_scale(ds41_misc_mean(s, n), norm_eps);
        for (size_t j = 0; j < n_mix; j++) {
            const float *f = fnd + j * n;
            BLOCK_SUM(s, n, ds41_misc_dot_term(f[i], hr[i]));
            mix[j] = DS41_FMUL((float)s, r);
        }
        ds41_hd_hc_sinkhorn(mix, scd, based, hc, iters, hc_eps, pre + m * (size_t)hc, post + m * (size_t)hc,
                            comb + m * (size_t)hc * (size_t)hc);
    }
}

void ds41_cuda_emu_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc,
                          size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(h);
    EMU_DEV(pre);
    EMU_DEV(out);
    for (size_t m = 0; m < M; m++)
        for (size_t d = 0; d < dim; d++)
            out[m * dim + d] =
                ds41_misc_hc_pre_elem(h + m * (size_t)hc * dim, pre + m * (size_t)hc, hc, dim, d);
}

void ds41_cuda_emu_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,
                           const float *comb, size_t M, int hc, size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(o);
    EMU_DEV(h);
    EMU_DEV(post);
    EMU_DEV(comb);
    EMU_DEV(out);
    const size_t H = (size_t)hc;
    for (size_t m = 0; m < M; m++)
        for (size_t j = 0; j < H; j++)
            for (size_t d = 0; d < dim; d++)
                out[(m * H + j) * dim + d] = ds41_misc_hc_post_elem(
                    o + m * dim, h + m * H * dim, post[m * H + j], comb + m * H * H, hc, dim, (int)j, d);
}

void ds41_cuda_emu_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos,
                              size_t M, float *cs) {
    ds41_cuda_ctx *c = enter(self);
    const float *f = ds41_cuda_weight(c, freqs, (size_t)n_pairs * sizeof *freqs);
    EMU_DEV(f);
    EMU_DEV(cs);
    const uint64_t *p = ds41_cuda_meta(c, pos, M * sizeof *pos);
    for (size_t m = 0; m < M; m++)
        for (size_t i = 0; i < (size_t)n_pairs; i++)
            ds41_hd_rope_cos_sin(f[i], p[m], cs + (m * n_pairs + i) * 2);
}

void ds41_cuda_emu_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                        size_t head_stride, int n_pairs, const float *cs, int inverse) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(x);
    EMU_DEV(cs);
    for (size_t m = 0; m < M; m++)
        for (size_t hh = 0; hh < (size_t)n_heads; hh++)
            for (size_t i = 0; i < (size_t)n_pairs; i++) {
                const float *t = cs + (m * (size_t)n_pairs + i) * 2;
                ds41_hd_rope_pair(x + m * row_stride + hh * head_stride + 2 * i, t[0], t[1], inverse);
            }
}

void ds41_cuda_emu_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n,
                          float limit, const float *route, float *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(g);
    EMU_DEV(u);
    EMU_DEV(route);
    EMU_DEV(out);
    for (size_t m = 0; m < M; m++)
        for (size_t i = 0; i < n; i++)
            out[m * n + i] =
                ds41_misc_swiglu_elem(g[m * n + i], u[m * n + i], limit, route ? route + m : NULL);
}

void ds41_cuda_emu_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                               const float *shared, size_t M, size_t D, float *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(oe);
    EMU_DEV(shared);
    EMU_DEV(out);
    const uint32_t *sl = ds41_cuda_meta(c, slot, M * k * sizeof *slot);
    for (size_t m = 0; m < M; m++)
        for (size_t d = 0; d < D; d++)
            out[m * D + d] = ds41_hd_moe_combine_elem(oe, sl + m * k, k, shared[m * D + d], D, d);
}

void ds41_cuda_emu_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E,
                          int k, float gate_temp, float route_scale, int32_t *sel, float *weight,
                          float *selection) {
    ds41_cuda_ctx *c = enter(self);
    const size_t ne = (size_t)E;
    const float *b = ds41_cuda_weight(c, bias, ne * sizeof *bias);
    EMU_DEV(logits);
    EMU_DEV(b);
    EMU_DEV(sel);
    EMU_DEV(weight);
    EMU_DEV(selection);
    c->stats.weight_bytes += ne * sizeof(float);
    /* The kernel's shared arrays of one token. */
    float *score = ds41_cuda_scratch(c, ne * (2 * sizeof(float) + 1));
    float *biased = score + ne;
    unsigned char *taken = (unsigned char *)(biased + ne);
    for (size_t m = 0; m < M; m++) {
        for (size_t e = 0; e < ne; e++) {
            score[e] = ds41_misc_router_score(logits[m * ne + e], gate_temp);
            biased[e] = score[e] + b[e];
            if (selection) selection[m * ne + e] = biased[e];
        }
        ds41_hd_router_pick(score, biased, taken, E, k, route_scale, sel + m * (size_t)k,
                            weight + m * (size_t)k);
    }
}

void ds41_cuda_emu_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M,
                              int hc, size_t dim, float eps, float dim_scale) {
    ds41_cuda_ctx *c = enter(self);
    const size_t H = (size_t)hc;
    const float *wd = ds41_cuda_weight(c, wqk, H * dim * sizeof *wqk);
    EMU_DEV(h);
    EMU_DEV(kv);
    EMU_DEV(wd);
    c->stats.weight_bytes += (uint64_t)H * dim * sizeof(float);
    for (size_t m = 0; m < M; m++)
        for (size_t cp = 0; cp < H; cp++) {
            float *hr = h + (m * H + cp) * dim;
            const float *kvr = kv + m * (H + 1) * dim, *key = kvr + cp * dim, *value = kvr + H * dim,
                        *wr = wd + cp * dim;
            double sh, sk, st;
            BLOCK_SUM(sh, dim, ds41_misc_sq_term(hr[i]));
            BLOCK_SUM(sk, dim, ds41_misc_sq_term(key[i]));
            BLOCK_SUM(st, dim, ds41_misc_engram_term(hr[i], wr[i], key[i]));
            const float gate = ds41_misc_engram_gate(ds41_misc_mean(sh, dim), ds41_misc_mean(sk, dim),
                                                     (float)st, eps, dim_scale);
            for (size_t d = 0; d < dim; d++) hr[d] = ds41_misc_engram_update(hr[d], gate, value[d]);
        }
}

void ds41_cuda_emu_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,
                         size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    const uint16_t *t = ds41_cuda_weight(c, table, ds41_misc_rows_i32(ids, M) * dim * sizeof *table);
    EMU_DEV(t);
    EMU_DEV(out);
    const int32_t *id = ds41_cuda_meta(c, ids, M * sizeof *ids);
    c->stats.weight_bytes += (uint64_t)M * dim * 2;
    for (size_t m = 0; m < M; m++)
        for (size_t cp = 0; cp < (size_t)hc; cp++)
            for (size_t d = 0; d < dim; d++)
                out[(m * (size_t)hc + cp) * dim + d] = ds41_hd_bf16_to_f32(t[(size_t)id[m] * dim + d]);
}

void ds41_cuda_emu_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,
                               const uint32_t *idx, size_t n, size_t row_bytes) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(dst);
    EMU_DEV(src);
    if (!n || !row_bytes) return;
    const uint32_t *ix = ds41_cuda_meta(c, idx, n * sizeof *idx);
    for (size_t i = 0; i < n; i++)
        for (size_t b = 0; b < row_bytes; b++)
            ((unsigned char *)dst)[i * row_bytes + b] =
                ((const unsigned char *)src)[(size_t)ix[i] * src_stride + b];
}

void ds41_cuda_emu_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows,
                            size_t n, size_t cols, float *out) {
    ds41_cuda_ctx *c = enter(self);
    const size_t sc = (cols + 31) / 32, nr = ds41_misc_rows_i64(rows, n);
    const uint8_t *qd = ds41_cuda_weight(c, q, nr * cols);
    const uint8_t *sd = ds41_cuda_weight(c, scale, nr * sc);
    EMU_DEV(qd);
    EMU_DEV(sd);
    EMU_DEV(out);
    const int64_t *rw = ds41_cuda_meta(c, rows, n * sizeof *rows);
    c->stats.weight_bytes += (uint64_t)n * (cols + sc);
    for (size_t i = 0; i < n; i++)
        for (size_t col = 0; col < cols; col++)
            out[i * cols + col] =
                ds41_misc_fp8_value(qd[(size_t)rw[i] * cols + col], sd[(size_t)rw[i] * sc + col / 32]);
}
