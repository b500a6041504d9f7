/* ds41-bench --kernels: see bench_kernels.h. */
#include "daemon/bench_kernels.h"

#include "engine/model/weights.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct shape {
    const char *format;
    ds41_linear_kind kind;
    size_t n, k, linears;
} shape;

/* Bytes of one linear as stored: codes (or bf16 values), then its scales. */
static size_t code_bytes(const shape *s) {
    switch (s->kind) {
    case DS41_LINEAR_BF16:
        return s->n * s->k * 2;
    case DS41_LINEAR_FP8:
        return s->n * s->k;
    default:
        return s->n * ((s->k + 1) / 2);
    }
}

static size_t scale_bytes(const shape *s) {
    switch (s->kind) {
    case DS41_LINEAR_FP8:
        return (s->n + 31) / 32 * ((s->k + 31) / 32);
    case DS41_LINEAR_FP4:
        return s->n * ((s->k + 31) / 32);
    default:
        return 0;
    }
}

/* Linears laid out back to back in mem (each 64-byte aligned), contents
 * valid for the format: e4m3 codes without the NaN pattern, any e2m1 code,
 * bf16 values of ordinary magnitude, scale bytes 2^-7 .. 2^0. */
static size_t place(const shape *s, uint8_t *mem, size_t bytes, ds41_linear *ws, size_t cap) {
    const size_t cb = code_bytes(s), sb = scale_bytes(s), one = (cb + sb + 63) & ~(size_t)63;
    size_t count = bytes / one;
    if (count > cap) count = cap;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < count; i++) {
        uint8_t *p = mem + i * one;
        if (s->kind == DS41_LINEAR_BF16) {
            uint16_t *v = (uint16_t *)p;
            for (size_t j = 0; j < cb / 2; j++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                v[j] = (uint16_t)(0x3C00 | ((x >> 33) & 0x7F) | (((x >> 60) & 1) << 15) | (((x >> 50) & 7) << 7));
            }
        } else {
            for (size_t j = 0; j < cb; j += 8) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                uint64_t w = x;
                if (s->kind == DS41_LINEAR_FP8) w &= 0xBEBEBEBEBEBEBEBEull; /* never 0x7F / 0xFF */
                memcpy(p + j, &w, cb - j < 8 ? cb - j : 8);
            }
            for (size_t j = 0; j < sb; j++) p[cb + j] = (uint8_t)(120 + (j % 8));
        }
        ws[i] = (ds41_linear){.kind = s->kind, .n = (int64_t)s->n, .k = (int64_t)s->k};
        if (s->kind == DS41_LINEAR_BF16)
            ws[i].bf16 = (const uint16_t *)p;
        else {
            ws[i].q = p;
            ws[i].scale = p + cb;
            ws[i].scale_cols = (int64_t)((s->k + 31) / 32);
        }
    }
    return count;
}

/* Weight bytes per second of calls of `per` linears over ws[0 .. count),
 * cycling through them for at least min_s seconds (best of `passes`
 * passes when min_s is 0: each pass reads every linear once). */
static double run(ds41_backend *be, const shape *s, const ds41_linear *ws, size_t count, size_t rows,
                  double min_s, int passes, const float *x, float *y) {
    const size_t per = s->linears;
    const ds41_linear *wp[16];
    const float *xp[16];
    float *yp[16];
    size_t Ms[16];
    for (size_t i = 0; i < per; i++) {
        xp[i] = x + i * rows * s->k;
        yp[i] = y + i * rows * s->n;
        Ms[i] = rows;
    }
    const double one = (double)(code_bytes(s) + scale_bytes(s));
    const size_t calls = count / per;
    double best = 0;
    for (int pass = 0; pass < passes; pass++) {
        const double t0 = now();
        double t = 0, bytes = 0;
        do {
            for (size_t c = 0; c < calls; c++) {
                for (size_t i = 0; i < per; i++) wp[i] = &ws[c * per + i];
                be->ops.linear_batch(&be->ops, per, wp, xp, Ms, yp, DS41_OUT_BF16);
            }
            bytes += (double)(calls * per) * one;
            t = now() - t0;
        } while (t < min_s);
        if (t > 0 && bytes / t > best) best = bytes / t;
    }
    return best / 1e9;
}

int ds41_bench_kernel_ceilings(ds41_backend *be, uint64_t memory_bytes, ds41_kernel_ceiling *out, size_t cap,
                               size_t *n, ds41_error *err) {
    static const shape shapes[] = {
        {"fp4", DS41_LINEAR_FP4, 512, 2048, 6},
        {"fp8", DS41_LINEAR_FP8, 2048, 2048, 1},
        {"bf16", DS41_LINEAR_BF16, 8192, 2048, 1},
    };
    static const size_t rows[] = {1, 4, 16};
    *n = 0;
    if (cap < 9) return ds41_fail(err, "kernel ceilings: room for 9 results needed");
    if (memory_bytes < (64u << 20)) memory_bytes = 64u << 20;
    const size_t threads = (size_t)ds41_backend_threads(be);
    const size_t max_lin = memory_bytes / (512 * 1024) + 64;
    uint8_t *mem = aligned_alloc(4096, (size_t)memory_bytes);
    ds41_linear *ws = calloc(max_lin, sizeof *ws);
    float *x = calloc(16 * 16 * 2048, sizeof *x), *y = calloc(16 * 16 * 8192, sizeof *y);
    if (!mem || !ws || !x || !y) {
        free(mem), free(ws), free(x), free(y);
        return ds41_fail(err, "kernel ceilings: out of memory for a %llu-byte weight set",
                         (unsigned long long)memory_bytes);
    }
    for (size_t i = 0; i < 16 * 16 * 2048; i++) x[i] = (float)((int)(i % 17) - 8) * 0.125f;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const shape *s = &shapes[si];
        /* Memory: the whole set; cache: about 1 MiB per thread, at least one call. */
        const size_t count = place(s, mem, (size_t)memory_bytes, ws, max_lin);
        const size_t one = code_bytes(s) + scale_bytes(s);
        size_t small = (threads << 20) / one;
        if (small < s->linears) small = s->linears;
        small = small / s->linears * s->linears;
        for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
            ds41_kernel_ceiling *c = &out[(*n)++];
            *c = (ds41_kernel_ceiling){.format = s->format, .n = s->n, .k = s->k, .linears = s->linears,
                                       .rows = rows[ri]};
            run(be, s, ws, small, rows[ri], 0.02, 1, x, y); /* warm */
            c->cache_gbs = run(be, s, ws, small, rows[ri], 0.25, 1, x, y);
            c->memory_gbs = run(be, s, ws, count / s->linears * s->linears, rows[ri], 0, 3, x, y);
        }
    }
    free(mem), free(ws), free(x), free(y);
    return 0;
}
