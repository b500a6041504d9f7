/* The real device of cuda/gpu.h: a thin mapping onto the CUDA runtime's C API.
 *
 * The runtime is linked statically (cuda/meson.build), so ds41d starts on a
 * machine without CUDA libraries; every entry point that can meet a missing
 * driver or device turns the runtime's error into a message and never
 * aborts.  The runtime's current device is per host thread, and the daemon
 * calls in from several threads (loading, the scheduler, the expert
 * streamer), so every call that creates work selects the table's device
 * first (cheap after the first time on a thread).
 *
 * Async errors: a queued call that the runtime refuses at once (bad pointer,
 * a sticky error from earlier work) is remembered on its stream and returned
 * by the next stream_sync, as gpu.h promises. */
#include "cuda/gpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef DS41_HAVE_CUDA

ds41_gpu *ds41_gpu_cuda_open(int device, ds41_error *err) {
    (void)device;
#ifdef DS41_CUDA_OPTION_DISABLED
    ds41_fail(err, "built without CUDA (configured with -Dcuda=disabled)");
#else
    ds41_fail(err, "built without CUDA (nvcc was not found at build time)");
#endif
    return NULL;
}

#else

#include <cuda_runtime_api.h>

typedef struct cudart_impl {
    int device;
} cudart_impl;

struct ds41_gpu_stream {
    cudaStream_t s;
    cudaError_t pending; /* first error of an async call queued on s */
};

struct ds41_gpu_event {
    cudaEvent_t e;
};

static int dev_of(const ds41_gpu *g) {
    return ((const cudart_impl *)g->impl)->device;
}

/* The runtime's name and message of e, for errors. */
static const char *why(cudaError_t e) {
    return cudaGetErrorString(e);
}

static int select_dev(ds41_gpu *g, const char *call, ds41_error *err) {
    cudaError_t e = cudaSetDevice(dev_of(g));
    if (e == cudaSuccess) return 0;
    ds41_fail(err, "%s: cudaSetDevice(%d): %s", call, dev_of(g), why(e));
    return -1;
}

static cudaStream_t native(const ds41_gpu_stream *s) {
    return s ? s->s : (cudaStream_t)0;
}

static void note(ds41_gpu_stream *s, cudaError_t e) {
    if (e != cudaSuccess && s && s->pending == cudaSuccess) s->pending = e;
}

static int cu_info(ds41_gpu *g, ds41_gpu_info *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    if (select_dev(g, "info", err) != 0) return -1;
    struct cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, dev_of(g));
    if (e != cudaSuccess) {
        ds41_fail(err, "cudaGetDeviceProperties(%d): %s", dev_of(g), why(e));
        return -1;
    }
    snprintf(out->name, sizeof out->name, "%.127s", p.name);
    out->cc_major = p.major;
    out->cc_minor = p.minor;
    out->multiprocessors = p.multiProcessorCount;
    int integrated = 0;
    if (cudaDeviceGetAttribute(&integrated, cudaDevAttrIntegrated, dev_of(g)) == cudaSuccess)
        out->unified = integrated != 0;
    if ((e = cudaDriverGetVersion(&out->driver_version)) != cudaSuccess ||
        (e = cudaRuntimeGetVersion(&out->runtime_version)) != cudaSuccess) {
        ds41_fail(err, "CUDA version query: %s", why(e));
        return -1;
    }
    size_t fr = 0, tot = 0;
    if ((e = cudaMemGetInfo(&fr, &tot)) != cudaSuccess) {
        ds41_fail(err, "cudaMemGetInfo: %s", why(e));
        return -1;
    }
    out->free_bytes = fr;
    out->total_bytes = tot;
    return 0;
}

static void *cu_dev_alloc(ds41_gpu *g, size_t n, ds41_error *err) {
    if (select_dev(g, "dev_alloc", err) != 0) return NULL;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n ? n : 1);
    if (e != cudaSuccess) {
        size_t fr = 0, tot = 0;
        (void)cudaGetLastError(); /* clear the non-sticky allocation error */
        cudaMemGetInfo(&fr, &tot);
        ds41_fail(err, "cudaMalloc of %zu bytes: %s (%zu of %zu bytes free)", n, why(e), fr, tot);
        return NULL;
    }
    /* Zeroed as gpu.h promises.  cudaMemset runs on the legacy default
     * stream, which the table's non-blocking streams do not wait for, so it
     * is finished here before anyone can queue work on the bytes. */
    if ((e = cudaMemset(p, 0, n ? n : 1)) != cudaSuccess || (e = cudaStreamSynchronize(0)) != cudaSuccess) {
        cudaFree(p);
        ds41_fail(err, "zeroing %zu bytes of device memory: %s", n, why(e));
        return NULL;
    }
    return p;
}

static void cu_dev_free(ds41_gpu *g, void *p, size_t n) {
    (void)n;
    if (!p) return;
    cudaSetDevice(dev_of(g));
    cudaFree(p);
}

static void *cu_host_alloc(ds41_gpu *g, size_t n, ds41_error *err) {
    if (select_dev(g, "host_alloc", err) != 0) return NULL;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, n ? n : 1, cudaHostAllocPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        ds41_fail(err, "cudaHostAlloc of %zu bytes of page-locked memory: %s", n, why(e));
        return NULL;
    }
    return p;
}

static void cu_host_free(ds41_gpu *g, void *p, size_t n) {
    (void)g;
    (void)n;
    if (p) cudaFreeHost(p);
}

static ds41_gpu_stream *cu_stream_new(ds41_gpu *g, ds41_error *err) {
    if (select_dev(g, "stream_new", err) != 0) return NULL;
    ds41_gpu_stream *s = calloc(1, sizeof *s);
    if (!s) {
        ds41_fail(err, "out of memory");
        return NULL;
    }
    cudaError_t e = cudaStreamCreateWithFlags(&s->s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(s);
        ds41_fail(err, "cudaStreamCreate: %s", why(e));
        return NULL;
    }
    return s;
}

static void cu_stream_free(ds41_gpu *g, ds41_gpu_stream *s) {
    if (!s) return;
    cudaSetDevice(dev_of(g));
    cudaStreamDestroy(s->s);
    free(s);
}

static int cu_stream_sync(ds41_gpu *g, ds41_gpu_stream *s, ds41_error *err) {
    (void)g;
    cudaError_t e = cudaStreamSynchronize(native(s));
    if (s && s->pending != cudaSuccess) {
        ds41_fail(err, "work queued on a CUDA stream failed: %s", why(s->pending));
        s->pending = cudaSuccess;
        return -1;
    }
    if (e != cudaSuccess) {
        ds41_fail(err, "cudaStreamSynchronize: %s", why(e));
        return -1;
    }
    return 0;
}

static ds41_gpu_event *cu_event_new(ds41_gpu *g, ds41_error *err) {
    if (select_dev(g, "event_new", err) != 0) return NULL;
    ds41_gpu_event *ev = calloc(1, sizeof *ev);
    if (!ev) {
        ds41_fail(err, "out of memory");
        return NULL;
    }
    cudaError_t e = cudaEventCreateWithFlags(&ev->e, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        free(ev);
        ds41_fail(err, "cudaEventCreate: %s", why(e));
        return NULL;
    }
    return ev;
}

static void cu_event_free(ds41_gpu *g, ds41_gpu_event *ev) {
    if (!ev) return;
    cudaSetDevice(dev_of(g));
    cudaEventDestroy(ev->e);
    free(ev);
}

static void cu_event_record(ds41_gpu *g, ds41_gpu_event *ev, ds41_gpu_stream *s) {
    cudaSetDevice(dev_of(g));
    note(s, cudaEventRecord(ev->e, native(s)));
}

static void cu_stream_wait(ds41_gpu *g, ds41_gpu_stream *s, ds41_gpu_event *ev) {
    cudaSetDevice(dev_of(g));
    note(s, cudaStreamWaitEvent(native(s), ev->e, 0));
}

/* An error other than "not ready" counts as done: the waiter goes on and the
 * stream's next sync reports the failure (spinning on it would hang). */
static bool cu_event_done(ds41_gpu *g, ds41_gpu_event *ev) {
    (void)g;
    return cudaEventQuery(ev->e) != cudaErrorNotReady;
}

static void cu_event_sync(ds41_gpu *g, ds41_gpu_event *ev) {
    (void)g;
    cudaEventSynchronize(ev->e);
}

static void copy(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n,
                 enum cudaMemcpyKind k) {
    if (!n) return;
    cudaSetDevice(dev_of(g));
    note(s, cudaMemcpyAsync(dst, src, n, k, native(s)));
}

static void cu_h2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    copy(g, s, dst, src, n, cudaMemcpyHostToDevice);
}
static void cu_d2h(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    copy(g, s, dst, src, n, cudaMemcpyDeviceToHost);
}
static void cu_d2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, const void *src, size_t n) {
    copy(g, s, dst, src, n, cudaMemcpyDeviceToDevice);
}

static void cu_d2d_2d(ds41_gpu *g, ds41_gpu_stream *s, void *dst, size_t dpitch, const void *src,
                      size_t spitch, size_t width, size_t rows) {
    if (!width || !rows) return;
    cudaSetDevice(dev_of(g));
    note(s, cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, native(s)));
}

static void cu_memset0(ds41_gpu *g, ds41_gpu_stream *s, void *dst, size_t n) {
    if (!n) return;
    cudaSetDevice(dev_of(g));
    note(s, cudaMemsetAsync(dst, 0, n, native(s)));
}

static void cu_host_fn(ds41_gpu *g, ds41_gpu_stream *s, void (*fn)(void *arg), void *arg) {
    cudaSetDevice(dev_of(g));
    note(s, cudaLaunchHostFunc(native(s), fn, arg));
}

static void *cu_stream_native(ds41_gpu *g, ds41_gpu_stream *s) {
    (void)g;
    return (void *)native(s);
}

static void cu_destroy(ds41_gpu *g) {
    if (!g) return;
    free(g->impl);
    free(g);
}

/* Why no device is usable, in words a user acts on. */
static void fail_open(ds41_error *err, int device, cudaError_t e) {
    switch (e) {
    case cudaErrorInsufficientDriver:
        ds41_fail(err,
                  "no usable CUDA driver (none installed, or older than CUDA runtime %d.%d this build needs)",
                  CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        break;
    case cudaErrorNoDevice:
        ds41_fail(err, "no CUDA device (the driver found no GPU)");
        break;
    case cudaErrorInvalidDevice:
        ds41_fail(err, "no CUDA device %d", device);
        break;
    default:
        ds41_fail(err, "CUDA device %d unusable: %s (%s)", device, why(e), cudaGetErrorName(e));
        break;
    }
}

ds41_gpu *ds41_gpu_cuda_open(int device, ds41_error *err) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        fail_open(err, device, e);
        return NULL;
    }
    if (device < 0 || device >= count) {
        ds41_fail(err, "no CUDA device %d (%d present)", device, count);
        return NULL;
    }
    /* Creates the primary context: a device in exclusive or prohibited
     * compute mode, or one out of memory, fails here rather than at the
     * first allocation. */
    if ((e = cudaSetDevice(device)) != cudaSuccess || (e = cudaFree(NULL)) != cudaSuccess) {
        fail_open(err, device, e);
        return NULL;
    }
    ds41_gpu *g = calloc(1, sizeof *g);
    cudart_impl *im = calloc(1, sizeof *im);
    if (!g || !im) {
        free(g);
        free(im);
        ds41_fail(err, "out of memory");
        return NULL;
    }
    im->device = device;
    *g = (ds41_gpu){
        .name = "cuda",
        .impl = im,
        .info = cu_info,
        .dev_alloc = cu_dev_alloc,
        .dev_free = cu_dev_free,
        .host_alloc = cu_host_alloc,
        .host_free = cu_host_free,
        .stream_new = cu_stream_new,
        .stream_free = cu_stream_free,
        .stream_sync = cu_stream_sync,
        .event_new = cu_event_new,
        .event_free = cu_event_free,
        .event_record = cu_event_record,
        .stream_wait = cu_stream_wait,
        .event_done = cu_event_done,
        .event_sync = cu_event_sync,
        .h2d = cu_h2d,
        .d2h = cu_d2h,
        .d2d = cu_d2d,
        .d2d_2d = cu_d2d_2d,
        .memset0 = cu_memset0,
        .host_fn = cu_host_fn,
        .stream_native = cu_stream_native,
        .destroy = cu_destroy,
    };
    return g;
}

#endif
