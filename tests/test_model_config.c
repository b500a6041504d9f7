/* Tests for config/model_config: the released inference/config.json, its
 * layer roles (REFERENCE.md §0.1 table), cache sizes, round trips, overrides,
 * defaults, and one error per validation rule naming the key at fault. */
#include "config/model_config.h"
#include "tests/tap.h"
#include "tests/test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define RELEASED "tests/data/config/inference_config.json"
#define TINY "tests/data/config/tiny_inference_config.json"

/* Copy of s with the first `from` replaced by `to`; NULL if `from` is absent. */
static char *replace(const char *s, const char *from, const char *to) {
    const char *at = strstr(s, from);
    if (!at) return NULL;
    size_t pre = (size_t)(at - s), fl = strlen(from), tl = strlen(to), rest = strlen(at + fl);
    char *out = malloc(pre + tl + rest + 1);
    memcpy(out, s, pre);
    memcpy(out + pre, to, tl);
    memcpy(out + pre + tl, at + fl, rest + 1);
    return out;
}

static bool has(const char *msg, const char *needle) {
    return strstr(msg, needle) != NULL;
}

/* Apply NULL-terminated key/value pairs in order, then finalize. */
static int set_all(ds41_model_config *c, const char *const *kv, ds41_error *err) {
    for (size_t i = 0; kv[i]; i += 2)
        if (ds41_model_config_set(c, kv[i], kv[i + 1], err) != 0) return -1;
    return ds41_model_config_finalize(c, err);
}

static char *released_text;
static size_t released_len;

/* Parse the released text with `from` replaced by `to`; expect an error that
 * contains `want`. */
static void expect_parse_error(const char *from, const char *to, const char *want, const char *what) {
    char *t = replace(released_text, from, to);
    ds41_model_config cfg;
    ds41_error err = {{0}};
    int rc = t ? ds41_model_config_parse(t, strlen(t), NULL, &cfg, &err) : 0;
    TAP_CHECK(t && rc == -1 && has(err.msg, want), "%s -> error naming %s (got: %s)", what, want,
              t ? err.msg : "(replacement text not found)");
    ds41_model_config_free(&cfg);
    free(t);
}

/* Parse the released config, override keys with set(), finalize; expect an
 * error containing `want`.  keys/values are NULL-terminated pairs. */
static void expect_finalize_error(const char *const *kv, const char *want, const char *what) {
    ds41_model_config cfg;
    ds41_error err = {{0}};
    int ok = ds41_model_config_parse(released_text, released_len, NULL, &cfg, &err) == 0;
    for (size_t i = 0; ok && kv[i]; i += 2) ok = ds41_model_config_set(&cfg, kv[i], kv[i + 1], &err) == 0;
    int rc = ok ? ds41_model_config_finalize(&cfg, &err) : 0;
    TAP_CHECK(ok && rc == -1 && has(err.msg, want) && !cfg.finalized && !cfg.roles,
              "%s -> error naming %s (got: %s)", what, want, err.msg);
    ds41_model_config_free(&cfg);
}

/* The released §0.1 table, transcribed by hand. */
static void test_released_roles(const ds41_model_config *c) {
    char kind[96], want[96];
    int bad = -1;
    char got_kind[256] = "";
    for (int l = 0; l < 43 && bad < 0; l++) {
        if (l <= 1) snprintf(want, sizeof want, "window");
        else if (l == 2 || l == 8 || l == 14) snprintf(want, sizeof want, "kv+index source");
        else if (l < 20) snprintf(want, sizeof want, "consumer of %d", l < 8 ? 2 : l < 14 ? 8 : 14);
        else if (l == 20) snprintf(want, sizeof want, "kv+index+candidate source");
        else if (l < 24) snprintf(want, sizeof want, "consumer of 20");
        else if (l < 40 && l % 4 == 0) snprintf(want, sizeof want, "index source (keys of 20), candidate user");
        else if (l < 40) snprintf(want, sizeof want, "consumer of 20, indices of %d", l - l % 4);
        else snprintf(want, sizeof want, "dspark stage %d (window)", l - 40);
        ds41_layer_role_kind(&c->roles[l], kind, sizeof kind);
        if (strcmp(kind, want) != 0) {
            bad = l;
            snprintf(got_kind, sizeof got_kind, "%s (want %s)", kind, want);
        }
    }
    TAP_CHECK(c->n_roles == 43 && bad < 0, "released: role kinds match the §0.1 table (first mismatch layer %d: %s)",
              bad, got_kind);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++) {
        const ds41_layer_role *r = &c->roles[l];
        int ratio = l < 2 || l >= 40 ? 0 : l < 20 ? 2 : 1;
        int kv_from = ratio == 0 ? -1 : l < 8 ? 2 : l < 14 ? 8 : l < 20 ? 14 : 20;
        int index_from = ratio == 0 ? -1 : l < 24 ? kv_from : l - l % 4;
        bool kv_source = l == 2 || l == 8 || l == 14 || l == 20;
        bool index_source = kv_source || (l >= 24 && l < 40 && l % 4 == 0);
        if (r->ratio != ratio || r->kv_from != kv_from || r->index_from != index_from || r->kv_source != kv_source ||
            r->index_source != index_source || r->index_keys_from != (index_source ? kv_from : -1) || !r->present)
            bad = l;
    }
    TAP_CHECK(bad < 0, "released: ratio, kv_from, index_from, index_keys_from per layer (first bad layer %d)", bad);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++) {
        const ds41_layer_role *r = &c->roles[l];
        bool user = l >= 24 && l < 40 && l % 4 == 0;
        if (r->candidate_source != (l == 20) || r->candidate_user != user) bad = l;
    }
    TAP_CHECK(bad < 0, "released: candidate source 20, users 24/28/32/36 (first bad layer %d)", bad);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++) {
        int slot = l == 1 ? 0 : l == 14 ? 1 : -1;
        if (c->roles[l].engram_slot != slot) bad = l;
    }
    TAP_CHECK(bad < 0, "released: engram before blocks 1 and 14 only (first bad layer %d)", bad);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++) {
        const ds41_layer_role *r = &c->roles[l];
        bool tap = l >= 37 && l <= 39;
        int stage = l >= 40 ? l - 40 : -1;
        if (r->dspark_tap != tap || r->dspark_stage != stage) bad = l;
    }
    TAP_CHECK(bad < 0, "released: dspark taps 37-39, stages 40-42 (first bad layer %d)", bad);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++) {
        const ds41_layer_role *r = &c->roles[l];
        bool compressed = l >= 2 && l < 40;
        if (r->rope_theta != (compressed ? 160000.0 : 10000.0) || r->yarn != compressed) bad = l;
    }
    TAP_CHECK(bad < 0, "released: rope theta 10000 without YaRN on ratio-0 layers, 160000 + YaRN elsewhere "
                       "(first bad layer %d)",
              bad);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++) {
        const ds41_layer_role *r = &c->roles[l];
        if (r->n_experts != (l < 40 ? 384 : 128) || r->n_active_experts != (l < 40 ? 6 : 3)) bad = l;
    }
    TAP_CHECK(bad < 0, "released: 384/6 experts on the backbone, 128/3 on DSpark stages (first bad layer %d)", bad);

    bad = -1;
    for (int l = 0; l < 43 && bad < 0; l++)
        if (c->roles[l].has_wgate != (l == 2 || l == 8 || l == 14)) bad = l;
    TAP_CHECK(bad < 0, "released: wgate only on the ratio-2 kv sources 2, 8, 14 (first bad layer %d)", bad);
}

static void test_released(void) {
    ds41_model_config c;
    ds41_error err = {{0}};
    int rc = ds41_model_config_parse(released_text, released_len, "inference/config.json", &c, &err);
    TAP_CHECK(rc == 0 && c.finalized, "released config parses (%s)", rc ? err.msg : "ok");
    if (rc != 0) return;
    TAP_CHECK(c.n_unknown_keys == 0, "released config has no unknown keys (%zu)", c.n_unknown_keys);
    TAP_CHECK(c.vocab_size == 129280 && c.dim == 5120 && c.n_layers == 40 && c.n_mtp_layers == 3 &&
                  c.head_dim == 512 && c.index_topk == 512 && c.window_size == 128 && c.compress_ratios.n == 43 &&
                  c.engram_num_embeddings.n == 2 && c.engram_num_embeddings.v[1] == 384016682 &&
                  c.route_scale == 1.5 && c.norm_eps == 1e-20 && c.hc_eps == 1e-6 && c.rope_factor == 16.0 &&
                  c.original_seq_len == 65536 && c.dspark_noise_token_id == 128799 && c.image_token_id == 129264 &&
                  c.vision_min_pixels == 295936 && !c.vision_max_wh_ratio_set && c.dtype == DS41_WEIGHT_FP8 &&
                  c.expert_dtype == DS41_WEIGHT_FP4 && c.score_func == DS41_SCORE_SQRTSOFTPLUS,
              "released: scalar and list values read");
    TAP_CHECK(c.max_batch_size == 4 && c.max_seq_len == 4096 && c.temperature == 1.0 && c.gate_temp == 1.0 &&
                  c.norm_topk_prob,
              "released: ModelArgs defaults for the keys the file omits");
    TAP_CHECK(c.engram_enabled && c.dspark_enabled && c.vision_enabled && c.candidates_enabled,
              "released: engram, DSpark, vision and candidates are on");
    test_released_roles(&c);

    uint64_t latent = 0, ikey = 0;
    uint64_t total = ds41_model_config_cache_bytes_per_token(&c, &latent, &ikey);
    TAP_CHECK(total == 890 && latent == 720 && ikey == 170, "released: cache 890 B/token = 720 latent + 170 index "
                                                            "keys (got %llu = %llu + %llu)",
              (unsigned long long)total, (unsigned long long)latent, (unsigned long long)ikey);
    ds41_cache_rate rate = ds41_model_config_cache_rate(&c);
    TAP_CHECK(rate.per_tokens == 1 && rate.total_bytes == 890, "released: the cache rate is exact per token");
    /* 3 ratio-2 sources x floor(1001/2) entries + 1 ratio-1 source x 1001, 356 B each */
    total = ds41_model_config_cache_bytes_for_tokens(&c, 1001, &latent, &ikey);
    TAP_CHECK(total == 3 * 500 * 356 + 1001 * 356 && latent == (3 * 500 + 1001) * 288 && ikey == (3 * 500 + 1001) * 68,
              "released: cache bytes for 1001 tokens use floor(n/ratio) entries (got %llu)",
              (unsigned long long)total);
    ds41_session_bytes sb;
    ds41_model_config_session_bytes(&c, &sb);
    TAP_CHECK(sb.window_ring_bytes == 43u * 128 * (512 + 16) && sb.compressor_carry_bytes == 3u * 2 * 2 * 512 * 4 &&
                  sb.engram_history_bytes == 2u * 3 * 4 &&
                  sb.total_bytes == sb.window_ring_bytes + sb.compressor_carry_bytes + sb.engram_history_bytes,
              "released: per-session window rings, compressor carries, engram history (got %llu, %llu, %llu)",
              (unsigned long long)sb.window_ring_bytes, (unsigned long long)sb.compressor_carry_bytes,
              (unsigned long long)sb.engram_history_bytes);

    /* round trip */
    char *out = NULL;
    size_t out_len = 0;
    FILE *f = open_memstream(&out, &out_len);
    rc = ds41_model_config_write_json(&c, f, &err);
    fclose(f);
    ds41_model_config back;
    int rc2 = rc == 0 ? ds41_model_config_parse(out, out_len, "written", &back, &err) : -1;
    TAP_CHECK(rc == 0 && rc2 == 0 && ds41_model_config_equal(&c, &back) && back.n_unknown_keys == 0,
              "released: write_json output parses back to an equal config (%s)", rc2 ? err.msg : "ok");
    static const char head[] = "{\n    \"vocab_size\": 129280,\n    \"dim\": 5120,\n";
    TAP_CHECK(out && strncmp(out, head, sizeof head - 1) == 0 &&
                  has(out, "\n    \"compress_ratios\": [0, 0, 2, 2,") && has(out, "\"norm_eps\": 1e-20,") &&
                  has(out, "\"hc_eps\": 1e-06,") && has(out, "\"vision_max_wh_ratio\": null,") &&
                  has(out, "\"route_scale\": 1.5,") && has(out, "\"rope_theta\": 10000.0,") &&
                  has(out, "\"norm_topk_prob\": true\n}\n"),
              "released: write_json uses the released key order, 4-space indent, inline lists, short reals");
    if (rc2 == 0) {
        char *out2 = NULL;
        size_t out2_len = 0;
        f = open_memstream(&out2, &out2_len);
        ds41_model_config_write_json(&back, f, &err);
        fclose(f);
        TAP_CHECK(out2_len == out_len && memcmp(out, out2, out_len) == 0, "released: writing twice gives the same bytes");
        free(out2);
        ds41_model_config_free(&back);
    }
    free(out);

    /* a config differing in one key is not equal */
    ds41_model_config other;
    ds41_model_config_parse(released_text, released_len, NULL, &other, &err);
    TAP_CHECK(ds41_model_config_equal(&c, &other), "equal: the same text gives equal configs");
    ds41_model_config_set(&other, "hc_eps", "1e-7", &err);
    TAP_CHECK(!ds41_model_config_equal(&c, &other), "equal: a changed real is noticed");
    ds41_model_config_set(&other, "hc_eps", "1e-06", &err);
    ds41_model_config_set(&other, "engram_num_embeddings", "[384006168, 384016683]", &err);
    TAP_CHECK(!ds41_model_config_equal(&c, &other), "equal: a changed list entry is noticed");
    ds41_model_config_free(&other);
    ds41_model_config_free(&c);
}

static void test_set(void) {
    ds41_model_config c;
    ds41_error err = {{0}};
    ds41_model_config_parse(released_text, released_len, NULL, &c, &err);
    int rc = ds41_model_config_set(&c, "n_routed_experts", "256", &err);
    TAP_CHECK(rc == 0 && c.n_routed_experts == 256 && !c.finalized && c.roles == NULL,
              "set: n_routed_experts 256 stored, config needs finalize");
    rc = ds41_model_config_finalize(&c, &err);
    TAP_CHECK(rc == 0 && c.roles[5].n_experts == 256 && c.roles[41].n_experts == 128,
              "set: finalize after set re-derives roles (%s)", rc ? err.msg : "ok");

    static const char *const move[] = {"kv_source_layers", "[2, 8, 14, 20, 30]", "index_source_layers",
                                       "[2, 8, 14, 20, 30, 36]", "candidate_source_layer", "-1", NULL};
    rc = set_all(&c, move, &err);
    char kind[96];
    TAP_CHECK(rc == 0 && c.kv_source_layers.n == 5 && c.roles[30].kv_source && c.roles[33].kv_from == 30 &&
                  c.roles[37].index_from == 36 && c.roles[37].kv_from == 30 && c.roles[36].index_keys_from == 30 &&
                  !c.roles[36].candidate_user && !c.candidates_enabled &&
                  strcmp(ds41_layer_role_kind(&c.roles[38], kind, sizeof kind), "consumer of 30, indices of 36") == 0,
              "set: list overrides move kv and index sources (%s)", rc ? err.msg : kind);

    ds41_model_config before;
    ds41_model_config_parse(released_text, released_len, NULL, &before, &err);
    ds41_model_config_free(&c);
    ds41_model_config_parse(released_text, released_len, NULL, &c, &err);
    rc = ds41_model_config_set(&c, "dim", "\"5120\"", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "key 'dim'") && has(err.msg, "expected an integer, got a string") &&
                  c.dim == 5120 && c.finalized,
              "set: a wrongly typed value is refused, config unchanged (%s)", err.msg);
    rc = ds41_model_config_set(&c, "kv_source_layers", "[2, 8.5]", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "key 'kv_source_layers'") && c.kv_source_layers.n == 4,
              "set: a list with a real is refused, list unchanged (%s)", err.msg);
    rc = ds41_model_config_set(&c, "no_such_key", "1", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "unknown key 'no_such_key'"), "set: unknown keys are refused (%s)", err.msg);
    rc = ds41_model_config_set(&c, "n_layers", "40 41", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "key 'n_layers'") && has(err.msg, "not JSON"),
              "set: a value that is not JSON is refused (%s)", err.msg);
    TAP_CHECK(ds41_model_config_equal(&c, &before), "set: failed sets leave every key as it was");
    rc = ds41_model_config_set(&c, "vision_max_wh_ratio", "2.5", &err);
    bool wh_set = c.vision_max_wh_ratio_set && c.vision_max_wh_ratio == 2.5;
    rc |= ds41_model_config_set(&c, "vision_max_wh_ratio", "null", &err);
    TAP_CHECK(rc == 0 && wh_set && !c.vision_max_wh_ratio_set, "set: a nullable key takes a number and null");
    rc = ds41_model_config_set(&c, "score_func", "\"sigmoid\"", &err);
    TAP_CHECK(rc == -1 && has(err.msg, "key 'score_func'") && has(err.msg, "unsupported"),
              "set: score_func other than sqrtsoftplus is unsupported (%s)", err.msg);
    static const char *const behaviour[] = {"norm_topk_prob", "false", "temperature", "0", NULL};
    rc = set_all(&c, behaviour, &err);
    TAP_CHECK(rc == 0 && !c.norm_topk_prob && c.temperature == 0.0, "set: booleans and reals are overridden");
    ds41_model_config_free(&before);
    ds41_model_config_free(&c);
}

static void test_errors(void) {
    /* the brief's exact message for a wrong compress_ratios length */
    expect_parse_error("1, 1, 1, 1, 0, 0, 0]", "1, 1, 1, 1, 0, 0]", "inference/config.json: key 'compress_ratios': "
                       "expected 43 entries (n_layers + n_mtp_layers), got 42",
                       "compress_ratios one entry short");
    expect_parse_error("\"engram_num_embeddings\": [384006168, 384016682]", "\"engram_num_embeddings\": [384006168]",
                       "key 'engram_num_embeddings': expected 2 entries", "engram_num_embeddings one entry short");
    expect_parse_error("\"dim\": 5120,\n", "", "key 'dim': required key is missing", "missing dim");
    expect_parse_error("\"kv_source_layers\": [2, 8, 14, 20],\n", "", "key 'kv_source_layers': required key",
                       "missing kv_source_layers");
    expect_parse_error("\"dim\": 5120", "\"dim\": \"5120\"", "key 'dim': expected an integer, got a string",
                       "dim as a string");
    expect_parse_error("\"n_layers\": 40", "\"n_layers\": 40.0", "key 'n_layers': expected an integer, got a real",
                       "n_layers as a real");
    expect_parse_error("\"dim\": 5120", "\"dim\": -5120", "key 'dim': -5120 is out of range",
                       "negative dim");
    expect_parse_error("\"index_source_layers\": [2,", "\"index_source_layers\": [\"2\",",
                       "key 'index_source_layers': entry 0: expected an integer", "a string in a layer list");
    expect_parse_error("\"route_scale\": 1.5", "\"route_scale\": true", "key 'route_scale': expected a number",
                       "route_scale as a boolean");
    expect_parse_error("\"route_scale\": 1.5", "\"route_scale\": 1e999", "invalid JSON",
                       "an overflowing real (no NaN/inf can be represented)");
    expect_parse_error("\"rope_theta\": 10000", "\"rope_theta\": 1", "key 'rope_theta': 1 must be > 1",
                       "rope_theta 1");
    expect_parse_error("\"score_func\": \"sqrtsoftplus\"", "\"score_func\": \"softmax\"",
                       "key 'score_func': unsupported value \"softmax\"", "score_func softmax");
    expect_parse_error("\"dtype\": \"fp8\"", "\"dtype\": \"bf16\"", "key 'dtype': unsupported", "dtype bf16");
    expect_parse_error("\"expert_dtype\": \"fp4\"", "\"expert_dtype\": null", "key 'expert_dtype': expected a string",
                       "expert_dtype null");
    expect_parse_error("\"vision_max_wh_ratio\": null", "\"vision_max_wh_ratio\": \"wide\"",
                       "key 'vision_max_wh_ratio': expected a number or null", "vision_max_wh_ratio as a string");
    expect_parse_error("\"dim\": 5120,", "\"dim\": 5120, \"dim\": 5120,", "line 3 column 22: duplicate key 'dim'",
                       "duplicate short key");
    expect_parse_error("\"engram_compressed_vocab_size\": 99092,",
                       "\"engram_compressed_vocab_size\": 99092, \"engram_compressed_vocab_size\": 99092,",
                       "duplicate key 'engram_compressed_vocab_size'", "duplicate long key");
    expect_parse_error("\"vocab_size\": 129280,", "\"vocab_size\": 129280", "invalid JSON", "malformed JSON");

    static const char *const below_every_source[] = {
        "compress_ratios",
        "[0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
        "1, 1, 1, 1, 0, 0, 0]",
        NULL};
    expect_finalize_error(below_every_source, "key 'compress_ratios': layer 1 has ratio 2 but no kv source",
                          "a compressed layer below every kv source");
    static const char *const ratio_mismatch[] = {
        "compress_ratios",
        "[0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
        "1, 1, 1, 1, 0, 0, 0]",
        NULL};
    expect_finalize_error(ratio_mismatch, "key 'compress_ratios': layer 21 has ratio 2 but the kv source it reads, "
                                          "layer 20, has ratio 1",
                          "a compressed layer whose kv source has another ratio");
    static const char *const mtp_ratio[] = {
        "compress_ratios",
        "[0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
        "1, 1, 1, 1, 1, 0, 0]",
        NULL};
    expect_finalize_error(mtp_ratio, "key 'compress_ratios': layer 40 is DSpark/MTP stage 0",
                          "a DSpark stage with a compress ratio");
    static const char *const ratio3[] = {
        "compress_ratios",
        "[0, 0, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
        "1, 1, 1, 1, 0, 0, 0]",
        NULL};
    expect_finalize_error(ratio3, "key 'compress_ratios': layer 2: ratio 3 is not supported", "ratio 3");
    static const char *const index_uncompressed[] = {"index_source_layers", "[1, 2, 8, 14, 20, 24, 28, 32, 36]", NULL};
    expect_finalize_error(index_uncompressed, "key 'index_source_layers': layer 1 has compress ratio 0",
                          "an index source that is not compressed");
    static const char *const kv_uncompressed[] = {"kv_source_layers", "[0, 2, 8, 14, 20]", NULL};
    expect_finalize_error(kv_uncompressed, "key 'kv_source_layers': layer 0 has compress ratio 0",
                          "a kv source that is not compressed");
    static const char *const kv_not_index[] = {"kv_source_layers", "[2, 5, 8, 14, 20]", NULL};
    expect_finalize_error(kv_not_index, "key 'index_source_layers': layer 5 reads compressed KV from layer 5",
                          "a kv source that is not an index source");
    static const char *const unsorted[] = {"kv_source_layers", "[2, 14, 8, 20]", NULL};
    expect_finalize_error(unsorted, "key 'kv_source_layers': layers must be sorted and unique", "unsorted kv sources");
    static const char *const out_of_range[] = {"index_source_layers", "[2, 8, 14, 20, 24, 28, 32, 36, 41]", NULL};
    expect_finalize_error(out_of_range, "key 'index_source_layers': layer 41 is not a backbone layer",
                          "an index source beyond n_layers");

    static const char *const dims[] = {"dim", "moe_inter_dim", "q_lora_rank", "o_lora_rank", "head_dim",
                                       "index_head_dim"};
    static const char *const bad_values[] = {"5136", "2320", "1296", "1040", "528", "144"};
    const char *first_bad = NULL;
    char first_msg[DS41_ERROR_MAX] = "";
    for (size_t i = 0; i < sizeof dims / sizeof dims[0] && !first_bad; i++) {
        ds41_model_config c;
        ds41_error err = {{0}};
        ds41_model_config_parse(released_text, released_len, NULL, &c, &err);
        char want[128];
        snprintf(want, sizeof want, "key '%s': %s is not a multiple of 32", dims[i], bad_values[i]);
        if (ds41_model_config_set(&c, dims[i], bad_values[i], &err) != 0 || ds41_model_config_finalize(&c, &err) == 0 ||
            !has(err.msg, want)) {
            first_bad = dims[i];
            snprintf(first_msg, sizeof first_msg, "%s", err.msg);
        }
        ds41_model_config_free(&c);
    }
    TAP_CHECK(!first_bad, "K dims not multiples of 32 are refused, naming the key (first failure %s: %s)",
              first_bad ? first_bad : "-", first_msg);

    /* candidates: 1 + (blocks-1)*8 must reach index_topk 512: 64 blocks give 505, 65 give 513 */
    static const char *const few_blocks[] = {"candidate_topk_blocks", "64", NULL};
    expect_finalize_error(few_blocks, "key 'candidate_topk_blocks': 64 blocks of 8 leave as few as 505",
                          "candidate settings leaving fewer finite candidates than index_topk");
    {
        ds41_model_config c;
        ds41_error err = {{0}};
        ds41_model_config_parse(released_text, released_len, NULL, &c, &err);
        static const char *const enough[] = {"candidate_topk_blocks", "65", NULL};
        int rc = set_all(&c, enough, &err);
        TAP_CHECK(rc == 0, "65 candidate blocks of 8 (513 positions) are enough for index_topk 512 (%s)",
                  rc ? err.msg : "ok");
        ds41_model_config_free(&c);
    }
    static const char *const zero_block[] = {"candidate_block_size", "0", NULL};
    expect_finalize_error(zero_block, "key 'candidate_block_size': must be >= 1", "candidate block size 0");
    static const char *const cand_not_kv[] = {"candidate_source_layer", "24", NULL};
    expect_finalize_error(cand_not_kv, "key 'candidate_source_layer': layer 24 must be both a kv source and an index",
                          "a candidate source that is not a kv source");
    static const char *const cand_other_cache[] = {"candidate_source_layer", "14", NULL};
    expect_finalize_error(cand_other_cache, "key 'candidate_source_layer': index source layer 20 above the candidate "
                                            "source reads layer 20's",
                          "candidate users reading another kv source");

    static const char *const rope_odd[] = {"rope_head_dim", "63", NULL};
    expect_finalize_error(rope_odd, "key 'rope_head_dim': 63 is odd", "odd rope_head_dim");
    static const char *const rope_big[] = {"rope_head_dim", "160", NULL};
    expect_finalize_error(rope_big, "key 'rope_head_dim': 160 exceeds index_head_dim", "rope_head_dim > index_head_dim");
    static const char *const groups[] = {"o_groups", "6", NULL};
    expect_finalize_error(groups, "key 'o_groups': n_heads 64 is not divisible by o_groups 6", "n_heads % o_groups");
    static const char *const active[] = {"n_activated_experts", "400", NULL};
    expect_finalize_error(active, "key 'n_activated_experts': 400 exceeds n_routed_experts 384",
                          "more active than routed experts");
    static const char *const shared[] = {"n_shared_experts", "2", NULL};
    expect_finalize_error(shared, "key 'n_shared_experts': unsupported value 2", "two shared experts");
    static const char *const eng_ids[] = {"engram_layer_ids", "[14, 1]", NULL};
    expect_finalize_error(eng_ids, "key 'engram_layer_ids': layers must be sorted", "unsorted engram layers");
    static const char *const eng_hd[] = {"engram_head_dim", "240", NULL};
    expect_finalize_error(eng_hd, "key 'engram_head_dim': 240 is not a multiple of 32", "engram_head_dim % 32");
    static const char *const eng_ngram[] = {"engram_max_ngram_size", "1", NULL};
    expect_finalize_error(eng_ngram, "key 'engram_max_ngram_size': 1 must be >= 2", "engram with 1-grams");
    static const char *const eng_rows[] = {"engram_num_embeddings", "[384006168, 383999999]", NULL};
    expect_finalize_error(eng_rows, "key 'engram_num_embeddings': entry 1 (layer 14): 383999999 rows cannot hold 24",
                          "an engram table too small for its hash columns");
    static const char *const eng_off[] = {"engram_layer_ids", "[]", NULL};
    expect_finalize_error(eng_off, "key 'engram_num_embeddings': 2 entries but engram_layer_ids is empty",
                          "engram tables without engram layers");
    static const char *const pad[] = {"engram_pad_id", "129280", NULL};
    expect_finalize_error(pad, "key 'engram_pad_id': 129280 is not below vocab_size", "engram_pad_id >= vocab");
    static const char *const noise[] = {"dspark_noise_token_id", "129280", NULL};
    expect_finalize_error(noise, "key 'dspark_noise_token_id': 129280 is not below vocab_size", "noise id >= vocab");
    static const char *const image[] = {"image_token_id", "200000", NULL};
    expect_finalize_error(image, "key 'image_token_id': 200000 is not below vocab_size", "image id >= vocab");
    static const char *const target[] = {"dspark_target_layer_ids", "[38, 39, 40]", NULL};
    expect_finalize_error(target, "key 'dspark_target_layer_ids': layer 40 is not a backbone layer",
                          "a DSpark target beyond the backbone");
    static const char *const no_mtp[] = {
        "n_mtp_layers", "0", "compress_ratios",
        "[0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
        "1, 1, 1, 1]",
        NULL};
    expect_finalize_error(no_mtp, "key 'dspark_block_size': DSpark is on (5) but n_mtp_layers is 0",
                          "DSpark without stages");
    static const char *const dspark_active[] = {"dspark_n_activated_experts", "129", NULL};
    expect_finalize_error(dspark_active, "key 'dspark_n_activated_experts': 129 active experts exceed the 128",
                          "DSpark active experts > DSpark routed experts");
    static const char *const vision_heads[] = {"vision_n_heads", "12", NULL};
    expect_finalize_error(vision_heads, "key 'vision_n_heads': vision_dim 1024 is not divisible by 12 heads",
                          "vision_dim % vision_n_heads");
}

/* The reference's own ModelArgs shapes (model.py defaults), behavioural keys omitted. */
static const char minimal[] =
    "{\"vocab_size\": 129280, \"dim\": 1024, \"moe_inter_dim\": 1024, \"n_layers\": 5, \"n_mtp_layers\": 1,"
    " \"n_heads\": 16, \"n_routed_experts\": 8, \"n_activated_experts\": 2, \"q_lora_rank\": 256,"
    " \"head_dim\": 128, \"rope_head_dim\": 32, \"o_groups\": 8, \"o_lora_rank\": 256, \"window_size\": 128,"
    " \"compress_ratios\": [0, 2, 2, 1, 1, 0], \"kv_source_layers\": [1, 3], \"index_source_layers\": [1, 3],"
    " \"index_n_heads\": 16, \"index_head_dim\": 64, \"index_topk\": 64, \"some_future_key\": {\"x\": 1}}";

static void test_defaults(void) {
    ds41_model_config c;
    ds41_error err = {{0}};
    int rc = ds41_model_config_parse(minimal, sizeof minimal - 1, "minimal.json", &c, &err);
    TAP_CHECK(rc == 0, "defaults: a config with only the required keys parses (%s)", rc ? err.msg : "ok");
    if (rc != 0) return;
    TAP_CHECK(c.n_shared_experts == 1 && c.score_func == DS41_SCORE_SQRTSOFTPLUS && c.route_scale == 1.0 &&
                  c.swiglu_limit == 0.0 && c.norm_eps == 1e-20 && c.compress_rope_theta == 40000.0 &&
                  c.original_seq_len == 0 && c.rope_theta == 10000.0 && c.rope_factor == 40.0 && c.beta_fast == 32 &&
                  c.beta_slow == 1 && c.candidate_source_layer == -1 && c.candidate_topk_blocks == 0 &&
                  c.candidate_block_size == 0 && c.hc_mult == 4 && c.hc_sinkhorn_iters == 20 && c.hc_eps == 1e-6 &&
                  c.engram_layer_ids.n == 0 && c.engram_max_ngram_size == 1 && c.engram_pad_id == 2 &&
                  c.vision_n_layers == 0 && c.dspark_block_size == 0 && c.max_batch_size == 4 &&
                  c.max_seq_len == 4096 && c.temperature == 1.0 && c.gate_temp == 1.0 && c.norm_topk_prob &&
                  c.dtype == DS41_WEIGHT_FP8 && c.expert_dtype == DS41_WEIGHT_FP4 && c.image_token_id == -1 &&
                  !c.vision_max_wh_ratio_set && c.vision_rope_theta == 10000.0,
              "defaults: omitted behavioural keys take the ModelArgs defaults of §0.1");
    TAP_CHECK(!c.engram_enabled && !c.dspark_enabled && !c.vision_enabled && !c.candidates_enabled,
              "defaults: engram, DSpark, vision and candidates are off");
    char kind[96];
    TAP_CHECK(c.n_roles == 6 && c.roles[1].kv_source && c.roles[2].kv_from == 1 && c.roles[2].index_from == 1 &&
                  c.roles[1].has_wgate && !c.roles[3].has_wgate && c.roles[4].kv_from == 3 &&
                  c.roles[1].rope_theta == 40000.0 && !c.roles[1].yarn && c.roles[0].rope_theta == 10000.0 &&
                  !c.roles[5].present && c.roles[5].dspark_stage == -1 &&
                  strcmp(ds41_layer_role_kind(&c.roles[5], kind, sizeof kind), "unused mtp layer (DSpark off)") == 0,
              "defaults: roles of the reference's toy shapes; no YaRN without original_seq_len; MTP layer unbuilt");
    TAP_CHECK(c.n_unknown_keys == 1 && strcmp(c.unknown_keys[0], "some_future_key") == 0,
              "unknown keys are accepted and recorded");
    ds41_session_bytes sb;
    ds41_model_config_session_bytes(&c, &sb);
    TAP_CHECK(sb.window_ring_bytes == 5u * 128 * (128 + 4) && sb.compressor_carry_bytes == 2u * 2 * 128 * 4 &&
                  sb.engram_history_bytes == 0,
              "defaults: session bytes count only built layers (got %llu, %llu)",
              (unsigned long long)sb.window_ring_bytes, (unsigned long long)sb.compressor_carry_bytes);
    ds41_model_config_free(&c);

    char *t = replace(minimal, "\"n_mtp_layers\": 1,", "\"n_mtp_layers\": 1, \"dspark_block_size\": 4,");
    rc = ds41_model_config_parse(t, strlen(t), "minimal.json", &c, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "minimal.json: key 'dspark_noise_token_id': required key is missing (DSpark "
                                       "is on"),
              "feature keys are required once the feature is on (%s)", err.msg);
    free(t);
    t = replace(minimal, "\"n_mtp_layers\": 1,", "\"n_mtp_layers\": 1, \"vision_n_layers\": 2,");
    rc = ds41_model_config_parse(t, strlen(t), "minimal.json", &c, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "key 'vision_dim': required key is missing (vision is on"),
              "vision keys are required when vision is on (%s)", err.msg);
    free(t);
}

static void test_tiny(void) {
    size_t len;
    char *text = slurp(TINY, &len);
    ds41_model_config c;
    ds41_error err = {{0}};
    int rc = text ? ds41_model_config_parse(text, len, TINY, &c, &err) : -1;
    TAP_CHECK(rc == 0, "tiny config parses (%s)", rc ? err.msg : "ok");
    free(text);
    if (rc != 0) return;
    static const char *const want[13] = {"window",
                                         "window",
                                         "kv+index source",
                                         "consumer of 2",
                                         "kv+index source",
                                         "consumer of 4",
                                         "kv+index+candidate source",
                                         "consumer of 6",
                                         "index source (keys of 6), candidate user",
                                         "consumer of 6, indices of 8",
                                         "dspark stage 0 (window)",
                                         "dspark stage 1 (window)",
                                         "dspark stage 2 (window)"};
    int bad = -1;
    char kind[96] = "";
    for (int l = 0; l < 13 && bad < 0; l++)
        if (strcmp(ds41_layer_role_kind(&c.roles[l], kind, sizeof kind), want[l]) != 0) bad = l;
    TAP_CHECK(c.n_roles == 13 && bad < 0, "tiny: role kinds (first mismatch layer %d: %s)", bad, kind);
    TAP_CHECK(c.roles[1].engram_slot == 0 && c.roles[4].engram_slot == 1 && c.roles[7].dspark_tap &&
                  c.roles[9].dspark_tap && !c.roles[6].dspark_tap && c.roles[11].n_experts == 4 &&
                  c.roles[11].n_active_experts == 2 && c.roles[4].has_wgate && !c.roles[6].has_wgate,
              "tiny: engram slots, taps, DSpark experts, wgate");
    /* sources 2, 4 (ratio 2) and 6 (ratio 1); latent 64/2+64/16 = 36 B, index key 32/2+32/32 = 17 B */
    uint64_t latent, ikey;
    uint64_t total = ds41_model_config_cache_bytes_per_token(&c, &latent, &ikey);
    TAP_CHECK(total == 106 && latent == 72 && ikey == 34, "tiny: cache 106 B/token = 72 + 34 (got %llu = %llu + %llu)",
              (unsigned long long)total, (unsigned long long)latent, (unsigned long long)ikey);

    /* one ratio-2 source only: 17/2 index-key bytes per token is fractional */
    static const char *const one_pair_source[] = {"kv_source_layers", "[2, 6]", "index_source_layers", "[2, 6, 8]",
                                                  NULL};
    rc = set_all(&c, one_pair_source, &err);
    ds41_cache_rate rate = ds41_model_config_cache_rate(&c);
    total = ds41_model_config_cache_bytes_per_token(&c, &latent, &ikey);
    TAP_CHECK(rc == 0 && rate.per_tokens == 2 && rate.latent_bytes == 108 && rate.index_key_bytes == 51 &&
                  rate.total_bytes == 159 && total == 80 && latent == 54 && ikey == 26,
              "tiny: a fractional rate is exact as a fraction and rounded up per token (%s)", rc ? err.msg : "ok");
    total = ds41_model_config_cache_bytes_for_tokens(&c, 3, &latent, &ikey);
    TAP_CHECK(total == 53 + 3 * 53 && latent == 4 * 36 && ikey == 4 * 17,
              "tiny: exact bytes for 3 tokens (1 ratio-2 entry + 3 ratio-1 entries)");

    char *out = NULL;
    size_t out_len = 0;
    FILE *f = open_memstream(&out, &out_len);
    ds41_model_config_write_json(&c, f, &err);
    fclose(f);
    ds41_model_config back;
    rc = ds41_model_config_parse(out, out_len, "written", &back, &err);
    TAP_CHECK(rc == 0 && ds41_model_config_equal(&c, &back), "tiny: overridden config round-trips through write_json");
    if (rc == 0) ds41_model_config_free(&back);
    free(out);
    ds41_model_config_free(&c);
}

static void test_misc(void) {
    ds41_model_config c;
    ds41_error err = {{0}};
    static const char hf[] = "{\"architectures\": [\"DeepseekV41ForCausalLM\"], \"text_config\": {\"hidden_size\": 128}}";
    int rc = ds41_model_config_parse(hf, sizeof hf - 1, "config.json", &c, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "config.json: this is a Hugging Face style config.json"),
              "a Hugging Face config.json is refused with a hint (%s)", err.msg);
    ds41_model_config_free(&c);
    rc = ds41_model_config_parse("[1, 2]", 6, NULL, &c, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "expected a JSON object at the top level, got a list"),
              "a top-level list is refused (%s)", err.msg);
    /* not NUL-terminated: the length bounds the text */
    char buf[64];
    memset(buf, 'x', sizeof buf);
    memcpy(buf, "{}", 2);
    rc = ds41_model_config_parse(buf, 2, NULL, &c, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "key 'vocab_size': required key is missing"),
              "text is bounded by len, not by a NUL (%s)", err.msg);
    ds41_model_config zero;
    memset(&zero, 0, sizeof zero);
    TAP_CHECK(c.roles == NULL && c.label == NULL && memcmp(&c, &zero, sizeof c) == 0,
              "a failed parse leaves the config empty");
    ds41_model_config_free(&c);
    rc = ds41_model_config_parse(NULL, 0, NULL, &c, &err);
    TAP_CHECK(rc == -1, "empty text is refused (%s)", err.msg);

    char dir[] = "/tmp/ds41-test-model-config-XXXXXX";
    char path[256];
    if (mkdtemp(dir)) {
        rc = ds41_model_config_load(dir, &c, &err);
        TAP_CHECK(rc == -1 && has(err.msg, dir) && has(err.msg, "/inference/config.json: cannot open"),
                  "load: a missing inference/config.json is named (%s)", err.msg);
        snprintf(path, sizeof path, "%s/inference", dir);
        mkdir(path, 0700);
        snprintf(path, sizeof path, "%s/inference/config.json", dir);
        FILE *f = fopen(path, "wb");
        fwrite(released_text, 1, released_len, f);
        fclose(f);
        rc = ds41_model_config_load(dir, &c, &err);
        TAP_CHECK(rc == 0 && c.n_roles == 43 && strcmp(c.label, path) == 0, "load: reads DIR/inference/config.json (%s)",
                  rc ? err.msg : "ok");
        ds41_model_config_free(&c);
        f = fopen(path, "wb");
        fputs("{\"dim\": 5120,", f);
        fclose(f);
        rc = ds41_model_config_load(dir, &c, &err);
        TAP_CHECK(rc == -1 && has(err.msg, path) && has(err.msg, "invalid JSON"),
                  "load: errors carry the file path (%s)", err.msg);
        unlink(path);
        snprintf(path, sizeof path, "%s/inference", dir);
        rmdir(path);
        rmdir(dir);
    } else {
        TAP_SKIP("mkdtemp failed");
    }

    /* init + set every required key + finalize builds a config from scratch */
    ds41_model_config_init(&c);
    static const char *const kv[] = {
        "vocab_size", "1000", "dim", "64", "moe_inter_dim", "32", "n_layers", "3", "n_mtp_layers", "0",
        "n_heads", "2", "n_routed_experts", "4", "n_activated_experts", "2", "q_lora_rank", "32",
        "head_dim", "32", "rope_head_dim", "8", "o_groups", "1", "o_lora_rank", "32", "window_size", "4",
        "compress_ratios", "[0, 1, 1]", "kv_source_layers", "[1]", "index_source_layers", "[1]",
        "index_n_heads", "2", "index_head_dim", "32", "index_topk", "2", NULL};
    rc = set_all(&c, kv, &err);
    TAP_CHECK(rc == 0 && c.n_roles == 3 && c.roles[2].kv_from == 1,
              "init + set + finalize builds a config from scratch (%s)", rc ? err.msg : "ok");
    ds41_model_config_free(&c);
    ds41_model_config_init(&c);
    rc = ds41_model_config_finalize(&c, &err);
    TAP_CHECK(rc == -1 && has(err.msg, "inference/config.json: key 'vocab_size': required key is missing"),
              "finalize of a bare init names the first missing key (%s)", err.msg);
    ds41_model_config_free(&c);
    ds41_model_config_free(NULL);
}

int main(void) {
    released_text = slurp(RELEASED, &released_len);
    TAP_CHECK(released_text != NULL, "test data %s is readable", RELEASED);
    if (!released_text) return tap_done();
    test_released();
    test_set();
    test_errors();
    test_defaults();
    test_tiny();
    test_misc();
    free(released_text);
    return tap_done();
}
