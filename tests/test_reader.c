/* storage/reader: every byte a reader returns is compared with pread(2) of
 * the same range, for both backends, buffered and O_DIRECT, plus faults,
 * end of file, queue overflow, cancellation, teardown with reads in flight,
 * the page cache, statistics and the bandwidth probe. */
#include "storage/reader.h"
#include "tests/tap.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FILE_SIZE ((size_t)3 * 1024 * 1024 + 12345)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static int make_file(const char *path, size_t size) {
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return -1;
    unsigned char *b = malloc(size);
    for (size_t i = 0; i < size; i++) b[i] = (unsigned char)(rnd() >> 29);
    size_t off = 0;
    while (off < size) {
        ssize_t w = pwrite(fd, b + off, size - off, (off_t)off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    free(b);
    fdatasync(fd);
    close(fd);
    return off == size ? 0 : -1;
}

/* Does the reference pread of [off, off+len) equal buf? */
static int same_as_pread(int fd, const void *buf, uint64_t off, size_t len) {
    unsigned char *ref = malloc(len ? len : 1);
    ssize_t got = pread(fd, ref, len, (off_t)off);
    int ok = got == (ssize_t)len && memcmp(ref, buf, len) == 0;
    free(ref);
    return ok;
}

typedef struct cfg {
    ds41_reader_backend backend;
    bool direct;
    const char *path;
    const char *where;
} cfg;

static const char *bname(ds41_reader_backend b) {
    return b == DS41_READER_IO_URING ? "io_uring" : "pread threads";
}

/* NULL and a TAP skip when the configuration cannot run here. */
static ds41_reader *open_cfg(const cfg *c, ds41_reader_opts o, const char *what) {
    ds41_error err = {{0}};
    o.backend = c->backend;
    o.direct = c->direct;
    ds41_reader *r = ds41_reader_new(&o, &err);
    if (!r) {
        TAP_SKIP("%s [%s, %s]: %s", what, bname(c->backend), c->where, err.msg);
        return NULL;
    }
    if (ds41_reader_add_file(r, c->path, -1, &err) != 0) {
        TAP_CHECK(0, "%s [%s, %s]: add_file: %s", what, bname(c->backend), c->where, err.msg);
        ds41_reader_free(r);
        return NULL;
    }
    if (c->direct && !ds41_reader_file_direct(r, 0)) {
        TAP_SKIP("%s [%s, O_DIRECT, %s]: filesystem refuses O_DIRECT: %s", what, bname(c->backend),
                 c->where, ds41_reader_file_direct_reason(r, 0));
        ds41_reader_free(r);
        return NULL;
    }
    return r;
}

/* Hundreds of random requests in one batch (more than the queue depth),
 * waited for partly by tag in random order, partly in bulk. */
static void test_random(const cfg *c, bool register_buffers) {
    char what[160];
    snprintf(what, sizeof what, "random reads match pread%s%s", c->direct ? ", O_DIRECT" : "",
             register_buffers ? ", registered buffers" : "");
    ds41_reader_opts o = {.queue_depth = 16, .chunk_bytes = 64 * 1024, .register_buffers = register_buffers};
    ds41_reader *r = open_cfg(c, o, what);
    if (!r) return;
    int ref = open(c->path, O_RDONLY);
    enum { N = 400 };
    ds41_read_req reqs[N];
    unsigned char *bufs[N];
    uint64_t size = FILE_SIZE;
    for (size_t i = 0; i < N; i++) {
        uint64_t off;
        size_t len;
        switch (i % 8) {
        case 0: off = rnd() % size; len = 1; break;                                /* one byte */
        case 1: off = (rnd() % (size / 4096)) * 4096 + 4096 - 3; len = 7; break;   /* spans 4 KiB */
        case 2: len = 1 + rnd() % 5000; off = size - len; break;                   /* to EOF */
        case 3: off = (rnd() % (size / 4096 - 64)) * 4096; len = 4096 * (1 + rnd() % 40); break; /* aligned */
        case 4: off = rnd() % (size - 300000); len = 100000 + rnd() % 200000; break; /* several chunks */
        default: off = rnd() % size; len = 1 + rnd() % (size - off < 20000 ? size - off : 20000); break;
        }
        /* Caller buffers at every alignment, some page aligned. */
        size_t shift = i % 3 == 0 ? 0 : rnd() % 64;
        bufs[i] = aligned_alloc(4096, (len + shift + 4095) / 4096 * 4096);
        reqs[i] = (ds41_read_req){.file = 0, .offset = off, .len = len, .buf = bufs[i] + shift, .tag = 1000 + i};
    }
    ds41_error err = {{0}};
    int ok = ds41_reader_submit(r, reqs, N, &err) == 0;
    char fail[DS41_ERROR_MAX + 256] = "";
    if (!ok) snprintf(fail, sizeof fail, "submit: %s", err.msg);
    bool seen[N] = {false};
    /* Half by tag, in a shuffled order. */
    size_t order[N];
    for (size_t i = 0; i < N; i++) order[i] = i;
    for (size_t i = N - 1; i > 0; i--) {
        size_t j = rnd() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (size_t k = 0; ok && k < N / 2; k++) {
        size_t i = order[k];
        ds41_read_completion comp;
        if (ds41_reader_wait_tag(r, 1000 + i, -1, &comp, &err) != 1) {
            ok = 0;
            snprintf(fail, sizeof fail, "wait_tag %zu: %s", i, err.msg);
        } else if (comp.error || comp.offset != reqs[i].offset || comp.len != reqs[i].len) {
            ds41_reader_completion_error(r, &comp, &err);
            ok = 0;
            snprintf(fail, sizeof fail, "tag %zu: %s", i, err.msg);
        } else {
            seen[i] = true;
        }
    }
    while (ok && ds41_reader_outstanding(r)) {
        ds41_read_completion comp[37];
        long n = ds41_reader_wait(r, 1, -1, comp, 37, &err);
        if (n <= 0) {
            ok = 0;
            snprintf(fail, sizeof fail, "wait returned %ld: %s", n, err.msg);
            break;
        }
        for (long k = 0; k < n; k++) {
            size_t i = (size_t)(comp[k].tag - 1000);
            if (i >= N || seen[i] || comp[k].error) {
                ok = 0;
                snprintf(fail, sizeof fail, "bad completion tag %llu error %d",
                         (unsigned long long)comp[k].tag, comp[k].error);
                break;
            }
            seen[i] = true;
        }
    }
    for (size_t i = 0; ok && i < N; i++) {
        if (!seen[i] || !same_as_pread(ref, reqs[i].buf, reqs[i].offset, reqs[i].len)) {
            ok = 0;
            snprintf(fail, sizeof fail, "request %zu (offset %llu, len %zu) differs from pread", i,
                     (unsigned long long)reqs[i].offset, reqs[i].len);
        }
    }
    ds41_reader_stats st;
    ds41_reader_get_stats(r, &st);
    uint64_t total = 0;
    for (size_t i = 0; i < N; i++) total += reqs[i].len;
    if (ok && (st.requests != N || st.completed != N || st.failed != 0 || st.bytes_delivered != total ||
               st.bytes_device < total || st.latency_p50_ns == 0 || st.latency_p50_ns > st.latency_p99_ns ||
               st.latency_p99_ns > st.latency_max_ns * 2)) {
        ok = 0;
        snprintf(fail, sizeof fail, "stats: requests %llu completed %llu delivered %llu device %llu p50 %llu p99 %llu",
                 (unsigned long long)st.requests, (unsigned long long)st.completed,
                 (unsigned long long)st.bytes_delivered, (unsigned long long)st.bytes_device,
                 (unsigned long long)st.latency_p50_ns, (unsigned long long)st.latency_p99_ns);
    }
    /* O_DIRECT: the unaligned requests went through bounce buffers. */
    if (ok && c->direct && (st.bytes_copied == 0 || st.bytes_copied >= total)) {
        ok = 0;
        snprintf(fail, sizeof fail, "O_DIRECT: %llu bytes copied of %llu", (unsigned long long)st.bytes_copied,
                 (unsigned long long)total);
    }
    if (register_buffers && c->direct && c->backend == DS41_READER_IO_URING)
        TAP_NOTE("registered buffers: %s%s", ds41_reader_buffers_registered(r) ? "yes" : "no: ",
                 ds41_reader_buffers_reason(r));
    TAP_CHECK(ok, "%s [%s, %s] (%d requests, queue depth 16)%s%s", what, bname(c->backend), c->where, N,
              ok ? "" : ": ", fail);
    if (ok)
        TAP_NOTE("  %llu bytes delivered, %llu from the device, %llu copied, %llu reads, p50 %llu us, p99 %llu us",
                 (unsigned long long)st.bytes_delivered, (unsigned long long)st.bytes_device,
                 (unsigned long long)st.bytes_copied, (unsigned long long)st.reads,
                 (unsigned long long)st.latency_p50_ns / 1000, (unsigned long long)st.latency_p99_ns / 1000);
    for (size_t i = 0; i < N; i++) free(bufs[i]);
    close(ref);
    ds41_reader_free(r);
}

/* Read one range and return the completion (error -1 on API failure). */
static ds41_read_completion read_one(ds41_reader *r, uint64_t off, size_t len, void *buf) {
    ds41_read_req q = {.file = 0, .offset = off, .len = len, .buf = buf, .tag = 7};
    ds41_read_completion c = {.error = -1};
    ds41_error err;
    if (ds41_reader_submit(r, &q, 1, &err) == 0) ds41_reader_wait_tag(r, 7, -1, &c, &err);
    return c;
}

static void test_faults(const cfg *c) {
    ds41_reader_opts o = {.queue_depth = 4, .chunk_bytes = 64 * 1024};
    ds41_reader *r = open_cfg(c, o, "faults");
    if (!r) return;
    int ref = open(c->path, O_RDONLY);
    const char *tagline = c->direct ? "O_DIRECT" : "buffered";
    unsigned char *buf = malloc(300000);
    ds41_error err = {{0}};

    /* Every read comes back short: the reader must continue each one. */
    ds41_reader_set_fault(r, 0, DS41_FAULT_SHORT, 0, 0);
    ds41_read_completion cp = read_one(r, 5001, 250000, buf);
    ds41_reader_set_fault(r, 0, DS41_FAULT_NONE, 0, 0);
    ds41_reader_stats st;
    ds41_reader_get_stats(r, &st);
    TAP_CHECK(cp.error == 0 && same_as_pread(ref, buf, 5001, 250000) && st.short_reads >= 4,
              "short reads are continued to the full length [%s, %s] (%llu continuations, error %d)",
              bname(c->backend), tagline, (unsigned long long)st.short_reads, cp.error);

    /* Edges (issue 19): a read of one unit + 1 byte that comes back one unit long (one byte
     * short) is continued for its last byte; a request one byte longer than chunk_bytes is
     * split into exactly two reads. */
    memset(buf, 0xA5, 8192);
    ds41_reader_reset_stats(r);
    ds41_reader_set_fault(r, 0, DS41_FAULT_SHORT, 1, 0);
    cp = read_one(r, 0, 2, buf);
    ds41_reader_set_fault(r, 0, DS41_FAULT_NONE, 0, 0);
    ds41_reader_get_stats(r, &st);
    /* (The injected fault only shortens the count the read reports, so the continuation is
     * what shows: one short read, continued by a second.) */
    TAP_CHECK(cp.error == 0 && same_as_pread(ref, buf, 0, 2) && (c->direct || (st.short_reads == 1 && st.reads == 2)),
              "a 2-byte read reported 1 byte short is continued for its last byte [%s, %s] (%llu short, %llu reads)",
              bname(c->backend), tagline, (unsigned long long)st.short_reads, (unsigned long long)st.reads);
    ds41_reader_reset_stats(r);
    cp = read_one(r, 0, 64 * 1024 + 1, buf);
    ds41_reader_get_stats(r, &st);
    TAP_CHECK(cp.error == 0 && same_as_pread(ref, buf, 0, 64 * 1024 + 1) && st.reads == 2,
              "a request of chunk_bytes + 1 is two reads [%s, %s] (%llu)", bname(c->backend), tagline,
              (unsigned long long)st.reads);

    /* The second read fails with EIO: that request fails, naming path and offset. */
    ds41_read_req qs[3];
    for (int i = 0; i < 3; i++) qs[i] = (ds41_read_req){.file = 0, .offset = 1000 + 20000 * (uint64_t)i, .len = 10000,
                                                        .buf = buf + 20000 * i, .tag = 50 + (uint64_t)i};
    ds41_reader_set_fault(r, 0, DS41_FAULT_EIO, 2, 0);
    ds41_reader_submit(r, qs, 3, &err);
    int failed = 0, good = 0;
    char msg[DS41_ERROR_MAX] = "";
    for (int i = 0; i < 3; i++) {
        ds41_read_completion cc;
        if (ds41_reader_wait_tag(r, 50 + (uint64_t)i, -1, &cc, &err) != 1) continue;
        if (cc.error == EIO && cc.injected) {
            failed++;
            ds41_reader_completion_error(r, &cc, &err);
            snprintf(msg, sizeof msg, "%s", err.msg);
        } else if (cc.error == 0 && same_as_pread(ref, buf + 20000 * i, qs[i].offset, qs[i].len)) {
            good++;
        }
    }
    TAP_CHECK(failed == 1 && good == 2 && strstr(msg, c->path) && strstr(msg, "at offset 21000") &&
                  strstr(msg, "Input/output error"),
              "injected EIO fails exactly that request with path and offset [%s, %s]: %s",
              bname(c->backend), tagline, msg);

    /* End of file: a range running past the end, and one starting beyond it. */
    ds41_read_completion e1 = read_one(r, FILE_SIZE - 10, 100, buf);
    ds41_reader_completion_error(r, &e1, &err);
    ds41_read_completion e2 = read_one(r, FILE_SIZE + 5000, 10, buf);
    TAP_CHECK(e1.error == ENODATA && e1.error_offset == FILE_SIZE && strstr(err.msg, "end of file") &&
                  strstr(err.msg, c->path) && e2.error == ENODATA,
              "reads past the end fail with end of file [%s, %s]: %s", bname(c->backend), tagline, err.msg);

    /* A delayed read: a short wait times out, a longer one gets it. */
    ds41_reader_set_fault(r, 0, DS41_FAULT_DELAY, 1, 150);
    ds41_read_req dq = {.file = 0, .offset = 77, .len = 3000, .buf = buf, .tag = 99};
    ds41_reader_submit(r, &dq, 1, &err);
    ds41_read_completion dc;
    int w1 = ds41_reader_wait_tag(r, 99, 20 * 1000 * 1000, &dc, &err);
    long w0 = ds41_reader_wait(r, 1, 0, &dc, 1, &err);
    int w2 = ds41_reader_wait_tag(r, 99, -1, &dc, &err);
    TAP_CHECK(w1 == 0 && w0 == 0 && w2 == 1 && dc.error == 0 && same_as_pread(ref, buf, 77, 3000),
              "delayed completion: timed-out waits return 0, then it arrives [%s, %s]", bname(c->backend), tagline);

    /* Cancel a long request queued behind a delayed one. */
    ds41_reader_set_fault(r, 0, DS41_FAULT_DELAY, 1, 100);
    ds41_read_req cq[2] = {{.file = 0, .offset = 0, .len = 4096, .buf = buf, .tag = 1},
                           {.file = 0, .offset = 0, .len = 290000, .buf = buf + 8192, .tag = 2}};
    ds41_reader_submit(r, cq, 2, &err);
    size_t nc = ds41_reader_cancel(r, 2);
    ds41_read_completion c1, c2;
    int got1 = ds41_reader_wait_tag(r, 1, -1, &c1, &err), got2 = ds41_reader_wait_tag(r, 2, -1, &c2, &err);
    ds41_reader_completion_error(r, &c2, &err);
    TAP_CHECK(nc == 1 && got1 == 1 && got2 == 1 && c1.error == 0 && c2.error == ECANCELED &&
                  strstr(err.msg, "cancelled") && ds41_reader_outstanding(r) == 0,
              "cancel completes the request with ECANCELED, others unaffected [%s, %s]", bname(c->backend), tagline);

    int bad = ds41_reader_wait_tag(r, 12345, -1, &c1, &err);
    TAP_CHECK(bad == -1 && strstr(err.msg, "12345"), "wait_tag for an unknown tag fails [%s, %s]: %s",
              bname(c->backend), tagline, err.msg);

    /* Teardown with many reads queued and in flight (some delayed). */
    enum { M = 200 };
    unsigned char *big = malloc((size_t)M * 5000);
    ds41_read_req many[M];
    for (int i = 0; i < M; i++)
        many[i] = (ds41_read_req){.file = 0, .offset = rnd() % (FILE_SIZE - 5000), .len = 5000,
                                  .buf = big + (size_t)i * 5000, .tag = (uint64_t)i};
    ds41_reader_set_fault(r, 0, DS41_FAULT_DELAY, 3, 50);
    int sub = ds41_reader_submit(r, many, M, &err);
    ds41_read_completion few[5];
    long gotfew = ds41_reader_wait(r, 5, -1, few, 5, &err);
    ds41_reader_free(r); /* ASan: nothing leaks, nothing is written after free */
    free(big);
    TAP_CHECK(sub == 0 && gotfew == 5, "reader freed with %d requests outstanding [%s, %s]", M - 5,
              bname(c->backend), tagline);
    free(buf);
    close(ref);
}

static size_t resident_pages(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return (size_t)-1;
    void *m = mmap(NULL, FILE_SIZE, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return (size_t)-1;
    size_t pages = (FILE_SIZE + 4095) / 4096, n = 0;
    unsigned char *vec = malloc(pages);
    if (mincore(m, FILE_SIZE, vec) == 0)
        for (size_t i = 0; i < pages; i++) n += vec[i] & 1;
    else
        n = (size_t)-1;
    free(vec);
    munmap(m, FILE_SIZE);
    return n;
}

static void drop_cache(const char *path) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

static size_t read_all(const char *path, bool direct) {
    ds41_reader_opts o = {.queue_depth = 8, .direct = direct};
    ds41_error err;
    ds41_reader *r = ds41_reader_new(&o, &err);
    if (!r) return 0;
    size_t ok = 0;
    unsigned char *buf = aligned_alloc(4096, (FILE_SIZE + 4096) / 4096 * 4096 + 4096);
    if (ds41_reader_add_file(r, path, -1, &err) == 0 && ds41_reader_file_direct(r, 0) == direct) {
        /* unaligned on purpose: the bounce path must not touch the page cache either */
        ds41_read_req q = {.file = 0, .offset = 1, .len = FILE_SIZE - 1, .buf = buf + 1, .tag = 1};
        ds41_read_completion c;
        if (ds41_reader_submit(r, &q, 1, &err) == 0 && ds41_reader_wait(r, 1, -1, &c, 1, &err) == 1 && !c.error)
            ok = FILE_SIZE - 1;
    }
    free(buf);
    ds41_reader_free(r);
    return ok;
}

static void test_page_cache(const char *path, const char *where) {
    drop_cache(path);
    size_t before = resident_pages(path);
    if (before != 0) {
        TAP_SKIP("O_DIRECT page cache check (%s): %zu pages stay resident after POSIX_FADV_DONTNEED", where, before);
        return;
    }
    size_t got = read_all(path, true);
    if (!got) {
        TAP_SKIP("O_DIRECT page cache check (%s): O_DIRECT unavailable", where);
        return;
    }
    size_t after_direct = resident_pages(path);
    size_t got2 = read_all(path, false);
    size_t after_buffered = resident_pages(path);
    size_t pages = (FILE_SIZE + 4095) / 4096;
    TAP_CHECK(after_direct == 0 && got2 && after_buffered > pages / 2,
              "O_DIRECT reads leave the page cache empty (%s): %zu pages after O_DIRECT, %zu of %zu after buffered",
              where, after_direct, after_buffered, pages);
}

static void test_fallback(const char *path) {
    ds41_error err = {{0}};
    ds41_reader_opts o = {.backend = DS41_READER_AUTO, .test_uring_init_errno = ENOSYS, .threads = 3};
    ds41_reader *r = ds41_reader_new(&o, &err);
    const char *w = r ? ds41_reader_warning(r) : NULL;
    int ok = r && strcmp(ds41_reader_backend_name(r), "pread threads") == 0 && w &&
             strstr(w, "io_uring unavailable") && strstr(w, "Function not implemented");
    if (ok) {
        unsigned char b[100];
        ok = ds41_reader_add_file(r, path, -1, &err) == 0;
        ds41_read_completion c = read_one(r, 4000, 100, b);
        int fd = open(path, O_RDONLY);
        ok = ok && c.error == 0 && same_as_pread(fd, b, 4000, 100);
        close(fd);
    }
    TAP_CHECK(ok, "io_uring unavailable (ENOSYS): falls back to pread threads with a warning: %s", w ? w : err.msg);
    ds41_reader_free(r);
    o.backend = DS41_READER_IO_URING;
    o.test_uring_init_errno = EPERM;
    r = ds41_reader_new(&o, &err);
    TAP_CHECK(!r && strstr(err.msg, "io_uring_queue_init") && strstr(err.msg, "not permitted"),
              "explicit io_uring backend fails when unavailable: %s", err.msg);
    ds41_reader_free(r);
}

static void test_api_errors(const char *path) {
    ds41_error err = {{0}};
    ds41_reader *r = ds41_reader_new(NULL, &err);
    ds41_reader_add_file(r, path, -1, &err);
    unsigned char b[8];
    ds41_read_req q[2] = {{.file = 0, .offset = 0, .len = 8, .buf = b, .tag = 1},
                          {.file = 3, .offset = 0, .len = 8, .buf = b, .tag = 2}};
    int rc = ds41_reader_submit(r, q, 2, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "file index 3") && ds41_reader_outstanding(r) == 0,
              "a batch with a bad file index is refused whole: %s", err.msg);
    q[1] = (ds41_read_req){.file = 0, .offset = UINT64_MAX - 3, .len = 8, .buf = b, .tag = 2};
    rc = ds41_reader_submit(r, q, 2, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "overflows") && strstr(err.msg, path), "offset overflow is refused: %s", err.msg);
    q[1] = (ds41_read_req){.file = 0, .offset = 0, .len = 8, .buf = NULL, .tag = 2};
    rc = ds41_reader_submit(r, q, 2, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "NULL buffer"), "NULL buffer is refused: %s", err.msg);
    rc = ds41_reader_add_file(r, "/nonexistent/ds41-shard", -1, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "/nonexistent/ds41-shard"), "missing file: %s", err.msg);
    q[0].len = 0;
    q[0].buf = NULL;
    ds41_read_completion c;
    rc = ds41_reader_submit(r, q, 1, &err);
    TAP_CHECK(rc == 0 && ds41_reader_wait(r, 1, -1, &c, 1, &err) == 1 && c.error == 0 && c.tag == 1,
              "a zero-length request completes at once");
    ds41_reader_opts bad = {.queue_depth = 100000};
    TAP_CHECK(!ds41_reader_new(&bad, &err) && strstr(err.msg, "queue_depth"), "queue depth bound: %s", err.msg);
    ds41_reader_free(r);
}

static void test_probe(const char *path, const char *where) {
    ds41_bandwidth_probe p;
    ds41_error err = {{0}};
    int rc = ds41_reader_probe_bandwidth(path, 2u << 20, &p, &err);
    TAP_CHECK(rc == 0 && p.bytes == 2u << 20 && p.seconds > 0 && p.bytes_per_second > 0,
              "bandwidth probe (%s): %.0f MB/s over %llu bytes, O_DIRECT %s, %s%s", where,
              rc == 0 ? p.bytes_per_second / 1e6 : 0.0, (unsigned long long)p.bytes, p.direct ? "yes" : "no",
              rc == 0 ? p.backend : "", rc == 0 ? "" : err.msg);
    rc = ds41_reader_probe_bandwidth("/nonexistent/x", 1 << 20, &p, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "/nonexistent/x"), "bandwidth probe of a missing file: %s", err.msg);
}

int main(void) {
    char tmp_path[] = "/tmp/ds41-reader-XXXXXX";
    int tfd = mkstemp(tmp_path);
    if (tfd >= 0) close(tfd);
    const char *bdir = getenv("DS41_BUILD_DIR");
    char build_path[4096];
    snprintf(build_path, sizeof build_path, "%s/ds41-reader-test-%d.bin", bdir ? bdir : ".", (int)getpid());
    if (tfd < 0 || make_file(tmp_path, FILE_SIZE) != 0 || make_file(build_path, FILE_SIZE) != 0) {
        TAP_CHECK(0, "create the test files");
        return tap_done();
    }
    cfg cfgs[8];
    size_t nc = 0;
    ds41_reader_backend backends[] = {DS41_READER_IO_URING, DS41_READER_PREAD};
    for (int b = 0; b < 2; b++) {
        cfgs[nc++] = (cfg){backends[b], false, tmp_path, "/tmp"};
        cfgs[nc++] = (cfg){backends[b], true, tmp_path, "/tmp"};
        cfgs[nc++] = (cfg){backends[b], true, build_path, "build dir"};
    }
    for (size_t i = 0; i < nc; i++) test_random(&cfgs[i], false);
    test_random(&cfgs[2], true);
    test_random(&cfgs[1], true);
    for (size_t i = 0; i < nc; i++)
        if (cfgs[i].path == build_path || !cfgs[i].direct) test_faults(&cfgs[i]);
    test_page_cache(tmp_path, "/tmp");
    test_page_cache(build_path, "build dir");
    test_fallback(tmp_path);
    test_api_errors(tmp_path);
    test_probe(build_path, "build dir");
    unlink(tmp_path);
    unlink(build_path);
    return tap_done();
}
