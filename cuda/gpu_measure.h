/* What a device can move: its memory bandwidth and the host-to-device copy
 * bandwidth from page-locked memory, measured through the device table
 * (cuda/gpu.h) -- ds41ctl doctor prints them and ds41-bench divides by them
 * (bytes touched per token over the device bound; streamed experts' copy
 * rate over what the link gives).
 *
 * Device bandwidth: one d2d copy of `device_bytes` between two device
 * buffers, timed on the host around stream_sync; each pass reads and writes
 * device_bytes, so the figure is 2 * device_bytes / seconds (the convention
 * of the vendors' bandwidth tests and of the HBM figures on data sheets).
 * Host-to-device: one h2d copy of `h2d_bytes` from a page-locked buffer
 * (host_alloc), h2d_bytes / seconds.  Each kind runs one untimed copy first
 * (first-touch mapping, clocks ramping up), then `passes` timed ones; the
 * best pass is reported, as noise only ever slows a copy down. */
#ifndef DS41_CUDA_GPU_MEASURE_H
#define DS41_CUDA_GPU_MEASURE_H

#include "config/error.h"
#include "cuda/gpu.h"

#include <stdint.h>

typedef struct ds41_gpu_measure {
    uint64_t device_bytes; /* size of each copy (bytes read = bytes written) */
    double device_gbs;     /* best pass: 2 * device_bytes / s / 1e9 */
    uint64_t h2d_bytes;
    double h2d_gbs; /* best pass: h2d_bytes / s / 1e9 */
    int passes;
} ds41_gpu_measure;

/* A monotonic clock in seconds (NULL: CLOCK_MONOTONIC).  The tests pass a
 * clock their fake table advances, so the arithmetic is checked exactly
 * without timing anything. */
typedef double (*ds41_gpu_clock_fn)(void *ctx);

/* Measures both on g (bytes 0: that kind is skipped and its figure left 0;
 * passes < 1 counts as 1).  Errors: allocation (the message says how much),
 * a copy that failed (the sync's message), a clock that did not advance. */
int ds41_gpu_measure_run(ds41_gpu *g, uint64_t device_bytes, uint64_t h2d_bytes, int passes,
                         ds41_gpu_clock_fn clock, void *clock_ctx, ds41_gpu_measure *out, ds41_error *err);

#endif
