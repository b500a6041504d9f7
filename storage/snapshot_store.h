/* ds41_snapshot_store: a directory of session snapshots of one model -- the disk tier of the
 * prefix cache (issue 7, part 6).
 *
 * Files.  DIR/<name>.snap, the format of storage/snapshot.h; <name> is 40 lowercase hex digits,
 * the first 20 bytes of the SHA-256 of the snapshot's partition key followed by its token ids (u32
 * little-endian each), so a token sequence has exactly one file per partition and saving it again
 * replaces it; the same ids of two partitions are two files.
 *
 * Partitions (issue 13).  Every snapshot belongs to the partition recorded in its file
 * (ds41_snapshot_owner: the key the daemon derives from the peer's uid and cache_salt, and the
 * owner uid).  A lookup names the partition and sees only that partition's snapshots, also after
 * a restart, so one user's prompt is never restored for another (nor revealed by cached_tokens).
 *
 * Temporary files of crashed writers (".tmp-*") are removed when the store opens.
 *
 * Index.  An in-memory table of every valid snapshot's token ids, rebuilt when the store opens
 * from each file's head and ids (head_check verified; the payload is not read).  Files named like
 * snapshots that are not valid snapshot heads (truncated, corrupted, another format version --
 * version 1 files, which predate partitions, among them) or
 * were made for another model (the model under this name was replaced) are logged and deleted:
 * they could never be restored.  ds41_snapshot_store_match picks the longest snapshot whose ids are a proper
 * prefix of a prompt (a linear scan: one comparison of at most the snapshot's length per snapshot). Loading
 * verifies the whole file (storage/snapshot.h); a file that fails is logged with the reason, dropped from the
 * index and deleted, and the caller falls back to prefill.
 *
 * Capacity.  max_bytes caps the files' total size: after every save the least recently used
 * snapshots (by last save or load; the file's mtime carries it across restarts) are deleted
 * until the total fits (the one just saved is kept even if it alone is larger).
 *
 * Writes.  ds41_snapshot_store_save writes synchronously; ds41_snapshot_store_save_async hands
 * the buffers to the store's writer thread (so an engine thread never waits on the disk; at most
 * 1 GiB of state waits, beyond that a save is dropped with an error);
 * ds41_snapshot_store_flush and ds41_snapshot_store_free wait for queued writes.
 *
 * Threads: every function may be called from any thread. */
#ifndef DS41_STORAGE_SNAPSHOT_STORE_H
#define DS41_STORAGE_SNAPSHOT_STORE_H

#include "storage/snapshot.h"

#define DS41_SNAPSHOT_NAME_LEN 40

typedef struct ds41_snapshot_store ds41_snapshot_store;

typedef struct ds41_snapshot_store_opts {
    const char *dir; /* created (mode 0750, parents too) when missing */
    uint8_t model_id[DS41_SNAPSHOT_ID_BYTES];
    uint64_t max_bytes; /* 0 = no cap */
    /* The most raw state bytes (KV + sampler) a snapshot of n_ids tokens can have for this model
     * (the bound reads allocate against); NULL = 1 GiB + 64 MiB. */
    uint64_t (*max_raw)(void *ctx, size_t n_ids);
    void *max_raw_ctx;
    ds41_snapshot_write_opts write; /* zstd level; test_delay_ms is TEST ONLY */
    /* Log lines (skipped and refused files, failed writes); NULL = silent.  Any thread. */
    void (*log)(void *ctx, const char *line);
    void *log_ctx;
} ds41_snapshot_store_opts;

typedef struct ds41_snapshot_entry {
    char name[DS41_SNAPSHOT_NAME_LEN + 1];
    size_t n_ids;
    ds41_snapshot_owner owner;  /* its partition (key and owner uid) */
    uint64_t bytes;             /* file size */
    int64_t created, last_used; /* unix seconds */
    bool has_sampler;
} ds41_snapshot_entry;

typedef struct ds41_snapshot_store_stats {
    uint64_t entries, bytes, max_bytes;
    uint64_t hits, misses; /* ds41_snapshot_store_match */
    uint64_t loads, load_errors, saves, save_errors, evictions;
    uint64_t restored_tokens; /* ids of successful loads */
} ds41_snapshot_store_stats;

/* Open (creating the directory), clean temporary files, build the index.  Errors: the directory
 * cannot be created or read, out of memory. */
int ds41_snapshot_store_open(const ds41_snapshot_store_opts *opts, ds41_snapshot_store **out,
                             ds41_error *err);
/* Wait for queued writes, stop the writer, free.  NULL is fine. */
void ds41_snapshot_store_free(ds41_snapshot_store *st);

/* The name of ids[0..n) in the partition of `owner` (its key; 40 hex digits + NUL). */
void ds41_snapshot_store_name(const ds41_snapshot_owner *owner, const int32_t *ids, size_t n,
                              char name[DS41_SNAPSHOT_NAME_LEN + 1]);

/* The longest snapshot of owner's partition (the same key) whose ids are a proper prefix of
 * ids[0..n): its length (0 = none) and name.  Counts a hit or a miss. */
size_t ds41_snapshot_store_match(ds41_snapshot_store *st, const ds41_snapshot_owner *owner,
                                 const int32_t *ids, size_t n, char name[DS41_SNAPSHOT_NAME_LEN + 1]);

/* Whether a snapshot of exactly ids[0..n) is indexed in owner's partition. */
bool ds41_snapshot_store_contains(ds41_snapshot_store *st, const ds41_snapshot_owner *owner,
                                  const int32_t *ids, size_t n);

/* Read and verify snapshot `name` (40 hex digits) into *out (ds41_snapshot_free).  It becomes
 * the most recently used.  Errors name the file; a file that fails verification is deleted
 * and leaves the index; an unknown or malformed name: "no snapshot NAME". */
int ds41_snapshot_store_load(ds41_snapshot_store *st, const char *name, ds41_snapshot *out, ds41_error *err);

/* Write a snapshot of ids[0..n) in owner's partition now (replacing one of the same ids and
 * partition), then apply the cap.  *entry (may be NULL) describes it. */
int ds41_snapshot_store_save(ds41_snapshot_store *st, const ds41_snapshot_owner *owner, const int32_t *ids,
                             size_t n, const uint8_t *kv, size_t kv_len, const uint8_t *sampler,
                             size_t sampler_len, ds41_snapshot_entry *entry, ds41_error *err);

/* Queue a save; ids and kv (malloc'd) are taken over, also on error (then freed); owner is
 * copied. */
int ds41_snapshot_store_save_async(ds41_snapshot_store *st, const ds41_snapshot_owner *owner, int32_t *ids,
                                   size_t n, uint8_t *kv, size_t kv_len, ds41_error *err);
/* Wait until every queued save is written (or failed). */
void ds41_snapshot_store_flush(ds41_snapshot_store *st);

/* Delete snapshot `name`.  -1 when there is none. */
int ds41_snapshot_store_remove(ds41_snapshot_store *st, const char *name, ds41_error *err);

/* Calls emit once per snapshot, most recently used first (under the store's lock: keep it
 * short). */
void ds41_snapshot_store_list(ds41_snapshot_store *st, void (*emit)(void *acc, const ds41_snapshot_entry *e),
                              void *acc);
void ds41_snapshot_store_get_stats(ds41_snapshot_store *st, ds41_snapshot_store_stats *out);
const char *ds41_snapshot_store_dir(const ds41_snapshot_store *st);

#endif
