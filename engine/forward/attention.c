/* Attention sub-layer: q path, window KV, compressor, indexer, candidate
 * blocks, sparse attention over the canonical list, inverse rope, wo_a/wo_b
 * (REFERENCE.md §2.8-2.11, §9, §10.7). */
#include "engine/forward/forward_internal.h"

#include "engine/model/quant.h"
#include "engine/backend/refmath.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Scratch of the step (forward_internal.h: ds41_engine.scratch). */
static void *step_buf(ds41_engine *e, size_t bytes) {
    return ds41_scratch_get(&e->scratch, bytes);
}

void ds41__rope_rows(ds41_engine *e, fwd_batch *b, int L) {
    if (b->rope_layer == L) return;
    const int rd = (int)e->cfg.rope_head_dim;
    const float *f = e->rope_freqs[L];
    if (b->rope_layer >= 0 && e->rope_freqs[b->rope_layer] &&
        memcmp(e->rope_freqs[b->rope_layer], f, (size_t)(rd / 2) * sizeof *f) == 0) {
        b->rope_layer = L; /* same frequencies: same table */
        return;
    }
    for (size_t r = 0; r < b->M; r++) ds41_rope_cos_sin(f, rd / 2, b->row_pos[r], b->rope_cs + r * (size_t)rd);
    b->rope_layer = L;
}

/* ---- compressor and index keys (kv source layers, §2.9, §2.10 step 1) ------------- */

/* A latent of group j (first token position j*ratio) is complete: derive its
 * index key from the unrotated latent, rotate both at the group's first
 * position, and append them (packed FP4) to the sequence's entries. */
static int emit_entry(ds41_engine *e, int L, ds41_kv_seq *seq, int src, uint64_t group, const float *latent,
                      ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t hd = (size_t)c->head_dim, ihd = (size_t)c->index_head_dim;
    const int rd = (int)c->rope_head_dim;
    const int ratio = c->roles[L].ratio;
    if (ds41_kv_seq_entries(seq, src) != group)
        return ds41_fail(err, "forward: layer %d: compressed entry %llu out of order (have %llu)", L,
                         (unsigned long long)group, (unsigned long long)ds41_kv_seq_entries(seq, src));
    const ds41_scratch_mark mark = ds41_scratch_mark_now(&e->scratch);
    float *key_raw = step_buf(e, ihd * sizeof *key_raw);
    float *key = step_buf(e, ihd * sizeof *key);
    float *rot = step_buf(e, hd * sizeof *rot);
    float *cs = step_buf(e, (size_t)rd * sizeof *cs);
    if (!key_raw || !key || !rot || !cs) {
        ds41_scratch_release(&e->scratch, mark);
        return ds41_fail(err, "forward: out of memory");
    }
    ops->linear(ops, &lw->idx_wk, latent, 1, key_raw, DS41_OUT_BF16_EXACT);
    ops->rmsnorm(ops, lw->idx_k_norm, key_raw, 1, ihd, e->norm_eps, key);
    ds41_rope_cos_sin(e->rope_freqs[L], rd / 2, group * (uint64_t)ratio, cs);
    ops->rope(ops, key + ihd - (size_t)rd, rd / 2, cs, 0);
    memcpy(rot, latent, hd * sizeof *rot);
    ops->rope(ops, rot + hd - (size_t)rd, rd / 2, cs, 0);
    int rc = ds41_kv_seq_append(seq, src, rot, key, err);
    ds41_scratch_release(&e->scratch, mark);
    return rc;
}

void ds41__compress_pool(const float *ckv, const float *csc, int ratio, size_t hd, float *ex, float *pooled) {
    for (size_t ch = 0; ch < hd; ch++) {
        float mx = csc[ch];
        for (int t = 1; t < ratio; t++) mx = csc[(size_t)t * hd + ch] > mx ? csc[(size_t)t * hd + ch] : mx;
        float sum = 0.0f;
        for (int t = 0; t < ratio; t++) {
            ex[t] = ds41_rm_exp(csc[(size_t)t * hd + ch] - mx);
            sum = t ? sum + ex[t] : ex[t];
        }
        float acc = 0.0f;
        for (int t = 0; t < ratio; t++) {
            const float w = ex[t] / sum;
            const float term = ckv[(size_t)t * hd + ch] * w;
            acc = t ? acc + term : term;
        }
        pooled[ch] = ds41_bf16_round(acc);
    }
}

static int compressor(ds41_engine *e, fwd_batch *b, int L, const float *xn, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t M = b->M, hd = (size_t)c->head_dim;
    const int ratio = c->roles[L].ratio;
    const ds41_kv_layout *lay = ds41_kv_pool_layout(ds41_kv_seq_pool(b->items[0].seq));
    const int src = lay->source_of_layer[L];
    const ds41_scratch_mark mark = ds41_scratch_mark_now(&e->scratch);
    int rc = 0;
    if (ratio == 1) {
        /* latent = norm(wkv(x)): bf16 linear, RMSNorm; one per token. */
        float *raw = step_buf(e, M * hd * sizeof *raw);
        float *lat = step_buf(e, M * hd * sizeof *lat);
        if (!raw || !lat) {
            ds41_scratch_release(&e->scratch, mark);
            return ds41_fail(err, "forward: out of memory");
        }
        ops->linear(ops, &lw->cmp_wkv, xn, M, raw, DS41_OUT_BF16_EXACT);
        ops->rmsnorm(ops, lw->cmp_norm, raw, M, hd, e->norm_eps, lat);
        for (size_t r = 0; r < M && rc == 0; r++)
            rc = emit_entry(e, L, b->items[b->row_item[r]].seq, src, b->row_pos[r], lat + r * hd, err);
        ds41_scratch_release(&e->scratch, mark);
        return rc;
    }
    /* ratio > 1: fp32 kv and gate scores, carried per slot (position mod
     * ratio); a completed group is pooled with a per-channel softmax over
     * its tokens (§2.9, §10.4 short sums, decision 12 of the numpy side). */
    float *kv = step_buf(e, M * hd * sizeof *kv);
    float *sc = step_buf(e, M * hd * sizeof *sc);
    float *pooled = step_buf(e, hd * sizeof *pooled);
    float *lat = step_buf(e, hd * sizeof *lat);
    float *ex = step_buf(e, (size_t)ratio * sizeof *ex);
    if (!kv || !sc || !pooled || !lat || !ex) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }
    ops->linear(ops, &lw->cmp_wkv, xn, M, kv, DS41_OUT_F32_EXACT);
    ops->linear(ops, &lw->cmp_wgate, xn, M, sc, DS41_OUT_F32_EXACT);
    for (size_t r = 0; r < M && rc == 0; r++) {
        ds41_kv_seq *seq = b->items[b->row_item[r]].seq;
        float *ckv = ds41_kv_carry_kv(seq, src);
        float *csc = ds41_kv_carry_score(seq, src);
        const uint64_t a = b->row_pos[r];
        const size_t slot = (size_t)(a % (uint64_t)ratio);
        memcpy(ckv + slot * hd, kv + r * hd, hd * sizeof *kv);
        memcpy(csc + slot * hd, sc + r * hd, hd * sizeof *sc);
        if ((a + 1) % (uint64_t)ratio != 0) continue;
        ds41__compress_pool(ckv, csc, ratio, hd, ex, pooled);
        ops->rmsnorm(ops, lw->cmp_norm, pooled, 1, hd, e->norm_eps, lat);
        rc = emit_entry(e, L, seq, src, a / (uint64_t)ratio, lat, err);
    }
out:
    ds41_scratch_release(&e->scratch, mark);
    return rc;
}

/* ---- indexer (§2.10, §2.11, §9.2, decision 8 of the numpy side) ------------------- */

/* Descending score, equal scores: lower index first.  NaN ranks above
 * everything (torch.topk treats NaN as the largest value). */
static int cmp_rank(int32_t a, int32_t b, const float *score) {
    const float sa = score[a], sb = score[b];
    const int na = isnan(sa), nb = isnan(sb);
    if (na != nb) return na ? -1 : 1;
    if (!na) {
        if (sa > sb) return -1;
        if (sa < sb) return 1;
    }
    return a < b ? -1 : (a > b ? 1 : 0);
}

/* Ascending index. */
static int cmp_index(int32_t a, int32_t b, const float *unused) {
    (void)unused;
    return a < b ? -1 : (a > b ? 1 : 0);
}

/* Sort a[0..n) of distinct indices by cmp, a total order on them (ties are
 * broken by index), so any correct sort gives the same result as qsort did.
 * A bottom-up merge sort through tmp[n] of the step's scratch: glibc's qsort
 * allocates a buffer of its own for arrays over 1 KiB. */
static void sort_i32(int32_t *a, int32_t *tmp, size_t n, int (*cmp)(int32_t, int32_t, const float *),
                     const float *score) {
    int32_t *src = a, *dst = tmp;
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            const size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) dst[k++] = cmp(src[j], src[i], score) < 0 ? src[j++] : src[i++];
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, n * sizeof *a);
}

/* order[0..n) <- 0..n-1 ranked by score (see cmp_rank); tmp[n] scratch. */
void ds41__index_rank(const float *score, int32_t *order, int32_t *tmp, size_t n) {
    for (size_t i = 0; i < n; i++) order[i] = (int32_t)i;
    sort_i32(order, tmp, n, cmp_rank, score);
}

/* The most compressed entries a row of the step reaches at ratio. */
static uint64_t step_max_reach(const fwd_batch *b, int ratio) {
    uint64_t max_reach = 0;
    for (size_t r = 0; r < b->M; r++) {
        const uint64_t reach = (b->row_pos[r] + 1) / (uint64_t)ratio;
        if (reach > max_reach) max_reach = reach;
    }
    return max_reach;
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

    const uint64_t max_reach = step_max_reach(b, ratio);
    int rc = 0;
    const ds41_scratch_mark mark = ds41_scratch_mark_now(&e->scratch);
    float *q = step_buf(e, M * qw * sizeof *q);
    float *w = step_buf(e, M * (size_t)nh * sizeof *w);
    float *score = step_buf(e, (size_t)max_reach * sizeof *score);
    int32_t *order = step_buf(e, (size_t)max_reach * sizeof *order);
    int32_t *sort_tmp = step_buf(e, (size_t)max_reach * sizeof *sort_tmp);
    const uint8_t **keys = step_buf(e, (size_t)max_reach * sizeof *keys);
    const size_t n_blocks_max = (size_t)((max_reach + B - 1) / B);
    float *bscore = step_buf(e, n_blocks_max * sizeof *bscore);
    int32_t *border = step_buf(e, n_blocks_max * sizeof *border);
    if (!q || !w || !score || !order || !sort_tmp || !keys || !bscore || !border) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }
    /* No candidate block is kept until this source's top-k says so. */
    if (role->candidate_source) memset(b->cand, 0, M * b->cand_stride);

    /* Query side: q = wq_b(qr), rope at the query position, FP4 1x32 QDQ;
     * w = bf16(weights_proj(x) * scale). */
    ops->linear(ops, &lw->idx_wq_b, qr, M, q, DS41_OUT_BF16_EXACT);
    ops->linear(ops, &lw->idx_weights_proj, xn, M, w, DS41_OUT_BF16_EXACT);
    for (size_t r = 0; r < M; r++) {
        for (int h = 0; h < nh; h++)
            ops->rope(ops, q + r * qw + (size_t)h * (size_t)ihd + (size_t)(ihd - rd), rd / 2,
                      b->rope_cs + r * (size_t)rd, 0);
        ds41_fp4_act_quant_ue8m0_qdq(q + r * qw, qw);
        for (int h = 0; h < nh; h++) w[r * (size_t)nh + (size_t)h] = ds41_bf16_round(w[r * (size_t)nh + (size_t)h] * e->index_scale);
    }

    for (size_t r = 0; r < M; r++) {
        ds41_kv_seq *seq = b->items[b->row_item[r]].seq;
        const size_t reach = (size_t)((b->row_pos[r] + 1) / (uint64_t)ratio);
        b->idx_count[L][r] = 0;
        if (reach == 0) continue; /* nothing compressed is visible yet (§2.10 step 8) */
        for (size_t t = 0; t < reach; t++) keys[t] = ds41_kv_seq_entry(seq, ks, t);
        ops->index_scores(ops, q + r * qw, w + r * (size_t)nh, nh, ihd, lay, keys, reach, score);

        if (role->candidate_source) {
            /* Block max over reachable positions, newest block pinned, top
             * candidate_topk_blocks, -inf picks dropped (§2.11). */
            const size_t nb = (reach + B - 1) / B;
            for (size_t blk = 0; blk < nb; blk++) {
                float mx = -INFINITY;
                for (size_t t = blk * B; t < reach && t < (blk + 1) * B; t++)
                    if (score[t] > mx || isnan(score[t])) mx = score[t];
                bscore[blk] = mx;
            }
            bscore[(reach - 1) / B] = INFINITY;
            ds41__index_rank(bscore, border, sort_tmp, nb);
            size_t take = (size_t)c->candidate_topk_blocks < nb ? (size_t)c->candidate_topk_blocks : nb;
            uint8_t *allow = b->cand + r * b->cand_stride;
            for (size_t i = 0; i < take; i++)
                if (!(bscore[border[i]] == -INFINITY)) allow[border[i]] = 1;
            if (b->hooks && b->hooks->decision) {
                size_t n_kept = 0;
                for (size_t blk = 0; blk < nb; blk++)
                    if (allow[blk]) border[n_kept++] = (int32_t)blk;
                ds41__report_decision(b, DS41_DECISION_CAND, L, r, border, n_kept, bscore, nb);
            }
        }
        if (role->candidate_user) {
            const uint8_t *allow = b->cand + r * b->cand_stride;
            for (size_t t = 0; t < reach; t++)
                if (!allow[t / B]) score[t] = -INFINITY;
        }
        /* Top min(index_topk, reach), lower position on ties; -inf picks of
         * a candidate user are kept (§2.10 step 7); then ascending. */
        const size_t k = topk < reach ? topk : reach;
        ds41__index_rank(score, order, sort_tmp, reach);
        int32_t *list = b->idx_list[L] + r * topk;
        memcpy(list, order, k * sizeof *list);
        sort_i32(list, sort_tmp, k, cmp_index, NULL);
        b->idx_count[L][r] = (uint32_t)k;
        ds41__report_decision(b, DS41_DECISION_INDEX, L, r, list, k, score, reach);
    }
out:
    ds41_scratch_release(&e->scratch, mark);
    return rc;
}

int ds41__attention_prepare(ds41_engine *e, fwd_batch *b, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const size_t M = b->M, topk = (size_t)c->index_topk;
    b->cand_stride = 1;
    for (size_t L = 0; L < (size_t)c->n_layers; L++) {
        const ds41_layer_role *role = &c->roles[L];
        if (role->ratio <= 0 || !role->index_source) continue; /* as ds41__attention runs it */
        b->idx_list[L] = step_buf(e, M * (topk ? topk : 1) * sizeof *b->idx_list[L]);
        b->idx_count[L] = step_buf(e, M * sizeof *b->idx_count[L]);
        if (!b->idx_list[L] || !b->idx_count[L]) return ds41_fail(err, "forward: out of memory");
        if (role->candidate_source) {
            /* One row of flags per row wide enough for every candidate
             * source's blocks (the rows' reach in blocks, as the indexer). */
            const uint64_t B = (uint64_t)c->candidate_block_size;
            const size_t nb = (size_t)((step_max_reach(b, role->ratio) + B - 1) / B);
            if (nb > b->cand_stride) b->cand_stride = nb;
        }
    }
    b->cand = step_buf(e, M * b->cand_stride);
    return b->cand ? 0 : ds41_fail(err, "forward: out of memory");
}

/* ---- the sub-layer ------------------------------------------------------------------------ */

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
    const ds41_scratch_mark mark = ds41_scratch_mark_now(&e->scratch);
    float *qa = step_buf(e, M * qlr * sizeof *qa);
    float *qr = step_buf(e, M * qlr * sizeof *qr);
    float *q = step_buf(e, M * H * hd * sizeof *q);
    float *kvraw = step_buf(e, M * hd * sizeof *kvraw);
    float *kv = step_buf(e, M * hd * sizeof *kv);
    uint8_t *chunk_rows = step_buf(e, M * row_bytes);
    float *o = step_buf(e, M * H * hd * sizeof *o);
    float *xg = step_buf(e, M * Kg * sizeof *xg);
    float *yg = step_buf(e, M * olr * sizeof *yg);
    float *ya = step_buf(e, M * G * olr * sizeof *ya);
    const uint8_t **wrows = step_buf(e, (W ? W : 1) * sizeof *wrows);
    const uint8_t **crows = step_buf(e, ((size_t)c->index_topk ? (size_t)c->index_topk : 1) * sizeof *crows);
    if (!qa || !qr || !q || !kvraw || !kv || !chunk_rows || !o || !xg || !yg || !ya || !wrows || !crows) {
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
    for (size_t r = 0; r < M; r++)
        for (size_t h = 0; h < H; h++)
            ops->rope(ops, q + (r * H + h) * hd + hd - (size_t)rd, rd / 2, b->rope_cs + r * (size_t)rd, 0);

    /* Window KV: kv_norm(wkv(x)), rope, FP8 1x32 QDQ (kept packed, in the
     * ring's row format, for this chunk's queries). */
    ops->linear(ops, &lw->wkv, xn, M, kvraw, DS41_OUT_BF16);
    ops->rmsnorm(ops, lw->kv_norm, kvraw, M, hd, e->norm_eps, kv);
    for (size_t r = 0; r < M; r++) {
        ops->rope(ops, kv + r * hd + hd - (size_t)rd, rd / 2, b->rope_cs + r * (size_t)rd, 0);
        ds41_act_quant(kv + r * hd, hd, chunk_rows + r * row_bytes, chunk_rows + r * row_bytes + hd);
    }

    if (role->kv_source && (rc = compressor(e, b, L, xn, err)) != 0) goto out;
    if (role->ratio > 0 && role->index_source && (rc = indexer(e, b, L, xn, qr, err)) != 0) goto out;

    const int src = role->ratio > 0 ? lay->source_of_layer[L] : -1;
    const int32_t *lists = role->ratio > 0 ? b->idx_list[role->index_from] : NULL;
    const uint32_t *counts = role->ratio > 0 ? b->idx_count[role->index_from] : NULL;
    if (role->ratio > 0 && (!lists || !counts)) {
        rc = ds41_fail(err, "forward: layer %d: index source %d produced no indices", L, role->index_from);
        goto out;
    }
    for (size_t r = 0; r < M; r++) {
        const size_t it = b->row_item[r];
        ds41_kv_seq *seq = b->items[it].seq;
        const uint64_t p0 = b->item_pos0[it], a = b->row_pos[r];
        const uint64_t first = a + 1 > W ? a + 1 - W : 0;
        ds41_attn_rows rows = {.layout = lay, .window = wrows, .comp = crows};
        for (uint64_t pos = first; pos <= a; pos++)
            wrows[rows.n_window++] = pos >= p0 ? chunk_rows + (b->item_row0[it] + (size_t)(pos - p0)) * row_bytes
                                               : ds41_kv_ring_row(seq, L, (uint32_t)(pos % W));
        if (role->ratio > 0) {
            const int32_t *list = lists + r * (size_t)c->index_topk;
            for (uint32_t j = 0; j < counts[r]; j++) crows[rows.n_comp++] = ds41_kv_seq_entry(seq, src, (uint64_t)list[j]);
            /* (An index source reported its list with its scores.) */
            if (!role->index_source)
                ds41__report_decision(b, DS41_DECISION_INDEX, L, r, list, counts[r], NULL, 0);
        }
        ops->sparse_attn(ops, q + r * H * hd, (int)H, (int)hd, lw->attn_sink, e->softmax_scale, &rows, o + r * H * hd);
        for (size_t h = 0; h < H; h++)
            ops->rope(ops, o + (r * H + h) * hd + hd - (size_t)rd, rd / 2, b->rope_cs + r * (size_t)rd, 1);
    }

    /* The chunk's last min(n, W) window rows go to the ring now that every
     * query of the chunk has read what it needs. */
    for (size_t it = 0; it < b->n_items; it++) {
        const ds41_fwd_item *item = &b->items[it];
        const size_t n = item->n_ids, start = n > W ? n - W : 0;
        for (size_t i = start; i < n; i++)
            ds41_kv_ring_write(item->seq, L, b->item_pos0[it] + i, kv + (b->item_row0[it] + i) * hd);
    }

    /* Grouped wo_a (bf16, block-diagonal over o_groups) then wo_b. */
    for (size_t g = 0; g < G; g++) {
        for (size_t r = 0; r < M; r++) memcpy(xg + r * Kg, o + r * H * hd + g * Kg, Kg * sizeof *xg);
        ds41_linear sub = lw->wo_a;
        sub.n = (int64_t)olr;
        sub.bf16 = lw->wo_a.bf16 + g * olr * Kg;
        ops->linear(ops, &sub, xg, M, yg, DS41_OUT_BF16);
        for (size_t r = 0; r < M; r++) memcpy(ya + r * G * olr + g * olr, yg + r * olr, olr * sizeof *yg);
    }
    ops->linear(ops, &lw->wo_b, ya, M, out, DS41_OUT_BF16);
out:
    ds41_scratch_release(&e->scratch, mark);
    return rc;
}
