/* Stop strings (streamed pieces, held-back partial matches, UTF-8) and token-level limits
 * (EOS, stop ids, max_tokens). */
#include "engine/serve/stop.h"
#include "tests/tap.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Feeds pieces (NULL-terminated list) and collects what was emitted. */
typedef struct run {
    char text[4096];
    size_t len;
    int stopped, stop_index;
    size_t held_after[64]; /* held bytes after each piece */
    size_t emitted_after[64];
} run;

static ds41_stop_matcher *matcher(const char *const *stops, size_t n) {
    size_t lens[16];
    for (size_t i = 0; i < n; i++) lens[i] = strlen(stops[i]);
    ds41_stop_matcher *m = NULL;
    ds41_error err = {{0}};
    if (ds41_stop_matcher_new(&m, stops, lens, n, &err) != 0) TAP_NOTE("matcher: %s", err.msg);
    return m;
}

static void feed_all(ds41_stop_matcher *m, const char *const *pieces, int finish, run *r) {
    memset(r, 0, sizeof *r);
    r->stop_index = -1;
    ds41_stop_output out;
    ds41_error err;
    for (int i = 0; pieces[i]; i++) {
        if (ds41_stop_matcher_feed(m, pieces[i], strlen(pieces[i]), &out, &err) != 0) {
            TAP_NOTE("feed: %s", err.msg);
            return;
        }
        memcpy(r->text + r->len, out.text, out.len);
        r->len += out.len;
        r->stopped = out.stopped;
        r->stop_index = out.stop_index;
        r->held_after[i] = ds41_stop_matcher_held(m);
        r->emitted_after[i] = r->len;
    }
    if (finish) {
        ds41_stop_matcher_finish(m, &out);
        memcpy(r->text + r->len, out.text, out.len);
        r->len += out.len;
    }
    r->text[r->len] = 0;
}

static int emitted(const run *r, const char *want) {
    return r->len == strlen(want) && memcmp(r->text, want, r->len) == 0;
}

static void test_basic(void) {
    ds41_stop_matcher *m = matcher(NULL, 0);
    run r;
    feed_all(m, (const char *[]){"Hello", ", ", "world", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "Hello, world") && r.held_after[0] == 0 && r.emitted_after[0] == 5 && !r.stopped,
              "no stop strings: every piece passes through at once");
    ds41_stop_matcher_free(m);

    const char *stops1[] = {"world"};
    m = matcher(stops1, 1);
    feed_all(m, (const char *[]){"Hello wo", "rl", "d! more", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "Hello ") && r.stopped && r.stop_index == 0 && r.held_after[0] == 2 &&
                  r.held_after[1] == 4 && r.emitted_after[0] == 6,
              "stop string across three pieces: 'wo' and 'worl' held, nothing of it or after it emitted");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"Hello wo", "rk", " done", NULL}, 1, &r);
    TAP_CHECK(emitted(&r, "Hello work done") && !r.stopped && r.emitted_after[1] == 10,
              "a partial match is released as soon as it cannot match (after reset)");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"world and more", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "") && r.stopped, "stop string at the very start: nothing emitted");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"w", "o", "r", "l", "d", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "") && r.stopped && r.held_after[3] == 4, "stop string fed byte by byte");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"hello wor", NULL}, 1, &r);
    TAP_CHECK(emitted(&r, "hello wor") && !r.stopped, "finish releases the held partial match");
    ds41_stop_output out;
    ds41_error err;
    ds41_stop_matcher_feed(m, "ld", 2, &out, &err);
    TAP_CHECK(out.len == 0, "after finish, further pieces are ignored");
    ds41_stop_matcher_free(m);

    const char *stops2[] = {"abc", "abd"};
    m = matcher(stops2, 2);
    feed_all(m, (const char *[]){"xab", "d", "tail", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "x") && r.stop_index == 1, "overlapping candidates 'abc'/'abd': 'abd' completes");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"xa", "bc", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "x") && r.stop_index == 0, "overlapping candidates: 'abc' completes");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"xab", "e", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "xabe") && !r.stopped && r.held_after[0] == 2 && r.held_after[1] == 0,
              "overlapping candidates, neither: 'ab' held, then released with 'e'");
    ds41_stop_matcher_free(m);

    const char *stops3[] = {"STOP", "END"};
    m = matcher(stops3, 2);
    feed_all(m, (const char *[]){"foo END bar STOP", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "foo ") && r.stop_index == 1,
              "several stop strings in one piece: the first to complete wins");
    ds41_stop_matcher_free(m);

    const char *stops4[] = {"abcd", "bc"};
    m = matcher(stops4, 2);
    feed_all(m, (const char *[]){"abcd", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "a") && r.stop_index == 1, "'bc' completes before 'abcd' does, so it wins");
    ds41_stop_matcher_free(m);

    const char *stops5[] = {"b", "ab", "ab"};
    m = matcher(stops5, 3);
    feed_all(m, (const char *[]){"xab", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "x") && r.stop_index == 1,
              "completing at the same byte: the longest wins ('ab' over 'b'), then the lowest index");
    ds41_stop_matcher_free(m);

    const char *stops6[] = {"aab", "abab"};
    m = matcher(stops6, 2);
    feed_all(m, (const char *[]){"aaa", "b", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "a") && r.stop_index == 0 && r.held_after[0] == 2,
              "self-overlapping prefix 'aab' in 'aaab' (only the last two a's held)");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"xaba", "bab", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "x") && r.stop_index == 1 && r.held_after[0] == 3,
              "'abab' found in 'xabab' across pieces");
    ds41_stop_matcher_free(m);

    const char *stops7[] = {"\n\nUser:"};
    m = matcher(stops7, 1);
    feed_all(m, (const char *[]){"Answer.", "\n", "\n", "Use", "r", ":", " next", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "Answer.") && r.stopped && r.held_after[3] == 5, "multi-token chat stop string");
    ds41_stop_matcher_free(m);
}

static void test_utf8(void) {
    const char *stops[] = {"\xC3\xA9!"}; /* "é!" */
    ds41_stop_matcher *m = matcher(stops, 1);
    run r;
    feed_all(m, (const char *[]){"caf", "\xC3\xA9", "!", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "caf") && r.stopped && r.held_after[1] == 2,
              "multibyte stop string: 'é' held whole, then stop");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"caf", "\xC3\xA3", "!", NULL}, 0, &r); /* "ã!" shares the lead byte */
    TAP_CHECK(emitted(&r, "caf\xC3\xA3!") && !r.stopped && r.held_after[1] == 0,
              "a character sharing the lead byte is not held");
    ds41_stop_matcher_free(m);

    const char *emoji[] = {"\xF0\x9F\x98\x80x"}; /* "😀x" */
    m = matcher(emoji, 1);
    feed_all(m, (const char *[]){"a\xF0\x9F\x98\x80", "y", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "a\xF0\x9F\x98\x80y") && r.emitted_after[0] == 1 && r.held_after[0] == 4,
              "4-byte character held as a partial match, released whole");
    ds41_stop_matcher_free(m);

    /* pieces that cut a sequence (not what the detokenizer sends, but never split on output) */
    m = matcher(NULL, 0);
    feed_all(m, (const char *[]){"a\xE2\x82", "\xAC", "b", NULL}, 1, &r);
    TAP_CHECK(emitted(&r, "a\xE2\x82\xAC"
                          "b") &&
                  r.emitted_after[0] == 1 && r.held_after[0] == 2 && r.emitted_after[1] == 4,
              "an incomplete UTF-8 sequence at the end of a piece is held until complete");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"\xE2\x82", NULL}, 1, &r);
    TAP_CHECK(emitted(&r, "\xE2\x82"), "finish releases an incomplete sequence unchanged");
    ds41_stop_matcher_reset(m);
    feed_all(m, (const char *[]){"\x80\x80\x80\x80z\xE2", "A", NULL}, 1, &r);
    TAP_CHECK(emitted(&r, "\x80\x80\x80\x80z\xE2"
                          "A") &&
                  r.emitted_after[0] == 5,
              "invalid bytes pass through unchanged");
    ds41_stop_matcher_free(m);

    const char *cjk[] = {"\xE3\x80\x82\n"}; /* "。\n" */
    m = matcher(cjk, 1);
    feed_all(m, (const char *[]){"\xE4\xBD\xA0\xE5\xA5\xBD\xE3\x80\x82", "\n\xE5\x86\x8D", NULL}, 0, &r);
    TAP_CHECK(emitted(&r, "\xE4\xBD\xA0\xE5\xA5\xBD") && r.stopped, "CJK stop string spanning two pieces");
    ds41_stop_matcher_free(m);
}

static void test_errors(void) {
    ds41_stop_matcher *m = (ds41_stop_matcher *)1;
    ds41_error err;
    const char *empty[] = {"ok", ""};
    size_t lens[2] = {2, 0};
    TAP_CHECK(ds41_stop_matcher_new(&m, empty, lens, 2, &err) != 0 && m == NULL &&
                  strstr(err.msg, "string 1"),
              "an empty stop string is refused, naming its index");
    const char *bad[] = {"\xC3("};
    size_t bad_len[1] = {2};
    TAP_CHECK(ds41_stop_matcher_new(&m, bad, bad_len, 1, &err) != 0 && strstr(err.msg, "UTF-8"),
              "an invalid UTF-8 stop string is refused");
    const char *many[DS41_STOP_MAX_STRINGS + 1];
    size_t many_len[DS41_STOP_MAX_STRINGS + 1];
    for (size_t i = 0; i <= DS41_STOP_MAX_STRINGS; i++) {
        many[i] = "x";
        many_len[i] = 1;
    }
    TAP_CHECK(ds41_stop_matcher_new(&m, many, many_len, DS41_STOP_MAX_STRINGS + 1, &err) != 0,
              "more than DS41_STOP_MAX_STRINGS stop strings are refused");
    char *huge = malloc(DS41_STOP_MAX_TOTAL_BYTES + 1);
    memset(huge, 'a', DS41_STOP_MAX_TOTAL_BYTES + 1);
    const char *hs[1] = {huge};
    size_t hl[1] = {DS41_STOP_MAX_TOTAL_BYTES + 1};
    TAP_CHECK(ds41_stop_matcher_new(&m, hs, hl, 1, &err) != 0,
              "stop strings above the byte limit are refused");
    hl[0] = 5000; /* a long stop string works */
    huge[4999] = 'b';
    ds41_stop_matcher *lm = NULL;
    int ok = ds41_stop_matcher_new(&lm, hs, hl, 1, &err) == 0;
    ds41_stop_output out = {0};
    size_t got = 0;
    for (int i = 0; ok && i < 6000 && !out.stopped; i++) {
        ds41_stop_matcher_feed(lm, i < 5999 ? "a" : "b", 1, &out, &err);
        got += out.len;
    }
    TAP_CHECK(ok && out.stopped && got == 1000, "a 5000-byte stop string matches after 1000 extra bytes");
    ds41_stop_matcher_free(lm);
    free(huge);
}

/* Reference: on the whole text, the first end offset where some stop string completes; the
 * longest there, then the lowest index. */
static size_t reference(const char *text, size_t len, const char *const *stops, size_t n, int *index) {
    *index = -1;
    for (size_t end = 1; end <= len; end++) {
        size_t best = 0;
        for (size_t k = 0; k < n; k++) {
            const size_t sl = strlen(stops[k]);
            if (sl <= end && sl > best && memcmp(text + end - sl, stops[k], sl) == 0) {
                best = sl;
                *index = (int)k;
            }
        }
        if (*index >= 0) return end - best;
    }
    return len;
}

static uint64_t next(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static void test_random(void) {
    /* small alphabet so stop strings occur and overlap often; random cuts */
    const char alphabet[] = "abcab\xC3\xA9";
    uint64_t x = 0x9E3779B97F4A7C15ull;
    int ok = 1, cases = 0;
    for (int trial = 0; trial < 3000 && ok; trial++) {
        char stop_buf[4][8];
        const char *stops[4];
        const size_t n = 1 + next(&x) % 4;
        for (size_t k = 0; k < n; k++) {
            const size_t len = 1 + next(&x) % 4;
            for (size_t j = 0; j < len; j++) stop_buf[k][j] = "abc"[next(&x) % 3];
            stop_buf[k][len] = 0;
            stops[k] = stop_buf[k];
        }
        char text[200];
        const size_t len = next(&x) % 150;
        for (size_t j = 0; j < len; j++) text[j] = alphabet[next(&x) % 5];
        if (len > 4 && next(&x) % 2) memcpy(text + len - 2, "\xC3\xA9", 2);
        text[len] = 0;
        int want_index;
        const size_t want = reference(text, len, stops, n, &want_index);
        ds41_stop_matcher *m = matcher(stops, n);
        char got[200];
        size_t got_len = 0, at = 0;
        ds41_stop_output out = {0};
        ds41_error err;
        while (at < len && !out.stopped) {
            size_t piece = 1 + next(&x) % 6;
            if (piece > len - at) piece = len - at;
            ds41_stop_matcher_feed(m, text + at, piece, &out, &err);
            memcpy(got + got_len, out.text, out.len);
            got_len += out.len;
            at += piece;
            /* invariant: emitted + held is exactly the input so far (before a stop) */
            if (!out.stopped && got_len + ds41_stop_matcher_held(m) != at) ok = 0;
        }
        if (!out.stopped) {
            ds41_stop_matcher_finish(m, &out);
            memcpy(got + got_len, out.text, out.len);
            got_len += out.len;
        }
        ok &= got_len == want && memcmp(got, text, want) == 0 && out.stop_index == want_index;
        if (!ok)
            TAP_NOTE("trial %d: text '%s' want %zu (stop %d) got %zu (stop %d)", trial, text, want,
                     want_index, got_len, out.stop_index);
        ds41_stop_matcher_free(m);
        cases++;
    }
    TAP_CHECK(
        ok, "%d random texts cut at random: same result as the whole-text reference, emitted + held = input",
        cases);
}

static void test_limits(void) {
    ds41_gen_limits lim;
    ds41_error err;
    const uint32_t eos[1] = {1};
    const uint32_t stop_ids[4] = {500, 7, 500, 9};
    TAP_CHECK(ds41_gen_limits_init(&lim, 5, eos, 1, stop_ids, 4, &err) == 0 && lim.n_stop_ids == 3,
              "limits: duplicate stop ids collapse");
    ds41_gen_verdict v1 = ds41_gen_limits_step(&lim, 42), v2 = ds41_gen_limits_step(&lim, 43);
    ds41_gen_verdict v3 = ds41_gen_limits_step(&lim, 1);
    TAP_CHECK(v1 == DS41_GEN_CONTINUE && v2 == DS41_GEN_CONTINUE && v3 == DS41_GEN_EOS &&
                  !ds41_gen_verdict_emits(v3) && lim.n_sampled == 3,
              "EOS stops without being emitted and counts as sampled");
    TAP_CHECK(ds41_gen_limits_step(&lim, 42) == DS41_GEN_EOS && lim.n_sampled == 3,
              "after a stop, further steps repeat the verdict and count nothing");
    ds41_gen_limits_init(&lim, 5, eos, 1, stop_ids, 4, &err);
    ds41_gen_limits_step(&lim, 2);
    TAP_CHECK(ds41_gen_limits_step(&lim, 9) == DS41_GEN_STOP_TOKEN, "a stop token id stops (not emitted)");
    ds41_gen_limits_init(&lim, 3, eos, 1, NULL, 0, &err);
    ds41_gen_verdict v[3];
    for (int i = 0; i < 3; i++) v[i] = ds41_gen_limits_step(&lim, 100 + (uint32_t)i);
    TAP_CHECK(v[0] == DS41_GEN_CONTINUE && v[1] == DS41_GEN_CONTINUE && v[2] == DS41_GEN_LENGTH &&
                  ds41_gen_verdict_emits(v[2]),
              "max_tokens 3: the third token is emitted with finish reason length");
    ds41_gen_limits_init(&lim, 1, eos, 1, NULL, 0, &err);
    TAP_CHECK(ds41_gen_limits_step(&lim, 1) == DS41_GEN_EOS, "EOS as the last allowed token is still a stop");
    ds41_gen_limits_init(&lim, 0, NULL, 0, NULL, 0, &err);
    int cont = 1;
    for (int i = 0; i < 100000; i++) cont &= ds41_gen_limits_step(&lim, 1) == DS41_GEN_CONTINUE;
    TAP_CHECK(cont, "max_tokens 0 and no EOS: no limit");
    uint32_t too_many[DS41_GEN_MAX_STOP_IDS + 1] = {0};
    TAP_CHECK(ds41_gen_limits_init(&lim, 1, too_many, DS41_GEN_MAX_EOS + 1, NULL, 0, &err) != 0 &&
                  ds41_gen_limits_init(&lim, 1, NULL, 0, too_many, DS41_GEN_MAX_STOP_IDS + 1, &err) != 0 &&
                  ds41_gen_limits_init(&lim, 1, NULL, 2, NULL, 0, &err) != 0,
              "too many ids or missing arrays are refused");
}

int main(void) {
    test_basic();
    test_utf8();
    test_errors();
    test_random();
    test_limits();
    return tap_done();
}
