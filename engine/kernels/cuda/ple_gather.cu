// PLE n-gram table row gather read in place from host memory (unified / ATS path).
//
// Each shard of the table is a memory-mapped region of the checkpoint file whose host address the
// device can dereference directly (cudaDevAttrPageableMemoryAccess == 1, e.g. GB10 / Grace with ATS).
// One thread per output value: it finds the shard of its row (binary search over the shard start
// rows), decodes the stored value (F32, BF16 by a 16-bit shift, FP8 e4m3fn / e5m2 by bit manipulation)
// and multiplies by the shard's per-tensor scale (1 for F32 / BF16) in float32.
//
// Layout source: modeling_qwen4_exp.py Qwen4ExpTextNGramEmbedding.__init__ / forward (rows of head_dim
// values, one row per (token, hash head), heads concatenated). NVRTC-compatible: no host headers.
// NOT RUN ON GB10 HARDWARE: only compiled (nvcc sm_90 / sm_121) and mirrored by a NumPy twin
// (engine/ple_table.py:gather_twin).

#include "grid_dep.cuh"
#define PLE_F32 0
#define PLE_BF16 1
#define PLE_F8E4M3 2
#define PLE_F8E5M2 3

__device__ __forceinline__ float ple_decode(const unsigned char* base, long long idx, int code) {
    // byte loads: a tensor inside a safetensors file need not be 2/4-byte aligned (little-endian)
    if (code == PLE_F32) {
        const unsigned char* p = base + idx * 4;
        return __uint_as_float((unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16) |
                               ((unsigned int)p[3] << 24));
    }
    if (code == PLE_BF16) {
        const unsigned char* p = base + idx * 2;
        return __uint_as_float(((unsigned int)p[0] | ((unsigned int)p[1] << 8)) << 16);
    }
    unsigned int v = base[idx];
    unsigned int sign = (v & 0x80u) << 24;
    if (code == PLE_F8E4M3) {
        unsigned int e = (v >> 3) & 0xFu, m = v & 0x7u;
        if (e == 0xFu && m == 0x7u) return __uint_as_float(0x7FC00000u);      // NaN (no infinities)
        if (e == 0u) {                                                          // subnormal: m * 2^-9
            float f = (float)m * 0.001953125f;
            return sign ? -f : f;
        }
        return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));         // bias 7 -> 127
    }
    // PLE_F8E5M2
    unsigned int e = (v >> 2) & 0x1Fu, m = v & 0x3u;
    if (e == 0x1Fu) return __uint_as_float(sign | (m ? 0x7FC00000u : 0x7F800000u));
    if (e == 0u) {                                                              // subnormal: m * 2^-16
        float f = (float)m * 0.0000152587890625f;
        return sign ? -f : f;
    }
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 21));             // bias 15 -> 127
}

// shard_ptrs:   [n_shards] device-readable base address of each shard (row-major [rows_k, head_dim])
// shard_starts: [n_shards + 1] first global row of each shard, last = total rows
// shard_codes:  [n_shards] dtype code (PLE_*);  shard_scales: [n_shards] float32 multiplier
// rows:         [n_rows] global row ids (validated on the host to lie in [0, total))
// out:          float32 [n_rows, head_dim] (= [T, heads * head_dim] for n_rows = T * heads)
extern "C" __global__ void ple_gather_rows(const unsigned long long* __restrict__ shard_ptrs,
                                           const long long* __restrict__ shard_starts,
                                           const int* __restrict__ shard_codes,
                                           const float* __restrict__ shard_scales,
                                           int n_shards,
                                           const long long* __restrict__ rows,
                                           long long n_rows, int head_dim,
                                           float* __restrict__ out) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long n = n_rows * (long long)head_dim;
    if (i >= n) return;
    long long r = i / head_dim;
    int c = (int)(i - r * head_dim);
    long long g = rows[r];
    int lo = 0, hi = n_shards - 1;                  // last shard k with shard_starts[k] <= g
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (shard_starts[mid] <= g) lo = mid; else hi = mid - 1;
    }
    long long local = g - shard_starts[lo];
    const unsigned char* base = reinterpret_cast<const unsigned char*>(shard_ptrs[lo]);
    float v = ple_decode(base, local * head_dim + c, shard_codes[lo]);
    out[i] = __fmul_rn(v, shard_scales[lo]);
}
