/* The CUDA backend's weight placement plan: which bound tensors go to device
 * memory, where in which arena, and the range table ds41_cuda_weight looks
 * bound host pointers up in (cuda/cuda_ctx.h).
 *
 * Placed: every dense tensor the forward pass hands an op, in its stored
 * format (FP8 e4m3 codes, FP4 packed codes, ue8m0 scales, bf16, fp32; wo_a
 * as the CPU backend holds it, bf16 dequantized at load), DSpark's when it
 * is bound.  Not placed: what no op reads (vision, gate.bias_vl, the
 * Engram q/k weights the engine folds into wqk at load), routed experts of
 * the text layers when the expert cache streams them (opts.experts false),
 * Engram tables when the Engram row cache streams them (opts.engram_tables
 * false).  The left-out routed experts and tables stay in the table as
 * "unplaced": an op handed one of them (a host pointer a device would fault
 * on) is a bug the lookup reports.
 *
 * Arenas: one per stored kind, each tensor at a 256-byte aligned offset, so
 * the backend allocates five device buffers and the plan is a pure function
 * of the config and the bound shapes (tests check it without a device). */
#ifndef DS41_CUDA_PLACEMENT_H
#define DS41_CUDA_PLACEMENT_H

#include "config/error.h"
#include "config/model_config.h"
#include "engine/model/tensor_plan.h"
#include "engine/model/weights.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum ds41_arena {
    DS41_ARENA_FP8 = 0, /* e4m3 codes */
    DS41_ARENA_FP4,     /* packed e2m1 codes */
    DS41_ARENA_SCALE,   /* ue8m0 scale bytes */
    DS41_ARENA_BF16,
    DS41_ARENA_F32,
    DS41_ARENA_COUNT
} ds41_arena;

#define DS41_PLACE_ALIGN 256

typedef struct ds41_place_entry {
    const void *host; /* the bound pointer (NULL in a plan made from the tensor plan) */
    uint64_t bytes;
    uint64_t offset;  /* in its arena, DS41_PLACE_ALIGN aligned */
    uint8_t arena;    /* ds41_arena */
    bool placed;      /* false: a routed expert / Engram table left to its streaming tier */
    int16_t layer;    /* -1: global */
    const char *what; /* static: "attn.wq_a.q", "embed", ... */
} ds41_place_entry;

typedef struct ds41_placement_opts {
    bool experts;       /* place the text layers' routed experts (no expert cache streams them) */
    bool engram_tables; /* place the Engram tables (no Engram row cache streams them) */
} ds41_placement_opts;

typedef struct ds41_placement {
    ds41_place_entry *e; /* sorted by host address (bound plans); plan order otherwise */
    size_t n;
    uint64_t arena_bytes[DS41_ARENA_COUNT];
    uint64_t total_bytes;    /* device bytes of all arenas */
    uint64_t expert_bytes;   /* routed-expert bytes placed */
    uint64_t unplaced_bytes; /* routed experts / Engram tables left out */
    size_t n_placed;
} ds41_placement;

/* The plan for bound weights w of cfg.  Errors: two bound tensors overlap,
 * out of memory. */
int ds41_placement_plan(ds41_placement *p, const ds41_model_config *cfg, const ds41_weights *w,
                        const ds41_placement_opts *opts, ds41_error *err);

/* The same figures from the tensor plan alone (no checkpoint: sizing a
 * device for a config).  Entries have host NULL and cannot be looked up. */
int ds41_placement_plan_tensors(ds41_placement *p, const ds41_model_config *cfg, const ds41_tensor_plan *plan,
                                const ds41_placement_opts *opts, ds41_error *err);

void ds41_placement_free(ds41_placement *p);

typedef enum ds41_place_found {
    DS41_PLACE_NOT_A_WEIGHT = 0, /* p is not inside a bound tensor: an expert slot, backend memory */
    DS41_PLACE_FOUND,            /* inside a placed tensor; *offset is p's offset in its arena */
    DS41_PLACE_PAST_END,         /* starts inside a tensor, runs past its end */
    DS41_PLACE_UNPLACED,         /* inside a tensor the plan left to a streaming tier */
} ds41_place_found;

/* Look [p, p+n) up (binary search over the sorted entries).  *entry: the
 * tensor p lies in (any result but NOT_A_WEIGHT); *offset: p's byte offset
 * in the entry's arena (FOUND). */
ds41_place_found ds41_placement_find(const ds41_placement *pl, const void *p, size_t n,
                                     const ds41_place_entry **entry, uint64_t *offset);

const char *ds41_arena_name(ds41_arena a);

#endif
