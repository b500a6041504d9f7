/* The fast CPU backend's level kernels, shared by the backend (ops_fast.c)
 * and each level's file (ops_fast_scalar.c, ops_fast_avx2.c,
 * ops_fast_avx512.c): the kernel table every level fills in and the exact
 * helpers they all use.  Internal to engine/backend/cpu/; the numerics and
 * invariance contract these kernels keep is in cpu_backend.h. */
#ifndef DS41_ENGINE_FAST_KERNELS_H
#define DS41_ENGINE_FAST_KERNELS_H

#include "engine/backend/cpu/cpu_backend.h"
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
/* Output columns per exact-linear tile (xlin_cols). */
#define XLIN_COLS 16

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

    /* Exact linears (DS41_OUT_BF16_EXACT / DS41_OUT_F32_EXACT: the indexer's
     * inputs, cpu_backend.h), the reference's value bit for bit; NULL where
     * the level has none (ops_fast.c then runs the reference's arithmetic
     * element by element).
     *   xlin_cols: FP8 / FP4 weights, output columns [n0, n1) (n0 a multiple
     *     of XLIN_COLS) of all M rows: per 32-wide K block the exact sum of
     *     the code products rounded to fp32, times fp32(a_scale * w_scale),
     *     added to an fp32 accumulator in block order; y = that accumulator
     *     rounded to bf16.  ad: [M][nkb * 32] the activations' code values
     *     (unscaled, exact in double, zero past K), as: [M][nkb] their
     *     scales.  A column whose codes include NaN or whose scale bytes
     *     include 255 gets bad[n - n0] = 1 and an undefined value (the
     *     caller recomputes it; so it does rows with NaN activations).
     *   xlin_scratch: the per-thread scratch bytes xlin_cols needs for M rows.
     *   xdot_bf16: ds41_xdot_f32_bf16 (the exact sum rounded once). */
    void (*xlin_cols)(const ds41_linear *w, const double *ad, const float *as, size_t M, size_t n0, size_t n1,
                      float *y, void *scratch, uint8_t *bad);
    size_t (*xlin_scratch)(size_t M);
    float (*xdot_bf16)(const float *x, const uint16_t *w, size_t n);

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
