/* Small JSON helpers shared by every layer (jansson underneath): type names for error messages,
 * and the writers the ipc layer builds every JSON text with, so that a string from outside (a
 * model's output, a URL, a service message) can never make jansson refuse to build a value:
 * invalid UTF-8 is replaced by U+FFFD and embedded NULs are kept as \u0000 escapes. */
#ifndef DS41_CONFIG_JSON_UTIL_H
#define DS41_CONFIG_JSON_UTIL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

/* "an object", "a list", "a string", "an integer", "a real number",
 * "a boolean", "null": for messages like "key 'x': expected a string, got
 * an integer". */
const char *ds41_json_type_name(const json_t *v);

/* The bare JSON type word: "object", "array", "string", "integer", "number", "boolean", "null"
 * (the API's 400 messages: "'x' must be a string, not integer"). */
const char *ds41_json_kind_name(const json_t *v);

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
