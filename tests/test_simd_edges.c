/* Edge lanes of the SIMD kernels at every CPU level this machine runs
 * (issue 19): an FP8 weight's NaN code inside a full 32-wide block (the
 * vector decoder takes the table for it; a wrong mask turns NaN into 480),
 * and the zero padding of a bf16 panel row when an earlier linear of another
 * shape left an infinity in the same scratch (a padding lane left stale turns
 * 0 * inf into NaN).  Both are compared with the reference backend bit for
 * bit where the reference is NaN, and by NaN-ness elsewhere. */
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/ops.h"
#include "engine/model/quant.h"
#include "tests/tap.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int count_nan(const float *y, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c += isnan(y[i]) != 0;
    return c;
}

static void test_level(ds41_cpu_level level) {
    ds41_error err = {{0}};
    ds41_cpu_opts o = {.threads = 1, .level = level};
    ds41_backend *be = ds41_backend_cpu_new(&o, &err);
    if (!TAP_CHECK(be != NULL, "backend at level %s%s%s", ds41_cpu_level_name(level), be ? "" : ": ",
                   be ? "" : err.msg))
        return;
    const ds41_ops *ops = &be->ops;
    const char *name = ds41_cpu_level_name(level);

    /* FP8: N = 4 rows, K = 64 (two full blocks); row 1 holds the NaN code 0x7F at k = 5,
     * row 2 the negative NaN code 0xFF at k = 40. */
    enum { N = 4, K = 64 };
    uint8_t q[N * K], sc[2] = {127, 126};
    for (size_t i = 0; i < N * K; i++) q[i] = (uint8_t)(0x30 + i % 7);
    q[1 * K + 5] = 0x7F;
    q[2 * K + 40] = 0xFF;
    ds41_linear w = {.kind = DS41_LINEAR_FP8, .n = N, .k = K, .q = q, .scale = sc, .scale_cols = 2};
    float x[K], y[N];
    for (size_t k = 0; k < K; k++) x[k] = (float)((int)(k % 5) - 2) * 0.25f;
    ops->linear(ops, &w, x, 1, y, DS41_OUT_F32);
    TAP_CHECK(isnan(y[1]) && isnan(y[2]) && !isnan(y[0]) && !isnan(y[3]),
              "%s: FP8 NaN codes inside full blocks give NaN rows, the others stay finite", name);

    /* bf16: first a linear with K = 64 whose every weight is +inf (fills the panel scratch
     * with inf), then K = 40 (padded to 64): its padding lanes must be zero, so finite
     * weights and inputs give finite outputs. */
    enum { K1 = 64, K2 = 40, N2 = 8 };
    static uint16_t wi[N2 * K1], wf[N2 * K2];
    for (size_t i = 0; i < N2 * K1; i++) wi[i] = 0x7F80; /* +inf */
    for (size_t i = 0; i < N2 * K2; i++) wf[i] = ds41_bf16_bits((float)(i % 9) * 0.125f - 0.5f);
    ds41_linear a = {.kind = DS41_LINEAR_BF16, .n = N2, .k = K1, .bf16 = wi};
    ds41_linear b = {.kind = DS41_LINEAR_BF16, .n = N2, .k = K2, .bf16 = wf};
    float xa[K1], ya[N2], xb[K2], yb[N2];
    for (size_t k = 0; k < K1; k++) xa[k] = 1.0f;
    for (size_t k = 0; k < K2; k++) xb[k] = (float)(k % 3) * 0.5f;
    ops->linear(ops, &a, xa, 1, ya, DS41_OUT_F32);
    ops->linear(ops, &b, xb, 1, yb, DS41_OUT_F32);
    TAP_CHECK(count_nan(yb, N2) == 0, "%s: a bf16 row padded to 32 lanes is finite after a linear that left inf in "
                                      "the scratch (%d NaN)",
              name, count_nan(yb, N2));
    ds41_backend_free(be);
}

int main(void) {
    const ds41_cpu_level top = ds41_cpu_level_detect();
    for (int l = DS41_CPU_SCALAR; l <= (int)top; l++) test_level((ds41_cpu_level)l);
    return tap_done();
}
