/* ds41_engine: the DeepSeek-V4.1 text forward pass (REFERENCE.md §2, §6, §9,
 * §10) over a loaded checkpoint.
 *
 * A ds41_engine owns the parsed config, the open checkpoint (mmapped), the
 * bound weights, the Engram layout and compressed token map (from the
 * checkpoint's tokenizer.json), per-layer rope tables, and the op backend.
 * Per-sequence state lives in engine/model/kv_cache.h sequences (window rings,
 * packed compressed entries, compressor carries, Engram history), created
 * from a pool made for the engine's config (ds41_engine_new_pool).
 *
 * The forward pass takes a batch of items, each a chunk of any length of one
 * sequence at that sequence's current position (ds41_kv_seq_tokens): a
 * prompt in one go, a prompt in chunks, or one decode token for each of many
 * sequences.  Results do not depend on how a sequence's tokens are chunked or
 * batched: in the reference mode, prefill(all) = chunked prefill =
 * token-by-token decode bit for bit (REFERENCE §9.3, §10.7).
 *
 * Decisions (REFERENCE §9) applied: index-source layers always score their own
 * kv source's index keys (§9.1); every top-k and the greedy argmax break ties
 * toward the lower index (§9.2); a chunk at any position is the natural
 * extension (§9.3): the window is ring + chunk, the compressor carry
 * continues, the indexer's visibility and top-k are per query.
 *
 * Thread safety: one ds41_forward call at a time per engine (it uses the
 * engine's scratch and its backend's); an engine is otherwise immutable after
 * load.
 *
 * Modes: the reference mode (opts.reference) is the canonical arithmetic of
 * REFERENCE §10, bit-exact against the numpy reference; the default is the
 * fast CPU backend (engine/backend/cpu/cpu_backend.h): threads and SIMD, the same rounding
 * points, fp32 sums in its own fixed order, checked layer by layer against
 * the reference.  In both, a sequence's results do not depend on how its
 * tokens are chunked or what shares its batch. */
#ifndef DS41_ENGINE_FORWARD_H
#define DS41_ENGINE_FORWARD_H

#include "config/error.h"
#include "config/model_config.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/model/kv_cache.h"
#include "engine/backend/ops.h"
#include "engine/model/weights.h"
#include "storage/expert_cache.h"
#include "storage/engram_cache.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ds41_engine ds41_engine;

/* Expert read prediction (engine/forward/moe.c).  NEXT: layer L+1's router on layer
 * L's FFN input, while L's experts load (a layer ahead, the least accurate).
 * EARLY: layer L's router on its FFN input without the attention output
 * (h entering L through the FFN's pre-mix and norm), before L's attention
 * runs (less lead time, far more accurate).  BOTH: the two. */
typedef enum ds41_expert_predict {
    DS41_XPREDICT_DEFAULT = 0, /* EARLY */
    DS41_XPREDICT_NEXT,
    DS41_XPREDICT_EARLY,
    DS41_XPREDICT_BOTH,
} ds41_expert_predict;

/* "next", "early", "both" (and "default") -> the mode; -1 for anything else. */
int ds41_expert_predict_parse(const char *s);
const char *ds41_expert_predict_name(ds41_expert_predict p);

/* Where a load stands (ds41_engine_opts.progress). */
typedef enum ds41_load_stage { DS41_LOAD_BINDING = 0, DS41_LOAD_PLACING, DS41_LOAD_DONE } ds41_load_stage;
typedef struct ds41_load_progress {
    ds41_load_stage stage;
    uint64_t tensors_done, tensors_total;
    uint64_t bytes_done, bytes_total;
} ds41_load_progress;

typedef struct ds41_engine_opts {
    /* Use the canonical reference arithmetic (REFERENCE §10): the reference
     * backend, whatever `backend` says. */
    bool reference;
    /* The backend (engine/backend/backend.h) when !reference; NULL = the fast CPU
     * backend made with `cpu`.  A backend given here belongs to the engine
     * from the call on (freed with it, and when the load fails or reference
     * is set). */
    ds41_backend *backend;
    /* Options of the fast CPU backend (threads, pinning, SIMD level cap);
     * zero-initialised = defaults. */
    ds41_cpu_opts cpu;
    /* Routed-expert tier (storage/expert_cache.h, issue 7): the bytes of a
     * slot pool into which the experts a step routes to are read from the
     * shards (io_uring, O_DIRECT), never through the mapping.  0, or a
     * budget covering every routed expert of the text layers: all resident,
     * used in place from the mapping (the default).  A budget below one
     * expert fails the load with the minimum in the message. */
    uint64_t expert_cache_bytes;
    /* With a backend computing on device memory (be->mem not host memory):
     * the bytes of the host tier between the device slots above and the
     * shards (storage/expert_cache.h, "Host tier"), in host memory from
     * be->mem->host_alloc (page-locked) when it has one; at least the
     * device budget.  0: the host staging slots are as many as the device
     * slots.  Ignored while the experts are resident or on host memory. */
    uint64_t host_expert_cache_bytes;
    bool expert_no_predict; /* no prediction at all (for comparisons) */
    /* Which predictions start expert reads before a layer's router runs
     * (ignored with expert_no_predict); logits do not depend on it. */
    ds41_expert_predict expert_predict;
    /* Candidates predicted beyond each token's top-k (its next-best experts
     * by the router's selection score; 0 = just the top-k): more of the
     * layer's experts arrive early, at the price of reads nobody uses. */
    unsigned expert_predict_extra;
    bool expert_buffered;   /* expert reads through the page cache instead of O_DIRECT */
    /* Engram row tier (storage/engram_cache.h): bytes of memory for Engram
     * table rows.  0, or a budget covering every Engram table (payload +
     * scales), keeps the tables on the checkpoint's mapping (resident, read
     * in place).  A smaller budget streams the rows: they are read from the
     * shards through an io_uring reader, never through the mapping, as soon
     * as their token ids are known (all positions of a forward call's chunks
     * at its start; the next decode token with ds41_engine_prefetch), into a
     * row cache of this many bytes.  Logits are the same bit for bit. */
    uint64_t engram_cache_bytes;
    /* Load progress (optional): called from the loading thread as the
     * weights are bound (after the globals and after each layer, stage
     * DS41_LOAD_BINDING), before and after the backend places them
     * (DS41_LOAD_PLACING), and once when the engine is ready (DS41_LOAD_DONE,
     * done == total).  Tensors and bytes are those of the config's tensor
     * plan.  It must be cheap; whoever reads the figures from another thread
     * keeps them in atomics. */
    void (*progress)(void *ctx, const struct ds41_load_progress *p);
    void *progress_ctx;
} ds41_engine_opts;

/* Load DIR (a checkpoint in the Hugging Face release layout: shards + index
 * or model.safetensors, inference/config.json, tokenizer.json when the
 * config has Engram layers).  opts may be NULL (defaults: the fast CPU
 * backend with one thread per CPU).  Errors name the
 * file, key or tensor at fault: config invalid, a tensor missing or of the
 * wrong dtype/shape, engram_num_embeddings not matching the prime layout,
 * the tokenizer's compressed token map not matching
 * engram_compressed_vocab_size or its size not matching vocab_size, a shard
 * truncated while the load read it (ds41_engine_check_mappings' message). */
ds41_engine *ds41_engine_load(const char *dir, const ds41_engine_opts *opts, ds41_error *err);

/* Free the engine (weights, checkpoint mapping).  Every pool made for it
 * may outlive it (pools only reference the config layout they copied).
 * NULL is fine. */
void ds41_engine_free(ds41_engine *e);

const ds41_model_config *ds41_engine_config(const ds41_engine *e);
const ds41_weights *ds41_engine_weights(const ds41_engine *e);
const ds41_ops *ds41_engine_ops(const ds41_engine *e);

/* Whole pages of the checkpoint mapping that hold nothing but routed-expert
 * bytes (codes and scales) of the text layers, as sorted disjoint address
 * ranges [start, end): what must stay out of the page cache when the experts
 * are streamed, for ds41-bench's mincore check and the tests.  Returns a
 * malloc'd array (free() it) and *n, or NULL with *n = 0 when there is none
 * or memory ran out. */
typedef struct ds41_page_range {
    uintptr_t start, end;
} ds41_page_range;
ds41_page_range *ds41_engine_expert_only_pages(const ds41_engine *e, size_t *n);

/* How many pages of the ranges are in the page cache (mincore(2)); pages
 * whose state cannot be read count as absent. */
uint64_t ds41_page_ranges_resident(const ds41_page_range *r, size_t n);
/* The engine's backend (owned by the engine): its counters, level, threads. */
ds41_backend *ds41_engine_backend(const ds41_engine *e);

/* ---- routed-expert tier ----
 * Whether the routed experts are streamed (a budget below their total). */
bool ds41_engine_experts_streamed(const ds41_engine *e);

/* Change the expert budget (same meaning as opts.expert_cache_bytes),
 * switching between resident and streamed as needed; an engine that loaded
 * with streamed experts on a backend that then left them out of its memory
 * (ds41_weights.experts_streamed) keeps streaming, and a budget of 0 or
 * above their total becomes a cache holding all of them.  Only between
 * ds41_forward calls, from the thread that calls them.  Errors (nothing
 * changes): below one expert slot, out of memory, the reader failing. */
int ds41_engine_set_expert_budget(ds41_engine *e, uint64_t bytes, ds41_error *err);

/* The same from any thread, for a running server: checked now (below one
 * expert slot -> error naming the minimum), applied by the next ds41_forward
 * call before it starts (if applying fails, e.g. out of memory, the old
 * budget stays and ds41_engine_expert_stats shows it). */
int ds41_engine_request_expert_budget(ds41_engine *e, uint64_t bytes, ds41_error *err);

/* The tier's figures (storage/expert_cache.h); any thread, any time.
 * Returns true when streamed (out filled, counters reset after reading when
 * reset), false when all experts are resident (out zeroed except
 * total_bytes / budget_bytes when known). */
bool ds41_engine_expert_stats(ds41_engine *e, ds41_expert_cache_stats *out, bool reset);

/* The tier's reader while streamed (its fault hook for tests: the daemon's
 * test-only engine.test_fault_* keys), else NULL.  Same thread rule as
 * ds41_engine_set_expert_budget. */
ds41_reader *ds41_engine_expert_reader(ds41_engine *e);

/* A KV pool for this engine's config (see ds41_kv_pool_new). */
ds41_kv_pool *ds41_engine_new_pool(const ds41_engine *e, uint64_t budget_bytes, uint32_t entries_per_page,
                                   ds41_error *err);

/* Compressed id of a token (the Engram token map), or -1 when the model has
 * no Engram layers or the id is out of range. */
int32_t ds41_engine_compressed_id(const ds41_engine *e, int32_t token);

/* One chunk of one sequence in a forward batch. */
typedef struct ds41_fwd_item {
    ds41_kv_seq *seq;    /* from a pool of this engine; positions start at ds41_kv_seq_tokens(seq) */
    const int32_t *ids;  /* n_ids token ids, each < vocab_size */
    size_t n_ids;        /* >= 1 */
    float *logits;       /* NULL: no logits; else [n_ids][vocab] (all positions) or [vocab] (last_only) */
    bool logits_last_only;
    /* DSpark (REFERENCE §7, engine/forward/dspark.h): also compute every
     * row's taps and write the DSpark stages' window rings at the rows'
     * positions (what ds41_dspark_draft reads).  An error when the model has
     * no DSpark stages. */
    bool spec_taps;
} ds41_fwd_item;

/* Streams reported to a hook (REFERENCE §10.1 names in brackets). */
typedef enum ds41_stream_kind {
    DS41_STREAM_H = 0,  /* [hc][dim] entering block `layer` before its Engram; layer = n_layers: after the last block (P.h.L) */
    DS41_STREAM_PRE,    /* [hc] block `layer`'s incoming attention pre-mix (P.pre.L) */
    DS41_STREAM_ATTN,   /* [dim] attention branch output, after wo_b (P.attn.L) */
    DS41_STREAM_FFN,    /* [dim] MoE branch output (P.ffn.L) */
    DS41_STREAM_LOGITS, /* [vocab] logits of the position (P.logits), layer = -1 */
} ds41_stream_kind;

/* Decisions reported to a hook (REFERENCE §10.1 names in brackets), with
 * the scores they were made from. */
typedef enum ds41_decision_kind {
    /* Every layer with a compressed part: the compressed entries its
     * attention reads, ascending (P.index_sel.L).  An index source also
     * gives its index scores over the reachable positions 0..reach-1 after
     * the candidate mask (-inf outside it); a reader layer gives none. */
    DS41_DECISION_INDEX = 0,
    /* The candidate source: the blocks it keeps, ascending (P.cand.L); the
     * scores are every block's max score, the newest block pinned to +inf. */
    DS41_DECISION_CAND,
    /* Every MoE layer: the routed experts in routing order (P.experts.L);
     * the scores are the selection scores sqrt(softplus(z)) + bias of every
     * expert. */
    DS41_DECISION_EXPERTS,
} ds41_decision_kind;

/* Optional observer: called for every row (token) of the batch, in layer
 * order, with the values as fp32 (valid only during the call).  item and
 * row identify the token (row = index inside the item's chunk).  LOGITS is
 * reported for the rows whose logits are computed (see ds41_fwd_item).
 * decision (may be NULL) is called for every row and decision of the
 * layers that make it, sel[0..n_sel) and score[0..n_score) valid only
 * during the call (score NULL when n_score is 0). */
typedef struct ds41_fwd_hooks {
    void (*stream)(void *ctx, ds41_stream_kind kind, int layer, size_t item, size_t row, const float *data,
                   size_t n);
    void *ctx;
    void (*decision)(void *ctx, ds41_decision_kind kind, int layer, size_t item, size_t row,
                     const int32_t *sel, size_t n_sel, const float *score, size_t n_score);
    /* Teacher forcing (may be NULL; layer-local checks, ds41-eval
     * --replay): called for every row at the start of every block, after the
     * H and PRE reports, with the row's stream h [hc][dim] and pre-mix [hc]
     * entering the block, which it may overwrite.  The block then computes
     * from the values it leaves (so what H/PRE report for block L+1 is block
     * L's output from the fed input). */
    void (*feed)(void *ctx, int layer, size_t item, size_t row, float *h, float *pre);
} ds41_fwd_hooks;

/* Run the forward pass on a batch: every item's chunk is appended to its
 * sequence (KV state updated, positions advanced by n_ids) and its logits
 * written when asked.  hooks may be NULL.
 *
 * Errors (err says which item/token): n_items == 0, an item with n_ids == 0
 * or NULL ids/seq, a sequence appearing twice, a sequence from a pool of a
 * different layout, a token id outside [0, vocab_size), not enough free KV
 * pages for the batch ("KV cache full ...").  These are checked before any
 * state changes, so the sequences are untouched.  Out of memory during the
 * pass leaves the batch's sequences in an unspecified state (free them).
 *
 * A shard truncated (or become unreadable) under the mapping while the pass
 * ran: the pass fails with ds41_engine_check_mappings' message, its logits
 * and the batch's sequences are garbage (free them); from then on every call
 * fails at once with that message: the engine must be freed and the model
 * loaded again. */
int ds41_forward(ds41_engine *e, ds41_fwd_item *items, size_t n_items, const ds41_fwd_hooks *hooks,
                 ds41_error *err);

/* ---- Engram row tier ---------------------------------------------------------------- */

/* Start reading the Engram rows the next forward call will need for `token`
 * appended to seq (the decode step after the one that sampled it): call it
 * as soon as the token is sampled, before other work (text, other
 * sequences), so the reads overlap it; the step then waits only for rows not
 * arrived yet.  Changes no sequence state (the hashes are computed on a copy
 * of seq's Engram history).  A no-op returning 0 when the tables are
 * resident or the model has no Engram layers.  Same thread rule as
 * ds41_forward (the engine thread).  Errors: token outside [0, vocab_size),
 * NULL seq, the reader refusing the reads; the forward call works without the
 * prefetch either way (it reads what is missing). */
int ds41_engine_prefetch(ds41_engine *e, ds41_kv_seq *seq, int32_t token, ds41_error *err);

/* Whether the Engram rows are streamed (a row cache exists); when they are,
 * *out gets the tier's statistics (storage/engram_cache.h; safe from any
 * thread), else *out is zeroed.  out may be NULL. */
bool ds41_engine_engram_stats(const ds41_engine *e, ds41_engram_cache_stats *out);

/* Zero the tier's statistics (no-op when resident). */
void ds41_engine_engram_reset_stats(ds41_engine *e);

/* The row cache, NULL when the tables are resident: for tests (fault
 * injection through ds41_engram_cache_reader) and diagnostics.  Engine
 * thread only. */
ds41_engram_cache *ds41_engine_engram_cache(ds41_engine *e);

/* Whether the checkpoint's mappings are intact (ds41_checkpoint_check_mappings):
 * 0, or -1 with "SHARD was truncated or became unreadable while mapped
 * (SIGBUS at offset N): the model must be reloaded".  Once lost, always
 * lost (ds41_forward fails from then on).  Any thread, any time, cheap. */
int ds41_engine_check_mappings(const ds41_engine *e, ds41_error *err);

/* Index of the largest logit, the lowest index on ties (REFERENCE §9.2).
 * NaN never wins over a number.  n >= 1. */
int32_t ds41_argmax(const float *logits, size_t n);

#endif
