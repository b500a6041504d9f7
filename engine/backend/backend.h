/* ds41_backend: what a compute backend owns, and the interface the engine
 * (engine/forward/forward.h) drives it through.
 *
 * A backend owns four things:
 *
 *  1. The kernels: a ds41_ops table (engine/backend/ops.h).  The forward pass
 *     (engine/forward/forward.c, attention.c, moe.c) calls nothing else for numeric
 *     work; it hands every op all rows of all sequences of a step at once, so
 *     a backend reads each weight once per step whatever the batch.
 *
 *  2. Its memory (mem, engine/backend/memory.h): the engine's activations
 *     and scratch (two stacks per engine, grown during warm-up: the backend
 *     one for activations and decisions, a host one for metadata), the KV
 *     page pool with the window rings and compressor carries, the routed
 *     experts' slots (storage/expert_cache.h uploads into them), the step's
 *     Engram rows (gathered on the host, uploaded).  The engine moves bytes
 *     in and out only by mem's upload / download / copy and the ops: the
 *     logits it samples from, the router's choices (they say which experts
 *     to read), decisions and streams for hooks, snapshots.  The guard
 *     backend of the tests (tests/guard_backend.h, meson test device_guard)
 *     keeps this memory inaccessible outside its ops and proves it.
 *
 *  3. Weight placement: place_weights() runs once at load, after the
 *     checkpoint's tensors are bound and checked (engine/model/weights.h), and may
 *     copy, repack or convert any of them into the backend's own memory and
 *     layout (device memory, interleaved blocks, wider types).  The ops keep
 *     receiving the bound host pointers; a backend that placed copies maps
 *     them to its own by address (the bound pointers are stable for the
 *     engine's life; wo_a arrives as row ranges of its bound tensor, one per
 *     o_group).  release_weights() undoes it before the weights are freed.
 *
 *  4. The KV page pool: new_pool() makes the pool sequences allocate their
 *     packed KV pages from (engine/model/kv_cache.h), in memory the kernels read.
 *
 * Backends here:
 *  - the reference (ds41_backend_reference_new): ds41_ops_reference, the
 *    canonical arithmetic of REFERENCE.md §10, scalar and single-threaded;
 *  - the fast CPU path (ds41_backend_cpu_new, engine/backend/cpu/cpu_backend.h): threads and
 *    SIMD kernels, batch- and chunk-invariant, checked layer by layer against
 *    the reference;
 *  - any op table (ds41_backend_from_ops): a backend with the CPU's
 *    placement and pool around a given table (tests wrap the reference).
 *
 * Placement of the CPU backends is the identity: their kernels decode FP8 /
 * FP4 / bf16 straight from the checkpoint's layout with table lookups (no
 * copy, no extra memory), and their memory (be->mem) is ds41_memory_host:
 * the pool is ds41_kv_pool_new_in(be->mem), host memory.
 *
 * Statistics: a backend may count what its kernels touch (stats()); the fast
 * CPU backend does, for ds41-bench. */
#ifndef DS41_ENGINE_BACKEND_H
#define DS41_ENGINE_BACKEND_H

#include "config/error.h"
#include "config/model_config.h"
#include "engine/model/kv_cache.h"
#include "engine/backend/memory.h"
#include "engine/backend/ops.h"
#include "engine/model/weights.h"

#include <stdbool.h>
#include <stdint.h>

/* What the kernels counted since the last reset.  Byte counts are of weights
 * as stored (FP8/FP4 codes and their scales, bf16, fp32), once per op call
 * that reads them: linear weights, hc mix functions, norm weights, attention
 * sinks, router biases, embedding rows and Engram table rows.  A step's
 * weight_bytes is therefore the weight traffic of that step with the experts
 * the batch used counted once each.  flops counts 2 per multiply-add of the
 * linears, the hc mixes, index scores and attention (QK and PV). */
typedef struct ds41_backend_stats {
    uint64_t weight_bytes;
    uint64_t flops;
    uint64_t op_calls;
} ds41_backend_stats;

typedef struct ds41_backend ds41_backend;

struct ds41_backend {
    const char *name;
    /* The kernels.  ops.ctx is the backend's private state. */
    ds41_ops ops;

    /* The memory the kernels compute on (engine/backend/memory.h): the
     * engine's activations and scratch, the KV pool, expert slots.  The
     * engine reaches it only through these calls and the ops. */
    const ds41_memory *mem;
    /* Optional views of the same memory for the engine's activation stacks
     * and for the expert cache's slots, so that a backend can count what
     * each holds (the CUDA backend's device memory per tier); NULL: mem. */
    const ds41_memory *scratch_mem;
    const ds41_memory *expert_mem;

    /* Placement (see above).  cfg and w outlive the placement.  Errors: out
     * of memory, device errors.  NULL: the identity. */
    int (*place_weights)(ds41_backend *be, const ds41_model_config *cfg, ds41_weights *w, ds41_error *err);
    void (*release_weights)(ds41_backend *be, ds41_weights *w);

    /* A KV page pool for cfg (arguments as ds41_kv_pool_new). */
    ds41_kv_pool *(*new_pool)(ds41_backend *be, const ds41_model_config *cfg, uint64_t budget_bytes,
                              uint32_t entries_per_page, ds41_error *err);

    /* Counters (NULL: none kept; *out is zeroed).  reset zeroes them after
     * reading. */
    void (*stats)(ds41_backend *be, ds41_backend_stats *out, bool reset);

    /* Free the backend (after every pool it made and the engine using it). */
    void (*destroy)(ds41_backend *be);

    void *impl; /* private */
};

/* How many host threads the backend computes on (1 for the reference and
 * wrapped op tables). */
int ds41_backend_threads(const ds41_backend *be);

/* The reference backend (ds41_ops_reference, host placement and pool). */
ds41_backend *ds41_backend_reference_new(ds41_error *err);

/* A backend around an op table (copied; ops->ctx is kept as given): host
 * placement and pool, no counters. */
ds41_backend *ds41_backend_from_ops(const ds41_ops *ops, ds41_error *err);

/* be->destroy(be); NULL is fine. */
void ds41_backend_free(ds41_backend *be);

#endif
