/* MoE sub-layer (REFERENCE.md §2.6 Gate/Expert/MoE, §9.2, §10.4): the
 * sqrt-softplus router with selection-only bias, FP4 routed experts with the
 * routing weight applied before w2, the FP8 shared expert, and the fp32
 * combine in increasing expert id then the shared expert. */
#include "engine/forward_internal.h"

#include "engine/quant.h"

#include <stdlib.h>
#include <string.h>

int ds41__moe(ds41_engine *e, fwd_batch *b, int L, const float *xn, float *out, ds41_error *err) {
    const ds41_model_config *c = &e->cfg;
    const ds41_layer_role *role = &c->roles[L];
    const ds41_layer_weights *lw = &e->w.layers[L];
    const ds41_ops *ops = e->ops;
    const size_t M = b->M, D = (size_t)c->dim, I = (size_t)c->moe_inter_dim;
    const size_t SI = I * (size_t)c->n_shared_experts;
    const int E = (int)role->n_experts, k = (int)role->n_active_experts;
    int rc = 0;

    float *logits = malloc(M * (size_t)E * sizeof *logits);
    int32_t *sel = malloc(M * (size_t)k * sizeof *sel);
    float *wts = malloc(M * (size_t)k * sizeof *wts);
    float *y = malloc(M * D * sizeof *y);
    float *xe = malloc(M * D * sizeof *xe);
    float *route = malloc(M * sizeof *route);
    size_t *rows = malloc(M * sizeof *rows);
    size_t hid = SI > I ? SI : I;
    float *g = malloc(M * hid * sizeof *g);
    float *u = malloc(M * hid * sizeof *u);
    float *h = malloc(M * hid * sizeof *h);
    float *oe = malloc(M * D * sizeof *oe);
    if (!logits || !sel || !wts || !y || !xe || !route || !rows || !g || !u || !h || !oe) {
        rc = ds41_fail(err, "forward: out of memory");
        goto out;
    }

    /* Router: fp32 matmul against the (exactly upcast) bf16 gate weight. */
    ops->linear(ops, &lw->gate, xn, M, logits, DS41_OUT_F32);
    if (e->gate_temp != 1.0f)
        for (size_t i = 0; i < M * (size_t)E; i++) logits[i] = logits[i] / e->gate_temp;
    ops->router(ops, logits, lw->gate_bias, M, E, k, e->route_scale, sel, wts);

    for (size_t i = 0; i < M * D; i++) y[i] = 0.0f;
    for (int ex = 0; ex < E; ex++) {
        size_t n = 0;
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < k; j++)
                if (sel[r * (size_t)k + (size_t)j] == ex) {
                    rows[n] = r;
                    route[n] = wts[r * (size_t)k + (size_t)j];
                    memcpy(xe + n * D, xn + r * D, D * sizeof *xe);
                    n++;
                }
        if (n == 0) continue;
        ops->linear(ops, &lw->w1[ex], xe, n, g, DS41_OUT_BF16);
        ops->linear(ops, &lw->w3[ex], xe, n, u, DS41_OUT_BF16);
        ops->swiglu(ops, g, u, n, I, e->swiglu_limit, route, h);
        ops->linear(ops, &lw->w2[ex], h, n, oe, DS41_OUT_BF16);
        for (size_t i = 0; i < n; i++) {
            float *yr = y + rows[i] * D;
            for (size_t d = 0; d < D; d++) yr[d] = yr[d] + oe[i * D + d];
        }
    }
    ops->linear(ops, &lw->sh_w1, xn, M, g, DS41_OUT_BF16);
    ops->linear(ops, &lw->sh_w3, xn, M, u, DS41_OUT_BF16);
    ops->swiglu(ops, g, u, M, SI, e->swiglu_limit, NULL, h);
    ops->linear(ops, &lw->sh_w2, h, M, oe, DS41_OUT_BF16);
    for (size_t i = 0; i < M * D; i++) out[i] = ds41_bf16_round(y[i] + oe[i]);
out:
    free(logits);
    free(sel);
    free(wts);
    free(y);
    free(xe);
    free(route);
    free(rows);
    free(g);
    free(u);
    free(h);
    free(oe);
    return rc;
}
