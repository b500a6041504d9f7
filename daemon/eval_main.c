/* ds41-eval: run the forward pass on given token ids and write the logits
 * (prefill and greedy decode) as JSON, optionally with the per-layer streams
 * of REFERENCE.md §10.1.  This is the hook for reference comparisons
 * (tests/reference/ds41_ref.py has the same command line and must produce
 * the same bytes in the reference mode). */
#include "config/buf.h"
#include "daemon/backend_flag.h"
#include "daemon/budget_flags.h"
#include "ds41_version.h"
#include "engine/backend/backend.h"
#include "engine/backend/cpu/cpu_backend.h"
#include "engine/forward/dspark.h"
#include "engine/forward/forward.h"
#include "engine/backend/cpu/threadpool.h"
#include "engine/serve/speculative.h"
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
            "                 [--no-predict] [--replay DUMP.safetensors] [--drafts]\n"
            "                 [--speculative N [--speculative-oracle]] [--backend KIND]\n"
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
            "canonical arithmetic of the reference mode (engine/backend/refmath.h; bit-exact against\n"
            "tests/reference/ds41_ref.py).\n"
            "--backend KIND: auto (the GPU when one is usable, else the fast CPU path; the\n"
            "default), cpu, cuda (an error without a usable GPU) or cuda-emu (test mode: the\n"
            "CUDA kernels emulated on the host); --reference wins over it.\n"
            "--engram-cache-bytes SIZE (bytes, or with a unit: 64MiB, 1.5GiB, 2GB) streams the\n"
            "Engram table rows from the checkpoint into a row cache of that size (0 or a size\n"
            "covering the tables: resident); each greedy token's rows are prefetched before its\n"
            "step.  The logits are the same either way.\n"
            "--drafts (a model with DSpark stages): before each greedy step feeds its token,\n"
            "the DSpark head drafts a block from that token (greedy, never fed back: the\n"
            "logits are the same as without); the JSON then ends with\n"
            "  \"drafts\":[{\"position\":p,\"ids\":[...],\"confidence\":[...]},...]\n"
            "one per greedy step, p = the position of its first draft token (the step's\n"
            "token's position + 1), dspark_block_size drafts each.\n"
            "--dump writes the section 10.1 stream dump, with the decisions (index top-k,\n"
            "candidate blocks, routed experts) and the scores they were made from.\n"
            "--replay DUMP (with --dump, without --ids/--decode) replays a dump teacher-forced:\n"
            "its ids and decode_ids are fed, and every block L starts from the dump's h.L and\n"
            "pre.L, so the new dump's h.L+1, attn.L, ffn.L and decisions are block L's work on\n"
            "the same inputs (a layer-local comparison of two levels or backends).\n"
            "--expert-cache-bytes SIZE (e.g. 1GiB, as in ds41d.yaml) streams the routed experts\n"
            "through a slot pool of that size (io_uring, O_DIRECT) when they do not all fit;\n"
            "--config FILE takes memory.expert_cache_bytes and engram_cache_bytes from a ds41d\n"
            "YAML file (the flags win); --no-predict turns off expert prediction.\n"
            "--host-expert-cache-bytes SIZE: with a GPU backend, the pinned host tier of routed\n"
            "experts between the device slots and the shards (memory.host_expert_cache_bytes).\n"
            "A budget that is absent, \"auto\" (flag or YAML) or 0 in the YAML is sized from the\n"
            "memory the process may use (MemAvailable, cgroup limits): everything resident when\n"
            "it fits, else the Engram rows streamed first, then the experts (see ds41d.yaml(5)).\n"
            "The logits do not depend on the budgets.\n"
            "--speculative N decodes the K greedy steps speculatively with the model's DSpark draft\n"
            "head (up to N drafts per step, 1..8; refused without DSpark): one forward call feeds a\n"
            "token and its drafts, the drafts equal to the previous row's argmax stand, the rest is\n"
            "rolled back.  The JSON is the same as without it plus\n"
            "  \"speculative\":{\"steps\":S,\"drafted\":D,\"accepted\":A}\n"
            "and with --drafts \"drafts\":[{\"position\":P,\"ids\":[...],\"confidence\":[...]},...] for\n"
            "every draft block (P: the position of the first draft).  --speculative-oracle (tests and\n"
            "benchmarks) drafts the plain greedy continuation instead (computed first): full\n"
            "acceptance.  Not with --dump or --replay.\n"
            "Exit status: 0 ok, 2 bad arguments or checkpoint, 1 other failures.\n");
}

/* ---- stream collection for --dump ---------------------------------------------- */

/* One decision kind of one layer over a part's rows (allocated when the
 * layer first reports it). */
typedef struct dec_arr {
    int32_t *sel; /* [S][w_sel], -1 padded */
    float *score; /* [S][w_score], NaN padded */
    size_t w_sel, w_score;
    size_t n_score_max; /* the widest score row reported (the tensor's width) */
} dec_arr;

#define N_DECISIONS 3 /* ds41_decision_kind */
static const char *const dec_sel_name[N_DECISIONS] = {"index_sel", "cand", "experts"};
static const char *const dec_score_name[N_DECISIONS] = {"index_score", "cand_score", "expert_score"};

typedef struct part {
    size_t S;
    size_t pos_last;           /* absolute position of the part's last row */
    float *h;                  /* [n_layers+1][S][hc*dim] */
    float *pre;                /* [n_layers][S][hc] */
    float *attn;               /* [n_layers][S][dim] */
    float *ffn;                /* [n_layers][S][dim] */
    float *logits;             /* [S][vocab] */
    dec_arr *dec[N_DECISIONS]; /* [n_layers] each */
    /* --replay: the source dump's streams fed into each block ([n_layers]) */
    const float **feed_h, **feed_pre;
} part;

typedef struct collector {
    const ds41_model_config *cfg;
    part *cur;
    size_t row_off; /* position of the current chunk's first row inside the part */
    int oom;        /* a decision array could not be allocated */
} collector;

static int part_alloc(part *p, const ds41_model_config *c, size_t S, size_t pos_last) {
    const size_t L = (size_t)c->n_layers, hc = (size_t)c->hc_mult, D = (size_t)c->dim, V = (size_t)c->vocab_size;
    p->S = S;
    p->pos_last = pos_last;
    for (int k = 0; k < N_DECISIONS; k++)
        if (!(p->dec[k] = calloc(L + 1, sizeof *p->dec[k]))) return -1;
    p->h = calloc((L + 1) * S * hc * D, sizeof(float));
    p->pre = calloc(L * S * hc + 1, sizeof(float));
    p->attn = calloc(L * S * D + 1, sizeof(float));
    p->ffn = calloc(L * S * D + 1, sizeof(float));
    p->logits = calloc(S * V, sizeof(float));
    return p->h && p->pre && p->attn && p->ffn && p->logits ? 0 : -1;
}

static void part_free(part *p, size_t n_layers) {
    for (int k = 0; k < N_DECISIONS; k++) {
        for (size_t l = 0; p->dec[k] && l < n_layers; l++) {
            free(p->dec[k][l].sel);
            free(p->dec[k][l].score);
        }
        free(p->dec[k]);
    }
    free(p->feed_h);
    free(p->feed_pre);
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

static void collect_decision(void *ctx, ds41_decision_kind kind, int layer, size_t item, size_t row,
                             const int32_t *sel, size_t n_sel, const float *score, size_t n_score) {
    collector *col = ctx;
    part *p = col->cur;
    (void)item;
    if (!p || (int)kind < 0 || kind >= N_DECISIONS || layer < 0 || layer >= col->cfg->n_layers) return;
    const ds41_model_config *c = col->cfg;
    dec_arr *d = &p->dec[kind][layer];
    if (!d->sel) {
        /* Widths: the most picks a row can have; the most scores (reach
         * positions or blocks <= positions, or experts). */
        d->w_sel = (size_t)(kind == DS41_DECISION_INDEX  ? c->index_topk
                            : kind == DS41_DECISION_CAND ? c->candidate_topk_blocks
                                                         : c->n_activated_experts);
        d->w_score = kind == DS41_DECISION_EXPERTS ? (size_t)c->n_routed_experts : p->pos_last + 1;
        if (d->w_sel == 0) d->w_sel = 1;
        d->sel = malloc(p->S * d->w_sel * sizeof *d->sel);
        d->score = malloc(p->S * d->w_score * sizeof *d->score);
        if (!d->sel || !d->score) {
            free(d->sel);
            free(d->score);
            d->sel = NULL;
            d->score = NULL;
            col->oom = 1;
            return;
        }
        for (size_t i = 0; i < p->S * d->w_sel; i++) d->sel[i] = -1;
        for (size_t i = 0; i < p->S * d->w_score; i++) d->score[i] = __builtin_nanf("");
    }
    const size_t s = col->row_off + row;
    if (s >= p->S) return;
    if (n_sel > d->w_sel) n_sel = d->w_sel;
    if (n_score > d->w_score) n_score = d->w_score;
    memcpy(d->sel + s * d->w_sel, sel, n_sel * sizeof *sel);
    if (n_score) memcpy(d->score + s * d->w_score, score, n_score * sizeof *score);
    if (n_score > d->n_score_max) d->n_score_max = n_score;
}

/* Teacher forcing from the --replay source (feed_h/feed_pre of the part). */
static void feed_row(void *ctx, int layer, size_t item, size_t row, float *h, float *pre) {
    collector *col = ctx;
    const part *p = col->cur;
    (void)item;
    if (!p || !p->feed_h || layer < 0 || layer >= col->cfg->n_layers) return;
    const size_t hc = (size_t)col->cfg->hc_mult, D = (size_t)col->cfg->dim, s = col->row_off + row;
    memcpy(h, p->feed_h[layer] + s * hc * D, hc * D * sizeof *h);
    memcpy(pre, p->feed_pre[layer] + s * hc, hc * sizeof *pre);
}

/* The score arrays as [S][n_score_max] (rows packed in place). */
static void pack_scores(part *p, size_t n_layers) {
    for (int k = 0; k < N_DECISIONS; k++)
        for (size_t l = 0; l < n_layers; l++) {
            dec_arr *d = &p->dec[k][l];
            if (!d->sel || d->n_score_max == d->w_score) continue;
            for (size_t s = 0; s < p->S; s++)
                memmove(d->score + s * d->n_score_max, d->score + s * d->w_score,
                        d->n_score_max * sizeof *d->score);
            d->w_score = d->n_score_max;
        }
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
        if (write ? ds41_checkpoint_writer_write(w, key, p->h + (size_t)l * (size_t)(S * hc * D), nb, err)
                  : ds41_checkpoint_writer_declare(w, key, DS41_F32, 3, shape, err))
            return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        const int64_t sp[2] = {S, hc}, sd[2] = {S, D};
        snprintf(key, sizeof key, "%s.pre.%lld", name, (long long)l);
        if (write ? ds41_checkpoint_writer_write(w, key, p->pre + (size_t)(l * S * hc),
                                                 (size_t)(S * hc) * sizeof(float), err)
                  : ds41_checkpoint_writer_declare(w, key, DS41_F32, 2, sp, err))
            return -1;
        snprintf(key, sizeof key, "%s.attn.%lld", name, (long long)l);
        if (write ? ds41_checkpoint_writer_write(w, key, p->attn + (size_t)(l * S * D),
                                                 (size_t)(S * D) * sizeof(float), err)
                  : ds41_checkpoint_writer_declare(w, key, DS41_F32, 2, sd, err))
            return -1;
        snprintf(key, sizeof key, "%s.ffn.%lld", name, (long long)l);
        if (write ? ds41_checkpoint_writer_write(w, key, p->ffn + (size_t)(l * S * D),
                                                 (size_t)(S * D) * sizeof(float), err)
                  : ds41_checkpoint_writer_declare(w, key, DS41_F32, 2, sd, err))
            return -1;
    }
    for (int k = 0; k < N_DECISIONS; k++)
        for (int64_t l = 0; l < L; l++) {
            const dec_arr *d = &p->dec[k][l];
            if (!d->sel) continue;
            const int64_t ss[2] = {S, (int64_t)d->w_sel}, sc[2] = {S, (int64_t)d->w_score};
            snprintf(key, sizeof key, "%s.%s.%lld", name, dec_sel_name[k], (long long)l);
            if (write
                    ? ds41_checkpoint_writer_write(w, key, d->sel, (size_t)S * d->w_sel * sizeof *d->sel, err)
                    : ds41_checkpoint_writer_declare(w, key, DS41_I32, 2, ss, err))
                return -1;
            if (d->w_score == 0) continue;
            snprintf(key, sizeof key, "%s.%s.%lld", name, dec_score_name[k], (long long)l);
            if (write ? ds41_checkpoint_writer_write(w, key, d->score,
                                                     (size_t)S * d->w_score * sizeof *d->score, err)
                      : ds41_checkpoint_writer_declare(w, key, DS41_F32, 2, sc, err))
                return -1;
        }
    snprintf(key, sizeof key, "%s.logits", name);
    const int64_t sv[2] = {S, V};
    return write ? ds41_checkpoint_writer_write(w, key, p->logits, (size_t)(S * V) * sizeof(float), err)
                 : ds41_checkpoint_writer_declare(w, key, DS41_F32, 2, sv, err);
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
    ds41_st_writer *w = ds41_checkpoint_writer_new(tmpl, 0, err);
    if (!w || ds41_checkpoint_writer_single_file(w, err) != 0) goto out;
    const int64_t s_ids[1] = {(int64_t)S}, s_dec[1] = {(int64_t)K};
    char name[32];
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && ds41_checkpoint_writer_begin(w, err) != 0) goto out;
        if (pass == 0 ? ds41_checkpoint_writer_declare(w, "ids", DS41_I64, 1, s_ids, err)
                      : ds41_checkpoint_writer_write(w, "ids", ids, S * sizeof *ids, err))
            goto out;
        if (pass == 0 ? ds41_checkpoint_writer_declare(w, "decode_ids", DS41_I64, 1, s_dec, err)
                      : ds41_checkpoint_writer_write(w, "decode_ids", dec, K * sizeof *dec, err))
            goto out;
        for (size_t k = 0; k <= K; k++) {
            if (k == 0)
                snprintf(name, sizeof name, "prefill");
            else
                snprintf(name, sizeof name, "decode.%zu", k - 1);
            if (dump_part(w, pass, c, name, &parts[k], err) != 0) goto out;
        }
    }
    if (ds41_checkpoint_writer_finish(w, err) != 0) goto out;
    char file[4200];
    snprintf(file, sizeof file, "%s/%s", tmpl, DS41_ST_SINGLE_NAME);
    if (rename(file, path) != 0) {
        ds41_fail(err, "%s: cannot move the dump into place: %s", path, strerror(errno));
        unlink(file);
        goto out;
    }
    rc = 0;
out:
    ds41_checkpoint_writer_free(w);
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

/* The DSpark drafts of --drafts: per greedy step, nd ids and confidences. */
typedef struct drafts_out {
    size_t nd;     /* drafts per block; 0: no --drafts */
    int32_t *ids;  /* [K][nd] */
    float *conf;   /* [K][nd] */
    uint64_t *pos; /* [K] position of each block's first draft */
} drafts_out;

static int write_json(const char *path, const int32_t *ids, size_t S, const float *pre_logits,
                      const int32_t *dec, const float *dec_logits, size_t K, size_t V, const drafts_out *dr,
                      const char *extra, ds41_error *err) {
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
    fputc(']', f);
    if (dr->nd) {
        fputs(",\"drafts\":[", f);
        for (size_t k = 0; k < K; k++) {
            fprintf(f, k ? ",{\"position\":%llu,\"ids\":[" : "{\"position\":%llu,\"ids\":[",
                    (unsigned long long)dr->pos[k]);
            for (size_t j = 0; j < dr->nd; j++) fprintf(f, j ? ",%d" : "%d", dr->ids[k * dr->nd + j]);
            fputs("],\"confidence\":", f);
            put_floats(f, dr->conf + k * dr->nd, dr->nd);
            fputc('}', f);
        }
        fputc(']', f);
    }
    if (extra) fputs(extra, f);
    fputs("}\n", f);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return ds41_fail(err, "%s: write error", path);
    return 0;
}

/* ---- --speculative ----------------------------------------------------------------------- */

typedef struct draft_rec {
    size_t position; /* of the first draft */
    uint32_t k;
    int32_t ids[DS41_SPEC_MAX_K];
    float conf[DS41_SPEC_MAX_K];
} draft_rec;

/* The K greedy steps after the prompt's last logits `last`, speculatively: blocks [t, drafts]
 * fed under the KV journal, drafts equal to the previous row's argmax kept, the rest rewound.
 * Writes the same dec / dec_logits as the plain loop. */
static int spec_greedy(ds41_engine *e, ds41_kv_seq *seq, const int32_t *ids, size_t S, const float *last, size_t K,
                       size_t V, const ds41_draft_provider *prov, uint32_t max_k, int32_t *dec, float *dec_logits,
                       ds41_spec_stats *st, draft_rec **recs, size_t *n_recs, ds41_error *err) {
    int32_t *ctx = malloc((S + K + 1) * sizeof *ctx);
    float *rows = malloc((1 + DS41_SPEC_MAX_K) * V * sizeof *rows);
    if (!ctx || !rows) {
        free(ctx);
        free(rows);
        return ds41_fail(err, "out of memory");
    }
    memcpy(ctx, ids, S * sizeof *ctx);
    int rc = 0;
    for (size_t k = 0; k < K && rc == 0;) {
        dec[k] = ds41_argmax(last, V);
        ctx[S + k] = dec[k];
        const uint32_t want = (uint32_t)(K - k - 1 < max_k ? K - k - 1 : max_k);
        ds41_draft d;
        memset(&d, 0, sizeof d);
        if (want) {
            ds41_draft_request rq = {.seq = seq, .context = ctx, .n_context = S + k + 1, .last = dec[k], .max_k = want};
            if ((rc = prov->draft(prov->ctx, &rq, 1, &d, err)) != 0) break;
            if (d.k > want) d.k = want;
            if (d.k) {
                draft_rec *nr = realloc(*recs, (*n_recs + 1) * sizeof *nr);
                if (!nr) {
                    rc = ds41_fail(err, "out of memory");
                    break;
                }
                *recs = nr;
                draft_rec *r = &nr[(*n_recs)++];
                r->position = S + k + 1;
                r->k = d.k;
                memcpy(r->ids, d.ids, d.k * sizeof *d.ids);
                memcpy(r->conf, d.confidence, d.k * sizeof *d.confidence);
            }
        }
        int32_t feed[1 + DS41_SPEC_MAX_K];
        feed[0] = dec[k];
        memcpy(feed + 1, d.ids, d.k * sizeof *d.ids);
        if (ds41_engine_prefetch(e, seq, dec[k], err) != 0) {
            rc = -1;
            break;
        }
        if (d.k && (rc = ds41_kv_seq_journal_begin(seq, 1 + d.k, err)) != 0) break;
        ds41_fwd_item item = {.seq = seq, .ids = feed, .n_ids = 1 + d.k, .logits = rows, .spec_taps = prov->taps};
        if ((rc = ds41_forward(e, &item, 1, NULL, err)) != 0) break;
        memcpy(dec_logits + k * V, rows, V * sizeof *rows);
        k++;
        uint32_t acc = 0;
        while (acc < d.k && ds41_argmax(rows + acc * V, V) == d.ids[acc]) {
            dec[k] = d.ids[acc];
            ctx[S + k] = dec[k];
            memcpy(dec_logits + k * V, rows + (acc + 1) * V, V * sizeof *rows);
            k++;
            acc++;
        }
        if (d.k) {
            rc = ds41_kv_seq_rewind(seq, S + k, err);
            ds41_kv_seq_journal_end(seq);
            st->steps++;
            st->drafted += d.k;
            st->accepted += acc;
            st->hist[acc]++;
        }
        last = dec_logits + (k - 1) * V;
    }
    free(ctx);
    free(rows);
    return rc;
}

/* ,"speculative":{...}[,"drafts":[...]] (malloc'd). */
static char *spec_json(const ds41_spec_stats *st, const draft_rec *recs, size_t n, bool drafts) {
    ds41_buf b = {0};
    ds41_buf_printf(&b, ",\"speculative\":{\"steps\":%llu,\"drafted\":%llu,\"accepted\":%llu}",
                    (unsigned long long)st->steps, (unsigned long long)st->drafted, (unsigned long long)st->accepted);
    if (drafts) {
        ds41_buf_printf(&b, ",\"drafts\":[");
        for (size_t i = 0; i < n; i++) {
            ds41_buf_printf(&b, "%s{\"position\":%zu,\"ids\":[", i ? "," : "", recs[i].position);
            for (uint32_t j = 0; j < recs[i].k; j++) ds41_buf_printf(&b, j ? ",%d" : "%d", recs[i].ids[j]);
            ds41_buf_printf(&b, "],\"confidence\":[");
            for (uint32_t j = 0; j < recs[i].k; j++) ds41_buf_printf(&b, j ? ",%.9g" : "%.9g", (double)recs[i].conf[j]);
            ds41_buf_printf(&b, "]}");
        }
        ds41_buf_printf(&b, "]");
    }
    if (b.oom) {
        ds41_buf_free(&b);
        return NULL;
    }
    return b.data;
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

/* ---- --replay: a dump read back --------------------------------------------------------- */

typedef struct replay {
    uint8_t *file;
    size_t size;
    ds41_st_header hdr;
} replay;

static const ds41_tensor *replay_find(const replay *r, const char *name) {
    for (size_t i = 0; i < r->hdr.tensor_count; i++)
        if (strcmp(r->hdr.tensors[i].name, name) == 0) return &r->hdr.tensors[i];
    return NULL;
}

/* The payload of tensor `name` with dtype dt and shape d0 x d1 x d2 (d2 = 0: 2-d, d1 = 0: 1-d,
 * d0 = SIZE_MAX: any first dimension, returned in *n0). */
static const void *replay_tensor(const replay *r, const char *path, const char *name, ds41_dtype dt,
                                 size_t d0, size_t d1, size_t d2, size_t *n0, ds41_error *err) {
    const ds41_tensor *t = replay_find(r, name);
    const int nd = d2 ? 3 : d1 ? 2 : 1;
    if (!t) {
        ds41_fail(err, "%s: tensor '%s' is missing", path, name);
        return NULL;
    }
    if (t->dtype != dt || t->ndim != nd || (d0 != SIZE_MAX && (uint64_t)t->shape[0] != d0) ||
        (nd > 1 && (uint64_t)t->shape[1] != d1) || (nd > 2 && (uint64_t)t->shape[2] != d2)) {
        ds41_fail(err, "%s: tensor '%s' has the wrong dtype or shape for this model", path, name);
        return NULL;
    }
    if (t->file_offset % ds41_dtype_size(dt) != 0) {
        ds41_fail(err, "%s: tensor '%s' is not aligned to its element size", path, name);
        return NULL;
    }
    if (n0) *n0 = (size_t)t->shape[0];
    return r->file + t->file_offset;
}

static int replay_open(replay *r, const char *path, ds41_error *err) {
    memset(r, 0, sizeof *r);
    FILE *f = fopen(path, "rb");
    if (!f) return ds41_fail(err, "%s: %s", path, strerror(errno));
    int rc = -1;
    if (fseek(f, 0, SEEK_END) != 0) goto out;
    long sz = ftell(f);
    if (sz < 8 || fseek(f, 0, SEEK_SET) != 0) {
        ds41_fail(err, "%s: not a safetensors dump", path);
        goto out;
    }
    r->size = (size_t)sz;
    r->file = malloc(r->size);
    if (!r->file || fread(r->file, 1, r->size, f) != r->size) {
        ds41_fail(err, "%s: cannot read the dump", path);
        goto out;
    }
    rc = ds41_checkpoint_parse_header(r->file, r->size, r->size, path, &r->hdr, err);
out:
    fclose(f);
    return rc;
}

static void replay_close(replay *r) {
    ds41_checkpoint_header_free(&r->hdr);
    free(r->file);
}

/* Point part p (named name) at the dump's streams of every block. */
static int replay_part(const replay *r, const char *path, const ds41_model_config *c, const char *name,
                       part *p, ds41_error *err) {
    const size_t L = (size_t)c->n_layers, hc = (size_t)c->hc_mult, D = (size_t)c->dim;
    p->feed_h = calloc(L + 1, sizeof *p->feed_h);
    p->feed_pre = calloc(L + 1, sizeof *p->feed_pre);
    if (!p->feed_h || !p->feed_pre) return ds41_fail(err, "out of memory");
    char key[128];
    for (size_t l = 0; l < L; l++) {
        snprintf(key, sizeof key, "%s.h.%zu", name, l);
        if (!(p->feed_h[l] = replay_tensor(r, path, key, DS41_F32, p->S, hc, D, NULL, err))) return -1;
        snprintf(key, sizeof key, "%s.pre.%zu", name, l);
        if (!(p->feed_pre[l] = replay_tensor(r, path, key, DS41_F32, p->S, hc, 0, NULL, err))) return -1;
    }
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
        {"replay", required_argument, NULL, 'R'},
        {"speculative", required_argument, NULL, 'S'},
        {"speculative-oracle", no_argument, NULL, 'O'},
        {"drafts", no_argument, NULL, 'D'},
        DS41_BUDGET_LONGOPTS,
        DS41_BACKEND_LONGOPT,
        {NULL, 0, NULL, 0},
    };
    const char *model = NULL, *ids_arg = NULL, *dump = NULL, *out = NULL, *replay_path = NULL;
    int decode_given = 0, want_drafts = 0;
    size_t chunk = 0, K = 0;
    ds41_engine_opts eo = {.reference = false};
    ds41_budget_flags budgets = {.tool = "ds41-eval"};
    size_t threads = 0, speculative = 0;
    bool spec_oracle = false;
    const char *backend = NULL; /* --backend (NULL: auto) */
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
            decode_given = 1;
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
        case 'R': replay_path = optarg; break;
        case 'S':
            if (parse_size(optarg, &speculative) != 0 || speculative < 1 || speculative > DS41_SPEC_MAX_K) {
                fprintf(stderr, "ds41-eval: --speculative: expected 1..%u, got '%s'\n", DS41_SPEC_MAX_K, optarg);
                return 2;
            }
            break;
        case 'O': spec_oracle = true; break;
        case DS41_BACKEND_OPT:
            if (ds41_backend_flag_parse("ds41-eval", optarg) != 0) return 2;
            backend = optarg;
            break;
        case 'D': want_drafts = 1; break;
        case 'o': out = optarg; break;
        case 'h': usage(stdout); return 0;
        case 'V':
            puts("ds41-eval " DS41_VERSION);
            return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc || !model || !out || (!ids_arg) == !replay_path) {
        usage(stderr);
        return 2;
    }
    if (replay_path && (!dump || decode_given)) {
        fprintf(stderr,
                "ds41-eval: --replay needs --dump and takes the ids and decode steps from the dump\n");
        return 2;
    }
    if (speculative ? dump || replay_path : spec_oracle) {
        fprintf(stderr, speculative ? "ds41-eval: --speculative does not go with --dump or --replay\n"
                                    : "ds41-eval: --speculative-oracle needs --speculative N\n");
        return 2;
    }
    int32_t *ids = NULL;
    size_t S = 0;
    replay rp;
    memset(&rp, 0, sizeof rp);
    const int64_t *replay_dec = NULL;
    if (replay_path) {
        ds41_error rerr = {{0}};
        const int64_t *rids = NULL;
        if (replay_open(&rp, replay_path, &rerr) != 0 ||
            !(rids = replay_tensor(&rp, replay_path, "ids", DS41_I64, SIZE_MAX, 0, 0, &S, &rerr)) ||
            !(replay_dec =
                  replay_tensor(&rp, replay_path, "decode_ids", DS41_I64, SIZE_MAX, 0, 0, &K, &rerr))) {
            fprintf(stderr, "ds41-eval: --replay: %s\n", rerr.msg);
            replay_close(&rp);
            return 2;
        }
        ids = malloc((S ? S : 1) * sizeof *ids);
        if (!ids) {
            replay_close(&rp);
            return 1;
        }
        for (size_t i = 0; i < S; i++)
            ids[i] = rids[i] < INT32_MIN || rids[i] > INT32_MAX ? -1 : (int32_t)rids[i];
        for (size_t k = 0; k < K; k++)
            if (replay_dec[k] < INT32_MIN || replay_dec[k] > INT32_MAX) {
                fprintf(stderr, "ds41-eval: --replay: %s: decode_ids[%zu] is out of range\n", replay_path, k);
                replay_close(&rp);
                free(ids);
                return 2;
            }
        if (S == 0) {
            fprintf(stderr, "ds41-eval: --replay: %s: the dump has no ids\n", replay_path);
            replay_close(&rp);
            free(ids);
            return 2;
        }
    } else if (parse_ids(ids_arg, &ids, &S) != 0 || S == 0) {
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
        replay_close(&rp);
        return 2;
    }

    ds41_error err = {{0}};
    int status = 1;
    ds41_kv_pool *pool = NULL;
    ds41_kv_seq *seq = NULL;
    float *pre_logits = NULL, *dec_logits = NULL;
    int32_t *dec = NULL;
    drafts_out dr = {0};
    part *parts = NULL;
    /* Budgets: the flags, else --config's memory.*_cache_bytes, else auto. */
    ds41_budget_run run = {.kv_tokens = (uint64_t)S + K, .batch = 1};
    if (ds41_budget_flags_apply(&budgets, model, &run, &eo, NULL, 0) != 0) {
        free(ids);
        replay_close(&rp);
        return 2;
    }
    if (ds41_backend_flag_apply("ds41-eval", backend, &eo) != 0) {
        free(ids);
        replay_close(&rp);
        return 2;
    }
    ds41_engine *e = ds41_engine_load(model, &eo, &err);
    if (!e) {
        fprintf(stderr, "ds41-eval: %s\n", err.msg);
        free(ids);
        replay_close(&rp);
        return 2;
    }
    if (!eo.reference && eo.cpu.level != DS41_CPU_AUTO) {
        /* A cap above the machine is lowered: say so (tests skip such levels). */
        const ds41_cpu_level got = ds41_backend_cpu_level(ds41_engine_backend(e));
        if (got != eo.cpu.level && got != DS41_CPU_AUTO) /* AUTO: not a CPU backend (--backend) */
            fprintf(stderr, "ds41-eval: --cpu %s: this machine has no %s; running at %s\n",
                    ds41_cpu_level_name(eo.cpu.level), ds41_cpu_level_name(eo.cpu.level),
                    ds41_cpu_level_name(got));
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
    if (want_drafts && !speculative && !cfg->dspark_enabled) {
        fprintf(stderr, "ds41-eval: --drafts: %s has no DSpark stages (dspark_block_size 0)\n", model);
        status = 2;
        goto done;
    }
    if (want_drafts && !speculative) { /* with --speculative the blocks it feeds are written instead */
        dr.nd = (size_t)cfg->dspark_block_size;
        dr.ids = malloc((K ? K : 1) * dr.nd * sizeof *dr.ids);
        dr.conf = malloc((K ? K : 1) * dr.nd * sizeof *dr.conf);
        dr.pos = malloc((K ? K : 1) * sizeof *dr.pos);
        if (!dr.ids || !dr.conf || !dr.pos) goto oom;
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
    ds41_fwd_hooks hooks = {
        .stream = collect, .ctx = &col, .decision = collect_decision, .feed = replay_path ? feed_row : NULL};
    if (dump) {
        parts = calloc(K + 1, sizeof *parts);
        if (!parts) goto oom;
        if (part_alloc(&parts[0], cfg, S, S - 1) != 0) goto oom;
        for (size_t k = 1; k <= K; k++)
            if (part_alloc(&parts[k], cfg, 1, S + k - 1) != 0) goto oom;
    }
    if (replay_path) {
        char name[32];
        for (size_t k = 0; k <= K; k++) {
            if (k == 0)
                snprintf(name, sizeof name, "prefill");
            else
                snprintf(name, sizeof name, "decode.%zu", k - 1);
            if (replay_part(&rp, replay_path, cfg, name, &parts[k], &err) != 0) {
                fprintf(stderr, "ds41-eval: --replay: %s\n", err.msg);
                status = 2;
                goto done;
            }
        }
    }

    for (size_t off = 0; off < S; off += chunk) {
        ds41_fwd_item item = {.seq = seq,
                              .ids = ids + off,
                              .n_ids = S - off < chunk ? S - off : chunk,
                              .logits = pre_logits + off * V,
                              .spec_taps = dr.nd != 0};
        col.cur = dump ? &parts[0] : NULL;
        col.row_off = off;
        if (ds41_forward(e, &item, 1, dump ? &hooks : NULL, &err) != 0) goto fail;
    }
    const float *last = pre_logits + (S - 1) * V;
    for (size_t k = 0; k < K; k++) {
        dec[k] = replay_dec ? (int32_t)replay_dec[k] : ds41_argmax(last, V);
        if (dec[k] < 0 || (int64_t)dec[k] >= cfg->vocab_size) {
            ds41_fail(&err, "--replay: %s: decode_ids[%zu] = %d is outside the vocabulary", replay_path, k,
                      dec[k]);
            goto fail;
        }
        if (ds41_engine_prefetch(e, seq, dec[k], &err) != 0) goto fail;
        if (dr.nd) {
            /* The head's block from the token this step feeds (never fed back). */
            dr.pos[k] = ds41_kv_seq_tokens(seq) + 1;
            ds41_draft_req rq = {.seq = seq,
                                 .token = dec[k],
                                 .k = dr.nd,
                                 .ids = dr.ids + k * dr.nd,
                                 .confidence = dr.conf + k * dr.nd};
            if (ds41_dspark_draft(e, &rq, 1, &err) != 0) goto fail;
        }
        ds41_fwd_item item = {.seq = seq,
                              .ids = &dec[k],
                              .n_ids = 1,
                              .logits = dec_logits + k * V,
                              .spec_taps = dr.nd != 0};
        col.cur = dump ? &parts[k + 1] : NULL;
        col.row_off = 0;
        if (ds41_forward(e, &item, 1, dump ? &hooks : NULL, &err) != 0) goto fail;
        last = dec_logits + k * V;
    }
    if (col.oom) goto oom;
    if (speculative) {
        /* again from the prompt, speculatively (the plain steps above were the oracle's reference) */
        ds41_draft_provider prov;
        ds41_oracle *oracle = NULL;
        if (spec_oracle) {
            int32_t *ref = malloc((S + K) * sizeof *ref);
            oracle = ref ? ds41_oracle_new((uint32_t)V, &err) : NULL;
            if (!oracle) {
                free(ref);
                goto oom;
            }
            memcpy(ref, ids, S * sizeof *ref);
            memcpy(ref + S, dec, K * sizeof *ref);
            int arc = ds41_oracle_add(oracle, ref, S + K, &err);
            free(ref);
            if (arc != 0) {
                ds41_oracle_free(oracle);
                goto fail;
            }
            prov = ds41_oracle_provider(oracle);
        } else if (ds41_spec_head_provider(e, &prov, &err) != 0) {
            fprintf(stderr, "ds41-eval: --speculative: %s\n", err.msg);
            status = 2;
            goto done;
        } else if ((int64_t)speculative > cfg->dspark_block_size) {
            fprintf(stderr, "ds41-eval: --speculative: %zu is above the model's dspark_block_size %lld\n",
                    speculative, (long long)cfg->dspark_block_size);
            status = 2;
            goto done;
        }
        ds41_kv_seq_free(seq);
        seq = ds41_kv_seq_new(pool, &err);
        int src = seq ? 0 : -1;
        for (size_t off = 0; off < S && src == 0; off += chunk) {
            ds41_fwd_item item = {.seq = seq, .ids = ids + off, .n_ids = S - off < chunk ? S - off : chunk,
                                  .logits = pre_logits + off * V, .spec_taps = prov.taps};
            src = ds41_forward(e, &item, 1, NULL, &err);
        }
        ds41_spec_stats sst;
        memset(&sst, 0, sizeof sst);
        draft_rec *recs = NULL;
        size_t n_recs = 0;
        if (src == 0)
            src = spec_greedy(e, seq, ids, S, pre_logits + (S - 1) * V, K, V, &prov, (uint32_t)speculative, dec,
                              dec_logits, &sst, &recs, &n_recs, &err);
        ds41_oracle_free(oracle);
        char *extra = src == 0 ? spec_json(&sst, recs, n_recs, want_drafts != 0) : NULL;
        free(recs);
        if (src != 0) goto fail;
        if (!extra) goto oom;
        src = write_json(out, ids, S, pre_logits, dec, dec_logits, K, V, &dr, extra, &err);
        free(extra);
        if (src != 0) goto fail;
    } else if (write_json(out, ids, S, pre_logits, dec, dec_logits, K, V, &dr, NULL, &err) != 0) {
        goto fail;
    }
    if (dump) {
        for (size_t k = 0; k <= K; k++) pack_scores(&parts[k], (size_t)cfg->n_layers);
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
        for (size_t k = 0; k <= K; k++) part_free(&parts[k], (size_t)cfg->n_layers);
    free(parts);
    free(pre_logits);
    free(dec_logits);
    free(dec);
    free(dr.ids);
    free(dr.conf);
    free(dr.pos);
    ds41_kv_seq_free(seq);
    ds41_kv_pool_free(pool);
    ds41_engine_free(e);
    free(ids);
    replay_close(&rp);
    return status;
}
