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


// ---- exact 3-way BF16 split of float32 activations (dense_linear_mma.cu's GEMV, gemm_tc.cu's GEMM inputs)
// hi = x with the low 16 bits cleared, r = x - hi (exact), mid = r truncated likewise, lo = r - mid (exact): lo has
// at most 8 significant bits, so it is a BF16 value and x == hi + mid + lo exactly (for |x| >= 2^-102 or so: parts
// below 2^-126 are subnormal, see dense_linear_mma.cu's header; a non-finite x gives NaN parts). Truncation, not
// rounding: integer/ALU ops only, no overflow near FLT_MAX. The NumPy twin is engine.kernels.gemm_tc.split3_twin.
// Outputs are the float32 bit patterns of the parts (low 16 bits zero); the BF16 bits are the upper 16.
__device__ __forceinline__ void split3(float x, unsigned int& hi, unsigned int& mid, unsigned int& lo) {
    hi = __float_as_uint(x) & 0xffff0000u;
    const float r = x - __uint_as_float(hi);
    mid = __float_as_uint(r) & 0xffff0000u;
    lo = __float_as_uint(r - __uint_as_float(mid));
}

// One m16n8k16 BF16 tensor-core MMA, c += A B (float32 accumulators; fragment layouts: PTX ISA,
// "Matrix Fragments for mma.m16n8k16"): a0 / a1 = rows g / g + 8 at k 2t, 2t + 1; a2 / a3 the same rows at k + 8;
// b0 / b1 = column g at k 2t, 2t + 1 / + 8; c0, c1 = row g, columns 2t, 2t + 1; c2, c3 = row g + 8 (g = lane / 4,
// t = lane % 4). sm_80+.
__device__ __forceinline__ void mma_bf16_16816(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                               unsigned int a3, unsigned int b0, unsigned int b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// split3 of two float32 values (k and k+1) into packed bf16x2 parts hi, mid, lo (low half = a).
__device__ __forceinline__ void split_pair(float a, float b, unsigned int& hi, unsigned int& mid, unsigned int& lo) {
    unsigned int ha, ma, la, hb, mb, lb;
    split3(a, ha, ma, la);
    split3(b, hb, mb, lb);
    hi = __byte_perm(ha, hb, 0x7632);
    mid = __byte_perm(ma, mb, 0x7632);
    lo = __byte_perm(la, lb, 0x7632);
}

// E4M3 (fn: no infinities, S.1111.111 is NaN) -> float32, exact.
__device__ __forceinline__ float e4m3_to_f32(unsigned int b) {
    const unsigned int em = b & 0x7fu;
    float v = em >= 8u ? __uint_as_float((em << 20) + (120u << 23)) : (float)em * 0.001953125f;  // m * 2^-9
    if (em == 0x7fu) v = __int_as_float(0x7fc00000);
    return (b & 0x80u) ? -v : v;
}

// E2M1 nibble -> float32, exact: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
__device__ __forceinline__ float e2m1_to_f32(unsigned int nib) {
    const unsigned int m = nib & 7u;
    const unsigned int bits = m >= 2u ? (0x3F00u + m * 0x40u) << 16 : (m ? 0x3F000000u : 0u);
    return __uint_as_float(bits | ((nib & 8u) << 28));
}

// 8 weights . 8 activations (two float4), the GEMV bodies' inner product (gemv_dense.cuh, gemv_quant.cuh)
__device__ __forceinline__ float dot8(const float* w, float4 a, float4 b) {
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}
