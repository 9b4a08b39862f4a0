// Dense linear kernels of the qwen4exp engine: Y[M, N] = X[M, K] @ W[N, K]^T.
//
// Weights are BF16 bit patterns (unsigned short; decoded exactly by a 16-bit shift) or float32;
// activations and accumulation are float32. Two shapes of work:
//   * gemv_*  : decode (few rows per weight matrix). One warp per output row, 16-byte weight loads,
//               up to NT activation rows share every weight load, warp-shuffle reduction.
//   * gemm_*  : prefill (many rows). 64x64 output tiles, BK=16, 4x4 per thread, shared memory.
// Both support "grouped" operation (MoE experts): a tile table lists (expert, first row, row count)
// per tile, computed on the device; tiles past *n_tiles exit early, so the grid can be sized by the
// worst case without a host synchronisation. Optional row_index gathers X rows.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

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

// Resolve the tile handled by this block. Returns false when the block has nothing to do.
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

template <typename WT, int NT, bool VEC>
__device__ __forceinline__ void gemv_body(const float* __restrict__ X, const int* __restrict__ row_index,
                                          const WT* __restrict__ W, long long w_expert_stride,
                                          float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                          const int* tile_count, const int* n_tiles, int M, int N, int K) {
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * (blockDim.x >> 5) + warp;
    if (n >= N) return;
    const WT* wrow = W + e * w_expert_stride + (long long)n * K;
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        int r = start + (t < count ? t : 0);
        long long xrow = row_index != nullptr ? (long long)row_index[r] : (long long)r;
        xr[t] = X + xrow * K;
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
    int k_done = 0;
    if (VEC) {
        const int K8 = K >> 3;
        int c = lane;
        // four independent 16-byte loads in flight per lane
        for (; c + 96 < K8; c += 128) {
            float w0[8], w1[8], w2[8], w3[8];
            load8(wrow + (long long)c * 8, w0);
            load8(wrow + (long long)(c + 32) * 8, w1);
            load8(wrow + (long long)(c + 64) * 8, w2);
            load8(wrow + (long long)(c + 96) * 8, w3);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < count) {
                    const float4* xp = reinterpret_cast<const float4*>(xr[t]);
                    float s = 0.f;
                    float4 a, b;
                    a = xp[2 * c]; b = xp[2 * c + 1];
                    s += w0[0] * a.x + w0[1] * a.y + w0[2] * a.z + w0[3] * a.w + w0[4] * b.x + w0[5] * b.y + w0[6] * b.z + w0[7] * b.w;
                    a = xp[2 * (c + 32)]; b = xp[2 * (c + 32) + 1];
                    s += w1[0] * a.x + w1[1] * a.y + w1[2] * a.z + w1[3] * a.w + w1[4] * b.x + w1[5] * b.y + w1[6] * b.z + w1[7] * b.w;
                    a = xp[2 * (c + 64)]; b = xp[2 * (c + 64) + 1];
                    s += w2[0] * a.x + w2[1] * a.y + w2[2] * a.z + w2[3] * a.w + w2[4] * b.x + w2[5] * b.y + w2[6] * b.z + w2[7] * b.w;
                    a = xp[2 * (c + 96)]; b = xp[2 * (c + 96) + 1];
                    s += w3[0] * a.x + w3[1] * a.y + w3[2] * a.z + w3[3] * a.w + w3[4] * b.x + w3[5] * b.y + w3[6] * b.z + w3[7] * b.w;
                    acc[t] += s;
                }
            }
        }
        for (; c < K8; c += 32) {
            float w0[8];
            load8(wrow + (long long)c * 8, w0);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                if (t < count) {
                    const float4* xp = reinterpret_cast<const float4*>(xr[t]);
                    float4 a = xp[2 * c], b = xp[2 * c + 1];
                    acc[t] += w0[0] * a.x + w0[1] * a.y + w0[2] * a.z + w0[3] * a.w + w0[4] * b.x + w0[5] * b.y + w0[6] * b.z + w0[7] * b.w;
                }
            }
        }
        k_done = K8 << 3;
    }
    for (int k = k_done + lane; k < K; k += 32) {
        float wv = load_w(wrow, k);
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (t < count) acc[t] += wv * xr[t][k];
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
        if (lane == t && t < count) Y[(long long)(start + t) * N + n] = acc[t];
}

#define GEMV_ENTRY(NAME, WT, NT, VEC)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                      \
        const float* X, const int* row_index, const WT* W, long long w_expert_stride, float* Y,                  \
        const int* tile_expert, const int* tile_start, const int* tile_count, const int* n_tiles, int M, int N,  \
        int K) {                                                                                                 \
        gemv_body<WT, NT, VEC>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles, \
                               M, N, K);                                                                         \
    }

GEMV_ENTRY(gemv_bf16_nt1_v, bf16_bits_t, 1, true)
GEMV_ENTRY(gemv_bf16_nt4_v, bf16_bits_t, 4, true)
GEMV_ENTRY(gemv_bf16_nt16_v, bf16_bits_t, 16, true)
GEMV_ENTRY(gemv_bf16_nt1_s, bf16_bits_t, 1, false)
GEMV_ENTRY(gemv_bf16_nt4_s, bf16_bits_t, 4, false)
GEMV_ENTRY(gemv_bf16_nt16_s, bf16_bits_t, 16, false)
GEMV_ENTRY(gemv_f32_nt1_v, float, 1, true)
GEMV_ENTRY(gemv_f32_nt4_v, float, 4, true)
GEMV_ENTRY(gemv_f32_nt16_v, float, 16, true)
GEMV_ENTRY(gemv_f32_nt1_s, float, 1, false)
GEMV_ENTRY(gemv_f32_nt4_s, float, 4, false)
GEMV_ENTRY(gemv_f32_nt16_s, float, 16, false)

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
    gemm_body<bf16_bits_t>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K);
}

extern "C" __global__ void __launch_bounds__(256) gemm_f32(const float* X, const int* row_index, const float* W,
                                                           long long w_expert_stride, float* Y,
                                                           const int* tile_expert, const int* tile_start,
                                                           const int* tile_count, const int* n_tiles, int M, int N,
                                                           int K) {
    gemm_body<float>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K);
}
