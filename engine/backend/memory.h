/* ds41_memory: the memory a backend computes on, and the only ways the host
 * moves bytes in and out of it.
 *
 * The engine never dereferences backend memory: activations and scratch of
 * the forward pass (engine/backend/scratch.h), the KV page pool, the window
 * rings and compressor carries (engine/model/kv_cache.h), routed-expert slots
 * (storage/expert_cache.h) and the per-step Engram rows all live in it.  The
 * host fills it by upload, reads it back by download (logits, decisions,
 * snapshots, the stream dump) and moves bytes inside it by copy; everything
 * else is done by the backend's ops (engine/backend/ops.h).  The host's own
 * memory keeps only metadata: positions, page tables, which sequence a row
 * belongs to, token and Engram row ids.
 *
 * Backends here:
 *  - ds41_memory_host: malloc and memcpy (the reference and fast CPU
 *    backends compute on host memory; their pointers are host pointers);
 *  - the guard backend of the tests (tests/guard_backend.h): host memory that
 *    is mprotect()ed inaccessible except inside its own ops and these calls,
 *    so that any host access the seam forgot faults (meson test
 *    device_guard);
 *  - later a device backend: device memory, cudaMemcpy*.
 *
 * Calls come from the engine's thread and, for the KV pool (a sequence
 * freed, forked or snapshotted by the scheduler or the daemon), from other
 * threads too: a backend makes them safe to call concurrently (the guard
 * counts the calls inside under a lock).  None fails except alloc (NULL:
 * out of memory). */
#ifndef DS41_ENGINE_MEMORY_H
#define DS41_ENGINE_MEMORY_H

#include "storage/host_alloc.h"

#include <stddef.h>

typedef struct ds41_memory ds41_memory;

struct ds41_memory {
    const char *name;
    void *ctx; /* the backend's state */
    /* n bytes (n >= 1) of backend memory, 64-byte aligned, every byte 0;
     * NULL when out of memory. */
    void *(*alloc)(const ds41_memory *m, size_t n);
    /* Give back p (from alloc with the same n); NULL is fine. */
    void (*free)(const ds41_memory *m, void *p, size_t n);
    /* dst (backend) <- src (host), n bytes. */
    void (*upload)(const ds41_memory *m, void *dst, const void *src, size_t n);
    /* dst (host) <- src (backend), n bytes. */
    void (*download)(const ds41_memory *m, void *dst, const void *src, size_t n);
    /* dst <- src, both backend memory, n bytes; the ranges may not overlap. */
    void (*copy)(const ds41_memory *m, void *dst, const void *src, size_t n);
    /* rows x width bytes: row r from src + r*src_pitch to dst + r*dst_pitch,
     * both backend memory (cudaMemcpy2D's shape: the column slices of the
     * grouped output projection, a row into a strided buffer). */
    void (*copy_2d)(const ds41_memory *m, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                    size_t width, size_t rows);
    /* Optional (NULL: none): n bytes of HOST memory, 4096-byte aligned,
     * that upload copies from fastest (a device backend's page-locked
     * memory); NULL when out of memory.  The storage tiers' host slots and
     * rows come from it (storage/host_alloc.h).  host_free gets the same n. */
    void *(*host_alloc)(const ds41_memory *m, size_t n);
    void (*host_free)(const ds41_memory *m, void *p, size_t n);
};

/* Host memory: aligned_alloc + memset, memcpy. */
extern const ds41_memory ds41_memory_host;

/* The storage tiers' host allocator over m's host_alloc / host_free (zero:
 * m is NULL or has none, so the tiers use anonymous memory). */
ds41_host_alloc ds41_memory_host_alloc(const ds41_memory *m);

#endif
