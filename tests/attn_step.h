/* A two-sequence step for the attend op in tests (test_ops_ref, test_ops_fast): 8-row window
 * rings and this step's own rows taken from one contiguous array of packed window rows, compressed
 * entries through pages, and for each row the per-query list sparse_attn takes, built by hand
 * (the canonical order), so attend can be compared with sparse_attn row by row. */
#ifndef DS41_TESTS_ATTN_STEP_H
#define DS41_TESTS_ATTN_STEP_H

#include "engine/backend/ops.h"

#include <stddef.h>
#include <stdint.h>

enum { ATTN_STEP_M = 5, ATTN_STEP_W = 8, ATTN_STEP_K = 4, ATTN_STEP_PER = 16 };

typedef struct attn_step_case {
    ds41_kv_layout lay; /* the caller's, with pages of ATTN_STEP_PER entries */
    const uint8_t *rings[2];
    size_t row_item[ATTN_STEP_M], item_row0[2], row_table[ATTN_STEP_M];
    uint64_t row_pos[ATTN_STEP_M], item_pos0[2];
    int32_t sel[ATTN_STEP_M * ATTN_STEP_K];
    uint32_t count[ATTN_STEP_M];
    const uint8_t *pages[16];
    ds41_attn_step step;
    /* per row: the lists by hand */
    const uint8_t *wrows[ATTN_STEP_M][ATTN_STEP_W], *crows[ATTN_STEP_M][ATTN_STEP_K];
    ds41_attn_rows rows[ATTN_STEP_M];
} attn_step_case;

/* wrow: >= 21 packed window rows (ring_row_bytes apart); ent: n_ent (<= 256) packed entries.
 * Sequence 0 is at positions 13..15 (its ring holds rows 0-7, the step's rows 8-10), sequence 1 at
 * 0..1 (the step's rows 11-12). */
static inline void attn_step_case_init(attn_step_case *t, const ds41_kv_layout *layout, const uint8_t *wrow,
                                       const uint8_t *ent, size_t n_ent) {
    static const size_t row_item[ATTN_STEP_M] = {0, 0, 0, 1, 1};
    static const uint64_t row_pos[ATTN_STEP_M] = {13, 14, 15, 0, 1};
    static const int32_t sel[ATTN_STEP_M][ATTN_STEP_K] = {{0, 5, 17, 40}, {2}, {0}, {1, 3}, {89}};
    static const uint32_t count[ATTN_STEP_M] = {4, 1, 0, 2, 1};
    *t = (attn_step_case){.lay = *layout, .item_row0 = {0, 3}, .item_pos0 = {13, 0}};
    ds41_kv_layout *lay = &t->lay;
    const size_t rb = lay->ring_row_bytes;
    t->rings[0] = wrow;
    t->rings[1] = wrow + 20 * rb; /* never read: sequence 1 has no earlier positions */
    lay->entries_per_page = ATTN_STEP_PER;
    for (size_t p = 0; p * ATTN_STEP_PER < n_ent && p < 16; p++) t->pages[p] = ent + p * ATTN_STEP_PER * lay->entry_bytes;
    for (size_t m = 0; m < ATTN_STEP_M; m++) {
        t->row_item[m] = row_item[m];
        t->row_pos[m] = row_pos[m];
        t->count[m] = count[m];
        for (int j = 0; j < ATTN_STEP_K; j++) t->sel[m * ATTN_STEP_K + (size_t)j] = sel[m][j];
        const size_t it = row_item[m];
        const uint64_t a = row_pos[m], first = a + 1 > ATTN_STEP_W ? a + 1 - ATTN_STEP_W : 0;
        ds41_attn_rows *r = &t->rows[m];
        *r = (ds41_attn_rows){.layout = lay, .window = t->wrows[m], .comp = t->crows[m]};
        for (uint64_t pos = first; pos <= a; pos++)
            t->wrows[m][r->n_window++] = pos >= t->item_pos0[it]
                                             ? wrow + (8 + t->item_row0[it] + (size_t)(pos - t->item_pos0[it])) * rb
                                             : wrow + (size_t)(pos % ATTN_STEP_W) * rb;
        for (uint32_t j = 0; j < count[m]; j++) t->crows[m][r->n_comp++] = ent + (size_t)sel[m][j] * lay->entry_bytes;
    }
    t->step = (ds41_attn_step){.layout = lay,
                               .window = ATTN_STEP_W,
                               .chunk = wrow + 8 * rb,
                               .rings = t->rings,
                               .row_item = t->row_item,
                               .row_pos = t->row_pos,
                               .item_row0 = t->item_row0,
                               .item_pos0 = t->item_pos0,
                               .sel = t->sel,
                               .count = t->count,
                               .sel_stride = ATTN_STEP_K,
                               .comp = {.layout = lay, .pages = t->pages, .row_table = t->row_table}};
}

/* ops->attend over the step = ops->sparse_attn row by row, bit for bit (q, out: [M][H][hd]). */
static inline int attn_step_check(const ds41_ops *ops, const attn_step_case *t, const float *q, int H, int hd,
                                  const float *sink, float scale, float *out, float *want) {
    const size_t qo = (size_t)H * (size_t)hd;
    ops->attend(ops, q, ATTN_STEP_M, H, hd, sink, scale, &t->step, out);
    for (size_t m = 0; m < ATTN_STEP_M; m++) ops->sparse_attn(ops, q + m * qo, H, hd, sink, scale, &t->rows[m], want + m * qo);
    for (size_t i = 0; i < ATTN_STEP_M * qo; i++)
        if (!(out[i] == want[i] || (out[i] != out[i] && want[i] != want[i]))) return 0;
    return 1;
}

#endif
