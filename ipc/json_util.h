/* Small JSON helpers shared by the ipc layer (jansson underneath).
 *
 * Everything the ipc layer writes into a JSON text goes through these, so a
 * string from outside (a model's output, a URL, a service message) can never
 * make jansson refuse to build a value: invalid UTF-8 is replaced by U+FFFD
 * and embedded NULs are kept as \u0000 escapes. */
#ifndef DS41_IPC_JSON_UTIL_H
#define DS41_IPC_JSON_UTIL_H

#include "config/utf8.h"

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* A JSON string of s[0..len) with every invalid UTF-8 sequence replaced by
 * U+FFFD.  s may be NULL when len is 0.  New reference; NULL only when out of
 * memory. */
json_t *ds41_json_string_lossy(const char *s, size_t len);

/* Set obj[key] to ds41_json_string_lossy(s, strlen(s)) (s NULL -> json null).
 * Returns 0 / -1 (out of memory). */
int ds41_json_set_str(json_t *obj, const char *key, const char *s);

/* Set obj[key] to the (stolen) value; returns 0, or -1 when value is NULL
 * or out of memory (value is released either way). */
int ds41_json_set_new(json_t *obj, const char *key, json_t *value);

/* Compact serialization (no spaces, key order as inserted, UTF-8 kept,
 * NUL-terminated, malloc()ed).  *len set when len != NULL.  NULL on error. */
char *ds41_json_dump(const json_t *value, size_t *len);

#endif
