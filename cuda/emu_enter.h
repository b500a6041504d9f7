/* ds41_cuda_emu_enter: the first call of every emulated op (cuda/emu_*.c).
 *
 * An emulated op computes on the host at call time, where the kernel it
 * stands for would run when the compute stream reaches it.  So before it
 * reads anything, the work queued on the compute stream so far (uploads of
 * its inputs, the metadata copies ds41_cuda_meta queued for it, earlier
 * ops' copies) and whatever that work waits on through events must have
 * run: this call runs it.  Work of other streams that the compute stream
 * does not wait on stays queued, so an op whose host logic forgot an event
 * reads stale bytes (cuda/gpu_fake.c).
 *
 * A ctx without a device (gpu == NULL: the families' standalone tests, with
 * an identity weight() and malloc'd meta()) has nothing queued: no-op. */
#ifndef DS41_CUDA_EMU_ENTER_H
#define DS41_CUDA_EMU_ENTER_H

#include "cuda/cuda_ctx.h"

void ds41_cuda_emu_enter(ds41_cuda_ctx *c);

#endif
