/* ds41-inspect: what a checkpoint directory holds and whether it is complete.
 *
 * Prints the tensor inventory (count and bytes per dtype and per module kind),
 * the layer-role table, the compressed-cache bytes per token and per-session
 * state, the tokenizer and Engram layout checks, and a checkpoint check that
 * names every missing, unexpected, mis-typed or mis-shaped tensor against
 * what the config requires (REFERENCE §3).  A directory holding only
 * inference/config.json gets the figures and every tensor listed as missing.
 *
 * Exit status: 0 nothing wrong, 1 problems found, 2 the directory could not be
 * read (bad config, malformed safetensors, usage). */
#include "config/model_config.h"
#include "ds41_version.h"
#include "engine/model/engram_layout.h"
#include "engine/model/engram_tokens.h"
#include "engine/model/tensor_plan.h"
#include "engine/text/vocab.h"
#include "storage/safetensors.h"

#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct tally {
    uint64_t count, bytes;
} tally;

static void human_bytes(uint64_t b, char *buf, size_t len) {
    const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 4) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", b);
    else
        snprintf(buf, len, "%.2f %s", v, unit[u]);
}

static void print_tally_row(const char *label, tally t) {
    char hb[32];
    human_bytes(t.bytes, hb, sizeof hb);
    printf("  %-22s %9" PRIu64 " %18" PRIu64 "  %12s\n", label, t.count, t.bytes, hb);
}

static void print_shape(const int64_t *shape, int ndim) {
    printf("[");
    for (int i = 0; i < ndim; i++) printf("%s%lld", i ? "," : "", (long long)shape[i]);
    printf("]");
}

typedef struct report_ctx {
    long limit;   /* max problem lines printed, < 0 = all */
    long printed;
    long suppressed;
} report_ctx;

static void report(void *vctx, ds41_check_problem problem, const char *name, const ds41_planned_tensor *p,
                   const ds41_tensor *t) {
    report_ctx *ctx = vctx;
    if (ctx->limit >= 0 && ctx->printed >= ctx->limit) {
        ctx->suppressed++;
        return;
    }
    ctx->printed++;
    switch (problem) {
    case DS41_CHECK_MISSING:
        printf("  missing     %s %s ", name, ds41_dtype_name(p->dtype));
        print_shape(p->shape, p->ndim);
        break;
    case DS41_CHECK_UNEXPECTED:
        printf("  unexpected  %s %s ", name, ds41_dtype_name(t->dtype));
        print_shape(t->shape, t->ndim);
        break;
    case DS41_CHECK_WRONG_DTYPE:
        printf("  wrong dtype %s: %s, expected %s", name, ds41_dtype_name(t->dtype), ds41_dtype_name(p->dtype));
        break;
    case DS41_CHECK_WRONG_SHAPE:
        printf("  wrong shape %s: ", name);
        print_shape(t->shape, t->ndim);
        printf(", expected ");
        print_shape(p->shape, p->ndim);
        break;
    }
    printf("\n");
}

static int cmp_planned_name(const void *a, const void *b) {
    return strcmp((*(const ds41_planned_tensor *const *)a)->name, (*(const ds41_planned_tensor *const *)b)->name);
}

static void print_inventory(const ds41_tensor_plan *plan, const ds41_checkpoint *ckpt) {
    tally by_dtype[DS41_DTYPE_COUNT] = {{0}};
    tally by_kind[DS41_KIND_COUNT] = {{0}};
    tally unexpected = {0}, total = {0};
    if (!ckpt) {
        printf("Tensor inventory (required by the config; no weights present)\n");
        for (size_t i = 0; i < plan->n; i++) {
            const ds41_planned_tensor *p = &plan->t[i];
            by_dtype[p->dtype].count++;
            by_dtype[p->dtype].bytes += p->nbytes;
            by_kind[p->kind].count++;
            by_kind[p->kind].bytes += p->nbytes;
            total.count++;
            total.bytes += p->nbytes;
        }
    } else {
        printf("Tensor inventory (present in the checkpoint)\n");
        const ds41_planned_tensor **sorted = malloc((plan->n ? plan->n : 1) * sizeof *sorted);
        if (!sorted) return;
        for (size_t i = 0; i < plan->n; i++) sorted[i] = &plan->t[i];
        qsort(sorted, plan->n, sizeof *sorted, cmp_planned_name);
        size_t n = ds41_checkpoint_tensor_count(ckpt);
        for (size_t i = 0; i < n; i++) {
            const ds41_tensor *t = ds41_checkpoint_tensor_at(ckpt, i);
            by_dtype[t->dtype].count++;
            by_dtype[t->dtype].bytes += t->nbytes;
            ds41_planned_tensor key;
            snprintf(key.name, sizeof key.name, "%s", t->name);
            const ds41_planned_tensor *kp = &key;
            const ds41_planned_tensor **hit = bsearch(&kp, sorted, plan->n, sizeof *sorted, cmp_planned_name);
            tally *k = hit ? &by_kind[(*hit)->kind] : &unexpected;
            k->count++;
            k->bytes += t->nbytes;
            total.count++;
            total.bytes += t->nbytes;
        }
        free(sorted);
    }
    printf("  %-22s %9s %18s  %12s\n", "dtype", "tensors", "bytes", "");
    for (int d = 0; d < DS41_DTYPE_COUNT; d++)
        if (by_dtype[d].count) print_tally_row(ds41_dtype_name((ds41_dtype)d), by_dtype[d]);
    printf("  %-22s %9s %18s  %12s\n", "module kind", "tensors", "bytes", "");
    for (int k = 0; k < DS41_KIND_COUNT; k++)
        if (by_kind[k].count) print_tally_row(ds41_tensor_kind_name((ds41_tensor_kind)k), by_kind[k]);
    if (unexpected.count) print_tally_row("(not in the plan)", unexpected);
    print_tally_row("total", total);
    printf("\n");
}

static void print_roles(const ds41_model_config *cfg) {
    printf("Layer roles\n");
    printf("  %-6s %-5s %-56s %-9s %-5s %-8s %-10s\n", "layer", "ratio", "attention", "rope", "yarn", "engram",
           "experts");
    for (size_t l = 0; l < cfg->n_roles; l++) {
        const ds41_layer_role *r = &cfg->roles[l];
        char kind[96], name[32], experts[64];
        if ((int64_t)l < cfg->n_layers)
            snprintf(name, sizeof name, "%zu", l);
        else
            snprintf(name, sizeof name, "mtp.%lld", (long long)((int64_t)l - cfg->n_layers));
        ds41_layer_role_kind(r, kind, sizeof kind);
        if (r->dspark_tap) strncat(kind, ", dspark tap", sizeof kind - strlen(kind) - 1);
        if (r->present)
            snprintf(experts, sizeof experts, "%lld top-%lld", (long long)r->n_experts,
                     (long long)r->n_active_experts);
        else
            snprintf(experts, sizeof experts, "-");
        printf("  %-6s %-5d %-56s %-9g %-5s %-8s %-10s\n", name, r->ratio, kind, r->rope_theta,
               r->yarn ? "yes" : "no", r->engram_slot >= 0 ? "before" : "", experts);
    }
    printf("\n");
}

static void print_cache(const ds41_model_config *cfg) {
    ds41_cache_rate rate = ds41_model_config_cache_rate(cfg);
    printf("Compressed cache (FP4 latents + FP4 index keys, packed)\n");
    if (rate.per_tokens == 1)
        printf("  %" PRIu64 " bytes/token (latents %" PRIu64 ", index keys %" PRIu64 ")\n", rate.total_bytes,
               rate.latent_bytes, rate.index_key_bytes);
    else
        printf("  %" PRIu64 " bytes per %" PRIu64 " tokens (latents %" PRIu64 ", index keys %" PRIu64 ")\n",
               rate.total_bytes, rate.per_tokens, rate.latent_bytes, rate.index_key_bytes);
    for (int64_t ctx = 4096; ctx <= 1048576; ctx *= 16) {
        char hb[32];
        human_bytes(ds41_model_config_cache_bytes_for_tokens(cfg, (uint64_t)ctx, NULL, NULL), hb, sizeof hb);
        printf("  at %7lld tokens: %s\n", (long long)ctx, hb);
    }
    ds41_session_bytes s;
    ds41_model_config_session_bytes(cfg, &s);
    printf("Per-session constants: window rings %" PRIu64 " B, compressor carries %" PRIu64
           " B, engram history %" PRIu64 " B, total %" PRIu64 " B\n\n",
           s.window_ring_bytes, s.compressor_carry_bytes, s.engram_history_bytes, s.total_bytes);
}

/* Tokenizer and Engram layout: returns the number of problems found. */
static int check_tokenizer_engram(const char *dir, const ds41_model_config *cfg) {
    int problems = 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    printf("Tokenizer and Engram\n");
    ds41_error err;
    ds41_vocab *v = NULL;
    if (access(path, F_OK) != 0) {
        printf("  tokenizer.json: not present (needed to serve text and for the Engram token map)\n");
        problems++;
    } else if (!(v = ds41_vocab_load_dir(dir, &err))) {
        printf("  tokenizer: %s\n", err.msg);
        problems++;
    } else {
        uint32_t n = ds41_vocab_size(v);
        printf("  tokenizer.json: %u ids, %zu merges, %zu added tokens\n", n, ds41_vocab_n_merges(v),
               ds41_vocab_n_added(v));
        if ((int64_t)n > cfg->vocab_size) {
            printf("  ! tokenizer has %u ids but vocab_size is %lld\n", n, (long long)cfg->vocab_size);
            problems++;
        }
    }
    if (cfg->engram_layer_ids.n == 0) {
        printf("  engram: off\n\n");
        ds41_vocab_free(v);
        return problems;
    }
    if (v) {
        int32_t *map = NULL;
        uint32_t n_ids = 0, n_comp = 0;
        if (ds41_engram_token_map_from_vocab(v, &map, &n_ids, &n_comp, &err) != 0) {
            printf("  engram token map: %s\n", err.msg);
            problems++;
        } else {
            bool ok = (int64_t)n_comp == cfg->engram_compressed_vocab_size;
            printf("  engram token map: %u compressed ids (engram_compressed_vocab_size %lld: %s)\n", n_comp,
                   (long long)cfg->engram_compressed_vocab_size, ok ? "ok" : "MISMATCH");
            if (!ok) problems++;
            free(map);
        }
    }
    int ids[DS41_ENGRAM_MAX_LAYERS];
    size_t nl = cfg->engram_layer_ids.n;
    ds41_engram_layout layout;
    if (nl > DS41_ENGRAM_MAX_LAYERS) {
        printf("  ! engram: %zu layers, at most %d supported\n", nl, DS41_ENGRAM_MAX_LAYERS);
        problems++;
    } else {
        for (size_t i = 0; i < nl; i++) ids[i] = (int)cfg->engram_layer_ids.v[i];
        if (ds41_engram_layout_compute(ids, (int)nl, (int)cfg->engram_max_ngram_size, (int)cfg->engram_n_heads,
                                       cfg->engram_vocab_size, cfg->engram_compressed_vocab_size, &layout,
                                       &err) != 0) {
            printf("  ! engram layout: %s\n", err.msg);
            problems++;
        } else {
            for (int i = 0; i < layout.n_layers; i++)
                printf("  engram layer %d: %d hash columns, %lld rows, multipliers %lld %lld ...\n",
                       layout.layers[i].layer_id, layout.n_cols, (long long)layout.layers[i].rows,
                       (long long)layout.layers[i].multipliers[0], (long long)layout.layers[i].multipliers[1]);
            if (ds41_engram_layout_check(&layout, cfg->engram_num_embeddings.v, (int)cfg->engram_num_embeddings.n,
                                         &err) != 0) {
                printf("  ! %s\n", err.msg);
                problems++;
            } else {
                printf("  engram_num_embeddings: ok (sums of the primes)\n");
            }
        }
    }
    printf("\n");
    ds41_vocab_free(v);
    return problems;
}

static void usage(FILE *f) {
    fprintf(f, "usage: ds41-inspect DIR [--max-list N]\n"
               "       ds41-inspect --version\n"
               "  Inventory, layer roles, cache figures and a completeness check of a\n"
               "  DeepSeek-V4.1 checkpoint directory (Hugging Face layout).\n"
               "  --max-list N   print at most N problem lines (default: all)\n"
               "exit status: 0 ok, 1 problems found, 2 unreadable\n");
}

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"max-list", required_argument, NULL, 'm'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    report_ctx rctx = {.limit = -1};
    int c;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        if (c == 'm') {
            char *end;
            rctx.limit = strtol(optarg, &end, 10);
            if (*end || rctx.limit < 0) {
                fprintf(stderr, "ds41-inspect: --max-list '%s': expected a non-negative integer\n", optarg);
                return 2;
            }
        } else if (c == 'h') {
            usage(stdout);
            return 0;
        } else if (c == 'V') {
            puts("ds41-inspect " DS41_VERSION);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (optind + 1 != argc) {
        usage(stderr);
        return 2;
    }
    const char *dir = argv[optind];
    ds41_error err;
    ds41_model_config cfg;
    if (ds41_model_config_load(dir, &cfg, &err) != 0) {
        fprintf(stderr, "ds41-inspect: %s\n", err.msg);
        return 2;
    }
    for (size_t i = 0; i < cfg.n_unknown_keys; i++)
        fprintf(stderr, "ds41-inspect: warning: %s: unknown key '%s' ignored\n", cfg.label, cfg.unknown_keys[i]);

    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    bool has_index = access(path, F_OK) == 0;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    bool has_single = access(path, F_OK) == 0;
    ds41_checkpoint *ckpt = NULL;
    if (has_index || has_single) {
        ckpt = ds41_checkpoint_open(dir, &err);
        if (!ckpt) {
            fprintf(stderr, "ds41-inspect: %s\n", err.msg);
            ds41_model_config_free(&cfg);
            return 2;
        }
    }
    ds41_tensor_plan plan;
    if (ds41_tensor_plan_build(&cfg, &plan, &err) != 0) {
        fprintf(stderr, "ds41-inspect: %s\n", err.msg);
        ds41_checkpoint_close(ckpt);
        ds41_model_config_free(&cfg);
        return 2;
    }

    printf("Checkpoint %s\n", dir);
    printf("  config: %s: %lld layers + %lld mtp, dim %lld, vocab %lld, %lld experts top-%lld\n", cfg.label,
           (long long)cfg.n_layers, (long long)cfg.n_mtp_layers, (long long)cfg.dim, (long long)cfg.vocab_size,
           (long long)cfg.n_routed_experts, (long long)cfg.n_activated_experts);
    if (ckpt)
        printf("  weights: %zu shard(s), %zu tensors, %" PRIu64 " payload bytes\n\n",
               ds41_checkpoint_shard_count(ckpt), ds41_checkpoint_tensor_count(ckpt),
               ds41_checkpoint_payload_bytes(ckpt));
    else
        printf("  weights: none (no model.safetensors.index.json or model.safetensors)\n\n");

    print_inventory(&plan, ckpt);
    print_roles(&cfg);
    print_cache(&cfg);
    int problems = check_tokenizer_engram(dir, &cfg);

    uint64_t planned_bytes = 0;
    for (size_t i = 0; i < plan.n; i++) planned_bytes += plan.t[i].nbytes;
    printf("Checkpoint check: the config requires %zu tensors, %" PRIu64 " payload bytes\n", plan.n, planned_bytes);
    ds41_check_counts cc = ds41_tensor_plan_check(&plan, ckpt, report, &rctx);
    if (rctx.suppressed) printf("  ... %ld more problem lines not shown (--max-list)\n", rctx.suppressed);
    printf("  missing %zu, unexpected %zu, wrong dtype %zu, wrong shape %zu\n", cc.missing, cc.unexpected,
           cc.wrong_dtype, cc.wrong_shape);
    problems += (int)(cc.missing + cc.unexpected + cc.wrong_dtype + cc.wrong_shape > 0);
    printf("\nResult: %s\n", problems ? "PROBLEMS FOUND" : "OK");

    ds41_tensor_plan_free(&plan);
    ds41_checkpoint_close(ckpt);
    ds41_model_config_free(&cfg);
    return problems ? 1 : 0;
}
