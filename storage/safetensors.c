/* safetensors reader: header parser, index parser, checkpoint directory.
 * The contract is storage/safetensors.h; this file explains the why. */
#include "storage/safetensors.h"
#include "config/json_util.h"
#include "storage/map_guard.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ================================================================ dtypes */

static const struct {
    const char *name;
    size_t size;
} dtype_info[DS41_DTYPE_COUNT] = {
    [DS41_BF16] = {"BF16", 2},       [DS41_F16] = {"F16", 2},         [DS41_F32] = {"F32", 4},
    [DS41_F8_E4M3] = {"F8_E4M3", 1}, [DS41_F8_E8M0] = {"F8_E8M0", 1}, [DS41_I8] = {"I8", 1},
    [DS41_U8] = {"U8", 1},           [DS41_I32] = {"I32", 4},         [DS41_I64] = {"I64", 8},
    [DS41_BOOL] = {"BOOL", 1},
};

const char *ds41_dtype_name(ds41_dtype dtype) {
    if ((unsigned)dtype >= DS41_DTYPE_COUNT) return "?";
    return dtype_info[dtype].name;
}

size_t ds41_dtype_size(ds41_dtype dtype) {
    if ((unsigned)dtype >= DS41_DTYPE_COUNT) return 0;
    return dtype_info[dtype].size;
}

int ds41_dtype_from_name(const char *s, size_t len, ds41_dtype *out) {
    if (!s) return -1;
    for (int d = 0; d < DS41_DTYPE_COUNT; d++) {
        const char *n = dtype_info[d].name;
        if (strlen(n) == len && memcmp(n, s, len) == 0) {
            *out = (ds41_dtype)d;
            return 0;
        }
    }
    return -1;
}

/* ======================================================= message helpers */

/* Names in messages come from untrusted files: show at most ~120 bytes and
 * replace control characters so an error stays one readable line. */
#define SHOW_MAX 160
static const char *show(char buf[SHOW_MAX], const char *s) {
    size_t o = 0, i = 0;
    for (; s[i] && o < 120; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[o++] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    if (s[i]) {
        /* Do not cut a UTF-8 sequence in half. */
        while (o > 0 && ((unsigned char)buf[o - 1] & 0xC0) == 0x80) o--;
        if (o > 0 && ((unsigned char)buf[o - 1] & 0xC0) == 0xC0) o--;
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = 0;
    return buf;
}

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* ====================================================== string hash table */

/* Open addressing with linear probing, sized once for a known number of
 * keys (load <= 1/2).  Keys are borrowed pointers. */
typedef struct strtab_slot {
    const char *key;
    uint32_t hash;
    uint32_t value;
} strtab_slot;

typedef struct strtab {
    strtab_slot *slots;
    size_t mask;
} strtab;

static uint32_t hash_str(const char *s) {
    uint64_t h = 0xcbf29ce484222325u;  /* FNV-1a, folded */
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3u;
    return (uint32_t)(h ^ (h >> 32));
}

static int strtab_init(strtab *t, size_t nkeys) {
    size_t cap = 16;
    while (cap < 2 * nkeys) {
        if (cap > SIZE_MAX / 4 / sizeof(strtab_slot)) return -1;
        cap *= 2;
    }
    t->slots = calloc(cap, sizeof *t->slots);
    t->mask = cap - 1;
    return t->slots ? 0 : -1;
}

static void strtab_free(strtab *t) {
    free(t->slots);
    t->slots = NULL;
}

/* Insert key -> value unless key is present.  Returns 1 when inserted, 0
 * when the key was there (its value stored in *existing).  The table must
 * have been sized for every key inserted. */
static int strtab_put(strtab *t, const char *key, uint32_t value, uint32_t *existing) {
    uint32_t h = hash_str(key);
    for (size_t i = h & t->mask;; i = (i + 1) & t->mask) {
        strtab_slot *s = &t->slots[i];
        if (!s->key) {
            s->key = key;
            s->hash = h;
            s->value = value;
            return 1;
        }
        if (s->hash == h && strcmp(s->key, key) == 0) {
            *existing = s->value;
            return 0;
        }
    }
}

static int strtab_get(const strtab *t, const char *key, uint32_t *value) {
    if (!t->slots) return 0;
    uint32_t h = hash_str(key);
    for (size_t i = h & t->mask;; i = (i + 1) & t->mask) {
        const strtab_slot *s = &t->slots[i];
        if (!s->key) return 0;
        if (s->hash == h && strcmp(s->key, key) == 0) {
            *value = s->value;
            return 1;
        }
    }
}

/* ============================================================ header parser */

static uint64_t load_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static json_t *load_json(const uint8_t *buf, size_t len, const char *label, const char *what,
                         ds41_error *err) {
    json_error_t je;
    json_t *root = json_loadb((const char *)buf, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        ds41_fail(err, "%s: %s is not valid JSON: %s (at byte %d of the JSON)", label, what, je.text,
                  je.position);
        return NULL;
    }
    if (!json_is_object(root)) {
        ds41_fail(err, "%s: %s is %s, not a JSON object", label, what, ds41_json_type_name(root));
        json_decref(root);
        return NULL;
    }
    return root;
}

/* Parse one JSON value that must be a non-negative integer. */
static bool json_nonneg(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* Validate one tensor entry and fill t (name excluded).  *begin gets the
 * relative data offset.  Errors are "tensor 'NAME': ..." (the caller prefixes
 * the file). */
static int parse_tensor_entry(const char *name, json_t *v, uint64_t data_size, ds41_tensor *t,
                              uint64_t *begin, ds41_error *err) {
    char nb[SHOW_MAX];
    if (!json_is_object(v))
        return ds41_fail(err, "tensor '%s': entry is %s, not an object", show(nb, name),
                         ds41_json_type_name(v));
    const char *key;
    json_t *field;
    json_object_foreach(v, key, field) {
        if (strcmp(key, "dtype") && strcmp(key, "shape") && strcmp(key, "data_offsets")) {
            char kb[SHOW_MAX];
            return ds41_fail(err,
                             "tensor '%s': unexpected key '%s' (an entry has exactly dtype, shape, "
                             "data_offsets)",
                             show(nb, name), show(kb, key));
        }
    }

    json_t *jd = json_object_get(v, "dtype");
    if (!jd) return ds41_fail(err, "tensor '%s': missing \"dtype\"", show(nb, name));
    if (!json_is_string(jd))
        return ds41_fail(err, "tensor '%s': dtype is %s, not a string", show(nb, name),
                         ds41_json_type_name(jd));
    if (ds41_dtype_from_name(json_string_value(jd), json_string_length(jd), &t->dtype) != 0) {
        char db[SHOW_MAX];
        return ds41_fail(err,
                         "tensor '%s': unsupported dtype '%s' (expected one of BF16, F16, F32, "
                         "F8_E4M3, F8_E8M0, I8, U8, I32, I64, BOOL)",
                         show(nb, name), show(db, json_string_value(jd)));
    }

    json_t *js = json_object_get(v, "shape");
    if (!js) return ds41_fail(err, "tensor '%s': missing \"shape\"", show(nb, name));
    if (!json_is_array(js))
        return ds41_fail(err, "tensor '%s': shape is %s, not an array", show(nb, name),
                         ds41_json_type_name(js));
    size_t ndim = json_array_size(js);
    if (ndim > DS41_MAX_DIMS)
        return ds41_fail(err, "tensor '%s': shape has %zu dimensions, more than %d", show(nb, name),
                         ndim, DS41_MAX_DIMS);
    bool any_zero = false;
    for (size_t i = 0; i < ndim; i++) {
        json_t *d = json_array_get(js, i);
        uint64_t dim;
        if (!json_nonneg(d, &dim)) {
            if (json_is_integer(d))
                return ds41_fail(err, "tensor '%s': shape[%zu] is %" JSON_INTEGER_FORMAT ", negative",
                                 show(nb, name), i, json_integer_value(d));
            return ds41_fail(err, "tensor '%s': shape[%zu] is %s, not a non-negative integer",
                             show(nb, name), i, ds41_json_type_name(d));
        }
        t->shape[i] = (int64_t)dim;
        if (dim == 0) any_zero = true;
    }
    t->ndim = (int)ndim;

    json_t *jo = json_object_get(v, "data_offsets");
    if (!jo) return ds41_fail(err, "tensor '%s': missing \"data_offsets\"", show(nb, name));
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return ds41_fail(err, "tensor '%s': data_offsets is not an array of two integers",
                         show(nb, name));
    uint64_t b, e;
    if (!json_nonneg(json_array_get(jo, 0), &b) || !json_nonneg(json_array_get(jo, 1), &e))
        return ds41_fail(err, "tensor '%s': data_offsets are not non-negative integers",
                         show(nb, name));
    if (b > e)
        return ds41_fail(err, "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") end before they begin",
                         show(nb, name), b, e);
    if (e > data_size)
        return ds41_fail(err,
                         "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                         ") lie outside the data region (%" PRIu64 " bytes; truncated file?)",
                         show(nb, name), b, e, data_size);

    /* Byte size with overflow checks; a zero dimension makes it 0 whatever
     * the others are. */
    uint64_t bytes = ds41_dtype_size(t->dtype);
    if (any_zero) {
        bytes = 0;
    } else {
        for (size_t i = 0; i < ndim; i++) {
            if (__builtin_mul_overflow(bytes, (uint64_t)t->shape[i], &bytes)) {
                char sb[256];
                format_shape(sb, sizeof sb, t->ndim, t->shape);
                return ds41_fail(err, "tensor '%s': shape %s of %s overflows a 64-bit byte size",
                                 show(nb, name), sb, ds41_dtype_name(t->dtype));
            }
        }
    }
    if (bytes != e - b) {
        char sb[256];
        format_shape(sb, sizeof sb, t->ndim, t->shape);
        return ds41_fail(err,
                         "tensor '%s': shape %s of %s is %" PRIu64 " bytes but data_offsets [%" PRIu64
                         ", %" PRIu64 ") hold %" PRIu64,
                         show(nb, name), sb, ds41_dtype_name(t->dtype), bytes, b, e, e - b);
    }
    t->nbytes = bytes;
    *begin = b;
    return 0;
}

typedef struct span {
    uint64_t begin, end;
    size_t tensor;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->tensor < y->tensor ? -1 : x->tensor > y->tensor;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const ds41_tensor *)a)->name, ((const ds41_tensor *)b)->name);
}

static char *arena_copy(char **cursor, const char *s, size_t len) {
    char *p = *cursor;
    memcpy(p, s, len);
    p[len] = 0;
    *cursor = p + len + 1;
    return p;
}

/* The JSON part of ds41_checkpoint_parse_header: root is the header object. */
static int parse_header_object(json_t *root, uint64_t data_start, uint64_t data_size,
                               ds41_st_header *out, ds41_error *err) {
    /* Pass 1: validate __metadata__, count entries and string bytes so one
     * allocation holds every name. */
    size_t ntensors = 0, nmeta = 0, string_bytes = 0;
    json_t *meta = NULL;
    const char *key;
    size_t key_len;
    json_t *v;
    json_object_keylen_foreach(root, key, key_len, v) {
        if (strcmp(key, "__metadata__") == 0) {
            meta = v;
            if (!json_is_object(meta))
                return ds41_fail(err, "__metadata__ is %s, not an object", ds41_json_type_name(meta));
            const char *mk;
            size_t mk_len;
            json_t *mv;
            json_object_keylen_foreach(meta, mk, mk_len, mv) {
                if (!json_is_string(mv)) {
                    char kb[SHOW_MAX];
                    return ds41_fail(err, "__metadata__ value of '%s' is %s, not a string",
                                     show(kb, mk), ds41_json_type_name(mv));
                }
                string_bytes += mk_len + 1 + json_string_length(mv) + 1;
                nmeta++;
            }
            continue;
        }
        if (key_len == 0) return ds41_fail(err, "a tensor has an empty name");
        ntensors++;
        string_bytes += key_len + 1;
    }

    out->tensors = ntensors ? calloc(ntensors, sizeof *out->tensors) : NULL;
    out->metadata = nmeta ? calloc(nmeta, sizeof *out->metadata) : NULL;
    out->strings = malloc(string_bytes ? string_bytes : 1);
    span *spans = ntensors ? malloc(ntensors * sizeof *spans) : NULL;
    if ((ntensors && (!out->tensors || !spans)) || (nmeta && !out->metadata) || !out->strings) {
        free(spans);
        return ds41_fail(err, "out of memory for %zu tensors", ntensors);
    }

    /* Pass 2: validate and copy every tensor entry. */
    char *cursor = out->strings;
    size_t nt = 0, nspans = 0;
    uint64_t payload = 0;
    json_object_keylen_foreach(root, key, key_len, v) {
        if (v == meta) continue;
        ds41_tensor *t = &out->tensors[nt];
        uint64_t begin = 0;
        if (parse_tensor_entry(key, v, data_size, t, &begin, err) != 0) {
            free(spans);
            return -1;
        }
        t->name = arena_copy(&cursor, key, key_len);
        t->file_offset = data_start + begin;
        if (t->nbytes) spans[nspans++] = (span){begin, begin + t->nbytes, nt};
        payload += t->nbytes;
        nt++;
    }
    out->tensor_count = nt;

    if (meta) {
        const char *mk;
        size_t mk_len;
        json_t *mv;
        size_t i = 0;
        json_object_keylen_foreach(meta, mk, mk_len, mv) {
            out->metadata[i].key = arena_copy(&cursor, mk, mk_len);
            out->metadata[i].value = arena_copy(&cursor, json_string_value(mv), json_string_length(mv));
            i++;
        }
        out->metadata_count = i;
    }

    /* Non-empty payloads must not share a byte.  After sorting by begin it
     * is enough to compare neighbours: as long as none overlap, ends rise. */
    if (nspans > 1) qsort(spans, nspans, sizeof *spans, cmp_span);
    for (size_t i = 1; i < nspans; i++) {
        if (spans[i].begin < spans[i - 1].end) {
            char a[SHOW_MAX], b[SHOW_MAX];
            const span *p = &spans[i - 1], *q = &spans[i];
            ds41_fail(err,
                      "tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 ") overlap tensor '%s' [%" PRIu64
                      ", %" PRIu64 ")",
                      show(a, out->tensors[q->tensor].name), q->begin, q->end,
                      show(b, out->tensors[p->tensor].name), p->begin, p->end);
            free(spans);
            return -1;
        }
    }
    free(spans);

    if (nt > 1) qsort(out->tensors, nt, sizeof *out->tensors, cmp_tensor_name);
    out->payload_bytes = payload;
    return 0;
}

int ds41_checkpoint_parse_header(const uint8_t *file_prefix, size_t prefix_len, uint64_t file_size,
                                 const char *file_label, ds41_st_header *out, ds41_error *err) {
    const char *label = file_label ? file_label : "<safetensors>";
    memset(out, 0, sizeof *out);
    if (file_size < 8)
        return ds41_fail(err, "%s: file is %" PRIu64 " bytes, too short for the 8-byte header length (truncated?)",
                         label, file_size);
    if (!file_prefix || prefix_len < 8)
        return ds41_fail(err, "%s: only %zu bytes of the file were read, the header length needs 8",
                         label, file_prefix ? prefix_len : 0);
    uint64_t n = load_le64(file_prefix);
    if (n > DS41_ST_MAX_HEADER_BYTES)
        return ds41_fail(err,
                         "%s: header length %" PRIu64 " is over the %" PRIu64
                         "-byte limit (corrupt, or not a safetensors file)",
                         label, n, DS41_ST_MAX_HEADER_BYTES);
    if (n > file_size - 8)
        return ds41_fail(err,
                         "%s: header length %" PRIu64 " runs past the end of the file (%" PRIu64
                         " bytes; truncated?)",
                         label, n, file_size);
    if (prefix_len - 8 < n)
        return ds41_fail(err, "%s: only %zu bytes of the file were read, the header needs %" PRIu64,
                         label, prefix_len, 8 + n);

    out->header_len = n;
    out->data_start = 8 + n;
    out->data_size = file_size - out->data_start;

    json_t *root = load_json(file_prefix + 8, (size_t)n, label, "header", err);
    if (!root) return -1;
    int rc = parse_header_object(root, out->data_start, out->data_size, out, err);
    json_decref(root);
    if (rc != 0) {
        ds41_error_prefix(err, "%s", label);
        ds41_checkpoint_header_free(out);
        return -1;
    }
    return 0;
}

void ds41_checkpoint_header_free(ds41_st_header *h) {
    if (!h) return;
    free(h->tensors);
    free(h->metadata);
    free(h->strings);
    memset(h, 0, sizeof *h);
}

/* ============================================================ index parser */

static bool plain_file_name(const char *s) {
    if (!*s) return false;
    if (strchr(s, '/') || strstr(s, "..")) return false;
    for (; *s; s++)
        if ((unsigned char)*s < 0x20) return false;
    return true;
}

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int ds41_checkpoint_parse_index(const uint8_t *json, size_t len, const char *file_label, ds41_st_index *out,
                                ds41_error *err) {
    const char *label = file_label ? file_label : "<index>";
    memset(out, 0, sizeof *out);
    if (len > DS41_ST_MAX_HEADER_BYTES)
        return ds41_fail(err, "%s: %zu bytes, over the %" PRIu64 "-byte limit for an index", label,
                         len, DS41_ST_MAX_HEADER_BYTES);
    json_t *root = load_json(json, len, label, "the index", err);
    if (!root) return -1;

    strtab shards = {0};
    const char **distinct = NULL;
    int rc = -1;
    char nb[SHOW_MAX], sb[SHOW_MAX];

    json_t *meta = json_object_get(root, "metadata");
    if (meta) {
        if (!json_is_object(meta)) {
            ds41_fail(err, "%s: metadata is %s, not an object", label, ds41_json_type_name(meta));
            goto done;
        }
        json_t *ts = json_object_get(meta, "total_size");
        if (ts) {
            /* Hugging Face writes an integer; some tools write it as a float
             * with an integral value, which says the same. */
            double d = json_is_real(ts) ? json_real_value(ts) : -1;
            if (json_nonneg(ts, &out->total_size)) {
                out->has_total_size = 1;
            } else if (json_is_real(ts) && d >= 0 && d < 18446744073709551616.0 && d == (double)(uint64_t)d) {
                out->total_size = (uint64_t)d;
                out->has_total_size = 1;
            } else {
                ds41_fail(err, "%s: metadata.total_size is %s, not a non-negative integer", label,
                          ds41_json_type_name(ts));
                goto done;
            }
        }
    }

    json_t *wm = json_object_get(root, "weight_map");
    if (!wm) {
        ds41_fail(err, "%s: no \"weight_map\" object", label);
        goto done;
    }
    if (!json_is_object(wm)) {
        ds41_fail(err, "%s: weight_map is %s, not an object", label, ds41_json_type_name(wm));
        goto done;
    }
    size_t nentries = json_object_size(wm);
    if (nentries == 0) {
        ds41_fail(err, "%s: weight_map is empty (no tensors)", label);
        goto done;
    }

    /* Pass 1: validate, find the distinct shard names, size the strings. */
    if (strtab_init(&shards, nentries) != 0 || !(distinct = malloc(nentries * sizeof *distinct))) {
        ds41_fail(err, "%s: out of memory for %zu entries", label, nentries);
        goto done;
    }
    size_t ndistinct = 0, string_bytes = 0;
    const char *key;
    size_t key_len;
    json_t *v;
    json_object_keylen_foreach(wm, key, key_len, v) {
        if (key_len == 0) {
            ds41_fail(err, "%s: weight_map has an empty tensor name", label);
            goto done;
        }
        if (!json_is_string(v)) {
            ds41_fail(err, "%s: weight_map: tensor '%s' maps to %s, not a shard file name", label,
                      show(nb, key), ds41_json_type_name(v));
            goto done;
        }
        const char *shard = json_string_value(v);
        if (!plain_file_name(shard)) {
            ds41_fail(err,
                      "%s: weight_map: tensor '%s' maps to shard '%s', which is not a plain file "
                      "name in the checkpoint directory (no '/', no '..')",
                      label, show(nb, key), show(sb, shard));
            goto done;
        }
        uint32_t existing;
        if (strtab_put(&shards, shard, (uint32_t)ndistinct, &existing)) {
            distinct[ndistinct++] = shard;
            string_bytes += strlen(shard) + 1;
        }
        string_bytes += key_len + 1;
    }

    /* Shards are numbered in name order; remember the first tensor mapped to
     * each so a missing shard can be reported with one of its tensors. */
    qsort(distinct, ndistinct, sizeof *distinct, cmp_cstr);
    out->entries = malloc(nentries * sizeof *out->entries);
    out->shard_names = malloc(ndistinct * sizeof *out->shard_names);
    out->shard_first_tensor = calloc(ndistinct, sizeof *out->shard_first_tensor);
    out->strings = malloc(string_bytes);
    if (!out->entries || !out->shard_names || !out->shard_first_tensor || !out->strings) {
        ds41_fail(err, "%s: out of memory for %zu entries", label, nentries);
        goto done;
    }
    char *cursor = out->strings;
    for (size_t i = 0; i < ndistinct; i++) {
        out->shard_names[i] = arena_copy(&cursor, distinct[i], strlen(distinct[i]));
        /* Re-point the table at the sorted number. */
        uint32_t h = hash_str(distinct[i]);
        for (size_t s = h & shards.mask;; s = (s + 1) & shards.mask) {
            if (shards.slots[s].hash == h && strcmp(shards.slots[s].key, distinct[i]) == 0) {
                shards.slots[s].value = (uint32_t)i;
                break;
            }
        }
    }
    out->shard_count = ndistinct;

    /* Pass 2: the entries, in file order. */
    size_t ne = 0;
    json_object_keylen_foreach(wm, key, key_len, v) {
        uint32_t shard = 0;
        strtab_get(&shards, json_string_value(v), &shard);
        out->entries[ne].tensor = arena_copy(&cursor, key, key_len);
        out->entries[ne].shard = shard;
        if (!out->shard_first_tensor[shard]) out->shard_first_tensor[shard] = out->entries[ne].tensor;
        ne++;
    }
    out->entry_count = ne;
    rc = 0;

done:
    strtab_free(&shards);
    free(distinct);
    json_decref(root);
    if (rc != 0) ds41_checkpoint_index_free(out);
    return rc;
}

void ds41_checkpoint_index_free(ds41_st_index *idx) {
    if (!idx) return;
    free(idx->entries);
    free(idx->shard_names);
    free(idx->shard_first_tensor);
    free(idx->strings);
    memset(idx, 0, sizeof *idx);
}

/* ============================================================== checkpoint */

typedef struct shard {
    char *path;        /* DIR/NAME */
    const char *name;  /* inside path */
    int fd;
    uint64_t size;
    void *map;
    int guard;         /* storage/map_guard.h handle of map, -1 = none */
    ds41_st_header header; /* tensors moved to the checkpoint; strings kept */
} shard;

struct ds41_checkpoint {
    char *dir;
    size_t shard_count;
    shard *shards;
    size_t tensor_count;
    ds41_tensor *tensors; /* sorted by name */
    strtab by_name;       /* name -> index in tensors */
    uint64_t payload_bytes;
};

static char *path_join(const char *dir, const char *name) {
    size_t dl = strlen(dir), nl = strlen(name);
    bool slash = dl > 0 && dir[dl - 1] == '/';
    char *p = malloc(dl + nl + 2);
    if (!p) return NULL;
    memcpy(p, dir, dl);
    if (!slash) p[dl++] = '/';
    memcpy(p + dl, name, nl + 1);
    return p;
}

/* pread exactly len bytes at off, or fail. */
static int pread_full(int fd, void *buf, size_t len, uint64_t off, const char *label, ds41_error *err) {
    uint8_t *p = buf;
    while (len > 0) {
        ssize_t got = pread(fd, p, len, (off_t)off);
        if (got < 0) {
            if (errno == EINTR) continue;
            return ds41_fail(err, "%s: read failed at offset %" PRIu64 ": %s", label, off, strerror(errno));
        }
        if (got == 0)
            return ds41_fail(err, "%s: file ended at offset %" PRIu64 " while reading (changed on disk?)",
                             label, off);
        p += got;
        len -= (size_t)got;
        off += (uint64_t)got;
    }
    return 0;
}

/* Read the index file fully (it is small: 7.4 MB for the real model). */
static int read_index(const char *path, ds41_st_index *idx, ds41_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not hang us */
    if (fd < 0) return ds41_fail(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    uint8_t *buf = NULL;
    int rc = -1;
    if (fstat(fd, &st) != 0) {
        ds41_fail(err, "%s: cannot stat: %s", path, strerror(errno));
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        ds41_fail(err, "%s: not a regular file", path);
        goto out;
    }
    if ((uint64_t)st.st_size > DS41_ST_MAX_HEADER_BYTES) {
        ds41_fail(err, "%s: %" PRIu64 " bytes, over the %" PRIu64 "-byte limit for an index", path,
                  (uint64_t)st.st_size, DS41_ST_MAX_HEADER_BYTES);
        goto out;
    }
    size_t len = (size_t)st.st_size;
    buf = malloc(len ? len : 1);
    if (!buf) {
        ds41_fail(err, "%s: out of memory (%zu bytes)", path, len);
        goto out;
    }
    if (pread_full(fd, buf, len, 0, path, err) != 0) goto out;
    rc = ds41_checkpoint_parse_index(buf, len, path, idx, err);
out:
    free(buf);
    close(fd);
    return rc;
}

/* Open one shard: read and validate its header with pread, then map it.
 * first_tensor (may be NULL) names a tensor the index maps here, for the
 * "missing shard" message. */
static int open_shard(shard *s, const char *first_tensor, ds41_error *err) {
    char nb[SHOW_MAX];
    /* O_NONBLOCK so that a FIFO planted under a shard's name cannot hang
     * us; it is cleared once the file is known to be regular (io_uring
     * would otherwise fail reads with EAGAIN instead of waiting). */
    s->fd = open(s->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (s->fd < 0) {
        int e = errno;
        if (e == ENOENT && first_tensor)
            return ds41_fail(err, "%s: shard file is missing (the index maps tensor '%s' and others to it)",
                             s->path, show(nb, first_tensor));
        return ds41_fail(err, "%s: cannot open shard: %s", s->path, strerror(e));
    }
    struct stat st;
    if (fstat(s->fd, &st) != 0) return ds41_fail(err, "%s: cannot stat: %s", s->path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return ds41_fail(err, "%s: not a regular file", s->path);
    int fl = fcntl(s->fd, F_GETFL);
    if (fl < 0 || fcntl(s->fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        return ds41_fail(err, "%s: fcntl failed: %s", s->path, strerror(errno));
    s->size = (uint64_t)st.st_size;
    if (s->size > (uint64_t)SIZE_MAX)
        return ds41_fail(err, "%s: %" PRIu64 " bytes do not fit the address space", s->path, s->size);

    /* No readahead on this descriptor: reading the header must not pull the
     * payload that follows it into the page cache (the io_uring reader reads
     * explicit ranges later, so random is right for it too). */
    (void)posix_fadvise(s->fd, 0, 0, POSIX_FADV_RANDOM);

    uint8_t len8[8];
    size_t first = s->size < 8 ? (size_t)s->size : 8;
    if (pread_full(s->fd, len8, first, 0, s->path, err) != 0) return -1;
    uint64_t n = first == 8 ? load_le64(len8) : 0;
    if (first < 8 || n > DS41_ST_MAX_HEADER_BYTES || n > s->size - 8) {
        /* The parser words the error. */
        return ds41_checkpoint_parse_header(len8, first, s->size, s->path, &s->header, err);
    }
    uint8_t *hbuf = malloc((size_t)(8 + n));
    if (!hbuf) return ds41_fail(err, "%s: out of memory for a %" PRIu64 "-byte header", s->path, n);
    int rc = pread_full(s->fd, hbuf, (size_t)(8 + n), 0, s->path, err);
    if (rc == 0) rc = ds41_checkpoint_parse_header(hbuf, (size_t)(8 + n), s->size, s->path, &s->header, err);
    free(hbuf);
    if (rc != 0) return -1;

    /* Map without populating; the payload is only faulted in on use. */
    void *m = mmap(NULL, (size_t)s->size, PROT_READ, MAP_SHARED, s->fd, 0);
    if (m == MAP_FAILED) return ds41_fail(err, "%s: mmap of %" PRIu64 " bytes failed: %s", s->path, s->size, strerror(errno));
    s->map = m;
    /* A shard truncated under us must not kill the process: the guard turns
     * the SIGBUS into zero pages plus a loss that ds41_checkpoint_check_mappings
     * reports. */
    s->guard = ds41_map_guard_register(m, (size_t)s->size, err);
    if (s->guard < 0) return ds41_error_prefix(err, "%s", s->path);
    /* Weights are read in scattered pieces (experts, engram rows): fault
     * single pages instead of reading ahead. */
    (void)madvise(m, (size_t)s->size, MADV_RANDOM);
    return 0;
}

/* Shards are independent until the merge, and parsing 48 headers of ~10 MB
 * JSON in all is most of the open time: parse them on a few threads.  Every
 * shard is attempted, and the lowest-numbered failure is reported, so the
 * message does not depend on scheduling. */
typedef struct shard_job {
    ds41_checkpoint *c;
    const char *const *first_tensor;
    ds41_error *errs;
    int *rcs;
    atomic_size_t next;
} shard_job;

static void *shard_worker(void *arg) {
    shard_job *job = arg;
    for (;;) {
        size_t i = atomic_fetch_add(&job->next, 1);
        if (i >= job->c->shard_count) return NULL;
        job->rcs[i] = open_shard(&job->c->shards[i], job->first_tensor ? job->first_tensor[i] : NULL, &job->errs[i]);
    }
}

static int open_all_shards(ds41_checkpoint *c, const char *const *first_tensor, ds41_error *err) {
    size_t n = c->shard_count;
    shard_job job = {.c = c, .first_tensor = first_tensor};
    atomic_init(&job.next, 0);
    job.errs = calloc(n, sizeof *job.errs);
    job.rcs = calloc(n, sizeof *job.rcs);
    if (!job.errs || !job.rcs) {
        free(job.errs);
        free(job.rcs);
        return ds41_fail(err, "%s: out of memory", c->dir);
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t nthreads = cpus > 1 ? (size_t)cpus : 1;
    if (nthreads > 16) nthreads = 16;
    if (nthreads > n) nthreads = n;
    pthread_t tids[16];
    size_t started = 0;
    /* The calling thread works too; failing to start a helper only slows
     * things down. */
    for (size_t i = 1; i < nthreads; i++, started++)
        if (pthread_create(&tids[started], NULL, shard_worker, &job) != 0) break;
    shard_worker(&job);
    for (size_t i = 0; i < started; i++) pthread_join(tids[i], NULL);

    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        if (job.rcs[i] != 0) {
            if (err) *err = job.errs[i];
            rc = -1;
            break;
        }
    }
    free(job.errs);
    free(job.rcs);
    return rc;
}

/* Merge every shard's tensors into one name-sorted array with a hash index;
 * a name in two shards is an error. */
static int merge_tensors(ds41_checkpoint *c, ds41_error *err) {
    size_t total = 0;
    for (size_t i = 0; i < c->shard_count; i++) total += c->shards[i].header.tensor_count;
    if (total > UINT32_MAX - 1) return ds41_fail(err, "%s: %zu tensors are too many", c->dir, total);
    c->tensors = total ? malloc(total * sizeof *c->tensors) : NULL;
    if ((total && !c->tensors) || strtab_init(&c->by_name, total) != 0)
        return ds41_fail(err, "%s: out of memory for %zu tensors", c->dir, total);
    size_t k = 0;
    for (size_t i = 0; i < c->shard_count; i++) {
        shard *s = &c->shards[i];
        for (size_t j = 0; j < s->header.tensor_count; j++) {
            ds41_tensor *t = &c->tensors[k++];
            *t = s->header.tensors[j];
            t->shard = (uint32_t)i;
            t->data = (const uint8_t *)s->map + t->file_offset;
            c->payload_bytes += t->nbytes;
        }
        free(s->header.tensors);
        s->header.tensors = NULL;
    }
    c->tensor_count = total;
    if (total > 1) qsort(c->tensors, total, sizeof *c->tensors, cmp_tensor_name);
    for (size_t i = 0; i < total; i++) {
        uint32_t other;
        if (!strtab_put(&c->by_name, c->tensors[i].name, (uint32_t)i, &other)) {
            char nb[SHOW_MAX];
            const ds41_tensor *a = &c->tensors[other], *b = &c->tensors[i];
            return ds41_fail(err, "%s: tensor '%s' is also in %s (a tensor must be in one shard)",
                             c->shards[b->shard].path, show(nb, b->name), c->shards[a->shard].name);
        }
    }
    return 0;
}

/* The index and the shard headers must describe the same tensors. */
static int check_index_agrees(ds41_checkpoint *c, const ds41_st_index *idx, const char *index_path,
                              ds41_error *err) {
    char nb[SHOW_MAX];
    bool *mapped = c->tensor_count ? calloc(c->tensor_count, sizeof *mapped) : NULL;
    if (c->tensor_count && !mapped) return ds41_fail(err, "%s: out of memory", c->dir);
    int rc = -1;
    for (size_t i = 0; i < idx->entry_count; i++) {
        const ds41_st_index_entry *e = &idx->entries[i];
        uint32_t ti;
        if (!strtab_get(&c->by_name, e->tensor, &ti)) {
            ds41_fail(err, "%s: tensor '%s' is missing: %s maps it to this shard", c->shards[e->shard].path,
                      show(nb, e->tensor), DS41_ST_INDEX_NAME);
            goto out;
        }
        const ds41_tensor *t = &c->tensors[ti];
        if (t->shard != e->shard) {
            ds41_fail(err, "%s: tensor '%s' is missing: %s maps it to this shard, but it is in %s",
                      c->shards[e->shard].path, show(nb, e->tensor), DS41_ST_INDEX_NAME,
                      c->shards[t->shard].name);
            goto out;
        }
        mapped[ti] = true;
    }
    for (size_t i = 0; i < c->tensor_count; i++) {
        if (!mapped[i]) {
            const ds41_tensor *t = &c->tensors[i];
            ds41_fail(err, "%s: tensor '%s' is not in the weight_map of %s", c->shards[t->shard].path,
                      show(nb, t->name), index_path);
            goto out;
        }
    }
    if (idx->has_total_size && idx->total_size != c->payload_bytes) {
        ds41_fail(err, "%s: metadata.total_size is %" PRIu64 " but the shards hold %" PRIu64 " payload bytes",
                  index_path, idx->total_size, c->payload_bytes);
        goto out;
    }
    rc = 0;
out:
    free(mapped);
    return rc;
}

static int setup_shards(ds41_checkpoint *c, size_t n, const char *const *names, ds41_error *err) {
    c->shards = calloc(n, sizeof *c->shards);
    if (!c->shards) return ds41_fail(err, "%s: out of memory", c->dir);
    c->shard_count = n;
    for (size_t i = 0; i < n; i++) {
        c->shards[i].fd = -1;
        c->shards[i].guard = -1;
        c->shards[i].path = path_join(c->dir, names[i]);
        if (!c->shards[i].path) return ds41_fail(err, "%s: out of memory", c->dir);
        c->shards[i].name = c->shards[i].path + strlen(c->shards[i].path) - strlen(names[i]);
    }
    return 0;
}

ds41_checkpoint *ds41_checkpoint_open(const char *dir, ds41_error *err) {
    if (!dir || !*dir) {
        ds41_fail(err, "checkpoint directory: empty path");
        return NULL;
    }
    struct stat st;
    if (stat(dir, &st) != 0) {
        ds41_fail(err, "%s: cannot open checkpoint directory: %s", dir, strerror(errno));
        return NULL;
    }
    if (!S_ISDIR(st.st_mode)) {
        ds41_fail(err, "%s: not a directory (give the checkpoint directory)", dir);
        return NULL;
    }
    ds41_checkpoint *c = calloc(1, sizeof *c);
    if (!c || !(c->dir = strdup(dir))) {
        free(c);
        ds41_fail(err, "%s: out of memory", dir);
        return NULL;
    }

    ds41_st_index idx = {0};
    char *index_path = path_join(dir, DS41_ST_INDEX_NAME);
    char *single_path = path_join(dir, DS41_ST_SINGLE_NAME);
    bool indexed = false;
    if (!index_path || !single_path) {
        ds41_fail(err, "%s: out of memory", dir);
        goto fail;
    }
    if (stat(index_path, &st) == 0) {
        indexed = true;
        if (read_index(index_path, &idx, err) != 0) goto fail;
        if (setup_shards(c, idx.shard_count, idx.shard_names, err) != 0) goto fail;
    } else if (errno != ENOENT) {
        ds41_fail(err, "%s: cannot stat: %s", index_path, strerror(errno));
        goto fail;
    } else if (stat(single_path, &st) == 0 || errno != ENOENT) {
        const char *one = DS41_ST_SINGLE_NAME;
        if (setup_shards(c, 1, &one, err) != 0) goto fail;
    } else {
        ds41_fail(err, "%s: no checkpoint here: neither %s nor %s exists", dir, DS41_ST_INDEX_NAME,
                  DS41_ST_SINGLE_NAME);
        goto fail;
    }

    if (open_all_shards(c, indexed ? idx.shard_first_tensor : NULL, err) != 0) goto fail;
    if (merge_tensors(c, err) != 0) goto fail;
    if (indexed && check_index_agrees(c, &idx, index_path, err) != 0) goto fail;

    ds41_checkpoint_index_free(&idx);
    free(index_path);
    free(single_path);
    return c;

fail:
    ds41_checkpoint_index_free(&idx);
    free(index_path);
    free(single_path);
    ds41_checkpoint_close(c);
    return NULL;
}

void ds41_checkpoint_close(ds41_checkpoint *c) {
    if (!c) return;
    for (size_t i = 0; i < c->shard_count; i++) {
        shard *s = &c->shards[i];
        ds41_map_guard_unregister(s->guard); /* before the range goes */
        if (s->map) munmap(s->map, (size_t)s->size);
        if (s->fd >= 0) close(s->fd);
        ds41_checkpoint_header_free(&s->header);
        free(s->path);
    }
    free(c->shards);
    free(c->tensors);
    strtab_free(&c->by_name);
    free(c->dir);
    free(c);
}

const char *ds41_checkpoint_dir(const ds41_checkpoint *c) {
    return c->dir;
}

size_t ds41_checkpoint_tensor_count(const ds41_checkpoint *c) {
    return c->tensor_count;
}

uint64_t ds41_checkpoint_payload_bytes(const ds41_checkpoint *c) {
    return c->payload_bytes;
}

const ds41_tensor *ds41_checkpoint_tensor_at(const ds41_checkpoint *c, size_t i) {
    return i < c->tensor_count ? &c->tensors[i] : NULL;
}

const ds41_tensor *ds41_checkpoint_find(const ds41_checkpoint *c, const char *name) {
    uint32_t i;
    if (!name || !strtab_get(&c->by_name, name, &i)) return NULL;
    return &c->tensors[i];
}

size_t ds41_checkpoint_shard_count(const ds41_checkpoint *c) {
    return c->shard_count;
}

const char *ds41_checkpoint_shard_path(const ds41_checkpoint *c, uint32_t i) {
    return i < c->shard_count ? c->shards[i].path : NULL;
}

int ds41_checkpoint_shard_fd(const ds41_checkpoint *c, uint32_t i) {
    return i < c->shard_count ? c->shards[i].fd : -1;
}

uint64_t ds41_checkpoint_shard_size(const ds41_checkpoint *c, uint32_t i) {
    return i < c->shard_count ? c->shards[i].size : 0;
}

const void *ds41_checkpoint_shard_base(const ds41_checkpoint *c, uint32_t i) {
    return i < c->shard_count ? c->shards[i].map : NULL;
}

uint64_t ds41_checkpoint_prefault(const ds41_checkpoint *c, const ds41_tensor *t) {
#ifdef MADV_POPULATE_READ
    if (!t || t->nbytes == 0 || t->shard >= c->shard_count || !c->shards[t->shard].map) return 0;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t b = (uintptr_t)t->data & ~(page - 1), e = (uintptr_t)t->data + t->nbytes;
    if (madvise((void *)b, e - b, MADV_POPULATE_READ) != 0) return 0;
    return t->nbytes;
#else
    (void)c;
    (void)t;
    return 0;
#endif
}

int ds41_checkpoint_check_mappings(const ds41_checkpoint *c, ds41_error *err) {
    if (ds41_map_guard_losses() == 0) return 0; /* nothing was ever lost in this process */
    for (size_t i = 0; i < c->shard_count; i++) {
        const uint64_t off = ds41_map_guard_lost(c->shards[i].guard);
        if (off != DS41_MAP_GUARD_INTACT)
            return ds41_fail(err,
                             "%s was truncated or became unreadable while mapped (SIGBUS at offset %" PRIu64
                             "): the model must be reloaded",
                             c->shards[i].path, off);
    }
    return 0;
}
