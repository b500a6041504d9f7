/* ds41_kv_cache: the per-sequence attention state of DeepSeek-V4.1, packed.
 *
 * What a sequence keeps (REFERENCE §1.6, §2.8-2.10, §6.3):
 *  - compressed entries, per kv source layer, one per `ratio` tokens: the
 *    latent (head_dim values, FP4 e2m1 + one e4m3 scale per 16) and the index
 *    key (index_head_dim values, FP4 e2m1 + one ue8m0 scale per 32).  At the
 *    released config that is 288 + 68 bytes per entry and 890 bytes per token
 *    over the four sources.  They live in fixed-size pages from a shared
 *    pool; a sequence has a page table per source.  This is the only copy:
 *    readers decode one row at a time from the packed codes.
 *  - window rings, one per attention layer: window_size rows of the rotated
 *    window KV as e4m3 codes + ue8m0 scales per 32 (the reference's FP8 QDQ).
 *  - compressor carries, per kv source with ratio > 1: the kv and score
 *    state of the incomplete group (fp32, ratio x head_dim each).
 *  - the Engram n-gram history.
 *
 * The reference stores dequantized bf16 values; the packed codes here decode
 * to exactly those values (e2m1 x e4m3 and e4m3 x 2^k are exact in bf16 for
 * every scale the quantizers produce), so storing codes changes no bit.
 *
 * Sequences fork in O(pages): the child shares every compressed page
 * (reference counted) and copies the small fixed state; the first append to
 * a shared, partly filled page copies that page (copy on write).  Freed
 * pages return to the pool's free list and are reused before the pool grows;
 * the pool never holds more than its budget.
 *
 * Every numeric byte (the pages, each sequence's rings and carries) lives in
 * the pool's memory (engine/backend/memory.h: host memory, or a backend's
 * memory the host must not dereference) and is moved only by that memory's
 * calls: upload, download, copy.  The bookkeeping (page tables, reference
 * counts, the free list, the Engram history) is host memory.  Pointers into
 * the pool's memory that this API returns are marked "backend memory": they
 * are for the backend's ops and the memory's calls only; host code reads the
 * bytes with the ds41_kv_*_read* calls.
 *
 * Thread safety: the pool is safe to share (allocation and reference counts
 * take its lock); a sequence is used by one thread at a time.  The memory's
 * calls are made by whichever thread calls the pool; a memory that must be
 * called from one thread makes its pool's users do so. */
#ifndef DS41_ENGINE_KV_CACHE_H
#define DS41_ENGINE_KV_CACHE_H

#include "config/error.h"
#include "config/model_config.h"
#include "engine/backend/memory.h"
#include "engine/model/engram_layout.h"

#include <stddef.h>
#include <stdint.h>

#define DS41_KV_MAX_SOURCES 16
#define DS41_KV_DEFAULT_ENTRIES_PER_PAGE 64

/* Geometry derived from the config; the same for every sequence of a pool. */
typedef struct ds41_kv_layout {
    int n_layers;                          /* config roles (backbone + mtp) */
    int n_sources;                         /* kv source layers */
    int source_layer[DS41_KV_MAX_SOURCES]; /* layer id of each source, ascending */
    int source_ratio[DS41_KV_MAX_SOURCES];
    int source_carry[DS41_KV_MAX_SOURCES]; /* index into the carries, -1 for ratio 1 */
    int *source_of_layer;                  /* [n_layers]: source a layer reads (role.kv_from), -1 */
    int *ring_of_layer;                    /* [n_layers]: window ring of a present layer, -1 */
    int n_rings;
    int n_carries;

    uint32_t latent_dim;      /* head_dim */
    uint32_t index_dim;       /* index_head_dim */
    uint32_t latent_bytes;    /* latent_dim/2 codes + latent_dim/16 e4m3 scales */
    uint32_t index_bytes;     /* index_dim/2 codes + index_dim/32 ue8m0 scales */
    uint32_t entry_bytes;     /* latent_bytes + index_bytes */
    uint32_t entries_per_page;
    uint32_t page_bytes;      /* entries_per_page * entry_bytes */

    uint32_t window;          /* window_size */
    uint32_t ring_row_bytes;  /* head_dim e4m3 codes + head_dim/32 ue8m0 scales */
} ds41_kv_layout;

typedef struct ds41_kv_pool ds41_kv_pool;
typedef struct ds41_kv_seq ds41_kv_seq;

typedef struct ds41_kv_pool_stats {
    uint64_t page_bytes;
    uint64_t pages_in_use;    /* referenced by at least one sequence */
    uint64_t pages_allocated; /* memory the pool holds (in use + free list) */
    uint64_t pages_max;       /* budget / page_bytes */
    uint64_t bytes_in_use;    /* pages_in_use * page_bytes */
    uint64_t sequences;       /* live sequences */
} ds41_kv_pool_stats;

/* A pool for a finalized config whose pages, rings and carries live in mem
 * (which outlives the pool).  budget_bytes caps the compressed pages (0 =
 * unlimited); entries_per_page 0 = DS41_KV_DEFAULT_ENTRIES_PER_PAGE.  Pages
 * are taken lazily, in chunks of at most 64, never beyond the budget.
 * Errors: unfinalized config, a dim that does not fit the packing (head_dim %
 * 16, index_head_dim % 32), more kv sources than DS41_KV_MAX_SOURCES, out of
 * memory. */
ds41_kv_pool *ds41_kv_pool_new_in(const ds41_memory *mem, const ds41_model_config *cfg, uint64_t budget_bytes,
                                  uint32_t entries_per_page, ds41_error *err);
/* ds41_kv_pool_new_in(&ds41_memory_host, ...). */
ds41_kv_pool *ds41_kv_pool_new(const ds41_model_config *cfg, uint64_t budget_bytes, uint32_t entries_per_page,
                               ds41_error *err);
/* The memory the pool's pages, rings and carries live in. */
const ds41_memory *ds41_kv_pool_memory(const ds41_kv_pool *pool);
/* Frees the pool; every sequence must have been freed before. */
void ds41_kv_pool_free(ds41_kv_pool *pool);
const ds41_kv_layout *ds41_kv_pool_layout(const ds41_kv_pool *pool);
void ds41_kv_pool_get_stats(ds41_kv_pool *pool, ds41_kv_pool_stats *out);

/* A new empty sequence (position 0, rings empty, carries reset, Engram
 * history empty).  NULL on out of memory (err says so). */
ds41_kv_seq *ds41_kv_seq_new(ds41_kv_pool *pool, ds41_error *err);
/* A copy of seq sharing its compressed pages (copy on write). */
ds41_kv_seq *ds41_kv_seq_fork(const ds41_kv_seq *seq, ds41_error *err);
/* Release the sequence and its page references.  NULL is allowed. */
void ds41_kv_seq_free(ds41_kv_seq *seq);
ds41_kv_pool *ds41_kv_seq_pool(const ds41_kv_seq *seq);

/* Tokens the sequence has consumed (the next token's position).  The
 * forward pass advances it after a chunk's state is complete. */
uint64_t ds41_kv_seq_tokens(const ds41_kv_seq *seq);
void ds41_kv_seq_set_tokens(ds41_kv_seq *seq, uint64_t n);

/* ---- compressed entries -------------------------------------------------- */

/* Entries stored for a source (= compressed positions 0 .. n-1). */
uint64_t ds41_kv_seq_entries(const ds41_kv_seq *seq, int source);

/* Append the next entry of a source: `latent` (latent_dim values, rotated,
 * bf16-representable; host memory) is FP4 1x16 e4m3-scale quantized,
 * `index_key` (index_dim values, rotated; host memory) FP4 1x32 ue8m0
 * quantized, both packed on the host and uploaded into the entry.  Error
 * (the sequence unchanged) when the pool's budget is exhausted: "KV cache
 * full (N pages of B bytes)". */
int ds41_kv_seq_append(ds41_kv_seq *seq, int source, const float *latent, const float *index_key,
                       ds41_error *err);

/* The same with the entry already packed (entry_bytes, as
 * ds41_kv_pack_entry writes it) in backend memory of the pool's memory (the
 * engine's scratch): the quantization ran elsewhere (a backend op over all of
 * a step's entries), the cache only copies the bytes (memory copy).  Same
 * errors. */
int ds41_kv_seq_append_packed(ds41_kv_seq *seq, int source, const uint8_t *entry, ds41_error *err);

/* The packed form of one entry (the format above) into entry[entry_bytes];
 * all host memory. */
void ds41_kv_pack_entry(const ds41_kv_layout *l, const float *latent, const float *index_key, uint8_t *entry);

/* The packed entry `entry` (< ds41_kv_seq_entries) of a source: backend
 * memory; valid until the next append to the sequence or its release. */
const uint8_t *ds41_kv_seq_entry(const ds41_kv_seq *seq, int source, uint64_t entry);
/* Its entry_bytes into out (host memory): one download. */
void ds41_kv_seq_read_entry(const ds41_kv_seq *seq, int source, uint64_t entry, uint8_t *out);

/* The page table of a source: the ids of the pages holding entries 0, 1, ...
 * (entries_per_page each), *n_pages of them; valid until the next append to
 * the sequence or its release.  With ds41_kv_pool_page the forward pass
 * describes every row's entries to an op per page, not per entry
 * (engine/backend/ops.h: ds41_kv_pages). */
const uint32_t *ds41_kv_seq_page_ids(const ds41_kv_seq *seq, int source, uint32_t *n_pages);

/* The bytes of page `id` of the pool (entries_per_page packed entries of
 * entry_bytes): backend memory; valid for the pool's life. */
const uint8_t *ds41_kv_pool_page(const ds41_kv_pool *pool, uint32_t id);

/* Decode a packed entry's latent / index key to its exact values.  entry is
 * host memory (ds41_kv_seq_read_entry's copy; the reference backend's ops,
 * whose memory is host memory, pass pool pointers). */
void ds41_kv_decode_latent(const ds41_kv_layout *l, const uint8_t *entry, float *out);
void ds41_kv_decode_index_key(const ds41_kv_layout *l, const uint8_t *entry, float *out);

/* ---- window rings ---------------------------------------------------------- */

/* Store the rotated window KV of token `pos` of a layer (head_dim values,
 * bf16-representable; host memory) in slot pos % window as e4m3 + ue8m0 per
 * 32 (the reference's act_quant QDQ): packed on the host, one upload. */
void ds41_kv_ring_write(ds41_kv_seq *seq, int layer, uint64_t pos, const float *kv);
/* The same for a row already packed in the ring's format (ring_row_bytes,
 * as ds41_act_quant writes it) in backend memory of the pool's memory (the
 * engine's scratch): a memory copy into slot pos % window. */
void ds41_kv_ring_put(ds41_kv_seq *seq, int layer, uint64_t pos, const uint8_t *row);

/* The packed row in a slot: backend memory.  A ring's slots are
 * contiguous: slot s is ds41_kv_ring_row(seq, layer, 0) + s * ring_row_bytes
 * (a backend op reaches a ring from its base). */
const uint8_t *ds41_kv_ring_row(const ds41_kv_seq *seq, int layer, uint32_t slot);
/* Its ring_row_bytes into out (host memory): one download. */
void ds41_kv_ring_read_row(const ds41_kv_seq *seq, int layer, uint32_t slot, uint8_t *out);
/* A packed row's decoding (exact values); row is host memory. */
void ds41_kv_decode_ring_row(const ds41_kv_layout *l, const uint8_t *row, float *out);

/* ---- compressor carries and Engram history ------------------------------ */

/* The carry of a ratio > 1 source: kv_state and score_state, each
 * [ratio][latent_dim] fp32, slot = position % ratio: backend memory (the
 * forward pass writes them by ops and memory calls).  NULL for ratio 1.  A
 * new sequence's are kv 0, score -inf. */
float *ds41_kv_carry_kv(ds41_kv_seq *seq, int source);
float *ds41_kv_carry_score(ds41_kv_seq *seq, int source);
/* Both into kv and score (host memory, ratio * latent_dim floats each; NULL
 * skips one): a download each.  -1 (nothing written) for a ratio-1 source. */
int ds41_kv_carry_read(const ds41_kv_seq *seq, int source, float *kv, float *score);

/* Write the carry slot of token `pos` (slot pos % ratio) of a ratio > 1 source: kv and score
 * are latent_dim fp32 each in backend memory of the pool's memory (memory copies; journaled,
 * see below).  No-op for a ratio-1 source.  The forward pass writes carries only through this. */
void ds41_kv_carry_put(ds41_kv_seq *seq, int source, uint64_t pos, const float *kv, const float *score);

ds41_engram_history *ds41_kv_seq_engram(ds41_kv_seq *seq);
/* Push the next token's compressed id onto the Engram history (journaled, see below); the
 * forward pass pushes only through this. */
int ds41_kv_seq_engram_push(ds41_kv_seq *seq, int32_t compressed_id_or_dead, ds41_error *err);

/* ---- journal: rewinding a sequence (speculative decoding) ------------------ */

/* Speculative decoding feeds drafts that may be rejected: the sequence must go back to the
 * position after the last accepted token as if the rejected ones had never been fed.  Between
 * ds41_kv_seq_journal_begin and _end every write to the sequence's state is journaled: a ring
 * slot's or carry slot's previous bytes are saved (memory copies inside the pool's memory, no
 * host round trip) the first time a position writes it, the Engram pushes are recorded, and the
 * forward pass writes every row of a chunk to the rings (not only the last window_size ones).
 * ds41_kv_seq_rewind(seq, j) then restores the slots of positions j.. newest first, truncates
 * every source to j / ratio entries (pages no longer needed go back to the pool; a page copied on
 * write stays the sequence's own copy), rebuilds the Engram history and sets the token count:
 * the sequence then serializes to the same bytes as one that only ever consumed j tokens, and
 * continues with the same logits bit for bit.  It may be rewound several times, and fed again,
 * inside one journal.  A fork made while a journal is open has none.
 *
 * begin: positions tokens .. tokens + max_rows - 1 can be journaled (ds41_forward refuses a
 * chunk beyond that, before any state changes).  Errors: already active, max_rows 0, out of
 * memory.  The journal's buffers are kept for the next begin (freed with the sequence). */
int ds41_kv_seq_journal_begin(ds41_kv_seq *seq, uint32_t max_rows, ds41_error *err);
bool ds41_kv_seq_journal_active(const ds41_kv_seq *seq);
/* Tokens the open journal can still take (UINT64_MAX without one). */
uint64_t ds41_kv_seq_journal_room(const ds41_kv_seq *seq);
/* Errors (nothing changes): no journal, tokens outside [the begin's position, current], more
 * positions written than the journal could take. */
int ds41_kv_seq_rewind(ds41_kv_seq *seq, uint64_t tokens, ds41_error *err);
/* Stop journaling (the state stays as it is). */
void ds41_kv_seq_journal_end(ds41_kv_seq *seq);

/* ---- accounting ------------------------------------------------------------ */

/* Pages the sequence references (shared pages included) and their bytes. */
uint64_t ds41_kv_seq_pages(const ds41_kv_seq *seq);
uint64_t ds41_kv_seq_page_bytes(const ds41_kv_seq *seq);
/* Pages a sequence of this layout references once it has consumed `tokens` tokens, sharing
 * none: the most a request that consumes that many tokens ever takes from the pool. */
uint64_t ds41_kv_pages_for_tokens(const ds41_kv_layout *l, uint64_t tokens);
/* Pages the pool must give the sequence for it to consume n_tokens more: fresh pages, plus a
 * copy of each partly filled last page it shares with a fork and appends to (copy on write). */
uint64_t ds41_kv_seq_pages_to_grow(const ds41_kv_seq *seq, uint64_t n_tokens);
/* Fixed per-sequence state: rings + carries + history. */
uint64_t ds41_kv_seq_state_bytes(const ds41_kv_seq *seq);

/* ---- serialization (session snapshots) ------------------------------------ */

/* The whole state of one sequence as bytes, so it can be written to disk and
 * restored in another process: a restored sequence continues exactly as the
 * original would (same logits, bit for bit).  Format "DS41KVSQ" version 1,
 * little-endian, canonical (equal states give equal bytes):
 *
 *   magic "DS41KVSQ", u32 version,
 *   u32 n_sources, n_rings, n_carries, latent_dim, index_dim, window,
 *       entry_bytes, ring_row_bytes, u32 ratio[n_sources],
 *   u64 tokens, u64 entries[n_sources]           (entries = tokens / ratio)
 *   the packed entries of each source in order   (entries x entry_bytes;
 *                                                 independent of the page size)
 *   the window rings                             (n_rings x window x ring_row_bytes)
 *   the carries as fp32 bit patterns             (per ratio>1 source: kv, score)
 *   the Engram history: i64 n_pushed, i32 recent[DS41_ENGRAM_MAX_NGRAM]
 *
 * The layout fields must equal the reading pool's (a snapshot of another
 * geometry is refused); the model's identity is the file format's business
 * (storage/snapshot.h). */

/* Exact size of ds41_kv_seq_serialize's output. */
size_t ds41_kv_seq_serialized_size(const ds41_kv_seq *seq);
/* The serialized size of any sequence of this layout that consumed `tokens` tokens (a bound
 * for readers of untrusted snapshots). */
uint64_t ds41_kv_serialized_size_for(const ds41_kv_layout *l, uint64_t tokens);
/* Writes the state into buf[cap] (host memory: the pool's bytes are
 * downloaded into it, one call per page, one for the rings, one for the
 * carries); *written = the size.  Error when cap is too small.  Reads seq
 * only (the caller makes sure no forward pass writes it). */
int ds41_kv_seq_serialize(const ds41_kv_seq *seq, uint8_t *buf, size_t cap, size_t *written, ds41_error *err);
/* A new sequence of pool rebuilt from buf[len] (host memory; untrusted: it is
 * checked on the host, then uploaded; every count and size is checked against
 * the pool's layout and the length, every packed scale and code must be a
 * finite value, unused ring slots and Engram slots must be zero, trailing
 * bytes are an error).  Errors name the field ("kv snapshot: source 2 has 7
 * entries, 40 tokens at ratio 4 need 10"); pages come from the pool ("KV
 * cache full" when its budget is exhausted).  *out is NULL on error and
 * nothing is left allocated. */
int ds41_kv_seq_deserialize(ds41_kv_pool *pool, const uint8_t *buf, size_t len, ds41_kv_seq **out,
                            ds41_error *err);

#endif
