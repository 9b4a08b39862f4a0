// Deterministic pseudo-random weight fill on the device (benchmarks at full depth without files).
//
//   fill_bf16_normal : out[i] = bf16 bits (truncated) of (u1 + u2 - 1) * amp, u1, u2 uniform in [0, 1) from a
//                      hash of (i, seed): a triangular distribution of std amp / sqrt(6).
//   fill_u8          : out[i] = (hash(i, seed) & mask) | bits  (FP8 / NVFP4 codes, E4M3 scale codes)
// Grid-stride loops over 64-bit indices (expert stacks exceed 2^31 elements).
// The NumPy twin is parity/bench/synthetic.py:_hash32 (same arithmetic on uint32).
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
__device__ __forceinline__ unsigned int hash32(unsigned long long i, unsigned int seed) {
    unsigned int x = (unsigned int)(i ^ (i >> 32)) ^ seed;
    x = (x ^ (x >> 16)) * 0x7feb352du;
    x = (x ^ (x >> 15)) * 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

extern "C" __global__ void fill_bf16_normal(unsigned short* out, long long n, unsigned int seed, float amp) {
    GRID_DEP_ENTRY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const unsigned int h = hash32((unsigned long long)i, seed);
        const float u1 = (float)(h & 0xffffu) * (1.0f / 65536.0f), u2 = (float)(h >> 16) * (1.0f / 65536.0f);
        out[i] = (unsigned short)(__float_as_uint((u1 + u2 - 1.0f) * amp) >> 16);
    }
}

extern "C" __global__ void fill_u8(unsigned char* out, long long n, unsigned int seed, unsigned int mask,
                                   unsigned int bits) {
    GRID_DEP_ENTRY();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        out[i] = (unsigned char)((hash32((unsigned long long)i, seed) & mask) | bits);
    }
}
