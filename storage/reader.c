/* ds41_reader: see reader.h.
 *
 * Structure: requests wait in a FIFO (`pending`) until a slot is free; a slot
 * is one in-flight chunk read (at most queue_depth), owning an aligned bounce
 * buffer when the reader reads any file with O_DIRECT.  Backends only execute
 * "read len bytes at off of fd into dst" and report the raw result; every
 * decision (continuation of short reads, alignment, copy-out, faults,
 * statistics, completion) is taken here in the caller's thread, so both
 * backends behave identically. */
#include "storage/reader.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_QUEUE_DEPTH 32u
#define MAX_QUEUE_DEPTH 4096u
#define DEFAULT_CHUNK ((size_t)1 << 20)
#define MAX_CHUNK ((size_t)64 << 20)
#define DEFAULT_THREADS 4u
#define MAX_THREADS 256u
#define DIRECT_ALIGN_DEFAULT 4096u
#define MAX_DIRECT_ALIGN 65536u
#define LAT_BUCKETS 512

typedef struct rfile {
    char *path;
    int fd;          /* buffered reads */
    bool own_fd;
    int dfd;         /* O_DIRECT descriptor or -1 */
    uint32_t align;  /* direct-I/O unit (1 when buffered) */
    uint64_t size;
    char reason[160];
} rfile;

typedef struct req req;
typedef struct req_list {
    req *head, *tail;
} req_list;

struct req {
    ds41_read_req r;
    req *prev, *next;      /* in pending, issued or done */
    req_list *list;        /* which list it is in */
    size_t issued;         /* bytes handed to slots so far */
    unsigned inflight;     /* slots working on it */
    int error;
    uint64_t error_offset;
    bool injected;
    uint64_t submit_ns;
};

typedef struct slot {
    req *rq;
    unsigned index;
    int fd;
    bool direct;
    bool bounce;            /* reading into the slot's bounce buffer */
    uint64_t want_off;      /* the chunk: file range [want_off, want_off+want_len) */
    size_t want_len;
    unsigned char *want_dst;
    uint64_t read_off;      /* what is read: [read_off, read_off+read_len) into read_dst */
    size_t read_len;
    unsigned char *read_dst;
    size_t done;            /* bytes of the read range present */
    size_t asked;           /* length of the read in flight */
    ds41_reader_fault_kind fault;
    /* delayed completions */
    long held_res;
    uint64_t release_ns;
    struct slot *next_delayed;
    struct slot *next_free;
} slot;

typedef struct done_item {
    slot *s;
    long res;
} done_item;

struct ds41_reader {
    ds41_reader_opts o;
    bool uring;
    struct io_uring ring;
    bool ring_inited;
    unsigned unsubmitted;    /* sqes prepared but not submitted */
    char warning[256];
    bool have_warning;

    /* pread pool */
    pthread_t *threads;
    unsigned nthreads;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    slot **work;             /* ring of queue_depth */
    unsigned work_head, work_count;
    done_item *dq;           /* ring of queue_depth */
    unsigned dq_head, dq_count;
    bool stop;
    bool sync_inited;

    rfile *files;
    size_t nfiles, cap_files;

    slot *slots;
    slot *free_slots;
    unsigned busy_slots;     /* slots with a read in the backend */
    slot *delayed;           /* completions held back by a DELAY fault */
    unsigned char *bounce;   /* queue_depth * bounce_size, aligned */
    size_t bounce_size;
    bool registered;
    char buf_reason[160];

    req_list pending, issued, done;
    size_t outstanding;

    /* fault */
    ds41_reader_fault_kind fault_kind;
    uint32_t fault_file;
    uint64_t fault_nth;      /* countdown; 0 = every read */
    unsigned fault_delay_ms;

    /* stats */
    ds41_reader_stats st;
    uint64_t lat[LAT_BUCKETS];
};

/* ------------------------------------------------------------ helpers */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void list_push(req_list *l, req *q) {
    q->list = l;
    q->next = NULL;
    q->prev = l->tail;
    if (l->tail) l->tail->next = q;
    else l->head = q;
    l->tail = q;
}

static void list_remove(req *q) {
    req_list *l = q->list;
    if (q->prev) q->prev->next = q->next;
    else l->head = q->next;
    if (q->next) q->next->prev = q->prev;
    else l->tail = q->prev;
    q->prev = q->next = NULL;
    q->list = NULL;
}

static unsigned lat_bucket(uint64_t v) {
    if (v < 16) return (unsigned)v;
    unsigned e = 63u - (unsigned)__builtin_clzll(v);
    unsigned sub = (unsigned)(v >> (e - 3)) & 7u;
    unsigned b = 16 + (e - 4) * 8 + sub;
    return b < LAT_BUCKETS ? b : LAT_BUCKETS - 1;
}

static uint64_t lat_upper(unsigned b) {
    if (b < 16) return b;
    unsigned e = (b - 16) / 8 + 4, sub = (b - 16) % 8;
    if (e >= 63) return UINT64_MAX;
    return (((uint64_t)8 + sub + 1) << (e - 3)) - 1;
}

static uint64_t lat_percentile(const ds41_reader *r, double p) {
    uint64_t total = 0;
    for (unsigned b = 0; b < LAT_BUCKETS; b++) total += r->lat[b];
    if (!total) return 0;
    uint64_t rank = (uint64_t)(p * (double)total);
    if (rank >= total) rank = total - 1;
    uint64_t seen = 0;
    for (unsigned b = 0; b < LAT_BUCKETS; b++) {
        seen += r->lat[b];
        if (seen > rank) return lat_upper(b);
    }
    return lat_upper(LAT_BUCKETS - 1);
}

/* A request leaves pending/issued for done. */
static void finish_req(ds41_reader *r, req *q) {
    list_remove(q);
    uint64_t lat = now_ns() - q->submit_ns;
    r->lat[lat_bucket(lat)]++;
    if (lat > r->st.latency_max_ns) r->st.latency_max_ns = lat;
    r->st.completed++;
    if (q->error) r->st.failed++;
    else r->st.bytes_delivered += q->r.len;
    list_push(&r->done, q);
}

static void fail_req(req *q, int error, uint64_t off, bool injected) {
    if (q->error) return; /* the first error wins */
    q->error = error;
    q->error_offset = off;
    q->injected = injected;
}

/* A request whose slots are all back and that will not issue more. */
static void maybe_finish(ds41_reader *r, req *q) {
    if (q->inflight) return;
    if (q->error || q->issued == q->r.len) finish_req(r, q);
}

/* ------------------------------------------------------------ backends */

static int uring_flush(ds41_reader *r) {
    while (r->unsubmitted) {
        int n = io_uring_submit(&r->ring);
        if (n == -EINTR || n == -EAGAIN || n == -EBUSY) return 0; /* retried by the next round */
        if (n < 0) return n;
        r->unsubmitted = 0; /* io_uring_submit hands over every prepared sqe */
    }
    return 0;
}

/* Hand the slot's next read to the backend. */
static void backend_issue(ds41_reader *r, slot *s) {
    unsigned char *dst = s->read_dst + s->done;
    uint64_t off = s->read_off + s->done;
    size_t len = s->read_len - s->done;
    s->asked = len;
    r->busy_slots++;
    r->st.reads++;
    if (r->uring) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (!sqe) { /* cannot happen: sq entries >= slots; flush and retry once */
            uring_flush(r);
            sqe = io_uring_get_sqe(&r->ring);
        }
        if (!sqe) abort();
        if (s->bounce && r->registered)
            io_uring_prep_read_fixed(sqe, s->fd, dst, (unsigned)len, off, (int)s->index);
        else
            io_uring_prep_read(sqe, s->fd, dst, (unsigned)len, off);
        io_uring_sqe_set_data64(sqe, (uint64_t)s->index + 1);
        r->unsubmitted++;
    } else {
        pthread_mutex_lock(&r->mu);
        r->work[(r->work_head + r->work_count) % r->o.queue_depth] = s;
        r->work_count++;
        pthread_cond_signal(&r->work_cv);
        pthread_mutex_unlock(&r->mu);
    }
}

static void *pread_worker(void *arg) {
    ds41_reader *r = arg;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && !r->work_count) pthread_cond_wait(&r->work_cv, &r->mu);
        if (!r->work_count) break; /* stop and nothing left */
        slot *s = r->work[r->work_head];
        r->work_head = (r->work_head + 1) % r->o.queue_depth;
        r->work_count--;
        pthread_mutex_unlock(&r->mu);
        long res;
        do {
            res = (long)pread(s->fd, s->read_dst + s->done, s->asked, (off_t)(s->read_off + s->done));
        } while (res < 0 && errno == EINTR);
        if (res < 0) res = -errno;
        pthread_mutex_lock(&r->mu);
        r->dq[(r->dq_head + r->dq_count) % r->o.queue_depth] = (done_item){s, res};
        r->dq_count++;
        pthread_cond_signal(&r->done_cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* Wait until the backend returns at least one raw result or deadline_ns
 * passes (UINT64_MAX: no limit; 0: do not block), collecting up to max into
 * out.  Returns the count, or -errno for a backend failure. */
static long backend_reap(ds41_reader *r, uint64_t deadline_ns, done_item *out, size_t max) {
    if (r->uring) {
        int e = uring_flush(r);
        if (e < 0) return e;
        struct io_uring_cqe *cqe = NULL;
        if (deadline_ns == UINT64_MAX) {
            e = io_uring_wait_cqe(&r->ring, &cqe);
        } else {
            uint64_t t = now_ns();
            uint64_t rel = deadline_ns > t ? deadline_ns - t : 0;
            if (rel == 0) {
                e = io_uring_peek_cqe(&r->ring, &cqe);
                if (e == -EAGAIN) e = -ETIME;
            } else {
                struct __kernel_timespec ts = {.tv_sec = (long long)(rel / 1000000000u),
                                               .tv_nsec = (long long)(rel % 1000000000u)};
                e = io_uring_wait_cqe_timeout(&r->ring, &cqe, &ts);
            }
        }
        if (e == -ETIME || e == -EINTR) return 0;
        if (e < 0) return e;
        size_t n = 0;
        while (n < max && io_uring_peek_cqe(&r->ring, &cqe) == 0) {
            uint64_t idx = io_uring_cqe_get_data64(cqe);
            long res = cqe->res;
            io_uring_cqe_seen(&r->ring, cqe);
            if (idx == 0 || idx > r->o.queue_depth) continue; /* not ours */
            out[n++] = (done_item){&r->slots[idx - 1], res};
        }
        return (long)n;
    }
    pthread_mutex_lock(&r->mu);
    if (deadline_ns == UINT64_MAX) {
        while (!r->dq_count) pthread_cond_wait(&r->done_cv, &r->mu);
    } else if (deadline_ns != 0) {
        /* Condition variables wait on CLOCK_REALTIME by default: convert the
         * monotonic deadline into a realtime one. */
        uint64_t t = now_ns();
        uint64_t rel = deadline_ns > t ? deadline_ns - t : 0;
        struct timespec abs;
        clock_gettime(CLOCK_REALTIME, &abs);
        uint64_t ns = (uint64_t)abs.tv_nsec + rel % 1000000000u;
        abs.tv_sec += (time_t)(rel / 1000000000u + ns / 1000000000u);
        abs.tv_nsec = (long)(ns % 1000000000u);
        while (!r->dq_count) {
            if (pthread_cond_timedwait(&r->done_cv, &r->mu, &abs) == ETIMEDOUT) break;
        }
    }
    size_t n = 0;
    while (n < max && r->dq_count) {
        out[n++] = r->dq[r->dq_head];
        r->dq_head = (r->dq_head + 1) % r->o.queue_depth;
        r->dq_count--;
    }
    pthread_mutex_unlock(&r->mu);
    return (long)n;
}

/* ------------------------------------------------------------ slots */

static void release_slot(ds41_reader *r, slot *s) {
    s->rq = NULL;
    s->next_free = r->free_slots;
    r->free_slots = s;
}

static ds41_reader_fault_kind take_fault(ds41_reader *r, uint32_t file) {
    if (r->fault_kind == DS41_FAULT_NONE) return DS41_FAULT_NONE;
    if (r->fault_file != DS41_READER_ANY_FILE && r->fault_file != file) return DS41_FAULT_NONE;
    ds41_reader_fault_kind k = r->fault_kind;
    if (r->fault_nth == 0) return k;
    if (--r->fault_nth) return DS41_FAULT_NONE;
    r->fault_kind = DS41_FAULT_NONE;
    return k;
}

static uint64_t align_down(uint64_t v, uint32_t a) { return v / a * a; }

/* Cut the next chunk of q into s and issue it. */
static void start_chunk(ds41_reader *r, req *q, slot *s) {
    const rfile *f = &r->files[q->r.file];
    size_t len = q->r.len - q->issued;
    if (len > r->o.chunk_bytes) len = r->o.chunk_bytes;
    s->rq = q;
    s->want_off = q->r.offset + q->issued;
    s->want_len = len;
    s->want_dst = (unsigned char *)q->r.buf + q->issued;
    s->direct = f->dfd >= 0;
    s->fd = s->direct ? f->dfd : f->fd;
    s->done = 0;
    s->bounce = false;
    if (s->direct) {
        uint32_t a = f->align;
        if (s->want_off % a == 0 && len % a == 0 && (uintptr_t)s->want_dst % a == 0) {
            s->read_off = s->want_off;
            s->read_len = len;
            s->read_dst = s->want_dst;
        } else {
            s->bounce = true;
            s->read_off = align_down(s->want_off, a);
            uint64_t end = s->want_off + len;
            uint64_t aend = (end + a - 1) / a * a;
            s->read_len = (size_t)(aend - s->read_off);
            s->read_dst = r->bounce + (size_t)s->index * r->bounce_size;
        }
    } else {
        s->read_off = s->want_off;
        s->read_len = len;
        s->read_dst = s->want_dst;
    }
    q->issued += len;
    q->inflight++;
    if (q->issued == q->r.len) {
        list_remove(q);
        list_push(&r->issued, q);
    }
    s->fault = take_fault(r, q->r.file);
    backend_issue(r, s);
}

/* Move waiting chunks into free slots. */
static void pump(ds41_reader *r) {
    while (r->pending.head && r->free_slots) {
        req *q = r->pending.head;
        if (q->error) { /* failed or cancelled: issue nothing more */
            list_remove(q);
            list_push(&r->issued, q);
            maybe_finish(r, q);
            continue;
        }
        slot *s = r->free_slots;
        r->free_slots = s->next_free;
        start_chunk(r, q, s);
    }
}

/* Process a raw result of the slot's read (after any delay). */
static void on_result(ds41_reader *r, slot *s, long res) {
    req *q = s->rq;
    uint32_t a = r->files[q->r.file].align;
    bool injected = false;
    if (s->fault == DS41_FAULT_EIO) {
        res = -EIO;
        injected = true;
    } else if (s->fault == DS41_FAULT_SHORT && res > 0) {
        long shorter = (long)align_down((uint64_t)res / 2, a);
        if (shorter < (long)a) shorter = (long)a;
        if (shorter < res) res = shorter;
    }
    s->fault = DS41_FAULT_NONE;
    uint64_t at = s->read_off + s->done;
    if (res < 0) {
        fail_req(q, (int)-res, at, injected);
        goto slot_done;
    }
    r->st.bytes_device += (uint64_t)res;
    s->done += (size_t)res;
    uint64_t have_end = s->read_off + s->done;
    uint64_t want_end = s->want_off + s->want_len;
    if (have_end >= want_end) {
        if (s->bounce) {
            memcpy(s->want_dst, s->read_dst + (s->want_off - s->read_off), s->want_len);
            r->st.bytes_copied += s->want_len;
        }
        goto slot_done;
    }
    /* Short.  0 bytes is the end of the file; with O_DIRECT a read ending off
     * the alignment unit is too (mid-file direct reads return whole units). */
    if (res == 0 || (s->direct && s->done % a)) {
        fail_req(q, ENODATA, have_end, false);
        goto slot_done;
    }
    if (q->error) goto slot_done; /* cancelled meanwhile */
    r->st.short_reads++;
    if (s->direct) s->done = (size_t)align_down(s->done, a);
    s->fault = take_fault(r, q->r.file);
    backend_issue(r, s);
    return;
slot_done:
    q->inflight--;
    release_slot(r, s);
    maybe_finish(r, q);
}

static void take_result(ds41_reader *r, slot *s, long res) {
    r->busy_slots--;
    if (s->fault == DS41_FAULT_DELAY) {
        s->fault = DS41_FAULT_NONE;
        s->held_res = res;
        s->release_ns = now_ns() + (uint64_t)r->fault_delay_ms * 1000000u;
        s->next_delayed = r->delayed;
        r->delayed = s;
        return;
    }
    on_result(r, s, res);
}

/* Release delayed completions that are due (all when force). */
static void release_delayed(ds41_reader *r, bool force) {
    uint64_t t = now_ns();
    slot **pp = &r->delayed;
    while (*pp) {
        slot *s = *pp;
        if (force || s->release_ns <= t) {
            *pp = s->next_delayed;
            on_result(r, s, s->held_res);
        } else {
            pp = &s->next_delayed;
        }
    }
}

/* One round: issue what fits, wait for results (until deadline_ns at most),
 * process them.  Returns 0 or -errno. */
static int progress(ds41_reader *r, uint64_t deadline_ns) {
    pump(r);
    uint64_t until = deadline_ns;
    for (slot *s = r->delayed; s; s = s->next_delayed)
        if (s->release_ns < until) until = s->release_ns;
    done_item items[64];
    long n = 0;
    if (r->busy_slots) {
        n = backend_reap(r, until, items, 64);
        if (n < 0) return (int)n;
    } else if (r->delayed && until != 0) {
        uint64_t t = now_ns();
        if (until > t) {
            struct timespec ts = {.tv_sec = (time_t)((until - t) / 1000000000u),
                                  .tv_nsec = (long)((until - t) % 1000000000u)};
            nanosleep(&ts, NULL);
        }
    } else if (r->uring) {
        int e = uring_flush(r);
        if (e < 0) return e;
    }
    for (long i = 0; i < n; i++) take_result(r, items[i].s, items[i].res);
    release_delayed(r, false);
    pump(r);
    if (r->uring) {
        int e = uring_flush(r);
        if (e < 0) return e;
    }
    return 0;
}

/* ------------------------------------------------------------ lifecycle */

static int start_pread_pool(ds41_reader *r, ds41_error *err) {
    r->work = calloc(r->o.queue_depth, sizeof *r->work);
    r->dq = calloc(r->o.queue_depth, sizeof *r->dq);
    r->threads = calloc(r->o.threads, sizeof *r->threads);
    if (!r->work || !r->dq || !r->threads) return ds41_fail(err, "reader: out of memory");
    for (unsigned i = 0; i < r->o.threads; i++) {
        int e = pthread_create(&r->threads[i], NULL, pread_worker, r);
        if (e) return ds41_fail(err, "reader: cannot start pread thread: %s", strerror(e));
        r->nthreads++;
    }
    return 0;
}

ds41_reader *ds41_reader_new(const ds41_reader_opts *opts, ds41_error *err) {
    ds41_reader_opts o = {0};
    if (opts) o = *opts;
    if (o.queue_depth == 0) o.queue_depth = DEFAULT_QUEUE_DEPTH;
    if (o.chunk_bytes == 0) o.chunk_bytes = DEFAULT_CHUNK;
    if (o.threads == 0) o.threads = DEFAULT_THREADS;
    if (o.queue_depth > MAX_QUEUE_DEPTH) {
        ds41_fail(err, "reader: queue_depth %u exceeds %u", o.queue_depth, MAX_QUEUE_DEPTH);
        return NULL;
    }
    if (o.chunk_bytes > MAX_CHUNK) {
        ds41_fail(err, "reader: chunk_bytes %zu exceeds %zu", o.chunk_bytes, MAX_CHUNK);
        return NULL;
    }
    if (o.threads > MAX_THREADS) {
        ds41_fail(err, "reader: threads %u exceeds %u", o.threads, MAX_THREADS);
        return NULL;
    }
    if (o.backend != DS41_READER_AUTO && o.backend != DS41_READER_IO_URING &&
        o.backend != DS41_READER_PREAD) {
        ds41_fail(err, "reader: unknown backend %d", (int)o.backend);
        return NULL;
    }
    o.chunk_bytes = (o.chunk_bytes + DIRECT_ALIGN_DEFAULT - 1) / DIRECT_ALIGN_DEFAULT * DIRECT_ALIGN_DEFAULT;

    ds41_reader *r = calloc(1, sizeof *r);
    if (!r) {
        ds41_fail(err, "reader: out of memory");
        return NULL;
    }
    r->o = o;
    snprintf(r->buf_reason, sizeof r->buf_reason, "%s",
             o.register_buffers ? "no O_DIRECT file yet" : "not requested");
    r->slots = calloc(o.queue_depth, sizeof *r->slots);
    if (!r->slots) {
        ds41_fail(err, "reader: out of memory");
        free(r);
        return NULL;
    }
    for (unsigned i = o.queue_depth; i-- > 0;) {
        r->slots[i].index = i;
        release_slot(r, &r->slots[i]);
    }
    if (o.backend != DS41_READER_PREAD) {
        int e = o.test_uring_init_errno ? -o.test_uring_init_errno
                                        : io_uring_queue_init(o.queue_depth, &r->ring, 0);
        if (e == 0) {
            r->uring = true;
            r->ring_inited = true;
        } else if (o.backend == DS41_READER_IO_URING) {
            ds41_fail(err, "reader: io_uring_queue_init: %s", strerror(-e));
            ds41_reader_free(r);
            return NULL;
        } else {
            r->have_warning = true;
            snprintf(r->warning, sizeof r->warning,
                     "io_uring unavailable (io_uring_queue_init: %s); reading with %u pread threads",
                     strerror(-e), o.threads);
        }
    }
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->work_cv, NULL);
    pthread_cond_init(&r->done_cv, NULL);
    r->sync_inited = true;
    if (!r->uring && start_pread_pool(r, err) < 0) {
        ds41_reader_free(r);
        return NULL;
    }
    return r;
}

void ds41_reader_free(ds41_reader *r) {
    if (!r) return;
    /* Nothing new is issued; reads already in the backend write into caller
     * and bounce buffers, so they are waited for before anything is freed. */
    while (r->busy_slots) {
        done_item items[64];
        long n = backend_reap(r, UINT64_MAX, items, 64);
        if (n < 0) break; /* a dead ring: nothing more will come back */
        for (long i = 0; i < n; i++) r->busy_slots--;
    }
    if (r->sync_inited) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_broadcast(&r->work_cv);
        pthread_mutex_unlock(&r->mu);
        for (unsigned i = 0; i < r->nthreads; i++) pthread_join(r->threads[i], NULL);
        pthread_mutex_destroy(&r->mu);
        pthread_cond_destroy(&r->work_cv);
        pthread_cond_destroy(&r->done_cv);
    }
    if (r->ring_inited) io_uring_queue_exit(&r->ring); /* also unregisters buffers */
    req_list *lists[] = {&r->pending, &r->issued, &r->done};
    for (size_t l = 0; l < 3; l++) {
        while (lists[l]->head) {
            req *q = lists[l]->head;
            list_remove(q);
            free(q);
        }
    }
    for (size_t i = 0; i < r->nfiles; i++) {
        if (r->files[i].own_fd) close(r->files[i].fd);
        if (r->files[i].dfd >= 0) close(r->files[i].dfd);
        free(r->files[i].path);
    }
    free(r->files);
    free(r->bounce);
    free(r->slots);
    free(r->work);
    free(r->dq);
    free(r->threads);
    free(r);
}

/* Allocate (and maybe register) the bounce buffers, once, when the first
 * O_DIRECT file arrives. */
static int ensure_bounce(ds41_reader *r, uint32_t align, ds41_error *err) {
    size_t need = r->o.chunk_bytes + 2 * (size_t)align;
    if (r->bounce) {
        if (need <= r->bounce_size) return 0;
        if (r->busy_slots || r->delayed)
            return ds41_fail(err, "reader: a file with a %u-byte direct-I/O unit cannot be added "
                                  "while reads are in flight", align);
        if (r->registered) {
            io_uring_unregister_buffers(&r->ring);
            r->registered = false;
        }
        free(r->bounce);
        r->bounce = NULL;
    }
    size_t total = need * r->o.queue_depth;
    r->bounce = aligned_alloc(MAX_DIRECT_ALIGN, (total + MAX_DIRECT_ALIGN - 1) / MAX_DIRECT_ALIGN * MAX_DIRECT_ALIGN);
    if (!r->bounce) return ds41_fail(err, "reader: cannot allocate %zu bytes of bounce buffers", total);
    r->bounce_size = need;
    if (!r->o.register_buffers) return 0;
    if (!r->uring) {
        snprintf(r->buf_reason, sizeof r->buf_reason, "no io_uring");
        return 0;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < total) {
        snprintf(r->buf_reason, sizeof r->buf_reason,
                 "RLIMIT_MEMLOCK is %llu bytes, %zu needed", (unsigned long long)rl.rlim_cur, total);
        return 0;
    }
    struct iovec *iov = calloc(r->o.queue_depth, sizeof *iov);
    if (!iov) return ds41_fail(err, "reader: out of memory");
    for (unsigned i = 0; i < r->o.queue_depth; i++)
        iov[i] = (struct iovec){r->bounce + (size_t)i * need, need};
    int e = io_uring_register_buffers(&r->ring, iov, r->o.queue_depth);
    free(iov);
    if (e < 0) {
        snprintf(r->buf_reason, sizeof r->buf_reason, "io_uring_register_buffers: %s", strerror(-e));
    } else {
        r->registered = true;
        r->buf_reason[0] = 0;
    }
    return 0;
}

/* Open path with O_DIRECT and make one aligned read; on success f->dfd and
 * f->align are set, otherwise f->reason says why. */
static void try_direct(rfile *f) {
    int dfd = open(f->path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (dfd < 0) {
        snprintf(f->reason, sizeof f->reason, "open(O_DIRECT): %s", strerror(errno));
        return;
    }
    uint32_t align = DIRECT_ALIGN_DEFAULT;
#ifdef STATX_DIOALIGN
    struct statx sx;
    if (statx(dfd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN)) {
        if (sx.stx_dio_offset_align == 0) {
            snprintf(f->reason, sizeof f->reason, "statx: the filesystem does not support O_DIRECT");
            close(dfd);
            return;
        }
        uint32_t m = sx.stx_dio_offset_align > sx.stx_dio_mem_align ? sx.stx_dio_offset_align
                                                                    : sx.stx_dio_mem_align;
        if (m > align) align = m;
    }
#endif
    if (align > MAX_DIRECT_ALIGN || (align & (align - 1))) {
        snprintf(f->reason, sizeof f->reason, "unsupported direct-I/O alignment %u", align);
        close(dfd);
        return;
    }
    void *probe = aligned_alloc(align, align);
    if (!probe) {
        snprintf(f->reason, sizeof f->reason, "out of memory for the probe read");
        close(dfd);
        return;
    }
    ssize_t got;
    do {
        got = pread(dfd, probe, align, 0);
    } while (got < 0 && errno == EINTR);
    int e = errno;
    free(probe);
    if (got < 0) {
        snprintf(f->reason, sizeof f->reason, "O_DIRECT probe read: %s", strerror(e));
        close(dfd);
        return;
    }
    f->dfd = dfd;
    f->align = align;
}

int ds41_reader_add_file(ds41_reader *r, const char *path, int fd, ds41_error *err) {
    if (!path) return ds41_fail(err, "reader: add_file: no path");
    if (r->nfiles >= INT32_MAX) return ds41_fail(err, "%s: reader: too many files", path);
    if (r->nfiles == r->cap_files) {
        size_t cap = r->cap_files ? r->cap_files * 2 : 8;
        rfile *nf = realloc(r->files, cap * sizeof *nf);
        if (!nf) return ds41_fail(err, "%s: reader: out of memory", path);
        r->files = nf;
        r->cap_files = cap;
    }
    rfile f = {.fd = fd, .dfd = -1, .align = 1};
    f.path = strdup(path);
    if (!f.path) return ds41_fail(err, "%s: reader: out of memory", path);
    if (fd < 0) {
        f.fd = open(path, O_RDONLY | O_CLOEXEC);
        if (f.fd < 0) {
            int e = errno;
            free(f.path);
            return ds41_fail(err, "%s: open: %s", path, strerror(e));
        }
        f.own_fd = true;
    }
    struct stat stb;
    if (fstat(f.fd, &stb) < 0) {
        int e = errno;
        if (f.own_fd) close(f.fd);
        free(f.path);
        return ds41_fail(err, "%s: fstat: %s", path, strerror(e));
    }
    f.size = (uint64_t)stb.st_size;
    if (r->o.direct) try_direct(&f);
    else snprintf(f.reason, sizeof f.reason, "O_DIRECT not requested");
    if (f.dfd >= 0 && ensure_bounce(r, f.align, err) < 0) {
        ds41_error_prefix(err, "%s", path);
        close(f.dfd);
        if (f.own_fd) close(f.fd);
        free(f.path);
        return -1;
    }
    r->files[r->nfiles] = f;
    return (int)r->nfiles++;
}

/* ------------------------------------------------------------ queries */

size_t ds41_reader_file_count(const ds41_reader *r) { return r->nfiles; }

const char *ds41_reader_file_path(const ds41_reader *r, uint32_t file) {
    return file < r->nfiles ? r->files[file].path : NULL;
}

uint64_t ds41_reader_file_size(const ds41_reader *r, uint32_t file) {
    return file < r->nfiles ? r->files[file].size : 0;
}

bool ds41_reader_file_direct(const ds41_reader *r, uint32_t file) {
    return file < r->nfiles && r->files[file].dfd >= 0;
}

const char *ds41_reader_file_direct_reason(const ds41_reader *r, uint32_t file) {
    return file < r->nfiles ? r->files[file].reason : NULL;
}

uint32_t ds41_reader_file_align(const ds41_reader *r, uint32_t file) {
    return file < r->nfiles ? r->files[file].align : 0;
}

const char *ds41_reader_backend_name(const ds41_reader *r) {
    return r->uring ? "io_uring" : "pread threads";
}

const char *ds41_reader_warning(const ds41_reader *r) { return r->have_warning ? r->warning : NULL; }

bool ds41_reader_buffers_registered(const ds41_reader *r) { return r->registered; }

const char *ds41_reader_buffers_reason(const ds41_reader *r) { return r->buf_reason; }

size_t ds41_reader_outstanding(const ds41_reader *r) { return r->outstanding; }

/* ------------------------------------------------------------ requests */

int ds41_reader_submit(ds41_reader *r, const ds41_read_req *reqs, size_t n, ds41_error *err) {
    if (n && !reqs) return ds41_fail(err, "reader: submit: NULL request array");
    for (size_t i = 0; i < n; i++) {
        const ds41_read_req *q = &reqs[i];
        if (q->file >= r->nfiles)
            return ds41_fail(err, "reader: request %zu (tag %llu): file index %u out of range (%zu files)",
                             i, (unsigned long long)q->tag, q->file, r->nfiles);
        const char *p = r->files[q->file].path;
        if (q->len && !q->buf)
            return ds41_fail(err, "%s: request %zu (tag %llu): NULL buffer for %zu bytes", p, i,
                             (unsigned long long)q->tag, q->len);
        if (q->offset > (uint64_t)INT64_MAX || q->len > (uint64_t)INT64_MAX - q->offset)
            return ds41_fail(err, "%s: request %zu (tag %llu): offset %llu + length %zu overflows",
                             p, i, (unsigned long long)q->tag, (unsigned long long)q->offset, q->len);
    }
    req **made = calloc(n ? n : 1, sizeof *made);
    if (!made) return ds41_fail(err, "reader: submit: out of memory");
    for (size_t i = 0; i < n; i++) {
        made[i] = calloc(1, sizeof **made);
        if (!made[i]) {
            for (size_t j = 0; j < i; j++) free(made[j]);
            free(made);
            return ds41_fail(err, "reader: submit: out of memory");
        }
    }
    uint64_t t = now_ns();
    for (size_t i = 0; i < n; i++) {
        req *q = made[i];
        q->r = reqs[i];
        q->submit_ns = t;
        r->st.requests++;
        r->outstanding++;
        if (q->r.len == 0) {
            list_push(&r->issued, q);
            finish_req(r, q);
        } else {
            list_push(&r->pending, q);
        }
    }
    free(made);
    pump(r);
    if (r->uring) {
        int e = uring_flush(r);
        if (e < 0) return ds41_fail(err, "reader: io_uring_submit: %s", strerror(-e));
    }
    return 0;
}

static void to_completion(const req *q, ds41_read_completion *c) {
    *c = (ds41_read_completion){.tag = q->r.tag,
                                .file = q->r.file,
                                .offset = q->r.offset,
                                .len = q->r.len,
                                .error = q->error,
                                .error_offset = q->error_offset,
                                .injected = q->injected};
}

static uint64_t deadline_from(int64_t timeout_ns) {
    if (timeout_ns < 0) return UINT64_MAX;
    if (timeout_ns == 0) return 0;
    return now_ns() + (uint64_t)timeout_ns;
}

static size_t done_count(const ds41_reader *r) {
    size_t n = 0;
    for (const req *q = r->done.head; q; q = q->next) n++;
    return n;
}

long ds41_reader_wait(ds41_reader *r, size_t min_complete, int64_t timeout_ns,
                      ds41_read_completion *out, size_t max, ds41_error *err) {
    if (max && !out) return ds41_fail(err, "reader: wait: NULL completion array");
    if (min_complete > max) min_complete = max;
    if (min_complete > r->outstanding) min_complete = r->outstanding;
    uint64_t deadline = deadline_from(timeout_ns);
    if (deadline == 0) { /* poll: one non-blocking round */
        int e = progress(r, 0);
        if (e < 0) return ds41_fail(err, "reader: %s backend: %s", ds41_reader_backend_name(r), strerror(-e));
    }
    while (deadline != 0 && done_count(r) < min_complete) {
        if (deadline != UINT64_MAX && now_ns() >= deadline) break;
        int e = progress(r, deadline);
        if (e < 0) return ds41_fail(err, "reader: %s backend: %s", ds41_reader_backend_name(r), strerror(-e));
    }
    size_t n = 0;
    while (n < max && r->done.head) {
        req *q = r->done.head;
        to_completion(q, &out[n++]);
        list_remove(q);
        free(q);
        r->outstanding--;
    }
    return (long)n;
}

static req *find_tag(req_list *l, uint64_t tag) {
    for (req *q = l->head; q; q = q->next)
        if (q->r.tag == tag) return q;
    return NULL;
}

int ds41_reader_wait_tag(ds41_reader *r, uint64_t tag, int64_t timeout_ns,
                         ds41_read_completion *out, ds41_error *err) {
    if (!out) return ds41_fail(err, "reader: wait_tag: NULL completion");
    uint64_t deadline = deadline_from(timeout_ns);
    for (;;) {
        req *q = find_tag(&r->done, tag);
        if (q) {
            to_completion(q, out);
            list_remove(q);
            free(q);
            r->outstanding--;
            return 1;
        }
        if (!find_tag(&r->pending, tag) && !find_tag(&r->issued, tag))
            return ds41_fail(err, "reader: no outstanding request with tag %llu", (unsigned long long)tag);
        if (deadline != 0 && deadline != UINT64_MAX && now_ns() >= deadline) return 0;
        int e = progress(r, deadline);
        if (e < 0) return ds41_fail(err, "reader: %s backend: %s", ds41_reader_backend_name(r), strerror(-e));
        if (deadline == 0 && !find_tag(&r->done, tag)) return 0;
    }
}

size_t ds41_reader_cancel(ds41_reader *r, uint64_t tag) {
    size_t n = 0;
    req_list *lists[] = {&r->pending, &r->issued};
    for (size_t l = 0; l < 2; l++) {
        req *q = lists[l]->head;
        while (q) {
            req *next = q->next;
            if (q->r.tag == tag && !q->error) {
                fail_req(q, ECANCELED, q->r.offset + q->issued, false);
                n++;
                if (!q->inflight) finish_req(r, q);
            }
            q = next;
        }
    }
    return n;
}

int ds41_reader_completion_error(const ds41_reader *r, const ds41_read_completion *c,
                                 ds41_error *err) {
    if (!c->error) return 0;
    const char *path = c->file < r->nfiles ? r->files[c->file].path : "?";
    const char *inj = c->injected ? " (injected fault)" : "";
    if (c->error == ENODATA)
        return ds41_fail(err, "%s: read of %zu bytes at offset %llu: end of file at offset %llu "
                              "(file was %llu bytes when added)",
                         path, c->len, (unsigned long long)c->offset,
                         (unsigned long long)c->error_offset,
                         (unsigned long long)ds41_reader_file_size(r, c->file));
    if (c->error == ECANCELED)
        return ds41_fail(err, "%s: read of %zu bytes at offset %llu: cancelled", path, c->len,
                         (unsigned long long)c->offset);
    return ds41_fail(err, "%s: read of %zu bytes at offset %llu: %s at offset %llu%s", path, c->len,
                     (unsigned long long)c->offset, strerror(c->error),
                     (unsigned long long)c->error_offset, inj);
}

/* ------------------------------------------------------------ faults, stats */

int ds41_reader_set_fault(ds41_reader *r, uint32_t file, ds41_reader_fault_kind kind,
                          uint64_t nth, unsigned delay_ms) {
    if (kind != DS41_FAULT_NONE && kind != DS41_FAULT_EIO && kind != DS41_FAULT_SHORT &&
        kind != DS41_FAULT_DELAY)
        return -1;
    r->fault_kind = kind;
    r->fault_file = file;
    r->fault_nth = nth;
    r->fault_delay_ms = delay_ms;
    return 0;
}

void ds41_reader_get_stats(const ds41_reader *r, ds41_reader_stats *out) {
    *out = r->st;
    out->latency_p50_ns = lat_percentile(r, 0.50);
    out->latency_p99_ns = lat_percentile(r, 0.99);
}

void ds41_reader_reset_stats(ds41_reader *r) {
    memset(&r->st, 0, sizeof r->st);
    memset(r->lat, 0, sizeof r->lat);
}

/* ------------------------------------------------------------ bandwidth probe */

int ds41_reader_probe_bandwidth(const char *path, uint64_t bytes, ds41_bandwidth_probe *out,
                                ds41_error *err) {
    enum { PROBE_QD = 32 };
    const size_t block = (size_t)1 << 20;
    *out = (ds41_bandwidth_probe){0};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds41_fail(err, "%s: open: %s", path, strerror(errno));
    /* Clean pages of the file would otherwise answer buffered fallback reads;
     * with O_DIRECT they are bypassed anyway. */
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ds41_reader_opts o = {.queue_depth = PROBE_QD, .chunk_bytes = block, .direct = true};
    ds41_reader *r = ds41_reader_new(&o, err);
    if (!r) {
        close(fd);
        return ds41_error_prefix(err, "%s: bandwidth probe", path);
    }
    unsigned char *bufs = NULL;
    int rc = -1;
    if (ds41_reader_add_file(r, path, fd, err) < 0) goto out;
    uint64_t size = ds41_reader_file_size(r, 0);
    uint64_t total = bytes < size ? bytes : size;
    total = total / DIRECT_ALIGN_DEFAULT * DIRECT_ALIGN_DEFAULT;
    if (total == 0) {
        ds41_fail(err, "%s: bandwidth probe: the file (%llu bytes) is smaller than 4096 bytes",
                  path, (unsigned long long)size);
        goto out;
    }
    bufs = aligned_alloc(MAX_DIRECT_ALIGN, PROBE_QD * block);
    if (!bufs) {
        ds41_fail(err, "%s: bandwidth probe: out of memory", path);
        goto out;
    }
    uint64_t next = 0, done = 0;
    unsigned free_buf[PROBE_QD], nfree = 0;
    for (unsigned i = 0; i < PROBE_QD; i++) free_buf[nfree++] = i;
    uint64_t t0 = now_ns();
    while (done < total) {
        ds41_read_req batch[PROBE_QD];
        size_t nb = 0;
        while (nfree && next < total) {
            unsigned b = free_buf[--nfree];
            size_t len = total - next < block ? (size_t)(total - next) : block;
            batch[nb++] = (ds41_read_req){.file = 0, .offset = next, .len = len,
                                          .buf = bufs + (size_t)b * block, .tag = b};
            next += len;
        }
        if (nb && ds41_reader_submit(r, batch, nb, err) < 0) goto out;
        ds41_read_completion c[PROBE_QD];
        long n = ds41_reader_wait(r, 1, -1, c, PROBE_QD, err);
        if (n < 0) goto out;
        for (long i = 0; i < n; i++) {
            if (ds41_reader_completion_error(r, &c[i], err) < 0) {
                ds41_error_prefix(err, "bandwidth probe");
                goto out;
            }
            done += c[i].len;
            free_buf[nfree++] = (unsigned)c[i].tag;
        }
    }
    uint64_t t1 = now_ns();
    out->bytes = total;
    out->seconds = (double)(t1 - t0) / 1e9;
    out->bytes_per_second = out->seconds > 0 ? (double)total / out->seconds : 0;
    out->direct = ds41_reader_file_direct(r, 0);
    snprintf(out->backend, sizeof out->backend, "%s", ds41_reader_backend_name(r));
    rc = 0;
out:
    ds41_reader_free(r);
    free(bufs);
    close(fd);
    return rc;
}
