/* The CUDA backend's two op tables, assembled in cuda/ops_table.c from the
 * op families below: the device kernels (ds41_cuda_k_*, cuda/k_*.cu, built
 * when nvcc is found) and their host emulation (ds41_cuda_emu_*,
 * cuda/emu_*.c, always built: the tests run it on the fake device).  Every
 * function has the signature of the ds41_ops member of the same name
 * (engine/backend/ops.h) and its self->ctx is a ds41_cuda_ctx
 * (cuda/cuda_ctx.h).
 *
 * Families (one num_*.h of shared arithmetic, one emu_*.c, one k_*.cu each):
 *  - linear:    linear, linear_batch
 *  - attention: act_quant_fp8, index_query, kv_pack, compress_pool,
 *               index_scores, index_blocks, index_topk, sparse_attn, attend
 *  - misc:      rmsnorm, hc_mix, hc_pre, hc_post, rope_table, rope, swiglu,
 *               moe_combine, router, engram_mix, embed, gather_rows, fp8_rows */
#ifndef DS41_CUDA_OPS_CUDA_H
#define DS41_CUDA_OPS_CUDA_H

#include "engine/backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The tables (ctx NULL: the backend copies a table and sets its ctx). */
extern const ds41_ops ds41_cuda_ops_emulated;
#ifdef DS41_HAVE_CUDA
extern const ds41_ops ds41_cuda_ops_device;
#endif

#define DS41_CUDA_OP_LIST(X)                                                                                           \
    X(linear) X(linear_batch) X(rmsnorm) X(hc_mix) X(hc_pre) X(hc_post) X(rope_table) X(rope) X(act_quant_fp8)        \
        X(index_query) X(kv_pack) X(compress_pool) X(index_scores) X(index_blocks) X(index_topk) X(sparse_attn)       \
            X(attend) X(swiglu) X(moe_combine) X(router) X(engram_mix) X(embed) X(gather_rows) X(fp8_rows)

#ifdef __cplusplus
}
#endif

#endif
