/* Choosing a backend by name: what `engine.backend` (ds41d.yaml) and
 * `--backend` (ds41-eval, ds41-bench, ds41-generate) say.
 *
 *  - "auto": the CUDA backend when a usable GPU is present (the device
 *    opens: driver, device and context), else the fast CPU backend; `why`
 *    receives one line saying which and why, for the log.
 *  - "cpu": the fast CPU backend (engine/backend/cpu/cpu_backend.h).
 *  - "cuda": the CUDA backend on device cuda_device; no usable GPU is an
 *    error naming the reason (no driver, no device, built without CUDA).
 *  - "cuda-emu": the CUDA backend with its kernels emulated on the host on
 *    the fake device (cuda/cuda_backend.h): the backend's placement, pools
 *    and streams with the kernels' arithmetic, on any machine; a test mode,
 *    slow, never picked by auto.
 *  - "reference": the reference backend (REFERENCE §10). */
#ifndef DS41_CUDA_BACKEND_SELECT_H
#define DS41_CUDA_BACKEND_SELECT_H

#include "config/error.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"

#include <stddef.h>

typedef enum ds41_backend_kind {
    DS41_BACKEND_AUTO = 0,
    DS41_BACKEND_CPU,
    DS41_BACKEND_CUDA,
    DS41_BACKEND_CUDA_EMU,
    DS41_BACKEND_REFERENCE,
} ds41_backend_kind;

/* "auto", "cpu", "cuda", "cuda-emu", "reference" -> the kind; -1 otherwise. */
int ds41_backend_kind_parse(const char *s);
const char *ds41_backend_kind_name(ds41_backend_kind k);

/* The backend `kind` names (NULL = "auto"); cpu: the fast CPU backend's
 * options (NULL = defaults).  Errors name the kind and the reason. */
ds41_backend *ds41_backend_open(const char *kind, const ds41_cpu_opts *cpu, int cuda_device, ds41_error *err);

/* The same, and the line saying what was chosen and why into why[0..why_n)
 * (always for auto; for the others, what was opened). */
ds41_backend *ds41_backend_open_why(const char *kind, const ds41_cpu_opts *cpu, int cuda_device, char *why,
                                    size_t why_n, ds41_error *err);

#endif
