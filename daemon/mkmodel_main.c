/* ds41-mkmodel: write a random-weight DeepSeek-V4.1 checkpoint in the Hugging
 * Face release layout (see engine/model/model_gen.h). */
#include "ds41_version.h"
#include "engine/model/model_gen.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41-mkmodel OUTDIR [--preset NAME] [--seed N] [--set key=value ...]\n"
            "                    [--tokenizer FILE] [--shard-bytes N] [--quiet]\n"
            "       ds41-mkmodel --version\n"
            "\n"
            "Writes a random-weight checkpoint of the DeepSeek-V4.1 architecture in the\n"
            "Hugging Face layout (safetensors shards + index, inference/config.json,\n"
            "config.json, tokenizer.json, tokenizer_config.json).\n"
            "\n"
            "  --preset NAME      tiny (default; every layer role, runs in seconds),\n"
            "                     long (window + index_topk > 64), bench (2-4 GB, release\n"
            "                     proportions), release-slice (the released layer\n"
            "                     dimensions in 4 layers, one per attention role;\n"
            "                     Engram tables scaled down; about 33 GB)\n"
            "  --seed N           weights and synthetic tokenizer seed (default 1)\n"
            "  --set key=value    override an inference/config.json key; value is JSON,\n"
            "                     e.g. --set n_routed_experts=256 --set kv_source_layers=[2,4]\n"
            "  --tokenizer FILE   use this tokenizer.json (and tokenizer_config.json beside\n"
            "                     it) instead of a synthetic one; vocab size and special\n"
            "                     ids follow it\n"
            "  --shard-bytes N    target shard size (default: automatic, >= 2 shards)\n"
            "  --quiet            no progress lines\n");
}

static void print_progress(void *ctx, const char *line) {
    (void)ctx;
    fprintf(stderr, "ds41-mkmodel: %s\n", line);
}

static int parse_u64(const char *s, uint64_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || s[0] == '-') return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"preset", required_argument, NULL, 'p'},
        {"seed", required_argument, NULL, 's'},
        {"set", required_argument, NULL, 'S'},
        {"tokenizer", required_argument, NULL, 't'},
        {"shard-bytes", required_argument, NULL, 'b'},
        {"quiet", no_argument, NULL, 'q'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    ds41_model_gen_opts o = {.preset = "tiny", .seed = 1, .progress = print_progress};
    const char **sets = calloc((size_t)argc, sizeof *sets);
    size_t n_sets = 0;
    int c;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (c) {
        case 'p': o.preset = optarg; break;
        case 's':
            if (parse_u64(optarg, &o.seed) != 0) {
                fprintf(stderr, "ds41-mkmodel: --seed '%s': expected a non-negative integer\n", optarg);
                return 2;
            }
            break;
        case 'S': sets[n_sets++] = optarg; break;
        case 't': o.tokenizer = optarg; break;
        case 'b':
            if (parse_u64(optarg, &o.shard_bytes) != 0 || o.shard_bytes == 0) {
                fprintf(stderr, "ds41-mkmodel: --shard-bytes '%s': expected a positive integer\n", optarg);
                return 2;
            }
            break;
        case 'q': o.progress = NULL; break;
        case 'h': usage(stdout); free(sets); return 0;
        case 'V':
            puts("ds41-mkmodel " DS41_VERSION);
            free(sets);
            return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind + 1 != argc) {
        usage(stderr);
        return 2;
    }
    o.sets = sets;
    o.n_sets = n_sets;
    ds41_error err;
    ds41_model_config cfg;
    if (ds41_model_generate(argv[optind], &o, &cfg, &err) != 0) {
        fprintf(stderr, "ds41-mkmodel: %s\n", err.msg);
        free(sets);
        return 1;
    }
    printf("%s: preset %s, seed %llu, %lld layers, dim %lld, vocab %lld\n", argv[optind], o.preset,
           (unsigned long long)o.seed, (long long)cfg.n_layers, (long long)cfg.dim, (long long)cfg.vocab_size);
    ds41_model_config_free(&cfg);
    free(sets);
    return 0;
}
