/* The attention family of the CUDA backend's ops (cuda/ops_cuda.h):
 * act_quant_fp8, index_query, kv_pack, compress_pool, index_scores,
 * index_blocks, index_topk, sparse_attn, attend.  ds41_cuda_emu_<op>
 * (cuda/emu_attn.c) is the host emulation, ds41_cuda_k_<op> (cuda/k_attn.cu)
 * the kernels; each has the signature of the ds41_ops member <op>
 * (engine/backend/ops.h) and self->ctx is a ds41_cuda_ctx.  Their
 * arithmetic and its order: cuda/num_attn.h.
 *
 * What the ops read as metadata (host arrays shipped with ds41_cuda_meta):
 * the reaches and page tables (ds41_kv_pages: pages, row_table, row_reach),
 * a step's row_item, row_pos, item_row0, item_pos0 and rings, sparse_attn's
 * window / comp pointer lists.  What they read as backend memory (device
 * pointers as given): activations, scores, candidate flags, and the index
 * selections sel / count that attend takes from index_topk. */
#ifndef DS41_CUDA_OP_ATTN_H
#define DS41_CUDA_OP_ATTN_H

#include "cuda/cuda_ctx.h"
#include "cuda/num_attn.h"
#include "engine/backend/ops.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS41_CUDA_ATTN_OPS(X)                                                                                \
    X(act_quant_fp8)                                                                                         \
    X(index_query) X(kv_pack) X(compress_pool) X(index_scores) X(index_blocks) X(index_topk) X(sparse_attn)  \
        X(attend)

/* The nine signatures with the name prefix P (ds41_cuda_emu_ or ds41_cuda_k_). */
#define DS41_CUDA_ATTN_DECLARE(P)                                                                                  \
    void P##act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,                 \
                          size_t out_stride);                                                                      \
    void P##index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M, float scale);   \
    void P##kv_pack(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent, const float *key,    \
                    size_t n, uint8_t *out);                                                                       \
    void P##compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,         \
                          size_t hd, float *pooled);                                                               \
    void P##index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads, int dim,     \
                         const ds41_kv_pages *keys, float *score, size_t score_stride);                            \
    void P##index_blocks(const ds41_ops *self, const float *score, size_t score_stride, const uint32_t *reach,     \
                         size_t M, size_t block, size_t n_take, float *bscore, size_t bscore_stride,               \
                         uint8_t *allow, size_t allow_stride);                                                     \
    void P##index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach, size_t M,   \
                       const uint8_t *allow, size_t allow_stride, size_t block, size_t k, int32_t *sel,            \
                       uint32_t *count);                                                                           \
    void P##sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim, const float *sink,        \
                        float scale, const ds41_attn_rows *rows, float *out);                                      \
    void P##attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim, const float *sink,   \
                   float scale, const ds41_attn_step *step, float *out);

/* ds41_cuda_emu_act_quant_fp8 ... ds41_cuda_emu_attend (cuda/emu_attn.c). */
DS41_CUDA_ATTN_DECLARE(ds41_cuda_emu_)
#ifdef DS41_HAVE_CUDA
/* ds41_cuda_k_act_quant_fp8 ... ds41_cuda_k_attend (cuda/k_attn.cu). */
DS41_CUDA_ATTN_DECLARE(ds41_cuda_k_)
#endif

/* ---- host preparation shared by both (cuda/attn_meta.c) -------------------------------- */

/* Heads per attention block (kernel) / per group (emulation). */
#define DS41_CUDA_ATTN_HEADS 4

/* The entries of a page table description the op may read: n_pages when
 * given, else what the rows' reaches (row_reach) need.  attend needs n_pages
 * (the forward pass sets it): its selections are device memory, so the host
 * cannot tell how far into the table they reach, and a meta copy of the
 * table must not read past the host array. */
size_t ds41_cuda_attn_n_pages(const ds41_kv_pages *k, size_t M);

/* A step's rows as device-side metadata (every host array shipped with
 * ds41_cuda_meta; sel / count are backend memory and taken as given). */
void ds41_cuda_attn_src_step(ds41_cuda_ctx *c, const ds41_attn_step *s, size_t M, ds41_na_attn_src *out);
/* One query's explicit lists, shipped the same way. */
void ds41_cuda_attn_src_rows(ds41_cuda_ctx *c, const ds41_attn_rows *r, ds41_na_attn_src *out);

/* index_scores' metadata: the reaches (returned), the page table and the
 * rows' table offsets as device copies; *max_reach the largest reach (the
 * launch's extent over entries); counts the op's flops. */
const uint32_t *ds41_cuda_index_meta(ds41_cuda_ctx *c, const ds41_kv_pages *keys, size_t M, int n_heads,
                                     int dim, uint32_t *max_reach, const uint8_t *const **pages,
                                     const size_t **row_table);

/* The counters of sparse_attn / attend (as the fast CPU backend counts). */
void ds41_cuda_attn_count(ds41_cuda_ctx *c, size_t H, size_t hd, size_t rows);
void ds41_cuda_attend_count(ds41_cuda_ctx *c, const ds41_attn_step *s, size_t M, size_t H, size_t hd);

#ifdef __cplusplus
}
#endif

#endif
