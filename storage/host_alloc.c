/* ds41_host_alloc (storage/host_alloc.h). */
#include "storage/host_alloc.h"

#include <stdint.h>
#include <stdlib.h>

void *ds41_host_alloc_get(const ds41_host_alloc *a, size_t n) {
    if (n == 0 || n > SIZE_MAX - DS41_HOST_ALLOC_ALIGN) return NULL;
    if (a && a->alloc) return a->alloc(a->ctx, n);
    return aligned_alloc(DS41_HOST_ALLOC_ALIGN,
                         (n + DS41_HOST_ALLOC_ALIGN - 1) / DS41_HOST_ALLOC_ALIGN * DS41_HOST_ALLOC_ALIGN);
}

void ds41_host_alloc_put(const ds41_host_alloc *a, void *p, size_t n) {
    if (!p) return;
    if (a && a->alloc) {
        if (a->free) a->free(a->ctx, p, n);
        return;
    }
    free(p);
}
