/* The reference op backend, one layer at a time, against straightforward
 * double-precision formulas of REFERENCE.md §2 (with the tolerance the
 * rounding points allow) and against the exact rules of §10 where a value is
 * determined bit for bit. */
#include "engine/backend/ops.h"
#include "engine/backend/refmath.h"
#include "engine/model/quant.h"
#include "tests/attn_step.h"
#include "tests/index_pages.h"
#include "tests/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x243f6a8885a308d3ull;
static double urand(void) { /* [-1, 1) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng >> 11) / 4503599627370496.0 - 1.0;
}

static float bfr(double x) {
    return ds41_bf16_round((float)x);
}

static void fill_bf16(float *x, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) x[i] = bfr(urand() * scale);
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* |a - b| within k bf16 ulps of b (or an absolute floor). */
static int close_bf16(float a, double b, double ulps, double floor_abs) {
    double ulp = fabs(b) * 0x1p-7;
    return fabs((double)a - b) <= ulps * ulp + floor_abs;
}

static const ds41_ops *ops = &ds41_ops_reference;

static void test_linear(void) {
    enum { N = 40, K = 96, M = 3 };
    static float w[N * K], x[M * K], y[M * N], wd[N * K], xq[M * K];
    static uint8_t q[N * K], sc[2 * 3], q4[N * K / 2], sc4[N * 3];
    for (size_t i = 0; i < N * K; i++) w[i] = (float)(urand() * (i % 97 < 40 ? 0.01 : 1.0));
    fill_bf16(x, M * K, 2.0);

    /* FP8: compare with the dequantized weight times the act-quantized x. */
    ds41_quant_fp8_weight(w, N, K, q, sc);
    ds41_dequant_fp8_weight(q, sc, N, K, wd);
    memcpy(xq, x, sizeof x);
    for (size_t m = 0; m < M; m++) ds41_act_quant_qdq(xq + m * K, K);
    ds41_linear lf8 = {.kind = DS41_LINEAR_FP8, .n = N, .k = K, .q = q, .scale = sc, .scale_cols = 3};
    ops->linear(ops, &lf8, x, M, y, DS41_OUT_BF16);
    int ok = 1, exact_bf16 = 1;
    for (size_t m = 0; m < M; m++)
        for (size_t n = 0; n < N; n++) {
            double ref = 0;
            for (size_t k = 0; k < K; k++) ref += (double)xq[m * K + k] * wd[n * K + k];
            ok &= close_bf16(y[m * N + n], ref, 1.01, 1e-30);
            exact_bf16 &= ds41_bf16_round(y[m * N + n]) == y[m * N + n];
        }
    TAP_CHECK(ok && exact_bf16, "FP8 linear = act_quant(x) . dequant(W) within one bf16 ulp, bf16 output");

    /* Block order: one K block's partial is scaled and added in K order. */
    float acc = 0.0f;
    {
        uint8_t aq[K], as[3];
        ds41_act_quant(x, K, aq, as);
        for (int kb = 0; kb < 3; kb++) {
            double p = 0;
            for (int k = kb * 32; k < kb * 32 + 32; k++) p += (double)ds41_e4m3_to_f32(aq[k]) * ds41_e4m3_to_f32(q[k]);
            float s = ds41_ue8m0_to_f32(as[kb]) * ds41_ue8m0_to_f32(sc[kb]);
            float t = (float)p * s;
            acc = acc + t;
        }
    }
    TAP_CHECK(bits(y[0]) == bits(ds41_bf16_round(acc)), "FP8 GEMM: acc = fp32(acc + fp32(p * fp32(sa * sb))) per block");

    /* FP4 weights (experts). */
    ds41_quant_fp4_weight(w, N, K, q4, sc4);
    ds41_dequant_fp4_weight(q4, sc4, N, K, wd);
    ds41_linear lf4 = {.kind = DS41_LINEAR_FP4, .n = N, .k = K, .q = q4, .scale = sc4, .scale_cols = 3};
    ops->linear(ops, &lf4, x, M, y, DS41_OUT_BF16);
    ok = 1;
    for (size_t m = 0; m < M; m++)
        for (size_t n = 0; n < N; n++) {
            double ref = 0;
            for (size_t k = 0; k < K; k++) ref += (double)xq[m * K + k] * wd[n * K + k];
            ok &= close_bf16(y[m * N + n], ref, 1.01, 1e-30);
        }
    TAP_CHECK(ok, "FP4 linear = act_quant(x) . dequant(W) within one bf16 ulp");

    /* BF16 weights: exact dot product, bf16 or fp32 output. */
    static uint16_t wb[N * K];
    for (size_t i = 0; i < N * K; i++) wb[i] = ds41_bf16_bits(w[i]);
    ds41_linear lb = {.kind = DS41_LINEAR_BF16, .n = N, .k = K, .bf16 = wb};
    static float y32[M * N];
    ops->linear(ops, &lb, x, M, y, DS41_OUT_BF16);
    ops->linear(ops, &lb, x, M, y32, DS41_OUT_F32);
    ok = 1;
    for (size_t m = 0; m < M; m++)
        for (size_t n = 0; n < N; n++) {
            float want = ds41_xdot_f32_bf16(x + m * K, wb + n * K, K);
            ok &= bits(y32[m * N + n]) == bits(want) && bits(y[m * N + n]) == bits(ds41_bf16_round(want));
        }
    TAP_CHECK(ok, "BF16 linear: fp32 = exact dot rounded once, bf16 output rounds that");
}

static void test_rmsnorm(void) {
    enum { n = 200 };
    float x[n], y[n];
    uint16_t w[n];
    fill_bf16(x, n, 3.0);
    for (int i = 0; i < n; i++) w[i] = ds41_bf16_bits((float)(1.0 + 0.5 * urand()));
    ops->rmsnorm(ops, w, x, 1, n, 1e-20f, y);
    double ms = 0;
    for (int i = 0; i < n; i++) ms += (double)x[i] * x[i];
    ms /= n;
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= close_bf16(y[i], ds41_bf16_to_f32(w[i]) * x[i] / sqrt(ms), 1.01, 1e-30);
    TAP_CHECK(ok, "rmsnorm = w x / sqrt(mean x^2) within one bf16 ulp");
    float zero[n] = {0}, yz[n];
    ops->rmsnorm(ops, w, zero, 1, n, 1e-20f, yz);
    int allz = 1;
    for (int i = 0; i < n; i++) allz &= yz[i] == 0.0f;
    TAP_CHECK(allz, "rmsnorm of zeros is zero (eps 1e-20 keeps rsqrt finite)");
}

static void test_hc(void) {
    enum { hc = 4, D = 64, NM = (2 + hc) * hc };
    static float fn[NM * hc * D], h[hc * D], o[D], out[hc * D], x[D];
    float base[NM], scale[3] = {0.5f, 0.7f, 1.3f}, pre[hc], post[hc], comb[hc * hc];
    for (size_t i = 0; i < NM * hc * D; i++) fn[i] = (float)(urand() * 0.05);
    for (int i = 0; i < NM; i++) base[i] = (float)urand();
    fill_bf16(h, hc * D, 1.0);
    ops->hc_mix(ops, fn, scale, base, h, 1, hc, D, 1e-20f, 20, 1e-6f, pre, post, comb);
    int ok = 1;
    for (int j = 0; j < hc; j++) {
        double cs = 0;
        for (int i = 0; i < hc; i++) cs += comb[i * hc + j];
        ok &= fabs(cs - 1.0) < 1e-5;
    }
    TAP_CHECK(ok, "Sinkhorn ends with a column normalisation: comb columns sum to 1");
    int ok_rows = 1;
    for (int i = 0; i < hc; i++) {
        double rs = 0;
        for (int j = 0; j < hc; j++) rs += comb[i * hc + j];
        ok_rows &= fabs(rs - 1.0) < 1e-2;
    }
    TAP_CHECK(ok_rows, "after 20 iterations comb rows sum to ~1 too (doubly stochastic)");
    int ok_range = 1;
    for (int i = 0; i < hc; i++) ok_range &= pre[i] > 1e-6f && pre[i] <= 1.0f + 1e-6f && post[i] > 0 && post[i] < 2.0f;
    /* pre[0] by hand: sigmoid(mix0 * s0 + b0) + eps with mix0 = dot(fn0, h) * rsqrt(mean h^2 + eps). */
    float r = ds41_rm_rsqrt(ds41_mean_sq_f32(h, hc * D) + 1e-20f);
    float mix0 = ds41_xdot_f32(fn, h, hc * D) * r;
    float t0 = mix0 * scale[0];
    float want0 = ds41_rm_sigmoid(t0 + base[0]) + 1e-6f;
    TAP_CHECK(ok_range && bits(pre[0]) == bits(want0), "pre = sigmoid(mix * scale + base) + eps exactly, post in (0, 2)");

    float onehot[hc] = {1, 0, 0, 0};
    ops->hc_pre(ops, h, onehot, 1, hc, D, x);
    TAP_CHECK(memcmp(x, h, sizeof x) == 0, "hc_pre with the one-hot start selects copy 0");
    float p4[hc] = {0.25f, 0.25f, 0.25f, 0.25f};
    ops->hc_pre(ops, h, p4, 1, hc, D, x);
    int ok_pre = 1;
    for (int d = 0; d < D; d++) {
        float a = 0.25f * h[d];
        for (int c = 1; c < hc; c++) a = a + 0.25f * h[c * D + d];
        ok_pre &= bits(x[d]) == bits(ds41_bf16_round(a));
    }
    TAP_CHECK(ok_pre, "hc_pre: ((p0 x0 + p1 x1) + p2 x2) + p3 x3, bf16");

    fill_bf16(o, D, 1.0);
    ops->hc_post(ops, o, h, post, comb, 1, hc, D, out);
    int ok_post = 1;
    for (int j = 0; j < hc; j++)
        for (int d = 0; d < D; d++) {
            float s = comb[j] * h[d];
            for (int i = 1; i < hc; i++) s = s + comb[i * hc + j] * h[i * D + d];
            float po = post[j] * o[d];
            ok_post &= bits(out[j * D + d]) == bits(ds41_bf16_round(po + s));
        }
    TAP_CHECK(ok_post, "hc_post: out[j] = bf16(post_j o + sum_i comb[i][j] h_i), column index = output copy");
}

static void test_attention(void) {
    /* A small cache layout: head_dim 64, window 8 (ring rows), latent entries. */
    ds41_kv_layout lay = {0};
    lay.latent_dim = 64;
    lay.index_dim = 32;
    lay.latent_bytes = 64 / 2 + 64 / 16;
    lay.index_bytes = 32 / 2 + 1;
    lay.entry_bytes = lay.latent_bytes + lay.index_bytes;
    lay.ring_row_bytes = 64 + 2;
    enum { H = 3, hd = 64, NW = 70, NC = 90 };
    static uint8_t wrow[NW][66], ent[NC][36 + 17];
    static float vals[NW + NC][hd], q[H * hd], out[H * hd];
    const uint8_t *wp[NW], *cp[NC];
    for (int j = 0; j < NW; j++) {
        float v[hd];
        fill_bf16(v, hd, 2.0);
        ds41_act_quant(v, hd, wrow[j], wrow[j] + hd);
        ds41_kv_decode_ring_row(&lay, wrow[j], vals[j]);
        wp[j] = wrow[j];
    }
    for (int j = 0; j < NC; j++) {
        float v[hd], k[32];
        fill_bf16(v, hd, 2.0);
        fill_bf16(k, 32, 1.0);
        ds41_fp4_act_quant_e4m3(v, hd, ent[j], ent[j] + hd / 2);
        ds41_fp4_act_quant_ue8m0(k, 32, ent[j] + lay.latent_bytes, ent[j] + lay.latent_bytes + 16);
        ds41_kv_decode_latent(&lay, ent[j], vals[NW + j]);
        cp[j] = ent[j];
    }
    fill_bf16(q, H * hd, 0.5);
    float sink[H] = {0.3f, -2.0f, 1.5f};
    const float scale = (float)pow(64.0, -0.5);
    ds41_attn_rows rows = {.layout = &lay, .n_window = NW, .window = wp, .n_comp = NC, .comp = cp};
    ops->sparse_attn(ops, q, H, hd, sink, scale, &rows, out);
    int ok = 1;
    for (int h = 0; h < H; h++) {
        double z[NW + NC], mx = -1e300, den = 0;
        for (int j = 0; j < NW + NC; j++) {
            double s = 0;
            for (int d = 0; d < hd; d++) s += (double)q[h * hd + d] * vals[j][d];
            z[j] = s * scale;
            mx = z[j] > mx ? z[j] : mx;
        }
        for (int j = 0; j < NW + NC; j++) den += exp(z[j] - mx);
        den += exp(sink[h] - mx);
        for (int d = 0; d < hd; d++) {
            double num = 0;
            for (int j = 0; j < NW + NC; j++) num += exp(z[j] - mx) * vals[j][d];
            double want = num / den;
            /* bf16(p) before PV: a few bf16 ulps of the largest term. */
            ok &= fabs(out[h * hd + d] - want) <= 0.02 * (fabs(want) + 0.05);
        }
    }
    TAP_CHECK(ok, "sparse attention over 160 rows (3 chunks of 64) = softmax with sink, within bf16 rounding");

    /* A single row and a very negative sink: the output is that row. */
    ds41_attn_rows one = {.layout = &lay, .n_window = 1, .window = wp};
    float sink_low[H] = {-1e30f, -1e30f, -1e30f};
    ops->sparse_attn(ops, q, H, hd, sink_low, scale, &one, out);
    TAP_CHECK(memcmp(out, vals[0], hd * sizeof(float)) == 0, "one row, no sink mass: the output is the row exactly");

    /* The sink only adds to the denominator: a large sink shrinks the output. */
    float sink_hi[H] = {30.0f, 30.0f, 30.0f};
    ops->sparse_attn(ops, q, H, hd, sink_hi, scale, &one, out);
    int tiny = 1;
    for (int d = 0; d < hd; d++) tiny &= fabsf(out[d]) < 1e-9f;
    TAP_CHECK(tiny, "a large sink takes the probability mass (numerator unchanged)");

    /* Index scores: bf16(sum_h bf16(relu(bf16(q_h.K)) * w_h)), three rows in one call over pages of
     * 16 entries (the last partly filled): a full reach, none, part; scores past a reach untouched. */
    enum { NH = 4, ID = 32, IM = 3, PER = 16, NP = (NC + PER - 1) / PER };
    static float iq[IM * NH * ID], iw[IM * NH], sc[IM * NC];
    index_test_queries(iq, iw, IM, NH, ID, urand);
    const uint8_t *pages[NP];
    index_test_pages(&lay, ent[0], NC, PER, pages);
    const size_t row_table[IM] = {0, 0, 0};
    const uint32_t reach[IM] = {NC, 0, 37};
    const ds41_kv_pages keys = {.layout = &lay, .pages = pages, .row_table = row_table, .row_reach = reach};
    for (int i = 0; i < IM * NC; i++) sc[i] = 1234.0f;
    ops->index_scores(ops, iq, iw, IM, NH, ID, &keys, sc, NC);
    int ok_idx = 1;
    for (int m = 0; m < IM; m++)
        for (int j = 0; j < NC; j++) {
            if ((uint32_t)j >= reach[m]) {
                ok_idx &= sc[m * NC + j] == 1234.0f;
                continue;
            }
            float k[ID];
            ds41_kv_decode_index_key(&lay, ent[j], k);
            float terms[NH];
            for (int h = 0; h < NH; h++) {
                float s = ds41_bf16_round(ds41_xdot_f32(iq + (m * NH + h) * ID, k, ID));
                terms[h] = ds41_bf16_round((s > 0 ? s : 0.0f) * iw[m * NH + h]);
            }
            ok_idx &= bits(sc[m * NC + j]) == bits(ds41_bf16_round(ds41_xsum_f32(terms, NH)));
        }
    TAP_CHECK(ok_idx,
              "index scores of 3 rows over paged keys: relu per head, times w, summed in bf16 (§2.10 step "
              "4); nothing past a row's reach");

    /* attend: a step of two sequences (ring rows, this step's rows, paged entries). */
    static attn_step_case t;
    static float sq[ATTN_STEP_M * H * hd], so[ATTN_STEP_M * H * hd], sw[ATTN_STEP_M * H * hd];
    attn_step_case_init(&t, &lay, wrow[0], ent[0], NC);
    fill_bf16(sq, ATTN_STEP_M * H * hd, 0.5);
    TAP_CHECK(
        attn_step_check(ops, &t, sq, H, hd, sink, scale, so, sw),
        "attend over a step of 2 sequences (rings, the step's rows, paged entries) = sparse_attn row by row");

    /* kv_pack: a step's entries packed entry_bytes apart, each as the cache packs it. */
    enum { NE = 3 };
    static float plat[NE * hd], pkey[NE * 32];
    static uint8_t pk[NE * (36 + 17)], pw[NE * (36 + 17)];
    fill_bf16(plat, NE * hd, 2.0);
    fill_bf16(pkey, NE * 32, 1.0);
    for (int i = 0; i < NE; i++)
        ds41_kv_pack_entry(&lay, plat + i * hd, pkey + i * 32, pw + i * lay.entry_bytes);
    ops->kv_pack(ops, &lay, plat, pkey, NE, pk);
    TAP_CHECK(memcmp(pk, pw, sizeof pk) == 0,
              "kv_pack of %d entries: each the cache's packed entry, entry_bytes apart", NE);
}

static void test_moe_parts(void) {
    /* Router: ties broken toward the lower expert id, order = descending biased score. */
    enum { E = 6, K = 3 };
    float logits[E] = {0.5f, 2.0f, 0.5f, 2.0f, -1.0f, 3.0f};
    float bias[E] = {0, 0, 0, 0, 10.0f, 0};
    int32_t sel[K];
    float w[K];
    float selection[E];
    ops->router(ops, logits, bias, 1, E, K, 1.0f, 1.5f, sel, w, selection);
    TAP_CHECK(sel[0] == 4 && sel[1] == 5 && sel[2] == 1, "router: bias only selects, ties go to the lower id (got %d %d %d)",
              sel[0], sel[1], sel[2]);
    float s4 = ds41_rm_sqrt(ds41_rm_softplus(-1.0f)), s5 = ds41_rm_sqrt(ds41_rm_softplus(3.0f)),
          s1 = ds41_rm_sqrt(ds41_rm_softplus(2.0f));
    float sum = (s4 + s5) + s1;
    float d = sum + 1e-20f;
    TAP_CHECK(bits(w[0]) == bits((s4 / d) * 1.5f) && bits(w[2]) == bits((s1 / d) * 1.5f),
              "router weights: unbiased sqrt(softplus), normalised in choice order, times route_scale");
    int ok_sel = 1;
    for (int e = 0; e < E; e++)
        ok_sel &= bits(selection[e]) == bits(ds41_rm_sqrt(ds41_rm_softplus(logits[e])) + bias[e]);
    TAP_CHECK(
        ok_sel,
        "router: the selection scores it ranked, sqrt(softplus(logit)) + bias, come out with the choice");
    /* gate_temp divides the logits: logits x4 at temperature 4 are the same decision, bit for bit. */
    float logits4[E], w4[K], selection4[E];
    int32_t sel4[K];
    for (int e = 0; e < E; e++) logits4[e] = logits[e] * 4.0f;
    ops->router(ops, logits4, bias, 1, E, K, 4.0f, 1.5f, sel4, w4, selection4);
    TAP_CHECK(memcmp(sel4, sel, sizeof sel) == 0 && memcmp(w4, w, sizeof w) == 0 &&
                  memcmp(selection4, selection, sizeof selection) == 0,
              "router: gate_temp divides the logits (x4 at temperature 4 = x1 at 1, bit for bit)");
    float w1[1];
    int32_t sel1[1];
    ops->router(ops, logits, bias, 1, E, 1, 1.0f, 1.5f, sel1, w1, NULL);
    TAP_CHECK(sel1[0] == 4 && bits(w1[0]) == bits(s4 * 1.5f), "router with k = 1: no normalisation, route_scale applied");

    float g[4] = {12.0f, -3.0f, 1.0f, 0.5f}, u[4] = {20.0f, -30.0f, 2.0f, -1.0f}, route[1] = {0.5f}, h[4];
    ops->swiglu(ops, g, u, 1, 4, 10.0f, route, h);
    float want0 = ds41_bf16_round(0.5f * (ds41_rm_silu(10.0f) * 10.0f));
    float want1 = ds41_bf16_round(0.5f * (ds41_rm_silu(-3.0f) * -10.0f));
    TAP_CHECK(bits(h[0]) == bits(want0) && bits(h[1]) == bits(want1),
              "swiglu: gate clamped from above, up clamped both ways, route weight before w2");
    ops->swiglu(ops, g, u, 1, 4, 0.0f, NULL, h);
    TAP_CHECK(bits(h[0]) == bits(ds41_bf16_round(ds41_rm_silu(12.0f) * 20.0f)), "swiglu_limit 0: no clamp");
}

static void test_engram_mix(void) {
    enum { hc = 4, D = 32 };
    float h[hc * D], h0[hc * D], kv[(hc + 1) * D], wqk[hc * D];
    fill_bf16(h, hc * D, 1.0);
    fill_bf16(kv, (hc + 1) * D, 1.0);
    for (int i = 0; i < hc * D; i++) wqk[i] = (float)(1.0 + 0.1 * urand());
    memcpy(h0, h, sizeof h);
    const float ds = (float)pow(32.0, -0.5);
    ops->engram_mix(ops, h, kv, wqk, 1, hc, D, 1e-20f, ds);
    /* Recover each copy's gate from one element and check the formula. */
    int ok = 1;
    for (int c = 0; c < hc; c++) {
        double mh = 0, mk = 0, dot = 0;
        for (int d = 0; d < D; d++) {
            mh += (double)h0[c * D + d] * h0[c * D + d];
            mk += (double)kv[c * D + d] * kv[c * D + d];
            dot += (double)h0[c * D + d] * wqk[c * D + d] * kv[c * D + d];
        }
        dot = dot / sqrt(mh / D) / sqrt(mk / D) / sqrt((double)D);
        double gate = 1.0 / (1.0 + exp(-copysign(sqrt(fmax(fabs(dot), 1e-6)), dot)));
        for (int d = 0; d < D; d++) ok &= close_bf16(h[c * D + d], h0[c * D + d] + gate * kv[hc * D + d], 1.01, 1e-6);
    }
    TAP_CHECK(ok, "engram: h + sigmoid(signed sqrt of the normalised dot) * value, per copy");
    memset(kv + hc * D, 0, D * sizeof(float));
    memcpy(h, h0, sizeof h);
    ops->engram_mix(ops, h, kv, wqk, 1, hc, D, 1e-20f, ds);
    TAP_CHECK(memcmp(h, h0, sizeof h) == 0, "engram with a zero value leaves the stream unchanged");
}

/* Rope of a whole step in one call: M rows of H heads at strides with gaps, against
 * ds41_rope_apply head by head; values outside the rotated pairs stay as they were. */
static void test_rope(void) {
    enum { M = 3, H = 2, NP = 4, OFF = 2, HS = 11, RS = H * HS + 3 };
    const uint64_t pos[M] = {0, 5, 12345};
    float freqs[NP], cs[M * 2 * NP], want_cs[M * 2 * NP];
    for (int i = 0; i < NP; i++) freqs[i] = (float)pow(10000.0, -2.0 * i / (2.0 * NP));
    ops->rope_table(ops, freqs, NP, pos, M, cs);
    for (int m = 0; m < M; m++) ds41_rope_cos_sin(freqs, NP, pos[m], want_cs + m * 2 * NP);
    TAP_CHECK(memcmp(cs, want_cs, sizeof cs) == 0, "rope_table: each row's cos/sin at its own position");
    for (int inverse = 0; inverse < 2; inverse++) {
        float x[M * RS], want[M * RS];
        fill_bf16(x, M * RS, 2.0);
        memcpy(want, x, sizeof x);
        for (int m = 0; m < M; m++)
            for (int h = 0; h < H; h++)
                ds41_rope_apply(want + m * RS + h * HS + OFF, NP, want_cs + m * 2 * NP, inverse);
        ops->rope(ops, x + OFF, M, H, RS, HS, NP, cs, inverse);
        TAP_CHECK(memcmp(x, want, sizeof x) == 0,
                  "rope (%s) over %d rows x %d heads in one call = per head and row, the rest untouched",
                  inverse ? "inverse" : "forward", M, H);
    }
}

/* The step's activation quantizers: FP8 rows written at a stride with a gap (the gap untouched),
 * the index queries' FP4 QDQ and weight scaling, each row as the single-row codec does it. */
static void test_step_quant(void) {
    enum { M = 3, N = 70, NS = (N + 31) / 32, STRIDE = N + NS + 5, QN = 64, WN = 3 };
    static float x[M * N], q[M * QN], w[M * WN], q0[M * QN], w0[M * WN];
    static uint8_t out[M * STRIDE], want[M * STRIDE];
    fill_bf16(x, M * N, 100.0);
    memset(out, 0xa5, sizeof out);
    memset(want, 0xa5, sizeof want);
    for (int m = 0; m < M; m++) ds41_act_quant(x + m * N, N, want + m * STRIDE, want + m * STRIDE + N);
    ops->act_quant_fp8(ops, x, M, N, out, STRIDE);
    TAP_CHECK(memcmp(out, want, sizeof out) == 0,
              "act_quant_fp8 of %d rows at a stride: codes + ue8m0 scales per row, the gap untouched", M);
    fill_bf16(q0, M * QN, 3.0);
    fill_bf16(w0, M * WN, 1.0);
    memcpy(q, q0, sizeof q);
    memcpy(w, w0, sizeof w);
    ops->index_query(ops, q, QN, w, WN, M, 0.125f * 1.5f);
    int ok = 1;
    for (int m = 0; m < M; m++) {
        ds41_fp4_act_quant_ue8m0_qdq(q0 + m * QN, QN);
        for (int i = 0; i < WN; i++)
            ok &= bits(w[m * WN + i]) == bits(ds41_bf16_round(w0[m * WN + i] * (0.125f * 1.5f)));
    }
    TAP_CHECK(ok && memcmp(q, q0, sizeof q) == 0,
              "index_query of %d rows: FP4 1x32 QDQ of each query row, w = bf16(w * scale)", M);
}

int main(void) {
    test_linear();
    test_rmsnorm();
    test_hc();
    test_rope();
    test_step_quant();
    test_attention();
    test_moe_parts();
    test_engram_mix();
    return tap_done();
}
