/* Strict parsing of POST /v1/responses bodies into the chat generation they become (see
 * ipc/api_responses.h).  The chat route's validators do the shared parts (messages, tools,
 * thinking); this file maps the Responses shapes onto them and names the Responses field in
 * every refusal. */
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/buf.h"
#include "config/json_util.h"
#include "ipc/api_internal.h"
#include "ipc/api_responses.h"

#define MAX_METADATA 16
#define MAX_METADATA_VALUE 512
#define MAX_CACHE_SALT 256

__attribute__((format(printf, 4, 5))) static int refuse(ds41_svc_error *err, const char *param,
                                                        const char *code, const char *fmt, ...) {
    char msg[sizeof err->message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ds41_svc_fail(err, DS41_SVC_BAD_REQUEST, param, "%s", msg);
    snprintf(err->code, sizeof err->code, "%s", code);
    return -1;
}

static int wrong_type(ds41_svc_error *err, const char *path, const char *want, const json_t *v) {
    return refuse(err, path, "invalid_type", "'%s' must be %s, not %s", path, want, ds41_json_kind_name(v));
}

static int no_memory(ds41_svc_error *err) {
    return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
}

static json_t *present(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* A number in [lo, hi] into *out (set=false when absent). */
static int get_range(const json_t *root, const char *key, double lo, double hi, ds41_opt_double *out,
                     ds41_svc_error *err) {
    json_t *v = present(root, key);
    out->set = false;
    if (!v) return 0;
    if (!json_is_number(v)) return wrong_type(err, key, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi)
        return refuse(err, key, "invalid_value", "'%s' must be in [%g, %g], got %g", key, lo, hi, x);
    out->set = true;
    out->value = x;
    return 0;
}

/* The chat validators name "tools[i].function.x" or "messages[i]..."; show the Responses path. */
static void rename_param(ds41_svc_error *err, const char *from, const char *to) {
    char *at = strstr(err->param, from);
    if (!at) return;
    char tmp[sizeof err->param];
    snprintf(tmp, sizeof tmp, "%.*s%s%s", (int)(at - err->param), err->param, to, at + strlen(from));
    snprintf(err->param, sizeof err->param, "%s", tmp);
}

/* ------------------------------------------------------------------ input */

/* The text of a content array of input_text / output_text parts, as chat text parts. */
static int convert_parts(const json_t *content, const char *path, json_t **out, ds41_svc_error *err) {
    *out = NULL;
    if (json_is_string(content)) {
        *out = json_incref((json_t *)content);
        return 0;
    }
    if (!json_is_array(content))
        return wrong_type(err, path, "a string or an array of content parts", content);
    json_t *parts = json_array();
    if (!parts) return no_memory(err);
    size_t i;
    json_t *p;
    json_array_foreach(content, i, p) {
        char pp[192];
        snprintf(pp, sizeof pp, "%s[%zu]", path, i);
        if (!json_is_object(p)) {
            json_decref(parts);
            return wrong_type(err, pp, "an object", p);
        }
        const char *type, *text;
        if (ds41_api_get_string(p, pp, "type", true, &type, err)) goto fail;
        if (strcmp(type, "input_text") == 0 || strcmp(type, "output_text") == 0 ||
            strcmp(type, "text") == 0) {
            static const char *const keys[] = {"type", "text", "annotations", "logprobs", NULL};
            if (ds41_api_check_keys(p, pp, keys, err) || ds41_api_get_string(p, pp, "text", true, &text, err))
                goto fail;
        } else if (strcmp(type, "refusal") == 0) {
            static const char *const keys[] = {"type", "refusal", NULL};
            if (ds41_api_check_keys(p, pp, keys, err) ||
                ds41_api_get_string(p, pp, "refusal", true, &text, err))
                goto fail;
        } else {
            char tp[208];
            snprintf(tp, sizeof tp, "%s.type", pp);
            bool media = strcmp(type, "input_image") == 0 || strcmp(type, "input_file") == 0 ||
                         strcmp(type, "input_audio") == 0;
            refuse(err, tp, media ? "unsupported_parameter" : "invalid_value",
                   media ? "content part type '%s' is not supported: this model takes text only"
                         : "unknown content part type '%s' (input_text, output_text)",
                   type);
            goto fail;
        }
        json_t *np = json_pack("{s:s,s:s}", "type", "text", "text", text);
        if (!np || json_array_append_new(parts, np)) {
            json_decref(parts);
            return no_memory(err);
        }
    }
    *out = parts;
    return 0;
fail:
    json_decref(parts);
    return -1;
}

/* The assistant message at the end of msgs that a function call joins, or a new one. */
static json_t *assistant_tail(json_t *msgs, json_t **pending_reasoning) {
    json_t *last = json_array_get(msgs, json_array_size(msgs) - 1);
    const char *role = json_string_value(json_object_get(last, "role"));
    if (last && role && strcmp(role, "assistant") == 0) return last;
    json_t *m = json_pack("{s:s,s:n}", "role", "assistant", "content");
    if (!m || json_array_append_new(msgs, m)) return NULL;
    if (*pending_reasoning) {
        json_object_set_new(m, "reasoning_content", *pending_reasoning);
        *pending_reasoning = NULL;
    }
    return m;
}

static int convert_message(const json_t *item, const char *ip, json_t *msgs, json_t **pending_reasoning,
                           ds41_svc_error *err) {
    static const char *const keys[] = {"type", "role", "content", "id", "status", NULL};
    const char *role;
    if (ds41_api_check_keys(item, ip, keys, err) || ds41_api_get_string(item, ip, "role", true, &role, err))
        return -1;
    bool asst = strcmp(role, "assistant") == 0;
    if (!asst && strcmp(role, "user") != 0 && strcmp(role, "system") != 0 && strcmp(role, "developer") != 0) {
        char rp[96];
        snprintf(rp, sizeof rp, "%s.role", ip);
        return refuse(err, rp, "invalid_value", "unknown role '%s' (user, assistant, system, developer)",
                      role);
    }
    char cp[96];
    snprintf(cp, sizeof cp, "%s.content", ip);
    json_t *c = present(item, "content");
    if (!c) return refuse(err, cp, "missing_field", "'%s' is required", cp);
    json_t *content;
    if (convert_parts(c, cp, &content, err)) return -1;
    json_t *m = json_pack("{s:s,s:o}", "role", role, "content", content);
    if (!m || json_array_append_new(msgs, m)) return no_memory(err);
    if (asst && *pending_reasoning) {
        json_object_set_new(m, "reasoning_content", *pending_reasoning);
        *pending_reasoning = NULL;
    }
    return 0;
}

static int convert_function_call(const json_t *item, const char *ip, json_t *msgs, json_t **pending_reasoning,
                                 ds41_svc_error *err) {
    static const char *const keys[] = {"type", "id", "call_id", "name", "arguments", "status", NULL};
    const char *call_id, *name, *args;
    if (ds41_api_check_keys(item, ip, keys, err) ||
        ds41_api_get_string(item, ip, "call_id", true, &call_id, err) ||
        ds41_api_get_string(item, ip, "name", true, &name, err) ||
        ds41_api_get_string(item, ip, "arguments", true, &args, err))
        return -1;
    json_t *m = assistant_tail(msgs, pending_reasoning);
    if (!m) return no_memory(err);
    json_t *calls = json_object_get(m, "tool_calls");
    if (!calls) {
        calls = json_array();
        if (!calls || json_object_set_new(m, "tool_calls", calls)) return no_memory(err);
    }
    json_t *call = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", call_id, "type", "function", "function", "name",
                             name, "arguments", args);
    if (!call || json_array_append_new(calls, call)) return no_memory(err);
    return 0;
}

static int convert_function_output(const json_t *item, const char *ip, json_t *msgs, ds41_svc_error *err) {
    static const char *const keys[] = {"type", "id", "call_id", "output", "status", NULL};
    const char *call_id;
    if (ds41_api_check_keys(item, ip, keys, err) ||
        ds41_api_get_string(item, ip, "call_id", true, &call_id, err))
        return -1;
    char op[96];
    snprintf(op, sizeof op, "%s.output", ip);
    json_t *o = present(item, "output");
    if (!o) return refuse(err, op, "missing_field", "'%s' is required", op);
    json_t *content;
    if (convert_parts(o, op, &content, err)) return -1;
    json_t *m = json_pack("{s:s,s:s,s:o}", "role", "tool", "tool_call_id", call_id, "content", content);
    if (!m || json_array_append_new(msgs, m)) return no_memory(err);
    return 0;
}

static int convert_reasoning(const json_t *item, const char *ip, json_t **pending_reasoning,
                             ds41_svc_error *err) {
    static const char *const keys[] = {"type",   "id", "summary", "content", "encrypted_content",
                                       "status", NULL};
    if (ds41_api_check_keys(item, ip, keys, err)) return -1;
    json_t *sum = present(item, "summary");
    char sp[96];
    snprintf(sp, sizeof sp, "%s.summary", ip);
    if (sum && !json_is_array(sum)) return wrong_type(err, sp, "an array", sum);
    json_t *enc = present(item, "encrypted_content");
    if (enc) {
        snprintf(sp, sizeof sp, "%s.encrypted_content", ip);
        return refuse(err, sp, "unsupported_parameter",
                      "'%s' is not supported: give the reasoning as content", sp);
    }
    json_t *c = present(item, "content");
    ds41_buf text = {0};
    if (c) {
        char cp[96];
        snprintf(cp, sizeof cp, "%s.content", ip);
        if (!json_is_array(c)) return wrong_type(err, cp, "an array", c);
        size_t i;
        json_t *p;
        json_array_foreach(c, i, p) {
            char pp[128];
            snprintf(pp, sizeof pp, "%s[%zu]", cp, i);
            if (!json_is_object(p)) {
                ds41_buf_free(&text);
                return wrong_type(err, pp, "an object", p);
            }
            static const char *const pkeys[] = {"type", "text", NULL};
            const char *type, *t;
            if (ds41_api_check_keys(p, pp, pkeys, err) ||
                ds41_api_get_string(p, pp, "type", true, &type, err) ||
                ds41_api_get_string(p, pp, "text", true, &t, err)) {
                ds41_buf_free(&text);
                return -1;
            }
            if (strcmp(type, "reasoning_text") != 0) {
                ds41_buf_free(&text);
                char tp[144];
                snprintf(tp, sizeof tp, "%s.type", pp);
                return refuse(err, tp, "invalid_value", "'%s' must be 'reasoning_text', not '%s'", tp, type);
            }
            ds41_buf_put(&text, t, json_string_length(json_object_get(p, "text")));
        }
    }
    if (text.oom) {
        ds41_buf_free(&text);
        return no_memory(err);
    }
    json_t *s = json_stringn(text.data ? text.data : "", text.len);
    ds41_buf_free(&text);
    if (!s) return no_memory(err);
    json_decref(*pending_reasoning);
    *pending_reasoning = s;
    return 0;
}

static int convert_input(const json_t *input, json_t **out, ds41_svc_error *err) {
    *out = json_array();
    if (!*out) return no_memory(err);
    if (json_is_string(input)) {
        json_t *m = json_pack("{s:s,s:O}", "role", "user", "content", input);
        if (!m || json_array_append_new(*out, m)) return no_memory(err);
        return 0;
    }
    if (!json_is_array(input)) return wrong_type(err, "input", "a string or an array of items", input);
    json_t *pending = NULL; /* reasoning waiting for its assistant turn */
    size_t i;
    json_t *item;
    json_array_foreach(input, i, item) {
        char ip[48];
        snprintf(ip, sizeof ip, "input[%zu]", i);
        if (!json_is_object(item)) {
            json_decref(pending);
            return wrong_type(err, ip, "an object", item);
        }
        const char *type;
        if (ds41_api_get_string(item, ip, "type", false, &type, err)) goto fail;
        int rc;
        if (!type || strcmp(type, "message") == 0)
            rc = convert_message(item, ip, *out, &pending, err);
        else if (strcmp(type, "function_call") == 0)
            rc = convert_function_call(item, ip, *out, &pending, err);
        else if (strcmp(type, "function_call_output") == 0)
            rc = convert_function_output(item, ip, *out, err);
        else if (strcmp(type, "reasoning") == 0)
            rc = convert_reasoning(item, ip, &pending, err);
        else {
            char tp[64];
            snprintf(tp, sizeof tp, "%s.type", ip);
            rc = refuse(err, tp, "invalid_value",
                        "item type '%s' is not supported (message, function_call, function_call_output, "
                        "reasoning)",
                        type);
        }
        if (rc) goto fail;
    }
    json_decref(pending); /* reasoning with no turn after it has nothing to belong to */
    return 0;
fail:
    json_decref(pending);
    return -1;
}

/* ------------------------------------------------------------------ tools */

/* Responses tools ({"type":"function","name",...}) -> the chat route's shape, validated there. */
static int convert_tools(const json_t *tools, ds41_api_request *r, json_t **names, ds41_svc_error *err) {
    *names = NULL;
    if (!tools) return 0;
    if (!json_is_array(tools)) return wrong_type(err, "tools", "an array", tools);
    json_t *chat = json_array();
    if (!chat) return no_memory(err);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        char tp[48];
        snprintf(tp, sizeof tp, "tools[%zu]", i);
        if (!json_is_object(t)) {
            json_decref(chat);
            return wrong_type(err, tp, "an object", t);
        }
        const char *type;
        if (ds41_api_get_string(t, tp, "type", true, &type, err)) goto fail;
        if (strcmp(type, "function") != 0) {
            char p2[64];
            snprintf(p2, sizeof p2, "%s.type", tp);
            refuse(err, p2, "unsupported_parameter", "tool type '%s' is not supported: only 'function' tools",
                   type);
            goto fail;
        }
        static const char *const keys[] = {"type", "name", "description", "parameters", "strict", NULL};
        if (ds41_api_check_keys(t, tp, keys, err)) goto fail;
        json_t *fn = json_deep_copy(t);
        if (!fn) goto oom;
        json_object_del(fn, "type");
        json_t *ct = json_pack("{s:s,s:o}", "type", "function", "function", fn);
        if (!ct || json_array_append_new(chat, ct)) goto oom;
    }
    int rc = ds41_api_parse_tools(chat, &r->tools_json, names, err);
    if (rc) rename_param(err, ".function.", ".");
    json_decref(chat);
    r->gen.tools_json = r->tools_json;
    return rc;
oom:
    no_memory(err);
fail:
    json_decref(chat);
    return -1;
}

static int convert_tool_choice(const json_t *tc, const json_t *names, ds41_api_request *r,
                               ds41_svc_error *err) {
    if (!tc) return 0;
    size_t n = names ? json_array_size(names) : 0;
    json_t *chat = NULL;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (strcmp(s, "none") != 0 && strcmp(s, "auto") != 0 && strcmp(s, "required") != 0)
            return refuse(err, "tool_choice", "invalid_value",
                          "'tool_choice' must be 'none', 'auto', 'required' or a function, not '%s'", s);
        if (strcmp(s, "required") == 0 && n == 0)
            return refuse(err, "tool_choice", "invalid_value", "'tool_choice' 'required' needs 'tools'");
        chat = json_incref((json_t *)tc);
    } else if (json_is_object(tc)) {
        static const char *const keys[] = {"type", "name", NULL};
        const char *type, *name;
        if (ds41_api_get_string(tc, "tool_choice", "type", true, &type, err)) return -1;
        if (strcmp(type, "function") != 0)
            return refuse(err, "tool_choice.type", "unsupported_parameter",
                          "'tool_choice.type' must be 'function', not '%s'", type);
        if (ds41_api_check_keys(tc, "tool_choice", keys, err) ||
            ds41_api_get_string(tc, "tool_choice", "name", true, &name, err))
            return -1;
        bool known = false;
        for (size_t i = 0; i < n; i++)
            known = known || strcmp(json_string_value(json_array_get(names, i)), name) == 0;
        if (!known)
            return refuse(err, "tool_choice.name", "invalid_value",
                          "'tool_choice' names '%s', which is not in 'tools'", name);
        chat = json_pack("{s:s,s:{s:s}}", "type", "function", "function", "name", name);
    } else {
        return wrong_type(err, "tool_choice", "a string or an object", tc);
    }
    r->tool_choice_json = chat ? ds41_json_dump(chat, NULL) : NULL;
    json_decref(chat);
    if (!r->tool_choice_json) return no_memory(err);
    r->gen.tool_choice_json = r->tool_choice_json;
    return 0;
}

/* text.format -> the chat route's response_format (the JSON-mode enforcement reads that). */
static int convert_text(const json_t *text, ds41_api_request *r, ds41_svc_error *err) {
    if (!text) return 0;
    if (!json_is_object(text)) return wrong_type(err, "text", "an object", text);
    static const char *const keys[] = {"format", "verbosity", NULL};
    const char *verbosity;
    if (ds41_api_check_keys(text, "text", keys, err) ||
        ds41_api_get_string(text, "text", "verbosity", false, &verbosity, err))
        return -1;
    json_t *f = present(text, "format");
    if (!f) return 0;
    const char *p = "text.format";
    if (!json_is_object(f)) return wrong_type(err, p, "an object", f);
    const char *type;
    if (ds41_api_get_string(f, p, "type", true, &type, err)) return -1;
    json_t *rf;
    if (strcmp(type, "text") == 0 || strcmp(type, "json_object") == 0) {
        static const char *const fkeys[] = {"type", NULL};
        if (ds41_api_check_keys(f, p, fkeys, err)) return -1;
        rf = json_pack("{s:s}", "type", type);
    } else if (strcmp(type, "json_schema") == 0) {
        static const char *const fkeys[] = {"type", "name", "schema", "description", "strict", NULL};
        const char *name, *desc;
        bool has_strict, strict;
        if (ds41_api_check_keys(f, p, fkeys, err) || ds41_api_get_string(f, p, "name", true, &name, err) ||
            ds41_api_get_string(f, p, "description", false, &desc, err) ||
            ds41_api_get_bool(f, p, "strict", &has_strict, &strict, err))
            return -1;
        json_t *schema = present(f, "schema");
        if (!schema)
            return refuse(err, "text.format.schema", "missing_field", "'text.format.schema' is required");
        if (!json_is_object(schema)) return wrong_type(err, "text.format.schema", "an object", schema);
        json_t *js = json_pack("{s:s,s:O}", "name", name, "schema", schema);
        if (js && desc) json_object_set_new(js, "description", json_string(desc));
        if (js && has_strict) json_object_set_new(js, "strict", json_boolean(strict));
        rf = js ? json_pack("{s:s,s:o}", "type", "json_schema", "json_schema", js) : NULL;
    } else {
        return refuse(err, "text.format.type", "invalid_value",
                      "'text.format.type' must be 'text', 'json_object' or 'json_schema', not '%s'", type);
    }
    /* What the enforcement cannot hold the output to is refused here, naming the keyword. */
    if (rf && ds41_api_check_format_schema(f, p, err)) {
        json_decref(rf);
        return -1;
    }
    if (!rf) return no_memory(err);
    r->response_format_json = ds41_json_dump(rf, NULL);
    json_decref(rf);
    if (!r->response_format_json) return no_memory(err);
    r->gen.response_format_json = r->response_format_json;
    return 0;
}

static int convert_reasoning_opts(const json_t *re, ds41_gen_request *g, ds41_svc_error *err) {
    if (!re) return 0;
    if (!json_is_object(re)) return wrong_type(err, "reasoning", "an object", re);
    static const char *const keys[] = {"effort", "summary", "generate_summary", NULL};
    const char *effort, *summary, *gen;
    if (ds41_api_check_keys(re, "reasoning", keys, err) ||
        ds41_api_get_string(re, "reasoning", "effort", false, &effort, err) ||
        ds41_api_get_string(re, "reasoning", "summary", false, &summary, err) ||
        ds41_api_get_string(re, "reasoning", "generate_summary", false, &gen, err))
        return -1;
    if (!effort) return 0;
    json_t *tmp = json_pack("{s:s}", "reasoning_effort", effort);
    if (!tmp) return no_memory(err);
    int rc = ds41_api_parse_thinking(tmp, &g->thinking, &g->reasoning_effort, err);
    json_decref(tmp);
    if (rc) rename_param(err, "reasoning_effort", "reasoning.effort");
    return rc;
}

/* --------------------------------------------------------------- the body */

static const char *const response_keys[] = {"model",
                                            "input",
                                            "instructions",
                                            "tools",
                                            "tool_choice",
                                            "reasoning",
                                            "max_output_tokens",
                                            "temperature",
                                            "top_p",
                                            "text",
                                            "stream",
                                            "store",
                                            "previous_response_id",
                                            "metadata",
                                            "parallel_tool_calls",
                                            "user",
                                            "include",
                                            "truncation",
                                            "service_tier",
                                            "prompt_cache_key",
                                            "safety_identifier",
                                            "background",
                                            "stream_options",
                                            "seed",
                                            "cache_salt",
                                            "ds41_forced_output",
                                            NULL};

static int check_ignored(const json_t *root, ds41_svc_error *err) {
    const char *s;
    if (ds41_api_get_string(root, NULL, "service_tier", false, &s, err) ||
        ds41_api_get_string(root, NULL, "prompt_cache_key", false, &s, err) ||
        ds41_api_get_string(root, NULL, "safety_identifier", false, &s, err) ||
        ds41_api_get_string(root, NULL, "truncation", false, &s, err))
        return -1;
    if (s && strcmp(s, "disabled") != 0 && strcmp(s, "auto") != 0)
        return refuse(err, "truncation", "invalid_value", "'truncation' must be 'disabled' or 'auto'");
    bool has, b;
    if (ds41_api_get_bool(root, NULL, "background", &has, &b, err)) return -1;
    if (has && b)
        return refuse(err, "background", "unsupported_parameter", "'background' responses are not supported");
    json_t *inc = present(root, "include");
    if (inc) {
        if (!json_is_array(inc)) return wrong_type(err, "include", "an array", inc);
        size_t i;
        json_t *v;
        json_array_foreach(inc, i, v) if (!json_is_string(v)) {
            char p[32];
            snprintf(p, sizeof p, "include[%zu]", i);
            return wrong_type(err, p, "a string", v);
        }
    }
    json_t *so = present(root, "stream_options");
    if (so) {
        if (!json_is_object(so)) return wrong_type(err, "stream_options", "an object", so);
        static const char *const keys[] = {"include_obfuscation", NULL};
        if (ds41_api_check_keys(so, "stream_options", keys, err) ||
            ds41_api_get_bool(so, "stream_options", "include_obfuscation", &has, &b, err))
            return -1;
    }
    return 0;
}

static int parse_metadata(const json_t *root, ds41_svc_error *err) {
    json_t *md = present(root, "metadata");
    if (!md) return 0;
    if (!json_is_object(md)) return wrong_type(err, "metadata", "an object", md);
    if (json_object_size(md) > MAX_METADATA)
        return refuse(err, "metadata", "invalid_value", "'metadata' has at most %d keys", MAX_METADATA);
    const char *key;
    json_t *v;
    json_object_foreach(md, key, v) {
        /* The key in the field's name, cut to 64 bytes at a character boundary
         * (jansson's keys are valid UTF-8; the error's param must stay so). */
        size_t kn = strlen(key);
        if (kn > 64) {
            kn = 64;
            while (kn > 0 && ((unsigned char)key[kn] & 0xC0) == 0x80) kn--;
        }
        char p[96];
        snprintf(p, sizeof p, "metadata.%.*s", (int)kn, key);
        if (!json_is_string(v)) return wrong_type(err, p, "a string", v);
        if (strlen(key) > 64 || json_string_length(v) > MAX_METADATA_VALUE)
            return refuse(err, p, "invalid_value", "metadata keys have at most 64 bytes, values at most %d",
                          MAX_METADATA_VALUE);
    }
    return 0;
}

static int dup_opt(const json_t *root, const char *key, char **out, ds41_svc_error *err) {
    const char *s;
    *out = NULL;
    if (ds41_api_get_string(root, NULL, key, false, &s, err)) return -1;
    if (s && !(*out = strdup(s))) return no_memory(err);
    return 0;
}

/* The request fields a response object repeats (null where not given). */
static json_t *make_echo(const json_t *root, const ds41_responses_request *r) {
    json_t *e = json_object();
    if (!e) return NULL;
    static const char *const keys[] = {"instructions",
                                       "max_output_tokens",
                                       "previous_response_id",
                                       "temperature",
                                       "top_p",
                                       "user",
                                       "reasoning",
                                       "metadata",
                                       "tools",
                                       "tool_choice",
                                       "text",
                                       NULL};
    for (size_t i = 0; keys[i]; i++) {
        json_t *v = present(root, keys[i]);
        if (json_object_set_new(e, keys[i], v ? json_deep_copy(v) : json_null())) goto fail;
    }
    if (json_is_null(json_object_get(e, "tools")) && json_object_set_new(e, "tools", json_array())) goto fail;
    if (json_is_null(json_object_get(e, "tool_choice")) &&
        json_object_set_new(e, "tool_choice", json_string("auto")))
        goto fail;
    if (json_is_null(json_object_get(e, "metadata")) && json_object_set_new(e, "metadata", json_object()))
        goto fail;
    if (json_is_null(json_object_get(e, "text")) &&
        json_object_set_new(e, "text", json_pack("{s:{s:s}}", "format", "type", "text")))
        goto fail;
    if (json_is_null(json_object_get(e, "reasoning")) &&
        json_object_set_new(e, "reasoning", json_pack("{s:n,s:n}", "effort", "summary")))
        goto fail;
    if (json_object_set_new(e, "parallel_tool_calls", json_boolean(r->chat.gen.parallel_tool_calls)) ||
        json_object_set_new(e, "store", json_boolean(r->store)) ||
        json_object_set_new(e, "truncation", json_string("disabled")) ||
        json_object_set_new(e, "background", json_false()))
        goto fail;
    return e;
fail:
    json_decref(e);
    return NULL;
}

int ds41_responses_parse(const char *body, size_t len, ds41_responses_request *out, ds41_svc_error *err) {
    memset(out, 0, sizeof *out);
    ds41_api_request *r = &out->chat;
    ds41_gen_request *g = &r->gen;
    g->kind = DS41_GEN_CHAT;
    g->parallel_tool_calls = true;
    g->peer_uid = -1;
    out->store = true;
    json_t *root, *names = NULL;
    if (ds41_api_parse_json(body, len, &root, err)) return -1;
    if (ds41_api_check_keys(root, NULL, response_keys, err) || check_ignored(root, err) ||
        parse_metadata(root, err))
        goto fail;
    if (dup_opt(root, "model", &r->model, err) || dup_opt(root, "instructions", &out->instructions, err) ||
        dup_opt(root, "previous_response_id", &out->previous_response_id, err) ||
        dup_opt(root, "user", &r->user, err) || dup_opt(root, "ds41_forced_output", &r->forced_output, err) ||
        dup_opt(root, "cache_salt", &r->cache_salt, err))
        goto fail;
    g->model = r->model;
    g->user = r->user;
    g->forced_output = r->forced_output;
    g->cache_salt = r->cache_salt;
    if (r->cache_salt && (!*r->cache_salt || strlen(r->cache_salt) > MAX_CACHE_SALT)) {
        refuse(err, "cache_salt", "invalid_value", "'cache_salt' must have 1..%d bytes", MAX_CACHE_SALT);
        goto fail;
    }
    if (out->previous_response_id && !*out->previous_response_id) {
        refuse(err, "previous_response_id", "invalid_value", "'previous_response_id' must not be empty");
        goto fail;
    }
    json_t *input = present(root, "input");
    if (!input) {
        refuse(err, "input", "missing_field", "'input' is required");
        goto fail;
    }
    if (convert_input(input, &out->input, err)) goto fail;
    if (get_range(root, "temperature", 0, 2, &g->temperature, err) ||
        get_range(root, "top_p", 0, 1, &g->top_p, err))
        goto fail;
    bool has, b;
    long long v;
    if (ds41_api_get_int(root, NULL, "max_output_tokens", 1, UINT32_MAX, &has, &v, err)) goto fail;
    g->max_tokens = has ? (uint32_t)v : 0;
    if (ds41_api_get_int(root, NULL, "seed", LLONG_MIN, LLONG_MAX, &has, &v, err)) goto fail;
    g->has_seed = has;
    g->seed = has ? (int64_t)v : 0;
    if (ds41_api_get_bool(root, NULL, "stream", &has, &b, err)) goto fail;
    g->stream = has && b;
    if (ds41_api_get_bool(root, NULL, "store", &has, &b, err)) goto fail;
    out->store = !has || b;
    if (ds41_api_get_bool(root, NULL, "parallel_tool_calls", &has, &b, err)) goto fail;
    g->parallel_tool_calls = !has || b;
    if (convert_tools(present(root, "tools"), r, &names, err) ||
        convert_tool_choice(present(root, "tool_choice"), names, r, err) ||
        convert_text(present(root, "text"), r, err) ||
        convert_reasoning_opts(present(root, "reasoning"), g, err))
        goto fail;
    out->echo = make_echo(root, out);
    if (!out->echo) {
        no_memory(err);
        goto fail;
    }
    json_decref(names);
    json_decref(root);
    return 0;
fail:
    json_decref(names);
    json_decref(root);
    ds41_responses_request_free(out);
    return -1;
}

int ds41_responses_messages(ds41_responses_request *r, const json_t *previous, json_t **conversation,
                            ds41_svc_error *err) {
    if (conversation) *conversation = NULL;
    json_t *conv = json_array();
    json_t *all = json_array();
    if (!conv || !all) goto oom;
    if ((previous && json_array_extend(conv, (json_t *)previous)) || json_array_extend(conv, r->input))
        goto oom;
    if (r->instructions) {
        json_t *sys = json_pack("{s:s,s:s}", "role", "system", "content", r->instructions);
        if (!sys || json_array_append_new(all, sys)) goto oom;
    }
    if (json_array_extend(all, conv)) goto oom;
    if (json_array_size(all) == 0) {
        json_decref(conv);
        json_decref(all);
        return refuse(err, "input", "invalid_value", "'input' must not be empty");
    }
    free(r->chat.messages_json);
    r->chat.messages_json = NULL;
    int rc = ds41_api_parse_messages(all, &r->chat.messages_json, err);
    json_decref(all);
    if (rc) {
        /* the messages came from input items (or a stored response): name the input */
        snprintf(err->param, sizeof err->param, "input");
        json_decref(conv);
        return -1;
    }
    r->chat.gen.messages_json = r->chat.messages_json;
    if (conversation)
        *conversation = conv;
    else
        json_decref(conv);
    return 0;
oom:
    json_decref(conv);
    json_decref(all);
    return no_memory(err);
}

void ds41_responses_request_free(ds41_responses_request *r) {
    if (!r) return;
    ds41_api_request_free(&r->chat);
    json_decref(r->input);
    json_decref(r->echo);
    free(r->instructions);
    free(r->previous_response_id);
    memset(r, 0, sizeof *r);
}
