/* ds41_ops: the small set of numeric operations the forward pass is built
 * from, behind a table of function pointers, so that backends (the canonical
 * reference below, the fast SIMD/threaded CPU path of engine/backend/cpu/cpu_backend.h, later
 * the CUDA backend) slot in without touching engine/forward/forward.c.  What else a
 * backend owns (weight placement, the KV page pool) is in engine/backend/backend.h.
 *
 * Conventions for every op:
 *  - Activations are fp32 arrays whose values are what the reference holds;
 *    "bf16 values" means every element is bf16-representable.  Row-major,
 *    rows contiguous unless a stride is given.
 *  - Memory: activations, scratch, decisions (selections, counts, flags,
 *    router outputs) and KV pages / rings are the backend's memory
 *    (engine/backend/backend.h, memory.h), which the host never touches.
 *    Metadata -- positions, token and row ids, reaches, row/item maps, page
 *    tables, the gather indices -- is host memory the op reads as given (a
 *    device backend ships it with the launch).  Weights and the tables
 *    computed from them at load (rope frequencies, Engram wqk) are what the
 *    backend placed.
 *  - Inputs and outputs must not overlap unless an op says "in place".
 *  - Ops never fail: sizes come from a validated config and bound weights
 *    (the forward pass checks everything before calling); they allocate
 *    only scratch they free before returning (or keep in their backend).
 *  - Every op gets the table it was called through as `self`, so a backend
 *    instance reaches its state (thread pool, scratch, counters) through
 *    self->ctx.  The reference ignores it.
 *  - Weights are the bound host pointers of engine/model/weights.h (stable for the
 *    engine's life; wo_a is passed as row ranges of the bound tensor, one per
 *    o_group).  A backend that placed its own copies finds them by these.
 *  - Batches: the forward pass hands an op all rows of all sequences of a
 *    step at once (M), so a backend reads each weight once per step.  The
 *    step-wide ops (rope, compress_pool, index_*) take per-row metadata
 *    arrays (positions, reaches, offsets into page tables) and row strides,
 *    never a callback into the engine or a host pointer per row or entry:
 *    that is what one device launch over the step can take.  Decisions
 *    (index selections, candidate blocks) are written to arrays the caller
 *    passes, which a device backend keeps in its own memory.
 *
 * The reference backend (ds41_ops_reference) implements REFERENCE.md §10
 * exactly: scalar, single-threaded, exact reductions (engine/backend/refmath.h). */
#ifndef DS41_ENGINE_OPS_H
#define DS41_ENGINE_OPS_H

#include "engine/model/kv_cache.h"
#include "engine/model/weights.h"

#include <stddef.h>
#include <stdint.h>

/* Output rounding of a linear layer. */
typedef enum ds41_linear_out {
    DS41_OUT_BF16 = 0, /* bf16(acc): every FP8/FP4 linear and bf16 nn.Linear */
    DS41_OUT_F32 = 1,  /* fp32 acc (fp32-parameter matmuls: gate, head, ratio-2 compressor); BF16 weights only */
    /* The same outputs with the reference's accumulation (§10.2-10.3) on
     * every backend, for the linears whose outputs reach a decision through
     * a coarse quantizer: the indexer's inputs (wq_a of an index source,
     * idx_wq_b, weights_proj, the compressor, idx_wk, the Engram wkv of a
     * KV or index source).  One bf16 ulp there
     * flips an FP4 code of an index query or key, which moves an index score
     * by several percent and swaps top-k entries that are far from a tie
     * (engine/backend/cpu/cpu_backend.h, "Decisions"). */
    DS41_OUT_BF16_EXACT = 2,
    DS41_OUT_F32_EXACT = 3,
} ds41_linear_out;

/* The output rounds to bf16 (DS41_OUT_BF16 or DS41_OUT_BF16_EXACT). */
static inline int ds41_linear_out_bf16(ds41_linear_out out) {
    return out == DS41_OUT_BF16 || out == DS41_OUT_BF16_EXACT;
}

/* The rows a sparse attention call attends, in the canonical order of
 * REFERENCE §10.7: window rows by ascending position, then compressed rows
 * by ascending position.  Rows stay packed: window rows in the kv cache's
 * ring format (head_dim e4m3 codes + head_dim/32 ue8m0 scales), compressed
 * rows as kv cache entries (the latent part is read). */
typedef struct ds41_attn_rows {
    const ds41_kv_layout *layout;
    size_t n_window;
    const uint8_t *const *window;
    size_t n_comp;
    const uint8_t *const *comp;
} ds41_attn_rows;

/* Where the rows of a step find their sequences' compressed entries: the
 * KV pool's pages (engine/model/kv_cache.h), one page table per sequence
 * and per row an offset into them and a reach.  Entry t of row m (t <
 * row_reach[m]) is entry t % entries_per_page of page
 * pages[row_table[m] + t / entries_per_page].  Per page, not per entry or
 * per row: the rows of a sequence share its table (ds41_kv_seq_page_ids),
 * so the description is metadata a device backend builds the same way over
 * its own page pool (a block table), and no op reaches into the engine or
 * the cache's structures. */
typedef struct ds41_kv_pages {
    const ds41_kv_layout *layout;
    const uint8_t *const *pages; /* the step's page tables, concatenated */
    const size_t *row_table;     /* [M] start of row m's table in pages */
    const uint32_t *row_reach;   /* [M] entries row m sees (its first ones); 0: none */
    size_t n_pages;              /* entries of pages (a device backend ships the table); 0: not given */
} ds41_kv_pages;

/* The packed entry t of row m (t < k->row_reach[m]). */
static inline const uint8_t *ds41_kv_pages_entry(const ds41_kv_pages *k, size_t m, size_t t) {
    const uint32_t per = k->layout->entries_per_page;
    return k->pages[k->row_table[m] + t / per] + (size_t)(t % per) * k->layout->entry_bytes;
}

/* What every query row of a step attends (§2.4, §10.7, the canonical
 * order): its window, positions max(0, pos+1-window) .. pos ascending, then
 * its compressed entries, the index selection ascending.  Metadata and a
 * few bases, no pointer per row: window position p of row m (item i =
 * row_item[m]) is the step's own packed row chunk + (item_row0[i] + p -
 * item_pos0[i]) * ring_row_bytes when p >= item_pos0[i] (this step wrote
 * it), else slot p % window of the item's ring, rings[i] + slot *
 * ring_row_bytes (engine/model/kv_cache.h); compressed entry sel[m *
 * sel_stride + j], j < count[m], through comp's page tables (row_reach not
 * read).  sel NULL: a window-only layer.
 *
 * block > 0: a DSpark draft block (REFERENCE §7, §10.7), no causal mask:
 * every item's chunk is exactly `block` rows at positions item_pos0 ..
 * item_pos0 + block - 1, none of them in the ring, and every row of the
 * item attends the ring's positions max(0, item_pos0 - window) ..
 * item_pos0 - 1 ascending, then all `block` chunk rows in order (sel must
 * be NULL).  A caller's window pointer array holds window + block
 * entries. */
typedef struct ds41_attn_step {
    const ds41_kv_layout *layout;
    uint32_t window;
    uint32_t block;              /* 0: causal (the forward pass); > 0: a draft block */
    const uint8_t *chunk;        /* [M][ring_row_bytes] the step's window rows */
    const uint8_t *const *rings; /* [n_items] each sequence's ring of the layer */
    const size_t *row_item;      /* [M] */
    const uint64_t *row_pos;     /* [M] */
    const size_t *item_row0;     /* [n_items] first row of each item */
    const uint64_t *item_pos0;   /* [n_items] its position */
    const int32_t *sel;          /* [M][sel_stride] or NULL */
    const uint32_t *count;       /* [M] */
    size_t sel_stride;
    ds41_kv_pages comp;
} ds41_attn_step;

/* Row m of a step as the per-query list sparse_attn takes (wrows: window
 * pointers, crows: sel_stride pointers of the caller's scratch). */
static inline ds41_attn_rows ds41_attn_step_rows(const ds41_attn_step *s, size_t m, const uint8_t **wrows,
                                                 const uint8_t **crows) {
    const size_t it = s->row_item[m], rb = s->layout->ring_row_bytes;
    const uint64_t a = s->row_pos[m], p0 = s->item_pos0[it], W = s->window;
    const uint64_t first = a + 1 > W ? a + 1 - W : 0;
    ds41_attn_rows rows = {.layout = s->layout, .window = wrows, .comp = crows};
    if (s->block) {
        for (uint64_t pos = p0 > W ? p0 - W : 0; pos < p0; pos++)
            wrows[rows.n_window++] = s->rings[it] + (size_t)(pos % W) * rb;
        for (uint32_t j = 0; j < s->block; j++)
            wrows[rows.n_window++] = s->chunk + (s->item_row0[it] + j) * rb;
        return rows;
    }
    for (uint64_t pos = first; pos <= a; pos++)
        wrows[rows.n_window++] = pos >= p0 ? s->chunk + (s->item_row0[it] + (size_t)(pos - p0)) * rb
                                           : s->rings[it] + (size_t)(pos % W) * rb;
    if (s->sel)
        for (uint32_t j = 0; j < s->count[m]; j++)
            crows[rows.n_comp++] = ds41_kv_pages_entry(&s->comp, m, (size_t)s->sel[m * s->sel_stride + j]);
    return rows;
}

typedef struct ds41_ops ds41_ops;

struct ds41_ops {
    const char *name;
    void *ctx; /* the backend instance's state; NULL for the reference */

    /* y[m][0..w->n) = x[m] W^T for m < M; x[m] has w->k bf16 values.
     * FP8 / FP4 weights: act_quant(x, 32, ue8m0) then the block GEMM
     * (§2.2-2.3, §10.3), bf16 output (out must be DS41_OUT_BF16).  BF16
     * weights: exact dot products, bf16 or fp32 output. */
    void (*linear)(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y, ds41_linear_out out);

    /* Several independent linears in one call (the experts of a MoE layer):
     * for i < n, ys[i][m][0..ws[i]->n) = linear(ws[i], xs[i], Ms[i]) with
     * output rounding `out`, exactly as n calls of `linear` (Ms[i] may be 0).
     * A backend may run them as one parallel job. */
    void (*linear_batch)(const ds41_ops *self, size_t n, const ds41_linear *const *ws, const float *const *xs,
                         const size_t *Ms, float *const *ys, ds41_linear_out out);

    /* RMSNorm of M rows of n values (§2.6, §10.5-10.6):
     * y = bf16(w * fp32(x * rsqrt(fp32(mean_sq(x) + eps)))); w bf16 [n]. */
    void (*rmsnorm)(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n, float eps, float *y);

    /* hc mixes + Sinkhorn of M token streams h[m] ([hc][dim] bf16 values,
     * §2.5, §2.7): pre[m][hc], post[m][hc], comb[m][hc][hc]. */
    void (*hc_mix)(const ds41_ops *self, const float *fn, const float *scale, const float *base, const float *h, size_t M, int hc,
                   size_t dim, float norm_eps, int iters, float hc_eps, float *pre, float *post, float *comb);

    /* out[m] = bf16(sum_c pre[m][c] * h[m][c]) ([dim]), short sum in copy order. */
    void (*hc_pre)(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim, float *out);

    /* out[m][j] = bf16(post[m][j] * o[m] + sum_i comb[m][i][j] * h[m][i]). */
    void (*hc_post)(const ds41_ops *self, const float *o, const float *h, const float *post, const float *comb, size_t M, int hc,
                    size_t dim, float *out);

    /* The rotation table of M rows (§2.6, §10.6): cs[m][0..2*n_pairs) =
     * ds41_rope_cos_sin(freqs, n_pairs, pos[m]) (cos, sin per pair; angles
     * evaluated in double).  An op so that the table is computed where the
     * rope op reads it (device memory on a device backend), from metadata the
     * host has anyway (positions); freqs [n_pairs] is the layer's fixed
     * frequency table. */
    void (*rope_table)(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos, size_t M,
                       float *cs);

    /* Rope of a whole step (§10.6), in place: for every row m < M and head
     * h < n_heads the n_pairs adjacent pairs at x + m*row_stride +
     * h*head_stride are rotated with row m's table cs + m*2*n_pairs
     * (rope_table); inverse != 0 rotates back; bf16 write-back.  x points
     * at the first rotated value of row 0, head 0 (the caller adds the
     * offset of the rope part inside a head), so the q heads, the window KV,
     * the index queries, compressed entries and the inverse rope of the
     * attention output are one call each: strides instead of a call per
     * head and row keep the op one launch over M x n_heads independent
     * rotations. */
    void (*rope)(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride, size_t head_stride,
                 int n_pairs, const float *cs, int inverse);

    /* FP8 activation quantization of a step (§2.2 act_quant, 1x32 blocks,
     * ue8m0 scales): row m of x (n bf16 values) becomes n e4m3 codes then
     * ceil(n/32) scale bytes at out + m*out_stride (the window ring's row
     * format, engine/model/kv_cache.h), as ds41_act_quant.  The window KV of
     * a step stays packed like this for its queries. */
    void (*act_quant_fp8)(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                          size_t out_stride);

    /* The index queries of a step (§2.10 steps 2-3), in place: each row of
     * q [M][qn] gets the FP4 1x32 ue8m0 QDQ (ds41_fp4_act_quant_ue8m0_qdq)
     * and each of w [M][wn] becomes bf16(w * scale). */
    void (*index_query)(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                        float scale);

    /* Quantize-on-append of a step's n compressed entries (§2.9, the KV
     * cache's packed format): entry i of out (entry_bytes apart) is
     * ds41_kv_pack_entry(layout, latent + i*latent_dim, key + i*index_dim)
     * (engine/model/kv_cache.h: FP4 latent with e4m3 scales per 16, FP4
     * index key with ue8m0 scales per 32).  The cache then only places the
     * bytes (ds41_kv_seq_append_packed); a device backend packs straight
     * into its page pool. */
    void (*kv_pack)(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent, const float *key,
                    size_t n, uint8_t *out);

    /* Compressor pooling of a step's n completed groups (§2.9, the numpy
     * side's decision 12): kv and score [n][ratio][hd] are each group's fp32
     * kv and gate scores slot by slot (position mod ratio); per group and
     * channel a softmax over the ratio scores shifted by their maximum, the
     * kv weighted by it and summed in slot order, bf16 into pooled[n][hd]
     * (ds41_rm_compress_pool, engine/backend/refmath.h).  Every group of the
     * step in one call: the engine stages each completed group (its carry
     * slots) contiguously, so the op needs no per-sequence pointers. */
    void (*compress_pool)(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,
                          size_t hd, float *pooled);

    /* Index scores of a step (§2.10 step 4): for each row m < M and entry
     * t < keys->row_reach[m], score[m*score_stride + t] =
     * bf16(sum_h bf16(relu(bf16(q_h . K_t)) * w_h)) with K_t the entry's
     * packed index key, q [M][n_heads][dim] (FP4-QDQ'd), w [M][n_heads]
     * (bf16 values).  Scores past a row's reach are not written.  One call
     * for all rows: the work is sum of the reaches x n_heads x dim, spread
     * over (row, entry) pairs. */
    void (*index_scores)(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads, int dim,
                         const ds41_kv_pages *keys, float *score, size_t score_stride);

    /* Candidate blocks of a step (§2.11), the candidate source's decision:
     * for each row m with reach[m] >= 1, its scores score[m*score_stride ..
     * + reach[m]) give block scores bscore[m*bscore_stride + j] (j <
     * ceil(reach/block): the max over the block, NaN winning; the newest
     * block pinned +inf) and allow[m*allow_stride + j] = 1 for the top
     * n_take blocks (torch.topk's order, lower block on ties) that are not
     * -inf; every other allow flag of the row (up to allow_stride) is 0.
     * The decisions stay in the arrays the caller gives (backend memory on
     * a device backend); the host only reads them to report them. */
    void (*index_blocks)(const ds41_ops *self, const float *score, size_t score_stride, const uint32_t *reach,
                         size_t M, size_t block, size_t n_take, float *bscore, size_t bscore_stride,
                         uint8_t *allow, size_t allow_stride);

    /* Index top-k of a step (§2.10 steps 6-8, §9.2): for each row m, with
     * allow non-NULL (a candidate user) the scores of entries in blocks
     * whose flag allow[m*allow_stride + t/block] is 0 first become -inf in
     * place (so the scores left are the ones ranked); then the top
     * min(k, reach[m]) entries in torch.topk's order (descending, lower
     * index on ties, NaN first; -inf picks kept) go ascending into
     * sel[m*k ..] and their number into count[m] (0 for a row that reaches
     * nothing). */
    void (*index_topk)(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                       size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                       int32_t *sel, uint32_t *count);

    /* The per-query kernel attend is defined by (the CPU backends run it
     * row by row; tests check it directly).
     * Sparse attention of one query position (§2.4, §10.7): q [n_heads][head_dim]
     * bf16 values, sink [n_heads], scale = fp32(head_dim^-0.5); out
     * [n_heads][head_dim] bf16 values.  rows->n_window + n_comp >= 1. */
    void (*sparse_attn)(const ds41_ops *self, const float *q, int n_heads, int head_dim, const float *sink, float scale,
                        const ds41_attn_rows *rows, float *out);

    /* Sparse attention of a whole step: row m's query q + m*n_heads*head_dim
     * attends the rows `step` describes for it (ds41_attn_step), out + m *
     * n_heads*head_dim as sparse_attn.  The op the forward pass calls: one
     * call per layer with per-row metadata; the CPU backends run their
     * sparse_attn kernel row by row through ds41_attn_step_rows, a device
     * backend one launch over the step. */
    void (*attend)(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                   const float *sink, float scale, const ds41_attn_step *step, float *out);

    /* SwiGLU of M rows of n (§2.6): g, u bf16 values (w1, w3 outputs);
     * limit > 0 clamps u to [-limit, limit] and g from above; h = silu(g) * u;
     * route (NULL for the shared expert) multiplies row m by route[m]; out
     * bf16(h). */
    void (*swiglu)(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n, float limit, const float *route, float *out);

    /* MoE combine of M tokens (§2.6, fp32 per §1.7): token m's k routed
     * expert outputs are the rows oe[slot[m*k + j]] ([D] each), j < k, in
     * increasing expert id; out[m][d] = bf16(y + shared[m][d]) with y their
     * fp32 sum from 0 in that order (ds41_rm_moe_combine_token).  A gather
     * per token through slot indices (no scatter into shared rows, no order
     * between threads), so tokens run in parallel on any backend. */
    void (*moe_combine)(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                        const float *shared, size_t M, size_t D, float *out);

    /* Router of M tokens over E experts (§2.6 Gate, §9.2, §10.4): logits
     * [M][E] are the fp32 gate matmul outputs; score =
     * sqrt(softplus(fp32(logit / gate_temp))); the k experts with the highest
     * fp32(score + bias) are chosen (ties: lower expert id), in that order
     * (descending biased score, equal: lower id first) into sel[m][k];
     * weight[m][k] = score at the choice, divided by fp32(short sum in choice
     * order + 1e-20) when k > 1, then times route_scale.  selection, when not
     * NULL, receives [M][E] the fp32(score + bias) the choice ranked: the
     * decision's scores (the §10.1 dump's expert_score), from the op, so the
     * host computes nothing to report them. */
    void (*router)(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                   float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection);

    /* Engram gating (§6.4 steps 3-5, §10.6) of M tokens, in place on
     * h[m] ([hc][dim] bf16 values): kv[m] is the wkv output
     * ([(hc+1)*dim] bf16 values: hc keys then the value), wqk [hc][dim] =
     * fp32(q_weight * k_weight); dim_scale = fp32(dim^-0.5). */
    void (*engram_mix)(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M, int hc, size_t dim, float eps,
                       float dim_scale);

    /* Embedding (§2.7 start): out[m][c][0..dim) = table[ids[m]] for every
     * copy c < hc, table bf16 [vocab][dim]; ids already checked in range. */
    void (*embed)(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc, size_t dim,
                  float *out);

    /* Gather of a step's rows inside backend memory: dst + i*row_bytes gets
     * the row_bytes at src + idx[i]*src_stride for i < n (idx: host
     * metadata).  The MoE sub-layer's per-expert token rows and routing
     * weights, the rows whose logits are wanted: the data stays where the
     * kernels compute, only the indices come from the host. */
    void (*gather_rows)(const ds41_ops *self, void *dst, const void *src, size_t src_stride, const uint32_t *idx,
                        size_t n, size_t row_bytes);

    /* Rows of an FP8 table with 1x32 ue8m0 scales (the Engram tables, §6.4
     * step 1): out[i][0..cols) = bf16(e4m3(q[rows[i]]) * 2^(scale - 127)),
     * q [*][cols], scale [*][ceil(cols/32)]; rows already checked. */
    void (*fp8_rows)(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows, size_t n,
                     size_t cols, float *out);
};

/* The canonical reference backend (REFERENCE §10). */
extern const ds41_ops ds41_ops_reference;

#endif
