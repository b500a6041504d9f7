/* The forward pass's decision steps, as the backends' ops (the reference and the fast CPU backend,
 * several rows or groups a call), on inputs the generated checkpoints never produce (issue 19): the
 * compressor's softmax pooling with gate scores 100 and more apart (its max shift is what keeps
 * exp() finite), the indexer's ranking, candidate blocks and top-k with NaN, ties and -inf scores
 * (torch.topk puts NaN first, ties go to the lower index), and the MoE combine of the release's 6
 * routed experts with outputs 2^24 apart, where the fp32 summation order shows in the result.
 * Each runs in milliseconds; the end-to-end bit-exactness tests cover the same code on real
 * shapes. */
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/index_select.h"
#include "engine/backend/ops.h"
#include "engine/forward/forward_internal.h"
#include "engine/model/quant.h"
#include "tests/tap.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The compress_pool op of a backend: G groups of the cases in one call, group g's kv scaled by
 * g + 1 (exact), so a group read at the wrong stride or a group left out shows. */
static void test_compress_pool(const ds41_ops *ops) {
    enum { RATIO = 4, HD = 5, G = 3 };
    /* channel-major view of the cases: scores[ch][slot], kv[ch][slot] */
    static const float scores[HD][RATIO] = {
        {0, 0, 0, 0},                /* equal scores: the mean of the kv */
        {0, 0, 0, 100},              /* the last slot dominates by 100 (exp(100) overflows fp32) */
        {100, 0, 0, 0},              /* the first slot dominates */
        {0, 100, 0, 0},              /* a middle slot dominates */
        {-1000, -1000, -1000, -900}, /* all far below 0; the last is the max by 100 */
    };
    static const float kv[HD][RATIO] = {
        {1, 2, 3, 4}, {1, 2, 3, 4}, {1, 2, 3, 4}, {1, 2, 3, 4}, {-1, -2, -3, 0.375f},
    };
    static const float expect[HD] = {2.5f, 4.0f, 1.0f, 2.0f, 0.375f};
    static const char *const what[HD] = {
        "equal scores pool to the mean (2.5)",
        "last slot 100 above the rest: its kv exactly (the shift includes the last slot)",
        "first slot 100 above the rest: its kv exactly",
        "middle slot 100 above the rest: its kv exactly",
        "scores near -1000, the last 100 above: its kv exactly",
    };
    float ckv[G * RATIO * HD], csc[G * RATIO * HD], pooled[G * HD];
    for (int g = 0; g < G; g++)
        for (int t = 0; t < RATIO; t++)
            for (int ch = 0; ch < HD; ch++) {
                ckv[(g * RATIO + t) * HD + ch] = kv[ch][t] * (float)(g + 1);
                csc[(g * RATIO + t) * HD + ch] = scores[ch][t];
            }
    memset(pooled, 0xff, sizeof pooled); /* NaN: a group the op leaves out shows */
    ops->compress_pool(ops, ckv, csc, G, RATIO, HD, pooled);
    for (int ch = 0; ch < HD; ch++) {
        int ok = 1;
        for (int g = 0; g < G; g++) {
            const float want = expect[ch] * (float)(g + 1);
            if (pooled[g * HD + ch] != want) {
                ok = 0;
                TAP_NOTE("group %d: pooled %g, expected %g", g, (double)pooled[g * HD + ch], (double)want);
            }
        }
        TAP_CHECK(ok, "%s: compressor pooling of %d groups in one call: %s", ops->name, G, what[ch]);
    }
}

static void test_index_rank(void) {
    const float score[] = {1.0f, NAN, 3.0f, 3.0f, NAN, -INFINITY, 2.0f, -0.0f, 0.0f};
    /* NaN first (lower index first among them), then descending, equal scores (also -0 and +0) by
     * lower index */
    const int32_t expect[] = {1, 4, 2, 3, 6, 0, 7, 8, 5};
    const size_t n = sizeof score / sizeof score[0];
    int32_t order[sizeof score / sizeof score[0]], tmp[sizeof score / sizeof score[0]];
    ds41_index_rank(score, order, tmp, n);
    TAP_CHECK(memcmp(order, expect, sizeof expect) == 0,
              "indexer ranking: NaN scores first (torch.topk), then descending, ties by lower index");
    if (memcmp(order, expect, sizeof expect) != 0)
        for (size_t i = 0; i < n; i++) TAP_NOTE("order[%zu] = %d, expected %d", i, order[i], expect[i]);
}

/* The indexer's decision ops of a backend over a whole step: rows of different reach (one that
 * reaches nothing), ties, NaN, k below and above the reach, a candidate source's blocks and a
 * candidate user's mask.  Each row is checked against the expected selection, so a row written at
 * the wrong stride, a row left out or a wrong tie rule shows. */
static void test_index_ops(const ds41_ops *ops) {
    enum { M = 4, R = 10, K = 4, B = 3, NB = 4, TAKE = 2 };
    static const float scores[M][R] = {
        {1, 5, 5, 2, 5, 0, 0, 0, 0, 0},     /* reach 6: ties at 5 -> 1, 2, 4, then 3 */
        {0, 0, 0, 0, 0, 0, 0, 0, 0, 0},     /* reach 0 */
        {3, NAN, 3, 9, 3, 3, 3, 1, 1, 2},   /* reach 10: NaN first, 9, then the lowest 3s */
        {-1, -1, -1, -1, 0, 0, 0, 0, 0, 0}, /* reach 3 < K: all three, ascending */
    };
    static const uint32_t reach[M] = {6, 0, 10, 3};
    static const int32_t want_sel[M][K] = {{1, 2, 3, 4}, {0}, {0, 1, 2, 3}, {0, 1, 2}};
    static const uint32_t want_count[M] = {4, 0, 4, 3};
    float sc[M * R];
    int32_t sel[M * K];
    uint32_t count[M];
    memcpy(sc, scores, sizeof sc);
    memset(sel, 0, sizeof sel);
    memset(count, 0xff, sizeof count);
    ops->index_topk(ops, sc, R, reach, M, NULL, 0, 1, K, sel, count);
    int ok = 1;
    for (int m = 0; m < M; m++) {
        ok &= count[m] == want_count[m] && memcmp(sel + m * K, want_sel[m], want_count[m] * sizeof *sel) == 0;
        if (count[m] != want_count[m])
            TAP_NOTE("row %d: %u selected, expected %u", m, count[m], want_count[m]);
        for (uint32_t i = 0; i < want_count[m] && i < count[m]; i++)
            if (sel[m * K + i] != want_sel[m][i])
                TAP_NOTE("row %d: sel[%u] = %d, expected %d", m, i, sel[m * K + i], want_sel[m][i]);
    }
    TAP_CHECK(
        ok, "%s index_topk of %d rows in one call: NaN first, ties to the lower index, ascending, row by row",
        ops->name, M);

    /* Candidate blocks of 3 (row 2: blocks {3,NaN,3} {9,3,3} {3,1,1} {2} -> NaN block first, the
     * newest pinned; row 0: {1,5,5} {2,5,0}: both kept; row 3: one block) */
    float bscore[M * NB];
    uint8_t allow[M * (NB + 1)];
    memcpy(sc, scores, sizeof sc);
    memset(allow, 7, sizeof allow);
    ops->index_blocks(ops, sc, R, reach, M, B, TAKE, bscore, NB, allow, NB + 1);
    static const uint8_t want_allow[M][NB + 1] = {{1, 1, 0, 0, 0}, {0}, {1, 0, 0, 1, 0}, {1, 0, 0, 0, 0}};
    int ok_b = memcmp(allow, want_allow, sizeof allow) == 0 && isnan(bscore[2 * NB]) &&
               bscore[2 * NB + 1] == 9.0f && bscore[2 * NB + 3] == INFINITY && bscore[0] == 5.0f &&
               bscore[1] == INFINITY;
    for (int m = 0; m < M; m++)
        for (int j = 0; j <= NB; j++)
            if (allow[m * (NB + 1) + j] != want_allow[m][j])
                TAP_NOTE("row %d: block %d allowed %d, expected %d", m, j, allow[m * (NB + 1) + j],
                         want_allow[m][j]);
    TAP_CHECK(ok_b,
              "%s index_blocks of %d rows: block max (NaN wins), newest pinned, top %d, other flags cleared",
              ops->name, M, TAKE);

    /* A block whose every score is -inf is never allowed, even when n_take leaves room (the op's
     * contract; the engine's scores are finite, so this is the op's own guard). */
    {
        const float ninf[7] = {-INFINITY, -INFINITY, -INFINITY, 1.0f, -INFINITY, -INFINITY, 2.0f};
        const uint32_t r7[1] = {7};
        float bs[3];
        uint8_t al[3];
        ops->index_blocks(ops, ninf, 7, r7, 1, B, 3, bs, 3, al, 3);
        TAP_CHECK(al[0] == 0 && al[1] == 1 && al[2] == 1 && bs[0] == -INFINITY,
                  "%s index_blocks: a block scored -inf is not allowed though n_take has room", ops->name);
    }

    /* A candidate user's mask: row 2 keeps blocks 0 and 3 only (entries 0-2, 9). */
    ops->index_topk(ops, sc, R, reach, M, allow, NB + 1, B, K, sel, count);
    static const int32_t want_masked[K] = {0, 1, 2, 9};
    TAP_CHECK(count[2] == K && memcmp(sel + 2 * K, want_masked, sizeof want_masked) == 0 &&
                  sc[2 * R + 3] == -INFINITY && count[0] == 4 && sel[0] == 1 && count[1] == 0 &&
                  count[3] == 3,
              "%s index_topk with a candidate mask: masked scores become -inf (in place), the kept ones win",
              ops->name);
}

static void test_moe_combine(const ds41_ops *ops) {
    enum { M = 2, K = 6, D = 3, TOTAL = M * K };
    const float big = 0x1p24f;
    /* per token, its 6 routed outputs in increasing expert id; d = 0 and 1 cross 2^24 where one
     * more unit rounds away (fp32 spacing 2 there), d = 2 mixes magnitudes 2^20 apart */
    static float routed[M][K][D];
    const float shared[M][D] = {{-0x1p24f, -0x1p24f, 0.0f}, {-0x1p24f, -0x1p24f, 0.0f}};
    for (int j = 0; j < K; j++) {
        routed[0][j][0] = j == 0 ? big : 1.0f;     /* 2^24 first: each +1 ties to even and is lost */
        routed[1][j][0] = j == K - 1 ? big : 1.0f; /* 2^24 last: 5 + 2^24 rounds to 2^24 + 4 */
        routed[0][j][1] = j == K - 1 ? big : 1.0f;
        routed[1][j][1] = j == 0 ? big : 1.0f;
        routed[0][j][2] = j == 0 ? 0x1p20f : 0x1.8p-4f;
        routed[1][j][2] = j == K - 1 ? -0x1p20f : 0x1.4p-3f;
    }
    /* slot layout of ds41__moe: expert by expert in increasing id, its tokens in row order */
    float oe[TOTAL * D];
    uint32_t slot_of[TOTAL]; /* [M][K]: each token's slots in increasing expert id */
    for (int j = 0; j < K; j++)
        for (int r = 0; r < M; r++) {
            const size_t slot = (size_t)(j * M + r);
            slot_of[r * K + j] = (uint32_t)slot;
            memcpy(oe + slot * D, routed[r][j], sizeof routed[r][j]);
        }
    float out[M * D];
    memset(out, 0xff, sizeof out);
    ops->moe_combine(ops, oe, slot_of, K, &shared[0][0], M, D, out);
    /* the definition: per token, fp32 sum from 0 in increasing expert id, plus shared, bf16 */
    int ok = 1;
    for (int r = 0; r < M; r++)
        for (int d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) acc = acc + routed[r][j][d];
            const float want = ds41_bf16_round(acc + shared[r][d]);
            if (out[r * D + d] != want) {
                ok = 0;
                TAP_NOTE("token %d dim %d: out %g, expected %g (y %.9g)", r, d, (double)out[r * D + d],
                         (double)want, (double)acc);
            }
        }
    TAP_CHECK(
        ok,
        "%s MoE combine of %d tokens: 6 routed outputs summed in increasing expert id, then the shared one",
        ops->name, M);
    TAP_CHECK(out[0] == 0.0f && out[D] == 4.0f && out[1] == 4.0f && out[D + 1] == 0.0f,
              "%s MoE combine: 2^24 then five 1s loses them (0), five 1s then 2^24 keeps 4", ops->name);
}

int main(void) {
    test_compress_pool(&ds41_ops_reference);
    test_index_ops(&ds41_ops_reference);
    test_moe_combine(&ds41_ops_reference);
    ds41_error err;
    ds41_cpu_opts o = {.threads = 2};
    ds41_backend *fast = ds41_backend_cpu_new(&o, &err);
    TAP_CHECK(fast != NULL, "the fast CPU backend starts");
    if (fast) {
        test_compress_pool(&fast->ops);
        test_index_ops(&fast->ops);
        test_moe_combine(&fast->ops);
        ds41_backend_free(fast);
    }
    test_index_rank();
    return tap_done();
}
