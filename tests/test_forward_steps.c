/* The forward pass's decision steps as pure functions, on inputs the generated checkpoints never
 * produce (issue 19): the compressor's softmax pooling with gate scores 100 and more apart (its
 * max shift is what keeps exp() finite), the indexer's ranking with NaN scores (torch.topk puts
 * NaN first), and the MoE combine of the release's 6 routed experts with outputs 2^24 apart, where
 * the fp32 summation order shows in the result.  Each runs in milliseconds; the end-to-end
 * bit-exactness tests cover the same code on real shapes. */
#include "engine/forward/forward_internal.h"
#include "engine/model/quant.h"
#include "tests/tap.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

static void test_compress_pool(void) {
    enum { RATIO = 4, HD = 5 };
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
    float ckv[RATIO * HD], csc[RATIO * HD], ex[RATIO], pooled[HD];
    for (int t = 0; t < RATIO; t++)
        for (int ch = 0; ch < HD; ch++) {
            ckv[t * HD + ch] = kv[ch][t];
            csc[t * HD + ch] = scores[ch][t];
        }
    ds41__compress_pool(ckv, csc, RATIO, HD, ex, pooled);
    for (int ch = 0; ch < HD; ch++) {
        TAP_CHECK(pooled[ch] == expect[ch], "compressor pooling: %s", what[ch]);
        if (pooled[ch] != expect[ch])
            TAP_NOTE("pooled %g, expected %g", (double)pooled[ch], (double)expect[ch]);
    }
}

static void test_index_rank(void) {
    const float score[] = {1.0f, NAN, 3.0f, 3.0f, NAN, -INFINITY, 2.0f, -0.0f, 0.0f};
    /* NaN first (lower index first among them), then descending, equal scores (also -0 and +0) by
     * lower index */
    const int32_t expect[] = {1, 4, 2, 3, 6, 0, 7, 8, 5};
    const size_t n = sizeof score / sizeof score[0];
    int32_t order[sizeof score / sizeof score[0]], tmp[sizeof score / sizeof score[0]];
    ds41__index_rank(score, order, tmp, n);
    TAP_CHECK(memcmp(order, expect, sizeof expect) == 0,
              "indexer ranking: NaN scores first (torch.topk), then descending, ties by lower index");
    if (memcmp(order, expect, sizeof expect) != 0)
        for (size_t i = 0; i < n; i++) TAP_NOTE("order[%zu] = %d, expected %d", i, order[i], expect[i]);
}

static void test_moe_combine(void) {
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
    float oe[(TOTAL + M) * D];
    size_t rows[TOTAL];
    for (int j = 0; j < K; j++)
        for (int r = 0; r < M; r++) {
            const size_t slot = (size_t)(j * M + r);
            rows[slot] = (size_t)r;
            memcpy(oe + slot * D, routed[r][j], sizeof routed[r][j]);
        }
    memcpy(oe + (size_t)TOTAL * D, shared, sizeof shared);
    float y[M * D], out[M * D];
    ds41__moe_combine(oe, rows, TOTAL, M, D, y, out);
    /* the definition: per token, fp32 sum from 0 in increasing expert id, plus shared, bf16 */
    int ok = 1;
    for (int r = 0; r < M; r++)
        for (int d = 0; d < D; d++) {
            float acc = 0.0f;
            for (int j = 0; j < K; j++) acc = acc + routed[r][j][d];
            const float want = ds41_bf16_round(acc + shared[r][d]);
            if (out[r * D + d] != want || y[r * D + d] != acc) {
                ok = 0;
                TAP_NOTE("token %d dim %d: out %g y %.9g, expected %g y %.9g", r, d, (double)out[r * D + d],
                         (double)y[r * D + d], (double)want, (double)acc);
            }
        }
    TAP_CHECK(ok, "MoE combine: 6 routed outputs summed in increasing expert id, then the shared one");
    TAP_CHECK(out[0] == 0.0f && out[D] == 4.0f && out[1] == 4.0f && out[D + 1] == 0.0f,
              "MoE combine: 2^24 then five 1s loses them (0), five 1s then 2^24 keeps 4");
}

int main(void) {
    test_compress_pool();
    test_index_rank();
    test_moe_combine();
    return tap_done();
}
