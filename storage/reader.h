/* ds41_reader: batched asynchronous reads of byte ranges of checkpoint shards
 * (issue 7, item 2).  Streamed tensors (routed experts, Engram rows) are read
 * through a reader, never by touching the shard mappings, so that what comes
 * from the device is explicit, measurable and does not fill the page cache.
 *
 * Backends
 *   - io_uring (liburing): one ring of `queue_depth` entries; a batch of
 *     requests goes to the kernel with ONE io_uring_submit.
 *   - pread threads: a pool of `threads` workers calling pread(2), used when
 *     io_uring is unavailable (io_uring_queue_init fails, e.g. ENOSYS on an old
 *     kernel or EPERM under seccomp / io_uring_disabled).  Same API and
 *     semantics; ds41_reader_warning() then says why, for the daemon's log and
 *     `ds41ctl doctor`.
 *
 * O_DIRECT
 *   With opts.direct each added file is re-opened by path with O_DIRECT and a
 *   probe read is made; when the filesystem refuses (tmpfs, some FUSE, ...)
 *   the file is read through the buffered descriptor and
 *   ds41_reader_file_direct_reason() records why.  Requests may have any
 *   offset, length and buffer alignment: a range that is not aligned to the
 *   file's direct-I/O unit (ds41_reader_file_align(), 4096 unless statx
 *   reports more) is read as the aligned covering range into an aligned
 *   bounce buffer and the wanted bytes are copied out; an already aligned
 *   request (buffer, offset and length) is read straight into the caller's
 *   buffer.  With opts.register_buffers the bounce buffers are registered
 *   with the ring (io_uring_register_buffers, read_fixed) when RLIMIT_MEMLOCK
 *   allows; otherwise they are used unregistered and
 *   ds41_reader_buffers_reason() says why.
 *
 * Requests and completions
 *   A request reads `len` bytes at `offset` of file `file` into `buf` and
 *   carries a caller tag.  Large requests are split into chunks of at most
 *   opts.chunk_bytes; at most queue_depth chunks are in flight, the rest wait
 *   in an internal FIFO (submitting more requests than the ring holds is fine).
 *   Short reads are continued until the range is complete or the file ends.
 *   A request completes once: with error 0 (all `len` bytes are in buf), or
 *   with an errno-style error (EIO and friends from the kernel; ENODATA when
 *   the file ended before offset+len; ECANCELED after ds41_reader_cancel).
 *   After a failed request the contents of buf are unspecified.
 *   ds41_reader_completion_error() turns a completion into a message naming
 *   the file path, the offset and the length.
 *
 * Ownership and threads
 *   A reader is NOT internally locked: all calls on one reader must come from
 *   one thread at a time (the engine thread that owns it).  The pread backend
 *   runs its own worker threads internally; that is invisible to the caller.
 *   A request's buffer belongs to the reader from ds41_reader_submit until
 *   the request's completion has been returned by a wait call, or until
 *   ds41_reader_free returns (which waits for reads already in the kernel /
 *   in a worker to finish, drops the rest and discards their completions).
 *
 * Fault injection (tests)
 *   ds41_reader_set_fault() is compiled in always and inert until called; it
 *   makes chosen reads fail (EIO), come back short, or complete late, so
 *   higher layers can test their error paths without a broken disk. */
#ifndef DS41_STORAGE_READER_H
#define DS41_STORAGE_READER_H

#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ds41_reader ds41_reader;

typedef enum ds41_reader_backend {
    DS41_READER_AUTO = 0,     /* io_uring, else pread threads with a warning */
    DS41_READER_IO_URING,     /* io_uring or fail */
    DS41_READER_PREAD,        /* pread thread pool */
} ds41_reader_backend;

typedef struct ds41_reader_opts {
    unsigned queue_depth;      /* chunks in flight; 0 = 32; at most 4096 */
    size_t chunk_bytes;        /* largest single read; 0 = 1 MiB; rounded up to 4096, at most 64 MiB */
    bool direct;               /* try O_DIRECT per file (see above) */
    bool register_buffers;     /* register bounce buffers with io_uring when memlock allows */
    ds41_reader_backend backend;
    unsigned threads;          /* pread backend workers; 0 = 4; at most 256 */
    /* Test knob, inert when 0: with backend AUTO or IO_URING, behave as if
     * io_uring_queue_init had failed with this errno (tests the fallback). */
    int test_uring_init_errno;
} ds41_reader_opts;

/* Create a reader.  opts may be NULL (all defaults: AUTO, buffered).  Fails
 * (NULL, err filled) on out-of-range options, when backend IO_URING was asked
 * for and the ring cannot be created, or when threads cannot be started. */
ds41_reader *ds41_reader_new(const ds41_reader_opts *opts, ds41_error *err);

/* Wait for reads already in the kernel or in a worker to finish, drop the
 * queued rest, and free everything (closing descriptors the reader opened;
 * caller descriptors stay open).  NULL is a no-op. */
void ds41_reader_free(ds41_reader *r);

/* Add a file and return its index (0, 1, ... in order of addition), or -1
 * with err filled.  path names the file in every message and is re-opened
 * with O_DIRECT when opts.direct; fd >= 0 is an open read-only descriptor of
 * the same file used for buffered reads (borrowed: it must stay open until
 * ds41_reader_free; e.g. ds41_checkpoint_shard_fd), fd < 0 makes the reader
 * open path itself.  The size is taken with fstat now
 * (ds41_reader_file_size); reads past it are still attempted, so a file that
 * was truncated or grew later is handled by what the kernel returns. */
int ds41_reader_add_file(ds41_reader *r, const char *path, int fd, ds41_error *err);

size_t ds41_reader_file_count(const ds41_reader *r);
/* For an out-of-range index: NULL / 0 / false / NULL. */
const char *ds41_reader_file_path(const ds41_reader *r, uint32_t file);
uint64_t ds41_reader_file_size(const ds41_reader *r, uint32_t file);
bool ds41_reader_file_direct(const ds41_reader *r, uint32_t file);
/* Why O_DIRECT is not used for the file ("O_DIRECT not requested",
 * "open(O_DIRECT): Invalid argument", ...); "" when it is used. */
const char *ds41_reader_file_direct_reason(const ds41_reader *r, uint32_t file);
/* Offset/length/buffer alignment used for the file's direct reads; 1 when
 * the file is read buffered. */
uint32_t ds41_reader_file_align(const ds41_reader *r, uint32_t file);

/* "io_uring" or "pread threads". */
const char *ds41_reader_backend_name(const ds41_reader *r);
/* A one-line warning for the daemon log / ds41ctl doctor (why the reader
 * fell back to pread threads), or NULL when there is nothing to say. */
const char *ds41_reader_warning(const ds41_reader *r);
/* Whether bounce buffers are registered with io_uring; when not, the reason
 * ("not requested", "no O_DIRECT file yet", "RLIMIT_MEMLOCK ...", ...). */
bool ds41_reader_buffers_registered(const ds41_reader *r);
const char *ds41_reader_buffers_reason(const ds41_reader *r);

/* ------------------------------------------------------------ requests */

typedef struct ds41_read_req {
    uint32_t file;       /* index from ds41_reader_add_file */
    uint64_t offset;     /* absolute byte offset in the file */
    size_t len;          /* bytes to read; 0 completes at once, successfully, at any offset */
    void *buf;           /* len bytes, any alignment; may be NULL when len is 0 */
    uint64_t tag;        /* returned in the completion; need not be unique */
} ds41_read_req;

typedef struct ds41_read_completion {
    uint64_t tag;
    uint32_t file;
    uint64_t offset;
    size_t len;
    int error;             /* 0, or a positive errno: EIO.., ENODATA (end of file), ECANCELED */
    uint64_t error_offset; /* file offset of the read that failed (the end of file for ENODATA) */
    bool injected;         /* the error came from ds41_reader_set_fault */
} ds41_read_completion;

/* Queue n requests (all or none: every request is validated first; an
 * invalid file index, a NULL buffer with len > 0, or offset+len past 2^63
 * fails the call with err naming the request) and hand as many chunks as
 * the queue depth allows to the backend: with io_uring by one
 * io_uring_submit.  Returns 0 or -1. */
int ds41_reader_submit(ds41_reader *r, const ds41_read_req *reqs, size_t n, ds41_error *err);

/* Requests submitted whose completion has not been returned yet. */
size_t ds41_reader_outstanding(const ds41_reader *r);

/* Drive the reads and return completed requests, oldest completion first:
 * waits until at least min_complete completions are available (min_complete
 * is clamped to max and to ds41_reader_outstanding()) or timeout_ns passes
 * (< 0: no limit; 0: poll), then stores up to max completions into out.
 * Returns how many were stored (possibly fewer than min_complete after a
 * timeout), or -1 with err filled when the backend itself fails. */
long ds41_reader_wait(ds41_reader *r, size_t min_complete, int64_t timeout_ns,
                      ds41_read_completion *out, size_t max, ds41_error *err);

/* Wait for the (oldest-submitted completed) request carrying tag, leaving
 * other completions for later waits.  Returns 1 with *out filled, 0 on
 * timeout, -1 with err filled when no outstanding request carries tag or the
 * backend fails. */
int ds41_reader_wait_tag(ds41_reader *r, uint64_t tag, int64_t timeout_ns,
                         ds41_read_completion *out, ds41_error *err);

/* Cancel every outstanding request carrying tag: chunks not yet issued are
 * dropped, and the request completes with ECANCELED once its issued chunks
 * are back (a request that already completed keeps its result).  Returns the
 * number of requests marked. */
size_t ds41_reader_cancel(ds41_reader *r, uint64_t tag);

/* 0 when c succeeded; otherwise fills err with e.g.
 *   "model-00003-of-00048.safetensors: read of 4096 bytes at offset 123:
 *    Input/output error at offset 0x7b"  or  "...: end of file at offset N
 *    (file is N bytes)" and returns -1. */
int ds41_reader_completion_error(const ds41_reader *r, const ds41_read_completion *c,
                                 ds41_error *err);

/* ------------------------------------------------------ fault injection */

typedef enum ds41_reader_fault_kind {
    DS41_FAULT_NONE = 0,  /* clear */
    DS41_FAULT_EIO,       /* the read completes with EIO (the request fails) */
    DS41_FAULT_SHORT,     /* the read returns about half of what it read (aligned to the
                           * file's unit, at least one unit); the reader must continue it */
    DS41_FAULT_DELAY,     /* the read's completion is held back by delay_ms */
} ds41_reader_fault_kind;

#define DS41_READER_ANY_FILE UINT32_MAX

/* Arm one fault (replacing any previous one): it hits the nth read issued
 * from now on (nth >= 1, counted over reads of `file`, or of every file for
 * DS41_READER_ANY_FILE) and then disarms; nth == 0 hits every matching read
 * until cleared with DS41_FAULT_NONE.  A "read" is one chunk or one
 * continuation.  delay_ms is used by DS41_FAULT_DELAY only.  Returns 0, or
 * -1 for an unknown kind. */
int ds41_reader_set_fault(ds41_reader *r, uint32_t file, ds41_reader_fault_kind kind,
                          uint64_t nth, unsigned delay_ms);

/* ----------------------------------------------------------- statistics */

typedef struct ds41_reader_stats {
    uint64_t requests;        /* submitted */
    uint64_t completed;       /* completions produced (ok or failed) */
    uint64_t failed;          /* of which failed (errors, end of file, cancelled) */
    uint64_t bytes_delivered; /* len of the requests that succeeded */
    uint64_t bytes_device;    /* bytes the read calls returned (incl. alignment overhead, re-reads) */
    uint64_t bytes_copied;    /* bytes copied from bounce buffers into callers' buffers */
    uint64_t reads;           /* read operations issued (chunks + continuations) */
    uint64_t short_reads;     /* reads that returned less than asked and were continued */
    /* Request latency, submit to completion; histogram resolution 1/8 of a power
     * of two (reported values are bucket upper bounds); 0 with no request. */
    uint64_t latency_p50_ns;
    uint64_t latency_p99_ns;
    uint64_t latency_max_ns;
} ds41_reader_stats;

void ds41_reader_get_stats(const ds41_reader *r, ds41_reader_stats *out);
void ds41_reader_reset_stats(ds41_reader *r);

/* --------------------------------------------------- bandwidth probe */

typedef struct ds41_bandwidth_probe {
    uint64_t bytes;           /* bytes read */
    double seconds;
    double bytes_per_second;
    bool direct;              /* false: O_DIRECT was refused and the figure may include the page cache */
    char backend[24];         /* reader backend used */
} ds41_bandwidth_probe;

/* The device's own sequential read bandwidth, for ds41-bench's "achieved /
 * device" ratio: drops the file's clean pages (posix_fadvise DONTNEED), then
 * reads its first min(bytes, file size) bytes (whole 4 KiB units) with O_DIRECT
 * 1 MiB reads, 32 in flight, through a ds41_reader (io_uring when available)
 * into aligned buffers, and times first submit to last completion.  This is
 * what the storage stack delivers to a streaming reader with no bounce copies
 * and no page cache, i.e. the ceiling for streamed expert reads from the file.
 * Returns 0, or -1 with err filled (open/read errors, a file under 4 KiB). */
int ds41_reader_probe_bandwidth(const char *path, uint64_t bytes, ds41_bandwidth_probe *out,
                                ds41_error *err);

#endif
