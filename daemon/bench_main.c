/* ds41-bench: throughput of the fast CPU path on a checkpoint, against the
 * machine's own limits measured in the same run.
 *
 * Figures (see usage()): prefill tokens/s and its FLOP/s as a fraction of the
 * FMA peak; decode tokens/s at batch 1, 4 and 16 with the weight bytes the
 * kernels touched per step (engine/backend/backend.h counters: every expert the
 * batch routed to counted once, attention and dense weights, hc mixes, norm
 * weights, embedding and Engram rows, the head) and those bytes per second as
 * a fraction of the measured read bandwidth.  Timing starts after a warm-up
 * that has touched the weights (page faults of the mapping do not count). */
#include "cuda/cuda_backend.h"
#include "cuda/gpu_measure.h"
#include "daemon/backend_flag.h"
#include "daemon/bench_kernels.h"
#include "daemon/bench_ops.h"
#include "daemon/budget_flags.h"
#include "ds41_version.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/forward/forward.h"
#include "engine/backend/cpu/threadpool.h"
#include "engine/serve/speculative.h"
#include "storage/expert_cache.h"
#include "storage/safetensors.h"

#include <errno.h>
#include <inttypes.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

static void usage(FILE *f) {
    fprintf(f, "usage: ds41-bench --model DIR [--threads N] [--pin] [--json] [--cpu scalar|avx2|avx512|amx]\n"
               "                  [--prompt N] [--steps N] [--batches 1,4,16] [--bandwidth-gib G]\n"
               "                  [--expert-cache-bytes SIZE] [--engram-cache-bytes SIZE]\n"
               "                  [--config ds41d.yaml] [--no-predict] [--predict early|next|both]\n"
               "                  [--predict-extra N] [--ops] [--backend KIND]\n"
               "                  [--host-expert-cache-bytes SIZE]\n"
               "       ds41-bench --model DIR --speculative N [--batches 1,4] [--steps T] [--json] ...\n"
               "       ds41-bench --kernels [--threads N] [--pin] [--json] [--cpu LEVEL] [--bandwidth-gib G]\n"
               "       ds41-bench --version\n"
               "\n"
               "Measures, with the backend --backend KIND names: auto (the GPU when one is usable,\n"
               "else the fast CPU path; the default), cpu, cuda (an error without a usable GPU) or\n"
               "cuda-emu (test mode: the CUDA kernels emulated on the host).  On the CUDA backend the\n"
               "machine figures are the device's: memory bandwidth (2 x a 1 GiB device copy / time,\n"
               "best of 3) and host-to-device copy bandwidth from pinned memory; no FLOP peak is\n"
               "measured there (prefill fractions 0).  --kernels always measures the CPU kernels.\n"
               "The figures:\n"
               "  machine   read bandwidth (every thread streaming its slice of a G GiB buffer,\n"
               "            default 4, far larger than the L3; 3 passes before and 3 after the\n"
               "            workload, the best kept) and FMA peak (likewise)\n"
               "  prefill   one prompt of N tokens (default 256) in one forward call, last-position\n"
               "            logits: tokens/s, GFLOP/s and the fraction of the FMA peak\n"
               "  decode    for each batch size B (default 1,4,16): B sequences with 32-token\n"
               "            prompts, then N greedy steps (default 8) of one token each, all B in\n"
               "            one forward call per step: tokens/s, weight bytes the kernels touched\n"
               "            per step, and those bytes per second as a fraction of the bandwidth\n"
               "  experts   with --expert-cache-bytes SIZE (or memory.expert_cache_bytes of --config\n"
               "            FILE) below the routed experts' total, they are streamed from the shards\n"
               "            through a slot pool of that size; the page cache is dropped first when\n"
               "            permitted, the device's own O_DIRECT read bandwidth is probed on the\n"
               "            largest shard before and after the workload (best kept), and each phase\n"
               "            prints the tier's uses, hits (+ predicted in time), hit rate, misses,\n"
               "            bytes read per token, achieved read bandwidth and its ratio to the\n"
               "            device's, load latency p50/p99, prediction accuracy (--no-predict turns\n"
               "            prediction off; --predict early: each layer's experts are predicted\n"
               "            before its attention (the default), next: a layer ahead from the\n"
"            previous layer's FFN input, both; --predict-extra N: N more candidates\n"
               "            per token beyond the router's top k) and /proc/self/io read_bytes\n"
               "  engram    with --engram-cache-bytes SIZE (or memory.engram_cache_bytes of --config) below\n"
               "            the Engram tables, their rows are streamed from the checkpoint into a row\n"
               "            cache of that size (each greedy token's rows prefetched before its step);\n"
               "            per phase: hits, hit rate, bytes read per token, read bandwidth (bytes\n"
               "            from the device / phase time), row read latency p50/p99\n"
               "  kernels   (--kernels, no checkpoint) the linear kernel's ceilings: weight bytes per\n"
               "            second it consumes per format (FP4 experts 6 x 512x2048, FP8 2048x2048,\n"
               "            bf16 8192x2048) for 1, 4 and 16 rows, weights in cache and from memory\n"
               "            (a set of --bandwidth-gib G GiB, default 2), next to the read bandwidth\n"
               "  ops       (--ops) per-layer time split by op for the prefill and each decode batch:\n"
               "            every op call of the backend timed and charged to its block's attention\n"
               "            or FFN part (linears split by format, a MoE layer's experts as one op),\n"
               "            the head, and the time between ops\n"
               "  speculative (--speculative N, instead of the figures above) for each batch size B\n"
               "            (default 1,4): B sequences with 32-token prompts generate T greedy tokens\n"
               "            each (--steps, here default 30), plainly (tokens/s, time per step), then\n"
               "            speculatively for k = 1..N with drafts equal to the plain continuation (the\n"
               "            test oracle: full acceptance; the tokens are checked to be the plain ones):\n"
               "            tokens/s, time per verification step (a token and k drafts per sequence)\n"
               "            and its cost relative to a plain step.  From those, tokens/s for a mean\n"
               "            accepted length a is about B * (1 + a) / (cost_k * plain step time).  The\n"
               "            model's DSpark head (if it has one, k = min(N, dspark_block_size), back-off\n"
               "            as in the daemon) last, over max(T, 256) tokens per sequence: tokens/s\n"
               "            against a plain run of that length, drafts accepted per block\n"
               "A budget that is absent, \"auto\" (flag or YAML) or 0 in the YAML is sized from the\n"
               "memory the process may use (MemAvailable, cgroup limits; see ds41d.yaml(5)).\n"
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

/* ---- the routed-expert tier's figures over a timed phase ---- */

typedef struct tier_result {
    bool streamed;
    ds41_expert_cache_stats st;
    uint64_t io_read_bytes; /* /proc/self/io read_bytes over the phase */
    double seconds, tokens;
} tier_result;

/* read_bytes of /proc/self/io (bytes this process caused to be fetched
 * from storage), or UINT64_MAX when unavailable. */
static uint64_t proc_read_bytes(void) {
    FILE *f = fopen("/proc/self/io", "r");
    if (!f) return UINT64_MAX;
    char line[128];
    uint64_t v = UINT64_MAX;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "read_bytes:", 11) == 0) v = strtoull(line + 11, NULL, 10);
    fclose(f);
    return v;
}

static uint64_t tier_io0;
static void tier_begin(ds41_engine *e) {
    ds41_expert_cache_stats st;
    ds41_engine_expert_stats(e, &st, true);
    tier_io0 = proc_read_bytes();
}

static void tier_end(ds41_engine *e, double seconds, double tokens, tier_result *t) {
    const uint64_t io = proc_read_bytes();
    t->streamed = ds41_engine_expert_stats(e, &t->st, true);
    t->io_read_bytes = io != UINT64_MAX && tier_io0 != UINT64_MAX ? io - tier_io0 : 0;
    t->seconds = seconds;
    t->tokens = tokens;
}

static double ratio(double a, double b) {
    return b > 0 ? a / b : 0.0;
}

static void tier_text(const char *phase, size_t batch, const tier_result *t, double dev_bps) {
    const ds41_expert_cache_stats *s = &t->st;
    char name[32];
    if (batch)
        snprintf(name, sizeof name, "%s B=%zu", phase, batch);
    else
        snprintf(name, sizeof name, "%s", phase);
    const double bw = ratio((double)s->bytes_read, t->seconds);
    printf("tier %-11s %" PRIu64 " expert uses: %" PRIu64 " hits + %" PRIu64 " predicted (%" PRIu64 " of them still in flight) = %.1f%% hit rate, %" PRIu64
           " misses, %" PRIu64 " waves; %.2f MB read/token; %.3f GB/s achieved = %.1f%% of the device (used: %.2f "
           "MB/token, %.3f GB/s = %.1f%%); stalled %.0f%% of the time; load p50 %.2f ms p99 %.2f ms; prediction accuracy %.1f%% (%" PRIu64 "/%" PRIu64
           ", %" PRIu64 " skipped); /proc/self/io read_bytes %.1f MB (tier read %.1f MB)\n",
           name, s->requests, s->hits, s->prefetch_hits, s->prefetch_inflight,
           100 * ratio((double)(s->hits + s->prefetch_hits), (double)s->requests), s->misses, s->waves,
           ratio((double)s->bytes_read, t->tokens) / 1e6, bw / 1e9, 100 * ratio(bw, dev_bps),
           ratio((double)s->bytes_used, t->tokens) / 1e6, ratio((double)s->bytes_used, t->seconds) / 1e9,
           100 * ratio(ratio((double)s->bytes_used, t->seconds), dev_bps), 100 * ratio((double)s->stall_ns * 1e-9, t->seconds), (double)s->latency_p50_ns / 1e6,
           (double)s->latency_p99_ns / 1e6, 100 * ratio((double)s->predicted_used, (double)s->predicted),
           s->predicted_used, s->predicted, s->predict_skipped, (double)t->io_read_bytes / 1e6,
           (double)s->bytes_read / 1e6);
}

static void tier_json(const char *phase, size_t batch, const tier_result *t, double dev_bps, bool first) {
    const ds41_expert_cache_stats *s = &t->st;
    const double bw = ratio((double)s->bytes_read, t->seconds);
    printf("%s{\"phase\":\"%s\",\"batch\":%zu,\"seconds\":%.6f,\"tokens\":%.0f,\"uses\":%" PRIu64
           ",\"hits\":%" PRIu64 ",\"prefetch_hits\":%" PRIu64 ",\"prefetch_inflight\":%" PRIu64 ",\"misses\":%" PRIu64 ",\"waves\":%" PRIu64
           ",\"hit_rate\":%.4f,\"bytes_read\":%" PRIu64 ",\"bytes_read_per_token\":%.0f,"
           "\"achieved_read_bps\":%.0f,\"fraction_of_device\":%.4f,\"bytes_used\":%" PRIu64
           ",\"used_read_bps\":%.0f,\"used_fraction_of_device\":%.4f,\"stall_seconds\":%.6f,"
           "\"latency_p50_ns\":%" PRIu64 ",\"latency_p99_ns\":%" PRIu64 ",\"predicted\":%" PRIu64
           ",\"predicted_used\":%" PRIu64 ",\"prediction_accuracy\":%.4f,\"proc_io_read_bytes\":%" PRIu64 "}",
           first ? "" : ",", phase, batch, t->seconds, t->tokens, s->requests, s->hits, s->prefetch_hits,
           s->prefetch_inflight, s->misses,
           s->waves, ratio((double)(s->hits + s->prefetch_hits), (double)s->requests), s->bytes_read,
           ratio((double)s->bytes_read, t->tokens), bw, ratio(bw, dev_bps), s->bytes_used,
           ratio((double)s->bytes_used, t->seconds), ratio(ratio((double)s->bytes_used, t->seconds), dev_bps),
           (double)s->stall_ns * 1e-9,
           s->latency_p50_ns, s->latency_p99_ns, s->predicted_used, s->predicted,
           ratio((double)s->predicted_used, (double)s->predicted), t->io_read_bytes);
}

/* The tier's own read rate in the engine's access pattern, without the
 * compute: a second expert cache of the same budget over the same shards
 * (opened again), `steps` decode-like steps of B=1 (each text layer asks for
 * n_active random distinct experts, uniform as random weights route), each
 * layer's request acquired in one submission, waited for and released.  With
 * `predict` the next layer's set is submitted right after the layer's own
 * request, as the engine does while a layer computes (here a perfect
 * prediction: this measures the pipeline, not the predictor).  Gives bytes
 * read per second of wall time and the hit rate. */
static int tier_ceiling(const char *model, uint64_t budget, bool predict, int steps, double *bps, double *hit_rate,
                        ds41_error *err) {
    int rc = -1;
    ds41_model_config cfg;
    memset(&cfg, 0, sizeof cfg);
    ds41_checkpoint *ck = NULL;
    ds41_expert_cache *xc = NULL;
    int32_t *sets = NULL;
    if (ds41_model_config_load(model, &cfg, err) != 0) return -1;
    if (!(ck = ds41_checkpoint_open(model, err))) goto out;
    ds41_expert_cache_opts o = {.budget_bytes = budget};
    if (!(xc = ds41_expert_cache_new(ck, &cfg, &o, err))) goto out;
    const int L = (int)cfg.n_layers;
    int k = 0;
    for (int l = 0; l < L; l++)
        if (cfg.roles[l].present && (int)cfg.roles[l].n_active_experts > k) k = (int)cfg.roles[l].n_active_experts;
    if (k == 0) {
        ds41_fail(err, "tier ceiling: no routed experts");
        goto out;
    }
    /* Every (step, layer)'s set, drawn up front (sorted, distinct). */
    sets = malloc((size_t)steps * (size_t)L * (size_t)k * sizeof *sets);
    if (!sets) {
        ds41_fail(err, "out of memory");
        goto out;
    }
    for (int st = 0; st < steps; st++)
        for (int l = 0; l < L; l++) {
            int32_t *v = sets + ((size_t)st * (size_t)L + (size_t)l) * (size_t)k;
            const int64_t E = cfg.roles[l].n_experts;
            for (int j = 0; j < k; j++) {
                int32_t x;
                bool dup;
                do {
                    x = random_id(E);
                    dup = false;
                    for (int q = 0; q < j; q++) dup = dup || v[q] == x;
                } while (dup);
                int q = j;
                while (q > 0 && v[q - 1] > x) v[q] = v[q - 1], q--;
                v[q] = x;
            }
        }
    uint8_t got[64];
    ds41_expert_view views[64];
    if (k > 64) {
        ds41_fail(err, "tier ceiling: more than 64 active experts");
        goto out;
    }
    ds41_expert_cache_stats st;
    ds41_expert_cache_get_stats(xc, &st, true);
    const double t0 = now();
    for (int s2 = 0; s2 < steps; s2++)
        for (int l = 0; l < L; l++) {
            if (!cfg.roles[l].present || cfg.roles[l].n_experts <= 0) continue;
            const int32_t *v = sets + ((size_t)s2 * (size_t)L + (size_t)l) * (size_t)k;
            if (ds41_expert_cache_acquire(xc, l, v, (size_t)k, got, err) < 0) goto out;
            if (predict) {
                const int nl = l + 1 < L ? l + 1 : 0, ns = l + 1 < L ? s2 : s2 + 1;
                if (ns < steps && cfg.roles[nl].present && cfg.roles[nl].n_experts > 0)
                    ds41_expert_cache_predict(xc, nl, sets + ((size_t)ns * (size_t)L + (size_t)nl) * (size_t)k,
                                              (size_t)k);
            }
            const int wrc = ds41_expert_cache_wait(xc, l, v, (size_t)k, got, views, err);
            ds41_expert_cache_release(xc, l, v, (size_t)k, got);
            if (wrc != 0) goto out;
            if (l + 1 == L && !predict) ds41_expert_cache_end_step(xc);
        }
    const double t = now() - t0;
    ds41_expert_cache_get_stats(xc, &st, false);
    *bps = (double)st.bytes_read / t;
    *hit_rate = st.requests ? (double)(st.hits + st.prefetch_hits) / (double)st.requests : 0.0;
    rc = 0;
out:
    free(sets);
    ds41_expert_cache_free(xc);
    ds41_checkpoint_close(ck);
    ds41_model_config_free(&cfg);
    return rc;
}

/* Pages of the checkpoint mapping that hold only routed-expert bytes of the
 * text layers, and how many of them are in the page cache (mincore): with
 * the experts streamed through O_DIRECT after a dropped page cache this
 * stays near 0, showing the experts came from the device, not the mapping. */
static void expert_pages_resident(const ds41_engine *e, uint64_t *resident, uint64_t *pages) {
    size_t n = 0;
    ds41_page_range *r = ds41_engine_expert_only_pages(e, &n);
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    *pages = 0;
    for (size_t i = 0; i < n; i++) *pages += (r[i].end - r[i].start) / pg;
    *resident = ds41_page_ranges_resident(r, n);
    free(r);
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

/* --ops: the op profile (NULL without --ops), snapshotted per timed phase. */
static ds41_op_profile *g_prof;

static ds41_op_profile *prof_snapshot(void) {
    return g_prof ? ds41_op_profile_snapshot(g_prof) : NULL;
}

typedef struct decode_result {
    ds41_op_profile *ops;
    size_t batch, steps;
    double seconds_per_step, tokens_per_s;
    double bytes_per_step, bytes_per_s, fraction;
    tier_result tier;
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
            tier_begin(e);
            ds41_engine_engram_reset_stats(e);
            if (g_prof) ds41_op_profile_reset(g_prof);
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
    r->ops = prof_snapshot();
    be->stats(be, &st, true);
    tier_end(e, t, (double)(B * steps), &r->tier);
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
    ds41_op_profile *ops;
    size_t tokens;
    double seconds, tokens_per_s, flops, gflops, fraction;
    tier_result tier;
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
        tier_begin(e);
        ds41_engine_engram_reset_stats(e);
        if (g_prof) ds41_op_profile_reset(g_prof);
        const double t0 = now();
        const int frc = ds41_forward(e, &it, 1, NULL, err);
        const double t = now() - t0;
        if (pass == 1) r->ops = prof_snapshot();
        be->stats(be, &st, true);
        tier_end(e, t, (double)P, &r->tier);
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

/* --kernels: machine figures, then the kernel ceilings (bench_kernels.h). */
/* ---- --speculative ----------------------------------------------------------------------- */

typedef struct spec_result {
    size_t batch, tokens;
    double plain_tps, plain_step_s;
    double tps[DS41_SPEC_MAX_K + 1], step_s[DS41_SPEC_MAX_K + 1], mean_accepted[DS41_SPEC_MAX_K + 1];
    /* the model's DSpark head (k = min(N, dspark_block_size), back-off as the daemon's) */
    bool head;
    uint32_t head_k;
    size_t head_tokens;
    double head_plain_tps, head_tps, head_step_s, head_mean_accepted, head_draft_rate;
} spec_result;

/* Tokens per sequence of the head's runs at least. */
#define HEAD_TOKENS 256

/* B sequences, T greedy tokens each: k = 0 plainly (recording the continuations into ref), else
 * with drafts from the oracle over ref, or with head (non-NULL) from the model's DSpark head
 * (every item fed with its taps; a sequence whose block had no accepted draft backs off as in
 * the daemon, up to DS41_SPEC_MAX_BACKOFF steps); the tokens are checked against ref.  *draft_rate = the share of
 * steps that drafted. */
static int spec_run(ds41_engine *e, size_t B, size_t T, uint32_t k, const ds41_draft_provider *head,
                    const int32_t *prompt, size_t P, int32_t *ref, double *tps, double *step_s, double *mean_acc,
                    double *draft_rate, ds41_error *err) {
    const size_t V = (size_t)ds41_engine_config(e)->vocab_size, R = 1 + DS41_SPEC_MAX_K;
    int rc = -1;
    ds41_kv_pool *pool = ds41_engine_new_pool(e, 0, 0, err);
    ds41_kv_seq **seqs = calloc(B, sizeof *seqs);
    ds41_fwd_item *items = calloc(B, sizeof *items);
    float *logits = malloc(B * R * V * sizeof *logits);
    int32_t *feed = malloc(B * R * sizeof *feed);
    size_t *done = calloc(B, sizeof *done);
    ds41_oracle *o = k && !head ? ds41_oracle_new((uint32_t)V, err) : NULL;
    ds41_spec_seq *ss = calloc(B, sizeof *ss);
    uint64_t steps = 0, drafted = 0, accepted = 0, seq_steps = 0, blocks = 0;
    if (!pool || !seqs || !items || !logits || !feed || !done || !ss || (k && !head && !o)) {
        if (pool) ds41_fail(err, "out of memory");
        goto out;
    }
    for (size_t b = 0; b < B && o; b++)
        if (ds41_oracle_add(o, ref + b * (P + T), P + T, err) != 0) goto out;
    ds41_draft_provider prov = head ? *head : k ? ds41_oracle_provider(o) : (ds41_draft_provider){0};
    for (size_t b = 0; b < B; b++) {
        ss[b].max_backoff_cap = DS41_SPEC_MAX_BACKOFF;
        if (!(seqs[b] = ds41_kv_seq_new(pool, err))) goto out;
        items[b] = (ds41_fwd_item){.seq = seqs[b], .ids = prompt + b * P, .n_ids = P, .logits = logits + b * R * V,
                                   .logits_last_only = true, .spec_taps = prov.taps};
        if (!k) memcpy(ref + b * (P + T), prompt + b * P, P * sizeof *ref);
    }
    if (ds41_forward(e, items, B, NULL, err) != 0) goto out;
    /* each sequence's last logits row (row 0 after the prefill) */
    size_t *last = calloc(B, sizeof *last);
    if (!last) goto out;
    const double t0 = now();
    for (;;) {
        size_t n = 0;
        for (size_t b = 0; b < B; b++) {
            if (done[b] >= T) continue;
            int32_t t = ds41_argmax(logits + (b * R + last[b]) * V, V);
            if (k && t != ref[b * (P + T) + P + done[b]]) {
                free(last);
                ds41_fail(err, "speculative run: sequence %zu token %zu differs from the plain run", b, done[b]);
                goto out;
            }
            if (!k) ref[b * (P + T) + P + done[b]] = t;
            done[b]++;
            int32_t *f = feed + b * R;
            f[0] = t;
            ds41_draft d;
            memset(&d, 0, sizeof d);
            const size_t room = T - done[b];
            seq_steps++;
            if (k && room && ss[b].skip > 0) {
                ss[b].skip--;
            } else if (k && room) {
                ds41_draft_request rq = {.seq = seqs[b], .context = ref + b * (P + T), .n_context = P + done[b],
                                         .last = t, .max_k = (uint32_t)(room < k ? room : k)};
                if (prov.draft(prov.ctx, &rq, 1, &d, err) != 0) {
                    free(last);
                    goto out;
                }
            }
            memcpy(f + 1, d.ids, d.k * sizeof *d.ids);
            if (d.k && ds41_kv_seq_journal_begin(seqs[b], 1 + d.k, err) != 0) {
                free(last);
                goto out;
            }
            items[n] = (ds41_fwd_item){
                .seq = seqs[b], .ids = f, .n_ids = 1 + d.k, .logits = logits + b * R * V, .spec_taps = prov.taps};
            n++;
            drafted += d.k;
            blocks += d.k > 0;
        }
        if (n == 0) break;
        if (ds41_forward(e, items, n, NULL, err) != 0) {
            free(last);
            goto out;
        }
        steps++;
        for (size_t i = 0; i < n; i++) {
            size_t b = 0;
            while (seqs[b] != items[i].seq) b++;
            size_t acc = 0;
            while (acc + 1 < items[i].n_ids &&
                   ds41_argmax(logits + (b * R + acc) * V, V) == items[i].ids[acc + 1]) {
                acc++;
                done[b]++;
            }
            last[b] = acc;
            accepted += acc;
            if (items[i].n_ids > 1) {
                if (ds41_kv_seq_rewind(seqs[b], P + done[b], err) != 0) {
                    free(last);
                    goto out;
                }
                ds41_kv_seq_journal_end(seqs[b]);
                ds41_spec_backoff(&ss[b], (uint32_t)acc);
            }
        }
    }
    const double t = now() - t0;
    free(last);
    *tps = (double)(B * T) / t;
    *step_s = t / (double)steps;
    *mean_acc = blocks ? (double)accepted / (double)blocks : 0;
    if (draft_rate) *draft_rate = seq_steps ? (double)blocks / (double)seq_steps : 0;
    (void)drafted;
    rc = 0;
out:
    if (seqs)
        for (size_t b = 0; b < B; b++) ds41_kv_seq_free(seqs[b]);
    ds41_kv_pool_free(pool);
    ds41_oracle_free(o);
    free(ss);
    free(seqs);
    free(items);
    free(logits);
    free(feed);
    free(done);
    return rc;
}

static int bench_speculative(ds41_engine *e, const size_t *batches, size_t n_batches, size_t T, uint32_t max_k,
                             int json) {
    const ds41_model_config *c = ds41_engine_config(e);
    const size_t P = 32;
    ds41_error err = {{0}};
    spec_result res[16];
    for (size_t i = 0; i < n_batches; i++) {
        const size_t B = batches[i];
        int32_t *prompt = malloc(B * P * sizeof *prompt), *ref = malloc(B * (P + T) * sizeof *ref);
        if (!prompt || !ref) {
            free(prompt);
            free(ref);
            fprintf(stderr, "ds41-bench: out of memory\n");
            return 1;
        }
        for (size_t j = 0; j < B * P; j++) prompt[j] = random_id(c->vocab_size);
        spec_result *r = &res[i];
        memset(r, 0, sizeof *r);
        r->batch = B;
        r->tokens = T;
        double unused;
        /* a warm-up run, the same as the timed plain one, touches the weights the timed runs use
         * (page faults of the mapping do not count) */
        int rc = spec_run(e, B, T, 0, NULL, prompt, P, ref, &unused, &unused, &unused, NULL, &err);
        if (rc == 0)
            rc = spec_run(e, B, T, 0, NULL, prompt, P, ref, &r->plain_tps, &r->plain_step_s, &unused, NULL, &err);
        for (uint32_t k = 1; k <= max_k && rc == 0; k++)
            rc = spec_run(e, B, T, k, NULL, prompt, P, ref, &r->tps[k], &r->step_s[k], &r->mean_accepted[k], NULL,
                          &err);
        ds41_draft_provider head;
        ds41_error herr = {{0}};
        if (rc == 0 && ds41_spec_head_provider(e, &head, &herr) == 0) {
            /* the head's figures are a long run's (the back-off settles over tens of steps),
             * against a plain run of the same length */
            r->head = true;
            r->head_k = max_k < (uint32_t)c->dspark_block_size ? max_k : (uint32_t)c->dspark_block_size;
            r->head_tokens = T > HEAD_TOKENS ? T : HEAD_TOKENS;
            int32_t *href = malloc(B * (P + r->head_tokens) * sizeof *href);
            rc = href ? 0 : ds41_fail(&err, "out of memory");
            if (rc == 0)
                rc = spec_run(e, B, r->head_tokens, 0, NULL, prompt, P, href, &r->head_plain_tps, &unused, &unused,
                              NULL, &err);
            if (rc == 0)
                rc = spec_run(e, B, r->head_tokens, r->head_k, &head, prompt, P, href, &r->head_tps, &r->head_step_s,
                              &r->head_mean_accepted, &r->head_draft_rate, &err);
            free(href);
        }
        free(prompt);
        free(ref);
        if (rc != 0) {
            fprintf(stderr, "ds41-bench: %s\n", err.msg);
            return 1;
        }
    }
    if (json) {
        printf("{\"speculative\":[");
        for (size_t i = 0; i < n_batches; i++) {
            const spec_result *r = &res[i];
            printf("%s{\"batch\":%zu,\"tokens_per_sequence\":%zu,\"plain_tokens_per_s\":%.3f,"
                   "\"plain_seconds_per_step\":%.6f,\"full_acceptance\":[",
                   i ? "," : "", r->batch, r->tokens, r->plain_tps, r->plain_step_s);
            for (uint32_t k = 1; k <= max_k; k++)
                printf("%s{\"k\":%u,\"tokens_per_s\":%.3f,\"seconds_per_step\":%.6f,\"step_cost_vs_plain\":%.4f,"
                       "\"mean_accepted\":%.3f}",
                       k > 1 ? "," : "", k, r->tps[k], r->step_s[k], r->step_s[k] / r->plain_step_s,
                       r->mean_accepted[k]);
            if (r->head)
                printf("],\"dspark_head\":{\"k\":%u,\"tokens_per_sequence\":%zu,\"plain_tokens_per_s\":%.3f,"
                       "\"tokens_per_s\":%.3f,\"vs_plain\":%.4f,\"mean_accepted\":%.3f,\"drafting_steps\":%.4f}}",
                       r->head_k, r->head_tokens, r->head_plain_tps, r->head_tps, r->head_tps / r->head_plain_tps,
                       r->head_mean_accepted, r->head_draft_rate);
            else
                printf("],\"dspark_head\":null}");
        }
        printf("]}\n");
        return 0;
    }
    for (size_t i = 0; i < n_batches; i++) {
        const spec_result *r = &res[i];
        printf("speculative B=%-3zu plain %.2f tokens/s (%.1f ms/step), %zu tokens per sequence\n", r->batch,
               r->plain_tps, 1e3 * r->plain_step_s, r->tokens);
        for (uint32_t k = 1; k <= max_k; k++)
            printf("  full acceptance k=%u: %.2f tokens/s (%.2fx plain), verification step %.1f ms = %.2fx a plain "
                   "step, %.2f drafts accepted per step\n",
                   k, r->tps[k], r->tps[k] / r->plain_tps, 1e3 * r->step_s[k], r->step_s[k] / r->plain_step_s,
                   r->mean_accepted[k]);
        printf("  tokens/s at mean accepted length a (k=%u): about %.2f * (1 + a) / %.2f\n", max_k,
               (double)r->batch / r->plain_step_s, r->step_s[max_k] / r->plain_step_s);
        if (r->head)
            printf("  DSpark head k=%u, %zu tokens per sequence: %.2f tokens/s against plain %.2f (%.3fx), %.2f "
                   "drafts accepted per block, %.1f%% of the steps drafted (back-off)\n",
                   r->head_k, r->head_tokens, r->head_tps, r->head_plain_tps, r->head_tps / r->head_plain_tps,
                   r->head_mean_accepted, 100.0 * r->head_draft_rate);
        else
            printf("  DSpark head: the model has none\n");
    }
    return 0;
}

static int bench_kernels(const ds41_cpu_opts *cpu, int json, uint64_t set_bytes) {
    ds41_error err = {{0}};
    ds41_backend *be = ds41_backend_cpu_new(cpu, &err);
    if (!be) {
        fprintf(stderr, "ds41-bench: %s\n", err.msg);
        return 1;
    }
    ds41_cpu_measure mach;
    ds41_kernel_ceiling kc[9];
    size_t n = 0;
    if (ds41_backend_cpu_measure(be, set_bytes, 3, &mach, &err) != 0 ||
        ds41_bench_kernel_ceilings(be, set_bytes, kc, 9, &n, &err) != 0) {
        fprintf(stderr, "ds41-bench: %s\n", err.msg);
        ds41_backend_free(be);
        return 1;
    }
    if (json) {
        printf("{\"backend\":\"%s\",\"threads\":%d,\"read_gbs\":%.3f,\"kernels\":[", be->name,
               ds41_backend_threads(be), mach.read_gbs);
        for (size_t i = 0; i < n; i++)
            printf("%s{\"format\":\"%s\",\"n\":%zu,\"k\":%zu,\"linears\":%zu,\"rows\":%zu,"
                   "\"cache_gbs\":%.3f,\"memory_gbs\":%.3f,\"memory_fraction\":%.4f}",
                   i ? "," : "", kc[i].format, kc[i].n, kc[i].k, kc[i].linears, kc[i].rows, kc[i].cache_gbs,
                   kc[i].memory_gbs, mach.read_gbs > 0 ? kc[i].memory_gbs / mach.read_gbs : 0.0);
        printf("]}\n");
    } else {
        printf("backend    %s, %d threads\n", be->name, ds41_backend_threads(be));
        printf("machine    read bandwidth %.2f GB/s (%.1f GiB buffer, best of 3 passes)\n", mach.read_gbs,
               (double)set_bytes / (1 << 30));
        printf("kernels    weight GB/s the linear kernel consumes (codes + scales); in cache / from memory "
               "(fraction of the read bandwidth)\n");
        for (size_t i = 0; i < n; i++)
            printf("  %-4s %zu x %4zux%zu, %2zu row%s  %7.2f / %6.2f GB/s (%4.1f%%)\n", kc[i].format,
                   kc[i].linears, kc[i].n, kc[i].k, kc[i].rows, kc[i].rows == 1 ? " " : "s", kc[i].cache_gbs,
                   kc[i].memory_gbs, mach.read_gbs > 0 ? 100.0 * kc[i].memory_gbs / mach.read_gbs : 0.0);
    }
    ds41_backend_free(be);
    return 0;
}

/* The machine's limits for the backend's figures: the CPU's read bandwidth and FMA peak on the fast
 * CPU backend; on the CUDA backend the device's memory bandwidth as read_gbs (gib is the CPU
 * buffer's size: the device copy is 1 GiB or an eighth of the free memory, whichever is less) and
 * no FLOP peak (0: fractions reported as 0); nothing on other backends. */
static int bench_machine(ds41_backend *be, size_t gib, ds41_cpu_measure *out, ds41_error *err) {
    memset(out, 0, sizeof *out);
    if (ds41_backend_cpu_level(be) != DS41_CPU_AUTO) return ds41_backend_cpu_measure(be, (uint64_t)gib << 30, 3, out, err);
    ds41_gpu *g = ds41_backend_is_cuda(be) ? ds41_backend_cuda_gpu(be) : NULL;
    ds41_gpu_info gi;
    if (!g || g->info(g, &gi, err) != 0) return g ? -1 : 0;
    uint64_t n = gi.free_bytes / 8 < (1ull << 30) ? gi.free_bytes / 8 : 1ull << 30;
    ds41_gpu_measure m;
    if (ds41_gpu_measure_run(g, n, n / 4, 3, NULL, NULL, &m, err) != 0) return -1;
    out->read_bytes = m.device_bytes;
    out->read_passes = m.passes;
    out->read_gbs = m.device_gbs;
    fprintf(stderr, "ds41-bench: %s: device memory %.1f GB/s, host-to-device %.1f GB/s (pinned)\n", gi.name,
            m.device_gbs, m.h2d_gbs);
    return 0;
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
        {"no-predict", no_argument, NULL, 'N'},
        {"kernels", no_argument, NULL, 'K'},
        {"ops", no_argument, NULL, 'O'},
        {"speculative", required_argument, NULL, 'S'},
        DS41_BUDGET_LONGOPTS,
        {"predict", required_argument, NULL, 'R'},
        {"predict-extra", required_argument, NULL, 'x'},
        DS41_BACKEND_LONGOPT,
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    const char *model = NULL;
    size_t threads = 0, P = 256, steps = 8, gib = 4;
    size_t batches[16] = {1, 4, 16}, n_batches = 3;
    int json = 0, kernels = 0, gib_set = 0, ops = 0, steps_set = 0, batches_set = 0;
    size_t speculative = 0;
    const char *backend = NULL; /* --backend (NULL: auto) */
    ds41_engine_opts eo = {.reference = false};
    ds41_budget_flags budgets = {.tool = "ds41-bench"};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
        int used = ds41_budget_flags_option(&budgets, ch, optarg);
        if (used < 0) return 2;
        if (used) continue;
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
        case 'K':
            kernels = 1;
            break;
        case DS41_BACKEND_OPT:
            if (ds41_backend_flag_parse("ds41-bench", optarg) != 0) return 2;
            backend = optarg;
            break;
        case 'O':
            ops = 1;
            break;
        case 'S':
            if (parse_size(optarg, &speculative) != 0 || speculative < 1 || speculative > DS41_SPEC_MAX_K) {
                fprintf(stderr, "ds41-bench: --speculative: expected 1..%u, got '%s'\n", DS41_SPEC_MAX_K, optarg);
                return 2;
            }
            break;
        case 'P':
            eo.cpu.pin = true;
            break;
        case 'N':
            eo.expert_no_predict = true;
            break;
        case 'R': {
            const int pm = ds41_expert_predict_parse(optarg);
            if (pm < 0) {
                fprintf(stderr, "ds41-bench: --predict: '%s' is not next, early or both\n", optarg);
                return 2;
            }
            eo.expert_predict = (ds41_expert_predict)pm;
            break;
        }
        case 'x': {
            char *end = NULL;
            errno = 0;
            const unsigned long v = strtoul(optarg, &end, 10);
            if (errno || !end || *end || optarg[0] == '-' || v > 64) {
                fprintf(stderr, "ds41-bench: --predict-extra: '%s' is not a number of experts in 0..64\n", optarg);
                return 2;
            }
            eo.expert_predict_extra = (unsigned)v;
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
            steps_set = 1;
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
            gib_set = 1;
            break;
        case 'b': {
            batches_set = 1;
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
        case 'V':
            puts("ds41-bench " DS41_VERSION);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind != argc || (!model && !kernels)) {
        usage(stderr);
        return 2;
    }
    if (kernels) {
        if (model) {
            fprintf(stderr, "ds41-bench: --kernels needs no --model (it measures synthetic weights)\n");
            return 2;
        }
        return bench_kernels(&eo.cpu, json, (uint64_t)(gib_set ? gib : 2) << 30);
    }
    if (speculative) {
        if (!batches_set) {
            batches[0] = 1;
            batches[1] = 4;
            n_batches = 2;
        }
        if (!steps_set) steps = 30;
    }
    ds41_error err = {{0}};
    /* Budgets: the flags, else --config's memory.*_cache_bytes, else auto (sized for the
     * largest batch of the run). */
    size_t max_batch = 1;
    for (size_t i = 0; i < n_batches; i++)
        if (batches[i] > max_batch) max_batch = batches[i];
    ds41_budget_run run = {.kv_tokens = (uint64_t)P + steps, .batch = (uint32_t)max_batch};
    if (ds41_budget_flags_apply(&budgets, model, &run, &eo, NULL, 0) != 0) return 2;
    if (ops) {
        /* The engine runs on a backend whose op table is wrapped with timers. */
        ds41_model_config oc;
        if (ds41_model_config_load(model, &oc, &err) != 0) {
            fprintf(stderr, "ds41-bench: %s\n", err.msg);
            return 2;
        }
        const int n_layers = (int)oc.n_layers;
        ds41_model_config_free(&oc);
        if (ds41_backend_flag_apply("ds41-bench", backend, &eo) != 0) return 1;
        if (!(g_prof = ds41_op_profile_install(eo.backend, n_layers))) {
            fprintf(stderr, "ds41-bench: --ops: out of memory\n");
            ds41_backend_free(eo.backend);
            return 1;
        }
    }
    if (!eo.backend && ds41_backend_flag_apply("ds41-bench", backend, &eo) != 0) return 1;
    ds41_engine *e = ds41_engine_load(model, &eo, &err);
    if (!e) {
        fprintf(stderr, "ds41-bench: %s\n", err.msg);
        return 2;
    }
    if (speculative) {
        const int src = bench_speculative(e, batches, n_batches, steps, (uint32_t)speculative, json);
        ds41_engine_free(e);
        return src;
    }
    ds41_backend *be = ds41_engine_backend(e);
    int status = 1;
    ds41_cpu_measure mach;
    prefill_result pre = {0};
    decode_result dec[16] = {{0}};
    /* Other work on the machine skews every figure: report the load. */
    double load[1] = {-1.0};
    if (getloadavg(load, 1) != 1) load[0] = -1.0;
    /* The machine's limits are measured before and after the workload and the
     * best of the two kept: on a shared machine one measurement can fall in a
     * busy moment and flatter the ratios (the best is the conservative
     * denominator). */
    ds41_cpu_measure mach2;
    if (bench_machine(be, gib, &mach, &err) != 0) goto fail;
    if (!json)
        fprintf(stderr, "ds41-bench: %s, %d threads: read %.1f GB/s, FMA %.0f GFLOP/s\n", be->name,
                ds41_backend_threads(be), mach.read_gbs, mach.fma_gflops);
    /* Expert tier: drop the page cache (when permitted) so that nothing of
     * the checkpoint is cached, and measure the device's own O_DIRECT read
     * bandwidth on the largest shard the tier reads. */
    const bool streamed = ds41_engine_experts_streamed(e);
    ds41_bandwidth_probe probe = {0};
    const char *dropped = "not needed (experts resident)";
    const char *probe_path = NULL;
    if (streamed) {
        ds41_reader *rd = ds41_engine_expert_reader(e);
        uint64_t best = 0;
        for (uint32_t i = 0; i < ds41_reader_file_count(rd); i++)
            if (ds41_reader_file_size(rd, i) > best) {
                best = ds41_reader_file_size(rd, i);
                probe_path = ds41_reader_file_path(rd, i);
            }
        sync();
        FILE *dc = fopen("/proc/sys/vm/drop_caches", "w");
        dropped = dc && fputs("1\n", dc) >= 0 && fclose(dc) == 0 ? "yes (/proc/sys/vm/drop_caches)"
                                                                : "no (not permitted: O_DIRECT keeps experts out of it)";
        if (probe_path && ds41_reader_probe_bandwidth(probe_path, 1ull << 30, &probe, &err) != 0) goto fail;
    }
    if (bench_prefill(e, be, P, mach.fma_gflops, &pre, &err) != 0) goto fail;
    for (size_t i = 0; i < n_batches; i++)
        if (bench_decode(e, be, batches[i], steps, mach.read_gbs, &dec[i], &err) != 0) goto fail;
    if (bench_machine(be, gib, &mach2, &err) != 0) goto fail;
    if (streamed && probe_path) {
        ds41_bandwidth_probe p2;
        if (ds41_reader_probe_bandwidth(probe_path, 1ull << 30, &p2, &err) != 0) goto fail;
        if (p2.bytes_per_second > probe.bytes_per_second) probe = p2;
    }
    const double dev_bps = probe.bytes_per_second;
    /* The tier without compute, with and without the next layer submitted early. */
    double ceil_bps[2] = {0, 0}, ceil_hits[2] = {0, 0};
    if (streamed) {
        ds41_expert_cache_stats g;
        ds41_engine_expert_stats(e, &g, false);
        for (int pr = 0; pr < 2; pr++)
            if (tier_ceiling(model, g.budget_bytes, pr == 1, 32, &ceil_bps[pr], &ceil_hits[pr], &err) != 0) goto fail;
    }
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
            const bool e_streamed = ds41_engine_engram_stats(e, &es);
            printf("\"engram_tier\":{\"streamed\":%s,\"budget_bytes\":%llu,\"capacity_rows\":%llu,\"row_bytes\":%llu,"
                   "\"reader\":\"%s\",\"direct\":%s",
                   e_streamed ? "true" : "false", (unsigned long long)eo.engram_cache_bytes,
                   (unsigned long long)es.capacity, (unsigned long long)es.row_bytes,
                   e_streamed ? ds41_reader_backend_name(ds41_engram_cache_reader(ds41_engine_engram_cache(e))) : "",
                   e_streamed && ds41_reader_file_direct(ds41_engram_cache_reader(ds41_engine_engram_cache(e)), 0)
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
        printf("]");
        if (pre.ops) {
            printf(",\"ops\":[");
            ds41_op_profile_print_json(pre.ops, stdout, "prefill", pre.seconds, 1);
            for (size_t i = 0; i < n_batches; i++)
                if (dec[i].ops) {
                    char what[32];
                    snprintf(what, sizeof what, "decode B=%zu", dec[i].batch);
                    putchar(',');
                    ds41_op_profile_print_json(dec[i].ops, stdout, what,
                                               dec[i].seconds_per_step * (double)dec[i].steps, dec[i].steps);
                }
            printf("]");
        }
        printf(",\"experts\":{\"streamed\":%s", streamed ? "true" : "false");
        if (streamed) {
            ds41_expert_cache_stats g;
            ds41_engine_expert_stats(e, &g, false);
            printf(",\"budget_bytes\":%" PRIu64 ",\"slot_bytes\":%" PRIu64 ",\"slots\":%" PRIu64
                   ",\"total_bytes\":%" PRIu64 ",\"reader\":\"%s\",\"direct\":%s,\"prediction\":%s,"
                   "\"prediction_mode\":\"%s\",\"prediction_extra\":%u,\"page_cache_dropped\":%s,\"device_read_bandwidth_bps\":%.0f,\"device_probe_direct\":%s,"
                   "\"io_without_compute\":{\"read_bps\":%.0f,\"fraction_of_device\":%.4f,\"hit_rate\":%.4f,"
                   "\"read_bps_next_layer_early\":%.0f,\"fraction_of_device_next_layer_early\":%.4f},"
                   "\"phases\":[",
                   g.budget_bytes, g.slot_bytes, g.slots, g.total_bytes, g.backend, g.direct ? "true" : "false",
                   eo.expert_no_predict ? "false" : "true",
                   eo.expert_no_predict ? "off" : ds41_expert_predict_name(eo.expert_predict), eo.expert_predict_extra, strncmp(dropped, "yes", 3) == 0 ? "true" : "false",
                   dev_bps, probe.direct ? "true" : "false", ceil_bps[0], ratio(ceil_bps[0], dev_bps), ceil_hits[0],
                   ceil_bps[1], ratio(ceil_bps[1], dev_bps));
            tier_json("prefill", 0, &pre.tier, dev_bps, true);
            for (size_t i = 0; i < n_batches; i++) tier_json("decode", dec[i].batch, &dec[i].tier, dev_bps, false);
            printf("]");
        }
        printf("}}\n");
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
        if (pre.ops) ds41_op_profile_print_text(pre.ops, stdout, "prefill", pre.seconds, 1);
        for (size_t i = 0; i < n_batches; i++)
            if (dec[i].ops) {
                char what[32];
                snprintf(what, sizeof what, "B=%zu", dec[i].batch);
                ds41_op_profile_print_text(dec[i].ops, stdout, what,
                                           dec[i].seconds_per_step * (double)dec[i].steps, dec[i].steps);
            }
        if (streamed) {
            ds41_expert_cache_stats g;
            ds41_engine_expert_stats(e, &g, false);
            printf("experts    streamed: budget %.1f MiB = %" PRIu64 " slots of %.2f MiB, %.1f MiB of routed experts "
                   "(%.1fx the budget); reader %s, O_DIRECT %s; prediction %s (+%u candidates); page cache dropped: %s\n",
                   (double)g.budget_bytes / 1048576.0, g.slots, (double)g.slot_bytes / 1048576.0,
                   (double)g.total_bytes / 1048576.0, (double)g.total_bytes / (double)g.budget_bytes, g.backend,
                   g.direct ? "yes" : "no", eo.expert_no_predict ? "off" : ds41_expert_predict_name(eo.expert_predict),
                   eo.expert_predict_extra, dropped);
            printf("device     O_DIRECT read bandwidth %.2f GB/s (%s, %.0f MiB, %s; best of a probe before and "
                   "after the workload)\n",
                   dev_bps / 1e9, probe_path, (double)probe.bytes / 1048576.0, probe.backend);
            printf("tier I/O   without compute (a second cache of the same budget; B=1 decode pattern, random "
                   "experts, 32 steps): %.3f GB/s = %.1f%% of the device at %.1f%% hits; with the next layer "
                   "submitted early: %.3f GB/s = %.1f%%\n",
                   ceil_bps[0] / 1e9, 100 * ratio(ceil_bps[0], dev_bps), 100 * ceil_hits[0], ceil_bps[1] / 1e9,
                   100 * ratio(ceil_bps[1], dev_bps));
            uint64_t res = 0, pgs = 0;
            expert_pages_resident(e, &res, &pgs);
            printf("mapping    pages of the shards holding only routed-expert bytes: %" PRIu64 " of %" PRIu64
                   " in the page cache after the run (mincore)\n",
                   res, pgs);
            tier_text("prefill", 0, &pre.tier, dev_bps);
            for (size_t i = 0; i < n_batches; i++) tier_text("decode", dec[i].batch, &dec[i].tier, dev_bps);
        } else {
            printf("experts    all resident (no --expert-cache-bytes below their total)\n");
        }
    }
    status = 0;
    goto done;
fail:
    fprintf(stderr, "ds41-bench: %s\n", err.msg);
done:
    ds41_engine_free(e);
    ds41_op_profile_free(pre.ops);
    for (size_t i = 0; i < n_batches; i++) ds41_op_profile_free(dec[i].ops);
    ds41_op_profile_free(g_prof);
    return status;
}
