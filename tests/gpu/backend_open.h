/* The backend a GPU check runs on, by the name --backend takes (cpu, reference, cuda-emu, cuda):
 * the programs of tests/gpu/ (ds41-opcheck) and the forward-pass checks that take
 * DS41_TEST_BACKEND open it here.
 *
 * cpu and reference are always available.  cuda and cuda-emu come from the backend selection of
 * cuda/backend_select.h (ds41_backend_open, the same choice ds41-eval --backend makes) when the
 * tree has it; a tree without it reports them unavailable, and the callers skip (exit 77) rather
 * than fail, so a branch without the CUDA backend still runs everything else. */
#ifndef DS41_TESTS_GPU_BACKEND_OPEN_H
#define DS41_TESTS_GPU_BACKEND_OPEN_H

#include "config/error.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"

#include <string.h>

#if defined(__has_include)
#if __has_include("cuda/backend_select.h")
#include "cuda/backend_select.h"
#define DS41_CHECK_HAVE_BACKEND_SELECT 1
#endif
#endif

/* The backend `kind` (threads: the fast CPU backend's pool, 0 = one per CPU; device: the CUDA
 * device ordinal), or NULL with err set; *unavailable is set when this build cannot make that
 * kind (any failure to open a kind other than cpu: the caller skips; check.sh counts a skip of
 * cuda on a device as a failure), clear for a real failure. */
__attribute__((unused)) static ds41_backend *check_backend_open(const char *kind, int threads, int device,
                                                                int *unavailable, ds41_error *err) {
    ds41_cpu_opts cpu = {.threads = threads};
    *unavailable = 0;
    if (strcmp(kind, "reference") == 0) return ds41_backend_reference_new(err);
#ifdef DS41_CHECK_HAVE_BACKEND_SELECT
    ds41_backend *be = ds41_backend_open(kind, &cpu, device, err);
    if (!be && strcmp(kind, "cpu") != 0) *unavailable = 1;
    return be;
#else
    (void)device;
    if (strcmp(kind, "cpu") == 0) return ds41_backend_cpu_new(&cpu, err);
    *unavailable = 1;
    ds41_fail(err, "backend '%s' is not in this build (no cuda/backend_select.h: cpu and reference only)",
              kind);
    return NULL;
#endif
}

#endif
