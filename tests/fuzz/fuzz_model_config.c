/* Fuzz target: ds41_model_config_parse over arbitrary bytes.
 *
 * Oracles beyond "no crash, no leak, no UB": a config that parses must
 * write back (write_json) to text that parses to an equal config, and its
 * derived figures must be self-consistent.  The same bytes are also fed to
 * ds41_model_config_set as a value for a few keys of different types. */
#include "config/model_config.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_round_trip(const ds41_model_config *cfg) {
    char *out = NULL;
    size_t out_len = 0;
    FILE *f = open_memstream(&out, &out_len);
    if (!f) return;
    ds41_error err;
    int rc = ds41_model_config_write_json(cfg, f, &err);
    fclose(f);
    if (rc != 0) {
        free(out);
        return;
    }
    ds41_model_config back;
    if (ds41_model_config_parse(out, out_len, "written", &back, &err) != 0) {
        fprintf(stderr, "written config does not parse: %s\n%s\n", err.msg, out);
        abort();
    }
    if (!ds41_model_config_equal(cfg, &back)) {
        fprintf(stderr, "written config parses to a different config:\n%s\n", out);
        abort();
    }
    ds41_model_config_free(&back);
    free(out);
}

static void check_derived(const ds41_model_config *cfg) {
    if (!cfg->finalized || cfg->n_roles != (size_t)(cfg->n_layers + cfg->n_mtp_layers)) abort();
    char kind[96];
    for (size_t l = 0; l < cfg->n_roles; l++) {
        const ds41_layer_role *r = &cfg->roles[l];
        ds41_layer_role_kind(r, kind, sizeof kind);
        /* a compressed layer always has a same-ratio kv source and an index source at or below it */
        if (r->ratio > 0) {
            if (r->kv_from < 0 || (size_t)r->kv_from > l || cfg->roles[r->kv_from].ratio != r->ratio) abort();
            if (r->index_from < 0 || (size_t)r->index_from > l || cfg->roles[r->index_from].kv_from != r->kv_from)
                abort();
        }
    }
    uint64_t latent, ikey;
    uint64_t total = ds41_model_config_cache_bytes_per_token(cfg, &latent, &ikey);
    ds41_cache_rate rate = ds41_model_config_cache_rate(cfg);
    if (rate.per_tokens == 0 || rate.total_bytes != rate.latent_bytes + rate.index_key_bytes) abort();
    if (rate.per_tokens == 1 && (total != rate.total_bytes || latent + ikey != total)) abort();
    uint64_t n = rate.per_tokens * 1000;
    if (ds41_model_config_cache_bytes_for_tokens(cfg, n, NULL, NULL) != rate.total_bytes * 1000) abort();
    ds41_session_bytes sb;
    ds41_model_config_session_bytes(cfg, &sb);
    if (sb.total_bytes != sb.window_ring_bytes + sb.compressor_carry_bytes + sb.engram_history_bytes) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds41_model_config cfg;
    ds41_error err;
    if (ds41_model_config_parse((const char *)data, size, "fuzz.json", &cfg, &err) == 0) {
        check_derived(&cfg);
        check_round_trip(&cfg);
    }
    ds41_model_config_free(&cfg);

    /* the same bytes as a --set value */
    static const char *const keys[] = {"compress_ratios", "vision_max_wh_ratio", "score_func",
                                       "norm_topk_prob",  "dim",                 "route_scale"};
    char *value = malloc(size + 1);
    if (!value) return 0;
    memcpy(value, data, size);
    value[size] = 0;
    ds41_model_config_init(&cfg);
    const char *key = keys[size % (sizeof keys / sizeof keys[0])];
    if (ds41_model_config_set(&cfg, key, value, &err) == 0) ds41_model_config_finalize(&cfg, &err);
    ds41_model_config_free(&cfg);
    free(value);
    return 0;
}
