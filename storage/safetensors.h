/* safetensors checkpoints: open a Hugging Face model directory, validate every
 * header, index the tensors, and write new checkpoints.
 *
 * File format (https://github.com/huggingface/safetensors): an 8-byte
 * little-endian u64 N, then N bytes of JSON
 *     {"__metadata__": {"k": "v", ...},
 *      "name": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
 * then the data region.  data_offsets are relative to the start of the data
 * region (absolute file offset 8 + N).
 *
 * A checkpoint directory is either
 *   - sharded: `model.safetensors.index.json`
 *         {"metadata": {"total_size": T}, "weight_map": {"tensor": "shard file", ...}}
 *     plus the shard files it names (DeepSeek-V4.1-Flash: 48 shards
 *     `model-000NN-of-00048.safetensors`, 96,085 tensors, ~510 GB), or
 *   - single-file: `model.safetensors` and no index.
 * If both are present the index wins (the way vLLM loads a directory).
 *
 * Everything read from disk is untrusted.  Opening validates all headers and
 * the index against each other, and fails with one message naming the file
 * and, where there is one, the tensor at fault (config/error.h).  Opening never
 * reads a payload byte: headers are read with pread(2) with readahead disabled,
 * shards are mapped read-only without MAP_POPULATE and advised MADV_RANDOM.
 * Payload pages are faulted in only when the caller touches tensor->data. */
#ifndef DS41_STORAGE_SAFETENSORS_H
#define DS41_STORAGE_SAFETENSORS_H

#include "config/error.h"

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------- dtypes */

/* The element types ds41 accepts in a header.  Other safetensors dtypes
 * (F64, I16, U16, F8_E5M2, ...) are rejected as unsupported. */
typedef enum ds41_dtype {
    DS41_BF16,     /* "BF16"    2 bytes */
    DS41_F16,      /* "F16"     2 bytes */
    DS41_F32,      /* "F32"     4 bytes */
    DS41_F8_E4M3,  /* "F8_E4M3" 1 byte, FP8 e4m3fn weights (REFERENCE.md §1.1) */
    DS41_F8_E8M0,  /* "F8_E8M0" 1 byte, ue8m0 scales (REFERENCE.md §1.2) */
    DS41_I8,       /* "I8"      1 byte, also packed FP4 E2M1 pairs (REFERENCE.md §1.3) */
    DS41_U8,       /* "U8"      1 byte */
    DS41_I32,      /* "I32"     4 bytes */
    DS41_I64,      /* "I64"     8 bytes */
    DS41_BOOL,     /* "BOOL"    1 byte */
    DS41_DTYPE_COUNT
} ds41_dtype;

/* The exact safetensors dtype string ("BF16", "F8_E4M3", ...); "?" for a
 * value outside the enum.  The string is static. */
const char *ds41_dtype_name(ds41_dtype dtype);

/* Bytes per element; 0 for a value outside the enum. */
size_t ds41_dtype_size(ds41_dtype dtype);

/* Look up the dtype whose safetensors string is exactly s[0..len) (case
 * sensitive, no NUL needed).  Returns 0 and stores it in *out, or -1 (and
 * leaves *out alone) when the string is not one of the ten names above. */
int ds41_dtype_from_name(const char *s, size_t len, ds41_dtype *out);

/* --------------------------------------------------------------- tensors */

#define DS41_MAX_DIMS 8

/* Largest accepted header length N.  The real index file is 7.4 MB and a
 * shard header is smaller; anything past this cap is treated as corrupt. */
#define DS41_ST_MAX_HEADER_BYTES ((uint64_t)100 << 20)

typedef struct ds41_tensor {
    const char *name;           /* NUL-terminated, owned by the header/checkpoint */
    ds41_dtype dtype;
    int ndim;                   /* 0..DS41_MAX_DIMS; 0 = scalar (one element) */
    int64_t shape[DS41_MAX_DIMS]; /* shape[ndim..] are 0 */
    uint64_t nbytes;            /* product(shape) * dtype size == end - begin */
    uint32_t shard;             /* index into the checkpoint's shards (0 from the parser) */
    uint64_t file_offset;       /* absolute offset of the payload in the shard file */
    const void *data;           /* payload inside the read-only mapping (NULL from the parser);
                                 * aligned to the element size when the writer below (or
                                 * Hugging Face) wrote the file, not guaranteed for others;
                                 * never dereference it when nbytes is 0.  Touching it
                                 * faults pages in from disk. */
} ds41_tensor;

/* ------------------------------------------------- header parser (pure) */

typedef struct ds41_st_metadata {
    const char *key;            /* NUL-terminated, owned by the header */
    const char *value;
} ds41_st_metadata;

typedef struct ds41_st_header {
    uint64_t header_len;        /* N, the JSON length */
    uint64_t data_start;        /* 8 + N: absolute offset of the data region */
    uint64_t data_size;         /* file_size - data_start */
    uint64_t payload_bytes;     /* sum of every tensor's nbytes */
    size_t tensor_count;
    ds41_tensor *tensors;       /* sorted by name (strcmp); shard = 0, data = NULL */
    size_t metadata_count;
    ds41_st_metadata *metadata; /* "__metadata__" entries in file order; none if absent */
    char *strings;              /* internal: the storage behind every name/key/value */
} ds41_st_header;

/* Parse and validate one safetensors header.
 *
 * file_prefix[0..prefix_len) are the first bytes of a file of file_size bytes;
 * they must cover the 8-byte length and the whole JSON (8 + N bytes); more is
 * fine and ignored.  file_label names the file in error messages (a path or
 * a file name; NULL reads as "<safetensors>").  Nothing here touches the
 * file system, so this is also the fuzzing entry point.
 *
 * Checks (each failure -> -1 with "LABEL: [tensor 'NAME': ]what is wrong"):
 *   - the file holds the 8-byte length; N <= DS41_ST_MAX_HEADER_BYTES;
 *     8 + N <= file_size (otherwise: truncated file); prefix_len >= 8 + N;
 *   - the JSON parses (UTF-8, no trailing garbage, duplicate keys rejected)
 *     and is an object;
 *   - "__metadata__", if present, is an object whose values are strings;
 *   - every other key is a non-empty tensor name whose value is an object
 *     with exactly "dtype" (a string naming a ds41_dtype), "shape" (an array
 *     of at most DS41_MAX_DIMS non-negative integers) and "data_offsets" (an
 *     array of two non-negative integers begin <= end);
 *   - product(shape) * dtype size, computed with overflow checks, equals
 *     end - begin; end lies inside the data region (file_size - 8 - N);
 *   - no two non-empty payload spans overlap (gaps are accepted; empty
 *     tensors may sit anywhere in the data region; bytes after the last
 *     payload are accepted too -- the safetensors library is stricter).
 *
 * On success fills *out (which the caller then owns: release it with
 * ds41_checkpoint_header_free) and returns 0.  On failure returns -1 and leaves *out
 * empty (safe to pass to ds41_checkpoint_header_free). */
int ds41_checkpoint_parse_header(const uint8_t *file_prefix, size_t prefix_len, uint64_t file_size,
                                 const char *file_label, ds41_st_header *out, ds41_error *err);

/* Release what ds41_checkpoint_parse_header allocated and zero *h.  NULL and an
 * already freed or zeroed header are fine. */
void ds41_checkpoint_header_free(ds41_st_header *h);

/* -------------------------------------------------- index parser (pure) */

typedef struct ds41_st_index_entry {
    const char *tensor;         /* NUL-terminated, owned by the index */
    uint32_t shard;             /* index into shard_names */
} ds41_st_index_entry;

typedef struct ds41_st_index {
    size_t shard_count;
    const char **shard_names;   /* distinct shard file names, strcmp order */
    const char **shard_first_tensor; /* per shard: the first tensor (file order) mapped to it */
    size_t entry_count;
    ds41_st_index_entry *entries; /* weight_map in file order */
    int has_total_size;         /* metadata.total_size was present */
    uint64_t total_size;
    char *strings;              /* internal: the storage behind every string */
} ds41_st_index;

/* Parse and validate `model.safetensors.index.json` from json[0..len) (no
 * NUL needed).  file_label names the file in messages (NULL reads as
 * "<index>").  Checks: len <= DS41_ST_MAX_HEADER_BYTES; valid JSON with no
 * duplicate keys; a top-level object; "metadata", if present, an object
 * whose "total_size", if present, is a non-negative integer (a real with an
 * integral value is accepted); "weight_map" a non-empty object whose values
 * are plain shard file names (non-empty, no '/', no "..", no control
 * characters).  Other top-level keys are ignored.  Nothing is checked
 * against the file system here.
 *
 * Returns 0 with *out filled (release with ds41_checkpoint_index_free), or -1 with
 * err filled and *out empty. */
int ds41_checkpoint_parse_index(const uint8_t *json, size_t len, const char *file_label, ds41_st_index *out,
                                ds41_error *err);

/* Release what ds41_checkpoint_parse_index allocated and zero *idx.  NULL is fine. */
void ds41_checkpoint_index_free(ds41_st_index *idx);

/* ------------------------------------------------------------ checkpoint */

typedef struct ds41_checkpoint ds41_checkpoint;

#define DS41_ST_INDEX_NAME "model.safetensors.index.json"
#define DS41_ST_SINGLE_NAME "model.safetensors"

/* Open the checkpoint in directory dir (see the top of this file for the two
 * layouts).  Reads the index and every shard header, maps every shard, and
 * validates, on top of ds41_checkpoint_parse_header's checks per shard:
 *   - the index is a JSON object (duplicate keys rejected, at most
 *     DS41_ST_MAX_HEADER_BYTES long); "weight_map" is an object of strings;
 *     "metadata", if present, is an object; metadata.total_size, if present,
 *     is a non-negative integer equal to the sum of all payload bytes;
 *   - every shard name is a plain file name (non-empty, no '/', no "..");
 *   - every shard named exists and is a regular file (the error names the
 *     shard and one tensor the index maps to it);
 *   - every tensor in the index is in the shard the index names, every
 *     tensor of a shard is mapped to that shard by the index, and no tensor
 *     name appears in two shards.
 * Shards are numbered in strcmp order of their file names.
 *
 * Shard headers are parsed on up to 16 threads; with several bad shards the
 * error is about the first by name, so messages do not depend on timing.
 *
 * Returns the checkpoint (release with ds41_checkpoint_close) or NULL with
 * err filled.  Symlinks are followed (Hugging Face cache snapshots are
 * symlinks to blobs).  After opening, the checkpoint is read-only: every
 * query below is safe from any number of threads.  Shard files should not
 * be truncated or rewritten in place while the checkpoint is open (replacing
 * one with rename(2) is harmless: the old file stays mapped; bytes
 * rewritten in place without shrinking the file go unnoticed).  If one is
 * truncated, touching a page past its new end raises SIGBUS: every shard
 * mapping is guarded (storage/map_guard.h), so the process survives, the
 * lost pages read as zeros, and ds41_checkpoint_check_mappings reports the
 * loss -- callers must check it after using tensor data and discard what
 * they computed from it. */
ds41_checkpoint *ds41_checkpoint_open(const char *dir, ds41_error *err);

/* Unmap every shard, close every descriptor, free everything.  Every pointer
 * obtained from the checkpoint (tensors, names, data, paths) dies with it.
 * NULL is fine. */
void ds41_checkpoint_close(ds41_checkpoint *ckpt);

/* The directory as given to ds41_checkpoint_open (a copy, owned by ckpt). */
const char *ds41_checkpoint_dir(const ds41_checkpoint *ckpt);

/* Number of tensors over all shards. */
size_t ds41_checkpoint_tensor_count(const ds41_checkpoint *ckpt);

/* Sum of nbytes over all tensors. */
uint64_t ds41_checkpoint_payload_bytes(const ds41_checkpoint *ckpt);

/* Tensor i (0 <= i < tensor_count) in strcmp order of names, so iteration is
 * deterministic; NULL when i is out of range.  Owned by ckpt. */
const ds41_tensor *ds41_checkpoint_tensor_at(const ds41_checkpoint *ckpt, size_t i);

/* The tensor called name (exact match) or NULL; expected O(1) (hash table). */
const ds41_tensor *ds41_checkpoint_find(const ds41_checkpoint *ckpt, const char *name);

/* Number of shard files (1 for a single-file checkpoint). */
size_t ds41_checkpoint_shard_count(const ds41_checkpoint *ckpt);

/* Path of shard i ("DIR/NAME"), owned by ckpt; NULL when i is out of range. */
const char *ds41_checkpoint_shard_path(const ds41_checkpoint *ckpt, uint32_t i);

/* Read-only descriptor of shard i (kept open until close, O_CLOEXEC, with
 * POSIX_FADV_RANDOM set: for io_uring/pread readers); -1 when out of range.
 * Owned by ckpt: do not close it. */
int ds41_checkpoint_shard_fd(const ds41_checkpoint *ckpt, uint32_t i);

/* Size in bytes of shard i (0 when out of range). */
uint64_t ds41_checkpoint_shard_size(const ds41_checkpoint *ckpt, uint32_t i);

/* Start of shard i's read-only mapping (the whole file, page aligned;
 * tensor->data == base + tensor->file_offset); NULL when out of range. */
const void *ds41_checkpoint_shard_base(const ds41_checkpoint *ckpt, uint32_t i);

/* Fill in the page tables of a tensor's payload now (madvise
 * MADV_POPULATE_READ: one call, reading from disk what the page cache
 * lacks), so that the first forward steps do not take a page fault per page
 * they touch (each one expensive in a virtual machine, and a random read of
 * an Engram row or an expert is one fault per row).  Returns the bytes
 * populated; 0 where the kernel cannot (before Linux 5.14, or a shard
 * truncated under us): those pages fault in on use, as without the call. */
uint64_t ds41_checkpoint_prefault(const ds41_checkpoint *ckpt, const ds41_tensor *t);

/* Whether every shard mapping is still intact: 0, or -1 with err
 * "PATH was truncated or became unreadable while mapped (SIGBUS at offset
 * N): the model must be reloaded" for the first shard (by index) that lost
 * pages, N being the file offset of the first fault absorbed in it.  Once a
 * shard lost pages it stays lost: the checkpoint must be closed and opened
 * again.  Cheap (one atomic load when nothing was ever lost in the
 * process); safe from any thread, e.g. after every forward step. */
int ds41_checkpoint_check_mappings(const ds41_checkpoint *ckpt, ds41_error *err);

/* ---------------------------------------------------------------- writer */

/* Streaming checkpoint writer (storage/st_writer.c): the model generator
 * writes multi-GB checkpoints without holding them in memory.
 *
 *   w = ds41_checkpoint_writer_new(dir, target, &err);
 *   ds41_checkpoint_writer_declare(w, name, dtype, ndim, shape, &err);   (every tensor)
 *   ds41_checkpoint_writer_begin(w, &err);                   (headers + index on disk)
 *   ds41_checkpoint_writer_write(w, name, data, nbytes, &err);  (every tensor, same order)
 *   ds41_checkpoint_writer_finish(w, &err);                  (fsync, close)
 *   ds41_checkpoint_writer_free(w);
 *
 * Output is what Hugging Face writes: shards `model-%05d-of-%05d.safetensors`
 * (numbered from 1) plus `model.safetensors.index.json` (metadata.total_size
 * and weight_map, keys sorted, 2-space indent), or one `model.safetensors`
 * in single-file mode.  Each header is compact JSON with
 * "__metadata__": {"format": "pt"} first, then the tensors in declaration
 * order, padded with spaces so the data region starts at a multiple of 8.
 * Inside a shard, payloads are laid out by element size, largest first
 * (stable), with no gaps: every payload is aligned to its element size, and
 * strict readers (the safetensors library) accept the file.
 *
 * Any failure leaves the writer failed: every later call returns -1 with the
 * same message.  Existing files of the same names in dir are overwritten;
 * nothing is ever deleted. */
typedef struct ds41_st_writer ds41_st_writer;

/* Start a writer into directory dir (which must exist).  A new shard starts
 * when adding the next tensor would take the current shard past
 * shard_target_bytes of payload (a shard always holds at least one tensor, so
 * a bigger tensor gets a shard of its own); 0 means no limit.  Returns NULL
 * with err filled when dir is not a directory or memory runs out. */
ds41_st_writer *ds41_checkpoint_writer_new(const char *dir, uint64_t shard_target_bytes, ds41_error *err);

/* Switch to single-file mode: everything goes to `model.safetensors`, no
 * index; shard_target_bytes is ignored and ds41_checkpoint_writer_break_shard fails.
 * Only before the first declare.  Returns 0 or -1. */
int ds41_checkpoint_writer_single_file(ds41_st_writer *w, ds41_error *err);

/* Declare the next tensor (before begin).  name: non-empty UTF-8, not
 * "__metadata__", not declared before (copied).  shape: ndim (0..8)
 * non-negative dims; the byte size must fit in 64 bits.  Returns 0 or -1. */
int ds41_checkpoint_writer_declare(ds41_st_writer *w, const char *name, ds41_dtype dtype, int ndim,
                                   const int64_t *shape, ds41_error *err);

/* Make the next declared tensor start a new shard (before begin; a break
 * before the first tensor or right after another break does nothing).
 * Returns 0, or -1 after begin or in single-file mode (the writer is then
 * failed, and the next call that takes an ds41_error reports why). */
int ds41_checkpoint_writer_break_shard(ds41_st_writer *w);

/* Assign shards, create the shard files with their headers and (sharded
 * mode) write the index.  Needs at least one declared tensor.  Returns 0 or -1. */
int ds41_checkpoint_writer_begin(ds41_st_writer *w, ds41_error *err);

/* Write the payload of the next tensor in declaration order: name must be
 * that tensor's name and nbytes its declared size (data may be NULL when
 * nbytes is 0).  Returns 0 or -1. */
int ds41_checkpoint_writer_write(ds41_st_writer *w, const char *name, const void *data, size_t nbytes,
                                 ds41_error *err);

/* Check that every declared tensor was written, fsync and close every file
 * and the directory.  Returns 0 or -1. */
int ds41_checkpoint_writer_finish(ds41_st_writer *w, ds41_error *err);

/* Free the writer and close any file it still has open (an unfinished
 * checkpoint stays on disk as it is).  NULL is fine. */
void ds41_checkpoint_writer_free(ds41_st_writer *w);

#endif
