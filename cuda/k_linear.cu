/* The linear kernels (ops linear, linear_batch): a small act_quant kernel
 * (one thread per 1x32 block of a row, e4m3 codes + ue8m0 byte into
 * scratch), then one GEMV/GEMM kernel over (column group, linear) for every
 * linear of the call at once (the experts of a MoE layer: one launch).
 *
 * A warp computes one output column n for all M rows of its linear, in
 * register tiles of kRows rows: lane l loads weight chunks c = l, l + 32,
 * ... (32-byte FP8 / 16-byte FP4 scale blocks, 16-byte BF16 chunks; a warp
 * reads 32 consecutive chunks of the row, contiguous bytes), decodes the
 * codes in registers and applies each chunk to every row of the tile before
 * the next; the 32 lane partials are combined with __shfl_xor_sync in the
 * tree of cuda/num_linear.h.  So each output's arithmetic is exactly the
 * one num_linear.h documents, the same for every M and every place in the
 * batch, and the host emulation (cuda/emu_linear.c) reproduces it bit for
 * bit.  No atomics, no shared-memory reductions; work depends on no other
 * warp. */
#include "cuda/op_linear.h"

#include <cuda_runtime.h>

namespace {

constexpr int kWarps = 4; /* output columns per block */
constexpr int kRows = 4;  /* rows of a register tile */
constexpr unsigned kFull = 0xFFFFFFFFu;

/* n bytes from src into dst (16-byte vector loads when aligned and whole). */
__device__ inline void load_bytes(uint8_t *dst, const uint8_t *src, int n, int whole) {
    if (n == whole && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
        for (int i = 0; i < whole / 16; i++)
            reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
        return;
    }
    for (int i = 0; i < n; i++) dst[i] = src[i];
}

__device__ inline float tree_f32(float v) {
    for (int o = DS41_LIN_LANES / 2; o > 0; o >>= 1) v = ds41_lin_add(v, __shfl_xor_sync(kFull, v, o));
    return v;
}
__device__ inline double tree_f64(double v) {
    for (int o = DS41_LIN_LANES / 2; o > 0; o >>= 1) v = ds41_lin_dadd(v, __shfl_xor_sync(kFull, v, o));
    return v;
}

__global__ void act_kernel(const ds41_lin_desc *dd) {
    const ds41_lin_desc *d = &dd[blockIdx.y];
    if (d->M == 0 || d->kind == DS41_LIN_KIND_BF16) return;
    const int64_t nkb = ds41_lin_nkb(d->k), items = d->M * nkb;
    for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < items;
         it += (int64_t)gridDim.x * blockDim.x)
        ds41_lin_act_item(d, it / nkb, it % nkb);
}

union Block32 {
    uint4 v[2];
    uint8_t b[32];
};

/* FP8 / FP4: column col of d, every row. */
__device__ void warp_quant(const ds41_lin_desc *d, int64_t col, int lane) {
    const int64_t K = d->k, N = d->n, M = d->M, nkb = ds41_lin_nkb(K), kp = ds41_lin_kp(K);
    const int fp4 = d->kind == DS41_LIN_KIND_FP4;
    const int wfull = fp4 ? DS41_LIN_QBLOCK / 2 : DS41_LIN_QBLOCK;
    const uint8_t *ascale = d->act + M * kp;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = M - m0 < kRows ? (int)(M - m0) : kRows;
        float acc[kRows];
        for (int r = 0; r < kRows; r++) acc[r] = 0.0f;
        /* Uniform trip count: the exact chain shuffles inside the loop. */
        for (int64_t base = 0; base < nkb; base += DS41_LIN_LANES) {
            const int64_t kb = base + lane;
            const bool valid = kb < nkb;
            Block32 wb, ab;
            int len = 0;
            uint8_t sw = 0;
            if (valid) {
                len = ds41_lin_len(K, kb * DS41_LIN_QBLOCK, DS41_LIN_QBLOCK);
                load_bytes(wb.b, ds41_lin_wblock(d, col, kb), fp4 ? (len + 1) / 2 : len, wfull);
                sw = ds41_lin_wscale(d, col, kb);
            }
            const int cnt = nkb - base < DS41_LIN_LANES ? (int)(nkb - base) : DS41_LIN_LANES;
            for (int r = 0; r < kRows; r++) {
                if (r >= rows) break;
                const int64_t m = m0 + r;
                float t = 0.0f;
                if (valid) {
                    load_bytes(ab.b, d->act + m * kp + kb * DS41_LIN_QBLOCK, DS41_LIN_QBLOCK,
                               DS41_LIN_QBLOCK);
                    const uint8_t sa = ascale[m * nkb + kb];
                    if (d->exact) {
                        const double b = len == DS41_LIN_QBLOCK
                                             ? ds41_lin_q_block_f64(wb.b, fp4, ab.b, DS41_LIN_QBLOCK)
                                             : ds41_lin_q_block_f64(wb.b, fp4, ab.b, len);
                        t = ds41_lin_q_scaled((float)b, sa, sw);
                    } else {
                        const float b = len == DS41_LIN_QBLOCK
                                            ? ds41_lin_q_block(wb.b, fp4, ab.b, DS41_LIN_QBLOCK)
                                            : ds41_lin_q_block(wb.b, fp4, ab.b, len);
                        acc[r] = ds41_lin_q_step(acc[r], b, sa, sw);
                    }
                }
                if (d->exact) /* the reference's chain, in block order */
                    for (int s = 0; s < cnt; s++) acc[r] = ds41_lin_add(acc[r], __shfl_sync(kFull, t, s));
            }
        }
        for (int r = 0; r < rows; r++) {
            const float v = d->exact ? acc[r] : tree_f32(acc[r]);
            if (lane == 0) d->y[(m0 + r) * N + col] = ds41_hd_bf16_round(v);
        }
    }
}

union Chunk8 {
    uint4 v;
    uint16_t h[8];
};

/* x[0..len) of a row into registers. */
__device__ inline void load_x(float *dst, const float *src, int len) {
    if (len == DS41_LIN_BF16_CHUNK && (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
        const float4 a = reinterpret_cast<const float4 *>(src)[0],
                     b = reinterpret_cast<const float4 *>(src)[1];
        dst[0] = a.x, dst[1] = a.y, dst[2] = a.z, dst[3] = a.w;
        dst[4] = b.x, dst[5] = b.y, dst[6] = b.z, dst[7] = b.w;
        return;
    }
    for (int i = 0; i < len; i++) dst[i] = src[i];
}

/* BF16: column col of d, every row. */
__device__ void warp_bf16(const ds41_lin_desc *d, int64_t col, int lane) {
    const int64_t K = d->k, N = d->n, M = d->M, nc = (K + DS41_LIN_BF16_CHUNK - 1) / DS41_LIN_BF16_CHUNK;
    const uint16_t *wrow = d->bf16 + col * K;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = M - m0 < kRows ? (int)(M - m0) : kRows;
        float acc[kRows];
        double s[kRows], a[kRows];
        for (int r = 0; r < kRows; r++) acc[r] = 0.0f, s[r] = a[r] = 0.0;
        for (int64_t ch = lane; ch < nc; ch += DS41_LIN_LANES) {
            const int64_t k0 = ch * DS41_LIN_BF16_CHUNK;
            const int len = ds41_lin_len(K, k0, DS41_LIN_BF16_CHUNK);
            Chunk8 wb;
            load_bytes(reinterpret_cast<uint8_t *>(wb.h), reinterpret_cast<const uint8_t *>(wrow + k0),
                       2 * len, 2 * DS41_LIN_BF16_CHUNK);
            for (int r = 0; r < kRows; r++) {
                if (r >= rows) break;
                float xr[DS41_LIN_BF16_CHUNK];
                load_x(xr, d->x + (m0 + r) * K + k0, len);
                if (d->exact)
                    ds41_lin_bf16_chunk_f64(&s[r], &a[r], xr, wb.h, len);
                else if (len == DS41_LIN_BF16_CHUNK)
                    acc[r] = ds41_lin_bf16_chunk(acc[r], xr, wb.h, DS41_LIN_BF16_CHUNK);
                else
                    acc[r] = ds41_lin_bf16_chunk(acc[r], xr, wb.h, len);
            }
        }
        for (int r = 0; r < rows; r++) {
            const int64_t m = m0 + r;
            if (!d->exact) {
                const float v = tree_f32(acc[r]);
                if (lane == 0) d->y[m * N + col] = ds41_lin_out(v, d->out_bf16);
                continue;
            }
            const double ts = tree_f64(s[r]), ta = tree_f64(a[r]); /* equal in every lane */
            float v;
            if (!ds41_lin_fast_round(ts, ta, K, &v)) {
                if (lane == 0)
                    v = ds41_lin_xdot_bf16(d->x + m * K, wrow, K); /* rare: near an fp32 boundary */
            }
            if (lane == 0) d->y[m * N + col] = ds41_lin_out(v, d->out_bf16);
        }
    }
}

__global__ void __launch_bounds__(kWarps * 32) linear_kernel(const ds41_lin_desc *dd) {
    const ds41_lin_desc *d = &dd[blockIdx.y];
    const int64_t col = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    if (d->M == 0 || col >= d->n) return; /* whole warps */
    if (d->kind == DS41_LIN_KIND_BF16)
        warp_bf16(d, col, threadIdx.x % 32);
    else
        warp_quant(d, col, threadIdx.x % 32);
}

} // namespace

extern "C" void ds41_cuda_k_linear_batch(const ds41_ops *self, size_t n, const ds41_linear *const *ws,
                                         const float *const *xs, const size_t *Ms, float *const *ys,
                                         ds41_linear_out out) {
    ds41_cuda_ctx *c = ds41_cuda_ctx_of(self);
    ds41_lin_desc local[16];
    ds41_lin_desc *d = n <= 16 ? local : static_cast<ds41_lin_desc *>(malloc(n * sizeof *d));
    if (!d) abort(); /* ops cannot fail (engine/backend/ops.h) */
    int64_t max_n, max_items;
    if (n && ds41_cuda_lin_descs(c, n, ws, xs, Ms, ys, out, d, &max_n, &max_items)) {
        const ds41_lin_desc *dd = static_cast<const ds41_lin_desc *>(ds41_cuda_meta(c, d, n * sizeof *d));
        cudaStream_t st = static_cast<cudaStream_t>(c->stream);
        if (max_items) {
            const int64_t blocks = (max_items + 255) / 256;
            act_kernel<<<dim3((unsigned)(blocks < 4096 ? blocks : 4096), (unsigned)n), 256, 0, st>>>(dd);
        }
        linear_kernel<<<dim3((unsigned)((max_n + kWarps - 1) / kWarps), (unsigned)n), kWarps * 32, 0, st>>>(
            dd);
    }
    if (d != local) free(d);
}

extern "C" void ds41_cuda_k_linear(const ds41_ops *self, const ds41_linear *w, const float *x, size_t M,
                                   float *y, ds41_linear_out out) {
    ds41_cuda_k_linear_batch(self, 1, &w, &x, &M, &y, out);
}
