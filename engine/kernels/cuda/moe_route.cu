// MoE routing of the decode chain (engine/kernels/moe.py, FUSED_DECODE; 1..16 tokens), no grid-wide handshake:
//
//   moe_route_block : one block of 32 * W threads (W warps, 1 <= W <= 16, dynamic shared memory W * E floats) after the
//                     router GEMV: top-k of every token (warp w: tokens w, w + W, ...; bit-identical to router_topk) and
//                     the route tables (counts, offsets, slot order, tile table: moe_tables' results; slot order within
//                     an expert deterministic), in place of router_topk + a memset + moe_tables (3 launches).
//   moe_combine_ilp : moe_combine's expression and summation order (slots in order j, then the gated shared expert),
//                     one output per thread with the loads of 8 slots in flight (moe_combine issues them one by one).
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "moe_route.cuh"

extern "C" __global__ void __launch_bounds__(512) moe_route_block(const float* __restrict__ logits, int T, int E, int k,
                                                                  int renorm, int TM, int* __restrict__ ids,
                                                                  float* __restrict__ wts, int* __restrict__ offsets,
                                                                  int* __restrict__ sorted_token,
                                                                  int* __restrict__ slot_pos,
                                                                  int* __restrict__ tile_expert,
                                                                  int* __restrict__ tile_start,
                                                                  int* __restrict__ tile_count,
                                                                  int* __restrict__ n_tiles) {
    extern __shared__ float moe_dyn[];
    const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int t = warp; t < T; t += nw)
        moe_topk_warp(logits + (long long)t * E, E, k, renorm, ids + (long long)t * k, wts + (long long)t * k,
                      moe_dyn + warp * E);
    __syncthreads();  // ids (global, written by this block) visible to the block; probs no longer needed
    moe_tables_block(ids, T * k, k, E, TM, reinterpret_cast<int*>(moe_dyn), offsets, sorted_token, slot_pos,
                     tile_expert, tile_start, tile_count, n_tiles);
}

extern "C" __global__ void moe_combine_ilp(const float* __restrict__ Y, const int* __restrict__ slot_pos,
                                           const float* __restrict__ w, const float* __restrict__ shared,
                                           const float* __restrict__ shared_gate, float* __restrict__ out, int T,
                                           int k, int H) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * H) return;
    const int t = (int)(i / H), h = (int)(i % H);
    float acc = 0.f;  // dense_moe.cu moe_combine: acc += Y[pos] * w, slots in order j
    for (int j0 = 0; j0 < k; j0 += 8) {
        float yv[8], wv[8];
        bool ok[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int j = j0 + q;
            const int p = j < k ? slot_pos[t * k + j] : -1;
            ok[q] = p >= 0;
            yv[q] = ok[q] ? Y[(long long)p * H + h] : 0.f;
            wv[q] = ok[q] ? w[t * k + j] : 0.f;
        }
#pragma unroll
        for (int q = 0; q < 8; ++q)
            if (ok[q]) acc += yv[q] * wv[q];
    }
    if (shared != nullptr) {
        float g = shared_gate[t];
        acc += (1.f / (1.f + expf(-g))) * shared[i];
    }
    out[i] = acc;
}
