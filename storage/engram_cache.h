/* ds41_engram_cache: the Engram row tier (issue 7, item 4).
 *
 * The Engram tables (REFERENCE.md §6.4: per Engram layer an e4m3 table
 * [rows][head_dim] and its ue8m0 scales [rows][head_dim/32]) are ~203 GB in
 * the release, far more than a workstation holds, yet a step reads only
 * n_cols rows per token and layer.  When the engine's Engram budget does not
 * cover the tables, rows are read from the shards on demand through a
 * ds41_reader (storage/reader.h: io_uring, O_DIRECT with aligned bounce
 * ranges, many rows per submission), never by touching the mmap, and kept in
 * this cache.
 *
 * Entries
 *   One entry = one table row: its e4m3 payload and its ue8m0 scale bytes,
 *   read as two requests (the payload and the scales live in two tensors).
 *   They cannot be one read: the release layout (and ds41-mkmodel's) puts
 *   the `.scale` tensor [rows][head_dim/32] right after the `.weight`
 *   tensor [rows][head_dim], so row r's scale lies rows x head_dim - r x
 *   (head_dim - head_dim/32) bytes after its payload, never less than
 *   rows x head_dim/32 + head_dim (11.5 MB on the bench preset, ~3 GB in
 *   the release): never within one aligned range, nor one 8 KiB read.
 *   Instead both reads of every row a request or gather needs go to the
 *   reader in ONE submission.  With O_DIRECT each read is one 4 KiB block,
 *   so a row costs 8 KiB from the device (bytes_device / rows_read).
 *   The budget pays for entries and their bookkeeping:
 *   capacity = budget / (payload + scale bytes + DS41_ENGRAM_ENTRY_OVERHEAD).
 *   A capacity of 0 is legal: every row is then read straight into the
 *   caller's buffer ("bypass" reads) and nothing is kept.
 *
 * Policy: LRU over the rows that are ready and not pinned.
 *   - ds41_engram_cache_request() (called when token ids become known: all
 *     rows of a prefill chunk at the start of the step, the sampled token's
 *     rows before the next decode step) starts reads for the rows that are
 *     neither ready nor in flight, one submission for the whole batch, and
 *     PINS every requested row it holds: pinned rows are never evicted, so
 *     what a step asked for stays until the step has used it.  A row that
 *     finds no free or evictable entry is not read early (counted as
 *     dropped); the gather reads it when needed.
 *   - ds41_engram_cache_unpin_all() ends the step: every pin goes (the engine
 *     calls it at the end of each forward call, successful or not, so pins
 *     from a prefetch that was never followed by a step cannot accumulate
 *     beyond one step).
 *   - Entries whose read is in flight are never evicted (their buffer belongs
 *     to the reader).
 *   - ds41_engram_cache_gather() copies rows out: ready rows at once (moved to
 *     the most recently used end), rows in flight when they arrive, absent
 *     rows are read (into a free or evicted entry, else straight into the
 *     output), all of them in one submission.  Because rows are copied out,
 *     a gather needs no entry beyond the capacity: any budget works, a budget
 *     smaller than one step's rows included (it only costs re-reads).
 *
 * Errors
 *   A failed read (I/O error, end of file, a truncated shard) of a row a
 *   gather needs fails the gather with a message naming the tensor and the
 *   shard file ("layers.1.engram.embed.weight in model-00001-of-00002
 *   .safetensors: read of 1024 bytes at offset ...: Input/output error ...").
 *   The entry is dropped (a later gather retries the read).  A failed read
 *   of a row nobody is waiting for (a prefetch) is dropped silently and
 *   counted in read_errors.  The gather returns only after every read into
 *   the caller's buffer has completed, so the buffer may be freed at once.
 *
 * Threads: one thread drives a cache (request/gather/unpin/free: the engine
 * thread, like the reader).  ds41_engram_cache_get_stats may be called from
 * any thread at any time (the counters are guarded by a mutex). */
#ifndef DS41_STORAGE_ENGRAM_CACHE_H
#define DS41_STORAGE_ENGRAM_CACHE_H

#include "config/error.h"
#include "storage/host_alloc.h"
#include "storage/reader.h"
#include "storage/safetensors.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ds41_engram_cache ds41_engram_cache;

/* Bookkeeping bytes the budget pays per entry (hash link, LRU links, state). */
#define DS41_ENGRAM_ENTRY_OVERHEAD 48u
/* Most tables one cache serves (one per Engram layer). */
#define DS41_ENGRAM_CACHE_MAX_TABLES 64

/* One table: two tensors of the checkpoint with the same first dimension
 * (rows), row-major, each row a contiguous byte range. */
typedef struct ds41_engram_table_spec {
    const ds41_tensor *payload; /* e4m3 [rows][head_dim] */
    const ds41_tensor *scale;   /* ue8m0 [rows][head_dim/32] */
} ds41_engram_table_spec;

typedef struct ds41_engram_cache_opts {
    uint64_t budget_bytes;  /* see "Entries" */
    bool buffered;          /* do not try O_DIRECT (default: O_DIRECT where the filesystem allows) */
    ds41_reader_backend backend; /* DS41_READER_AUTO by default */
    unsigned queue_depth;   /* reads in flight (more wait in the reader's queue); 0 = 1024.  The
                             * reader's bounce buffers (queue_depth x 12 KiB with O_DIRECT) come
                             * on top of the budget. */
    /* Where the entries' bytes come from (storage/host_alloc.h; zero:
     * anonymous memory): a device backend's page-locked memory, so the
     * rows a gather hands over for upload sit in memory the device copies
     * from at bus speed. */
    ds41_host_alloc host_alloc;
} ds41_engram_cache_opts;

/* Make a cache over n_tables tables of ckpt (borrowed: it must outlive the
 * cache).  Creates its own reader and adds the shards holding the tables
 * (their paths for O_DIRECT, the checkpoint's descriptors for buffered
 * reads).  Errors (err names the tensor): n_tables 0 or above
 * DS41_ENGRAM_CACHE_MAX_TABLES, a NULL tensor, tensors of different row
 * counts or whose size is not rows * row bytes, rows of different widths
 * across tables, a row wider than 1 MiB, a reader that cannot be created, out
 * of memory. */
ds41_engram_cache *ds41_engram_cache_new(const ds41_checkpoint *ckpt, const ds41_engram_table_spec *tables,
                                         size_t n_tables, const ds41_engram_cache_opts *opts, ds41_error *err);

/* Wait for reads in flight, free everything.  NULL is fine. */
void ds41_engram_cache_free(ds41_engram_cache *c);

/* Entries the budget pays for, and the bytes of one row (payload, scales). */
size_t ds41_engram_cache_capacity(const ds41_engram_cache *c);
size_t ds41_engram_cache_row_bytes(const ds41_engram_cache *c);
size_t ds41_engram_cache_scale_bytes(const ds41_engram_cache *c);

/* The cache's reader (owned by the cache): for fault injection in tests and
 * for the backend name / O_DIRECT state in diagnostics.  Calls on it follow
 * the reader's one-thread rule (the thread driving the cache). */
ds41_reader *ds41_engram_cache_reader(ds41_engram_cache *c);

/* Start reads of rows[0..n) of `table` that are neither ready nor in flight
 * and pin every requested row the cache holds (see "Policy"); duplicates are
 * fine.  Does not wait.  Errors: table or a row out of range (nothing is
 * started), the reader refusing the submission. */
int ds41_engram_cache_request(ds41_engram_cache *c, uint32_t table, const int64_t *rows, size_t n,
                              ds41_error *err);

/* Copy rows[0..n) of `table` into payload_out[n][row_bytes] and
 * scale_out[n][scale_bytes], reading what is missing and waiting for what is
 * in flight.  Errors: table or a row out of range (nothing touched), a read
 * failure (message naming tensor and shard; see "Errors"), the reader
 * failing.  The outputs' contents are unspecified after an error. */
int ds41_engram_cache_gather(ds41_engram_cache *c, uint32_t table, const int64_t *rows, size_t n,
                             uint8_t *payload_out, uint8_t *scale_out, ds41_error *err);

/* Drop every pin (end of a step).  NULL is fine. */
void ds41_engram_cache_unpin_all(ds41_engram_cache *c);

/* Reap completions that have already arrived (no waiting), which also hands
 * the reader's queued reads to the device as slots free up: the engine calls
 * it between layers so a step's requested rows keep flowing while it
 * computes.  Returns 0 or -1 when the reader fails. */
int ds41_engram_cache_poll(ds41_engram_cache *c, ds41_error *err);

/* Statistics since creation or the last reset.  Per gather, each distinct
 * row counts once as a use: a HIT when it was in the cache before the step
 * asked for it (no read for this use), else a MISS; a miss whose read had
 * completed when the gather reached it was PREFETCHED EARLY (requested at
 * the start of the step or by a decode prefetch), otherwise the gather
 * WAITED for it. */
typedef struct ds41_engram_cache_stats {
    uint64_t budget_bytes;
    uint64_t capacity;        /* entries */
    uint64_t entries_used;    /* entries holding a row or a read in flight */
    uint64_t row_bytes;       /* payload + scale bytes of one row */
    uint64_t uses;            /* distinct rows per gather, summed */
    uint64_t hits;
    uint64_t misses;
    uint64_t prefetched_early; /* of the misses */
    uint64_t waited;           /* of the misses */
    uint64_t rows_read;       /* rows read successfully (into entries or bypass) */
    uint64_t bypass_reads;    /* rows read straight into a gather's output (no entry free) */
    uint64_t prefetch_dropped; /* requested rows not read early: no free or evictable entry */
    uint64_t evictions;
    uint64_t read_errors;     /* failed row reads (needed or not) */
    uint64_t bytes_read;      /* payload + scale bytes of the rows read */
    uint64_t bytes_device;    /* bytes the device returned (alignment overhead included) */
    /* Row read latency: submission to the moment the cache reaps the
     * completion (completions are reaped by every request, gather and poll,
     * so a prefetched row that lands during compute counts until the next of
     * those).  Percentiles are bucket upper bounds, 1/8 of a power of two. */
    uint64_t read_ns;         /* sum over rows read */
    uint64_t latency_p50_ns;
    uint64_t latency_p99_ns;
    uint64_t latency_max_ns;
    uint64_t gathers;
    uint64_t gather_wait_ns;  /* time gathers spent waiting for reads */
} ds41_engram_cache_stats;

void ds41_engram_cache_get_stats(const ds41_engram_cache *c, ds41_engram_cache_stats *out);
void ds41_engram_cache_reset_stats(ds41_engram_cache *c);

#endif
