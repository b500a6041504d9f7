/* What the tests read from the fake device (cuda/gpu_fake.c) besides the
 * ds41_gpu table: the memory it holds and the work it still has queued. */
#ifndef DS41_CUDA_GPU_FAKE_H
#define DS41_CUDA_GPU_FAKE_H

#include "cuda/gpu.h"

#include <stddef.h>
#include <stdint.h>

typedef struct ds41_gpu_fake_stats {
    uint64_t dev_bytes;    /* device memory allocated now (each allocation rounded to 256 B) */
    uint64_t dev_allocs;   /* live device allocations */
    uint64_t pinned_bytes; /* page-locked host memory allocated now */
    uint64_t queued;       /* items queued on streams and not run yet */
    uint64_t executed;     /* items run since the device was made */
} ds41_gpu_fake_stats;

/* Zeroes *out when g is not a fake device. */
void ds41_gpu_fake_get_stats(ds41_gpu *g, ds41_gpu_fake_stats *out);

/* Whether g is a fake device (ds41_gpu_fake_new). */
bool ds41_gpu_is_fake(const ds41_gpu *g);

#endif
