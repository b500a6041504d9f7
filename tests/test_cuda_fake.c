/* The fake device (cuda/gpu_fake.c) keeps CUDA's rules and no more: queued
 * work is deferred until a sync, an event wait or query, or later work that
 * depends on it forces it; streams are ordered only through events; device
 * memory is tracked (range checks, a total that runs out with a clear
 * error).  So host logic that forgets an event reads stale bytes here. */
#include "cuda/gpu_fake.h"
#include "tests/tap.h"

#include <stdlib.h>
#include <string.h>

static ds41_gpu *make(uint64_t total, uint64_t seed) {
    ds41_error err = {0};
    ds41_gpu_fake_opts o = {.total_bytes = total, .seed = seed};
    ds41_gpu *g = ds41_gpu_fake_new(&o, &err);
    if (!g) TAP_NOTE("fake: %s", err.msg);
    return g;
}

/* An upload on a copy stream read back through the compute stream: without
 * the event the compute stream's copy runs first and sees zeros. */
static void missing_wait(void) {
    ds41_error err = {0};
    ds41_gpu *g = make(0, 1);
    ds41_gpu_stream *cp = g->stream_new(g, &err), *cs = g->stream_new(g, &err);
    ds41_gpu_event *ev = g->event_new(g, &err);
    unsigned char *a = g->dev_alloc(g, 64, &err), *b = g->dev_alloc(g, 64, &err);
    unsigned char src[64], out[64];
    memset(src, 0x5a, sizeof src);

    g->h2d(g, cp, a, src, 64);
    g->d2d(g, cs, b, a, 64); /* no wait: unordered */
    g->d2h(g, cs, out, b, 64);
    g->stream_sync(g, cs, &err);
    int zeros = 1;
    for (int i = 0; i < 64; i++) zeros &= out[i] == 0;
    TAP_CHECK(zeros, "without an event the compute stream reads the stale (zero) bytes");
    ds41_gpu_fake_stats st;
    ds41_gpu_fake_get_stats(g, &st);
    TAP_CHECK(st.queued == 1, "the copy stream's upload is still queued (%llu items)",
              (unsigned long long)st.queued);
    g->stream_sync(g, cp, &err);

    /* The same with the event: the wait forces the upload first. */
    unsigned char src2[64];
    memset(src2, 0xa5, sizeof src2);
    g->h2d(g, cp, a, src2, 64);
    g->event_record(g, ev, cp);
    g->stream_wait(g, cs, ev);
    g->d2d(g, cs, b, a, 64);
    g->d2h(g, cs, out, b, 64);
    g->stream_sync(g, cs, &err);
    TAP_CHECK(out[0] == 0xa5 && out[63] == 0xa5, "with record + wait the compute stream sees the upload");

    /* An async upload reads its source when the stream reaches it, not at
     * the call: a host that reuses the buffer before sync sends the new bytes. */
    memset(src, 1, sizeof src);
    g->h2d(g, cp, a, src, 64);
    memset(src, 2, sizeof src);
    g->d2h(g, cp, out, a, 64);
    g->stream_sync(g, cp, &err);
    TAP_CHECK(out[0] == 2, "an h2d source is read when the stream runs it (reuse before sync is visible)");

    /* Work queued on a stream stays queued until forced. */
    memset(out, 0, sizeof out);
    g->d2h(g, cs, out, a, 64);
    TAP_CHECK(out[0] == 0, "a queued download has not run before the stream is synced");
    g->event_record(g, ev, cs);
    g->event_sync(g, ev);
    TAP_CHECK(out[0] == 2, "event_sync runs the stream up to the record");

    g->dev_free(g, a, 64);
    g->dev_free(g, b, 64);
    g->event_free(g, ev);
    g->stream_free(g, cp);
    g->stream_free(g, cs);
    ds41_gpu_free(g);
}

/* Items of one stream run in order; an event refers to the record it was
 * given at the time of the wait, not to a later re-record. */
static int log_buf[64], log_n;
static void log_fn(void *arg) {
    log_buf[log_n++] = (int)(intptr_t)arg;
}

static void event_order(void) {
    ds41_error err = {0};
    ds41_gpu *g = make(0, 7);
    ds41_gpu_stream *s1 = g->stream_new(g, &err), *s2 = g->stream_new(g, &err);
    ds41_gpu_event *e = g->event_new(g, &err);
    log_n = 0;
    g->host_fn(g, s1, log_fn, (void *)1);
    g->host_fn(g, s1, log_fn, (void *)2);
    g->event_record(g, e, s1);
    g->host_fn(g, s1, log_fn, (void *)3);
    g->stream_wait(g, s2, e);
    g->event_record(g, e, s1); /* re-recorded: the wait above still means the first record */
    g->host_fn(g, s2, log_fn, (void *)10);
    g->stream_sync(g, s2, &err);
    TAP_CHECK(log_n == 3 && log_buf[0] == 1 && log_buf[1] == 2 && log_buf[2] == 10,
              "a wait runs the other stream up to its record and no further (got %d items)", log_n);
    TAP_CHECK(!g->event_done(g, e) || log_n >= 4, "the re-recorded event is not done while item 3 is queued");
    g->event_sync(g, e);
    TAP_CHECK(log_n == 4 && log_buf[3] == 3, "event_sync ran the rest of s1 up to the second record");

    /* A poll loop on event_done ends: every query moves the device on. */
    for (int i = 0; i < 20; i++) g->host_fn(g, s1, log_fn, (void *)(intptr_t)(20 + i));
    g->event_record(g, e, s1);
    int polls = 0;
    while (!g->event_done(g, e) && polls < 1000) polls++;
    TAP_CHECK(polls < 1000 && log_n == 24, "polling event_done reaches the record (%d polls)", polls);
    int inorder = 1;
    for (int i = 0; i < 20; i++) inorder &= log_buf[4 + i] == 20 + i;
    TAP_CHECK(inorder, "one stream's items ran in queue order");
    ds41_gpu_event *never = g->event_new(g, &err);
    TAP_CHECK(g->event_done(g, never), "an event never recorded is done (as cudaEventQuery says)");
    g->event_free(g, never);

    /* Two streams without events: the seed picks which ready item runs
     * first when the device makes progress on its own (event queries). */
    int first_s1 = 0, first_s2 = 0;
    for (uint64_t seed = 0; seed < 16; seed++) {
        ds41_gpu *h = make(0, seed);
        ds41_gpu_stream *a = h->stream_new(h, &err), *b = h->stream_new(h, &err);
        ds41_gpu_event *ea = h->event_new(h, &err);
        log_n = 0;
        h->host_fn(h, a, log_fn, (void *)1);
        h->host_fn(h, b, log_fn, (void *)2);
        h->event_record(h, ea, a);
        while (log_n < 2) (void)h->event_done(h, ea);
        first_s1 += log_buf[0] == 1;
        first_s2 += log_buf[0] == 2;
        h->event_free(h, ea);
        ds41_gpu_free(h);
    }
    TAP_CHECK(first_s1 > 0 && first_s2 > 0, "independent streams run in a seeded order (%d / %d)", first_s1,
              first_s2);
    g->event_free(g, e);
    ds41_gpu_free(g);
}

static void memory(void) {
    ds41_error err = {0};
    ds41_gpu *g = make(4096, 3);
    unsigned char *a = g->dev_alloc(g, 1000, &err);
    TAP_CHECK(a && ((uintptr_t)a & 255) == 0, "device allocations are 256-byte aligned");
    int zero = 1;
    for (int i = 0; i < 1000; i++) zero &= a[i] == 0;
    TAP_CHECK(zero, "device allocations are zeroed");
    TAP_CHECK(ds41_gpu_fake_is_device(g, a, 1000) && ds41_gpu_fake_is_device(g, a + 999, 1) &&
                  ds41_gpu_fake_is_device(g, a, 1024),
              "is_device accepts ranges inside the allocation (rounded to 256)");
    TAP_CHECK(!ds41_gpu_fake_is_device(g, a, 1025) && !ds41_gpu_fake_is_device(g, a - 1, 2),
              "is_device rejects ranges that run past the allocation");
    unsigned char host[16];
    TAP_CHECK(!ds41_gpu_fake_is_device(g, host, 1) && !ds41_gpu_fake_is_device(g, NULL, 1),
              "host memory and NULL are not device memory");
    unsigned char *b = g->dev_alloc(g, 3000, &err);
    TAP_CHECK(b != NULL, "a second allocation fits the 4096 bytes");
    ds41_gpu_info info;
    g->info(g, &info, &err);
    TAP_CHECK(info.total_bytes == 4096 && info.free_bytes == 4096 - 1024 - 3072,
              "info reports total and free");
    err.msg[0] = 0;
    void *c = g->dev_alloc(g, 1, &err);
    TAP_CHECK(c == NULL && strstr(err.msg, "out of device memory") && strstr(err.msg, "0 of 4096"),
              "past the total: NULL and a clear error (%s)", err.msg);
    g->dev_free(g, a, 1000);
    TAP_CHECK(!ds41_gpu_fake_is_device(g, a, 1), "a freed allocation is no longer device memory");
    c = g->dev_alloc(g, 1, &err);
    TAP_CHECK(c != NULL, "freed bytes can be allocated again");
    void *p = g->host_alloc(g, 5000, &err);
    ds41_gpu_fake_stats st;
    ds41_gpu_fake_get_stats(g, &st);
    TAP_CHECK(st.dev_bytes == 3072 + 256 && st.dev_allocs == 2 && st.pinned_bytes == 5000,
              "stats: device and pinned bytes held");
    TAP_CHECK(!ds41_gpu_fake_is_device(g, p, 1), "pinned host memory is not device memory");
    g->host_free(g, p, 5000);
    g->dev_free(g, b, 3000);
    g->dev_free(g, c, 1);
    ds41_gpu_free(g);
}

int main(void) {
    missing_wait();
    event_order();
    memory();
    return tap_done();
}
