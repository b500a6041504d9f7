/* Fuzz target 'tokenizer_encode': ds41_tokenizer_encode on arbitrary bytes.
 * The first byte picks one of two small synthetic tokenizers: the plain one
 * (DeepSeek's pre-tokenizer) or a variant with added tokens carrying every
 * flag, add_prefix_space, the GPT-2 regex and other Split behaviors; the
 * rest is the text.  Invalid UTF-8 is replaced by U+FFFD first (the
 * documented contract), so with the plain tokenizer decode(encode(x)) must
 * equal from_utf8_lossy(x) for every input (the variant's prefix spaces and
 * stripped spaces change the text on purpose); with both every id must
 * exist and the streaming decoder must give decode()'s text.  Any violation
 * aborts. */
#include "engine/text/synth_tokenizer.h"
#include "engine/text/tokenizer.h"

#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check(int ok) {
    if (!ok) abort();
}

static ds41_tokenizer *make(bool variant) {
    ds41_error err = {{0}};
    size_t len;
    char *js = ds41_synth_tokenizer_json(1000, 3, &len, &err);
    check(js != NULL);
    if (variant) {
        json_t *root = json_loadb(js, len, 0, NULL);
        check(root != NULL);
        free(js);
        json_t *added = json_object_get(root, "added_tokens");
        static const struct {
            const char *content;
            bool sw, ls, rs, norm, special;
        } extra[] = {{"zqxw", 1, 0, 0, 0, 0}, {"⟦lr⟧", 0, 1, 1, 0, 0}, {" jvj", 0, 0, 1, 1, 0},
                     {"<|x|>", 0, 1, 0, 0, 1}, {"<|x|><|y|>", 1, 0, 0, 0, 1}};
        for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++)
            json_array_append_new(added, json_pack("{s:i,s:s,s:b,s:b,s:b,s:b,s:b}", "id", (json_int_t)(1000 + i),
                                                   "content", extra[i].content, "single_word", extra[i].sw, "lstrip",
                                                   extra[i].ls, "rstrip", extra[i].rs, "normalized", extra[i].norm,
                                                   "special", extra[i].special));
        json_t *steps = json_object_get(json_object_get(root, "pre_tokenizer"), "pretokenizers");
        json_object_set_new(json_array_get(steps, 3), "add_prefix_space", json_true());
        json_object_set_new(json_array_get(steps, 3), "use_regex", json_true());
        json_object_set_new(json_array_get(steps, 0), "behavior", json_string("MergedWithNext"));
        json_object_set_new(json_array_get(steps, 1), "invert", json_true());
        json_object_set_new(json_array_get(steps, 1), "behavior", json_string("Contiguous"));
        js = json_dumps(root, JSON_COMPACT);
        json_decref(root);
        check(js != NULL);
        len = strlen(js);
    }
    ds41_vocab *v = ds41_vocab_parse(js, len, "synth.json", &err);
    free(js);
    check(v != NULL);
    ds41_tokenizer *t = ds41_tokenizer_new(v, &err);
    check(t != NULL);
    return t; /* kept for the whole run (the vocabulary with it) */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static ds41_tokenizer *tok[2];
    if (!tok[0]) {
        tok[0] = make(false);
        tok[1] = make(true);
    }
    if (size == 0) return 0;
    bool variant = data[0] & 1;
    const ds41_tokenizer *t = tok[variant];
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    ds41_token_ids ids = {0};
    ds41_error err = {{0}};
    check(ds41_tokenizer_encode(t, text, n, &ids, &err) == 0);
    uint32_t vs = ds41_vocab_size(ds41_tokenizer_vocab(t));
    for (size_t i = 0; i < ids.n; i++) check(ids.ids[i] < vs && ds41_tokenizer_token_bytes(t, ids.ids[i], NULL));
    size_t want_len, got_len;
    char *want = ds41_utf8_lossy((const uint8_t *)text, n, &want_len);
    char *got = ds41_tokenizer_decode(t, ids.ids, ids.n, false, &got_len);
    check(want && got);
    if (!variant) check(want_len == got_len && memcmp(want, got, got_len) == 0);
    check(n == 0 || ids.n > 0);
    /* the streaming decoder gives the same text */
    ds41_detok *d = ds41_detok_new(t, false);
    check(d != NULL);
    size_t o = 0;
    for (size_t i = 0; i < ids.n; i++) {
        const char *s;
        size_t k;
        check(ds41_detok_push(d, ids.ids[i], &s, &k) == 0);
        check(o + k <= got_len && memcmp(got + o, s, k) == 0);
        o += k;
    }
    const char *s;
    size_t k;
    ds41_detok_finish(d, &s, &k);
    check(o + k == got_len && memcmp(got + o, s, k) == 0);
    ds41_detok_free(d);
    free(want);
    free(got);
    ds41_token_ids_free(&ids);
    return 0;
}
