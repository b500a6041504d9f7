/* DSpark draft head (REFERENCE §7, §10.7): the model's own drafter, three
 * `mtp.*` stages fed by taps of the backbone's target layers.
 *
 * Two halves:
 *  - In a forward call (engine/forward/forward.h), an item with spec_taps
 *    also computes, for every row, the taps (the stream entering each
 *    dspark_target_layer_ids block after any Engram, averaged over the hc
 *    copies), main_x = main_norm(main_proj(taps)) with stage 0's weights,
 *    and each stage's window KV of main_x, QDQ_fp8(rope(kv_norm(wkv(main_x))))
 *    at the row's position (the stage's rope: theta rope_theta, no YaRN).
 *    These go into the stage's window ring of the sequence (the kv cache's
 *    ring of layer n_layers + k, written with ds41_kv_ring_put like every
 *    other ring, so whatever journals ring writes covers them), at slot
 *    position % window_size, the last window_size rows of the item.  main_x
 *    itself is not kept: REFERENCE §7 uses it for nothing but that window KV.
 *  - ds41_dspark_draft: for a sequence that consumed positions 0..q and the
 *    token t sampled for position q+1, the draft block [t, noise x
 *    (block_size-1)] at positions q+1 .. q+block_size runs through every
 *    stage as a full block (hyper-connections, attention over the stage's
 *    ring positions max(0, q+1-window) .. q plus all block rows, no causal
 *    mask inside the block, MoE with the stage's experts), then the last
 *    stage's norm, the backbone head, the Markov correction row by row and
 *    the confidence.  Row i's corrected logits give the draft for position
 *    q+2+i; drafts are greedy (argmax, lowest id on ties, as ds41_argmax).
 *
 * What the draft reads: the stage rings at positions max(0, q+1-window) ..
 * q, i.e. what forward calls with spec_taps wrote for those positions.  A
 * sequence whose last window_size positions were not all fed with
 * spec_taps drafts from whatever its rings hold there (zeros for a new
 * sequence): valid arithmetic, meaningless drafts.  Rolling a sequence
 * back to fewer tokens needs its rings (stage rings included) restored for
 * the positions it keeps, as for the backbone's rings.
 *
 * What the draft changes: nothing of the sequence (tokens, compressed
 * entries, carries, Engram history, every ring: the draft rows' window KV is
 * computed for the block and dropped).  It uses the engine's scratch, so
 * the thread rule is ds41_forward's: one call at a time per engine, never
 * concurrently with ds41_forward.
 *
 * Arithmetic: every step is an op of the engine's table (engine/backend/ops.h),
 * so it runs on any backend; in the reference mode it is bit-exact against
 * tests/reference/ds41_ref.py forward_spec (decisions in
 * tests/reference/README.md).  The Markov correction and the argmax run on
 * the host on downloaded logits (fp32 additions). */
#ifndef DS41_ENGINE_DSPARK_H
#define DS41_ENGINE_DSPARK_H

#include "engine/forward/forward.h"

#include <stddef.h>
#include <stdint.h>

/* One sequence's draft request. */
typedef struct ds41_draft_req {
    ds41_kv_seq *seq; /* in: from a pool of this engine, ds41_kv_seq_tokens(seq) = q + 1 >= 1 */
    int32_t token;    /* in: the token sampled for position q + 1, in [0, vocab_size) */
    size_t k;         /* in: drafts wanted, 1 .. dspark_block_size (the block is computed whole) */
    int32_t *ids;     /* out: [k] the drafts for positions q+2 .. q+1+k */
    float
        *confidence; /* out (NULL: not wanted): [k] raw confidence logits ([x ; e_i] . w_conf, no sigmoid) */
    float *logits;   /* out (NULL: not wanted): [k][vocab] the Markov-corrected fp32 logits each draft is
                      * the argmax of (the draft distribution a sampler would use, q of a verifier) */
} ds41_draft_req;

/* Draft for every request, all in one batch (rows = n * block_size).
 * Errors (nothing written, no state changed): the model has no DSpark stages,
 * n == 0, a NULL seq or ids, a sequence at position 0 or listed twice, k
 * outside 1..dspark_block_size, a token outside the vocabulary, sequences of
 * different pools or of a pool made for another model; out of memory.  A
 * checkpoint shard lost under the mapping: ds41_forward's error. */
int ds41_dspark_draft(ds41_engine *e, ds41_draft_req *reqs, size_t n, ds41_error *err);

#endif
