/* ds41_model_config: the model's `inference/config.json`, validated, with the
 * role of every layer derived from it.
 *
 * The file is the reference's `ModelArgs(**json)` (REFERENCE.md §0.1): field
 * names are the JSON keys.  ds41 reads every key the reference defines:
 *
 *  - shape keys (dimensions, counts, layer lists, compress_ratios, vocab) are
 *    REQUIRED: a missing one is an error (the reference has toy defaults for
 *    them, which would silently build a different model);
 *  - keys of an optional feature (engram_*, dspark_*, vision_*, image_token_id)
 *    are required only when that feature is on: engram when engram_layer_ids
 *    is non-empty, DSpark when dspark_block_size > 0, vision when
 *    vision_n_layers > 0;
 *  - behavioural keys take the reference's ModelArgs defaults when omitted
 *    (n_shared_experts 1, score_func sqrtsoftplus, route_scale 1.0,
 *    swiglu_limit 0, norm_eps 1e-20, compress_rope_theta 40000,
 *    original_seq_len 0, rope_theta 10000, rope_factor 40, beta_fast 32,
 *    beta_slow 1, candidate_source_layer -1, candidate_topk_blocks 0,
 *    candidate_block_size 0, hc_mult 4, hc_sinkhorn_iters 20, hc_eps 1e-6,
 *    engram_layer_ids [], engram_max_ngram_size 1, engram_pad_id 2,
 *    dspark_block_size 0, dspark_n_routed_experts 0, dspark_n_activated_experts
 *    0 (0 = the backbone's counts), vision_n_layers 0, vision_rope_theta 10000,
 *    vision_max_wh_ratio null, dtype "fp8", expert_dtype "fp4",
 *    max_batch_size 4, max_seq_len 4096, temperature 1, gate_temp 1.0,
 *    norm_topk_prob true).
 *
 * Unknown keys are accepted (forward compatibility) and their names recorded
 * in `unknown_keys` so the caller can warn.  A Hugging Face style config.json
 * (nested text_config, HF key names) is not read; the error says so.
 *
 * Every error names the file (the `label`) and the key, e.g.
 *   "inference/config.json: key 'compress_ratios': expected 43 entries
 *    (n_layers + n_mtp_layers), got 42".
 *
 * Layer roles (REFERENCE §0.1 table, §2.8-2.11, §9.1): layers are numbered
 * 0 .. n_layers-1 (backbone) then n_layers .. n_layers+n_mtp_layers-1 (DSpark
 * stages, checkpoint prefix mtp.k).  A layer with compress ratio 0 attends to
 * its sliding window only.  A layer with ratio r > 0 also attends to a
 * compressed KV cache, built by the nearest kv source at or below it (which
 * must have the same ratio), at `index_topk` positions chosen by the nearest
 * index source at or below it (which must read the same kv source).  An index
 * source scores the index keys of its own kv source (ds41's reading, §9.1).
 * The candidate source publishes a block mask that every index source above it
 * applies (those must read the candidate source's cache).
 *
 * Validation rules beyond types and ranges (each error names the key):
 *  - compress_ratios has n_layers + n_mtp_layers entries, each in
 *    0..DS41_MAX_COMPRESS_RATIO; DSpark/MTP entries are 0.
 *  - layer lists (kv_source_layers, index_source_layers, engram_layer_ids,
 *    dspark_target_layer_ids) are sorted, unique, and < n_layers.
 *  - kv and index sources have ratio > 0; every layer with ratio > 0 has a kv
 *    source of the same ratio and an index source at or below it as above;
 *    in effect every kv source is also an index source.
 *  - candidate_source_layer (when >= 0) is a kv source and an index source;
 *    candidate_block_size >= 1, candidate_topk_blocks >= 1 and
 *    1 + (candidate_topk_blocks - 1) * candidate_block_size >= index_topk
 *    (the pinned newest block may hold a single reachable position, the
 *    others are full: the fewest finite candidates a query can get must still
 *    fill index_topk, else -inf picks would be attended, REFERENCE §2.10.7).
 *  - K dimensions of FP8/FP4 linears are multiples of 32: dim, moe_inter_dim,
 *    q_lora_rank, o_lora_rank, head_dim, index_head_dim, engram_head_dim
 *    (so head_dim is also a multiple of 16, the FP4 1x16 latent group, and
 *    wo_a's K = n_heads * head_dim / o_groups and the engram wkv K =
 *    engram_n_heads * (engram_max_ngram_size - 1) * engram_head_dim are
 *    multiples of 32 too).  rope_head_dim is even, <= head_dim and
 *    <= index_head_dim.  n_heads % o_groups == 0.
 *  - n_activated_experts <= n_routed_experts (also for DSpark); n_shared_experts
 *    is 1 (the reference asserts it); dtype "fp8", expert_dtype "fp4",
 *    score_func "sqrtsoftplus" (anything else: "unsupported").
 *  - engram on: engram_num_embeddings has one entry per engram layer, each at
 *    least (engram_max_ngram_size - 1) * engram_n_heads * engram_vocab_size
 *    (the sum of that many distinct primes >= engram_vocab_size; the exact
 *    prime sums are checked by the engram module), engram_max_ngram_size >= 2,
 *    engram_compressed_vocab_size <= vocab_size, engram_pad_id < vocab_size.
 *  - DSpark on (dspark_block_size > 0): n_mtp_layers >= 1, at least one
 *    target layer, dspark_noise_token_id < vocab_size.  The number of target
 *    layers is NOT tied to n_mtp_layers: the target hiddens are concatenated
 *    into main_proj's input (K = dim * targets), and the reference's own
 *    self-test runs 2 targets with 1 stage.  With DSpark off the MTP layers
 *    are not built (role.present false), as in the reference.
 *  - vision on: the vision_* shapes >= 1, vision_dim % vision_n_heads == 0,
 *    0 <= image_token_id < vocab_size.
 *
 * Ownership: a ds41_model_config owns all of its lists, roles, label and
 * unknown key names; ds41_model_config_free() releases them. */
#ifndef DS41_CONFIG_MODEL_CONFIG_H
#define DS41_CONFIG_MODEL_CONFIG_H

#include "config/error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The largest compress ratio the engine implements: ratio 1 is a plain
 * projection (no gate), ratio 2 the gated softmax pool of token pairs
 * (REFERENCE §2.9).  The pool generalises to any r in the reference; raise
 * this when the engine's compressor and cache code are checked for r > 2. */
#define DS41_MAX_COMPRESS_RATIO 2

/* Number of keys ds41 knows (the size of ds41_model_config.key_present). */
#define DS41_MODEL_CONFIG_N_KEYS 69

/* An owned list of integers (layer ids, ratios, table sizes). */
typedef struct ds41_i64_list {
    int64_t *v;
    size_t n;
} ds41_i64_list;

typedef enum ds41_score_func {
    DS41_SCORE_SQRTSOFTPLUS = 0, /* sqrt(softplus(x)); the only one V4.1 uses */
} ds41_score_func;

typedef enum ds41_weight_dtype {
    DS41_WEIGHT_FP8 = 0, /* "fp8": e4m3 with ue8m0 32x32 block scales */
    DS41_WEIGHT_FP4 = 1, /* "fp4": packed e2m1 with ue8m0 1x32 scales */
} ds41_weight_dtype;

/* What one layer does, derived from the config by ds41_model_config_finalize. */
typedef struct ds41_layer_role {
    bool present;          /* false only for MTP layers while DSpark is off (not built) */
    int ratio;             /* compress ratio: 0 = sliding window only */
    bool kv_source;        /* owns a compressor, compressed KV cache and index keys */
    int kv_from;           /* layer whose compressed KV it reads (itself for a source); -1 if ratio 0 */
    bool index_source;     /* owns an indexer query side (wq_b, weights_proj) */
    int index_from;        /* index source whose top-k it uses (itself for a source); -1 if ratio 0 */
    int index_keys_from;   /* kv source whose index keys it scores (REFERENCE §9.1: its own kv
                              source); -1 unless index_source */
    bool candidate_source; /* computes and publishes the candidate block mask (its own scores unmasked) */
    bool candidate_user;   /* index source that masks its scores with the published candidates */
    int engram_slot;       /* index into engram_layer_ids (engram applied BEFORE this block) or -1 */
    int dspark_stage;      /* 0 .. n_mtp_layers-1 for a built DSpark stage, else -1 */
    bool dspark_tap;       /* this block's input (after engram) is tapped for DSpark */
    double rope_theta;     /* rope base for everything in the layer */
    bool yarn;             /* YaRN scaling (original_seq_len, rope_factor, beta_fast/slow) */
    int64_t n_experts;     /* routed experts of its MoE */
    int64_t n_active_experts;
    bool has_wgate;        /* kv source with ratio > 1: gated pooling compressor */
} ds41_layer_role;

typedef struct ds41_model_config {
    /* --- keys, in the released file's order --- */
    int64_t vocab_size;
    int64_t dim;
    int64_t moe_inter_dim;
    int64_t n_layers;
    int64_t n_mtp_layers;
    int64_t dspark_block_size;
    int64_t dspark_noise_token_id;
    ds41_i64_list dspark_target_layer_ids;
    int64_t dspark_markov_rank;
    int64_t dspark_n_routed_experts;    /* 0: same as n_routed_experts */
    int64_t dspark_n_activated_experts; /* 0: same as n_activated_experts */
    int64_t n_heads;
    int64_t n_routed_experts;
    int64_t n_shared_experts;
    int64_t n_activated_experts;
    ds41_score_func score_func;
    double route_scale;
    double swiglu_limit; /* 0: no clamp */
    int64_t q_lora_rank;
    int64_t head_dim;
    int64_t rope_head_dim;
    double norm_eps;
    int64_t o_groups;
    int64_t o_lora_rank;
    int64_t window_size;
    ds41_i64_list kv_source_layers;
    ds41_i64_list index_source_layers;
    int64_t original_seq_len; /* 0: no YaRN */
    double rope_theta;
    double rope_factor;
    int64_t beta_fast;
    int64_t beta_slow;
    int64_t index_n_heads;
    int64_t index_head_dim;
    int64_t index_topk;
    int64_t candidate_source_layer; /* -1: candidates off */
    int64_t candidate_topk_blocks;
    int64_t candidate_block_size;
    int64_t hc_mult;
    int64_t hc_sinkhorn_iters;
    double hc_eps;
    ds41_i64_list engram_layer_ids;
    int64_t engram_vocab_size;
    ds41_i64_list engram_num_embeddings; /* table rows per engram layer */
    int64_t engram_max_ngram_size;
    int64_t engram_pad_id;
    int64_t engram_compressed_vocab_size;
    ds41_weight_dtype dtype;
    ds41_weight_dtype expert_dtype;
    double compress_rope_theta;
    ds41_i64_list compress_ratios; /* n_layers + n_mtp_layers entries */
    int64_t vision_n_layers;       /* 0: vision off */
    int64_t vision_dim;
    int64_t vision_n_heads;
    int64_t vision_inter_dim;
    int64_t vision_patch_size;
    int64_t vision_downsample_ratio;
    int64_t vision_max_n_token;
    int64_t vision_min_pixels;
    bool vision_max_wh_ratio_set; /* false: JSON null, no limit */
    double vision_max_wh_ratio;
    int64_t image_token_id; /* -1 when vision is off and the key is absent */
    int64_t engram_n_heads;
    int64_t engram_head_dim;
    double vision_rope_theta;
    /* ModelArgs fields the released file leaves at their defaults */
    int64_t max_batch_size;
    int64_t max_seq_len;
    double temperature;
    double gate_temp;
    bool norm_topk_prob;

    /* --- bookkeeping --- */
    char *label;                  /* file name used in error messages (owned) */
    char **unknown_keys;          /* names of keys ds41 does not know (owned), for warnings */
    size_t n_unknown_keys;
    unsigned char key_present[DS41_MODEL_CONFIG_N_KEYS]; /* set by parse/set; required-key checks */

    /* --- derived by ds41_model_config_finalize (stale after a set) --- */
    bool finalized;
    bool engram_enabled;     /* engram_layer_ids non-empty */
    bool dspark_enabled;     /* dspark_block_size > 0 */
    bool vision_enabled;     /* vision_n_layers > 0 */
    bool candidates_enabled; /* candidate_source_layer >= 0 */
    ds41_layer_role *roles;  /* n_roles = n_layers + n_mtp_layers entries */
    size_t n_roles;
} ds41_model_config;

/* Exact compressed-cache growth: `latent_bytes + index_key_bytes` =
 * `total_bytes` bytes per `per_tokens` tokens (a reduced fraction). */
typedef struct ds41_cache_rate {
    uint64_t latent_bytes;
    uint64_t index_key_bytes;
    uint64_t total_bytes;
    uint64_t per_tokens;
} ds41_cache_rate;

/* Fixed per-session state (independent of context length). */
typedef struct ds41_session_bytes {
    uint64_t window_ring_bytes;      /* every built layer: window_size x (head_dim FP8 + head_dim/32 ue8m0) */
    uint64_t compressor_carry_bytes; /* every kv source with ratio > 1: kv + score state, ratio x head_dim fp32 each */
    uint64_t engram_history_bytes;   /* every engram layer: (max_ngram - 1) int32 compressed ids of look-back */
    uint64_t total_bytes;
} ds41_session_bytes;

/* Set every key to its ModelArgs default (shape keys 0 / empty), no key
 * marked present, no roles.  The result is not valid until the required keys
 * are set (ds41_model_config_set) and ds41_model_config_finalize succeeds.
 * Use ds41_model_config_free() afterwards. */
void ds41_model_config_init(ds41_model_config *cfg);

/* Parse `len` bytes of JSON text (need not be NUL-terminated), apply defaults,
 * validate and derive roles (ds41_model_config_finalize).  `label` names the
 * text in error messages (NULL: "inference/config.json").  cfg needs no prior
 * initialisation; on success it owns memory (ds41_model_config_free); on
 * failure it is left freed/empty (free is still safe) and err says why,
 * naming the label and the key (or line/column for malformed JSON). */
int ds41_model_config_parse(const char *text, size_t len, const char *label, ds41_model_config *cfg,
                            ds41_error *err);

/* Read and parse CKPT_DIR/inference/config.json (the label is that path).
 * Errors name the path (missing file, read error, files over 16 MiB). */
int ds41_model_config_load(const char *ckpt_dir, ds41_model_config *cfg, ds41_error *err);

/* Override one known key with a JSON value (e.g. "n_routed_experts", "256";
 * "kv_source_layers", "[2,4]"; "vision_max_wh_ratio", "null"), with the same
 * type and range checks as parsing.  cfg must come from ds41_model_config_init,
 * _parse or _load.  Marks the config not finalized (roles freed): call
 * ds41_model_config_finalize() after the last set.  Unknown keys are an error.
 * On error cfg is unchanged. */
int ds41_model_config_set(ds41_model_config *cfg, const char *key, const char *value_json,
                          ds41_error *err);

/* Check required keys and every consistency rule (see above), then derive the
 * feature flags and `roles`.  Errors name the label and the key.  On error the
 * config stays not finalized (roles NULL). */
int ds41_model_config_finalize(ds41_model_config *cfg, ds41_error *err);

/* Release everything cfg owns and leave it as after ds41_model_config_init
 * minus the defaults (all zero).  NULL is allowed. */
void ds41_model_config_free(ds41_model_config *cfg);

/* Write cfg as an inference/config.json: every known key (the released file's
 * keys in its order, then the ModelArgs fields it leaves out), 4-space indent,
 * lists inline, reals in the shortest form that reads back to the same double.
 * Parsing the output yields a config equal to cfg (ds41_model_config_equal).
 * Unknown keys are not written (their values are not kept).  Errors: write
 * failures (err names the label). */
int ds41_model_config_write_json(const ds41_model_config *cfg, FILE *f, ds41_error *err);

/* True when every key of a and b has the same value (lists element-wise, reals
 * bit-for-bit up to -0.0 == 0.0).  Ignores labels, unknown keys, presence marks
 * and derived fields. */
bool ds41_model_config_equal(const ds41_model_config *a, const ds41_model_config *b);

/* Exact compressed cache growth of a finalized cfg (REFERENCE §1.6, §2.9-2.10,
 * stored packed): per kv source with ratio r, one entry per r tokens of
 *   latent    = head_dim/2 (FP4 codes) + head_dim/16 (e4m3 scale per 16) bytes,
 *   index key = index_head_dim/2 (FP4) + index_head_dim/32 (ue8m0 per 32) bytes.
 * Summed over kv sources as a reduced fraction over `per_tokens` tokens. */
ds41_cache_rate ds41_model_config_cache_rate(const ds41_model_config *cfg);

/* The same as bytes per token.  Exact whenever the rate's per_tokens is 1
 * (always with ratios 1 and 2 unless index_head_dim / 32 is odd); otherwise
 * each figure is rounded UP to whole bytes (use ds41_model_config_cache_rate
 * or _cache_bytes_for_tokens for exact sizes).  latent_bytes and
 * index_key_bytes may be NULL.  Returns the total. */
uint64_t ds41_model_config_cache_bytes_per_token(const ds41_model_config *cfg, uint64_t *latent_bytes,
                                                 uint64_t *index_key_bytes);

/* Exact compressed cache bytes holding `n_tokens` tokens of context: per kv
 * source, floor(n_tokens / ratio) entries (REFERENCE §2.9 compress_len).
 * latent_bytes and index_key_bytes may be NULL.  Returns the total. */
uint64_t ds41_model_config_cache_bytes_for_tokens(const ds41_model_config *cfg, uint64_t n_tokens,
                                                  uint64_t *latent_bytes, uint64_t *index_key_bytes);

/* Fixed per-session state of a finalized cfg (see ds41_session_bytes). */
void ds41_model_config_session_bytes(const ds41_model_config *cfg, ds41_session_bytes *out);

/* A short description of a layer's attention role for tables, written into
 * buf (always NUL-terminated when buflen > 0) and returned: "window",
 * "dspark stage 0 (window)", "unused mtp layer", "kv+index source",
 * "kv+index+candidate source", "index source (keys of 20)",
 * "index source (keys of 20), candidate user", "consumer of 2",
 * "consumer of 20, indices of 24". */
const char *ds41_layer_role_kind(const ds41_layer_role *role, char *buf, size_t buflen);

/* Names for the enums, as written in the JSON. */
const char *ds41_score_func_name(ds41_score_func f);
const char *ds41_weight_dtype_name(ds41_weight_dtype d);

#endif
