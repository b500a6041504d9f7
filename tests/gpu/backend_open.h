/* The backend a GPU check runs on, by the name --backend takes (cpu, reference, cuda-emu, cuda):
 * the programs of tests/gpu/ (ds41-opcheck) and the forward-pass checks that take
 * DS41_TEST_BACKEND open it here.
 *
 * Every kind comes from the backend selection of cuda/backend_select.h (ds41_backend_open, the
 * same choice ds41-eval --backend makes).  cpu, reference and cuda-emu (the kernels' host
 * emulation) exist on every host, so failing to open them is a failure; cuda needs a GPU, and a
 * host without one reports it unavailable: the callers skip (exit 77) there, and check.sh counts a
 * skip of cuda on a device as a failure. */
#ifndef DS41_TESTS_GPU_BACKEND_OPEN_H
#define DS41_TESTS_GPU_BACKEND_OPEN_H

#include "config/error.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"

#include <string.h>

#include "cuda/backend_select.h"

/* The backend `kind` (threads: the fast CPU backend's pool, 0 = one per CPU; device: the CUDA
 * device ordinal), or NULL with err set; *unavailable is set when kind is cuda and this host or
 * build has no usable GPU (the caller skips), clear for a real failure. */
__attribute__((unused)) static ds41_backend *check_backend_open(const char *kind, int threads, int device,
                                                                int *unavailable, ds41_error *err) {
    ds41_cpu_opts cpu = {.threads = threads};
    *unavailable = 0;
    if (strcmp(kind, "reference") == 0) return ds41_backend_reference_new(err);
    ds41_backend *be = ds41_backend_open(kind, &cpu, device, err);
    if (!be && strcmp(kind, "cuda") == 0) *unavailable = 1;
    return be;
}

#endif
