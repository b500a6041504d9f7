/* Fuzz target 'tokenizer_json': ds41_vocab_parse on arbitrary bytes, then,
 * for whatever loads, every id is decoded (raw and lossy) and the invariants
 * of engine/text/vocab.h are checked; the same bytes also go to the
 * tokenizer_config.json parser.  Any violation aborts. */
#include "engine/text/vocab.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void check(int ok) {
    if (!ok) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds41_error err = {{0}};
    ds41_vocab *v = ds41_vocab_parse((const char *)data, size, "fuzz.json", &err);
    if (!v) {
        check(strncmp(err.msg, "fuzz.json: ", 11) == 0); /* every error names the source */
        return 0;
    }
    size_t cap = ds41_vocab_max_token_bytes(v);
    uint8_t *buf = malloc(cap + 1);
    check(buf != NULL);
    uint32_t existing = 0;
    for (uint32_t id = 0; id < ds41_vocab_size(v); id++) {
        size_t tn, n, ln;
        const char *t = ds41_vocab_token_string(v, id, &tn);
        int rc = ds41_vocab_decode_id(v, id, buf, cap, &n);
        char *text = ds41_vocab_decode_id_lossy(v, id, &ln);
        if (!t) {
            check(rc == -1 && n == 0 && text == NULL);
            continue;
        }
        existing++;
        check(rc == 0 && n <= tn && tn <= cap && text != NULL && text[ln] == 0);
        /* The lossy text is valid UTF-8: making it lossy again changes nothing. */
        size_t again_n;
        char *again = ds41_utf8_lossy((const uint8_t *)text, ln, &again_n);
        check(again != NULL && again_n == ln && memcmp(again, text, ln) == 0);
        free(again);
        free(text);
        /* Looking the string up gives an id with that same string. */
        int32_t found = ds41_vocab_find(v, t, tn);
        size_t fn;
        const char *fs = found >= 0 ? ds41_vocab_token_string(v, (uint32_t)found, &fn) : NULL;
        check(fs != NULL && fn == tn && memcmp(fs, t, tn) == 0);
    }
    check(existing == ds41_vocab_n_tokens(v));
    for (size_t i = 0; i < ds41_vocab_n_merges(v); i++) {
        uint32_t l, r, m;
        size_t ln, rn, mn;
        check(ds41_vocab_merge(v, i, &l, &r, &m) == 0);
        const char *ls = ds41_vocab_token_string(v, l, &ln), *rs = ds41_vocab_token_string(v, r, &rn),
                   *ms = ds41_vocab_token_string(v, m, &mn);
        check(ls && rs && ms);
        /* merged = left + right, unless an added token took one of the ids
         * over (possible with holes; HF then decodes the added token too). */
        if (!ds41_vocab_added_token(v, l) && !ds41_vocab_added_token(v, r) && !ds41_vocab_added_token(v, m))
            check(mn == ln + rn && memcmp(ms, ls, ln) == 0 && memcmp(ms + ln, rs, rn) == 0);
    }
    for (size_t i = 0; i < ds41_vocab_n_added(v); i++) {
        const ds41_added_token *a = ds41_vocab_added_at(v, i);
        check(a && ds41_vocab_added_token(v, a->id) == a &&
              ds41_vocab_find(v, a->content, a->content_len) == (int32_t)a->id);
    }
    for (int c = 0; c <= DS41_VOCAB_DECODER; c++)
        check(ds41_vocab_component_json(v, (ds41_vocab_component)c) != NULL);
    for (size_t i = 0; i < ds41_vocab_n_splits(v); i++) check(ds41_vocab_split_at(v, i)->pattern != NULL);
    /* The config parser on the same bytes: it must fail cleanly or succeed. */
    if (ds41_vocab_parse_config(v, (const char *)data, size, "fuzz-config.json", &err) != 0)
        check(strncmp(err.msg, "fuzz-config.json: ", 18) == 0);
    free(buf);
    ds41_vocab_free(v);
    return 0;
}
