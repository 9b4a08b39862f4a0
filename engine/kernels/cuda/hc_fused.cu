// Fused hyper-connection input side for decode-sized steps (T <= 16 tokens): three launches instead of six.
//
// hc_pre (engine/kernels/norms.py) computes, per token t (Qwen4ExpTextGatedResidual.forward):
//   n   = grouped zero-centred RMSNorm of x (dense_norms.cu rms_norm_rows, unchanged, launch 1)
//   d   = n @ [down; inject]^T                    [r + hc]
//   a   = silu(d[:r] / hc),  inj = 2 sigmoid(d[r:] / hc)
//   m   = a @ up^T                                [hc * H]
//   mixed[h] = mean_s sigmoid(m[s*H + h]) * n[s*H + h]
// The unfused chain is GEMV, act_div, GEMV, hc_mix, act_div (5 launches after the norm). Here:
//   hc_down_act : one block per row j of [down; inject]: its 256 threads split the W = hc*H columns, the block
//                 sum is reduced in a fixed order (block_sum), and thread 0 applies the activation of its slice
//                 (the same float expressions as act_div).
//   hc_up_mix   : one warp per output feature h: the hc rows s*H + h of up (r columns each) against a (kept in
//                 shared memory), then the stream mean exactly as hc_mix (s ascending, sum then / hc).
// The products are those of the unfused chain; only the order of the float32 sums inside the two dot products
// differs (a fixed order: replays are bit-exact). Weights are BF16 bits (W_T = unsigned short) or float32.
// Requirements checked by the host: W % 8 == 0 and r % 8 == 0, 16-byte aligned rows, T <= 16.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "common.cuh"

__device__ __forceinline__ float hcf_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float hcf_silu(float x) { return x / (1.f + expf(-x)); }

// 8 consecutive weights as float32 (BF16 bits: exact upcast)
__device__ __forceinline__ void load8(const unsigned short* p, float* w) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = __uint_as_float(u[i] << 16);
        w[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void load8(const float* p, float* w) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
}

// grid (r + hc), block 256. N: [T, W] normed; DI: [r + hc, W]; A: [T, r]; INJ: [T, hc].
template <typename W_T, int TG>
__device__ void hc_down_act_body(const float* __restrict__ N, const W_T* __restrict__ DI, float* __restrict__ A,
                                 float* __restrict__ INJ, int T, int W, int r, int hc) {
    __shared__ float red[33];
    const int j = blockIdx.x;
    const W_T* wrow = DI + (long long)j * W;
    const int pieces = W >> 3;
    for (int t0 = 0; t0 < T; t0 += TG) {
        float acc[TG];
#pragma unroll
        for (int t = 0; t < TG; ++t) acc[t] = 0.f;
        for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
            float w[8];
            load8(wrow + 8 * p, w);
#pragma unroll
            for (int t = 0; t < TG; ++t) {
                if (t0 + t < T) {
                    const float* n = N + (long long)(t0 + t) * W + 8 * p;
                    const float4 x0 = __ldg(reinterpret_cast<const float4*>(n));
                    const float4 x1 = __ldg(reinterpret_cast<const float4*>(n + 4));
                    acc[t] += w[0] * x0.x + w[1] * x0.y + w[2] * x0.z + w[3] * x0.w
                            + w[4] * x1.x + w[5] * x1.y + w[6] * x1.z + w[7] * x1.w;
                }
            }
        }
#pragma unroll
        for (int t = 0; t < TG; ++t) {
            if (t0 + t >= T) break;  // uniform across the block
            const float s = block_sum(acc[t], red);
            if (threadIdx.x == 0) {
                const float v = s / (float)hc;
                if (j < r) A[(long long)(t0 + t) * r + j] = hcf_silu(v);
                else INJ[(long long)(t0 + t) * hc + (j - r)] = 2.f * hcf_sigmoid(v);
            }
        }
    }
}

// grid ceil(H / 8), block 256, dynamic shared T * r floats. A: [T, r]; UP: [hc * H, r]; N: [T, hc * H];
// MIXED: [T, H].
template <typename W_T, int TG>
__device__ void hc_up_mix_body(const float* __restrict__ A, const W_T* __restrict__ UP, const float* __restrict__ N,
                               float* __restrict__ MIXED, int T, int H, int r, int hc) {
    extern __shared__ float sa[];
    for (int i = threadIdx.x; i < T * r; i += blockDim.x) sa[i] = A[i];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (h >= H) return;  // after the only __syncthreads
    const int pieces = r >> 3;
    const long long Wd = (long long)hc * H;
    for (int t0 = 0; t0 < T; t0 += TG) {
        float mix[TG];
#pragma unroll
        for (int t = 0; t < TG; ++t) mix[t] = 0.f;
        for (int s = 0; s < hc; ++s) {
            const W_T* urow = UP + ((long long)s * H + h) * r;
            float acc[TG];
#pragma unroll
            for (int t = 0; t < TG; ++t) acc[t] = 0.f;
            for (int p = lane; p < pieces; p += 32) {
                float w[8];
                load8(urow + 8 * p, w);
#pragma unroll
                for (int t = 0; t < TG; ++t) {
                    if (t0 + t < T) {
                        const float* a = sa + (t0 + t) * r + 8 * p;
                        acc[t] += w[0] * a[0] + w[1] * a[1] + w[2] * a[2] + w[3] * a[3]
                                + w[4] * a[4] + w[5] * a[5] + w[6] * a[6] + w[7] * a[7];
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < TG; ++t) {
                float v = acc[t];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
                if (t0 + t < T) mix[t] += hcf_sigmoid(v) * N[(long long)(t0 + t) * Wd + (long long)s * H + h];
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < TG; ++t)
                if (t0 + t < T) MIXED[(long long)(t0 + t) * H + h] = mix[t] / (float)hc;
        }
    }
}

#define HC_FUSED_INSTANCES(SUFFIX, W_T, TG)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) hc_down_act_##SUFFIX(                                       \
        const float* __restrict__ N, const W_T* __restrict__ DI, float* __restrict__ A, float* __restrict__ INJ,   \
        int T, int W, int r, int hc) {                                                                             \
        hc_down_act_body<W_T, TG>(N, DI, A, INJ, T, W, r, hc);                                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) hc_up_mix_##SUFFIX(                                         \
        const float* __restrict__ A, const W_T* __restrict__ UP, const float* __restrict__ N,                      \
        float* __restrict__ MIXED, int T, int H, int r, int hc) {                                                  \
        hc_up_mix_body<W_T, TG>(A, UP, N, MIXED, T, H, r, hc);                                                     \
    }

HC_FUSED_INSTANCES(bf16_t1, unsigned short, 1)
HC_FUSED_INSTANCES(bf16_t4, unsigned short, 4)
HC_FUSED_INSTANCES(f32_t1, float, 1)
HC_FUSED_INSTANCES(f32_t4, float, 4)
