/* The indexer's decisions for one query row (REFERENCE §2.10-2.11, §9.2, decision 8 of the numpy
 * side): the ranking torch.topk gives, candidate blocks and the index top-k.  Shared by every CPU
 * backend's index_blocks / index_topk ops (engine/backend/ops.h), which run them row by row, so
 * the decisions are the same bits on every backend and level (engine/backend/cpu/cpu_backend.h,
 * "Decisions").  Nothing here allocates: the sorts run through the caller's scratch. */
#ifndef DS41_ENGINE_INDEX_SELECT_H
#define DS41_ENGINE_INDEX_SELECT_H

#include <stddef.h>
#include <stdint.h>

/* torch.topk's order: order[0..n) <- 0..n-1 by score descending, equal scores by lower index, NaN
 * above everything (ties among NaN by lower index).  tmp: n int32 of scratch. */
void ds41_index_rank(const float *score, int32_t *order, int32_t *tmp, size_t n);

/* Candidate blocks of a row that reaches `reach` >= 1 entries with scores score[0..reach): block
 * j's score is the max of its `block` entries' scores (NaN wins), the newest block (holding entry
 * reach-1) pinned at +inf, into bscore[0..nb), nb = ceil(reach / block); allow[0..nb) <- 1 for the
 * top n_take blocks by ds41_index_rank whose score is not -inf, 0 for the others.  order, tmp:
 * nb int32 each of scratch. */
void ds41_index_blocks_row(const float *score, size_t reach, size_t block, size_t n_take, float *bscore,
                           uint8_t *allow, int32_t *order, int32_t *tmp);

/* The index top-k of a row (§2.10 steps 6-8): with allow non-NULL (a candidate user) the scores
 * of entries in blocks not allowed (allow[t / block] == 0) first become -inf, in place; then the
 * top min(k, reach) entries by ds41_index_rank (-inf picks kept), ascending, into sel.  Returns
 * their number.  order, tmp: reach int32 each of scratch. */
size_t ds41_index_topk_row(float *score, size_t reach, const uint8_t *allow, size_t block, size_t k,
                           int32_t *sel, int32_t *order, int32_t *tmp);

#endif
