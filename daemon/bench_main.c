/* ds41-bench: throughput of the fast CPU path on a checkpoint, against the
 * machine's own limits measured in the same run.
 *
 * Figures (see usage()): prefill tokens/s and its FLOP/s as a fraction of the
 * FMA peak; decode tokens/s at batch 1, 4 and 16 with the weight bytes the
 * kernels touched per step (engine/backend.h counters: every expert the
 * batch routed to counted once, attention and dense weights, hc mixes, norm
 * weights, embedding and Engram rows, the head) and those bytes per second as
 * a fraction of the measured read bandwidth.  Timing starts after a warm-up
 * that has touched the weights (page faults of the mapping do not count). */
#include "config/daemon_config.h"
#include "engine/backend.h"
#include "engine/forward.h"
#include "engine/threadpool.h"

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void usage(FILE *f) {
    fprintf(f, "usage: ds41-bench --model DIR [--threads N] [--pin] [--json] [--cpu scalar|avx2|avx512|amx]\n"
               "                  [--prompt N] [--steps N] [--batches 1,4,16] [--bandwidth-gib G]\n"
               "                  [--engram-cache-bytes SIZE]\n"
               "\n"
               "Measures, with the fast CPU path:\n"
               "  machine   read bandwidth (every thread streaming its slice of a G GiB buffer,\n"
               "            default 4, far larger than the L3; 3 passes before and 3 after the\n"
               "            workload, the best kept) and FMA peak (likewise)\n"
               "  prefill   one prompt of N tokens (default 256) in one forward call, last-position\n"
               "            logits: tokens/s, GFLOP/s and the fraction of the FMA peak\n"
               "  decode    for each batch size B (default 1,4,16): B sequences with 32-token\n"
               "            prompts, then N greedy steps (default 8) of one token each, all B in\n"
               "            one forward call per step: tokens/s, weight bytes the kernels touched\n"
               "            per step, and those bytes per second as a fraction of the bandwidth\n"
               "  engram    with --engram-cache-bytes SIZE (bytes or 64MiB, 1.5GiB, ...) smaller than\n"
               "            the Engram tables, their rows are streamed from the checkpoint into a row\n"
               "            cache of that size (each greedy token's rows prefetched before its step);\n"
               "            per phase: hits, hit rate, bytes read per token, read bandwidth (bytes\n"
               "            from the device / phase time), row read latency p50/p99\n"
               "--threads N sets the thread pool's size (default one per CPU), --pin binds its\n"
               "threads to CPUs.  --json prints one JSON object instead of text.\n"
               "Exit status: 0 ok, 2 bad arguments or checkpoint, 1 other failures.\n");
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_size(const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-') return -1;
    *out = (size_t)v;
    return 0;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static int32_t random_id(int64_t vocab) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((rng_state >> 33) % (uint64_t)vocab);
}

/* The Engram row tier over one timed phase. */
typedef struct engram_phase {
    bool streamed;
    ds41_engram_cache_stats st;
    double hit_rate, bytes_read_per_token, read_gbs;
} engram_phase;

static void engram_phase_end(ds41_engine *e, size_t tokens, double seconds, engram_phase *out) {
    out->streamed = ds41_engine_engram_stats(e, &out->st);
    const ds41_engram_cache_stats *s = &out->st;
    out->hit_rate = s->uses ? (double)s->hits / (double)s->uses : 0;
    out->bytes_read_per_token = tokens ? (double)s->bytes_read / (double)tokens : 0;
    out->read_gbs = seconds > 0 ? (double)s->bytes_device / seconds / 1e9 : 0;
}

static void engram_phase_json(const engram_phase *p) {
    if (!p->streamed) return;
    const ds41_engram_cache_stats *s = &p->st;
    printf(",\"engram\":{\"uses\":%llu,\"hits\":%llu,\"misses\":%llu,\"hit_rate\":%.4f,\"prefetched_early\":%llu,"
           "\"waited\":%llu,\"bypass_reads\":%llu,\"rows_read\":%llu,\"bytes_read\":%llu,\"bytes_device\":%llu,"
           "\"bytes_read_per_token\":%.1f,\"read_bandwidth_gbs\":%.4f,\"latency_p50_us\":%.1f,"
           "\"latency_p99_us\":%.1f,\"gather_wait_seconds\":%.6f}",
           (unsigned long long)s->uses, (unsigned long long)s->hits, (unsigned long long)s->misses, p->hit_rate,
           (unsigned long long)s->prefetched_early, (unsigned long long)s->waited,
           (unsigned long long)s->bypass_reads, (unsigned long long)s->rows_read, (unsigned long long)s->bytes_read,
           (unsigned long long)s->bytes_device, p->bytes_read_per_token, p->read_gbs,
           (double)s->latency_p50_ns / 1e3, (double)s->latency_p99_ns / 1e3, (double)s->gather_wait_ns / 1e9);
}

static void engram_phase_text(const char *what, const engram_phase *p) {
    if (!p->streamed) return;
    const ds41_engram_cache_stats *s = &p->st;
    printf("  engram %-9s hit rate %.1f%% (%llu hits, %llu misses: %llu prefetched early, %llu waited), "
           "%.1f KB read/token, %.3f GB/s from the device, row read p50 %.0f us p99 %.0f us\n",
           what, 100 * p->hit_rate, (unsigned long long)s->hits, (unsigned long long)s->misses,
           (unsigned long long)s->prefetched_early, (unsigned long long)s->waited, p->bytes_read_per_token / 1e3,
           p->read_gbs, (double)s->latency_p50_ns / 1e3, (double)s->latency_p99_ns / 1e3);
}

typedef struct decode_result {
    size_t batch, steps;
    double seconds_per_step, tokens_per_s;
    double bytes_per_step, bytes_per_s, fraction;
    engram_phase eng;
} decode_result;

/* B sequences, 32-token prompts, one warm-up step, then `steps` timed steps. */
static int bench_decode(ds41_engine *e, ds41_backend *be, size_t B, size_t steps, double bw_gbs,
                        decode_result *r, ds41_error *err) {
    const ds41_model_config *c = ds41_engine_config(e);
    const size_t V = (size_t)c->vocab_size, P = 32;
    int rc = -1;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq **seqs = calloc(B, sizeof *seqs);
    ds41_fwd_item *items = calloc(B, sizeof *items);
    int32_t *prompt = malloc(B * P * sizeof *prompt), *tok = malloc(B * sizeof *tok);
    float *logits = malloc(B * V * sizeof *logits);
    if (!pool || !seqs || !items || !prompt || !tok || !logits) {
        if (pool) ds41_fail(err, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < B * P; i++) prompt[i] = random_id(c->vocab_size);
    for (size_t b = 0; b < B; b++) {
        if (!(seqs[b] = ds41_kv_seq_new(pool, err))) goto out;
        items[b] = (ds41_fwd_item){.seq = seqs[b],
                                   .ids = prompt + b * P,
                                   .n_ids = P,
                                   .logits = logits + b * V,
                                   .logits_last_only = true};
    }
    if (ds41_forward(e, items, B, NULL, err) != 0) goto out;
    ds41_backend_stats st;
    double t0 = 0;
    for (size_t s = 0; s <= steps; s++) {
        if (s == 1) {
            be->stats(be, &st, true);
            ds41_engine_engram_reset_stats(e);
            t0 = now();
        }
        for (size_t b = 0; b < B; b++) {
            tok[b] = ds41_argmax(logits + b * V, V);
            items[b].ids = &tok[b];
            items[b].n_ids = 1;
            if (ds41_engine_prefetch(e, seqs[b], tok[b], err) != 0) goto out;
        }
        if (ds41_forward(e, items, B, NULL, err) != 0) goto out;
    }
    const double t = now() - t0;
    be->stats(be, &st, true);
    engram_phase_end(e, B * steps, t, &r->eng);
    r->batch = B;
    r->steps = steps;
    r->seconds_per_step = t / (double)steps;
    r->tokens_per_s = (double)(B * steps) / t;
    r->bytes_per_step = (double)st.weight_bytes / (double)steps;
    r->bytes_per_s = (double)st.weight_bytes / t;
    r->fraction = bw_gbs > 0 ? r->bytes_per_s / (bw_gbs * 1e9) : 0;
    rc = 0;
out:
    if (seqs)
        for (size_t b = 0; b < B; b++) ds41_kv_seq_free(seqs[b]);
    ds41_kv_pool_free(pool);
    free(seqs);
    free(items);
    free(prompt);
    free(tok);
    free(logits);
    return rc;
}

typedef struct prefill_result {
    size_t tokens;
    double seconds, tokens_per_s, flops, gflops, fraction;
    engram_phase eng;
} prefill_result;

/* One untimed prefill (warm-up: touches the weights, faults the mapping),
 * then the timed one on a fresh sequence. */
static int bench_prefill(ds41_engine *e, ds41_backend *be, size_t P, double peak_gflops, prefill_result *r,
                         ds41_error *err) {
    const ds41_model_config *c = ds41_engine_config(e);
    const size_t V = (size_t)c->vocab_size;
    int rc = -1;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    int32_t *ids = malloc(P * sizeof *ids);
    float *logits = malloc(V * sizeof *logits);
    if (!pool || !ids || !logits) {
        if (pool) ds41_fail(err, "out of memory");
        goto out;
    }
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < P; i++) ids[i] = random_id(c->vocab_size);
        ds41_kv_seq *s = ds41_kv_seq_new(pool, err);
        if (!s) goto out;
        ds41_fwd_item it = {.seq = s, .ids = ids, .n_ids = P, .logits = logits, .logits_last_only = true};
        ds41_backend_stats st;
        be->stats(be, &st, true);
        ds41_engine_engram_reset_stats(e);
        const double t0 = now();
        const int frc = ds41_forward(e, &it, 1, NULL, err);
        const double t = now() - t0;
        be->stats(be, &st, true);
        engram_phase_end(e, P, t, &r->eng);
        ds41_kv_seq_free(s);
        if (frc != 0) goto out;
        r->tokens = P;
        r->seconds = t;
        r->tokens_per_s = (double)P / t;
        r->flops = (double)st.flops;
        r->gflops = (double)st.flops / t / 1e9;
        r->fraction = peak_gflops > 0 ? r->gflops / peak_gflops : 0;
    }
    rc = 0;
out:
    ds41_kv_pool_free(pool);
    free(ids);
    free(logits);
    return rc;
}

int main(int argc, char **argv) {
    static const struct option longopts[] = {
        {"model", required_argument, NULL, 'm'},
        {"threads", required_argument, NULL, 't'},
        {"json", no_argument, NULL, 'j'},
        {"cpu", required_argument, NULL, 'L'},
        {"prompt", required_argument, NULL, 'p'},
        {"steps", required_argument, NULL, 's'},
        {"batches", required_argument, NULL, 'b'},
        {"bandwidth-gib", required_argument, NULL, 'g'},
        {"pin", no_argument, NULL, 'P'},
        {"engram-cache-bytes", required_argument, NULL, 'E'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *model = NULL;
    size_t threads = 0, P = 256, steps = 8, gib = 4;
    size_t batches[16] = {1, 4, 16}, n_batches = 3;
    int json = 0;
    ds41_engine_opts eo = {.reference = false};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'm':
            model = optarg;
            break;
        case 't':
            if (parse_size(optarg, &threads) != 0 || threads == 0 || threads > DS41_THREADPOOL_MAX) {
                fprintf(stderr, "ds41-bench: --threads: expected an integer in [1, %d], got '%s'\n",
                        DS41_THREADPOOL_MAX, optarg);
                return 2;
            }
            eo.cpu.threads = (int)threads;
            break;
        case 'j':
            json = 1;
            break;
        case 'P':
            eo.cpu.pin = true;
            break;
        case 'E': {
            ds41_error serr = {{0}};
            if (ds41_size_parse(optarg, &eo.engram_cache_bytes, &serr) != 0) {
                fprintf(stderr, "ds41-bench: --engram-cache-bytes: %s\n", serr.msg);
                return 2;
            }
            break;
        }
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
                fprintf(stderr, "ds41-bench: --cpu: expected scalar, avx2, avx512 or amx, got '%s'\n",
                        optarg);
                return 2;
            }
            break;
        case 'p':
            if (parse_size(optarg, &P) != 0 || P == 0 || P > (1u << 20)) {
                fprintf(stderr, "ds41-bench: --prompt: expected an integer in [1, 1048576], got '%s'\n",
                        optarg);
                return 2;
            }
            break;
        case 's':
            if (parse_size(optarg, &steps) != 0 || steps == 0 || steps > 100000) {
                fprintf(stderr, "ds41-bench: --steps: expected an integer in [1, 100000], got '%s'\n",
                        optarg);
                return 2;
            }
            break;
        case 'g':
            if (parse_size(optarg, &gib) != 0 || gib == 0 || gib > 1024) {
                fprintf(stderr, "ds41-bench: --bandwidth-gib: expected an integer in [1, 1024], got '%s'\n",
                        optarg);
                return 2;
            }
            break;
        case 'b': {
            n_batches = 0;
            const char *p = optarg;
            for (;;) {
                char *end;
                errno = 0;
                unsigned long v = strtoul(p, &end, 10);
                if (errno || end == p || v == 0 || v > 4096 || (*end != ',' && *end) || n_batches == 16 ||
                    *p == '-') {
                    fprintf(stderr,
                            "ds41-bench: --batches: expected up to 16 comma-separated sizes in [1, 4096], "
                            "got '%s'\n",
                            optarg);
                    return 2;
                }
                batches[n_batches++] = v;
                if (!*end) break;
                p = end + 1;
            }
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind != argc || !model) {
        usage(stderr);
        return 2;
    }
    ds41_error err = {{0}};
    ds41_engine *e = ds41_engine_load(model, &eo, &err);
    if (!e) {
        fprintf(stderr, "ds41-bench: %s\n", err.msg);
        return 2;
    }
    ds41_backend *be = ds41_engine_backend(e);
    int status = 1;
    ds41_cpu_measure mach;
    prefill_result pre = {0};
    decode_result dec[16];
    /* Other work on the machine skews every figure: report the load. */
    double load[1] = {-1.0};
    if (getloadavg(load, 1) != 1) load[0] = -1.0;
    /* The machine's limits are measured before and after the workload and the
     * best of the two kept: on a shared machine one measurement can fall in a
     * busy moment and flatter the ratios (the best is the conservative
     * denominator). */
    ds41_cpu_measure mach2;
    if (ds41_backend_cpu_measure(be, (uint64_t)gib << 30, 3, &mach, &err) != 0) goto fail;
    if (!json)
        fprintf(stderr, "ds41-bench: %s, %d threads: read %.1f GB/s, FMA %.0f GFLOP/s\n", be->name,
                ds41_backend_threads(be), mach.read_gbs, mach.fma_gflops);
    if (bench_prefill(e, be, P, mach.fma_gflops, &pre, &err) != 0) goto fail;
    for (size_t i = 0; i < n_batches; i++)
        if (bench_decode(e, be, batches[i], steps, mach.read_gbs, &dec[i], &err) != 0) goto fail;
    if (ds41_backend_cpu_measure(be, (uint64_t)gib << 30, 3, &mach2, &err) != 0) goto fail;
    const double bw_first = mach.read_gbs, bw_second = mach2.read_gbs;
    if (mach2.read_gbs > mach.read_gbs) mach.read_gbs = mach2.read_gbs;
    if (mach2.fma_gflops > mach.fma_gflops) mach.fma_gflops = mach2.fma_gflops;
    mach.read_passes += mach2.read_passes;
    pre.fraction = mach.fma_gflops > 0 ? pre.gflops / mach.fma_gflops : 0;
    for (size_t i = 0; i < n_batches; i++) dec[i].fraction = dec[i].bytes_per_s / (mach.read_gbs * 1e9);

    if (json) {
        printf("{\"model\":\"");
        for (const char *p = model; *p; p++) {
            if (*p == '"' || *p == '\\')
                printf("\\%c", *p);
            else if ((unsigned char)*p < 0x20)
                printf("\\u%04x", *p);
            else
                putchar(*p);
        }
        printf("\",\"backend\":\"%s\",\"threads\":%d,\"load_average_1m\":%.2f,", be->name,
               ds41_backend_threads(be), load[0]);
        printf("\"machine\":{\"read_bandwidth_gbs\":%.3f,\"read_bandwidth_samples_gbs\":[%.3f,%.3f],"
               "\"read_buffer_bytes\":%llu,\"read_passes\":%d,"
               "\"fma_peak_gflops\":%.3f},",
               mach.read_gbs, bw_first, bw_second, (unsigned long long)mach.read_bytes, mach.read_passes,
               mach.fma_gflops);
        printf("\"prefill\":{\"tokens\":%zu,\"seconds\":%.6f,\"tokens_per_s\":%.3f,\"flops\":%.0f,\"gflops\":"
               "%.3f,"
               "\"fraction_of_fma_peak\":%.4f",
               pre.tokens, pre.seconds, pre.tokens_per_s, pre.flops, pre.gflops, pre.fraction);
        engram_phase_json(&pre.eng);
        printf("},");
        {
            ds41_engram_cache_stats es;
            const bool streamed = ds41_engine_engram_stats(e, &es);
            printf("\"engram_tier\":{\"streamed\":%s,\"budget_bytes\":%llu,\"capacity_rows\":%llu,\"row_bytes\":%llu,"
                   "\"reader\":\"%s\",\"direct\":%s",
                   streamed ? "true" : "false", (unsigned long long)eo.engram_cache_bytes,
                   (unsigned long long)es.capacity, (unsigned long long)es.row_bytes,
                   streamed ? ds41_reader_backend_name(ds41_engram_cache_reader(ds41_engine_engram_cache(e))) : "",
                   streamed && ds41_reader_file_direct(ds41_engram_cache_reader(ds41_engine_engram_cache(e)), 0)
                       ? "true"
                       : "false");
            printf("},");
        }
        printf("\"decode\":[");
        for (size_t i = 0; i < n_batches; i++) {
            printf(
                "%s{\"batch\":%zu,\"steps\":%zu,\"seconds_per_step\":%.6f,\"tokens_per_s\":%.3f,"
                "\"weight_bytes_per_step\":%.0f,\"weight_bytes_per_s\":%.0f,\"bound_seconds_per_step\":%.6f,"
                "\"fraction_of_bandwidth\":%.4f",
                i ? "," : "", dec[i].batch, dec[i].steps, dec[i].seconds_per_step, dec[i].tokens_per_s,
                dec[i].bytes_per_step, dec[i].bytes_per_s,
                mach.read_gbs > 0 ? dec[i].bytes_per_step / (mach.read_gbs * 1e9) : 0.0, dec[i].fraction);
            engram_phase_json(&dec[i].eng);
            printf("}");
        }
        printf("]}\n");
    } else {
        printf("model      %s\nbackend    %s, %d threads (load average %.2f at the start)\n", model, be->name,
               ds41_backend_threads(be), load[0]);
        printf("machine    read bandwidth %.2f GB/s (%.1f GiB buffer, best of %d passes: %.2f before the "
               "workload, "
               "%.2f after), FMA peak %.1f GFLOP/s\n",
               mach.read_gbs, (double)mach.read_bytes / (1u << 30), mach.read_passes, bw_first, bw_second,
               mach.fma_gflops);
        printf("prefill    %zu tokens in %.3f s: %.1f tokens/s, %.1f GFLOP/s = %.1f%% of the FMA peak\n",
               pre.tokens, pre.seconds, pre.tokens_per_s, pre.gflops, 100 * pre.fraction);
        {
            ds41_engram_cache_stats es;
            if (ds41_engine_engram_stats(e, &es)) {
                ds41_reader *rd = ds41_engram_cache_reader(ds41_engine_engram_cache(e));
                printf("engram     rows streamed: budget %llu bytes = %llu rows of %llu bytes, reader %s%s\n",
                       (unsigned long long)eo.engram_cache_bytes, (unsigned long long)es.capacity,
                       (unsigned long long)es.row_bytes, ds41_reader_backend_name(rd),
                       ds41_reader_file_direct(rd, 0) ? ", O_DIRECT" : ", buffered");
            } else {
                printf("engram     tables resident (mapped)\n");
            }
        }
        engram_phase_text("prefill", &pre.eng);
        for (size_t i = 0; i < n_batches; i++) {
            char what[32];
            snprintf(what, sizeof what, "B=%zu", dec[i].batch);
            engram_phase_text(what, &dec[i].eng);
        }
        for (size_t i = 0; i < n_batches; i++)
            printf("decode B=%-3zu %.2f tokens/s (%.1f ms/step), %.1f MB weights/step, %.2f GB/s = %.1f%% of "
                   "the "
                   "read bandwidth (bound %.1f ms/step)\n",
                   dec[i].batch, dec[i].tokens_per_s, 1e3 * dec[i].seconds_per_step,
                   dec[i].bytes_per_step / 1e6, dec[i].bytes_per_s / 1e9, 100 * dec[i].fraction,
                   mach.read_gbs > 0 ? 1e3 * dec[i].bytes_per_step / (mach.read_gbs * 1e9) : 0.0);
    }
    status = 0;
    goto done;
fail:
    fprintf(stderr, "ds41-bench: %s\n", err.msg);
done:
    ds41_engine_free(e);
    return status;
}
