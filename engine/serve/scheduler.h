/* ds41_scheduler: continuous batching of many generations over one engine.
 *
 * One engine thread runs steps.  Each step:
 *   1. applies cancellations (a queued request is dropped, a running one aborted and its KV pages
 *      freed at once) and admits queued requests in order while fewer than max_sequences run
 *      and the KV pool can hold the new prompt plus a reserve for its first tokens (prefix-cache
 *      entries are evicted, least recently used first, to make room);
 *   2. builds ONE ds41_forward batch: one token for every sequence that is decoding, then
 *      prefill chunks (at most prefill_chunk tokens each, max_batch_tokens in all) of sequences
 *      still reading their prompt, oldest first -- so prefill interleaves with decode and a long
 *      prompt never stalls the sequences already generating;
 *   3. samples the next token of every sequence whose prompt is complete
 *      (engine/serve/generate.h) and delivers the text to the request's sink; finished sequences leave
 *      the batch, their KV goes to the prefix cache.
 * A batch the pool cannot hold (ds41_forward would fail with "KV cache full") is avoided before
 * the call: prefix-cache entries are evicted first, then the most recently admitted running
 * sequence is preempted (its request ends with DS41_SCHED_KV_FULL).
 *
 * Prefix cache.  Sequences cannot be rewound past their last journaled forward call (the window
 * rings and compressor carries only hold the state at the current position; engine/model/kv_cache.h), so the cache keeps snapshots at useful positions, each a
 * ds41_kv_seq_fork (copy-on-write pages) with the token ids it consumed:
 *   - a request's prompt minus its last token, taken when prefill gets there (the last token is
 *     fed in the next step), so the same prompt again -- a retry, another sample, another client
 *     with the same conversation -- skips all but one token;
 *   - a finished request's sequence (prompt + answer), so the next turn of a conversation, whose
 *     prompt starts with the previous prompt and answer, skips them.
 * A new request forks the longest entry of its own partition (below) whose ids are a prefix of its
 * prompt (and shorter than it); usage reports those tokens as cached_tokens.  In the reference arithmetic a
 * hit gives exactly the tokens a miss gives (the forward pass does not depend on chunking).  Entries are
 * bounded by prefix_cache_max_bytes (page bytes they reference) and DS41_SCHED_MAX_CACHE_ENTRIES,
 * and evicted LRU, also whenever live sequences need their pages.
 *
 * Partitions (issue 13).  Every request and every entry belongs to a partition
 * (ds41_sched_partition): an entry is reused only by requests with the same partition key, in
 * memory and through the disk tier, whose callbacks get the partition to record and match.  Were
 * entries shared, cached_tokens (and the time to the first token) would tell one user whether
 * another user sent a guessed prompt.  ds41d derives the key from the peer's uid and the request's
 * cache_salt (ds41_scheduler_partition_make); the owner uid is kept for admin listings.
 *
 * Threads.  submit / cancel / stats / sessions may be called from any thread; sinks are called
 * on the engine thread only, one request's calls in order: any number of delta() calls, then
 * exactly one done().  A sink must not call back into the scheduler's submit (cancel is fine).
 */
#ifndef DS41_ENGINE_SCHEDULER_H
#define DS41_ENGINE_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/error.h"
#include "engine/forward/forward.h"
#include "engine/serve/generate.h"
#include "engine/serve/speculative.h"

#define DS41_SCHED_MAX_CACHE_ENTRIES 256u
/* Buckets (upper bounds) of the sequences-per-decode-step histogram; the last is +Inf. */
#define DS41_SCHED_HIST_BUCKETS 10
extern const unsigned ds41_sched_hist_bounds[DS41_SCHED_HIST_BUCKETS - 1]; /* 1 2 4 8 16 32 64 128 256 */

/* Who may reuse a prefix-cache entry: requests whose key equals the entry's (see above). */
#define DS41_SCHED_PARTITION_KEY_BYTES 32
typedef struct ds41_sched_partition {
    uint8_t key[DS41_SCHED_PARTITION_KEY_BYTES];
    int64_t owner_uid; /* the uid of the peer that sent the request, -1 = unknown (no credentials) */
} ds41_sched_partition;

/* The partition of a request from uid (-1: a peer without credentials, e.g. TCP) with salt
 * salt[0..salt_len) (NULL/0: none).  The key is SHA-256 over a domain tag, the uid -- or, with
 * share_across_users, one tag for every user -- and the salt, each length-prefixed: different
 * uids, or different salts, never share a key; with sharing on only the salt separates. */
void ds41_scheduler_partition_make(int64_t uid, bool share_across_users, const char *salt, size_t salt_len,
                                   ds41_sched_partition *out);

/* The disk tier of the prefix cache (optional; ds41d implements it with storage/snapshot_store.h).
 * Both callbacks run with no forward pass in flight (so they may allocate from and read the
 * pool) and must not call into the scheduler: restore on the engine thread WITHOUT the
 * scheduler's lock (a file read must not stall submit or stats), evicted with the lock held (keep
 * it short: copy, do not write).  Only used with prefix_cache on. */
typedef struct ds41_sched_disk {
    /* A prompt ids[0..n) of partition `part` missed the in-memory prefix cache: return a new
     * sequence of `pool` holding the state after the longest proper prefix of it stored for the
     * same partition key, with that prefix's length in *n_cached; NULL when there is none or it
     * cannot be restored (the request is then prefilled as usual). */
    ds41_kv_seq *(*restore)(void *ctx, ds41_kv_pool *pool, const ds41_sched_partition *part,
                            const int32_t *ids, size_t n, size_t *n_cached);
    /* An entry the scheduler computed -- a prompt minus its last token, or a finished
     * conversation (prompt + answer) -- leaves the in-memory cache: evicted, or the scheduler is
     * being freed.  The disk tier may keep it.  (Entries that came from the disk tier or from
     * ds41_scheduler_import are not handed back.)  seq, part and ids are borrowed; the disk tier
     * must record the partition with it. */
    void (*evicted)(void *ctx, const ds41_kv_seq *seq, const ds41_sched_partition *part, const int32_t *ids,
                    size_t n);
    void *ctx;
} ds41_sched_disk;

typedef struct ds41_sched_config {
    uint32_t max_sequences;    /* sequences generating at once (>= 1) */
    uint32_t max_batch_tokens; /* tokens per forward step (>= max_sequences) */
    uint32_t prefill_chunk;    /* prompt tokens per chunk (>= 1) */
    uint32_t max_queue;        /* requests waiting for a slot; more -> DS41_SCHED_QUEUE_FULL */
    uint64_t kv_budget_bytes;  /* the KV pool's budget; 0 = unlimited */
    uint32_t entries_per_page; /* 0 = DS41_KV_DEFAULT_ENTRIES_PER_PAGE */
    uint32_t admit_reserve_tokens; /* KV room a request needs beyond its prompt to be admitted
                                      (at most its max_tokens); 0 = 256 */
    bool prefix_cache;
    uint64_t prefix_cache_max_bytes; /* 0 = any page live sequences do not need */
    ds41_sched_disk disk; /* zeroed = no disk tier */
    /* Speculative decoding (engine/serve/speculative.h): with draft.draft set, after each step
     * the provider is asked (once for the step's sequences) for up to spec.max_k drafts of every
     * sequence that goes on decoding; the next step feeds each sequence's [token, drafts] with
     * its verification rows in the same batch as the others' decode and prefill rows (draft rows
     * only while max_batch_tokens has room after one row per decoding sequence).  The provider
     * is borrowed (it must outlive the scheduler) and called on the engine thread. */
    ds41_spec_config spec;
    ds41_draft_provider draft;
    /* Log lines (warnings: preemptions, errors); NULL = silent.  Engine thread. */
    void (*log)(void *log_ctx, const char *line);
    void *log_ctx;
} ds41_sched_config;

/* How a request ended (ds41_sched_sink.done). */
typedef enum ds41_sched_status {
    DS41_SCHED_DONE = 0,   /* the generation finished (see its finish reason) */
    DS41_SCHED_CANCELLED,  /* ds41_scheduler_cancel, or the scheduler stopped */
    DS41_SCHED_KV_FULL,    /* preempted: the KV pool could not hold it */
    DS41_SCHED_QUEUE_FULL, /* submit only: max_queue requests wait already */
    DS41_SCHED_STOPPING,   /* submit only: the scheduler is stopping */
    DS41_SCHED_ERROR,      /* the forward pass or sampling failed (message says why) */
    DS41_SCHED_TOO_LARGE,  /* submit only: even the whole KV pool cannot hold the request's worst case
                              (prompt + max_tokens, clipped to the context); the message names the sizes */
} ds41_sched_status;

typedef struct ds41_sched_sink {
    /* Text of one step (d->finished on the last one).  g is the request's generation (read-only
     * use: counts, tokens, result). */
    void (*delta)(void *ctx, const ds41_generation *g, const ds41_generation_delta *d);
    /* The end: status and (unless DONE) a message; g's counts and result (after DONE) are
     * final.  The generation is freed after the call. */
    void (*done)(void *ctx, const ds41_generation *g, ds41_sched_status status, const char *message);
    void *ctx;
} ds41_sched_sink;

typedef struct ds41_scheduler ds41_scheduler;

/* Start the engine thread for `engine` (borrowed; it must outlive the scheduler, which makes the
 * only ds41_forward calls on it).  Errors: a config value out of range, the KV pool, threads. */
int ds41_scheduler_new(ds41_engine *engine, const ds41_sched_config *cfg, ds41_scheduler **out, ds41_error *err);

/* Stop: refuse new requests; let running and queued ones go on for up to drain_ms; cancel what
 * is left (done() with CANCELLED); join the thread; free everything (the prefix cache too).
 * NULL is fine. */
void ds41_scheduler_free(ds41_scheduler *s, unsigned drain_ms);

/* Queue a generation (ownership passes to the scheduler, also on failure: it is freed then).
 * Returns 0 and the request id (> 0) in *id, or a refusal status (QUEUE_FULL, TOO_LARGE: the
 * request's worst case can never fit the whole pool, STOPPING) with err filled; then no sink call
 * ever happens.  A request that fits the pool but not the pages free now waits in the queue.
 * On acceptance the sink may be called before this returns. */
ds41_sched_status ds41_scheduler_submit(ds41_scheduler *s, ds41_generation *g, const ds41_sched_sink *sink,
                                        uint64_t *id, ds41_error *err);
/* The same for a request of partition `part` (copied; ds41_scheduler_submit uses one fixed
 * partition: an all-zero key, owner -1). */
ds41_sched_status ds41_scheduler_submit_in(ds41_scheduler *s, const ds41_sched_partition *part,
                                           ds41_generation *g, const ds41_sched_sink *sink, uint64_t *id,
                                           ds41_error *err);

/* Ask a request to end (client gone): done() with CANCELLED comes soon (at the next step), and
 * its KV pages are freed (not cached).  Unknown or finished ids are ignored. */
void ds41_scheduler_cancel(ds41_scheduler *s, uint64_t id);

/* Counters since start, and current levels. */
typedef struct ds41_sched_stats {
    uint64_t requests_stop, requests_length, requests_tool_calls; /* finished, by finish reason */
    uint64_t requests_cancelled, requests_kv_full, requests_error;
    uint64_t rejected_queue_full, rejected_kv_full;
    uint64_t prompt_tokens;    /* of finished requests */
    uint64_t cached_tokens;    /* prompt tokens served from the prefix cache */
    uint64_t generated_tokens; /* sampled tokens */
    uint64_t prefill_tokens;   /* prompt tokens that went through the model */
    uint64_t steps;            /* forward calls */
    uint64_t decode_steps;     /* forward calls with at least one decoding sequence */
    uint64_t decode_hist[DS41_SCHED_HIST_BUCKETS]; /* decode steps by decoding sequences (non-cumulative) */
    uint64_t decode_seqs_sum;  /* sum of decoding sequences over decode steps */
    uint64_t prefix_hits, prefix_misses;
    uint64_t disk_hits, disk_cached_tokens; /* misses of the in-memory cache served from the disk tier */
    uint64_t preemptions;
    double tokens_per_s; /* generated tokens per second over the last ~10 s */
    /* speculative decoding: verification blocks, drafts fed, drafts that stood; blocks by the
     * number of accepted drafts (0 .. DS41_SPEC_MAX_K) */
    uint64_t spec_steps, spec_drafted, spec_accepted;
    uint64_t spec_hist[DS41_SPEC_MAX_K + 1];
    uint32_t queued, running, max_running_seen;
    uint64_t cache_entries, cache_bytes; /* prefix-cache snapshots and the page bytes they reference */
    uint64_t kv_page_bytes, kv_page_tokens, kv_pages_in_use, kv_pages_max; /* pages_max 0 = unlimited */
    double kv_bytes_per_token; /* compressed-cache bytes per token of context */
} ds41_sched_stats;

void ds41_scheduler_stats(ds41_scheduler *s, ds41_sched_stats *out);

/* One holder of KV memory: a queued or running request, or a prefix-cache entry. */
typedef struct ds41_sched_session {
    char id[32];         /* "r<request id>" for requests, "c<n>" for cache entries */
    const char *state;   /* "queued", "prefill", "decode", "cached" */
    uint64_t request_id; /* 0 for cache entries */
    uint64_t prompt_tokens, generated_tokens, cached_tokens;
    uint64_t kv_tokens;  /* tokens whose KV the sequence holds */
    uint64_t kv_pages, kv_bytes; /* pages referenced (shared ones included) and their bytes */
    int64_t created, last_used;  /* unix seconds */
    int64_t owner_uid;           /* its partition's owner (-1 = unknown); for admins */
} ds41_sched_session;

/* Calls emit once per session (under the scheduler's lock: keep it short, do not call back). */
void ds41_scheduler_sessions(ds41_scheduler *s, void (*emit)(void *acc, const ds41_sched_session *sess), void *acc);

/* Delete a session by id: a cache entry is freed, a request cancelled.  0, or -1 when no such
 * session exists. */
int ds41_scheduler_delete_session(ds41_scheduler *s, const char *id);

/* A copy of a session's state for a snapshot (ds41_scheduler_export). */
typedef struct ds41_sched_export {
    ds41_kv_seq *seq;      /* a fork of the session's sequence (copy-on-write; ds41_kv_seq_free it) */
    int32_t *ids;          /* the n_ids token ids it consumed (malloc'd) */
    size_t n_ids;
    uint8_t *sampler;      /* running requests: the sampler state (ds41_sampler_snapshot bytes) */
    size_t sampler_len;
    ds41_sched_partition part; /* the session's partition (a snapshot must keep it) */
} ds41_sched_export;

/* Copy the state of session `id` (see ds41_sched_session): a cache entry "c<n>" at once, a
 * running request "r<n>" by the engine thread between two steps (this call waits for it).  The
 * copy shares pages with the session (copy on write) and stays valid whatever the session does
 * next.  Errors: no such session, a queued request (nothing computed yet), a request with
 * nothing fed yet, the scheduler stopping, out of memory. */
int ds41_scheduler_export(ds41_scheduler *s, const char *id, ds41_sched_export *out, ds41_error *err);
void ds41_scheduler_export_free(ds41_sched_export *x);

/* Put a serialized sequence (ds41_kv_seq_deserialize bytes, borrowed) that consumed ids[0..n)
 * into the in-memory prefix cache as an entry of partition `part` (a snapshot's recorded one;
 * done by the engine thread between two steps; this call waits).  *entry_id (may be NULL) receives the
 * entry's session id ("c<n>").  Errors: the prefix cache is off, the bytes are refused (engine/model/kv_cache.h),
 * their token count is not n, the pool is full, the scheduler is stopping. */
int ds41_scheduler_import(ds41_scheduler *s, const ds41_sched_partition *part, const uint8_t *kv,
                          size_t kv_len, const int32_t *ids, size_t n, char entry_id[32], ds41_error *err);

/* Drop every prefix-cache entry (e.g. before unloading). */
void ds41_scheduler_clear_cache(ds41_scheduler *s);

#endif
