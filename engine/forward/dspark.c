/* DSpark draft head (REFERENCE §7, §10.7; the contract is dspark.h): the
 * taps and stage windows written by a forward call with spec_taps, and the
 * draft block through the stages, the head, the Markov correction and the
 * confidence.  The stages are ordinary blocks (ds41__block) whose attention
 * runs in draft-block mode (fwd_batch.draft_block, ds41_attn_step.block). */
#include "engine/forward/dspark.h"

#include "engine/forward/forward_internal.h"

#include <string.h>

#define dev(bytes) ds41__dev(e, (bytes))
#define host(bytes) ds41__host(e, (bytes))

/* ---- taps and stage windows (inside ds41_forward) ------------------------------------------ */

int ds41__dspark_spec_begin(ds41_engine *e, const fwd_batch *b, fwd_spec *s) {
    const ds41_model_config *c = &e->cfg;
    memset(s, 0, sizeof *s);
    size_t n = 0;
    for (size_t i = 0; i < b->n_items; i++)
        if (b->items[i].spec_taps) n += b->items[i].n_ids;
    if (n == 0) return 1;
    const size_t hc = (size_t)c->hc_mult, D = (size_t)c->dim, nt = c->dspark_target_layer_ids.n;
    s->row = host(n * sizeof *s->row);
    s->pos = host(n * sizeof *s->pos);
    float *inv = host(n * hc * sizeof *inv);
    s->inv = dev(n * hc * sizeof *s->inv);
    s->taps = dev(n * nt * D * sizeof *s->taps);
    if (!s->row || !s->pos || !inv || !s->inv || !s->taps) return 0;
    size_t k = 0;
    for (size_t i = 0; i < b->n_items; i++) {
        if (!b->items[i].spec_taps) continue;
        for (size_t t = 0; t < b->items[i].n_ids; t++, k++) {
            s->row[k] = (uint32_t)(b->item_row0[i] + t);
            s->pos[k] = b->item_pos0[i] + t;
        }
    }
    /* The copy average bf16(mean_c h[c]) as hc_pre with weights fp32(1/hc):
     * the short sum of §10.4 in copy order (tests/reference/README.md). */
    const float w = (float)(1.0 / (double)hc);
    for (size_t r = 0; r < n * hc; r++) inv[r] = w;
    e->mem->upload(e->mem, s->inv, inv, n * hc * sizeof *inv);
    s->n = n;
    return 1;
}

int ds41__dspark_tap(ds41_engine *e, const fwd_batch *b, fwd_spec *s, int L, const float *h,
                     ds41_error *err) {
    (void)b;
    const ds41_model_config *c = &e->cfg;
    const size_t hc = (size_t)c->hc_mult, D = (size_t)c->dim, nt = c->dspark_target_layer_ids.n, n = s->n;
    size_t j = 0;
    while (j < nt && c->dspark_target_layer_ids.v[j] != L) j++;
    if (j == nt) return 0;
    const fwd_frame f = ds41__frame(e);
    float *hg = dev(n * hc * D * sizeof *hg);
    float *t = dev(n * D * sizeof *t);
    int rc = 0;
    if (!hg || !t) {
        rc = ds41_fail(err, "forward: out of memory");
    } else {
        e->ops->gather_rows(e->ops, hg, h, hc * D * sizeof *h, s->row, n, hc * D * sizeof *hg);
        e->ops->hc_pre(e->ops, hg, s->inv, n, (int)hc, D, t);
        e->mem->copy_2d(e->mem, s->taps + j * D, nt * D * sizeof *t, t, D * sizeof *t, D * sizeof *t, n);
    }
    ds41__frame_release(e, f);
    return rc;
}

int ds41__dspark_seed(ds41_engine *e, fwd_batch *b, fwd_spec *s, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_ops *ops = e->ops;
    const size_t n = s->n, D = (size_t)c->dim, hd = (size_t)c->head_dim, W = (size_t)c->window_size;
    const int rd = (int)c->rope_head_dim;
    const ds41_kv_layout *lay = ds41_kv_pool_layout(ds41_kv_seq_pool(b->items[0].seq));
    const size_t rb = lay->ring_row_bytes;
    const fwd_frame f = ds41__frame(e);
    float *mx = dev(n * D * sizeof *mx);
    float *main_x = dev(n * D * sizeof *main_x);
    float *cs = dev(n * (size_t)rd * sizeof *cs);
    float *kvraw = dev(n * hd * sizeof *kvraw);
    float *kv = dev(n * hd * sizeof *kv);
    uint8_t *rows = dev(n * rb);
    if (!mx || !main_x || !cs || !kvraw || !kv || !rows) {
        ds41__frame_release(e, f);
        return ds41_fail(err, "forward: out of memory");
    }
    /* main_x = main_norm(main_proj(taps)) (stage 0's weights). */
    ops->linear(ops, &e->w.mtp_main_proj, s->taps, n, mx, DS41_OUT_BF16);
    ops->rmsnorm(ops, e->w.mtp_main_norm, mx, n, D, e->norm_eps, main_x);
    for (int64_t k = 0; k < c->n_mtp_layers; k++) {
        const int L = (int)(c->n_layers + k);
        ops->rope_table(ops, e->rope_freqs_be[L], rd / 2, s->pos, n, cs);
        ds41__window_kv(e, L, main_x, n, cs, kvraw, kv, rows, rb);
        /* Each item's last min(n_ids, W) rows into the stage's ring (a
         * journaled sequence's every row, as the backbone's rings: a rewind
         * inside the chunk needs the rows it keeps). */
        size_t base = 0;
        for (size_t i = 0; i < b->n_items; i++) {
            const ds41_fwd_item *it = &b->items[i];
            if (!it->spec_taps) continue;
            const bool all = ds41_kv_seq_journal_active(it->seq);
            for (size_t t = it->n_ids > W && !all ? it->n_ids - W : 0; t < it->n_ids; t++)
                ds41_kv_ring_put(it->seq, L, b->item_pos0[i] + t, rows + (base + t) * rb);
            base += it->n_ids;
        }
    }
    ds41__frame_release(e, f);
    return 0;
}

/* ---- the draft call ---------------------------------------------------------------------- */

static int check_requests(const ds41_engine *e, const ds41_draft_req *reqs, size_t n, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    if (!c->dspark_enabled || c->n_mtp_layers < 1 || !e->w.mtp_markov_embed)
        return ds41_fail(err, "dspark: %s has no DSpark stages", c->label);
    if (!reqs || n == 0) return ds41_fail(err, "dspark: no draft requests");
    const ds41_kv_pool *pool = NULL;
    for (size_t i = 0; i < n; i++) {
        const ds41_draft_req *r = &reqs[i];
        if (!r->seq || !r->ids)
            return ds41_fail(err, "dspark: request %zu has no sequence or no ids buffer", i);
        if (r->k < 1 || (int64_t)r->k > c->dspark_block_size)
            return ds41_fail(err, "dspark: request %zu: k = %zu outside 1..%lld (dspark_block_size)", i, r->k,
                             (long long)c->dspark_block_size);
        if (r->token < 0 || r->token >= c->vocab_size)
            return ds41_fail(err, "dspark: request %zu: token %d outside [0, %lld)", i, r->token,
                             (long long)c->vocab_size);
        if (ds41_kv_seq_tokens(r->seq) == 0)
            return ds41_fail(err, "dspark: request %zu: the sequence has consumed no token", i);
        if (ds41_kv_seq_tokens(r->seq) > UINT64_MAX / 4)
            return ds41_fail(err, "dspark: request %zu: position overflow", i);
        for (size_t j = 0; j < i; j++)
            if (reqs[j].seq == r->seq)
                return ds41_fail(err, "dspark: requests %zu and %zu share a sequence", j, i);
        const ds41_kv_pool *p = ds41_kv_seq_pool(r->seq);
        const ds41_kv_layout *l = ds41_kv_pool_layout(p);
        if (l->n_layers != (int)c->n_roles || l->latent_dim != (uint32_t)c->head_dim ||
            l->window != (uint32_t)c->window_size || l->ring_of_layer[c->n_layers] < 0)
            return ds41_fail(err, "dspark: request %zu: its sequence's pool was made for another model", i);
        if (pool && p != pool) return ds41_fail(err, "dspark: the requests mix sequences of different pools");
        pool = p;
    }
    return 0;
}

/* The draft block through the stages, the head, the Markov chain and the
 * confidence (dspark.h); the requests are checked. */
static int draft(ds41_engine *e, ds41_draft_req *reqs, size_t n, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_ops *ops = e->ops;
    const ds41_memory *mem = e->mem;
    const size_t hc = (size_t)c->hc_mult, D = (size_t)c->dim, V = (size_t)c->vocab_size;
    const size_t B = (size_t)c->dspark_block_size, R = (size_t)c->dspark_markov_rank, M = n * B;
    size_t kmax = 0;
    for (size_t i = 0; i < n; i++)
        if (reqs[i].k > kmax) kmax = reqs[i].k;
    const size_t KC = D + R; /* the confidence input [x ; e] */
    int rc = -1;

    const fwd_frame frame = ds41__frame(e);
    fwd_batch b;
    memset(&b, 0, sizeof b);
    ds41_fwd_item *items = host(n * sizeof *items);
    int32_t *block_ids = host(M * sizeof *block_ids);
    b.items = items;
    b.n_items = n;
    b.M = M;
    b.rope_layer = -1;
    b.draft_block = (uint32_t)B;
    b.item_row0 = host(n * sizeof *b.item_row0);
    b.item_pos0 = host(n * sizeof *b.item_pos0);
    b.row_item = host(M * sizeof *b.row_item);
    b.row_pos = host(M * sizeof *b.row_pos);
    b.row_token = block_ids;
    b.idx_list = host(c->n_roles * sizeof *b.idx_list);
    b.idx_count = host(c->n_roles * sizeof *b.idx_count);
    b.rope_cs = dev(M * (size_t)c->rope_head_dim * sizeof *b.rope_cs);
    float *pre_init = host(M * hc * sizeof *pre_init);
    fwd_block_bufs bb;
    const int bb_ok = ds41__block_bufs(e, M, &bb);
    float *lg = dev(M * V * sizeof *lg);
    float *hl = host(M * V * sizeof *hl); /* the head's logits, then Markov-corrected */
    float *er = dev(n * R * sizeof *er);  /* the Markov embedding of each request's current id */
    float *mk = dev(n * V * sizeof *mk);
    float *mkh = host(n * V * sizeof *mkh);
    int32_t *cur = host(n * sizeof *cur);
    int32_t *out_ids = host(n * kmax * sizeof *out_ids);
    float *cat = dev(n * kmax * KC * sizeof *cat); /* [n][kmax][x ; e] */
    float *conf = dev(n * kmax * sizeof *conf);
    float *conf_h = host(n * kmax * sizeof *conf_h);
    if (!items || !block_ids || !b.item_row0 || !b.item_pos0 || !b.row_item || !b.row_pos || !b.idx_list ||
        !b.idx_count || !b.rope_cs || !pre_init || !bb_ok || !lg || !hl || !er || !mk || !mkh || !cur ||
        !out_ids || !cat || !conf || !conf_h) {
        ds41_fail(err, "dspark: out of memory");
        goto out;
    }
    memset(b.idx_list, 0, c->n_roles * sizeof *b.idx_list);
    memset(b.idx_count, 0, c->n_roles * sizeof *b.idx_count);

    /* The block [token, noise x (B-1)] at positions q+1 .. q+B of each sequence. */
    for (size_t i = 0; i < n; i++) {
        items[i] = (ds41_fwd_item){.seq = reqs[i].seq, .ids = block_ids + i * B, .n_ids = B};
        b.item_row0[i] = i * B;
        b.item_pos0[i] = ds41_kv_seq_tokens(reqs[i].seq);
        for (size_t j = 0; j < B; j++) {
            const size_t r = i * B + j;
            block_ids[r] = j == 0 ? reqs[i].token : (int32_t)c->dspark_noise_token_id;
            b.row_item[r] = i;
            b.row_pos[r] = b.item_pos0[i] + j;
        }
    }
    ops->embed(ops, e->w.embed, block_ids, M, (int)hc, D, bb.h);
    for (size_t r = 0; r < M; r++)
        for (size_t cp = 0; cp < hc; cp++) pre_init[r * hc + cp] = cp == 0 ? 1.0f : 0.0f;
    mem->upload(mem, bb.pre_mix, pre_init, M * hc * sizeof *pre_init);
    for (int64_t k = 0; k < c->n_mtp_layers; k++)
        if (ds41__block(e, &b, (int)(c->n_layers + k), &bb, err) != 0) goto out;

    /* x = hc_pre(h, pre_mix); logits = head(norm(x)), fp32. */
    ops->hc_pre(ops, bb.h, bb.pre_mix, M, (int)hc, D, bb.x);
    ops->rmsnorm(ops, e->w.mtp_norm, bb.x, M, D, e->norm_eps, bb.xn);
    ops->linear(ops, &e->w.head, bb.xn, M, lg, DS41_OUT_F32);
    mem->download(mem, hl, lg, M * V * sizeof *hl);
    for (size_t i = 0; i < n; i++)
        mem->copy_2d(mem, cat + i * kmax * KC, KC * sizeof *cat, bb.x + i * B * D, D * sizeof *cat,
                     D * sizeof *cat, kmax);

    /* Markov correction, row by row: row j's logits get e(id_j) . markov_head,
     * id_0 = the token, id_{j+1} = the argmax of row j's corrected logits. */
    for (size_t i = 0; i < n; i++) cur[i] = reqs[i].token;
    for (size_t j = 0; j < kmax; j++) {
        ops->embed(ops, e->w.mtp_markov_embed, cur, n, 1, R, er);
        mem->copy_2d(mem, cat + j * KC + D, kmax * KC * sizeof *cat, er, R * sizeof *er, R * sizeof *er, n);
        ops->linear(ops, &e->w.mtp_markov_head, er, n, mk, DS41_OUT_F32);
        mem->download(mem, mkh, mk, n * V * sizeof *mkh);
        for (size_t i = 0; i < n; i++) {
            float *row = hl + (i * B + j) * V;
            const float *add = mkh + i * V;
            for (size_t v = 0; v < V; v++) row[v] = row[v] + add[v];
            cur[i] = ds41_argmax(row, V);
            out_ids[i * kmax + j] = cur[i];
        }
    }
    /* confidence_i = [x_i ; e_i] . w_conf (fp32, the raw logit). */
    ops->linear(ops, &e->w.mtp_confidence, cat, n * kmax, conf, DS41_OUT_F32);
    mem->download(mem, conf_h, conf, n * kmax * sizeof *conf_h);

    for (size_t i = 0; i < n; i++) {
        ds41_draft_req *r = &reqs[i];
        for (size_t j = 0; j < r->k; j++) {
            r->ids[j] = out_ids[i * kmax + j];
            if (r->confidence) r->confidence[j] = conf_h[i * kmax + j];
            if (r->logits) memcpy(r->logits + j * V, hl + (i * B + j) * V, V * sizeof *hl);
        }
    }
    rc = 0;
out:
    ds41__frame_release(e, frame);
    return rc;
}

int ds41_dspark_draft(ds41_engine *e, ds41_draft_req *reqs, size_t n, ds41_error *err) {
    if (check_requests(e, reqs, n, err) != 0) return -1;
    /* As ds41_forward: nothing computed on a lost shard's zeros is returned. */
    if (ds41_checkpoint_check_mappings(e->ckpt, err) != 0) return -1;
    int rc = draft(e, reqs, n, err);
    ds41_error lost;
    if (ds41_checkpoint_check_mappings(e->ckpt, &lost) != 0) {
        if (err) *err = lost;
        rc = -1;
    }
    return rc;
}
