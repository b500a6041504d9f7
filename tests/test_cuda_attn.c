/* The CUDA backend's attention family (cuda/op_attn.h) in its host emulation
 * (cuda/emu_attn.c over cuda/num_attn.h, the kernels' arithmetic and order):
 *  - the host+device codecs exhaustively / on sweeps against engine/model/quant.c;
 *  - every op against the reference op and the fast CPU op on random inputs:
 *    quantizers, packing and pooling bit for bit; index scores and the
 *    decisions (top-k with ties, NaN and -inf, candidate blocks) equal given
 *    equal inputs; attention within the documented double-sum bound (bit
 *    equal on almost every element, never more than one bf16 ulp off);
 *    reaches 0, 1 and not multiples of the page or block size, windows
 *    wrapping the ring, DSpark block mode;
 *  - batch invariance: every row alone = the rows batched, bit for bit. */
#include "cuda/op_attn.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/model/quant.h"
#include "tests/attn_step.h"
#include "tests/index_pages.h"
#include "tests/tap.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- a host test ctx (until the fake device lands): identity weights, meta a
 * malloc'd copy after which the host array is poisoned until the op returns
 * (metas_restore), so an op that reads a host metadata array instead of its
 * device copy reads garbage and fails (or trips the sanitizers); scratch from
 * a buffer ----------------------------------------------------------------------------- */

typedef struct meta_rec {
    void *copy, *host, *saved;
    size_t n;
} meta_rec;
static meta_rec metas[4096];
static size_t n_metas;
static unsigned char scratch_buf[1 << 20];

static const void *t_weight(ds41_cuda_ctx *c, const void *p, size_t n) {
    (void)c;
    (void)n;
    return p;
}
static void *t_meta(ds41_cuda_ctx *c, const void *host, size_t n) {
    (void)c;
    meta_rec *r = &metas[n_metas];
    if (n_metas == sizeof metas / sizeof metas[0] || !(r->copy = malloc(n)) || !(r->saved = malloc(n)))
        abort();
    n_metas++;
    memcpy(r->copy, host, n);
    memcpy(r->saved, host, n);
    r->host = (void *)(uintptr_t)host; /* the test's own writable arrays */
    r->n = n;
    memset(r->host, 0xA5, n);
    return r->copy;
}
static void *t_scratch(ds41_cuda_ctx *c, size_t n) {
    (void)c;
    if (n > sizeof scratch_buf) abort();
    return scratch_buf;
}
/* Un-poison the host arrays shipped since the last call (newest first). */
static void metas_restore(void) {
    while (n_metas) {
        meta_rec *r = &metas[--n_metas];
        memcpy(r->host, r->saved, r->n);
        free(r->saved);
        free(r->copy);
    }
}

/* An emulated op call, then the host arrays back. */
#define EMU(op, ...) (emu.op(&emu, __VA_ARGS__), metas_restore())

static ds41_cuda_ctx tctx = {.weight = t_weight, .meta = t_meta, .scratch = t_scratch, .emulated = true};
static ds41_ops emu;
static const ds41_ops *ref = &ds41_ops_reference;
static const ds41_ops *fast;

static uint64_t rng = 0x243f6a8885a308d3ull;
static double urand(void) { /* [-1, 1) */
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng >> 11) / 4503599627370496.0 - 1.0;
}
static uint32_t irand(uint32_t n) {
    return (uint32_t)((urand() + 1.0) * 0.5 * n) % n;
}
static void fill_bf16(float *x, size_t n, double scale) {
    for (size_t i = 0; i < n; i++)
        x[i] = ds41_bf16_round((float)(urand() * scale * (i % 7 == 3 ? 8.0 : 1.0)));
}
static int same_bits(const void *a, const void *b, size_t n) {
    return memcmp(a, b, n) == 0;
}
static int same_f(float a, float b) {
    return a == b || (isnan(a) && isnan(b));
}
static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* ---- codecs -------------------------------------------------------------------------- */

static void test_codecs(void) {
    int ok = 1;
    for (int b = 0; b < 256; b++) {
        ok &= fbits(ds41_hd_e4m3_to_f32((uint8_t)b)) == fbits(ds41_e4m3_table[b]);
        ok &= fbits(ds41_hd_ue8m0_to_f32((uint8_t)b)) == fbits(ds41_ue8m0_to_f32((uint8_t)b)) ||
              (b == 255 && isnan(ds41_hd_ue8m0_to_f32(255)));
    }
    for (int c = 0; c < 16; c++) ok &= fbits(ds41_hd_e2m1_to_f32((uint8_t)c)) == fbits(ds41_e2m1_table[c]);
    TAP_CHECK(ok,
              "decoders: all 256 e4m3 codes, all 16 e2m1 codes, all 256 ue8m0 bytes = quant.c, bit for bit");
    /* Encoders over every fp32 exponent, the codes' rounding boundaries and specials. */
    int enc = 1, n = 0;
    float specials[] = {0.0f,     -0.0f,      INFINITY, -INFINITY, NAN,       448.0f, 464.0f,
                        0x1p-10f, 0x1.8p-10f, 0.25f,    0.75f,     1.25f,     1.75f,  2.5f,
                        3.5f,     5.0f,       6.0f,     1e-45f,    0x1p-126f, 3.4e38f};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0] + 400000; i++) {
        float v;
        if (i < sizeof specials / sizeof specials[0])
            v = specials[i];
        else {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            const uint32_t u = (uint32_t)(rng >> 32);
            memcpy(&v, &u, sizeof v);
        }
        n++;
        enc &= ds41_hd_e4m3_from_f32(v) == ds41_e4m3_from_f32(v);
        enc &= ds41_hd_e2m1_from_f32(v) == ds41_e2m1_from_f32(v);
        enc &= ds41_hd_ue8m0_scale_byte(fabsf(v), DS41_FP8_RECIP) ==
               ds41_ue8m0_scale_byte(fabsf(v), DS41_FP8_RECIP);
        enc &= ds41_hd_ue8m0_scale_byte(fabsf(v), DS41_FP4_RECIP) ==
               ds41_ue8m0_scale_byte(fabsf(v), DS41_FP4_RECIP);
        enc &= fbits(ds41_hd_bf16_round(v)) == fbits(ds41_bf16_round(v));
    }
    TAP_CHECK(enc,
              "encoders (e4m3, e2m1, ue8m0 scale bytes, bf16 rounding) = quant.c on %d values (specials, "
              "random bit patterns)",
              n);
}

/* ---- the step quantizers and the pooling: bit for bit ---------------------------------- */

static void test_quantizers(void) {
    enum { M = 7, N = 70, STRIDE = N + 3 + 4, QN = 100, WN = 6, G = 5, RATIO = 4, HD = 37, NE = 6 };
    static float x[M * N], q[M * QN], w[M * WN], q0[M * QN], w0[M * WN], qr[M * QN], wr[M * WN];
    static uint8_t out[M * STRIDE], out_r[M * STRIDE], out_f[M * STRIDE];
    static float qf[M * QN], wf[M * WN];
    fill_bf16(x, M * N, 50.0);
    x[3] = NAN;
    x[40] = INFINITY;
    x[N + 5] = 0x1p-10f;
    for (int i = 0; i < 32; i++) x[2 * N + 32 + i] = 0.0f; /* a zero block: the floor */
    fill_bf16(q0, M * QN, 2.0);
    q0[7] = NAN;
    fill_bf16(w0, M * WN, 1.0);
    memset(out, 0x5a, sizeof out);
    memset(out_r, 0x5a, sizeof out_r);
    memset(out_f, 0x5a, sizeof out_f);
    ref->act_quant_fp8(ref, x, M, N, out_r, STRIDE);
    fast->act_quant_fp8(fast, x, M, N, out_f, STRIDE);
    EMU(act_quant_fp8, x, M, N, out, STRIDE);
    TAP_CHECK(same_bits(out, out_r, sizeof out) && same_bits(out, out_f, sizeof out),
              "act_quant_fp8 of %d rows of %d (partial block, NaN, inf, zero "
              "block), at a stride: bit for bit the reference and the fast CPU op",
              M, N);
    memcpy(q, q0, sizeof q);
    memcpy(w, w0, sizeof w);
    memcpy(qr, q0, sizeof q);
    memcpy(wr, w0, sizeof w);
    memcpy(qf, q0, sizeof q);
    memcpy(wf, w0, sizeof w);
    ref->index_query(ref, qr, QN, wr, WN, M, 0.0625f);
    fast->index_query(fast, qf, QN, wf, WN, M, 0.0625f);
    EMU(index_query, q, QN, w, WN, M, 0.0625f);
    TAP_CHECK(
        same_bits(q, qr, sizeof q) && same_bits(w, wr, sizeof w) && same_bits(q, qf, sizeof q) &&
            same_bits(w, wf, sizeof w),
        "index_query of %d rows (FP4 QDQ with a partial block and NaN, weights): bit for bit the reference "
        "and the fast CPU op",
        M);

    ds41_kv_layout lay = {0};
    lay.latent_dim = 64;
    lay.index_dim = 96;
    lay.latent_bytes = 64 / 2 + 64 / 16;
    lay.index_bytes = 96 / 2 + 96 / 32;
    lay.entry_bytes = lay.latent_bytes + lay.index_bytes;
    static float lat[NE * 64], key[NE * 96];
    static uint8_t pk[NE * 87], pr[NE * 87], pf[NE * 87];
    fill_bf16(lat, NE * 64, 2.0);
    fill_bf16(key, NE * 96, 1.0);
    lat[17] = NAN;
    for (int i = 0; i < 16; i++) lat[64 + 16 + i] = 0.0f;
    ref->kv_pack(ref, &lay, lat, key, NE, pr);
    fast->kv_pack(fast, &lay, lat, key, NE, pf);
    EMU(kv_pack, &lay, lat, key, NE, pk);
    TAP_CHECK(same_bits(pk, pr, sizeof pk) && same_bits(pk, pf, sizeof pk),
              "kv_pack of %d entries (e4m3-scaled latent, ue8m0 key, NaN, zero "
              "block): bit for bit the reference and the fast CPU op",
              NE);

    static float kv[G * RATIO * HD], sc[G * RATIO * HD], pooled[G * HD], pooled_r[G * HD], pooled_f[G * HD];
    for (int i = 0; i < G * RATIO * HD; i++) {
        kv[i] = (float)urand();
        sc[i] = (float)(urand() * 8.0);
    }
    sc[HD + 2] = -INFINITY;
    ref->compress_pool(ref, kv, sc, G, RATIO, HD, pooled_r);
    EMU(compress_pool, kv, sc, G, RATIO, HD, pooled);
    fast->compress_pool(fast, kv, sc, G, RATIO, HD, pooled_f);
    TAP_CHECK(same_bits(pooled, pooled_r, sizeof pooled) && same_bits(pooled, pooled_f, sizeof pooled),
              "compress_pool (%d groups of %d x %d): bit for bit the reference and the fast CPU op", G, RATIO,
              HD);
    metas_restore();
}

/* ---- index scores ---------------------------------------------------------------------- */

static void test_index_scores(void) {
    enum { NH = 5, ID = 64, M = 6, PER = 8, NC = 77, STRIDE = NC + 3 };
    ds41_kv_layout lay = {0};
    lay.latent_dim = 32;
    lay.index_dim = ID;
    lay.latent_bytes = 32 / 2 + 32 / 16;
    lay.index_bytes = ID / 2 + ID / 32;
    lay.entry_bytes = lay.latent_bytes + lay.index_bytes;
    static uint8_t ent[NC * (18 + 34)];
    for (int j = 0; j < NC; j++) {
        float v[32], k[ID];
        fill_bf16(v, 32, 2.0);
        fill_bf16(k, ID, 1.0);
        ds41_kv_pack_entry(&lay, v, k, ent + (size_t)j * lay.entry_bytes);
    }
    static float q[M * NH * ID], w[M * NH], sc[M * STRIDE], sr[M * STRIDE], sf[M * STRIDE], s1[STRIDE];
    index_test_queries(q, w, M, NH, ID, urand);
    const uint8_t *pages[(NC + PER - 1) / PER];
    index_test_pages(&lay, ent, NC, PER, pages);
    /* Two sequences' tables: rows 0-2 the whole table, rows 3-5 its second half. */
    size_t row_table[M] = {0, 0, 0, 4, 4, 4};
    uint32_t reach[M] = {NC, 0, 1, 41 - 32, 8, 13};
    const ds41_kv_pages keys = {.layout = &lay, .pages = pages, .row_table = row_table, .row_reach = reach};
    for (int i = 0; i < M * STRIDE; i++) sc[i] = sr[i] = sf[i] = 1234.0f;
    ref->index_scores(ref, q, w, M, NH, ID, &keys, sr, STRIDE);
    fast->index_scores(fast, q, w, M, NH, ID, &keys, sf, STRIDE);
    EMU(index_scores, q, w, M, NH, ID, &keys, sc, STRIDE);
    TAP_CHECK(
        same_bits(sc, sr, sizeof sc) && same_bits(sc, sf, sizeof sc),
        "index_scores of %d rows over paged keys (reaches %u, 0, 1, %u, %u, %u): equal to the reference and "
        "the fast CPU op, nothing past a row's reach written",
        M, reach[0], reach[3], reach[4], reach[5]);
    int alone = 1;
    for (size_t m = 0; m < M; m++) {
        for (int i = 0; i < STRIDE; i++) s1[i] = 1234.0f;
        const ds41_kv_pages k1 = {.layout = &lay,
                                  .pages = pages,
                                  .row_table = row_table + m,
                                  .row_reach = reach + m,
                                  .n_pages = (NC + PER - 1) / PER};
        EMU(index_scores, q + m * NH * ID, w + m * NH, 1, NH, ID, &k1, s1, STRIDE);
        alone &= same_bits(s1, sc + m * STRIDE, sizeof s1);
    }
    TAP_CHECK(alone, "index_scores: every row alone = the batch, bit for bit");
    /* A large step: 40 rows of random reaches and tables, against the reference and each row alone. */
    enum { BM = 40 };
    static float bq[BM * NH * ID], bw[BM * NH], bs[BM * STRIDE], bsr[BM * STRIDE];
    size_t btable[BM];
    uint32_t breach[BM];
    index_test_queries(bq, bw, BM, NH, ID, urand);
    for (size_t m = 0; m < BM; m++) {
        btable[m] = irand(4);
        breach[m] = irand((uint32_t)(NC - btable[m] * PER) + 1);
    }
    const ds41_kv_pages bk = {.layout = &lay, .pages = pages, .row_table = btable, .row_reach = breach};
    for (int i = 0; i < BM * STRIDE; i++) bs[i] = bsr[i] = 1234.0f;
    ref->index_scores(ref, bq, bw, BM, NH, ID, &bk, bsr, STRIDE);
    EMU(index_scores, bq, bw, BM, NH, ID, &bk, bs, STRIDE);
    int big = same_bits(bs, bsr, sizeof bs);
    for (size_t m = 0; m < BM; m++) {
        for (int i = 0; i < STRIDE; i++) s1[i] = 1234.0f;
        const ds41_kv_pages k1 = {
            .layout = &lay, .pages = pages, .row_table = btable + m, .row_reach = breach + m};
        EMU(index_scores, bq + m * NH * ID, bw + m * NH, 1, NH, ID, &k1, s1, STRIDE);
        big &= same_bits(s1, bs + m * STRIDE, sizeof s1);
    }
    TAP_CHECK(
        big, "index_scores of %d rows of random reaches: equal to the reference, every row alone = the batch",
        BM);
    metas_restore();
}

/* ---- decisions ---------------------------------------------------------------------------- */

/* Scores with many ties (few distinct values), NaN, -inf, +-0. */
static void tie_scores(float *s, size_t n) {
    static const float vals[] = {1.0f, 0.5f, 0.5f, -0.0f, 0.0f, 2.0f, -1.0f, 0.25f, 3.0f, 1.0f};
    for (size_t i = 0; i < n; i++) {
        const uint32_t r = irand(40);
        s[i] = r == 0 ? NAN : (r == 1 ? -INFINITY : (r < 12 ? vals[r - 2] : ds41_bf16_round((float)urand())));
    }
}

static void test_decisions(void) {
    enum { M = 9, STRIDE = 3001, K = 64, B = 16, NB = (STRIDE + B - 1) / B, TAKE = 7 };
    static float score[M * STRIDE], s_r[M * STRIDE], s_e[M * STRIDE], s_f[M * STRIDE], s1[STRIDE];
    static float bs_r[M * NB], bs_e[M * NB], bs_f[M * NB], bs1[NB];
    static uint8_t al_r[M * NB], al_e[M * NB], al_f[M * NB], al1[NB];
    static int32_t sel_r[M * K], sel_e[M * K], sel_f[M * K], sel1[K];
    static uint32_t cnt_r[M], cnt_e[M], cnt_f[M], cnt1;
    uint32_t reach[M] = {STRIDE, 0, 1, 17, 64, 65, 2000, 200, 1500};
    tie_scores(score, M * STRIDE);
    /* Row 5: every score equal (the tie rule alone decides); row 7: -0 and +0 alternating (equal
     * values: the lower indices, whatever the sign); row 8: all -inf but 3. */
    for (int i = 0; i < STRIDE; i++) score[5 * STRIDE + i] = 0.5f;
    for (int i = 0; i < STRIDE; i++) score[7 * STRIDE + i] = i % 2 ? 0.0f : -0.0f;
    for (int i = 0; i < STRIDE; i++) score[8 * STRIDE + i] = i % 500 == 7 ? 1.0f : -INFINITY;
    memset(sel_r, 0xff, sizeof sel_r);
    memset(sel_e, 0xff, sizeof sel_e);
    memset(sel_f, 0xff, sizeof sel_f);
    memset(bs_r, 0, sizeof bs_r);
    memset(bs_e, 0, sizeof bs_e);
    memset(bs_f, 0, sizeof bs_f);
    ref->index_blocks(ref, score, STRIDE, reach, M, B, TAKE, bs_r, NB, al_r, NB);
    fast->index_blocks(fast, score, STRIDE, reach, M, B, TAKE, bs_f, NB, al_f, NB);
    EMU(index_blocks, score, STRIDE, reach, M, B, TAKE, bs_e, NB, al_e, NB);
    TAP_CHECK(
        same_bits(bs_e, bs_r, sizeof bs_e) && same_bits(al_e, al_r, sizeof al_e) &&
            same_bits(bs_e, bs_f, sizeof bs_e) && same_bits(al_e, al_f, sizeof al_e),
        "index_blocks of %d rows (ties, NaN, -inf, reaches 0, 1, not multiples of %d): block scores and "
        "allowed blocks equal the reference's and the fast CPU op's",
        M, B);
    for (int allowed = 0; allowed < 2; allowed++) {
        memcpy(s_r, score, sizeof s_r);
        memcpy(s_e, score, sizeof s_e);
        memcpy(s_f, score, sizeof s_f);
        const uint8_t *al = allowed ? al_r : NULL;
        ref->index_topk(ref, s_r, STRIDE, reach, M, al, NB, B, K, sel_r, cnt_r);
        fast->index_topk(fast, s_f, STRIDE, reach, M, al, NB, B, K, sel_f, cnt_f);
        EMU(index_topk, s_e, STRIDE, reach, M, al, NB, B, K, sel_e, cnt_e);
        int ok = same_bits(cnt_e, cnt_r, sizeof cnt_e) && same_bits(cnt_e, cnt_f, sizeof cnt_e) &&
                 same_bits(s_e, s_r, sizeof s_e);
        for (size_t m = 0; m < M; m++)
            ok &= same_bits(sel_e + m * K, sel_r + m * K, cnt_r[m] * sizeof *sel_e) &&
                  same_bits(sel_e + m * K, sel_f + m * K, cnt_r[m] * sizeof *sel_e);
        TAP_CHECK(ok,
                  "index_topk of %d rows, %s: torch.topk's order (NaN first, lower index on ties, -inf picks "
                  "kept), the same selections and counts as the reference and the fast CPU op",
                  M, allowed ? "masked by the candidate blocks" : "unmasked");
    }
    /* Each row alone = batched. */
    int alone = 1;
    for (size_t m = 0; m < M; m++) {
        memcpy(s1, score + m * STRIDE, sizeof s1);
        EMU(index_blocks, s1, STRIDE, reach + m, 1, B, TAKE, bs1, NB, al1, NB);
        alone &= same_bits(al1, al_e + m * NB, NB) &&
                 same_bits(bs1, bs_e + m * NB, ((reach[m] + B - 1) / B) * sizeof *bs1);
        EMU(index_topk, s1, STRIDE, reach + m, 1, al_e + m * NB, NB, B, K, sel1, &cnt1);
        alone &= cnt1 == cnt_e[m] && same_bits(sel1, sel_e + m * K, cnt1 * sizeof *sel1);
    }
    TAP_CHECK(alone, "index_blocks and index_topk: every row alone = the batch, bit for bit");
    metas_restore();
}

/* ---- attention ------------------------------------------------------------------------------ */

/* got vs want (bf16 values): equal bits, or both NaN, or one bf16 ulp apart (a
 * double sum within its bound of a rounding boundary); *exact counts the
 * equal ones. */
static int attn_close(const float *got, const float *want, size_t n, size_t *exact) {
    int ok = 1;
    for (size_t i = 0; i < n; i++) {
        if (same_f(got[i], want[i])) {
            (*exact)++;
            continue;
        }
        const double ulp = ldexp(1.0, ilogb(fmax(fabs(want[i]), 0x1p-126)) - 7);
        ok &= fabs((double)got[i] - want[i]) <= ulp;
    }
    return ok;
}

typedef struct attn_fix {
    ds41_kv_layout lay;
    int H, hd;
    uint8_t *wrow; /* NWR window rows */
    uint8_t *ent;  /* NENT entries */
    const uint8_t *pages[64];
} attn_fix;

enum { NWR = 400, NENT = 300, APER = 16 };

static void attn_fix_init(attn_fix *f, int H, int hd) {
    memset(f, 0, sizeof *f);
    f->H = H;
    f->hd = hd;
    f->lay.latent_dim = (uint32_t)hd;
    f->lay.index_dim = 32;
    f->lay.latent_bytes = (uint32_t)(hd / 2 + hd / 16);
    f->lay.index_bytes = 32 / 2 + 1;
    f->lay.entry_bytes = f->lay.latent_bytes + f->lay.index_bytes;
    f->lay.ring_row_bytes = (uint32_t)(hd + hd / 32);
    f->wrow = malloc((size_t)NWR * f->lay.ring_row_bytes);
    f->ent = malloc((size_t)NENT * f->lay.entry_bytes);
    float *v = malloc((size_t)hd * sizeof *v), k[32];
    for (int j = 0; j < NWR; j++) {
        fill_bf16(v, (size_t)hd, 2.0);
        ds41_act_quant(v, (size_t)hd, f->wrow + (size_t)j * f->lay.ring_row_bytes,
                       f->wrow + (size_t)j * f->lay.ring_row_bytes + hd);
    }
    for (int j = 0; j < NENT; j++) {
        fill_bf16(v, (size_t)hd, 2.0);
        fill_bf16(k, 32, 1.0);
        ds41_kv_pack_entry(&f->lay, v, k, f->ent + (size_t)j * f->lay.entry_bytes);
    }
    free(v);
    index_test_pages(&f->lay, f->ent, NENT, APER, f->pages);
}

/* A random step: n_items sequences with rings of W rows (taken from the
 * fixture's rows), chunk rows after them; causal rows with random selections
 * (ascending, distinct) or a DSpark block. */
typedef struct rstep {
    size_t M, n_items;
    const uint8_t *rings[8];
    size_t row_item[64], item_row0[8], row_table[64];
    uint64_t row_pos[64], item_pos0[8];
    int32_t sel[64 * 24];
    uint32_t count[64];
    ds41_attn_step step;
} rstep;

static void rstep_init(rstep *r, const attn_fix *f, uint32_t W, uint32_t block, int with_sel) {
    memset(r, 0, sizeof *r);
    r->n_items = 1 + irand(5);
    const size_t rb = f->lay.ring_row_bytes;
    size_t row = 0;
    for (size_t it = 0; it < r->n_items; it++) {
        r->rings[it] = f->wrow + (size_t)irand(NWR - 2 * W - 70) * rb;
        r->item_pos0[it] = irand(3) == 0 ? irand(3) : irand(2000);
        r->item_row0[it] = row;
        const size_t rows = block ? block : 1 + irand(9);
        for (size_t j = 0; j < rows; j++, row++) {
            r->row_item[row] = it;
            r->row_pos[row] = r->item_pos0[it] + j;
            r->row_table[row] = irand(4);
            if (with_sel) {
                const uint32_t n = irand(24);
                r->count[row] = n;
                int32_t t = (int32_t)irand(5);
                for (uint32_t i = 0; i < n; i++, t += 1 + (int32_t)irand(6)) r->sel[row * 24 + i] = t;
            }
        }
    }
    r->M = row;
    r->step = (ds41_attn_step){.layout = &f->lay,
                               .window = W,
                               .block = block,
                               .chunk = f->wrow + (size_t)(NWR - 70) * rb,
                               .rings = r->rings,
                               .row_item = r->row_item,
                               .row_pos = r->row_pos,
                               .item_row0 = r->item_row0,
                               .item_pos0 = r->item_pos0,
                               .sel = with_sel ? r->sel : NULL,
                               .count = r->count,
                               .sel_stride = 24,
                               .comp = {.layout = &f->lay,
                                        .pages = f->pages,
                                        .row_table = r->row_table,
                                        .n_pages = (NENT + APER - 1) / APER}};
}

/* attend of a random step on emu vs the reference, the fast op and each row
 * alone; returns the checks' conjunction and counts exact elements. */
static int attend_case(const attn_fix *f, rstep *r, const float *q, const float *sink, float scale,
                       float *o_e, float *o_r, float *o_f, float *o1, size_t *exact, size_t *total,
                       int *alone) {
    const size_t qo = (size_t)f->H * (size_t)f->hd;
    ref->attend(ref, q, r->M, f->H, f->hd, sink, scale, &r->step, o_r);
    fast->attend(fast, q, r->M, f->H, f->hd, sink, scale, &r->step, o_f);
    EMU(attend, q, r->M, f->H, f->hd, sink, scale, &r->step, o_e);
    int ok = attn_close(o_e, o_r, r->M * qo, exact) & attn_close(o_e, o_f, r->M * qo, exact + 1);
    *total += r->M * qo;
    for (size_t m = 0; m < r->M; m++) {
        ds41_attn_step s1 = r->step;
        s1.row_item = r->row_item + m;
        s1.row_pos = r->row_pos + m;
        s1.count = r->count + m;
        s1.sel = r->step.sel ? r->sel + m * 24 : NULL;
        s1.comp.row_table = r->row_table + m;
        EMU(attend, q + m * qo, 1, f->H, f->hd, sink, scale, &s1, o1);
        *alone &= same_bits(o1, o_e + m * qo, qo * sizeof *o1);
    }
    metas_restore();
    return ok;
}

static void test_attention(void) {
    static attn_fix f;
    attn_fix_init(&f, 6, 64);
    const int H = f.H, hd = f.hd;
    const size_t qo = (size_t)H * (size_t)hd;
    static float q[64 * 6 * 64], o_e[64 * 6 * 64], o_r[64 * 6 * 64], o_f[64 * 6 * 64], o1[6 * 64];
    fill_bf16(q, sizeof q / sizeof q[0], 0.5);
    const float sink[6] = {0.3f, -2.0f, 1.5f, -1e30f, 0.0f, 4.0f};
    const float scale = (float)pow(64.0, -0.5);

    /* sparse_attn over explicit lists: 3 chunks of 64, one row, a NaN row. */
    const uint8_t *wp[150], *cp[90];
    for (int j = 0; j < 150; j++) wp[j] = f.wrow + (size_t)j * f.lay.ring_row_bytes;
    for (int j = 0; j < 90; j++) cp[j] = f.ent + (size_t)(j * 3) * f.lay.entry_bytes;
    size_t exact[2] = {0, 0}, total = 0;
    int ok = 1;
    const ds41_attn_rows lists[3] = {
        {.layout = &f.lay, .n_window = 100, .window = wp, .n_comp = 90, .comp = cp},
        {.layout = &f.lay, .n_window = 0, .window = wp, .n_comp = 1, .comp = cp},
        {.layout = &f.lay, .n_window = 1, .window = wp + 7, .n_comp = 0, .comp = cp}};
    for (int i = 0; i < 3; i++) {
        ref->sparse_attn(ref, q, H, hd, sink, scale, &lists[i], o_r);
        fast->sparse_attn(fast, q, H, hd, sink, scale, &lists[i], o_f);
        EMU(sparse_attn, q, H, hd, sink, scale, &lists[i], o_e);
        ok &= attn_close(o_e, o_r, qo, &exact[0]) & attn_close(o_e, o_f, qo, &exact[1]);
        total += qo;
    }
    TAP_CHECK(
        ok && exact[0] * 100 >= total * 99 && exact[1] * 100 >= total * 99,
        "sparse_attn (190 rows in 3 chunks, one compressed row, one window row): within one bf16 ulp of the "
        "reference and the fast CPU op, %zu / %zu and %zu / %zu elements bit equal",
        exact[0], total, exact[1], total);
    metas_restore();

    /* The shared two-sequence step of the CPU tests: attend = sparse_attn row by row. */
    static attn_step_case t;
    static float sq[ATTN_STEP_M * 6 * 64], so[ATTN_STEP_M * 6 * 64], sw[ATTN_STEP_M * 6 * 64];
    attn_step_case_init(&t, &f.lay, f.wrow, f.ent, NENT);
    t.step.comp.n_pages = 16;
    fill_bf16(sq, sizeof sq / sizeof sq[0], 0.5);
    const int step_ok = attn_step_check(&emu, &t, sq, H, hd, sink, scale, so, sw);
    metas_restore();
    TAP_CHECK(step_ok, "attend over the two-sequence step (a window wrapping the ring) = sparse_attn row by "
                       "row, bit for bit");
    metas_restore();

    /* Random steps: causal with selections, window-only, DSpark blocks; windows wrap. */
    static const struct {
        uint32_t W, block;
        int sel;
        const char *what;
    } kinds[] = {{8, 0, 1, "causal, window 8, selections"},
                 {70, 0, 1, "causal, window 70 (two chunks), selections"},
                 {5, 0, 0, "causal, window-only"},
                 {8, 4, 0, "DSpark blocks of 4, window 8"},
                 {67, 3, 0, "DSpark blocks of 3, window 67"}};
    for (size_t kd = 0; kd < sizeof kinds / sizeof kinds[0]; kd++) {
        size_t ex[2] = {0, 0}, tot = 0;
        int good = 1, alone = 1;
        for (int rep = 0; rep < 6; rep++) {
            static rstep r;
            rstep_init(&r, &f, kinds[kd].W, kinds[kd].block, kinds[kd].sel);
            good &= attend_case(&f, &r, q, sink, scale, o_e, o_r, o_f, o1, ex, &tot, &alone);
        }
        TAP_CHECK(
            good && ex[0] * 100 >= tot * 99 && ex[1] * 100 >= tot * 99,
            "attend, %s: within one bf16 ulp of the reference and the fast CPU op (%zu / %zu and %zu / %zu "
            "bit equal)",
            kinds[kd].what, ex[0], tot, ex[1], tot);
        TAP_CHECK(alone, "attend, %s: every row alone = the batch, bit for bit", kinds[kd].what);
    }
    free(f.wrow);
    free(f.ent);
}

int main(void) {
    ds41_error err;
    ds41_cpu_opts o = {.threads = 2};
    ds41_backend *cpu = ds41_backend_cpu_new(&o, &err);
    if (!cpu) {
        TAP_CHECK(0, "fast CPU backend: %s", err.msg);
        return tap_done();
    }
    fast = &cpu->ops;
    emu = (ds41_ops){.name = "cuda-emu-attn", .ctx = &tctx};
#define SET(op) emu.op = ds41_cuda_emu_##op;
    DS41_CUDA_ATTN_OPS(SET)
#undef SET
    test_codecs();
    test_quantizers();
    test_index_scores();
    test_decisions();
    test_attention();
    TAP_CHECK(tctx.stats.op_calls > 0 && tctx.stats.flops > 0, "the ops count their calls and flops");
    ds41_backend_free(cpu);
    return tap_done();
}
