/* Choosing a backend by name (cuda/backend_select.h). */
#include "cuda/backend_select.h"

#include "cuda/cuda_backend.h"
#include "cuda/gpu.h"

#include <stdio.h>
#include <string.h>

static const char *const kind_names[] = {"auto", "cpu", "cuda", "cuda-emu", "reference"};

int ds41_backend_kind_parse(const char *s) {
    for (size_t i = 0; s && i < sizeof kind_names / sizeof kind_names[0]; i++)
        if (strcmp(s, kind_names[i]) == 0) return (int)i;
    return -1;
}

const char *ds41_backend_kind_name(ds41_backend_kind k) {
    return (unsigned)k < sizeof kind_names / sizeof kind_names[0] ? kind_names[k] : "?";
}

/* The CUDA backend on an opened device g (the backend owns g from here on,
 * also when it fails). */
static ds41_backend *cuda_on(ds41_gpu *g, int device, ds41_error *err) {
    ds41_cuda_opts o = {.device = device, .gpu = g};
    return ds41_backend_cuda_new(&o, err);
}

ds41_backend *ds41_backend_open_why(const char *kind, const ds41_cpu_opts *cpu, int cuda_device, char *why,
                                    size_t why_n, ds41_error *err) {
    char none[1];
    if (!why || !why_n) {
        why = none;
        why_n = sizeof none;
    }
    why[0] = 0;
    int k = ds41_backend_kind_parse(kind ? kind : "auto");
    if (k < 0) {
        ds41_fail(err, "backend '%.40s': not one of auto, cpu, cuda, cuda-emu, reference", kind);
        return NULL;
    }
    ds41_backend *be = NULL;
    ds41_error gerr = {{0}};
    ds41_gpu *g = NULL;
    switch ((ds41_backend_kind)k) {
    case DS41_BACKEND_AUTO:
        if ((g = ds41_gpu_cuda_open(cuda_device, &gerr))) {
            if ((be = cuda_on(g, cuda_device, &gerr))) {
                snprintf(why, why_n, "backend auto: cuda (CUDA device %d is usable)", cuda_device);
                return be;
            }
            snprintf(why, why_n, "backend auto: cpu (CUDA device %d opened but its backend failed: %.150s)",
                     cuda_device, gerr.msg);
        } else {
            snprintf(why, why_n, "backend auto: cpu (no usable GPU: %.180s)", gerr.msg);
        }
        be = ds41_backend_cpu_new(cpu, err);
        break;
    case DS41_BACKEND_CPU:
        if ((be = ds41_backend_cpu_new(cpu, err))) snprintf(why, why_n, "backend cpu");
        break;
    case DS41_BACKEND_CUDA:
        if (!(g = ds41_gpu_cuda_open(cuda_device, err))) {
            ds41_error_prefix(err, "backend cuda: no usable GPU");
            return NULL;
        }
        if (!(be = cuda_on(g, cuda_device, err))) {
            ds41_error_prefix(err, "backend cuda");
            return NULL;
        }
        snprintf(why, why_n, "backend cuda (device %d)", cuda_device);
        break;
    case DS41_BACKEND_CUDA_EMU: {
        ds41_cuda_opts o = {.emulated = true};
        if (!(be = ds41_backend_cuda_new(&o, err))) {
            ds41_error_prefix(err, "backend cuda-emu");
            return NULL;
        }
        snprintf(why, why_n, "backend cuda-emu (the CUDA kernels emulated on the host: a test mode)");
        break;
    }
    case DS41_BACKEND_REFERENCE:
        if ((be = ds41_backend_reference_new(err))) snprintf(why, why_n, "backend reference");
        break;
    }
    return be;
}

ds41_backend *ds41_backend_open(const char *kind, const ds41_cpu_opts *cpu, int cuda_device,
                                ds41_error *err) {
    return ds41_backend_open_why(kind, cpu, cuda_device, NULL, 0, err);
}
