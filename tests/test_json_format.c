/* Structured output (engine/serve/generate.h "Structured output"): the response-format schemas are
 * compiled or refused naming the keyword; with random logits on a synthetic byte-level BPE
 * vocabulary, at every step the mask leaves exactly the tokens whose bytes continue a valid
 * document (compared with a token-by-token check that feeds every token from the current state,
 * without the byte-order walk) and EOS exactly when the document is complete; every output is
 * JSON that an independent validator accepts; a tight max_tokens still ends in a whole document;
 * thinking mode constrains only the content; min_tokens holds EOS back.  The per-step cost of the
 * mask is printed (as a comment) for a 1,024-id and a 129,280-id vocabulary. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include <jansson.h>

#include "engine/model/pcg64.h"
#include "engine/serve/generate_internal.h"
#include "engine/text/synth_tokenizer.h"
#include "engine/text/vocab.h"
#include "tests/schema_valid.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

static const char *const SCHEMAS[] = {
    NULL, /* json_object */
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"bb\",\"c\"]}}},\"required\":[\"name\",\"age\","
    "\"tags\"],\"additionalProperties\":false}",
    "{\"type\":\"object\",\"properties\":{\"p\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":"
    "\"number\"},"
    "\"y\":{\"type\":[\"number\",\"null\"]}},\"required\":[\"x\",\"y\"],\"additionalProperties\":false},"
    "\"l\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"ok\"]}}},\"required\":[\"p\",\"l\"]}",
    "{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}",
    "{\"enum\":[\"red\",\"green\",3,null]}",
    "{\"type\":\"string\"}",
};
#define N_SCHEMAS (sizeof SCHEMAS / sizeof *SCHEMAS)

static json_t *format_of(size_t i) {
    if (!SCHEMAS[i]) return json_pack("{s:s}", "type", "json_object");
    json_t *s = json_loads(SCHEMAS[i], 0, NULL);
    return json_pack("{s:s,s:{s:s,s:o}}", "type", "json_schema", "json_schema", "name", "t", "schema", s);
}

static json_t *schema_of(size_t i) {
    return SCHEMAS[i] ? json_loads(SCHEMAS[i], 0, NULL) : json_pack("{s:s}", "type", "object");
}

/* ---- refusals ---- */

static void expect_refused(const char *format, const char *path, const char *keyword) {
    json_t *f = json_loads(format, 0, NULL);
    ds41_schema *s = NULL;
    char ep[256];
    ds41_error err = {{0}};
    int rc = ds41_schema_compile_format(f, "response_format", &s, ep, sizeof ep, &err);
    char quoted[64];
    snprintf(quoted, sizeof quoted, "'%s'", keyword);
    TAP_CHECK(rc != 0 && !s && strcmp(ep, path) == 0 && strstr(err.msg, quoted), "refused at %s (%s)", path,
              err.msg);
    ds41_schema_free(s);
    json_decref(f);
}

static void test_compile(void) {
    ds41_schema *s = NULL;
    char ep[256];
    ds41_error err;
    json_t *f = json_pack("{s:s}", "type", "text");
    TAP_CHECK(ds41_schema_compile_format(f, "response_format", &s, ep, sizeof ep, &err) == 0 && !s,
              "text: nothing to enforce");
    json_decref(f);
    TAP_CHECK(ds41_schema_compile_format(NULL, "response_format", &s, ep, sizeof ep, &err) == 0 && !s,
              "no format: nothing to enforce");
    for (size_t i = 0; i < N_SCHEMAS; i++) {
        f = format_of(i);
        int rc = ds41_schema_compile_format(f, "response_format", &s, ep, sizeof ep, &err);
        TAP_CHECK(rc == 0 && s, "schema %zu compiles (%s)", i, rc ? err.msg : "ok");
        ds41_schema_free(s);
        s = NULL;
        json_decref(f);
    }
    /* the Responses API's text.format shape: the schema at the top */
    f = json_loads(
        "{\"type\":\"json_schema\",\"name\":\"x\",\"schema\":{\"type\":\"object\",\"properties\":{\"a\":"
        "{\"type\":\"string\",\"minLength\":2}}}}",
        0, NULL);
    TAP_CHECK(ds41_schema_compile_format(f, "text.format", &s, ep, sizeof ep, &err) != 0 &&
                  strcmp(ep, "text.format.schema.properties.a.minLength") == 0,
              "text.format shape: refusal at %s", ep);
    json_decref(f);
    expect_refused(
        "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"object\","
        "\"properties\":{\"s\":{\"type\":\"string\",\"pattern\":\"a\"}}}}}",
        "response_format.json_schema.schema.properties.s.pattern", "pattern");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"oneOf\":[{}]}}}",
                   "response_format.json_schema.schema.oneOf", "oneOf");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"array\","
                   "\"items\":{\"type\":\"integer\",\"maximum\":3}}}}",
                   "response_format.json_schema.schema.items.maximum", "maximum");
    expect_refused("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"$defs\":{}}}}",
                   "response_format.json_schema.schema.$defs", "$defs");
    f = json_pack("{s:s}", "type", "yaml");
    TAP_CHECK(ds41_schema_compile_format(f, "response_format", &s, ep, sizeof ep, &err) != 0 &&
                  strcmp(ep, "response_format.type") == 0,
              "an unknown type is refused naming response_format.type (%s)", err.msg);
    json_decref(f);
}

/* ---- the mask against a token-by-token check ---- */

typedef struct fixture {
    ds41_vocab *vocab;
    ds41_tokenizer *tok;
    uint32_t nv;
    ds41_sampler_scratch *scratch;
} fixture;

static int fixture_new(fixture *fx, const char *root, uint32_t nv) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/v%u", root, nv);
    ds41_error err;
    if (mkdir(dir, 0700) != 0 || ds41_synth_tokenizer_write(dir, nv, 1, &err) != 0) return -1;
    fx->vocab = ds41_vocab_load_dir(dir, &err);
    fx->tok = fx->vocab ? ds41_tokenizer_new(fx->vocab, &err) : NULL;
    fx->nv = nv;
    if (!fx->tok || ds41_sampler_scratch_new(&fx->scratch, nv, &err) != 0) return -1;
    return 0;
}

static void fixture_free(fixture *fx) {
    ds41_sampler_scratch_free(fx->scratch);
    ds41_tokenizer_free(fx->tok);
    ds41_vocab_free(fx->vocab);
}

/* Whether token t may follow, checked from the current state on its own. */
static bool brute_ok(ds41_generation *g, uint32_t t, size_t limit) {
    if ((int32_t)t == g->eos_id) return ds41_json_match_complete(&g->js.m);
    if (ds41_tokenizer_is_special(g->tok, t)) return false;
    size_t bl = 0;
    const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, t, &bl);
    if (!b || !bl) return false;
    ds41_json_match m;
    ds41_json_match_copy(&m, &g->js.m);
    for (size_t i = 0; i < bl; i++) {
        if (m.depth == 0 && m.done) return false;
        if (!ds41_json_match_byte(&m, b[i])) return false;
    }
    /* the content may not come to hold the EOS text */
    size_t tl = 0;
    const char *text = ds41_generation_text(g, &tl);
    char tail[128];
    size_t keep = tl < 64 ? tl : 64, n = keep + (bl < 64 ? bl : 64);
    memcpy(tail, text + tl - keep, keep);
    memcpy(tail + keep, b, n - keep);
    if (bl < 64 && memmem(tail, n, DS41_CHAT_EOS, strlen(DS41_CHAT_EOS))) return false;
    if (limit != SIZE_MAX && ds41_json_match_completion(&m, NULL, 0) > limit) return false;
    return true;
}

typedef struct run_stats {
    size_t steps, masked_steps, mismatches, eos_wrong;
    double mask_ns;
} run_stats;

/* One generation on random logits; fills the content (malloc'd) and checks every mask. */
static int run(fixture *fx, size_t schema, uint64_t seed, uint32_t max_tokens, bool thinking,
               uint32_t min_tokens, bool check, char **content, const char **finish, run_stats *st) {
    json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", "JSON please");
    json_t *rf = format_of(schema);
    ds41_generation_params p = ds41_generation_params_default();
    p.messages = msgs;
    p.response_format = rf;
    p.max_tokens = max_tokens;
    p.thinking = thinking;
    p.min_tokens = min_tokens;
    p.sampler.temperature = 1.0f;
    p.sampler.has_seed = true;
    p.sampler.seed = seed;
    static const char think[] = "Hmm.</think>";
    ds41_token_ids forced = {0};
    ds41_error err;
    if (thinking) {
        ds41_tokenizer_encode(fx->tok, think, strlen(think), &forced, &err);
        p.forced_ids = forced.ids;
        p.n_forced = forced.n;
    }
    ds41_generation *g = NULL;
    int rc = ds41_generation_new(fx->tok, &p, fx->nv, &g, &err);
    json_decref(msgs);
    json_decref(rf);
    if (rc != 0) {
        ds41_token_ids_free(&forced);
        TAP_NOTE("generation_new: %s", err.msg);
        return -1;
    }
    float *logits = malloc(fx->nv * sizeof *logits);
    ds41_pcg64 rng;
    ds41_pcg64_set_seed(&rng, seed * 7919 + 1, 54);
    while (!ds41_generation_finished(g)) {
        const int32_t *ids;
        size_t n = ds41_generation_pending(g, &ids);
        if (n) ds41_generation_mark_fed(g, n);
        for (uint32_t t = 0; t < fx->nv; t++)
            logits[t] = (float)((double)ds41_pcg64_next32(&rng) / 4294967296.0 * 8.0 - 4.0);
        if (min_tokens && g->eos_id >= 0) logits[g->eos_id] = 50.0f; /* the model wants to end */
        size_t gen = g->n_tokens - g->n_prompt;
        if (gen >= g->n_forced && g->jf == JF_ON) {
            ds41_json_format_budget(g);
            if (g->cforce_pos >= g->n_cforce) {
                size_t left = ds41_gen_budget_left(g);
                size_t limit = left == SIZE_MAX ? SIZE_MAX : left - 1 - (g->eos_id >= 0);
                struct timespec a, b;
                clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
                const float *m = ds41_json_format_logits(g, logits);
                clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
                st->mask_ns += (double)(b.tv_sec - a.tv_sec) * 1e9 + (double)(b.tv_nsec - a.tv_nsec);
                if (m && m != logits) st->masked_steps++;
                if (check && m && m != logits) {
                    bool done = g->js.m.depth == 0 && g->js.m.done;
                    for (uint32_t t = 0; t < fx->nv; t++) {
                        bool want = done ? (int32_t)t == g->eos_id : brute_ok(g, t, limit);
                        if ((m[t] > -INFINITY) != want) st->mismatches++;
                    }
                    if (g->eos_id >= 0 && (m[g->eos_id] > -INFINITY) != ds41_json_match_complete(&g->js.m))
                        st->eos_wrong++;
                }
            }
        }
        ds41_generation_delta d;
        if (ds41_generation_step(g, logits, fx->scratch, &d, &err) != 0) {
            TAP_NOTE("step: %s", err.msg);
            break;
        }
        st->steps++;
    }
    const ds41_chat_completion *r = ds41_generation_result(g);
    *content = strdup(r && r->content ? r->content : "");
    *finish = ds41_generation_finish_name(g);
    if (thinking && (!r || !r->reasoning_content || strcmp(r->reasoning_content, "Hmm.") != 0)) {
        free(*content);
        *content = strdup("reasoning lost");
    }
    free(logits);
    ds41_generation_free(g);
    ds41_token_ids_free(&forced);
    return 0;
}

static bool validates(size_t schema, const char *content) {
    json_error_t je;
    json_t *v = json_loads(content, JSON_DECODE_ANY, &je);
    json_t *sc = schema_of(schema);
    bool ok = v && valid(sc, v);
    json_decref(v);
    json_decref(sc);
    return ok;
}

static void test_mask(fixture *fx) {
    run_stats st = {0};
    size_t bad_json = 0, bad_finish = 0, runs = 0;
    for (size_t s = 0; s < N_SCHEMAS; s++) {
        for (uint64_t seed = 1; seed <= 8; seed++) {
            char *content = NULL;
            const char *finish = NULL;
            if (run(fx, s, seed * 31 + s, 0, false, 0, true, &content, &finish, &st) != 0) {
                bad_json++;
                continue;
            }
            runs++;
            if (!validates(s, content)) {
                bad_json++;
                TAP_NOTE("schema %zu seed %llu: %s", s, (unsigned long long)seed, content);
            }
            if (strcmp(finish, "stop") != 0) bad_finish++;
            free(content);
        }
    }
    TAP_CHECK(st.masked_steps > 100 && st.mismatches == 0,
              "every mask keeps exactly the tokens that continue the document (%zu masked steps, %zu "
              "mismatches)",
              st.masked_steps, st.mismatches);
    TAP_CHECK(st.eos_wrong == 0, "EOS is allowed exactly when the document is complete");
    TAP_CHECK(runs == 8 * N_SCHEMAS && bad_json == 0 && bad_finish == 0,
              "%zu outputs (no max_tokens) are whole valid documents ending on EOS", runs);
    TAP_NOTE("mask, %u-id vocabulary: %.1f us CPU per step", fx->nv,
             st.mask_ns / 1e3 / (double)st.masked_steps);
}

static void test_budget(fixture *fx) {
    size_t bad = 0, runs = 0;
    run_stats st = {0};
    for (size_t s = 1; s < N_SCHEMAS; s++) {
        for (uint32_t mt = 40; mt <= 70; mt += 15) {
            char *content = NULL;
            const char *finish = NULL;
            if (run(fx, s, 1000 + mt + s, mt, false, 0, true, &content, &finish, &st) != 0) {
                bad++;
                continue;
            }
            runs++;
            if (!validates(s, content) || strcmp(finish, "stop") != 0) {
                bad++;
                TAP_NOTE("schema %zu max_tokens %u: %s (%s)", s, mt, content, finish);
            }
            free(content);
        }
    }
    TAP_CHECK(
        runs && bad == 0 && st.mismatches == 0,
        "a tight max_tokens still ends in a whole valid document (%zu runs; masks checked with the budget)",
        runs);
}

static void test_thinking_and_min_tokens(fixture *fx) {
    run_stats st = {0};
    char *content = NULL;
    const char *finish = NULL;
    bool ok = true;
    for (uint64_t seed = 1; seed <= 4; seed++) {
        ok = ok && run(fx, 1, seed, 0, true, 0, true, &content, &finish, &st) == 0 && validates(1, content) &&
             strcmp(finish, "stop") == 0;
        if (!ok) TAP_NOTE("thinking seed %llu: %s", (unsigned long long)seed, content ? content : "");
        free(content);
        content = NULL;
    }
    TAP_CHECK(ok && st.mismatches == 0, "thinking mode: the reasoning is free, the content after it is held");

    /* min_tokens: the logits want EOS at once; without a constraint it comes at min_tokens */
    json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", "hi");
    size_t gens[2];
    for (int k = 0; k < 2; k++) {
        ds41_generation_params p = ds41_generation_params_default();
        p.messages = msgs;
        p.max_tokens = 50;
        p.min_tokens = k ? 7 : 0;
        p.sampler.temperature = 0.0f;
        ds41_generation *g = NULL;
        ds41_error err;
        float *logits = calloc(fx->nv, sizeof *logits);
        if (ds41_generation_new(fx->tok, &p, fx->nv, &g, &err) != 0) {
            free(logits);
            gens[k] = 0;
            continue;
        }
        logits[g->eos_id] = 10.0f;
        logits[300] = 5.0f;
        while (!ds41_generation_finished(g)) {
            const int32_t *ids;
            ds41_generation_mark_fed(g, ds41_generation_pending(g, &ids));
            if (ds41_generation_step(g, logits, fx->scratch, NULL, &err) != 0) break;
        }
        gens[k] = ds41_generation_completion_tokens(g) * 10 +
                  (ds41_generation_finish_reason(g) == DS41_GENERATION_EOS);
        ds41_generation_free(g);
        free(logits);
    }
    json_decref(msgs);
    TAP_CHECK(gens[0] == 11 && gens[1] == 81,
              "min_tokens 7: EOS after 7 tokens (without: at once) (%zu, %zu)", gens[0], gens[1]);
    /* with a constraint whose document is done, the end wins over min_tokens */
    st = (run_stats){0};
    ok = run(fx, 4, 5, 0, false, 40, false, &content, &finish, &st) == 0 && validates(4, content) &&
         strcmp(finish, "stop") == 0;
    TAP_CHECK(ok, "min_tokens yields to a complete document's end (%s)", content ? content : "");
    free(content);
}

static void bench_big(fixture *fx) {
    run_stats st = {0};
    for (size_t s = 0; s < 3; s++) {
        char *content = NULL;
        const char *finish = NULL;
        if (run(fx, s, 77 + s, 40, false, 0, true, &content, &finish, &st) == 0) free(content);
    }
    TAP_CHECK(st.mismatches == 0 && st.masked_steps > 0,
              "129,280-id vocabulary: every mask matches the token-by-token check (%zu steps)",
              st.masked_steps);
    TAP_NOTE("mask, %u-id vocabulary, max_tokens 40: %.1f us CPU per step (%zu steps)", fx->nv,
             st.mask_ns / 1e3 / (double)st.masked_steps, st.masked_steps);
    /* the cost without the token-by-token check (a budget far away) */
    st = (run_stats){0};
    char *content = NULL;
    const char *finish = NULL;
    if (run(fx, 1, 91, 2000, false, 0, false, &content, &finish, &st) == 0) free(content);
    TAP_NOTE("mask, %u-id vocabulary, max_tokens 2000: %.1f us CPU per step (%zu steps)", fx->nv,
             st.mask_ns / 1e3 / (double)st.masked_steps, st.masked_steps);
}

int main(void) {
    test_compile();
    char root[512];
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-jf-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    fixture small = {0};
    if (TAP_CHECK(fixture_new(&small, root, 1024) == 0, "1,024-id synthetic tokenizer")) {
        test_mask(&small);
        test_budget(&small);
        test_thinking_and_min_tokens(&small);
    }
    fixture_free(&small);
    fixture big = {0};
    if (TAP_CHECK(fixture_new(&big, root, 129280) == 0, "129,280-id synthetic tokenizer")) bench_big(&big);
    fixture_free(&big);
    tmpdir_remove(root);
    return tap_done();
}
