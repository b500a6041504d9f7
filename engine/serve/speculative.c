/* Speculative decoding's loop and the test oracle (see speculative.h). */
#include "engine/serve/speculative.h"

#include "engine/forward/dspark.h"
#include "engine/model/pcg64.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the test oracle ------------------------------------------------------------------------ */

typedef struct oracle_ref {
    int32_t *ids;
    size_t n;
} oracle_ref;

struct ds41_oracle {
    uint32_t n_vocab;
    oracle_ref *refs;
    size_t n_refs;
    uint32_t corrupt_every;
    float *q;     /* [n_vocab] or NULL */
    float *q_out; /* [DS41_SPEC_MAX_K * n_vocab] rows handed out */
    ds41_pcg64 rng;
};

ds41_oracle *ds41_oracle_new(uint32_t n_vocab, ds41_error *err) {
    ds41_oracle *o = calloc(1, sizeof *o);
    if (!o) {
        ds41_fail(err, "oracle: out of memory");
        return NULL;
    }
    o->n_vocab = n_vocab;
    return o;
}

void ds41_oracle_free(ds41_oracle *o) {
    if (!o) return;
    for (size_t i = 0; i < o->n_refs; i++) free(o->refs[i].ids);
    free(o->refs);
    free(o->q);
    free(o->q_out);
    free(o);
}

int ds41_oracle_add(ds41_oracle *o, const int32_t *ids, size_t n, ds41_error *err) {
    oracle_ref *r = realloc(o->refs, (o->n_refs + 1) * sizeof *r);
    if (!r) return ds41_fail(err, "oracle: out of memory");
    o->refs = r;
    int32_t *c = malloc((n ? n : 1) * sizeof *c);
    if (!c) return ds41_fail(err, "oracle: out of memory");
    if (n) memcpy(c, ids, n * sizeof *c);
    o->refs[o->n_refs++] = (oracle_ref){c, n};
    return 0;
}

void ds41_oracle_set_corruption(ds41_oracle *o, uint32_t corrupt_every) {
    o->corrupt_every = corrupt_every;
}

int ds41_oracle_set_q(ds41_oracle *o, const float *q, uint64_t seed, ds41_error *err) {
    double total = 0;
    for (uint32_t i = 0; i < o->n_vocab; i++) {
        if (!(q[i] >= 0.0f)) return ds41_fail(err, "oracle: q[%u] is negative or NaN", i);
        total += q[i];
    }
    if (!(total > 0)) return ds41_fail(err, "oracle: q has no mass");
    free(o->q);
    free(o->q_out);
    o->q = malloc((size_t)o->n_vocab * sizeof *o->q);
    o->q_out = malloc((size_t)DS41_SPEC_MAX_K * o->n_vocab * sizeof *o->q_out);
    if (!o->q || !o->q_out) return ds41_fail(err, "oracle: out of memory");
    for (uint32_t i = 0; i < o->n_vocab; i++) o->q[i] = (float)(q[i] / total);
    ds41_seedseq_pcg64(&o->rng, seed);
    return 0;
}

static int32_t oracle_draw(ds41_oracle *o) {
    const double u = (double)(ds41_pcg64_next64(&o->rng) >> 11) * 0x1p-53;
    double below = 0;
    int32_t last = 0;
    for (uint32_t i = 0; i < o->n_vocab; i++) {
        if (o->q[i] <= 0.0f) continue;
        last = (int32_t)i;
        below += o->q[i];
        if (below > u) return (int32_t)i;
    }
    return last;
}

static int oracle_draft(void *ctx, const ds41_draft_request *reqs, size_t n, ds41_draft *out,
                        ds41_error *err) {
    (void)err;
    ds41_oracle *o = ctx;
    for (size_t r = 0; r < n; r++) {
        const ds41_draft_request *q = &reqs[r];
        ds41_draft *d = &out[r];
        memset(d, 0, sizeof *d);
        const uint32_t max_k = q->max_k < DS41_SPEC_MAX_K ? q->max_k : DS41_SPEC_MAX_K;
        if (o->q) {
            /* one q for every row: the rows of this answer share o->q_out (valid until the next call) */
            for (uint32_t i = 0; i < max_k; i++) {
                d->ids[i] = oracle_draw(o);
                d->confidence[i] = 1.0f;
                memcpy(o->q_out + (size_t)i * o->n_vocab, o->q, (size_t)o->n_vocab * sizeof *o->q);
            }
            d->k = max_k;
            d->q = o->q_out;
            continue;
        }
        for (size_t i = 0; i < o->n_refs; i++) {
            const oracle_ref *ref = &o->refs[i];
            if (ref->n < q->n_context || memcmp(ref->ids, q->context, q->n_context * sizeof *q->context) != 0)
                continue;
            while (d->k < max_k && q->n_context + d->k < ref->n) {
                const size_t p = q->n_context + d->k;
                int32_t id = ref->ids[p];
                if (o->corrupt_every && p % o->corrupt_every == 0)
                    id = (int32_t)(((uint32_t)id + 1) % o->n_vocab);
                d->ids[d->k] = id;
                d->confidence[d->k] = 1.0f;
                d->k++;
            }
            break;
        }
    }
    return 0;
}

ds41_draft_provider ds41_oracle_provider(ds41_oracle *o) {
    return (ds41_draft_provider){.name = "oracle", .draft = oracle_draft, .free = NULL, .ctx = o};
}

/* ---- the loop ------------------------------------------------------------------------------- */

void ds41_spec_stats_add(ds41_spec_stats *to, const ds41_spec_stats *from) {
    to->steps += from->steps;
    to->drafted += from->drafted;
    to->accepted += from->accepted;
    for (unsigned i = 0; i <= DS41_SPEC_MAX_K; i++) to->hist[i] += from->hist[i];
}

int ds41_spec_config_check(const ds41_spec_config *cfg, const char *prefix, ds41_error *err) {
    if (cfg->max_k < 1 || cfg->max_k > DS41_SPEC_MAX_K)
        return ds41_fail(err, "%s.max_draft: %u is outside 1..%u", prefix, cfg->max_k, DS41_SPEC_MAX_K);
    if (!(cfg->min_confidence >= 0.0f && cfg->min_confidence <= 1.0f))
        return ds41_fail(err, "%s.min_confidence: %g is outside 0..1", prefix, (double)cfg->min_confidence);
    return 0;
}

uint32_t ds41_spec_want(const ds41_spec_config *cfg, ds41_spec_seq *ss, const ds41_generation *g) {
    if (ss->skip > 0) {
        ss->skip--;
        return 0;
    }
    uint64_t k = cfg->max_k;
    /* drafts past the last token the generation can make are wasted rows */
    const uint64_t done = ds41_generation_completion_tokens(g);
    const uint32_t max_tokens = ds41_generation_max_tokens(g), max_context = ds41_generation_max_context(g);
    if (max_tokens && k > (max_tokens > done ? max_tokens - done : 0))
        k = max_tokens > done ? max_tokens - done : 0;
    size_t n = 0;
    (void)ds41_generation_tokens(g, &n);
    if (max_context && k + n > max_context) k = max_context > n ? max_context - n : 0;
    return (uint32_t)k;
}

void ds41_spec_take(const ds41_spec_config *cfg, ds41_spec_seq *ss, const ds41_generation *g,
                    const ds41_draft *d) {
    const int32_t *pending = NULL;
    ss->k = 0;
    ss->q = NULL;
    if (ds41_generation_pending(g, &pending) != 1) return;
    ss->ids[0] = pending[0];
    uint32_t k = d->k < cfg->max_k ? d->k : cfg->max_k;
    uint32_t i = 0;
    for (; i < k; i++) {
        if (d->confidence[i] < cfg->min_confidence) break;
        ss->ids[1 + i] = d->ids[i];
    }
    ss->k = i;
    ss->q = d->q;
    ss->max_backoff_cap = cfg->max_backoff;
}

void ds41_spec_backoff(ds41_spec_seq *ss, uint32_t accepted) {
    if (accepted == 0) {
        ss->backoff = ss->backoff ? ss->backoff * 2 : 1;
        if (ss->backoff > ss->max_backoff_cap) ss->backoff = ss->max_backoff_cap;
        ss->skip = ss->backoff;
    } else {
        ss->backoff = 0;
    }
}

int ds41_spec_begin(ds41_spec_seq *ss, ds41_kv_seq *seq, ds41_error *err) {
    ss->pos0 = ds41_kv_seq_tokens(seq);
    if (ss->k == 0) return 0;
    return ds41_kv_seq_journal_begin(seq, 1 + ss->k, err);
}

int ds41_spec_verify(ds41_spec_seq *ss, ds41_generation *g, ds41_kv_seq *seq, const float *logits,
                     uint32_t n_vocab, ds41_sampler_scratch *scratch, ds41_spec_emit emit, void *emit_ctx,
                     size_t *n_steps, ds41_error *err) {
    const uint32_t k = ss->k;
    uint32_t kept = 0, accepted = 0; /* drafts fed that stand; drafts the output took */
    size_t steps = 0;
    int rc = 0;
    for (uint32_t i = 0; i <= k; i++) {
        ds41_generation_delta d;
        bool acc = false;
        const float *row = logits + (size_t)i * n_vocab;
        if (i < k)
            rc = ds41_generation_step_draft(g, row, scratch, (uint32_t)ss->ids[1 + i],
                                            ss->q ? ss->q + (size_t)i * n_vocab : NULL, &d, &acc, err);
        else
            rc = ds41_generation_step(g, row, scratch, &d, err);
        if (rc != 0) break;
        steps++;
        if (emit) emit(emit_ctx, g, &d, row);
        if (!acc) break;
        accepted++;
        if (ds41_generation_finished(g)) break; /* the last token is never fed */
        ds41_generation_mark_fed(g, 1);
        kept++;
    }
    if (k > 0) {
        ds41_error rerr = {{0}};
        if (ds41_kv_seq_rewind(seq, ss->pos0 + 1 + kept, &rerr) != 0 && rc == 0) {
            *err = rerr;
            rc = -1;
        }
        ds41_kv_seq_journal_end(seq);
        ss->st.steps++;
        ss->st.drafted += k;
        ss->st.accepted += accepted;
        ss->st.hist[accepted]++;
        ds41_spec_backoff(ss, accepted);
    }
    ss->k = 0;
    if (n_steps) *n_steps = steps;
    return rc;
}

/* ---- the DSpark head ------------------------------------------------------------------------- */

/* The model's own drafter (engine/forward/dspark.h) for the batch in one call: greedy drafts, so
 * q is one-hot (NULL), which speculative sampling handles exactly (accept with p(d), else draw
 * from p without d).  The head's confidence is a raw logit; the provider's scale is 0..1, so it
 * goes through the logistic function. */
static int head_draft(void *ctx, const ds41_draft_request *reqs, size_t n, ds41_draft *out, ds41_error *err) {
    ds41_engine *e = ctx;
    const uint32_t block = (uint32_t)ds41_engine_config(e)->dspark_block_size;
    ds41_draft_req *rq = calloc(n ? n : 1, sizeof *rq);
    if (!rq) return ds41_fail(err, "dspark: out of memory");
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        memset(&out[i], 0, sizeof out[i]);
        uint32_t k = reqs[i].max_k < block ? reqs[i].max_k : block;
        if (k > DS41_SPEC_MAX_K) k = DS41_SPEC_MAX_K;
        if (k == 0 || ds41_kv_seq_tokens(reqs[i].seq) == 0) continue;
        out[i].k = k;
        rq[m++] = (ds41_draft_req){.seq = reqs[i].seq,
                                   .token = reqs[i].last,
                                   .k = k,
                                   .ids = out[i].ids,
                                   .confidence = out[i].confidence};
    }
    int rc = m ? ds41_dspark_draft(e, rq, m, err) : 0;
    free(rq);
    for (size_t i = 0; i < n; i++) {
        if (rc != 0) {
            out[i].k = 0;
            continue;
        }
        for (uint32_t j = 0; j < out[i].k; j++)
            out[i].confidence[j] = (float)(1.0 / (1.0 + exp(-(double)out[i].confidence[j])));
    }
    return rc;
}

int ds41_spec_head_provider(ds41_engine *e, ds41_draft_provider *out, ds41_error *err) {
    const ds41_model_config *c = ds41_engine_config(e);
    if (c->dspark_block_size <= 0)
        return ds41_fail(err, "speculative decoding needs the model's DSpark head: dspark_block_size is 0");
    *out = (ds41_draft_provider){.name = "dspark", .draft = head_draft, .free = NULL, .ctx = e, .taps = true};
    return 0;
}

/* ---- one generation on one sequence ------------------------------------------------------------ */

int ds41_spec_generate(ds41_engine *e, ds41_kv_seq *seq, ds41_generation *g, size_t chunk,
                       const ds41_spec_config *cfg, const ds41_draft_provider *provider,
                       ds41_sampler_scratch *scratch, float *logits, ds41_spec_emit emit, void *emit_ctx,
                       ds41_spec_stats *stats, ds41_error *err) {
    const uint32_t nv = (uint32_t)ds41_engine_config(e)->vocab_size;
    ds41_spec_seq ss;
    memset(&ss, 0, sizeof ss);
    int rc = 0;
    /* the prompt (or what the prefix cache left of it) */
    const int32_t *pending;
    size_t n = ds41_generation_pending(g, &pending);
    while (n > 0 && rc == 0) {
        const size_t k = chunk && n > chunk ? chunk : n;
        ds41_fwd_item item = {.seq = seq,
                              .ids = pending,
                              .n_ids = k,
                              .logits = k == n ? logits : NULL,
                              .logits_last_only = true,
                              .spec_taps = provider && provider->taps};
        rc = ds41_forward(e, &item, 1, NULL, err);
        if (rc == 0) ds41_generation_mark_fed(g, k);
        n = ds41_generation_pending(g, &pending);
    }
    if (rc == 0 && ds41_generation_wants_logits(g)) {
        ds41_generation_delta d;
        rc = ds41_generation_step(g, logits, scratch, &d, err);
        if (rc == 0 && emit) emit(emit_ctx, g, &d, logits);
    }
    while (rc == 0 && !ds41_generation_finished(g)) {
        ss.k = 0;
        if (ds41_generation_pending(g, &pending) != 1) return ds41_fail(err, "speculative: no token to feed");
        ss.ids[0] = pending[0];
        const uint32_t want = cfg && provider ? ds41_spec_want(cfg, &ss, g) : 0;
        if (want > 0) {
            size_t n_ctx = 0;
            const int32_t *ctx = ds41_generation_tokens(g, &n_ctx);
            ds41_draft_request rq = {
                .seq = seq, .context = ctx, .n_context = n_ctx, .last = pending[0], .max_k = want};
            ds41_draft d;
            memset(&d, 0, sizeof d);
            rc = provider->draft(provider->ctx, &rq, 1, &d, err);
            if (rc != 0) break;
            ds41_spec_take(cfg, &ss, g, &d);
        }
        rc = ds41_spec_begin(&ss, seq, err);
        if (rc != 0) break;
        ds41_fwd_item item = {
            .seq = seq, .ids = ss.ids, .n_ids = 1 + ss.k, .logits = logits, .spec_taps = provider && provider->taps};
        rc = ds41_forward(e, &item, 1, NULL, err);
        if (rc != 0) {
            ds41_kv_seq_journal_end(seq);
            break;
        }
        ds41_generation_mark_fed(g, 1);
        rc = ds41_spec_verify(&ss, g, seq, logits, nv, scratch, emit, emit_ctx, NULL, err);
    }
    if (stats) *stats = ss.st;
    return rc;
}
