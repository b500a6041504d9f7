/* Device and host-to-device copy bandwidth (cuda/gpu_measure.h). */
#include "cuda/gpu_measure.h"

#include <string.h>
#include <time.h>

static double mono_now(void *ctx) {
    (void)ctx;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct timer {
    ds41_gpu_clock_fn now;
    void *ctx;
} timer;

/* The best (shortest) of `passes` timed copies after one untimed one, in
 * seconds; -1 with err set on a failed copy or a clock that stood still. */
static double best_copy(ds41_gpu *g, ds41_gpu_stream *s, bool h2d, void *dst, const void *src, uint64_t n,
                        int passes, const timer *t, ds41_error *err) {
    double best = -1;
    for (int i = -1; i < passes; i++) {
        double t0 = t->now(t->ctx);
        if (h2d)
            g->h2d(g, s, dst, src, (size_t)n);
        else
            g->d2d(g, s, dst, src, (size_t)n);
        if (g->stream_sync(g, s, err) != 0) {
            ds41_error_prefix(err, "%s copy of %llu bytes", h2d ? "host-to-device" : "device",
                              (unsigned long long)n);
            return -1;
        }
        double dt = t->now(t->ctx) - t0;
        if (i < 0) continue; /* the untimed first copy */
        if (!(dt > 0)) {
            ds41_fail(err, "%s copy of %llu bytes: the clock did not advance",
                      h2d ? "host-to-device" : "device", (unsigned long long)n);
            return -1;
        }
        if (best < 0 || dt < best) best = dt;
    }
    return best;
}

int ds41_gpu_measure_run(ds41_gpu *g, uint64_t device_bytes, uint64_t h2d_bytes, int passes,
                         ds41_gpu_clock_fn clock, void *clock_ctx, ds41_gpu_measure *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    out->passes = passes < 1 ? 1 : passes;
    timer t = {clock ? clock : mono_now, clock ? clock_ctx : NULL};
    ds41_gpu_stream *s = g->stream_new(g, err);
    if (!s) return -1;
    int rc = -1;
    void *a = NULL, *b = NULL, *host = NULL;
    if (device_bytes) {
        if (!(a = g->dev_alloc(g, (size_t)device_bytes, err)) ||
            !(b = g->dev_alloc(g, (size_t)device_bytes, err))) {
            ds41_error_prefix(err, "measuring device bandwidth");
            goto out;
        }
        double dt = best_copy(g, s, false, b, a, device_bytes, out->passes, &t, err);
        if (dt < 0) goto out;
        out->device_bytes = device_bytes;
        out->device_gbs = 2.0 * (double)device_bytes / dt / 1e9;
        g->dev_free(g, b, (size_t)device_bytes);
        b = NULL;
    }
    if (h2d_bytes) {
        if (!a || device_bytes < h2d_bytes) {
            if (a) g->dev_free(g, a, (size_t)device_bytes);
            device_bytes = h2d_bytes;
            if (!(a = g->dev_alloc(g, (size_t)h2d_bytes, err))) {
                ds41_error_prefix(err, "measuring host-to-device bandwidth");
                goto out;
            }
        }
        if (!(host = g->host_alloc(g, (size_t)h2d_bytes, err))) {
            ds41_error_prefix(err, "measuring host-to-device bandwidth");
            goto out;
        }
        memset(host, 0x5a, (size_t)h2d_bytes); /* touched, so no page is mapped during a timed copy */
        double dt = best_copy(g, s, true, a, host, h2d_bytes, out->passes, &t, err);
        if (dt < 0) goto out;
        out->h2d_bytes = h2d_bytes;
        out->h2d_gbs = (double)h2d_bytes / dt / 1e9;
    }
    rc = 0;
out:
    if (host) g->host_free(g, host, (size_t)h2d_bytes);
    if (b) g->dev_free(g, b, (size_t)device_bytes);
    if (a) g->dev_free(g, a, (size_t)device_bytes);
    g->stream_free(g, s);
    return rc;
}
