/* engine/generate: one request's generation state machine, driven over the real forward pass of
 * a generated tiny checkpoint (written with ds41_model_generate into a mkdtemp directory and
 * removed at the end). */
#include "config/utf8.h"
#include "engine/forward/forward.h"
#include "engine/serve/generate.h"
#include "engine/model/model_gen.h"
#include "engine/text/pyjson.h"
#include "engine/text/tokenizer.h"
#include "schema_valid.h"
#include "tap.h"
#include "tmpdir.h"

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static ds41_engine *E;
static ds41_tokenizer *TOK;
static ds41_vocab *VOCAB;
static ds41_kv_pool *POOL;
static ds41_sampler_scratch *SCRATCH;
static uint32_t NV;

#define TOOL_BLOCK                                                                                                    \
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" "             \
    "string=\"true\">Paris</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"days\" string=\"false\">3</｜DSML｜ "  \
    "parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"

/* Two invokes; and one whose first call has arguments that are not JSON (string="false" with
 * raw text: the parser copies it). */
#define TOOL_BLOCK_2                                                                                         \
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" " \
    "string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n<｜DSML｜ invoke "                \
    "name=\"get_weather\">\n"                                                                                \
    "<｜DSML｜ parameter name=\"city\" string=\"true\">Rome</｜DSML｜ parameter>\n</｜DSML｜ "         \
    "invoke>\n</｜DSML｜ calls>"
#define TOOL_BLOCK_BAD_FIRST                                                                                 \
    "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"days\" " \
    "string=\"false\">three</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n<｜DSML｜ invoke "               \
    "name=\"get_weather\">\n"                                                                                \
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"

/* What a run produced. */
typedef struct run {
    int rc;
    char err[DS41_ERROR_MAX];
    int32_t *tokens; /* generated */
    size_t n_tokens;
    size_t n_prompt, n_cached, n_reasoning_tokens;
    ds41_buf reasoning, content; /* concatenated deltas */
    bool deltas_valid_utf8;
    char *result_reasoning, *result_content;
    size_t result_reasoning_len, result_content_len;
    char **call_names, **call_args;
    size_t n_calls;
    size_t n_final_calls_events; /* steps that carried tool calls */
    ds41_generation_finish finish;
    char finish_name[32];
    bool logprobs_ok;
    /* tool-call fragments, accumulated per index as a client does */
    ds41_buf stream_names[8], stream_args[8];
    size_t n_stream_calls;
    bool frags_ok;          /* a name only on a call's first fragment, with empty arguments */
    size_t frag_steps;      /* steps that carried fragments */
    size_t frag_steps_early; /* ... before the final step */
} run;

static void run_free(run *r) {
    free(r->tokens);
    ds41_buf_free(&r->reasoning);
    ds41_buf_free(&r->content);
    free(r->result_reasoning);
    free(r->result_content);
    for (size_t i = 0; i < r->n_calls; i++) {
        free(r->call_names[i]);
        free(r->call_args[i]);
    }
    free(r->call_names);
    free(r->call_args);
    for (size_t i = 0; i < 8; i++) {
        ds41_buf_free(&r->stream_names[i]);
        ds41_buf_free(&r->stream_args[i]);
    }
    memset(r, 0, sizeof *r);
}

static char *dupn(const char *s, size_t n) {
    char *d = malloc(n + 1);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

typedef struct run_opts {
    size_t chunk;          /* prefill chunk, 0 = all */
    size_t cached;         /* prefix-cache the first N prompt tokens (forked sequence) */
    size_t abort_after;    /* abort after this many steps (0 = never) */
    bool check_logprobs;   /* expect finite logprobs with n_top alternatives */
    bool no_model;         /* forced outputs only: constant logits instead of the forward pass */
    uint32_t n_top;
} run_opts;

/* Drive a generation to its end over the engine (one sequence), as the offline tool does. */
static run run_gen(const ds41_generation_params *p, const run_opts *o) {
    static const run_opts none = {0};
    if (!o) o = &none;
    run r = {.deltas_valid_utf8 = true, .logprobs_ok = true, .frags_ok = true};
    ds41_error err = {{0}};
    ds41_generation *g = NULL;
    ds41_kv_seq *seq = NULL, *base = NULL;
    float *logits = malloc(NV * sizeof *logits);
    r.rc = ds41_generation_new(TOK, p, NV, &g, &err);
    if (r.rc != 0) goto out;
    r.rc = -1;
    seq = ds41_kv_seq_new(POOL, &err);
    if (!seq) goto out;
    if (o->cached) {
        /* A "cache": another sequence that consumed the prefix, forked. */
        const int32_t *ids;
        ds41_generation_pending(g, &ids);
        base = ds41_kv_seq_new(POOL, &err);
        ds41_fwd_item it = {.seq = base, .ids = ids, .n_ids = o->cached};
        if (!base || ds41_forward(E, &it, 1, NULL, &err) != 0) goto out;
        ds41_kv_seq_free(seq);
        seq = ds41_kv_seq_fork(base, &err);
        if (!seq || ds41_generation_mark_cached(g, o->cached, &err) != 0) goto out;
    }
    size_t steps = 0;
    for (;;) {
        const int32_t *ids;
        size_t n = ds41_generation_pending(g, &ids);
        while (n) {
            size_t k = o->chunk && n > o->chunk ? o->chunk : n;
            if (o->no_model) {
                ds41_generation_mark_fed(g, n);
                memset(logits, 0, NV * sizeof *logits);
                break;
            }
            ds41_fwd_item it = {.seq = seq, .ids = ids, .n_ids = k, .logits = k == n ? logits : NULL,
                                .logits_last_only = true};
            if (ds41_forward(E, &it, 1, NULL, &err) != 0) goto out;
            ds41_generation_mark_fed(g, k);
            n = ds41_generation_pending(g, &ids);
        }
        if (!ds41_generation_wants_logits(g)) break;
        ds41_generation_delta d;
        if (o->abort_after && steps == o->abort_after) {
            if (ds41_generation_abort(g, &d, &err) != 0) goto out;
        } else if (ds41_generation_step(g, logits, SCRATCH, &d, &err) != 0) {
            goto out;
        }
        steps++;
        if ((d.reasoning_len && !ds41_utf8_valid(d.reasoning, d.reasoning_len, NULL)) ||
            (d.content_len && !ds41_utf8_valid(d.content, d.content_len, NULL)))
            r.deltas_valid_utf8 = false;
        ds41_buf_put(&r.reasoning, d.reasoning, d.reasoning_len);
        ds41_buf_put(&r.content, d.content, d.content_len);
        if (o->check_logprobs && d.finish != DS41_GENERATION_ABORTED &&
            (!isfinite(d.sample.logprob) || d.sample.logprob > 0 || d.sample.n_top != o->n_top))
            r.logprobs_ok = false;
        if (d.n_tool_calls) r.n_final_calls_events++;
        if (d.n_tool_deltas) {
            r.frag_steps++;
            if (!d.finished) r.frag_steps_early++;
        }
        for (size_t i = 0; i < d.n_tool_deltas; i++) {
            const ds41_generation_tool_delta *td = &d.tool_deltas[i];
            if (td->index > r.n_stream_calls || td->index >= 8) {
                r.frags_ok = false;
                continue;
            }
            bool first = td->index == r.n_stream_calls;
            if (first != (td->name != NULL) || (first && (td->arguments_len || td->name[td->name_len] != 0)))
                r.frags_ok = false;
            if (first) {
                r.n_stream_calls++;
                ds41_buf_put(&r.stream_names[td->index], td->name, td->name_len);
            }
            ds41_buf_put(&r.stream_args[td->index], td->arguments, td->arguments_len);
        }
        if (d.finished) break;
    }
    size_t n_all;
    const int32_t *all = ds41_generation_tokens(g, &n_all);
    r.n_prompt = ds41_generation_prompt_tokens(g);
    r.n_cached = ds41_generation_cached_tokens(g);
    r.n_reasoning_tokens = ds41_generation_reasoning_tokens(g);
    r.n_tokens = n_all - r.n_prompt;
    r.tokens = malloc((r.n_tokens + 1) * sizeof *r.tokens);
    memcpy(r.tokens, all + r.n_prompt, r.n_tokens * sizeof *r.tokens);
    const ds41_chat_completion *c = ds41_generation_result(g);
    if (!c) {
        snprintf(err.msg, sizeof err.msg, "no result after the end");
        goto out;
    }
    r.result_reasoning = dupn(c->reasoning_content, c->reasoning_content_len);
    r.result_reasoning_len = c->reasoning_content_len;
    r.result_content = dupn(c->content, c->content_len);
    r.result_content_len = c->content_len;
    r.n_calls = c->n_tool_calls;
    r.call_names = calloc(r.n_calls + 1, sizeof *r.call_names);
    r.call_args = calloc(r.n_calls + 1, sizeof *r.call_args);
    for (size_t i = 0; i < r.n_calls; i++) {
        r.call_names[i] = dupn(c->tool_calls[i].name, c->tool_calls[i].name_len);
        r.call_args[i] = dupn(c->tool_calls[i].arguments, c->tool_calls[i].arguments_len);
    }
    r.finish = ds41_generation_finish_reason(g);
    snprintf(r.finish_name, sizeof r.finish_name, "%s", ds41_generation_finish_name(g));
    r.rc = 0;
out:
    if (r.rc != 0) snprintf(r.err, sizeof r.err, "%s", err.msg);
    ds41_generation_free(g);
    ds41_kv_seq_free(seq);
    ds41_kv_seq_free(base);
    free(logits);
    return r;
}

static bool streamed_equals_result(const run *r) {
    return r->reasoning.len == r->result_reasoning_len &&
           (r->reasoning.len == 0 || memcmp(r->reasoning.data, r->result_reasoning, r->reasoning.len) == 0) &&
           r->content.len == r->result_content_len &&
           (r->content.len == 0 || memcmp(r->content.data, r->result_content, r->content.len) == 0);
}

/* The calls a client accumulates from the fragments are the parsed ones. */
static bool streamed_calls_equal_result(const run *r) {
    if (!r->frags_ok || r->n_stream_calls != r->n_calls) return false;
    for (size_t i = 0; i < r->n_calls; i++) {
        const ds41_buf *nm = &r->stream_names[i], *ar = &r->stream_args[i];
        if (nm->len != strlen(r->call_names[i]) || (nm->len && memcmp(nm->data, r->call_names[i], nm->len) != 0) ||
            ar->len != strlen(r->call_args[i]) || (ar->len && memcmp(ar->data, r->call_args[i], ar->len) != 0))
            return false;
    }
    return true;
}

static const char *cstr(const ds41_buf *b) { return b->data ? b->data : ""; }

/* Token ids of a text (special tokens matched). */
static uint32_t *encode(const char *text, size_t *n) {
    ds41_token_ids ids = {0};
    ds41_error err;
    if (ds41_tokenizer_encode(TOK, text, strlen(text), &ids, &err) != 0) {
        *n = 0;
        return NULL;
    }
    *n = ids.n;
    return ids.ids;
}

static json_t *user(const char *text) { return json_pack("[{s:s s:s}]", "role", "user", "content", text); }

/* ---- cases -------------------------------------------------------------------------------------- */

static void test_prompt(void) {
    json_t *msgs = json_pack("[{s:s s:s} {s:s s:s}]", "role", "developer", "content", "Be brief.", "role", "user",
                             "content", "Hi");
    json_t *as_system = json_pack("[{s:s s:s} {s:s s:s}]", "role", "system", "content", "Be brief.", "role", "user",
                                  "content", "Hi");
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.thinking = true;
    p.reasoning_effort = 20;
    ds41_generation *g = NULL;
    ds41_error err;
    int rc = ds41_generation_new(TOK, &p, NV, &g, &err);
    ds41_chat_request req = ds41_chat_request_default();
    req.messages = as_system;
    req.mode = DS41_CHAT_MODE_THINKING;
    json_t *effort = json_integer(20);
    req.reasoning_effort = effort;
    ds41_chat_prompt want;
    ds41_chat_render(&req, &want, &err);
    size_t len = 0;
    const char *text = rc == 0 ? ds41_generation_prompt_text(g, &len) : "";
    TAP_CHECK(rc == 0 && len == want.len && memcmp(text, want.text, len) == 0,
              "chat prompt = the V4.1 rendering (developer as system, effort prefix, <think>)");
    size_t n_want = 0, n_have = 0;
    uint32_t *ids = encode(want.text, &n_want);
    const int32_t *have = rc == 0 ? ds41_generation_tokens(g, &n_have) : NULL;
    bool same = rc == 0 && n_have == n_want && ds41_generation_prompt_tokens(g) == n_want;
    for (size_t i = 0; same && i < n_want; i++) same = (uint32_t)have[i] == ids[i];
    TAP_CHECK(same && n_want > 0 && ids[0] == 0, "prompt ids = the tokenizer's ids of the rendered text (BOS first)");
    const int32_t *pend;
    TAP_CHECK(rc == 0 && ds41_generation_pending(g, &pend) == n_want && pend == have && !ds41_generation_wants_logits(g),
              "the whole prompt is pending at first");
    free(ids);
    ds41_chat_prompt_free(&want);
    ds41_generation_free(g);
    json_decref(effort);

    /* prefix continuation: the last assistant message is rendered without its EOS */
    json_t *pre = json_pack("[{s:s s:s} {s:s s:s s:b}]", "role", "user", "content", "Count", "role", "assistant",
                            "content", "1, 2,", "prefix", 1);
    p = ds41_generation_params_default();
    p.messages = pre;
    rc = ds41_generation_new(TOK, &p, NV, &g, &err);
    text = rc == 0 ? ds41_generation_prompt_text(g, &len) : "";
    static const char tail[] = "<｜Assistant｜></think>1, 2,";
    TAP_CHECK(rc == 0 && len >= sizeof tail - 1 && memcmp(text + len - (sizeof tail - 1), tail, sizeof tail - 1) == 0,
              "a prefix assistant message is continued (no EOS after it)");
    ds41_generation_free(g);

    /* raw text and ids */
    p = ds41_generation_params_default();
    p.kind = DS41_GENERATION_RAW;
    p.text = "<｜begin▁of▁sentence｜>Once upon";
    p.text_len = strlen(p.text);
    rc = ds41_generation_new(TOK, &p, NV, &g, &err);
    ids = encode(p.text, &n_want);
    have = rc == 0 ? ds41_generation_tokens(g, &n_have) : NULL;
    same = rc == 0 && n_have == n_want;
    for (size_t i = 0; same && i < n_want; i++) same = (uint32_t)have[i] == ids[i];
    TAP_CHECK(same, "raw prompt = the text's ids exactly (no BOS added)");
    ds41_generation_free(g);
    free(ids);

    json_decref(msgs);
    json_decref(as_system);
    json_decref(pre);
}

static void test_errors(void) {
    ds41_generation *g = (ds41_generation *)1;
    ds41_error err;
    ds41_generation_params p = ds41_generation_params_default();
    p.kind = DS41_GENERATION_RAW;
    p.text = "";
    p.text_len = 0;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && !g && strstr(err.msg, "empty"),
              "an empty prompt is refused (%s)", err.msg);
    uint32_t bad_ids[2] = {5, 5000};
    p.kind = DS41_GENERATION_IDS;
    p.ids = bad_ids;
    p.n_ids = 2;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && strstr(err.msg, "prompt[1]"),
              "a prompt id outside the vocabulary is refused (%s)", err.msg);
    p.n_ids = 1;
    p.max_context = 1;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && strstr(err.msg, "context"),
              "a prompt that fills the context is refused (%s)", err.msg);
    p.max_context = 0;
    ds41_logit_bias lb = {.token = 4000, .bias = 1};
    p.sampler.logit_bias = &lb;
    p.sampler.n_logit_bias = 1;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && strstr(err.msg, "logit_bias"),
              "logit_bias outside the vocabulary is refused (%s)", err.msg);
    p.sampler.n_logit_bias = 0;
    json_t *bad = json_pack("[{s:s s:s}]", "role", "wizard", "content", "x");
    p = ds41_generation_params_default();
    p.messages = bad;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && strstr(err.msg, "Unknown role: wizard"),
              "an unknown role is refused with the encoder's message (%s)", err.msg);
    json_decref(bad);
    const char *empty_stop[1] = {""};
    json_t *msgs = user("x");
    p.messages = msgs;
    p.stop = empty_stop;
    p.n_stop = 1;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && strstr(err.msg, "stop"),
              "an empty stop string is refused (%s)", err.msg);
    p.n_stop = 0;
    uint32_t forced_bad = 9999;
    p.forced_ids = &forced_bad;
    p.n_forced = 1;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && strstr(err.msg, "forced"),
              "a forced id outside the vocabulary is refused (%s)", err.msg);
    p.n_forced = 0;
    g = NULL;
    int rc = ds41_generation_new(TOK, &p, NV, &g, &err);
    float *logits = calloc(NV, sizeof *logits);
    ds41_generation_delta d;
    TAP_CHECK(rc == 0 && ds41_generation_step(g, logits, SCRATCH, &d, &err) != 0 && strstr(err.msg, "feed"),
              "step before the prompt is fed is refused (%s)", err.msg);
    TAP_CHECK(rc == 0 && ds41_generation_mark_cached(g, ds41_generation_prompt_tokens(g), &err) != 0,
              "the whole prompt cannot come from the prefix cache (the last token gives logits)");
    ds41_generation_mark_fed(g, 1u << 30);
    logits[3] = NAN;
    TAP_CHECK(rc == 0 && ds41_generation_pending(g, NULL) == 0 && ds41_generation_step(g, logits, SCRATCH, &d, &err) != 0 &&
                  ds41_generation_wants_logits(g),
              "NaN logits are an error and change nothing (%s)", err.msg);
    free(logits);
    ds41_generation_free(g);
    json_decref(msgs);
}

static void test_seeded(void) {
    json_t *msgs = user("Tell me a story.");
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.sampler.temperature = 1.0f;
    p.sampler.has_seed = 1;
    p.sampler.seed = 7;
    p.max_tokens = 24;
    p.ignore_eos = true;
    run a = run_gen(&p, NULL), b = run_gen(&p, NULL);
    p.sampler.seed = 8;
    run c = run_gen(&p, NULL);
    TAP_CHECK(a.rc == 0 && b.rc == 0 && a.n_tokens == 24 && b.n_tokens == 24 &&
                  memcmp(a.tokens, b.tokens, 24 * sizeof *a.tokens) == 0 && strcmp(cstr(&a.content), cstr(&b.content)) == 0,
              "the same seed gives the same tokens and text (%s)", a.err);
    TAP_CHECK(c.rc == 0 && c.n_tokens == 24 && memcmp(a.tokens, c.tokens, 24 * sizeof *a.tokens) != 0,
              "another seed gives other tokens");
    TAP_CHECK(a.finish == DS41_GENERATION_MAX_TOKENS && strcmp(a.finish_name, "length") == 0,
              "max_tokens ends with finish_reason length");
    /* chunked prefill and a prefix-cache hit change nothing */
    run_opts chunked = {.chunk = 5};
    run d = run_gen(&p, &chunked);
    run_opts cached = {.cached = c.n_prompt - 3};
    run e = run_gen(&p, &cached);
    TAP_CHECK(d.rc == 0 && d.n_tokens == c.n_tokens && memcmp(d.tokens, c.tokens, c.n_tokens * sizeof *c.tokens) == 0,
              "a prompt prefilled in chunks of 5 gives the same tokens");
    TAP_CHECK(e.rc == 0 && e.n_tokens == c.n_tokens && memcmp(e.tokens, c.tokens, c.n_tokens * sizeof *c.tokens) == 0 &&
                  e.n_cached == c.n_prompt - 3 && c.n_cached == 0,
              "a prefix-cache hit (forked sequence) gives the same tokens and reports %zu cached tokens", e.n_cached);
    run_free(&a);
    run_free(&b);
    run_free(&c);
    run_free(&d);
    run_free(&e);
    json_decref(msgs);
}

/* Greedy generation = the argmax chain computed directly on the forward pass. */
static void test_greedy(void) {
    const uint32_t prompt[] = {0, 40, 41, 42, 300, 301, 302, 7, 8, 9};
    const size_t np = sizeof prompt / sizeof *prompt, K = 20;
    ds41_generation_params p = ds41_generation_params_default();
    p.kind = DS41_GENERATION_IDS;
    p.ids = prompt;
    p.n_ids = np;
    p.sampler.temperature = 0;
    p.max_tokens = (uint32_t)K;
    p.ignore_eos = true;
    run r = run_gen(&p, NULL);

    ds41_error err;
    ds41_kv_seq *seq = ds41_kv_seq_new(POOL, &err);
    float *logits = malloc(NV * sizeof *logits);
    int32_t ids[64];
    for (size_t i = 0; i < np; i++) ids[i] = (int32_t)prompt[i];
    ds41_fwd_item it = {.seq = seq, .ids = ids, .n_ids = np, .logits = logits, .logits_last_only = true};
    bool ok = ds41_forward(E, &it, 1, NULL, &err) == 0;
    int32_t chain[32];
    for (size_t k = 0; ok && k < K; k++) {
        chain[k] = ds41_argmax(logits, NV);
        ds41_fwd_item step = {.seq = seq, .ids = &chain[k], .n_ids = 1, .logits = logits, .logits_last_only = true};
        if (k + 1 < K) ok = ds41_forward(E, &step, 1, NULL, &err) == 0;
    }
    TAP_CHECK(ok && r.rc == 0 && r.n_tokens == K && memcmp(r.tokens, chain, K * sizeof *chain) == 0,
              "temperature 0 = the argmax chain of the forward pass (%zu tokens)", K);
    ds41_kv_seq_free(seq);
    free(logits);
    run_free(&r);

    /* logprobs with alternatives */
    json_t *msgs = user("Hi");
    p = ds41_generation_params_default();
    p.messages = msgs;
    p.sampler.logprobs = 1;
    p.sampler.top_logprobs = 3;
    p.sampler.has_seed = 1;
    p.max_tokens = 6;
    run_opts lo = {.check_logprobs = true, .n_top = 3};
    r = run_gen(&p, &lo);
    TAP_CHECK(r.rc == 0 && r.logprobs_ok, "logprobs: a finite logprob <= 0 and 3 alternatives per token");
    run_free(&r);
    json_decref(msgs);
}

static void test_forced(void) {
    json_t *msgs = user("Weather in Paris?");
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":"
                               "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}}}}}]",
                               0, NULL);
    size_t nf;
    uint32_t *forced = encode("I should call the tool.</think>" TOOL_BLOCK "<｜end▁of▁sentence｜>", &nf);
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.tools = tools;
    p.thinking = true;
    p.forced_ids = forced;
    p.n_forced = nf;
    p.sampler.has_seed = 1;
    p.sampler.seed = 3;
    run r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_tokens == nf && memcmp(r.tokens, forced, nf * sizeof *forced) == 0 &&
                  r.finish == DS41_GENERATION_EOS,
              "forced ids are generated in order, the forced EOS ends it (%s)", r.err);
    TAP_CHECK(strcmp(r.result_reasoning, "I should call the tool.") == 0 && strcmp(r.result_content, "") == 0,
              "</think> ends the reasoning (reasoning '%s', content '%s')", r.result_reasoning, r.result_content);
    TAP_CHECK(r.n_calls == 1 && strcmp(r.call_names[0], "get_weather") == 0 &&
                  strcmp(r.call_args[0], "{\"city\": \"Paris\", \"days\": 3}") == 0 && r.n_final_calls_events == 1,
              "the DSML block parses into one tool call, delivered in the final step (%s)",
              r.n_calls ? r.call_args[0] : "none");
    TAP_CHECK(strcmp(r.finish_name, "tool_calls") == 0 && streamed_equals_result(&r),
              "finish_reason tool_calls; the streamed reasoning and content equal the parsed message");
    TAP_CHECK(
        streamed_calls_equal_result(&r) && r.frag_steps_early == 1,
        "the call is streamed when its invoke closes, before the last step (%zu steps before the last carry "
        "fragments): name first with empty arguments, the fragments add up to the parsed arguments ('%s')",
        r.frag_steps_early, cstr(&r.stream_args[0]));
    size_t n_think;
    uint32_t *think_ids = encode("I should call the tool.</think>", &n_think);
    TAP_CHECK(r.n_reasoning_tokens == n_think, "reasoning tokens = the tokens up to </think> (%zu)", r.n_reasoning_tokens);
    free(think_ids);
    run_free(&r);
    free(forced);

    /* a block cut off by max_tokens at every token: never DSML text in content; a call only when its
     * invoke is complete with JSON arguments; streamed = not streamed (issue 13).  The last cut
     * leaves the block whole (only its EOS missing): its calls come back as parsed. */
    static const char *const cut_texts[] = {
        "Hmm.</think>Checking." TOOL_BLOCK,
        "Hmm.</think>Checking." TOOL_BLOCK_2,
        "Hmm.</think>Checking." TOOL_BLOCK_BAD_FIRST,
    };
    static const size_t full_calls[] = {1, 2, 0};
    for (size_t ti = 0; ti < 3; ti++) {
        forced = encode(cut_texts[ti], &nf);
        p.forced_ids = forced;
        p.n_forced = nf;
        bool ok = true;
        size_t n_with_call = 0;
        char why[1200] = "";
        /* the forced tokens decide the text: uniform logits instead of the model's, as the cut
         * points are many (a forward pass each took minutes under the sanitizers) */
        run_opts no_model = {.no_model = true};
        for (size_t cut = 1; cut <= nf && ok; cut++) {
            p.max_tokens = (uint32_t)cut;
            r = run_gen(&p, &no_model);
            bool args_ok = true;
            for (size_t i = 0; i < r.n_calls; i++) {
                json_t *a = json_loads(r.call_args[i], 0, NULL);
                args_ok = args_ok && json_is_object(a);
                json_decref(a);
            }
            if (r.n_calls) n_with_call++;
            if (r.rc != 0 || strcmp(r.finish_name, "length") != 0 || strstr(r.result_content, "DSML") ||
                strstr(r.result_content, "<｜") ||
                strncmp(r.result_content, "Checking.", strcspn(r.result_content, "\n")) != 0 ||
                strspn(r.result_content + strcspn(r.result_content, "\n"), "\n") !=
                    strlen(r.result_content + strcspn(r.result_content, "\n")) ||
                (cut < nf && (!args_ok || r.n_calls > full_calls[ti])) || !streamed_equals_result(&r) ||
                !streamed_calls_equal_result(&r)) {
                ok = false;
                snprintf(why, sizeof why,
                         "cut at %zu: rc %d, finish %s, content '%s', %zu calls ('%s'), %zu streamed %s", cut,
                         r.rc, r.finish_name, r.result_content, r.n_calls, r.n_calls ? r.call_args[0] : "",
                         r.n_stream_calls, r.err);
            }
            run_free(&r);
        }
        TAP_CHECK(ok && (full_calls[ti] == 0 || n_with_call > 0),
                  "block %zu cut off by max_tokens at each of its %zu tokens: finish length, no DSML in "
                  "content, calls "
                  "only whole with JSON arguments (%zu cuts had one), streamed = parsed %s",
                  ti, nf, n_with_call, why);
        free(forced);
    }

    /* cut off by the context instead of max_tokens: the same result at every third cut (the block
     * is handled as a cut-off one in both cases) */
    {
        forced = encode(cut_texts[1], &nf);
        p.forced_ids = forced;
        p.n_forced = nf;
        run_opts no_model = {.no_model = true};
        p.max_tokens = 1;
        r = run_gen(&p, &no_model);
        const size_t n_prompt = r.n_prompt;
        run_free(&r);
        bool same = n_prompt > 0;
        char why[600] = "";
        for (size_t cut = 1; cut < nf && same; cut += 3) {
            p.max_tokens = (uint32_t)cut;
            p.max_context = 0;
            run by_tokens = run_gen(&p, &no_model);
            p.max_tokens = 0;
            p.max_context = (uint32_t)(n_prompt + cut);
            run by_context = run_gen(&p, &no_model);
            same = by_tokens.rc == 0 && by_context.rc == 0 && by_context.finish == DS41_GENERATION_CONTEXT &&
                   strcmp(by_tokens.result_content, by_context.result_content) == 0 &&
                   by_tokens.n_calls == by_context.n_calls && !strstr(by_context.result_content, "DSML") &&
                   streamed_equals_result(&by_context);
            if (!same)
                snprintf(why, sizeof why,
                         "cut at %zu: '%s' (%zu calls) by max_tokens, '%s' (%zu calls) by the context", cut,
                         by_tokens.result_content ? by_tokens.result_content : "", by_tokens.n_calls,
                         by_context.result_content ? by_context.result_content : "", by_context.n_calls);
            run_free(&by_tokens);
            run_free(&by_context);
        }
        p.max_context = 0;
        TAP_CHECK(
            same,
            "block 1 cut off by the context at every third of its %zu tokens: as by max_tokens, no DSML %s",
            nf, why);
        free(forced);
    }

    /* tool calls not parsed (tool_choice none): the block is plain content, streamed as it comes */
    forced = encode("Hmm.</think>Checking." TOOL_BLOCK "<｜end▁of▁sentence｜>", &nf);
    p.forced_ids = forced;
    p.n_forced = nf;
    p.max_tokens = 0;
    p.parse_tool_calls = false;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_calls == 0 && strcmp(r.result_content, "Checking." TOOL_BLOCK) == 0 &&
                  strcmp(r.finish_name, "stop") == 0 && streamed_equals_result(&r),
              "without tool-call parsing the block is content");
    run_free(&r);
    free(forced);
    json_decref(tools);

    /* logit_bias forces single tokens */
    p = ds41_generation_params_default();
    p.messages = msgs;
    p.thinking = true;
    int32_t think_end = ds41_vocab_find(VOCAB, "</think>", 8);
    ds41_logit_bias lb = {.token = (uint32_t)think_end, .bias = 100};
    p.sampler.logit_bias = &lb;
    p.sampler.n_logit_bias = 1;
    p.max_tokens = 1;
    p.sampler.has_seed = 1;
    r = run_gen(&p, NULL);
    TAP_CHECK(think_end > 0 && r.rc == 0 && r.n_tokens == 1 && r.tokens[0] == think_end &&
                  strcmp(r.result_reasoning, "") == 0 && strcmp(r.result_content, "") == 0 && r.n_reasoning_tokens == 1,
              "logit_bias +100 makes the model emit </think>: empty reasoning closed");
    run_free(&r);
    int32_t eos = ds41_vocab_find(VOCAB, "<｜end▁of▁sentence｜>", strlen("<｜end▁of▁sentence｜>"));
    lb.token = (uint32_t)eos;
    p.thinking = false;
    p.max_tokens = 10;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_tokens == 1 && r.tokens[0] == eos && r.finish == DS41_GENERATION_EOS &&
                  strcmp(r.finish_name, "stop") == 0 && r.result_content_len == 0,
              "logit_bias on EOS: one token, finish stop, empty content, EOS counted");
    run_free(&r);

    /* ignore_eos: generation goes on past an EOS, whose text stays out of the message (it would
     * end the parse and hide the rest) */
    {
        forced = encode("Hello<｜end▁of▁sentence｜> world, still here.", &nf);
        p = ds41_generation_params_default();
        p.messages = msgs;
        p.forced_ids = forced;
        p.n_forced = nf;
        p.max_tokens = (uint32_t)nf;
        p.ignore_eos = true;
        r = run_gen(&p, NULL);
        bool has_eos = false;
        for (size_t i = 0; i < r.n_tokens; i++) has_eos |= r.tokens[i] == eos;
        TAP_CHECK(r.rc == 0 && r.n_tokens == nf && has_eos && strcmp(r.finish_name, "length") == 0 &&
                      strcmp(r.result_content, "Hello world, still here.") == 0 && streamed_equals_result(&r),
                  "ignore_eos: the tokens after an EOS are content, streamed as they come; the EOS counts "
                  "but adds no text ('%s')",
                  r.result_content ? r.result_content : "(none)");
        run_free(&r);
        p.ignore_eos = false;
        r = run_gen(&p, NULL);
        TAP_CHECK(r.rc == 0 && r.finish == DS41_GENERATION_EOS && strcmp(r.result_content, "Hello") == 0,
                  "without ignore_eos the same EOS ends it ('%s')",
                  r.result_content ? r.result_content : "(none)");
        run_free(&r);
        free(forced);
    }
    json_decref(msgs);
}

static void test_stop_and_limits(void) {
    json_t *msgs = user("x");
    const char *text = "Hello world, stop here please and more text after";
    size_t nf;
    uint32_t *forced = encode(text, &nf);
    const char *stops[2] = {"op her", "zzz"};
    /* the stop string must span several tokens for the case to mean something */
    bool spans = true;
    for (size_t i = 0; i < nf; i++) {
        size_t len;
        const uint8_t *b = ds41_tokenizer_token_bytes(TOK, forced[i], &len);
        if (b && memmem(b, len, "op her", 6)) spans = false;
    }
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.forced_ids = forced;
    p.n_forced = nf;
    p.stop = stops;
    p.n_stop = 2;
    run r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && strcmp(r.result_content, "Hello world, st") == 0 && strcmp(cstr(&r.content), "Hello world, st") == 0 &&
                  r.finish == DS41_GENERATION_STOP_STRING && strcmp(r.finish_name, "stop") == 0 && r.n_tokens < nf && spans,
              "a stop string across token boundaries cuts the text before it ('%s')", r.result_content);
    run_free(&r);

    p.n_stop = 0;
    p.max_tokens = 5;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_tokens == 5 && r.finish == DS41_GENERATION_MAX_TOKENS, "max_tokens 5: five tokens");
    size_t n_prompt = r.n_prompt;
    run_free(&r);
    p.max_tokens = 0;
    p.max_context = (uint32_t)n_prompt + 3;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_tokens == 3 && r.finish == DS41_GENERATION_CONTEXT && strcmp(r.finish_name, "length") == 0,
              "the context limit ends generation with length");
    run_free(&r);
    p.max_context = 0;
    uint32_t stop_id = forced[2];
    p.stop_ids = &stop_id;
    p.n_stop_ids = 1;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_tokens == 3 && r.finish == DS41_GENERATION_STOP_TOKEN && strcmp(r.finish_name, "stop") == 0,
              "a stop token id ends generation without its text");
    run_free(&r);
    p.n_stop_ids = 0;

    /* abort mid-way: what was generated is delivered and parsed */
    run_opts ab = {.abort_after = 4};
    r = run_gen(&p, &ab);
    TAP_CHECK(r.rc == 0 && r.finish == DS41_GENERATION_ABORTED && r.n_tokens == 4 && streamed_equals_result(&r) &&
                  strncmp(text, r.result_content, r.result_content_len) == 0 && r.result_content_len > 0,
              "abort ends the generation with what it had ('%s')", r.result_content);
    run_free(&r);
    free(forced);
    json_decref(msgs);
}

/* Byte tokens of multi-byte characters never leave a partial UTF-8 sequence. */
static void test_utf8(void) {
    const char *s = "é€😀";
    uint32_t byte_id[256];
    for (uint32_t id = 0; id < NV; id++) {
        size_t len;
        const uint8_t *b = ds41_tokenizer_token_bytes(TOK, id, &len);
        if (b && len == 1 && !ds41_tokenizer_is_special(TOK, id) && ds41_vocab_added_token(VOCAB, id) == NULL)
            byte_id[b[0]] = id;
    }
    uint32_t forced[16];
    size_t nf = 0;
    for (const uint8_t *c = (const uint8_t *)s; *c; c++) forced[nf++] = byte_id[*c];
    forced[nf++] = byte_id[0xE2]; /* a lead byte that never completes */
    json_t *msgs = user("x");
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.forced_ids = forced;
    p.n_forced = nf;
    p.max_tokens = (uint32_t)nf;
    run r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.deltas_valid_utf8 && strcmp(cstr(&r.content), "é€😀\xEF\xBF\xBD") == 0 &&
                  streamed_equals_result(&r),
              "byte tokens stream whole characters only; a dangling lead byte ends as U+FFFD");
    run_free(&r);
    json_decref(msgs);
}

/* Property: however the text is cut into tokens, the streamed reasoning and content are exactly
 * the final parse's.  Texts are random sequences of pieces of the markers, random words and
 * special tokens, forced, in both modes. */
static void test_split_property(void) {
    static const char *const pieces[] = {
        "a",    "b c",  " ",   "\n",         "\n\n",           "<",          "｜DSML｜",         " calls",
        ">",    ">\n",  "</",  "</think>",   "<think>",        " invoke",    " name=\"f\"",     " parameter",
        "é",    "😀",   "x=1", "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"g\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        "<｜end▁of▁sentence｜>", "</｜DSML｜ calls>", "string=\"true\">v</｜DSML｜ parameter>\n",
        "<｜DSML｜ parameter name=\"k\" string=\"true\">", "<｜DSML｜ parameter name=\"n\" string=\"false\">",
        "</｜DSML｜ parameter>\n", "</｜DSML｜ parameter>", "</｜DSML｜ invoke>\n", "<｜DSML｜ invoke name=\"h\">\n",
        "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n", "\"q\\é\t", "<\n", "1.5",
    };
    const size_t n_pieces = sizeof pieces / sizeof *pieces;
    json_t *msgs = user("x");
    uint64_t rng = 0x9E3779B97F4A7C15u;
    bool ok = true;
    char bad[256] = "";
    size_t with_calls = 0;
    for (int trial = 0; trial < 1000 && ok; trial++) {
        ds41_buf text = {0};
        rng = rng * 6364136223846793005u + 1442695040888963407u;
        int n = 1 + (int)((rng >> 33) % 12);
        for (int k = 0; k < n; k++) {
            rng = rng * 6364136223846793005u + 1442695040888963407u;
            ds41_buf_puts(&text, pieces[(rng >> 33) % n_pieces]);
        }
        size_t nf;
        uint32_t *forced = encode(text.data, &nf);
        ds41_generation_params p = ds41_generation_params_default();
        p.messages = msgs;
        p.thinking = (trial & 1) != 0;
        p.parse_tool_calls = (trial % 3) != 0;
        p.forced_ids = forced;
        p.n_forced = nf;
        p.max_tokens = (uint32_t)nf; /* ends on the last forced token unless an EOS comes first */
        p.ignore_eos = (trial % 5) == 0;
        run_opts fast = {.no_model = true};
        run r = run_gen(&p, &fast);
        if (r.rc != 0 || !streamed_equals_result(&r) || !r.deltas_valid_utf8 || !r.frags_ok ||
            (r.n_calls > 0 && !streamed_calls_equal_result(&r))) {
            ok = false;
            snprintf(bad, sizeof bad, "trial %d (thinking %d, tools %d): %.150s", trial, p.thinking,
                     p.parse_tool_calls, text.data);
        }
        with_calls += r.n_calls > 0;
        run_free(&r);
        free(forced);
        ds41_buf_free(&text);
    }
    TAP_CHECK(ok && with_calls > 0,
              "1000 random marker texts: streamed reasoning/content = the parsed message, streamed tool calls = "
              "the parsed ones whenever the parse has calls (%zu with calls) %s",
              with_calls, bad);
    json_decref(msgs);
}

/* tool_choice required / named constrain a random-weight model into a call; parallel_tool_calls. */
static void test_tool_choice(void) {
    json_t *msgs = user("Weather?");
    json_t *tools = json_loads(
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\"},\"note\":{\"type\":\"string\"}}}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"get_time\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"zone\":{\"type\":\"string\"}}}}}]",
        0, NULL);
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.tools = tools;
    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_NAMED;
    p.tool_choice_name = "get_time";
    p.max_tokens = 120;
    p.sampler.has_seed = 1;
    bool ok = true, json_ok = true;
    char bad[2048] = "";
    for (uint64_t seed = 1; seed <= 6 && ok; seed++) {
        p.sampler.seed = seed;
        run r = run_gen(&p, NULL);
        json_t *args = r.n_calls ? json_loads(r.call_args[0], JSON_ALLOW_NUL, NULL) : NULL;
        if (!args) json_ok = false;
        json_decref(args);
        if (r.rc != 0 || r.n_calls != 1 || strcmp(r.call_names[0], "get_time") != 0 ||
            strcmp(r.finish_name, "tool_calls") != 0 || r.result_content_len != 0 || !streamed_calls_equal_result(&r) ||
            !streamed_equals_result(&r)) {
            ok = false;
            snprintf(bad, sizeof bad, "seed %llu: rc %d, %zu calls, finish %s, content '%.60s' %s", (unsigned long long)seed,
                     r.rc, r.n_calls, r.finish_name, r.result_content ? r.result_content : "", r.err);
        }
        run_free(&r);
    }
    TAP_CHECK(ok && json_ok,
              "tool_choice named, random model, 6 seeds: exactly one call to that function, no content, finish "
              "tool_calls, JSON arguments (string values), streamed = parsed %s", bad);

    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_REQUIRED;
    p.tool_choice_name = NULL;
    p.max_tokens = 60;
    ok = true;
    for (uint64_t seed = 1; seed <= 6 && ok; seed++) {
        p.sampler.seed = seed;
        run r = run_gen(&p, NULL);
        if (r.rc != 0 || r.n_calls < 1 || strcmp(r.finish_name, "tool_calls") != 0 ||
            (strcmp(r.call_names[0], "get_time") != 0 && strcmp(r.call_names[0], "get_weather") != 0) ||
            !streamed_calls_equal_result(&r)) {
            ok = false;
            snprintf(bad, sizeof bad, "seed %llu: rc %d, %zu calls, finish %s, %zu tokens, content '%.300s' %s",
                     (unsigned long long)seed, r.rc, r.n_calls, r.finish_name, r.n_tokens,
                     r.result_content ? r.result_content : "", r.err);
        }
        run_free(&r);
    }
    TAP_CHECK(ok, "tool_choice required, random model, max_tokens 60: a call to one of the tools %s", bad);

    /* thinking: the reasoning is free, the call starts after </think> */
    size_t nf;
    uint32_t *forced = encode("Let me see.</think>", &nf);
    p.thinking = true;
    p.forced_ids = forced;
    p.n_forced = nf;
    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_NAMED;
    p.tool_choice_name = "get_weather";
    p.sampler.seed = 5;
    p.max_tokens = 80;
    run r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_calls == 1 && strcmp(r.call_names[0], "get_weather") == 0 &&
                  strcmp(r.result_reasoning, "Let me see.") == 0 && r.result_content_len == 0 &&
                  streamed_calls_equal_result(&r) && streamed_equals_result(&r),
              "thinking mode: the reasoning stays the model's, the named call follows </think> (%s)", r.err);
    run_free(&r);
    free(forced);

    /* max_tokens too small for the invoke line: no call (cut off) */
    p.forced_ids = NULL;
    p.n_forced = 0;
    p.thinking = false;
    p.max_tokens = 3;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_calls == 0 && strcmp(r.finish_name, "length") == 0,
              "a max_tokens that cannot hold the invoke line cuts the call off (finish length)");
    run_free(&r);

    /* parallel_tool_calls false keeps the first of two calls (auto, forced output) */
    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_AUTO;
    p.max_tokens = 0;
    forced = encode("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_time\">\n<｜DSML｜ parameter name=\"zone\" "
                    "string=\"true\">UTC</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n<｜DSML｜ invoke "
                    "name=\"get_weather\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>",
                    &nf);
    p.forced_ids = forced;
    p.n_forced = nf;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_calls == 2 && streamed_calls_equal_result(&r) &&
                  strcmp(r.call_args[1], "{}") == 0,
              "parallel_tool_calls true: both calls, streamed and parsed");
    run_free(&r);
    p.parallel_tool_calls = false;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_calls == 1 && strcmp(r.call_names[0], "get_time") == 0 &&
                  strcmp(r.call_args[0], "{\"zone\": \"UTC\"}") == 0 && streamed_calls_equal_result(&r) &&
                  strcmp(r.finish_name, "tool_calls") == 0,
              "parallel_tool_calls false: the first call only, streamed and parsed");
    run_free(&r);
    free(forced);

    /* parallel false under a named choice: the grammar closes the block after one invoke */
    p.forced_ids = NULL;
    p.n_forced = 0;
    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_REQUIRED;
    p.max_tokens = 60;
    p.sampler.seed = 9;
    r = run_gen(&p, NULL);
    TAP_CHECK(r.rc == 0 && r.n_calls == 1 &&
                  strcmp(r.finish_name, "tool_calls") == 0,
              "tool_choice required with parallel_tool_calls false: one call");
    run_free(&r);

    /* uniform logits (every allowed token equally likely), many seeds and budgets, both choices */
    ok = true;
    size_t n_params_seen = 0;
    for (uint64_t trial = 0; trial < 150 && ok; trial++) {
        p.tool_choice = trial % 2 ? DS41_GENERATION_TOOL_CHOICE_REQUIRED : DS41_GENERATION_TOOL_CHOICE_NAMED;
        p.tool_choice_name = trial % 2 ? NULL : "get_weather";
        p.parallel_tool_calls = trial % 3 != 0;
        p.max_tokens = (uint32_t)(50 + (trial * 37) % 150);
        p.sampler.seed = 1000 + trial;
        run_opts fast = {.no_model = true};
        r = run_gen(&p, &fast);
        json_t *args = r.n_calls ? json_loads(r.call_args[0], JSON_ALLOW_NUL, NULL) : NULL;
        if (args) n_params_seen += json_object_size(args);
        if (r.rc != 0 || r.n_calls < 1 || !args || strcmp(r.finish_name, "tool_calls") != 0 || r.result_content_len ||
            (!p.parallel_tool_calls && r.n_calls != 1) || (trial % 2 == 0 && strcmp(r.call_names[0], "get_weather") != 0) ||
            !streamed_calls_equal_result(&r) || !streamed_equals_result(&r)) {
            ok = false;
            snprintf(bad, sizeof bad, "trial %llu: rc %d, %zu calls, finish %s, %zu tokens, content '%.300s', "
                     "call '%.200s' streamed '%.200s' %s", (unsigned long long)trial, r.rc, r.n_calls, r.finish_name,
                     r.n_tokens, r.result_content ? r.result_content : "", r.n_calls ? r.call_args[0] : "",
                     cstr(&r.stream_args[0]), r.err);
        }
        json_decref(args);
        run_free(&r);
    }
    TAP_CHECK(ok && n_params_seen > 0,
              "150 runs over uniform logits (named / required, parallel or not, max_tokens 50..199): always a "
              "call with JSON-object arguments, finish tool_calls, streamed = parsed (%zu parameters in all) %s",
              n_params_seen, bad);
    p.parallel_tool_calls = true;

    ds41_error err = {{0}};
    ds41_generation *g = NULL;
    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_NAMED;
    p.tool_choice_name = "nope";
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && !g && strstr(err.msg, "nope"),
              "tool_choice naming a function not among the tools is refused (%s)", err.msg);
    p.tools = NULL;
    p.tool_choice = DS41_GENERATION_TOOL_CHOICE_REQUIRED;
    TAP_CHECK(ds41_generation_new(TOK, &p, NV, &g, &err) != 0 && !g && strstr(err.msg, "no tools"),
              "tool_choice required without tools is refused (%s)", err.msg);
    json_decref(tools);
    json_decref(msgs);
}

/* skip_special: the special tokens' text never reaches reasoning or content, streamed or final,
 * even when a special token's text is spelt by ordinary tokens over several steps. */
static uint32_t *concat_encoded(const char *const *pieces, size_t n_pieces, size_t *n) {
    uint32_t *all = NULL;
    *n = 0;
    for (size_t i = 0; i < n_pieces; i++) {
        size_t k;
        uint32_t *ids = encode(pieces[i], &k);
        all = realloc(all, (*n + k + 1) * sizeof *all);
        memcpy(all + *n, ids, k * sizeof *ids);
        *n += k;
        free(ids);
    }
    return all;
}

static bool has_special_text(const char *s) {
    static const char *const sp[] = {"<think>", "｜", "<｜", "end▁of▁sentence", NULL};
    for (size_t i = 0; sp[i]; i++)
        if (s && strstr(s, sp[i])) return true;
    return false;
}

static void test_special_tokens(void) {
    json_t *msgs = user("Hi");
    /* "<｜Assistant｜>" and "<｜User｜>" spelt by ordinary tokens, byte by byte around the
     * fullwidth bar: a streamed step may end inside them */
    const char *const pieces[] = {
        "Let me <｜title｜>think",     "<", "｜", "Ass",  "istant", "｜",       ">",
        ".</think>Answer <think>with", "<", "｜", "User", "｜>",    " tokens.", "<｜end▁of▁sentence｜>"};
    size_t nf;
    uint32_t *forced = concat_encoded(pieces, sizeof pieces / sizeof *pieces, &nf);
    ds41_generation_params p = ds41_generation_params_default();
    p.skip_special = true; /* what the daemon sets unless skip_special_tokens is false */
    p.messages = msgs, p.thinking = true;
    p.forced_ids = forced, p.n_forced = nf;
    run_opts o = {.no_model = true};
    run r = run_gen(&p, &o);
    TAP_CHECK(r.rc == 0 && r.finish == DS41_GENERATION_EOS &&
                  strcmp(r.result_reasoning, "Let me think.") == 0 &&
                  strcmp(r.result_content, "Answer with tokens.") == 0,
              "skip_special: the message's reasoning and content lose every special token ('%s' / '%s', %s)",
              r.result_reasoning ? r.result_reasoning : "", r.result_content ? r.result_content : "", r.err);
    TAP_CHECK(
        r.rc == 0 && streamed_equals_result(&r) && !has_special_text(cstr(&r.reasoning)) &&
            !has_special_text(cstr(&r.content)),
        "skip_special: the streamed deltas add up to the same text, no special token in part ('%s' / '%s')",
        cstr(&r.reasoning), cstr(&r.content));
    run_free(&r);

    p.skip_special = false;
    r = run_gen(&p, &o);
    TAP_CHECK(r.rc == 0 && strcmp(r.result_reasoning, "Let me <｜title｜>think<｜Assistant｜>.") == 0 &&
                  strcmp(r.result_content, "Answer <think>with<｜User｜> tokens.") == 0 &&
                  streamed_equals_result(&r),
              "without skip_special they are kept, streamed and final ('%s' / '%s')",
              r.result_reasoning ? r.result_reasoning : "", r.result_content ? r.result_content : "");
    run_free(&r);
    free(forced);

    /* a text prompt (completions): the same rule; a held '<' that becomes no special token is
     * delivered at the end */
    const char *const raw_pieces[] = {"a<｜Assistant｜>b", "<think>", "c <", "｜", "Use"};
    forced = concat_encoded(raw_pieces, sizeof raw_pieces / sizeof *raw_pieces, &nf);
    p = ds41_generation_params_default();
    p.kind = DS41_GENERATION_RAW;
    p.text = "x";
    p.text_len = 1;
    p.forced_ids = forced;
    p.n_forced = nf;
    p.max_tokens = (uint32_t)nf;
    p.skip_special = true;
    r = run_gen(&p, &o);
    TAP_CHECK(r.rc == 0 && strcmp(r.result_content, "abc <｜Use") == 0 && streamed_equals_result(&r),
              "a raw prompt: special tokens dropped, a prefix that never completes one kept ('%s')",
              r.result_content ? r.result_content : "");
    run_free(&r);
    free(forced);

    /* the DSML marker is markup, not a control token: a block left as text keeps it whole */
    const char *const dsml_pieces[] = {"a<｜DSML｜ calls>", "<think>", "</｜DSML｜ calls>"};
    forced = concat_encoded(dsml_pieces, sizeof dsml_pieces / sizeof *dsml_pieces, &nf);
    p.forced_ids = forced;
    p.n_forced = nf;
    p.max_tokens = (uint32_t)nf;
    r = run_gen(&p, &o);
    TAP_CHECK(r.rc == 0 && r.result_content &&
                  strcmp(r.result_content, "a<｜DSML｜ calls></｜DSML｜ calls>") == 0 &&
                  streamed_equals_result(&r),
              "skip_special keeps the DSML marker of a block left as text ('%s')",
              r.result_content ? r.result_content : "");
    run_free(&r);
    free(forced);
    json_decref(msgs);
}

/* tool_choice required / named with typed schemas (issue 13): over many seeds, temperatures and
 * budgets, every call's arguments are JSON of its schema with every required property, streamed
 * = parsed; a random-weight model and uniform logits both. */
static void test_tool_schema(void) {
    json_t *msgs = user("Book it.");
    json_t *tools = json_loads(
        "[{\"type\":\"function\",\"function\":{\"name\":\"book\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\"},\"nights\":{\"type\":\"integer\"},"
        "\"price\":{\"type\":\"number\"},\"unit\":{\"type\":\"string\",\"enum\":[\"EUR\",\"USD\"]},"
        "\"flex\":{\"type\":\"boolean\"},\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"}},"
        "\"guest\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":"
        "[\"integer\",\"null\"]}},\"required\":[\"name\",\"age\"],\"additionalProperties\":false},"
        "\"note\":{}},\"required\":[\"city\",\"nights\",\"guest\",\"unit\"]}}},"
        "{\"type\":\"function\",\"function\":{\"name\":\"ping\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"n\":{\"type\":\"integer\",\"enum\":[1,2,30]}},\"required\":[\"n\"]}}}]",
        0, NULL);
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.tools = tools;
    p.sampler.has_seed = 1;
    bool ok = true;
    size_t n_runs = 0, n_calls = 0, n_props = 0;
    char bad[1500] = "";
    for (uint64_t trial = 0; trial < 60 && ok; trial++) {
        p.tool_choice = trial % 3 ? DS41_GENERATION_TOOL_CHOICE_REQUIRED : DS41_GENERATION_TOOL_CHOICE_NAMED;
        p.tool_choice_name = trial % 3 ? NULL : (trial % 2 ? "ping" : "book");
        p.parallel_tool_calls = trial % 4 != 0;
        p.max_tokens = (uint32_t)(300 + (trial * 53) % 300);
        p.sampler.seed = 77 + trial;
        p.sampler.temperature = (float)(trial % 5) * 0.5f; /* 0 (greedy) .. 2 */
        run_opts fast = {.no_model = trial % 4 != 1};
        run r = run_gen(&p, &fast);
        n_runs++;
        bool good = r.rc == 0 && r.n_calls >= 1 && strcmp(r.finish_name, "tool_calls") == 0 &&
                    r.result_content_len == 0 && streamed_calls_equal_result(&r) &&
                    streamed_equals_result(&r);
        for (size_t i = 0; good && i < r.n_calls; i++) {
            json_t *a = json_loads(r.call_args[i], 0, NULL);
            size_t ti = strcmp(r.call_names[i], "ping") == 0 ? 1 : 0;
            const json_t *sc =
                json_object_get(json_object_get(json_array_get(tools, ti), "function"), "parameters");
            good = a && valid(sc, a) &&
                   (!p.tool_choice_name || strcmp(r.call_names[i], p.tool_choice_name) == 0);
            if (a) n_props += json_object_size(a);
            json_decref(a);
            n_calls++;
        }
        if (!good) {
            ok = false;
            snprintf(bad, sizeof bad,
                     "trial %llu: rc %d, %zu calls, finish %s, content '%.200s', call %s '%.600s' %s",
                     (unsigned long long)trial, r.rc, r.n_calls, r.finish_name,
                     r.result_content ? r.result_content : "", r.n_calls ? r.call_names[0] : "",
                     r.n_calls ? r.call_args[0] : "", r.err);
        }
        run_free(&r);
    }
    TAP_CHECK(
        ok,
        "%zu runs (named / required, temperatures 0..2, max_tokens 300..599, model and uniform logits): "
        "%zu calls, each with arguments that are JSON of its schema and every required property (%zu "
        "properties in all), finish tool_calls, streamed = parsed %s",
        n_runs, n_calls, n_props, bad);

    /* a budget too small for the whole call: cut off, never DSML in content, streamed = parsed */
    ok = true;
    size_t n_cut_calls = 0;
    for (uint32_t mt = 1; mt <= 300 && ok; mt += 7) {
        p.tool_choice = DS41_GENERATION_TOOL_CHOICE_NAMED;
        p.tool_choice_name = "book";
        p.max_tokens = mt;
        p.sampler.seed = mt;
        p.sampler.temperature = 1;
        run_opts fast = {.no_model = true};
        run r = run_gen(&p, &fast);
        bool good = r.rc == 0 && !strstr(r.result_content ? r.result_content : "", "DSML") &&
                    streamed_calls_equal_result(&r) && streamed_equals_result(&r);
        for (size_t i = 0; good && i < r.n_calls; i++) {
            json_t *a = json_loads(r.call_args[i], 0, NULL);
            good = a &&
                   valid(json_object_get(json_object_get(json_array_get(tools, 0), "function"), "parameters"),
                         a);
            json_decref(a);
            n_cut_calls++;
        }
        if (!good) {
            ok = false;
            snprintf(bad, sizeof bad, "max_tokens %u: rc %d, %zu calls, finish %s, content '%.300s' %s", mt,
                     r.rc, r.n_calls, r.finish_name, r.result_content ? r.result_content : "", r.err);
        }
        run_free(&r);
    }
    TAP_CHECK(ok,
              "max_tokens 1..300 under a named choice: no DSML in content, any call (%zu) valid, streamed = "
              "parsed %s",
              n_cut_calls, bad);
    json_decref(tools);
    json_decref(msgs);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    char root[512];
    snprintf(root, sizeof root, "%s/ds41-generate-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir[600];
    snprintf(dir, sizeof dir, "%s/tiny", root);
    ds41_error err = {{0}};
    ds41_model_gen_opts mo = {.preset = "tiny", .seed = 1};
    int rc = ds41_model_generate(dir, &mo, NULL, &err);
    if (rc == 0) E = ds41_engine_load(dir, NULL, &err);
    if (E) VOCAB = ds41_vocab_load_dir(dir, &err);
    if (VOCAB) TOK = ds41_tokenizer_new(VOCAB, &err);
    if (TOK) {
        NV = (uint32_t)ds41_engine_config(E)->vocab_size;
        POOL = ds41_engine_new_pool(E, 0, 0, &err);
    }
    if (POOL && ds41_sampler_scratch_new(&SCRATCH, NV, &err) != 0) SCRATCH = NULL;
    if (!TAP_CHECK(SCRATCH != NULL, "tiny checkpoint, engine, tokenizer (%s)", SCRATCH ? "ok" : err.msg)) {
        tmpdir_remove(root);
        return tap_done();
    }
    test_prompt();
    test_errors();
    test_seeded();
    test_greedy();
    test_forced();
    test_special_tokens();
    test_stop_and_limits();
    test_utf8();
    test_split_property();
    test_tool_choice();
    test_tool_schema();

    ds41_sampler_scratch_free(SCRATCH);
    ds41_kv_pool_free(POOL);
    ds41_tokenizer_free(TOK);
    ds41_vocab_free(VOCAB);
    ds41_engine_free(E);
    tmpdir_remove(root);
    return tap_done();
}
