/* Fuzz target 'generate': engine/generate's streaming split on arbitrary output.  The input
 * decides the options (first byte: thinking mode, DSML parsing, ignore_eos, byte-level forcing,
 * up to two stop strings given after it as a length byte + bytes) and the generated output: the
 * rest of the input is either encoded with a small synthetic DeepSeek tokenizer (special tokens
 * such as </think>, ｜DSML｜ and EOS matched) or, with byte-level forcing, mapped byte by byte to
 * the byte tokens (so multi-byte characters arrive split and invalid UTF-8 occurs).  Those ids are
 * forced as the generation's output over constant logits (no model).  Invariants, any violation
 * aborts: every delta is valid UTF-8; the concatenated streamed reasoning and content equal the
 * final message's reasoning_content and content; parsed tool calls come only in the final step;
 * tool-call fragments come in index order, a call's first one with its name and empty arguments,
 * and whenever the final parse has calls, the fragments add up to exactly those calls; the
 * generation ends within the forced ids; usage counts add up.  Flag bit 6 sets
 * parallel_tool_calls false, bit 7 tool_choice "required" over two tools (the constraint runs,
 * the forced ids override it). */
#include "config/utf8.h"
#include "engine/serve/generate.h"
#include "engine/text/synth_tokenizer.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab.h"

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A violated invariant names itself before aborting (a crash artifact is then read at once). */
#define check(ok)                                                                              \
    do {                                                                                       \
        if (!(ok)) {                                                                           \
            fprintf(stderr, "fuzz_generate: invariant failed at line %d: %s\n", __LINE__, #ok); \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

static ds41_tokenizer *TOK;
static uint32_t NV;
static uint32_t BYTE_ID[256];
static ds41_sampler_scratch *SCRATCH;
static float *LOGITS;
static json_t *MESSAGES;
static json_t *TOOLS;

static void setup(void) {
    if (TOK) return;
    ds41_error err = {{0}};
    size_t len;
    char *js = ds41_synth_tokenizer_json(1000, 5, &len, &err);
    check(js != NULL);
    ds41_vocab *v = ds41_vocab_parse(js, len, "synth.json", &err);
    free(js);
    check(v != NULL);
    TOK = ds41_tokenizer_new(v, &err); /* borrows v for the life of the process */
    check(TOK != NULL);
    NV = ds41_vocab_size(v);
    for (uint32_t id = 0; id < NV; id++) {
        size_t l;
        const uint8_t *b = ds41_tokenizer_token_bytes(TOK, id, &l);
        if (b && l == 1 && !ds41_vocab_added_token(v, id) && !BYTE_ID[b[0]]) BYTE_ID[b[0]] = id;
    }
    check(ds41_sampler_scratch_new(&SCRATCH, NV, &err) == 0);
    LOGITS = calloc(NV, sizeof *LOGITS);
    check(LOGITS != NULL);
    MESSAGES = json_pack("[{s:s s:s}]", "role", "user", "content", "x");
    check(MESSAGES != NULL);
    TOOLS = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\","
                       "\"properties\":{\"k\":{\"type\":\"string\"},\"n\":{\"type\":\"integer\"}}}}},"
                       "{\"type\":\"function\",\"function\":{\"name\":\"g\"}}]",
                       0, NULL);
    check(TOOLS != NULL);
}

/* Tool-call fragments as a client accumulates them. */
typedef struct acc_call {
    char *name, *args;
    size_t name_len, args_len;
} acc_call;

static void acc_append(char **dst, size_t *len, const char *s, size_t n) {
    *dst = realloc(*dst, *len + n + 1);
    check(*dst != NULL);
    if (n) memcpy(*dst + *len, s, n);
    *len += n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    setup();
    if (size < 1) return 0;
    const uint8_t flags = data[0];
    size_t pos = 1;
    const char *stops[2];
    size_t stop_lens[2];
    size_t n_stop = 0;
    for (int k = 0; k < ((flags >> 4) & 3) && k < 2; k++) {
        if (pos >= size) return 0;
        size_t l = data[pos++] % 16;
        if (l == 0 || pos + l > size) return 0;
        stops[n_stop] = (const char *)data + pos;
        stop_lens[n_stop++] = l;
        pos += l;
    }
    ds41_token_ids ids = {0};
    ds41_error err = {{0}};
    if (flags & 8) {
        for (size_t i = pos; i < size; i++) {
            uint32_t id = BYTE_ID[data[i]];
            if (ids.n == ids.cap) {
                ids.cap = ids.cap ? ids.cap * 2 : 64;
                ids.ids = realloc(ids.ids, ids.cap * sizeof *ids.ids);
                check(ids.ids != NULL);
            }
            ids.ids[ids.n++] = id;
        }
    } else {
        check(ds41_tokenizer_encode(TOK, (const char *)data + pos, size - pos, &ids, &err) == 0);
    }
    if (ids.n == 0 || ids.n > 512) {
        ds41_token_ids_free(&ids);
        return 0;
    }
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = MESSAGES;
    p.thinking = flags & 1;
    p.parse_tool_calls = !(flags & 2);
    p.ignore_eos = flags & 4;
    p.stop = stops;
    p.stop_lens = stop_lens;
    p.n_stop = n_stop;
    p.parallel_tool_calls = !(flags & 64);
    if (flags & 128) {
        p.tools = TOOLS;
        p.tool_choice = DS41_GENERATION_TOOL_CHOICE_REQUIRED;
    }
    p.forced_ids = ids.ids;
    p.n_forced = ids.n;
    p.max_tokens = (uint32_t)ids.n;
    p.sampler.has_seed = 1;
    p.sampler.temperature = 0; /* greedy: the forced ids decide, sampling stays cheap */
    ds41_generation *g = NULL;
    if (ds41_generation_new(TOK, &p, NV, &g, &err) != 0) { /* e.g. a stop string that is not UTF-8 */
        ds41_token_ids_free(&ids);
        return 0;
    }
    char *reasoning = malloc(1), *content = malloc(1);
    size_t rl = 0, cl = 0, steps = 0, calls_seen = 0, n_acc = 0;
    acc_call acc[16];
    memset(acc, 0, sizeof acc);
    check(reasoning && content);
    bool finished = false;
    while (!finished) {
        ds41_generation_mark_fed(g, ds41_generation_pending(g, NULL));
        check(ds41_generation_wants_logits(g));
        ds41_generation_delta d;
        check(ds41_generation_step(g, LOGITS, SCRATCH, &d, &err) == 0);
        steps++;
        check(d.token == ids.ids[steps - 1]);
        check(ds41_utf8_valid(d.reasoning, d.reasoning_len, NULL) && ds41_utf8_valid(d.content, d.content_len, NULL));
        reasoning = realloc(reasoning, rl + d.reasoning_len + 1);
        content = realloc(content, cl + d.content_len + 1);
        check(reasoning && content);
        memcpy(reasoning + rl, d.reasoning, d.reasoning_len);
        memcpy(content + cl, d.content, d.content_len);
        rl += d.reasoning_len;
        cl += d.content_len;
        if (d.n_tool_calls) {
            check(d.finished);
            calls_seen = d.n_tool_calls;
        }
        for (size_t i = 0; i < d.n_tool_deltas; i++) {
            const ds41_generation_tool_delta *td = &d.tool_deltas[i];
            check(td->index <= n_acc);
            bool first = td->index == n_acc;
            check(first == (td->name != NULL));
            if (first) {
                check(td->arguments_len == 0 && td->name[td->name_len] == 0);
                if (n_acc == 16) continue; /* more calls than kept: only the order is checked */
                acc_append(&acc[n_acc].name, &acc[n_acc].name_len, td->name, td->name_len);
                n_acc++;
            }
            if (td->index < 16) acc_append(&acc[td->index].args, &acc[td->index].args_len, td->arguments, td->arguments_len);
        }
        finished = d.finished;
        check(steps <= ids.n);
    }
    const ds41_chat_completion *r = ds41_generation_result(g);
    check(r != NULL);
    check(r->reasoning_content_len == rl && memcmp(r->reasoning_content, reasoning, rl) == 0);
    check(r->content_len == cl && memcmp(r->content, content, cl) == 0);
    check(calls_seen == r->n_tool_calls);
    check(ds41_generation_completion_tokens(g) == steps);
    check(ds41_generation_reasoning_tokens(g) <= steps);
    check(p.thinking || ds41_generation_reasoning_tokens(g) == 0);
    for (size_t i = 0; i < r->n_tool_calls; i++) check(p.parse_tool_calls && r->tool_calls[i].name != NULL);
    check(p.parallel_tool_calls || r->n_tool_calls <= 1);
    if (r->n_tool_calls > 0 && r->n_tool_calls <= 16) {
        check(n_acc == r->n_tool_calls);
        for (size_t i = 0; i < n_acc; i++) {
            const ds41_chat_tool_call *c = &r->tool_calls[i];
            check(acc[i].name_len == c->name_len && memcmp(acc[i].name, c->name, c->name_len) == 0);
            check(acc[i].args_len == c->arguments_len && (!c->arguments_len || memcmp(acc[i].args, c->arguments, c->arguments_len) == 0));
        }
    }
    for (size_t i = 0; i < n_acc; i++) {
        free(acc[i].name);
        free(acc[i].args);
    }
    free(reasoning);
    free(content);
    ds41_generation_free(g);
    ds41_token_ids_free(&ids);
    return 0;
}
