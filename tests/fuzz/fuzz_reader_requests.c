/* Fuzz target for storage/reader: request sequences (offsets, lengths,
 * buffer misalignment, batching, waits by tag / in bulk / polling,
 * cancellation, injected faults) come from the input bytes; every byte a
 * successful request delivers is compared with the file's known content and
 * every failure must be explained (end of file, cancel, injected EIO).  A
 * mismatch aborts.  The file is an O_TMPFILE in /tmp (64 KiB + 1000 bytes of
 * a fixed pattern), re-opened through /proc/self/fd so that O_DIRECT is
 * exercised where /tmp supports it.
 *
 * Layout: byte 0 = flags (bit 0 pread backend, bit 1 O_DIRECT, bits 2-3
 * fault kind, bits 4-7 fault nth), byte 1 = queue depth (1..16), byte 2 =
 * chunk size (4 KiB * (1..8)); then 6-byte records: op, offset (2 bytes,
 * scaled to run past the end), length (2 bytes), buffer shift. */
#include "storage/reader.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define FSIZE (65536 + 1000)
#define MAX_REQS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int file_fd = -1;
static char file_path[64];
static unsigned char content[FSIZE];

static void setup(void) {
    if (file_fd >= 0) return;
    for (size_t i = 0; i < FSIZE; i++) content[i] = (unsigned char)(i * 131 + (i >> 8) * 7);
    file_fd = open("/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (file_fd < 0) {
        char tmpl[] = "/tmp/ds41-fuzz-reader-XXXXXX";
        file_fd = mkstemp(tmpl);
        if (file_fd < 0) abort();
        unlink(tmpl);
    }
    if (pwrite(file_fd, content, FSIZE, 0) != FSIZE) abort();
    snprintf(file_path, sizeof file_path, "/proc/self/fd/%d", file_fd);
}

static void fail(const char *what, uint64_t tag) {
    fprintf(stderr, "fuzz_reader_requests: %s (tag %llu)\n", what, (unsigned long long)tag);
    abort();
}

typedef struct slotinfo {
    ds41_read_req q;
    unsigned char *mem;
    bool submitted, done, cancelled;
} slotinfo;

static void check_completion(slotinfo *s, const ds41_read_completion *c, bool eio_armed) {
    if (s->done) fail("completion returned twice", c->tag);
    s->done = true;
    if (c->offset != s->q.offset || c->len != s->q.len || c->file != 0) fail("completion fields", c->tag);
    switch (c->error) {
    case 0:
        if (s->q.len && s->q.offset + s->q.len > FSIZE) fail("read past the end succeeded", c->tag);
        if (s->q.len && memcmp(s->q.buf, content + s->q.offset, s->q.len)) fail("wrong bytes", c->tag);
        break;
    case ENODATA:
        if (s->q.offset + s->q.len <= FSIZE) fail("end of file inside the file", c->tag);
        break;
    case ECANCELED:
        if (!s->cancelled) fail("cancelled without cancel", c->tag);
        break;
    case EIO:
        if (!eio_armed || !c->injected) fail("EIO without a fault", c->tag);
        break;
    default:
        fail("unexpected error", c->tag);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    setup();
    ds41_reader_opts o = {.backend = (data[0] & 1) ? DS41_READER_PREAD : DS41_READER_IO_URING,
                          .direct = (data[0] & 2) != 0,
                          .register_buffers = true,
                          .queue_depth = 1u + data[1] % 16,
                          .chunk_bytes = 4096u * (1u + data[2] % 8),
                          .threads = 2};
    ds41_error err;
    ds41_reader *r = ds41_reader_new(&o, &err);
    if (!r) {
        o.backend = DS41_READER_PREAD; /* io_uring may be unavailable here */
        r = ds41_reader_new(&o, &err);
        if (!r) abort();
    }
    if (ds41_reader_add_file(r, file_path, file_fd, &err) != 0) abort();
    ds41_reader_fault_kind kinds[] = {DS41_FAULT_NONE, DS41_FAULT_EIO, DS41_FAULT_SHORT, DS41_FAULT_DELAY};
    ds41_reader_fault_kind fk = kinds[(data[0] >> 2) & 3];
    ds41_reader_set_fault(r, 0, fk, (uint64_t)(data[0] >> 4), 1);
    bool eio_armed = fk == DS41_FAULT_EIO;

    slotinfo reqs[MAX_REQS];
    memset(reqs, 0, sizeof reqs);
    size_t n = 0, batch_start = 0;
    data += 3;
    size -= 3;
    for (; size >= 6 && n < MAX_REQS; data += 6, size -= 6) {
        uint8_t op = data[0];
        uint64_t off = ((uint64_t)data[1] | (uint64_t)data[2] << 8) * (FSIZE + 4096) / 65536;
        size_t len = ((size_t)data[3] | (size_t)data[4] << 8) % 20000;
        size_t shift = data[5] % 64;
        slotinfo *s = &reqs[n];
        s->mem = malloc(len + shift + 1);
        if (!s->mem) abort();
        s->q = (ds41_read_req){.file = 0, .offset = off, .len = len, .buf = s->mem + shift, .tag = n};
        n++;
        if ((op & 3) == 0 || n == MAX_REQS || size < 12) { /* submit the batch so far */
            ds41_read_req batch[MAX_REQS];
            for (size_t i = batch_start; i < n; i++) batch[i - batch_start] = reqs[i].q;
            if (ds41_reader_submit(r, batch, n - batch_start, &err) != 0) fail("submit", n);
            for (size_t i = batch_start; i < n; i++) reqs[i].submitted = true;
            batch_start = n;
        }
        ds41_read_completion c[8];
        switch ((op >> 2) & 3) {
        case 1: { /* wait by tag for some submitted request */
            size_t t = op % n;
            if (reqs[t].submitted && !reqs[t].done) {
                if (ds41_reader_wait_tag(r, t, -1, c, &err) != 1) fail("wait_tag", t);
                check_completion(&reqs[c[0].tag], c, eio_armed);
            }
            break;
        }
        case 2: { /* poll */
            long got = ds41_reader_wait(r, 0, 0, c, 8, &err);
            if (got < 0) fail("poll", 0);
            for (long i = 0; i < got; i++) check_completion(&reqs[c[i].tag], &c[i], eio_armed);
            break;
        }
        case 3: { /* cancel one */
            size_t t = op % n;
            if (reqs[t].submitted && !reqs[t].done && ds41_reader_cancel(r, t) == 1) reqs[t].cancelled = true;
            break;
        }
        default:
            break;
        }
        if (op & 0x80) break; /* free the reader with reads outstanding */
    }
    if (!(size >= 6 && (data[0] & 0x80))) {
        while (ds41_reader_outstanding(r)) {
            ds41_read_completion c[8];
            long got = ds41_reader_wait(r, 1, -1, c, 8, &err);
            if (got <= 0) fail("drain", 0);
            for (long i = 0; i < got; i++) check_completion(&reqs[c[i].tag], &c[i], eio_armed);
        }
        for (size_t i = 0; i < n; i++)
            if (reqs[i].submitted && !reqs[i].done) fail("request never completed", i);
    }
    ds41_reader_free(r);
    for (size_t i = 0; i < n; i++) free(reqs[i].mem);
    return 0;
}
