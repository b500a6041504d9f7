/* ds41_cuda_ctx: what every op of the CUDA backend's tables (the device
 * kernels cuda/k_*.cu and their host emulation cuda/emu_*.c) finds in
 * self->ctx, and the rules they follow.
 *
 * An op receives what ds41_ops says (engine/backend/ops.h): activations,
 * scratch, KV pages / rings and decisions are backend memory (device
 * pointers); metadata arrays are host memory; weights are the bound host
 * pointers of engine/model/weights.h.  So an op
 *  - translates every weight pointer with ds41_cuda_weight (the placed
 *    device copy; an expert-slot view from storage/expert_cache.h is already
 *    device memory and comes back unchanged);
 *  - ships every host metadata array it reads with ds41_cuda_meta (a device
 *    copy queued on the compute stream; arrays of device pointers -- the
 *    rings of an attention step, page tables -- are metadata too);
 *  - takes temporaries from ds41_cuda_scratch;
 *  - queues its work on the compute stream and returns (no sync), adding
 *    what it read and computed to the counters.
 * The emulated ops do the same through the same calls and then run the
 * kernels' arithmetic (cuda/num_*.h) on the host when the stream reaches
 * them; on the fake device they check every pointer they touch is device
 * memory (ds41_gpu_fake_is_device), so a host pointer that would fault a
 * real GPU fails a host test instead.
 *
 * Numerics: the fast CPU path's contract (engine/backend/cpu/cpu_backend.h,
 * "Numerics", "Decisions", "Batch and chunk invariance"), each kernel's
 * reduction order written down in its num_*.h and depending only on the
 * reduction length, never on M, the row's place in the batch, the grid or
 * the block size; no atomics in any reduction. */
#ifndef DS41_CUDA_CTX_H
#define DS41_CUDA_CTX_H

#include "cuda/gpu.h"
#include "engine/backend/backend.h"

#include <stddef.h>
#include <stdint.h>

typedef struct ds41_cuda_ctx ds41_cuda_ctx;

struct ds41_cuda_ctx {
    ds41_gpu *gpu;
    ds41_gpu_stream *compute; /* every op's work */
    void *stream;             /* ds41_gpu stream_native(compute): the cudaStream_t kernels launch on; NULL when emulated */
    bool emulated;            /* the ops are cuda/emu_*.c on a fake device */

    /* The device copy of the weight bytes [p, p+n) (n: the bytes the op
     * reads from p), or p itself when p is not a placed weight (an expert
     * slot, already device memory).  A range that starts in a placed
     * tensor and runs past its end is a bug the backend reports and aborts
     * on. */
    const void *(*weight)(ds41_cuda_ctx *c, const void *p, size_t n);
    /* A device copy of host[0..n) for the op being queued, valid until the
     * compute stream has run it (n == 0 or host == NULL: NULL). */
    void *(*meta)(ds41_cuda_ctx *c, const void *host, size_t n);
    /* n bytes of device scratch for the op being queued (zeroed not
     * promised), valid until the compute stream has run it; the next op may
     * reuse the bytes (same stream, so ordered). */
    void *(*scratch)(ds41_cuda_ctx *c, size_t n);

    ds41_backend_stats stats; /* what the ops read and computed (engine/backend/backend.h) */
    void *impl;               /* the backend's private state */
};

static inline ds41_cuda_ctx *ds41_cuda_ctx_of(const ds41_ops *self) {
    return (ds41_cuda_ctx *)self->ctx;
}
static inline const void *ds41_cuda_weight(ds41_cuda_ctx *c, const void *p, size_t n) {
    return p ? c->weight(c, p, n) : NULL;
}
static inline void *ds41_cuda_meta(ds41_cuda_ctx *c, const void *host, size_t n) {
    return host && n ? c->meta(c, host, n) : NULL;
}
static inline void *ds41_cuda_scratch(ds41_cuda_ctx *c, size_t n) {
    return c->scratch(c, n ? n : 1);
}

#endif
