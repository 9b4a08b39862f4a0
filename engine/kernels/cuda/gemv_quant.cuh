// Stored-format weight loaders (FP8, NVFP4) and their GEMV body (quant_linear.cu documents them).
// Included by quant_linear.cu. nvcc finds this header beside the including source; NVRTC gets it inlined
// (engine.backend.cuda_source).
#pragma once

#include "common.cuh"

typedef unsigned char u8;

// e4m3_to_f32 / e2m1_to_f32: common.cuh (shared with gemm_tc.cu)

struct FP8W {
    const u8* Q;
    const float* S;
    long long q_es, s_es;  // expert strides (elements)
    int rb, cb, ncb;       // scale block rows, columns; scale columns per row block
    static constexpr int EPL = 16;  // weights per 16-byte load
    __device__ __forceinline__ long long row_bytes(int K) const { return K; }
    __device__ __forceinline__ float get(long long e, int n, int k, int K) const {
        const float s = S[e * s_es + (long long)(n / rb) * ncb + k / cb];
        return e4m3_to_f32(Q[e * q_es + (long long)n * K + k]) * s;
    }
    // 16 weights of row n starting at k0 (k0 % 16 == 0, cb % 16 == 0, 16-byte aligned row): the raw codes and
    // scale are fetched first (raw), decoded later (decode), so several chunks' loads can be in flight
    struct Raw {
        uint4 v;
        float s;
    };
    __device__ __forceinline__ Raw raw(long long e, int n, int k0, int K) const {
        Raw r;
        r.v = *reinterpret_cast<const uint4*>(Q + e * q_es + (long long)n * K + k0);
        r.s = S[e * s_es + (long long)(n / rb) * ncb + k0 / cb];
        return r;
    }
    __device__ __forceinline__ float row_scale(long long, int) const { return 1.f; }
    // 8 weights of a fetched chunk: piece p (elements 8p .. 8p + 7)
    __device__ __forceinline__ void decode8(const Raw& r, int p, float, float* w) const {
        const unsigned int lo = (p == 0) ? r.v.x : r.v.z, hi = (p == 0) ? r.v.y : r.v.w;
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = e4m3_to_f32((lo >> (8 * j)) & 0xffu) * r.s;
#pragma unroll
        for (int j = 0; j < 4; ++j) w[4 + j] = e4m3_to_f32((hi >> (8 * j)) & 0xffu) * r.s;
    }
};

struct NVFP4W {
    const u8* Q;
    const u8* S;
    const float* S2;
    long long q_es, s_es;  // expert strides (bytes)
    int s2_rows, s2_per_e;  // rows per global scale; global scales per expert
    static constexpr int EPL = 32;
    __device__ __forceinline__ float s2(long long e, int n) const { return S2[e * s2_per_e + n / s2_rows]; }
    __device__ __forceinline__ float get(long long e, int n, int k, int K) const {
        const unsigned int b = Q[e * q_es + (long long)n * (K >> 1) + (k >> 1)];
        const float sc = e4m3_to_f32(S[e * s_es + (long long)n * (K >> 4) + (k >> 4)]);
        return (e2m1_to_f32((k & 1) ? (b >> 4) : (b & 15u)) * sc) * s2(e, n);
    }
    // 32 weights of row n starting at k0 (k0 % 32 == 0, 16-byte aligned row): raw codes + their two scale bytes
    struct Raw {
        uint4 v;
        unsigned int s;  // two E4M3 scale bytes (elements k0..k0+15, k0+16..k0+31)
    };
    __device__ __forceinline__ Raw raw(long long e, int n, int k0, int K) const {
        Raw r;
        r.v = *reinterpret_cast<const uint4*>(Q + e * q_es + (long long)n * (K >> 1) + (k0 >> 1));
        r.s = *reinterpret_cast<const unsigned short*>(S + e * s_es + (long long)n * (K >> 4) + (k0 >> 4));
        return r;
    }
    __device__ __forceinline__ float row_scale(long long e, int n) const { return s2(e, n); }
    // 8 weights of a fetched chunk: piece p (elements 8p .. 8p + 7, word p of the 16 bytes)
    __device__ __forceinline__ void decode8(const Raw& r, int p, float g, float* w) const {
        const unsigned int u = p == 0 ? r.v.x : (p == 1 ? r.v.y : (p == 2 ? r.v.z : r.v.w));
        const float sc = e4m3_to_f32(p < 2 ? (r.s & 0xffu) : ((r.s >> 8) & 0xffu));
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = (e2m1_to_f32((u >> (4 * j)) & 15u) * sc) * g;
    }
};

// R weight rows per warp ((8 / KS) * R rows per block of 8 warps), KS warps split K. VEC: 16-byte chunks,
// U chunks per row fetched before any is decoded; each 8-element piece of the activation rows is loaded
// once and reused for the R rows (the activations are float32: 8x (NVFP4) / 4x (FP8) the weight bytes, so
// reading them once per weight row made the 1-row kernels L1-bound, as measured: docs/performance.md).
template <typename LD, int NT, int R, int KS, bool VEC>
__device__ __forceinline__ void qgemv_body(const LD& ld, const float* __restrict__ X, const int* __restrict__ row_index,
                                           float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                           const int* tile_count, const int* n_tiles, int M, int N, int K) {
    constexpr int RG = 8 / KS;
    constexpr int EPL = LD::EPL;
    constexpr int U = (NT == 1 && R == 1) ? 4 : ((NT == 1 || (NT == 4 && R == 1)) ? 2 : 1);  // chunks in flight
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / KS, ks = warp % KS;
    const int n0 = (blockIdx.x * RG + rg) * R;
    int nr[R];  // row of each slot, clamped to a valid row (its result is not written when n0 + r >= N)
#pragma unroll
    for (int r = 0; r < R; ++r) nr[r] = n0 + r < N ? n0 + r : N - 1;
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
    if (n0 < N) {
        if (VEC) {
            const int KC = K / EPL;
            constexpr int STEP = 32 * KS;
            float g[R];
#pragma unroll
            for (int r = 0; r < R; ++r) g[r] = ld.row_scale(e, nr[r]);
            for (int c0 = ks * 32 + lane; c0 < KC; c0 += U * STEP) {
                typename LD::Raw raw[U][R];  // U chunks x R rows of loads issued before any is consumed
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (c0 + u * STEP < KC) {
#pragma unroll
                        for (int r = 0; r < R; ++r) raw[u][r] = ld.raw(e, nr[r], (c0 + u * STEP) * EPL, K);
                    }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + u * STEP;
                    if (c < KC) {
#pragma unroll
                        for (int p = 0; p < EPL / 8; ++p) {
                            if (NT <= 4) {  // hold the activation piece of every row, reuse it for the R rows
                                float4 xa[NT], xb[NT];
#pragma unroll
                                for (int t = 0; t < NT; ++t) {
                                    if (t < count) {
                                        const float4* xp = reinterpret_cast<const float4*>(xr[t] + c * EPL + 8 * p);
                                        xa[t] = xp[0];
                                        xb[t] = xp[1];
                                    }
                                }
#pragma unroll
                                for (int r = 0; r < R; ++r) {
                                    float w[8];
                                    ld.decode8(raw[u][r], p, g[r], w);
#pragma unroll
                                    for (int t = 0; t < NT; ++t)
                                        if (t < count) acc[r][t] += dot8(w, xa[t], xb[t]);
                                }
                            } else {  // 16 rows: registers allow one activation piece at a time
#pragma unroll
                                for (int r = 0; r < R; ++r) {
                                    float w[8];
                                    ld.decode8(raw[u][r], p, g[r], w);
#pragma unroll
                                    for (int t = 0; t < NT; ++t)
                                        if (t < count) {
                                            const float4* xp = reinterpret_cast<const float4*>(xr[t] + c * EPL + 8 * p);
                                            acc[r][t] += dot8(w, xp[0], xp[1]);
                                        }
                                }
                            }
                        }
                    }
                }
            }
            k_done = KC * EPL;
        }
        for (int k = k_done + ks * 32 + lane; k < K; k += 32 * KS) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float wv = ld.get(e, nr[r], k, K);
#pragma unroll
                for (int t = 0; t < NT; ++t)
                    if (t < count) acc[r][t] += wv * xr[t][k];
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
                    float sum = 0.f;
                    for (int q = 0; q < KS; ++q) sum += red[rg * KS + q][r * NT + lane];
                    Y[(long long)(start + lane) * N + n0 + r] = sum;
                }
            }
        }
    }
}
