// Norm and hyper-connection kernels of the qwen4exp engine (float32 activations, float32 weights).
//
//   rms_norm_rows       : zero-centred RMSNorm, optionally grouped: y = x * rsqrt(mean_g(x^2) + eps) * (1 + w)
//                         (plain weight when zero_centred == 0). One block per (row, group).
//   gated_rms_norm_rows : y = w * x * rsqrt(mean(x^2) + eps) * act(gate)   (act: 0 silu, 1 sigmoid)
//   act_div             : y = silu(x / d) (mode 0) or 2 * sigmoid(x / d) (mode 1)
//   hc_mix              : mixed[t, h] = mean_s sigmoid(m[t, s, h]) * normed[t, s, h]
//   hc_combine          : out[t, s, h] = res[t, s, h] + y[t, h] * inj[t, s]
//   hc_combine_norm     : hc_combine, then the next hyper-connection's grouped zero-centred RMSNorm of its output,
//                         in one launch: one block per (row, stream) with rms_norm_rows' loop and block size, so
//                         both outputs are bit-identical to hc_combine followed by rms_norm_rows.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
#include "common.cuh"

__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.f + expf(-x)); }

extern "C" __global__ void rms_norm_rows(const float* __restrict__ X, const float* __restrict__ W,
                                         float* __restrict__ Y, long long rows, int D, int group_size, float eps,
                                         int zero_centred) {
    GRID_DEP_ENTRY();
    __shared__ float red[33];
    const int groups = D / group_size;
    const long long b = blockIdx.x;
    const long long row = b / groups;
    const int g = (int)(b % groups);
    if (row >= rows) return;
    const float* x = X + row * D + (long long)g * group_size;
    float* y = Y + row * D + (long long)g * group_size;
    const float* w = W + (long long)g * group_size;
    float ss = 0.f;
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(ss / (float)group_size + eps);
    for (int i = threadIdx.x; i < group_size; i += blockDim.x) {
        float wv = zero_centred ? (1.f + w[i]) : w[i];
        y[i] = (x[i] * inv) * wv;
    }
}

extern "C" __global__ void gated_rms_norm_rows(const float* __restrict__ X, const float* __restrict__ G,
                                               const float* __restrict__ W, float* __restrict__ Y, long long rows,
                                               int D, float eps, int act) {
    GRID_DEP_ENTRY();
    __shared__ float red[33];
    const long long row = blockIdx.x;
    if (row >= rows) return;
    const float* x = X + row * D;
    const float* gt = G + row * D;
    float* y = Y + row * D;
    float ss = 0.f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float gv = gt[i];
        float a = act == 0 ? siluf_(gv) : sigmoidf_(gv);
        y[i] = (W[i] * (x[i] * inv)) * a;
    }
}

extern "C" __global__ void act_div(const float* __restrict__ X, float* __restrict__ Y, long long n, float d,
                                   int mode) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = X[i] / d;
    Y[i] = mode == 0 ? siluf_(v) : 2.f * sigmoidf_(v);
}

extern "C" __global__ void hc_mix(const float* __restrict__ Mpre, const float* __restrict__ normed,
                                  float* __restrict__ mixed, long long T, int hc, int H) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * H) return;
    long long t = i / H;
    int h = (int)(i % H);
    const long long base = t * (long long)hc * H + h;
    float s = 0.f;
    for (int k = 0; k < hc; ++k) s += sigmoidf_(Mpre[base + (long long)k * H]) * normed[base + (long long)k * H];
    mixed[i] = s / (float)hc;
}

extern "C" __global__ void hc_combine(const float* __restrict__ R, const float* __restrict__ Yb,
                                      const float* __restrict__ Inj, float* __restrict__ Out, long long T, int hc,
                                      int H) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long W = (long long)hc * H;
    if (i >= T * W) return;
    long long t = i / W;
    int c = (int)(i % W);
    int s = c / H, h = c % H;
    Out[i] = R[i] + Yb[t * H + h] * Inj[t * hc + s];
}

extern "C" __global__ void hc_combine_norm(const float* __restrict__ R, const float* __restrict__ Yb,
                                           const float* __restrict__ Inj, const float* __restrict__ Wn,
                                           float* __restrict__ Out, float* __restrict__ Normed, long long T, int hc,
                                           int H, float eps) {
    GRID_DEP_ENTRY();
    __shared__ float red[33];
    const long long row = blockIdx.x / hc;
    const int s = (int)(blockIdx.x % hc);
    if (row >= T) return;
    const long long base = row * (long long)hc * H + (long long)s * H;
    const float inj = Inj[row * hc + s];
    const float* yb = Yb + row * (long long)H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        const float v = R[base + i] + yb[i] * inj;
        Out[base + i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    const float* w = Wn + (long long)s * H;
    for (int i = threadIdx.x; i < H; i += blockDim.x) Normed[base + i] = (Out[base + i] * inv) * (1.f + w[i]);
}
