/* The CUDA backend's linear family (cuda/num_linear.h, cuda/emu_linear.c),
 * on the host: the kernels' emulation is bit for bit what the kernels
 * compute (cuda/k_linear.cu calls the same num_linear.h functions in the
 * same decomposition), so this checks the kernels' numerics:
 *  - the host+device codecs exhaustively against engine/model/quant.c, and
 *    the 1x32 act_quant against ds41_act_quant;
 *  - every output against a model of the documented order written here
 *    independently (lane partials, halving tree, bf16 rounding), bit for
 *    bit: a different tree order or a missing rounding fails;
 *  - against the reference op within the documented bound (and the fast CPU
 *    path's 2 (K + 2) 2^-24 sum|x w| + 1 bf16 ulp), against the fast CPU op
 *    within both bounds together; the EXACT variants bit-equal to the
 *    reference (and to the fast CPU op's EXACT linears), including sums
 *    that sit on an fp32 tie or cancel (the exact accumulator's fallback);
 *  - batch invariance: each row alone = the rows batched, M 1..17 and 64;
 *    linear_batch = n linear calls (Ms[i] = 0 writes nothing). */
#include "cuda/op_linear.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/ops.h"
#include "engine/model/quant.h"
#include "tests/cuda_test_ctx.h"
#include "tests/float_bits.h"
#include "tests/linear_data.h"
#include "tests/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x2545f4914f6cdd1dull;
static double urand(void) { /* [-1, 1) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng >> 11) / 4503599627370496.0 - 1.0;
}
static uint32_t urand32(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng >> 32);
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* Bitwise equal, or both NaN. */
static int same_or_nan(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return bits(a) == bits(b);
}

static test_cuda_ctx tctx;
static ds41_ops emu;
static ds41_backend *fast;

/* ---- codecs ------------------------------------------------------------------------------------ */

static void test_codecs(void) {
    int ok = 1;
    for (int b = 0; b < 256; b++) ok &= bits(ds41_hd_e4m3_to_f32((uint8_t)b)) == bits(ds41_e4m3_table[b]);
    TAP_CHECK(ok, "e4m3 decode: all 256 codes bit-equal to ds41_e4m3_table (signed NaNs, -0)");
    ok = 1;
    for (int c = 0; c < 256; c++)
        ok &= bits(ds41_hd_e2m1_to_f32((uint8_t)c)) == bits(ds41_e2m1_to_f32((uint8_t)c));
    TAP_CHECK(ok, "e2m1 decode: all 16 codes (and ignored high bits) bit-equal to quant.c");
    ok = 1;
    for (int b = 0; b < 256; b++)
        ok &= bits(ds41_hd_ue8m0_to_f32((uint8_t)b)) == bits(ds41_ue8m0_to_f32((uint8_t)b));
    TAP_CHECK(ok, "ue8m0 decode: all 256 bytes bit-equal (0 = 2^-127, 255 = NaN)");
    ok = 1;
    for (uint32_t h = 0; h < 65536; h++)
        ok &= bits(ds41_hd_bf16_to_f32((uint16_t)h)) == bits(ds41_bf16_to_f32((uint16_t)h));
    TAP_CHECK(ok, "bf16 decode: all 65536 patterns");

    /* Encoders: every upper half with low halves at and around the bf16 tie
     * and the e4m3 grids' ties (low bits 0 puts an e4m3 normal / subnormal
     * tie on every pattern whose dropped bits are 100..0), plus random ones. */
    static const uint32_t lows[] = {0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
    uint32_t bad_bf = 0, bad_e4 = 0, bad_sc = 0;
    int ok_bf = 1, ok_e4 = 1, ok_sc = 1;
    for (uint32_t h = 0; h < 65536; h++)
        for (size_t j = 0; j < sizeof lows / sizeof lows[0] + 2; j++) {
            const uint32_t u = h << 16 | (j < sizeof lows / sizeof lows[0] ? lows[j] : (urand32() & 0xFFFF));
            const float f = from_bits(u);
            if (!same(ds41_hd_bf16_round(f), ds41_bf16_round(f))) ok_bf = 0, bad_bf = u;
            if (ds41_hd_e4m3_from_f32(f) != ds41_e4m3_from_f32(f)) ok_e4 = 0, bad_e4 = u;
            if (ds41_hd_ue8m0_scale_byte(f, DS41_FP8_RECIP) != ds41_ue8m0_scale_byte(f, DS41_FP8_RECIP) ||
                ds41_hd_ue8m0_scale_byte(f, DS41_FP4_RECIP) != ds41_ue8m0_scale_byte(f, DS41_FP4_RECIP))
                ok_sc = 0, bad_sc = u;
        }
    TAP_CHECK(ok_bf, "bf16 RNE rounding = ds41_bf16_round over 524288 patterns (ties, NaN payloads)");
    if (!ok_bf) TAP_NOTE("first bad 0x%08x", bad_bf);
    TAP_CHECK(ok_e4,
              "e4m3 encode = ds41_e4m3_from_f32 over 524288 patterns (ties, subnormal grid, clamp, NaN)");
    if (!ok_e4) TAP_NOTE("first bad 0x%08x", bad_e4);
    TAP_CHECK(ok_sc, "ue8m0 scale byte = ds41_ue8m0_scale_byte (FP8 and FP4 reciprocals) over 524288 amaxes");
    if (!ok_sc) TAP_NOTE("first bad 0x%08x", bad_sc);

    /* act_quant of one block against ds41_act_quant. */
    ok = 1;
    int bad_len = 0;
    for (int it = 0; it < 20000; it++) {
        const int len = 1 + (int)(urand32() % 32);
        float x[32];
        const int e = (int)(urand32() % 60) - 30;
        for (int i = 0; i < len; i++) {
            const uint32_t r = urand32() % 64;
            x[i] = r == 0                  ? 0.0f
                   : r == 1                ? -0.0f
                   : r == 2 && it % 7 == 0 ? NAN
                   : r == 3 && it % 5 == 0 ? (it & 1 ? INFINITY : -INFINITY)
                   : r == 4                ? 1e-6f
                                           : ds41_bf16_round((float)ldexp(urand(), e));
        }
        if (it % 11 == 0) /* all tiny: the 1e-4 amax floor */
            for (int i = 0; i < len; i++) x[i] = ds41_bf16_round((float)(urand() * 1e-6));
        uint8_t q1[32], q2[32], s1, s2;
        s1 = ds41_lin_act_quant_block(x, len, q1);
        ds41_act_quant(x, (size_t)len, q2, &s2);
        if (s1 != s2 || memcmp(q1, q2, (size_t)len) != 0) ok = 0, bad_len = len;
    }
    TAP_CHECK(ok, "act_quant of a 1x32 block (lengths 1..32, zeros, NaN, inf, tiny blocks) = ds41_act_quant");
    if (!ok) TAP_NOTE("a block of %d differs", bad_len);
}

/* ---- linear data ------------------------------------------------------------------------------ */

static void make_linear(ds41_linear_kind kind, size_t M, size_t N, size_t K, lin_data *d) {
    lin_data_make(kind, M, N, K, urand, d);
}

static void free_linear(lin_data *d) {
    lin_data_free(d);
}

static int is_exact(ds41_linear_out out) {
    return out == DS41_OUT_BF16_EXACT || out == DS41_OUT_F32_EXACT;
}

/* ---- the documented order, written independently ---------------------------------------------- */

/* Halving tree over 32 lane values: level h adds lane l + h into lane l
 * (l < h), h = 16 .. 1 (the butterfly's lane 0). */
static float halve32(float *v) {
    for (int h = 16; h >= 1; h /= 2)
        for (int l = 0; l < h; l++) v[l] = v[l] + v[l + h];
    return v[0];
}

/* y of the non-exact variants as num_linear.h documents them. */
static void spec_linear(const lin_data *d, ds41_linear_out out, float *y) {
    const size_t M = d->M, N = d->N, K = d->K, nkb = (K + 31) / 32;
    const int fp4 = d->w.kind == DS41_LINEAR_FP4;
    uint8_t *codes = malloc(K + 1), *sbytes = malloc(nkb + 1);
    for (size_t m = 0; m < M; m++) {
        if (d->w.kind != DS41_LINEAR_BF16) ds41_act_quant(d->x + m * K, K, codes, sbytes);
        for (size_t n = 0; n < N; n++) {
            float v[32];
            for (int l = 0; l < 32; l++) {
                float acc = 0.0f;
                if (d->w.kind == DS41_LINEAR_BF16) {
                    for (size_t c = (size_t)l; c * 8 < K; c += 32)
                        for (size_t k = c * 8; k < c * 8 + 8 && k < K; k++)
                            acc = fmaf(d->x[m * K + k], ds41_bf16_to_f32(d->bf[n * K + k]), acc);
                } else {
                    for (size_t kb = (size_t)l; kb < nkb; kb += 32) {
                        float b = 0.0f;
                        for (size_t k = kb * 32; k < kb * 32 + 32 && k < K; k++) {
                            const float wv =
                                fp4 ? ds41_e2m1_table[(d->q[n * ((K + 1) / 2) + k / 2] >> (k % 2 * 4)) & 15]
                                    : ds41_e4m3_table[d->q[n * K + k]];
                            b = fmaf(ds41_e4m3_table[codes[k]], wv, b);
                        }
                        const uint8_t sw = d->sc[(fp4 ? n : n / 32) * (size_t)d->w.scale_cols + kb];
                        const float sc = ds41_ue8m0_to_f32(sbytes[kb]) * ds41_ue8m0_to_f32(sw);
                        const float t = b * sc;
                        acc = acc + t;
                    }
                }
                v[l] = acc;
            }
            const float r = halve32(v);
            y[m * N + n] =
                d->w.kind != DS41_LINEAR_BF16 || ds41_linear_out_bf16(out) ? ds41_bf16_round(r) : r;
        }
    }
    free(codes);
    free(sbytes);
}

static int ceil_log2(size_t n) {
    int l = 0;
    while (((size_t)1 << l) < n) l++;
    return l;
}

/* The documented rounding depth (cuda/num_linear.h) of a non-exact variant
 * against the reference. */
static double doc_depth(ds41_linear_kind kind, size_t K) {
    if (kind == DS41_LINEAR_BF16) {
        const size_t lane = 8 * ((K + 255) / 256), nc = (K + 7) / 8;
        return (double)(K < lane ? K : lane) + ceil_log2(nc < 32 ? nc : 32);
    }
    const size_t nkb = (K + 31) / 32;
    return (double)((K < 32 ? K : 32) - 1 + (nkb + 31) / 32 - 1 + (size_t)ceil_log2(nkb < 32 ? nkb : 32) +
                    nkb);
}

/* |a - b| <= depth 2^-24 S (1 + 2^-10) + (bf16 outputs) one bf16 ulp. */
static int within_depth(float a, float b, double s, double depth, int bf16_out) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    double tol = depth * 0x1p-24 * s * (1.0 + 0x1p-10);
    if (bf16_out) tol += fmax(fabs((double)a), fabs((double)b)) * 0x1p-7;
    return fabs((double)a - (double)b) <= tol + 1e-30;
}

static const char *kind_name(ds41_linear_kind k) {
    return k == DS41_LINEAR_FP8 ? "FP8" : k == DS41_LINEAR_FP4 ? "FP4" : "BF16";
}
static const char *out_name(ds41_linear_out o) {
    static const char *n[] = {"BF16", "F32", "BF16_EXACT", "F32_EXACT"};
    return n[o];
}

static void run_linear(const ds41_ops *ops, const lin_data *d, size_t M, const float *x, float *y,
                       ds41_linear_out out) {
    ops->linear(ops, &d->w, x, M, y, out);
    test_cuda_ctx_reset(&tctx);
}

static void test_linear_case(ds41_linear_kind kind, size_t M, size_t N, size_t K, ds41_linear_out out) {
    lin_data d;
    make_linear(kind, M, N, K, &d);
    const size_t MN = M * N;
    float *y = malloc(MN * sizeof *y), *ref = malloc(MN * sizeof *ref), *fy = malloc(MN * sizeof *fy);
    float *spec = malloc(MN * sizeof *spec), *row = malloc(N * sizeof *row);
    double *mag = malloc(MN * sizeof *mag);
    for (size_t m = 0; m < M; m++)
        for (size_t n = 0; n < N; n++) {
            double s = 0;
            for (size_t k = 0; k < K; k++) s += fabs((double)d.xq[m * K + k] * d.wd[n * K + k]);
            mag[m * N + n] = s;
        }
    run_linear(&emu, &d, M, d.x, y, out);
    ds41_ops_reference.linear(&ds41_ops_reference, &d.w, d.x, M, ref, out);
    fast->ops.linear(&fast->ops, &d.w, d.x, M, fy, out);
    const int bf = kind != DS41_LINEAR_BF16 || ds41_linear_out_bf16(out);
    const double depth = doc_depth(kind, K), fast_depth = 2.0 * (double)(K + 2);
    int ok_order = 1, ok_ref = 1, ok_fast = 1, inv = 1;
    size_t bad = 0;
    if (!is_exact(out)) spec_linear(&d, out, spec);
    for (size_t i = 0; i < MN; i++) {
        if (is_exact(out)) {
            /* error 0: the reference's value, and the fast CPU op's EXACT one */
            if (!same_or_nan(y[i], ref[i]) && ok_ref) ok_ref = 0, bad = i;
            ok_fast &= same_or_nan(y[i], fy[i]);
        } else {
            if (!same_or_nan(y[i], spec[i]) && ok_order) ok_order = 0, bad = i;
            if (!(within_depth(y[i], ref[i], mag[i], depth, bf) &&
                  within_depth(y[i], ref[i], mag[i], fast_depth, bf)) &&
                ok_ref)
                ok_ref = 0, bad = i;
            ok_fast &= within_depth(y[i], fy[i], mag[i], depth + fast_depth, bf) ||
                       within_depth(y[i], fy[i], mag[i], 0, bf) /* both bf16, a rounding apart */;
        }
    }
    for (size_t m = 0; m < M && inv; m++) {
        run_linear(&emu, &d, 1, d.x + m * K, row, out);
        inv = memcmp(row, y + m * N, N * sizeof *row) == 0;
    }
    TAP_CHECK(ok_order && ok_ref && ok_fast && inv,
              "emu linear %s out %s M=%zu N=%zu K=%zu: %s, fast CPU op %s, rows alone = batched",
              kind_name(kind), out_name(out), M, N, K,
              is_exact(out) ? "= reference bit for bit"
                            : "= documented order bit for bit, reference within bound",
              is_exact(out) ? "EXACT equal" : "within both bounds");
    if (!ok_order || !ok_ref)
        TAP_NOTE("element %zu: got %.9g, order model %.9g, reference %.9g, magnitude %.3g", bad,
                 (double)y[bad], is_exact(out) ? 0.0 : (double)spec[bad], (double)ref[bad], mag[bad]);
    if (!ok_fast) TAP_NOTE("fast CPU op differs beyond the bounds");
    if (!inv) TAP_NOTE("a row alone differs from the batch");
    free(y), free(ref), free(fy), free(spec), free(row), free(mag);
    free_linear(&d);
}

static void test_linears(void) {
    static const struct {
        size_t M, N, K;
    } shapes[] = {{1, 1, 1},   {3, 7, 31},  {5, 33, 33},  {17, 9, 45},  {2, 65, 100}, {64, 5, 200},
                  {7, 3, 513}, {9, 7, 777}, {4, 5, 1100}, {2, 3, 2100}, {1, 1, 257}};
    const int quick = getenv("DS41_SANITIZED") != NULL;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        if (quick && shapes[s].K > 1000 && s % 2) continue;
        for (int kind = DS41_LINEAR_FP8; kind <= DS41_LINEAR_BF16; kind++)
            for (int out = 0; out < 4; out++) {
                if (kind != DS41_LINEAR_BF16 && (out == DS41_OUT_F32 || out == DS41_OUT_F32_EXACT)) continue;
                test_linear_case((ds41_linear_kind)kind, shapes[s].M, shapes[s].N, shapes[s].K,
                                 (ds41_linear_out)out);
            }
    }
}

/* M 1..17 and 64: the first M rows of a batch of 64 give the same bits. */
static void test_batch_sizes(void) {
    for (int kind = DS41_LINEAR_FP8; kind <= DS41_LINEAR_BF16; kind++)
        for (int ex = 0; ex < 2; ex++) {
            const ds41_linear_out out = ex ? DS41_OUT_BF16_EXACT : DS41_OUT_BF16;
            lin_data d;
            const size_t N = 13, K = 301;
            make_linear((ds41_linear_kind)kind, 64, N, K, &d);
            float *all = malloc(64 * N * sizeof *all), *part = malloc(64 * N * sizeof *part);
            run_linear(&emu, &d, 64, d.x, all, out);
            int ok = 1;
            size_t bad = 0;
            for (size_t M = 1; M <= 17 && ok; M++) {
                /* a different starting row, so a row's place in the call changes too */
                const size_t r0 = (M * 5) % (64 - M);
                run_linear(&emu, &d, M, d.x + r0 * K, part, out);
                if (memcmp(part, all + r0 * N, M * N * sizeof *part) != 0) ok = 0, bad = M;
            }
            TAP_CHECK(
                ok,
                "emu linear %s out %s: rows [r0, r0+M) for M = 1..17 = the same rows of M = 64, bit for bit",
                kind_name((ds41_linear_kind)kind), out_name(out));
            if (!ok) TAP_NOTE("M = %zu differs", bad);
            free(all), free(part);
            free_linear(&d);
        }
}

/* linear_batch = n linear calls; Ms[i] = 0 leaves ys[i] alone. */
static void test_batch_op(void) {
    enum { NL = 20 };
    for (int ex = 0; ex < 2; ex++) {
        const ds41_linear_out out = ex ? DS41_OUT_BF16_EXACT : DS41_OUT_BF16;
        lin_data d[NL];
        const ds41_linear *ws[NL];
        const float *xs[NL];
        size_t Ms[NL];
        float *ys[NL], *one[NL];
        for (int i = 0; i < NL; i++) {
            static const size_t mlist[] = {3, 0, 1, 17, 2, 64, 0, 5};
            const size_t M = mlist[i % 8], N = 1 + (size_t)(i * 7 % 40), K = 32 + (size_t)(i * 37 % 300);
            make_linear(i % 3 == 2   ? DS41_LINEAR_FP8
                        : i % 3 == 1 ? DS41_LINEAR_BF16
                                     : DS41_LINEAR_FP4,
                        M ? M : 1, N, K, &d[i]);
            ws[i] = &d[i].w, xs[i] = d[i].x, Ms[i] = M;
            ys[i] = malloc((M ? M : 1) * N * sizeof(float));
            one[i] = malloc((M ? M : 1) * N * sizeof(float));
            for (size_t j = 0; j < (M ? M : 1) * N; j++) ys[i][j] = one[i][j] = 12345.0f;
        }
        for (int n = 1; n <= NL; n += NL - 1) { /* 1 linear (on the stack), 20 (allocated descriptors) */
            emu.linear_batch(&emu, (size_t)n, ws, xs, Ms, ys, out);
            test_cuda_ctx_reset(&tctx);
        }
        int ok = 1;
        for (int i = 0; i < NL; i++) {
            if (Ms[i]) run_linear(&emu, &d[i], Ms[i], d[i].x, one[i], out);
            ok &= memcmp(ys[i], one[i], (Ms[i] ? Ms[i] : 1) * d[i].N * sizeof(float)) == 0;
        }
        TAP_CHECK(ok,
                  "emu linear_batch of 20 mixed FP4/BF16/FP8 linears (Ms 0..64) out %s = 20 linear calls, "
                  "Ms[i] = 0 untouched",
                  out_name(out));
        for (int i = 0; i < NL; i++) free(ys[i]), free(one[i]), free_linear(&d[i]);
    }
}

/* The one output of a 1 x 1 linear: emulated and reference. */
static void one_output(const ds41_linear *w, const float *x, ds41_linear_out out, float *y, float *ref) {
    *y = 7.0f, *ref = 8.0f;
    emu.linear(&emu, w, x, 1, y, out);
    test_cuda_ctx_reset(&tctx);
    ds41_ops_reference.linear(&ds41_ops_reference, w, x, 1, ref, out);
}

/* BF16 EXACT sums the double fast path cannot decide: on an fp32 tie, after
 * cancellation, non-finite, a tiny signed result. */
static void test_exact_fallback(void) {
    static const struct {
        float x[3], w[3];
        size_t K;
        const char *what;
    } cs[] = {
        {{1.0f, 0x1p-24f, 0}, {1.0f, 1.0f, 0}, 2, "1 + 2^-24 (an fp32 tie: even 1)"},
        {{1.0f, 0x1p-24f, 0x1p-60f}, {1.0f, 1.0f, 1.0f}, 3, "1 + 2^-24 + 2^-60 (just above the tie)"},
        {{0x1p100f, 1.0f, -0x1p100f}, {1.0f, 1.0f, 1.0f}, 3, "2^100 + 1 - 2^100 (cancellation: 1)"},
        {{INFINITY, 1.0f, 0}, {1.0f, 1.0f, 0}, 2, "inf + 1"},
        {{INFINITY, INFINITY, 0}, {1.0f, -1.0f, 0}, 2, "inf - inf (NaN)"},
        {{-0x1p-130f, 0, 0}, {0x1p-30f, 0, 0}, 1, "-2^-160 (-0)"},
        {{0x1p-120f, 0x1p-120f, 0}, {0x1p-30f, -0x1p-30f, 0}, 2, "an exact zero (+0)"},
    };
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++)
        for (int o = 0; o < 2; o++) {
            const ds41_linear_out out = o ? DS41_OUT_F32_EXACT : DS41_OUT_BF16_EXACT;
            uint16_t wb[3];
            for (int i = 0; i < 3; i++) wb[i] = ds41_bf16_bits(cs[c].w[i]);
            ds41_linear w = {.kind = DS41_LINEAR_BF16, .n = 1, .k = (int64_t)cs[c].K, .bf16 = wb};
            float y, ref;
            one_output(&w, cs[c].x, out, &y, &ref);
            TAP_CHECK(same_or_nan(y, ref), "emu BF16 %s: %s = reference (%a)", out_name(out), cs[c].what,
                      (double)ref);
        }
}

/* FP8 sums whose fp32 value depends on the order: products 2^16, -2^16 and
 * 2^-18 (codes 256 x 256 and 2^-9 x 2^-9 after scaling), at positions in
 * one block (K = 3) or in three blocks (K = 65).  The fast variant keeps
 * 2^-18 when the big products cancel first and loses it when it comes
 * between them (within its bound); the EXACT variant (and the reference)
 * sums a block exactly and chains the blocks in block order.  Random data
 * rarely shows this: its block sums are mostly exact in fp32 and a chain
 * order seldom moves a bf16 output, so a reversed block order, an fp32 sum
 * in the EXACT path or a reversed EXACT chain would pass there. */
static void test_block_order(void) {
    static const struct {
        size_t K, at[3];
        float x[3], w[3];
        ds41_linear_out out;
        float want;
        const char *what;
    } cs[] = {
        // clang-format off
        {3, {0, 1, 2}, {256.0f, -256.0f, 0x1p-9f}, {256.0f, 256.0f, 0x1p-9f}, DS41_OUT_BF16, 0x1p-18f,
         "fast, one block: 2^16 - 2^16 + 2^-18 in k order keeps 2^-18"},
        {3, {0, 1, 2}, {256.0f, 0x1p-9f, -256.0f}, {256.0f, 0x1p-9f, 256.0f}, DS41_OUT_BF16, 0.0f,
         "fast, one block: 2^16 + 2^-18 - 2^16 in k order loses 2^-18 (fp32, within the bound)"},
        {3, {0, 1, 2}, {256.0f, 0x1p-9f, -256.0f}, {256.0f, 0x1p-9f, 256.0f}, DS41_OUT_BF16_EXACT, 0x1p-18f,
         "EXACT, one block: 2^16 + 2^-18 - 2^16 is 2^-18 (exact block sum)"},
        {65, {0, 32, 64}, {256.0f, -256.0f, 0x1p-9f}, {256.0f, 256.0f, 0x1p-9f}, DS41_OUT_BF16_EXACT, 0x1p-18f,
         "EXACT, three blocks: 2^16, -2^16, 2^-18 chained in block order keep 2^-18"},
        // clang-format on
    };
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        const size_t K = cs[c].K, nkb = (K + 31) / 32;
        float x[65] = {0}, wf[65] = {0};
        for (int i = 0; i < 3; i++) x[cs[c].at[i]] = cs[c].x[i], wf[cs[c].at[i]] = cs[c].w[i];
        uint8_t q[65], sc[3];
        ds41_quant_fp8_weight(wf, 1, K, q, sc);
        ds41_linear w = {.kind = DS41_LINEAR_FP8,
                         .n = 1,
                         .k = (int64_t)K,
                         .q = q,
                         .scale = sc,
                         .scale_cols = (int64_t)nkb};
        float y, ref;
        one_output(&w, x, cs[c].out, &y, &ref);
        TAP_CHECK(bits(y) == bits(cs[c].want) && (cs[c].out == DS41_OUT_BF16 || bits(ref) == bits(y)),
                  "emu FP8 order, %s: got %a", cs[c].what, (double)y);
    }
}

int main(void) {
    ds41_error err;
    test_cuda_ctx_init(&tctx);
    emu = (ds41_ops){.name = "cuda-emu-linear",
                     .ctx = &tctx.c,
                     .linear = ds41_cuda_emu_linear,
                     .linear_batch = ds41_cuda_emu_linear_batch};
    ds41_cpu_opts o = {.threads = 1};
    fast = ds41_backend_cpu_new(&o, &err);
    if (!fast) {
        TAP_CHECK(0, "fast CPU backend: %s", err.msg);
        return tap_done();
    }
    test_codecs();
    test_exact_fallback();
    test_block_order();
    test_linears();
    test_batch_sizes();
    test_batch_op();
    const ds41_backend_stats st = tctx.c.stats;
    TAP_CHECK(st.op_calls > 0 && st.flops > 0 && st.weight_bytes > 0,
              "the ops count calls, flops and weight bytes");
    ds41_backend_free(fast);
    test_cuda_ctx_free(&tctx);
    return tap_done();
}
