/* Sampler on fixed logits: parameter checks, greedy ties, seeded reproducibility and the
 * documented PRNG, the fast path against a full-sort reference, empirical distributions
 * (chi-square with fixed seeds, so the test is deterministic), penalties and logit_bias against
 * their formulas, logprobs against log-softmax, snapshot / restore, error handling, timing. */
#include "engine/model/pcg64.h"
#include "engine/serve/sampler.h"
#include "tests/tap.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BIG_VOCAB 129280u

/* ---------------------------------------------------------------------------------------------
 * helpers */
static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double uniform(uint64_t *x) {
    return (double)(splitmix(x) >> 11) * 0x1p-53;
}
/* Roughly LM-shaped logits: normal bulk, a few strong candidates. */
static void random_logits(float *l, uint32_t n, uint64_t seed) {
    uint64_t x = seed;
    for (uint32_t i = 0; i < n; i++) {
        const double u1 = uniform(&x) + 1e-300, u2 = uniform(&x);
        l[i] = (float)(2.5 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    for (int k = 0; k < 8; k++) l[splitmix(&x) % n] += (float)(6.0 + 4.0 * uniform(&x));
}

static ds41_sampler *make(const ds41_sampler_params *p, uint32_t n) {
    ds41_error err = {{0}};
    ds41_sampler *s = NULL;
    if (ds41_sampler_new(&s, p, n, &err) != 0) TAP_NOTE("ds41_sampler_new: %s", err.msg);
    return s;
}

static ds41_sampler_scratch *scratch_for(uint32_t n) {
    ds41_sampler_scratch *sc = NULL;
    ds41_error err = {{0}};
    if (ds41_sampler_scratch_new(&sc, n, &err) != 0) TAP_NOTE("scratch: %s", err.msg);
    return sc;
}

static uint32_t draw(ds41_sampler *s, ds41_sampler_scratch *sc, const float *l, uint32_t n) {
    ds41_sample_result r;
    ds41_error err = {{0}};
    if (ds41_sampler_sample(s, sc, l, n, &r, &err) != 0) {
        TAP_NOTE("sample: %s", err.msg);
        return UINT32_MAX;
    }
    return r.token;
}

/* Expected probabilities by the definitions, in double: softmax at temperature t, then top_k
 * (prefix of probability order, ties lower id), top_p over the renormalized top_k set (smallest
 * prefix reaching top_p), min_p (p >= min_p * p_max), renormalized. */
typedef struct order_item {
    double p;
    uint32_t id;
} order_item;
static int cmp_item(const void *a, const void *b) {
    const order_item *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return (x->id > y->id) - (x->id < y->id);
}
static void expected_distribution(const float *l, uint32_t n, double t, uint32_t top_k, double top_p,
                                  double min_p, double *out) {
    double mx = -INFINITY;
    for (uint32_t i = 0; i < n; i++) mx = fmax(mx, l[i]);
    order_item *it = malloc(n * sizeof *it);
    for (uint32_t i = 0; i < n; i++) it[i] = (order_item){exp(((double)l[i] - mx) / t), i};
    qsort(it, n, sizeof *it, cmp_item);
    uint32_t m = top_k > 0 && top_k < n ? top_k : n;
    double zs = 0;
    for (uint32_t i = 0; i < m; i++) zs += it[i].p;
    if (top_p < 1.0) {
        double c = 0;
        uint32_t j = 0;
        while (j < m) {
            c += it[j].p / zs;
            j++;
            if (c >= top_p) break;
        }
        m = j;
    }
    uint32_t j = 0;
    while (j < m && it[j].p >= min_p * it[0].p) j++;
    m = j;
    double zk = 0;
    for (uint32_t i = 0; i < m; i++) zk += it[i].p;
    for (uint32_t i = 0; i < n; i++) out[i] = 0;
    for (uint32_t i = 0; i < m; i++) out[it[i].id] = it[i].p / zk;
    free(it);
}

/* Draws `draws` tokens and returns the chi-square statistic against expect (cells with expected
 * probability 0 must stay empty: *outside counts draws that landed there). */
static double chi_square(ds41_sampler *s, ds41_sampler_scratch *sc, const float *l, uint32_t n,
                         const double *expect, uint32_t draws, uint32_t *outside, uint32_t *cells) {
    uint32_t *count = calloc(n, sizeof *count);
    for (uint32_t k = 0; k < draws; k++) {
        const uint32_t t = draw(s, sc, l, n);
        if (t < n) count[t]++;
    }
    double chi = 0;
    *outside = 0;
    *cells = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (expect[i] == 0) {
            *outside += count[i];
            continue;
        }
        const double e = expect[i] * draws;
        chi += (count[i] - e) * (count[i] - e) / e;
        (*cells)++;
    }
    free(count);
    return chi;
}

/* Generous bound: df + 8 sqrt(2 df) + 8 (far above the 1e-9 quantile for these dfs; a wrong
 * distribution with 200,000 draws lands orders of magnitude higher). */
static int chi_ok(double chi, uint32_t cells) {
    const double df = cells > 1 ? cells - 1 : 1;
    return chi < df + 8.0 * sqrt(2.0 * df) + 8.0;
}

/* ---------------------------------------------------------------------------------------------
 * parameter checks */
static void test_params(void) {
    ds41_error err = {{0}};
    ds41_sampler_params p = ds41_sampler_params_default();
    TAP_CHECK(ds41_sampler_params_check(&p, 100, &err) == 0, "default parameters are valid");

    int ok = 1;
    const char *first_bad = NULL;
#define BAD(field, stmt)                                                                                     \
    do {                                                                                                     \
        ds41_sampler_params q = ds41_sampler_params_default();                                               \
        stmt;                                                                                                \
        err.msg[0] = 0;                                                                                      \
        if (ds41_sampler_params_check(&q, 100, &err) == 0 || !strstr(err.msg, field)) {                      \
            ok = 0;                                                                                          \
            if (!first_bad) first_bad = #stmt;                                                               \
        }                                                                                                    \
    } while (0)
    BAD("temperature", q.temperature = -0.5f);
    BAD("temperature", q.temperature = NAN);
    BAD("temperature", q.temperature = INFINITY);
    BAD("top_p", q.top_p = 1.5f);
    BAD("top_p", q.top_p = -0.1f);
    BAD("top_p", q.top_p = NAN);
    BAD("min_p", q.min_p = 2.0f);
    BAD("min_p", q.min_p = NAN);
    BAD("repetition_penalty", q.repetition_penalty = 0.0f);
    BAD("repetition_penalty", q.repetition_penalty = -1.0f);
    BAD("repetition_penalty", q.repetition_penalty = INFINITY);
    BAD("repetition_window", q.repetition_window = DS41_SAMPLER_MAX_WINDOW + 1);
    BAD("presence_penalty", q.presence_penalty = NAN);
    BAD("frequency_penalty", q.frequency_penalty = -INFINITY);
    BAD("top_logprobs", q.top_logprobs = 3);
    BAD("top_logprobs", (q.logprobs = 1, q.top_logprobs = DS41_SAMPLER_MAX_TOP_LOGPROBS + 1));
    BAD("logprobs_mode", q.logprobs_mode = (ds41_logprobs_mode)7);
    static const ds41_logit_bias dup[2] = {{5, 1.0f}, {5, 2.0f}};
    static const ds41_logit_bias oor[1] = {{100, 1.0f}};
    static const ds41_logit_bias nonfinite[1] = {{3, NAN}};
    BAD("logit_bias", (q.logit_bias = dup, q.n_logit_bias = 2));
    BAD("logit_bias", (q.logit_bias = oor, q.n_logit_bias = 1));
    BAD("logit_bias", (q.logit_bias = nonfinite, q.n_logit_bias = 1));
    BAD("logit_bias", (q.logit_bias = NULL, q.n_logit_bias = 1));
    BAD("logit_bias", (q.logit_bias = dup, q.n_logit_bias = DS41_SAMPLER_MAX_LOGIT_BIAS + 1));
#undef BAD
    TAP_CHECK(ok, "invalid parameters are refused with a message naming the field (first failure: %s)",
              first_bad ? first_bad : "none");
    TAP_CHECK(ds41_sampler_params_check(&p, 0, &err) != 0 && strstr(err.msg, "vocabulary") &&
                  ds41_sampler_params_check(&p, DS41_SAMPLER_MAX_VOCAB + 1, &err) != 0,
              "vocabulary sizes 0 and above the maximum are refused");
    ds41_sampler *s = (ds41_sampler *)1;
    p.temperature = -1;
    TAP_CHECK(ds41_sampler_new(&s, &p, 100, &err) != 0 && s == NULL,
              "ds41_sampler_new refuses invalid parameters and leaves NULL");
}

/* ---------------------------------------------------------------------------------------------
 * greedy */
static void test_greedy(void) {
    ds41_sampler_scratch *sc = scratch_for(16);
    const float l[10] = {0.5f, 1.0f, -2.0f, 3.0f, 3.0f - 1e-6f, 0.0f, -INFINITY, 3.0f, 2.9f, 3.0f};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.temperature = 0;
    p.top_k = 2;
    p.top_p = 0.1f;
    p.min_p = 0.9f;
    p.has_seed = 1;
    p.seed = 1;
    ds41_sampler *s = make(&p, 10);
    int ok = 1;
    for (int i = 0; i < 5; i++) ok &= draw(s, sc, l, 10) == 3;
    TAP_CHECK(ok, "greedy: argmax with ties (ids 3, 7, 9) going to the lowest id, every time");
    ds41_sampler_free(s);

    const ds41_logit_bias bias[1] = {{9, 0.25f}};
    p.logit_bias = bias;
    p.n_logit_bias = 1;
    s = make(&p, 10);
    TAP_CHECK(draw(s, sc, l, 10) == 9, "greedy: logit_bias applies before the argmax");
    ds41_sampler_free(s);

    p = ds41_sampler_params_default();
    p.temperature = 0;
    p.frequency_penalty = 0.5f;
    s = make(&p, 10);
    ds41_error err;
    ds41_sampler_accept(s, 3, &err);
    TAP_CHECK(draw(s, sc, l, 10) == 7, "greedy: penalties apply before the argmax (3 penalized -> 7)");
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
}

/* ---------------------------------------------------------------------------------------------
 * reproducibility and the documented PRNG */
static void test_seeds(void) {
    const uint32_t n = 1000;
    float *l = malloc(n * sizeof *l);
    random_logits(l, n, 11);
    ds41_sampler_scratch *sc = scratch_for(n);
    ds41_sampler_params p = ds41_sampler_params_default();
    p.temperature = 1.3f;
    p.has_seed = 1;
    p.seed = 123456789;
    ds41_sampler *a = make(&p, n), *b = make(&p, n);
    p.seed = 123456790;
    ds41_sampler *c = make(&p, n);
    int same = 1, differ = 0;
    for (int i = 0; i < 2000; i++) {
        const uint32_t ta = draw(a, sc, l, n), tb = draw(b, sc, l, n), tc = draw(c, sc, l, n);
        same &= ta == tb;
        differ += ta != tc;
    }
    TAP_CHECK(same, "the same seed gives the same 2000 tokens");
    TAP_CHECK(differ > 1000, "a different seed gives a different sequence (%d of 2000 differ)", differ);
    TAP_CHECK(ds41_sampler_seed(a) == 123456789, "ds41_sampler_seed reports the given seed");
    ds41_sampler_free(a);
    ds41_sampler_free(b);
    ds41_sampler_free(c);

    /* unseeded: a seed is drawn and reported; replaying with it gives the same tokens */
    p.has_seed = 0;
    a = make(&p, n);
    p.has_seed = 1;
    p.seed = ds41_sampler_seed(a);
    b = make(&p, n);
    same = 1;
    for (int i = 0; i < 500; i++) same &= draw(a, sc, l, n) == draw(b, sc, l, n);
    TAP_CHECK(same, "an unseeded sampler reports its drawn seed (%" PRIu64 ") and replays with it", p.seed);
    ds41_sampler_free(a);
    ds41_sampler_free(b);

    /* the stream is numpy default_rng(seed).integers(0, M): r = 0 picks the top token, so with a
     * tiny vocabulary and known weights the draws can be predicted from ds41_pcg64 directly */
    const float l4[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* equal weights 2^42 each, order 0,1,2,3 */
    p = ds41_sampler_params_default();
    p.has_seed = 1;
    p.seed = 42;
    a = make(&p, 4);
    ds41_pcg64 rng;
    ds41_seedseq_pcg64(&rng, 42);
    int match = 1;
    for (int i = 0; i < 200; i++) {
        int64_t r;
        ds41_pcg64_integers(&rng, (int64_t)(4 * DS41_SAMPLER_WEIGHT_ONE), &r, 1, NULL);
        match &= draw(a, sc, l4, 4) == (uint32_t)((uint64_t)r / DS41_SAMPLER_WEIGHT_ONE);
    }
    TAP_CHECK(match, "draws are numpy default_rng(seed).integers(0, M) mapped through the inverse CDF");
    ds41_sampler_free(a);
    ds41_sampler_scratch_free(sc);
    free(l);
}

/* ---------------------------------------------------------------------------------------------
 * the fast path (partial selection) against a full sort of the documented weights */
static int cmp_u64_desc(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

/* Logit shapes that steer the sampler through each of its paths: PEAKED (a few strong tokens,
 * about a thousand within 14 nats of the top: only the heavy tokens are materialized), TAIL (a
 * handful of heavy tokens and 129k just below the heavy threshold holding ~11% of the weight:
 * draws, top_k and top_p boundaries fall outside the heavy set and switch to the complete build),
 * FLAT (everything heavy: the complete build from the start). */
enum shape { PEAKED, TAIL, FLAT };

static void shaped_logits(float *l, uint32_t n, enum shape shape, uint64_t seed) {
    uint64_t x = seed;
    if (shape == PEAKED) {
        random_logits(l, n, seed);
        for (int k = 0; k < 8; k++) l[splitmix(&x) % n] += (float)(14.0 + 6.0 * uniform(&x));
    } else if (shape == TAIL) {
        /* just below ln 2^-20 = -13.863: ~11% of the weight is in the light tail */
        for (uint32_t i = 0; i < n; i++) l[i] = (float)(-13.87 - 0.02 * uniform(&x));
        for (int k = 0; k < 4; k++) l[splitmix(&x) % n] = (float)(-2.0 - 6.0 * uniform(&x));
        l[splitmix(&x) % n] = 0.0f;
    } else {
        for (uint32_t i = 0; i < n; i++) l[i] = (float)(splitmix(&x) % 4) * 0.001f;
    }
}

typedef struct ref_case {
    const char *name;
    enum shape shape;
    float temperature;
    uint32_t top_k;
    float top_p, min_p;
    int steps;
    uint32_t vocab;        /* 0: BIG_VOCAB */
    uint32_t top_logprobs; /* > 0: also check PROCESSED logprobs against the reference */
} ref_case;

static void test_full_sort_reference(void) {
    float *l = malloc(BIG_VOCAB * sizeof *l);
    uint64_t *w = malloc(BIG_VOCAB * sizeof *w), *keys = malloc(BIG_VOCAB * sizeof *keys);
    ds41_sampler_scratch *sc = scratch_for(BIG_VOCAB);
    const ref_case cases[] = {
        {"peaked T=1", PEAKED, 1.0f, 0, 1.0f, 0.0f, 20},
        {"peaked T=0.7 top_k=40", PEAKED, 0.7f, 40, 1.0f, 0.0f, 20},
        {"peaked T=1 top_p=0.9", PEAKED, 1.0f, 0, 0.9f, 0.0f, 20},
        {"peaked T=1.2 min_p=0.05", PEAKED, 1.2f, 0, 1.0f, 0.05f, 20},
        {"peaked T=0.8 top_k=100 top_p=0.95 min_p=0.01", PEAKED, 0.8f, 100, 0.95f, 0.01f, 20},
        {"peaked T=3 top_p=0.5", PEAKED, 3.0f, 0, 0.5f, 0.0f, 20},
        {"tail T=1 (draws landing in the light tail)", TAIL, 1.0f, 0, 1.0f, 0.0f, 60},
        {"tail T=1 top_k=1000", TAIL, 1.0f, 1000, 1.0f, 0.0f, 20},
        {"tail T=1 top_k=8 (just past the heavy tokens), 20 logprobs", TAIL, 1.0f, 8, 1.0f, 0.0f, 20, 0, 20},
        {"tail T=1 min_p=1e-7, 20 logprobs (past the heavy tokens)", TAIL, 1.0f, 0, 1.0f, 1e-7f, 20, 0, 20},
        {"peaked T=0.9 top_p=0.99, 5 logprobs", PEAKED, 0.9f, 0, 0.99f, 0.0f, 20, 0, 5},
        {"tail T=1 top_p=0.95", TAIL, 1.0f, 0, 0.95f, 0.0f, 20},
        {"tail T=1 top_p=0.95 min_p=1e-6", TAIL, 1.0f, 0, 0.95f, 1e-6f, 20},
        {"flat T=50", FLAT, 50.0f, 0, 1.0f, 0.0f, 20},
        {"flat T=1 top_k=1000 top_p=0.3", FLAT, 1.0f, 1000, 0.3f, 0.0f, 20},
        /* vocabularies that are not a multiple of the vector width (tails of every loop) */
        {"peaked T=1, vocabulary 129,277", PEAKED, 1.0f, 0, 1.0f, 0.0f, 20, 129277},
        {"tail T=1 top_p=0.95, vocabulary 129,279", TAIL, 1.0f, 0, 0.95f, 0.0f, 20, 129279},
        {"flat T=2, vocabulary 1", FLAT, 2.0f, 0, 1.0f, 0.0f, 5, 1},
        {"flat T=2, vocabulary 2", FLAT, 2.0f, 0, 1.0f, 0.0f, 20, 2},
        {"peaked T=1 min_p=0.001, vocabulary 7", PEAKED, 1.0f, 0, 1.0f, 0.001f, 40, 7},
        {"peaked T=0.5 top_k=3, vocabulary 13", PEAKED, 0.5f, 3, 1.0f, 0.0f, 40, 13},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint32_t n = cases[c].vocab ? cases[c].vocab : BIG_VOCAB;
        ds41_sampler_params p = ds41_sampler_params_default();
        p.temperature = cases[c].temperature;
        p.top_k = cases[c].top_k;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.has_seed = 1;
        p.seed = 1000 + c;
        p.logprobs = cases[c].top_logprobs > 0;
        p.top_logprobs = cases[c].top_logprobs;
        p.logprobs_mode = DS41_LOGPROBS_PROCESSED;
        ds41_sampler *s = make(&p, n);
        ds41_pcg64 rng;
        ds41_seedseq_pcg64(&rng, p.seed);
        int ok = 1, step_bad = -1;
        for (int step = 0; step < cases[c].steps && ok; step++) {
            shaped_logits(l, n, cases[c].shape, 500 + 31 * (uint64_t)step);
            ds41_error err;
            if (ds41_sampler_weights(s, sc, l, n, w, &err) != 0) {
                ok = 0;
                break;
            }
            size_t m = 0;
            for (uint32_t i = 0; i < n; i++)
                if (w[i] > 0) keys[m++] = (w[i] << 20) | ((uint64_t)(DS41_SAMPLER_MAX_VOCAB - 1) - i);
            qsort(keys, m, sizeof *keys, cmp_u64_desc);
            if (p.top_k > 0 && p.top_k < m) m = p.top_k;
            if (p.top_p < 1.0f) {
                uint64_t mass = 0, cum = 0;
                for (size_t i = 0; i < m; i++) mass += keys[i] >> 20;
                const unsigned __int128 need =
                    (unsigned __int128)(uint64_t)floor((double)p.top_p * 0x1p32 + 0.5) * mass;
                size_t j = 0;
                while (j < m) {
                    cum += keys[j] >> 20;
                    j++;
                    if (((unsigned __int128)cum << 32) >= need) break;
                }
                m = j;
            }
            const uint64_t min_w = (uint64_t)fmax(1.0, ceil((double)p.min_p * 0x1p42));
            size_t j = 0;
            while (j < m && (keys[j] >> 20) >= min_w) j++;
            m = j;
            uint64_t mass = 0;
            for (size_t i = 0; i < m; i++) mass += keys[i] >> 20;
            int64_t r;
            ds41_pcg64_integers(&rng, (int64_t)mass, &r, 1, NULL);
            uint64_t cum = 0;
            uint32_t expect = UINT32_MAX;
            for (size_t i = 0; i < m; i++) {
                cum += keys[i] >> 20;
                if (cum > (uint64_t)r) {
                    expect =
                        (uint32_t)((DS41_SAMPLER_MAX_VOCAB - 1) - (keys[i] & (DS41_SAMPLER_MAX_VOCAB - 1)));
                    break;
                }
            }
            ds41_sample_result res;
            if (ds41_sampler_sample(s, sc, l, n, &res, &err) != 0 || res.token != expect) ok = 0;
            if (ok && p.logprobs) {
                /* the kept set's size, order and total weight show in the alternatives */
                const size_t listed = m < p.top_logprobs ? m : p.top_logprobs;
                ok &= res.n_top == listed && fabs(res.logprob - log((double)w[expect] / (double)mass)) < 1e-5;
                for (size_t i = 0; ok && i < listed; i++)
                    ok &= res.top[i].token ==
                          (uint32_t)((DS41_SAMPLER_MAX_VOCAB - 1) - (keys[i] & (DS41_SAMPLER_MAX_VOCAB - 1)));
            }
            if (!ok) step_bad = step;
        }
        TAP_CHECK(ok, "fast path = full-sort definition + numpy stream: %s, %d steps", cases[c].name,
                  cases[c].steps);
        if (step_bad >= 0) TAP_NOTE("first mismatch at step %d", step_bad);
        ds41_sampler_free(s);
    }
    ds41_sampler_scratch_free(sc);
    free(l);
    free(w);
    free(keys);
}

/* ---------------------------------------------------------------------------------------------
 * empirical distributions */
typedef struct dist_case {
    const char *name;
    float temperature;
    uint32_t top_k;
    float top_p, min_p;
    uint32_t kept; /* expected size of the kept set */
} dist_case;

static void test_distributions(void) {
    /* logits 0.5 apart: at T=1 each probability is e^-0.5 times the previous; cumulative sums
     * .395 .634 .779 .867 .921 ... (no top_p boundary below is near one; without top_k, top_p 0.8
     * would keep 4, over the top-5 set it keeps 3) */
    const uint32_t n = 12;
    const float l[12] = {1.5f, 2.5f, -0.5f, 2.0f, 0.0f, 3.0f, -1.0f, 1.0f, 0.5f, -3.0f, -2.0f, -1.5f};
    const dist_case cases[] = {
        {"temperature 1", 1.0f, 0, 1.0f, 0.0f, 12},
        {"temperature 0.5", 0.5f, 0, 1.0f, 0.0f, 12},
        {"temperature 2", 2.0f, 0, 1.0f, 0.0f, 12},
        {"top_k 3", 1.0f, 3, 1.0f, 0.0f, 3},
        {"top_p 0.75", 1.0f, 0, 0.75f, 0.0f, 3},
        {"top_p 0 (one token)", 1.0f, 0, 0.0f, 0.0f, 1},
        {"min_p 0.2", 1.0f, 0, 1.0f, 0.2f, 4},
        {"top_k 6 + top_p 0.9 + min_p 0.3 at T 1.5", 1.5f, 6, 0.9f, 0.3f, 4},
        {"top_k 5 + top_p 0.8 (top_p over the top_k set)", 1.0f, 5, 0.8f, 0.0f, 3},
    };
    ds41_sampler_scratch *sc = scratch_for(n);
    double expect[12];
    uint64_t w[12];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        ds41_sampler_params p = ds41_sampler_params_default();
        p.temperature = cases[c].temperature;
        p.top_k = cases[c].top_k;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.has_seed = 1;
        p.seed = 77 + c;
        ds41_sampler *s = make(&p, n);
        expected_distribution(l, n, p.temperature, p.top_k, p.top_p, p.min_p, expect);
        uint32_t kept = 0;
        for (uint32_t i = 0; i < n; i++) kept += expect[i] > 0;
        /* weights reproduce the softmax to float precision */
        ds41_sampler_weights(s, sc, l, n, w, NULL);
        double wsum = 0, worst = 0;
        double full[12];
        expected_distribution(l, n, p.temperature, 0, 1.0, 0.0, full);
        for (uint32_t i = 0; i < n; i++) wsum += (double)w[i];
        for (uint32_t i = 0; i < n; i++) worst = fmax(worst, fabs((double)w[i] / wsum - full[i]));
        uint32_t outside, cells;
        const double chi = chi_square(s, sc, l, n, expect, 200000, &outside, &cells);
        TAP_CHECK(kept == cases[c].kept && outside == 0 && chi_ok(chi, cells) && worst < 1e-6,
                  "%s: keeps %u tokens (expected %u), none drawn outside, chi2 %.1f over %u cells, weights "
                  "within %.1e "
                  "of softmax",
                  cases[c].name, kept, cases[c].kept, chi, cells, worst);
        ds41_sampler_free(s);
    }
    ds41_sampler_scratch_free(sc);
}

/* ---------------------------------------------------------------------------------------------
 * penalties and logit_bias */
static float penalized(float v, int in_history, uint32_t generated, float rep, float presence,
                       float frequency) {
    if (in_history) v = v > 0.0f ? v / rep : v * rep;
    if (generated > 0) v = v - ((float)generated * frequency + presence);
    return v;
}

static void test_penalties(void) {
    const uint32_t n = 64;
    float l[64], got[64], want[64];
    random_logits(l, n, 3);
    l[10] = 0.0f;
    const ds41_logit_bias bias[3] = {{5, 1.5f}, {6, -2.25f}, {10, 0.75f}};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.repetition_penalty = 1.3f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.logit_bias = bias;
    p.n_logit_bias = 3;
    ds41_sampler *s = make(&p, n);
    ds41_error err;
    const uint32_t prompt[6] = {1, 2, 2, 5, 6, 7};
    const uint32_t gen[7] = {7, 8, 8, 8, 10, 1, 5};
    ds41_sampler_accept_prompt(s, prompt, 6, &err);
    for (int i = 0; i < 7; i++) ds41_sampler_accept(s, gen[i], &err);
    ds41_sampler_process_logits(s, l, n, got, &err);
    int in_history[64] = {0};
    uint32_t count[64] = {0};
    for (int i = 0; i < 6; i++) in_history[prompt[i]] = 1;
    for (int i = 0; i < 7; i++) {
        in_history[gen[i]] = 1;
        count[gen[i]]++;
    }
    for (uint32_t i = 0; i < n; i++) {
        float v = l[i];
        for (int b = 0; b < 3; b++)
            if (bias[b].token == i) v += bias[b].bias;
        want[i] = penalized(v, in_history[i], count[i], 1.3f, 0.5f, 0.25f);
    }
    TAP_CHECK(
        memcmp(got, want, sizeof got) == 0,
        "bias, then repetition (prompt + generated), then presence/frequency (generated only): exact floats");
    /* spot checks of the formulas */
    const float v8 = l[8] > 0 ? l[8] / 1.3f : l[8] * 1.3f;
    TAP_CHECK(got[8] == v8 - (3.0f * 0.25f + 0.5f), "token generated 3 times: -(3 * frequency + presence)");
    TAP_CHECK(got[2] == (l[2] > 0 ? l[2] / 1.3f : l[2] * 1.3f), "prompt-only token: repetition penalty only");
    TAP_CHECK(got[40] == l[40] || in_history[40], "untouched token keeps its logit");
    TAP_CHECK(got[10] == 0.75f / 1.3f - (0.25f + 0.5f),
              "a zero logit biased positive is divided (bias comes before the repetition penalty)");
    ds41_sampler_free(s);

    /* repetition window: only the last 3 tokens of prompt + generated */
    p = ds41_sampler_params_default();
    p.repetition_penalty = 2.0f;
    p.repetition_window = 3;
    s = make(&p, n);
    for (uint32_t i = 0; i < n; i++) l[i] = (i % 2) ? 1.0f : -1.0f;
    const uint32_t pr[5] = {1, 2, 3, 4, 5};
    ds41_sampler_accept_prompt(s, pr, 5, &err);
    ds41_sampler_process_logits(s, l, n, got, &err);
    int ok = got[1] == 1.0f && got[2] == -1.0f && got[3] == 0.5f && got[4] == -2.0f && got[5] == 0.5f;
    ds41_sampler_accept(s, 9, &err);
    ds41_sampler_accept(s, 5, &err);
    ds41_sampler_process_logits(s, l, n, got, &err);
    ok &= got[3] == 1.0f && got[4] == -1.0f && got[5] == 0.5f && got[9] == 0.5f;
    ds41_sampler_accept(s, 11, &err);
    ds41_sampler_accept(s, 12, &err);
    ds41_sampler_process_logits(s, l, n, got, &err);
    ok &= got[9] == 1.0f && got[5] == 0.5f && got[11] == 0.5f && got[12] == -2.0f;
    for (int i = 0; i < 1000; i++) ds41_sampler_accept(s, (uint32_t)(i % 7) + 20, &err);
    ds41_sampler_process_logits(s, l, n, got, &err);
    int pen = 0;
    for (uint32_t i = 0; i < n; i++) pen += got[i] != l[i];
    ok &= pen == 3;
    TAP_CHECK(ok, "repetition_window 3: tokens leave the window (%d penalized after a long run)", pen);
    ds41_sampler_free(s);

    /* presence/frequency ignore prompt tokens; repetition 1 tracks nothing */
    p = ds41_sampler_params_default();
    p.presence_penalty = -0.5f;
    s = make(&p, n);
    ds41_sampler_accept_prompt(s, pr, 5, &err);
    ds41_sampler_accept(s, 30, &err);
    ds41_sampler_accept(s, 30, &err);
    ds41_sampler_process_logits(s, l, n, got, &err);
    ok = got[30] == l[30] + 0.5f;
    for (uint32_t i = 0; i < n; i++)
        if (i != 30) ok &= got[i] == l[i];
    TAP_CHECK(ok, "negative presence penalty raises generated tokens once; prompt tokens do not count");
    ds41_sampler_free(s);

    /* the distribution under bias and penalties matches softmax of the formula's logits */
    const uint32_t m = 8;
    const float lm[8] = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, 1.5f, -1.0f, 0.25f};
    const ds41_logit_bias b2[2] = {{2, 1.0f}, {7, -100.0f}};
    p = ds41_sampler_params_default();
    p.repetition_penalty = 1.5f;
    p.frequency_penalty = 0.4f;
    p.presence_penalty = 0.2f;
    p.logit_bias = b2;
    p.n_logit_bias = 2;
    p.has_seed = 1;
    p.seed = 5;
    s = make(&p, m);
    ds41_sampler_accept(s, 4, &err);
    ds41_sampler_accept(s, 4, &err);
    const uint32_t pm[1] = {5};
    ds41_sampler_accept_prompt(s, pm, 1, &err);
    float lp[8];
    for (uint32_t i = 0; i < m; i++) {
        float v = lm[i] + (i == 2 ? 1.0f : i == 7 ? -100.0f : 0.0f);
        lp[i] = penalized(v, i == 4 || i == 5, i == 4 ? 2 : 0, 1.5f, 0.2f, 0.4f);
    }
    double expect[8];
    expected_distribution(lp, m, 1.0, 0, 1.0, 0.0, expect);
    expect[7] = 0; /* e^-100 relative: weight 0, never kept */
    ds41_sampler_scratch *sc = scratch_for(m);
    uint32_t outside, cells;
    const double chi = chi_square(s, sc, lm, m, expect, 200000, &outside, &cells);
    TAP_CHECK(
        outside == 0 && chi_ok(chi, cells),
        "bias + penalties: draws follow softmax of the penalized logits (chi2 %.1f), bias -100 never drawn",
        chi);
    ds41_sampler_free(s);

    /* saturation: overflow gives FLT_MAX, a -inf logit stays -inf whatever the bias */
    {
        const ds41_logit_bias b3[2] = {{0, 100.0f}, {1, 3e38f}};
        p = ds41_sampler_params_default();
        p.repetition_penalty = 1e-38f;
        p.logit_bias = b3;
        p.n_logit_bias = 2;
        s = make(&p, 4);
        const float ls[4] = {-INFINITY, 3e38f, 20.0f, -1.0f};
        float out[4];
        ds41_sampler_accept_prompt(s, (uint32_t[2]){2, 3}, 2, &err);
        ds41_sampler_process_logits(s, ls, 4, out, &err);
        int sat = out[0] == -INFINITY && out[1] == FLT_MAX && out[2] == FLT_MAX && out[3] == -1e-38f;
        ds41_sampler_free(s);
        p = ds41_sampler_params_default();
        p.repetition_penalty = 3e38f;
        s = make(&p, 1);
        const float one[1] = {-5.0f};
        ds41_sampler_accept(s, 0, &err);
        ds41_sampler_process_logits(s, one, 1, out, &err);
        sat &= out[0] == -FLT_MAX && draw(s, sc, one, 1) == 0;
        TAP_CHECK(sat, "overflowing bias or penalty saturates at +-FLT_MAX (the token stays drawable); "
                       "a -inf logit stays -inf despite a bias");
        ds41_sampler_free(s);
    }

    /* +100 bias forces a token */
    const ds41_logit_bias force[1] = {{6, 100.0f}};
    p = ds41_sampler_params_default();
    p.logit_bias = force;
    p.n_logit_bias = 1;
    p.temperature = 1.5f;
    s = make(&p, m);
    ok = 1;
    for (int i = 0; i < 2000; i++) ok &= draw(s, sc, lm, m) == 6;
    TAP_CHECK(ok, "logit_bias +100 makes the token certain");
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
}

/* ---------------------------------------------------------------------------------------------
 * logprobs */
static void log_softmax(const float *l, uint32_t n, double t, double *out) {
    double mx = -INFINITY, z = 0;
    for (uint32_t i = 0; i < n; i++) mx = fmax(mx, l[i] / t);
    for (uint32_t i = 0; i < n; i++) z += exp(l[i] / t - mx);
    for (uint32_t i = 0; i < n; i++) out[i] = l[i] / t - mx - log(z);
}

static void test_logprobs(void) {
    const uint32_t n = 5000;
    float *l = malloc(n * sizeof *l);
    double *ref = malloc(n * sizeof *ref);
    random_logits(l, n, 21);
    l[17] = l[18] = 40.0f; /* a tie at the top: ordered by lower id */
    l[19] = -INFINITY;
    log_softmax(l, n, 1.0, ref);
    ds41_sampler_scratch *sc = scratch_for(n);
    const ds41_logit_bias bias[1] = {{100, 50.0f}};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.temperature = 0.7f;
    p.top_k = 10;
    p.logit_bias = bias;
    p.n_logit_bias = 1;
    p.frequency_penalty = 1.0f;
    p.logprobs = 1;
    p.top_logprobs = 20;
    p.has_seed = 1;
    p.seed = 8;
    ds41_sampler *s = make(&p, n);
    ds41_error err;
    ds41_sampler_accept(s, 17, &err);
    ds41_sample_result r;
    double worst = 0;
    int order_ok = 1, count_ok = 1;
    for (int k = 0; k < 50; k++) {
        ds41_sampler_sample(s, sc, l, n, &r, &err);
        worst = fmax(worst, fabs(r.logprob - ref[r.token]));
        count_ok &= r.n_top == 20;
        for (uint32_t i = 0; i < r.n_top; i++) {
            worst = fmax(worst, fabs(r.top[i].logprob - ref[r.top[i].token]));
            if (i > 0)
                order_ok &=
                    l[r.top[i - 1].token] > l[r.top[i].token] ||
                    (l[r.top[i - 1].token] == l[r.top[i].token] && r.top[i - 1].token < r.top[i].token);
        }
    }
    /* the 20 highest raw logits, exactly */
    int top_ok = r.top[0].token == 17 && r.top[1].token == 18;
    for (uint32_t i = 0; i < n; i++) {
        int listed = 0;
        for (uint32_t j = 0; j < r.n_top; j++) listed |= r.top[j].token == i;
        if (!listed && l[i] > l[r.top[r.n_top - 1].token]) top_ok = 0;
    }
    TAP_CHECK(worst < 2e-5,
              "RAW logprobs = log_softmax of the model logits, whatever bias/penalties/T (max error %.2e)",
              worst);
    TAP_CHECK(order_ok && count_ok && top_ok,
              "RAW top_logprobs: the 20 highest raw logits, descending, tie 17/18 by lower id");
    ds41_sampler_free(s);

    /* RAW at temperature 1 without bias or penalties (reuses the exps of the weights pass) */
    ds41_sampler_params plain = ds41_sampler_params_default();
    plain.logprobs = 1;
    plain.top_logprobs = 5;
    s = make(&plain, n);
    worst = 0;
    for (int k = 0; k < 20; k++) {
        ds41_sampler_sample(s, sc, l, n, &r, &err);
        worst = fmax(worst, fabs(r.logprob - ref[r.token]));
        for (uint32_t i = 0; i < r.n_top; i++)
            worst = fmax(worst, fabs(r.top[i].logprob - ref[r.top[i].token]));
    }
    TAP_CHECK(worst < 2e-5 && r.n_top == 5 && r.top[0].token == 17,
              "RAW logprobs at T=1 without adjustments = log_softmax (max error %.2e)", worst);
    ds41_sampler_free(s);

    /* PROCESSED: the distribution drawn from (logits without the +40 spike, which would leave
     * only two tokens with a nonzero weight) */
    random_logits(l, n, 22);
    l[17] = l[18] = 12.0f;
    p.logprobs_mode = DS41_LOGPROBS_PROCESSED;
    p.logit_bias = NULL;
    p.n_logit_bias = 0;
    p.frequency_penalty = 0;
    s = make(&p, n);
    double expect_p[5000];
    expected_distribution(l, n, 0.7, 10, 1.0, 0.0, expect_p);
    worst = 0;
    int listed_ok = 1;
    for (int k = 0; k < 50; k++) {
        ds41_sampler_sample(s, sc, l, n, &r, &err);
        worst = fmax(worst, fabs(r.logprob - log(expect_p[r.token])));
        listed_ok &= r.n_top == 10;
        for (uint32_t i = 0; i < r.n_top; i++) {
            worst = fmax(worst, fabs(r.top[i].logprob - log(expect_p[r.top[i].token])));
            if (i > 0) listed_ok &= r.top[i - 1].logprob >= r.top[i].logprob;
        }
    }
    TAP_CHECK(worst < 2e-5 && listed_ok,
              "PROCESSED logprobs = log of the kept, renormalized distribution; only the 10 kept listed (max "
              "error %.2e)",
              worst);
    random_logits(l, n, 21);
    l[17] = l[18] = 40.0f;
    l[19] = -INFINITY;
    ds41_sampler_free(s);

    /* greedy: RAW and PROCESSED */
    p = ds41_sampler_params_default();
    p.temperature = 0;
    p.logprobs = 1;
    p.top_logprobs = 3;
    p.presence_penalty = 1.0f;
    s = make(&p, n);
    ds41_sampler_accept(s, 17, &err);
    ds41_sampler_sample(s, sc, l, n, &r, &err);
    TAP_CHECK(r.token == 18 && fabs(r.logprob - ref[18]) < 2e-5 && r.n_top == 3 && r.top[0].token == 17 &&
                  r.top[1].token == 18,
              "greedy RAW: the penalized argmax 18, its raw logprob, raw alternatives");
    ds41_sampler_free(s);
    p.logprobs_mode = DS41_LOGPROBS_PROCESSED;
    s = make(&p, n);
    ds41_sampler_accept(s, 17, &err);
    ds41_sampler_sample(s, sc, l, n, &r, &err);
    float lp[5000];
    ds41_sampler_process_logits(s, l, n, lp, &err);
    double refp[5000];
    log_softmax(lp, n, 1.0, refp);
    TAP_CHECK(r.token == 18 && fabs(r.logprob - refp[18]) < 2e-5 && r.top[0].token == 18 &&
                  r.top[1].token == 17 && fabs(r.top[1].logprob - refp[17]) < 2e-5,
              "greedy PROCESSED: log_softmax of the penalized logits");
    ds41_sampler_free(s);

    /* PROCESSED alternatives beyond the heavy tokens: 20 listed from a shape with only 6 heavy */
    {
        const uint32_t nb = BIG_VOCAB;
        float *lb = malloc(nb * sizeof *lb);
        uint64_t *wb = malloc(nb * sizeof *wb), *kb = malloc(nb * sizeof *kb);
        ds41_sampler_scratch *big = scratch_for(nb);
        shaped_logits(lb, nb, TAIL, 4);
        p = ds41_sampler_params_default();
        p.logprobs = 1;
        p.top_logprobs = 20;
        p.logprobs_mode = DS41_LOGPROBS_PROCESSED;
        s = make(&p, nb);
        ds41_sampler_weights(s, big, lb, nb, wb, &err);
        size_t m = 0;
        double total = 0;
        for (uint32_t i = 0; i < nb; i++) {
            total += (double)wb[i];
            if (wb[i] > 0) kb[m++] = (wb[i] << 20) | ((uint64_t)(DS41_SAMPLER_MAX_VOCAB - 1) - i);
        }
        qsort(kb, m, sizeof *kb, cmp_u64_desc);
        ds41_sampler_sample(s, big, lb, nb, &r, &err);
        int ok = r.n_top == 20;
        double worst_b = 0;
        for (uint32_t i = 0; ok && i < 20; i++) {
            const uint32_t id =
                (uint32_t)((DS41_SAMPLER_MAX_VOCAB - 1) - (kb[i] & (DS41_SAMPLER_MAX_VOCAB - 1)));
            ok &= r.top[i].token == id;
            worst_b = fmax(worst_b, fabs(r.top[i].logprob - log((double)wb[id] / total)));
        }
        TAP_CHECK(ok && worst_b < 1e-5,
                  "PROCESSED top 20 reach past the heavy tokens into the light tail, in sampling order (max "
                  "error %.2e)",
                  worst_b);
        ds41_sampler_free(s);
        ds41_sampler_scratch_free(big);
        free(lb);
        free(wb);
        free(kb);
    }

    /* no logprobs requested */
    p = ds41_sampler_params_default();
    s = make(&p, n);
    ds41_sampler_sample(s, sc, l, n, &r, &err);
    TAP_CHECK(isnan(r.logprob) && r.n_top == 0, "without logprobs: logprob NAN, no alternatives");
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
    free(l);
    free(ref);
}

/* ---------------------------------------------------------------------------------------------
 * snapshot / restore */
static int run_steps(ds41_sampler *s, ds41_sampler_scratch *sc, float *l, uint32_t n, int from, int steps,
                     uint32_t *tokens, float *logprobs) {
    ds41_error err;
    for (int k = 0; k < steps; k++) {
        random_logits(l, n, 9000 + (uint64_t)(from + k));
        ds41_sample_result r;
        if (ds41_sampler_sample(s, sc, l, n, &r, &err) != 0) return -1;
        tokens[k] = r.token;
        logprobs[k] = r.logprob;
        if (ds41_sampler_accept(s, r.token, &err) != 0) return -1;
    }
    return 0;
}

static void test_snapshot(void) {
    const uint32_t n = 3000;
    float *l = malloc(n * sizeof *l);
    ds41_sampler_scratch *sc = scratch_for(n);
    for (int variant = 0; variant < 2; variant++) {
        const ds41_logit_bias bias[2] = {{3, 2.0f}, {2999, -1.0f}};
        ds41_sampler_params p = ds41_sampler_params_default();
        p.temperature = 1.1f;
        p.top_k = 200;
        p.top_p = 0.97f;
        p.min_p = 0.001f;
        p.repetition_penalty = 1.2f;
        p.repetition_window = variant == 0 ? 0 : 16;
        p.presence_penalty = 0.3f;
        p.frequency_penalty = 0.2f;
        p.logit_bias = bias;
        p.n_logit_bias = 2;
        p.logprobs = 1;
        p.logprobs_mode = DS41_LOGPROBS_PROCESSED;
        p.has_seed = 0;
        ds41_sampler *a = make(&p, n);
        ds41_error err;
        uint32_t prompt[40];
        for (int i = 0; i < 40; i++) prompt[i] = (uint32_t)(i * 37 % 3000);
        ds41_sampler_accept_prompt(a, prompt, 40, &err);
        uint32_t ta[60], tb[60];
        float la[60], lb[60];
        run_steps(a, sc, l, n, 0, 25, ta, la);
        const size_t size = ds41_sampler_snapshot_size(a);
        uint8_t *snap = malloc(size), *again = malloc(size);
        size_t written = 0;
        int ok = ds41_sampler_snapshot(a, snap, size, &written, &err) == 0 && written == size;
        ds41_sampler *b = NULL;
        ok &= ds41_sampler_restore(&b, snap, size, &err) == 0;
        if (!ok) TAP_NOTE("snapshot/restore: %s", err.msg);
        ok &=
            b && ds41_sampler_snapshot(b, again, size, &written, &err) == 0 && memcmp(snap, again, size) == 0;
        ok &= b && ds41_sampler_seed(b) == ds41_sampler_seed(a);
        if (b) {
            run_steps(a, sc, l, n, 25, 60, ta, la);
            run_steps(b, sc, l, n, 25, 60, tb, lb);
        }
        ok &= b && memcmp(ta, tb, sizeof ta) == 0 && memcmp(la, lb, sizeof la) == 0;
        TAP_CHECK(ok,
                  "snapshot (%zu bytes) -> restore -> identical next 60 samples and logprobs, equal "
                  "re-snapshot (%s)",
                  size, variant == 0 ? "whole history" : "window 16");

        /* damaged snapshots are refused cleanly */
        int refused = 1;
        size_t bad_at = 0;
        for (size_t cut = 0; cut < size; cut++) {
            ds41_sampler *c = (ds41_sampler *)1;
            if (ds41_sampler_restore(&c, snap, cut, &err) == 0 || c != NULL) {
                refused = 0;
                bad_at = cut;
                ds41_sampler_free(c);
                break;
            }
        }
        uint8_t *longer = malloc(size + 1);
        memcpy(longer, snap, size);
        longer[size] = 0;
        ds41_sampler *c = NULL;
        refused &= ds41_sampler_restore(&c, longer, size + 1, &err) != 0 && strstr(err.msg, "trailing");
        longer[0] ^= 1;
        refused &= ds41_sampler_restore(&c, longer, size, &err) != 0 && strstr(err.msg, "magic");
        longer[0] ^= 1;
        longer[8] = 2;
        refused &= ds41_sampler_restore(&c, longer, size, &err) != 0 && strstr(err.msg, "version");
        free(longer);
        TAP_CHECK(refused,
                  "truncated (every length), extended, bad-magic and bad-version snapshots are refused%s",
                  refused ? "" : " (a truncation was accepted)");
        if (!refused) TAP_NOTE("accepted truncation at %zu", bad_at);
        free(snap);
        free(again);
        ds41_sampler_free(a);
        ds41_sampler_free(b);
    }
    ds41_sampler_scratch_free(sc);
    free(l);
}

/* ---------------------------------------------------------------------------------------------
 * errors and edge cases */
static void test_errors(void) {
    const uint32_t n = 8;
    float l[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    ds41_sampler_scratch *sc = scratch_for(n), *small = scratch_for(4);
    ds41_sampler_params p = ds41_sampler_params_default();
    p.has_seed = 1;
    p.seed = 3;
    ds41_sampler *s = make(&p, n), *t = make(&p, n);
    ds41_error err;
    ds41_sample_result r;
    l[5] = NAN;
    TAP_CHECK(ds41_sampler_sample(s, sc, l, n, &r, &err) != 0 && strstr(err.msg, "token 5") &&
                  strstr(err.msg, "NaN"),
              "a NaN logit is an error naming the token");
    l[5] = INFINITY;
    TAP_CHECK(ds41_sampler_sample(s, sc, l, n, &r, &err) != 0 && strstr(err.msg, "+inf"),
              "+inf logit is an error");
    for (uint32_t i = 0; i < n; i++) l[i] = -INFINITY;
    TAP_CHECK(ds41_sampler_sample(s, sc, l, n, &r, &err) != 0 && strstr(err.msg, "-inf"),
              "every logit -inf is an error");
    for (uint32_t i = 0; i < n; i++) l[i] = (float)i;
    TAP_CHECK(ds41_sampler_sample(s, sc, l, n - 1, &r, &err) != 0 && strstr(err.msg, "vocabulary"),
              "a logits size different from the vocabulary is an error");
    TAP_CHECK(ds41_sampler_sample(s, small, l, n, &r, &err) != 0 && strstr(err.msg, "scratch"),
              "a too-small scratch is an error");
    /* the failed calls left the PRNG alone */
    int same = 1;
    for (int i = 0; i < 100; i++) same &= draw(s, sc, l, n) == draw(t, sc, l, n);
    TAP_CHECK(same, "failed samples do not advance the PRNG");
    TAP_CHECK(ds41_sampler_accept(s, n, &err) != 0 &&
                  ds41_sampler_accept_prompt(s, (uint32_t[2]){1, 99}, 2, &err) != 0,
              "accepting an id outside the vocabulary is an error");

    /* -inf tokens are never drawn, also at huge temperature */
    for (uint32_t i = 0; i < n; i++) l[i] = (i % 2) ? -INFINITY : (float)i;
    ds41_sampler_free(s);
    p.temperature = 1e30f;
    s = make(&p, n);
    int never = 1, seen[8] = {0};
    for (int i = 0; i < 4000; i++) {
        const uint32_t k = draw(s, sc, l, n);
        never &= k < n && (k % 2) == 0;
        if (k < n) seen[k] = 1;
    }
    TAP_CHECK(never && seen[0] && seen[2] && seen[4] && seen[6],
              "-inf logits are never drawn; temperature 1e30 is uniform over the rest");
    ds41_sampler_free(s);
    /* tiny temperature: effectively greedy, lowest id on ties through the weight order */
    p.temperature = 1e-6f;
    s = make(&p, n);
    const float tie[8] = {1, 3, 2, 3, 0, -1, 3, 2.999f};
    int greedyish = 1;
    for (int i = 0; i < 500; i++) {
        const uint32_t k = draw(s, sc, tie, n);
        greedyish &= k == 1 || k == 3 || k == 6;
    }
    TAP_CHECK(greedyish, "temperature 1e-6: only the tied maxima are drawn");
    ds41_sampler_free(s);
    ds41_sampler_free(t);
    ds41_sampler_scratch_free(sc);
    ds41_sampler_scratch_free(small);
}

/* ---------------------------------------------------------------------------------------------
 * integer thresholds of steps 6-8, hit exactly through ds41_sampler_sample_weights (weights from
 * float logits cannot land on them) */
typedef struct weights_case {
    const char *name;
    float top_p, min_p;
    uint64_t w[4];
    uint64_t kept_mass; /* expected M_kept */
} weights_case;

static int sample_weights(const ds41_sampler_params *p, const uint64_t *w, uint32_t n, uint32_t *token,
                          uint64_t *mass) {
    ds41_sampler *s = make(p, n);
    ds41_sampler_scratch *sc = scratch_for(n);
    ds41_error err = {{0}};
    const int rc = s && sc ? ds41_sampler_sample_weights(s, sc, w, n, token, mass, &err) : -1;
    if (rc != 0) TAP_NOTE("sample_weights: %s", err.msg);
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
    return rc;
}

static void test_weight_thresholds(void) {
    const uint64_t one = DS41_SAMPLER_WEIGHT_ONE;
    const weights_case cases[] = {
        /* P = 2^31, M = 2^43 + 1: P M / 2^32 = 2^42 + 1/2 rounds UP to need = 2^42 + 1, so the first
         * token's mass 2^42 is one short and its tie joins (a floor would stop at the first) */
        {"top_p 0.5, P*M/2^32 = 2^42 + 1/2: the nucleus rounds up past a prefix of 2^42",
         0.5f,
         0.0f,
         {one, one, 1, 0},
         2 * one},
        /* need - 1 = 2^42 = the mass of bucket 42 exactly: the cut is the first key of bucket 41 */
        {"top_p 0.5, need - 1 at the end of the top bucket: the next bucket's first token is kept",
         0.5f,
         0.0f,
         {one, one / 2, one / 2, 1},
         one + one / 2},
        /* min_p * 2^42 = 2^22 + 1/2 rounds up: 2^22 is dropped, 2^22 + 1 kept */
        {"min_p 2^-20 (1 + 2^-23): weight 2^22 is below ceil(min_p 2^42), 2^22 + 1 is not",
         1.0f,
         0x1.000002p-20f,
         {one, (uint64_t)1 << 22, ((uint64_t)1 << 22) + 1, 0},
         one + ((uint64_t)1 << 22) + 1},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        ds41_sampler_params p = ds41_sampler_params_default();
        p.has_seed = 1;
        p.seed = 7;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        uint32_t token = UINT32_MAX;
        uint64_t mass = 0;
        const int rc = sample_weights(&p, cases[c].w, 4, &token, &mass);
        TAP_CHECK(rc == 0 && mass == cases[c].kept_mass && token < 4 && cases[c].w[token] > 0, "%s",
                  cases[c].name);
        if (mass != cases[c].kept_mass)
            TAP_NOTE("M_kept %" PRIu64 ", expected %" PRIu64, mass, cases[c].kept_mass);
    }

    /* a draw r exactly at the end of bucket 42 + bucket 41 (cumulative weight r, not > r) picks the
     * first token of the next bucket: choose the seed so that r falls where the weights can put a
     * bucket end (M = 2^43, r in (2^42 + 2^41, 2^43)) */
    uint64_t seed = 0;
    int64_t r = 0;
    for (;; seed++) {
        ds41_pcg64 rng;
        ds41_seedseq_pcg64(&rng, seed);
        ds41_pcg64_integers(&rng, (int64_t)(2 * one), &r, 1, NULL);
        if ((uint64_t)r > one + one / 2) break;
    }
    const uint64_t w[3] = {one, (uint64_t)r - one, 2 * one - (uint64_t)r};
    ds41_sampler_params p = ds41_sampler_params_default();
    p.has_seed = 1;
    p.seed = seed;
    uint32_t token = UINT32_MAX;
    uint64_t mass = 0;
    const int rc = sample_weights(&p, w, 3, &token, &mass);
    TAP_CHECK(rc == 0 && mass == 2 * one && token == 2,
              "a draw exactly at a bucket's end picks the next bucket's token (seed %" PRIu64 ", r = %" PRId64
              ", got token %u)",
              seed, r, token);

    /* the entry point checks what step 4 guarantees */
    const uint64_t no_top[2] = {one - 1, 5}, above[2] = {one, one + 1};
    ds41_sampler *s = make(&p, 2);
    ds41_sampler_scratch *sc = scratch_for(2);
    ds41_error err = {{0}};
    TAP_CHECK(ds41_sampler_sample_weights(s, sc, no_top, 2, &token, NULL, &err) != 0 &&
                  strstr(err.msg, "2^42") &&
                  ds41_sampler_sample_weights(s, sc, above, 2, &token, NULL, &err) != 0 &&
                  strstr(err.msg, "token 1"),
              "sample_weights rejects weights without a top token of 2^42 or above it");
    ds41_sampler_free(s);
    ds41_sampler_scratch_free(sc);
}

/* ---------------------------------------------------------------------------------------------
 * timing (notes only: the suite also runs under sanitizers, so no time limit is asserted) */
static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); /* CPU time: other jobs on the machine do not count */
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void test_timing(void) {
    const uint32_t n = BIG_VOCAB;
    float *l = malloc(n * sizeof *l);
    ds41_sampler_scratch *sc = scratch_for(n);
    struct {
        const char *name;
        float t;
        uint32_t k;
        float top_p, min_p;
        int logprobs;
    } cases[] = {
        {"greedy", 0.0f, 0, 1.0f, 0.0f, 0},
        {"T=1", 1.0f, 0, 1.0f, 0.0f, 0},
        {"T=0.7 top_k=40", 0.7f, 40, 1.0f, 0.0f, 0},
        {"T=1 top_p=0.95", 1.0f, 0, 0.95f, 0.0f, 0},
        {"T=1 min_p=0.05", 1.0f, 0, 1.0f, 0.05f, 0},
        {"T=1 top_p=0.9 + 20 RAW logprobs", 1.0f, 0, 0.9f, 0.0f, 1},
    };
    int all_ok = 1;
    for (int shape = 0; shape < 2; shape++) {
        shaped_logits(l, n, shape == 0 ? PEAKED : FLAT, 1);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            ds41_sampler_params p = ds41_sampler_params_default();
            p.temperature = cases[c].t;
            p.top_k = cases[c].k;
            p.top_p = cases[c].top_p;
            p.min_p = cases[c].min_p;
            p.logprobs = cases[c].logprobs;
            p.top_logprobs = cases[c].logprobs ? 20 : 0;
            p.has_seed = 1;
            ds41_sampler *s = make(&p, n);
            const int reps = 200;
            const double t0 = now();
            for (int i = 0; i < reps; i++) all_ok &= draw(s, sc, l, n) < n;
            TAP_NOTE("%-6s %-34s %.3f ms per sample over %u logits", shape == 0 ? "peaked" : "flat",
                     cases[c].name, (now() - t0) / reps * 1e3, n);
            ds41_sampler_free(s);
        }
    }
    TAP_CHECK(all_ok, "timing runs over 129,280 logits sampled valid tokens");
    ds41_sampler_scratch_free(sc);
    free(l);
}

int main(void) {
    test_params();
    test_greedy();
    test_seeds();
    test_full_sort_reference();
    test_distributions();
    test_penalties();
    test_logprobs();
    test_snapshot();
    test_errors();
    test_weight_thresholds();
    test_timing();
    return tap_done();
}
