/* Speculative decoding (issue 16): a draft provider guesses the next tokens of a sequence, one
 * forward call verifies them, and the output is exactly plain decoding's.
 *
 * A step of a speculating sequence (in ds41-generate, ds41-eval, ds41-bench and the scheduler's
 * continuous batching alike):
 *   1. the backbone step sampled token t (ds41_generation_step: t is pending, not fed);
 *   2. the provider drafts up to k tokens d1..dk after t (ds41_spec_plan asks it for
 *      ds41_spec_want tokens, cuts the block at the first row below the confidence threshold);
 *   3. the next forward call feeds [t, d1..dk] for that sequence with logits for every row, in the
 *      same batch as other sequences' rows, under a KV journal (ds41_spec_begin);
 *   4. ds41_spec_verify steps the generation row by row: row i's logits give the token after
 *      [t, d1..di] (ds41_generation_step_draft: greedy takes the argmax, temperature > 0 accepts
 *      with min(1, p/q) and draws from norm(max(0, p - q)) on rejection); while the token is the
 *      draft d(i+1) the next row is stepped too, else the block ends there; the last row's token
 *      (all k accepted) is the backbone's own next token.  Then the sequence is rewound to the
 *      rows that stand (engine/model/kv_cache.h journal).
 * Nothing of a rejected draft reaches the generation: the sampler's penalty history, the stop
 * matcher, the token counts and the streamed text only ever see the tokens that stand, in order,
 * each through the same step as plain decoding (so EOS, stop strings and max_tokens end a block
 * mid-way exactly as they end plain decoding).  The KV state is the only thing the rejected rows
 * touched, and the rewind leaves it as if they had never been fed.  So greedy speculative output
 * is plain greedy output, tokens and logits, whatever the drafts; seeded sampling is reproducible
 * (same seed, same drafts, same tokens) and has plain sampling's distribution.
 *
 * The last generated token is never fed (as in plain decoding): when a block ends on an accepted
 * draft that finished the generation (EOS, a stop), that row is rewound too.
 *
 * Adaptive length: a block stops at the first draft whose confidence is below
 * min_confidence; a sequence whose blocks keep being rejected backs off (after a block with no
 * accepted draft it skips drafting for 1, then 2, 4, ... up to max_backoff steps; an accepted
 * draft resets it), so useless drafts cost little. */
#ifndef DS41_ENGINE_SPECULATIVE_H
#define DS41_ENGINE_SPECULATIVE_H

#include "config/error.h"
#include "engine/forward/forward.h"
#include "engine/model/kv_cache.h"
#include "engine/serve/generate.h"
#include "engine/serve/sampler.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The longest back-off (steps without drafting after blocks of no accepted draft) the tools and
 * the daemon use: after n such blocks in a row a sequence drafts once every min(2^n, this) + 1
 * steps, so a head whose drafts are useless (random weights) costs a few percent. */
#define DS41_SPEC_MAX_BACKOFF 64u

/* Longest draft block (V4.1's DSpark drafts blocks of dspark_block_size = 5). */
#define DS41_SPEC_MAX_K 8u

/* ---- draft providers ------------------------------------------------------------------------ */

/* One sequence's draft request.  The provider may read the sequence (its KV state after the
 * backbone step, positions 0 .. ds41_kv_seq_tokens - 1, `last` not yet fed) but must not change
 * it. */
typedef struct ds41_draft_request {
    ds41_kv_seq *seq;
    const int32_t *context; /* every token of the sequence, prompt first; the last one is `last` */
    size_t n_context;
    int32_t last;   /* the token the backbone step sampled (context[n_context - 1]) */
    uint32_t max_k; /* drafts wanted at most (1 .. DS41_SPEC_MAX_K) */
} ds41_draft_request;

/* A provider's answer for one sequence. */
typedef struct ds41_draft {
    uint32_t k; /* drafts given, 0 .. max_k (0: none this step) */
    int32_t ids[DS41_SPEC_MAX_K];
    float confidence[DS41_SPEC_MAX_K]; /* per row, 0..1 (the provider's own estimate) */
    /* NULL: deterministic drafts (q one-hot on each id); else q[i * n_vocab ..] is row i's draft
     * distribution (ids[i] must have q > 0), owned by the provider, valid until its next call. */
    const float *q;
} ds41_draft;

/* A draft provider: draft() fills out[0..n) for reqs[0..n) in one call (a head drafts the batch
 * together).  Called on the engine thread between forward calls (a provider that runs its own
 * forward work may use the engine then).  Returns 0, or -1 with err (the sequences then decode
 * without drafts this step).  free (may be NULL) releases ctx. */
typedef struct ds41_draft_provider {
    const char *name;
    int (*draft)(void *ctx, const ds41_draft_request *reqs, size_t n, ds41_draft *out, ds41_error *err);
    void (*free)(void *ctx);
    void *ctx;
    /* The provider reads what the forward pass leaves for a draft head (the DSpark stage
     * windows): every forward item of a sequence it drafts for, prompt chunks included, is fed
     * with spec_taps (engine/forward/dspark.h). */
    bool taps;
} ds41_draft_provider;

/* The test oracle (tests, ds41-bench's full-acceptance figures, ds41-eval/ds41-generate's
 * --speculative-oracle): drafts read from reference continuations, so acceptance is what the
 * test chooses.  Not a model: the daemon never uses it.
 *   - ds41_oracle_add(o, ids, n): a reference token sequence (e.g. the prompt followed by the
 *     backbone's own greedy continuation).  A request whose context is a prefix of a reference
 *     gets that reference's next tokens as drafts (confidence 1), fewer where it ends, none when
 *     no reference matches.
 *   - corrupt_every > 0: every draft at a position p (its index in the reference) with
 *     p % corrupt_every == 0 is replaced by (id + 1) % n_vocab (partial acceptance; 1 rejects all).
 *   - ds41_oracle_set_q(o, q): drafts are instead drawn from the fixed distribution q[n_vocab]
 *     (from a PCG64 stream seeded with `seed`), reported with q: a provider with a non-trivial q
 *     for the sampling tests. */
typedef struct ds41_oracle ds41_oracle;
ds41_oracle *ds41_oracle_new(uint32_t n_vocab, ds41_error *err);
void ds41_oracle_free(ds41_oracle *o);
int ds41_oracle_add(ds41_oracle *o, const int32_t *ids, size_t n, ds41_error *err);
void ds41_oracle_set_corruption(ds41_oracle *o, uint32_t corrupt_every);
int ds41_oracle_set_q(ds41_oracle *o, const float *q, uint64_t seed, ds41_error *err);
/* The provider view of o (o stays the caller's: the provider's free is NULL). */
ds41_draft_provider ds41_oracle_provider(ds41_oracle *o);

/* ---- the loop ------------------------------------------------------------------------------- */

typedef struct ds41_spec_config {
    uint32_t max_k;       /* 1 .. DS41_SPEC_MAX_K */
    float min_confidence; /* a block stops at the first draft below it (0 = never) */
    uint32_t max_backoff; /* longest run of steps without drafting after rejections (0 = none) */
} ds41_spec_config;

/* Counters: steps = verification steps (blocks fed), drafted = drafts fed, accepted = drafts that
 * stood; hist[a] = blocks with a accepted drafts (a = 0 .. DS41_SPEC_MAX_K). */
typedef struct ds41_spec_stats {
    uint64_t steps, drafted, accepted;
    uint64_t hist[DS41_SPEC_MAX_K + 1];
} ds41_spec_stats;
void ds41_spec_stats_add(ds41_spec_stats *to, const ds41_spec_stats *from);

/* Per-sequence state: the planned block and the back-off. */
typedef struct ds41_spec_seq {
    uint32_t k;                       /* drafts planned for the next forward call */
    int32_t ids[1 + DS41_SPEC_MAX_K]; /* [t, d1..dk]: what that call feeds */
    const float *q;                   /* the provider's q rows (valid until its next call) */
    uint32_t skip, backoff;           /* steps still skipped, the last back-off length */
    uint32_t max_backoff_cap;         /* the config's max_backoff (set by ds41_spec_take) */
    uint64_t pos0;                    /* t's position (the journal's start) */
    ds41_spec_stats st;
} ds41_spec_seq;

/* Drafts to ask for g at this step (0 while backing off, or when the budget left -- max_tokens,
 * max_context -- has no room for a draft after the pending token).  Counts a skipped step. */
uint32_t ds41_spec_want(const ds41_spec_config *cfg, ds41_spec_seq *ss, const ds41_generation *g);

/* Take the provider's answer d for g (whose one pending token is t): the block [t, d1..dk] cut at
 * the first draft below the confidence threshold, stored in ss (ss->k = k, 0 = plain step). */
void ds41_spec_take(const ds41_spec_config *cfg, ds41_spec_seq *ss, const ds41_generation *g,
                    const ds41_draft *d);

/* After a verified block with `accepted` drafts standing: the back-off (none accepted: skip the
 * next 1, 2, 4, ... up to max_backoff_cap steps; any accepted: drafting again at once).  For
 * loops that verify on their own (ds41-bench); ds41_spec_verify calls it. */
void ds41_spec_backoff(ds41_spec_seq *ss, uint32_t accepted);

/* Before the forward call that feeds ss->ids[0 .. 1 + ss->k) to seq (logits for every row):
 * opens seq's journal.  Errors: ds41_kv_seq_journal_begin's. */
int ds41_spec_begin(ds41_spec_seq *ss, ds41_kv_seq *seq, ds41_error *err);

/* Called for every step's delta, in order (the text a client sees), with the logits row
 * [n_vocab] the step sampled from (valid during the call). */
typedef void (*ds41_spec_emit)(void *ctx, const ds41_generation *g, const ds41_generation_delta *d,
                               const float *logits);

/* After that forward call (and ds41_generation_mark_fed(g, 1) for t): step g over the rows'
 * logits[(1 + ss->k) * n_vocab] as described above, emit each step's delta, rewind seq to the
 * rows that stand and close its journal.  *n_steps = tokens generated (>= 1).  Errors (g is then
 * in ds41_generation_step's error state; seq's journal is closed, its state is the rows that
 * stood): a step failed, the rewind failed. */
int ds41_spec_verify(ds41_spec_seq *ss, ds41_generation *g, ds41_kv_seq *seq, const float *logits,
                     uint32_t n_vocab, ds41_sampler_scratch *scratch, ds41_spec_emit emit, void *emit_ctx,
                     size_t *n_steps, ds41_error *err);

/* The daemon's provider: the model's DSpark head.  Errors when the model has none
 * ("speculative decoding needs the model's DSpark head: dspark_block_size is 0").  It drafts
 * with ds41_dspark_draft (engine/forward/dspark.h) for the whole batch in one call: greedy
 * drafts (q one-hot), up to dspark_block_size, confidence = the logistic of the head's
 * confidence logit; taps is set (every item of a speculating sequence feeds the head's stage
 * windows). */
int ds41_spec_head_provider(ds41_engine *e, ds41_draft_provider *out, ds41_error *err);

/* One generation on one sequence to its end, with speculation when cfg and provider are given
 * (else plain decoding through the same code): the prompt in chunks of `chunk` tokens (0 = one
 * call), then a forward call per step feeding [t, drafts].  logits: room for
 * (1 + DS41_SPEC_MAX_K) * n_vocab floats.  emit (may be NULL) gets every step.  stats (may be
 * NULL) receives the sequence's counters.  Errors: the forward pass, a step, the provider (its
 * error fails the run: a test wants to know). */
int ds41_spec_generate(ds41_engine *e, ds41_kv_seq *seq, ds41_generation *g, size_t chunk,
                       const ds41_spec_config *cfg, const ds41_draft_provider *provider,
                       ds41_sampler_scratch *scratch, float *logits, ds41_spec_emit emit, void *emit_ctx,
                       ds41_spec_stats *stats, ds41_error *err);

/* Check a config (max_k 1 .. DS41_SPEC_MAX_K and <= block_size when block_size > 0, min_confidence
 * 0..1); errors name the field with prefix (e.g. "engine.speculative"). */
int ds41_spec_config_check(const ds41_spec_config *cfg, const char *prefix, ds41_error *err);

#endif
