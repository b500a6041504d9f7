/* The tokenizer's White_Space class against the Unicode data over every code
 * point (issue 19).  The class was checked with a hand-picked list of 19
 * characters, so dropping one other space (U+205F, U+1680, ...) from the
 * hand-written table changed tokenization and nothing noticed.
 *
 * The reference is derived from the generated general-category table
 * (engine/text/unicode_tables.c, from the Unicode 16.0 character database): in
 * Unicode, White_Space is exactly the space, line and paragraph separators
 * (Zs, Zl, Zp) plus the controls U+0009..U+000D and U+0085.  Both users of the
 * class are compared with it for every code point: the regex translation of
 * \s (the pre-tokenizer) and the lstrip/rstrip of added tokens.  Likewise the
 * word class of single_word added tokens (Rust regex \w: Alphabetic, marks,
 * Nd, Pc and the join controls), from the generated Alphabetic and category
 * tables, which also exercises the binary search over those tables. */
#include "engine/text/synth_tokenizer.h"
#include "engine/text/tokenizer.h"
#include "engine/text/unicode_tables.h"
#include "engine/text/vocab.h"
#include "tests/tap.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CP_LIMIT 0x110000u

static bool is_surrogate(uint32_t c) {
    return c >= 0xD800 && c <= 0xDFFF;
}

/* White_Space from the generated category table. */
static void reference_white_space(bool *ws) {
    memset(ws, 0, CP_LIMIT * sizeof *ws);
    for (size_t i = 0; i < ds41_unicode_gc_n_ranges; i++) {
        const ds41_unicode_range *r = &ds41_unicode_gc_ranges[i];
        if (r->value == DS41_GC_ZS || r->value == DS41_GC_ZL || r->value == DS41_GC_ZP)
            for (uint32_t c = r->first; c <= r->last && c < CP_LIMIT; c++) ws[c] = true;
    }
    for (uint32_t c = 0x09; c <= 0x0D; c++) ws[c] = true;
    ws[0x85] = true;
}

/* Parses the bracket class "[\x{A}-\x{B}\x{C}...]" the translation emits. */
static bool parse_class(const char *s, bool *set) {
    memset(set, 0, CP_LIMIT * sizeof *set);
    if (*s++ != '[') return false;
    while (*s && *s != ']') {
        unsigned long a, b;
        char *end;
        if (strncmp(s, "\\x{", 3) != 0) return false;
        a = strtoul(s + 3, &end, 16);
        if (*end != '}') return false;
        s = end + 1;
        b = a;
        if (*s == '-') {
            if (strncmp(s + 1, "\\x{", 3) != 0) return false;
            b = strtoul(s + 4, &end, 16);
            if (*end != '}') return false;
            s = end + 1;
        }
        if (a > b || b >= CP_LIMIT) return false;
        for (unsigned long c = a; c <= b; c++) set[c] = true;
    }
    return *s == ']' && s[1] == 0;
}

static void test_regex_class(const bool *ws) {
    ds41_error e = {{0}};
    char *s = ds41_tokenizer_translate_regex("[\\s]", 4, &e);
    bool *set = malloc(CP_LIMIT * sizeof *set);
    bool parsed = s && set && parse_class(s, set);
    TAP_CHECK(parsed, "translate: [\\s] is a class of code point ranges ('%.80s')", s ? s : e.msg);
    if (parsed) {
        uint32_t bad = CP_LIMIT, n = 0;
        for (uint32_t c = 0; c < CP_LIMIT; c++) {
            if (is_surrogate(c)) continue;
            n += ws[c];
            if (set[c] != ws[c] && bad == CP_LIMIT) bad = c;
        }
        TAP_CHECK(bad == CP_LIMIT && n == 25,
                  "the regex \\s class equals White_Space (Zs|Zl|Zp|U+0009..D|U+0085, %u code points) over all "
                  "code points (first difference: U+%04X)",
                  n, bad);
    }
    free(set);
    free(s);
}

static size_t put_utf8(char *o, uint32_t c) {
    if (c < 0x80) {
        o[0] = (char)c;
        return 1;
    }
    if (c < 0x800) {
        o[0] = (char)(0xC0 | (c >> 6));
        o[1] = (char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | (c >> 12));
        o[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (c >> 18));
    o[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

/* The synthetic tokenizer plus added tokens (ids from 2000): <|r|> with rstrip, <|n|> with
 * neither, <|l|> with lstrip. */
static ds41_tokenizer *strip_tokenizer(ds41_vocab **vout, ds41_error *e) {
    size_t len;
    char *js = ds41_synth_tokenizer_json(2000, 7, &len, e);
    json_t *root = js ? json_loadb(js, len, 0, NULL) : NULL;
    free(js);
    if (!root) return NULL;
    static const char *const names[3] = {"<|r|>", "<|n|>", "<|l|>"};
    for (int i = 0; i < 3; i++)
        json_array_append_new(json_object_get(root, "added_tokens"),
                              json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", 2000 + i, "content", names[i],
                                        "single_word", 0, "lstrip", i == 2, "rstrip", i == 0, "normalized", 0,
                                        "special", 0));
    char *out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    ds41_vocab *v = out ? ds41_vocab_parse(out, strlen(out), "strip.json", e) : NULL;
    free(out);
    ds41_tokenizer *t = v ? ds41_tokenizer_new(v, e) : NULL;
    if (!t) ds41_vocab_free(v);
    *vout = t ? v : NULL;
    return t;
}

#define BATCH 4096

/* Encodes "<open> c <close>" for the code points [c0, c0 + BATCH) in one text and returns the
 * first code point whose "swallowed" state (nothing between the two added tokens) differs from
 * ws, CP_LIMIT when none; *broken when the ids do not have the expected shape. */
static uint32_t strip_batch(const ds41_tokenizer *t, uint32_t c0, uint32_t open, uint32_t close, const bool *ws,
                            ds41_token_ids *ids, bool *broken) {
    static const char *const names[3] = {"<|r|>", "<|n|>", "<|l|>"};
    static char text[BATCH * 16];
    uint32_t cps[BATCH];
    size_t n = 0, k = 0;
    for (uint32_t c = c0; c < c0 + BATCH && c < CP_LIMIT; c++) {
        if (is_surrogate(c) || c == 0) continue;
        cps[k++] = c;
        n += (size_t)sprintf(text + n, "%s", names[open - 2000]);
        n += put_utf8(text + n, c);
        n += (size_t)sprintf(text + n, "%s", names[close - 2000]);
    }
    ds41_error e = {{0}};
    ids->n = 0; /* encode appends */
    if (ds41_tokenizer_encode(t, text, n, ids, &e) != 0) {
        *broken = true;
        return c0;
    }
    size_t at = 0;
    for (size_t i = 0; i < k; i++) {
        if (at >= ids->n || ids->ids[at] != open) {
            *broken = true;
            return cps[i];
        }
        size_t j = at + 1;
        while (j < ids->n && ids->ids[j] != close) j++;
        if (j >= ids->n) {
            *broken = true;
            return cps[i];
        }
        bool swallowed = j == at + 1;
        if (swallowed != ws[cps[i]]) return cps[i];
        at = j + 1;
    }
    return CP_LIMIT;
}

static void test_strip_class(const bool *ws) {
    ds41_error e = {{0}};
    ds41_vocab *v = NULL;
    ds41_tokenizer *t = strip_tokenizer(&v, &e);
    if (!TAP_CHECK(t != NULL, "lstrip/rstrip tokenizer builds%s%s", t ? "" : ": ", t ? "" : e.msg)) return;
    ds41_token_ids ids = {0};
    uint32_t bad_r = CP_LIMIT, bad_l = CP_LIMIT;
    bool broken_r = false, broken_l = false;
    for (uint32_t c0 = 0; c0 < CP_LIMIT && bad_r == CP_LIMIT; c0 += BATCH)
        bad_r = strip_batch(t, c0, 2000, 2001, ws, &ids, &broken_r);
    for (uint32_t c0 = 0; c0 < CP_LIMIT && bad_l == CP_LIMIT; c0 += BATCH)
        bad_l = strip_batch(t, c0, 2001, 2002, ws, &ids, &broken_l);
    TAP_CHECK(bad_r == CP_LIMIT,
              "rstrip swallows a code point exactly when it is White_Space, over all code points "
              "(first difference: U+%04X%s)",
              bad_r, broken_r ? ", unexpected ids" : "");
    TAP_CHECK(bad_l == CP_LIMIT,
              "lstrip swallows a code point exactly when it is White_Space, over all code points "
              "(first difference: U+%04X%s)",
              bad_l, broken_l ? ", unexpected ids" : "");
    ds41_token_ids_free(&ids);
    ds41_tokenizer_free(t);
    ds41_vocab_free(v);
}

static void reference_word(bool *word) {
    memset(word, 0, CP_LIMIT * sizeof *word);
    for (size_t i = 0; i < ds41_unicode_alphabetic_n_ranges; i++)
        for (uint32_t c = ds41_unicode_alphabetic_ranges[i].first; c <= ds41_unicode_alphabetic_ranges[i].last; c++)
            word[c] = true;
    for (size_t i = 0; i < ds41_unicode_gc_n_ranges; i++) {
        const uint32_t g = ds41_unicode_gc_ranges[i].value;
        if (g == DS41_GC_MN || g == DS41_GC_MC || g == DS41_GC_ME || g == DS41_GC_ND || g == DS41_GC_PC)
            for (uint32_t c = ds41_unicode_gc_ranges[i].first; c <= ds41_unicode_gc_ranges[i].last; c++)
                word[c] = true;
    }
    word[0x200C] = word[0x200D] = true;
}

static void test_word_class(void) {
    ds41_error e = {{0}};
    size_t len;
    char *js = ds41_synth_tokenizer_json(2000, 7, &len, &e);
    json_t *root = js ? json_loadb(js, len, 0, NULL) : NULL;
    free(js);
    ds41_tokenizer *t = NULL;
    ds41_vocab *v = NULL;
    if (root) {
        json_t *added = json_object_get(root, "added_tokens");
        json_array_append_new(added, json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", 2000, "content", "<|n|>",
                                               "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special",
                                               0));
        json_array_append_new(added, json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", 2001, "content", "qzq",
                                               "single_word", 1, "lstrip", 0, "rstrip", 0, "normalized", 0, "special",
                                               0));
        char *out = json_dumps(root, JSON_COMPACT);
        json_decref(root);
        v = out ? ds41_vocab_parse(out, strlen(out), "word.json", &e) : NULL;
        free(out);
        t = v ? ds41_tokenizer_new(v, &e) : NULL;
    }
    if (!TAP_CHECK(t != NULL, "single_word tokenizer builds%s%s", t ? "" : ": ", t ? "" : e.msg)) {
        ds41_vocab_free(v);
        return;
    }
    bool *word = malloc(CP_LIMIT * sizeof *word);
    reference_word(word);
    /* "<|n|>qzq" + c per code point: qzq (single_word) is matched exactly when c is not a word
     * character (its left neighbour '>' never is). */
    static char text[BATCH * 16];
    uint32_t cps[BATCH];
    ds41_token_ids ids = {0};
    uint32_t bad = CP_LIMIT;
    bool broken = false;
    for (uint32_t c0 = 0; c0 < CP_LIMIT && bad == CP_LIMIT && !broken; c0 += BATCH) {
        size_t n = 0, k = 0;
        for (uint32_t c = c0; c < c0 + BATCH && c < CP_LIMIT; c++) {
            if (is_surrogate(c) || c == 0) continue;
            cps[k++] = c;
            memcpy(text + n, "<|n|>qzq", 8);
            n += 8;
            n += put_utf8(text + n, c);
        }
        ids.n = 0;
        if (ds41_tokenizer_encode(t, text, n, &ids, &e) != 0) {
            broken = true;
            break;
        }
        size_t at = 0;
        for (size_t i = 0; i < k && bad == CP_LIMIT; i++) {
            if (at >= ids.n || ids.ids[at] != 2000) {
                broken = true;
                bad = cps[i];
                break;
            }
            size_t j = at + 1;
            while (j < ids.n && ids.ids[j] != 2000) j++;
            const bool matched = j > at + 1 && ids.ids[at + 1] == 2001;
            if (matched == word[cps[i]]) bad = cps[i];
            at = j;
        }
    }
    TAP_CHECK(bad == CP_LIMIT && !broken,
              "single_word tokens see a word character exactly when Rust's \\w does (Alphabetic | M | Nd | Pc | "
              "join controls), over all code points (first difference: U+%04X%s)",
              bad, broken ? ", unexpected ids" : "");
    free(word);
    ds41_token_ids_free(&ids);
    ds41_tokenizer_free(t);
    ds41_vocab_free(v);
}

int main(void) {
    bool *ws = malloc(CP_LIMIT * sizeof *ws);
    if (!ws) return 1;
    reference_white_space(ws);
    test_regex_class(ws);
    test_strip_class(ws);
    free(ws);
    test_word_class();
    return tap_done();
}
