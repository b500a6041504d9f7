/* engine/threadpool: every index of a job runs exactly once, on a thread
 * index inside the pool; serial fallbacks (no pool, one thread, one chunk,
 * nested and concurrent runs); pinning; many back-to-back jobs; workers that
 * sleep between jobs wake up for the next one. */
#include "engine/backend/cpu/threadpool.h"
#include "tests/tap.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct count_job {
    _Atomic unsigned *hits;
    int n_threads;
    atomic_int bad_thread;
    atomic_int seen_thread[64];
} count_job;

static void count_task(void *p, size_t b, size_t e, int th) {
    count_job *j = p;
    if (th < 0 || th >= j->n_threads) atomic_store(&j->bad_thread, 1);
    if (th >= 0 && th < 64) atomic_store(&j->seen_thread[th], 1);
    for (size_t i = b; i < e; i++) atomic_fetch_add(&j->hits[i], 1);
}

/* Run a job of n indices in chunks of grain; 1 if every index ran once. */
static int run_once(ds41_threadpool *pool, size_t n, size_t grain, count_job *j) {
    j->hits = calloc(n ? n : 1, sizeof *j->hits);
    j->n_threads = ds41_threadpool_size(pool);
    atomic_store(&j->bad_thread, 0);
    ds41_threadpool_run(pool, n, grain, count_task, j);
    int ok = !atomic_load(&j->bad_thread);
    for (size_t i = 0; i < n; i++) ok &= atomic_load(&j->hits[i]) == 1;
    free((void *)j->hits);
    return ok;
}

/* A task that runs a nested job on the same pool. */
typedef struct nest_job {
    ds41_threadpool *pool;
    atomic_int bad;
    _Atomic unsigned total;
} nest_job;

typedef struct nest_outer {
    nest_job *inner;
    atomic_int index_mismatch;
} nest_outer;

static _Thread_local int outer_thread = -1;

static void inner_index_task(void *p, size_t b, size_t e, int th) {
    nest_outer *o = p;
    if (th != outer_thread) atomic_store(&o->index_mismatch, 1);
    atomic_fetch_add(&o->inner->total, (unsigned)(e - b));
}

static void outer_task(void *p, size_t b, size_t e, int th) {
    nest_outer *o = p;
    for (size_t i = b; i < e; i++) {
        outer_thread = th;
        ds41_threadpool_run(o->inner->pool, 10, 1, inner_index_task, o);
        outer_thread = -1;
    }
}

typedef struct conc_arg {
    ds41_threadpool *pool;
    int ok;
} conc_arg;

static void *concurrent_caller(void *p) {
    conc_arg *a = p;
    a->ok = 1;
    for (int r = 0; r < 200 && a->ok; r++) {
        count_job j;
        memset(&j, 0, sizeof j);
        a->ok = run_once(a->pool, 1000 + (size_t)r, 7, &j);
    }
    return NULL;
}

int main(void) {
    ds41_error err;
    TAP_CHECK(ds41_cpu_count() >= 1, "the machine has %d usable CPUs", ds41_cpu_count());

    const int sizes[] = {1, 2, 3, 4};
    const size_t ns[] = {0, 1, 2, 7, 64, 1000, 100003};
    const size_t grains[] = {0, 1, 3, 64, 5000};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        ds41_threadpool *pool = ds41_threadpool_new(sizes[s], false, &err);
        if (!TAP_CHECK(pool && ds41_threadpool_size(pool) == sizes[s], "a pool of %d threads starts",
                       sizes[s]))
            continue;
        int ok = 1;
        size_t bad_n = 0, bad_g = 0;
        for (size_t a = 0; a < sizeof ns / sizeof ns[0] && ok; a++)
            for (size_t g = 0; g < sizeof grains / sizeof grains[0] && ok; g++) {
                count_job j;
                memset(&j, 0, sizeof j);
                ok = run_once(pool, ns[a], grains[g], &j);
                bad_n = ns[a];
                bad_g = grains[g];
            }
        TAP_CHECK(ok,
                  "%d threads: every index of jobs of 0..100003 indices in chunks of 0..5000 runs once, on a "
                  "thread index < %d%s",
                  sizes[s], sizes[s], ok ? "" : " (failed)");
        if (!ok) TAP_NOTE("first failure: n %zu grain %zu", bad_n, bad_g);

        /* Many back-to-back small jobs (the forward pass's pattern). */
        ok = 1;
        for (int r = 0; r < 20000 && ok; r++) {
            count_job j;
            memset(&j, 0, sizeof j);
            ok = run_once(pool, 1 + (size_t)(r % 37), 1, &j);
        }
        TAP_CHECK(ok, "%d threads: 20000 back-to-back small jobs, each index once", sizes[s]);

        /* Workers that went to sleep (longer than the spin) wake for a job,
         * and a large job uses more than one thread. */
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
        count_job j;
        memset(&j, 0, sizeof j);
        ok = run_once(pool, 200000, 1, &j);
        int used = 0;
        for (int t = 0; t < sizes[s]; t++) used += atomic_load(&j.seen_thread[t]);
        TAP_CHECK(ok && used >= 1,
                  "%d threads: after an idle sleep a job of 200000 chunks runs (%d threads took part)",
                  sizes[s], used);

        /* Nested: a task's own run() goes inline, reporting its thread index. */
        nest_job inner = {.pool = pool};
        nest_outer outer = {.inner = &inner};
        ds41_threadpool_run(pool, 16, 1, outer_task, &outer);
        TAP_CHECK(atomic_load(&inner.total) == 160 && !atomic_load(&outer.index_mismatch),
                  "%d threads: a run() inside a task runs inline with the task's thread index", sizes[s]);

        /* Two outside threads sharing the pool: one runs, the other inline. */
        conc_arg a1 = {pool, 0}, a2 = {pool, 0};
        pthread_t t1, t2;
        pthread_create(&t1, NULL, concurrent_caller, &a1);
        pthread_create(&t2, NULL, concurrent_caller, &a2);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
        TAP_CHECK(a1.ok && a2.ok, "%d threads: two threads calling run() at once both get complete jobs",
                  sizes[s]);
        ds41_threadpool_free(pool);
    }

    /* No pool: serial on the caller, thread index 0. */
    count_job j;
    memset(&j, 0, sizeof j);
    TAP_CHECK(run_once(NULL, 1234, 10, &j) && ds41_threadpool_size(NULL) == 1,
              "a NULL pool runs the job on the caller");

    /* Default size: one thread per usable CPU. */
    ds41_threadpool *def = ds41_threadpool_new(0, false, &err);
    TAP_CHECK(def && ds41_threadpool_size(def) == ds41_cpu_count(), "n_threads 0 = one per CPU (%d)",
              ds41_threadpool_size(def));
    ds41_threadpool_free(def);

    /* Pinned pool (best effort: the results are the same).  Last: it pins
     * the calling thread too. */
    ds41_threadpool *pinned = ds41_threadpool_new(2, true, &err);
    memset(&j, 0, sizeof j);
    TAP_CHECK(pinned && run_once(pinned, 5000, 3, &j), "a pinned pool runs jobs");
    ds41_threadpool_free(pinned);
    ds41_threadpool_free(NULL);
    return tap_done();
}
