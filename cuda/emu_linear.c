/* Host emulation of the linear kernels (cuda/k_linear.cu): the same launch
 * descriptors, the act_quant kernel's work items, and per output the warp's
 * 32 lane partials and combine tree of cuda/num_linear.h, so the values are
 * the kernels' bit for bit. */
#include "cuda/op_linear.h"

#include "cuda/emu_enter.h"
#define DS41_LIN_EMU_ENTER(c) ds41_cuda_emu_enter(c)

#include <stdio.h>
#include <stdlib.h>

/* On the fake device every byte an emulated kernel touches must be device
 * memory (cuda/emu_enter.h). */

int ds41_cuda_lin_descs(ds41_cuda_ctx *c, size_t n, const ds41_linear *const *ws, const float *const *xs,
                        const size_t *Ms, float *const *ys, ds41_linear_out out, ds41_lin_desc *d,
                        int64_t *max_n, int64_t *max_items) {
    const int exact = out == DS41_OUT_BF16_EXACT || out == DS41_OUT_F32_EXACT;
    size_t act_total = 0;
    int any = 0;
    *max_n = 0;
    *max_items = 0;
    c->stats.op_calls++;
    for (size_t i = 0; i < n; i++) {
        const ds41_linear *w = ws[i];
        ds41_lin_desc *e = &d[i];
        *e = (ds41_lin_desc){.x = xs[i],
                             .y = ys[i],
                             .n = w->n,
                             .k = w->k,
                             .M = (int64_t)Ms[i],
                             .exact = exact,
                             .out_bf16 = ds41_linear_out_bf16(out)};
        if (Ms[i] == 0 || w->n == 0) {
            e->M = 0;
            continue;
        }
        any = 1;
        if (e->n > *max_n) *max_n = e->n;
        const uint64_t N = (uint64_t)w->n, K = (uint64_t)w->k;
        if (w->kind == DS41_LINEAR_NONE || K == 0) {
            /* No products: every output is +0, as the reference's empty sums. */
            e->kind = DS41_LIN_KIND_BF16;
            e->k = 0;
            continue;
        }
        /* Counted as the fast CPU backend counts them: every weight byte once per call. */
        c->stats.flops += 2 * (uint64_t)Ms[i] * N * K;
        if (w->kind == DS41_LINEAR_BF16) {
            e->kind = DS41_LIN_KIND_BF16;
            e->bf16 = ds41_cuda_weight(c, w->bf16, N * K * 2);
            c->stats.weight_bytes += N * K * 2;
            continue;
        }
        const int fp4 = w->kind == DS41_LINEAR_FP4;
        e->kind = fp4 ? DS41_LIN_KIND_FP4 : DS41_LIN_KIND_FP8;
        e->out_bf16 = 1; /* FP8 / FP4 outputs are bf16 (the reference) */
        e->scale_cols = w->scale_cols;
        const size_t qbytes = N * (size_t)ds41_lin_row_bytes(e->kind, (int64_t)K);
        const size_t sbytes = (fp4 ? N : (N + 31) / 32) * (size_t)w->scale_cols;
        e->q = ds41_cuda_weight(c, w->q, qbytes);
        e->scale = ds41_cuda_weight(c, w->scale, sbytes);
        c->stats.weight_bytes += qbytes + sbytes;
        const int64_t nkb = ds41_lin_nkb((int64_t)K);
        if (e->M * nkb > *max_items) *max_items = e->M * nkb;
        act_total += ((size_t)e->M * (size_t)(ds41_lin_kp((int64_t)K) + nkb) + 255) & ~(size_t)255;
    }
    if (act_total) {
        uint8_t *act = ds41_cuda_scratch(c, act_total);
        for (size_t i = 0; i < n; i++) {
            ds41_lin_desc *e = &d[i];
            if (e->M == 0 || e->kind == DS41_LIN_KIND_BF16) continue;
            e->act = act;
            act += ((size_t)e->M * (size_t)(ds41_lin_kp(e->k) + ds41_lin_nkb(e->k)) + 255) & ~(size_t)255;
        }
    }
    return any;
}

/* y[m][n] of a quantized linear as the warp computes it. */
static float emu_quant(const ds41_lin_desc *d, int64_t m, int64_t n) {
    const int64_t K = d->k, nkb = ds41_lin_nkb(K), kp = ds41_lin_kp(K);
    const int fp4 = d->kind == DS41_LIN_KIND_FP4;
    const uint8_t *acodes = d->act + m * kp, *ascale = d->act + d->M * kp + m * nkb;
    if (d->exact) {
        /* The lanes' block values t in block order (the kernel's __shfl_sync walk). */
        float acc = 0.0f;
        for (int64_t kb = 0; kb < nkb; kb++) {
            const int len = ds41_lin_len(K, kb * DS41_LIN_QBLOCK, DS41_LIN_QBLOCK);
            const double b =
                ds41_lin_q_block_f64(ds41_lin_wblock(d, n, kb), fp4, acodes + kb * DS41_LIN_QBLOCK, len);
            acc = ds41_lin_add(acc, ds41_lin_q_scaled((float)b, ascale[kb], ds41_lin_wscale(d, n, kb)));
        }
        return ds41_hd_bf16_round(acc);
    }
    float v[DS41_LIN_LANES];
    for (int l = 0; l < DS41_LIN_LANES; l++) {
        float acc = 0.0f;
        for (int64_t kb = l; kb < nkb; kb += DS41_LIN_LANES) {
            const int len = ds41_lin_len(K, kb * DS41_LIN_QBLOCK, DS41_LIN_QBLOCK);
            const float b =
                ds41_lin_q_block(ds41_lin_wblock(d, n, kb), fp4, acodes + kb * DS41_LIN_QBLOCK, len);
            acc = ds41_lin_q_step(acc, b, ascale[kb], ds41_lin_wscale(d, n, kb));
        }
        v[l] = acc;
    }
    return ds41_hd_bf16_round(ds41_lin_tree_f32(v));
}

/* y[m][n] of a BF16 linear as the warp computes it. */
static float emu_bf16(const ds41_lin_desc *d, int64_t m, int64_t n) {
    const int64_t K = d->k, nc = (K + DS41_LIN_BF16_CHUNK - 1) / DS41_LIN_BF16_CHUNK;
    const float *x = d->x + m * K;
    const uint16_t *w = d->bf16 + n * K;
    if (d->exact) {
        double s[DS41_LIN_LANES], a[DS41_LIN_LANES];
        for (int l = 0; l < DS41_LIN_LANES; l++) {
            s[l] = a[l] = 0.0;
            for (int64_t ch = l; ch < nc; ch += DS41_LIN_LANES) {
                const int64_t k0 = ch * DS41_LIN_BF16_CHUNK;
                ds41_lin_bf16_chunk_f64(&s[l], &a[l], x + k0, w + k0,
                                        ds41_lin_len(K, k0, DS41_LIN_BF16_CHUNK));
            }
        }
        float r;
        if (!ds41_lin_fast_round(ds41_lin_tree_f64(s), ds41_lin_tree_f64(a), K, &r))
            r = ds41_lin_xdot_bf16(x, w, K);
        return ds41_lin_out(r, d->out_bf16);
    }
    float v[DS41_LIN_LANES];
    for (int l = 0; l < DS41_LIN_LANES; l++) {
        float acc = 0.0f;
        for (int64_t ch = l; ch < nc; ch += DS41_LIN_LANES) {
            const int64_t k0 = ch * DS41_LIN_BF16_CHUNK;
            acc = ds41_lin_bf16_chunk(acc, x + k0, w + k0, ds41_lin_len(K, k0, DS41_LIN_BF16_CHUNK));
        }
        v[l] = acc;
    }
    return ds41_lin_out(ds41_lin_tree_f32(v), d->out_bf16);
}

/* The two kernels of a call, in stream order: act_quant items, then every
 * output of every linear. */
static void emu_run(const ds41_cuda_ctx *c, const ds41_lin_desc *dd, size_t n) {
    ds41_cuda_emu_check(c, dd, n * sizeof *dd, "descriptors");
    for (size_t i = 0; i < n; i++) {
        const ds41_lin_desc *d = &dd[i];
        if (d->M == 0) continue;
        const size_t M = (size_t)d->M, N = (size_t)d->n, K = (size_t)d->k;
        ds41_cuda_emu_check(c, d->x, M * K * sizeof(float), "x");
        ds41_cuda_emu_check(c, d->y, M * N * sizeof(float), "y");
        if (K == 0) continue;
        if (d->kind == DS41_LIN_KIND_BF16) {
            ds41_cuda_emu_check(c, d->bf16, N * K * 2, "bf16 weight");
            continue;
        }
        const int fp4 = d->kind == DS41_LIN_KIND_FP4;
        ds41_cuda_emu_check(c, d->q, N * (size_t)ds41_lin_row_bytes(d->kind, d->k), "weight codes");
        ds41_cuda_emu_check(c, d->scale, (fp4 ? N : (N + 31) / 32) * (size_t)d->scale_cols, "weight scales");
        ds41_cuda_emu_check(c, d->act, M * (size_t)(ds41_lin_kp(d->k) + ds41_lin_nkb(d->k)),
                            "activation scratch");
    }
    for (size_t i = 0; i < n; i++) {
        const ds41_lin_desc *d = &dd[i];
        if (d->M == 0 || d->kind == DS41_LIN_KIND_BF16) continue;
        const int64_t nkb = ds41_lin_nkb(d->k);
        for (int64_t it = 0; it < d->M * nkb; it++) ds41_lin_act_item(d, it / nkb, it % nkb);
    }
    for (size_t i = 0; i < n; i++) {
        const ds41_lin_desc *d = &dd[i];
        for (int64_t m = 0; m < d->M; m++)
            for (int64_t col = 0; col < d->n; col++)
                d->y[m * d->n + col] =
                    d->kind == DS41_LIN_KIND_BF16 ? emu_bf16(d, m, col) : emu_quant(d, m, col);
    }
}

void ds41_cuda_emu_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                                const float *const *xs, const size_t *Ms, float *const *ys,
                                ds41_linear_out out) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    DS41_LIN_EMU_ENTER(c);
    ds41_lin_desc local[16];
    ds41_lin_desc *d = n <= 16 ? local : malloc(n * sizeof *d);
    if (!d) abort(); /* ops cannot fail (engine/backend/ops.h) */
    int64_t max_n, max_items;
    if (ds41_cuda_lin_descs(c, n, ws, xs, Ms, ys, out, d, &max_n, &max_items))
        emu_run(c, ds41_cuda_meta(c, d, n * sizeof *d), n);
    if (d != local) free(d);
}

void ds41_cuda_emu_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                          ds41_linear_out out) {
    ds41_cuda_emu_linear_batch(self, 1, &w, &x, &M, &y, out);
}
