/* tests/protected_memory.h. */
#include "tests/protected_memory.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void protect_all(const protected_memory *pm, int prot) {
    for (size_t i = 0; i < pm->n_regions; i++)
        if (mprotect(pm->regions[i].base, pm->regions[i].mapped, prot) != 0) abort();
}

static protected_memory *ctx(const ds41_memory *m) {
    return m->ctx;
}

static void *pm_alloc(const ds41_memory *m, size_t n) {
    protected_memory *pm = ctx(m);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (n == 0 || n > SIZE_MAX - page || pm->full) return NULL;
    if (pm->n_regions == pm->cap_regions) {
        size_t cap = pm->cap_regions ? 2 * pm->cap_regions : 64;
        pmem_region *r = realloc(pm->regions, cap * sizeof *r);
        if (!r) return NULL;
        pm->regions = r;
        pm->cap_regions = cap;
    }
    const size_t mapped = (n + page - 1) / page * page;
    /* Anonymous pages are zero, as alloc promises; page-aligned is 64-aligned. */
    void *p = mmap(NULL, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    pm->regions[pm->n_regions++] = (pmem_region){p, n, mapped};
    pm->allocs++;
    pm->bytes_now += n;
    return p;
}

static void pm_free(const ds41_memory *m, void *p, size_t n) {
    protected_memory *pm = ctx(m);
    if (!p) return;
    for (size_t i = 0; i < pm->n_regions; i++) {
        if (pm->regions[i].base != p) continue;
        if (pm->regions[i].n != n) pm->bad_free = true;
        munmap(p, pm->regions[i].mapped);
        pm->bytes_now -= pm->regions[i].n;
        pm->regions[i] = pm->regions[--pm->n_regions];
        pm->frees++;
        return;
    }
    pm->bad_free = true;
}

/* One byte movement with every region open; a range outside the live
 * regions (other than the host side of upload/download) faults as it would
 * in any other code. */
static void pm_move(const ds41_memory *m, uint64_t *counter, void *dst, const void *src, size_t n) {
    protected_memory *pm = ctx(m);
    (*counter)++;
    protect_all(pm, PROT_READ | PROT_WRITE);
    if (n) memcpy(dst, src, n);
    protect_all(pm, PROT_NONE);
}

/* Count a call whose backend range [p, p + n) is not memory it handed out. */
static void check_owned(protected_memory *pm, const void *p, size_t n) {
    if (!protected_memory_owns(pm, p, n)) pm->foreign++;
}

static void pm_upload(const ds41_memory *m, void *dst, const void *src, size_t n) {
    check_owned(ctx(m), dst, n);
    ctx(m)->upload_bytes += n;
    pm_move(m, &ctx(m)->uploads, dst, src, n);
}

static void pm_download(const ds41_memory *m, void *dst, const void *src, size_t n) {
    check_owned(ctx(m), src, n);
    pm_move(m, &ctx(m)->downloads, dst, src, n);
}

static void pm_copy(const ds41_memory *m, void *dst, const void *src, size_t n) {
    check_owned(ctx(m), dst, n);
    check_owned(ctx(m), src, n);
    pm_move(m, &ctx(m)->copies, dst, src, n);
}

static void pm_copy_2d(const ds41_memory *m, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                       size_t width, size_t rows) {
    protected_memory *pm = ctx(m);
    pm->copies_2d++;
    protect_all(pm, PROT_READ | PROT_WRITE);
    for (size_t r = 0; r < rows && width; r++)
        memcpy((unsigned char *)dst + r * dst_pitch, (const unsigned char *)src + r * src_pitch, width);
    protect_all(pm, PROT_NONE);
}

void protected_memory_init(protected_memory *pm) {
    memset(pm, 0, sizeof *pm);
    pm->mem = (ds41_memory){.name = "protected",
                            .ctx = pm,
                            .alloc = pm_alloc,
                            .free = pm_free,
                            .upload = pm_upload,
                            .download = pm_download,
                            .copy = pm_copy,
                            .copy_2d = pm_copy_2d};
}

void protected_memory_fini(protected_memory *pm) {
    for (size_t i = 0; i < pm->n_regions; i++) munmap(pm->regions[i].base, pm->regions[i].mapped);
    free(pm->regions);
    memset(pm, 0, sizeof *pm);
}

bool protected_memory_owns(const protected_memory *pm, const void *p, size_t n) {
    const uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < pm->n_regions; i++) {
        const uintptr_t base = (uintptr_t)pm->regions[i].base;
        if (a >= base && n <= pm->regions[i].n && a - base <= pm->regions[i].n - n) return true;
    }
    return false;
}
