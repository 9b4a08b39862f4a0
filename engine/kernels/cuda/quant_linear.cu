// Linear kernels over weights kept in their stored quantised format: Y[M, N] = X[M, K] @ deq(W)[N, K]^T.
//
// Formats (engine/kernels/quant.py documents the layouts; model-facts section 4):
//   fp8   : Q uint8 [E?, N, K] E4M3 codes; S float32 [E?, N / rb, ceil(K / cb)] block scales
//           (`weight_scale_inv`, rb x cb blocks: 128 x 128 in the official FP8 release; rb may be smaller
//           when two matrices are stacked, e.g. gate + up of width I not a multiple of 128).
//           deq = float(code) * S[n / rb][k / cb]            (one float32 product, as the reference)
//   nvfp4 : Q uint8 [E?, N, K / 2] E2M1 codes, element 2j in the low nibble of byte j;
//           S uint8 [E?, N, K / 16] E4M3 scales per 16 elements; S2 float32 [E? * (N / s2_rows)] global
//           scales (`weight_scale_2`; one per stacked source matrix of s2_rows rows).
//           deq = (float(code) * float(scale)) * S2           (the first product is exact in float32)
// Activations and accumulation are float32. Dequantised values are bit-identical to the reference
// reader's (reference/checkpoint.py); only the summation order differs.
//
// qgemv2_*: decode, the default (gemv_quant2.cuh; docs/kernels_quant.md): streaming loads, hardware E4M3 decode.
// qgemv_* : decode, the previous kernels (QWEN4EXP_QGEMV2=0), and the scalar path of both (unaligned / odd K).
//          1, 4 or 16 activation rows per weight pass. R weight rows per warp (4 for 1 and 4
//          activation rows, else 1), KS warps may split K; every lane loads 16 bytes of each row per chunk (16
//          FP8 or 32 NVFP4 weights) with several chunks in flight, decodes each weight once and reuses it for
//          every activation row of the tile, and each activation piece for the R rows. Scalar path for rows
//          that are not 16-byte aligned.
// gemm_* : prefill. 64 x 64 output tiles, BK = 16, 4 x 4 per thread, weights dequantised while staged in
//          shared memory.
// Both take the grouped-launch tile table of dense_linear.cu (MoE experts), computed on the device.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "common.cuh"

// Module split (NVRTC compile time: the qgemv2 instances take ~3x the rest): NVRTC builds one module without
// QGEMV2_NT (the qgemv_* / qgemm_* / qdequant_* entries) and one per activation-row tile with -DQGEMV2_NT=1, 4 or
// 16 (that tile's qgemv2_* entries), each on first use (engine/kernels/dense_common.py: kernel_module_options).
// nvcc (tests/engine/test_engine_nvcc.py) compiles everything.
#if !defined(__CUDACC_RTC__)
#define QL_BASE 1
#define QL_NT(n) 1
#elif defined(QGEMV2_NT)
#define QL_BASE 0
#define QL_NT(n) (QGEMV2_NT == (n))
#else
#define QL_BASE 1
#define QL_NT(n) 0
#endif

typedef unsigned char u8;

// e4m3_to_f32 / e2m1_to_f32: common.cuh (shared with gemm_tc.cu)

struct FP8W {
    const u8* Q;
    const float* S;
    long long q_es, s_es;  // expert strides (elements)
    int rb, cb, ncb;       // scale block rows, columns; scale columns per row block
    static constexpr int EPL = 16;  // weights per 16-byte load
    __device__ __forceinline__ long long row_bytes(int K) const { return K; }
    __device__ __forceinline__ float get(long long e, int n, int k, int K) const {
        const float s = S[e * s_es + (long long)(n / rb) * ncb + k / cb];
        return e4m3_to_f32(Q[e * q_es + (long long)n * K + k]) * s;
    }
    // 16 weights of row n starting at k0 (k0 % 16 == 0, cb % 16 == 0, 16-byte aligned row): the raw codes and
    // scale are fetched first (raw), decoded later (decode), so several chunks' loads can be in flight
    struct Raw {
        uint4 v;
        float s;
    };
    __device__ __forceinline__ Raw raw(long long e, int n, int k0, int K) const {
        Raw r;
        r.v = *reinterpret_cast<const uint4*>(Q + e * q_es + (long long)n * K + k0);
        r.s = S[e * s_es + (long long)(n / rb) * ncb + k0 / cb];
        return r;
    }
    __device__ __forceinline__ float row_scale(long long, int) const { return 1.f; }
    // 8 weights of a fetched chunk: piece p (elements 8p .. 8p + 7)
    __device__ __forceinline__ void decode8(const Raw& r, int p, float, float* w) const {
        const unsigned int lo = (p == 0) ? r.v.x : r.v.z, hi = (p == 0) ? r.v.y : r.v.w;
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = e4m3_to_f32((lo >> (8 * j)) & 0xffu) * r.s;
#pragma unroll
        for (int j = 0; j < 4; ++j) w[4 + j] = e4m3_to_f32((hi >> (8 * j)) & 0xffu) * r.s;
    }
};

struct NVFP4W {
    const u8* Q;
    const u8* S;
    const float* S2;
    long long q_es, s_es;  // expert strides (bytes)
    int s2_rows, s2_per_e;  // rows per global scale; global scales per expert
    static constexpr int EPL = 32;
    __device__ __forceinline__ float s2(long long e, int n) const { return S2[e * s2_per_e + n / s2_rows]; }
    __device__ __forceinline__ float get(long long e, int n, int k, int K) const {
        const unsigned int b = Q[e * q_es + (long long)n * (K >> 1) + (k >> 1)];
        const float sc = e4m3_to_f32(S[e * s_es + (long long)n * (K >> 4) + (k >> 4)]);
        return (e2m1_to_f32((k & 1) ? (b >> 4) : (b & 15u)) * sc) * s2(e, n);
    }
    // 32 weights of row n starting at k0 (k0 % 32 == 0, 16-byte aligned row): raw codes + their two scale bytes
    struct Raw {
        uint4 v;
        unsigned int s;  // two E4M3 scale bytes (elements k0..k0+15, k0+16..k0+31)
    };
    __device__ __forceinline__ Raw raw(long long e, int n, int k0, int K) const {
        Raw r;
        r.v = *reinterpret_cast<const uint4*>(Q + e * q_es + (long long)n * (K >> 1) + (k0 >> 1));
        r.s = *reinterpret_cast<const unsigned short*>(S + e * s_es + (long long)n * (K >> 4) + (k0 >> 4));
        return r;
    }
    __device__ __forceinline__ float row_scale(long long e, int n) const { return s2(e, n); }
    // 8 weights of a fetched chunk: piece p (elements 8p .. 8p + 7, word p of the 16 bytes)
    __device__ __forceinline__ void decode8(const Raw& r, int p, float g, float* w) const {
        const unsigned int u = p == 0 ? r.v.x : (p == 1 ? r.v.y : (p == 2 ? r.v.z : r.v.w));
        const float sc = e4m3_to_f32(p < 2 ? (r.s & 0xffu) : ((r.s >> 8) & 0xffu));
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = (e2m1_to_f32((u >> (4 * j)) & 15u) * sc) * g;
    }
};

__device__ __forceinline__ float dot8(const float* w, float4 a, float4 b) {
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}

// R weight rows per warp ((8 / KS) * R rows per block of 8 warps), KS warps split K. VEC: 16-byte chunks,
// U chunks per row fetched before any is decoded; each 8-element piece of the activation rows is loaded
// once and reused for the R rows (the activations are float32: 8x (NVFP4) / 4x (FP8) the weight bytes, so
// reading them once per weight row made the 1-row kernels L1-bound; measured 2026-12-01, see
// docs/performance.md).
template <typename LD, int NT, int R, int KS, bool VEC>
__device__ __forceinline__ void qgemv_body(const LD& ld, const float* __restrict__ X, const int* __restrict__ row_index,
                                           float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                           const int* tile_count, const int* n_tiles, int M, int N, int K) {
    constexpr int RG = 8 / KS;
    constexpr int EPL = LD::EPL;
    constexpr int U = (NT == 1 && R == 1) ? 4 : ((NT == 1 || (NT == 4 && R == 1)) ? 2 : 1);  // chunks in flight
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / KS, ks = warp % KS;
    const int n0 = (blockIdx.x * RG + rg) * R;
    int nr[R];  // row of each slot, clamped to a valid row (its result is not written when n0 + r >= N)
#pragma unroll
    for (int r = 0; r < R; ++r) nr[r] = n0 + r < N ? n0 + r : N - 1;
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        int rr = start + (t < count ? t : 0);
        long long xrow = row_index != nullptr ? (long long)row_index[rr] : (long long)rr;
        xr[t] = X + xrow * K;
    }
    float acc[R][NT];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    int k_done = 0;
    if (n0 < N) {
        if (VEC) {
            const int KC = K / EPL;
            constexpr int STEP = 32 * KS;
            float g[R];
#pragma unroll
            for (int r = 0; r < R; ++r) g[r] = ld.row_scale(e, nr[r]);
            for (int c0 = ks * 32 + lane; c0 < KC; c0 += U * STEP) {
                typename LD::Raw raw[U][R];  // U chunks x R rows of loads issued before any is consumed
#pragma unroll
                for (int u = 0; u < U; ++u)
                    if (c0 + u * STEP < KC) {
#pragma unroll
                        for (int r = 0; r < R; ++r) raw[u][r] = ld.raw(e, nr[r], (c0 + u * STEP) * EPL, K);
                    }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + u * STEP;
                    if (c < KC) {
#pragma unroll
                        for (int p = 0; p < EPL / 8; ++p) {
                            if (NT <= 4) {  // hold the activation piece of every row, reuse it for the R rows
                                float4 xa[NT], xb[NT];
#pragma unroll
                                for (int t = 0; t < NT; ++t) {
                                    if (t < count) {
                                        const float4* xp = reinterpret_cast<const float4*>(xr[t] + c * EPL + 8 * p);
                                        xa[t] = xp[0];
                                        xb[t] = xp[1];
                                    }
                                }
#pragma unroll
                                for (int r = 0; r < R; ++r) {
                                    float w[8];
                                    ld.decode8(raw[u][r], p, g[r], w);
#pragma unroll
                                    for (int t = 0; t < NT; ++t)
                                        if (t < count) acc[r][t] += dot8(w, xa[t], xb[t]);
                                }
                            } else {  // 16 rows: registers allow one activation piece at a time
#pragma unroll
                                for (int r = 0; r < R; ++r) {
                                    float w[8];
                                    ld.decode8(raw[u][r], p, g[r], w);
#pragma unroll
                                    for (int t = 0; t < NT; ++t)
                                        if (t < count) {
                                            const float4* xp = reinterpret_cast<const float4*>(xr[t] + c * EPL + 8 * p);
                                            acc[r][t] += dot8(w, xp[0], xp[1]);
                                        }
                                }
                            }
                        }
                    }
                }
            }
            k_done = KC * EPL;
        }
        for (int k = k_done + ks * 32 + lane; k < K; k += 32 * KS) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const float wv = ld.get(e, nr[r], k, K);
#pragma unroll
                for (int t = 0; t < NT; ++t)
                    if (t < count) acc[r][t] += wv * xr[t][k];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], off);
    if (KS == 1) {
#pragma unroll
        for (int t = 0; t < NT; ++t)
            if (lane == t && t < count) {
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (n0 + r < N) Y[(long long)(start + t) * N + n0 + r] = acc[r][t];
            }
    } else {
        __shared__ float red[8][R * NT];
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int t = 0; t < NT; ++t) red[warp][r * NT + t] = acc[r][t];
        }
        __syncthreads();
        if (ks == 0 && lane < NT && lane < count) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (n0 + r < N) {
                    float sum = 0.f;
                    for (int q = 0; q < KS; ++q) sum += red[rg * KS + q][r * NT + lane];
                    Y[(long long)(start + lane) * N + n0 + r] = sum;
                }
            }
        }
    }
}

#define QCOMMON_ARGS                                                                                         \
    const float *X, const int *row_index, float *Y, const int *tile_expert, const int *tile_start,           \
        const int *tile_count, const int *n_tiles, int M, int N, int K
#define QCOMMON_PASS X, row_index, Y, tile_expert, tile_start, tile_count, n_tiles, M, N, K

#define FP8_ARGS const u8 *Q, const float *S, long long q_es, long long s_es, int rb, int cb, int ncb
#define FP8_MAKE FP8W ld{Q, S, q_es, s_es, rb, cb, ncb};
#define NVFP4_ARGS const u8 *Q, const u8 *S, const float *S2, long long q_es, long long s_es, int s2_rows, int s2_per_e
#define NVFP4_MAKE NVFP4W ld{Q, S, S2, q_es, s_es, s2_rows, s2_per_e};

#define QGEMV_ENTRY(FMT, LD, NT, R, KS, VEC, SUF)                                                              \
    extern "C" __global__ void __launch_bounds__(256) qgemv_##FMT##_nt##NT##_r##R##_ks##KS##_##SUF(            \
        FMT##_ARGS_LC, QCOMMON_ARGS) {                                                                         \
        FMT##_MAKE_LC                                                                                          \
        qgemv_body<LD, NT, R, KS, VEC>(ld, QCOMMON_PASS);                                                      \
    }

#define fp8_ARGS_LC FP8_ARGS
#define fp8_MAKE_LC FP8_MAKE
#define nvfp4_ARGS_LC NVFP4_ARGS
#define nvfp4_MAKE_LC NVFP4_MAKE

#define QGEMV_FAMILY(FMT, LD) \
    QGEMV_ENTRY(FMT, LD, 1, 1, 1, true, v) \
    QGEMV_ENTRY(FMT, LD, 1, 1, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 1, 4, 1, true, v) \
    QGEMV_ENTRY(FMT, LD, 1, 4, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 1, 1, 8, true, v) \
    QGEMV_ENTRY(FMT, LD, 1, 1, 8, false, s) \
    QGEMV_ENTRY(FMT, LD, 4, 1, 1, true, v) \
    QGEMV_ENTRY(FMT, LD, 4, 1, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 4, 4, 1, true, v) \
    QGEMV_ENTRY(FMT, LD, 4, 4, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 4, 1, 8, true, v) \
    QGEMV_ENTRY(FMT, LD, 4, 1, 8, false, s) \
    QGEMV_ENTRY(FMT, LD, 16, 1, 1, true, v) \
    QGEMV_ENTRY(FMT, LD, 16, 1, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 16, 1, 8, true, v) \
    QGEMV_ENTRY(FMT, LD, 16, 1, 8, false, s)

#if QL_BASE
QGEMV_FAMILY(fp8, FP8W)
QGEMV_FAMILY(nvfp4, NVFP4W)
#endif

// ---------------------------------------------------------------------------------------------------------
// qgemv2_* : the streaming decode GEMV (the default; the qgemv_* family above stays selectable for A/B). Design,
// decode and exactness argument: gemv_quant2.cuh and docs/kernels_quant.md.
#include "gemv_quant2.cuh"

#define QGEMV2_ENTRY(FMT, LD, NT, G, RL, KS, U)                                                                \
    extern "C" __global__ void __launch_bounds__(256, QGEMV2_MINB(NT))                                         \
        qgemv2_##FMT##_nt##NT##_g##G##_r##RL##_ks##KS##_u##U(                                                  \
        FMT##_ARGS_LC, QCOMMON_ARGS) {                                                                         \
        FMT##_MAKE2_LC                                                                                         \
        qgemv2_body<LD, NT, G, RL, KS, U>(ld, QCOMMON_PASS);                                                   \
    }

#define fp8_MAKE2_LC FP8S ld{Q, S, q_es, s_es, rb, cb, ncb};
#define nvfp4_MAKE2_LC NVFP4S ld{Q, S, S2, q_es, s_es, s2_rows, s2_per_e};

// Configurations (NT, G, RL, U; each with KS 1, 2, 4, 8, chosen by the host): the defaults of
// engine/kernels/linear.py QGEMV2_CONFIG and the alternatives the micro-bench compares (bench_quant.py). Why small G: the activation loads of
// a warp touch G distinct 128-byte lines (NVFP4: a 16-byte chunk is 32 weights = 128 bytes of float32
// activations), which is what bounds L1 at 4 and 16 rows.
#define QGEMV2_KS(FMT, LD, NT, G, RL, U)                                                                      \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 1, U)                                                                    \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 2, U)                                                                    \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 4, U)                                                                    \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 8, U)

// qgemv2 instances begin (tests/engine/test_engine_quant.py and bench_quant.py read these lines)
#define QGEMV2_FAMILY_NT1(FMT, LD)  \
    QGEMV2_KS(FMT, LD, 1, 4, 1, 5)  \
    QGEMV2_KS(FMT, LD, 1, 2, 1, 5)  \
    QGEMV2_KS(FMT, LD, 1, 2, 2, 3)
#define QGEMV2_FAMILY_NT4(FMT, LD)  \
    QGEMV2_KS(FMT, LD, 4, 4, 2, 3)  \
    QGEMV2_KS(FMT, LD, 4, 2, 2, 3)  \
    QGEMV2_KS(FMT, LD, 4, 4, 1, 5)
#define QGEMV2_FAMILY_NT16(FMT, LD) \
    QGEMV2_KS(FMT, LD, 16, 4, 2, 3) \
    QGEMV2_KS(FMT, LD, 16, 2, 2, 3) \
    QGEMV2_KS(FMT, LD, 16, 1, 2, 3)
// qgemv2 instances end

#if QL_NT(1)
QGEMV2_FAMILY_NT1(fp8, FP8S)
QGEMV2_FAMILY_NT1(nvfp4, NVFP4S)
#endif
#if QL_NT(4)
QGEMV2_FAMILY_NT4(fp8, FP8S)
QGEMV2_FAMILY_NT4(nvfp4, NVFP4S)
#endif
#if QL_NT(16)
QGEMV2_FAMILY_NT16(fp8, FP8S)
QGEMV2_FAMILY_NT16(nvfp4, NVFP4S)
#endif

// ---------------------------------------------------------------------------------------------------------
// Tiled GEMM (prefill): 64 x 64 outputs per block, 256 threads, 4 x 4 per thread, K in steps of 16.
template <typename LD>
__device__ __forceinline__ void qgemm_body(const LD& ld, const float* __restrict__ X, const int* __restrict__ row_index,
                                           float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                           const int* tile_count, const int* n_tiles, int M, int N, int K) {
    constexpr int BM = 64, BN = 64, BK = 16;
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, BM, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    __shared__ float As[BK][BM + 4];
    __shared__ float Bs[BK][BN + 4];
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;
    const int n0 = blockIdx.x * BN;
    const int lr = tid >> 2, lk = (tid & 3) * 4;
    const bool a_ok = lr < count;
    long long a_row = 0;
    if (a_ok) a_row = row_index != nullptr ? (long long)row_index[start + lr] : (long long)(start + lr);
    const float* xa = X + a_row * K;
    const int bn = n0 + lr;
    const bool b_ok = bn < N;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int k = k0 + lk + i;
            As[lk + i][lr] = (a_ok && k < K) ? xa[k] : 0.f;
            Bs[lk + i][lr] = (b_ok && k < K) ? ld.get(e, bn, k, K) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int r = ty * 4 + i;
        if (r >= count) continue;
        float* yr = Y + (long long)(start + r) * N;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int n = n0 + tx * 4 + j;
            if (n < N) yr[n] = acc[i][j];
        }
    }
}

#if QL_BASE
extern "C" __global__ void __launch_bounds__(256) qgemm_fp8(FP8_ARGS, QCOMMON_ARGS) {
    FP8_MAKE
    qgemm_body<FP8W>(ld, QCOMMON_PASS);
}

extern "C" __global__ void __launch_bounds__(256) qgemm_nvfp4(NVFP4_ARGS, QCOMMON_ARGS) {
    NVFP4_MAKE
    qgemm_body<NVFP4W>(ld, QCOMMON_PASS);
}

// Dequantise a whole (stacked) weight to float32 (tests, and the float32 view a caller may ask for).
extern "C" __global__ void qdequant_fp8(FP8_ARGS, int E, int N, int K, float* out) {
    FP8_MAKE
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)E * N * K;
    if (i >= total) return;
    long long e = i / ((long long)N * K);
    int n = (int)((i / K) % N), k = (int)(i % K);
    out[i] = ld.get(e, n, k, K);
}

extern "C" __global__ void qdequant_nvfp4(NVFP4_ARGS, int E, int N, int K, float* out) {
    NVFP4_MAKE
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)E * N * K;
    if (i >= total) return;
    long long e = i / ((long long)N * K);
    int n = (int)((i / K) % N), k = (int)(i % K);
    out[i] = ld.get(e, n, k, K);
}
#endif  // QL_BASE
