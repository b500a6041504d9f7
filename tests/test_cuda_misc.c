/* The CUDA backend's misc family (cuda/op_misc.h) on the host: the kernels'
 * arithmetic and decomposition as the emulation runs them (cuda/emu_misc.c
 * over cuda/num_misc.h), against the reference ops (engine/backend/ops_ref.c)
 * and the fast CPU ops:
 *  - the codecs exhaustively against engine/model/quant.c, and the ports of
 *    refmath's shared sequences (hc Sinkhorn, MoE combine, rope cos/sin and
 *    rotation, the double-evaluated functions) bit for bit on many random
 *    and extreme inputs;
 *  - every op: bit for bit where num_misc.h says bit-exact (NaN, inf, ties,
 *    large |x| included); the reducing ops bit for bit where the double sums
 *    are exact (inputs on a coarse grid) and within their bound (one bf16
 *    ulp of the output) on general inputs;
 *  - batch invariance: each row alone = the rows batched, bit for bit, for
 *    M in 1..17 and a large M;
 *  - the counters and that every weight / metadata range an op names covers
 *    what it reads (the test context hands out exact-size copies, so a read
 *    past them is a sanitizer error). */
#include "cuda/cuda_ctx.h"
#include "cuda/num_misc.h"
#include "cuda/op_misc.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/ops.h"
#include "engine/backend/refmath.h"
#include "engine/model/quant.h"
#include "tests/float_bits.h"
#include "tests/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- a host test context (identity device: copies in host memory) ----------------------- */

/* weight() and meta() return malloc'd copies of exactly the bytes the op
 * names (freed after the op), so an op that reads past its declared range
 * reads past an allocation; scratch() a buffer grown on demand. */
typedef struct test_ctx {
    ds41_cuda_ctx c;
    void *copies[64];
    int n_copies;
    void *scratch;
    size_t scratch_n;
} test_ctx;

static void *keep_copy(test_ctx *t, const void *p, size_t n) {
    void *q = malloc(n ? n : 1);
    if (!q || t->n_copies == 64) abort();
    memcpy(q, p, n);
    t->copies[t->n_copies++] = q;
    return q;
}
static const void *t_weight(ds41_cuda_ctx *c, const void *p, size_t n) {
    return keep_copy((test_ctx *)c, p, n);
}
static void *t_meta(ds41_cuda_ctx *c, const void *host, size_t n) {
    return keep_copy((test_ctx *)c, host, n);
}
static void *t_scratch(ds41_cuda_ctx *c, size_t n) {
    test_ctx *t = (test_ctx *)c;
    if (n > t->scratch_n) {
        free(t->scratch);
        t->scratch = malloc(n);
        if (!t->scratch) abort();
        t->scratch_n = n;
    }
    return t->scratch;
}

static test_ctx tctx;
static ds41_ops emu;

/* Free the copies of the last op (call after every op). */
static void done(void) {
    for (int i = 0; i < tctx.n_copies; i++) free(tctx.copies[i]);
    tctx.n_copies = 0;
}

static void emu_init(void) {
    memset(&tctx, 0, sizeof tctx);
    tctx.c.weight = t_weight;
    tctx.c.meta = t_meta;
    tctx.c.scratch = t_scratch;
    tctx.c.emulated = true;
    memset(&emu, 0, sizeof emu);
    emu.name = "cuda-emu misc";
    emu.ctx = &tctx.c;
#define SET(op) emu.op = ds41_cuda_emu_##op;
    SET(rmsnorm)
    SET(hc_mix)
    SET(hc_pre)
    SET(hc_post)
    SET(rope_table)
    SET(rope)
    SET(swiglu) SET(moe_combine) SET(router) SET(engram_mix) SET(embed) SET(gather_rows) SET(fp8_rows)
#undef SET
}

static const ds41_ops *ref = &ds41_ops_reference;
static const ds41_ops *fast;

/* ---- inputs -------------------------------------------------------------------------------- */

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint64_t next_u64(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return rng;
}
static double urand(void) { /* [-1, 1) */
    return (double)(next_u64() >> 11) / 4503599627370496.0 - 1.0;
}
static float bfr(double x) {
    return ds41_bf16_round((float)x);
}
/* General fp32 values over many binades (not bf16: the squares round). */
static void fill_wide(float *x, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(urand() * scale * ldexp(1.0, (int)(next_u64() % 9) - 4));
}
static void fill_bf16(float *x, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) x[i] = bfr(urand() * scale);
}
/* bf16 values of magnitude in [1/4, 4): squares and products with a
 * 2^-10-grid weight sum exactly in double over thousands of terms. */
static void fill_grid(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = bfr(ldexp(1.0 + (urand() + 1.0) / 2.0, (int)(next_u64() % 4) - 2));
        x[i] = next_u64() & 1 ? -v : v;
    }
}

/* |a - b| <= one bf16 ulp of b (a NaN only against a NaN). */
static int bf16_close(const float *a, const float *b, size_t n, size_t *diff) {
    int ok = 1;
    *diff = 0;
    for (size_t i = 0; i < n; i++) {
        if (same(a[i], b[i]) || (isnan(a[i]) && isnan(b[i]))) continue;
        (*diff)++;
        if (isnan(a[i]) || isnan(b[i])) {
            ok = 0;
            continue;
        }
        int e;
        frexpf(b[i], &e);
        ok &= fabs((double)a[i] - b[i]) <= ldexp(1.0, e - 8);
    }
    return ok;
}

static int bits_equal(const void *a, const void *b, size_t n) {
    return memcmp(a, b, n) == 0;
}

/* Float arrays of `bytes` bytes: the same bits, or NaN in both (a NaN's
 * sign and payload are not part of any op's contract: the device returns
 * its canonical NaN, and a C compiler may compute x - y as x + (-y)). */
static int vsame(float a, float b) {
    return same(a, b) || (isnan(a) && isnan(b));
}
static int fsame(const float *a, const float *b, size_t bytes) {
    for (size_t i = 0; i < bytes / sizeof *a; i++)
        if (!vsame(a[i], b[i])) return 0;
    return 1;
}

/* max |a - b| / max |b| <= tol, NaN only against NaN. */
static int rel_close(const float *a, const float *b, size_t n, double tol) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) != isnan(b[i])) return 0;
        num = fmax(num, fabs((double)a[i] - b[i]));
        den = fmax(den, fabs((double)b[i]));
    }
    return (den > 0 ? num / den : num) <= tol;
}

/* ---- codecs and shared sequences ------------------------------------------------------------ */

static float f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void test_codecs(void) {
    int ok = 1;
    for (uint32_t b = 0; b < 65536; b++)
        ok &= same(ds41_hd_bf16_to_f32((uint16_t)b), ds41_bf16_to_f32((uint16_t)b));
    TAP_CHECK(ok, "bf16 -> fp32: all 65536 patterns = quant.c");
    ok = 1;
    /* Every fp32 pattern whose low 16 bits are a tie, one below, one above,
     * zero, for every high half (signs, subnormals, inf, NaN payloads). */
    static const uint32_t lows[] = {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x0001u, 0x4000u};
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (size_t l = 0; l < sizeof lows / sizeof lows[0]; l++) {
            const float x = f32(hi << 16 | lows[l]);
            ok &=
                ds41_hd_bf16_bits(x) == ds41_bf16_bits(x) && same(ds41_hd_bf16_round(x), ds41_bf16_round(x));
        }
    for (int i = 0; i < 200000; i++) {
        const float x = f32((uint32_t)next_u64());
        ok &= ds41_hd_bf16_bits(x) == ds41_bf16_bits(x);
    }
    TAP_CHECK(ok,
              "fp32 -> bf16 (nearest even, NaN quieted): every high half x ties and neighbours = quant.c");
    ok = 1;
    for (int b = 0; b < 256; b++) ok &= same(ds41_hd_e4m3_to_f32((uint8_t)b), ds41_e4m3_table[b]);
    TAP_CHECK(ok, "e4m3 decode: all 256 codes = quant.c's table (bits: -0, subnormals, NaN and -NaN)");
    ok = 1;
    for (int b = 0; b < 256; b++) ok &= same(ds41_hd_ue8m0_to_f32((uint8_t)b), ds41_ue8m0_to_f32((uint8_t)b));
    TAP_CHECK(ok, "ue8m0 decode: all 256 scales = quant.c (0: 2^-127 subnormal, 255: NaN)");
}

/* Arguments that stress the double evaluations: around 0, the softplus
 * cut at 20, exp's overflow and underflow, inf, NaN, subnormals. */
static float edge_arg(int i) {
    static const float e[] = {0.0f,     -0.0f,     20.0f,   0x1.fffffep4f, 0x1.000002p4f, 88.7f, 89.0f,
                              -87.3f,   -104.0f,   -110.0f, 1e-40f,        -1e-40f,       1e30f, -1e30f,
                              INFINITY, -INFINITY, NAN,     710.0f,        -745.0f};
    const int n = (int)(sizeof e / sizeof e[0]);
    if (i < n) return e[i];
    return (float)(urand() * ldexp(1.0, (int)(next_u64() % 14) - 6));
}

static void test_functions(void) {
    int ok = 1;
    for (int i = 0; i < 100000; i++) {
        const float x = edge_arg(i);
        ok &= vsame(ds41_hd_exp(x), ds41_rm_exp(x)) && vsame(ds41_hd_sigmoid(x), ds41_rm_sigmoid(x)) &&
              vsame(ds41_hd_silu(x), ds41_rm_silu(x)) && vsame(ds41_hd_softplus(x), ds41_rm_softplus(x)) &&
              vsame(ds41_hd_sqrt(fabsf(x)), ds41_rm_sqrt(fabsf(x))) &&
              vsame(ds41_hd_rsqrt(fabsf(x)), ds41_rm_rsqrt(fabsf(x)));
    }
    TAP_CHECK(ok,
              "exp, sigmoid, silu, softplus, sqrt, rsqrt: = refmath on 100000 arguments (edges, NaN, inf)");
}

static void test_sinkhorn_port(void) {
    int ok = 1, cases = 0;
    float mix[(2 + 8) * 8], scale[3], base[(2 + 8) * 8];
    float pre[8], post[8], comb[64], pre_r[8], post_r[8], comb_r[64];
    for (int it = 0; it < 3000; it++) {
        const int hc = 1 + (int)(next_u64() % 8), iters = (int)(next_u64() % 21);
        const int n_mix = (2 + hc) * hc;
        const double mag = ldexp(1.0, (int)(next_u64() % 12) - 4); /* up to 128: exp underflows to 0 */
        for (int j = 0; j < n_mix; j++) {
            mix[j] = (float)(urand() * mag);
            base[j] = (float)(urand() * 2.0);
        }
        if (it % 50 == 7) mix[next_u64() % (unsigned)n_mix] = it % 100 == 7 ? NAN : INFINITY;
        for (int j = 0; j < 3; j++) scale[j] = (float)(urand() * 2.0);
        const float eps = it % 3 ? 1e-6f : 0.0f;
        ds41_hd_hc_sinkhorn(mix, scale, base, hc, iters, eps, pre, post, comb);
        ds41_rm_hc_sinkhorn(mix, scale, base, hc, iters, eps, pre_r, post_r, comb_r);
        ok &= fsame(pre, pre_r, (size_t)hc * 4) && fsame(post, post_r, (size_t)hc * 4) &&
              fsame(comb, comb_r, (size_t)hc * hc * 4);
        cases++;
    }
    TAP_CHECK(ok,
              "hc Sinkhorn port = ds41_rm_hc_sinkhorn bit for bit (%d cases: hc 1..8, 0..20 iterations, "
              "large mixes, NaN / inf)",
              cases);
}

static void test_combine_port(void) {
    enum { D = 37, R = 9 };
    static float oe[R * D], shared[D], out_r[D];
    uint32_t slot[R];
    int ok = 1;
    for (int it = 0; it < 2000; it++) {
        const size_t n = next_u64() % (R + 1);
        fill_wide(oe, R * D, 100.0);
        fill_bf16(shared, D, 10.0);
        if (it % 10 == 3) {
            oe[next_u64() % (R * D)] = -0.0f;
            shared[next_u64() % D] = -0.0f;
            oe[next_u64() % (R * D)] = it % 20 == 3 ? INFINITY : NAN;
            oe[next_u64() % (R * D)] = 3e38f;
        }
        for (size_t j = 0; j < n; j++) slot[j] = (uint32_t)(next_u64() % R);
        ds41_rm_moe_combine_token(oe, slot, n, shared, D, out_r);
        for (size_t d = 0; d < D; d++)
            ok &= vsame(ds41_hd_moe_combine_elem(oe, slot, n, shared[d], D, d), out_r[d]);
    }
    TAP_CHECK(
        ok, "MoE combine port = ds41_rm_moe_combine_token bit for bit (2000 tokens, 0..9 rows, -0, inf, NaN, "
            "overflow)");
}

static void test_rope_port(void) {
    enum { NP = 32 };
    float f[NP], cs[2 * NP], cs_r[2 * NP], x[2 * NP], xr[2 * NP];
    int ok = 1;
    for (int it = 0; it < 2000; it++) {
        ds41_rope_freqs(2 * NP, it % 2 ? 10000.0 : 160000.0, it % 3 ? 0 : 4096, 16.0, 32.0, 1.0, f);
        const uint64_t pos = it < 10 ? (uint64_t)it : next_u64() % (it % 4 ? 70000u : 1000000000u);
        ds41_rope_cos_sin(f, NP, pos, cs_r);
        for (int i = 0; i < NP; i++) ds41_hd_rope_cos_sin(f[i], pos, cs + 2 * i);
        ok &= fsame(cs, cs_r, sizeof cs);
        fill_wide(x, 2 * NP, 50.0);
        if (it % 25 == 1) x[next_u64() % (2 * NP)] = it % 50 == 1 ? NAN : -INFINITY;
        for (int inv = 0; inv < 2; inv++) {
            memcpy(xr, x, sizeof x);
            float xe[2 * NP];
            memcpy(xe, x, sizeof x);
            ds41_rope_apply(xr, NP, cs_r, inv);
            for (int i = 0; i < NP; i++) ds41_hd_rope_pair(xe + 2 * i, cs_r[2 * i], cs_r[2 * i + 1], inv);
            ok &= fsame(xe, xr, sizeof xe);
        }
    }
    TAP_CHECK(ok, "rope cos/sin and rotation ports = ds41_rope_cos_sin / ds41_rope_apply bit for bit (2000 "
                  "positions up to 1e9, YaRN tables, forward and inverse, NaN / inf)");
}

/* fp32 values of magnitude in [1, 2) with full 24-bit significands: their
 * squares must be rounded to fp32 (§10.5) and then sum exactly in double. */
static void fill_f32_unit(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = (float)((urand() >= 0 ? 1.0 : -1.0) * (1.0 + fabs(urand())));
}

static void test_block_sum(void) {
    /* Exact terms: any order gives the exact sum; so the butterfly is a
     * sum of all 256 partials, each counted once. */
    double v[DS41_MISC_THREADS], t[DS41_MISC_THREADS];
    int ok = 1;
    for (int it = 0; it < 200; it++) {
        double exact = 0;
        for (int i = 0; i < DS41_MISC_THREADS; i++) {
            v[i] = (double)(int64_t)(next_u64() % 2000001) - 1000000.0;
            t[i] = v[i];
            exact += t[i];
        }
        ok &= ds41_misc_block_sum(v) == exact;
    }
    /* One partial at a time: each lane's value reaches the total once. */
    for (int i = 0; i < DS41_MISC_THREADS; i++) {
        memset(v, 0, sizeof v);
        v[i] = 1.0;
        ok &= ds41_misc_block_sum(v) == 1.0;
    }
    TAP_CHECK(ok, "block sum: every one of the 256 partials counted once");
    /* The kernels' mean of squares (one element per thread here) against
     * the reference's: each square rounded to fp32 first, so with fp32
     * inputs in [1, 2) the double sum is exact and the mean bit for bit. */
    float x[DS41_MISC_THREADS];
    ok = 1;
    for (int it = 0; it < 5000; it++) {
        const size_t n = 1 + next_u64() % DS41_MISC_THREADS;
        fill_f32_unit(x, n);
        for (size_t i = 0; i < DS41_MISC_THREADS; i++) v[i] = i < n ? ds41_misc_sq_term(x[i]) : 0.0;
        ok &= same(ds41_misc_mean(ds41_misc_block_sum(v), n), ds41_mean_sq_f32(x, n));
    }
    TAP_CHECK(
        ok, "mean of squares (squares rounded to fp32, block sum, one division): = ds41_mean_sq_f32 bit for "
            "bit on 5000 rows of full-precision fp32");
}

/* ---- ops: reference, fast CPU, emulation -------------------------------------------------------- */

enum { BIG_M = 64 };

static void test_rmsnorm(void) {
    enum { N = 1000 };
    static float x[BIG_M * N], y[BIG_M * N], yr[BIG_M * N], yf[BIG_M * N], one[N];
    static uint16_t w[N];
    for (int i = 0; i < N; i++) w[i] = ds41_bf16_bits((float)(1.0 + 0.5 * urand()));
    static const char *const what[] = {"exact sums of bf16 squares", "exact sums of rounded fp32 squares",
                                       "general fp32"};
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 0)
            fill_grid(x, BIG_M * N);
        else if (pass == 1)
            fill_f32_unit(x, BIG_M * N);
        else
            fill_wide(x, BIG_M * N, 3.0);
        int eq = 1, close_r = 1, close_f = 1, inv = 1;
        size_t d1 = 0, d2 = 0;
        /* M = 1..17 and a large M */
        for (size_t M = 1; M <= BIG_M; M = M == 17 ? BIG_M : M + 1) {
            ref->rmsnorm(ref, w, x, M, N, 1e-6f, yr);
            fast->rmsnorm(fast, w, x, M, N, 1e-6f, yf);
            emu.rmsnorm(&emu, w, x, M, N, 1e-6f, y);
            done();
            for (size_t m = 0; m < M; m++) {
                emu.rmsnorm(&emu, w, x + m * N, 1, N, 1e-6f, one);
                done();
                inv &= fsame(one, y + m * N, sizeof one);
            }
            size_t e1, e2;
            eq &= fsame(y, yr, M * N * 4);
            close_r &= bf16_close(y, yr, M * N, &e1);
            close_f &= bf16_close(y, yf, M * N, &e2);
            d1 += e1;
            d2 += e2;
        }
        TAP_CHECK(
            (pass < 2 ? eq : close_r) && close_f && inv,
            "rmsnorm M 1..17 and %d, %s: %s the reference (%zu differ), fast within a bf16 ulp (%zu differ), "
            "rows alone = batched",
            BIG_M, what[pass], pass < 2 ? "bit for bit" : "within a bf16 ulp of", d1, d2);
    }
}

/* Rows the reference defines at the edges: all zeros (r = rsqrt(eps)),
 * squares that overflow to inf (r = 0, so inf * 0 = NaN where x is inf),
 * squares that underflow to 0, a NaN, an infinity. */
static void test_rmsnorm_edges(void) {
    enum { N = 300, M = 5 };
    static float x[M * N], y[M * N], yr[M * N], yf[M * N];
    static uint16_t w[N];
    for (int i = 0; i < N; i++) w[i] = ds41_bf16_bits((float)(1.0 + 0.5 * urand()));
    fill_bf16(x, M * N, 2.0);
    for (int i = 0; i < N; i++) {
        x[i] = 0.0f;
        x[2 * N + i] = (float)(urand() * 1e-30);
    }
    x[N + 7] = 1e20f;
    x[N + 100] = -3e25f;
    x[3 * N + 5] = NAN;
    x[4 * N + 9] = -INFINITY;
    ref->rmsnorm(ref, w, x, M, N, 1e-6f, yr);
    fast->rmsnorm(fast, w, x, M, N, 1e-6f, yf);
    emu.rmsnorm(&emu, w, x, M, N, 1e-6f, y);
    done();
    TAP_CHECK(
        fsame(y, yr, sizeof y) && fsame(y, yf, sizeof y),
        "rmsnorm edge rows (zeros, overflowing and underflowing squares, NaN, -inf): = reference and fast");
}

static void test_hc(void) {
    enum { HC = 4, D = 300, NMIX = (2 + HC) * HC };
    static const size_t Ms[] = {1, 2, 17, 40};
    static float h[40 * HC * D], fn[NMIX * HC * D], o[40 * D];
    float scale[3] = {0.5f, 0.7f, 0.9f}, base[NMIX];
    static float pre[40 * HC], post[40 * HC], comb[40 * HC * HC];
    static float pre_r[40 * HC], post_r[40 * HC], comb_r[40 * HC * HC];
    static float pre_f[40 * HC], post_f[40 * HC], comb_f[40 * HC * HC];
    for (int i = 0; i < NMIX; i++) base[i] = (float)(urand() * 0.5);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0) {
            fill_grid(h, sizeof h / 4);
            for (size_t i = 0; i < sizeof fn / 4; i++)
                fn[i] = (float)ldexp((double)(next_u64() % 201) - 100.0, -12);
        } else {
            fill_bf16(h, sizeof h / 4, 1.0);
            fill_wide(fn, sizeof fn / 4, 0.05);
        }
        for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
            const size_t M = Ms[mi];
            ref->hc_mix(ref, fn, scale, base, h, M, HC, D, 1e-6f, 20, 1e-6f, pre_r, post_r, comb_r);
            fast->hc_mix(fast, fn, scale, base, h, M, HC, D, 1e-6f, 20, 1e-6f, pre_f, post_f, comb_f);
            const uint64_t w0 = tctx.c.stats.weight_bytes, f0 = tctx.c.stats.flops;
            emu.hc_mix(&emu, fn, scale, base, h, M, HC, D, 1e-6f, 20, 1e-6f, pre, post, comb);
            done();
            const int counted = tctx.c.stats.weight_bytes - w0 == ((uint64_t)NMIX * HC * D + NMIX + 3) * 4 &&
                                tctx.c.stats.flops - f0 == 2 * (uint64_t)M * (NMIX + 1) * HC * D;
            int inv = 1;
            for (size_t m = 0; m < M; m++) {
                float p1[HC], q1[HC], c1[HC * HC];
                emu.hc_mix(&emu, fn, scale, base, h + m * HC * D, 1, HC, D, 1e-6f, 20, 1e-6f, p1, q1, c1);
                done();
                inv &= fsame(p1, pre + m * HC, sizeof p1) && fsame(q1, post + m * HC, sizeof q1) &&
                       fsame(c1, comb + m * HC * HC, sizeof c1);
            }
            const int eq_r = fsame(pre, pre_r, M * HC * 4) && fsame(post, post_r, M * HC * 4) &&
                             fsame(comb, comb_r, M * HC * HC * 4);
            const int close_r = rel_close(pre, pre_r, M * HC, 1e-5) &&
                                rel_close(post, post_r, M * HC, 1e-5) &&
                                rel_close(comb, comb_r, M * HC * HC, 1e-4);
            const int close_f = rel_close(pre, pre_f, M * HC, 1e-5) &&
                                rel_close(post, post_f, M * HC, 1e-5) &&
                                rel_close(comb, comb_f, M * HC * HC, 1e-4);
            TAP_CHECK((pass == 0 ? eq_r : close_r) && close_f && inv && counted,
                      "hc_mix + Sinkhorn M %zu, %s: %s the reference, close to fast, rows alone = batched, "
                      "counters",
                      M, pass == 0 ? "exact dots" : "general", pass == 0 ? "bit for bit" : "fp32 close to");
        }
    }
    /* hc_pre / hc_post on the reference's mixes: bit for bit, including a
     * NaN and an infinity in the stream. */
    static float hp[40 * D], hp_r[40 * D], hp_f[40 * D], ho[40 * HC * D], ho_r[40 * HC * D],
        ho_f[40 * HC * D];
    fill_bf16(h, sizeof h / 4, 4.0);
    fill_bf16(o, sizeof o / 4, 4.0);
    h[5] = NAN;
    h[HC * D + 7] = INFINITY;
    o[3] = -INFINITY;
    for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
        const size_t M = Ms[mi];
        ref->hc_pre(ref, h, pre_r, M, HC, D, hp_r);
        ref->hc_post(ref, o, h, post_r, comb_r, M, HC, D, ho_r);
        fast->hc_pre(fast, h, pre_r, M, HC, D, hp_f);
        fast->hc_post(fast, o, h, post_r, comb_r, M, HC, D, ho_f);
        emu.hc_pre(&emu, h, pre_r, M, HC, D, hp);
        emu.hc_post(&emu, o, h, post_r, comb_r, M, HC, D, ho);
        done();
        TAP_CHECK(fsame(hp, hp_r, M * D * 4) && fsame(ho, ho_r, M * HC * D * 4) &&
                      fsame(hp, hp_f, M * D * 4) && fsame(ho, ho_f, M * HC * D * 4),
                  "hc_pre / hc_post M %zu: = reference and fast bit for bit (NaN, inf in the stream)", M);
    }
}

static void test_rope(void) {
    enum { M = 17, H = 3, NP = 16, OFF = 5, HS = 2 * NP + OFF, RS = H * HS + 3 };
    uint64_t pos[M];
    float freqs[NP];
    static float cs[M * 2 * NP], cs_r[M * 2 * NP], x[M * RS], xr[M * RS], xf[M * RS], x0[M * RS];
    for (int m = 0; m < M; m++) pos[m] = m < 3 ? (uint64_t)m : next_u64() % 1000000u;
    ds41_rope_freqs(2 * NP, 10000.0, 4096, 16.0, 32.0, 1.0, freqs);
    ref->rope_table(ref, freqs, NP, pos, M, cs_r);
    emu.rope_table(&emu, freqs, NP, pos, M, cs);
    done();
    int inv = 1;
    for (int m = 0; m < M; m++) {
        float one[2 * NP];
        emu.rope_table(&emu, freqs, NP, pos + m, 1, one);
        done();
        inv &= fsame(one, cs + m * 2 * NP, sizeof one);
    }
    TAP_CHECK(
        fsame(cs, cs_r, sizeof cs) && inv,
        "rope_table (%d rows, positions up to 1e6, YaRN): = reference bit for bit, rows alone = batched", M);
    fill_wide(x0, M * RS, 20.0);
    x0[OFF + 1] = NAN;
    for (int inverse = 0; inverse < 2; inverse++) {
        memcpy(x, x0, sizeof x);
        memcpy(xr, x0, sizeof x);
        memcpy(xf, x0, sizeof x);
        ref->rope(ref, xr + OFF, M, H, RS, HS, NP, cs_r, inverse);
        fast->rope(fast, xf + OFF, M, H, RS, HS, NP, cs_r, inverse);
        emu.rope(&emu, x + OFF, M, H, RS, HS, NP, cs_r, inverse);
        done();
        /* Rows one by one over a fresh copy: the same bits. */
        static float x1[M * RS];
        memcpy(x1, x0, sizeof x1);
        for (int m = 0; m < M; m++) {
            emu.rope(&emu, x1 + m * RS + OFF, 1, H, RS, HS, NP, cs_r + m * 2 * NP, inverse);
            done();
        }
        TAP_CHECK(
            fsame(x, xr, sizeof x) && fsame(x, xf, sizeof x) && fsame(x1, x, sizeof x),
            "rope %s (%d rows x %d heads at strides, gaps untouched): = reference and fast bit for bit, rows "
            "alone = batched",
            inverse ? "inverse" : "forward", M, H);
    }
}

static void test_swiglu(void) {
    enum { M = 17, N = 133 };
    static float g[M * N], u[M * N], out[M * N], out_r[M * N], out_f[M * N], one[N];
    float route[M];
    fill_bf16(g, M * N, 30.0);
    fill_bf16(u, M * N, 30.0);
    for (int m = 0; m < M; m++) route[m] = (float)(urand() + 1.5);
    /* edges: NaN, inf, silu's exp overflow and underflow */
    static const float ge[] = {NAN, INFINITY, -INFINITY, 100.0f, -100.0f, -1000.0f, 1e30f, 0.0f, -0.0f};
    for (size_t i = 0; i < sizeof ge / sizeof ge[0]; i++) {
        g[i * 7] = ge[i];
        u[i * 11 + 1] = ge[sizeof ge / sizeof ge[0] - 1 - i];
    }
    static const float limits[] = {0.0f, 10.0f};
    for (int li = 0; li < 2; li++)
        for (int rt = 0; rt < 2; rt++) {
            const float *r = rt ? route : NULL;
            ref->swiglu(ref, g, u, M, N, limits[li], r, out_r);
            fast->swiglu(fast, g, u, M, N, limits[li], r, out_f);
            emu.swiglu(&emu, g, u, M, N, limits[li], r, out);
            done();
            int inv = 1;
            for (int m = 0; m < M; m++) {
                emu.swiglu(&emu, g + m * N, u + m * N, 1, N, limits[li], r ? r + m : NULL, one);
                done();
                inv &= fsame(one, out + m * N, sizeof one);
            }
            TAP_CHECK(fsame(out, out_r, sizeof out) && fsame(out, out_f, sizeof out) && inv,
                      "swiglu limit %g, %s: = reference and fast bit for bit (NaN, inf, exp overflow), rows "
                      "alone = "
                      "batched",
                      (double)limits[li], rt ? "routed" : "shared");
        }
}

static void test_moe_combine(void) {
    enum { M = 20, K = 6, D = 77, ROWS = M * K };
    static float oe[ROWS * D], shared[M * D], out[M * D], out_r[M * D], out_f[M * D], one[D];
    uint32_t slot[M * K];
    fill_bf16(oe, ROWS * D, 5.0);
    fill_bf16(shared, M * D, 5.0);
    oe[3] = NAN;
    oe[D + 4] = -0.0f;
    shared[4] = -0.0f;
    for (int i = 0; i < M * K; i++) slot[i] = (uint32_t)(next_u64() % ROWS);
    ref->moe_combine(ref, oe, slot, K, shared, M, D, out_r);
    fast->moe_combine(fast, oe, slot, K, shared, M, D, out_f);
    emu.moe_combine(&emu, oe, slot, K, shared, M, D, out);
    done();
    int inv = 1;
    for (int m = 0; m < M; m++) {
        emu.moe_combine(&emu, oe, slot + m * K, K, shared + m * D, 1, D, one);
        done();
        inv &= fsame(one, out + m * D, sizeof one);
    }
    TAP_CHECK(fsame(out, out_r, sizeof out) && fsame(out, out_f, sizeof out) && inv,
              "moe_combine (%d tokens x %d slots): = reference and fast bit for bit, rows alone = batched", M,
              K);
}

/* Router on logits with many exact ties (scores equal, biases equal), NaN,
 * large |logit| (softplus's linear branch) and inf. */
static void test_router(void) {
    enum { E = 40, K = 6, M = 33 };
    static float logits[M * E], sel_s[M * E], sel_s_r[M * E], sel_s1[E], w[M * K], w_r[M * K], w_f[M * K],
        w1[K];
    float bias[E];
    static int32_t s[M * K], s_r[M * K], s_f[M * K], s1[K];
    for (int e = 0; e < E; e++) bias[e] = e % 5 == 0 ? 0.0f : (float)(ldexp((double)(next_u64() % 5), -4));
    for (int m = 0; m < M; m++)
        for (int e = 0; e < E; e++) {
            float v = (float)ldexp((double)(next_u64() % 7) - 3.0, -1); /* coarse: ties */
            if (m % 4 == 1) v = (float)(urand() * 40.0);                /* > 20 / temp: linear branch */
            if (m % 8 == 3 && e % 13 == 2) v = NAN;
            if (m == 5) v = 1.0f;          /* every expert ties on the score */
            if (m == 6 && e == 0) v = NAN; /* a NaN first expert: stays chosen */
            if (m == 7 && e == 9) v = INFINITY;
            logits[m * E + e] = v;
        }
    static const float temps[] = {1.0f, 0.7f};
    for (int ti = 0; ti < 2; ti++) {
        ref->router(ref, logits, bias, M, E, K, temps[ti], 2.5f, s_r, w_r, sel_s_r);
        fast->router(fast, logits, bias, M, E, K, temps[ti], 2.5f, s_f, w_f, NULL);
        emu.router(&emu, logits, bias, M, E, K, temps[ti], 2.5f, s, w, sel_s);
        done();
        int inv = 1;
        for (int m = 0; m < M; m++) {
            emu.router(&emu, logits + m * E, bias, 1, E, K, temps[ti], 2.5f, s1, w1, sel_s1);
            done();
            inv &= bits_equal(s1, s + m * K, sizeof s1) && fsame(w1, w + m * K, sizeof w1) &&
                   fsame(sel_s1, sel_s + m * E, sizeof sel_s1);
        }
        /* The tie rule directly: row 5 ties every score, so the choice is
         * the highest bias, lower ids first. */
        int ties = 1, prev = -1;
        for (int i = 0; i < K; i++) {
            const int e = s[5 * K + i];
            ties &= prev < 0 || bias[e] < bias[prev] || (bias[e] == bias[prev] && e > prev);
            prev = e;
        }
        TAP_CHECK(bits_equal(s, s_r, sizeof s) && fsame(w, w_r, sizeof w) &&
                      fsame(sel_s, sel_s_r, sizeof sel_s) && bits_equal(s, s_f, sizeof s) &&
                      fsame(w, w_f, sizeof w) && ties && inv,
                  "router temp %g (%d tokens, %d experts, top %d; ties, NaN, inf, large logits): choices, "
                  "weights and "
                  "selection scores = reference bit for bit, = fast, lower id on ties, rows alone = batched",
                  (double)temps[ti], M, E, K);
    }
    /* k = 1: no normalisation; the selection output may be NULL. */
    ref->router(ref, logits, bias, M, E, 1, 1.0f, 1.0f, s_r, w_r, NULL);
    emu.router(&emu, logits, bias, M, E, 1, 1.0f, 1.0f, s, w, NULL);
    done();
    TAP_CHECK(bits_equal(s, s_r, M * 4) && fsame(w, w_r, M * 4),
              "router top 1, no selection output: = reference");
}

static void test_engram(void) {
    enum { HC = 4, D = 700 };
    static const size_t Ms[] = {1, 3, 17, 24};
    static float h0[24 * HC * D], h[24 * HC * D], hr[24 * HC * D], hf[24 * HC * D], h1[HC * D],
        kv[24 * (HC + 1) * D], wqk[HC * D];
    const float ds = (float)pow((double)D, -0.5);
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 0) {
            fill_grid(h0, sizeof h0 / 4);
            fill_grid(kv, sizeof kv / 4);
            for (int i = 0; i < HC * D; i++) wqk[i] = (float)ldexp(64.0 + (double)(next_u64() % 64), -6);
        } else {
            fill_bf16(h0, sizeof h0 / 4, 2.0);
            fill_bf16(kv, sizeof kv / 4, 2.0);
            for (int i = 0; i < HC * D; i++) wqk[i] = (float)(1.0 + 0.1 * urand());
        }
        for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
            const size_t M = Ms[mi], n = M * HC * D;
            memcpy(h, h0, n * 4);
            memcpy(hr, h0, n * 4);
            memcpy(hf, h0, n * 4);
            ref->engram_mix(ref, hr, kv, wqk, M, HC, D, 1e-6f, ds);
            fast->engram_mix(fast, hf, kv, wqk, M, HC, D, 1e-6f, ds);
            emu.engram_mix(&emu, h, kv, wqk, M, HC, D, 1e-6f, ds);
            done();
            int inv = 1;
            for (size_t m = 0; m < M; m++) {
                memcpy(h1, h0 + m * HC * D, sizeof h1);
                emu.engram_mix(&emu, h1, kv + m * (HC + 1) * D, wqk, 1, HC, D, 1e-6f, ds);
                done();
                inv &= fsame(h1, h + m * HC * D, sizeof h1);
            }
            size_t d1, d2;
            const int c1 = bf16_close(h, hr, n, &d1), c2 = bf16_close(h, hf, n, &d2);
            TAP_CHECK((pass == 0 ? fsame(h, hr, n * 4) : c1) && c2 && inv,
                      "engram_mix M %zu, %s: %s the reference (%zu differ), fast within a bf16 ulp (%zu), "
                      "rows alone "
                      "= batched",
                      M, pass == 0 ? "exact sums" : "general",
                      pass == 0 ? "bit for bit" : "within a bf16 ulp of", d1, d2);
        }
    }
}

static void test_gathers(void) {
    enum { V = 50, ED = 70, HC = 4, M = 9 };
    static uint16_t table[V * ED];
    for (int i = 0; i < V * ED; i++) table[i] = (uint16_t)next_u64();
    const int32_t ids[M] = {0, 49, 7, 7, 3, 12, 48, 0, 5};
    static float emb[M * HC * ED], emb_r[M * HC * ED];
    ref->embed(ref, table, ids, M, HC, ED, emb_r);
    const uint64_t w0 = tctx.c.stats.weight_bytes;
    emu.embed(&emu, table, ids, M, HC, ED, emb);
    done();
    TAP_CHECK(bits_equal(emb, emb_r, sizeof emb) && tctx.c.stats.weight_bytes - w0 == (uint64_t)M * ED * 2,
              "embed (every bf16 pattern class incl. NaN): = reference bit for bit, weight bytes counted");
    /* FP8 rows: every code with scales across the range (0: 2^-127, 254:
     * 2^127 overflows, 255: NaN), cols not a multiple of 32. */
    enum { FV = 40, FC = 300, FSC = (FC + 31) / 32, FN = 7 };
    static uint8_t fq[FV * FC], fs[FV * FSC];
    for (int i = 0; i < FV * FC; i++) fq[i] = (uint8_t)i;
    for (int i = 0; i < FV * FSC; i++) fs[i] = (uint8_t)(i % 3 == 0 ? (i * 37) % 256 : 100 + i % 50);
    fs[0] = 0;
    fs[1] = 255;
    fs[2] = 254;
    const int64_t rows[FN] = {0, 39, 3, 3, 17, 1, 2};
    static float fr[FN * FC], fr_r[FN * FC];
    ref->fp8_rows(ref, fq, fs, rows, FN, FC, fr_r);
    emu.fp8_rows(&emu, fq, fs, rows, FN, FC, fr);
    done();
    TAP_CHECK(fsame(fr, fr_r, sizeof fr), "fp8_rows (all codes, extreme scales, partial block): = reference");
    /* gather_rows: byte rows at a stride, repeated and out-of-order ids,
     * odd sizes. */
    enum { SR = 30, STRIDE = 53, RB = 37, GN = 11 };
    static unsigned char src[SR * STRIDE], dst[GN * RB], dst_r[GN * RB];
    for (int i = 0; i < SR * STRIDE; i++) src[i] = (unsigned char)next_u64();
    const uint32_t idx[GN] = {29, 0, 5, 5, 17, 1, 28, 3, 3, 10, 0};
    memset(dst, 0xAB, sizeof dst);
    memset(dst_r, 0xAB, sizeof dst_r);
    ref->gather_rows(ref, dst_r, src, STRIDE, idx, GN, RB);
    emu.gather_rows(&emu, dst, src, STRIDE, idx, GN, RB);
    done();
    emu.gather_rows(&emu, dst, src, STRIDE, idx, 0, RB);
    done();
    TAP_CHECK(bits_equal(dst, dst_r, sizeof dst),
              "gather_rows (odd stride and row bytes, repeats): = reference");
}

int main(void) {
    ds41_error err;
    emu_init();
    ds41_cpu_opts o = {.threads = 2};
    ds41_backend *be = ds41_backend_cpu_new(&o, &err);
    if (!be) {
        TAP_CHECK(0, "fast CPU backend: %s", err.msg);
        return tap_done();
    }
    fast = &be->ops;
    test_codecs();
    test_functions();
    test_sinkhorn_port();
    test_combine_port();
    test_rope_port();
    test_block_sum();
    test_rmsnorm();
    test_rmsnorm_edges();
    test_hc();
    test_rope();
    test_swiglu();
    test_moe_combine();
    test_router();
    test_engram();
    test_gathers();
    TAP_CHECK(tctx.c.stats.op_calls > 0, "the ops count their calls (%llu)",
              (unsigned long long)tctx.c.stats.op_calls);
    free(tctx.scratch);
    ds41_backend_free(be);
    return tap_done();
}
