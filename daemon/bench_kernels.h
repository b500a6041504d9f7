/* Kernel ceilings for ds41-bench --kernels: how fast the backend's linear
 * kernel consumes weights of each stored format, with the weights in cache
 * and with them streamed from memory, at the row counts decode uses.
 *
 * Decode reads every weight once per step, so its tokens/s is bounded both by
 * the memory bandwidth and by how many weight bytes per second the kernels
 * can turn into products.  On few cores the second bound can be the lower
 * one (FP8/FP4 codes are expanded to bf16 before the tile products); these
 * figures say which, per format, without a checkpoint. */
#ifndef DS41_DAEMON_BENCH_KERNELS_H
#define DS41_DAEMON_BENCH_KERNELS_H

#include "config/error.h"
#include "engine/backend/backend.h"

#include <stddef.h>
#include <stdint.h>

typedef struct ds41_kernel_ceiling {
    const char *format; /* "bf16", "fp8", "fp4" */
    size_t n, k;        /* one linear's shape (output rows x inputs) */
    size_t linears;     /* linears per call (a MoE layer's experts are one call) */
    size_t rows;        /* activation rows per linear (the batch a weight serves) */
    double cache_gbs;   /* weight bytes (codes + scales) per second, the set in cache */
    double memory_gbs;  /* the same with a set far larger than the last-level cache */
} ds41_kernel_ceiling;

/* Runs the table of shapes (bench-preset proportions: experts 512x2048 FP4,
 * attention 2048x2048 FP8, head-like 8192x2048 bf16; 1, 4 and 16 rows) on
 * be's linear_batch.  The in-cache set is about 1 MiB per thread, repeated;
 * the memory set is memory_bytes (>= 64 MiB), each weight read once per pass,
 * best of 3 passes.  Weights are synthetic and valid (no NaN codes, ordinary
 * scales), so every kernel takes its fast path.  Fills out[0 .. *n) (cap >=
 * 9).  Errors: out of memory. */
int ds41_bench_kernel_ceilings(ds41_backend *be, uint64_t memory_bytes, ds41_kernel_ceiling *out, size_t cap,
                               size_t *n, ds41_error *err);

#endif
