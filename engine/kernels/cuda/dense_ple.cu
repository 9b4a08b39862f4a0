// PLE (per-layer n-gram embedding) kernels of the qwen4exp engine.
//
//   ple_gate          : per (token, stream): grouped norms of key and query, signed-square-root gate,
//                       gated value and its grouped norm
//   ple_conv          : silu(dilated depthwise causal conv) over [carried state | x]
//   ple_conv_state    : carry the last (K - 1) * dilation inputs into the state slab row
//
// The n-gram hash runs on the host (engine.kernels.ple.ngram_hash -> reference.numba_kernels): its ids and
// rows are host data on every engine path.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
#include "common.cuh"

// One block per (row r, stream s). key: [R, hc*H] (key_proj output), value: [R, H], hidden: [R, hc*H].
extern "C" __global__ void ple_gate(const float* __restrict__ key, const float* __restrict__ value,
                                    const float* __restrict__ hidden, const float* __restrict__ wk,
                                    const float* __restrict__ wq, const float* __restrict__ wc,
                                    float* __restrict__ gated, float* __restrict__ gated_normed,
                                    float* __restrict__ gate_out, long long R, int hc, int H, float eps) {
    GRID_DEP_ENTRY();
    __shared__ float red[33];
    const long long r = blockIdx.x / hc;
    const int s = blockIdx.x % hc;
    if (r >= R) return;
    const long long base = r * (long long)hc * H + (long long)s * H;
    const float* k = key + base;
    const float* q = hidden + base;
    const float* v = value + r * H;
    const float* wks = wk + (long long)s * H;
    const float* wqs = wq + (long long)s * H;
    const float* wcs = wc + (long long)s * H;
    float sk = 0.f, sq = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) { sk += k[i] * k[i]; sq += q[i] * q[i]; }
    sk = block_sum(sk, red);
    sq = block_sum(sq, red);
    const float ik = 1.f / sqrtf(sk / (float)H + eps), iq = 1.f / sqrtf(sq / (float)H + eps);
    float d = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x)
        d += ((k[i] * ik) * (1.f + wks[i])) * ((q[i] * iq) * (1.f + wqs[i]));
    d = block_sum(d, red);
    float g = d / sqrtf((float)H);
    const float sgn = (float)((g > 0.f) - (g < 0.f));
    g = sqrtf(fmaxf(fabsf(g), 1e-6f)) * sgn;
    if (threadIdx.x == 0) gate_out[r * hc + s] = g;
    const float sig = 1.f / (1.f + expf(-g));
    float sv = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float gv = sig * v[i];
        gated[base + i] = gv;
        sv += gv * gv;
    }
    sv = block_sum(sv, red);
    const float iv = 1.f / sqrtf(sv / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float gv = sig * v[i];
        gated_normed[base + i] = (gv * iv) * (1.f + wcs[i]);
    }
}

// x: [B, T, C]; state_slab: [S, L, C] with L = (K - 1) * dil; weight: [C, K]; y: [B, T, C]
extern "C" __global__ void ple_conv(const float* __restrict__ x, const float* __restrict__ state_slab,
                                    const long long* __restrict__ slots, const float* __restrict__ weight,
                                    float* __restrict__ y, int B, int T, int C, int K, int dil) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * T * C) return;
    const int c = (int)(i % C);
    const long long bt = i / C;
    const int t = (int)(bt % T);
    const long long b = bt / T;
    const int L = (K - 1) * dil;
    const float* st = state_slab + slots[b] * (long long)L * C;
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
        int tau = t - (K - 1 - j) * dil;  // < 0: from the carried state
        float xv = tau >= 0 ? x[(b * T + tau) * (long long)C + c] : st[(long long)(L + tau) * C + c];
        acc += weight[(long long)c * K + j] * xv;
    }
    y[i] = acc / (1.f + expf(-acc));
}

extern "C" __global__ void ple_conv_state(const float* __restrict__ x, float* __restrict__ state_slab,
                                          const long long* __restrict__ slots, int B, int T, int C, int L) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)B * C) return;
    const int c = (int)(i % C);
    const long long b = i / C;
    float* st = state_slab + slots[b] * (long long)L * C;
    // ascending: row j reads row T + j >= j of the old state, not yet overwritten
    for (int j = 0; j < L; ++j) {
        int p = T + j;  // position in [state (L) | x (T)]
        st[(long long)j * C + c] = p < L ? st[(long long)p * C + c] : x[(b * T + (p - L)) * (long long)C + c];
    }
}
