/* ds41-opcheck: every op of engine/backend/ops.h on one backend (--backend cpu | cuda-emu | cuda
 * | reference) against the reference ops (ds41_ops_reference) on the host, through the backend's
 * own memory and placement exactly as the forward pass drives it:
 *  - weights are the tensors of a generated checkpoint (engine/model/model_gen.h), bound and
 *    handed to be->place_weights, so a backend that copies them (the CUDA one) maps the bound
 *    pointers the ops receive to its copies (row ranges inside a tensor included);
 *  - activations, scratch and decisions are uploaded with be->mem and the outputs downloaded;
 *    metadata (positions, reaches, page tables, row maps, ids) stays host memory.
 * Shapes: `tiny` (the tiny preset: dim 128, 4 heads of 64, window 8, index top-8) and `release`
 * (the release-slice preset's layer dimensions: dim 5120, 64 heads x 512, q_lora 1280, 8 x 1024
 * output groups, experts 2304 x 5120, index 32 x 128 top-512, window 128; one layer and six
 * experts so the checkpoint stays small; linears on row ranges of at most 256 outputs, which
 * keeps the exact reference fast): FP8, FP4 and BF16 weights, every ds41_linear_out, windows that
 * wrap the ring, attend in causal and DSpark block mode.
 *
 * Bounds (tests/op_bounds.h, the fast path's documented ones, engine/backend/cpu/cpu_backend.h):
 * linears within the fp32 accumulation bound (+ one bf16 ulp), the EXACT outputs and every
 * copy-like op bit for bit, the double-sum ops within their rounding (one output ulp where a
 * double exp / cos / sin of the device's library may round the other way, cuda/hd.h).
 * Decisions (router, index top-k, candidate blocks): on the reference's scores bit for bit the
 * reference's; on the backend's own scores the reference's or a choice that only differs within
 * the score error of the boundary (REFERENCE §10.1, as tests/reference/test_simd_diff.py judges
 * it).  Batch invariance: rows (or a sequence's rows) computed alone = batched, bit for bit.
 * One TAP line per op and shape, with the op's time on the backend (best of --reps, the output's
 * download included: a figure, not a check).
 *
 * Exit: 0 all passed, 1 a check failed, 2 bad arguments, 77 the backend cannot be opened in this
 * build or on this host (tests/gpu/backend_open.h). */
#include "config/error.h"
#include "config/model_config.h"
#include "engine/backend/backend.h"
#include "engine/backend/ops.h"
#include "engine/backend/refmath.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"
#include "engine/model/quant.h"
#include "engine/model/weights.h"
#include "storage/safetensors.h"
#include "tests/gpu/backend_open.h"
#include "tests/index_pages.h"
#include "tests/op_bounds.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the backend and its memory --------------------------------------------------------- */

static ds41_backend *BE;
static const ds41_ops *OPS;
static const ds41_memory *MEM;
static const ds41_ops *const REF = &ds41_ops_reference;
static int REPS = 1;

typedef struct dev_buf {
    void *p;
    size_t n;
} dev_buf;
static dev_buf *bufs;
static size_t n_bufs, cap_bufs;

static void die(const char *what) {
    printf("Bail out! %s\n", what);
    exit(1);
}

static void *xmalloc(size_t n) {
    void *p = calloc(n ? n : 1, 1);
    if (!p) die("out of host memory");
    return p;
}

/* n bytes of backend memory (zeroed), freed by dev_release(). */
static void *dnew(size_t n) {
    if (n == 0) n = 1;
    void *p = MEM->alloc(MEM, n);
    if (!p) die("out of backend memory");
    if (n_bufs == cap_bufs) {
        cap_bufs = cap_bufs ? 2 * cap_bufs : 64;
        bufs = realloc(bufs, cap_bufs * sizeof *bufs);
        if (!bufs) die("out of host memory");
    }
    bufs[n_bufs++] = (dev_buf){p, n};
    return p;
}

/* A backend copy of host[0..n). */
static void *dup_(const void *host, size_t n) {
    void *p = dnew(n);
    if (n) MEM->upload(MEM, p, host, n);
    return p;
}

static void put(void *dev, const void *host, size_t n) {
    if (n) MEM->upload(MEM, dev, host, n);
}

static void get(void *host, const void *dev, size_t n) {
    if (n) MEM->download(MEM, host, dev, n);
}

static void dev_release(void) {
    for (size_t i = 0; i < n_bufs; i++) MEM->free(MEM, bufs[i].p, bufs[i].n);
    n_bufs = 0;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Time `call` followed by the download of n bytes of `dev` into `host` (the download waits for
 * a device backend's queued work): best of REPS, in microseconds.  `reset` runs before each
 * repetition, untimed (in-place ops get their input back). */
#define TIMED(us, reset, call, host, dev, n)                                                                 \
    do {                                                                                                     \
        double best_ = 1e300;                                                                                \
        for (int r_ = 0; r_ < REPS; r_++) {                                                                  \
            reset;                                                                                           \
            const double t0_ = now();                                                                        \
            call;                                                                                            \
            get(host, dev, n);                                                                               \
            const double t_ = now() - t0_;                                                                   \
            if (t_ < best_) best_ = t_;                                                                      \
        }                                                                                                    \
        (us) = best_ * 1e6;                                                                                  \
    } while (0)

static int same_bits(const void *a, const void *b, size_t n) {
    return memcmp(a, b, n) == 0;
}

/* The same bits, or both NaN. */
static int same_f(float a, float b) {
    return memcmp(&a, &b, sizeof a) == 0 || (isnan(a) && isnan(b));
}

/* Elements apart by more than `ulps` units of the output's precision (bf16: 16 low bits zero, so a
 * unit is 2^16 fp32 units); *n_diff counts those that differ at all. */
static size_t ulp_far(const float *a, const float *b, size_t n, unsigned ulps, int bf16, size_t *n_diff) {
    size_t far = 0;
    *n_diff = 0;
    for (size_t i = 0; i < n; i++) {
        if (same_f(a[i], b[i])) continue;
        ++*n_diff;
        if (isnan(a[i]) || isnan(b[i]) || (a[i] < 0) != (b[i] < 0)) {
            far++;
            continue;
        }
        uint32_t ua, ub;
        memcpy(&ua, &a[i], 4);
        memcpy(&ub, &b[i], 4);
        const uint32_t d = ua > ub ? ua - ub : ub - ua;
        if (d > (uint32_t)ulps << (bf16 ? 16 : 0)) far++;
    }
    return far;
}

/* The documented bound of the ops whose reductions are double sums of exact products rounded
 * where the reference rounds (engine/backend/cpu/cpu_backend.h "Numerics"): every output a bf16
 * value and the reference's except within one bf16 ulp (a double sum, or the device library's
 * double exp, that rounds the other way at a boundary); *n_diff counts the outputs that differ. */
static int bf16_close(const float *a, const float *b, size_t n, size_t *n_diff) {
    int ok = ulp_far(a, b, n, 1, 1, n_diff) == 0;
    for (size_t i = 0; i < n && ok; i++) {
        uint32_t u;
        memcpy(&u, &a[i], 4);
        ok = (u & 0xffffu) == 0 || isnan(a[i]);
    }
    return ok;
}

/* ---- decisions (REFERENCE §10.1) ---------------------------------------------------------- */

/* Whether the set `pick` (n ids) is a top-n of some score vector within err of `score` (len
 * values): no kept id trails a dropped one by more than 2 err.  NaN ranks first, as in
 * torch.topk. */
static int set_admissible(const int32_t *pick, size_t n, const float *score, size_t len, double err) {
    for (size_t i = 0; i < n; i++) {
        const double a = isnan(score[pick[i]]) ? INFINITY : score[pick[i]];
        for (size_t e = 0; e < len; e++) {
            int kept = 0;
            for (size_t j = 0; j < n && !kept; j++) kept = pick[j] == (int32_t)e;
            if (kept) continue;
            const double b = isnan(score[e]) ? INFINITY : score[e];
            if (b - a > 2 * err && !(isinf(a) && isinf(b) && a == b)) return 0;
        }
    }
    return 1;
}

/* ---- the checkpoint ----------------------------------------------------------------------- */

typedef struct shape {
    const char *name, *preset;
    const char *sets[16];
    size_t n_sets;
    size_t ms[3];     /* row counts */
    size_t ncap;      /* linears: at most this many output rows (a row range of the tensor) */
    size_t n_ent;     /* compressed entries of the attention and index checks */
    size_t n_pos_big; /* a large position (rope, window wrap) */
} shape;

static const shape shapes[] = {
    {.name = "tiny",
     .preset = "tiny",
     .n_sets = 0,
     .ms = {1, 5, 17},
     .ncap = 4096,
     .n_ent = 41,
     .n_pos_big = 70001},
    /* The release's layer dimensions in one layer (a ratio-2 KV + index source with Engram
     * before it), 6 routed experts, a small vocabulary and Engram table: 0.5 GB instead of 33. */
    {.name = "release",
     .preset = "release-slice",
     .sets = {"n_layers=1", "compress_ratios=[2]", "kv_source_layers=[0]", "index_source_layers=[0]",
              "candidate_source_layer=-1", "engram_layer_ids=[0]", "engram_num_embeddings=[1]",
              "engram_vocab_size=3000", "n_routed_experts=6", "vocab_size=2048"},
     .n_sets = 10,
     .ms = {1, 4, 16},
     .ncap = 256,
     .n_ent = 1100,
     .n_pos_big = 1000003},
};

typedef struct model {
    ds41_model_config cfg;
    ds41_checkpoint *ck;
    ds41_weights w;
    int placed;
    int L0, Ls, Li, Le; /* a layer; a ratio-2 kv source; an index source; an Engram layer */
} model;

static int load_model(const shape *s, const char *dir, model *m, ds41_error *err) {
    memset(m, 0, sizeof *m);
    ds41_model_gen_opts o = {.preset = s->preset, .seed = 41, .sets = s->sets, .n_sets = s->n_sets};
    if (ds41_model_generate(dir, &o, NULL, err) != 0) return ds41_error_prefix(err, "generate %s", s->name);
    if (ds41_model_config_load(dir, &m->cfg, err) != 0) return -1;
    if (!(m->ck = ds41_checkpoint_open(dir, err))) return -1;
    if (ds41_weights_bind(&m->w, &m->cfg, m->ck, err) != 0) return -1;
    if (BE->place_weights) {
        if (BE->place_weights(BE, &m->cfg, &m->w, err) != 0) return ds41_error_prefix(err, "place_weights");
        m->placed = 1;
    }
    m->Ls = m->Li = m->Le = -1;
    for (size_t l = 0; l < (size_t)m->cfg.n_layers; l++) {
        const ds41_layer_role *r = &m->cfg.roles[l];
        if (m->Ls < 0 && r->has_wgate) m->Ls = (int)l;
        if (m->Li < 0 && r->index_source) m->Li = (int)l;
        if (m->Le < 0 && r->engram_slot >= 0) m->Le = (int)l;
    }
    if (m->Ls < 0 || m->Li < 0 || m->Le < 0)
        return ds41_fail(
            err, "%s: the checkpoint lacks a ratio-2 kv source, an index source or an Engram layer", s->name);
    return 0;
}

static void free_model(model *m) {
    if (m->placed && BE->release_weights) BE->release_weights(BE, &m->w);
    ds41_weights_free(&m->w);
    ds41_checkpoint_close(m->ck);
    ds41_model_config_free(&m->cfg);
}

static ds41_kv_layout layout_of(const ds41_model_config *c, uint32_t per) {
    ds41_kv_layout l = {0};
    l.latent_dim = (uint32_t)c->head_dim;
    l.index_dim = (uint32_t)c->index_head_dim;
    l.latent_bytes = l.latent_dim / 2 + l.latent_dim / 16;
    l.index_bytes = l.index_dim / 2 + l.index_dim / 32;
    l.entry_bytes = l.latent_bytes + l.index_bytes;
    l.entries_per_page = per;
    l.page_bytes = per * l.entry_bytes;
    l.window = (uint32_t)c->window_size;
    l.ring_row_bytes = l.latent_dim + l.latent_dim / 32;
    return l;
}

/* ---- linears ------------------------------------------------------------------------------- */

/* Rows [n0, n0 + n) of w (n0 a multiple of 32: FP8 scales cover 32 x 32 blocks). */
static ds41_linear row_range(const ds41_linear *w, size_t cap) {
    ds41_linear r = *w;
    if ((size_t)w->n <= cap) return r;
    const size_t n0 = (((size_t)w->n - cap) / 2) & ~(size_t)31, K = (size_t)w->k;
    r.n = (int64_t)cap;
    if (w->kind == DS41_LINEAR_FP8) {
        r.q += n0 * K;
        r.scale += (n0 / 32) * (size_t)w->scale_cols;
    } else if (w->kind == DS41_LINEAR_FP4) {
        r.q += n0 * ((K + 1) / 2);
        r.scale += n0 * (size_t)w->scale_cols;
    } else {
        r.bf16 += n0 * K;
    }
    return r;
}

static void dequant(const ds41_linear *w, float *wd) {
    const size_t N = (size_t)w->n, K = (size_t)w->k;
    if (w->kind == DS41_LINEAR_FP8)
        ds41_dequant_fp8_weight(w->q, w->scale, N, K, wd);
    else if (w->kind == DS41_LINEAR_FP4)
        ds41_dequant_fp4_weight(w->q, w->scale, N, K, wd);
    else
        for (size_t i = 0; i < N * K; i++) wd[i] = ds41_bf16_to_f32(w->bf16[i]);
}

static const char *kind_name(ds41_linear_kind k) {
    return k == DS41_LINEAR_FP8 ? "FP8" : k == DS41_LINEAR_FP4 ? "FP4" : "BF16";
}

static const char *out_name(ds41_linear_out o) {
    static const char *n[] = {"bf16", "f32", "bf16-exact", "f32-exact"};
    return n[o];
}

/* One weight at the shape's row counts: = reference (bit for bit for the EXACT outputs, else
 * within the accumulation bound), each row alone = the batch. */
static void check_linear(const shape *s, const char *what, const ds41_linear *full, ds41_linear_out out) {
    if (full->kind == DS41_LINEAR_NONE) {
        TAP_CHECK(0, "%s linear %s: the checkpoint has no such weight", s->name, what);
        return;
    }
    const ds41_linear w = row_range(full, s->ncap);
    const size_t N = (size_t)w.n, K = (size_t)w.k;
    const int exact = out == DS41_OUT_BF16_EXACT || out == DS41_OUT_F32_EXACT;
    const int bf = ds41_linear_out_bf16(out) || w.kind != DS41_LINEAR_BF16;
    float *wd = xmalloc(N * K * sizeof *wd);
    dequant(&w, wd);
    int ok = 1, inv = 1;
    double us[3] = {0};
    char note[300] = "";
    for (int mi = 0; mi < 3; mi++) {
        const size_t M = s->ms[mi];
        float *x = xmalloc(M * K * sizeof *x), *xq = xmalloc(M * K * sizeof *xq);
        float *y = xmalloc(M * N * sizeof *y), *ref = xmalloc(M * N * sizeof *ref),
              *row = xmalloc(N * sizeof *row);
        double *mag = xmalloc(M * N * sizeof *mag);
        fill_bf16(x, M * K, 2.0);
        memcpy(xq, x, M * K * sizeof *x);
        if (w.kind != DS41_LINEAR_BF16)
            for (size_t m = 0; m < M; m++) ds41_act_quant_qdq(xq + m * K, K);
        linear_magnitudes(xq, wd, M, N, K, mag);
        REF->linear(REF, &w, x, M, ref, out);
        float *dx = dup_(x, M * K * sizeof *x), *dy = dnew(M * N * sizeof *y), *drow = dnew(N * sizeof *row);
        TIMED(us[mi], (void)0, OPS->linear(OPS, &w, dx, M, dy, out), y, dy, M * N * sizeof *y);
        for (size_t i = 0; i < M * N; i++) {
            const int good = exact ? same_f(y[i], ref[i]) : within(y[i], ref[i], mag[i], K, bf);
            if (!good && ok)
                snprintf(note, sizeof note, "M=%zu element %zu: got %.9g, reference %.9g, magnitude sum %.3g",
                         M, i, (double)y[i], (double)ref[i], mag[i]);
            ok &= good;
        }
        for (size_t m = 0; m < M && inv; m++) {
            OPS->linear(OPS, &w, dx + m * K, 1, drow, out);
            get(row, drow, N * sizeof *row);
            if (!(inv = same_bits(row, y + m * N, N * sizeof *row)))
                snprintf(note + strlen(note), sizeof note - strlen(note), " row %zu of M=%zu alone differs",
                         m, M);
        }
        dev_release();
        free(x);
        free(xq);
        free(y);
        free(ref);
        free(row);
        free(mag);
    }
    TAP_CHECK(
        ok && inv,
        "%s linear %s %s N=%zu K=%zu out %s, M=%zu/%zu/%zu: = reference %s, rows alone = batched bit for bit "
        "(%.1f / %.1f / %.1f us)",
        s->name, what, kind_name(w.kind), N, K, out_name(out), s->ms[0], s->ms[1], s->ms[2],
        exact ? "bit for bit"
        : bf  ? "within fp32 accumulation + 1 bf16 ulp"
              : "within fp32 accumulation",
        us[0], us[1], us[2]);
    if (note[0]) TAP_NOTE("%s", note);
    free(wd);
}

static void check_linears(const shape *s, const model *md) {
    const ds41_layer_weights *l0 = &md->w.layers[md->L0], *ls = &md->w.layers[md->Ls],
                             *li = &md->w.layers[md->Li], *le = &md->w.layers[md->Le];
    check_linear(s, "wq_a", &l0->wq_a, DS41_OUT_BF16);
    check_linear(s, "wo_b", &l0->wo_b, DS41_OUT_BF16);
    check_linear(s, "wkv", &l0->wkv, DS41_OUT_BF16);
    check_linear(s, "idx_wq_b", &li->idx_wq_b, DS41_OUT_BF16_EXACT);
    check_linear(s, "eng_wkv", &le->eng_wkv, DS41_OUT_BF16_EXACT);
    check_linear(s, "expert w1", &l0->w1[0], DS41_OUT_BF16);
    check_linear(s, "expert w2", &l0->w2[1], DS41_OUT_BF16);
    check_linear(s, "shared w3", &l0->sh_w3, DS41_OUT_BF16);
    check_linear(s, "wo_a", &l0->wo_a, DS41_OUT_BF16);
    check_linear(s, "gate", &l0->gate, DS41_OUT_F32);
    check_linear(s, "head", &md->w.head, DS41_OUT_F32);
    check_linear(s, "cmp_wkv", &ls->cmp_wkv, DS41_OUT_F32_EXACT);
    check_linear(s, "cmp_wgate", &ls->cmp_wgate, DS41_OUT_F32_EXACT);
    check_linear(s, "cmp_wkv", &ls->cmp_wkv, DS41_OUT_BF16_EXACT);
    check_linear(s, "idx_weights_proj", &li->idx_weights_proj, DS41_OUT_BF16_EXACT);
    check_linear(s, "idx_wk", &ls->idx_wk, DS41_OUT_BF16_EXACT);
}

/* linear_batch over experts of different sizes, one member without rows: = one linear call per
 * member, bit for bit, and those within the reference's bound. */
static void check_linear_batch(const shape *s, const model *md) {
    const ds41_layer_weights *l0 = &md->w.layers[md->L0];
    enum { NB = 4 };
    ds41_linear w[NB] = {row_range(&l0->w1[0], s->ncap), row_range(&l0->w3[1], s->ncap),
                         row_range(&l0->w2[2], s->ncap), row_range(&l0->w1[3], s->ncap)};
    const size_t Ms[NB] = {s->ms[1], 0, s->ms[0], s->ms[2]};
    const ds41_linear *ws[NB];
    const float *dxs[NB];
    float *dys[NB], *x[NB], *y[NB], *one[NB];
    for (int i = 0; i < NB; i++) {
        const size_t K = (size_t)w[i].k, N = (size_t)w[i].n, M = Ms[i] ? Ms[i] : 1;
        ws[i] = &w[i];
        x[i] = xmalloc(M * K * sizeof(float));
        fill_bf16(x[i], M * K, 2.0);
        y[i] = xmalloc(M * N * sizeof(float));
        one[i] = xmalloc(M * N * sizeof(float));
        dxs[i] = dup_(x[i], M * K * sizeof(float));
        dys[i] = dnew(M * N * sizeof(float));
    }
    double us = 0;
    TIMED(us, (void)0, OPS->linear_batch(OPS, NB, ws, dxs, Ms, dys, DS41_OUT_BF16), y[3], dys[3],
          Ms[3] * (size_t)w[3].n * sizeof(float));
    int same = 1, ok = 1;
    for (int i = 0; i < NB; i++) {
        if (!Ms[i]) continue;
        const size_t K = (size_t)w[i].k, N = (size_t)w[i].n, M = Ms[i];
        get(y[i], dys[i], M * N * sizeof(float));
        float *d1 = dnew(M * N * sizeof(float)), *ref = xmalloc(M * N * sizeof(float));
        OPS->linear(OPS, ws[i], dxs[i], M, d1, DS41_OUT_BF16);
        get(one[i], d1, M * N * sizeof(float));
        same &= same_bits(one[i], y[i], M * N * sizeof(float));
        float *wd = xmalloc(N * K * sizeof *wd), *xq = xmalloc(M * K * sizeof *xq);
        double *mag = xmalloc(M * N * sizeof *mag);
        dequant(ws[i], wd);
        memcpy(xq, x[i], M * K * sizeof *xq);
        for (size_t m = 0; m < M; m++) ds41_act_quant_qdq(xq + m * K, K);
        linear_magnitudes(xq, wd, M, N, K, mag);
        REF->linear(REF, ws[i], x[i], M, ref, DS41_OUT_BF16);
        for (size_t j = 0; j < M * N; j++) ok &= within(y[i][j], ref[j], mag[j], K, 1);
        free(ref);
        free(wd);
        free(xq);
        free(mag);
    }
    TAP_CHECK(same && ok,
              "%s linear_batch of 4 FP4 experts (%zu/0/%zu/%zu rows): = one linear call each bit for bit, "
              "within the "
              "reference's bound (%.1f us)",
              s->name, Ms[0], Ms[2], Ms[3], us);
    dev_release();
    for (int i = 0; i < NB; i++) {
        free(x[i]);
        free(y[i]);
        free(one[i]);
    }
}

/* ---- norms and hyper-connections ---------------------------------------------------------- */

static void check_rmsnorm(const shape *s, const model *md) {
    const ds41_layer_weights *l0 = &md->w.layers[md->L0];
    const struct {
        const char *name;
        const uint16_t *w;
        size_t n;
    } cs[3] = {{"attn_norm", l0->attn_norm, (size_t)md->cfg.dim},
               {"q_norm", l0->q_norm, (size_t)md->cfg.q_lora_rank},
               {"kv_norm", l0->kv_norm, (size_t)md->cfg.head_dim}};
    const float eps = (float)md->cfg.norm_eps;
    for (int c = 0; c < 3; c++) {
        const size_t M = s->ms[2], n = cs[c].n;
        float *x = xmalloc(M * n * 4), *y = xmalloc(M * n * 4), *r = xmalloc(M * n * 4),
              *one = xmalloc(n * 4);
        fill_bf16(x, M * n, 3.0);
        REF->rmsnorm(REF, cs[c].w, x, M, n, eps, r);
        float *dx = dup_(x, M * n * 4), *dy = dnew(M * n * 4), *d1 = dnew(n * 4);
        double us, e = 0;
        TIMED(us, (void)0, OPS->rmsnorm(OPS, cs[c].w, dx, M, n, eps, dy), y, dy, M * n * 4);
        int inv = 1;
        for (size_t m = 0; m < M; m++) {
            OPS->rmsnorm(OPS, cs[c].w, dx + m * n, 1, n, eps, d1);
            get(one, d1, n * 4);
            inv &= same_bits(one, y + m * n, n * 4);
        }
        size_t nd = 0;
        rel_close(y, r, M * n, 2 * 0x1p-8, &e);
        const int ok = bf16_close(y, r, M * n, &nd);
        TAP_CHECK(
            ok && inv,
            "%s rmsnorm %s (%zu rows of %zu): bf16 outputs within one ulp of the reference (%zu differ, "
            "%.2g), rows alone = batched (%.1f us)",
            s->name, cs[c].name, M, n, nd, e, us);
        dev_release();
        free(x);
        free(y);
        free(r);
        free(one);
    }
}

static void check_hc(const shape *s, const model *md) {
    const ds41_layer_weights *l0 = &md->w.layers[md->L0];
    const size_t M = s->ms[2], D = (size_t)md->cfg.dim;
    const int hc = (int)md->cfg.hc_mult, iters = (int)md->cfg.hc_sinkhorn_iters;
    const float neps = (float)md->cfg.norm_eps, heps = (float)md->cfg.hc_eps;
    const size_t H = (size_t)hc * D;
    float *h = xmalloc(M * H * 4), *o = xmalloc(M * D * 4);
    fill_bf16(h, M * H, 1.0);
    fill_bf16(o, M * D, 1.0);
    float *pre = xmalloc(M * hc * 4), *post = xmalloc(M * hc * 4), *comb = xmalloc(M * hc * hc * 4);
    float *pr = xmalloc(M * hc * 4), *por = xmalloc(M * hc * 4), *cr = xmalloc(M * hc * hc * 4);
    REF->hc_mix(REF, l0->hc_attn_fn, l0->hc_attn_scale, l0->hc_attn_base, h, M, hc, D, neps, iters, heps, pr,
                por, cr);
    float *dh = dup_(h, M * H * 4), *dpre = dnew(M * hc * 4), *dpost = dnew(M * hc * 4),
          *dcomb = dnew(M * hc * hc * 4);
    double us;
    TIMED(us, (void)0,
          OPS->hc_mix(OPS, l0->hc_attn_fn, l0->hc_attn_scale, l0->hc_attn_base, dh, M, hc, D, neps, iters,
                      heps, dpre, dpost, dcomb),
          comb, dcomb, M * hc * hc * 4);
    get(pre, dpre, M * hc * 4);
    get(post, dpost, M * hc * 4);
    double e1, e2, e3;
    int ok = rel_close(pre, pr, M * hc, 1e-5, &e1) & rel_close(post, por, M * hc, 1e-5, &e2) &
             rel_close(comb, cr, M * hc * hc, 1e-4, &e3);
    int inv = 1;
    float p1[16], q1[16], c1[256];
    for (size_t m = 0; m < M && hc <= 16; m++) {
        float *a = dnew(hc * 4), *b = dnew(hc * 4), *c = dnew(hc * hc * 4);
        OPS->hc_mix(OPS, l0->hc_attn_fn, l0->hc_attn_scale, l0->hc_attn_base, dh + m * H, 1, hc, D, neps,
                    iters, heps, a, b, c);
        get(p1, a, hc * 4);
        get(q1, b, hc * 4);
        get(c1, c, hc * hc * 4);
        inv &= same_bits(p1, pre + m * hc, hc * 4) && same_bits(q1, post + m * hc, hc * 4) &&
               same_bits(c1, comb + m * hc * hc, hc * hc * 4);
    }
    TAP_CHECK(ok && inv,
              "%s hc_mix + Sinkhorn (%zu rows, hc %d x dim %zu, %d iterations): pre/post/comb within "
              "1e-5/1e-5/1e-4 of "
              "the reference (%.2g %.2g %.2g), rows alone = batched (%.1f us)",
              s->name, M, hc, D, iters, e1, e2, e3, us);
    /* hc_pre / hc_post on the reference's mixes: the reference's short sums. */
    float *dpr = dup_(pr, M * hc * 4), *dpor = dup_(por, M * hc * 4), *dcr = dup_(cr, M * hc * hc * 4);
    float *dout = dnew(M * D * 4), *dho = dnew(M * H * 4), *dox = dup_(o, M * D * 4);
    float *hp = xmalloc(M * D * 4), *hpr = xmalloc(M * D * 4), *ho = xmalloc(M * H * 4),
          *hor = xmalloc(M * H * 4);
    float *one = xmalloc(H * 4);
    REF->hc_pre(REF, h, pr, M, hc, D, hpr);
    REF->hc_post(REF, o, h, por, cr, M, hc, D, hor);
    double us1, us2;
    TIMED(us1, (void)0, OPS->hc_pre(OPS, dh, dpr, M, hc, D, dout), hp, dout, M * D * 4);
    TIMED(us2, (void)0, OPS->hc_post(OPS, dox, dh, dpor, dcr, M, hc, D, dho), ho, dho, M * H * 4);
    inv = 1;
    for (size_t m = 0; m < M; m++) {
        float *d1 = dnew(H * 4);
        OPS->hc_pre(OPS, dh + m * H, dpr + m * hc, 1, hc, D, d1);
        get(one, d1, D * 4);
        inv &= same_bits(one, hp + m * D, D * 4);
        OPS->hc_post(OPS, dox + m * D, dh + m * H, dpor + m * hc, dcr + m * hc * hc, 1, hc, D, d1);
        get(one, d1, H * 4);
        inv &= same_bits(one, ho + m * H, H * 4);
    }
    TAP_CHECK(same_bits(hp, hpr, M * D * 4) && inv,
              "%s hc_pre (%zu rows): the reference's short sums bit for bit, "
              "rows alone = batched (%.1f us)",
              s->name, M, us1);
    TAP_CHECK(same_bits(ho, hor, M * H * 4) && inv,
              "%s hc_post (%zu rows): the reference's short sums bit for bit, "
              "rows alone = batched (%.1f us)",
              s->name, M, us2);
    dev_release();
    free(h);
    free(o);
    free(pre);
    free(post);
    free(comb);
    free(pr);
    free(por);
    free(cr);
    free(hp);
    free(hpr);
    free(ho);
    free(hor);
    free(one);
}

/* ---- rope, quantizers, pooling ------------------------------------------------------------ */

static void check_rope(const shape *s, const model *md) {
    const size_t M = s->ms[2], H = (size_t)md->cfg.n_heads, hd = (size_t)md->cfg.head_dim;
    const int np = (int)md->cfg.rope_head_dim / 2;
    const size_t RS = H * hd + 3, OFF = hd - 2 * (size_t)np;
    uint64_t *pos = xmalloc(M * 8);
    float *fr = xmalloc((size_t)np * 4);
    for (size_t m = 0; m < M; m++) pos[m] = m == 0 ? 0 : m == 1 ? s->n_pos_big : (uint64_t)(m * 977 + 3);
    for (int i = 0; i < np; i++)
        fr[i] = (float)pow(md->cfg.rope_theta, -2.0 * i / (2.0 * np)) / (i % 3 ? 1.0f : 7.0f);
    float *cs = xmalloc(M * 2 * (size_t)np * 4), *csr = xmalloc(M * 2 * (size_t)np * 4);
    REF->rope_table(REF, fr, np, pos, M, csr);
    float *dfr = dup_(fr, (size_t)np * 4), *dcs = dnew(M * 2 * (size_t)np * 4);
    double us;
    TIMED(us, (void)0, OPS->rope_table(OPS, dfr, np, pos, M, dcs), cs, dcs, M * 2 * (size_t)np * 4);
    size_t nd = 0;
    const size_t far = ulp_far(cs, csr, M * 2 * (size_t)np, 1, 0, &nd);
    TAP_CHECK(far == 0,
              "%s rope_table (%zu rows, %d pairs, positions up to %zu): the reference's cos/sin within one "
              "fp32 ulp "
              "(%zu of %zu differ by one: the double cos/sin of the backend's library) (%.1f us)",
              s->name, M, np, (size_t)s->n_pos_big, nd, M * 2 * (size_t)np, us);
    float *x0 = xmalloc(M * RS * 4), *x = xmalloc(M * RS * 4), *xr = xmalloc(M * RS * 4);
    fill_bf16(x0, M * RS, 2.0);
    float *dx = dnew(M * RS * 4), *dcsr = dup_(csr, M * 2 * (size_t)np * 4);
    int ok = 1;
    double us2 = 0;
    for (int inv = 0; inv < 2; inv++) {
        memcpy(xr, x0, M * RS * 4);
        REF->rope(REF, xr + OFF, M, (int)H, RS, hd, np, csr, inv);
        TIMED(us2, put(dx, x0, M * RS * 4), OPS->rope(OPS, dx + OFF, M, (int)H, RS, hd, np, dcsr, inv), x, dx,
              M * RS * 4);
        ok &= same_bits(x, xr, M * RS * 4);
    }
    TAP_CHECK(
        ok,
        "%s rope (%zu rows x %zu heads, %d pairs at offset %zu, rows at a stride with a gap, forward and "
        "inverse): bit for bit the reference (%.1f us)",
        s->name, M, H, np, OFF, us2);
    dev_release();
    free(pos);
    free(fr);
    free(cs);
    free(csr);
    free(x0);
    free(x);
    free(xr);
}

static void check_quantizers(const shape *s, const model *md) {
    const size_t M = s->ms[2], hd = (size_t)md->cfg.head_dim, ST = hd + hd / 32 + 5;
    const size_t IH = (size_t)md->cfg.index_n_heads, ID = (size_t)md->cfg.index_head_dim, QN = IH * ID;
    float *x = xmalloc(M * hd * 4);
    fill_bf16(x, M * hd, 50.0);
    x[3] = NAN; /* a NaN block */
    uint8_t *o = xmalloc(M * ST), *orf = xmalloc(M * ST);
    memset(orf, 0x5a, M * ST);
    REF->act_quant_fp8(REF, x, M, hd, orf, ST);
    float *dx = dup_(x, M * hd * 4);
    uint8_t *dout = dup_(orf, M * ST); /* the gaps between rows keep the reference's 0x5a */
    uint8_t *fill = xmalloc(M * ST);
    memset(fill, 0x5a, M * ST);
    double us;
    TIMED(us, put(dout, fill, M * ST), OPS->act_quant_fp8(OPS, dx, M, hd, dout, ST), o, dout, M * ST);
    TAP_CHECK(same_bits(o, orf, M * ST),
              "%s act_quant_fp8 (%zu rows of %zu at a stride of %zu, a NaN block): bit for bit the "
              "reference, nothing "
              "written between rows (%.1f us)",
              s->name, M, hd, ST, us);
    float *q0 = xmalloc(M * QN * 4), *w0 = xmalloc(M * IH * 4), *q = xmalloc(M * QN * 4),
          *w = xmalloc(M * IH * 4);
    fill_bf16(q0, M * QN, 2.0);
    fill_bf16(w0, M * IH, 1.0);
    memcpy(q, q0, M * QN * 4);
    memcpy(w, w0, M * IH * 4);
    const float sc = (float)(pow((double)ID, -0.5) * pow((double)IH, -0.5));
    REF->index_query(REF, q, QN, w, IH, M, sc);
    float *dq = dnew(M * QN * 4), *dw = dnew(M * IH * 4), *gq = xmalloc(M * QN * 4),
          *gw = xmalloc(M * IH * 4);
    TIMED(
        us,
        {
            put(dq, q0, M * QN * 4);
            put(dw, w0, M * IH * 4);
        },
        OPS->index_query(OPS, dq, QN, dw, IH, M, sc), gq, dq, M * QN * 4);
    get(gw, dw, M * IH * 4);
    TAP_CHECK(same_bits(gq, q, M * QN * 4) && same_bits(gw, w, M * IH * 4),
              "%s index_query (%zu rows, %zu x %zu): FP4 QDQ and weights bit for bit the reference (%.1f us)",
              s->name, M, IH, ID, us);
    /* kv_pack */
    const ds41_kv_layout lay = layout_of(&md->cfg, 16);
    const size_t NE = s->ms[2] + 3;
    float *lat = xmalloc(NE * hd * 4), *key = xmalloc(NE * ID * 4);
    fill_bf16(lat, NE * hd, 2.0);
    fill_bf16(key, NE * ID, 1.0);
    uint8_t *pk = xmalloc(NE * lay.entry_bytes), *pr = xmalloc(NE * lay.entry_bytes);
    REF->kv_pack(REF, &lay, lat, key, NE, pr);
    float *dl = dup_(lat, NE * hd * 4), *dk = dup_(key, NE * ID * 4);
    uint8_t *dp = dnew(NE * lay.entry_bytes);
    TIMED(us, (void)0, OPS->kv_pack(OPS, &lay, dl, dk, NE, dp), pk, dp, NE * lay.entry_bytes);
    TAP_CHECK(same_bits(pk, pr, NE * lay.entry_bytes),
              "%s kv_pack (%zu entries of %u bytes): bit for bit the reference (%.1f us)", s->name, NE,
              lay.entry_bytes, us);
    dev_release();
    free(x);
    free(o);
    free(orf);
    free(fill);
    free(q0);
    free(w0);
    free(q);
    free(w);
    free(gq);
    free(gw);
    free(lat);
    free(key);
    free(pk);
    free(pr);
}

static void check_pool(const shape *s, const model *md) {
    const size_t G = s->ms[2] + 2, hd = (size_t)md->cfg.head_dim;
    const int R = 2;
    float *kv = xmalloc(G * R * hd * 4), *sc = xmalloc(G * R * hd * 4);
    for (size_t i = 0; i < G * R * hd; i++) {
        kv[i] = (float)urand();
        sc[i] = (float)(urand() * 8.0);
    }
    float *p = xmalloc(G * hd * 4), *pr = xmalloc(G * hd * 4);
    REF->compress_pool(REF, kv, sc, G, R, hd, pr);
    float *dk = dup_(kv, G * R * hd * 4), *ds = dup_(sc, G * R * hd * 4), *dp = dnew(G * hd * 4);
    double us;
    TIMED(us, (void)0, OPS->compress_pool(OPS, dk, ds, G, R, hd, dp), p, dp, G * hd * 4);
    size_t nd = 0;
    const size_t far = ulp_far(p, pr, G * hd, 1, 1, &nd);
    TAP_CHECK(far == 0,
              "%s compress_pool (%zu groups of %d x %zu): the reference within one bf16 ulp (%zu of %zu "
              "differ: the "
              "double exp of the backend's library) (%.1f us)",
              s->name, G, R, hd, nd, G * hd, us);
    dev_release();
    free(kv);
    free(sc);
    free(p);
    free(pr);
}

/* ---- the indexer ------------------------------------------------------------------------- */

static void check_indexer(const shape *s, const model *md) {
    const ds41_model_config *c = &md->cfg;
    const int IH = (int)c->index_n_heads, ID = (int)c->index_head_dim;
    const size_t M = s->ms[1] + 2, NE = s->n_ent, hd = (size_t)c->head_dim, per = 16;
    ds41_kv_layout lay = layout_of(c, (uint32_t)per);
    /* Entries packed by the reference, on the host and uploaded. */
    uint8_t *ent = xmalloc(NE * lay.entry_bytes);
    {
        float *lat = xmalloc(NE * hd * 4), *key = xmalloc(NE * (size_t)ID * 4);
        fill_bf16(lat, NE * hd, 2.0);
        fill_bf16(key, NE * (size_t)ID, 1.0);
        REF->kv_pack(REF, &lay, lat, key, NE, ent);
        free(lat);
        free(key);
    }
    uint8_t *dent = dup_(ent, NE * lay.entry_bytes);
    const size_t NP = (NE + per - 1) / per;
    const uint8_t **hpages = xmalloc(NP * sizeof *hpages), **dpages = xmalloc(NP * sizeof *dpages);
    index_test_pages(&lay, ent, NE, (uint32_t)per, hpages);
    index_test_pages(&lay, dent, NE, (uint32_t)per, dpages);
    size_t *row_table = xmalloc(M * sizeof *row_table);
    uint32_t *reach = xmalloc(M * sizeof *reach);
    for (size_t m = 0; m < M; m++) {
        reach[m] = m == 0 ? (uint32_t)NE : m == 1 ? 0 : m == 2 ? 1 : (uint32_t)(1 + (m * 7919) % NE);
        row_table[m] = 0;
    }
    float *q = xmalloc(M * (size_t)IH * (size_t)ID * 4), *w = xmalloc(M * (size_t)IH * 4);
    index_test_queries(q, w, M, IH, ID, urand);
    /* a run of equal entries (ties) */
    for (size_t t = 5; t < 9 && t < NE; t++)
        memcpy(ent + t * lay.entry_bytes, ent + 4 * lay.entry_bytes, lay.entry_bytes);
    put(dent, ent, NE * lay.entry_bytes);
    const ds41_kv_pages hk = {.layout = &lay, .pages = hpages, .row_table = row_table, .row_reach = reach, .n_pages = NP};
    const ds41_kv_pages dk = {.layout = &lay, .pages = dpages, .row_table = row_table, .row_reach = reach, .n_pages = NP};
    float *sr = xmalloc(M * NE * 4), *sg = xmalloc(M * NE * 4);
    for (size_t i = 0; i < M * NE; i++) sr[i] = 1234.0f;
    REF->index_scores(REF, q, w, M, IH, ID, &hk, sr, NE);
    float *dq = dup_(q, M * (size_t)IH * (size_t)ID * 4), *dw = dup_(w, M * (size_t)IH * 4),
          *dsc = dnew(M * NE * 4);
    float *sentinel = xmalloc(M * NE * 4);
    for (size_t i = 0; i < M * NE; i++) sentinel[i] = 1234.0f;
    double us;
    TIMED(us, put(dsc, sentinel, M * NE * 4), OPS->index_scores(OPS, dq, dw, M, IH, ID, &dk, dsc, NE), sg,
          dsc, M * NE * 4);
    int ok = 1;
    size_t exact = 0;
    double err_max = 0;
    /* The documented error of index scores is 0 (engine/backend/cpu/cpu_backend.h "Decisions":
     * every product is exact and every sum a double sum of exact terms rounded where the
     * reference rounds), so any difference is a defect; the largest is reported. */
    for (size_t i = 0; i < M * NE; i++) {
        exact += same_f(sg[i], sr[i]);
        err_max = fmax(err_max, fabs((double)sg[i] - sr[i]));
    }
    ok = exact == M * NE;
    TAP_CHECK(
        ok,
        "%s index_scores (%zu rows, %d x %d heads, reaches up to %zu over pages of %zu): bit for bit the "
        "reference's (%zu of %zu equal, largest difference %.3g), nothing past a row's reach (%.1f us)",
        s->name, M, IH, ID, NE, per, exact, M * NE, err_max, us);

    /* Candidate blocks and top-k, first on the reference's scores (bit for bit), then on the
     * backend's own (the reference's choice or one within the score error of the boundary). */
    const size_t B = (size_t)c->candidate_block_size, nb = (NE + B - 1) / B, AS = nb + 3;
    const size_t take = (size_t)c->candidate_topk_blocks < nb ? (size_t)c->candidate_topk_blocks : nb / 2 + 1;
    const size_t K = (size_t)c->index_topk;
    float *bsr = xmalloc(M * nb * 4), *bsg = xmalloc(M * nb * 4);
    uint8_t *ar = xmalloc(M * AS), *ag = xmalloc(M * AS);
    memset(ar, 7, M * AS);
    REF->index_blocks(REF, sr, NE, reach, M, B, take, bsr, nb, ar, AS);
    float *dsr = dup_(sr, M * NE * 4), *dbs = dnew(M * nb * 4);
    uint8_t *dal = dnew(M * AS), *seven = xmalloc(M * AS);
    memset(seven, 7, M * AS);
    TIMED(us, put(dal, seven, M * AS), OPS->index_blocks(OPS, dsr, NE, reach, M, B, take, dbs, nb, dal, AS),
          ag, dal, M * AS);
    get(bsg, dbs, M * nb * 4);
    int blocks_ok = same_bits(ag, ar, M * AS);
    for (size_t m = 0; m < M; m++)
        for (size_t j = 0; j < (reach[m] + B - 1) / B; j++)
            blocks_ok &= same_f(bsg[m * nb + j], bsr[m * nb + j]);
    TAP_CHECK(blocks_ok,
              "%s index_blocks (%zu rows, blocks of %zu, top %zu of %zu) on the reference's scores: block "
              "scores and "
              "allow flags bit for bit (%.1f us)",
              s->name, M, B, take, nb, us);

    int32_t *selr = xmalloc(M * K * 4), *selg = xmalloc(M * K * 4);
    uint32_t *cnr = xmalloc(M * 4), *cng = xmalloc(M * 4);
    int32_t *dsel = dnew(M * K * 4);
    uint32_t *dcnt = dnew(M * 4);
    uint8_t *dar = dup_(ar, M * AS);
    float *scr = xmalloc(M * NE * 4);
    int topk_ok = 1;
    double us2 = 0;
    for (int masked = 0; masked < 2; masked++) {
        memcpy(scr, sr, M * NE * 4);
        REF->index_topk(REF, scr, NE, reach, M, masked ? ar : NULL, AS, B, K, selr, cnr);
        TIMED(us2, put(dsr, sr, M * NE * 4),
              OPS->index_topk(OPS, dsr, NE, reach, M, masked ? dar : NULL, AS, B, K, dsel, dcnt), selg, dsel,
              M * K * 4);
        get(cng, dcnt, M * 4);
        topk_ok &= same_bits(cng, cnr, M * 4);
        for (size_t m = 0; m < M && topk_ok; m++)
            topk_ok &= same_bits(selg + m * K, selr + m * K, cnr[m] * 4);
    }
    TAP_CHECK(topk_ok,
              "%s index_topk (%zu rows, top %zu, plain and masked by the candidate blocks) on the "
              "reference's scores: "
              "selections and counts bit for bit (%.1f us)",
              s->name, M, K, us2);

    /* On the backend's own scores: the decision contract. */
    float *dsg = dup_(sg, M * NE * 4);
    OPS->index_topk(OPS, dsg, NE, reach, M, NULL, AS, B, K, dsel, dcnt);
    get(selg, dsel, M * K * 4);
    get(cng, dcnt, M * 4);
    memcpy(scr, sr, M * NE * 4);
    REF->index_topk(REF, scr, NE, reach, M, NULL, AS, B, K, selr, cnr);
    size_t differ = 0, bad = 0;
    for (size_t m = 0; m < M; m++) {
        if (cng[m] != cnr[m]) {
            bad++;
            continue;
        }
        if (same_bits(selg + m * K, selr + m * K, cnr[m] * 4)) continue;
        differ++;
        double e = 0;
        for (size_t t = 0; t < reach[m]; t++) e = fmax(e, fabs((double)sg[m * NE + t] - sr[m * NE + t]));
        if (!set_admissible(selg + m * K, cng[m], sr + m * NE, reach[m], e)) bad++;
    }
    TAP_CHECK(
        bad == 0,
        "%s index top-k on the backend's own scores: %zu of %zu rows differ from the reference's choice, all "
        "within the score error of the boundary (largest score error %.3g)",
        s->name, differ, M, err_max);
    dev_release();
    free(ent);
    free(hpages);
    free(dpages);
    free(row_table);
    free(reach);
    free(q);
    free(w);
    free(sr);
    free(sg);
    free(sentinel);
    free(bsr);
    free(bsg);
    free(ar);
    free(ag);
    free(seven);
    free(selr);
    free(selg);
    free(cnr);
    free(cng);
    free(scr);
}

/* ---- attention ---------------------------------------------------------------------------- */

/* Packed window rows (FP8 + ue8m0, the ring format) of random bf16 vectors. */
static uint8_t *window_rows(size_t n, size_t hd, size_t rb) {
    uint8_t *r = xmalloc(n * rb);
    float *v = xmalloc(hd * 4);
    for (size_t j = 0; j < n; j++) {
        fill_bf16(v, hd, 2.0);
        ds41_act_quant(v, hd, r + j * rb, r + j * rb + hd);
    }
    free(v);
    return r;
}

/* Attention outputs: bf16_close (*n_diff outputs differ by one ulp), and the worst per-head
 * max |d| / max |ref| for the report. */
static int attn_close(const float *a, const float *b, size_t H, size_t hd, double *worst, size_t *n_diff) {
    *worst = 0;
    for (size_t h = 0; h < H; h++) {
        double e = 0;
        rel_close(a + h * hd, b + h * hd, hd, 1e-2, &e);
        *worst = fmax(*worst, e);
    }
    return bf16_close(a, b, H * hd, n_diff);
}

static void check_attention(const shape *s, const model *md) {
    const ds41_model_config *c = &md->cfg;
    const size_t H = (size_t)c->n_heads, hd = (size_t)c->head_dim, W = (size_t)c->window_size;
    const size_t NE = s->n_ent, per = 16, K = (size_t)c->index_topk, QO = H * hd;
    ds41_kv_layout lay = layout_of(c, (uint32_t)per);
    const size_t rb = lay.ring_row_bytes;
    const float *sink = md->w.layers[md->L0].attn_sink;
    const float scale = (float)pow((double)hd, -0.5);
    uint8_t *ent = xmalloc(NE * lay.entry_bytes);
    {
        float *lat = xmalloc(NE * hd * 4), *key = xmalloc(NE * (size_t)c->index_head_dim * 4);
        fill_bf16(lat, NE * hd, 2.0);
        fill_bf16(key, NE * (size_t)c->index_head_dim, 1.0);
        REF->kv_pack(REF, &lay, lat, key, NE, ent);
        free(lat);
        free(key);
    }
    uint8_t *dent = dup_(ent, NE * lay.entry_bytes);

    /* sparse_attn of one query over a full window and K compressed entries. */
    {
        uint8_t *wr = window_rows(W, hd, rb), *dwr = dup_(wr, W * rb);
        const uint8_t **hw = xmalloc(W * sizeof *hw), **dw = xmalloc(W * sizeof *dw);
        const size_t nc = K < NE ? K : NE;
        const uint8_t **hc = xmalloc(nc * sizeof *hc), **dc = xmalloc(nc * sizeof *dc);
        for (size_t j = 0; j < W; j++) {
            hw[j] = wr + ((j * 5) % W) * rb;
            dw[j] = dwr + ((j * 5) % W) * rb;
        }
        for (size_t j = 0; j < nc; j++) {
            hc[j] = ent + (j * NE / nc) * lay.entry_bytes;
            dc[j] = dent + (j * NE / nc) * lay.entry_bytes;
        }
        float *q = xmalloc(QO * 4), *o = xmalloc(QO * 4), *r = xmalloc(QO * 4);
        fill_bf16(q, QO, 0.5);
        const ds41_attn_rows hr = {.layout = &lay, .n_window = W, .window = hw, .n_comp = nc, .comp = hc};
        const ds41_attn_rows drw = {.layout = &lay, .n_window = W, .window = dw, .n_comp = nc, .comp = dc};
        REF->sparse_attn(REF, q, (int)H, (int)hd, sink, scale, &hr, r);
        float *dq = dup_(q, QO * 4), *dout = dnew(QO * 4);
        double us, worst = 0;
        TIMED(us, (void)0, OPS->sparse_attn(OPS, dq, (int)H, (int)hd, sink, scale, &drw, dout), o, dout,
              QO * 4);
        size_t nd = 0;
        const int ok = attn_close(o, r, H, hd, &worst, &nd);
        TAP_CHECK(
            ok,
            "%s sparse_attn (%zu heads x %zu, %zu window + %zu compressed rows, the layer's sink): bf16 "
            "outputs within one ulp of the reference (%zu of %zu differ; worst head %.2g) (%.1f us)",
            s->name, H, hd, W, nc, nd, QO, worst, us);
        free(wr);
        free(hw);
        free(dw);
        free(hc);
        free(dc);
        free(q);
        free(o);
        free(r);
    }

    /* attend, causal: three sequences, one far past the window (the ring wrapped several
     * times), one whose chunk crosses the window's end, one at position 0. */
    for (int mode = 0; mode < 2; mode++) {
        const size_t NI = mode == 0 ? 3 : 2;
        const size_t blk = mode == 0 ? 0 : (size_t)(c->dspark_block_size > 0 ? c->dspark_block_size : 5);
        const size_t rows_c[3] = {3, 4, 2};
        const uint64_t pos0_c[3] = {3 * W + 5, W >= 2 ? W - 2 : 0, 0};
        const uint64_t pos0_b[2] = {W + 3, 2};
        size_t M = 0, item_row0[3];
        uint64_t item_pos0[3];
        for (size_t i = 0; i < NI; i++) {
            item_row0[i] = M;
            item_pos0[i] = mode == 0 ? pos0_c[i] : pos0_b[i];
            M += mode == 0 ? rows_c[i] : blk;
        }
        size_t *row_item = xmalloc(M * sizeof *row_item), *row_table = xmalloc(M * sizeof *row_table);
        uint64_t *row_pos = xmalloc(M * 8);
        for (size_t i = 0; i < NI; i++)
            for (size_t r = 0; r < (mode == 0 ? rows_c[i] : blk); r++) {
                row_item[item_row0[i] + r] = i;
                row_pos[item_row0[i] + r] = item_pos0[i] + r;
                row_table[item_row0[i] + r] = 0;
            }
        uint8_t *rings = window_rows(NI * W, hd, rb), *chunk = window_rows(M, hd, rb);
        uint8_t *drings = dup_(rings, NI * W * rb), *dchunk = dup_(chunk, M * rb);
        const uint8_t *hring[3], *dring[3];
        for (size_t i = 0; i < NI; i++) {
            hring[i] = rings + i * W * rb;
            dring[i] = drings + i * W * rb;
        }
        const size_t NP = (NE + per - 1) / per;
        const uint8_t **hp = xmalloc(NP * sizeof *hp), **dp = xmalloc(NP * sizeof *dp);
        index_test_pages(&lay, ent, NE, (uint32_t)per, hp);
        index_test_pages(&lay, dent, NE, (uint32_t)per, dp);
        int32_t *sel = xmalloc(M * K * 4);
        uint32_t *cnt = xmalloc(M * 4);
        for (size_t m = 0; m < M; m++) {
            cnt[m] = row_item[m] == 0 ? (uint32_t)(K < NE ? K : NE) : row_item[m] == 1 ? 1 : 0;
            for (uint32_t j = 0; j < cnt[m]; j++) sel[m * K + j] = (int32_t)((j * NE) / cnt[m] + (m % 2));
        }
        int32_t *dsel = dup_(sel, M * K * 4);
        uint32_t *dcnt = dup_(cnt, M * 4);
        ds41_attn_step hs = {.layout = &lay,
                             .window = (uint32_t)W,
                             .block = (uint32_t)blk,
                             .chunk = chunk,
                             .rings = hring,
                             .row_item = row_item,
                             .row_pos = row_pos,
                             .item_row0 = item_row0,
                             .item_pos0 = item_pos0,
                             .sel = mode == 0 ? sel : NULL,
                             .count = cnt,
                             .sel_stride = K,
                             .comp = {.layout = &lay, .pages = hp, .row_table = row_table, .n_pages = NP}};
        ds41_attn_step ds = hs;
        ds.chunk = dchunk;
        ds.rings = dring;
        ds.sel = mode == 0 ? dsel : NULL;
        ds.count = dcnt;
        ds.comp.pages = dp;
        float *q = xmalloc(M * QO * 4), *o = xmalloc(M * QO * 4), *r = xmalloc(M * QO * 4),
              *o0 = xmalloc(M * QO * 4);
        fill_bf16(q, M * QO, 0.5);
        REF->attend(REF, q, M, (int)H, (int)hd, sink, scale, &hs, r);
        float *dq = dup_(q, M * QO * 4), *dout = dnew(M * QO * 4), *dout0 = dnew(M * QO * 4);
        double us, worst = 0, w1;
        TIMED(us, (void)0, OPS->attend(OPS, dq, M, (int)H, (int)hd, sink, scale, &ds, dout), o, dout,
              M * QO * 4);
        int ok = 1;
        size_t nd = 0, nd1;
        for (size_t m = 0; m < M; m++) {
            ok &= attn_close(o + m * QO, r + m * QO, H, hd, &w1, &nd1);
            worst = fmax(worst, w1);
            nd += nd1;
        }
        /* the first sequence alone: its rows come first, so the same step with M of its rows */
        const size_t M0 = mode == 0 ? rows_c[0] : blk;
        OPS->attend(OPS, dq, M0, (int)H, (int)hd, sink, scale, &ds, dout0);
        get(o0, dout0, M0 * QO * 4);
        const int inv = same_bits(o0, o, M0 * QO * 4);
        if (mode == 0)
            TAP_CHECK(
                ok && inv,
                "%s attend causal (%zu rows of 3 sequences at positions %llu.., %llu.., 0..: window %zu "
                "wrapped, chunk across the window's end, up to %zu compressed rows through pages): bf16 "
                "outputs within one ulp of the reference (%zu of %zu differ; worst head %.2g), the first "
                "sequence alone = batched bit for bit (%.1f us)",
                s->name, M, (unsigned long long)pos0_c[0], (unsigned long long)pos0_c[1], W, K, nd, M * QO,
                worst, us);
        else
            TAP_CHECK(
                ok && inv,
                "%s attend DSpark blocks (2 blocks of %zu at positions %llu and 2, no causal mask): bf16 "
                "outputs within one ulp of the reference (%zu of %zu differ; worst head %.2g), the first "
                "block alone = batched bit for bit (%.1f us)",
                s->name, blk, (unsigned long long)pos0_b[0], nd, M * QO, worst, us);
        dev_release();
        dent = dup_(ent, NE * lay.entry_bytes);
        free(row_item);
        free(row_table);
        free(row_pos);
        free(rings);
        free(chunk);
        free(hp);
        free(dp);
        free(sel);
        free(cnt);
        free(q);
        free(o);
        free(r);
        free(o0);
    }
    dev_release();
    free(ent);
}

/* ---- MoE, Engram, gathers ---------------------------------------------------------------- */

static void check_moe(const shape *s, const model *md) {
    const ds41_model_config *c = &md->cfg;
    const size_t M = s->ms[2], I = (size_t)c->moe_inter_dim, D = (size_t)c->dim;
    const int E = (int)c->n_routed_experts, k = (int)c->n_activated_experts;
    /* swiglu, with and without route weights */
    float *g = xmalloc(M * I * 4), *u = xmalloc(M * I * 4), *rt = xmalloc(M * 4), *h = xmalloc(M * I * 4),
          *hr = xmalloc(M * I * 4);
    fill_bf16(g, M * I, 6.0);
    fill_bf16(u, M * I, 12.0);
    for (size_t m = 0; m < M; m++) rt[m] = (float)(0.1 + fabs(urand()));
    float *dg = dup_(g, M * I * 4), *du = dup_(u, M * I * 4), *drt = dup_(rt, M * 4), *dh = dnew(M * I * 4);
    int ok = 1;
    size_t nd = 0;
    double us = 0;
    for (int routed = 0; routed < 2; routed++) {
        REF->swiglu(REF, g, u, M, I, (float)c->swiglu_limit, routed ? rt : NULL, hr);
        TIMED(us, (void)0, OPS->swiglu(OPS, dg, du, M, I, (float)c->swiglu_limit, routed ? drt : NULL, dh), h,
              dh, M * I * 4);
        size_t nd1 = 0;
        ok &= bf16_close(h, hr, M * I, &nd1);
        nd += nd1;
    }
    TAP_CHECK(
        ok,
        "%s swiglu (%zu rows of %zu, limit %g, with and without route weights): bf16 outputs within one "
        "ulp of the reference (%zu differ: the double exp of silu) (%.1f us)",
        s->name, M, I, c->swiglu_limit, nd, us);
    /* moe_combine: k expert rows per token through slots, plus the shared expert's row */
    const size_t T = M * (size_t)k;
    float *oe = xmalloc(T * D * 4), *sh = xmalloc(M * D * 4), *out = xmalloc(M * D * 4),
          *outr = xmalloc(M * D * 4);
    fill_bf16(oe, T * D, 1.0);
    fill_bf16(sh, M * D, 1.0);
    uint32_t *slot = xmalloc(T * 4);
    for (size_t i = 0; i < T; i++) slot[i] = (uint32_t)((i * 7) % T);
    REF->moe_combine(REF, oe, slot, (size_t)k, sh, M, D, outr);
    float *doe = dup_(oe, T * D * 4), *dsh = dup_(sh, M * D * 4), *dout = dnew(M * D * 4);
    TIMED(us, (void)0, OPS->moe_combine(OPS, doe, slot, (size_t)k, dsh, M, D, dout), out, dout, M * D * 4);
    TAP_CHECK(same_bits(out, outr, M * D * 4),
              "%s moe_combine (%zu tokens x %d experts of %zu): bit for bit the reference (%.1f us)", s->name,
              M, k, D, us);
    /* router: on the same logits, the reference's choices, or ones within the score error */
    const float *bias = md->w.layers[md->L0].gate_bias;
    float *lg = xmalloc(M * (size_t)E * 4), *wr = xmalloc(M * (size_t)k * 4),
          *wg = xmalloc(M * (size_t)k * 4);
    float *sr = xmalloc(M * (size_t)E * 4), *sg = xmalloc(M * (size_t)E * 4);
    int32_t *selr = xmalloc(M * (size_t)k * 4), *selg = xmalloc(M * (size_t)k * 4);
    for (size_t i = 0; i < M * (size_t)E; i++) lg[i] = (float)(urand() * 4);
    lg[1] = lg[0]; /* a tie */
    REF->router(REF, lg, bias, M, E, k, (float)c->gate_temp, (float)c->route_scale, selr, wr, sr);
    float *dlg = dup_(lg, M * (size_t)E * 4), *dwt = dnew(M * (size_t)k * 4), *dsc = dnew(M * (size_t)E * 4);
    int32_t *dsel = dnew(M * (size_t)k * 4);
    TIMED(us, (void)0,
          OPS->router(OPS, dlg, bias, M, E, k, (float)c->gate_temp, (float)c->route_scale, dsel, dwt, dsc),
          selg, dsel, M * (size_t)k * 4);
    get(wg, dwt, M * (size_t)k * 4);
    get(sg, dsc, M * (size_t)E * 4);
    size_t differ = 0, bad = 0;
    nd = 0;
    const size_t far = ulp_far(sg, sr, M * (size_t)E, 2, 0, &nd);
    for (size_t m = 0; m < M; m++) {
        if (same_bits(selg + m * k, selr + m * k, (size_t)k * 4)) {
            for (int j = 0; j < k; j++)
                if (fabsf(wg[m * k + j] - wr[m * k + j]) > 1e-6f * fabsf(wr[m * k + j])) bad++;
            continue;
        }
        differ++;
        double e = 0;
        for (int j = 0; j < E; j++) e = fmax(e, fabs((double)sg[m * E + j] - sr[m * E + j]));
        if (!set_admissible(selg + m * k, (size_t)k, sr + m * E, (size_t)E, e)) bad++;
    }
    TAP_CHECK(
        far == 0 && bad == 0,
        "%s router (%zu tokens, top %d of %d, the layer's bias): selection scores within 2 fp32 ulp of the "
        "reference (%zu differ), %zu choices differ, all within the score error of the boundary, weights "
        "within "
        "1e-6 (%.1f us)",
        s->name, M, k, E, nd, differ, us);
    dev_release();
    free(g);
    free(u);
    free(rt);
    free(h);
    free(hr);
    free(oe);
    free(sh);
    free(out);
    free(outr);
    free(slot);
    free(lg);
    free(wr);
    free(wg);
    free(sr);
    free(sg);
    free(selr);
    free(selg);
}

static void check_engram_and_rows(const shape *s, const model *md) {
    const ds41_model_config *c = &md->cfg;
    const ds41_layer_weights *le = &md->w.layers[md->Le];
    const size_t M = s->ms[2], D = (size_t)c->dim;
    const int hc = (int)c->hc_mult;
    const size_t HD = (size_t)hc * D;
    float *wqk = xmalloc(HD * 4), *h0 = xmalloc(M * HD * 4), *kv = xmalloc(M * (HD + D) * 4);
    for (size_t i = 0; i < HD; i++) wqk[i] = ds41_bf16_to_f32(le->eng_q[i]) * ds41_bf16_to_f32(le->eng_k[i]);
    fill_bf16(h0, M * HD, 1.0);
    fill_bf16(kv, M * (HD + D), 1.0);
    float *h = xmalloc(M * HD * 4), *hr = xmalloc(M * HD * 4);
    memcpy(hr, h0, M * HD * 4);
    const float ds = (float)pow((double)D, -0.5), eps = (float)c->norm_eps;
    REF->engram_mix(REF, hr, kv, wqk, M, hc, D, eps, ds);
    float *dw = dup_(wqk, HD * 4), *dkv = dup_(kv, M * (HD + D) * 4), *dh = dnew(M * HD * 4);
    double us, e = 0;
    TIMED(us, put(dh, h0, M * HD * 4), OPS->engram_mix(OPS, dh, dkv, dw, M, hc, D, eps, ds), h, dh,
          M * HD * 4);
    size_t nd = 0;
    rel_close(h, hr, M * HD, 2 * 0x1p-8, &e);
    const int ok = bf16_close(h, hr, M * HD, &nd);
    TAP_CHECK(ok,
              "%s engram_mix (%zu rows, hc %d x %zu, the layer's q*k): bf16 outputs within one ulp of the "
              "reference (%zu differ, %.2g) (%.1f us)",
              s->name, M, hc, D, nd, e, us);
    /* embed: rows of the placed table, first and last ids included */
    int32_t *ids = xmalloc(M * 4);
    for (size_t m = 0; m < M; m++)
        ids[m] = m == 0   ? 0
                 : m == 1 ? (int32_t)(c->vocab_size - 1)
                          : (int32_t)((m * 131) % (size_t)c->vocab_size);
    float *em = xmalloc(M * HD * 4), *emr = xmalloc(M * HD * 4), *dem = dnew(M * HD * 4);
    REF->embed(REF, md->w.embed, ids, M, hc, D, emr);
    TIMED(us, (void)0, OPS->embed(OPS, md->w.embed, ids, M, hc, D, dem), em, dem, M * HD * 4);
    TAP_CHECK(same_bits(em, emr, M * HD * 4),
              "%s embed (%zu ids x %d copies of %zu, ids 0 and vocab-1): bit for bit "
              "the reference (%.1f us)",
              s->name, M, hc, D, us);
    /* gather_rows inside backend memory */
    const size_t NR = M + 5, RB = D * 4 + 4;
    uint8_t *src = xmalloc(NR * (RB + 12)), *dst = xmalloc(M * RB), *dstr = xmalloc(M * RB);
    for (size_t i = 0; i < NR * (RB + 12); i++) src[i] = (uint8_t)((urand() + 1.0) * 127.99);
    uint32_t *idx = xmalloc(M * 4);
    for (size_t i = 0; i < M; i++) idx[i] = (uint32_t)((i * 3 + 1) % NR);
    for (size_t i = 0; i < M; i++) memcpy(dstr + i * RB, src + idx[i] * (RB + 12), RB);
    uint8_t *dsrc = dup_(src, NR * (RB + 12)), *ddst = dnew(M * RB);
    TIMED(us, (void)0, OPS->gather_rows(OPS, ddst, dsrc, RB + 12, idx, M, RB), dst, ddst, M * RB);
    TAP_CHECK(same_bits(dst, dstr, M * RB),
              "%s gather_rows (%zu rows of %zu bytes at a stride of %zu): the rows "
              "named, bit for bit (%.1f us)",
              s->name, M, RB, RB + 12, us);
    /* fp8_rows as the forward pass runs it when the Engram rows are streamed (engine/forward/
     * forward.c engram_stream_rows, the CUDA engine's path: the tables are far larger than device
     * memory at the release's size): the step's rows, first and last of the table included,
     * gathered on the host into a compact table in backend memory, read by row ids 0..n-1 (in a
     * shuffled order here).  Backends that compute on host memory (identity placement) also read
     * the bound table in place, the resident path. */
    const size_t cols = (size_t)c->engram_head_dim, sb = (cols + 31) / 32;
    int64_t *rows = xmalloc(M * 8), *ord = xmalloc(M * 8);
    uint8_t *cq = xmalloc(M * cols), *cs = xmalloc(M * sb);
    for (size_t i = 0; i < M; i++) {
        rows[i] = i == 0 ? 0 : i == 1 ? le->eng_rows - 1 : (int64_t)((i * 7717) % (size_t)le->eng_rows);
        ord[i] = (int64_t)((i * 5 + 3) % M);
    }
    for (size_t i = 0; i < M; i++) {
        memcpy(cq + i * cols, le->eng_table + (size_t)rows[ord[i]] * cols, cols);
        memcpy(cs + i * sb, le->eng_table_scale + (size_t)rows[ord[i]] * sb, sb);
    }
    float *fr = xmalloc(M * cols * 4), *frr = xmalloc(M * cols * 4), *dfr = dnew(M * cols * 4);
    REF->fp8_rows(REF, le->eng_table, le->eng_table_scale, rows, M, cols, frr);
    uint8_t *dcq = dup_(cq, M * cols), *dcs = dup_(cs, M * sb);
    int64_t *inv_ord = xmalloc(M * 8);
    for (size_t i = 0; i < M; i++) inv_ord[ord[i]] = (int64_t)i;
    TIMED(us, (void)0, OPS->fp8_rows(OPS, dcq, dcs, inv_ord, M, cols, dfr), fr, dfr, M * cols * 4);
    int ok_rows = same_bits(fr, frr, M * cols * 4);
    if (!BE->place_weights) {
        OPS->fp8_rows(OPS, le->eng_table, le->eng_table_scale, rows, M, cols, dfr);
        get(fr, dfr, M * cols * 4);
        ok_rows &= same_bits(fr, frr, M * cols * 4);
    }
    TAP_CHECK(
        ok_rows,
        "%s fp8_rows (%zu rows of the Engram table, %zu columns, rows 0 and last, gathered into backend "
        "memory%s): bit for bit the reference (%.1f us)",
        s->name, M, cols, BE->place_weights ? "" : "; and the bound table in place", us);
    free(ord);
    free(inv_ord);
    free(cq);
    free(cs);
    dev_release();
    free(wqk);
    free(h0);
    free(kv);
    free(h);
    free(hr);
    free(ids);
    free(em);
    free(emr);
    free(src);
    free(dst);
    free(dstr);
    free(idx);
    free(rows);
    free(fr);
    free(frr);
}

static void run_shape(const shape *s, const char *root) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/%s", root, s->name);
    model md;
    ds41_error err = {{0}};
    const double t0 = now();
    const int loaded = load_model(s, dir, &md, &err) == 0;
    if (!TAP_CHECK(loaded, "%s: checkpoint generated, bound and placed on %s (%s)", s->name, BE->name,
                   loaded ? "ok" : err.msg)) {
        free_model(&md);
        return;
    }
    TAP_NOTE("%s: dim %lld, %lld heads x %lld, window %lld, index %lld x %lld top-%lld, %lld experts of %lld "
             "(%.1f s "
             "to generate and place)",
             s->name, (long long)md.cfg.dim, (long long)md.cfg.n_heads, (long long)md.cfg.head_dim,
             (long long)md.cfg.window_size, (long long)md.cfg.index_n_heads, (long long)md.cfg.index_head_dim,
             (long long)md.cfg.index_topk, (long long)md.cfg.n_routed_experts,
             (long long)md.cfg.moe_inter_dim, now() - t0);
    check_linears(s, &md);
    check_linear_batch(s, &md);
    check_rmsnorm(s, &md);
    check_hc(s, &md);
    check_rope(s, &md);
    check_quantizers(s, &md);
    check_pool(s, &md);
    check_indexer(s, &md);
    check_attention(s, &md);
    check_moe(s, &md);
    check_engram_and_rows(s, &md);
    free_model(&md);
    tmpdir_remove(dir);
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41-opcheck [--backend cpu|cuda-emu|cuda|reference] [--shapes tiny,release] [--reps N]\n"
            "                    [--device N] [--threads N]\n"
            "Every op of the backend against the reference ops on generated weights (TAP on stdout).\n"
            "Exit status: 0 all passed, 1 a check failed, 2 bad arguments, 77 backend not available.\n");
}

int main(int argc, char **argv) {
    const char *backend = "cpu", *shape_list = "tiny";
    int device = 0, threads = 0;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            usage(stderr);
            return 2;
        }
        if (strcmp(a, "--backend") == 0)
            backend = v;
        else if (strcmp(a, "--shapes") == 0)
            shape_list = v;
        else if (strcmp(a, "--reps") == 0)
            REPS = atoi(v) > 0 ? atoi(v) : 1;
        else if (strcmp(a, "--device") == 0)
            device = atoi(v);
        else if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else {
            usage(stderr);
            return 2;
        }
    }
    for (const char *p = shape_list; *p;) {
        const size_t n = strcspn(p, ",");
        int known = 0;
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            known |= strlen(shapes[s].name) == n && strncmp(shapes[s].name, p, n) == 0;
        if (!known) {
            fprintf(stderr, "ds41-opcheck: unknown shape '%.*s' (tiny, release)\n", (int)n, p);
            return 2;
        }
        p += n + (p[n] == ',');
    }
    ds41_error err = {{0}};
    int unavailable = 0;
    BE = check_backend_open(backend, threads, device, &unavailable, &err);
    if (!BE) {
        printf("1..0 # SKIP backend %s: %s\n", backend, err.msg);
        return unavailable ? 77 : 1;
    }
    OPS = &BE->ops;
    MEM = BE->mem;
    TAP_NOTE("backend %s (ops %s, memory %s)", BE->name, OPS->name, MEM->name);
    char root[3000];
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-opcheck-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        ds41_backend_free(BE);
        return tap_done();
    }
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const size_t n = strlen(shapes[s].name);
        for (const char *p = shape_list; *p;) {
            const size_t k = strcspn(p, ",");
            if (k == n && strncmp(p, shapes[s].name, n) == 0) run_shape(&shapes[s], root);
            p += k + (p[k] == ',');
        }
    }
    tmpdir_remove(root);
    ds41_backend_free(BE);
    free(bufs);
    return tap_done();
}
