// Rotary position embedding ("half" layout) on the first rotary_dim channels of each head.
// Source: modeling_qwen4_exp.py apply_rotary_pos_emb / rotate_half; angles float32(pos) * inv_freq in float32
// (Qwen4ExpTextRotaryEmbedding.forward). One thread per rotated pair or passed-through channel, so the op is
// safe in place (out == x).

#include "grid_dep.cuh"
template <typename T>
__device__ __forceinline__ void rope_body(const T* __restrict__ x, T* out, const long long* __restrict__ pos,
                                          const float* __restrict__ inv_freq, long long n_tok, int n_heads,
                                          int head_dim, int rotary_dim) {
    const int half = rotary_dim / 2;
    const int per_head = head_dim - half;  // half pairs + (head_dim - rotary_dim) copies
    long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = n_tok * n_heads * per_head;
    if (gid >= total) return;
    int j = (int)(gid % per_head);
    long long th = gid / per_head;          // token * n_heads + head
    long long t = th / n_heads;
    const long long base = th * head_dim;
    if (j < half) {
        float ang = (float)pos[t] * inv_freq[j];
        T c = (T)cosf(ang), s = (T)sinf(ang);
        T a = x[base + j], b = x[base + j + half];
        out[base + j] = a * c - b * s;
        out[base + j + half] = b * c + a * s;
    } else {
        int d = j + half;  // >= rotary_dim
        out[base + d] = x[base + d];
    }
}

extern "C" __global__ void rope_f32(const float* x, float* out, const long long* pos, const float* inv_freq,
                                    long long n_tok, int n_heads, int head_dim, int rotary_dim) {
    GRID_DEP_ENTRY();
    rope_body<float>(x, out, pos, inv_freq, n_tok, n_heads, head_dim, rotary_dim);
}

extern "C" __global__ void rope_f64(const double* x, double* out, const long long* pos, const float* inv_freq,
                                    long long n_tok, int n_heads, int head_dim, int rotary_dim) {
    GRID_DEP_ENTRY();
    rope_body<double>(x, out, pos, inv_freq, n_tok, n_heads, head_dim, rotary_dim);
}
