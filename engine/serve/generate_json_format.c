/* Structured output (generate.h "Structured output"): the content is held to a JSON document of
 * the response format's schema by masking, before each step, every token whose bytes cannot
 * continue the document, and by forcing EOS once it is complete. */
#include "engine/serve/generate_internal.h"

#include "config/utf8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Whitespace between tokens and a string's length are bounded so that a model that never ends
 * them (a random-weight one) still reaches the end of the document. */
#define JF_WS_MAX 2
#define JF_STR_MAX 512

void ds41_json_format_free(ds41_generation *g) {
    ds41_schema_free(g->jf_schema);
    g->jf_schema = NULL;
    free(g->jf_stack);
    g->jf_stack = NULL;
    free(g->jf_plain);
    g->jf_plain = NULL;
    g->jf = JF_OFF;
}

static size_t eos_cost(const ds41_generation *g) {
    return g->eos_id >= 0 ? 1 : 0;
}

/* One byte of content through a state: false when no valid document continues with it. */
static bool jstate_byte(const ds41_generation *g, jstate *s, unsigned char c) {
    if (s->m.depth == 0 && s->m.done) return false; /* nothing after the document */
    size_t k = s->guard;
    const unsigned char *e = (const unsigned char *)g->jf_eos;
    if (g->jf_eos_len) {
        while (k > 0 && e[k] != c) k = g->jf_fail[k - 1];
        if (e[k] == c) k++;
        if (k == g->jf_eos_len) return false;
    }
    if (!ds41_json_match_byte(&s->m, c)) return false;
    s->guard = (uint8_t)k;
    return true;
}

static void jstate_copy(jstate *d, const jstate *s) {
    ds41_json_match_copy(&d->m, &s->m);
    d->guard = s->guard;
}

int ds41_json_format_setup(ds41_generation *g, const ds41_generation_params *p, bool prefix,
                           ds41_error *err) {
    if (p->kind != DS41_GENERATION_CHAT || !p->response_format) return 0;
    char epath[256];
    if (ds41_schema_compile_format(p->response_format, "response_format", &g->jf_schema, epath, sizeof epath,
                                   err) != 0)
        return -1;
    /* the tool-choice constraint holds the output to a call; a continued assistant message's
     * content is the client's */
    if (!g->jf_schema || g->cst != CS_OFF || prefix) {
        ds41_json_format_free(g);
        return 0;
    }
    size_t n_order = 0;
    const uint32_t *lcp;
    const uint32_t *order = ds41_tokenizer_byte_order(g->tok, &lcp, &n_order);
    size_t maxlen = 1;
    for (size_t i = 0; i < n_order; i++) {
        size_t bl = 0;
        ds41_tokenizer_token_bytes(g->tok, order[i], &bl);
        if (bl > maxlen) maxlen = bl;
    }
    g->jf_depth_cap = maxlen + 1;
    g->jf_stack = malloc(g->jf_depth_cap * sizeof *g->jf_stack);
    if (!g->jf_stack) return oom(err);
    g->jf_growth = ds41_schema_step_growth(g->jf_schema);
    g->jf_eos = DS41_CHAT_EOS;
    g->jf_eos_len = strlen(DS41_CHAT_EOS);
    if (g->jf_eos_len > sizeof g->jf_fail) g->jf_eos_len = 0;
    for (size_t i = 1, k = 0; i < g->jf_eos_len; i++) {
        while (k > 0 && g->jf_eos[i] != g->jf_eos[k]) k = g->jf_fail[k - 1];
        if (g->jf_eos[i] == g->jf_eos[k]) k++;
        g->jf_fail[i] = (uint8_t)k;
    }
    g->jf_fail[0] = 0;
    g->jf_plain = calloc(g->n_vocab, 1);
    if (!g->jf_plain) return oom(err);
    for (size_t i = 0; i < n_order; i++) {
        size_t bl = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, order[i], &bl);
        bool plain = order[i] < g->n_vocab && ds41_utf8_valid((const char *)b, bl, NULL);
        for (size_t k = 0; plain && k < bl; k++)
            plain = b[k] >= 0x20 && b[k] != '"' && b[k] != '\\' && b[k] != '<';
        if (plain) g->jf_plain[order[i]] = 1;
    }
    for (int c = 0; c < 256; c++) g->jf_byte_tok[c] = UINT32_MAX;
    for (uint32_t t = 0; t < g->n_vocab; t++) {
        size_t bl = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, t, &bl);
        if (b && bl == 1 && g->jf_byte_tok[b[0]] == UINT32_MAX && !ds41_tokenizer_is_special(g->tok, t))
            g->jf_byte_tok[b[0]] = t;
    }
    ds41_json_match_init_value(&g->js.m, g->jf_schema, JF_WS_MAX, JF_STR_MAX);
    g->js.guard = 0;
    g->jf = g->parse_mode == DS41_CHAT_MODE_THINKING ? JF_WAIT_THINK : JF_ON;
    return 0;
}

/* Force the document's shortest completion (one token per byte), then EOS. */
static void force_close(ds41_generation *g) {
    size_t n = ds41_json_match_completion(&g->js.m, NULL, 0);
    uint32_t *f = n != SIZE_MAX ? malloc((n + 1) * sizeof *f) : NULL;
    char *c = f ? malloc(n + 1) : NULL;
    if (!c) {
        free(f);
        g->jf = JF_OFF;
        return;
    }
    ds41_json_match_completion(&g->js.m, c, n);
    for (size_t i = 0; i < n; i++) {
        f[i] = g->jf_byte_tok[(unsigned char)c[i]];
        if (f[i] == UINT32_MAX) { /* a byte this vocabulary cannot write alone */
            free(c);
            free(f);
            g->jf = JF_OFF;
            return;
        }
    }
    free(c);
    if (g->eos_id >= 0) f[n++] = (uint32_t)g->eos_id;
    free(g->cforce);
    g->cforce = f;
    g->n_cforce = n;
    g->cforce_pos = 0;
}

void ds41_json_format_budget(ds41_generation *g) {
    if (g->jf != JF_ON || g->cforce_pos < g->n_cforce) return;
    size_t left = ds41_gen_budget_left(g);
    if (left == SIZE_MAX) return;
    size_t need = ds41_json_match_completion(&g->js.m, NULL, 0);
    if (need != SIZE_MAX && left <= need + eos_cost(g) + 1) force_close(g);
}

/* Every token is tested from the current state by walking the vocabulary in byte order
 * (ds41_tokenizer_byte_order): a prefix shared with the token before is not fed again, and the
 * tokens below a prefix that no document continues are skipped without a byte fed.  A token
 * whose shortest close would not fit the budget is left out (checked only for tokens long enough
 * to come near it: ds41_schema_step_growth bounds what a byte can add). */
const float *ds41_json_format_logits(ds41_generation *g, const float *logits) {
    if (g->jf == JF_OFF) return logits;
    if (g->jf == JF_WAIT_THINK) return ds41_gen_without_eos(g, logits); /* the content must come */
    float *m = ds41_gen_masked(g);
    if (!m) return logits;
    for (uint32_t t = 0; t < g->n_vocab; t++) m[t] = -INFINITY;
    bool complete = ds41_json_match_complete(&g->js.m);
    if (g->js.m.depth == 0 && g->js.m.done) { /* only the end is left */
        if (g->eos_id < 0) {
            g->jf = JF_OFF; /* ignore_eos: the model goes on unconstrained */
            return logits;
        }
        m[g->eos_id] = logits[g->eos_id];
        if (!(logits[g->eos_id] > -INFINITY)) {
            force_close(g);
            return NULL;
        }
        return m;
    }
    bool any = false;
    if (complete && g->eos_id >= 0 && logits[g->eos_id] > -INFINITY) {
        m[g->eos_id] = logits[g->eos_id];
        any = true;
    }
    size_t left = ds41_gen_budget_left(g);
    size_t limit = left == SIZE_MAX ? SIZE_MAX : left - 1 - eos_cost(g); /* the budget: left > 1 + eos */
    size_t now = limit == SIZE_MAX ? 0 : ds41_json_match_completion(&g->js.m, NULL, 0);
    /* a token that stays inside the open string adds at most an escape's or a UTF-8 sequence's
     * rest to the close (most of the vocabulary, while a string is open) */
    bool in_str = ds41_json_match_in_string(&g->js.m);
    size_t slen0 = g->js.m.slen;
    size_t n_order = 0;
    const uint32_t *lcp;
    const uint32_t *order = ds41_tokenizer_byte_order(g->tok, &lcp, &n_order);
    jstate *st = g->jf_stack;
    jstate_copy(&st[0], &g->js);
    size_t alive = 0;    /* st[0..alive] hold the previous token's first bytes */
    bool failed = false; /* the previous token died at its byte `alive` */
    /* inside a string, with no escape or UTF-8 sequence open and nothing of the EOS text before: a
     * plain token (jf_plain) that fits the string's bound continues it and leaves the close as it
     * is, so it needs no byte fed */
    bool fast =
        in_str && !g->js.m.esc && !g->js.m.u8need && g->js.guard == 0 && (limit == SIZE_MAX || now <= limit);
    for (size_t i = 0; i < n_order; i++) {
        uint32_t t = order[i];
        size_t bl = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, t, &bl);
        if (fast && t < g->n_vocab && g->jf_plain[t] && (!g->js.m.str_max || slen0 + bl <= g->js.m.str_max)) {
            if (logits[t] > -INFINITY && (int32_t)t != g->eos_id && (int32_t)t != g->silent_eos_id) {
                m[t] = logits[t];
                any = true;
            }
            alive = 0; /* the stack was not walked for it */
            failed = false;
            continue;
        }
        size_t l = i ? lcp[i] : 0;
        if (failed && l > alive) continue; /* below the dead prefix */
        size_t d = l < alive ? l : alive;
        failed = false;
        size_t j = d;
        for (; j < bl && j + 1 < g->jf_depth_cap; j++) {
            jstate_copy(&st[j + 1], &st[j]);
            if (!jstate_byte(g, &st[j + 1], b[j])) break;
        }
        alive = j;
        if (j < bl) {
            failed = true;
            continue;
        }
        if (!(logits[t] > -INFINITY) || t >= g->n_vocab || (int32_t)t == g->eos_id ||
            (int32_t)t == g->silent_eos_id)
            continue;
        bool same_str = in_str && ds41_json_match_in_string(&st[bl].m) && st[bl].m.slen == slen0 + bl;
        if (limit != SIZE_MAX && (now > limit || limit - now < (same_str ? 5 : bl * g->jf_growth))) {
            size_t need = ds41_json_match_completion(&st[bl].m, NULL, 0);
            if (need == SIZE_MAX || need > limit) continue;
        }
        m[t] = logits[t];
        any = true;
    }
    if (!any) {
        force_close(g); /* nothing fits: the shortest close */
        return NULL;
    }
    return m;
}

void ds41_json_format_token(ds41_generation *g, uint32_t token, bool emitted) {
    if (g->jf == JF_OFF) return;
    if (g->jf == JF_WAIT_THINK) {
        if (g->state == SPLIT_REASONING) return;
        /* the content starts: what follows "</think>" in the text so far is its first bytes */
        const char *t = g->text.data ? g->text.data : "";
        const char *e = memmem(t, g->text.len, DS41_CHAT_THINK_END, strlen(DS41_CHAT_THINK_END));
        g->jf = JF_ON;
        if (!e) return;
        for (const char *c = e + strlen(DS41_CHAT_THINK_END); c < t + g->text.len; c++)
            if (!jstate_byte(g, &g->js, (unsigned char)*c)) {
                g->jf = JF_OFF;
                return;
            }
        return;
    }
    if (!emitted || (int32_t)token == g->silent_eos_id || (int32_t)token == g->eos_id) return;
    size_t bl = 0;
    const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, token, &bl);
    for (size_t i = 0; b && i < bl; i++)
        if (!jstate_byte(g, &g->js, b[i])) {
            g->jf = JF_OFF; /* forced test output left the document */
            return;
        }
}
