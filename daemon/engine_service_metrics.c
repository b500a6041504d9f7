/* ds41d's engine service: the Prometheus /metrics route (see engine_service_internal.h). */
#include "daemon/engine_service_internal.h"

#include "config/buf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- metrics ---------------------------------------------------------------------------------- */

static void metric_head(ds41_buf *b, const char *name, const char *type, const char *help) {
    ds41_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A model's histogram samples: counts[n] per bucket (non-cumulative), bounds[n - 1] the upper
 * bounds of all but the last (+Inf) bucket, then _sum and _count. */
static void put_histogram(ds41_buf *b, const char *name, const char *model_name, const uint64_t *counts,
                          const unsigned *bounds, size_t n, uint64_t sum, uint64_t count) {
    uint64_t cum = 0;
    for (size_t k = 0; k < n; k++) {
        cum += counts[k];
        if (k + 1 < n)
            ds41_buf_printf(b, "%s_bucket{model=\"%s\",le=\"%u\"} %llu\n", name, model_name, bounds[k],
                            (unsigned long long)cum);
        else
            ds41_buf_printf(b, "%s_bucket{model=\"%s\",le=\"+Inf\"} %llu\n", name, model_name,
                            (unsigned long long)cum);
    }
    ds41_buf_printf(b, "%s_sum{model=\"%s\"} %llu\n", name, model_name, (unsigned long long)sum);
    ds41_buf_printf(b, "%s_count{model=\"%s\"} %llu\n", name, model_name, (unsigned long long)count);
}

/* The storage tiers' ds41_tier_* series of every ready model: the routed
 * experts (tier="experts", always present; streamed 0 while everything is
 * resident) and the Engram rows (tier="engram", only when streamed).  Each
 * family's HELP/TYPE comes once, its samples labelled by tier.  Called with
 * cfg_lock held. */
enum tier_field {
    TF_STREAMED,
    TF_BUDGET,
    TF_USED,
    TF_TOTAL,
    TF_ENTRIES,
    TF_HITS,
    TF_MISSES,
    TF_EARLY,
    TF_WAITED,
    TF_READ_BYTES,
    TF_DEVICE_BYTES,
    TF_ERRORS,
    TF_EVICTIONS,
    TF_PREDICTED,
    TF_PREDICTED_USED,
    TF_UPLOAD_BYTES,
    TF_STALL_NS,
};

/* A field of the expert tier's statistics; false when it has no such field. */
static bool expert_field(const ds41_expert_cache_stats *x, bool streamed, int f, uint64_t *v) {
    switch (f) {
    case TF_STREAMED: *v = streamed; return true;
    case TF_BUDGET: *v = x->budget_bytes; return true;
    case TF_USED: *v = x->slots_used * x->slot_bytes; return true;
    case TF_TOTAL: *v = x->total_bytes; return true;
    case TF_HITS: *v = x->hits + x->prefetch_hits; return true;
    case TF_MISSES: *v = x->misses; return true;
    case TF_READ_BYTES: *v = x->bytes_read; return true;
    case TF_ERRORS: *v = x->read_errors; return true;
    case TF_PREDICTED: *v = x->predicted; return true;
    case TF_PREDICTED_USED: *v = x->predicted_used; return true;
    case TF_UPLOAD_BYTES: *v = x->bytes_uploaded; return true;
    case TF_STALL_NS: *v = x->stall_ns; return true;
    default: return false;
    }
}

/* The expert cache's host tier (tier="experts_host", only with a host tier
 * of its own: a device backend's).  Its hits are device misses it served
 * without a read; its misses, those read from the shards. */
static bool expert_host_field(const ds41_expert_cache_stats *x, int f, uint64_t *v) {
    if (x->host_budget_bytes == 0) return false;
    switch (f) {
    case TF_STREAMED: *v = 1; return true;
    case TF_BUDGET: *v = x->host_budget_bytes; return true;
    case TF_USED: *v = x->host_slots_used * x->slot_bytes; return true;
    case TF_TOTAL: *v = x->total_bytes; return true;
    case TF_HITS: *v = x->host_hits; return true;
    case TF_MISSES: *v = x->misses - x->host_hits; return true;
    case TF_READ_BYTES: *v = x->bytes_read; return true;
    case TF_ERRORS: *v = x->read_errors; return true;
    case TF_EVICTIONS: *v = x->host_evictions; return true;
    default: return false;
    }
}

/* The same for the Engram row tier. */
static bool engram_field(const ds41_engram_cache_stats *g, int f, uint64_t *v) {
    switch (f) {
    case TF_STREAMED: *v = 1; return true;
    case TF_BUDGET: *v = g->budget_bytes; return true;
    case TF_ENTRIES: *v = g->entries_used; return true;
    case TF_HITS: *v = g->hits; return true;
    case TF_MISSES: *v = g->misses; return true;
    case TF_EARLY: *v = g->prefetched_early; return true;
    case TF_WAITED: *v = g->waited; return true;
    case TF_READ_BYTES: *v = g->bytes_read; return true;
    case TF_DEVICE_BYTES: *v = g->bytes_device; return true;
    case TF_ERRORS: *v = g->read_errors; return true;
    case TF_EVICTIONS: *v = g->evictions; return true;
    default: return false;
    }
}

static void tier_metrics(ds41_engine_service *s, ds41_buf *b, const bool *ready, size_t n) {
    const size_t cap = n ? n : 1;
    ds41_expert_cache_stats *xs = calloc(cap, sizeof *xs);
    ds41_engram_cache_stats *es = calloc(cap, sizeof *es);
    bool *have = calloc(cap, sizeof *have), *x_streamed = calloc(cap, sizeof *x_streamed),
         *e_on = calloc(cap, sizeof *e_on);
    if (!xs || !es || !have || !x_streamed || !e_on) goto out;
    for (size_t i = 0; i < n; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (ready[i] && m->state == DS41_MODEL_READY && m->engine) {
            have[i] = true;
            x_streamed[i] = ds41_engine_expert_stats(m->engine, &xs[i], false);
            e_on[i] = ds41_engine_engram_stats(m->engine, &es[i]);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    static const struct {
        const char *name, *type, *help;
        int field;
    } series[] = {
        {"ds41_tier_streamed", "gauge", "1 when the tier reads from disk under its budget, 0 when all resident.",
         TF_STREAMED},
        {"ds41_tier_budget_bytes", "gauge", "The tier's memory budget (0: auto, all resident).", TF_BUDGET},
        {"ds41_tier_used_bytes", "gauge", "Bytes of the expert tier's slots holding data.", TF_USED},
        {"ds41_tier_total_bytes", "gauge", "Bytes of everything the expert tier serves (all routed experts).",
         TF_TOTAL},
        {"ds41_tier_entries", "gauge", "Engram rows cached or being read.", TF_ENTRIES},
        {"ds41_tier_hits_total", "counter",
         "Uses served from memory (experts: incl. predicted loads in time; Engram: distinct rows a step found "
         "cached).",
         TF_HITS},
        {"ds41_tier_misses_total", "counter", "Uses that had to be read from the device.", TF_MISSES},
        {"ds41_tier_prefetched_early_total", "counter",
         "Engram misses whose read had completed when the step needed them.", TF_EARLY},
        {"ds41_tier_waited_total", "counter", "Engram misses the step waited for.", TF_WAITED},
        {"ds41_tier_read_bytes_total", "counter", "Bytes of the tensors read from the shards into the tier.",
         TF_READ_BYTES},
        {"ds41_tier_device_bytes_total", "counter", "Bytes the device returned for Engram rows (alignment included).",
         TF_DEVICE_BYTES},
        {"ds41_tier_read_errors_total", "counter", "Failed reads.", TF_ERRORS},
        {"ds41_tier_evictions_total", "counter", "Engram rows (or experts of the experts' host tier) evicted.",
         TF_EVICTIONS},
        {"ds41_tier_predictions_total", "counter", "Experts predicted for the next layer.", TF_PREDICTED},
        {"ds41_tier_predictions_used_total", "counter", "Predicted experts the layer then used.", TF_PREDICTED_USED},
        {"ds41_tier_uploaded_bytes_total", "counter",
         "Expert bytes copied from host slots to a device backend's slots (0 on the CPU backends).",
         TF_UPLOAD_BYTES},
        {"ds41_tier_stall_nanoseconds_total", "counter", "Time layers waited for expert loads to finish.",
         TF_STALL_NS},
    };
    for (size_t k = 0; k < sizeof series / sizeof series[0]; k++) {
        metric_head(b, series[k].name, series[k].type, series[k].help);
        for (size_t i = 0; i < n; i++) {
            if (!have[i]) continue;
            uint64_t v;
            if (expert_field(&xs[i], x_streamed[i], series[k].field, &v))
                ds41_buf_printf(b, "%s{model=\"%s\",tier=\"experts\"} %llu\n", series[k].name, s->models[i]->name,
                                (unsigned long long)v);
            if (expert_host_field(&xs[i], series[k].field, &v))
                ds41_buf_printf(b, "%s{model=\"%s\",tier=\"experts_host\"} %llu\n", series[k].name,
                                s->models[i]->name, (unsigned long long)v);
            if (e_on[i] && engram_field(&es[i], series[k].field, &v))
                ds41_buf_printf(b, "%s{model=\"%s\",tier=\"engram\"} %llu\n", series[k].name, s->models[i]->name,
                                (unsigned long long)v);
        }
    }
    metric_head(b, "ds41_tier_read_latency_seconds", "gauge",
                "Read latency quantiles of the tier's reads, submission to last byte (bucket upper bounds).");
    for (size_t i = 0; i < n; i++) {
        if (!have[i]) continue;
        if (x_streamed[i]) {
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"experts\",quantile=\"0.5\"} %.9f\n",
                            s->models[i]->name, (double)xs[i].latency_p50_ns * 1e-9);
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"experts\",quantile=\"0.99\"} %.9f\n",
                            s->models[i]->name, (double)xs[i].latency_p99_ns * 1e-9);
        }
        if (e_on[i]) {
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"engram\",quantile=\"0.5\"} %.9f\n",
                            s->models[i]->name, (double)es[i].latency_p50_ns * 1e-9);
            ds41_buf_printf(b, "ds41_tier_read_latency_seconds{model=\"%s\",tier=\"engram\",quantile=\"0.99\"} %.9f\n",
                            s->models[i]->name, (double)es[i].latency_p99_ns * 1e-9);
        }
    }
out:
    free(xs);
    free(es);
    free(have);
    free(x_streamed);
    free(e_on);
}

bool es_device_mem(const model *m, ds41_cuda_mem_stats *out) {
    memset(out, 0, sizeof *out);
    const ds41_backend *be = m->engine ? ds41_engine_backend(m->engine) : NULL;
    if (!be || !ds41_backend_is_cuda(be)) return false;
    ds41_backend_cuda_mem_stats(be, out);
    return true;
}

const char *const es_device_tier_names[ES_DEVICE_TIERS] = {"device-weights", "device-pool",  "device-experts",
                                                           "device-scratch", "device-other", "pinned-host"};

void es_device_tier_bytes(const ds41_cuda_mem_stats *d, uint64_t out[ES_DEVICE_TIERS]) {
    const uint64_t v[ES_DEVICE_TIERS] = {d->weight_bytes,  d->pool_bytes,  d->expert_bytes,
                                         d->scratch_bytes, d->other_bytes, d->pinned_host_bytes};
    memcpy(out, v, sizeof v);
}

/* ds41_device_memory_bytes{model,tier}: the CUDA backend's memory by what holds it, for the
 * ready models that run on it (no samples for the others). */
static void device_metrics(ds41_engine_service *s, ds41_buf *b, const bool *ready, size_t n) {
    metric_head(b, "ds41_device_memory_bytes", "gauge",
                "Device memory the CUDA backend holds by tier (pinned-host: its page-locked host memory).");
    for (size_t i = 0; i < n; i++) {
        model *m = s->models[i];
        ds41_cuda_mem_stats d;
        pthread_rwlock_rdlock(&m->lock);
        const bool on = ready[i] && m->state == DS41_MODEL_READY && es_device_mem(m, &d);
        pthread_rwlock_unlock(&m->lock);
        if (!on) continue;
        uint64_t v[ES_DEVICE_TIERS];
        es_device_tier_bytes(&d, v);
        for (int k = 0; k < ES_DEVICE_TIERS; k++)
            ds41_buf_printf(b, "ds41_device_memory_bytes{model=\"%s\",tier=\"%s\"} %llu\n", m->name,
                            es_device_tier_names[k], (unsigned long long)v[k]);
    }
}

static int svc_metrics(void *ctx, char **text, size_t *text_len, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    ds41_buf b = {0};
    pthread_rwlock_rdlock(&s->cfg_lock);
    size_t n = s->n_models;
    ds41_sched_stats *st = calloc(n ? n : 1, sizeof *st);
    bool *ready = calloc(n ? n : 1, sizeof *ready);
    ds41_model_state *state = calloc(n ? n : 1, sizeof *state);
    ds41_snapshot_store_stats *sn = calloc(n ? n : 1, sizeof *sn);
    bool *has_store = calloc(n ? n : 1, sizeof *has_store);
    if (!st || !ready || !state || !sn || !has_store) {
        pthread_rwlock_unlock(&s->cfg_lock);
        free(st);
        free(ready);
        free(state);
        free(sn);
        free(has_store);
        return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        state[i] = es_effective_state(m, NULL);
        if (m->state == DS41_MODEL_READY) {
            ds41_scheduler_stats(m->sched, &st[i]);
            ready[i] = true;
            if (m->store) {
                ds41_snapshot_store_get_stats(m->store, &sn[i]);
                has_store[i] = true;
            }
        }
        pthread_rwlock_unlock(&m->lock);
    }
    static const char *const state_names[] = {"unloaded", "loading", "ready", "failed"};
    metric_head(&b, "ds41_model_state", "gauge", "1 for the state each configured model is in.");
    for (size_t i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            ds41_buf_printf(&b, "ds41_model_state{model=\"%s\",state=\"%s\"} %d\n", s->models[i]->name, state_names[k],
                            (int)state[i] == k);

#define PER_MODEL(metric, type, help, expr)                                                              \
    do {                                                                                                 \
        metric_head(&b, metric, type, help);                                                             \
        for (size_t i = 0; i < n; i++)                                                                   \
            if (ready[i])                                                                                \
                ds41_buf_printf(&b, metric "{model=\"%s\"} %llu\n", s->models[i]->name,                      \
                                (unsigned long long)(expr));                                             \
    } while (0)

    metric_head(&b, "ds41_requests_total", "counter", "Generation requests by outcome.");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        const struct {
            const char *o;
            uint64_t v;
        } outs[] = {{"stop", st[i].requests_stop},
                    {"length", st[i].requests_length},
                    {"tool_calls", st[i].requests_tool_calls},
                    {"cancelled", st[i].requests_cancelled},
                    {"kv_full", st[i].requests_kv_full},
                    {"error", st[i].requests_error},
                    {"rejected_queue_full", st[i].rejected_queue_full},
                    {"rejected_kv_full", st[i].rejected_kv_full}};
        for (size_t k = 0; k < sizeof outs / sizeof outs[0]; k++)
            ds41_buf_printf(&b, "ds41_requests_total{model=\"%s\",outcome=\"%s\"} %llu\n", s->models[i]->name,
                            outs[k].o, (unsigned long long)outs[k].v);
    }
    PER_MODEL("ds41_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", st[i].prompt_tokens);
    PER_MODEL("ds41_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
              st[i].cached_tokens);
    PER_MODEL("ds41_prefill_tokens_total", "counter", "Prompt tokens that went through the model.", st[i].prefill_tokens);
    PER_MODEL("ds41_generated_tokens_total", "counter", "Sampled tokens.", st[i].generated_tokens);
    metric_head(&b, "ds41_generated_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            ds41_buf_printf(&b, "ds41_generated_tokens_per_second{model=\"%s\"} %.3f\n", s->models[i]->name,
                            st[i].tokens_per_s);
    PER_MODEL("ds41_queue_depth", "gauge", "Requests waiting for a decode slot.", st[i].queued);
    PER_MODEL("ds41_running_sequences", "gauge", "Sequences in prefill or decode.", st[i].running);
    PER_MODEL("ds41_forward_steps_total", "counter", "Forward passes (batched steps).", st[i].steps);
    PER_MODEL("ds41_preemptions_total", "counter", "Sequences preempted because the KV cache was full.",
              st[i].preemptions);
#define PER_STORE(metric, type, help, expr)                                                              \
    do {                                                                                                 \
        metric_head(&b, metric, type, help);                                                             \
        for (size_t i = 0; i < n; i++)                                                                   \
            if (has_store[i])                                                                            \
                ds41_buf_printf(&b, metric "{model=\"%s\"} %llu\n", s->models[i]->name,                      \
                                (unsigned long long)(expr));                                             \
    } while (0)
    PER_STORE("ds41_snapshot_files", "gauge", "Session snapshots on disk.", sn[i].entries);
    PER_STORE("ds41_snapshot_bytes", "gauge", "Bytes of the session snapshots on disk.", sn[i].bytes);
    PER_STORE("ds41_snapshot_hits_total", "counter", "Prefix-cache misses served by a snapshot on disk.", sn[i].hits);
    PER_STORE("ds41_snapshot_misses_total", "counter", "Prefix-cache misses no snapshot on disk covered.",
              sn[i].misses);
    PER_STORE("ds41_snapshot_restored_tokens_total", "counter", "Tokens of the snapshots loaded.",
              sn[i].restored_tokens);
    PER_STORE("ds41_snapshot_load_errors_total", "counter", "Snapshots refused when loading (and deleted).",
              sn[i].load_errors);
    PER_STORE("ds41_snapshot_saves_total", "counter", "Snapshots written.", sn[i].saves);
    PER_STORE("ds41_snapshot_save_errors_total", "counter", "Snapshot writes that failed.", sn[i].save_errors);
    PER_STORE("ds41_snapshot_evictions_total", "counter", "Snapshots deleted by the snapshots.max_bytes cap.",
              sn[i].evictions);
#undef PER_STORE
    metric_head(&b, "ds41_kv_cache_bytes", "gauge", "KV cache page bytes in use and free (free: under the budget).");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        uint64_t used = st[i].kv_pages_in_use * st[i].kv_page_bytes;
        ds41_buf_printf(&b, "ds41_kv_cache_bytes{model=\"%s\",state=\"used\"} %llu\n", s->models[i]->name,
                        (unsigned long long)used);
        if (st[i].kv_pages_max)
            ds41_buf_printf(&b, "ds41_kv_cache_bytes{model=\"%s\",state=\"free\"} %llu\n", s->models[i]->name,
                            (unsigned long long)((st[i].kv_pages_max - st[i].kv_pages_in_use) * st[i].kv_page_bytes));
    }
    metric_head(&b, "ds41_decode_batch_sequences", "histogram", "Sequences decoded together per forward step.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            put_histogram(&b, "ds41_decode_batch_sequences", s->models[i]->name, st[i].decode_hist,
                          ds41_sched_hist_bounds, DS41_SCHED_HIST_BUCKETS, st[i].decode_seqs_sum,
                          st[i].decode_steps);
    PER_MODEL("ds41_speculative_steps_total", "counter",
              "Speculative verification blocks (a token and its drafts fed).", st[i].spec_steps);
    PER_MODEL("ds41_speculative_drafted_total", "counter", "Draft tokens fed for verification.",
              st[i].spec_drafted);
    PER_MODEL("ds41_speculative_accepted_total", "counter", "Draft tokens the output took.",
              st[i].spec_accepted);
    metric_head(&b, "ds41_speculative_accepted_length", "histogram",
                "Accepted drafts per verification block.");
    {
        static const unsigned accepted_bounds[DS41_SPEC_MAX_K + 1] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
        _Static_assert(DS41_SPEC_MAX_K == 8, "one bound per accepted length");
        for (size_t i = 0; i < n; i++) {
            if (!ready[i]) continue;
            uint64_t counts[DS41_SPEC_MAX_K + 2] = {0}; /* the last (+Inf) bucket stays empty */
            memcpy(counts, st[i].spec_hist, sizeof st[i].spec_hist);
            put_histogram(&b, "ds41_speculative_accepted_length", s->models[i]->name, counts, accepted_bounds,
                          DS41_SPEC_MAX_K + 2, st[i].spec_accepted, st[i].spec_steps);
        }
    }
    metric_head(&b, "ds41_cache_hits_total", "counter", "Cache hits by tier.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            ds41_buf_printf(&b, "ds41_cache_hits_total{model=\"%s\",tier=\"prefix\"} %llu\n", s->models[i]->name,
                            (unsigned long long)st[i].prefix_hits);
    metric_head(&b, "ds41_cache_misses_total", "counter", "Cache misses by tier.");
    for (size_t i = 0; i < n; i++)
        if (ready[i])
            ds41_buf_printf(&b, "ds41_cache_misses_total{model=\"%s\",tier=\"prefix\"} %llu\n", s->models[i]->name,
                            (unsigned long long)st[i].prefix_misses);
    metric_head(&b, "ds41_cache_hit_ratio", "gauge", "Hits / (hits + misses) by tier since start.");
    for (size_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        uint64_t t = st[i].prefix_hits + st[i].prefix_misses;
        ds41_buf_printf(&b, "ds41_cache_hit_ratio{model=\"%s\",tier=\"prefix\"} %.6f\n", s->models[i]->name,
                        t ? (double)st[i].prefix_hits / (double)t : 0.0);
    }
    PER_MODEL("ds41_prefix_cache_entries", "gauge", "Prefix-cache snapshots kept.", st[i].cache_entries);
    PER_MODEL("ds41_prefix_cache_bytes", "gauge", "KV page bytes the prefix-cache snapshots reference.",
              st[i].cache_bytes);
    tier_metrics(s, &b, ready, n);
    device_metrics(s, &b, ready, n);
#undef PER_MODEL
    pthread_rwlock_unlock(&s->cfg_lock);
    free(st);
    free(ready);
    free(state);
    free(sn);
    free(has_store);
    *text = ds41_buf_take(&b, text_len);
    if (!*text) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
    return 0;
}

void es_metrics_routes(ds41_service *iface) {
    iface->metrics = svc_metrics;
}
