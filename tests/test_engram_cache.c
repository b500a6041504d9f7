/* storage/engram_cache: every gathered row is compared with the bytes the
 * checkpoint was written with, under budgets from "everything fits" down to
 * zero entries; prefetch (request) then gather, pins, eviction, statistics,
 * injected read faults and a shard truncated under the cache (clear errors
 * naming tensor and shard, the cache keeps working), and mincore() showing
 * the tables' mapped pages are never touched. */
#include "storage/engram_cache.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define RB 64
#define SB 2
static const int64_t ROWS[2] = {5003, 3001};
static uint8_t *ref_p[2], *ref_s[2];
static char dir[256];

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* Two tables (payload + scales each) in two shards, with other tensors
 * around them. */
static int write_ckpt(void) {
    ds41_error err = {{0}};
    ds41_st_writer *w = ds41_checkpoint_writer_new(dir, 0, &err);
    if (!w) return -1;
    static uint8_t pad[8192];
    const char *names[2][2] = {{"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"},
                               {"layers.3.engram.embed.weight", "layers.3.engram.embed.scale"}};
    int rc = 0;
    for (int t = 0; t < 2 && rc == 0; t++) {
        if (t) ds41_checkpoint_writer_break_shard(w);
        const int64_t pshape[2] = {ROWS[t], RB}, sshape[2] = {ROWS[t], SB}, padshape[1] = {8192};
        char padname[32];
        snprintf(padname, sizeof padname, "pad.%d", t);
        rc |= ds41_checkpoint_writer_declare(w, padname, DS41_U8, 1, padshape, &err);
        rc |= ds41_checkpoint_writer_declare(w, names[t][0], DS41_F8_E4M3, 2, pshape, &err);
        rc |= ds41_checkpoint_writer_declare(w, names[t][1], DS41_F8_E8M0, 2, sshape, &err);
    }
    rc = rc ? rc : ds41_checkpoint_writer_begin(w, &err);
    for (int t = 0; t < 2 && rc == 0; t++) {
        char padname[32];
        snprintf(padname, sizeof padname, "pad.%d", t);
        rc |= ds41_checkpoint_writer_write(w, padname, pad, sizeof pad, &err);
        rc |= ds41_checkpoint_writer_write(w, names[t][0], ref_p[t], (size_t)ROWS[t] * RB, &err);
        rc |= ds41_checkpoint_writer_write(w, names[t][1], ref_s[t], (size_t)ROWS[t] * SB, &err);
    }
    rc = rc ? rc : ds41_checkpoint_writer_finish(w, &err);
    ds41_checkpoint_writer_free(w);
    if (rc) fprintf(stderr, "%s\n", err.msg);
    return rc;
}

static ds41_engram_table_spec specs[2];

static ds41_engram_cache *make(ds41_checkpoint *ck, uint64_t budget, ds41_error *err) {
    ds41_engram_cache_opts o = {.budget_bytes = budget};
    return ds41_engram_cache_new(ck, specs, 2, &o, err);
}

/* The host allocator of the allocator test: one block, every call counted. */
typedef struct counting_alloc {
    unsigned allocs, frees;
    size_t bytes;
    void *block;
} counting_alloc;

static void *ca_alloc(void *ctx, size_t n) {
    counting_alloc *a = ctx;
    a->block = aligned_alloc(DS41_HOST_ALLOC_ALIGN,
                             (n + DS41_HOST_ALLOC_ALIGN - 1) / DS41_HOST_ALLOC_ALIGN * DS41_HOST_ALLOC_ALIGN);
    if (!a->block) return NULL;
    a->allocs++;
    a->bytes = n;
    return a->block;
}

static void ca_free(void *ctx, void *p, size_t n) {
    counting_alloc *a = ctx;
    a->frees += p == a->block && n == a->bytes;
    free(p);
}

/* Gather n random rows (with repeats) of table t; 1 when every row matches. */
static int gather_check(ds41_engram_cache *c, uint32_t t, size_t n, int64_t *rows_used, ds41_error *err) {
    int64_t *rows = malloc(n * sizeof *rows);
    uint8_t *p = malloc(n * RB), *s = malloc(n * SB);
    for (size_t k = 0; k < n; k++) rows[k] = k > 0 && rnd() % 5 == 0 ? rows[rnd() % k] : (int64_t)(rnd() % (uint64_t)ROWS[t]);
    if (rows_used) memcpy(rows_used, rows, n * sizeof *rows);
    int ok = ds41_engram_cache_gather(c, t, rows, n, p, s, err) == 0;
    for (size_t k = 0; k < n && ok; k++)
        ok = memcmp(p + k * RB, ref_p[t] + rows[k] * RB, RB) == 0 && memcmp(s + k * SB, ref_s[t] + rows[k] * SB, SB) == 0;
    free(rows);
    free(p);
    free(s);
    return ok;
}

static int gather_rows(ds41_engram_cache *c, uint32_t t, const int64_t *rows, size_t n, ds41_error *err) {
    uint8_t *p = malloc(n * RB), *s = malloc(n * SB);
    int ok = ds41_engram_cache_gather(c, t, rows, n, p, s, err) == 0;
    for (size_t k = 0; k < n && ok; k++)
        ok = memcmp(p + k * RB, ref_p[t] + rows[k] * RB, RB) == 0 && memcmp(s + k * SB, ref_s[t] + rows[k] * SB, SB) == 0;
    free(p);
    free(s);
    return ok;
}

static size_t resident_pages(const void *base, uint64_t off, uint64_t len) {
    const long pg = sysconf(_SC_PAGESIZE);
    const uint64_t a = (off + (uint64_t)pg - 1) / (uint64_t)pg * (uint64_t)pg, b = (off + len) / (uint64_t)pg * (uint64_t)pg;
    if (b <= a) return 0;
    const size_t n = (size_t)((b - a) / (uint64_t)pg);
    unsigned char *v = malloc(n);
    size_t r = 0;
    if (mincore((void *)((const char *)base + a), (size_t)(b - a), v) == 0)
        for (size_t i = 0; i < n; i++) r += v[i] & 1;
    else
        r = (size_t)-1;
    free(v);
    return r;
}

int main(void) {
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, sizeof dir, "%s/ds41_engram_cache_XXXXXX", tmp);
    if (!mkdtemp(dir)) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    for (int t = 0; t < 2; t++) {
        ref_p[t] = malloc((size_t)ROWS[t] * RB);
        ref_s[t] = malloc((size_t)ROWS[t] * SB);
        for (int64_t i = 0; i < ROWS[t] * RB; i++) ref_p[t][i] = (uint8_t)rnd();
        for (int64_t i = 0; i < ROWS[t] * SB; i++) ref_s[t][i] = (uint8_t)rnd();
    }
    if (!TAP_CHECK(write_ckpt() == 0, "checkpoint with two tables in two shards written")) return tap_done();
    ds41_error err = {{0}};
    ds41_checkpoint *ck = ds41_checkpoint_open(dir, &err);
    if (!TAP_CHECK(ck != NULL, "checkpoint opens")) return tap_done();
    specs[0] = (ds41_engram_table_spec){ds41_checkpoint_find(ck, "layers.1.engram.embed.weight"),
                                        ds41_checkpoint_find(ck, "layers.1.engram.embed.scale")};
    specs[1] = (ds41_engram_table_spec){ds41_checkpoint_find(ck, "layers.3.engram.embed.weight"),
                                        ds41_checkpoint_find(ck, "layers.3.engram.embed.scale")};
    /* The tables' pages leave the page cache, so mincore can tell whether
     * anything faults them back in through the mapping. */
    for (uint32_t i = 0; i < ds41_checkpoint_shard_count(ck); i++)
        posix_fadvise(ds41_checkpoint_shard_fd(ck, i), 0, 0, POSIX_FADV_DONTNEED);

    /* ---- construction errors */
    {
        ds41_engram_table_spec bad[2] = {specs[0], {specs[1].payload, specs[0].scale}};
        ds41_engram_cache *c = ds41_engram_cache_new(ck, bad, 2, NULL, &err);
        TAP_CHECK(!c && strstr(err.msg, "layers.3.engram.embed.weight"),
                  "tables whose payload and scales differ in rows are refused naming the tensor (%s)", err.msg);
        ds41_engram_cache_free(c);
        c = ds41_engram_cache_new(ck, specs, 0, NULL, &err);
        TAP_CHECK(!c, "zero tables are refused");
    }

    /* ---- a budget of 100 entries, gathers far larger */
    const uint64_t per = RB + SB + DS41_ENGRAM_ENTRY_OVERHEAD;
    ds41_engram_cache *c = make(ck, 100 * per + per / 2, &err);
    if (!TAP_CHECK(c != NULL, "cache created (%s)", c ? "" : err.msg)) return tap_done();
    TAP_CHECK(ds41_engram_cache_capacity(c) == 100 && ds41_engram_cache_row_bytes(c) == RB &&
                  ds41_engram_cache_scale_bytes(c) == SB,
              "capacity = budget / (row + scales + overhead) = 100");
    {
        int ok = 1;
        for (int it = 0; it < 40 && ok; it++) ok = gather_check(c, (uint32_t)(it % 2), 1 + rnd() % 400, NULL, &err);
        TAP_CHECK(ok, "40 random gathers of up to 400 rows (repeats included) with 100 entries return the written bytes%s%s",
                  ok ? "" : ": ", ok ? "" : err.msg);
        ds41_engram_cache_stats st;
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(st.uses == st.hits + st.misses && st.misses == st.prefetched_early + st.waited && st.evictions > 0 &&
                      st.entries_used == 100 && st.capacity == 100 && st.rows_read >= st.misses &&
                      st.bytes_read == st.rows_read * (RB + SB) && st.bytes_device >= st.bytes_read &&
                      st.latency_p50_ns > 0 && st.latency_p99_ns >= st.latency_p50_ns &&
                      st.latency_max_ns >= st.latency_p50_ns / 2 && st.gathers == 40,
                  "statistics add up (uses %llu = hits %llu + misses %llu, %llu evictions, %llu bytes read, "
                  "%llu from the device, p50 %llu ns, p99 %llu ns)",
                  (unsigned long long)st.uses, (unsigned long long)st.hits, (unsigned long long)st.misses,
                  (unsigned long long)st.evictions, (unsigned long long)st.bytes_read,
                  (unsigned long long)st.bytes_device, (unsigned long long)st.latency_p50_ns,
                  (unsigned long long)st.latency_p99_ns);
    }
    /* Request, let the reads land, then gather: every row was prefetched early;
     * gathering the same rows again is all hits. */
    {
        ds41_engram_cache_reset_stats(c);
        int64_t rows[60];
        for (int k = 0; k < 60; k++) rows[k] = (int64_t)(rnd() % (uint64_t)ROWS[1]);
        rows[59] = rows[3];
        int ok = ds41_engram_cache_request(c, 1, rows, 60, &err) == 0;
        usleep(20000);
        ok = ok && gather_rows(c, 1, rows, 60, &err);
        ds41_engram_cache_stats st;
        ds41_engram_cache_get_stats(c, &st);
        const uint64_t uniq = st.uses;
        TAP_CHECK(ok && st.hits + st.misses == uniq && st.prefetched_early + st.waited == st.misses && st.prefetched_early > 0 &&
                      st.bypass_reads == 0,
                  "requested rows arrive before the gather (%llu of %llu prefetched early)",
                  (unsigned long long)st.prefetched_early, (unsigned long long)uniq);
        ds41_engram_cache_unpin_all(c);
        ds41_engram_cache_reset_stats(c);
        ok = gather_rows(c, 1, rows, 60, &err);
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(ok && st.hits == uniq && st.misses == 0 && st.rows_read == 0, "a second gather of the same rows is all hits");
    }
    /* Pins: 150 requested rows, 100 entries: 50 are not read early, nothing
     * requested is evicted by the request itself, and the gather still
     * returns every row. */
    {
        ds41_engram_cache_unpin_all(c);
        ds41_engram_cache_reset_stats(c);
        int64_t rows[150];
        const int64_t base = (int64_t)(rnd() % (uint64_t)ROWS[0]);
        for (int k = 0; k < 150; k++) rows[k] = (base + 31 * k) % ROWS[0]; /* distinct */
        int ok = ds41_engram_cache_request(c, 0, rows, 150, &err) == 0;
        ds41_engram_cache_stats st;
        ds41_engram_cache_get_stats(c, &st);
        const uint64_t dropped = st.prefetch_dropped;
        ok = ok && gather_rows(c, 0, rows, 150, &err);
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(ok && dropped == 50 && st.bypass_reads == 50,
                  "a step asking for more rows than the budget: %llu not read early, read past the cache, all correct",
                  (unsigned long long)dropped);
        ds41_engram_cache_unpin_all(c);
    }
    /* Argument errors change nothing. */
    {
        int64_t bad[2] = {1, ROWS[0]};
        uint8_t p[2 * RB], s[2 * SB];
        int rc1 = ds41_engram_cache_gather(c, 0, bad, 2, p, s, &err);
        TAP_CHECK(rc1 != 0 && strstr(err.msg, "layers.1.engram.embed.weight"), "a row outside the table is refused (%s)", err.msg);
        int rc2 = ds41_engram_cache_request(c, 2, bad, 1, &err);
        TAP_CHECK(rc2 != 0, "an unknown table is refused (%s)", err.msg);
    }
    /* ---- faults */
    {
        ds41_reader *r = ds41_engram_cache_reader(c);
        ds41_engram_cache_unpin_all(c);
        int64_t rows[30];
        for (int k = 0; k < 30; k++) rows[k] = (int64_t)(rnd() % (uint64_t)ROWS[1]);
        uint8_t p[30 * RB], s[30 * SB];
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_EIO, 7, 0);
        int rc = ds41_engram_cache_gather(c, 1, rows, 30, p, s, &err);
        TAP_CHECK(rc != 0 && strstr(err.msg, "layers.3.engram.embed") && strstr(err.msg, "model-00002-of-00002.safetensors") &&
                      strstr(err.msg, "Input/output error"),
                  "an injected I/O error fails the gather naming tensor and shard: %s", err.msg);
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        TAP_CHECK(gather_rows(c, 1, rows, 30, &err), "the same gather succeeds once the fault is gone");
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_SHORT, 0, 0);
        TAP_CHECK(gather_check(c, 0, 200, NULL, &err), "short reads are continued: rows still right");
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        /* A failed prefetch nobody waits for is dropped and retried by the gather. */
        ds41_engram_cache_reset_stats(c);
        for (int k = 0; k < 30; k++) rows[k] = (int64_t)(rnd() % (uint64_t)ROWS[1]);
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_EIO, 0, 0);
        int okr = ds41_engram_cache_request(c, 1, rows, 30, &err) == 0;
        usleep(20000);
        ds41_engram_cache_poll(c, &err);
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        okr = okr && gather_rows(c, 1, rows, 30, &err);
        ds41_engram_cache_stats st;
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(okr && st.read_errors > 0, "failed prefetches are dropped and read again by the gather (%llu errors)",
                  (unsigned long long)st.read_errors);
        ds41_engram_cache_unpin_all(c);
        /* Delayed reads: the gather waits for rows in flight. */
        ds41_engram_cache_reset_stats(c);
        for (int k = 0; k < 30; k++) rows[k] = (int64_t)(rnd() % (uint64_t)ROWS[0]);
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_DELAY, 0, 30);
        okr = ds41_engram_cache_request(c, 0, rows, 30, &err) == 0;
        okr = okr && gather_rows(c, 0, rows, 30, &err);
        ds41_reader_set_fault(r, DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(okr && st.waited > 0 && st.gather_wait_ns >= 20000000ull,
                  "slow reads are waited for (%llu rows, %.1f ms)", (unsigned long long)st.waited,
                  (double)st.gather_wait_ns / 1e6);
        ds41_engram_cache_unpin_all(c);
    }
    /* ---- mincore: the mapped table pages were never touched */
    {
        ds41_reader *r = ds41_engram_cache_reader(c);
        if (!ds41_reader_file_direct(r, 0)) {
            TAP_SKIP("O_DIRECT unavailable here (%s): buffered reads fill the page cache", ds41_reader_file_direct_reason(r, 0));
        } else {
            size_t res = 0;
            for (int t = 0; t < 2; t++) {
                const ds41_tensor *tp = specs[t].payload;
                res += resident_pages(ds41_checkpoint_shard_base(ck, tp->shard), tp->file_offset, tp->nbytes);
            }
            TAP_CHECK(res == 0, "with O_DIRECT the tables' mapped pages stay out of memory (%zu resident)", res);
        }
    }
    /* ---- the exact LRU victim and the p99 rank (issue 19): fill the 100 entries with rows
     * 0..99 of table 0, touch row 0, bring in one new row: row 1 (least recently used) goes,
     * row 0 stays.  With fewer than 100 reads, p99 is the bucket of the slowest read. */
    {
        ds41_engram_cache_unpin_all(c);
        int64_t fill[100], one;
        for (int k = 0; k < 100; k++) fill[k] = k;
        int ok = gather_rows(c, 0, fill, 100, &err);
        ds41_engram_cache_unpin_all(c);
        one = 0;
        ok = ok && gather_rows(c, 0, &one, 1, &err);
        ds41_engram_cache_unpin_all(c);
        one = 100;
        ok = ok && gather_rows(c, 0, &one, 1, &err);
        ds41_engram_cache_unpin_all(c);
        ds41_engram_cache_reset_stats(c);
        one = 0;
        ok = ok && gather_rows(c, 0, &one, 1, &err);
        ds41_engram_cache_stats st;
        ds41_engram_cache_get_stats(c, &st);
        const int zero_hit = st.hits == 1;
        ds41_engram_cache_unpin_all(c);
        ds41_engram_cache_reset_stats(c);
        one = 1;
        ok = ok && gather_rows(c, 0, &one, 1, &err);
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(ok && zero_hit && st.misses == 1,
                  "LRU: after touching row 0, a new row evicts row 1 (the least recently used), not row 0");
        ds41_engram_cache_unpin_all(c);
        ds41_engram_cache_reset_stats(c);
        /* Two reads, the first held back 20 ms by the reader's fault hook: p99 of 2 samples is
         * the slower one (rank ceil(0.99 * 2) = 2), in a histogram bucket of its own. */
        int64_t two[2] = {300, 307};
        ds41_reader_set_fault(ds41_engram_cache_reader(c), DS41_READER_ANY_FILE, DS41_FAULT_DELAY, 1, 20);
        ok = gather_rows(c, 0, two, 2, &err);
        ds41_reader_set_fault(ds41_engram_cache_reader(c), DS41_READER_ANY_FILE, DS41_FAULT_NONE, 0, 0);
        ds41_engram_cache_get_stats(c, &st);
        TAP_CHECK(ok && st.rows_read == 2 && st.latency_max_ns >= 20000000ull && st.latency_p99_ns >= st.latency_max_ns,
                  "p99 of 2 reads, one delayed 20 ms, is the bucket of the slow one (%llu ns >= max %llu ns)",
                  (unsigned long long)st.latency_p99_ns, (unsigned long long)st.latency_max_ns);
        ds41_engram_cache_unpin_all(c);
    }
    ds41_engram_cache_free(c);

    /* ---- no entries at all */
    {
        ds41_engram_cache *z = make(ck, 10, &err);
        int ok = z && ds41_engram_cache_capacity(z) == 0;
        int64_t rows[50];
        ok = ok && gather_check(z, 1, 50, rows, &err) && ds41_engram_cache_request(z, 0, rows, 10, &err) == 0;
        ds41_engram_cache_stats st;
        if (z) ds41_engram_cache_get_stats(z, &st);
        TAP_CHECK(ok && st.bypass_reads == st.uses && st.hits == 0 && st.entries_used == 0,
                  "a budget below one entry reads every row straight into the output");
        ds41_engram_cache_free(z);
    }
    /* ---- everything fits: the second pass over the table is all hits */
    {
        ds41_engram_cache *big = make(ck, (uint64_t)(ROWS[0] + ROWS[1]) * per, &err);
        int64_t all[5003];
        for (int64_t i = 0; i < ROWS[0]; i++) all[i] = ROWS[0] - 1 - i;
        int ok = big && gather_rows(big, 0, all, (size_t)ROWS[0], &err);
        ds41_engram_cache_reset_stats(big);
        ok = ok && gather_rows(big, 0, all, (size_t)ROWS[0], &err);
        ds41_engram_cache_stats st;
        if (big) ds41_engram_cache_get_stats(big, &st);
        TAP_CHECK(ok && st.hits == (uint64_t)ROWS[0] && st.evictions == 0, "a budget covering the table: every row of it read once, then hits");
        ds41_engram_cache_free(big);
    }
    /* ---- entries from the allocator callback (issue 15: pinned memory from a device backend) */
    {
        counting_alloc ca = {0};
        ds41_engram_cache_opts o = {.budget_bytes = 20 * per, .host_alloc = {&ca, ca_alloc, ca_free}};
        ds41_engram_cache *c3 = ds41_engram_cache_new(ck, specs, 2, &o, &err);
        TAP_CHECK(c3 && ca.allocs == 1 && ca.bytes == 20 * (RB + SB),
                  "the entries come from the allocator callback: one call of %zu bytes", ca.bytes);
        const int64_t rows[4] = {1, 9, 4, 2};
        int ok = c3 && gather_rows(c3, 0, rows, 4, &err) && gather_rows(c3, 0, rows, 4, &err);
        /* Hits are served from the callback's block: overwrite it and the next
         * gather of the same rows returns what is there now. */
        uint8_t p[4 * RB], sc[4 * SB];
        if (ok) memset(ca.block, 0xA5, ca.bytes);
        ok = ok && ds41_engram_cache_gather(c3, 0, rows, 4, p, sc, &err) == 0;
        int served = ok;
        for (size_t k = 0; k < sizeof p && served; k++) served = p[k] == 0xA5;
        for (size_t k = 0; k < sizeof sc && served; k++) served = sc[k] == 0xA5;
        TAP_CHECK(served, "gathers read the rows out of the callback's memory%s%s", ok ? "" : ": ",
                  ok ? "" : err.msg);
        ds41_engram_cache_free(c3);
        TAP_CHECK(ca.frees == 1, "free gives the entries back through the callback");
        counting_alloc none = {0};
        o = (ds41_engram_cache_opts){.budget_bytes = per / 2, .host_alloc = {&none, ca_alloc, ca_free}};
        c3 = ds41_engram_cache_new(ck, specs, 2, &o, &err);
        TAP_CHECK(c3 && ds41_engram_cache_capacity(c3) == 0 && none.allocs == 0,
                  "no entries (bypass only): no allocator call");
        ds41_engram_cache_free(c3);
    }
    /* ---- the shard is truncated under the cache */
    {
        ds41_engram_cache *c2 = make(ck, 50 * per, &err);
        const char *shard = ds41_checkpoint_shard_path(ck, specs[1].payload->shard);
        int ok = c2 && truncate(shard, (off_t)specs[1].payload->file_offset + 100 * RB) == 0;
        int64_t rows[3] = {5, 2000, 7};
        uint8_t p[3 * RB], s[3 * SB];
        int rc = ok ? ds41_engram_cache_gather(c2, 1, rows, 3, p, s, &err) : 0;
        TAP_CHECK(ok && rc != 0 && strstr(err.msg, "model-00002-of-00002.safetensors") && strstr(err.msg, "layers.3.engram.embed"),
                  "rows past the end of a truncated shard fail with a clear error: %s", err.msg);
        int64_t first[2] = {5, 7};
        TAP_CHECK(c2 && gather_rows(c2, 0, first, 2, &err), "the other shard still serves");
        ds41_engram_cache_free(c2);
    }
    ds41_checkpoint_close(ck);
    tmpdir_remove(dir);
    for (int t = 0; t < 2; t++) {
        free(ref_p[t]);
        free(ref_s[t]);
    }
    return tap_done();
}
