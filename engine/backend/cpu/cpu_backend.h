/* The fast CPU backend (a ds41_backend, engine/backend/backend.h): threads
 * (engine/backend/cpu/threadpool.h) and SIMD at levels chosen at run time
 * (engine/backend/cpu/ops_fast_avx512.c: AMX tiles and AVX-512, ops_fast_avx2.c,
 * ops_fast_scalar.c; their shared table is the internal fast_kernels.h).
 * This header is its CPU-specific API: the levels, the options, the
 * machine probe; the engine reaches the kernels through the op table.
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
 *    only the accumulation differs: error at most about K 2^-24 of
 *    sum_k |x_k w_k| before the output's bf16 rounding (tests/test_ops_fast.c
 *    within(): 2 (K + 2) 2^-24 of that sum, plus one bf16 ulp).  Every
 *    kernel shape of a level (panel, register tile, the fused decode + dot
 *    of tasks of a few rows) computes the same values in the same order, so
 *    this one bound covers them all;
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
 *    Cost: those linears run at double-precision speed (AVX-512: the
 *    32-value block sums as double FMAs over tiles of 16 columns, weights
 *    decoded once per tile into an L1 panel, fast_kernels.h xlin_cols;
 *    about 4x the bf16 kernels' time per multiply-add, 3-4x at one row);
 *    they are about 1% of a token's multiply-adds at the release shape
 *    (114M of 15.7G), plus layer 14's Engram wkv (the bench preset's
 *    layer 4: 63M, a third of its multiply-adds).
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
 *    scratch panel for many rows, or, for tasks of at most 16 rows at AVX-512
 *    (a speculative step's token + drafts, batched decode; row blocks of at
 *    most 8) and 2 at AVX2, decoding them into registers or an L1 slab right
 *    where they are multiplied; past 4 rows AVX-512 decodes a tile's columns
 *    first and then takes the rows in turn, which reorders work across
 *    outputs but no output's own accumulation)
 *    only when it computes bit-identical values (tests/test_ops_fast.c: rows
 *    alone = batched across those sizes).
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
#ifndef DS41_ENGINE_CPU_BACKEND_H
#define DS41_ENGINE_CPU_BACKEND_H

#include "config/error.h"
#include "engine/backend/backend.h"

#include <stdbool.h>
#include <stdint.h>

/* SIMD levels of the fast CPU kernels, lowest to highest. */
typedef enum ds41_cpu_level {
    DS41_CPU_AUTO = 0,   /* the best the CPU and OS support (and DS41_CPU_LEVEL allows) */
    DS41_CPU_SCALAR = 1, /* portable C */
    DS41_CPU_AVX2 = 2,   /* AVX2 + FMA + F16C: fp32 FMA kernels */
    DS41_CPU_AVX512 = 3, /* AVX-512 F/BW/VL/DQ/VBMI + AVX512_BF16: bf16 dot-product kernels */
    DS41_CPU_AMX = 4,    /* the AVX-512 level + AMX-TILE/AMX-BF16: bf16 tile products for the linears */
} ds41_cpu_level;

/* Options of the fast CPU backend. */
typedef struct ds41_cpu_opts {
    int threads;          /* 0 = one per CPU the process may use */
    bool pin;             /* pin the pool's threads to CPUs (engine/backend/cpu/threadpool.h) */
    ds41_cpu_level level; /* DS41_CPU_AUTO or a cap */
} ds41_cpu_opts;          /* zero-initialised = the defaults */

/* The best level this machine supports: cpuid feature bits, the OS's saved
 * register state (xgetbv) and, for AMX, the kernel's permission for tile
 * data; capped by the environment variable DS41_CPU_LEVEL (scalar, avx2,
 * avx512 or amx) when set. */
ds41_cpu_level ds41_cpu_level_detect(void);

/* "scalar", "avx2", "avx512", "amx" ("auto" for DS41_CPU_AUTO). */
const char *ds41_cpu_level_name(ds41_cpu_level level);

/* The fast CPU backend (engine/backend/cpu/cpu_backend.h).  opts NULL = defaults; a level
 * above what the machine supports is lowered to it.  Errors: thread
 * creation, out of memory. */
ds41_backend *ds41_backend_cpu_new(const ds41_cpu_opts *opts, ds41_error *err);

/* The level a fast CPU backend runs at, DS41_CPU_AUTO for other backends. */
ds41_cpu_level ds41_backend_cpu_level(const ds41_backend *be);

/* Machine figures measured on a fast CPU backend's threads (ds41-bench). */
typedef struct ds41_cpu_measure {
    uint64_t read_bytes; /* size of the buffer read */
    int read_passes;
    double read_gbs; /* best pass: bytes / s / 1e9, every thread streaming its own slice at once */
    double
        fma_gflops; /* best of 3: every thread running 12 independent fp32 FMA chains of the level's width */
} ds41_cpu_measure;

/* Read bandwidth: a buffer of buffer_bytes anonymous memory (4 KiB pages, as
 * the checkpoint's file mapping has) is written once, then read `passes`
 * times start to end by all the pool's threads, each streaming its own slice
 * with the widest loads of the backend's level.  A cache line is read again
 * only after the whole buffer has gone through the caches, so a buffer much
 * larger than the last-level cache (ds41-bench uses >= 4 GiB against a few
 * hundred MiB of L3) measures memory.  FMA peak: 12 independent FMA chains
 * per thread for ~0.2 s.  Errors: not a fast CPU backend, out of memory. */
int ds41_backend_cpu_measure(ds41_backend *be, uint64_t buffer_bytes, int passes, ds41_cpu_measure *out,
                             ds41_error *err);

#endif
