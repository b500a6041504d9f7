/* --backend KIND for the offline tools (daemon/backend_flag.h). */
#include "daemon/backend_flag.h"

#include "cuda/backend_select.h"

#include <stdio.h>

int ds41_backend_flag_parse(const char *tool, const char *arg) {
    int k = ds41_backend_kind_parse(arg);
    if (k < 0 || k == DS41_BACKEND_REFERENCE) {
        fprintf(stderr, "%s: --backend: expected auto, cpu, cuda or cuda-emu, got '%s'\n", tool, arg);
        return -1;
    }
    return 0;
}

int ds41_backend_flag_apply(const char *tool, const char *kind, ds41_engine_opts *eo) {
    if (eo->reference) return 0;
    ds41_error err = {{0}};
    char why[256];
    eo->backend = ds41_backend_open_why(kind, &eo->cpu, 0, why, sizeof why, &err);
    if (!eo->backend) {
        fprintf(stderr, "%s: %s\n", tool, err.msg);
        return -1;
    }
    if (kind) fprintf(stderr, "%s: %s\n", tool, why);
    return 0;
}
