/* V4.1 chat encoding: messages -> prompt (the parser is chat_parse.c).  The structure follows the official encoder step by step (process images ->
 * merge tool messages -> sort tool results -> drop thinking -> render each message), working on
 * jansson copies of the messages the way the Python works on dict copies, so that every corner
 * behaves the same.  Comments name the Python function each part reproduces. */
#include "engine/text/chat.h"
#include "engine/text/chat_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/pyjson.h"


#define EFFORT_TEMPLATE_HEAD "Reasoning Effort: "
#define EFFORT_TEMPLATE_TAIL " (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
#define RESPONSE_FORMAT_HEAD "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

/* REFERENCE §11.1: the tools block around the schema lines. */
static const char TOOLS_HEAD[] =
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by "
    "writing a \"<｜DSML｜ calls>\" block like the following:\n"
    "\n"
    "<｜DSML｜ calls>\n"
    "<｜DSML｜ invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜ parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜ "
    "parameter>\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    "<｜DSML｜ invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n"
    "\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types "
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n"
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n";
static const char TOOLS_TAIL[] =
    "\n"
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

/* DS_TASK_SP_TOKENS, in the order the error message lists them. */
static const struct {
    const char *name;
    const char *token;
} TASKS[] = {
    {"action", "<｜action｜>"}, {"query", "<｜query｜>"}, {"authority", "<｜authority｜>"},
    {"domain", "<｜domain｜>"}, {"title", "<｜title｜>"}, {"read_url", "<｜read_url｜>"},
};
#define N_TASKS (sizeof TASKS / sizeof TASKS[0])

/* Where a working message came from ("messages[3]"), kept in the copy under a key no encoder code
 * reads, for error messages. */
static const char ORIGIN_KEY[] = "\x01" "ds41-origin";

/* ---- small helpers over jansson values, with Python semantics ---- */

static json_t *get(const json_t *obj, const char *key) {
    return json_is_object(obj) ? json_object_get(obj, key) : NULL;
}

static bool has_key(const json_t *obj, const char *key) {
    return get(obj, key) != NULL;
}

/* Python truthiness. */
static bool truthy(const json_t *v) {
    if (!v) return false;
    switch (json_typeof(v)) {
    case JSON_NULL:
    case JSON_FALSE: return false;
    case JSON_TRUE: return true;
    case JSON_INTEGER: return json_integer_value(v) != 0;
    case JSON_REAL: return json_real_value(v) != 0.0;
    case JSON_STRING: return json_string_length(v) > 0;
    case JSON_ARRAY: return json_array_size(v) > 0;
    case JSON_OBJECT: return json_object_size(v) > 0;
    }
    return false;
}

/* `x is None` for msg.get(key): missing or null. */
static bool is_none(const json_t *v) {
    return !v || json_is_null(v);
}

static bool str_eq(const json_t *v, const char *s) {
    size_t n = strlen(s);
    return json_is_string(v) && json_string_length(v) == n && memcmp(json_string_value(v), s, n) == 0;
}

static bool role_is(const json_t *msg, const char *role) {
    return str_eq(get(msg, "role"), role);
}

static bool contains(const char *hay, size_t hay_len, const char *needle) {
    return memmem(hay, hay_len, needle, strlen(needle)) != NULL;
}

static const char *origin(const json_t *msg) {
    const json_t *o = get(msg, ORIGIN_KEY);
    return json_is_string(o) ? json_string_value(o) : "a message";
}

/* ds41's own error about a message: "messages[2]: ...". */
__attribute__((format(printf, 3, 4))) static int fail_msg(ds41_error *err, const json_t *msg, const char *fmt,
                                                          ...) {
    if (!err) return -1;
    va_list ap;
    va_start(ap, fmt);
    ds41_vfail(err, fmt, ap);
    va_end(ap);
    return ds41_error_prefix(err, "%s", origin(msg));
}

/* str(v) into out (str.format / f-string of a value). */
static int put_str(ds41_buf *out, const json_t *v, ds41_error *err) {
    if (!v) {
        ds41_buf_puts(out, "None");
        return 0;
    }
    if (json_is_string(v)) {
        ds41_buf_put(out, json_string_value(v), json_string_length(v));
        return 0;
    }
    ds41_py *p = ds41_py_from_json(v, err);
    if (!p) return -1;
    ds41_py_str(p, out);
    ds41_py_free(p);
    return 0;
}

/* `x or ""` formatted: "" for falsy values, else str(x). */
static int put_str_or_empty(ds41_buf *out, const json_t *v, ds41_error *err) {
    return truthy(v) ? put_str(out, v, err) : 0;
}

/* str(v) as a C string for an error message (cut to fit). */
static void str_for_message(const json_t *v, char *dst, size_t cap) {
    ds41_buf b = {0};
    ds41_error ignored;
    if (put_str(&b, v, &ignored) != 0 || b.oom || !b.data) {
        snprintf(dst, cap, "?");
    } else {
        size_t n = ds41_utf8_cut(b.data, b.len, cap - 1);
        memcpy(dst, b.data, n);
        dst[n] = 0;
    }
    ds41_buf_free(&b);
}

/* json.dumps(v, ensure_ascii=False) into out. */
static int put_json(ds41_buf *out, const json_t *v, ds41_error *err) {
    ds41_py *p = ds41_py_from_json(v, err);
    if (!p) return -1;
    ds41_py_dumps(p, out);
    ds41_py_free(p);
    return 0;
}

/* A new array holding a's items then b's (shared references). */
static json_t *concat(const json_t *a, const json_t *b) {
    json_t *r = json_array();
    if (!r) return NULL;
    if ((a && json_array_extend(r, (json_t *)a) != 0) || (b && json_array_extend(r, (json_t *)b) != 0)) {
        json_decref(r);
        return NULL;
    }
    return r;
}

/* ---- reasoning effort (render_reasoning_effort) ---- */

int ds41_chat_mode_parse(const char *name, ds41_chat_mode *mode, ds41_error *err) {
    if (name && strcmp(name, "chat") == 0) {
        *mode = DS41_CHAT_MODE_CHAT;
        return 0;
    }
    if (name && strcmp(name, "thinking") == 0) {
        *mode = DS41_CHAT_MODE_THINKING;
        return 0;
    }
    if (!name) return ds41_fail(err, "Invalid thinking_mode `None`");
    return ds41_fail(err, "Invalid thinking_mode `%.*s`", (int)ds41_utf8_cut(name, strlen(name), MAX_NAME), name);
}

int ds41_chat_reasoning_effort(const json_t *effort, int *budget, ds41_error *err) {
    if (is_none(effort)) {
        *budget = 75;
        return 0;
    }
    if (json_is_integer(effort) && json_integer_value(effort) >= 1 && json_integer_value(effort) <= 100) {
        *budget = (int)json_integer_value(effort);
        return 0;
    }
    if (str_eq(effort, "low") || str_eq(effort, "high") || str_eq(effort, "max")) {
        *budget = str_eq(effort, "low") ? 50 : str_eq(effort, "high") ? 75 : 100;
        return 0;
    }
    char shown[256];
    str_for_message(effort, shown, sizeof shown);
    return ds41_fail(err,
                     "Invalid reasoning effort for deepseek_v41: %s, should be int within [1,100] or ['low', "
                     "'high', 'max']",
                     shown);
}

/* ---- images (process_image_messages) ---- */

/* _extract_image: the image record of an image / image_url block. */
static json_t *extract_image(const json_t *msg, const json_t *block, ds41_error *err) {
    json_t *rec = json_pack("{s:s}", "type", "image");
    if (!rec) {
        oom(err);
        return NULL;
    }
    if (str_eq(get(block, "type"), "image_url")) {
        const json_t *iu = get(block, "image_url");
        json_t *url;
        if (json_is_string(iu)) {
            url = json_incref((json_t *)iu);
        } else if (!truthy(iu)) {
            url = json_string("");
        } else if (json_is_object(iu)) {
            url = get(iu, "url") ? json_incref(get(iu, "url")) : json_string("");
        } else {
            json_decref(rec);
            fail_msg(err, msg, "image_url block: 'image_url' must be a string or an object");
            return NULL;
        }
        if (!url || json_object_set_new(rec, "url", url) != 0) {
            json_decref(rec);
            oom(err);
            return NULL;
        }
    } else {
        static const char *const keys[] = {"source", "url", "data"};
        for (size_t i = 0; i < 3; i++)
            if (has_key(block, keys[i]) && json_object_set(rec, keys[i], get(block, keys[i])) != 0) {
                json_decref(rec);
                oom(err);
                return NULL;
            }
    }
    if (!truthy(get(rec, "source")) && !truthy(get(rec, "url")) && !truthy(get(rec, "data"))) {
        json_decref(rec);
        ds41_fail(err, "Image block does not contain a valid source");
        return NULL;
    }
    return rec;
}

/* _process_image_blocks: image blocks become placeholder text blocks (their records appended to
 * images, when not NULL); text blocks are checked for a literal placeholder. */
static json_t *process_blocks(const json_t *msg, const json_t *blocks, json_t *images, int depth,
                              ds41_error *err) {
    if (depth > DS41_PY_MAX_DEPTH) {
        fail_msg(err, msg, "content blocks nested deeper than %d levels", DS41_PY_MAX_DEPTH);
        return NULL;
    }
    json_t *out = json_array();
    if (!out) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *block;
    json_array_foreach(blocks, i, block) {
        json_t *item = NULL;
        const json_t *type = get(block, "type");
        if (!json_is_object(block)) {
            item = json_incref(block);
        } else if (str_eq(type, "image") || str_eq(type, "image_url")) {
            json_t *rec = extract_image(msg, block, err);
            if (!rec) goto fail;
            if (images && json_array_append_new(images, rec) != 0) {
                oom(err);
                goto fail;
            }
            if (!images) json_decref(rec);
            item = json_pack("{s:s, s:s}", "type", "text", "text", DS41_CHAT_IMAGE);
        } else if (str_eq(type, "tool_result") && json_is_array(get(block, "content"))) {
            json_t *inner = process_blocks(msg, get(block, "content"), images, depth + 1, err);
            if (!inner) goto fail;
            item = json_copy(block);
            if (!item || json_object_set_new(item, "content", inner) != 0) {
                if (!item) json_decref(inner);
                json_decref(item);
                oom(err);
                goto fail;
            }
        } else if (str_eq(type, "text")) {
            const json_t *text = get(block, "text");
            if (text && !json_is_string(text) && !json_is_null(text)) {
                fail_msg(err, msg, "a text content block's 'text' must be a string");
                goto fail;
            }
            if (json_is_string(text) && contains(json_string_value(text), json_string_length(text), DS41_CHAT_IMAGE)) {
                size_t n = ds41_utf8_prefix(json_string_value(text), json_string_length(text), 100);
                ds41_fail(err,
                          "Text block contains image placeholder '" DS41_CHAT_IMAGE
                          "': '%.*s'. Images should be separate content blocks.",
                          (int)n, json_string_value(text));
                goto fail;
            }
            item = json_incref(block);
        } else {
            item = json_incref(block);
        }
        if (!item || json_array_append_new(out, item) != 0) {
            oom(err);
            goto fail;
        }
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* The texts of a block list joined by "\n\n" (process_image_messages' new `content`). */
static json_t *join_text_blocks(const json_t *msg, const json_t *blocks, ds41_error *err) {
    ds41_buf b = {0};
    bool first = true;
    size_t i;
    json_t *block;
    json_array_foreach(blocks, i, block) {
        if (!json_is_object(block) || !str_eq(get(block, "type"), "text")) continue;
        const json_t *text = get(block, "text");
        if (text && !json_is_string(text)) {
            ds41_buf_free(&b);
            fail_msg(err, msg, "a text content block's 'text' must be a string");
            return NULL;
        }
        if (!first) ds41_buf_puts(&b, "\n\n");
        first = false;
        if (text) ds41_buf_put(&b, json_string_value(text), json_string_length(text));
    }
    size_t len = 0;
    char *s = ds41_buf_take(&b, &len);
    json_t *r = s ? json_stringn_nocheck(s, len) : NULL;
    free(s);
    if (!r) oom(err);
    return r;
}

/* process_image_messages over one list; new message copies.  images may be NULL (context). */
static json_t *process_image_messages(const json_t *list, json_t *images, ds41_error *err) {
    json_t *out = json_array();
    if (!out) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *orig;
    json_array_foreach(list, i, orig) {
        json_t *msg = json_deep_copy(orig);
        if (!msg || json_array_append_new(out, msg) != 0) {
            oom(err);
            goto fail;
        }
        const json_t *content = get(msg, "content");
        if (json_is_string(content) &&
            contains(json_string_value(content), json_string_length(content), DS41_CHAT_IMAGE)) {
            ds41_fail(err, "Message content contains image special token '" DS41_CHAT_IMAGE
                           "'. Images should be provided as image content blocks.");
            goto fail;
        }
        const json_t *rc = get(msg, "reasoning_content");
        if (json_is_string(rc) && contains(json_string_value(rc), json_string_length(rc), DS41_CHAT_IMAGE)) {
            ds41_fail(err, "reasoning_content contains image special token '" DS41_CHAT_IMAGE "'");
            goto fail;
        }
        if (json_is_array(content) && !has_key(msg, "content_blocks")) {
            json_t *blocks = json_incref((json_t *)content);
            json_object_del(msg, "content");
            if (json_object_set_new(msg, "content_blocks", blocks) != 0) {
                oom(err);
                goto fail;
            }
        }
        const json_t *blocks = get(msg, "content_blocks");
        if (truthy(blocks)) {
            if (!json_is_array(blocks)) {
                fail_msg(err, msg, "content_blocks must be a list");
                goto fail;
            }
            json_t *processed = process_blocks(msg, blocks, images, 0, err);
            if (!processed) goto fail;
            if (json_object_set_new(msg, "content_blocks", processed) != 0) {
                oom(err);
                goto fail;
            }
            if (!json_is_string(get(msg, "content"))) {
                json_t *joined = join_text_blocks(msg, processed, err);
                if (!joined) goto fail;
                if (json_object_set_new(msg, "content", joined) != 0) {
                    oom(err);
                    goto fail;
                }
            }
        }
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* ---- merge_tool_messages ---- */

/* list holds this renderer's private copies (process_image_messages made them), so unlike the
 * Python it does not copy again: it takes references and may change those messages. */
static json_t *merge_tool_messages(const json_t *list, ds41_error *err) {
    json_t *merged = json_array();
    if (!merged) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *orig;
    json_array_foreach(list, i, orig) {
        json_t *msg = json_incref(orig);
        size_t n = json_array_size(merged);
        json_t *last = n ? json_array_get(merged, n - 1) : NULL;
        bool last_is_user = last && role_is(last, "user") && has_key(last, "content_blocks");
        if (role_is(msg, "tool")) {
            const json_t *id = get(msg, "tool_call_id");
            const json_t *content = get(msg, "content");
            json_t *block = json_pack("{s:s, s:o, s:o}", "type", "tool_result", "tool_use_id",
                                      id ? json_incref((json_t *)id) : json_string(""), "content",
                                      content ? json_incref((json_t *)content) : json_string(""));
            if (!block) {
                json_decref(msg);
                oom(err);
                goto fail;
            }
            if (last_is_user) {
                json_t *lb = get(last, "content_blocks");
                if (!json_is_array(lb)) {
                    json_decref(block);
                    fail_msg(err, msg, "content_blocks must be a list");
                    json_decref(msg);
                    goto fail;
                }
                if (json_array_append_new(lb, block) != 0) {
                    json_decref(msg);
                    oom(err);
                    goto fail;
                }
            } else {
                json_t *user = json_pack("{s:s, s:[o], s:O}", "role", "user", "content_blocks", block, ORIGIN_KEY,
                                         get(msg, ORIGIN_KEY) ? get(msg, ORIGIN_KEY) : json_null());
                if (!user || json_array_append_new(merged, user) != 0) {
                    json_decref(msg);
                    oom(err);
                    goto fail;
                }
            }
            json_decref(msg);
        } else if (role_is(msg, "user")) {
            json_t *blocks = get(msg, "content_blocks");
            if (is_none(blocks)) {
                const json_t *content = get(msg, "content");
                blocks = json_pack("[{s:s, s:o}]", "type", "text", "text",
                                   content ? json_incref((json_t *)content) : json_string(""));
                if (!blocks || json_object_set_new(msg, "content_blocks", blocks) != 0) {
                    json_decref(msg);
                    oom(err);
                    goto fail;
                }
            } else if (!json_is_array(blocks)) {
                fail_msg(err, msg, "content_blocks must be a list");
                json_decref(msg);
                goto fail;
            }
            if (last_is_user && is_none(get(last, "task"))) {
                json_t *lb = get(last, "content_blocks");
                if (!json_is_array(lb)) {
                    fail_msg(err, last, "content_blocks must be a list");
                    json_decref(msg);
                    goto fail;
                }
                if (json_array_extend(lb, blocks) != 0) {
                    json_decref(msg);
                    oom(err);
                    goto fail;
                }
                json_decref(msg);
            } else if (json_array_append_new(merged, msg) != 0) {
                oom(err);
                goto fail;
            }
        } else if (json_array_append_new(merged, msg) != 0) {
            oom(err);
            goto fail;
        }
    }
    return merged;
fail:
    json_decref(merged);
    return NULL;
}

/* ---- sort_tool_results_by_call_order ---- */

/* Python dict-key equality for JSON scalars (1 == 1.0 == True). */
static bool key_equal(const json_t *a, const json_t *b) {
    if (json_is_string(a) || json_is_string(b))
        return json_is_string(a) && json_is_string(b) && json_string_length(a) == json_string_length(b) &&
               memcmp(json_string_value(a), json_string_value(b), json_string_length(a)) == 0;
    if (json_is_null(a) || json_is_null(b)) return json_is_null(a) && json_is_null(b);
    bool an = json_is_number(a) || json_is_boolean(a), bn = json_is_number(b) || json_is_boolean(b);
    if (!an || !bn) return false;
    if (json_is_real(a) || json_is_real(b)) {
        double x = json_is_real(a) ? json_real_value(a) : json_is_integer(a) ? (double)json_integer_value(a) : json_is_true(a);
        double y = json_is_real(b) ? json_real_value(b) : json_is_integer(b) ? (double)json_integer_value(b) : json_is_true(b);
        if (x != y) return false;
        /* an int compares equal to a float only when the float is exactly it */
        const json_t *i = json_is_integer(a) ? a : json_is_integer(b) ? b : NULL;
        if (!i) return true;
        double f = json_is_real(a) ? json_real_value(a) : json_real_value(b);
        return f >= -9223372036854775808.0 && f < 9223372036854775808.0 && (json_int_t)f == json_integer_value(i);
    }
    json_int_t x = json_is_integer(a) ? json_integer_value(a) : json_is_true(a);
    json_int_t y = json_is_integer(b) ? json_integer_value(b) : json_is_true(b);
    return x == y;
}

static bool hashable(const json_t *v) {
    return !json_is_array(v) && !json_is_object(v);
}

typedef struct call_order {
    const json_t **ids;
    size_t *index;
    size_t n, cap;
} call_order;

static size_t order_lookup(const call_order *o, const json_t *id) {
    for (size_t i = 0; i < o->n; i++)
        if (key_equal(o->ids[i], id)) return o->index[i];
    return 0;
}

typedef struct keyed_block {
    size_t key;
    size_t pos;
    json_t *block;
} keyed_block;

static int cmp_keyed(const void *a, const void *b) {
    const keyed_block *x = a, *y = b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos; /* stable, as Python's sorted */
}

static int sort_tool_results(json_t *list, ds41_error *err) {
    call_order order = {0};
    int rc = -1;
    size_t i;
    json_t *msg;
    json_array_foreach(list, i, msg) {
        const json_t *calls = get(msg, "tool_calls");
        if (role_is(msg, "assistant") && truthy(calls)) {
            order.n = 0;
            if (!json_is_array(calls)) {
                fail_msg(err, msg, "tool_calls must be a list");
                goto done;
            }
            size_t idx;
            json_t *tc;
            json_array_foreach(calls, idx, tc) {
                if (!json_is_object(tc)) {
                    fail_msg(err, msg, "tool_calls[%zu] must be an object", idx);
                    goto done;
                }
                const json_t *id = get(tc, "id");
                if (!truthy(id)) {
                    const json_t *fn = get(tc, "function");
                    if (fn && !json_is_object(fn)) {
                        fail_msg(err, msg, "tool_calls[%zu].function must be an object", idx);
                        goto done;
                    }
                    id = get(fn, "id");
                }
                if (!truthy(id)) continue;
                if (!hashable(id)) {
                    fail_msg(err, msg, "tool_calls[%zu]: an id must be a string", idx);
                    goto done;
                }
                size_t k = 0;
                while (k < order.n && !key_equal(order.ids[k], id)) k++;
                if (k == order.n) {
                    if (order.n == order.cap) {
                        size_t nc = order.cap ? order.cap * 2 : 8;
                        const json_t **ni = realloc(order.ids, nc * sizeof *ni);
                        if (!ni) {
                            oom(err);
                            goto done;
                        }
                        order.ids = ni;
                        size_t *nx = realloc(order.index, nc * sizeof *nx);
                        if (!nx) {
                            oom(err);
                            goto done;
                        }
                        order.index = nx;
                        order.cap = nc;
                    }
                    order.ids[order.n++] = id;
                }
                order.index[k] = idx;
            }
        } else if (role_is(msg, "user") && truthy(get(msg, "content_blocks"))) {
            json_t *blocks = get(msg, "content_blocks");
            if (!json_is_array(blocks)) {
                fail_msg(err, msg, "content_blocks must be a list");
                goto done;
            }
            size_t n_results = 0, b;
            json_t *block;
            json_array_foreach(blocks, b, block) {
                if (!json_is_object(block)) {
                    fail_msg(err, msg, "content block %zu must be an object", b);
                    goto done;
                }
                if (str_eq(get(block, "type"), "tool_result")) n_results++;
            }
            if (n_results < 2 || order.n == 0) continue;
            keyed_block *kb = malloc(n_results * sizeof *kb);
            if (!kb) {
                oom(err);
                goto done;
            }
            size_t k = 0;
            json_array_foreach(blocks, b, block) {
                if (!str_eq(get(block, "type"), "tool_result")) continue;
                const json_t *use_id = get(block, "tool_use_id");
                json_t *empty = NULL;
                if (!use_id) use_id = empty = json_string("");
                if (!use_id || !hashable(use_id)) {
                    free(kb);
                    json_decref(empty);
                    if (!use_id) oom(err);
                    else fail_msg(err, msg, "a tool_call_id must be a string");
                    goto done;
                }
                kb[k] = (keyed_block){order_lookup(&order, use_id), k, json_incref(block)};
                json_decref(empty);
                k++;
            }
            qsort(kb, n_results, sizeof *kb, cmp_keyed);
            k = 0;
            json_array_foreach(blocks, b, block) {
                if (!str_eq(get(block, "type"), "tool_result")) continue;
                json_array_set_new(blocks, b, kb[k++].block);
            }
            free(kb);
        }
    }
    rc = 0;
done:
    free(order.ids);
    free(order.index);
    return rc;
}

/* ---- find_last_user_index, _drop_thinking_messages ---- */

static long find_last_user(const json_t *list) {
    for (size_t i = json_array_size(list); i-- > 0;) {
        const json_t *m = json_array_get(list, i);
        if (role_is(m, "user") || (role_is(m, "system") && i > 0)) return (long)i;
    }
    return -1;
}

static json_t *drop_thinking(const json_t *list, ds41_error *err) {
    static const char *const keep[] = {"user", "system", "tool", "latest_reminder", "direct_search_results"};
    long last = find_last_user(list);
    json_t *out = json_array();
    if (!out) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *msg;
    json_array_foreach(list, i, msg) {
        const json_t *role = get(msg, "role");
        if (role && !hashable(role)) {
            fail_msg(err, msg, "role must be a string");
            goto fail;
        }
        bool kept = (long)i >= last;
        for (size_t k = 0; k < 5 && !kept; k++) kept = str_eq(role, keep[k]);
        json_t *item = NULL;
        if (kept) {
            item = json_incref(msg);
        } else if (str_eq(role, "assistant")) {
            item = json_copy(msg);
            if (item) json_object_del(item, "reasoning_content");
        } else {
            continue;
        }
        if (!item || json_array_append_new(out, item) != 0) {
            oom(err);
            goto fail;
        }
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* ---- tool names and namespaces (REFERENCE §11.9) ---- */

/* The namespace name of a `namespace` value: NULL for none, a string, or {"name": string}. */
static int namespace_name(const json_t *msg, const char *where, const json_t *ns, const json_t **name,
                          ds41_error *err) {
    *name = NULL;
    if (is_none(ns)) return 0;
    if (json_is_string(ns)) {
        *name = ns;
        return 0;
    }
    if (json_is_object(ns) && json_is_string(get(ns, "name"))) {
        *name = get(ns, "name");
        return 0;
    }
    return fail_msg(err, msg, "%s: a namespace must be a string or an object with a string 'name'", where);
}

/* _tool_name_for_encoding: the name to write, "ns::name" when there is a namespace. */
static int qualified_name(const json_t *name, const json_t *ns, ds41_buf *out, ds41_error *err) {
    const char *n = json_string_value(name);
    size_t n_len = json_string_length(name);
    const char *s = ns ? json_string_value(ns) : NULL;
    size_t s_len = ns ? json_string_length(ns) : 0;
    const char *sep = memmem(n, n_len, "::", 2);
    if (sep) {
        size_t p_len = (size_t)(sep - n);
        if (s && (s_len != p_len || memcmp(s, n, p_len) != 0))
            return ds41_fail(err, "Conflicting tool namespaces: %.*s != %.*s", (int)ds41_utf8_cut(s, s_len, MAX_NAME), s,
                             (int)ds41_utf8_cut(n, p_len, MAX_NAME), n);
        s = n;
        s_len = p_len;
        n = sep + 2;
        n_len -= p_len + 2;
    }
    if (memmem(n, n_len, "::", 2))
        return ds41_fail(err, "Tool name must not contain '::': %.*s", (int)ds41_utf8_cut(n, n_len, MAX_NAME), n);
    if (s && memmem(s, s_len, "::", 2))
        return ds41_fail(err, "Tool namespace must not contain '::': %.*s", (int)ds41_utf8_cut(s, s_len, MAX_NAME), s);
    if (s) {
        ds41_buf_put(out, s, s_len);
        ds41_buf_puts(out, "::");
    }
    ds41_buf_put(out, n, n_len);
    return 0;
}

/* tools_from_openai_format: the function schemas to list, names qualified, `namespace` removed and
 * its description prepended.  Returns a new array of new objects. */
static json_t *tools_from_openai_format(const json_t *msg, const json_t *tools, ds41_error *err) {
    if (!json_is_array(tools)) {
        fail_msg(err, msg, "tools must be a list");
        return NULL;
    }
    json_t *out = json_array();
    if (!out) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *tool;
    json_array_foreach(tools, i, tool) {
        char where[48];
        snprintf(where, sizeof where, "tools[%zu]", i);
        const json_t *fn = get(tool, "function");
        if (!json_is_object(fn)) {
            fail_msg(err, msg, "%s must be an object with a 'function' object", where);
            goto fail;
        }
        json_t *f = json_copy((json_t *)fn);
        if (!f || json_array_append_new(out, f) != 0) {
            oom(err);
            goto fail;
        }
        if (!is_none(get(tool, "namespace")) && json_object_set(f, "namespace", get(tool, "namespace")) != 0) {
            oom(err);
            goto fail;
        }
        json_t *ns = json_incref(get(f, "namespace"));
        const json_t *ns_name;
        if (namespace_name(msg, where, ns, &ns_name, err) != 0) {
            json_decref(ns);
            goto fail;
        }
        const json_t *name = get(f, "name");
        if (!json_is_string(name)) {
            json_decref(ns);
            fail_msg(err, msg, "%s.function must have a string 'name'", where);
            goto fail;
        }
        ds41_buf q = {0};
        if (qualified_name(name, ns_name, &q, err) != 0) {
            ds41_buf_free(&q);
            json_decref(ns);
            goto fail;
        }
        size_t q_len = 0;
        char *qs = ds41_buf_take(&q, &q_len);
        json_t *qj = qs ? json_stringn_nocheck(qs, q_len) : NULL;
        free(qs);
        if (!qj || json_object_set_new(f, "name", qj) != 0) {
            json_decref(ns);
            oom(err);
            goto fail;
        }
        json_object_del(f, "namespace");
        if (json_is_object(ns) && truthy(get(ns, "description"))) {
            ds41_buf d = {0};
            if (put_str(&d, get(ns, "description"), err) != 0) {
                json_decref(ns);
                goto fail;
            }
            ds41_buf_putc(&d, '\n');
            if (put_str_or_empty(&d, get(f, "description"), err) != 0) {
                ds41_buf_free(&d);
                json_decref(ns);
                goto fail;
            }
            size_t d_len = 0;
            char *ds = ds41_buf_take(&d, &d_len);
            json_t *dj = ds ? json_stringn_nocheck(ds, d_len) : NULL;
            free(ds);
            if (!dj || json_object_set_new(f, "description", dj) != 0) {
                json_decref(ns);
                oom(err);
                goto fail;
            }
        }
        json_decref(ns);
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* render_tools */
static int render_tools(const json_t *schemas, ds41_buf *out, ds41_error *err) {
    ds41_buf_puts(out, TOOLS_HEAD);
    size_t i;
    json_t *schema;
    json_array_foreach(schemas, i, schema) {
        if (i) ds41_buf_putc(out, '\n');
        if (put_json(out, schema, err) != 0) return -1;
    }
    ds41_buf_puts(out, TOOLS_TAIL);
    return 0;
}

/* ---- assistant tool calls (tool_calls_from_openai_format, encode_arguments_to_dsml) ---- */

static void put_param(ds41_buf *out, const char *key, size_t key_len, const ds41_py *value) {
    ds41_buf_puts(out, "<" DS41_CHAT_DSML " parameter name=\"");
    ds41_buf_put(out, key, key_len);
    if (value->kind == DS41_PY_STR) {
        ds41_buf_puts(out, "\" string=\"true\">");
        ds41_buf_put(out, value->text, value->text_len);
    } else {
        ds41_buf_puts(out, "\" string=\"false\">");
        ds41_py_dumps(value, out);
    }
    ds41_buf_puts(out, "</" DS41_CHAT_DSML " parameter>");
}

static int encode_arguments(const json_t *arguments, ds41_buf *out, ds41_error *err) {
    ds41_py *original = ds41_py_from_json(arguments, err);
    if (!original) return -1;
    const ds41_py *args = original;
    ds41_py *decoded = NULL;
    if (original->kind != DS41_PY_DICT) {
        /* Tolerate JSON strings, double-encoded ones too. */
        for (int round = 0; round < 2 && args->kind == DS41_PY_STR; round++) {
            ds41_py *next;
            bool is_json;
            if (ds41_py_loads(args->text, args->text_len, &next, &is_json, err) != 0) {
                ds41_py_free(decoded);
                ds41_py_free(original);
                return ds41_error_prefix(err, "tool call arguments");
            }
            if (!is_json) break;
            ds41_py_free(decoded);
            decoded = next;
            args = decoded;
        }
    }
    if (args->kind == DS41_PY_DICT) {
        for (size_t i = 0; i < args->n; i++) {
            if (i) ds41_buf_putc(out, '\n');
            put_param(out, args->entries[i].key, args->entries[i].key_len, args->entries[i].value);
        }
    } else {
        put_param(out, "arguments", 9, original);
    }
    ds41_py_free(decoded);
    ds41_py_free(original);
    return 0;
}

/* tool_calls_from_openai_format: [{"name": qualified name, "arguments": ...}], checked before
 * anything is written (the official encoder converts the calls of every message it renders). */
static json_t *convert_tool_calls(const json_t *msg, const json_t *calls, ds41_error *err) {
    if (!json_is_array(calls)) {
        fail_msg(err, msg, "tool_calls must be a list");
        return NULL;
    }
    json_t *out = json_array();
    if (!out) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *tc;
    json_array_foreach(calls, i, tc) {
        char where[48];
        snprintf(where, sizeof where, "tool_calls[%zu]", i);
        const json_t *fn = get(tc, "function");
        if (!json_is_object(fn)) {
            fail_msg(err, msg, "%s has no 'function' object", where);
            goto fail;
        }
        const json_t *name = get(fn, "name");
        if (!json_is_string(name)) {
            fail_msg(err, msg, "%s.function has no string 'name'", where);
            goto fail;
        }
        const json_t *hint = truthy(get(tc, "namespace")) ? get(tc, "namespace") : get(fn, "namespace");
        const json_t *ns;
        if (namespace_name(msg, where, truthy(hint) ? hint : NULL, &ns, err) != 0) goto fail;
        ds41_buf q = {0};
        if (qualified_name(name, ns, &q, err) != 0) {
            ds41_buf_free(&q);
            goto fail;
        }
        if (!has_key(fn, "arguments")) {
            ds41_buf_free(&q);
            fail_msg(err, msg, "%s.function has no 'arguments'", where);
            goto fail;
        }
        size_t q_len = 0;
        char *qs = ds41_buf_take(&q, &q_len);
        json_t *call = qs ? json_pack("{s:s%, s:O}", "name", qs, q_len, "arguments", get(fn, "arguments")) : NULL;
        free(qs);
        if (!call || json_array_append_new(out, call) != 0) {
            oom(err);
            goto fail;
        }
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* The DSML block of converted calls. */
static int render_tool_calls(const json_t *msg, const json_t *calls, ds41_buf *out, ds41_error *err) {
    ds41_buf_puts(out, "\n\n<" DS41_CHAT_DSML " calls>\n");
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) {
        const json_t *name = get(call, "name");
        if (i) ds41_buf_putc(out, '\n');
        ds41_buf_puts(out, "<" DS41_CHAT_DSML " invoke name=\"");
        ds41_buf_put(out, json_string_value(name), json_string_length(name));
        ds41_buf_puts(out, "\">\n");
        if (encode_arguments(get(call, "arguments"), out, err) != 0)
            return ds41_error_prefix(err, "%s: tool_calls[%zu]", origin(msg), i);
        ds41_buf_puts(out, "\n</" DS41_CHAT_DSML " invoke>");
    }
    ds41_buf_puts(out, "\n</" DS41_CHAT_DSML " calls>");
    return 0;
}

/* ---- render_message ---- */

typedef struct render_state {
    ds41_chat_mode mode;
    bool drop;
    long last_user; /* find_last_user_index of the list being rendered */
    const json_t *effort;
    ds41_buf *out;
    ds41_error *err;
} render_state;

static int render_user_block(const json_t *msg, const json_t *block, ds41_buf *out, ds41_error *err) {
    if (!json_is_object(block)) return fail_msg(err, msg, "a content block must be an object");
    const json_t *type = get(block, "type");
    if (str_eq(type, "text")) {
        const json_t *text = get(block, "text");
        if (text && !json_is_string(text))
            return fail_msg(err, msg, "a text content block's 'text' must be a string");
        if (text) ds41_buf_put(out, json_string_value(text), json_string_length(text));
        return 0;
    }
    if (str_eq(type, "tool_result")) {
        const json_t *content = get(block, "content");
        ds41_buf_puts(out, "<tool_result>");
        if (!content) {
            /* block.get("content", "") */
        } else if (json_is_array(content)) {
            size_t i;
            json_t *b;
            json_array_foreach(content, i, b) {
                if (!json_is_object(b)) return fail_msg(err, msg, "a tool result content block must be an object");
                if (i) ds41_buf_puts(out, "\n\n");
                if (str_eq(get(b, "type"), "text")) {
                    const json_t *text = get(b, "text");
                    if (text && !json_is_string(text))
                        return fail_msg(err, msg, "a text content block's 'text' must be a string");
                    if (text) ds41_buf_put(out, json_string_value(text), json_string_length(text));
                } else {
                    ds41_buf_puts(out, "[Unsupported ");
                    if (put_str(out, get(b, "type"), err) != 0) return -1;
                    ds41_buf_putc(out, ']');
                }
            }
        } else if (put_str(out, content, err) != 0) { /* str(): "None", "True", Python repr of a dict */
            return -1;
        }
        ds41_buf_puts(out, "</tool_result>");
        return 0;
    }
    ds41_buf_puts(out, "[Unsupported ");
    if (put_str(out, type, err) != 0) return -1;
    ds41_buf_putc(out, ']');
    return 0;
}

static int render_message(size_t index, const json_t *list, const render_state *st) {
    ds41_buf *out = st->out;
    ds41_error *err = st->err;
    const json_t *msg = json_array_get(list, index);
    long last_user = st->last_user;
    bool thinking = st->mode == DS41_CHAT_MODE_THINKING;
    const json_t *role = get(msg, "role");
    const json_t *content = get(msg, "content");
    const json_t *tool_calls = get(msg, "tool_calls");

    json_t *schemas = NULL, *calls = NULL;
    int rc = -1;
    if (truthy(get(msg, "tools"))) {
        schemas = tools_from_openai_format(msg, get(msg, "tools"), err);
        if (!schemas) goto done;
    }
    if (truthy(tool_calls)) {
        calls = convert_tool_calls(msg, tool_calls, err);
        if (!calls) goto done;
    }

    int budget;
    if (ds41_chat_reasoning_effort(st->effort, &budget, err) != 0) goto done;
    bool effort_prefix = index == 0 && thinking;
    if (index == 0 && (effort_prefix || str_eq(role, "system"))) ds41_buf_puts(out, DS41_CHAT_SYSTEM);
    if (effort_prefix) ds41_buf_printf(out, EFFORT_TEMPLATE_HEAD "%d" EFFORT_TEMPLATE_TAIL, budget);

    if (str_eq(role, "system")) {
        if (index > 0) ds41_buf_puts(out, DS41_CHAT_SYSTEM);
        if (put_str_or_empty(out, content, err) != 0) goto done;
        if (schemas) {
            ds41_buf_puts(out, "\n\n");
            if (render_tools(schemas, out, err) != 0) goto done;
        }
        if (truthy(get(msg, "response_format"))) {
            ds41_buf_puts(out, "\n\n" RESPONSE_FORMAT_HEAD);
            if (put_json(out, get(msg, "response_format"), err) != 0) goto done;
        }
    } else if (str_eq(role, "user")) {
        ds41_buf_puts(out, DS41_CHAT_USER);
        const json_t *blocks = get(msg, "content_blocks");
        if (truthy(blocks)) {
            if (!json_is_array(blocks)) {
                fail_msg(err, msg, "content_blocks must be a list");
                goto done;
            }
            size_t i;
            json_t *block;
            json_array_foreach(blocks, i, block) {
                if (i) ds41_buf_puts(out, "\n\n");
                if (render_user_block(msg, block, out, err) != 0) goto done;
            }
        } else if (put_str_or_empty(out, content, err) != 0) {
            goto done;
        }
    } else if (str_eq(role, "latest_reminder")) {
        ds41_buf_puts(out, DS41_CHAT_LATEST_REMINDER);
        if (put_str(out, content, err) != 0) goto done;
    } else if (str_eq(role, "tool")) {
        ds41_fail(err, "deepseek_v41 merges tool messages into user; please preprocess with merge_tool_messages()");
        goto done;
    } else if (str_eq(role, "assistant")) {
        bool prev_has_task = index >= 1 && !is_none(get(json_array_get(list, index - 1), "task"));
        if (thinking && !prev_has_task && (!st->drop || (long)index > last_user)) {
            if (put_str_or_empty(out, get(msg, "reasoning_content"), err) != 0) goto done;
            ds41_buf_puts(out, DS41_CHAT_THINK_END);
        }
        if (put_str_or_empty(out, content, err) != 0) goto done;
        if (calls && render_tool_calls(msg, calls, out, err) != 0) goto done;
        if (!truthy(get(msg, "wo_eos"))) ds41_buf_puts(out, DS41_CHAT_EOS);
    } else {
        char shown[256];
        str_for_message(role, shown, sizeof shown);
        ds41_fail(err, "Unknown role: %s", shown);
        goto done;
    }

    /* The generation prompt: only before an assistant / latest_reminder message, or at the end. */
    if (index + 1 < json_array_size(list)) {
        const json_t *next_role = get(json_array_get(list, index + 1), "role");
        if (!str_eq(next_role, "assistant") && !str_eq(next_role, "latest_reminder")) {
            rc = 0;
            goto done;
        }
    }
    const json_t *task = get(msg, "task");
    if (!is_none(task)) {
        size_t t = 0;
        while (t < N_TASKS && !str_eq(task, TASKS[t].name)) t++;
        if (t == N_TASKS) {
            char shown[256];
            str_for_message(task, shown, sizeof shown);
            ds41_fail(err,
                      "Invalid task: '%s'. Valid tasks are: ['action', 'query', 'authority', 'domain', 'title', "
                      "'read_url']",
                      shown);
            goto done;
        }
        if (t != 0) {
            ds41_buf_puts(out, TASKS[t].token);
        } else {
            ds41_buf_puts(out, DS41_CHAT_ASSISTANT);
            ds41_buf_puts(out, thinking ? DS41_CHAT_THINK_START : DS41_CHAT_THINK_END);
            ds41_buf_puts(out, TASKS[t].token);
        }
    } else if (str_eq(role, "user") || (str_eq(role, "system") && index > 0)) {
        ds41_buf_puts(out, DS41_CHAT_ASSISTANT);
        bool open = thinking && (!st->drop || (long)index >= last_user);
        ds41_buf_puts(out, open ? DS41_CHAT_THINK_START : DS41_CHAT_THINK_END);
    }
    rc = 0;
done:
    json_decref(schemas);
    json_decref(calls);
    return rc;
}

/* ---- encode_messages ---- */

ds41_chat_request ds41_chat_request_default(void) {
    return (ds41_chat_request){.mode = DS41_CHAT_MODE_CHAT, .drop_thinking = true, .add_bos = true};
}

void ds41_chat_prompt_free(ds41_chat_prompt *p) {
    if (!p) return;
    free(p->text);
    json_decref(p->images);
    *p = (ds41_chat_prompt){0};
}

/* Working copies of a message list, each tagged with where it came from. */
static json_t *tagged_copy(const json_t *list, const char *name, ds41_error *err) {
    json_t *out = json_array();
    if (!out) {
        oom(err);
        return NULL;
    }
    size_t i;
    json_t *msg;
    json_array_foreach(list, i, msg) {
        if (!json_is_object(msg)) {
            json_decref(out);
            ds41_fail(err, "%s[%zu] must be a JSON object", name, i);
            return NULL;
        }
        char tag[48];
        snprintf(tag, sizeof tag, "%s[%zu]", name, i);
        json_t *copy = json_copy(msg);
        if (!copy || json_object_set_new(copy, ORIGIN_KEY, json_string(tag)) != 0 ||
            json_array_append_new(out, copy) != 0) {
            json_decref(out);
            oom(err);
            return NULL;
        }
    }
    return out;
}

/* Request-level tools / response_format onto the first (system) message of list. */
static int attach_request_tools(json_t *list, const ds41_chat_request *req, ds41_error *err) {
    const json_t *rf = req->response_format;
    bool use_rf = truthy(rf) && !(json_is_object(rf) && json_object_size(rf) == 1 && str_eq(get(rf, "type"), "text"));
    bool use_tools = truthy(req->tools);
    if (!use_rf && !use_tools) return 0;
    json_t *sys = json_array_get(list, 0);
    if (!sys || !role_is(sys, "system")) {
        sys = json_pack("{s:s, s:s, s:s}", "role", "system", "content", "", ORIGIN_KEY,
                        "the system message added for the request's tools");
        if (!sys || json_array_insert_new(list, 0, sys) != 0) return oom(err);
    }
    if (use_tools && json_object_set(sys, "tools", (json_t *)req->tools) != 0) return oom(err);
    if (use_rf && json_object_set(sys, "response_format", (json_t *)rf) != 0) return oom(err);
    return 0;
}

int ds41_chat_render(const ds41_chat_request *req, ds41_chat_prompt *out, ds41_error *err) {
    if (!out) return ds41_fail(err, "chat render: no output");
    *out = (ds41_chat_prompt){0};
    if (!req) return ds41_fail(err, "chat render: no request");
    if (!json_is_array(req->messages)) return ds41_fail(err, "messages must be a JSON array");
    if (req->context && !json_is_null(req->context) && !json_is_array(req->context))
        return ds41_fail(err, "context must be a JSON array");
    if (req->mode != DS41_CHAT_MODE_CHAT && req->mode != DS41_CHAT_MODE_THINKING)
        return ds41_fail(err, "Invalid thinking_mode `%d`", (int)req->mode);

    int rc = -1;
    ds41_buf text = {0};
    json_t *msgs = NULL, *ctx = NULL, *images = NULL, *msgs_p = NULL, *ctx_p = NULL, *msgs_m = NULL,
           *ctx_m = NULL, *all = NULL, *full = NULL, *ctx_dropped = NULL;

    msgs = tagged_copy(req->messages, "messages", err);
    ctx = json_is_array(req->context) ? tagged_copy(req->context, "context", err) : json_array();
    if (!msgs || !ctx) {
        if (msgs && !ctx) oom(err);
        goto done;
    }
    if (attach_request_tools(json_array_size(ctx) ? ctx : msgs, req, err) != 0) goto done;

    /* process_image_messages: context first (its errors come first), images of messages only. */
    images = json_array();
    if (!images) {
        oom(err);
        goto done;
    }
    ctx_p = process_image_messages(ctx, NULL, err);
    if (!ctx_p) goto done;
    msgs_p = process_image_messages(msgs, images, err);
    if (!msgs_p) goto done;

    /* merge_tool_messages; tool results sorted with the context's calls in view. */
    msgs_m = merge_tool_messages(msgs_p, err);
    if (!msgs_m) goto done;
    all = concat(ctx_p, msgs_m);
    if (!all) {
        oom(err);
        goto done;
    }
    if (sort_tool_results(all, err) != 0) goto done;
    if (json_array_size(ctx_p)) {
        ctx_m = merge_tool_messages(ctx_p, err);
        if (!ctx_m || sort_tool_results(ctx_m, err) != 0) goto done;
    } else {
        ctx_m = json_array();
        if (!ctx_m) {
            oom(err);
            goto done;
        }
    }
    full = concat(ctx_m, msgs_m);
    if (!full) {
        oom(err);
        goto done;
    }
    if (req->add_bos && json_array_size(ctx_m) == 0) ds41_buf_puts(&text, DS41_CHAT_BOS);

    bool drop = req->drop_thinking;
    size_t i;
    json_t *m;
    json_array_foreach(full, i, m) if (truthy(get(m, "tools"))) drop = false;

    long n_render, ctx_len;
    if (req->mode == DS41_CHAT_MODE_THINKING && drop) {
        json_t *dropped = drop_thinking(full, err);
        if (!dropped) goto done;
        json_decref(full);
        full = dropped;
        ctx_dropped = drop_thinking(ctx_m, err);
        if (!ctx_dropped) goto done;
        n_render = (long)json_array_size(full) - (long)json_array_size(ctx_dropped);
        ctx_len = (long)json_array_size(full) - n_render;
    } else {
        n_render = (long)json_array_size(msgs_m);
        ctx_len = (long)json_array_size(ctx_m);
    }
    render_state st = {req->mode, drop, find_last_user(full), req->reasoning_effort, &text, err};
    for (long k = 0; k < n_render; k++)
        if (render_message((size_t)(k + ctx_len), full, &st) != 0) goto done;

    if (text.oom) {
        oom(err);
        goto done;
    }
    size_t bad;
    if (text.len && !ds41_utf8_valid(text.data, text.len, &bad)) {
        ds41_fail(err, "the prompt would not be valid UTF-8 at byte %zu: tool call arguments decode to a lone "
                       "UTF-16 surrogate, which has no UTF-8 form",
                  bad);
        goto done;
    }
    out->text = ds41_buf_take(&text, &out->len);
    if (!out->text) {
        oom(err);
        goto done;
    }
    out->images = images;
    images = NULL;
    rc = 0;
done:
    ds41_buf_free(&text);
    json_decref(msgs);
    json_decref(ctx);
    json_decref(images);
    json_decref(msgs_p);
    json_decref(ctx_p);
    json_decref(msgs_m);
    json_decref(ctx_m);
    json_decref(all);
    json_decref(full);
    json_decref(ctx_dropped);
    return rc;
}
