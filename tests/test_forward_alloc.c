/* A forward call allocates nothing once the engine is warm (issue 14: the
 * engine's scratch is allocated once and reused).
 *
 * The test executable is linked with -Wl,--wrap for malloc, calloc,
 * realloc, aligned_alloc and posix_memalign, so every allocation made by
 * code linked into it (the engine, the backends, the thread pool's workers)
 * goes through the counters below.  A round of forward calls on the
 * generated tiny checkpoint (a whole prefill, a chunked prefill, a batch of
 * decodes with a prefill beside them, batched decode steps, a single decode)
 * runs twice on fresh sequences, the same shapes at the same positions: the
 * first round warms the engine up, the second must not allocate at all.  In
 * the reference mode and the fast CPU backend at its best level and at the
 * scalar level.  The KV page pool is a pool of its own (it keeps the pages
 * the first round's sequences gave back), the experts and Engram rows stay
 * resident on the mapping. */
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/scratch.h"
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the allocation counters (link-time wrappers) ---------------------------------- */

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);
int __wrap_posix_memalign(void **p, size_t align, size_t n);

/* Atomic: the thread pool's workers allocate (or must not) too. */
static atomic_bool counting;
static atomic_ulong n_allocs;

static void count(void) {
    if (atomic_load_explicit(&counting, memory_order_relaxed)) atomic_fetch_add(&n_allocs, 1);
}

void *__wrap_malloc(size_t n) {
    count();
    return __real_malloc(n);
}

void *__wrap_calloc(size_t n, size_t size) {
    count();
    return __real_calloc(n, size);
}

void *__wrap_realloc(void *p, size_t n) {
    count();
    return __real_realloc(p, n);
}

void *__wrap_aligned_alloc(size_t align, size_t n) {
    count();
    return __real_aligned_alloc(align, n);
}

int __wrap_posix_memalign(void **p, size_t align, size_t n) {
    count();
    return __real_posix_memalign(p, align, n);
}

/* ---- the scratch stack itself ------------------------------------------------------ */

/* A step's worth of nested requests: aligned, disjoint, kept while live. */
static int scratch_step(ds41_scratch *s) {
    static const size_t sizes[] = {100, 70000, 5, 1 << 20, 0, 300000};
    const ds41_scratch_mark m0 = ds41_scratch_mark_now(s);
    unsigned char *p[6];
    int ok = 1;
    for (size_t i = 0; i < 6; i++) {
        if (i == 4) {
            /* A nested frame released before the next request. */
            const ds41_scratch_mark m = ds41_scratch_mark_now(s);
            ok &= ds41_scratch_get(s, 4096) != NULL;
            ds41_scratch_release(s, m);
        }
        p[i] = ds41_scratch_get(s, sizes[i]);
        ok &= p[i] != NULL && (uintptr_t)p[i] % 64 == 0;
        if (p[i]) memset(p[i], (int)i + 1, sizes[i]);
    }
    for (size_t i = 0; i < 6 && ok; i++)
        for (size_t k = 0; k < sizes[i]; k++) ok &= p[i][k] == (unsigned char)(i + 1);
    ds41_scratch_release(s, m0);
    return ok;
}

static void check_scratch(void) {
    ds41_scratch s = {0};
    TAP_CHECK(scratch_step(&s), "scratch: buffers 64-byte aligned, disjoint, kept until released");
    TAP_CHECK(s.n == 1 && ds41_scratch_bytes(&s) == s.peak,
              "scratch: released to empty, one block as deep as the stack was (%d blocks, %zu of %zu bytes)",
              s.n, ds41_scratch_bytes(&s), s.peak);
    atomic_store(&n_allocs, 0);
    atomic_store(&counting, true);
    const int ok = scratch_step(&s);
    atomic_store(&counting, false);
    TAP_CHECK(ok && atomic_load(&n_allocs) == 0, "scratch: the same requests again allocate nothing (%lu)",
              atomic_load(&n_allocs));
    ds41_scratch_free(&s);
}

/* ---- the round of forward calls ------------------------------------------------------- */

#define N_SEQ 3
#define MAX_IDS 16

typedef struct fwd_round {
    ds41_engine *e;
    ds41_kv_seq *seq[N_SEQ];
    float *logits; /* [MAX_IDS][V] */
    unsigned long allocs[16];
    const char *what[16];
    size_t n_calls;
    int failed;
} fwd_round;

static int32_t token(size_t s, size_t i) {
    return (int32_t)((s * 131 + i * 37 + 5) % 1000);
}

/* One forward call of the items, its allocations counted. */
static void call(fwd_round *r, const char *what, ds41_fwd_item *it, size_t n) {
    ds41_error err;
    atomic_store(&n_allocs, 0);
    atomic_store(&counting, true);
    const int rc = ds41_forward(r->e, it, n, NULL, &err);
    atomic_store(&counting, false);
    if (rc != 0) {
        TAP_CHECK(0, "%s: %s", what, err.msg);
        r->failed = 1;
    }
    r->what[r->n_calls] = what;
    r->allocs[r->n_calls++] = atomic_load(&n_allocs);
}

/* Sequence s's ids from position at, n of them. */
static ds41_fwd_item item(fwd_round *r, size_t s, size_t at, size_t n, int32_t *buf, bool last_only) {
    for (size_t i = 0; i < n; i++) buf[i] = token(s, at + i);
    return (ds41_fwd_item){
        .seq = r->seq[s], .ids = buf, .n_ids = n, .logits = r->logits, .logits_last_only = last_only};
}

static void run_round(fwd_round *r) {
    int32_t a[MAX_IDS], b[MAX_IDS], c[MAX_IDS];
    ds41_fwd_item it[N_SEQ];
    it[0] = item(r, 0, 0, 11, a, false);
    call(r, "prefill of 11 tokens", it, 1);
    for (size_t at = 0; at < 11; at += 4) {
        it[0] = item(r, 1, at, at + 4 <= 11 ? 4 : 11 - at, b, true);
        call(r, "chunked prefill (4, 4, 3)", it, 1);
    }
    it[0] = item(r, 0, 11, 1, a, true);
    it[1] = item(r, 1, 11, 1, b, true);
    it[2] = item(r, 2, 0, 6, c, true);
    call(r, "two decodes and a prefill of 6 in one batch", it, 3);
    for (size_t step = 0; step < 3; step++) {
        it[0] = item(r, 0, 12 + step, 1, a, true);
        it[1] = item(r, 1, 12 + step, 1, b, true);
        it[2] = item(r, 2, 6 + step, 1, c, true);
        call(r, "a decode step of three sequences", it, 3);
    }
    it[0] = item(r, 0, 15, 1, a, true);
    call(r, "a decode step of one sequence", it, 1);
}

static void check_mode(const char *dir, const char *name, const ds41_engine_opts *o) {
    ds41_error err;
    fwd_round r = {0};
    r.e = ds41_engine_load(dir, o, &err);
    if (!TAP_CHECK(r.e != NULL, "%s: engine loads%s%s", name, r.e ? "" : ": ", r.e ? "" : err.msg)) return;
    ds41_kv_pool *pool = ds41_engine_new_pool(r.e, 0, 0, &err);
    const size_t V = (size_t)ds41_engine_config(r.e)->vocab_size;
    r.logits = malloc(MAX_IDS * V * sizeof *r.logits);
    unsigned long warm = 0, hot = 0;
    for (int pass = 0; pass < 2 && pool && r.logits && !r.failed; pass++) {
        for (size_t s = 0; s < N_SEQ; s++) r.seq[s] = ds41_kv_seq_new(pool, &err);
        r.n_calls = 0;
        run_round(&r);
        for (size_t s = 0; s < N_SEQ; s++) ds41_kv_seq_free(r.seq[s]);
        for (size_t i = 0; i < r.n_calls; i++) *(pass ? &hot : &warm) += r.allocs[i];
    }
    if (!r.failed) {
        TAP_NOTE("%s: %lu allocations in the warm-up fwd_round", name, warm);
        for (size_t i = 0; i < r.n_calls; i++)
            TAP_CHECK(r.allocs[i] == 0, "%s, warm: call %zu (%s) allocates nothing (%lu allocations)", name,
                      i, r.what[i], r.allocs[i]);
        TAP_CHECK(hot == 0, "%s: no allocation in the second round (%lu)", name, hot);
    }
    free(r.logits);
    ds41_kv_pool_free(pool);
    ds41_engine_free(r.e);
}

int main(void) {
    char root[3000], dir[4096];
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-test-forward-alloc-XXXXXX")) {
        TAP_CHECK(0, "temporary directory");
        return tap_done();
    }
    snprintf(dir, sizeof dir, "%s/tiny", root);
    ds41_model_gen_opts g = {.preset = "tiny", .seed = 3};
    ds41_error err;
    check_scratch();
    if (TAP_CHECK(ds41_model_generate(dir, &g, NULL, &err) == 0, "tiny checkpoint generated")) {
        ds41_engine_opts ref = {.reference = true};
        check_mode(dir, "reference", &ref);
        ds41_engine_opts fast = {.cpu = {.threads = 2}};
        check_mode(dir, "fast CPU backend (best level, 2 threads)", &fast);
        ds41_engine_opts scalar = {.cpu = {.threads = 2, .level = DS41_CPU_SCALAR}};
        check_mode(dir, "fast CPU backend (scalar level, 2 threads)", &scalar);
    }
    tmpdir_remove(root);
    return tap_done();
}
