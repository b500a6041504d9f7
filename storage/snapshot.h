/* ds41_snapshot: the on-disk file of one session snapshot (issue 7, part 6).
 *
 * A snapshot file holds the token ids a sequence consumed (the prefix key), the sequence's
 * serialized state (engine/model/kv_cache.h: ds41_kv_seq_serialize) and optionally its sampler state
 * (engine/serve/sampler.h: ds41_sampler_snapshot), for one model.  This module knows nothing of the
 * engine: the state is opaque bytes here.
 *
 * Format, version 2 (every integer little-endian):
 *
 *   offset  size  field
 *        0     8  magic "DS41SNAP"
 *        8     4  u32 format version (2)
 *       12     4  u32 flags: bit 0 = a sampler state follows the KV state; other bits 0
 *       16    32  model identity (ds41_snapshot_model_id)
 *       48     8  u64 n_ids            token ids (1 .. DS41_SNAPSHOT_MAX_IDS)
 *       56     8  u64 kv_len           raw bytes of the KV state (>= 1)
 *       64     8  u64 sampler_len      raw bytes of the sampler state (0 unless flag bit 0)
 *       72     8  u64 payload_len      bytes of the zstd frame below
 *       80     8  i64 created          unix seconds
 *       88    32  partition key        who may reuse the state (ds41_snapshot_owner.key)
 *      120     8  i64 owner uid        the uid of the peer whose request made it, -1 = none
 *      128     8  u64 head_check       CRC-64/XZ of bytes 0..128 followed by the ids section
 *      136  4*n   ids                  u32 each
 *        .     .  payload              one zstd frame (content size recorded) of
 *                                      kv_len + sampler_len bytes: the KV state, then the sampler
 *    end-8     8  u64 file_check       CRC-64/XZ of every byte before it
 *
 * The checksum is CRC-64/XZ (the ECMA-182 polynomial, reflected, init and xorout all ones; check
 * value 0x995DC9BBDF1939FA for "123456789"), computed by ds41_crc64.  head_check lets an index be
 * built from the head and ids alone; file_check covers the whole file.  The file length must be
 * exactly 136 + 4*n_ids + payload_len + 8.
 *
 * The partition (version 2, issue 13): a prefix-cache entry may only be reused by requests of the
 * same partition -- by default the peer's uid plus the request's cache_salt, hashed into the key
 * by the daemon -- so one local user cannot learn from cached_tokens what another one sent.  The
 * key is opaque here; the owner uid is kept for the admin listings.  Version 1 files (before
 * partitions) are refused ("format version 1 has no cache partition ..."): their owner is
 * unknown, so restoring them for anyone could leak another user's prompt; the store deletes
 * them with that log line.
 *
 * Files are written atomically: a temporary file in the same directory (named
 * ".tmp-<name>-<pid>-<n>", exclusive create, mode 0640), written, fsync'd, renamed over the final
 * name, then the directory fsync'd.  A crash leaves either the old file, the new one, or a
 * temporary file that ds41_snapshot_clean_temp removes -- never a partial snapshot under a final
 * name.
 *
 * Reading verifies everything before anything is returned: magic, version, flags, the model
 * identity, every length against the file size and the caller's bound, both checksums, the zstd
 * frame (its recorded content size must equal kv_len + sampler_len, and decoding must give
 * exactly that many bytes).  Errors name the file: "SNAP: checksum mismatch (file corrupted)",
 * "SNAP: truncated (...)", "SNAP: format version 3, this build reads 2", "SNAP: made for another
 * model".
 *
 * Threads: no global state; functions may run concurrently on different files. */
#ifndef DS41_STORAGE_SNAPSHOT_H
#define DS41_STORAGE_SNAPSHOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/error.h"
#include "config/sha256.h" /* ds41_sha256 (snapshot ids) */

#define DS41_SNAPSHOT_VERSION 2u
#define DS41_SNAPSHOT_ID_BYTES 32
#define DS41_SNAPSHOT_HEAD_BYTES 136
#define DS41_SNAPSHOT_KEY_BYTES 32
#define DS41_SNAPSHOT_MAX_IDS (1u << 24)
#define DS41_SNAPSHOT_FLAG_SAMPLER 1u

/* CRC-64/XZ of data[len], continuing from crc (start with 0). */
uint64_t ds41_crc64(uint64_t crc, const void *data, size_t len);

/* The identity of the checkpoint in dir: SHA-256 over, in this order, inference/config.json,
 * model.safetensors.index.json (when present), and for every *.safetensors file in name order its
 * name, its size, its header (8-byte length + JSON) and the first 4096 payload bytes after the
 * header.  The payload sample tells apart generated checkpoints that differ only in their seed.
 * Errors name the file that cannot be read. */
int ds41_snapshot_model_id(const char *dir, uint8_t id[DS41_SNAPSHOT_ID_BYTES], ds41_error *err);

/* The prefix-cache partition a snapshot belongs to (see above). */
typedef struct ds41_snapshot_owner {
    uint8_t key[DS41_SNAPSHOT_KEY_BYTES]; /* lookups match it exactly */
    int64_t uid;                          /* the peer's uid, -1 = no credentials */
} ds41_snapshot_owner;

/* What a snapshot holds (ds41_snapshot_read / ds41_snapshot_parse).  Owned arrays. */
typedef struct ds41_snapshot {
    uint32_t version, flags;
    uint8_t model_id[DS41_SNAPSHOT_ID_BYTES];
    int64_t created;
    ds41_snapshot_owner owner;
    int32_t *ids; /* n_ids ids (each < 2^31) */
    size_t n_ids;
    uint8_t *kv; /* kv_len bytes (NULL when only the head was read) */
    size_t kv_len;
    uint8_t *sampler; /* sampler_len bytes, NULL when none */
    size_t sampler_len;
    uint64_t file_bytes;
} ds41_snapshot;

void ds41_snapshot_free(ds41_snapshot *s);

/* Options of ds41_snapshot_write. */
typedef struct ds41_snapshot_write_opts {
    int zstd_level; /* 0 = 3 */
    /* TEST ONLY: sleep this many milliseconds after writing half of the temporary file, before
     * the rest, the fsync and the rename, so a test can kill the process in the middle of a
     * save.  0 in production. */
    unsigned test_delay_ms;
} ds41_snapshot_write_opts;

/* Write a snapshot of partition `owner` to path atomically (see above).  ids[n_ids]
 * (1..DS41_SNAPSHOT_MAX_IDS, each
 * >= 0), kv[kv_len] (>= 1 byte), sampler[sampler_len] (NULL/0 = none).  opts may be NULL.
 * *file_bytes (may be NULL) receives the file's size.  Errors name the file (no space, rights);
 * no temporary file is left behind on error. */
int ds41_snapshot_write(const char *path, const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES],
                        const ds41_snapshot_owner *owner, const int32_t *ids, size_t n_ids, const uint8_t *kv,
                        size_t kv_len, const uint8_t *sampler, size_t sampler_len,
                        const ds41_snapshot_write_opts *opts, uint64_t *file_bytes, ds41_error *err);

/* Verify and decode a whole snapshot held in memory, labelled `label` in errors.  model_id NULL =
 * any model.  max_raw bounds kv_len + sampler_len (what will be allocated).  On success *out
 * owns ids, kv and sampler; on error *out is empty. */
int ds41_snapshot_parse(const uint8_t *buf, size_t len, const char *label,
                        const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES], uint64_t max_raw, ds41_snapshot *out,
                        ds41_error *err);

/* Read and verify the file at path (as ds41_snapshot_parse). */
int ds41_snapshot_read(const char *path, const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES], uint64_t max_raw,
                       ds41_snapshot *out, ds41_error *err);

/* Read only the head and the ids (head_check verified, the file length consistent with the
 * head); kv stays NULL.  For building an index without reading payloads. */
int ds41_snapshot_read_head(const char *path, const uint8_t model_id[DS41_SNAPSHOT_ID_BYTES],
                            ds41_snapshot *out, ds41_error *err);

/* Remove the temporary files a crashed writer may have left in dir (names starting ".tmp-").
 * Returns how many were removed (-1 when dir cannot be read). */
int ds41_snapshot_clean_temp(const char *dir);

#endif
