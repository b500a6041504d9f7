#include "engine/text/vocab.h"

#include "config/json_util.h"
#include "config/utf8.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ======================================================================
 * GPT-2 byte alphabet
 * ====================================================================== */

/* Printable bytes keep their code point; the 68 others, in ascending order
 * (0x00-0x20, 0x7F-0xA0, 0xAD), become U+0100..U+0143. */
static bool byte_is_printable(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

uint32_t ds41_byte_level_char(uint8_t byte) {
    if (byte_is_printable(byte)) return byte;
    if (byte <= 0x20) return 0x100 + byte;               /* 33 of them: U+0100..U+0120 */
    if (byte <= 0xA0) return 0x100 + 33 + (byte - 0x7F); /* 34: U+0121..U+0142 */
    return 0x143;                                        /* 0xAD */
}

int ds41_byte_level_byte(uint32_t cp) {
    if (cp < 0x100) return byte_is_printable(cp) ? (int)cp : -1;
    uint32_t k = cp - 0x100;
    if (k <= 32) return (int)k;
    if (k <= 66) return (int)(0x7F + k - 33);
    return k == 67 ? 0xAD : -1;
}

int ds41_byte_level_rank(uint8_t byte) {
    /* The 188 printable bytes first, in byte order, then the 68 others. */
    if (byte >= 0x21 && byte <= 0x7E) return byte - 0x21;        /* 94 */
    if (byte >= 0xA1 && byte <= 0xAC) return 94 + (byte - 0xA1); /* 12 */
    if (byte >= 0xAE) return 106 + (byte - 0xAE);                /* 82 */
    return 188 + (int)(ds41_byte_level_char(byte) - 0x100);
}

/* ======================================================================
 * The vocabulary
 * ====================================================================== */

#define NO_STRING UINT32_MAX

typedef struct span {
    uint32_t off, len; /* into the arena; off == NO_STRING: hole */
} span;

/* Open-addressing string -> entry index map (entries live in a span array). */
typedef struct strmap {
    uint32_t *slots; /* entry index + 1; 0 = empty */
    uint32_t mask;
} strmap;

struct ds41_vocab {
    char *label;
    char *arena;
    size_t arena_len, arena_cap;

    uint32_t size;     /* max id + 1 */
    uint32_t n_tokens; /* ids that exist */
    span *id_str;      /* [size]: the string of each id */

    uint32_t model_count;
    span *model_str;    /* [model_count] */
    uint32_t *model_id; /* [model_count] */
    strmap model_map;

    ds41_added_token *added; /* [n_added], file order */
    size_t n_added;
    uint32_t *added_by_id; /* [n_added]: indices into added, sorted by id */
    span *added_str;       /* [n_added] */
    strmap added_map;

    ds41_merge *merges;
    size_t n_merges;
    bool ignore_merges;

    char *component[4];
    bool normalizer_identity;
    ds41_vocab_split *splits;
    size_t n_splits;
    bool has_byte_level, bl_add_prefix_space, bl_use_regex;

    size_t max_token_bytes;

    int32_t bos, eos, pad;
    bool add_bos, add_eos;
    uint64_t model_max_length;
};

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

static int strmap_init(strmap *m, size_t n_entries) {
    size_t cap = 16;
    while (cap < 2 * n_entries + 1) cap <<= 1;
    m->slots = calloc(cap, sizeof *m->slots);
    m->mask = (uint32_t)(cap - 1);
    return m->slots ? 0 : -1;
}

/* Find S among the entries (strings given by SPANS); returns the entry index
 * or -1, and in *slot the slot where it is or would go. */
static int64_t strmap_find(const strmap *m, const char *arena, const span *spans, const char *s, size_t n,
                           uint32_t *slot) {
    uint32_t i = (uint32_t)hash_bytes(s, n) & m->mask;
    for (;;) {
        uint32_t e = m->slots[i];
        if (!e) {
            if (slot) *slot = i;
            return -1;
        }
        const span *sp = &spans[e - 1];
        if (sp->len == n && memcmp(arena + sp->off, s, n) == 0) {
            if (slot) *slot = i;
            return e - 1;
        }
        i = (i + 1) & m->mask;
    }
}

/* A token or key for an error message: quoted, control bytes escaped, cut
 * after ~48 bytes on a character boundary. */
static const char *show(const char *s, size_t n, char out[96]) {
    size_t o = 0;
    out[o++] = '\'';
    for (size_t i = 0; i < n; i++) {
        if (o > 56) {
            while (i > 0 && ((uint8_t)s[i] & 0xC0) == 0x80) i--, o--; /* back to a char start */
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        uint8_t c = (uint8_t)s[i];
        if (c < 0x20 || c == 0x7F || c == '\'' || c == '\\') {
            o += (size_t)snprintf(out + o, 8, "\\x%02x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o++] = '\'';
    out[o] = 0;
    return out;
}

static const char *lbl(const char *label) {
    return label ? label : "tokenizer.json";
}

static int arena_put(ds41_vocab *v, const char *s, size_t n, span *out) {
    if (n >= UINT32_MAX || v->arena_len + n + 1 > v->arena_cap) return -1;
    memcpy(v->arena + v->arena_len, s, n);
    v->arena[v->arena_len + n] = 0;
    out->off = (uint32_t)v->arena_len;
    out->len = (uint32_t)n;
    v->arena_len += n + 1;
    return 0;
}

/* ---- small JSON helpers ---------------------------------------------------- */

/* A JSON integer in [0, DS41_VOCAB_MAX_IDS) -> *id; else a message in why. */
static bool json_id(const json_t *j, uint32_t *id, const char **why) {
    if (!json_is_integer(j)) {
        *why = "must be an integer";
        return false;
    }
    json_int_t x = json_integer_value(j);
    if (x < 0) {
        *why = "is negative";
        return false;
    }
    if (x >= (json_int_t)DS41_VOCAB_MAX_IDS) {
        *why = "is too large (ids must be below 4194304)";
        return false;
    }
    *id = (uint32_t)x;
    return true;
}

/* A field that is absent or JSON null. */
static bool absent(const json_t *j) {
    return j == NULL || json_is_null(j);
}

static const char *type_of(const json_t *j) {
    json_t *t = json_is_object(j) ? json_object_get(j, "type") : NULL;
    return json_is_string(t) ? json_string_value(t) : NULL;
}

static int optional_bool(const json_t *obj, const char *key, bool dflt, bool *out, const char *label,
                         const char *path, ds41_error *err) {
    json_t *j = json_object_get(obj, key);
    if (absent(j)) {
        *out = dflt;
        return 0;
    }
    if (!json_is_boolean(j)) {
        if (!path) return ds41_fail(err, "%s: field '%s': must be true or false", label, key);
        return ds41_fail(err, "%s: %s.%s: must be true or false", label, path, key);
    }
    *out = json_is_true(j);
    return 0;
}

/* ---- components ---------------------------------------------------------- */

static bool normalizer_identity(const json_t *n, int depth) {
    if (absent(n)) return true;
    const char *t = type_of(n);
    if (!t || strcmp(t, "Sequence") != 0 || depth > 8) return false;
    json_t *list = json_object_get(n, "normalizers");
    if (!json_is_array(list)) return false;
    size_t i;
    json_t *e;
    json_array_foreach(list, i, e) {
        if (!normalizer_identity(e, depth + 1)) return false;
    }
    return true;
}

static int add_split(ds41_vocab *v, const char *pattern, size_t pattern_len, bool is_regex,
                     const char *behavior, bool invert) {
    ds41_vocab_split *ns = realloc(v->splits, (v->n_splits + 1) * sizeof *ns);
    if (!ns) return -1;
    v->splits = ns;
    ds41_vocab_split *s = &ns[v->n_splits];
    memset(s, 0, sizeof *s);
    char *p = malloc(pattern_len + 1);
    char *b = strdup(behavior);
    if (!p || !b) {
        free(p);
        free(b);
        return -1;
    }
    memcpy(p, pattern, pattern_len);
    p[pattern_len] = 0;
    s->pattern = p;
    s->pattern_len = pattern_len;
    s->is_regex = is_regex;
    s->behavior = b;
    s->invert = invert;
    v->n_splits++;
    return 0;
}

static int parse_pre_tokenizer(ds41_vocab *v, const json_t *p, const char *path, int depth, const char *label,
                               ds41_error *err) {
    if (absent(p)) return 0;
    if (depth > 8) return ds41_fail(err, "%s: %s: nested too deeply", label, path);
    if (!json_is_object(p)) return ds41_fail(err, "%s: %s: must be an object or null", label, path);
    const char *type = type_of(p);
    if (!type) return ds41_fail(err, "%s: %s.type: missing or not a string", label, path);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list))
            return ds41_fail(err, "%s: %s.pretokenizers: must be an array", label, path);
        size_t i;
        json_t *e;
        json_array_foreach(list, i, e) {
            char sub[256];
            snprintf(sub, sizeof sub, "%s.pretokenizers[%zu]", path, i);
            if (parse_pre_tokenizer(v, e, sub, depth + 1, label, err)) return -1;
        }
        return 0;
    }
    if (strcmp(type, "Split") == 0) {
        json_t *pat = json_object_get(p, "pattern");
        json_t *rx = json_is_object(pat) ? json_object_get(pat, "Regex") : NULL;
        json_t *lit = json_is_object(pat) ? json_object_get(pat, "String") : NULL;
        if (!json_is_object(pat) || json_object_size(pat) != 1 ||
            !(json_is_string(rx) || json_is_string(lit)))
            return ds41_fail(err, "%s: %s.pattern: must be {\"Regex\": string} or {\"String\": string}",
                             label, path);
        json_t *s = rx ? rx : lit;
        json_t *beh = json_object_get(p, "behavior");
        if (!json_is_string(beh)) return ds41_fail(err, "%s: %s.behavior: must be a string", label, path);
        bool invert = false;
        if (optional_bool(p, "invert", false, &invert, label, path, err)) return -1;
        if (add_split(v, json_string_value(s), json_string_length(s), rx != NULL, json_string_value(beh),
                      invert))
            return ds41_fail(err, "%s: %s: out of memory", label, path);
        return 0;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        bool aps = true, ur = true;
        if (optional_bool(p, "add_prefix_space", true, &aps, label, path, err)) return -1;
        if (optional_bool(p, "use_regex", true, &ur, label, path, err)) return -1;
        if (!v->has_byte_level) {
            v->has_byte_level = true;
            v->bl_add_prefix_space = aps;
            v->bl_use_regex = ur;
        }
        return 0;
    }
    return 0; /* other pre-tokenizers are kept as JSON for the encoder to judge */
}

static int check_decoder(const json_t *d, const char *label, ds41_error *err) {
    if (absent(d))
        return ds41_fail(err, "%s: decoder: missing; a byte-level BPE needs the ByteLevel decoder", label);
    const char *type = type_of(d);
    if (!type) return ds41_fail(err, "%s: decoder.type: missing or not a string", label);
    if (strcmp(type, "ByteLevel") == 0) return 0;
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(d, "decoders");
        if (!json_is_array(list)) return ds41_fail(err, "%s: decoder.decoders: must be an array", label);
        if (json_array_size(list) == 1) {
            const char *t0 = type_of(json_array_get(list, 0));
            if (t0 && strcmp(t0, "ByteLevel") == 0) return 0;
        }
        return ds41_fail(err,
                         "%s: decoder: a Sequence must consist of exactly one ByteLevel step "
                         "(any other step changes what an id decodes to)",
                         label);
    }
    return ds41_fail(err, "%s: decoder: type '%s' is not supported; ByteLevel is required", label, type);
}

static int keep_component(ds41_vocab *v, ds41_vocab_component c, const json_t *j, const char *label,
                          ds41_error *err) {
    v->component[c] = absent(j) ? strdup("null") : ds41_json_dump(j, NULL);
    if (!v->component[c]) return ds41_fail(err, "%s: out of memory", label);
    return 0;
}

/* ---- model --------------------------------------------------------------- */

static int check_model_options(const json_t *model, const char *label, ds41_error *err) {
    json_t *type = json_object_get(model, "type");
    if (!json_is_string(type))
        return ds41_fail(err, "%s: model.type: missing or not a string; only \"BPE\" is supported", label);
    if (strcmp(json_string_value(type), "BPE") != 0) {
        char b[96];
        return ds41_fail(err, "%s: model.type: %s is not supported; only \"BPE\" is", label,
                         show(json_string_value(type), json_string_length(type), b));
    }
    json_t *dropout = json_object_get(model, "dropout");
    if (!absent(dropout))
        return ds41_fail(err, "%s: model.dropout: must be null (BPE dropout is not supported)", label);
    static const char *const no_affix[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        json_t *a = json_object_get(model, no_affix[i]);
        if (!absent(a) && !(json_is_string(a) && json_string_length(a) == 0))
            return ds41_fail(err, "%s: model.%s: must be null for a byte-level BPE", label, no_affix[i]);
    }
    json_t *bf = json_object_get(model, "byte_fallback");
    if (!absent(bf) && !json_is_boolean(bf))
        return ds41_fail(err, "%s: model.byte_fallback: must be true or false", label);
    if (json_is_true(bf))
        return ds41_fail(
            err, "%s: model.byte_fallback: true is not supported (byte-level BPE covers every byte)", label);
    json_t *fu = json_object_get(model, "fuse_unk");
    if (!absent(fu) && !json_is_boolean(fu))
        return ds41_fail(err, "%s: model.fuse_unk: must be true or false", label);
    json_t *unk = json_object_get(model, "unk_token");
    if (!absent(unk) && !json_is_string(unk))
        return ds41_fail(err, "%s: model.unk_token: must be a string or null", label);
    return 0;
}

/* Fill model strings, ids and the per-id table from model.vocab. */
static int load_model_vocab(ds41_vocab *v, const json_t *vocab, const char *label, ds41_error *err) {
    const char *key;
    json_t *val;
    uint32_t k = 0;
    json_object_foreach((json_t *)vocab, key, val) {
        size_t klen = strlen(key);
        uint32_t id = 0;
        span sp;
        if (arena_put(v, key, klen, &sp)) return ds41_fail(err, "%s: model.vocab: too large", label);
        v->model_str[k] = sp;
        v->model_id[k] = (uint32_t)json_integer_value(val); /* range checked by the caller */
        id = v->model_id[k];
        if (v->id_str[id].off != NO_STRING) {
            char a[96], b[96];
            const span *o = &v->id_str[id];
            return ds41_fail(err, "%s: model.vocab: %s and %s both have id %u", label,
                             show(v->arena + o->off, o->len, a), show(key, klen, b), id);
        }
        v->id_str[id] = sp;
        uint32_t slot;
        if (strmap_find(&v->model_map, v->arena, v->model_str, key, klen, &slot) >= 0) {
            char a[96]; /* jansson rejects duplicate keys, so this is defensive */
            return ds41_fail(err, "%s: model.vocab: %s appears twice", label, show(key, klen, a));
        }
        v->model_map.slots[slot] = k + 1;
        k++;
    }
    return 0;
}

static int64_t model_lookup(const ds41_vocab *v, const char *s, size_t n) {
    int64_t e = strmap_find(&v->model_map, v->arena, v->model_str, s, n, NULL);
    return e < 0 ? -1 : (int64_t)v->model_id[e];
}

/* ---- added tokens -------------------------------------------------------- */

static const char *const added_flags[5] = {"single_word", "lstrip", "rstrip", "normalized", "special"};

static int check_added_entry(const json_t *t, size_t i, uint32_t *id, const char *label, ds41_error *err) {
    if (!json_is_object(t)) return ds41_fail(err, "%s: added_tokens[%zu]: must be an object", label, i);
    const char *why;
    if (!json_id(json_object_get(t, "id"), id, &why))
        return ds41_fail(err, "%s: added_tokens[%zu].id: %s", label, i,
                         json_object_get(t, "id") ? why : "missing");
    json_t *c = json_object_get(t, "content");
    if (!json_is_string(c))
        return ds41_fail(err, "%s: added_tokens[%zu].content: must be a string", label, i);
    if (json_string_length(c) == 0)
        return ds41_fail(err, "%s: added_tokens[%zu].content: is empty", label, i);
    for (size_t f = 0; f < 5; f++)
        if (!json_is_boolean(json_object_get(t, added_flags[f])))
            return ds41_fail(err, "%s: added_tokens[%zu].%s: must be true or false", label, i,
                             added_flags[f]);
    return 0;
}

static int cmp_added_by_id(const void *a, const void *b, void *ctx) {
    const ds41_added_token *added = ctx;
    uint32_t x = added[*(const uint32_t *)a].id, y = added[*(const uint32_t *)b].id;
    return (x > y) - (x < y);
}

static int load_added(ds41_vocab *v, const json_t *list, const char *label, ds41_error *err) {
    size_t i;
    json_t *t;
    /* Hugging Face's id assignment (AddedVocabulary::add_tokens): the model's
     * id when the content is in model.vocab, else the next id after
     * max(len(model.vocab), largest added id so far). */
    int64_t added_max = -1;
    json_array_foreach((json_t *)list, i, t) {
        json_t *c = json_object_get(t, "content");
        const char *content = json_string_value(c);
        size_t clen = json_string_length(c);
        ds41_added_token *a = &v->added[i];
        a->id = (uint32_t)json_integer_value(json_object_get(t, "id"));
        bool flags[5];
        for (size_t f = 0; f < 5; f++) flags[f] = json_is_true(json_object_get(t, added_flags[f]));
        a->single_word = flags[0];
        a->lstrip = flags[1];
        a->rstrip = flags[2];
        a->normalized = flags[3];
        a->special = flags[4];

        uint32_t slot;
        int64_t dup = strmap_find(&v->added_map, v->arena, v->added_str, content, clen, &slot);
        if (dup >= 0) {
            char b[96];
            return ds41_fail(err, "%s: added_tokens[%zu].content: %s is also added_tokens[%lld]", label, i,
                             show(content, clen, b), (long long)dup);
        }
        int64_t hf_id = model_lookup(v, content, clen);
        if (hf_id < 0) {
            int64_t model_len = v->model_count;
            hf_id = added_max < 0                                ? model_len
                    : (added_max >= model_len || model_len == 0) ? added_max + 1
                                                                 : model_len;
        }
        if (hf_id != (int64_t)a->id) {
            char b[96];
            return ds41_fail(err,
                             "%s: added_tokens[%zu].id: %s has id %u, but Hugging Face tokenizers "
                             "assigns it %lld (the model.vocab id of the same string, else the next "
                             "id after max(len(model.vocab), previous added ids))",
                             label, i, show(content, clen, b), a->id, (long long)hf_id);
        }
        if (hf_id > added_max) added_max = hf_id;

        if (arena_put(v, content, clen, &v->added_str[i]))
            return ds41_fail(err, "%s: added_tokens: too large", label);
        a->content = v->arena + v->added_str[i].off;
        a->content_len = clen;
        v->added_map.slots[slot] = (uint32_t)i + 1;
        v->n_added = i + 1;
    }
    /* Index by id; two added tokens on one id would be ambiguous. */
    for (size_t k = 0; k < v->n_added; k++) v->added_by_id[k] = (uint32_t)k;
    qsort_r(v->added_by_id, v->n_added, sizeof *v->added_by_id, cmp_added_by_id, v->added);
    for (size_t k = 1; k < v->n_added; k++) {
        const ds41_added_token *x = &v->added[v->added_by_id[k - 1]], *y = &v->added[v->added_by_id[k]];
        if (x->id == y->id)
            return ds41_fail(err, "%s: added_tokens[%u].id: id %u is also used by added_tokens[%u]", label,
                             v->added_by_id[k], y->id, v->added_by_id[k - 1]);
    }
    for (size_t k = 0; k < v->n_added; k++) v->id_str[v->added[k].id] = v->added_str[k];
    return 0;
}

/* ---- merges -------------------------------------------------------------- */

/* Open-addressing set of (left, right) pairs, to reject a pair listed twice. */
typedef struct pairset {
    uint64_t *keys; /* (left << 32 | right) + 1; 0 = empty */
    size_t mask;
} pairset;

static bool pairset_insert(pairset *s, uint32_t l, uint32_t r) {
    uint64_t key = (((uint64_t)l << 32) | r) + 1;
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 20) & s->mask;
    while (s->keys[i]) {
        if (s->keys[i] == key) return false;
        i = (i + 1) & s->mask;
    }
    s->keys[i] = key;
    return true;
}

static int load_merges(ds41_vocab *v, const json_t *merges, const char *label, ds41_error *err) {
    size_t n = json_array_size(merges);
    if (n == 0) return 0;
    v->merges = malloc(n * sizeof *v->merges);
    pairset seen = {0};
    size_t cap = 16;
    while (cap < 2 * n + 1) cap <<= 1;
    seen.keys = calloc(cap, sizeof *seen.keys);
    seen.mask = cap - 1;
    char *joined = malloc(2 * v->max_token_bytes + 1);
    int rc = -1;
    if (!v->merges || !seen.keys || !joined) {
        ds41_fail(err, "%s: model.merges: out of memory", label);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(merges, i);
        const char *half[2];
        size_t hlen[2];
        if (json_is_string(m)) {
            const char *s = json_string_value(m);
            size_t len = json_string_length(m);
            const char *sp = memchr(s, ' ', len);
            if (!sp || memchr(sp + 1, ' ', len - (size_t)(sp - s) - 1)) {
                char b[96];
                ds41_fail(err, "%s: model.merges[%zu]: %s must be two tokens separated by one space", label,
                          i, show(s, len, b));
                goto out;
            }
            half[0] = s;
            hlen[0] = (size_t)(sp - s);
            half[1] = sp + 1;
            hlen[1] = len - hlen[0] - 1;
        } else if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
                   json_is_string(json_array_get(m, 1))) {
            for (int h = 0; h < 2; h++) {
                half[h] = json_string_value(json_array_get(m, h));
                hlen[h] = json_string_length(json_array_get(m, h));
            }
        } else {
            ds41_fail(err, "%s: model.merges[%zu]: must be a string \"a b\" or a pair [\"a\", \"b\"]", label,
                      i);
            goto out;
        }
        int64_t id[2];
        for (int h = 0; h < 2; h++) {
            id[h] = model_lookup(v, half[h], hlen[h]);
            if (id[h] < 0) {
                char b[96];
                ds41_fail(err, "%s: model.merges[%zu]: %s is not in model.vocab", label, i,
                          show(half[h], hlen[h], b));
                goto out;
            }
        }
        /* Both halves are vocab strings, so the join fits 2 * max_token_bytes. */
        memcpy(joined, half[0], hlen[0]);
        memcpy(joined + hlen[0], half[1], hlen[1]);
        int64_t merged = model_lookup(v, joined, hlen[0] + hlen[1]);
        if (merged < 0) {
            char b[96];
            ds41_fail(err, "%s: model.merges[%zu]: the merged string %s is not in model.vocab", label, i,
                      show(joined, hlen[0] + hlen[1], b));
            goto out;
        }
        if (!pairset_insert(&seen, (uint32_t)id[0], (uint32_t)id[1])) {
            char a[96], b[96];
            ds41_fail(err, "%s: model.merges[%zu]: the pair %s %s is listed twice", label, i,
                      show(half[0], hlen[0], a), show(half[1], hlen[1], b));
            goto out;
        }
        v->merges[i] = (ds41_merge){(uint32_t)id[0], (uint32_t)id[1], (uint32_t)merged};
        v->n_merges = i + 1;
    }
    rc = 0;
out:
    free(seen.keys);
    free(joined);
    return rc;
}

/* ---- parse --------------------------------------------------------------- */

static int parse_root(ds41_vocab *v, json_t *root, const char *label, ds41_error *err) {
    if (!json_is_object(root)) return ds41_fail(err, "%s: the top level must be a JSON object", label);
    json_t *version = json_object_get(root, "version");
    if (version && !(json_is_string(version) && strcmp(json_string_value(version), "1.0") == 0))
        return ds41_fail(err, "%s: version: only \"1.0\" is supported", label);

    json_t *model = json_object_get(root, "model");
    if (!json_is_object(model)) return ds41_fail(err, "%s: model: missing or not an object", label);
    if (check_model_options(model, label, err)) return -1;
    json_t *vocab = json_object_get(model, "vocab");
    if (!json_is_object(vocab)) return ds41_fail(err, "%s: model.vocab: missing or not an object", label);
    if (json_object_size(vocab) == 0) return ds41_fail(err, "%s: model.vocab: is empty", label);
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_array(merges)) return ds41_fail(err, "%s: model.merges: missing or not an array", label);
    json_t *im = json_object_get(model, "ignore_merges");
    if (!absent(im) && !json_is_boolean(im))
        return ds41_fail(err, "%s: model.ignore_merges: must be true or false", label);
    v->ignore_merges = json_is_true(im);

    json_t *added = json_object_get(root, "added_tokens");
    if (!absent(added) && !json_is_array(added))
        return ds41_fail(err, "%s: added_tokens: must be an array", label);

    /* Pass 1: check ids and sizes, so the tables can be allocated once. */
    uint64_t max_id = 0, strings = 0;
    size_t max_len = 0;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        uint32_t id = 0;
        const char *why;
        size_t klen = strlen(key);
        if (!json_id(val, &id, &why)) {
            char b[96];
            return ds41_fail(err, "%s: model.vocab[%s]: the id %s", label, show(key, klen, b), why);
        }
        if (id > max_id) max_id = id;
        strings += klen + 1;
        if (klen > max_len) max_len = klen;
    }
    size_t n_added = absent(added) ? 0 : json_array_size(added);
    for (size_t i = 0; i < n_added; i++) {
        uint32_t id = 0;
        json_t *t = json_array_get(added, i);
        if (check_added_entry(t, i, &id, label, err)) return -1;
        if (id > max_id) max_id = id;
        size_t clen = json_string_length(json_object_get(t, "content"));
        strings += clen + 1;
        if (clen > max_len) max_len = clen;
    }
    /* The string arena is addressed by 32-bit offsets. */
    if (strings >= UINT32_MAX) return ds41_fail(err, "%s: token strings too large", label);

    v->size = (uint32_t)max_id + 1;
    v->model_count = (uint32_t)json_object_size(vocab);
    v->max_token_bytes = max_len;
    v->arena_cap = (size_t)strings;
    v->arena = malloc(v->arena_cap ? v->arena_cap : 1);
    v->id_str = malloc(v->size * sizeof *v->id_str);
    v->model_str = malloc(v->model_count * sizeof *v->model_str);
    v->model_id = malloc(v->model_count * sizeof *v->model_id);
    v->added = calloc(n_added ? n_added : 1, sizeof *v->added);
    v->added_str = calloc(n_added ? n_added : 1, sizeof *v->added_str);
    v->added_by_id = calloc(n_added ? n_added : 1, sizeof *v->added_by_id);
    if (!v->arena || !v->id_str || !v->model_str || !v->model_id || !v->added || !v->added_str ||
        !v->added_by_id || strmap_init(&v->model_map, v->model_count) || strmap_init(&v->added_map, n_added))
        return ds41_fail(err, "%s: out of memory", label);
    for (uint32_t i = 0; i < v->size; i++) v->id_str[i] = (span){NO_STRING, 0};

    if (load_model_vocab(v, vocab, label, err)) return -1;
    if (n_added && load_added(v, added, label, err)) return -1;
    if (load_merges(v, merges, label, err)) return -1;

    json_t *unk = json_object_get(model, "unk_token");
    if (json_is_string(unk) && model_lookup(v, json_string_value(unk), json_string_length(unk)) < 0) {
        char b[96];
        return ds41_fail(err, "%s: model.unk_token: %s is not in model.vocab", label,
                         show(json_string_value(unk), json_string_length(unk), b));
    }

    json_t *normalizer = json_object_get(root, "normalizer");
    if (!absent(normalizer) && !json_is_object(normalizer))
        return ds41_fail(err, "%s: normalizer: must be an object or null", label);
    v->normalizer_identity = normalizer_identity(normalizer, 0);
    json_t *pre = json_object_get(root, "pre_tokenizer");
    if (parse_pre_tokenizer(v, pre, "pre_tokenizer", 0, label, err)) return -1;
    json_t *post = json_object_get(root, "post_processor");
    if (!absent(post) && !json_is_object(post))
        return ds41_fail(err, "%s: post_processor: must be an object or null", label);
    json_t *decoder = json_object_get(root, "decoder");
    if (check_decoder(decoder, label, err)) return -1;
    if (keep_component(v, DS41_VOCAB_NORMALIZER, normalizer, label, err) ||
        keep_component(v, DS41_VOCAB_PRE_TOKENIZER, pre, label, err) ||
        keep_component(v, DS41_VOCAB_POST_PROCESSOR, post, label, err) ||
        keep_component(v, DS41_VOCAB_DECODER, decoder, label, err))
        return -1;

    uint32_t n = 0;
    for (uint32_t i = 0; i < v->size; i++) n += v->id_str[i].off != NO_STRING;
    v->n_tokens = n;
    return 0;
}

ds41_vocab *ds41_vocab_parse(const char *json, size_t len, const char *label, ds41_error *err) {
    label = lbl(label);
    if (!json && len) {
        ds41_fail(err, "%s: no data", label);
        return NULL;
    }
    if (len > DS41_VOCAB_MAX_FILE_BYTES) {
        ds41_fail(err, "%s: %zu bytes is more than a tokenizer.json may have (%zu)", label, len,
                  DS41_VOCAB_MAX_FILE_BYTES);
        return NULL;
    }
    json_error_t jerr;
    json_t *root = json_loadb(json ? json : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        ds41_fail(err, "%s: invalid JSON at line %d, column %d: %s", label, jerr.line, jerr.column,
                  jerr.text);
        return NULL;
    }
    ds41_vocab *v = calloc(1, sizeof *v);
    if (!v || !(v->label = strdup(label))) {
        free(v);
        json_decref(root);
        ds41_fail(err, "%s: out of memory", label);
        return NULL;
    }
    v->bos = v->eos = v->pad = -1;
    int rc = parse_root(v, root, label, err);
    json_decref(root);
    if (rc) {
        ds41_vocab_free(v);
        return NULL;
    }
    return v;
}

/* Read a whole regular file of at most MAX bytes.  Returns malloc'd data. */
static char *read_file(const char *path, size_t max, size_t *len, ds41_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        ds41_fail(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        ds41_fail(err, "%s: not a regular file", path);
        return NULL;
    }
    if ((uint64_t)st.st_size > max) {
        fclose(f);
        ds41_fail(err, "%s: %lld bytes is more than allowed (%zu)", path, (long long)st.st_size, max);
        return NULL;
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n ? n : 1);
    if (!buf) {
        fclose(f);
        ds41_fail(err, "%s: out of memory", path);
        return NULL;
    }
    size_t got = fread(buf, 1, n, f);
    int bad = ferror(f) || got != n;
    fclose(f);
    if (bad) {
        free(buf);
        ds41_fail(err, "%s: read error", path);
        return NULL;
    }
    *len = n;
    return buf;
}

ds41_vocab *ds41_vocab_load(const char *path, ds41_error *err) {
    size_t len;
    char *data = read_file(path, DS41_VOCAB_MAX_FILE_BYTES, &len, err);
    if (!data) return NULL;
    ds41_vocab *v = ds41_vocab_parse(data, len, path, err);
    free(data);
    return v;
}

static char *join_path(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t o = a;
    if (a && dir[a - 1] != '/') p[o++] = '/';
    memcpy(p + o, name, b + 1);
    return p;
}

ds41_vocab *ds41_vocab_load_dir(const char *dir, ds41_error *err) {
    char *tj = join_path(dir, "tokenizer.json");
    char *tc = join_path(dir, "tokenizer_config.json");
    ds41_vocab *v = NULL;
    if (!tj || !tc) {
        ds41_fail(err, "%s: out of memory", dir);
        goto out;
    }
    v = ds41_vocab_load(tj, err);
    if (!v) goto out;
    struct stat st;
    if (stat(tc, &st) == 0 && ds41_vocab_load_config(v, tc, err)) {
        ds41_vocab_free(v);
        v = NULL;
    }
out:
    free(tj);
    free(tc);
    return v;
}

void ds41_vocab_free(ds41_vocab *v) {
    if (!v) return;
    free(v->label);
    free(v->arena);
    free(v->id_str);
    free(v->model_str);
    free(v->model_id);
    free(v->model_map.slots);
    free(v->added);
    free(v->added_by_id);
    free(v->added_str);
    free(v->added_map.slots);
    free(v->merges);
    for (int i = 0; i < 4; i++) free(v->component[i]);
    for (size_t i = 0; i < v->n_splits; i++) {
        free((char *)v->splits[i].pattern);
        free((char *)v->splits[i].behavior);
    }
    free(v->splits);
    free(v);
}

/* ---- tokenizer_config.json ------------------------------------------------ */

/* bos_token etc.: absent/null -> -1; a string or {"content": string} -> its id. */
static int config_token(const ds41_vocab *v, const json_t *root, const char *key, int32_t *id,
                        const char *label, ds41_error *err) {
    json_t *t = json_object_get(root, key);
    if (absent(t)) {
        *id = -1;
        return 0;
    }
    json_t *s = json_is_object(t) ? json_object_get(t, "content") : t;
    if (!json_is_string(s))
        return ds41_fail(err,
                         "%s: field '%s': must be a string, an object with a string \"content\", or null",
                         label, key);
    int32_t found = ds41_vocab_find(v, json_string_value(s), json_string_length(s));
    if (found < 0) {
        char b[96];
        return ds41_fail(err, "%s: field '%s': %s is not a token of the vocabulary", label, key,
                         show(json_string_value(s), json_string_length(s), b));
    }
    *id = found;
    return 0;
}

int ds41_vocab_parse_config(ds41_vocab *v, const char *json, size_t len, const char *label, ds41_error *err) {
    label = label ? label : "tokenizer_config.json";
    if (!json && len) return ds41_fail(err, "%s: no data", label);
    json_error_t jerr;
    /* Integers as reals: configs write model_max_length values beyond int64. */
    json_t *root = json_loadb(json ? json : "", len, JSON_REJECT_DUPLICATES | JSON_DECODE_INT_AS_REAL, &jerr);
    if (!root)
        return ds41_fail(err, "%s: invalid JSON at line %d, column %d: %s", label, jerr.line, jerr.column,
                         jerr.text);
    int rc = -1;
    int32_t bos = -1, eos = -1, pad = -1;
    bool add_bos = false, add_eos = false;
    uint64_t mml = 0;
    if (!json_is_object(root)) {
        ds41_fail(err, "%s: the top level must be a JSON object", label);
        goto out;
    }
    if (config_token(v, root, "bos_token", &bos, label, err) ||
        config_token(v, root, "eos_token", &eos, label, err) ||
        config_token(v, root, "pad_token", &pad, label, err))
        goto out;
    if (optional_bool(root, "add_bos_token", false, &add_bos, label, NULL, err) ||
        optional_bool(root, "add_eos_token", false, &add_eos, label, NULL, err))
        goto out;
    json_t *m = json_object_get(root, "model_max_length");
    if (!absent(m)) {
        if (!json_is_number(m)) {
            ds41_fail(err, "%s: field 'model_max_length': must be a number", label);
            goto out;
        }
        double d = json_number_value(m);
        if (!(d >= 0)) {
            ds41_fail(err, "%s: field 'model_max_length': must not be negative", label);
            goto out;
        }
        mml = d >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)d;
    }
    v->bos = bos;
    v->eos = eos;
    v->pad = pad;
    v->add_bos = add_bos;
    v->add_eos = add_eos;
    v->model_max_length = mml;
    rc = 0;
out:
    json_decref(root);
    return rc;
}

int ds41_vocab_load_config(ds41_vocab *v, const char *path, ds41_error *err) {
    size_t len;
    char *data = read_file(path, 64u << 20, &len, err);
    if (!data) return -1;
    int rc = ds41_vocab_parse_config(v, data, len, path, err);
    free(data);
    return rc;
}

int32_t ds41_vocab_bos_id(const ds41_vocab *v) {
    return v->bos;
}
int32_t ds41_vocab_eos_id(const ds41_vocab *v) {
    return v->eos;
}
int32_t ds41_vocab_pad_id(const ds41_vocab *v) {
    return v->pad;
}
bool ds41_vocab_add_bos(const ds41_vocab *v) {
    return v->add_bos;
}
bool ds41_vocab_add_eos(const ds41_vocab *v) {
    return v->add_eos;
}
uint64_t ds41_vocab_model_max_length(const ds41_vocab *v) {
    return v->model_max_length;
}

/* ---- accessors ----------------------------------------------------------- */

uint32_t ds41_vocab_size(const ds41_vocab *v) {
    return v->size;
}
uint32_t ds41_vocab_n_tokens(const ds41_vocab *v) {
    return v->n_tokens;
}
uint32_t ds41_vocab_model_entries(const ds41_vocab *v) {
    return v->model_count;
}
size_t ds41_vocab_max_token_bytes(const ds41_vocab *v) {
    return v->max_token_bytes;
}

const char *ds41_vocab_token_string(const ds41_vocab *v, uint32_t id, size_t *len) {
    if (id >= v->size || v->id_str[id].off == NO_STRING) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = v->id_str[id].len;
    return v->arena + v->id_str[id].off;
}

int32_t ds41_vocab_find(const ds41_vocab *v, const char *s, size_t len) {
    if (!s && len) return -1;
    if (!s) s = "";
    int64_t a = strmap_find(&v->added_map, v->arena, v->added_str, s, len, NULL);
    if (a >= 0) return (int32_t)v->added[a].id;
    return (int32_t)model_lookup(v, s, len);
}

int32_t ds41_vocab_find_model(const ds41_vocab *v, const char *s, size_t len) {
    if (!s && len) return -1;
    return (int32_t)model_lookup(v, s ? s : "", len);
}

const ds41_added_token *ds41_vocab_added_token(const ds41_vocab *v, uint32_t id) {
    size_t lo = 0, hi = v->n_added;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint32_t mid_id = v->added[v->added_by_id[mid]].id;
        if (mid_id == id) return &v->added[v->added_by_id[mid]];
        if (mid_id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

size_t ds41_vocab_n_added(const ds41_vocab *v) {
    return v->n_added;
}

const ds41_added_token *ds41_vocab_added_at(const ds41_vocab *v, size_t i) {
    return i < v->n_added ? &v->added[i] : NULL;
}

size_t ds41_vocab_n_merges(const ds41_vocab *v) {
    return v->n_merges;
}
const ds41_merge *ds41_vocab_merges(const ds41_vocab *v) {
    return v->n_merges ? v->merges : NULL;
}

int ds41_vocab_merge(const ds41_vocab *v, size_t rank, uint32_t *left, uint32_t *right, uint32_t *merged) {
    if (rank >= v->n_merges) return -1;
    if (left) *left = v->merges[rank].left;
    if (right) *right = v->merges[rank].right;
    if (merged) *merged = v->merges[rank].merged;
    return 0;
}

bool ds41_vocab_ignore_merges(const ds41_vocab *v) {
    return v->ignore_merges;
}

const char *ds41_vocab_component_json(const ds41_vocab *v, ds41_vocab_component c) {
    if ((unsigned)c > DS41_VOCAB_DECODER) return NULL;
    return v->component[c];
}

bool ds41_vocab_normalizer_is_identity(const ds41_vocab *v) {
    return v->normalizer_identity;
}
size_t ds41_vocab_n_splits(const ds41_vocab *v) {
    return v->n_splits;
}

const ds41_vocab_split *ds41_vocab_split_at(const ds41_vocab *v, size_t i) {
    return i < v->n_splits ? &v->splits[i] : NULL;
}

bool ds41_vocab_pretok_byte_level(const ds41_vocab *v, bool *add_prefix_space, bool *use_regex) {
    if (add_prefix_space) *add_prefix_space = v->bl_add_prefix_space;
    if (use_regex) *use_regex = v->bl_use_regex;
    return v->has_byte_level;
}

/* ---- decoding ------------------------------------------------------------ */

int ds41_vocab_decode_id(const ds41_vocab *v, uint32_t id, uint8_t *buf, size_t cap, size_t *len) {
    size_t n;
    const uint8_t *s = (const uint8_t *)ds41_vocab_token_string(v, id, &n);
    if (!s) {
        if (len) *len = 0;
        return -1;
    }
    /* Map every character back to its byte; stop at the first one outside
     * the alphabet, in which case the token's UTF-8 is the answer. */
    size_t i = 0, o = 0;
    bool all_mapped = true;
    while (i < n) {
        uint32_t cp;
        size_t k = ds41_utf8_decode(s + i, n - i, &cp);
        int byte = k ? ds41_byte_level_byte(cp) : -1;
        if (byte < 0) {
            all_mapped = false;
            break;
        }
        if (o < cap) buf[o] = (uint8_t)byte;
        o++;
        i += k;
    }
    if (!all_mapped) {
        o = n;
        if (n <= cap && n) memcpy(buf, s, n);
    }
    if (len) *len = o;
    return o <= cap ? 0 : -1;
}

char *ds41_vocab_decode_id_lossy(const ds41_vocab *v, uint32_t id, size_t *len) {
    size_t n;
    if (!ds41_vocab_token_string(v, id, &n)) {
        if (len) *len = 0;
        return NULL;
    }
    uint8_t small[512];
    uint8_t *bytes = n <= sizeof small ? small : malloc(n);
    if (!bytes) return NULL;
    size_t got = 0;
    char *text = NULL;
    if (ds41_vocab_decode_id(v, id, bytes, n, &got) == 0) text = ds41_utf8_lossy(bytes, got, len);
    if (bytes != small) free(bytes);
    return text;
}
