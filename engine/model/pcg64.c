#include "engine/model/pcg64.h"

/* numpy's SeedSequence constants (numpy/random/bit_generator.pyx), 32-bit words. */
enum { SEEDSEQ_POOL_WORDS = 4, SEEDSEQ_XSHIFT = 16 };
#define SEEDSEQ_INIT_A 0x43b0d7e5u
#define SEEDSEQ_MULT_A 0x931e8875u
#define SEEDSEQ_INIT_B 0x8b51f9ddu
#define SEEDSEQ_MULT_B 0x58f38dedu
#define SEEDSEQ_MIX_MULT_L 0xca01f9ddu
#define SEEDSEQ_MIX_MULT_R 0x4973f715u

/* PCG's default 128-bit LCG multiplier. */
#define PCG64_MULT_HI 2549297995355413924ull
#define PCG64_MULT_LO 4865540595714422341ull

static uint32_t seedseq_hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= SEEDSEQ_MULT_A;
    value *= *hash_const;
    value ^= value >> SEEDSEQ_XSHIFT;
    return value;
}

static uint32_t seedseq_mix(uint32_t x, uint32_t y) {
    uint32_t result = SEEDSEQ_MIX_MULT_L * x - SEEDSEQ_MIX_MULT_R * y;
    result ^= result >> SEEDSEQ_XSHIFT;
    return result;
}

/* SeedSequence.mix_entropy for an integer entropy: its 32-bit words, least significant
 * first (0 -> one zero word), hashed into the pool. */
static void seedseq_pool(uint64_t entropy, uint32_t pool[SEEDSEQ_POOL_WORDS]) {
    uint32_t words[2];
    size_t n_words = 0;
    do {
        words[n_words++] = (uint32_t)entropy;
        entropy >>= 32;
    } while (entropy != 0);

    uint32_t hash_const = SEEDSEQ_INIT_A;
    for (size_t i = 0; i < SEEDSEQ_POOL_WORDS; i++)
        pool[i] = seedseq_hashmix(i < n_words ? words[i] : 0, &hash_const);
    for (size_t src = 0; src < SEEDSEQ_POOL_WORDS; src++)
        for (size_t dst = 0; dst < SEEDSEQ_POOL_WORDS; dst++)
            if (src != dst) pool[dst] = seedseq_mix(pool[dst], seedseq_hashmix(pool[src], &hash_const));
    /* At most two entropy words, never more than the pool: no remaining-entropy pass. */
}

void ds41_seedseq_generate_state32(uint64_t entropy, uint32_t *out, size_t n_words) {
    uint32_t pool[SEEDSEQ_POOL_WORDS];
    seedseq_pool(entropy, pool);
    uint32_t hash_const = SEEDSEQ_INIT_B;
    for (size_t i = 0; i < n_words; i++) {
        uint32_t v = pool[i % SEEDSEQ_POOL_WORDS];
        v ^= hash_const;
        hash_const *= SEEDSEQ_MULT_B;
        v *= hash_const;
        v ^= v >> SEEDSEQ_XSHIFT;
        out[i] = v;
    }
}

static unsigned __int128 pcg64_multiplier(void) {
    return ((unsigned __int128)PCG64_MULT_HI << 64) | PCG64_MULT_LO;
}

static void pcg64_step(ds41_pcg64 *rng) {
    rng->state = rng->state * pcg64_multiplier() + rng->inc;
}

void ds41_pcg64_set_seed(ds41_pcg64 *rng, unsigned __int128 initstate, unsigned __int128 initseq) {
    rng->state = 0;
    rng->inc = (initseq << 1) | 1u;
    pcg64_step(rng);
    rng->state += initstate;
    pcg64_step(rng);
    rng->has_uint32 = 0;
    rng->uinteger = 0;
}

void ds41_seedseq_pcg64(ds41_pcg64 *rng, uint64_t entropy) {
    /* generate_state(4, uint64): eight 32-bit words read pairwise as little-endian 64-bit words. */
    uint32_t w[8];
    ds41_seedseq_generate_state32(entropy, w, 8);
    uint64_t v[4];
    for (int i = 0; i < 4; i++) v[i] = (uint64_t)w[2 * i] | ((uint64_t)w[2 * i + 1] << 32);
    /* pcg64_set_seed(seed = v[0..1], inc = v[2..3]), each as (high, low). */
    unsigned __int128 initstate = ((unsigned __int128)v[0] << 64) | v[1];
    unsigned __int128 initseq = ((unsigned __int128)v[2] << 64) | v[3];
    ds41_pcg64_set_seed(rng, initstate, initseq);
}

uint64_t ds41_pcg64_next64(ds41_pcg64 *rng) {
    pcg64_step(rng);
    /* XSL-RR: xor the halves, rotate right by the top 6 bits. */
    uint64_t hi = (uint64_t)(rng->state >> 64);
    uint64_t lo = (uint64_t)rng->state;
    unsigned rot = (unsigned)(hi >> 58);
    uint64_t x = hi ^ lo;
    return (x >> rot) | (x << ((64u - rot) & 63u));
}

uint32_t ds41_pcg64_next32(ds41_pcg64 *rng) {
    if (rng->has_uint32) {
        rng->has_uint32 = 0;
        return rng->uinteger;
    }
    uint64_t next = ds41_pcg64_next64(rng);
    rng->has_uint32 = 1;
    rng->uinteger = (uint32_t)(next >> 32);
    return (uint32_t)next;
}

/* numpy's bounded_lemire_uint64: a draw in [0, rng] for rng < 2^64 - 1. */
static uint64_t bounded_lemire64(ds41_pcg64 *g, uint64_t rng) {
    const uint64_t rng_excl = rng + 1;
    unsigned __int128 m = (unsigned __int128)ds41_pcg64_next64(g) * rng_excl;
    uint64_t leftover = (uint64_t)m;
    if (leftover < rng_excl) {
        const uint64_t threshold = (UINT64_MAX - rng) % rng_excl;
        while (leftover < threshold) {
            m = (unsigned __int128)ds41_pcg64_next64(g) * rng_excl;
            leftover = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* numpy's buffered_bounded_lemire_uint32: a draw in [0, rng] for rng < 2^32 - 1. */
static uint32_t bounded_lemire32(ds41_pcg64 *g, uint32_t rng) {
    const uint32_t rng_excl = rng + 1;
    uint64_t m = (uint64_t)ds41_pcg64_next32(g) * rng_excl;
    uint32_t leftover = (uint32_t)m;
    if (leftover < rng_excl) {
        const uint32_t threshold = (UINT32_MAX - rng) % rng_excl;
        while (leftover < threshold) {
            m = (uint64_t)ds41_pcg64_next32(g) * rng_excl;
            leftover = (uint32_t)m;
        }
    }
    return (uint32_t)(m >> 32);
}

int ds41_pcg64_integers(ds41_pcg64 *rng, int64_t high, int64_t *out, size_t n, ds41_error *err) {
    if (high < 1)
        return ds41_fail(err, "pcg64 integers: high must be >= 1 (got %lld; numpy raises 'high <= 0')",
                         (long long)high);
    if (n > 0 && !out) return ds41_fail(err, "pcg64 integers: no output buffer for %zu values", n);
    /* random_bounded_uint64_fill(off = 0, rng = high - 1, use_masked = false). */
    const uint64_t range = (uint64_t)high - 1;
    for (size_t i = 0; i < n; i++) {
        uint64_t v;
        if (range == 0)
            v = 0;
        else if (range == UINT32_MAX)
            v = ds41_pcg64_next32(rng);
        else if (range < UINT32_MAX)
            v = bounded_lemire32(rng, (uint32_t)range);
        else
            v = bounded_lemire64(rng, range); /* range <= 2^63 - 2, never the full-width case */
        out[i] = (int64_t)v;
    }
    return 0;
}
