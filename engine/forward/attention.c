/* Attention sub-layer: q path, window KV, compressor, indexer, candidate
 * blocks, sparse attention over the canonical list, inverse rope, wo_a/wo_b
 * (REFERENCE.md §2.8-2.11, §9, §10.7). */
#include "engine/forward/forward_internal.h"

#include <string.h>

/* Buffers of the step (forward_internal.h): dev = backend memory
 * (activations, decisions), host = metadata and downloads. */
#define dev(bytes) ds41__dev(e, (bytes))
#define host(bytes) ds41__host(e, (bytes))

void ds41__rope_rows(ds41_engine *e, fwd_batch *b, int L) {
    if (b->rope_layer == L) return;
    const int rd = (int)e->cfg.rope_head_dim;
    const float *f = e->rope_freqs[L];
    if (b->rope_layer >= 0 && e->rope_freqs[b->rope_layer] &&
        memcmp(e->rope_freqs[b->rope_layer], f, (size_t)(rd / 2) * sizeof *f) == 0) {
        b->rope_layer = L; /* same frequencies: same table */
        return;
    }
    e->ops->rope_table(e->ops, e->rope_freqs_be[L], rd / 2, b->row_pos, b->M, b->rope_cs);
    b->rope_layer = L;
}

/* ---- compressor and index keys (kv source layers, §2.9, §2.10 step 1) ------------- */

/* The step's n completed latents lat[n][hd] (entry i of group pos[i] /
 * ratio, completed by row row[i], in row order): derive each index key from
 * the unrotated latent, rotate both at the group's first position, and
 * append them (packed FP4) to the sequences' entries.  Every entry of the
 * step goes through each op once. */
static int emit_entries(ds41_engine *e, fwd_batch *b, int L, int src, const float *lat, size_t n,
                        const size_t *row, const uint64_t *pos, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t hd = (size_t)c->head_dim, ihd = (size_t)c->index_head_dim;
    const int rd = (int)c->rope_head_dim;
    const int ratio = c->roles[L].ratio;
    if (n == 0) return 0;
    const fwd_frame f = ds41__frame(e);
    float *key_raw = dev(n * ihd * sizeof *key_raw);
    float *key = dev(n * ihd * sizeof *key);
    float *rot = dev(n * hd * sizeof *rot);
    float *cs = dev(n * (size_t)rd * sizeof *cs);
    const ds41_kv_layout *lay = ds41_kv_pool_layout(ds41_kv_seq_pool(b->items[0].seq));
    uint8_t *packed = dev(n * lay->entry_bytes);
    int rc = 0;
    if (!key_raw || !key || !rot || !cs || !packed) {
        ds41__frame_release(e, f);
        return ds41_fail(err, "forward: out of memory");
    }
    ops->linear(ops, &lw->idx_wk, lat, n, key_raw, DS41_OUT_BF16_EXACT);
    ops->rmsnorm(ops, lw->idx_k_norm, key_raw, n, ihd, e->norm_eps, key);
    ops->rope_table(ops, e->rope_freqs_be[L], rd / 2, pos, n, cs);
    ops->rope(ops, key + ihd - (size_t)rd, n, 1, ihd, ihd, rd / 2, cs, 0);
    e->mem->copy(e->mem, rot, lat, n * hd * sizeof *rot);
    ops->rope(ops, rot + hd - (size_t)rd, n, 1, hd, hd, rd / 2, cs, 0);
    ops->kv_pack(ops, lay, rot, key, n, packed);
    for (size_t i = 0; i < n && rc == 0; i++) {
        ds41_kv_seq *seq = b->items[b->row_item[row[i]]].seq;
        const uint64_t group = pos[i] / (uint64_t)ratio;
        if (ds41_kv_seq_entries(seq, src) != group)
            rc = ds41_fail(err, "forward: layer %d: compressed entry %llu out of order (have %llu)", L,
                           (unsigned long long)group, (unsigned long long)ds41_kv_seq_entries(seq, src));
        else
            rc = ds41_kv_seq_append_packed(seq, src, packed + i * lay->entry_bytes, err);
    }
    ds41__frame_release(e, f);
    return rc;
}

/* Position a completes its group of ratio tokens (the group is pooled there). */
static int group_completes(uint64_t a, int ratio) {
    return (a + 1) % (uint64_t)ratio == 0;
}

static int compressor(ds41_engine *e, fwd_batch *b, int L, const float *xn, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t M = b->M, hd = (size_t)c->head_dim;
    const int ratio = c->roles[L].ratio;
    const ds41_kv_layout *lay = ds41_kv_pool_layout(ds41_kv_seq_pool(b->items[0].seq));
    const int src = lay->source_of_layer[L];
    const fwd_frame f = ds41__frame(e);
    int rc = 0;
    /* Entries completed by this step: at most one per row. */
    size_t *row = host(M * sizeof *row);
    uint64_t *pos = host(M * sizeof *pos);
    float *lat = dev(M * hd * sizeof *lat);
    if (!row || !pos || !lat) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }
    if (ratio == 1) {
        /* latent = norm(wkv(x)): bf16 linear, RMSNorm; one per token. */
        float *raw = dev(M * hd * sizeof *raw);
        if (!raw) {
            rc = ds41_fail(err, "forward: out of memory");
            goto out;
        }
        ops->linear(ops, &lw->cmp_wkv, xn, M, raw, DS41_OUT_BF16_EXACT);
        ops->rmsnorm(ops, lw->cmp_norm, raw, M, hd, e->norm_eps, lat);
        for (size_t r = 0; r < M; r++) {
            row[r] = r;
            pos[r] = b->row_pos[r];
        }
        rc = emit_entries(e, b, L, src, lat, M, row, pos, err);
        goto out;
    }
    /* ratio > 1: fp32 kv and gate scores, carried per slot (position mod
     * ratio); a completed group is pooled with a per-channel softmax over
     * its tokens (§2.9, §10.4 short sums, decision 12 of the numpy side).
     * A group completes at its last position: its carry is staged then, as
     * later rows of a long chunk reuse the slots. */
    size_t n = 0;
    for (size_t r = 0; r < M; r++)
        if (group_completes(b->row_pos[r], ratio)) n++;
    const size_t group = (size_t)ratio * hd;
    float *kv = dev(M * hd * sizeof *kv);
    float *sc = dev(M * hd * sizeof *sc);
    float *gkv = dev((n ? n : 1) * group * sizeof *gkv);
    float *gsc = dev((n ? n : 1) * group * sizeof *gsc);
    float *pooled = dev((n ? n : 1) * hd * sizeof *pooled);
    if (!kv || !sc || !gkv || !gsc || !pooled) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }
    ops->linear(ops, &lw->cmp_wkv, xn, M, kv, DS41_OUT_F32_EXACT);
    ops->linear(ops, &lw->cmp_wgate, xn, M, sc, DS41_OUT_F32_EXACT);
    n = 0;
    for (size_t r = 0; r < M; r++) {
        ds41_kv_seq *seq = b->items[b->row_item[r]].seq;
        float *ckv = ds41_kv_carry_kv(seq, src);
        float *csc = ds41_kv_carry_score(seq, src);
        const uint64_t a = b->row_pos[r];
        /* The carries are backend memory of the pool, written by the cache (journaled). */
        ds41_kv_carry_put(seq, src, a, kv + r * hd, sc + r * hd);
        if (!group_completes(a, ratio)) continue;
        e->mem->copy(e->mem, gkv + n * group, ckv, group * sizeof *gkv);
        e->mem->copy(e->mem, gsc + n * group, csc, group * sizeof *gsc);
        row[n] = r;
        pos[n] = a + 1 - (uint64_t)ratio;
        n++;
    }
    if (n) {
        ops->compress_pool(ops, gkv, gsc, n, ratio, hd, pooled);
        ops->rmsnorm(ops, lw->cmp_norm, pooled, n, hd, e->norm_eps, lat);
    }
    rc = emit_entries(e, b, L, src, lat, n, row, pos, err);
out:
    ds41__frame_release(e, f);
    return rc;
}

/* ---- indexer (§2.10, §2.11, §9.2, decision 8 of the numpy side) ------------------- */

/* The most compressed entries a row of the step reaches at ratio. */
static uint64_t step_max_reach(const fwd_batch *b, int ratio) {
    uint64_t max_reach = 0;
    for (size_t r = 0; r < b->M; r++) {
        const uint64_t reach = (b->row_pos[r] + 1) / (uint64_t)ratio;
        if (reach > max_reach) max_reach = reach;
    }
    return max_reach;
}

/* The page tables of source `src` for the step's rows: pages (the items'
 * tables concatenated, from the step's scratch) and row_table[M] (where
 * each row's table starts), as ds41_kv_pages describes them.  NULL on out
 * of memory. */
static const uint8_t **step_pages(ds41_engine *e, const fwd_batch *b, int src, size_t *row_table,
                                  size_t *n_pages) {
    const ds41_kv_pool *pool = ds41_kv_seq_pool(b->items[0].seq);
    size_t *item_table = host(b->n_items * sizeof *item_table);
    if (!item_table) return NULL;
    size_t n_ids = 0;
    for (size_t it = 0; it < b->n_items; it++) {
        uint32_t np;
        (void)ds41_kv_seq_page_ids(b->items[it].seq, src, &np);
        item_table[it] = n_ids;
        n_ids += np;
    }
    const uint8_t **pages = host((n_ids ? n_ids : 1) * sizeof *pages);
    if (!pages) return NULL;
    for (size_t it = 0; it < b->n_items; it++) {
        uint32_t np;
        const uint32_t *ids = ds41_kv_seq_page_ids(b->items[it].seq, src, &np);
        for (uint32_t i = 0; i < np; i++) pages[item_table[it] + i] = ds41_kv_pool_page(pool, ids[i]);
    }
    for (size_t r = 0; r < b->M; r++) row_table[r] = item_table[b->row_item[r]];
    *n_pages = n_ids;
    return pages;
}

/* Report the step's candidate blocks (kept block ids ascending, with the
 * block scores) and index selections to the batch's hook.  The decisions
 * themselves were made by the ops and stay in backend memory; this
 * downloads them (only when a hook wants them). */
static int report_indexer(ds41_engine *e, fwd_batch *b, int L, const ds41_layer_role *role, const uint32_t *reach,
                          const float *score, size_t stride, const float *bscore, size_t nb_stride, size_t B,
                          size_t topk, ds41_error *err) {
    if (!b->hooks || !b->hooks->decision) return 0;
    const size_t M = b->M;
    const ds41_memory *mem = e->mem;
    const fwd_frame f = ds41__frame(e);
    const int cs = role->candidate_source;
    int32_t *list = host(M * topk * sizeof *list);
    uint32_t *count = host(M * sizeof *count);
    float *hs = host(M * stride * sizeof *hs);
    uint8_t *allow = cs ? host(M * b->cand_stride) : NULL;
    float *hb = cs ? host(M * nb_stride * sizeof *hb) : NULL;
    int32_t *kept = cs ? host(nb_stride * sizeof *kept) : NULL;
    if (!list || !count || !hs || (cs && (!allow || !hb || !kept))) {
        ds41__frame_release(e, f);
        return ds41_fail(err, "forward: out of memory");
    }
    mem->download(mem, list, b->idx_list[L], M * topk * sizeof *list);
    mem->download(mem, count, b->idx_count[L], M * sizeof *count);
    mem->download(mem, hs, score, M * stride * sizeof *hs);
    if (cs) {
        mem->download(mem, allow, b->cand, M * b->cand_stride);
        mem->download(mem, hb, bscore, M * nb_stride * sizeof *hb);
    }
    for (size_t r = 0; r < M; r++) {
        if (reach[r] == 0) continue; /* nothing compressed is visible yet (§2.10 step 8) */
        if (cs) {
            const size_t nb = (reach[r] + B - 1) / B;
            size_t n_kept = 0;
            for (size_t blk = 0; blk < nb; blk++)
                if (allow[r * b->cand_stride + blk]) kept[n_kept++] = (int32_t)blk;
            ds41__report_decision(b, DS41_DECISION_CAND, L, r, kept, n_kept, hb + r * nb_stride, nb);
        }
        ds41__report_decision(b, DS41_DECISION_INDEX, L, r, list + r * topk, count[r], hs + r * stride, reach[r]);
    }
    ds41__frame_release(e, f);
    return 0;
}

static int indexer(ds41_engine *e, fwd_batch *b, int L, const float *xn, const float *qr, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_role *role = &c->roles[L];
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t M = b->M;
    const int nh = (int)c->index_n_heads, ihd = (int)c->index_head_dim, rd = (int)c->rope_head_dim;
    const size_t qw = (size_t)nh * (size_t)ihd;
    const int ratio = role->ratio;
    const size_t topk = (size_t)c->index_topk;
    const ds41_kv_layout *lay = ds41_kv_pool_layout(ds41_kv_seq_pool(b->items[0].seq));
    const int ks = lay->source_of_layer[role->index_keys_from];
    const size_t B = role->candidate_source || role->candidate_user ? (size_t)c->candidate_block_size : 1;

    const size_t max_reach = (size_t)step_max_reach(b, ratio);
    const size_t stride = max_reach ? max_reach : 1;
    const size_t nb_stride = (max_reach + B - 1) / B ? (max_reach + B - 1) / B : 1;
    int rc = 0;
    const fwd_frame f = ds41__frame(e);
    float *q = dev(M * qw * sizeof *q);
    float *w = dev(M * (size_t)nh * sizeof *w);
    float *score = dev(M * stride * sizeof *score);
    uint32_t *reach = host(M * sizeof *reach);
    size_t *row_table = host(M * sizeof *row_table);
    float *bscore = role->candidate_source ? dev(M * nb_stride * sizeof *bscore) : NULL;
    if (!q || !w || !score || !reach || !row_table || (role->candidate_source && !bscore)) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }

    /* Query side: q = wq_b(qr), rope at the query position, FP4 1x32 QDQ;
     * w = bf16(weights_proj(x) * scale). */
    ops->linear(ops, &lw->idx_wq_b, qr, M, q, DS41_OUT_BF16_EXACT);
    ops->linear(ops, &lw->idx_weights_proj, xn, M, w, DS41_OUT_BF16_EXACT);
    ops->rope(ops, q + (size_t)(ihd - rd), M, nh, qw, (size_t)ihd, rd / 2, b->rope_cs, 0);
    ops->index_query(ops, q, qw, w, (size_t)nh, M, e->index_scale);

    /* Metadata: each row's reach and its sequence's page table (the
     * entries the compressor appended this step included). */
    size_t n_pages = 0;
    const uint8_t **pages = step_pages(e, b, ks, row_table, &n_pages);
    if (!pages) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }
    for (size_t r = 0; r < M; r++) reach[r] = (uint32_t)((b->row_pos[r] + 1) / (uint64_t)ratio);
    const ds41_kv_pages keys = {
        .layout = lay, .pages = pages, .row_table = row_table, .row_reach = reach, .n_pages = n_pages};

    /* Scores, candidate blocks (the source), the mask (a user), top-k:
     * the decisions land in b->cand and b->idx_list/idx_count. */
    ops->index_scores(ops, q, w, M, nh, ihd, &keys, score, stride);
    if (role->candidate_source)
        ops->index_blocks(ops, score, stride, reach, M, B, (size_t)c->candidate_topk_blocks, bscore,
                          nb_stride, b->cand, b->cand_stride);
    ops->index_topk(ops, score, stride, reach, M, role->candidate_user ? b->cand : NULL, b->cand_stride, B,
                    topk, b->idx_list[L], b->idx_count[L]);
    rc = report_indexer(e, b, L, role, reach, score, stride, bscore, nb_stride, B, topk, err);
out:
    ds41__frame_release(e, f);
    return rc;
}

int ds41__attention_prepare(ds41_engine *e, fwd_batch *b, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const size_t M = b->M, topk = (size_t)c->index_topk;
    b->cand_stride = 1;
    for (size_t L = 0; L < (size_t)c->n_layers; L++) {
        const ds41_layer_role *role = &c->roles[L];
        if (role->ratio <= 0 || !role->index_source) continue; /* as ds41__attention runs it */
        b->idx_list[L] = dev(M * (topk ? topk : 1) * sizeof *b->idx_list[L]);
        b->idx_count[L] = dev(M * sizeof *b->idx_count[L]);
        if (!b->idx_list[L] || !b->idx_count[L]) return ds41_fail(err, "forward: out of memory");
        if (role->candidate_source) {
            /* One row of flags per row wide enough for every candidate
             * source's blocks (the rows' reach in blocks, as the indexer). */
            const uint64_t B = (uint64_t)c->candidate_block_size;
            const size_t nb = (size_t)((step_max_reach(b, role->ratio) + B - 1) / B);
            if (nb > b->cand_stride) b->cand_stride = nb;
        }
    }
    b->cand = dev(M * b->cand_stride);
    return b->cand ? 0 : ds41_fail(err, "forward: out of memory");
}

/* ---- the sub-layer ------------------------------------------------------------------------ */

void ds41__window_kv(ds41_engine *e, int L, const float *xn, size_t M, const float *cs, float *kvraw,
                     float *kv, uint8_t *rows, size_t row_bytes) {
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t hd = (size_t)e->cfg.head_dim;
    const int rd = (int)e->cfg.rope_head_dim;
    ops->linear(ops, &lw->wkv, xn, M, kvraw, DS41_OUT_BF16);
    ops->rmsnorm(ops, lw->kv_norm, kvraw, M, hd, e->norm_eps, kv);
    ops->rope(ops, kv + hd - (size_t)rd, M, 1, hd, hd, rd / 2, cs, 0);
    ops->act_quant_fp8(ops, kv, M, hd, rows, row_bytes);
}

int ds41__attention(ds41_engine *e, fwd_batch *b, int L, const float *xn, float *out, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_role *role = &c->roles[L];
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t M = b->M, H = (size_t)c->n_heads, hd = (size_t)c->head_dim;
    const size_t qlr = (size_t)c->q_lora_rank;
    const int rd = (int)c->rope_head_dim;
    const size_t W = (size_t)c->window_size;
    const size_t G = (size_t)c->o_groups, olr = (size_t)c->o_lora_rank, Kg = H * hd / G;
    const ds41_kv_layout *lay = ds41_kv_pool_layout(ds41_kv_seq_pool(b->items[0].seq));
    const size_t row_bytes = lay->ring_row_bytes;
    int rc = 0;

    ds41__rope_rows(e, b, L);
    const fwd_frame f = ds41__frame(e);
    float *qa = dev(M * qlr * sizeof *qa);
    float *qr = dev(M * qlr * sizeof *qr);
    float *q = dev(M * H * hd * sizeof *q);
    float *kvraw = dev(M * hd * sizeof *kvraw);
    float *kv = dev(M * hd * sizeof *kv);
    uint8_t *chunk_rows = dev(M * row_bytes);
    float *o = dev(M * H * hd * sizeof *o);
    float *xg = dev(M * Kg * sizeof *xg);
    float *yg = dev(M * olr * sizeof *yg);
    float *ya = dev(M * G * olr * sizeof *ya);
    const uint8_t **rings = host(b->n_items * sizeof *rings);
    size_t *row_table = host(M * sizeof *row_table);
    if (!qa || !qr || !q || !kvraw || !kv || !chunk_rows || !o || !xg || !yg || !ya || !rings || !row_table) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }

    /* q: low-rank path with q_norm, rope on each head's last rd features.
     * An index source's indexer reads qr too: there wq_a takes the
     * reference's accumulation (DS41_OUT_BF16_EXACT, engine/backend/ops.h). */
    ops->linear(ops, &lw->wq_a, xn, M, qa,
                role->ratio > 0 && role->index_source ? DS41_OUT_BF16_EXACT : DS41_OUT_BF16);
    ops->rmsnorm(ops, lw->q_norm, qa, M, qlr, e->norm_eps, qr);
    ops->linear(ops, &lw->wq_b, qr, M, q, DS41_OUT_BF16);
    ops->rope(ops, q + hd - (size_t)rd, M, (int)H, H * hd, hd, rd / 2, b->rope_cs, 0);

    /* Window KV (kept packed, in the ring's row format, for this chunk's queries). */
    ds41__window_kv(e, L, xn, M, b->rope_cs, kvraw, kv, chunk_rows, row_bytes);

    if (role->kv_source && (rc = compressor(e, b, L, xn, err)) != 0) goto out;
    if (role->ratio > 0 && role->index_source && (rc = indexer(e, b, L, xn, qr, err)) != 0) goto out;

    const int src = role->ratio > 0 ? lay->source_of_layer[L] : -1;
    const int32_t *lists = role->ratio > 0 ? b->idx_list[role->index_from] : NULL;
    const uint32_t *counts = role->ratio > 0 ? b->idx_count[role->index_from] : NULL;
    if (role->ratio > 0 && (!lists || !counts)) {
        rc = ds41_fail(err, "forward: layer %d: index source %d produced no indices", L, role->index_from);
        goto out;
    }
    /* Every row's window and compressed list, described by metadata
     * (engine/backend/ops.h: ds41_attn_step), attended in one call. */
    ds41_attn_step step = {.layout = lay,
                           .window = (uint32_t)W,
                           .block = b->draft_block,
                           .chunk = chunk_rows,
                           .rings = rings,
                           .row_item = b->row_item,
                           .row_pos = b->row_pos,
                           .item_row0 = b->item_row0,
                           .item_pos0 = b->item_pos0,
                           .sel = lists,
                           .count = counts,
                           .sel_stride = (size_t)c->index_topk};
    for (size_t it = 0; it < b->n_items; it++) rings[it] = ds41_kv_ring_row(b->items[it].seq, L, 0);
    if (role->ratio > 0) {
        size_t n_pages = 0;
        const uint8_t **pages = step_pages(e, b, src, row_table, &n_pages);
        if (!pages) {
            rc = ds41_fail(err, "forward: out of memory");
            goto out;
        }
        step.comp = (ds41_kv_pages){.layout = lay, .pages = pages, .row_table = row_table, .n_pages = n_pages};
        /* (An index source reported its lists with their scores.) */
        if (!role->index_source && b->hooks && b->hooks->decision) {
            const size_t topk = (size_t)c->index_topk;
            int32_t *hl = host(M * topk * sizeof *hl);
            uint32_t *hn = host(M * sizeof *hn);
            if (!hl || !hn) {
                rc = ds41_fail(err, "forward: out of memory");
                goto out;
            }
            e->mem->download(e->mem, hl, lists, M * topk * sizeof *hl);
            e->mem->download(e->mem, hn, counts, M * sizeof *hn);
            for (size_t r = 0; r < M; r++)
                ds41__report_decision(b, DS41_DECISION_INDEX, L, r, hl + r * topk, hn[r], NULL, 0);
        }
    }
    ops->attend(ops, q, M, (int)H, (int)hd, lw->attn_sink, e->softmax_scale, &step, o);
    ops->rope(ops, o + hd - (size_t)rd, M, (int)H, H * hd, hd, rd / 2, b->rope_cs, 1);

    /* The chunk's last min(n, W) window rows go to the ring now that every
     * query of the chunk has read what it needs (a draft block's never:
     * REFERENCE §7 writes only the backbone positions' main_kv there). */
    for (size_t it = 0; it < b->n_items && !b->draft_block; it++) {
        const ds41_fwd_item *item = &b->items[it];
        /* (A journaled sequence gets every row: a rewind inside the chunk needs them.) */
        const size_t n = item->n_ids, start = n > W && !ds41_kv_seq_journal_active(item->seq) ? n - W : 0;
        for (size_t i = start; i < n; i++)
            ds41_kv_ring_put(item->seq, L, b->item_pos0[it] + i,
                             chunk_rows + (b->item_row0[it] + i) * row_bytes);
    }

    /* Grouped wo_a (bf16, block-diagonal over o_groups) then wo_b. */
    for (size_t g = 0; g < G; g++) {
        e->mem->copy_2d(e->mem, xg, Kg * sizeof *xg, o + g * Kg, H * hd * sizeof *o, Kg * sizeof *xg, M);
        ds41_linear sub = lw->wo_a;
        sub.n = (int64_t)olr;
        sub.bf16 = lw->wo_a.bf16 + g * olr * Kg;
        ops->linear(ops, &sub, xg, M, yg, DS41_OUT_BF16);
        e->mem->copy_2d(e->mem, ya + g * olr, G * olr * sizeof *ya, yg, olr * sizeof *yg, olr * sizeof *yg, M);
    }
    ops->linear(ops, &lw->wo_b, ya, M, out, DS41_OUT_BF16);
out:
    ds41__frame_release(e, f);
    return rc;
}
