/* The Responses API routes (see ipc/api_responses.h): a request is parsed into a chat
 * generation and submitted to the service like the chat route's; the service's events are
 * turned into output items (reasoning, message, function_call), streamed as response.* SSE
 * events or gathered into one response object, and the finished response is stored (with the
 * conversation that led to it) for GET and previous_response_id.
 *
 * A request's state (resp_ctx) is shared by the handler and the service's sink, reference
 * counted as the chat route's gen_ctx is; the service's reference goes at the terminal event,
 * which builds the final object.  It is stored before the client sees it (so a client that
 * continues at once finds it), never on the service's thread: by the handler of a non-streamed
 * request, by a short-lived thread before response.completed of a streamed one. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "config/buf.h"
#include "config/json_util.h"
#include "config/utf8.h"
#include "ipc/api_internal.h"
#include "ipc/api_responses.h"
#include "ipc/response_store.h"

#define MAX_ITEMS 160
#define MAX_TOOLS 128

enum { ITEM_REASONING, ITEM_MESSAGE, ITEM_FUNCTION };

typedef struct out_item {
    int type;
    char id[48];
    char call_id[72];
    char *name;
    ds41_buf text; /* reasoning text, message text or arguments */
    bool closed;
} out_item;

typedef struct resp_ctx {
    pthread_mutex_t mu;
    int refs;
    uint64_t id;
    char resp_id[48];
    int64_t created;
    bool stream, done, attached, end_pending, started;
    bool terminal; /* the service's terminal event came (done: and was handled) */
    ds41_api *api;
    ds41_http_stream *out;
    uint64_t seq;
    out_item items[MAX_ITEMS];
    int n_items;
    int open; /* index of the item receiving text, -1 none */
    int tool_item[MAX_TOOLS];
    ds41_gen_accept accept;
    json_t *echo, *conversation, *final;
    bool store;
    int64_t peer;
    ds41_response_store *st;
    bool failed;
    ds41_svc_error error;
    ds41_finish_reason finish;
    ds41_gen_usage usage;
    ds41_http_signal sig;
} resp_ctx;

static void ctx_unref(resp_ctx *c) {
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left) return;
    for (int i = 0; i < c->n_items; i++) {
        free(c->items[i].name);
        ds41_buf_free(&c->items[i].text);
    }
    json_decref(c->echo);
    json_decref(c->conversation);
    json_decref(c->final);
    ds41_http_signal_destroy(&c->sig);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* prefix + 32 hex digits of fresh randomness (128 bits: ids cannot be guessed). */
static void random_id(const char *prefix, char *out, size_t n) {
    uint8_t b[16];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) {
        /* no entropy is not a reason to fail a request, but never hand out a guessable id:
         * an id from a clock is only used for unstored items */
        uint64_t t = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)out;
        memcpy(b, &t, 8);
        memcpy(b + 8, &t, 8);
    }
    int k = snprintf(out, n, "%s", prefix);
    for (size_t i = 0; i < sizeof b && k >= 0 && (size_t)k + 2 < n; i++)
        k += snprintf(out + k, n - (size_t)k, "%02x", b[i]);
}

/* ------------------------------------------------------------ JSON shapes */

static json_t *usage_json(const ds41_gen_usage *u) {
    return json_pack("{s:o,s:{s:o},s:o,s:{s:o},s:o}", "input_tokens", ds41_api_ju64(u->prompt_tokens),
                     "input_tokens_details", "cached_tokens", ds41_api_ju64(u->cached_tokens),
                     "output_tokens", ds41_api_ju64(u->completion_tokens), "output_tokens_details",
                     "reasoning_tokens", ds41_api_ju64(u->reasoning_tokens), "total_tokens",
                     ds41_api_ju64(u->prompt_tokens + u->completion_tokens));
}

static json_t *text_of(const out_item *it) {
    return ds41_json_string_lossy(it->text.data ? it->text.data : "", it->text.len);
}

/* The item as the client sees it; `full` false: as announced (no text yet, in progress). */
static json_t *item_json(const out_item *it, bool full, bool incomplete) {
    const char *status = !full ? "in_progress" : incomplete ? "incomplete" : "completed";
    switch (it->type) {
    case ITEM_REASONING:
        return json_pack("{s:s,s:s,s:[],s:o}", "type", "reasoning", "id", it->id, "summary", "content",
                         full ? json_pack("[{s:s,s:o}]", "type", "reasoning_text", "text", text_of(it))
                              : json_array());
    case ITEM_MESSAGE:
        return json_pack("{s:s,s:s,s:s,s:s,s:o}", "type", "message", "id", it->id, "role", "assistant",
                         "status", status, "content",
                         full ? json_pack("[{s:s,s:o,s:[],s:[]}]", "type", "output_text", "text", text_of(it),
                                          "annotations", "logprobs")
                              : json_array());
    default:
        return json_pack("{s:s,s:s,s:s,s:s,s:o,s:s}", "type", "function_call", "id", it->id, "call_id",
                         it->call_id, "name", it->name ? it->name : "", "arguments",
                         full ? text_of(it) : json_string(""), "status", status);
    }
}

static json_t *response_json(const resp_ctx *c, const char *status, bool with_output) {
    json_t *o = json_deep_copy(c->echo);
    json_t *output = json_array();
    if (!o || !output) goto fail;
    bool incomplete = strcmp(status, "incomplete") == 0;
    for (int i = 0; with_output && i < c->n_items; i++)
        if (json_array_append_new(output, item_json(&c->items[i], true, incomplete && i == c->n_items - 1)))
            goto fail;
    if (ds41_json_set_str(o, "id", c->resp_id) || ds41_json_set_str(o, "object", "response") ||
        ds41_json_set_new(o, "created_at", json_integer(c->created)) ||
        ds41_json_set_str(o, "status", status) || ds41_json_set_str(o, "model", c->accept.model) ||
        json_object_set(o, "output", output) || ds41_json_set_new(o, "error", json_null()) ||
        ds41_json_set_new(o, "incomplete_details",
                          incomplete ? json_pack("{s:s}", "reason", "max_output_tokens") : json_null()) ||
        ds41_json_set_new(o, "usage", with_output ? usage_json(&c->usage) : json_null()))
        goto fail;
    json_decref(output);
    return o;
fail:
    json_decref(o);
    json_decref(output);
    return NULL;
}

/* ------------------------------------------------------------ SSE events */

static json_t *response_json(const resp_ctx *c, const char *status, bool with_output);
static void send_event_locked(resp_ctx *c, const char *type, json_t *data);

/* response.created and response.in_progress, before anything else (the service fills the
 * model name in before its first event, and events may come before submit() returns). */
static void start_locked(resp_ctx *c) {
    if (c->started) return;
    c->started = true;
    send_event_locked(c, "response.created",
                      json_pack("{s:o}", "response", response_json(c, "in_progress", false)));
    send_event_locked(c, "response.in_progress",
                      json_pack("{s:o}", "response", response_json(c, "in_progress", false)));
}

/* "event: TYPE\ndata: {...,"type":TYPE,"sequence_number":n}\n\n" (data stolen). */
static void send_event_locked(resp_ctx *c, const char *type, json_t *data) {
    if (!c->stream || !data) {
        json_decref(data);
        return;
    }
    start_locked(c);
    ds41_json_set_str(data, "type", type);
    ds41_json_set_new(data, "sequence_number", ds41_api_ju64(c->seq++));
    size_t len;
    char *text = ds41_json_dump(data, &len);
    json_decref(data);
    if (!text) return;
    ds41_buf b = {0};
    ds41_buf_printf(&b, "event: %s\ndata: ", type);
    ds41_buf_put(&b, text, len);
    ds41_buf_put(&b, "\n\n", 2);
    free(text);
    if (!b.oom && c->out) ds41_http_stream_write(c->out, b.data, b.len);
    ds41_buf_free(&b);
}

static void close_item_locked(resp_ctx *c, bool incomplete) {
    if (c->open < 0) return;
    int i = c->open;
    out_item *it = &c->items[i];
    c->open = -1;
    it->closed = true;
    if (it->type == ITEM_REASONING) {
        send_event_locked(c, "response.reasoning_text.done",
                          json_pack("{s:s,s:i,s:i,s:o}", "item_id", it->id, "output_index", i,
                                    "content_index", 0, "text", text_of(it)));
        send_event_locked(c, "response.content_part.done",
                          json_pack("{s:s,s:i,s:i,s:{s:s,s:o}}", "item_id", it->id, "output_index", i,
                                    "content_index", 0, "part", "type", "reasoning_text", "text",
                                    text_of(it)));
    } else if (it->type == ITEM_MESSAGE) {
        send_event_locked(c, "response.output_text.done",
                          json_pack("{s:s,s:i,s:i,s:o,s:[]}", "item_id", it->id, "output_index", i,
                                    "content_index", 0, "text", text_of(it), "logprobs"));
        send_event_locked(c, "response.content_part.done",
                          json_pack("{s:s,s:i,s:i,s:{s:s,s:o,s:[]}}", "item_id", it->id, "output_index", i,
                                    "content_index", 0, "part", "type", "output_text", "text", text_of(it),
                                    "annotations"));
    } else {
        send_event_locked(c, "response.function_call_arguments.done",
                          json_pack("{s:s,s:i,s:o,s:s}", "item_id", it->id, "output_index", i, "arguments",
                                    text_of(it), "name", it->name ? it->name : ""));
    }
    send_event_locked(c, "response.output_item.done",
                      json_pack("{s:i,s:o}", "output_index", i, "item", item_json(it, true, incomplete)));
}

/* Start a new output item of `type` (closing the open one); -1 when there is no room. */
static int open_item_locked(resp_ctx *c, int type) {
    close_item_locked(c, false);
    if (c->n_items >= MAX_ITEMS) return -1;
    int i = c->n_items++;
    out_item *it = &c->items[i];
    it->type = type;
    random_id(type == ITEM_REASONING ? "rs_" : type == ITEM_MESSAGE ? "msg_" : "fc_", it->id, sizeof it->id);
    if (type != ITEM_FUNCTION) c->open = i;
    return i;
}

static void announce_item_locked(resp_ctx *c, int i) {
    out_item *it = &c->items[i];
    send_event_locked(c, "response.output_item.added",
                      json_pack("{s:i,s:o}", "output_index", i, "item", item_json(it, false, false)));
    if (it->type == ITEM_FUNCTION) return;
    json_t *part = it->type == ITEM_REASONING
                       ? json_pack("{s:s,s:s}", "type", "reasoning_text", "text", "")
                       : json_pack("{s:s,s:s,s:[]}", "type", "output_text", "text", "", "annotations");
    send_event_locked(c, "response.content_part.added",
                      json_pack("{s:s,s:i,s:i,s:o}", "item_id", it->id, "output_index", i, "content_index", 0,
                                "part", part));
}

static void text_delta_locked(resp_ctx *c, int type, const char *s, size_t n) {
    if (!n) return;
    if (c->open < 0 || c->items[c->open].type != type) {
        int i = open_item_locked(c, type);
        if (i < 0) return;
        announce_item_locked(c, i);
    }
    out_item *it = &c->items[c->open];
    ds41_buf_put(&it->text, s, n);
    send_event_locked(c,
                      type == ITEM_REASONING ? "response.reasoning_text.delta" : "response.output_text.delta",
                      json_pack(type == ITEM_REASONING ? "{s:s,s:i,s:i,s:o}" : "{s:s,s:i,s:i,s:o,s:[]}",
                                "item_id", it->id, "output_index", c->open, "content_index", 0, "delta",
                                ds41_json_string_lossy(s, n), "logprobs"));
}

static void tool_event_locked(resp_ctx *c, const ds41_gen_event *ev) {
    if (ev->tool_index < 0 || ev->tool_index >= MAX_TOOLS) return;
    int i = c->tool_item[ev->tool_index];
    if (i < 0) {
        i = open_item_locked(c, ITEM_FUNCTION);
        if (i < 0) return;
        c->tool_item[ev->tool_index] = i;
        out_item *it = &c->items[i];
        it->name = strdup(ev->tool_name ? ev->tool_name : "");
        const char *given = ev->tool_id;
        if (given && *given && strlen(given) < sizeof it->call_id &&
            ds41_utf8_valid(given, strlen(given), NULL))
            snprintf(it->call_id, sizeof it->call_id, "%s", given);
        else
            random_id("call_", it->call_id, sizeof it->call_id);
        announce_item_locked(c, i);
        c->open = i; /* its argument fragments follow */
    }
    out_item *it = &c->items[i];
    ds41_buf_put(&it->text, ev->arguments, ev->arguments_len);
    if (ev->arguments_len)
        send_event_locked(c, "response.function_call_arguments.delta",
                          json_pack("{s:s,s:i,s:o}", "item_id", it->id, "output_index", i, "delta",
                                    ds41_json_string_lossy(ev->arguments, ev->arguments_len)));
}

/* The assistant turn this response adds to the conversation (chat message shape). */
static json_t *assistant_message(const resp_ctx *c) {
    json_t *m = json_pack("{s:s}", "role", "assistant");
    json_t *calls = json_array();
    ds41_buf content = {0}, reasoning = {0};
    if (!m || !calls) goto fail;
    for (int i = 0; i < c->n_items; i++) {
        const out_item *it = &c->items[i];
        if (it->type == ITEM_MESSAGE) ds41_buf_put(&content, it->text.data, it->text.len);
        if (it->type == ITEM_REASONING) ds41_buf_put(&reasoning, it->text.data, it->text.len);
        if (it->type == ITEM_FUNCTION &&
            json_array_append_new(calls, json_pack("{s:s,s:s,s:{s:s,s:o}}", "id", it->call_id, "type",
                                                   "function", "function", "name", it->name ? it->name : "",
                                                   "arguments", text_of(it))))
            goto fail;
    }
    if (content.oom || reasoning.oom) goto fail;
    if (content.len || !json_array_size(calls))
        ds41_json_set_new(m, "content",
                          ds41_json_string_lossy(content.data ? content.data : "", content.len));
    else
        json_object_set_new(m, "content", json_null());
    if (reasoning.len)
        ds41_json_set_new(m, "reasoning_content", ds41_json_string_lossy(reasoning.data, reasoning.len));
    if (json_array_size(calls)) json_object_set(m, "tool_calls", calls);
    json_decref(calls);
    ds41_buf_free(&content);
    ds41_buf_free(&reasoning);
    return m;
fail:
    json_decref(m);
    json_decref(calls);
    ds41_buf_free(&content);
    ds41_buf_free(&reasoning);
    return NULL;
}

/* Keep the finished response and its conversation (a failure is logged in the answer's absence:
 * the response itself is still delivered). */
static void store_locked(resp_ctx *c) {
    if (!c->store || !c->st || !c->final) return;
    json_t *conv = json_copy(c->conversation);
    json_t *asst = assistant_message(c);
    if (!conv || !asst || json_array_append_new(conv, asst)) {
        json_decref(conv);
        return;
    }
    json_t *rec = json_pack("{s:O,s:o}", "response", c->final, "conversation", conv);
    size_t len;
    char *text = rec ? ds41_json_dump(rec, &len) : NULL;
    json_decref(rec);
    ds41_error err;
    if (text && ds41_response_store_put(c->st, c->peer, c->resp_id, text, len, c->created, &err) != 0)
        fprintf(stderr, "ds41d: %s\n", err.msg);
    free(text);
}

/* The end of a response: response.completed / response.incomplete (or the error event), then
 * the stream's end.  Returns the stream to end once the lock is released (NULL: none yet, the
 * handler ends it when it attaches). */
static ds41_http_stream *finalize_locked(resp_ctx *c) {
    if (c->failed)
        send_event_locked(c, "error",
                          json_pack("{s:s,s:s,s:s?}", "code",
                                    c->error.code[0] ? c->error.code : ds41_svc_status_code(c->error.status),
                                    "message", c->error.message[0] ? c->error.message : "generation failed",
                                    "param", c->error.param[0] ? c->error.param : NULL));
    else
        send_event_locked(c, c->finish == DS41_FINISH_LENGTH ? "response.incomplete" : "response.completed",
                          c->final ? json_pack("{s:O}", "response", c->final) : NULL);
    c->done = true;
    if (!c->stream) return NULL;
    if (!c->attached) {
        c->end_pending = true;
        return NULL;
    }
    ds41_http_stream *s = c->out;
    c->out = NULL;
    return s;
}

/* A streamed response to store: written off the service's thread (the engine's step loop must
 * not wait for an fsync), before response.completed goes out so that a client continuing at
 * once finds it.  Holds the service's reference. */
static void *store_and_finish(void *arg) {
    resp_ctx *c = arg;
    ds41_api *api = c->api;
    pthread_mutex_lock(&c->mu);
    store_locked(c);
    ds41_http_stream *to_end = finalize_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (to_end) ds41_http_stream_end(to_end);
    ctx_unref(c);
    atomic_fetch_sub(&api->store_pending, 1); /* the last touch of api: ds41_api_free waits for it */
    return NULL;
}

static void sink_event(void *ctx, const ds41_gen_event *ev) {
    resp_ctx *c = ctx;
    if (!ev) return;
    pthread_mutex_lock(&c->mu);
    if (c->terminal) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    bool terminal = ev->type == DS41_GEN_FINISH || ev->type == DS41_GEN_ERROR;
    switch (ev->type) {
    case DS41_GEN_DELTA:
        text_delta_locked(c, ITEM_REASONING, ev->reasoning, ev->reasoning_len);
        text_delta_locked(c, ITEM_MESSAGE, ev->content, ev->content_len);
        break;
    case DS41_GEN_TOOL_CALL:
        tool_event_locked(c, ev);
        break;
    case DS41_GEN_FINISH:
        if (ev->finish_reason == DS41_FINISH_CANCELLED) {
            c->failed = true;
            ds41_svc_fail(&c->error, DS41_SVC_CANCELLED, NULL, "the request was cancelled by the server");
            break;
        }
        c->finish = ev->finish_reason;
        c->usage = ev->usage;
        close_item_locked(c, ev->finish_reason == DS41_FINISH_LENGTH);
        c->final =
            response_json(c, ev->finish_reason == DS41_FINISH_LENGTH ? "incomplete" : "completed", true);
        break;
    case DS41_GEN_ERROR:
        c->failed = true;
        c->error = ev->error;
        c->error.message[sizeof c->error.message - 1] = 0;
        c->error.param[sizeof c->error.param - 1] = 0;
        c->error.code[sizeof c->error.code - 1] = 0;
        break;
    }
    if (!terminal) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    c->terminal = true;
    /* a non-streamed response is stored by the handler, which waits anyway */
    if (c->stream && !c->failed && c->store && c->st) {
        pthread_attr_t attr;
        pthread_t t;
        atomic_fetch_add(&c->api->store_pending, 1);
        bool spawned = pthread_attr_init(&attr) == 0;
        if (spawned) {
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            spawned = pthread_create(&t, &attr, store_and_finish, c) == 0;
            pthread_attr_destroy(&attr);
        }
        if (spawned) {
            pthread_mutex_unlock(&c->mu);
            return;
        }
        atomic_fetch_sub(&c->api->store_pending, 1);
        store_locked(c); /* no thread: store here rather than not at all */
    }
    ds41_http_stream *to_end = finalize_locked(c);
    pthread_mutex_unlock(&c->mu);
    if (to_end) ds41_http_stream_end(to_end);
    if (!c->stream) ds41_http_signal_raise(&c->sig);
    ctx_unref(c);
}

typedef struct abandon_ctx {
    ds41_service svc;
    uint64_t id;
} abandon_ctx;

static void cancel_on_abandon(void *ctx) {
    abandon_ctx *a = ctx;
    a->svc.cancel(a->svc.ctx, a->id);
}

static int64_t peer_uid(ds41_http_exchange *ex) {
    const ds41_http_peer *p = ds41_http_peer_info(ex);
    return p && p->has_creds ? (int64_t)p->uid : -1;
}

/* The stored record {"response","conversation"} of (peer, id), or NULL (404 sent). */
static json_t *load_record(ds41_http_exchange *ex, ds41_api *api, const char *id, const char *param) {
    char *text = NULL;
    size_t len = 0;
    ds41_error err;
    int rc = api->responses ? ds41_response_store_get(api->responses, peer_uid(ex), id, (int64_t)time(NULL),
                                                      &text, &len, &err)
                            : 0;
    json_t *rec = rc == 1 ? json_loadb(text, len, 0, NULL) : NULL;
    free(text);
    if (rec && json_is_object(json_object_get(rec, "response")) &&
        json_is_array(json_object_get(rec, "conversation")))
        return rec;
    json_decref(rec);
    if (rc < 0)
        ds41_http_respond_error(ex, 500, NULL, NULL, param, "%s", err.msg);
    else
        ds41_http_respond_error(ex, 404, NULL, param ? "previous_response_not_found" : "not_found", param,
                                "no stored response with id '%s'", id);
    return NULL;
}

void ds41_api_route_responses_create(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    size_t len;
    const char *body = ds41_http_body(ex, &len);
    ds41_responses_request req;
    ds41_svc_error err = {0};
    if (ds41_responses_parse(body, len, &req, &err)) {
        ds41_api_bad_request(ex, &err);
        return;
    }
    json_t *prev = NULL, *conv = NULL;
    if (req.previous_response_id) {
        prev = load_record(ex, api, req.previous_response_id, "previous_response_id");
        if (!prev) {
            ds41_responses_request_free(&req);
            return;
        }
    }
    int rc = ds41_responses_messages(&req, prev ? json_object_get(prev, "conversation") : NULL, &conv, &err);
    json_decref(prev);
    if (rc) {
        ds41_responses_request_free(&req);
        ds41_api_bad_request(ex, &err);
        return;
    }
    resp_ctx *c = calloc(1, sizeof *c);
    if (!c || ds41_http_signal_init(&c->sig, NULL) != 0) {
        free(c);
        json_decref(conv);
        ds41_responses_request_free(&req);
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->refs = 1;
    c->open = -1;
    for (int i = 0; i < MAX_TOOLS; i++) c->tool_item[i] = -1;
    c->id = atomic_fetch_add(&api->next_id, 1);
    random_id("resp_", c->resp_id, sizeof c->resp_id);
    c->created = (int64_t)time(NULL);
    c->stream = req.chat.gen.stream;
    c->echo = json_incref(req.echo);
    c->conversation = conv;
    c->store = req.store;
    c->st = api->responses;
    c->api = api;
    c->peer = peer_uid(ex);
    snprintf(c->accept.model, sizeof c->accept.model, "%s", req.chat.model ? req.chat.model : "");
    if (c->stream) {
        abandon_ctx *a = malloc(sizeof *a);
        if (a) {
            a->svc = api->svc;
            a->id = c->id;
            c->out = ds41_http_stream_new(cancel_on_abandon, a, free);
        }
        if (!c->out) {
            free(a);
            ds41_responses_request_free(&req);
            ctx_unref(c);
            ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
            return;
        }
    }
    req.chat.gen.id = c->id;
    req.chat.gen.response_id = c->resp_id;
    req.chat.gen.peer_uid = c->peer;
    c->refs = 2;
    ds41_gen_sink sink = {.event = sink_event, .sink_ctx = c};
    rc = api->svc.submit(api->svc.ctx, &req.chat.gen, &sink, &c->accept, &err);
    ds41_responses_request_free(&req);
    c->accept.model[sizeof c->accept.model - 1] = 0;
    if (!ds41_utf8_valid(c->accept.model, strlen(c->accept.model), NULL)) c->accept.model[0] = 0;
    if (rc != 0) {
        ds41_api_submit_refused(&c->mu, &c->done, &c->out, &err);
        ds41_api_respond_svc_error(ex, &err);
        ctx_unref(c);
        ctx_unref(c);
        return;
    }
    if (c->stream) {
        pthread_mutex_lock(&c->mu);
        if (!c->done) start_locked(c);
        pthread_mutex_unlock(&c->mu);
        static const char stop_event[] = "event: error\ndata: {\"type\":\"error\",\"code\":\"shutting_down\","
                                         "\"message\":\"the server is shutting down\",\"param\":null}\n\n";
        ds41_api_attach_stream(ex, &c->mu, &c->out, &c->attached, &c->end_pending, stop_event);
        ctx_unref(c);
        return;
    }
    if (!ds41_api_wait_terminal(ex, api, c->id, &c->mu, &c->done, &c->sig)) {
        ctx_unref(c);
        return;
    }
    if (c->failed) {
        ds41_api_respond_svc_error(ex, &c->error);
    } else {
        pthread_mutex_lock(&c->mu);
        store_locked(c);
        pthread_mutex_unlock(&c->mu);
        ds41_api_respond_json(ex, 200, json_incref(c->final));
    }
    ctx_unref(c);
}

void ds41_api_route_responses_get(ds41_http_exchange *ex, void *ctx) {
    json_t *rec = load_record(ex, ctx, ds41_http_path_param(ex), NULL);
    if (!rec) return;
    ds41_api_respond_json(ex, 200, json_incref(json_object_get(rec, "response")));
    json_decref(rec);
}

void ds41_api_route_responses_delete(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    const char *id = ds41_http_path_param(ex);
    if (!api->responses || ds41_response_store_remove(api->responses, peer_uid(ex), id) != 1) {
        ds41_http_respond_error(ex, 404, NULL, "not_found", NULL, "no stored response with id '%s'", id);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:s,s:s,s:b}", "id", id, "object", "response", "deleted", 1));
}
