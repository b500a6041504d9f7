/* Speculative decoding's loop (engine/serve/speculative.h, issue 16) with the test oracle as the
 * draft provider, on a generated tiny checkpoint, fast and reference arithmetic:
 *   - greedy speculative output = plain greedy output, tokens and every step's logits bit for bit,
 *     at k = 1..5, at full, partial and no acceptance, with a chunked prefill, from a fork of a
 *     cached prompt (prefix-cache hit), from a snapshot restored mid-conversation, with a stop
 *     token that ends a block mid-way and a max_tokens that ends one; the sequence's final KV
 *     state serializes to the plain run's bytes;
 *   - rollback leaves no trace: a seeded sampling run whose drafts were mostly rejected leaves the
 *     sequence in exactly the state of one that was fed only the kept tokens, and both continue
 *     with the same logits;
 *   - the acceptance rule keeps the distribution: first-token samples with a non-trivial draft q
 *     against the exact distribution p (chi-square, fixed seeds, so it cannot flake);
 *   - adaptive length: the confidence threshold cuts blocks, and a sequence whose drafts are all
 *     rejected backs off (fewer drafted rows than steps). */
#include "engine/forward/forward.h"
#include "engine/model/kv_cache.h"
#include "engine/model/model_gen.h"
#include "engine/serve/generate.h"
#include "engine/serve/scheduler.h"
#include "engine/serve/speculative.h"
#include "engine/text/tokenizer.h"
#include "engine/text/vocab.h"
#include "tap.h"
#include "tmpdir.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PROMPT 21
#define GEN 26
#define MAXT 64

static ds41_tokenizer *TOK;
static uint32_t NV;

typedef struct trace {
    int32_t tokens[MAXT];
    float *logits; /* [MAXT][NV] */
    size_t n;
} trace;

static void on_step(void *ctx, const ds41_generation *g, const ds41_generation_delta *d,
                    const float *logits) {
    (void)g;
    trace *t = ctx;
    if (t->n >= MAXT) return;
    t->tokens[t->n] = (int32_t)d->token;
    memcpy(t->logits + t->n * NV, logits, (size_t)NV * sizeof(float));
    t->n++;
}

/* The oracle's reference: the prompt followed by a run's tokens. */
static void oracle_add_run(ds41_oracle *o, const uint32_t *prompt, size_t np, const trace *t) {
    int32_t ref[PROMPT + MAXT];
    for (size_t i = 0; i < np; i++) ref[i] = (int32_t)prompt[i];
    memcpy(ref + np, t->tokens, t->n * sizeof *ref);
    ds41_error err = {{0}};
    if (ds41_oracle_add(o, ref, np + t->n, &err) != 0) TAP_NOTE("oracle: %s", err.msg);
}

typedef struct run_opts {
    uint32_t max_tokens;
    const uint32_t *stop_ids;
    uint32_t n_stop_ids;
    float temperature;
    uint64_t seed;
    size_t chunk;
    size_t cached; /* > 0: the first `cached` prompt tokens come from a fork of a fed sequence */
    bool restore;  /* the fork above goes through serialize / deserialize */
    const ds41_spec_config *cfg; /* NULL: plain */
    const ds41_draft_provider *prov;
} run_opts;

/* One generation of the prompt; the trace, the final KV bytes (malloc'd) and the stats. */
static int run(ds41_engine *e, ds41_kv_pool *pool, const uint32_t *prompt, const run_opts *o, trace *t,
               uint8_t **kv, size_t *kv_len, ds41_spec_stats *st, ds41_error *err) {
    ds41_generation_params gp = ds41_generation_params_default();
    gp.kind = DS41_GENERATION_IDS;
    gp.ids = prompt;
    gp.n_ids = PROMPT;
    gp.max_tokens = o->max_tokens;
    gp.stop_ids = o->stop_ids;
    gp.n_stop_ids = o->n_stop_ids;
    gp.ignore_eos = true;
    gp.sampler.temperature = o->temperature;
    gp.sampler.has_seed = 1;
    gp.sampler.seed = o->seed;
    if (o->temperature > 0) {
        gp.sampler.top_k = 20;
        gp.sampler.repetition_penalty = 1.2f;
        gp.sampler.frequency_penalty = 0.4f;
    }
    ds41_generation *g = NULL;
    ds41_sampler_scratch *sc = NULL;
    ds41_kv_seq *seq = NULL;
    float *logits = malloc((size_t)(1 + DS41_SPEC_MAX_K) * NV * sizeof(float));
    int rc = ds41_generation_new(TOK, &gp, NV, &g, err);
    if (rc == 0) rc = ds41_sampler_scratch_new(&sc, NV, err);
    if (rc == 0 && o->cached) {
        /* a prefix-cache hit: a sequence fed the first tokens, forked (or snapshot and restored) */
        ds41_kv_seq *base = ds41_kv_seq_new(pool, err);
        int32_t ids[PROMPT];
        for (size_t i = 0; i < o->cached; i++) ids[i] = (int32_t)prompt[i];
        ds41_fwd_item it = {.seq = base, .ids = ids, .n_ids = o->cached};
        rc = base ? ds41_forward(e, &it, 1, NULL, err) : -1;
        if (rc == 0 && o->restore) {
            size_t n = ds41_kv_seq_serialized_size(base), w = 0;
            uint8_t *b = malloc(n);
            rc = ds41_kv_seq_serialize(base, b, n, &w, err);
            if (rc == 0) rc = ds41_kv_seq_deserialize(pool, b, w, &seq, err);
            free(b);
        } else if (rc == 0) {
            seq = ds41_kv_seq_fork(base, err);
            rc = seq ? 0 : -1;
        }
        ds41_kv_seq_free(base);
        if (rc == 0) rc = ds41_generation_mark_cached(g, o->cached, err);
    } else if (rc == 0) {
        seq = ds41_kv_seq_new(pool, err);
        rc = seq ? 0 : -1;
    }
    t->n = 0;
    if (rc == 0)
        rc = ds41_spec_generate(e, seq, g, o->chunk, o->cfg, o->prov, sc, logits, on_step, t, st, err);
    if (rc == 0 && kv) {
        *kv_len = ds41_kv_seq_serialized_size(seq);
        *kv = malloc(*kv_len);
        rc = ds41_kv_seq_serialize(seq, *kv, *kv_len, kv_len, err);
    }
    free(logits);
    ds41_kv_seq_free(seq);
    ds41_sampler_scratch_free(sc);
    ds41_generation_free(g);
    return rc;
}

static void test_greedy(ds41_engine *e, const char *mode) {
    ds41_error err = {{0}};
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 4, &err);
    uint32_t prompt[PROMPT];
    uint64_t x = 99;
    for (int i = 0; i < PROMPT; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        prompt[i] = 3 + (uint32_t)((x >> 33) % (NV - 3));
    }
    trace plain = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    trace spec = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    uint8_t *kv_plain = NULL;
    size_t kv_plain_len = 0;
    run_opts po = {.max_tokens = GEN};
    int rc = run(e, pool, prompt, &po, &plain, &kv_plain, &kv_plain_len, NULL, &err);
    if (!TAP_CHECK(rc == 0 && plain.n == GEN, "%s: plain greedy run (%s)", mode, rc ? err.msg : "ok"))
        goto out;

    /* the oracle knows the plain continuation */
    ds41_oracle *o = ds41_oracle_new(NV, &err);
    oracle_add_run(o, prompt, PROMPT, &plain);
    ds41_draft_provider prov = ds41_oracle_provider(o);

    static const struct {
        uint32_t corrupt;
        const char *what;
    } acc[] = {{0, "full"}, {7, "partial"}, {1, "no"}};
    for (size_t a = 0; a < sizeof acc / sizeof acc[0]; a++) {
        ds41_oracle_set_corruption(o, acc[a].corrupt);
        for (uint32_t k = 1; k <= 5; k++) {
            ds41_spec_config cfg = {.max_k = k, .min_confidence = 0, .max_backoff = 0};
            int ok = 1;
            ds41_spec_stats st;
            const char *fail = "";
            /* variants: plain prefill; chunked prefill; prefix-cache fork; restored snapshot */
            for (int v = 0; v < 4 && ok; v++) {
                run_opts so = {.max_tokens = GEN, .cfg = &cfg, .prov = &prov};
                if (v == 1) so.chunk = 4;
                if (v >= 2) so.cached = PROMPT - 1 - (size_t)k;
                if (v == 3) so.restore = true;
                uint8_t *kv = NULL;
                size_t kv_len = 0;
                memset(&st, 0, sizeof st);
                rc = run(e, pool, prompt, &so, &spec, &kv, &kv_len, &st, &err);
                ok = rc == 0 && spec.n == plain.n &&
                     memcmp(spec.tokens, plain.tokens, plain.n * sizeof(int32_t)) == 0 &&
                     memcmp(spec.logits, plain.logits, plain.n * NV * sizeof(float)) == 0;
                if (!ok) fail = v == 0 ? "plain prefill" : v == 1 ? "chunked" : v == 2 ? "fork" : "restored";
                if (ok && !(kv_len == kv_plain_len && memcmp(kv, kv_plain, kv_len) == 0)) {
                    ok = 0;
                    fail = "final KV state";
                }
                if (ok && acc[a].corrupt == 0 && !(st.drafted > 0 && st.accepted == st.drafted)) {
                    ok = 0;
                    fail = "not every draft accepted";
                }
                if (ok && acc[a].corrupt == 1 && !(st.drafted > 0 && st.accepted == 0)) {
                    ok = 0;
                    fail = "a corrupted draft accepted";
                }
                if (ok && acc[a].corrupt == 7 && !(st.accepted > 0 && st.accepted < st.drafted)) {
                    ok = 0;
                    fail = "acceptance not partial";
                }
                free(kv);
            }
            TAP_CHECK(ok,
                      "%s: greedy speculative = plain greedy (tokens, logits, final KV bytes), k=%u, %s "
                      "acceptance, "
                      "plain / chunked prefill / prefix fork / restored snapshot%s%s%s",
                      mode, k, acc[a].what, ok ? "" : ": ", fail, rc ? err.msg : "");
        }
    }

    /* stop token mid-block and max_tokens inside a block */
    {
        ds41_oracle_set_corruption(o, 0);
        ds41_spec_config cfg = {.max_k = 5};
        const uint32_t stop_id = (uint32_t)plain.tokens[12];
        size_t stop_at = 0;
        while (plain.tokens[stop_at] != (int32_t)stop_id) stop_at++;
        run_opts a = {.max_tokens = GEN, .stop_ids = &stop_id, .n_stop_ids = 1};
        run_opts b = a;
        b.cfg = &cfg;
        b.prov = &prov;
        trace t1 = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
        uint8_t *k1 = NULL, *k2 = NULL;
        size_t l1 = 0, l2 = 0;
        int r1 = run(e, pool, prompt, &a, &t1, &k1, &l1, NULL, &err);
        int r2 = run(e, pool, prompt, &b, &spec, &k2, &l2, NULL, &err);
        TAP_CHECK(
            r1 == 0 && r2 == 0 && t1.n == stop_at + 1 && spec.n == t1.n &&
                memcmp(spec.tokens, t1.tokens, t1.n * sizeof(int32_t)) == 0 && l1 == l2 &&
                memcmp(k1, k2, l1) == 0,
            "%s: a stop token inside a fully accepted block ends it exactly where plain decoding ends (%zu "
            "tokens) and the stop token is not fed",
            mode, t1.n);
        free(k1);
        free(k2);
        a = (run_opts){.max_tokens = 7};
        b = a;
        b.cfg = &cfg;
        b.prov = &prov;
        k1 = k2 = NULL;
        r1 = run(e, pool, prompt, &a, &t1, &k1, &l1, NULL, &err);
        r2 = run(e, pool, prompt, &b, &spec, &k2, &l2, NULL, &err);
        TAP_CHECK(r1 == 0 && r2 == 0 && t1.n == 7 && spec.n == 7 &&
                      memcmp(spec.tokens, t1.tokens, 7 * sizeof(int32_t)) == 0 && l1 == l2 &&
                      memcmp(k1, k2, l1) == 0,
                  "%s: max_tokens 7 with k=5 drafts ends inside a block as plain decoding does", mode);
        free(k1);
        free(k2);
        free(t1.logits);
    }

    /* adaptive length: confidence threshold and back-off */
    {
        ds41_oracle_set_corruption(o, 1); /* every draft rejected */
        ds41_spec_config cfg = {.max_k = 4, .max_backoff = 8};
        run_opts so = {.max_tokens = GEN, .cfg = &cfg, .prov = &prov};
        ds41_spec_stats st = {0};
        rc = run(e, pool, prompt, &so, &spec, NULL, NULL, &st, &err);
        TAP_CHECK(rc == 0 && spec.n == plain.n &&
                      memcmp(spec.tokens, plain.tokens, plain.n * sizeof(int32_t)) == 0 && st.accepted == 0 &&
                      st.steps > 0 && st.steps <= 6,
                  "%s: rejected blocks back off (%llu verification blocks over %zu tokens, output unchanged)",
                  mode, (unsigned long long)st.steps, spec.n);
    }
    ds41_oracle_free(o);
out:
    free(kv_plain);
    free(plain.logits);
    free(spec.logits);
    ds41_kv_pool_free(pool);
}

/* A provider wrapping the oracle with confidences 1, 0.9, 0.5, 0.2, ... per row. */
static int conf_draft(void *ctx, const ds41_draft_request *reqs, size_t n, ds41_draft *out, ds41_error *err) {
    const ds41_draft_provider *inner = ctx;
    if (inner->draft(inner->ctx, reqs, n, out, err) != 0) return -1;
    static const float conf[] = {1.0f, 0.9f, 0.5f, 0.2f, 0.1f, 0.1f, 0.1f, 0.1f};
    for (size_t i = 0; i < n; i++)
        for (uint32_t r = 0; r < out[i].k; r++) out[i].confidence[r] = conf[r];
    return 0;
}

static void test_confidence(ds41_engine *e) {
    ds41_error err = {{0}};
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    uint32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = 5 + (uint32_t)i * 13;
    trace plain = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    trace spec = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    run_opts po = {.max_tokens = 12};
    int rc = run(e, pool, prompt, &po, &plain, NULL, NULL, NULL, &err);
    ds41_oracle *o = ds41_oracle_new(NV, &err);
    oracle_add_run(o, prompt, PROMPT, &plain);
    ds41_draft_provider inner = ds41_oracle_provider(o);
    ds41_draft_provider prov = {.name = "conf", .draft = conf_draft, .ctx = &inner};
    ds41_spec_config cfg = {.max_k = 5, .min_confidence = 0.6f};
    run_opts so = {.max_tokens = 12, .cfg = &cfg, .prov = &prov};
    ds41_spec_stats st = {0};
    if (rc == 0) rc = run(e, pool, prompt, &so, &spec, NULL, NULL, &st, &err);
    TAP_CHECK(rc == 0 && spec.n == plain.n &&
                  memcmp(spec.tokens, plain.tokens, plain.n * sizeof(int32_t)) == 0 && st.steps > 0 &&
                  st.drafted <= 2 * st.steps && st.hist[2] > 0 && st.hist[3] == 0,
              "a block stops at the first draft below min_confidence 0.6 (%llu drafts in %llu blocks)",
              (unsigned long long)st.drafted, (unsigned long long)st.steps);
    ds41_oracle_free(o);
    free(plain.logits);
    free(spec.logits);
    ds41_kv_pool_free(pool);
}

/* Rollback leaves no trace: a sampled run with a non-trivial q (many rejections) ends in the state
 * of a sequence fed only the tokens that stood; both continue alike. */
static void test_no_trace(ds41_engine *e, const char *mode) {
    ds41_error err = {{0}};
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 4, &err);
    uint32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = 7 + (uint32_t)i * 31 % (NV - 7);
    float *q = calloc(NV, sizeof *q);
    for (uint32_t i = 0; i < NV; i++) q[i] = 1.0f + (float)(i % 7);
    ds41_oracle *o = ds41_oracle_new(NV, &err);
    ds41_oracle_set_q(o, q, 5, &err);
    ds41_draft_provider prov = ds41_oracle_provider(o);
    ds41_spec_config cfg = {.max_k = 3};
    run_opts so = {.max_tokens = GEN, .temperature = 0.8f, .seed = 17, .cfg = &cfg, .prov = &prov};
    trace t = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    uint8_t *kv = NULL;
    size_t kv_len = 0;
    ds41_spec_stats st = {0};
    int rc = run(e, pool, prompt, &so, &t, &kv, &kv_len, &st, &err);
    int ok = rc == 0 && t.n == GEN && st.drafted > st.accepted;
    /* the never-drafted sequence: prompt + generated tokens but the last */
    int32_t ids[PROMPT + MAXT];
    for (int i = 0; i < PROMPT; i++) ids[i] = (int32_t)prompt[i];
    memcpy(ids + PROMPT, t.tokens, t.n * sizeof *ids);
    ds41_kv_seq *b = ds41_kv_seq_new(pool, &err);
    ds41_fwd_item it = {.seq = b, .ids = ids, .n_ids = PROMPT + t.n - 1};
    if (ok) ok = ds41_forward(e, &it, 1, NULL, &err) == 0;
    size_t lb = ds41_kv_seq_serialized_size(b), wb = 0;
    uint8_t *kb = malloc(lb);
    if (ok) ok = ds41_kv_seq_serialize(b, kb, lb, &wb, &err) == 0 && wb == kv_len && memcmp(kb, kv, wb) == 0;
    /* both continue with the last token and three more */
    ds41_kv_seq *a = NULL;
    if (ok) ok = ds41_kv_seq_deserialize(pool, kv, kv_len, &a, &err) == 0;
    if (ok) {
        int32_t more[4] = {ids[PROMPT + t.n - 1], 9, 10, 11};
        float *la = malloc((size_t)4 * NV * sizeof(float)), *lb2 = malloc((size_t)4 * NV * sizeof(float));
        ds41_fwd_item ia = {.seq = a, .ids = more, .n_ids = 4, .logits = la};
        ds41_fwd_item ib = {.seq = b, .ids = more, .n_ids = 4, .logits = lb2};
        ok = ds41_forward(e, &ia, 1, NULL, &err) == 0 && ds41_forward(e, &ib, 1, NULL, &err) == 0 &&
             memcmp(la, lb2, (size_t)4 * NV * sizeof(float)) == 0;
        free(la);
        free(lb2);
    }
    TAP_CHECK(ok,
              "%s: seeded sampling with rejected drafts (%llu drafted, %llu accepted) leaves the state of a "
              "sequence "
              "that never drafted; both continue with the same logits%s%s",
              mode, (unsigned long long)st.drafted, (unsigned long long)st.accepted, ok ? "" : ": ", err.msg);
    /* reproducible: the same seed and drafts give the same tokens */
    ds41_oracle_free(o);
    o = ds41_oracle_new(NV, &err);
    ds41_oracle_set_q(o, q, 5, &err);
    prov = ds41_oracle_provider(o);
    trace t2 = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    rc = run(e, pool, prompt, &so, &t2, NULL, NULL, NULL, &err);
    TAP_CHECK(rc == 0 && t2.n == t.n && memcmp(t2.tokens, t.tokens, t.n * sizeof(int32_t)) == 0,
              "%s: seeded speculative sampling is reproducible", mode);
    free(t2.logits);
    ds41_kv_seq_free(a);
    ds41_kv_seq_free(b);
    free(kb);
    free(kv);
    free(t.logits);
    free(q);
    ds41_oracle_free(o);
    ds41_kv_pool_free(pool);
}

/* The acceptance rule keeps p: N first tokens sampled speculatively (drafts from q) against the
 * exact p of the sampler (top_k 6 over the model's logits: 6 cells).  Chi-square with 5 degrees
 * of freedom at significance 0.001 (critical value 20.515); the seeds are fixed, so the statistic
 * is one fixed number. */
static void test_distribution(ds41_engine *e) {
    ds41_error err = {{0}};
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    ds41_kv_seq *seq = ds41_kv_seq_new(pool, &err);
    int32_t prompt[5] = {11, 12, 13, 14, 15};
    float *logits = malloc((size_t)NV * sizeof(float));
    ds41_fwd_item it = {.seq = seq, .ids = prompt, .n_ids = 5, .logits = logits, .logits_last_only = true};
    int rc = ds41_forward(e, &it, 1, NULL, &err);
    /* flatten the model's logits (random weights make them peaked) so every kept token matters */
    for (uint32_t i = 0; i < NV; i++) logits[i] *= 0.05f;
    ds41_sampler_params sp = ds41_sampler_params_default();
    sp.temperature = 1.0f;
    sp.top_k = 6;
    sp.has_seed = 1;
    sp.seed = 2024;
    ds41_sampler *s = NULL;
    ds41_sampler_scratch *sc = NULL;
    if (rc == 0) rc = ds41_sampler_new(&s, &sp, NV, &err);
    if (rc == 0) rc = ds41_sampler_scratch_new(&sc, NV, &err);
    uint64_t *w = malloc((size_t)NV * sizeof *w);
    if (rc == 0) rc = ds41_sampler_weights(s, sc, logits, NV, w, &err);
    /* exact p: the 6 largest weights (ties to the lower id), normalized */
    uint32_t cell[6];
    double p[6], mass = 0;
    for (int c = 0; c < 6 && rc == 0; c++) {
        uint32_t best = UINT32_MAX;
        for (uint32_t i = 0; i < NV; i++) {
            bool used = false;
            for (int d = 0; d < c; d++) used |= cell[d] == i;
            if (!used && (best == UINT32_MAX || w[i] > w[best])) best = i;
        }
        cell[c] = best;
        p[c] = (double)w[best];
        mass += p[c];
    }
    for (int c = 0; c < 6; c++) p[c] /= mass;
    /* q: half its mass on the least likely kept token, the rest spread over 20 tokens (some outside
     * the kept set) -- far from p */
    float *q = calloc(NV, sizeof *q);
    q[cell[5]] = 0.5f;
    for (int i = 0; i < 20; i++) q[(cell[0] + 1 + (uint32_t)i * 37) % NV] += 0.025f;
    for (int c = 0; c < 5; c++) q[cell[c]] += 0.01f;
    enum { N = 20000 };
    static const struct {
        const char *what;
        bool with_q;
    } kinds[] = {{"drafts from a non-trivial q", true}, {"a deterministic draft (q one-hot)", false}};
    for (size_t kd = 0; kd < 2 && rc == 0; kd++) {
        ds41_oracle *o = ds41_oracle_new(NV, &err);
        ds41_oracle_set_q(o, q, 77 + kd, &err);
        ds41_draft_provider prov = ds41_oracle_provider(o);
        uint64_t count[6] = {0}, outside = 0, acc = 0;
        for (int n = 0; n < N && rc == 0; n++) {
            ds41_draft_request rq = {.seq = seq, .context = prompt, .n_context = 5, .last = 15, .max_k = 1};
            ds41_draft d;
            rc = prov.draft(prov.ctx, &rq, 1, &d, &err);
            ds41_sample_result res;
            int a = 0;
            /* the deterministic kind drafts the second most likely kept token, always */
            const uint32_t draft = kinds[kd].with_q ? (uint32_t)d.ids[0] : cell[1];
            if (rc == 0)
                rc = ds41_sampler_sample_draft(s, sc, logits, NV, draft, kinds[kd].with_q ? d.q : NULL, &res,
                                               &a, &err);
            acc += (uint64_t)a;
            int c = 0;
            while (c < 6 && cell[c] != res.token) c++;
            if (c == 6)
                outside++;
            else
                count[c]++;
        }
        double chi2 = 0;
        for (int c = 0; c < 6; c++) {
            const double exp_n = p[c] * N;
            chi2 += ((double)count[c] - exp_n) * ((double)count[c] - exp_n) / exp_n;
        }
        TAP_CHECK(
            rc == 0 && outside == 0 && chi2 < 20.515 && acc > 0 && acc < N,
            "speculative sampling with %s keeps the sampler's distribution: chi-square %.2f < 20.515 (5 dof, "
            "p = 0.001), %llu/%d drafts accepted, %llu tokens outside the kept set",
            kinds[kd].what, chi2, (unsigned long long)acc, N, (unsigned long long)outside);
        ds41_oracle_free(o);
    }
    free(q);
    free(w);
    free(logits);
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
}

/* ---- continuous batching: 16 concurrent seeded greedy clients ---------------------------------- */

#define CLIENTS 16
#define CGEN 14

typedef struct crec {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[MAXT];
    size_t n;
    bool done;
    ds41_sched_status status;
    char message[200];
} crec;

static void c_delta(void *ctx, const ds41_generation *g, const ds41_generation_delta *d) {
    (void)g;
    crec *r = ctx;
    pthread_mutex_lock(&r->mu);
    if (r->n < MAXT) r->tokens[r->n++] = (int32_t)d->token;
    pthread_mutex_unlock(&r->mu);
}

static void c_done(void *ctx, const ds41_generation *g, ds41_sched_status status, const char *message) {
    (void)g;
    crec *r = ctx;
    pthread_mutex_lock(&r->mu);
    snprintf(r->message, sizeof r->message, "%s", message ? message : "");
    r->done = true;
    r->status = status;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* Runs CLIENTS requests through a scheduler; 0 when all finished. */
static int sched_run(ds41_engine *e, const ds41_sched_config *cfg, uint32_t prompts[CLIENTS][PROMPT],
                     crec *recs, ds41_sched_stats *st, ds41_error *err) {
    ds41_scheduler *s = NULL;
    if (ds41_scheduler_new(e, cfg, &s, err) != 0) return -1;
    int rc = 0;
    for (int c = 0; c < CLIENTS; c++) {
        memset(&recs[c], 0, sizeof recs[c]);
        pthread_mutex_init(&recs[c].mu, NULL);
        pthread_cond_init(&recs[c].cv, NULL);
        ds41_generation_params gp = ds41_generation_params_default();
        gp.kind = DS41_GENERATION_IDS;
        gp.ids = prompts[c];
        /* clients 8.. share their first tokens with clients 0..: prefix-cache hits */
        gp.n_ids = PROMPT - (size_t)(c % 3);
        gp.max_tokens = CGEN + (uint32_t)(c % 4);
        gp.ignore_eos = true;
        gp.sampler.temperature = 0;
        ds41_generation *g = NULL;
        if (ds41_generation_new(TOK, &gp, NV, &g, err) != 0) return -1;
        ds41_sched_sink sink = {.delta = c_delta, .done = c_done, .ctx = &recs[c]};
        uint64_t id;
        if (ds41_scheduler_submit(s, g, &sink, &id, err) != DS41_SCHED_DONE) rc = -1;
    }
    for (int c = 0; c < CLIENTS; c++) {
        pthread_mutex_lock(&recs[c].mu);
        while (!recs[c].done) pthread_cond_wait(&recs[c].cv, &recs[c].mu);
        pthread_mutex_unlock(&recs[c].mu);
        if (recs[c].status != DS41_SCHED_DONE) {
            TAP_NOTE("client %d ended with status %d: %s", c, (int)recs[c].status, recs[c].message);
            rc = -1;
        }
    }
    ds41_scheduler_stats(s, st);
    ds41_scheduler_free(s, 0);
    return rc;
}

static void test_scheduler(ds41_engine *e, const char *mode) {
    ds41_error err = {{0}};
    uint32_t prompts[CLIENTS][PROMPT];
    uint64_t x = 4242;
    for (int c = 0; c < CLIENTS; c++)
        for (int i = 0; i < PROMPT; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            prompts[c][i] =
                c >= 8 && i < PROMPT - 4 ? prompts[c - 8][i] : 3 + (uint32_t)((x >> 33) % (NV - 3));
        }
    ds41_sched_config cfg = {.max_sequences = 5,
                             .max_batch_tokens = 24,
                             .prefill_chunk = 6,
                             .max_queue = 64,
                             .prefix_cache = true};
    static crec plain[CLIENTS], spec[CLIENTS];
    ds41_sched_stats st;
    int rc = sched_run(e, &cfg, prompts, plain, &st, &err);
    if (!TAP_CHECK(rc == 0, "%s: %d concurrent plain greedy clients (%s)", mode, CLIENTS,
                   rc ? err.msg : "ok"))
        return;
    ds41_oracle *o = ds41_oracle_new(NV, &err);
    for (int c = 0; c < CLIENTS; c++) {
        trace t = {.n = plain[c].n};
        memcpy(t.tokens, plain[c].tokens, t.n * sizeof *t.tokens);
        oracle_add_run(o, prompts[c], PROMPT - (size_t)(c % 3), &t);
    }
    ds41_oracle_set_corruption(o, 7);
    cfg.spec = (ds41_spec_config){.max_k = 4, .max_backoff = 4};
    cfg.draft = ds41_oracle_provider(o);
    rc = sched_run(e, &cfg, prompts, spec, &st, &err);
    int same = rc == 0;
    for (int c = 0; c < CLIENTS && same; c++) {
        same = spec[c].n == plain[c].n &&
               memcmp(spec[c].tokens, plain[c].tokens, plain[c].n * sizeof(int32_t)) == 0;
        if (!same) {
            TAP_NOTE("client %d: %zu tokens, plain %zu", c, spec[c].n, plain[c].n);
            for (size_t i = 0; i < spec[c].n && i < plain[c].n; i++)
                if (spec[c].tokens[i] != plain[c].tokens[i]) {
                    TAP_NOTE("first difference at token %zu: %d, plain %d", i, spec[c].tokens[i],
                             plain[c].tokens[i]);
                    break;
                }
        }
    }
    TAP_CHECK(same && st.spec_accepted > 0 && st.spec_accepted < st.spec_drafted && st.spec_steps > 0,
              "%s: %d concurrent seeded greedy clients with speculation (k=4, partial acceptance, prefill "
              "chunks and "
              "prefix-cache hits in the same steps) get exactly their plain tokens (%llu blocks, %llu "
              "drafted, %llu "
              "accepted)%s%s",
              mode, CLIENTS, (unsigned long long)st.spec_steps, (unsigned long long)st.spec_drafted,
              (unsigned long long)st.spec_accepted, rc ? ": " : "", rc ? err.msg : "");
    uint64_t hist_blocks = 0, hist_acc = 0;
    for (unsigned a = 0; a <= DS41_SPEC_MAX_K; a++) {
        hist_blocks += st.spec_hist[a];
        hist_acc += a * st.spec_hist[a];
    }
    TAP_CHECK(hist_blocks == st.spec_steps && hist_acc == st.spec_accepted,
              "%s: the accepted-length histogram adds up to the blocks and the accepted drafts", mode);
    for (int c = 0; c < CLIENTS; c++) {
        pthread_mutex_destroy(&plain[c].mu);
        pthread_cond_destroy(&plain[c].cv);
        pthread_mutex_destroy(&spec[c].mu);
        pthread_cond_destroy(&spec[c].cv);
    }
    ds41_oracle_free(o);
}

/* A provider that feeds the taps and never drafts: plain decoding with the head's stage windows. */
static int no_drafts(void *ctx, const ds41_draft_request *reqs, size_t n, ds41_draft *out, ds41_error *err) {
    (void)ctx;
    (void)reqs;
    (void)err;
    memset(out, 0, n * sizeof *out);
    return 0;
}

/* The daemon's provider is the model's DSpark head: refused without one; with one it drafts
 * (engine/forward/dspark.h: the forward items carry spec_taps) and the output is plain decoding's,
 * tokens and every step's logits, at every k. */
static void test_head_provider(ds41_engine *e, const char *mode, const char *root) {
    ds41_error err = {{0}};
    ds41_draft_provider prov;
    int rc = ds41_spec_head_provider(e, &prov, &err);
    TAP_CHECK(rc != 0 || prov.taps, "the head's provider asks for the DSpark taps");
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, &err);
    uint32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++) prompt[i] = 40 + (uint32_t)i;
    trace a = {.logits = malloc((size_t)MAXT * NV * sizeof(float))},
          b = {.logits = malloc((size_t)MAXT * NV * sizeof(float))};
    /* plain decoding that feeds the taps: the stage windows a never-drafting sequence has */
    ds41_draft_provider taps_only = prov;
    taps_only.draft = no_drafts;
    ds41_spec_config cfg0 = {.max_k = 5};
    run_opts po = {.max_tokens = 12, .cfg = &cfg0, .prov = &taps_only};
    uint8_t *kv_plain = NULL;
    size_t kv_plain_len = 0;
    if (rc == 0) rc = run(e, pool, prompt, &po, &a, &kv_plain, &kv_plain_len, NULL, &err);
    for (uint32_t k = 1; k <= 5; k++) {
        ds41_spec_config cfg = {.max_k = k};
        run_opts so = {.max_tokens = 12, .cfg = &cfg, .prov = &prov};
        ds41_spec_stats st = {0};
        uint8_t *kv = NULL;
        size_t kv_len = 0;
        int krc = rc == 0 ? run(e, pool, prompt, &so, &b, &kv, &kv_len, &st, &err) : rc;
        TAP_CHECK(krc == 0 && a.n == b.n && memcmp(a.tokens, b.tokens, a.n * sizeof(int32_t)) == 0 &&
                      memcmp(a.logits, b.logits, a.n * NV * sizeof(float)) == 0 && st.drafted > 0,
                  "%s, k=%u: the DSpark head drafts (%llu drafted, %llu accepted) and the output is plain "
                  "decoding's, tokens and logits (%s)",
                  mode, k, (unsigned long long)st.drafted, (unsigned long long)st.accepted, krc ? err.msg : "ok");
        TAP_CHECK(krc == 0 && kv && kv_len == kv_plain_len && memcmp(kv, kv_plain, kv_len) == 0,
                  "%s, k=%u: the rejected drafts left no trace: the sequence (the head's stage windows "
                  "included) serializes to the bytes of one that never drafted",
                  mode, k);
        free(kv);
    }
    free(kv_plain);
    free(a.logits);
    free(b.logits);
    ds41_kv_pool_free(pool);
    if (!root) return;
    /* a model without DSpark */
    char dir[600];
    snprintf(dir, sizeof dir, "%s/nodspark", root);
    const char *sets[] = {"dspark_block_size=0",
                          "n_mtp_layers=0",
                          "dspark_target_layer_ids=[]",
                          "dspark_n_routed_experts=0",
                          "dspark_n_activated_experts=0",
                          "dspark_markov_rank=0",
                          "compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1, 1]"};
    ds41_model_gen_opts mo = {
        .preset = "tiny", .seed = 4, .sets = sets, .n_sets = sizeof sets / sizeof sets[0]};
    ds41_engine *e2 = NULL;
    if (ds41_model_generate(dir, &mo, NULL, &err) == 0) e2 = ds41_engine_load(dir, NULL, &err);
    memset(&err, 0, sizeof err);
    rc = e2 ? ds41_spec_head_provider(e2, &prov, &err) : 0;
    TAP_CHECK(e2 && rc != 0 && strstr(err.msg, "dspark_block_size is 0"),
              "a model without DSpark refuses speculative decoding (%s)", err.msg);
    ds41_engine_free(e2);
}

int main(void) {
    char root[512];
    if (!tmpdir_make(root, sizeof root, "TMPDIR", "ds41-spec-XXXXXX")) {
        TAP_CHECK(0, "mkdtemp");
        return tap_done();
    }
    char dir[600];
    snprintf(dir, sizeof dir, "%s/tiny", root);
    ds41_error err = {{0}};
    ds41_model_gen_opts mo = {.preset = "tiny", .seed = 4};
    ds41_vocab *v = NULL;
    if (ds41_model_generate(dir, &mo, NULL, &err) == 0) v = ds41_vocab_load_dir(dir, &err);
    if (v) TOK = ds41_tokenizer_new(v, &err);
    if (!TAP_CHECK(TOK != NULL, "tiny checkpoint and tokenizer (%s)", TOK ? "ok" : err.msg)) {
        tmpdir_remove(root);
        return tap_done();
    }
    for (int m = 0; m < 2; m++) {
        ds41_engine_opts eo = {.reference = m == 1, .cpu = {.threads = 2}};
        ds41_engine *e = ds41_engine_load(dir, &eo, &err);
        if (!TAP_CHECK(e != NULL, "engine (%s)", e ? "ok" : err.msg)) continue;
        NV = (uint32_t)ds41_engine_config(e)->vocab_size;
        const char *mode = m ? "reference" : "fast";
        test_greedy(e, mode);
        test_no_trace(e, mode);
        test_scheduler(e, mode);
        if (m == 0) {
            test_confidence(e);
            test_distribution(e);
        }
        test_head_provider(e, mode, m == 0 ? root : NULL);
        ds41_engine_free(e);
    }
    ds41_tokenizer_free(TOK);
    ds41_vocab_free(v);
    tmpdir_remove(root);
    return tap_done();
}
