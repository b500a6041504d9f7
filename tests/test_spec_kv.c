/* The KV journal (engine/model/kv_cache.h, issue 16): a sequence that ran a forward call over n
 * rows and was rewound to j of them serializes to the same bytes as a sequence that only ever
 * got those j rows, and continues with the same logits bit for bit.  Random cases: histories fed
 * in random chunks, n below and above the window (tiny: 8; long: 32), ratio-2 sources whose
 * groups the rewind cuts, 4-entry pages (a rewind across a page boundary gives pages back), forks that
 * share the pages while the journal runs (copy on write; the fork is untouched), several rewinds
 * and forwards inside one journal; fast and reference arithmetic. */
#include "engine/forward/forward.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"
#include "engine/model/pcg64.h"
#include "tap.h"
#include "tmpdir.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 12 /* above the window of 8 */
#define MAX_HIST 40
#define CASES 14

static uint32_t NV;

static uint32_t rnd(uint64_t *x, uint32_t n) {
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((*x >> 33) % n);
}

static int feed(ds41_engine *e, ds41_kv_seq *seq, const int32_t *ids, size_t n, float *logits,
                ds41_error *err) {
    ds41_fwd_item it = {.seq = seq, .ids = ids, .n_ids = n, .logits = logits};
    return ds41_forward(e, &it, 1, NULL, err);
}

/* The serialized bytes (malloc'd) of seq. */
static uint8_t *ser(const ds41_kv_seq *s, size_t *len) {
    size_t n = ds41_kv_seq_serialized_size(s);
    uint8_t *b = malloc(n);
    ds41_error err = {{0}};
    if (ds41_kv_seq_serialize(s, b, n, len, &err) != 0) {
        free(b);
        return NULL;
    }
    return b;
}

static int same_state(const ds41_kv_seq *a, const ds41_kv_seq *b) {
    size_t la = 0, lb = 0;
    uint8_t *sa = ser(a, &la), *sb = ser(b, &lb);
    int same = sa && sb && la == lb && memcmp(sa, sb, la) == 0;
    if (!same && sa && sb && la == lb)
        for (size_t i = 0; i < la; i++)
            if (sa[i] != sb[i]) {
                TAP_NOTE("first difference at byte %zu of %zu", i, la);
                break;
            }
    free(sa);
    free(sb);
    return same;
}

/* One random case; returns 1 when every check held. */
static int one_case(ds41_engine *e, ds41_kv_pool *pool, uint64_t *x, int verbose) {
    ds41_error err = {{0}};
    int32_t hist[MAX_HIST], rows[MAX_ROWS], more[2 * MAX_ROWS];
    const uint32_t h = rnd(x, MAX_HIST + 1), n = 1 + rnd(x, MAX_ROWS), j = rnd(x, n + 1);
    const uint32_t n2 = 1 + rnd(x, MAX_ROWS / 2), j2 = rnd(x, n2 + 1), m = 1 + rnd(x, 4);
    const bool fork = rnd(x, 2), twice = rnd(x, 2);
    for (uint32_t i = 0; i < h; i++) hist[i] = (int32_t)rnd(x, NV);
    for (uint32_t i = 0; i < n; i++) rows[i] = (int32_t)rnd(x, NV);
    for (uint32_t i = 0; i < 2 * MAX_ROWS; i++) more[i] = (int32_t)rnd(x, NV);
    uint32_t chunks[MAX_HIST], nc = 0;
    for (uint32_t done = 0; done < h;) {
        uint32_t c = 1 + rnd(x, h - done < 11 ? h - done : 11);
        chunks[nc++] = c;
        done += c;
    }
    float *la = malloc((size_t)2 * MAX_ROWS * NV * sizeof(float));
    float *lb = malloc((size_t)2 * MAX_ROWS * NV * sizeof(float));
    ds41_kv_seq *a = ds41_kv_seq_new(pool, &err), *b = ds41_kv_seq_new(pool, &err), *f = NULL;
    int ok = a && b && la && lb;
    for (uint32_t c = 0, at = 0; ok && c < nc; at += chunks[c++])
        ok = feed(e, a, hist + at, chunks[c], NULL, &err) == 0 &&
             feed(e, b, hist + at, chunks[c], NULL, &err) == 0;
    uint8_t *fork_bytes = NULL;
    size_t fork_len = 0;
    if (ok && fork) {
        f = ds41_kv_seq_fork(a, &err);
        fork_bytes = f ? ser(f, &fork_len) : NULL;
        ok = fork_bytes != NULL;
    }
    /* a: the n rows journaled, rewound to j (twice: rewound, fed n2 more, rewound to j + j2) */
    uint32_t keep = j;
    if (ok) ok = ds41_kv_seq_journal_begin(a, 2 * MAX_ROWS, &err) == 0;
    if (ok) ok = feed(e, a, rows, n, la, &err) == 0 && ds41_kv_seq_rewind(a, h + j, &err) == 0;
    if (ok && twice) {
        ok = feed(e, a, more, n2, la, &err) == 0 && ds41_kv_seq_rewind(a, h + j + j2, &err) == 0;
        keep = j + j2;
    }
    if (a) ds41_kv_seq_journal_end(a);
    /* b: only the kept rows */
    int32_t kept[2 * MAX_ROWS];
    for (uint32_t i = 0; i < keep; i++) kept[i] = i < j ? rows[i] : more[i - j];
    if (ok && keep) ok = feed(e, b, kept, keep, NULL, &err) == 0;
    if (!ok) {
        TAP_NOTE("case h=%u n=%u j=%u: %s", h, n, j, err.msg);
        goto out;
    }
    ok = ds41_kv_seq_tokens(a) == h + keep && same_state(a, b);
    if (!ok && verbose)
        TAP_NOTE("h=%u n=%u j=%u twice=%d n2=%u j2=%u: states differ", h, n, j, twice, n2, j2);
    /* both continue alike */
    if (ok) {
        ok = feed(e, a, more + MAX_ROWS, m, la, &err) == 0 && feed(e, b, more + MAX_ROWS, m, lb, &err) == 0 &&
             memcmp(la, lb, (size_t)m * NV * sizeof(float)) == 0 && same_state(a, b);
        if (!ok && verbose) TAP_NOTE("h=%u n=%u j=%u: continuation differs", h, n, j);
    }
    if (ok && fork) {
        size_t len = 0;
        uint8_t *now = ser(f, &len);
        ok = now && len == fork_len && memcmp(now, fork_bytes, len) == 0;
        if (!ok && verbose) TAP_NOTE("h=%u n=%u j=%u: the fork changed", h, n, j);
        free(now);
    }
out:
    free(fork_bytes);
    ds41_kv_seq_free(f);
    ds41_kv_seq_free(a);
    ds41_kv_seq_free(b);
    free(la);
    free(lb);
    return ok;
}

static void run(const char *dir, const char *what, bool reference, uint64_t seed) {
    const char *mode = reference ? "reference" : "fast";
    ds41_error err = {{0}};
    ds41_engine_opts eo = {.reference = reference, .cpu = {.threads = 2}};
    ds41_engine *e = ds41_engine_load(dir, &eo, &err);
    if (!TAP_CHECK(e != NULL, "%s %s: engine (%s)", what, mode, e ? "ok" : err.msg)) return;
    NV = (uint32_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 4, &err); /* 4 entries a page: many page boundaries */
    uint64_t x = seed;
    int passed = 0;
    for (int c = 0; c < CASES; c++) passed += one_case(e, pool, &x, 1);
    TAP_CHECK(passed == CASES,
              "%s %s: %d/%d random rewinds serialize like the never-fed sequence and continue with the same "
              "logits bit for bit",
              what, mode, passed, CASES);

    /* pages: a rewind gives back what the rejected rows took */
    ds41_kv_pool_stats st0, st1;
    ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
    int32_t ids[MAX_ROWS];
    for (int i = 0; i < MAX_ROWS; i++) ids[i] = 5 + i;
    ds41_kv_pool_get_stats(pool, &st0);
    int rc = ds41_kv_seq_journal_begin(s, MAX_ROWS, &err);
    if (rc == 0) rc = feed(e, s, ids, MAX_ROWS, NULL, &err);
    ds41_kv_pool_get_stats(pool, &st1);
    const bool grew = st1.pages_in_use > st0.pages_in_use;
    if (rc == 0) rc = ds41_kv_seq_rewind(s, 0, &err);
    ds41_kv_pool_get_stats(pool, &st1);
    TAP_CHECK(rc == 0 && grew && st1.pages_in_use == st0.pages_in_use && ds41_kv_seq_pages(s) == 0,
              "%s %s: a rewind to 0 gives every page the rows took back to the pool", what, mode);

    /* the journal's limits: a chunk beyond its room is refused before any state changes */
    rc = feed(e, s, ids, MAX_ROWS, NULL, &err);
    int32_t one = 7;
    ds41_error e2 = {{0}};
    int rc2 = rc == 0 ? feed(e, s, &one, 1, NULL, &e2) : 0;
    TAP_CHECK(rc == 0 && rc2 != 0 && strstr(e2.msg, "journal has room for 0") &&
                  ds41_kv_seq_tokens(s) == MAX_ROWS,
              "%s %s: a chunk beyond the journal's room is refused (%s)", what, mode, e2.msg);
    rc = ds41_kv_seq_rewind(s, MAX_ROWS + 1, &e2);
    TAP_CHECK(rc != 0 && strstr(e2.msg, "outside"), "%s %s: a rewind past the end is refused (%s)", what,
              mode, e2.msg);
    ds41_kv_seq_journal_end(s);
    rc = ds41_kv_seq_rewind(s, 0, &e2);
    TAP_CHECK(rc != 0 && strstr(e2.msg, "without a journal"), "%s %s: a rewind without a journal is refused",
              what, mode);
    ds41_kv_seq_free(s);
    ds41_kv_pool_free(pool);
    ds41_engine_free(e);
}

int main(void) {
    char root[512];
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-speckv-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    /* (ds41 implements compress ratios 0..2: ratio 2 is the one whose groups a rewind cuts) */
    static const char *const models[] = {"tiny", "long"};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        char dir[600];
        snprintf(dir, sizeof dir, "%s/m%zu", root, i);
        ds41_error err = {{0}};
        ds41_model_gen_opts mo = {.preset = models[i], .seed = 5 + i};
        if (!TAP_CHECK(ds41_model_generate(dir, &mo, NULL, &err) == 0, "%s checkpoint (%s)", models[i],
                       err.msg[0] ? err.msg : "ok"))
            continue;
        run(dir, models[i], false, 11 + i);
        run(dir, models[i], true, 23 + i);
    }
    tmpdir_remove(root);
    return tap_done();
}
