/* device_guard (issue 14): the engine suite on the guard backend
 * (tests/guard_backend.h), whose memory the host cannot touch outside the
 * backend's own ops and memory calls.
 *
 * Every scenario runs twice, on the plain fast CPU backend and on the guard
 * backend (the same CPU options, so the same kernels), and everything it
 * observes -- logits of every position it computes, sampled tokens and their
 * logprobs, what the stream and decision hooks receive, snapshot bytes,
 * prefix-cache hits -- must be byte-identical.  Checkpoints: generated tiny,
 * long (window + index_topk > 64) and wide (twice the width, heads and
 * experts).  Scenarios: prefill whole, in chunks of 7 and token by token;
 * several sequences of different lengths prefilled in one call, then decoded
 * together; the same with the stream and decision hooks on; forks in the
 * middle of a page, both branches continuing (copy on write); a sequence
 * serialized, restored into its pool and into a pool of other pages, all
 * three continuing; the scheduler with concurrent requests, with its prefix
 * cache, with a disk tier and an import; routed experts streamed under a
 * budget of one slot (waves) and of three, Engram rows streamed under a
 * budget smaller than a decode step's rows, with ds41_engine_prefetch.
 *
 * A negative control proves the guard has teeth: a child process that reads
 * or writes guard memory from the host dies of SIGSEGV, while the same bytes
 * go through upload, download and an op. */
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/forward/dspark.h"
#include "engine/forward/forward.h"
#include "engine/model/model_gen.h"
#include "engine/model/pcg64.h"
#include "engine/serve/generate.h"
#include "engine/serve/scheduler.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab.h"
#include "storage/expert_cache.h"
#include "storage/safetensors.h"
#include "tests/guard_backend.h"
#include "tests/tap.h"
#include "tests/tmpdir.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define GUARD_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define GUARD_TEST_ASAN 1
#endif
#endif

static char root[3000];

/* ---- what a scenario observed -------------------------------------------------------------- */

/* The bytes a scenario observed, in order, with labelled sections so that a
 * difference can be named. */
#define OBS_MAX_LABELS 1024
typedef struct obs {
    unsigned char *p;
    size_t n, cap;
    bool oom;
    size_t n_labels;
    size_t label_at[OBS_MAX_LABELS];
    char label[OBS_MAX_LABELS][96];
} obs;

static void obs_put(obs *o, const void *data, size_t n) {
    if (o->oom || n == 0) return;
    if (o->n + n > o->cap) {
        size_t cap = o->cap ? o->cap : 1 << 16;
        while (cap < o->n + n) cap *= 2;
        unsigned char *p = realloc(o->p, cap);
        if (!p) {
            o->oom = true;
            return;
        }
        o->p = p, o->cap = cap;
    }
    memcpy(o->p + o->n, data, n);
    o->n += n;
}

static void obs_u64(obs *o, uint64_t v) {
    obs_put(o, &v, sizeof v);
}

__attribute__((format(printf, 2, 3))) static void obs_label(obs *o, const char *fmt, ...) {
    if (o->n_labels == OBS_MAX_LABELS) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->label[o->n_labels], sizeof o->label[0], fmt, ap);
    va_end(ap);
    o->label_at[o->n_labels++] = o->n;
}

/* The label of the section holding byte `at`. */
static const char *obs_section(const obs *o, size_t at) {
    const char *l = "(before any label)";
    for (size_t i = 0; i < o->n_labels && o->label_at[i] <= at; i++) l = o->label[i];
    return l;
}

static void obs_free(obs *o) {
    free(o->p);
    free(o);
}

/* ---- checkpoints, engines ---------------------------------------------------------------------- */

#define NPROMPT 4
#define MAX_STEPS 8
#define NEXT_TURN_MAX 1024 /* prompt 0 + an answer + prompt 1 */

typedef struct model {
    const char *name;
    char dir[4096];
    ds41_engine *plain, *guarded;
    ds41_vocab *vocab;
    ds41_tokenizer *tok;
    size_t V;
    int32_t *prompt[NPROMPT]; /* of different lengths, the first the longest */
    size_t len[NPROMPT];
    size_t steps; /* greedy decode steps after a prefill (<= MAX_STEPS) */
} model;

/* Random ids with a repeated n-gram (Engram rows shared inside a step) and a
 * run of one id (index-score ties). */
static int32_t *make_prompt(ds41_pcg64 *rng, size_t n, size_t V) {
    int32_t *p = malloc(n * sizeof *p);
    if (!p) return NULL;
    for (size_t i = 0; i < n; i++) p[i] = (int32_t)(ds41_pcg64_next64(rng) % V);
    for (size_t i = 0; i < 6 && n / 2 + i < n && i < n / 2; i++) p[n / 2 + i] = p[i];
    for (size_t i = n / 4; i < n / 4 + 4 && i < n / 2; i++) p[i] = 7;
    return p;
}

/* A fast engine on dir with `base`'s options (NULL: defaults) and two
 * threads; guarded: on a guard backend with those CPU options. */
static ds41_engine *load(const char *dir, const ds41_engine_opts *base, bool guarded, ds41_error *err) {
    ds41_engine_opts o = base ? *base : (ds41_engine_opts){0};
    o.reference = false;
    o.cpu.threads = 2;
    o.backend = NULL;
    if (guarded && !(o.backend = ds41_guard_backend_new(&o.cpu, err))) return NULL;
    return ds41_engine_load(dir, &o, err);
}

static int model_open(model *m, const char *name, const char *const *sets, size_t n_sets, uint64_t seed,
                      size_t n, size_t steps) {
    ds41_error err = {{0}};
    memset(m, 0, sizeof *m);
    m->name = name;
    m->steps = steps;
    if (steps > MAX_STEPS || n + MAX_STEPS + n / 2 + 3 > NEXT_TURN_MAX) {
        TAP_NOTE("%s: %zu tokens and %zu steps are too many", name, n, steps);
        return -1;
    }
    snprintf(m->dir, sizeof m->dir, "%s/%s", root, name);
    const char *preset = strcmp(name, "long") == 0 ? "long" : "tiny";
    ds41_model_gen_opts go = {.preset = preset, .seed = seed, .sets = sets, .n_sets = n_sets};
    if (ds41_model_generate(m->dir, &go, NULL, &err) != 0 || !(m->plain = load(m->dir, NULL, false, &err)) ||
        !(m->guarded = load(m->dir, NULL, true, &err)) || !(m->vocab = ds41_vocab_load_dir(m->dir, &err)) ||
        !(m->tok = ds41_tokenizer_new(m->vocab, &err))) {
        TAP_NOTE("%s: %s", name, err.msg);
        return -1;
    }
    m->V = (size_t)ds41_engine_config(m->plain)->vocab_size;
    const size_t lens[NPROMPT] = {n, n / 2 + 3, 7, 1};
    ds41_pcg64 rng;
    ds41_seedseq_pcg64(&rng, seed);
    for (int i = 0; i < NPROMPT; i++) {
        m->len[i] = lens[i];
        if (!(m->prompt[i] = make_prompt(&rng, lens[i], m->V))) return -1;
    }
    return 0;
}

static void model_close(model *m) {
    ds41_engine_free(m->plain);
    ds41_engine_free(m->guarded);
    ds41_tokenizer_free(m->tok);
    ds41_vocab_free(m->vocab);
    for (int i = 0; i < NPROMPT; i++) free(m->prompt[i]);
}

/* ---- running a scenario both ways ----------------------------------------------------------------- */

/* A scenario runs on engine e and appends what it observes to o; it may
 * check that it did what it is meant to (a prefix hit, waves, ...) and fail
 * with err.  0 / -1. */
typedef int (*scenario_fn)(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err);

/* The forward pass, the KV cache and the expert slots live in backend
 * memory (issue 14): a scenario must have used the guard's memory, bytes
 * held at some time and bytes moved through its memory calls. */
static void check_guard_memory_used(const char *what, const ds41_guard_stats *before,
                                    const ds41_guard_stats *after) {
    TAP_CHECK(
        after->bytes_peak > 0 && after->mem_calls > before->mem_calls,
        "%s: the engine's memory is the guard's (%llu bytes at most, %llu memory calls in the scenario)",
        what, (unsigned long long)after->bytes_peak,
        (unsigned long long)(after->mem_calls - before->mem_calls));
}

/* Run fn on plain and on guarded; one check: both succeed, they observe the
 * same bytes (something), and the guard ran ops. */
static void compare_on(ds41_engine *plain, ds41_engine *guarded, const model *m, const char *what,
                       scenario_fn fn, const void *arg) {
    obs *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    ds41_error ea = {{0}}, eb = {{0}};
    ds41_guard_stats g0 = {0}, g1 = {0};
    if (!a || !b) {
        TAP_CHECK(0, "%s %s: out of memory", m->name, what);
        free(a), free(b);
        return;
    }
    ds41_guard_backend_stats(ds41_engine_backend(guarded), &g0);
    const int ra = fn(plain, m, arg, a, &ea);
    const int rb = fn(guarded, m, arg, b, &eb);
    ds41_guard_backend_stats(ds41_engine_backend(guarded), &g1);
    check_guard_memory_used(what, &g0, &g1);
    size_t at = 0;
    const size_t n = a->n < b->n ? a->n : b->n;
    while (at < n && a->p[at] == b->p[at]) at++;
    const bool same = !a->oom && !b->oom && a->n > 0 && a->n == b->n && at == n;
    TAP_CHECK(ra == 0 && rb == 0 && same && g1.op_calls > g0.op_calls,
              "%s %s: guarded = plain byte for byte (%zu bytes observed, %llu guarded ops)", m->name, what,
              a->n, (unsigned long long)(g1.op_calls - g0.op_calls));
    if (ra) TAP_NOTE("plain: %s", ea.msg);
    if (rb) TAP_NOTE("guarded: %s", eb.msg);
    if (ra == 0 && rb == 0 && !same)
        TAP_NOTE("first difference at byte %zu of %zu / %zu, in %s", at, a->n, b->n,
                 at < a->n ? obs_section(a, at) : obs_section(b, at));
    obs_free(a);
    obs_free(b);
}

static void compare(const model *m, const char *what, scenario_fn fn, const void *arg) {
    compare_on(m->plain, m->guarded, m, what, fn, arg);
}

/* The same on engines loaded with opts (streamed tiers). */
static void compare_with(const model *m, const ds41_engine_opts *opts, const char *what, scenario_fn fn,
                         const void *arg) {
    ds41_error err = {{0}};
    ds41_engine *p = load(m->dir, opts, false, &err), *g = p ? load(m->dir, opts, true, &err) : NULL;
    if (TAP_CHECK(p && g, "%s %s: both engines load%s%s", m->name, what, p && g ? "" : ": ",
                  p && g ? "" : err.msg))
        compare_on(p, g, m, what, fn, arg);
    ds41_engine_free(p);
    ds41_engine_free(g);
}

/* ---- forward scenarios ------------------------------------------------------------------------------ */

/* What the hooks receive, into the observation. */
typedef struct hook_rec {
    obs *o;
    size_t streams, decisions;
} hook_rec;

static void on_stream(void *ctx, ds41_stream_kind kind, int layer, size_t item, size_t row, const float *data,
                      size_t n) {
    hook_rec *h = ctx;
    h->streams++;
    const int64_t head[5] = {kind, layer, (int64_t)item, (int64_t)row, (int64_t)n};
    obs_put(h->o, head, sizeof head);
    obs_put(h->o, data, n * sizeof *data);
}

static void on_decision(void *ctx, ds41_decision_kind kind, int layer, size_t item, size_t row,
                        const int32_t *sel, size_t n_sel, const float *score, size_t n_score) {
    hook_rec *h = ctx;
    h->decisions++;
    const int64_t head[6] = {100 + kind,   layer,          (int64_t)item,
                             (int64_t)row, (int64_t)n_sel, (int64_t)n_score};
    obs_put(h->o, head, sizeof head);
    obs_put(h->o, sel, n_sel * sizeof *sel);
    if (n_score) obs_put(h->o, score, n_score * sizeof *score);
}

/* Greedy steps of seq[0..S) in one call each, from last[S][V] (the logits
 * of each sequence's last position, updated in place); each step's logits
 * also into hist[step][S][V] when hist is not NULL. */
static int decode(ds41_engine *e, const model *m, ds41_kv_seq *const *seq, size_t S, float *last, float *hist,
                  const ds41_fwd_hooks *hooks, bool prefetch, const char *what, obs *o, ds41_error *err) {
    const size_t V = m->V;
    ds41_fwd_item it[NPROMPT];
    int32_t tok[NPROMPT];
    int rc = S <= NPROMPT ? 0 : ds41_fail(err, "%zu sequences", S);
    for (size_t step = 0; step < m->steps && rc == 0; step++) {
        for (size_t s = 0; s < S && rc == 0; s++) {
            tok[s] = ds41_argmax(last + s * V, V);
            it[s] = (ds41_fwd_item){.seq = seq[s], .ids = &tok[s], .n_ids = 1, .logits = last + s * V};
            if (prefetch) rc = ds41_engine_prefetch(e, seq[s], tok[s], err);
        }
        obs_label(o, "%s: decode step %zu tokens", what, step);
        obs_put(o, tok, S * sizeof *tok);
        obs_label(o, "%s: decode step %zu hooks", what, step);
        if (rc == 0) rc = ds41_forward(e, it, S, hooks, err);
        obs_label(o, "%s: decode step %zu logits", what, step);
        obs_put(o, last, S * V * sizeof *last);
        if (hist) memcpy(hist + step * S * V, last, S * V * sizeof *last);
    }
    return rc;
}

/* prompt[0..n) into seq in chunks of `chunk`, the logits of every position
 * observed; the last position's into last[V]. */
static int prefill(ds41_engine *e, const model *m, ds41_kv_seq *seq, const int32_t *prompt, size_t n,
                   size_t chunk, float *last, const char *what, obs *o, ds41_error *err) {
    const size_t V = m->V;
    float *lg = malloc(chunk * V * sizeof *lg);
    int rc = lg ? 0 : ds41_fail(err, "out of memory");
    for (size_t off = 0; off < n && rc == 0; off += chunk) {
        ds41_fwd_item it = {
            .seq = seq, .ids = prompt + off, .n_ids = n - off < chunk ? n - off : chunk, .logits = lg};
        rc = ds41_forward(e, &it, 1, NULL, err);
        obs_label(o, "%s: prefill logits of positions %zu..%zu", what, off, off + it.n_ids - 1);
        obs_put(o, lg, it.n_ids * V * sizeof *lg);
        if (rc == 0 && off + it.n_ids == n) memcpy(last, lg + (it.n_ids - 1) * V, V * sizeof *lg);
    }
    free(lg);
    return rc;
}

typedef struct batch_arg {
    size_t n_seq;  /* prompts 0..n_seq-1, each its own sequence */
    size_t chunk;  /* prefill chunk (0: whole) */
    bool hooks;    /* stream + decision hooks on every call */
    bool prefetch; /* ds41_engine_prefetch of each sampled token before its step */
} batch_arg;

/* The sequences' prompts prefilled together, each in chunks (each call takes
 * the next chunk of every sequence not done), logits of every position; then
 * m->steps greedy steps of all of them in one call each. */
static int sc_batch(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    const batch_arg *ba = arg;
    const size_t V = m->V, S = ba->n_seq, chunk = ba->chunk ? ba->chunk : m->len[0];
    hook_rec hr = {.o = o};
    const ds41_fwd_hooks hooks = {.stream = on_stream, .decision = on_decision, .ctx = &hr};
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq *seq[NPROMPT] = {0};
    size_t rows = 0;
    for (size_t s = 0; s < S; s++) rows += m->len[s];
    float *lg = malloc(rows * V * sizeof *lg), *last = malloc(NPROMPT * V * sizeof *last);
    ds41_fwd_item it[NPROMPT];
    int rc = pool && lg && last && S <= NPROMPT ? 0 : -1;
    for (size_t s = 0; s < S && rc == 0; s++)
        if (!(seq[s] = ds41_kv_seq_new(pool, err))) rc = -1;
    for (size_t off = 0, round = 0; off < m->len[0] && rc == 0; off += chunk, round++) {
        size_t k = 0, at = 0;
        for (size_t s = 0; s < S; s++) {
            if (off >= m->len[s]) continue;
            const size_t c = m->len[s] - off < chunk ? m->len[s] - off : chunk;
            it[k++] =
                (ds41_fwd_item){.seq = seq[s], .ids = m->prompt[s] + off, .n_ids = c, .logits = lg + at * V};
            at += c;
        }
        obs_label(o, "prefill round %zu hooks", round);
        rc = ds41_forward(e, it, k, ba->hooks ? &hooks : NULL, err);
        obs_label(o, "prefill round %zu logits", round);
        obs_put(o, lg, at * V * sizeof *lg);
        /* the last logits of each sequence whose prompt ended in this call */
        for (size_t s = 0, j = 0, row = 0; s < S && rc == 0; s++) {
            if (off >= m->len[s]) continue;
            row += it[j].n_ids;
            if (off + it[j].n_ids == m->len[s]) memcpy(last + s * V, lg + (row - 1) * V, V * sizeof *lg);
            j++;
        }
    }
    if (rc == 0)
        rc = decode(e, m, seq, S, last, NULL, ba->hooks ? &hooks : NULL, ba->prefetch, "batch", o, err);
    if (rc == 0 && ba->hooks && (hr.streams == 0 || hr.decisions == 0))
        rc = ds41_fail(err, "the hooks saw %zu streams and %zu decisions", hr.streams, hr.decisions);
    for (size_t s = 0; s < S; s++) ds41_kv_seq_free(seq[s]);
    ds41_kv_pool_free(pool);
    free(lg);
    free(last);
    return rc;
}

/* A sequence forked in the middle of a page (4 entries a page), both
 * continuing two ways in one call (the shared partial page is copied on
 * write), then decoding together; a fork of the fork once the first owner
 * is gone, the two decoding the same tokens to the same logits. */
static int sc_fork(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    (void)arg;
    const size_t V = m->V, n = m->len[0];
    size_t pre = n / 2 + 1;
    if (pre % 4 == 0) pre++;
    const int32_t *p = m->prompt[0];
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 4, err);
    ds41_kv_seq *seq[3] = {0};
    float *lg = malloc(2 * n * V * sizeof *lg), *last = malloc(2 * V * sizeof *last);
    float *hist = malloc(m->steps * 2 * V * sizeof *hist);
    int32_t *alt = malloc(n * sizeof *alt);
    int rc = pool && lg && last && hist && alt && (seq[0] = ds41_kv_seq_new(pool, err)) ? 0 : -1;
    if (rc == 0) rc = prefill(e, m, seq[0], p, pre, pre, last, "fork prefix", o, err);
    ds41_kv_pool_stats st0, st1;
    if (rc == 0) {
        ds41_kv_pool_get_stats(pool, &st0);
        if (!(seq[1] = ds41_kv_seq_fork(seq[0], err))) rc = -1;
        ds41_kv_pool_get_stats(pool, &st1);
        if (rc == 0 && st1.pages_in_use != st0.pages_in_use)
            rc = ds41_fail(err, "the fork took pages (%llu -> %llu)", (unsigned long long)st0.pages_in_use,
                           (unsigned long long)st1.pages_in_use);
    }
    for (size_t i = 0; alt && i < n; i++) alt[i] = i < pre ? p[i] : p[n - 1 - (i - pre)];
    if (rc == 0) {
        ds41_fwd_item both[2] = {
            {.seq = seq[0], .ids = p + pre, .n_ids = n - pre, .logits = lg},
            {.seq = seq[1], .ids = alt + pre, .n_ids = n - pre, .logits = lg + (n - pre) * V}};
        rc = ds41_forward(e, both, 2, NULL, err);
        obs_label(o, "both branches' logits");
        obs_put(o, lg, 2 * (n - pre) * V * sizeof *lg);
        memcpy(last, lg + (n - pre - 1) * V, V * sizeof *lg);
        memcpy(last + V, lg + (2 * (n - pre) - 1) * V, V * sizeof *lg);
    }
    if (rc == 0) rc = decode(e, m, seq, 2, last, NULL, NULL, false, "both branches", o, err);
    if (rc == 0 && !(seq[2] = ds41_kv_seq_fork(seq[1], err))) rc = -1;
    ds41_kv_seq_free(seq[0]);
    seq[0] = NULL;
    if (rc == 0) {
        memcpy(last, last + V, V * sizeof *last);
        rc = decode(e, m, seq + 1, 2, last, hist, NULL, false, "a fork of the fork", o, err);
    }
    for (size_t k = 0; k < m->steps && rc == 0; k++)
        if (memcmp(hist + 2 * k * V, hist + (2 * k + 1) * V, V * sizeof *hist) != 0)
            rc = ds41_fail(err, "a fork and its copy differ at step %zu", k);
    ds41_kv_seq_free(seq[1]);
    ds41_kv_seq_free(seq[2]);
    if (pool) {
        ds41_kv_pool_get_stats(pool, &st1);
        if (rc == 0 && (st1.pages_in_use != 0 || st1.sequences != 0))
            rc = ds41_fail(err, "%llu pages still in use", (unsigned long long)st1.pages_in_use);
    }
    ds41_kv_pool_free(pool);
    free(lg);
    free(last);
    free(hist);
    free(alt);
    return rc;
}

/* A sequence serialized after its prompt (chunks of 7), restored into its
 * own pool and into a pool of one-entry pages; the three continue (the
 * original and its copy in one call, the other alone) to the same logits,
 * and their states serialize to the same bytes again. */
static int sc_snapshot(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    (void)arg;
    const size_t V = m->V, K = m->steps;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err),
                 *other = pool ? ds41_engine_new_pool(e, 0, 1, err) : NULL;
    ds41_kv_seq *a = other ? ds41_kv_seq_new(pool, err) : NULL, *b = NULL, *c = NULL;
    float *last = malloc(3 * V * sizeof *last), *hab = malloc(K * 2 * V * sizeof *hab),
          *hc = malloc(K * V * sizeof *hc);
    uint8_t *buf = NULL, *buf2 = NULL;
    size_t len = 0, w = 0;
    int rc = a && last && hab && hc ? 0 : -1;
    if (rc == 0) rc = prefill(e, m, a, m->prompt[0], m->len[0], 7, last, "snapshot prompt", o, err);
    if (rc == 0) {
        len = ds41_kv_seq_serialized_size(a);
        if (!(buf = malloc(len)) || !(buf2 = malloc(len))) rc = ds41_fail(err, "out of memory");
    }
    if (rc == 0) rc = ds41_kv_seq_serialize(a, buf, len, &w, err);
    obs_label(o, "the serialized state");
    obs_put(o, buf, w);
    if (rc == 0) rc = ds41_kv_seq_deserialize(pool, buf, len, &b, err);
    if (rc == 0) rc = ds41_kv_seq_deserialize(other, buf, len, &c, err);
    if (rc == 0) {
        memcpy(last + V, last, V * sizeof *last);
        memcpy(last + 2 * V, last, V * sizeof *last);
        ds41_kv_seq *ab[2] = {a, b};
        rc = decode(e, m, ab, 2, last, hab, NULL, false, "original + restored", o, err);
        if (rc == 0)
            rc = decode(e, m, &c, 1, last + 2 * V, hc, NULL, false, "restored into other pages", o, err);
    }
    for (size_t k = 0; k < K && rc == 0; k++)
        if (memcmp(hab + 2 * k * V, hab + (2 * k + 1) * V, V * sizeof *hc) != 0 ||
            memcmp(hab + 2 * k * V, hc + k * V, V * sizeof *hc) != 0)
            rc = ds41_fail(err, "a restored sequence's step %zu differs from the original's", k);
    /* the three states are equal again */
    len = a ? ds41_kv_seq_serialized_size(a) : 0;
    free(buf);
    free(buf2);
    buf = malloc(len ? len : 1), buf2 = malloc(len ? len : 1);
    size_t w2 = 0;
    if (rc == 0 && (!buf || !buf2)) rc = ds41_fail(err, "out of memory");
    if (rc == 0) rc = ds41_kv_seq_serialize(a, buf, len, &w, err);
    if (rc == 0) rc = ds41_kv_seq_serialize(c, buf2, len, &w2, err);
    if (rc == 0 && (w != w2 || memcmp(buf, buf2, w) != 0))
        rc = ds41_fail(err, "the restored sequence's state serializes differently after %zu steps", K);
    obs_label(o, "the serialized state after the steps");
    obs_put(o, buf, w);
    ds41_kv_seq_free(a);
    ds41_kv_seq_free(b);
    ds41_kv_seq_free(c);
    ds41_kv_pool_free(pool);
    ds41_kv_pool_free(other);
    free(last);
    free(hab);
    free(hc);
    free(buf);
    free(buf2);
    return rc;
}

/* ---- scheduler scenarios ---------------------------------------------------------------------- */

#define WAIT_S 600

/* One request's record: every sampled token with its logprobs, the end. */
typedef struct req {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    obs *o; /* its own observation, appended to the scenario's in request order */
    size_t n_tokens;
    int n_done;
    ds41_sched_status status;
    char message[256];
    size_t cached, completion;
    int32_t gen[MAX_STEPS]; /* the tokens generated */
} req;

static int req_init(req *r) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    return (r->o = calloc(1, sizeof *r->o)) ? 0 : -1;
}

static void req_destroy(req *r) {
    if (r->o) obs_free(r->o);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
}

static void req_delta(void *ctx, const ds41_generation *g, const ds41_generation_delta *d) {
    (void)g;
    req *r = ctx;
    pthread_mutex_lock(&r->mu);
    const ds41_sample_result *sr = &d->sample;
    const uint32_t head[3] = {d->token, sr->token, sr->n_top};
    obs_put(r->o, head, sizeof head);
    obs_put(r->o, &sr->logprob, sizeof sr->logprob);
    obs_put(r->o, sr->top, sr->n_top * sizeof *sr->top);
    if (r->n_tokens < MAX_STEPS) r->gen[r->n_tokens] = (int32_t)d->token;
    r->n_tokens++;
    pthread_mutex_unlock(&r->mu);
}

static void req_done(void *ctx, const ds41_generation *g, ds41_sched_status status, const char *message) {
    req *r = ctx;
    pthread_mutex_lock(&r->mu);
    r->n_done++;
    r->status = status;
    snprintf(r->message, sizeof r->message, "%s", message ? message : "");
    r->cached = ds41_generation_cached_tokens(g);
    r->completion = ds41_generation_completion_tokens(g);
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* Queue ids[0..n) (seeded sampling at temperature 0.9, logprobs with every
 * alternative, max_tokens, EOS ignored). */
static int submit(ds41_scheduler *s, const model *m, const int32_t *ids, size_t n, uint64_t seed,
                  uint32_t max_tokens, req *r, ds41_error *err) {
    uint32_t *u = malloc(n * sizeof *u);
    if (!u) return ds41_fail(err, "out of memory");
    for (size_t i = 0; i < n; i++) u[i] = (uint32_t)ids[i];
    ds41_generation_params p = ds41_generation_params_default();
    p.kind = DS41_GENERATION_IDS;
    p.ids = u;
    p.n_ids = n;
    p.sampler.temperature = 0.9f;
    p.sampler.has_seed = 1;
    p.sampler.seed = seed;
    p.sampler.logprobs = 1;
    p.sampler.top_logprobs = DS41_SAMPLER_MAX_TOP_LOGPROBS;
    p.max_tokens = max_tokens;
    p.ignore_eos = true;
    ds41_generation *g = NULL;
    int rc = ds41_generation_new(m->tok, &p, (uint32_t)m->V, &g, err);
    free(u);
    if (rc != 0) return -1;
    const ds41_sched_sink sink = {.delta = req_delta, .done = req_done, .ctx = r};
    uint64_t id;
    return ds41_scheduler_submit(s, g, &sink, &id, err) == DS41_SCHED_DONE ? 0 : -1;
}

/* Wait for r's end; then its record goes into o.  0, or -1 when it did not
 * end in time or did not finish (DONE, max_tokens generated). */
static int req_finish(req *r, const char *what, uint32_t max_tokens, obs *o, ds41_error *err) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += WAIT_S;
    pthread_mutex_lock(&r->mu);
    while (r->n_done == 0)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &t) != 0) break;
    const int done = r->n_done;
    pthread_mutex_unlock(&r->mu);
    if (!done) return ds41_fail(err, "%s did not end in %d s", what, WAIT_S);
    if (r->status != DS41_SCHED_DONE || r->completion != max_tokens || r->n_tokens != max_tokens)
        return ds41_fail(err, "%s ended with status %d after %zu tokens: %s", what, (int)r->status,
                         r->n_tokens, r->message);
    obs_label(o, "%s: tokens and logprobs", what);
    obs_put(o, r->o->p, r->o->n);
    obs_label(o, "%s: cached tokens", what);
    obs_u64(o, r->cached);
    return r->o->oom ? ds41_fail(err, "out of memory") : 0;
}

/* The next turn of a conversation whose first turn was prompt 0 and a's
 * answer: both, then prompt 1.  Its length. */
static size_t next_turn(const model *m, const req *a, int32_t *next) {
    const size_t g = a->n_tokens < MAX_STEPS ? a->n_tokens : MAX_STEPS;
    memcpy(next, m->prompt[0], m->len[0] * sizeof *next);
    memcpy(next + m->len[0], a->gen, g * sizeof *next);
    memcpy(next + m->len[0] + g, m->prompt[1], m->len[1] * sizeof *next);
    return m->len[0] + g + m->len[1];
}

static ds41_sched_config sched_config(bool prefix_cache) {
    return (ds41_sched_config){.max_sequences = 6,
                               .max_batch_tokens = 64,
                               .prefill_chunk = 8,
                               .max_queue = 16,
                               .prefix_cache = prefix_cache};
}

/* Six requests of different lengths queued at once: they prefill in chunks
 * of 8 beside each other's decode steps. */
static int sc_sched_concurrent(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    (void)arg;
    enum { N = 6 };
    const uint32_t T = (uint32_t)m->steps;
    const ds41_sched_config cfg = sched_config(false);
    ds41_scheduler *s = NULL;
    req r[N];
    int rc = 0, made = 0;
    for (; made < N && rc == 0; made++) rc = req_init(&r[made]);
    if (rc == 0) rc = ds41_scheduler_new(e, &cfg, &s, err);
    for (int i = 0; i < N && rc == 0; i++) {
        const size_t off = (size_t)i, n = 4 + 5 * (size_t)i;
        const size_t len = n < m->len[0] - off ? n : m->len[0] - off;
        rc = submit(s, m, m->prompt[0] + off, len, 100 + (uint64_t)i, T, &r[i], err);
    }
    for (int i = 0; i < N && rc == 0; i++) {
        char what[32];
        snprintf(what, sizeof what, "request %d", i);
        rc = req_finish(&r[i], what, T, o, err);
    }
    ds41_sched_stats st;
    if (s) ds41_scheduler_stats(s, &st);
    if (rc == 0 && st.max_running_seen < 2)
        rc = ds41_fail(err, "the requests never ran together (%u at most)", st.max_running_seen);
    ds41_scheduler_free(s, 0);
    for (int i = 0; i < made; i++) req_destroy(&r[i]);
    return rc;
}

/* The prefix cache: a prompt, the same prompt again (all but its last token
 * cached), the next turn of the conversation (prompt + answer cached). */
static int sc_sched_prefix(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    (void)arg;
    const uint32_t T = (uint32_t)m->steps;
    const size_t n = m->len[0];
    const ds41_sched_config cfg = sched_config(true);
    ds41_scheduler *s = NULL;
    req a, b, c;
    int rc = req_init(&a) | req_init(&b) | req_init(&c);
    if (rc == 0) rc = ds41_scheduler_new(e, &cfg, &s, err);
    if (rc == 0) rc = submit(s, m, m->prompt[0], n, 7, T, &a, err);
    if (rc == 0) rc = req_finish(&a, "the first request", T, o, err);
    if (rc == 0) rc = submit(s, m, m->prompt[0], n, 8, T, &b, err);
    if (rc == 0) rc = req_finish(&b, "the same prompt", T, o, err);
    int32_t next[NEXT_TURN_MAX];
    const size_t nn = next_turn(m, &a, next);
    if (rc == 0) rc = submit(s, m, next, nn, 9, T, &c, err);
    if (rc == 0) rc = req_finish(&c, "the next turn", T, o, err);
    if (rc == 0 && (b.cached != n - 1 || c.cached < n))
        rc = ds41_fail(err, "prefix cache: %zu of %zu and %zu of %zu tokens cached", b.cached, n, c.cached,
                       nn);
    ds41_scheduler_free(s, 0);
    req_destroy(&a);
    req_destroy(&b);
    req_destroy(&c);
    return rc;
}

/* The prefix cache's disk tier, in memory: the newest entry handed to it. */
typedef struct mem_disk {
    uint8_t *kv;
    size_t kv_len;
    int32_t ids[NEXT_TURN_MAX];
    size_t n_ids;
    int evicted, restored;
    bool failed;
} mem_disk;

static void disk_evicted(void *ctx, const ds41_kv_seq *seq, const ds41_sched_partition *part,
                         const int32_t *ids, size_t n) {
    (void)part;
    mem_disk *d = ctx;
    ds41_error err;
    size_t w = 0;
    d->evicted++;
    if (n > NEXT_TURN_MAX || n < d->n_ids) return; /* keep the longest */
    free(d->kv);
    d->kv_len = ds41_kv_seq_serialized_size(seq);
    d->kv = malloc(d->kv_len);
    if (!d->kv || ds41_kv_seq_serialize(seq, d->kv, d->kv_len, &w, &err) != 0) d->failed = true;
    d->n_ids = n;
    memcpy(d->ids, ids, n * sizeof *ids);
}

static ds41_kv_seq *disk_restore(void *ctx, ds41_kv_pool *pool, const ds41_sched_partition *part,
                                 const int32_t *ids, size_t n, size_t *n_cached) {
    (void)part;
    mem_disk *d = ctx;
    ds41_kv_seq *seq = NULL;
    ds41_error err;
    *n_cached = 0;
    if (!d->kv || d->n_ids >= n || memcmp(d->ids, ids, d->n_ids * sizeof *ids) != 0 ||
        ds41_kv_seq_deserialize(pool, d->kv, d->kv_len, &seq, &err) != 0)
        return NULL;
    d->restored++;
    *n_cached = d->n_ids;
    return seq;
}

/* A conversation goes to the disk tier when its scheduler stops; its next
 * turn on a new scheduler is restored from there, and on a third one from
 * the same bytes imported into the prefix cache. */
static int sc_sched_disk(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    (void)arg;
    const uint32_t T = (uint32_t)m->steps;
    mem_disk d = {0};
    ds41_sched_config cfg = sched_config(true), plain = sched_config(true);
    cfg.disk = (ds41_sched_disk){.restore = disk_restore, .evicted = disk_evicted, .ctx = &d};
    ds41_scheduler *s = NULL;
    req a, b, c;
    int32_t next[NEXT_TURN_MAX];
    size_t nn = 0, stored = 0;
    uint8_t *kv = NULL;
    size_t kv_len = 0;
    int rc = req_init(&a) | req_init(&b) | req_init(&c);
    if (rc == 0) rc = ds41_scheduler_new(e, &cfg, &s, err);
    if (rc == 0) rc = submit(s, m, m->prompt[0], m->len[0], 21, T, &a, err);
    if (rc == 0) rc = req_finish(&a, "the first turn", T, o, err);
    ds41_scheduler_free(s, 1000);
    s = NULL;
    if (rc == 0 && (d.failed || !d.kv || d.n_ids + 1 != m->len[0] + T))
        rc = ds41_fail(err, "the disk tier got %zu ids of a %zu-token conversation", d.n_ids, m->len[0] + T);
    if (rc == 0 && !(kv = malloc(d.kv_len))) rc = ds41_fail(err, "out of memory");
    if (rc == 0) {
        obs_label(o, "the stored conversation");
        obs_put(o, d.kv, d.kv_len);
        memcpy(kv, d.kv, d.kv_len);
        kv_len = d.kv_len;
        stored = d.n_ids;
        nn = next_turn(m, &a, next);
        rc = ds41_scheduler_new(e, &cfg, &s, err);
    }
    if (rc == 0) rc = submit(s, m, next, nn, 22, T, &b, err);
    if (rc == 0) rc = req_finish(&b, "the next turn restored from disk", T, o, err);
    ds41_scheduler_free(s, 0);
    s = NULL;
    if (rc == 0 && (d.restored != 1 || b.cached != stored))
        rc = ds41_fail(err, "%d restores, %zu tokens cached of %zu stored", d.restored, b.cached, stored);
    if (rc == 0) rc = ds41_scheduler_new(e, &plain, &s, err);
    const ds41_sched_partition part = {.owner_uid = -1}; /* ds41_scheduler_submit's partition */
    if (rc == 0) rc = ds41_scheduler_import(s, &part, kv, kv_len, next, stored, NULL, err);
    if (rc == 0) rc = submit(s, m, next, nn, 22, T, &c, err);
    if (rc == 0) rc = req_finish(&c, "the next turn from the imported state", T, o, err);
    if (rc == 0 && c.cached != stored)
        rc = ds41_fail(err, "%zu tokens cached from the import of %zu", c.cached, stored);
    ds41_scheduler_free(s, 0);
    req_destroy(&a);
    req_destroy(&b);
    req_destroy(&c);
    free(d.kv);
    free(kv);
    return rc;
}

/* ---- streamed tiers ------------------------------------------------------------------------------ */

typedef struct stream_arg {
    batch_arg b;
    bool experts, waves; /* experts streamed; some acquire could not pin a layer's union */
    bool engram, bypass; /* Engram rows streamed; some read bypassed the cache */
    bool host_tier;      /* on device-like memory: a host tier holding every expert served misses */
} stream_arg;

static int sc_streamed(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    const stream_arg *sa = arg;
    if (ds41_engine_experts_streamed(e) != sa->experts || ds41_engine_engram_stats(e, NULL) != sa->engram)
        return ds41_fail(err, "experts %s, Engram rows %s",
                         ds41_engine_experts_streamed(e) ? "streamed" : "resident",
                         ds41_engine_engram_stats(e, NULL) ? "streamed" : "resident");
    ds41_expert_cache_stats xs;
    ds41_engram_cache_stats es;
    ds41_engine_expert_stats(e, &xs, true);
    ds41_engine_engram_reset_stats(e);
    int rc = sc_batch(e, m, &sa->b, o, err);
    ds41_engine_expert_stats(e, &xs, false);
    ds41_engine_engram_stats(e, &es);
    if (rc == 0 && sa->experts && (xs.requests == 0 || (sa->waves && xs.waves == 0)))
        rc = ds41_fail(err, "the expert tier saw %llu requests, %llu waves", (unsigned long long)xs.requests,
                       (unsigned long long)xs.waves);
    /* The host tier holds every expert: each is read at most once, and
     * device misses come from it (the CPU engine computes on host memory:
     * no tier there). */
    if (rc == 0 && sa->host_tier && ds41_engine_backend(e)->mem != &ds41_memory_host &&
        (xs.host_hits == 0 || xs.reads > xs.host_slots || xs.host_budget_bytes == 0))
        rc = ds41_fail(err, "the host tier served %llu misses, %llu reads for %llu host slots",
                       (unsigned long long)xs.host_hits, (unsigned long long)xs.reads,
                       (unsigned long long)xs.host_slots);
    if (rc == 0 && sa->engram && (es.rows_read == 0 || (sa->bypass && es.bypass_reads == 0)))
        rc = ds41_fail(err, "the Engram tier read %llu rows, %llu bypassing",
                       (unsigned long long)es.rows_read, (unsigned long long)es.bypass_reads);
    return rc;
}

static void streamed(const model *m) {
    ds41_error err = {{0}};
    const ds41_model_config *c = ds41_engine_config(m->plain);
    ds41_checkpoint *ck = ds41_checkpoint_open(m->dir, &err);
    uint64_t slot = 0, total = 0, tables = 0;
    if (!TAP_CHECK(ck && ds41_expert_cache_geometry(ck, c, &slot, &total, &err) == 0,
                   "%s: expert slot size (%s)", m->name, ck ? "ok" : err.msg)) {
        ds41_checkpoint_close(ck);
        return;
    }
    for (size_t i = 0; i < ds41_checkpoint_tensor_count(ck); i++) {
        const ds41_tensor *t = ds41_checkpoint_tensor_at(ck, i);
        if (strstr(t->name, "engram.embed.")) tables += t->nbytes;
    }
    ds41_checkpoint_close(ck);
    const uint64_t ehd = (uint64_t)c->engram_head_dim,
                   entry = ehd + (ehd + 31) / 32 + DS41_ENGRAM_ENTRY_OVERHEAD;
    const uint64_t step_rows =
        (uint64_t)((c->engram_max_ngram_size - 1) * c->engram_n_heads) * c->engram_layer_ids.n;
    TAP_NOTE(
        "%s: %llu bytes of experts in slots of %llu, %llu bytes of Engram tables, %llu rows a decode step",
        m->name, (unsigned long long)total, (unsigned long long)slot, (unsigned long long)tables,
        (unsigned long long)step_rows);

    ds41_engine_opts o = {.expert_cache_bytes = slot};
    stream_arg a = {.b = {.n_seq = 3}, .experts = true, .waves = true};
    compare_with(m, &o, "experts streamed in one slot (waves), 3 prompts prefilled and decoded together",
                 sc_streamed, &a);

    o = (ds41_engine_opts){.expert_cache_bytes = 3 * slot, .engram_cache_bytes = 200 * entry};
    a = (stream_arg){.b = {.n_seq = 3, .chunk = 7, .prefetch = true}, .experts = true, .engram = true};
    compare_with(m, &o, "experts in 3 slots and Engram rows in 200 streamed, chunks of 7, prefetch",
                 sc_streamed, &a);

    /* Issue 15: 2 device slots above a host tier of every expert. */
    o = (ds41_engine_opts){.expert_cache_bytes = 2 * slot, .host_expert_cache_bytes = 2 * total};
    a = (stream_arg){.b = {.n_seq = 3, .prefetch = true}, .experts = true, .host_tier = true};
    compare_with(m, &o, "experts in 2 device slots above a host tier holding all of them", sc_streamed, &a);

    o = (ds41_engine_opts){.engram_cache_bytes = step_rows / 2 * entry};
    a = (stream_arg){.b = {.n_seq = 1, .chunk = 4, .prefetch = true}, .engram = true, .bypass = true};
    compare_with(m, &o, "Engram rows streamed under half a decode step's rows, chunks of 4, prefetch",
                 sc_streamed, &a);
}

/* ---- the guard has teeth -------------------------------------------------------------------------- */

/* In a child: guard memory filled by upload, moved by an op (gather_rows),
 * read back by download -- each reports 'y' on the pipe -- then touched by
 * the host (a read, or a write), which must kill it with SIGSEGV. */
static void teeth_child(int out, bool write_it) {
#ifdef GUARD_TEST_ASAN
    signal(SIGSEGV, SIG_DFL); /* AddressSanitizer's handler would report and abort */
#endif
    ds41_error err;
    const ds41_cpu_opts co = {.threads = 1};
    ds41_backend *be = ds41_guard_backend_new(&co, &err);
    if (!be) _exit(2);
    const ds41_memory *mem = be->mem;
    enum { ROW = 64, ROWS = 8 };
    unsigned char src[ROWS * ROW], back[ROWS * ROW];
    uint32_t idx[ROWS];
    for (size_t i = 0; i < sizeof src; i++) src[i] = (unsigned char)(i * 7 + 1);
    for (uint32_t i = 0; i < ROWS; i++) idx[i] = ROWS - 1 - i;
    unsigned char *p = mem->alloc(mem, sizeof src), *q = mem->alloc(mem, sizeof src);
    uint32_t *d_idx = mem->alloc(mem, sizeof idx);
    if (!p || !q || !d_idx) _exit(3);
    mem->upload(mem, p, src, sizeof src);
    mem->upload(mem, d_idx, idx, sizeof idx);
    mem->download(mem, back, p, sizeof back);
    char ok = memcmp(src, back, sizeof src) == 0 ? 'y' : 'n';
    (void)!write(out, &ok, 1);
    be->ops.gather_rows(&be->ops, q, p, ROW, d_idx, ROWS, ROW);
    mem->download(mem, back, q, sizeof back);
    ok = 'y';
    for (size_t r = 0; r < ROWS; r++) ok = memcmp(back + r * ROW, src + idx[r] * ROW, ROW) == 0 ? ok : 'n';
    (void)!write(out, &ok, 1);
    if (write_it)
        ((volatile unsigned char *)q)[3] = 1;
    else
        ok = ((volatile unsigned char *)p)[5] == src[5] ? 'y' : 'n';
    _exit(4); /* not reached: the host touched the memory and lived */
}

static void test_teeth(void) {
    for (int wr = 0; wr < 2; wr++) {
        int pfd[2], efd[2];
        if (pipe(pfd) != 0 || pipe(efd) != 0) {
            TAP_CHECK(0, "pipe: %s", strerror(errno));
            return;
        }
        fflush(stdout);
        const pid_t pid = fork();
        if (pid == 0) {
            close(pfd[0]);
            close(efd[0]);
            dup2(efd[1], 2);
            teeth_child(pfd[1], wr);
        }
        close(pfd[1]);
        close(efd[1]);
        char got[2] = {0}, msg[4096] = {0};
        size_t n = 0, e = 0;
        ssize_t k;
        while (n < 2 && (k = read(pfd[0], got + n, 2 - n)) > 0) n += (size_t)k;
        while (e + 1 < sizeof msg && (k = read(efd[0], msg + e, sizeof msg - 1 - e)) > 0) e += (size_t)k;
        close(pfd[0]);
        close(efd[0]);
        int status = 0;
        if (pid < 0 || waitpid(pid, &status, 0) != pid) status = 0;
        const char *how = wr ? "write" : "read";
        TAP_CHECK(
            n == 2 && got[0] == 'y' && got[1] == 'y',
            "guard memory: upload then download give the bytes back, and an op (gather_rows) moves them (%s "
            "child)",
            how);
        const bool segv = WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
        TAP_CHECK(
            segv,
            "guard memory: a host %s outside the backend's calls kills the process with SIGSEGV (%s %d)", how,
            WIFSIGNALED(status) ? "signal" : "exit status",
            WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
#ifndef GUARD_TEST_ASAN
        TAP_CHECK(strstr(msg, "the host touched backend memory") != NULL,
                  "guard memory: the fault handler names the %s (%.80s)", how, msg);
#endif
    }
}

/* ---- DSpark drafts ------------------------------------------------------------------------------------ */

/* A sequence's serialized state into a malloc'd buffer (*len bytes); NULL on failure. */
static uint8_t *seq_state(const ds41_kv_seq *seq, size_t *len, ds41_error *err) {
    *len = ds41_kv_seq_serialized_size(seq);
    uint8_t *buf = malloc(*len ? *len : 1);
    size_t w = 0;
    if (!buf || ds41_kv_seq_serialize(seq, buf, *len, &w, err) != 0 || w != *len) {
        free(buf);
        if (!err->msg[0]) ds41_fail(err, "out of memory");
        return NULL;
    }
    return buf;
}

/* Prompts 0 and 1 prefilled with spec_taps (in chunks of 7), then greedy
 * steps of both in one call each; before each step the DSpark head drafts a
 * block from each sequence's token, both in one call (ids, confidences and
 * corrected logits observed), and sequence 0 again alone: the same bytes
 * (a draft does not depend on its batch), and neither call changes the
 * sequences' state (their serializations before and after are equal). */
static int sc_drafts(ds41_engine *e, const model *m, const void *arg, obs *o, ds41_error *err) {
    (void)arg;
    const size_t V = m->V, B = (size_t)ds41_engine_config(e)->dspark_block_size;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq *seq[2] = {0};
    float *lg = malloc(7 * V * sizeof *lg), *last = malloc(2 * V * sizeof *last);
    float *dlog = malloc(3 * B * V * sizeof *dlog), *conf = malloc(3 * B * sizeof *conf);
    int32_t *dids = malloc(3 * B * sizeof *dids);
    int rc = pool && lg && last && dlog && conf && dids && (seq[0] = ds41_kv_seq_new(pool, err)) &&
                     (seq[1] = ds41_kv_seq_new(pool, err))
                 ? 0
                 : (err->msg[0] ? -1 : ds41_fail(err, "out of memory"));
    for (int s = 0; s < 2 && rc == 0; s++)
        for (size_t off = 0; off < m->len[s] && rc == 0; off += 7) {
            const size_t n = m->len[s] - off < 7 ? m->len[s] - off : 7;
            ds41_fwd_item it = {
                .seq = seq[s], .ids = m->prompt[s] + off, .n_ids = n, .logits = lg, .spec_taps = true};
            rc = ds41_forward(e, &it, 1, NULL, err);
            if (rc == 0 && off + n == m->len[s]) memcpy(last + s * V, lg + (n - 1) * V, V * sizeof *lg);
        }
    for (size_t step = 0; step < m->steps && rc == 0; step++) {
        int32_t tok[2] = {ds41_argmax(last, V), ds41_argmax(last + V, V)};
        size_t len[2] = {0, 0}, len2 = 0;
        uint8_t *before[2] = {seq_state(seq[0], &len[0], err), seq_state(seq[1], &len[1], err)};
        ds41_draft_req rq[3];
        for (int i = 0; i < 3; i++)
            rq[i] = (ds41_draft_req){.seq = seq[i % 2],
                                     .token = tok[i % 2],
                                     .k = B,
                                     .ids = dids + i * B,
                                     .confidence = conf + i * B,
                                     .logits = dlog + i * B * V};
        if (!before[0] || !before[1]) rc = -1;
        if (rc == 0) rc = ds41_dspark_draft(e, rq, 2, err);
        if (rc == 0) rc = ds41_dspark_draft(e, rq + 2, 1, err);
        obs_label(o, "drafts before step %zu: ids", step);
        obs_put(o, dids, 2 * B * sizeof *dids);
        obs_label(o, "drafts before step %zu: confidences", step);
        obs_put(o, conf, 2 * B * sizeof *conf);
        obs_label(o, "drafts before step %zu: logits", step);
        obs_put(o, dlog, 2 * B * V * sizeof *dlog);
        if (rc == 0 && (memcmp(dids, dids + 2 * B, B * sizeof *dids) != 0 ||
                        memcmp(conf, conf + 2 * B, B * sizeof *conf) != 0 ||
                        memcmp(dlog, dlog + 2 * B * V, B * V * sizeof *dlog) != 0))
            rc = ds41_fail(err, "step %zu: sequence 0's drafts alone differ from its drafts in a batch of 2",
                           step);
        for (int s = 0; s < 2 && rc == 0; s++) {
            uint8_t *after = seq_state(seq[s], &len2, err);
            if (!after)
                rc = -1;
            else if (len2 != len[s] || memcmp(after, before[s], len2) != 0)
                rc = ds41_fail(err, "step %zu: drafting changed sequence %d's state", step, s);
            free(after);
        }
        free(before[0]);
        free(before[1]);
        ds41_fwd_item it[2];
        for (int s = 0; s < 2; s++)
            it[s] = (ds41_fwd_item){
                .seq = seq[s], .ids = &tok[s], .n_ids = 1, .logits = last + s * V, .spec_taps = true};
        if (rc == 0) rc = ds41_forward(e, it, 2, NULL, err);
        obs_label(o, "step %zu: logits", step);
        obs_put(o, last, 2 * V * sizeof *last);
    }
    ds41_kv_seq_free(seq[0]);
    ds41_kv_seq_free(seq[1]);
    ds41_kv_pool_free(pool);
    free(lg);
    free(last);
    free(dlog);
    free(conf);
    free(dids);
    return rc;
}

/* The draft call's refusals (nothing written), and k drafts = the first k of
 * a whole block (the Markov chain stops early, nothing else changes). */
static void draft_api(const model *m) {
    ds41_engine *e = m->plain;
    const size_t B = (size_t)ds41_engine_config(e)->dspark_block_size;
    ds41_error err = {{0}};
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_seq *a = pool ? ds41_kv_seq_new(pool, &err) : NULL,
                *b = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    if (!TAP_CHECK(a && b, "draft API: a pool and two sequences%s", err.msg)) goto out;
    int32_t ids[16], full[16];
    float conf[16], full_conf[16];
    for (int i = 0; i < 16; i++) ids[i] = -7;
    ds41_draft_req rq = {.seq = a, .token = 1, .k = B, .ids = ids};
    const int r0 = ds41_dspark_draft(e, &rq, 1, &err);
    TAP_CHECK(r0 != 0 && strstr(err.msg, "consumed no token") && ids[0] == -7,
              "draft API: a sequence at position 0 is refused, nothing written (%s)", err.msg);
    ds41_fwd_item it[2] = {{.seq = a, .ids = m->prompt[0], .n_ids = m->len[0], .spec_taps = true},
                           {.seq = b, .ids = m->prompt[1], .n_ids = m->len[1], .spec_taps = true}};
    err.msg[0] = 0;
    if (!TAP_CHECK(ds41_forward(e, it, 2, NULL, &err) == 0, "draft API: prefill with spec_taps%s", err.msg))
        goto out;
    struct {
        ds41_draft_req r[2];
        size_t n;
        const char *msg, *what;
    } bad[] = {
        {{{.seq = a, .token = 1, .k = 0, .ids = ids}}, 1, "outside 1..", "k = 0"},
        {{{.seq = a, .token = 1, .k = B + 1, .ids = ids}}, 1, "outside 1..", "k = dspark_block_size + 1"},
        {{{.seq = a, .token = (int32_t)m->V, .k = 1, .ids = ids}},
         1,
         "outside [0,",
         "a token past the vocabulary"},
        {{{.seq = a, .token = -1, .k = 1, .ids = ids}}, 1, "outside [0,", "a negative token"},
        {{{.seq = a, .token = 1, .k = 1, .ids = NULL}}, 1, "no ids buffer", "no ids buffer"},
        {{{.seq = a, .token = 1, .k = 1, .ids = ids}, {.seq = a, .token = 2, .k = 1, .ids = ids + 8}},
         2,
         "share a sequence",
         "a sequence twice"},
        {{{.seq = a, .token = 1, .k = 1, .ids = ids}}, 0, "no draft requests", "no request"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        err.msg[0] = 0;
        const int rc = ds41_dspark_draft(e, bad[i].r, bad[i].n, &err);
        TAP_CHECK(rc != 0 && strstr(err.msg, bad[i].msg) && ids[0] == -7 && ids[8] == -7,
                  "draft API: %s is refused, nothing written (%s)", bad[i].what, err.msg);
    }
    err.msg[0] = 0;
    ds41_draft_req whole = {.seq = a, .token = 3, .k = B, .ids = full, .confidence = full_conf};
    int ok = ds41_dspark_draft(e, &whole, 1, &err) == 0;
    for (size_t k = 1; k <= B && ok; k++) {
        ds41_draft_req part[2] = {{.seq = a, .token = 3, .k = k, .ids = ids, .confidence = conf},
                                  {.seq = b, .token = 4, .k = B, .ids = ids + 8}};
        ok = ds41_dspark_draft(e, part, 2, &err) == 0 && memcmp(ids, full, k * sizeof *ids) == 0 &&
             memcmp(conf, full_conf, k * sizeof *conf) == 0;
    }
    TAP_CHECK(ok,
              "draft API: k = 1..%zu drafts (next to a whole block of another sequence) are the first k of a "
              "whole block, confidences included%s",
              B, err.msg);
out:
    ds41_kv_seq_free(a);
    ds41_kv_seq_free(b);
    ds41_kv_pool_free(pool);
}

/* A model without DSpark stages refuses taps and drafts. */
static void no_dspark(void) {
    static const char *const off[] = {"dspark_block_size=0"};
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/no-dspark", root);
    ds41_error err = {{0}};
    ds41_model_gen_opts go = {.preset = "tiny", .seed = 5, .sets = off, .n_sets = 1};
    ds41_engine *e = ds41_model_generate(dir, &go, NULL, &err) == 0 ? load(dir, NULL, false, &err) : NULL;
    ds41_kv_pool *pool = e ? ds41_engine_new_pool(e, 0, 0, &err) : NULL;
    ds41_kv_seq *seq = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    if (TAP_CHECK(seq, "no-DSpark model: loads%s", err.msg)) {
        const int32_t tok[2] = {5, 6};
        int32_t ids[4] = {-7, -7, -7, -7};
        ds41_fwd_item it = {.seq = seq, .ids = tok, .n_ids = 2, .spec_taps = true};
        const int rf = ds41_forward(e, &it, 1, NULL, &err);
        TAP_CHECK(rf != 0 && strstr(err.msg, "no DSpark stages") && ds41_kv_seq_tokens(seq) == 0,
                  "no-DSpark model: a forward item with spec_taps is refused, the sequence untouched (%s)",
                  err.msg);
        it.spec_taps = false;
        ds41_draft_req rq = {.seq = seq, .token = 1, .k = 1, .ids = ids};
        const int rd = ds41_forward(e, &it, 1, NULL, &err) == 0 ? ds41_dspark_draft(e, &rq, 1, &err) : 0;
        TAP_CHECK(rd != 0 && strstr(err.msg, "no DSpark stages") && ids[0] == -7,
                  "no-DSpark model: a draft is refused (%s)", err.msg);
    }
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    ds41_engine_free(e);
}

/* ---- the suite on one checkpoint ------------------------------------------------------------------- */

static void suite(model *m, bool sched, bool stream) {
    const batch_arg whole = {.n_seq = 1}, by7 = {.n_seq = 1, .chunk = 7}, by1 = {.n_seq = 1, .chunk = 1};
    const batch_arg batch = {.n_seq = NPROMPT}, hooked = {.n_seq = 3, .chunk = 7, .hooks = true};
    char what[160];
    snprintf(what, sizeof what, "prefill of %zu tokens whole + %zu greedy steps", m->len[0], m->steps);
    compare(m, what, sc_batch, &whole);
    compare(m, "prefill in chunks of 7 + greedy steps", sc_batch, &by7);
    compare(m, "prefill token by token + greedy steps", sc_batch, &by1);
    snprintf(what, sizeof what, "%d prompts of %zu, %zu, %zu, %zu tokens in one call, then decoded together",
             NPROMPT, m->len[0], m->len[1], m->len[2], m->len[3]);
    compare(m, what, sc_batch, &batch);
    compare(m, "3 prompts in chunks of 7 together, then decoded, stream + decision hooks on", sc_batch,
            &hooked);
    compare(m, "a fork inside a page, both branches continuing, a fork of the fork", sc_fork, NULL);
    compare(m, "serialize, restore into the pool and into other pages, continue", sc_snapshot, NULL);
    compare(m, "DSpark drafts (2 sequences with spec_taps, batched and alone) before every greedy step",
            sc_drafts, NULL);
    if (sched) {
        compare(m, "scheduler: 6 concurrent requests", sc_sched_concurrent, NULL);
        compare(m, "scheduler: prefix cache (same prompt, next turn)", sc_sched_prefix, NULL);
        compare(m, "scheduler: disk tier restore and import", sc_sched_disk, NULL);
    }
    if (stream) streamed(m);
}

int main(void) {
    ds41_guard_install_fault_handler();
    test_teeth(); /* first: no threads yet in this process */
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-test-device-guard-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    /* Under the sanitizers, shorter prompts and fewer steps; long's prompt
     * still wraps its window (32) more than once. */
    const bool slow = getenv("DS41_SANITIZED") != NULL;
    /* Twice tiny's width, heads and experts (3 routed per token), a window of
     * 48 and 40 indexed entries. */
    static const char *const wide[] = {"dim=256",
                                       "n_heads=8",
                                       "o_groups=4",
                                       "q_lora_rank=96",
                                       "moe_inter_dim=128",
                                       "n_routed_experts=16",
                                       "n_activated_experts=3",
                                       "index_n_heads=8",
                                       "window_size=48",
                                       "index_topk=40",
                                       "candidate_topk_blocks=12",
                                       "candidate_block_size=4"};
    model m;
    if (TAP_CHECK(model_open(&m, "tiny", NULL, 0, 31, slow ? 24 : 40, slow ? 4 : 6) == 0,
                  "tiny: checkpoint, engines, tokenizer"))
        suite(&m, true, true);
    if (m.plain) draft_api(&m);
    model_close(&m);
    no_dspark();
    if (TAP_CHECK(model_open(&m, "long", NULL, 0, 32, slow ? 70 : 100, slow ? 3 : 5) == 0,
                  "long: checkpoint, engines, tokenizer"))
        suite(&m, true, false);
    model_close(&m);
    if (TAP_CHECK(
            model_open(&m, "wide", wide, sizeof wide / sizeof *wide, 33, slow ? 40 : 64, slow ? 3 : 5) == 0,
            "wide: checkpoint, engines, tokenizer"))
        suite(&m, true, true);
    model_close(&m);
    tmpdir_remove(root);
    return tap_done();
}
