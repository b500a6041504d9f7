/* ds41_threadpool: a fork-join pool of pthreads for the per-op parallel
 * loops of the fast CPU backend (engine/backend/cpu/ops_fast.c).
 *
 * One job at a time: ds41_threadpool_run(pool, n, grain, fn, ctx) splits the
 * index range [0, n) into chunks of `grain` indices, hands them out to the
 * calling thread and the workers (dynamically, first come first served) and
 * returns when every chunk has run.  Which thread runs which chunk is not
 * fixed, so a job must not let its results depend on that: every index's
 * work has to be a pure function of the index (this is what keeps the fast
 * path's results independent of the thread count; see engine/backend/cpu/cpu_backend.h).
 *
 * Overhead: workers spin on the job counter for a short while after each job
 * (a few tens of microseconds) before they sleep on a futex, so the dozens of
 * back-to-back jobs of a forward pass cost about a microsecond each to start,
 * and an idle pool costs no CPU.
 *
 * Thread safety: a pool runs one job at a time.  A run() issued while the
 * pool is busy (from another thread, or from inside a job's function) does
 * not wait for it: it runs its whole range on the calling thread, reporting
 * the calling thread's index in the busy job when called from inside one of
 * its chunks, else 0 (so per-thread scratch indexed by `thread` is safe for
 * nested runs; two threads outside the pool sharing it concurrently must not
 * share such scratch).  Freeing a pool while a run() is in progress is not
 * allowed. */
#ifndef DS41_ENGINE_THREADPOOL_H
#define DS41_ENGINE_THREADPOOL_H

#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>

typedef struct ds41_threadpool ds41_threadpool;

/* Called for chunks [begin, end) of a job; `thread` is the index of the
 * thread running it (0 = the caller, 1 .. size-1 = workers), for per-thread
 * scratch. */
typedef void (*ds41_task_fn)(void *ctx, size_t begin, size_t end, int thread);

/* The number of CPUs this process may run on (sched_getaffinity), >= 1. */
int ds41_cpu_count(void);

/* A pool of n_threads threads in all, the caller included (n_threads - 1
 * workers are started); n_threads <= 0 means ds41_cpu_count().  At most
 * DS41_THREADPOOL_MAX.  With pin, thread i is bound to the i-th CPU of the
 * process's affinity mask (modulo its size), the caller's thread at its
 * first run().  Errors: thread creation failed, out of memory. */
#define DS41_THREADPOOL_MAX 256
ds41_threadpool *ds41_threadpool_new(int n_threads, bool pin, ds41_error *err);

/* Stop and join the workers, free the pool.  NULL is fine. */
void ds41_threadpool_free(ds41_threadpool *pool);

/* Threads in the pool, the caller included (>= 1). */
int ds41_threadpool_size(const ds41_threadpool *pool);

/* Run fn over [0, n) in chunks of grain (0 is taken as 1) and wait for all
 * of them.  n == 0 returns at once.  A NULL pool runs everything on the
 * caller (thread index 0). */
void ds41_threadpool_run(ds41_threadpool *pool, size_t n, size_t grain, ds41_task_fn fn, void *ctx);

#endif
