/* ds41_scratch: a stack of scratch memory that is grown while an engine warms
 * up and then reused, so that a forward step allocates nothing (issue 14;
 * tests/test_forward_alloc.c).  The forward pass and the reference ops take
 * their temporary buffers from one; each function marks the stack on entry
 * and releases back to its mark on exit, in LIFO order.
 *
 * Memory comes in blocks; a request that fits no block adds one at least as
 * large as all before it.  When the stack is released to empty (the end of
 * a step) and holds more than one block, the blocks are replaced by one as
 * large as the deepest the stack has been: the step that grew the stack
 * pays for the allocation, the next step of the same shape finds everything
 * in place.
 *
 * Every buffer is 64-byte aligned; its contents are undefined (as malloc's).
 * The blocks are the memory of `mem` (engine/backend/memory.h): the host
 * reaches a backend's scratch only through that memory's calls and ops.
 * Not thread-safe: one per engine thread (the reference backend has its
 * own; the fast backend's threads use per-thread buffers of their own). */
#ifndef DS41_ENGINE_SCRATCH_H
#define DS41_ENGINE_SCRATCH_H

#include "engine/backend/memory.h"

#include <stddef.h>

#define DS41_SCRATCH_BLOCKS 32

typedef struct ds41_scratch_block {
    unsigned char *p;
    size_t cap, used;
} ds41_scratch_block;

typedef struct ds41_scratch {
    /* Where blocks come from: a backend's memory (the forward pass's
     * activations), NULL: host memory.  Set before the first get. */
    const ds41_memory *mem;
    ds41_scratch_block blocks[DS41_SCRATCH_BLOCKS];
    int n;        /* blocks allocated */
    int cur;      /* the block requests are cut from; blocks after it are unused */
    size_t depth; /* bytes handed out and not released */
    size_t peak;  /* the largest depth so far */
} ds41_scratch;   /* zero-initialised = empty */

/* A position of the stack to release back to. */
typedef struct ds41_scratch_mark {
    int block;
    size_t used, depth;
} ds41_scratch_mark;

/* bytes of scratch (0 is fine), or NULL when out of memory. */
void *ds41_scratch_get(ds41_scratch *s, size_t bytes);

ds41_scratch_mark ds41_scratch_mark_now(const ds41_scratch *s);

/* Give back everything got since m; releasing to empty consolidates (above). */
void ds41_scratch_release(ds41_scratch *s, ds41_scratch_mark m);

/* Bytes held (the sum of the blocks' sizes). */
size_t ds41_scratch_bytes(const ds41_scratch *s);

void ds41_scratch_free(ds41_scratch *s);

#endif
