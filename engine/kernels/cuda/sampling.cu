// Token selection on the device: row-wise argmax of float32 logits (greedy decoding).
//
// row_argmax: one block per row (small vocabularies / many rows). row_argmax_partial + row_argmax_final:
// P blocks per row each reduce a contiguous chunk, then one block per row reduces the P partials (a
// 248k-entry row read by one block alone takes ~100 us on an H200; by 64 blocks, a few us). Result = the index np.argmax would return: the first maximum, with NaN
// ranking above every number (np.argmax returns the first NaN when a row holds one). Each thread scans a
// strided slice keeping its first best, then a shared-memory tree reduction keeps, for equal values,
// the lower index. Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
__device__ __forceinline__ bool argmax_better(float v, long long i, float bv, long long bi) {
    // is (v, i) preferred to (bv, bi)? NaN first, then larger value, then lower index
    const bool vn = v != v, bn = bv != bv;
    if (vn || bn) {
        if (vn && bn) return i < bi;
        return vn;
    }
    if (v != bv) return v > bv;
    return i < bi;
}

extern "C" __global__ void __launch_bounds__(1024) row_argmax(const float* __restrict__ logits, long long V,
                                                              long long* __restrict__ out) {
    GRID_DEP_ENTRY();
    __shared__ float sv[1024];
    __shared__ long long si[1024];
    const long long row = blockIdx.x;
    const float* x = logits + row * V;
    float bv = -__int_as_float(0x7f800000);  // -inf
    long long bi = V;                         // "none yet": loses every tie
    for (long long j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = x[j];
        if (argmax_better(v, j, bv, bi)) { bv = v; bi = j; }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float v = sv[threadIdx.x + s];
            const long long i = si[threadIdx.x + s];
            if (argmax_better(v, i, sv[threadIdx.x], si[threadIdx.x])) { sv[threadIdx.x] = v; si[threadIdx.x] = i; }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[row] = si[0] < V ? si[0] : 0;  // a row of -inf only: index 0, as np.argmax
}

__device__ __forceinline__ void argmax_block_reduce(float& bv, long long& bi, float* sv, long long* si) {
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x >> 1; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float v = sv[threadIdx.x + s];
            const long long i = si[threadIdx.x + s];
            if (argmax_better(v, i, sv[threadIdx.x], si[threadIdx.x])) { sv[threadIdx.x] = v; si[threadIdx.x] = i; }
        }
        __syncthreads();
    }
    bv = sv[0];
    bi = si[0];
}

// grid (P, B), 256 threads: block p of row b reduces entries [p * chunk, min(V, (p + 1) * chunk))
extern "C" __global__ void __launch_bounds__(256) row_argmax_partial(const float* __restrict__ logits, long long V,
                                                                    long long chunk, float* __restrict__ part_v,
                                                                    long long* __restrict__ part_i) {
    GRID_DEP_ENTRY();
    __shared__ float sv[256];
    __shared__ long long si[256];
    const long long row = blockIdx.y;
    const int P = gridDim.x;
    const float* x = logits + row * V;
    const long long a = (long long)blockIdx.x * chunk;
    const long long b = a + chunk < V ? a + chunk : V;
    float bv = -__int_as_float(0x7f800000);
    long long bi = V;
    for (long long j = a + threadIdx.x; j < b; j += blockDim.x) {
        const float v = x[j];
        if (argmax_better(v, j, bv, bi)) { bv = v; bi = j; }
    }
    argmax_block_reduce(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        part_v[row * P + blockIdx.x] = bv;
        part_i[row * P + blockIdx.x] = bi;
    }
}

// one block (>= P threads, a power of two) per row
extern "C" __global__ void __launch_bounds__(1024) row_argmax_final(const float* __restrict__ part_v,
                                                                  const long long* __restrict__ part_i, int P,
                                                                  long long V, long long* __restrict__ out) {
    GRID_DEP_ENTRY();
    __shared__ float sv[1024];
    __shared__ long long si[1024];
    const long long row = blockIdx.x;
    float bv = -__int_as_float(0x7f800000);
    long long bi = V;
    if (threadIdx.x < P) {
        bv = part_v[row * P + threadIdx.x];
        bi = part_i[row * P + threadIdx.x];
    }
    argmax_block_reduce(bv, bi, sv, si);
    if (threadIdx.x == 0) out[row] = bi < V ? bi : 0;
}
