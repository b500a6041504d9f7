#include "ipc/json_util.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Length of the valid UTF-8 sequence starting at s[0] (1..4), or 0 when the
 * bytes there do not start one (overlongs, surrogates and values above
 * U+10FFFF are invalid, as in RFC 3629). */
static size_t utf8_seq_len(const unsigned char *s, size_t avail) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t n;
    uint32_t min, cp;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        min = 0x80;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        min = 0x800;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        min = 0x10000;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (avail < n) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return n;
}

size_t ds41_utf8_valid_prefix(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        size_t n = utf8_seq_len(u + i, len - i);
        if (n == 0) break;
        i += n;
    }
    return i;
}

bool ds41_utf8_valid(const char *s, size_t len) {
    return ds41_utf8_valid_prefix(s, len) == len;
}

json_t *ds41_json_string_lossy(const char *s, size_t len) {
    if (len == 0) return json_string("");
    if (ds41_utf8_valid(s, len)) return json_stringn(s, len);
    /* Worst case every byte becomes the 3-byte U+FFFD. */
    if (len > (SIZE_MAX - 1) / 3) return NULL;
    char *out = malloc(len * 3 + 1);
    if (!out) return NULL;
    const unsigned char *u = (const unsigned char *)s;
    size_t o = 0, i = 0;
    while (i < len) {
        size_t n = utf8_seq_len(u + i, len - i);
        if (n == 0) {
            out[o++] = (char)0xEF;
            out[o++] = (char)0xBF;
            out[o++] = (char)0xBD;
            i++;
        } else {
            memcpy(out + o, u + i, n);
            o += n;
            i += n;
        }
    }
    json_t *j = json_stringn(out, o);
    free(out);
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
