// Gated DeltaNet kernels: causal depthwise conv (prefill / decode on a state slab) and the recurrent gated delta
// rule (batched decode and k-token verify with per-position checkpoints).
// Sources: modeling_qwen4_exp.py causal_conv1d_fn / causal_conv1d_update (conv + silu),
// torch_recurrent_gated_delta_rule (l2norm eps inside rsqrt, q scaled by Dk^-0.5, v-head -> k-head = hv / (Hv/Hk)).
// Layouts: x [T, C]; weight [C, K]; conv_state [S, K-1, C]; state [S, Hv, Dk, Dv].

#include "grid_dep.cuh"
#ifndef GDN_DK
#define GDN_DK 128   // key head dim; the host compiles with -DGDN_DK=<Dk>
#endif

__device__ __forceinline__ float dexp(float a) { return expf(a); }
__device__ __forceinline__ double dexp(double a) { return exp(a); }
__device__ __forceinline__ float dsqrt(float a) { return sqrtf(a); }
__device__ __forceinline__ double dsqrt(double a) { return sqrt(a); }

template <typename T>
__device__ __forceinline__ T silu_(T a) { return a / ((T)1 + dexp(-a)); }

// ---------------------------------------------------------------------------------------------- conv prefill
// out[t, c] = silu(sum_j w[c, j] * window[t + j, c]), window = concat(state[slot], x). Optionally ck[t, j, c] =
// window[t + 1 + j, c] (the conv state after input t). Reads the old state only: the state update runs after.
template <typename X, typename S>
__device__ void conv_prefill_body(const X* __restrict__ x, const X* __restrict__ w, const S* __restrict__ st, S* ck,
                                  X* __restrict__ out, long long T, int C, int K, long long slot, int want_ck) {
    long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= T * C) return;
    long long t = gid / C;
    int c = (int)(gid % C);
    const S* srow = st + slot * (long long)(K - 1) * C;
    X acc = 0;
    for (int j = 0; j < K; ++j) {
        long long p = t + j - (K - 1);  // index into x; negative -> state row K-1+p
        X val = p >= 0 ? x[p * C + c] : (X)srow[(K - 1 + p) * C + c];
        acc += w[(long long)c * K + j] * val;
    }
    out[gid] = silu_(acc);
    if (want_ck) {
        for (int j = 0; j < K - 1; ++j) {
            long long p = t + 1 + j - (K - 1);
            S val = p >= 0 ? (S)x[p * C + c] : srow[(K - 1 + p) * C + c];
            ck[(t * (K - 1) + j) * C + c] = val;
        }
    }
}

// state[slot] <- last K-1 rows of concat(state[slot], x); one thread per channel (reads before writes).
template <typename X, typename S>
__device__ void conv_state_update_body(const X* __restrict__ x, S* st, long long T, int C, int K, long long slot) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    S* srow = st + slot * (long long)(K - 1) * C;
    S buf[16];
    // K - 1 <= 16 (checked by the host); gather first, then write
    for (int j = 0; j < K - 1; ++j) {
        long long p = T + j - (K - 1);
        buf[j] = p >= 0 ? (S)x[p * C + c] : srow[(K - 1 + p) * C + c];
    }
    for (int j = 0; j < K - 1; ++j) srow[j * C + c] = buf[j];
}

// ---------------------------------------------------------------------------------------------- conv decode
template <typename X, typename S>
__device__ void conv_decode_body(const X* __restrict__ x, const X* __restrict__ w, S* st, const long long* __restrict__ slots,
                                 X* __restrict__ out, long long B, int C, int K) {
    long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (gid >= B * C) return;
    long long b = gid / C;
    int c = (int)(gid % C);
    S* srow = st + slots[b] * (long long)(K - 1) * C;
    X xin = x[gid];
    X acc = w[(long long)c * K + (K - 1)] * xin;
    for (int j = 0; j < K - 1; ++j) acc += w[(long long)c * K + j] * (X)srow[j * C + c];
    for (int j = 0; j < K - 2; ++j) srow[j * C + c] = srow[(j + 1) * C + c];
    if (K > 1) srow[(K - 2) * C + c] = (S)xin;
    out[gid] = silu_(acc);
}

// ---------------------------------------------------------------------------------------------- recurrent rule
// grid (B, Hv, ceil(Dv/32)), block 32 (one warp). Lane owns value column j; its state column lives in registers.
template <typename X, typename S>
__device__ void recurrent_body(const X* __restrict__ q, const X* __restrict__ k, const X* __restrict__ v,
                               const X* __restrict__ g, const X* __restrict__ beta, S* state,
                               const long long* __restrict__ slots, const long long* __restrict__ cu, S* ck,
                               X* __restrict__ out, int Hk, int Hv, int Dv, int want_ck, float eps) {
    const int b = blockIdx.x, hv = blockIdx.y;
    const int lane = threadIdx.x;
    const int j = blockIdx.z * 32 + lane;
    const bool active = j < Dv;
    const int hk = hv / (Hv / Hk);
    __shared__ X qs[GDN_DK];
    __shared__ X ks[GDN_DK];
    S* srow = state + ((slots[b] * Hv + hv) * (long long)GDN_DK) * Dv;
    X s[GDN_DK];
#pragma unroll
    for (int i = 0; i < GDN_DK; ++i) s[i] = active ? (X)srow[(long long)i * Dv + j] : (X)0;
    const X qscale = (X)1 / dsqrt((X)GDN_DK);
    for (long long t = cu[b]; t < cu[b + 1]; ++t) {
        const X* qt = q + (t * Hk + hk) * GDN_DK;
        const X* kt = k + (t * Hk + hk) * GDN_DK;
        X sq = 0, sk = 0;
        for (int i = lane; i < GDN_DK; i += 32) {
            X a = qt[i], c = kt[i];
            sq += a * a;
            sk += c * c;
        }
        for (int o = 16; o > 0; o >>= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
            sk += __shfl_xor_sync(0xffffffffu, sk, o);
        }
        const X rq = (X)1 / dsqrt(sq + (X)eps), rk = (X)1 / dsqrt(sk + (X)eps);
        __syncwarp();
        for (int i = lane; i < GDN_DK; i += 32) {
            qs[i] = qt[i] * rq * qscale;
            ks[i] = kt[i] * rk;
        }
        __syncwarp();
        const X decay = dexp(g[t * Hv + hv]);
        const X bt = beta[t * Hv + hv];
        X mem = 0;
#pragma unroll
        for (int i = 0; i < GDN_DK; ++i) {
            s[i] *= decay;
            mem += s[i] * ks[i];
        }
        const X vj = active ? v[(t * Hv + hv) * (long long)Dv + j] : (X)0;
        const X delta = (vj - mem) * bt;
        X o = 0;
#pragma unroll
        for (int i = 0; i < GDN_DK; ++i) {
            s[i] += ks[i] * delta;
            o += s[i] * qs[i];
        }
        if (active) {
            out[(t * Hv + hv) * (long long)Dv + j] = o;
            if (want_ck) {
                S* crow = ck + ((t * Hv + hv) * (long long)GDN_DK) * Dv;
#pragma unroll
                for (int i = 0; i < GDN_DK; ++i) crow[(long long)i * Dv + j] = (S)s[i];
            }
        }
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < GDN_DK; ++i) srow[(long long)i * Dv + j] = (S)s[i];
    }
}

#define GDN_INSTANTIATE(SFX, X, S)                                                                               \
extern "C" __global__ void gdn_conv_prefill_##SFX(const X* x, const X* w, const S* st, S* ck, X* out,            \
                                                  long long T, int C, int K, long long slot, int want_ck) { GRID_DEP_ENTRY();      \
    conv_prefill_body<X, S>(x, w, st, ck, out, T, C, K, slot, want_ck);                                          \
}                                                                                                                \
extern "C" __global__ void gdn_conv_state_update_##SFX(const X* x, S* st, long long T, int C, int K,             \
                                                       long long slot) { GRID_DEP_ENTRY();                       \
    conv_state_update_body<X, S>(x, st, T, C, K, slot);                                                          \
}                                                                                                                \
extern "C" __global__ void gdn_conv_decode_##SFX(const X* x, const X* w, S* st, const long long* slots, X* out,   \
                                                 long long B, int C, int K) { GRID_DEP_ENTRY();                  \
    conv_decode_body<X, S>(x, w, st, slots, out, B, C, K);                                                       \
}                                                                                                                \
extern "C" __global__ void gdn_recurrent_##SFX(const X* q, const X* k, const X* v, const X* g, const X* beta,    \
                                               S* state, const long long* slots, const long long* cu, S* ck,     \
                                               X* out, int Hk, int Hv, int Dv, int want_ck, float eps) { GRID_DEP_ENTRY();         \
    recurrent_body<X, S>(q, k, v, g, beta, state, slots, cu, ck, out, Hk, Hv, Dv, want_ck, eps);                 \
}

GDN_INSTANTIATE(f32_f32, float, float)
GDN_INSTANTIATE(f64_f32, double, float)
GDN_INSTANTIATE(f32_f64, float, double)
GDN_INSTANTIATE(f64_f64, double, double)

// ---------------------------------------------------------------------------------------------- chunk solve
// Forward substitution for the chunked prefill: X <- (I + L)^-1 X for strictly lower L [Bt, C, C] (C <= 64) and
// X [Bt, C, W], in place. grid (Bt, ceil(W / 64)), block 64: thread = one column of X (columns independent).
template <typename X>
__device__ void unit_lower_solve_body(const X* __restrict__ L, X* x, int C, int W) {
    __shared__ X Ls[64 * 64];
    __shared__ X Xs[64 * 64];
    const long long b = blockIdx.x;
    const int col = blockIdx.y * 64 + threadIdx.x;
    for (int i = threadIdx.x; i < C * C; i += blockDim.x) Ls[i] = L[b * C * C + i];
    const bool active = col < W;
    if (active)
        for (int i = 0; i < C; ++i) Xs[i * 64 + threadIdx.x] = x[(b * C + i) * (long long)W + col];
    __syncthreads();
    if (!active) return;
    for (int i = 1; i < C; ++i) {
        X acc = Xs[i * 64 + threadIdx.x];
        for (int j = 0; j < i; ++j) acc -= Ls[i * C + j] * Xs[j * 64 + threadIdx.x];
        Xs[i * 64 + threadIdx.x] = acc;
    }
    for (int i = 1; i < C; ++i) x[(b * C + i) * (long long)W + col] = Xs[i * 64 + threadIdx.x];
}

extern "C" __global__ void gdn_unit_lower_solve_f32(const float* L, float* x, int C, int W) {
    GRID_DEP_ENTRY();
    unit_lower_solve_body<float>(L, x, C, W);
}

// ---------------------------------------------------------------------------------------------- recurrent (split)
// The decode / verify kernel (up to engine.kernels.gdn.GDN_SPLIT_MAX_TPS tokens per sequence; the kernel above
// serves prefill). grid (B, Hv, ceil(Dv / 32)), block 32 * GDN_W: lane = value column j, warp w = key rows
// [w * GDN_RPW, (w + 1) * GDN_RPW): every thread holds GDN_RPW state values, so the state slab is read by 8x more
// threads with all their loads in flight. mem_j = sum_i S_ij k_i and o_j = sum_i S_ij q_i are per-warp partial sums
// over the warp's rows, then the warps' partials in order 0..GDN_W-1 (shared memory, two barriers per token;
// deterministic): the only numerical difference to the one-warp kernel is this summation order. cu == nullptr means
// one token per sequence (decode; no offsets array). q / k / v token rows are q_ld / k_ld / v_ld floats apart (column
// slices of the conv output are read in place). a != nullptr fuses the gates: g = -exp(A_log) * softplus(a +
// dt_bias) (torch threshold 20), beta = sigmoid(b), the formula of gdn_gates' float32 kernel (not bitwise: that
// ElementwiseKernel is compiled separately; the H200 shows last-ulp differences of the read-out).
#define GDN_W 8
#define GDN_RPW ((GDN_DK + GDN_W - 1) / GDN_W)

extern "C" __global__ void __launch_bounds__(32 * GDN_W)
gdn_recurrent_split_f32_f32(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                            const float* __restrict__ g, const float* __restrict__ beta, float* state,
                            const long long* __restrict__ slots, const long long* __restrict__ cu, float* ck,
                            float* __restrict__ out, int Hk, int Hv, int Dv, int want_ck, float eps,
                            const float* __restrict__ ga, const float* __restrict__ gb,
                            const float* __restrict__ A_log, const float* __restrict__ dt_bias, long long q_ld,
                            long long k_ld, long long v_ld) {
    GRID_DEP_ENTRY();
    __shared__ float red_m[GDN_W][32];
    __shared__ float red_o[GDN_W][32];
    const int b = blockIdx.x, hv = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int j = blockIdx.z * 32 + lane;
    const bool active = j < Dv;
    const int hk = hv / (Hv / Hk);
    const int i0 = warp * GDN_RPW;
    float* srow = state + ((slots[b] * Hv + hv) * (long long)GDN_DK) * Dv;
    float s[GDN_RPW];
#pragma unroll
    for (int r = 0; r < GDN_RPW; ++r) {
        const int i = i0 + r;
        s[r] = (active && i < GDN_DK) ? srow[(long long)i * Dv + j] : 0.f;
    }
    const float qscale = 1.0f / sqrtf((float)GDN_DK);
    const long long t0 = cu != nullptr ? cu[b] : (long long)b;
    const long long t1 = cu != nullptr ? cu[b + 1] : (long long)b + 1;
    for (long long t = t0; t < t1; ++t) {
        const float* qt = q + t * q_ld + hk * GDN_DK;  // token rows may be strided (columns of the conv output)
        const float* kt = k + t * k_ld + hk * GDN_DK;
        // l2 norms as the one-warp kernel computes them (lane-strided partials, butterfly), in every warp
        float sq = 0.f, sk = 0.f;
        for (int i = lane; i < GDN_DK; i += 32) {
            const float a = qt[i], c = kt[i];
            sq += a * a;
            sk += c * c;
        }
        for (int o = 16; o > 0; o >>= 1) {
            sq += __shfl_xor_sync(0xffffffffu, sq, o);
            sk += __shfl_xor_sync(0xffffffffu, sk, o);
        }
        const float rq = 1.0f / sqrtf(sq + eps), rk = 1.0f / sqrtf(sk + eps);
        float ks[GDN_RPW], qs[GDN_RPW];
#pragma unroll
        for (int r = 0; r < GDN_RPW; ++r) {
            const int i = i0 + r;
            ks[r] = i < GDN_DK ? kt[i] * rk : 0.f;
            qs[r] = i < GDN_DK ? qt[i] * rq * qscale : 0.f;
        }
        float gt, btv;
        if (ga != nullptr) {
            const float x = ga[t * Hv + hv] + dt_bias[hv];
            const float sp = x > 20.0f ? x : log1pf(expf(fminf(x, 20.0f)));
            gt = -expf(A_log[hv]) * sp;
            btv = 1.0f / (1.0f + expf(-gb[t * Hv + hv]));
        } else {
            gt = g[t * Hv + hv];
            btv = beta[t * Hv + hv];
        }
        const float decay = expf(gt);
        float mem = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_RPW; ++r) {
            s[r] *= decay;
            mem += s[r] * ks[r];
        }
        red_m[warp][lane] = mem;
        __syncthreads();
        mem = 0.f;
#pragma unroll
        for (int w = 0; w < GDN_W; ++w) mem += red_m[w][lane];
        const float vj = active ? v[t * v_ld + (long long)hv * Dv + j] : 0.f;
        const float delta = (vj - mem) * btv;
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < GDN_RPW; ++r) {
            s[r] += ks[r] * delta;
            o += s[r] * qs[r];
        }
        red_o[warp][lane] = o;
        __syncthreads();
        if (warp == 0 && active) {
            float oo = 0.f;
#pragma unroll
            for (int w = 0; w < GDN_W; ++w) oo += red_o[w][lane];
            out[(t * Hv + hv) * (long long)Dv + j] = oo;
        }
        if (want_ck && active) {
            float* crow = ck + ((t * Hv + hv) * (long long)GDN_DK) * Dv;
#pragma unroll
            for (int r = 0; r < GDN_RPW; ++r)
                if (i0 + r < GDN_DK) crow[(long long)(i0 + r) * Dv + j] = s[r];
        }
    }
    if (active) {
#pragma unroll
        for (int r = 0; r < GDN_RPW; ++r)
            if (i0 + r < GDN_DK) srow[(long long)(i0 + r) * Dv + j] = s[r];
    }
}
