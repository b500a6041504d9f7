/* One request's generation as a state machine (see generate.h). */
#include "engine/serve/generate.h"
#include "engine/serve/generate_internal.h"

#include "engine/text/json_schema.h"
#include "engine/text/pyjson.h"
#include "engine/serve/stop.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

ds41_generation_params ds41_generation_params_default(void) {
    ds41_generation_params p;
    memset(&p, 0, sizeof p);
    p.kind = DS41_GENERATION_CHAT;
    p.parse_tool_calls = true;
    p.parallel_tool_calls = true;
    p.sampler = ds41_sampler_params_default();
    return p;
}

/* ---- special tokens out of the returned text (skip_special) -------------------------------------- */

/* The decoded text of every added token of the vocabulary (V4.1 marks only a few "special", but
 * every added token is a control token: <｜Assistant｜>, <think>, <｜safety｜>...), except the
 * DSML marker: a tool-call block that stays content (tool_choice none, or a block that does not
 * parse) is markup the client may read, and without its markers it would be "< calls>..." garbage. */
static int specials_init(ds41_generation *g) {
    const ds41_vocab *v = ds41_tokenizer_vocab(g->tok);
    size_t n = ds41_vocab_n_added(v);
    g->specials = calloc(n ? n : 1, sizeof *g->specials);
    if (!g->specials) return -1;
    for (size_t i = 0; i < n; i++) {
        size_t len = 0;
        const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, ds41_vocab_added_at(v, i)->id, &len);
        if (!b || !len) continue;
        if (len == strlen(DS41_CHAT_DSML) && memcmp(b, DS41_CHAT_DSML, len) == 0) continue;
        g->specials[g->n_specials++] = (special_text){(const char *)b, len};
        g->special_first[b[0] >> 3] |= (uint8_t)(1u << (b[0] & 7));
    }
    return 0;
}

/* Append t[*pos..len) to OUT without the special tokens' text and advance *pos.  At each byte the
 * longest special text that matches is dropped; unless FINAL, a tail that may still grow into
 * one is held back (*pos stops there), so stripping piece by piece gives exactly what stripping
 * the whole text does, and a special token cut between two steps never shows in part. */
static void strip_specials(const ds41_generation *g, const char *t, size_t len, size_t *pos, ds41_buf *out,
                           bool final) {
    if (!t) return;
    size_t i = *pos, run = i;
    while (i < len) {
        const uint8_t c = (uint8_t)t[i];
        if (!(g->special_first[c >> 3] & (1u << (c & 7)))) {
            i++;
            continue;
        }
        size_t best = 0;
        bool maybe = false;
        for (size_t k = 0; k < g->n_specials; k++) {
            const special_text *sp = &g->specials[k];
            if ((uint8_t)sp->s[0] != c) continue;
            if (sp->len <= len - i) {
                if (sp->len > best && memcmp(t + i, sp->s, sp->len) == 0) best = sp->len;
            } else if (!final && memcmp(t + i, sp->s, len - i) == 0) {
                maybe = true;
            }
        }
        if (maybe) break;
        if (best) {
            ds41_buf_put(out, t + run, i - run);
            i += best;
            run = i;
        } else {
            i++;
        }
    }
    ds41_buf_put(out, t + run, i - run);
    *pos = i;
}

/* A malloc'd string (*s, *len) without the special tokens' text (in place: it only shrinks). */
static int strip_string(const ds41_generation *g, char *s, size_t *len) {
    ds41_buf b = {0};
    size_t pos = 0;
    strip_specials(g, s, *len, &pos, &b, true);
    if (b.oom) {
        ds41_buf_free(&b);
        return -1;
    }
    if (b.len) memcpy(s, b.data, b.len);
    s[b.len] = 0;
    *len = b.len;
    ds41_buf_free(&b);
    return 0;
}

static int push_token(ds41_generation *g, int32_t id) {
    if (g->n_tokens == g->cap_tokens) {
        size_t nc = g->cap_tokens ? g->cap_tokens * 2 : 256;
        int32_t *nt = realloc(g->tokens, nc * sizeof *nt);
        if (!nt) return -1;
        g->tokens = nt;
        g->cap_tokens = nc;
    }
    g->tokens[g->n_tokens++] = id;
    return 0;
}

/* ---- prompt ------------------------------------------------------------------------------ */

/* The request's messages as the encoder takes them: "developer" is "system", and a last
 * assistant message with "prefix": true is rendered without its EOS (continued).  Returns a new
 * array; *prefix tells whether the last message is continued. */
static json_t *prepare_messages(const json_t *messages, bool *prefix, ds41_error *err) {
    *prefix = false;
    if (!json_is_array(messages)) {
        ds41_fail(err, "messages: expected an array");
        return NULL;
    }
    json_t *list = json_deep_copy(messages);
    if (!list) {
        oom(err);
        return NULL;
    }
    size_t n = json_array_size(list);
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(list, i);
        if (!json_is_object(msg)) continue; /* the encoder names it */
        const char *role = json_string_value(json_object_get(msg, "role"));
        if (role && strcmp(role, "developer") == 0 && json_object_set_new(msg, "role", json_string("system")) != 0)
            goto fail;
        json_t *pf = json_object_get(msg, "prefix");
        if (pf) {
            bool continued = json_is_true(pf) && i + 1 == n && role && strcmp(role, "assistant") == 0;
            if (json_object_del(msg, "prefix") != 0) goto fail;
            if (continued) {
                if (json_object_set_new(msg, "wo_eos", json_true()) != 0) goto fail;
                *prefix = true;
            }
        }
    }
    return list;
fail:
    json_decref(list);
    oom(err);
    return NULL;
}

static int render_chat(ds41_generation *g, const ds41_generation_params *p, bool *prefix, ds41_error *err) {
    json_t *messages = prepare_messages(p->messages, prefix, err);
    if (!messages) return -1;
    ds41_chat_request req = ds41_chat_request_default();
    req.messages = messages;
    req.tools = p->tools;
    req.response_format = p->response_format;
    req.mode = p->thinking ? DS41_CHAT_MODE_THINKING : DS41_CHAT_MODE_CHAT;
    json_t *effort = NULL;
    if (p->reasoning_effort != 0) {
        effort = json_integer(p->reasoning_effort);
        if (!effort) {
            json_decref(messages);
            return oom(err);
        }
        req.reasoning_effort = effort;
    }
    ds41_chat_prompt prompt;
    int rc = ds41_chat_render(&req, &prompt, err);
    json_decref(messages);
    json_decref(effort);
    if (rc != 0) return -1;
    if (json_array_size(prompt.images) > 0) {
        ds41_chat_prompt_free(&prompt);
        return ds41_fail(err, "messages: image content is not supported by this model");
    }
    g->prompt_text = prompt.text;
    g->prompt_text_len = prompt.len;
    prompt.text = NULL;
    ds41_chat_prompt_free(&prompt);
    return 0;
}

static int tokenize_prompt(ds41_generation *g, const char *text, size_t len, ds41_error *err) {
    ds41_token_ids ids = {0};
    if (ds41_tokenizer_encode(g->tok, text, len, &ids, err) != 0) {
        ds41_token_ids_free(&ids);
        return ds41_error_prefix(err, "prompt");
    }
    for (size_t i = 0; i < ids.n; i++) {
        if (ids.ids[i] >= g->n_vocab) {
            uint32_t bad = ids.ids[i];
            ds41_token_ids_free(&ids);
            return ds41_fail(err, "prompt: token %u is outside the model's vocabulary (%u)", bad, g->n_vocab);
        }
        if (push_token(g, (int32_t)ids.ids[i]) != 0) {
            ds41_token_ids_free(&ids);
            return oom(err);
        }
    }
    ds41_token_ids_free(&ids);
    return 0;
}

/* ---- tool-call streaming ---------------------------------------------------------------------- */

static bool has_prefix(const char *s, size_t n, const char *lit) {
    size_t l = strlen(lit);
    return n >= l && memcmp(s, lit, l) == 0;
}

/* s[0..n) is a proper prefix of lit (may still become it). */
static bool may_become(const char *s, size_t n, const char *lit) {
    size_t l = strlen(lit);
    return n < l && memcmp(s, lit, n) == 0;
}

static void frag_push(ds41_generation *g, size_t index, const char *name, size_t name_len, const char *args,
                      size_t args_len) {
    if (index >= g->n_calls) return;
    if (!name && !args_len) return;
    if (!name) ds41_buf_put(&g->calls[index].args, args, args_len);
    if (!g->calls[index].released) return; /* held until the call is complete */
    /* the step's last fragment grows when it holds the same call's arguments (a first fragment
     * keeps its empty arguments) */
    if (!name && g->n_frags && g->frags[g->n_frags - 1].index == index && !g->frags[g->n_frags - 1].has_name &&
        g->frags[g->n_frags - 1].args_off + g->frags[g->n_frags - 1].args_len == g->frag_text.len) {
        ds41_buf_put(&g->frag_text, args, args_len);
        g->frags[g->n_frags - 1].args_len += args_len;
        return;
    }
    if (g->n_frags == g->cap_frags) {
        size_t nc = g->cap_frags ? g->cap_frags * 2 : 8;
        frag *nf = realloc(g->frags, nc * sizeof *nf);
        if (!nf) {
            g->frag_oom = true;
            return;
        }
        g->frags = nf;
        g->cap_frags = nc;
    }
    frag *f = &g->frags[g->n_frags++];
    f->index = index;
    f->has_name = name != NULL;
    f->name_off = g->frag_text.len;
    f->name_len = name ? name_len : 0;
    if (name) {
        ds41_buf_put(&g->frag_text, name, name_len);
        ds41_buf_putc(&g->frag_text, 0); /* names are NUL-terminated (ds41_gen_event takes C strings) */
    }
    f->args_off = g->frag_text.len;
    f->args_len = args_len;
    ds41_buf_put(&g->frag_text, args, args_len);
}

static void frag_args(ds41_generation *g, const char *s, size_t n) {
    if (g->n_calls) frag_push(g, g->n_calls - 1, NULL, 0, s, n);
}

/* A new call named name[0..n) ("ns::name" streams its bare name, as the parser splits it). */
static void call_start(ds41_generation *g, const char *name, size_t n) {
    const char *sep = memmem(name, n, "::", 2);
    if (sep) {
        n -= (size_t)(sep - name) + 2;
        name = sep + 2;
    }
    if (g->n_calls == g->cap_calls) {
        size_t nc = g->cap_calls ? g->cap_calls * 2 : 4;
        stream_call *ncs = realloc(g->calls, nc * sizeof *ncs);
        if (!ncs) {
            g->frag_oom = true;
            return;
        }
        g->calls = ncs;
        g->cap_calls = nc;
    }
    stream_call *c = &g->calls[g->n_calls];
    memset(c, 0, sizeof *c);
    c->name = malloc(n + 1);
    if (!c->name) {
        g->frag_oom = true;
        return;
    }
    if (n) memcpy(c->name, name, n);
    c->name[n] = 0;
    c->name_len = n;
    g->n_calls++;
}

/* The arguments text is one JSON value (jansson, as a client would parse it). */
static bool json_text_ok(const char *s, size_t n) {
    json_t *v = json_loadb(s ? s : "", n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    json_decref(v);
    return v != NULL;
}

/* The last call's invoke closed: its fragments (name, then the arguments so far) go out when its
 * arguments are valid JSON and every call before it went out, so a stream cut off later never
 * holds a call the final message lacks (finalize salvages exactly these calls). */
static void call_complete(ds41_generation *g) {
    if (!g->n_calls) return;
    size_t i = g->n_calls - 1;
    stream_call *c = &g->calls[i];
    if (c->released || (i && !g->calls[i - 1].released) || !json_text_ok(c->args.data, c->args.len)) return;
    c->released = true;
    frag_push(g, i, c->name, c->name_len, "", 0);
    if (c->args.len) {
        /* the arguments were accumulated already: push them as fragments without appending again */
        ds41_buf a = c->args;
        c->args = (ds41_buf){0};
        frag_push(g, i, NULL, 0, a.data, a.len);
        ds41_buf_free(&a);
    }
}

/* A piece of the open value: JSON-escaped (without quotes) for a string value, raw otherwise. */
static void value_piece(ds41_generation *g, const char *s, size_t n) {
    if (!n) return;
    if (!g->value_string) {
        frag_args(g, s, n);
        return;
    }
    ds41_buf q = {0};
    ds41_py_dumps_string(s, n, &q);
    if (q.oom || q.len < 2) g->frag_oom = true;
    else frag_args(g, q.data + 1, q.len - 2);
    ds41_buf_free(&q);
}

/* Python's \s for one ASCII byte (the streamer stalls on other whitespace: the parser decides). */
static bool ascii_space(unsigned char c) { return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20); }

/* The longest suffix of s[0..n) that is a proper prefix of lit. */
static size_t held_suffix(const char *s, size_t n, const char *lit) {
    size_t l = strlen(lit);
    for (size_t k = l - 1 < n ? l - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, lit, k) == 0) return k;
    return 0;
}

static bool param_name_seen(const ds41_generation *g, const char *name, size_t n) {
    size_t pos = 0;
    while (pos < g->param_names.len) {
        const char *s = g->param_names.data + pos;
        size_t l = strlen(s);
        if (l == n && memcmp(s, name, n) == 0) return true;
        pos += l + 1;
    }
    return false;
}

/* Stream as much of the block as the text decides (see generate.h "Tool-call streaming"). */
static void block_scan(ds41_generation *g) {
    const char *t = g->text.data ? g->text.data : "";
    const size_t len = g->text.len;
    for (;;) {
        const char *r = t + g->block_pos;
        const size_t n = len - g->block_pos;
        switch (g->bstate) {
        case BS_CALLS: {
            static const char inv[] = ">\n" DSML_INVOKE_START, end[] = ">\n" DSML_CALLS_END;
            if (has_prefix(r, n, inv)) {
                g->block_pos += strlen(inv);
                g->bstate = !g->parallel_tool_calls && g->n_calls > 0 ? BS_STALLED : BS_HEAD;
                continue;
            }
            if (has_prefix(r, n, end)) {
                g->block_pos += strlen(end);
                g->bstate = BS_DONE;
                return;
            }
            if (!may_become(r, n, inv) && !may_become(r, n, end)) g->bstate = BS_STALLED;
            return;
        }
        case BS_HEAD: {
            const char *ps = memmem(r, n, DSML_PARAM_START, strlen(DSML_PARAM_START));
            const char *ie = memmem(r, n, DSML_INVOKE_END, strlen(DSML_INVOKE_END));
            if (!ps && !ie) return;
            bool param = ps && (!ie || ps < ie);
            size_t cn = (size_t)((param ? ps : ie) - r), i = 0;
            while (i < cn && ascii_space((unsigned char)r[i])) i++;
            if (cn - i < 6 || memcmp(r + i, "name=\"", 6) != 0 || (i < cn && (unsigned char)r[i] >= 0x80)) {
                g->bstate = BS_STALLED;
                return;
            }
            size_t name0 = i + 6, name1 = SIZE_MAX;
            for (size_t q = name0; q + 3 <= cn; q++) {
                if (memcmp(r + q, "\">\n", 3) == 0 && (q + 3 == cn || (q + 4 == cn && r[cn - 1] == '\n'))) {
                    name1 = q;
                    break;
                }
            }
            if (name1 == SIZE_MAX) {
                g->bstate = BS_STALLED;
                return;
            }
            call_start(g, r + name0, name1 - name0);
            g->n_params = 0;
            g->param_names.len = 0;
            if (param) {
                g->block_pos += cn + strlen(DSML_PARAM_START);
                g->bstate = BS_PARAM_HEAD;
            } else {
                frag_args(g, "{}", 2);
                call_complete(g);
                g->block_pos += cn + strlen(DSML_INVOKE_END);
                g->bstate = BS_CALLS;
            }
            continue;
        }
        case BS_PARAM_HEAD: {
            static const char lead[] = " name=\"", t_lit[] = "\" string=\"true\">", f_lit[] = "\" string=\"false\">";
            if (!has_prefix(r, n, lead)) {
                if (!may_become(r, n, lead)) g->bstate = BS_STALLED;
                return;
            }
            const char *pe = memmem(r, n, DSML_PARAM_END, strlen(DSML_PARAM_END));
            size_t lim = pe ? (size_t)(pe - r) : n, at = SIZE_MAX, lit = 0;
            bool is_string = false;
            for (size_t q = 7; q < lim; q++) {
                if (has_prefix(r + q, lim - q, t_lit)) {
                    at = q, lit = strlen(t_lit), is_string = true;
                    break;
                }
                if (has_prefix(r + q, lim - q, f_lit)) {
                    at = q, lit = strlen(f_lit);
                    break;
                }
                if (!pe && (may_become(r + q, n - q, t_lit) || may_become(r + q, n - q, f_lit))) return;
            }
            if (at == SIZE_MAX) {
                if (pe) g->bstate = BS_STALLED;
                return;
            }
            if (param_name_seen(g, r + 7, at - 7) || memchr(r + 7, 0, at - 7)) {
                g->bstate = BS_STALLED; /* Duplicate parameter name: the parse fails */
                return;
            }
            ds41_buf_put(&g->param_names, r + 7, at - 7);
            ds41_buf_putc(&g->param_names, 0);
            ds41_buf head = {0};
            ds41_buf_puts(&head, g->n_params ? ", " : "{");
            ds41_py_dumps_string(r + 7, at - 7, &head);
            ds41_buf_puts(&head, is_string ? ": \"" : ": ");
            if (head.oom) g->frag_oom = true;
            else frag_args(g, head.data, head.len);
            ds41_buf_free(&head);
            g->n_params++;
            g->value_string = is_string;
            g->block_pos += at + lit;
            g->bstate = BS_VALUE;
            continue;
        }
        case BS_VALUE: {
            const char *pe = memmem(r, n, DSML_PARAM_END, strlen(DSML_PARAM_END));
            if (pe) {
                size_t e = (size_t)(pe - r), ve;
                if (e >= 1 && r[e - 1] == '<') ve = e - 1;
                else if (e >= 2 && r[e - 2] == '<' && r[e - 1] == '\n') ve = e - 2;
                else {
                    g->bstate = BS_STALLED;
                    return;
                }
                value_piece(g, r, ve);
                if (g->value_string) frag_args(g, "\"", 1);
                g->block_pos += e + strlen(DSML_PARAM_END);
                g->bstate = BS_AFTER_PARAM;
                continue;
            }
            /* hold what may still end the value (a bare "/｜DSML｜ parameter" too: it would end the
             * parser's chunk without its '<', and the streamer has to see it to stall) */
            size_t h1 = held_suffix(r, n, "<" DSML_PARAM_END), h2 = held_suffix(r, n, "<\n" DSML_PARAM_END),
                   h3 = held_suffix(r, n, DSML_PARAM_END);
            size_t hold = h1 > h2 ? h1 : h2;
            if (h3 > hold) hold = h3;
            value_piece(g, r, n - hold);
            g->block_pos += n - hold;
            return;
        }
        case BS_AFTER_PARAM: {
            static const char nxt[] = ">\n" DSML_PARAM_START, cl[] = ">\n" DSML_INVOKE_END;
            if (has_prefix(r, n, nxt)) {
                g->block_pos += strlen(nxt);
                g->bstate = BS_PARAM_HEAD;
                continue;
            }
            if (has_prefix(r, n, cl)) {
                frag_args(g, "}", 1);
                call_complete(g);
                g->block_pos += strlen(cl);
                g->bstate = BS_CALLS;
                continue;
            }
            if (!may_become(r, n, nxt) && !may_become(r, n, cl)) g->bstate = BS_STALLED;
            return;
        }
        case BS_DONE:
        case BS_STALLED: return;
        }
    }
}

/* After the final parse: complete each streamed call and stream the calls not streamed yet, so a
 * call's fragments add up to its parsed arguments.  A streamed call the parse contradicts (its
 * block did not parse) gets nothing more. */
static void stream_reconcile(ds41_generation *g) {
    const ds41_chat_completion *r = &g->result;
    for (size_t i = 0; i < r->n_tool_calls; i++) {
        const ds41_chat_tool_call *c = &r->tool_calls[i];
        if (i < g->n_calls && g->calls[i].released) {
            const stream_call *sc = &g->calls[i];
            if (sc->name_len == c->name_len && memcmp(sc->name, c->name, c->name_len) == 0 &&
                sc->args.len <= c->arguments_len && (!sc->args.len || memcmp(sc->args.data, c->arguments, sc->args.len) == 0))
                frag_push(g, i, NULL, 0, c->arguments + sc->args.len, c->arguments_len - sc->args.len);
            continue;
        }
        if (i > g->n_calls || (i && !g->calls[i - 1].released))
            break; /* a call before it was missed (out of memory) */
        if (i == g->n_calls) call_start(g, c->name, c->name_len);
        if (i >= g->n_calls) break;
        stream_call *sc = &g->calls[i];
        sc->args.len = 0;
        sc->released = true;
        frag_push(g, i, c->name, c->name_len, "", 0);
        frag_push(g, i, NULL, 0, c->arguments, c->arguments_len);
    }
}

/* ---- setup --------------------------------------------------------------------------------- */

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void ds41_generation_mark_started(ds41_generation *g) {
    if (g->started) return; /* a preempted request keeps its first admission */
    g->started = true;
    g->t_start = mono_ns();
}

void ds41_generation_timings(const ds41_generation *g, double *prefill_ms, double *decode_ms) {
    *prefill_ms = g->t_first > g->t_start ? (double)(g->t_first - g->t_start) / 1e6 : 0;
    *decode_ms = g->t_last > g->t_first ? (double)(g->t_last - g->t_first) / 1e6 : 0;
}

int ds41_generation_new(const ds41_tokenizer *tok, const ds41_generation_params *p, uint32_t n_vocab,
                        ds41_generation **out, ds41_error *err) {
    if (!out) return ds41_fail(err, "generation: no output");
    *out = NULL;
    if (!tok || !p) return ds41_fail(err, "generation: no tokenizer or parameters");
    if (n_vocab == 0 || n_vocab > DS41_SAMPLER_MAX_VOCAB) return ds41_fail(err, "generation: bad vocabulary size %u", n_vocab);
    ds41_generation *g = calloc(1, sizeof *g);
    if (!g) return oom(err);
    g->tok = tok;
    g->n_vocab = n_vocab;
    g->t_start = mono_ns();
    g->kind = p->kind;
    g->silent_eos_id = -1;
    g->max_context = p->max_context;
    g->parse_tool_calls = p->kind == DS41_GENERATION_CHAT && p->parse_tool_calls;
    g->parallel_tool_calls = p->parallel_tool_calls;
    g->max_tokens = p->max_tokens;

    bool prefix = false;
    switch (p->kind) {
    case DS41_GENERATION_CHAT:
        if (render_chat(g, p, &prefix, err) != 0) goto fail;
        if (tokenize_prompt(g, g->prompt_text, g->prompt_text_len, err) != 0) goto fail;
        break;
    case DS41_GENERATION_RAW:
        if (!p->text && p->text_len) {
            ds41_fail(err, "prompt: no text");
            goto fail;
        }
        g->prompt_text = malloc(p->text_len + 1);
        if (!g->prompt_text) {
            oom(err);
            goto fail;
        }
        if (p->text_len) memcpy(g->prompt_text, p->text, p->text_len);
        g->prompt_text[p->text_len] = 0;
        g->prompt_text_len = p->text_len;
        if (tokenize_prompt(g, p->text, p->text_len, err) != 0) goto fail;
        break;
    case DS41_GENERATION_IDS:
        if (!p->ids && p->n_ids) {
            ds41_fail(err, "prompt: no ids");
            goto fail;
        }
        for (size_t i = 0; i < p->n_ids; i++) {
            if (p->ids[i] >= n_vocab) {
                ds41_fail(err, "prompt[%zu]: token %u is outside the model's vocabulary (%u)", i, p->ids[i], n_vocab);
                goto fail;
            }
            if (push_token(g, (int32_t)p->ids[i]) != 0) {
                oom(err);
                goto fail;
            }
        }
        g->prompt_text = calloc(1, 1);
        if (!g->prompt_text) {
            oom(err);
            goto fail;
        }
        break;
    default: ds41_fail(err, "generation: unknown prompt kind %d", (int)p->kind); goto fail;
    }
    g->n_prompt = g->n_tokens;
    if (g->n_prompt == 0) {
        ds41_fail(err, "prompt is empty");
        goto fail;
    }
    if (g->max_context && g->n_prompt >= g->max_context) {
        ds41_fail(err, "prompt of %zu tokens leaves no room in the context (%u tokens)", g->n_prompt, g->max_context);
        goto fail;
    }

    /* Chat output in thinking mode starts in the reasoning, unless a continued assistant
     * message already closed it (its reasoning, if any, is part of the prompt). */
    g->parse_mode = p->kind == DS41_GENERATION_CHAT && p->thinking && !prefix ? DS41_CHAT_MODE_THINKING
                                                                               : DS41_CHAT_MODE_CHAT;
    g->state = g->parse_mode == DS41_CHAT_MODE_THINKING ? SPLIT_REASONING : SPLIT_CONTENT;

    if (ds41_sampler_new(&g->sampler, &p->sampler, n_vocab, err) != 0) {
        ds41_error_prefix(err, "sampling");
        goto fail;
    }
    {
        uint32_t *prompt_ids = malloc(g->n_prompt * sizeof *prompt_ids);
        if (!prompt_ids) {
            oom(err);
            goto fail;
        }
        for (size_t i = 0; i < g->n_prompt; i++) prompt_ids[i] = (uint32_t)g->tokens[i];
        int rc = ds41_sampler_accept_prompt(g->sampler, prompt_ids, g->n_prompt, err);
        free(prompt_ids);
        if (rc != 0) goto fail;
    }

    for (uint32_t i = 0; i < p->n_stop_ids; i++) {
        if (!p->stop_ids || p->stop_ids[i] >= n_vocab) {
            ds41_fail(err, "stop_token_ids[%u]: not a token of the vocabulary (%u)", i, n_vocab);
            goto fail;
        }
    }
    {
        /* The EOS of tokenizer_config.json, else the V4.1 EOS text's id. */
        const ds41_vocab *v = ds41_tokenizer_vocab(tok);
        int32_t eos = ds41_vocab_eos_id(v);
        if (eos < 0) eos = ds41_vocab_find(v, DS41_CHAT_EOS, strlen(DS41_CHAT_EOS));
        uint32_t eos_ids[1];
        uint32_t n_eos = 0;
        if (!p->ignore_eos && eos >= 0 && (uint32_t)eos < n_vocab) eos_ids[n_eos++] = (uint32_t)eos;
        g->eos_id = n_eos ? (int32_t)eos_ids[0] : -1;
        /* The EOS that ends a generation is never part of T.  One generated past (ignore_eos) stays
         * out of a CHAT text too: there its text is the parser's end marker, and everything after
         * it (the rest of a benchmark's tokens) would be dropped from the stream and the message. */
        g->silent_eos_id =
            p->ignore_eos && p->kind == DS41_GENERATION_CHAT && eos >= 0 && (uint32_t)eos < n_vocab ? eos
                                                                                                    : -1;
        if (ds41_gen_limits_init(&g->limits, p->max_tokens, eos_ids, n_eos, p->stop_ids, p->n_stop_ids, err) != 0)
            goto fail;
    }

    if (p->n_stop) {
        if (!p->stop) {
            ds41_fail(err, "stop: no strings");
            goto fail;
        }
        size_t *lens = malloc(p->n_stop * sizeof *lens);
        if (!lens) {
            oom(err);
            goto fail;
        }
        for (size_t i = 0; i < p->n_stop; i++) lens[i] = p->stop_lens ? p->stop_lens[i] : (p->stop[i] ? strlen(p->stop[i]) : 0);
        int rc = ds41_stop_matcher_new(&g->stop, p->stop, lens, p->n_stop, err);
        free(lens);
        if (rc != 0) {
            ds41_error_prefix(err, "stop");
            goto fail;
        }
    } else if (ds41_stop_matcher_new(&g->stop, NULL, NULL, 0, err) != 0) {
        goto fail;
    }

    g->detok = ds41_detok_new(tok, p->kind == DS41_GENERATION_CHAT ? false : p->skip_special);
    if (!g->detok || (p->skip_special && specials_init(g) != 0)) {
        oom(err);
        goto fail;
    }

    if (p->n_forced) {
        if (!p->forced_ids) {
            ds41_fail(err, "forced output: no ids");
            goto fail;
        }
        g->forced = malloc(p->n_forced * sizeof *g->forced);
        if (!g->forced) {
            oom(err);
            goto fail;
        }
        for (size_t i = 0; i < p->n_forced; i++) {
            if (p->forced_ids[i] >= n_vocab) {
                ds41_fail(err, "forced output[%zu]: token %u is outside the vocabulary (%u)", i, p->forced_ids[i], n_vocab);
                goto fail;
            }
            g->forced[i] = p->forced_ids[i];
        }
        g->n_forced = p->n_forced;
    }
    if (g->parse_tool_calls && p->tool_choice != DS41_GENERATION_TOOL_CHOICE_AUTO &&
        ds41_tool_choice_setup(g, p, err) != 0)
        goto fail;
    if (ds41_json_format_setup(g, p, prefix, err) != 0) goto fail;
    g->min_tokens = p->min_tokens;
    *out = g;
    return 0;
fail:
    ds41_generation_free(g);
    return -1;
}

void ds41_generation_free(ds41_generation *g) {
    if (!g) return;
    free(g->prompt_text);
    free(g->tokens);
    free(g->forced);
    ds41_sampler_free(g->sampler);
    ds41_stop_matcher_free(g->stop);
    ds41_detok_free(g->detok);
    ds41_buf_free(&g->text);
    ds41_buf_free(&g->step_reasoning);
    ds41_buf_free(&g->step_content);
    ds41_buf_free(&g->all_reasoning);
    ds41_buf_free(&g->all_content);
    free(g->specials);
    if (g->has_result) ds41_chat_completion_free(&g->result);
    for (size_t i = 0; i < g->n_calls; i++) {
        free(g->calls[i].name);
        ds41_buf_free(&g->calls[i].args);
    }
    free(g->calls);
    free(g->frags);
    ds41_buf_free(&g->frag_text);
    free(g->deltas);
    ds41_buf_free(&g->param_names);
    ds41_tool_choice_clear(g);
    free(g->cands);
    ds41_buf_free(&g->cur);
    ds41_buf_free(&g->tail);
    ds41_tool_choice_free(g);
    free(g->prop_used);
    ds41_json_format_free(g);
    free(g->cforce);
    free(g->masked);
    free(g);
}

/* ---- accessors ------------------------------------------------------------------------------ */

const int32_t *ds41_generation_tokens(const ds41_generation *g, size_t *n) {
    if (n) *n = g->n_tokens;
    return g->tokens;
}
size_t ds41_generation_prompt_tokens(const ds41_generation *g) { return g->n_prompt; }
size_t ds41_generation_completion_tokens(const ds41_generation *g) { return g->n_tokens - g->n_prompt; }
size_t ds41_generation_reasoning_tokens(const ds41_generation *g) { return g->n_reasoning; }
size_t ds41_generation_cached_tokens(const ds41_generation *g) { return g->n_cached; }
uint32_t ds41_generation_max_tokens(const ds41_generation *g) {
    return g->max_tokens;
}
uint32_t ds41_generation_max_context(const ds41_generation *g) {
    return g->max_context;
}

const char *ds41_generation_prompt_text(const ds41_generation *g, size_t *len) {
    if (len) *len = g->prompt_text_len;
    return g->prompt_text;
}

size_t ds41_generation_pending(const ds41_generation *g, const int32_t **ids) {
    size_t n = g->finish == DS41_GENERATION_RUNNING ? g->n_tokens - g->n_fed : 0;
    if (ids) *ids = n ? g->tokens + g->n_fed : NULL;
    return n;
}

void ds41_generation_mark_fed(ds41_generation *g, size_t n) {
    size_t pending = ds41_generation_pending(g, NULL);
    g->n_fed += n < pending ? n : pending;
}

int ds41_generation_mark_cached(ds41_generation *g, size_t n, ds41_error *err) {
    if (g->n_fed != 0) return ds41_fail(err, "prefix cache: the generation has already fed tokens");
    if (n >= g->n_prompt) return ds41_fail(err, "prefix cache: %zu cached tokens for a prompt of %zu", n, g->n_prompt);
    g->n_fed = n;
    g->n_cached = n;
    return 0;
}

bool ds41_generation_wants_logits(const ds41_generation *g) {
    return g->finish == DS41_GENERATION_RUNNING && g->n_fed == g->n_tokens;
}

bool ds41_generation_finished(const ds41_generation *g) { return g->finish != DS41_GENERATION_RUNNING; }
ds41_generation_finish ds41_generation_finish_reason(const ds41_generation *g) { return g->finish; }

int ds41_generation_stop_index(const ds41_generation *g) {
    return g->finish == DS41_GENERATION_STOP_STRING ? g->stop_index : -1;
}

const char *ds41_generation_finish_name(const ds41_generation *g) {
    switch (g->finish) {
    case DS41_GENERATION_RUNNING: return "running";
    case DS41_GENERATION_EOS:
    case DS41_GENERATION_STOP_TOKEN:
    case DS41_GENERATION_STOP_STRING:
        return g->has_result && g->result.n_tool_calls > 0 ? "tool_calls" : "stop";
    case DS41_GENERATION_MAX_TOKENS:
    case DS41_GENERATION_CONTEXT: return "length";
    case DS41_GENERATION_ABORTED: return "abort";
    }
    return "stop";
}

const char *ds41_generation_text(const ds41_generation *g, size_t *len) {
    if (len) *len = g->text.len;
    return g->text.data ? g->text.data : "";
}

const ds41_chat_completion *ds41_generation_result(const ds41_generation *g) {
    return g->has_result ? &g->result : NULL;
}

uint64_t ds41_generation_seed(const ds41_generation *g) { return ds41_sampler_seed(g->sampler); }

const ds41_sampler *ds41_generation_sampler(const ds41_generation *g) { return g->sampler; }

/* ---- the output splitter -------------------------------------------------------------------- */

static bool marker_watched(const ds41_generation *g, int m) {
    switch (g->state) {
    case SPLIT_REASONING: return m != M_TOOL_CALLS || g->parse_tool_calls;
    case SPLIT_CONTENT: return m == M_EOS || (m == M_TOOL_CALLS && g->parse_tool_calls);
    default: return false;
    }
}

static void emit_part(ds41_generation *g, split_state part, const char *s, size_t n) {
    if (!n) return;
    const int k = part == SPLIT_REASONING ? 0 : 1;
    ds41_buf *all = k ? &g->all_content : &g->all_reasoning,
             *step = k ? &g->step_content : &g->step_reasoning;
    ds41_buf_put(all, s, n);
    if (!g->specials)
        ds41_buf_put(step, s, n);
    else if (!all->oom)
        strip_specials(g, all->data, all->len, &g->strip_pos[k], step, false);
}

/* The end: what was held back as a possible special token is not one; the message loses the
 * special tokens' text as the stream did. */
static int specials_finish(ds41_generation *g) {
    if (!g->specials) return 0;
    if (g->all_reasoning.oom || g->all_content.oom) return -1;
    strip_specials(g, g->all_reasoning.data, g->all_reasoning.len, &g->strip_pos[0], &g->step_reasoning,
                   true);
    strip_specials(g, g->all_content.data, g->all_content.len, &g->strip_pos[1], &g->step_content, true);
    ds41_chat_completion *r = &g->result;
    if (r->reasoning_content && strip_string(g, r->reasoning_content, &r->reasoning_content_len) != 0)
        return -1;
    if (r->content && strip_string(g, r->content, &r->content_len) != 0) return -1;
    return 0;
}

/* Decide as much of T as can be decided: stream reasoning / content up to the next marker or up
 * to a suffix that may still become one (unless final: then nothing is held back). */
static void split_advance(ds41_generation *g, bool final) {
    const char *t = g->text.data ? g->text.data : "";
    const size_t len = g->text.len;
    if (g->kind != DS41_GENERATION_CHAT) {
        emit_part(g, SPLIT_CONTENT, t + g->split_pos, len - g->split_pos);
        g->split_pos = len;
        return;
    }
    if (g->state == SPLIT_BLOCK) {
        block_scan(g);
        return;
    }
    while (g->state == SPLIT_REASONING || g->state == SPLIT_CONTENT) {
        size_t best = SIZE_MAX;
        int which = -1;
        for (int m = 0; m < N_MARKERS; m++) {
            if (!marker_watched(g, m)) continue;
            const char *hit = memmem(t + g->split_pos, len - g->split_pos, MARKER_TEXT[m], strlen(MARKER_TEXT[m]));
            if (hit && (size_t)(hit - t) < best) {
                best = (size_t)(hit - t);
                which = m;
            }
        }
        if (which < 0) {
            size_t hold = 0;
            if (!final) {
                /* the longest suffix that is a proper prefix of a watched marker */
                for (int m = 0; m < N_MARKERS; m++) {
                    if (!marker_watched(g, m)) continue;
                    size_t ml = strlen(MARKER_TEXT[m]);
                    size_t avail = len - g->split_pos;
                    for (size_t k = (ml - 1 < avail ? ml - 1 : avail); k > hold; k--) {
                        if (memcmp(t + len - k, MARKER_TEXT[m], k) == 0) {
                            hold = k;
                            break;
                        }
                    }
                }
            }
            emit_part(g, g->state, t + g->split_pos, len - g->split_pos - hold);
            g->split_pos = len - hold;
            return;
        }
        emit_part(g, g->state, t + g->split_pos, best - g->split_pos);
        g->split_pos = best;
        if (which == M_THINK_END) {
            g->split_pos += strlen(MARKER_TEXT[M_THINK_END]);
            g->state = SPLIT_CONTENT;
        } else if (which == M_TOOL_CALLS) {
            g->state = SPLIT_BLOCK;
            g->block_start = best;
            g->bstate = BS_CALLS;
            g->block_pos = best + strlen(TOOL_CALLS_START);
            block_scan(g);
            return;
        } else {
            g->state = SPLIT_DONE;
        }
    }
}

/* Everything of `full` past what was streamed, when the streamed text is its prefix.  It is by
 * construction (the splitter follows the parser's rules); were it not, nothing more is sent
 * rather than text that contradicts the stream. */
static void emit_rest(ds41_generation *g, split_state part, const char *full, size_t full_len) {
    const ds41_buf *done = part == SPLIT_REASONING ? &g->all_reasoning : &g->all_content;
    if (done->len > full_len || (done->len && memcmp(full, done->data, done->len) != 0)) return;
    emit_part(g, part, full + done->len, full_len - done->len);
}

static char *dup_buf(const ds41_buf *b, size_t *len) {
    char *s = malloc(b->len + 1);
    if (!s) return NULL;
    if (b->len) memcpy(s, b->data, b->len);
    s[b->len] = 0;
    *len = b->len;
    return s;
}

static void completion_replace(ds41_generation *g, ds41_chat_completion *c) {
    ds41_chat_completion_free(&g->result);
    g->result = *c;
}

/* Output cut off by max_tokens or the context (generate.h "Cut off"): a tool-call block the
 * parser cannot take whole never reaches content.  Its complete invokes are kept (the longest cut
 * after an invoke's end that parses, closed with the calls end), as far as their arguments are
 * valid JSON; the rest of the block is dropped.  Without a block, the end of content that may
 * have been the start of one ("\n\n<｜..." and longer) is dropped.  -1: out of memory. */
static int cut_off_block(ds41_generation *g) {
    const char *t = g->text.data ? g->text.data : "";
    if (g->state == SPLIT_DONE) return 0; /* the message ended at an EOS in the text: its end is no cut */
    if (g->state != SPLIT_BLOCK) {
        ds41_chat_completion *r = &g->result;
        size_t ml = strlen(TOOL_CALLS_START);
        for (size_t k = ml - 1; k >= 3; k--) {
            if (r->content_len >= k && memcmp(r->content + r->content_len - k, TOOL_CALLS_START, k) == 0) {
                r->content_len -= k;
                r->content[r->content_len] = 0;
                break;
            }
        }
        return 0;
    }
    size_t bs = g->block_start;
    /* the block parsed whole (only its EOS is missing); the parser also takes a last invoke cut
     * right after its name line, which is not whole */
    if (!g->result.repaired && memmem(t + bs, g->text.len - bs, DSML_CALLS_END, strlen(DSML_CALLS_END)))
        return 0;
    ds41_chat_completion c;
    memset(&c, 0, sizeof c);
    bool got = false;
    /* the invoke ends, last first */
    size_t ends[64], n_ends = 0;
    for (size_t pos = bs;;) {
        const char *h = memmem(t + pos, g->text.len - pos, DSML_INVOKE_END, strlen(DSML_INVOKE_END));
        if (!h) break;
        pos = (size_t)(h - t) + strlen(DSML_INVOKE_END);
        if (n_ends == sizeof ends / sizeof *ends) memmove(ends, ends + 1, --n_ends * sizeof *ends);
        ends[n_ends++] = pos;
    }
    while (n_ends && !got) {
        ds41_buf b = {0};
        ds41_buf_put(&b, t, ends[--n_ends]);
        ds41_buf_puts(&b, ">\n" DSML_CALLS_END);
        if (b.oom) {
            ds41_buf_free(&b);
            return -1;
        }
        got = ds41_chat_parse_completion(b.data, b.len, g->parse_mode, &c, NULL) == 0;
        ds41_buf_free(&b);
    }
    if (!got && ds41_chat_parse_completion_lenient(t, bs, g->parse_mode, &c, NULL) != 0) return -1;
    /* the calls with JSON arguments, up to the first without */
    size_t keep = 0;
    while (keep < c.n_tool_calls &&
           json_text_ok(c.tool_calls[keep].arguments, c.tool_calls[keep].arguments_len))
        keep++;
    for (size_t i = keep; i < c.n_tool_calls; i++) {
        free(c.tool_calls[i].name);
        free(c.tool_calls[i].tool_namespace);
        free(c.tool_calls[i].arguments);
    }
    c.n_tool_calls = keep;
    c.repaired = true;
    completion_replace(g, &c);
    return 0;
}

/* The end of the text: parse it and deliver what was not streamed. */
static int finalize(ds41_generation *g, ds41_error *err) {
    /* Text held for a possible stop string can no longer become one. */
    const char *piece;
    size_t piece_len;
    ds41_stop_output so;
    if (g->finish != DS41_GENERATION_STOP_STRING) {
        ds41_detok_finish(g->detok, &piece, &piece_len);
        if (piece_len) {
            if (ds41_stop_matcher_feed(g->stop, piece, piece_len, &so, err) != 0) return -1;
            ds41_buf_put(&g->text, so.text, so.len);
        }
        ds41_stop_matcher_finish(g->stop, &so);
        ds41_buf_put(&g->text, so.text, so.len);
    }
    if (g->text.oom) return oom(err);

    if (g->kind != DS41_GENERATION_CHAT || !g->parse_tool_calls) {
        /* No DSML to decide: the splitter's own split is the result. */
        split_advance(g, true);
        if (g->all_reasoning.oom || g->all_content.oom) return oom(err);
        ds41_chat_completion *r = &g->result;
        memset(r, 0, sizeof *r);
        r->reasoning_content = dup_buf(&g->all_reasoning, &r->reasoning_content_len);
        r->content = dup_buf(&g->all_content, &r->content_len);
        g->has_result = true;
        if (!r->reasoning_content || !r->content || specials_finish(g) != 0) return oom(err);
        return 0;
    }

    /* The parser's input: T, plus the EOS the model ended with (it is not part of T). */
    ds41_buf parse_in = {0};
    ds41_buf_put(&parse_in, g->text.data ? g->text.data : "", g->text.len);
    if (g->finish == DS41_GENERATION_EOS) ds41_buf_puts(&parse_in, DS41_CHAT_EOS);
    if (parse_in.oom) {
        ds41_buf_free(&parse_in);
        return oom(err);
    }
    ds41_error note;
    int rc = ds41_chat_parse_completion_lenient(parse_in.data ? parse_in.data : "", parse_in.len, g->parse_mode,
                                                &g->result, &note);
    ds41_buf_free(&parse_in);
    if (rc != 0) return oom(err);
    g->has_result = true;
    if ((g->finish == DS41_GENERATION_MAX_TOKENS || g->finish == DS41_GENERATION_CONTEXT) &&
        cut_off_block(g) != 0)
        return oom(err);
    if (!g->parallel_tool_calls && g->result.n_tool_calls > 1) {
        /* parallel_tool_calls false: the first call only */
        for (size_t i = 1; i < g->result.n_tool_calls; i++) {
            free(g->result.tool_calls[i].name);
            free(g->result.tool_calls[i].tool_namespace);
            free(g->result.tool_calls[i].arguments);
        }
        g->result.n_tool_calls = 1;
    }
    stream_reconcile(g);
    emit_rest(g, SPLIT_REASONING, g->result.reasoning_content, g->result.reasoning_content_len);
    emit_rest(g, SPLIT_CONTENT, g->result.content, g->result.content_len);
    g->state = SPLIT_DONE;
    return specials_finish(g) != 0 ? oom(err) : 0;
}

/* ---- stepping ---------------------------------------------------------------------------------- */

static void step_reset(ds41_generation *g, ds41_generation_delta *out) {
    g->step_reasoning.len = 0;
    g->step_content.len = 0;
    if (g->step_reasoning.data) g->step_reasoning.data[0] = 0;
    if (g->step_content.data) g->step_content.data[0] = 0;
    g->n_frags = 0;
    g->frag_text.len = 0;
    memset(out, 0, sizeof *out);
}

static void step_fill(ds41_generation *g, ds41_generation_delta *out) {
    out->reasoning = g->step_reasoning.data ? g->step_reasoning.data : "";
    out->reasoning_len = g->step_reasoning.len;
    out->content = g->step_content.data ? g->step_content.data : "";
    out->content_len = g->step_content.len;
    out->finished = g->finish != DS41_GENERATION_RUNNING;
    out->finish = g->finish;
    if (out->finished && g->has_result) {
        out->tool_calls = g->result.tool_calls;
        out->n_tool_calls = g->result.n_tool_calls;
    }
    if (g->n_frags && g->n_frags <= g->cap_deltas) {
        for (size_t i = 0; i < g->n_frags; i++) {
            const frag *f = &g->frags[i];
            g->deltas[i] = (ds41_generation_tool_delta){
                .index = f->index,
                .name = f->has_name ? g->frag_text.data + f->name_off : NULL,
                .name_len = f->name_len,
                .arguments = f->args_len ? g->frag_text.data + f->args_off : "",
                .arguments_len = f->args_len,
            };
        }
        out->tool_deltas = g->deltas;
        out->n_tool_deltas = g->n_frags;
    }
}

/* Room for this step's tool deltas (before step_fill, which cannot fail). */
static int deltas_reserve(ds41_generation *g) {
    if (g->frag_oom || g->frag_text.oom) return -1;
    if (g->n_frags <= g->cap_deltas) return 0;
    ds41_generation_tool_delta *nd = realloc(g->deltas, g->n_frags * sizeof *nd);
    if (!nd) return -1;
    g->deltas = nd;
    g->cap_deltas = g->n_frags;
    return 0;
}

/* log_softmax(logits)[token] in double precision (forced tokens' logprob). */
static float raw_logprob(const float *logits, uint32_t n, uint32_t token) {
    float mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0;
    for (uint32_t i = 0; i < n; i++) sum += exp((double)logits[i] - (double)mx);
    return (float)((double)logits[token] - (double)mx - log(sum));
}

/* A constraint (tool choice, structured output) forces the next token. */
static bool constraint_forcing(const ds41_generation *g) {
    return (g->cst != CS_OFF || g->jf == JF_ON) && g->cforce_pos < g->n_cforce;
}

/* min_tokens: EOS and the stop ids are masked, unless nothing else is left (a constraint that
 * allows only the end). */
const float *ds41_gen_without_eos(ds41_generation *g, const float *logits) {
    float *m = ds41_gen_masked(g);
    if (!m) return logits;
    memcpy(m, logits, (size_t)g->n_vocab * sizeof *m);
    if (g->eos_id >= 0) m[g->eos_id] = -INFINITY;
    for (uint32_t t = 0; t < g->n_vocab; t++)
        if (m[t] > -INFINITY) return m;
    return logits;
}

static const float *min_tokens_logits(ds41_generation *g, const float *logits) {
    float *m = ds41_gen_masked(g);
    if (!m) return logits;
    if (logits != m) memcpy(m, logits, (size_t)g->n_vocab * sizeof *m);
    float keep[1 + DS41_GEN_MAX_STOP_IDS];
    size_t nk = 0;
    if (g->eos_id >= 0) {
        keep[nk++] = m[g->eos_id];
        m[g->eos_id] = -INFINITY;
    }
    for (uint32_t i = 0; i < g->limits.n_stop_ids; i++) {
        keep[nk++] = m[g->limits.stop_ids[i]];
        m[g->limits.stop_ids[i]] = -INFINITY;
    }
    for (uint32_t t = 0; t < g->n_vocab; t++)
        if (m[t] > -INFINITY) return m;
    nk = 0; /* nothing else: put them back */
    if (g->eos_id >= 0) m[g->eos_id] = keep[nk++];
    for (uint32_t i = 0; i < g->limits.n_stop_ids; i++) m[g->limits.stop_ids[i]] = keep[nk++];
    return m;
}

/* A step; with draft >= 0 the sample is speculative (ds41_generation_step_draft). */
static int step_impl(ds41_generation *g, const float *logits, ds41_sampler_scratch *scratch, int64_t draft,
                     const float *q, ds41_generation_delta *out, bool *accepted, ds41_error *err) {
    ds41_generation_delta dummy;
    if (!out) out = &dummy;
    step_reset(g, out);
    if (!ds41_generation_wants_logits(g))
        return ds41_fail(err, g->finish != DS41_GENERATION_RUNNING ? "generation: already finished"
                                                                   : "generation: tokens still to feed");
    if (!logits) return ds41_fail(err, "generation: no logits");
    if (push_token(g, 0) != 0) return oom(err); /* room first, so nothing fails after sampling */
    g->n_tokens--;
    if (!g->t_first) g->t_first = mono_ns();

    ds41_sample_result res;
    size_t gen_index = g->n_tokens - g->n_prompt;
    bool test_forced = gen_index < g->n_forced;
    if (!test_forced) {
        ds41_tool_choice_budget(g);
        ds41_json_format_budget(g);
    }
    bool c_forced = !test_forced && constraint_forcing(g);
    const float *use = test_forced || c_forced ? logits
                       : g->jf != JF_OFF       ? ds41_json_format_logits(g, logits)
                                               : ds41_tool_choice_logits(g, logits);
    if (!use) { /* the constraint forces its close from here */
        c_forced = constraint_forcing(g);
        use = logits;
    }
    if (!test_forced && !c_forced && gen_index < g->min_tokens) use = min_tokens_logits(g, use);
    if (draft >= 0 && !test_forced && !c_forced) {
        int acc = 0;
        if (ds41_sampler_sample_draft(g->sampler, scratch, use, g->n_vocab, (uint32_t)draft, q, &res, &acc, err) !=
            0)
            return -1;
    } else if (ds41_sampler_sample(g->sampler, scratch, use, g->n_vocab, &res, err) != 0) {
        return -1;
    }
    if (test_forced || c_forced) {
        uint32_t forced = test_forced ? g->forced[gen_index] : g->cforce[g->cforce_pos++];
        if (res.token != forced) {
            res.token = forced;
            if (!isnan(res.logprob)) res.logprob = raw_logprob(logits, g->n_vocab, forced);
        }
        out->forced = true;
    }
    const uint32_t token = res.token;
    /* the sampled token is the draft: what the verification fed at this position stands */
    if (accepted) *accepted = draft >= 0 && (int64_t)token == draft;
    out->token = token;
    out->sample = res;
    out->reasoning_token = g->state == SPLIT_REASONING;
    if (out->reasoning_token) g->n_reasoning++;

    ds41_gen_verdict v = ds41_gen_limits_step(&g->limits, token);
    g->tokens[g->n_tokens++] = (int32_t)token;
    if (ds41_gen_verdict_emits(v)) {
        if (ds41_sampler_accept(g->sampler, token, err) != 0) return -1;
        out->emitted = true;
    }
    if (ds41_gen_verdict_emits(v) && (int32_t)token != g->silent_eos_id) {
        const char *piece;
        size_t piece_len;
        if (g->cst != CS_OFF) {
            size_t bl = 0;
            const uint8_t *b = ds41_tokenizer_token_bytes(g->tok, token, &bl);
            for (size_t i = 0; b && i < bl; i++) ds41_tool_choice_byte(g, (char)b[i]);
        }
        if (ds41_detok_push(g->detok, token, &piece, &piece_len) != 0) return oom(err);
        ds41_stop_output so = {.text = piece, .len = piece_len};
        /* before min_tokens, stop strings are not looked for (a match across the boundary is not
         * seen either) */
        if (gen_index >= g->min_tokens && ds41_stop_matcher_feed(g->stop, piece, piece_len, &so, err) != 0)
            return -1;
        ds41_buf_put(&g->text, so.text, so.len);
        if (g->text.oom) return oom(err);
        if (so.stopped) {
            g->finish = DS41_GENERATION_STOP_STRING;
            g->stop_index = so.stop_index;
        }
    }
    if (g->finish == DS41_GENERATION_RUNNING) {
        if (v == DS41_GEN_EOS)
            g->finish = DS41_GENERATION_EOS;
        else if (v == DS41_GEN_STOP_TOKEN)
            g->finish = DS41_GENERATION_STOP_TOKEN;
        else if (v == DS41_GEN_LENGTH)
            g->finish = DS41_GENERATION_MAX_TOKENS;
        else if (g->max_context && g->n_tokens >= g->max_context)
            g->finish = DS41_GENERATION_CONTEXT;
    }
    split_advance(g, false);
    ds41_json_format_token(g, token, ds41_gen_verdict_emits(v));
    g->t_last = mono_ns();
    if (g->finish != DS41_GENERATION_RUNNING && finalize(g, err) != 0) return -1;
    if (g->step_reasoning.oom || g->step_content.oom || g->all_reasoning.oom || g->all_content.oom ||
        deltas_reserve(g) != 0)
        return oom(err);
    step_fill(g, out);
    return 0;
}

int ds41_generation_step(ds41_generation *g, const float *logits, ds41_sampler_scratch *scratch,
                         ds41_generation_delta *out, ds41_error *err) {
    return step_impl(g, logits, scratch, -1, NULL, out, NULL, err);
}

int ds41_generation_step_draft(ds41_generation *g, const float *logits, ds41_sampler_scratch *scratch,
                               uint32_t draft, const float *q, ds41_generation_delta *out, bool *accepted,
                               ds41_error *err) {
    if (accepted) *accepted = false;
    if (draft >= g->n_vocab) return ds41_fail(err, "generation: draft token %u outside the vocabulary", draft);
    return step_impl(g, logits, scratch, draft, q, out, accepted, err);
}

int ds41_generation_abort(ds41_generation *g, ds41_generation_delta *out, ds41_error *err) {
    ds41_generation_delta dummy;
    if (!out) out = &dummy;
    step_reset(g, out);
    if (g->finish == DS41_GENERATION_RUNNING) {
        g->finish = DS41_GENERATION_ABORTED;
        split_advance(g, false);
        if (finalize(g, err) != 0) return -1;
        if (g->step_reasoning.oom || g->step_content.oom || deltas_reserve(g) != 0) return oom(err);
        step_fill(g, out);
        return 0;
    }
    out->finished = true;
    out->finish = g->finish;
    out->reasoning = out->content = "";
    return 0;
}
