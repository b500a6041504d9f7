/* Inputs of the index_scores op for tests (test_ops_ref, test_ops_fast): M rows of index queries
 * (bf16 values, FP4 1x32 QDQ'd per row as the indexer does) and head weights, and a page table over
 * a contiguous array of packed entries. */
#ifndef DS41_TESTS_INDEX_PAGES_H
#define DS41_TESTS_INDEX_PAGES_H

#include "engine/backend/ops.h"
#include "engine/model/quant.h"

#include <stddef.h>
#include <stdint.h>

/* q [M][nh][dim] and w [M][nh] from rnd() in [-1, 1) (w scaled by 1/64). */
static inline void index_test_queries(float *q, float *w, size_t M, int nh, int dim, double (*rnd)(void)) {
    const size_t qw = (size_t)nh * (size_t)dim;
    for (size_t i = 0; i < M * qw; i++) q[i] = ds41_bf16_round((float)rnd());
    for (size_t m = 0; m < M; m++) ds41_fp4_act_quant_ue8m0_qdq(q + m * qw, qw);
    for (size_t i = 0; i < M * (size_t)nh; i++) w[i] = ds41_bf16_round((float)(rnd() / 64.0));
}

/* pages[0..ceil(n/per)) over entries[n] (entry_bytes each, contiguous), per entries a page. */
static inline void index_test_pages(ds41_kv_layout *lay, const uint8_t *entries, size_t n, uint32_t per,
                                    const uint8_t **pages) {
    lay->entries_per_page = per;
    for (size_t p = 0; p * per < n; p++) pages[p] = entries + p * (size_t)per * lay->entry_bytes;
}

#endif
