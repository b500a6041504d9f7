/* The fast CPU backend: the op table over the level kernels
 * (engine/backend/cpu/fast_kernels.h), the thread pool, scratch and counters, CPU feature
 * detection, and the reference and wrapper backends of engine/backend/backend.h. */
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/backend/cpu/fast_kernels.h"

#include "engine/backend/cpu/threadpool.h"
#include "engine/backend/index_select.h"
#include "engine/backend/refmath.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

/* ---- CPU levels -------------------------------------------------------------------------- */

#if defined(__x86_64__)
static uint64_t xgetbv0(void) {
    uint32_t a, d;
    __asm__ __volatile__("xgetbv" : "=a"(a), "=d"(d) : "c"(0));
    return ((uint64_t)d << 32) | a;
}
#endif

static int amx_usable(void) {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16) return 0;
    /* XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS manages the state;
     * then the process asks for it. */
    if ((xgetbv0() & 0x60000) != 0x60000) return 0;
    static int granted = -1;
    if (granted < 0) granted = ds41__amx_enable();
    return granted;
#else
    return 0;
#endif
}

static ds41_cpu_level hardware_level(void) {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return DS41_CPU_SCALAR;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return DS41_CPU_SCALAR;
    const uint64_t xcr0 = xgetbv0();
    const int ymm_state = (xcr0 & 0x6) == 0x6, zmm_state = (xcr0 & 0xE6) == 0xE6;
    unsigned b7 = 0, c7 = 0, a71 = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        b7 = b;
        c7 = c;
        if (a >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) a71 = a;
    }
    const int avx2 = (b7 >> 5) & 1;
    const int f512 = (b7 >> 16) & 1, dq = (b7 >> 17) & 1, bw = (b7 >> 30) & 1, vl = (b7 >> 31) & 1;
    const int vbmi = (c7 >> 1) & 1, bf16 = (a71 >> 5) & 1;
    if (!ymm_state || !avx2 || !fma || !f16c) return DS41_CPU_SCALAR;
    if (zmm_state && f512 && dq && bw && vl && vbmi && bf16)
        return amx_usable() ? DS41_CPU_AMX : DS41_CPU_AVX512;
    return DS41_CPU_AVX2;
#else
    return DS41_CPU_SCALAR;
#endif
}

ds41_cpu_level ds41_cpu_level_detect(void) {
    ds41_cpu_level l = hardware_level();
    const char *env = getenv("DS41_CPU_LEVEL");
    if (env) {
        ds41_cpu_level cap = strcmp(env, "scalar") == 0   ? DS41_CPU_SCALAR
                             : strcmp(env, "avx2") == 0   ? DS41_CPU_AVX2
                             : strcmp(env, "avx512") == 0 ? DS41_CPU_AVX512
                                                          : DS41_CPU_AMX;
        if (cap < l) l = cap;
    }
    return l;
}

const char *ds41_cpu_level_name(ds41_cpu_level level) {
    switch (level) {
    case DS41_CPU_SCALAR:
        return "scalar";
    case DS41_CPU_AVX2:
        return "avx2";
    case DS41_CPU_AVX512:
        return "avx512";
    case DS41_CPU_AMX:
        return "amx";
    default:
        return "auto";
    }
}

static const fast_kernels *kernels_for(ds41_cpu_level level) {
#if defined(__x86_64__)
    if (level == DS41_CPU_AMX) return &ds41__fast_amx;
    if (level == DS41_CPU_AVX512) return &ds41__fast_avx512;
    if (level == DS41_CPU_AVX2) return &ds41__fast_avx2;
#endif
    (void)level;
    return &ds41__fast_scalar;
}

/* ---- backend state ------------------------------------------------------------------------ */

enum {
    BREAK_INDEX_BF16 = 1,
    BREAK_SWIGLU_BF16 = 2,
    BREAK_ATTN_P_BF16 = 4,
};

typedef struct buf {
    void *p;
    size_t cap;
} buf;

/* Op kinds timed when DS41_FAST_PROFILE is set (printed at destroy). */
enum {
    P_LINEAR_FP8,
    P_LINEAR_FP4,
    P_LINEAR_BF16,
    P_LINEAR_BATCH,
    P_NORM,
    P_HC_MIX,
    P_HC_PREPOST,
    P_INDEX,
    P_ATTN,
    P_SWIGLU,
    P_ENGRAM,
    P_COUNT
};
static const char *const prof_names[P_COUNT] = {
    "linear fp8",   "linear fp4",  "linear bf16", "linear batch (MoE)", "rmsnorm", "hc_mix", "hc_pre/post",
    "index_scores", "sparse_attn", "swiglu",      "engram_mix"};

typedef struct fast_ctx {
    const fast_kernels *k;
    ds41_threadpool *pool;
    int n_threads;
    buf act, work, work2;
    buf lin_starts, lin_act; /* run_linears' task tables, kept between calls */
    buf attn_rows;           /* attend's per-row pointer lists */
    buf *scratch; /* [n_threads] */
    ds41_backend_stats st;
    unsigned brk;
    int profile;
    double prof_s[P_COUNT];
    uint64_t prof_calls[P_COUNT], prof_bytes[P_COUNT];
} fast_ctx;

static double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define PROF_BEGIN(c) const double prof_t0 = (c)->profile ? prof_now() : 0.0
#define PROF_END(c, kind, bytes)                                                                             \
    do {                                                                                                     \
        if ((c)->profile) {                                                                                  \
            (c)->prof_s[kind] += prof_now() - prof_t0;                                                       \
            (c)->prof_calls[kind]++;                                                                         \
            (c)->prof_bytes[kind] += (bytes);                                                                \
        }                                                                                                    \
    } while (0)

/* Grow b to at least `bytes` (64-byte aligned, contents not kept).  The ops
 * cannot fail, so running out of memory here is fatal rather than wrong. */
static void *ensure(buf *b, size_t bytes) {
    if (bytes == 0) bytes = 1;
    if (b->cap < bytes) {
        free(b->p);
        size_t cap = (bytes + 63) & ~(size_t)63;
        b->p = aligned_alloc(64, cap);
        if (!b->p) abort();
        b->cap = cap;
    }
    return b->p;
}

static void ensure_scratch(fast_ctx *c, size_t bytes) {
    for (int t = 0; t < c->n_threads; t++) ensure(&c->scratch[t], bytes);
}

static fast_ctx *ctx_of(const ds41_ops *self) {
    return self->ctx;
}

/* ---- linear --------------------------------------------------------------------------------- */

/* A batch of independent linears run as two parallel jobs: packing every
 * linear's activations (groups of pack_rows rows), then every (linear, column
 * block, row block) task.  A single linear is a batch of one. */
typedef struct lin_job {
    fast_ctx *c;
    size_t n;
    const ds41_linear *const *ws;
    const float *const *xs;
    const size_t *Ms;
    float *const *ys;
    int out_bf16;
    uint8_t **act;      /* [n] each linear's packed activations */
    size_t *pack_start; /* [n + 1] prefix sums of pack groups */
    size_t *task_start; /* [n + 1] prefix sums of tasks */
} lin_job;

/* The linear a flat index belongs to (start is non-decreasing, start[0] = 0). */
static size_t find_linear(const size_t *start, size_t n, size_t t) {
    size_t lo = 0, hi = n; /* start[lo] <= t < start[hi] */
    while (hi - lo > 1) {
        const size_t mid = (lo + hi) / 2;
        if (start[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

static void pack_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    lin_job *j = p;
    const size_t unit = j->c->k->pack_rows;
    for (size_t t = b; t < e; t++) {
        const size_t i = find_linear(j->pack_start, j->n, t), g = t - j->pack_start[i];
        const ds41_linear *w = j->ws[i];
        const size_t K = (size_t)w->k;
        j->c->k->pack_act(w->kind, j->xs[i] + g * unit * K, K, j->Ms[i], g * unit, j->act[i]);
    }
}

/* Task t of a linear job: its linear, weight rows [n0, n1) and activation
 * rows [m0, m1). */
typedef struct lin_task_at {
    size_t i, n0, n1, m0, m1;
} lin_task_at;

static lin_task_at task_at(const lin_job *j, size_t t) {
    const size_t i = find_linear(j->task_start, j->n, t), lt = t - j->task_start[i];
    const ds41_linear *w = j->ws[i];
    const size_t N = (size_t)w->n, M = j->Ms[i], ncb = (N + FAST_COLS - 1) / FAST_COLS;
    const size_t cb = lt % ncb, rb = lt / ncb;
    lin_task_at a = {.i = i, .n0 = cb * FAST_COLS, .m0 = rb * FAST_ROWS};
    a.n1 = a.n0 + FAST_COLS < N ? a.n0 + FAST_COLS : N;
    a.m1 = a.m0 + FAST_ROWS < M ? a.m0 + FAST_ROWS : M;
    return a;
}

/* The weight bytes rows [n0, n1) of w are stored in (codes or bf16 values,
 * then scales), as the lines to prefetch for a task that reads them. */
static fast_prefetch weight_range(const ds41_linear *w, size_t n0, size_t n1) {
    fast_prefetch r = {{NULL, NULL}, {NULL, NULL}};
    const size_t K = (size_t)w->k;
    const char *q = NULL, *s = NULL;
    size_t qrow = 0, srow = 0, s0 = n0, s1 = n1;
    switch (w->kind) {
    case DS41_LINEAR_BF16:
        q = (const char *)w->bf16, qrow = K * 2;
        break;
    case DS41_LINEAR_FP8:
        q = (const char *)w->q, qrow = K, s = (const char *)w->scale, srow = (size_t)w->scale_cols;
        s0 = n0 / 32, s1 = (n1 + 31) / 32;
        break;
    case DS41_LINEAR_FP4:
        q = (const char *)w->q, qrow = (K + 1) / 2, s = (const char *)w->scale, srow = (size_t)w->scale_cols;
        break;
    default:
        return r;
    }
    /* Whole lines: start at the line holding the first byte. */
    r.p[0] = (const char *)((uintptr_t)(q + n0 * qrow) & ~(uintptr_t)63);
    r.end[0] = q + n1 * qrow;
    if (s) {
        r.p[1] = (const char *)((uintptr_t)(s + s0 * srow) & ~(uintptr_t)63);
        r.end[1] = s + s1 * srow;
    }
    return r;
}

/* A thread runs its range of tasks in order; tasks of one linear with few
 * rows are consecutive row blocks, contiguous in memory, so each task
 * prefetches the next one's weights (fast_prefetch). */
static void lin_task(void *p, size_t b, size_t e, int th) {
    lin_job *j = p;
    for (size_t t = b; t < e; t++) {
        const lin_task_at a = task_at(j, t);
        fast_prefetch next = {{NULL, NULL}, {NULL, NULL}};
        if (t + 1 < e) {
            /* (Only a first row block reads its weights from memory; later
             * ones of the same columns follow it.) */
            const lin_task_at nx = task_at(j, t + 1);
            if (nx.m0 == 0) next = weight_range(j->ws[nx.i], nx.n0, nx.n1);
        }
        j->c->k->linear_cols(j->ws[a.i], j->act[a.i], j->Ms[a.i], a.m0, a.m1, a.n0, a.n1, j->ys[a.i],
                             j->out_bf16, j->c->scratch[th].p, &next);
    }
}

static uint64_t linear_weight_bytes(const ds41_linear *w) {
    const uint64_t N = (uint64_t)w->n, K = (uint64_t)w->k;
    switch (w->kind) {
    case DS41_LINEAR_BF16:
        return N * K * 2;
    case DS41_LINEAR_FP8:
        return N * K + (N + 31) / 32 * (uint64_t)w->scale_cols;
    case DS41_LINEAR_FP4:
        return N * ((K + 1) / 2) + N * (uint64_t)w->scale_cols;
    default:
        return 0;
    }
}

static void run_linears(fast_ctx *c, size_t n, const ds41_linear *const *ws, const float *const *xs,
                        const size_t *Ms, float *const *ys, ds41_linear_out out, int prof_kind) {
    PROF_BEGIN(c);
    size_t *starts = ensure(&c->lin_starts, 2 * (n + 1) * sizeof *starts);
    uint8_t **act = ensure(&c->lin_act, (n ? n : 1) * sizeof *act);
    lin_job j = {.c = c,
                 .n = n,
                 .ws = ws,
                 .xs = xs,
                 .Ms = Ms,
                 .ys = ys,
                 .out_bf16 = ds41_linear_out_bf16(out),
                 .act = act,
                 .pack_start = starts,
                 .task_start = starts + n + 1};
    const size_t unit = c->k->pack_rows;
    size_t act_total = 0, scratch = 0, groups = 0, tasks = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; i++) {
        const ds41_linear *w = ws[i];
        const size_t N = (size_t)w->n, K = (size_t)w->k, M = Ms[i];
        j.pack_start[i] = groups;
        j.task_start[i] = tasks;
        if (M == 0 || N == 0) continue;
        if (K == 0 || w->kind == DS41_LINEAR_NONE) {
            memset(ys[i], 0, M * N * sizeof(float));
            continue;
        }
        bytes += linear_weight_bytes(w);
        c->st.flops += 2 * (uint64_t)M * N * K;
        act_total += (c->k->act_bytes(w->kind, K, M) + 63) & ~(size_t)63;
        const size_t sb = c->k->scratch_bytes(w->kind, M < FAST_ROWS ? M : FAST_ROWS, K);
        if (sb > scratch) scratch = sb;
        groups += (M + unit - 1) / unit;
        tasks += ((N + FAST_COLS - 1) / FAST_COLS) * ((M + FAST_ROWS - 1) / FAST_ROWS);
    }
    j.pack_start[n] = groups;
    j.task_start[n] = tasks;
    c->st.weight_bytes += bytes;
    uint8_t *base = ensure(&c->act, act_total);
    for (size_t i = 0, off = 0; i < n; i++) {
        act[i] = base + off;
        const ds41_linear *w = ws[i];
        if (Ms[i] && w->n && w->k && w->kind != DS41_LINEAR_NONE)
            off += (c->k->act_bytes(w->kind, (size_t)w->k, Ms[i]) + 63) & ~(size_t)63;
    }
    if (groups) {
        /* Pack groups of about 32K values of work each. */
        const size_t K0 = n ? (size_t)ws[0]->k : 1;
        ds41_threadpool_run(c->pool, groups, 1 + 32768 / ((K0 ? K0 : 1) * unit), pack_task, &j);
        ensure_scratch(c, scratch);
        /* Runs of consecutive tasks (about four per thread), so that a
         * thread walks through contiguous weight rows and prefetches each
         * next task's while it works (lin_task); still dynamic enough that
         * a thread the OS delays does not hold the others up for long. */
        const size_t runs = (size_t)c->n_threads * 4;
        ds41_threadpool_run(c->pool, tasks, (tasks + runs - 1) / runs, lin_task, &j);
    }
    PROF_END(c, prof_kind, bytes);
}

/* ---- exact linears (DS41_OUT_*_EXACT: the indexer's inputs) ------------------------------- */

/* The reference's arithmetic (§10.2-10.3, engine/backend/ops_ref.c), split over
 * output columns.  FP8 / FP4: per 32-wide K block the sum of the code
 * products (multiples of 2^-18 below 2^18, so 32 of them are exact in
 * double in any order: every summation order gives the one exact value),
 * rounded to fp32, times fp32(a_scale * b_scale), added to an fp32
 * accumulator in block order.  BF16: the exact sum rounded once
 * (ds41_xdot_f32_bf16).  So the result is the reference's bit for bit at
 * every level.  A level with exact kernels (fast_kernels.h xlin_cols,
 * xdot_bf16) runs them vectorized over K and across columns; the element
 * by element route below stays for levels without them and for the columns
 * and rows that hold NaN codes or scales (whose NaN payloads the vector
 * route does not promise to reproduce). */
typedef struct xlin_job {
    fast_ctx *c;
    const ds41_linear *w;
    const float *x;  /* BF16: the input rows */
    const float *av; /* FP8 / FP4: [M][K] activation code values (unscaled) */
    const float *as; /* [M][nkb] activation block scales */
    const double *ad; /* [M][nkb * 32] the same code values in double, zero padded (xlin_cols) */
    size_t M, K, nkb;
    float *y;
    int out_bf16;
    uint8_t *bad; /* [N] columns xlin_cols left to the element route */
} xlin_job;

static void xlin_task(void *p, size_t b, size_t e, int th) {
    xlin_job *j = p;
    const ds41_linear *w = j->w;
    const size_t K = j->K, N = (size_t)w->n, nkb = j->nkb;
    for (size_t n = b; n < e; n++) {
        if (w->kind == DS41_LINEAR_BF16) {
            float (*const xdot)(const float *, const uint16_t *, size_t) =
                j->c->k->xdot_bf16 ? j->c->k->xdot_bf16 : ds41_xdot_f32_bf16;
            for (size_t m = 0; m < j->M; m++) {
                const float v = xdot(j->x + m * K, w->bf16 + n * K, K);
                j->y[m * N + n] = j->out_bf16 ? fast_bf16_round(v) : v;
            }
            continue;
        }
        float *wv = j->c->scratch[th].p, *ws = wv + K;
        const int fp4 = w->kind == DS41_LINEAR_FP4;
        const uint8_t *q = w->q + n * fast_row_bytes(w);
        for (size_t k = 0; k < K; k++)
            wv[k] = fp4 ? ds41_e2m1_table[(q[k / 2] >> ((k & 1) * 4)) & 15] : ds41_e4m3_table[q[k]];
        const uint8_t *srow = w->scale + (fp4 ? n : n / 32) * (size_t)w->scale_cols;
        for (size_t kb = 0; kb < nkb; kb++) ws[kb] = fast_ue8m0(srow[kb]);
        for (size_t m = 0; m < j->M; m++) {
            const float *a = j->av + m * K, *sa = j->as + m * nkb;
            float acc = 0.0f;
            for (size_t kb = 0; kb < nkb; kb++) {
                const size_t k0 = kb * 32, len = K - k0 < 32 ? K - k0 : 32;
                const float pf = (float)j->c->k->dot(a + k0, wv + k0, len);
                const float sc = sa[kb] * ws[kb];
                const float t = pf * sc;
                acc = acc + t;
            }
            j->y[m * N + n] = fast_bf16_round(acc);
        }
    }
}

/* Tiles of XLIN_COLS columns on the level's exact kernel. */
static void xlin_tile_task(void *p, size_t b, size_t e, int th) {
    xlin_job *j = p;
    const size_t N = (size_t)j->w->n, n0 = b * XLIN_COLS, n1 = e * XLIN_COLS < N ? e * XLIN_COLS : N;
    j->c->k->xlin_cols(j->w, j->ad, j->as, j->M, n0, n1, j->y, j->c->scratch[th].p, j->bad + n0);
}

/* The activations' act_quant (as ds41_act_quant), rows [b, e): code values
 * in fp32 and in double (zero padded to whole blocks), the block scales, and
 * whether the row holds a NaN value or scale (its outputs then come from the
 * element route). */
typedef struct xact_job {
    const float *x;
    size_t K, nkb;
    float *av, *as;
    double *ad; /* NULL when the level has no xlin_cols */
    uint8_t *row_bad;
    fast_ctx *c;
} xact_job;

static void xact_task(void *p, size_t b, size_t e, int th) {
    xact_job *j = p;
    const size_t K = j->K, nkb = j->nkb, Kp = nkb * 32;
    uint8_t *codes = j->c->scratch[th].p, *sb = codes + K;
    for (size_t m = b; m < e; m++) {
        ds41_act_quant(j->x + m * K, K, codes, sb);
        float *av = j->av + m * K, *as = j->as + m * nkb;
        int bad = 0;
        for (size_t k = 0; k < K; k++) {
            av[k] = ds41_e4m3_table[codes[k]];
            bad |= (codes[k] & 0x7F) == 0x7F;
        }
        for (size_t kb = 0; kb < nkb; kb++) {
            as[kb] = fast_ue8m0(sb[kb]);
            bad |= sb[kb] == 255;
        }
        if (j->ad) {
            double *ad = j->ad + m * Kp;
            for (size_t k = 0; k < K; k++) ad[k] = (double)av[k];
            for (size_t k = K; k < Kp; k++) ad[k] = 0.0;
        }
        j->row_bad[m] = (uint8_t)bad;
    }
}

static void fast_linear_exact(fast_ctx *c, const ds41_linear *w, const float *x, size_t M, float *y,
                              int out_bf16) {
    PROF_BEGIN(c);
    const size_t N = (size_t)w->n, K = (size_t)w->k, nkb = (K + 31) / 32, Kp = nkb * 32;
    if (M == 0 || N == 0) return;
    if (K == 0 || w->kind == DS41_LINEAR_NONE) {
        memset(y, 0, M * N * sizeof *y);
        return;
    }
    c->st.flops += 2 * (uint64_t)M * N * K;
    c->st.weight_bytes += linear_weight_bytes(w);
    xlin_job j = {.c = c, .w = w, .x = x, .M = M, .K = K, .nkb = nkb, .y = y, .out_bf16 = out_bf16};
    if (w->kind == DS41_LINEAR_BF16) {
        ds41_threadpool_run(c->pool, N, 1 + 32768 / (M * K + 1), xlin_task, &j);
    } else {
        const int vec = c->k->xlin_cols != NULL;
        /* work2: av [M][K] | as [M][nkb] | ad [M][Kp] (vec) | row_bad [M] | bad [N] */
        const size_t av_b = (M * K + M * nkb) * sizeof(float), ad_b = vec ? M * Kp * sizeof(double) : 0;
        uint8_t *base = ensure(&c->work2, ((av_b + 63) & ~(size_t)63) + ad_b + M + N);
        float *av = (float *)base, *as = av + M * K;
        double *ad = vec ? (double *)(base + ((av_b + 63) & ~(size_t)63)) : NULL;
        uint8_t *row_bad = base + ((av_b + 63) & ~(size_t)63) + ad_b, *bad = row_bad + M;
        size_t scratch = (K + nkb) * sizeof(float);
        if (vec && c->k->xlin_scratch(M) > scratch) scratch = c->k->xlin_scratch(M);
        ensure_scratch(c, scratch);
        xact_job aj = {.x = x, .K = K, .nkb = nkb, .av = av, .as = as, .ad = ad, .row_bad = row_bad, .c = c};
        ds41_threadpool_run(c->pool, M, 1 + 16384 / K, xact_task, &aj);
        j.av = av;
        j.as = as;
        j.ad = ad;
        j.bad = bad;
        if (!vec) {
            ds41_threadpool_run(c->pool, N, 1 + 32768 / (M * K + 1), xlin_task, &j);
        } else {
            memset(bad, 0, N);
            const size_t tiles = (N + XLIN_COLS - 1) / XLIN_COLS;
            ds41_threadpool_run(c->pool, tiles, 1 + 8192 / (M * K / 32 + 1), xlin_tile_task, &j);
            /* Columns with NaN codes or scales, then rows with NaN
             * activations, again on the element route (rare: NaN weights
             * or inputs). */
            for (size_t n = 0; n < N; n++)
                if (bad[n]) xlin_task(&j, n, n + 1, 0);
            for (size_t m = 0; m < M; m++) {
                if (!row_bad[m]) continue;
                xlin_job r = j;
                r.M = 1;
                r.av = av + m * K;
                r.as = as + m * nkb;
                r.y = y + m * N;
                xlin_task(&r, 0, N, 0);
            }
        }
    }
    PROF_END(c,
             w->kind == DS41_LINEAR_FP8   ? P_LINEAR_FP8
             : w->kind == DS41_LINEAR_FP4 ? P_LINEAR_FP4
                                          : P_LINEAR_BF16,
             linear_weight_bytes(w));
}

static void fast_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                        ds41_linear_out out) {
    if (out == DS41_OUT_BF16_EXACT || out == DS41_OUT_F32_EXACT) {
        fast_linear_exact(ctx_of(self), w, x, M, y, out == DS41_OUT_BF16_EXACT);
        return;
    }
    const int kind = w->kind == DS41_LINEAR_FP8   ? P_LINEAR_FP8
                     : w->kind == DS41_LINEAR_FP4 ? P_LINEAR_FP4
                                                  : P_LINEAR_BF16;
    run_linears(ctx_of(self), 1, &w, &x, &M, &y, out, kind);
}

static void fast_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                              const float *const *xs, const size_t *Ms, float *const *ys,
                              ds41_linear_out out) {
    if (out == DS41_OUT_BF16_EXACT || out == DS41_OUT_F32_EXACT) {
        for (size_t i = 0; i < n; i++)
            fast_linear_exact(ctx_of(self), ws[i], xs[i], Ms[i], ys[i], out == DS41_OUT_BF16_EXACT);
        return;
    }
    run_linears(ctx_of(self), n, ws, xs, Ms, ys, out, P_LINEAR_BATCH);
}

/* ---- row-parallel helpers ------------------------------------------------------------------ */

/* Run fn over M rows in chunks of about `per_chunk` elements of work. */
static void rows_parallel(fast_ctx *c, size_t M, size_t work_per_row, ds41_task_fn fn, void *job) {
    size_t grain = work_per_row ? 16384 / work_per_row : M;
    if (grain == 0) grain = 1;
    ds41_threadpool_run(c->pool, M, grain, fn, job);
}

/* ---- norms ---------------------------------------------------------------------------------- */

typedef struct norm_job {
    fast_ctx *c;
    const uint16_t *w;
    const float *x;
    size_t n;
    float eps;
    float *y;
} norm_job;

static void norm_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    norm_job *j = p;
    const size_t n = j->n;
    for (size_t m = b; m < e; m++) {
        const float *xr = j->x + m * n;
        const float ms = (float)(j->c->k->sumsq(xr, n) / (double)n);
        const float r = ds41_rm_rsqrt(ms + j->eps);
        for (size_t i = 0; i < n; i++) {
            const float t = xr[i] * r;
            j->y[m * n + i] = fast_bf16_round(fast_f32_from_bits((uint32_t)j->w[i] << 16) * t);
        }
    }
}

static void fast_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n,
                         float eps, float *y) {
    fast_ctx *c = ctx_of(self);
    PROF_BEGIN(c);
    c->st.weight_bytes += n * 2;
    norm_job j = {c, w, x, n, eps, y};
    rows_parallel(c, M, n, norm_task, &j);
    PROF_END(c, P_NORM, n * 2);
}

/* ---- hyper-connections ------------------------------------------------------------------------ */

typedef struct mix_job {
    fast_ctx *c;
    const float *fn, *h;
    size_t M, n;
    int n_mix;
    float eps;
    float *rs, *mix;
} mix_job;

static void mix_rs_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    mix_job *j = p;
    for (size_t m = b; m < e; m++) {
        const float *hr = j->h + m * j->n;
        const float ms = (float)(j->c->k->sumsq(hr, j->n) / (double)j->n);
        j->rs[m] = ds41_rm_rsqrt(ms + j->eps);
    }
}

/* Mix functions per task: the qk kernel computes them in one pass over the
 * stream row (its four-way form is bit for bit four dot calls). */
#define MIX_GROUP 4

static void mix_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    mix_job *j = p;
    const size_t groups = ((size_t)j->n_mix + MIX_GROUP - 1) / MIX_GROUP;
    for (size_t t = b; t < e; t++) {
        const size_t g = t % groups, m = t / groups, mi0 = g * MIX_GROUP;
        const size_t cnt = (size_t)j->n_mix - mi0 < MIX_GROUP ? (size_t)j->n_mix - mi0 : MIX_GROUP;
        const float *hr = j->h + m * j->n;
        double d[MIX_GROUP];
        if (j->c->k->qk)
            j->c->k->qk(hr, j->fn + mi0 * j->n, cnt, j->n, d);
        else
            for (size_t i = 0; i < cnt; i++) d[i] = j->c->k->dot(j->fn + (mi0 + i) * j->n, hr, j->n);
        for (size_t i = 0; i < cnt; i++) j->mix[m * (size_t)j->n_mix + mi0 + i] = (float)d[i] * j->rs[m];
    }
}

static void fast_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,
                        const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters, float hc_eps,
                        float *pre, float *post, float *comb) {
    fast_ctx *c = ctx_of(self);
    const size_t n = (size_t)hc * dim;
    const int n_mix = (2 + hc) * hc;
    PROF_BEGIN(c);
    c->st.weight_bytes += ((uint64_t)n_mix * n + (uint64_t)n_mix + 3) * sizeof(float);
    c->st.flops += 2 * (uint64_t)M * (uint64_t)(n_mix + 1) * n;
    float *rs = ensure(&c->work, M * sizeof(float));
    float *mix = ensure(&c->work2, M * (size_t)n_mix * sizeof(float));
    mix_job j = {c, fn, h, M, n, n_mix, norm_eps, rs, mix};
    rows_parallel(c, M, n, mix_rs_task, &j);
    /* Tasks are (row, group of mixes) pairs with the group fastest: a task
     * reads one stream row once for MIX_GROUP mix functions. */
    ds41_threadpool_run(c->pool, M * (((size_t)n_mix + MIX_GROUP - 1) / MIX_GROUP), 1, mix_task, &j);
    for (size_t m = 0; m < M; m++)
        ds41_rm_hc_sinkhorn(mix + m * (size_t)n_mix, scale, base, hc, iters, hc_eps, pre + m * (size_t)hc,
                            post + m * (size_t)hc, comb + m * (size_t)hc * (size_t)hc);
    PROF_END(c, P_HC_MIX, (uint64_t)n_mix * n * sizeof(float));
}

/* hc_pre / hc_post / rope / router / embed / fp8 rows: elementwise work the
 * reference already does at memory speed; the fast path runs it row-parallel
 * (it is bit-exact, and per row, so invariant). */
typedef struct pre_job {
    const ds41_ops *self;
    const float *a, *b, *c, *d;
    int hc;
    size_t dim;
    float *out;
} pre_job;

/* hc_pre / hc_post: the reference's short sums in copy order, each product
 * and sum one fp32 operation (no fusion: the build disables contraction),
 * bf16 rounding inline; loops over d innermost so they vectorize.  Bit for
 * bit the reference. */
static void hc_pre_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    pre_job *j = p;
    const size_t hc = (size_t)j->hc, D = j->dim;
    for (size_t m = b; m < e; m++) {
        const float *hr = j->a + m * hc * D, *pm = j->b + m * hc;
        float *dst = j->out + m * D;
        const float p0 = pm[0];
        for (size_t d = 0; d < D; d++) dst[d] = p0 * hr[d];
        for (size_t c = 1; c < hc; c++) {
            const float pc = pm[c];
            const float *hc_row = hr + c * D;
            for (size_t d = 0; d < D; d++) {
                const float t = pc * hc_row[d];
                dst[d] = dst[d] + t;
            }
        }
        for (size_t d = 0; d < D; d++) dst[d] = fast_bf16_round(dst[d]);
    }
}

static void fast_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim,
                        float *out) {
    fast_ctx *c = ctx_of(self);
    PROF_BEGIN(c);
    pre_job j = {.self = self, .a = h, .b = pre, .hc = hc, .dim = dim, .out = out};
    rows_parallel(c, M, (size_t)hc * dim, hc_pre_task, &j);
    PROF_END(c, P_HC_PREPOST, 0);
}

static void hc_post_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    pre_job *j = p;
    const size_t hc = (size_t)j->hc, D = j->dim;
    for (size_t m = b; m < e; m++) {
        const float *hr = j->b + m * hc * D, *cm = j->d + m * hc * hc, *o = j->a + m * D;
        for (size_t jj = 0; jj < hc; jj++) {
            const float pj = j->c[m * hc + jj], c0 = cm[jj];
            float *dst = j->out + (m * hc + jj) * D;
            for (size_t d = 0; d < D; d++) dst[d] = c0 * hr[d];
            for (size_t i = 1; i < hc; i++) {
                const float ci = cm[i * hc + jj];
                const float *hi_row = hr + i * D;
                for (size_t d = 0; d < D; d++) {
                    const float t = ci * hi_row[d];
                    dst[d] = dst[d] + t;
                }
            }
            for (size_t d = 0; d < D; d++) {
                const float po = pj * o[d];
                dst[d] = fast_bf16_round(po + dst[d]);
            }
        }
    }
}

static void fast_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,
                         const float *comb, size_t M, int hc, size_t dim, float *out) {
    fast_ctx *c = ctx_of(self);
    PROF_BEGIN(c);
    pre_job j = {.self = self, .a = o, .b = h, .c = post, .d = comb, .hc = hc, .dim = dim, .out = out};
    rows_parallel(c, M, (size_t)hc * (size_t)hc * dim, hc_post_task, &j);
    PROF_END(c, P_HC_PREPOST, 0);
}

/* Rope: rows in parallel, each row's heads with the reference's rotation. */
typedef struct rope_job {
    float *x;
    int n_heads, n_pairs, inverse;
    size_t row_stride, head_stride;
    const float *freqs, *cs_in;
    const uint64_t *pos;
    float *cs;
} rope_job;

static void rope_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    rope_job *j = p;
    const size_t w = 2 * (size_t)j->n_pairs;
    for (size_t m = b; m < e; m++)
        for (int h = 0; h < j->n_heads; h++)
            ds41_rope_apply(j->x + m * j->row_stride + (size_t)h * j->head_stride, j->n_pairs,
                            j->cs_in + m * w, j->inverse);
}

static void rope_table_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    rope_job *j = p;
    for (size_t m = b; m < e; m++)
        ds41_rope_cos_sin(j->freqs, j->n_pairs, j->pos[m], j->cs + m * 2 * (size_t)j->n_pairs);
}

static void fast_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos,
                            size_t M, float *cs) {
    rope_job j = {.n_pairs = n_pairs, .freqs = freqs, .pos = pos, .cs = cs};
    rows_parallel(ctx_of(self), M, 64 * (size_t)n_pairs, rope_table_task, &j);
}

static void fast_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                      size_t head_stride, int n_pairs, const float *cs, int inverse) {
    rope_job j = {.x = x,
                  .n_heads = n_heads,
                  .n_pairs = n_pairs,
                  .inverse = inverse,
                  .row_stride = row_stride,
                  .head_stride = head_stride,
                  .cs_in = cs};
    rows_parallel(ctx_of(self), M, 8 * (size_t)n_heads * (size_t)n_pairs, rope_task, &j);
}

static void fast_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                        float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection) {
    ctx_of(self)->st.weight_bytes += (uint64_t)E * sizeof(float);
    ds41_ops_reference.router(self, logits, bias, M, E, k, gate_temp, route_scale, sel, weight, selection);
}

static void fast_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,
                       size_t dim, float *out) {
    ctx_of(self)->st.weight_bytes += (uint64_t)M * dim * 2;
    ds41_ops_reference.embed(self, table, ids, M, hc, dim, out);
}

/* Engram table rows: the reference's values (each e4m3 value times its
 * block's ue8m0 scale, rounded to bf16), rows split over the threads and
 * each row's lines prefetched a few rows ahead.  The rows are random in a
 * table of hundreds of MB, so every one is a TLB and a cache miss (costly
 * under a hypervisor's nested page tables), which a single thread walking
 * the rows one by one waits out in turn. */
typedef struct fp8rows_job {
    const uint8_t *q, *scale;
    const int64_t *rows;
    size_t cols;
    float *out;
} fp8rows_job;

#define FP8ROWS_AHEAD 8

static void fp8rows_prefetch(const fp8rows_job *j, size_t i) {
    const size_t cols = j->cols, sc = (cols + 31) / 32;
    const uint8_t *q = j->q + (size_t)j->rows[i] * cols;
    for (size_t off = 0; off < cols; off += 64) __builtin_prefetch(q + off);
    __builtin_prefetch(j->scale + (size_t)j->rows[i] * sc);
}

static void fp8rows_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    const fp8rows_job *j = p;
    const size_t cols = j->cols, sc = (cols + 31) / 32;
    for (size_t i = b; i < b + FP8ROWS_AHEAD && i < e; i++) fp8rows_prefetch(j, i);
    for (size_t i = b; i < e; i++) {
        if (i + FP8ROWS_AHEAD < e) fp8rows_prefetch(j, i + FP8ROWS_AHEAD);
        const uint8_t *q = j->q + (size_t)j->rows[i] * cols, *s = j->scale + (size_t)j->rows[i] * sc;
        float *dst = j->out + i * cols;
        for (size_t c = 0; c < cols; c++) dst[c] = fast_bf16_round(ds41_e4m3_table[q[c]] * fast_ue8m0(s[c / 32]));
    }
}

static void fast_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows,
                          size_t n, size_t cols, float *out) {
    fast_ctx *c = ctx_of(self);
    c->st.weight_bytes += (uint64_t)n * (cols + (cols + 31) / 32);
    if (n == 0 || cols == 0) return;
    fp8rows_job j = {.q = q, .scale = scale, .rows = rows, .cols = cols, .out = out};
    ds41_threadpool_run(c->pool, n, 1 + 8192 / cols, fp8rows_task, &j);
}

/* Data movement: a copy per row; nothing to gain from threads at the
 * sizes a step gathers. */
static void fast_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,
                             const uint32_t *idx, size_t n, size_t row_bytes) {
    ds41_ops_reference.gather_rows(self, dst, src, src_stride, idx, n, row_bytes);
}

/* ---- activation quantization ----------------------------------------------------------------- */

typedef struct quant_job {
    const float *x;
    float *q, *w;
    size_t n, wn;
    uint8_t *out;
    size_t out_stride;
    float scale;
} quant_job;

static void act_quant_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    quant_job *j = p;
    for (size_t m = b; m < e; m++)
        ds41_act_quant(j->x + m * j->n, j->n, j->out + m * j->out_stride, j->out + m * j->out_stride + j->n);
}

/* Rows in parallel, each the reference's quantizer (bit for bit). */
static void fast_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                               size_t out_stride) {
    quant_job j = {.x = x, .n = n, .out = out, .out_stride = out_stride};
    rows_parallel(ctx_of(self), M, 8 * n, act_quant_task, &j);
}

static void index_query_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    quant_job *j = p;
    for (size_t m = b; m < e; m++) {
        ds41_fp4_act_quant_ue8m0_qdq(j->q + m * j->n, j->n);
        for (size_t i = 0; i < j->wn; i++)
            j->w[m * j->wn + i] = fast_bf16_round(j->w[m * j->wn + i] * j->scale);
    }
}

static void fast_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                             float scale) {
    quant_job j = {.q = q, .w = w, .n = qn, .wn = wn, .scale = scale};
    rows_parallel(ctx_of(self), M, 8 * qn, index_query_task, &j);
}

typedef struct pack_job {
    const ds41_kv_layout *l;
    const float *latent, *key;
    uint8_t *out;
} pack_job;

static void pack_entries_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    pack_job *j = p;
    for (size_t i = b; i < e; i++)
        ds41_kv_pack_entry(j->l, j->latent + i * j->l->latent_dim, j->key + i * j->l->index_dim,
                           j->out + i * j->l->entry_bytes);
}

/* Entries in parallel, each the cache's own packer (bit for bit). */
static void fast_kv_pack(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent,
                         const float *key, size_t n, uint8_t *out) {
    pack_job j = {layout, latent, key, out};
    rows_parallel(ctx_of(self), n, 8 * (layout->latent_dim + layout->index_dim), pack_entries_task, &j);
}

/* ---- compressor ------------------------------------------------------------------------------ */

typedef struct pool_job {
    fast_ctx *c;
    const float *kv, *score;
    int ratio;
    size_t hd;
    float *pooled;
} pool_job;

static void pool_task(void *p, size_t b, size_t e, int th) {
    pool_job *j = p;
    const size_t group = (size_t)j->ratio * j->hd;
    for (size_t g = b; g < e; g++)
        ds41_rm_compress_pool(j->kv + g * group, j->score + g * group, j->ratio, j->hd, j->c->scratch[th].p,
                              j->pooled + g * j->hd);
}

/* Groups in parallel, each the reference's pooling (bit for bit). */
static void fast_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,
                               size_t hd, float *pooled) {
    fast_ctx *c = ctx_of(self);
    ensure_scratch(c, (size_t)ratio * sizeof(float));
    pool_job j = {c, kv, score, ratio, hd, pooled};
    rows_parallel(c, n, 16 * (size_t)ratio * hd, pool_task, &j);
}

/* ---- indexer -------------------------------------------------------------------------------- */

typedef struct idx_job {
    fast_ctx *c;
    const float *q, *w;
    size_t M;
    int n_heads, dim;
    const ds41_kv_pages *keys;
    const size_t *start; /* [M + 1] prefix sums of the reaches: flat (row, entry) index */
    float *score;
    size_t score_stride;
    /* index_blocks / index_topk */
    const uint32_t *reach;
    size_t block, n_take, k, bscore_stride, allow_stride;
    float *bscore;
    uint8_t *allow;
    const uint8_t *allow_in;
    int32_t *sel;
    uint32_t *count;
} idx_job;

/* Tasks are the step's (row, entry) pairs, flattened: rows of very
 * different reach (a long prefix and a fresh sequence) share the threads. */
static void idx_task(void *p, size_t b, size_t e, int th) {
    idx_job *j = p;
    const size_t dim = (size_t)j->dim, qw = (size_t)j->n_heads * dim;
    const ds41_kv_layout *lay = j->keys->layout;
    float *key = j->c->scratch[th].p;
    size_t m = find_linear(j->start, j->M, b);
    for (size_t f = b; f < e; f++) {
        while (f >= j->start[m + 1]) m++;
        const size_t t = f - j->start[m];
        const float *q = j->q + m * qw, *w = j->w + m * (size_t)j->n_heads;
        /* The index key: e2m1 codes then one ue8m0 scale per 32. */
        const uint8_t *k = ds41_kv_pages_entry(j->keys, m, t) + lay->latent_bytes;
        for (size_t i = 0; i < dim; i++)
            key[i] = ds41_e2m1_table[(k[i / 2] >> ((i & 1) * 4)) & 15] * fast_ue8m0(k[dim / 2 + i / 32]);
        double sum = 0.0;
        for (int h = 0; h < j->n_heads; h++) {
            const float s = fast_bf16_round((float)j->c->k->dot(q + (size_t)h * dim, key, dim));
            const float r = isnan(s) ? s : (s > 0.0f ? s : 0.0f);
            const float term = fast_bf16_round(r * w[h]);
            sum += (double)term;
        }
        j->score[m * j->score_stride + t] =
            (j->c->brk & BREAK_INDEX_BF16) ? (float)sum : fast_bf16_round((float)sum);
    }
}

static void fast_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                              int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    fast_ctx *c = ctx_of(self);
    PROF_BEGIN(c);
    size_t *start = ensure(&c->work, (M + 1) * sizeof *start);
    start[0] = 0;
    for (size_t m = 0; m < M; m++) start[m + 1] = start[m] + keys->row_reach[m];
    c->st.flops += 2 * (uint64_t)start[M] * (uint64_t)n_heads * (uint64_t)dim;
    ensure_scratch(c, (size_t)dim * sizeof(float));
    idx_job j = {.c = c,
                 .q = q,
                 .w = w,
                 .M = M,
                 .n_heads = n_heads,
                 .dim = dim,
                 .keys = keys,
                 .start = start,
                 .score = score,
                 .score_stride = score_stride};
    if (start[M])
        ds41_threadpool_run(c->pool, start[M], 1 + 8192 / ((size_t)n_heads * (size_t)dim + 1), idx_task, &j);
    PROF_END(c, P_INDEX, 0);
}

/* index_blocks / index_topk: rows in parallel, each the shared per-row
 * decision (engine/backend/index_select.h), so the same bits as the
 * reference; the sorts use the thread's scratch. */
static void blocks_task(void *p, size_t b, size_t e, int th) {
    idx_job *j = p;
    int32_t *order = j->c->scratch[th].p, *tmp = order + j->bscore_stride;
    for (size_t m = b; m < e; m++) {
        memset(j->allow + m * j->allow_stride, 0, j->allow_stride);
        if (j->reach[m])
            ds41_index_blocks_row(j->score + m * j->score_stride, j->reach[m], j->block, j->n_take,
                                  j->bscore + m * j->bscore_stride, j->allow + m * j->allow_stride, order,
                                  tmp);
    }
}

static void fast_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                              const uint32_t *reach, size_t M, size_t block, size_t n_take, float *bscore,
                              size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    fast_ctx *c = ctx_of(self);
    ensure_scratch(c, 2 * (bscore_stride ? bscore_stride : 1) * sizeof(int32_t));
    idx_job j = {.c = c,
                 .score = (float *)score,
                 .score_stride = score_stride,
                 .reach = reach,
                 .block = block,
                 .n_take = n_take,
                 .bscore = bscore,
                 .bscore_stride = bscore_stride,
                 .allow = allow,
                 .allow_stride = allow_stride};
    rows_parallel(c, M, 4 * bscore_stride + 64, blocks_task, &j);
}

static void topk_task(void *p, size_t b, size_t e, int th) {
    idx_job *j = p;
    int32_t *order = j->c->scratch[th].p, *tmp = order + j->bscore_stride; /* max reach each */
    for (size_t m = b; m < e; m++)
        j->count[m] = (uint32_t)ds41_index_topk_row(j->score + m * j->score_stride, j->reach[m],
                                                    j->allow_in ? j->allow_in + m * j->allow_stride : NULL,
                                                    j->block, j->k, j->sel + m * j->k, order, tmp);
}

static void fast_index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                            size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                            int32_t *sel, uint32_t *count) {
    fast_ctx *c = ctx_of(self);
    size_t max_reach = 1;
    for (size_t m = 0; m < M; m++)
        if (reach[m] > max_reach) max_reach = reach[m];
    ensure_scratch(c, 2 * max_reach * sizeof(int32_t));
    idx_job j = {.c = c,
                 .score = score,
                 .score_stride = score_stride,
                 .reach = reach,
                 .block = block,
                 .k = k,
                 .bscore_stride = max_reach,
                 .allow_in = allow,
                 .allow_stride = allow_stride,
                 .sel = sel,
                 .count = count};
    rows_parallel(c, M, 16 * max_reach + 64, topk_task, &j);
}

/* ---- sparse attention ---------------------------------------------------------------------- */

#define ATTN_CHUNK 64

typedef struct attn_job {
    fast_ctx *c;
    const float *q;
    size_t H, hd;
    const float *sink;
    float scale;
    const ds41_attn_rows *rows;
    size_t total;
    float *kv; /* [total][hd] decoded */
    float *out;
} attn_job;

static void attn_decode_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    attn_job *j = p;
    const ds41_attn_rows *rows = j->rows;
    for (size_t i = b; i < e; i++) {
        float *dst = j->kv + i * j->hd;
        if (i < rows->n_window)
            j->c->k->decode_ring_row(rows->window[i], j->hd, dst);
        else
            j->c->k->decode_latent(rows->comp[i - rows->n_window], j->hd, dst);
    }
}

/* One head at a time, the reference's online softmax (§10.7, decision 7 of
 * the numpy side): per chunk of 64 rows, z = fp32(q.kv) * scale, the
 * running max, corr and p from the double exp rounded to fp32, den =
 * fp32(den * corr) + fp32(sum p), acc = fp32(acc * corr) + fp32(sum bf16(p)
 * kv); sums in double (exact products), rounded once. */
static void attn_head_task(void *p, size_t b, size_t e, int th) {
    attn_job *j = p;
    const fast_kernels *k = j->c->k;
    const size_t hd = j->hd;
    float *acc = j->c->scratch[th].p;
    double *pv = (double *)(acc + ((hd + 15) & ~(size_t)15));
    const int keep_p = (j->c->brk & BREAK_ATTN_P_BF16) != 0;
    float z[ATTN_CHUNK], pb[ATTN_CHUNK], zd[ATTN_CHUNK], pe[ATTN_CHUNK];
    double zs[ATTN_CHUNK];
    for (size_t h = b; h < e; h++) {
        const float *qh = j->q + h * hd;
        float mx = -1e30f, den = 0.0f;
        memset(acc, 0, hd * sizeof *acc);
        for (size_t c0 = 0; c0 < j->total; c0 += ATTN_CHUNK) {
            const size_t nc = j->total - c0 < ATTN_CHUNK ? j->total - c0 : ATTN_CHUNK;
            float m_new = mx;
            if (k->qk)
                k->qk(qh, j->kv + c0 * hd, nc, hd, zs);
            else
                for (size_t i = 0; i < nc; i++) zs[i] = k->dot(qh, j->kv + (c0 + i) * hd, hd);
            for (size_t i = 0; i < nc; i++) {
                z[i] = (float)zs[i] * j->scale;
                if (z[i] > m_new) m_new = z[i];
            }
            const float corr = ds41_rm_exp(mx - m_new);
            for (size_t i = 0; i < nc; i++) zd[i] = z[i] - m_new;
            k->exp(zd, pe, nc);
            double psum = 0.0;
            for (size_t i = 0; i < nc; i++) {
                psum += (double)pe[i];
                pb[i] = keep_p ? pe[i] : fast_bf16_round(pe[i]);
            }
            const float dc = den * corr;
            den = dc + (float)psum;
            if (k->pv) {
                k->pv(pb, j->kv + c0 * hd, nc, hd, pv);
            } else {
                memset(pv, 0, hd * sizeof *pv);
                for (size_t i = 0; i < nc; i++) k->axpy(pv, pb[i], j->kv + (c0 + i) * hd, hd);
            }
            for (size_t d = 0; d < hd; d++) {
                const float ac = acc[d] * corr;
                acc[d] = ac + (float)pv[d];
            }
            mx = m_new;
        }
        const float d = den + ds41_rm_exp(j->sink[h] - mx);
        for (size_t i = 0; i < hd; i++) j->out[h * hd + i] = fast_bf16_round(acc[i] / d);
    }
}

static void fast_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim,
                             const float *sink, float scale, const ds41_attn_rows *rows, float *out) {
    fast_ctx *c = ctx_of(self);
    const size_t H = (size_t)n_heads, hd = (size_t)head_dim, total = rows->n_window + rows->n_comp;
    PROF_BEGIN(c);
    c->st.weight_bytes += H * sizeof(float);
    c->st.flops += 4 * (uint64_t)H * total * hd;
    attn_job j = {c, q, H, hd, sink, scale, rows, total, ensure(&c->work, total * hd * sizeof(float)), out};
    ds41_threadpool_run(c->pool, total, 16, attn_decode_task, &j);
    ensure_scratch(c, ((hd + 15) & ~(size_t)15) * sizeof(float) + hd * sizeof(double));
    ds41_threadpool_run(c->pool, H, 1, attn_head_task, &j);
    PROF_END(c, P_ATTN, 0);
}

/* Row by row, each row's heads and rows in parallel as sparse_attn. */
static void fast_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                        const float *sink, float scale, const ds41_attn_step *step, float *out) {
    fast_ctx *c = ctx_of(self);
    const size_t nw = (size_t)step->window + step->block, nc = step->sel_stride ? step->sel_stride : 1;
    const uint8_t **wrows = ensure(&c->attn_rows, (nw + nc) * sizeof *wrows), **crows = wrows + nw;
    const size_t qo = (size_t)n_heads * (size_t)head_dim;
    for (size_t m = 0; m < M; m++) {
        const ds41_attn_rows rows = ds41_attn_step_rows(step, m, wrows, crows);
        fast_sparse_attn(self, q + m * qo, n_heads, head_dim, sink, scale, &rows, out + m * qo);
    }
}

/* ---- MoE and Engram ----------------------------------------------------------------------- */

typedef struct elem_job {
    fast_ctx *c;
    const float *g, *u, *route;
    size_t n;
    float limit;
    float *out;
    /* engram */
    float *h;
    const float *kv, *wqk;
    int hc;
    float eps, dim_scale;
} elem_job;

static void swiglu_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    elem_job *j = p;
    const int keep = (j->c->brk & BREAK_SWIGLU_BF16) != 0;
    for (size_t m = b; m < e; m++)
        for (size_t i = 0; i < j->n; i++) {
            float gv = j->g[m * j->n + i], uv = j->u[m * j->n + i];
            if (j->limit > 0.0f) {
                uv = uv < -j->limit ? -j->limit : (uv > j->limit ? j->limit : uv);
                gv = gv > j->limit ? j->limit : gv;
            }
            float h = ds41_rm_silu(gv) * uv;
            if (j->route) h = j->route[m] * h;
            j->out[m * j->n + i] = keep ? h : fast_bf16_round(h);
        }
}

static void fast_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n, float limit,
                        const float *route, float *out) {
    fast_ctx *c = ctx_of(self);
    PROF_BEGIN(c);
    elem_job j = {.c = c, .g = g, .u = u, .route = route, .n = n, .limit = limit, .out = out};
    rows_parallel(c, M, 8 * n, swiglu_task, &j);
    PROF_END(c, P_SWIGLU, 0);
}

typedef struct combine_job {
    const float *oe, *shared;
    const uint32_t *slot;
    size_t k, D;
    float *out;
} combine_job;

static void combine_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    combine_job *j = p;
    for (size_t m = b; m < e; m++)
        ds41_rm_moe_combine_token(j->oe, j->slot + m * j->k, j->k, j->shared + m * j->D, j->D,
                                  j->out + m * j->D);
}

/* Tokens in parallel, each the reference's combine (bit for bit). */
static void fast_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                             const float *shared, size_t M, size_t D, float *out) {
    combine_job j = {.oe = oe, .shared = shared, .slot = slot, .k = k, .D = D, .out = out};
    rows_parallel(ctx_of(self), M, (k + 1) * D, combine_task, &j);
}

/* The reference's Engram gating (§6.4, §10.6) with double sums. */
static void engram_task(void *p, size_t b, size_t e, int th) {
    elem_job *j = p;
    const fast_kernels *k = j->c->k;
    const size_t hc = (size_t)j->hc, dim = j->n;
    float *t = j->c->scratch[th].p;
    for (size_t m = b; m < e; m++) {
        const float *kvr = j->kv + m * (hc + 1) * dim;
        const float *value = kvr + hc * dim;
        for (size_t cp = 0; cp < hc; cp++) {
            float *hr = j->h + (m * hc + cp) * dim;
            const float *key = kvr + cp * dim, *wr = j->wqk + cp * dim;
            const float ms_h = (float)(k->sumsq(hr, dim) / (double)dim),
                        ms_k = (float)(k->sumsq(key, dim) / (double)dim);
            const float rstd = ds41_rm_rsqrt(ms_h + j->eps) * ds41_rm_rsqrt(ms_k + j->eps);
            double s = 0.0;
            for (size_t d = 0; d < dim; d++) {
                const float hw = hr[d] * wr[d];
                t[d] = hw * key[d];
                s += (double)t[d];
            }
            const float sr = (float)s * rstd;
            const float dot = sr * j->dim_scale;
            float a = fabsf(dot);
            if (a < 1e-6f) a = 1e-6f;
            const float gate = ds41_rm_sigmoid(copysignf(ds41_rm_sqrt(a), dot));
            for (size_t d = 0; d < dim; d++) {
                const float gv = gate * value[d];
                hr[d] = fast_bf16_round(hr[d] + gv);
            }
        }
    }
}

static void fast_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M,
                            int hc, size_t dim, float eps, float dim_scale) {
    fast_ctx *c = ctx_of(self);
    PROF_BEGIN(c);
    c->st.weight_bytes += (uint64_t)hc * dim * sizeof(float);
    ensure_scratch(c, dim * sizeof(float));
    elem_job j = {
        .c = c, .n = dim, .h = h, .kv = kv, .wqk = wqk, .hc = hc, .eps = eps, .dim_scale = dim_scale};
    rows_parallel(c, M, 4 * (size_t)hc * dim, engram_task, &j);
    PROF_END(c, P_ENGRAM, 0);
}

/* ---- backends ------------------------------------------------------------------------------ */

static const ds41_ops fast_ops_template = {
    .name = "fast",
    .linear = fast_linear,
    .linear_batch = fast_linear_batch,
    .rmsnorm = fast_rmsnorm,
    .hc_mix = fast_hc_mix,
    .hc_pre = fast_hc_pre,
    .hc_post = fast_hc_post,
    .rope_table = fast_rope_table,
    .rope = fast_rope,
    .act_quant_fp8 = fast_act_quant_fp8,
    .index_query = fast_index_query,
    .kv_pack = fast_kv_pack,
    .compress_pool = fast_compress_pool,
    .index_scores = fast_index_scores,
    .index_blocks = fast_index_blocks,
    .index_topk = fast_index_topk,
    .sparse_attn = fast_sparse_attn,
    .attend = fast_attend,
    .swiglu = fast_swiglu,
    .moe_combine = fast_moe_combine,
    .router = fast_router,
    .engram_mix = fast_engram_mix,
    .embed = fast_embed,
    .fp8_rows = fast_fp8_rows,
    .gather_rows = fast_gather_rows,
};

static ds41_kv_pool *host_pool(ds41_backend *be, const ds41_model_config *cfg, uint64_t budget_bytes,
                               uint32_t entries_per_page, ds41_error *err) {
    return ds41_kv_pool_new_in(be->mem, cfg, budget_bytes, entries_per_page, err);
}

static void fast_stats(ds41_backend *be, ds41_backend_stats *out, bool reset) {
    fast_ctx *c = be->ops.ctx;
    *out = c->st;
    if (reset) memset(&c->st, 0, sizeof c->st);
}

static void fast_destroy(ds41_backend *be) {
    fast_ctx *c = be->ops.ctx;
    if (c && c->profile) {
        double total = 0;
        for (int i = 0; i < P_COUNT; i++) total += c->prof_s[i];
        fprintf(stderr, "ds41 fast backend profile (%s, %d threads): %.3f s in ops\n", be->name, c->n_threads,
                total);
        for (int i = 0; i < P_COUNT; i++)
            if (c->prof_calls[i])
                fprintf(stderr, "  %-20s %9.3f s %5.1f%%  %8llu calls  %8.2f GB/s of weights\n",
                        prof_names[i], c->prof_s[i], total > 0 ? 100 * c->prof_s[i] / total : 0.0,
                        (unsigned long long)c->prof_calls[i],
                        c->prof_s[i] > 0 ? (double)c->prof_bytes[i] / c->prof_s[i] / 1e9 : 0.0);
    }
    if (c) {
        ds41_threadpool_free(c->pool);
        if (c->scratch)
            for (int t = 0; t < c->n_threads; t++) free(c->scratch[t].p);
        free(c->scratch);
        free(c->act.p);
        free(c->work.p);
        free(c->work2.p);
        free(c->lin_starts.p);
        free(c->lin_act.p);
        free(c->attn_rows.p);
        free(c);
    }
    free(be);
}

static unsigned break_flags(void) {
    const char *env = getenv("DS41_FAST_BREAK");
    if (!env) return 0;
    unsigned f = 0;
    if (strstr(env, "index_bf16")) f |= BREAK_INDEX_BF16;
    if (strstr(env, "swiglu_bf16")) f |= BREAK_SWIGLU_BF16;
    if (strstr(env, "attn_p_bf16")) f |= BREAK_ATTN_P_BF16;
    return f;
}

ds41_backend *ds41_backend_cpu_new(const ds41_cpu_opts *opts, ds41_error *err) {
    const ds41_cpu_opts o = opts ? *opts : (ds41_cpu_opts){0};
    ds41_cpu_level level = ds41_cpu_level_detect();
    if (o.level != DS41_CPU_AUTO && o.level < level) level = o.level;
    ds41_backend *be = calloc(1, sizeof *be);
    fast_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        ds41_fail(err, "cpu backend: out of memory");
        return NULL;
    }
    be->ops = fast_ops_template;
    be->ops.ctx = c;
    be->destroy = fast_destroy;
    be->new_pool = host_pool;
    be->mem = &ds41_memory_host;
    be->stats = fast_stats;
    c->k = kernels_for(level);
    c->k->init();
    c->brk = break_flags();
    c->profile = getenv("DS41_FAST_PROFILE") != NULL;
    c->pool = ds41_threadpool_new(o.threads, o.pin, err);
    if (!c->pool) {
        fast_destroy(be);
        return NULL;
    }
    c->n_threads = ds41_threadpool_size(c->pool);
    c->scratch = calloc((size_t)c->n_threads, sizeof *c->scratch);
    if (!c->scratch) {
        fast_destroy(be);
        ds41_fail(err, "cpu backend: out of memory");
        return NULL;
    }
    switch (level) {
    case DS41_CPU_AMX:
        be->name = c->brk ? "cpu-amx (DS41_FAST_BREAK)" : "cpu-amx";
        break;
    case DS41_CPU_AVX512:
        be->name = c->brk ? "cpu-avx512 (DS41_FAST_BREAK)" : "cpu-avx512";
        break;
    case DS41_CPU_AVX2:
        be->name = c->brk ? "cpu-avx2 (DS41_FAST_BREAK)" : "cpu-avx2";
        break;
    default:
        be->name = c->brk ? "cpu-scalar (DS41_FAST_BREAK)" : "cpu-scalar";
        break;
    }
    be->ops.name = be->name;
    return be;
}

ds41_cpu_level ds41_backend_cpu_level(const ds41_backend *be) {
    if (!be || be->destroy != fast_destroy) return DS41_CPU_AUTO;
    return ((const fast_ctx *)be->ops.ctx)->k->level;
}

int ds41_backend_threads(const ds41_backend *be) {
    if (!be || be->destroy != fast_destroy) return 1;
    return ((const fast_ctx *)be->ops.ctx)->n_threads;
}

/* ---- machine measurements ------------------------------------------------------------------ */

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct measure_job {
    const fast_kernels *k;
    char *buf;
    size_t slice;
    size_t iters;
    _Atomic uint64_t sink;
} measure_job;

static void fill_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    measure_job *j = p;
    for (size_t i = b; i < e; i++) memset(j->buf + i * j->slice, (int)(i & 0xFF), j->slice);
}

static void read_task(void *p, size_t b, size_t e, int th) {
    (void)th;
    measure_job *j = p;
    for (size_t i = b; i < e; i++)
        atomic_fetch_xor(&j->sink, j->k->read_sum(j->buf + i * j->slice, j->slice));
}

static void fma_task(void *p, size_t b, size_t e, int th) {
    measure_job *j = p;
    for (size_t i = b; i < e; i++) {
        const float r = j->k->fma_burn(j->iters, (float)th);
        atomic_fetch_add(&j->sink, (uint64_t)(r > 0.0f));
    }
}

int ds41_backend_cpu_measure(ds41_backend *be, uint64_t buffer_bytes, int passes, ds41_cpu_measure *out,
                             ds41_error *err) {
    if (!be || be->destroy != fast_destroy) return ds41_fail(err, "measure: not a fast CPU backend");
    fast_ctx *c = be->ops.ctx;
    memset(out, 0, sizeof *out);
    if (passes < 1) passes = 1;
    /* Slices: 8 per thread, each a multiple of 256 bytes. */
    const size_t n_slices = (size_t)c->n_threads * 8;
    const size_t slice = (size_t)(buffer_bytes / n_slices) / 256 * 256;
    if (slice == 0)
        return ds41_fail(err, "measure: buffer of %llu bytes too small", (unsigned long long)buffer_bytes);
    const size_t bytes = slice * n_slices;
    char *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) return ds41_fail(err, "measure: cannot map %zu bytes", bytes);
    measure_job j = {.k = c->k, .buf = mem, .slice = slice};
    ds41_threadpool_run(c->pool, n_slices, 1, fill_task, &j);
    double best = 0;
    for (int p = 0; p < passes; p++) {
        const double t0 = seconds();
        ds41_threadpool_run(c->pool, n_slices, 1, read_task, &j);
        const double t = seconds() - t0;
        if (t > 0 && (double)bytes / t > best) best = (double)bytes / t;
    }
    munmap(mem, bytes);
    out->read_bytes = bytes;
    out->read_passes = passes;
    out->read_gbs = best / 1e9;

    /* FMA: calibrate the iteration count for ~0.2 s on one thread. */
    j.iters = 1 << 16;
    for (;;) {
        const double t0 = seconds();
        atomic_fetch_add(&j.sink, (uint64_t)(c->k->fma_burn(j.iters, 1.0f) > 0.0f));
        const double t = seconds() - t0;
        if (t > 0.05 || j.iters > ((size_t)1 << 40)) {
            j.iters = (size_t)((double)j.iters * (0.2 / (t > 0 ? t : 1e-3))) + 1;
            break;
        }
        j.iters *= 4;
    }
    double fbest = 0;
    for (int p = 0; p < 3; p++) {
        const double t0 = seconds();
        ds41_threadpool_run(c->pool, (size_t)c->n_threads, 1, fma_task, &j);
        const double t = seconds() - t0;
        const double flops = (double)c->n_threads * (double)j.iters * 12.0 * (double)c->k->fma_lanes * 2.0;
        if (t > 0 && flops / t > fbest) fbest = flops / t;
    }
    out->fma_gflops = fbest / 1e9;
    return 0;
}

static void plain_destroy(ds41_backend *be) {
    free(be);
}

ds41_backend *ds41_backend_from_ops(const ds41_ops *ops, ds41_error *err) {
    ds41_backend *be = calloc(1, sizeof *be);
    if (!be) {
        ds41_fail(err, "backend: out of memory");
        return NULL;
    }
    be->ops = *ops;
    be->name = ops->name;
    be->new_pool = host_pool;
    be->mem = &ds41_memory_host;
    be->destroy = plain_destroy;
    return be;
}

ds41_backend *ds41_backend_reference_new(ds41_error *err) {
    return ds41_backend_from_ops(&ds41_ops_reference, err);
}

void ds41_backend_free(ds41_backend *be) {
    if (be) be->destroy(be);
}
