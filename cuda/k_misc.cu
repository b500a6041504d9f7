// The misc family's kernels (cuda/op_misc.h): one launch per op over all the
// step's rows on the compute stream, no sync.  The arithmetic is
// cuda/num_misc.h, shared with the host emulation cuda/emu_misc.c, which
// runs the same decomposition: a block of DS41_MISC_THREADS threads per
// reduced row (rmsnorm, hc_mix, router) or per (row, copy) (engram_mix), its
// partials combined by block_sum below in ds41_misc_block_sum's order, and
// one thread per output element elsewhere (grid-stride loops, so the grid
// size changes nothing an element computes).  No atomics: every output
// element is written by one thread.
#include "cuda/cuda_ctx.h"
#include "cuda/num_misc.h"
#include "cuda/op_misc.h"

#include <cuda_runtime.h>

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = DS41_MISC_THREADS;

// Blocks of an elementwise launch over `total` elements (grid-stride beyond).
unsigned grid_for(size_t total) {
    const size_t b = (total + kThreads - 1) / kThreads;
    return (unsigned)(b < (1u << 20) ? b : (1u << 20));
}

cudaStream_t stream_of(ds41_cuda_ctx *c) {
    return (cudaStream_t)c->stream;
}

ds41_cuda_ctx *enter(const ds41_ops *self) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    c->stats.op_calls++;
    return c;
}

// ds41_misc_block_sum on the device: each warp's xor butterfly (lane i adds
// lane i ^ o, o = 16 .. 1), then every warp runs the butterfly over the 8
// warp totals (o = 4, 2, 1; lanes 8..31 hold 0.0 and only meet each other),
// so every thread returns the same total.  sh: DS41_MISC_WARPS doubles of
// shared memory; the leading barrier lets a block call it again at once.
__device__ double block_sum(double v, double *sh) {
    for (int o = 16; o >= 1; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
    const int lane = (int)(threadIdx.x & 31u), w = (int)(threadIdx.x >> 5);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    double t = lane < DS41_MISC_WARPS ? sh[lane] : 0.0;
    for (int o = DS41_MISC_WARPS / 2; o >= 1; o >>= 1) t += __shfl_xor_sync(kFull, t, o);
    return t;
}

__global__ void k_rmsnorm(const uint16_t *w, const float *x, size_t n, float eps, float *y) {
    __shared__ double sh[DS41_MISC_WARPS];
    const size_t m = blockIdx.x;
    const float *xr = x + m * n;
    double a = 0.0;
    for (size_t i = threadIdx.x; i < n; i += kThreads) a += ds41_misc_sq_term(xr[i]);
    const float r = ds41_misc_rms_scale(ds41_misc_mean(block_sum(a, sh), n), eps);
    for (size_t i = threadIdx.x; i < n; i += kThreads) y[m * n + i] = ds41_misc_rmsnorm_elem(w[i], xr[i], r);
}

// One block per row; mix [n_mix] in dynamic shared memory.
__global__ void k_hc_mix(const float *fn, const float *scale, const float *base, const float *h, int hc,
                         size_t dim, float norm_eps, int iters, float hc_eps, float *pre, float *post,
                         float *comb) {
    __shared__ double sh[DS41_MISC_WARPS];
    extern __shared__ float mix[];
    const size_t m = blockIdx.x, n = (size_t)hc * dim, n_mix = (size_t)(2 + hc) * (size_t)hc;
    const float *hr = h + m * n;
    double a = 0.0;
    for (size_t i = threadIdx.x; i < n; i += kThreads) a += ds41_misc_sq_term(hr[i]);
    const float r = ds41_misc_rms_scale(ds41_misc_mean(block_sum(a, sh), n), norm_eps);
    for (size_t j = 0; j < n_mix; j++) {
        const float *f = fn + j * n;
        a = 0.0;
        for (size_t i = threadIdx.x; i < n; i += kThreads) a += ds41_misc_dot_term(f[i], hr[i]);
        const double s = block_sum(a, sh);
        if (threadIdx.x == 0) mix[j] = DS41_FMUL((float)s, r);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        ds41_hd_hc_sinkhorn(mix, scale, base, hc, iters, hc_eps, pre + m * (size_t)hc, post + m * (size_t)hc,
                            comb + m * (size_t)hc * (size_t)hc);
}

__global__ void k_hc_pre(const float *h, const float *pre, size_t M, int hc, size_t dim, float *out) {
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * dim;
         t += (size_t)gridDim.x * kThreads) {
        const size_t m = t / dim, d = t % dim;
        out[t] = ds41_misc_hc_pre_elem(h + m * (size_t)hc * dim, pre + m * (size_t)hc, hc, dim, d);
    }
}

__global__ void k_hc_post(const float *o, const float *h, const float *post, const float *comb, size_t M,
                          int hc, size_t dim, float *out) {
    const size_t H = (size_t)hc;
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * H * dim;
         t += (size_t)gridDim.x * kThreads) {
        const size_t d = t % dim, j = (t / dim) % H, m = t / (dim * H);
        out[t] = ds41_misc_hc_post_elem(o + m * dim, h + m * H * dim, post[m * H + j], comb + m * H * H, hc,
                                        dim, (int)j, d);
    }
}

__global__ void k_rope_table(const float *f, int n_pairs, const uint64_t *pos, size_t M, float *cs) {
    const size_t P = (size_t)n_pairs;
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * P; t += (size_t)gridDim.x * kThreads)
        ds41_hd_rope_cos_sin(f[t % P], pos[t / P], cs + 2 * t);
}

__global__ void k_rope(float *x, size_t M, int n_heads, size_t row_stride, size_t head_stride, int n_pairs,
                       const float *cs, int inverse) {
    const size_t P = (size_t)n_pairs, H = (size_t)n_heads;
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * H * P;
         t += (size_t)gridDim.x * kThreads) {
        const size_t i = t % P, hh = (t / P) % H, m = t / (P * H);
        const float *c = cs + (m * P + i) * 2;
        ds41_hd_rope_pair(x + m * row_stride + hh * head_stride + 2 * i, c[0], c[1], inverse);
    }
}

__global__ void k_swiglu(const float *g, const float *u, size_t M, size_t n, float limit, const float *route,
                         float *out) {
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * n; t += (size_t)gridDim.x * kThreads)
        out[t] = ds41_misc_swiglu_elem(g[t], u[t], limit, route ? route + t / n : nullptr);
}

__global__ void k_moe_combine(const float *oe, const uint32_t *slot, size_t k, const float *shared, size_t M,
                              size_t D, float *out) {
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * D; t += (size_t)gridDim.x * kThreads)
        out[t] = ds41_hd_moe_combine_elem(oe, slot + (t / D) * k, k, shared[t], D, t % D);
}

// One block per token: the scores in parallel, the decision by thread 0 with
// the reference's scan (shared: score, biased [E] floats, taken [E] bytes).
__global__ void k_router(const float *logits, const float *bias, int E, int k, float gate_temp,
                         float route_scale, int32_t *sel, float *weight, float *selection) {
    extern __shared__ float rsh[];
    const size_t m = blockIdx.x, ne = (size_t)E;
    float *score = rsh, *biased = rsh + ne;
    unsigned char *taken = (unsigned char *)(biased + ne);
    for (size_t e = threadIdx.x; e < ne; e += kThreads) {
        score[e] = ds41_misc_router_score(logits[m * ne + e], gate_temp);
        biased[e] = score[e] + bias[e];
        if (selection) selection[m * ne + e] = biased[e];
    }
    __syncthreads();
    if (threadIdx.x == 0)
        ds41_hd_router_pick(score, biased, taken, E, k, route_scale, sel + m * (size_t)k,
                            weight + m * (size_t)k);
}

// One block per (token, copy); h in place (every read of the row happens in
// the sums, before the barrier inside the last block_sum).
__global__ void k_engram_mix(float *h, const float *kv, const float *wqk, int hc, size_t dim, float eps,
                             float dim_scale) {
    __shared__ double sh[DS41_MISC_WARPS];
    const size_t H = (size_t)hc, m = blockIdx.x / H, cp = blockIdx.x % H;
    float *hr = h + (m * H + cp) * dim;
    const float *kvr = kv + m * (H + 1) * dim, *key = kvr + cp * dim, *value = kvr + H * dim,
                *wr = wqk + cp * dim;
    double a = 0.0, b = 0.0, s = 0.0;
    for (size_t i = threadIdx.x; i < dim; i += kThreads) a += ds41_misc_sq_term(hr[i]);
    for (size_t i = threadIdx.x; i < dim; i += kThreads) b += ds41_misc_sq_term(key[i]);
    for (size_t i = threadIdx.x; i < dim; i += kThreads) s += ds41_misc_engram_term(hr[i], wr[i], key[i]);
    const double sa = block_sum(a, sh), sb = block_sum(b, sh), ss = block_sum(s, sh);
    const float gate =
        ds41_misc_engram_gate(ds41_misc_mean(sa, dim), ds41_misc_mean(sb, dim), (float)ss, eps, dim_scale);
    for (size_t i = threadIdx.x; i < dim; i += kThreads)
        hr[i] = ds41_misc_engram_update(hr[i], gate, value[i]);
}

__global__ void k_embed(const uint16_t *table, const int32_t *ids, size_t M, int hc, size_t dim, float *out) {
    const size_t H = (size_t)hc;
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < M * H * dim;
         t += (size_t)gridDim.x * kThreads)
        out[t] = ds41_hd_bf16_to_f32(table[(size_t)ids[t / (H * dim)] * dim + t % dim]);
}

// One block per row; 4-byte words when every address and size allows.
__global__ void k_gather_rows(unsigned char *dst, const unsigned char *src, size_t src_stride,
                              const uint32_t *idx, size_t row_bytes, int words) {
    const size_t i = blockIdx.x;
    const unsigned char *s = src + (size_t)idx[i] * src_stride;
    unsigned char *d = dst + i * row_bytes;
    if (words)
        for (size_t b = threadIdx.x; b < row_bytes / 4; b += kThreads)
            ((uint32_t *)d)[b] = ((const uint32_t *)s)[b];
    else
        for (size_t b = threadIdx.x; b < row_bytes; b += kThreads) d[b] = s[b];
}

__global__ void k_fp8_rows(const uint8_t *q, const uint8_t *scale, const int64_t *rows, size_t n, size_t cols,
                           float *out) {
    const size_t sc = (cols + 31) / 32;
    for (size_t t = blockIdx.x * (size_t)kThreads + threadIdx.x; t < n * cols;
         t += (size_t)gridDim.x * kThreads) {
        const size_t r = (size_t)rows[t / cols], col = t % cols;
        out[t] = ds41_misc_fp8_value(q[r * cols + col], scale[r * sc + col / 32]);
    }
}

} // namespace

extern "C" {

void ds41_cuda_k_rmsnorm(const ds41_ops *self, const uint16_t *w, const float *x, size_t M, size_t n,
                         float eps, float *y) {
    ds41_cuda_ctx *c = enter(self);
    const uint16_t *wd = (const uint16_t *)ds41_cuda_weight(c, w, n * sizeof *w);
    c->stats.weight_bytes += n * 2;
    if (M && n) k_rmsnorm<<<(unsigned)M, kThreads, 0, stream_of(c)>>>(wd, x, n, eps, y);
}

void ds41_cuda_k_hc_mix(const ds41_ops *self, const float *fn, const float *scale, const float *base,
                        const float *h, size_t M, int hc, size_t dim, float norm_eps, int iters, float hc_eps,
                        float *pre, float *post, float *comb) {
    ds41_cuda_ctx *c = enter(self);
    const size_t n = (size_t)hc * dim, n_mix = (size_t)(2 + hc) * (size_t)hc;
    const float *fnd = (const float *)ds41_cuda_weight(c, fn, n_mix * n * sizeof *fn);
    const float *scd = (const float *)ds41_cuda_weight(c, scale, 3 * sizeof *scale);
    const float *based = (const float *)ds41_cuda_weight(c, base, n_mix * sizeof *base);
    c->stats.weight_bytes += ((uint64_t)n_mix * n + (uint64_t)n_mix + 3) * sizeof(float);
    c->stats.flops += 2 * (uint64_t)M * (uint64_t)(n_mix + 1) * n;
    if (M)
        k_hc_mix<<<(unsigned)M, kThreads, n_mix * sizeof(float), stream_of(c)>>>(
            fnd, scd, based, h, hc, dim, norm_eps, iters, hc_eps, pre, post, comb);
}

void ds41_cuda_k_hc_pre(const ds41_ops *self, const float *h, const float *pre, size_t M, int hc, size_t dim,
                        float *out) {
    ds41_cuda_ctx *c = enter(self);
    if (M && dim) k_hc_pre<<<grid_for(M * dim), kThreads, 0, stream_of(c)>>>(h, pre, M, hc, dim, out);
}

void ds41_cuda_k_hc_post(const ds41_ops *self, const float *o, const float *h, const float *post,
                         const float *comb, size_t M, int hc, size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    const size_t total = M * (size_t)hc * dim;
    if (total) k_hc_post<<<grid_for(total), kThreads, 0, stream_of(c)>>>(o, h, post, comb, M, hc, dim, out);
}

void ds41_cuda_k_rope_table(const ds41_ops *self, const float *freqs, int n_pairs, const uint64_t *pos,
                            size_t M, float *cs) {
    ds41_cuda_ctx *c = enter(self);
    const float *f = (const float *)ds41_cuda_weight(c, freqs, (size_t)n_pairs * sizeof *freqs);
    const uint64_t *p = (const uint64_t *)ds41_cuda_meta(c, pos, M * sizeof *pos);
    const size_t total = M * (size_t)n_pairs;
    if (total) k_rope_table<<<grid_for(total), kThreads, 0, stream_of(c)>>>(f, n_pairs, p, M, cs);
}

void ds41_cuda_k_rope(const ds41_ops *self, float *x, size_t M, int n_heads, size_t row_stride,
                      size_t head_stride, int n_pairs, const float *cs, int inverse) {
    ds41_cuda_ctx *c = enter(self);
    const size_t total = M * (size_t)n_heads * (size_t)n_pairs;
    if (total)
        k_rope<<<grid_for(total), kThreads, 0, stream_of(c)>>>(x, M, n_heads, row_stride, head_stride,
                                                               n_pairs, cs, inverse);
}

void ds41_cuda_k_swiglu(const ds41_ops *self, const float *g, const float *u, size_t M, size_t n, float limit,
                        const float *route, float *out) {
    ds41_cuda_ctx *c = enter(self);
    if (M && n) k_swiglu<<<grid_for(M * n), kThreads, 0, stream_of(c)>>>(g, u, M, n, limit, route, out);
}

void ds41_cuda_k_moe_combine(const ds41_ops *self, const float *oe, const uint32_t *slot, size_t k,
                             const float *shared, size_t M, size_t D, float *out) {
    ds41_cuda_ctx *c = enter(self);
    const uint32_t *sl = (const uint32_t *)ds41_cuda_meta(c, slot, M * k * sizeof *slot);
    if (M && D) k_moe_combine<<<grid_for(M * D), kThreads, 0, stream_of(c)>>>(oe, sl, k, shared, M, D, out);
}

void ds41_cuda_k_router(const ds41_ops *self, const float *logits, const float *bias, size_t M, int E, int k,
                        float gate_temp, float route_scale, int32_t *sel, float *weight, float *selection) {
    ds41_cuda_ctx *c = enter(self);
    const float *b = (const float *)ds41_cuda_weight(c, bias, (size_t)E * sizeof *bias);
    c->stats.weight_bytes += (uint64_t)E * sizeof(float);
    if (M)
        k_router<<<(unsigned)M, kThreads, (size_t)E *(2 * sizeof(float) + 1), stream_of(c)>>>(
            logits, b, E, k, gate_temp, route_scale, sel, weight, selection);
}

void ds41_cuda_k_engram_mix(const ds41_ops *self, float *h, const float *kv, const float *wqk, size_t M,
                            int hc, size_t dim, float eps, float dim_scale) {
    ds41_cuda_ctx *c = enter(self);
    const float *wd = (const float *)ds41_cuda_weight(c, wqk, (size_t)hc * dim * sizeof *wqk);
    c->stats.weight_bytes += (uint64_t)hc * dim * sizeof(float);
    if (M && hc > 0)
        k_engram_mix<<<(unsigned)(M * (size_t)hc), kThreads, 0, stream_of(c)>>>(h, kv, wd, hc, dim, eps,
                                                                                dim_scale);
}

void ds41_cuda_k_embed(const ds41_ops *self, const uint16_t *table, const int32_t *ids, size_t M, int hc,
                       size_t dim, float *out) {
    ds41_cuda_ctx *c = enter(self);
    const uint16_t *t =
        (const uint16_t *)ds41_cuda_weight(c, table, ds41_misc_rows_i32(ids, M) * dim * sizeof *table);
    const int32_t *id = (const int32_t *)ds41_cuda_meta(c, ids, M * sizeof *ids);
    c->stats.weight_bytes += (uint64_t)M * dim * 2;
    const size_t total = M * (size_t)hc * dim;
    if (total) k_embed<<<grid_for(total), kThreads, 0, stream_of(c)>>>(t, id, M, hc, dim, out);
}

void ds41_cuda_k_gather_rows(const ds41_ops *self, void *dst, const void *src, size_t src_stride,
                             const uint32_t *idx, size_t n, size_t row_bytes) {
    ds41_cuda_ctx *c = enter(self);
    if (!n || !row_bytes) return;
    const uint32_t *ix = (const uint32_t *)ds41_cuda_meta(c, idx, n * sizeof *idx);
    const int words = (((uintptr_t)dst | (uintptr_t)src | src_stride | row_bytes) & 3u) == 0;
    k_gather_rows<<<(unsigned)n, kThreads, 0, stream_of(c)>>>(
        (unsigned char *)dst, (const unsigned char *)src, src_stride, ix, row_bytes, words);
}

void ds41_cuda_k_fp8_rows(const ds41_ops *self, const uint8_t *q, const uint8_t *scale, const int64_t *rows,
                          size_t n, size_t cols, float *out) {
    ds41_cuda_ctx *c = enter(self);
    const size_t sc = (cols + 31) / 32, nr = ds41_misc_rows_i64(rows, n);
    const uint8_t *qd = (const uint8_t *)ds41_cuda_weight(c, q, nr * cols);
    const uint8_t *sd = (const uint8_t *)ds41_cuda_weight(c, scale, nr * sc);
    const int64_t *rw = (const int64_t *)ds41_cuda_meta(c, rows, n * sizeof *rows);
    c->stats.weight_bytes += (uint64_t)n * (cols + sc);
    if (n && cols) k_fp8_rows<<<grid_for(n * cols), kThreads, 0, stream_of(c)>>>(qd, sd, rw, n, cols, out);
}

} // extern "C"
