#include "engine/model/weights.h"

#include "engine/model/quant.h"
#include "engine/model/tensor_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct binder {
    ds41_weights *w;
    const ds41_checkpoint *ck;
    ds41_error *err;
    int failed;
    char prefix[48];
} binder;

static void *own(binder *b, size_t bytes) {
    ds41_weights *w = b->w;
    if (w->n_owned == w->cap_owned) {
        size_t cap = w->cap_owned ? w->cap_owned * 2 : 16;
        void **o = realloc(w->owned, cap * sizeof *o);
        if (!o) return NULL;
        w->owned = o;
        w->cap_owned = cap;
    }
    void *p = malloc(bytes ? bytes : 1);
    if (p) w->owned[w->n_owned++] = p;
    return p;
}

/* The checked tensor PREFIX+suffix (it was validated against the plan). */
static const ds41_tensor *get(binder *b, const char *suffix) {
    if (b->failed) return NULL;
    char name[DS41_PLAN_NAME_MAX + 16];
    snprintf(name, sizeof name, "%s%s", b->prefix, suffix);
    const ds41_tensor *t = ds41_checkpoint_find(b->ck, name);
    if (!t || (t->nbytes > 0 && !t->data)) {
        b->failed = ds41_fail(b->err, "weights: tensor '%s' is not in the checkpoint", name);
        return NULL;
    }
    return t;
}

/* In-place pointer when aligned to `align`, else an aligned copy. */
static const void *aligned_data(binder *b, const ds41_tensor *t, size_t align) {
    if (!t) return NULL;
    if (((uintptr_t)t->data % align) == 0) return t->data;
    void *p = own(b, t->nbytes);
    if (!p) {
        b->failed = ds41_fail(b->err, "weights: out of memory copying misaligned tensor '%s'", t->name);
        return NULL;
    }
    memcpy(p, t->data, t->nbytes);
    b->w->copied_bytes += t->nbytes;
    return p;
}

static const uint16_t *bf16_tensor(binder *b, const char *suffix) {
    return aligned_data(b, get(b, suffix), sizeof(uint16_t));
}

static const float *f32_tensor(binder *b, const char *suffix) {
    return aligned_data(b, get(b, suffix), sizeof(float));
}

static void bind_bf16_linear(binder *b, ds41_linear *l, const char *suffix) {
    const ds41_tensor *t = get(b, suffix);
    if (!t) return;
    l->kind = DS41_LINEAR_BF16;
    l->n = t->shape[0];
    l->k = t->shape[1];
    l->bf16 = aligned_data(b, t, sizeof(uint16_t));
}

/* FP8 or FP4 linear NAME.weight + NAME.scale (logical k from the scale for
 * FP4: the weight holds k/2 bytes per row). */
static void bind_q_linear(binder *b, ds41_linear *l, ds41_weight_dtype dt, int64_t k, const char *name) {
    char s[96];
    snprintf(s, sizeof s, "%s.weight", name);
    const ds41_tensor *wt = get(b, s);
    snprintf(s, sizeof s, "%s.scale", name);
    const ds41_tensor *st = get(b, s);
    if (!wt || !st) return;
    l->kind = dt == DS41_WEIGHT_FP4 ? DS41_LINEAR_FP4 : DS41_LINEAR_FP8;
    l->n = wt->shape[0];
    l->k = k;
    l->q = wt->data;
    l->scale = st->data;
    l->scale_cols = st->shape[1];
}

/* wo_a as the reference's conversion leaves it: bf16 [n][k]. */
static void bind_wo_a(binder *b, ds41_linear *l, int64_t k) {
    const ds41_tensor *wt = get(b, "attn.wo_a.weight");
    const ds41_tensor *st = get(b, "attn.wo_a.scale");
    if (!wt || !st) return;
    const int64_t n = wt->shape[0];
    uint16_t *out = own(b, (size_t)n * (size_t)k * sizeof *out);
    float *row = malloc((size_t)k * sizeof *row);
    if (!out || !row) {
        free(row);
        b->failed = ds41_fail(b->err, "weights: out of memory dequantizing '%s'", wt->name);
        return;
    }
    const uint8_t *q = wt->data;
    const uint8_t *sc = st->data;
    const int64_t sc_cols = st->shape[1];
    for (int64_t i = 0; i < n; i++) {
        /* One row at a time through the codec: W = e4m3 * 2^(s-127), exact. */
        ds41_dequant_fp8_weight(q + (size_t)i * (size_t)k, sc + (size_t)(i / 32) * (size_t)sc_cols, 1, (size_t)k,
                                row);
        for (int64_t j = 0; j < k; j++) out[(size_t)i * (size_t)k + (size_t)j] = ds41_bf16_bits(row[j]);
    }
    free(row);
    l->kind = DS41_LINEAR_BF16;
    l->n = n;
    l->k = k;
    l->bf16 = out;
    b->w->copied_bytes += (uint64_t)n * (uint64_t)k * sizeof *out;
}

static void bind_layer(binder *b, const ds41_model_config *cfg, const ds41_layer_role *role, ds41_layer_weights *lw) {
    const int64_t D = cfg->dim, H = cfg->n_heads, hd = cfg->head_dim;
    lw->present = 1;
    lw->attn_norm = bf16_tensor(b, "attn_norm.weight");
    lw->ffn_norm = bf16_tensor(b, "ffn_norm.weight");
    lw->q_norm = bf16_tensor(b, "attn.q_norm.weight");
    lw->kv_norm = bf16_tensor(b, "attn.kv_norm.weight");
    lw->attn_sink = f32_tensor(b, "attn.attn_sink");
    bind_q_linear(b, &lw->wq_a, cfg->dtype, D, "attn.wq_a");
    bind_q_linear(b, &lw->wq_b, cfg->dtype, cfg->q_lora_rank, "attn.wq_b");
    bind_q_linear(b, &lw->wkv, cfg->dtype, D, "attn.wkv");
    bind_wo_a(b, &lw->wo_a, H * hd / cfg->o_groups);
    bind_q_linear(b, &lw->wo_b, cfg->dtype, cfg->o_groups * cfg->o_lora_rank, "attn.wo_b");
    if (role->kv_source) {
        bind_bf16_linear(b, &lw->cmp_wkv, "attn.compressor.wkv.weight");
        if (role->has_wgate) bind_bf16_linear(b, &lw->cmp_wgate, "attn.compressor.wgate.weight");
        lw->cmp_norm = bf16_tensor(b, "attn.compressor.norm.weight");
        bind_bf16_linear(b, &lw->idx_wk, "attn.indexer.wk.weight");
        lw->idx_k_norm = bf16_tensor(b, "attn.indexer.k_norm.weight");
    }
    if (role->index_source) {
        bind_q_linear(b, &lw->idx_wq_b, cfg->dtype, cfg->q_lora_rank, "attn.indexer.wq_b");
        bind_bf16_linear(b, &lw->idx_weights_proj, "attn.indexer.weights_proj.weight");
    }
    lw->hc_attn_fn = f32_tensor(b, "hc_attn_fn");
    lw->hc_ffn_fn = f32_tensor(b, "hc_ffn_fn");
    lw->hc_attn_base = f32_tensor(b, "hc_attn_base");
    lw->hc_ffn_base = f32_tensor(b, "hc_ffn_base");
    lw->hc_attn_scale = f32_tensor(b, "hc_attn_scale");
    lw->hc_ffn_scale = f32_tensor(b, "hc_ffn_scale");

    bind_bf16_linear(b, &lw->gate, "ffn.gate.weight");
    lw->gate_bias = f32_tensor(b, "ffn.gate.bias");
    lw->gate_bias_vl = f32_tensor(b, "ffn.gate.bias_vl");
    const int64_t E = role->n_experts;
    lw->n_experts = E;
    lw->w1 = own(b, (size_t)E * sizeof *lw->w1);
    lw->w2 = own(b, (size_t)E * sizeof *lw->w2);
    lw->w3 = own(b, (size_t)E * sizeof *lw->w3);
    if (!lw->w1 || !lw->w2 || !lw->w3) {
        if (!b->failed) b->failed = ds41_fail(b->err, "weights: out of memory");
        return;
    }
    memset(lw->w1, 0, (size_t)E * sizeof *lw->w1);
    memset(lw->w2, 0, (size_t)E * sizeof *lw->w2);
    memset(lw->w3, 0, (size_t)E * sizeof *lw->w3);
    char name[64];
    for (int64_t e = 0; e < E && !b->failed; e++) {
        snprintf(name, sizeof name, "ffn.experts.%lld.w1", (long long)e);
        bind_q_linear(b, &lw->w1[e], cfg->expert_dtype, D, name);
        snprintf(name, sizeof name, "ffn.experts.%lld.w2", (long long)e);
        bind_q_linear(b, &lw->w2[e], cfg->expert_dtype, cfg->moe_inter_dim, name);
        snprintf(name, sizeof name, "ffn.experts.%lld.w3", (long long)e);
        bind_q_linear(b, &lw->w3[e], cfg->expert_dtype, D, name);
    }
    const int64_t sinter = cfg->moe_inter_dim * cfg->n_shared_experts;
    bind_q_linear(b, &lw->sh_w1, cfg->dtype, D, "ffn.shared_experts.w1");
    bind_q_linear(b, &lw->sh_w2, cfg->dtype, sinter, "ffn.shared_experts.w2");
    bind_q_linear(b, &lw->sh_w3, cfg->dtype, D, "ffn.shared_experts.w3");

    if (role->engram_slot >= 0) {
        const ds41_tensor *t = get(b, "engram.embed.weight");
        const ds41_tensor *s = get(b, "engram.embed.scale");
        if (t && s) {
            lw->eng_table = t->data;
            lw->eng_table_scale = s->data;
            lw->eng_rows = t->shape[0];
        }
        const int64_t cols = (cfg->engram_max_ngram_size - 1) * cfg->engram_n_heads;
        bind_q_linear(b, &lw->eng_wkv, cfg->dtype, cols * cfg->engram_head_dim, "engram.wkv");
        lw->eng_q = bf16_tensor(b, "engram.q_weight");
        lw->eng_k = bf16_tensor(b, "engram.k_weight");
    }
}

typedef struct check_ctx {
    ds41_error *err;
    int failed;
} check_ctx;

static void dims(char *buf, size_t len, int ndim, const int64_t *shape) {
    size_t off = 0;
    off += (size_t)snprintf(buf + off, len - off, "[");
    for (int i = 0; i < ndim && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (off < len) snprintf(buf + off, len - off, "]");
}

static void on_problem(void *ctxp, ds41_check_problem problem, const char *name, const ds41_planned_tensor *p,
                       const ds41_tensor *t) {
    check_ctx *ctx = ctxp;
    if (ctx->failed || problem == DS41_CHECK_UNEXPECTED) return;
    char want[96], got[96];
    switch (problem) {
    case DS41_CHECK_MISSING:
        dims(want, sizeof want, p->ndim, p->shape);
        ctx->failed = ds41_fail(ctx->err, "weights: tensor '%s' (%s %s) is missing from the checkpoint", name,
                                ds41_dtype_name(p->dtype), want);
        break;
    case DS41_CHECK_WRONG_DTYPE:
        ctx->failed = ds41_fail(ctx->err, "weights: tensor '%s' has dtype %s, expected %s", name,
                                ds41_dtype_name(t->dtype), ds41_dtype_name(p->dtype));
        break;
    case DS41_CHECK_WRONG_SHAPE:
        dims(want, sizeof want, p->ndim, p->shape);
        dims(got, sizeof got, t->ndim, t->shape);
        ctx->failed = ds41_fail(ctx->err, "weights: tensor '%s' has shape %s, expected %s", name, got, want);
        break;
    default:
        break;
    }
}

int ds41_weights_bind(ds41_weights *w, const ds41_model_config *cfg, const ds41_checkpoint *ckpt, ds41_error *err) {
    return ds41_weights_bind_progress(w, cfg, ckpt, NULL, NULL, err);
}

/* What binding has done so far, by plan group: [0] the global tensors (layer -1), [1 + l] layer l. */
typedef struct bind_progress {
    ds41_weights_progress_fn fn;
    void *ctx;
    uint64_t *tensors, *bytes; /* [n_roles + 1] */
    uint64_t tensors_total, bytes_total, tensors_done, bytes_done;
} bind_progress;

static void progress_group(bind_progress *p, size_t group) {
    if (!p->fn) return;
    p->tensors_done += p->tensors[group];
    p->bytes_done += p->bytes[group];
    p->fn(p->ctx, p->tensors_done, p->tensors_total, p->bytes_done, p->bytes_total);
}

int ds41_weights_bind_progress(ds41_weights *w, const ds41_model_config *cfg, const ds41_checkpoint *ckpt,
                               ds41_weights_progress_fn fn, void *ctx, ds41_error *err) {
    memset(w, 0, sizeof *w);
    if (!cfg->finalized || !cfg->roles) return ds41_fail(err, "weights: the model config is not finalized");
    ds41_tensor_plan plan;
    if (ds41_tensor_plan_build(cfg, &plan, err) != 0) return -1;
    check_ctx cc = {.err = err};
    ds41_check_counts counts = ds41_tensor_plan_check(&plan, ckpt, on_problem, &cc);
    size_t planned = plan.n;
    bind_progress prog = {.fn = fn, .ctx = ctx};
    if (fn && !cc.failed) {
        prog.tensors = calloc(cfg->n_roles + 1, sizeof *prog.tensors);
        prog.bytes = calloc(cfg->n_roles + 1, sizeof *prog.bytes);
        if (!prog.tensors || !prog.bytes) cc.failed = ds41_fail(err, "weights: out of memory");
        /* A tensor of no layer (globals, vision) counts with the globals. */
        for (size_t i = 0; !cc.failed && i < plan.n; i++) {
            const int l = plan.t[i].layer;
            const size_t g = l >= 0 && (size_t)l < cfg->n_roles ? (size_t)l + 1 : 0;
            prog.tensors[g]++;
            prog.bytes[g] += plan.t[i].nbytes;
            prog.tensors_total++;
            prog.bytes_total += plan.t[i].nbytes;
        }
    }
    ds41_tensor_plan_free(&plan);
    if (cc.failed) {
        free(prog.tensors);
        free(prog.bytes);
        return -1;
    }
    w->n_bound = planned;
    w->n_unplanned = counts.unexpected;

    binder b = {.w = w, .ck = ckpt, .err = err};
    b.prefix[0] = 0;
    w->embed = bf16_tensor(&b, "embed.weight");
    bind_bf16_linear(&b, &w->head, "head.weight");
    w->norm = bf16_tensor(&b, "norm.weight");
    w->n_layers = cfg->n_roles;
    w->layers = calloc(cfg->n_roles ? cfg->n_roles : 1, sizeof *w->layers);
    if (!w->layers) b.failed = ds41_fail(err, "weights: out of memory");
    if (!b.failed) progress_group(&prog, 0);
    for (size_t l = 0; l < cfg->n_roles && !b.failed; l++) {
        const ds41_layer_role *role = &cfg->roles[l];
        if (role->present) {
            if ((int64_t)l < cfg->n_layers)
                snprintf(b.prefix, sizeof b.prefix, "layers.%zu.", l);
            else
                snprintf(b.prefix, sizeof b.prefix, "mtp.%lld.", (long long)((int64_t)l - cfg->n_layers));
            bind_layer(&b, cfg, role, &w->layers[l]);
        }
        if (!b.failed) progress_group(&prog, l + 1);
    }
    if (!b.failed && cfg->dspark_enabled && cfg->n_mtp_layers > 0) {
        snprintf(b.prefix, sizeof b.prefix, "mtp.0.");
        bind_q_linear(&b, &w->mtp_main_proj, DS41_WEIGHT_FP8,
                      cfg->dim * (int64_t)cfg->dspark_target_layer_ids.n, "main_proj");
        w->mtp_main_norm = bf16_tensor(&b, "main_norm.weight");
        snprintf(b.prefix, sizeof b.prefix, "mtp.%lld.", (long long)(cfg->n_mtp_layers - 1));
        w->mtp_norm = bf16_tensor(&b, "norm.weight");
        w->mtp_markov_embed = bf16_tensor(&b, "markov_head.embed.weight");
        bind_bf16_linear(&b, &w->mtp_markov_head, "markov_head.head.weight");
        bind_bf16_linear(&b, &w->mtp_confidence, "confidence_head.proj.weight");
    }
    free(prog.tensors);
    free(prog.bytes);
    if (b.failed) {
        ds41_weights_free(w);
        return -1;
    }
    return 0;
}

void ds41_weights_free(ds41_weights *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_owned; i++) free(w->owned[i]);
    free(w->owned);
    free(w->layers);
    memset(w, 0, sizeof *w);
}
