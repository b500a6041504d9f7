#include "config/json_util.h"

#include "config/utf8.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *ds41_json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "a list";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

const char *ds41_json_kind_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "object";
    case JSON_ARRAY:
        return "array";
    case JSON_STRING:
        return "string";
    case JSON_INTEGER:
        return "integer";
    case JSON_REAL:
        return "number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "boolean";
    case JSON_NULL:
        return "null";
    }
    return "value";
}

json_t *ds41_json_string_lossy(const char *s, size_t len) {
    if (len == 0) return json_string("");
    if (ds41_utf8_valid(s, len, NULL)) return json_stringn(s, len);
    size_t n = 0;
    char *fixed = ds41_utf8_lossy((const uint8_t *)s, len, &n);
    if (!fixed) return NULL;
    json_t *j = json_stringn(fixed, n);
    free(fixed);
    return j;
}

int ds41_json_set_new(json_t *obj, const char *key, json_t *value) {
    if (!value) return -1;
    return json_object_set_new(obj, key, value) == 0 ? 0 : -1;
}

int ds41_json_set_str(json_t *obj, const char *key, const char *s) {
    return ds41_json_set_new(obj, key, s ? ds41_json_string_lossy(s, strlen(s)) : json_null());
}

char *ds41_json_dump(const json_t *value, size_t *len) {
    char *text = json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY);
    if (text && len) *len = strlen(text);
    return text;
}
