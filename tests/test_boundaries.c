/* Inputs exactly at thresholds and ties of the numeric kernels (issue 19).
 *
 * Each check sits ON a boundary that the older tests only approached from
 * either side, and each was written against a mutant of tests/mutation that
 * survived them: the exact accumulator's sticky bit from the fourth limb
 * down, a mean's division remainder at a tie, half of the smallest subnormal,
 * the fast path's zero rule and its error bound, softplus around its switch to
 * the linear branch, the YaRN ramp's upper clamp, and a NaN in a later row of
 * an FP8 weight block. */
#include "config/buf.h"
#include "config/daemon_config.h"
#include "config/model_config.h"
#include "engine/model/kv_cache.h"
#include "engine/backend/ops.h"
#include "engine/text/pyjson.h"
#include "engine/model/quant.h"
#include "engine/backend/refmath.h"
#include "engine/serve/sampler.h"
#include "engine/serve/stop.h"
#include "storage/safetensors.h"
#include "storage/snapshot.h"
#include "storage/snapshot_store.h"
#include "tests/float_bits.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the cache partition the snapshots of this test belong to (any fixed one) */
static const ds41_snapshot_owner SNAP_OWNER = {.key = {0x5a, 1}, .uid = 1000};

static void test_sum_of(void) {
    /* 1 + 2^-24 is the tie between 1 and 1 + 2^-23; a residual of 2^-100 lies three 32-bit
     * limbs below the top one (not in the 64 bits read from the top three) and must still
     * break the tie upward through the sticky bit. */
    const double s1[] = {1.0, 0x1p-24, 0x1p-100};
    const double s2[] = {1.0, 0x1p-24, 0x1p-1000};
    TAP_CHECK(same(sum_of(s1, 3), 1.0f + 0x1p-23f) && same(sum_of(s2, 3), 1.0f + 0x1p-23f),
              "a residual in the fourth limb below the top, or far below, breaks a tie upward");
    /* Exactly half of the smallest subnormal is a tie: to the even 0 (+0, positive sum). */
    const double h[] = {0x1p-150};
    const double hn[] = {-0x1p-150};
    TAP_CHECK(same(sum_of(h, 1), 0.0f) && same(sum_of(hn, 1), -0.0f),
              "exactly half the smallest subnormal rounds to the even zero, keeping the sign");
    /* A mean whose quotient is an exact fp32 tie and whose division leaves a remainder:
     * (3 (2^23 + 0.5) + 2^-38) / 3 = 2^23 + 0.5 + 2^-38/3, above the tie: up.  The sum fits
     * 63 bits, so only the remainder (not the sticky bit of the sum) can tell. */
    ds41_xacc a;
    ds41_xacc_init(&a);
    ds41_xacc_add(&a, 3.0 * (0x1p23 + 0.5));
    ds41_xacc_add(&a, 0x1p-38);
    const float m = ds41_xacc_round_div(&a, 3);
    ds41_xacc_init(&a);
    ds41_xacc_add(&a, 3.0 * (0x1p23 + 0.5));
    const float t = ds41_xacc_round_div(&a, 3);
    TAP_CHECK(
        same(m, 8388609.0f) && same(t, 8388608.0f),
        "a mean just above a tie only by its division remainder rounds up (%.1f), the exact tie to even "
        "(%.1f)",
        (double)m, (double)t);
}

static void test_fast_path(void) {
    /* The terms are exact doubles whose exact sum is 0: the result is +0, although the fast
     * path's interval [-2^-1074, 2^-1074] rounds to -0 and +0 at its ends (equal floats). */
    const double z[] = {0x1p-1074, -0x1p-1074};
    TAP_CHECK(same(ds41_xsum_f64(z, 2), 0.0f),
              "an exact zero from tiny opposite terms is +0 on the fast path too");
    /* Sixteen additions at 2^20 each round up by ~2^-33 (more than 2^-52 of the absolute sum
     * 2^21), so the double sum lies 2^-29 above the exact one, across the fp32 tie
     * T = 1 + 2^-24: the exact sum is T - 2^-30 (-> 1), the double sum T + 2^-30.  The fast
     * path must use the (n + 2)-term error bound to see that and fall back. */
    double t[20];
    size_t n = 0;
    t[n++] = 0x1p20;
    for (int i = 0; i < 16; i++) t[n++] = 0x1p-33 + 0x1p-60;
    t[n++] = -0x1p20;
    t[n++] = 1.0 + 0x1p-24 + 0x1p-30 - 0x1p-28;
    const float exact = sum_of(t, n), fast = ds41_xsum_f64(t, n);
    TAP_CHECK(
        same(exact, 1.0f) && same(fast, 1.0f),
        "a double sum that crossed an fp32 tie by accumulated rounding falls back to the exact sum (%a, %a)",
        (double)exact, (double)fast);
}

static void test_softplus(void) {
    /* softplus(x) = log1p(exp(x)) until that equals x in fp32; from x = 20 on, x.  Every
     * 1/16 step from 0 to 20 and the switch point itself. */
    int ok = 1;
    float bad = 0;
    for (int i = 0; i <= 20 * 16 && ok; i++) {
        const float x = (float)i / 16.0f;
        ok = same(ds41_rm_softplus(x), (float)log1p(exp((double)x)));
        if (!ok) bad = x;
    }
    TAP_CHECK(ok, "softplus = log1p(exp(x)) on [0, 20] in steps of 1/16 (first bad %g)", (double)bad);
    TAP_CHECK(same(ds41_rm_softplus(20.0f), 20.0f) &&
                  same(ds41_rm_softplus(nextafterf(20.0f, 30.0f)), nextafterf(20.0f, 30.0f)),
              "softplus at and just above the switch point 20 is x");
}

static void test_yarn_clamp(void) {
    /* rd 8, base 10, orig 1000, beta 32 / 0.001: low = floor(2.79) = 2, high = ceil(20.8) = 21,
     * clamped to rd - 1 = 7, so the ramp at pair 3 is (3 - 2) / 5. */
    float f[4], plain[4];
    ds41_rope_freqs(8, 10.0, 0, 4.0, 32.0, 0.001, plain);
    ds41_rope_freqs(8, 10.0, 1000, 4.0, 32.0, 0.001, f);
    const float ramp = (float)(3.0 - 2.0) / 5.0f, smooth = 1.0f - ramp;
    const float want = (plain[3] / 4.0f) * (1.0f - smooth) + plain[3] * smooth;
    TAP_CHECK(same(f[3], want) && same(f[0], plain[0]) && same(f[2], plain[2]),
              "YaRN: a ramp end past the last dimension is clamped to rd - 1 (pair 3: %a, want %a)",
              (double)f[3], (double)want);
}

static void test_fp8_weight_nan(void) {
    /* torch's amax propagates NaN: a NaN anywhere in a weight block, also in a row after
     * the largest value, makes the block's scale NaN (block 0 here: rows and columns 0..31). */
    enum { N = 128, K = 128 };
    static float w[N * K];
    static uint8_t q[N * K];
    uint8_t scale[(N / DS41_QUANT_BLOCK) * (K / DS41_QUANT_BLOCK)] = {0};
    for (size_t i = 0; i < N * K; i++) w[i] = 0.5f;
    w[0] = 3.0f;
    w[5 * K + 7] = NAN;
    ds41_quant_fp8_weight(w, N, K, q, scale);
    TAP_CHECK(scale[0] == DS41_UE8M0_NAN && scale[1] != DS41_UE8M0_NAN,
              "FP8 weight block: a NaN in a later row gives the NaN scale, its neighbour keeps a number (got "
              "0x%02x)",
              scale[0]);
}

static void test_router_two(void) {
    /* The release routes 6 experts and the presets 2: k = 2 (not only k = 1 and 3) is
     * normalised: w = s / (s0 + s1 + 1e-20) * route_scale. */
    const ds41_ops *ops = &ds41_ops_reference;
    enum { E = 5 };
    const float logits[E] = {0.25f, 1.5f, -0.5f, 2.5f, 1.0f}, bias[E] = {0};
    int32_t sel[2];
    float w[2];
    ops->router(ops, logits, bias, 1, E, 2, 1.0f, 2.5f, sel, w, NULL);
    const float s3 = ds41_rm_sqrt(ds41_rm_softplus(2.5f)), s1 = ds41_rm_sqrt(ds41_rm_softplus(1.5f));
    const float d = (s3 + s1) + 1e-20f;
    TAP_CHECK(sel[0] == 3 && sel[1] == 1 && same(w[0], (s3 / d) * 2.5f) && same(w[1], (s1 / d) * 2.5f),
              "router with k = 2: weights normalised over the two, times route_scale");
}

static void test_swiglu_low_gate(void) {
    /* The gate is clamped from above only: a gate far below -limit stays as it is. */
    const ds41_ops *ops = &ds41_ops_reference;
    const float g[2] = {-12.0f, -10.5f}, u[2] = {1.0f, -2.0f};
    float h[2];
    ops->swiglu(ops, g, u, 1, 2, 7.0f, NULL, h);
    TAP_CHECK(same(h[0], ds41_bf16_round(ds41_rm_silu(-12.0f) * 1.0f)) &&
                  same(h[1], ds41_bf16_round(ds41_rm_silu(-10.5f) * -2.0f)),
              "swiglu: a gate below -limit is not clamped (limit 7, gates -12 and -10.5)");
}

/* Column normalisation of the Sinkhorn step, in the reference's order. */
static void col_norm(float *c, int hc, float eps) {
    for (int j = 0; j < hc; j++) {
        float s = c[j];
        for (int i = 1; i < hc; i++) s = s + c[i * hc + j];
        const float d = s + eps;
        for (int i = 0; i < hc; i++) c[i * hc + j] = c[i * hc + j] / d;
    }
}

static void row_norm(float *c, int hc, float eps) {
    for (int i = 0; i < hc; i++) {
        float s = c[i * hc];
        for (int j = 1; j < hc; j++) s = s + c[i * hc + j];
        const float d = s + eps;
        for (int j = 0; j < hc; j++) c[i * hc + j] = c[i * hc + j] / d;
    }
}

static void test_sinkhorn_order(void) {
    /* After the row softmax (+ eps) the first iteration normalises columns only; each later
     * one rows, then columns.  Checked relationally: iters = 1 and 2 against iters = 0
     * followed by those steps. */
    enum { HC = 4 };
    float mix[(2 + HC) * HC], scale[3] = {0.7f, 1.3f, 0.9f}, base[(2 + HC) * HC];
    for (int i = 0; i < (2 + HC) * HC; i++) {
        mix[i] = (float)((i * 37) % 17) / 8.0f - 1.0f;
        base[i] = (float)((i * 11) % 7) / 16.0f;
    }
    const float eps = 1e-3f;
    float pre[HC], post[HC], c0[HC * HC], c1[HC * HC], c2[HC * HC];
    ds41_rm_hc_sinkhorn(mix, scale, base, HC, 0, eps, pre, post, c0);
    ds41_rm_hc_sinkhorn(mix, scale, base, HC, 1, eps, pre, post, c1);
    ds41_rm_hc_sinkhorn(mix, scale, base, HC, 2, eps, pre, post, c2);
    float w1[HC * HC], w2[HC * HC];
    memcpy(w1, c0, sizeof w1);
    col_norm(w1, HC, eps);
    memcpy(w2, w1, sizeof w2);
    row_norm(w2, HC, eps);
    col_norm(w2, HC, eps);
    TAP_CHECK(!memcmp(c1, w1, sizeof w1) && !memcmp(c2, w2, sizeof w2),
              "Sinkhorn: iteration 1 normalises columns only, later ones rows then columns");
}

static void test_kv_budget_and_fork(void) {
    ds41_model_config cfg;
    ds41_error err;
    if (!TAP_CHECK(ds41_model_config_load("tests/data/config/release", &cfg, &err) == 0, "release config"))
        return;
    /* A budget of 63 pages, one below the pool's 64-page growth chunk: exactly 63 pages of
     * 64 entries fit, the next entry is refused (the chunk is cut to the budget). */
    ds41_kv_pool *pool = ds41_kv_pool_new(&cfg, 63ull * 64 * 356, 64, &err);
    ds41_kv_seq *s = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    float lat[512] = {0.5f}, key[128] = {0.25f};
    int filled = s != NULL;
    for (int i = 0; filled && i < 63 * 64; i++) filled = ds41_kv_seq_append(s, 0, lat, key, &err) == 0;
    const int refused = s && ds41_kv_seq_append(s, 0, lat, key, &err) != 0;
    ds41_kv_pool_stats st = {0};
    if (pool) ds41_kv_pool_get_stats(pool, &st);
    TAP_CHECK(
        filled && refused && st.pages_allocated == 63,
        "KV budget of 63 pages (below one growth chunk): 63 pages fill, the next entry is refused (%llu "
        "allocated)",
        (unsigned long long)st.pages_allocated);
    /* A fork has its parent's token count. */
    ds41_kv_seq_set_tokens(s, 4032);
    ds41_kv_seq *f = s ? ds41_kv_seq_fork(s, &err) : NULL;
    TAP_CHECK(f && ds41_kv_seq_tokens(f) == 4032 && ds41_kv_seq_entries(f, 0) == 63 * 64,
              "a fork keeps the parent's token count and entries");
    ds41_kv_seq_free(f);
    ds41_kv_seq_free(s);
    ds41_kv_pool_free(pool);
    ds41_model_config_free(&cfg);
}

/* Distinct tokens drawn in 400 draws from logits l[n] under p. */
static int distinct_draws(const ds41_sampler_params *p, const float *l, uint32_t n, uint32_t *seen_mask) {
    ds41_error err = {{0}};
    ds41_sampler *s = NULL;
    ds41_sampler_scratch *sc = NULL;
    *seen_mask = 0;
    if (ds41_sampler_new(&s, p, n, &err) != 0 || ds41_sampler_scratch_new(&sc, n, &err) != 0) {
        TAP_NOTE("sampler: %s", err.msg);
        ds41_sampler_free(s);
        ds41_sampler_scratch_free(sc);
        return -1;
    }
    for (int i = 0; i < 400; i++) {
        ds41_sample_result r;
        if (ds41_sampler_sample(s, sc, l, n, &r, &err) != 0 || r.token >= 32) {
            *seen_mask = UINT32_MAX;
            break;
        }
        *seen_mask |= 1u << r.token;
    }
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
    return __builtin_popcount(*seen_mask);
}

static void test_top_p_tie(void) {
    /* Four equal logits: each token has exactly a quarter of the mass.  top_p 0.5 is reached
     * exactly by the first two (ties: lower id first), so only tokens 0 and 1 may be drawn;
     * top_p 0.75 exactly by three. */
    const float l[4] = {1.5f, 1.5f, 1.5f, 1.5f};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.seed = 12345;
    p.has_seed = 1;
    uint32_t mask;
    p.top_p = 0.5f;
    const int two = distinct_draws(&p, l, 4, &mask);
    const uint32_t mask2 = mask;
    p.top_p = 0.75f;
    const int three = distinct_draws(&p, l, 4, &mask);
    TAP_CHECK(two == 2 && mask2 == 0x3 && three == 3 && mask == 0x7,
              "top_p at an exact tie keeps the smallest prefix reaching it: 0.5 of 4 equal tokens -> {0, 1} "
              "(mask 0x%x), 0.75 -> {0, 1, 2} (mask 0x%x)",
              mask2, mask);
}

static void min_p_case(float top_p) {
    /* min_p = 1 keeps exactly the tokens whose weight equals the largest (W >= 2^42): the two
     * equal top logits, not the third.  PROCESSED logprobs list only kept tokens.  With top_p
     * < 1 the nucleus comes first and min_p then cuts the kept set (another code path). */
    const float l[3] = {2.0f, 2.0f, 0.0f};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.top_p = top_p;
    p.seed = 7;
    p.has_seed = 1;
    p.min_p = 1.0f;
    p.logprobs = 1;
    p.top_logprobs = 3;
    p.logprobs_mode = DS41_LOGPROBS_PROCESSED;
    ds41_error err = {{0}};
    ds41_sampler *s = NULL;
    ds41_sampler_scratch *sc = NULL;
    ds41_sample_result r = {0};
    const int ok = ds41_sampler_new(&s, &p, 3, &err) == 0 && ds41_sampler_scratch_new(&sc, 3, &err) == 0 &&
                   ds41_sampler_sample(s, sc, l, 3, &r, &err) == 0;
    TAP_CHECK(ok && r.n_top == 2 && r.token < 2 && r.top[0].token == 0 && r.top[1].token == 1,
              "min_p = 1, top_p %g: the tokens exactly at min_p * p_max are kept, the others dropped (%u "
              "listed%s%s)",
              (double)top_p, ok ? (unsigned)r.n_top : 0u, ok ? "" : ": ", ok ? "" : err.msg);
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
}

static void test_min_p_at_threshold(void) {
    min_p_case(1.0f);
    min_p_case(0.999f);
}

static void test_raw_logprob_tail(void) {
    /* RAW logprobs over a vocabulary that is not a multiple of the 4-lane sum: the last
     * token (the largest logit) belongs in the log-sum-exp. */
    const float l[5] = {0.0f, -1.0f, 0.5f, -2.0f, 3.0f};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.seed = 3;
    p.has_seed = 1;
    p.logprobs = 1;
    ds41_error err = {{0}};
    ds41_sampler *s = NULL;
    ds41_sampler_scratch *sc = NULL;
    ds41_sample_result r = {0};
    const int ok = ds41_sampler_new(&s, &p, 5, &err) == 0 && ds41_sampler_scratch_new(&sc, 5, &err) == 0 &&
                   ds41_sampler_sample(s, sc, l, 5, &r, &err) == 0;
    double sum = 0;
    for (int i = 0; i < 5; i++) sum += exp((double)l[i] - 3.0);
    const double want = (double)l[ok ? r.token : 0] - (3.0 + log(sum));
    TAP_CHECK(ok && fabs((double)r.logprob - want) < 1e-5,
              "RAW logprob over 5 logits includes the last one in the normaliser (%g, want %g)",
              (double)r.logprob, want);
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
}

/* Feeds the pieces; returns the emitted text (static) and whether a stop happened. */
static const char *stop_run(const char *stop, const char *const *pieces, size_t n, int *stopped) {
    static char out[256];
    size_t o = 0;
    ds41_error err = {{0}};
    ds41_stop_matcher *m = NULL;
    const size_t len = strlen(stop);
    *stopped = -1;
    if (ds41_stop_matcher_new(&m, &stop, &len, 1, &err) != 0) return "";
    ds41_stop_output so;
    for (size_t i = 0; i < n; i++) {
        if (ds41_stop_matcher_feed(m, pieces[i], strlen(pieces[i]), &so, &err) != 0) break;
        if (o + so.len < sizeof out) memcpy(out + o, so.text, so.len), o += so.len;
        *stopped = so.stopped;
    }
    out[o] = 0;
    ds41_stop_matcher_free(m);
    return out;
}

static void test_stop_edges(void) {
    /* "aaabb" is not in "aaabaabb", but a prefix table that falls back one level only finds
     * it there. */
    int stopped;
    const char *const t1[] = {"aaab", "aabb"};
    const char *o1 = stop_run("aaabb", t1, 2, &stopped);
    TAP_CHECK(stopped == 0 && strcmp(o1, "aaabaabb") == 0,
              "stop string aaabb is not found in aaabaabb (KMP fallback through two levels; emitted '%s')",
              o1);
    /* A piece ending inside a 4-byte character led by F4 (U+100000..U+10FFFF) holds the
     * partial character back; the next piece completes it. */
    const char *const t2[] = {"a\xF4\x8F\xBF"};
    const char *o2 = stop_run("zz", t2, 1, &stopped);
    const int held = strcmp(o2, "a") == 0;
    const char *const t3[] = {"a\xF4\x8F\xBF", "\xBF"
                                               "b"};
    const char *o3 = stop_run("zz", t3, 2, &stopped);
    TAP_CHECK(held && strcmp(o3, "a\xF4\x8F\xBF\xBF"
                                 "b") == 0,
              "a partial U+10FFFF (lead byte F4) at a piece's end is held back until complete");
}

static void test_top_k_one(void) {
    /* top_k = 1 keeps only the largest logit, whatever the temperature. */
    const float l[4] = {0.0f, 1.0f, 0.5f, 0.75f};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.seed = 99;
    p.has_seed = 1;
    p.temperature = 2.0f;
    p.top_k = 1;
    uint32_t mask;
    const int n = distinct_draws(&p, l, 4, &mask);
    TAP_CHECK(n == 1 && mask == 0x2, "top_k = 1 draws only the argmax (mask 0x%x)", mask);
}

static int repr_is(double x, const char *want) {
    ds41_buf b = {0};
    ds41_py_float_repr(x, &b);
    const int ok = b.data && b.len == strlen(want) && memcmp(b.data, want, b.len) == 0;
    if (!ok) TAP_NOTE("repr(%.17g) = '%.*s', want '%s'", x, (int)b.len, b.data ? b.data : "", want);
    ds41_buf_free(&b);
    return ok;
}

/* json.loads: 1 = parsed (text of a string/int in *text if given), 0 = Python would raise. */
static int py_loads(const char *s, size_t n, char *text, size_t text_cap) {
    ds41_py *v = NULL;
    bool is_json = false;
    ds41_error err = {{0}};
    if (ds41_py_loads(s, n, &v, &is_json, &err) != 0) return -1;
    if (v && text && v->text) snprintf(text, text_cap, "%s", v->text);
    ds41_py_free(v);
    return is_json ? 1 : 0;
}

static void test_pyjson_edges(void) {
    /* Python's float repr switches to an exponent below 1e-4 and from 1e16 on. */
    TAP_CHECK(repr_is(1e-05, "1e-05") && repr_is(0.0001, "0.0001") && repr_is(1e15, "1000000000000000.0") &&
                  repr_is(1e16, "1e+16"),
              "float repr at both exponent switch points: 1e-05, 0.0001, 1000000000000000.0, 1e+16");
    /* A surrogate pair whose low half is U+DFFF combines to U+1F7FF. */
    char t[64] = "";
    const char *pair = "\"\\ud83d\\udfff\"";
    TAP_CHECK(py_loads(pair, strlen(pair), t, sizeof t) == 1 && strcmp(t, "\xF0\x9F\x9F\xBF") == 0,
              "json.loads combines \\ud83d\\udfff (low surrogate U+DFFF) into U+1F7FF");
    /* Raw control characters: U+001F is refused like U+0000, U+0020 is text. */
    TAP_CHECK(py_loads("\"a\x1f"
                       "b\"",
                       5, NULL, 0) == 0 &&
                  py_loads("\"a b\"", 5, NULL, 0) == 1,
              "json.loads refuses a raw U+001F in a string and accepts a space");
    /* int(): 4300 digits are the limit, inclusive. */
    static char digits[4302];
    memset(digits, '7', 4301);
    TAP_CHECK(py_loads(digits, 4300, NULL, 0) == 1 && py_loads(digits, 4301, NULL, 0) == 0,
              "json.loads accepts a 4300-digit integer and refuses 4301 digits (Python's limit)");
}

/* Parses a one-tensor header; returns 0 or -1 with the message in msg. */
static int st_header(const char *json, uint64_t data_bytes, char *msg, size_t cap) {
    uint8_t buf[512];
    const size_t jl = strlen(json);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)jl >> (8 * i));
    memcpy(buf + 8, json, jl);
    ds41_st_header h;
    ds41_error e = {{0}};
    const int rc = ds41_checkpoint_parse_header(buf, 8 + jl, 8 + jl + data_bytes, "mem.safetensors", &h, &e);
    snprintf(msg, cap, "%s", rc ? e.msg : "");
    ds41_checkpoint_header_free(&h);
    return rc;
}

static void test_safetensors_offsets(void) {
    char m[sizeof(ds41_error)];
    /* data_offsets [5, 4): the end is one before the begin (named as such, not as a size). */
    const int r1 =
        st_header("{\"t\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[5,4]}}", 16, m, sizeof m);
    TAP_CHECK(r1 != 0 && strstr(m, "end before they begin"), "safetensors: data_offsets [5, 4) -> '%s'", m);
    /* A span of 12 bytes for a shape of 8 (F32 [2]): refused, as is 4. */
    const int r2 =
        st_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]}}", 16, m, sizeof m);
    const int r3 =
        st_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 16, m, sizeof m);
    const int r4 =
        st_header("{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16, m, sizeof m);
    TAP_CHECK(r2 != 0 && r3 != 0 && r4 == 0, "safetensors: a span one element longer or shorter than the "
                                             "shape is refused, the exact one accepted");
}

static void test_snapshot_edges(void) {
    char root[256];
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-bound-XXXXXX")) {
        TAP_CHECK(0, "temporary directory under $TMPDIR or /tmp");
        return;
    }
    static uint8_t noise[1500];
    uint64_t x = 7;
    for (size_t i = 0; i < sizeof noise; i++) {
        x = x * 6364136223846793005u + 1442695040888963407u;
        noise[i] = (uint8_t)(x >> 56);
    }
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 100 + i;
    const uint8_t model[DS41_SNAPSHOT_ID_BYTES] = {4, 5, 6};
    ds41_error err = {{0}};

    /* A head that claims zero token ids is refused for that reason. */
    char path[700];
    snprintf(path, sizeof path, "%s/z.snap", root);
    uint64_t bytes = 0;
    uint8_t *buf = NULL;
    if (ds41_snapshot_write(path, model, &SNAP_OWNER, ids, 3, noise, 100, NULL, 0, NULL, &bytes, &err) == 0 &&
        (buf = malloc(bytes)) != NULL) {
        FILE *f = fopen(path, "rb");
        const size_t got = f ? fread(buf, 1, bytes, f) : 0;
        if (f) fclose(f);
        memset(buf + 48, 0, 8); /* n_ids */
        ds41_snapshot snap;
        const int rc =
            got == bytes ? ds41_snapshot_parse(buf, bytes, "z.snap", NULL, 1u << 20, &snap, &err) : 0;
        TAP_CHECK(rc == -1 && strstr(err.msg, "0 token ids"),
                  "snapshot: a head with 0 token ids is refused as such (%s)", err.msg);
        free(buf);
    }

    /* The store's byte cap: two snapshots exactly filling the cap stay; a third evicts the least
     * recently used; one snapshot larger than the cap is kept (never the one just saved).  The
     * snapshots have the same number of ids and the same state, so the same file size. */
    char d1[700], d2[700];
    snprintf(d1, sizeof d1, "%s/probe", root);
    snprintf(d2, sizeof d2, "%s/capped", root);
    ds41_snapshot_store_opts o = {0};
    memcpy(o.model_id, model, sizeof model);
    o.dir = d1;
    ds41_snapshot_store *st = NULL;
    ds41_snapshot_entry e1 = {0}, e2 = {0};
    if (ds41_snapshot_store_open(&o, &st, &err) != 0) {
        TAP_CHECK(0, "store open: %s", err.msg);
        tmpdir_remove(root);
        return;
    }
    ds41_snapshot_store_save(st, &SNAP_OWNER, ids, 10, noise, 1000, NULL, 0, &e1, &err);
    ds41_snapshot_store_free(st);
    const uint64_t one = e1.bytes;
    o.dir = d2;
    o.max_bytes = 2 * one;
    ds41_snapshot_store_stats ss = {0};
    if (one && ds41_snapshot_store_open(&o, &st, &err) == 0) {
        ds41_snapshot_store_save(st, &SNAP_OWNER, ids, 10, noise, 1000, NULL, 0, &e1, &err);
        ds41_snapshot_store_save(st, &SNAP_OWNER, ids + 10, 10, noise, 1000, NULL, 0, &e2, &err);
        ds41_snapshot_store_get_stats(st, &ss);
        TAP_CHECK(
            e1.bytes == one && e2.bytes == one && ss.bytes == 2 * one && ss.evictions == 0 &&
                ds41_snapshot_store_contains(st, &SNAP_OWNER, ids, 10) &&
                ds41_snapshot_store_contains(st, &SNAP_OWNER, ids + 10, 10),
            "snapshot store: two snapshots exactly filling max_bytes (%llu) evict nothing (%llu evictions)",
            (unsigned long long)(2 * one), (unsigned long long)ss.evictions);
        ds41_snapshot_store_save(st, &SNAP_OWNER, ids + 20, 10, noise, 1000, NULL, 0, &e2, &err);
        ds41_snapshot_store_get_stats(st, &ss);
        TAP_CHECK(ss.evictions == 1 && !ds41_snapshot_store_contains(st, &SNAP_OWNER, ids, 10) &&
                      ds41_snapshot_store_contains(st, &SNAP_OWNER, ids + 10, 10) &&
                      ds41_snapshot_store_contains(st, &SNAP_OWNER, ids + 20, 10),
                  "snapshot store: over max_bytes the oldest snapshot is evicted, the others stay");
        ds41_snapshot_store_free(st);
    }
    snprintf(d2, sizeof d2, "%s/tiny", root);
    o.dir = d2;
    o.max_bytes = one / 2;
    if (one && ds41_snapshot_store_open(&o, &st, &err) == 0) {
        ds41_snapshot_store_save(st, &SNAP_OWNER, ids, 10, noise, 1000, NULL, 0, &e1, &err);
        ds41_snapshot_store_get_stats(st, &ss);
        TAP_CHECK(ds41_snapshot_store_contains(st, &SNAP_OWNER, ids, 10) && ss.evictions == 0,
                  "snapshot store: a snapshot larger than max_bytes is kept when it is the one just saved");
        ds41_snapshot_store_free(st);
    }
    tmpdir_remove(root);
}

static void test_config_utf8_edges(void) {
    /* Command-line overrides are checked as strict UTF-8: overlong forms (C0 AF = '/', E0 80 AF,
     * F0 80 80 AF) and surrogates are refused, the shortest forms around them accepted. */
    ds41_daemon_config cfg;
    ds41_error err = {{0}};
    if (ds41_daemon_config_defaults(&cfg, &err) != 0) {
        TAP_CHECK(0, "daemon config defaults: %s", err.msg);
        return;
    }
    static const char *const bad[] = {"/run/\xC0\xAF.sock", "/run/\xE0\x80\xAF.sock",
                                      "/run/\xF0\x80\x80\xAF.sock", "/run/\xED\xA0\x80.sock"};
    static const char *const good[] = {"/run/\xC2\x80.sock", "/run/\xE0\xA0\x80.sock",
                                       "/run/\xF0\x90\x80\x80.sock"};
    int refused = 0, accepted = 0;
    for (size_t i = 0; i < 4; i++)
        refused += ds41_daemon_config_set(&cfg, "listen.socket", bad[i], &err) == -1;
    for (size_t i = 0; i < 3; i++)
        accepted += ds41_daemon_config_set(&cfg, "listen.socket", good[i], &err) == 0;
    TAP_CHECK(
        refused == 4 && accepted == 3,
        "overrides: overlong UTF-8 forms and a surrogate are refused (%d of 4), the shortest forms at each "
        "length's lower edge accepted (%d of 3)",
        refused, accepted);
    ds41_daemon_config_free(&cfg);
}

/* Loads the release config, applies key = value and finalizes; 0 or -1 with err. */
static int release_with(const char *key, const char *value, ds41_error *err) {
    ds41_model_config cfg;
    if (ds41_model_config_load("tests/data/config/release", &cfg, err) != 0) return -2;
    int rc = ds41_model_config_set(&cfg, key, value, err);
    if (rc == 0) rc = ds41_model_config_finalize(&cfg, err);
    ds41_model_config_free(&cfg);
    return rc;
}

static void test_model_config_edges(void) {
    ds41_error e1 = {{0}}, e2 = {{0}};
    int a = release_with("dspark_block_size", "4096", &e1),
        b = release_with("dspark_block_size", "4097", &e2);
    TAP_CHECK(
        a == 0 && b == -1 && strstr(e2.msg, "dspark_block_size"),
        "config.json: an integer at its maximum (dspark_block_size 4096) is accepted, one past refused (%s)",
        e2.msg);
    a = release_with("kv_source_layers", "[2, 8, 8, 14, 20]", &e1);
    TAP_CHECK(a == -1 && strstr(e1.msg, "sorted and unique"),
              "config.json: a repeated source layer is refused (%s)", e1.msg);
    ds41_model_config cfg;
    char routed[32] = "", plus1[32] = "";
    if (ds41_model_config_load("tests/data/config/release", &cfg, &e1) == 0) {
        snprintf(routed, sizeof routed, "%lld", (long long)cfg.n_routed_experts);
        snprintf(plus1, sizeof plus1, "%lld", (long long)cfg.n_routed_experts + 1);
        ds41_model_config_free(&cfg);
    }
    a = release_with("n_activated_experts", routed, &e1);
    b = release_with("n_activated_experts", plus1, &e2);
    TAP_CHECK(a == 0 && b == -1 && strstr(e2.msg, "n_activated_experts"),
              "config.json: routing all %s experts is accepted, one more refused (%s%s)", routed,
              a ? e1.msg : "", e2.msg);
}

int main(void) {
    test_model_config_edges();
    test_config_utf8_edges();
    test_snapshot_edges();
    test_safetensors_offsets();
    test_pyjson_edges();
    test_top_k_one();
    test_raw_logprob_tail();
    test_stop_edges();
    test_top_p_tie();
    test_min_p_at_threshold();
    test_kv_budget_and_fork();
    test_router_two();
    test_swiglu_low_gate();
    test_sinkhorn_order();
    test_sum_of();
    test_fast_path();
    test_softplus();
    test_yarn_clamp();
    test_fp8_weight_nan();
    return tap_done();
}
