#include "engine/model/engram_layout.h"

#include <string.h>

#include "engine/model/pcg64.h"

/* (a * b) mod m without overflow. */
static uint64_t mulmod64(uint64_t a, uint64_t b, uint64_t m) {
    return (uint64_t)((unsigned __int128)a * b % m);
}

static uint64_t powmod64(uint64_t base, uint64_t exp, uint64_t m) {
    uint64_t result = 1 % m;
    base %= m;
    while (exp) {
        if (exp & 1) result = mulmod64(result, base, m);
        base = mulmod64(base, base, m);
        exp >>= 1;
    }
    return result;
}

/* Deterministic Miller-Rabin: the first twelve primes as bases decide every n < 3.3e24,
 * so all 64-bit n. */
static int is_prime64(uint64_t n) {
    static const uint64_t bases[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
    if (n < 2) return 0;
    for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        if (n == bases[i]) return 1;
        if (n % bases[i] == 0) return 0;
    }
    uint64_t d = n - 1;
    int s = 0;
    while ((d & 1) == 0) {
        d >>= 1;
        s++;
    }
    for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        uint64_t x = powmod64(bases[i], d, n);
        if (x == 1 || x == n - 1) continue;
        int composite = 1;
        for (int r = 1; r < s; r++) {
            x = mulmod64(x, x, n);
            if (x == n - 1) {
                composite = 0;
                break;
            }
        }
        if (composite) return 0;
    }
    return 1;
}

static int prime_seen(const int64_t *seen, size_t n_seen, int64_t p) {
    for (size_t i = 0; i < n_seen; i++)
        if (seen[i] == p) return 1;
    return 0;
}

int ds41_engram_layout_compute(const int *layer_ids, int n_layers, int max_ngram, int n_heads,
                               int64_t engram_vocab_size, int64_t compressed_vocab, ds41_engram_layout *out,
                               ds41_error *err) {
    if (!out) return ds41_fail(err, "engram layout: no output");
    memset(out, 0, sizeof *out);
    if (n_layers < 0 || n_layers > DS41_ENGRAM_MAX_LAYERS)
        return ds41_fail(err, "engram_layer_ids: %d entries, supported 0..%d", n_layers,
                         DS41_ENGRAM_MAX_LAYERS);
    if (n_layers == 0) return 0;
    if (!layer_ids) return ds41_fail(err, "engram_layer_ids: missing");
    if (max_ngram < 2 || max_ngram > DS41_ENGRAM_MAX_NGRAM)
        return ds41_fail(err, "engram_max_ngram_size: %d, supported 2..%d with engram layers", max_ngram,
                         DS41_ENGRAM_MAX_NGRAM);
    if (n_heads < 1 || n_heads > DS41_ENGRAM_MAX_HEADS)
        return ds41_fail(err, "engram_n_heads: %d, supported 1..%d", n_heads, DS41_ENGRAM_MAX_HEADS);
    if (engram_vocab_size < 1 || engram_vocab_size > DS41_ENGRAM_MAX_VOCAB)
        return ds41_fail(err, "engram_vocab_size: %lld, supported 1..%lld", (long long)engram_vocab_size,
                         (long long)DS41_ENGRAM_MAX_VOCAB);
    if (compressed_vocab < 1 || compressed_vocab > INT32_MAX)
        return ds41_fail(err, "engram_compressed_vocab_size: %lld, supported 1..%d",
                         (long long)compressed_vocab, INT32_MAX);
    for (int i = 0; i < n_layers; i++) {
        if (layer_ids[i] < 0 || layer_ids[i] > DS41_ENGRAM_MAX_LAYER_ID)
            return ds41_fail(err, "engram_layer_ids[%d]: %d, supported 0..%d", i, layer_ids[i],
                             DS41_ENGRAM_MAX_LAYER_ID);
        for (int j = 0; j < i; j++)
            if (layer_ids[j] == layer_ids[i])
                return ds41_fail(err, "engram_layer_ids[%d]: layer %d is listed twice", i, layer_ids[i]);
    }

    ds41_engram_layout l;
    memset(&l, 0, sizeof l);
    l.n_layers = n_layers;
    l.max_ngram = max_ngram;
    l.n_heads = n_heads;
    l.n_cols = (max_ngram - 1) * n_heads;
    l.engram_vocab_size = engram_vocab_size;
    l.compressed_vocab = compressed_vocab;
    int64_t bound = (INT64_MAX / compressed_vocab) / 2;
    l.multiplier_bound = bound > 1 ? bound : 1;

    /* The seen-set spans all layers; at most MAX_LAYERS * MAX_COLS primes. */
    int64_t seen[DS41_ENGRAM_MAX_LAYERS * DS41_ENGRAM_MAX_COLS];
    size_t n_seen = 0;
    for (int s = 0; s < n_layers; s++) {
        ds41_engram_layer_layout *ll = &l.layers[s];
        ll->layer_id = layer_ids[s];
        for (int n = 2; n <= max_ngram; n++) {
            int64_t previous = engram_vocab_size - 1;
            for (int head = 0; head < n_heads; head++) {
                /* Prime gaps below 2^41 are < 1000; the loop ends long before overflow. */
                int64_t candidate = previous + 1;
                while (!is_prime64((uint64_t)candidate) || prime_seen(seen, n_seen, candidate)) candidate++;
                seen[n_seen++] = candidate;
                int col = (n - 2) * n_heads + head;
                ll->primes[col] = candidate;
                ll->offsets[col] = ll->rows;
                ll->rows += candidate;
                previous = candidate;
            }
        }
        ds41_pcg64 rng;
        ds41_seedseq_pcg64(&rng, (uint64_t)DS41_ENGRAM_SEED_PRIME * (uint64_t)layer_ids[s]);
        int64_t draws[DS41_ENGRAM_MAX_NGRAM];
        if (ds41_pcg64_integers(&rng, l.multiplier_bound, draws, (size_t)max_ngram, err) != 0)
            return ds41_error_prefix(err, "engram multipliers of layer %d", layer_ids[s]);
        /* draw < bound <= 2^62, so draw*2+1 fits. */
        for (int k = 0; k < max_ngram; k++) ll->multipliers[k] = draws[k] * 2 + 1;
    }
    *out = l;
    return 0;
}

int ds41_engram_layout_check(const ds41_engram_layout *layout, const int64_t *num_embeddings, int n,
                             ds41_error *err) {
    if (!layout) return ds41_fail(err, "engram_num_embeddings: no layout to check against");
    if (n != layout->n_layers)
        return ds41_fail(err, "engram_num_embeddings: %d entries but engram_layer_ids has %d", n,
                         layout->n_layers);
    if (n > 0 && !num_embeddings) return ds41_fail(err, "engram_num_embeddings: missing");
    for (int i = 0; i < n; i++) {
        const ds41_engram_layer_layout *ll = &layout->layers[i];
        if (num_embeddings[i] != ll->rows)
            return ds41_fail(err,
                             "engram_num_embeddings[%d] = %lld but the hash primes of layer %d sum to %lld "
                             "(engram_vocab_size %lld, max_ngram %d, %d heads)",
                             i, (long long)num_embeddings[i], ll->layer_id, (long long)ll->rows,
                             (long long)layout->engram_vocab_size, layout->max_ngram, layout->n_heads);
    }
    return 0;
}

int ds41_engram_layout_slot(const ds41_engram_layout *layout, int layer_id) {
    if (!layout) return -1;
    for (int s = 0; s < layout->n_layers && s < DS41_ENGRAM_MAX_LAYERS; s++)
        if (layout->layers[s].layer_id == layer_id) return s;
    return -1;
}

void ds41_engram_history_init(ds41_engram_history *h) {
    if (!h) return;
    memset(h, 0, sizeof *h);
}

int ds41_engram_history_push(ds41_engram_history *h, int32_t compressed_id_or_dead, ds41_error *err) {
    if (!h) return ds41_fail(err, "engram history: none");
    if (compressed_id_or_dead < 0 && compressed_id_or_dead != DS41_ENGRAM_DEAD)
        return ds41_fail(err, "engram history: compressed id %d is neither >= 0 nor DEAD (-1)",
                         compressed_id_or_dead);
    if (h->n_pushed < 0 || h->n_pushed == INT64_MAX)
        return ds41_fail(err, "engram history: position counter %lld is corrupt", (long long)h->n_pushed);
    memmove(h->recent + 1, h->recent, (DS41_ENGRAM_MAX_NGRAM - 1) * sizeof h->recent[0]);
    h->recent[0] = compressed_id_or_dead;
    h->n_pushed++;
    return 0;
}

int ds41_engram_hash_position(const ds41_engram_layout *layout, int slot, const ds41_engram_history *h,
                              int32_t pad_id, int64_t *ids_out, ds41_error *err) {
    if (!layout || !h || !ids_out) return ds41_fail(err, "engram hash: missing layout, history or output");
    if (layout->n_layers < 0 || layout->n_layers > DS41_ENGRAM_MAX_LAYERS)
        return ds41_fail(err, "engram hash: layout is not initialised");
    if (slot < 0 || slot >= layout->n_layers)
        return ds41_fail(err, "engram hash: slot %d out of range (%d engram layers)", slot, layout->n_layers);
    if (layout->max_ngram < 2 || layout->max_ngram > DS41_ENGRAM_MAX_NGRAM || layout->n_heads < 1 ||
        layout->n_heads > DS41_ENGRAM_MAX_HEADS ||
        layout->n_cols != (layout->max_ngram - 1) * layout->n_heads)
        return ds41_fail(err, "engram hash: layout is not initialised");
    if (h->n_pushed < 1) return ds41_fail(err, "engram hash: no token pushed to the history yet");
    if (pad_id < 0 || pad_id >= layout->compressed_vocab)
        return ds41_fail(err, "engram hash: pad id %d outside [0, %lld)", pad_id,
                         (long long)layout->compressed_vocab);

    const ds41_engram_layer_layout *ll = &layout->layers[slot];
    int blocked = 0;
    uint64_t hash = 0;
    for (int k = 0; k < layout->max_ngram; k++) {
        /* p < k  <=>  fewer than k+1 tokens pushed. */
        if (h->n_pushed <= k || h->recent[k] == DS41_ENGRAM_DEAD) blocked = 1;
        int32_t tok = blocked ? pad_id : h->recent[k];
        if (tok < 0 || tok >= layout->compressed_vocab)
            return ds41_fail(err, "engram hash: compressed id %d at position %lld outside [0, %lld)", tok,
                             (long long)(h->n_pushed - 1 - k), (long long)layout->compressed_vocab);
        /* tok < compressed_vocab and mult < 2*bound <= (2^63-1)/compressed_vocab: no overflow. */
        uint64_t product = (uint64_t)tok * (uint64_t)ll->multipliers[k];
        hash = k == 0 ? product : hash ^ product;
        if (k == 0) continue;
        for (int head = 0; head < layout->n_heads; head++) {
            int col = (k - 1) * layout->n_heads + head;
            if (ll->primes[col] < 2) return ds41_fail(err, "engram hash: layout is not initialised");
            ids_out[col] = (int64_t)(hash % (uint64_t)ll->primes[col]) + ll->offsets[col];
        }
    }
    return 0;
}

int ds41_engram_hash_tokens(const ds41_engram_layout *layout, ds41_engram_history *h, int32_t pad_id,
                            const int32_t *compressed, size_t n, int64_t *ids_out, ds41_error *err) {
    if (!layout || !h) return ds41_fail(err, "engram hash: missing layout or history");
    if (n > 0 && (!compressed || !ids_out)) return ds41_fail(err, "engram hash: missing tokens or output");
    size_t per_token = (size_t)layout->n_layers * (size_t)(layout->n_cols > 0 ? layout->n_cols : 0);
    for (size_t t = 0; t < n; t++) {
        ds41_engram_history next = *h;
        if (ds41_engram_history_push(&next, compressed[t], err) != 0)
            return ds41_error_prefix(err, "token %zu", t);
        for (int slot = 0; slot < layout->n_layers; slot++)
            if (ds41_engram_hash_position(layout, slot, &next, pad_id,
                                          ids_out + t * per_token + (size_t)slot * (size_t)layout->n_cols,
                                          err) != 0)
                return ds41_error_prefix(err, "token %zu", t);
        *h = next;
    }
    return 0;
}
