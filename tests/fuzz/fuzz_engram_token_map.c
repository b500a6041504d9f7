/* Fuzz the Engram token-map normalisation and builder with arbitrary bytes: the whole input is
 * normalised, then split at 0xFF bytes (never part of UTF-8) into token texts whose raw strings
 * are the same bytes reversed, and a map is built.  Invariants: success only for valid UTF-8,
 * normalised output is valid UTF-8, map ids are dense in first-appearance order. */
#include "engine/model/engram_token_map.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct pieces {
    const uint8_t *data;
    size_t starts[256], lens[256];
    uint32_t n;
    char raw[4096];
} pieces;

static int valid_utf8(const char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k =
            utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &c);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

static int piece_text(void *ctx, uint32_t id, char **text, size_t *text_len, const char **raw,
                      size_t *raw_len, ds41_error *err) {
    pieces *p = ctx;
    if (id >= p->n) return ds41_fail(err, "id %u out of range", id);
    size_t len = p->lens[id];
    *text = malloc(len + 1);
    if (!*text) return ds41_fail(err, "out of memory");
    memcpy(*text, p->data + p->starts[id], len);
    (*text)[len] = 0;
    *text_len = len;
    size_t rl = len < sizeof p->raw ? len : sizeof p->raw;
    for (size_t i = 0; i < rl; i++) p->raw[i] = (char)p->data[p->starts[id] + len - 1 - i];
    *raw = p->raw;
    *raw_len = rl;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *out = NULL;
    size_t out_len = 0;
    ds41_error err;
    if (ds41_engram_normalize((const char *)data, size, &out, &out_len, &err) == 0) {
        if (!valid_utf8((const char *)data, size) || !valid_utf8(out, out_len) || out[out_len] != 0) abort();
        free(out);
    } else if (out != NULL) {
        abort();
    }

    pieces p = {.data = data};
    size_t start = 0;
    for (size_t i = 0; i <= size && p.n < 256; i++) {
        if (i == size || data[i] == 0xFF) {
            p.starts[p.n] = start;
            p.lens[p.n] = i - start;
            p.n++;
            start = i + 1;
        }
    }
    int32_t map[256];
    uint32_t n_compressed = 0;
    if (ds41_engram_token_map_build(p.n, piece_text, &p, map, &n_compressed, &err) == 0) {
        int32_t next = 0;
        for (uint32_t i = 0; i < p.n; i++) {
            if (map[i] < 0 || map[i] > next) abort();
            if (map[i] == next) next++;
        }
        if ((uint32_t)next != n_compressed || n_compressed > p.n) abort();
        uint8_t digest[32];
        if (ds41_engram_token_map_digest(map, p.n, digest) != 0) abort();
    }
    return 0;
}
