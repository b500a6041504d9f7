/* The forward pass on generated checkpoints (tiny and long presets):
 * prefill(all) = chunks of 1, 3, 7 = token-by-token decode bit for bit,
 * batched decode = separate decode, forks, the packed cache's bytes per
 * token counted in the page pool, page reuse over 1,000 sequences, errors
 * that leave sequences untouched, and checkpoint validation at load.
 *
 * Checkpoints are written with ds41_model_generate into a mkdtemp directory
 * under $TMPDIR (or /tmp) and removed at the end. */
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "engine/model/quant.h"
#include "engine/model/tensor_plan.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static char root[3000];

/* This file tests the reference mode (the fast path: test_fast_forward.c). */
static const ds41_engine_opts ref_opts = {.reference = true};

static uint64_t rng = 0x5deece66dull;
static uint32_t rnd(uint32_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rng >> 33) % n);
}

/* A prompt with repeats (Engram history hits the same n-grams again) and a
 * run of one token (ties in the index scores). */
static int32_t *make_prompt(size_t n, int64_t vocab) {
    int32_t *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = (int32_t)rnd((uint32_t)vocab);
    for (size_t i = 0; i + 8 < n && i < 8; i++) p[n / 2 + i < n ? n / 2 + i : i] = p[i];
    for (size_t i = n / 4; i < n / 4 + 5 && i < n; i++) p[i] = 7;
    return p;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Feed prompt[0..n) to a fresh sequence in chunks of `chunk`, logits of every
 * position into out[n][V]; then K greedy steps into dec_out[K][V] (argmax
 * of the previous logits), tokens into dec_tok.  Returns 0 or -1. */
static int run(ds41_engine *e, ds41_kv_pool *pool, const int32_t *prompt, size_t n, size_t chunk, float *out,
               size_t K, float *dec_out, int32_t *dec_tok) {
    ds41_error err;
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
    if (!s) return -1;
    int rc = 0;
    for (size_t off = 0; off < n && rc == 0; off += chunk) {
        ds41_fwd_item it = {.seq = s, .ids = prompt + off, .n_ids = n - off < chunk ? n - off : chunk, .logits = out + off * V};
        rc = ds41_forward(e, &it, 1, NULL, &err);
    }
    const float *last = out + (n - 1) * V;
    for (size_t k = 0; k < K && rc == 0; k++) {
        dec_tok[k] = ds41_argmax(last, V);
        ds41_fwd_item it = {.seq = s, .ids = &dec_tok[k], .n_ids = 1, .logits = dec_out + k * V};
        rc = ds41_forward(e, &it, 1, NULL, &err);
        last = dec_out + k * V;
    }
    if (rc) TAP_NOTE("forward: %s", err.msg);
    ds41_kv_seq_free(s);
    return rc;
}

static void test_chunking(ds41_engine *e, const char *name, size_t n) {
    const ds41_model_config *c = ds41_engine_config(e);
    const size_t V = (size_t)c->vocab_size, K = 16;
    ds41_error err;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    int32_t *p = make_prompt(n, c->vocab_size);
    float *whole = malloc(n * V * sizeof *whole), *part = malloc(n * V * sizeof *part);
    float *dw = malloc(K * V * sizeof *dw), *dp = malloc(K * V * sizeof *dp);
    int32_t tw[16], tp[16];
    double t0 = now();
    int ok = run(e, pool, p, n, n, whole, K, dw, tw) == 0;
    TAP_NOTE("%s: prefill %zu + %zu decode steps in %.2f s", name, n, K, now() - t0);
    TAP_CHECK(ok, "%s: prefill of %zu tokens and %zu greedy steps run (window %lld, index_topk %lld)", name, n, K,
              (long long)c->window_size, (long long)c->index_topk);
    int finite = 1;
    for (size_t i = 0; i < n * V; i++) finite &= isfinite(whole[i]);
    TAP_CHECK(finite, "%s: every logit is finite", name);
    const size_t chunks[3] = {1, 3, 7};
    for (int ci = 0; ci < 3; ci++) {
        int same = run(e, pool, p, n, chunks[ci], part, K, dp, tp) == 0;
        same = same && memcmp(whole, part, n * V * sizeof *part) == 0;
        same = same && memcmp(tw, tp, sizeof tw) == 0 && memcmp(dw, dp, K * V * sizeof *dp) == 0;
        TAP_CHECK(same, "%s: prefill in chunks of %zu = prefill(all), every position and %zu greedy steps bit for bit%s",
                  name, chunks[ci], K, chunks[ci] == 1 ? " (token-by-token decode)" : "");
    }

    /* Batched decode: two sequences decoded in one call = each alone. */
    int32_t *p2 = make_prompt(n / 2 + 3, c->vocab_size);
    const size_t n2 = n / 2 + 3;
    float *w2 = malloc(n2 * V * sizeof *w2), *d2 = malloc(K * V * sizeof *d2);
    int32_t t2[16];
    ok = run(e, pool, p2, n2, n2, w2, K, d2, t2) == 0;
    ds41_kv_seq *a = ds41_kv_seq_new(pool, &err), *b = ds41_kv_seq_new(pool, &err);
    float *la = malloc(n * V * sizeof *la), *lb = malloc(n2 * V * sizeof *lb);
    ds41_fwd_item pre[2] = {{.seq = a, .ids = p, .n_ids = n, .logits = la}, {.seq = b, .ids = p2, .n_ids = n2, .logits = lb}};
    ok = ok && ds41_forward(e, pre, 2, NULL, &err) == 0; /* two prompts in one batch */
    ok = ok && memcmp(la, whole, n * V * sizeof *la) == 0 && memcmp(lb, w2, n2 * V * sizeof *lb) == 0;
    TAP_CHECK(ok, "%s: two prompts prefilled in one batch = each alone", name);
    int same = ok;
    float *ga = malloc(V * sizeof *ga), *gb = malloc(V * sizeof *gb);
    for (size_t k = 0; k < K && same; k++) {
        ds41_fwd_item dec[2] = {{.seq = a, .ids = &tw[k], .n_ids = 1, .logits = ga},
                                {.seq = b, .ids = &t2[k], .n_ids = 1, .logits = gb}};
        same = ds41_forward(e, dec, 2, NULL, &err) == 0 && memcmp(ga, dw + k * V, V * sizeof *ga) == 0 &&
               memcmp(gb, d2 + k * V, V * sizeof *gb) == 0;
    }
    TAP_CHECK(same, "%s: %zu decode steps batched across two sequences = each decoded alone", name, K);

    /* Fork: a prefix, forked, continued two ways = fresh sequences. */
    ds41_kv_seq *f0 = ds41_kv_seq_new(pool, &err);
    const size_t pre_n = n / 2 + 1;
    float *scratch = malloc(n * V * sizeof *scratch);
    ds41_fwd_item it0 = {.seq = f0, .ids = p, .n_ids = pre_n, .logits = NULL};
    ok = ds41_forward(e, &it0, 1, NULL, &err) == 0;
    ds41_kv_pool_stats st0, st1;
    ds41_kv_pool_get_stats(pool, &st0);
    ds41_kv_seq *f1 = ds41_kv_seq_fork(f0, &err);
    ds41_kv_pool_get_stats(pool, &st1);
    ok = ok && f1 && st1.pages_in_use == st0.pages_in_use;
    /* f0 continues with the prompt; f1 with the prompt's tail reversed. */
    int32_t *alt = malloc(n * sizeof *alt);
    for (size_t i = 0; i < n; i++) alt[i] = i < pre_n ? p[i] : p[n - 1 - (i - pre_n)];
    float *alt_whole = malloc(n * V * sizeof *alt_whole);
    ok = ok && run(e, pool, alt, n, n, alt_whole, 0, NULL, NULL) == 0;
    ds41_fwd_item c0 = {.seq = f0, .ids = p + pre_n, .n_ids = n - pre_n, .logits = scratch};
    ds41_fwd_item c1 = {.seq = f1, .ids = alt + pre_n, .n_ids = n - pre_n, .logits = scratch + (n - pre_n) * V};
    ds41_fwd_item both[2] = {c0, c1};
    ok = ok && ds41_forward(e, both, 2, NULL, &err) == 0;
    ok = ok && memcmp(scratch, whole + pre_n * V, (n - pre_n) * V * sizeof *scratch) == 0 &&
         memcmp(scratch + (n - pre_n) * V, alt_whole + pre_n * V, (n - pre_n) * V * sizeof *scratch) == 0;
    TAP_CHECK(ok, "%s: a forked sequence shares its pages and both branches continue exactly", name);

    ds41_kv_seq_free(a);
    ds41_kv_seq_free(b);
    ds41_kv_seq_free(f0);
    ds41_kv_seq_free(f1);
    ds41_kv_pool_get_stats(pool, &st1);
    TAP_CHECK(st1.pages_in_use == 0 && st1.sequences == 0, "%s: every page is back in the pool", name);
    ds41_kv_pool_free(pool);
    free(p);
    free(p2);
    free(whole);
    free(part);
    free(dw);
    free(dp);
    free(w2);
    free(d2);
    free(la);
    free(lb);
    free(ga);
    free(gb);
    free(scratch);
    free(alt);
    free(alt_whole);
}

static void test_cache(ds41_engine *e) {
    const ds41_model_config *c = ds41_engine_config(e);
    ds41_error err;
    const size_t N = 37;
    int32_t *p = make_prompt(N, c->vocab_size);

    /* One entry per page: pages in use x page size is exactly the packed
     * bytes of N tokens: per kv source floor(N/ratio) x (latent FP4 + e4m3
     * scales, index key FP4 + ue8m0 scales). */
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 1, &err);
    ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
    ds41_fwd_item it = {.seq = s, .ids = p, .n_ids = N};
    int ok = ds41_forward(e, &it, 1, NULL, &err) == 0;
    ds41_kv_pool_stats st;
    ds41_kv_pool_get_stats(pool, &st);
    uint64_t lat = 0, key = 0;
    uint64_t want = ds41_model_config_cache_bytes_for_tokens(c, N, &lat, &key);
    ds41_cache_rate rate = ds41_model_config_cache_rate(c);
    /* The same figure by hand from the layout of REFERENCE §1.5-1.6. */
    const ds41_kv_layout *l1 = ds41_kv_pool_layout(pool);
    uint64_t manual = 0;
    for (int src = 0; src < l1->n_sources; src++)
        manual += (N / (uint64_t)l1->source_ratio[src]) *
                  (uint64_t)(c->head_dim / 2 + c->head_dim / 16 + c->index_head_dim / 2 + c->index_head_dim / 32);
    TAP_CHECK(ok && st.pages_in_use * st.page_bytes == want && want == manual,
              "after %zu tokens the pool holds %llu pages x %llu B = %llu B = the config's rate (%llu B per %llu "
              "tokens)",
              N, (unsigned long long)st.pages_in_use, (unsigned long long)st.page_bytes,
              (unsigned long long)(st.pages_in_use * st.page_bytes), (unsigned long long)rate.total_bytes,
              (unsigned long long)rate.per_tokens);
    TAP_CHECK(ds41_kv_seq_page_bytes(s) == want && lat + key == want, "the sequence's pages hold %llu latent + %llu index-key bytes",
              (unsigned long long)lat, (unsigned long long)key);
    /* Decoding 3 more tokens grows it by exactly their entries. */
    int32_t more[3] = {1, 2, 3};
    ok = 1;
    for (int k = 0; k < 3; k++) {
        ds41_fwd_item d = {.seq = s, .ids = &more[k], .n_ids = 1};
        ok &= ds41_forward(e, &d, 1, NULL, &err) == 0;
    }
    ds41_kv_pool_get_stats(pool, &st);
    TAP_CHECK(ok && st.bytes_in_use == ds41_model_config_cache_bytes_for_tokens(c, N + 3, NULL, NULL),
              "decode steps add exactly their packed entries");
    ds41_kv_seq_free(s);
    ds41_kv_pool_free(pool);

    /* Default pages (64 entries): whole pages, at most one partly filled per source. */
    pool = ds41_engine_new_pool(e, 0, 0, &err);
    s = ds41_kv_seq_new(pool, &err);
    it.seq = s;
    ok = ds41_forward(e, &it, 1, NULL, &err) == 0;
    ds41_kv_pool_get_stats(pool, &st);
    const ds41_kv_layout *l = ds41_kv_pool_layout(pool);
    uint64_t pages = 0;
    for (int src = 0; src < l->n_sources; src++)
        pages += (N / (uint64_t)l->source_ratio[src] + l->entries_per_page - 1) / l->entries_per_page;
    TAP_CHECK(ok && st.pages_in_use == pages && st.bytes_in_use == pages * l->page_bytes,
              "with %u-entry pages: %llu pages in use", l->entries_per_page, (unsigned long long)pages);
    ds41_kv_seq_free(s);

    /* 1,000 short sequences: pages come back and are reused, the pool does
     * not grow after the first. */
    ds41_kv_pool_stats first = {0};
    ok = 1;
    double t0 = now();
    for (int i = 0; i < 1000 && ok; i++) {
        ds41_kv_seq *q = ds41_kv_seq_new(pool, &err);
        ds41_fwd_item qi = {.seq = q, .ids = p + (i % 30), .n_ids = 2}; /* one entry per source */
        ok &= q && ds41_forward(e, &qi, 1, NULL, &err) == 0;
        ds41_kv_pool_get_stats(pool, &st);
        if (i == 0) first = st;
        ok &= st.pages_allocated == first.pages_allocated && st.pages_in_use == (uint64_t)l->n_sources;
        ds41_kv_seq_free(q);
        ds41_kv_pool_get_stats(pool, &st);
        ok &= st.pages_in_use == 0;
    }
    TAP_NOTE("1000 sequences in %.2f s", now() - t0);
    TAP_CHECK(ok, "1,000 short sequences: pages reused, pool stays at %llu allocated pages",
              (unsigned long long)first.pages_allocated);

    /* A budget too small for a prompt: refused before anything changes. */
    const uint64_t entry_bytes = l->entry_bytes;
    ds41_kv_pool_free(pool);
    pool = ds41_engine_new_pool(e, 10 * entry_bytes, 1, &err); /* 10 one-entry pages */
    s = ds41_kv_seq_new(pool, &err);
    it.seq = s;
    int rc = ds41_forward(e, &it, 1, NULL, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "KV cache full") && ds41_kv_seq_tokens(s) == 0 && ds41_kv_seq_pages(s) == 0,
              "a prompt that does not fit the budget is refused, the sequence untouched (%s)", err.msg);
    ds41_kv_seq_free(s);
    ds41_kv_pool_free(pool);
    free(p);
}

static void test_errors_and_hooks(ds41_engine *e) {
    const ds41_model_config *c = ds41_engine_config(e);
    ds41_error err;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
    int32_t bad[2] = {1, (int32_t)c->vocab_size};
    ds41_fwd_item it = {.seq = s, .ids = bad, .n_ids = 2};
    int rc = ds41_forward(e, &it, 1, NULL, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "outside") && ds41_kv_seq_tokens(s) == 0 &&
                  ds41_kv_seq_engram(s)->n_pushed == 0,
              "an id outside the vocabulary is refused before any state changes (%s)", err.msg);
    int32_t ok_ids[2] = {1, 2};
    ds41_fwd_item twice[2] = {{.seq = s, .ids = ok_ids, .n_ids = 1}, {.seq = s, .ids = ok_ids + 1, .n_ids = 1}};
    rc = ds41_forward(e, twice, 2, NULL, &err);
    TAP_CHECK(rc != 0 && strstr(err.msg, "share"), "a sequence twice in one batch is refused");
    rc = ds41_forward(e, twice, 0, NULL, &err);
    ds41_fwd_item empty = {.seq = s, .ids = ok_ids, .n_ids = 0};
    int rc2 = ds41_forward(e, &empty, 1, NULL, &err);
    TAP_CHECK(rc != 0 && rc2 != 0, "an empty batch and an empty chunk are refused");

    float tie[5] = {1.0f, 3.0f, -2.0f, 3.0f, NAN};
    float nanfirst[3] = {NAN, -1.0f, -1.0f};
    TAP_CHECK(ds41_argmax(tie, 5) == 1 && ds41_argmax(nanfirst, 3) == 1, "argmax: lowest id on ties, NaN never wins");
    ds41_kv_seq_free(s);
    ds41_kv_pool_free(pool);
}

typedef struct hook_ctx {
    size_t D, hc, V;
    float *h0;     /* [rows][hc][D] stream entering block 0 */
    float *logits; /* [rows][V] */
    int pre_onehot;
    int calls_attn;
    int calls_feed;
    int n_layers;
} hook_ctx;

static void hook(void *ctxp, ds41_stream_kind kind, int layer, size_t item, size_t row, const float *data, size_t n) {
    hook_ctx *h = ctxp;
    (void)item;
    if (kind == DS41_STREAM_H && layer == 0) memcpy(h->h0 + row * n, data, n * sizeof *data);
    if (kind == DS41_STREAM_PRE && layer == 0) h->pre_onehot &= data[0] == 1.0f && data[1] == 0.0f;
    if (kind == DS41_STREAM_ATTN) h->calls_attn++;
    if (kind == DS41_STREAM_LOGITS) memcpy(h->logits + row * n, data, n * sizeof *data);
}

/* Feed hook: zero the stream entering the last block. */
static void feed_zero(void *ctxp, int layer, size_t item, size_t row, float *hs, float *pre) {
    hook_ctx *h = ctxp;
    (void)item, (void)row, (void)pre;
    h->calls_feed++;
    if (layer == h->n_layers - 1) memset(hs, 0, h->hc * h->D * sizeof *hs);
}

static void test_hooks(ds41_engine *e) {
    const ds41_model_config *c = ds41_engine_config(e);
    const size_t D = (size_t)c->dim, hc = (size_t)c->hc_mult, V = (size_t)c->vocab_size, n = 5;
    ds41_error err;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
    int32_t ids[5] = {3, 1, 4, 1, 5};
    hook_ctx h = {.D = D, .hc = hc, .V = V, .pre_onehot = 1, .n_layers = (int)c->n_layers};
    h.h0 = malloc(n * hc * D * sizeof(float));
    h.logits = malloc(n * V * sizeof(float));
    float *lg = malloc(n * V * sizeof *lg);
    ds41_fwd_hooks hooks = {.stream = hook, .ctx = &h};
    ds41_fwd_item it = {.seq = s, .ids = ids, .n_ids = n, .logits = lg};
    int ok = ds41_forward(e, &it, 1, &hooks, &err) == 0;
    const ds41_weights *w = ds41_engine_weights(e);
    int emb = 1;
    for (size_t r = 0; r < n; r++)
        for (size_t cp = 0; cp < hc; cp++)
            for (size_t d = 0; d < D; d++)
                emb &= h.h0[(r * hc + cp) * D + d] == ds41_bf16_to_f32(w->embed[(size_t)ids[r] * D + d]);
    TAP_CHECK(ok && emb && h.pre_onehot, "hooks: block 0 sees the embedding in every copy and the one-hot pre-mix");
    TAP_CHECK(h.calls_attn == (int)(n * (size_t)c->n_layers) && memcmp(h.logits, lg, n * V * sizeof *lg) == 0,
              "hooks: one attention stream per row and layer, logits as returned");
    /* Only the last position's logits when asked. */
    ds41_kv_seq *s2 = ds41_kv_seq_new(pool, &err);
    float *last = malloc(V * sizeof *last);
    ds41_fwd_item it2 = {.seq = s2, .ids = ids, .n_ids = n, .logits = last, .logits_last_only = true};
    ok = ds41_forward(e, &it2, 1, NULL, &err) == 0;
    TAP_CHECK(ok && memcmp(last, lg + (n - 1) * V, V * sizeof *last) == 0, "logits_last_only gives the last row");
    /* Teacher forcing: what feed writes is what the block computes from
     * (ds41-eval --replay and the layer-local checks depend on it), on
     * whatever memory the backend keeps the stream in. */
    float *fed = malloc(n * V * sizeof *fed);
    ds41_fwd_hooks zero_hooks = {.feed = feed_zero, .ctx = &h};
    ds41_kv_seq *s3 = ds41_kv_seq_new(pool, &err);
    ds41_fwd_item it3 = {.seq = s3, .ids = ids, .n_ids = n, .logits = fed};
    h.calls_feed = 0;
    ok = ds41_forward(e, &it3, 1, &zero_hooks, &err) == 0;
    int finite = 1;
    for (size_t i = 0; i < n * V; i++) finite &= isfinite(fed[i]);
    TAP_CHECK(ok && finite && h.calls_feed == (int)(n * (size_t)c->n_layers) &&
                  memcmp(fed, lg, n * V * sizeof *lg) != 0,
              "hooks: feed is called per row and block, and a stream it zeroes changes the logits (%d calls)",
              h.calls_feed);
    free(fed);
    ds41_kv_seq_free(s3);
    free(last);
    free(h.h0);
    free(h.logits);
    free(lg);
    ds41_kv_seq_free(s);
    ds41_kv_seq_free(s2);
    ds41_kv_pool_free(pool);
}

/* A backend that wraps the reference and counts calls: the forward pass
 * goes through the op table (the seam for the fast CPU and CUDA backends). */
static long counted_linear, counted_attn;
static void counting_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M, float *y,
                            ds41_linear_out out) {
    counted_linear++;
    ds41_ops_reference.linear(self, w, x, M, y, out);
}
static void counting_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim, const float *sink,
                          float scale, const ds41_attn_rows *rows, float *out) {
    counted_attn++;
    ds41_ops_reference.sparse_attn(self, q, n_heads, head_dim, sink, scale, rows, out);
}

static void test_backend(const char *dir) {
    ds41_ops counting = ds41_ops_reference;
    counting.name = "counting";
    counting.linear = counting_linear;
    counting.sparse_attn = counting_attn;
    ds41_error err;
    ds41_engine_opts opts = {.reference = false, .backend = ds41_backend_from_ops(&counting, &err)};
    ds41_engine *a = ds41_engine_load(dir, &ref_opts, &err), *b = ds41_engine_load(dir, &opts, &err);
    int ok = a && b && strcmp(ds41_engine_ops(b)->name, "counting") == 0;
    const size_t V = ok ? (size_t)ds41_engine_config(a)->vocab_size : 1;
    float *la = malloc(4 * V * sizeof *la), *lb = malloc(4 * V * sizeof *lb);
    int32_t ids[4] = {9, 8, 7, 6};
    for (int k = 0; k < 2 && ok; k++) {
        ds41_engine *e = k ? b : a;
        ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
        ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
        ds41_fwd_item it = {.seq = s, .ids = ids, .n_ids = 4, .logits = k ? lb : la};
        ok = ds41_forward(e, &it, 1, NULL, &err) == 0;
        ds41_kv_seq_free(s);
        ds41_kv_pool_free(pool);
    }
    TAP_CHECK(ok && counted_linear > 0 && counted_attn == 4 * ds41_engine_config(a)->n_layers &&
                  memcmp(la, lb, 4 * V * sizeof *la) == 0,
              "a backend given in the options carries the pass (%ld linear, %ld attention calls), same logits",
              counted_linear, counted_attn);
    free(la);
    free(lb);
    ds41_engine_free(a);
    ds41_engine_free(b);
}

/* Rewrite DIR/inference/config.json with one key changed. */
static int edit_config(const char *dir, const char *key, const char *value) {
    ds41_model_config cfg;
    ds41_error err;
    if (ds41_model_config_load(dir, &cfg, &err) != 0) return -1;
    int rc = ds41_model_config_set(&cfg, key, value, &err);
    if (rc == 0) rc = ds41_model_config_finalize(&cfg, &err);
    char path[4200];
    snprintf(path, sizeof path, "%s/inference/config.json", dir);
    FILE *f = rc == 0 ? fopen(path, "w") : NULL;
    if (f) {
        rc = ds41_model_config_write_json(&cfg, f, &err);
        fclose(f);
    } else {
        rc = -1;
    }
    ds41_model_config_free(&cfg);
    return rc;
}

static void test_load_errors(const char *dir) {
    ds41_error err;
    /* Layer 3 as an extra index source: its indexer tensors are missing. */
    int ok = edit_config(dir, "index_source_layers", "[2, 3, 5, 7]") == 0;
    ds41_engine *e = ds41_engine_load(dir, &ref_opts, &err);
    TAP_CHECK(ok && !e && strstr(err.msg, "layers.3.attn.indexer.wq_b.weight") && strstr(err.msg, "missing"),
              "load names a missing tensor (%s)", err.msg);
    ds41_engine_free(e);
    ok = edit_config(dir, "index_source_layers", "[2, 5, 7]") == 0 && edit_config(dir, "q_lora_rank", "96") == 0;
    e = ds41_engine_load(dir, &ref_opts, &err);
    TAP_CHECK(ok && !e && strstr(err.msg, "shape") && strstr(err.msg, "attn.q_norm.weight"),
              "load names a tensor with the wrong shape (%s)", err.msg);
    ds41_engine_free(e);
    ok = edit_config(dir, "q_lora_rank", "64") == 0 && edit_config(dir, "engram_compressed_vocab_size", "5") == 0;
    e = ds41_engine_load(dir, &ref_opts, &err);
    TAP_CHECK(ok && !e && strstr(err.msg, "engram_compressed_vocab_size"),
              "load checks the tokenizer's Engram token map against the config (%s)", err.msg);
    ds41_engine_free(e);
}

static ds41_engine *make(const char *preset, uint64_t seed, char *dir_out) {
    snprintf(dir_out, 4096, "%s/%s", root, preset);
    ds41_model_gen_opts o = {.preset = preset, .seed = seed};
    ds41_error err;
    if (ds41_model_generate(dir_out, &o, NULL, &err) != 0) {
        TAP_NOTE("generate %s: %s", preset, err.msg);
        return NULL;
    }
    ds41_engine *e = ds41_engine_load(dir_out, &ref_opts, &err);
    if (!e) TAP_NOTE("load %s: %s", preset, err.msg);
    return e;
}

int main(void) {
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-test-forward-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir_tiny[4096], dir_long[4096];
    ds41_engine *tiny = make("tiny", 11, dir_tiny);
    if (TAP_CHECK(tiny != NULL, "tiny checkpoint generated and loaded")) {
        const ds41_weights *w = ds41_engine_weights(tiny);
        const ds41_model_config *c = ds41_engine_config(tiny);
        uint64_t wo_a = 0;
        for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers; l++)
            if (c->roles[l].present) wo_a += (uint64_t)(c->o_groups * c->o_lora_rank) * (uint64_t)(c->n_heads * c->head_dim / c->o_groups) * 2;
        TAP_CHECK(w->n_unplanned == 0 && w->copied_bytes == wo_a && w->n_bound > 0,
                  "tiny: %zu tensors bound (DSpark included), only wo_a copied (%llu bytes)", w->n_bound,
                  (unsigned long long)w->copied_bytes);
        test_chunking(tiny, "tiny", 48);
        test_cache(tiny);
        test_errors_and_hooks(tiny);
        test_hooks(tiny);
    }
    ds41_engine_free(tiny);
    test_backend(dir_tiny);
    test_load_errors(dir_tiny);

    /* Vision tensors (and DSpark stages) are bound and checked though the
     * text forward pass does not run them. */
    {
        static const char *const vis[] = {"vision_n_layers=1",     "vision_dim=64",        "vision_n_heads=4",
                                          "vision_inter_dim=96",   "vision_patch_size=14", "vision_downsample_ratio=2",
                                          "vision_max_n_token=64", "vision_min_pixels=3136"};
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/vision", root);
        ds41_model_gen_opts o = {.preset = "tiny", .seed = 5, .sets = vis, .n_sets = 8};
        ds41_error err;
        ds41_model_config cfg;
        const int generated = ds41_model_generate(dir, &o, &cfg, &err) == 0;
        int ok = generated;
        ds41_engine *ve = ok ? ds41_engine_load(dir, &ref_opts, &err) : NULL;
        ds41_tensor_plan plan = {0};
        ok = ok && ve && ds41_tensor_plan_build(&cfg, &plan, &err) == 0;
        size_t n_vision = 0, n_dspark = 0;
        for (size_t i = 0; ok && i < plan.n; i++) {
            n_vision += plan.t[i].kind == DS41_KIND_VISION;
            n_dspark += plan.t[i].kind == DS41_KIND_DSPARK;
        }
        const ds41_weights *w = ve ? ds41_engine_weights(ve) : NULL;
        TAP_CHECK(ok && w->n_bound == plan.n && w->n_unplanned == 0 && n_vision > 0 && n_dspark > 0,
                  "a checkpoint with vision and DSpark loads: all %zu planned tensors checked (%zu vision, %zu "
                  "DSpark)%s%s",
                  plan.n, n_vision, n_dspark, ok ? "" : ": ", ok ? "" : err.msg);
        if (ok) {
            ds41_kv_pool *pool = ds41_engine_new_pool(ve, 0, 0, &err);
            ds41_kv_seq *s = ds41_kv_seq_new(pool, &err);
            int32_t ids[3] = {1, 2, 3};
            ds41_fwd_item it = {.seq = s, .ids = ids, .n_ids = 3};
            TAP_CHECK(ds41_forward(ve, &it, 1, NULL, &err) == 0, "and runs the text forward pass");
            ds41_kv_seq_free(s);
            ds41_kv_pool_free(pool);
        }
        ds41_tensor_plan_free(&plan);
        if (generated) ds41_model_config_free(&cfg);
        ds41_engine_free(ve);
    }

    ds41_engine *lng = make("long", 12, dir_long);
    if (TAP_CHECK(lng != NULL, "long checkpoint generated and loaded")) test_chunking(lng, "long", 140);
    ds41_engine_free(lng);

    tmpdir_remove(root);
    return tap_done();
}
