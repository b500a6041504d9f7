/* ds41_cuda_emu_enter: the first call of every emulated op (cuda/emu_*.c).
 *
 * An emulated op computes on the host at call time, where the kernel it
 * stands for would run when the compute stream reaches it.  So before it
 * reads anything, the work queued on the compute stream so far (uploads of
 * its inputs, copies of be->mem, earlier ops' copies) and whatever that
 * work waits on through events must have run: this call runs it.  The
 * metadata an op ships afterwards is there too: an emulated ctx's meta()
 * runs its copy before returning (cuda/cuda_backend.c).  Work of other
 * streams that the compute stream does not wait on stays queued, so host
 * logic that forgot an event reads stale bytes (cuda/gpu_fake.c).
 *
 * A ctx without a device (gpu == NULL: the families' standalone tests, with
 * an identity weight() and malloc'd meta()) has nothing queued: no-op. */
#ifndef DS41_CUDA_EMU_ENTER_H
#define DS41_CUDA_EMU_ENTER_H

#include "cuda/cuda_ctx.h"

void ds41_cuda_emu_enter(ds41_cuda_ctx *c);

/* On the fake device, abort naming the op's argument `what` unless
 * [p, p+n) is device memory: a host pointer an emulated op would read or
 * write is one a real GPU faults on (cuda/cuda_ctx.h).  NULL p, other
 * devices and the standalone test ctx (gpu NULL): nothing to check. */
void ds41_cuda_emu_check(const ds41_cuda_ctx *c, const void *p, size_t n, const char *what);

#endif
