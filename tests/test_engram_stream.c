/* The Engram row tier in the engine (engine/forward/forward.h engram_cache_bytes,
 * ds41_engine_prefetch): on generated tiny and long checkpoints, in the
 * reference and the fast mode, logits are bit-identical with the tables
 * resident and streamed under budgets from a quarter of the tables down to
 * fewer rows than one decode step reads (prefill whole and in chunks, greedy
 * decode with the sampled token prefetched); mincore() shows the streamed
 * tables' mapped pages stay out of memory; an injected read error fails the
 * forward call naming the shard and the tensor, and the engine keeps
 * working. */
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "storage/safetensors.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static char root[3000];

#define PROMPT 21
#define STEPS 5

typedef struct trace {
    float *logits; /* [(PROMPT + STEPS)][V] */
    int32_t tok[STEPS];
} trace;

/* Prefill in chunks of `chunk`, then STEPS greedy steps; with `prefetch` the
 * sampled token's rows are requested before each step (after `pause_us`). */
static int run(ds41_engine *e, const int32_t *prompt, size_t chunk, bool prefetch, unsigned pause_us, trace *t,
               ds41_error *err) {
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq *seq = pool ? ds41_kv_seq_new(pool, err) : NULL;
    int rc = seq ? 0 : -1;
    for (size_t off = 0; off < PROMPT && rc == 0; off += chunk) {
        ds41_fwd_item it = {.seq = seq, .ids = prompt + off, .n_ids = PROMPT - off < chunk ? PROMPT - off : chunk,
                            .logits = t->logits + off * V};
        rc = ds41_forward(e, &it, 1, NULL, err);
    }
    for (size_t k = 0; k < STEPS && rc == 0; k++) {
        t->tok[k] = ds41_argmax(t->logits + (PROMPT - 1 + k) * V, V);
        if (prefetch) {
            rc = ds41_engine_prefetch(e, seq, t->tok[k], err);
            if (pause_us) usleep(pause_us);
        }
        ds41_fwd_item it = {.seq = seq, .ids = &t->tok[k], .n_ids = 1, .logits = t->logits + (PROMPT + k) * V};
        if (rc == 0) rc = ds41_forward(e, &it, 1, NULL, err);
    }
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    return rc;
}

static size_t resident_pages(const void *base, uint64_t off, uint64_t len) {
    const uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint64_t a = (off + pg - 1) / pg * pg, b = (off + len) / pg * pg;
    if (b <= a) return 0;
    const size_t n = (size_t)((b - a) / pg);
    unsigned char *v = malloc(n);
    size_t r = 0;
    if (v && mincore((void *)((const char *)base + a), (size_t)(b - a), v) == 0)
        for (size_t i = 0; i < n; i++) r += v[i] & 1;
    else
        r = (size_t)-1;
    free(v);
    return r;
}

/* Resident pages of every Engram table (payload + scales) of the checkpoint. */
static size_t table_pages(const ds41_checkpoint *ck, size_t *total) {
    size_t r = 0;
    *total = 0;
    for (size_t i = 0; i < ds41_checkpoint_tensor_count(ck); i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(ck, i);
        if (!strstr(t->name, "engram.embed.")) continue;
        r += resident_pages(ds41_checkpoint_shard_base(ck, t->shard), t->file_offset, t->nbytes);
        *total += (size_t)(t->nbytes / 4096);
    }
    return r;
}

static void drop_cache(const ds41_checkpoint *ck) {
    for (uint32_t i = 0; i < ds41_checkpoint_shard_count(ck); i++)
        posix_fadvise(ds41_checkpoint_shard_fd(ck, i), 0, 0, POSIX_FADV_DONTNEED);
}

static void make_prompt(int32_t *prompt, uint64_t seed, size_t V) {
    uint64_t r = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int i = 0; i < PROMPT; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = (int32_t)((r >> 33) % V);
    }
    prompt[15] = prompt[3]; /* a repeated n-gram: rows shared inside a step */
    prompt[16] = prompt[4];
    prompt[17] = prompt[5];
}

static void preset_checks(const char *preset, uint64_t seed) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", root, preset);
    ds41_model_gen_opts go = {.preset = preset, .seed = seed};
    ds41_error err = {{0}};
    if (!TAP_CHECK(ds41_model_generate(dir, &go, NULL, &err) == 0, "%s: checkpoint generated", preset)) {
        TAP_NOTE("%s", err.msg);
        return;
    }
    ds41_checkpoint *ck = ds41_checkpoint_open(dir, &err);
    if (!ck) {
        TAP_CHECK(0, "%s: checkpoint opens: %s", preset, err.msg);
        return;
    }
    ds41_engine_opts ro = {.reference = true};
    ds41_engine *probe = ds41_engine_load(dir, &ro, &err);
    if (!TAP_CHECK(probe != NULL, "%s: loads", preset)) {
        ds41_checkpoint_close(ck);
        return;
    }
    const ds41_model_config *c = ds41_engine_config(probe);
    const size_t V = (size_t)c->vocab_size;
    const uint64_t ehd = (uint64_t)c->engram_head_dim, entry = ehd + (ehd + 31) / 32 + DS41_ENGRAM_ENTRY_OVERHEAD;
    const uint64_t cols = (uint64_t)((c->engram_max_ngram_size - 1) * c->engram_n_heads);
    const uint64_t step_rows = cols * c->engram_layer_ids.n; /* rows one decode step reads */
    uint64_t tables = 0;
    for (size_t i = 0; i < ds41_checkpoint_tensor_count(ck); i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(ck, i);
        if (strstr(t->name, "engram.embed.")) tables += t->nbytes;
    }
    ds41_engine_free(probe);
    TAP_NOTE("%s: Engram tables %llu bytes, %llu rows per decode step, %llu bytes per entry", preset,
             (unsigned long long)tables, (unsigned long long)step_rows, (unsigned long long)entry);

    int32_t prompt[PROMPT], prompt2[PROMPT], prompt3[PROMPT];
    make_prompt(prompt, seed, V);
    make_prompt(prompt2, seed + 100, V);
    make_prompt(prompt3, seed + 200, V);

    const uint64_t budgets[3] = {tables / 4, 200 * entry, (step_rows / 2) * entry};
    const char *budget_names[3] = {"a quarter of the tables", "200 rows", "half a decode step's rows"};
    for (int mode = 0; mode < 2; mode++) {
        const char *mname = mode ? "fast" : "reference";
        ds41_engine_opts base = {.reference = mode == 0, .cpu = {.threads = 2}};
        trace want = {.logits = malloc((PROMPT + STEPS) * V * sizeof(float))};
        ds41_engine *res = ds41_engine_load(dir, &base, &err);
        int ok = res && !ds41_engine_engram_stats(res, NULL) && run(res, prompt, PROMPT, true, 0, &want, &err) == 0;
        ds41_engine_free(res);
        if (!TAP_CHECK(ok, "%s %s: resident run", preset, mname)) {
            TAP_NOTE("%s", err.msg);
            free(want.logits);
            continue;
        }
        /* Covering the whole table keeps the mapping. */
        ds41_engine_opts all = base;
        all.engram_cache_bytes = tables;
        res = ds41_engine_load(dir, &all, &err);
        TAP_CHECK(res && !ds41_engine_engram_stats(res, NULL), "%s %s: a budget covering the tables keeps them resident",
                  preset, mname);
        ds41_engine_free(res);

        for (int bi = 0; bi < 3; bi++) {
            ds41_engine_opts so = base;
            so.engram_cache_bytes = budgets[bi];
            drop_cache(ck);
            ds41_engine *st = ds41_engine_load(dir, &so, &err);
            trace got = {.logits = malloc((PROMPT + STEPS) * V * sizeof(float))};
            const size_t chunks[2] = {PROMPT, 4};
            int same = st != NULL && ds41_engine_engram_stats(st, NULL);
            for (int ci = 0; ci < 2 && same; ci++) {
                same = run(st, prompt, chunks[ci], ci == 0, 0, &got, &err) == 0 &&
                       memcmp(got.logits, want.logits, (PROMPT + STEPS) * V * sizeof(float)) == 0 &&
                       memcmp(got.tok, want.tok, sizeof got.tok) == 0;
            }
            ds41_engram_cache_stats s;
            if (st)
                ds41_engine_engram_stats(st, &s);
            else
                memset(&s, 0, sizeof s);
            TAP_CHECK(same, "%s %s: streamed under %s (%llu entries): prefill whole and in chunks of 4, %d greedy steps: "
                            "logits bit-identical to resident",
                      preset, mname, budget_names[bi], (unsigned long long)s.capacity, STEPS);
            if (!same) TAP_NOTE("%s", err.msg);
            TAP_CHECK(st && s.uses == s.hits + s.misses && s.misses == s.prefetched_early + s.waited &&
                          s.rows_read > 0 && s.read_errors == 0 && s.entries_used <= s.capacity &&
                          (bi < 2 || s.bypass_reads > 0),
                      "%s %s %s: statistics (%llu uses, %llu hits, %llu misses: %llu early, %llu waited; %llu bypass; "
                      "%llu rows read)",
                      preset, mname, budget_names[bi], (unsigned long long)s.uses, (unsigned long long)s.hits,
                      (unsigned long long)s.misses, (unsigned long long)s.prefetched_early,
                      (unsigned long long)s.waited, (unsigned long long)s.bypass_reads,
                      (unsigned long long)s.rows_read);
            if (bi == 1 && mode == 1) {
                /* The tables' pages never entered memory through the mapping. */
                ds41_reader *rd = ds41_engram_cache_reader(ds41_engine_engram_cache(st));
                size_t total = 0, pages = table_pages(ck, &total);
                if (!ds41_reader_file_direct(rd, 0))
                    TAP_SKIP("%s: O_DIRECT unavailable (%s)", preset, ds41_reader_file_direct_reason(rd, 0));
                else
                    TAP_CHECK(pages == 0 && total > 4, "%s: streamed tables: %zu of their %zu pages resident (mincore)",
                              preset, pages, total);
                /* A decode step whose rows were prefetched in time waits for none. */
                ds41_engine_engram_reset_stats(st);
                int okp = run(st, prompt2, PROMPT, true, 100000, &got, &err) == 0;
                ds41_engine_engram_stats(st, &s);
                TAP_CHECK(okp && s.misses > 0 && s.prefetched_early > 0,
                          "%s: rows prefetched with the sampled token arrive early (%llu early, %llu waited)", preset,
                          (unsigned long long)s.prefetched_early, (unsigned long long)s.waited);
                /* A read error fails the call, naming shard and tensor; then all is well again. */
                ds41_engram_cache *cache = ds41_engine_engram_cache(st);
                ds41_reader_set_fault(ds41_engram_cache_reader(cache), DS41_READER_ANY_FILE, DS41_FAULT_EIO, 0, 0);
                ds41_error ferr = {{0}};
                int frc = run(st, prompt3, PROMPT, false, 0, &got, &ferr);
                TAP_CHECK(frc != 0 && strstr(ferr.msg, "engram.embed.") && strstr(ferr.msg, ".safetensors") &&
                              strstr(ferr.msg, "layer "),
                          "%s: an Engram read error fails the forward call: %s", preset, ferr.msg);
                ds41_reader_set_fault(ds41_engram_cache_reader(cache), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
                int again = run(st, prompt, PROMPT, true, 0, &got, &err) == 0 &&
                            memcmp(got.logits, want.logits, (PROMPT + STEPS) * V * sizeof(float)) == 0;
                TAP_CHECK(again, "%s: after the fault the same engine gives the resident logits again", preset);
                int32_t bad = (int32_t)V;
                ds41_kv_pool *pool = ds41_engine_new_pool(st, 0, 0, &err);
                ds41_kv_seq *sq = pool ? ds41_kv_seq_new(pool, &err) : NULL;
                TAP_CHECK(sq && ds41_engine_prefetch(st, sq, bad, &err) != 0 && ds41_engine_prefetch(st, sq, 0, &err) == 0,
                          "%s: prefetch refuses a token outside the vocabulary (%s)", preset, err.msg);
                ds41_kv_seq_free(sq);
                ds41_kv_pool_free(pool);
            }
            free(got.logits);
            ds41_engine_free(st);
        }
        free(want.logits);
    }
    ds41_checkpoint_close(ck);
}

int main(void) {
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-test-engram-stream-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    preset_checks("tiny", 11);
    preset_checks("long", 12);
    tmpdir_remove(root);
    return tap_done();
}
