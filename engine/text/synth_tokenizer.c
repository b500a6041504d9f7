#include "engine/text/synth_tokenizer.h"

#include "config/buf.h"

#include "engine/text/pyjson.h"
#include "engine/text/vocab.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ======================================================================
 * The real file's added tokens 128000..129279 and the layouts
 * ====================================================================== */

#define REAL_TOP_FIRST 128000u
#define REAL_TOP_COUNT 1280u
#define REAL_VOCAB_SIZE (REAL_TOP_FIRST + REAL_TOP_COUNT) /* 129,280 */
#define NAMED_LAYOUT_MIN 512u
#define N_BYTE_TOKENS 256u
#define FIRST_MERGED_ID (3u + N_BYTE_TOKENS) /* 259 */

static const char *const named_128799[48] = {
    "<｜System｜>",
    "<｜fim▁hole｜>",
    "<｜fim▁begin｜>",
    "<｜fim▁end｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<|EOT|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
    "<｜begin▁of▁repo▁name｜>",
    "<｜end▁of▁repo▁name｜>",
    "<｜begin▁of▁file▁name｜>",
    "<｜end▁of▁file▁name｜>",
    "<｜begin▁of▁file｜>",
    "<｜end▁of▁file｜>",
    "<think>",
    "</think>",
    "<｜place▁holder▁for▁copy｜>",
    "<｜place▁holder▁for▁pointer▁replace｜>",
    "｜DSML｜",
    "<｜begin▁sys｜>",
    "<｜end▁sys｜>",
    "<｜latest_reminder｜>",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜task｜>",
    "<｜political｜>",
    "<｜entity｜>",
    "<｜title｜>",
    "<｜safety｜>",
    "<｜answer｜>",
    "<｜search｜>",
    "<dsml:",
    "</dsml:",
    "<｜search▁begin｜>",
    "<｜search▁end｜>",
    "<｜extracted_url｜>",
    "<｜read_url｜>",
    "<｜end_of_query｜>",
};

static const char *const tags_129271[8] = {
    "<｜/polygon｜>", "<｜polygon｜>", "<｜/point｜>", "<｜point｜>",
    "<｜/box｜>",     "<｜box｜>",     "<｜/ref｜>",   "<｜ref｜>",
};

typedef struct top_token {
    char content[64];
    bool normalized, special;
} top_token;

/* The real file's added token REAL_ID (128000..129279). */
static void real_top_token(uint32_t real_id, top_token *t) {
    t->normalized = false;
    t->special = true;
    if (real_id < 128799) {
        snprintf(t->content, sizeof t->content, "<｜place▁holder▁no▁%u｜>", real_id - REAL_TOP_FIRST);
    } else if (real_id <= 128846) {
        snprintf(t->content, sizeof t->content, "%s", named_128799[real_id - 128799]);
        t->normalized = real_id != 128846; /* <｜end_of_query｜> is the special one */
        t->special = real_id == 128846;
    } else if (real_id <= 129261) {
        snprintf(t->content, sizeof t->content, "<|place_holder_mm_span_%04u|>", real_id - 128847 + 21);
    } else if (real_id == 129262) {
        snprintf(t->content, sizeof t->content, "<｜rl_image_pad｜>");
    } else if (real_id == 129263) {
        snprintf(t->content, sizeof t->content, "<｜rl_image_start｜>");
    } else if (real_id == 129264) {
        snprintf(t->content, sizeof t->content, "%s", DS41_SYNTH_DEEPSEEK_IMAGE);
        t->special = false;
    } else if (real_id <= 129270) {
        snprintf(t->content, sizeof t->content, "<|place_holder_mm_span_%04u|>", real_id - 129265 + 436);
        t->special = false;
    } else if (real_id <= 129278) {
        snprintf(t->content, sizeof t->content, "%s", tags_129271[real_id - 129271]);
    } else {
        snprintf(t->content, sizeof t->content, "<|place_holder_mm_span_0442|>");
    }
}

static const uint32_t core_layout[17] = {
    128799, 128801, 128803, 128804, 128805, 128806, 128821, 128822, 128825,
    128828, 128829, 128830, 128831, 128832, 128836, 128845, 129264,
};

/* The real ids of the top block for VOCAB_SIZE, in order; returns K. */
static uint32_t top_layout(uint32_t vocab_size, uint32_t ids[REAL_TOP_COUNT]) {
    uint32_t k = 0;
    if (vocab_size >= REAL_VOCAB_SIZE) {
        for (uint32_t i = 0; i < REAL_TOP_COUNT; i++) ids[k++] = REAL_TOP_FIRST + i;
    } else if (vocab_size >= NAMED_LAYOUT_MIN) {
        for (uint32_t id = 128799; id <= 128846; id++) ids[k++] = id;
        for (uint32_t id = 129262; id <= 129264; id++) ids[k++] = id;
        for (uint32_t id = 129271; id <= 129278; id++) ids[k++] = id;
    } else {
        for (uint32_t i = 0; i < 17; i++) ids[k++] = core_layout[i];
    }
    return k;
}

static const char *const sentence_tokens[3] = {DS41_SYNTH_BOS, DS41_SYNTH_EOS, DS41_SYNTH_PAD};

int32_t ds41_synth_tokenizer_special_id(uint32_t vocab_size, const char *content) {
    if (vocab_size < DS41_SYNTH_VOCAB_MIN || vocab_size > DS41_SYNTH_VOCAB_MAX || !content) return -1;
    for (int i = 0; i < 3; i++)
        if (strcmp(content, sentence_tokens[i]) == 0) return i;
    uint32_t ids[REAL_TOP_COUNT];
    uint32_t k = top_layout(vocab_size, ids);
    for (uint32_t i = 0; i < k; i++) {
        top_token t;
        real_top_token(ids[i], &t);
        if (strcmp(t.content, content) == 0) return (int32_t)(vocab_size - k + i);
    }
    return -1;
}

/* ======================================================================
 * Small building blocks
 * ====================================================================== */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, n), n > 0 (the modulo bias is irrelevant here). */
static uint32_t rnd(uint64_t *s, uint32_t n) {
    return (uint32_t)(rng_next(s) % n);
}

/* Skewed towards 0: like a word frequency rank. */
static uint32_t rnd_skew(uint64_t *s, uint32_t n) {
    uint64_t a = rnd(s, n), b = rnd(s, n);
    return (uint32_t)(a * b / n);
}

static void buf_cp(ds41_buf *b, uint32_t cp) { /* one code point as UTF-8 */
    char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (char)(0xF0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    ds41_buf_put(b, u, n);
}

/* Strings with ids 0..n-1 and a hash index (token strings, word types). */
typedef struct strset {
    ds41_buf text;
    uint32_t *off, *len;
    uint32_t n, cap;
    uint32_t *slots; /* id + 1; 0 = empty */
    uint32_t mask;
    bool oom;
} strset;

static uint64_t hash_str(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 31);
}

static int64_t strset_find(const strset *t, const char *s, size_t n) {
    if (!t->slots) return -1;
    uint32_t i = (uint32_t)hash_str(s, n) & t->mask;
    for (;;) {
        uint32_t e = t->slots[i];
        if (!e) return -1;
        if (t->len[e - 1] == n && memcmp(t->text.data + t->off[e - 1], s, n) == 0) return e - 1;
        i = (i + 1) & t->mask;
    }
}

static void strset_rehash(strset *t, uint32_t cap) {
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots) {
        t->oom = true;
        return;
    }
    free(t->slots);
    t->slots = slots;
    t->mask = cap - 1;
    for (uint32_t id = 0; id < t->n; id++) {
        uint32_t i = (uint32_t)hash_str(t->text.data + t->off[id], t->len[id]) & t->mask;
        while (t->slots[i]) i = (i + 1) & t->mask;
        t->slots[i] = id + 1;
    }
}

/* Add a string that is not in the set yet; returns its id or -1. */
static int64_t strset_add(strset *t, const char *s, size_t n) {
    if (t->oom) return -1;
    if (t->n == t->cap) {
        uint32_t cap = t->cap ? 2 * t->cap : 1024;
        uint32_t *off = realloc(t->off, cap * sizeof *off);
        if (off) t->off = off;
        uint32_t *len = realloc(t->len, cap * sizeof *len);
        if (len) t->len = len;
        if (!off || !len) {
            t->oom = true;
            return -1;
        }
        t->cap = cap;
    }
    if (!t->slots || 2 * (t->n + 1) > t->mask + 1) {
        strset_rehash(t, t->slots ? 2 * (t->mask + 1) : 2048);
        if (t->oom) return -1;
    }
    uint32_t id = t->n;
    t->off[id] = (uint32_t)t->text.len;
    t->len[id] = (uint32_t)n;
    ds41_buf_put(&t->text, s, n);
    ds41_buf_put(&t->text, "", 1); /* keep a NUL between strings */
    if (t->text.oom) {
        t->oom = true;
        return -1;
    }
    t->n++;
    uint32_t i = (uint32_t)hash_str(s, n) & t->mask;
    while (t->slots[i]) i = (i + 1) & t->mask;
    t->slots[i] = id + 1;
    return id;
}

static void strset_free(strset *t) {
    free(t->text.data);
    free(t->off);
    free(t->len);
    free(t->slots);
}

/* ======================================================================
 * The corpus: word types (already pre-tokenized pieces) with counts
 * ====================================================================== */

static const char *const onsets[] = {"",   "t",  "th", "s",  "w",  "b",  "c",  "m",  "h",  "p",   "f",
                                     "d",  "l",  "r",  "n",  "g",  "st", "pr", "tr", "ch", "sh",  "wh",
                                     "k",  "v",  "y",  "j",  "bl", "gr", "cl", "fr", "sp", "str", "z",
                                     "qu", "br", "dr", "pl", "sc", "sl", "sm", "sn", "sw", "thr"};
static const char *const vowels[] = {"e",  "a", "o",  "i",  "u",  "ea", "ou", "io", "ai", "ee",
                                     "oo", "y", "ie", "au", "oi", "ue", "ei", "ay", "ow", "ey"};
static const char *const codas[] = {"",   "n",  "r",  "s",  "t",  "l",  "",   "d",  "m",  "nd", "st",
                                    "ng", "ck", "rt", "ld", "ss", "x",  "ll", "nt", "th", "sh", "ch",
                                    "ct", "mp", "ft", "lt", "rd", "rn", "rs", "ts", "ps", "wn"};
static const char *const suffixes[] = {"s",    "ed",   "ing",  "er",  "ly",  "ion", "es",  "al",
                                       "ment", "ness", "able", "ity", "ous", "ive", "ful", "ism"};
static const char *const puncts[] = {",", ".", "(", ")",  ":",  ";",  "\"", "'",  "-",  "!",  "?",
                                     "/", "[", "]", "{",  "}",  "=",  "+",  "*",  "#",  "&",  "%",
                                     "<", ">", "|", "_",  "`",  "~",  "@",  "$",  "^",  "\\", "—",
                                     "“", "”", "…", "、", "。", "，", "！", "？", "：", "（", "）"};
static const char *const spaces[] = {"\n",     "\n\n", " ",   "  ",   "    ",     "\t",
                                     "\n\n\n", "   ",  " \n", "\r\n", "        ", "\t\t"};
static const char *const accented[] = {"é", "è", "ê", "à", "â", "ü", "ö", "ä", "ñ", "ç", "ß", "ó", "í", "ú"};
static const uint32_t symbols[] = {0x2192, 0x20AC, 0xA9,   0xB0,   0xB1,   0xD7,   0xF7,   0x2264,
                                   0x2265, 0x2211, 0x221A, 0x221E, 0x2605, 0x2665, 0x2022, 0x2713};

#define N_OF(a) (sizeof(a) / sizeof((a)[0]))
#define CJK_POOL 3000u

static void gen_english(ds41_buf *w, uint64_t *s, bool allow_space) {
    if (allow_space && rnd(s, 100) < 72) ds41_buf_put(w, " ", 1);
    size_t first = w->len;
    uint32_t r = rnd(s, 100), syl = r < 45 ? 1 : r < 80 ? 2 : r < 94 ? 3 : 4;
    for (uint32_t k = 0; k < syl; k++) {
        ds41_buf_puts(w, onsets[rnd_skew(s, N_OF(onsets))]);
        ds41_buf_puts(w, vowels[rnd_skew(s, N_OF(vowels))]);
        ds41_buf_puts(w, codas[rnd_skew(s, N_OF(codas))]);
    }
    if (rnd(s, 100) < 20) ds41_buf_puts(w, suffixes[rnd_skew(s, N_OF(suffixes))]);
    if (!w->oom && w->len > first && rnd(s, 100) < 12 && w->data[first] >= 'a' && w->data[first] <= 'z')
        w->data[first] = (char)(w->data[first] - 'a' + 'A');
}

/* One pre-tokenized piece of text (the kinds the real pre-tokenizer yields). */
static void gen_word(ds41_buf *w, uint64_t *s, const uint32_t *cjk_pool) {
    w->len = 0;
    uint32_t kind = rnd(s, 100);
    if (kind < 52) {
        gen_english(w, s, true);
    } else if (kind < 60) { /* \p{N}{1,3} */
        uint32_t n = 1 + rnd_skew(s, 3);
        for (uint32_t k = 0; k < n; k++) buf_cp(w, '0' + rnd(s, 10));
    } else if (kind < 70) { /* " ?[\p{P}\p{S}]+[\r\n]*" */
        if (rnd(s, 100) < 35) ds41_buf_put(w, " ", 1);
        uint32_t n = 1 + rnd_skew(s, 3);
        for (uint32_t k = 0; k < n; k++) ds41_buf_puts(w, puncts[rnd_skew(s, N_OF(puncts))]);
        uint32_t nl = rnd(s, 100);
        if (nl < 15)
            ds41_buf_put(w, "\n", 1);
        else if (nl < 20)
            ds41_buf_put(w, "\n\n", 2);
    } else if (kind < 75) { /* whitespace runs */
        ds41_buf_puts(w, spaces[rnd_skew(s, N_OF(spaces))]);
    } else if (kind < 86) { /* CJK / kana runs */
        uint32_t n = 1 + rnd_skew(s, 6);
        for (uint32_t k = 0; k < n; k++) {
            uint32_t r = rnd(s, 100);
            if (r < 80)
                buf_cp(w, cjk_pool[rnd_skew(s, CJK_POOL)]);
            else if (r < 90)
                buf_cp(w, 0x3041 + rnd_skew(s, 0x56)); /* hiragana */
            else
                buf_cp(w, 0x30A1 + rnd_skew(s, 0x5A)); /* katakana */
        }
    } else if (kind < 94) { /* accented Latin, Cyrillic, Greek */
        if (rnd(s, 100) < 70) ds41_buf_put(w, " ", 1);
        uint32_t script = rnd(s, 10), n = 2 + rnd(s, 8);
        for (uint32_t k = 0; k < n; k++) {
            if (script < 4)
                ds41_buf_puts(w, rnd(s, 4) ? onsets[1 + rnd_skew(s, N_OF(onsets) - 1)]
                                      : accented[rnd_skew(s, N_OF(accented))]);
            else if (script < 7)
                buf_cp(w, 0x0430 + rnd_skew(s, 32)); /* Cyrillic а..я */
            else
                buf_cp(w, 0x03B1 + rnd_skew(s, 25)); /* Greek α..ω */
        }
    } else if (kind < 97) { /* "[punct][A-Za-z]+": 's .com _init (the */
        static const char lead[] = "'._-(/@#$";
        ds41_buf_put(w, &lead[rnd_skew(s, sizeof lead - 1)], 1);
        gen_english(w, s, false);
    } else { /* symbols and emoji */
        if (rnd(s, 100) < 40) ds41_buf_put(w, " ", 1);
        uint32_t n = 1 + rnd(s, 2);
        for (uint32_t k = 0; k < n; k++) {
            uint32_t r = rnd(s, 3);
            buf_cp(w, r == 0   ? symbols[rnd_skew(s, N_OF(symbols))]
                      : r == 1 ? 0x1F600 + rnd_skew(s, 80)
                               : 0x1F300 + rnd_skew(s, 256));
        }
    }
}

/* ======================================================================
 * BPE training
 * ====================================================================== */

typedef struct heap_entry {
    int64_t count;
    uint32_t a, b;
} heap_entry;

typedef struct trainer {
    /* word types: symbols (token ids) in one array; counts */
    uint32_t *sym;
    size_t sym_len;
    uint32_t *w_start, *w_len, *w_count, *w_stamp;
    uint32_t n_words;

    /* pairs */
    uint64_t *p_keys; /* (a << 32 | b) + 1; 0 = empty */
    uint32_t *p_slot_idx;
    size_t p_mask, p_used;
    uint32_t *p_a, *p_b, *p_where, *p_stamp;
    int64_t *p_count;
    uint8_t *p_banned;
    uint32_t p_n, p_cap;

    /* where-lists: nodes (word, next); index 0 is the end */
    uint32_t *n_word, *n_next;
    size_t n_n, n_cap;

    heap_entry *heap;
    size_t h_n, h_cap;

    uint32_t *touched;
    size_t t_n, t_cap;
    bool oom;
} trainer;

static bool heap_before(const heap_entry *x, const heap_entry *y) {
    if (x->count != y->count) return x->count > y->count;
    if (x->a != y->a) return x->a < y->a;
    return x->b < y->b;
}

static void heap_push(trainer *t, int64_t count, uint32_t a, uint32_t b) {
    if (t->h_n == t->h_cap) {
        size_t cap = t->h_cap ? 2 * t->h_cap : 4096;
        heap_entry *h = realloc(t->heap, cap * sizeof *h);
        if (!h) {
            t->oom = true;
            return;
        }
        t->heap = h;
        t->h_cap = cap;
    }
    size_t i = t->h_n++;
    heap_entry e = {count, a, b};
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!heap_before(&e, &t->heap[parent])) break;
        t->heap[i] = t->heap[parent];
        i = parent;
    }
    t->heap[i] = e;
}

static heap_entry heap_pop(trainer *t) {
    heap_entry top = t->heap[0];
    heap_entry last = t->heap[--t->h_n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= t->h_n) break;
        if (c + 1 < t->h_n && heap_before(&t->heap[c + 1], &t->heap[c])) c++;
        if (!heap_before(&t->heap[c], &last)) break;
        t->heap[i] = t->heap[c];
        i = c;
    }
    if (t->h_n) t->heap[i] = last;
    return top;
}

static size_t pair_slot(const trainer *t, uint64_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 24) & t->p_mask;
    while (t->p_keys[i] && t->p_keys[i] != key) i = (i + 1) & t->p_mask;
    return i;
}

static void pair_grow_table(trainer *t) {
    size_t cap = t->p_keys ? 2 * (t->p_mask + 1) : 1 << 16;
    uint64_t *keys = calloc(cap, sizeof *keys);
    uint32_t *idx = malloc(cap * sizeof *idx);
    if (!keys || !idx) {
        free(keys);
        free(idx);
        t->oom = true;
        return;
    }
    uint64_t *old_keys = t->p_keys;
    uint32_t *old_idx = t->p_slot_idx;
    size_t old_cap = old_keys ? t->p_mask + 1 : 0;
    t->p_keys = keys;
    t->p_slot_idx = idx;
    t->p_mask = cap - 1;
    for (size_t i = 0; i < old_cap; i++) {
        if (!old_keys[i]) continue;
        size_t j = pair_slot(t, old_keys[i]);
        keys[j] = old_keys[i];
        idx[j] = old_idx[i];
    }
    free(old_keys);
    free(old_idx);
}

/* The pair (a, b)'s index, created with count 0 when new; UINT32_MAX on OOM. */
static uint32_t pair_get(trainer *t, uint32_t a, uint32_t b) {
    uint64_t key = (((uint64_t)a << 32) | b) + 1;
    if (t->p_keys) {
        size_t slot = pair_slot(t, key);
        if (t->p_keys[slot]) return t->p_slot_idx[slot];
    }
    if (!t->p_keys || 2 * (t->p_used + 1) > t->p_mask + 1) {
        pair_grow_table(t);
        if (t->oom) return UINT32_MAX;
    }
    size_t slot = pair_slot(t, key);
    if (t->p_n == t->p_cap) {
        uint32_t cap = t->p_cap ? 2 * t->p_cap : 1 << 15;
        uint32_t **arr32[] = {&t->p_a, &t->p_b, &t->p_where, &t->p_stamp};
        for (size_t k = 0; k < 4; k++) {
            uint32_t *p = realloc(*arr32[k], cap * sizeof **arr32[k]);
            if (!p) {
                t->oom = true;
                return UINT32_MAX;
            }
            *arr32[k] = p;
        }
        int64_t *c = realloc(t->p_count, cap * sizeof *c);
        if (c) t->p_count = c;
        uint8_t *bn = realloc(t->p_banned, cap);
        if (bn) t->p_banned = bn;
        if (!c || !bn) {
            t->oom = true;
            return UINT32_MAX;
        }
        t->p_cap = cap;
    }
    uint32_t idx = t->p_n++;
    t->p_a[idx] = a;
    t->p_b[idx] = b;
    t->p_where[idx] = 0;
    t->p_stamp[idx] = 0;
    t->p_count[idx] = 0;
    t->p_banned[idx] = 0;
    t->p_keys[slot] = key;
    t->p_slot_idx[slot] = idx;
    t->p_used++;
    return idx;
}

static void where_push(trainer *t, uint32_t pair, uint32_t word) {
    if (t->n_n == t->n_cap) {
        size_t cap = t->n_cap ? 2 * t->n_cap : 1 << 16;
        uint32_t *w = realloc(t->n_word, cap * sizeof *w);
        if (w) t->n_word = w;
        uint32_t *n = realloc(t->n_next, cap * sizeof *n);
        if (n) t->n_next = n;
        if (!w || !n) {
            t->oom = true;
            return;
        }
        t->n_cap = cap;
        if (t->n_n == 0) t->n_n = 1; /* node 0 is the list end */
    }
    size_t node = t->n_n++;
    t->n_word[node] = word;
    t->n_next[node] = t->p_where[pair];
    t->p_where[pair] = (uint32_t)node;
}

static void touched_push(trainer *t, uint32_t pair) {
    if (t->t_n == t->t_cap) {
        size_t cap = t->t_cap ? 2 * t->t_cap : 1024;
        uint32_t *p = realloc(t->touched, cap * sizeof *p);
        if (!p) {
            t->oom = true;
            return;
        }
        t->touched = p;
        t->t_cap = cap;
    }
    t->touched[t->t_n++] = pair;
}

/* Replace every (a, b) in the words that hold it by NEW_ID, keeping the pair
 * counts exact; queue the pairs that contain NEW_ID (only they can grow). */
static void apply_merge(trainer *t, uint32_t pair, uint32_t new_id, uint32_t stamp) {
    uint32_t a = t->p_a[pair], b = t->p_b[pair];
    t->t_n = 0;
    for (uint32_t node = t->p_where[pair]; node && !t->oom; node = t->n_next[node]) {
        uint32_t w = t->n_word[node];
        if (t->w_stamp[w] == stamp) continue;
        t->w_stamp[w] = stamp;
        uint32_t *s = t->sym + t->w_start[w];
        uint32_t len = t->w_len[w];
        int64_t c = t->w_count[w];
        bool holds = false;
        for (uint32_t i = 0; i + 1 < len && !holds; i++) holds = s[i] == a && s[i + 1] == b;
        if (!holds) continue;
        for (uint32_t i = 0; i + 1 < len; i++) {
            uint32_t p = pair_get(t, s[i], s[i + 1]); /* exists: only looked up */
            if (p == UINT32_MAX) return;
            t->p_count[p] -= c;
        }
        uint32_t j = 0;
        for (uint32_t i = 0; i < len;) {
            if (i + 1 < len && s[i] == a && s[i + 1] == b) {
                s[j++] = new_id;
                i += 2;
            } else {
                s[j++] = s[i++];
            }
        }
        t->w_len[w] = len = j;
        for (uint32_t i = 0; i + 1 < len; i++) {
            uint32_t p = pair_get(t, s[i], s[i + 1]);
            if (p == UINT32_MAX) return;
            t->p_count[p] += c;
            if (s[i] == new_id || s[i + 1] == new_id) {
                where_push(t, p, w);
                if (t->p_stamp[p] != stamp) {
                    t->p_stamp[p] = stamp;
                    touched_push(t, p);
                }
            }
        }
    }
    for (size_t k = 0; k < t->t_n && !t->oom; k++) {
        uint32_t p = t->touched[k];
        if (t->p_count[p] > 0) heap_push(t, t->p_count[p], t->p_a[p], t->p_b[p]);
    }
}

static void trainer_free(trainer *t) {
    free(t->sym);
    free(t->w_start);
    free(t->w_len);
    free(t->w_count);
    free(t->w_stamp);
    free(t->p_keys);
    free(t->p_slot_idx);
    free(t->p_a);
    free(t->p_b);
    free(t->p_where);
    free(t->p_stamp);
    free(t->p_count);
    free(t->p_banned);
    free(t->n_word);
    free(t->n_next);
    free(t->heap);
    free(t->touched);
}

/* ======================================================================
 * The generator
 * ====================================================================== */

typedef struct merge_rec {
    uint32_t a, b;
} merge_rec;

typedef struct synth {
    uint32_t vocab_size, top_k, model_count, target_new;
    uint32_t corpus_words; /* word types to draw; 0 = automatic */
    uint32_t trained;      /* tokens learned from the corpus */
    uint32_t top_ids[REAL_TOP_COUNT];
    strset tokens;   /* model.vocab strings, id = index */
    strset reserved; /* added-token contents a merge must not produce */
    merge_rec *merges;
    size_t n_merges, merges_cap;
    uint32_t byte_token[256]; /* byte -> its token id */
    bool oom;
} synth;

static void add_merge(synth *g, uint32_t a, uint32_t b) {
    if (g->n_merges == g->merges_cap) {
        size_t cap = g->merges_cap ? 2 * g->merges_cap : 1024;
        merge_rec *m = realloc(g->merges, cap * sizeof *m);
        if (!m) {
            g->oom = true;
            return;
        }
        g->merges = m;
        g->merges_cap = cap;
    }
    g->merges[g->n_merges++] = (merge_rec){a, b};
}

/* The joined string of tokens a and b in SCRATCH. */
static void join_tokens(const synth *g, uint32_t a, uint32_t b, ds41_buf *scratch) {
    scratch->len = 0;
    ds41_buf_put(scratch, g->tokens.text.data + g->tokens.off[a], g->tokens.len[a]);
    ds41_buf_put(scratch, g->tokens.text.data + g->tokens.off[b], g->tokens.len[b]);
}

static int base_tokens(synth *g) {
    for (int i = 0; i < 3; i++) strset_add(&g->tokens, sentence_tokens[i], strlen(sentence_tokens[i]));
    uint8_t byte_of_rank[N_BYTE_TOKENS];
    for (uint32_t byte = 0; byte < N_BYTE_TOKENS; byte++)
        byte_of_rank[ds41_byte_level_rank((uint8_t)byte)] = (uint8_t)byte;
    ds41_buf ch = {0};
    for (uint32_t r = 0; r < N_BYTE_TOKENS; r++) {
        uint8_t byte = byte_of_rank[r];
        ch.len = 0;
        buf_cp(&ch, ds41_byte_level_char(byte));
        g->byte_token[byte] = (uint32_t)strset_add(&g->tokens, ch.data, ch.len);
    }
    free(ch.data);
    for (uint32_t k = 0; k < g->top_k; k++) {
        top_token t;
        real_top_token(g->top_ids[k], &t);
        strset_add(&g->reserved, t.content, strlen(t.content));
    }
    return g->tokens.oom || g->reserved.oom || ch.oom ? -1 : 0;
}

/* Draw word types until there are enough to learn TARGET_NEW tokens. */
static int build_corpus(synth *g, trainer *t, uint64_t *rng) {
    uint32_t cjk_pool[CJK_POOL];
    for (uint32_t i = 0; i < CJK_POOL; i++) cjk_pool[i] = 0x4E00 + rnd(rng, 0x9FA5 - 0x4E00 + 1);

    strset types = {0};
    uint32_t *counts = NULL;
    size_t counts_cap = 0;
    /* Enough word types for the merges wanted, and never a tiny corpus, so
     * that small vocabularies still get the common merges first. */
    uint64_t want = (uint64_t)g->target_new + g->target_new / 4 + 64;
    if (want < 4096) want = 4096;
    if (g->corpus_words) want = g->corpus_words;
    uint64_t max_draws = 8 * want + 100000;
    ds41_buf w = {0};
    int rc = -1;
    for (uint64_t d = 0; d < max_draws && types.n < want; d++) {
        gen_word(&w, rng, cjk_pool);
        if (w.oom) goto out;
        if (w.len == 0) continue;
        int64_t id = strset_find(&types, w.data, w.len);
        if (id < 0) {
            id = strset_add(&types, w.data, w.len);
            if (id < 0) goto out;
            if ((size_t)id >= counts_cap) {
                counts_cap = counts_cap ? 2 * counts_cap : 4096;
                uint32_t *c = realloc(counts, counts_cap * sizeof *c);
                if (!c) goto out;
                counts = c;
            }
            counts[id] = 0;
        }
        counts[id]++;
    }
    t->n_words = types.n;
    size_t total = 0;
    for (uint32_t i = 0; i < types.n; i++) total += types.len[i];
    t->sym = malloc((total ? total : 1) * sizeof *t->sym);
    t->w_start = malloc((types.n ? types.n : 1) * sizeof *t->w_start);
    t->w_len = malloc((types.n ? types.n : 1) * sizeof *t->w_len);
    t->w_count = malloc((types.n ? types.n : 1) * sizeof *t->w_count);
    t->w_stamp = calloc(types.n ? types.n : 1, sizeof *t->w_stamp);
    if (!t->sym || !t->w_start || !t->w_len || !t->w_count || !t->w_stamp) goto out;
    for (uint32_t i = 0; i < types.n; i++) {
        t->w_start[i] = (uint32_t)t->sym_len;
        t->w_len[i] = types.len[i];
        t->w_count[i] = counts[i];
        const uint8_t *p = (const uint8_t *)types.text.data + types.off[i];
        for (uint32_t k = 0; k < types.len[i]; k++) t->sym[t->sym_len++] = g->byte_token[p[k]];
    }
    rc = 0;
out:
    free(w.data);
    free(counts);
    strset_free(&types);
    return rc;
}

static int learn_merges(synth *g, trainer *t) {
    for (uint32_t w = 0; w < t->n_words; w++) {
        const uint32_t *s = t->sym + t->w_start[w];
        for (uint32_t i = 0; i + 1 < t->w_len[w]; i++) {
            uint32_t p = pair_get(t, s[i], s[i + 1]);
            if (p == UINT32_MAX) return -1;
            t->p_count[p] += t->w_count[w];
            where_push(t, p, w);
        }
    }
    for (uint32_t p = 0; p < t->p_n && !t->oom; p++) heap_push(t, t->p_count[p], t->p_a[p], t->p_b[p]);
    ds41_buf joined = {0};
    uint32_t made = 0, stamp = 0;
    while (made < g->target_new && t->h_n && !t->oom && !joined.oom && !g->oom) {
        heap_entry e = heap_pop(t);
        uint32_t p = pair_get(t, e.a, e.b);
        if (p == UINT32_MAX) break;
        int64_t cur = t->p_count[p];
        if (cur <= 0 || t->p_banned[p]) continue;
        if (cur != e.count) { /* stale entry: the count went down since */
            heap_push(t, cur, e.a, e.b);
            continue;
        }
        join_tokens(g, e.a, e.b, &joined);
        if (strset_find(&g->reserved, joined.data, joined.len) >= 0) {
            t->p_banned[p] = 1; /* would shadow an added token: never merge it */
            continue;
        }
        int64_t id = strset_find(&g->tokens, joined.data, joined.len);
        if (id < 0) {
            id = strset_add(&g->tokens, joined.data, joined.len);
            if (id < 0) break;
            made++;
        }
        add_merge(g, e.a, e.b);
        apply_merge(t, p, (uint32_t)id, ++stamp);
    }
    free(joined.data);
    g->trained = (uint32_t)g->n_merges;
    return t->oom || g->oom || g->tokens.oom ? -1 : 0;
}

/* When the corpus ran dry: join an existing token with a byte token. */
static int fill_merges(synth *g, uint64_t *rng) {
    ds41_buf joined = {0};
    while (g->tokens.n < g->model_count && !joined.oom && !g->oom) {
        uint32_t a = 3 + rnd(rng, g->tokens.n - 3);
        uint32_t b = g->byte_token[rnd(rng, 256)];
        if (rnd(rng, 2)) {
            uint32_t x = a;
            a = b;
            b = x;
        }
        join_tokens(g, a, b, &joined);
        if (joined.len > 48 || strset_find(&g->tokens, joined.data, joined.len) >= 0 ||
            strset_find(&g->reserved, joined.data, joined.len) >= 0)
            continue;
        if (strset_add(&g->tokens, joined.data, joined.len) < 0) break;
        add_merge(g, a, b);
    }
    free(joined.data);
    return joined.oom || g->oom || g->tokens.oom ? -1 : 0;
}

static const char components_json[] =
    "  \"normalizer\": {\n"
    "    \"type\": \"Sequence\",\n"
    "    \"normalizers\": []\n"
    "  },\n"
    "  \"pre_tokenizer\": {\n"
    "    \"type\": \"Sequence\",\n"
    "    \"pretokenizers\": [\n"
    "      {\n"
    "        \"type\": \"Split\",\n"
    "        \"pattern\": {\n"
    "          \"Regex\": \"\\\\p{N}{1,3}\"\n"
    "        },\n"
    "        \"behavior\": \"Isolated\",\n"
    "        \"invert\": false\n"
    "      },\n"
    "      {\n"
    "        \"type\": \"Split\",\n"
    "        \"pattern\": {\n"
    "          \"Regex\": \"[一-龥぀-ゟ゠-ヿ]+\"\n"
    "        },\n"
    "        \"behavior\": \"Isolated\",\n"
    "        \"invert\": false\n"
    "      },\n"
    "      {\n"
    "        \"type\": \"Split\",\n"
    "        \"pattern\": {\n"
    "          \"Regex\": "
    "\"[!\\\"#$%&'()*+,\\\\-./:;<=>?@\\\\[\\\\\\\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\\\p{L}\\\\p{P}"
    "\\\\p{S}]?[\\\\p{L}\\\\p{M}]+| ?[\\\\p{P}\\\\p{S}]+[\\r\\n]*|\\\\s*[\\r\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"\n"
    "        },\n"
    "        \"behavior\": \"Isolated\",\n"
    "        \"invert\": false\n"
    "      },\n"
    "      {\n"
    "        \"type\": \"ByteLevel\",\n"
    "        \"add_prefix_space\": false,\n"
    "        \"trim_offsets\": true,\n"
    "        \"use_regex\": false\n"
    "      }\n"
    "    ]\n"
    "  },\n"
    "  \"post_processor\": {\n"
    "    \"type\": \"ByteLevel\",\n"
    "    \"add_prefix_space\": true,\n"
    "    \"trim_offsets\": false,\n"
    "    \"use_regex\": true\n"
    "  },\n"
    "  \"decoder\": {\n"
    "    \"type\": \"ByteLevel\",\n"
    "    \"add_prefix_space\": true,\n"
    "    \"trim_offsets\": true,\n"
    "    \"use_regex\": true\n"
    "  },\n";

static void emit_added(ds41_buf *out, uint32_t id, const char *content, bool normalized, bool special, bool last) {
    ds41_buf_printf(out, "    {\n      \"id\": %u,\n      \"content\": ", id);
    ds41_py_dumps_string(content, strlen(content), out);
    ds41_buf_printf(out,
               ",\n      \"single_word\": false,\n      \"lstrip\": false,\n      \"rstrip\": false,\n"
               "      \"normalized\": %s,\n      \"special\": %s\n    }%s\n",
               normalized ? "true" : "false", special ? "true" : "false", last ? "" : ",");
}

static void emit(const synth *g, ds41_buf *out) {
    ds41_buf_puts(out, "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
                  "  \"added_tokens\": [\n");
    for (uint32_t i = 0; i < 3; i++) emit_added(out, i, sentence_tokens[i], false, true, false);
    for (uint32_t k = 0; k < g->top_k; k++) {
        top_token t;
        real_top_token(g->top_ids[k], &t);
        emit_added(out, g->model_count + k, t.content, t.normalized, t.special, k + 1 == g->top_k);
    }
    ds41_buf_puts(out, "  ],\n");
    ds41_buf_puts(out, components_json);
    ds41_buf_puts(out, "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n"
                  "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n"
                  "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n    \"vocab\": {\n");
    for (uint32_t id = 0; id < g->tokens.n; id++) {
        ds41_buf_puts(out, "      ");
        ds41_py_dumps_string(g->tokens.text.data + g->tokens.off[id], g->tokens.len[id], out);
        ds41_buf_printf(out, ": %u%s\n", id, id + 1 == g->tokens.n ? "" : ",");
    }
    ds41_buf_puts(out, "    },\n    \"merges\": [");
    for (size_t m = 0; m < g->n_merges; m++) {
        uint32_t a = g->merges[m].a, b = g->merges[m].b;
        /* One string "a b": byte-level tokens never hold a space. */
        ds41_buf_puts(out, m ? ",\n      \"" : "\n      \"");
        ds41_py_dumps_chars(g->tokens.text.data + g->tokens.off[a], g->tokens.len[a], out);
        ds41_buf_put(out, " ", 1);
        ds41_py_dumps_chars(g->tokens.text.data + g->tokens.off[b], g->tokens.len[b], out);
        ds41_buf_put(out, "\"", 1);
    }
    ds41_buf_puts(out, g->n_merges ? "\n    ]\n  }\n}\n" : "]\n  }\n}\n");
}

char *ds41_synth_tokenizer_json_opts(uint32_t vocab_size, uint64_t seed, ds41_synth_options *opts,
                                     size_t *len, ds41_error *err) {
    if (vocab_size < DS41_SYNTH_VOCAB_MIN || vocab_size > DS41_SYNTH_VOCAB_MAX) {
        ds41_fail(err, "synthetic tokenizer: vocab_size %u is outside [%u, %u]", vocab_size,
                  DS41_SYNTH_VOCAB_MIN, DS41_SYNTH_VOCAB_MAX);
        return NULL;
    }
    synth g = {0};
    trainer t = {0};
    ds41_buf out = {0};
    char *result = NULL;
    uint64_t rng = seed ^ 0xD541D541D541D541ull;
    g.vocab_size = vocab_size;
    g.top_k = top_layout(vocab_size, g.top_ids);
    g.model_count = vocab_size - g.top_k;
    g.target_new = g.model_count - FIRST_MERGED_ID;
    g.corpus_words = opts ? opts->corpus_words : 0;
    if (base_tokens(&g) || build_corpus(&g, &t, &rng) || learn_merges(&g, &t) || fill_merges(&g, &rng))
        goto out;
    emit(&g, &out);
    if (out.oom) goto out;
    result = out.data;
    out.data = NULL;
    if (len) *len = out.len;
    if (opts) opts->trained_merges = g.trained;
out:
    if (!result) ds41_fail(err, "synthetic tokenizer (vocab_size %u): out of memory", vocab_size);
    free(out.data);
    trainer_free(&t);
    strset_free(&g.tokens);
    strset_free(&g.reserved);
    free(g.merges);
    return result;
}

char *ds41_synth_tokenizer_json(uint32_t vocab_size, uint64_t seed, size_t *len, ds41_error *err) {
    return ds41_synth_tokenizer_json_opts(vocab_size, seed, NULL, len, err);
}

static const char config_json[] = "{\n"
                                  "  \"add_bos_token\": false,\n"
                                  "  \"add_eos_token\": false,\n"
                                  "  \"bos_token\": {\n"
                                  "    \"__type\": \"AddedToken\",\n"
                                  "    \"content\": \"<｜begin▁of▁sentence｜>\",\n"
                                  "    \"lstrip\": false,\n"
                                  "    \"normalized\": true,\n"
                                  "    \"rstrip\": false,\n"
                                  "    \"single_word\": false\n"
                                  "  },\n"
                                  "  \"clean_up_tokenization_spaces\": false,\n"
                                  "  \"eos_token\": {\n"
                                  "    \"__type\": \"AddedToken\",\n"
                                  "    \"content\": \"<｜end▁of▁sentence｜>\",\n"
                                  "    \"lstrip\": false,\n"
                                  "    \"normalized\": true,\n"
                                  "    \"rstrip\": false,\n"
                                  "    \"single_word\": false\n"
                                  "  },\n"
                                  "  \"legacy\": true,\n"
                                  "  \"model_max_length\": 1048576,\n"
                                  "  \"pad_token\": {\n"
                                  "    \"__type\": \"AddedToken\",\n"
                                  "    \"content\": \"<｜end▁of▁sentence｜>\",\n"
                                  "    \"lstrip\": false,\n"
                                  "    \"normalized\": true,\n"
                                  "    \"rstrip\": false,\n"
                                  "    \"single_word\": false\n"
                                  "  },\n"
                                  "  \"sp_model_kwargs\": {},\n"
                                  "  \"unk_token\": null,\n"
                                  "  \"tokenizer_class\": \"PreTrainedTokenizerFast\"\n"
                                  "}";

const char *ds41_synth_tokenizer_config_json(size_t *len) {
    if (len) *len = sizeof config_json - 1;
    return config_json;
}

static int write_file(const char *dir, const char *name, const char *data, size_t len, ds41_error *err) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *path = malloc(n);
    if (!path) return ds41_fail(err, "%s/%s: out of memory", dir, name);
    snprintf(path, n, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        ds41_fail(err, "%s: cannot create: %s", path, strerror(errno));
        free(path);
        return -1;
    }
    size_t put = fwrite(data, 1, len, f);
    int bad = put != len || ferror(f);
    if (fclose(f) != 0) bad = 1;
    if (bad) ds41_fail(err, "%s: write failed: %s", path, strerror(errno));
    free(path);
    return bad ? -1 : 0;
}

int ds41_synth_tokenizer_write(const char *dir, uint32_t vocab_size, uint64_t seed, ds41_error *err) {
    size_t len;
    char *json = ds41_synth_tokenizer_json(vocab_size, seed, &len, err);
    if (!json) return -1;
    int rc = write_file(dir, "tokenizer.json", json, len, err);
    free(json);
    if (rc) return -1;
    size_t clen;
    const char *cfg = ds41_synth_tokenizer_config_json(&clen);
    return write_file(dir, "tokenizer_config.json", cfg, clen, err);
}
