/* ipc/api_admin.c: the admin routes except GET /admin/models (which shares the model listing of
 * api.c): model load/unload, sessions, caches, snapshots, the expert budget. */
#include "ipc/api.h"
#include "config/daemon_config.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/api_internal.h"
#include "config/json_util.h"

static bool model_path_ok(const char *p, char *why, size_t why_len) {
    size_t n = strlen(p);
    if (n == 0 || p[0] != '/') {
        snprintf(why, why_len, "'path' must be an absolute path");
        return false;
    }
    if (n >= 4096) {
        snprintf(why, why_len, "'path' is too long");
        return false;
    }
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)p[i] < 0x20 || p[i] == 0x7f) {
            snprintf(why, why_len, "'path' contains control characters");
            return false;
        }
    for (const char *s = p; (s = strstr(s, "..")) != NULL; s += 2) {
        bool start = s == p || s[-1] == '/';
        bool end = s[2] == 0 || s[2] == '/';
        if (start && end) {
            snprintf(why, why_len, "'path' must not contain '..' segments");
            return false;
        }
    }
    return true;
}

void ds41_api_route_admin_load(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.load_model != NULL, "model loading")) return;
    json_t *root;
    if (ds41_api_parse_body(ex, &root)) return;
    static const char *const keys[] = {"name", "path", NULL};
    ds41_svc_error err = {0};
    const char *name = NULL, *path = NULL;
    if (ds41_api_check_keys(root, NULL, keys, &err) ||
        ds41_api_get_string(root, NULL, "name", false, &name, &err) ||
        ds41_api_get_string(root, NULL, "path", false, &path, &err))
        goto bad;
    if (!name && !path) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "name", "give 'name' or 'path'");
        snprintf(err.code, sizeof err.code, "missing_field");
        goto bad;
    }
    char why[128];
    if (path && !model_path_ok(path, why, sizeof why)) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "path", "%s", why);
        goto bad;
    }
    if (name && (strlen(name) == 0 || strlen(name) > 256)) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "name", "'name' must have 1..256 bytes");
        goto bad;
    }
    int rc = api->svc.load_model(api->svc.ctx, name, path, &err);
    json_decref(root);
    if (rc < 0) {
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, rc == 0 ? 200 : 202, json_pack("{s:s}", "status", rc == 0 ? "ready" : "loading"));
    return;
bad:
    json_decref(root);
    ds41_api_bad_request(ex, &err);
}

void ds41_api_route_admin_unload(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.unload_model != NULL, "model unloading")) return;
    json_t *root;
    if (ds41_api_parse_body(ex, &root)) return;
    static const char *const keys[] = {"name", NULL};
    ds41_svc_error err = {0};
    const char *name = NULL;
    if (ds41_api_check_keys(root, NULL, keys, &err) ||
        ds41_api_get_string(root, NULL, "name", true, &name, &err)) {
        json_decref(root);
        ds41_api_bad_request(ex, &err);
        return;
    }
    int rc = api->svc.unload_model(api->svc.ctx, name, &err);
    json_decref(root);
    if (rc != 0) {
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s}", "status", "unloaded"));
}

typedef struct list_acc {
    json_t *list;
    bool oom;
} list_acc;

/* A partition owner's uid (admin listings), null when unknown (a peer without credentials). */
static json_t *owner_json(int64_t uid) {
    return uid >= 0 ? json_integer((json_int_t)uid) : json_null();
}

static void session_emit(void *accp, const ds41_svc_session *s) {
    list_acc *acc = accp;
    if (!s || !s->id || acc->oom) return;
    json_t *o = json_object();
    bool ok = o && !ds41_json_set_str(o, "id", s->id) && !ds41_json_set_str(o, "model", s->model) &&
              !ds41_json_set_str(o, "state", s->state) &&
              !ds41_json_set_new(o, "request_id", ds41_api_ju64(s->request_id)) &&
              !ds41_json_set_new(o, "prompt_tokens", ds41_api_ju64(s->prompt_tokens)) &&
              !ds41_json_set_new(o, "generated_tokens", ds41_api_ju64(s->generated_tokens)) &&
              !ds41_json_set_new(o, "cached_tokens", ds41_api_ju64(s->cached_tokens)) &&
              !ds41_json_set_new(o, "kv_tokens", ds41_api_ju64(s->kv_tokens)) &&
              !ds41_json_set_new(o, "kv_pages", ds41_api_ju64(s->kv_pages)) &&
              !ds41_json_set_new(o, "kv_bytes", ds41_api_ju64(s->kv_bytes)) &&
              !ds41_json_set_new(o, "created", json_integer(s->created)) &&
              !ds41_json_set_new(o, "last_used", json_integer(s->last_used)) &&
              !ds41_json_set_new(o, "owner_uid", owner_json(s->owner_uid));
    if (!ok || json_array_append_new(acc->list, o)) {
        if (!ok) json_decref(o);
        acc->oom = true;
    }
}

void ds41_api_route_admin_sessions(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.list_sessions != NULL, "session listing")) return;
    list_acc acc = {.list = json_array()};
    ds41_svc_error err = {0};
    if (!acc.list) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    if (api->svc.list_sessions(api->svc.ctx, session_emit, &acc, &err) != 0) {
        json_decref(acc.list);
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    if (acc.oom) {
        json_decref(acc.list);
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s,s:o}", "object", "list", "data", acc.list));
}

void ds41_api_route_admin_session_delete(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.delete_session != NULL, "session deletion")) return;
    const char *id = ds41_http_path_param(ex);
    ds41_svc_error err = {0};
    if (api->svc.delete_session(api->svc.ctx, id, &err) != 0) {
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s,s:b}", "id", id, "deleted", 1));
}

typedef struct cache_acc {
    json_t *obj;
    int calls;
} cache_acc;

static void cache_emit(void *accp, const ds41_svc_cache *c) {
    cache_acc *acc = accp;
    if (!c || acc->calls++) return;
    json_t *o = json_object();
    json_t *tiers = json_array();
    bool ok = o && tiers;
    for (size_t i = 0; ok && c->tiers && i < c->n_tiers; i++) {
        const ds41_svc_cache_tier *t = &c->tiers[i];
        json_t *to = json_object();
        uint64_t lookups = t->hits + t->misses;
        ok = to && !json_array_append_new(tiers, to) && !ds41_json_set_str(to, "name", t->name) &&
             !ds41_json_set_new(to, "used_bytes", ds41_api_ju64(t->used_bytes)) &&
             !ds41_json_set_new(to, "capacity_bytes", ds41_api_ju64(t->capacity_bytes)) &&
             !ds41_json_set_new(to, "hits", ds41_api_ju64(t->hits)) &&
             !ds41_json_set_new(to, "misses", ds41_api_ju64(t->misses)) &&
             !ds41_json_set_new(to, "hit_rate",
                                lookups ? ds41_api_jreal((double)t->hits / (double)lookups) : json_null());
        if (ok && t->streamed)
            ok = !ds41_json_set_new(to, "streamed", json_true()) &&
                 !ds41_json_set_new(to, "total_bytes", ds41_api_ju64(t->total_bytes)) &&
                 !ds41_json_set_new(to, "bytes_read", ds41_api_ju64(t->bytes_read)) &&
                 !ds41_json_set_new(to, "latency_p50_ns", ds41_api_ju64(t->latency_p50_ns)) &&
                 !ds41_json_set_new(to, "latency_p99_ns", ds41_api_ju64(t->latency_p99_ns)) &&
                 !ds41_json_set_new(to, "predicted", ds41_api_ju64(t->predicted)) &&
                 !ds41_json_set_new(to, "predicted_used", ds41_api_ju64(t->predicted_used)) &&
                 !ds41_json_set_new(to, "prediction_accuracy",
                                    t->predicted ? ds41_api_jreal((double)t->predicted_used / (double)t->predicted)
                                                 : json_null());
        else if (ok && t->total_bytes)
            ok = !ds41_json_set_new(to, "streamed", json_false()) &&
                 !ds41_json_set_new(to, "total_bytes", ds41_api_ju64(t->total_bytes));
    }
    ok = ok && !ds41_json_set_new(o, "page_tokens", ds41_api_ju64(c->page_tokens)) &&
         !ds41_json_set_new(o, "page_bytes", ds41_api_ju64(c->page_bytes)) &&
         !ds41_json_set_new(o, "pages_total", ds41_api_ju64(c->pages_total)) &&
         !ds41_json_set_new(o, "pages_used", ds41_api_ju64(c->pages_used)) &&
         !ds41_json_set_new(o, "pages_free", ds41_api_ju64(c->pages_free)) &&
         !ds41_json_set_new(o, "bytes_per_token", ds41_api_jreal(c->bytes_per_token)) &&
         !json_object_set(o, "tiers", tiers) &&
         (!c->budgets || !ds41_json_set_str(o, "budgets", c->budgets)) &&
         !ds41_json_set_new(o, "prefix_shared_across_users", json_boolean(c->prefix_shared_across_users));
    json_decref(tiers);
    if (!ok) {
        json_decref(o);
        o = NULL;
    }
    acc->obj = o;
}

void ds41_api_route_admin_cache(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.cache_info != NULL, "cache statistics")) return;
    cache_acc acc = {0};
    ds41_svc_error err = {0};
    if (api->svc.cache_info(api->svc.ctx, cache_emit, &acc, &err) != 0) {
        json_decref(acc.obj);
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    if (!acc.obj) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL,
                                acc.calls ? "out of memory" : "the service reported no cache statistics");
        return;
    }
    ds41_api_respond_json(ex, 200, acc.obj);
}

/* ---------------------------------------------------------------- snapshots */

static void snapshot_emit(void *accp, const ds41_svc_snapshot *s) {
    list_acc *acc = accp;
    if (!s || !s->id || acc->oom) return;
    json_t *o = json_object();
    bool ok = o && !ds41_json_set_str(o, "id", s->id) && !ds41_json_set_str(o, "model", s->model) &&
              !ds41_json_set_new(o, "tokens", ds41_api_ju64(s->tokens)) &&
              !ds41_json_set_new(o, "bytes", ds41_api_ju64(s->bytes)) &&
              !ds41_json_set_new(o, "created", json_integer(s->created)) &&
              !ds41_json_set_new(o, "last_used", json_integer(s->last_used)) &&
              !ds41_json_set_new(o, "sampler_state", json_boolean(s->has_sampler)) &&
              !ds41_json_set_new(o, "owner_uid", owner_json(s->owner_uid));
    if (!ok || json_array_append_new(acc->list, o)) {
        if (!ok) json_decref(o);
        acc->oom = true;
    }
}

void ds41_api_route_admin_snapshots(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.list_snapshots != NULL, "snapshots")) return;
    list_acc acc = {.list = json_array()};
    ds41_svc_error err = {0};
    if (!acc.list) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    if (api->svc.list_snapshots(api->svc.ctx, snapshot_emit, &acc, &err) != 0 || acc.oom) {
        json_decref(acc.list);
        if (acc.oom)
            ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        else
            ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s,s:o}", "object", "list", "data", acc.list));
}

/* A body {"KEY": "<id>"} with nothing else; the id 1..200 bytes. */
static int one_id_body(ds41_http_exchange *ex, const char *key, json_t **root, const char **id) {
    if (ds41_api_parse_body(ex, root)) return -1;
    const char *const keys[] = {key, NULL};
    ds41_svc_error err = {0};
    if (ds41_api_check_keys(*root, NULL, keys, &err) || ds41_api_get_string(*root, NULL, key, true, id, &err)) {
        json_decref(*root);
        ds41_api_bad_request(ex, &err);
        return -1;
    }
    if (strlen(*id) == 0 || strlen(*id) > 200) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, key, "'%s' must have 1..200 bytes", key);
        json_decref(*root);
        ds41_api_bad_request(ex, &err);
        return -1;
    }
    return 0;
}

void ds41_api_route_admin_snapshot_save(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.save_snapshot != NULL, "snapshots")) return;
    json_t *root;
    const char *session;
    if (one_id_body(ex, "session", &root, &session)) return;
    list_acc acc = {.list = json_array()};
    ds41_svc_error err = {0};
    int rc = acc.list ? api->svc.save_snapshot(api->svc.ctx, session, snapshot_emit, &acc, &err) : -1;
    json_decref(root);
    if (rc != 0 || acc.oom || json_array_size(acc.list) != 1) {
        if (rc != 0 && acc.list)
            ds41_api_respond_svc_error(ex, &err);
        else
            ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        json_decref(acc.list);
        return;
    }
    json_t *snap = json_incref(json_array_get(acc.list, 0));
    json_decref(acc.list);
    ds41_api_respond_json(ex, 200, snap);
}

void ds41_api_route_admin_snapshot_restore(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.restore_snapshot != NULL, "snapshots")) return;
    json_t *root;
    const char *id;
    if (one_id_body(ex, "id", &root, &id)) return;
    char session[256] = "";
    uint64_t tokens = 0;
    ds41_svc_error err = {0};
    int rc = api->svc.restore_snapshot(api->svc.ctx, id, session, sizeof session, &tokens, &err);
    json_t *out = rc == 0 ? json_pack("{s:s,s:s,s:o}", "id", id, "session", session, "tokens", ds41_api_ju64(tokens)) : NULL;
    json_decref(root);
    if (rc != 0) {
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200, out);
}

void ds41_api_route_admin_snapshot_delete(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.delete_snapshot != NULL, "snapshots")) return;
    const char *id = ds41_http_path_param(ex);
    ds41_svc_error err = {0};
    if (api->svc.delete_snapshot(api->svc.ctx, id, &err) != 0) {
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s,s:b}", "id", id, "deleted", 1));
}

/* POST /admin/cache/experts {"bytes": N | "16GiB" | "auto", "model": name?} */
void ds41_api_route_admin_cache_experts(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.set_expert_budget != NULL, "expert budget changes")) return;
    json_t *root;
    if (ds41_api_parse_body(ex, &root)) return;
    static const char *const keys[] = {"bytes", "model", NULL};
    ds41_svc_error err = {0};
    const char *model = NULL;
    uint64_t bytes = 0;
    if (ds41_api_check_keys(root, NULL, keys, &err) || ds41_api_get_string(root, NULL, "model", false, &model, &err))
        goto bad;
    const json_t *b = json_object_get(root, "bytes");
    if (json_is_integer(b) && json_integer_value(b) >= 0) {
        bytes = (uint64_t)json_integer_value(b);
    } else if (json_is_string(b)) {
        ds41_error perr = {{0}};
        if (strcmp(json_string_value(b), "auto") != 0 && ds41_size_parse(json_string_value(b), &bytes, &perr) != 0) {
            ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "bytes", "'bytes': %s", perr.msg);
            goto bad;
        }
    } else {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "bytes",
                      "'bytes' must be a size: a non-negative integer, a string like \"16GiB\", or \"auto\"");
        goto bad;
    }
    uint64_t chosen = bytes;
    int rc = api->svc.set_expert_budget(api->svc.ctx, model, bytes, &chosen, &err);
    json_decref(root);
    if (rc != 0) {
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200,
                 json_pack("{s:I,s:b,s:s}", "expert_cache_bytes", (json_int_t)chosen, "auto", bytes == 0,
                           "applies", "next step"));
    return;
bad:
    json_decref(root);
    ds41_api_bad_request(ex, &err);
}
