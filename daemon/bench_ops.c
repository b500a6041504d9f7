#include "daemon/bench_ops.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    OP_LINEAR_FP8,
    OP_LINEAR_FP4,
    OP_LINEAR_BF16,
    OP_LINEAR_BATCH,
    OP_RMSNORM,
    OP_HC_MIX,
    OP_HC_PRE,
    OP_HC_POST,
    OP_ROPE_TABLE,
    OP_ROPE,
    OP_ACT_QUANT_FP8,
    OP_INDEX_QUERY,
    OP_KV_PACK,
    OP_COMPRESS_POOL,
    OP_INDEX_SCORES,
    OP_INDEX_BLOCKS,
    OP_INDEX_TOPK,
    OP_SPARSE_ATTN,
    OP_ATTEND,
    OP_SWIGLU,
    OP_MOE_COMBINE,
    OP_ROUTER,
    OP_ENGRAM_MIX,
    OP_EMBED,
    OP_GATHER_ROWS,
    OP_FP8_ROWS,
    OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
    "linear_fp8",   "linear_fp4",   "linear_bf16", "experts",     "rmsnorm",     "hc_mix",  "hc_pre",
    "hc_post",      "rope_table",   "rope",        "act_quant",   "index_query", "kv_pack", "compress_pool",
    "index_scores", "index_blocks", "index_topk",  "sparse_attn", "attend",      "swiglu",  "moe_combine",
    "router",       "engram_mix",   "embed",       "gather_rows", "fp8_rows",
};

struct ds41_op_profile {
    ds41_ops inner; /* the backend's own table */
    int n_layers;
    int slot;     /* 2 * block + sub-layer, or 2 * n_layers: outside the blocks */
    uint64_t *ns; /* [(2 * n_layers + 1) * OP_COUNT] */
};

static ds41_op_profile *prof;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void charge(int op, uint64_t t0) {
    const int s = prof->slot < 2 * prof->n_layers ? prof->slot : 2 * prof->n_layers;
    prof->ns[(size_t)s * OP_COUNT + (size_t)op] += now_ns() - t0;
}

#define TIMED(op, call)                                                                                      \
    do {                                                                                                     \
        const uint64_t t0_ = now_ns();                                                                       \
        call;                                                                                                \
        charge(op, t0_);                                                                                     \
    } while (0)

static void w_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                     ds41_linear_out out) {
    (void)self;
    const int op = w->kind == DS41_LINEAR_FP8   ? OP_LINEAR_FP8
                   : w->kind == DS41_LINEAR_FP4 ? OP_LINEAR_FP4
                                                : OP_LINEAR_BF16;
    TIMED(op, prof->inner.linear(&prof->inner, w, x, M, y, out));
}
static void w_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                           const float *const *xs, const size_t *Ms, float *const *ys, ds41_linear_out out) {
    (void)self;
    TIMED(OP_LINEAR_BATCH, prof->inner.linear_batch(&prof->inner, n, ws, xs, Ms, ys, out));
}
static void w_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n, float eps,
                      float *y) {
    (void)self;
    TIMED(OP_RMSNORM, prof->inner.rmsnorm(&prof->inner, w, x, M, n, eps, y));
}
static void w_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,
                     const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters, float hc_eps,
                     float *pre, float *post, float *comb) {
    (void)self;
    TIMED(OP_HC_MIX, prof->inner.hc_mix(&prof->inner, fn, scale, base, h, M, hc, dim, norm_eps, iters, hc_eps,
                                        pre, post, comb));
}
static void w_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim,
                     float *out) {
    (void)self;
    TIMED(OP_HC_PRE, prof->inner.hc_pre(&prof->inner, h, pre, M, hc, dim, out));
}
/* A sub-layer ends with its hc_post: the next op belongs to the next one. */
static void w_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,
                      const float *comb, size_t M, int hc, size_t dim, float *out) {
    (void)self;
    TIMED(OP_HC_POST, prof->inner.hc_post(&prof->inner, o, h, post, comb, M, hc, dim, out));
    if (prof->slot < 2 * prof->n_layers) prof->slot++;
}
static void w_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos, size_t M,
                         float *cs) {
    (void)self;
    TIMED(OP_ROPE_TABLE, prof->inner.rope_table(&prof->inner, freqs, n_pairs, pos, M, cs));
}
static void w_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                   size_t head_stride, int n_pairs, const float *cs, int inverse) {
    (void)self;
    TIMED(OP_ROPE,
          prof->inner.rope(&prof->inner, x, M, n_heads, row_stride, head_stride, n_pairs, cs, inverse));
}
static void w_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                            size_t out_stride) {
    (void)self;
    TIMED(OP_ACT_QUANT_FP8, prof->inner.act_quant_fp8(&prof->inner, x, M, n, out, out_stride));
}
static void w_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                          float scale) {
    (void)self;
    TIMED(OP_INDEX_QUERY, prof->inner.index_query(&prof->inner, q, qn, w, wn, M, scale));
}
static void w_kv_pack(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent,
                      const float *key, size_t n, uint8_t *out) {
    (void)self;
    TIMED(OP_KV_PACK, prof->inner.kv_pack(&prof->inner, layout, latent, key, n, out));
}
static void w_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,
                            size_t hd, float *pooled) {
    (void)self;
    TIMED(OP_COMPRESS_POOL, prof->inner.compress_pool(&prof->inner, kv, score, n, ratio, hd, pooled));
}
static void w_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                           int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    (void)self;
    TIMED(OP_INDEX_SCORES,
          prof->inner.index_scores(&prof->inner, q, w, M, n_heads, dim, keys, score, score_stride));
}
static void w_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                           const uint32_t *reach, size_t M, size_t block, size_t n_take, float *bscore,
                           size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    (void)self;
    TIMED(OP_INDEX_BLOCKS, prof->inner.index_blocks(&prof->inner, score, score_stride, reach, M, block,
                                                    n_take, bscore, bscore_stride, allow, allow_stride));
}
static void w_index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                         size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                         int32_t *sel, uint32_t *count) {
    (void)self;
    TIMED(OP_INDEX_TOPK, prof->inner.index_topk(&prof->inner, score, score_stride, reach, M, allow,
                                                allow_stride, block, k, sel, count));
}
static void w_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim, const float *sink,
                          float scale, const ds41_attn_rows *rows, float *out) {
    (void)self;
    TIMED(OP_SPARSE_ATTN,
          prof->inner.sparse_attn(&prof->inner, q, n_heads, head_dim, sink, scale, rows, out));
}
static void w_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                     const float *sink, float scale, const ds41_attn_step *step, float *out) {
    (void)self;
    TIMED(OP_ATTEND, prof->inner.attend(&prof->inner, q, M, n_heads, head_dim, sink, scale, step, out));
}
static void w_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n, float limit,
                     const float *route, float *out) {
    (void)self;
    TIMED(OP_SWIGLU, prof->inner.swiglu(&prof->inner, g, u, M, n, limit, route, out));
}
static void w_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                          const float *shared, size_t M, size_t D, float *out) {
    (void)self;
    TIMED(OP_MOE_COMBINE, prof->inner.moe_combine(&prof->inner, oe, slot, k, shared, M, D, out));
}
static void w_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                     float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection) {
    (void)self;
    TIMED(OP_ROUTER, prof->inner.router(&prof->inner, logits, bias, M, E, k, gate_temp, route_scale, sel,
                                        weight, selection));
}
static void w_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M, int hc,
                         size_t dim, float eps, float dim_scale) {
    (void)self;
    TIMED(OP_ENGRAM_MIX, prof->inner.engram_mix(&prof->inner, h, kv, wqk, M, hc, dim, eps, dim_scale));
}
/* A forward pass starts with the embedding (charged outside the blocks). */
static void w_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,
                    size_t dim, float *out) {
    (void)self;
    prof->slot = 2 * prof->n_layers;
    TIMED(OP_EMBED, prof->inner.embed(&prof->inner, table, ids, M, hc, dim, out));
    prof->slot = 0;
}
static void w_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,
                          const uint32_t *idx, size_t n, size_t row_bytes) {
    (void)self;
    TIMED(OP_GATHER_ROWS, prof->inner.gather_rows(&prof->inner, dst, src, src_stride, idx, n, row_bytes));
}
static void w_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows,
                       size_t n, size_t cols, float *out) {
    (void)self;
    TIMED(OP_FP8_ROWS, prof->inner.fp8_rows(&prof->inner, q, scale, rows, n, cols, out));
}

static size_t n_slots(const ds41_op_profile *p) {
    return (size_t)(2 * p->n_layers + 1);
}

ds41_op_profile *ds41_op_profile_install(ds41_backend *be, int n_layers) {
    if (prof || n_layers <= 0) return NULL;
    ds41_op_profile *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_layers = n_layers;
    p->slot = 2 * n_layers;
    p->ns = calloc(n_slots(p) * OP_COUNT, sizeof *p->ns);
    if (!p->ns) {
        free(p);
        return NULL;
    }
    p->inner = be->ops;
    /* Ops this file does not know (added later) stay as they are: their time
     * shows as time between ops. */
#define WRAP(f)                                                                                              \
    if (be->ops.f) be->ops.f = w_##f
    WRAP(linear);
    WRAP(linear_batch);
    WRAP(rmsnorm);
    WRAP(hc_mix);
    WRAP(hc_pre);
    WRAP(hc_post);
    WRAP(rope_table);
    WRAP(rope);
    WRAP(act_quant_fp8);
    WRAP(index_query);
    WRAP(kv_pack);
    WRAP(compress_pool);
    WRAP(index_scores);
    WRAP(index_blocks);
    WRAP(index_topk);
    WRAP(sparse_attn);
    WRAP(attend);
    WRAP(swiglu);
    WRAP(moe_combine);
    WRAP(router);
    WRAP(engram_mix);
    WRAP(embed);
    WRAP(gather_rows);
    WRAP(fp8_rows);
#undef WRAP
    prof = p;
    return p;
}

void ds41_op_profile_reset(ds41_op_profile *p) {
    memset(p->ns, 0, n_slots(p) * OP_COUNT * sizeof *p->ns);
}

ds41_op_profile *ds41_op_profile_snapshot(const ds41_op_profile *p) {
    ds41_op_profile *s = malloc(sizeof *s);
    if (!s) return NULL;
    *s = *p;
    s->ns = malloc(n_slots(p) * OP_COUNT * sizeof *s->ns);
    if (!s->ns) {
        free(s);
        return NULL;
    }
    memcpy(s->ns, p->ns, n_slots(p) * OP_COUNT * sizeof *s->ns);
    return s;
}

void ds41_op_profile_free(ds41_op_profile *p) {
    if (!p) return;
    if (prof == p) prof = NULL;
    free(p->ns);
    free(p);
}

static double slot_total(const ds41_op_profile *p, size_t s) {
    uint64_t t = 0;
    for (int op = 0; op < OP_COUNT; op++) t += p->ns[s * OP_COUNT + (size_t)op];
    return (double)t * 1e-9;
}

static double all_total(const ds41_op_profile *p) {
    double t = 0;
    for (size_t s = 0; s < n_slots(p); s++) t += slot_total(p, s);
    return t;
}

/* The slot's ops in decreasing time, as "name ms, ...". */
static void slot_text(const ds41_op_profile *p, size_t s, double per, FILE *f) {
    int order[OP_COUNT], n = 0;
    for (int op = 0; op < OP_COUNT; op++) /* what would print as 0.00 is left out */
        if ((double)p->ns[s * OP_COUNT + (size_t)op] * 1e-6 / per >= 0.005) order[n++] = op;
    for (int i = 1; i < n; i++)
        for (int j = i;
             j > 0 && p->ns[s * OP_COUNT + (size_t)order[j]] > p->ns[s * OP_COUNT + (size_t)order[j - 1]];
             j--) {
            const int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    for (int i = 0; i < n; i++)
        fprintf(f, "%s%s %.2f", i ? ", " : "", op_names[order[i]],
                (double)p->ns[s * OP_COUNT + (size_t)order[i]] * 1e-6 / per);
}

void ds41_op_profile_print_text(const ds41_op_profile *p, FILE *f, const char *phase, double seconds,
                                size_t steps) {
    const double per = steps ? (double)steps : 1.0, ops = all_total(p);
    fprintf(f,
            "ops %-9s %.2f ms/step: ops %.2f ms, between ops %.2f ms (per block: attention | FFN, ms/step by "
            "op)\n",
            phase, 1e3 * seconds / per, 1e3 * ops / per, 1e3 * (seconds - ops) / per);
    for (int L = 0; L < p->n_layers; L++) {
        fprintf(f, "  block %-3d %7.2f | %7.2f  attn: ", L, 1e3 * slot_total(p, (size_t)(2 * L)) / per,
                1e3 * slot_total(p, (size_t)(2 * L + 1)) / per);
        slot_text(p, (size_t)(2 * L), per, f);
        fprintf(f, "; ffn: ");
        slot_text(p, (size_t)(2 * L + 1), per, f);
        fputc('\n', f);
    }
    fprintf(f, "  head      %7.2f            ", 1e3 * slot_total(p, n_slots(p) - 1) / per);
    slot_text(p, n_slots(p) - 1, per, f);
    fputc('\n', f);
}

static void slot_json(const ds41_op_profile *p, size_t s, double per, FILE *f) {
    fputc('{', f);
    int first = 1;
    for (int op = 0; op < OP_COUNT; op++) {
        const uint64_t v = p->ns[s * OP_COUNT + (size_t)op];
        if (!v) continue;
        fprintf(f, "%s\"%s\":%.9f", first ? "" : ",", op_names[op], (double)v * 1e-9 / per);
        first = 0;
    }
    fputc('}', f);
}

void ds41_op_profile_print_json(const ds41_op_profile *p, FILE *f, const char *phase, double seconds,
                                size_t steps) {
    const double per = steps ? (double)steps : 1.0;
    fprintf(f,
            "{\"phase\":\"%s\",\"seconds_per_step\":%.9f,\"between_ops_seconds_per_step\":%.9f,\"blocks\":[",
            phase, seconds / per, (seconds - all_total(p)) / per);
    for (int L = 0; L < p->n_layers; L++) {
        fprintf(f, "%s{\"block\":%d,\"attn\":", L ? "," : "", L);
        slot_json(p, (size_t)(2 * L), per, f);
        fprintf(f, ",\"ffn\":");
        slot_json(p, (size_t)(2 * L + 1), per, f);
        fputc('}', f);
    }
    fprintf(f, "],\"head\":");
    slot_json(p, n_slots(p) - 1, per, f);
    fputc('}', f);
}
