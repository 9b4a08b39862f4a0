// Device helpers shared by several engine kernel files (included with #include "common.cuh").
//
// nvcc finds this header beside the including source; for NVRTC, engine.backend.load_module inlines it into the
// source text (so cupy's compile cache, keyed on that text, sees a change here too). No host headers.
#pragma once

// Sum of v over the block. blockDim.x is a multiple of 32, at most 1024; red holds >= 33 floats (shared).
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();  // red may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = (threadIdx.x < nw) ? red[threadIdx.x] : 0.f;
    if (warp == 0) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) red[32] = s;
    }
    __syncthreads();
    return red[32];
}

// The row tile a GEMM/GEMV block handles: grouped (MoE: tile_start/tile_count/tile_expert/n_tiles from the
// dispatch) or dense (tile * TM, expert 0). Returns false when the block has nothing to do.
__device__ __forceinline__ bool resolve_tile(int tile, int TM, int M, const int* tile_expert, const int* tile_start,
                                             const int* tile_count, const int* n_tiles, int& start, int& count,
                                             long long& e) {
    if (tile_start != nullptr) {
        if (tile >= *n_tiles) return false;
        start = tile_start[tile];
        count = tile_count[tile];
        e = tile_expert[tile];
    } else {
        start = tile * TM;
        if (start >= M) return false;
        count = min(TM, M - start);
        e = 0;
    }
    return count > 0;
}

// 8 weights . 8 activations (two float4), the GEMV bodies' inner product (gemv_dense.cuh, gemv_quant.cuh)
__device__ __forceinline__ float dot8(const float* w, float4 a, float4 b) {
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}
