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
// Requirements checked by the host: W % 8 == 0, r % 8 == 0, r <= 512, hc <= 8, 16-byte aligned rows, T <= 16.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
#include "common.cuh"

__device__ __forceinline__ float hcf_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float hcf_silu(float x) { return x / (1.f + expf(-x)); }

// 8 consecutive weights: raw 16 bytes (BF16 bits) or two float4 (float32), decoded to float32 (exact upcast)
struct Raw8b { uint4 v; };
struct Raw8f { float4 a, b; };
template <typename W_T> struct RawOf;
template <> struct RawOf<unsigned short> { typedef Raw8b T; };
template <> struct RawOf<float> { typedef Raw8f T; };

// volatile: the loads stay where they are written, all issued before the first product (a non-volatile asm or __ldg
// was sunk by the compiler to its use inside the per-stream loop: one memory round trip per stream, 12 us measured)
__device__ __forceinline__ void ld8(const unsigned short* p, Raw8b& r) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.v.x), "=r"(r.v.y), "=r"(r.v.z), "=r"(r.v.w) : "l"(p));
}
__device__ __forceinline__ void ld8(const float* p, Raw8f& r) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.a.x), "=f"(r.a.y), "=f"(r.a.z), "=f"(r.a.w) : "l"(p));
    asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.b.x), "=f"(r.b.y), "=f"(r.b.z), "=f"(r.b.w) : "l"(p + 4));
}
__device__ __forceinline__ void dec8(const Raw8b& r, float* w) {
    const unsigned int u[4] = {r.v.x, r.v.y, r.v.z, r.v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = __uint_as_float(u[i] << 16);
        w[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void dec8(const Raw8f& r, float* w) {
    w[0] = r.a.x; w[1] = r.a.y; w[2] = r.a.z; w[3] = r.a.w; w[4] = r.b.x; w[5] = r.b.y; w[6] = r.b.z; w[7] = r.b.w;
}
// activations (re-read by every block: cached)
__device__ __forceinline__ void ld8x(const float* p, Raw8f& r) {
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.a.x), "=f"(r.a.y), "=f"(r.a.z), "=f"(r.a.w) : "l"(p));
    asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.b.x), "=f"(r.b.y), "=f"(r.b.z), "=f"(r.b.w) : "l"(p + 4));
}
__device__ __forceinline__ float ld_f32(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float dot8(const float* w, const float* x) {
    return w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3] + w[4] * x[4] + w[5] * x[5] + w[6] * x[6]
         + w[7] * x[7];
}

// Down side: PU pieces of 8 columns per thread are issued before any is used (one round when W <= 2048 * PU;
// the host picks the smallest PU in {2, 4, 5, 8} covering W, so registers stay low and blocks resident per SM high).
// Up side: streams <= HC_MAX (a template parameter, 4 or 8), pieces per lane per row <= UP_Q (r <= 512).
#define UP_Q 2

// grid (r + hc), block 256. N: [T, W] normed; DI: [r + hc, W]; A: [T, r]; INJ: [T, hc].
template <typename W_T, int TG, int DOWN_PU>
__device__ void hc_down_act_body(const float* __restrict__ N, const W_T* __restrict__ DI, float* __restrict__ A,
                                 float* __restrict__ INJ, int T, int W, int r, int hc) {
    typedef typename RawOf<W_T>::T Raw;
    __shared__ float red[33];
    const int j = blockIdx.x;
    const W_T* wrow = DI + (long long)j * W;
    const int pieces = W >> 3;
    for (int t0 = 0; t0 < T; t0 += TG) {
        float acc[TG];
#pragma unroll
        for (int t = 0; t < TG; ++t) acc[t] = 0.f;
        for (int p0 = threadIdx.x; p0 < pieces; p0 += DOWN_PU * blockDim.x) {
            Raw raw[DOWN_PU];
#pragma unroll
            for (int q = 0; q < DOWN_PU; ++q) {
                const int p = p0 + q * blockDim.x;
                if (p < pieces) ld8(wrow + 8 * p, raw[q]);
            }
#pragma unroll
            for (int t = 0; t < TG; ++t) {
                if (t0 + t < T) {
                    Raw8f xr[DOWN_PU];  // this token's activation pieces, all loads in flight before the products
#pragma unroll
                    for (int q = 0; q < DOWN_PU; ++q) {
                        const int p = p0 + q * blockDim.x;
                        if (p < pieces) ld8x(N + (long long)(t0 + t) * W + 8 * p, xr[q]);
                    }
#pragma unroll
                    for (int q = 0; q < DOWN_PU; ++q) {
                        const int p = p0 + q * blockDim.x;
                        if (p < pieces) {
                            float w[8], x[8];
                            dec8(raw[q], w);
                            dec8(xr[q], x);
                            acc[t] += dot8(w, x);
                        }
                    }
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

// One warp per output h: grid ceil(H / (blockDim / 32)) (the host launches 128 threads), dynamic shared T * r floats.
// A: [T, r]; UP: [hc * H, r]; N: [T, hc * H]; MIXED: [T, H]. Every weight piece of the warp's hc rows is loaded
// before the first product.
template <typename W_T, int TG, int HC_MAX>
__device__ void hc_up_mix_body(const float* __restrict__ A, const W_T* __restrict__ UP, const float* __restrict__ N,
                               float* __restrict__ MIXED, int T, int H, int r, int hc) {
    typedef typename RawOf<W_T>::T Raw;
    extern __shared__ float sa[];
    const int lane = threadIdx.x & 31;
    const int h = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int pieces = r >> 3;
    Raw raw[HC_MAX][UP_Q];
    if (h < H) {
#pragma unroll
        for (int s = 0; s < HC_MAX; ++s) {
            if (s < hc) {
                const W_T* urow = UP + ((long long)s * H + h) * r;
#pragma unroll
                for (int q = 0; q < UP_Q; ++q) {
                    const int p = lane + 32 * q;
                    if (p < pieces) ld8(urow + 8 * p, raw[s][q]);
                }
            }
        }
    }
    const long long Wd = (long long)hc * H;
    float nv[TG];  // lane s holds normed[t, s*H + h]; the first token group's are loaded before the barrier too
#pragma unroll
    for (int t = 0; t < TG; ++t)
        nv[t] = (h < H && lane < hc && t < T) ? ld_f32(N + (long long)t * Wd + (long long)lane * H + h) : 0.f;
    for (int i = threadIdx.x; i < T * r; i += blockDim.x) sa[i] = A[i];
    __syncthreads();
    if (h >= H) return;  // after the only __syncthreads
    for (int t0 = 0; t0 < T; t0 += TG) {
        if (t0 > 0) {
#pragma unroll
            for (int t = 0; t < TG; ++t)
                nv[t] = (lane < hc && t0 + t < T) ? N[(long long)(t0 + t) * Wd + (long long)lane * H + h] : 0.f;
        }
        float mix[TG];
#pragma unroll
        for (int t = 0; t < TG; ++t) mix[t] = 0.f;
#pragma unroll
        for (int s = 0; s < HC_MAX; ++s) {
            if (s >= hc) break;
            float acc[TG];
#pragma unroll
            for (int t = 0; t < TG; ++t) acc[t] = 0.f;
#pragma unroll
            for (int q = 0; q < UP_Q; ++q) {
                const int p = lane + 32 * q;
                if (p < pieces) {
                    float w[8];
                    dec8(raw[s][q], w);
#pragma unroll
                    for (int t = 0; t < TG; ++t)
                        if (t0 + t < T) acc[t] += dot8(w, sa + (t0 + t) * r + 8 * p);
                }
            }
#pragma unroll
            for (int t = 0; t < TG; ++t) {
                float v = acc[t];
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
                const float n = __shfl_sync(0xffffffffu, nv[t], s);
                if (t0 + t < T) mix[t] += hcf_sigmoid(v) * n;
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < TG; ++t)
                if (t0 + t < T) MIXED[(long long)(t0 + t) * H + h] = mix[t] / (float)hc;
        }
    }
}

#define HC_DOWN_INSTANCE(SUFFIX, W_T, TG, PU)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) hc_down_act_##SUFFIX##_pu##PU(                               \
        const float* __restrict__ N, const W_T* __restrict__ DI, float* __restrict__ A, float* __restrict__ INJ,   \
        int T, int W, int r, int hc) { GRID_DEP_ENTRY();                                                           \
        hc_down_act_body<W_T, TG, PU>(N, DI, A, INJ, T, W, r, hc);                                                 \
    }
#define HC_UP_INSTANCE(SUFFIX, W_T, TG, HCM)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) hc_up_mix_##SUFFIX##_hc##HCM(                                \
        const float* __restrict__ A, const W_T* __restrict__ UP, const float* __restrict__ N,                      \
        float* __restrict__ MIXED, int T, int H, int r, int hc) { GRID_DEP_ENTRY();                                \
        hc_up_mix_body<W_T, TG, HCM>(A, UP, N, MIXED, T, H, r, hc);                                                \
    }
#define HC_FUSED_INSTANCES(SUFFIX, W_T, TG)                                                                        \
    HC_DOWN_INSTANCE(SUFFIX, W_T, TG, 2) HC_DOWN_INSTANCE(SUFFIX, W_T, TG, 4) HC_DOWN_INSTANCE(SUFFIX, W_T, TG, 5) \
    HC_DOWN_INSTANCE(SUFFIX, W_T, TG, 8)                                                                           \
    HC_UP_INSTANCE(SUFFIX, W_T, TG, 4) HC_UP_INSTANCE(SUFFIX, W_T, TG, 8)

HC_FUSED_INSTANCES(bf16_t1, unsigned short, 1)
HC_FUSED_INSTANCES(bf16_t4, unsigned short, 4)
HC_FUSED_INSTANCES(f32_t1, float, 1)
HC_FUSED_INSTANCES(f32_t4, float, 4)
