/* The fake device (cuda/gpu.h): device memory is host memory, and queued
 * work is deferred as late as CUDA's rules allow.
 *
 * Every item queued on a stream (a copy, a memset, a host function, an
 * event's record, a wait for an event) gets a global sequence number and
 * stays queued until something forces it:
 *  - stream_sync(s) runs s up to its last item;
 *  - event_sync(e) runs the stream e was recorded on up to that record;
 *  - event_done(e) does the same, but first runs a few items of other
 *    streams in an order drawn from the seed (the device makes progress
 *    between queries), so a poll loop ends;
 *  - running an item first runs every earlier item of its stream, and a
 *    wait item first runs what the event it waits for depends on.
 * Nothing else runs queued work: a host that queues an upload and reads the
 * destination through another stream without an event, or reuses a staging
 * buffer before its copy has run, sees the stale bytes in a test, where a
 * real device would hand it the right ones by luck most of the time.
 *
 * Pointers are checked where a real GPU would fault: h2d / d2h / d2d /
 * memset ranges must lie inside live device allocations (and the host side
 * outside them); a violation aborts with a message naming the call.
 *
 * One recursive lock covers the device: the KV pool's memory calls come
 * from several threads (engine/backend/memory.h), and a host function run
 * by the device may queue more work. */
#include "cuda/gpu_fake.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char fake_name[] = "fake";

typedef enum item_kind { IT_COPY, IT_COPY_2D, IT_MEMSET, IT_HOST_FN, IT_RECORD, IT_WAIT } item_kind;

typedef struct item {
    item_kind kind;
    uint64_t seq;
    struct item *next;
    void *dst;
    const void *src;
    size_t n, dpitch, spitch, rows;
    void (*fn)(void *);
    void *arg;
    struct ds41_gpu_stream *wait_stream; /* IT_WAIT: the stream whose item wait_seq must have run */
    uint64_t wait_seq;
} item;

struct ds41_gpu_stream {
    item *head, *tail;
    uint64_t done_seq; /* sequence number of the last item run (streams run in order) */
    bool dead;         /* freed by the user; kept until the device goes (events may name it) */
    struct ds41_gpu_stream *next_all;
};

struct ds41_gpu_event {
    struct ds41_gpu_stream *stream; /* where the last record was queued; NULL: never recorded */
    uint64_t seq;
};

typedef struct alloc_rec {
    uintptr_t base;
    size_t n; /* rounded size */
} alloc_rec;

typedef struct fake {
    pthread_mutex_t mu;
    uint64_t total, used, pinned, queued, executed, seq, rng;
    alloc_rec *allocs; /* sorted by base */
    size_t n_allocs, cap_allocs;
    struct ds41_gpu_stream *streams;
} fake;

static fake *F(const ds41_gpu *g) {
    return (fake *)g->impl;
}

static uint64_t next_rand(fake *f) {
    f->rng = f->rng * 6364136223846793005ull + 1442695040888963407ull;
    return f->rng >> 33;
}

static _Noreturn void die(const char *call, const char *what, const void *p, size_t n) {
    fprintf(stderr, "fake gpu: %s: %s [%p, +%zu) is not where it must be (a real GPU faults here)\n", call,
            what, p, n);
    abort();
}

/* The allocation holding [p, p+n), or NULL. */
static const alloc_rec *find_alloc(const fake *f, const void *p, size_t n) {
    const uintptr_t a = (uintptr_t)p;
    size_t lo = 0, hi = f->n_allocs;
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        if (f->allocs[mid].base <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0) return NULL;
    const alloc_rec *r = &f->allocs[lo - 1];
    if (a - r->base > r->n || n > r->n - (a - r->base)) return NULL;
    return r;
}

static bool is_dev(const fake *f, const void *p, size_t n) {
    return p && find_alloc(f, p, n ? n : 1);
}

/* ------------------------------------------------------------- running */

static void run_stream_to(ds41_gpu *g, struct ds41_gpu_stream *s, uint64_t seq);

static void exec_item(ds41_gpu *g, struct ds41_gpu_stream *s, item *it) {
    fake *f = F(g);
    switch (it->kind) {
    case IT_COPY:
        if (it->n) memcpy(it->dst, it->src, it->n);
        break;
    case IT_COPY_2D:
        for (size_t r = 0; r < it->rows && it->n; r++)
            memcpy((unsigned char *)it->dst + r * it->dpitch, (const unsigned char *)it->src + r * it->spitch,
                   it->n);
        break;
    case IT_MEMSET:
        if (it->n) memset(it->dst, 0, it->n);
        break;
    case IT_HOST_FN:
        it->fn(it->arg);
        break;
    case IT_RECORD:
        break;
    case IT_WAIT:
        break;
    }
    s->done_seq = it->seq;
    f->queued--;
    f->executed++;
}

/* Run the head item of s (its dependencies first). */
static void run_head(ds41_gpu *g, struct ds41_gpu_stream *s) {
    item *it = s->head;
    if (it->kind == IT_WAIT && it->wait_stream != s) run_stream_to(g, it->wait_stream, it->wait_seq);
    /* A host function may have queued onto s meanwhile: still the head. */
    s->head = it->next;
    if (!s->head) s->tail = NULL;
    exec_item(g, s, it);
    free(it);
}

/* Run s's items up to sequence number seq (inclusive). */
static void run_stream_to(ds41_gpu *g, struct ds41_gpu_stream *s, uint64_t seq) {
    while (s->head && s->head->seq <= seq) run_head(g, s);
}

/* A few items of streams with queued work, in seeded order. */
static void run_some(ds41_gpu *g, unsigned steps) {
    fake *f = F(g);
    for (unsigned k = 0; k < steps; k++) {
        size_t n = 0;
        for (struct ds41_gpu_stream *s = f->streams; s; s = s->next_all) n += s->head != NULL;
        if (!n) return;
        size_t pick = (size_t)(next_rand(f) % n);
        for (struct ds41_gpu_stream *s = f->streams; s; s = s->next_all)
            if (s->head && pick-- == 0) {
                run_head(g, s);
                break;
            }
    }
}

static void queue(ds41_gpu *g, struct ds41_gpu_stream *s, item *proto) {
    fake *f = F(g);
    item *it = malloc(sizeof *it);
    if (!it) {
        fprintf(stderr, "fake gpu: out of host memory queueing work\n");
        abort();
    }
    *it = *proto;
    it->next = NULL;
    it->seq = ++f->seq;
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    f->queued++;
}

/* ------------------------------------------------------------- the table */

static int f_info(ds41_gpu *g, ds41_gpu_info *out, ds41_error *err) {
    (void)err;
    fake *f = F(g);
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "fake device (host memory)");
    out->cc_major = 9;
    out->multiprocessors = 1;
    pthread_mutex_lock(&f->mu);
    out->total_bytes = f->total;
    out->free_bytes = f->total ? f->total - f->used : 0;
    pthread_mutex_unlock(&f->mu);
    out->unified = false;
    return 0;
}

static void *f_dev_alloc(ds41_gpu *g, size_t n, ds41_error *err) {
    fake *f = F(g);
    if (n == 0 || n > SIZE_MAX - 255) {
        ds41_fail(err, "fake gpu: device allocation of %zu bytes", n);
        return NULL;
    }
    const size_t r = (n + 255) & ~(size_t)255;
    pthread_mutex_lock(&f->mu);
    if (f->total && (r > f->total || f->used > f->total - r)) {
        ds41_fail(err, "fake gpu: out of device memory: %zu bytes asked, %llu of %llu bytes free", n,
                  (unsigned long long)(f->total - f->used), (unsigned long long)f->total);
        pthread_mutex_unlock(&f->mu);
        return NULL;
    }
    void *p = NULL;
    if (f->n_allocs == f->cap_allocs) {
        const size_t cap = f->cap_allocs ? 2 * f->cap_allocs : 64;
        alloc_rec *na = realloc(f->allocs, cap * sizeof *na);
        if (na) f->allocs = na, f->cap_allocs = cap;
    }
    if (f->n_allocs < f->cap_allocs) p = aligned_alloc(256, r);
    if (!p) {
        ds41_fail(err, "fake gpu: out of host memory for a %zu-byte device allocation", n);
        pthread_mutex_unlock(&f->mu);
        return NULL;
    }
    memset(p, 0, r);
    size_t i = f->n_allocs;
    while (i > 0 && f->allocs[i - 1].base > (uintptr_t)p) {
        f->allocs[i] = f->allocs[i - 1];
        i--;
    }
    f->allocs[i] = (alloc_rec){(uintptr_t)p, r};
    f->n_allocs++;
    f->used += r;
    pthread_mutex_unlock(&f->mu);
    return p;
}

static void f_dev_free(ds41_gpu *g, void *p, size_t n) {
    (void)n;
    if (!p) return;
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    const alloc_rec *r = find_alloc(f, p, 1);
    if (!r || r->base != (uintptr_t)p) die("dev_free", "pointer", p, n);
    const size_t i = (size_t)(r - f->allocs);
    f->used -= r->n;
    memmove(&f->allocs[i], &f->allocs[i + 1], (f->n_allocs - i - 1) * sizeof *f->allocs);
    f->n_allocs--;
    pthread_mutex_unlock(&f->mu);
    free(p);
}

typedef struct pinned_hdr {
    size_t n;
    unsigned char pad[56];
} pinned_hdr;

static void *f_host_alloc(ds41_gpu *g, size_t n, ds41_error *err) {
    fake *f = F(g);
    void *p = n && n < SIZE_MAX - 4096 ? aligned_alloc(4096, (n + 4095) & ~(size_t)4095) : NULL;
    if (!p) {
        ds41_fail(err, "fake gpu: pinned host allocation of %zu bytes failed", n);
        return NULL;
    }
    pthread_mutex_lock(&f->mu);
    f->pinned += n;
    pthread_mutex_unlock(&f->mu);
    return p;
}

static void f_host_free(ds41_gpu *g, void *p, size_t n) {
    if (!p) return;
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    f->pinned -= n;
    pthread_mutex_unlock(&f->mu);
    free(p);
}

static ds41_gpu_stream *f_stream_new(ds41_gpu *g, ds41_error *err) {
    fake *f = F(g);
    struct ds41_gpu_stream *s = calloc(1, sizeof *s);
    if (!s) {
        ds41_fail(err, "fake gpu: out of memory for a stream");
        return NULL;
    }
    pthread_mutex_lock(&f->mu);
    s->next_all = f->streams;
    f->streams = s;
    pthread_mutex_unlock(&f->mu);
    return s;
}

static void f_stream_free(ds41_gpu *g, ds41_gpu_stream *s) {
    if (!s) return;
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    if (s->tail) run_stream_to(g, s, s->tail->seq); /* cudaStreamDestroy lets queued work finish */
    s->dead = true;
    pthread_mutex_unlock(&f->mu);
}

static int f_stream_sync(ds41_gpu *g, ds41_gpu_stream *s, ds41_error *err) {
    (void)err;
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    if (s->tail) run_stream_to(g, s, s->tail->seq);
    pthread_mutex_unlock(&f->mu);
    return 0;
}

static ds41_gpu_event *f_event_new(ds41_gpu *g, ds41_error *err) {
    (void)g;
    ds41_gpu_event *e = calloc(1, sizeof *e);
    if (!e) ds41_fail(err, "fake gpu: out of memory for an event");
    return e;
}

static void f_event_free(ds41_gpu *g, ds41_gpu_event *e) {
    (void)g;
    free(e);
}

static void f_event_record(ds41_gpu *g, ds41_gpu_event *e, ds41_gpu_stream *s) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    queue(g, s, &(item){.kind = IT_RECORD});
    e->stream = s;
    e->seq = s->tail->seq;
    pthread_mutex_unlock(&f->mu);
}

static void f_stream_wait(ds41_gpu *g, ds41_gpu_stream *s, ds41_gpu_event *e) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    if (e->stream) queue(g, s, &(item){.kind = IT_WAIT, .wait_stream = e->stream, .wait_seq = e->seq});
    pthread_mutex_unlock(&f->mu);
}

static bool passed(const ds41_gpu_event *e) {
    return !e->stream || e->stream->done_seq >= e->seq;
}

static bool f_event_done(ds41_gpu *g, ds41_gpu_event *e) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    /* The device moved on a little since the last query (at least one item
     * while any is queued, so a poll loop ends); the event's own stream
     * runs to it only when the draw says so. */
    run_some(g, 1 + (unsigned)(next_rand(f) % 4));
    if (e->stream && next_rand(f) % 4 == 0) run_stream_to(g, e->stream, e->seq);
    const bool d = passed(e);
    pthread_mutex_unlock(&f->mu);
    return d;
}

static void f_event_sync(ds41_gpu *g, ds41_gpu_event *e) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    if (e->stream) run_stream_to(g, e->stream, e->seq);
    pthread_mutex_unlock(&f->mu);
}

static void check_dev(const fake *f, const char *call, const char *what, const void *p, size_t n) {
    if (n && !is_dev(f, p, n)) die(call, what, p, n);
}
static void check_host(const fake *f, const char *call, const char *what, const void *p, size_t n) {
    if (n && (!p || find_alloc(f, p, 1))) die(call, what, p, n);
}

/* A copy queued on s after checking each side is where the call says
 * (device memory, or host memory outside every device allocation). */
static void queue_copy(ds41_gpu *g, ds41_gpu_stream *s, const char *call, void *dst, bool dst_dev,
                       const void *src, bool src_dev, size_t n) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    (dst_dev ? check_dev : check_host)(f, call, dst_dev ? "destination" : "host destination", dst, n);
    (src_dev ? check_dev : check_host)(f, call, src_dev ? "source" : "host source", src, n);
    queue(g, s, &(item){.kind = IT_COPY, .dst = dst, .src = src, .n = n});
    pthread_mutex_unlock(&f->mu);
}

static void f_h2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    queue_copy(g, s, "h2d", dst, true, src, false, n);
}

static void f_d2h(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    queue_copy(g, s, "d2h", dst, false, src, true, n);
}

static void f_d2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    queue_copy(g, s, "d2d", dst, true, src, true, n);
}

static void f_d2d_2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, size_t dpitch, const void *src,
                     size_t spitch, size_t width, size_t rows) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    if (rows && width) {
        check_dev(f, "d2d_2d", "destination", dst, (rows - 1) * dpitch + width);
        check_dev(f, "d2d_2d", "source", src, (rows - 1) * spitch + width);
    }
    queue(g, s,
          &(item){.kind = IT_COPY_2D,
                  .dst = dst,
                  .src = src,
                  .n = width,
                  .dpitch = dpitch,
                  .spitch = spitch,
                  .rows = rows});
    pthread_mutex_unlock(&f->mu);
}

static void f_memset0(ds41_gpu *g, ds41_gpu_stream *s, void *dst, size_t n) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    check_dev(f, "memset0", "destination", dst, n);
    queue(g, s, &(item){.kind = IT_MEMSET, .dst = dst, .n = n});
    pthread_mutex_unlock(&f->mu);
}

static void f_host_fn(ds41_gpu *g, ds41_gpu_stream *s, void (*fn)(void *), void *arg) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    queue(g, s, &(item){.kind = IT_HOST_FN, .fn = fn, .arg = arg});
    pthread_mutex_unlock(&f->mu);
}

static void *f_stream_native(ds41_gpu *g, ds41_gpu_stream *s) {
    (void)g, (void)s;
    return NULL;
}

static void f_destroy(ds41_gpu *g) {
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    for (struct ds41_gpu_stream *s = f->streams; s; s = s->next_all)
        if (s->tail) run_stream_to(g, s, s->tail->seq);
    pthread_mutex_unlock(&f->mu);
    for (struct ds41_gpu_stream *s = f->streams, *nx; s; s = nx) {
        nx = s->next_all;
        free(s);
    }
    for (size_t i = 0; i < f->n_allocs; i++) free((void *)f->allocs[i].base);
    free(f->allocs);
    pthread_mutex_destroy(&f->mu);
    free(f);
    free(g);
}

ds41_gpu *ds41_gpu_fake_new(const ds41_gpu_fake_opts *opts, ds41_error *err) {
    ds41_gpu *g = calloc(1, sizeof *g);
    fake *f = calloc(1, sizeof *f);
    if (!g || !f) {
        free(g);
        free(f);
        ds41_fail(err, "fake gpu: out of memory");
        return NULL;
    }
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&f->mu, &a);
    pthread_mutexattr_destroy(&a);
    f->total = opts ? opts->total_bytes : 0;
    f->rng = (opts ? opts->seed : 0) ^ 0x9e3779b97f4a7c15ull;
    *g = (ds41_gpu){
        .name = fake_name,
        .impl = f,
        .info = f_info,
        .dev_alloc = f_dev_alloc,
        .dev_free = f_dev_free,
        .host_alloc = f_host_alloc,
        .host_free = f_host_free,
        .stream_new = f_stream_new,
        .stream_free = f_stream_free,
        .stream_sync = f_stream_sync,
        .event_new = f_event_new,
        .event_free = f_event_free,
        .event_record = f_event_record,
        .stream_wait = f_stream_wait,
        .event_done = f_event_done,
        .event_sync = f_event_sync,
        .h2d = f_h2d,
        .d2h = f_d2h,
        .d2d = f_d2d,
        .d2d_2d = f_d2d_2d,
        .memset0 = f_memset0,
        .host_fn = f_host_fn,
        .stream_native = f_stream_native,
        .destroy = f_destroy,
    };
    return g;
}

bool ds41_gpu_is_fake(const ds41_gpu *g) {
    return g && g->name == fake_name;
}

bool ds41_gpu_fake_is_device(const ds41_gpu *g, const void *p, size_t n) {
    if (!ds41_gpu_is_fake(g)) return false;
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    const bool d = is_dev(f, p, n);
    pthread_mutex_unlock(&f->mu);
    return d;
}

void ds41_gpu_fake_get_stats(ds41_gpu *g, ds41_gpu_fake_stats *out) {
    memset(out, 0, sizeof *out);
    if (!ds41_gpu_is_fake(g)) return;
    fake *f = F(g);
    pthread_mutex_lock(&f->mu);
    *out = (ds41_gpu_fake_stats){f->used, f->n_allocs, f->pinned, f->queued, f->executed};
    pthread_mutex_unlock(&f->mu);
}
