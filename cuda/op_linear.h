/* The linear family of the CUDA backend (cuda/ops_cuda.h): linear and
 * linear_batch as device kernels (cuda/k_linear.cu) and as their host
 * emulation (cuda/emu_linear.c), each with the signature of the ds41_ops
 * member of the same name; the arithmetic and its error bounds are in
 * cuda/num_linear.h. */
#ifndef DS41_CUDA_OP_LINEAR_H
#define DS41_CUDA_OP_LINEAR_H

#include "cuda/cuda_ctx.h"
#include "cuda/num_linear.h"
#include "engine/backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

void ds41_cuda_emu_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                          ds41_linear_out out);
void ds41_cuda_emu_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                                const float *const *xs, const size_t *Ms, float *const *ys,
                                ds41_linear_out out);

/* Shared by both: the launch descriptors of n linears (host array d[n]):
 * device weight pointers (ds41_cuda_weight), activation scratch for the
 * quantized kinds (ds41_cuda_scratch), the counters.  Returns whether any
 * linear has work (M, N >= 1); *max_n, *max_items: the largest N and M x
 * ceil(K/32) over them (the grids). */
int ds41_cuda_lin_descs(ds41_cuda_ctx *c, size_t n, const ds41_linear *const *ws, const float *const *xs,
                        const size_t *Ms, float *const *ys, ds41_linear_out out, ds41_lin_desc *d,
                        int64_t *max_n, int64_t *max_items);

#ifdef DS41_HAVE_CUDA
void ds41_cuda_k_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                        ds41_linear_out out);
void ds41_cuda_k_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                              const float *const *xs, const size_t *Ms, float *const *ys,
                              ds41_linear_out out);
#endif

#ifdef __cplusplus
}
#endif

#endif
