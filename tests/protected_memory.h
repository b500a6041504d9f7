/* A ds41_memory for tests whose bytes the host cannot touch: every
 * allocation is its own mmap'd, page-rounded region, kept PROT_NONE except
 * while one of the memory's own calls runs (all regions are opened for the
 * call, then closed again).  Code that reaches backend memory only through
 * the memory's calls works unchanged; a plain load, store or memcpy the seam
 * forgot faults on the spot.  It also counts its calls and keeps the live
 * regions, so a test can check that a module's bytes really live in it.
 *
 * Single-threaded, for tests only: every call costs two mprotect() per live
 * region. */
#ifndef DS41_TESTS_PROTECTED_MEMORY_H
#define DS41_TESTS_PROTECTED_MEMORY_H

#include "engine/backend/memory.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pmem_region {
    unsigned char *base;
    size_t n;      /* bytes asked for */
    size_t mapped; /* page-rounded */
} pmem_region;

typedef struct protected_memory {
    ds41_memory mem; /* hand &pm->mem to the code under test; mem.ctx = pm */
    pmem_region *regions;
    size_t n_regions, cap_regions;
    uint64_t allocs, frees, uploads, downloads, copies, copies_2d;
    uint64_t upload_bytes;
    uint64_t bytes_now;
    bool bad_free;    /* a free of a pointer or size it did not hand out */
    uint64_t foreign; /* upload / download / copy calls whose backend side it did not hand out */
    bool full;        /* set by a test: alloc fails (out of device memory) */
} protected_memory;

void protected_memory_init(protected_memory *pm);
/* Unmaps what is still allocated (a leak the test reports through n_regions first). */
void protected_memory_fini(protected_memory *pm);
/* [p, p + n) lies inside one live allocation. */
bool protected_memory_owns(const protected_memory *pm, const void *p, size_t n);

#endif
