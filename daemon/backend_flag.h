/* --backend KIND, shared by ds41-eval, ds41-bench and ds41-generate: which
 * backend the engine computes on (cuda/backend_select.h):
 *   auto      the CUDA backend when a usable GPU is present, else cpu (the default)
 *   cpu       the fast CPU backend (--threads, --cpu, --pin apply)
 *   cuda      the GPU; no usable one is an error saying why
 *   cuda-emu  test mode: the CUDA backend with its kernels emulated on the host
 * The reference arithmetic (--reference where a tool has it) wins over it. */
#ifndef DS41_DAEMON_BACKEND_FLAG_H
#define DS41_DAEMON_BACKEND_FLAG_H

#include "engine/forward/forward.h"

#include <getopt.h>

#define DS41_BACKEND_OPT 0x1010
#define DS41_BACKEND_LONGOPT                                                                                 \
    { "backend", required_argument, NULL, DS41_BACKEND_OPT }

/* The line each tool's --help prints for the option. */
#define DS41_BACKEND_HELP                                                                                    \
    "  --backend KIND     auto (the GPU when one is usable, else cpu; the default), cpu, cuda (an\n"         \
    "                     error without a usable GPU) or cuda-emu (test mode: the CUDA kernels\n"            \
    "                     emulated on the host)\n"

/* Checks KIND for --backend; on a bad one prints "TOOL: --backend: ..." to
 * stderr and returns -1 (the tool exits 2). */
int ds41_backend_flag_parse(const char *tool, const char *arg);

/* Opens the backend KIND names (NULL: auto) into eo->backend, with eo->cpu,
 * unless eo->reference.  An explicit KIND's choice (auto: what it took and
 * why) is reported on stderr.  -1 with the message printed on failure. */
int ds41_backend_flag_apply(const char *tool, const char *kind, ds41_engine_opts *eo);

#endif
