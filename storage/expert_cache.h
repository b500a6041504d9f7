/* ds41_expert_cache: the routed-expert storage tier (issue 7, item 3).
 *
 * When the routed experts of a checkpoint do not fit the memory budget
 * (memory.expert_cache_bytes), the engine keeps a pool of slots in anonymous
 * memory and reads the experts a step routes to from the checkpoint shards
 * through a ds41_reader (storage/reader.h: io_uring, O_DIRECT with aligned
 * bounce ranges), never by touching the shards' mapping.
 *
 * Slots
 *   One slot holds one routed expert of one text layer: w1, w2, w3 payloads
 *   (FP4/FP8 codes) and their ue8m0 scales, laid out as the expert's tensors
 *   lie in the shard (adjacent tensors of the same shard are read as one
 *   range; ranges are 64-byte aligned in the slot).  The slot size is the
 *   largest expert's; the pool has floor(budget / slot size) slots, at least
 *   one (a smaller budget is refused with an error naming the minimum).
 *   Outside the budget: the reader's bounce buffers (queue depth x ~1 MiB,
 *   64 MiB by default; reads land straight in the slots, the bounce buffers
 *   serve only ranges that end at an unaligned end of file) and the index
 *   (4 bytes per routed expert).
 *
 *   Where the backend computes (opts.slot_memory, engine/backend/memory.h):
 *   with host memory (NULL or &ds41_memory_host: the CPU backends) the views
 *   point into the slots the reads land in.  With another memory (a device
 *   backend's) the slots above become the staging tier and the cache keeps a
 *   twin pool of the same number of slots in that memory (one allocation):
 *   when an expert's read has completed, before its view is first handed
 *   out (by wait, wait_some), its slot's bytes go to the twin slot in one
 *   upload; the views point into the twin, and a hit hands the twin out
 *   again without uploading (a new load into the slot makes the twin stale).
 *   The cache never touches the twin's bytes itself.  The budget counts the
 *   twin pool's bytes (what the device holds); without a host tier of its
 *   own (opts.host_tier_bytes 0) the host staging slots are as many.
 *
 * Host tier (issue 15: device slots above a host tier above NVMe)
 *   With a twin pool and opts.host_tier_bytes, the host slots are a tier of
 *   their own: floor(host_tier_bytes / slot size) of them (at most every
 *   expert; fewer than the device slots is refused, since every device load
 *   is staged in a host slot until its upload), kept across device-budget
 *   changes.  Reads land in host slots only.  A device miss whose expert the
 *   host tier holds (or is reading) costs one upload and no read (host_hits);
 *   otherwise a host slot is evicted, read (io_uring, as above) and then
 *   uploaded.  A device slot holds its host slot (a pin there) from the
 *   miss until its upload; after that the host slot stays cached.  Each tier
 *   has its own LFU-with-aging policy below; the host tier counts the
 *   device misses it serves.  A prediction with no device slot free still
 *   reads its expert into the host tier (predict_host), so the layer's miss
 *   costs an upload only.  A failed read empties its host slot at once.
 *   Host slot memory comes from opts.host_alloc (a device backend's
 *   page-locked memory, so uploads run at bus speed).
 *
 * Pinning and waves
 *   ds41_expert_cache_acquire pins the experts a layer needs: hits first (so
 *   a miss never evicts an expert the same request needs), then one slot per
 *   miss, evicting unpinned experts.  It pins as many as there are slots and
 *   says which; the caller computes those, releases them and acquires the
 *   rest (a "wave").  So a step whose layer routes to more experts than the
 *   pool holds still works, at the price of re-reading; the arithmetic per
 *   expert is the same, so the results are bit-identical.  All misses of one
 *   acquire go to the reader in ONE batched submission.
 *
 * Policy: LFU with aging, LRU among equals.  Every use (a hit or a load)
 *   adds one to the slot's counter; every 8 x slots uses every counter is
 *   halved, so old popularity fades.  The victim is the unpinned, not
 *   in-flight slot with the lowest counter, the least recently used among
 *   those.  Decoding walks the layers in a cycle longer than the pool holds,
 *   where pure LRU evicts everything before its next use; the frequency term
 *   keeps the experts the router favours resident and lets newcomers churn
 *   through the least valuable slots.
 *
 * Prediction
 *   ds41_expert_cache_predict starts reads for the experts the caller
 *   expects a layer to use before its router runs (engine/forward/moe.c: layer L's
 *   router on its FFN input without the attention output, before L's
 *   attention; and/or layer L+1's router on layer L's FFN input), into slots
 *   not pinned now, in the order given (likeliest first); those slots carry
 *   a prediction pin until that layer's acquire (which keeps the used ones
 *   and drops the rest) or ds41_expert_cache_end_step.  Several predictions
 *   for one layer add up.  Statistics count the experts predicted (once per
 *   layer and step), how many of them the layer then used, and how many were
 *   still in flight when it asked.
 *
 * Computing as reads complete
 *   ds41_expert_cache_wait_some hands out the pinned experts whose reads
 *   have finished, so the caller computes those (and the hits) while the
 *   rest still load; ds41_expert_cache_wait waits for all of them.
 *
 * Errors
 *   A failed read (EIO, a short file, an injected fault) fails
 *   ds41_expert_cache_wait with a message naming the shard, the offset and
 *   the expert's tensors; the slot is emptied at release, so a later request
 *   reads again.  A failed read of a PREDICTED expert never fails a request
 *   by itself: when a layer needs that expert it is read again, once, on
 *   demand (before the acquire: as a miss; after it: by wait / wait_some),
 *   and only that read's failure is reported.  Nothing else changes: no
 *   crash, no leak.
 *
 * Threads: every call except ds41_expert_cache_get_stats comes from one
 * thread at a time (the engine's forward call).  get_stats may be called
 * from any thread at any time. */
#ifndef DS41_STORAGE_EXPERT_CACHE_H
#define DS41_STORAGE_EXPERT_CACHE_H

#include "config/error.h"
#include "config/model_config.h"
#include "engine/backend/memory.h"
#include "storage/host_alloc.h"
#include "storage/reader.h"
#include "storage/safetensors.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ds41_expert_cache ds41_expert_cache;

typedef struct ds41_expert_cache_opts {
    uint64_t budget_bytes;  /* slot pool size; at least one slot */
    bool buffered;          /* read through the page cache (no O_DIRECT); default O_DIRECT */
    unsigned queue_depth;   /* reader chunks in flight; 0 = 128 */
    ds41_reader_backend backend; /* AUTO: io_uring, else pread threads */
    /* The memory the backend computes on (the engine: its backend's mem).
     * NULL or &ds41_memory_host: views point into the host slots; another
     * memory: a twin pool there (see Slots). */
    const ds41_memory *slot_memory;
    /* With a twin pool: the bytes of a host tier of its own (see Host
     * tier), at least the device tier's slots; 0 = the host slots are as
     * many as the twin slots (staging only).  Ignored on host memory. */
    uint64_t host_tier_bytes;
    /* Where host slots come from (storage/host_alloc.h; zero: anonymous
     * memory).  A device backend gives page-locked memory. */
    ds41_host_alloc host_alloc;
} ds41_expert_cache_opts;

/* The routed experts of cfg's text layers (layers.L.ffn.experts.E.w{1,2,3}
 * .weight/.scale for L < n_layers) in ckpt: the slot size one expert needs
 * and the bytes of all of them.  Errors: a tensor missing (names it). */
int ds41_expert_cache_geometry(const ds41_checkpoint *ckpt, const ds41_model_config *cfg, uint64_t *slot_bytes,
                               uint64_t *total_bytes, ds41_error *err);

/* A cache over ckpt (borrowed: it must outlive the cache; its shard
 * descriptors are used for buffered reads) for cfg's text layers.  Errors:
 * budget below one slot ("... at least N bytes"), tensors missing, the
 * reader cannot start, out of memory. */
ds41_expert_cache *ds41_expert_cache_new(const ds41_checkpoint *ckpt, const ds41_model_config *cfg,
                                         const ds41_expert_cache_opts *opts, ds41_error *err);

/* Waits for reads in flight, frees everything.  NULL is fine. */
void ds41_expert_cache_free(ds41_expert_cache *c);

uint64_t ds41_expert_cache_slot_bytes(const ds41_expert_cache *c);
size_t ds41_expert_cache_slots(const ds41_expert_cache *c);
/* Bytes of all routed experts of the text layers. */
uint64_t ds41_expert_cache_total_bytes(const ds41_expert_cache *c);
uint64_t ds41_expert_cache_budget(const ds41_expert_cache *c);

/* Change the budget (drops every cached expert; waits for reads in flight).
 * Only between steps: fails when a slot is pinned.  Errors: below one slot,
 * out of memory (the old pool is kept then: with a twin pool the new one is
 * allocated before the old one goes, so both exist for a moment). */
int ds41_expert_cache_set_budget(ds41_expert_cache *c, uint64_t budget_bytes, ds41_error *err);

/* The reader (for its fault hook, ds41_reader_set_fault, and its backend
 * name / warning).  Owned by the cache. */
ds41_reader *ds41_expert_cache_reader(ds41_expert_cache *c);

/* Where one pinned expert's tensors are: w[0..2] = w1, w2, w3 codes,
 * s[0..2] their scales.  Valid until the expert is released.  With a twin
 * pool they are opts.slot_memory's: reach them only through it and the
 * backend's ops. */
typedef struct ds41_expert_view {
    const uint8_t *w[3];
    const uint8_t *s[3];
} ds41_expert_view;

/* Pin experts[0..n) of text layer `layer` (ids in [0, n_experts), distinct):
 * sets got[i] = 1 for each expert pinned (hits first, then misses while
 * slots last), starts the misses' reads in one submission, and returns how
 * many were pinned (>= 1 when n >= 1 and nothing else is pinned), or -1
 * with err filled (bad arguments, the reader failing to submit; nothing is
 * left pinned then).  Prediction pins of this layer become ordinary pins or
 * are dropped. */
long ds41_expert_cache_acquire(ds41_expert_cache *c, int layer, const int32_t *experts, size_t n, uint8_t *got,
                               ds41_error *err);

/* Wait until the pinned experts[i] with got[i] are loaded and fill views[i]
 * for them.  Returns 0, or -1 with err naming the shard and tensors of the
 * first expert whose read failed (the experts stay pinned: release them). */
int ds41_expert_cache_wait(ds41_expert_cache *c, int layer, const int32_t *experts, size_t n, const uint8_t *got,
                           ds41_expert_view *views, ds41_error *err);

/* Like ds41_expert_cache_wait, expert by expert as the reads complete: for
 * each pinned experts[i] (got[i]) not yet done[i] whose load has finished,
 * fills views[i] and sets done[i] = 1 ("newly done").  Waits until at least
 * min_new are newly done (fewer when fewer remain; 0: only polls).  Lets the
 * caller compute the experts already there while the others still load.
 * Returns the number newly done, or -1 with err as ds41_expert_cache_wait
 * (a read failed: the experts stay pinned, release them). */
long ds41_expert_cache_wait_some(ds41_expert_cache *c, int layer, const int32_t *experts, size_t n,
                                 const uint8_t *got, uint8_t *done, size_t min_new, ds41_expert_view *views,
                                 ds41_error *err);

/* Unpin experts[i] with got[i] (got NULL: all n).  An expert whose read
 * failed is dropped from the cache. */
void ds41_expert_cache_release(ds41_expert_cache *c, int layer, const int32_t *experts, size_t n,
                               const uint8_t *got);

/* Start reads for the experts the caller expects `layer` to use next, into
 * slots nobody pins (at most all of them; experts already cached only get a
 * prediction pin).  Returns how many experts are now cached or loading for
 * the prediction.  Read submission errors are not fatal: the prediction is
 * cut short (counted). */
size_t ds41_expert_cache_predict(ds41_expert_cache *c, int layer, const int32_t *experts, size_t n);

/* End of a forward step (or its failure): drop every prediction pin.  Every
 * ordinary pin must have been released. */
void ds41_expert_cache_end_step(ds41_expert_cache *c);

typedef struct ds41_expert_cache_stats {
    uint64_t budget_bytes, slot_bytes, slots, slots_used, total_bytes;
    uint64_t requests;       /* expert uses: experts pinned by acquire (= hits + prefetch_hits + misses) */
    uint64_t hits;           /* already loaded (in the device tier when there is a host tier) */
    uint64_t prefetch_hits;  /* loaded or in flight thanks to a prediction, first use */
    uint64_t prefetch_inflight; /* of which still in flight when the layer asked (late predictions) */
    uint64_t misses;         /* loaded on demand: read, or with a host tier uploaded from it */
    uint64_t host_hits;      /* of the misses, those the host tier held (or was reading): no read */
    uint64_t evictions;
    uint64_t waves;          /* acquires that could not pin the whole request */
    uint64_t read_errors;
    uint64_t bytes_read;     /* bytes delivered into slots */
    uint64_t device_bytes;   /* bytes the reader read from the device (incl. alignment) */
    uint64_t bytes_used;     /* of bytes_read, those of loads a layer then used (demand loads, and
                              * predicted loads at their first use): bytes_read - bytes_used were
                              * read for predictions nobody used */
    uint64_t reads;          /* expert reads from the shards started (demand + prediction) */
    uint64_t predicted;      /* experts predicted for a layer */
    uint64_t predicted_used; /* of which the layer used */
    uint64_t predict_skipped;/* predicted experts not loaded for want of free slots */
    uint64_t predict_host;   /* predicted experts read into the host tier only (no device slot free) */
    uint64_t latency_p50_ns; /* expert load latency, submit to last byte (last 4096 loads) */
    uint64_t latency_p99_ns;
    uint64_t stall_ns;       /* time spent in wait() for loads to finish */
    uint64_t slot_memory_bytes; /* the twin pool in opts.slot_memory (0: none, the backend computes on
                                 * the host slots) */
    uint64_t uploads;           /* loaded slots uploaded to their twins (once per load) */
    uint64_t bytes_uploaded;    /* bytes of those uploads */
    uint64_t host_budget_bytes; /* the host tier's budget (0: no host tier of its own) */
    uint64_t host_slots;        /* host slots: the host tier's, else as many as slots */
    uint64_t host_slots_used;
    uint64_t host_bytes;        /* host slot memory (opts.host_alloc) */
    uint64_t host_evictions;    /* host tier evictions (with a host tier of its own) */
    char backend[24];        /* reader backend */
    bool direct;             /* O_DIRECT in use on the first expert shard */
} ds41_expert_cache_stats;

/* Snapshot of the counters (thread-safe).  reset zeroes the counters after
 * reading (not the geometry). */
void ds41_expert_cache_get_stats(ds41_expert_cache *c, ds41_expert_cache_stats *out, bool reset);

#endif
