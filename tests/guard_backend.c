/* The guard backend (tests/guard_backend.h). */
#include "tests/guard_backend.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <execinfo.h>
#endif

/* Address space reserved per guard backend (PROT_NONE, no commit): more than
 * any test checkpoint's activations, KV pool and expert slots. */
#define GUARD_RESERVE ((size_t)64 << 30)

typedef struct extent {
    size_t off, len;
} extent;

typedef struct guard {
    ds41_backend *inner; /* the fast CPU backend whose kernels run */
    ds41_ops inner_ops;  /* its table (ctx: its state) */
    ds41_memory mem;
    unsigned char *base;
    size_t page, high; /* [base, base + high) has been handed out at some time */
    extent *free_list; /* ascending, coalesced, below high */
    size_t n_free, cap_free;
    pthread_mutex_t mu; /* depth, the allocator, the counters */
    int depth;          /* ops / memory calls inside (several threads may be) */
    ds41_guard_stats st;
} guard;

/* ---- the registry (for ds41_guard_owns) ---------------------------------------------- */

#define MAX_GUARDS 64
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static guard *registry[MAX_GUARDS];

static int registry_add(guard *g) {
    pthread_mutex_lock(&registry_mu);
    int rc = -1;
    for (int i = 0; i < MAX_GUARDS && rc; i++)
        if (!registry[i]) registry[i] = g, rc = 0;
    pthread_mutex_unlock(&registry_mu);
    return rc;
}

static void registry_remove(guard *g) {
    pthread_mutex_lock(&registry_mu);
    for (int i = 0; i < MAX_GUARDS; i++)
        if (registry[i] == g) registry[i] = NULL;
    pthread_mutex_unlock(&registry_mu);
}

/* No lock: called from the fault handler (a torn read only weakens the message). */
bool ds41_guard_owns(const void *p) {
    const unsigned char *c = p;
    for (int i = 0; i < MAX_GUARDS; i++) {
        const guard *g = registry[i];
        if (g && c >= g->base && c < g->base + GUARD_RESERVE) return true;
    }
    return false;
}

/* ---- opening and closing the memory ------------------------------------------------------ */

static void protect(guard *g, int prot) {
    if (g->high && mprotect(g->base, g->high, prot) != 0) {
        fprintf(stderr, "guard backend: mprotect: %s\n", strerror(errno));
        abort();
    }
}

static void guard_enter(guard *g, int op) {
    pthread_mutex_lock(&g->mu);
    if (g->depth++ == 0) protect(g, PROT_READ | PROT_WRITE);
    if (op)
        g->st.op_calls++;
    else
        g->st.mem_calls++;
    pthread_mutex_unlock(&g->mu);
}

static void guard_leave(guard *g) {
    pthread_mutex_lock(&g->mu);
    if (--g->depth == 0) protect(g, PROT_NONE);
    pthread_mutex_unlock(&g->mu);
}

/* ---- the allocator: page-granular first fit over the reserved range ------------------------ */

static size_t pages_of(const guard *g, size_t n) {
    return (n + g->page - 1) / g->page * g->page;
}

static int free_insert(guard *g, size_t off, size_t len) {
    if (g->n_free == g->cap_free) {
        const size_t cap = g->cap_free ? 2 * g->cap_free : 64;
        extent *f = realloc(g->free_list, cap * sizeof *f);
        if (!f) return -1;
        g->free_list = f, g->cap_free = cap;
    }
    size_t i = 0;
    while (i < g->n_free && g->free_list[i].off < off) i++;
    memmove(g->free_list + i + 1, g->free_list + i, (g->n_free - i) * sizeof *g->free_list);
    g->free_list[i] = (extent){off, len};
    g->n_free++;
    /* Coalesce with the next, then the previous. */
    if (i + 1 < g->n_free && g->free_list[i].off + g->free_list[i].len == g->free_list[i + 1].off) {
        g->free_list[i].len += g->free_list[i + 1].len;
        memmove(g->free_list + i + 1, g->free_list + i + 2, (g->n_free - i - 2) * sizeof *g->free_list);
        g->n_free--;
    }
    if (i > 0 && g->free_list[i - 1].off + g->free_list[i - 1].len == g->free_list[i].off) {
        g->free_list[i - 1].len += g->free_list[i].len;
        memmove(g->free_list + i, g->free_list + i + 1, (g->n_free - i - 1) * sizeof *g->free_list);
        g->n_free--;
    }
    return 0;
}

/* Fresh pages of a private anonymous mapping read as zero, and freed ones are
 * dropped (MADV_DONTNEED), so alloc hands out zeros without touching them. */
static void *guard_alloc(const ds41_memory *m, size_t n) {
    guard *g = m->ctx;
    if (n == 0) return NULL;
    const size_t len = pages_of(g, n);
    pthread_mutex_lock(&g->mu);
    void *p = NULL;
    for (size_t i = 0; i < g->n_free; i++)
        if (g->free_list[i].len >= len) {
            p = g->base + g->free_list[i].off;
            g->free_list[i].off += len;
            g->free_list[i].len -= len;
            if (g->free_list[i].len == 0) {
                memmove(g->free_list + i, g->free_list + i + 1, (g->n_free - i - 1) * sizeof *g->free_list);
                g->n_free--;
            }
            break;
        }
    if (!p && len <= GUARD_RESERVE - g->high) {
        p = g->base + g->high;
        g->high += len;
        /* The new pages take the range's current protection. */
        if (mprotect(p, len, g->depth ? PROT_READ | PROT_WRITE : PROT_NONE) != 0) abort();
    }
    if (p) {
        g->st.bytes_now += len;
        if (g->st.bytes_now > g->st.bytes_peak) g->st.bytes_peak = g->st.bytes_now;
    }
    pthread_mutex_unlock(&g->mu);
    return p;
}

static void guard_free(const ds41_memory *m, void *p, size_t n) {
    guard *g = m->ctx;
    if (!p) return;
    const size_t len = pages_of(g, n);
    const size_t off = (size_t)((unsigned char *)p - g->base);
    if ((unsigned char *)p < g->base || off % g->page || off + len > g->high) {
        fprintf(stderr, "guard backend: free of %p (%zu bytes) outside its memory\n", p, n);
        abort();
    }
    (void)madvise(p, len, MADV_DONTNEED);
    pthread_mutex_lock(&g->mu);
    if (free_insert(g, off, len) != 0) abort();
    g->st.bytes_now -= len;
    pthread_mutex_unlock(&g->mu);
}

static void guard_move(const ds41_memory *m, void *dst, const void *src, size_t n) {
    guard *g = m->ctx;
    guard_enter(g, 0);
    if (n) memcpy(dst, src, n);
    guard_leave(g);
}

static void guard_copy_2d(const ds41_memory *m, void *dst, size_t dst_pitch, const void *src,
                          size_t src_pitch, size_t width, size_t rows) {
    guard *g = m->ctx;
    guard_enter(g, 0);
    ds41_memory_host.copy_2d(&ds41_memory_host, dst, dst_pitch, src, src_pitch, width, rows);
    guard_leave(g);
}

/* ---- the ops: the fast backend's, with the memory open --------------------------------------- */

/* One wrapper per op of engine/backend/ops.h: a new op must be added here
 * (the assertion fails until it is). */
_Static_assert(sizeof(ds41_ops) == 2 * sizeof(void *) + 24 * sizeof(void (*)(void)),
               "tests/guard_backend.c wraps every op of ds41_ops");

static void guard_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                         ds41_linear_out out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.linear(&gd->inner_ops, w, x, M, y, out);
    guard_leave(gd);
}

static void guard_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                               const float *const *xs, const size_t *Ms, float *const *ys,
                               ds41_linear_out out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.linear_batch(&gd->inner_ops, n, ws, xs, Ms, ys, out);
    guard_leave(gd);
}

static void guard_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n,
                          float eps, float *y) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.rmsnorm(&gd->inner_ops, w, x, M, n, eps, y);
    guard_leave(gd);
}

static void guard_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,
                         const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters,
                         float hc_eps, float *pre, float *post, float *comb) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.hc_mix(&gd->inner_ops, fn, scale, base, h, M, hc, dim, norm_eps, iters, hc_eps, pre, post,
                         comb);
    guard_leave(gd);
}

static void guard_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim,
                         float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.hc_pre(&gd->inner_ops, h, pre, M, hc, dim, out);
    guard_leave(gd);
}

static void guard_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,
                          const float *comb, size_t M, int hc, size_t dim, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.hc_post(&gd->inner_ops, o, h, post, comb, M, hc, dim, out);
    guard_leave(gd);
}

static void guard_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos,
                             size_t M, float *cs) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.rope_table(&gd->inner_ops, freqs, n_pairs, pos, M, cs);
    guard_leave(gd);
}

static void guard_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                       size_t head_stride, int n_pairs, const float *cs, int inverse) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.rope(&gd->inner_ops, x, M, n_heads, row_stride, head_stride, n_pairs, cs, inverse);
    guard_leave(gd);
}

static void guard_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                                size_t out_stride) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.act_quant_fp8(&gd->inner_ops, x, M, n, out, out_stride);
    guard_leave(gd);
}

static void guard_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                              float scale) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.index_query(&gd->inner_ops, q, qn, w, wn, M, scale);
    guard_leave(gd);
}

static void guard_kv_pack(const ds41_ops *self, const ds41_kv_layout *layout, const float *latent,
                          const float *key, size_t n, uint8_t *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.kv_pack(&gd->inner_ops, layout, latent, key, n, out);
    guard_leave(gd);
}

static void guard_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n,
                                int ratio, size_t hd, float *pooled) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.compress_pool(&gd->inner_ops, kv, score, n, ratio, hd, pooled);
    guard_leave(gd);
}

static void guard_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                               int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.index_scores(&gd->inner_ops, q, w, M, n_heads, dim, keys, score, score_stride);
    guard_leave(gd);
}

static void guard_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                               const uint32_t *reach, size_t M, size_t block, size_t n_take, float *bscore,
                               size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.index_blocks(&gd->inner_ops, score, score_stride, reach, M, block, n_take, bscore,
                               bscore_stride, allow, allow_stride);
    guard_leave(gd);
}

static void guard_index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                             size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                             int32_t *sel, uint32_t *count) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.index_topk(&gd->inner_ops, score, score_stride, reach, M, allow, allow_stride, block, k,
                             sel, count);
    guard_leave(gd);
}

static void guard_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim,
                              const float *sink, float scale, const ds41_attn_rows *rows, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.sparse_attn(&gd->inner_ops, q, n_heads, head_dim, sink, scale, rows, out);
    guard_leave(gd);
}

static void guard_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                         const float *sink, float scale, const ds41_attn_step *step, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.attend(&gd->inner_ops, q, M, n_heads, head_dim, sink, scale, step, out);
    guard_leave(gd);
}

static void guard_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n,
                         float limit, const float *route, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.swiglu(&gd->inner_ops, g, u, M, n, limit, route, out);
    guard_leave(gd);
}

static void guard_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                              const float *shared, size_t M, size_t D, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.moe_combine(&gd->inner_ops, oe, slot, k, shared, M, D, out);
    guard_leave(gd);
}

static void guard_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                         float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.router(&gd->inner_ops, logits, bias, M, E, k, gate_temp, route_scale, sel, weight,
                         selection);
    guard_leave(gd);
}

static void guard_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M,
                             int hc, size_t dim, float eps, float dim_scale) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.engram_mix(&gd->inner_ops, h, kv, wqk, M, hc, dim, eps, dim_scale);
    guard_leave(gd);
}

static void guard_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,
                        size_t dim, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.embed(&gd->inner_ops, table, ids, M, hc, dim, out);
    guard_leave(gd);
}

static void guard_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,
                              const uint32_t *idx, size_t n, size_t row_bytes) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.gather_rows(&gd->inner_ops, dst, src, src_stride, idx, n, row_bytes);
    guard_leave(gd);
}

static void guard_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows,
                           size_t n, size_t cols, float *out) {
    guard *gd = self->ctx;
    guard_enter(gd, 1);
    gd->inner_ops.fp8_rows(&gd->inner_ops, q, scale, rows, n, cols, out);
    guard_leave(gd);
}

static const ds41_ops guard_ops_template = {
    .name = "guard",
    .linear = guard_linear,
    .linear_batch = guard_linear_batch,
    .rmsnorm = guard_rmsnorm,
    .hc_mix = guard_hc_mix,
    .hc_pre = guard_hc_pre,
    .hc_post = guard_hc_post,
    .rope_table = guard_rope_table,
    .rope = guard_rope,
    .act_quant_fp8 = guard_act_quant_fp8,
    .index_query = guard_index_query,
    .kv_pack = guard_kv_pack,
    .compress_pool = guard_compress_pool,
    .index_scores = guard_index_scores,
    .index_blocks = guard_index_blocks,
    .index_topk = guard_index_topk,
    .sparse_attn = guard_sparse_attn,
    .attend = guard_attend,
    .swiglu = guard_swiglu,
    .moe_combine = guard_moe_combine,
    .router = guard_router,
    .engram_mix = guard_engram_mix,
    .embed = guard_embed,
    .gather_rows = guard_gather_rows,
    .fp8_rows = guard_fp8_rows,
};

/* ---- the backend -------------------------------------------------------------------------------- */

static ds41_kv_pool *guard_new_pool(ds41_backend *be, const ds41_model_config *cfg, uint64_t budget_bytes,
                                    uint32_t entries_per_page, ds41_error *err) {
    guard *g = be->impl;
    /* The CPU backend's pool in this backend's memory (be->mem). */
    return g->inner->new_pool(be, cfg, budget_bytes, entries_per_page, err);
}

static void guard_stats(ds41_backend *be, ds41_backend_stats *out, bool reset) {
    guard *g = be->impl;
    g->inner->stats(g->inner, out, reset);
}

static void guard_destroy(ds41_backend *be) {
    guard *g = be->impl;
    if (g) {
        registry_remove(g);
        ds41_backend_free(g->inner);
        if (g->base) munmap(g->base, GUARD_RESERVE);
        free(g->free_list);
        pthread_mutex_destroy(&g->mu);
        free(g);
    }
    free(be);
}

ds41_backend *ds41_guard_backend_new(const ds41_cpu_opts *opts, ds41_error *err) {
    ds41_backend *be = calloc(1, sizeof *be);
    guard *g = calloc(1, sizeof *g);
    if (!be || !g) {
        free(be);
        free(g);
        ds41_fail(err, "guard backend: out of memory");
        return NULL;
    }
    pthread_mutex_init(&g->mu, NULL);
    be->impl = g;
    be->destroy = guard_destroy;
    g->page = (size_t)sysconf(_SC_PAGESIZE);
    g->base = mmap(NULL, GUARD_RESERVE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (g->base == MAP_FAILED) {
        g->base = NULL;
        ds41_fail(err, "guard backend: reserving %zu bytes: %s", GUARD_RESERVE, strerror(errno));
        guard_destroy(be);
        return NULL;
    }
    if (registry_add(g) != 0) {
        ds41_fail(err, "guard backend: more than %d alive", MAX_GUARDS);
        guard_destroy(be);
        return NULL;
    }
    g->inner = ds41_backend_cpu_new(opts, err);
    if (!g->inner) {
        guard_destroy(be);
        return NULL;
    }
    g->inner_ops = g->inner->ops;
    g->mem = (ds41_memory){.name = "guard",
                           .ctx = g,
                           .alloc = guard_alloc,
                           .free = guard_free,
                           .upload = guard_move,
                           .download = guard_move,
                           .copy = guard_move,
                           .copy_2d = guard_copy_2d};
    be->name = "guard";
    be->ops = guard_ops_template;
    be->ops.ctx = g;
    be->mem = &g->mem;
    be->place_weights = g->inner->place_weights;
    be->release_weights = g->inner->release_weights;
    be->new_pool = guard_new_pool;
    be->stats = guard_stats;
    return be;
}

void ds41_guard_backend_stats(const ds41_backend *be, ds41_guard_stats *out) {
    guard *g = be->impl;
    pthread_mutex_lock(&g->mu);
    *out = g->st;
    pthread_mutex_unlock(&g->mu);
}

/* ---- the fault handler ------------------------------------------------------------------------------ */

static void on_fault(int sig, siginfo_t *si, void *uc) {
    (void)uc;
    char msg[160];
    const int n = snprintf(msg, sizeof msg, "%s at %p%s\n",
                           ds41_guard_owns(si->si_addr) ? "device_guard: the host touched backend memory"
                                                        : "device_guard: segmentation fault",
                           si->si_addr, ds41_guard_owns(si->si_addr) ? " outside the backend's ops" : "");
    if (n > 0) (void)!write(2, msg, (size_t)n);
#if defined(__GLIBC__)
    void *frames[64];
    backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
#endif
    signal(sig, SIG_DFL);
    raise(sig);
}

void ds41_guard_install_fault_handler(void) {
#if defined(__SANITIZE_ADDRESS__)
    return; /* AddressSanitizer reports the fault with its stack */
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
    return;
#endif
#endif
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, NULL);
    sigaction(SIGBUS, &sa, NULL);
}
