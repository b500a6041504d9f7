#include "engine/model/tensor_plan.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const kind_names[DS41_KIND_COUNT] = {
    [DS41_KIND_EMBED_HEAD] = "embeddings/head",
    [DS41_KIND_ATTENTION] = "attention",
    [DS41_KIND_HYPER_CONN] = "hyper-connections",
    [DS41_KIND_ROUTER] = "router/ffn norm",
    [DS41_KIND_ROUTED_EXPERTS] = "routed experts",
    [DS41_KIND_SHARED_EXPERTS] = "shared experts",
    [DS41_KIND_ENGRAM_TABLES] = "engram tables",
    [DS41_KIND_ENGRAM_OTHER] = "engram projections",
    [DS41_KIND_DSPARK] = "dspark",
    [DS41_KIND_VISION] = "vision",
};

const char *ds41_tensor_kind_name(ds41_tensor_kind kind) {
    return (unsigned)kind < DS41_KIND_COUNT ? kind_names[kind] : "?";
}

/* The builder carries the plan being filled, the layer/kind context of the
 * tensors being added and the first error (so the add calls stay flat). */
typedef struct builder {
    ds41_tensor_plan *plan;
    ds41_error *err;
    int failed;
    int layer;
    int expert;
    ds41_tensor_kind kind;
    char prefix[48];
} builder;

static uint64_t ceil_div(int64_t a, int64_t b) {
    return (uint64_t)((a + b - 1) / b);
}

static void add(builder *b, ds41_dtype dtype, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Add one tensor; d1 < 0 means a 1-D tensor [d0]. */
static void add(builder *b, ds41_dtype dtype, int64_t d0, int64_t d1, const char *fmt, ...) {
    if (b->failed) return;
    ds41_tensor_plan *p = b->plan;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 1024;
        ds41_planned_tensor *t = realloc(p->t, cap * sizeof *t);
        if (!t) {
            b->failed = ds41_fail(b->err, "tensor plan: out of memory");
            return;
        }
        p->t = t;
        p->cap = cap;
    }
    ds41_planned_tensor *t = &p->t[p->n];
    memset(t, 0, sizeof *t);
    int len = snprintf(t->name, sizeof t->name, "%s", b->prefix);
    va_list ap;
    va_start(ap, fmt);
    int more = vsnprintf(t->name + len, sizeof t->name - (size_t)len, fmt, ap);
    va_end(ap);
    if (len < 0 || more < 0 || (size_t)(len + more) >= sizeof t->name) {
        b->failed = ds41_fail(b->err, "tensor plan: name too long (%s...)", b->prefix);
        return;
    }
    t->dtype = dtype;
    t->ndim = d1 < 0 ? 1 : 2;
    t->shape[0] = d0;
    t->shape[1] = d1 < 0 ? 0 : d1;
    if (d0 <= 0 || (t->ndim == 2 && d1 <= 0)) {
        b->failed = ds41_fail(b->err, "tensor plan: tensor '%s' would have an empty shape", t->name);
        return;
    }
    uint64_t elems = (uint64_t)d0;
    if (t->ndim == 2 && __builtin_mul_overflow(elems, (uint64_t)d1, &elems)) {
        b->failed = ds41_fail(b->err, "tensor plan: tensor '%s' is too large", t->name);
        return;
    }
    if (__builtin_mul_overflow(elems, (uint64_t)ds41_dtype_size(dtype), &t->nbytes)) {
        b->failed = ds41_fail(b->err, "tensor plan: tensor '%s' is too large", t->name);
        return;
    }
    t->kind = b->kind;
    t->layer = b->layer;
    t->expert = b->expert;
    p->n++;
}

/* An FP8 linear [n, k]: e4m3 weight plus one ue8m0 scale per 32x32 block. */
static void add_fp8_linear(builder *b, int64_t n, int64_t k, const char *name) {
    add(b, DS41_F8_E4M3, n, k, "%s.weight", name);
    add(b, DS41_F8_E8M0, (int64_t)ceil_div(n, 32), (int64_t)ceil_div(k, 32), "%s.scale", name);
}

/* An FP4 linear [n, k]: packed e2m1 (two per byte along k) plus a ue8m0
 * scale per row per 32 consecutive k. */
static void add_fp4_linear(builder *b, int64_t n, int64_t k, const char *name) {
    add(b, DS41_I8, n, k / 2, "%s.weight", name);
    add(b, DS41_F8_E8M0, n, k / 32, "%s.scale", name);
}

static void add_linear(builder *b, ds41_weight_dtype dt, int64_t n, int64_t k, const char *name) {
    if (dt == DS41_WEIGHT_FP4)
        add_fp4_linear(b, n, k, name);
    else
        add_fp8_linear(b, n, k, name);
}

/* The tensors every block has (backbone layers and DSpark stages alike). */
static void add_block(builder *b, const ds41_model_config *cfg, const ds41_layer_role *role, bool dspark) {
    const int64_t D = cfg->dim;
    const int64_t H = cfg->n_heads;
    const int64_t hd = cfg->head_dim;
    const int64_t hc = cfg->hc_mult;
    const int64_t mix = (2 + hc) * hc;
    ds41_tensor_kind base_kind = dspark ? DS41_KIND_DSPARK : DS41_KIND_ATTENTION;

    b->kind = base_kind;
    add(b, DS41_BF16, D, -1, "attn_norm.weight");
    add(b, DS41_F32, H, -1, "attn.attn_sink");
    add(b, DS41_BF16, cfg->q_lora_rank, -1, "attn.q_norm.weight");
    add(b, DS41_BF16, hd, -1, "attn.kv_norm.weight");
    add_linear(b, cfg->dtype, cfg->q_lora_rank, D, "attn.wq_a");
    add_linear(b, cfg->dtype, H * hd, cfg->q_lora_rank, "attn.wq_b");
    add_linear(b, cfg->dtype, hd, D, "attn.wkv");
    add_linear(b, cfg->dtype, cfg->o_groups * cfg->o_lora_rank, H * hd / cfg->o_groups, "attn.wo_a");
    add_linear(b, cfg->dtype, D, cfg->o_groups * cfg->o_lora_rank, "attn.wo_b");

    if (role->kv_source) {
        add(b, DS41_BF16, hd, D, "attn.compressor.wkv.weight");
        if (role->has_wgate) add(b, DS41_BF16, hd, D, "attn.compressor.wgate.weight");
        add(b, DS41_BF16, hd, -1, "attn.compressor.norm.weight");
        add(b, DS41_BF16, cfg->index_head_dim, hd, "attn.indexer.wk.weight");
        add(b, DS41_BF16, cfg->index_head_dim, -1, "attn.indexer.k_norm.weight");
    }
    if (role->index_source) {
        add_linear(b, cfg->dtype, cfg->index_n_heads * cfg->index_head_dim, cfg->q_lora_rank,
                   "attn.indexer.wq_b");
        add(b, DS41_BF16, cfg->index_n_heads, D, "attn.indexer.weights_proj.weight");
    }

    b->kind = dspark ? DS41_KIND_DSPARK : DS41_KIND_HYPER_CONN;
    add(b, DS41_F32, mix, hc * D, "hc_attn_fn");
    add(b, DS41_F32, mix, hc * D, "hc_ffn_fn");
    add(b, DS41_F32, mix, -1, "hc_attn_base");
    add(b, DS41_F32, mix, -1, "hc_ffn_base");
    add(b, DS41_F32, 3, -1, "hc_attn_scale");
    add(b, DS41_F32, 3, -1, "hc_ffn_scale");

    const int64_t E = role->n_experts;
    const int64_t inter = cfg->moe_inter_dim;
    b->kind = dspark ? DS41_KIND_DSPARK : DS41_KIND_ROUTER;
    add(b, DS41_BF16, D, -1, "ffn_norm.weight");
    add(b, DS41_BF16, E, D, "ffn.gate.weight");
    add(b, DS41_F32, E, -1, "ffn.gate.bias");
    add(b, DS41_F32, E, -1, "ffn.gate.bias_vl");

    b->kind = dspark ? DS41_KIND_DSPARK : DS41_KIND_ROUTED_EXPERTS;
    char name[64];
    for (int64_t e = 0; e < E && !b->failed; e++) {
        b->expert = (int)e;
        snprintf(name, sizeof name, "ffn.experts.%lld.w1", (long long)e);
        add_linear(b, cfg->expert_dtype, inter, D, name);
        snprintf(name, sizeof name, "ffn.experts.%lld.w2", (long long)e);
        add_linear(b, cfg->expert_dtype, D, inter, name);
        snprintf(name, sizeof name, "ffn.experts.%lld.w3", (long long)e);
        add_linear(b, cfg->expert_dtype, inter, D, name);
    }
    b->expert = -1;

    b->kind = dspark ? DS41_KIND_DSPARK : DS41_KIND_SHARED_EXPERTS;
    const int64_t sinter = inter * cfg->n_shared_experts;
    add_linear(b, cfg->dtype, sinter, D, "ffn.shared_experts.w1");
    add_linear(b, cfg->dtype, D, sinter, "ffn.shared_experts.w2");
    add_linear(b, cfg->dtype, sinter, D, "ffn.shared_experts.w3");

    if (role->engram_slot >= 0) {
        const int64_t rows = cfg->engram_num_embeddings.v[role->engram_slot];
        const int64_t ed = cfg->engram_head_dim;
        const int64_t cols = (cfg->engram_max_ngram_size - 1) * cfg->engram_n_heads;
        b->kind = DS41_KIND_ENGRAM_TABLES;
        add(b, DS41_F8_E4M3, rows, ed, "engram.embed.weight");
        add(b, DS41_F8_E8M0, rows, ed / 32, "engram.embed.scale");
        b->kind = DS41_KIND_ENGRAM_OTHER;
        add_linear(b, cfg->dtype, (hc + 1) * D, cols * ed, "engram.wkv");
        add(b, DS41_BF16, hc, D, "engram.q_weight");
        add(b, DS41_BF16, hc, D, "engram.k_weight");
    }
}

int ds41_tensor_plan_build(const ds41_model_config *cfg, ds41_tensor_plan *plan, ds41_error *err) {
    memset(plan, 0, sizeof *plan);
    if (!cfg->finalized || !cfg->roles) return ds41_fail(err, "tensor plan: the model config is not finalized");
    builder b = {.plan = plan, .err = err, .layer = -1, .expert = -1};
    const int64_t D = cfg->dim;
    const int64_t V = cfg->vocab_size;

    b.kind = DS41_KIND_EMBED_HEAD;
    add(&b, DS41_BF16, V, D, "embed.weight");
    add(&b, DS41_BF16, V, D, "head.weight");
    add(&b, DS41_BF16, D, -1, "norm.weight");
    if (cfg->vision_enabled) {
        b.kind = DS41_KIND_VISION;
        add(&b, DS41_BF16, D, -1, "image_start");
        add(&b, DS41_BF16, D, -1, "image_end");
        add(&b, DS41_BF16, D, -1, "image_newline");
    }

    for (int64_t l = 0; l < cfg->n_layers && !b.failed; l++) {
        b.layer = (int)l;
        snprintf(b.prefix, sizeof b.prefix, "layers.%lld.", (long long)l);
        add_block(&b, cfg, &cfg->roles[l], false);
    }

    if (cfg->dspark_enabled) {
        for (int64_t k = 0; k < cfg->n_mtp_layers && !b.failed; k++) {
            const ds41_layer_role *role = &cfg->roles[cfg->n_layers + k];
            if (!role->present) continue;
            b.layer = (int)(cfg->n_layers + k);
            snprintf(b.prefix, sizeof b.prefix, "mtp.%lld.", (long long)k);
            add_block(&b, cfg, role, true);
            b.kind = DS41_KIND_DSPARK;
            if (k == 0) {
                add_fp8_linear(&b, D, D * (int64_t)cfg->dspark_target_layer_ids.n, "main_proj");
                add(&b, DS41_BF16, D, -1, "main_norm.weight");
            }
            if (k == cfg->n_mtp_layers - 1) {
                const int64_t r = cfg->dspark_markov_rank;
                add(&b, DS41_BF16, D, -1, "norm.weight");
                add(&b, DS41_BF16, V, r, "markov_head.embed.weight");
                add(&b, DS41_BF16, V, r, "markov_head.head.weight");
                add(&b, DS41_BF16, 1, D + r, "confidence_head.proj.weight");
            }
        }
    }

    if (cfg->vision_enabled) {
        const int64_t vd = cfg->vision_dim;
        const int64_t vi = cfg->vision_inter_dim;
        b.kind = DS41_KIND_VISION;
        b.layer = -1;
        for (int64_t blk = 0; blk < cfg->vision_n_layers && !b.failed; blk++) {
            snprintf(b.prefix, sizeof b.prefix, "vision.blocks.%lld.", (long long)blk);
            add(&b, DS41_BF16, 3 * vd, vd, "attn.wqkv.weight");
            add(&b, DS41_BF16, 3 * vd, -1, "attn.wqkv.bias");
            add(&b, DS41_BF16, vd, vd, "attn.wo.weight");
            add(&b, DS41_BF16, vd, -1, "attn.wo.bias");
            add(&b, DS41_BF16, 2 * vi, vd, "mlp.w1.weight");
            add(&b, DS41_BF16, vd, vi, "mlp.w2.weight");
            add(&b, DS41_BF16, vd, -1, "norm1.weight");
            add(&b, DS41_BF16, vd, -1, "norm2.weight");
        }
        b.prefix[0] = 0;
        const int64_t ps = cfg->vision_patch_size;
        const int64_t ds = cfg->vision_downsample_ratio;
        add(&b, DS41_BF16, vd, -1, "vision.norm.weight");
        add(&b, DS41_BF16, vd, 3 * ps * ps, "vision.patch_embed.proj.weight");
        add(&b, DS41_BF16, vd, -1, "vision.patch_embed.proj.bias");
        add(&b, DS41_BF16, D, vd * ds * ds, "aligner.w1.weight");
        add(&b, DS41_BF16, D, -1, "aligner.w1.bias");
        add(&b, DS41_BF16, D, D, "aligner.w2.weight");
        add(&b, DS41_BF16, D, -1, "aligner.w2.bias");
    }

    if (b.failed) {
        ds41_tensor_plan_free(plan);
        return -1;
    }
    return 0;
}

void ds41_tensor_plan_free(ds41_tensor_plan *plan) {
    if (!plan) return;
    free(plan->t);
    memset(plan, 0, sizeof *plan);
}

const ds41_planned_tensor *ds41_tensor_plan_find(const ds41_tensor_plan *plan, const char *name) {
    for (size_t i = 0; i < plan->n; i++)
        if (strcmp(plan->t[i].name, name) == 0) return &plan->t[i];
    return NULL;
}

static bool same_shape(const ds41_planned_tensor *p, const ds41_tensor *t) {
    if (p->ndim != t->ndim) return false;
    for (int i = 0; i < p->ndim; i++)
        if (p->shape[i] != t->shape[i]) return false;
    return true;
}

/* Sort helper: plan indices ordered by tensor name, so the checkpoint (also
 * sorted by name) can be merged against the plan in one pass. */
static int cmp_plan_index(const void *a, const void *b, void *ctx) {
    const ds41_tensor_plan *plan = ctx;
    return strcmp(plan->t[*(const size_t *)a].name, plan->t[*(const size_t *)b].name);
}

ds41_check_counts ds41_tensor_plan_check(const ds41_tensor_plan *plan, const ds41_checkpoint *ckpt,
                                         ds41_check_report_fn report, void *ctx) {
    ds41_check_counts c = {0};
    for (size_t i = 0; i < plan->n; i++) {
        const ds41_planned_tensor *p = &plan->t[i];
        const ds41_tensor *t = ckpt ? ds41_checkpoint_find(ckpt, p->name) : NULL;
        if (!t) {
            c.missing++;
            if (report) report(ctx, DS41_CHECK_MISSING, p->name, p, NULL);
        } else if (t->dtype != p->dtype) {
            c.wrong_dtype++;
            if (report) report(ctx, DS41_CHECK_WRONG_DTYPE, p->name, p, t);
        } else if (!same_shape(p, t)) {
            c.wrong_shape++;
            if (report) report(ctx, DS41_CHECK_WRONG_SHAPE, p->name, p, t);
        }
    }
    if (!ckpt) return c;

    /* Unexpected tensors: merge the name-sorted checkpoint against a
     * name-sorted view of the plan (96k tensors: no quadratic search). */
    size_t *order = malloc((plan->n ? plan->n : 1) * sizeof *order);
    if (!order) return c;
    for (size_t i = 0; i < plan->n; i++) order[i] = i;
    qsort_r(order, plan->n, sizeof *order, cmp_plan_index, (void *)plan);
    size_t j = 0, n = ds41_checkpoint_tensor_count(ckpt);
    for (size_t i = 0; i < n; i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(ckpt, i);
        int cmp = 1;
        while (j < plan->n && (cmp = strcmp(plan->t[order[j]].name, t->name)) < 0) j++;
        if (j >= plan->n || cmp != 0) {
            c.unexpected++;
            if (report) report(ctx, DS41_CHECK_UNEXPECTED, t->name, NULL, t);
        }
    }
    free(order);
    return c;
}
