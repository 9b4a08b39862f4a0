// Dense linear kernels of the qwen4exp engine: Y[M, N] = X[M, K] @ W[N, K]^T.
//
// Weights are BF16 bit patterns (unsigned short; decoded exactly by a 16-bit shift) or float32;
// activations and accumulation are float32. Two shapes of work:
//   * gemv_*  : decode (few rows per weight matrix). Warps own R weight rows (optionally KS warps split
//               K for short, wide matrices), 16-byte weight loads, up to NT activation rows share
//               every weight load, warp-shuffle (+ shared-memory for KS > 1) reduction.
//   * gemm_*  : prefill (many rows). 64x64 output tiles, BK=16, 4x4 per thread, shared memory.
// Both support "grouped" operation (MoE experts): a tile table lists (expert, first row, row count)
// per tile, computed on the device; tiles past *n_tiles exit early, so the grid can be sized by the
// worst case without a host synchronisation. Optional row_index gathers X rows.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
#include "common.cuh"

#include "gemv_dense.cuh"

#define GEMV_ENTRY(NAME, WT, NT, R, KS, VEC)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                      \
        const float* X, const int* row_index, const WT* W, long long w_expert_stride, float* Y,                  \
        const int* tile_expert, const int* tile_start, const int* tile_count, const int* n_tiles, int M, int N,  \
        int K) { GRID_DEP_ENTRY();                                                                               \
        gemv_body<WT, NT, R, KS, VEC>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count,  \
                                      n_tiles, M, N, K);                                                         \
    }

#define GEMV_FAMILY(WNAME, WT)                                       \
    GEMV_ENTRY(gemv_##WNAME##_nt1_r1_ks1_v, WT, 1, 1, 1, true)      \
    GEMV_ENTRY(gemv_##WNAME##_nt1_r1_ks1_s, WT, 1, 1, 1, false)     \
    GEMV_ENTRY(gemv_##WNAME##_nt1_r1_ks8_v, WT, 1, 1, 8, true)      \
    GEMV_ENTRY(gemv_##WNAME##_nt1_r1_ks8_s, WT, 1, 1, 8, false)     \
    GEMV_ENTRY(gemv_##WNAME##_nt4_r4_ks1_v, WT, 4, 4, 1, true)      \
    GEMV_ENTRY(gemv_##WNAME##_nt4_r4_ks1_s, WT, 4, 4, 1, false)     \
    GEMV_ENTRY(gemv_##WNAME##_nt4_r1_ks8_v, WT, 4, 1, 8, true)      \
    GEMV_ENTRY(gemv_##WNAME##_nt4_r1_ks8_s, WT, 4, 1, 8, false)     \
    GEMV_ENTRY(gemv_##WNAME##_nt16_r4_ks1_v, WT, 16, 4, 1, true)    \
    GEMV_ENTRY(gemv_##WNAME##_nt16_r4_ks1_s, WT, 16, 4, 1, false)   \
    GEMV_ENTRY(gemv_##WNAME##_nt16_r1_ks8_v, WT, 16, 1, 8, true)    \
    GEMV_ENTRY(gemv_##WNAME##_nt16_r1_ks8_s, WT, 16, 1, 8, false)

GEMV_FAMILY(bf16, bf16_bits_t)
GEMV_FAMILY(f32, float)

// ---------------------------------------------------------------------------------------------------------
// Tiled GEMM: 64 x 64 outputs per block, 256 threads, 4 x 4 per thread, K in steps of 16.
#define GBM 64
#define GBN 64
#define GBK 16

template <typename WT>
__device__ __forceinline__ void gemm_body(const float* __restrict__ X, const int* __restrict__ row_index,
                                          const WT* __restrict__ W, long long w_expert_stride,
                                          float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                          const int* tile_count, const int* n_tiles, int M, int N, int K) {
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, GBM, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    __shared__ float As[GBK][GBM + 4];
    __shared__ float Bs[GBK][GBN + 4];
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int n0 = blockIdx.x * GBN;
    const WT* Wb = W + e * w_expert_stride;
    // loader coordinates: one row (of A or B) and 4 consecutive k per thread
    const int lr = tid >> 2, lk = (tid & 3) * 4;
    const bool a_ok = lr < count;
    long long a_row = 0;
    if (a_ok) a_row = row_index != nullptr ? (long long)row_index[start + lr] : (long long)(start + lr);
    const float* xa = X + a_row * K;
    const int bn = n0 + lr;
    const bool b_ok = bn < N;
    const WT* wb = Wb + (long long)(b_ok ? bn : 0) * K;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += GBK) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int k = k0 + lk + i;
            As[lk + i][lr] = (a_ok && k < K) ? xa[k] : 0.f;
            Bs[lk + i][lr] = (b_ok && k < K) ? load_w(wb, k) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GBK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int r = ty * 4 + i;
        if (r >= count) continue;
        float* yr = Y + (long long)(start + r) * N;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int n = n0 + tx * 4 + j;
            if (n < N) yr[n] = acc[i][j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) gemm_bf16(const float* X, const int* row_index,
                                                            const bf16_bits_t* W, long long w_expert_stride,
                                                            float* Y, const int* tile_expert, const int* tile_start,
                                                            const int* tile_count, const int* n_tiles, int M, int N,
                                                            int K) {
    GRID_DEP_ENTRY();
    gemm_body<bf16_bits_t>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K);
}

extern "C" __global__ void __launch_bounds__(256) gemm_f32(const float* X, const int* row_index, const float* W,
                                                           long long w_expert_stride, float* Y,
                                                           const int* tile_expert, const int* tile_start,
                                                           const int* tile_count, const int* n_tiles, int M, int N,
                                                           int K) {
    GRID_DEP_ENTRY();
    gemm_body<float>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K);
}
