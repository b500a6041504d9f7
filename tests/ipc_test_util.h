/* Helpers shared by the ipc tests: JSON lookup by path and SSE splitting. */
#ifndef DS41_TESTS_IPC_TEST_UTIL_H
#define DS41_TESTS_IPC_TEST_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Value at a path like "choices[0].delta.content" (NULL if absent). */
__attribute__((unused)) static json_t *jpath(json_t *root, const char *path) {
    json_t *cur = root;
    const char *p = path;
    while (cur && *p) {
        if (*p == '.') p++;
        if (*p == '[') {
            char *end;
            long i = strtol(p + 1, &end, 10);
            if (*end != ']') return NULL;
            cur = json_array_get(cur, (size_t)i);
            p = end + 1;
            continue;
        }
        size_t n = strcspn(p, ".[");
        char key[128];
        if (n >= sizeof key) return NULL;
        memcpy(key, p, n);
        key[n] = 0;
        cur = json_object_get(cur, key);
        p += n;
    }
    return cur;
}

__attribute__((unused)) static const char *jstr(json_t *root, const char *path) {
    return json_string_value(jpath(root, path));
}

__attribute__((unused)) static long long jint(json_t *root, const char *path) {
    json_t *v = jpath(root, path);
    return json_is_integer(v) ? json_integer_value(v) : -999999;
}

/* The OpenAI error shape: exactly {"error":{message,type,param,code}}. */
__attribute__((unused)) static bool is_error_shape(json_t *root, const char *type, const char *code,
                                                   const char *param) {
    json_t *e = json_object_get(root, "error");
    if (!json_is_object(root) || json_object_size(root) != 1 || !json_is_object(e) ||
        json_object_size(e) != 4)
        return false;
    if (!json_is_string(json_object_get(e, "message")) || !json_string_length(json_object_get(e, "message")))
        return false;
    if (type && (!jstr(e, "type") || strcmp(jstr(e, "type"), type) != 0)) return false;
    if (code && (!jstr(e, "code") || strcmp(jstr(e, "code"), code) != 0)) return false;
    json_t *pv = json_object_get(e, "param");
    if (param) {
        if (!json_is_string(pv) || strcmp(json_string_value(pv), param) != 0) return false;
    } else if (!json_is_null(pv) && !json_is_string(pv)) {
        return false;
    }
    return true;
}

/* Split an SSE body into events.  Every event must be "data: ...\n\n" (SSE
 * comments ": ..." are skipped and counted).  Returns a JSON array whose items
 * are the parsed data objects, or the string "[DONE]"; NULL when the framing
 * is wrong (then *why says where). */
__attribute__((unused)) static json_t *sse_split(const char *body, size_t len, int *comments, char *why,
                                                 size_t why_len) {
    json_t *events = json_array();
    size_t i = 0;
    if (comments) *comments = 0;
    while (i < len) {
        const char *end = NULL;
        for (size_t k = i; k + 1 < len; k++)
            if (body[k] == '\n' && body[k + 1] == '\n') {
                end = body + k;
                break;
            }
        if (!end) {
            snprintf(why, why_len, "event at byte %zu not terminated by a blank line", i);
            json_decref(events);
            return NULL;
        }
        size_t n = (size_t)(end - (body + i));
        if (n >= 1 && body[i] == ':') {
            if (comments) (*comments)++;
        } else if (n >= 6 && memcmp(body + i, "data: ", 6) == 0) {
            if (memchr(body + i, '\n', n)) {
                snprintf(why, why_len, "event at byte %zu spans several lines", i);
                json_decref(events);
                return NULL;
            }
            if (n == 12 && memcmp(body + i + 6, "[DONE]", 6) == 0) {
                json_array_append_new(events, json_string("[DONE]"));
            } else {
                json_t *j = json_loadb(body + i + 6, n - 6, JSON_ALLOW_NUL, NULL);
                if (!j) {
                    snprintf(why, why_len, "event at byte %zu is not JSON", i);
                    json_decref(events);
                    return NULL;
                }
                json_array_append_new(events, j);
            }
        } else {
            snprintf(why, why_len, "event at byte %zu does not start with 'data: '", i);
            json_decref(events);
            return NULL;
        }
        i += n + 2;
    }
    return events;
}

/* Split a Responses API SSE body (issue 18) into its events' data objects: every event must be
 * "event: TYPE\ndata: {...}\n\n" with data.type == TYPE.  NULL when the framing is wrong (then
 * *why says where). */
__attribute__((unused)) static json_t *sse_split_named(const char *body, size_t len, char *why, size_t why_len) {
    json_t *events = json_array();
    size_t i = 0;
    while (events && i < len) {
        const char *end = NULL, *nl;
        for (size_t k = i; k + 1 < len; k++)
            if (body[k] == '\n' && body[k + 1] == '\n') {
                end = body + k;
                break;
            }
        nl = end ? memchr(body + i, '\n', (size_t)(end - (body + i))) : NULL;
        if (!end || !nl || (size_t)(nl - (body + i)) < 8 || memcmp(body + i, "event: ", 7) != 0 ||
            (size_t)(end - nl) < 7 || memcmp(nl + 1, "data: ", 6) != 0 || memchr(nl + 1, '\n', (size_t)(end - nl - 1))) {
            snprintf(why, why_len, "event at byte %zu is not 'event: TYPE\\ndata: JSON\\n\\n'", i);
            json_decref(events);
            return NULL;
        }
        json_t *j = json_loadb(nl + 7, (size_t)(end - nl - 7), 0, NULL);
        const char *type = json_string_value(json_object_get(j, "type"));
        size_t tl = (size_t)(nl - (body + i)) - 7;
        if (!type || strlen(type) != tl || memcmp(type, body + i + 7, tl) != 0) {
            snprintf(why, why_len, "event at byte %zu: data is not JSON or its type differs from the event line", i);
            json_decref(j);
            json_decref(events);
            return NULL;
        }
        json_array_append_new(events, j);
        i = (size_t)(end - body) + 2;
    }
    return events;
}

#endif
