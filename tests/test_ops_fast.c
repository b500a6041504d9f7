/* The fast CPU backend's kernels (engine/backend/cpu/fast_kernels.h), at every SIMD level
 * this machine has (amx, avx512, avx2, scalar), on random inputs of awkward
 * sizes (one row, one column, K not a multiple of the vector width or of the
 * 32-blocks where the format allows):
 *  - each level against the exact reference op within the error bound of fp32
 *    accumulation (plus one bf16 ulp where the output is rounded), and each
 *    SIMD level against the scalar level with the same bound;
 *  - activation quantization bit for bit (identity weights isolate every
 *    quantized value, including RNE ties, the subnormal grid, saturation,
 *    blocks with NaN and infinity, partial blocks);
 *  - batch invariance: M rows at once = each row alone, bit for bit, and one
 *    thread = two threads, bit for bit;
 *  - the exact linears (DS41_OUT_*_EXACT) = the reference bit for bit;
 *  - the other ops (norms, hc mixes, attention, index scores, SwiGLU, Engram,
 *    gathers) against the reference within their rounding. */
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/cpu/fast_kernels.h"
#include "engine/backend/ops.h"
#include "engine/backend/refmath.h"
#include "engine/model/quant.h"
#include "tests/attn_step.h"
#include "tests/index_pages.h"
#include "tests/linear_data.h"
#include "tests/op_bounds.h"
#include "tests/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Levels this machine runs, highest first, and a backend for each. */
static int n_levels;
static ds41_cpu_level levels[4];
static ds41_backend *backends[4];
static ds41_backend *single_thread[4];

static const ds41_ops *ops_of(int i) {
    return &backends[i]->ops;
}

/* ---- linear ---------------------------------------------------------------------------- */

typedef struct lin_case {
    ds41_linear_kind kind;
    size_t M, N, K;
    ds41_linear_out out;
} lin_case;

static void make_linear(const lin_case *c, lin_data *d) {
    lin_data_make(c->kind, c->M, c->N, c->K, urand, d);
}

static void free_linear(lin_data *d) {
    lin_data_free(d);
}

static void test_linear_case(const lin_case *c) {
    lin_data d;
    make_linear(c, &d);
    const size_t M = c->M, N = c->N, K = c->K;
    const int bf = c->out == DS41_OUT_BF16;
    float *ref = malloc(M * N * sizeof *ref), *scalar = malloc(M * N * sizeof *scalar);
    float *y = malloc(M * N * sizeof *y), *row = malloc(N * sizeof *row);
    double *mag = malloc(M * N * sizeof *mag);
    linear_magnitudes(d.xq, d.wd, M, N, K, mag);
    ds41_ops_reference.linear(&ds41_ops_reference, &d.w, d.x, M, ref, c->out);
    const char *kn = c->kind == DS41_LINEAR_FP8 ? "FP8" : c->kind == DS41_LINEAR_FP4 ? "FP4" : "BF16";
    for (int li = n_levels - 1; li >= 0; li--) {
        const ds41_ops *ops = ops_of(li);
        ops->linear(ops, &d.w, d.x, M, y, c->out);
        int ok_ref = 1, ok_scalar = 1, inv = 1, threads = 1;
        size_t bad = 0;
        for (size_t i = 0; i < M * N; i++) {
            if (!within(y[i], ref[i], mag[i], K, bf)) {
                if (ok_ref) bad = i;
                ok_ref = 0;
            }
            if (li < n_levels - 1) ok_scalar &= within(y[i], scalar[i], mag[i], K, bf);
        }
        /* Row by row = all rows at once, bit for bit. */
        for (size_t m = 0; m < M && inv; m++) {
            ops->linear(ops, &d.w, d.x + m * K, 1, row, c->out);
            inv = memcmp(row, y + m * N, N * sizeof *row) == 0;
        }
        /* One thread = two threads. */
        const ds41_ops *one = &single_thread[li]->ops;
        float *y1 = malloc(M * N * sizeof *y1);
        one->linear(one, &d.w, d.x, M, y1, c->out);
        threads = memcmp(y1, y, M * N * sizeof *y) == 0;
        free(y1);
        if (li == n_levels - 1) memcpy(scalar, y, M * N * sizeof *y);
        TAP_CHECK(ok_ref && ok_scalar && inv && threads,
                  "%s linear %s M=%zu N=%zu K=%zu%s: = reference and = scalar within fp32 accumulation%s, "
                  "rows alone = "
                  "batched, 1 thread = 2 threads bit for bit",
                  ds41_cpu_level_name(levels[li]), kn, M, N, K, bf ? "" : " (fp32 out)",
                  bf ? " + 1 bf16 ulp" : "");
        if (!ok_ref)
            TAP_NOTE("element %zu: got %.9g, reference %.9g, magnitude sum %.3g", bad, (double)y[bad],
                     (double)ref[bad], mag[bad]);
        if (!inv) TAP_NOTE("rows computed alone differ from the batch");
        if (!threads) TAP_NOTE("thread counts differ");
    }
    free(ref);
    free(scalar);
    free(y);
    free(row);
    free(mag);
    free_linear(&d);
}

/* Identity FP8 weights (1.0, scale 2^0) isolate every quantized activation:
 * y[m][n] = act_quant QDQ value of x[m][n], exactly. */
static void test_act_quant(void) {
    enum { K = 200, M = 5 };
    static uint8_t q[K * K], sc[((K + 31) / 32) * ((K + 31) / 32)];
    static float x[M * K], want[M * K], y[M * K];
    memset(q, 0, sizeof q);
    for (int i = 0; i < K; i++) q[i * K + i] = 0x38; /* e4m3 1.0 */
    memset(sc, 127, sizeof sc);
    ds41_linear w = {
        .kind = DS41_LINEAR_FP8, .n = K, .k = K, .q = q, .scale = sc, .scale_cols = (K + 31) / 32};
    /* Row 0: ties and boundaries relative to a block amax of 448 * 2^k. */
    for (int i = 0; i < K; i++) {
        const int blk = i / 32, j = i % 32;
        const float s = ldexpf(1.0f, blk - 3); /* block scale 2^(blk-3) once amax = 448 s */
        float v;
        switch (j) {
        case 0:
            v = 448.0f * s;
            break; /* the amax */
        case 1:
            v = -1.0625f * s;
            break; /* tie between 1.0 and 1.125: to even 1.0 */
        case 2:
            v = 1.1875f * s;
            break; /* tie 1.125 / 1.25: to even 1.25 */
        case 3:
            v = ldexpf(1.0f, -10) * s;
            break; /* exactly half the subnormal step: 0 */
        case 4:
            v = ldexpf(3.0f, -10) * s;
            break; /* 1.5 steps: to even 2 steps */
        case 5:
            v = -ldexpf(1.0f, -10) * s;
            break; /* -0 */
        case 6:
            v = ldexpf(15.0f, -10) * s;
            break; /* 7.5 steps: to 8 = 2^-6, the min normal */
        case 7:
            v = 0.0f;
            break;
        case 8:
            v = -0.0f;
            break;
        default:
            v = (float)(urand() * 300.0) * s;
            break;
        }
        x[i] = bfr(v);
    }
    /* Row 1: a zero block (amax floor), tiny values, and a partial last
     * block (K = 200). */
    for (int i = 0; i < K; i++) {
        float v = bfr(urand() * 3.0);
        if (i / 32 == 3) v = 0.0f;
        if (i / 32 == 4) v = bfr(urand() * 1e-6);
        x[K + i] = v;
    }
    /* Row 2: huge values (scales near the top of the range). */
    for (int i = 0; i < K; i++) x[2 * K + i] = bfr(urand() * 3e37);
    /* Rows 3 and 4: a NaN, an infinity: the block's scale is NaN, and the
     * products spread NaN to the whole row, in the reference as here. */
    for (int i = 0; i < K; i++) x[3 * K + i] = x[4 * K + i] = bfr(urand());
    x[3 * K + 37] = NAN;
    x[4 * K + 70] = -INFINITY;
    memcpy(want, x, sizeof x);
    for (int m = 0; m < 3; m++) ds41_act_quant_qdq(want + m * K, K);
    for (int i = 3 * K; i < M * K; i++) want[i] = NAN;
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        ops->linear(ops, &w, x, M, y, DS41_OUT_BF16);
        int ok = 1, first = -1;
        for (int i = 0; i < M * K; i++) {
            const int same = (isnan(y[i]) && isnan(want[i])) || y[i] == want[i];
            if (!same && first < 0) first = i;
            ok &= same;
        }
        TAP_CHECK(
            ok,
            "%s: activations quantized exactly as ds41_act_quant (RNE ties, subnormal grid, NaN/inf/zero "
            "blocks, huge scales, a partial block)",
            ds41_cpu_level_name(levels[li]));
        if (!ok)
            TAP_NOTE("index %d: x %.9g got %.9g want %.9g", first, (double)x[first], (double)y[first],
                     (double)want[first]);
    }
}

static void test_linears(void) {
    const lin_case cases[] = {
        {DS41_LINEAR_FP8, 1, 1, 32, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 1, 33, 96, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 3, 70, 160, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 17, 40, 40, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 40, 65, 100, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 130, 33, 64, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 1, 1, 32, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 2, 31, 64, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 5, 65, 96, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 33, 17, 50, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 131, 40, 128, DS41_OUT_BF16},
        {DS41_LINEAR_BF16, 1, 1, 1, DS41_OUT_BF16},
        {DS41_LINEAR_BF16, 1, 7, 33, DS41_OUT_F32},
        {DS41_LINEAR_BF16, 3, 40, 100, DS41_OUT_BF16},
        {DS41_LINEAR_BF16, 17, 65, 64, DS41_OUT_F32},
        {DS41_LINEAR_BF16, 35, 32, 96, DS41_OUT_BF16},
        {DS41_LINEAR_BF16, 130, 20, 31, DS41_OUT_F32},
        /* K over several AMX slabs, 2..15 rows (the narrow activation tiles) */
        {DS41_LINEAR_FP8, 15, 33, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 7, 40, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 1, 64, 2048, DS41_OUT_BF16},
        {DS41_LINEAR_BF16, 9, 40, 1056, DS41_OUT_F32},
        /* 2..4 rows over K of several 256-value slabs with a partial block: the
         * fused decode + dot tiles (AVX-512 up to 8 rows, AVX2 up to 2) */
        {DS41_LINEAR_FP8, 2, 70, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 4, 37, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 3, 37, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 4, 70, 1100, DS41_OUT_BF16},
        /* 5..8 rows: AVX-512's fused tiles past the rows whose activations
         * stay in registers (a speculative step's token + drafts) */
        {DS41_LINEAR_FP8, 6, 37, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 8, 70, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 5, 37, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP4, 8, 70, 1100, DS41_OUT_BF16},
        /* 9..16 rows: the fused tiles on row blocks of at most 8 */
        {DS41_LINEAR_FP4, 12, 37, 1100, DS41_OUT_BF16},
        {DS41_LINEAR_FP8, 16, 70, 1100, DS41_OUT_BF16},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_linear_case(&cases[i]);
}

/* ---- the other ops ------------------------------------------------------------------- */

static void test_norms_and_hc(void) {
    enum { M = 5, D = 200, hc = 4 };
    static float x[M * D], y[M * D], yr[M * D], h[M * hc * D], fn[24 * hc * D];
    static uint16_t w[D];
    fill_bf16(x, M * D, 3.0);
    for (int i = 0; i < D; i++) w[i] = ds41_bf16_bits((float)(1.0 + 0.5 * urand()));
    ds41_ops_reference.rmsnorm(&ds41_ops_reference, w, x, M, D, 1e-20f, yr);
    fill_bf16(h, M * hc * D, 1.0);
    for (int i = 0; i < 24 * hc * D; i++) fn[i] = (float)(urand() * 0.05);
    const float scale[3] = {0.5f, 0.7f, 0.9f};
    float base[24];
    for (int i = 0; i < 24; i++) base[i] = (float)(urand() * 0.5);
    static float pre[M * hc], post[M * hc], comb[M * hc * hc], pre_r[M * hc], post_r[M * hc],
        comb_r[M * hc * hc];
    ds41_ops_reference.hc_mix(&ds41_ops_reference, fn, scale, base, h, M, hc, D, 1e-20f, 20, 1e-6f, pre_r,
                              post_r, comb_r);
    static float hp[M * D], hp_r[M * D], o[M * D], ho[M * hc * D], ho_r[M * hc * D];
    fill_bf16(o, M * D, 1.0);
    ds41_ops_reference.hc_pre(&ds41_ops_reference, h, pre_r, M, hc, D, hp_r);
    ds41_ops_reference.hc_post(&ds41_ops_reference, o, h, post_r, comb_r, M, hc, D, ho_r);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        const char *ln = ds41_cpu_level_name(levels[li]);
        double e1 = 0, e2 = 0, e3 = 0;
        ops->rmsnorm(ops, w, x, M, D, 1e-20f, y);
        int inv = 1;
        for (int m = 0; m < M; m++) {
            float one[D];
            ops->rmsnorm(ops, w, x + m * D, 1, D, 1e-20f, one);
            inv &= memcmp(one, y + m * D, sizeof one) == 0;
        }
        TAP_CHECK(rel_close(y, yr, M * D, 2 * 0x1p-8, &e1) && inv,
                  "%s rmsnorm (D %d): within a bf16 ulp of the reference (%.2g), rows alone = batched", ln, D,
                  e1);
        ops->hc_mix(ops, fn, scale, base, h, M, hc, D, 1e-20f, 20, 1e-6f, pre, post, comb);
        const int ok_mix = rel_close(pre, pre_r, M * hc, 1e-5, &e1) &&
                           rel_close(post, post_r, M * hc, 1e-5, &e2) &&
                           rel_close(comb, comb_r, M * hc * hc, 1e-4, &e3);
        float pre1[hc], post1[hc], comb1[hc * hc];
        ops->hc_mix(ops, fn, scale, base, h + 2 * hc * D, 1, hc, D, 1e-20f, 20, 1e-6f, pre1, post1, comb1);
        inv = memcmp(pre1, pre + 2 * hc, sizeof pre1) == 0 &&
              memcmp(comb1, comb + 2 * hc * hc, sizeof comb1) == 0;
        TAP_CHECK(ok_mix && inv,
                  "%s hc_mix + Sinkhorn: fp32 close to the reference (%.2g %.2g %.2g), a row alone = batched",
                  ln, e1, e2, e3);
        ops->hc_pre(ops, h, pre_r, M, hc, D, hp);
        ops->hc_post(ops, o, h, post_r, comb_r, M, hc, D, ho);
        TAP_CHECK(memcmp(hp, hp_r, sizeof hp) == 0 && memcmp(ho, ho_r, sizeof ho) == 0,
                  "%s hc_pre / hc_post: the reference's short sums, bit for bit", ln);
    }
}

/* Rope and compressor pooling over a whole step: bit for bit the reference (the same
 * per-row arithmetic), rows at strides with gaps, an odd number of rows and groups. */
static void test_rope_and_pool(void) {
    enum { M = 5, H = 3, NP = 8, OFF = 3, HS = 2 * NP + OFF, RS = H * HS + 1, RATIO = 4, HD = 37, G = 5 };
    uint64_t pos[M];
    float freqs[NP], cs_r[M * 2 * NP], cs[M * 2 * NP];
    static float x[M * RS], xr[M * RS], x0[M * RS];
    static float kv[G * RATIO * HD], sc[G * RATIO * HD], pooled[G * HD], pooled_r[G * HD];
    for (int m = 0; m < M; m++) pos[m] = (uint64_t)(m * 977 + 3);
    for (int i = 0; i < NP; i++) freqs[i] = (float)pow(10000.0, -2.0 * i / (2.0 * NP));
    fill_bf16(x0, M * RS, 2.0);
    for (int i = 0; i < G * RATIO * HD; i++) {
        kv[i] = (float)urand();
        sc[i] = (float)(urand() * 8.0);
    }
    ds41_ops_reference.rope_table(&ds41_ops_reference, freqs, NP, pos, M, cs_r);
    ds41_ops_reference.compress_pool(&ds41_ops_reference, kv, sc, G, RATIO, HD, pooled_r);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        const char *ln = ds41_cpu_level_name(levels[li]);
        ops->rope_table(ops, freqs, NP, pos, M, cs);
        int ok = memcmp(cs, cs_r, sizeof cs) == 0;
        for (int inverse = 0; inverse < 2; inverse++) {
            memcpy(x, x0, sizeof x);
            memcpy(xr, x0, sizeof x);
            ds41_ops_reference.rope(&ds41_ops_reference, xr + OFF, M, H, RS, HS, NP, cs_r, inverse);
            ops->rope(ops, x + OFF, M, H, RS, HS, NP, cs_r, inverse);
            ok &= memcmp(x, xr, sizeof x) == 0;
        }
        TAP_CHECK(ok,
                  "%s rope_table + rope (%d rows x %d heads, forward and inverse): bit for bit the reference",
                  ln, M, H);
        memset(pooled, 0xff, sizeof pooled);
        ops->compress_pool(ops, kv, sc, G, RATIO, HD, pooled);
        TAP_CHECK(memcmp(pooled, pooled_r, sizeof pooled) == 0,
                  "%s compress_pool (%d groups of %d x %d): bit for bit the reference", ln, G, RATIO, HD);
    }
}

/* The step's activation quantizers: bit for bit the reference over 5 rows (N not a multiple of
 * 32, so a partial block per row), rows at a stride. */
static void test_step_quant(void) {
    enum { M = 5, N = 70, STRIDE = N + 3 + 2, QN = 96, WN = 5 };
    static float x[M * N], q[M * QN], w[M * WN], qr[M * QN], wr[M * WN];
    static uint8_t out[M * STRIDE], out_r[M * STRIDE];
    fill_bf16(x, M * N, 50.0);
    fill_bf16(qr, M * QN, 2.0);
    fill_bf16(wr, M * WN, 1.0);
    memset(out_r, 0x5a, sizeof out_r);
    ds41_ops_reference.act_quant_fp8(&ds41_ops_reference, x, M, N, out_r, STRIDE);
    static float q0[M * QN], w0[M * WN];
    memcpy(q0, qr, sizeof q0);
    memcpy(w0, wr, sizeof w0);
    ds41_ops_reference.index_query(&ds41_ops_reference, qr, QN, wr, WN, M, 0.0625f);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        memset(out, 0x5a, sizeof out);
        ops->act_quant_fp8(ops, x, M, N, out, STRIDE);
        memcpy(q, q0, sizeof q);
        memcpy(w, w0, sizeof w);
        ops->index_query(ops, q, QN, w, WN, M, 0.0625f);
        TAP_CHECK(memcmp(out, out_r, sizeof out) == 0 && memcmp(q, qr, sizeof q) == 0 &&
                      memcmp(w, wr, sizeof w) == 0,
                  "%s act_quant_fp8 and index_query of %d rows: bit for bit the reference",
                  ds41_cpu_level_name(levels[li]), M);
    }
}

static void test_attention(void) {
    ds41_kv_layout lay = {0};
    lay.latent_dim = 64;
    lay.index_dim = 32;
    lay.latent_bytes = 64 / 2 + 64 / 16;
    lay.index_bytes = 32 / 2 + 1;
    lay.entry_bytes = lay.latent_bytes + lay.index_bytes;
    lay.ring_row_bytes = 64 + 2;
    enum { H = 3, hd = 64, NW = 70, NC = 90 };
    static uint8_t wrow[NW][66], ent[NC][36 + 17];
    static float q[H * hd], out[H * hd], ref[H * hd];
    const uint8_t *wp[NW], *cp[NC];
    for (int j = 0; j < NW; j++) {
        float v[hd];
        fill_bf16(v, hd, 2.0);
        if (j == 5) v[3] = NAN; /* one NaN row: the output of every head is NaN in both */
        ds41_act_quant(v, hd, wrow[j], wrow[j] + hd);
        wp[j] = wrow[j];
    }
    for (int j = 0; j < NC; j++) {
        float v[hd], k[32];
        fill_bf16(v, hd, 2.0);
        fill_bf16(k, 32, 1.0);
        ds41_fp4_act_quant_e4m3(v, hd, ent[j], ent[j] + hd / 2);
        ds41_fp4_act_quant_ue8m0(k, 32, ent[j] + lay.latent_bytes, ent[j] + lay.latent_bytes + 16);
        cp[j] = ent[j];
    }
    fill_bf16(q, H * hd, 0.5);
    float sink[H] = {0.3f, -2.0f, 1.5f};
    const float scale = (float)pow(64.0, -0.5);
    /* Window rows without the NaN one, then everything with it. */
    const uint8_t *wp2[NW - 1];
    for (int j = 0, k = 0; j < NW; j++)
        if (j != 5) wp2[k++] = wp[j];
    ds41_attn_rows rows = {.layout = &lay, .n_window = NW - 1, .window = wp2, .n_comp = NC, .comp = cp};
    ds41_attn_rows with_nan = {.layout = &lay, .n_window = NW, .window = wp, .n_comp = 3, .comp = cp};
    ds41_attn_rows one = {.layout = &lay, .n_window = 0, .window = wp, .n_comp = 1, .comp = cp};
    ds41_ops_reference.sparse_attn(&ds41_ops_reference, q, H, hd, sink, scale, &rows, ref);
    /* Index scores of 4 rows over pages of 8 entries (a full reach, none, part, one entry). */
    enum { NH = 4, ID = 32, IM = 4, PER = 8, NP = (NC + PER - 1) / PER };
    static float iq[IM * NH * ID], iw[IM * NH], sc[IM * NC], sc_r[IM * NC];
    index_test_queries(iq, iw, IM, NH, ID, urand);
    const uint8_t *pages[NP];
    index_test_pages(&lay, ent[0], NC, PER, pages);
    const size_t row_table[IM] = {0, 0, 0, 0};
    const uint32_t reach[IM] = {NC, 0, 41, 1};
    const ds41_kv_pages keys = {.layout = &lay, .pages = pages, .row_table = row_table, .row_reach = reach};
    for (int i = 0; i < IM * NC; i++) sc_r[i] = 1234.0f;
    ds41_ops_reference.index_scores(&ds41_ops_reference, iq, iw, IM, NH, ID, &keys, sc_r, NC);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        const char *ln = ds41_cpu_level_name(levels[li]);
        double e = 0, worst = 0;
        ops->sparse_attn(ops, q, H, hd, sink, scale, &rows, out);
        int ok = 1;
        for (int h = 0; h < H; h++) {
            ok &= rel_close(out + h * hd, ref + h * hd, hd, 1e-2, &e);
            worst = fmax(worst, e);
        }
        TAP_CHECK(
            ok,
            "%s sparse attention over 159 rows (window + compressed, 3 chunks of 64): per head within 1e-2 "
            "of the reference (%.2g)",
            ln, worst);
        ops->sparse_attn(ops, q, H, hd, sink, scale, &with_nan, out);
        int all_nan = 1;
        for (int i = 0; i < H * hd; i++) all_nan &= isnan(out[i]);
        float r1[H * hd], f1[H * hd];
        const float low[H] = {-1e30f, -1e30f, -1e30f};
        ds41_ops_reference.sparse_attn(&ds41_ops_reference, q, H, hd, low, scale, &one, r1);
        ops->sparse_attn(ops, q, H, hd, low, scale, &one, f1);
        TAP_CHECK(
            all_nan && memcmp(r1, f1, sizeof r1) == 0,
            "%s attention: a NaN row makes every output NaN; one row and no sink mass give the row exactly",
            ln);
        for (int i = 0; i < IM * NC; i++) sc[i] = 1234.0f;
        ops->index_scores(ops, iq, iw, IM, NH, ID, &keys, sc, NC);
        int ok_idx = 1;
        for (int j = 0; j < IM * NC; j++)
            ok_idx &= fabsf(sc[j] - sc_r[j]) <= 2 * 0x1p-8 * fmaxf(fabsf(sc_r[j]), 1e-3f);
        TAP_CHECK(ok_idx,
                  "%s index scores of %d rows over paged keys: within the reference's bf16 roundings, "
                  "nothing past a row's reach",
                  ln, IM);
        static attn_step_case t;
        static float sq[ATTN_STEP_M * H * hd], so[ATTN_STEP_M * H * hd], sw[ATTN_STEP_M * H * hd];
        attn_step_case_init(&t, &lay, wrow[0], ent[0], NC);
        fill_bf16(sq, ATTN_STEP_M * H * hd, 0.5);
        TAP_CHECK(attn_step_check(ops, &t, sq, H, hd, sink, scale, so, sw),
                  "%s attend over a step of 2 sequences = sparse_attn row by row, bit for bit", ln);
        enum { NE = 5 };
        static float plat[NE * hd], pkey[NE * 32];
        static uint8_t pk[NE * (36 + 17)], pr[NE * (36 + 17)];
        fill_bf16(plat, NE * hd, 2.0);
        fill_bf16(pkey, NE * 32, 1.0);
        ds41_ops_reference.kv_pack(&ds41_ops_reference, &lay, plat, pkey, NE, pr);
        ops->kv_pack(ops, &lay, plat, pkey, NE, pk);
        TAP_CHECK(memcmp(pk, pr, sizeof pk) == 0, "%s kv_pack of %d entries: bit for bit the reference", ln,
                  NE);
    }
}

static void test_moe_engram_gathers(void) {
    enum { M = 4, I = 70, E = 12, K = 3 };
    static float g[M * I], u[M * I], hr[M * I], hf[M * I];
    fill_bf16(g, M * I, 6.0);
    fill_bf16(u, M * I, 12.0);
    const float route[M] = {0.5f, 1.25f, 0.75f, 0.1f};
    ds41_ops_reference.swiglu(&ds41_ops_reference, g, u, M, I, 10.0f, route, hr);
    float logits[M * E], bias[E], wr[M * K], wf[M * K];
    int32_t sr[M * K], sf[M * K];
    for (int i = 0; i < M * E; i++) logits[i] = (float)(urand() * 4);
    for (int i = 0; i < E; i++) bias[i] = (float)(urand() * 0.1);
    ds41_ops_reference.router(&ds41_ops_reference, logits, bias, M, E, K, 1.0f, 1.5f, sr, wr, NULL);
    enum { hc = 4, D = 48 };
    static float h[M * hc * D], h0[M * hc * D], href[M * hc * D], kv[M * (hc + 1) * D], wqk[hc * D];
    fill_bf16(h0, M * hc * D, 1.0);
    fill_bf16(kv, M * (hc + 1) * D, 1.0);
    for (int i = 0; i < hc * D; i++) wqk[i] = (float)(1.0 + 0.1 * urand());
    const float ds = (float)pow((double)D, -0.5);
    memcpy(href, h0, sizeof h0);
    ds41_ops_reference.engram_mix(&ds41_ops_reference, href, kv, wqk, M, hc, D, 1e-20f, ds);
    enum { V = 50, ED = 64 };
    static uint16_t table[V * ED];
    for (int i = 0; i < V * ED; i++) table[i] = ds41_bf16_bits((float)urand());
    const int32_t ids[M] = {0, 49, 7, 7};
    static float emb[M * hc * ED], emb_r[M * hc * ED];
    ds41_ops_reference.embed(&ds41_ops_reference, table, ids, M, hc, ED, emb_r);
    static uint8_t ft[V * ED], fs[V * ED / 32];
    for (int i = 0; i < V * ED; i++) ft[i] = (uint8_t)(urand() * 120 + 120);
    for (int i = 0; i < V * ED / 32; i++) fs[i] = (uint8_t)(120 + i % 9);
    const int64_t rows[5] = {3, 0, 49, 3, 17};
    static float fr[5 * ED], fr_r[5 * ED];
    ds41_ops_reference.fp8_rows(&ds41_ops_reference, ft, fs, rows, 5, ED, fr_r);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        const char *ln = ds41_cpu_level_name(levels[li]);
        ops->swiglu(ops, g, u, M, I, 10.0f, route, hf);
        double e = 0;
        int ok = 1;
        for (int i = 0; i < M * I; i++) ok &= fabsf(hf[i] - hr[i]) <= 0x1p-8 * fabsf(hr[i]) + 1e-30f;
        TAP_CHECK(ok, "%s swiglu: clamps, route weight, bf16 output within a bf16 ulp of the reference", ln);
        ops->router(ops, logits, bias, M, E, K, 1.0f, 1.5f, sf, wf, NULL);
        TAP_CHECK(memcmp(sr, sf, sizeof sr) == 0 && memcmp(wr, wf, sizeof wr) == 0, "%s router = reference",
                  ln);
        memcpy(h, h0, sizeof h0);
        ops->engram_mix(ops, h, kv, wqk, M, hc, D, 1e-20f, ds);
        TAP_CHECK(rel_close(h, href, M * hc * D, 2 * 0x1p-8, &e),
                  "%s engram gating within bf16 of the reference (%.2g)", ln, e);
        ops->embed(ops, table, ids, M, hc, ED, emb);
        ops->fp8_rows(ops, ft, fs, rows, 5, ED, fr);
        TAP_CHECK(memcmp(emb, emb_r, sizeof emb) == 0 && memcmp(fr, fr_r, sizeof fr) == 0,
                  "%s embedding rows and FP8 table rows = reference", ln);
    }
}

/* FP8 weight scales far from 2^0: with few rows the AMX level multiplies the
 * activations by the weight scale of each 32 x 32 block (and falls back to
 * scaling the weights where a scaled activation would leave bf16's normal
 * range); with many rows it scales the weights.  Every output must be the
 * same bit for bit either way, and the same as the reference within the
 * accumulation tolerance where nothing underflows. */
static void test_fp8_scale_extremes(void) {
    const size_t N = 64, K = 320, M = 40, kb = (K + 31) / 32;
    static const uint8_t scales[] = {10, 11, 40, 127, 200, 236, 90, 160, 127, 12};
    lin_case c = {DS41_LINEAR_FP8, M, N, K, DS41_OUT_F32};
    lin_data d;
    make_linear(&c, &d);
    for (size_t i = 0; i < ((N + 31) / 32) * kb; i++) d.sc[i] = scales[(i * 7 + i / kb) % sizeof scales];
    /* Rows 0-19 small (many activations below 2^-10, so sc = 10 blocks fall
     * back), rows 20-39 near 1. */
    for (size_t m = 0; m < M; m++)
        for (size_t k = 0; k < K; k++)
            d.x[m * K + k] = ldexpf(d.x[m * K + k], m < 20 ? -12 + (int)(k % 9) : 0);
    float *y = malloc(M * N * sizeof *y), *row = malloc(N * sizeof *row),
          *three = malloc(3 * N * sizeof *three);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        ops->linear(ops, &d.w, d.x, M, y, DS41_OUT_F32);
        int alone = 1, narrow = 1, finite = 1, nonzero = 0;
        for (size_t m = 0; m < M; m++) {
            ops->linear(ops, &d.w, d.x + m * K, 1, row, DS41_OUT_F32);
            alone &= memcmp(row, y + m * N, N * sizeof *row) == 0;
        }
        for (size_t m = 0; m + 3 <= M; m += 3) {
            ops->linear(ops, &d.w, d.x + m * K, 3, three, DS41_OUT_F32);
            narrow &= memcmp(three, y + m * N, 3 * N * sizeof *three) == 0;
        }
        for (size_t i = 0; i < M * N; i++) {
            finite &= isfinite(y[i]) != 0;
            nonzero += y[i] != 0.0f;
        }
        if (!alone || !narrow) TAP_NOTE("alone %d narrow %d", alone, narrow);
        TAP_CHECK(
            alone && narrow && finite && nonzero > (int)(M * N / 2),
            "%s FP8 linear, scales 2^-117 .. 2^109: 1 row and 3 rows = 40 rows bit for bit (finite, %d of "
            "%zu non-zero)",
            ds41_cpu_level_name(levels[li]), nonzero, M * N);
    }
    free(y);
    free(row);
    free(three);
    free_linear(&d);
}

/* The exact linears (DS41_OUT_BF16_EXACT / F32_EXACT, the indexer's
 * inputs): the reference's value bit for bit at every level, whatever the
 * rows, columns (tiles of XLIN_COLS and partial ones), K (partial 32-blocks)
 * and threads; inputs spread over the whole e4m3 range (subnormal codes,
 * cancelling block sums) and, in the second half of the cases, NaN codes,
 * a NaN (255) scale byte, a NaN and an infinite input and scale bytes 0 and
 * 254 (the element route's rows and columns next to vector ones). */
static int same_bits_or_nan(const float *a, const float *b, size_t n, size_t *where) {
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) && isnan(b[i])) continue;
        if (memcmp(&a[i], &b[i], sizeof a[i]) != 0) {
            *where = i;
            return 0;
        }
    }
    return 1;
}

static void test_exact_linears(void) {
    static const struct {
        ds41_linear_kind kind;
        size_t M, N, K;
        int nasty;
    } cases[] = {
        {DS41_LINEAR_FP8, 1, 1, 32, 0},     {DS41_LINEAR_FP8, 1, 17, 100, 0},
        {DS41_LINEAR_FP8, 2, 33, 300, 0},   {DS41_LINEAR_FP8, 5, 64, 1100, 0},
        {DS41_LINEAR_FP8, 17, 70, 160, 0},  {DS41_LINEAR_FP8, 40, 16, 64, 0},
        {DS41_LINEAR_FP4, 1, 15, 64, 0},    {DS41_LINEAR_FP4, 3, 33, 100, 0},
        {DS41_LINEAR_FP4, 9, 48, 1100, 0},  {DS41_LINEAR_FP4, 33, 17, 50, 0},
        {DS41_LINEAR_BF16, 1, 7, 33, 0},    {DS41_LINEAR_BF16, 4, 40, 1056, 0},
        {DS41_LINEAR_BF16, 19, 33, 100, 0}, {DS41_LINEAR_FP8, 6, 70, 300, 1},
        {DS41_LINEAR_FP8, 1, 40, 96, 1},    {DS41_LINEAR_FP4, 6, 50, 300, 1},
        {DS41_LINEAR_BF16, 6, 20, 64, 1},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const size_t M = cases[ci].M, N = cases[ci].N, K = cases[ci].K, kb = (K + 31) / 32;
        const ds41_linear_kind kind = cases[ci].kind;
        const int nasty = cases[ci].nasty;
        lin_data d;
        lin_data_make(kind, M, N, K, urand, &d);
        /* every value times 2^e, e in [-14, 6]: e4m3 codes down to the subnormals */
        for (size_t i = 0; i < M * K; i++)
            d.x[i] = ds41_bf16_round(ldexpf(d.x[i], -14 + (int)((i * 7 + i / 5) % 21)));
        if (nasty) {
            if (kind == DS41_LINEAR_FP8) {
                d.q[3 * K + K / 2] = 0x7F; /* column 3: a NaN code */
                d.q[(N - 1) * K] = 0xFF;   /* the last column: -NaN */
                d.sc[kb - 1] = 255;        /* columns 0-31, the last block: a NaN scale */
                if (N > 32) d.sc[kb] = 0;  /* columns 32-63, block 0: 2^-127 */
                if (N > 32 && kb > 1) d.sc[kb + 1] = 254;
            } else if (kind == DS41_LINEAR_FP4) {
                d.sc[5 * kb] = 255; /* column 5, block 0 */
                d.sc[6 * kb] = 0;
                d.sc[7 * kb] = 254;
            } else {
                d.bf[2 * K + 1] = 0x7FC0; /* column 2: NaN */
                d.bf[4 * K] = 0x7F80;     /* column 4: +inf */
            }
            if (M > 2) {
                d.x[1 * K + 3] = NAN;          /* row 1 */
                d.x[2 * K + K - 1] = INFINITY; /* row 2 */
            } else {
                d.x[K / 3] = NAN; /* the only row */
            }
        }
        float *ref = malloc(M * N * sizeof *ref), *y = malloc(M * N * sizeof *y),
              *row = malloc(N * sizeof *row);
        const char *kn = kind == DS41_LINEAR_FP8 ? "FP8" : kind == DS41_LINEAR_FP4 ? "FP4" : "BF16";
        for (int o = 0; o < 2; o++) {
            const ds41_linear_out out = o ? DS41_OUT_F32_EXACT : DS41_OUT_BF16_EXACT;
            ds41_ops_reference.linear(&ds41_ops_reference, &d.w, d.x, M, ref, out);
            for (int li = 0; li < n_levels; li++) {
                const ds41_ops *ops = ops_of(li), *one = &single_thread[li]->ops;
                size_t at = 0;
                ops->linear(ops, &d.w, d.x, M, y, out);
                const int eq = same_bits_or_nan(y, ref, M * N, &at);
                int alone = 1, threads;
                for (size_t m = 0; m < M; m++) {
                    ops->linear(ops, &d.w, d.x + m * K, 1, row, out);
                    alone &= same_bits_or_nan(row, y + m * N, N, &(size_t){0});
                }
                float *y1 = malloc(M * N * sizeof *y1);
                one->linear(one, &d.w, d.x, M, y1, out);
                threads = same_bits_or_nan(y1, y, M * N, &(size_t){0});
                free(y1);
                TAP_CHECK(
                    eq && alone && threads,
                    "%s linear %s %s M=%zu N=%zu K=%zu%s: = reference bit for bit, rows alone = batched, "
                    "1 thread = 2 threads",
                    ds41_cpu_level_name(levels[li]), kn, o ? "F32_EXACT" : "BF16_EXACT", M, N, K,
                    nasty ? " (NaN codes/scales/inputs, scales 2^-127 and 2^127)" : "");
                if (!eq)
                    TAP_NOTE("element %zu (row %zu, column %zu): got %.9g, reference %.9g", at, at / N,
                             at % N, (double)y[at], (double)ref[at]);
            }
        }
        free(ref);
        free(y);
        free(row);
        lin_data_free(&d);
    }
}

/* FP8 EXACT block sums that need their own rounding: products 2^16, 2^9,
 * 2^8 and -2^-9 in one block sum to 66304 - 2^-9, which rounds (RNE) to
 * the fp32 66304, a bf16 tie that goes to the even 66560; a truncated or
 * otherwise misrounded block sum lands below the tie (66048), and random
 * data almost never shows it (the bf16 output hides an fp32 ulp).  And
 * 2^16 + 2^-18 - 2^16 in one block is 2^-18 only if the block is summed
 * exactly.  In 16 columns (one whole tile) and 40 (tiles and a partial). */
static void test_exact_block_rounding(void) {
    static const struct {
        float x[4], w[4], want;
    } cs[] = {
        {{256.0f, 32.0f, 16.0f, 0x1p-9f}, {256.0f, 16.0f, 16.0f, -1.0f}, 66560.0f},
        {{256.0f, 0x1p-9f, -256.0f, 0.0f}, {256.0f, 0x1p-9f, 256.0f, 0.0f}, 0x1p-18f},
    };
    static const size_t widths[] = {16, 40};
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++)
        for (size_t wi = 0; wi < 2; wi++) {
            const size_t N = widths[wi], K = 40, nkb = 2;
            float x[40] = {0}, *wf = calloc(N * K, sizeof *wf), y[40], ref[40];
            for (int i = 0; i < 4; i++) x[i] = cs[c].x[i];
            for (size_t n = 0; n < N; n++)
                for (int i = 0; i < 4; i++) wf[n * K + (size_t)i] = cs[c].w[i];
            uint8_t *q = malloc(N * K), sc[2 * 2];
            ds41_quant_fp8_weight(wf, N, K, q, sc);
            const ds41_linear w = {.kind = DS41_LINEAR_FP8,
                                   .n = (int64_t)N,
                                   .k = (int64_t)K,
                                   .q = q,
                                   .scale = sc,
                                   .scale_cols = (int64_t)nkb};
            ds41_ops_reference.linear(&ds41_ops_reference, &w, x, 1, ref, DS41_OUT_BF16_EXACT);
            for (int li = 0; li < n_levels; li++) {
                const ds41_ops *ops = ops_of(li);
                ops->linear(ops, &w, x, 1, y, DS41_OUT_BF16_EXACT);
                int ok = 1;
                for (size_t n = 0; n < N; n++)
                    ok &= memcmp(&y[n], &ref[n], sizeof y[n]) == 0 && y[n] == cs[c].want;
                TAP_CHECK(ok, "%s FP8 EXACT, %zu columns: one block summing to %s = %a, as the reference",
                          ds41_cpu_level_name(levels[li]), N,
                          c == 0 ? "66304 - 2^-9 (fp32 RNE, then a bf16 tie)" : "2^16 + 2^-18 - 2^16",
                          (double)y[0]);
            }
            free(q);
            free(wf);
        }
}

/* Engram table rows over many rows (the threads' split and the prefetch
 * ahead): = the reference bit for bit, with every e4m3 code (NaN included)
 * and scale bytes 0, 1, 254 and 255 among the blocks. */
static void test_fp8_rows_many(void) {
    enum { V = 700, ED = 96, N = 300 };
    static uint8_t ft[V * ED], fs[V * ED / 32];
    for (int i = 0; i < V * ED; i++) ft[i] = (uint8_t)(i * 7 + i / 96);
    static const uint8_t sc[] = {120, 127, 0, 1, 254, 255, 131, 100};
    for (int i = 0; i < V * ED / 32; i++) fs[i] = sc[(i * 5 + i / 3) % 8];
    static int64_t rows[N];
    for (int i = 0; i < N; i++) rows[i] = (int64_t)((i * 389 + 11) % V);
    static float ref[N * ED], got[N * ED];
    ds41_ops_reference.fp8_rows(&ds41_ops_reference, ft, fs, rows, N, ED, ref);
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        ops->fp8_rows(ops, ft, fs, rows, N, ED, got);
        size_t at = 0;
        TAP_CHECK(same_bits_or_nan(got, ref, (size_t)N * ED, &at),
                  "%s FP8 table rows: %d random rows of %d (every code, scales 2^-127 .. NaN) = reference",
                  ds41_cpu_level_name(levels[li]), N, V);
    }
}

/* linear_batch = one linear call per member, bit for bit, including
 * members with no rows and members of different kinds and sizes. */
static void test_linear_batch(void) {
    const lin_case cases[5] = {{DS41_LINEAR_FP4, 3, 40, 64, DS41_OUT_BF16},
                               {DS41_LINEAR_FP4, 0, 33, 64, DS41_OUT_BF16},
                               {DS41_LINEAR_FP8, 17, 70, 96, DS41_OUT_BF16},
                               {DS41_LINEAR_FP4, 1, 65, 128, DS41_OUT_BF16},
                               {DS41_LINEAR_FP8, 40, 32, 64, DS41_OUT_BF16}};
    lin_data d[5];
    const ds41_linear *ws[5];
    const float *xs[5];
    size_t Ms[5];
    float *ys[5], *one[5];
    for (int i = 0; i < 5; i++) {
        lin_case c = cases[i];
        if (c.M == 0) c.M = 1; /* data for one row; the batch asks for none */
        make_linear(&c, &d[i]);
        ws[i] = &d[i].w;
        xs[i] = d[i].x;
        Ms[i] = cases[i].M;
        ys[i] = calloc((Ms[i] ? Ms[i] : 1) * cases[i].N, sizeof(float));
        one[i] = calloc((Ms[i] ? Ms[i] : 1) * cases[i].N, sizeof(float));
    }
    for (int li = 0; li < n_levels; li++) {
        const ds41_ops *ops = ops_of(li);
        ops->linear_batch(ops, 5, ws, xs, Ms, ys, DS41_OUT_BF16);
        int ok = 1;
        for (int i = 0; i < 5; i++) {
            if (!Ms[i]) continue;
            ops->linear(ops, ws[i], xs[i], Ms[i], one[i], DS41_OUT_BF16);
            ok &= memcmp(one[i], ys[i], Ms[i] * cases[i].N * sizeof(float)) == 0;
        }
        TAP_CHECK(ok, "%s linear_batch of 5 (FP8/FP4, 0..40 rows) = one linear call each, bit for bit",
                  ds41_cpu_level_name(levels[li]));
    }
    float *r[5];
    for (int i = 0; i < 5; i++) r[i] = calloc((Ms[i] ? Ms[i] : 1) * cases[i].N, sizeof(float));
    ds41_ops_reference.linear_batch(&ds41_ops_reference, 5, ws, xs, Ms, r, DS41_OUT_BF16);
    int ok = 1;
    for (int i = 0; i < 5; i++) {
        if (!Ms[i]) continue;
        ds41_ops_reference.linear(&ds41_ops_reference, ws[i], xs[i], Ms[i], one[i], DS41_OUT_BF16);
        ok &= memcmp(one[i], r[i], Ms[i] * cases[i].N * sizeof(float)) == 0;
    }
    TAP_CHECK(ok, "reference linear_batch = one reference linear call each");
    for (int i = 0; i < 5; i++) {
        free_linear(&d[i]);
        free(ys[i]);
        free(one[i]);
        free(r[i]);
    }
}

/* The kernels' double-precision reductions and exp against the exact ones
 * (refmath): the double sum rounded once equals the exact sum rounded once,
 * and exp equals ds41_rm_exp, on random inputs of awkward lengths. */
static void test_primitives(void) {
    const fast_kernels *ks[4] = {&ds41__fast_scalar, NULL, NULL, NULL};
    int nk = 1;
#if defined(__x86_64__)
    const ds41_cpu_level top = ds41_cpu_level_detect();
    if (top >= DS41_CPU_AVX2) ks[nk++] = &ds41__fast_avx2;
    if (top >= DS41_CPU_AVX512) ks[nk++] = &ds41__fast_avx512;
#endif
    enum { NX = 100000 };
    static float a[1030], b[1030], x[NX], e[NX];
    for (int ki = 0; ki < nk; ki++) {
        const fast_kernels *k = ks[ki];
        k->init();
        int ok_dot = 1, ok_sq = 1, ok_axpy = 1;
        const size_t lens[] = {1, 2, 7, 8, 15, 16, 17, 33, 100, 512, 1029};
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            const size_t n = lens[li];
            for (int rep = 0; rep < 20; rep++) {
                for (size_t i = 0; i < n; i++) {
                    a[i] = (float)(urand() * ldexp(1.0, (int)(urand() * 20)));
                    b[i] = bfr(urand());
                }
                ok_dot &= (float)k->dot(a, b, n) == ds41_xdot_f32(a, b, n);
                ok_sq &= (float)(k->sumsq(a, n) / (double)n) == ds41_mean_sq_f32(a, n);
                double y[1030], want[1030];
                for (size_t i = 0; i < n; i++) y[i] = want[i] = urand();
                k->axpy(y, b[0], a, n);
                for (size_t i = 0; i < n; i++)
                    ok_axpy &= fabs(y[i] - (want[i] + (double)b[0] * a[i])) <= 1e-15 * (1 + fabs(y[i]));
            }
        }
        for (int i = 0; i < NX; i++) x[i] = (float)(urand() * 110.0 - 10.0);
        x[0] = 0.0f;
        x[1] = -1e30f;
        x[2] = 88.7f;
        x[3] = -103.9f;
        x[4] = NAN;
        x[5] = -INFINITY;
        k->exp(x, e, NX);
        int ok_exp = 1, first = -1;
        for (int i = 0; i < NX; i++) {
            const float w = ds41_rm_exp(x[i]);
            if (!((isnan(w) && isnan(e[i])) || memcmp(&w, &e[i], sizeof w) == 0)) {
                if (first < 0) first = i;
                ok_exp = 0;
            }
        }
        TAP_CHECK(
            ok_dot && ok_sq && ok_axpy && ok_exp,
            "%s kernels: double dot / mean of squares rounded once = the exact ones, axpy in double, exp = "
            "ds41_rm_exp on %d arguments",
            ds41_cpu_level_name(k->level), NX);
        if (first >= 0) TAP_NOTE("exp(%.9g): got %.9g", (double)x[first], (double)e[first]);
    }
}

int main(void) {
    ds41_error err;
    const ds41_cpu_level top = ds41_cpu_level_detect();
    for (int l = top; l >= DS41_CPU_SCALAR; l--) {
        ds41_cpu_opts o = {.threads = 2, .level = (ds41_cpu_level)l};
        ds41_cpu_opts o1 = {.threads = 1, .level = (ds41_cpu_level)l};
        backends[n_levels] = ds41_backend_cpu_new(&o, &err);
        single_thread[n_levels] = ds41_backend_cpu_new(&o1, &err);
        if (!backends[n_levels] || !single_thread[n_levels]) {
            TAP_CHECK(0, "backend at level %s: %s", ds41_cpu_level_name((ds41_cpu_level)l), err.msg);
            return tap_done();
        }
        levels[n_levels] = (ds41_cpu_level)l;
        TAP_CHECK((int)ds41_backend_cpu_level(backends[n_levels]) == l,
                  "a backend at level %s runs at that level", ds41_cpu_level_name((ds41_cpu_level)l));
        n_levels++;
    }
    TAP_NOTE("this machine's best level: %s", ds41_cpu_level_name(top));
    test_primitives();
    test_act_quant();
    test_linears();
    test_fp8_scale_extremes();
    test_exact_linears();
    test_exact_block_rounding();
    test_fp8_rows_many();
    test_linear_batch();
    test_norms_and_hc();
    test_rope_and_pool();
    test_step_quant();
    test_attention();
    test_moe_engram_gathers();
    for (int i = 0; i < n_levels; i++) {
        ds41_backend_free(backends[i]);
        ds41_backend_free(single_thread[i]);
    }
    return tap_done();
}
