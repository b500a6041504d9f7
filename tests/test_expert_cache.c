/* The routed-expert tier (storage/expert_cache.h, engine integration in
 * engine/forward/moe.c) on generated tiny and long checkpoints:
 *  - logits are bit-identical, fast and reference modes, whether every expert
 *    is resident (mapping) or streamed with budgets of one slot (a layer's
 *    union never fits: waves), three slots, a third of the experts and one
 *    slot short of all of them, with and without next-layer prediction;
 *  - streamed experts are never touched through the mapping: the pages that
 *    hold only expert bytes are made PROT_NONE during the streamed runs (a
 *    touch would crash the test), and with O_DIRECT mincore() shows those
 *    pages did not enter the page cache;
 *  - statistics move (hits, misses, bytes, latency, predictions);
 *  - an injected read error (EIO, or a short read that must be continued)
 *    fails that forward call with a message naming the shard and tensor, and
 *    the next call on fresh sequences gives the right logits again;
 *  - budgets below one slot are refused with the minimum in the message;
 *    the budget changes at run time. */
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "storage/expert_cache.h"
#include "tests/protected_memory.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char root[3000];

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static int32_t rnd(int64_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((rng >> 33) % (uint64_t)n);
}

#define NSEQ 3
#define STEPS 5
static const size_t plen[NSEQ] = {21, 13, 7};

/* A fixed workload: three prompts prefilled in one call (all positions of the
 * first, last positions of the others), then STEPS greedy decode steps of all
 * three in one call each.  Every logit is appended to out (size
 * logits_floats()).  Returns 0, or -1 with err filled by the failing call. */
static size_t logits_floats(size_t V) {
    return (plen[0] + 2 + NSEQ * STEPS) * V;
}

static int run(ds41_engine *e, int32_t *const *prompts, float *out, ds41_error *err) {
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    int rc = -1;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq *seq[NSEQ] = {0};
    if (!pool) return -1;
    for (int s = 0; s < NSEQ; s++)
        if (!(seq[s] = ds41_kv_seq_new(pool, err))) goto out;
    ds41_fwd_item it[NSEQ];
    float *o = out;
    for (int s = 0; s < NSEQ; s++) {
        it[s] = (ds41_fwd_item){.seq = seq[s], .ids = prompts[s], .n_ids = plen[s], .logits = o,
                                .logits_last_only = s != 0};
        o += (s == 0 ? plen[0] : 1) * V;
    }
    if (ds41_forward(e, it, NSEQ, NULL, err) != 0) goto out;
    int32_t tok[NSEQ];
    float *prev[NSEQ] = {out + (plen[0] - 1) * V, out + plen[0] * V, out + (plen[0] + 1) * V};
    for (int st = 0; st < STEPS; st++) {
        for (int s = 0; s < NSEQ; s++) {
            tok[s] = ds41_argmax(prev[s], V);
            it[s] = (ds41_fwd_item){.seq = seq[s], .ids = &tok[s], .n_ids = 1, .logits = o, .logits_last_only = true};
            prev[s] = o;
            o += V;
        }
        if (ds41_forward(e, it, NSEQ, NULL, err) != 0) goto out;
    }
    rc = 0;
out:
    for (int s = 0; s < NSEQ; s++) ds41_kv_seq_free(seq[s]);
    ds41_kv_pool_free(pool);
    return rc;
}

/* Sequence A prefilled with prompt; if fail_b, a sequence B forked from A
 * (sharing its pages) runs a forward call that fails on an injected read
 * error; then A decodes STEPS greedy tokens.  A's decode logits go to out
 * [STEPS][V].  Returns 0, or -1 (err) when anything but B's call fails or
 * B's call does not fail. */
static int run_isolated(ds41_engine *e, const int32_t *prompt, size_t n, int fail_b, float *out, ds41_error *err) {
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq *a = pool ? ds41_kv_seq_new(pool, err) : NULL, *bq = NULL;
    float *lg = malloc(V * sizeof *lg);
    int rc = -1;
    if (!a || !lg) goto out;
    ds41_fwd_item it = {.seq = a, .ids = prompt, .n_ids = n, .logits = lg, .logits_last_only = true};
    if (ds41_forward(e, &it, 1, NULL, err) != 0) goto out;
    if (fail_b) {
        if (!(bq = ds41_kv_seq_fork(a, err))) goto out;
        ds41_reader_set_fault(ds41_engine_expert_reader(e), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 0, 0);
        ds41_error berr;
        ds41_fwd_item ib = {.seq = bq, .ids = prompt, .n_ids = n, .logits = NULL};
        const int brc = ds41_forward(e, &ib, 1, NULL, &berr);
        ds41_reader_set_fault(ds41_engine_expert_reader(e), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        ds41_kv_seq_free(bq);
        if (brc == 0) {
            ds41_fail(err, "B's forward call did not fail");
            goto out;
        }
    }
    for (int st = 0; st < STEPS; st++) {
        int32_t tok = ds41_argmax(lg, V);
        it = (ds41_fwd_item){.seq = a, .ids = &tok, .n_ids = 1, .logits = out + (size_t)st * V, .logits_last_only = true};
        if (ds41_forward(e, &it, 1, NULL, err) != 0) goto out;
        memcpy(lg, out + (size_t)st * V, V * sizeof *lg);
    }
    rc = 0;
out:
    ds41_kv_seq_free(a);
    ds41_kv_pool_free(pool);
    free(lg);
    return rc;
}

/* ---- the mapping's expert-only pages ----------------------------------------------- */

static size_t pages_in(const ds41_page_range *r, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    size_t t = 0;
    for (size_t i = 0; i < n; i++) t += (r[i].end - r[i].start) / pg;
    return t;
}

static int protect(const ds41_page_range *r, size_t n, int prot) {
    for (size_t i = 0; i < n; i++)
        if (mprotect((void *)r[i].start, r[i].end - r[i].start, prot) != 0) return -1;
    return 0;
}

/* Write back and drop the checkpoint files' pages from the page cache. */
static int drop_dir_cache(const char *dir) {
    char cmd[8192];
    int ok = 1;
    /* Every shard of the directory. */
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strstr(de->d_name, ".safetensors")) continue;
        snprintf(cmd, sizeof cmd, "%s/%s", dir, de->d_name);
        int fd = open(cmd, O_RDONLY);
        if (fd < 0) {
            ok = 0;
            continue;
        }
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
    closedir(d);
    return ok ? 0 : -1;
}

/* ---- the checks -------------------------------------------------------------------- */

static void test_preset(const char *dir, const char *name, int with_reference) {
    ds41_error err;
    ds41_engine_opts fo = {.cpu = {.threads = 2}};
    ds41_engine *base = ds41_engine_load(dir, &fo, &err);
    if (!TAP_CHECK(base, "%s: resident engine loads", name)) {
        TAP_NOTE("%s", err.msg);
        return;
    }
    const ds41_model_config *c = ds41_engine_config(base);
    const size_t V = (size_t)c->vocab_size, NF = logits_floats(V);
    int32_t *prompts[NSEQ];
    for (int s = 0; s < NSEQ; s++) {
        prompts[s] = malloc(plen[s] * sizeof(int32_t));
        for (size_t i = 0; i < plen[s]; i++) prompts[s][i] = rnd(c->vocab_size);
    }
    float *want = malloc(NF * sizeof *want), *got = malloc(NF * sizeof *got);
    float *want_ref = malloc(NF * sizeof *want_ref);
    TAP_CHECK(!ds41_engine_experts_streamed(base), "%s: no budget = all experts resident", name);
    int ok = run(base, prompts, want, &err) == 0;
    TAP_CHECK(ok, "%s: resident run", name);
    ds41_engine_free(base);
    if (with_reference) {
        ds41_engine_opts ro = {.reference = true};
        ds41_engine *ref = ds41_engine_load(dir, &ro, &err);
        TAP_CHECK(ref && run(ref, prompts, want_ref, &err) == 0, "%s: resident reference run", name);
        ds41_engine_free(ref);
    }

    uint64_t slot = 0, total = 0;
    {
        ds41_engine_opts o = fo;
        o.expert_cache_bytes = 1; /* below one slot */
        ds41_engine *e = ds41_engine_load(dir, &o, &err);
        TAP_CHECK(!e && strstr(err.msg, "below one expert slot") && strstr(err.msg, "minimum"),
                  "%s: a budget below one slot is refused: %s", name, e ? "(loaded)" : err.msg);
        const char *m = strstr(err.msg, "the minimum is ");
        if (m) slot = strtoull(m + 15, NULL, 10);
        ds41_engine_free(e);
    }
    {
        ds41_engine_opts o = fo;
        o.expert_cache_bytes = slot;
        ds41_engine *e = ds41_engine_load(dir, &o, &err);
        ds41_expert_cache_stats st;
        if (e) ds41_engine_expert_stats(e, &st, false);
        total = e ? st.total_bytes : 0;
        TAP_CHECK(e && ds41_engine_experts_streamed(e) && st.slots == 1 && st.slot_bytes == slot,
                  "%s: one-slot budget (%" PRIu64 " bytes): streamed, 1 slot, %" PRIu64 " bytes of experts", name,
                  slot, total);
        ds41_engine_free(e);
    }

    /* Budgets: 1 slot (waves everywhere), 3 slots (under one layer's union),
     * a third of the experts, one slot short of all; prediction off, early
     * (the default), next layer, both, early with 3 candidates more than the
     * top k per token. */
    const uint64_t budgets[4] = {slot, 3 * slot, total / 3, total - 1};
    const char *bname[4] = {"1 slot", "3 slots", "a third", "all but one"};
    static const char *const pname[5] = {"off", "on (early)", "on (next layer)", "on (early + next layer)",
                                         "on (early, top k + 3)"};
    static const ds41_expert_predict pmode[5] = {DS41_XPREDICT_DEFAULT, DS41_XPREDICT_DEFAULT, DS41_XPREDICT_NEXT,
                                                 DS41_XPREDICT_BOTH, DS41_XPREDICT_EARLY};
    for (int bi = 0; bi < 4; bi++)
        for (int pred = 4; pred >= 0; pred--) {
            ds41_engine_opts o = fo;
            o.expert_cache_bytes = budgets[bi];
            o.expert_no_predict = !pred;
            o.expert_predict = pmode[pred];
            o.expert_predict_extra = pred == 4 ? 3 : 0;
            ds41_engine *e = ds41_engine_load(dir, &o, &err);
            if (!e) {
                TAP_CHECK(0, "%s: load with budget %s: %s", name, bname[bi], err.msg);
                continue;
            }
            size_t nr = 0;
            ds41_page_range *pages = ds41_engine_expert_only_pages(e, &nr);
            const int prot_ok = protect(pages, nr, PROT_NONE) == 0;
            memset(got, 0, NF * sizeof *got);
            const int rrc = run(e, prompts, got, &err);
            protect(pages, nr, PROT_READ);
            ds41_expert_cache_stats st;
            ds41_engine_expert_stats(e, &st, false);
            TAP_CHECK(rrc == 0 && prot_ok && memcmp(got, want, NF * sizeof *got) == 0,
                      "%s: streamed, budget %s (%" PRIu64 " slots), prediction %s: logits bit-identical to resident "
                      "(%zu expert-only pages PROT_NONE during the run)%s%s",
                      name, bname[bi], st.slots, pname[pred], pages_in(pages, nr), rrc ? ": " : "",
                      rrc ? err.msg : "");
            /* With 3 extra candidates of tiny's 8 experts every use may be predicted: no miss left. */
            TAP_CHECK(st.requests > 0 && (st.misses > 0 || (pred == 4 && st.prefetch_hits > 0)) &&
                          st.bytes_read >= st.misses * 1 && st.bytes_used > 0 && st.bytes_used <= st.bytes_read &&
                          st.prefetch_inflight <= st.prefetch_hits &&
                          st.latency_p50_ns > 0 &&
                          st.latency_p99_ns >= st.latency_p50_ns && st.requests == st.hits + st.prefetch_hits + st.misses &&
                          (bi > 0 || st.waves > 0) && (!pred ? st.predicted == 0 : bi < 2 || st.predicted > 0) &&
                          st.predicted_used <= st.predicted,
                      "%s: budget %s, prediction %s: stats requests %" PRIu64 " hits %" PRIu64 " prefetch hits %" PRIu64
                      " misses %" PRIu64 " waves %" PRIu64 " bytes %" PRIu64 " (used %" PRIu64 ") p50 %" PRIu64 " ns p99 %" PRIu64
                      " ns predicted %" PRIu64 " used %" PRIu64,
                      name, bname[bi], pname[pred], st.requests, st.hits, st.prefetch_hits, st.misses, st.waves,
                      st.bytes_read, st.bytes_used, st.latency_p50_ns, st.latency_p99_ns, st.predicted, st.predicted_used);
            free(pages);
            ds41_engine_free(e);
        }

    /* Reference mode, streamed with waves and with a third. */
    if (with_reference)
        for (int bi = 0; bi < 3; bi += 2) {
            ds41_engine_opts o = {.reference = true, .expert_cache_bytes = budgets[bi]};
            ds41_engine *e = ds41_engine_load(dir, &o, &err);
            const int rrc = e ? run(e, prompts, got, &err) : -1;
            TAP_CHECK(rrc == 0 && memcmp(got, want_ref, NF * sizeof *got) == 0,
                      "%s: reference mode, streamed with budget %s: logits bit-identical to resident reference%s%s",
                      name, bname[bi], rrc ? ": " : "", rrc ? err.msg : "");
            ds41_engine_free(e);
        }

    /* mincore: with O_DIRECT the streamed experts never enter the page cache. */
    {
        ds41_engine_opts o = fo;
        o.expert_cache_bytes = budgets[2];
        ds41_engine *e = ds41_engine_load(dir, &o, &err);
        ds41_expert_cache_stats st;
        if (e) ds41_engine_expert_stats(e, &st, false);
        if (!e) {
            TAP_CHECK(0, "%s: load for mincore: %s", name, err.msg);
        } else if (!st.direct) {
            TAP_SKIP("%s: mincore check: the file system refuses O_DIRECT here", name);
        } else {
            size_t nr = 0;
            ds41_page_range *pages = ds41_engine_expert_only_pages(e, &nr);
            const int dropped = drop_dir_cache(dir) == 0;
            const size_t before = (size_t)ds41_page_ranges_resident(pages, nr);
            const int rrc = run(e, prompts, got, &err);
            const size_t after = (size_t)ds41_page_ranges_resident(pages, nr);
            ds41_engine_expert_stats(e, &st, false);
            TAP_CHECK(dropped && rrc == 0 && st.bytes_read > 0 && after <= before,
                      "%s: O_DIRECT reads of %" PRIu64 " expert bytes left the page cache alone: %zu of %zu "
                      "expert-only pages resident before, %zu after",
                      name, st.bytes_read, before, pages_in(pages, nr), after);
            free(pages);
        }
        ds41_engine_free(e);
    }

    /* Faults: EIO, then a short read (continued by the reader: no error).
     * Without prediction the third read is one the step needs; with it, a
     * failed read of a predicted expert the layer does not use is dropped
     * silently (and a used one is read again), so every read fails there. */
    for (int pred = 0; pred < 2; pred++) {
        ds41_engine_opts o = fo;
        o.expert_cache_bytes = 3 * slot;
        o.expert_no_predict = !pred;
        ds41_engine *e = ds41_engine_load(dir, &o, &err);
        ds41_reader *r = e ? ds41_engine_expert_reader(e) : NULL;
        if (TAP_CHECK(e && r, "%s: streamed engine for fault injection (prediction %s)", name, pred ? "on" : "off")) {
            ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_EIO, pred ? 0 : 3, 0);
            const int rrc = run(e, prompts, got, &err);
            ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
            TAP_CHECK(rrc != 0 && strstr(err.msg, "layers.") && strstr(err.msg, ".ffn.experts.") &&
                          strstr(err.msg, ".safetensors") && strstr(err.msg, "Input/output error"),
                      "%s: an injected EIO (prediction %s) fails the forward call naming shard and tensor: %s", name,
                      pred ? "on" : "off", rrc ? err.msg : "(no error)");
            ds41_expert_cache_stats st;
            ds41_engine_expert_stats(e, &st, false);
            TAP_CHECK(st.read_errors >= 1, "%s: read error counted (%" PRIu64 ", prediction %s)", name, st.read_errors, pred ? "on" : "off");
            const int rc2 = run(e, prompts, got, &err);
            TAP_CHECK(rc2 == 0 && memcmp(got, want, NF * sizeof *got) == 0,
                      "%s: after the fault (prediction %s), fresh sequences give the resident logits again%s%s", name, pred ? "on" : "off",
                      rc2 ? ": " : "", rc2 ? err.msg : "");
            ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_SHORT, 0, 0);
            const int rc3 = run(e, prompts, got, &err);
            ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
            TAP_CHECK(rc3 == 0 && memcmp(got, want, NF * sizeof *got) == 0,
                      "%s: every read short (continued, prediction %s): logits still bit-identical%s%s", name, pred ? "on" : "off", rc3 ? ": " : "",
                      rc3 ? err.msg : "");
        }
        /* A failed call leaves other sequences intact: A, then B forked from
         * A failing (every expert read fails), then A decodes as if alone. */
        if (e && pred) {
            const size_t V2 = V;
            float *ra = malloc(STEPS * V2 * sizeof *ra), *rb = malloc(STEPS * V2 * sizeof *rb);
            /* Drop cached experts so B's call must read (and fail). */
            int okf = ds41_engine_set_expert_budget(e, 3 * slot, &err) == 0 &&
                      run_isolated(e, prompts[0], plen[0], 0, ra, &err) == 0 &&
                      ds41_engine_set_expert_budget(e, 3 * slot + 1, &err) == 0 &&
                      run_isolated(e, prompts[0], plen[0], 1, rb, &err) == 0;
            TAP_CHECK(okf && memcmp(ra, rb, STEPS * V2 * sizeof *ra) == 0,
                      "%s: a forward call failing on expert reads for a sequence forked from A leaves A intact: A's "
                      "decode logits bit-identical%s%s",
                      name, okf ? "" : ": ", okf ? "" : err.msg);
            free(ra);
            free(rb);
        }
        /* Run-time budget changes: resident, streamed, resized. */
        if (e && pred) {
            int okb = ds41_engine_set_expert_budget(e, 0, &err) == 0 && !ds41_engine_experts_streamed(e);
            okb = okb && run(e, prompts, got, &err) == 0 && memcmp(got, want, NF * sizeof *got) == 0;
            okb = okb && ds41_engine_set_expert_budget(e, 2 * slot, &err) == 0 && ds41_engine_experts_streamed(e);
            okb = okb && run(e, prompts, got, &err) == 0 && memcmp(got, want, NF * sizeof *got) == 0;
            okb = okb && ds41_engine_set_expert_budget(e, total / 2, &err) == 0;
            ds41_expert_cache_stats st;
            ds41_engine_expert_stats(e, &st, false);
            okb = okb && st.budget_bytes == total / 2 && st.slots == total / 2 / slot;
            okb = okb && run(e, prompts, got, &err) == 0 && memcmp(got, want, NF * sizeof *got) == 0;
            const int refused = ds41_engine_set_expert_budget(e, slot - 1, &err) != 0 && ds41_engine_experts_streamed(e);
            TAP_CHECK(okb && refused,
                      "%s: budget changed at run time (resident -> 2 slots -> half): same logits; below a slot "
                      "refused, old pool kept",
                      name);
        }
        ds41_engine_free(e);
    }
    (void)ok;
    for (int s = 0; s < NSEQ; s++) free(prompts[s]);
    free(want);
    free(got);
    free(want_ref);
}

/* The cache's own contract, on the tiny checkpoint: arguments checked, the
 * policy (LFU with aging keeps a popular expert that LRU would evict),
 * waves (more experts than slots: hits pinned first), prediction pins. */
static void test_api(const char *dir) {
    ds41_error err;
    ds41_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    ds41_checkpoint *ck = NULL;
    ds41_expert_cache *xc = NULL;
    if (!TAP_CHECK(ds41_model_config_load(dir, &cfg, &err) == 0 && (ck = ds41_checkpoint_open(dir, &err)),
                   "api: config and checkpoint open"))
        goto out;
    uint64_t slot = 0, total = 0;
    const int grc = ds41_expert_cache_geometry(ck, &cfg, &slot, &total, &err);
    TAP_CHECK(grc == 0 && slot > 0 && total >= 80 * slot / 2,
              "api: geometry: slot %" PRIu64 " bytes, %" PRIu64 " bytes of experts", slot, total);
    ds41_expert_cache_opts o = {.budget_bytes = 3 * slot};
    xc = ds41_expert_cache_new(ck, &cfg, &o, &err);
    if (!TAP_CHECK(xc && ds41_expert_cache_slots(xc) == 3, "api: 3-slot cache")) goto out;
    uint8_t got[8];
    ds41_expert_view v[8];
    const int32_t bad[1] = {8};
    TAP_CHECK(ds41_expert_cache_acquire(xc, 0, bad, 1, got, &err) < 0 && strstr(err.msg, "out of range"),
              "api: expert out of range refused: %s", err.msg);
    TAP_CHECK(ds41_expert_cache_acquire(xc, 99, bad, 0, got, &err) < 0 && strstr(err.msg, "layer 99"),
              "api: layer out of range refused: %s", err.msg);
    /* Expert 0 used five times, then 1, 2, 3 once each: LRU would evict 0 at 3. */
    int ok = 1;
    const int32_t seq[8] = {0, 0, 0, 0, 0, 1, 2, 3};
    for (int i = 0; i < 8 && ok; i++) {
        ok = ds41_expert_cache_acquire(xc, 0, &seq[i], 1, got, &err) == 1 &&
             ds41_expert_cache_wait(xc, 0, &seq[i], 1, got, v, &err) == 0;
        ds41_expert_cache_release(xc, 0, &seq[i], 1, got);
    }
    ds41_expert_cache_stats st;
    ds41_expert_cache_get_stats(xc, &st, true);
    const int32_t zero[1] = {0};
    ok = ok && ds41_expert_cache_acquire(xc, 0, zero, 1, got, &err) == 1;
    ds41_expert_cache_release(xc, 0, zero, 1, got);
    ds41_expert_cache_get_stats(xc, &st, true);
    TAP_CHECK(ok && st.hits == 1 && st.misses == 0, "api: LFU keeps the popular expert 0 through 1, 2, 3 (hits %" PRIu64
              ", misses %" PRIu64 ")", st.hits, st.misses);
    /* Five experts, three slots: hits (0 and 3 are cached) pinned first. */
    const int32_t five[5] = {1, 2, 3, 4, 0};
    const long p = ds41_expert_cache_acquire(xc, 0, five, 5, got, &err);
    TAP_CHECK(p == 3 && got[2] && got[4] && got[0] + got[1] + got[3] == 1,
              "api: 5 experts on 3 slots: 3 pinned, the cached 3 and 0 among them (%d%d%d%d%d)", got[0], got[1],
              got[2], got[3], got[4]);
    TAP_CHECK(ds41_expert_cache_wait(xc, 0, five, 5, got, v, &err) == 0 && v[2].w[0] && v[4].s[2],
              "api: views of the pinned experts");
    TAP_CHECK(ds41_expert_cache_set_budget(xc, 4 * slot, &err) != 0 && strstr(err.msg, "pinned"),
              "api: no resize while pinned: %s", err.msg);
    ds41_expert_cache_release(xc, 0, five, 5, got);
    /* Prediction: layer 1's experts 5 and 6 loaded early, then used. */
    const int32_t pr[2] = {5, 6};
    TAP_CHECK(ds41_expert_cache_predict(xc, 1, pr, 2) == 2, "api: prediction loads 2 experts of layer 1");
    ok = ds41_expert_cache_acquire(xc, 1, pr, 2, got, &err) == 2 && ds41_expert_cache_wait(xc, 1, pr, 2, got, v, &err) == 0;
    ds41_expert_cache_release(xc, 1, pr, 2, got);
    ds41_expert_cache_end_step(xc);
    ds41_expert_cache_get_stats(xc, &st, false);
    TAP_CHECK(ok && st.predicted == 2 && st.predicted_used == 2 && st.prefetch_hits == 2,
              "api: predicted 2, used 2, prefetch hits %" PRIu64, st.prefetch_hits);
    /* Two predictions for one layer (early + next) count each expert once. */
    const int32_t pr2[3] = {1, 2, 3};
    ds41_expert_cache_get_stats(xc, &st, true);
    ok = ds41_expert_cache_predict(xc, 2, pr2, 2) == 2 && ds41_expert_cache_predict(xc, 2, pr2, 3) == 3;
    ok = ok && ds41_expert_cache_acquire(xc, 2, pr2, 1, got, &err) == 1;
    ds41_expert_cache_release(xc, 2, pr2, 1, got);
    ds41_expert_cache_end_step(xc);
    ds41_expert_cache_get_stats(xc, &st, true);
    TAP_CHECK(ok && st.predicted == 3 && st.predicted_used == 1,
              "api: predictions {1,2} then {1,2,3} for one layer: 3 predicted, 1 used (%" PRIu64 ", %" PRIu64 ")",
              st.predicted, st.predicted_used);
    /* wait_some: the experts as they arrive, each once, the same views as wait. */
    {
        const int32_t three[3] = {0, 1, 2};
        uint8_t done[3] = {0, 0, 0};
        ds41_expert_view vs[3], vw[3];
        memset(vs, 0, sizeof vs);
        long total_new = 0, calls = 0, bad_calls = 0;
        int wok = ds41_expert_cache_acquire(xc, 3, three, 3, got, &err) == 3;
        const long polled = wok ? ds41_expert_cache_wait_some(xc, 3, three, 3, got, done, 0, vs, &err) : -1;
        wok = wok && polled >= 0 && polled <= 3;
        total_new = polled > 0 ? polled : 0;
        while (wok && total_new < 3 && calls++ < 10) {
            const long k = ds41_expert_cache_wait_some(xc, 3, three, 3, got, done, 1, vs, &err);
            if (k < 1) bad_calls++;
            total_new += k > 0 ? k : 0;
        }
        const long again = ds41_expert_cache_wait_some(xc, 3, three, 3, got, done, 1, vs, &err);
        wok = wok && bad_calls == 0 && total_new == 3 && done[0] && done[1] && done[2] && again == 0 &&
              ds41_expert_cache_wait(xc, 3, three, 3, got, vw, &err) == 0 && memcmp(vs, vw, sizeof vs) == 0;
        ds41_expert_cache_release(xc, 3, three, 3, got);
        TAP_CHECK(wok, "api: wait_some hands each of 3 loading experts out once (%ld at the first poll), then 0; "
                       "views = wait's%s%s",
                  polled, wok ? "" : ": ", wok ? "" : err.msg);
        /* A failed read: wait_some names the tensor; the experts stay pinned. */
        ds41_reader_set_fault(ds41_expert_cache_reader(xc), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 0, 0);
        const int32_t two[2] = {0, 1};
        uint8_t done2[2] = {0, 0};
        const long pin2 = ds41_expert_cache_acquire(xc, 4, two, 2, got, &err);
        const long k2 = pin2 == 2 ? ds41_expert_cache_wait_some(xc, 4, two, 2, got, done2, 2, vs, &err) : 0;
        ds41_reader_set_fault(ds41_expert_cache_reader(xc), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        TAP_CHECK(pin2 == 2 && k2 < 0 && strstr(err.msg, "layers.4.ffn.experts.0.") && strstr(err.msg, "Input/output"),
                  "api: wait_some on a failed read: %s", k2 < 0 ? err.msg : "(no error)");
        ds41_expert_cache_release(xc, 4, two, 2, got);
        /* Released failed slots are dropped: the same experts read fine now. */
        memset(done2, 0, sizeof done2);
        const int ok2 = ds41_expert_cache_acquire(xc, 4, two, 2, got, &err) == 2 &&
                        ds41_expert_cache_wait_some(xc, 4, two, 2, got, done2, 2, vs, &err) == 2;
        ds41_expert_cache_release(xc, 4, two, 2, got);
        TAP_CHECK(ok2, "api: after the failure the experts are read again%s%s", ok2 ? "" : ": ", ok2 ? "" : err.msg);
        /* A predicted read that fails is read again when the layer needs the
         * expert (whether the failure arrived before the acquire or while
         * waiting): wait and wait_some succeed; the error is counted. */
        for (int variant = 0; variant < 2; variant++) {
            const int layer = 5 + variant;
            const int32_t one[1] = {3};
            uint8_t done1[1] = {0};
            ds41_expert_cache_stats s0, s1;
            ds41_expert_cache_get_stats(xc, &s0, false);
            ds41_reader_set_fault(ds41_expert_cache_reader(xc), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 1, 0);
            int okp = ds41_expert_cache_predict(xc, layer, one, 1) == 1 &&
                      ds41_expert_cache_acquire(xc, layer, one, 1, got, &err) == 1;
            okp = okp && (variant == 0 ? ds41_expert_cache_wait(xc, layer, one, 1, got, vs, &err) == 0
                                       : ds41_expert_cache_wait_some(xc, layer, one, 1, got, done1, 1, vs, &err) == 1);
            ds41_reader_set_fault(ds41_expert_cache_reader(xc), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
            ds41_expert_cache_release(xc, layer, one, 1, got);
            ds41_expert_cache_end_step(xc);
            ds41_expert_cache_get_stats(xc, &s1, false);
            TAP_CHECK(okp && s1.read_errors == s0.read_errors + 1,
                      "api: a failed predicted read is read again on demand: %s succeeds (read errors +%" PRIu64 ")%s%s",
                      variant == 0 ? "wait" : "wait_some", s1.read_errors - s0.read_errors, okp ? "" : ": ",
                      okp ? "" : err.msg);
        }
    }
out:
    ds41_expert_cache_free(xc);
    ds41_checkpoint_close(ck);
    ds41_model_config_free(&cfg);
}

/* ---- a device-like slot memory ----------------------------------------------------- */

/* The device-like slot memory is tests/protected_memory.h: regions the host
 * cannot touch outside the memory's own calls, so a cache that dereferences
 * its twin pool faults; it counts uploads and calls on memory it did not hand
 * out (foreign), and a cache has no business copying inside the twin pool. */
static uint64_t pm_bad(const protected_memory *pm) {
    return pm->foreign + pm->copies + pm->copies_2d + (pm->bad_free ? 1 : 0);
}

/* Pinned expert (L, ex) of the twin cache, its view v: every tensor lies in
 * the twin pool and, downloaded through the memory, equals the checkpoint's
 * bytes and the host-path cache hx's view of the same expert.  Returns 1 when
 * all six do. */
static int twin_view_ok(const ds41_memory *m, ds41_expert_cache *hx, const ds41_checkpoint *ck, int L,
                        int32_t ex, const ds41_expert_view *v) {
    protected_memory *t = m->ctx;
    ds41_error err;
    uint8_t hgot = 0;
    ds41_expert_view hv;
    if (ds41_expert_cache_acquire(hx, L, &ex, 1, &hgot, &err) != 1 ||
        ds41_expert_cache_wait(hx, L, &ex, 1, &hgot, &hv, &err) != 0) {
        TAP_NOTE("host path: %s", err.msg);
        return 0;
    }
    int ok = 1;
    for (int k = 0; k < 6 && ok; k++) {
        char name[128];
        snprintf(name, sizeof name, "layers.%d.ffn.experts.%d.w%d.%s", L, (int)ex, k / 2 + 1,
                 k % 2 ? "scale" : "weight");
        const ds41_tensor *tt = ds41_checkpoint_find(ck, name);
        const uint8_t *dev = k % 2 ? v->s[k / 2] : v->w[k / 2], *host = k % 2 ? hv.s[k / 2] : hv.w[k / 2];
        uint8_t *buf = tt ? malloc(tt->nbytes) : NULL;
        const uint64_t bad0 = pm_bad(t);
        if (!buf || !protected_memory_owns(t, dev, tt->nbytes)) {
            ok = 0;
        } else {
            m->download(m, buf, dev, tt->nbytes);
            ok = pm_bad(t) == bad0 && memcmp(buf, host, tt->nbytes) == 0 &&
                 memcmp(buf, tt->data, tt->nbytes) == 0;
        }
        if (!ok)
            TAP_NOTE("twin view of %s: %s", name, buf ? "not in the twin pool or wrong bytes" : "missing");
        free(buf);
    }
    ds41_expert_cache_release(hx, L, &ex, 1, &hgot);
    return ok;
}

/* Acquire experts[0..n) of layer L in dx, wait (wait_some when some), check
 * the views (twin_view_ok), release; waves until all are done.  Returns 1
 * when every wave pinned something and every view was right. */
static int twin_round(const ds41_memory *m, ds41_expert_cache *dx, ds41_expert_cache *hx,
                      const ds41_checkpoint *ck, int L, const int32_t *experts, size_t n, int some,
                      ds41_error *err) {
    uint8_t got[8], done[8];
    snprintf(err->msg, sizeof err->msg, "(no message)");
    ds41_expert_view v[8];
    int32_t want[8];
    size_t nl = n;
    memcpy(want, experts, n * sizeof *want);
    while (nl) {
        const long p = ds41_expert_cache_acquire(dx, L, want, nl, got, err);
        if (p < 1) return 0;
        int ok = 1;
        if (some) {
            memset(done, 0, sizeof done);
            for (long have = 0; ok && have < p;) {
                const long k = ds41_expert_cache_wait_some(dx, L, want, nl, got, done, 1, v, err);
                ok = k >= 1;
                have += ok ? k : 0;
            }
        } else {
            ok = ds41_expert_cache_wait(dx, L, want, nl, got, v, err) == 0;
        }
        for (size_t i = 0; ok && i < nl; i++)
            if (got[i]) ok = twin_view_ok(m, hx, ck, L, want[i], &v[i]);
        ds41_expert_cache_release(dx, L, want, nl, got);
        if (!ok) return 0;
        size_t k = 0; /* the next wave: those not pinned */
        for (size_t i = 0; i < nl; i++)
            if (!got[i]) want[k++] = want[i];
        nl = k;
    }
    return 1;
}

/* The twin pool (opts.slot_memory a device-like memory) on the tiny
 * checkpoint: views in the twin with the right bytes, one upload per load
 * (hits upload nothing; a reload into the slot uploads again), waves,
 * predictions, read faults, set_budget, free. */
static void test_twin(const char *dir) {
    ds41_error err;
    ds41_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    ds41_checkpoint *ck = NULL;
    ds41_expert_cache *dx = NULL, *hx = NULL;
    protected_memory tm;
    protected_memory_init(&tm);
    const ds41_memory m = tm.mem;
    uint64_t slot = 0;
    if (!TAP_CHECK(ds41_model_config_load(dir, &cfg, &err) == 0 && (ck = ds41_checkpoint_open(dir, &err)) &&
                       ds41_expert_cache_geometry(ck, &cfg, &slot, NULL, &err) == 0,
                   "twin: config and checkpoint open"))
        goto out;
    ds41_expert_cache_opts ho = {.budget_bytes = 2 * slot, .slot_memory = &ds41_memory_host};
    ds41_expert_cache_opts xo = {.budget_bytes = 3 * slot, .slot_memory = &m};
    hx = ds41_expert_cache_new(ck, &cfg, &ho, &err);
    dx = ds41_expert_cache_new(ck, &cfg, &xo, &err);
    ds41_expert_cache_stats st, hs;
    if (!TAP_CHECK(hx && dx, "twin: caches made%s%s", hx && dx ? "" : ": ", hx && dx ? "" : err.msg))
        goto out;
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(tm.n_regions == 1 && tm.regions[0].mapped >= 3 * slot && st.slots == 3 && st.slot_memory_bytes == 3 * slot &&
                  st.budget_bytes == 3 * slot,
              "twin: 3 slots, one allocation of %" PRIu64 " bytes in the slot memory (%zu live)",
              st.slot_memory_bytes, tm.n_regions);

    const int32_t e012[3] = {0, 1, 2}, e5[5] = {0, 1, 2, 3, 4}, e56[2] = {5, 6};
    int ok = twin_round(&m, dx, hx, ck, 0, e012, 3, 0, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(
        ok && tm.uploads == 3 && st.uploads == 3 && st.bytes_uploaded == tm.upload_bytes,
        "twin: wait: 3 loads, 3 uploads, views in the twin with the checkpoint's and the host path's bytes "
        "(%" PRIu64 " uploads)%s%s",
        tm.uploads, ok ? "" : ": ", ok ? "" : err.msg);
    ok = twin_round(&m, dx, hx, ck, 0, e012, 3, 1, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && st.hits == 3 && tm.uploads == 3,
              "twin: wait_some on 3 hits: the same bytes, no upload (%" PRIu64 " hits, %" PRIu64
              " uploads)%s%s",
              st.hits, tm.uploads, ok ? "" : ": ", ok ? "" : err.msg);
    ok = twin_round(&m, dx, hx, ck, 1, e5, 5, 1, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && st.waves >= 1 && tm.uploads == 8,
              "twin: 5 experts on 3 slots in waves: each uploaded once (%" PRIu64 " waves, %" PRIu64
              " uploads)%s%s",
              st.waves, tm.uploads, ok ? "" : ": ", ok ? "" : err.msg);
    ok = ds41_expert_cache_predict(dx, 2, e56, 2) == 2 && twin_round(&m, dx, hx, ck, 2, e56, 2, 0, &err);
    ds41_expert_cache_end_step(dx);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && st.prefetch_hits == 2 && tm.uploads == 10,
              "twin: 2 predicted experts, uploaded at their use (%" PRIu64 " prefetch hits, %" PRIu64
              " uploads)%s%s",
              st.prefetch_hits, tm.uploads, ok ? "" : ": ", ok ? "" : err.msg);

    /* A failed read: reported as on the host path, nothing uploaded; the
     * next request reads and uploads again. */
    {
        const int32_t one[1] = {0};
        uint8_t got[1];
        ds41_expert_view v[1];
        const uint64_t up0 = tm.uploads;
        ds41_reader_set_fault(ds41_expert_cache_reader(dx), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 0, 0);
        const long p = ds41_expert_cache_acquire(dx, 3, one, 1, got, &err);
        const int wrc = p == 1 ? ds41_expert_cache_wait(dx, 3, one, 1, got, v, &err) : 0;
        ds41_reader_set_fault(ds41_expert_cache_reader(dx), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        ds41_expert_cache_release(dx, 3, one, 1, got);
        TAP_CHECK(p == 1 && wrc < 0 && strstr(err.msg, "layers.3.ffn.experts.0.") &&
                      strstr(err.msg, "Input/output") && tm.uploads == up0,
                  "twin: a failed read fails wait naming the tensor, nothing uploaded: %s",
                  wrc < 0 ? err.msg : "(no error)");
        ok = twin_round(&m, dx, hx, ck, 3, one, 1, 0, &err);
        TAP_CHECK(ok && tm.uploads == up0 + 1,
                  "twin: after the failure the expert is read and uploaded again%s%s", ok ? "" : ": ",
                  ok ? "" : err.msg);
        /* A predicted read that fails is read again on demand, then uploaded. */
        ds41_reader_set_fault(ds41_expert_cache_reader(dx), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 1, 0);
        const int32_t four[1] = {4};
        ok =
            ds41_expert_cache_predict(dx, 4, four, 1) == 1 && twin_round(&m, dx, hx, ck, 4, four, 1, 1, &err);
        ds41_reader_set_fault(ds41_expert_cache_reader(dx), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        ds41_expert_cache_end_step(dx);
        TAP_CHECK(ok && tm.uploads == up0 + 2,
                  "twin: a failed predicted read is read again on demand and uploaded once%s%s",
                  ok ? "" : ": ", ok ? "" : err.msg);
    }

    /* One slot: every expert reloads the same slot, so a twin not marked
     * stale by the reload would hand out the previous expert's bytes. */
    ok = ds41_expert_cache_set_budget(dx, slot, &err) == 0;
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && tm.n_regions == 1 && tm.allocs == 2 && tm.regions[0].mapped >= slot && tm.regions[0].mapped < 2 * slot &&
                  st.slot_memory_bytes == slot && st.slots == 1,
              "twin: set_budget to one slot: the twin pool reallocated (%zu live, %" PRIu64
              " allocations)%s%s",
              tm.n_regions, tm.allocs, ok ? "" : ": ", ok ? "" : err.msg);
    {
        const uint64_t up0 = tm.uploads;
        const int32_t a[1] = {0}, b[1] = {1};
        ok = 1;
        for (int i = 0; i < 4 && ok; i++) ok = twin_round(&m, dx, hx, ck, 5, i % 2 ? b : a, 1, i % 2, &err);
        TAP_CHECK(ok && tm.uploads == up0 + 4,
                  "twin: experts 0, 1, 0, 1 through one slot: each reload uploaded, views right (%" PRIu64
                  " uploads)%s%s",
                  tm.uploads - up0, ok ? "" : ": ", ok ? "" : err.msg);
    }
    const uint64_t waves0 = st.waves;
    ok = ds41_expert_cache_set_budget(dx, 4 * slot, &err) == 0 &&
         twin_round(&m, dx, hx, ck, 6, e5, 4, 0, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && tm.n_regions == 1 && tm.allocs == 3 && st.slots == 4 && st.slot_memory_bytes == 4 * slot &&
                  st.waves == waves0 && st.uploads == tm.uploads,
              "twin: set_budget to 4 slots: 4 experts in one wave, right bytes%s%s", ok ? "" : ": ",
              ok ? "" : err.msg);
    /* The slot memory full: a resize is refused naming it and the old
     * pools keep working; a new cache is refused. */
    tm.full = 1;
    const int rrc = ds41_expert_cache_set_budget(dx, 2 * slot, &err);
    TAP_CHECK(rrc != 0 && strstr(err.msg, "in protected memory"),
              "twin: slot memory full: resize refused: %s", rrc ? err.msg : "(resized)");
    ok = twin_round(&m, dx, hx, ck, 6, e5 + 1, 4, 1, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && st.slots == 4 && tm.n_regions == 1,
              "twin: after the refused resize the 4-slot pools still work%s%s", ok ? "" : ": ",
              ok ? "" : err.msg);
    ds41_expert_cache *nx = ds41_expert_cache_new(ck, &cfg, &xo, &err);
    TAP_CHECK(!nx && strstr(err.msg, "in protected memory") && tm.n_regions == 1,
              "twin: slot memory full: a new cache is refused: %s", nx ? "(made)" : err.msg);
    ds41_expert_cache_free(nx);
    tm.full = 0;
    ds41_expert_cache_get_stats(hx, &hs, false);
    TAP_CHECK(hs.slot_memory_bytes == 0 && hs.uploads == 0 && hs.bytes_uploaded == 0,
              "twin: the host path (ds41_memory_host) has no twin and uploads nothing");
    ds41_expert_cache_free(dx);
    dx = NULL;
    TAP_CHECK(tm.n_regions == 0 && pm_bad(&tm) == 0,
              "twin: free gives the twin pool back; no call on foreign memory (%" PRIu64 " bad)", pm_bad(&tm));
out:
    ds41_expert_cache_free(dx);
    ds41_expert_cache_free(hx);
    ds41_checkpoint_close(ck);
    ds41_model_config_free(&cfg);
    protected_memory_fini(&tm);
}

/* The host allocator of the tier tests: anonymous memory, every call counted. */
typedef struct counting_alloc {
    uint64_t allocs, frees, bytes_now, bytes_peak;
} counting_alloc;

static void *ca_alloc(void *ctx, size_t n) {
    counting_alloc *a = ctx;
    void *p = aligned_alloc(DS41_HOST_ALLOC_ALIGN,
                            (n + DS41_HOST_ALLOC_ALIGN - 1) / DS41_HOST_ALLOC_ALIGN * DS41_HOST_ALLOC_ALIGN);
    if (!p) return NULL;
    a->allocs++;
    a->bytes_now += n;
    if (a->bytes_now > a->bytes_peak) a->bytes_peak = a->bytes_now;
    return p;
}

static void ca_free(void *ctx, void *p, size_t n) {
    counting_alloc *a = ctx;
    a->frees++;
    a->bytes_now -= n;
    free(p);
}

/* Experts experts[0..n) of layer L acquired, waited for (twin views checked
 * against the checkpoint) and released in waves; the cache's reads,
 * host hits and uploads of the round into *reads / *host_hits / *uploads. */
static int tier_round(const ds41_memory *m, ds41_expert_cache *dx, ds41_expert_cache *hx,
                      const ds41_checkpoint *ck, int L, const int32_t *experts, size_t n, uint64_t *reads,
                      uint64_t *host_hits, uint64_t *uploads, ds41_error *err) {
    ds41_expert_cache_stats a, b;
    ds41_expert_cache_get_stats(dx, &a, false);
    const int ok = twin_round(m, dx, hx, ck, L, experts, n, L % 2, err);
    ds41_expert_cache_get_stats(dx, &b, false);
    *reads = b.reads - a.reads;
    *host_hits = b.host_hits - a.host_hits;
    *uploads = b.uploads - a.uploads;
    return ok;
}

/* A host tier of its own above the twin pool (issue 15): 2 device slots,
 * 6 host slots.  An expert evicted from the device tier comes back from the
 * host tier with an upload and no read; without the host tier (0) the same
 * workload reads it again.  Budgets, allocator calls, a read failure and
 * host-only predictions. */
static void test_host_tier(const char *dir) {
    ds41_error err;
    ds41_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    ds41_checkpoint *ck = NULL;
    ds41_expert_cache *dx = NULL, *hx = NULL, *lx = NULL;
    protected_memory tm;
    protected_memory_init(&tm);
    const ds41_memory m = tm.mem;
    counting_alloc ca = {0};
    uint64_t slot = 0;
    if (!TAP_CHECK(ds41_model_config_load(dir, &cfg, &err) == 0 && (ck = ds41_checkpoint_open(dir, &err)) &&
                       ds41_expert_cache_geometry(ck, &cfg, &slot, NULL, &err) == 0,
                   "tier: config and checkpoint open"))
        goto out;
    const ds41_host_alloc ha = {.ctx = &ca, .alloc = ca_alloc, .free = ca_free};
    ds41_expert_cache_opts ho = {.budget_bytes = 2 * slot, .slot_memory = &ds41_memory_host};
    ds41_expert_cache_opts xo = {.budget_bytes = 2 * slot,
                                 .slot_memory = &m,
                                 .host_tier_bytes = 6 * slot + slot / 2,
                                 .host_alloc = ha};
    ds41_expert_cache_opts lo = {.budget_bytes = 2 * slot, .slot_memory = &m};
    hx = ds41_expert_cache_new(ck, &cfg, &ho, &err);
    dx = hx ? ds41_expert_cache_new(ck, &cfg, &xo, &err) : NULL;
    lx = dx ? ds41_expert_cache_new(ck, &cfg, &lo, &err) : NULL;
    if (!TAP_CHECK(hx && dx && lx, "tier: caches made%s%s", lx ? "" : ": ", lx ? "" : err.msg)) goto out;
    ds41_expert_cache_stats st;
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(st.slots == 2 && st.host_slots == 6 && st.host_bytes == 6 * slot &&
                  st.host_budget_bytes == 6 * slot + slot / 2 && st.slot_memory_bytes == 2 * slot &&
                  ca.allocs == 1 && ca.bytes_now == 6 * slot,
              "tier: 2 device slots, 6 host slots (6.5 slots of budget) in one allocator call (%" PRIu64
              " host slots, %" PRIu64 " calls, %" PRIu64 " bytes)",
              st.host_slots, ca.allocs, ca.bytes_now);

    /* Experts 0,1 then 2,3 (evicting 0,1 from the device) then 0,1 again. */
    const int32_t e01[2] = {0, 1}, e23[2] = {2, 3};
    uint64_t r1 = 0, h1 = 0, u1 = 0, r2 = 0, h2 = 0, u2 = 0, r3 = 0, h3 = 0, u3 = 0;
    int ok = tier_round(&m, dx, hx, ck, 0, e01, 2, &r1, &h1, &u1, &err) &&
             tier_round(&m, dx, hx, ck, 0, e23, 2, &r2, &h2, &u2, &err) &&
             tier_round(&m, dx, hx, ck, 0, e01, 2, &r3, &h3, &u3, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(
        ok && r1 == 2 && r2 == 2 && r3 == 0 && h3 == 2 && u3 == 2 && st.misses == 6 && st.hits == 0 &&
            st.host_hits == 2 && st.evictions == 4 && tm.uploads == 6,
        "tier: 0,1 evicted from the device by 2,3 come back from the host tier: 2 uploads, no read, the "
        "checkpoint's bytes (reads %" PRIu64 "/%" PRIu64 "/%" PRIu64 ", host hits %" PRIu64
        ", uploads %" PRIu64 ")%s%s",
        r1, r2, r3, h3, u3, ok ? "" : ": ", ok ? "" : err.msg);
    /* The same workload without a host tier of its own reads 0,1 again. */
    ok = tier_round(&m, lx, hx, ck, 0, e01, 2, &r1, &h1, &u1, &err) &&
         tier_round(&m, lx, hx, ck, 0, e23, 2, &r2, &h2, &u2, &err) &&
         tier_round(&m, lx, hx, ck, 0, e01, 2, &r3, &h3, &u3, &err);
    ds41_expert_cache_get_stats(lx, &st, false);
    TAP_CHECK(
        ok && r3 == 2 && h3 == 0 && st.host_slots == 2 && st.host_budget_bytes == 0,
        "tier: without it (host_tier_bytes 0) the staging slots are the 2 device slots and 0,1 are read "
        "again (%" PRIu64 " reads)",
        r3);

    /* A failed read is reported naming the tensor; an expert the host tier
     * holds needs no read, so the same fault does not touch it. */
    {
        ds41_expert_cache_get_stats(dx, &st, true);
        const int32_t held[2] = {2, 3}, fresh[1] = {3};
        uint8_t got[2];
        ds41_expert_view v[2];
        ds41_reader_set_fault(ds41_expert_cache_reader(dx), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 0, 0);
        const long p = ds41_expert_cache_acquire(dx, 2, fresh, 1, got, &err);
        const int wrc = p == 1 ? ds41_expert_cache_wait(dx, 2, fresh, 1, got, v, &err) : 0;
        ds41_expert_cache_release(dx, 2, fresh, 1, got);
        TAP_CHECK(p == 1 && wrc < 0 && strstr(err.msg, "layers.2.ffn.experts.3.") &&
                      strstr(err.msg, "Input/output"),
                  "tier: a failed read fails wait naming the tensor: %s", wrc < 0 ? err.msg : "(no error)");
        /* Layer 0's 2 and 3 are in the host tier, not on the device. */
        const long p2 = ds41_expert_cache_acquire(dx, 0, held, 2, got, &err);
        const int w2 = p2 == 2 ? ds41_expert_cache_wait(dx, 0, held, 2, got, v, &err) : -1;
        ds41_expert_cache_release(dx, 0, held, 2, got);
        ds41_reader_set_fault(ds41_expert_cache_reader(dx), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        ds41_expert_cache_get_stats(dx, &st, false);
        TAP_CHECK(p2 == 2 && w2 == 0 && st.host_hits == 2 && st.reads == 1 && st.read_errors == 1,
                  "tier: under the same fault, experts the host tier holds are served (%" PRIu64
                  " host hits, %" PRIu64 " read errors)%s%s",
                  st.host_hits, st.read_errors, w2 == 0 ? "" : ": ", w2 == 0 ? "" : err.msg);
        ok = tier_round(&m, dx, hx, ck, 2, fresh, 1, &r1, &h1, &u1, &err);
        TAP_CHECK(ok && r1 == 1 && u1 == 1,
                  "tier: after the failure the expert is read and uploaded again%s%s", ok ? "" : ": ",
                  ok ? "" : err.msg);
    }

    /* Eight experts of layer 1 through the tiers: never more than 6 host
     * slots, LFU evictions in the host tier, no further allocation. */
    const int32_t e8[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    ok = tier_round(&m, dx, hx, ck, 1, e8, 8, &r1, &h1, &u1, &err) &&
         tier_round(&m, dx, hx, ck, 1, e8, 8, &r2, &h2, &u2, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(
        ok && r1 == 8 && u1 == 8 && r2 + h2 == u2 && u2 >= 6 && st.host_slots_used <= 6 &&
            st.host_evictions >= 2 && ca.allocs == 1 && ca.bytes_peak == 6 * slot,
        "tier: 8 experts twice through 2 device and 6 host slots: every upload a read or a host hit (%" PRIu64
        " uploads, %" PRIu64 " re-read, %" PRIu64 " from the host tier), %" PRIu64
        " host slots used, %" PRIu64 " host evictions%s%s",
        u2, r2, h2, st.host_slots_used, st.host_evictions, ok ? "" : ": ", ok ? "" : err.msg);

    /* A prediction with every device slot pinned reads into the host tier
     * only; the layer's miss then costs an upload and no read. */
    {
        const int32_t pin2[2] = {0, 1}, later[1] = {5};
        uint8_t got[2];
        ds41_expert_cache_get_stats(dx, &st, true);
        ok = ds41_expert_cache_acquire(dx, 3, pin2, 2, got, &err) == 2;
        const size_t pd = ds41_expert_cache_predict(dx, 3, later, 1);
        ds41_expert_cache_release(dx, 3, pin2, 2, got);
        ds41_expert_cache_get_stats(dx, &st, false);
        const uint64_t reads0 = st.reads;
        ok = ok && pd == 1 && st.predict_host == 1 &&
             tier_round(&m, dx, hx, ck, 3, later, 1, &r1, &h1, &u1, &err);
        ds41_expert_cache_end_step(dx);
        TAP_CHECK(ok && reads0 == 3 && r1 == 0 && h1 == 1 && u1 == 1,
                  "tier: a prediction with no device slot free is read into the host tier; its use uploads "
                  "without a read (%" PRIu64 " reads, %" PRIu64 " host hits)%s%s",
                  r1, h1, ok ? "" : ": ", ok ? "" : err.msg);
    }

    /* Device resizes keep the host tier (3 slots: 0,1 of layer 0 still
     * there); a device tier above the host tier is refused. */
    ok = ds41_expert_cache_set_budget(dx, 3 * slot, &err) == 0 &&
         tier_round(&m, dx, hx, ck, 3, e01, 2, &r1, &h1, &u1, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(ok && st.slots == 3 && st.host_slots == 6 && r1 == 0 && h1 == 2 && ca.allocs == 1,
              "tier: set_budget to 3 device slots keeps the host tier's experts (%" PRIu64 " reads)%s%s", r1,
              ok ? "" : ": ", ok ? "" : err.msg);
    const int brc = ds41_expert_cache_set_budget(dx, 7 * slot, &err);
    ds41_expert_cache_get_stats(dx, &st, false);
    TAP_CHECK(brc != 0 && strstr(err.msg, "host tier") && st.slots == 3,
              "tier: a device tier above the host tier is refused: %s", brc ? err.msg : "(resized)");
    xo.host_tier_bytes = slot;
    ds41_expert_cache *nx = ds41_expert_cache_new(ck, &cfg, &xo, &err);
    TAP_CHECK(!nx && strstr(err.msg, "host tier"), "tier: a host tier below the device tier is refused: %s",
              nx ? "(made)" : err.msg);
    ds41_expert_cache_free(nx);
    ds41_expert_cache_free(dx);
    dx = NULL;
    TAP_CHECK(ca.frees == ca.allocs && ca.bytes_now == 0 && tm.n_regions == 1 && pm_bad(&tm) == 0,
              "tier: free gives the host slots back through the allocator (%" PRIu64 " of %" PRIu64 ")",
              ca.frees, ca.allocs);
out:
    ds41_expert_cache_free(dx);
    ds41_expert_cache_free(lx);
    ds41_expert_cache_free(hx);
    ds41_checkpoint_close(ck);
    ds41_model_config_free(&cfg);
    protected_memory_fini(&tm);
}

static int make(const char *preset, uint64_t seed, char *dir_out) {
    snprintf(dir_out, 4096, "%s/%s", root, preset);
    ds41_model_gen_opts o = {.preset = preset, .seed = seed};
    ds41_error err;
    if (ds41_model_generate(dir_out, &o, NULL, &err) != 0) {
        TAP_NOTE("generate %s: %s", preset, err.msg);
        return -1;
    }
    return 0;
}

int main(void) {
    /* Beside the build (a disk file system: O_DIRECT and mincore are
     * meaningful there; /tmp may be tmpfs). */
    const char *bd = getenv("DS41_BUILD_DIR");
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/ds41-test-expert-cache-XXXXXX", bd && *bd ? bd : tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir_tiny[4096], dir_long[4096];
    if (TAP_CHECK(make("tiny", 71, dir_tiny) == 0, "tiny checkpoint generated")) {
        test_api(dir_tiny);
        test_twin(dir_tiny);
        test_host_tier(dir_tiny);
        test_preset(dir_tiny, "tiny", 1);
    }
    if (TAP_CHECK(make("long", 72, dir_long) == 0, "long checkpoint generated"))
        test_preset(dir_long, "long", getenv("DS41_SANITIZED") == NULL);
    tmpdir_remove(root);
    return tap_done();
}
