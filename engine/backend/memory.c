/* ds41_memory_host (engine/backend/memory.h). */
#include "engine/backend/memory.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void *host_alloc(const ds41_memory *m, size_t n) {
    (void)m;
    if (n == 0 || n > SIZE_MAX - 63) return NULL;
    const size_t rounded = (n + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded);
    if (p) memset(p, 0, rounded);
    return p;
}

static void host_free(const ds41_memory *m, void *p, size_t n) {
    (void)m, (void)n;
    free(p);
}

static void host_move(const ds41_memory *m, void *dst, const void *src, size_t n) {
    (void)m;
    if (n) memcpy(dst, src, n);
}

static void host_copy_2d(const ds41_memory *m, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                         size_t width, size_t rows) {
    (void)m;
    for (size_t r = 0; r < rows && width; r++)
        memcpy((unsigned char *)dst + r * dst_pitch, (const unsigned char *)src + r * src_pitch, width);
}

const ds41_memory ds41_memory_host = {
    .name = "host",
    .alloc = host_alloc,
    .free = host_free,
    .upload = host_move,
    .download = host_move,
    .copy = host_move,
    .copy_2d = host_copy_2d,
};

static void *pinned_alloc(void *ctx, size_t n) {
    const ds41_memory *m = ctx;
    return m->host_alloc(m, n);
}

static void pinned_free(void *ctx, void *p, size_t n) {
    const ds41_memory *m = ctx;
    if (m->host_free) m->host_free(m, p, n);
}

ds41_host_alloc ds41_memory_host_alloc(const ds41_memory *m) {
    if (!m || !m->host_alloc) return (ds41_host_alloc){0};
    return (ds41_host_alloc){.ctx = (void *)m, .alloc = pinned_alloc, .free = pinned_free};
}
