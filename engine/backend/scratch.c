/* The scratch stack of engine/backend/scratch.h. */
#include "engine/backend/scratch.h"

#include <stdint.h>
#include <stdlib.h>

#define ALIGN 64
#define MIN_BLOCK ((size_t)64 << 10)

static size_t round_up(size_t bytes) {
    return bytes > SIZE_MAX - (ALIGN - 1) ? 0 : (bytes + ALIGN - 1) & ~(size_t)(ALIGN - 1);
}

/* Append a block of at least `need` bytes, at least as large as all the
 * others together (so a stack that keeps growing adds few blocks). */
static int add_block(ds41_scratch *s, size_t need) {
    if (s->n == DS41_SCRATCH_BLOCKS) return -1;
    size_t cap = ds41_scratch_bytes(s);
    if (cap < need) cap = need;
    if (cap < MIN_BLOCK) cap = MIN_BLOCK;
    unsigned char *p = s->mem ? s->mem->alloc(s->mem, cap) : aligned_alloc(ALIGN, cap);
    if (!p) return -1;
    s->blocks[s->n] = (ds41_scratch_block){.p = p, .cap = cap, .used = 0};
    s->cur = s->n++;
    return 0;
}

/* The bytes handed out, as one block would hold them (without the ends of
 * blocks that a request skipped). */
static void grew(ds41_scratch *s, size_t need) {
    s->depth += need;
    if (s->depth > s->peak) s->peak = s->depth;
}

void *ds41_scratch_get(ds41_scratch *s, size_t bytes) {
    const size_t need = round_up(bytes ? bytes : 1);
    if (need == 0) return NULL;
    while (s->cur < s->n) {
        ds41_scratch_block *b = &s->blocks[s->cur];
        if (b->cap - b->used >= need) {
            void *p = b->p + b->used;
            b->used += need;
            grew(s, need);
            return p;
        }
        if (s->cur + 1 == s->n) break;
        s->cur++;
    }
    if (add_block(s, need) != 0) return NULL;
    s->blocks[s->cur].used = need;
    grew(s, need);
    return s->blocks[s->cur].p;
}

ds41_scratch_mark ds41_scratch_mark_now(const ds41_scratch *s) {
    if (s->n == 0) return (ds41_scratch_mark){0, 0, 0};
    return (ds41_scratch_mark){s->cur, s->blocks[s->cur].used, s->depth};
}

/* One block as deep as the stack has been instead of several (contents are
 * dropped: only called when the stack is empty). */
static void free_blocks(ds41_scratch *s) {
    for (int i = 0; i < s->n; i++) {
        if (s->mem)
            s->mem->free(s->mem, s->blocks[i].p, s->blocks[i].cap);
        else
            free(s->blocks[i].p);
    }
}

static void consolidate(ds41_scratch *s) {
    free_blocks(s);
    s->n = s->cur = 0;
    (void)add_block(s, s->peak); /* out of memory: the next get tries again */
}

void ds41_scratch_release(ds41_scratch *s, ds41_scratch_mark m) {
    if (s->n == 0) return;
    for (int i = m.block + 1; i < s->n; i++) s->blocks[i].used = 0;
    s->cur = m.block;
    s->blocks[m.block].used = m.used;
    s->depth = m.depth;
    if (m.block == 0 && m.used == 0 && s->n > 1) consolidate(s);
}

size_t ds41_scratch_bytes(const ds41_scratch *s) {
    size_t t = 0;
    for (int i = 0; i < s->n; i++) t += s->blocks[i].cap;
    return t;
}

void ds41_scratch_free(ds41_scratch *s) {
    free_blocks(s);
    s->n = s->cur = 0;
    s->depth = s->peak = 0;
}
