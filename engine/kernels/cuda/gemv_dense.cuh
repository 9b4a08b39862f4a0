// GEMV body over BF16 / float32 weights (dense_linear.cu documents it).
// Included by dense_linear.cu. nvcc finds this header beside the including source; NVRTC gets it inlined
// (engine.backend.cuda_source).
#pragma once

#include "common.cuh"

typedef unsigned short bf16_bits_t;

__device__ __forceinline__ float bf16_lo(unsigned int v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float load_w(const bf16_bits_t* w, long long i) {
    return __uint_as_float(((unsigned int)w[i]) << 16);
}
__device__ __forceinline__ float load_w(const float* w, long long i) { return w[i]; }

// 8 consecutive weights starting at w (16-byte aligned for bf16, 32-byte for float)
__device__ __forceinline__ void load8(const bf16_bits_t* w, float* f) {
    uint4 v = *reinterpret_cast<const uint4*>(w);
    f[0] = bf16_lo(v.x); f[1] = bf16_hi(v.x); f[2] = bf16_lo(v.y); f[3] = bf16_hi(v.y);
    f[4] = bf16_lo(v.z); f[5] = bf16_hi(v.z); f[6] = bf16_lo(v.w); f[7] = bf16_hi(v.w);
}
__device__ __forceinline__ void load8(const float* w, float* f) {
    float4 a = reinterpret_cast<const float4*>(w)[0];
    float4 b = reinterpret_cast<const float4*>(w)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// 8 weights . 8 activations (two float4)
// GEMV body. A block is 8 warps. KS warps split the K range of one row group (KS = 1: none), each
// warp owns R consecutive weight rows and up to NT activation rows (the tile). Every lane loads 16
// bytes of each of its R weight rows per step (U steps unrolled: 4 loads in flight per lane), and
// each activation value loaded is reused for R rows, each weight for NT activation rows.
template <typename WT, int NT, int R, int KS, bool VEC>
__device__ __forceinline__ void gemv_body(const float* __restrict__ X, const int* __restrict__ row_index,
                                          const WT* __restrict__ W, long long w_expert_stride,
                                          float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                          const int* tile_count, const int* n_tiles, int M, int N, int K) {
    constexpr int RG = 8 / KS;               // row groups per block
    constexpr int U = R >= 4 ? 1 : 4 / R;    // chunks unrolled per step
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / KS, ks = warp % KS;
    const int n0 = (blockIdx.x * RG + rg) * R;
    const WT* Wb = W + e * w_expert_stride;
    const WT* wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wrow[r] = Wb + (long long)(n0 + r < N ? n0 + r : 0) * K;
    const bool any_row = n0 < N;
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        int rr = start + (t < count ? t : 0);
        long long xrow = row_index != nullptr ? (long long)row_index[rr] : (long long)rr;
        xr[t] = X + xrow * K;
    }
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    int k_done = 0;
    if (VEC) {
        const int K8 = K >> 3;
        constexpr int STEP = 32 * KS;
        int c = ks * 32 + lane;
        if (any_row) {
            for (; c + (U - 1) * STEP < K8; c += U * STEP) {
                float w[U][R][8];
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int r = 0; r < R; ++r) load8(wrow[r] + (long long)(c + u * STEP) * 8, w[u][r]);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < count) {
                        const float4* xp = reinterpret_cast<const float4*>(xr[t]);
#pragma unroll
                        for (int u = 0; u < U; ++u) {
                            const float4 a = xp[2 * (c + u * STEP)], b = xp[2 * (c + u * STEP) + 1];
#pragma unroll
                            for (int r = 0; r < R; ++r) acc[r][t] += dot8(w[u][r], a, b);
                        }
                    }
                }
            }
            for (; c < K8; c += STEP) {
                float w[R][8];
#pragma unroll
                for (int r = 0; r < R; ++r) load8(wrow[r] + (long long)c * 8, w[r]);
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    if (t < count) {
                        const float4* xp = reinterpret_cast<const float4*>(xr[t]);
                        const float4 a = xp[2 * c], b = xp[2 * c + 1];
#pragma unroll
                        for (int r = 0; r < R; ++r) acc[r][t] += dot8(w[r], a, b);
                    }
                }
            }
        }
        k_done = K8 << 3;
    }
    if (any_row) {
        for (int k = k_done + ks * 32 + lane; k < K; k += 32 * KS) {
            float wv[R];
#pragma unroll
            for (int r = 0; r < R; ++r) wv[r] = load_w(wrow[r], k);
#pragma unroll
            for (int t = 0; t < NT; ++t)
                if (t < count) {
                    const float xv = xr[t][k];
#pragma unroll
                    for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
                }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], off);
    if (KS == 1) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (lane == t && t < count) {
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (n0 + r < N) Y[(long long)(start + t) * N + n0 + r] = acc[r][t];
            }
    } else {
        __shared__ float red[8][R * NT];
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int t = 0; t < NT; ++t) red[warp][r * NT + t] = acc[r][t];
        }
        __syncthreads();
        if (ks == 0 && lane < NT && lane < count) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (n0 + r < N) {
                    float s = 0.f;
                    for (int q = 0; q < KS; ++q) s += red[rg * KS + q][r * NT + lane];
                    Y[(long long)(start + lane) * N + n0 + r] = s;
                }
            }
        }
    }
}
