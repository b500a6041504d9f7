/* Stop matcher on random stop strings and random pieces.  Input: byte 0 = number of stop strings
 * (mod 5); per stop string a length byte (1 + b % 8) and its bytes (mapped to 'a'..'d' when the
 * raw bytes are not valid UTF-8, so matches stay frequent); then pieces, each a length byte
 * (b % 9) and its bytes.  Checks, aborting on violation:
 *   - before a stop, emitted + held bytes are exactly the input so far;
 *   - the emitted text and the stop index equal the whole-text reference (first completing stop
 *     string, longest at that byte, then lowest index), also when the text comes in one piece. */
#include "engine/serve/stop.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                                          \
    do {                                                                                                     \
        if (!(cond)) __builtin_trap();                                                                       \
    } while (0)

static size_t reference(const uint8_t *text, size_t len, char stops[][8], const size_t *lens, size_t n,
                        int *index) {
    *index = -1;
    for (size_t end = 1; end <= len; end++) {
        size_t best = 0;
        for (size_t k = 0; k < n; k++)
            if (lens[k] <= end && lens[k] > best && memcmp(text + end - lens[k], stops[k], lens[k]) == 0) {
                best = lens[k];
                *index = (int)k;
            }
        if (*index >= 0) return end - best;
    }
    return len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    size_t at = 0;
    const size_t n = data[at++] % 5;
    char stops[4][8] = {{0}};
    size_t lens[4] = {0};
    const char *ptrs[4] = {0};
    for (size_t k = 0; k < n; k++) {
        lens[k] = at < size ? 1 + data[at++] % 8 : 1;
        for (size_t j = 0; j < lens[k]; j++) stops[k][j] = at < size ? (char)data[at++] : 'a';
        ptrs[k] = stops[k];
    }
    ds41_stop_matcher *m = NULL, *whole = NULL;
    ds41_error err;
    if (ds41_stop_matcher_new(&m, ptrs, lens, n, &err) != 0) {
        for (size_t k = 0; k < n; k++)
            for (size_t j = 0; j < lens[k]; j++) stops[k][j] = (char)('a' + (uint8_t)stops[k][j] % 4);
        CHECK(ds41_stop_matcher_new(&m, ptrs, lens, n, &err) == 0);
    }
    CHECK(ds41_stop_matcher_new(&whole, ptrs, lens, n, &err) == 0);

    uint8_t *text = malloc(size + 1), *got = malloc(size + 1);
    CHECK(text && got);
    size_t text_len = 0, got_len = 0;
    ds41_stop_output out = {0};
    while (at < size) {
        size_t piece = data[at++] % 9;
        if (piece > size - at) piece = size - at;
        memcpy(text + text_len, data + at, piece);
        text_len += piece;
        CHECK(ds41_stop_matcher_feed(m, (const char *)data + at, piece, &out, &err) == 0);
        at += piece;
        CHECK(out.len <= size);
        memcpy(got + got_len, out.text, out.len);
        got_len += out.len;
        if (out.stopped) break;
        CHECK(got_len + ds41_stop_matcher_held(m) == text_len);
    }
    /* the text after a stop would be ignored: keep the reference to what was fed */
    if (!out.stopped) {
        ds41_stop_matcher_finish(m, &out);
        memcpy(got + got_len, out.text, out.len);
        got_len += out.len;
        CHECK(ds41_stop_matcher_held(m) == 0);
    }
    int want_index;
    const size_t want = reference(text, text_len, stops, lens, n, &want_index);
    CHECK(got_len == want && memcmp(got, text, want) == 0 && out.stop_index == want_index);
    CHECK(out.stopped == (want_index >= 0));

    /* the same text in one piece */
    ds41_stop_output one;
    CHECK(ds41_stop_matcher_feed(whole, (const char *)text, text_len, &one, &err) == 0);
    size_t one_len = one.len;
    CHECK(memcmp(one.text, text, one.len) == 0);
    if (!one.stopped) {
        ds41_stop_matcher_finish(whole, &one);
        one_len += one.len;
    }
    CHECK(one_len == want && one.stop_index == want_index);

    free(text);
    free(got);
    ds41_stop_matcher_free(m);
    ds41_stop_matcher_free(whole);
    return 0;
}
