// Token selection on the device: row-wise argmax of float32 logits (greedy decoding).
//
// row_argmax: one block per row. Result = the index np.argmax would return: the first maximum, with NaN
// ranking above every number (np.argmax returns the first NaN when a row holds one). Each thread scans a
// strided slice keeping its first best, then a shared-memory tree reduction keeps, for equal values,
// the lower index. Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

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
