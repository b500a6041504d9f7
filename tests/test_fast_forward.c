/* Batch and chunk invariance of the fast CPU path (engine/backend/cpu/cpu_backend.h), on
 * generated tiny and long checkpoints: a sequence's logits are bit-identical
 * whether it runs alone, in decode batches of 4 and 16 with different
 * companions (other prompts, other lengths, other positions), with its prompt
 * prefilled whole, in chunks of 1 (token by token) or 7, or together with
 * other prompts; with one thread or two; at the best SIMD level and at the
 * scalar level.  Also: the default engine is the fast path, --reference is
 * not, and the backend's counters see the weights a step touches.
 *
 * DS41_TEST_BACKEND=cuda (or cuda-emu, or any name tests/gpu/backend_open.h knows) runs the same
 * invariance on that backend instead (tests/gpu/check.sh on a GPU; exit 77 where this build cannot
 * open it), and a session snapshot taken on the fast CPU backend restored on it: the restored state
 * reads back byte for byte, continues like the CPU run within the layer check's logits tolerance,
 * and a snapshot taken on the backend continues there exactly like the uninterrupted run. */
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/forward/forward.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"
#include "tests/gpu/backend_open.h"
#include "tests/op_bounds.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char root[3000];

/* DS41_TEST_BACKEND: the backend the invariance runs on (NULL: the fast CPU backend). */
static const char *test_backend;

/* Engine options: the fast CPU backend with `threads`, or a fresh test_backend instance. */
static int engine_opts(ds41_engine_opts *o, int threads, ds41_error *err) {
    memset(o, 0, sizeof *o);
    o->cpu.threads = threads;
    if (!test_backend) return 0;
    int unavailable = 0;
    o->backend = check_backend_open(test_backend, threads, 0, &unavailable, err);
    return o->backend ? 0 : -1;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;
static int32_t rnd(int64_t n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((rng >> 33) % (uint64_t)n);
}

static int32_t *make_prompt(size_t n, int64_t vocab) {
    int32_t *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = rnd(vocab);
    for (size_t i = 0; i + 8 < n && i < 8; i++)
        p[n / 2 + i < n ? n / 2 + i : i] = p[i];                  /* repeated n-grams */
    for (size_t i = n / 4; i < n / 4 + 5 && i < n; i++) p[i] = 7; /* index-score ties */
    return p;
}

/* The target sequence's results: prefill logits of every position and the
 * logits of K greedy steps. */
typedef struct trace {
    float *prefill; /* [n][V] */
    float *dec;     /* [K][V] */
    int32_t tok[16];
} trace;

#define STEPS 6

/* Prefill the target in chunks of `chunk`, companions (n_comp prompts of
 * their own) prefilled in the same calls as the target's first chunk, then
 * STEPS greedy steps in which every sequence decodes its own argmax, all in
 * one forward call per step. */
static int run(ds41_engine *e, const int32_t *prompt, size_t n, size_t chunk, int32_t **comp,
               const size_t *comp_n, size_t n_comp, trace *out) {
    ds41_error err;
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    const size_t S = 1 + n_comp;
    ds41_kv_seq **seq = calloc(S, sizeof *seq);
    ds41_fwd_item *it = calloc(S, sizeof *it);
    float *cl = malloc(S * V * sizeof *cl);
    int32_t *tok = malloc(S * sizeof *tok);
    int rc = pool && seq && it && cl && tok ? 0 : -1;
    for (size_t s = 0; s < S && rc == 0; s++)
        if (!(seq[s] = ds41_kv_seq_new(pool, &err))) rc = -1;
    /* Prefill: the target's chunks; the companions ride along with its first. */
    for (size_t off = 0; off < n && rc == 0; off += chunk) {
        size_t k = 0;
        it[k++] = (ds41_fwd_item){.seq = seq[0],
                                  .ids = prompt + off,
                                  .n_ids = n - off < chunk ? n - off : chunk,
                                  .logits = out->prefill + off * V};
        if (off == 0)
            for (size_t c = 0; c < n_comp; c++)
                it[k++] = (ds41_fwd_item){.seq = seq[1 + c],
                                          .ids = comp[c],
                                          .n_ids = comp_n[c],
                                          .logits = cl + (1 + c) * V,
                                          .logits_last_only = true};
        rc = ds41_forward(e, it, k, NULL, &err);
    }
    if (rc == 0) memcpy(cl, out->prefill + (n - 1) * V, V * sizeof *cl);
    for (size_t k = 0; k < STEPS && rc == 0; k++) {
        for (size_t s = 0; s < S; s++) {
            tok[s] = ds41_argmax(cl + s * V, V);
            it[s] = (ds41_fwd_item){
                .seq = seq[s], .ids = &tok[s], .n_ids = 1, .logits = s ? cl + s * V : out->dec + k * V};
        }
        out->tok[k] = tok[0];
        rc = ds41_forward(e, it, S, NULL, &err);
        if (rc == 0) memcpy(cl, out->dec + k * V, V * sizeof *cl);
    }
    if (rc) TAP_NOTE("forward: %s", err.msg);
    if (seq)
        for (size_t s = 0; s < S; s++) ds41_kv_seq_free(seq[s]);
    ds41_kv_pool_free(pool);
    free(seq);
    free(it);
    free(cl);
    free(tok);
    return rc;
}

static int same(const trace *a, const trace *b, size_t n, size_t V) {
    return memcmp(a->prefill, b->prefill, n * V * sizeof(float)) == 0 &&
           memcmp(a->dec, b->dec, STEPS * V * sizeof(float)) == 0 &&
           memcmp(a->tok, b->tok, sizeof a->tok) == 0;
}

static void trace_alloc(trace *t, size_t n, size_t V) {
    memset(t, 0, sizeof *t);
    t->prefill = calloc(n * V, sizeof(float));
    t->dec = calloc(STEPS * V, sizeof(float));
}

static void trace_free(trace *t) {
    free(t->prefill);
    free(t->dec);
}

static void test_invariance(const char *dir, const char *name, size_t n, int all_levels) {
    ds41_error err = {{0}};
    ds41_engine_opts o2, o1;
    ds41_engine *e = engine_opts(&o2, 2, &err) == 0 ? ds41_engine_load(dir, &o2, &err) : NULL;
    ds41_engine *e1 = e && engine_opts(&o1, 1, &err) == 0 ? ds41_engine_load(dir, &o1, &err) : NULL;
    if (!TAP_CHECK(e && e1, "%s: engines load (%s)", name, e ? ds41_engine_backend(e)->name : err.msg)) {
        ds41_engine_free(e);
        ds41_engine_free(e1);
        return;
    }
    const int64_t vocab = ds41_engine_config(e)->vocab_size;
    const size_t V = (size_t)vocab;
    int32_t *p = make_prompt(n, vocab);
    int32_t *comp[15];
    size_t comp_n[15];
    for (int c = 0; c < 15; c++) {
        comp_n[c] = 1 + (size_t)rnd((int64_t)n + 20);
        comp[c] = make_prompt(comp_n[c], vocab);
    }
    trace alone, t;
    trace_alloc(&alone, n, V);
    trace_alloc(&t, n, V);
    int ok = run(e, p, n, n, NULL, NULL, 0, &alone) == 0;
    int finite = ok;
    for (size_t i = 0; ok && i < n * V; i++) finite &= isfinite(alone.prefill[i]);
    TAP_CHECK(ok && finite, "%s: %zu-token prompt + %d greedy steps alone, every logit finite", name, n,
              STEPS);

    const size_t chunks[2] = {1, 7};
    for (int ci = 0; ci < 2; ci++) {
        ok = run(e, p, n, chunks[ci], NULL, NULL, 0, &t) == 0 && same(&alone, &t, n, V);
        TAP_CHECK(ok,
                  "%s: prompt in chunks of %zu = whole, every position and every greedy step bit for bit%s",
                  name, chunks[ci], chunks[ci] == 1 ? " (token-by-token decode)" : "");
    }
    ok = run(e, p, n, n, comp, comp_n, 3, &t) == 0 && same(&alone, &t, n, V);
    TAP_CHECK(
        ok, "%s: batch of 4 (3 other prompts, prefilled together, then decoded together) = alone bit for bit",
        name);
    ok = run(e, p, n, n, comp, comp_n, 15, &t) == 0 && same(&alone, &t, n, V);
    TAP_CHECK(ok, "%s: batch of 16 = alone bit for bit", name);
    ok = run(e, p, n, 7, comp + 4, comp_n + 4, 11, &t) == 0 && same(&alone, &t, n, V);
    TAP_CHECK(ok, "%s: chunks of 7 beside 11 other sequences, then a batch of 12 = alone bit for bit", name);
    ok = run(e1, p, n, 5, comp, comp_n, 3, &t) == 0 && same(&alone, &t, n, V);
    TAP_CHECK(ok, "%s: %s (chunks of 5, batch of 4) = the first bit for bit", name,
              test_backend ? "a second instance of the backend" : "one thread");

    /* The counters: a decode step touches at least the head and the
     * attention weights, more with more sequences (more experts). */
    ds41_backend *be = ds41_engine_backend(e);
    ds41_backend_stats st = {0};
    if (be->stats) {
        be->stats(be, &st, true);
        TAP_CHECK(st.weight_bytes > 0 && st.flops > 0,
                  "%s: the backend counted %llu weight bytes and %llu flops", name,
                  (unsigned long long)st.weight_bytes, (unsigned long long)st.flops);
    } else {
        TAP_SKIP("%s: backend %s keeps no counters", name, be->name);
    }

    if (all_levels) {
        /* Lower levels are invariant too (their own order, fixed). */
        for (int l = DS41_CPU_SCALAR; l < (int)ds41_backend_cpu_level(be); l++) {
            ds41_engine_opts ol = {.cpu = {.threads = 2, .level = (ds41_cpu_level)l}};
            ds41_engine *el = ds41_engine_load(dir, &ol, &err);
            trace a2;
            trace_alloc(&a2, n, V);
            ok = el && run(el, p, n, n, NULL, NULL, 0, &a2) == 0 &&
                 run(el, p, n, 3, comp, comp_n, 15, &t) == 0 && same(&a2, &t, n, V);
            TAP_CHECK(ok, "%s at level %s: chunks of 3 in a batch of 16 = alone bit for bit", name,
                      ds41_cpu_level_name((ds41_cpu_level)l));
            trace_free(&a2);
            ds41_engine_free(el);
        }
    }
    trace_free(&alone);
    trace_free(&t);
    free(p);
    for (int c = 0; c < 15; c++) free(comp[c]);
    ds41_engine_free(e);
    ds41_engine_free(e1);
}

static void test_modes(const char *dir) {
    ds41_error err;
    ds41_engine *def = ds41_engine_load(dir, NULL, &err);
    ds41_engine_opts ro = {.reference = true};
    ds41_engine *ref = ds41_engine_load(dir, &ro, &err);
    TAP_CHECK(def && ref && strncmp(ds41_engine_backend(def)->name, "cpu-", 4) == 0 &&
                  strcmp(ds41_engine_ops(ref)->name, "reference") == 0 &&
                  ds41_backend_threads(ds41_engine_backend(def)) >= 1,
              "default options = the fast CPU backend (%s, %d threads); reference = the reference ops",
              def ? ds41_engine_backend(def)->name : "?",
              def ? ds41_backend_threads(ds41_engine_backend(def)) : 0);
    ds41_engine_free(def);
    ds41_engine_free(ref);
}

/* Feed ids (n) to seq in one call; logits of every position into out (or only the last). */
static int feed(ds41_engine *e, ds41_kv_seq *seq, const int32_t *ids, size_t n, float *out, bool last_only) {
    ds41_error err;
    ds41_fwd_item it = {.seq = seq, .ids = ids, .n_ids = n, .logits = out, .logits_last_only = last_only};
    const int rc = ds41_forward(e, &it, 1, NULL, &err);
    if (rc) TAP_NOTE("forward: %s", err.msg);
    return rc;
}

/* The sequence's snapshot (malloc'd, *len bytes), or NULL. */
static uint8_t *snapshot(const ds41_kv_seq *seq, size_t *len) {
    ds41_error err;
    const size_t cap = ds41_kv_seq_serialized_size(seq);
    uint8_t *b = malloc(cap);
    if (b && ds41_kv_seq_serialize(seq, b, cap, len, &err) == 0) return b;
    TAP_NOTE("serialize: %s", err.msg);
    free(b);
    return NULL;
}

static ds41_kv_seq *restore(ds41_kv_pool *pool, const uint8_t *b, size_t len) {
    ds41_error err;
    ds41_kv_seq *s = NULL;
    if (ds41_kv_seq_deserialize(pool, b, len, &s, &err) != 0) TAP_NOTE("deserialize: %s", err.msg);
    return s;
}

/* Continue seq with the tokens c[0..k) one forward call each; logits of each into out[k][V]. */
static int continue_each(ds41_engine *e, ds41_kv_seq *seq, const int32_t *c, size_t k, float *out, size_t V) {
    for (size_t i = 0; i < k; i++)
        if (feed(e, seq, c + i, 1, out + i * V, true) != 0) return -1;
    return 0;
}

/* Session snapshots across backends: taken on the fast CPU backend (ecpu) after an n-token
 * prompt, restored on the test backend (ebe). */
static void test_snapshot_across(const char *dir, const char *name, size_t n) {
    ds41_error err = {{0}};
    ds41_engine_opts oc = {.cpu = {.threads = 2}}, ob;
    ds41_engine *ecpu = ds41_engine_load(dir, &oc, &err);
    ds41_engine *ebe = ecpu && engine_opts(&ob, 2, &err) == 0 ? ds41_engine_load(dir, &ob, &err) : NULL;
    if (!TAP_CHECK(ecpu && ebe, "%s: CPU and %s engines load%s%s", name, test_backend, err.msg[0] ? ": " : "",
                   err.msg)) {
        ds41_engine_free(ecpu);
        ds41_engine_free(ebe);
        return;
    }
    const size_t V = (size_t)ds41_engine_config(ecpu)->vocab_size, K = STEPS;
    int32_t *p = make_prompt(n, (int64_t)V), c[STEPS];
    for (size_t i = 0; i < K; i++) c[i] = rnd((int64_t)V);
    ds41_kv_pool *pc = ds41_engine_new_pool(ecpu, 0, 0, &err), *pb = ds41_engine_new_pool(ebe, 0, 0, &err);
    float *last = malloc(V * sizeof *last), *A = malloc(K * V * sizeof *A), *A1 = malloc(K * V * sizeof *A1),
          *B = malloc(K * V * sizeof *B), *U = malloc(K * V * sizeof *U), *R = malloc(K * V * sizeof *R);
    ds41_kv_seq *sc = pc ? ds41_kv_seq_new(pc, &err) : NULL, *ub = pb ? ds41_kv_seq_new(pb, &err) : NULL;
    ds41_kv_seq *r1 = NULL, *r2 = NULL, *r3 = NULL, *rc = NULL;
    uint8_t *S = NULL, *S2 = NULL, *T = NULL;
    size_t ls = 0, ls2 = 0, lt = 0;
    int ok = sc && ub && last && A && A1 && B && U && R && feed(ecpu, sc, p, n, last, true) == 0 &&
             (S = snapshot(sc, &ls)) != NULL;
    /* 1. restored on the backend, the state reads back byte for byte */
    ok = ok && (r1 = restore(pb, S, ls)) != NULL && (S2 = snapshot(r1, &ls2)) != NULL;
    TAP_CHECK(ok && ls2 == ls && memcmp(S, S2, ls) == 0,
              "%s: a snapshot taken on the CPU after %zu tokens, restored on %s, reads back byte for byte "
              "(%zu bytes)",
              name, n, test_backend, ls);
    /* 2. continued there: token by token = in one call, and close to the CPU's own continuation */
    int ok2 = ok && continue_each(ebe, r1, c, K, A, V) == 0 && (r2 = restore(pb, S, ls)) != NULL &&
              feed(ebe, r2, c, K, A1, false) == 0 && continue_each(ecpu, sc, c, K, B, V) == 0;
    const int same_chunk = ok2 && memcmp(A, A1, K * V * sizeof *A) == 0;
    double worst = 0, e = 0;
    int close = ok2, argmax_same = 0;
    for (size_t i = 0; ok2 && i < K; i++) {
        close &= rel_close(A + i * V, B + i * V, V, 2e-2, &e);
        worst = fmax(worst, e);
        argmax_same += ds41_argmax(A + i * V, V) == ds41_argmax(B + i * V, V);
    }
    TAP_CHECK(same_chunk && close,
              "%s: continued on %s for %zu tokens: one call = token by token bit for bit, logits within 2e-2 "
              "of the "
              "CPU's own continuation (worst %.2e; greedy choice the same at %d of %zu)",
              name, test_backend, K, worst, argmax_same, K);
    /* 3. a snapshot taken on the backend continues there exactly like the uninterrupted run, and
     *    the CPU reads it */
    int ok3 = feed(ebe, ub, p, n, last, true) == 0 && (T = snapshot(ub, &lt)) != NULL &&
              continue_each(ebe, ub, c, K, U, V) == 0 && (r3 = restore(pb, T, lt)) != NULL &&
              continue_each(ebe, r3, c, K, R, V) == 0 && (rc = restore(pc, T, lt)) != NULL;
    TAP_CHECK(ok3 && memcmp(U, R, K * V * sizeof *U) == 0,
              "%s: a snapshot taken on %s continues there bit for bit like the uninterrupted run; the CPU "
              "backend restores it",
              name, test_backend);
    ds41_kv_seq_free(sc);
    ds41_kv_seq_free(ub);
    ds41_kv_seq_free(r1);
    ds41_kv_seq_free(r2);
    ds41_kv_seq_free(r3);
    ds41_kv_seq_free(rc);
    ds41_kv_pool_free(pc);
    ds41_kv_pool_free(pb);
    free(S);
    free(S2);
    free(T);
    free(p);
    free(last);
    free(A);
    free(A1);
    free(B);
    free(U);
    free(R);
    ds41_engine_free(ebe);
    ds41_engine_free(ecpu);
}

static int make(const char *preset, uint64_t seed, char *dir_out) {
    snprintf(dir_out, 4096, "%s/%s", root, preset);
    ds41_model_gen_opts o = {.preset = preset, .seed = seed};
    ds41_error err;
    if (ds41_model_generate(dir_out, &o, NULL, &err) != 0) {
        TAP_NOTE("generate %s: %s", preset, err.msg);
        return -1;
    }
    return 0;
}

int main(void) {
    test_backend = getenv("DS41_TEST_BACKEND");
    if (test_backend && (!*test_backend || strcmp(test_backend, "cpu") == 0)) test_backend = NULL;
    if (test_backend) {
        ds41_error err = {{0}};
        int unavailable = 0;
        ds41_backend *probe = check_backend_open(test_backend, 1, 0, &unavailable, &err);
        if (!probe) {
            printf("1..0 # SKIP backend %s: %s\n", test_backend, err.msg);
            return unavailable ? 77 : 1;
        }
        ds41_backend_free(probe);
    }
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-test-fast-forward-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir_tiny[4096], dir_long[4096];
    /* Under the sanitizers (several times slower) shorter prompts; the long
     * one still wraps the window (32) twice and passes FAST_ROWS in one chunk
     * in the plain build. */
    const int slow = getenv("DS41_SANITIZED") != NULL;
    if (TAP_CHECK(make("tiny", 21, dir_tiny) == 0, "tiny checkpoint generated")) {
        if (!test_backend) test_modes(dir_tiny);
        test_invariance(dir_tiny, "tiny", slow ? 24 : 40, !test_backend);
        if (test_backend) test_snapshot_across(dir_tiny, "tiny", 37);
    }
    if (TAP_CHECK(make("long", 22, dir_long) == 0, "long checkpoint generated")) {
        test_invariance(dir_long, "long", slow ? 70 : 130, 0);
        if (test_backend) test_snapshot_across(dir_long, "long", 101);
    }
    tmpdir_remove(root);
    return tap_done();
}
