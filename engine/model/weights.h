/* ds41_weights: every tensor of a model config bound to an open checkpoint
 * (REFERENCE.md §3), ready for the forward pass.
 *
 * Binding checks every tensor of the config's tensor plan (engine/model/tensor_plan.h)
 * against the checkpoint: present, right dtype, right shape; DSpark and
 * vision tensors included, although the text forward pass does not execute
 * them.  Tensors the plan does not know are ignored (counted in
 * `n_unplanned`), so any checkpoint in the release layout loads.
 *
 * What is copied and what is not (REFERENCE §3 "What convert.py does"):
 *  - FP8 / FP4 payloads and their scales are used in place, inside the
 *    checkpoint's read-only mapping: never copied.
 *  - `attn.wo_a` is dequantized to bf16 at load, as the reference's
 *    conversion does: bf16(fp32(e4m3) * 2^(scale - 127)) per 32x32 block
 *    (exact).  These are the only weight copies ds41 makes in general.
 *  - BF16 and F32 tensors are used in place when aligned to their element
 *    size (always, for files written by Hugging Face or ds41); a misaligned
 *    one (legal in safetensors) is copied into an aligned buffer.
 *  - The fp32 upcasts of the reference (head, ratio-2 compressor wkv/wgate;
 *    gate weights upcast on use) are not materialized: bf16 -> fp32 is exact,
 *    so the linear ops read bf16 and widen on the fly, which is numerically
 *    the same and keeps the head at half the memory.
 *
 * The bound structure points into the checkpoint: it must outlive none of
 * it (free the weights before closing the checkpoint). */
#ifndef DS41_ENGINE_WEIGHTS_H
#define DS41_ENGINE_WEIGHTS_H

#include "config/error.h"
#include "config/model_config.h"
#include "storage/safetensors.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* How a linear layer's weight is stored. */
typedef enum ds41_linear_kind {
    DS41_LINEAR_NONE = 0, /* not bound (the layer has no such tensor) */
    DS41_LINEAR_FP8,      /* e4m3 [n][k] + ue8m0 [ceil(n/32)][ceil(k/32)]: act_quant + fp8 GEMM */
    DS41_LINEAR_FP4,      /* packed e2m1 [n][k/2] + ue8m0 [n][ceil(k/32)]: act_quant + fp4 GEMM */
    DS41_LINEAR_BF16,     /* bf16 [n][k]: plain matmul, fp32 accumulate */
} ds41_linear_kind;

/* One linear weight W[n][k] (y = x W^T, no bias). */
typedef struct ds41_linear {
    ds41_linear_kind kind;
    int64_t n, k;
    const uint8_t *q;     /* FP8 codes / FP4 packed codes (NULL for BF16) */
    const uint8_t *scale; /* ue8m0 bytes (NULL for BF16) */
    int64_t scale_cols;   /* ceil(k/32): row stride of scale */
    const uint16_t *bf16; /* BF16 values (NULL for FP8/FP4) */
} ds41_linear;

/* The weights of one block (backbone layer or DSpark stage).  Pointers of
 * tensors a layer does not have are NULL / kind NONE. */
typedef struct ds41_layer_weights {
    int present;
    const uint16_t *attn_norm, *ffn_norm, *q_norm, *kv_norm; /* bf16 [dim], [dim], [q_lora_rank], [head_dim] */
    const float *attn_sink;                                  /* [n_heads] */
    ds41_linear wq_a, wq_b, wkv, wo_a, wo_b;                 /* wo_a: BF16 (dequantized at load) */

    /* kv source: compressor and index keys */
    ds41_linear cmp_wkv, cmp_wgate; /* BF16 [head_dim][dim]; wgate only for ratio > 1 */
    const uint16_t *cmp_norm;       /* [head_dim] */
    ds41_linear idx_wk;             /* BF16 [index_head_dim][head_dim] */
    const uint16_t *idx_k_norm;     /* [index_head_dim] */
    /* index source: query side */
    ds41_linear idx_wq_b;         /* FP8 [index_n_heads * index_head_dim][q_lora_rank] */
    ds41_linear idx_weights_proj; /* BF16 [index_n_heads][dim] */

    /* hyper-connections, F32 */
    const float *hc_attn_fn, *hc_ffn_fn;     /* [(2+hc)*hc][hc*dim] */
    const float *hc_attn_base, *hc_ffn_base; /* [(2+hc)*hc] */
    const float *hc_attn_scale, *hc_ffn_scale; /* [3] */

    /* MoE */
    ds41_linear gate;                      /* BF16 [n_experts][dim] (fp32 matmul) */
    const float *gate_bias, *gate_bias_vl; /* [n_experts] */
    int64_t n_experts;
    ds41_linear *w1, *w2, *w3; /* [n_experts] each, FP4 (expert_dtype) */
    ds41_linear sh_w1, sh_w2, sh_w3;

    /* Engram (layers in engram_layer_ids) */
    const uint8_t *eng_table;       /* e4m3 [rows][engram_head_dim] */
    const uint8_t *eng_table_scale; /* ue8m0 [rows][engram_head_dim/32] */
    int64_t eng_rows;
    ds41_linear eng_wkv;            /* FP8 [(hc+1)*dim][cols*engram_head_dim] */
    const uint16_t *eng_q, *eng_k;  /* bf16 [hc][dim] */
} ds41_layer_weights;

typedef struct ds41_weights {
    const uint16_t *embed; /* bf16 [vocab][dim] */
    ds41_linear head;      /* BF16 [vocab][dim], fp32 matmul and logits */
    const uint16_t *norm;  /* bf16 [dim] */
    ds41_layer_weights *layers; /* [n_layers] = config roles (backbone + DSpark stages) */
    size_t n_layers;
    /* The DSpark extras (REFERENCE §3, §7), bound when DSpark is on, else
     * kind NONE / NULL: stage 0's main_proj (FP8 [dim][dim * targets]) and
     * main_norm; the last stage's norm, Markov embedding (bf16
     * [vocab][markov_rank]), Markov head and confidence projection (BF16,
     * fp32 matmuls: [vocab][markov_rank] and [1][dim + markov_rank]). */
    ds41_linear mtp_main_proj;
    const uint16_t *mtp_main_norm;
    const uint16_t *mtp_norm;
    const uint16_t *mtp_markov_embed;
    ds41_linear mtp_markov_head, mtp_confidence;
    size_t n_bound;     /* planned tensors found and checked */
    size_t n_unplanned; /* checkpoint tensors the plan does not know (ignored) */
    uint64_t copied_bytes; /* wo_a dequantized + misaligned copies */
    /* internal: owned buffers */
    void **owned;
    size_t n_owned, cap_owned;
    /* Set by the engine before a backend places the weights
     * (engine/backend/backend.h): the routed experts reach the ops only as
     * the expert cache's slot views, and the Engram tables only as rows the
     * Engram cache gathered, so a backend may leave those tensors out of its
     * own memory. */
    bool experts_streamed;
    bool engram_streamed;
} ds41_weights;

/* Bind every tensor the finalized cfg requires from ckpt into *w.  Errors
 * (w left empty, err naming the tensor): a planned tensor missing, with the
 * wrong dtype or the wrong shape; out of memory. */
int ds41_weights_bind(ds41_weights *w, const ds41_model_config *cfg, const ds41_checkpoint *ckpt, ds41_error *err);

/* Load progress: how much of the plan is bound so far.  Called from the
 * binding thread after the global tensors and after each layer, so a load
 * reports a few dozen times however large the model; the last call has
 * done == total.  The callback must be cheap (it runs between layers). */
typedef void (*ds41_weights_progress_fn)(void *ctx, uint64_t tensors_done, uint64_t tensors_total,
                                         uint64_t bytes_done, uint64_t bytes_total);

/* ds41_weights_bind, reporting progress to fn (NULL = none). */
int ds41_weights_bind_progress(ds41_weights *w, const ds41_model_config *cfg, const ds41_checkpoint *ckpt,
                               ds41_weights_progress_fn fn, void *ctx, ds41_error *err);

/* Release what binding allocated (wo_a copies, misaligned copies, tables).
 * NULL and an empty/zeroed struct are fine. */
void ds41_weights_free(ds41_weights *w);

#endif
