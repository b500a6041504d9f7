/* The indexer's per-row decisions (index_select.h): moved out of the forward pass so that the
 * backends' ops make them for all rows of a step. */
#include "engine/backend/index_select.h"

#include <math.h>
#include <string.h>

/* Descending score, equal scores: lower index first.  NaN ranks above
 * everything (torch.topk treats NaN as the largest value). */
static int cmp_rank(int32_t a, int32_t b, const float *score) {
    const float sa = score[a], sb = score[b];
    const int na = isnan(sa), nb = isnan(sb);
    if (na != nb) return na ? -1 : 1;
    if (!na) {
        if (sa > sb) return -1;
        if (sa < sb) return 1;
    }
    return a < b ? -1 : (a > b ? 1 : 0);
}

/* Ascending index. */
static int cmp_index(int32_t a, int32_t b, const float *unused) {
    (void)unused;
    return a < b ? -1 : (a > b ? 1 : 0);
}

/* Sort a[0..n) of distinct indices by cmp, a total order on them (ties are
 * broken by index), so any correct sort gives the same result as qsort did.
 * A bottom-up merge sort through tmp[n] of the caller's scratch: glibc's qsort
 * allocates a buffer of its own for arrays over 1 KiB. */
static void sort_i32(int32_t *a, int32_t *tmp, size_t n, int (*cmp)(int32_t, int32_t, const float *),
                     const float *score) {
    int32_t *src = a, *dst = tmp;
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            const size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) dst[k++] = cmp(src[j], src[i], score) < 0 ? src[j++] : src[i++];
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, n * sizeof *a);
}

void ds41_index_rank(const float *score, int32_t *order, int32_t *tmp, size_t n) {
    for (size_t i = 0; i < n; i++) order[i] = (int32_t)i;
    sort_i32(order, tmp, n, cmp_rank, score);
}

void ds41_index_blocks_row(const float *score, size_t reach, size_t block, size_t n_take, float *bscore,
                           uint8_t *allow, int32_t *order, int32_t *tmp) {
    const size_t nb = (reach + block - 1) / block;
    for (size_t blk = 0; blk < nb; blk++) {
        float mx = -INFINITY;
        for (size_t t = blk * block; t < reach && t < (blk + 1) * block; t++)
            if (score[t] > mx || isnan(score[t])) mx = score[t];
        bscore[blk] = mx;
        allow[blk] = 0;
    }
    bscore[(reach - 1) / block] = INFINITY;
    ds41_index_rank(bscore, order, tmp, nb);
    const size_t take = n_take < nb ? n_take : nb;
    for (size_t i = 0; i < take; i++)
        if (!(bscore[order[i]] == -INFINITY)) allow[order[i]] = 1;
}

size_t ds41_index_topk_row(float *score, size_t reach, const uint8_t *allow, size_t block, size_t k,
                           int32_t *sel, int32_t *order, int32_t *tmp) {
    if (allow)
        for (size_t t = 0; t < reach; t++)
            if (!allow[t / block]) score[t] = -INFINITY;
    const size_t n = k < reach ? k : reach;
    ds41_index_rank(score, order, tmp, reach);
    memcpy(sel, order, n * sizeof *sel);
    sort_i32(sel, tmp, n, cmp_index, NULL);
    return n;
}
