/* A tiny host ds41_cuda_ctx (cuda/cuda_ctx.h) for testing the CUDA
 * backend's emulated ops on their own, before (or without) the backend and
 * its fake device: weights are their host pointers (identity weight()),
 * meta() hands out a fresh copy of the host array (so an op that read the
 * caller's array instead of the copy is still correct, but one that writes
 * into it is visible to ASan as a separate block), scratch() hands out fresh
 * 256-byte-aligned blocks; gpu is NULL (nothing queued: emu ops run at once).
 * Everything is freed by test_cuda_ctx_reset / test_cuda_ctx_free. */
#ifndef DS41_TESTS_CUDA_TEST_CTX_H
#define DS41_TESTS_CUDA_TEST_CTX_H

#include "cuda/cuda_ctx.h"

#include <stdlib.h>
#include <string.h>

typedef struct test_cuda_ctx {
    ds41_cuda_ctx c; /* first: &t->c is the ctx the ops get */
    void **blocks;
    size_t n_blocks, cap_blocks;
} test_cuda_ctx;

static void *test_cuda_ctx_block(ds41_cuda_ctx *c, size_t n) {
    test_cuda_ctx *t = (test_cuda_ctx *)c;
    if (t->n_blocks == t->cap_blocks) {
        t->cap_blocks = t->cap_blocks ? 2 * t->cap_blocks : 16;
        t->blocks = realloc(t->blocks, t->cap_blocks * sizeof *t->blocks);
        if (!t->blocks) abort();
    }
    void *p = aligned_alloc(256, (n + 255) & ~(size_t)255);
    if (!p) abort();
    t->blocks[t->n_blocks++] = p;
    return p;
}

static const void *test_cuda_ctx_weight(ds41_cuda_ctx *c, const void *p, size_t n) {
    (void)c;
    (void)n;
    return p;
}

static void *test_cuda_ctx_meta(ds41_cuda_ctx *c, const void *host, size_t n) {
    void *p = test_cuda_ctx_block(c, n);
    memcpy(p, host, n);
    return p;
}

static void *test_cuda_ctx_scratch(ds41_cuda_ctx *c, size_t n) {
    void *p = test_cuda_ctx_block(c, n);
    memset(p, 0xA5, n); /* "zeroed not promised": garbage an op must not read */
    return p;
}

__attribute__((unused)) static void test_cuda_ctx_init(test_cuda_ctx *t) {
    memset(t, 0, sizeof *t);
    t->c.emulated = true;
    t->c.weight = test_cuda_ctx_weight;
    t->c.meta = test_cuda_ctx_meta;
    t->c.scratch = test_cuda_ctx_scratch;
}

/* Free what the ops took so far (between ops). */
__attribute__((unused)) static void test_cuda_ctx_reset(test_cuda_ctx *t) {
    for (size_t i = 0; i < t->n_blocks; i++) free(t->blocks[i]);
    t->n_blocks = 0;
}

__attribute__((unused)) static void test_cuda_ctx_free(test_cuda_ctx *t) {
    test_cuda_ctx_reset(t);
    free(t->blocks);
    t->blocks = NULL;
    t->cap_blocks = 0;
}

#endif
