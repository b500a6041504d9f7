/* The fast CPU backend's kernels (ds41_backend_cpu_new, engine/backend/backend.h):
 * threads (engine/backend/cpu/threadpool.h) and SIMD at three levels chosen at run time
 * (engine/backend/cpu/ops_fast_avx512.c: AMX tiles and AVX-512, ops_fast_avx2.c,
 * ops_fast_scalar.c).  Not a
 * public header: the engine reaches these kernels through the op table.
 *
 * Numerics.  The fast path keeps every rounding point of the reference
 * (REFERENCE.md §10): activations entering FP8/FP4 linears are quantized per
 * 1x32 exactly as ds41_act_quant does, outputs are rounded to bf16 where the
 * reference rounds, attention probabilities are rounded to bf16 before the PV
 * product, index scores go through their three bf16 roundings, and so on.
 * What it does not keep is the reference's exact reductions:
 *  - the linear layers (nearly all the arithmetic) accumulate in fp32 in
 *    the order the kernel finds fastest (AMX tiles, bf16 or fp32 FMA).  FP8 /
 *    FP4 weights and activations are decoded to their exact values (scales
 *    folded in where the product is exact: every e4m3 / e2m1 value times a
 *    power of two is exact in bf16 and fp32), so the products are exact and
 *    only the accumulation differs;
 *  - every other reduction (means of squares, hc mixes, attention scores,
 *    softmax sums and PV, index scores, Engram) is a double sum of exact
 *    products rounded once, in a fixed order, with the reference's sequence
 *    of fp32 operations and its double-evaluated exp/rsqrt/silu/sigmoid.
 *    That is the reference's result except when the double sum itself
 *    rounds; it costs little (these ops are a few percent of the work) and
 *    matters: an fp32-ordered attention or norm flips bf16 outputs that the
 *    next FP8 quantization, index top-k or router turns into errors of
 *    several percent in a row, which the layer-local check then counts (an
 *    fp32 variant of the numpy reference fails it on most long-preset
 *    prompts).
 * This is checked layer by layer against the numpy reference
 * (tests/reference/test_layer_check.py).
 *
 * Decisions (REFERENCE §10.1 decision contract) and their score error.  The
 * fast path makes three kinds: the index top-k, the candidate blocks and the
 * routed experts.  A decision may differ from the reference's (and from
 * another level's) only where the scores it compares differ by no more than
 * the documented error below; tests/reference/test_simd_diff.py checks it.
 *  - Index scores and candidate block scores: error 0.  Every input of an
 *    index score is computed with the reference's arithmetic: the linears
 *    of the indexer's path (wq_a of an index source, idx_wq_b,
 *    weights_proj, the compressor's wkv and wgate, idx_wk, and the Engram
 *    wkv of an Engram layer that is a KV or index source: its output is
 *    part of the block's input there) take
 *    DS41_OUT_BF16_EXACT / DS41_OUT_F32_EXACT (engine/backend/ops.h: per 32-block
 *    exact code sums and the reference's fp32 block chain for FP8, the
 *    exact sum rounded once for BF16), and the norms, pooling, rope, FP4
 *    QDQ and the score's head sum are the reductions above.  This matters
 *    because the index query and key pass through FP4 (e2m1: one mantissa
 *    bit) after those linears: an fp32-ordered accumulation that lands one
 *    bf16 ulp away flips an FP4 code and moves a score by ~10%, swapping
 *    top-k entries far from any tie (tests/data/regress-simd-indexer).  So
 *    index selections and candidate blocks equal the reference's given the
 *    same block inputs (the one exception: a double sum of n exact terms is
 *    off by at most n * 2^-53 of its terms' magnitude, which changes the
 *    fp32 result only within that distance of a rounding boundary).
 *    Cost: those linears run at double-precision dot speed; they are
 *    about 1% of a token's multiply-adds at the release shape (114M of
 *    15.7G, plus layer 14's Engram wkv).
 *  - Routed experts: error e_route = 2^-8 * (1 + |s|) of each selection
 *    score s = sqrt(softplus(z / gate_temp)) + bias, given the same block
 *    input (tests/reference/ds41_ref.py route_error_bound).  Two sources:
 *    the gate's own fp32 accumulation of K = dim products (|dz| <= g_K * A,
 *    g_K = K 2^-24 / (1 - K 2^-24), A = sum_i |x_i w_i|; the score's slope
 *    in z is at most 0.32), and, much larger, the FFN input itself: it
 *    carries the block's attention output, whose bf16 values differ from
 *    the reference's by the linears' tolerated accumulation order.  The
 *    bound is not derived a priori but measured: over the differential
 *    sweeps (test_simd_diff.py) the largest score difference between two
 *    levels is about a tenth of the two levels' e_route together.  Routings
 *    may differ only between experts whose scores are within that sum (and
 *    against the reference, within the one e_route).  The gate stays a fast
 *    fp32 linear: most of e_route comes from the FFN input, which an exact
 *    gate would not remove.
 *
 * Batch and chunk invariance, the rule every kernel follows: the value of an
 * output element is a function of its own inputs only, computed by the same
 * sequence of floating-point operations whatever the number of rows M of the
 * call, the row's index among them, the number of threads and which thread
 * runs it.  Concretely:
 *  - reductions run along the row's own data (K for a linear, the head
 *    dimension for attention) in a fixed blocking that depends only on K and
 *    the level, never split across threads, never across rows;
 *  - register tiles over several rows repeat, row by row, exactly the
 *    instruction sequence of a one-row tile (a remainder tile of fewer rows
 *    is the same code with fewer rows);
 *  - threads split output columns (and, for large M, row blocks), never a
 *    reduction;
 *  - the kernel chosen may depend on M (e.g. decoding weights once into a
 *    scratch panel for many rows) only when it computes bit-identical values.
 * So a sequence's logits are the same whatever shares its decode step and
 * however its prompt was chunked (tests/test_fast_forward.c).  They differ
 * between levels (AVX-512, AVX2, scalar sum in different orders), which is
 * why a level is fixed for the life of a backend.
 *
 * DS41_FAST_PROFILE: when set at backend creation, the backend times its
 * ops by kind and prints the totals (seconds, calls, weight GB/s) to stderr
 * when it is freed (ds41-bench, ds41-eval).
 *
 * DS41_FAST_BREAK (test only): when this environment variable names a
 * rounding point at backend creation, the backend skips it, to show that the
 * layer-local check catches such a mistake: "index_bf16" (the head sum of
 * the index scores is not rounded to bf16), "swiglu_bf16" (the SwiGLU output
 * entering w2 is not rounded to bf16), "attn_p_bf16" (attention
 * probabilities are not rounded to bf16 before the PV product). */
#ifndef DS41_ENGINE_OPS_FAST_H
#define DS41_ENGINE_OPS_FAST_H

#include "engine/backend/backend.h"
#include "engine/backend/ops.h"
#include "engine/model/quant.h"
#include "engine/model/weights.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Linear layers.  A call is split into tasks of FAST_COLS output columns
 * (aligned, so an FP8 32x32 scale block never straddles two tasks) times row
 * blocks of FAST_ROWS rows; a task computes y[m][n] for its rows and columns
 * from the packed activations of every row. */
#define FAST_COLS 32
#define FAST_ROWS 128

/* The weight bytes the calling thread's next task will read, in memory
 * order (up to two ranges: codes and scales).  A kernel may advance through
 * them with software prefetches while it works on its own task, so that a
 * thread walking contiguous tasks keeps one memory stream going across task
 * boundaries (each task on its own would start with a burst of demand
 * misses).  Prefetching is a hint: results never depend on it. */
typedef struct fast_prefetch {
    const char *p[2], *end[2];
} fast_prefetch;

typedef struct fast_kernels {
    ds41_cpu_level level;
    /* Build the level's tables (idempotent; called before any kernel). */
    void (*init)(void);

    /* Packed activations of a linear call: bytes for M rows of K; the
     * inputs (bf16 values) packed into act, groups of rows in parallel, each
     * call writing only its group's bytes.  FP8/FP4 quantize the row
     * per 1x32 exactly as ds41_act_quant and keep the exact values, BF16
     * keeps x.  The layout is private to the level. */
    size_t (*act_bytes)(ds41_linear_kind kind, size_t K, size_t M);
    /* Packs rows [m, min(m + pack_rows, M)) (m a multiple of pack_rows),
     * x = row m's input (rows K apart). */
    void (*pack_act)(ds41_linear_kind kind, const float *x, size_t K, size_t M, size_t m, uint8_t *act);
    size_t pack_rows;
    /* Per-thread scratch a linear_cols call needs. */
    size_t (*scratch_bytes)(ds41_linear_kind kind, size_t rows, size_t K);
    /* y[m * N + n] for m in [m0, m1), n in [n0, n1) (N = w->n; m0 a multiple
     * of FAST_ROWS, n0 of FAST_COLS): the dot product of row m's packed
     * activation with weight row n, rounded to bf16 when out_bf16. */
    void (*linear_cols)(const ds41_linear *w, const uint8_t *act, size_t M, size_t m0, size_t m1, size_t n0,
                        size_t n1, float *y, int out_bf16, void *scratch, fast_prefetch *next);

    /* Reductions outside the linear layers, in double: products of fp32
     * values are exact in double, and their double sum, rounded once to
     * fp32 by the caller, is the reference's exact sum rounded once except
     * in (rare) cases the double sum itself rounded.  The order is fixed
     * (a function of n only).
     *   dot:   sum of a[i] * b[i]
     *   sumsq: sum of fp32(x[i] * x[i]) (the squares rounded to fp32 first,
     *          as the reference's means of squares)
     *   axpy:  y[i] += a * x[i] with y in double */
    double (*dot)(const float *a, const float *b, size_t n);
    double (*sumsq)(const float *x, size_t n);
    void (*axpy)(double *y, float a, const float *x, size_t n);
    /* Attention inner loops (NULL: built from dot / axpy):
     *   qk: z[j] = dot(q, kv + j * hd, hd) for j < n (in double, as dot);
     *   pv: pv[d] = sum over j < n of p[j] * kv[j * hd + d] in double, in
     *       j order for every d (the fresh sum, not accumulated). */
    void (*qk)(const float *q, const float *kv, size_t n, size_t hd, double *z);
    void (*pv)(const float *p, const float *kv, size_t n, size_t hd, double *pv);
    /* out[i] = fp32(exp(double(x[i]))): ds41_rm_exp, the reference's exp
     * (a double exp accurate to an ulp, rounded once; equal to the C
     * library's except where the two double results straddle an fp32
     * rounding boundary). */
    void (*exp)(const float *x, float *out, size_t n);
    /* Decode a packed window-ring row (e4m3 + ue8m0 per 32) / a compressed
     * latent (e2m1 + e4m3 scale per 16) of dim values to their exact values
     * (dim a multiple of 32, as the kv cache layout guarantees). */
    void (*decode_ring_row)(const uint8_t *row, size_t dim, float *out);
    void (*decode_latent)(const uint8_t *entry, size_t dim, float *out);

    /* Machine measurements for ds41-bench: read `bytes` (a multiple of 256,
     * 64-byte aligned) with the widest loads, returning a value that depends
     * on every byte; and run iters x 12 independent FMA chains of fma_lanes
     * fp32 lanes (2 * 12 * fma_lanes flops per iteration). */
    uint64_t (*read_sum)(const void *p, size_t bytes);
    float (*fma_burn)(size_t iters, float seed);
    unsigned fma_lanes;
} fast_kernels;

extern const fast_kernels ds41__fast_scalar;
#if defined(__x86_64__)
extern const fast_kernels ds41__fast_avx2;
extern const fast_kernels ds41__fast_avx512;
extern const fast_kernels ds41__fast_amx;
/* Ask the kernel for AMX tile state (once per process); 1 if granted. */
int ds41__amx_enable(void);
#endif

/* ---- shared helpers (exact) ------------------------------------------------------ */

static inline uint32_t fast_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float fast_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> nearest bf16 value (RNE), NaN kept quiet: ds41_bf16_round inline. */
static inline float fast_bf16_round(float x) {
    uint32_t u = fast_f32_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return fast_f32_from_bits((u | 0x00400000u) & 0xFFFF0000u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return fast_f32_from_bits(u & 0xFFFF0000u);
}

/* 2^(b - 127) for a ue8m0 byte (255 = NaN, 0 = 2^-127). */
static inline float fast_ue8m0(uint8_t b) {
    if (b == 255) return fast_f32_from_bits(0x7FC00000u);
    if (b == 0) return 0x1p-127f;
    return fast_f32_from_bits((uint32_t)b << 23);
}

/* Row bytes of a weight's codes and the row stride of its scales. */
static inline size_t fast_row_bytes(const ds41_linear *w) {
    return w->kind == DS41_LINEAR_FP4 ? (size_t)(w->k + 1) / 2 : (size_t)w->k;
}

/* Exact value of weight element (n, k) of an FP8 / FP4 linear. */
static inline float fast_weight_value(const ds41_linear *w, size_t n, size_t k) {
    if (w->kind == DS41_LINEAR_FP8) {
        const float s = fast_ue8m0(w->scale[(n / 32) * (size_t)w->scale_cols + k / 32]);
        return ds41_e4m3_table[w->q[n * (size_t)w->k + k]] * s;
    }
    const uint8_t byte = w->q[n * fast_row_bytes(w) + k / 2];
    const float s = fast_ue8m0(w->scale[n * (size_t)w->scale_cols + k / 32]);
    return ds41_e2m1_table[(byte >> ((k & 1) * 4)) & 15] * s;
}

#endif
