/* inference/config.json: table-driven parsing, validation, layer roles.
 *
 * One table (`keys`) describes every key: JSON type, when it is required,
 * its default, its allowed range and where it lives in ds41_model_config.
 * Parsing, set(), writing and comparison all walk that table; finalize()
 * holds the rules that relate keys to each other.  Nothing here knows the
 * released model's numbers: roles and sizes come from the config alone. */
#include "config/model_config.h"
#include "config/json_util.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_LABEL "inference/config.json"
#define MAX_CONFIG_FILE_BYTES (16u << 20)
#define MAX_LIST_ENTRIES 8192
#define MAX_UNKNOWN_KEYS 4096

/* Generous bounds that keep every product computed from the config inside
 * int64_t (dimensions up to 2^20, layer counts up to 2^12, ...). */
#define LIM_DIM (INT64_C(1) << 20)
#define LIM_LAYERS (INT64_C(1) << 12)
#define LIM_COUNT (INT64_C(1) << 16)
#define LIM_BIG (INT64_C(1) << 40)
#define LIM_TOKEN_ID INT64_C(0x7fffffff)

enum key_type {
    KT_INT,
    KT_REAL,
    KT_NULLABLE_REAL,
    KT_BOOL,
    KT_LIST,
    KT_SCORE_FUNC,
    KT_WEIGHT_DTYPE, /* "fp8" only (dense weights) */
    KT_EXPERT_DTYPE, /* "fp4" only (routed experts) */
};

/* When a key must be present. */
enum key_need {
    NEED_SHAPE,  /* always */
    NEED_NONE,   /* has a default */
    NEED_ENGRAM, /* when engram_layer_ids is non-empty */
    NEED_DSPARK, /* when dspark_block_size > 0 */
    NEED_VISION, /* when vision_n_layers > 0 */
};

/* Allowed range of a real. */
enum real_range {
    RR_POSITIVE,   /* > 0 */
    RR_NONNEG,     /* >= 0 */
    RR_ABOVE_ONE,  /* > 1 (a logarithm base) */
};

typedef struct key_spec {
    const char *name;
    enum key_type type;
    enum key_need need;
    size_t offset;     /* of the value field */
    size_t set_offset; /* KT_NULLABLE_REAL: of the bool saying it is not null */
    int64_t min, max;  /* KT_INT value, KT_LIST elements */
    int64_t dflt_int;  /* KT_INT, KT_BOOL, enums */
    double dflt_real;  /* KT_REAL, KT_NULLABLE_REAL (NAN: null) */
    enum real_range range;
} key_spec;

#define OFF(f) offsetof(ds41_model_config, f)
#define K_INT(n, need, lo, hi, d) {#n, KT_INT, need, OFF(n), 0, lo, hi, d, 0, 0}
#define K_REAL(n, need, rr, d) {#n, KT_REAL, need, OFF(n), 0, 0, 0, 0, d, rr}
#define K_LIST(n, need, lo, hi) {#n, KT_LIST, need, OFF(n), 0, lo, hi, 0, 0, 0}

/* Order: the released file's, then the ModelArgs fields it leaves out.  The
 * writer emits keys in this order. */
static const key_spec keys[] = {
    K_INT(vocab_size, NEED_SHAPE, 1, LIM_TOKEN_ID, 0),
    K_INT(dim, NEED_SHAPE, 1, LIM_DIM, 0),
    K_INT(moe_inter_dim, NEED_SHAPE, 1, LIM_DIM, 0),
    K_INT(n_layers, NEED_SHAPE, 1, LIM_LAYERS, 0),
    K_INT(n_mtp_layers, NEED_SHAPE, 0, 256, 0),
    K_INT(dspark_block_size, NEED_NONE, 0, 4096, 0),
    K_INT(dspark_noise_token_id, NEED_DSPARK, 0, LIM_TOKEN_ID, 0),
    K_LIST(dspark_target_layer_ids, NEED_DSPARK, 0, LIM_LAYERS),
    K_INT(dspark_markov_rank, NEED_DSPARK, 0, LIM_DIM, 0),
    K_INT(dspark_n_routed_experts, NEED_NONE, 0, LIM_COUNT, 0),
    K_INT(dspark_n_activated_experts, NEED_NONE, 0, LIM_COUNT, 0),
    K_INT(n_heads, NEED_SHAPE, 1, LIM_LAYERS, 0),
    K_INT(n_routed_experts, NEED_SHAPE, 1, LIM_COUNT, 0),
    K_INT(n_shared_experts, NEED_NONE, 0, 256, 1),
    K_INT(n_activated_experts, NEED_SHAPE, 1, LIM_COUNT, 0),
    {"score_func", KT_SCORE_FUNC, NEED_NONE, OFF(score_func), 0, 0, 0, DS41_SCORE_SQRTSOFTPLUS, 0, 0},
    K_REAL(route_scale, NEED_NONE, RR_POSITIVE, 1.0),
    K_REAL(swiglu_limit, NEED_NONE, RR_NONNEG, 0.0),
    K_INT(q_lora_rank, NEED_SHAPE, 1, LIM_DIM, 0),
    K_INT(head_dim, NEED_SHAPE, 1, LIM_DIM, 0),
    K_INT(rope_head_dim, NEED_SHAPE, 1, LIM_DIM, 0),
    K_REAL(norm_eps, NEED_NONE, RR_POSITIVE, 1e-20),
    K_INT(o_groups, NEED_SHAPE, 1, LIM_LAYERS, 0),
    K_INT(o_lora_rank, NEED_SHAPE, 1, LIM_DIM, 0),
    K_INT(window_size, NEED_SHAPE, 1, INT64_C(1) << 24, 0),
    K_LIST(kv_source_layers, NEED_SHAPE, 0, LIM_LAYERS),
    K_LIST(index_source_layers, NEED_SHAPE, 0, LIM_LAYERS),
    K_INT(original_seq_len, NEED_NONE, 0, LIM_BIG, 0),
    K_REAL(rope_theta, NEED_NONE, RR_ABOVE_ONE, 10000.0),
    K_REAL(rope_factor, NEED_NONE, RR_POSITIVE, 40.0),
    K_INT(beta_fast, NEED_NONE, 1, LIM_DIM, 32),
    K_INT(beta_slow, NEED_NONE, 1, LIM_DIM, 1),
    K_INT(index_n_heads, NEED_SHAPE, 1, LIM_LAYERS, 0),
    K_INT(index_head_dim, NEED_SHAPE, 1, LIM_DIM, 0),
    K_INT(index_topk, NEED_SHAPE, 1, INT64_C(1) << 24, 0),
    K_INT(candidate_source_layer, NEED_NONE, -1, LIM_LAYERS, -1),
    K_INT(candidate_topk_blocks, NEED_NONE, 0, INT64_C(1) << 30, 0),
    K_INT(candidate_block_size, NEED_NONE, 0, LIM_DIM, 0),
    K_INT(hc_mult, NEED_NONE, 1, 64, 4),
    K_INT(hc_sinkhorn_iters, NEED_NONE, 1, LIM_COUNT, 20),
    K_REAL(hc_eps, NEED_NONE, RR_NONNEG, 1e-6),
    K_LIST(engram_layer_ids, NEED_NONE, 0, LIM_LAYERS),
    K_INT(engram_vocab_size, NEED_ENGRAM, 0, LIM_BIG, 0),
    K_LIST(engram_num_embeddings, NEED_ENGRAM, 1, LIM_BIG),
    K_INT(engram_max_ngram_size, NEED_NONE, 1, 64, 1),
    K_INT(engram_pad_id, NEED_NONE, 0, LIM_TOKEN_ID, 2),
    K_INT(engram_compressed_vocab_size, NEED_ENGRAM, 0, LIM_TOKEN_ID, 0),
    {"dtype", KT_WEIGHT_DTYPE, NEED_NONE, OFF(dtype), 0, 0, 0, DS41_WEIGHT_FP8, 0, 0},
    {"expert_dtype", KT_EXPERT_DTYPE, NEED_NONE, OFF(expert_dtype), 0, 0, 0, DS41_WEIGHT_FP4, 0, 0},
    K_REAL(compress_rope_theta, NEED_NONE, RR_ABOVE_ONE, 40000.0),
    K_LIST(compress_ratios, NEED_SHAPE, 0, LIM_COUNT),
    K_INT(vision_n_layers, NEED_NONE, 0, LIM_LAYERS, 0),
    K_INT(vision_dim, NEED_VISION, 0, LIM_DIM, 0),
    K_INT(vision_n_heads, NEED_VISION, 0, LIM_LAYERS, 0),
    K_INT(vision_inter_dim, NEED_VISION, 0, LIM_DIM, 0),
    K_INT(vision_patch_size, NEED_VISION, 0, 4096, 0),
    K_INT(vision_downsample_ratio, NEED_VISION, 0, 4096, 0),
    K_INT(vision_max_n_token, NEED_VISION, 0, INT64_C(1) << 24, 0),
    K_INT(vision_min_pixels, NEED_VISION, 0, LIM_BIG, 0),
    {"vision_max_wh_ratio", KT_NULLABLE_REAL, NEED_NONE, OFF(vision_max_wh_ratio),
     OFF(vision_max_wh_ratio_set), 0, 0, 0, NAN, RR_POSITIVE},
    K_INT(image_token_id, NEED_VISION, -1, LIM_TOKEN_ID, -1),
    K_INT(engram_n_heads, NEED_ENGRAM, 0, LIM_LAYERS, 0),
    K_INT(engram_head_dim, NEED_ENGRAM, 0, LIM_DIM, 0),
    K_REAL(vision_rope_theta, NEED_NONE, RR_ABOVE_ONE, 10000.0),
    K_INT(max_batch_size, NEED_NONE, 1, LIM_COUNT, 4),
    K_INT(max_seq_len, NEED_NONE, 1, LIM_TOKEN_ID, 4096),
    K_REAL(temperature, NEED_NONE, RR_NONNEG, 1.0),
    K_REAL(gate_temp, NEED_NONE, RR_POSITIVE, 1.0),
    {"norm_topk_prob", KT_BOOL, NEED_NONE, OFF(norm_topk_prob), 0, 0, 0, 1, 0, 0},
};

_Static_assert(sizeof keys / sizeof keys[0] == DS41_MODEL_CONFIG_N_KEYS,
               "DS41_MODEL_CONFIG_N_KEYS must match the key table");

#define N_KEYS (sizeof keys / sizeof keys[0])

/* ------------------------------------------------------------------------- */
/* field access */

static int64_t *int_field(ds41_model_config *cfg, const key_spec *k) {
    return (int64_t *)((char *)cfg + k->offset);
}
static const int64_t *int_field_c(const ds41_model_config *cfg, const key_spec *k) {
    return (const int64_t *)((const char *)cfg + k->offset);
}
static double *real_field(ds41_model_config *cfg, const key_spec *k) {
    return (double *)((char *)cfg + k->offset);
}
static const double *real_field_c(const ds41_model_config *cfg, const key_spec *k) {
    return (const double *)((const char *)cfg + k->offset);
}
static bool *bool_field(ds41_model_config *cfg, size_t offset) {
    return (bool *)((char *)cfg + offset);
}
static const bool *bool_field_c(const ds41_model_config *cfg, size_t offset) {
    return (const bool *)((const char *)cfg + offset);
}
static ds41_i64_list *list_field(ds41_model_config *cfg, const key_spec *k) {
    return (ds41_i64_list *)((char *)cfg + k->offset);
}
static const ds41_i64_list *list_field_c(const ds41_model_config *cfg, const key_spec *k) {
    return (const ds41_i64_list *)((const char *)cfg + k->offset);
}
/* Enums are stored as their C enum type; both have int-sized storage. */
static int enum_get(const ds41_model_config *cfg, const key_spec *k) {
    if (k->type == KT_SCORE_FUNC) return (int)*(const ds41_score_func *)((const char *)cfg + k->offset);
    return (int)*(const ds41_weight_dtype *)((const char *)cfg + k->offset);
}
static void enum_set(ds41_model_config *cfg, const key_spec *k, int v) {
    if (k->type == KT_SCORE_FUNC)
        *(ds41_score_func *)((char *)cfg + k->offset) = (ds41_score_func)v;
    else
        *(ds41_weight_dtype *)((char *)cfg + k->offset) = (ds41_weight_dtype)v;
}

static const key_spec *find_key(const char *name, size_t *index) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].name, name) == 0) {
            if (index) *index = i;
            return &keys[i];
        }
    return NULL;
}

const char *ds41_score_func_name(ds41_score_func f) {
    switch (f) {
    case DS41_SCORE_SQRTSOFTPLUS: return "sqrtsoftplus";
    }
    return "?";
}

const char *ds41_weight_dtype_name(ds41_weight_dtype d) {
    switch (d) {
    case DS41_WEIGHT_FP8: return "fp8";
    case DS41_WEIGHT_FP4: return "fp4";
    }
    return "?";
}

/* ------------------------------------------------------------------------- */
/* init / free */

static void free_owned(ds41_model_config *cfg) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (keys[i].type == KT_LIST) free(list_field(cfg, &keys[i])->v);
    for (size_t i = 0; i < cfg->n_unknown_keys; i++) free(cfg->unknown_keys[i]);
    free(cfg->unknown_keys);
    free(cfg->label);
    free(cfg->roles);
}

void ds41_model_config_free(ds41_model_config *cfg) {
    if (!cfg) return;
    free_owned(cfg);
    memset(cfg, 0, sizeof *cfg);
}

void ds41_model_config_init(ds41_model_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_spec *k = &keys[i];
        switch (k->type) {
        case KT_INT: *int_field(cfg, k) = k->dflt_int; break;
        case KT_REAL: *real_field(cfg, k) = k->dflt_real; break;
        case KT_NULLABLE_REAL:
            *bool_field(cfg, k->set_offset) = !isnan(k->dflt_real);
            *real_field(cfg, k) = isnan(k->dflt_real) ? 0.0 : k->dflt_real;
            break;
        case KT_BOOL: *bool_field(cfg, k->offset) = k->dflt_int != 0; break;
        case KT_LIST: break; /* empty */
        case KT_SCORE_FUNC:
        case KT_WEIGHT_DTYPE:
        case KT_EXPERT_DTYPE: enum_set(cfg, k, (int)k->dflt_int); break;
        }
    }
}

static const char *label_of(const ds41_model_config *cfg) {
    return cfg->label ? cfg->label : DEFAULT_LABEL;
}

/* ------------------------------------------------------------------------- */
/* one key from a JSON value */

/* A value converted from JSON, not yet stored (so a failed set() changes nothing). */
typedef struct key_value {
    int64_t i;
    double r;
    bool flag; /* KT_BOOL value; KT_NULLABLE_REAL: not null */
    ds41_i64_list list;
} key_value;

static int check_real(const key_spec *k, double r, ds41_error *err) {
    if (!isfinite(r)) return ds41_fail(err, "key '%s': %g is not a finite number", k->name, r);
    switch (k->range) {
    case RR_POSITIVE:
        if (!(r > 0)) return ds41_fail(err, "key '%s': %.17g must be > 0", k->name, r);
        break;
    case RR_NONNEG:
        if (!(r >= 0)) return ds41_fail(err, "key '%s': %.17g must be >= 0", k->name, r);
        break;
    case RR_ABOVE_ONE:
        if (!(r > 1)) return ds41_fail(err, "key '%s': %.17g must be > 1 (it is a logarithm base)", k->name, r);
        break;
    }
    return 0;
}

static int convert_value(const key_spec *k, const json_t *v, key_value *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    switch (k->type) {
    case KT_INT:
        if (!json_is_integer(v))
            return ds41_fail(err, "key '%s': expected an integer, got %s", k->name, ds41_json_type_name(v));
        out->i = (int64_t)json_integer_value(v);
        if (out->i < k->min || out->i > k->max)
            return ds41_fail(err, "key '%s': %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]", k->name,
                             out->i, k->min, k->max);
        return 0;
    case KT_NULLABLE_REAL:
        if (json_is_null(v)) {
            out->flag = false;
            return 0;
        }
        out->flag = true;
        /* fall through */
    case KT_REAL:
        if (!json_is_number(v))
            return ds41_fail(err, "key '%s': expected a number%s, got %s", k->name,
                             k->type == KT_NULLABLE_REAL ? " or null" : "", ds41_json_type_name(v));
        out->r = json_number_value(v);
        return check_real(k, out->r, err);
    case KT_BOOL:
        if (!json_is_boolean(v))
            return ds41_fail(err, "key '%s': expected true or false, got %s", k->name, ds41_json_type_name(v));
        out->flag = json_is_true(v);
        return 0;
    case KT_SCORE_FUNC:
    case KT_WEIGHT_DTYPE:
    case KT_EXPERT_DTYPE: {
        if (!json_is_string(v))
            return ds41_fail(err, "key '%s': expected a string, got %s", k->name, ds41_json_type_name(v));
        const char *s = json_string_value(v);
        int want = k->type == KT_SCORE_FUNC ? DS41_SCORE_SQRTSOFTPLUS
                   : k->type == KT_WEIGHT_DTYPE ? DS41_WEIGHT_FP8
                                                : DS41_WEIGHT_FP4;
        const char *name = k->type == KT_SCORE_FUNC ? ds41_score_func_name((ds41_score_func)want)
                                                    : ds41_weight_dtype_name((ds41_weight_dtype)want);
        if (strlen(s) != json_string_length(v) || strcmp(s, name) != 0)
            return ds41_fail(err, "key '%s': unsupported value \"%.64s\" (ds41 implements \"%s\" only)", k->name,
                             s, name);
        out->i = want;
        return 0;
    }
    case KT_LIST: {
        if (!json_is_array(v))
            return ds41_fail(err, "key '%s': expected a list of integers, got %s", k->name, ds41_json_type_name(v));
        size_t n = json_array_size(v);
        if (n > MAX_LIST_ENTRIES)
            return ds41_fail(err, "key '%s': %zu entries is more than the %d allowed", k->name, n,
                             MAX_LIST_ENTRIES);
        if (n == 0) return 0;
        out->list.v = malloc(n * sizeof *out->list.v);
        if (!out->list.v) return ds41_fail(err, "key '%s': out of memory", k->name);
        for (size_t j = 0; j < n; j++) {
            const json_t *e = json_array_get(v, j);
            if (!json_is_integer(e)) {
                free(out->list.v);
                out->list.v = NULL;
                return ds41_fail(err, "key '%s': entry %zu: expected an integer, got %s", k->name, j,
                                 ds41_json_type_name(e));
            }
            int64_t x = (int64_t)json_integer_value(e);
            if (x < k->min || x > k->max) {
                free(out->list.v);
                out->list.v = NULL;
                return ds41_fail(err,
                                 "key '%s': entry %zu: %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]",
                                 k->name, j, x, k->min, k->max);
            }
            out->list.v[j] = x;
        }
        out->list.n = n;
        return 0;
    }
    }
    return ds41_fail(err, "key '%s': internal error: unknown key type", k->name);
}

/* Move a converted value into cfg (takes ownership of its list). */
static void store_value(ds41_model_config *cfg, const key_spec *k, key_value *kv) {
    switch (k->type) {
    case KT_INT: *int_field(cfg, k) = kv->i; break;
    case KT_REAL: *real_field(cfg, k) = kv->r; break;
    case KT_NULLABLE_REAL:
        *bool_field(cfg, k->set_offset) = kv->flag;
        *real_field(cfg, k) = kv->flag ? kv->r : 0.0;
        break;
    case KT_BOOL: *bool_field(cfg, k->offset) = kv->flag; break;
    case KT_SCORE_FUNC:
    case KT_WEIGHT_DTYPE:
    case KT_EXPERT_DTYPE: enum_set(cfg, k, (int)kv->i); break;
    case KT_LIST: {
        ds41_i64_list *l = list_field(cfg, k);
        free(l->v);
        *l = kv->list;
        kv->list.v = NULL;
        kv->list.n = 0;
        break;
    }
    }
}

/* ------------------------------------------------------------------------- */
/* JSON loading */

/* jansson names a duplicate key only when it is short; its position points
 * just past the key's closing quote, so recover the raw key text from there. */
static void duplicate_key_name(const char *text, size_t len, int position, char *out, size_t outlen) {
    out[0] = 0;
    if (position <= 1 || (size_t)position > len || text[position - 1] != '"') return;
    size_t end = (size_t)position - 1, start = end;
    while (start > 0) {
        start--;
        if (text[start] != '"') continue;
        size_t backslashes = 0;
        while (backslashes < start && text[start - 1 - backslashes] == '\\') backslashes++;
        if (backslashes % 2 == 0) break;
    }
    if (text[start] != '"' || start == end) return;
    size_t o = 0;
    for (size_t i = start + 1; i < end && o + 1 < outlen; i++) {
        unsigned char c = (unsigned char)text[i];
        out[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    out[o] = 0;
}

static int json_error_to_ds41(const json_error_t *je, const char *text, size_t len, ds41_error *err) {
    if (json_error_code(je) == json_error_duplicate_key) {
        char key[128];
        duplicate_key_name(text, len, je->position, key, sizeof key);
        if (key[0])
            return ds41_fail(err, "line %d column %d: duplicate key '%s'", je->line, je->column, key);
    }
    return ds41_fail(err, "line %d column %d: invalid JSON: %s", je->line, je->column, je->text);
}

static int set_label(ds41_model_config *cfg, const char *label, ds41_error *err) {
    char *copy = strdup(label ? label : DEFAULT_LABEL);
    if (!copy) return ds41_fail(err, "%s: out of memory", label ? label : DEFAULT_LABEL);
    free(cfg->label);
    cfg->label = copy;
    return 0;
}

static int record_unknown_key(ds41_model_config *cfg, const char *name) {
    if (cfg->n_unknown_keys >= MAX_UNKNOWN_KEYS) return 0; /* a warning list, not a store */
    char **grown = realloc(cfg->unknown_keys, (cfg->n_unknown_keys + 1) * sizeof *grown);
    if (!grown) return -1;
    cfg->unknown_keys = grown;
    char *copy = strdup(name);
    if (!copy) return -1;
    cfg->unknown_keys[cfg->n_unknown_keys++] = copy;
    return 0;
}

static int parse_object(ds41_model_config *cfg, json_t *root, ds41_error *err) {
    if (!json_is_object(root))
        return ds41_fail(err, "expected a JSON object at the top level, got %s", ds41_json_type_name(root));
    /* A Hugging Face config.json nests the text model under text_config and
     * uses other key names; say so instead of listing missing keys. */
    if (!json_object_get(root, "dim") &&
        (json_object_get(root, "text_config") || json_object_get(root, "hidden_size")))
        return ds41_fail(err, "this is a Hugging Face style config.json (it has '%s'); ds41 reads the "
                              "checkpoint's inference/config.json",
                         json_object_get(root, "text_config") ? "text_config" : "hidden_size");

    const char *name;
    json_t *value;
    json_object_foreach(root, name, value) {
        size_t index;
        const key_spec *k = find_key(name, &index);
        if (!k) {
            if (record_unknown_key(cfg, name) != 0) return ds41_fail(err, "out of memory");
            continue;
        }
        key_value kv;
        if (convert_value(k, value, &kv, err) != 0) return -1;
        store_value(cfg, k, &kv);
        cfg->key_present[index] = 1;
    }
    return 0;
}

int ds41_model_config_parse(const char *text, size_t len, const char *label, ds41_model_config *cfg,
                            ds41_error *err) {
    ds41_model_config_init(cfg);
    if (set_label(cfg, label, err) != 0) return -1;
    const char *lab = label_of(cfg);
    if (!text && len > 0) {
        ds41_fail(err, "%s: no text", lab);
        ds41_model_config_free(cfg);
        return -1;
    }
    json_error_t je;
    json_t *root = json_loadb(text ? text : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        json_error_to_ds41(&je, text ? text : "", len, err);
        ds41_error_prefix(err, "%s", lab);
        ds41_model_config_free(cfg);
        return -1;
    }
    int rc = parse_object(cfg, root, err);
    json_decref(root);
    if (rc != 0) {
        ds41_error_prefix(err, "%s", lab);
        ds41_model_config_free(cfg);
        return -1;
    }
    if (ds41_model_config_finalize(cfg, err) != 0) {
        ds41_model_config_free(cfg);
        return -1;
    }
    return 0;
}

int ds41_model_config_load(const char *ckpt_dir, ds41_model_config *cfg, ds41_error *err) {
    memset(cfg, 0, sizeof *cfg);
    if (!ckpt_dir) return ds41_fail(err, "model config: no checkpoint directory given");
    size_t dlen = strlen(ckpt_dir);
    const char *tail = "/inference/config.json";
    char *path = malloc(dlen + strlen(tail) + 1);
    if (!path) return ds41_fail(err, "%s: out of memory", ckpt_dir);
    memcpy(path, ckpt_dir, dlen);
    strcpy(path + dlen, tail);

    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        ds41_fail(err, "%s: cannot open: %s", path, strerror(e));
        free(path);
        return -1;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int rc = 0;
    for (;;) {
        if (len == cap) {
            if (cap >= MAX_CONFIG_FILE_BYTES) {
                rc = ds41_fail(err, "%s: larger than %u bytes; not a model config", path, MAX_CONFIG_FILE_BYTES);
                break;
            }
            size_t ncap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, ncap);
            if (!nb) {
                rc = ds41_fail(err, "%s: out of memory", path);
                break;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) {
            if (ferror(f)) rc = ds41_fail(err, "%s: read error: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (rc == 0) rc = ds41_model_config_parse(buf, len, path, cfg, err);
    free(buf);
    free(path);
    return rc;
}

int ds41_model_config_set(ds41_model_config *cfg, const char *key, const char *value_json, ds41_error *err) {
    if (!key || !value_json) return ds41_fail(err, "set: key and value are required");
    size_t index;
    const key_spec *k = find_key(key, &index);
    if (!k) return ds41_fail(err, "set: unknown key '%.200s'", key);
    json_error_t je;
    json_t *v = json_loads(value_json, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &je);
    if (!v) return ds41_fail(err, "set: key '%s': value is not JSON: %s", k->name, je.text);
    key_value kv;
    int rc = convert_value(k, v, &kv, err);
    json_decref(v);
    if (rc != 0) return ds41_error_prefix(err, "set");
    store_value(cfg, k, &kv);
    cfg->key_present[index] = 1;
    cfg->finalized = false;
    free(cfg->roles);
    cfg->roles = NULL;
    cfg->n_roles = 0;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* validation */

/* Fail with "LABEL: key 'KEY': message". */
__attribute__((format(printf, 4, 5))) static int key_fail(const ds41_model_config *cfg, ds41_error *err,
                                                           const char *key, const char *fmt, ...) {
    char msg[DS41_ERROR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ds41_fail(err, "%s: key '%s': %s", label_of(cfg), key, msg);
}

static int check_layer_list(const ds41_model_config *cfg, const char *key, const ds41_i64_list *l,
                            ds41_error *err) {
    for (size_t i = 0; i < l->n; i++) {
        if (l->v[i] >= cfg->n_layers)
            return key_fail(cfg, err, key, "layer %" PRId64 " is not a backbone layer (n_layers is %" PRId64 ")",
                            l->v[i], cfg->n_layers);
        if (i > 0 && l->v[i] <= l->v[i - 1])
            return key_fail(cfg, err, key, "layers must be sorted and unique (%" PRId64 " follows %" PRId64 ")",
                            l->v[i], l->v[i - 1]);
    }
    return 0;
}

static int check_multiple(const ds41_model_config *cfg, const char *key, int64_t v, int64_t m, const char *why,
                          ds41_error *err) {
    if (v % m != 0)
        return key_fail(cfg, err, key, "%" PRId64 " is not a multiple of %" PRId64 " (%s)", v, m, why);
    return 0;
}

static int check_presence(const ds41_model_config *cfg, ds41_error *err) {
    bool engram = cfg->engram_layer_ids.n > 0;
    bool dspark = cfg->dspark_block_size > 0;
    bool vision = cfg->vision_n_layers > 0;
    for (size_t i = 0; i < N_KEYS; i++) {
        if (cfg->key_present[i]) continue;
        const char *when = NULL;
        switch (keys[i].need) {
        case NEED_NONE: break;
        case NEED_SHAPE: when = ""; break;
        case NEED_ENGRAM:
            if (engram) when = " (engram is on: engram_layer_ids is not empty)";
            break;
        case NEED_DSPARK:
            if (dspark) when = " (DSpark is on: dspark_block_size > 0)";
            break;
        case NEED_VISION:
            if (vision) when = " (vision is on: vision_n_layers > 0)";
            break;
        }
        if (when) return key_fail(cfg, err, keys[i].name, "required key is missing%s", when);
    }
    return 0;
}

static int check_shapes(const ds41_model_config *cfg, ds41_error *err) {
    static const char k32[] = "K dimension of an FP8/FP4 linear, quantized in blocks of 32";
    if (cfg->n_shared_experts != 1)
        return key_fail(cfg, err, "n_shared_experts", "unsupported value %" PRId64 " (the model has exactly 1)",
                        cfg->n_shared_experts);
    if (check_multiple(cfg, "dim", cfg->dim, 32, k32, err) ||
        check_multiple(cfg, "moe_inter_dim", cfg->moe_inter_dim, 32, k32, err) ||
        check_multiple(cfg, "q_lora_rank", cfg->q_lora_rank, 32, k32, err) ||
        check_multiple(cfg, "o_lora_rank", cfg->o_lora_rank, 32, k32, err) ||
        check_multiple(cfg, "head_dim", cfg->head_dim, 32,
                       "K of wo_a's groups and the index-key projection; the window KV is FP8 in blocks of 32 "
                       "and the compressed latent FP4 in groups of 16",
                       err) ||
        check_multiple(cfg, "index_head_dim", cfg->index_head_dim, 32,
                       "indexer queries and keys are FP4 in blocks of 32", err))
        return -1;
    if (cfg->rope_head_dim % 2 != 0)
        return key_fail(cfg, err, "rope_head_dim", "%" PRId64 " is odd (rope rotates pairs)", cfg->rope_head_dim);
    if (cfg->rope_head_dim > cfg->head_dim)
        return key_fail(cfg, err, "rope_head_dim", "%" PRId64 " exceeds head_dim %" PRId64, cfg->rope_head_dim,
                        cfg->head_dim);
    if (cfg->rope_head_dim > cfg->index_head_dim)
        return key_fail(cfg, err, "rope_head_dim", "%" PRId64 " exceeds index_head_dim %" PRId64,
                        cfg->rope_head_dim, cfg->index_head_dim);
    if (cfg->n_heads % cfg->o_groups != 0)
        return key_fail(cfg, err, "o_groups", "n_heads %" PRId64 " is not divisible by o_groups %" PRId64,
                        cfg->n_heads, cfg->o_groups);
    if (cfg->n_activated_experts > cfg->n_routed_experts)
        return key_fail(cfg, err, "n_activated_experts", "%" PRId64 " exceeds n_routed_experts %" PRId64,
                        cfg->n_activated_experts, cfg->n_routed_experts);
    return 0;
}

/* compress_ratios and the kv/index source lists; fills the attention part of roles. */
static int derive_attention_roles(const ds41_model_config *cfg, ds41_layer_role *roles, ds41_error *err) {
    const int64_t n_total = cfg->n_layers + cfg->n_mtp_layers;
    const ds41_i64_list *cr = &cfg->compress_ratios;
    if ((int64_t)cr->n != n_total)
        return key_fail(cfg, err, "compress_ratios",
                        "expected %" PRId64 " entries (n_layers + n_mtp_layers), got %zu", n_total, cr->n);
    for (int64_t l = 0; l < n_total; l++) {
        if (cr->v[l] > DS41_MAX_COMPRESS_RATIO)
            return key_fail(cfg, err, "compress_ratios",
                            "layer %" PRId64 ": ratio %" PRId64 " is not supported (ds41 implements 0..%d)", l,
                            cr->v[l], DS41_MAX_COMPRESS_RATIO);
        if (l >= cfg->n_layers && cr->v[l] != 0)
            return key_fail(cfg, err, "compress_ratios",
                            "layer %" PRId64 " is DSpark/MTP stage %" PRId64 " and must have ratio 0, not %" PRId64,
                            l, l - cfg->n_layers, cr->v[l]);
    }
    if (check_layer_list(cfg, "kv_source_layers", &cfg->kv_source_layers, err) ||
        check_layer_list(cfg, "index_source_layers", &cfg->index_source_layers, err))
        return -1;
    for (size_t i = 0; i < cfg->kv_source_layers.n; i++)
        if (cr->v[cfg->kv_source_layers.v[i]] == 0)
            return key_fail(cfg, err, "kv_source_layers",
                            "layer %" PRId64 " has compress ratio 0, so it has no compressed KV to own",
                            cfg->kv_source_layers.v[i]);
    for (size_t i = 0; i < cfg->index_source_layers.n; i++)
        if (cr->v[cfg->index_source_layers.v[i]] == 0)
            return key_fail(cfg, err, "index_source_layers",
                            "layer %" PRId64 " has compress ratio 0, so it has no compressed positions to index",
                            cfg->index_source_layers.v[i]);

    for (size_t i = 0; i < cfg->kv_source_layers.n; i++) roles[cfg->kv_source_layers.v[i]].kv_source = true;
    for (size_t i = 0; i < cfg->index_source_layers.n; i++) roles[cfg->index_source_layers.v[i]].index_source = true;

    /* Layers run in order and each source's output stays current until the
     * next source of the same kind (the reference's shared_attn slots). */
    int cur_kv = -1, cur_index = -1;
    for (int64_t l = 0; l < n_total; l++) {
        ds41_layer_role *r = &roles[l];
        r->ratio = (int)cr->v[l];
        r->kv_from = r->index_from = r->index_keys_from = -1;
        if (r->ratio == 0) continue;
        if (r->kv_source) cur_kv = (int)l;
        if (r->index_source) cur_index = (int)l;
        if (cur_kv < 0)
            return key_fail(cfg, err, "compress_ratios",
                            "layer %" PRId64 " has ratio %d but no kv source at or below it to read compressed KV "
                            "from (see kv_source_layers)",
                            l, r->ratio);
        if (roles[cur_kv].ratio != r->ratio)
            return key_fail(cfg, err, "compress_ratios",
                            "layer %" PRId64 " has ratio %d but the kv source it reads, layer %d, has ratio %d "
                            "(see kv_source_layers)",
                            l, r->ratio, cur_kv, roles[cur_kv].ratio);
        r->kv_from = cur_kv;
        if (cur_index < 0)
            return key_fail(cfg, err, "index_source_layers",
                            "layer %" PRId64 " has ratio %d but no index source at or below it", l, r->ratio);
        if (roles[cur_index].kv_from != cur_kv)
            return key_fail(cfg, err, "index_source_layers",
                            "layer %" PRId64 " reads compressed KV from layer %d, but its nearest index source, "
                            "layer %d, indexes layer %d's cache (every kv source must also be an index source)",
                            l, cur_kv, cur_index, roles[cur_index].kv_from);
        r->index_from = cur_index;
        if (r->index_source) r->index_keys_from = cur_kv;
        r->has_wgate = r->kv_source && r->ratio > 1;
    }
    return 0;
}

static int check_candidates(const ds41_model_config *cfg, ds41_layer_role *roles, ds41_error *err) {
    int64_t cs = cfg->candidate_source_layer;
    if (cs < 0) return 0;
    if (cs >= cfg->n_layers)
        return key_fail(cfg, err, "candidate_source_layer",
                        "layer %" PRId64 " is not a backbone layer (n_layers is %" PRId64 ")", cs, cfg->n_layers);
    if (!roles[cs].index_source || !roles[cs].kv_source)
        return key_fail(cfg, err, "candidate_source_layer",
                        "layer %" PRId64 " must be both a kv source and an index source", cs);
    if (cfg->candidate_block_size < 1)
        return key_fail(cfg, err, "candidate_block_size", "must be >= 1 when candidate_source_layer is set");
    if (cfg->candidate_topk_blocks < 1)
        return key_fail(cfg, err, "candidate_topk_blocks", "must be >= 1 when candidate_source_layer is set");
    /* Fewest finite candidates a query with enough context can get: the pinned
     * newest block may hold one reachable position, the others are full. */
    int64_t fewest = 1 + (cfg->candidate_topk_blocks - 1) * cfg->candidate_block_size;
    if (fewest < cfg->index_topk)
        return key_fail(cfg, err, "candidate_topk_blocks",
                        "%" PRId64 " blocks of %" PRId64 " leave as few as %" PRId64
                        " candidate positions, fewer than index_topk %" PRId64,
                        cfg->candidate_topk_blocks, cfg->candidate_block_size, fewest, cfg->index_topk);
    for (int64_t l = cs + 1; l < cfg->n_layers; l++) {
        if (!roles[l].index_source) continue;
        if (roles[l].kv_from != cs)
            return key_fail(cfg, err, "candidate_source_layer",
                            "index source layer %" PRId64 " above the candidate source reads layer %d's "
                            "compressed KV, not layer %" PRId64 "'s, so the candidate mask does not apply to it",
                            l, roles[l].kv_from, cs);
        roles[l].candidate_user = true;
    }
    roles[cs].candidate_source = true;
    return 0;
}

static int check_engram(const ds41_model_config *cfg, ds41_layer_role *roles, ds41_error *err) {
    const ds41_i64_list *ids = &cfg->engram_layer_ids;
    if (check_layer_list(cfg, "engram_layer_ids", ids, err)) return -1;
    if (ids->n == 0) {
        if (cfg->engram_num_embeddings.n != 0)
            return key_fail(cfg, err, "engram_num_embeddings", "%zu entries but engram_layer_ids is empty",
                            cfg->engram_num_embeddings.n);
        return 0;
    }
    if (cfg->engram_max_ngram_size < 2)
        return key_fail(cfg, err, "engram_max_ngram_size", "%" PRId64 " must be >= 2 when engram is on",
                        cfg->engram_max_ngram_size);
    if (cfg->engram_n_heads < 1) return key_fail(cfg, err, "engram_n_heads", "must be >= 1 when engram is on");
    if (cfg->engram_head_dim < 1) return key_fail(cfg, err, "engram_head_dim", "must be >= 1 when engram is on");
    if (check_multiple(cfg, "engram_head_dim", cfg->engram_head_dim, 32,
                       "table rows have one ue8m0 scale per 32 channels and feed the FP8 wkv", err))
        return -1;
    if (cfg->engram_vocab_size < 1)
        return key_fail(cfg, err, "engram_vocab_size", "must be >= 1 when engram is on");
    if (cfg->engram_compressed_vocab_size < 1 || cfg->engram_compressed_vocab_size > cfg->vocab_size)
        return key_fail(cfg, err, "engram_compressed_vocab_size",
                        "%" PRId64 " must be in [1, vocab_size %" PRId64 "]", cfg->engram_compressed_vocab_size,
                        cfg->vocab_size);
    if (cfg->engram_pad_id >= cfg->vocab_size)
        return key_fail(cfg, err, "engram_pad_id", "%" PRId64 " is not below vocab_size %" PRId64,
                        cfg->engram_pad_id, cfg->vocab_size);
    if (cfg->engram_num_embeddings.n != ids->n)
        return key_fail(cfg, err, "engram_num_embeddings",
                        "expected %zu entries (one per engram layer), got %zu", ids->n,
                        cfg->engram_num_embeddings.n);
    /* Each table stacks (max_ngram - 1) * n_heads prime-sized blocks, every
     * prime at least engram_vocab_size (bounded ranges: no overflow). */
    int64_t columns = (cfg->engram_max_ngram_size - 1) * cfg->engram_n_heads;
    int64_t min_rows = columns * cfg->engram_vocab_size;
    for (size_t i = 0; i < ids->n; i++)
        if (cfg->engram_num_embeddings.v[i] < min_rows)
            return key_fail(cfg, err, "engram_num_embeddings",
                            "entry %zu (layer %" PRId64 "): %" PRId64 " rows cannot hold %" PRId64
                            " hash columns of at least engram_vocab_size %" PRId64 " rows each",
                            i, ids->v[i], cfg->engram_num_embeddings.v[i], columns, cfg->engram_vocab_size);
    for (size_t i = 0; i < ids->n; i++) roles[ids->v[i]].engram_slot = (int)i;
    return 0;
}

static int check_dspark(const ds41_model_config *cfg, ds41_layer_role *roles, ds41_error *err) {
    const ds41_i64_list *t = &cfg->dspark_target_layer_ids;
    if (check_layer_list(cfg, "dspark_target_layer_ids", t, err)) return -1;
    if (cfg->dspark_block_size == 0) return 0;
    if (cfg->n_mtp_layers < 1)
        return key_fail(cfg, err, "dspark_block_size",
                        "DSpark is on (%" PRId64 ") but n_mtp_layers is 0: there are no draft stages",
                        cfg->dspark_block_size);
    if (t->n == 0)
        return key_fail(cfg, err, "dspark_target_layer_ids", "DSpark is on but no target layer is listed");
    if (cfg->dspark_noise_token_id >= cfg->vocab_size)
        return key_fail(cfg, err, "dspark_noise_token_id", "%" PRId64 " is not below vocab_size %" PRId64,
                        cfg->dspark_noise_token_id, cfg->vocab_size);
    if (cfg->dspark_markov_rank < 1)
        return key_fail(cfg, err, "dspark_markov_rank", "must be >= 1 when DSpark is on");
    int64_t routed = cfg->dspark_n_routed_experts ? cfg->dspark_n_routed_experts : cfg->n_routed_experts;
    int64_t active = cfg->dspark_n_activated_experts ? cfg->dspark_n_activated_experts : cfg->n_activated_experts;
    if (active > routed)
        return key_fail(cfg, err, "dspark_n_activated_experts",
                        "%" PRId64 " active experts exceed the %" PRId64 " DSpark routed experts", active, routed);
    for (size_t i = 0; i < t->n; i++) roles[t->v[i]].dspark_tap = true;
    for (int64_t s = 0; s < cfg->n_mtp_layers; s++) {
        ds41_layer_role *r = &roles[cfg->n_layers + s];
        r->dspark_stage = (int)s;
        r->n_experts = routed;
        r->n_active_experts = active;
    }
    return 0;
}

static int check_vision(const ds41_model_config *cfg, ds41_error *err) {
    if (cfg->image_token_id >= cfg->vocab_size)
        return key_fail(cfg, err, "image_token_id", "%" PRId64 " is not below vocab_size %" PRId64,
                        cfg->image_token_id, cfg->vocab_size);
    if (cfg->vision_n_layers == 0) return 0;
    static const char *const shapes[] = {"vision_dim",         "vision_n_heads",      "vision_inter_dim",
                                         "vision_patch_size",  "vision_downsample_ratio",
                                         "vision_max_n_token", "vision_min_pixels"};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const key_spec *k = find_key(shapes[i], NULL);
        if (*int_field_c(cfg, k) < 1) return key_fail(cfg, err, k->name, "must be >= 1 when vision is on");
    }
    if (cfg->vision_dim % cfg->vision_n_heads != 0)
        return key_fail(cfg, err, "vision_n_heads", "vision_dim %" PRId64 " is not divisible by %" PRId64 " heads",
                        cfg->vision_dim, cfg->vision_n_heads);
    if (cfg->image_token_id < 0)
        return key_fail(cfg, err, "image_token_id", "must be a token id when vision is on");
    return 0;
}

int ds41_model_config_finalize(ds41_model_config *cfg, ds41_error *err) {
    free(cfg->roles);
    cfg->roles = NULL;
    cfg->n_roles = 0;
    cfg->finalized = false;
    if (check_presence(cfg, err) || check_shapes(cfg, err)) return -1;

    size_t n_total = (size_t)(cfg->n_layers + cfg->n_mtp_layers);
    ds41_layer_role *roles = calloc(n_total, sizeof *roles);
    if (!roles) return ds41_fail(err, "%s: out of memory", label_of(cfg));
    for (size_t l = 0; l < n_total; l++) {
        bool backbone = (int64_t)l < cfg->n_layers;
        roles[l].present = backbone || cfg->dspark_block_size > 0;
        roles[l].engram_slot = -1;
        roles[l].dspark_stage = -1;
        roles[l].n_experts = cfg->n_routed_experts;
        roles[l].n_active_experts = cfg->n_activated_experts;
    }
    if (derive_attention_roles(cfg, roles, err) || check_candidates(cfg, roles, err) ||
        check_engram(cfg, roles, err) || check_dspark(cfg, roles, err) || check_vision(cfg, err)) {
        free(roles);
        return -1;
    }
    for (size_t l = 0; l < n_total; l++) {
        /* Window-only layers use the base theta without YaRN; compressed
         * layers use the compressed theta (+ YaRN) for everything. */
        roles[l].rope_theta = roles[l].ratio > 0 ? cfg->compress_rope_theta : cfg->rope_theta;
        roles[l].yarn = roles[l].ratio > 0 && cfg->original_seq_len > 0;
    }
    cfg->roles = roles;
    cfg->n_roles = n_total;
    cfg->engram_enabled = cfg->engram_layer_ids.n > 0;
    cfg->dspark_enabled = cfg->dspark_block_size > 0;
    cfg->vision_enabled = cfg->vision_n_layers > 0;
    cfg->candidates_enabled = cfg->candidate_source_layer >= 0;
    cfg->finalized = true;
    return 0;
}

/* ------------------------------------------------------------------------- */
/* writing and comparing */

/* Shortest "%.Ng" that reads back to exactly r; ".0" added to integral values
 * so the JSON stays a real. */
static void format_real(double r, char *buf, size_t n) {
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(buf, n, "%.*g", digits, r);
        if (strtod(buf, NULL) == r) break;
    }
    if (!strpbrk(buf, ".eEn")) {
        size_t len = strlen(buf);
        if (len + 2 < n) memcpy(buf + len, ".0", 3);
    }
}

int ds41_model_config_write_json(const ds41_model_config *cfg, FILE *f, ds41_error *err) {
    fputs("{\n", f);
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_spec *k = &keys[i];
        fprintf(f, "    \"%s\": ", k->name);
        char num[64];
        switch (k->type) {
        case KT_INT: fprintf(f, "%" PRId64, *int_field_c(cfg, k)); break;
        case KT_REAL:
            format_real(*real_field_c(cfg, k), num, sizeof num);
            fputs(num, f);
            break;
        case KT_NULLABLE_REAL:
            if (*bool_field_c(cfg, k->set_offset)) {
                format_real(*real_field_c(cfg, k), num, sizeof num);
                fputs(num, f);
            } else {
                fputs("null", f);
            }
            break;
        case KT_BOOL: fputs(*bool_field_c(cfg, k->offset) ? "true" : "false", f); break;
        case KT_SCORE_FUNC:
            fprintf(f, "\"%s\"", ds41_score_func_name((ds41_score_func)enum_get(cfg, k)));
            break;
        case KT_WEIGHT_DTYPE:
        case KT_EXPERT_DTYPE:
            fprintf(f, "\"%s\"", ds41_weight_dtype_name((ds41_weight_dtype)enum_get(cfg, k)));
            break;
        case KT_LIST: {
            const ds41_i64_list *l = list_field_c(cfg, k);
            fputc('[', f);
            for (size_t j = 0; j < l->n; j++) fprintf(f, "%s%" PRId64, j ? ", " : "", l->v[j]);
            fputc(']', f);
            break;
        }
        }
        fputs(i + 1 < N_KEYS ? ",\n" : "\n", f);
    }
    fputs("}\n", f);
    if (fflush(f) != 0 || ferror(f))
        return ds41_fail(err, "%s: writing the config failed: %s", label_of(cfg), strerror(errno));
    return 0;
}

bool ds41_model_config_equal(const ds41_model_config *a, const ds41_model_config *b) {
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_spec *k = &keys[i];
        switch (k->type) {
        case KT_INT:
            if (*int_field_c(a, k) != *int_field_c(b, k)) return false;
            break;
        case KT_NULLABLE_REAL:
            if (*bool_field_c(a, k->set_offset) != *bool_field_c(b, k->set_offset)) return false;
            if (!*bool_field_c(a, k->set_offset)) break;
            /* fall through */
        case KT_REAL:
            if (*real_field_c(a, k) != *real_field_c(b, k)) return false;
            break;
        case KT_BOOL:
            if (*bool_field_c(a, k->offset) != *bool_field_c(b, k->offset)) return false;
            break;
        case KT_SCORE_FUNC:
        case KT_WEIGHT_DTYPE:
        case KT_EXPERT_DTYPE:
            if (enum_get(a, k) != enum_get(b, k)) return false;
            break;
        case KT_LIST: {
            const ds41_i64_list *la = list_field_c(a, k), *lb = list_field_c(b, k);
            if (la->n != lb->n) return false;
            for (size_t j = 0; j < la->n; j++)
                if (la->v[j] != lb->v[j]) return false;
            break;
        }
        }
    }
    return true;
}

/* ------------------------------------------------------------------------- */
/* sizes */

static uint64_t gcd_u64(uint64_t a, uint64_t b) {
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static uint64_t latent_entry_bytes(const ds41_model_config *cfg) {
    uint64_t hd = (uint64_t)cfg->head_dim;
    return hd / 2 + hd / 16; /* FP4 codes + one e4m3 scale per 16 */
}

static uint64_t index_key_entry_bytes(const ds41_model_config *cfg) {
    uint64_t ihd = (uint64_t)cfg->index_head_dim;
    return ihd / 2 + ihd / 32; /* FP4 codes + one ue8m0 scale per 32 */
}

ds41_cache_rate ds41_model_config_cache_rate(const ds41_model_config *cfg) {
    /* Common denominator: the lcm of the kv sources' ratios. */
    uint64_t den = 1;
    for (size_t i = 0; i < cfg->kv_source_layers.n; i++) {
        int64_t l = cfg->kv_source_layers.v[i];
        if (l < 0 || (size_t)l >= cfg->compress_ratios.n || cfg->compress_ratios.v[l] <= 0) continue;
        uint64_t r = (uint64_t)cfg->compress_ratios.v[l];
        den = den / gcd_u64(den, r) * r;
    }
    uint64_t latent = 0, ikey = 0;
    for (size_t i = 0; i < cfg->kv_source_layers.n; i++) {
        int64_t l = cfg->kv_source_layers.v[i];
        if (l < 0 || (size_t)l >= cfg->compress_ratios.n || cfg->compress_ratios.v[l] <= 0) continue;
        uint64_t per = den / (uint64_t)cfg->compress_ratios.v[l];
        latent += latent_entry_bytes(cfg) * per;
        ikey += index_key_entry_bytes(cfg) * per;
    }
    uint64_t g = gcd_u64(gcd_u64(latent, ikey), den);
    if (g == 0) g = 1;
    ds41_cache_rate rate = {latent / g, ikey / g, (latent + ikey) / g, den / g};
    return rate;
}

static uint64_t ceil_div(uint64_t a, uint64_t b) {
    return a / b + (a % b != 0);
}

uint64_t ds41_model_config_cache_bytes_per_token(const ds41_model_config *cfg, uint64_t *latent_bytes,
                                                 uint64_t *index_key_bytes) {
    ds41_cache_rate rate = ds41_model_config_cache_rate(cfg);
    if (latent_bytes) *latent_bytes = ceil_div(rate.latent_bytes, rate.per_tokens);
    if (index_key_bytes) *index_key_bytes = ceil_div(rate.index_key_bytes, rate.per_tokens);
    return ceil_div(rate.total_bytes, rate.per_tokens);
}

uint64_t ds41_model_config_cache_bytes_for_tokens(const ds41_model_config *cfg, uint64_t n_tokens,
                                                  uint64_t *latent_bytes, uint64_t *index_key_bytes) {
    uint64_t latent = 0, ikey = 0;
    for (size_t i = 0; i < cfg->kv_source_layers.n; i++) {
        int64_t l = cfg->kv_source_layers.v[i];
        if (l < 0 || (size_t)l >= cfg->compress_ratios.n || cfg->compress_ratios.v[l] <= 0) continue;
        uint64_t entries = n_tokens / (uint64_t)cfg->compress_ratios.v[l];
        latent += entries * latent_entry_bytes(cfg);
        ikey += entries * index_key_entry_bytes(cfg);
    }
    if (latent_bytes) *latent_bytes = latent;
    if (index_key_bytes) *index_key_bytes = ikey;
    return latent + ikey;
}

void ds41_model_config_session_bytes(const ds41_model_config *cfg, ds41_session_bytes *out) {
    memset(out, 0, sizeof *out);
    uint64_t hd = (uint64_t)cfg->head_dim;
    uint64_t ring_row = hd + hd / 32; /* FP8 values + one ue8m0 scale per 32 */
    for (size_t l = 0; l < cfg->n_roles; l++) {
        const ds41_layer_role *r = &cfg->roles[l];
        if (!r->present) continue;
        out->window_ring_bytes += (uint64_t)cfg->window_size * ring_row;
        if (r->kv_source && r->ratio > 1)
            out->compressor_carry_bytes += 2 * (uint64_t)r->ratio * hd * sizeof(float);
    }
    if (cfg->engram_layer_ids.n > 0 && cfg->engram_max_ngram_size > 1)
        out->engram_history_bytes =
            (uint64_t)cfg->engram_layer_ids.n * (uint64_t)(cfg->engram_max_ngram_size - 1) * sizeof(int32_t);
    out->total_bytes = out->window_ring_bytes + out->compressor_carry_bytes + out->engram_history_bytes;
}

/* ------------------------------------------------------------------------- */
/* role text */

const char *ds41_layer_role_kind(const ds41_layer_role *r, char *buf, size_t buflen) {
    if (!buf || buflen == 0) return buf;
    if (!r->present)
        snprintf(buf, buflen, "unused mtp layer (DSpark off)");
    else if (r->dspark_stage >= 0)
        snprintf(buf, buflen, "dspark stage %d (window)", r->dspark_stage);
    else if (r->ratio == 0)
        snprintf(buf, buflen, "window");
    else if (r->kv_source)
        snprintf(buf, buflen, "kv+index%s source", r->candidate_source ? "+candidate" : "");
    else if (r->index_source)
        snprintf(buf, buflen, "index source (keys of %d)%s", r->index_keys_from,
                 r->candidate_user ? ", candidate user" : "");
    else if (r->index_from == r->kv_from)
        snprintf(buf, buflen, "consumer of %d", r->kv_from);
    else
        snprintf(buf, buflen, "consumer of %d, indices of %d", r->kv_from, r->index_from);
    return buf;
}
