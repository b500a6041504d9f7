/* The forward pass: load, embedding, Engram, blocks with hyper-connections,
 * final norm and head (REFERENCE.md §2.5-2.7, §6.3-6.4, §9, §10).  The
 * attention and MoE sub-layers are in attention.c and moe.c. */
#include "engine/forward/forward_internal.h"

#include "engine/model/engram_tokens.h"
#include "engine/model/quant.h"
#include "engine/backend/refmath.h"
#include "engine/text/vocab.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- load ---------------------------------------------------------------------- */

static int load_engram(ds41_engine *e, const char *dir, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    ds41_vocab *v = ds41_vocab_load_dir(dir, err);
    if (!v) return ds41_error_prefix(err, "engram token map");
    uint32_t n_ids = 0, n_comp = 0;
    int rc = ds41_engram_token_map_from_vocab(v, &e->token_map, &n_ids, &n_comp, err);
    ds41_vocab_free(v);
    if (rc != 0) return ds41_error_prefix(err, "engram token map");
    e->n_map = n_ids;
    if ((int64_t)n_ids != c->vocab_size)
        return ds41_fail(err, "%s/tokenizer.json: %u token ids, but %s says vocab_size %lld", dir, n_ids, c->label,
                         (long long)c->vocab_size);
    if ((int64_t)n_comp != c->engram_compressed_vocab_size)
        return ds41_fail(err,
                         "%s/tokenizer.json: the Engram token map has %u distinct keys, but %s says "
                         "engram_compressed_vocab_size %lld",
                         dir, n_comp, c->label, (long long)c->engram_compressed_vocab_size);
    if (c->engram_pad_id < 0 || c->engram_pad_id >= (int64_t)n_ids)
        return ds41_fail(err, "%s: key 'engram_pad_id': %lld is not a token id", c->label, (long long)c->engram_pad_id);
    e->engram_pad = e->token_map[c->engram_pad_id];

    int ids[DS41_ENGRAM_MAX_LAYERS];
    if (c->engram_layer_ids.n > DS41_ENGRAM_MAX_LAYERS)
        return ds41_fail(err, "%s: key 'engram_layer_ids': more than %d layers", c->label, DS41_ENGRAM_MAX_LAYERS);
    for (size_t i = 0; i < c->engram_layer_ids.n; i++) ids[i] = (int)c->engram_layer_ids.v[i];
    if (c->engram_max_ngram_size > DS41_ENGRAM_MAX_NGRAM || c->engram_n_heads > DS41_ENGRAM_MAX_HEADS)
        return ds41_fail(err, "%s: engram_max_ngram_size / engram_n_heads above the engine's limits", c->label);
    if (ds41_engram_layout_compute(ids, (int)c->engram_layer_ids.n, (int)c->engram_max_ngram_size,
                                   (int)c->engram_n_heads, c->engram_vocab_size, c->engram_compressed_vocab_size,
                                   &e->eng, err) != 0)
        return ds41_error_prefix(err, "%s", c->label);
    if (ds41_engram_layout_check(&e->eng, c->engram_num_embeddings.v, (int)c->engram_num_embeddings.n, err) != 0)
        return ds41_error_prefix(err, "%s", c->label);

    /* w = fp32(q_weight) * fp32(k_weight) per copy (§6.4 step 3): computed
     * once on the host, kept in backend memory for engram_mix. */
    const size_t hc = (size_t)c->hc_mult, D = (size_t)c->dim;
    e->wqk = calloc(c->engram_layer_ids.n, sizeof *e->wqk);
    float *tmp = malloc(hc * D * sizeof *tmp);
    if (!e->wqk || !tmp) {
        free(tmp);
        return ds41_fail(err, "out of memory");
    }
    for (size_t s = 0; s < c->engram_layer_ids.n; s++) {
        const ds41_layer_weights *lw = &e->w.layers[c->engram_layer_ids.v[s]];
        e->wqk[s] = e->mem->alloc(e->mem, hc * D * sizeof(float));
        if (!e->wqk[s]) {
            free(tmp);
            return ds41_fail(err, "out of memory");
        }
        for (size_t i = 0; i < hc * D; i++) tmp[i] = ds41_bf16_to_f32(lw->eng_q[i]) * ds41_bf16_to_f32(lw->eng_k[i]);
        e->mem->upload(e->mem, e->wqk[s], tmp, hc * D * sizeof *tmp);
    }
    free(tmp);
    return 0;
}

/* The Engram row tier: a row cache when the budget does not cover the tables
 * (payload + scales of every Engram layer); otherwise the tables stay on the
 * mapping. */
static int setup_engram_stream(ds41_engine *e, uint64_t budget, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const size_t nsl = c->engram_layer_ids.n;
    ds41_engram_table_spec specs[DS41_ENGRAM_MAX_LAYERS];
    uint64_t total = 0;
    for (size_t s = 0; s < nsl; s++) {
        char name[96];
        const long long L = (long long)c->engram_layer_ids.v[s];
        snprintf(name, sizeof name, "layers.%lld.engram.embed.weight", L);
        specs[s].payload = ds41_checkpoint_find(e->ckpt, name);
        snprintf(name, sizeof name, "layers.%lld.engram.embed.scale", L);
        specs[s].scale = ds41_checkpoint_find(e->ckpt, name);
        if (!specs[s].payload || !specs[s].scale)
            return ds41_fail(err, "%s: layer %lld: Engram table tensors missing", c->label, L);
        total += specs[s].payload->nbytes + specs[s].scale->nbytes;
    }
    if (nsl == 0 || budget >= total) return 0;
    ds41_engram_cache_opts o = {.budget_bytes = budget, .host_alloc = ds41_memory_host_alloc(e->be->mem)};
    e->ecache = ds41_engram_cache_new(e->ckpt, specs, nsl, &o, err);
    if (!e->ecache) return -1;
    const size_t ehd = (size_t)c->engram_head_dim;
    if (ds41_engram_cache_row_bytes(e->ecache) != ehd || ds41_engram_cache_scale_bytes(e->ecache) != (ehd + 31) / 32)
        return ds41_fail(err, "%s: Engram table rows are not engram_head_dim e4m3 codes + ue8m0 scales per 32",
                         specs[0].payload->name);
    return 0;
}

/* The binder's progress, forwarded with its stage to the caller's callback. */
typedef struct load_report {
    const ds41_engine_opts *opts;
    ds41_load_progress p;
} load_report;

static void report_stage(load_report *r, ds41_load_stage stage) {
    r->p.stage = stage;
    if (r->opts && r->opts->progress) r->opts->progress(r->opts->progress_ctx, &r->p);
}

static void on_bind_progress(void *ctx, uint64_t tensors_done, uint64_t tensors_total, uint64_t bytes_done,
                             uint64_t bytes_total) {
    load_report *r = ctx;
    r->p = (ds41_load_progress){DS41_LOAD_BINDING, tensors_done, tensors_total, bytes_done, bytes_total};
    report_stage(r, DS41_LOAD_BINDING);
}

/* Host backends read the weights straight from the checkpoint's mapping:
 * map the pages of what stays resident at load, in one call per tensor,
 * instead of a page fault per page in the first steps (llama.cpp maps its
 * file with MAP_POPULATE for the same reason).  What the engine streams
 * (routed experts under an expert budget, the Engram tables under a row
 * cache) is left alone: its budget is the point. */
static void prefault_resident(ds41_engine *e, const ds41_engine_opts *opts) {
    const bool experts_streamed =
        opts && opts->expert_cache_bytes && opts->expert_cache_bytes < e->expert_total_bytes;
    const bool engram_streamed = e->cfg.engram_enabled && opts && opts->engram_cache_bytes;
    const size_t n = ds41_checkpoint_tensor_count(e->ckpt);
    for (size_t i = 0; i < n; i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(e->ckpt, i);
        if (experts_streamed && strstr(t->name, ".ffn.experts.")) continue;
        if (engram_streamed && strstr(t->name, ".engram.embed.")) continue;
        ds41_checkpoint_prefault(e->ckpt, t);
    }
}

ds41_engine *ds41_engine_load(const char *dir, const ds41_engine_opts *opts, ds41_error *err) {
    load_report rep = {.opts = opts};
    ds41_engine *e = calloc(1, sizeof *e);
    if (!e) {
        ds41_fail(err, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&e->xc_mu, NULL);
    if (opts && opts->reference) {
        ds41_backend_free(opts->backend);
        e->be = ds41_backend_reference_new(err);
    } else if (opts && opts->backend) {
        e->be = opts->backend;
    } else {
        e->be = ds41_backend_cpu_new(opts ? &opts->cpu : NULL, err);
    }
    if (!e->be) goto fail;
    e->ops = &e->be->ops;
    e->mem = e->be->mem ? e->be->mem : &ds41_memory_host;
    e->scratch.mem = e->be->scratch_mem ? e->be->scratch_mem : e->mem;
    if (ds41_model_config_load(dir, &e->cfg, err) != 0) goto fail;
    const ds41_model_config *c = &e->cfg;
    if (c->rope_head_dim < 2 || c->rope_head_dim > c->head_dim || c->rope_head_dim > c->index_head_dim ||
        c->hc_mult < 1 || c->hc_mult > 64 || c->window_size < 1 || c->index_topk < 1) {
        ds41_fail(err, "%s: rope_head_dim, hc_mult, window_size or index_topk outside what the engine supports",
                  c->label);
        goto fail;
    }
    e->ckpt = ds41_checkpoint_open(dir, err);
    if (!e->ckpt) goto fail;
    if (ds41_weights_bind_progress(&e->w, c, e->ckpt, opts && opts->progress ? on_bind_progress : NULL, &rep,
                                   err) != 0) {
        ds41_error_prefix(err, "%s", dir);
        goto fail;
    }
    if (e->be->place_weights) {
        /* Tell the backend what the engine will stream, so that it need not
         * hold those tensors (ds41_weights.experts_streamed). */
        if (opts && opts->expert_cache_bytes) {
            if (ds41_expert_cache_geometry(e->ckpt, c, &e->expert_slot_bytes, &e->expert_total_bytes, err) != 0)
                goto fail;
            e->w.experts_streamed = opts->expert_cache_bytes < e->expert_total_bytes;
        }
        e->w.engram_streamed = c->engram_enabled && opts && opts->engram_cache_bytes;
        report_stage(&rep, DS41_LOAD_PLACING);
        if (e->be->place_weights(e->be, c, &e->w, err) != 0) {
            ds41_error_prefix(err, "%s: backend %s", dir, e->be->name);
            goto fail;
        }
        e->placed = 1;
        report_stage(&rep, DS41_LOAD_PLACING);
    }
    e->rope_freqs = calloc(c->n_roles, sizeof *e->rope_freqs);
    e->rope_freqs_be = calloc(c->n_roles, sizeof *e->rope_freqs_be);
    if (!e->rope_freqs || !e->rope_freqs_be) {
        ds41_fail(err, "out of memory");
        goto fail;
    }
    for (size_t l = 0; l < c->n_roles; l++) {
        const ds41_layer_role *r = &c->roles[l];
        if (!r->present) continue;
        e->rope_freqs[l] = malloc((size_t)(c->rope_head_dim / 2) * sizeof(float));
        if (!e->rope_freqs[l]) {
            ds41_fail(err, "out of memory");
            goto fail;
        }
        ds41_rope_freqs((int)c->rope_head_dim, r->rope_theta, r->yarn ? c->original_seq_len : 0, c->rope_factor,
                        (double)c->beta_fast, (double)c->beta_slow, e->rope_freqs[l]);
        const size_t fb = (size_t)(c->rope_head_dim / 2) * sizeof(float);
        if (!(e->rope_freqs_be[l] = e->mem->alloc(e->mem, fb))) {
            ds41_fail(err, "out of memory");
            goto fail;
        }
        e->mem->upload(e->mem, e->rope_freqs_be[l], e->rope_freqs[l], fb);
    }
    if (c->engram_enabled && load_engram(e, dir, err) != 0) goto fail;
    /* The expert tier's geometry (cheap: index lookups), for its figures
     * even while everything is resident. */
    if (ds41_expert_cache_geometry(e->ckpt, c, &e->expert_slot_bytes, &e->expert_total_bytes, err) != 0) {
        ds41_error_prefix(err, "%s", dir);
        goto fail;
    }
    if (!e->be->place_weights) prefault_resident(e, opts);
    {
        const ds41_expert_predict p = opts ? opts->expert_predict : DS41_XPREDICT_DEFAULT;
        const bool on = !(opts && opts->expert_no_predict);
        e->expert_predict_next = on && (p == DS41_XPREDICT_NEXT || p == DS41_XPREDICT_BOTH);
        e->expert_predict_early = on && (p == DS41_XPREDICT_DEFAULT || p == DS41_XPREDICT_EARLY || p == DS41_XPREDICT_BOTH);
        e->expert_predict_extra = opts ? opts->expert_predict_extra : 0;
    }
    e->expert_buffered = opts && opts->expert_buffered;
    e->expert_host_budget = opts ? opts->host_expert_cache_bytes : 0;
    if (opts && opts->expert_cache_bytes && ds41_engine_set_expert_budget(e, opts->expert_cache_bytes, err) != 0) {
        ds41_error_prefix(err, "%s", dir);
        goto fail;
    }
    if (c->engram_enabled && opts && opts->engram_cache_bytes &&
        setup_engram_stream(e, opts->engram_cache_bytes, err) != 0) {
        ds41_error_prefix(err, "%s: Engram row cache", dir);
        goto fail;
    }

    e->norm_eps = (float)c->norm_eps;
    e->hc_eps = (float)c->hc_eps;
    e->route_scale = (float)c->route_scale;
    e->swiglu_limit = (float)c->swiglu_limit;
    e->gate_temp = (float)c->gate_temp;
    e->softmax_scale = (float)pow((double)c->head_dim, -0.5);
    e->index_scale = (float)(pow((double)c->index_head_dim, -0.5) * pow((double)c->index_n_heads, -0.5));
    e->engram_scale = (float)pow((double)c->dim, -0.5);
    /* Loading read tensor data (wo_a, Engram projections): a shard cut
     * meanwhile leaves zeros behind, never a usable engine. */
    if (ds41_checkpoint_check_mappings(e->ckpt, err) != 0) goto fail;
    report_stage(&rep, DS41_LOAD_DONE);
    return e;
fail:
    ds41_engine_free(e);
    return NULL;
}

void ds41_engine_free(ds41_engine *e) {
    if (!e) return;
    ds41_expert_cache_free(e->xc);
    pthread_mutex_destroy(&e->xc_mu);
    ds41_scratch_free(&e->scratch);
    ds41_scratch_free(&e->host);
    const size_t D = (size_t)e->cfg.dim, hc = (size_t)e->cfg.hc_mult, fb = (size_t)(e->cfg.rope_head_dim / 2);
    if (e->wqk)
        for (size_t s = 0; s < e->cfg.engram_layer_ids.n; s++) e->mem->free(e->mem, e->wqk[s], hc * D * sizeof(float));
    free(e->wqk);
    if (e->rope_freqs)
        for (size_t l = 0; l < e->cfg.n_roles; l++) free(e->rope_freqs[l]);
    if (e->rope_freqs_be)
        for (size_t l = 0; l < e->cfg.n_roles; l++) e->mem->free(e->mem, e->rope_freqs_be[l], fb * sizeof(float));
    free(e->rope_freqs);
    free(e->rope_freqs_be);
    free(e->token_map);
    ds41_engram_cache_free(e->ecache);
    if (e->placed && e->be->release_weights) e->be->release_weights(e->be, &e->w);
    ds41_weights_free(&e->w);
    ds41_checkpoint_close(e->ckpt);
    ds41_model_config_free(&e->cfg);
    ds41_backend_free(e->be);
    free(e);
}

const ds41_model_config *ds41_engine_config(const ds41_engine *e) {
    return &e->cfg;
}

const ds41_weights *ds41_engine_weights(const ds41_engine *e) {
    return &e->w;
}

static int cmp_page_range(const void *x, const void *y) {
    const ds41_page_range *p = x, *q = y;
    return p->start < q->start ? -1 : p->start > q->start;
}

ds41_page_range *ds41_engine_expert_only_pages(const ds41_engine *e, size_t *n_out) {
    size_t n = 0, cap = 0;
    ds41_page_range *r = NULL;
    *n_out = 0;
    for (int L = 0; L < (int)e->cfg.n_layers; L++) {
        const ds41_layer_weights *lw = &e->w.layers[L];
        for (int64_t ex = 0; ex < lw->n_experts; ex++) {
            const ds41_linear *ls[3] = {&lw->w1[ex], &lw->w2[ex], &lw->w3[ex]};
            for (int k = 0; k < 3; k++) {
                if (n + 2 > cap) {
                    cap = cap ? 2 * cap : 1024;
                    ds41_page_range *nr = realloc(r, cap * sizeof *nr);
                    if (!nr) {
                        free(r);
                        return NULL;
                    }
                    r = nr;
                }
                const ds41_linear *l = ls[k];
                const size_t qb = (size_t)(l->n * (l->kind == DS41_LINEAR_FP4 ? (l->k + 1) / 2 : l->k));
                r[n++] = (ds41_page_range){(uintptr_t)l->q, (uintptr_t)l->q + qb};
                r[n++] = (ds41_page_range){(uintptr_t)l->scale, (uintptr_t)l->scale + (size_t)(l->n * l->scale_cols)};
            }
        }
    }
    if (!n) {
        free(r);
        return NULL;
    }
    /* Merge the byte ranges, then keep the whole pages inside each. */
    qsort(r, n, sizeof *r, cmp_page_range);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (m && r[i].start <= r[m - 1].end) {
            if (r[i].end > r[m - 1].end) r[m - 1].end = r[i].end;
        } else {
            r[m++] = r[i];
        }
    }
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        const uintptr_t a = (r[i].start + pg - 1) / pg * pg, b = r[i].end / pg * pg;
        if (b > a) r[k++] = (ds41_page_range){a, b};
    }
    *n_out = k;
    return r;
}

uint64_t ds41_page_ranges_resident(const ds41_page_range *r, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uint64_t t = 0;
    for (size_t i = 0; i < n; i++) {
        const size_t np = (r[i].end - r[i].start) / pg;
        unsigned char *v = malloc(np ? np : 1);
        if (v && mincore((void *)r[i].start, r[i].end - r[i].start, v) == 0)
            for (size_t p = 0; p < np; p++) t += v[p] & 1;
        free(v);
    }
    return t;
}

const ds41_ops *ds41_engine_ops(const ds41_engine *e) {
    return e->ops;
}

ds41_backend *ds41_engine_backend(const ds41_engine *e) {
    return e->be;
}

bool ds41_engine_experts_streamed(const ds41_engine *e) {
    return e->xc != NULL;
}

int ds41_engine_set_expert_budget(ds41_engine *e, uint64_t bytes, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    if (bytes) {
        pthread_mutex_lock(&e->xc_mu);
        const int grc = e->expert_total_bytes ? 0
                                              : ds41_expert_cache_geometry(e->ckpt, c, &e->expert_slot_bytes,
                                                                           &e->expert_total_bytes, err);
        pthread_mutex_unlock(&e->xc_mu);
        if (grc != 0) return -1;
    }
    if (e->placed && e->w.experts_streamed && (bytes == 0 || bytes >= e->expert_total_bytes)) {
        /* The backend placed no routed experts (they were streamed at load):
         * "all of them" is a cache that holds all of them. */
        bytes = e->expert_total_bytes;
    } else if (bytes == 0 || bytes >= e->expert_total_bytes) {
        /* Everything fits: the experts are used in place from the mapping. */
        pthread_mutex_lock(&e->xc_mu);
        ds41_expert_cache *old = e->xc;
        e->xc = NULL;
        e->expert_budget = bytes;
        pthread_mutex_unlock(&e->xc_mu);
        ds41_expert_cache_free(old);
        return 0;
    }
    if (e->xc) {
        pthread_mutex_lock(&e->xc_mu);
        const int rc = ds41_expert_cache_set_budget(e->xc, bytes, err);
        if (rc == 0) e->expert_budget = bytes;
        pthread_mutex_unlock(&e->xc_mu);
        return rc;
    }
    ds41_expert_cache_opts o = {.budget_bytes = bytes,
                                .buffered = e->expert_buffered,
                                .slot_memory = e->be->expert_mem ? e->be->expert_mem : e->be->mem,
                                .host_tier_bytes = e->expert_host_budget,
                                .host_alloc = ds41_memory_host_alloc(e->be->mem)};
    ds41_expert_cache *xc = ds41_expert_cache_new(e->ckpt, c, &o, err);
    if (!xc) return -1;
    pthread_mutex_lock(&e->xc_mu);
    e->xc = xc;
    e->expert_budget = bytes;
    pthread_mutex_unlock(&e->xc_mu);
    return 0;
}

int ds41_engine_request_expert_budget(ds41_engine *e, uint64_t bytes, ds41_error *err) {
    pthread_mutex_lock(&e->xc_mu);
    int rc = 0;
    /* The geometry reads only the checkpoint's immutable index. */
    if (!e->expert_total_bytes)
        rc = ds41_expert_cache_geometry(e->ckpt, &e->cfg, &e->expert_slot_bytes, &e->expert_total_bytes, err);
    if (rc == 0 && e->expert_total_bytes == 0 && bytes)
        rc = ds41_fail(err, "the model has no routed experts");
    if (rc == 0 && bytes && bytes < e->expert_total_bytes && bytes < e->expert_slot_bytes)
        rc = ds41_fail(err, "expert budget of %llu bytes is below one expert slot (the minimum is %llu bytes)",
                       (unsigned long long)bytes, (unsigned long long)e->expert_slot_bytes);
    if (rc == 0) {
        e->budget_pending = true;
        e->budget_requested = bytes;
    }
    pthread_mutex_unlock(&e->xc_mu);
    return rc;
}

bool ds41_engine_expert_stats(ds41_engine *e, ds41_expert_cache_stats *out, bool reset) {
    pthread_mutex_lock(&e->xc_mu);
    const bool streamed = e->xc != NULL;
    if (streamed) {
        ds41_expert_cache_get_stats(e->xc, out, reset);
    } else {
        memset(out, 0, sizeof *out);
        out->budget_bytes = e->expert_budget;
        out->total_bytes = e->expert_total_bytes;
    }
    pthread_mutex_unlock(&e->xc_mu);
    return streamed;
}

ds41_reader *ds41_engine_expert_reader(ds41_engine *e) {
    return e->xc ? ds41_expert_cache_reader(e->xc) : NULL;
}

ds41_kv_pool *ds41_engine_new_pool(const ds41_engine *e, uint64_t budget_bytes, uint32_t entries_per_page,
                                   ds41_error *err) {
    return e->be->new_pool(e->be, &e->cfg, budget_bytes, entries_per_page, err);
}

int32_t ds41_engine_compressed_id(const ds41_engine *e, int32_t token) {
    if (!e->token_map || token < 0 || (uint32_t)token >= e->n_map) return -1;
    return e->token_map[token];
}

int32_t ds41_argmax(const float *x, size_t n) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (x[i] > x[best] || (isnan(x[best]) && !isnan(x[i]))) best = i;
    return (int32_t)best;
}

/* ---- forward ------------------------------------------------------------------------ */

/* Checks that change nothing: items well formed, sequences distinct and of a
 * pool with this engine's geometry, ids in range, KV pages available. */
static int validate(const ds41_engine *e, const ds41_fwd_item *items, size_t n_items, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    if (n_items == 0 || !items) return ds41_fail(err, "forward: empty batch");
    ds41_kv_pool *pool = NULL;
    for (size_t i = 0; i < n_items; i++) {
        const ds41_fwd_item *it = &items[i];
        if (!it->seq || !it->ids || it->n_ids == 0)
            return ds41_fail(err, "forward: item %zu has no sequence or no tokens", i);
        for (size_t j = 0; j < i; j++)
            if (items[j].seq == it->seq) return ds41_fail(err, "forward: items %zu and %zu share a sequence", j, i);
        for (size_t t = 0; t < it->n_ids; t++)
            if (it->ids[t] < 0 || it->ids[t] >= c->vocab_size)
                return ds41_fail(err, "forward: item %zu token %zu: id %d outside [0, %lld)", i, t, it->ids[t],
                                 (long long)c->vocab_size);
        if (it->spec_taps && !c->dspark_enabled)
            return ds41_fail(err, "forward: item %zu asks for DSpark taps, but %s has no DSpark stages", i,
                             c->label);
        ds41_kv_pool *p = ds41_kv_seq_pool(it->seq);
        const ds41_kv_layout *l = ds41_kv_pool_layout(p);
        if (l->n_layers != (int)c->n_roles || l->latent_dim != (uint32_t)c->head_dim ||
            l->index_dim != (uint32_t)c->index_head_dim || l->window != (uint32_t)c->window_size)
            return ds41_fail(err, "forward: item %zu: its sequence's pool was made for another model", i);
        for (size_t L = 0; L < c->n_roles; L++)
            if (c->roles[L].present && c->roles[L].kv_source && l->source_of_layer[L] < 0)
                return ds41_fail(err, "forward: item %zu: its sequence's pool was made for another model", i);
        if (it->n_ids > ds41_kv_seq_journal_room(it->seq))
            return ds41_fail(err, "forward: item %zu: %zu tokens, its sequence's journal has room for %llu",
                             i, it->n_ids, (unsigned long long)ds41_kv_seq_journal_room(it->seq));
        if (pool && p != pool) return ds41_fail(err, "forward: the batch mixes sequences of different pools");
        pool = p;
    }
    /* Every per-row buffer of the pass must be addressable: rows times the
     * widest row (in floats, with room for 8-byte elements). */
    size_t M = 0;
    for (size_t i = 0; i < n_items; i++)
        if (__builtin_add_overflow(M, items[i].n_ids, &M)) return ds41_fail(err, "forward: batch too large");
    const int64_t widths[] = {c->hc_mult * c->dim,
                              (c->hc_mult + 1) * c->dim,
                              c->vocab_size,
                              c->n_heads * c->head_dim,
                              c->index_n_heads * c->index_head_dim,
                              c->n_routed_experts,
                              c->moe_inter_dim * c->n_shared_experts,
                              c->engram_enabled ? (c->engram_max_ngram_size - 1) * c->engram_n_heads * c->engram_head_dim : 0,
                              c->index_topk};
    uint64_t widest = 1;
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        if (widths[i] > 0 && (uint64_t)widths[i] > widest) widest = (uint64_t)widths[i];
    if ((uint64_t)M > (uint64_t)(SIZE_MAX / 16) / widest)
        return ds41_fail(err, "forward: batch of %zu tokens too large for this model's buffers", M);
    for (size_t i = 0; i < n_items; i++)
        if (ds41_kv_seq_tokens(items[i].seq) > UINT64_MAX / 4 - items[i].n_ids)
            return ds41_fail(err, "forward: item %zu: position overflow", i);

    /* Pages the batch takes: new pages per source, plus a copy of each
     * shared, partly filled last page it appends to (copy on write). */
    uint64_t need = 0;
    for (size_t i = 0; i < n_items; i++) need += ds41_kv_seq_pages_to_grow(items[i].seq, items[i].n_ids);
    ds41_kv_pool_stats st;
    ds41_kv_pool_get_stats(pool, &st);
    if (st.pages_max && need > st.pages_max - st.pages_in_use)
        return ds41_fail(err, "KV cache full (%llu pages of %llu bytes; the batch needs up to %llu more, %llu free)",
                         (unsigned long long)st.pages_max, (unsigned long long)st.page_bytes,
                         (unsigned long long)need, (unsigned long long)(st.pages_max - st.pages_in_use));
    return 0;
}

/* Hand the step's rows (backend memory, [M][width]) to the stream hook,
 * downloaded. */
static void report(ds41_engine *e, const ds41_fwd_hooks *hooks, const fwd_batch *b, ds41_stream_kind kind,
                   int layer, const float *rows, size_t width) {
    if (!hooks || !hooks->stream) return;
    const fwd_frame f = ds41__frame(e);
    float *h = ds41__host(e, b->M * width * sizeof *h);
    if (h) {
        e->mem->download(e->mem, h, rows, b->M * width * sizeof *h);
        for (size_t r = 0; r < b->M; r++) {
            const size_t it = b->row_item[r];
            hooks->stream(hooks->ctx, kind, layer, it, r - b->item_row0[it], h + r * width, width);
        }
    }
    ds41__frame_release(e, f);
}

/* Teacher forcing at block L (ds41_fwd_hooks.feed): each row's stream and
 * pre-mix go to the hook on the host, and what it leaves there is what the
 * block computes from (uploaded back). */
static int feed(ds41_engine *e, const ds41_fwd_hooks *hooks, const fwd_batch *b, int L, float *h, float *pre_mix,
                size_t hc, size_t D, ds41_error *err) {
    const fwd_frame f = ds41__frame(e);
    float *hh = ds41__host(e, b->M * hc * D * sizeof *hh), *hp = ds41__host(e, b->M * hc * sizeof *hp);
    if (!hh || !hp) {
        ds41__frame_release(e, f);
        return ds41_fail(err, "forward: out of memory");
    }
    e->mem->download(e->mem, hh, h, b->M * hc * D * sizeof *hh);
    e->mem->download(e->mem, hp, pre_mix, b->M * hc * sizeof *hp);
    for (size_t r = 0; r < b->M; r++) {
        const size_t it = b->row_item[r];
        hooks->feed(hooks->ctx, L, it, r - b->item_row0[it], hh + r * hc * D, hp + r * hc);
    }
    e->mem->upload(e->mem, h, hh, b->M * hc * D * sizeof *hh);
    e->mem->upload(e->mem, pre_mix, hp, b->M * hc * sizeof *hp);
    ds41__frame_release(e, f);
    return 0;
}

/* Streamed Engram rows: the row cache copies rows ids[0..n) of the slot's
 * table (payload + scales) into a compact table, which the op then reads as
 * rows 0..n-1, the same codes and scales as the mapping would give.  ids is
 * overwritten. */
static int engram_stream_rows(ds41_engine *e, int slot, int L, int64_t *ids, size_t n, size_t ehd, float *rows,
                              ds41_error *err) {
    const size_t sb = (ehd + 31) / 32;
    const fwd_frame f = ds41__frame(e);
    /* Gathered on the host (the row cache is host memory), uploaded as one
     * compact table. */
    uint8_t *hq = ds41__host(e, n * ehd), *hs = ds41__host(e, n * sb);
    uint8_t *q = ds41__dev(e, n * ehd), *sc = ds41__dev(e, n * sb);
    int rc = 0;
    if (!hq || !hs || !q || !sc)
        rc = ds41_fail(err, "forward: out of memory");
    else if (ds41_engram_cache_gather(e->ecache, (uint32_t)slot, ids, n, hq, hs, err) != 0)
        rc = ds41_error_prefix(err, "forward: layer %d", L);
    if (rc == 0) {
        e->mem->upload(e->mem, q, hq, n * ehd);
        e->mem->upload(e->mem, sc, hs, n * sb);
        for (size_t i = 0; i < n; i++) ids[i] = (int64_t)i;
        e->ops->fp8_rows(e->ops, q, sc, ids, n, ehd, rows);
    }
    ds41__frame_release(e, f);
    return rc;
}

/* Ask the row cache for every row of the call (all positions, all Engram
 * layers) at once, before layer 0: the reads overlap the blocks before each
 * Engram layer, and rows already prefetched are pinned for the step. */
static int engram_request(ds41_engine *e, const fwd_batch *b, const int64_t *hash_ids, ds41_error *err) {
    const size_t nsl = (size_t)e->eng.n_layers, ncols = (size_t)e->eng.n_cols, M = b->M;
    const ds41_scratch_mark mark = ds41_scratch_mark_now(&e->host);
    int64_t *ids = ds41__host(e, M * ncols * sizeof *ids);
    if (!ids) return ds41_fail(err, "forward: out of memory");
    int rc = 0;
    for (size_t s = 0; s < nsl && rc == 0; s++) {
        for (size_t r = 0; r < M; r++)
            memcpy(ids + r * ncols, hash_ids + (r * nsl + s) * ncols, ncols * sizeof *ids);
        rc = ds41_engram_cache_request(e->ecache, (uint32_t)s, ids, M * ncols, err);
    }
    ds41_scratch_release(&e->host, mark);
    return rc == 0 ? 0 : ds41_error_prefix(err, "forward: Engram rows");
}

/* The table rows of layer L's slot that the step's hashes select, as ids
 * into its table: ids[M * ncols].  Errors: a row outside the table. */
static int engram_row_ids(const ds41_engine *e, const fwd_batch *b, int L, const int64_t *hash_ids,
                          int64_t *ids, ds41_error *err) {
    const ds41_layer_weights *lw = &e->w.layers[L];
    const size_t slot = (size_t)e->cfg.roles[L].engram_slot;
    const size_t ncols = (size_t)e->eng.n_cols, nsl = (size_t)e->eng.n_layers;
    for (size_t r = 0; r < b->M; r++)
        for (size_t col = 0; col < ncols; col++) {
            const int64_t id = hash_ids[(r * nsl + slot) * ncols + col];
            if (id < 0 || id >= lw->eng_rows)
                return ds41_fail(err, "forward: layer %d: engram row %lld outside the table (%lld rows)", L,
                                 (long long)id, (long long)lw->eng_rows);
            ids[r * ncols + col] = id;
        }
    return 0;
}

/* Engram before block L (§6.4): rows of the hashed ids, wkv, gating. */
static int engram_apply(ds41_engine *e, fwd_batch *b, int L, const int64_t *hash_ids, float *h, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_weights *lw = &e->w.layers[L];
    const int slot = c->roles[L].engram_slot;
    const size_t M = b->M, ncols = (size_t)e->eng.n_cols, ehd = (size_t)c->engram_head_dim;
    const size_t hc = (size_t)c->hc_mult, D = (size_t)c->dim;
    const fwd_frame f = ds41__frame(e);
    float *rows = ds41__dev(e, M * ncols * ehd * sizeof *rows);
    float *kv = ds41__dev(e, M * (hc + 1) * D * sizeof *kv);
    int64_t *ids = ds41__host(e, M * ncols * sizeof *ids);
    int rc = !rows || !kv || !ids ? ds41_fail(err, "forward: out of memory") : 0;
    if (rc == 0) rc = engram_row_ids(e, b, L, hash_ids, ids, err);
    if (rc == 0 && e->ecache)
        rc = engram_stream_rows(e, slot, L, ids, M * ncols, ehd, rows, err);
    else if (rc == 0)
        e->ops->fp8_rows(e->ops, lw->eng_table, lw->eng_table_scale, ids, M * ncols, ehd, rows);
    if (rc == 0) {
        /* At a layer that computes index keys or index scores the Engram
         * output is one of the indexer's inputs: the reference's
         * accumulation there (DS41_OUT_BF16_EXACT, engine/backend/ops.h). */
        const ds41_layer_role *role = &e->cfg.roles[L];
        const int feeds_indexer = role->ratio > 0 && (role->kv_source || role->index_source);
        e->ops->linear(e->ops, &lw->eng_wkv, rows, M, kv,
                       feeds_indexer ? DS41_OUT_BF16_EXACT : DS41_OUT_BF16);
        e->ops->engram_mix(e->ops, h, kv, e->wqk[slot], M, (int)hc, D, e->norm_eps, e->engram_scale);
    }
    ds41__frame_release(e, f);
    return rc;
}

/* Hash every token of the batch for every Engram layer, pushing the tokens
 * onto their sequences' histories (§6.3).  On the host, not an op: the
 * hashes are integer functions of token ids (the host's metadata), they
 * name the rows the host's Engram row tier streams and prefetches, and the
 * fp8_rows op takes them as its row ids. */
static int engram_hash(ds41_engine *e, fwd_batch *b, int64_t *ids, ds41_error *err) {
    const size_t nsl = (size_t)e->eng.n_layers, ncols = (size_t)e->eng.n_cols;
    for (size_t it = 0; it < b->n_items; it++) {
        const ds41_fwd_item *item = &b->items[it];
        ds41_engram_history *hist = ds41_kv_seq_engram(item->seq);
        for (size_t t = 0; t < item->n_ids; t++) {
            const size_t r = b->item_row0[it] + t;
            if (ds41_kv_seq_engram_push(item->seq, e->token_map[item->ids[t]], err) != 0) return -1;
            for (size_t s = 0; s < nsl; s++)
                if (ds41_engram_hash_position(&e->eng, (int)s, hist, e->engram_pad, ids + (r * nsl + s) * ncols, err) !=
                    0)
                    return -1;
        }
    }
    return 0;
}

/* The buffers of one block over M rows, from the engine's backend scratch
 * (the caller's frame). */
int ds41__block_bufs(ds41_engine *e, size_t M, fwd_block_bufs *bb) {
    const size_t hc = (size_t)e->cfg.hc_mult, D = (size_t)e->cfg.dim;
    bb->h = ds41__dev(e, M * hc * D * sizeof *bb->h);
    bb->h2 = ds41__dev(e, M * hc * D * sizeof *bb->h2);
    bb->pre_mix = ds41__dev(e, M * hc * sizeof *bb->pre_mix);
    bb->a_pre = ds41__dev(e, M * hc * sizeof *bb->a_pre);
    bb->a_post = ds41__dev(e, M * hc * sizeof *bb->a_post);
    bb->a_comb = ds41__dev(e, M * hc * hc * sizeof *bb->a_comb);
    bb->f_post = ds41__dev(e, M * hc * sizeof *bb->f_post);
    bb->f_comb = ds41__dev(e, M * hc * hc * sizeof *bb->f_comb);
    bb->x = ds41__dev(e, M * D * sizeof *bb->x);
    bb->xn = ds41__dev(e, M * D * sizeof *bb->xn);
    bb->br = ds41__dev(e, M * D * sizeof *bb->br);
    return bb->h && bb->h2 && bb->pre_mix && bb->a_pre && bb->a_post && bb->a_comb && bb->f_post &&
           bb->f_comb && bb->x && bb->xn && bb->br;
}

int ds41__block(ds41_engine *e, fwd_batch *b, int L, fwd_block_bufs *bb, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_ops *ops = e->ops;
    const ds41_layer_weights *lw = &e->w.layers[L];
    const size_t M = b->M, hc = (size_t)c->hc_mult, D = (size_t)c->dim;

    /* Attention sub-layer (§2.7 steps 1-2). */
    ops->hc_mix(ops, lw->hc_attn_fn, lw->hc_attn_scale, lw->hc_attn_base, bb->h, M, (int)hc, D, e->norm_eps,
                (int)c->hc_sinkhorn_iters, e->hc_eps, bb->a_pre, bb->a_post, bb->a_comb);
    /* The FFN's pre-mix is known now: start this layer's likely expert
     * reads so they overlap the attention. */
    ds41__moe_predict_early(e, b, L, bb->h, bb->a_pre);
    ops->hc_pre(ops, bb->h, bb->pre_mix, M, (int)hc, D, bb->x);
    ops->rmsnorm(ops, lw->attn_norm, bb->x, M, D, e->norm_eps, bb->xn);
    if (ds41__attention(e, b, L, bb->xn, bb->br, err) != 0) return -1;
    report(e, b->hooks, b, DS41_STREAM_ATTN, L, bb->br, D);
    ops->hc_post(ops, bb->br, bb->h, bb->a_post, bb->a_comb, M, (int)hc, D, bb->h2);
    float *t = bb->h;
    bb->h = bb->h2;
    bb->h2 = t;

    /* FFN sub-layer (steps 3-4): its input uses the attention's pre;
     * its own pre goes to the next block (step 5). */
    ops->hc_mix(ops, lw->hc_ffn_fn, lw->hc_ffn_scale, lw->hc_ffn_base, bb->h, M, (int)hc, D, e->norm_eps,
                (int)c->hc_sinkhorn_iters, e->hc_eps, bb->pre_mix, bb->f_post, bb->f_comb);
    ops->hc_pre(ops, bb->h, bb->a_pre, M, (int)hc, D, bb->x);
    ops->rmsnorm(ops, lw->ffn_norm, bb->x, M, D, e->norm_eps, bb->xn);
    if (ds41__moe(e, b, L, bb->xn, bb->br, err) != 0) return -1;
    report(e, b->hooks, b, DS41_STREAM_FFN, L, bb->br, D);
    ops->hc_post(ops, bb->br, bb->h, bb->f_post, bb->f_comb, M, (int)hc, D, bb->h2);
    t = bb->h;
    bb->h = bb->h2;
    bb->h2 = t;
    return 0;
}

int ds41_engine_check_mappings(const ds41_engine *e, ds41_error *err) {
    return ds41_checkpoint_check_mappings(e->ckpt, err);
}

/* The pass itself; ds41_forward wraps it with the mapping checks. */
static int forward_pass(ds41_engine *e, ds41_fwd_item *items, size_t n_items, const ds41_fwd_hooks *hooks,
                        ds41_error *err);

int ds41_forward(ds41_engine *e, ds41_fwd_item *items, size_t n_items, const ds41_fwd_hooks *hooks,
                 ds41_error *err) {
    /* A shard lost earlier (storage/map_guard.h): its pages read as zeros
     * now, so nothing this engine computes can be trusted any more. */
    if (ds41_checkpoint_check_mappings(e->ckpt, err) != 0) {
        ds41_engram_cache_unpin_all(e->ecache); /* a step ends: prefetch pins go */
        return -1;
    }
    int rc = forward_pass(e, items, n_items, hooks, err);
    /* Lost during this pass: its results were computed (partly) on zeros. */
    ds41_error lost;
    if (ds41_checkpoint_check_mappings(e->ckpt, &lost) != 0) {
        if (err) *err = lost;
        rc = -1;
    }
    return rc;
}

static int forward_pass(ds41_engine *e, ds41_fwd_item *items, size_t n_items, const ds41_fwd_hooks *hooks,
                        ds41_error *err) {
    if (validate(e, items, n_items, err) != 0) {
        ds41_engram_cache_unpin_all(e->ecache); /* a step ends: prefetch pins go */
        return -1;
    }
    {
        /* A run-time budget change (ds41_engine_request_expert_budget). */
        pthread_mutex_lock(&e->xc_mu);
        const bool pending = e->budget_pending;
        const uint64_t want = e->budget_requested;
        e->budget_pending = false;
        pthread_mutex_unlock(&e->xc_mu);
        ds41_error ignored;
        if (pending) (void)ds41_engine_set_expert_budget(e, want, &ignored);
    }
    const ds41_model_config *c = &e->cfg;
    const ds41_ops *ops = e->ops;
    const size_t hc = (size_t)c->hc_mult, D = (size_t)c->dim, V = (size_t)c->vocab_size;
    const int n_layers = (int)c->n_layers;
    int rc = -1;

    fwd_batch b;
    memset(&b, 0, sizeof b);
    b.items = items;
    b.n_items = n_items;
    b.rope_layer = -1;
    b.hooks = hooks;
    for (size_t i = 0; i < n_items; i++) b.M += items[i].n_ids;
    const size_t M = b.M;
    size_t n_logit_rows = 0;
    for (size_t i = 0; i < n_items; i++)
        if (items[i].logits) n_logit_rows += items[i].logits_last_only ? 1 : items[i].n_ids;

    /* Every buffer of the step from the engine's scratch, released at the end. */
    /* Metadata on the host; every activation in backend memory. */
    const fwd_frame frame = ds41__frame(e);
    b.item_row0 = ds41__host(e, n_items * sizeof *b.item_row0);
    b.item_pos0 = ds41__host(e, n_items * sizeof *b.item_pos0);
    b.row_item = ds41__host(e, M * sizeof *b.row_item);
    b.row_pos = ds41__host(e, M * sizeof *b.row_pos);
    b.row_token = ds41__host(e, M * sizeof *b.row_token);
    b.idx_list = ds41__host(e, c->n_roles * sizeof *b.idx_list);
    b.idx_count = ds41__host(e, c->n_roles * sizeof *b.idx_count);
    const size_t nsl = c->engram_enabled ? (size_t)e->eng.n_layers : 0, ncols = (size_t)e->eng.n_cols;
    const size_t n_hash = M * nsl * ncols;
    int64_t *hash_ids = ds41__host(e, n_hash * sizeof *hash_ids);
    float *pre_init = ds41__host(e, M * hc * sizeof *pre_init);
    uint32_t *logit_row = ds41__host(e, n_logit_rows * sizeof *logit_row);
    b.rope_cs = ds41__dev(e, M * (size_t)c->rope_head_dim * sizeof *b.rope_cs);
    fwd_block_bufs bb;
    const int bb_ok = ds41__block_bufs(e, M, &bb);
    fwd_spec spec;
    memset(&spec, 0, sizeof spec);
    float *lx = ds41__dev(e, n_logit_rows * D * sizeof *lx);
    float *normed = ds41__dev(e, n_logit_rows * D * sizeof *normed);
    float *lg = ds41__dev(e, n_logit_rows * V * sizeof *lg);
    if (!b.item_row0 || !b.item_pos0 || !b.row_item || !b.row_pos || !b.row_token || !b.rope_cs ||
        !b.idx_list || !b.idx_count || !hash_ids || !pre_init || !logit_row || !bb_ok || !lx || !normed ||
        !lg) {
        ds41_fail(err, "forward: out of memory");
        goto out;
    }
    memset(b.idx_list, 0, c->n_roles * sizeof *b.idx_list);
    memset(b.idx_count, 0, c->n_roles * sizeof *b.idx_count);
    for (size_t i = 0, r = 0; i < n_items; i++) {
        b.item_row0[i] = r;
        b.item_pos0[i] = ds41_kv_seq_tokens(items[i].seq);
        for (size_t t = 0; t < items[i].n_ids; t++, r++) {
            b.row_item[r] = i;
            b.row_pos[r] = b.item_pos0[i] + t;
        }
    }
    if (!ds41__dspark_spec_begin(e, &b, &spec)) {
        ds41_fail(err, "forward: out of memory");
        goto out;
    }
    if (ds41__attention_prepare(e, &b, err) != 0) goto out;
    if (nsl && engram_hash(e, &b, hash_ids, err) != 0) goto out;
    if (nsl && e->ecache && engram_request(e, &b, hash_ids, err) != 0) goto out;

    /* Embedding into every copy; block 0's pre-mix is one-hot copy 0. */
    for (size_t i = 0, r = 0; i < n_items; i++)
        for (size_t t = 0; t < items[i].n_ids; t++, r++) b.row_token[r] = items[i].ids[t];
    ops->embed(ops, e->w.embed, b.row_token, M, (int)hc, D, bb.h);
    for (size_t r = 0; r < M; r++)
        for (size_t cp = 0; cp < hc; cp++) pre_init[r * hc + cp] = cp == 0 ? 1.0f : 0.0f;
    e->mem->upload(e->mem, bb.pre_mix, pre_init, M * hc * sizeof *pre_init);

    for (int L = 0; L < n_layers; L++) {
        const ds41_layer_role *role = &c->roles[L];
        report(e, hooks, &b, DS41_STREAM_H, L, bb.h, hc * D);
        report(e, hooks, &b, DS41_STREAM_PRE, L, bb.pre_mix, hc);
        if (hooks && hooks->feed && feed(e, hooks, &b, L, bb.h, bb.pre_mix, hc, D, err) != 0) goto out;
        if (e->ecache) {
            /* Keep the requested rows flowing: reap what arrived, issue what waits. */
            ds41_error perr;
            (void)ds41_engram_cache_poll(e->ecache, &perr); /* a failing reader shows in the gather */
        }
        if (role->engram_slot >= 0 && engram_apply(e, &b, L, hash_ids, bb.h, err) != 0) goto out;

        if (spec.n && role->dspark_tap && ds41__dspark_tap(e, &b, &spec, L, bb.h, err) != 0) goto out;
        if (ds41__block(e, &b, L, &bb, err) != 0) goto out;
    }
    report(e, hooks, &b, DS41_STREAM_H, n_layers, bb.h, hc * D);
    /* The DSpark stages' windows from this step's taps (items with spec_taps). */
    if (spec.n && ds41__dspark_seed(e, &b, &spec, err) != 0) goto out;

    /* Final collapse with the last FFN pre, norm, fp32 head (§2.6-2.7). */
    if (n_logit_rows) {
        float *x = bb.x;
        ops->hc_pre(ops, bb.h, bb.pre_mix, M, (int)hc, D, x);
        size_t k = 0;
        for (size_t i = 0; i < n_items; i++) {
            if (!items[i].logits) continue;
            const size_t first = items[i].logits_last_only ? items[i].n_ids - 1 : 0;
            for (size_t t = first; t < items[i].n_ids; t++) logit_row[k++] = (uint32_t)(b.item_row0[i] + t);
        }
        ops->gather_rows(ops, lx, x, D * sizeof *x, logit_row, n_logit_rows, D * sizeof *lx);
        ops->rmsnorm(ops, e->w.norm, lx, n_logit_rows, D, e->norm_eps, normed);
        ops->linear(ops, &e->w.head, normed, n_logit_rows, lg, DS41_OUT_F32);
        /* The logits the host samples from, copied back item by item. */
        k = 0;
        for (size_t i = 0; i < n_items; i++) {
            if (!items[i].logits) continue;
            const size_t first = items[i].logits_last_only ? items[i].n_ids - 1 : 0, n = items[i].n_ids - first;
            e->mem->download(e->mem, items[i].logits, lg + k * V, n * V * sizeof *lg);
            k += n;
            if (hooks && hooks->stream)
                for (size_t t = first; t < items[i].n_ids; t++)
                    hooks->stream(hooks->ctx, DS41_STREAM_LOGITS, -1, i, t, items[i].logits + (t - first) * V, V);
        }
    }
    for (size_t i = 0; i < n_items; i++) ds41_kv_seq_set_tokens(items[i].seq, b.item_pos0[i] + items[i].n_ids);
    rc = 0;
out:
    if (e->xc) ds41_expert_cache_end_step(e->xc);
    ds41_engram_cache_unpin_all(e->ecache);
    ds41__frame_release(e, frame);
    return rc;
}

/* ---- Engram row tier ---------------------------------------------------------------- */

int ds41_engine_prefetch(ds41_engine *e, ds41_kv_seq *seq, int32_t token, ds41_error *err) {
    if (!e->ecache) return 0;
    if (!seq) return ds41_fail(err, "prefetch: no sequence");
    if (token < 0 || (int64_t)token >= e->cfg.vocab_size || (uint32_t)token >= e->n_map)
        return ds41_fail(err, "prefetch: token id %d outside [0, %lld)", token, (long long)e->cfg.vocab_size);
    /* The hashes of the position `token` will take, on a copy of the history. */
    ds41_engram_history h = *ds41_kv_seq_engram(seq);
    if (ds41_engram_history_push(&h, e->token_map[token], err) != 0) return -1;
    const int nsl = e->eng.n_layers;
    int64_t ids[DS41_ENGRAM_MAX_COLS];
    for (int s = 0; s < nsl; s++) {
        if (ds41_engram_hash_position(&e->eng, s, &h, e->engram_pad, ids, err) != 0) return -1;
        if (ds41_engram_cache_request(e->ecache, (uint32_t)s, ids, (size_t)e->eng.n_cols, err) != 0)
            return ds41_error_prefix(err, "prefetch");
    }
    return 0;
}

bool ds41_engine_engram_stats(const ds41_engine *e, ds41_engram_cache_stats *out) {
    if (!e->ecache) {
        if (out) memset(out, 0, sizeof *out);
        return false;
    }
    if (out) ds41_engram_cache_get_stats(e->ecache, out);
    return true;
}

void ds41_engine_engram_reset_stats(ds41_engine *e) {
    if (e->ecache) ds41_engram_cache_reset_stats(e->ecache);
}

ds41_engram_cache *ds41_engine_engram_cache(ds41_engine *e) {
    return e->ecache;
}
