/* cuda/gpu_measure.h against a tiny device table of this test's own: copies
 * are memcpy and advance a virtual clock by what the test says each one
 * takes, so the figures are checked exactly (bytes read + written over the
 * best pass for the device, bytes over the best pass for host-to-device, the
 * untimed first copy left out) without timing anything; and what the
 * measurement asks of the table (sizes, pinned source, a sync per copy,
 * everything freed, errors passed on with context). */
#include "cuda/gpu.h"
#include "cuda/gpu_measure.h"
#include "tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct tiny {
    double now;       /* the virtual clock, seconds */
    double pass_s[8]; /* what copy k (0 = the untimed first) of the current kind takes */
    int copies, d2d_calls, h2d_calls, syncs;
    size_t last_n;
    int dev_live, host_live, streams_live;
    void *host_bufs[4];
    int n_host;
    bool h2d_from_pinned;  /* every h2d source lay in a host_alloc buffer */
    int fail_dev_alloc_at; /* 1-based dev_alloc call that fails (0 none) */
    int dev_allocs;
    bool fail_sync;
    bool frozen_clock;
} tiny;

struct ds41_gpu_stream {
    int unused;
};

static tiny *T(ds41_gpu *g) {
    return g->impl;
}
static void *t_dev_alloc(ds41_gpu *g, size_t n, ds41_error *err) {
    if (++T(g)->dev_allocs == T(g)->fail_dev_alloc_at) {
        ds41_fail(err, "pretend out of device memory (%zu bytes)", n);
        return NULL;
    }
    T(g)->dev_live++;
    return calloc(1, n);
}
static void t_dev_free(ds41_gpu *g, void *p, size_t n) {
    (void)n;
    T(g)->dev_live--;
    free(p);
}
static void *t_host_alloc(ds41_gpu *g, size_t n, ds41_error *err) {
    (void)err;
    void *p = malloc(n);
    T(g)->host_live++;
    if (T(g)->n_host < 4) T(g)->host_bufs[T(g)->n_host++] = p;
    return p;
}
static void t_host_free(ds41_gpu *g, void *p, size_t n) {
    (void)n;
    T(g)->host_live--;
    free(p);
}
static ds41_gpu_stream *t_stream_new(ds41_gpu *g, ds41_error *err) {
    (void)err;
    T(g)->streams_live++;
    return calloc(1, sizeof(ds41_gpu_stream));
}
static void t_stream_free(ds41_gpu *g, ds41_gpu_stream *s) {
    T(g)->streams_live--;
    free(s);
}
static int t_stream_sync(ds41_gpu *g, ds41_gpu_stream *s, ds41_error *err) {
    (void)s;
    T(g)->syncs++;
    if (T(g)->fail_sync) return ds41_fail(err, "pretend copy failure");
    return 0;
}
static void advance(tiny *t, size_t n) {
    t->last_n = n;
    if (!t->frozen_clock) t->now += t->pass_s[t->copies < 8 ? t->copies : 7];
    t->copies++;
}
static void t_d2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    (void)s;
    memcpy(dst, src, n);
    T(g)->d2d_calls++;
    advance(T(g), n);
}
static void t_h2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    (void)s;
    bool pinned = false;
    for (int i = 0; i < T(g)->n_host; i++) pinned |= src == T(g)->host_bufs[i];
    T(g)->h2d_from_pinned &= pinned;
    memcpy(dst, src, n);
    T(g)->h2d_calls++;
    advance(T(g), n);
}
static double t_clock(void *ctx) {
    return ((tiny *)ctx)->now;
}

static ds41_gpu table(tiny *t) {
    memset(t, 0, sizeof *t);
    t->h2d_from_pinned = true;
    ds41_gpu g = {.name = "tiny",
                  .impl = t,
                  .dev_alloc = t_dev_alloc,
                  .dev_free = t_dev_free,
                  .host_alloc = t_host_alloc,
                  .host_free = t_host_free,
                  .stream_new = t_stream_new,
                  .stream_free = t_stream_free,
                  .stream_sync = t_stream_sync,
                  .d2d = t_d2d,
                  .h2d = t_h2d};
    return g;
}

static bool near(double a, double b) {
    return fabs(a - b) <= 1e-9 * fabs(b); /* the virtual clock subtracts times ~10 s apart */
}

int main(void) {
    tiny t;
    ds41_gpu g = table(&t);
    ds41_gpu_measure m;
    ds41_error err = {{0}};

    /* Device only: 1 MiB copies; the untimed first one is slow, the best
     * timed one takes 0.5 ms. */
    const double d_pass[] = {9.0, 0.002, 0.0005, 0.001};
    memcpy(t.pass_s, d_pass, sizeof d_pass);
    int rc = ds41_gpu_measure_run(&g, 1u << 20, 0, 3, t_clock, &t, &m, &err);
    TAP_CHECK(rc == 0 && near(m.device_gbs, 2.0 * (1u << 20) / 0.0005 / 1e9) && m.device_bytes == 1u << 20 &&
                  m.h2d_gbs == 0 && m.h2d_bytes == 0 && m.passes == 3,
              "device bandwidth = bytes read + written over the best timed pass (%s, got %.6f GB/s)",
              rc ? err.msg : "ok", m.device_gbs);
    TAP_CHECK(t.d2d_calls == 4 && t.h2d_calls == 0 && t.syncs == 4 && t.last_n == 1u << 20,
              "one untimed and three timed d2d copies of the size asked, each synced (%d copies, %d syncs)",
              t.d2d_calls, t.syncs);
    TAP_CHECK(t.dev_live == 0 && t.host_live == 0 && t.streams_live == 0,
              "every buffer and the stream are freed");

    /* Both kinds: host-to-device larger than the device copy (a fresh device
     * buffer), from page-locked memory. */
    g = table(&t);
    const double b_pass[] = {1.0, 0.004, 0.004, 5.0, 0.003, 0.002, 0.0025, 0.006};
    memcpy(t.pass_s, b_pass, sizeof b_pass);
    rc = ds41_gpu_measure_run(&g, 4096, 8192, 3, t_clock, &t, &m, &err);
    TAP_CHECK(
        rc == 0 && near(m.device_gbs, 2.0 * 4096 / 0.004 / 1e9) && near(m.h2d_gbs, 8192 / 0.002 / 1e9),
        "host-to-device = bytes over its best timed pass, its untimed copy left out (%s, %.6f / %.6f GB/s)",
        rc ? err.msg : "ok", m.device_gbs, m.h2d_gbs);
    TAP_CHECK(
        t.h2d_calls == 4 && t.h2d_from_pinned && t.last_n == 8192 && t.dev_live == 0 && t.host_live == 0,
        "host-to-device copies come from host_alloc (pinned) memory, all freed (%d copies)", t.h2d_calls);

    /* passes < 1 is one pass. */
    g = table(&t);
    const double one[] = {1.0, 0.25};
    memcpy(t.pass_s, one, sizeof one);
    rc = ds41_gpu_measure_run(&g, 0, 1000, 0, t_clock, &t, &m, &err);
    TAP_CHECK(rc == 0 && m.passes == 1 && t.h2d_calls == 2 && near(m.h2d_gbs, 1000 / 0.25 / 1e9) &&
                  m.device_gbs == 0,
              "passes 0 runs one timed pass; device bytes 0 skips the device figure");

    /* Errors carry the measurement's context and leave nothing allocated. */
    g = table(&t);
    t.fail_dev_alloc_at = 2;
    rc = ds41_gpu_measure_run(&g, 4096, 4096, 2, t_clock, &t, &m, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "measuring device bandwidth") && strstr(err.msg, "4096 bytes") &&
                  t.dev_live == 0 && t.streams_live == 0,
              "a failed allocation is an error naming the measurement and the size (%s)", err.msg);
    g = table(&t);
    t.fail_sync = true;
    t.pass_s[0] = 1;
    rc = ds41_gpu_measure_run(&g, 0, 4096, 2, t_clock, &t, &m, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "host-to-device copy of 4096 bytes") &&
                  strstr(err.msg, "pretend copy") && t.dev_live == 0 && t.host_live == 0,
              "a failed copy is reported by its sync, naming the copy (%s)", err.msg);
    g = table(&t);
    t.frozen_clock = true;
    rc = ds41_gpu_measure_run(&g, 4096, 0, 2, t_clock, &t, &m, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "clock did not advance") && t.dev_live == 0,
              "a clock that stands still is an error, not an infinite bandwidth (%s)", err.msg);

    /* The real clock (NULL) on the tiny table gives a positive figure. */
    g = table(&t);
    rc = ds41_gpu_measure_run(&g, 1u << 20, 1u << 20, 2, NULL, NULL, &m, &err);
    TAP_CHECK(rc == 0 && m.device_gbs > 0 && m.h2d_gbs > 0, "the monotonic clock is the default (%s)",
              rc ? err.msg : "ok");
    return tap_done();
}
