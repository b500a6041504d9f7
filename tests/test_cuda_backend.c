/* The CUDA backend's host side (cuda/cuda_backend.c, cuda/placement.c) on
 * the fake device (cuda/gpu_fake.c), with an op table that wraps the
 * reference ops the way the emulated kernels work: each op enters the
 * emulation (ds41_cuda_emu_enter), translates every weight pointer with
 * ds41_cuda_weight, ships every host metadata array with ds41_cuda_meta
 * and checks that every pointer it computes on is device memory, then runs
 * the reference op on those (fake device memory is host memory).
 *
 * Checked: the placement plan (bound weights against the tensor plan on the
 * tiny and long checkpoints, the lookup, the released config's figures);
 * whole forward passes bit-identical to the reference backend (prompt and
 * decode steps, chunked prefill, a snapshot taken on the CPU reference
 * restored here, routed experts streamed through the expert cache into
 * device slots); the memory statistics adding up to what the device holds;
 * the metadata ring's reuse waiting for the compute stream. */
#include "cuda/cuda_backend_internal.h"
#include "cuda/emu_enter.h"
#include "cuda/gpu_fake.h"
#include "cuda/placement.h"
#include "engine/forward/forward.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"
#include "engine/model/tensor_plan.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---------------------------------------------------- the wrapped table */

static const ds41_ops *R = &ds41_ops_reference;
static unsigned long violations; /* pointers an op computed on that are not device memory */
static char first_violation[200];

static ds41_cuda_ctx *enter(const ds41_ops *self) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    ds41_cuda_emu_enter(c);
    return c;
}

static void dev(ds41_cuda_ctx *c, const void *p, size_t n, const char *what) {
    if (!p || !n || ds41_gpu_fake_is_device(c->gpu, p, n)) return;
    if (!violations++) snprintf(first_violation, sizeof first_violation, "%s (%p, %zu bytes)", what, p, n);
}

static const void *W(ds41_cuda_ctx *c, const void *p, size_t n, const char *what) {
    const void *d = ds41_cuda_weight(c, p, n);
    dev(c, d, n, what);
    return d;
}

static void *META(ds41_cuda_ctx *c, const void *host, size_t n) {
    void *d = ds41_cuda_meta(c, host, n);
    dev(c, d, n, "metadata");
    return d;
}

static ds41_linear lin(ds41_cuda_ctx *c, const ds41_linear *w) {
    ds41_linear l = *w;
    const size_t n = (size_t)w->n, k = (size_t)w->k, sc = (size_t)w->scale_cols;
    if (w->kind == DS41_LINEAR_FP8) {
        l.q = W(c, w->q, n * k, "fp8 codes");
        l.scale = W(c, w->scale, (n + 31) / 32 * sc, "fp8 scales");
    } else if (w->kind == DS41_LINEAR_FP4) {
        l.q = W(c, w->q, n * ((k + 1) / 2), "fp4 codes");
        l.scale = W(c, w->scale, n * sc, "fp4 scales");
    } else {
        l.bf16 = W(c, w->bf16, n * k * 2, "bf16 weight");
    }
    return l;
}

static void w_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                     ds41_linear_out out) {
    ds41_cuda_ctx *c = enter(self);
    const ds41_linear l = lin(c, w);
    dev(c, x, M * (size_t)w->k * 4, "linear x");
    dev(c, y, M * (size_t)w->n * 4, "linear y");
    R->linear(R, &l, x, M, y, out);
}

static void w_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                           const float *const *xs, const size_t *Ms, float *const *ys, ds41_linear_out out) {
    ds41_cuda_ctx *c = enter(self);
    ds41_linear *l = malloc((n ? n : 1) * sizeof *l);
    const ds41_linear **lp = malloc((n ? n : 1) * sizeof *lp);
    for (size_t i = 0; i < n; i++) {
        l[i] = lin(c, ws[i]);
        lp[i] = &l[i];
        dev(c, xs[i], Ms[i] * (size_t)ws[i]->k * 4, "linear_batch x");
        dev(c, ys[i], Ms[i] * (size_t)ws[i]->n * 4, "linear_batch y");
    }
    const size_t *dMs = META(c, Ms, n * sizeof *Ms);
    R->linear_batch(R, n, lp, xs, dMs, ys, out);
    free(l);
    free(lp);
}

static void w_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n, float eps,
                      float *y) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, x, M * n * 4, "rmsnorm x");
    R->rmsnorm(R, W(c, w, n * 2, "rmsnorm weight"), x, M, n, eps, y);
}

static void w_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,
                     const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters, float hc_eps,
                     float *pre, float *post, float *comb) {
    ds41_cuda_ctx *c = enter(self);
    const size_t mix = (size_t)(2 + hc) * (size_t)hc;
    dev(c, h, M * (size_t)hc * dim * 4, "hc_mix h");
    dev(c, comb, M * (size_t)hc * (size_t)hc * 4, "hc_mix comb");
    R->hc_mix(R, W(c, fn, mix * (size_t)hc * dim * 4, "hc fn"), W(c, scale, 12, "hc scale"),
              W(c, base, mix * 4, "hc base"), h, M, hc, dim, norm_eps, iters, hc_eps, pre, post, comb);
}

static void w_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim,
                     float *out) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, out, M * dim * 4, "hc_pre out");
    R->hc_pre(R, h, pre, M, hc, dim, out);
}

static void w_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,
                      const float *comb, size_t M, int hc, size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, out, M * (size_t)hc * dim * 4, "hc_post out");
    R->hc_post(R, o, h, post, comb, M, hc, dim, out);
}

static void w_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos, size_t M,
                         float *cs) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, freqs, (size_t)n_pairs * 4, "rope freqs");
    dev(c, cs, M * 2 * (size_t)n_pairs * 4, "rope table");
    R->rope_table(R, freqs, n_pairs, META(c, pos, M * sizeof *pos), M, cs);
}

static void w_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                   size_t head_stride, int n_pairs, const float *cs, int inverse) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, x, 4, "rope x");
    R->rope(R, x, M, n_heads, row_stride, head_stride, n_pairs, cs, inverse);
}

static void w_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                            size_t out_stride) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, x, M * n * 4, "act_quant x");
    dev(c, out, 1, "act_quant out");
    R->act_quant_fp8(R, x, M, n, out, out_stride);
}

static void w_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                          float scale) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, q, M * qn * 4, "index_query q");
    R->index_query(R, q, qn, w, wn, M, scale);
}

static void w_kv_pack(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent,
                      const float *key, size_t n, uint8_t *out) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, out, n * layout->entry_bytes, "kv_pack out");
    R->kv_pack(R, layout, latent, key, n, out);
}

static void w_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,
                            size_t hd, float *pooled) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, kv, n * (size_t)ratio * hd * 4, "compress_pool kv");
    R->compress_pool(R, kv, score, n, ratio, hd, pooled);
}

static ds41_kv_pages pages(ds41_cuda_ctx *c, const ds41_kv_pages *k, size_t M) {
    ds41_kv_pages d = *k;
    if (!k->row_table) return d;
    size_t np = 0;
    const uint32_t per = k->layout->entries_per_page;
    for (size_t m = 0; m < M; m++)
        if (k->row_reach && k->row_reach[m]) {
            const size_t end = k->row_table[m] + (k->row_reach[m] + per - 1) / per;
            if (end > np) np = end;
        }
    for (size_t i = 0; i < np; i++) dev(c, k->pages[i], 1, "kv page");
    d.pages = np ? META(c, k->pages, np * sizeof *k->pages) : k->pages;
    d.row_table = META(c, k->row_table, M * sizeof *k->row_table);
    if (k->row_reach) d.row_reach = META(c, k->row_reach, M * sizeof *k->row_reach);
    return d;
}

static void w_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                           int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, q, M * (size_t)n_heads * (size_t)dim * 4, "index_scores q");
    const ds41_kv_pages k = pages(c, keys, M);
    R->index_scores(R, q, w, M, n_heads, dim, &k, score, score_stride);
}

static void w_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                           const uint32_t *reach, size_t M, size_t block, size_t n_take, float *bscore,
                           size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, allow, 1, "index_blocks allow");
    R->index_blocks(R, score, score_stride, META(c, reach, M * sizeof *reach), M, block, n_take, bscore,
                    bscore_stride, allow, allow_stride);
}

static void w_index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                         size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                         int32_t *sel, uint32_t *count) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, sel, 1, "index_topk sel");
    dev(c, count, M * 4, "index_topk count");
    R->index_topk(R, score, score_stride, META(c, reach, M * sizeof *reach), M, allow, allow_stride, block, k,
                  sel, count);
}

static void w_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim, const float *sink,
                          float scale, const ds41_attn_rows *rows, float *out) {
    ds41_cuda_ctx *c = enter(self);
    ds41_attn_rows r = *rows;
    r.window = rows->n_window ? META(c, rows->window, rows->n_window * sizeof *rows->window) : rows->window;
    r.comp = rows->n_comp ? META(c, rows->comp, rows->n_comp * sizeof *rows->comp) : rows->comp;
    R->sparse_attn(R, q, n_heads, head_dim, W(c, sink, (size_t)n_heads * 4, "attn sink"), scale, &r, out);
}

static void w_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                     const float *sink, float scale, const ds41_attn_step *step, float *out) {
    ds41_cuda_ctx *c = enter(self);
    ds41_attn_step s = *step;
    size_t n_items = 0;
    for (size_t m = 0; m < M; m++)
        if (step->row_item[m] + 1 > n_items) n_items = step->row_item[m] + 1;
    dev(c, q, M * (size_t)n_heads * (size_t)head_dim * 4, "attend q");
    dev(c, out, M * (size_t)n_heads * (size_t)head_dim * 4, "attend out");
    dev(c, step->chunk, M * step->layout->ring_row_bytes, "attend chunk");
    for (size_t i = 0; i < n_items; i++) dev(c, step->rings[i], 1, "attend ring");
    s.rings = META(c, step->rings, n_items * sizeof *step->rings);
    s.row_item = META(c, step->row_item, M * sizeof *step->row_item);
    s.row_pos = META(c, step->row_pos, M * sizeof *step->row_pos);
    s.item_row0 = META(c, step->item_row0, n_items * sizeof *step->item_row0);
    s.item_pos0 = META(c, step->item_pos0, n_items * sizeof *step->item_pos0);
    if (step->sel) s.comp = pages(c, &step->comp, M);
    R->attend(R, q, M, n_heads, head_dim, W(c, sink, (size_t)n_heads * 4, "attn sink"), scale, &s, out);
}

static void w_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n, float limit,
                     const float *route, float *out) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, g, M * n * 4, "swiglu g");
    dev(c, out, M * n * 4, "swiglu out");
    R->swiglu(R, g, u, M, n, limit, route, out);
}

static void w_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                          const float *shared, size_t M, size_t D, float *out) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, out, M * D * 4, "moe_combine out");
    R->moe_combine(R, oe, META(c, slot, M * k * sizeof *slot), k, shared, M, D, out);
}

static void w_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                     float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, logits, M * (size_t)E * 4, "router logits");
    dev(c, sel, M * (size_t)k * 4, "router sel");
    R->router(R, logits, W(c, bias, (size_t)E * 4, "router bias"), M, E, k, gate_temp, route_scale, sel,
              weight, selection);
}

static void w_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M, int hc,
                         size_t dim, float eps, float dim_scale) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, wqk, (size_t)hc * dim * 4, "engram wqk");
    dev(c, h, M * (size_t)hc * dim * 4, "engram h");
    R->engram_mix(R, h, kv, wqk, M, hc, dim, eps, dim_scale);
}

static void w_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,
                    size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    int32_t top = 0;
    for (size_t m = 0; m < M; m++)
        if (ids[m] > top) top = ids[m];
    dev(c, out, M * (size_t)hc * dim * 4, "embed out");
    R->embed(R, W(c, table, ((size_t)top + 1) * dim * 2, "embedding"), META(c, ids, M * sizeof *ids), M, hc,
             dim, out);
}

static void w_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,
                          const uint32_t *idx, size_t n, size_t row_bytes) {
    ds41_cuda_ctx *c = enter(self);
    dev(c, dst, n * row_bytes, "gather dst");
    dev(c, src, row_bytes, "gather src");
    R->gather_rows(R, dst, src, src_stride, META(c, idx, n * sizeof *idx), n, row_bytes);
}

static void w_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows,
                       size_t n, size_t cols, float *out) {
    ds41_cuda_ctx *c = enter(self);
    int64_t top = 0;
    for (size_t i = 0; i < n; i++)
        if (rows[i] > top) top = rows[i];
    dev(c, out, n * cols * 4, "fp8_rows out");
    R->fp8_rows(R, W(c, q, ((size_t)top + 1) * cols, "engram table"),
                W(c, scale, ((size_t)top + 1) * ((cols + 31) / 32), "engram scales"),
                META(c, rows, n * sizeof *rows), n, cols, out);
}

static const ds41_ops wrapped = {
    .name = "cuda-test (reference through the ctx)",
    .linear = w_linear,
    .linear_batch = w_linear_batch,
    .rmsnorm = w_rmsnorm,
    .hc_mix = w_hc_mix,
    .hc_pre = w_hc_pre,
    .hc_post = w_hc_post,
    .rope_table = w_rope_table,
    .rope = w_rope,
    .act_quant_fp8 = w_act_quant_fp8,
    .index_query = w_index_query,
    .kv_pack = w_kv_pack,
    .compress_pool = w_compress_pool,
    .index_scores = w_index_scores,
    .index_blocks = w_index_blocks,
    .index_topk = w_index_topk,
    .sparse_attn = w_sparse_attn,
    .attend = w_attend,
    .swiglu = w_swiglu,
    .moe_combine = w_moe_combine,
    .router = w_router,
    .engram_mix = w_engram_mix,
    .embed = w_embed,
    .gather_rows = w_gather_rows,
    .fp8_rows = w_fp8_rows,
};

static ds41_backend *fake_backend(uint64_t seed, bool emulated) {
    ds41_error err = {0};
    const ds41_gpu_fake_opts fo = {.seed = seed};
    ds41_cuda_opts o = {.emulated = emulated};
    o.gpu = ds41_gpu_fake_new(&fo, &err);
    ds41_backend *be = o.gpu ? ds41_backend_cuda_new_with_ops(&o, &wrapped, &err) : NULL;
    if (!be) TAP_NOTE("cuda backend: %s", err.msg);
    return be;
}

/* ----------------------------------------------------------- placement */

static void placement_checks(const char *dir, const char *label) {
    ds41_error err = {0};
    ds41_engine_opts ro = {.reference = true};
    ds41_engine *e = ds41_engine_load(dir, &ro, &err);
    if (!TAP_CHECK(e != NULL, "%s: reference engine loads (%s)", label, e ? "" : err.msg)) return;
    const ds41_model_config *cfg = ds41_engine_config(e);
    const ds41_weights *w = ds41_engine_weights(e);
    ds41_tensor_plan plan;
    ds41_placement a, b, x;
    const ds41_placement_opts all = {.experts = true, .engram_tables = true}, streamed = {0};
    int ok = ds41_tensor_plan_build(cfg, &plan, &err) == 0 &&
             ds41_placement_plan(&a, cfg, w, &all, &err) == 0 &&
             ds41_placement_plan_tensors(&b, cfg, &plan, &all, &err) == 0 &&
             ds41_placement_plan(&x, cfg, w, &streamed, &err) == 0;
    if (!TAP_CHECK(ok, "%s: plans (%s)", label, ok ? "" : err.msg)) return;
    int same = a.total_bytes == b.total_bytes && a.n_placed == b.n_placed;
    for (int k = 0; k < DS41_ARENA_COUNT; k++) same &= a.arena_bytes[k] == b.arena_bytes[k];
    TAP_CHECK(same, "%s: the bound weights' plan equals the tensor plan's: %zu tensors, %llu device bytes",
              label, a.n_placed, (unsigned long long)a.total_bytes);
    TAP_NOTE("%s: fp8 %llu, fp4 %llu, scale %llu, bf16 %llu, f32 %llu bytes; experts %llu", label,
             (unsigned long long)a.arena_bytes[0], (unsigned long long)a.arena_bytes[1],
             (unsigned long long)a.arena_bytes[2], (unsigned long long)a.arena_bytes[3],
             (unsigned long long)a.arena_bytes[4], (unsigned long long)a.expert_bytes);
    /* DSpark stages' experts stay placed: the expert cache streams the text layers' only. */
    TAP_CHECK(a.expert_bytes > 0 && x.expert_bytes < a.expert_bytes &&
                  x.unplaced_bytes >= a.expert_bytes - x.expert_bytes && x.total_bytes < a.total_bytes,
              "%s: streamed experts leave %llu bytes out", label, (unsigned long long)x.unplaced_bytes);
    int aligned = 1, sorted = 1, within = 1;
    for (size_t i = 0; i < a.n; i++) {
        aligned &= a.e[i].offset % DS41_PLACE_ALIGN == 0;
        within &= a.e[i].offset + a.e[i].bytes <= a.arena_bytes[a.e[i].arena];
        if (i) sorted &= (uintptr_t)a.e[i - 1].host + a.e[i - 1].bytes <= (uintptr_t)a.e[i].host;
    }
    TAP_CHECK(aligned && sorted && within,
              "%s: offsets 256-aligned inside their arenas, ranges sorted, disjoint", label);

    /* The lookup: wo_a's row ranges resolve inside their tensor, a range
     * past a tensor's end is reported, a slot is not a weight. */
    const ds41_layer_weights *lw = &w->layers[0];
    const ds41_place_entry *en = NULL;
    uint64_t off0 = 0, off1 = 0;
    const size_t k = (size_t)lw->wo_a.k, rows = (size_t)lw->wo_a.n;
    const ds41_place_found f0 = ds41_placement_find(&a, lw->wo_a.bf16, rows * k * 2, &en, &off0);
    const ds41_place_found f1 =
        ds41_placement_find(&a, lw->wo_a.bf16 + rows / 2 * k, rows / 2 * k * 2, &en, &off1);
    TAP_CHECK(f0 == DS41_PLACE_FOUND && f1 == DS41_PLACE_FOUND && off1 == off0 + rows / 2 * k * 2 &&
                  strcmp(en->what, "attn.wo_a") == 0,
              "%s: a wo_a row range resolves inside wo_a's placed copy", label);
    TAP_CHECK(ds41_placement_find(&a, lw->wo_a.bf16 + 1, rows * k * 2, &en, &off0) == DS41_PLACE_PAST_END,
              "%s: a range running past a tensor's end is an error", label);
    int local = 0;
    TAP_CHECK(ds41_placement_find(&a, &local, 4, &en, &off0) == DS41_PLACE_NOT_A_WEIGHT,
              "%s: other memory is not a weight", label);
    TAP_CHECK(ds41_placement_find(&x, lw->w1[0].q, 16, &en, &off0) == DS41_PLACE_UNPLACED &&
                  ds41_placement_find(&a, lw->w1[0].q, 16, &en, &off0) == DS41_PLACE_FOUND,
              "%s: a routed expert left to the expert cache is found as unplaced", label);
    ds41_placement_free(&a);
    ds41_placement_free(&b);
    ds41_placement_free(&x);
    ds41_tensor_plan_free(&plan);
    ds41_engine_free(e);
}

static void placement_release(void) {
    ds41_error err = {0};
    ds41_model_config cfg;
    ds41_tensor_plan plan;
    ds41_placement all, dense;
    if (!TAP_CHECK(ds41_model_config_load("tests/data/config/release", &cfg, &err) == 0 &&
                       ds41_tensor_plan_build(&cfg, &plan, &err) == 0,
                   "released config and plan (%s)", err.msg))
        return;
    const ds41_placement_opts o_all = {.experts = true, .engram_tables = true}, o_dense = {0};
    if (TAP_CHECK(ds41_placement_plan_tensors(&all, &cfg, &plan, &o_all, &err) == 0 &&
                      ds41_placement_plan_tensors(&dense, &cfg, &plan, &o_dense, &err) == 0,
                  "released config: placement plans")) {
        const double G = 1024.0 * 1024 * 1024;
        TAP_NOTE(
            "released config: dense weights on the device %.2f GiB (%llu bytes: fp8 %.2f, fp4 %.2f, scale "
            "%.2f, bf16 %.2f, f32 %.2f GiB); with every routed expert and Engram table %.2f GiB",
            dense.total_bytes / G, (unsigned long long)dense.total_bytes, dense.arena_bytes[0] / G,
            dense.arena_bytes[1] / G, dense.arena_bytes[2] / G, dense.arena_bytes[3] / G,
            dense.arena_bytes[4] / G, all.total_bytes / G);
        uint64_t streamed = 0;
        for (size_t i = 0; i < plan.n; i++)
            if (plan.t[i].kind == DS41_KIND_ROUTED_EXPERTS || plan.t[i].kind == DS41_KIND_ENGRAM_TABLES)
                streamed += plan.t[i].nbytes;
        TAP_CHECK(dense.total_bytes > 0 && dense.unplaced_bytes == streamed && all.unplaced_bytes == 0,
                  "released config: exactly the routed experts and Engram tables (%.2f GiB) are left to "
                  "their tiers",
                  streamed / G);
        TAP_CHECK(dense.total_bytes < (uint64_t)80 << 30,
                  "released config: the dense weights fit an 80 GB device (%.2f GiB)", dense.total_bytes / G);
        ds41_placement_free(&all);
        ds41_placement_free(&dense);
    }
    ds41_tensor_plan_free(&plan);
    ds41_model_config_free(&cfg);
}

/* ------------------------------------------------------- forward passes */

#define STEPS 5

/* Prefill prompt in chunks of `chunk` (all positions' logits), then STEPS
 * greedy decode steps; logits into out ([n + STEPS][V]). */
static int run(ds41_engine *e, const int32_t *prompt, size_t n, size_t chunk, float *out) {
    ds41_error err = {0};
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_seq *seq = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    int rc = seq ? 0 : -1;
    for (size_t off = 0; off < n && rc == 0; off += chunk) {
        ds41_fwd_item it = {.seq = seq,
                            .ids = prompt + off,
                            .n_ids = n - off < chunk ? n - off : chunk,
                            .logits = out + off * V};
        rc = ds41_forward(e, &it, 1, NULL, &err);
    }
    for (size_t k = 0; k < STEPS && rc == 0; k++) {
        const int32_t tok = ds41_argmax(out + (n - 1 + k) * V, V);
        ds41_fwd_item it = {.seq = seq, .ids = &tok, .n_ids = 1, .logits = out + (n + k) * V};
        rc = ds41_forward(e, &it, 1, NULL, &err);
    }
    if (rc != 0) TAP_NOTE("run: %s", err.msg);
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    return rc;
}

static int check_stats(ds41_engine *e, const char *label) {
    ds41_backend *be = ds41_engine_backend(e);
    ds41_cuda_mem_stats ms;
    ds41_gpu_fake_stats fs;
    ds41_backend_cuda_mem_stats(be, &ms);
    ds41_gpu_fake_get_stats(ds41_backend_cuda_gpu(be), &fs);
    const uint64_t sum =
        ms.weight_bytes + ms.pool_bytes + ms.expert_bytes + ms.scratch_bytes + ms.other_bytes;
    TAP_NOTE("%s: weights %llu, pool %llu, experts %llu, scratch %llu, other %llu, pinned %llu; placed by "
             "O_DIRECT "
             "%llu, from the mapping %llu bytes",
             label, (unsigned long long)ms.weight_bytes, (unsigned long long)ms.pool_bytes,
             (unsigned long long)ms.expert_bytes, (unsigned long long)ms.scratch_bytes,
             (unsigned long long)ms.other_bytes, (unsigned long long)ms.pinned_host_bytes,
             (unsigned long long)ms.placed_direct_bytes, (unsigned long long)ms.placed_mapped_bytes);
    return TAP_CHECK(
        sum == fs.dev_bytes && ms.pinned_host_bytes == fs.pinned_bytes && ms.weight_bytes > 0 &&
            ms.scratch_bytes > 0 && ms.placed_direct_bytes + ms.placed_mapped_bytes > 0,
        "%s: memory statistics add up to what the device holds (%llu of %llu bytes, pinned %llu of "
        "%llu)",
        label, (unsigned long long)sum, (unsigned long long)fs.dev_bytes,
        (unsigned long long)ms.pinned_host_bytes, (unsigned long long)fs.pinned_bytes);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static int32_t rnd(int64_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((rng >> 33) % (uint64_t)n);
}

static void forward_checks(const char *dir, const char *label, size_t n) {
    ds41_error err = {0};
    ds41_engine_opts ro = {.reference = true};
    ds41_engine *ref = ds41_engine_load(dir, &ro, &err);
    ds41_engine_opts co = {.backend = fake_backend(11, true)};
    ds41_engine *cu = co.backend ? ds41_engine_load(dir, &co, &err) : NULL;
    if (!TAP_CHECK(ref && cu, "%s: reference and fake-CUDA engines load (%s)", label, err.msg)) {
        ds41_engine_free(ref);
        ds41_engine_free(cu);
        return;
    }
    /* Where the file system takes O_DIRECT, placement used it. */
    int direct_ok = 0;
    DIR *d = opendir(dir);
    for (struct dirent *de; d && (de = readdir(d)) && !direct_ok;) {
        if (!strstr(de->d_name, ".safetensors") || strstr(de->d_name, ".json")) continue;
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        const int fd = open(path, O_RDONLY | O_DIRECT);
        direct_ok = fd >= 0;
        if (fd >= 0) close(fd);
    }
    if (d) closedir(d);
    ds41_cuda_mem_stats ms;
    ds41_backend_cuda_mem_stats(ds41_engine_backend(cu), &ms);
    if (direct_ok)
        TAP_CHECK(
            ms.placed_direct_bytes > ms.placed_mapped_bytes,
            "%s: placement read the shards with O_DIRECT (%llu bytes; %llu from memory: wo_a's bf16 copies)",
            label, (unsigned long long)ms.placed_direct_bytes, (unsigned long long)ms.placed_mapped_bytes);
    else
        TAP_SKIP("%s: the file system refuses O_DIRECT", label);
    const size_t V = (size_t)ds41_engine_config(ref)->vocab_size;
    int32_t *prompt = malloc(n * sizeof *prompt);
    for (size_t i = 0; i < n; i++) prompt[i] = rnd((int64_t)V);
    float *a = calloc((n + STEPS) * V, sizeof *a), *b = calloc((n + STEPS) * V, sizeof *b),
          *c = calloc((n + STEPS) * V, sizeof *c);
    violations = 0;
    const int ra = run(ref, prompt, n, n, a), rb = run(cu, prompt, n, n, b), rc = run(cu, prompt, n, 1, c);
    TAP_CHECK(ra == 0 && rb == 0 && rc == 0 && memcmp(a, b, (n + STEPS) * V * sizeof *a) == 0,
              "%s: fake-CUDA logits bit-identical to the reference (prompt of %zu, %d decode steps)", label,
              n, STEPS);
    TAP_CHECK(rc == 0 && memcmp(b, c, (n + STEPS) * V * sizeof *a) == 0,
              "%s: chunked prefill = token by token on the fake CUDA backend", label);
    TAP_CHECK(violations == 0, "%s: every pointer the ops computed on was device memory (%lu violations%s%s)",
              label, violations, violations ? ": first " : "", violations ? first_violation : "");

    /* A snapshot of the reference (CPU) engine's sequence restored into the
     * fake-CUDA engine's device pool continues identically. */
    const size_t cut = n / 2;
    ds41_kv_pool *pr = ds41_engine_new_pool(ref, 0, 0, &err), *pc = ds41_engine_new_pool(cu, 0, 0, &err);
    ds41_kv_seq *sr = pr ? ds41_kv_seq_new(pr, &err) : NULL, *sc = NULL;
    float *la = malloc(V * sizeof *la), *lb = malloc(V * sizeof *lb);
    int ok = sr != NULL;
    ds41_fwd_item it = {.seq = sr, .ids = prompt, .n_ids = cut, .logits = la, .logits_last_only = true};
    ok = ok && ds41_forward(ref, &it, 1, NULL, &err) == 0;
    size_t sz = ok ? ds41_kv_seq_serialized_size(sr) : 0, wr = 0;
    uint8_t *snap = malloc(sz ? sz : 1);
    ok = ok && ds41_kv_seq_serialize(sr, snap, sz, &wr, &err) == 0 &&
         ds41_kv_seq_deserialize(pc, snap, wr, &sc, &err) == 0;
    int same = ok;
    for (size_t t = cut; t < n && ok; t++) {
        ds41_fwd_item ia = {.seq = sr, .ids = prompt + t, .n_ids = 1, .logits = la, .logits_last_only = true};
        ds41_fwd_item ib = {.seq = sc, .ids = prompt + t, .n_ids = 1, .logits = lb, .logits_last_only = true};
        ok = ds41_forward(ref, &ia, 1, NULL, &err) == 0 && ds41_forward(cu, &ib, 1, NULL, &err) == 0;
        same &= ok && memcmp(la, lb, V * sizeof *la) == 0 && memcmp(la, a + t * V, V * sizeof *la) == 0;
    }
    TAP_CHECK(ok && same, "%s: a snapshot taken on the CPU reference continues identically on fake CUDA (%s)",
              label, ok ? "" : err.msg);
    check_stats(cu, label); /* with a sequence in the device pool */
    ds41_cuda_mem_stats fullms = {0};
    if (cu) ds41_backend_cuda_mem_stats(ds41_engine_backend(cu), &fullms);
    const uint64_t full_weight_bytes = fullms.weight_bytes; /* every routed expert placed */
    free(snap);
    free(la);
    free(lb);
    ds41_kv_seq_free(sr);
    ds41_kv_seq_free(sc);
    ds41_kv_pool_free(pr);
    ds41_kv_pool_free(pc);
    ds41_engine_free(cu);

    /* Routed experts streamed by the expert cache into device slots (slot
     * memory = be->mem) after a load that placed them all: a budget set at
     * run time. */
    ds41_engine_opts xo = {.backend = fake_backend(12, true)};
    ds41_engine *xe = xo.backend ? ds41_engine_load(dir, &xo, &err) : NULL;
    uint64_t slot = 0, total = 0;
    if (xe) {
        ds41_expert_cache_stats xs;
        ds41_engine_expert_stats(xe, &xs, false);
        total = xs.total_bytes;
        slot = total / 4;
    }
    ok =
        xe && total && ds41_engine_set_expert_budget(xe, slot, &err) == 0 && ds41_engine_experts_streamed(xe);
    if (TAP_CHECK(ok, "%s: fake-CUDA engine with a quarter of the experts' bytes as expert cache (%s)", label,
                  ok ? "" : err.msg)) {
        violations = 0;
        const int rx = run(xe, prompt, n, n, c);
        TAP_CHECK(
            rx == 0 && memcmp(a, c, (n + STEPS) * V * sizeof *a) == 0 && violations == 0,
            "%s: experts streamed into device slots: logits bit-identical to the reference (%lu violations)",
            label, violations);
        ds41_expert_cache_stats xs;
        ds41_engine_expert_stats(xe, &xs, false);
        TAP_CHECK(xs.slot_memory_bytes > 0 && xs.uploads > 0,
                  "%s: the expert cache uploaded %llu slots to the device", label,
                  (unsigned long long)xs.uploads);
        check_stats(xe, label);
        ds41_cuda_mem_stats xm;
        ds41_backend_cuda_mem_stats(ds41_engine_backend(xe), &xm);
        TAP_CHECK(
            xm.expert_bytes == xs.slot_memory_bytes && xm.scratch_bytes > 0,
            "%s: device memory by tier: the expert slots (%llu bytes) and the activations counted apart",
            label, (unsigned long long)xm.expert_bytes);
    }
    ds41_engine_free(xe);

    /* The engine tells the backend it streams the experts (a budget at
     * load, ds41_weights.experts_streamed): the placement leaves them out,
     * and a later budget of 0 (resident) keeps a cache holding all of them
     * instead of handing the ops host pointers. */
    if (total) {
        ds41_engine_opts so = {
            .backend = fake_backend(13, true), .expert_cache_bytes = slot, .host_expert_cache_bytes = total};
        ds41_engine *se = so.backend ? ds41_engine_load(dir, &so, &err) : NULL;
        ds41_cuda_mem_stats xm = {0};
        if (se) ds41_backend_cuda_mem_stats(ds41_engine_backend(se), &xm);
        violations = 0;
        int rs = se ? run(se, prompt, n, n, c) : -1;
        TAP_CHECK(rs == 0 && memcmp(a, c, (n + STEPS) * V * sizeof *a) == 0 && violations == 0 &&
                      xm.weight_bytes + total / 2 < full_weight_bytes,
                  "%s: experts streamed from the load: placed %llu bytes of weights without them, logits "
                  "bit-identical to the reference (%s)",
                  label, (unsigned long long)xm.weight_bytes, se ? "" : err.msg);
        ds41_expert_cache_stats hs = {0};
        if (se) ds41_engine_expert_stats(se, &hs, false);
        TAP_CHECK(se && hs.host_slots > 0 && xm.pinned_host_bytes >= hs.host_slots * hs.slot_bytes &&
                      check_stats(se, label),
                  "%s: the expert cache's host tier (%llu slots) is the backend's pinned memory (%llu bytes "
                  "pinned)",
                  label, (unsigned long long)hs.host_slots, (unsigned long long)xm.pinned_host_bytes);
        rs = se && ds41_engine_set_expert_budget(se, 0, &err) == 0 && ds41_engine_experts_streamed(se)
                 ? run(se, prompt, n, n, c)
                 : -1;
        TAP_CHECK(
            rs == 0 && memcmp(a, c, (n + STEPS) * V * sizeof *a) == 0 && violations == 0,
            "%s: a budget of 0 afterwards keeps the experts in a cache holding all of them, same logits",
            label);
        ds41_engine_free(se);
    }
    ds41_engine_free(ref);
    free(prompt);
    free(a);
    free(b);
    free(c);
}

/* ----------------------------------------------------- the metadata ring */

/* Metadata copies queued back to back (the ring wraps several times before
 * the compute stream runs anything) each reach the op that reads them: a
 * segment is refilled only after the stream has passed its last copies. */
static void meta_ring(void) {
    ds41_backend *be = fake_backend(5, false);
    if (!be) return;
    ds41_cuda_ctx *c = ds41_backend_cuda_ctx(be);
    enum { N = 96, BYTES = 8192 };
    uint8_t *src = malloc(BYTES), *got = calloc(N, BYTES);
    for (int i = 0; i < N; i++) {
        memset(src, i + 1, BYTES);
        void *d = c->meta(c, src, BYTES);
        memset(src, 0xee, BYTES); /* the caller's array may change after the call */
        c->gpu->d2h(c->gpu, c->compute, got + (size_t)i * BYTES, d, BYTES);
    }
    c->gpu->stream_sync(c->gpu, c->compute, &(ds41_error){0});
    int good = 0;
    for (int i = 0; i < N; i++)
        good += got[(size_t)i * BYTES] == i + 1 && got[(size_t)i * BYTES + BYTES - 1] == i + 1;
    TAP_CHECK(good == N,
              "metadata: %d of %d copies queued back to back (the ring wrapped) read what was shipped", good,
              N);
    /* One op's metadata across a growth of the ring: the bytes taken before
     * it stay valid until the stream has run the op. */
    uint8_t *big = malloc(1 << 20), small[64], got_small[64], *got_big = malloc(1 << 20);
    memset(small, 0x42, sizeof small);
    memset(big, 0x17, 1 << 20);
    void *ds = c->meta(c, small, sizeof small), *db = c->meta(c, big, 1 << 20);
    c->gpu->d2h(c->gpu, c->compute, got_small, ds, sizeof small);
    c->gpu->d2h(c->gpu, c->compute, got_big, db, 1 << 20);
    c->gpu->stream_sync(c->gpu, c->compute, &(ds41_error){0});
    TAP_CHECK(got_small[0] == 0x42 && got_small[63] == 0x42 && got_big[0] == 0x17 &&
                  got_big[(1 << 20) - 1] == 0x17,
              "metadata: bytes taken before the ring grew stay valid for the op");
    for (int i = 0; i < 64; i++) c->meta(c, big, 60000); /* round the grown ring: the old buffers go */
    c->gpu->stream_sync(c->gpu, c->compute, &(ds41_error){0});
    free(big);
    free(got_big);
    void *s1 = c->scratch(c, 1000), *s2 = c->scratch(c, 1000);
    TAP_CHECK(s1 != s2 && ds41_gpu_fake_is_device(c->gpu, s1, 1000) &&
                  ds41_gpu_fake_is_device(c->gpu, s2, 1000),
              "scratch: two takes for one op are distinct device bytes");
    free(src);
    free(got);
    ds41_backend_free(be);
}

/* Placement through the mapping (a file system without O_DIRECT takes this
 * path): the stats say so, and the logits stay the reference's. */
static void mapped_fallback(const char *dir) {
    ds41_error err = {0};
    ds41_engine_opts ro = {.reference = true};
    ds41_engine_opts co = {.backend = fake_backend(13, true)};
    if (co.backend) ds41_backend_cuda_set_buffered(co.backend, true);
    ds41_engine *ref = ds41_engine_load(dir, &ro, &err);
    ds41_engine *cu = co.backend ? ds41_engine_load(dir, &co, &err) : NULL;
    if (TAP_CHECK(ref && cu, "buffered placement: engines load (%s)", err.msg)) {
        ds41_cuda_mem_stats ms;
        ds41_backend_cuda_mem_stats(ds41_engine_backend(cu), &ms);
        TAP_CHECK(ms.placed_direct_bytes == 0 && ms.placed_mapped_bytes > 0,
                  "buffered placement: every placed byte came from the mapping (%llu bytes)",
                  (unsigned long long)ms.placed_mapped_bytes);
        const size_t V = (size_t)ds41_engine_config(ref)->vocab_size, n = 9;
        int32_t prompt[9];
        for (size_t i = 0; i < n; i++) prompt[i] = rnd((int64_t)V);
        float *a = calloc((n + STEPS) * V, sizeof *a), *b = calloc((n + STEPS) * V, sizeof *b);
        TAP_CHECK(run(ref, prompt, n, n, a) == 0 && run(cu, prompt, n, 4, b) == 0 &&
                      memcmp(a, b, (n + STEPS) * V * sizeof *a) == 0,
                  "buffered placement: logits bit-identical to the reference");
        free(a);
        free(b);
    }
    ds41_engine_free(ref);
    ds41_engine_free(cu);
}

/* be->mem's ordering (engine/backend/memory.h): upload returns when the
 * source may be reused, download when the bytes are there, copies are
 * ordered with both; each allocation counted under its memory's kind. */
static void memory_order(void) {
    ds41_backend *be = fake_backend(9, true);
    if (!be) return;
    const ds41_memory *m = be->mem, *pm = ds41_backend_cuda_memory(be, DS41_CUDA_MEM_POOL);
    enum { N = 3000 };
    uint8_t src[N], out[N], want[N];
    for (int i = 0; i < N; i++) src[i] = want[i] = (uint8_t)(i * 7 + 1);
    uint8_t *a = m->alloc(m, N), *b = pm->alloc(pm, N), *c = m->alloc(m, 2 * N);
    m->upload(m, a, src, N);
    memset(src, 0, N); /* reused right after the call */
    m->copy(m, b, a, N);
    m->copy_2d(m, c, 2 * 100, b, 100, 100, N / 100);
    m->download(m, out, b, N);
    TAP_CHECK(memcmp(out, want, N) == 0,
              "memory: upload, copy, download in order; the source reusable on return");
    memset(out, 0, N);
    m->download(m, out, c + 200, 100);
    TAP_CHECK(memcmp(out, want + 100, 100) == 0, "memory: copy_2d moves rows between pitches");
    ds41_cuda_mem_stats ms;
    ds41_backend_cuda_mem_stats(be, &ms);
    TAP_CHECK(ms.pool_bytes == 3072 && ms.other_bytes == 3072 + 6144,
              "memory: allocations counted by the memory they came from (pool %llu, other %llu)",
              (unsigned long long)ms.pool_bytes, (unsigned long long)ms.other_bytes);
    m->copy(m, c, a, N); /* queued; the free waits for it */
    m->free(m, a, N);
    pm->free(pm, b, N);
    m->free(m, c, 2 * N);
    ds41_backend_cuda_mem_stats(be, &ms);
    TAP_CHECK(ms.pool_bytes == 0 && ms.other_bytes == 0, "memory: frees counted");
    ds41_backend_free(be);
}

static int make(const char *root, const char *preset, uint64_t seed, char *dir, size_t cap) {
    ds41_error err = {0};
    snprintf(dir, cap, "%s/%s", root, preset);
    ds41_model_gen_opts o = {.preset = preset, .seed = seed};
    if (ds41_model_generate(dir, &o, NULL, &err) != 0) {
        TAP_NOTE("generate %s: %s", preset, err.msg);
        return -1;
    }
    return 0;
}

/* ------------------------------------- the emulated ops' pointer check */

/* swiglu of the emulated table (cuda/emu_misc.c) on 4 values, in a child:
 * the exit status, or 128 + the signal that ended it. */
static int swiglu_child(ds41_backend *be, const float *g, const float *u, float *out) {
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        be->ops.swiglu(&be->ops, g, u, 1, 4, 0.0f, NULL, out);
        ds41_cuda_emu_enter(ds41_backend_cuda_ctx(be));
        _exit(0);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid) return -1;
    return WIFSIGNALED(st) ? 128 + WTERMSIG(st) : WEXITSTATUS(st);
}

/* The host emulation of the kernels (not the wrapped reference table of the
 * tests above) refuses a host pointer: on a GPU it would fault. */
static void emulated_pointer_check(void) {
    ds41_error err = {0};
    const ds41_cuda_opts o = {.emulated = true};
    ds41_backend *be = ds41_backend_cuda_new(&o, &err);
    if (!TAP_CHECK(be != NULL, "the emulated CUDA backend opens (%s)", be ? "" : err.msg)) return;
    float *g = be->mem->alloc(be->mem, 3 * 4 * sizeof(float)), host[4] = {0};
    const int ok = g ? swiglu_child(be, g, g + 4, g + 8) : -1;
    const int bad = g ? swiglu_child(be, g, g + 4, host) : -1;
    TAP_CHECK(ok == 0 && bad == 128 + SIGABRT,
              "emulated ops: device pointers run (status %d), a host output pointer aborts (status %d)", ok,
              bad);
    be->mem->free(be->mem, g, 3 * 4 * sizeof(float));
    ds41_backend_free(be);
}

int main(void) {
    static char root[3000], dir[3100];

    emulated_pointer_check();

    meta_ring();
    memory_order();
    placement_release();
    /* Under the build tree: a real file system, where placement reads the
     * shards with O_DIRECT (/tmp is often tmpfs, which refuses it); the
     * stats note which path it took. */
    if (!tmpdir_make(root, sizeof root, "DS41_BUILD_DIR", "ds41-test-cuda-backend-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    if (make(root, "tiny", 31, dir, sizeof dir) == 0) {
        placement_checks(dir, "tiny");
        forward_checks(dir, "tiny", 23);
        mapped_fallback(dir);
    }
    if (make(root, "long", 32, dir, sizeof dir) == 0) {
        placement_checks(dir, "long");
        forward_checks(dir, "long", 40);
    }
    tmpdir_remove(root);
    return tap_done();
}
