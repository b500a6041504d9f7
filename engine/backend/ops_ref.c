/* The canonical reference backend: REFERENCE.md §10, scalar and
 * single-threaded.  Every reduction is exact (engine/backend/refmath.h) and rounded
 * once; every elementwise fp32 operation is one C float operation in the
 * order of the reference's expression (the build disables FMA contraction). */
#include "engine/backend/ops.h"

#include "engine/backend/index_select.h"
#include "engine/backend/refmath.h"
#include "engine/backend/scratch.h"
#include "engine/model/quant.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Scratch of the ops: a stack per thread (engine/backend/scratch.h) that grows
 * while an engine warms up and is then reused, so that a step allocates
 * nothing.  Per thread because the table keeps no state of its own (the fast
 * backend calls some of these ops with its own context); freed when the
 * thread exits.  The ops cannot fail, so running out of memory for scratch
 * is fatal rather than silently wrong. */
static _Thread_local ds41_scratch tls_stack;
static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;

static void tls_free(void *unused) {
    (void)unused;
    ds41_scratch_free(&tls_stack);
}

static void tls_init(void) {
    if (pthread_key_create(&tls_key, tls_free) != 0) abort();
}

static ds41_scratch *ref_stack(void) {
    if (tls_stack.n == 0) {
        /* First use on this thread: free the stack when it exits. */
        pthread_once(&tls_once, tls_init);
        pthread_setspecific(tls_key, &tls_stack);
    }
    return &tls_stack;
}

static void *scratch(ds41_scratch *st, size_t bytes) {
    void *p = ds41_scratch_get(st, bytes);
    if (!p) abort();
    return p;
}

/* ---- linear ---------------------------------------------------------------- */

/* act_quant + FP8/FP4 block GEMM (§2.2, §2.3, §10.3): per 32-wide K block,
 * p = fp32(exact block sum of code products) - exact in double, the code
 * products being multiples of 2^-18 (FP8 x FP8; 2^-10 for FP4 x FP8) below
 * 2^18, so 32 of them need at most 41 bits -, acc = fp32(acc + fp32(p *
 * fp32(a_scale * b_scale))); y = bf16(acc). */
static void linear_quant(const ds41_linear *w, const float *x, size_t M, float *y) {
    const size_t K = (size_t)w->k, N = (size_t)w->n;
    const size_t nkb = (K + 31) / 32;
    const int fp4 = w->kind == DS41_LINEAR_FP4;
    const size_t row_bytes = fp4 ? (K + 1) / 2 : K;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    float *av = scratch(st, M * K * sizeof *av);
    float *as = scratch(st, M * nkb * sizeof *as);
    float *ws = scratch(st, nkb * sizeof *ws);
    float *wv = scratch(st, K * sizeof *wv);
    uint8_t *codes = scratch(st, K);
    uint8_t *sbytes = scratch(st, nkb);
    for (size_t m = 0; m < M; m++) {
        ds41_act_quant(x + m * K, K, codes, sbytes);
        for (size_t k = 0; k < K; k++) av[m * K + k] = ds41_e4m3_table[codes[k]];
        for (size_t kb = 0; kb < nkb; kb++) as[m * nkb + kb] = ds41_ue8m0_to_f32(sbytes[kb]);
    }
    for (size_t n = 0; n < N; n++) {
        /* This row's unscaled weight values and block scales. */
        const uint8_t *q = w->q + n * row_bytes;
        if (fp4)
            for (size_t k = 0; k < K; k++) wv[k] = ds41_e2m1_table[(q[k / 2] >> ((k & 1) * 4)) & 15];
        else
            for (size_t k = 0; k < K; k++) wv[k] = ds41_e4m3_table[q[k]];
        const uint8_t *srow = w->scale + (fp4 ? n : n / 32) * (size_t)w->scale_cols;
        for (size_t kb = 0; kb < nkb; kb++) ws[kb] = ds41_ue8m0_to_f32(srow[kb]);
        for (size_t m = 0; m < M; m++) {
            const float *a = av + m * K;
            const float *sa = as + m * nkb;
            float acc = 0.0f;
            for (size_t kb = 0; kb < nkb; kb++) {
                const size_t k0 = kb * 32, k1 = k0 + 32 < K ? k0 + 32 : K;
                /* Every partial sum is exact, so any order gives the same p. */
                double p0 = 0.0, p1 = 0.0, p2 = 0.0, p3 = 0.0;
                size_t k = k0;
                for (; k + 4 <= k1; k += 4) {
                    p0 += (double)a[k] * (double)wv[k];
                    p1 += (double)a[k + 1] * (double)wv[k + 1];
                    p2 += (double)a[k + 2] * (double)wv[k + 2];
                    p3 += (double)a[k + 3] * (double)wv[k + 3];
                }
                for (; k < k1; k++) p0 += (double)a[k] * (double)wv[k];
                const float pf = (float)((p0 + p1) + (p2 + p3));
                const float sc = sa[kb] * ws[kb];
                const float t = pf * sc;
                acc = acc + t;
            }
            y[m * N + n] = ds41_bf16_round(acc);
        }
    }
    ds41_scratch_release(st, st_mark);
}

static void ref_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y, ds41_linear_out out) {
    (void)self;
    if (w->kind == DS41_LINEAR_FP8 || w->kind == DS41_LINEAR_FP4) {
        linear_quant(w, x, M, y);
        return;
    }
    const size_t K = (size_t)w->k, N = (size_t)w->n;
    for (size_t m = 0; m < M; m++)
        for (size_t n = 0; n < N; n++) {
            float v = ds41_xdot_f32_bf16(x + m * K, w->bf16 + n * K, K);
            y[m * N + n] = ds41_linear_out_bf16(out) ? ds41_bf16_round(v) : v;
        }
}

static void ref_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws, const float *const *xs,
                             const size_t *Ms, float *const *ys, ds41_linear_out out) {
    for (size_t i = 0; i < n; i++)
        if (Ms[i]) ref_linear(self, ws[i], xs[i], Ms[i], ys[i], out);
}

/* ---- norms and hyper-connections ---------------------------------------------- */

static void ref_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n, float eps, float *y) {
    (void)self;
    for (size_t m = 0; m < M; m++) {
        const float *xr = x + m * n;
        const float ms = ds41_mean_sq_f32(xr, n);
        const float r = ds41_rm_rsqrt(ms + eps);
        for (size_t i = 0; i < n; i++) {
            const float t = xr[i] * r;
            y[m * n + i] = ds41_bf16_round(ds41_bf16_to_f32(w[i]) * t);
        }
    }
}

static void ref_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base, const float *h, size_t M, int hc,
                       size_t dim, float norm_eps, int iters, float hc_eps, float *pre, float *post, float *comb) {
    (void)self;
    const size_t n = (size_t)hc * dim;
    const int n_mix = (2 + hc) * hc;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    float *mix = scratch(st, (size_t)n_mix * sizeof *mix);
    for (size_t m = 0; m < M; m++) {
        const float *hr = h + m * n;
        const float ms = ds41_mean_sq_f32(hr, n);
        const float r = ds41_rm_rsqrt(ms + norm_eps);
        for (int j = 0; j < n_mix; j++) mix[j] = ds41_xdot_f32(fn + (size_t)j * n, hr, n) * r;
        ds41_rm_hc_sinkhorn(mix, scale, base, hc, iters, hc_eps, pre + m * (size_t)hc, post + m * (size_t)hc,
                 comb + m * (size_t)hc * (size_t)hc);
    }
    ds41_scratch_release(st, st_mark);
}

static void ref_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim, float *out) {
    (void)self;
    for (size_t m = 0; m < M; m++) {
        const float *hr = h + m * (size_t)hc * dim;
        const float *p = pre + m * (size_t)hc;
        for (size_t d = 0; d < dim; d++) {
            float acc = p[0] * hr[d];
            for (int c = 1; c < hc; c++) {
                const float t = p[c] * hr[(size_t)c * dim + d];
                acc = acc + t;
            }
            out[m * dim + d] = ds41_bf16_round(acc);
        }
    }
}

static void ref_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post, const float *comb, size_t M, int hc,
                        size_t dim, float *out) {
    (void)self;
    for (size_t m = 0; m < M; m++) {
        const float *hr = h + m * (size_t)hc * dim;
        const float *cm = comb + m * (size_t)hc * (size_t)hc;
        for (int j = 0; j < hc; j++) {
            const float pj = post[m * (size_t)hc + (size_t)j];
            float *dst = out + (m * (size_t)hc + (size_t)j) * dim;
            for (size_t d = 0; d < dim; d++) {
                float s = cm[j] * hr[d];
                for (int i = 1; i < hc; i++) {
                    const float t = cm[i * hc + j] * hr[(size_t)i * dim + d];
                    s = s + t;
                }
                const float po = pj * o[m * dim + d];
                dst[d] = ds41_bf16_round(po + s);
            }
        }
    }
}

static void ref_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos,
                           size_t M, float *cs) {
    (void)self;
    for (size_t m = 0; m < M; m++) ds41_rope_cos_sin(freqs, n_pairs, pos[m], cs + m * 2 * (size_t)n_pairs);
}

static void ref_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                     size_t head_stride, int n_pairs, const float *cs, int inverse) {
    (void)self;
    for (size_t m = 0; m < M; m++)
        for (int h = 0; h < n_heads; h++)
            ds41_rope_apply(x + m * row_stride + (size_t)h * head_stride, n_pairs,
                            cs + m * 2 * (size_t)n_pairs, inverse);
}

/* ---- activation quantization ---------------------------------------------------- */

static void ref_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                              size_t out_stride) {
    (void)self;
    for (size_t m = 0; m < M; m++)
        ds41_act_quant(x + m * n, n, out + m * out_stride, out + m * out_stride + n);
}

static void ref_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                            float scale) {
    (void)self;
    for (size_t m = 0; m < M; m++) {
        ds41_fp4_act_quant_ue8m0_qdq(q + m * qn, qn);
        for (size_t i = 0; i < wn; i++) w[m * wn + i] = ds41_bf16_round(w[m * wn + i] * scale);
    }
}

static void ref_kv_pack(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent,
                        const float *key, size_t n, uint8_t *out) {
    (void)self;
    for (size_t i = 0; i < n; i++)
        ds41_kv_pack_entry(layout, latent + i * layout->latent_dim, key + i * layout->index_dim,
                           out + i * layout->entry_bytes);
}

/* ---- compressor ------------------------------------------------------------------ */

static void ref_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,
                              size_t hd, float *pooled) {
    (void)self;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    float *ex = scratch(st, (size_t)ratio * sizeof *ex);
    const size_t group = (size_t)ratio * hd;
    for (size_t g = 0; g < n; g++)
        ds41_rm_compress_pool(kv + g * group, score + g * group, ratio, hd, ex, pooled + g * hd);
    ds41_scratch_release(st, st_mark);
}

/* ---- indexer and attention ------------------------------------------------------- */

static float relu(float s) {
    if (isnan(s)) return s;
    return s > 0.0f ? s : 0.0f;
}

static void ref_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                             int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    (void)self;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    float *key = scratch(st, (size_t)dim * sizeof *key);
    float *terms = scratch(st, (size_t)n_heads * sizeof *terms);
    const size_t qw = (size_t)n_heads * (size_t)dim;
    for (size_t m = 0; m < M; m++) {
        const float *qm = q + m * qw, *wm = w + m * (size_t)n_heads;
        for (size_t t = 0; t < keys->row_reach[m]; t++) {
            ds41_kv_decode_index_key(keys->layout, ds41_kv_pages_entry(keys, m, t), key);
            for (int h = 0; h < n_heads; h++) {
                const float s =
                    ds41_bf16_round(ds41_xdot_f32(qm + (size_t)h * (size_t)dim, key, (size_t)dim));
                terms[h] = ds41_bf16_round(relu(s) * wm[h]);
            }
            score[m * score_stride + t] = ds41_bf16_round(ds41_xsum_f32(terms, (size_t)n_heads));
        }
    }
    ds41_scratch_release(st, st_mark);
}

static void ref_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                             const uint32_t *reach, size_t M, size_t block, size_t n_take, float *bscore,
                             size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    (void)self;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    int32_t *order = scratch(st, (bscore_stride ? bscore_stride : 1) * sizeof *order);
    int32_t *tmp = scratch(st, (bscore_stride ? bscore_stride : 1) * sizeof *tmp);
    for (size_t m = 0; m < M; m++) {
        memset(allow + m * allow_stride, 0, allow_stride);
        if (reach[m])
            ds41_index_blocks_row(score + m * score_stride, reach[m], block, n_take,
                                  bscore + m * bscore_stride, allow + m * allow_stride, order, tmp);
    }
    ds41_scratch_release(st, st_mark);
}

static void ref_index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                           size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                           int32_t *sel, uint32_t *count) {
    (void)self;
    size_t max_reach = 1;
    for (size_t m = 0; m < M; m++)
        if (reach[m] > max_reach) max_reach = reach[m];
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    int32_t *order = scratch(st, max_reach * sizeof *order);
    int32_t *tmp = scratch(st, max_reach * sizeof *tmp);
    for (size_t m = 0; m < M; m++)
        count[m] = (uint32_t)ds41_index_topk_row(score + m * score_stride, reach[m],
                                                 allow ? allow + m * allow_stride : NULL, block, k,
                                                 sel + m * k, order, tmp);
    ds41_scratch_release(st, st_mark);
}

#define ATTN_CHUNK 64

static void ref_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim, const float *sink, float scale,
                            const ds41_attn_rows *rows, float *out) {
    (void)self;
    const size_t hd = (size_t)head_dim, H = (size_t)n_heads;
    const size_t total = rows->n_window + rows->n_comp;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    float *kv = scratch(st, ATTN_CHUNK * hd * sizeof *kv);
    float *mx = scratch(st, H * sizeof *mx);
    float *den = scratch(st, H * sizeof *den);
    float *acc = scratch(st, H * hd * sizeof *acc);
    float z[ATTN_CHUNK], p[ATTN_CHUNK], pb[ATTN_CHUNK];
    double terms[ATTN_CHUNK];
    for (size_t h = 0; h < H; h++) {
        mx[h] = -1e30f;
        den[h] = 0.0f;
    }
    memset(acc, 0, H * hd * sizeof *acc);
    for (size_t c0 = 0; c0 < total; c0 += ATTN_CHUNK) {
        const size_t nc = total - c0 < ATTN_CHUNK ? total - c0 : ATTN_CHUNK;
        for (size_t j = 0; j < nc; j++) {
            const size_t idx = c0 + j;
            if (idx < rows->n_window)
                ds41_kv_decode_ring_row(rows->layout, rows->window[idx], kv + j * hd);
            else
                ds41_kv_decode_latent(rows->layout, rows->comp[idx - rows->n_window], kv + j * hd);
        }
        for (size_t h = 0; h < H; h++) {
            const float *qh = q + h * hd;
            float m_new = mx[h];
            for (size_t j = 0; j < nc; j++) {
                z[j] = ds41_xdot_f32(qh, kv + j * hd, hd) * scale;
                if (z[j] > m_new) m_new = z[j];
            }
            const float corr = ds41_rm_exp(mx[h] - m_new);
            for (size_t j = 0; j < nc; j++) {
                p[j] = ds41_rm_exp(z[j] - m_new);
                pb[j] = ds41_bf16_round(p[j]);
            }
            const float psum = ds41_xsum_f32(p, nc);
            const float dc = den[h] * corr;
            den[h] = dc + psum;
            float *ah = acc + h * hd;
            for (size_t d = 0; d < hd; d++) {
                for (size_t j = 0; j < nc; j++) terms[j] = (double)pb[j] * (double)kv[j * hd + d];
                const float pv = ds41_xsum_f64(terms, nc);
                const float ac = ah[d] * corr;
                ah[d] = ac + pv;
            }
            mx[h] = m_new;
        }
    }
    for (size_t h = 0; h < H; h++) {
        const float d = den[h] + ds41_rm_exp(sink[h] - mx[h]);
        for (size_t i = 0; i < hd; i++) out[h * hd + i] = ds41_bf16_round(acc[h * hd + i] / d);
    }
    ds41_scratch_release(st, st_mark);
}

/* Row by row through the table's sparse_attn (a wrapping backend sees each
 * query, tests/test_forward.c). */
static void ref_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                       const float *sink, float scale, const ds41_attn_step *step, float *out) {
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    const uint8_t **wrows = scratch(st, ((size_t)step->window + step->block) * sizeof *wrows);
    const uint8_t **crows = scratch(st, (step->sel_stride ? step->sel_stride : 1) * sizeof *crows);
    const size_t qo = (size_t)n_heads * (size_t)head_dim;
    for (size_t m = 0; m < M; m++) {
        const ds41_attn_rows rows = ds41_attn_step_rows(step, m, wrows, crows);
        self->sparse_attn(self, q + m * qo, n_heads, head_dim, sink, scale, &rows, out + m * qo);
    }
    ds41_scratch_release(st, st_mark);
}

/* ---- MoE ------------------------------------------------------------------------------ */

static void ref_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n, float limit, const float *route,
                       float *out) {
    (void)self;
    for (size_t m = 0; m < M; m++)
        for (size_t i = 0; i < n; i++) {
            float gv = g[m * n + i], uv = u[m * n + i];
            if (limit > 0.0f) {
                uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
                gv = gv > limit ? limit : gv;
            }
            float h = ds41_rm_silu(gv) * uv;
            if (route) h = route[m] * h;
            out[m * n + i] = ds41_bf16_round(h);
        }
}

static void ref_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                            const float *shared, size_t M, size_t D, float *out) {
    (void)self;
    for (size_t m = 0; m < M; m++)
        ds41_rm_moe_combine_token(oe, slot + m * k, k, shared + m * D, D, out + m * D);
}

static void ref_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                       float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection) {
    (void)self;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    float *score = scratch(st, (size_t)E * sizeof *score);
    float *biased = scratch(st, (size_t)E * sizeof *biased);
    unsigned char *taken = scratch(st, (size_t)E);
    for (size_t m = 0; m < M; m++) {
        for (int e = 0; e < E; e++) {
            const float z = logits[m * (size_t)E + (size_t)e] / gate_temp;
            score[e] = ds41_rm_sqrt(ds41_rm_softplus(z));
            biased[e] = score[e] + bias[e];
            taken[e] = 0;
            if (selection) selection[m * (size_t)E + (size_t)e] = biased[e];
        }
        int32_t *s = sel + m * (size_t)k;
        float *w = weight + m * (size_t)k;
        for (int i = 0; i < k; i++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || biased[e] > biased[best])) best = e;
            taken[best] = 1;
            s[i] = best;
            w[i] = score[best];
        }
        if (k > 1) {
            float sum = w[0];
            for (int i = 1; i < k; i++) sum = sum + w[i];
            const float d = sum + 1e-20f;
            for (int i = 0; i < k; i++) w[i] = w[i] / d;
        }
        for (int i = 0; i < k; i++) w[i] = w[i] * route_scale;
    }
    ds41_scratch_release(st, st_mark);
}

/* ---- Engram ------------------------------------------------------------------------------ */

static void ref_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M, int hc, size_t dim, float eps,
                           float dim_scale) {
    (void)self;
    ds41_scratch *st = ref_stack();
    const ds41_scratch_mark st_mark = ds41_scratch_mark_now(st);
    double *terms = scratch(st, dim * sizeof *terms);
    for (size_t m = 0; m < M; m++) {
        const float *kvr = kv + m * (size_t)(hc + 1) * dim;
        const float *value = kvr + (size_t)hc * dim;
        for (int c = 0; c < hc; c++) {
            float *hr = h + (m * (size_t)hc + (size_t)c) * dim;
            const float *key = kvr + (size_t)c * dim;
            const float *wr = wqk + (size_t)c * dim;
            const float ms_h = ds41_mean_sq_f32(hr, dim);
            const float ms_k = ds41_mean_sq_f32(key, dim);
            const float rstd = ds41_rm_rsqrt(ms_h + eps) * ds41_rm_rsqrt(ms_k + eps);
            for (size_t d = 0; d < dim; d++) {
                const float hw = hr[d] * wr[d];
                const float t = hw * key[d];
                terms[d] = (double)t;
            }
            const float s = ds41_xsum_f64(terms, dim);
            const float sr = s * rstd;
            const float dot = sr * dim_scale;
            float a = fabsf(dot);
            if (a < 1e-6f) a = 1e-6f;
            const float gate = ds41_rm_sigmoid(copysignf(ds41_rm_sqrt(a), dot));
            for (size_t d = 0; d < dim; d++) {
                const float gv = gate * value[d];
                hr[d] = ds41_bf16_round(hr[d] + gv);
            }
        }
    }
    ds41_scratch_release(st, st_mark);
}

/* ---- gathers ------------------------------------------------------------------------------ */

static void ref_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc, size_t dim,
                      float *out) {
    (void)self;
    for (size_t r = 0; r < M; r++)
        for (size_t cp = 0; cp < (size_t)hc; cp++)
            for (size_t d = 0; d < dim; d++)
                out[(r * (size_t)hc + cp) * dim + d] = ds41_bf16_to_f32(table[(size_t)ids[r] * dim + d]);
}

static void ref_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows, size_t n,
                         size_t cols, float *out) {
    (void)self;
    const size_t sc = (cols + 31) / 32;
    for (size_t i = 0; i < n; i++) {
        float *dst = out + i * cols;
        ds41_dequant_fp8_rows_1x32(q + (size_t)rows[i] * cols, scale + (size_t)rows[i] * sc, 1, cols, dst);
        for (size_t c = 0; c < cols; c++) dst[c] = ds41_bf16_round(dst[c]);
    }
}

static void ref_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride, const uint32_t *idx,
                            size_t n, size_t row_bytes) {
    (void)self;
    for (size_t i = 0; i < n && row_bytes; i++)
        memcpy((unsigned char *)dst + i * row_bytes, (const unsigned char *)src + (size_t)idx[i] * src_stride,
               row_bytes);
}

const ds41_ops ds41_ops_reference = {
    .name = "reference",
    .linear = ref_linear,
    .linear_batch = ref_linear_batch,
    .rmsnorm = ref_rmsnorm,
    .hc_mix = ref_hc_mix,
    .hc_pre = ref_hc_pre,
    .hc_post = ref_hc_post,
    .rope_table = ref_rope_table,
    .rope = ref_rope,
    .act_quant_fp8 = ref_act_quant_fp8,
    .index_query = ref_index_query,
    .kv_pack = ref_kv_pack,
    .compress_pool = ref_compress_pool,
    .index_scores = ref_index_scores,
    .index_blocks = ref_index_blocks,
    .index_topk = ref_index_topk,
    .sparse_attn = ref_sparse_attn,
    .attend = ref_attend,
    .swiglu = ref_swiglu,
    .moe_combine = ref_moe_combine,
    .router = ref_router,
    .engram_mix = ref_engram_mix,
    .embed = ref_embed,
    .fp8_rows = ref_fp8_rows,
    .gather_rows = ref_gather_rows,
};
