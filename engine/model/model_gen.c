#include "engine/model/model_gen.h"

#include "engine/model/engram_layout.h"
#include "engine/model/engram_tokens.h"
#include "engine/model/quant.h"
#include "engine/text/synth_tokenizer.h"
#include "engine/model/tensor_plan.h"
#include "engine/text/vocab.h"
#include "storage/safetensors.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Presets.  Each is a list of config keys as JSON values; derived keys
 * (vocab_size of a given tokenizer, special ids, engram sizes) are filled in
 * from the tokenizer later.  vocab_size here is the size of the synthetic
 * tokenizer; engram_compressed_vocab_size and engram_num_embeddings here are
 * placeholders overwritten before the config is finalized. */

typedef struct preset_kv {
    const char *key;
    const char *json;
} preset_kv;

/* Shared by tiny and long: 10 layers covering every role.
 *   0,1      window only (engram before 1)
 *   2        ratio-2 kv+index source; 3,4 its consumers
 *   5        ratio-1 kv+index+candidate source (engram before 5); 6 consumer
 *   7        ratio-1 index source, candidate user; 8,9 use 7's indices
 *   10..12   DSpark stages tapping 7,8,9 */
#define SMALL_COMMON                                                                                  \
    {"dim", "128"}, {"moe_inter_dim", "64"}, {"n_layers", "10"}, {"n_mtp_layers", "3"},                \
        {"dspark_block_size", "5"}, {"dspark_noise_token_id", "3"}, {"dspark_target_layer_ids", "[7, 8, 9]"}, \
        {"dspark_markov_rank", "32"}, {"dspark_n_routed_experts", "4"}, {"dspark_n_activated_experts", "2"}, \
        {"n_heads", "4"}, {"n_routed_experts", "8"}, {"n_shared_experts", "1"}, {"n_activated_experts", "2"}, \
        {"score_func", "\"sqrtsoftplus\""}, {"route_scale", "1.5"}, {"swiglu_limit", "10.0"},          \
        {"q_lora_rank", "64"}, {"head_dim", "64"}, {"rope_head_dim", "16"}, {"norm_eps", "1e-20"},     \
        {"o_groups", "2"}, {"o_lora_rank", "32"}, {"kv_source_layers", "[2, 5]"},                      \
        {"index_source_layers", "[2, 5, 7]"}, {"original_seq_len", "65536"}, {"rope_theta", "10000"},  \
        {"rope_factor", "16"}, {"beta_fast", "32"}, {"beta_slow", "1"}, {"index_n_heads", "4"},        \
        {"index_head_dim", "64"}, {"candidate_source_layer", "5"}, {"hc_mult", "4"},                   \
        {"hc_sinkhorn_iters", "20"}, {"hc_eps", "1e-06"}, {"engram_layer_ids", "[1, 5]"},               \
        {"engram_vocab_size", "2000"}, {"engram_num_embeddings", "[12000, 12000]"},                    \
        {"engram_max_ngram_size", "4"}, {"engram_pad_id", "2"}, {"engram_compressed_vocab_size", "1"},   \
        {"dtype", "\"fp8\""}, {"expert_dtype", "\"fp4\""}, {"compress_rope_theta", "160000"},           \
        {"compress_ratios", "[0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0]"}, {"vision_n_layers", "0"},       \
        {"engram_n_heads", "2"}, {"engram_head_dim", "32"}, {"vocab_size", "1024"}

static const preset_kv preset_tiny[] = {
    SMALL_COMMON,
    {"window_size", "8"},
    {"index_topk", "8"},
    {"candidate_topk_blocks", "5"},
    {"candidate_block_size", "2"},
    {NULL, NULL},
};

/* window_size + index_topk > 64: attention lists span several 64-chunks. */
static const preset_kv preset_long[] = {
    SMALL_COMMON,
    {"window_size", "32"},
    {"index_topk", "48"},
    {"candidate_topk_blocks", "16"},
    {"candidate_block_size", "4"},
    {NULL, NULL},
};

/* Release proportions scaled down to 2-4 GB: the real vocabulary size,
 * head_dim 512, window 128, 64 experts top-6 + 1 shared, 8 layers. */
static const preset_kv preset_bench[] = {
    {"vocab_size", "129280"},
    {"dim", "2048"},
    {"moe_inter_dim", "512"},
    {"n_layers", "8"},
    {"n_mtp_layers", "1"},
    {"dspark_block_size", "5"},
    {"dspark_noise_token_id", "3"},
    {"dspark_target_layer_ids", "[7]"},
    {"dspark_markov_rank", "256"},
    {"dspark_n_routed_experts", "16"},
    {"dspark_n_activated_experts", "3"},
    {"n_heads", "16"},
    {"n_routed_experts", "64"},
    {"n_shared_experts", "1"},
    {"n_activated_experts", "6"},
    {"score_func", "\"sqrtsoftplus\""},
    {"route_scale", "1.5"},
    {"swiglu_limit", "10.0"},
    {"q_lora_rank", "512"},
    {"head_dim", "512"},
    {"rope_head_dim", "64"},
    {"norm_eps", "1e-20"},
    {"o_groups", "4"},
    {"o_lora_rank", "512"},
    {"window_size", "128"},
    {"kv_source_layers", "[2, 4]"},
    {"index_source_layers", "[2, 4, 6]"},
    {"original_seq_len", "65536"},
    {"rope_theta", "10000"},
    {"rope_factor", "16"},
    {"beta_fast", "32"},
    {"beta_slow", "1"},
    {"index_n_heads", "16"},
    {"index_head_dim", "128"},
    {"index_topk", "128"},
    {"candidate_source_layer", "4"},
    {"candidate_topk_blocks", "64"},
    {"candidate_block_size", "8"},
    {"hc_mult", "4"},
    {"hc_sinkhorn_iters", "20"},
    {"hc_eps", "1e-06"},
    {"engram_layer_ids", "[1, 4]"},
    {"engram_vocab_size", "60000"},
    {"engram_num_embeddings", "[1440000, 1440000]"},
    {"engram_max_ngram_size", "4"},
    {"engram_pad_id", "2"},
    {"engram_compressed_vocab_size", "1"},
    {"dtype", "\"fp8\""},
    {"expert_dtype", "\"fp4\""},
    {"compress_rope_theta", "160000"},
    {"compress_ratios", "[0, 0, 2, 2, 1, 1, 1, 1, 0]"},
    {"vision_n_layers", "0"},
    {"engram_n_heads", "8"},
    {"engram_head_dim", "256"},
    {NULL, NULL},
};

/* The released layer dimensions (REFERENCE §0.1: dim 5120, 64 heads x 512,
 * q_lora 1280, o 8 x 1024, 384 experts of 2304 top-6 + 1 shared, window 128,
 * index 32 x 128 top-512, candidate blocks 2048 x 8, the release's rope,
 * YaRN, routing and hc values) in four layers, one per attention role the
 * release repeats, so kernels and benches run at the real shapes:
 *   0  ratio 2, KV + index source         (release layers 2, 8, 14)
 *   1  ratio 1, KV + index + candidate source (release layer 20)
 *   2  ratio 1, index source, candidate user  (release 24, 28, 32, 36)
 *   3  ratio 1, consumer of 1's KV and 2's indices (25-27, 29-31, ...: most
 *      of the release's layers)
 * The window-only layers 0 and 1 of the release are left out: their
 * attention is the window part every layer above has.  Engram runs before
 * blocks 1 and 3 with its tables scaled down: engram_vocab_size 60000 instead
 * of 16,000,000 (about 1.4 M rows and 380 MB per table instead of 384 M rows
 * and ~100 GB; the rows a token reads and their width are the release's).
 * DSpark is off (n_mtp_layers 0; --set can turn it on).  A layer's routed
 * experts are 7.2 GB of FP4: the checkpoint is about 33 GB. */
static const preset_kv preset_release_slice[] = {
    {"vocab_size", "129280"},
    {"dim", "5120"},
    {"moe_inter_dim", "2304"},
    {"n_layers", "4"},
    {"n_mtp_layers", "0"},
    {"dspark_block_size", "0"},
    {"n_heads", "64"},
    {"head_dim", "512"},
    {"rope_head_dim", "64"},
    {"q_lora_rank", "1280"},
    {"o_groups", "8"},
    {"o_lora_rank", "1024"},
    {"n_routed_experts", "384"},
    {"n_activated_experts", "6"},
    {"n_shared_experts", "1"},
    {"score_func", "\"sqrtsoftplus\""},
    {"route_scale", "1.5"},
    {"swiglu_limit", "10.0"},
    {"norm_eps", "1e-20"},
    {"window_size", "128"},
    {"kv_source_layers", "[0, 1]"},
    {"index_source_layers", "[0, 1, 2]"},
    {"candidate_source_layer", "1"},
    {"candidate_topk_blocks", "2048"},
    {"candidate_block_size", "8"},
    {"index_n_heads", "32"},
    {"index_head_dim", "128"},
    {"index_topk", "512"},
    {"rope_theta", "10000"},
    {"compress_rope_theta", "160000"},
    {"original_seq_len", "65536"},
    {"rope_factor", "16"},
    {"beta_fast", "32"},
    {"beta_slow", "1"},
    {"hc_mult", "4"},
    {"hc_sinkhorn_iters", "20"},
    {"hc_eps", "1e-06"},
    {"engram_layer_ids", "[1, 3]"},
    {"engram_vocab_size", "60000"},
    {"engram_num_embeddings", "[1440000, 1440000]"},
    {"engram_max_ngram_size", "4"},
    {"engram_n_heads", "8"},
    {"engram_head_dim", "256"},
    {"engram_pad_id", "2"},
    {"engram_compressed_vocab_size", "1"},
    {"dtype", "\"fp8\""},
    {"expert_dtype", "\"fp4\""},
    {"compress_ratios", "[2, 1, 1, 1]"},
    {"vision_n_layers", "0"},
    {NULL, NULL},
};

const char *const ds41_model_presets[] = {"tiny", "long", "bench", "release-slice", NULL};

static const preset_kv *find_preset(const char *name) {
    if (!name || strcmp(name, "tiny") == 0) return preset_tiny;
    if (strcmp(name, "long") == 0) return preset_long;
    if (strcmp(name, "bench") == 0) return preset_bench;
    if (strcmp(name, "release-slice") == 0) return preset_release_slice;
    return NULL;
}

static int set_key(ds41_model_config *cfg, const char *key, const char *json, ds41_error *err) {
    return ds41_model_config_set(cfg, key, json, err);
}

static int set_int(ds41_model_config *cfg, const char *key, int64_t v, ds41_error *err) {
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    return set_key(cfg, key, buf, err);
}

int ds41_model_gen_preset_config(const char *preset, const char *const *sets, size_t n_sets,
                                 ds41_model_config *cfg, ds41_error *err) {
    const preset_kv *p = find_preset(preset);
    if (!p) return ds41_fail(err, "unknown preset '%s' (tiny, long, bench, release-slice)", preset);
    ds41_model_config_init(cfg);
    for (; p->key; p++) {
        if (set_key(cfg, p->key, p->json, err) != 0) {
            ds41_model_config_free(cfg);
            return ds41_error_prefix(err, "preset %s", preset ? preset : "tiny");
        }
    }
    for (size_t i = 0; i < n_sets; i++) {
        const char *eq = strchr(sets[i], '=');
        if (!eq || eq == sets[i]) {
            ds41_model_config_free(cfg);
            return ds41_fail(err, "--set '%s': expected key=value", sets[i]);
        }
        char key[128];
        size_t klen = (size_t)(eq - sets[i]);
        if (klen >= sizeof key) {
            ds41_model_config_free(cfg);
            return ds41_fail(err, "--set '%s': key too long", sets[i]);
        }
        memcpy(key, sets[i], klen);
        key[klen] = 0;
        if (set_key(cfg, key, eq + 1, err) != 0) {
            ds41_model_config_free(cfg);
            return ds41_error_prefix(err, "--set %s", key);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Deterministic random numbers: xoshiro256** seeded by splitmix64 of
 * (seed, FNV-1a of the tensor name), so a tensor's values do not depend on
 * which other tensors exist or in which order they are written. */

typedef struct rng {
    uint64_t s[4];
} rng;

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void rng_seed(rng *r, uint64_t seed, const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *c = name; *c; c++) h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
    uint64_t x = seed ^ h;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

static inline uint64_t rng_next(rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* Uniform in [-1, 1) with 24 random bits. */
static inline float rng_sym(rng *r) {
    return (float)(rng_next(r) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* A sample with standard deviation `std` (uniform: cheap, bounded, enough
 * for weights whose only job is to keep activations O(1)). */
static inline float rng_std(rng *r, float std) {
    return rng_sym(r) * (std * 1.7320508f);
}

/* A per-block magnitude factor 2^v, v in {-1, 0, 1}: makes the power-of-two
 * scales differ across blocks. */
static inline float block_factor(rng *r) {
    static const float f[3] = {0.5f, 1.0f, 2.0f};
    return f[rng_next(r) % 3];
}

/* ------------------------------------------------------------------------ */
/* What values a tensor gets, from its name. */

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* Standard deviation of a tensor's entries; k = logical fan-in (0 for 1-D). */
static float value_std(const char *name, int64_t k, bool *offset_one) {
    *offset_one = false;
    if (ends_with(name, "norm.weight") || ends_with(name, "norm1.weight") || ends_with(name, "norm2.weight")) {
        *offset_one = true; /* 1 + noise: a norm gain */
        return 0.1f;
    }
    if (strcmp(name, "embed.weight") == 0 || ends_with(name, "markov_head.embed.weight")) return 1.0f;
    if (ends_with(name, "attn_sink")) return 1.0f;
    if (strstr(name, "hc_") && ends_with(name, "_base")) return 0.5f;
    if (strstr(name, "hc_") && ends_with(name, "_scale")) {
        *offset_one = true;
        return 0.1f;
    }
    if (ends_with(name, "gate.bias") || ends_with(name, "gate.bias_vl")) return 0.1f;
    if (ends_with(name, "engram.q_weight") || ends_with(name, "engram.k_weight")) return 1.0f;
    if (ends_with(name, ".bias")) return 0.02f;
    if (strncmp(name, "image_", 6) == 0) return 1.0f;
    if (k <= 0) return 0.1f;
    float std = 1.0f / sqrtf((float)k);
    if (strstr(name, "hc_") && ends_with(name, "_fn")) return 0.5f * std;
    /* Branch outputs feeding the residual stream: half gain keeps the stream
     * from growing layer over layer. */
    if (strstr(name, "wo_b") || strstr(name, ".w2.")) return 0.5f * std;
    return std;
}

typedef struct gen_ctx {
    uint64_t seed;
    ds41_st_writer *w;
    ds41_error *err;
} gen_ctx;

static int write_bytes(gen_ctx *g, const char *name, const void *data, size_t n) {
    return ds41_checkpoint_writer_write(g->w, name, data, n, g->err);
}

/* BF16 / F32 tensors. */
static int gen_plain(gen_ctx *g, const ds41_planned_tensor *t) {
    uint64_t elems = t->nbytes / ds41_dtype_size(t->dtype);
    int64_t k = t->ndim == 2 ? t->shape[1] : 0;
    bool one;
    float std = value_std(t->name, k, &one);
    rng r;
    rng_seed(&r, g->seed, t->name);
    void *buf = malloc(t->nbytes ? t->nbytes : 1);
    if (!buf) return ds41_fail(g->err, "tensor '%s': out of memory (%llu bytes)", t->name,
                               (unsigned long long)t->nbytes);
    for (uint64_t i = 0; i < elems; i++) {
        float v = rng_std(&r, std) + (one ? 1.0f : 0.0f);
        if (t->dtype == DS41_BF16)
            ((uint16_t *)buf)[i] = ds41_bf16_bits(v);
        else
            ((float *)buf)[i] = v;
    }
    int rc = write_bytes(g, t->name, buf, t->nbytes);
    free(buf);
    return rc;
}

/* An FP8 linear: weight [N,K] e4m3 + scale [ceil(N/32), ceil(K/32)]. */
static int gen_fp8_linear(gen_ctx *g, const ds41_planned_tensor *wt, const ds41_planned_tensor *st) {
    size_t N = (size_t)wt->shape[0], K = (size_t)wt->shape[1];
    bool one;
    float std = value_std(wt->name, (int64_t)K, &one);
    rng r;
    rng_seed(&r, g->seed, wt->name);
    size_t nbr = (N + 31) / 32, nbc = (K + 31) / 32;
    float *fac = malloc(nbr * nbc * sizeof *fac);
    float *w = malloc(N * K * sizeof *w);
    uint8_t *q = malloc(N * K);
    uint8_t *s = malloc(st->nbytes);
    int rc = -1;
    if (!fac || !w || !q || !s) {
        ds41_fail(g->err, "tensor '%s': out of memory", wt->name);
        goto out;
    }
    for (size_t b = 0; b < nbr * nbc; b++) fac[b] = block_factor(&r);
    for (size_t n = 0; n < N; n++)
        for (size_t k = 0; k < K; k++) w[n * K + k] = rng_std(&r, std) * fac[(n / 32) * nbc + k / 32];
    ds41_quant_fp8_weight(w, N, K, q, s);
    rc = write_bytes(g, wt->name, q, N * K);
    if (rc == 0) rc = write_bytes(g, st->name, s, st->nbytes);
out:
    free(fac);
    free(w);
    free(q);
    free(s);
    return rc;
}

/* An FP4 routed-expert linear: weight [N,K/2] packed e2m1 + scale [N,K/32]. */
static int gen_fp4_linear(gen_ctx *g, const ds41_planned_tensor *wt, const ds41_planned_tensor *st) {
    size_t N = (size_t)wt->shape[0], K = (size_t)wt->shape[1] * 2;
    bool one;
    float std = value_std(wt->name, (int64_t)K, &one);
    rng r;
    rng_seed(&r, g->seed, wt->name);
    float *w = malloc(N * K * sizeof *w);
    uint8_t *q = malloc(N * K / 2);
    uint8_t *s = malloc(N * K / 32);
    int rc = -1;
    if (!w || !q || !s) {
        ds41_fail(g->err, "tensor '%s': out of memory", wt->name);
        goto out;
    }
    for (size_t i = 0; i < N * K; i += 32) {
        float f = block_factor(&r);
        for (size_t j = 0; j < 32; j++) w[i + j] = rng_std(&r, std) * f;
    }
    ds41_quant_fp4_weight(w, N, K, q, s);
    rc = write_bytes(g, wt->name, q, N * K / 2);
    if (rc == 0) rc = write_bytes(g, st->name, s, N * K / 32);
out:
    free(w);
    free(q);
    free(s);
    return rc;
}

/* An Engram table: rows [rows, d] e4m3 with one ue8m0 scale per 32 columns
 * per row, quantized like activations (1x32).  Generated in row chunks so a
 * table of millions of rows never exists as fp32. */
static int gen_engram_table(gen_ctx *g, const ds41_planned_tensor *wt, const ds41_planned_tensor *st) {
    size_t rows = (size_t)wt->shape[0], d = (size_t)wt->shape[1];
    rng r;
    rng_seed(&r, g->seed, wt->name);
    uint8_t *q = malloc(rows * d);
    uint8_t *s = malloc(rows * (d / 32));
    const size_t chunk = 4096;
    float *w = malloc(chunk * d * sizeof *w);
    int rc = -1;
    if (!q || !s || !w) {
        ds41_fail(g->err, "tensor '%s': out of memory (%zu rows)", wt->name, rows);
        goto out;
    }
    for (size_t r0 = 0; r0 < rows; r0 += chunk) {
        size_t nr = rows - r0 < chunk ? rows - r0 : chunk;
        for (size_t i = 0; i < nr * d; i += 32) {
            float f = block_factor(&r);
            for (size_t j = 0; j < 32; j++) w[i + j] = ds41_bf16_round(rng_std(&r, 1.0f) * f);
        }
        ds41_act_quant(w, nr * d, q + r0 * d, s + r0 * (d / 32));
    }
    rc = write_bytes(g, wt->name, q, rows * d);
    if (rc == 0) rc = write_bytes(g, st->name, s, rows * (d / 32));
out:
    free(q);
    free(s);
    free(w);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Files around the weights. */

static int mkdir_p(const char *path, ds41_error *err) {
    char buf[4096];
    if (strlen(path) >= sizeof buf) return ds41_fail(err, "%s: path too long", path);
    strcpy(buf, path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return ds41_fail(err, "%s: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return ds41_fail(err, "%s: %s", buf, strerror(errno));
    return 0;
}

static bool file_exists(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return access(path, F_OK) == 0;
}

static int copy_file(const char *from, const char *to, ds41_error *err) {
    FILE *in = fopen(from, "rb");
    if (!in) return ds41_fail(err, "%s: %s", from, strerror(errno));
    FILE *out = fopen(to, "wb");
    if (!out) {
        fclose(in);
        return ds41_fail(err, "%s: %s", to, strerror(errno));
    }
    char buf[65536];
    size_t n;
    int rc = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) {
            rc = ds41_fail(err, "%s: write failed", to);
            break;
        }
    if (ferror(in)) rc = ds41_fail(err, "%s: read failed", from);
    fclose(in);
    if (fclose(out) != 0 && rc == 0) rc = ds41_fail(err, "%s: write failed", to);
    return rc;
}

static int write_root_config(const char *dir, const ds41_model_config *cfg, const ds41_vocab *v,
                             const char *preset, uint64_t seed, ds41_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return ds41_fail(err, "%s: %s", path, strerror(errno));
    fprintf(f,
            "{\n"
            "  \"architectures\": [\"DeepseekV4ForCausalLM\"],\n"
            "  \"model_type\": \"deepseek_v4\",\n"
            "  \"bos_token_id\": %d,\n"
            "  \"eos_token_id\": %d,\n"
            "  \"vocab_size\": %lld,\n"
            "  \"hidden_size\": %lld,\n"
            "  \"num_hidden_layers\": %lld,\n"
            "  \"num_attention_heads\": %lld,\n"
            "  \"torch_dtype\": \"bfloat16\",\n"
            "  \"quantization_config\": {\n"
            "    \"quant_method\": \"fp8\",\n"
            "    \"activation_scheme\": \"dynamic\",\n"
            "    \"fmt\": \"e4m3\",\n"
            "    \"scale_fmt\": \"ue8m0\",\n"
            "    \"weight_block_size\": [32, 32]\n"
            "  },\n"
            "  \"ds41_generated\": {\"tool\": \"ds41-mkmodel\", \"preset\": \"%s\", \"seed\": %llu,"
            " \"note\": \"random weights; inference/config.json is authoritative\"}\n"
            "}\n",
            (int)ds41_vocab_bos_id(v), (int)ds41_vocab_eos_id(v), (long long)cfg->vocab_size,
            (long long)cfg->dim, (long long)cfg->n_layers, (long long)cfg->n_heads, preset,
            (unsigned long long)seed);
    if (fclose(f) != 0) return ds41_fail(err, "%s: write failed", path);
    return 0;
}

static int write_inference_config(const char *dir, const ds41_model_config *cfg, ds41_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/inference", dir);
    if (mkdir_p(path, err) != 0) return -1;
    snprintf(path, sizeof path, "%s/inference/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return ds41_fail(err, "%s: %s", path, strerror(errno));
    int rc = ds41_model_config_write_json(cfg, f, err);
    if (fclose(f) != 0 && rc == 0) rc = ds41_fail(err, "%s: write failed", path);
    return rc;
}

/* Fill in the keys that follow from the tokenizer (see the header). */
static int derive_from_tokenizer(ds41_model_config *cfg, const ds41_vocab *v, const char *tok_path,
                                 ds41_error *err) {
    if (set_int(cfg, "vocab_size", ds41_vocab_size(v), err) != 0) return -1;
    if (cfg->dspark_block_size > 0) {
        static const char noise[] = "<｜System｜>";
        int32_t id = ds41_vocab_find(v, noise, sizeof noise - 1);
        if (id < 0) return ds41_fail(err, "%s: no token '%s' for dspark_noise_token_id", tok_path, noise);
        if (set_int(cfg, "dspark_noise_token_id", id, err) != 0) return -1;
    }
    if (cfg->vision_n_layers > 0) {
        static const char image[] = "<｜deepseek_image｜>";
        int32_t id = ds41_vocab_find(v, image, sizeof image - 1);
        if (id < 0) return ds41_fail(err, "%s: no token '%s' for image_token_id", tok_path, image);
        if (set_int(cfg, "image_token_id", id, err) != 0) return -1;
    }
    if (cfg->engram_layer_ids.n == 0) return 0;

    int32_t *map = NULL;
    uint32_t n_ids = 0, n_comp = 0;
    if (ds41_engram_token_map_from_vocab(v, &map, &n_ids, &n_comp, err) != 0)
        return ds41_error_prefix(err, "%s", tok_path);
    free(map);
    if (set_int(cfg, "engram_compressed_vocab_size", n_comp, err) != 0) return -1;

    int ids[DS41_ENGRAM_MAX_LAYERS];
    if (cfg->engram_layer_ids.n > DS41_ENGRAM_MAX_LAYERS)
        return ds41_fail(err, "engram_layer_ids: at most %d engram layers", DS41_ENGRAM_MAX_LAYERS);
    for (size_t i = 0; i < cfg->engram_layer_ids.n; i++) ids[i] = (int)cfg->engram_layer_ids.v[i];
    ds41_engram_layout layout;
    if (ds41_engram_layout_compute(ids, (int)cfg->engram_layer_ids.n, (int)cfg->engram_max_ngram_size,
                                   (int)cfg->engram_n_heads, cfg->engram_vocab_size, n_comp, &layout, err) != 0)
        return -1;
    char list[512];
    size_t off = 0;
    off += (size_t)snprintf(list + off, sizeof list - off, "[");
    for (int i = 0; i < layout.n_layers; i++)
        off += (size_t)snprintf(list + off, sizeof list - off, "%s%lld", i ? ", " : "",
                                (long long)layout.layers[i].rows);
    snprintf(list + off, sizeof list - off, "]");
    return set_key(cfg, "engram_num_embeddings", list, err);
}

static void progress(const ds41_model_gen_opts *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void progress(const ds41_model_gen_opts *o, const char *fmt, ...) {
    if (!o->progress) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    o->progress(o->progress_ctx, line);
}

static bool is_pair(const ds41_tensor_plan *plan, size_t i) {
    if (i + 1 >= plan->n) return false;
    const char *a = plan->t[i].name, *b = plan->t[i + 1].name;
    size_t la = strlen(a), lb = strlen(b);
    return ends_with(a, ".weight") && ends_with(b, ".scale") && la - 7 == lb - 6 && strncmp(a, b, la - 7) == 0;
}

int ds41_model_generate(const char *outdir, const ds41_model_gen_opts *opts, ds41_model_config *cfg_out,
                        ds41_error *err) {
    const char *preset = opts->preset ? opts->preset : "tiny";
    ds41_model_config cfg;
    ds41_vocab *v = NULL;
    ds41_tensor_plan plan = {0};
    ds41_st_writer *w = NULL;
    size_t *order = NULL;
    int rc = -1;
    char tok_path[4096];

    if (ds41_model_gen_preset_config(preset, opts->sets, opts->n_sets, &cfg, err) != 0) return -1;
    if (mkdir_p(outdir, err) != 0) goto out;
    if (file_exists(outdir, "model.safetensors.index.json") || file_exists(outdir, "model.safetensors")) {
        ds41_fail(err, "%s: already holds a checkpoint; choose an empty directory", outdir);
        goto out;
    }

    /* Tokenizer first: the vocabulary decides vocab_size and the Engram sizes. */
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", outdir);
    if (opts->tokenizer) {
        if (copy_file(opts->tokenizer, tok_path, err) != 0) goto out;
        char cfg_from[4096], cfg_to[4096];
        snprintf(cfg_from, sizeof cfg_from, "%s", opts->tokenizer);
        char *slash = strrchr(cfg_from, '/');
        snprintf(slash ? slash + 1 : cfg_from, sizeof cfg_from - (size_t)(slash ? slash + 1 - cfg_from : 0),
                 "tokenizer_config.json");
        snprintf(cfg_to, sizeof cfg_to, "%s/tokenizer_config.json", outdir);
        if (access(cfg_from, R_OK) == 0 && copy_file(cfg_from, cfg_to, err) != 0) goto out;
        progress(opts, "tokenizer: copied %s", opts->tokenizer);
    } else {
        if (cfg.vocab_size <= 0 || cfg.vocab_size > UINT32_MAX) {
            ds41_fail(err, "vocab_size %lld: cannot build a synthetic tokenizer of that size",
                      (long long)cfg.vocab_size);
            goto out;
        }
        if (ds41_synth_tokenizer_write(outdir, (uint32_t)cfg.vocab_size, opts->seed, err) != 0) goto out;
        progress(opts, "tokenizer: synthetic byte-level BPE, %lld ids", (long long)cfg.vocab_size);
    }
    v = ds41_vocab_load_dir(outdir, err);
    if (!v) goto out;
    if (derive_from_tokenizer(&cfg, v, tok_path, err) != 0) goto out;
    if (ds41_model_config_finalize(&cfg, err) != 0) goto out;
    if (write_inference_config(outdir, &cfg, err) != 0) goto out;
    if (write_root_config(outdir, &cfg, v, preset, opts->seed, err) != 0) goto out;

    if (ds41_tensor_plan_build(&cfg, &plan, err) != 0) goto out;
    uint64_t total = 0;
    for (size_t i = 0; i < plan.n; i++) total += plan.t[i].nbytes;

    /* Order: everything except the Engram tables, then each table in a shard
     * of its own, as the release keeps its two tables in the last shards. */
    order = malloc(plan.n * sizeof *order);
    if (!order) {
        ds41_fail(err, "out of memory");
        goto out;
    }
    size_t n_order = 0;
    uint64_t table_bytes = 0;
    for (size_t i = 0; i < plan.n; i++)
        if (plan.t[i].kind != DS41_KIND_ENGRAM_TABLES) order[n_order++] = i;
        else table_bytes += plan.t[i].nbytes;
    uint64_t shard = opts->shard_bytes;
    if (shard == 0) {
        uint64_t rest = total - table_bytes;
        shard = rest / 2 + 1; /* at least two shards before the tables */
        if (shard > (2ull << 30)) shard = 2ull << 30;
    }
    w = ds41_checkpoint_writer_new(outdir, shard, err);
    if (!w) goto out;
    for (size_t j = 0; j < n_order; j++) {
        const ds41_planned_tensor *t = &plan.t[order[j]];
        if (ds41_checkpoint_writer_declare(w, t->name, t->dtype, t->ndim, t->shape, err) != 0) goto out;
    }
    for (size_t i = 0; i < plan.n; i++) {
        if (plan.t[i].kind != DS41_KIND_ENGRAM_TABLES) continue;
        if (ends_with(plan.t[i].name, ".weight")) ds41_checkpoint_writer_break_shard(w);
        order[n_order++] = i;
        if (ds41_checkpoint_writer_declare(w, plan.t[i].name, plan.t[i].dtype, plan.t[i].ndim,
                                           plan.t[i].shape, err) != 0)
            goto out;
    }
    if (ds41_checkpoint_writer_begin(w, err) != 0) goto out;

    gen_ctx g = {.seed = opts->seed, .w = w, .err = err};
    for (size_t j = 0; j < n_order; j++) {
        const ds41_planned_tensor *t = &plan.t[order[j]];
        bool pair = j + 1 < n_order && order[j + 1] == order[j] + 1 && is_pair(&plan, order[j]);
        int r;
        if (pair && t->dtype == DS41_F8_E4M3 && t->kind == DS41_KIND_ENGRAM_TABLES)
            r = gen_engram_table(&g, t, &plan.t[order[j + 1]]);
        else if (pair && t->dtype == DS41_F8_E4M3)
            r = gen_fp8_linear(&g, t, &plan.t[order[j + 1]]);
        else if (pair && t->dtype == DS41_I8)
            r = gen_fp4_linear(&g, t, &plan.t[order[j + 1]]);
        else if (t->dtype == DS41_BF16 || t->dtype == DS41_F32)
            r = gen_plain(&g, t);
        else
            r = ds41_fail(err, "tensor '%s': no generator for dtype %s", t->name, ds41_dtype_name(t->dtype));
        if (r != 0) goto out;
        if (pair) j++;
        if ((j + 1) % 256 == 0 || j + 1 == n_order)
            progress(opts, "wrote %zu/%zu tensors", j + 1, n_order);
    }
    if (ds41_checkpoint_writer_finish(w, err) != 0) goto out;
    progress(opts, "%s: %zu tensors, %llu payload bytes", outdir, plan.n, (unsigned long long)total);
    rc = 0;
out:
    ds41_checkpoint_writer_free(w);
    free(order);
    ds41_tensor_plan_free(&plan);
    ds41_vocab_free(v);
    if (rc == 0 && cfg_out)
        *cfg_out = cfg;
    else
        ds41_model_config_free(&cfg);
    return rc;
}
