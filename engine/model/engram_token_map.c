#include "engine/model/engram_token_map.h"

#include "config/sha256.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#define REPLACEMENT_CHAR 0xFFFD
#define SENTINEL_CHAR 0xE000

/* Unicode White_Space (PropList.txt); what Rust's char::is_whitespace, and so the `Strip`
 * normaliser of `tokenizers`, removes.  Python's str.strip() would also remove U+001C..U+001F. */
static int is_white_space(utf8proc_int32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

/* The [ \t\r\n] class of the whitespace-run rule. */
static int is_run_space(utf8proc_int32_t c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

static int utf8proc_failure(ds41_error *err, const char *what, utf8proc_ssize_t code) {
    return ds41_fail(err, "engram normalisation: %s: %s", what, utf8proc_errmsg(code));
}

int ds41_engram_normalize(const char *text, size_t len, char **out, size_t *out_len, ds41_error *err) {
    if (!out || !out_len) return ds41_fail(err, "engram normalisation: no output");
    *out = NULL;
    *out_len = 0;
    if (len > DS41_ENGRAM_MAX_TOKEN_BYTES)
        return ds41_fail(err, "engram normalisation: text of %zu bytes exceeds %zu", len,
                         (size_t)DS41_ENGRAM_MAX_TOKEN_BYTES);
    if (len > 0 && !text) return ds41_fail(err, "engram normalisation: no text");

    /* 1. NFKC.  utf8proc_map validates the UTF-8; NUL bytes pass as U+0000 without NULLTERM. */
    utf8proc_uint8_t *nfkc = NULL;
    utf8proc_ssize_t nfkc_len = 0;
    if (len > 0) {
        nfkc_len = utf8proc_map((const utf8proc_uint8_t *)text, (utf8proc_ssize_t)len, &nfkc,
                                UTF8PROC_STABLE | UTF8PROC_COMPAT | UTF8PROC_COMPOSE);
        if (nfkc_len < 0) return utf8proc_failure(err, "NFKC", nfkc_len);
    }

    /* 2. NFD with every combining mark (Mn, Mc, Me) dropped, as code points.  The first call
     * sizes the buffer (utf8proc writes nothing past bufsize). */
    const utf8proc_option_t nfd_strip = UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_STRIPMARK;
    utf8proc_int32_t *cps = NULL;
    utf8proc_ssize_t n = 0;
    if (nfkc_len > 0) {
        n = utf8proc_decompose(nfkc, nfkc_len, NULL, 0, nfd_strip);
        if (n < 0) {
            free(nfkc);
            return utf8proc_failure(err, "NFD", n);
        }
        if (n > 0) {
            cps = malloc((size_t)n * sizeof *cps);
            if (!cps) {
                free(nfkc);
                return ds41_fail(err, "engram normalisation: out of memory");
            }
            utf8proc_ssize_t again = utf8proc_decompose(nfkc, nfkc_len, cps, n, nfd_strip);
            if (again != n) {
                free(nfkc);
                free(cps);
                return ds41_fail(err, "engram normalisation: NFD size changed between passes");
            }
        }
    }
    free(nfkc);

    /* 3. Lowercase each code point; 4. collapse runs of [ \t\r\n] into one space. */
    size_t w = 0;
    int in_run = 0;
    for (utf8proc_ssize_t r = 0; r < n; r++) {
        utf8proc_int32_t c = utf8proc_tolower(cps[r]);
        if (is_run_space(c)) {
            if (in_run) continue;
            in_run = 1;
            c = ' ';
        } else {
            in_run = 0;
        }
        cps[w++] = c;
    }
    /* 5. A lone space survives the strip as the sentinel ... */
    if (w == 1 && cps[0] == ' ') cps[0] = SENTINEL_CHAR;
    /* 6. strip White_Space at both ends ... */
    size_t begin = 0, end = w;
    while (begin < end && is_white_space(cps[begin])) begin++;
    while (end > begin && is_white_space(cps[end - 1])) end--;
    /* 7. ... and every sentinel (also one that was in the text) becomes a space. */
    char *buf = malloc((end - begin) * 4 + 1);
    if (!buf) {
        free(cps);
        return ds41_fail(err, "engram normalisation: out of memory");
    }
    size_t o = 0;
    for (size_t i = begin; i < end; i++) {
        utf8proc_int32_t c = cps[i] == SENTINEL_CHAR ? ' ' : cps[i];
        o += (size_t)utf8proc_encode_char(c, (utf8proc_uint8_t *)buf + o);
    }
    buf[o] = 0;
    free(cps);
    *out = buf;
    *out_len = o;
    return 0;
}

/* Whether UTF-8 text[len] contains U+FFFD (the marker of a lossy decode). */
static int contains_replacement_char(const char *text, size_t len) {
    for (size_t i = 0; i + 2 < len; i++)
        if ((unsigned char)text[i] == 0xEF && (unsigned char)text[i + 1] == 0xBF &&
            (unsigned char)text[i + 2] == 0xBD)
            return 1;
    return 0;
}

static char *copy_bytes(const char *s, size_t len) {
    char *c = malloc(len + 1);
    if (!c) return NULL;
    if (len) memcpy(c, s, len);
    c[len] = 0;
    return c;
}

int ds41_engram_token_key(const char *text, size_t text_len, const char *raw, size_t raw_len, char **key,
                          size_t *key_len, ds41_error *err) {
    if (!key || !key_len) return ds41_fail(err, "engram token key: no output");
    *key = NULL;
    *key_len = 0;
    if ((text_len > 0 && !text) || (raw_len > 0 && !raw))
        return ds41_fail(err, "engram token key: missing text or raw string");
    if (text_len > DS41_ENGRAM_MAX_TOKEN_BYTES || raw_len > DS41_ENGRAM_MAX_TOKEN_BYTES)
        return ds41_fail(err, "engram token key: token of more than %zu bytes",
                         (size_t)DS41_ENGRAM_MAX_TOKEN_BYTES);
    const char *src = NULL;
    size_t src_len = 0;
    char *normalized = NULL;
    size_t normalized_len = 0;
    /* The text must be valid UTF-8 in either branch: normalisation checks it. */
    if (ds41_engram_normalize(text, text_len, &normalized, &normalized_len, err) != 0) return -1;
    if (contains_replacement_char(text, text_len)) {
        src = raw;
        src_len = raw_len;
    } else if (normalized_len > 0) {
        *key = normalized;
        *key_len = normalized_len;
        return 0;
    } else {
        src = text;
        src_len = text_len;
    }
    free(normalized);
    *key = copy_bytes(src, src_len);
    if (!*key) return ds41_fail(err, "engram token key: out of memory");
    *key_len = src_len;
    return 0;
}

/* Byte-keyed open-addressing table: key -> compressed id. */
typedef struct key_entry {
    char *key; /* owned; NULL = empty slot */
    size_t len;
    uint64_t hash;
    int32_t id;
} key_entry;

typedef struct key_table {
    key_entry *slots;
    size_t capacity; /* power of two */
    size_t count;
} key_table;

static uint64_t fnv1a64(const char *s, size_t len) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static void key_table_free(key_table *t) {
    for (size_t i = 0; i < t->capacity; i++) free(t->slots[i].key);
    free(t->slots);
    memset(t, 0, sizeof *t);
}

static key_entry *key_table_find(key_table *t, const char *key, size_t len, uint64_t hash) {
    size_t mask = t->capacity - 1;
    for (size_t i = (size_t)hash & mask;; i = (i + 1) & mask) {
        key_entry *e = &t->slots[i];
        if (!e->key) return e;
        if (e->hash == hash && e->len == len && memcmp(e->key, key, len) == 0) return e;
    }
}

static int key_table_grow(key_table *t) {
    size_t capacity = t->capacity ? t->capacity * 2 : 1024;
    key_entry *slots = calloc(capacity, sizeof *slots);
    if (!slots) return -1;
    key_table old = *t;
    t->slots = slots;
    t->capacity = capacity;
    for (size_t i = 0; i < old.capacity; i++) {
        key_entry *e = &old.slots[i];
        if (e->key) *key_table_find(t, e->key, e->len, e->hash) = *e;
    }
    free(old.slots);
    return 0;
}

int ds41_engram_token_map_build(uint32_t n_ids, ds41_engram_text_fn get_text, void *ctx, int32_t *map_out,
                                uint32_t *n_compressed, ds41_error *err) {
    if (!get_text || !map_out || !n_compressed) return ds41_fail(err, "engram token map: missing argument");
    if (n_ids < 1 || n_ids > DS41_ENGRAM_MAX_TOKEN_IDS)
        return ds41_fail(err, "engram token map: %u token ids, supported 1..%u", n_ids,
                         DS41_ENGRAM_MAX_TOKEN_IDS);
    key_table table = {0};
    if (key_table_grow(&table) != 0) return ds41_fail(err, "engram token map: out of memory");
    for (uint32_t id = 0; id < n_ids; id++) {
        char *text = NULL;
        size_t text_len = 0;
        const char *raw = NULL;
        size_t raw_len = 0;
        if (get_text(ctx, id, &text, &text_len, &raw, &raw_len, err) != 0) {
            free(text);
            key_table_free(&table);
            return ds41_error_prefix(err, "engram token map: token %u", id);
        }
        char *key = NULL;
        size_t key_len = 0;
        int rc = ds41_engram_token_key(text, text_len, raw, raw_len, &key, &key_len, err);
        free(text);
        if (rc != 0) {
            key_table_free(&table);
            return ds41_error_prefix(err, "engram token map: token %u", id);
        }
        uint64_t hash = fnv1a64(key, key_len);
        key_entry *e = key_table_find(&table, key, key_len, hash);
        if (e->key) {
            free(key);
        } else {
            e->key = key;
            e->len = key_len;
            e->hash = hash;
            e->id = (int32_t)table.count++;
            /* Keep the load factor at most 1/2. */
            if (table.count * 2 > table.capacity && key_table_grow(&table) != 0) {
                key_table_free(&table);
                return ds41_fail(err, "engram token map: out of memory at token %u", id);
            }
            e = key_table_find(&table, key, key_len, hash);
        }
        map_out[id] = e->id;
    }
    *n_compressed = (uint32_t)table.count;
    key_table_free(&table);
    return 0;
}

int ds41_engram_token_map_digest(const int32_t *map, uint32_t n, uint8_t out[32]) {
    if ((n > 0 && !map) || !out) return -1;
    ds41_sha256_ctx c;
    ds41_sha256_init(&c);
    ds41_sha256_update(&c, "[", 1);
    char num[16];
    for (uint32_t i = 0; i < n; i++) {
        int len = snprintf(num, sizeof num, i ? ", %d" : "%d", (int)map[i]);
        ds41_sha256_update(&c, num, (size_t)len);
    }
    ds41_sha256_update(&c, "]", 1);
    ds41_sha256_final(&c, out);
    return 0;
}
