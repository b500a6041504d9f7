/* The guard backend (issue 14): the fast CPU backend's kernels on memory the
 * host cannot touch.
 *
 * Its memory (engine/backend/memory.h: the engine's activations and scratch,
 * the KV page pool, window rings and compressor carries, expert slots, the
 * per-step Engram rows) comes from one reserved address range that is
 * mprotect()ed PROT_NONE except while one of its own ops or memory calls
 * runs.  The engine, the scheduler and every tool are supposed to reach
 * backend memory only through those; any access the seam forgot faults on
 * the spot instead of silently working on a CPU and failing on a GPU.  The
 * kernels are the fast backend's, so logits must be byte-identical to
 * ds41_backend_cpu_new's with the same options (meson test device_guard).
 *
 * For tests only: every op and memory call costs two mprotect() calls. */
#ifndef DS41_TESTS_GUARD_BACKEND_H
#define DS41_TESTS_GUARD_BACKEND_H

#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"

#include <stdbool.h>
#include <stdint.h>

/* A guard backend around a fast CPU backend made with opts (NULL: defaults). */
ds41_backend *ds41_guard_backend_new(const ds41_cpu_opts *opts, ds41_error *err);

/* What a guard backend saw: calls that opened its memory (ops and memory
 * calls) and the bytes it holds now and at most. */
typedef struct ds41_guard_stats {
    uint64_t op_calls;
    uint64_t mem_calls;
    uint64_t bytes_now;
    uint64_t bytes_peak;
} ds41_guard_stats;
void ds41_guard_backend_stats(const ds41_backend *be, ds41_guard_stats *out);

/* p lies in the memory of some live guard backend (for the fault handler's
 * message). */
bool ds41_guard_owns(const void *p);

/* Install a SIGSEGV handler that names a fault inside guard memory ("the host
 * touched backend memory at ...") with a backtrace, then aborts.  Not under
 * AddressSanitizer, whose own handler reports the stack. */
void ds41_guard_install_fault_handler(void);

#endif
