/* Fork-join thread pool (see threadpool.h).
 *
 * Protocol.  One 32-bit word `state` holds a job generation (high 24 bits)
 * and the number of workers inside the current job (low 8 bits).  An odd
 * generation is an open job, an even one means idle.  The caller publishes a
 * job by writing its fields, resetting `next` and moving the generation from
 * even to odd (release); workers that notice join it by incrementing the
 * count with a compare-and-swap that also checks the generation, claim
 * chunks from `next` until it passes the end, and leave (decrement).  The
 * caller runs chunks too; when `next` has passed the end it closes the job by
 * moving the generation to the next even value with a compare-and-swap that
 * only succeeds while no worker is inside.  So the caller waits only for
 * workers that actually took part (a descheduled worker that has not joined
 * costs nothing: on a loaded machine the caller and the running workers
 * simply do all the chunks), and a worker can never join a closed job or
 * read the fields of the next one.
 *
 * Idle workers spin on `state` for a short while, then sleep on it as a
 * futex; the caller wakes them when `sleepers` is non-zero.  The race is
 * closed by sequentially consistent operations: a worker counts itself in
 * `sleepers` before futex_wait(state, seen), which the kernel refuses when
 * state has moved; the caller moves state before it reads `sleepers`. */
#include "engine/backend/cpu/threadpool.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How long an idle thread spins before it sleeps. */
#define SPIN_NS 50000

struct ds41_threadpool {
    int n; /* threads, caller included */
    pthread_t *workers;
    int n_started;
    bool pin;
    int *cpus;
    int n_cpus;
    bool caller_pinned;

    /* the current job */
    ds41_task_fn fn;
    void *ctx;
    size_t n_items, grain;

    _Atomic uint32_t state; /* generation << 8 | workers inside */
    _Atomic size_t next;
    _Atomic uint32_t sleepers;
    atomic_int busy;
    atomic_int stop;
};

#define GEN(s) ((s) >> 8)
#define INSIDE(s) ((s)&0xFFu)

/* The index of the calling thread in the pool whose job it is running (0
 * outside any job): a nested run() reports it for its inline chunks. */
static _Thread_local int current_index;
static _Thread_local const ds41_threadpool *current_pool;

typedef struct worker_arg {
    ds41_threadpool *pool;
    int index;
} worker_arg;

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)addr, op, val, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int ds41_cpu_count(void) {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)(n < INT_MAX ? n : INT_MAX) : 1;
}

static void pin_self(const ds41_threadpool *pool, int index) {
    if (!pool->pin || pool->n_cpus == 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(pool->cpus[index % pool->n_cpus], &set);
    /* Best effort: a failure (e.g. a CPU taken away meanwhile) leaves the
     * thread where the scheduler puts it. */
    (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* Claim and run chunks of the current job. */
static void run_chunks(ds41_threadpool *pool, int thread) {
    const size_t n = pool->n_items, grain = pool->grain;
    const int saved_index = current_index;
    const ds41_threadpool *saved_pool = current_pool;
    current_index = thread;
    current_pool = pool;
    for (;;) {
        size_t b = atomic_fetch_add_explicit(&pool->next, grain, memory_order_relaxed);
        if (b >= n) break;
        size_t e = n - b < grain ? n : b + grain;
        pool->fn(pool->ctx, b, e, thread);
    }
    current_index = saved_index;
    current_pool = saved_pool;
}

static void *worker_main(void *p) {
    worker_arg *a = p;
    ds41_threadpool *pool = a->pool;
    const int index = a->index;
    free(a);
    pin_self(pool, index);
    uint32_t seen = 0; /* generation of the last job seen (or the initial idle one) */
    for (;;) {
        uint32_t s = atomic_load(&pool->state);
        if (GEN(s) == seen || !(GEN(s) & 1)) {
            /* Nothing new: spin a while, then sleep until the word moves. */
            const uint64_t t0 = now_ns();
            unsigned spins = 0;
            for (;;) {
                if (atomic_load_explicit(&pool->stop, memory_order_relaxed)) return NULL;
                s = atomic_load(&pool->state);
                if (GEN(s) != seen && (GEN(s) & 1)) break;
                if ((++spins & 255) == 0 && now_ns() - t0 > SPIN_NS) {
                    atomic_fetch_add(&pool->sleepers, 1);
                    s = atomic_load(&pool->state);
                    if ((GEN(s) == seen || !(GEN(s) & 1)) && !atomic_load(&pool->stop))
                        futex(&pool->state, FUTEX_WAIT_PRIVATE, s);
                    atomic_fetch_sub(&pool->sleepers, 1);
                } else {
                    cpu_relax();
                }
            }
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = GEN(s);
        /* Join the open job seen (fails if it closed meanwhile). */
        int joined = 0;
        while (GEN(s) == seen) {
            if (atomic_compare_exchange_weak(&pool->state, &s, s + 1)) {
                joined = 1;
                break;
            }
        }
        if (!joined) continue;
        run_chunks(pool, index);
        atomic_fetch_sub(&pool->state, 1);
    }
}

ds41_threadpool *ds41_threadpool_new(int n_threads, bool pin, ds41_error *err) {
    if (n_threads <= 0) n_threads = ds41_cpu_count();
    if (n_threads > DS41_THREADPOOL_MAX) n_threads = DS41_THREADPOOL_MAX;
    ds41_threadpool *pool = calloc(1, sizeof *pool);
    if (!pool) {
        ds41_fail(err, "thread pool: out of memory");
        return NULL;
    }
    pool->n = n_threads;
    pool->pin = pin;
    if (pin) {
        cpu_set_t set;
        pool->cpus = calloc(CPU_SETSIZE, sizeof *pool->cpus);
        if (!pool->cpus) {
            free(pool);
            ds41_fail(err, "thread pool: out of memory");
            return NULL;
        }
        if (sched_getaffinity(0, sizeof set, &set) == 0)
            for (int c = 0; c < CPU_SETSIZE; c++)
                if (CPU_ISSET(c, &set)) pool->cpus[pool->n_cpus++] = c;
    }
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (!pool->workers) {
            ds41_threadpool_free(pool);
            ds41_fail(err, "thread pool: out of memory");
            return NULL;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        int rc = a ? 0 : ENOMEM;
        if (a) {
            a->pool = pool;
            a->index = i;
            rc = pthread_create(&pool->workers[i - 1], NULL, worker_main, a);
            if (rc != 0) free(a);
        }
        if (rc != 0) {
            /* Keep the workers started so far consistent with n for the
             * shutdown below. */
            pool->n = i;
            ds41_threadpool_free(pool);
            ds41_fail(err, "thread pool: cannot start worker %d of %d: %s", i, n_threads - 1, strerror(rc));
            return NULL;
        }
        pool->n_started = i;
    }
    return pool;
}

void ds41_threadpool_free(ds41_threadpool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->state, 1u << 8); /* move the word so sleepers wake */
    futex(&pool->state, FUTEX_WAKE_PRIVATE, INT_MAX);
    for (int i = 0; i < pool->n_started; i++) pthread_join(pool->workers[i], NULL);
    free(pool->workers);
    free(pool->cpus);
    free(pool);
}

int ds41_threadpool_size(const ds41_threadpool *pool) {
    return pool ? pool->n : 1;
}

void ds41_threadpool_run(ds41_threadpool *pool, size_t n, size_t grain, ds41_task_fn fn, void *ctx) {
    if (n == 0) return;
    if (grain == 0) grain = 1;
    /* Serial: no pool, a single thread, a job of one chunk, or the pool is
     * busy (a nested or concurrent call). */
    int expected = 0;
    if (!pool || pool->n == 1 || n <= grain || !atomic_compare_exchange_strong(&pool->busy, &expected, 1)) {
        fn(ctx, 0, n, pool && current_pool == pool ? current_index : 0);
        return;
    }
    if (pool->pin && !pool->caller_pinned) {
        pin_self(pool, 0);
        pool->caller_pinned = true;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_items = n;
    pool->grain = grain;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    /* Idle (even, nobody inside) -> open (odd). */
    uint32_t s = atomic_load(&pool->state);
    const uint32_t open = ((GEN(s) | 1u) + (GEN(s) & 1u ? 2u : 0u)) << 8;
    atomic_store(&pool->state, open); /* seq_cst: publishes the job, then sleepers is read */
    if (atomic_load(&pool->sleepers) > 0) futex(&pool->state, FUTEX_WAKE_PRIVATE, INT_MAX);
    run_chunks(pool, 0);
    /* Close: open with nobody inside -> the next even generation. */
    const uint32_t closed = (GEN(open) + 1u) << 8;
    const uint64_t t0 = now_ns();
    unsigned spins = 0;
    for (;;) {
        uint32_t want = open;
        if (atomic_compare_exchange_weak(&pool->state, &want, closed)) break;
        /* Someone is still inside, finishing a chunk. */
        if ((++spins & 255) == 0 && now_ns() - t0 > SPIN_NS)
            sched_yield();
        else
            cpu_relax();
    }
    atomic_store_explicit(&pool->busy, 0, memory_order_release);
}
