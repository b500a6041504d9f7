/* ds41_host_alloc: where the storage tiers get the host memory their reads
 * land in (the expert cache's host slots, the Engram row cache's entries).
 *
 * A device backend hands these buffers to its host-to-device copies; when
 * they are page-locked (cudaHostAlloc) the copies run at full bus speed
 * and asynchronously, from pageable memory they do not.  So the tiers take
 * their host memory from a callback the engine fills from the backend's
 * memory (engine/backend/memory.h: host_alloc / host_free), and fall back
 * to ordinary anonymous memory when there is none (the CPU backends).
 *
 * alloc returns n bytes aligned to DS41_HOST_ALLOC_ALIGN (O_DIRECT reads
 * land straight in them), or NULL when out of memory; the bytes need not be
 * zero.  free gets the same n back.  Both are called from the thread that
 * makes, resizes or frees the cache. */
#ifndef DS41_STORAGE_HOST_ALLOC_H
#define DS41_STORAGE_HOST_ALLOC_H

#include <stddef.h>

#define DS41_HOST_ALLOC_ALIGN 4096u

typedef struct ds41_host_alloc {
    void *ctx;
    void *(*alloc)(void *ctx, size_t n); /* NULL: aligned_alloc */
    void (*free)(void *ctx, void *p, size_t n);
} ds41_host_alloc;

/* n bytes (n >= 1) from a (NULL or a->alloc NULL: aligned_alloc, the size
 * rounded up to the alignment); NULL when out of memory. */
void *ds41_host_alloc_get(const ds41_host_alloc *a, size_t n);
/* Give back p from ds41_host_alloc_get(a, n); NULL is fine. */
void ds41_host_alloc_put(const ds41_host_alloc *a, void *p, size_t n);

#endif
