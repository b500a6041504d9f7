/* Engram layout: PCG64 / SeedSequence against numpy, primes, offsets and multipliers of the
 * released and a tiny config, the 960 hash vectors, and the compressed token map.
 * Data: tests/data/engram/ (see its README.md). */
#include "engine/model/engram_layout.h"
#include "engine/model/engram_token_map.h"
#include "engine/model/pcg64.h"
#include "tests/tap.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DATA "tests/data/engram/"

static json_t *load_json(const char *path) {
    json_error_t je;
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &je);
    if (!j) TAP_NOTE("cannot load %s: %s (line %d)", path, je.text, je.line);
    return j;
}

static json_t *at(json_t *j, const char *path) {
    /* "a.b.3.c": object keys and array indices separated by dots. */
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *tok = strtok(buf, "."); tok && j; tok = strtok(NULL, ".")) {
        if (json_is_array(j))
            j = json_array_get(j, strtoul(tok, NULL, 10));
        else
            j = json_object_get(j, tok);
    }
    return j;
}

static int64_t geti(json_t *j, const char *path) {
    return (int64_t)json_integer_value(at(j, path));
}

static uint64_t parse_u64(const char *s) {
    return s ? strtoull(s, NULL, 0) : 0;
}

static unsigned __int128 parse_u128(const char *s) {
    unsigned __int128 v = 0;
    for (; s && *s >= '0' && *s <= '9'; s++) v = v * 10 + (unsigned)(*s - '0');
    return v;
}

/* ---- PCG64 ---- */

static void test_csv_stream(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        TAP_CHECK(0, "%s: readable", path);
        return;
    }
    char line[256];
    uint64_t seed = 0;
    int have_seed = 0, n = 0, bad = -1;
    uint64_t got_bad = 0, want_bad = 0;
    ds41_pcg64 rng;
    while (fgets(line, sizeof line, f)) {
        char *comma = strchr(line, ',');
        if (!comma) continue;
        *comma = 0;
        if (strcmp(line, "seed") == 0) {
            seed = parse_u64(comma + 1);
            have_seed = 1;
            ds41_seedseq_pcg64(&rng, seed);
            continue;
        }
        if (!have_seed) break;
        uint64_t want = parse_u64(comma + 1);
        uint64_t got = ds41_pcg64_next64(&rng);
        if (got != want && bad < 0) {
            bad = n;
            got_bad = got;
            want_bad = want;
        }
        n++;
    }
    fclose(f);
    TAP_CHECK(have_seed && n == 1000 && bad < 0,
              "%s: PCG64(SeedSequence(0x%" PRIx64 ")) reproduces numpy's %d raw values%s", path, seed, n,
              bad < 0 ? "" : " (mismatch)");
    if (bad >= 0) TAP_NOTE("first mismatch at %d: 0x%016" PRIx64 " != 0x%016" PRIx64, bad, got_bad, want_bad);
}

static void test_seed_states(json_t *rngs) {
    size_t i;
    json_t *e;
    json_array_foreach(rngs, i, e) {
        uint64_t seed = (uint64_t)geti(e, "seed");
        uint32_t words[4];
        ds41_seedseq_generate_state32(seed, words, 4);
        int ok = json_array_size(at(e, "seedsequence_generate_state_uint32x4")) == 4;
        for (int k = 0; k < 4; k++)
            ok &= words[k] == (uint32_t)json_integer_value(
                                  json_array_get(at(e, "seedsequence_generate_state_uint32x4"), (size_t)k));
        TAP_CHECK(ok, "SeedSequence(%" PRIu64 ").generate_state(4) equals numpy", seed);

        ds41_pcg64 rng;
        ds41_seedseq_pcg64(&rng, seed);
        ok = rng.state == parse_u128(json_string_value(at(e, "pcg64_state"))) &&
             rng.inc == parse_u128(json_string_value(at(e, "pcg64_inc")));
        TAP_CHECK(ok, "PCG64(%" PRIu64 ") state and increment equal numpy's", seed);

        json_t *raw = at(e, "raw_uint64_first8");
        ok = json_array_size(raw) == 8;
        for (size_t k = 0; k < 8 && ok; k++)
            ok = ds41_pcg64_next64(&rng) == parse_u64(json_string_value(json_array_get(raw, k)));
        TAP_CHECK(ok, "PCG64(%" PRIu64 ") first 8 raw values equal numpy's", seed);
    }
}

static void test_next32_and_bounds(void) {
    ds41_pcg64 a, b;
    ds41_seedseq_pcg64(&a, 12345);
    b = a;
    uint64_t v = ds41_pcg64_next64(&b);
    uint32_t lo = ds41_pcg64_next32(&a), hi = ds41_pcg64_next32(&a);
    TAP_CHECK(lo == (uint32_t)v && hi == (uint32_t)(v >> 32) && a.state == b.state,
              "next32 yields the low then the buffered high half of one 64-bit draw");

    ds41_error err;
    int64_t out[4] = {7, 7, 7, 7};
    ds41_seedseq_pcg64(&a, 1);
    b = a;
    TAP_CHECK(ds41_pcg64_integers(&a, 1, out, 4, &err) == 0 && out[0] == 0 && out[3] == 0 &&
                  a.state == b.state,
              "integers(0, 1) yields zeros without consuming the stream (numpy rng == 0)");
    TAP_CHECK(ds41_pcg64_integers(&a, 0, out, 1, &err) == -1 && strstr(err.msg, "high") &&
                  ds41_pcg64_integers(&a, -5, out, 1, &err) == -1,
              "integers rejects high < 1");
}

/* Sequences of integers() calls on one generator, every branch of numpy's bounded fill. */
static void test_bounded_draws(void) {
    json_t *j = load_json(DATA "numpy_bounded_draws.json");
    json_t *seqs = at(j, "sequences");
    int ok = json_array_size(seqs) > 0;
    size_t n_values = 0;
    char why[160] = "";
    size_t i;
    json_t *seq;
    json_array_foreach(seqs, i, seq) {
        uint64_t seed = parse_u64(json_string_value(at(seq, "seed")));
        ds41_pcg64 rng;
        ds41_seedseq_pcg64(&rng, seed);
        size_t c;
        json_t *call;
        json_array_foreach(at(seq, "calls"), c, call) {
            json_t *values = at(call, "values");
            size_t n = json_array_size(values);
            int64_t out[16];
            ds41_error err;
            if (n > 16 || ds41_pcg64_integers(&rng, geti(call, "high"), out, n, &err) != 0) {
                ok = 0;
                snprintf(why, sizeof why, " (seed %" PRIu64 " call %zu failed)", seed, c);
                break;
            }
            for (size_t k = 0; k < n; k++, n_values++)
                if (ok && out[k] != json_integer_value(json_array_get(values, k))) {
                    ok = 0;
                    snprintf(why, sizeof why,
                             " (seed %" PRIu64 " call %zu high %" PRId64 " value %zu: %" PRId64 ")", seed, c,
                             geti(call, "high"), k, out[k]);
                }
        }
    }
    TAP_CHECK(ok, "integers(0, high) equals numpy for %zu draws over all bounded-fill branches%s", n_values,
              why);
    json_decref(j);
}

/* ---- layout ---- */

static int json_int_array(json_t *a, int64_t *out, size_t max) {
    if (!json_is_array(a) || json_array_size(a) > max) return -1;
    for (size_t i = 0; i < json_array_size(a); i++) out[i] = json_integer_value(json_array_get(a, i));
    return (int)json_array_size(a);
}

static void test_release_layout(json_t *rngjson, json_t *release_config) {
    json_t *rel = at(rngjson, "release");
    int layer_ids[8];
    int64_t tmp[8];
    int n_layers = json_int_array(at(release_config, "engram_layer_ids"), tmp, 8);
    for (int i = 0; i < n_layers; i++) layer_ids[i] = (int)tmp[i];
    ds41_engram_layout l;
    ds41_error err = {{0}};
    int rc = ds41_engram_layout_compute(
        layer_ids, n_layers, (int)geti(release_config, "engram_max_ngram_size"),
        (int)geti(release_config, "engram_n_heads"), geti(release_config, "engram_vocab_size"),
        geti(release_config, "engram_compressed_vocab_size"), &l, &err);
    TAP_CHECK(rc == 0 && l.n_layers == 2 && l.n_cols == 24, "release layout computes (%s)",
              rc ? err.msg : "2 layers, 24 columns");
    if (rc) return;
    TAP_CHECK(l.multiplier_bound == geti(rel, "bound"), "release multiplier bound = %" PRId64,
              l.multiplier_bound);

    /* Raw integers() draws of default_rng(10007*L). */
    int ok = 1;
    for (int s = 0; s < 2; s++) {
        ds41_pcg64 rng;
        ds41_seedseq_pcg64(&rng, 10007u * (uint64_t)l.layers[s].layer_id);
        int64_t draws[4];
        ok &= ds41_pcg64_integers(&rng, l.multiplier_bound, draws, 4, &err) == 0;
        for (int k = 0; k < 4; k++) {
            char p[64];
            snprintf(p, sizeof p, "integers_draws.%d.%d", s, k);
            ok &= draws[k] == geti(rel, p);
        }
    }
    TAP_CHECK(ok, "integers(0, bound, size=4) draws for layers 1 and 14 equal numpy's");

    ok = 1;
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 4; k++) {
            char p[64];
            snprintf(p, sizeof p, "multipliers.%d.%d", s, k);
            ok &= l.layers[s].multipliers[k] == geti(rel, p);
        }
    TAP_CHECK(ok, "release multipliers equal numpy's (%" PRId64 ", ...)", l.layers[0].multipliers[0]);

    ok = 1;
    for (int s = 0; s < 2; s++)
        for (int c = 0; c < 24; c++) {
            char p[96];
            snprintf(p, sizeof p, "primes_[layer][ngram-2][head].%d.%d.%d", s, c / 8, c % 8);
            ok &= l.layers[s].primes[c] == geti(rel, p);
            snprintf(p, sizeof p, "offsets_[layer][col].%d.%d", s, c);
            ok &= l.layers[s].offsets[c] == geti(rel, p);
        }
    TAP_CHECK(ok, "release primes (global seen-set) and column offsets equal REFERENCE §6.2");

    int64_t num_embeddings[8];
    int n_emb = json_int_array(at(release_config, "engram_num_embeddings"), num_embeddings, 8);
    TAP_CHECK(n_emb == 2 && l.layers[0].rows == num_embeddings[0] && l.layers[1].rows == num_embeddings[1] &&
                  l.layers[0].rows == geti(rel, "rows_sum_primes.0"),
              "row counts %" PRId64 ", %" PRId64 " equal the released engram_num_embeddings",
              l.layers[0].rows, l.layers[1].rows);
    TAP_CHECK(ds41_engram_layout_check(&l, num_embeddings, n_emb, &err) == 0,
              "layout check accepts the released config");

    num_embeddings[1] += 1;
    rc = ds41_engram_layout_check(&l, num_embeddings, n_emb, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "engram_num_embeddings[1]") && strstr(err.msg, "384016682"),
              "layout check rejects a wrong engram_num_embeddings (%s)", err.msg);
    rc = ds41_engram_layout_check(&l, num_embeddings, 1, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "engram_num_embeddings"),
              "layout check rejects a wrong entry count (%s)", err.msg);

    TAP_CHECK(ds41_engram_layout_slot(&l, 14) == 1 && ds41_engram_layout_slot(&l, 1) == 0 &&
                  ds41_engram_layout_slot(&l, 2) == -1,
              "slot lookup by layer id");
}

static void test_tiny_layout(json_t *rngjson, json_t *tiny_config) {
    json_t *tc = at(tiny_config, "text_config");
    json_t *tiny = at(rngjson, "ishizuki_tiny");
    int64_t tmp[8];
    int layer_ids[8];
    int n_layers = json_int_array(at(tc, "engram_layer_ids"), tmp, 8);
    for (int i = 0; i < n_layers; i++) layer_ids[i] = (int)tmp[i];
    ds41_engram_layout l;
    ds41_error err = {{0}};
    int rc = ds41_engram_layout_compute(layer_ids, n_layers, (int)geti(tc, "engram_max_ngram_size"),
                                        (int)geti(tc, "engram_n_heads"), geti(tc, "engram_vocab_size"),
                                        geti(tc, "engram_compressed_vocab_size"), &l, &err);
    TAP_CHECK(rc == 0 && l.n_layers == 2 && l.n_cols == 6, "tiny layout computes (%s)",
              rc ? err.msg : "2 layers, 6 columns");
    if (rc) return;
    int ok = 1;
    for (int s = 0; s < 2; s++)
        for (int c = 0; c < 6; c++) {
            char p[64];
            snprintf(p, sizeof p, "primes.%d.%d.%d", s, c / 2, c % 2);
            ok &= l.layers[s].primes[c] == geti(tiny, p);
        }
    TAP_CHECK(ok, "tiny primes equal numpy/sympy's (101, 103, ..., 157 across both layers)");
    ok = 1;
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 4; k++) {
            char p[64];
            snprintf(p, sizeof p, "multipliers.%d.%d", s, k);
            ok &= l.layers[s].multipliers[k] == geti(tiny, p);
        }
    TAP_CHECK(ok, "tiny multipliers (compressed vocab 270, seeds 10007 and 40028) equal numpy's");
    int64_t num_embeddings[8];
    int n_emb = json_int_array(at(tc, "engram_num_embeddings"), num_embeddings, 8);
    TAP_CHECK(ds41_engram_layout_check(&l, num_embeddings, n_emb, &err) == 0 &&
                  l.layers[0].rows == geti(tiny, "rows.0") && l.layers[1].rows == geti(tiny, "rows.1"),
              "tiny row counts equal the tiny config's engram_num_embeddings");
}

static void test_layout_rejects(void) {
    ds41_engram_layout l;
    ds41_error err;
    int ids[3] = {1, 14, 1};
    struct {
        const int *ids;
        int n, ngram, heads;
        int64_t vocab, cvocab;
        const char *field;
    } bad[] = {
        {ids, 2, 1, 8, 16000000, 99092, "engram_max_ngram_size"},
        {ids, 2, DS41_ENGRAM_MAX_NGRAM + 1, 8, 16000000, 99092, "engram_max_ngram_size"},
        {ids, 2, 4, 0, 16000000, 99092, "engram_n_heads"},
        {ids, 2, 4, DS41_ENGRAM_MAX_HEADS + 1, 16000000, 99092, "engram_n_heads"},
        {ids, 2, 4, 8, 0, 99092, "engram_vocab_size"},
        {ids, 2, 4, 8, DS41_ENGRAM_MAX_VOCAB + 1, 99092, "engram_vocab_size"},
        {ids, 2, 4, 8, 16000000, 0, "engram_compressed_vocab_size"},
        {ids, 2, 4, 8, 16000000, (int64_t)INT32_MAX + 1, "engram_compressed_vocab_size"},
        {ids, 3, 4, 8, 16000000, 99092, "listed twice"},
        {ids, -1, 4, 8, 16000000, 99092, "engram_layer_ids"},
        {ids, DS41_ENGRAM_MAX_LAYERS + 1, 4, 8, 16000000, 99092, "engram_layer_ids"},
        {NULL, 2, 4, 8, 16000000, 99092, "engram_layer_ids"},
    };
    const size_t n_bad = sizeof bad / sizeof bad[0];
    size_t first_bad = n_bad;
    for (size_t i = 0; i < n_bad; i++) {
        err.msg[0] = 0;
        int rc = ds41_engram_layout_compute(bad[i].ids, bad[i].n, bad[i].ngram, bad[i].heads, bad[i].vocab,
                                            bad[i].cvocab, &l, &err);
        if ((rc != -1 || !strstr(err.msg, bad[i].field) || l.n_layers != 0) && first_bad == n_bad)
            first_bad = i;
    }
    TAP_CHECK(first_bad == n_bad, "layout rejects %zu out-of-range config values, naming the field", n_bad);
    if (first_bad != n_bad) TAP_NOTE("first failing case %zu (%s)", first_bad, err.msg);
    int neg[1] = {-3};
    TAP_CHECK(ds41_engram_layout_compute(neg, 1, 4, 8, 16000000, 99092, &l, &err) == -1 &&
                  strstr(err.msg, "engram_layer_ids[0]"),
              "layout rejects a negative layer id");
    TAP_CHECK(ds41_engram_layout_compute(NULL, 0, 0, 0, 0, 0, &l, &err) == 0 && l.n_layers == 0 &&
                  ds41_engram_layout_check(&l, NULL, 0, &err) == 0,
              "no engram layers: empty layout, nothing else checked");
    /* Primes just above a small vocabulary, seen-set across two layers with vocab 2: 2,3 | 5,7. */
    int two[2] = {0, 5};
    TAP_CHECK(ds41_engram_layout_compute(two, 2, 2, 2, 2, 10, &l, &err) == 0 && l.layers[0].primes[0] == 2 &&
                  l.layers[0].primes[1] == 3 && l.layers[1].primes[0] == 5 && l.layers[1].primes[1] == 7 &&
                  l.layers[1].offsets[1] == 5 && l.layers[1].rows == 12,
              "prime search restarts per layer and skips primes already taken");
}

/* ---- hashing ---- */

static int64_t json_rows(json_t *a, size_t i) {
    return json_integer_value(json_array_get(a, i));
}

static int hash_case(const ds41_engram_layout *l, int32_t pad, json_t *token_map, json_t *tokens,
                     json_t *mask, json_t *rows, int incremental, char *why, size_t why_len) {
    size_t n = json_array_size(tokens);
    size_t per = (size_t)l->n_layers * (size_t)l->n_cols;
    if (n == 0 || n > 64 || json_array_size(rows) != n * per) {
        snprintf(why, why_len, "bad vector sizes");
        return 0;
    }
    int32_t comp[64];
    for (size_t t = 0; t < n; t++) {
        int64_t tok = json_integer_value(json_array_get(tokens, t));
        int dead = mask && json_integer_value(json_array_get(mask, t)) == 0;
        comp[t] =
            dead ? DS41_ENGRAM_DEAD : (int32_t)json_integer_value(json_array_get(token_map, (size_t)tok));
    }
    int64_t *ids = calloc(n * per, sizeof *ids);
    ds41_engram_history h;
    ds41_engram_history_init(&h);
    ds41_error err;
    int rc;
    if (!incremental) {
        rc = ds41_engram_hash_tokens(l, &h, pad, comp, n, ids, &err);
    } else {
        /* prefill of 5 (or all), then decode one token at a time through hash_position */
        size_t pre = n > 5 ? 5 : n;
        rc = ds41_engram_hash_tokens(l, &h, pad, comp, pre, ids, &err);
        for (size_t t = pre; t < n && rc == 0; t++) {
            rc = ds41_engram_history_push(&h, comp[t], &err);
            for (int s = 0; s < l->n_layers && rc == 0; s++)
                rc = ds41_engram_hash_position(l, s, &h, pad, ids + t * per + (size_t)s * (size_t)l->n_cols,
                                               &err);
        }
    }
    int ok = rc == 0;
    if (!ok) snprintf(why, why_len, "%.200s", err.msg);
    for (size_t i = 0; ok && i < n * per; i++)
        if (ids[i] != json_rows(rows, i)) {
            snprintf(why, why_len, "token %zu layer slot %zu col %zu: %" PRId64 " != %" PRId64, i / per,
                     (i % per) / (size_t)l->n_cols, i % (size_t)l->n_cols, ids[i], json_rows(rows, i));
            ok = 0;
        }
    free(ids);
    return ok;
}

static void test_hash_vectors(json_t *v) {
    json_t *lay = at(v, "layout");
    int64_t tmp[8];
    int ids[8];
    int n = json_int_array(at(lay, "layer_ids"), tmp, 8);
    for (int i = 0; i < n; i++) ids[i] = (int)tmp[i];
    ds41_engram_layout l;
    ds41_error err;
    int rc = ds41_engram_layout_compute(ids, n, (int)geti(lay, "max_ngram_size"), (int)geti(lay, "n_heads"),
                                        geti(lay, "engram_vocab_size"), geti(lay, "compressed_vocab_size"),
                                        &l, &err);
    int64_t rows[8];
    int n_rows = json_int_array(at(lay, "rows"), rows, 8);
    TAP_CHECK(rc == 0 && ds41_engram_layout_check(&l, rows, n_rows, &err) == 0,
              "hash-vector layout matches its row counts");
    if (rc) return;
    json_t *map = at(v, "token_map");
    int32_t pad = (int32_t)json_integer_value(json_array_get(map, (size_t)geti(lay, "pad_id_raw")));
    char why[256] = "";
    size_t total = json_array_size(at(v, "f1_rows")) + json_array_size(at(v, "f2_rows")) +
                   json_array_size(at(v, "f3_rows"));
    int ok = hash_case(&l, pad, map, at(v, "f1_tokens"), NULL, at(v, "f1_rows"), 0, why, sizeof why);
    TAP_CHECK(ok, "hash vectors: 8-token prefill, 384 row ids %s", why);
    ok = hash_case(&l, pad, map, at(v, "f1_tokens"), at(v, "f2_mask"), at(v, "f2_rows"), 0, why, sizeof why);
    TAP_CHECK(ok, "hash vectors: position 3 DEAD blocks it and later look-backs, 384 row ids %s", why);
    ok = hash_case(&l, pad, map, at(v, "f3a_tokens"), NULL, at(v, "f3_rows"), 0, why, sizeof why) &&
         hash_case(&l, pad, map, at(v, "f3b_tokens"), NULL, at(v, "f3_rows"), 0, why, sizeof why);
    TAP_CHECK(ok, "hash vectors: two ids sharing a compressed id hash alike, 2 x 192 row ids %s", why);
    TAP_CHECK(total == 960, "hash vectors: %zu distinct expected ids in all", total);
    ok = hash_case(&l, pad, map, at(v, "f1_tokens"), at(v, "f2_mask"), at(v, "f2_rows"), 1, why, sizeof why);
    TAP_CHECK(ok, "prefill then decode (history persists) gives the same ids %s", why);

    /* Errors. */
    ds41_engram_history h;
    ds41_engram_history_init(&h);
    int64_t out[DS41_ENGRAM_MAX_COLS];
    TAP_CHECK(ds41_engram_hash_position(&l, 0, &h, pad, out, &err) == -1 && strstr(err.msg, "no token"),
              "hashing an empty history fails");
    TAP_CHECK(ds41_engram_history_push(&h, -2, &err) == -1 && h.n_pushed == 0,
              "push rejects negative ids other than DEAD");
    ds41_engram_history_push(&h, 99092, &err);
    TAP_CHECK(ds41_engram_hash_position(&l, 0, &h, pad, out, &err) == -1 && strstr(err.msg, "99092"),
              "hash rejects a compressed id >= compressed vocab (%s)", err.msg);
    ds41_engram_history_init(&h);
    ds41_engram_history_push(&h, 5, &err);
    TAP_CHECK(ds41_engram_hash_position(&l, 2, &h, pad, out, &err) == -1 &&
                  ds41_engram_hash_position(&l, 0, &h, 99092, out, &err) == -1 &&
                  ds41_engram_hash_position(&l, 0, &h, -1, out, &err) == -1,
              "hash rejects a bad slot and a pad id outside the compressed vocab");
    int32_t toks[3] = {4, -7, 5};
    int64_t outs[3 * 2 * 24];
    ds41_engram_history_init(&h);
    rc = ds41_engram_hash_tokens(&l, &h, pad, toks, 3, outs, &err);
    TAP_CHECK(rc == -1 && h.n_pushed == 1 && strstr(err.msg, "token 1"),
              "hash_tokens stops at a bad token, keeping the history before it (%s)", err.msg);
}

/* ---- token map ---- */

static int key_is(const char *text, const char *raw, const char *want) {
    char *key = NULL;
    size_t len = 0;
    ds41_error err;
    if (ds41_engram_token_key(text, strlen(text), raw, raw ? strlen(raw) : 0, &key, &len, &err) != 0) {
        TAP_NOTE("key of '%s' failed: %s", text, err.msg);
        return 0;
    }
    int ok = len == strlen(want) && memcmp(key, want, len) == 0;
    if (!ok) TAP_NOTE("key of '%s' is '%.*s', want '%s'", text, (int)len, key, want);
    free(key);
    return ok;
}

static int same_key(const char *a, const char *b) {
    char *ka = NULL, *kb = NULL;
    size_t la = 0, lb = 0;
    int ok = ds41_engram_token_key(a, strlen(a), "ra", 2, &ka, &la, NULL) == 0 &&
             ds41_engram_token_key(b, strlen(b), "rb", 2, &kb, &lb, NULL) == 0 && la == lb &&
             memcmp(ka, kb, la) == 0;
    free(ka);
    free(kb);
    return ok;
}

static void test_normalize_hand_cases(void) {
    TAP_CHECK(same_key("\xc3\x89", "e") && key_is("\xc3\x89", NULL, "e"),
              "'\xc3\x89' and 'e' share a key (NFD, marks dropped, lowercase)");
    TAP_CHECK(same_key("\xef\xac\x81", "fi") && key_is("\xef\xac\x81", NULL, "fi"),
              "NFKC: the ligature U+FB01 keys as 'fi'");
    TAP_CHECK(key_is("a \t\r\n b", NULL, "a b") && key_is("  Hello  World  ", NULL, "hello world"),
              "runs of [ \\t\\r\\n] become one space, ends are stripped");
    TAP_CHECK(key_is(" ", NULL, " ") && key_is("  ", NULL, " ") && key_is("\t\n", NULL, " ") &&
                  key_is(" x ", NULL, "x"),
              "' ' alone survives the strip (sentinel), '  ' collapses to it, ' x ' strips");
    TAP_CHECK(key_is("a\xef\xbf\xbd", "\xc3\xa2\xc4\xa2", "\xc3\xa2\xc4\xa2") &&
                  key_is("\xef\xbf\xbd", "raw", "raw"),
              "a text with U+FFFD keys by its raw vocabulary string");
    TAP_CHECK(key_is("\xcc\x81", NULL, "\xcc\x81") && key_is("\xe1\x9a\x80", NULL, "\xe1\x9a\x80") &&
                  key_is("", "r", ""),
              "a text that normalises to '' keeps the text itself (lone mark, U+1680, empty)");
    TAP_CHECK(key_is("\xc2\xa0x\xe3\x80\x80", NULL, "x") && key_is("\x1cq\x1f", NULL, "\x1cq\x1f"),
              "strip removes Unicode White_Space only (not U+001C..U+001F)");
    TAP_CHECK(key_is("\xce\x9f\xce\x94\xce\x9f\xce\xa3", NULL, "\xce\xbf\xce\xb4\xce\xbf\xcf\x83") &&
                  key_is("\xc4\xb0stanbul", NULL, "istanbul"),
              "lowercase is per character (no final sigma; U+0130 loses its dot as a mark)");
    TAP_CHECK(key_is("\xee\x80\x80", NULL, " ") && key_is("a\xee\x80\x80"
                                                          "b",
                                                          NULL, "a b"),
              "a U+E000 in the text also becomes a space (as the reference's sentinel replace)");
    char *out = NULL;
    size_t len = 0;
    ds41_error err;
    TAP_CHECK(ds41_engram_normalize("a\0B", 3, &out, &len, &err) == 0 && len == 3 &&
                  memcmp(out, "a\0b", 3) == 0,
              "NUL bytes pass through normalisation");
    free(out);
    TAP_CHECK(ds41_engram_normalize("\xff", 1, &out, &len, &err) == -1 && out == NULL &&
                  ds41_engram_normalize("\xed\xa0\x80", 3, &out, &len, &err) == -1,
              "invalid UTF-8 (and encoded surrogates) is rejected: %s", err.msg);
}

static void test_normalize_cases_file(void) {
    json_t *cases = load_json(DATA "normalize_cases.json");
    size_t i;
    json_t *c;
    int ok = cases != NULL && json_array_size(cases) > 50;
    size_t bad = 0;
    json_array_foreach(cases, i, c) {
        json_t *in = json_array_get(c, 0), *want = json_array_get(c, 1);
        char *out = NULL;
        size_t len = 0;
        ds41_error err;
        int good =
            ds41_engram_normalize(json_string_value(in), json_string_length(in), &out, &len, &err) == 0 &&
            len == json_string_length(want) && memcmp(out, json_string_value(want), len) == 0;
        if (!good && ok) {
            bad = i;
            ok = 0;
        }
        free(out);
    }
    TAP_CHECK(ok, "normalisation equals the Python prototype on %zu tricky strings%s", json_array_size(cases),
              ok ? "" : " (mismatch)");
    if (!ok) TAP_NOTE("first mismatch: case %zu", bad);
    json_decref(cases);
}

typedef struct text_table {
    const char *const (*entries)[2];
    uint32_t n;
    uint32_t fail_at; /* UINT32_MAX: never */
} text_table;

static int table_text(void *ctx, uint32_t id, char **text, size_t *text_len, const char **raw,
                      size_t *raw_len, ds41_error *err) {
    text_table *t = ctx;
    if (id >= t->n || id == t->fail_at) return ds41_fail(err, "no such id");
    *text_len = strlen(t->entries[id][0]);
    *text = malloc(*text_len + 1);
    memcpy(*text, t->entries[id][0], *text_len + 1);
    *raw = t->entries[id][1];
    *raw_len = strlen(*raw);
    return 0;
}

static void test_token_map_build(void) {
    static const char *const entries[][2] = {
        {"Hello", "Hello"},                     /* 0 -> hello */
        {"hello", "hello"},                     /* 0 */
        {"\xc3\x89", "\xc3\x83\xc2\x89"},       /* 1 -> e */
        {"e", "e"},                             /* 1 */
        {"\xef\xac\x81", "x"},                  /* 2 -> fi */
        {"fi", "fi"},                           /* 2 */
        {" ", "\xc4\xa0"},                      /* 3 -> ' ' */
        {"  ", "\xc4\xa0\xc4\xa0"},             /* 3 */
        {"\t", "\xc4\x89"},                     /* 3 */
        {" x ", "\xc4\xa0x\xc4\xa0"},           /* 4 -> x */
        {"x", "x"},                             /* 4 */
        {"\xef\xbf\xbd", "\xc3\xa2\xc4\xa2"},   /* 5 -> raw */
        {"\xef\xbf\xbd", "\xc3\xa2\xc4\xa3"},   /* 6 -> another raw */
        {"a\xef\xbf\xbd", "a\xc3\xa2\xc4\xa2"}, /* 7 */
        {"\xcc\x81", "\xc3\x8c\xc2\x81"},       /* 8 -> its own text */
        {"\xe2\x83\x9d", "z"},                  /* 9 */
        {"", ""},                               /* 10 */
        {"\xe1\x9a\x80", "q"},                  /* 11 */
        {"\xef\xbf\xbd", "hello"},              /* 0: a raw key equal to a normalised one */
        {"e\xcc\x81", "y"},                     /* 1 */
        {"\xc4\xb0", "w"},                      /* 12 -> i */
        {"i", "i"},                             /* 12 */
        {"\xc3\xa2\xc4\xa2", "v"}, /* 13 -> 'âģ' normalised: 'aģ'... distinct from the raw key 5 */
    };
    static const int32_t want[] = {0, 0, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 12, 12, 13};
    const uint32_t n = sizeof entries / sizeof entries[0];
    text_table t = {entries, n, UINT32_MAX};
    int32_t map[sizeof entries / sizeof entries[0]];
    uint32_t n_comp = 0;
    ds41_error err;
    int rc = ds41_engram_token_map_build(n, table_text, &t, map, &n_comp, &err);
    int ok = rc == 0 && n_comp == 14 && sizeof want == sizeof map;
    uint32_t bad = 0;
    for (uint32_t i = 0; ok && i < n; i++)
        if (map[i] != want[i]) {
            bad = i;
            ok = 0;
        }
    TAP_CHECK(ok, "token map: first-appearance ids over %u hand-made tokens, %u distinct%s", n, n_comp,
              ok ? "" : " (mismatch)");
    if (!ok) TAP_NOTE("rc %d (%s), first mismatch at id %u", rc, rc ? err.msg : "", bad);

    t.fail_at = 7;
    rc = ds41_engram_token_map_build(n, table_text, &t, map, &n_comp, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "token 7") && strstr(err.msg, "no such id"),
              "token map: a callback error names the id (%s)", err.msg);
    static const char *const invalid[][2] = {{"a", "a"}, {"\xc3", "x"}};
    text_table ti = {invalid, 2, UINT32_MAX};
    rc = ds41_engram_token_map_build(2, table_text, &ti, map, &n_comp, &err);
    TAP_CHECK(rc == -1 && strstr(err.msg, "token 1"),
              "token map: invalid UTF-8 text is an error naming the id (%s)", err.msg);
    TAP_CHECK(ds41_engram_token_map_build(0, table_text, &ti, map, &n_comp, &err) == -1,
              "token map: zero ids rejected");
}

static void hex32(const uint8_t d[32], char out[65]) {
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void test_digest_and_struffl(json_t *tiny_config) {
    uint8_t d[32];
    char hex[65];
    /* sha256("[]") and sha256("[0, 1, -1]"), from sha256sum. */
    ds41_engram_token_map_digest(NULL, 0, d);
    hex32(d, hex);
    int ok = strcmp(hex, "4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945") == 0;
    int32_t small[3] = {0, 1, -1};
    ds41_engram_token_map_digest(small, 3, d);
    hex32(d, hex);
    ok &= strcmp(hex, "71d179e82d47ec3390431c7f77829adc3def57ceda0a92b886cd0f96c0248bbf") == 0;
    TAP_CHECK(ok, "digest is sha256 of \"[a, b, ...]\" (%s)", hex);

    json_t *m = load_json(DATA "struffl_tiny_engram_token_map.json");
    json_t *tc = at(tiny_config, "text_config");
    size_t n = json_array_size(m);
    int32_t *map = calloc(n ? n : 1, sizeof *map);
    int32_t max = -1;
    ok = n > 0;
    for (size_t i = 0; i < n; i++) {
        map[i] = (int32_t)json_integer_value(json_array_get(m, i));
        if (map[i] > max + 1 || map[i] < 0) ok = 0; /* ids appear in first-appearance order */
        if (map[i] > max) max = map[i];
    }
    TAP_CHECK(ok && (int64_t)n == geti(tc, "vocab_size") &&
                  max + 1 == geti(tc, "engram_compressed_vocab_size"),
              "struffl tiny map: %zu ids, %d compressed ids in first-appearance order, as its config says", n,
              max + 1);
    ds41_engram_token_map_digest(map, (uint32_t)n, d);
    hex32(d, hex);
    TAP_CHECK(strcmp(hex, "1cded3946009157d62f32a46e7d55094ed5725d7da9dc4f0b25e09ec8a1645fa") == 0,
              "digest of the struffl map equals the sha256 of its published JSON file");
    free(map);
    json_decref(m);
}

/* The real V4.1 tokenizer's map (99,092 ids, the published digest) is checked
 * end to end through the vocabulary loader in tests/test_engram_tokens.c. */

int main(void) {
    test_csv_stream(DATA "pcg64-testset-1.csv");
    test_csv_stream(DATA "pcg64-testset-2.csv");
    json_t *rng = load_json(DATA "engram_rng_values_numpy1.24.json");
    json_t *release_config = load_json(DATA "inference_config.json");
    json_t *tiny_config = load_json(DATA "struffl_tiny_config.json");
    json_t *vectors = load_json(DATA "dsv41_engram_hash_vectors.json");
    TAP_CHECK(rng && release_config && tiny_config && vectors, "test data loads");
    test_seed_states(at(rng, "rng"));
    test_next32_and_bounds();
    test_bounded_draws();
    test_release_layout(rng, release_config);
    test_tiny_layout(rng, tiny_config);
    test_layout_rejects();
    test_hash_vectors(vectors);
    test_normalize_hand_cases();
    test_normalize_cases_file();
    test_token_map_build();
    test_digest_and_struffl(tiny_config);
    json_decref(rng);
    json_decref(release_config);
    json_decref(tiny_config);
    json_decref(vectors);
    return tap_done();
}
