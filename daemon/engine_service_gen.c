/* ds41d's engine service: the generation routes (chat/completions, cancel) and tokenize/detokenize (see engine_service_internal.h). */
#include "daemon/engine_service_internal.h"

#include "daemon/log.h"
#include "engine/serve/generate.h"
#include "engine/text/pyjson.h"

#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- generation jobs -------------------------------------------------------------------------- */

static void job_unref(ds41_engine_service *s, job *j) {
    pthread_mutex_lock(&s->jobs_mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&s->jobs_mu);
    if (last) free(j);
}

static void job_unlink(ds41_engine_service *s, job *j) {
    pthread_mutex_lock(&s->jobs_mu);
    for (job **pp = &s->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    }
    pthread_mutex_unlock(&s->jobs_mu);
}

static void on_delta(void *ctx, const ds41_generation *g, const ds41_generation_delta *d) {
    (void)g;
    job *j = ctx;
    ds41_gen_event ev = {.type = DS41_GEN_DELTA};
    ev.content = d->content;
    ev.content_len = d->content_len;
    ev.reasoning = d->reasoning;
    ev.reasoning_len = d->reasoning_len;
    ds41_gen_logprob lp;
    ds41_gen_top_logprob top[DS41_SAMPLER_MAX_TOP_LOGPROBS];
    if (j->logprobs && d->emitted) {
        size_t len = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(j->m->tok, d->token, &len);
        lp = (ds41_gen_logprob){.token = b ? (const char *)b : "", .token_len = b ? len : 0,
                                .logprob = d->sample.logprob, .reasoning = d->reasoning_token};
        size_t nt = d->sample.n_top < (uint32_t)j->top_logprobs ? d->sample.n_top : (size_t)j->top_logprobs;
        for (size_t k = 0; k < nt; k++) {
            size_t tl = 0;
            const uint8_t *tb = ds41_tokenizer_token_bytes(j->m->tok, d->sample.top[k].token, &tl);
            top[k] = (ds41_gen_top_logprob){.token = tb ? (const char *)tb : "", .token_len = tb ? tl : 0,
                                            .logprob = d->sample.top[k].logprob};
        }
        lp.top = top;
        lp.n_top = nt;
        ev.logprobs = &lp;
        ev.n_logprobs = 1;
    }
    if (ev.content_len || ev.reasoning_len || ev.n_logprobs) j->sink.event(j->sink.sink_ctx, &ev);
    if (j->stream) {
        for (size_t i = 0; i < d->n_tool_deltas; i++) {
            const ds41_generation_tool_delta *td = &d->tool_deltas[i];
            if (td->index > INT_MAX) continue;
            ds41_gen_event tc = {.type = DS41_GEN_TOOL_CALL, .tool_index = (int)td->index, .tool_name = td->name,
                                 .arguments = td->arguments, .arguments_len = td->arguments_len};
            j->sink.event(j->sink.sink_ctx, &tc);
        }
        return;
    }
    for (size_t i = 0; i < d->n_tool_calls; i++) {
        const ds41_chat_tool_call *c = &d->tool_calls[i];
        ds41_gen_event tc = {.type = DS41_GEN_TOOL_CALL, .tool_index = j->tool_index++, .tool_name = c->name,
                             .arguments = c->arguments, .arguments_len = c->arguments_len};
        j->sink.event(j->sink.sink_ctx, &tc);
    }
}

static void on_done(void *ctx, const ds41_generation *g, ds41_sched_status status, const char *message) {
    job *j = ctx;
    ds41_gen_event ev = {0};
    ev.usage.prompt_tokens = ds41_generation_prompt_tokens(g);
    ev.usage.completion_tokens = ds41_generation_completion_tokens(g);
    ev.usage.cached_tokens = ds41_generation_cached_tokens(g);
    ev.usage.reasoning_tokens = ds41_generation_reasoning_tokens(g);
    ev.usage.has_timings = true;
    ds41_generation_timings(g, &ev.usage.prefill_ms, &ev.usage.decode_ms);
    pthread_mutex_lock(&j->svc->jobs_mu);
    bool timed_out = j->timed_out;
    pthread_mutex_unlock(&j->svc->jobs_mu);
    if (status == DS41_SCHED_DONE || (status == DS41_SCHED_CANCELLED && timed_out)) {
        ev.type = DS41_GEN_FINISH;
        const char *f = ds41_generation_finish_name(g);
        ev.finish_reason = timed_out                         ? DS41_FINISH_LENGTH
                           : strcmp(f, "length") == 0        ? DS41_FINISH_LENGTH
                           : strcmp(f, "tool_calls") == 0    ? DS41_FINISH_TOOL_CALLS
                                                             : DS41_FINISH_STOP;
        int si = ds41_generation_stop_index(g);
        ev.stop_string = ev.finish_reason == DS41_FINISH_STOP && si >= 0;
        ev.stop_index = si >= 0 ? (size_t)si : 0;
    } else {
        ev.type = DS41_GEN_ERROR;
        switch (status) {
        case DS41_SCHED_CANCELLED: ds41_svc_fail(&ev.error, DS41_SVC_CANCELLED, NULL, "cancelled"); break;
        case DS41_SCHED_KV_FULL:
            ds41_svc_fail(&ev.error, DS41_SVC_KV_FULL, NULL, "%s", message ? message : "the KV cache is full");
            ev.error.retry_after_s = 1;
            break;
        default: ds41_svc_fail(&ev.error, DS41_SVC_INTERNAL, NULL, "%s", message ? message : "internal error"); break;
        }
    }
    job_unlink(j->svc, j);
    j->sink.event(j->sink.sink_ctx, &ev);
    job_unref(j->svc, j);
}

/* ---- request translation ---------------------------------------------------------------------- */

typedef struct gen_inputs {
    json_t *messages, *tools, *response_format, *tool_choice;
    ds41_logit_bias *bias;
    uint32_t *ids;
    ds41_token_ids forced;
    size_t *stop_lens;
} gen_inputs;

static void gen_inputs_free(gen_inputs *in) {
    json_decref(in->messages);
    json_decref(in->tools);
    json_decref(in->response_format);
    json_decref(in->tool_choice);
    free(in->bias);
    free(in->ids);
    ds41_token_ids_free(&in->forced);
    free(in->stop_lens);
}

static int load_json(const char *text, const char *param, json_t **out, ds41_svc_error *err) {
    if (!text) return 0;
    json_error_t je;
    *out = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
    if (!*out) return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, param, "'%s' is not valid JSON: %s", param, je.text);
    return 0;
}

static int build_params(ds41_engine_service *s, model *m, const ds41_gen_request *req, gen_inputs *in,
                        ds41_generation_params *p, ds41_svc_error *err) {
    *p = ds41_generation_params_default();
    if (req->kind == DS41_GEN_CHAT) {
        p->kind = DS41_GENERATION_CHAT;
        if (load_json(req->messages_json, "messages", &in->messages, err) ||
            load_json(req->tools_json, "tools", &in->tools, err) ||
            load_json(req->response_format_json, "response_format", &in->response_format, err))
            return -1;
        bool choice_none = req->tool_choice_json && strcmp(req->tool_choice_json, "\"none\"") == 0;
        p->messages = in->messages;
        p->tools = choice_none ? NULL : in->tools;
        p->parse_tool_calls = !choice_none;
        p->parallel_tool_calls = req->parallel_tool_calls;
        if (!choice_none && load_json(req->tool_choice_json, "tool_choice", &in->tool_choice, err)) return -1;
        if (json_is_string(in->tool_choice) && strcmp(json_string_value(in->tool_choice), "required") == 0) {
            p->tool_choice = DS41_GENERATION_TOOL_CHOICE_REQUIRED;
        } else if (json_is_object(in->tool_choice)) {
            p->tool_choice = DS41_GENERATION_TOOL_CHOICE_NAMED;
            p->tool_choice_name = json_string_value(json_object_get(json_object_get(in->tool_choice, "function"), "name"));
        }
        p->response_format = in->response_format;
        p->thinking = req->thinking == DS41_THINKING_ENABLED;
        p->reasoning_effort = p->thinking ? req->reasoning_effort : 0;
    } else if (req->prompt_tokens) {
        p->kind = DS41_GENERATION_IDS;
        in->ids = malloc((req->n_prompt_tokens ? req->n_prompt_tokens : 1) * sizeof *in->ids);
        if (!in->ids) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        for (size_t i = 0; i < req->n_prompt_tokens; i++) {
            if (req->prompt_tokens[i] < 0 || (uint32_t)req->prompt_tokens[i] >= m->n_vocab)
                return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "prompt", "token id %d is outside the vocabulary (%u)",
                                     req->prompt_tokens[i], m->n_vocab);
            in->ids[i] = (uint32_t)req->prompt_tokens[i];
        }
        p->ids = in->ids;
        p->n_ids = req->n_prompt_tokens;
    } else {
        p->kind = DS41_GENERATION_RAW;
        p->text = req->prompt ? req->prompt : "";
        p->text_len = req->prompt ? req->prompt_len : 0;
    }
    ds41_sampler_params *sp = &p->sampler;
    if (req->temperature.set) sp->temperature = (float)req->temperature.value;
    if (req->top_p.set) sp->top_p = (float)req->top_p.value;
    sp->top_k = req->top_k > 0 ? (uint32_t)req->top_k : 0;
    if (req->min_p.set) sp->min_p = (float)req->min_p.value;
    if (req->repetition_penalty.set) sp->repetition_penalty = (float)req->repetition_penalty.value;
    if (req->presence_penalty.set) sp->presence_penalty = (float)req->presence_penalty.value;
    if (req->frequency_penalty.set) sp->frequency_penalty = (float)req->frequency_penalty.value;
    sp->has_seed = req->has_seed;
    sp->seed = (uint64_t)req->seed;
    if (req->n_logit_bias) {
        in->bias = calloc(req->n_logit_bias, sizeof *in->bias);
        if (!in->bias) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        for (size_t i = 0; i < req->n_logit_bias; i++) {
            int32_t t = req->logit_bias[i].token;
            if (t < 0 || (uint32_t)t >= m->n_vocab)
                return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "logit_bias",
                                     "logit_bias names token %d, outside the vocabulary (%u)", t, m->n_vocab);
            in->bias[i] = (ds41_logit_bias){.token = (uint32_t)t, .bias = req->logit_bias[i].bias};
        }
        sp->logit_bias = in->bias;
        sp->n_logit_bias = (uint32_t)req->n_logit_bias;
    }
    sp->logprobs = req->logprobs || req->top_logprobs > 0;
    sp->top_logprobs = req->top_logprobs > 0 ? (uint32_t)req->top_logprobs : 0;
    if (req->n_stop) {
        in->stop_lens = malloc(req->n_stop * sizeof *in->stop_lens);
        if (!in->stop_lens) return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        for (size_t i = 0; i < req->n_stop; i++) in->stop_lens[i] = strlen(req->stop[i]);
        p->stop = req->stop;
        p->stop_lens = in->stop_lens;
        p->n_stop = req->n_stop;
    }
    p->max_tokens = req->max_tokens ? req->max_tokens : s->st.max_tokens_default;
    p->max_context = m->context > UINT32_MAX ? UINT32_MAX : (uint32_t)m->context;
    p->ignore_eos = req->ignore_eos;
    p->min_tokens = req->min_tokens;
    if (req->ignored_hints)
        ds41_log(DS41_LOG_INFO, "request %" PRIu64 ": ignoring%s%s (not needed by ds41)", req->id,
                 req->ignored_hints & DS41_HINT_CACHE_PROMPT ? " cache_prompt" : "",
                 req->ignored_hints & DS41_HINT_KEEP_ALIVE ? " keep_alive" : "");
    p->skip_special = !req->keep_special_tokens;
    if (req->forced_output) {
        if (!s->st.test_forced_output)
            return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "ds41_forced_output",
                                 "'ds41_forced_output' is a test hook; this server does not enable it "
                                 "(engine.test_forced_output)");
        ds41_error e;
        if (ds41_tokenizer_encode(m->tok, req->forced_output, strlen(req->forced_output), &in->forced, &e) != 0)
            return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "ds41_forced_output", "%s", e.msg);
        p->forced_ids = in->forced.ids;
        p->n_forced = in->forced.n;
    }
    return 0;
}

/* A generation error: context errors are 400 context_length_exceeded, the rest 400. */
static int generation_error(const ds41_error *e, bool chat, ds41_svc_error *err) {
    if (strstr(e->msg, "context"))
        return ds41_svc_fail(err, DS41_SVC_CONTEXT_LENGTH, chat ? "messages" : "prompt", "%s", e->msg);
    const char *param = strncmp(e->msg, "tool_choice", 11) == 0       ? "tool_choice"
                        : strncmp(e->msg, "response_format", 15) == 0 ? "response_format"
                        : strncmp(e->msg, "sampling", 8) == 0         ? "logit_bias"
                        : strncmp(e->msg, "stop", 4) == 0             ? "stop"
                        : strncmp(e->msg, "prompt", 6) == 0           ? "prompt"
                                                                      : "messages";
    return ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, param, "%s", e->msg);
}

static int svc_submit(void *ctx, const ds41_gen_request *req, const ds41_gen_sink *sink, ds41_gen_accept *accept,
                      ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    int rc = -1;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_acquire_model(s, req->model, err);
    if (!m) {
        pthread_rwlock_unlock(&s->cfg_lock);
        return -1;
    }
    gen_inputs in = {0};
    ds41_generation_params p;
    ds41_generation *g = NULL;
    ds41_error e = {{0}};
    if (build_params(s, m, req, &in, &p, err) != 0) goto out;
    if (ds41_generation_new(m->tok, &p, m->n_vocab, &g, &e) != 0) {
        generation_error(&e, req->kind == DS41_GEN_CHAT, err);
        goto out;
    }
    job *j = calloc(1, sizeof *j);
    if (!j) {
        ds41_generation_free(g);
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        goto out;
    }
    j->svc = s;
    j->m = m;
    j->ipc_id = req->id;
    j->sink = *sink;
    j->logprobs = p.sampler.logprobs != 0;
    j->top_logprobs = (int)p.sampler.top_logprobs;
    j->stream = req->stream;
    j->refs = 2;
    clock_gettime(CLOCK_MONOTONIC, &j->started);
    snprintf(accept->model, sizeof accept->model, "%s", m->name);
    accept->prompt_tokens = ds41_generation_prompt_tokens(g);
    pthread_mutex_lock(&s->jobs_mu);
    j->next = s->jobs;
    s->jobs = j;
    pthread_mutex_unlock(&s->jobs_mu);
    ds41_sched_sink ss = {.delta = on_delta, .done = on_done, .ctx = j};
    uint64_t id = 0;
    /* Its prefix-cache partition: the peer's uid (unless shared) and its cache_salt (issue 13). */
    ds41_sched_partition part;
    ds41_scheduler_partition_make(req->peer_uid, s->st.prefix_share, req->cache_salt,
                                  req->cache_salt ? strlen(req->cache_salt) : 0, &part);
    ds41_sched_status st = ds41_scheduler_submit_in(m->sched, &part, g, &ss, &id, &e);
    if (st != DS41_SCHED_DONE) {
        job_unlink(s, j);
        free(j);
        switch (st) {
        case DS41_SCHED_QUEUE_FULL:
            ds41_svc_fail(err, DS41_SVC_QUEUE_FULL, NULL, "%s", e.msg);
            err->retry_after_s = 1;
            break;
        case DS41_SCHED_KV_FULL:
            ds41_svc_fail(err, DS41_SVC_KV_FULL, NULL, "%s", e.msg);
            err->retry_after_s = 5;
            break;
        case DS41_SCHED_TOO_LARGE: /* waiting would not help: 400, not 503 + Retry-After */
            ds41_svc_fail(
                err, DS41_SVC_BAD_REQUEST, "max_tokens", "%s%s", e.msg,
                req->max_tokens ? "" : "; the request gave no max_tokens, limits.max_tokens_default applied");
            snprintf(err->code, sizeof err->code, "request_too_large_for_kv_pool");
            break;
        case DS41_SCHED_STOPPING: ds41_svc_fail(err, DS41_SVC_UNAVAILABLE, NULL, "%s", e.msg); break;
        default: ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "%s", e.msg); break;
        }
        goto out;
    }
    pthread_mutex_lock(&s->jobs_mu);
    j->sched_id = id;
    if (j->cancel_requested && j->refs == 2) ds41_scheduler_cancel(m->sched, id);
    pthread_mutex_unlock(&s->jobs_mu);
    job_unref(s, j);
    rc = 0;
out:
    gen_inputs_free(&in);
    pthread_rwlock_unlock(&m->lock);
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static void svc_cancel(void *ctx, uint64_t request_id) {
    ds41_engine_service *s = ctx;
    pthread_mutex_lock(&s->jobs_mu);
    for (job *j = s->jobs; j; j = j->next) {
        if (j->ipc_id != request_id) continue;
        j->cancel_requested = true;
        /* Under jobs_mu: the job has not ended, so its scheduler cannot have been freed (its
         * done() needs this lock). */
        if (j->sched_id) ds41_scheduler_cancel(j->m->sched, j->sched_id);
        break;
    }
    pthread_mutex_unlock(&s->jobs_mu);
}

static int svc_tokenize(void *ctx, const ds41_tokenize_request *req, int32_t **tokens, size_t *n_tokens,
                        ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_acquire_model(s, req->model, err);
    int rc = -1;
    if (!m) goto out_cfg;
    if (req->messages_json) {
        gen_inputs in = {0};
        ds41_generation_params p = ds41_generation_params_default();
        if (load_json(req->messages_json, "messages", &in.messages, err) ||
            load_json(req->tools_json, "tools", &in.tools, err)) {
            gen_inputs_free(&in);
            goto out;
        }
        p.messages = in.messages;
        p.tools = in.tools;
        p.thinking = req->thinking == DS41_THINKING_ENABLED;
        p.reasoning_effort = p.thinking ? req->reasoning_effort : 0;
        ds41_generation *g = NULL;
        ds41_error e;
        if (ds41_generation_new(m->tok, &p, m->n_vocab, &g, &e) != 0) {
            gen_inputs_free(&in);
            generation_error(&e, true, err);
            goto out;
        }
        size_t n;
        const int32_t *ids = ds41_generation_tokens(g, &n);
        *tokens = malloc((n ? n : 1) * sizeof **tokens);
        if (*tokens) {
            memcpy(*tokens, ids, n * sizeof *ids);
            *n_tokens = n;
            rc = 0;
        } else {
            ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        }
        ds41_generation_free(g);
        gen_inputs_free(&in);
    } else {
        ds41_token_ids ids = {0};
        ds41_error e;
        int32_t bos = ds41_vocab_bos_id(m->vocab);
        if (bos < 0) bos = ds41_vocab_find(m->vocab, DS41_CHAT_BOS, strlen(DS41_CHAT_BOS));
        if (ds41_tokenizer_encode(m->tok, req->text, req->text_len, &ids, &e) != 0) {
            ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "content", "%s", e.msg);
            goto out;
        }
        size_t extra = req->add_special && bos >= 0 ? 1 : 0;
        *tokens = malloc((ids.n + extra + 1) * sizeof **tokens);
        if (!*tokens) {
            ds41_token_ids_free(&ids);
            ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
            goto out;
        }
        if (extra) (*tokens)[0] = bos;
        for (size_t i = 0; i < ids.n; i++) (*tokens)[extra + i] = (int32_t)ids.ids[i];
        *n_tokens = ids.n + extra;
        ds41_token_ids_free(&ids);
        rc = 0;
    }
out:
    pthread_rwlock_unlock(&m->lock);
out_cfg:
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

static int svc_detokenize(void *ctx, const char *model_name, const int32_t *tokens, size_t n_tokens, char **text,
                          size_t *text_len, ds41_svc_error *err) {
    ds41_engine_service *s = ctx;
    pthread_rwlock_rdlock(&s->cfg_lock);
    model *m = es_acquire_model(s, model_name, err);
    int rc = -1;
    if (!m) goto out_cfg;
    uint32_t *ids = malloc((n_tokens ? n_tokens : 1) * sizeof *ids);
    if (!ids) {
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= m->n_vocab) {
            ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, "tokens", "token id %d is outside the vocabulary (%u)", tokens[i],
                          m->n_vocab);
            free(ids);
            goto out;
        }
        ids[i] = (uint32_t)tokens[i];
    }
    *text = ds41_tokenizer_decode(m->tok, ids, n_tokens, false, text_len);
    free(ids);
    if (!*text) {
        ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
        goto out;
    }
    rc = 0;
out:
    pthread_rwlock_unlock(&m->lock);
out_cfg:
    pthread_rwlock_unlock(&s->cfg_lock);
    return rc;
}

void es_generation_routes(ds41_service *iface) {
    iface->submit = svc_submit;
    iface->cancel = svc_cancel;
    iface->tokenize = svc_tokenize;
    iface->detokenize = svc_detokenize;
}
