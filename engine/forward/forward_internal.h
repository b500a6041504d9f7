/* Internal structures shared by the forward pass files (forward.c,
 * attention.c, moe.c).  Not a public header. */
#ifndef DS41_ENGINE_FORWARD_INTERNAL_H
#define DS41_ENGINE_FORWARD_INTERNAL_H

#include "engine/backend/scratch.h"
#include "engine/forward/forward.h"
#include "engine/model/engram_layout.h"
#include "storage/expert_cache.h"
#include "storage/safetensors.h"

#include <pthread.h>

struct ds41_engine {
    ds41_model_config cfg;
    ds41_checkpoint *ckpt;
    ds41_weights w;
    ds41_backend *be;
    const ds41_ops *ops; /* &be->ops */
    int placed;          /* be->place_weights succeeded */

    /* Engram */
    int32_t *token_map; /* [n_map] compressed id of each token id */
    uint32_t n_map;
    int32_t engram_pad; /* compressed id of engram_pad_id */
    ds41_engram_layout eng;
    float **wqk; /* per engram slot: fp32(q_weight * k_weight) [hc][dim], backend memory */
    ds41_engram_cache *ecache; /* streamed rows (table index = slot); NULL: tables resident */

    /* Rope frequencies per layer (rope_head_dim/2), NULL for absent layers:
     * on the host (to compare layers) and in backend memory (for rope_table). */
    float **rope_freqs;
    float **rope_freqs_be;

    /* Constants as the fp32 values the arithmetic uses (REFERENCE §10) */
    float norm_eps, hc_eps, route_scale, swiglu_limit, gate_temp;
    float softmax_scale; /* fp32(head_dim^-0.5) */
    float index_scale;   /* fp32(index_head_dim^-0.5 * index_n_heads^-0.5) */
    float engram_scale;  /* fp32(dim^-0.5) */

    /* Routed-expert tier (storage/expert_cache.h): NULL while every expert
     * is used in place from the mapping.  xc_mu guards the pointer against
     * statistics readers on other threads; the forward thread uses it
     * without the lock (only that thread replaces it). */
    ds41_expert_cache *xc;
    pthread_mutex_t xc_mu;
    uint64_t expert_budget;      /* as asked (0 = all resident) */
    uint64_t expert_total_bytes; /* all routed experts of the text layers (0 until known) */
    bool expert_predict_next;    /* predict layer L+1 at layer L's experts */
    bool expert_predict_early;   /* predict layer L before its attention */
    unsigned expert_predict_extra; /* candidates beyond the top-k per token */
    bool expert_buffered;
    uint64_t expert_host_budget; /* opts.host_expert_cache_bytes */
    uint64_t expert_slot_bytes;  /* one expert's slot (0 until known) */
    bool budget_pending;         /* under xc_mu: a requested budget for the next forward */
    uint64_t budget_requested;

    /* Scratch of the forward pass: every per-step buffer of forward.c,
     * attention.c and moe.c comes from these stacks, marked on entry to a
     * function and released on its return; they grow while the engine warms
     * up, then a step allocates nothing (tests/test_forward_alloc.c).
     * `scratch` is backend memory (be->mem: activations, decisions), which
     * the pass reaches only through ops and memory calls; `host` holds the
     * metadata the host computes (positions, row maps, page tables, ids) and
     * what it downloads (the router's choices, reports to hooks). */
    ds41_scratch scratch;
    ds41_scratch host;
    const ds41_memory *mem; /* be->mem */
};

/* A position of both scratch stacks (backend and host), taken on entry to a
 * function and released on its return. */
typedef struct fwd_frame {
    ds41_scratch_mark dev, host;
} fwd_frame;

static inline fwd_frame ds41__frame(const ds41_engine *e) {
    return (fwd_frame){ds41_scratch_mark_now(&e->scratch), ds41_scratch_mark_now(&e->host)};
}

static inline void ds41__frame_release(ds41_engine *e, fwd_frame f) {
    ds41_scratch_release(&e->scratch, f.dev);
    ds41_scratch_release(&e->host, f.host);
}

/* bytes of backend memory (activations; only ops and memory calls touch it). */
static inline void *ds41__dev(ds41_engine *e, size_t bytes) {
    return ds41_scratch_get(&e->scratch, bytes);
}

/* bytes of host memory (metadata, downloads). */
static inline void *ds41__host(ds41_engine *e, size_t bytes) {
    return ds41_scratch_get(&e->host, bytes);
}

/* One forward call's rows (tokens) and per-call state. */
typedef struct fwd_batch {
    size_t M;                 /* rows */
    size_t n_items;
    const ds41_fwd_item *items;
    size_t *item_row0;        /* [n_items] first row of each item */
    uint64_t *item_pos0;      /* [n_items] position of that row */
    size_t *row_item;         /* [M] */
    uint64_t *row_pos;        /* [M] absolute position */
    int32_t *row_token;       /* [M] token id */
    float *rope_cs;           /* [M][rope_head_dim] cos/sin of the current layer at each row's position */
    int rope_layer;           /* layer rope_cs was computed for, -1 none */

    /* Published top-k lists, per index source layer: positions [M][index_topk], counts [M]
     * (backend memory: the decisions stay where the kernels made them) */
    int32_t **idx_list;
    uint32_t **idx_count;
    /* Candidate blocks published by the candidate source: [M][cand_stride] flags (backend memory) */
    uint8_t *cand;
    size_t cand_stride;
    const ds41_fwd_hooks *hooks; /* NULL or the caller's observer (decisions are reported to it) */
    /* > 0: the rows are DSpark draft blocks of this many rows per item
     * (engine/forward/dspark.c): the attention attends as ds41_attn_step.block
     * says and writes no ring. */
    uint32_t draft_block;
} fwd_batch;

/* Report a decision of row r to the batch's hook, if it has one (sel and
 * score are host memory: downloaded by the caller). */
static inline void ds41__report_decision(const fwd_batch *b, ds41_decision_kind kind, int layer, size_t r,
                                         const int32_t *sel, size_t n_sel, const float *score,
                                         size_t n_score) {
    if (!b->hooks || !b->hooks->decision) return;
    const size_t it = b->row_item[r];
    b->hooks->decision(b->hooks->ctx, kind, layer, it, r - b->item_row0[it], sel, n_sel, score, n_score);
}

/* The indexer's outputs for the whole step (idx_list / idx_count of every
 * index source, cand), taken from the pass's scratch frame before the layer
 * loop: later layers read them.  Errors: out of memory. */
int ds41__attention_prepare(ds41_engine *e, fwd_batch *b, ds41_error *err);

/* Attention sub-layer of layer L on xn [M][dim] (normed input): writes
 * out [M][dim]; updates the batch sequences' rings and (kv sources) their
 * compressed entries and carries.  Errors: out of memory, KV cache full. */
int ds41__attention(ds41_engine *e, fwd_batch *b, int L, const float *xn, float *out, ds41_error *err);

/* MoE sub-layer of layer L on xn [M][dim]: out [M][dim].  Errors: out of memory. */
int ds41__moe(ds41_engine *e, fwd_batch *b, int L, const float *xn, float *out, ds41_error *err);
/* Start reads for the experts layer L will probably use, before its
 * attention runs: L's router applied to L's FFN input without the attention
 * output (h: the stream entering layer L; ffn_pre: the FFN's pre-mix, which
 * the attention's hc_mix computes).  No-op unless experts are streamed with
 * prediction on; best effort (out of memory skips it). */
void ds41__moe_predict_early(ds41_engine *e, const fwd_batch *b, int L, const float *h, const float *ffn_pre);

/* The buffers one block works in over M rows (backend memory): the stream h
 * [M][hc][dim] (h2 its double buffer), the incoming attention pre-mix
 * [M][hc], the hc mixes of the two sub-layers, and [M][dim] scratch. */
typedef struct fwd_block_bufs {
    float *h, *h2, *pre_mix;
    float *a_pre, *a_post, *a_comb, *f_post, *f_comb;
    float *x, *xn, *br;
} fwd_block_bufs;

/* Take them from the engine's backend scratch (the caller's frame): 0 on out
 * of memory. */
int ds41__block_bufs(ds41_engine *e, size_t M, fwd_block_bufs *bb);

/* Block L with hyper-connections (§2.7) on bb->h with bb->pre_mix: on
 * return bb->h is the block's output and bb->pre_mix the next block's
 * attention pre-mix.  The backbone's layers and the DSpark stages alike.
 * Errors: out of memory, KV cache full. */
int ds41__block(ds41_engine *e, fwd_batch *b, int L, fwd_block_bufs *bb, ds41_error *err);

/* The window KV of M rows at layer L (§2.8 step 2): kv_norm(wkv(xn)), rope
 * with the rows' table cs [M][rope_head_dim], FP8 1x32 QDQ, packed in the
 * ring's row format into rows [M][row_bytes].  kvraw, kv: [M][head_dim]
 * scratch (backend memory, like everything else). */
void ds41__window_kv(ds41_engine *e, int L, const float *xn, size_t M, const float *cs, float *kvraw,
                     float *kv, uint8_t *rows, size_t row_bytes);

/* DSpark taps of one forward call (engine/forward/dspark.c): the rows of its
 * items with spec_taps. */
typedef struct fwd_spec {
    size_t n;      /* rows; 0: no item asked */
    uint32_t *row; /* [n] their batch rows, ascending (host) */
    uint64_t *pos; /* [n] their positions (host) */
    float *inv;    /* [n][hc] = fp32(1/hc): the copy average as an hc_pre */
    float *taps;   /* [n][targets * dim] (backend memory) */
} fwd_spec;

/* Set up *s for the batch from the caller's frame: 0 on out of memory. */
int ds41__dspark_spec_begin(ds41_engine *e, const fwd_batch *b, fwd_spec *s);
/* Block L's input stream h [M][hc][dim] (after any Engram), when L is a
 * target layer, averaged over the copies into the tap rows.  Errors: out of
 * memory. */
int ds41__dspark_tap(ds41_engine *e, const fwd_batch *b, fwd_spec *s, int L, const float *h, ds41_error *err);
/* After the last block: main_x from the taps, every stage's window KV at
 * the rows' positions into the stage rings (the last window rows of each
 * item).  Errors: out of memory. */
int ds41__dspark_seed(ds41_engine *e, fwd_batch *b, fwd_spec *s, ds41_error *err);

/* cos/sin for layer L at every row's position into b->rope_cs (cached per layer). */
void ds41__rope_rows(ds41_engine *e, fwd_batch *b, int L);

/* Compressor pooling, the indexer's decisions and the MoE combine are backend ops
 * (engine/backend/ops.h; per row engine/backend/index_select.h, engine/backend/refmath.h), which
 * tests give inputs the generated checkpoints never produce (tests/test_forward_steps.c). */

#endif
