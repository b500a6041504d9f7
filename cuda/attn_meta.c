/* Host preparation of the attention family's ops (cuda/op_attn.h): the
 * metadata arrays a launch reads, shipped with ds41_cuda_meta, for both the
 * kernels and their emulation (so the emulation reads the same device copies
 * the kernels would). */
#include "cuda/op_attn.h"

size_t ds41_cuda_attn_n_pages(const ds41_kv_pages *k, size_t M) {
    if (k->n_pages) return k->n_pages;
    size_t n = 0;
    const size_t per = k->layout->entries_per_page;
    for (size_t m = 0; k->row_reach && m < M; m++)
        if (k->row_reach[m]) {
            const size_t end = k->row_table[m] + (k->row_reach[m] + per - 1) / per;
            if (end > n) n = end;
        }
    return n;
}

void ds41_cuda_attn_src_step(ds41_cuda_ctx *c, const ds41_attn_step *s, size_t M, ds41_na_attn_src *out) {
    size_t n_items = 0;
    for (size_t m = 0; m < M; m++)
        if (s->row_item[m] + 1 > n_items) n_items = s->row_item[m] + 1;
    ds41_na_attn_src a = {0};
    a.window_size = s->window;
    a.block = s->block;
    a.chunk = s->chunk;
    a.rings = (const uint8_t *const *)ds41_cuda_meta(c, s->rings, n_items * sizeof *s->rings);
    a.row_item = (const size_t *)ds41_cuda_meta(c, s->row_item, M * sizeof *s->row_item);
    a.row_pos = (const uint64_t *)ds41_cuda_meta(c, s->row_pos, M * sizeof *s->row_pos);
    a.item_row0 = (const size_t *)ds41_cuda_meta(c, s->item_row0, n_items * sizeof *s->item_row0);
    a.item_pos0 = (const uint64_t *)ds41_cuda_meta(c, s->item_pos0, n_items * sizeof *s->item_pos0);
    a.sel = s->sel;
    a.count = s->count;
    a.sel_stride = s->sel_stride;
    if (s->sel) {
        a.pages = (const uint8_t *const *)ds41_cuda_meta(
            c, s->comp.pages, ds41_cuda_attn_n_pages(&s->comp, M) * sizeof *s->comp.pages);
        a.row_table = (const size_t *)ds41_cuda_meta(c, s->comp.row_table, M * sizeof *s->comp.row_table);
        a.per = s->comp.layout->entries_per_page;
        a.entry_bytes = s->comp.layout->entry_bytes;
    }
    a.ring_row_bytes = s->layout->ring_row_bytes;
    *out = a;
}

void ds41_cuda_attn_src_rows(ds41_cuda_ctx *c, const ds41_attn_rows *r, ds41_na_attn_src *out) {
    ds41_na_attn_src a = {0};
    a.lists = 1;
    a.n_window = r->n_window;
    a.n_comp = r->n_comp;
    a.window = (const uint8_t *const *)ds41_cuda_meta(c, r->window, r->n_window * sizeof *r->window);
    a.comp = (const uint8_t *const *)ds41_cuda_meta(c, r->comp, r->n_comp * sizeof *r->comp);
    *out = a;
}

const uint32_t *ds41_cuda_index_meta(ds41_cuda_ctx *c, const ds41_kv_pages *keys, size_t M, int n_heads,
                                     int dim, uint32_t *max_reach, const uint8_t *const **pages,
                                     const size_t **row_table) {
    uint32_t mr = 0;
    uint64_t pairs = 0;
    for (size_t m = 0; m < M; m++) {
        pairs += keys->row_reach[m];
        if (keys->row_reach[m] > mr) mr = keys->row_reach[m];
    }
    *max_reach = mr;
    c->stats.flops += 2 * pairs * (uint64_t)n_heads * (uint64_t)dim;
    *pages = (const uint8_t *const *)ds41_cuda_meta(c, keys->pages,
                                                    ds41_cuda_attn_n_pages(keys, M) * sizeof *keys->pages);
    *row_table = (const size_t *)ds41_cuda_meta(c, keys->row_table, M * sizeof *keys->row_table);
    return (const uint32_t *)ds41_cuda_meta(c, keys->row_reach, M * sizeof *keys->row_reach);
}

void ds41_cuda_attn_count(ds41_cuda_ctx *c, size_t H, size_t hd, size_t rows) {
    c->stats.weight_bytes += H * sizeof(float);
    c->stats.flops += 4 * (uint64_t)H * rows * hd;
}

void ds41_cuda_attend_count(ds41_cuda_ctx *c, const ds41_attn_step *s, size_t M, size_t H, size_t hd) {
    /* sel / count are on the device: the window rows and sel_stride bound the compressed ones */
    for (size_t m = 0; m < M; m++) {
        const uint64_t a = s->row_pos[m], p0 = s->item_pos0[s->row_item[m]], W = s->window;
        const uint64_t nw =
            s->block ? p0 - (p0 > W ? p0 - W : 0) + s->block : a + 1 - (a + 1 > W ? a + 1 - W : 0);
        ds41_cuda_attn_count(c, H, hd, (size_t)nw + (s->sel ? s->sel_stride : 0));
    }
}
