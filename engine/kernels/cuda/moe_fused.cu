// Fused decode-path kernels of the MoE block (engine/kernels/moe.py, FUSED_DECODE; 1..16 tokens).
//
// The unfused chain is 12 launches + a memset (router GEMV, top-k, tables, shared gate/up, shared SwiGLU,
// shared down, shared gate, grouped gate/up, SwiGLU, grouped down, combine). Here:
//   moe_route<WT, NT, R, KS, VEC>     : the router GEMV (gemv_body, the very launch linear() would make), then the
//                                       last block to finish does top-k for every token and the route tables.
//   moe_gemv_dense / moe_gemv_mma /   : one GEMV launch (the body linear() / grouped_linear() would pick, unchanged)
//   moe_qgemv_fp8 / moe_qgemv_nvfp4     followed by an epilogue run by the last block of a group of blocks:
//        EPI 1 (SwiGLU)  : the last of the grid_x blocks of a row tile computes h = silu(gate) * up for the tile's
//                          rows (gate/up launches: routed grouped and shared dense);
//        EPI 2 (combine) : the last of the grid_y blocks (tiles) of a column block computes, for its columns and
//                          every token, out = sum_j w[t, j] * Y[pos[t, j]] (+ sigmoid(g[t]) * shared[t]), slots in
//                          order j (the grouped down launch).
// Numerics: every value is computed by the same expression as in the unfused chain (gemv bodies shared through
// gemv_*.cuh; top-k emulates router_topk's 256-thread reductions lane by lane; SwiGLU and combine are the
// dense_moe.cu formulas), so the results are bit-identical to it. No float atomics: the epilogues run once per
// group, in a fixed order, so replays are bit-exact.
//
// "Last block" handshake: every thread fences its global writes, the block synchronises, thread 0 takes a ticket
// from an int counter (atomicAdd); the block drawing the last ticket resets the counter to 0 (ready for the next
// launch and every graph replay) and reads the other blocks' results through L2 (__ldcg). The counters are one
// device buffer (moe.py), zero when no fused kernel is running: one fused MoE chain in flight per device.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule, name expressions of the templates) and nvcc.

#include "common.cuh"
#include "gemv_dense.cuh"
#include "gemv_quant.cuh"
#include "gemv_mma.cuh"
#include "moe_route.cuh"

// True in the block that finished last of `expected` blocks sharing `counter` (which it resets to 0).
__device__ __forceinline__ bool moe_last_block(int* counter, int expected) {
    __shared__ int s_last;
    __threadfence();  // this thread's results are visible device-wide before its block takes a ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        const int ticket = atomicAdd(counter, 1);
        const int last = ticket == expected - 1;
        if (last) atomicExch(counter, 0);
        s_last = last;
    }
    __syncthreads();
    const bool last = s_last != 0;
    if (last) __threadfence();
    return last;
}

// Router GEMV (logits [T, E] = X [T, H] @ W [E, H]^T, grid and body exactly as linear() launches them), then
// the last block: top-k of every token (warp w takes tokens w, w + 8, ...) and the tables. 256 threads; dynamic
// shared memory max(8 * E floats, E ints).
template <typename WT, int NT, int R, int KS, bool VEC>
__global__ void __launch_bounds__(256) moe_route(const float* X, const WT* W, float* logits, int T, int E, int H,
                                                 int k, int renorm, int TM, int* ids, float* wts, int* offsets,
                                                 int* sorted_token, int* slot_pos, int* tile_expert, int* tile_start,
                                                 int* tile_count, int* n_tiles, int* counter) {
    gemv_body<WT, NT, R, KS, VEC>(X, nullptr, W, 0, logits, nullptr, nullptr, nullptr, nullptr, T, E, H);
    if (!moe_last_block(counter, gridDim.x * gridDim.y)) return;
    extern __shared__ float moe_dyn[];
    const int warp = threadIdx.x >> 5;
    for (int t = warp; t < T; t += 8)
        moe_topk_warp(logits + (long long)t * E, E, k, renorm, ids + (long long)t * k, wts + (long long)t * k,
                      moe_dyn + warp * E);
    __syncthreads();  // ids (global, written by this block) visible to the block; probs no longer needed
    moe_tables_block(ids, T * k, k, E, TM, reinterpret_cast<int*>(moe_dyn), offsets, sorted_token, slot_pos,
                     tile_expert, tile_start, tile_count, n_tiles);
}

// Epilogues (see the header). TM: the body's rows per tile (its resolve_tile argument). cols_per_block: output
// columns of one grid-x block of the body. pair_p (SwiGLU): > 0 when I is a multiple of cols_per_block, then the
// gate columns of grid-x block b and the up columns of block b + pair_p are the same features and the second of
// the two to finish does their SwiGLU (small, parallel tails); 0: the last of the tile's blocks does the whole tile.
#define MOE_EPI_PARAMS                                                                                         \
    int *counter, float *h, const int *slot_pos, const float *rw, const float *shared, const float *sgate,    \
        float *out, int T, int k, int cols_per_block, int pair_p

// h[s, c] = silu(Y[s, c]) * Y[s, I + c] for rows [s0, s0 + rows), columns [c0, c0 + nc); 4 elements' loads in flight
__device__ __forceinline__ void moe_swiglu_rows(const float* Y, float* h, int I, int s0, int rows, int c0, int nc) {
    const int n = rows * nc;
    for (int i0 = threadIdx.x; i0 < n; i0 += 4 * blockDim.x) {
        float g[4], u[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = i0 + q * blockDim.x;
            if (i < n) {
                const long long s = s0 + i / nc;
                const int c = c0 + i % nc;
                g[q] = __ldcg(Y + s * 2 * I + c);
                u[q] = __ldcg(Y + s * 2 * I + I + c);
            }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const int i = i0 + q * blockDim.x;
            if (i < n) {
                const long long s = s0 + i / nc;
                const int c = c0 + i % nc;
                h[s * I + c] = (g[q] / (1.f + expf(-g[q]))) * u[q];  // dense_moe.cu moe_swiglu
            }
        }
    }
}

template <int EPI, int TM>
__device__ __forceinline__ void moe_epilogue(const float* Y, int M, int N, const int* tile_expert,
                                             const int* tile_start, const int* tile_count, const int* n_tiles,
                                             MOE_EPI_PARAMS) {
    if (EPI == 1) {
        const int I = N / 2;
        int start, count;
        long long e;
        if (pair_p > 0) {  // SwiGLU of one column pair of row tile blockIdx.y once both blocks are done
            const int b = blockIdx.x % pair_p;
            if (!moe_last_block(counter + (long long)blockIdx.y * pair_p + b, 2)) return;
            if (!resolve_tile(blockIdx.y, TM, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
            const int c0 = b * cols_per_block;
            moe_swiglu_rows(Y, h, I, start, count, c0, min(cols_per_block, I - c0));
        } else {  // SwiGLU of the row tile blockIdx.y once all its column blocks are done
            if (!moe_last_block(counter + blockIdx.y, gridDim.x)) return;
            if (!resolve_tile(blockIdx.y, TM, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
            moe_swiglu_rows(Y, h, I, start, count, 0, I);
        }
    } else if (EPI == 2) {  // combine of the columns of column block blockIdx.x once all its tiles are done
        if (!moe_last_block(counter + blockIdx.x, gridDim.y)) return;
        const int n0 = blockIdx.x * cols_per_block, n1 = min(N, n0 + cols_per_block), nc = n1 - n0;
        for (int i = threadIdx.x; i < T * nc; i += blockDim.x) {
            const int t = i / nc, n = n0 + i % nc;
            float acc = 0.f;  // dense_moe.cu moe_combine: acc += Y[pos] * w in slot order j (8 slots' loads in flight)
            for (int j0 = 0; j0 < k; j0 += 8) {
                float yv[8], wv[8];
                bool ok[8];
#pragma unroll
                for (int q = 0; q < 8; ++q) {
                    const int j = j0 + q;
                    const int p = j < k ? slot_pos[t * k + j] : -1;
                    ok[q] = p >= 0;
                    yv[q] = ok[q] ? __ldcg(Y + (long long)p * N + n) : 0.f;
                    wv[q] = ok[q] ? rw[t * k + j] : 0.f;
                }
#pragma unroll
                for (int q = 0; q < 8; ++q)
                    if (ok[q]) acc += yv[q] * wv[q];
            }
            if (shared != nullptr) {
                float g = sgate[t];
                acc += (1.f / (1.f + expf(-g))) * shared[(long long)t * N + n];
            }
            out[(long long)t * N + n] = acc;
        }
    }
}

#define MOE_EPI_PASS(TM)                                                                                      \
    moe_epilogue<EPI, TM>(Y, M, N, tile_expert, tile_start, tile_count, n_tiles, counter, h, slot_pos, rw,    \
                          shared, sgate, out, T, k, cols_per_block, pair_p)

template <int EPI, typename WT, int NT, int R, int KS, bool VEC>
__global__ void __launch_bounds__(256) moe_gemv_dense(const float* X, const int* row_index, const WT* W,
                                                      long long w_expert_stride, float* Y, const int* tile_expert,
                                                      const int* tile_start, const int* tile_count,
                                                      const int* n_tiles, int M, int N, int K, MOE_EPI_PARAMS) {
    gemv_body<WT, NT, R, KS, VEC>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles,
                                  M, N, K);
    MOE_EPI_PASS(NT);
}

template <int EPI, int NT, int KS, int SX>
__global__ void __launch_bounds__(256) moe_gemv_mma(const float* X, const int* row_index, const bf16_bits_t* W,
                                                    long long w_expert_stride, float* Y, const int* tile_expert,
                                                    const int* tile_start, const int* tile_count, const int* n_tiles,
                                                    int M, int N, int K, MOE_EPI_PARAMS) {
    if constexpr (SX != 0)
        mma_gemv_body_sx<NT, 1, 3>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles,
                                   M, N, K);
    else
        mma_gemv_body<NT, KS, 1, 3>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count,
                                    n_tiles, M, N, K);
    MOE_EPI_PASS(NT);
}

template <int EPI, int NT, int R, int KS, bool VEC>
__global__ void __launch_bounds__(256) moe_qgemv_fp8(const u8* Q, const float* S, long long q_es, long long s_es,
                                                     int rb, int cb, int ncb, const float* X, const int* row_index,
                                                     float* Y, const int* tile_expert, const int* tile_start,
                                                     const int* tile_count, const int* n_tiles, int M, int N, int K,
                                                     MOE_EPI_PARAMS) {
    FP8W ld{Q, S, q_es, s_es, rb, cb, ncb};
    qgemv_body<FP8W, NT, R, KS, VEC>(ld, X, row_index, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K);
    MOE_EPI_PASS(NT);
}

template <int EPI, int NT, int R, int KS, bool VEC>
__global__ void __launch_bounds__(256) moe_qgemv_nvfp4(const u8* Q, const u8* S, const float* S2, long long q_es,
                                                       long long s_es, int s2_rows, int s2_per_e, const float* X,
                                                       const int* row_index, float* Y, const int* tile_expert,
                                                       const int* tile_start, const int* tile_count,
                                                       const int* n_tiles, int M, int N, int K, MOE_EPI_PARAMS) {
    NVFP4W ld{Q, S, S2, q_es, s_es, s2_rows, s2_per_e};
    qgemv_body<NVFP4W, NT, R, KS, VEC>(ld, X, row_index, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K);
    MOE_EPI_PASS(NT);
}

// nvcc (tests/engine/test_engine_nvcc.py) compiles this file without name expressions: instantiate one of each
// so the template bodies are checked there too (NVRTC instantiates only what moe.py names).
#ifndef __CUDACC_RTC__
template __global__ void moe_route<float, 1, 1, 8, true>(const float*, const float*, float*, int, int, int, int, int,
                                                         int, int*, float*, int*, int*, int*, int*, int*, int*, int*,
                                                         int*);
template __global__ void moe_gemv_dense<1, unsigned short, 4, 4, 1, true>(const float*, const int*,
                                                                          const unsigned short*, long long, float*,
                                                                          const int*, const int*, const int*,
                                                                          const int*, int, int, int, MOE_EPI_PARAMS);
template __global__ void moe_gemv_mma<2, 16, 1, 1>(const float*, const int*, const bf16_bits_t*, long long, float*,
                                                   const int*, const int*, const int*, const int*, int, int, int,
                                                   MOE_EPI_PARAMS);
template __global__ void moe_qgemv_fp8<2, 1, 4, 1, true>(const u8*, const float*, long long, long long, int, int, int,
                                                         const float*, const int*, float*, const int*, const int*,
                                                         const int*, const int*, int, int, int, MOE_EPI_PARAMS);
template __global__ void moe_qgemv_nvfp4<1, 16, 1, 8, false>(const u8*, const u8*, const float*, long long, long long,
                                                             int, int, const float*, const int*, float*, const int*,
                                                             const int*, const int*, const int*, int, int, int,
                                                             MOE_EPI_PARAMS);
#endif
