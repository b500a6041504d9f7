/* Token sampler (see sampler.h for the pipeline, its order and the exact definitions). */
#include "engine/serve/sampler.h"

#include "engine/model/pcg64.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

/* Results must not depend on whether the compiler fuses a*b+c into one rounding (gcc does not in
 * ISO C mode; clang needs to be told). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

/* ---------------------------------------------------------------------------------------------
 * Sort keys: (weight << 20) | (ID_MASK - id).  Weights are at most 2^42 (43 bits), ids < 2^20, so
 * a key fits 63 bits and descending key order is "weight descending, lower id first".  Keys are
 * unique (the id part), so every selection below has exactly one answer. */
#define ID_BITS 20
#define ID_MASK ((uint64_t)DS41_SAMPLER_MAX_VOCAB - 1)

static inline uint64_t key_weight(uint64_t key) {
    return key >> ID_BITS;
}
static inline uint32_t key_token(uint64_t key) {
    return (uint32_t)(ID_MASK - (key & ID_MASK));
}
static inline uint64_t make_key(uint64_t weight, uint32_t token) {
    return (weight << ID_BITS) | (ID_MASK - token);
}

/* ---------------------------------------------------------------------------------------------
 * exp(x) for x <= 0 in float, four lanes at a time (GCC / clang vector extensions: plain IEEE
 * operations per lane, the same on every platform; libm's expf may differ by an ulp between
 * implementations, which would move weights).  Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2,
 * degree-6 Taylor polynomial (relative error ~1.2e-7), 2^n through the exponent bits.  x < -87
 * (below FLT_MIN) gives 0, exp(0) is exactly 1.  Only integer compares select lanes, so the
 * compiler needs no FP-exception reasoning to keep this branch-free.  Every caller goes through
 * the vector path (tails are padded), so no value depends on where it sits in the array. */
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));
typedef uint32_t u32x4 __attribute__((vector_size(16)));

#define EXP_FLOOR_BITS 0xC2AE0000u /* -87.0f */

static inline f32x4 splat(float x) {
    return (f32x4){x, x, x, x};
}

static inline f32x4 exp_nonpos4(f32x4 x) {
    const u32x4 xb = (u32x4)x;
    /* for x <= 0 (sign bit set or +0), x < -87 exactly when the bits compare above -87's */
    const u32x4 under = (u32x4)(xb > EXP_FLOOR_BITS);
    const f32x4 xc = (f32x4)((xb & ~under) | (EXP_FLOOR_BITS & under));
    const f32x4 magic = splat(12582912.0f); /* 1.5 * 2^23: adding and subtracting rounds to int */
    const f32x4 n = (xc * splat(1.44269504f) + magic) - magic;
    f32x4 r = xc - n * splat(0.693359375f); /* ln 2 high part (9 bits: n * hi is exact) */
    r = r + n * splat(2.12194440e-4f);      /* low part: ln 2 = 0.693359375 - 2.12194440e-4 */
    const f32x4 p =
        splat(1.0f) +
        r * (splat(1.0f) +
             r * (splat(0.5f) + r * (splat(1.66666672e-1f) +
                                     r * (splat(4.16666679e-2f) +
                                          r * (splat(8.33333377e-3f) + r * splat(1.38888892e-3f))))));
    const i32x4 ni = __builtin_convertvector(n, i32x4);
    const f32x4 scale = (f32x4)((u32x4)(ni + 127) << 23);
    return (f32x4)((u32x4)(p * scale) & ~under);
}

/* out[i] = exp((v[i] - v_max) / divisor) for i < n (v[i] <= v_max, divisor > 0). */
static void scaled_exp(const float *v, uint32_t n, float v_max, float divisor, float *out) {
    const f32x4 m = splat(v_max), d = splat(divisor);
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        f32x4 x;
        memcpy(&x, v + i, sizeof x);
        const f32x4 e = exp_nonpos4((x - m) / d);
        memcpy(out + i, &e, sizeof e);
    }
    if (i < n) {
        f32x4 x = m;
        memcpy(&x, v + i, (n - i) * sizeof *v);
        const f32x4 e = exp_nonpos4((x - m) / d);
        memcpy(out + i, &e, (n - i) * sizeof *out);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Count map: token id -> count, open addressing with linear probing and backward-shift deletion.
 * Holds only the distinct tokens seen, so a sequence costs memory in proportion to what it used,
 * not to the vocabulary. */
#define SLOT_EMPTY UINT32_MAX

typedef struct count_slot {
    uint32_t token;
    uint32_t count;
} count_slot;

typedef struct count_map {
    count_slot *slots;
    uint32_t bits; /* capacity = 2^bits (0 when nothing is allocated) */
    uint32_t len;
} count_map;

static inline uint32_t map_home(const count_map *m, uint32_t token) {
    return (uint32_t)(((uint64_t)token * 0x9E3779B97F4A7C15ull) >> (64 - m->bits));
}

static count_slot *map_find(const count_map *m, uint32_t token) {
    if (m->bits == 0) return NULL;
    const uint32_t mask = (1u << m->bits) - 1;
    for (uint32_t i = map_home(m, token);; i = (i + 1) & mask) {
        if (m->slots[i].token == token) return &m->slots[i];
        if (m->slots[i].token == SLOT_EMPTY) return NULL;
    }
}

static int map_grow(count_map *m) {
    const uint32_t bits = m->bits ? m->bits + 1 : 4;
    count_slot *slots = malloc(((size_t)1 << bits) * sizeof *slots);
    if (!slots) return -1;
    for (size_t i = 0; i < ((size_t)1 << bits); i++) slots[i] = (count_slot){SLOT_EMPTY, 0};
    count_map bigger = {slots, bits, m->len};
    const uint32_t mask = (1u << bits) - 1;
    for (size_t i = 0; m->bits && i < ((size_t)1 << m->bits); i++) {
        if (m->slots[i].token == SLOT_EMPTY) continue;
        uint32_t j = map_home(&bigger, m->slots[i].token);
        while (slots[j].token != SLOT_EMPTY) j = (j + 1) & mask;
        slots[j] = m->slots[i];
    }
    free(m->slots);
    *m = bigger;
    return 0;
}

/* Adds one occurrence (saturating at UINT32_MAX).  -1 only when growing fails. */
static int map_increment(count_map *m, uint32_t token) {
    count_slot *slot = map_find(m, token);
    if (slot) {
        if (slot->count < UINT32_MAX) slot->count++;
        return 0;
    }
    /* keep the load factor <= 1/2 so probes stay short */
    if (m->bits == 0 || (uint64_t)(m->len + 1) * 2 > ((uint64_t)1 << m->bits)) {
        if (map_grow(m) != 0) return -1;
    }
    const uint32_t mask = (1u << m->bits) - 1;
    uint32_t i = map_home(m, token);
    while (m->slots[i].token != SLOT_EMPTY) i = (i + 1) & mask;
    m->slots[i] = (count_slot){token, 1};
    m->len++;
    return 0;
}

/* Removes one occurrence of a token that is present; deletes the entry at zero. */
static void map_decrement(count_map *m, uint32_t token) {
    count_slot *slot = map_find(m, token);
    if (!slot) return;
    if (--slot->count > 0) return;
    const uint32_t mask = (1u << m->bits) - 1;
    uint32_t hole = (uint32_t)(slot - m->slots);
    for (uint32_t j = (hole + 1) & mask; m->slots[j].token != SLOT_EMPTY; j = (j + 1) & mask) {
        /* the entry at j may move into the hole unless its home lies cyclically in (hole, j] */
        const uint32_t home = map_home(m, m->slots[j].token);
        const int stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (stays) continue;
        m->slots[hole] = m->slots[j];
        hole = j;
    }
    m->slots[hole] = (count_slot){SLOT_EMPTY, 0};
    m->len--;
}

static void map_free(count_map *m) {
    free(m->slots);
    *m = (count_map){0};
}

/* ---------------------------------------------------------------------------------------------
 * State */
struct ds41_sampler {
    ds41_sampler_params params; /* params.logit_bias points to bias */
    ds41_logit_bias *bias;
    uint32_t n_vocab;
    uint64_t seed;
    ds41_pcg64 rng;
    int track_repetition; /* repetition_penalty != 1 */
    int track_generated;  /* presence or frequency penalty != 0 */
    /* Repetition history: with a window, counts of the tokens in the ring (the last
     * repetition_window tokens); without, every token ever seen (count saturating). */
    count_map repetition;
    uint32_t *ring;
    uint32_t ring_cap, ring_len, ring_head; /* ring_head: oldest entry once the ring is full */
    count_map generated;                    /* presence / frequency counts of generated tokens */
};

struct ds41_sampler_scratch {
    uint32_t cap;
    float *logits;  /* processed logits l */
    float *w;       /* exp((l - l_max) / T) */
    uint64_t *tmp;  /* candidate keys in id order */
    uint64_t *keys; /* candidate keys bucketed by weight */
};

ds41_sampler_params ds41_sampler_params_default(void) {
    return (ds41_sampler_params){
        .temperature = 1.0f,
        .top_k = 0,
        .top_p = 1.0f,
        .min_p = 0.0f,
        .repetition_penalty = 1.0f,
        .repetition_window = 0,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .logit_bias = NULL,
        .n_logit_bias = 0,
        .seed = 0,
        .has_seed = 0,
        .logprobs = 0,
        .top_logprobs = 0,
        .logprobs_mode = DS41_LOGPROBS_RAW,
    };
}

static int cmp_u32(const void *a, const void *b) {
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

int ds41_sampler_params_check(const ds41_sampler_params *p, uint32_t n_vocab, ds41_error *err) {
    if (!p) return ds41_fail(err, "sampler: no parameters");
    if (n_vocab == 0 || n_vocab > DS41_SAMPLER_MAX_VOCAB)
        return ds41_fail(err, "sampler: vocabulary size %u is outside 1..%u", n_vocab,
                         DS41_SAMPLER_MAX_VOCAB);
    if (!(isfinite(p->temperature) && p->temperature >= 0.0f))
        return ds41_fail(err, "sampler: temperature %g must be finite and >= 0", (double)p->temperature);
    if (!(p->top_p >= 0.0f && p->top_p <= 1.0f))
        return ds41_fail(err, "sampler: top_p %g must be in [0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return ds41_fail(err, "sampler: min_p %g must be in [0, 1]", (double)p->min_p);
    if (!(isfinite(p->repetition_penalty) && p->repetition_penalty > 0.0f))
        return ds41_fail(err, "sampler: repetition_penalty %g must be finite and > 0 (1 = off)",
                         (double)p->repetition_penalty);
    if (p->repetition_window > DS41_SAMPLER_MAX_WINDOW)
        return ds41_fail(err, "sampler: repetition_window %u exceeds %u", p->repetition_window,
                         DS41_SAMPLER_MAX_WINDOW);
    if (!isfinite(p->presence_penalty))
        return ds41_fail(err, "sampler: presence_penalty %g must be finite", (double)p->presence_penalty);
    if (!isfinite(p->frequency_penalty))
        return ds41_fail(err, "sampler: frequency_penalty %g must be finite", (double)p->frequency_penalty);
    if (p->n_logit_bias > DS41_SAMPLER_MAX_LOGIT_BIAS)
        return ds41_fail(err, "sampler: logit_bias has %u entries, at most %u are accepted", p->n_logit_bias,
                         DS41_SAMPLER_MAX_LOGIT_BIAS);
    if (p->n_logit_bias > 0 && !p->logit_bias)
        return ds41_fail(err, "sampler: logit_bias has %u entries but no array", p->n_logit_bias);
    uint32_t ids[DS41_SAMPLER_MAX_LOGIT_BIAS];
    for (uint32_t i = 0; i < p->n_logit_bias; i++) {
        if (p->logit_bias[i].token >= n_vocab)
            return ds41_fail(err, "sampler: logit_bias[%u]: token %u is outside the vocabulary (%u tokens)",
                             i, p->logit_bias[i].token, n_vocab);
        if (!isfinite(p->logit_bias[i].bias))
            return ds41_fail(err, "sampler: logit_bias[%u]: bias for token %u is not finite", i,
                             p->logit_bias[i].token);
        ids[i] = p->logit_bias[i].token;
    }
    qsort(ids, p->n_logit_bias, sizeof ids[0], cmp_u32);
    for (uint32_t i = 1; i < p->n_logit_bias; i++)
        if (ids[i] == ids[i - 1])
            return ds41_fail(err, "sampler: logit_bias lists token %u more than once", ids[i]);
    if (p->top_logprobs > DS41_SAMPLER_MAX_TOP_LOGPROBS)
        return ds41_fail(err, "sampler: top_logprobs %u exceeds %u", p->top_logprobs,
                         DS41_SAMPLER_MAX_TOP_LOGPROBS);
    if (p->top_logprobs > 0 && !p->logprobs)
        return ds41_fail(err, "sampler: top_logprobs %u needs logprobs", p->top_logprobs);
    if (p->logprobs_mode != DS41_LOGPROBS_RAW && p->logprobs_mode != DS41_LOGPROBS_PROCESSED)
        return ds41_fail(err, "sampler: logprobs_mode %d is unknown", (int)p->logprobs_mode);
    return 0;
}

static int draw_seed(uint64_t *seed, ds41_error *err) {
    uint8_t buf[8];
    size_t got = 0;
    while (got < sizeof buf) {
        ssize_t n = getrandom(buf + got, sizeof buf - got, 0);
        if (n < 0) {
            if (errno == EINTR) continue;
            return ds41_fail(err, "sampler: getrandom failed while drawing a seed: %s", strerror(errno));
        }
        got += (size_t)n;
    }
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)buf[i] << (8 * i);
    *seed = v;
    return 0;
}

/* Builds a state from checked params with a known seed. */
static int sampler_create(ds41_sampler **out, const ds41_sampler_params *params, uint32_t n_vocab,
                          uint64_t seed, ds41_error *err) {
    ds41_sampler *s = calloc(1, sizeof *s);
    if (!s) return ds41_fail(err, "sampler: out of memory");
    s->params = *params;
    if (params->n_logit_bias > 0) {
        s->bias = malloc(params->n_logit_bias * sizeof *s->bias);
        if (!s->bias) {
            free(s);
            return ds41_fail(err, "sampler: out of memory for %u logit_bias entries", params->n_logit_bias);
        }
        memcpy(s->bias, params->logit_bias, params->n_logit_bias * sizeof *s->bias);
    }
    s->params.logit_bias = s->bias;
    s->params.has_seed = params->has_seed ? 1 : 0;
    s->params.logprobs = params->logprobs ? 1 : 0;
    s->params.seed = params->has_seed ? params->seed : 0;
    s->n_vocab = n_vocab;
    s->seed = seed;
    ds41_seedseq_pcg64(&s->rng, seed);
    s->track_repetition = params->repetition_penalty != 1.0f;
    s->track_generated = params->presence_penalty != 0.0f || params->frequency_penalty != 0.0f;
    *out = s;
    return 0;
}

int ds41_sampler_new(ds41_sampler **out, const ds41_sampler_params *params, uint32_t n_vocab,
                     ds41_error *err) {
    if (!out) return ds41_fail(err, "sampler: no output pointer");
    *out = NULL;
    if (ds41_sampler_params_check(params, n_vocab, err) != 0) return -1;
    uint64_t seed = params->seed;
    if (!params->has_seed && draw_seed(&seed, err) != 0) return -1;
    return sampler_create(out, params, n_vocab, seed, err);
}

void ds41_sampler_free(ds41_sampler *s) {
    if (!s) return;
    map_free(&s->repetition);
    map_free(&s->generated);
    free(s->ring);
    free(s->bias);
    free(s);
}

const ds41_sampler_params *ds41_sampler_get_params(const ds41_sampler *s) {
    return &s->params;
}

uint64_t ds41_sampler_seed(const ds41_sampler *s) {
    return s->seed;
}

uint32_t ds41_sampler_n_vocab(const ds41_sampler *s) {
    return s->n_vocab;
}

/* Appends one token to the repetition history (ring + window counts, or the whole-history set). */
static int repetition_push(ds41_sampler *s, uint32_t token) {
    const uint32_t window = s->params.repetition_window;
    if (window == 0) return map_increment(&s->repetition, token);
    if (s->ring_len < window) {
        if (s->ring_len == s->ring_cap) {
            uint32_t cap = s->ring_cap ? s->ring_cap * 2 : 64;
            if (cap > window || cap < s->ring_cap) cap = window;
            uint32_t *ring = realloc(s->ring, (size_t)cap * sizeof *ring);
            if (!ring) return -1;
            s->ring = ring;
            s->ring_cap = cap;
        }
        if (map_increment(&s->repetition, token) != 0) return -1;
        s->ring[s->ring_len++] = token;
        return 0;
    }
    /* full: the oldest token leaves the window */
    if (map_increment(&s->repetition, token) != 0) return -1;
    map_decrement(&s->repetition, s->ring[s->ring_head]);
    s->ring[s->ring_head] = token;
    s->ring_head = s->ring_head + 1 == window ? 0 : s->ring_head + 1;
    return 0;
}

int ds41_sampler_accept_prompt(ds41_sampler *s, const uint32_t *tokens, size_t n, ds41_error *err) {
    if (n > 0 && !tokens) return ds41_fail(err, "sampler: %zu prompt tokens but no array", n);
    for (size_t i = 0; i < n; i++)
        if (tokens[i] >= s->n_vocab)
            return ds41_fail(err, "sampler: prompt token %zu is %u, outside the vocabulary (%u tokens)", i,
                             tokens[i], s->n_vocab);
    if (!s->track_repetition) return 0;
    for (size_t i = 0; i < n; i++)
        if (repetition_push(s, tokens[i]) != 0)
            return ds41_fail(err, "sampler: out of memory recording prompt token %zu", i);
    return 0;
}

int ds41_sampler_accept(ds41_sampler *s, uint32_t token, ds41_error *err) {
    if (token >= s->n_vocab)
        return ds41_fail(err, "sampler: accepted token %u is outside the vocabulary (%u tokens)", token,
                         s->n_vocab);
    /* grow the generated map first: if that fails nothing has changed */
    if (s->track_generated && map_increment(&s->generated, token) != 0)
        return ds41_fail(err, "sampler: out of memory recording token %u", token);
    if (s->track_repetition && repetition_push(s, token) != 0) {
        if (s->track_generated) map_decrement(&s->generated, token);
        return ds41_fail(err, "sampler: out of memory recording token %u", token);
    }
    return 0;
}

int ds41_sampler_scratch_new(ds41_sampler_scratch **out, uint32_t max_vocab, ds41_error *err) {
    if (!out) return ds41_fail(err, "sampler scratch: no output pointer");
    *out = NULL;
    if (max_vocab == 0 || max_vocab > DS41_SAMPLER_MAX_VOCAB)
        return ds41_fail(err, "sampler scratch: vocabulary size %u is outside 1..%u", max_vocab,
                         DS41_SAMPLER_MAX_VOCAB);
    ds41_sampler_scratch *sc = calloc(1, sizeof *sc);
    if (sc) {
        sc->cap = max_vocab;
        sc->logits = malloc((size_t)max_vocab * sizeof *sc->logits);
        sc->w = malloc((size_t)max_vocab * sizeof *sc->w);
        sc->tmp = malloc((size_t)max_vocab * sizeof *sc->tmp);
        sc->keys = malloc((size_t)max_vocab * sizeof *sc->keys);
    }
    if (!sc || !sc->logits || !sc->w || !sc->tmp || !sc->keys) {
        ds41_sampler_scratch_free(sc);
        return ds41_fail(err, "sampler scratch: out of memory for %u tokens", max_vocab);
    }
    *out = sc;
    return 0;
}

void ds41_sampler_scratch_free(ds41_sampler_scratch *sc) {
    if (!sc) return;
    free(sc->logits);
    free(sc->w);
    free(sc->tmp);
    free(sc->keys);
    free(sc);
}

/* ---------------------------------------------------------------------------------------------
 * Steps 1-3.  Every step touches only the tokens it concerns, and each is a per-token formula, so
 * applying them set by set gives each token bias, then repetition, then presence/frequency. */
static int has_adjustments(const ds41_sampler *s) {
    return s->params.n_logit_bias > 0 || (s->track_repetition && s->repetition.len > 0) ||
           (s->track_generated && s->generated.len > 0);
}

/* Overflow of a finite logit saturates at +-FLT_MAX (the bias or penalty pushed it as far as it
 * goes), so steps 1-3 keep finite logits finite: they never create NaN or an infinity, and never
 * mask a token the model allowed.  Non-finite logits are left alone (-inf stays masked). */
static inline float saturate(float v) {
    return v > FLT_MAX ? FLT_MAX : v < -FLT_MAX ? -FLT_MAX : v;
}

static void process_logits(const ds41_sampler *s, const float *logits, float *out) {
    if (out != logits) memcpy(out, logits, (size_t)s->n_vocab * sizeof *out);
    for (uint32_t i = 0; i < s->params.n_logit_bias; i++) {
        const uint32_t t = s->bias[i].token;
        if (isfinite(out[t])) out[t] = saturate(out[t] + s->bias[i].bias);
    }
    if (s->track_repetition && s->repetition.len > 0) {
        const float penalty = s->params.repetition_penalty;
        for (size_t i = 0; i < ((size_t)1 << s->repetition.bits); i++) {
            const uint32_t t = s->repetition.slots[i].token;
            if (t == SLOT_EMPTY || !isfinite(out[t])) continue;
            out[t] = saturate(out[t] > 0.0f ? out[t] / penalty : out[t] * penalty);
        }
    }
    if (s->track_generated && s->generated.len > 0) {
        const float frequency = s->params.frequency_penalty, presence = s->params.presence_penalty;
        for (size_t i = 0; i < ((size_t)1 << s->generated.bits); i++) {
            const count_slot slot = s->generated.slots[i];
            if (slot.token == SLOT_EMPTY || !isfinite(out[slot.token])) continue;
            out[slot.token] = saturate(out[slot.token] - ((float)slot.count * frequency + presence));
        }
    }
}

int ds41_sampler_process_logits(const ds41_sampler *s, const float *logits, uint32_t n_vocab, float *out,
                                ds41_error *err) {
    if (n_vocab != s->n_vocab)
        return ds41_fail(err, "sampler: got %u logits for a vocabulary of %u tokens", n_vocab, s->n_vocab);
    if (!logits || !out) return ds41_fail(err, "sampler: no logits buffer");
    process_logits(s, logits, out);
    return 0;
}

/* Largest value of v[0..n) into *max and the lowest index holding it into *arg (UINT32_MAX when
 * every value is -inf).  Returns -1 with *bad = the first NaN / +inf index. */
static int scan_max(const float *v, uint32_t n, float *max, uint32_t *arg, uint32_t *bad) {
    /* four independent accumulators: a compare-and-blend chain per vector would be latency bound */
    f32x4 m[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};
    i32x4 ok = {-1, -1, -1, -1};
    const f32x4 inf = splat(INFINITY);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int k = 0; k < 4; k++) {
            f32x4 x;
            memcpy(&x, v + i + 4 * k, sizeof x);
            ok &= x < inf;
            const i32x4 greater = x > m[k];
            m[k] = (f32x4)(((i32x4)x & greater) | ((i32x4)m[k] & ~greater));
        }
    }
    for (int k = 1; k < 4; k++) {
        const i32x4 greater = m[k] > m[0];
        m[0] = (f32x4)(((i32x4)m[k] & greater) | ((i32x4)m[0] & ~greater));
    }
    float best = -INFINITY;
    int all_ok = 1;
    for (int k = 0; k < 4; k++) {
        if (m[0][k] > best) best = m[0][k];
        all_ok &= ok[k] != 0;
    }
    for (; i < n; i++) {
        if (!(v[i] < INFINITY)) all_ok = 0;
        if (v[i] > best) best = v[i];
    }
    if (!all_ok) {
        for (i = 0; i < n && v[i] < INFINITY; i++) {
        }
        *bad = i;
        return -1;
    }
    *max = best;
    *arg = UINT32_MAX;
    if (best == -INFINITY) return 0;
    for (i = 0; v[i] != best; i++) {
    }
    *arg = i;
    return 0;
}

/* Checks sizes, applies steps 1-3 (into scratch, or not at all when nothing applies) and finds the
 * maximum.  *l is the processed logits.  Fails on NaN / +inf (steps 1-3 leave non-finite logits
 * alone and never make one, so these are the model's) and when every logit is -inf. */
static int prepare(const ds41_sampler *s, ds41_sampler_scratch *sc, const float *logits, uint32_t n,
                   const float **l, uint32_t *argmax, ds41_error *err) {
    if (n != s->n_vocab)
        return ds41_fail(err, "sampler: got %u logits for a vocabulary of %u tokens", n, s->n_vocab);
    if (!logits) return ds41_fail(err, "sampler: no logits");
    if (!sc || sc->cap < n)
        return ds41_fail(err, "sampler: scratch holds %u tokens, the vocabulary has %u", sc ? sc->cap : 0, n);
    const float *out = logits;
    if (has_adjustments(s)) {
        process_logits(s, logits, sc->logits);
        out = sc->logits;
    }
    float max;
    uint32_t bad;
    if (scan_max(out, n, &max, argmax, &bad) != 0)
        return ds41_fail(err, "sampler: logit of token %u is %s", bad, isnan(logits[bad]) ? "NaN" : "+inf");
    if (*argmax == UINT32_MAX) return ds41_fail(err, "sampler: every logit is -inf, no token can be chosen");
    *l = out;
    return 0;
}

/* W = floor(w * 2^42): exact scaling, then truncation (w <= 1, so W <= 2^42 fits int64). */
static inline uint64_t weight_from(float w) {
    return (uint64_t)(int64_t)(w * 0x1p42f);
}

/* ---------------------------------------------------------------------------------------------
 * Selection on unique keys, in descending order.  Quickselect with a median-of-three pivot; after
 * a bounded number of rounds (adversarial inputs) the remaining range is sorted instead.  Either
 * way the answer is the unique one a full sort gives, and weights are summed exactly in integers,
 * so the path taken never changes a result. */
#define SMALL_RANGE 16

static inline void swap_keys(uint64_t *a, size_t i, size_t j) {
    const uint64_t t = a[i];
    a[i] = a[j];
    a[j] = t;
}

static int cmp_key_desc(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

static void sort_desc(uint64_t *a, size_t n) {
    if (n > SMALL_RANGE) {
        qsort(a, n, sizeof *a, cmp_key_desc);
        return;
    }
    for (size_t i = 1; i < n; i++) {
        const uint64_t v = a[i];
        size_t j = i;
        for (; j > 0 && a[j - 1] < v; j--) a[j] = a[j - 1];
        a[j] = v;
    }
}

/* Partitions a[lo..hi) (at least 3 keys): afterwards a[lo..p) > a[p] > a[p+1..hi).  Returns p and
 * the total weight of a[lo..p) in *mass_above. */
static size_t partition_desc(uint64_t *a, size_t lo, size_t hi, uint64_t *mass_above) {
    const size_t mid = lo + (hi - lo) / 2, last = hi - 1;
    /* median of a[lo], a[mid], a[last] moved to a[last] */
    if (a[mid] > a[lo]) swap_keys(a, mid, lo);
    if (a[last] > a[lo]) swap_keys(a, last, lo);
    if (a[mid] > a[last]) swap_keys(a, mid, last); /* now a[lo] >= a[last] >= a[mid] */
    const uint64_t pivot = a[last];
    size_t store = lo;
    uint64_t mass = 0;
    for (size_t i = lo; i < last; i++) {
        if (a[i] > pivot) {
            mass += key_weight(a[i]);
            swap_keys(a, i, store);
            store++;
        }
    }
    swap_keys(a, store, last);
    *mass_above = mass;
    return store;
}

static unsigned select_budget(size_t n) {
    unsigned bits = 0;
    while (n >>= 1) bits++;
    return 2 * bits + 8;
}

/* Rearranges a[0..n) (1 <= k < n) so that a[0..k) are the k largest keys. */
static void select_top(uint64_t *a, size_t n, size_t k) {
    size_t lo = 0, hi = n;
    unsigned budget = select_budget(n);
    while (hi - lo > SMALL_RANGE && budget-- > 0) {
        uint64_t unused;
        const size_t p = partition_desc(a, lo, hi, &unused);
        if (p == k || p + 1 == k) return;
        if (p > k)
            hi = p;
        else
            lo = p + 1;
    }
    sort_desc(a + lo, hi - lo);
}

/* The inverse CDF: returns the smallest p such that the p+1 largest keys weigh more than t, and
 * rearranges a[0..n) so that a[0..p) are the p largest keys and a[p] the next one.  Needs n >= 1
 * and t < total weight (else the last position is returned). */
static size_t weighted_select(uint64_t *a, size_t n, uint64_t t) {
    size_t lo = 0, hi = n;
    uint64_t below = 0; /* weight of a[0..lo) */
    unsigned budget = select_budget(n);
    while (hi - lo > SMALL_RANGE && budget-- > 0) {
        uint64_t mass;
        const size_t p = partition_desc(a, lo, hi, &mass);
        if (t < below + mass) {
            hi = p;
        } else if (t < below + mass + key_weight(a[p])) {
            return p;
        } else {
            below += mass + key_weight(a[p]);
            lo = p + 1;
        }
    }
    sort_desc(a + lo, hi - lo);
    for (size_t i = lo; i < hi; i++) {
        below += key_weight(a[i]);
        if (below > t) return i;
    }
    return hi > 0 ? hi - 1 : 0;
}

/* Moves the keys with weight >= min_weight to the front of a[0..n); returns their count. */
static size_t keep_heavy(uint64_t *a, size_t n, uint64_t min_weight) {
    size_t kept = 0;
    for (size_t i = 0; i < n; i++)
        if (key_weight(a[i]) >= min_weight) swap_keys(a, i, kept++);
    return kept;
}

static uint64_t total_weight(const uint64_t *a, size_t n) {
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) total += key_weight(a[i]);
    return total;
}

/* ---------------------------------------------------------------------------------------------
 * The kept set, bucketed by weight magnitude: bucket b holds the weights in [2^b, 2^(b+1))
 * (b = 42: exactly 2^42, the top token and its ties).  Keys are laid out bucket 42 first, so
 * every key of a bucket precedes every key of a lower bucket in the sampling order; a selection
 * then only has to look inside the one bucket where its boundary falls, found from per-bucket
 * counts and weights.  The kept set is always a prefix of the order: the buckets from 42 down to
 * `lowest`, each kept on [start, end), with the partly kept bucket's kept keys first in its range.
 *
 * Usually only the heavy tokens (W >= 2^22, p >= 2^-20 p_max) are materialized: their keys are
 * gathered in one vector pass, while the lighter kept tokens are known only by their exact count
 * and total weight (outside_*; every one of them comes after every materialized key).  A step
 * whose boundary falls among them, or a draw landing in their weight, switches to the complete
 * build; both paths give the same answer because all weights and sums are exact. */
#define N_BUCKETS 43
#define HEAVY_WEIGHT 0x1p-20f /* w threshold of the heavy tokens (a power of two: W >= 2^22) */
#define MAX_HEAVY 8192u       /* more heavy tokens than this: build completely at once */

typedef struct kept_set {
    uint64_t *keys;
    size_t start[N_BUCKETS], end[N_BUCKETS];
    uint64_t mass[N_BUCKETS]; /* weight of keys[start, end) */
    int lowest;
    uint64_t outside_mass; /* kept but not materialized (lighter than every key) */
    size_t outside_count;
} kept_set;

static inline int bucket_of(uint64_t weight) {
    return 63 - __builtin_clzll(weight);
}

/* Lays out keys tmp[0..c) by bucket into keys; the set is complete (nothing outside). */
static void kept_bucket(kept_set *ks, const uint64_t *tmp, size_t c, uint64_t *keys) {
    /* four histograms, so consecutive keys in the same bucket do not wait on each other */
    size_t count[4][N_BUCKETS] = {{0}};
    for (size_t j = 0; j < c; j++) count[j & 3][bucket_of(key_weight(tmp[j]))]++;
    size_t fill[N_BUCKETS], at = 0;
    for (int b = N_BUCKETS - 1; b >= 0; b--) {
        ks->start[b] = fill[b] = at;
        at += count[0][b] + count[1][b] + count[2][b] + count[3][b];
        ks->end[b] = at;
    }
    for (size_t j = 0; j < c; j++) keys[fill[bucket_of(key_weight(tmp[j]))]++] = tmp[j];
    for (int b = N_BUCKETS - 1; b >= 0; b--)
        ks->mass[b] = total_weight(keys + ks->start[b], ks->end[b] - ks->start[b]);
    ks->keys = keys;
    ks->lowest = 0;
    ks->outside_mass = 0;
    ks->outside_count = 0;
}

static uint64_t kept_mass(const kept_set *ks) {
    uint64_t total = 0;
    for (int b = N_BUCKETS - 1; b >= ks->lowest; b--) total += ks->mass[b];
    return total;
}

static size_t kept_count(const kept_set *ks) {
    size_t total = 0;
    for (int b = N_BUCKETS - 1; b >= ks->lowest; b--) total += ks->end[b] - ks->start[b];
    return total;
}

/* Cuts the kept set to its first k keys (1 <= k <= materialized count). */
static void kept_first(kept_set *ks, size_t k) {
    size_t before = 0;
    ks->outside_mass = 0;
    ks->outside_count = 0;
    for (int b = N_BUCKETS - 1; b >= ks->lowest; b--) {
        const size_t size = ks->end[b] - ks->start[b];
        if (before + size >= k) {
            const size_t j = k - before; /* >= 1: otherwise the previous bucket ended the walk */
            if (j < size) {
                select_top(ks->keys + ks->start[b], size, j);
                ks->end[b] = ks->start[b] + j;
                ks->mass[b] = total_weight(ks->keys + ks->start[b], j);
            }
            ks->lowest = b;
            return;
        }
        before += size;
    }
}

/* Finds the first key whose cumulative weight exceeds t (t < materialized mass) and returns its
 * position in keys; with cut, the kept set ends there. */
static size_t kept_find(kept_set *ks, uint64_t t, int cut) {
    uint64_t below = 0;
    int b = N_BUCKETS - 1;
    for (; b > ks->lowest && below + ks->mass[b] <= t; b--) below += ks->mass[b];
    const size_t size = ks->end[b] - ks->start[b];
    const size_t p = weighted_select(ks->keys + ks->start[b], size, t - below);
    if (cut) {
        ks->end[b] = ks->start[b] + p + 1;
        ks->mass[b] = total_weight(ks->keys + ks->start[b], p + 1);
        ks->lowest = b;
        ks->outside_mass = 0;
        ks->outside_count = 0;
    }
    return ks->start[b] + p;
}

/* Drops the kept keys lighter than min_weight (>= 1); the set must be complete. */
static void kept_min_weight(kept_set *ks, uint64_t min_weight) {
    const int b = bucket_of(min_weight);
    if (b < ks->lowest) return; /* every kept weight is >= 2^lowest > min_weight */
    ks->lowest = b;
    const size_t kept = keep_heavy(ks->keys + ks->start[b], ks->end[b] - ks->start[b], min_weight);
    ks->end[b] = ks->start[b] + kept;
    ks->mass[b] = total_weight(ks->keys + ks->start[b], kept);
}

/* ceil(min_p * 2^42), at least 1 (weight-0 tokens are never kept). */
static uint64_t min_p_weight(float min_p) {
    const double w = ceil((double)min_p * 0x1p42);
    return w < 1.0 ? 1 : (uint64_t)w;
}

/* The smallest float f with f * 2^42 >= weight: for any float w, w >= f exactly when
 * floor(w * 2^42) >= weight. */
static float weight_threshold(uint64_t weight) {
    const double v = (double)weight * 0x1p-42; /* exact: weight < 2^53 */
    float f = (float)v;
    if ((double)f < v) f = nextafterf(f, INFINITY);
    return f;
}

/* What one pass over the weights learns: the exact count and total weight of the tokens with
 * W >= the build floor. */
typedef struct weigh_result {
    uint64_t mass;
    size_t count;
} weigh_result;

typedef struct weigh_acc {
    i32x4 hi, lo, n;
} weigh_acc;

static inline void weigh4(f32x4 x, i32x4 valid, f32x4 m, f32x4 d, f32x4 floor_w, int divide, float *out,
                          uint32_t n_out, weigh_acc *a) {
    const f32x4 e = exp_nonpos4(divide ? (x - m) / d : x - m);
    memcpy(out, &e, n_out * sizeof *out);
    /* W = floor(e * 2^42) = hi * 2^21 + lo, both exact in int32 lanes: e * 2^21 is exact, so is
     * its fractional part, and that times 2^21 again */
    const f32x4 scaled = e * splat(0x1p21f);
    const i32x4 hi = __builtin_convertvector(scaled, i32x4);
    const i32x4 lo =
        __builtin_convertvector((scaled - __builtin_convertvector(hi, f32x4)) * splat(0x1p21f), i32x4);
    const i32x4 in = (e >= floor_w) & valid;
    a->hi += hi & in;
    a->lo += lo & in;
    a->n -= in;
}

static void weigh_flush(weigh_acc *a, weigh_result *r) {
    for (int k = 0; k < 4; k++) {
        r->mass += ((uint64_t)(uint32_t)a->hi[k] << 21) + (uint32_t)a->lo[k];
        r->count += (uint32_t)a->n[k];
    }
    *a = (weigh_acc){{0}};
}

/* w[i] = exp((l[i] - l_max) / t) (the same lanes as scaled_exp; dividing by 1 is skipped, which
 * changes nothing) and the totals above. */
static void weigh(const float *l, uint32_t n, float l_max, float t, float floor_w, float *w,
                  weigh_result *r) {
    const f32x4 m = splat(l_max), d = splat(t), fl = splat(floor_w);
    const i32x4 all = {-1, -1, -1, -1};
    const int divide = t != 1.0f;
    weigh_acc a = {{0}};
    *r = (weigh_result){0};
    uint32_t i = 0, block = 0;
    for (; i + 4 <= n; i += 4) {
        f32x4 x;
        memcpy(&x, l + i, sizeof x);
        weigh4(x, all, m, d, fl, divide, w + i, 4, &a);
        /* lanes hold at most 512 * 2^21 = 2^30 before a flush */
        if (++block == 512) {
            weigh_flush(&a, r);
            block = 0;
        }
    }
    if (i < n) {
        f32x4 x = m;
        memcpy(&x, l + i, (n - i) * sizeof *l);
        const i32x4 lane = {0, 1, 2, 3};
        weigh4(x, lane < (int32_t)(n - i), m, d, fl, divide, w + i, n - i, &a);
    }
    weigh_flush(&a, r);
}

/* Keys of the tokens with w >= heavy_w, in id order; SIZE_MAX once there are more than max. */
static size_t gather_heavy(const float *w, uint32_t n, float heavy_w, size_t max, uint64_t *keys) {
    const f32x4 hv = splat(heavy_w);
    size_t c = 0;
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        f32x4 x;
        memcpy(&x, w + i, sizeof x);
        const i32x4 hit = x >= hv;
        if ((hit[0] | hit[1] | hit[2] | hit[3]) == 0) continue;
        if (c + 4 > max) return SIZE_MAX;
        for (uint32_t k = 0; k < 4; k++)
            if (hit[k]) keys[c++] = make_key(weight_from(w[i + k]), i + k);
    }
    for (; i < n; i++) {
        if (!(w[i] >= heavy_w)) continue;
        if (c + 1 > max) return SIZE_MAX;
        keys[c++] = make_key(weight_from(w[i]), i);
    }
    return c;
}

/* Keys of every token with W >= min_weight, in id order. */
static size_t gather_all(const float *w, uint32_t n, uint64_t min_weight, uint64_t *keys) {
    size_t c = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t weight = weight_from(w[i]);
        if (weight >= min_weight) keys[c++] = make_key(weight, i);
    }
    return c;
}

/* Everything the truncation steps need, computed once per sample. */
typedef struct draw_setup {
    const float *l;
    float l_max;
    uint64_t floor_weight; /* min_p weight, or 1 when the nucleus step comes first */
    uint64_t min_weight;   /* ceil(min_p * 2^42), at least 1 */
    weigh_result totals;
} draw_setup;

/* Steps 5-7 on a built kept set; returns 1 when a boundary falls among the tokens that are not
 * materialized (never for a complete set). */
static int truncate_kept(const ds41_sampler_params *p, kept_set *ks, uint64_t min_weight) {
    if (p->top_k > 0 && p->top_k < kept_count(ks) + ks->outside_count) {
        if (p->top_k > kept_count(ks)) return 1;
        kept_first(ks, p->top_k);
    }
    if (p->top_p < 1.0f) {
        /* smallest prefix with C * 2^32 >= P * M, i.e. weight > need - 1 with need = ceil(P M / 2^32) */
        const uint64_t scaled_p = (uint64_t)floor((double)p->top_p * 0x1p32 + 0.5);
        const unsigned __int128 product = (unsigned __int128)scaled_p * (kept_mass(ks) + ks->outside_mass);
        const uint64_t need = (uint64_t)((product + (((unsigned __int128)1 << 32) - 1)) >> 32);
        if (ks->outside_count > 0 && need > kept_mass(ks)) return 1;
        kept_find(ks, need > 0 ? need - 1 : 0, 1);
        kept_min_weight(ks, min_weight);
    }
    return 0;
}

/* Steps 4-7 on the weights in sc->w.  complete = 0 materializes only the heavy tokens and returns
 * 1 when a boundary falls among the others (then call again with complete = 1). */
static int truncate(const ds41_sampler *s, ds41_sampler_scratch *sc, const draw_setup *ds, int complete,
                    kept_set *ks) {
    if (complete) {
        kept_bucket(ks, sc->tmp, gather_all(sc->w, s->n_vocab, ds->floor_weight, sc->tmp), sc->keys);
    } else {
        const float heavy_w = fmaxf(HEAVY_WEIGHT, weight_threshold(ds->floor_weight));
        const size_t c = gather_heavy(sc->w, s->n_vocab, heavy_w, MAX_HEAVY, sc->tmp);
        if (c == SIZE_MAX) return 1;
        kept_bucket(ks, sc->tmp, c, sc->keys);
        ks->outside_mass = ds->totals.mass - kept_mass(ks);
        ks->outside_count = ds->totals.count - c;
    }
    return truncate_kept(&s->params, ks, ds->min_weight);
}

/* ---------------------------------------------------------------------------------------------
 * Logprobs */

/* log(sum_i exp(v_i - v_max)) + v_max over v[0..n) (v_max finite), exps into tmp. */
static double log_sum_exp(const float *v, uint32_t n, float v_max, float *tmp, int tmp_ready) {
    if (!tmp_ready) scaled_exp(v, n, v_max, 1.0f, tmp);
    double sum[4] = {0, 0, 0, 0};
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) sum[k] += (double)tmp[i + k];
    for (; i < n; i++) sum[0] += (double)tmp[i];
    return (double)v_max + log((sum[0] + sum[1]) + (sum[2] + sum[3]));
}

/* The k highest values of v[0..n), value descending, lower id first on ties. */
static uint32_t top_values(const float *v, uint32_t n, uint32_t k, ds41_token_logprob *top) {
    uint32_t have = 0;
    for (uint32_t i = 0; i < n && k > 0; i++) {
        const float x = v[i];
        if (have == k && !(x > top[k - 1].logprob)) continue;
        uint32_t j = have < k ? have++ : k - 1;
        while (j > 0 && x > top[j - 1].logprob) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = (ds41_token_logprob){i, x};
    }
    return have;
}

/* log_softmax over all of v (RAW: the model's logits; PROCESSED greedy: l).  tmp_ready: tmp already
 * holds exp(v - max v) (the weights pass at temperature 1 over unadjusted logits computed exactly
 * that). */
static void full_logprobs(const float *v, uint32_t n, uint32_t token, uint32_t k, float *tmp, int tmp_ready,
                          ds41_sample_result *r) {
    float v_max;
    uint32_t arg, bad;
    if (scan_max(v, n, &v_max, &arg, &bad) != 0) v_max = INFINITY; /* excluded by prepare */
    /* every value -inf cannot reach here either; stay defined regardless */
    const double lse = isfinite(v_max) ? log_sum_exp(v, n, v_max, tmp, tmp_ready) : INFINITY;
    r->logprob = (float)((double)v[token] - lse);
    r->n_top = top_values(v, n, k, r->top);
    for (uint32_t i = 0; i < r->n_top; i++) r->top[i].logprob = (float)((double)r->top[i].logprob - lse);
}

/* PROCESSED with temperature: log(W_i / M) = d_i + 42 ln 2 - ln M over the kept set, listed in
 * sampling order (a lower bucket can only matter while fewer than k keys were seen).  Needs at
 * least top_logprobs materialized keys, or a complete set. */
static void kept_logprobs(const ds41_sampler *s, const float *l, float l_max, const kept_set *ks,
                          uint64_t mass, uint32_t token, ds41_sample_result *r) {
    const float t = s->params.temperature;
    const double offset = 42.0 * 0.69314718055994530942 - log((double)mass);
    r->logprob = (float)((double)((l[token] - l_max) / t) + offset);
    const uint32_t k = s->params.top_logprobs;
    uint64_t best[DS41_SAMPLER_MAX_TOP_LOGPROBS];
    uint32_t have = 0;
    for (int b = N_BUCKETS - 1; b >= ks->lowest && have < k; b--) {
        for (size_t i = ks->start[b]; i < ks->end[b]; i++) {
            const uint64_t key = ks->keys[i];
            if (have == k && key <= best[k - 1]) continue;
            uint32_t j = have < k ? have++ : k - 1;
            while (j > 0 && key > best[j - 1]) {
                best[j] = best[j - 1];
                j--;
            }
            best[j] = key;
        }
    }
    r->n_top = have;
    for (uint32_t i = 0; i < have; i++) {
        const uint32_t id = key_token(best[i]);
        r->top[i] = (ds41_token_logprob){id, (float)((double)((l[id] - l_max) / t) + offset)};
    }
}

/* ---------------------------------------------------------------------------------------------
 * Sampling */
int ds41_sampler_sample(ds41_sampler *s, ds41_sampler_scratch *sc, const float *logits, uint32_t n,
                        ds41_sample_result *result, ds41_error *err) {
    if (!result) return ds41_fail(err, "sampler: no result");
    draw_setup ds;
    uint32_t argmax;
    if (prepare(s, sc, logits, n, &ds.l, &argmax, err) != 0) return -1;
    const ds41_sampler_params *p = &s->params;
    ds.l_max = ds.l[argmax];
    memset(result, 0, sizeof *result);
    result->logprob = NAN;

    if (p->temperature == 0.0f) {
        result->token = argmax;
        if (p->logprobs)
            full_logprobs(p->logprobs_mode == DS41_LOGPROBS_RAW ? logits : ds.l, n, argmax, p->top_logprobs,
                          sc->w, 0, result);
        return 0;
    }

    ds.min_weight = min_p_weight(p->min_p);
    /* without a nucleus step, min_p is just a weight floor and applies at once */
    ds.floor_weight = p->top_p < 1.0f ? 1 : ds.min_weight;
    weigh(ds.l, n, ds.l_max, p->temperature, weight_threshold(ds.floor_weight), sc->w, &ds.totals);
    kept_set ks;
    int complete = truncate(s, sc, &ds, 0, &ks) != 0;
    if (complete) truncate(s, sc, &ds, 1, &ks);
    const uint64_t mass = kept_mass(&ks) + ks.outside_mass;
    int64_t r;
    if (ds41_pcg64_integers(&s->rng, (int64_t)mass, &r, 1, err) != 0) return -1;
    const int need_all_keys = p->logprobs && p->logprobs_mode == DS41_LOGPROBS_PROCESSED &&
                              ks.outside_count > 0 && kept_count(&ks) < p->top_logprobs;
    if (!complete && ((uint64_t)r >= kept_mass(&ks) || need_all_keys)) truncate(s, sc, &ds, 1, &ks);
    result->token = key_token(ks.keys[kept_find(&ks, (uint64_t)r, 0)]);
    if (p->logprobs) {
        if (p->logprobs_mode == DS41_LOGPROBS_RAW)
            full_logprobs(logits, n, result->token, p->top_logprobs, sc->w,
                          ds.l == logits && p->temperature == 1.0f, result);
        else
            kept_logprobs(s, ds.l, ds.l_max, &ks, mass, result->token, result);
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Speculative sampling (sampler.h: ds41_sampler_sample_draft) */

/* The kept weight of token t (0 when truncated away); the set is complete. */
static uint64_t kept_weight_of(const kept_set *ks, uint32_t t) {
    for (int b = N_BUCKETS - 1; b >= ks->lowest; b--)
        for (size_t i = ks->start[b]; i < ks->end[b]; i++)
            if (key_token(ks->keys[i]) == t) return key_weight(ks->keys[i]);
    return 0;
}

/* A uniform double in [0, 1) from 53 bits of the stream. */
static double uniform01(ds41_pcg64 *rng) {
    return (double)(ds41_pcg64_next64(rng) >> 11) * 0x1p-53;
}

int ds41_sampler_sample_draft(ds41_sampler *s, ds41_sampler_scratch *sc, const float *logits, uint32_t n,
                              uint32_t draft, const float *q, ds41_sample_result *result, int *accepted,
                              ds41_error *err) {
    if (!result || !accepted) return ds41_fail(err, "sampler: no result");
    if (draft >= s->n_vocab)
        return ds41_fail(err, "sampler: draft token %u outside the vocabulary (%u)", draft, s->n_vocab);
    if (q && !(q[draft] > 0.0f))
        return ds41_fail(err, "sampler: the draft distribution gives its own token %u no probability", draft);
    draw_setup ds;
    uint32_t argmax;
    if (prepare(s, sc, logits, n, &ds.l, &argmax, err) != 0) return -1;
    const ds41_sampler_params *p = &s->params;
    if (p->temperature == 0.0f) {
        /* p is one-hot on the argmax: accepted exactly when the draft is it, else the argmax */
        if (ds41_sampler_sample(s, sc, logits, n, result, err) != 0) return -1;
        *accepted = result->token == draft;
        return 0;
    }
    ds.l_max = ds.l[argmax];
    memset(result, 0, sizeof *result);
    result->logprob = NAN;
    ds.min_weight = min_p_weight(p->min_p);
    ds.floor_weight = p->top_p < 1.0f ? 1 : ds.min_weight;
    weigh(ds.l, n, ds.l_max, p->temperature, weight_threshold(ds.floor_weight), sc->w, &ds.totals);
    kept_set ks;
    truncate(s, sc, &ds, 1, &ks); /* complete: every kept weight is needed */
    const uint64_t mass = kept_mass(&ks), w_draft = kept_weight_of(&ks, draft);
    uint32_t token = draft;
    if (!q) {
        /* q one-hot on the draft: accept with p(draft) = W_d / M exactly (integers); on rejection
         * the residual max(0, p - q) is p without the draft */
        int64_t r;
        if (ds41_pcg64_integers(&s->rng, (int64_t)mass, &r, 1, err) != 0) return -1;
        *accepted = (uint64_t)r < w_draft;
        if (!*accepted) {
            if (ds41_pcg64_integers(&s->rng, (int64_t)(mass - w_draft), &r, 1, err) != 0) return -1;
            uint64_t below = 0;
            token = argmax;
            for (int b = N_BUCKETS - 1; b >= ks.lowest; b--)
                for (size_t i = ks.start[b]; i < ks.end[b]; i++) {
                    const uint32_t t = key_token(ks.keys[i]);
                    if (t == draft) continue;
                    below += key_weight(ks.keys[i]);
                    if (below > (uint64_t)r) {
                        token = t;
                        goto chosen;
                    }
                }
        }
    } else {
        /* accept with min(1, p/q); on rejection draw from norm(max(0, p - q)) */
        const double pd = (double)w_draft / (double)mass;
        *accepted = uniform01(&s->rng) * (double)q[draft] < pd;
        if (!*accepted) {
            double total = 0;
            for (int b = N_BUCKETS - 1; b >= ks.lowest; b--)
                for (size_t i = ks.start[b]; i < ks.end[b]; i++) {
                    const double d =
                        (double)key_weight(ks.keys[i]) / (double)mass - (double)q[key_token(ks.keys[i])];
                    if (d > 0) total += d;
                }
            const double u = uniform01(&s->rng) * total;
            double below = 0;
            token = argmax; /* total 0 cannot reject; rounding falls back on the argmax */
            for (int b = N_BUCKETS - 1; b >= ks.lowest; b--)
                for (size_t i = ks.start[b]; i < ks.end[b]; i++) {
                    const double d =
                        (double)key_weight(ks.keys[i]) / (double)mass - (double)q[key_token(ks.keys[i])];
                    if (d <= 0) continue;
                    below += d;
                    if (below > u) {
                        token = key_token(ks.keys[i]);
                        goto chosen;
                    }
                }
        }
    }
chosen:
    result->token = token;
    if (p->logprobs) {
        if (p->logprobs_mode == DS41_LOGPROBS_RAW)
            full_logprobs(logits, n, token, p->top_logprobs, sc->w, 0, result);
        else
            kept_logprobs(s, ds.l, ds.l_max, &ks, mass, token, result);
    }
    return 0;
}

int ds41_sampler_weights(const ds41_sampler *s, ds41_sampler_scratch *sc, const float *logits, uint32_t n,
                         uint64_t *weights, ds41_error *err) {
    if (!weights) return ds41_fail(err, "sampler: no weights buffer");
    const float *l;
    uint32_t argmax;
    if (prepare(s, sc, logits, n, &l, &argmax, err) != 0) return -1;
    if (s->params.temperature == 0.0f) {
        memset(weights, 0, (size_t)n * sizeof *weights);
        weights[argmax] = DS41_SAMPLER_WEIGHT_ONE;
        return 0;
    }
    scaled_exp(l, n, l[argmax], s->params.temperature, sc->w);
    for (uint32_t i = 0; i < n; i++) weights[i] = weight_from(sc->w[i]);
    return 0;
}

int ds41_sampler_sample_weights(ds41_sampler *s, ds41_sampler_scratch *sc, const uint64_t *weights,
                                uint32_t n, uint32_t *token, uint64_t *kept_mass_out, ds41_error *err) {
    if (!weights || !token) return ds41_fail(err, "sampler: no weights or token buffer");
    if (n != s->n_vocab)
        return ds41_fail(err, "sampler: got %u weights for a vocabulary of %u tokens", n, s->n_vocab);
    if (!sc || sc->cap < n)
        return ds41_fail(err, "sampler: scratch holds %u tokens, the vocabulary has %u", sc ? sc->cap : 0, n);
    const ds41_sampler_params *p = &s->params;
    if (p->temperature == 0.0f) return ds41_fail(err, "sampler: greedy sampling draws no weights");
    uint64_t top = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (weights[i] > DS41_SAMPLER_WEIGHT_ONE)
            return ds41_fail(err, "sampler: weight of token %u is above 2^42", i);
        if (weights[i] > top) top = weights[i];
    }
    if (top != DS41_SAMPLER_WEIGHT_ONE)
        return ds41_fail(err, "sampler: no token has the top weight 2^42 (step 4 always gives one)");
    /* the same floor and steps as ds41_sampler_sample's complete build */
    const uint64_t min_weight = min_p_weight(p->min_p);
    const uint64_t floor_weight = p->top_p < 1.0f ? 1 : min_weight;
    size_t c = 0;
    for (uint32_t i = 0; i < n; i++)
        if (weights[i] >= floor_weight) sc->tmp[c++] = make_key(weights[i], i);
    kept_set ks;
    kept_bucket(&ks, sc->tmp, c, sc->keys);
    truncate_kept(p, &ks, min_weight);
    const uint64_t mass = kept_mass(&ks);
    int64_t r;
    if (ds41_pcg64_integers(&s->rng, (int64_t)mass, &r, 1, err) != 0) return -1;
    *token = key_token(ks.keys[kept_find(&ks, (uint64_t)r, 0)]);
    if (kept_mass_out) *kept_mass_out = mass;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Snapshot: little-endian fields in this order
 *   "DS41SMPL" u32 version=1 u32 n_vocab
 *   f32 temperature u32 top_k f32 top_p f32 min_p f32 repetition_penalty u32 repetition_window
 *   f32 presence_penalty f32 frequency_penalty u32 has_seed u32 logprobs u32 top_logprobs
 *   u32 logprobs_mode u64 seed (the one in use) u32 n_logit_bias {u32 token f32 bias}*
 *   PCG64: u64 state_hi u64 state_lo u64 inc_hi u64 inc_lo u32 has_uint32 u32 uinteger
 *   u32 n_repetition, then with a window the ring oldest first (u32 token)*, without one the
 *     distinct tokens seen ascending (u32 token)*
 *   u32 n_generated {u32 token u32 count}* ascending by token */
#define SNAPSHOT_MAGIC "DS41SMPL"
#define SNAPSHOT_VERSION 1u

typedef struct writer {
    uint8_t *buf; /* NULL: count only */
    size_t len;
} writer;

static void put_bytes(writer *w, const void *src, size_t n) {
    if (w->buf) memcpy(w->buf + w->len, src, n);
    w->len += n;
}
static void put_u32(writer *w, uint32_t v) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put_bytes(w, b, 4);
}
static void put_u64(writer *w, uint64_t v) {
    put_u32(w, (uint32_t)v);
    put_u32(w, (uint32_t)(v >> 32));
}
static void put_f32(writer *w, float f) {
    uint32_t v;
    memcpy(&v, &f, 4);
    put_u32(w, v);
}

static int cmp_slot(const void *a, const void *b) {
    const uint32_t x = ((const count_slot *)a)->token, y = ((const count_slot *)b)->token;
    return (x > y) - (x < y);
}

/* Copies the map's entries sorted by token into a new array (NULL on failure; none when empty). */
static count_slot *sorted_entries(const count_map *m, int *fail) {
    *fail = 0;
    if (m->len == 0) return NULL;
    count_slot *e = malloc(m->len * sizeof *e);
    if (!e) {
        *fail = 1;
        return NULL;
    }
    size_t k = 0;
    for (size_t i = 0; i < ((size_t)1 << m->bits); i++)
        if (m->slots[i].token != SLOT_EMPTY) e[k++] = m->slots[i];
    qsort(e, k, sizeof *e, cmp_slot);
    return e;
}

/* Serializes s.  With w->buf set, needs the sorted entries (allocated here); -1 if that fails. */
static int serialize(const ds41_sampler *s, writer *w) {
    const ds41_sampler_params *p = &s->params;
    put_bytes(w, SNAPSHOT_MAGIC, 8);
    put_u32(w, SNAPSHOT_VERSION);
    put_u32(w, s->n_vocab);
    put_f32(w, p->temperature);
    put_u32(w, p->top_k);
    put_f32(w, p->top_p);
    put_f32(w, p->min_p);
    put_f32(w, p->repetition_penalty);
    put_u32(w, p->repetition_window);
    put_f32(w, p->presence_penalty);
    put_f32(w, p->frequency_penalty);
    put_u32(w, (uint32_t)p->has_seed);
    put_u32(w, (uint32_t)p->logprobs);
    put_u32(w, p->top_logprobs);
    put_u32(w, (uint32_t)p->logprobs_mode);
    put_u64(w, s->seed);
    put_u32(w, p->n_logit_bias);
    for (uint32_t i = 0; i < p->n_logit_bias; i++) {
        put_u32(w, s->bias[i].token);
        put_f32(w, s->bias[i].bias);
    }
    put_u64(w, (uint64_t)(s->rng.state >> 64));
    put_u64(w, (uint64_t)s->rng.state);
    put_u64(w, (uint64_t)(s->rng.inc >> 64));
    put_u64(w, (uint64_t)s->rng.inc);
    put_u32(w, s->rng.has_uint32 ? 1u : 0u);
    put_u32(w, s->rng.uinteger);

    if (p->repetition_window > 0) {
        put_u32(w, s->ring_len);
        const uint32_t start = s->ring_len == p->repetition_window ? s->ring_head : 0;
        for (uint32_t i = 0; i < s->ring_len; i++) {
            uint32_t at = start + i;
            if (at >= s->ring_len) at -= s->ring_len;
            put_u32(w, s->ring[at]);
        }
    } else {
        put_u32(w, s->repetition.len);
        if (w->buf) {
            int fail;
            count_slot *e = sorted_entries(&s->repetition, &fail);
            if (fail) return -1;
            for (uint32_t i = 0; i < s->repetition.len; i++) put_u32(w, e[i].token);
            free(e);
        } else {
            w->len += (size_t)s->repetition.len * 4;
        }
    }
    put_u32(w, s->generated.len);
    if (w->buf) {
        int fail;
        count_slot *e = sorted_entries(&s->generated, &fail);
        if (fail) return -1;
        for (uint32_t i = 0; i < s->generated.len; i++) {
            put_u32(w, e[i].token);
            put_u32(w, e[i].count);
        }
        free(e);
    } else {
        w->len += (size_t)s->generated.len * 8;
    }
    return 0;
}

size_t ds41_sampler_snapshot_size(const ds41_sampler *s) {
    writer w = {NULL, 0};
    serialize(s, &w);
    return w.len;
}

int ds41_sampler_snapshot(const ds41_sampler *s, uint8_t *buf, size_t cap, size_t *written, ds41_error *err) {
    const size_t need = ds41_sampler_snapshot_size(s);
    if (!buf || cap < need)
        return ds41_fail(err, "sampler snapshot: needs %zu bytes, the buffer has %zu", need, buf ? cap : 0);
    writer w = {buf, 0};
    if (serialize(s, &w) != 0) return ds41_fail(err, "sampler snapshot: out of memory");
    if (written) *written = w.len;
    return 0;
}

typedef struct reader {
    const uint8_t *buf;
    size_t len, at;
    ds41_error *err;
    int failed;
} reader;

static int take(reader *r, size_t n, const char *what, const uint8_t **out) {
    if (r->failed) return -1;
    if (r->len - r->at < n) {
        r->failed = 1;
        return ds41_fail(r->err, "sampler snapshot: truncated at byte %zu reading %s (%zu bytes)", r->at,
                         what, r->len);
    }
    *out = r->buf + r->at;
    r->at += n;
    return 0;
}
static uint32_t get_u32(reader *r, const char *what) {
    const uint8_t *b = NULL;
    if (take(r, 4, what, &b) != 0) return 0;
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}
static uint64_t get_u64(reader *r, const char *what) {
    const uint64_t lo = get_u32(r, what);
    return lo | (uint64_t)get_u32(r, what) << 32;
}
static float get_f32(reader *r, const char *what) {
    const uint32_t v = get_u32(r, what);
    float f;
    memcpy(&f, &v, 4);
    return f;
}

int ds41_sampler_restore(ds41_sampler **out, const uint8_t *buf, size_t len, ds41_error *err) {
    if (!out) return ds41_fail(err, "sampler snapshot: no output pointer");
    *out = NULL;
    if (!buf && len > 0) return ds41_fail(err, "sampler snapshot: no buffer");
    reader r = {buf, len, 0, err, 0};
    const uint8_t *magic = NULL;
    if (take(&r, 8, "magic", &magic) != 0) return -1;
    if (memcmp(magic, SNAPSHOT_MAGIC, 8) != 0)
        return ds41_fail(err, "sampler snapshot: bad magic (not a ds41 sampler snapshot)");
    const uint32_t version = get_u32(&r, "version");
    if (!r.failed && version != SNAPSHOT_VERSION)
        return ds41_fail(err, "sampler snapshot: version %u is not supported (expected %u)", version,
                         SNAPSHOT_VERSION);
    const uint32_t n_vocab = get_u32(&r, "n_vocab");
    ds41_sampler_params p = ds41_sampler_params_default();
    p.temperature = get_f32(&r, "temperature");
    p.top_k = get_u32(&r, "top_k");
    p.top_p = get_f32(&r, "top_p");
    p.min_p = get_f32(&r, "min_p");
    p.repetition_penalty = get_f32(&r, "repetition_penalty");
    p.repetition_window = get_u32(&r, "repetition_window");
    p.presence_penalty = get_f32(&r, "presence_penalty");
    p.frequency_penalty = get_f32(&r, "frequency_penalty");
    const uint32_t has_seed = get_u32(&r, "has_seed");
    const uint32_t logprobs = get_u32(&r, "logprobs");
    p.top_logprobs = get_u32(&r, "top_logprobs");
    const uint32_t mode = get_u32(&r, "logprobs_mode");
    const uint64_t seed = get_u64(&r, "seed");
    p.n_logit_bias = get_u32(&r, "n_logit_bias");
    if (r.failed) return -1;
    if (has_seed > 1 || logprobs > 1)
        return ds41_fail(err, "sampler snapshot: has_seed / logprobs flags must be 0 or 1 (got %u, %u)",
                         has_seed, logprobs);
    if (mode > (uint32_t)DS41_LOGPROBS_PROCESSED)
        return ds41_fail(err, "sampler snapshot: logprobs_mode %u is unknown", mode);
    p.has_seed = (int)has_seed;
    p.logprobs = (int)logprobs;
    p.logprobs_mode = (ds41_logprobs_mode)mode;
    p.seed = seed;
    if (p.n_logit_bias > DS41_SAMPLER_MAX_LOGIT_BIAS)
        return ds41_fail(err, "sampler snapshot: logit_bias has %u entries, at most %u are accepted",
                         p.n_logit_bias, DS41_SAMPLER_MAX_LOGIT_BIAS);
    ds41_logit_bias bias[DS41_SAMPLER_MAX_LOGIT_BIAS];
    for (uint32_t i = 0; i < p.n_logit_bias; i++) {
        bias[i].token = get_u32(&r, "logit_bias token");
        bias[i].bias = get_f32(&r, "logit_bias value");
    }
    if (r.failed) return -1;
    p.logit_bias = bias;
    if (ds41_sampler_params_check(&p, n_vocab, err) != 0) return ds41_error_prefix(err, "sampler snapshot");

    ds41_pcg64 rng;
    const uint64_t state_hi = get_u64(&r, "PRNG state"), state_lo = get_u64(&r, "PRNG state");
    const uint64_t inc_hi = get_u64(&r, "PRNG increment"), inc_lo = get_u64(&r, "PRNG increment");
    const uint32_t has_uint32 = get_u32(&r, "PRNG buffer flag");
    rng.uinteger = get_u32(&r, "PRNG buffer");
    if (r.failed) return -1;
    rng.state = (unsigned __int128)state_hi << 64 | state_lo;
    rng.inc = (unsigned __int128)inc_hi << 64 | inc_lo;
    rng.has_uint32 = (int)has_uint32;
    if ((inc_lo & 1) == 0) return ds41_fail(err, "sampler snapshot: PRNG increment is even (must be odd)");
    if (has_uint32 > 1)
        return ds41_fail(err, "sampler snapshot: PRNG buffer flag %u is not 0 or 1", has_uint32);

    ds41_sampler *s;
    if (sampler_create(&s, &p, n_vocab, seed, err) != 0) return -1;
    s->rng = rng;

    const uint32_t n_rep = get_u32(&r, "repetition history length");
    if (r.failed) goto fail;
    if (n_rep > 0 && !s->track_repetition) {
        ds41_fail(err, "sampler snapshot: %u repetition history entries but repetition_penalty is off",
                  n_rep);
        goto fail;
    }
    if (p.repetition_window > 0 && n_rep > p.repetition_window) {
        ds41_fail(err, "sampler snapshot: repetition history of %u tokens exceeds the window of %u", n_rep,
                  p.repetition_window);
        goto fail;
    }
    if (n_rep > (len - r.at) / 4) {
        ds41_fail(err, "sampler snapshot: truncated: %u repetition history entries announced", n_rep);
        goto fail;
    }
    for (uint32_t i = 0, prev = 0; i < n_rep; i++) {
        const uint32_t token = get_u32(&r, "repetition history token");
        if (token >= n_vocab) {
            ds41_fail(err, "sampler snapshot: repetition history token %u is outside the vocabulary (%u)",
                      token, n_vocab);
            goto fail;
        }
        if (p.repetition_window == 0 && i > 0 && token <= prev) {
            ds41_fail(err, "sampler snapshot: repetition set is not strictly ascending at entry %u", i);
            goto fail;
        }
        prev = token;
        if (repetition_push(s, token) != 0) {
            ds41_fail(err, "sampler snapshot: out of memory");
            goto fail;
        }
    }
    const uint32_t n_gen = get_u32(&r, "generated count length");
    if (r.failed) goto fail;
    if (n_gen > 0 && !s->track_generated) {
        ds41_fail(err, "sampler snapshot: %u generated counts but presence and frequency penalties are off",
                  n_gen);
        goto fail;
    }
    if (n_gen > (len - r.at) / 8) {
        ds41_fail(err, "sampler snapshot: truncated: %u generated counts announced", n_gen);
        goto fail;
    }
    for (uint32_t i = 0, prev = 0; i < n_gen; i++) {
        const uint32_t token = get_u32(&r, "generated token");
        const uint32_t count = get_u32(&r, "generated count");
        if (token >= n_vocab || count == 0 || (i > 0 && token <= prev)) {
            ds41_fail(err,
                      "sampler snapshot: generated count %u (token %u, count %u) is outside the vocabulary, "
                      "zero or out of order",
                      i, token, count);
            goto fail;
        }
        prev = token;
        if (map_increment(&s->generated, token) != 0) {
            ds41_fail(err, "sampler snapshot: out of memory");
            goto fail;
        }
        map_find(&s->generated, token)->count = count;
    }
    if (r.at != len) {
        ds41_fail(err, "sampler snapshot: %zu trailing bytes after the state", len - r.at);
        goto fail;
    }
    *out = s;
    return 0;
fail:
    ds41_sampler_free(s);
    return -1;
}
