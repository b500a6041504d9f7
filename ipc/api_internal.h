/* Helpers shared by ipc/api.c, ipc/api_admin.c and ipc/api_request.c (not a public contract).
 * All of them fill err as a 400 naming the field (see ipc/api.h) and return
 * -1 on a bad value; 0 otherwise.  A null JSON value counts as absent. */
#ifndef DS41_IPC_API_INTERNAL_H
#define DS41_IPC_API_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>

#include "ipc/api.h"
#include "ipc/service.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* A 400 naming the field param, with code (invalid_value, missing_field, ...) and a message. */
int ds41_api_field_error(ds41_svc_error *err, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A 400 invalid_type: "'path' must be <want>, not <kind of v>". */
int ds41_api_type_error(ds41_svc_error *err, const char *path, const char *want, const json_t *v);

/* Parse body as a JSON object (duplicate keys refused). *out: new reference. */
int ds41_api_parse_json(const char *body, size_t len, json_t **out, ds41_svc_error *err);

/* Refuse a key of obj not in the NULL-terminated allowed list.  prefix is the
 * object's own path ("" or NULL at the top level). */
int ds41_api_check_keys(const json_t *obj, const char *prefix, const char *const *allowed,
                        ds41_svc_error *err);

/* Typed getters: *out untouched-or-NULL when absent; required -> missing_field. */
int ds41_api_get_string(const json_t *obj, const char *prefix, const char *key, bool required,
                        const char **out, ds41_svc_error *err);
int ds41_api_get_bool(const json_t *obj, const char *prefix, const char *key, bool *has, bool *out,
                      ds41_svc_error *err);
int ds41_api_get_int(const json_t *obj, const char *prefix, const char *key, long long lo, long long hi,
                     bool *has, long long *out, ds41_svc_error *err);

/* Validate "messages" and produce the normalized compact JSON (malloc()ed). */
int ds41_api_parse_messages(const json_t *messages, char **out_json, ds41_svc_error *err);

/* Validate "tools" (NULL/null/[] -> *out_json NULL).  *names (if names is
 * not NULL) gets a new array of the function names. */
int ds41_api_parse_tools(const json_t *tools, char **out_json, json_t **names, ds41_svc_error *err);

/* A response format (chat's response_format, the Responses API's text.format): its schema must be
 * in the subset structured output enforces (engine/text/json_schema.h ds41_schema_compile_format);
 * else 400 naming the keyword's path under path. */
int ds41_api_check_format_schema(const json_t *format, const char *path, ds41_svc_error *err);

/* A generation the service refused at submission (no event was or will be
 * delivered): under mu, mark it done and take its stream (*out), end that
 * stream, and make sure err says why.  The caller then answers err and drops
 * both references. */
void ds41_api_submit_refused(pthread_mutex_t *mu, bool *done, ds41_http_stream **out, ds41_svc_error *err);

/* Hand a streamed generation's stream (*out, taken under mu) to the
 * exchange, with stop_event as what a draining server sends; then, under
 * mu, mark it attached and end the stream if the generation finished while
 * it was being attached (end_pending).  The caller then drops its reference. */
void ds41_api_attach_stream(ds41_http_exchange *ex, pthread_mutex_t *mu, ds41_http_stream **out, bool *attached,
                            const bool *end_pending, const char *stop_event);

/* thinking / chat_template_kwargs / reasoning_effort -> mode and effort. */
int ds41_api_parse_thinking(const json_t *root, ds41_thinking *mode, int *effort, ds41_svc_error *err);

/* ---- shared by the route files (api.c, api_admin.c) ---- */

#define N_ROUTES 24

struct ds41_api {
    ds41_service svc;
    ds41_http_metrics *metrics;
    ds41_api_options opts;
    ds41_http_route routes[N_ROUTES];
    ds41_http_router router;
    atomic_uint_fast64_t next_id;
    uint32_t salt;
    uint8_t id_key[16]; /* keys the ids clients see (shown_id) */
    struct ds41_response_store *responses; /* stored responses of /v1/responses */
    atomic_int store_pending;              /* threads storing a streamed response (api_responses.c) */
};

json_t *ds41_api_ju64(uint64_t v);
/* The id a client sees for request counter value id (a keyed hash: ids do not count requests). */
uint64_t ds41_api_shown_id(const ds41_api *api, uint64_t id);
/* A finite double as JSON (non-finite: -9999 below zero, else 0). */
json_t *ds41_api_jreal(double v);
/* A service error as its HTTP answer (Retry-After on 429/503). */
void ds41_api_respond_svc_error(ds41_http_exchange *ex, const ds41_svc_error *e);
/* Serialize and send a JSON value (stolen).  NULL -> 500. */
void ds41_api_respond_json(ds41_http_exchange *ex, int status, json_t *v);
void ds41_api_bad_request(ds41_http_exchange *ex, const ds41_svc_error *e);
/* The body as a JSON object, or a 400 sent and -1. */
int ds41_api_parse_body(ds41_http_exchange *ex, json_t **root);
/* Wait for the terminal event of non-streamed generation `id` (*done under mu, sig raised by
 * the sink).  true once done; false when the client went away or the server is stopping: the
 * generation was cancelled and the exchange abandoned or answered 503. */
bool ds41_api_wait_terminal(ds41_http_exchange *ex, ds41_api *api, uint64_t id, pthread_mutex_t *mu,
                            const bool *done, ds41_http_signal *sig);
/* A 501 unless the service implements the route's function. */
bool ds41_api_need(ds41_http_exchange *ex, bool implemented, const char *what);

/* The admin routes (api_admin.c); ctx is the ds41_api. */
void ds41_api_route_admin_cache(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_cache_experts(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_load(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_session_delete(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_sessions(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_snapshot_delete(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_snapshot_restore(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_snapshot_save(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_snapshots(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_admin_unload(ds41_http_exchange *ex, void *ctx);

/* The Responses API routes (api_responses.c); ctx is the ds41_api. */
void ds41_api_route_responses_create(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_responses_get(ds41_http_exchange *ex, void *ctx);
void ds41_api_route_responses_delete(ds41_http_exchange *ex, void *ctx);

#endif
