/* ds41d's engine service: the session, cache, snapshot and expert-budget routes (admin) (see engine_service_internal.h). */
#include "daemon/engine_service_internal.h"

#include "daemon/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sess_acc {
    const char *model;
    ds41_svc_session_emit emit;
    void *acc;
} sess_acc;

static void emit_session(void *p, const ds41_sched_session *ss) {
    sess_acc *a = p;
    char id[200];
    snprintf(id, sizeof id, "%s:%s", a->model, ss->id);
    ds41_svc_session out = {.id = id,
                            .model = a->model,
                            .state = ss->state,
                            .request_id = 0,
                            .prompt_tokens = ss->prompt_tokens,
                            .generated_tokens = ss->generated_tokens,
                            .cached_tokens = ss->cached_tokens,
                            .kv_tokens = ss->kv_tokens,
                            .kv_pages = ss->kv_pages,
                            .kv_bytes = ss->kv_bytes,
                            .created = ss->created,
                            .last_used = ss->last_used,
                            .owner_uid = ss->owner_uid};
    a->emit(a->acc, &out);
}

static int svc_list_sessions(void *ctx, ds41_svc_session_emit emit, void *acc, ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY) {
            sess_acc a = {.model = m->name, .emit = emit, .acc = acc};
            ds41_scheduler_sessions(m->sched, emit_session, &a);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return 0;
}

static int svc_delete_session(void *ctx, const char *id, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    const char *colon = strrchr(id, ':');
    if (!colon) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, NULL, "no session '%s'", id);
    char name[160];
    snprintf(name, sizeof name, "%.*s", (int)(colon - id), id);
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_find_model(s, name);
    int rc = -1;
    if (m) {
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY) rc = ds41_scheduler_delete_session(m->sched, colon + 1);
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    if (rc != 0) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, NULL, "no session '%s'", id);
    return 0;
}

static int svc_cache_info(void *ctx, void (*emit)(void *acc, const ds41_svc_cache *cache), void *acc,
                          ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    ds41_svc_cache c = {0};
    uint64_t kv_used = 0, kv_cap = 0, pc_bytes = 0, hits = 0, misses = 0;
    uint64_t sn_bytes = 0, sn_cap = 0, sn_hits = 0, sn_misses = 0;
    bool first = true;
    ds41_svc_cache_tier xt = {.name = "experts"}, gt = {.name = "engram"}, ht = {.name = "experts_host"};
    bool have_experts = false, have_engram = false, have_host = false, have_device = false;
    uint64_t device[ES_DEVICE_TIERS] = {0}; /* summed over the models on the CUDA backend */
    char budgets[sizeof s->models[0]->budgets] = "";
    pthread_rwlock_rdlock(&s->cfg_lock);
    c.prefix_shared_across_users = s->st.prefix_share;
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY) {
            ds41_sched_stats st;
            ds41_scheduler_stats(m->sched, &st);
            if (first || m->is_default) {
                c.page_tokens = st.kv_page_tokens;
                c.page_bytes = st.kv_page_bytes;
                c.bytes_per_token = st.kv_bytes_per_token;
                first = false;
            }
            c.pages_total += st.kv_pages_max;
            c.pages_used += st.kv_pages_in_use;
            kv_used += st.kv_pages_in_use * st.kv_page_bytes;
            kv_cap += st.kv_pages_max * st.kv_page_bytes;
            pc_bytes += st.cache_bytes;
            hits += st.prefix_hits;
            misses += st.prefix_misses;
            if (m->store) {
                ds41_snapshot_store_stats ss;
                ds41_snapshot_store_get_stats(m->store, &ss);
                sn_bytes += ss.bytes;
                sn_cap += ss.max_bytes;
                sn_hits += ss.hits;
                sn_misses += ss.misses;
            }
            if (m->budgets[0] && (!budgets[0] || m->is_default)) snprintf(budgets, sizeof budgets, "%s", m->budgets);
            ds41_expert_cache_stats xs;
            const bool streamed = ds41_engine_expert_stats(m->engine, &xs, false);
            /* Summed over models; latency of the default (or first) model. */
            if (!have_experts || m->is_default) {
                xt.latency_p50_ns = xs.latency_p50_ns;
                xt.latency_p99_ns = xs.latency_p99_ns;
            }
            have_experts = true;
            xt.streamed = xt.streamed || streamed;
            xt.used_bytes += xs.slots_used * xs.slot_bytes;
            xt.capacity_bytes += xs.budget_bytes;
            xt.total_bytes += xs.total_bytes;
            xt.hits += xs.hits + xs.prefetch_hits;
            xt.misses += xs.misses;
            xt.bytes_read += xs.bytes_read;
            xt.predicted += xs.predicted;
            xt.predicted_used += xs.predicted_used;
            ds41_cuda_mem_stats dm;
            if (es_device_mem(m, &dm)) {
                uint64_t v[ES_DEVICE_TIERS];
                es_device_tier_bytes(&dm, v);
                for (int k = 0; k < ES_DEVICE_TIERS; k++) device[k] += v[k];
                have_device = true;
            }
            /* A device backend's host tier of experts (storage/expert_cache.h). */
            if (xs.host_budget_bytes) {
                have_host = ht.streamed = true;
                ht.used_bytes += xs.host_slots_used * xs.slot_bytes;
                ht.capacity_bytes += xs.host_budget_bytes;
                ht.total_bytes += xs.total_bytes;
                ht.hits += xs.host_hits;
                ht.misses += xs.misses - xs.host_hits;
                ht.bytes_read += xs.bytes_read;
            }
            ds41_engram_cache_stats gs;
            if (ds41_engine_engram_stats(m->engine, &gs)) {
                if (!have_engram || m->is_default) {
                    gt.latency_p50_ns = gs.latency_p50_ns;
                    gt.latency_p99_ns = gs.latency_p99_ns;
                }
                have_engram = true;
                gt.streamed = true;
                gt.used_bytes += gs.entries_used * gs.row_bytes;
                gt.capacity_bytes += gs.budget_bytes;
                gt.hits += gs.hits;
                gt.misses += gs.misses;
                gt.bytes_read += gs.bytes_read;
            }
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    c.pages_free = c.pages_total > c.pages_used ? c.pages_total - c.pages_used : 0;
    ds41_svc_cache_tier tiers[6 + ES_DEVICE_TIERS] = {
        {.name = "kv", .used_bytes = kv_used, .capacity_bytes = kv_cap},
        {.name = "prefix", .used_bytes = pc_bytes, .capacity_bytes = s->st.prefix_cache_max_bytes, .hits = hits,
         .misses = misses},
        {.name = "snapshots", .used_bytes = sn_bytes, .capacity_bytes = sn_cap, .hits = sn_hits, .misses = sn_misses},
        xt,
    };
    c.budgets = budgets[0] ? budgets : NULL;
    c.tiers = tiers;
    c.n_tiers = 2;
    if (s->st.snapshots) c.n_tiers++;
    if (have_experts) tiers[c.n_tiers++] = xt;
    if (have_host) tiers[c.n_tiers++] = ht;
    if (have_engram) tiers[c.n_tiers++] = gt; /* only while its rows are streamed */
    for (int k = 0; have_device && k < ES_DEVICE_TIERS; k++) /* only on the CUDA backend */
        tiers[c.n_tiers++] = (ds41_svc_cache_tier){.name = es_device_tier_names[k], .used_bytes = device[k]};
    emit(acc, &c);
    return 0;
}

/* ---- session snapshots (admin) ------------------------------------------------------------------ */

typedef struct snap_acc {
    const char *model;
    ds41_svc_snapshot_emit emit;
    void *acc;
} snap_acc;

static void emit_snapshot(void *p, const ds41_snapshot_entry *e) {
    snap_acc *a = p;
    char id[256];
    snprintf(id, sizeof id, "%s:%s", a->model, e->name);
    ds41_svc_snapshot out = {.id = id,
                             .model = a->model,
                             .tokens = e->n_ids,
                             .bytes = e->bytes,
                             .created = e->created,
                             .last_used = e->last_used,
                             .has_sampler = e->has_sampler,
                             .owner_uid = e->owner.uid};
    a->emit(a->acc, &out);
}

static int svc_list_snapshots(void *ctx, ds41_svc_snapshot_emit emit, void *acc, ds41_svc_error *err) {
    (void)err;
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models; i++) {
        model *m = s->models[i];
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY && m->store) {
            snap_acc a = {.model = m->name, .emit = emit, .acc = acc};
            ds41_snapshot_store_list(m->store, emit_snapshot, &a);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return 0;
}

/* Split "<model>:<rest>" and take the READY model's read lock (cfg_lock held by the caller).
 * NULL: no such model (or not loaded). */
static model *model_of_id(ds41_engine_service *s, const char *id, const char **rest) {
    const char *colon = id ? strrchr(id, ':') : NULL;
    if (!colon || colon == id || (size_t)(colon - id) >= 160) return NULL;
    char name[160];
    snprintf(name, sizeof name, "%.*s", (int)(colon - id), id);
    model *m = es_find_model(s, name);
    if (!m) return NULL;
    pthread_rwlock_rdlock(&m->lock);
    if (m->state != DS41_MODEL_READY) {
        pthread_rwlock_unlock(&m->lock);
        return NULL;
    }
    *rest = colon + 1;
    return m;
}

static int svc_save_snapshot(void *ctx, const char *session_id, ds41_svc_snapshot_emit emit, void *acc,
                             ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    const char *sid = NULL;
    model *m = model_of_id(s, session_id, &sid);
    int rc = -1;
    if (!m) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "session", "no session '%.200s'", session_id);
    } else if (!m->store) {
        ds41_svc_fail(err, DS41_SVC_CONFLICT, NULL, "snapshots are disabled for model %s (snapshots.enabled)",
                      m->name);
    } else {
        ds41_sched_export x;
        ds41_error e = {{0}};
        if (ds41_scheduler_export(m->sched, sid, &x, &e) != 0) {
            ds41_svc_fail(err, strstr(e.msg, "no session") ? DS41_SVC_NOT_FOUND : DS41_SVC_CONFLICT, "session",
                          "%.200s: %s", session_id, e.msg);
        } else {
            size_t len = ds41_kv_seq_serialized_size(x.seq), written = 0;
            uint8_t *kv = malloc(len);
            ds41_snapshot_entry entry;
            const ds41_snapshot_owner owner = es_owner_of(&x.part); /* the file keeps the session's partition */
            if (!kv || ds41_kv_seq_serialize(x.seq, kv, len, &written, &e) != 0 ||
                ds41_snapshot_store_save(m->store, &owner, x.ids, x.n_ids, kv, len, x.sampler, x.sampler_len,
                                         &entry, &e) != 0) {
                ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "%s", e.msg[0] ? e.msg : "out of memory");
            } else {
                snap_acc a = {.model = m->name, .emit = emit, .acc = acc};
                emit_snapshot(&a, &entry);
                ds41_log(DS41_LOG_INFO, "model %s: saved %s (%zu tokens) as snapshot %s", m->name, session_id,
                         x.n_ids, entry.name);
                rc = 0;
            }
            free(kv);
            ds41_scheduler_export_free(&x);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_restore_snapshot(void *ctx, const char *snapshot_id, char *session_id, size_t session_id_size,
                                uint64_t *tokens, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    const char *name = NULL;
    model *m = model_of_id(s, snapshot_id, &name);
    int rc = -1;
    if (!m || !m->store) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "id", "no snapshot '%.200s'", snapshot_id);
        if (m) pthread_rwlock_unlock(&m->lock);
    } else {
        ds41_snapshot snap;
        ds41_error e = {{0}};
        if (ds41_snapshot_store_load(m->store, name, &snap, &e) != 0) {
            bool missing = strncmp(e.msg, "no snapshot", 11) == 0;
            ds41_svc_fail(err, missing ? DS41_SVC_NOT_FOUND : DS41_SVC_BAD_REQUEST, "id", "%s%s",
                          missing ? "" : "snapshot refused: ", e.msg);
        } else {
            char cid[32];
            const ds41_sched_partition part = es_partition_of(&snap.owner); /* back into its own partition */
            if (ds41_scheduler_import(m->sched, &part, snap.kv, snap.kv_len, snap.ids, snap.n_ids, cid, &e) !=
                0) {
                bool full = strstr(e.msg, "KV cache full") || strstr(e.msg, "cannot keep");
                ds41_svc_fail(err, full ? DS41_SVC_KV_FULL : DS41_SVC_BAD_REQUEST, "id", "snapshot %.200s: %s",
                              snapshot_id, e.msg);
                if (!full && !strstr(e.msg, "stopping") && !strstr(e.msg, "disabled")) {
                    ds41_log(DS41_LOG_WARNING, "model %s: snapshot %s refused: %s (deleted)", m->name, name, e.msg);
                    ds41_snapshot_store_remove(m->store, name, NULL);
                }
            } else {
                snprintf(session_id, session_id_size, "%s:%s", m->name, cid);
                *tokens = snap.n_ids;
                rc = 0;
            }
            ds41_snapshot_free(&snap);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_delete_snapshot(void *ctx, const char *snapshot_id, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    const char *name = NULL;
    model *m = model_of_id(s, snapshot_id, &name);
    int rc = -1;
    if (m) {
        if (m->store) rc = ds41_snapshot_store_remove(m->store, name, NULL);
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    if (rc != 0) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, NULL, "no snapshot '%.200s'", snapshot_id);
    return 0;
}

static int svc_set_expert_budget(void *ctx, const char *name, uint64_t bytes, uint64_t *chosen,
                                 ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    int rc = 0;
    size_t matched = 0;
    bool chosen_default = false;
    pthread_rwlock_rdlock(&s->cfg_lock);
    for (size_t i = 0; i < s->n_models && rc == 0; i++) {
        model *m = s->models[i];
        if (name && strcmp(name, m->name) != 0) continue;
        pthread_rwlock_rdlock(&m->lock);
        if (m->state == DS41_MODEL_READY && m->engine) {
            matched++;
            ds41_error e2 = {{0}};
            /* "auto" (0): the budget the auto sizing chose at load. */
            const uint64_t want = bytes ? bytes : m->auto_expert_bytes;
            if (!bytes && m->auto_expert_error[0])
                rc = ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "bytes", "model %s: auto: %s", m->name,
                                   m->auto_expert_error);
            else if (ds41_engine_request_expert_budget(m->engine, want, &e2) != 0)
                rc = ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "bytes", "model %s: %s", m->name, e2.msg);
            else if (!bytes)
                ds41_log(DS41_LOG_INFO, "model %s: expert budget auto = %llu bytes (%s)", m->name,
                         (unsigned long long)want, want ? "streamed" : "resident");
            if (rc == 0 && chosen && (matched == 1 || (m->is_default && !chosen_default))) {
                *chosen = want;
                chosen_default = m->is_default;
            }
        } else if (name) {
            matched++;
            rc = ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "model %s is not loaded", m->name);
        }
        pthread_rwlock_unlock(&m->lock);
    }
    pthread_rwlock_unlock(&s->cfg_lock);
    if (rc == 0 && !name) { /* the budget of models loaded later too */
        pthread_rwlock_wrlock(&s->cfg_lock);
        s->st.expert_cache_bytes = bytes;
        pthread_rwlock_unlock(&s->cfg_lock);
    }
    if (rc == 0 && name && !matched) return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "model", "no model '%s'", name);
    if (rc == 0 && !matched) return ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "no model is loaded");
    if (rc == 0)
        ds41_log(DS41_LOG_INFO, "expert budget set to %llu bytes (%s) from the next step", (unsigned long long)bytes,
                 name ? name : "every model");
    return rc;
}

void es_cache_routes(ds41_service *iface) {
    iface->list_sessions = svc_list_sessions;
    iface->delete_session = svc_delete_session;
    iface->cache_info = svc_cache_info;
    iface->list_snapshots = svc_list_snapshots;
    iface->save_snapshot = svc_save_snapshot;
    iface->restore_snapshot = svc_restore_snapshot;
    iface->delete_snapshot = svc_delete_snapshot;
    iface->set_expert_budget = svc_set_expert_budget;
}
