/* The Anthropic Messages API (see ipc/api_anthropic.h): the request parser
 * that turns a Messages body into the chat route's ds41_api_request, the
 * message builder that turns the service's events into content blocks and
 * SSE events, and the two routes. */
#include "ipc/api_anthropic.h"

#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "config/json_util.h"
#include "config/utf8.h"
#include "ipc/api_internal.h"

#define MAX_STOP 16
#define MAX_STOP_BYTES 1024

/* ----------------------------------------------------------- error helpers */

#define bad ds41_api_field_error
#define type_error ds41_api_type_error

static int oom(ds41_svc_error *err) {
    return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
}

/* obj[key] when present and not null, else NULL. */
static json_t *get(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return v && !json_is_null(v) ? v : NULL;
}

static void sub(char *out, size_t n, const char *prefix, const char *key) {
    if (snprintf(out, n, "%s.%s", prefix, key) < 0) out[0] = 0;
}

static void idx(char *out, size_t n, const char *prefix, size_t i) {
    if (snprintf(out, n, "%s[%zu]", prefix, i) < 0) out[0] = 0;
}

/* obj[key], a required object (its path: prefix.key). */
static int get_object(const json_t *obj, const char *prefix, const char *key, const char *want, json_t **out,
                      ds41_svc_error *err) {
    char p[220];
    sub(p, sizeof p, prefix, key);
    *out = get(obj, key);
    if (!*out) return bad(err, p, "missing_field", "'%s' is required", p);
    return json_is_object(*out) ? 0 : type_error(err, p, want, *out);
}

/* cache_control: accepted and ignored (the prefix cache is automatic), but it must look like one. */
static int check_cache_control(const json_t *block, const char *path, ds41_svc_error *err) {
    json_t *cc = get(block, "cache_control");
    if (!cc) return 0;
    char p[200];
    sub(p, sizeof p, path, "cache_control");
    if (!json_is_object(cc)) return type_error(err, p, "an object", cc);
    static const char *const keys[] = {"type", "ttl", NULL};
    const char *s;
    return ds41_api_check_keys(cc, p, keys, err) || ds41_api_get_string(cc, p, "type", true, &s, err) ||
                   ds41_api_get_string(cc, p, "ttl", false, &s, err)
               ? -1
               : 0;
}

/* A text block: check its keys, append sep and its "text" to out. */
static int text_block(const json_t *b, const char *path, const char *sep, ds41_buf *out,
                      ds41_svc_error *err) {
    const char *text;
    static const char *const keys[] = {"type", "text", "cache_control", "citations", NULL};
    if (ds41_api_check_keys(b, path, keys, err) || ds41_api_get_string(b, path, "text", true, &text, err) ||
        check_cache_control(b, path, err))
        return -1;
    json_t *cit = get(b, "citations");
    if (cit && !(json_is_array(cit) && json_array_size(cit) == 0)) {
        char p[200];
        sub(p, sizeof p, path, "citations");
        return bad(err, p, "unsupported_parameter", "'%s' is not supported: there are no documents to cite",
                   p);
    }
    ds41_buf_puts(out, sep);
    ds41_buf_put(out, text, json_string_length(json_object_get(b, "text")));
    return 0;
}

/* content[i]: its path into p (200 bytes) and its "type" (a required string). */
static int block_at(const json_t *content, size_t i, const char *cpath, char *p, const char **type,
                    ds41_svc_error *err) {
    idx(p, 200, cpath, i);
    const json_t *b = json_array_get(content, i);
    if (!json_is_object(b)) return type_error(err, p, "an object", b);
    return ds41_api_get_string(b, p, "type", true, type, err);
}

static int unsupported_block(const char *path, const char *type, const char *role, ds41_svc_error *err) {
    char p[200];
    sub(p, sizeof p, path, "type");
    static const char *const media[] = {"image", "document", "search_result", "container_upload", NULL};
    for (size_t i = 0; media[i]; i++)
        if (strcmp(type, media[i]) == 0)
            return bad(err, p, "unsupported_parameter",
                       "'%s': '%s' blocks are not supported: this model takes text only", p, type);
    if (strstr(type, "server_tool") || strstr(type, "web_search") || strstr(type, "code_execution") ||
        strstr(type, "mcp_"))
        return bad(err, p, "unsupported_parameter",
                   "'%s': '%s' blocks are not supported: there are no server tools", p, type);
    return bad(err, p, "invalid_value", "'%s': '%s' is not a content block type of a %s message", p, type,
               role);
}

/* A string or an array of text blocks, joined, into *out (a new json string). */
static int text_or_blocks(const json_t *v, const char *path, json_t **out, ds41_svc_error *err) {
    *out = NULL;
    if (json_is_string(v)) {
        *out = json_incref((json_t *)v);
        return 0;
    }
    if (!json_is_array(v)) return type_error(err, path, "a string or an array of text blocks", v);
    ds41_buf b = {0};
    size_t i;
    json_t *blk;
    json_array_foreach(v, i, blk) {
        char p[200];
        const char *type;
        if (block_at(v, i, path, p, &type, err)) goto fail;
        if (strcmp(type, "text") != 0) {
            unsupported_block(p, type, "text", err);
            goto fail;
        }
        if (text_block(blk, p, i ? "\n\n" : "", &b, err)) goto fail;
    }
    if (b.oom) {
        ds41_buf_free(&b);
        return oom(err);
    }
    *out = json_stringn(b.data ? b.data : "", b.len);
    ds41_buf_free(&b);
    return *out ? 0 : oom(err);
fail:
    ds41_buf_free(&b);
    return -1;
}

/* ---------------------------------------------------------------- messages */

/* Append {"role": role, "content": text} to out. */
static int push_text(json_t *out, const char *role, json_t *text, ds41_svc_error *err) {
    json_t *m = json_pack("{s:s,s:O}", "role", role, "content", text);
    return !m || json_array_append_new(out, m) ? oom(err) : 0;
}

static int user_message(const json_t *content, const char *cpath, const json_t *tool_ids, json_t *out,
                        ds41_svc_error *err) {
    if (json_is_string(content)) return push_text(out, "user", (json_t *)content, err);
    ds41_buf text = {0};
    bool has_text = false;
    size_t i;
    json_t *blk;
    json_array_foreach(content, i, blk) {
        char p[200];
        const char *type;
        if (block_at(content, i, cpath, p, &type, err)) goto fail;
        if (strcmp(type, "text") == 0) {
            if (text_block(blk, p, has_text ? "\n\n" : "", &text, err)) goto fail;
            has_text = true;
        } else if (strcmp(type, "tool_result") == 0) {
            static const char *const keys[] = {"type",     "tool_use_id",   "content",
                                               "is_error", "cache_control", NULL};
            const char *id;
            bool has_err = false, is_err = false;
            if (ds41_api_check_keys(blk, p, keys, err) ||
                ds41_api_get_string(blk, p, "tool_use_id", true, &id, err) ||
                ds41_api_get_bool(blk, p, "is_error", &has_err, &is_err, err) ||
                check_cache_control(blk, p, err))
                goto fail;
            bool known = false;
            for (size_t k = 0; k < json_array_size(tool_ids); k++)
                known = known || strcmp(json_string_value(json_array_get(tool_ids, k)), id) == 0;
            if (!known) {
                char ip[220];
                sub(ip, sizeof ip, p, "tool_use_id");
                bad(err, ip, "invalid_value",
                    "'%s': '%.64s' is not the id of a tool_use block of an earlier assistant turn", ip, id);
                goto fail;
            }
            /* Text before a tool result stays before it. */
            if (has_text) {
                json_t *s = json_stringn(text.data ? text.data : "", text.len);
                int rc = s ? push_text(out, "user", s, err) : oom(err);
                json_decref(s);
                if (rc) goto fail;
                ds41_buf_free(&text);
                has_text = false;
            }
            json_t *c = get(blk, "content"), *s = NULL;
            char cp[220];
            sub(cp, sizeof cp, p, "content");
            if (c && text_or_blocks(c, cp, &s, err)) goto fail;
            if (is_err) {
                ds41_buf e = {0};
                ds41_buf_puts(&e, "Error: ");
                if (s) ds41_buf_put(&e, json_string_value(s), json_string_length(s));
                json_decref(s);
                s = e.oom ? NULL : json_stringn(e.data, e.len);
                ds41_buf_free(&e);
            } else if (!s) {
                s = json_string("");
            }
            json_t *m =
                s ? json_pack("{s:s,s:o,s:s}", "role", "tool", "content", s, "tool_call_id", id) : NULL;
            if (!m || json_array_append_new(out, m)) {
                oom(err);
                goto fail;
            }
        } else {
            unsupported_block(p, type, "user", err);
            goto fail;
        }
    }
    if (has_text || json_array_size(content) == 0) {
        json_t *s = json_stringn(text.data ? text.data : "", text.len);
        int rc = s ? push_text(out, "user", s, err) : oom(err);
        json_decref(s);
        if (rc) goto fail;
    }
    ds41_buf_free(&text);
    return 0;
fail:
    ds41_buf_free(&text);
    return -1;
}

static int assistant_message(const json_t *content, const char *cpath, json_t *tool_ids, json_t *out,
                             ds41_svc_error *err) {
    if (json_is_string(content)) return push_text(out, "assistant", (json_t *)content, err);
    ds41_buf text = {0}, reasoning = {0};
    bool has_reasoning = false;
    json_t *calls = json_array();
    if (!calls) return oom(err);
    size_t i;
    json_t *blk;
    json_array_foreach(content, i, blk) {
        char p[200];
        const char *type;
        if (block_at(content, i, cpath, p, &type, err)) goto fail;
        if (strcmp(type, "text") == 0) {
            if (text_block(blk, p, "", &text, err)) goto fail;
        } else if (strcmp(type, "thinking") == 0) {
            static const char *const keys[] = {"type", "thinking", "signature", NULL};
            const char *t, *sig;
            if (ds41_api_check_keys(blk, p, keys, err) ||
                ds41_api_get_string(blk, p, "thinking", true, &t, err) ||
                ds41_api_get_string(blk, p, "signature", false, &sig, err))
                goto fail;
            ds41_buf_put(&reasoning, t, json_string_length(json_object_get(blk, "thinking")));
            has_reasoning = true;
        } else if (strcmp(type, "redacted_thinking") == 0) {
            static const char *const keys[] = {"type", "data", NULL};
            const char *d;
            if (ds41_api_check_keys(blk, p, keys, err) || ds41_api_get_string(blk, p, "data", true, &d, err))
                goto fail;
        } else if (strcmp(type, "tool_use") == 0) {
            static const char *const keys[] = {"type", "id", "name", "input", "cache_control", NULL};
            const char *id, *name;
            if (ds41_api_check_keys(blk, p, keys, err) || ds41_api_get_string(blk, p, "id", true, &id, err) ||
                ds41_api_get_string(blk, p, "name", true, &name, err) || check_cache_control(blk, p, err))
                goto fail;
            json_t *input;
            if (get_object(blk, p, "input", "an object", &input, err)) goto fail;
            if (*id == 0) {
                char dp[220];
                sub(dp, sizeof dp, p, "id");
                bad(err, dp, "invalid_value", "'%s' must not be empty", dp);
                goto fail;
            }
            json_t *call = json_pack("{s:s,s:s,s:{s:s,s:O}}", "id", id, "type", "function", "function",
                                     "name", name, "arguments", input);
            if (!call || json_array_append_new(calls, call) ||
                json_array_append_new(tool_ids, json_string(id))) {
                oom(err);
                goto fail;
            }
        } else {
            unsupported_block(p, type, "assistant", err);
            goto fail;
        }
    }
    json_t *m = json_object();
    if (!m || json_array_append_new(out, m) || text.oom || reasoning.oom) {
        oom(err);
        goto fail;
    }
    bool ok = !ds41_json_set_str(m, "role", "assistant") &&
              !ds41_json_set_new(m, "content",
                                 text.len || json_array_size(calls) == 0
                                     ? json_stringn(text.data ? text.data : "", text.len)
                                     : json_null()) &&
              (!has_reasoning ||
               !ds41_json_set_new(m, "reasoning_content",
                                  json_stringn(reasoning.data ? reasoning.data : "", reasoning.len))) &&
              (json_array_size(calls) == 0 || !json_object_set(m, "tool_calls", calls));
    json_decref(calls);
    ds41_buf_free(&text);
    ds41_buf_free(&reasoning);
    return ok ? 0 : oom(err);
fail:
    json_decref(calls);
    ds41_buf_free(&text);
    ds41_buf_free(&reasoning);
    return -1;
}

/* system + messages -> the chat route's normalized messages (OpenAI roles). */
static int parse_messages(const json_t *root, char **out_json, ds41_svc_error *err) {
    *out_json = NULL;
    json_t *msgs = get(root, "messages");
    if (!msgs) return bad(err, "messages", "missing_field", "'messages' is required");
    if (!json_is_array(msgs)) return type_error(err, "messages", "an array", msgs);
    if (json_array_size(msgs) == 0)
        return bad(err, "messages", "invalid_value", "'messages' must not be empty");
    json_t *out = json_array(), *tool_ids = json_array(), *sys = NULL;
    if (!out || !tool_ids) goto nomem;
    json_t *s = get(root, "system");
    if (s) {
        if (text_or_blocks(s, "system", &sys, err)) goto fail;
        if (push_text(out, "system", sys, err)) goto fail;
    }
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        char mp[48], cp[64], rp[64];
        idx(mp, sizeof mp, "messages", i);
        if (!json_is_object(m)) {
            type_error(err, mp, "an object", m);
            goto fail;
        }
        static const char *const keys[] = {"role", "content", NULL};
        const char *role;
        if (ds41_api_check_keys(m, mp, keys, err) || ds41_api_get_string(m, mp, "role", true, &role, err))
            goto fail;
        bool user = strcmp(role, "user") == 0;
        if (!user && strcmp(role, "assistant") != 0) {
            sub(rp, sizeof rp, mp, "role");
            bad(err, rp, "invalid_value",
                "'%s' must be 'user' or 'assistant', not '%.32s' (the system prompt is 'system')", rp, role);
            goto fail;
        }
        sub(cp, sizeof cp, mp, "content");
        json_t *c = get(m, "content");
        if (!c) {
            bad(err, cp, "missing_field", "'%s' is required", cp);
            goto fail;
        }
        if (!json_is_string(c) && !json_is_array(c)) {
            type_error(err, cp, "a string or an array of content blocks", c);
            goto fail;
        }
        if (user ? user_message(c, cp, tool_ids, out, err) : assistant_message(c, cp, tool_ids, out, err))
            goto fail;
        /* A final assistant turn is a prefill: the answer continues it (DeepSeek's prefix). */
        if (!user && i + 1 == json_array_size(msgs) &&
            json_object_set_new(json_array_get(out, json_array_size(out) - 1), "prefix", json_true()))
            goto nomem;
    }
    *out_json = ds41_json_dump(out, NULL);
    if (!*out_json) goto nomem;
    json_decref(out);
    json_decref(tool_ids);
    json_decref(sys);
    return 0;
nomem:
    oom(err);
fail:
    json_decref(out);
    json_decref(tool_ids);
    json_decref(sys);
    return -1;
}

/* ------------------------------------------------------------------- tools */

/* "tools[i].function.parameters..." (the chat checker's path) -> "tools[i].input_schema...". */
static void rename_tool_param(ds41_svc_error *err) {
    char *f = strstr(err->param, ".function.");
    if (!f) return;
    const char *tail = f + strlen(".function.");
    bool params = strncmp(tail, "parameters", 10) == 0;
    char out[sizeof err->param + 16];
    int n = snprintf(out, sizeof out, "%.*s.%s%s", (int)(f - err->param), err->param,
                     params ? "input_schema" : "", params ? tail + 10 : tail);
    if (n > 0) {
        size_t len = strnlen(out, sizeof err->param - 1);
        memcpy(err->param, out, len);
        err->param[len] = 0;
    }
}

static int parse_tools(const json_t *root, ds41_api_request *r, json_t **names, ds41_svc_error *err) {
    *names = NULL;
    json_t *tools = get(root, "tools");
    if (!tools) return 0;
    if (!json_is_array(tools)) return type_error(err, "tools", "an array", tools);
    json_t *conv = json_array();
    if (!conv) return oom(err);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        char p[48];
        idx(p, sizeof p, "tools", i);
        if (!json_is_object(t)) {
            json_decref(conv);
            return type_error(err, p, "an object", t);
        }
        static const char *const keys[] = {"type",         "name",          "description",
                                           "input_schema", "cache_control", NULL};
        const char *type, *name, *desc;
        if (ds41_api_get_string(t, p, "type", false, &type, err)) goto fail;
        if (type && strcmp(type, "custom") != 0) {
            char tp[64];
            sub(tp, sizeof tp, p, "type");
            bad(err, tp, "unsupported_parameter",
                "'%s': '%.64s' tools (server tools) are not supported; give client tools", tp, type);
            goto fail;
        }
        if (ds41_api_check_keys(t, p, keys, err) || ds41_api_get_string(t, p, "name", true, &name, err) ||
            ds41_api_get_string(t, p, "description", false, &desc, err) || check_cache_control(t, p, err))
            goto fail;
        json_t *schema;
        if (get_object(t, p, "input_schema", "an object (a JSON schema)", &schema, err)) goto fail;
        json_t *fn = json_pack("{s:s,s:O}", "name", name, "parameters", schema);
        if (fn && desc) json_object_set(fn, "description", json_object_get(t, "description"));
        json_t *ct = fn ? json_pack("{s:s,s:o}", "type", "function", "function", fn) : NULL;
        if (!ct || json_array_append_new(conv, ct)) {
            json_decref(conv);
            return oom(err);
        }
    }
    int rc = ds41_api_parse_tools(conv, &r->tools_json, names, err);
    if (rc) rename_tool_param(err);
    json_decref(conv);
    return rc;
fail:
    json_decref(conv);
    return -1;
}

static int parse_tool_choice(const json_t *root, const json_t *names, ds41_api_request *r,
                             ds41_svc_error *err) {
    json_t *tc = get(root, "tool_choice");
    if (!tc) return 0;
    if (!json_is_object(tc)) return type_error(err, "tool_choice", "an object", tc);
    static const char *const keys[] = {"type", "name", "disable_parallel_tool_use", NULL};
    const char *type, *name;
    bool has, no_parallel;
    if (ds41_api_check_keys(tc, "tool_choice", keys, err) ||
        ds41_api_get_string(tc, "tool_choice", "type", true, &type, err) ||
        ds41_api_get_string(tc, "tool_choice", "name", false, &name, err) ||
        ds41_api_get_bool(tc, "tool_choice", "disable_parallel_tool_use", &has, &no_parallel, err))
        return -1;
    r->gen.parallel_tool_calls = !(has && no_parallel);
    size_t n_tools = names ? json_array_size(names) : 0;
    json_t *conv = NULL;
    if (strcmp(type, "auto") == 0 || strcmp(type, "none") == 0) {
        conv = json_string(type);
    } else if (strcmp(type, "any") == 0) {
        if (!n_tools)
            return bad(err, "tool_choice.type", "invalid_value", "'tool_choice.type' 'any' needs 'tools'");
        conv = json_string("required");
    } else if (strcmp(type, "tool") == 0) {
        if (!name)
            return bad(err, "tool_choice.name", "missing_field",
                       "'tool_choice.name' is required with type 'tool'");
        bool known = false;
        for (size_t i = 0; i < n_tools; i++)
            known = known || strcmp(json_string_value(json_array_get(names, i)), name) == 0;
        if (!known)
            return bad(err, "tool_choice.name", "invalid_value",
                       "'tool_choice.name': '%.64s' is not in 'tools'", name);
        conv = json_pack("{s:s,s:{s:s}}", "type", "function", "function", "name", name);
    } else {
        return bad(err, "tool_choice.type", "invalid_value",
                   "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none', not '%.32s'", type);
    }
    if (name && strcmp(type, "tool") != 0)
        return json_decref(conv),
               bad(err, "tool_choice.name", "invalid_value", "'tool_choice.name' goes with type 'tool' only");
    r->tool_choice_json = conv ? ds41_json_dump(conv, NULL) : NULL;
    json_decref(conv);
    return r->tool_choice_json ? 0 : oom(err);
}

/* ---------------------------------------------------------------- thinking */

int ds41_anth_budget_effort(long long budget) {
    return budget < 2048 ? 25 : budget < 8192 ? 50 : budget < 32000 ? 75 : 100;
}

static int parse_thinking(const json_t *root, bool has_max, long long max_tokens, ds41_gen_request *g,
                          ds41_svc_error *err) {
    json_t *th = get(root, "thinking");
    if (!th) return 0;
    if (!json_is_object(th)) return type_error(err, "thinking", "an object", th);
    const char *type;
    if (ds41_api_get_string(th, "thinking", "type", true, &type, err)) return -1;
    if (strcmp(type, "disabled") == 0) {
        static const char *const keys[] = {"type", NULL};
        if (ds41_api_check_keys(th, "thinking", keys, err)) return -1;
        g->thinking = DS41_THINKING_DISABLED;
        return 0;
    }
    if (strcmp(type, "enabled") != 0)
        return bad(err, "thinking.type", "invalid_value",
                   "'thinking.type' must be 'enabled' or 'disabled', not '%.32s'", type);
    static const char *const keys[] = {"type", "budget_tokens", NULL};
    bool has;
    long long budget;
    if (ds41_api_check_keys(th, "thinking", keys, err) ||
        ds41_api_get_int(th, "thinking", "budget_tokens", 1024, INT32_MAX, &has, &budget, err))
        return -1;
    if (!has)
        return bad(err, "thinking.budget_tokens", "missing_field", "'thinking.budget_tokens' is required");
    if (has_max && budget >= max_tokens)
        return bad(err, "thinking.budget_tokens", "invalid_value",
                   "'thinking.budget_tokens' (%lld) must be less than 'max_tokens' (%lld)", budget,
                   max_tokens);
    g->thinking = DS41_THINKING_ENABLED;
    g->reasoning_effort = ds41_anth_budget_effort(budget);
    return 0;
}

/* ----------------------------------------------------------------- sampling */

static int get_unit(const json_t *root, const char *key, ds41_opt_double *out, ds41_svc_error *err) {
    json_t *v = get(root, key);
    out->set = false;
    if (!v) return 0;
    if (!json_is_number(v)) return type_error(err, key, "a number", v);
    double x = json_number_value(v);
    if (!(x >= 0 && x <= 1)) return bad(err, key, "invalid_value", "'%s' must be in [0, 1], got %g", key, x);
    out->set = true;
    out->value = x;
    return 0;
}

static int parse_stop(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    json_t *st = get(root, "stop_sequences");
    if (!st) return 0;
    if (!json_is_array(st)) return type_error(err, "stop_sequences", "an array of strings", st);
    size_t n = json_array_size(st);
    if (n > MAX_STOP)
        return bad(err, "stop_sequences", "invalid_value", "at most %d stop sequences", MAX_STOP);
    if (!n) return 0;
    r->stop = calloc(n, sizeof *r->stop);
    if (!r->stop) return oom(err);
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_array_get(st, i);
        char p[40];
        idx(p, sizeof p, "stop_sequences", i);
        if (!json_is_string(s)) return type_error(err, p, "a string", s);
        size_t len = json_string_length(s);
        if (len == 0 || len > MAX_STOP_BYTES || memchr(json_string_value(s), 0, len))
            return bad(err, p, "invalid_value", "'%s' must have 1..%d bytes and no NUL", p, MAX_STOP_BYTES);
        r->stop[i] = strdup(json_string_value(s));
        if (!r->stop[i]) return oom(err);
        r->gen.n_stop = i + 1;
    }
    r->gen.stop = (const char *const *)r->stop;
    return 0;
}

static int parse_metadata(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    json_t *md = get(root, "metadata");
    if (!md) return 0;
    if (!json_is_object(md)) return type_error(err, "metadata", "an object", md);
    static const char *const keys[] = {"user_id", NULL};
    const char *u;
    if (ds41_api_check_keys(md, "metadata", keys, err) ||
        ds41_api_get_string(md, "metadata", "user_id", false, &u, err))
        return -1;
    if (u && !(r->user = strdup(u))) return oom(err);
    r->gen.user = r->user;
    return 0;
}

/* ------------------------------------------------------------------ request */

static const char *const message_keys[] = {
    "model",    "max_tokens",     "messages",           "system", "tools", "tool_choice",
    "thinking", "stop_sequences", "temperature",        "top_p",  "top_k", "metadata",
    "stream",   "service_tier",   "ds41_forced_output", NULL};
static const char *const count_keys[] = {"model",       "messages", "system", "tools",
                                         "tool_choice", "thinking", NULL};

int ds41_anth_parse(const char *body, size_t len, bool count_tokens, ds41_api_request *out,
                    ds41_svc_error *err) {
    memset(out, 0, sizeof *out);
    out->gen.kind = DS41_GEN_CHAT;
    out->gen.parallel_tool_calls = true;
    out->gen.peer_uid = -1;
    json_t *root, *names = NULL;
    if (ds41_api_parse_json(body, len, &root, err)) return -1;
    ds41_gen_request *g = &out->gen;
    const char *s;
    bool has_max = false, has;
    long long max_tokens = 0, v;
    if (ds41_api_check_keys(root, NULL, count_tokens ? count_keys : message_keys, err) ||
        ds41_api_get_string(root, NULL, "model", true, &s, err))
        goto fail;
    if (!(out->model = strdup(s))) goto nomem;
    g->model = out->model;
    if (!count_tokens) {
        if (ds41_api_get_int(root, NULL, "max_tokens", 1, UINT32_MAX, &has_max, &max_tokens, err)) goto fail;
        if (!has_max) {
            bad(err, "max_tokens", "missing_field", "'max_tokens' is required");
            goto fail;
        }
        g->max_tokens = (uint32_t)max_tokens;
    }
    if (parse_messages(root, &out->messages_json, err) || parse_tools(root, out, &names, err) ||
        parse_tool_choice(root, names, out, err) || parse_thinking(root, has_max, max_tokens, g, err))
        goto fail;
    g->messages_json = out->messages_json;
    g->tools_json = out->tools_json;
    g->tool_choice_json = out->tool_choice_json;
    if (!count_tokens) {
        bool b;
        if (get_unit(root, "temperature", &g->temperature, err) || get_unit(root, "top_p", &g->top_p, err) ||
            ds41_api_get_int(root, NULL, "top_k", 0, INT32_MAX, &has, &v, err))
            goto fail;
        g->top_k = has ? (int32_t)v : 0;
        if (ds41_api_get_bool(root, NULL, "stream", &has, &b, err)) goto fail;
        g->stream = has && b;
        if (ds41_api_get_string(root, NULL, "service_tier", false, &s, err)) goto fail;
        if (s && strcmp(s, "auto") != 0 && strcmp(s, "standard_only") != 0) {
            bad(err, "service_tier", "invalid_value", "'service_tier' must be 'auto' or 'standard_only'");
            goto fail;
        }
        if (parse_stop(root, out, err) || parse_metadata(root, out, err) ||
            ds41_api_get_string(root, NULL, "ds41_forced_output", false, &s, err))
            goto fail;
        if (s && !(out->forced_output = strdup(s))) goto nomem;
        g->forced_output = out->forced_output;
    }
    json_decref(names);
    json_decref(root);
    return 0;
nomem:
    oom(err);
fail:
    json_decref(names);
    json_decref(root);
    ds41_api_request_free(out);
    return -1;
}

/* ============================================================ the message */

int ds41_anth_message_init(ds41_anth_message *m, const char *id, const char *model, uint64_t id_bits,
                           bool stream, const char *const *stop, size_t n_stop) {
    memset(m, 0, sizeof *m);
    snprintf(m->id, sizeof m->id, "%s", id);
    /* A long model name is cut at a character boundary: the message goes out as JSON. */
    const char *mn = model ? model : "";
    const size_t mlen = ds41_utf8_cut(mn, strlen(mn), sizeof m->model - 1);
    snprintf(m->model, sizeof m->model, "%.*s", (int)mlen, mn);
    m->id_bits = id_bits;
    m->stream = stream;
    if (n_stop) {
        m->stop = calloc(n_stop, sizeof *m->stop);
        if (!m->stop) return -1;
        for (size_t i = 0; i < n_stop; i++) {
            m->stop[i] = strdup(stop[i]);
            if (!m->stop[i]) return -1;
            m->n_stop = i + 1;
        }
    }
    return 0;
}

void ds41_anth_message_free(ds41_anth_message *m) {
    for (size_t i = 0; i < m->n_blocks; i++) {
        free(m->blocks[i].name);
        ds41_buf_free(&m->blocks[i].text);
    }
    for (size_t i = 0; i < m->n_stop; i++) free(m->stop[i]);
    free(m->stop);
    memset(m, 0, sizeof *m);
}

/* "event: NAME\ndata: JSON\n\n" (v stolen). */
static void sse(ds41_buf *out, const char *name, json_t *v) {
    char *text = v ? ds41_json_dump(v, NULL) : NULL;
    json_decref(v);
    if (!text || !out) {
        free(text);
        if (out && !text) out->oom = true;
        return;
    }
    ds41_buf_printf(out, "event: %s\ndata: %s\n\n", name, text);
    free(text);
}

static json_t *usage_json(uint64_t prompt, uint64_t cached, uint64_t output) {
    if (cached > prompt) cached = prompt;
    return json_pack("{s:o,s:o,s:i,s:o}", "input_tokens", ds41_api_ju64(prompt - cached),
                     "cache_read_input_tokens", ds41_api_ju64(cached), "cache_creation_input_tokens", 0,
                     "output_tokens", ds41_api_ju64(output));
}

void ds41_anth_message_start(ds41_anth_message *m, ds41_buf *out) {
    if (m->started || !m->stream) return;
    m->started = true;
    json_t *msg = json_pack("{s:s,s:s,s:s,s:s,s:[],s:n,s:n,s:o}", "id", m->id, "type", "message", "role",
                            "assistant", "model", m->model, "content", "stop_reason", "stop_sequence",
                            "usage", usage_json(m->prompt_tokens, 0, 0));
    sse(out, "message_start", json_pack("{s:s,s:o}", "type", "message_start", "message", msg));
    sse(out, "ping", json_pack("{s:s}", "type", "ping"));
}

static json_t *block_start_json(const ds41_anth_block *b) {
    switch (b->type) {
    case DS41_ANTH_THINKING:
        return json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", "", "signature", "");
    case DS41_ANTH_TEXT:
        return json_pack("{s:s,s:s}", "type", "text", "text", "");
    case DS41_ANTH_TOOL_USE:
        return json_pack("{s:s,s:s,s:o,s:{}}", "type", "tool_use", "id", b->id, "name",
                         ds41_json_string_lossy(b->name ? b->name : "", b->name ? strlen(b->name) : 0),
                         "input");
    }
    return NULL;
}

static void close_block(ds41_anth_message *m, ds41_buf *out) {
    if (!m->open) return;
    m->open = false;
    size_t i = m->n_blocks - 1;
    if (m->blocks[i].type == DS41_ANTH_THINKING)
        sse(out, "content_block_delta",
            json_pack("{s:s,s:I,s:{s:s,s:s}}", "type", "content_block_delta", "index", (json_int_t)i, "delta",
                      "type", "signature_delta", "signature", ""));
    sse(out, "content_block_stop",
        json_pack("{s:s,s:I}", "type", "content_block_stop", "index", (json_int_t)i));
}

/* The open block of this type (a new one when the last is of another type or tool call); NULL when full. */
static ds41_anth_block *block_for(ds41_anth_message *m, ds41_anth_block_type type, int tool_index,
                                  ds41_buf *out) {
    if (m->n_blocks && m->blocks[m->n_blocks - 1].type == type &&
        (type != DS41_ANTH_TOOL_USE || m->blocks[m->n_blocks - 1].tool_index == tool_index))
        return &m->blocks[m->n_blocks - 1];
    if (type == DS41_ANTH_TOOL_USE) /* a later fragment of an earlier call (not the last block) */
        for (size_t i = 0; i < m->n_blocks; i++)
            if (m->blocks[i].type == type && m->blocks[i].tool_index == tool_index) return &m->blocks[i];
    if (m->n_blocks == DS41_ANTH_MAX_BLOCKS) return NULL;
    close_block(m, out);
    ds41_anth_block *b = &m->blocks[m->n_blocks++];
    memset(b, 0, sizeof *b);
    b->type = type;
    b->tool_index = tool_index;
    if (type == DS41_ANTH_TOOL_USE)
        snprintf(b->id, sizeof b->id, "toolu_%016" PRIx64 "%04x", m->id_bits,
                 (unsigned)(m->n_blocks - 1) & 0xffff);
    return b;
}

static void open_block(ds41_anth_message *m, ds41_anth_block *b, ds41_buf *out) {
    if (!m->stream || (m->open && b == &m->blocks[m->n_blocks - 1])) return;
    if (b != &m->blocks[m->n_blocks - 1]) return; /* fragment of a closed call: nothing to stream */
    m->open = true;
    sse(out, "content_block_start",
        json_pack("{s:s,s:I,s:o}", "type", "content_block_start", "index", (json_int_t)(m->n_blocks - 1),
                  "content_block", block_start_json(b)));
}

static void delta(ds41_anth_message *m, ds41_anth_block_type type, int tool_index, const char *name,
                  const char *s, size_t n, ds41_buf *out) {
    ds41_anth_block *b = block_for(m, type, tool_index, out);
    if (!b) return;
    if (type == DS41_ANTH_TOOL_USE && !b->name) b->name = strdup(name ? name : "");
    bool last = b == &m->blocks[m->n_blocks - 1];
    open_block(m, b, out);
    ds41_buf_put(&b->text, s, n);
    if (!m->stream || !n || !last) return;
    static const char *const kinds[] = {NULL, "thinking_delta", "text_delta", "input_json_delta"};
    static const char *const fields[] = {NULL, "thinking", "text", "partial_json"};
    sse(out, "content_block_delta",
        json_pack("{s:s,s:I,s:{s:s,s:o}}", "type", "content_block_delta", "index",
                  (json_int_t)(m->n_blocks - 1), "delta", "type", kinds[type], fields[type],
                  ds41_json_string_lossy(s, n)));
}

static const char *stop_reason(const ds41_anth_message *m) {
    switch (m->finish) {
    case DS41_FINISH_LENGTH:
        return "max_tokens";
    case DS41_FINISH_TOOL_CALLS:
        return "tool_use";
    default:
        return m->stop_string && m->stop_index < m->n_stop ? "stop_sequence" : "end_turn";
    }
}

static json_t *stop_sequence_json(const ds41_anth_message *m) {
    if (m->finish != DS41_FINISH_STOP || !m->stop_string || m->stop_index >= m->n_stop) return json_null();
    return ds41_json_string_lossy(m->stop[m->stop_index], strlen(m->stop[m->stop_index]));
}

void ds41_anth_message_event(ds41_anth_message *m, const ds41_gen_event *ev, ds41_buf *out) {
    if (m->finished) return;
    ds41_anth_message_start(m, out);
    switch (ev->type) {
    case DS41_GEN_DELTA:
        if (ev->reasoning_len) delta(m, DS41_ANTH_THINKING, -1, NULL, ev->reasoning, ev->reasoning_len, out);
        if (ev->content_len) delta(m, DS41_ANTH_TEXT, -1, NULL, ev->content, ev->content_len, out);
        return;
    case DS41_GEN_TOOL_CALL:
        if (ev->tool_index >= 0)
            delta(m, DS41_ANTH_TOOL_USE, ev->tool_index, ev->tool_name, ev->arguments, ev->arguments_len,
                  out);
        return;
    case DS41_GEN_FINISH:
        m->finished = true;
        m->finish = ev->finish_reason;
        m->stop_string = ev->stop_string;
        m->stop_index = ev->stop_index;
        m->usage = ev->usage;
        if (!m->stream) return;
        close_block(m, out);
        sse(out, "message_delta",
            json_pack(
                "{s:s,s:{s:s,s:o},s:o}", "type", "message_delta", "delta", "stop_reason", stop_reason(m),
                "stop_sequence", stop_sequence_json(m), "usage",
                usage_json(ev->usage.prompt_tokens, ev->usage.cached_tokens, ev->usage.completion_tokens)));
        sse(out, "message_stop", json_pack("{s:s}", "type", "message_stop"));
        return;
    case DS41_GEN_ERROR: {
        m->finished = true;
        if (!m->stream || !out) return;
        char *e = ds41_anth_error_json(&ev->error);
        if (e)
            ds41_buf_printf(out, "event: error\ndata: %s\n\n", e);
        else
            out->oom = true;
        free(e);
        return;
    }
    }
}

/* A tool call's input: its arguments JSON as an object (the engine makes JSON objects; anything else, e.g. a
 * call cut by max_tokens, is kept as the text it is under "_raw" rather than lost). */
static json_t *tool_input(const ds41_anth_block *b) {
    json_t *v = b->text.len ? json_loadb(b->text.data, b->text.len, 0, NULL) : json_object();
    if (json_is_object(v)) return v;
    json_decref(v);
    return json_pack("{s:o}", "_raw", ds41_json_string_lossy(b->text.data ? b->text.data : "", b->text.len));
}

json_t *ds41_anth_message_json(const ds41_anth_message *m) {
    json_t *content = json_array();
    if (!content) return NULL;
    for (size_t i = 0; i < m->n_blocks; i++) {
        const ds41_anth_block *b = &m->blocks[i];
        const char *t = b->text.data ? b->text.data : "";
        json_t *o = NULL;
        switch (b->type) {
        case DS41_ANTH_THINKING:
            o = json_pack("{s:s,s:o,s:s}", "type", "thinking", "thinking",
                          ds41_json_string_lossy(t, b->text.len), "signature", "");
            break;
        case DS41_ANTH_TEXT:
            o = json_pack("{s:s,s:o}", "type", "text", "text", ds41_json_string_lossy(t, b->text.len));
            break;
        case DS41_ANTH_TOOL_USE:
            o = json_pack("{s:s,s:s,s:o,s:o}", "type", "tool_use", "id", b->id, "name",
                          ds41_json_string_lossy(b->name ? b->name : "", b->name ? strlen(b->name) : 0),
                          "input", tool_input(b));
            break;
        }
        if (!o || json_array_append_new(content, o)) {
            json_decref(content);
            return NULL;
        }
    }
    return json_pack("{s:s,s:s,s:s,s:s,s:o,s:s,s:o,s:o}", "id", m->id, "type", "message", "role", "assistant",
                     "model", m->model, "content", content, "stop_reason", stop_reason(m), "stop_sequence",
                     stop_sequence_json(m), "usage",
                     usage_json(m->usage.prompt_tokens, m->usage.cached_tokens, m->usage.completion_tokens));
}

/* ------------------------------------------------------------------ errors */

static const char *error_type(ds41_svc_status s) {
    switch (ds41_api_http_status(s)) {
    case 400:
    case 409:
        return "invalid_request_error";
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    case 503:
        return "overloaded_error";
    default:
        return "api_error";
    }
}

char *ds41_anth_error_json(const ds41_svc_error *e) {
    char msg[sizeof e->message + sizeof e->param + 8];
    const char *text = e->message[0] ? e->message : "the service failed without a message";
    /* The field first, unless the message already starts by quoting it. */
    if (e->param[0] && !(text[0] == '\'' && strncmp(text + 1, e->param, strlen(e->param)) == 0))
        snprintf(msg, sizeof msg, "%s: %s", e->param, text);
    else
        snprintf(msg, sizeof msg, "%s", text);
    json_t *o = json_pack("{s:s,s:{s:s,s:o}}", "type", "error", "error", "type", error_type(e->status),
                          "message", ds41_json_string_lossy(msg, strlen(msg)));
    char *s = o ? ds41_json_dump(o, NULL) : NULL;
    json_decref(o);
    return s;
}

static void respond_error(ds41_http_exchange *ex, const ds41_svc_error *e) {
    int status = ds41_api_http_status(e->status);
    if (status == 429 || status == 503) {
        char ra[16];
        snprintf(ra, sizeof ra, "%u", e->retry_after_s ? e->retry_after_s : 1);
        ds41_http_add_header(ex, "Retry-After", ra);
    }
    char *body = ds41_anth_error_json(e);
    if (!body) {
        ds41_http_respond_error(ex, 500, NULL, NULL, NULL, "out of memory");
        return;
    }
    ds41_http_respond(ex, status, NULL, body, strlen(body));
    free(body);
}

/* ================================================================== routes */

static void respond_oom(ds41_http_exchange *ex) {
    ds41_svc_error err = {0};
    ds41_svc_fail(&err, DS41_SVC_INTERNAL, NULL, "out of memory");
    respond_error(ex, &err);
}

/* The body as a request, or the 400 sent and -1. */
static int parse_body(ds41_http_exchange *ex, bool count_tokens, ds41_api_request *req) {
    size_t len;
    const char *body = ds41_http_body(ex, &len);
    ds41_svc_error err = {0};
    if (ds41_anth_parse(body, len, count_tokens, req, &err) == 0) return 0;
    respond_error(ex, &err);
    return -1;
}

/* One /v1/messages request, shared by the handler and the service's sink (reference counted). */
typedef struct anth_ctx {
    pthread_mutex_t mu;
    int refs;
    uint64_t id;
    ds41_anth_message msg;
    ds41_gen_accept accept;
    bool done, failed;
    ds41_svc_error error;
    /* stream */
    ds41_http_stream *out;
    bool attached, end_pending;
    ds41_http_signal sig;
} anth_ctx;

static void ctx_unref(anth_ctx *c) {
    pthread_mutex_lock(&c->mu);
    int left = --c->refs;
    pthread_mutex_unlock(&c->mu);
    if (left) return;
    ds41_anth_message_free(&c->msg);
    ds41_http_signal_destroy(&c->sig);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static void write_locked(anth_ctx *c, ds41_buf *b) {
    if (!b->oom && b->len && c->out) ds41_http_stream_write(c->out, b->data, b->len);
    ds41_buf_free(b);
}

static void sink_event(void *ctx, const ds41_gen_event *ev) {
    anth_ctx *c = ctx;
    if (!ev) return;
    pthread_mutex_lock(&c->mu);
    if (c->done) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    if (!c->msg.started && c->msg.stream) { /* the accept is filled before the first event */
        snprintf(c->msg.model, sizeof c->msg.model, "%s", c->accept.model);
        c->msg.prompt_tokens = c->accept.prompt_tokens;
    }
    bool terminal = ev->type == DS41_GEN_FINISH || ev->type == DS41_GEN_ERROR;
    ds41_gen_event e = *ev;
    if (ev->type == DS41_GEN_FINISH && ev->finish_reason == DS41_FINISH_CANCELLED) {
        e.type = DS41_GEN_ERROR;
        ds41_svc_fail(&e.error, DS41_SVC_CANCELLED, NULL, "the request was cancelled by the server");
    }
    e.error.message[sizeof e.error.message - 1] = 0;
    e.error.param[sizeof e.error.param - 1] = 0;
    ds41_buf b = {0};
    ds41_anth_message_event(&c->msg, &e, &b);
    write_locked(c, &b);
    ds41_http_stream *to_end = NULL;
    if (terminal) {
        c->done = true;
        if (e.type == DS41_GEN_ERROR) {
            c->failed = true;
            c->error = e.error;
        }
        if (c->msg.stream) {
            if (c->attached) {
                to_end = c->out;
                c->out = NULL;
            } else {
                c->end_pending = true;
            }
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (terminal) {
        if (to_end) ds41_http_stream_end(to_end);
        if (!c->msg.stream) ds41_http_signal_raise(&c->sig);
        ctx_unref(c);
    }
}

typedef struct cancel_ctx {
    ds41_service svc;
    uint64_t id;
} cancel_ctx;

static void cancel_on_abandon(void *ctx) {
    cancel_ctx *cc = ctx;
    cc->svc.cancel(cc->svc.ctx, cc->id);
}

void ds41_api_route_anthropic_messages(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    ds41_api_request req;
    ds41_svc_error err = {0};
    if (parse_body(ex, false, &req)) return;
    anth_ctx *c = calloc(1, sizeof *c);
    if (!c || ds41_http_signal_init(&c->sig, NULL) != 0) {
        free(c);
        ds41_api_request_free(&req);
        respond_oom(ex);
        return;
    }
    pthread_mutex_init(&c->mu, NULL);
    c->refs = 1;
    c->id = atomic_fetch_add(&api->next_id, 1);
    uint64_t bits = ds41_api_shown_id(api, c->id); /* ids a client sees: keyed, not the counter */
    char id[48];
    snprintf(id, sizeof id, "msg_%08" PRIx32 "%016" PRIx64, api->salt, bits);
    if (ds41_anth_message_init(&c->msg, id, req.model, bits, req.gen.stream, req.gen.stop, req.gen.n_stop)) {
        ds41_api_request_free(&req);
        ctx_unref(c);
        respond_oom(ex);
        return;
    }
    if (c->msg.stream) {
        cancel_ctx *cc = malloc(sizeof *cc);
        if (cc) {
            cc->svc = api->svc;
            cc->id = c->id;
            c->out = ds41_http_stream_new(cancel_on_abandon, cc, free);
        }
        if (!c->out) {
            free(cc);
            ds41_api_request_free(&req);
            ctx_unref(c);
            respond_oom(ex);
            return;
        }
    }
    req.gen.id = c->id;
    req.gen.response_id = c->msg.id;
    const ds41_http_peer *peer = ds41_http_peer_info(ex); /* the prefix-cache partition's owner */
    req.gen.peer_uid = peer && peer->has_creds ? (int64_t)peer->uid : -1;
    c->refs = 2; /* handler + service */
    ds41_gen_sink sink = {.event = sink_event, .sink_ctx = c};
    int rc = api->svc.submit(api->svc.ctx, &req.gen, &sink, &c->accept, &err);
    ds41_api_request_free(&req);
    pthread_mutex_lock(&c->mu);
    c->accept.model[sizeof c->accept.model - 1] = 0;
    if (!ds41_utf8_valid(c->accept.model, strlen(c->accept.model), NULL)) c->accept.model[0] = 0;
    if (!c->msg.started) {
        if (c->accept.model[0]) snprintf(c->msg.model, sizeof c->msg.model, "%s", c->accept.model);
        c->msg.prompt_tokens = c->accept.prompt_tokens;
    }
    pthread_mutex_unlock(&c->mu);
    if (rc != 0) {
        ds41_api_submit_refused(&c->mu, &c->done, &c->out, &err);
        respond_error(ex, &err);
        ctx_unref(c);
        ctx_unref(c);
        return;
    }
    if (c->msg.stream) {
        pthread_mutex_lock(&c->mu);
        if (!c->done) {
            ds41_buf b = {0};
            ds41_anth_message_start(&c->msg, &b);
            write_locked(c, &b);
        }
        pthread_mutex_unlock(&c->mu);
        static const char stop_event[] =
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\","
            "\"message\":\"the server is shutting down\"}}\n\n";
        ds41_api_attach_stream(ex, &c->mu, &c->out, &c->attached, &c->end_pending, stop_event);
        ctx_unref(c);
        return;
    }
    for (;;) {
        pthread_mutex_lock(&c->mu);
        bool done = c->done;
        pthread_mutex_unlock(&c->mu);
        if (done) break;
        ds41_http_wait_result w = ds41_http_wait(ex, &c->sig, -1);
        if (w == DS41_HTTP_WAIT_CLIENT_GONE || w == DS41_HTTP_WAIT_STOPPING) {
            api->svc.cancel(api->svc.ctx, c->id);
            if (w == DS41_HTTP_WAIT_CLIENT_GONE) {
                ds41_http_abandon(ex);
            } else {
                ds41_http_add_header(ex, "Connection", "close");
                ds41_svc_fail(&err, DS41_SVC_UNAVAILABLE, NULL, "the server is shutting down");
                respond_error(ex, &err);
            }
            ctx_unref(c);
            return;
        }
    }
    if (c->failed)
        respond_error(ex, &c->error);
    else
        ds41_api_respond_json(ex, 200, ds41_anth_message_json(&c->msg));
    ctx_unref(c);
}

void ds41_api_route_anthropic_count_tokens(ds41_http_exchange *ex, void *ctx) {
    ds41_api *api = ctx;
    ds41_api_request req;
    ds41_svc_error err = {0};
    if (parse_body(ex, true, &req)) return;
    if (!api->svc.tokenize) {
        ds41_api_request_free(&req);
        ds41_svc_fail(&err, DS41_SVC_INTERNAL, NULL, "the service does not implement tokenization");
        respond_error(ex, &err);
        return;
    }
    ds41_tokenize_request tr = {.model = req.model,
                                .messages_json = req.messages_json,
                                .tools_json = req.tools_json,
                                .thinking = req.gen.thinking,
                                .reasoning_effort = req.gen.reasoning_effort};
    int32_t *tokens = NULL;
    size_t n = 0;
    int rc = api->svc.tokenize(api->svc.ctx, &tr, &tokens, &n, &err);
    ds41_api_request_free(&req);
    free(tokens);
    if (rc) {
        respond_error(ex, &err);
        return;
    }
    ds41_api_respond_json(ex, 200, json_pack("{s:o}", "input_tokens", ds41_api_ju64(n)));
}
