/* The CUDA backend (a ds41_backend, engine/backend/backend.h).
 *
 * Memory (be->mem) is device memory through a ds41_gpu (cuda/gpu.h); the ops
 * are the device kernels (cuda/k_*.cu), or, for tests and `--backend
 * cuda-emu`, their host emulation on the fake device (cuda/emu_*.c,
 * cuda/gpu_fake.c): the same backend code, placement, pools and streams, so
 * everything but the kernels' thread mapping is exercised on any host.
 *
 * Placement (place_weights): every dense tensor the forward pass reads is
 * copied to device memory in its stored format (FP8 e4m3 + ue8m0, FP4 +
 * ue8m0, bf16, fp32; no dequantized copies, wo_a as the CPU backend holds
 * it), read from the shards with O_DIRECT into pinned staging buffers and
 * copied asynchronously, one arena per kind (cuda/placement.h plans it);
 * routed experts stay out of it when the expert cache streams them
 * (storage/expert_cache.h: the device slots are its twin pool in be->mem,
 * above a pinned host tier, above NVMe).
 *
 * The KV page pool lives in device memory (ds41_kv_pool_new_in(be->mem)):
 * 890 B/token at the released config, latents and index keys as FP4 codes
 * + scales, window rings FP8; snapshots download and upload it. */
#ifndef DS41_CUDA_BACKEND_H
#define DS41_CUDA_BACKEND_H

#include "config/error.h"
#include "cuda/gpu.h"
#include "engine/backend/backend.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct ds41_cuda_opts {
    int device;    /* CUDA device ordinal (real device only) */
    ds41_gpu *gpu; /* NULL: open the real device `device`; else this one (the backend owns it) */
    bool emulated; /* the host emulation of the kernels (gpu must be a fake device, or NULL to make one) */
} ds41_cuda_opts;  /* zero-initialised: device 0, real kernels */

/* Errors: no usable device (the message says why: no driver, no device,
 * built without CUDA), out of device memory. */
ds41_backend *ds41_backend_cuda_new(const ds41_cuda_opts *opts, ds41_error *err);

/* Whether be is a CUDA backend (real or emulated), and its device. */
bool ds41_backend_is_cuda(const ds41_backend *be);
ds41_gpu *ds41_backend_cuda_gpu(const ds41_backend *be);

/* Device memory held, by what holds it (/metrics, ds41ctl cache). */
typedef struct ds41_cuda_mem_stats {
    uint64_t weight_bytes;      /* placed dense weights */
    uint64_t pool_bytes;        /* KV page pools, window rings, carries */
    uint64_t expert_bytes;      /* routed-expert slots (the expert cache's twin pool) */
    uint64_t scratch_bytes;     /* activations, op scratch, metadata arena */
    uint64_t other_bytes;       /* anything else allocated through be->mem */
    uint64_t pinned_host_bytes; /* page-locked host memory: staging, metadata, the host expert tier */
    /* How place_weights read the weights: bytes read with O_DIRECT into
     * pinned staging, and bytes copied from the checkpoint's mapping (a file
     * system without O_DIRECT, tensors the binder copied: wo_a). */
    uint64_t placed_direct_bytes;
    uint64_t placed_mapped_bytes;
} ds41_cuda_mem_stats;
void ds41_backend_cuda_mem_stats(const ds41_backend *be, ds41_cuda_mem_stats *out);

#endif
