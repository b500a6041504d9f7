/* Strict parsing of the generation requests (see ipc/api.h for the field
 * list).  Every refusal names the field in err->param and says why. */
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/json_schema.h"
#include "ipc/api.h"
#include "ipc/api_internal.h"
#include "config/json_util.h"

#define MAX_STOP 16
#define MAX_STOP_BYTES 1024
#define MAX_LOGIT_BIAS 1024
#define MAX_CACHE_SALT_BYTES 256
#define MAX_TOOLS 512
#define MAX_TOOL_NAME 128

/* ----------------------------------------------------------- error helpers */

/* bad(): the helper every refusal goes through; api_internal.h shares it with the other parsers. */
#define bad ds41_api_field_error

int ds41_api_field_error(ds41_svc_error *err, const char *param, const char *code, const char *fmt, ...) {
    if (!err) return -1;
    err->status = DS41_SVC_BAD_REQUEST;
    err->retry_after_s = 0;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    snprintf(err->code, sizeof err->code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    ds41_svc_error_clip_utf8(err);
    return -1;
}

static int oom(ds41_svc_error *err) {
    return ds41_svc_fail(err, DS41_SVC_INTERNAL, NULL, "out of memory");
}

/* "prefix.key" (or "key" at the top level) into out. */
/* Field paths are for messages only: a path cut short still names the field. */
static void join_path(char *out, size_t n, const char *prefix, const char *key) {
    int r = prefix && *prefix ? snprintf(out, n, "%s.%s", prefix, key) : snprintf(out, n, "%s", key);
    if (r < 0) out[0] = 0;
}

static void index_path(char *out, size_t n, const char *prefix, size_t i) {
    if (snprintf(out, n, "%s[%zu]", prefix, i) < 0) out[0] = 0;
}

int ds41_api_parse_json(const char *body, size_t len, json_t **out, ds41_svc_error *err) {
    json_error_t je;
    *out = NULL;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return bad(err, NULL, "invalid_json", "the body is not valid JSON: %s (line %d, column %d)", je.text,
                   je.line, je.column);
    if (!json_is_object(root)) {
        int rc = bad(err, NULL, "invalid_json", "the body must be a JSON object, not %s",
                     ds41_json_kind_name(root));
        json_decref(root);
        return rc;
    }
    *out = root;
    return 0;
}

int ds41_api_check_keys(const json_t *obj, const char *prefix, const char *const *allowed,
                        ds41_svc_error *err) {
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)obj, key, v) {
        bool ok = false;
        for (size_t i = 0; allowed[i]; i++)
            if (strcmp(key, allowed[i]) == 0) {
                ok = true;
                break;
            }
        if (!ok) {
            /* An empty key still gets a name: the field is [""] of its object. */
            char path[160];
            if (key[0])
                join_path(path, sizeof path, prefix, key);
            else
                snprintf(path, sizeof path, "%s[\"\"]", prefix);
            return bad(err, path, "unknown_field", "unknown field '%s'", path);
        }
    }
    return 0;
}

/* obj[key] when present and not null, else NULL. */
static json_t *get(const json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return v && !json_is_null(v) ? v : NULL;
}

static int type_error(ds41_svc_error *err, const char *path, const char *want, const json_t *v) {
    return bad(err, path, "invalid_type", "'%s' must be %s, not %s", path, want, ds41_json_kind_name(v));
}

int ds41_api_type_error(ds41_svc_error *err, const char *path, const char *want, const json_t *v) {
    return type_error(err, path, want, v);
}

int ds41_api_get_string(const json_t *obj, const char *prefix, const char *key, bool required,
                        const char **out, ds41_svc_error *err) {
    char path[160];
    join_path(path, sizeof path, prefix, key);
    json_t *v = get(obj, key);
    *out = NULL;
    if (!v) return required ? bad(err, path, "missing_field", "'%s' is required", path) : 0;
    if (!json_is_string(v)) return type_error(err, path, "a string", v);
    *out = json_string_value(v);
    return 0;
}

int ds41_api_get_bool(const json_t *obj, const char *prefix, const char *key, bool *has, bool *out,
                      ds41_svc_error *err) {
    char path[160];
    join_path(path, sizeof path, prefix, key);
    json_t *v = get(obj, key);
    if (has) *has = v != NULL;
    if (!v) return 0;
    if (!json_is_boolean(v)) return type_error(err, path, "a boolean", v);
    *out = json_is_true(v);
    return 0;
}

/* A number in [lo, hi] (lo_open / hi_open exclude the bound). */
static int get_number(const json_t *obj, const char *key, double lo, bool lo_open, double hi,
                      ds41_opt_double *out, ds41_svc_error *err) {
    json_t *v = get(obj, key);
    out->set = false;
    if (!v) return 0;
    if (!json_is_number(v)) return type_error(err, key, "a number", v);
    double x = json_number_value(v);
    if (!isfinite(x) || x > hi || x < lo || (lo_open && x == lo))
        return bad(err, key, "invalid_value", "'%s' must be in %c%g, %g], got %g", key, lo_open ? '(' : '[',
                   lo, hi, x);
    out->set = true;
    out->value = x;
    return 0;
}

int ds41_api_get_int(const json_t *obj, const char *prefix, const char *key, long long lo, long long hi,
                     bool *has, long long *out, ds41_svc_error *err) {
    char path[160];
    join_path(path, sizeof path, prefix, key);
    json_t *v = get(obj, key);
    *has = false;
    if (!v) return 0;
    if (!json_is_integer(v)) return type_error(err, path, "an integer", v);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return bad(err, path, "invalid_value", "'%s' must be in [%lld, %lld], got %lld", path, lo, hi, x);
    *has = true;
    *out = x;
    return 0;
}

static int refuse_if_set(const json_t *root, const char *key, const char *why, ds41_svc_error *err) {
    if (get(root, key)) return bad(err, key, "unsupported_parameter", "'%s' is not supported: %s", key, why);
    return 0;
}

static int dup_string(const char *s, char **out, ds41_svc_error *err) {
    *out = NULL;
    if (!s) return 0;
    *out = strdup(s);
    return *out ? 0 : oom(err);
}

static int dump_to(const json_t *v, char **out, ds41_svc_error *err) {
    *out = ds41_json_dump(v, NULL);
    return *out ? 0 : oom(err);
}

/* --------------------------------------------------------------- messages */

static int parse_content(const json_t *msg, const char *mpath, const char *role, bool allow_null,
                         json_t *norm, ds41_svc_error *err) {
    char path[160];
    join_path(path, sizeof path, mpath, "content");
    json_t *c = json_object_get(msg, "content");
    if (!c || json_is_null(c)) {
        if (!allow_null) return bad(err, path, "missing_field", "'%s' is required for role '%s'", path, role);
        return json_object_set_new(norm, "content", json_null()) ? oom(err) : 0;
    }
    if (json_is_string(c)) return json_object_set(norm, "content", c) ? oom(err) : 0;
    if (!json_is_array(c)) return type_error(err, path, "a string, an array of parts or null", c);
    json_t *parts = json_array();
    if (!parts) return oom(err);
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part) {
        char ppath[192];
        index_path(ppath, sizeof ppath, path, i);
        if (!json_is_object(part)) {
            json_decref(parts);
            return type_error(err, ppath, "an object", part);
        }
        const char *type;
        if (ds41_api_get_string(part, ppath, "type", true, &type, err)) goto fail;
        if (strcmp(type, "text") == 0) {
            static const char *const keys[] = {"type", "text", NULL};
            const char *text;
            if (ds41_api_check_keys(part, ppath, keys, err) ||
                ds41_api_get_string(part, ppath, "text", true, &text, err))
                goto fail;
            json_t *np = json_pack("{s:s,s:O}", "type", "text", "text", json_object_get(part, "text"));
            if (!np || json_array_append_new(parts, np)) {
                json_decref(parts);
                return oom(err);
            }
        } else if (strcmp(type, "image_url") == 0 || strcmp(type, "input_audio") == 0 ||
                   strcmp(type, "file") == 0 || strcmp(type, "refusal") == 0) {
            char tpath[200];
            join_path(tpath, sizeof tpath, ppath, "type");
            json_decref(parts);
            return bad(err, tpath, "unsupported_parameter",
                       "content part type '%s' is not supported: this model takes text only", type);
        } else {
            char tpath[200];
            join_path(tpath, sizeof tpath, ppath, "type");
            json_decref(parts);
            return bad(err, tpath, "invalid_value", "unknown content part type '%s'", type);
        }
    }
    return json_object_set_new(norm, "content", parts) ? oom(err) : 0;
fail:
    json_decref(parts);
    return -1;
}

static int parse_tool_calls(const json_t *tc, const char *mpath, json_t *norm, ds41_svc_error *err) {
    char path[160];
    join_path(path, sizeof path, mpath, "tool_calls");
    if (!json_is_array(tc)) return type_error(err, path, "an array", tc);
    json_t *out = json_array();
    if (!out) return oom(err);
    size_t i;
    json_t *call;
    json_array_foreach(tc, i, call) {
        char cpath[192], fpath[208];
        index_path(cpath, sizeof cpath, path, i);
        if (!json_is_object(call)) {
            json_decref(out);
            return type_error(err, cpath, "an object", call);
        }
        static const char *const keys[] = {"id", "type", "function", "index", NULL};
        static const char *const fkeys[] = {"name", "arguments", "parsed_arguments", NULL};
        const char *id, *type, *name;
        if (ds41_api_check_keys(call, cpath, keys, err) ||
            ds41_api_get_string(call, cpath, "id", true, &id, err) ||
            ds41_api_get_string(call, cpath, "type", false, &type, err))
            goto fail;
        if (type && strcmp(type, "function") != 0) {
            char tpath[208];
            join_path(tpath, sizeof tpath, cpath, "type");
            bad(err, tpath, "invalid_value", "tool call type must be 'function', not '%s'", type);
            goto fail;
        }
        bool has_index;
        long long index;
        if (ds41_api_get_int(call, cpath, "index", 0, INT_MAX, &has_index, &index, err)) goto fail;
        json_t *fn = get(call, "function");
        join_path(fpath, sizeof fpath, cpath, "function");
        if (!fn) {
            bad(err, fpath, "missing_field", "'%s' is required", fpath);
            goto fail;
        }
        if (!json_is_object(fn)) {
            type_error(err, fpath, "an object", fn);
            goto fail;
        }
        if (ds41_api_check_keys(fn, fpath, fkeys, err) ||
            ds41_api_get_string(fn, fpath, "name", true, &name, err))
            goto fail;
        json_t *args = json_object_get(fn, "arguments");
        char apath[224];
        join_path(apath, sizeof apath, fpath, "arguments");
        if (!args || json_is_null(args)) {
            bad(err, apath, "missing_field", "'%s' is required", apath);
            goto fail;
        }
        if (!json_is_string(args) && !json_is_object(args)) {
            type_error(err, apath, "a string or an object", args);
            goto fail;
        }
        json_t *nc = json_pack("{s:s,s:s,s:{s:s,s:O}}", "id", id, "type", "function", "function", "name",
                               name, "arguments", args);
        if (!nc || json_array_append_new(out, nc)) {
            json_decref(out);
            return oom(err);
        }
    }
    return json_object_set_new(norm, "tool_calls", out) ? oom(err) : 0;
fail:
    json_decref(out);
    return -1;
}

int ds41_api_parse_messages(const json_t *messages, char **out_json, ds41_svc_error *err) {
    *out_json = NULL;
    if (!messages) return bad(err, "messages", "missing_field", "'messages' is required");
    if (!json_is_array(messages)) return type_error(err, "messages", "an array", messages);
    if (json_array_size(messages) == 0)
        return bad(err, "messages", "invalid_value", "'messages' must not be empty");
    json_t *norm_all = json_array();
    if (!norm_all) return oom(err);
    size_t i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        char mpath[64];
        index_path(mpath, sizeof mpath, "messages", i);
        if (!json_is_object(m)) {
            type_error(err, mpath, "an object", m);
            goto fail;
        }
        const char *role;
        if (ds41_api_get_string(m, mpath, "role", true, &role, err)) goto fail;
        static const char *const common_keys[] = {"role", "content", "name", NULL};
        static const char *const tool_keys[] = {"role", "content", "name", "tool_call_id", NULL};
        static const char *const asst_keys[] = {
            "role",    "content",     "name",  "tool_calls",    "reasoning_content",
            "refusal", "annotations", "audio", "function_call", "prefix",
            "parsed",  NULL};
        bool is_asst = strcmp(role, "assistant") == 0;
        bool is_tool = strcmp(role, "tool") == 0;
        if (!is_asst && !is_tool && strcmp(role, "system") != 0 && strcmp(role, "user") != 0 &&
            strcmp(role, "developer") != 0) {
            char rpath[80];
            join_path(rpath, sizeof rpath, mpath, "role");
            bad(err, rpath, "invalid_value", "unknown role '%s' (system, developer, user, assistant, tool)",
                role);
            goto fail;
        }
        if (ds41_api_check_keys(m, mpath, is_asst ? asst_keys : is_tool ? tool_keys : common_keys, err))
            goto fail;
        json_t *norm = json_object();
        if (!norm || json_array_append_new(norm_all, norm)) {
            json_decref(norm_all);
            return oom(err);
        }
        if (json_object_set(norm, "role", json_object_get(m, "role"))) {
            oom(err);
            goto fail;
        }
        if (parse_content(m, mpath, role, is_asst, norm, err)) goto fail;
        const char *s;
        if (ds41_api_get_string(m, mpath, "name", false, &s, err)) goto fail;
        if (s && json_object_set(norm, "name", json_object_get(m, "name"))) {
            oom(err);
            goto fail;
        }
        if (is_tool) {
            if (ds41_api_get_string(m, mpath, "tool_call_id", true, &s, err)) goto fail;
            if (json_object_set(norm, "tool_call_id", json_object_get(m, "tool_call_id"))) {
                oom(err);
                goto fail;
            }
        }
        if (is_asst) {
            if (ds41_api_get_string(m, mpath, "reasoning_content", false, &s, err)) goto fail;
            if (s && json_object_set(norm, "reasoning_content", json_object_get(m, "reasoning_content"))) {
                oom(err);
                goto fail;
            }
            if (ds41_api_get_string(m, mpath, "refusal", false, &s, err)) goto fail;
            json_t *ann = get(m, "annotations");
            char p2[96];
            if (ann && !json_is_array(ann)) {
                join_path(p2, sizeof p2, mpath, "annotations");
                type_error(err, p2, "an array", ann);
                goto fail;
            }
            json_t *audio = get(m, "audio");
            if (audio) {
                join_path(p2, sizeof p2, mpath, "audio");
                bad(err, p2, "unsupported_parameter", "'%s' is not supported: this model takes text only",
                    p2);
                goto fail;
            }
            if (get(m, "function_call")) {
                join_path(p2, sizeof p2, mpath, "function_call");
                bad(err, p2, "unsupported_parameter", "'%s' is deprecated and not supported; use tool_calls",
                    p2);
                goto fail;
            }
            json_t *tc = get(m, "tool_calls");
            if (tc && parse_tool_calls(tc, mpath, norm, err)) goto fail;
            bool has_prefix, prefix = false;
            if (ds41_api_get_bool(m, mpath, "prefix", &has_prefix, &prefix, err)) goto fail;
            if (has_prefix && json_object_set_new(norm, "prefix", json_boolean(prefix))) {
                oom(err);
                goto fail;
            }
        }
    }
    int rc = dump_to(norm_all, out_json, err);
    json_decref(norm_all);
    return rc;
fail:
    json_decref(norm_all);
    return -1;
}

/* ------------------------------------------------------------------- tools */

static bool tool_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n > MAX_TOOL_NAME) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.' || c == ':'))
            return false;
    }
    return true;
}

static int check_namespace(const json_t *holder, const char *prefix, ds41_svc_error *err) {
    json_t *ns = get(holder, "namespace");
    if (!ns) return 0;
    char path[200];
    join_path(path, sizeof path, prefix, "namespace");
    if (json_is_string(ns)) return 0;
    if (!json_is_object(ns)) return type_error(err, path, "a string or an object", ns);
    static const char *const keys[] = {"name", "description", NULL};
    const char *s;
    if (ds41_api_check_keys(ns, path, keys, err) || ds41_api_get_string(ns, path, "name", true, &s, err) ||
        ds41_api_get_string(ns, path, "description", false, &s, err))
        return -1;
    return 0;
}

/* The namespace a tool or function object gives (string or {"name": ...}), or NULL. */
static const char *namespace_name(const json_t *holder) {
    const json_t *ns = get(holder, "namespace");
    if (json_is_object(ns)) ns = json_object_get(ns, "name");
    return json_string_value(ns);
}

int ds41_api_parse_tools(const json_t *tools, char **out_json, json_t **names, ds41_svc_error *err) {
    *out_json = NULL;
    if (names) *names = NULL;
    if (!tools || json_is_null(tools)) return 0;
    if (!json_is_array(tools)) return type_error(err, "tools", "an array", tools);
    if (json_array_size(tools) > MAX_TOOLS)
        return bad(err, "tools", "invalid_value", "at most %d tools", MAX_TOOLS);
    json_t *nm = json_array();
    if (!nm) return oom(err);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        char tpath[48], fpath[64];
        index_path(tpath, sizeof tpath, "tools", i);
        if (!json_is_object(t)) {
            type_error(err, tpath, "an object", t);
            goto fail;
        }
        static const char *const keys[] = {"type", "function", "namespace", NULL};
        static const char *const fkeys[] = {"name", "description", "parameters", "strict", "namespace", NULL};
        const char *type, *name, *desc;
        if (ds41_api_check_keys(t, tpath, keys, err) ||
            ds41_api_get_string(t, tpath, "type", true, &type, err))
            goto fail;
        if (strcmp(type, "function") != 0) {
            char p2[64];
            join_path(p2, sizeof p2, tpath, "type");
            bad(err, p2, "invalid_value", "tool type must be 'function', not '%s'", type);
            goto fail;
        }
        if (check_namespace(t, tpath, err)) goto fail;
        json_t *fn = get(t, "function");
        join_path(fpath, sizeof fpath, tpath, "function");
        if (!fn) {
            bad(err, fpath, "missing_field", "'%s' is required", fpath);
            goto fail;
        }
        if (!json_is_object(fn)) {
            type_error(err, fpath, "an object", fn);
            goto fail;
        }
        if (ds41_api_check_keys(fn, fpath, fkeys, err) ||
            ds41_api_get_string(fn, fpath, "name", true, &name, err) ||
            ds41_api_get_string(fn, fpath, "description", false, &desc, err) ||
            check_namespace(fn, fpath, err))
            goto fail;
        if (!tool_name_ok(name)) {
            char p2[80];
            join_path(p2, sizeof p2, fpath, "name");
            bad(err, p2, "invalid_value", "tool name must be 1..%d characters of [A-Za-z0-9_.:-]",
                MAX_TOOL_NAME);
            goto fail;
        }
        json_t *params = get(fn, "parameters");
        if (params && !json_is_object(params)) {
            char p2[80];
            join_path(p2, sizeof p2, fpath, "parameters");
            type_error(err, p2, "an object (a JSON schema)", params);
            goto fail;
        }
        bool has_strict, strict;
        if (ds41_api_get_bool(fn, fpath, "strict", &has_strict, &strict, err)) goto fail;
        /* the parameters schema: the subset engine/text/json_schema.h supports, refused otherwise (a
         * tool_choice constraint could not hold the model to the rest) */
        char spath[96], epath[128];
        join_path(spath, sizeof spath, fpath, "parameters");
        ds41_schema *schema = NULL;
        ds41_error se;
        if (ds41_schema_compile(params, spath, &schema, epath, sizeof epath, &se) != 0) {
            bad(err, epath[0] ? epath : spath, "invalid_value", "%s", se.msg);
            goto fail;
        }
        ds41_schema_free(schema);
        /* a name twice (in the same namespace) would make a call ambiguous */
        const char *ns = namespace_name(t);
        if (!ns) ns = namespace_name(fn);
        for (size_t k = 0; k < i; k++) {
            const json_t *ot = json_array_get(tools, k), *ofn = json_object_get(ot, "function");
            const char *ons = namespace_name(ot);
            if (!ons) ons = namespace_name(ofn);
            if (strcmp(json_string_value(json_object_get(ofn, "name")), name) == 0 &&
                strcmp(ns ? ns : "", ons ? ons : "") == 0) {
                char p2[80];
                join_path(p2, sizeof p2, fpath, "name");
                bad(err, p2, "invalid_value", "duplicate tool name '%s' (tools[%zu] has it too)", name, k);
                goto fail;
            }
        }
        if (json_array_append_new(nm, json_string(name))) {
            oom(err);
            goto fail;
        }
    }
    if (json_array_size(tools) > 0 && dump_to(tools, out_json, err)) goto fail;
    if (names)
        *names = nm;
    else
        json_decref(nm);
    return 0;
fail:
    json_decref(nm);
    return -1;
}

static int parse_tool_choice(const json_t *root, const json_t *names, char **out, ds41_svc_error *err) {
    *out = NULL;
    json_t *tc = get(root, "tool_choice");
    if (!tc) return 0;
    size_t n_tools = names ? json_array_size(names) : 0;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (strcmp(s, "none") != 0 && strcmp(s, "auto") != 0 && strcmp(s, "required") != 0)
            return bad(err, "tool_choice", "invalid_value",
                       "'tool_choice' must be 'none', 'auto', 'required' or a function, not '%s'", s);
        if (strcmp(s, "required") == 0 && n_tools == 0)
            return bad(err, "tool_choice", "invalid_value", "'tool_choice' 'required' needs 'tools'");
        return dump_to(tc, out, err);
    }
    if (!json_is_object(tc)) return type_error(err, "tool_choice", "a string or an object", tc);
    static const char *const keys[] = {"type", "function", NULL};
    static const char *const fkeys[] = {"name", NULL};
    const char *type, *name;
    if (ds41_api_check_keys(tc, "tool_choice", keys, err) ||
        ds41_api_get_string(tc, "tool_choice", "type", true, &type, err))
        return -1;
    if (strcmp(type, "function") != 0)
        return bad(err, "tool_choice.type", "unsupported_parameter",
                   "'tool_choice.type' must be 'function', not '%s'", type);
    json_t *fn = get(tc, "function");
    if (!fn) return bad(err, "tool_choice.function", "missing_field", "'tool_choice.function' is required");
    if (!json_is_object(fn)) return type_error(err, "tool_choice.function", "an object", fn);
    if (ds41_api_check_keys(fn, "tool_choice.function", fkeys, err) ||
        ds41_api_get_string(fn, "tool_choice.function", "name", true, &name, err))
        return -1;
    for (size_t i = 0; i < n_tools; i++)
        if (strcmp(json_string_value(json_array_get(names, i)), name) == 0) return dump_to(tc, out, err);
    return bad(err, "tool_choice.function.name", "invalid_value",
               "'tool_choice' names '%s', which is not in 'tools'", name);
}

static int parse_response_format(const json_t *root, char **out, ds41_svc_error *err) {
    *out = NULL;
    json_t *rf = get(root, "response_format");
    if (!rf) return 0;
    if (!json_is_object(rf)) return type_error(err, "response_format", "an object", rf);
    const char *type;
    if (ds41_api_get_string(rf, "response_format", "type", true, &type, err)) return -1;
    if (strcmp(type, "text") == 0 || strcmp(type, "json_object") == 0) {
        static const char *const keys[] = {"type", NULL};
        if (ds41_api_check_keys(rf, "response_format", keys, err)) return -1;
    } else if (strcmp(type, "json_schema") == 0) {
        static const char *const keys[] = {"type", "json_schema", NULL};
        static const char *const skeys[] = {"name", "description", "schema", "strict", NULL};
        if (ds41_api_check_keys(rf, "response_format", keys, err)) return -1;
        json_t *js = get(rf, "json_schema");
        const char *p = "response_format.json_schema";
        if (!js) return bad(err, p, "missing_field", "'%s' is required", p);
        if (!json_is_object(js)) return type_error(err, p, "an object", js);
        const char *s;
        bool has, b;
        if (ds41_api_check_keys(js, p, skeys, err) || ds41_api_get_string(js, p, "name", true, &s, err) ||
            ds41_api_get_string(js, p, "description", false, &s, err) ||
            ds41_api_get_bool(js, p, "strict", &has, &b, err))
            return -1;
        json_t *schema = get(js, "schema");
        if (schema && !json_is_object(schema))
            return type_error(err, "response_format.json_schema.schema", "an object", schema);
    } else {
        return bad(err, "response_format.type", "invalid_value",
                   "'response_format.type' must be 'text', 'json_object' or 'json_schema', not '%s'", type);
    }
    if (ds41_api_check_format_schema(rf, "response_format", err)) return -1;
    return dump_to(rf, out, err);
}

int ds41_api_check_format_schema(const json_t *format, const char *path, ds41_svc_error *err) {
    char epath[256];
    ds41_schema *schema = NULL;
    ds41_error se;
    if (ds41_schema_compile_format(format, path, &schema, epath, sizeof epath, &se) != 0)
        return bad(err, epath[0] ? epath : path, "invalid_value", "%s", se.msg);
    ds41_schema_free(schema);
    return 0;
}

/* ---------------------------------------------------------------- thinking */

int ds41_api_parse_thinking(const json_t *root, ds41_thinking *mode, int *effort, ds41_svc_error *err) {
    *mode = DS41_THINKING_DEFAULT;
    *effort = 0;
    ds41_thinking explicit_mode = DS41_THINKING_DEFAULT;
    const char *explicit_from = NULL;

    json_t *th = get(root, "thinking");
    if (th) {
        if (!json_is_object(th)) return type_error(err, "thinking", "an object", th);
        static const char *const keys[] = {"type", NULL};
        const char *type;
        if (ds41_api_check_keys(th, "thinking", keys, err) ||
            ds41_api_get_string(th, "thinking", "type", true, &type, err))
            return -1;
        if (strcmp(type, "enabled") == 0)
            explicit_mode = DS41_THINKING_ENABLED;
        else if (strcmp(type, "disabled") == 0)
            explicit_mode = DS41_THINKING_DISABLED;
        else
            return bad(err, "thinking.type", "invalid_value",
                       "'thinking.type' must be 'enabled' or 'disabled', not '%s'", type);
        explicit_from = "thinking.type";
    }
    json_t *kw = get(root, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) return type_error(err, "chat_template_kwargs", "an object", kw);
        static const char *const keys[] = {"thinking", "enable_thinking", NULL};
        if (ds41_api_check_keys(kw, "chat_template_kwargs", keys, err)) return -1;
        for (int k = 0; k < 2; k++) {
            const char *key = k ? "enable_thinking" : "thinking";
            bool has, on;
            if (ds41_api_get_bool(kw, "chat_template_kwargs", key, &has, &on, err)) return -1;
            if (!has) continue;
            ds41_thinking m = on ? DS41_THINKING_ENABLED : DS41_THINKING_DISABLED;
            if (explicit_mode != DS41_THINKING_DEFAULT && explicit_mode != m) {
                char path[64];
                join_path(path, sizeof path, "chat_template_kwargs", key);
                return bad(err, path, "invalid_value", "'%s' contradicts '%s'", path, explicit_from);
            }
            explicit_mode = m;
            explicit_from = k ? "chat_template_kwargs.enable_thinking" : "chat_template_kwargs.thinking";
        }
    }
    json_t *re = get(root, "reasoning_effort");
    int level = 0;
    bool effort_none = false;
    if (re) {
        if (json_is_integer(re)) {
            long long v = json_integer_value(re);
            if (v < 1 || v > 100)
                return bad(err, "reasoning_effort", "invalid_value",
                           "'reasoning_effort' as a number must be in [1, 100], got %lld", v);
            level = (int)v;
        } else if (json_is_string(re)) {
            static const struct {
                const char *name;
                int level;
            } map[] = {{"none", 0},  {"minimal", 25}, {"low", 50}, {"medium", 75},
                       {"high", 75}, {"xhigh", 100},  {"max", 100}};
            const char *s = json_string_value(re);
            size_t i;
            for (i = 0; i < sizeof map / sizeof map[0]; i++)
                if (strcmp(s, map[i].name) == 0) break;
            if (i == sizeof map / sizeof map[0])
                return bad(err, "reasoning_effort", "invalid_value",
                           "'reasoning_effort' must be none, minimal, low, medium, high, xhigh, max "
                           "or 1..100, not '%s'",
                           s);
            level = map[i].level;
            effort_none = level == 0;
        } else {
            return type_error(err, "reasoning_effort", "a string or an integer", re);
        }
    }
    if (effort_none) {
        if (explicit_mode == DS41_THINKING_ENABLED)
            return bad(err, "reasoning_effort", "invalid_value",
                       "'reasoning_effort' 'none' contradicts '%s' enabled", explicit_from);
        *mode = DS41_THINKING_DISABLED;
        return 0;
    }
    if (level) {
        if (explicit_mode == DS41_THINKING_DISABLED)
            return bad(err, "reasoning_effort", "invalid_value",
                       "'reasoning_effort' needs thinking, but '%s' disables it", explicit_from);
        *mode = DS41_THINKING_ENABLED;
        *effort = level;
        return 0;
    }
    *mode = explicit_mode;
    return 0;
}

/* --------------------------------------------------------- common sampling */

static int parse_stop(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    json_t *st = get(root, "stop");
    if (!st) return 0;
    size_t n;
    if (json_is_string(st))
        n = 1;
    else if (json_is_array(st))
        n = json_array_size(st);
    else
        return type_error(err, "stop", "a string or an array of strings", st);
    if (n > MAX_STOP) return bad(err, "stop", "invalid_value", "at most %d stop strings", MAX_STOP);
    if (n == 0) return 0;
    r->stop = calloc(n, sizeof *r->stop);
    if (!r->stop) return oom(err);
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_is_string(st) ? st : json_array_get(st, i);
        char path[32];
        if (json_is_string(st))
            snprintf(path, sizeof path, "stop");
        else
            index_path(path, sizeof path, "stop", i);
        if (!json_is_string(s)) return type_error(err, path, "a string", s);
        size_t len = json_string_length(s);
        if (len == 0 || len > MAX_STOP_BYTES)
            return bad(err, path, "invalid_value", "stop strings must have 1..%d bytes", MAX_STOP_BYTES);
        if (memchr(json_string_value(s), 0, len))
            return bad(err, path, "invalid_value", "stop strings must not contain NUL");
        r->stop[i] = strdup(json_string_value(s));
        if (!r->stop[i]) return oom(err);
        r->gen.n_stop = i + 1;
    }
    r->gen.stop = (const char *const *)r->stop;
    return 0;
}

static int parse_logit_bias(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    json_t *lb = get(root, "logit_bias");
    if (!lb) return 0;
    if (!json_is_object(lb)) return type_error(err, "logit_bias", "an object", lb);
    size_t n = json_object_size(lb);
    if (n > MAX_LOGIT_BIAS)
        return bad(err, "logit_bias", "invalid_value", "at most %d logit_bias entries", MAX_LOGIT_BIAS);
    if (n == 0) return 0;
    r->logit_bias = calloc(n, sizeof *r->logit_bias);
    if (!r->logit_bias) return oom(err);
    const char *key;
    json_t *v;
    size_t i = 0;
    json_object_foreach(lb, key, v) {
        char path[64];
        snprintf(path, sizeof path, "logit_bias.%.40s", key);
        size_t kl = strlen(key);
        bool digits = kl > 0 && kl <= 10;
        for (size_t k = 0; digits && k < kl; k++) digits = key[k] >= '0' && key[k] <= '9';
        long long tok = digits ? strtoll(key, NULL, 10) : -1;
        if (!digits || tok > INT32_MAX)
            return bad(err, path, "invalid_value", "logit_bias keys must be token ids (0..%d)", INT32_MAX);
        if (!json_is_number(v)) return type_error(err, path, "a number", v);
        double b = json_number_value(v);
        if (!(b >= -100.0 && b <= 100.0))
            return bad(err, path, "invalid_value", "logit_bias values must be in [-100, 100]");
        r->logit_bias[i].token = (int32_t)tok;
        r->logit_bias[i].bias = (float)b;
        i++;
    }
    r->gen.logit_bias = r->logit_bias;
    r->gen.n_logit_bias = i;
    return 0;
}

/* cache_salt: the prefix-cache partition of the request within its peer's (issue 13). */
static int parse_cache_salt(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    json_t *cs = get(root, "cache_salt");
    if (!cs) return 0;
    if (!json_is_string(cs)) return type_error(err, "cache_salt", "a string", cs);
    size_t len = json_string_length(cs);
    if (len == 0 || len > MAX_CACHE_SALT_BYTES)
        return bad(err, "cache_salt", "invalid_value", "'cache_salt' must have 1..%d bytes",
                   MAX_CACHE_SALT_BYTES);
    if (memchr(json_string_value(cs), 0, len))
        return bad(err, "cache_salt", "invalid_value", "'cache_salt' must not contain NUL");
    if (dup_string(json_string_value(cs), &r->cache_salt, err)) return -1;
    r->gen.cache_salt = r->cache_salt;
    return 0;
}

static int parse_common(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    ds41_gen_request *g = &r->gen;
    const char *s;
    if (ds41_api_get_string(root, NULL, "model", false, &s, err) || dup_string(s, &r->model, err)) return -1;
    g->model = r->model;
    if (get_number(root, "temperature", 0, false, 2, &g->temperature, err) ||
        get_number(root, "top_p", 0, false, 1, &g->top_p, err) ||
        get_number(root, "min_p", 0, false, 1, &g->min_p, err) ||
        get_number(root, "repetition_penalty", 0, true, 100, &g->repetition_penalty, err) ||
        get_number(root, "presence_penalty", -2, false, 2, &g->presence_penalty, err) ||
        get_number(root, "frequency_penalty", -2, false, 2, &g->frequency_penalty, err))
        return -1;
    bool has;
    long long v;
    if (ds41_api_get_int(root, NULL, "top_k", -1, INT32_MAX, &has, &v, err)) return -1;
    g->top_k = has && v > 0 ? (int32_t)v : 0;
    if (ds41_api_get_int(root, NULL, "seed", LLONG_MIN, LLONG_MAX, &has, &v, err)) return -1;
    g->has_seed = has;
    g->seed = has ? (int64_t)v : 0;
    if (ds41_api_get_int(root, NULL, "n", 1, 1, &has, &v, err)) {
        if (json_is_integer(json_object_get(root, "n")))
            bad(err, "n", "invalid_value", "only n = 1 is supported");
        return -1;
    }
    bool b;
    if (ds41_api_get_bool(root, NULL, "stream", &has, &b, err)) return -1;
    g->stream = has && b;
    if (ds41_api_get_bool(root, NULL, "ignore_eos", &has, &b, err)) return -1;
    g->ignore_eos = has && b;
    if (ds41_api_get_bool(root, NULL, "skip_special_tokens", &has, &b, err)) return -1;
    g->keep_special_tokens = has && !b;
    json_t *so = get(root, "stream_options");
    if (so) {
        if (!json_is_object(so)) return type_error(err, "stream_options", "an object", so);
        if (!g->stream)
            return bad(err, "stream_options", "invalid_value", "'stream_options' needs 'stream': true");
        static const char *const keys[] = {"include_usage", "include_obfuscation", NULL};
        bool has_ob, ob;
        if (ds41_api_check_keys(so, "stream_options", keys, err) ||
            ds41_api_get_bool(so, "stream_options", "include_usage", &has, &b, err) ||
            ds41_api_get_bool(so, "stream_options", "include_obfuscation", &has_ob, &ob, err))
            return -1;
        r->include_usage = has && b;
    }
    if (ds41_api_get_string(root, NULL, "user", false, &s, err) || dup_string(s, &r->user, err)) return -1;
    g->user = r->user;
    if (ds41_api_get_string(root, NULL, "ds41_forced_output", false, &s, err) || dup_string(s, &r->forced_output, err))
        return -1;
    g->forced_output = r->forced_output;
    if (parse_stop(root, r, err) || parse_logit_bias(root, r, err) || parse_cache_salt(root, r, err))
        return -1;
    if (ds41_api_get_int(root, NULL, "min_tokens", 0, UINT32_MAX, &has, &v, err)) return -1;
    g->min_tokens = has ? (uint32_t)v : 0;
    /* hints of llama-server (cache_prompt: ds41 always reuses cached prefixes) and Ollama
     * (keep_alive: the model stays loaded until unloaded); accepted, not acted on */
    if (ds41_api_get_bool(root, NULL, "cache_prompt", &has, &b, err)) return -1;
    if (has) g->ignored_hints |= DS41_HINT_CACHE_PROMPT;
    json_t *ka = get(root, "keep_alive");
    if (ka && !json_is_string(ka) && !json_is_number(ka) && !json_is_null(ka))
        return type_error(err, "keep_alive", "a duration (string or number)", ka);
    if (ka) g->ignored_hints |= DS41_HINT_KEEP_ALIVE;
    return 0;
}

/* min_tokens may not exceed max_tokens (nothing could satisfy both). */
static int check_min_tokens(const ds41_gen_request *g, ds41_svc_error *err) {
    if (g->max_tokens && g->min_tokens > g->max_tokens)
        return bad(err, "min_tokens", "invalid_value", "'min_tokens' (%u) exceeds 'max_tokens' (%u)",
                   g->min_tokens, g->max_tokens);
    return 0;
}

static void request_init(ds41_api_request *r) {
    memset(r, 0, sizeof *r);
    r->gen.parallel_tool_calls = true;
    r->gen.peer_uid = -1; /* the caller fills in the peer's credentials */
}

void ds41_api_request_free(ds41_api_request *r) {
    if (!r) return;
    free(r->model);
    free(r->messages_json);
    free(r->tools_json);
    free(r->tool_choice_json);
    free(r->response_format_json);
    free(r->prompt);
    free(r->prompt_tokens);
    if (r->stop)
        for (size_t i = 0; i < r->gen.n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->logit_bias);
    free(r->user);
    free(r->forced_output);
    free(r->cache_salt);
    memset(r, 0, sizeof *r);
}

/* ------------------------------------------------------------------- chat */

static const char *const chat_keys[] = {"messages",
                                        "model",
                                        "temperature",
                                        "top_p",
                                        "max_tokens",
                                        "max_completion_tokens",
                                        "stop",
                                        "seed",
                                        "logit_bias",
                                        "logprobs",
                                        "top_logprobs",
                                        "tools",
                                        "tool_choice",
                                        "response_format",
                                        "stream",
                                        "stream_options",
                                        "n",
                                        "presence_penalty",
                                        "frequency_penalty",
                                        "user",
                                        "parallel_tool_calls",
                                        "reasoning_effort",
                                        "thinking",
                                        "chat_template_kwargs",
                                        "top_k",
                                        "min_p",
                                        "repetition_penalty",
                                        "ignore_eos",
                                        "skip_special_tokens",
                                        "ds41_forced_output",
                                        "cache_salt",
                                        "min_tokens",
                                        "cache_prompt",
                                        "keep_alive",
                                        "store",
                                        "metadata",
                                        "service_tier",
                                        "modalities",
                                        "prompt_cache_key",
                                        "safety_identifier",
                                        "verbosity",
                                        "audio",
                                        "prediction",
                                        "web_search_options",
                                        "functions",
                                        "function_call",
                                        NULL};

static int parse_ignored_chat_fields(const json_t *root, ds41_svc_error *err) {
    bool has, b;
    const char *s;
    if (ds41_api_get_bool(root, NULL, "store", &has, &b, err) ||
        ds41_api_get_string(root, NULL, "service_tier", false, &s, err) ||
        ds41_api_get_string(root, NULL, "prompt_cache_key", false, &s, err) ||
        ds41_api_get_string(root, NULL, "safety_identifier", false, &s, err) ||
        ds41_api_get_string(root, NULL, "verbosity", false, &s, err))
        return -1;
    json_t *md = get(root, "metadata");
    if (md) {
        if (!json_is_object(md)) return type_error(err, "metadata", "an object", md);
        const char *key;
        json_t *v;
        json_object_foreach(md, key, v) {
            char path[96];
            snprintf(path, sizeof path, "metadata.%.64s", key);
            if (!json_is_string(v)) return type_error(err, path, "a string", v);
        }
    }
    json_t *mod = get(root, "modalities");
    if (mod) {
        if (!json_is_array(mod)) return type_error(err, "modalities", "an array", mod);
        size_t i;
        json_t *v;
        json_array_foreach(mod, i, v) {
            char path[32];
            index_path(path, sizeof path, "modalities", i);
            if (!json_is_string(v)) return type_error(err, path, "a string", v);
            if (strcmp(json_string_value(v), "text") != 0)
                return bad(err, path, "unsupported_parameter", "only the 'text' modality is supported");
        }
    }
    if (refuse_if_set(root, "audio", "this model produces text only", err) ||
        refuse_if_set(root, "prediction", "predicted outputs are not implemented", err) ||
        refuse_if_set(root, "web_search_options", "there is no web search", err) ||
        refuse_if_set(root, "functions", "deprecated; use 'tools'", err) ||
        refuse_if_set(root, "function_call", "deprecated; use 'tool_choice'", err))
        return -1;
    return 0;
}

int ds41_api_parse_chat(const char *body, size_t len, ds41_api_request *out, ds41_svc_error *err) {
    request_init(out);
    json_t *root;
    if (ds41_api_parse_json(body, len, &root, err)) return -1;
    ds41_gen_request *g = &out->gen;
    g->kind = DS41_GEN_CHAT;
    json_t *names = NULL;
    if (ds41_api_check_keys(root, NULL, chat_keys, err) || parse_ignored_chat_fields(root, err) ||
        ds41_api_parse_messages(json_object_get(root, "messages"), &out->messages_json, err) ||
        parse_common(root, out, err))
        goto fail;
    g->messages_json = out->messages_json;
    bool has_mt, has_mct;
    long long mt = 0, mct = 0;
    if (ds41_api_get_int(root, NULL, "max_tokens", 1, UINT32_MAX, &has_mt, &mt, err) ||
        ds41_api_get_int(root, NULL, "max_completion_tokens", 1, UINT32_MAX, &has_mct, &mct, err))
        goto fail;
    if (has_mt && has_mct && mt != mct) {
        bad(err, "max_tokens", "invalid_value",
            "'max_tokens' (%lld) and 'max_completion_tokens' (%lld) disagree", mt, mct);
        goto fail;
    }
    g->max_tokens = (uint32_t)(has_mct ? mct : has_mt ? mt : 0);
    if (check_min_tokens(g, err)) goto fail;
    bool has, b;
    if (ds41_api_get_bool(root, NULL, "logprobs", &has, &b, err)) goto fail;
    g->logprobs = has && b;
    long long tl;
    if (ds41_api_get_int(root, NULL, "top_logprobs", 0, 20, &has, &tl, err)) goto fail;
    if (has && !g->logprobs) {
        bad(err, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
        goto fail;
    }
    g->top_logprobs = has ? (int)tl : 0;
    if (ds41_api_parse_tools(json_object_get(root, "tools"), &out->tools_json, &names, err) ||
        parse_tool_choice(root, names, &out->tool_choice_json, err) ||
        parse_response_format(root, &out->response_format_json, err))
        goto fail;
    g->tools_json = out->tools_json;
    g->tool_choice_json = out->tool_choice_json;
    g->response_format_json = out->response_format_json;
    if (ds41_api_get_bool(root, NULL, "parallel_tool_calls", &has, &b, err)) goto fail;
    g->parallel_tool_calls = has ? b : true;
    if (ds41_api_parse_thinking(root, &g->thinking, &g->reasoning_effort, err)) goto fail;
    json_decref(names);
    json_decref(root);
    return 0;
fail:
    json_decref(names);
    json_decref(root);
    ds41_api_request_free(out);
    return -1;
}

/* ------------------------------------------------------------- completions */

static const char *const completion_keys[] = {"model",
                                              "prompt",
                                              "suffix",
                                              "max_tokens",
                                              "temperature",
                                              "top_p",
                                              "n",
                                              "stream",
                                              "stream_options",
                                              "logprobs",
                                              "echo",
                                              "stop",
                                              "presence_penalty",
                                              "frequency_penalty",
                                              "best_of",
                                              "logit_bias",
                                              "seed",
                                              "user",
                                              "top_k",
                                              "min_p",
                                              "repetition_penalty",
                                              "ignore_eos",
                                              "skip_special_tokens",
                                              "ds41_forced_output",
                                              "cache_salt",
                                              "min_tokens",
                                              "cache_prompt",
                                              "keep_alive",
                                              NULL};

static int parse_token_ids(const json_t *arr, const char *path, ds41_api_request *r, ds41_svc_error *err) {
    size_t n = json_array_size(arr);
    if (n == 0) return bad(err, path, "invalid_value", "'%s' must not be empty", path);
    r->prompt_tokens = malloc(n * sizeof *r->prompt_tokens);
    if (!r->prompt_tokens) return oom(err);
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(arr, i);
        char p[64];
        index_path(p, sizeof p, path, i);
        if (!json_is_integer(t)) return type_error(err, p, "a token id (integer)", t);
        long long v = json_integer_value(t);
        if (v < 0 || v > INT32_MAX)
            return bad(err, p, "invalid_value", "token ids must be in [0, %d]", INT32_MAX);
        r->prompt_tokens[i] = (int32_t)v;
    }
    r->gen.prompt_tokens = r->prompt_tokens;
    r->gen.n_prompt_tokens = n;
    return 0;
}

static int set_prompt_text(const json_t *s, ds41_api_request *r, ds41_svc_error *err) {
    size_t n = json_string_length(s);
    r->prompt = malloc(n + 1);
    if (!r->prompt) return oom(err);
    memcpy(r->prompt, json_string_value(s), n + 1);
    r->gen.prompt = r->prompt;
    r->gen.prompt_len = n;
    return 0;
}

static int parse_prompt(const json_t *root, ds41_api_request *r, ds41_svc_error *err) {
    json_t *p = get(root, "prompt");
    if (!p) return bad(err, "prompt", "missing_field", "'prompt' is required");
    if (json_is_string(p)) return set_prompt_text(p, r, err);
    if (!json_is_array(p))
        return type_error(err, "prompt", "a string, an array of token ids or an array of one of those", p);
    if (json_array_size(p) == 0) return bad(err, "prompt", "invalid_value", "'prompt' must not be empty");
    json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) return parse_token_ids(p, "prompt", r, err);
    if (json_array_size(p) != 1)
        return bad(err, "prompt", "invalid_value", "only one prompt per request is supported (n = 1)");
    if (json_is_string(first)) return set_prompt_text(first, r, err);
    if (json_is_array(first)) return parse_token_ids(first, "prompt[0]", r, err);
    return type_error(err, "prompt[0]", "a string or an array of token ids", first);
}

int ds41_api_parse_completion(const char *body, size_t len, unsigned default_max_tokens,
                              ds41_api_request *out, ds41_svc_error *err) {
    request_init(out);
    json_t *root;
    if (ds41_api_parse_json(body, len, &root, err)) return -1;
    ds41_gen_request *g = &out->gen;
    g->kind = DS41_GEN_COMPLETION;
    if (ds41_api_check_keys(root, NULL, completion_keys, err) || parse_prompt(root, out, err) ||
        parse_common(root, out, err))
        goto fail;
    const char *suffix;
    if (ds41_api_get_string(root, NULL, "suffix", false, &suffix, err)) goto fail;
    if (suffix && *suffix) {
        bad(err, "suffix", "unsupported_parameter", "'suffix' (fill in the middle) is not supported");
        goto fail;
    }
    bool has;
    long long v;
    if (ds41_api_get_int(root, NULL, "best_of", 1, 1, &has, &v, err)) {
        if (json_is_integer(json_object_get(root, "best_of")))
            bad(err, "best_of", "invalid_value", "only best_of = 1 is supported");
        goto fail;
    }
    if (ds41_api_get_int(root, NULL, "max_tokens", 1, UINT32_MAX, &has, &v, err)) goto fail;
    g->max_tokens = has ? (uint32_t)v : (default_max_tokens ? default_max_tokens : 16);
    if (check_min_tokens(g, err)) goto fail;
    if (ds41_api_get_int(root, NULL, "logprobs", 0, 20, &has, &v, err)) goto fail;
    g->logprobs = has;
    g->top_logprobs = has ? (int)v : 0;
    bool echo;
    if (ds41_api_get_bool(root, NULL, "echo", &has, &echo, err)) goto fail;
    out->echo = has && echo;
    if (out->echo && !g->prompt) {
        bad(err, "echo", "unsupported_parameter", "'echo' needs a text prompt");
        goto fail;
    }
    if (out->echo && g->logprobs) {
        bad(err, "echo", "unsupported_parameter",
            "'echo' with 'logprobs' (prompt logprobs) is not supported");
        goto fail;
    }
    json_decref(root);
    return 0;
fail:
    json_decref(root);
    ds41_api_request_free(out);
    return -1;
}
