#include "ipc/json_util.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>


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
