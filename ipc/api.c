/* OpenAI-compatible and admin routes over a ds41_service (see ipc/api.h).
 *
 * A generation request lives in a gen_ctx shared by the route handler (on the
 * connection's thread) and the service (which calls sink_event from its own
 * threads): reference counted, one reference each; the service's is dropped
 * at the terminal event.  Streams go out through a ds41_http_stream whose
 * abandon callback cancels the generation; non-streaming requests wait for
 * the terminal event with ds41_http_wait(), which also notices a client
 * that goes away. */
#include "ipc/api.h"
#include "config/buf.h"
#include "config/daemon_config.h"
#include "config/sha256.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "ipc/api_anthropic.h"
#include "ipc/api_internal.h"
#include "ipc/response_store.h"
#include "config/json_util.h"
#include "config/utf8.h"

#define MAX_TOOL_CALLS 128

/* ------------------------------------------------------------- utilities */

json_t *ds41_api_ju64(uint64_t v) {
    return json_integer(v > (uint64_t)LLONG_MAX ? LLONG_MAX : (json_int_t)v);
}

json_t *ds41_api_jreal(double v) {
    return json_real(isfinite(v) ? v : (v < 0 ? -9999.0 : 0.0));
}

/* A logprob value as OpenAI shows it (-inf -> -9999). */
static json_t *jlogprob(double v) {
    if (isnan(v) || v < -9999.0) v = -9999.0;
    if (v > 0) v = 0;
    return json_real(v);
}

static int64_t unix_now(void) {
    return (int64_t)time(NULL);
}

int ds41_api_http_status(ds41_svc_status status) {
    switch (status) {
    case DS41_SVC_BAD_REQUEST:
    case DS41_SVC_CONTEXT_LENGTH:
        return 400;
    case DS41_SVC_FORBIDDEN:
        return 403;
    case DS41_SVC_NOT_FOUND:
        return 404;
    case DS41_SVC_CONFLICT:
        return 409;
    case DS41_SVC_QUEUE_FULL:
        return 429;
    case DS41_SVC_KV_FULL:
    case DS41_SVC_UNAVAILABLE:
    case DS41_SVC_CANCELLED:
        return 503;
    case DS41_SVC_OK:
    case DS41_SVC_INTERNAL:
        return 500;
    }
    return 500;
}

static const char *svc_code(const ds41_svc_error *e) {
    if (e->code[0]) return e->code;
    if (e->status == DS41_SVC_OK) return "internal_error";
    return ds41_svc_status_code(e->status);
}

void ds41_api_respond_svc_error(ds41_http_exchange *ex, const ds41_svc_error *e) {
    int status = ds41_api_http_status(e->status);
    if (status == 429 || status == 503) {
        char ra[16];
        snprintf(ra, sizeof ra, "%u", e->retry_after_s ? e->retry_after_s : 1);
        ds41_http_add_header(ex, "Retry-After", ra);
    }
    const char *msg = e->message[0] ? e->message : "the service failed without a message";
    ds41_http_respond_error(ex, status, NULL, svc_code(e), e->param, "%s", msg);
}

/* Serialize and send a JSON value (stolen).  NULL -> 500. */
void ds41_api_respond_json(ds41_http_exchange *ex, int status, json_t *v) {
    size_t len = 0;
    char *text = v ? ds41_json_dump(v, &len) : NULL;
    json_decref(v);
    if (!text) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    ds41_http_respond(ex, status, NULL, text, len);
    free(text);
}

void ds41_api_bad_request(ds41_http_exchange *ex, const ds41_svc_error *e) {
    ds41_api_respond_svc_error(ex, e);
}

int ds41_api_parse_body(ds41_http_exchange *ex, json_t **root) {
    size_t len;
    const char *body = ds41_http_body(ex, &len);
    ds41_svc_error err = {0};
    if (ds41_api_parse_json(body, len, root, &err)) {
        ds41_api_bad_request(ex, &err);
        return -1;
    }
    return 0;
}

bool ds41_api_need(ds41_http_exchange *ex, bool implemented, const char *what) {
    if (implemented) return true;
    ds41_http_respond_error(ex, 501, "server_error", "not_implemented", NULL,
                            "the service does not implement %s", what);
    return false;
}

/* ================================================================ gen_ctx */

typedef struct tool_acc {
    bool seen;
    char id[64];
    char *name;
    ds41_buf args;
} tool_acc;

typedef struct gen_ctx {
    pthread_mutex_t mu;
    int refs;
    uint64_t id;
    uint64_t shown_id; /* what response and tool-call ids show instead of the counter */
    uint32_t salt;
    char response_id[64];
    ds41_gen_accept accept;
    int64_t created;
    ds41_gen_kind kind;
    bool stream;
    bool include_usage;
    bool logprobs;
    int top_logprobs;
    bool done;
    /* stream */
    ds41_http_stream *out;
    bool attached;
    bool end_pending;
    bool started; /* role chunk / echo sent */
    char *echo;
    size_t echo_len;
    uint64_t text_offset;
    /* non-stream */
    ds41_buf content, reasoning;
    json_t *lp_content, *lp_reasoning;             /* chat */
    json_t *c_tokens, *c_lps, *c_tops, *c_offsets; /* completions */
    tool_acc tools[MAX_TOOL_CALLS];
    /* terminal */
    bool failed;
    ds41_finish_reason finish;
    ds41_gen_usage usage;
    ds41_svc_error error;
    ds41_http_signal sig;
} gen_ctx;

static void gen_free(gen_ctx *g) {
    free(g->echo);
    free(g->content.data);
    free(g->reasoning.data);
    json_decref(g->lp_content);
    json_decref(g->lp_reasoning);
    json_decref(g->c_tokens);
    json_decref(g->c_lps);
    json_decref(g->c_tops);
    json_decref(g->c_offsets);
    for (int i = 0; i < MAX_TOOL_CALLS; i++) {
        free(g->tools[i].name);
        free(g->tools[i].args.data);
    }
    ds41_http_signal_destroy(&g->sig);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

static void gen_unref(gen_ctx *g) {
    pthread_mutex_lock(&g->mu);
    int left = --g->refs;
    pthread_mutex_unlock(&g->mu);
    if (left == 0) gen_free(g);
}

static const char *finish_name(ds41_finish_reason r) {
    switch (r) {
    case DS41_FINISH_LENGTH:
        return "length";
    case DS41_FINISH_TOOL_CALLS:
        return "tool_calls";
    default:
        return "stop";
    }
}

/* llama-server's "timings" (its names, so its clients read them): cache_n prompt tokens from the
 * prefix cache, prompt_n prefilled, predicted_n generated. */
static json_t *timings_json(const ds41_gen_usage *u) {
    uint64_t prompt_n =
        u->prompt_tokens - (u->cached_tokens < u->prompt_tokens ? u->cached_tokens : u->prompt_tokens);
    double pms = u->prefill_ms > 0 ? u->prefill_ms : 0, dms = u->decode_ms > 0 ? u->decode_ms : 0;
    return json_pack("{s:I,s:I,s:f,s:f,s:f,s:I,s:f,s:f,s:f}", "cache_n", (json_int_t)u->cached_tokens,
                     "prompt_n", (json_int_t)prompt_n, "prompt_ms", pms, "prompt_per_token_ms",
                     prompt_n ? pms / (double)prompt_n : 0.0, "prompt_per_second",
                     pms > 0 ? (double)prompt_n * 1000.0 / pms : 0.0, "predicted_n",
                     (json_int_t)u->completion_tokens, "predicted_ms", dms, "predicted_per_token_ms",
                     u->completion_tokens ? dms / (double)u->completion_tokens : 0.0, "predicted_per_second",
                     dms > 0 ? (double)u->completion_tokens * 1000.0 / dms : 0.0);
}

/* Adds "timings" to a response object or chunk (when the service measured them). */
static void add_timings(json_t *o, const ds41_gen_usage *u) {
    if (o && u->has_timings) json_object_set_new(o, "timings", timings_json(u));
}

static json_t *usage_json(const ds41_gen_usage *u) {
    json_t *o = json_object();
    json_t *pd = json_object();
    json_t *cd = json_object();
    if (!o || !pd || !cd) goto fail;
    if (ds41_json_set_new(o, "prompt_tokens", ds41_api_ju64(u->prompt_tokens)) ||
        ds41_json_set_new(o, "completion_tokens", ds41_api_ju64(u->completion_tokens)) ||
        ds41_json_set_new(o, "total_tokens", ds41_api_ju64(u->prompt_tokens + u->completion_tokens)) ||
        ds41_json_set_new(pd, "cached_tokens", ds41_api_ju64(u->cached_tokens)) ||
        ds41_json_set_new(cd, "reasoning_tokens", ds41_api_ju64(u->reasoning_tokens)))
        goto fail;
    json_object_set_new(o, "prompt_tokens_details", pd);
    json_object_set_new(o, "completion_tokens_details", cd);
    return o;
fail:
    json_decref(o);
    json_decref(pd);
    json_decref(cd);
    return NULL;
}

static json_t *bytes_json(const char *s, size_t n) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer((unsigned char)s[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* One OpenAI chat logprob entry. */
static json_t *chat_logprob_json(const ds41_gen_logprob *lp, int max_top) {
    json_t *o = json_object();
    json_t *tops = json_array();
    if (!o || !tops) goto fail;
    if (ds41_json_set_new(o, "token", ds41_json_string_lossy(lp->token, lp->token_len)) ||
        ds41_json_set_new(o, "logprob", jlogprob(lp->logprob)) ||
        ds41_json_set_new(o, "bytes", bytes_json(lp->token, lp->token_len)))
        goto fail;
    size_t n = lp->n_top < (size_t)max_top ? lp->n_top : (size_t)max_top;
    for (size_t i = 0; lp->top && i < n; i++) {
        const ds41_gen_top_logprob *t = &lp->top[i];
        json_t *to = json_object();
        if (!to || json_array_append_new(tops, to) ||
            ds41_json_set_new(to, "token", ds41_json_string_lossy(t->token, t->token_len)) ||
            ds41_json_set_new(to, "logprob", jlogprob(t->logprob)) ||
            ds41_json_set_new(to, "bytes", bytes_json(t->token, t->token_len)))
            goto fail;
    }
    json_object_set_new(o, "top_logprobs", tops);
    return o;
fail:
    json_decref(o);
    json_decref(tops);
    return NULL;
}

/* Append the event's logprobs to the chat arrays (content / reasoning). */
static int chat_logprobs_append(const gen_ctx *g, const ds41_gen_event *ev, json_t *content,
                                json_t *reasoning) {
    for (size_t i = 0; i < ev->n_logprobs; i++) {
        json_t *e = chat_logprob_json(&ev->logprobs[i], g->top_logprobs);
        if (!e) return -1;
        if (json_array_append_new(ev->logprobs[i].reasoning ? reasoning : content, e)) return -1;
    }
    return 0;
}

/* Completion-style logprobs for the event's tokens, appended to the arrays. */
static int completion_logprobs_append(gen_ctx *g, const ds41_gen_event *ev, json_t *tokens, json_t *lps,
                                      json_t *tops, json_t *offsets) {
    for (size_t i = 0; i < ev->n_logprobs; i++) {
        const ds41_gen_logprob *lp = &ev->logprobs[i];
        json_t *top = json_object();
        if (!top || json_array_append_new(tops, top)) return -1;
        size_t n = lp->n_top < (size_t)g->top_logprobs ? lp->n_top : (size_t)g->top_logprobs;
        for (size_t k = 0; lp->top && k < n; k++) {
            json_t *key = ds41_json_string_lossy(lp->top[k].token, lp->top[k].token_len);
            if (!key) return -1;
            int rc = json_object_setn_new(top, json_string_value(key), json_string_length(key),
                                          jlogprob(lp->top[k].logprob));
            json_decref(key);
            if (rc) return -1;
        }
        if (json_array_append_new(tokens, ds41_json_string_lossy(lp->token, lp->token_len)) ||
            json_array_append_new(lps, jlogprob(lp->logprob)) ||
            json_array_append_new(offsets, ds41_api_ju64(g->text_offset)))
            return -1;
        g->text_offset += lp->token_len;
    }
    return 0;
}

/* ------------------------------------------------------- stream chunks */

/* Write "data: {chunk}\n\n" with choices = [choice] (or [] and usage). */
static void emit_chunk_locked(gen_ctx *g, json_t *choice, json_t *usage, const ds41_gen_usage *timings) {
    json_t *o = json_object();
    json_t *choices = json_array();
    bool ok = o && choices;
    ok = ok && !ds41_json_set_str(o, "id", g->response_id);
    ok = ok && !ds41_json_set_str(o, "object",
                                  g->kind == DS41_GEN_CHAT ? "chat.completion.chunk" : "text_completion");
    ok = ok && !ds41_json_set_new(o, "created", json_integer(g->created));
    ok = ok && !ds41_json_set_str(o, "model", g->accept.model);
    if (ok && choice) ok = !json_array_append(choices, choice);
    ok = ok && !json_object_set(o, "choices", choices);
    if (ok && g->include_usage) ok = !ds41_json_set_new(o, "usage", usage ? json_incref(usage) : json_null());
    if (ok && timings) add_timings(o, timings);
    if (ok) {
        size_t len;
        char *text = ds41_json_dump(o, &len);
        if (text) {
            ds41_buf b = {0};
            ds41_buf_put(&b, "data: ", 6);
            ds41_buf_put(&b, text, len);
            ds41_buf_put(&b, "\n\n", 2);
            if (!b.oom && g->out) ds41_http_stream_write(g->out, b.data, b.len);
            free(b.data);
            free(text);
        }
    }
    json_decref(o);
    json_decref(choices);
    json_decref(choice);
    json_decref(usage);
}

static json_t *chat_choice(json_t *delta, json_t *logprobs, const char *finish) {
    json_t *c = json_object();
    if (!c || !delta) {
        json_decref(c);
        json_decref(delta);
        json_decref(logprobs);
        return NULL;
    }
    json_object_set_new(c, "index", json_integer(0));
    json_object_set_new(c, "delta", delta);
    json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    return c;
}

static json_t *text_choice(json_t *text, json_t *logprobs, const char *finish) {
    json_t *c = json_object();
    if (!c || !text) {
        json_decref(c);
        json_decref(text);
        json_decref(logprobs);
        return NULL;
    }
    json_object_set_new(c, "index", json_integer(0));
    json_object_set_new(c, "text", text);
    json_object_set_new(c, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(c, "finish_reason", finish ? json_string(finish) : json_null());
    return c;
}

/* First chunk: the assistant role (chat) or the echoed prompt (completions). */
static void start_stream_locked(gen_ctx *g) {
    if (g->started) return;
    g->started = true;
    if (g->kind == DS41_GEN_CHAT) {
        emit_chunk_locked(g,
                          chat_choice(json_pack("{s:s,s:s}", "role", "assistant", "content", ""), NULL, NULL),
                          NULL, NULL);
    } else if (g->echo) {
        emit_chunk_locked(g, text_choice(ds41_json_string_lossy(g->echo, g->echo_len), NULL, NULL), NULL,
                          NULL);
        g->text_offset = g->echo_len;
    }
}

static void tool_call_id(const gen_ctx *g, int index, const char *given, char out[64]) {
    if (given && *given && strlen(given) < 64 && ds41_utf8_valid(given, strlen(given), NULL))
        snprintf(out, 64, "%s", given);
    else
        snprintf(out, 64, "call_%08" PRIx32 "%012" PRIx64 "%04x", g->salt,
                 g->shown_id & UINT64_C(0xFFFFFFFFFFFF), (unsigned)index);
}

static void stream_event_locked(gen_ctx *g, const ds41_gen_event *ev) {
    start_stream_locked(g);
    switch (ev->type) {
    case DS41_GEN_DELTA: {
        if (g->kind == DS41_GEN_COMPLETION) {
            /* Completions have no reasoning channel: all text is text. */
            ds41_buf t = {0};
            ds41_buf_put(&t, ev->reasoning, ev->reasoning_len);
            ds41_buf_put(&t, ev->content, ev->content_len);
            json_t *lp = NULL;
            if (g->logprobs && ev->n_logprobs) {
                json_t *tok = json_array(), *lps = json_array(), *tops = json_array(), *off = json_array();
                if (tok && lps && tops && off && !completion_logprobs_append(g, ev, tok, lps, tops, off))
                    lp = json_pack("{s:O,s:O,s:O,s:O}", "tokens", tok, "token_logprobs", lps, "top_logprobs",
                                   tops, "text_offset", off);
                json_decref(tok);
                json_decref(lps);
                json_decref(tops);
                json_decref(off);
            } else {
                g->text_offset += t.len;
            }
            if (t.len || lp)
                emit_chunk_locked(g, text_choice(ds41_json_string_lossy(t.data, t.len), lp, NULL), NULL,
                                  NULL);
            else
                json_decref(lp);
            free(t.data);
            return;
        }
        json_t *delta = json_object();
        if (!delta) return;
        if (ev->reasoning_len)
            ds41_json_set_new(delta, "reasoning_content",
                              ds41_json_string_lossy(ev->reasoning, ev->reasoning_len));
        if (ev->content_len)
            ds41_json_set_new(delta, "content", ds41_json_string_lossy(ev->content, ev->content_len));
        json_t *lp = NULL;
        if (g->logprobs && ev->n_logprobs) {
            json_t *c = json_array(), *r = json_array();
            if (c && r && !chat_logprobs_append(g, ev, c, r)) {
                lp = json_object();
                if (lp) {
                    json_object_set(lp, "content", c);
                    if (json_array_size(r)) json_object_set(lp, "reasoning_content", r);
                }
            }
            json_decref(c);
            json_decref(r);
        }
        if (json_object_size(delta) == 0 && !lp) {
            json_decref(delta);
            return;
        }
        emit_chunk_locked(g, chat_choice(delta, lp, NULL), NULL, NULL);
        return;
    }
    case DS41_GEN_TOOL_CALL: {
        if (g->kind != DS41_GEN_CHAT || ev->tool_index < 0 || ev->tool_index >= MAX_TOOL_CALLS) return;
        tool_acc *t = &g->tools[ev->tool_index];
        json_t *fn = json_object();
        json_t *call = json_object();
        if (!fn || !call) {
            json_decref(fn);
            json_decref(call);
            return;
        }
        json_object_set_new(call, "index", json_integer(ev->tool_index));
        if (!t->seen) {
            t->seen = true;
            tool_call_id(g, ev->tool_index, ev->tool_id, t->id);
            ds41_json_set_str(call, "id", t->id);
            ds41_json_set_str(call, "type", "function");
            ds41_json_set_str(fn, "name", ev->tool_name ? ev->tool_name : "");
        }
        ds41_json_set_new(fn, "arguments", ds41_json_string_lossy(ev->arguments, ev->arguments_len));
        json_object_set_new(call, "function", fn);
        json_t *delta = json_pack("{s:[o]}", "tool_calls", call);
        emit_chunk_locked(g, chat_choice(delta, NULL, NULL), NULL, NULL);
        return;
    }
    case DS41_GEN_FINISH: {
        if (ev->finish_reason == DS41_FINISH_CANCELLED) {
            ds41_svc_error e = {0};
            ds41_svc_fail(&e, DS41_SVC_CANCELLED, NULL, "the request was cancelled by the server");
            char *body = ds41_http_error_json(503, NULL, "cancelled", NULL, e.message, NULL);
            if (body && g->out) {
                ds41_buf b = {0};
                ds41_buf_put(&b, "data: ", 6);
                ds41_buf_put(&b, body, strlen(body));
                ds41_buf_put(&b, "\n\n", 2);
                if (!b.oom) ds41_http_stream_write(g->out, b.data, b.len);
                free(b.data);
            }
            free(body);
            return;
        }
        /* timings go on the last chunk: the usage chunk, else the finish_reason one */
        const char *fin = finish_name(ev->finish_reason);
        const ds41_gen_usage *t = g->include_usage ? NULL : &ev->usage;
        if (g->kind == DS41_GEN_CHAT)
            emit_chunk_locked(g, chat_choice(json_object(), NULL, fin), NULL, t);
        else
            emit_chunk_locked(g, text_choice(json_string(""), NULL, fin), NULL, t);
        if (g->include_usage) emit_chunk_locked(g, NULL, usage_json(&ev->usage), &ev->usage);
        static const char done[] = "data: [DONE]\n\n";
        if (g->out) ds41_http_stream_write(g->out, done, sizeof done - 1);
        return;
    }
    case DS41_GEN_ERROR: {
        const ds41_svc_error *e = &ev->error;
        char *body = ds41_http_error_json(ds41_api_http_status(e->status), NULL, svc_code(e), e->param,
                                          e->message[0] ? e->message : "generation failed", NULL);
        if (body && g->out) {
            ds41_buf b = {0};
            ds41_buf_put(&b, "data: ", 6);
            ds41_buf_put(&b, body, strlen(body));
            ds41_buf_put(&b, "\n\n", 2);
            if (!b.oom) ds41_http_stream_write(g->out, b.data, b.len);
            free(b.data);
        }
        free(body);
        return;
    }
    }
}

static void accumulate_locked(gen_ctx *g, const ds41_gen_event *ev) {
    switch (ev->type) {
    case DS41_GEN_DELTA:
        if (g->kind == DS41_GEN_COMPLETION) {
            ds41_buf_put(&g->content, ev->reasoning, ev->reasoning_len);
            ds41_buf_put(&g->content, ev->content, ev->content_len);
            if (g->logprobs && ev->n_logprobs) {
                if (!g->c_tokens) {
                    g->c_tokens = json_array();
                    g->c_lps = json_array();
                    g->c_tops = json_array();
                    g->c_offsets = json_array();
                }
                if (g->c_tokens && g->c_lps && g->c_tops && g->c_offsets)
                    completion_logprobs_append(g, ev, g->c_tokens, g->c_lps, g->c_tops, g->c_offsets);
            } else {
                g->text_offset += ev->reasoning_len + ev->content_len;
            }
            return;
        }
        ds41_buf_put(&g->content, ev->content, ev->content_len);
        ds41_buf_put(&g->reasoning, ev->reasoning, ev->reasoning_len);
        if (g->logprobs && ev->n_logprobs) {
            if (!g->lp_content) g->lp_content = json_array();
            if (!g->lp_reasoning) g->lp_reasoning = json_array();
            if (g->lp_content && g->lp_reasoning) chat_logprobs_append(g, ev, g->lp_content, g->lp_reasoning);
        }
        return;
    case DS41_GEN_TOOL_CALL: {
        if (g->kind != DS41_GEN_CHAT || ev->tool_index < 0 || ev->tool_index >= MAX_TOOL_CALLS) return;
        tool_acc *t = &g->tools[ev->tool_index];
        if (!t->seen) {
            t->seen = true;
            tool_call_id(g, ev->tool_index, ev->tool_id, t->id);
            t->name = strdup(ev->tool_name ? ev->tool_name : "");
        }
        ds41_buf_put(&t->args, ev->arguments, ev->arguments_len);
        return;
    }
    default:
        return;
    }
}

/* The service's callback. */
static void sink_event(void *ctx, const ds41_gen_event *ev) {
    gen_ctx *g = ctx;
    if (!ev) return;
    pthread_mutex_lock(&g->mu);
    if (g->done) { /* contract violation: nothing after the terminal event */
        pthread_mutex_unlock(&g->mu);
        return;
    }
    bool terminal = ev->type == DS41_GEN_FINISH || ev->type == DS41_GEN_ERROR;
    if (g->stream)
        stream_event_locked(g, ev);
    else
        accumulate_locked(g, ev);
    ds41_http_stream *to_end = NULL;
    if (terminal) {
        g->done = true;
        if (ev->type == DS41_GEN_ERROR ||
            (ev->type == DS41_GEN_FINISH && ev->finish_reason == DS41_FINISH_CANCELLED)) {
            g->failed = true;
            if (ev->type == DS41_GEN_ERROR)
                g->error = ev->error;
            else
                ds41_svc_fail(&g->error, DS41_SVC_CANCELLED, NULL, "the request was cancelled by the server");
            g->error.message[sizeof g->error.message - 1] = 0;
            g->error.param[sizeof g->error.param - 1] = 0;
            g->error.code[sizeof g->error.code - 1] = 0;
        } else {
            g->finish = ev->finish_reason;
            g->usage = ev->usage;
        }
        if (g->stream) {
            if (g->attached) {
                to_end = g->out;
                g->out = NULL;
            } else {
                g->end_pending = true;
            }
        }
    }
    pthread_mutex_unlock(&g->mu);
    if (terminal) {
        if (to_end) ds41_http_stream_end(to_end);
        if (!g->stream) ds41_http_signal_raise(&g->sig);
        gen_unref(g); /* the service's reference */
    }
}

/* What a stream's abandon callback needs: the service and the request id. */
typedef struct cancel_ctx {
    ds41_service svc;
    uint64_t id;
} cancel_ctx;

static void cancel_on_abandon(void *ctx) {
    cancel_ctx *c = ctx;
    c->svc.cancel(c->svc.ctx, c->id);
}

/* --------------------------------------------------- response building */

static json_t *build_chat_response(gen_ctx *g) {
    json_t *msg = json_object();
    json_t *tools = json_array();
    if (!msg || !tools) goto fail;
    for (int i = 0; i < MAX_TOOL_CALLS; i++) {
        tool_acc *t = &g->tools[i];
        if (!t->seen) continue;
        json_t *call = json_object(), *fn = json_object();
        if (!call || !fn || json_array_append_new(tools, call)) {
            json_decref(fn);
            goto fail;
        }
        ds41_json_set_str(call, "id", t->id);
        ds41_json_set_str(call, "type", "function");
        ds41_json_set_str(fn, "name", t->name ? t->name : "");
        ds41_json_set_new(fn, "arguments", ds41_json_string_lossy(t->args.data, t->args.len));
        json_object_set_new(call, "function", fn);
    }
    ds41_json_set_str(msg, "role", "assistant");
    if (g->content.len || json_array_size(tools) == 0)
        ds41_json_set_new(msg, "content", ds41_json_string_lossy(g->content.data, g->content.len));
    else
        json_object_set_new(msg, "content", json_null());
    if (g->reasoning.len)
        ds41_json_set_new(msg, "reasoning_content", ds41_json_string_lossy(g->reasoning.data, g->reasoning.len));
    if (json_array_size(tools)) json_object_set(msg, "tool_calls", tools);
    json_t *lp = json_null();
    if (g->logprobs) {
        json_decref(lp);
        lp = json_object();
        if (lp) {
            json_object_set_new(lp, "content", g->lp_content ? json_incref(g->lp_content) : json_array());
            if (g->lp_reasoning && json_array_size(g->lp_reasoning))
                json_object_set(lp, "reasoning_content", g->lp_reasoning);
        }
    }
    const char *fin = finish_name(g->finish);
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:[{s:i,s:O,s:o,s:s}],s:o}", "id", g->response_id, "object",
                          "chat.completion", "created", (json_int_t)g->created, "model", g->accept.model,
                          "choices", "index", 0, "message", msg, "logprobs", lp, "finish_reason", fin,
                          "usage", usage_json(&g->usage));
    add_timings(o, &g->usage);
    json_decref(msg);
    json_decref(tools);
    return o;
fail:
    json_decref(msg);
    json_decref(tools);
    return NULL;
}

static json_t *build_completion_response(gen_ctx *g) {
    ds41_buf text = {0};
    ds41_buf_put(&text, g->echo, g->echo ? g->echo_len : 0);
    ds41_buf_put(&text, g->content.data, g->content.len);
    if (text.oom) {
        free(text.data);
        return NULL;
    }
    json_t *lp = json_null();
    if (g->logprobs) {
        json_decref(lp);
        lp = json_pack("{s:o,s:o,s:o,s:o}", "tokens", g->c_tokens ? json_incref(g->c_tokens) : json_array(),
                       "token_logprobs", g->c_lps ? json_incref(g->c_lps) : json_array(), "top_logprobs",
                       g->c_tops ? json_incref(g->c_tops) : json_array(), "text_offset",
                       g->c_offsets ? json_incref(g->c_offsets) : json_array());
    }
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:[{s:i,s:o,s:o,s:s}],s:o}", "id", g->response_id, "object",
                          "text_completion", "created", (json_int_t)g->created, "model", g->accept.model,
                          "choices", "index", 0, "text", ds41_json_string_lossy(text.data, text.len), "logprobs",
                          lp, "finish_reason", finish_name(g->finish), "usage", usage_json(&g->usage));
    add_timings(o, &g->usage);
    free(text.data);
    return o;
}

/* ------------------------------------------------------ generation route */

bool ds41_api_wait_terminal(ds41_http_exchange *ex, ds41_api *api, uint64_t id, pthread_mutex_t *mu,
                            const bool *done, ds41_http_signal *sig) {
    for (;;) {
        pthread_mutex_lock(mu);
        bool d = *done;
        pthread_mutex_unlock(mu);
        if (d) return true;
        ds41_http_wait_result w = ds41_http_wait(ex, sig, -1);
        if (w == DS41_HTTP_WAIT_CLIENT_GONE) {
            api->svc.cancel(api->svc.ctx, id);
            ds41_http_abandon(ex);
            return false;
        }
        if (w == DS41_HTTP_WAIT_STOPPING) {
            api->svc.cancel(api->svc.ctx, id);
            ds41_http_add_header(ex, "Retry-After", "1");
            ds41_http_add_header(ex, "Connection", "close");
            ds41_http_respond_error(ex, 503, NULL, "shutting_down", NULL, "the server is shutting down");
            return false;
        }
    }
}

/* The id a client sees for request `id`: a keyed hash, not the counter, so a local user cannot
 * count from the ids of its own responses how many requests other users made meanwhile. */
static uint64_t shown_id(const ds41_api *api, uint64_t id) {
    uint8_t b[sizeof api->id_key + 8], h[32];
    memcpy(b, api->id_key, sizeof api->id_key);
    for (int i = 0; i < 8; i++) b[sizeof api->id_key + i] = (uint8_t)(id >> (8 * i));
    ds41_sha256(b, sizeof b, h);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)h[i] << (8 * i);
    return v;
}

uint64_t ds41_api_shown_id(const ds41_api *api, uint64_t id) {
    return shown_id(api, id);
}

static void handle_generation(ds41_http_exchange *ex, ds41_api *api, ds41_gen_kind kind) {
    size_t len;
    const char *body = ds41_http_body(ex, &len);
    ds41_api_request req;
    ds41_svc_error err = {0};
    int rc = kind == DS41_GEN_CHAT
                 ? ds41_api_parse_chat(body, len, &req, &err)
                 : ds41_api_parse_completion(body, len, api->opts.completion_max_tokens, &req, &err);
    if (rc) {
        ds41_api_bad_request(ex, &err);
        return;
    }
    gen_ctx *g = calloc(1, sizeof *g);
    if (!g || ds41_http_signal_init(&g->sig, NULL) != 0) {
        free(g);
        ds41_api_request_free(&req);
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    pthread_mutex_init(&g->mu, NULL);
    g->refs = 1;
    g->id = atomic_fetch_add(&api->next_id, 1);
    g->salt = api->salt;
    g->shown_id = shown_id(api, g->id);
    snprintf(g->response_id, sizeof g->response_id, "%s-%08" PRIx32 "%016" PRIx64,
             kind == DS41_GEN_CHAT ? "chatcmpl" : "cmpl", api->salt, g->shown_id);
    g->created = unix_now();
    g->kind = kind;
    g->stream = req.gen.stream;
    g->include_usage = req.include_usage;
    g->logprobs = req.gen.logprobs;
    g->top_logprobs = req.gen.top_logprobs;
    snprintf(g->accept.model, sizeof g->accept.model, "%s", req.model ? req.model : "");
    if (req.echo && req.prompt) {
        g->echo = malloc(req.gen.prompt_len + 1);
        if (g->echo) {
            memcpy(g->echo, req.prompt, req.gen.prompt_len + 1);
            g->echo_len = req.gen.prompt_len;
        }
    }
    if (g->stream) {
        cancel_ctx *cc = malloc(sizeof *cc);
        if (cc) {
            cc->svc = api->svc;
            cc->id = g->id;
            g->out = ds41_http_stream_new(cancel_on_abandon, cc, free);
        }
        if (!g->out) {
            free(cc);
            ds41_api_request_free(&req);
            gen_unref(g);
            ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
            return;
        }
    }
    req.gen.id = g->id;
    req.gen.response_id = g->response_id;
    const ds41_http_peer *peer = ds41_http_peer_info(ex); /* the prefix-cache partition's owner */
    req.gen.peer_uid = peer && peer->has_creds ? (int64_t)peer->uid : -1;
    g->refs = 2; /* handler + service */
    ds41_gen_sink sink = {.event = sink_event, .sink_ctx = g};
    rc = api->svc.submit(api->svc.ctx, &req.gen, &sink, &g->accept, &err);
    ds41_api_request_free(&req);
    g->accept.model[sizeof g->accept.model - 1] = 0;
    if (!ds41_utf8_valid(g->accept.model, strlen(g->accept.model), NULL)) g->accept.model[0] = 0;
    if (rc != 0) {
        ds41_api_submit_refused(&g->mu, &g->done, &g->out, &err);
        ds41_api_respond_svc_error(ex, &err);
        gen_unref(g); /* the service's reference */
        gen_unref(g);
        return;
    }

    if (g->stream) {
        pthread_mutex_lock(&g->mu);
        if (!g->done) start_stream_locked(g);
        pthread_mutex_unlock(&g->mu);
        static const char stop_event[] =
            "data: {\"error\":{\"message\":\"the server is shutting down\",\"type\":\"server_error\","
            "\"param\":null,\"code\":\"shutting_down\"}}\n\n";
        ds41_api_attach_stream(ex, &g->mu, &g->out, &g->attached, &g->end_pending, stop_event);
        gen_unref(g);
        return;
    }

    if (!ds41_api_wait_terminal(ex, api, g->id, &g->mu, &g->done, &g->sig)) {
        gen_unref(g);
        return;
    }
    /* done: the service has dropped its reference; only ours is left */
    if (g->failed) {
        ds41_api_respond_svc_error(ex, &g->error);
    } else {
        ds41_api_respond_json(ex, 200, kind == DS41_GEN_CHAT ? build_chat_response(g) : build_completion_response(g));
    }
    gen_unref(g);
}

static void route_chat(ds41_http_exchange *ex, void *ctx) {
    handle_generation(ex, ctx, DS41_GEN_CHAT);
}
static void route_completions(ds41_http_exchange *ex, void *ctx) {
    handle_generation(ex, ctx, DS41_GEN_COMPLETION);
}

/* ============================================================ other routes */

static const char *model_state_name(ds41_model_state s);

/* /health's "models": every configured model with its state (and why, unless ready). */
static void health_model_emit(void *acc, const ds41_svc_model *m) {
    json_t *list = acc, *o = json_object();
    if (!m || !m->id || !o) {
        json_decref(o);
        return;
    }
    ds41_json_set_str(o, "id", m->id);
    ds41_json_set_str(o, "state", model_state_name(m->state));
    if (m->state != DS41_MODEL_READY && m->detail && m->detail[0])
        ds41_json_set_str(o, m->state == DS41_MODEL_FAILED ? "error" : "detail", m->detail);
    json_array_append_new(list, o);
}

static void route_health(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    ds41_svc_health h = {0};
    api->svc.health(api->svc.ctx, &h);
    h.detail[sizeof h.detail - 1] = 0;
    json_t *o = json_object();
    if (o) {
        ds41_json_set_str(o, "status",
                          h.state == DS41_HEALTH_OK        ? "ok"
                          : h.state == DS41_HEALTH_LOADING ? "loading"
                                                           : "error");
        if (h.state != DS41_HEALTH_OK) ds41_json_set_str(o, "detail", h.detail);
        json_t *models = api->svc.list_models ? json_array() : NULL;
        ds41_svc_error err = {0};
        if (models && api->svc.list_models(api->svc.ctx, health_model_emit, models, &err) == 0)
            json_object_set(o, "models", models);
        json_decref(models);
    }
    if (h.state == DS41_HEALTH_LOADING) ds41_http_add_header(ex, "Retry-After", "5");
    ds41_api_respond_json(ex, h.state == DS41_HEALTH_OK ? 200 : 503, o);
}

static const char *model_state_name(ds41_model_state s) {
    switch (s) {
    case DS41_MODEL_UNLOADED:
        return "unloaded";
    case DS41_MODEL_LOADING:
        return "loading";
    case DS41_MODEL_READY:
        return "ready";
    case DS41_MODEL_FAILED:
        return "failed";
    }
    return "unknown";
}

typedef struct model_acc {
    json_t *list;
    bool admin;
    const char *only_id; /* GET /v1/models/{id} */
    bool oom;
} model_acc;

static json_t *public_model_json(const ds41_svc_model *m) {
    json_t *o = json_object();
    if (!o) return NULL;
    if (ds41_json_set_str(o, "id", m->id) || ds41_json_set_str(o, "object", "model") ||
        ds41_json_set_new(o, "created", json_integer(m->created)) ||
        ds41_json_set_str(o, "owned_by", "ds41") ||
        (m->context_length && ds41_json_set_new(o, "max_model_len", ds41_api_ju64(m->context_length)))) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static void model_emit(void *accp, const ds41_svc_model *m) {
    model_acc *acc = accp;
    if (!m || !m->id || acc->oom) return;
    json_t *o;
    if (!acc->admin) {
        if (m->state != DS41_MODEL_READY) return;
        if (acc->only_id && strcmp(acc->only_id, m->id) != 0) return;
        o = public_model_json(m);
    } else {
        o = json_object();
        json_t *tiers = json_object();
        uint64_t total = 0;
        bool ok = o && tiers;
        for (size_t i = 0; ok && m->tiers && i < m->n_tiers; i++) {
            if (!m->tiers[i].tier) continue;
            json_t *key = ds41_json_string_lossy(m->tiers[i].tier, strlen(m->tiers[i].tier));
            ok = key && !json_object_setn_new(tiers, json_string_value(key), json_string_length(key),
                                              ds41_api_ju64(m->tiers[i].bytes));
            json_decref(key);
            total += m->tiers[i].bytes;
        }
        ok = ok && !ds41_json_set_str(o, "id", m->id) && !ds41_json_set_str(o, "path", m->path) &&
             !ds41_json_set_str(o, "state", model_state_name(m->state)) &&
             !ds41_json_set_new(o, "created", json_integer(m->created)) &&
             !ds41_json_set_new(o, "context_length", ds41_api_ju64(m->context_length)) &&
             !ds41_json_set_str(o, "detail", m->detail) && !json_object_set(o, "tiers", tiers) &&
             !ds41_json_set_new(o, "bytes_total", ds41_api_ju64(total)) &&
             (!m->threads || !ds41_json_set_new(o, "threads", ds41_api_ju64(m->threads)));
        if (ok && m->load && m->load->state) {
            json_t *l = json_object();
            ok = l && !ds41_json_set_str(l, "state", m->load->state) &&
                 !ds41_json_set_new(l, "bytes_done", ds41_api_ju64(m->load->bytes_done)) &&
                 !ds41_json_set_new(l, "bytes_total", ds41_api_ju64(m->load->bytes_total)) &&
                 !ds41_json_set_new(l, "tensors_done", ds41_api_ju64(m->load->tensors_done)) &&
                 !ds41_json_set_new(l, "tensors_total", ds41_api_ju64(m->load->tensors_total)) &&
                 !json_object_set(o, "load", l);
            json_decref(l);
        }
        json_decref(tiers);
        if (!ok) {
            json_decref(o);
            o = NULL;
        }
    }
    if (!o || json_array_append_new(acc->list, o)) acc->oom = true;
}

static void list_models(ds41_http_exchange *ex, ds41_api *api, bool admin, const char *only_id) {
    if (!ds41_api_need(ex, api->svc.list_models != NULL, "model listing")) return;
    model_acc acc = {.list = json_array(), .admin = admin, .only_id = only_id};
    ds41_svc_error err = {0};
    if (!acc.list) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    if (api->svc.list_models(api->svc.ctx, model_emit, &acc, &err) != 0) {
        json_decref(acc.list);
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    if (acc.oom) {
        json_decref(acc.list);
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    if (only_id) {
        if (json_array_size(acc.list) == 0) {
            json_decref(acc.list);
            ds41_http_respond_error(ex, 404, NULL, "model_not_found", "model",
                                    "the model '%s' does not exist or is not loaded", only_id);
            return;
        }
        json_t *one = json_incref(json_array_get(acc.list, 0));
        json_decref(acc.list);
        ds41_api_respond_json(ex, 200, one);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s,s:o}", "object", "list", "data", acc.list));
}

static void route_models(ds41_http_exchange *ex, void *ctx) {
    list_models(ex, ctx, false, NULL);
}
static void route_model_one(ds41_http_exchange *ex, void *ctx) {
    list_models(ex, ctx, false, ds41_http_path_param(ex));
}
static void route_admin_models(ds41_http_exchange *ex, void *ctx) {
    list_models(ex, ctx, true, NULL);
}

static void route_tokenize(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.tokenize != NULL, "tokenization")) return;
    json_t *root;
    if (ds41_api_parse_body(ex, &root)) return;
    static const char *const keys[] = {
        "model",    "content", "prompt",   "add_special",      "add_special_tokens",
        "messages", "tools",   "thinking", "reasoning_effort", "chat_template_kwargs",
        NULL};
    ds41_svc_error err = {0};
    ds41_tokenize_request tr = {0};
    char *messages = NULL, *tools = NULL;
    const char *content = NULL, *prompt = NULL;
    bool has1 = false, has2 = false, b1 = false, b2 = false;
    if (ds41_api_check_keys(root, NULL, keys, &err) ||
        ds41_api_get_string(root, NULL, "model", false, &tr.model, &err) ||
        ds41_api_get_string(root, NULL, "content", false, &content, &err) ||
        ds41_api_get_string(root, NULL, "prompt", false, &prompt, &err) ||
        ds41_api_get_bool(root, NULL, "add_special", &has1, &b1, &err) ||
        ds41_api_get_bool(root, NULL, "add_special_tokens", &has2, &b2, &err))
        goto bad;
    json_t *msgs = json_object_get(root, "messages");
    bool has_msgs = msgs && !json_is_null(msgs);
    if ((content != NULL) + (prompt != NULL) + has_msgs != 1) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "content",
                      "give exactly one of 'content', 'prompt' or 'messages'");
        snprintf(err.code, sizeof err.code, "missing_field");
        goto bad;
    }
    tr.add_special = (has1 && b1) || (has2 && b2);
    if (has_msgs) {
        if (ds41_api_parse_messages(msgs, &messages, &err) ||
            ds41_api_parse_tools(json_object_get(root, "tools"), &tools, NULL, &err) ||
            ds41_api_parse_thinking(root, &tr.thinking, &tr.reasoning_effort, &err))
            goto bad;
        tr.messages_json = messages;
        tr.tools_json = tools;
    } else {
        json_t *t = json_object_get(root, content ? "content" : "prompt");
        tr.text = json_string_value(t);
        tr.text_len = json_string_length(t);
        if (json_object_get(root, "tools") || json_object_get(root, "thinking") ||
            json_object_get(root, "reasoning_effort") || json_object_get(root, "chat_template_kwargs")) {
            ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "messages",
                          "'tools' and thinking options need 'messages'");
            snprintf(err.code, sizeof err.code, "invalid_value");
            goto bad;
        }
    }
    int32_t *tokens = NULL;
    size_t n = 0;
    if (api->svc.tokenize(api->svc.ctx, &tr, &tokens, &n, &err) != 0) {
        free(messages);
        free(tools);
        json_decref(root);
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    free(messages);
    free(tools);
    json_decref(root);
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++)
        if (json_array_append_new(arr, json_integer(tokens[i]))) {
            json_decref(arr);
            arr = NULL;
        }
    free(tokens);
    ds41_api_respond_json(ex, 200, arr ? json_pack("{s:o,s:I}", "tokens", arr, "count", (json_int_t)n) : NULL);
    return;
bad:
    free(messages);
    free(tools);
    json_decref(root);
    ds41_api_bad_request(ex, &err);
}

static void route_detokenize(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    if (!ds41_api_need(ex, api->svc.detokenize != NULL, "detokenization")) return;
    json_t *root;
    if (ds41_api_parse_body(ex, &root)) return;
    static const char *const keys[] = {"model", "tokens", NULL};
    ds41_svc_error err = {0};
    const char *model = NULL;
    int32_t *ids = NULL;
    if (ds41_api_check_keys(root, NULL, keys, &err) ||
        ds41_api_get_string(root, NULL, "model", false, &model, &err))
        goto bad;
    json_t *t = json_object_get(root, "tokens");
    if (!t || json_is_null(t)) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "tokens", "'tokens' is required");
        snprintf(err.code, sizeof err.code, "missing_field");
        goto bad;
    }
    if (!json_is_array(t)) {
        ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, "tokens", "'tokens' must be an array, not %s",
                      ds41_json_kind_name(t));
        snprintf(err.code, sizeof err.code, "invalid_type");
        goto bad;
    }
    size_t n = json_array_size(t);
    ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) {
        json_decref(root);
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(t, i);
        char path[40];
        snprintf(path, sizeof path, "tokens[%zu]", i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX) {
            ds41_svc_fail(&err, DS41_SVC_BAD_REQUEST, path, "'%s' must be a token id in [0, %d]", path,
                          INT32_MAX);
            snprintf(err.code, sizeof err.code, json_is_integer(v) ? "invalid_value" : "invalid_type");
            goto bad;
        }
        ids[i] = (int32_t)json_integer_value(v);
    }
    char *text = NULL;
    size_t tl = 0;
    if (api->svc.detokenize(api->svc.ctx, model, ids, n, &text, &tl, &err) != 0) {
        free(ids);
        json_decref(root);
        ds41_api_respond_svc_error(ex, &err);
        return;
    }
    free(ids);
    json_decref(root);
    json_t *o = json_object();
    if (o && ds41_json_set_new(o, "content", ds41_json_string_lossy(text, text ? tl : 0))) {
        json_decref(o);
        o = NULL;
    }
    free(text);
    ds41_api_respond_json(ex, 200, o);
    return;
bad:
    free(ids);
    json_decref(root);
    ds41_api_bad_request(ex, &err);
}

static void route_metrics(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    ds41_buf b = {0};
    ds41_buf_put(&b, "", 0);
    if (api->svc.metrics) {
        char *text = NULL;
        size_t len = 0;
        ds41_svc_error err = {0};
        if (api->svc.metrics(api->svc.ctx, &text, &len, &err) != 0) {
            ds41_api_respond_svc_error(ex, &err);
            return;
        }
        if (text) {
            ds41_buf_put(&b, text, len);
            if (len && text[len - 1] != '\n') ds41_buf_put(&b, "\n", 1);
        }
        free(text);
    }
    size_t hl = 0;
    char *http = ds41_http_metrics_render(api->metrics, &hl);
    if (http) ds41_buf_put(&b, http, hl);
    free(http);
    if (b.oom) {
        free(b.data);
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    ds41_http_respond(ex, 200, "text/plain; version=0.0.4; charset=utf-8", b.data ? b.data : "", b.len);
    free(b.data);
}

/* ================================================================ the api */

int ds41_api_new(const ds41_service *svc, ds41_http_metrics *metrics, const ds41_api_options *opts,
                 ds41_api **out, ds41_error *err) {
    *out = NULL;
    if (!svc || !svc->health || !svc->submit || !svc->cancel)
        return ds41_fail(err, "api: the service must implement health, submit and cancel");
    ds41_api *api = calloc(1, sizeof *api);
    if (!api) return ds41_fail(err, "api: out of memory");
    api->svc = *svc;
    api->metrics = metrics;
    if (opts) api->opts = *opts;
    atomic_init(&api->next_id, 1);
    atomic_init(&api->store_pending, 0);
    if (getrandom(&api->salt, sizeof api->salt, GRND_NONBLOCK) != (ssize_t)sizeof api->salt)
        api->salt = (uint32_t)time(NULL) ^ (uint32_t)(uintptr_t)api;
    if (getrandom(api->id_key, sizeof api->id_key, GRND_NONBLOCK) != (ssize_t)sizeof api->id_key) {
        uint64_t t = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)api ^ ((uint64_t)api->salt << 32);
        memcpy(api->id_key, &t, sizeof t);
    }
    const ds41_http_route routes[N_ROUTES] = {
        {"GET", "/health", DS41_AUTH_INFERENCE, false, "health", route_health},
        {"GET", "/v1/models", DS41_AUTH_INFERENCE, false, "models", route_models},
        {"GET", "/v1/models/*", DS41_AUTH_INFERENCE, false, "model", route_model_one},
        {"POST", "/v1/chat/completions", DS41_AUTH_INFERENCE, true, "chat_completions", route_chat},
        {"POST", "/v1/completions", DS41_AUTH_INFERENCE, true, "completions", route_completions},
        {"POST", "/v1/responses", DS41_AUTH_INFERENCE, true, "responses", ds41_api_route_responses_create},
        {"GET", "/v1/responses/*", DS41_AUTH_INFERENCE, false, "response_get", ds41_api_route_responses_get},
        {"DELETE", "/v1/responses/*", DS41_AUTH_INFERENCE, false, "response_delete", ds41_api_route_responses_delete},
        {"POST", "/v1/messages", DS41_AUTH_INFERENCE, true, "messages", ds41_api_route_anthropic_messages},
        {"POST", "/v1/messages/count_tokens", DS41_AUTH_INFERENCE, true, "messages_count_tokens",
         ds41_api_route_anthropic_count_tokens},
        {"POST", "/tokenize", DS41_AUTH_INFERENCE, true, "tokenize", route_tokenize},
        {"POST", "/detokenize", DS41_AUTH_INFERENCE, true, "detokenize", route_detokenize},
        {"GET", "/metrics", DS41_AUTH_INFERENCE, false, "metrics", route_metrics},
        {"GET", "/admin/models", DS41_AUTH_ADMIN, false, "admin_models", route_admin_models},
        {"POST", "/admin/models/load", DS41_AUTH_ADMIN, true, "admin_models_load", ds41_api_route_admin_load},
        {"POST", "/admin/models/unload", DS41_AUTH_ADMIN, true, "admin_models_unload", ds41_api_route_admin_unload},
        {"GET", "/admin/sessions", DS41_AUTH_ADMIN, false, "admin_sessions", ds41_api_route_admin_sessions},
        {"DELETE", "/admin/sessions/*", DS41_AUTH_ADMIN, false, "admin_session_delete",
         ds41_api_route_admin_session_delete},
        {"GET", "/admin/cache", DS41_AUTH_ADMIN, false, "admin_cache", ds41_api_route_admin_cache},
        {"GET", "/admin/snapshots", DS41_AUTH_ADMIN, false, "admin_snapshots", ds41_api_route_admin_snapshots},
        {"POST", "/admin/snapshots/save", DS41_AUTH_ADMIN, true, "admin_snapshots_save", ds41_api_route_admin_snapshot_save},
        {"POST", "/admin/snapshots/restore", DS41_AUTH_ADMIN, true, "admin_snapshots_restore",
         ds41_api_route_admin_snapshot_restore},
        {"DELETE", "/admin/snapshots/*", DS41_AUTH_ADMIN, false, "admin_snapshot_delete", ds41_api_route_admin_snapshot_delete},
        {"POST", "/admin/cache/experts", DS41_AUTH_ADMIN, true, "admin_cache_experts", ds41_api_route_admin_cache_experts},
    };
    memcpy(api->routes, routes, sizeof routes);
    if (ds41_response_store_open(api->opts.responses_dir, api->opts.responses_max_bytes,
                                 api->opts.responses_max_age_s, unix_now(), &api->responses, err) != 0) {
        free(api);
        return -1;
    }
    api->router = (ds41_http_router){.routes = api->routes,
                                     .n_routes = N_ROUTES,
                                     .ctx = api,
                                     .max_body_bytes = api->opts.max_body_bytes,
                                     .metrics = metrics};
    *out = api;
    return 0;
}

void ds41_api_free(ds41_api *api) {
    /* a streamed response's store thread still writes: the store outlives it */
    while (api && atomic_load(&api->store_pending) > 0) nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
    if (api) ds41_response_store_close(api->responses);
    free(api);
}

const ds41_http_router *ds41_api_router(const ds41_api *api) {
    return &api->router;
}

void ds41_api_submit_refused(pthread_mutex_t *mu, bool *done, ds41_http_stream **out, ds41_svc_error *err) {
    pthread_mutex_lock(mu);
    *done = true;
    ds41_http_stream *s = *out;
    *out = NULL;
    pthread_mutex_unlock(mu);
    if (s) ds41_http_stream_end(s);
    if (err->status == DS41_SVC_OK)
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "the service refused the request without a reason");
}

void ds41_api_attach_stream(ds41_http_exchange *ex, pthread_mutex_t *mu, ds41_http_stream **out, bool *attached,
                            const bool *end_pending, const char *stop_event) {
    pthread_mutex_lock(mu);
    ds41_http_stream *s = *out;
    pthread_mutex_unlock(mu);
    ds41_http_respond_stream(ex, 200, "text/event-stream", s, stop_event);
    pthread_mutex_lock(mu);
    *attached = true;
    ds41_http_stream *to_end = NULL;
    if (*end_pending) {
        to_end = *out;
        *out = NULL;
    }
    pthread_mutex_unlock(mu);
    if (to_end) ds41_http_stream_end(to_end);
}
