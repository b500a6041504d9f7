/* The tool-choice constraint of one generation (generate.h "Tool choice"): driven by the bytes
 * of each token, it masks the logits so that the output holds the required tool calls, each
 * value matching its parameter's schema, and closes the block before the token budget ends. */
#include "engine/serve/generate_internal.h"

#include "engine/text/pyjson.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void ds41_tool_choice_free(ds41_generation *g) {
    for (size_t i = 0; i < g->n_ctools; i++) {
        free(g->ctools[i].name);
        ds41_schema_free(g->ctools[i].schema);
    }
    free(g->ctools);
    g->ctools = NULL;
    g->n_ctools = 0;
}

void ds41_tool_choice_clear(ds41_generation *g) {
    for (size_t i = 0; i < g->n_cands; i++) free(g->cands[i].text);
    g->n_cands = 0;
}

static size_t eos_cost(const ds41_generation *g) {
    return g->eos_id >= 0 ? 1 : 0;
}

/* A parameter's shortest value is written raw (string="true") when that is allowed and no longer. */
static bool min_raw(const ds41_schema *s, size_t k) {
    if (!ds41_schema_param_raw_ok(s, k)) return false;
    if (!ds41_schema_param_json_ok(s, k)) return true;
    return ds41_schema_param_min(s, k, true, NULL, 0) <= ds41_schema_param_min(s, k, false, NULL, 0);
}

static void put_min(ds41_buf *out, const ds41_schema *s, size_t k, bool raw) {
    char small[256];
    size_t n = ds41_schema_param_min(s, k, raw, small, sizeof small);
    if (n <= sizeof small) {
        ds41_buf_put(out, small, n);
        return;
    }
    char *big = malloc(n);
    if (!big) {
        out->oom = true;
        return;
    }
    ds41_schema_param_min(s, k, raw, big, n);
    ds41_buf_put(out, big, n);
    free(big);
}

/* The bytes (and, with out, the text) that close the open invoke of tool ti and the block: each
 * required parameter not in used[] (NULL: none used) with its shortest value, then the invoke's
 * and the block's ends.  after_param: the invoke's last line was a parameter (the next line
 * starts with "\n"). */
static size_t close_invoke(const ds41_generation *g, size_t ti, const bool *used, bool after_param,
                           ds41_buf *out) {
    const ds41_schema *s = g->ctools[ti].schema;
    size_t n = 0;
    bool lead = after_param;
    for (size_t k = 0; k < ds41_schema_n_params(s); k++) {
        if (!ds41_schema_param_required(s, k) || (used && used[k])) continue;
        bool raw = min_raw(s, k);
        const char *name = ds41_schema_param_name(s, k);
        n += (lead ? 1 : 0) + strlen(DSML_PARAM_START " name=\"") + strlen(name) +
             strlen(raw ? "\" string=\"true\">" : "\" string=\"false\">") +
             ds41_schema_param_min(s, k, raw, NULL, 0) + strlen(VALUE_END);
        if (out) {
            if (lead) ds41_buf_putc(out, '\n');
            ds41_buf_puts(out, DSML_PARAM_START " name=\"");
            ds41_buf_puts(out, name);
            ds41_buf_puts(out, raw ? "\" string=\"true\">" : "\" string=\"false\">");
            put_min(out, s, k, raw);
            ds41_buf_puts(out, VALUE_END);
        }
        lead = true;
    }
    static const char tail[] = DSML_INVOKE_END ">\n" DSML_CALLS_END;
    n += (lead ? 1 : 0) + strlen(tail);
    if (out) {
        if (lead) ds41_buf_putc(out, '\n');
        ds41_buf_puts(out, tail);
    }
    return n;
}

/* The open value: the matcher of its text (the "content" branch) and, once the text so far is a
 * whole value followed by '<', how much of "</｜DSML｜ parameter>" follows (the "end" branch; a
 * raw string may go on with a '<' of its own, so both can be alive).  guard: how much of the DSML
 * marker the text ends with (a value may not contain it: the parser would end the value there). */
#define MARK "｜DSML｜"
static void vstate_copy(vstate *d, const vstate *s) {
    ds41_json_match_copy(&d->m, &s->m);
    d->content = s->content;
    d->end = s->end;
    d->guard = s->guard;
}

/* -1: dead, 0: alive, 1: the value and its end are complete. */
static int vstate_byte(vstate *v, unsigned char c) {
    static const char end[] = VALUE_END, mark[] = MARK;
    const size_t el = sizeof end - 1, ml = sizeof mark - 1;
    uint8_t e = 0;
    if (v->end)
        e = (unsigned char)end[v->end] == c ? (uint8_t)(v->end + 1) : 0;
    else if (c == '<' && v->content && ds41_json_match_complete(&v->m))
        e = 1;
    bool content = false;
    if (v->content) {
        /* the longest suffix of text + c that begins the marker (KMP; the marker's only borders
         * are the first bytes of its "｜") */
        static const uint8_t border[] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 2};
        size_t gl = v->guard;
        while (gl > 0 && (unsigned char)mark[gl] != c) gl = border[gl];
        if ((unsigned char)mark[gl] == c) gl++;
        if (gl < ml && ds41_json_match_byte(&v->m, c)) {
            content = true;
            v->guard = (uint8_t)gl;
        }
    }
    v->content = content;
    v->end = e;
    if (e == el) return 1;
    return content || e ? 0 : -1;
}

/* Bytes that end the open value and the block from v (SIZE_MAX: none). */
static size_t vstate_close(const ds41_generation *g, const vstate *v) {
    size_t n;
    if (v->end)
        n = strlen(VALUE_END) - v->end;
    else if (v->content)
        n = ds41_json_match_completion(&v->m, NULL, 0) + strlen(VALUE_END);
    else
        return SIZE_MAX;
    return n == SIZE_MAX ? n : n + g->vrest;
}

static bool cand_add(ds41_generation *g, size_t cap, const char *a, const char *b, const char *c, int next,
                     int arg, size_t cost) {
    if (g->n_cands >= cap) return false;
    ds41_buf t = {0};
    ds41_buf_puts(&t, a);
    ds41_buf_puts(&t, b);
    ds41_buf_puts(&t, c);
    if (t.oom) {
        ds41_buf_free(&t);
        return false;
    }
    size_t len;
    char *text = ds41_buf_take(&t, &len);
    if (!text) return false;
    g->cands[g->n_cands++] =
        (cand){.text = text, .len = len, .next = next, .arg = arg, .cost = cost, .fit = true};
    return true;
}

static bool all_required_used(const ds41_generation *g) {
    const ds41_schema *s = g->ctools[g->ctool_cur].schema;
    for (size_t k = 0; k < ds41_schema_n_params(s); k++)
        if (ds41_schema_param_required(s, k) && !g->prop_used[k]) return false;
    return true;
}

/* The bytes after a new invoke's name line: the cheapest close of any tool (LIT_NAME cands carry
 * their own). */
static size_t max_invoke_cost(const ds41_generation *g) {
    size_t m = 0;
    for (size_t i = 0; i < g->n_ctools; i++) {
        size_t l = strlen(g->ctools[i].name) + 3 + close_invoke(g, i, NULL, false, NULL);
        if (l > m) m = l;
    }
    return m;
}

/* Enter a literal state: the candidates that may follow, each with the bytes that would close
 * the block after it (its cost). */
static void constraint_literal(ds41_generation *g, lit_kind kind) {
    ds41_tool_choice_clear(g);
    g->cur.len = 0;
    g->lit = kind;
    g->cst = CS_LITERAL;
    size_t cap = 2;
    if (kind == LIT_NAME) cap = g->n_ctools;
    if (kind == LIT_AFTER_HEAD || kind == LIT_AFTER_PARAM)
        cap = 1 + 2 * (g->ctool_cur >= 0 ? ds41_schema_n_params(g->ctools[g->ctool_cur].schema) : 0);
    free(g->cands);
    g->cands = calloc(cap ? cap : 1, sizeof *g->cands);
    bool ok = g->cands != NULL;
    switch (kind) {
    case LIT_START:
        ok = ok && cand_add(g, cap, "\n\n<" DS41_CHAT_DSML " calls>\n", DSML_INVOKE_START, " name=\"",
                            100 + LIT_NAME, 0, max_invoke_cost(g));
        break;
    case LIT_NAME:
        for (size_t i = 0; ok && i < g->n_ctools; i++)
            ok = cand_add(g, cap, g->ctools[i].name, "\">\n", "", 100 + LIT_AFTER_HEAD, (int)i,
                          close_invoke(g, i, NULL, false, NULL));
        break;
    case LIT_AFTER_HEAD:
    case LIT_AFTER_PARAM: {
        const char *lead = kind == LIT_AFTER_PARAM ? "\n" : "";
        const ds41_schema *s = g->ctools[g->ctool_cur].schema;
        for (size_t k = 0; ok && k < ds41_schema_n_params(s); k++) {
            if (g->prop_used[k]) continue;
            ds41_buf pre = {0};
            ds41_buf_puts(&pre, lead);
            ds41_buf_puts(&pre, DSML_PARAM_START " name=\"");
            ds41_buf_puts(&pre, ds41_schema_param_name(s, k));
            ds41_buf_putc(&pre, 0);
            if (pre.oom) ok = false;
            g->prop_used[k] = true;
            size_t rest = strlen(VALUE_END) + close_invoke(g, (size_t)g->ctool_cur, g->prop_used, true, NULL);
            g->prop_used[k] = false;
            if (ok && ds41_schema_param_raw_ok(s, k))
                ok = cand_add(g, cap, pre.data, "\" string=\"true\">", "", CS_VALUE, (int)(2 * k + 1),
                              rest + ds41_schema_param_min(s, k, true, NULL, 0));
            if (ok && ds41_schema_param_json_ok(s, k))
                ok = cand_add(g, cap, pre.data, "\" string=\"false\">", "", CS_VALUE, (int)(2 * k),
                              rest + ds41_schema_param_min(s, k, false, NULL, 0));
            ds41_buf_free(&pre);
        }
        /* the invoke closes only once every required parameter is there */
        if (ok && all_required_used(g))
            ok = cand_add(g, cap, lead, DSML_INVOKE_END ">\n", "", 100 + LIT_AFTER_INVOKE, 0,
                          strlen(DSML_CALLS_END));
        break;
    }
    case LIT_AFTER_INVOKE:
        ok = ok && cand_add(g, cap, DSML_CALLS_END, "", "", CS_EOS_ONLY, 0, 0);
        if (g->parallel_tool_calls)
            ok = ok &&
                 cand_add(g, cap, DSML_INVOKE_START, " name=\"", "", 100 + LIT_NAME, 0, max_invoke_cost(g));
        break;
    }
    if (!ok) {
        g->cst = CS_OFF; /* out of memory: the model goes free rather than the request failing */
        return;
    }
    if (g->n_cands == 1 && g->cforce_pos >= g->n_cforce) {
        /* No choice: its canonical tokens (the model's own tokenization, and the fewest). */
        ds41_token_ids ids = {0};
        ds41_error e;
        bool fits = ds41_tokenizer_encode(g->tok, g->cands[0].text, g->cands[0].len, &ids, &e) == 0 && ids.n > 0;
        for (size_t i = 0; fits && i < ids.n; i++) fits = ids.ids[i] < g->n_vocab;
        uint32_t *f = fits ? malloc(ids.n * sizeof *f) : NULL;
        if (f) {
            memcpy(f, ids.ids, ids.n * sizeof *f);
            free(g->cforce);
            g->cforce = f;
            g->n_cforce = ids.n;
            g->cforce_pos = 0;
        }
        ds41_token_ids_free(&ids);
    }
}

static void constraint_value(ds41_generation *g, int arg) {
    size_t k = (size_t)arg / 2;
    g->prop_used[k] = true;
    ds41_json_match_init(&g->vs.m, g->ctools[g->ctool_cur].schema, k, arg & 1);
    g->vs.content = true;
    g->vs.end = 0;
    g->vs.guard = 0;
    g->vrest = close_invoke(g, (size_t)g->ctool_cur, g->prop_used, true, NULL);
    g->cst = CS_VALUE;
}

/* One generated byte through the constraint. */
void ds41_tool_choice_byte(ds41_generation *g, char c) {
    switch (g->cst) {
    case CS_OFF: return;
    case CS_WAIT_THINK: {
        const char *end = DS41_CHAT_THINK_END;
        size_t el = strlen(end);
        ds41_buf_putc(&g->tail, c);
        if (g->tail.len > el) {
            memmove(g->tail.data, g->tail.data + g->tail.len - el, el);
            g->tail.len = el;
        }
        if (g->tail.len == el && memcmp(g->tail.data, end, el) == 0) {
            g->tail.len = 0;
            constraint_literal(g, LIT_START);
        }
        return;
    }
    case CS_VALUE: {
        int r = vstate_byte(&g->vs, (unsigned char)c);
        if (r < 0)
            g->cst = CS_OFF; /* forced output left the grammar */
        else if (r > 0)
            constraint_literal(g, LIT_AFTER_PARAM);
        return;
    }
    case CS_LITERAL: {
        ds41_buf_putc(&g->cur, c);
        if (g->cur.oom) {
            g->cst = CS_OFF;
            return;
        }
        bool alive = false;
        for (size_t i = 0; i < g->n_cands; i++) {
            const cand *k = &g->cands[i];
            if (k->len < g->cur.len || memcmp(k->text, g->cur.data, g->cur.len) != 0) continue;
            alive = true;
            if (k->len != g->cur.len) continue;
            int next = k->next, arg = k->arg;
            if (next == CS_VALUE) {
                constraint_value(g, arg);
            } else if (next == CS_EOS_ONLY) {
                g->cst = g->eos_id >= 0 ? CS_EOS_ONLY : CS_OFF;
            } else {
                lit_kind lk = (lit_kind)(next - 100);
                if (lk == LIT_AFTER_HEAD) {
                    g->ctool_cur = arg;
                    free(g->prop_used);
                    g->prop_used =
                        calloc(ds41_schema_n_params(g->ctools[arg].schema) + 1, sizeof *g->prop_used);
                    g->n_invokes++;
                    if (!g->prop_used) {
                        g->cst = CS_OFF;
                        return;
                    }
                }
                constraint_literal(g, lk);
            }
            return;
        }
        if (!alive) g->cst = CS_OFF; /* forced output left the grammar */
        return;
    }
    case CS_EOS_ONLY: g->cst = CS_OFF; return;
    }
}

/* Force text (then EOS): its canonical tokens when their bytes are exactly text, else one token
 * per byte (text that begins inside a UTF-8 sequence does not tokenize to itself). */
static bool force_text(ds41_generation *g, const char *text, size_t len) {
    ds41_token_ids ids = {0};
    ds41_error e;
    bool exact = ds41_tokenizer_encode(g->tok, text, len, &ids, &e) == 0;
    size_t pos = 0;
    for (size_t i = 0; exact && i < ids.n; i++) {
        size_t bl = 0;
        const uint8_t *b =
            ids.ids[i] < g->n_vocab ? ds41_tokenizer_token_bytes(g->tok, ids.ids[i], &bl) : NULL;
        exact = b && bl && pos + bl <= len && memcmp(text + pos, b, bl) == 0;
        pos += bl;
    }
    exact = exact && pos == len;
    size_t n = exact ? ids.n : len;
    for (size_t i = 0; !exact && i < len; i++)
        if (g->byte_tok[(unsigned char)text[i]] == UINT32_MAX) {
            ds41_token_ids_free(&ids);
            return false;
        }
    uint32_t *f = malloc((n + 1) * sizeof *f);
    if (!f) {
        ds41_token_ids_free(&ids);
        return false;
    }
    for (size_t i = 0; i < n; i++) f[i] = exact ? ids.ids[i] : g->byte_tok[(unsigned char)text[i]];
    ds41_token_ids_free(&ids);
    if (g->eos_id >= 0) f[n++] = (uint32_t)g->eos_id;
    free(g->cforce);
    g->cforce = f;
    g->n_cforce = n;
    g->cforce_pos = 0;
    return true;
}

/* Close the block from here: the open value's shortest completion, the required parameters not
 * written yet, the invoke's and the block's ends, then EOS. */
static void force_close(ds41_generation *g) {
    ds41_buf t = {0};
    if (g->cst == CS_VALUE) {
        if (g->vs.end) {
            ds41_buf_puts(&t, &VALUE_END[g->vs.end]);
        } else {
            size_t n = ds41_json_match_completion(&g->vs.m, NULL, 0);
            char *c = n != SIZE_MAX ? malloc(n + 1) : NULL;
            if (!c) {
                g->cst = CS_OFF;
                return;
            }
            ds41_json_match_completion(&g->vs.m, c, n);
            ds41_buf_put(&t, c, n);
            free(c);
            ds41_buf_puts(&t, VALUE_END);
        }
        close_invoke(g, (size_t)g->ctool_cur, g->prop_used, true, &t);
    } else if (g->lit == LIT_AFTER_INVOKE) {
        ds41_buf_puts(&t, DSML_CALLS_END);
    } else {
        close_invoke(g, (size_t)g->ctool_cur, g->prop_used, g->lit == LIT_AFTER_PARAM, &t);
    }
    if (t.oom || !force_text(g, t.data ? t.data : "", t.len)) g->cst = CS_OFF;
    ds41_buf_free(&t);
}

/* Before each step: when the token budget (max_tokens, the context) would no longer hold the
 * cheapest close from here (one token per byte at worst) plus EOS and one more token, force the
 * close; otherwise mark the literal candidates whose own close would not fit (the mask leaves
 * them out).  A value's tokens are checked one by one in constraint_logits. */
void ds41_tool_choice_budget(ds41_generation *g) {
    if (g->cforce_pos < g->n_cforce) return;
    size_t left = ds41_gen_budget_left(g);
    if (left == SIZE_MAX) return;
    if (g->cst == CS_VALUE) {
        size_t need = vstate_close(g, &g->vs);
        if (need != SIZE_MAX && left <= need + eos_cost(g) + 1) force_close(g);
        return;
    }
    if (g->cst != CS_LITERAL) return;
    bool close_point = g->cur.len == 0 && g->ctool_cur >= 0 &&
                       (g->lit == LIT_AFTER_HEAD || g->lit == LIT_AFTER_PARAM || g->lit == LIT_AFTER_INVOKE);
    size_t any_fit = 0;
    for (size_t i = 0; i < g->n_cands; i++) {
        cand *k = &g->cands[i];
        size_t rest = k->len >= g->cur.len ? k->len - g->cur.len : 0;
        k->fit = rest + k->cost + eos_cost(g) + 1 <= left;
        if (k->fit && k->len >= g->cur.len && memcmp(k->text, g->cur.data, g->cur.len) == 0) any_fit++;
    }
    if (close_point) {
        size_t need = g->lit == LIT_AFTER_INVOKE ? strlen(DSML_CALLS_END)
                                                 : close_invoke(g, (size_t)g->ctool_cur, g->prop_used,
                                                                g->lit == LIT_AFTER_PARAM, NULL);
        if (!any_fit || left <= need + eos_cost(g) + 1) force_close(g);
    } else if (!any_fit) {
        for (size_t i = 0; i < g->n_cands; i++) g->cands[i].fit = true; /* cut off whatever it does */
    }
}

/* The logits the sampler sees under the constraint (or logits itself when it does not apply).
 * Every token is checked against the grammar with its bytes (a token may not run past the end
 * of the literal or value it is in); in a value, a token whose close would not fit the budget is
 * left out too.  Cost per step: O(vocabulary x token length), with the tokens whose first byte
 * cannot follow skipped at once. */
const float *ds41_tool_choice_logits(ds41_generation *g, const float *logits) {
    if (g->cst == CS_OFF) return logits;
    float *m = ds41_gen_masked(g);
    if (!m) return logits;
    if (g->cst == CS_LITERAL) {
        bool any = false;
        for (uint32_t t = 0; t < g->n_vocab; t++) {
            size_t bl = 0;
            const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, t, &bl);
            bool ok = false;
            for (size_t i = 0; b && bl && !ok && i < g->n_cands; i++) {
                const cand *k = &g->cands[i];
                ok = k->fit && g->cur.len + bl <= k->len && memcmp(k->text, g->cur.data, g->cur.len) == 0 &&
                     memcmp(k->text + g->cur.len, b, bl) == 0;
            }
            m[t] = ok ? logits[t] : -INFINITY;
            if (ok && logits[t] > -INFINITY) any = true;
        }
        if (!any) {
            g->cst = CS_OFF; /* no token of this vocabulary continues the grammar */
            return logits;
        }
        return m;
    }
    if (g->cst == CS_VALUE) {
        size_t left = ds41_gen_budget_left(g);
        size_t limit =
            left == SIZE_MAX ? SIZE_MAX : left - 1 - eos_cost(g); /* constraint_budget: left > 1 + eos */
        bool first[256];
        for (int c = 0; c < 256; c++) {
            vstate v;
            vstate_copy(&v, &g->vs);
            first[c] = vstate_byte(&v, (unsigned char)c) >= 0;
        }
        bool any = false;
        for (uint32_t t = 0; t < g->n_vocab; t++) {
            m[t] = -INFINITY;
            if (!(logits[t] > -INFINITY) || (int32_t)t == g->eos_id || (int32_t)t == g->silent_eos_id)
                continue;
            size_t bl = 0;
            const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, t, &bl);
            if (!b || !bl || !first[b[0]]) continue;
            vstate v;
            vstate_copy(&v, &g->vs);
            int r = 0;
            for (size_t i = 0; i < bl && r == 0; i++) {
                r = vstate_byte(&v, b[i]);
                if (r > 0 && i + 1 < bl) r = -1; /* runs past the value's end */
            }
            if (r < 0) continue;
            if (limit != SIZE_MAX) {
                size_t need = r > 0 ? g->vrest : vstate_close(g, &v);
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
    if (g->cst == CS_EOS_ONLY) {
        if (g->eos_id < 0 || !(logits[g->eos_id] > -INFINITY)) return logits;
        for (uint32_t t = 0; t < g->n_vocab; t++) m[t] = -INFINITY;
        m[g->eos_id] = logits[g->eos_id];
        return m;
    }
    return ds41_gen_without_eos(g, logits); /* WAIT_THINK */
}

/* The tools the constraint may call, from the request's tools array (their parameters schemas
 * compiled: a schema outside the supported subset is refused here, as the API refuses it). */
int ds41_tool_choice_setup(ds41_generation *g, const ds41_generation_params *p, ds41_error *err) {
    const char *what = p->tool_choice == DS41_GENERATION_TOOL_CHOICE_NAMED ? "tool_choice" : "tool_choice 'required'";
    size_t n = json_is_array(p->tools) ? json_array_size(p->tools) : 0;
    if (n == 0) return ds41_fail(err, "%s: no tools", what);
    if (p->tool_choice == DS41_GENERATION_TOOL_CHOICE_NAMED && !p->tool_choice_name)
        return ds41_fail(err, "tool_choice: no function name");
    g->ctools = calloc(n, sizeof *g->ctools);
    if (!g->ctools) return oom(err);
    for (size_t i = 0; i < n; i++) {
        const json_t *fn = json_object_get(json_array_get(p->tools, i), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!name || !*name || strchr(name, '"')) continue;
        if (p->tool_choice == DS41_GENERATION_TOOL_CHOICE_NAMED && strcmp(name, p->tool_choice_name) != 0) continue;
        ctool *ct = &g->ctools[g->n_ctools++];
        ct->name = strdup(name);
        if (!ct->name) return oom(err);
        char path[64];
        snprintf(path, sizeof path, "tools[%zu].function.parameters", i);
        if (ds41_schema_compile(json_object_get(fn, "parameters"), path, &ct->schema, NULL, 0, err) != 0)
            return -1;
    }
    if (g->n_ctools == 0)
        return p->tool_choice == DS41_GENERATION_TOOL_CHOICE_NAMED
                   ? ds41_fail(err, "tool_choice: function '%s' is not among the tools", p->tool_choice_name)
                   : ds41_fail(err, "%s: no usable tools", what);
    /* single-byte tokens, for forcing bytes that do not tokenize to themselves */
    for (int c = 0; c < 256; c++) g->byte_tok[c] = UINT32_MAX;
    for (uint32_t t = 0; t < g->n_vocab; t++) {
        size_t bl = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, t, &bl);
        if (b && bl == 1 && g->byte_tok[b[0]] == UINT32_MAX && (int32_t)t != g->eos_id) g->byte_tok[b[0]] = t;
    }
    g->ctool_cur = -1;
    if (g->parse_mode == DS41_CHAT_MODE_THINKING) g->cst = CS_WAIT_THINK;
    else constraint_literal(g, LIT_START);
    return 0;
}
