#include "config/utf8.h"

#include <stdlib.h>
#include <string.h>

size_t ds41_utf8_sequence(const uint8_t *s, size_t len, size_t *subpart) {
    uint8_t b = s[0];
    if (b < 0x80) return 1;
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF)
        n = 2;
    else if (b == 0xE0)
        n = 3, lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF)
        n = 3;
    else if (b == 0xED)
        n = 3, hi = 0x9F; /* no surrogates */
    else if (b == 0xF0)
        n = 4, lo = 0x90; /* no overlong 4-byte forms */
    else if (b >= 0xF1 && b <= 0xF3)
        n = 4;
    else if (b == 0xF4)
        n = 4, hi = 0x8F; /* nothing above U+10FFFF */
    else {
        if (subpart) *subpart = 1; /* 0x80..0xC1, 0xF5..0xFF never start a character */
        return 0;
    }
    size_t k = 1;
    for (; k < n && k < len; k++) {
        uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (s[k] < l || s[k] > h) break;
    }
    if (k == n) return n;
    if (subpart) *subpart = k;
    return 0;
}

size_t ds41_utf8_decode(const uint8_t *s, size_t len, uint32_t *cp) {
    if (len == 0) return 0;
    size_t n = ds41_utf8_sequence(s, len, NULL);
    if (n == 0) return 0;
    uint32_t c = n == 1 ? s[0] : s[0] & (0xFFu >> (n + 1)); /* the lead byte's payload bits */
    for (size_t k = 1; k < n; k++) c = (c << 6) | (s[k] & 0x3F);
    *cp = c;
    return n;
}

bool ds41_utf8_truncated(const uint8_t *s, size_t len) {
    size_t sub = 0;
    return s[0] >= 0xC2 && s[0] <= 0xF4 && ds41_utf8_sequence(s, len, &sub) == 0 && sub == len;
}

size_t ds41_utf8_cut(const char *s, size_t len, size_t max) {
    if (len <= max) return len;
    size_t n = max;
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--;
    return n;
}

bool ds41_utf8_valid(const char *s, size_t len, size_t *bad_offset) {
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0;
    while (i < len) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        size_t n = ds41_utf8_sequence(u + i, len - i, NULL);
        if (!n) {
            if (bad_offset) *bad_offset = i;
            return false;
        }
        i += n;
    }
    return true;
}

size_t ds41_utf8_valid_prefix(const char *s, size_t len) {
    size_t bad = len;
    ds41_utf8_valid(s, len, &bad);
    return bad;
}

char *ds41_utf8_lossy(const uint8_t *bytes, size_t n, size_t *out_len) {
    if (n > (SIZE_MAX - 1) / 3) return NULL;
    char *out = malloc(3 * n + 1);
    if (!out) return NULL;
    size_t i = 0, o = 0;
    while (i < n) {
        size_t sub = 1;
        size_t k = ds41_utf8_sequence(bytes + i, n - i, &sub);
        if (k) {
            memcpy(out + o, bytes + i, k);
            o += k;
            i += k;
            continue;
        }
        i += sub;
        out[o++] = (char)0xEF;
        out[o++] = (char)0xBF;
        out[o++] = (char)0xBD;
    }
    out[o] = 0;
    char *shrunk = realloc(out, o + 1);
    if (shrunk) out = shrunk;
    if (out_len) *out_len = o;
    return out;
}

bool ds41_utf8_contains_replacement(const char *s, size_t n) {
    for (size_t i = 0; i + 2 < n; i++)
        if ((uint8_t)s[i] == 0xEF && (uint8_t)s[i + 1] == 0xBF && (uint8_t)s[i + 2] == 0xBD) return true;
    return false;
}
