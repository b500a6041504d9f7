/* V4.1 chat encoding: generated text -> assistant message (parse_message_from_completion_text,
 * strict and lenient), and the message as JSON.  The renderer is chat_render.c. */
#include "engine/text/chat.h"
#include "engine/text/chat_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/pyjson.h"

/* ---- parse_message_from_completion_text ---- */

/* The stop strings of the parser. */
enum stop_id {
    S_THINK_END,
    S_TOOL_CALLS_START,
    S_EOS,
    S_CALLS_END,
    S_INVOKE_START,
    S_INVOKE_END,
    S_PARAM_START,
    S_PARAM_END,
    N_STOPS
};
static const char *const STOP_TEXT[N_STOPS] = {DS41_CHAT_THINK_END, TOOL_CALLS_START, DS41_CHAT_EOS, CALLS_END,
                                               INVOKE_START,        INVOKE_END,       PARAM_START,   PARAM_END};
#define NOT_FOUND SIZE_MAX

/* The text and, per stop string, its last search: a search from a later position reuses the hit
 * (or the absence) when it still lies ahead, so a long text with many parameters is scanned in
 * linear rather than quadratic time. */
typedef struct text_view {
    const char *s;
    size_t len;
    bool known[N_STOPS];
    size_t from[N_STOPS];
    size_t at[N_STOPS];
} text_view;

static text_view text_view_of(const char *s, size_t len) {
    text_view t = {.s = s, .len = len};
    return t;
}

static size_t find_stop(text_view *t, int id, size_t pos) {
    if (t->known[id] && t->from[id] <= pos && (t->at[id] == NOT_FOUND || t->at[id] >= pos)) return t->at[id];
    const char *hit = pos <= t->len ? memmem(t->s + pos, t->len - pos, STOP_TEXT[id], strlen(STOP_TEXT[id])) : NULL;
    t->known[id] = true;
    t->from[id] = pos;
    t->at[id] = hit ? (size_t)(hit - t->s) : NOT_FOUND;
    return t->at[id];
}

enum { STOP_NONE = -1 };

/* _read_until_stop: from pos, the earliest of the stops ids[] (the first listed wins a tie).
 * Sets the content span [*c0, *c1) and returns the index in ids[] of the stop found (STOP_NONE:
 * content runs to the end); *pos moves past the stop. */
static int read_until(text_view *t, size_t *pos, const int *ids, int n_ids, size_t *c0, size_t *c1) {
    size_t best = t->len;
    int which = STOP_NONE;
    for (int k = 0; k < n_ids; k++) {
        size_t at = find_stop(t, ids[k], *pos);
        if (at != NOT_FOUND && at < best) {
            best = at;
            which = k;
        }
    }
    *c0 = *pos;
    *c1 = best;
    *pos = which == STOP_NONE ? t->len : best + strlen(STOP_TEXT[ids[which]]);
    return which;
}

/* "PREFIX'quoted'SUFFIX" with quoted cut to fit the error buffer. */
static int fail_quote(ds41_error *err, const char *prefix, const char *q, size_t q_len, const char *suffix) {
    const char *dots = "";
    if (q_len > MAX_QUOTE) {
        q_len = ds41_utf8_cut(q, q_len, MAX_QUOTE);
        dots = "...";
    }
    return ds41_fail(err, "%s'%.*s%s'%s", prefix, (int)q_len, q, dots, suffix);
}

/* Python's str.isspace() (what \s matches in a str pattern) for the code point at s[i]; returns
 * its byte length, 0 if it is not whitespace. */
static size_t python_space(const char *s, size_t len, size_t i) {
    const unsigned char *u = (const unsigned char *)s + i;
    size_t left = len - i;
    if ((u[0] >= 0x09 && u[0] <= 0x0D) || (u[0] >= 0x1C && u[0] <= 0x20)) return 1;
    if (left >= 2 && u[0] == 0xC2 && (u[1] == 0x85 || u[1] == 0xA0)) return 2;
    if (left >= 3) {
        if (u[0] == 0xE1 && u[1] == 0x9A && u[2] == 0x80) return 3; /* U+1680 */
        if (u[0] == 0xE2 && u[1] == 0x80 &&
            ((u[2] >= 0x80 && u[2] <= 0x8A) || u[2] == 0xA8 || u[2] == 0xA9 || u[2] == 0xAF))
            return 3;                                                   /* U+2000..200A, 2028, 2029, 202F */
        if (u[0] == 0xE2 && u[1] == 0x81 && u[2] == 0x9F) return 3; /* U+205F */
        if (u[0] == 0xE3 && u[1] == 0x80 && u[2] == 0x80) return 3; /* U+3000 */
    }
    return 0;
}

/* Whether `$` (no MULTILINE) matches at p in c[0..n): at the end or before a final newline. */
static bool dollar_at(const char *c, size_t n, size_t p) {
    return p == n || (p + 1 == n && c[p] == '\n');
}

/* re.findall(r'^\s*name="(.*?)">\n$', c, DOTALL) has exactly one match: *name = its group. */
static bool match_invoke_head(const char *c, size_t n, size_t *name0, size_t *name1) {
    size_t i = 0, w;
    while (i < n && (w = python_space(c, n, i)) > 0) i += w;
    if (n - i < 6 || memcmp(c + i, "name=\"", 6) != 0) return false;
    size_t j = i + 6;
    for (size_t p = j; p + 3 <= n; p++) {
        if (memcmp(c + p, "\">\n", 3) == 0 && dollar_at(c, n, p + 3)) {
            *name0 = j;
            *name1 = p;
            return true;
        }
    }
    return false;
}

/* re.findall(r'^ name="(.*?)" string="(true|false)">(.*?)<$', c, DOTALL) has exactly one match. */
static bool match_param(const char *c, size_t n, size_t *name0, size_t *name1, bool *is_string, size_t *v0,
                        size_t *v1) {
    if (n < 7 || memcmp(c, " name=\"", 7) != 0) return false;
    size_t q;
    if (n >= 1 && c[n - 1] == '<') q = n - 1;
    else if (n >= 2 && c[n - 2] == '<' && c[n - 1] == '\n') q = n - 2;
    else return false;
    static const char t_lit[] = "\" string=\"true\">", f_lit[] = "\" string=\"false\">";
    for (size_t p = 7; p < n; p++) {
        size_t lit = 0;
        if (n - p >= sizeof t_lit - 1 && memcmp(c + p, t_lit, sizeof t_lit - 1) == 0) lit = sizeof t_lit - 1;
        else if (n - p >= sizeof f_lit - 1 && memcmp(c + p, f_lit, sizeof f_lit - 1) == 0) lit = sizeof f_lit - 1;
        if (!lit) continue;
        /* The first place the literal matches decides: a later one only starts the value later. */
        if (p + lit > q) return false;
        *name0 = 7;
        *name1 = p;
        *is_string = lit == sizeof t_lit - 1;
        *v0 = p + lit;
        *v1 = q;
        return true;
    }
    return false;
}

static char *dup_span(const char *s, size_t n) {
    char *p = malloc(n + 1);
    if (!p) return NULL;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

typedef struct param_span {
    size_t name0, name1;
    size_t v0, v1;
    bool is_string;
} param_span;

/* The parameter names of one invoke, for the duplicate check (Python keeps them in a dict): an
 * open-addressing set of indices into params[], rebuilt as it grows. */
typedef struct name_set {
    size_t *slot; /* index + 1, 0 = empty */
    size_t cap;   /* a power of two */
} name_set;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603u; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211u;
    return h;
}

static bool same_name(const char *s, const param_span *a, const param_span *b) {
    return a->name1 - a->name0 == b->name1 - b->name0 && memcmp(s + a->name0, s + b->name0, a->name1 - a->name0) == 0;
}

/* Adds params[idx]; returns 1 if the name was there already, 0 if added, -1 out of memory. */
static int name_set_add(name_set *set, const char *s, const param_span *params, size_t idx) {
    if ((idx + 1) * 2 > set->cap) {
        size_t cap = set->cap ? set->cap * 2 : 16;
        size_t *slot = calloc(cap, sizeof *slot);
        if (!slot) return -1;
        for (size_t i = 0; i < set->cap; i++) {
            if (!set->slot[i]) continue;
            const param_span *p = &params[set->slot[i] - 1];
            size_t h = (size_t)hash_bytes(s + p->name0, p->name1 - p->name0) & (cap - 1);
            while (slot[h]) h = (h + 1) & (cap - 1);
            slot[h] = set->slot[i];
        }
        free(set->slot);
        set->slot = slot;
        set->cap = cap;
    }
    const param_span *p = &params[idx];
    size_t h = (size_t)hash_bytes(s + p->name0, p->name1 - p->name0) & (set->cap - 1);
    while (set->slot[h]) {
        if (same_name(s, &params[set->slot[h] - 1], p)) return 1;
        h = (h + 1) & (set->cap - 1);
    }
    set->slot[h] = idx + 1;
    return 0;
}

static void free_calls(ds41_chat_tool_call *calls, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(calls[i].name);
        free(calls[i].tool_namespace);
        free(calls[i].arguments);
    }
    free(calls);
}

/* decode_dsml_to_arguments plus the namespace split: one call from its name and parameters. */
static int make_call(const text_view *t, size_t name0, size_t name1, const param_span *params, size_t n_params,
                     ds41_chat_tool_call *call, ds41_error *err) {
    *call = (ds41_chat_tool_call){0};
    ds41_buf args = {0};
    ds41_buf_putc(&args, '{');
    for (size_t i = 0; i < n_params; i++) {
        if (i) ds41_buf_puts(&args, ", ");
        ds41_py_dumps_string(t->s + params[i].name0, params[i].name1 - params[i].name0, &args);
        ds41_buf_puts(&args, ": ");
        if (params[i].is_string) ds41_py_dumps_string(t->s + params[i].v0, params[i].v1 - params[i].v0, &args);
        else ds41_buf_put(&args, t->s + params[i].v0, params[i].v1 - params[i].v0);
    }
    ds41_buf_putc(&args, '}');
    call->arguments = ds41_buf_take(&args, &call->arguments_len);
    const char *name = t->s + name0;
    size_t name_len = name1 - name0;
    const char *sep = memmem(name, name_len, "::", 2);
    if (sep) {
        call->tool_namespace_len = (size_t)(sep - name);
        call->tool_namespace = dup_span(name, call->tool_namespace_len);
        name_len -= call->tool_namespace_len + 2;
        name = sep + 2;
    }
    call->name = dup_span(name, name_len);
    call->name_len = name_len;
    if (!call->arguments || !call->name || (sep && !call->tool_namespace)) {
        free(call->arguments);
        free(call->name);
        free(call->tool_namespace);
        *call = (ds41_chat_tool_call){0};
        return oom(err);
    }
    return 0;
}

/* parse_tool_calls from *pos (just after "\n\n<｜DSML｜ calls"). */
static int parse_tool_calls(text_view *t, size_t *pos, ds41_chat_tool_call **calls_out, size_t *n_out,
                            ds41_error *err) {
    static const int call_stops[] = {S_INVOKE_START, S_CALLS_END};
    static const int inner_stops[] = {S_PARAM_START, S_INVOKE_END};
    static const int param_stops[] = {S_PARAM_END};
    ds41_chat_tool_call *calls = NULL;
    size_t n_calls = 0, cap_calls = 0;
    param_span *params = NULL;
    size_t cap_params = 0;
    name_set names = {0};
    size_t c0, c1;
    int rc = -1;
    while (*pos < t->len) {
        int stop = read_until(t, pos, call_stops, 2, &c0, &c1);
        if (c1 - c0 != 2 || memcmp(t->s + c0, ">\n", 2) != 0) {
            fail_quote(err, "Tool call format error: expected '>\\n' but got ", t->s + c0, c1 - c0, "");
            goto done;
        }
        if (stop == 1) break;
        if (stop == STOP_NONE) {
            ds41_fail(err, "Missing special token in tool calls");
            goto done;
        }
        stop = read_until(t, pos, inner_stops, 2, &c0, &c1);
        size_t name0, name1;
        if (!match_invoke_head(t->s + c0, c1 - c0, &name0, &name1)) {
            fail_quote(err, "Tool name format error: ", t->s + c0, c1 - c0, "");
            goto done;
        }
        name0 += c0;
        name1 += c0;
        size_t n_params = 0;
        if (names.cap) memset(names.slot, 0, names.cap * sizeof *names.slot);
        while (stop == 0) {
            read_until(t, pos, param_stops, 1, &c0, &c1);
            param_span ps;
            if (!match_param(t->s + c0, c1 - c0, &ps.name0, &ps.name1, &ps.is_string, &ps.v0, &ps.v1)) {
                fail_quote(err, "Parameter format error: ", t->s + c0, c1 - c0, "");
                goto done;
            }
            ps.name0 += c0;
            ps.name1 += c0;
            ps.v0 += c0;
            ps.v1 += c0;
            if (n_params == cap_params) {
                size_t nc = cap_params ? cap_params * 2 : 8;
                param_span *np = realloc(params, nc * sizeof *np);
                if (!np) {
                    oom(err);
                    goto done;
                }
                params = np;
                cap_params = nc;
            }
            params[n_params] = ps;
            int dup = name_set_add(&names, t->s, params, n_params);
            if (dup < 0) {
                oom(err);
                goto done;
            }
            if (dup) {
                fail_quote(err, "Duplicate parameter name: ", t->s + ps.name0, ps.name1 - ps.name0, "");
                goto done;
            }
            n_params++;
            stop = read_until(t, pos, inner_stops, 2, &c0, &c1);
            if (c1 - c0 != 2 || memcmp(t->s + c0, ">\n", 2) != 0) {
                fail_quote(err, "Parameter format error: expected '>\\n' but got ", t->s + c0, c1 - c0, "");
                goto done;
            }
        }
        if (n_calls == cap_calls) {
            size_t nc = cap_calls ? cap_calls * 2 : 4;
            ds41_chat_tool_call *np = realloc(calls, nc * sizeof *np);
            if (!np) {
                oom(err);
                goto done;
            }
            calls = np;
            cap_calls = nc;
        }
        if (make_call(t, name0, name1, params, n_params, &calls[n_calls], err) != 0) goto done;
        n_calls++;
    }
    rc = 0;
done:
    free(params);
    free(names.slot);
    if (rc == 0) {
        *calls_out = calls;
        *n_out = n_calls;
    } else {
        free_calls(calls, n_calls);
    }
    return rc;
}

void ds41_chat_completion_free(ds41_chat_completion *c) {
    if (!c) return;
    free(c->reasoning_content);
    free(c->content);
    free_calls(c->tool_calls, c->n_tool_calls);
    *c = (ds41_chat_completion){0};
}

static int set_span(char **dst, size_t *dst_len, const char *s, size_t n, ds41_error *err) {
    *dst = dup_span(s, n);
    *dst_len = n;
    return *dst ? 0 : oom(err);
}

static int parse_strict(text_view *t, ds41_chat_mode mode, ds41_chat_completion *out, ds41_error *err) {
    static const int think_stops[] = {S_THINK_END, S_TOOL_CALLS_START};
    static const int content_stops[] = {S_EOS, S_TOOL_CALLS_START};
    static const int eos_stop[] = {S_EOS};
    size_t pos = 0, r0 = 0, r1 = 0, c0, c1;
    if (mode == DS41_CHAT_MODE_THINKING) {
        if (read_until(t, &pos, think_stops, 2, &r0, &r1) != 0)
            return ds41_fail(err, "Invalid thinking format: missing </think>");
    }
    int stop = read_until(t, &pos, content_stops, 2, &c0, &c1);
    bool tool_calling = stop == 1;
    if (!tool_calling && stop != 0) return ds41_fail(err, "Invalid format: missing EOS token");
    ds41_chat_tool_call *calls = NULL;
    size_t n_calls = 0;
    if (tool_calling) {
        if (parse_tool_calls(t, &pos, &calls, &n_calls, err) != 0) return -1;
        size_t e0, e1;
        read_until(t, &pos, eos_stop, 1, &e0, &e1);
        if (e1 > e0) {
            free_calls(calls, n_calls);
            return ds41_fail(err, "Unexpected content after tool calls");
        }
    }
    if (pos != t->len) {
        free_calls(calls, n_calls);
        return ds41_fail(err, "Unexpected content at end");
    }
    static const char *const specials[] = {DS41_CHAT_BOS, DS41_CHAT_EOS, DS41_CHAT_THINK_START, DS41_CHAT_THINK_END,
                                           DS41_CHAT_DSML};
    for (size_t k = 0; k < 5; k++) {
        size_t n = strlen(specials[k]);
        if (memmem(t->s + c0, c1 - c0, specials[k], n) || memmem(t->s + r0, r1 - r0, specials[k], n)) {
            free_calls(calls, n_calls);
            return ds41_fail(err, "Unexpected special token '%s' in content", specials[k]);
        }
    }
    out->tool_calls = calls;
    out->n_tool_calls = n_calls;
    if (set_span(&out->reasoning_content, &out->reasoning_content_len, t->s + r0, r1 - r0, err) != 0 ||
        set_span(&out->content, &out->content_len, t->s + c0, c1 - c0, err) != 0) {
        ds41_chat_completion_free(out);
        return -1;
    }
    return 0;
}

int ds41_chat_parse_completion(const char *text, size_t len, ds41_chat_mode mode, ds41_chat_completion *out,
                               ds41_error *err) {
    if (!out) return ds41_fail(err, "chat parse: no output");
    *out = (ds41_chat_completion){0};
    if (!text && len) return ds41_fail(err, "chat parse: no text");
    size_t bad;
    if (len && !ds41_utf8_valid(text, len, &bad))
        return ds41_fail(err, "completion text is not valid UTF-8 (byte %zu)", bad);
    text_view tv = text_view_of(text ? text : "", len);
    return parse_strict(&tv, mode, out, err);
}

/* The lenient salvage of a text the strict parser rejected (see chat.h). */
static int parse_salvage(text_view *t, ds41_chat_mode mode, ds41_chat_completion *out, ds41_error *err) {
    static const int think_stops[] = {S_THINK_END, S_TOOL_CALLS_START, S_EOS};
    static const int content_stops[] = {S_EOS, S_TOOL_CALLS_START};
    static const int eos_stop[] = {S_EOS};
    size_t pos = 0, r0 = 0, r1 = 0, c0, c1;
    if (mode == DS41_CHAT_MODE_THINKING) {
        int stop = read_until(t, &pos, think_stops, 3, &r0, &r1);
        if (stop == 1 || stop == 2) pos = r1; /* the block / EOS is read again below */
    }
    ds41_buf content = {0};
    int stop = read_until(t, &pos, content_stops, 2, &c0, &c1);
    ds41_buf_put(&content, t->s + c0, c1 - c0);
    if (stop == 1) {
        size_t block0 = c1, after = pos;
        ds41_chat_tool_call *calls = NULL;
        size_t n_calls = 0;
        ds41_error ignored;
        if (parse_tool_calls(t, &after, &calls, &n_calls, &ignored) == 0) {
            size_t e0, e1;
            read_until(t, &after, eos_stop, 1, &e0, &e1);
            ds41_buf_put(&content, t->s + e0, e1 - e0);
            out->tool_calls = calls;
            out->n_tool_calls = n_calls;
        } else {
            size_t scan = block0, e0, e1;
            read_until(t, &scan, eos_stop, 1, &e0, &e1);
            ds41_buf_put(&content, t->s + e0, e1 - e0);
        }
    }
    out->content = ds41_buf_take(&content, &out->content_len);
    if (!out->content || set_span(&out->reasoning_content, &out->reasoning_content_len, t->s + r0, r1 - r0, err) != 0) {
        ds41_chat_completion_free(out);
        return oom(err);
    }
    out->repaired = true;
    return 0;
}

int ds41_chat_parse_completion_lenient(const char *text, size_t len, ds41_chat_mode mode,
                                       ds41_chat_completion *out, ds41_error *note) {
    if (!out) return ds41_fail(note, "chat parse: no output");
    *out = (ds41_chat_completion){0};
    if (!text && len) return ds41_fail(note, "chat parse: no text");
    ds41_buf clean = {0};
    text_view t = text_view_of(text ? text : "", len);
    size_t bad;
    bool sanitized = len && !ds41_utf8_valid(text, len, &bad);
    if (sanitized) {
        ds41_utf8_sanitize(text, len, &clean);
        if (clean.oom) {
            ds41_buf_free(&clean);
            return oom(note);
        }
        t = text_view_of(clean.data, clean.len);
    }
    ds41_error strict_err;
    int rc;
    if (parse_strict(&t, mode, out, &strict_err) == 0) {
        out->repaired = sanitized;
        if (sanitized && note) ds41_fail(note, "completion text is not valid UTF-8 (byte %zu)", bad);
        rc = 0;
    } else if (strcmp(strict_err.msg, "out of memory") == 0) {
        rc = oom(note);
    } else {
        if (note) *note = strict_err;
        rc = parse_salvage(&t, mode, out, note);
    }
    ds41_buf_free(&clean);
    return rc;
}

json_t *ds41_chat_completion_to_message(const ds41_chat_completion *c, ds41_error *err) {
    if (!c) {
        ds41_fail(err, "chat message: no completion");
        return NULL;
    }
    json_t *msg = json_object();
    json_t *calls = json_array();
    if (!msg || !calls) {
        json_decref(calls);
        goto fail;
    }
    /* json_object_set_new / json_array_append_new take the reference even when they fail. */
    if (json_object_set_new(msg, "role", json_string("assistant")) != 0 ||
        json_object_set_new(msg, "content", json_stringn(c->content ? c->content : "", c->content_len)) != 0 ||
        json_object_set_new(msg, "reasoning_content",
                            json_stringn(c->reasoning_content ? c->reasoning_content : "",
                                         c->reasoning_content_len)) != 0 ||
        json_object_set_new(msg, "tool_calls", calls) != 0)
        goto fail;
    for (size_t i = 0; i < c->n_tool_calls; i++) {
        const ds41_chat_tool_call *tc = &c->tool_calls[i];
        json_t *call = json_object();
        if (json_array_append_new(calls, call) != 0 || json_object_set_new(call, "type", json_string("function")) != 0)
            goto fail;
        if (tc->tool_namespace &&
            json_object_set_new(call, "namespace", json_stringn(tc->tool_namespace, tc->tool_namespace_len)) != 0)
            goto fail;
        json_t *fn = json_object();
        if (json_object_set_new(call, "function", fn) != 0 ||
            json_object_set_new(fn, "name", json_stringn(tc->name, tc->name_len)) != 0 ||
            json_object_set_new(fn, "arguments", json_stringn(tc->arguments, tc->arguments_len)) != 0)
            goto fail;
    }
    return msg;
fail:
    json_decref(msg);
    ds41_fail(err, "chat message: out of memory or text that is not valid UTF-8");
    return NULL;
}
