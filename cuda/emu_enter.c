/* ds41_cuda_emu_enter (cuda/emu_enter.h). */
#include "cuda/emu_enter.h"

#include "cuda/gpu_fake.h"

#include <stdio.h>
#include <stdlib.h>

void ds41_cuda_emu_enter(ds41_cuda_ctx *c) {
    if (!c || !c->gpu || !c->compute) return;
    ds41_error err = {0};
    /* A sync of the compute stream runs exactly its queue and what its
     * waits depend on (the fake device never runs unrelated work here). */
    if (c->gpu->stream_sync(c->gpu, c->compute, &err) != 0) {
        fprintf(stderr, "ds41: emulated op: compute stream failed: %s\n", err.msg);
        abort();
    }
}

void ds41_cuda_emu_check(const ds41_cuda_ctx *c, const void *p, size_t n, const char *what) {
    if (!c || !c->gpu || !p || !n || !ds41_gpu_is_fake(c->gpu)) return;
    if (!ds41_gpu_fake_is_device(c->gpu, p, n)) {
        fprintf(stderr, "ds41: emulated op: %s [%p, +%zu) is not device memory\n", what, p, n);
        abort();
    }
}
