/* ds41_gpu: the device the CUDA backend drives, as a small table of calls.
 *
 * Everything the backend's host logic does with a GPU -- allocate device and
 * pinned host memory, queue copies on streams, order streams with events,
 * launch kernels on a stream -- goes through this table, so that the logic
 * (weight placement, the expert slot and host tiers, the copy/compute
 * overlap, the metadata arena) is tested on the host against a fake device
 * (cuda/gpu_fake.c) while the real one (cuda/gpu_cudart.c, the CUDA runtime)
 * is only a thin mapping.
 *
 * Semantics are CUDA's: work queued on one stream runs in order; work on
 * different streams is unordered unless an event recorded on one is waited
 * on by the other; *_async calls return before the work is done, and their
 * host buffers must stay untouched (and, for real overlap, pinned) until the
 * stream has passed them.  The fake device honours exactly this and no more:
 * it defers queued work and runs it only when the rules force it (a sync, an
 * event wait, a later item on the same stream), so host logic that forgets an
 * event reads stale bytes in the tests instead of working by luck.
 *
 * Kernels are not in this table: the op table of the backend
 * (cuda/ops_table.c) launches them on ds41_gpu_stream_native(s) (a
 * cudaStream_t on the real device) or, on the fake device, runs their host
 * emulation (cuda/emu_*.c) when the stream reaches it (ds41_gpu_host_fn).
 *
 * Errors: calls that can fail return 0 / non-NULL on success and fill err
 * naming the call and the device's message; a failed async call is reported
 * by the next sync on its stream. */
#ifndef DS41_CUDA_GPU_H
#define DS41_CUDA_GPU_H

#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ds41_gpu ds41_gpu;
typedef struct ds41_gpu_stream ds41_gpu_stream;
typedef struct ds41_gpu_event ds41_gpu_event;

/* What the device is (ds41ctl doctor, /metrics, the placement's budgets). */
typedef struct ds41_gpu_info {
    char name[128];
    int cc_major, cc_minor; /* compute capability */
    int driver_version;     /* CUDA's encoding: 1000 * major + 10 * minor */
    int runtime_version;
    int multiprocessors;
    uint64_t total_bytes, free_bytes; /* device memory at the query */
    bool unified;                     /* integrated / unified memory (Jetson, GB10) */
} ds41_gpu_info;

struct ds41_gpu {
    const char *name; /* "cuda", "fake" */
    void *impl;

    int (*info)(ds41_gpu *g, ds41_gpu_info *out, ds41_error *err);

    /* Device memory: n >= 1 bytes, 256-byte aligned, zeroed; NULL when out of
     * memory (err says how much was asked and what is free). */
    void *(*dev_alloc)(ds41_gpu *g, size_t n, ds41_error *err);
    void (*dev_free)(ds41_gpu *g, void *p, size_t n);
    /* Page-locked host memory for async copies; NULL on failure. */
    void *(*host_alloc)(ds41_gpu *g, size_t n, ds41_error *err);
    void (*host_free)(ds41_gpu *g, void *p, size_t n);

    ds41_gpu_stream *(*stream_new)(ds41_gpu *g, ds41_error *err);
    void (*stream_free)(ds41_gpu *g, ds41_gpu_stream *s);
    /* Wait until everything queued on s has run; 0 or the first error of
     * its work. */
    int (*stream_sync)(ds41_gpu *g, ds41_gpu_stream *s, ds41_error *err);

    ds41_gpu_event *(*event_new)(ds41_gpu *g, ds41_error *err);
    void (*event_free)(ds41_gpu *g, ds41_gpu_event *e);
    /* Mark the point s has reached; a later wait / query refers to it. */
    void (*event_record)(ds41_gpu *g, ds41_gpu_event *e, ds41_gpu_stream *s);
    /* s runs nothing queued after this call before e's point has passed. */
    void (*stream_wait)(ds41_gpu *g, ds41_gpu_stream *s, ds41_gpu_event *e);
    /* Has e's point passed (non-blocking)?  And block until it has. */
    bool (*event_done)(ds41_gpu *g, ds41_gpu_event *e);
    void (*event_sync)(ds41_gpu *g, ds41_gpu_event *e);

    /* Copies queued on s (dst, src: device or host pointers as named). */
    void (*h2d)(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n);
    void (*d2h)(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n);
    void (*d2d)(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n);
    void (*d2d_2d)(ds41_gpu *g, ds41_gpu_stream *s, void *dst, size_t dpitch, const void *src, size_t spitch,
                   size_t width, size_t rows);
    void (*memset0)(ds41_gpu *g, ds41_gpu_stream *s, void *dst, size_t n);

    /* A host function queued on s: runs when s reaches it (the fake device
     * runs kernel emulations this way; the real device uses it for nothing
     * on the hot path). */
    void (*host_fn)(ds41_gpu *g, ds41_gpu_stream *s, void (*fn)(void *arg), void *arg);

    /* The native handle of s (cudaStream_t) for kernel launches; NULL on the
     * fake device. */
    void *(*stream_native)(ds41_gpu *g, ds41_gpu_stream *s);

    void (*destroy)(ds41_gpu *g);
};

/* The first CUDA device, or NULL with err saying why none is usable ("no
 * CUDA driver", "no device", "built without CUDA", the runtime's message).
 * Never aborts on a machine without a GPU or driver. */
ds41_gpu *ds41_gpu_cuda_open(int device, ds41_error *err);

/* The fake device (cuda/gpu_fake.c): device memory is host memory the
 * tests may inspect, queued work is deferred as described above.  Options:
 * total bytes it pretends to have (0: unlimited), and a seed for the order
 * in which it runs independent streams' ready work. */
typedef struct ds41_gpu_fake_opts {
    uint64_t total_bytes;
    uint64_t seed;
} ds41_gpu_fake_opts;
ds41_gpu *ds41_gpu_fake_new(const ds41_gpu_fake_opts *opts, ds41_error *err);

/* Whether p lies inside memory the fake device allocated with dev_alloc (the
 * emulated kernels assert every pointer they read or write is device
 * memory: a host pointer that reached a kernel is the bug a real GPU turns
 * into a fault). */
bool ds41_gpu_fake_is_device(const ds41_gpu *g, const void *p, size_t n);

/* g->destroy(g); NULL is fine. */
void ds41_gpu_free(ds41_gpu *g);

#endif
