// Tensor-core GEMV bodies for BF16 weights (dense_linear_mma.cu documents them).
// Included by dense_linear_mma.cu. nvcc finds this header beside the including source; NVRTC gets it inlined
// (engine.backend.cuda_source).
#pragma once

#include "common.cuh"

typedef unsigned short bf16_bits_t;

// 16 bytes of weights, streamed (not kept in L1)
__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// split_pair (the exact 3-way BF16 split of two activations): common.cuh (shared with gemm_tc.cu)

// mma_bf16_16816 (one m16n8k16 BF16 MMA, float32 accumulators): common.cuh

// 16 x 8 x 32 partial product of one step: va/vb = this lane's 8 weights of rows g and g+8, h/m/l = the
// activation parts; accumulated in a fresh register tile and then added to acc with ordinary
// (round-to-nearest) float32 adds: the tensor core's internal accumulation truncates, and chaining all
// K/16 * 3 MMAs into one accumulator would add a bias growing with K.
template <int SPLITS>
__device__ __forceinline__ void mma_step(float* acc, const uint4& va, const uint4& vb, const unsigned int* h,
                                         const unsigned int* m, const unsigned int* l) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    if (SPLITS >= 3) {
        mma_bf16_16816(c, va.x, vb.x, va.y, vb.y, l[0], l[1]);
        mma_bf16_16816(c, va.z, vb.z, va.w, vb.w, l[2], l[3]);
    }
    mma_bf16_16816(c, va.x, vb.x, va.y, vb.y, m[0], m[1]);
    mma_bf16_16816(c, va.z, vb.z, va.w, vb.w, m[2], m[3]);
    mma_bf16_16816(c, va.x, vb.x, va.y, vb.y, h[0], h[1]);
    mma_bf16_16816(c, va.z, vb.z, va.w, vb.w, h[2], h[3]);
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] += c[i];
}

// One step of 32 k for all MT m-tiles and the active n-tiles of a warp.
template <int NTILES, int MT, int SPLITS>
__device__ __forceinline__ void mma_kstep(float (*acc)[NTILES][4], const uint4* va, const uint4* vb,
                                          const float4* const* xp, int s, bool two) {
#pragma unroll
    for (int j = 0; j < NTILES; ++j) {
        if (j == 0 || two) {
            const float4 p = __ldg(xp[j] + 8 * s), q = __ldg(xp[j] + 8 * s + 1);
            unsigned int h[4], m[4], l[4];
            split_pair(p.x, p.y, h[0], m[0], l[0]);
            split_pair(p.z, p.w, h[1], m[1], l[1]);
            split_pair(q.x, q.y, h[2], m[2], l[2]);
            split_pair(q.z, q.w, h[3], m[3], l[3]);
#pragma unroll
            for (int i = 0; i < MT; ++i) mma_step<SPLITS>(acc[i][j], va[i], vb[i], h, m, l);
        }
    }
}

// NT: tokens per tile (8 or 16); KS: warps splitting K (1 or 8); MT: 16-row m-tiles per warp (1 or 2).
template <int NT, int KS, int MT, int SPLITS>
__device__ __forceinline__ void mma_gemv_body(const float* __restrict__ X, const int* __restrict__ row_index,
                                              const bf16_bits_t* __restrict__ W, long long w_expert_stride,
                                              float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                              const int* tile_count, const int* n_tiles, int M, int N, int K) {
    constexpr int NTILES = NT / 8;  // n-tiles of 8 tokens
    constexpr int RG = 8 / KS;      // row groups (of MT m-tiles) per block
    constexpr int U = 4 / MT;       // steps of 32 k per group: 2 * MT * U = 8 16-byte loads per lane
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / KS, ks = warp % KS;
    const int n0 = (blockIdx.x * RG + rg) * 16 * MT;
    if (KS == 1 && n0 >= N) return;  // (KS > 1: one row group per block, always inside N)
    const int g = lane >> 2, t = lane & 3;
    const bf16_bits_t* Wb = W + e * w_expert_stride;
    const uint4* wa[MT];
    const uint4* wb[MT];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int row_a = min(n0 + 16 * i + g, N - 1), row_b = min(n0 + 16 * i + g + 8, N - 1);
        wa[i] = reinterpret_cast<const uint4*>(Wb + (long long)row_a * K) + t;
        wb[i] = reinterpret_cast<const uint4*>(Wb + (long long)row_b * K) + t;
    }
    const float4* xp[NTILES];
#pragma unroll
    for (int j = 0; j < NTILES; ++j) {
        const int tok = j * 8 + g < count ? j * 8 + g : 0;
        const long long xrow = row_index != nullptr ? (long long)row_index[start + tok] : (long long)(start + tok);
        xp[j] = reinterpret_cast<const float4*>(X + xrow * K) + 2 * t;
    }
    const bool two = NTILES == 2 && count > 8;
    float acc[MT][NTILES][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NTILES; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
    const int S = K >> 5;  // steps of 32 k
    const int Q = S / U;   // full groups of U steps; group qq covers steps qq*U .. qq*U+U-1
    uint4 va[U][MT], vb[U][MT];
    if (ks < Q) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                va[u][i] = ld_stream16(wa[i] + 4 * (ks * U + u));
                vb[u][i] = ld_stream16(wb[i] + 4 * (ks * U + u));
            }
    }
    for (int qq = ks; qq < Q; qq += KS) {
        // prefetch the warp's next group while this one is multiplied
        uint4 na[U][MT], nb[U][MT];
        const int qn = qq + KS;
        if (qn < Q) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    na[u][i] = ld_stream16(wa[i] + 4 * (qn * U + u));
                    nb[u][i] = ld_stream16(wb[i] + 4 * (qn * U + u));
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) mma_kstep<NTILES, MT, SPLITS>(acc, va[u], vb[u], xp, qq * U + u, two);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                va[u][i] = na[u][i];
                vb[u][i] = nb[u][i];
            }
    }
    for (int s = Q * U + ks; s < S; s += KS) {  // tail steps (fewer than U)
        uint4 ta[MT], tb[MT];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            ta[i] = ld_stream16(wa[i] + 4 * s);
            tb[i] = ld_stream16(wb[i] + 4 * s);
        }
        mma_kstep<NTILES, MT, SPLITS>(acc, ta, tb, xp, s, two);
    }
    if (KS > 1) {
        __shared__ float red[8][MT * NTILES * 4][32];  // [warp][accumulator][lane]: conflict-free
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NTILES; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) red[warp][(i * NTILES + j) * 4 + c][lane] = acc[i][j][c];
        __syncthreads();
        if (ks != 0) return;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int j = 0; j < NTILES; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    float sum = acc[i][j][c];
                    for (int w = 1; w < KS; ++w) sum += red[rg * KS + w][(i * NTILES + j) * 4 + c][lane];
                    acc[i][j][c] = sum;
                }
    }
    // C fragment: c0, c1 = feature g, tokens 2t, 2t+1; c2, c3 = feature g + 8, same tokens
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NTILES; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int tok = j * 8 + 2 * t + (c & 1);
                const int n = n0 + 16 * i + g + (c >> 1) * 8;
                if (tok < count && n < N) Y[(long long)(start + tok) * N + n] = acc[i][j][c];
            }
}

// KS = 1 variant with the activation split shared by the block: all 8 warps of a block multiply the same
// tokens over the same k-steps (different weight rows), so per group of U steps the block loads the
// group's activations once (one float4 per thread), splits them, and stores the hi/mid/lo B fragments in
// shared memory in the fragment order (double-buffered, one __syncthreads per group); every warp then
// reads its B fragments with three conflict-free 16-byte shared loads per step and n-tile. The weights
// of the next group are prefetched into registers before the barrier. Tail steps (K % (32 U)) use the
// per-lane split of mma_kstep.
template <int NT, int MT, int SPLITS>
__device__ __forceinline__ void mma_gemv_body_sx(const float* __restrict__ X, const int* __restrict__ row_index,
                                                 const bf16_bits_t* __restrict__ W, long long w_expert_stride,
                                                 float* __restrict__ Y, const int* tile_expert,
                                                 const int* tile_start, const int* tile_count, const int* n_tiles,
                                                 int M, int N, int K) {
    constexpr int NTILES = NT / 8;
    constexpr int U = 4 / MT;
    constexpr int F4 = NT * 8 * U;              // float4 of activations per group
    constexpr int FI = (F4 + 255) / 256;        // per thread
    __shared__ uint4 sx[2][U][NTILES][32][3];   // [buffer][step][n-tile][lane][hi, mid, lo]
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * 8 + warp) * 16 * MT;  // (warps past N still take part in the barriers)
    const int g = lane >> 2, t = lane & 3;
    const bf16_bits_t* Wb = W + e * w_expert_stride;
    const uint4* wa[MT];
    const uint4* wb[MT];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int row_a = min(n0 + 16 * i + g, N - 1), row_b = min(n0 + 16 * i + g + 8, N - 1);
        wa[i] = reinterpret_cast<const uint4*>(Wb + (long long)row_a * K) + t;
        wb[i] = reinterpret_cast<const uint4*>(Wb + (long long)row_b * K) + t;
    }
    const bool two = NTILES == 2 && count > 8;
    // staging coordinates of this thread: float4 f = token * 8U + u * 8 + t4 * 2 + half
    const float4* sp[FI];
    bool sact[FI];
    int s_u[FI], s_j[FI], s_lane[FI], s_half[FI];
#pragma unroll
    for (int r = 0; r < FI; ++r) {
        const int f = threadIdx.x + 256 * r;
        const int tokn = f / (8 * U), v = f % (8 * U);
        sact[r] = f < F4 && (tokn < 8 || two);
        const int tok = tokn < count ? tokn : 0;
        const long long xrow = row_index != nullptr ? (long long)row_index[start + tok] : (long long)(start + tok);
        s_u[r] = v / 8;
        s_j[r] = tokn / 8;
        s_lane[r] = (tokn % 8) * 4 + (v % 8) / 2;
        s_half[r] = v % 2;
        sp[r] = reinterpret_cast<const float4*>(X + xrow * K) + s_u[r] * 8 + (v % 8);  // + 8 U per group
    }
    const float4* xp[NTILES];  // for the tail steps
#pragma unroll
    for (int j = 0; j < NTILES; ++j) {
        const int tok = j * 8 + g < count ? j * 8 + g : 0;
        const long long xrow = row_index != nullptr ? (long long)row_index[start + tok] : (long long)(start + tok);
        xp[j] = reinterpret_cast<const float4*>(X + xrow * K) + 2 * t;
    }
    float acc[MT][NTILES][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NTILES; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
    const int S = K >> 5;
    const int Q = S / U;
    float4 xr[FI];
    uint4 va[U][MT], vb[U][MT];
    auto stage_store = [&](int buf) {
#pragma unroll
        for (int r = 0; r < FI; ++r) {
            if (sact[r]) {
                unsigned int h0, m0, l0, h1, m1, l1;
                split_pair(xr[r].x, xr[r].y, h0, m0, l0);
                split_pair(xr[r].z, xr[r].w, h1, m1, l1);
                unsigned int* d = reinterpret_cast<unsigned int*>(&sx[buf][s_u[r]][s_j[r]][s_lane[r]][0]);
                const int o = 2 * s_half[r];
                *reinterpret_cast<uint2*>(d + o) = make_uint2(h0, h1);
                *reinterpret_cast<uint2*>(d + 4 + o) = make_uint2(m0, m1);
                *reinterpret_cast<uint2*>(d + 8 + o) = make_uint2(l0, l1);
            }
        }
    };
    if (Q > 0) {
#pragma unroll
        for (int r = 0; r < FI; ++r)
            if (sact[r]) xr[r] = __ldg(sp[r]);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                va[u][i] = ld_stream16(wa[i] + 4 * u);
                vb[u][i] = ld_stream16(wb[i] + 4 * u);
            }
        stage_store(0);
    }
    for (int qq = 0; qq < Q; ++qq) {
        const int qn = qq + 1;
        uint4 na[U][MT], nb[U][MT];
        if (qn < Q) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    na[u][i] = ld_stream16(wa[i] + 4 * (qn * U + u));
                    nb[u][i] = ld_stream16(wb[i] + 4 * (qn * U + u));
                }
#pragma unroll
            for (int r = 0; r < FI; ++r)
                if (sact[r]) xr[r] = __ldg(sp[r] + 8 * U * qn);
        }
        __syncthreads();  // group qq's fragments visible; everyone is done reading buffer (qq + 1) & 1
        const int b = qq & 1;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < NTILES; ++j) {
                if (j == 0 || two) {
                    const uint4 h = sx[b][u][j][lane][0], m = sx[b][u][j][lane][1], l = sx[b][u][j][lane][2];
                    const unsigned int hh[4] = {h.x, h.y, h.z, h.w}, mm[4] = {m.x, m.y, m.z, m.w},
                                       ll[4] = {l.x, l.y, l.z, l.w};
#pragma unroll
                    for (int i = 0; i < MT; ++i) mma_step<SPLITS>(acc[i][j], va[u][i], vb[u][i], hh, mm, ll);
                }
            }
        if (qn < Q) stage_store(qn & 1);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                va[u][i] = na[u][i];
                vb[u][i] = nb[u][i];
            }
    }
    for (int s = Q * U; s < S; ++s) {  // tail steps (fewer than U)
        uint4 ta[MT], tb[MT];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            ta[i] = ld_stream16(wa[i] + 4 * s);
            tb[i] = ld_stream16(wb[i] + 4 * s);
        }
        mma_kstep<NTILES, MT, SPLITS>(acc, ta, tb, xp, s, two);
    }
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NTILES; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int tok = j * 8 + 2 * t + (c & 1);
                const int n = n0 + 16 * i + g + (c >> 1) * 8;
                if (tok < count && n < N) Y[(long long)(start + tok) * N + n] = acc[i][j][c];
            }
}
