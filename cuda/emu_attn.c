/* Host emulation of the attention family's kernels (cuda/k_attn.cu): the
 * same decomposition loop for loop (a thread's work is one loop body, a
 * warp's 32 lane partials are combined by the kernel's xor butterfly), over
 * the arithmetic of cuda/num_attn.h, reading metadata only through its
 * ds41_cuda_meta device copies (cuda/attn_meta.c). */
#include "cuda/op_attn.h"

#include <math.h>
#include <string.h>

#include "cuda/emu_enter.h"
#define DS41_EMU_ENTER(c) ds41_cuda_emu_enter(c)

/* Every data pointer an emulated op touches must be device memory on the
 * fake device (cuda/emu_enter.h); c is the op's context. */
#define EMU_DEV(p) ds41_cuda_emu_check(c, (p), 1, #p)

static ds41_cuda_ctx *enter(const ds41_ops *self) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    DS41_EMU_ENTER(c);
    c->stats.op_calls++;
    return c;
}

/* ---- step quantizers: a thread per block ------------------------------------------------ */

void ds41_cuda_emu_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                                 size_t out_stride) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(x);
    EMU_DEV(out);
    const size_t nb = (n + 31) / 32;
    for (size_t t = 0; t < M * nb; t++) {
        const size_t m = t / nb;
        ds41_na_act_quant_block(x + m * n, n, t % nb, out + m * out_stride, out + m * out_stride + n);
    }
}

void ds41_cuda_emu_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                               float scale) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(q);
    EMU_DEV(w);
    const size_t nb = (qn + 31) / 32;
    for (size_t t = 0; t < M * nb; t++) ds41_na_fp4_qdq_block(q + (t / nb) * qn, qn, t % nb);
    for (size_t i = 0; i < M * wn; i++) w[i] = ds41_hd_bf16_round(ds41_na_fmul(w[i], scale));
}

void ds41_cuda_emu_kv_pack(const ds41_ops *self, const ds41_kv_layout *l, const float *latent,
                           const float *key, size_t n, uint8_t *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(latent);
    EMU_DEV(key);
    EMU_DEV(out);
    const size_t ld = l->latent_dim, kd = l->index_dim, nl = (ld + 15) / 16, nk = (kd + 31) / 32;
    for (size_t t = 0; t < n * (nl + nk); t++) {
        const size_t i = t / (nl + nk), b = t % (nl + nk);
        uint8_t *e = out + i * l->entry_bytes;
        if (b < nl)
            ds41_na_latent_block(latent + i * ld, ld, b, e, e + ld / 2);
        else
            ds41_na_key_block(key + i * kd, kd, b - nl, e + l->latent_bytes, e + l->latent_bytes + kd / 2);
    }
}

void ds41_cuda_emu_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n,
                                 int ratio, size_t hd, float *pooled) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(kv);
    EMU_DEV(score);
    EMU_DEV(pooled);
    const size_t group = (size_t)ratio * hd;
    for (size_t t = 0; t < n * hd; t++) {
        const size_t g = t / hd;
        pooled[t] = ds41_na_pool_channel(kv + g * group, score + g * group, ratio, hd, t % hd);
    }
}

/* ---- index scores: a warp per (row, entry) ------------------------------------------------- */

void ds41_cuda_emu_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                                int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(q);
    EMU_DEV(w);
    EMU_DEV(score);
    const ds41_kv_layout *lay = keys->layout;
    const uint8_t *const *pages;
    const size_t *row_table;
    uint32_t max_reach;
    const uint32_t *reach = ds41_cuda_index_meta(c, keys, M, n_heads, dim, &max_reach, &pages, &row_table);
    const size_t D = (size_t)dim, qw = (size_t)n_heads * D, per = lay->entries_per_page;
    double part[DS41_NA_WARP];
    for (size_t m = 0; m < M; m++) {
        for (size_t t = 0; t < reach[m]; t++) {
            const uint8_t *k =
                pages[row_table[m] + t / per] + (t % per) * (size_t)lay->entry_bytes + lay->latent_bytes;
            double hsum = 0.0;
            for (int h = 0; h < n_heads; h++) {
                const float *qh = q + m * qw + (size_t)h * D;
                for (unsigned l = 0; l < DS41_NA_WARP; l++) {
                    double s = 0.0;
                    for (size_t i = l; i < D; i += DS41_NA_WARP)
                        s = ds41_na_dacc(s, qh[i], ds41_na_key_value(k, D, i));
                    part[l] = s;
                }
                const float term =
                    ds41_na_index_term(ds41_na_xor_tree(part), w[m * (size_t)n_heads + (size_t)h]);
                hsum = ds41_na_dadd(hsum, (double)term);
            }
            score[m * score_stride + t] = ds41_hd_bf16_round((float)hsum);
        }
    }
}

/* ---- decisions: a block per row -------------------------------------------------------------- */

/* The n-th largest rank key of a[0..len) (1 <= n <= len): 8 passes of the
 * radix select, each a histogram of one digit over the keys that match the
 * digits chosen so far (the kernel's block-wide counts). */
static uint64_t select_nth(const float *a, size_t len, size_t n) {
    uint64_t prefix = 0;
    uint32_t r = (uint32_t)n, hist[256];
    for (unsigned d = 8; d-- > 0;) {
        memset(hist, 0, sizeof hist);
        for (size_t i = 0; i < len; i++) {
            const uint64_t key = ds41_na_rank_key64(a[i], (uint32_t)i);
            if (ds41_na_select_match(key, prefix, d)) hist[(key >> (8 * d)) & 255u]++;
        }
        prefix = (prefix << 8) | ds41_na_select_bin(hist, &r);
    }
    return prefix;
}

void ds41_cuda_emu_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                                const uint32_t *reach_host, size_t M, size_t block, size_t n_take,
                                float *bscore, size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(score);
    EMU_DEV(bscore);
    EMU_DEV(allow);
    const uint32_t *reach = (const uint32_t *)ds41_cuda_meta(c, reach_host, M * sizeof *reach_host);
    for (size_t m = 0; m < M; m++) {
        uint8_t *al = allow + m * allow_stride;
        for (size_t j = 0; j < allow_stride; j++) al[j] = 0;
        const size_t r = reach[m];
        if (!r) continue;
        const float *s = score + m * score_stride;
        float *bs = bscore + m * bscore_stride;
        const size_t nb = (r + block - 1) / block;
        for (size_t j = 0; j < nb; j++) { /* a thread per block */
            float mx = -INFINITY;
            for (size_t t = j * block; t < r && t < (j + 1) * block; t++)
                mx = ds41_na_block_max_step(mx, s[t]);
            bs[j] = j == nb - 1 ? INFINITY : mx;
        }
        const size_t take = n_take < nb ? n_take : nb;
        if (!take) continue;
        const uint64_t T = take < nb ? select_nth(bs, nb, take) : 0;
        for (size_t j = 0; j < nb; j++)
            if (ds41_na_rank_key64(bs[j], (uint32_t)j) >= T && !(bs[j] == -INFINITY)) al[j] = 1;
    }
}

void ds41_cuda_emu_index_topk(const ds41_ops *self, float *score, size_t score_stride,
                              const uint32_t *reach_host, size_t M, const uint8_t *allow, size_t allow_stride,
                              size_t block, size_t k, int32_t *sel, uint32_t *count) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(score);
    EMU_DEV(allow);
    EMU_DEV(sel);
    EMU_DEV(count);
    const uint32_t *reach = (const uint32_t *)ds41_cuda_meta(c, reach_host, M * sizeof *reach_host);
    for (size_t m = 0; m < M; m++) {
        const size_t r = reach[m];
        float *s = score + m * score_stride;
        if (allow)
            for (size_t t = 0; t < r; t++)
                if (!allow[m * allow_stride + t / block]) s[t] = -INFINITY;
        const size_t n = k < r ? k : r;
        count[m] = (uint32_t)n;
        if (!n) continue;
        const uint64_t T = n < r ? select_nth(s, r, n) : 0;
        size_t o = 0; /* the compaction in index order */
        for (size_t t = 0; t < r; t++)
            if (ds41_na_rank_key64(s[t], (uint32_t)t) >= T) sel[m * k + o++] = (int32_t)t;
    }
}

/* ---- attention: a block per (query row, group of heads) ---------------------------------------- */

/* Heads [h0, h1) of query m: the kernel's per-block program.  acc: (h1 - h0)
 * x hd floats (the block's shared memory). */
static void attn_block(const ds41_na_attn_src *src, size_t m, const float *q, size_t h0, size_t h1, size_t hd,
                       const float *sink, float scale, float *acc, float *out) {
    size_t nw, ncomp;
    ds41_na_attn_counts(src, m, &nw, &ncomp);
    const size_t total = nw + ncomp;
    float mx[DS41_CUDA_ATTN_HEADS], den[DS41_CUDA_ATTN_HEADS];
    const uint8_t *rows[DS41_NA_CHUNK];
    int isw[DS41_NA_CHUNK];
    float z[DS41_NA_CHUNK], p[DS41_NA_CHUNK], pb[DS41_NA_CHUNK];
    double part[DS41_NA_WARP];
    for (size_t g = 0; g < h1 - h0; g++) {
        mx[g] = -1e30f;
        den[g] = 0.0f;
        for (size_t d = 0; d < hd; d++) acc[g * hd + d] = 0.0f;
    }
    for (size_t c0 = 0; c0 < total; c0 += DS41_NA_CHUNK) {
        const size_t nc = total - c0 < DS41_NA_CHUNK ? total - c0 : DS41_NA_CHUNK;
        for (size_t j = 0; j < nc; j++) {
            rows[j] = ds41_na_attn_row(src, m, c0 + j, nw);
            isw[j] = c0 + j < nw;
        }
        for (size_t g = 0; g < h1 - h0; g++) {
            const float *qh = q + (h0 + g) * hd;
            for (size_t j = 0; j < nc; j++) { /* a warp per row */
                for (unsigned l = 0; l < DS41_NA_WARP; l++) {
                    double s = 0.0;
                    for (size_t d = l; d < hd; d += DS41_NA_WARP)
                        s = ds41_na_dacc(s, qh[d], ds41_na_row_value(rows[j], isw[j], hd, d));
                    part[l] = s;
                }
                z[j] = ds41_na_fmul((float)ds41_na_xor_tree(part), scale);
            }
            const float m_new = ds41_na_chunk_max(mx[g], z, nc);
            const float corr = ds41_na_exp(ds41_na_fsub(mx[g], m_new));
            for (size_t j = 0; j < nc; j++) p[j] = ds41_na_prob(z[j], m_new, &pb[j]);
            den[g] = ds41_na_den_update(den[g], corr, p, nc);
            for (size_t d = 0; d < hd; d++) { /* a thread per channel */
                double pv = 0.0;
                for (size_t j = 0; j < nc; j++)
                    pv = ds41_na_dacc(pv, pb[j], ds41_na_row_value(rows[j], isw[j], hd, d));
                acc[g * hd + d] = ds41_na_acc_update(acc[g * hd + d], corr, pv);
            }
            mx[g] = m_new;
        }
    }
    for (size_t g = 0; g < h1 - h0; g++)
        for (size_t d = 0; d < hd; d++)
            out[(h0 + g) * hd + d] = ds41_na_attn_out(acc[g * hd + d], den[g], sink[h0 + g], mx[g]);
}

static void attn_rows(ds41_cuda_ctx *c, const ds41_na_attn_src *src, const float *q, size_t M, int n_heads,
                      int head_dim, const float *sink, float scale, float *out) {
    const size_t H = (size_t)n_heads, hd = (size_t)head_dim, qo = H * hd;
    float *acc = (float *)ds41_cuda_scratch(c, DS41_CUDA_ATTN_HEADS * hd * sizeof *acc);
    sink = (const float *)ds41_cuda_weight(c, sink, H * sizeof *sink); /* the layer's weight */
    EMU_DEV(sink);
    for (size_t m = 0; m < M; m++)
        for (size_t h0 = 0; h0 < H; h0 += DS41_CUDA_ATTN_HEADS) {
            const size_t h1 = h0 + DS41_CUDA_ATTN_HEADS < H ? h0 + DS41_CUDA_ATTN_HEADS : H;
            attn_block(src, m, q + m * qo, h0, h1, hd, sink, scale, acc, out + m * qo);
        }
}

void ds41_cuda_emu_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim,
                               const float *sink, float scale, const ds41_attn_rows *rows, float *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(q);
    EMU_DEV(out);
    ds41_na_attn_src src;
    ds41_cuda_attn_src_rows(c, rows, &src);
    ds41_cuda_attn_count(c, (size_t)n_heads, (size_t)head_dim, rows->n_window + rows->n_comp);
    attn_rows(c, &src, q, 1, n_heads, head_dim, sink, scale, out);
}

void ds41_cuda_emu_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                          const float *sink, float scale, const ds41_attn_step *step, float *out) {
    ds41_cuda_ctx *c = enter(self);
    EMU_DEV(q);
    EMU_DEV(out);
    EMU_DEV(step->chunk);
    ds41_cuda_attend_count(c, step, M, (size_t)n_heads, (size_t)head_dim); /* reads the host metadata */
    ds41_na_attn_src src;
    ds41_cuda_attn_src_step(c, step, M, &src);
    attn_rows(c, &src, q, M, n_heads, head_dim, sink, scale, out);
}
