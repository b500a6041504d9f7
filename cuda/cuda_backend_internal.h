/* The CUDA backend's constructor with a given op table (tests: the
 * reference ops wrapped to go through the ctx's weight / meta calls), and
 * the tagged views of its memory. */
#ifndef DS41_CUDA_BACKEND_INTERNAL_H
#define DS41_CUDA_BACKEND_INTERNAL_H

#include "cuda/cuda_backend.h"
#include "cuda/cuda_ctx.h"
#include "engine/backend/ops.h"

/* As ds41_backend_cuda_new, with ops (copied; its ctx becomes the
 * backend's ds41_cuda_ctx) instead of the device / emulated table.
 * opts->gpu must be given. */
ds41_backend *ds41_backend_cuda_new_with_ops(const ds41_cuda_opts *opts, const ds41_ops *ops,
                                             ds41_error *err);

/* What an allocation through a memory counts as in ds41_cuda_mem_stats. */
typedef enum ds41_cuda_mem_kind {
    DS41_CUDA_MEM_OTHER = 0, /* be->mem */
    DS41_CUDA_MEM_POOL,      /* the pools new_pool makes */
    DS41_CUDA_MEM_EXPERTS,   /* for the expert cache's slot_memory */
    DS41_CUDA_MEM_SCRATCH,   /* for the engine's activation stacks */
    DS41_CUDA_MEM_KINDS
} ds41_cuda_mem_kind;

/* The backend's memory with allocations counted as kind (same device, same
 * stream; be->mem is DS41_CUDA_MEM_OTHER). */
const ds41_memory *ds41_backend_cuda_memory(const ds41_backend *be, ds41_cuda_mem_kind kind);

/* Read the weights through the checkpoint's mapping (the page cache)
 * instead of O_DIRECT at the next place_weights: the path a file system
 * without O_DIRECT takes. */
void ds41_backend_cuda_set_buffered(ds41_backend *be, bool buffered);

/* The op context (tests call weight / meta / scratch directly). */
ds41_cuda_ctx *ds41_backend_cuda_ctx(const ds41_backend *be);

#endif
