/* The misc family of the CUDA backend's ops (cuda/ops_cuda.h): rmsnorm,
 * hc_mix, hc_pre, hc_post, rope_table, rope, swiglu, moe_combine, router,
 * engram_mix, embed, gather_rows, fp8_rows.  Each with exactly the signature
 * of the ds41_ops member of its name (engine/backend/ops.h), self->ctx a
 * ds41_cuda_ctx (cuda/cuda_ctx.h):
 *  - ds41_cuda_emu_<op> (cuda/emu_misc.c): the kernels' decomposition run
 *    on the host at call time over the shared arithmetic of cuda/num_misc.h;
 *  - ds41_cuda_k_<op> (cuda/k_misc.cu, built with nvcc): one launch over all
 *    rows on the compute stream, no sync.
 * Numerics and per-op error bounds: cuda/num_misc.h. */
#ifndef DS41_CUDA_OP_MISC_H
#define DS41_CUDA_OP_MISC_H

#include "engine/backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS41_CUDA_MISC_DECLARE(prefix)                                                                       \
    void prefix##rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n,        \
                         float eps, float *y);                                                               \
    void prefix##hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,        \
                        const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters,             \
                        float hc_eps, float *pre, float *post, float *comb);                                 \
    void prefix##hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc,            \
                        size_t dim, float *out);                                                             \
    void prefix##hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,            \
                         const float *comb, size_t M, int hc, size_t dim, float *out);                       \
    void prefix##rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos,      \
                            size_t M, float *cs);                                                            \
    void prefix##rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,              \
                      size_t head_stride, int n_pairs, const float *cs, int inverse);                        \
    void prefix##swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n,            \
                        float limit, const float *route, float *out);                                        \
    void prefix##moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,          \
                             const float *shared, size_t M, size_t D, float *out);                           \
    void prefix##router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E,       \
                        int k, float gate_temp, float route_scale, int32_t *sel, float *weight,              \
                        float *selection);                                                                   \
    void prefix##engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M,     \
                            int hc, size_t dim, float eps, float dim_scale);                                 \
    void prefix##embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,    \
                       size_t dim, float *out);                                                              \
    void prefix##gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,            \
                             const uint32_t *idx, size_t n, size_t row_bytes);                               \
    void prefix##fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows, \
                          size_t n, size_t cols, float *out);

DS41_CUDA_MISC_DECLARE(ds41_cuda_emu_)
#ifdef DS41_HAVE_CUDA
DS41_CUDA_MISC_DECLARE(ds41_cuda_k_)
#endif

#undef DS41_CUDA_MISC_DECLARE

#ifdef __cplusplus
}
#endif

#endif
