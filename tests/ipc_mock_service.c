/* Deterministic mock of ds41_service (see ipc_mock_service.h). */
#include "tests/ipc_mock_service.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_STEPS 16

typedef enum { MODE_NORMAL, MODE_SLOW, MODE_GATED, MODE_HANG, MODE_FLOOD } job_mode;

typedef struct step {
    ds41_gen_event_type type;
    char reasoning[32];
    char content[32];
    int tool_index;
    char tool_name[160];
    char args[32];
    bool first_fragment;
    ds41_finish_reason finish;
    ds41_svc_status error;
} step;

typedef struct job {
    struct job *next;
    mock_service *m;
    uint64_t id;
    ds41_gen_sink sink;
    job_mode mode;
    bool cancelled;
    unsigned gates_seen;
    step steps[MAX_STEPS];
    int n_steps;
    bool logprobs;
    int top_logprobs;
    ds41_gen_usage usage;
    unsigned flood_tokens;
} job;

struct mock_service {
    ds41_service iface;
    bool async;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    job *live;
    unsigned n_live;
    unsigned workers;
    unsigned gate;
    unsigned cancels;
    unsigned accepted;
    ds41_health_state health;
    char health_detail[128];
    char last[1024];
    unsigned requests;
};

/* ----------------------------------------------------------- the plan */

static void plan(job *j, const ds41_gen_request *req) {
    int n = 0;
    if (req->thinking == DS41_THINKING_ENABLED) {
        for (int i = 0; i < 2; i++) {
            j->steps[n].type = DS41_GEN_DELTA;
            snprintf(j->steps[n].reasoning, sizeof j->steps[n].reasoning, "think%d ", i);
            n++;
        }
        j->usage.reasoning_tokens = 2;
    }
    bool tool_call = false;
    char tool_name[160] = "";
    if (req->tools_json && !(req->tool_choice_json && strcmp(req->tool_choice_json, "\"none\"") == 0)) {
        json_t *tools = json_loads(req->tools_json, 0, NULL);
        const char *name =
            json_string_value(json_object_get(json_object_get(json_array_get(tools, 0), "function"), "name"));
        if (name) {
            snprintf(tool_name, sizeof tool_name, "%s", name);
            tool_call = true;
        }
        json_decref(tools);
    }
    bool late_error = req->model && strcmp(req->model, "late-error") == 0;
    if (tool_call) {
        step *s = &j->steps[n++];
        s->type = DS41_GEN_TOOL_CALL;
        s->tool_index = 0;
        s->first_fragment = true;
        snprintf(s->tool_name, sizeof s->tool_name, "%s", tool_name);
        snprintf(s->args, sizeof s->args, "{\"x\": ");
        s = &j->steps[n++];
        s->type = DS41_GEN_TOOL_CALL;
        s->tool_index = 0;
        snprintf(s->args, sizeof s->args, "1}");
        j->steps[n].type = DS41_GEN_FINISH;
        j->steps[n++].finish = DS41_FINISH_TOOL_CALLS;
        j->usage.completion_tokens = j->usage.reasoning_tokens + 6;
    } else {
        static const char *const words[] = {"Hello", " from", " the", " mock", " \xe2\x9c\x93"};
        unsigned limit = req->max_tokens ? req->max_tokens : 5;
        unsigned k;
        for (k = 0; k < 5 && k < limit; k++) {
            j->steps[n].type = DS41_GEN_DELTA;
            snprintf(j->steps[n].content, sizeof j->steps[n].content, "%s", words[k]);
            n++;
            if (late_error) {
                k++;
                break;
            }
        }
        j->usage.completion_tokens = j->usage.reasoning_tokens + k;
        if (late_error) {
            j->steps[n].type = DS41_GEN_ERROR;
            j->steps[n++].error = DS41_SVC_KV_FULL;
        } else {
            j->steps[n].type = DS41_GEN_FINISH;
            j->steps[n++].finish = limit < 5 ? DS41_FINISH_LENGTH : DS41_FINISH_STOP;
        }
    }
    if (req->model && strcmp(req->model, "cancel-self") == 0)
        j->steps[n - 1] = (step){.type = DS41_GEN_FINISH, .finish = DS41_FINISH_CANCELLED};
    j->n_steps = n;
    size_t in = req->messages_json ? strlen(req->messages_json)
                : req->prompt      ? req->prompt_len
                                   : req->n_prompt_tokens * 4;
    j->usage.prompt_tokens = in / 4 + 1;
    j->usage.cached_tokens = j->usage.prompt_tokens > 2 ? 2 : 0;
    j->logprobs = req->logprobs;
    j->top_logprobs = req->top_logprobs;
}

/* ------------------------------------------------------------ delivery */

static void deliver(job *j, const step *s, int index) {
    ds41_gen_event ev = {.type = s->type};
    ds41_gen_logprob lp[2];
    ds41_gen_top_logprob tops[20];
    static const char *const alt_names[] = {"alt0", "alt1", "alt2", "alt3", "alt4",
                                            "alt5", "alt6", "alt7", "alt8", "alt9"};
    switch (s->type) {
    case DS41_GEN_DELTA: {
        ev.content = s->content;
        ev.content_len = strlen(s->content);
        ev.reasoning = s->reasoning;
        ev.reasoning_len = strlen(s->reasoning);
        if (j->logprobs) {
            int nt = j->top_logprobs > 10 ? 10 : j->top_logprobs;
            for (int k = 0; k < nt; k++)
                tops[k] = (ds41_gen_top_logprob){alt_names[k], strlen(alt_names[k]), -1.0 - k};
            const char *tok = ev.content_len ? s->content : s->reasoning;
            lp[0] = (ds41_gen_logprob){.token = tok,
                                       .token_len = strlen(tok),
                                       .logprob = -0.25 * (index + 1),
                                       .top = tops,
                                       .n_top = (size_t)nt,
                                       .reasoning = ev.content_len == 0};
            ev.logprobs = lp;
            ev.n_logprobs = 1;
        }
        break;
    }
    case DS41_GEN_TOOL_CALL:
        ev.tool_index = s->tool_index;
        ev.tool_name = s->first_fragment ? s->tool_name : NULL;
        ev.arguments = s->args;
        ev.arguments_len = strlen(s->args);
        break;
    case DS41_GEN_FINISH:
        ev.finish_reason = s->finish;
        ev.usage = j->usage;
        break;
    case DS41_GEN_ERROR:
        ds41_svc_fail(&ev.error, s->error, NULL, "mock: KV memory ran out mid-generation");
        ev.error.retry_after_s = 7;
        break;
    }
    j->sink.event(j->sink.sink_ctx, &ev);
}

static void job_unlink_locked(mock_service *m, job *j) {
    for (job **p = &m->live; *p; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            m->n_live--;
            break;
        }
    pthread_cond_broadcast(&m->cond);
}

static void finish_cancelled(job *j) {
    ds41_gen_event ev = {.type = DS41_GEN_FINISH, .finish_reason = DS41_FINISH_CANCELLED, .usage = j->usage};
    if (j->id & 1) {
        ev.type = DS41_GEN_ERROR;
        ds41_svc_fail(&ev.error, DS41_SVC_CANCELLED, NULL, "cancelled");
    }
    j->sink.event(j->sink.sink_ctx, &ev);
}

/* "flood": as many 64-byte deltas as max_tokens asks, as fast as possible. */
static void run_flood(job *j) {
    mock_service *m = j->m;
    static const char piece[] = "flood flood flood flood flood flood flood flood flood flood floo";
    for (unsigned i = 0; i < j->flood_tokens; i++) {
        pthread_mutex_lock(&m->mu);
        bool cancelled = j->cancelled;
        if (cancelled) job_unlink_locked(m, j);
        pthread_mutex_unlock(&m->mu);
        if (cancelled) {
            finish_cancelled(j);
            return;
        }
        ds41_gen_event ev = {.type = DS41_GEN_DELTA, .content = piece, .content_len = sizeof piece - 1};
        j->sink.event(j->sink.sink_ctx, &ev);
    }
    pthread_mutex_lock(&m->mu);
    job_unlink_locked(m, j);
    pthread_mutex_unlock(&m->mu);
    ds41_gen_event fin = {.type = DS41_GEN_FINISH, .finish_reason = DS41_FINISH_LENGTH, .usage = j->usage};
    j->sink.event(j->sink.sink_ctx, &fin);
}

static void run_job(job *j) {
    mock_service *m = j->m;
    if (j->mode == MODE_FLOOD) {
        run_flood(j);
        return;
    }
    for (int i = 0; i < j->n_steps; i++) {
        bool terminal = j->steps[i].type == DS41_GEN_FINISH || j->steps[i].type == DS41_GEN_ERROR;
        if (m->async) {
            pthread_mutex_lock(&m->mu);
            if (j->mode == MODE_GATED && i > 0) {
                while (!j->cancelled && m->gate <= j->gates_seen) pthread_cond_wait(&m->cond, &m->mu);
                j->gates_seen++;
            } else if (j->mode == MODE_SLOW && i > 0) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 20 * 1000000;
                if (ts.tv_nsec >= 1000000000) {
                    ts.tv_sec++;
                    ts.tv_nsec -= 1000000000;
                }
                while (!j->cancelled && pthread_cond_timedwait(&m->cond, &m->mu, &ts) != ETIMEDOUT) {
                }
            } else if (j->mode == MODE_HANG && i > 0) {
                while (!j->cancelled) pthread_cond_wait(&m->cond, &m->mu);
            }
            bool cancelled = j->cancelled;
            if (cancelled || terminal) job_unlink_locked(m, j);
            pthread_mutex_unlock(&m->mu);
            if (cancelled) {
                finish_cancelled(j);
                return;
            }
        } else if (terminal) {
            pthread_mutex_lock(&m->mu);
            job_unlink_locked(m, j);
            pthread_mutex_unlock(&m->mu);
        }
        deliver(j, &j->steps[i], i);
    }
}

static void *worker(void *arg) {
    job *j = arg;
    mock_service *m = j->m;
    run_job(j);
    free(j);
    pthread_mutex_lock(&m->mu);
    m->workers--;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* ------------------------------------------------------- the interface */

static void mock_health(void *ctx, ds41_svc_health *out) {
    mock_service *m = ctx;
    pthread_mutex_lock(&m->mu);
    out->state = m->health;
    snprintf(out->detail, sizeof out->detail, "%s", m->health_detail);
    pthread_mutex_unlock(&m->mu);
}

static int mock_list_models(void *ctx, ds41_svc_model_emit emit, void *acc, ds41_svc_error *err) {
    (void)ctx;
    (void)err;
    ds41_svc_tier_bytes tiers[2] = {{"vram", 1000}, {"ram", 2000}};
    ds41_svc_model a = {.id = "mock-model",
                        .path = "/models/mock",
                        .state = DS41_MODEL_READY,
                        .created = 1700000000,
                        .context_length = 4096,
                        .tiers = tiers,
                        .n_tiers = 2};
    ds41_svc_model b = {.id = "other",
                        .path = "/models/other",
                        .state = DS41_MODEL_UNLOADED,
                        .created = 1700000001,
                        .detail = "not loaded"};
    emit(acc, &a);
    emit(acc, &b);
    return 0;
}

static void summarize(mock_service *m, const ds41_gen_request *r) {
    char stop[128] = "";
    for (size_t i = 0; i < r->n_stop; i++) {
        size_t l = strlen(stop);
        snprintf(stop + l, sizeof stop - l, "%s%s", i ? "|" : "", r->stop[i]);
    }
    snprintf(m->last, sizeof m->last,
             "kind=%d;model=%s;thinking=%d;effort=%d;max_tokens=%u;temperature=%s%g;top_p=%s%g;"
             "top_k=%d;seed=%s%lld;stop=%s;logit_bias=%zu%s%d:%g;logprobs=%d/%d;stream=%d;"
             "tools=%s;tool_choice=%s;response_format=%s;prompt_tokens=%zu;messages=%s",
             (int)r->kind, r->model ? r->model : "(default)", (int)r->thinking, r->reasoning_effort,
             r->max_tokens, r->temperature.set ? "" : "unset:", r->temperature.value,
             r->top_p.set ? "" : "unset:", r->top_p.value, r->top_k,
             r->has_seed ? "" : "unset:", (long long)r->seed, stop, r->n_logit_bias,
             r->n_logit_bias ? "@" : "", r->n_logit_bias ? r->logit_bias[0].token : 0,
             r->n_logit_bias ? (double)r->logit_bias[0].bias : 0.0, (int)r->logprobs, r->top_logprobs,
             (int)r->stream, r->tools_json ? "yes" : "no", r->tool_choice_json ? r->tool_choice_json : "-",
             r->response_format_json ? r->response_format_json : "-", r->n_prompt_tokens,
             r->messages_json ? r->messages_json : "-");
}

static int mock_submit(void *ctx, const ds41_gen_request *req, const ds41_gen_sink *sink,
                       ds41_gen_accept *accept, ds41_svc_error *err) {
    mock_service *m = ctx;
    pthread_mutex_lock(&m->mu);
    summarize(m, req);
    m->requests++;
    pthread_mutex_unlock(&m->mu);
    const char *model = req->model;
    if (model && strcmp(model, "missing") == 0) {
        ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "model", "the model 'missing' does not exist");
        snprintf(err->code, sizeof err->code, "model_not_found");
        return -1;
    }
    if (model && strcmp(model, "queue-full") == 0) {
        ds41_svc_fail(err, DS41_SVC_QUEUE_FULL, NULL, "mock: the request queue is full");
        err->retry_after_s = 3;
        return -1;
    }
    if (model && strcmp(model, "kv-full") == 0) {
        ds41_svc_fail(err, DS41_SVC_KV_FULL, NULL, "mock: KV memory is full");
        err->retry_after_s = 7;
        return -1;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "mock: out of memory");
    j->m = m;
    j->id = req->id;
    j->sink = *sink;
    j->mode = MODE_NORMAL;
    if (m->async && model) {
        if (strcmp(model, "slow") == 0) j->mode = MODE_SLOW;
        if (strcmp(model, "gated") == 0) j->mode = MODE_GATED;
        if (strcmp(model, "hang") == 0) j->mode = MODE_HANG;
        if (strcmp(model, "flood") == 0) j->mode = MODE_FLOOD;
    }
    j->flood_tokens = req->max_tokens;
    plan(j, req);
    snprintf(accept->model, sizeof accept->model, "%s", model ? model : "mock-model");
    pthread_mutex_lock(&m->mu);
    j->next = m->live;
    m->live = j;
    m->n_live++;
    m->accepted++;
    if (m->async) m->workers++;
    pthread_mutex_unlock(&m->mu);
    if (!m->async) {
        run_job(j);
        free(j);
        return 0;
    }
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, worker, j) != 0) {
        /* run inline rather than fail after acceptance */
        pthread_attr_destroy(&attr);
        run_job(j);
        free(j);
        pthread_mutex_lock(&m->mu);
        m->workers--;
        pthread_cond_broadcast(&m->cond);
        pthread_mutex_unlock(&m->mu);
        return 0;
    }
    pthread_attr_destroy(&attr);
    return 0;
}

static void mock_cancel(void *ctx, uint64_t id) {
    mock_service *m = ctx;
    pthread_mutex_lock(&m->mu);
    for (job *j = m->live; j; j = j->next)
        if (j->id == id && !j->cancelled) {
            j->cancelled = true;
            m->cancels++;
        }
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->mu);
}

static int mock_tokenize(void *ctx, const ds41_tokenize_request *req, int32_t **tokens, size_t *n,
                         ds41_svc_error *err) {
    (void)ctx;
    if (req->model && strcmp(req->model, "missing") == 0)
        return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "model", "the model 'missing' does not exist");
    const char *text = req->messages_json ? req->messages_json : req->text;
    size_t len = req->messages_json ? strlen(req->messages_json) : req->text_len;
    size_t extra = req->add_special ? 1 : 0;
    *tokens = malloc((len + extra + 1) * sizeof **tokens);
    if (!*tokens) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
    if (extra) (*tokens)[0] = 0;
    for (size_t i = 0; i < len; i++) (*tokens)[extra + i] = (unsigned char)text[i];
    *n = len + extra;
    return 0;
}

static int mock_detokenize(void *ctx, const char *model, const int32_t *tokens, size_t n, char **text,
                           size_t *len, ds41_svc_error *err) {
    (void)ctx;
    (void)model;
    for (size_t i = 0; i < n; i++)
        if (tokens[i] > 255) {
            char p[32];
            snprintf(p, sizeof p, "tokens[%zu]", i);
            return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, p, "token id %d is not in the vocabulary",
                                 tokens[i]);
        }
    *text = malloc(n + 1);
    if (!*text) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) (*text)[i] = (char)tokens[i];
    (*text)[n] = 0;
    *len = n;
    return 0;
}

static int mock_metrics(void *ctx, char **text, size_t *len, ds41_svc_error *err) {
    mock_service *m = ctx;
    char buf[256];
    pthread_mutex_lock(&m->mu);
    int k =
        snprintf(buf, sizeof buf, "# TYPE mock_requests_total counter\nmock_requests_total %u", m->requests);
    pthread_mutex_unlock(&m->mu);
    *text = strdup(buf);
    if (!*text) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
    *len = (size_t)k;
    return 0;
}

static int mock_load(void *ctx, const char *name, const char *path, ds41_svc_error *err) {
    (void)ctx;
    if (path) {
        if (strncmp(path, "/models/", 8) != 0)
            return ds41_svc_fail(err, DS41_SVC_FORBIDDEN, "path", "'%s' is outside the model directories",
                                 path);
        return 1;
    }
    if (strcmp(name, "mock-model") == 0) return 0;
    if (strcmp(name, "busy") == 0)
        return ds41_svc_fail(err, DS41_SVC_CONFLICT, "name", "a load is in progress");
    return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "name", "no model named '%s'", name);
}

static int mock_unload(void *ctx, const char *name, ds41_svc_error *err) {
    (void)ctx;
    if (strcmp(name, "mock-model") == 0) return 0;
    return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "name", "no model named '%s'", name);
}

static int mock_sessions(void *ctx, ds41_svc_session_emit emit, void *acc, ds41_svc_error *err) {
    mock_service *m = ctx;
    (void)err;
    ds41_svc_session s = {.id = "sess-cached",
                          .model = "mock-model",
                          .state = "cached",
                          .prompt_tokens = 10,
                          .generated_tokens = 5,
                          .cached_tokens = 2,
                          .kv_tokens = 15,
                          .kv_pages = 1,
                          .kv_bytes = 13350,
                          .created = 1700000000,
                          .last_used = 1700000100};
    emit(acc, &s);
    pthread_mutex_lock(&m->mu);
    for (job *j = m->live; j; j = j->next) {
        char id[40];
        snprintf(id, sizeof id, "req-%llu", (unsigned long long)j->id);
        ds41_svc_session live = {.id = id,
                                 .model = "mock-model",
                                 .state = "decode",
                                 .request_id = j->id,
                                 .kv_tokens = 3,
                                 .kv_pages = 1,
                                 .kv_bytes = 2670};
        emit(acc, &live);
    }
    pthread_mutex_unlock(&m->mu);
    return 0;
}

static int mock_delete_session(void *ctx, const char *id, ds41_svc_error *err) {
    mock_service *m = ctx;
    if (strcmp(id, "sess-cached") == 0) return 0;
    unsigned long long rid;
    char tail;
    if (sscanf(id, "req-%llu%c", &rid, &tail) == 1) {
        pthread_mutex_lock(&m->mu);
        bool found = false;
        for (job *j = m->live; j; j = j->next)
            if (j->id == rid) found = true;
        pthread_mutex_unlock(&m->mu);
        if (found) {
            mock_cancel(m, rid);
            return 0;
        }
    }
    return ds41_svc_fail(err, DS41_SVC_NOT_FOUND, "id", "no session '%s'", id);
}

static int mock_cache(void *ctx, void (*emit)(void *acc, const ds41_svc_cache *cache), void *acc,
                      ds41_svc_error *err) {
    (void)ctx;
    (void)err;
    ds41_svc_cache_tier tiers[2] = {{"kv", 26700, 267000, 0, 0}, {"prefix", 13350, 267000, 3, 1}};
    ds41_svc_cache c = {.page_tokens = 15,
                        .page_bytes = 13350,
                        .pages_total = 20,
                        .pages_used = 2,
                        .pages_free = 18,
                        .bytes_per_token = 890.0,
                        .tiers = tiers,
                        .n_tiers = 2};
    emit(acc, &c);
    return 0;
}

mock_service *mock_service_new(bool async) {
    mock_service *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->async = async;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cond, NULL);
    m->health = DS41_HEALTH_OK;
    m->iface = (ds41_service){
        .ctx = m,
        .health = mock_health,
        .list_models = mock_list_models,
        .submit = mock_submit,
        .cancel = mock_cancel,
        .tokenize = mock_tokenize,
        .detokenize = mock_detokenize,
        .metrics = mock_metrics,
        .load_model = mock_load,
        .unload_model = mock_unload,
        .list_sessions = mock_sessions,
        .delete_session = mock_delete_session,
        .cache_info = mock_cache,
    };
    return m;
}

void mock_service_free(mock_service *m) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    for (job *j = m->live; j; j = j->next) j->cancelled = true;
    pthread_cond_broadcast(&m->cond);
    while (m->workers) pthread_cond_wait(&m->cond, &m->mu);
    pthread_mutex_unlock(&m->mu);
    pthread_cond_destroy(&m->cond);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const ds41_service *mock_service_iface(mock_service *m) {
    return &m->iface;
}

void mock_service_set_health(mock_service *m, ds41_health_state state, const char *detail) {
    pthread_mutex_lock(&m->mu);
    m->health = state;
    snprintf(m->health_detail, sizeof m->health_detail, "%s", detail ? detail : "");
    pthread_mutex_unlock(&m->mu);
}

void mock_service_gate(mock_service *m) {
    pthread_mutex_lock(&m->mu);
    m->gate++;
    pthread_cond_broadcast(&m->cond);
    pthread_mutex_unlock(&m->mu);
}

unsigned mock_service_cancels(mock_service *m) {
    pthread_mutex_lock(&m->mu);
    unsigned n = m->cancels;
    pthread_mutex_unlock(&m->mu);
    return n;
}

unsigned mock_service_live(mock_service *m) {
    pthread_mutex_lock(&m->mu);
    unsigned n = m->n_live;
    pthread_mutex_unlock(&m->mu);
    return n;
}

unsigned mock_service_accepted(mock_service *m) {
    pthread_mutex_lock(&m->mu);
    unsigned n = m->accepted;
    pthread_mutex_unlock(&m->mu);
    return n;
}

bool mock_service_wait_idle(mock_service *m, int timeout_ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&m->mu);
    int rc = 0;
    while ((m->n_live || m->workers) && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&m->cond, &m->mu, &ts);
    bool idle = m->n_live == 0 && m->workers == 0;
    pthread_mutex_unlock(&m->mu);
    return idle;
}

void mock_service_last_request(mock_service *m, char *out, size_t n) {
    pthread_mutex_lock(&m->mu);
    snprintf(out, n, "%s", m->last);
    pthread_mutex_unlock(&m->mu);
}
