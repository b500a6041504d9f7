/* MoE sub-layer (REFERENCE.md §2.6 Gate/Expert/MoE, §9.2, §10.4): the
 * sqrt-softplus router with selection-only bias, FP4 routed experts with the
 * routing weight applied before w2, the FP8 shared expert, and the fp32
 * combine in increasing expert id then the shared expert.
 *
 * Routed experts come from the mapping (resident), or, under an expert
 * budget, from the expert tier (storage/expert_cache.h): the layer's experts
 * are predicted before its attention (ds41__moe_predict_early) and/or a layer
 * ahead (predict_next) and their reads started; right after the router,
 * every expert the batch selected is requested in one submission; the
 * experts are computed group by group as their reads complete, and the
 * ds41_linear views point into the pinned slots until the layer is done. */
#include "engine/forward/forward_internal.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* Expert read prediction (issue 7 item 3): apply layer L2's router (its
 * gate and selection bias) to a stream close to L2's own FFN input, known
 * before L2's router runs, and start reads for the union of the experts it
 * selects (top k + expert_predict_extra per token).  Best effort: out of
 * memory or a layer without experts just skips it. */
static void predict_layer(ds41_engine *e, const fwd_batch *b, int L2, const float *xn) {
    const ds41_model_config *c = &e->cfg;
    if (L2 >= (int)c->n_layers || !c->roles[L2].present || c->roles[L2].n_experts <= 0) return;
    const ds41_layer_weights *lw2 = &e->w.layers[L2];
    const size_t M = b->M;
    const int E2 = (int)c->roles[L2].n_experts;
    /* The router picks greedily by selection score, so its top k + extra
     * begins with its top k. */
    const int k2 = (int)((uint64_t)c->roles[L2].n_active_experts + e->expert_predict_extra < (uint64_t)E2
                             ? c->roles[L2].n_active_experts + (int64_t)e->expert_predict_extra
                             : E2);
    const fwd_frame f = ds41__frame(e);
    float *logits = ds41__dev(e, M * (size_t)E2 * sizeof *logits);
    int32_t *dsel = ds41__dev(e, M * (size_t)k2 * sizeof *dsel);
    float *wts = ds41__dev(e, M * (size_t)k2 * sizeof *wts);
    int32_t *sel = ds41__host(e, M * (size_t)k2 * sizeof *sel);
    uint8_t *want = ds41__host(e, (size_t)E2);
    int32_t *list = ds41__host(e, (size_t)E2 * sizeof *list);
    if (logits && dsel && wts && sel && want && list) {
        memset(want, 0, (size_t)E2);
        e->ops->linear(e->ops, &lw2->gate, xn, M, logits, DS41_OUT_F32);
        e->ops->router(e->ops, logits, lw2->gate_bias, M, E2, k2, e->gate_temp, e->route_scale, dsel, wts,
                       NULL);
        /* The choices come back to the host: they say what to read. */
        e->mem->download(e->mem, sel, dsel, M * (size_t)k2 * sizeof *sel);
        /* In rank order (every token's first choice, then its second, ...)
         * so the likeliest experts are read first and extra candidates last. */
        size_t n = 0;
        for (int j = 0; j < k2; j++)
            for (size_t r = 0; r < M; r++) {
                const int32_t ex = sel[r * (size_t)k2 + (size_t)j];
                if (ex >= 0 && ex < E2 && !want[ex]) {
                    want[ex] = 1;
                    list[n++] = ex;
                }
            }
        ds41_expert_cache_predict(e->xc, L2, list, n);
    }
    ds41__frame_release(e, f);
}

/* What one layer's expert arithmetic works on (see ds41__moe). */
typedef struct expert_work {
    ds41_engine *e;
    const ds41_layer_weights *lw;
    size_t M, D, I, SI, hid, sh;
    const float *xn;
    const size_t *count, *first;
    const float *xe, *route;
    float *g, *u, *h, *oe;
    const ds41_linear **lin;
    const float **lx;
    float **ly;
    size_t *lm;
    const ds41_linear *xl; /* streamed: [ex * 3 + w] views into the slots; NULL: the mapping */
} expert_work;

/* The routed experts list[0..n) (and the shared expert when `shared`):
 * w1 and w3 in one batch, SwiGLU (routing weight before w2), w2 in one
 * batch, each output a compact [rows][width] block at its expert's offset
 * (first * hid >= the previous block's rows * I: no overlap).  An expert's
 * arithmetic does not depend on what shares its batch, so any grouping gives
 * the same bits. */
static void run_experts(const expert_work *w, const int32_t *list, size_t n, bool shared) {
    const ds41_ops *ops = w->e->ops;
    const ds41_layer_weights *lw = w->lw;
    const size_t D = w->D, hid = w->hid, sh = w->sh;
    size_t n_lin = 0;
    for (size_t i = 0; i < n; i++) {
        const int ex = list[i];
        for (int which = 0; which < 2; which++) {
            w->lin[n_lin] = w->xl ? &w->xl[(size_t)ex * 3 + (which ? 2u : 0u)] : which ? &lw->w3[ex] : &lw->w1[ex];
            w->lx[n_lin] = w->xe + w->first[ex] * D;
            w->ly[n_lin] = (which ? w->u : w->g) + w->first[ex] * hid;
            w->lm[n_lin++] = w->count[ex];
        }
    }
    if (shared) {
        w->lin[n_lin] = &lw->sh_w1, w->lx[n_lin] = w->xn, w->ly[n_lin] = w->g + sh * hid, w->lm[n_lin++] = w->M;
        w->lin[n_lin] = &lw->sh_w3, w->lx[n_lin] = w->xn, w->ly[n_lin] = w->u + sh * hid, w->lm[n_lin++] = w->M;
    }
    if (n_lin == 0) return;
    ops->linear_batch(ops, n_lin, w->lin, w->lx, w->lm, w->ly, DS41_OUT_BF16);
    for (size_t i = 0; i < n; i++) {
        const int ex = list[i];
        ops->swiglu(ops, w->g + w->first[ex] * hid, w->u + w->first[ex] * hid, w->count[ex], w->I,
                    w->e->swiglu_limit, w->route + w->first[ex], w->h + w->first[ex] * hid);
    }
    if (shared) ops->swiglu(ops, w->g + sh * hid, w->u + sh * hid, w->M, w->SI, w->e->swiglu_limit, NULL, w->h + sh * hid);
    n_lin = 0;
    for (size_t i = 0; i < n; i++) {
        const int ex = list[i];
        w->lin[n_lin] = w->xl ? &w->xl[(size_t)ex * 3 + 1] : &lw->w2[ex], w->lx[n_lin] = w->h + w->first[ex] * hid,
        w->ly[n_lin] = w->oe + w->first[ex] * D;
        w->lm[n_lin++] = w->count[ex];
    }
    if (shared)
        w->lin[n_lin] = &lw->sh_w2, w->lx[n_lin] = w->h + sh * hid, w->ly[n_lin] = w->oe + sh * D,
        w->lm[n_lin++] = w->M;
    ops->linear_batch(ops, n_lin, w->lin, w->lx, w->lm, w->ly, DS41_OUT_BF16);
}

/* Layer L+1's experts from layer L's normed FFN input (while L's experts
 * load: a layer of lead time, but L's FFN and L+1's attention still change
 * the stream). */
static void predict_next(ds41_engine *e, const fwd_batch *b, int L, const float *xn) {
    predict_layer(e, b, L + 1, xn);
}

/* Layer L's experts from its FFN input without the attention output: the
 * stream entering L through the FFN's pre-mix and norm. */
void ds41__moe_predict_early(ds41_engine *e, const fwd_batch *b, int L, const float *h, const float *ffn_pre) {
    const ds41_model_config *c = &e->cfg;
    if (!e->xc || !e->expert_predict_early || !c->roles[L].present || c->roles[L].n_experts <= 0) return;
    const size_t M = b->M, D = (size_t)c->dim;
    const fwd_frame f = ds41__frame(e);
    float *x = ds41__dev(e, M * D * sizeof *x);
    float *xn = ds41__dev(e, M * D * sizeof *xn);
    if (x && xn) {
        e->ops->hc_pre(e->ops, h, ffn_pre, M, (int)c->hc_mult, D, x);
        e->ops->rmsnorm(e->ops, e->w.layers[L].ffn_norm, x, M, D, e->norm_eps, xn);
        predict_layer(e, b, L, xn);
    }
    ds41__frame_release(e, f);
}

int ds41_expert_predict_parse(const char *s) {
    static const char *const names[] = {"default", "next", "early", "both"};
    for (int i = 0; s && i < 4; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

const char *ds41_expert_predict_name(ds41_expert_predict p) {
    switch (p) {
    case DS41_XPREDICT_NEXT: return "next";
    case DS41_XPREDICT_BOTH: return "both";
    case DS41_XPREDICT_DEFAULT:
    case DS41_XPREDICT_EARLY: break;
    }
    return "early";
}

int ds41__moe(ds41_engine *e, fwd_batch *b, int L, const float *xn, float *out, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_role *role = &c->roles[L];
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t M = b->M, D = (size_t)c->dim, I = (size_t)c->moe_inter_dim;
    const size_t SI = I * (size_t)c->n_shared_experts;
    const int E = (int)role->n_experts, k = (int)role->n_active_experts;
    const size_t total = M * (size_t)k; /* routed (token, expert) pairs */
    const size_t hid = SI > I ? SI : I;
    int rc = 0;

    /* Activations and the router's outputs in backend memory; the choices
     * downloaded (they decide which experts to read and compute), the
     * gather's indices and the expert lists on the host. */
    const fwd_frame f = ds41__frame(e);
    float *logits = ds41__dev(e, M * (size_t)E * sizeof *logits);
    int32_t *dsel = ds41__dev(e, M * (size_t)k * sizeof *dsel);
    float *wts = ds41__dev(e, M * (size_t)k * sizeof *wts);
    int32_t *sel = ds41__host(e, M * (size_t)k * sizeof *sel);
    size_t *fill = ds41__host(e, M * sizeof *fill);
    size_t *count = ds41__host(e, (size_t)E * sizeof *count);
    size_t *first = ds41__host(e, (size_t)E * sizeof *first);
    uint32_t *src_row = ds41__host(e, total * sizeof *src_row); /* the token row of each gathered row */
    uint32_t *src_wt = ds41__host(e, total * sizeof *src_wt);   /* its routing weight in wts */
    /* Every expert's rows gathered one after the other (expert order), then
     * the shared expert's M rows. */
    float *xe = ds41__dev(e, total * D * sizeof *xe);
    float *route = ds41__dev(e, total * sizeof *route);
    uint32_t *tslot = ds41__host(e, total * sizeof *tslot); /* [M][k] each token's slots, increasing id */
    float *g = ds41__dev(e, (total + M) * hid * sizeof *g);
    float *u = ds41__dev(e, (total + M) * hid * sizeof *u);
    float *h = ds41__dev(e, (total + M) * hid * sizeof *h);
    float *oe = ds41__dev(e, (total + M) * D * sizeof *oe);
    const size_t nl = 2 * ((size_t)E + 1);
    const ds41_linear **lin = ds41__host(e, nl * sizeof *lin);
    const float **lx = ds41__host(e, nl * sizeof *lx);
    float **ly = ds41__host(e, nl * sizeof *ly);
    size_t *lm = ds41__host(e, nl * sizeof *lm);
    int32_t *pending = ds41__host(e, ((size_t)E + 1) * sizeof *pending);
    uint8_t *got = ds41__host(e, (size_t)E + 1);
    uint8_t *done = ds41__host(e, (size_t)E + 1);
    int32_t *group = ds41__host(e, ((size_t)E + 1) * sizeof *group);
    ds41_expert_view *views = ds41__host(e, ((size_t)E + 1) * sizeof *views);
    ds41_linear *xl = ds41__host(e, ((size_t)E + 1) * 3 * sizeof *xl);
    if (!pending || !got || !done || !group || !views || !xl || !logits || !dsel || !sel || !wts || !fill ||
        !count || !first || !src_row || !src_wt || !xe || !route || !tslot || !g || !u || !h || !oe || !lin ||
        !lx || !ly || !lm) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }
    memset(count, 0, (size_t)E * sizeof *count);

    /* Router: fp32 matmul against the (exactly upcast) bf16 gate weight. */
    ops->linear(ops, &lw->gate, xn, M, logits, DS41_OUT_F32);
    /* The selection scores the router ranked (ops.h router) are wanted only
     * to report the decision; they overwrite the logits, read no more. */
    const bool report = b->hooks && b->hooks->decision;
    ops->router(ops, logits, lw->gate_bias, M, E, k, e->gate_temp, e->route_scale, dsel, wts,
                report ? logits : NULL);
    e->mem->download(e->mem, sel, dsel, M * (size_t)k * sizeof *sel);
    for (size_t i = 0; i < total; i++)
        if (sel[i] < 0 || sel[i] >= E) {
            rc = ds41_fail(err, "forward: layer %d: the router chose expert %d of %d", L, sel[i], E);
            goto out;
        }
    if (report) {
        float *hs = ds41__host(e, M * (size_t)E * sizeof *hs);
        if (!hs) {
            rc = ds41_fail(err, "forward: out of memory");
            goto out;
        }
        e->mem->download(e->mem, hs, logits, M * (size_t)E * sizeof *hs);
        for (size_t r = 0; r < M; r++)
            ds41__report_decision(b, DS41_DECISION_EXPERTS, L, r, sel + r * (size_t)k, (size_t)k, hs + r * (size_t)E,
                                  (size_t)E);
    }

    /* Gather: expert by expert in increasing id, its tokens in row order. */
    for (size_t i = 0; i < total; i++) count[sel[i]]++;
    for (int ex = 0, at = 0; ex < E; ex++) {
        first[ex] = (size_t)at;
        at += (int)count[ex];
    }
    {
        size_t n = 0;
        memset(fill, 0, M * sizeof *fill);
        for (int ex = 0; ex < E; ex++)
            for (size_t r = 0; r < M; r++)
                for (int j = 0; j < k; j++)
                    if (sel[r * (size_t)k + (size_t)j] == ex) {
                        tslot[r * (size_t)k + fill[r]++] = (uint32_t)n;
                        src_wt[n] = (uint32_t)(r * (size_t)k + (size_t)j);
                        src_row[n] = (uint32_t)r;
                        n++;
                    }
        ops->gather_rows(ops, route, wts, sizeof *wts, src_wt, n, sizeof *route);
        ops->gather_rows(ops, xe, xn, D * sizeof *xn, src_row, n, D * sizeof *xe);
    }
    const size_t sh = total; /* row offset of the shared expert in g/u/h/oe */

    /* The experts the batch routed to, in increasing id.  Resident (no
     * expert tier): one wave of all of them.  Streamed: the tier pins as
     * many as it has slots (all of them unless the budget is below this
     * layer's union) and the rest follow in further waves; each expert's
     * arithmetic is the same whatever shares its wave, so the results are
     * bit-identical to the resident path. */
    size_t n_pending = 0;
    for (int ex = 0; ex < E; ex++)
        if (count[ex]) pending[n_pending++] = ex;
    /* The expert tier holds the text layers' experts; a DSpark stage's are
     * used in place from the mapping. */
    ds41_expert_cache *xc = L < (int)c->n_layers ? e->xc : NULL;
    const expert_work wk = {.e = e, .lw = lw, .M = M, .D = D, .I = I, .SI = SI, .hid = hid, .sh = sh,
                            .xn = xn, .count = count, .first = first, .xe = xe, .route = route,
                            .g = g, .u = u, .h = h, .oe = oe, .lin = lin, .lx = lx, .ly = ly, .lm = lm,
                            .xl = xc ? xl : NULL};
    if (!xc || !n_pending) {
        run_experts(&wk, pending, n_pending, true);
        goto combine;
    }
    bool first_wave = true;
    do {
        const long pinned = ds41_expert_cache_acquire(xc, L, pending, n_pending, got, err);
        if (pinned < 0) {
            rc = ds41_error_prefix(err, "layer %d", L);
            goto out;
        }
        /* While this layer's reads are in flight: guess the next layer's
         * experts and start their reads (only when this layer fits the pool:
         * with waves there is no room to spare). */
        if (first_wave && e->expert_predict_next && (size_t)pinned == n_pending) predict_next(e, b, L, xn);
        const bool last_wave = (size_t)pinned == n_pending; /* the shared expert rides with the last wave */
        /* Compute as the reads complete: first the shared expert with the
         * experts already loaded (hits), then each group that has arrived
         * since, so the arithmetic overlaps the reads still in flight. */
        memset(done, 0, n_pending);
        bool shared_left = last_wave;
        for (size_t n_done = 0; n_done < (size_t)pinned || shared_left;) {
            const long arrived = n_done < (size_t)pinned
                               ? ds41_expert_cache_wait_some(xc, L, pending, n_pending, got, done, shared_left ? 0 : 1,
                                                             views, err)
                               : 0;
            if (arrived < 0) {
                ds41_expert_cache_release(xc, L, pending, n_pending, got);
                rc = ds41_error_prefix(err, "layer %d", L);
                goto out;
            }
            size_t n_group = 0;
            for (size_t i = 0; i < n_pending; i++) {
                if (!done[i] || done[i] == 2) continue;
                done[i] = 2; /* computed */
                const int ex = pending[i];
                const ds41_linear *src[3] = {&lw->w1[ex], &lw->w2[ex], &lw->w3[ex]};
                for (int w = 0; w < 3; w++) {
                    xl[(size_t)ex * 3 + (size_t)w] = *src[w];
                    xl[(size_t)ex * 3 + (size_t)w].q = views[i].w[w];
                    xl[(size_t)ex * 3 + (size_t)w].scale = views[i].s[w];
                }
                group[n_group++] = ex;
            }
            run_experts(&wk, group, n_group, shared_left);
            shared_left = false;
            n_done += n_group;
        }
        ds41_expert_cache_release(xc, L, pending, n_pending, got);
        size_t keep = 0;
        for (size_t i = 0; i < n_pending; i++)
            if (!got[i]) pending[keep++] = pending[i];
        n_pending = keep;
        first_wave = false;
    } while (n_pending > 0);

combine:
    ops->moe_combine(ops, oe, tslot, (size_t)k, oe + total * D, M, D, out);
out:
    ds41__frame_release(e, f);
    return rc;
}
