// The attention family's kernels (cuda/op_attn.h) over the arithmetic of
// cuda/num_attn.h, in the decomposition cuda/emu_attn.c repeats on the host:
//  - act_quant_fp8, index_query, kv_pack: a thread per quantization block;
//    compress_pool: a thread per (group, channel);
//  - index_scores: a warp per (row, entry), lanes split the key's elements
//    (lane l: l, l+32, ...), __shfl_xor_sync butterfly 16..1;
//  - index_blocks, index_topk: a block per row; block maxima a thread per
//    candidate block; the top n by an 8-pass radix select over the 64-bit
//    rank keys (integer histograms in shared memory: exact counts, so the
//    result does not depend on the order the threads add them), then a
//    ballot compaction in index order;
//  - sparse_attn / attend: a block of 4 warps per (query row, 4 heads);
//    per chunk of 64 rows the rows' addresses once, then per head: a warp
//    per row for the scores, one thread for the running max / corr / den
//    (sequential, as the reference), a thread per channel for PV.
// Everything launches on the op context's stream and never syncs; no atomics
// but the integer histogram counts.
#include "cuda/op_attn.h"

#include <cuda_runtime.h>

namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;

inline cudaStream_t stream_of(ds41_cuda_ctx *c) {
    return (cudaStream_t)c->stream;
}

inline unsigned blocks_for(size_t n, unsigned per) {
    return (unsigned)((n + per - 1) / per);
}

// ---- step quantizers ------------------------------------------------------------------

__global__ void k_act_quant(const float *x, size_t M, size_t n, uint8_t *out, size_t out_stride) {
    const size_t nb = (n + 31) / 32, t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= M * nb) return;
    const size_t m = t / nb;
    ds41_na_act_quant_block(x + m * n, n, t % nb, out + m * out_stride, out + m * out_stride + n);
}

__global__ void k_index_query(float *q, size_t qn, float *w, size_t wn, size_t M, float scale) {
    const size_t nb = (qn + 31) / 32, t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < M * nb)
        ds41_na_fp4_qdq_block(q + (t / nb) * qn, qn, t % nb);
    else if (t - M * nb < M * wn)
        w[t - M * nb] = ds41_hd_bf16_round(ds41_na_fmul(w[t - M * nb], scale));
}

__global__ void k_kv_pack(size_t ld, size_t kd, size_t latent_bytes, size_t entry_bytes, const float *latent,
                          const float *key, size_t n, uint8_t *out) {
    const size_t nl = (ld + 15) / 16, nk = (kd + 31) / 32, t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * (nl + nk)) return;
    const size_t i = t / (nl + nk), b = t % (nl + nk);
    uint8_t *e = out + i * entry_bytes;
    if (b < nl)
        ds41_na_latent_block(latent + i * ld, ld, b, e, e + ld / 2);
    else
        ds41_na_key_block(key + i * kd, kd, b - nl, e + latent_bytes, e + latent_bytes + kd / 2);
}

__global__ void k_compress_pool(const float *kv, const float *score, size_t n, int ratio, size_t hd,
                                float *pooled) {
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * hd) return;
    const size_t g = t / hd, group = (size_t)ratio * hd;
    pooled[t] = ds41_na_pool_channel(kv + g * group, score + g * group, ratio, hd, t % hd);
}

// ---- index scores ----------------------------------------------------------------------

constexpr unsigned kScoreWarps = 8;

__device__ double warp_tree(double v) {
    for (unsigned o = DS41_NA_WARP / 2; o; o >>= 1) v = ds41_na_dadd(v, __shfl_xor_sync(kFull, v, (int)o));
    return v;
}

__global__ void k_index_scores(const float *q, const float *w, int n_heads, int dim,
                               const uint8_t *const *pages, const size_t *row_table, const uint32_t *reach,
                               uint32_t per, size_t entry_bytes, size_t latent_bytes, float *score,
                               size_t score_stride) {
    const size_t m = blockIdx.y, t = (size_t)blockIdx.x * kScoreWarps + threadIdx.x / DS41_NA_WARP;
    const unsigned lane = threadIdx.x % DS41_NA_WARP;
    if (t >= reach[m]) return; // the whole warp leaves together
    const size_t D = (size_t)dim;
    const uint8_t *k = pages[row_table[m] + t / per] + (t % per) * entry_bytes + latent_bytes;
    double hsum = 0.0;
    for (int h = 0; h < n_heads; h++) {
        const float *qh = q + (m * (size_t)n_heads + (size_t)h) * D;
        double s = 0.0;
        for (size_t i = lane; i < D; i += DS41_NA_WARP)
            s = ds41_na_dacc(s, qh[i], ds41_na_key_value(k, D, i));
        hsum =
            ds41_na_dadd(hsum, (double)ds41_na_index_term(warp_tree(s), w[m * (size_t)n_heads + (size_t)h]));
    }
    if (lane == 0) score[m * score_stride + t] = ds41_hd_bf16_round((float)hsum);
}

// ---- decisions ----------------------------------------------------------------------------

constexpr unsigned kSelThreads = 256;

// The n-th largest rank key of a[0..len) (1 <= n <= len), every thread of the
// block calling (cuda/emu_attn.c select_nth is the same passes).
__device__ uint64_t block_select(const float *a, size_t len, uint32_t n) {
    __shared__ uint32_t hist[256];
    __shared__ uint64_t prefix;
    __shared__ uint32_t r;
    if (threadIdx.x == 0) {
        prefix = 0;
        r = n;
    }
    for (unsigned d = 8; d-- > 0;) {
        for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const uint64_t pre = prefix;
        for (size_t i = threadIdx.x; i < len; i += blockDim.x) {
            const uint64_t key = ds41_na_rank_key64(a[i], (uint32_t)i);
            if (ds41_na_select_match(key, pre, d)) atomicAdd(&hist[(key >> (8 * d)) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint32_t rr = r;
            prefix = (pre << 8) | ds41_na_select_bin(hist, &rr);
            r = rr;
        }
        __syncthreads();
    }
    return prefix;
}

// out[0..) <- the indices i < len with key >= T, ascending.
__device__ void block_compact(const float *a, size_t len, uint64_t T, int32_t *out) {
    __shared__ uint32_t warp_n[kSelThreads / DS41_NA_WARP];
    __shared__ size_t base;
    const unsigned lane = threadIdx.x % DS41_NA_WARP, wi = threadIdx.x / DS41_NA_WARP;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    for (size_t c0 = 0; c0 < len; c0 += blockDim.x) {
        const size_t i = c0 + threadIdx.x;
        const bool flag = i < len && ds41_na_rank_key64(a[i], (uint32_t)i) >= T;
        const unsigned ballot = __ballot_sync(kFull, flag);
        if (lane == 0) warp_n[wi] = (uint32_t)__popc(ballot);
        __syncthreads();
        size_t off = base;
        for (unsigned v = 0; v < wi; v++) off += warp_n[v];
        if (flag) out[off + (size_t)__popc(ballot & ((1u << lane) - 1u))] = (int32_t)i;
        __syncthreads();
        if (threadIdx.x == 0)
            for (unsigned v = 0; v < blockDim.x / DS41_NA_WARP; v++) base += warp_n[v];
        __syncthreads();
    }
}

__global__ void k_index_blocks(const float *score, size_t score_stride, const uint32_t *reach, size_t block,
                               size_t n_take, float *bscore, size_t bscore_stride, uint8_t *allow,
                               size_t allow_stride) {
    const size_t m = blockIdx.x, r = reach[m];
    uint8_t *al = allow + m * allow_stride;
    for (size_t j = threadIdx.x; j < allow_stride; j += blockDim.x) al[j] = 0;
    if (!r) return; // uniform over the block
    const float *s = score + m * score_stride;
    float *bs = bscore + m * bscore_stride;
    const size_t nb = (r + block - 1) / block;
    for (size_t j = threadIdx.x; j < nb; j += blockDim.x) {
        float mx = -INFINITY;
        for (size_t t = j * block; t < r && t < (j + 1) * block; t++) mx = ds41_na_block_max_step(mx, s[t]);
        bs[j] = j == nb - 1 ? INFINITY : mx;
    }
    __syncthreads();
    const size_t take = n_take < nb ? n_take : nb;
    if (!take) return;
    const uint64_t T = take < nb ? block_select(bs, nb, (uint32_t)take) : 0;
    for (size_t j = threadIdx.x; j < nb; j += blockDim.x)
        if (ds41_na_rank_key64(bs[j], (uint32_t)j) >= T && !(bs[j] == -INFINITY)) al[j] = 1;
}

__global__ void k_index_topk(float *score, size_t score_stride, const uint32_t *reach, const uint8_t *allow,
                             size_t allow_stride, size_t block, size_t k, int32_t *sel, uint32_t *count) {
    const size_t m = blockIdx.x, r = reach[m];
    float *s = score + m * score_stride;
    if (allow)
        for (size_t t = threadIdx.x; t < r; t += blockDim.x)
            if (!allow[m * allow_stride + t / block]) s[t] = -INFINITY;
    __syncthreads();
    const size_t n = k < r ? k : r;
    if (threadIdx.x == 0) count[m] = (uint32_t)n;
    if (!n) return;
    const uint64_t T = n < r ? block_select(s, r, (uint32_t)n) : 0;
    block_compact(s, r, T, sel + m * k);
}

// ---- attention ---------------------------------------------------------------------------

constexpr unsigned kAttnThreads = 128, kAttnWarps = kAttnThreads / DS41_NA_WARP;

// Block (m, group): heads [group * 4, +4) of query m; dynamic shared memory:
// 4 x hd floats of accumulators.
__global__ void k_attn(ds41_na_attn_src src, const float *q, int n_heads, int head_dim, const float *sink,
                       float scale, float *out) {
    extern __shared__ float acc[];
    __shared__ const uint8_t *rows[DS41_NA_CHUNK];
    __shared__ int isw[DS41_NA_CHUNK];
    __shared__ float z[DS41_NA_CHUNK], p[DS41_NA_CHUNK], pb[DS41_NA_CHUNK];
    __shared__ float mx[DS41_CUDA_ATTN_HEADS], den[DS41_CUDA_ATTN_HEADS], m_new, corr;
    const size_t m = blockIdx.x, hd = (size_t)head_dim, H = (size_t)n_heads;
    const size_t h0 = (size_t)blockIdx.y * DS41_CUDA_ATTN_HEADS;
    const size_t nh = H - h0 < DS41_CUDA_ATTN_HEADS ? H - h0 : DS41_CUDA_ATTN_HEADS;
    const unsigned lane = threadIdx.x % DS41_NA_WARP, wi = threadIdx.x / DS41_NA_WARP;
    const float *qm = q + m * H * hd;
    size_t nw, ncomp;
    ds41_na_attn_counts(&src, m, &nw, &ncomp);
    const size_t total = nw + ncomp;
    if (threadIdx.x < nh) {
        mx[threadIdx.x] = -1e30f;
        den[threadIdx.x] = 0.0f;
    }
    for (size_t i = threadIdx.x; i < nh * hd; i += blockDim.x) acc[i] = 0.0f;
    for (size_t c0 = 0; c0 < total; c0 += DS41_NA_CHUNK) {
        const size_t nc = total - c0 < DS41_NA_CHUNK ? total - c0 : DS41_NA_CHUNK;
        __syncthreads();
        if (threadIdx.x < nc) {
            rows[threadIdx.x] = ds41_na_attn_row(&src, m, c0 + threadIdx.x, nw);
            isw[threadIdx.x] = c0 + threadIdx.x < nw;
        }
        __syncthreads();
        for (size_t g = 0; g < nh; g++) {
            const float *qh = qm + (h0 + g) * hd;
            for (size_t j = wi; j < nc; j += kAttnWarps) {
                double s = 0.0;
                for (size_t d = lane; d < hd; d += DS41_NA_WARP)
                    s = ds41_na_dacc(s, qh[d], ds41_na_row_value(rows[j], isw[j], hd, d));
                s = warp_tree(s);
                if (lane == 0) z[j] = ds41_na_fmul((float)s, scale);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                m_new = ds41_na_chunk_max(mx[g], z, nc);
                corr = ds41_na_exp(ds41_na_fsub(mx[g], m_new));
            }
            __syncthreads();
            if (threadIdx.x < nc) p[threadIdx.x] = ds41_na_prob(z[threadIdx.x], m_new, &pb[threadIdx.x]);
            __syncthreads();
            if (threadIdx.x == 0) den[g] = ds41_na_den_update(den[g], corr, p, nc);
            for (size_t d = threadIdx.x; d < hd; d += blockDim.x) {
                double pv = 0.0;
                for (size_t j = 0; j < nc; j++)
                    pv = ds41_na_dacc(pv, pb[j], ds41_na_row_value(rows[j], isw[j], hd, d));
                acc[g * hd + d] = ds41_na_acc_update(acc[g * hd + d], corr, pv);
            }
            __syncthreads();
            if (threadIdx.x == 0) mx[g] = m_new;
        }
    }
    __syncthreads();
    for (size_t i = threadIdx.x; i < nh * hd; i += blockDim.x) {
        const size_t g = i / hd;
        out[m * H * hd + (h0 + g) * hd + i % hd] = ds41_na_attn_out(acc[i], den[g], sink[h0 + g], mx[g]);
    }
}

void launch_attn(ds41_cuda_ctx *c, const ds41_na_attn_src &src, const float *q, size_t M, int n_heads,
                 int head_dim, const float *sink, float scale, float *out) {
    if (!M) return;
    const size_t smem = DS41_CUDA_ATTN_HEADS * (size_t)head_dim * sizeof(float);
    if (smem > 48 * 1024)
        cudaFuncSetAttribute(k_attn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    const dim3 grid((unsigned)M, blocks_for((size_t)n_heads, DS41_CUDA_ATTN_HEADS));
    // sink is the layer's weight (placed by the backend); q and out are activations
    const float *sk = (const float *)ds41_cuda_weight(c, sink, (size_t)n_heads * sizeof(float));
    k_attn<<<grid, kAttnThreads, smem, stream_of(c)>>>(src, q, n_heads, head_dim, sk, scale, out);
}

} // namespace

// ---- the ops ---------------------------------------------------------------------------------

extern "C" {

void ds41_cuda_k_act_quant_fp8(const ds41_ops *self, const float *x, size_t M, size_t n, uint8_t *out,
                               size_t out_stride) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    const size_t t = M * ((n + 31) / 32);
    if (t) k_act_quant<<<blocks_for(t, 128), 128, 0, stream_of(c)>>>(x, M, n, out, out_stride);
}

void ds41_cuda_k_index_query(const ds41_ops *self, float *q, size_t qn, float *w, size_t wn, size_t M,
                             float scale) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    const size_t t = M * ((qn + 31) / 32) + M * wn;
    if (t) k_index_query<<<blocks_for(t, 128), 128, 0, stream_of(c)>>>(q, qn, w, wn, M, scale);
}

void ds41_cuda_k_kv_pack(const ds41_ops *self, const ds41_kv_layout *l, const float *latent, const float *key,
                         size_t n, uint8_t *out) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    const size_t t = n * ((l->latent_dim + 15) / 16 + (l->index_dim + 31) / 32);
    if (t)
        k_kv_pack<<<blocks_for(t, 128), 128, 0, stream_of(c)>>>(l->latent_dim, l->index_dim, l->latent_bytes,
                                                                l->entry_bytes, latent, key, n, out);
}

void ds41_cuda_k_compress_pool(const ds41_ops *self, const float *kv, const float *score, size_t n, int ratio,
                               size_t hd, float *pooled) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    if (n && hd)
        k_compress_pool<<<blocks_for(n * hd, 128), 128, 0, stream_of(c)>>>(kv, score, n, ratio, hd, pooled);
}

void ds41_cuda_k_index_scores(const ds41_ops *self, const float *q, const float *w, size_t M, int n_heads,
                              int dim, const ds41_kv_pages *keys, float *score, size_t score_stride) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    const uint8_t *const *pages;
    const size_t *row_table;
    uint32_t max_reach;
    const uint32_t *reach = ds41_cuda_index_meta(c, keys, M, n_heads, dim, &max_reach, &pages, &row_table);
    if (!max_reach) return;
    const ds41_kv_layout *l = keys->layout;
    const dim3 grid(blocks_for(max_reach, kScoreWarps), (unsigned)M);
    k_index_scores<<<grid, kScoreWarps * DS41_NA_WARP, 0, stream_of(c)>>>(
        q, w, n_heads, dim, pages, row_table, reach, l->entries_per_page, l->entry_bytes, l->latent_bytes,
        score, score_stride);
}

void ds41_cuda_k_index_blocks(const ds41_ops *self, const float *score, size_t score_stride,
                              const uint32_t *reach, size_t M, size_t block, size_t n_take, float *bscore,
                              size_t bscore_stride, uint8_t *allow, size_t allow_stride) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    const uint32_t *r = (const uint32_t *)ds41_cuda_meta(c, reach, M * sizeof *reach);
    if (M)
        k_index_blocks<<<(unsigned)M, kSelThreads, 0, stream_of(c)>>>(
            score, score_stride, r, block, n_take, bscore, bscore_stride, allow, allow_stride);
}

void ds41_cuda_k_index_topk(const ds41_ops *self, float *score, size_t score_stride, const uint32_t *reach,
                            size_t M, const uint8_t *allow, size_t allow_stride, size_t block, size_t k,
                            int32_t *sel, uint32_t *count) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    const uint32_t *r = (const uint32_t *)ds41_cuda_meta(c, reach, M * sizeof *reach);
    if (M)
        k_index_topk<<<(unsigned)M, kSelThreads, 0, stream_of(c)>>>(score, score_stride, r, allow,
                                                                    allow_stride, block, k, sel, count);
}

void ds41_cuda_k_sparse_attn(const ds41_ops *self, const float *q, int n_heads, int head_dim,
                             const float *sink, float scale, const ds41_attn_rows *rows, float *out) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    ds41_na_attn_src src;
    ds41_cuda_attn_src_rows(c, rows, &src);
    ds41_cuda_attn_count(c, (size_t)n_heads, (size_t)head_dim, rows->n_window + rows->n_comp);
    launch_attn(c, src, q, 1, n_heads, head_dim, sink, scale, out);
}

void ds41_cuda_k_attend(const ds41_ops *self, const float *q, size_t M, int n_heads, int head_dim,
                        const float *sink, float scale, const ds41_attn_step *step, float *out) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    ds41_cuda_attend_count(c, step, M, (size_t)n_heads, (size_t)head_dim); /* reads the host metadata */
    ds41_na_attn_src src;
    ds41_cuda_attn_src_step(c, step, M, &src);
    launch_attn(c, src, q, M, n_heads, head_dim, sink, scale, out);
}

} // extern "C"
