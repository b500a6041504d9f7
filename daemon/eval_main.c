/* ds41-eval: run the forward pass on given token ids and write the logits
 * (prefill and greedy decode) as JSON, optionally with the per-layer streams
 * of REFERENCE.md §10.1.  This is the hook for reference comparisons
 * (tests/reference/ds41_ref.py has the same command line and must produce
 * the same bytes in the reference mode). */
#include "daemon/budget_flags.h"
#include "ds41_version.h"
#include "engine/forward.h"
#include "engine/threadpool.h"
#include "storage/safetensors.h"

#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: ds41-eval --model DIR --ids 0,17,42,... [--chunk N] [--decode K] [--reference]\n"
            "                 [--threads N] [--pin] [--cpu LEVEL] [--dump STREAMS.safetensors] --out FILE.json\n"
            "                 [--expert-cache-bytes SIZE] [--engram-cache-bytes SIZE] [--config ds41d.yaml]\n"
            "                 [--no-predict]\n"
            "       ds41-eval --version\n"
            "\n"
            "Feeds the ids as a prompt (in chunks of N tokens if --chunk is given), then\n"
            "K greedy steps (each feeds the argmax of the previous logits, lowest id on\n"
            "ties), and writes\n"
            "  {\"ids\":[...],\"prefill_logits\":[[vocab floats] per position],\n"
            "   \"greedy\":[{\"token\":t,\"logits\":[...]},...]}\n"
            "with every float as %%.9g of its float32 value.  The default is the fast CPU\n"
            "path (threads, SIMD; --threads N, default one per CPU, --pin binds them to CPUs;\n"
            "--cpu scalar|avx2|avx512|amx caps the SIMD level).  --reference selects the\n"
            "canonical arithmetic of the reference mode (engine/refmath.h; bit-exact against\n"
            "tests/reference/ds41_ref.py).\n"
            "--engram-cache-bytes SIZE (bytes, or with a unit: 64MiB, 1.5GiB, 2GB) streams the\n"
            "Engram table rows from the checkpoint into a row cache of that size (0 or a size\n"
            "covering the tables: resident); each greedy token's rows are prefetched before its\n"
            "step.  The logits are the same either way.\n"
            "--dump writes the section 10.1 stream dump.\n"
            "--expert-cache-bytes SIZE (e.g. 1GiB, as in ds41d.yaml) streams the routed experts\n"
            "through a slot pool of that size (io_uring, O_DIRECT) when they do not all fit;\n"
            "--config FILE takes memory.expert_cache_bytes and engram_cache_bytes from a ds41d\n"
            "YAML file (the flags win); --no-predict turns off expert prediction.\n"
            "A budget that is absent, \"auto\" (flag or YAML) or 0 in the YAML is sized from the\n"
            "memory the process may use (MemAvailable, cgroup limits): everything resident when\n"
            "it fits, else the Engram rows streamed first, then the experts (see ds41d.yaml(5)).\n"
            "The logits do not depend on the budgets.\n"
            "Exit status: 0 ok, 2 bad arguments or checkpoint, 1 other failures.\n");
}

/* ---- stream collection for --dump ---------------------------------------------- */

typedef struct part {
    size_t S;
    float *h;      /* [n_layers+1][S][hc*dim] */
    float *pre;    /* [n_layers][S][hc] */
    float *attn;   /* [n_layers][S][dim] */
    float *ffn;    /* [n_layers][S][dim] */
    float *logits; /* [S][vocab] */
} part;

typedef struct collector {
    const ds41_model_config *cfg;
    part *cur;
    size_t row_off; /* position of the current chunk's first row inside the part */
} collector;

static int part_alloc(part *p, const ds41_model_config *c, size_t S) {
    const size_t L = (size_t)c->n_layers, hc = (size_t)c->hc_mult, D = (size_t)c->dim, V = (size_t)c->vocab_size;
    p->S = S;
    p->h = calloc((L + 1) * S * hc * D, sizeof(float));
    p->pre = calloc(L * S * hc + 1, sizeof(float));
    p->attn = calloc(L * S * D + 1, sizeof(float));
    p->ffn = calloc(L * S * D + 1, sizeof(float));
    p->logits = calloc(S * V, sizeof(float));
    return p->h && p->pre && p->attn && p->ffn && p->logits ? 0 : -1;
}

static void part_free(part *p) {
    free(p->h);
    free(p->pre);
    free(p->attn);
    free(p->ffn);
    free(p->logits);
}

static void collect(void *ctx, ds41_stream_kind kind, int layer, size_t item, size_t row, const float *data,
                    size_t n) {
    collector *col = ctx;
    part *p = col->cur;
    (void)item;
    if (!p) return;
    const size_t s = col->row_off + row, S = p->S;
    float *dst = NULL;
    switch (kind) {
    case DS41_STREAM_H: dst = p->h + ((size_t)layer * S + s) * n; break;
    case DS41_STREAM_PRE: dst = p->pre + ((size_t)layer * S + s) * n; break;
    case DS41_STREAM_ATTN: dst = p->attn + ((size_t)layer * S + s) * n; break;
    case DS41_STREAM_FFN: dst = p->ffn + ((size_t)layer * S + s) * n; break;
    case DS41_STREAM_LOGITS: dst = p->logits + s * n; break;
    }
    memcpy(dst, data, n * sizeof *data);
}

/* Declare (write == 0) or write (write == 1) the tensors of one part. */
static int dump_part(ds41_st_writer *w, int write, const ds41_model_config *c, const char *name, const part *p,
                     ds41_error *err) {
    const int64_t L = c->n_layers, hc = c->hc_mult, D = c->dim, V = c->vocab_size, S = (int64_t)p->S;
    char key[128];
    for (int64_t l = 0; l <= L; l++) {
        snprintf(key, sizeof key, "%s.h.%lld", name, (long long)l);
        const int64_t shape[3] = {S, hc, D};
        const size_t nb = (size_t)(S * hc * D) * sizeof(float);
        if (write ? ds41_st_writer_write(w, key, p->h + (size_t)l * (size_t)(S * hc * D), nb, err)
                  : ds41_st_writer_declare(w, key, DS41_F32, 3, shape, err))
            return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        const int64_t sp[2] = {S, hc}, sd[2] = {S, D};
        snprintf(key, sizeof key, "%s.pre.%lld", name, (long long)l);
        if (write ? ds41_st_writer_write(w, key, p->pre + (size_t)(l * S * hc), (size_t)(S * hc) * sizeof(float), err)
                  : ds41_st_writer_declare(w, key, DS41_F32, 2, sp, err))
            return -1;
        snprintf(key, sizeof key, "%s.attn.%lld", name, (long long)l);
        if (write ? ds41_st_writer_write(w, key, p->attn + (size_t)(l * S * D), (size_t)(S * D) * sizeof(float), err)
                  : ds41_st_writer_declare(w, key, DS41_F32, 2, sd, err))
            return -1;
        snprintf(key, sizeof key, "%s.ffn.%lld", name, (long long)l);
        if (write ? ds41_st_writer_write(w, key, p->ffn + (size_t)(l * S * D), (size_t)(S * D) * sizeof(float), err)
                  : ds41_st_writer_declare(w, key, DS41_F32, 2, sd, err))
            return -1;
    }
    snprintf(key, sizeof key, "%s.logits", name);
    const int64_t sv[2] = {S, V};
    return write ? ds41_st_writer_write(w, key, p->logits, (size_t)(S * V) * sizeof(float), err)
                 : ds41_st_writer_declare(w, key, DS41_F32, 2, sv, err);
}

/* Write the dump to PATH: a single-file safetensors written in a temporary
 * directory beside PATH, then renamed into place. */
static int write_dump(const char *path, const ds41_model_config *c, const int64_t *ids, size_t S,
                      const int64_t *dec, size_t K, const part *parts, ds41_error *err) {
    char *pcopy = strdup(path);
    if (!pcopy) return ds41_fail(err, "out of memory");
    char tmpl[4096];
    snprintf(tmpl, sizeof tmpl, "%s/.ds41-dump-XXXXXX", dirname(pcopy));
    free(pcopy);
    if (!mkdtemp(tmpl)) return ds41_fail(err, "%s: cannot create a temporary directory: %s", path, strerror(errno));
    int rc = -1;
    ds41_st_writer *w = ds41_st_writer_new(tmpl, 0, err);
    if (!w || ds41_st_writer_single_file(w, err) != 0) goto out;
    const int64_t s_ids[1] = {(int64_t)S}, s_dec[1] = {(int64_t)K};
    char name[32];
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && ds41_st_writer_begin(w, err) != 0) goto out;
        if (pass == 0 ? ds41_st_writer_declare(w, "ids", DS41_I64, 1, s_ids, err)
                      : ds41_st_writer_write(w, "ids", ids, S * sizeof *ids, err))
            goto out;
        if (pass == 0 ? ds41_st_writer_declare(w, "decode_ids", DS41_I64, 1, s_dec, err)
                      : ds41_st_writer_write(w, "decode_ids", dec, K * sizeof *dec, err))
            goto out;
        for (size_t k = 0; k <= K; k++) {
            if (k == 0)
                snprintf(name, sizeof name, "prefill");
            else
                snprintf(name, sizeof name, "decode.%zu", k - 1);
            if (dump_part(w, pass, c, name, &parts[k], err) != 0) goto out;
        }
    }
    if (ds41_st_writer_finish(w, err) != 0) goto out;
    char file[4200];
    snprintf(file, sizeof file, "%s/%s", tmpl, DS41_ST_SINGLE_NAME);
    if (rename(file, path) != 0) {
        ds41_fail(err, "%s: cannot move the dump into place: %s", path, strerror(errno));
        unlink(file);
        goto out;
    }
    rc = 0;
out:
    ds41_st_writer_free(w);
    if (rc != 0) {
        snprintf(name, sizeof name, "%s", DS41_ST_SINGLE_NAME);
        char file2[4200];
        snprintf(file2, sizeof file2, "%s/%s", tmpl, name);
        unlink(file2);
    }
    rmdir(tmpl);
    return rc;
}

/* ---- JSON output ------------------------------------------------------------------- */

static void put_floats(FILE *f, const float *x, size_t n) {
    fputc('[', f);
    for (size_t i = 0; i < n; i++) fprintf(f, i ? ",%.9g" : "%.9g", (double)x[i]);
    fputc(']', f);
}

static int write_json(const char *path, const int32_t *ids, size_t S, const float *pre_logits, const int32_t *dec,
                      const float *dec_logits, size_t K, size_t V, ds41_error *err) {
    FILE *f = fopen(path, "w");
    if (!f) return ds41_fail(err, "%s: %s", path, strerror(errno));
    fputs("{\"ids\":[", f);
    for (size_t i = 0; i < S; i++) fprintf(f, i ? ",%d" : "%d", ids[i]);
    fputs("],\"prefill_logits\":[", f);
    for (size_t s = 0; s < S; s++) {
        if (s) fputc(',', f);
        put_floats(f, pre_logits + s * V, V);
    }
    fputs("],\"greedy\":[", f);
    for (size_t k = 0; k < K; k++) {
        fprintf(f, k ? ",{\"token\":%d,\"logits\":" : "{\"token\":%d,\"logits\":", dec[k]);
        put_floats(f, dec_logits + k * V, V);
        fputc('}', f);
    }
    fputs("]}\n", f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return ds41_fail(err, "%s: write error", path);
    return 0;
}

/* ---- main ---------------------------------------------------------------------------- */

static int parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-') return -1;
    *out = (size_t)v;
    return 0;
}

/* "0,17,42" -> ids; every entry a decimal integer in int32 range. */
static int parse_ids(const char *s, int32_t **ids, size_t *n) {
    size_t cap = 16, k = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return -1;
    const char *p = s;
    for (;;) {
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (errno || end == p || x < INT32_MIN || x > INT32_MAX || (*end != ',' && *end != 0)) {
            free(v);
            return -1;
        }
        if (k == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, cap * sizeof *nv);
            if (!nv) {
                free(v);
                return -1;
            }
            v = nv;
        }
        v[k++] = (int32_t)x;
        if (*end == 0) break;
        p = end + 1;
    }
    *ids = v;
    *n = k;
    return 0;
}

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"model", required_argument, NULL, 'm'},
        {"ids", required_argument, NULL, 'i'},
        {"chunk", required_argument, NULL, 'c'},
        {"decode", required_argument, NULL, 'k'},
        {"reference", no_argument, NULL, 'r'},
        {"dump", required_argument, NULL, 'd'},
        {"out", required_argument, NULL, 'o'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {"threads", required_argument, NULL, 't'},
        {"cpu", required_argument, NULL, 'L'},
        {"pin", no_argument, NULL, 'P'},
        {"no-predict", no_argument, NULL, 'N'},
        DS41_BUDGET_LONGOPTS,
        {NULL, 0, NULL, 0},
    };
    const char *model = NULL, *ids_arg = NULL, *dump = NULL, *out = NULL;
    size_t chunk = 0, K = 0;
    ds41_engine_opts eo = {.reference = false};
    ds41_budget_flags budgets = {.tool = "ds41-eval"};
    size_t threads = 0;
    int c;
    while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int used = ds41_budget_flags_option(&budgets, c, optarg);
        if (used < 0) return 2;
        if (used) continue;
        switch (c) {
        case 'm': model = optarg; break;
        case 'i': ids_arg = optarg; break;
        case 'c':
            if (parse_size(optarg, &chunk) != 0 || chunk == 0) {
                fprintf(stderr, "ds41-eval: --chunk: expected a positive integer, got '%s'\n", optarg);
                return 2;
            }
            break;
        case 'k':
            if (parse_size(optarg, &K) != 0) {
                fprintf(stderr, "ds41-eval: --decode: expected a non-negative integer, got '%s'\n", optarg);
                return 2;
            }
            break;
        case 'r': eo.reference = true; break;
        case 'P': eo.cpu.pin = true; break;
        case 'N': eo.expert_no_predict = true; break;
        case 't':
            if (parse_size(optarg, &threads) != 0 || threads == 0 || threads > DS41_THREADPOOL_MAX) {
                fprintf(stderr, "ds41-eval: --threads: expected an integer in [1, %d], got '%s'\n",
                        DS41_THREADPOOL_MAX, optarg);
                return 2;
            }
            eo.cpu.threads = (int)threads;
            break;
        case 'L':
            if (strcmp(optarg, "scalar") == 0)
                eo.cpu.level = DS41_CPU_SCALAR;
            else if (strcmp(optarg, "avx2") == 0)
                eo.cpu.level = DS41_CPU_AVX2;
            else if (strcmp(optarg, "avx512") == 0)
                eo.cpu.level = DS41_CPU_AVX512;
            else if (strcmp(optarg, "amx") == 0)
                eo.cpu.level = DS41_CPU_AMX;
            else {
                fprintf(stderr, "ds41-eval: --cpu: expected scalar, avx2, avx512 or amx, got '%s'\n", optarg);
                return 2;
            }
            break;
        case 'd': dump = optarg; break;
        case 'o': out = optarg; break;
        case 'h': usage(stdout); return 0;
        case 'V':
            puts("ds41-eval " DS41_VERSION);
            return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc || !model || !ids_arg || !out) {
        usage(stderr);
        return 2;
    }
    int32_t *ids = NULL;
    size_t S = 0;
    if (parse_ids(ids_arg, &ids, &S) != 0 || S == 0) {
        fprintf(stderr, "ds41-eval: --ids: expected comma-separated integers, got '%s'\n", ids_arg);
        return 2;
    }
    if (chunk == 0 || chunk > S) chunk = S;
    /* Keep every buffer size computable: (S + K) * vocab floats and the
     * dump's (layers + 1) * S * hc * dim floats are checked below. */
    if (S > ((size_t)1 << 24) || K > ((size_t)1 << 20)) {
        fprintf(stderr, "ds41-eval: at most %zu prompt ids and %zu decode steps\n", (size_t)1 << 24,
                (size_t)1 << 20);
        free(ids);
        return 2;
    }

    ds41_error err = {{0}};
    int status = 1;
    ds41_kv_pool *pool = NULL;
    ds41_kv_seq *seq = NULL;
    float *pre_logits = NULL, *dec_logits = NULL;
    int32_t *dec = NULL;
    part *parts = NULL;
    /* Budgets: the flags, else --config's memory.*_cache_bytes, else auto. */
    ds41_budget_run run = {.kv_tokens = (uint64_t)S + K, .batch = 1};
    if (ds41_budget_flags_apply(&budgets, model, &run, &eo, NULL, 0) != 0) {
        free(ids);
        return 2;
    }
    ds41_engine *e = ds41_engine_load(model, &eo, &err);
    if (!e) {
        fprintf(stderr, "ds41-eval: %s\n", err.msg);
        free(ids);
        return 2;
    }
    const ds41_model_config *cfg = ds41_engine_config(e);
    const size_t V = (size_t)cfg->vocab_size;
    for (size_t i = 0; i < S; i++)
        if (ids[i] < 0 || (int64_t)ids[i] >= cfg->vocab_size) {
            fprintf(stderr, "ds41-eval: --ids: id %d at index %zu is outside [0, %zu)\n", ids[i], i, V);
            status = 2;
            goto done;
        }
    {
        size_t rows = S + K, bytes;
        const size_t per_row = (size_t)(cfg->n_layers + 1) * (size_t)cfg->hc_mult * (size_t)cfg->dim + V;
        if (__builtin_mul_overflow(rows, per_row, &bytes) || __builtin_mul_overflow(bytes, sizeof(float), &bytes)) {
            fprintf(stderr, "ds41-eval: %zu positions do not fit in memory for this model\n", rows);
            status = 2;
            goto done;
        }
    }
    pool = ds41_engine_new_pool(e, 0, 0, &err);
    seq = pool ? ds41_kv_seq_new(pool, &err) : NULL;
    pre_logits = malloc(S * V * sizeof *pre_logits);
    dec_logits = malloc((K ? K : 1) * V * sizeof *dec_logits);
    dec = malloc((K ? K : 1) * sizeof *dec);
    if (!seq || !pre_logits || !dec_logits || !dec) {
        if (!err.msg[0]) ds41_fail(&err, "out of memory");
        goto fail;
    }
    collector col = {.cfg = cfg};
    ds41_fwd_hooks hooks = {.stream = collect, .ctx = &col};
    if (dump) {
        parts = calloc(K + 1, sizeof *parts);
        if (!parts) goto oom;
        if (part_alloc(&parts[0], cfg, S) != 0) goto oom;
        for (size_t k = 1; k <= K; k++)
            if (part_alloc(&parts[k], cfg, 1) != 0) goto oom;
    }

    for (size_t off = 0; off < S; off += chunk) {
        ds41_fwd_item item = {.seq = seq, .ids = ids + off, .n_ids = S - off < chunk ? S - off : chunk,
                              .logits = pre_logits + off * V};
        col.cur = dump ? &parts[0] : NULL;
        col.row_off = off;
        if (ds41_forward(e, &item, 1, dump ? &hooks : NULL, &err) != 0) goto fail;
    }
    const float *last = pre_logits + (S - 1) * V;
    for (size_t k = 0; k < K; k++) {
        dec[k] = ds41_argmax(last, V);
        if (ds41_engine_prefetch(e, seq, dec[k], &err) != 0) goto fail;
        ds41_fwd_item item = {.seq = seq, .ids = &dec[k], .n_ids = 1, .logits = dec_logits + k * V};
        col.cur = dump ? &parts[k + 1] : NULL;
        col.row_off = 0;
        if (ds41_forward(e, &item, 1, dump ? &hooks : NULL, &err) != 0) goto fail;
        last = dec_logits + k * V;
    }
    if (write_json(out, ids, S, pre_logits, dec, dec_logits, K, V, &err) != 0) goto fail;
    if (dump) {
        int64_t *ids64 = malloc(S * sizeof *ids64), *dec64 = malloc((K ? K : 1) * sizeof *dec64);
        if (!ids64 || !dec64) {
            free(ids64);
            free(dec64);
            goto oom;
        }
        for (size_t i = 0; i < S; i++) ids64[i] = ids[i];
        for (size_t k = 0; k < K; k++) dec64[k] = dec[k];
        int rc = write_dump(dump, cfg, ids64, S, dec64, K, parts, &err);
        free(ids64);
        free(dec64);
        if (rc != 0) goto fail;
    }
    status = 0;
    goto done;
oom:
    ds41_fail(&err, "out of memory");
fail:
    fprintf(stderr, "ds41-eval: %s\n", err.msg);
    status = 1;
done:
    if (parts)
        for (size_t k = 0; k <= K; k++) part_free(&parts[k]);
    free(parts);
    free(pre_logits);
    free(dec_logits);
    free(dec);
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    ds41_engine_free(e);
    free(ids);
    return status;
}
