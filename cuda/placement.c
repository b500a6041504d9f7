/* The weight placement plan (cuda/placement.h). */
#include "cuda/placement.h"

#include <stdlib.h>
#include <string.h>

typedef struct builder {
    ds41_placement *p;
    const ds41_placement_opts *o;
    size_t cap;
    int failed;
    ds41_error *err;
} builder;

static void put(builder *b, const void *host, uint64_t bytes, ds41_arena a, int layer, const char *what,
                bool placed) {
    if (b->failed || bytes == 0) return;
    if (b->p->n == b->cap) {
        const size_t cap = b->cap ? 2 * b->cap : 256;
        ds41_place_entry *ne = realloc(b->p->e, cap * sizeof *ne);
        if (!ne) {
            b->failed = ds41_fail(b->err, "placement: out of memory");
            return;
        }
        b->p->e = ne;
        b->cap = cap;
    }
    b->p->e[b->p->n++] = (ds41_place_entry){.host = host,
                                            .bytes = bytes,
                                            .arena = (uint8_t)a,
                                            .placed = placed,
                                            .layer = (int16_t)layer,
                                            .what = what};
}

static void put_linear(builder *b, const ds41_linear *l, int layer, const char *what, bool placed) {
    const uint64_t n = (uint64_t)l->n, k = (uint64_t)l->k, sc = (uint64_t)l->scale_cols;
    switch (l->kind) {
    case DS41_LINEAR_NONE:
        return;
    case DS41_LINEAR_FP8:
        if (l->q) put(b, l->q, n * k, DS41_ARENA_FP8, layer, what, placed);
        if (l->scale) put(b, l->scale, (n + 31) / 32 * sc, DS41_ARENA_SCALE, layer, what, placed);
        return;
    case DS41_LINEAR_FP4:
        if (l->q) put(b, l->q, n * ((k + 1) / 2), DS41_ARENA_FP4, layer, what, placed);
        if (l->scale) put(b, l->scale, n * sc, DS41_ARENA_SCALE, layer, what, placed);
        return;
    case DS41_LINEAR_BF16:
        if (l->bf16) put(b, l->bf16, n * k * 2, DS41_ARENA_BF16, layer, what, placed);
        return;
    }
}

static void put_vec(builder *b, const void *p, uint64_t n, ds41_arena a, int layer, const char *what) {
    if (p) put(b, p, n * (a == DS41_ARENA_F32 ? 4 : 2), a, layer, what, true);
}

/* Offsets: each arena in entry order, DS41_PLACE_ALIGN apart. */
static void lay_out(ds41_placement *p) {
    memset(p->arena_bytes, 0, sizeof p->arena_bytes);
    p->total_bytes = p->expert_bytes = p->unplaced_bytes = 0;
    p->n_placed = 0;
    for (size_t i = 0; i < p->n; i++) {
        ds41_place_entry *e = &p->e[i];
        if (!e->placed) {
            p->unplaced_bytes += e->bytes;
            continue;
        }
        e->offset = p->arena_bytes[e->arena];
        p->arena_bytes[e->arena] += (e->bytes + DS41_PLACE_ALIGN - 1) / DS41_PLACE_ALIGN * DS41_PLACE_ALIGN;
        p->n_placed++;
        if (e->what && strncmp(e->what, "ffn.experts.", 12) == 0) p->expert_bytes += e->bytes;
    }
    for (int a = 0; a < DS41_ARENA_COUNT; a++) p->total_bytes += p->arena_bytes[a];
}

static int cmp_host(const void *x, const void *y) {
    const ds41_place_entry *a = x, *b = y;
    const uintptr_t u = (uintptr_t)a->host, v = (uintptr_t)b->host;
    if (u != v) return u < v ? -1 : 1;
    return a->bytes < b->bytes ? -1 : a->bytes > b->bytes;
}

int ds41_placement_plan(ds41_placement *p, const ds41_model_config *cfg, const ds41_weights *w,
                        const ds41_placement_opts *opts, ds41_error *err) {
    memset(p, 0, sizeof *p);
    const ds41_placement_opts none = {0};
    builder b = {.p = p, .o = opts ? opts : &none, .err = err};
    const uint64_t D = (uint64_t)cfg->dim, V = (uint64_t)cfg->vocab_size, hc = (uint64_t)cfg->hc_mult;
    const uint64_t mix = (2 + hc) * hc;
    put_vec(&b, w->embed, V * D, DS41_ARENA_BF16, -1, "embed");
    put_linear(&b, &w->head, -1, "head", true);
    put_vec(&b, w->norm, D, DS41_ARENA_BF16, -1, "norm");
    for (size_t l = 0; l < w->n_layers && l < cfg->n_roles; l++) {
        const ds41_layer_weights *lw = &w->layers[l];
        if (!lw->present) continue;
        const int L = (int)l;
        const bool text = (int64_t)l < cfg->n_layers;
        put_vec(&b, lw->attn_norm, D, DS41_ARENA_BF16, L, "attn_norm");
        put_vec(&b, lw->ffn_norm, D, DS41_ARENA_BF16, L, "ffn_norm");
        put_vec(&b, lw->q_norm, (uint64_t)cfg->q_lora_rank, DS41_ARENA_BF16, L, "attn.q_norm");
        put_vec(&b, lw->kv_norm, (uint64_t)cfg->head_dim, DS41_ARENA_BF16, L, "attn.kv_norm");
        put_vec(&b, lw->attn_sink, (uint64_t)cfg->n_heads, DS41_ARENA_F32, L, "attn.attn_sink");
        put_linear(&b, &lw->wq_a, L, "attn.wq_a", true);
        put_linear(&b, &lw->wq_b, L, "attn.wq_b", true);
        put_linear(&b, &lw->wkv, L, "attn.wkv", true);
        put_linear(&b, &lw->wo_a, L, "attn.wo_a", true);
        put_linear(&b, &lw->wo_b, L, "attn.wo_b", true);
        put_linear(&b, &lw->cmp_wkv, L, "attn.compressor.wkv", true);
        put_linear(&b, &lw->cmp_wgate, L, "attn.compressor.wgate", true);
        put_vec(&b, lw->cmp_norm, (uint64_t)cfg->head_dim, DS41_ARENA_BF16, L, "attn.compressor.norm");
        put_linear(&b, &lw->idx_wk, L, "attn.indexer.wk", true);
        put_vec(&b, lw->idx_k_norm, (uint64_t)cfg->index_head_dim, DS41_ARENA_BF16, L, "attn.indexer.k_norm");
        put_linear(&b, &lw->idx_wq_b, L, "attn.indexer.wq_b", true);
        put_linear(&b, &lw->idx_weights_proj, L, "attn.indexer.weights_proj", true);
        put_vec(&b, lw->hc_attn_fn, mix * hc * D, DS41_ARENA_F32, L, "hc_attn_fn");
        put_vec(&b, lw->hc_ffn_fn, mix * hc * D, DS41_ARENA_F32, L, "hc_ffn_fn");
        put_vec(&b, lw->hc_attn_base, mix, DS41_ARENA_F32, L, "hc_attn_base");
        put_vec(&b, lw->hc_ffn_base, mix, DS41_ARENA_F32, L, "hc_ffn_base");
        put_vec(&b, lw->hc_attn_scale, 3, DS41_ARENA_F32, L, "hc_attn_scale");
        put_vec(&b, lw->hc_ffn_scale, 3, DS41_ARENA_F32, L, "hc_ffn_scale");
        put_linear(&b, &lw->gate, L, "ffn.gate", true);
        put_vec(&b, lw->gate_bias, (uint64_t)lw->n_experts, DS41_ARENA_F32, L, "ffn.gate.bias");
        /* The expert cache streams the text layers' routed experts only;
         * DSpark stages' experts are always resident. */
        const bool experts = !text || b.o->experts;
        for (int64_t x = 0; x < lw->n_experts; x++) {
            put_linear(&b, &lw->w1[x], L, "ffn.experts.w1", experts);
            put_linear(&b, &lw->w2[x], L, "ffn.experts.w2", experts);
            put_linear(&b, &lw->w3[x], L, "ffn.experts.w3", experts);
        }
        put_linear(&b, &lw->sh_w1, L, "ffn.shared_experts.w1", true);
        put_linear(&b, &lw->sh_w2, L, "ffn.shared_experts.w2", true);
        put_linear(&b, &lw->sh_w3, L, "ffn.shared_experts.w3", true);
        if (lw->eng_table) {
            const uint64_t ehd = (uint64_t)cfg->engram_head_dim, rows = (uint64_t)lw->eng_rows;
            put(&b, lw->eng_table, rows * ehd, DS41_ARENA_FP8, L, "engram.embed", b.o->engram_tables);
            put(&b, lw->eng_table_scale, rows * ((ehd + 31) / 32), DS41_ARENA_SCALE, L, "engram.embed",
                b.o->engram_tables);
        }
        put_linear(&b, &lw->eng_wkv, L, "engram.wkv", true);
    }
    put_linear(&b, &w->mtp_main_proj, -1, "mtp.main_proj", true);
    put_vec(&b, w->mtp_main_norm, D, DS41_ARENA_BF16, -1, "mtp.main_norm");
    put_vec(&b, w->mtp_norm, D, DS41_ARENA_BF16, -1, "mtp.norm");
    put_vec(&b, w->mtp_markov_embed, V * (uint64_t)cfg->dspark_markov_rank, DS41_ARENA_BF16, -1,
            "mtp.markov_head.embed");
    put_linear(&b, &w->mtp_markov_head, -1, "mtp.markov_head.head", true);
    put_linear(&b, &w->mtp_confidence, -1, "mtp.confidence_head.proj", true);
    if (b.failed) {
        ds41_placement_free(p);
        return -1;
    }
    /* Sorted by address for the lookup; a tensor bound twice (the same
     * bytes) is placed once, overlapping different ones is a binding bug. */
    qsort(p->e, p->n, sizeof *p->e, cmp_host);
    size_t m = 0;
    for (size_t i = 0; i < p->n; i++) {
        if (m && p->e[i].host == p->e[m - 1].host && p->e[i].bytes == p->e[m - 1].bytes) continue;
        if (m && (uintptr_t)p->e[i].host < (uintptr_t)p->e[m - 1].host + p->e[m - 1].bytes) {
            const char *a = p->e[m - 1].what, *c = p->e[i].what;
            ds41_placement_free(p);
            return ds41_fail(err, "placement: bound tensors %s and %s overlap", a, c);
        }
        p->e[m++] = p->e[i];
    }
    p->n = m;
    lay_out(p);
    return 0;
}

static bool ends_with(const char *s, const char *suffix) {
    const size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

int ds41_placement_plan_tensors(ds41_placement *p, const ds41_model_config *cfg, const ds41_tensor_plan *plan,
                                const ds41_placement_opts *opts, ds41_error *err) {
    memset(p, 0, sizeof *p);
    const ds41_placement_opts none = {0};
    builder b = {.p = p, .o = opts ? opts : &none, .err = err};
    for (size_t i = 0; i < plan->n && !b.failed; i++) {
        const ds41_planned_tensor *t = &plan->t[i];
        if (t->kind == DS41_KIND_VISION || ends_with(t->name, "gate.bias_vl") ||
            ends_with(t->name, "engram.q_weight") || ends_with(t->name, "engram.k_weight") ||
            ends_with(t->name, "attn.wo_a.scale"))
            continue;
        if (t->kind == DS41_KIND_DSPARK && !cfg->dspark_enabled) continue;
        bool placed = true;
        if (t->kind == DS41_KIND_ROUTED_EXPERTS) placed = b.o->experts;
        if (t->kind == DS41_KIND_ENGRAM_TABLES) placed = b.o->engram_tables;
        const char *what = t->kind == DS41_KIND_ROUTED_EXPERTS ? "ffn.experts." : NULL;
        if (ends_with(t->name, "attn.wo_a.weight")) { /* held dequantized, bf16 */
            put(&b, NULL, t->nbytes * 2, DS41_ARENA_BF16, t->layer, "attn.wo_a", true);
            continue;
        }
        ds41_arena a;
        switch (t->dtype) {
        case DS41_F8_E4M3:
            a = DS41_ARENA_FP8;
            break;
        case DS41_I8:
            a = DS41_ARENA_FP4;
            break;
        case DS41_F8_E8M0:
            a = DS41_ARENA_SCALE;
            break;
        case DS41_F32:
            a = DS41_ARENA_F32;
            break;
        default:
            a = DS41_ARENA_BF16;
            break;
        }
        put(&b, NULL, t->nbytes, a, t->layer, what, placed);
    }
    if (b.failed) {
        ds41_placement_free(p);
        return -1;
    }
    lay_out(p);
    return 0;
}

void ds41_placement_free(ds41_placement *p) {
    if (!p) return;
    free(p->e);
    memset(p, 0, sizeof *p);
}

ds41_place_found ds41_placement_find(const ds41_placement *pl, const void *p, size_t n,
                                     const ds41_place_entry **entry, uint64_t *offset) {
    const uintptr_t a = (uintptr_t)p;
    size_t lo = 0, hi = pl->n;
    while (lo < hi) { /* first entry starting after a */
        const size_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)pl->e[mid].host <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0) return DS41_PLACE_NOT_A_WEIGHT;
    const ds41_place_entry *e = &pl->e[lo - 1];
    const uint64_t off = (uint64_t)(a - (uintptr_t)e->host);
    if (!e->host || off >= e->bytes) return DS41_PLACE_NOT_A_WEIGHT;
    if (entry) *entry = e;
    if (n > e->bytes - off) return DS41_PLACE_PAST_END;
    if (!e->placed) return DS41_PLACE_UNPLACED;
    if (offset) *offset = e->offset + off;
    return DS41_PLACE_FOUND;
}

const char *ds41_arena_name(ds41_arena a) {
    static const char *const names[DS41_ARENA_COUNT] = {"fp8", "fp4", "scale", "bf16", "f32"};
    return (unsigned)a < DS41_ARENA_COUNT ? names[a] : "?";
}
