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
// qgemv_*_s: decode, the scalar path (unaligned pointers / odd K).
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

#include "grid_dep.cuh"
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

// the loaders and the qgemv body
#include "gemv_quant.cuh"

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
        FMT##_ARGS_LC, QCOMMON_ARGS) { GRID_DEP_ENTRY();                                                       \
        FMT##_MAKE_LC                                                                                          \
        qgemv_body<LD, NT, R, KS, VEC>(ld, QCOMMON_PASS);                                                      \
    }

#define fp8_ARGS_LC FP8_ARGS
#define fp8_MAKE_LC FP8_MAKE
#define nvfp4_ARGS_LC NVFP4_ARGS
#define nvfp4_MAKE_LC NVFP4_MAKE

#define QGEMV_FAMILY(FMT, LD) \
    QGEMV_ENTRY(FMT, LD, 1, 1, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 1, 4, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 1, 1, 8, false, s) \
    QGEMV_ENTRY(FMT, LD, 4, 1, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 4, 4, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 4, 1, 8, false, s) \
    QGEMV_ENTRY(FMT, LD, 16, 1, 1, false, s) \
    QGEMV_ENTRY(FMT, LD, 16, 1, 8, false, s)

#if QL_BASE
QGEMV_FAMILY(fp8, FP8W)
QGEMV_FAMILY(nvfp4, NVFP4W)
#endif

// ---------------------------------------------------------------------------------------------------------
// qgemv2_* : the streaming decode GEMV (every launch with 16-byte chunks). Design,
// decode and exactness argument: gemv_quant2.cuh and docs/kernels_quant.md.
#include "gemv_quant2.cuh"

#define QGEMV2_ENTRY(FMT, LD, NT, G, RL, KS, U)                                                                \
    extern "C" __global__ void __launch_bounds__(256, QGEMV2_MINB(NT))                                         \
        qgemv2_##FMT##_nt##NT##_g##G##_r##RL##_ks##KS##_u##U(                                                  \
        FMT##_ARGS_LC, QCOMMON_ARGS) { GRID_DEP_ENTRY();                                                       \
        FMT##_MAKE2_LC                                                                                         \
        qgemv2_body<LD, NT, G, RL, KS, U>(ld, QCOMMON_PASS);                                                   \
    }

#define fp8_MAKE2_LC FP8S ld{Q, S, q_es, s_es, rb, cb, ncb};
#define nvfp4_MAKE2_LC NVFP4S ld{Q, S, S2, q_es, s_es, s2_rows, s2_per_e};

// Configurations (NT, G, RL, U; each with KS 1, 2, 4, 8, chosen by the host): the defaults of
// engine/kernels/linear.py QGEMV2_CONFIG and the alternatives the micro-bench compares (lab/bench_quant.py). Why small G: the activation loads of
// a warp touch G distinct 128-byte lines (NVFP4: a 16-byte chunk is 32 weights = 128 bytes of float32
// activations), which is what bounds L1 at 4 and 16 rows.
#define QGEMV2_KS(FMT, LD, NT, G, RL, U)                                                                      \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 1, U)                                                                    \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 2, U)                                                                    \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 4, U)                                                                    \
    QGEMV2_ENTRY(FMT, LD, NT, G, RL, 8, U)

// qgemv2 instances begin (tests/engine/test_engine_quant.py and lab/bench_quant.py read these lines)
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

// qmma_<fmt>_nt<NT>_ks<KS>: the tensor-core FP8 / NVFP4 GEMV (gemv_qmma.cuh), in the same per-tile modules.
#include "gemv_qmma.cuh"
#define QMMA_ENTRY(FMT, LD, NT, KS)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 2) qmma_##FMT##_nt##NT##_ks##KS(FMT##_ARGS_LC,            \
                                                                                    QCOMMON_ARGS) { GRID_DEP_ENTRY();            \
        LD ld{FMT##_LD_INIT};                                                                                  \
        qmma_body<LD, NT, KS>(ld, QCOMMON_PASS);                                                                \
    }
#define fp8_LD_INIT Q, S, q_es, s_es, rb, cb, ncb
#define nvfp4_LD_INIT Q, S, S2, q_es, s_es, s2_rows, s2_per_e
#define QMMA_FAMILY(NT)                                                                                        \
    QMMA_ENTRY(fp8, FP8M, NT, 1) QMMA_ENTRY(fp8, FP8M, NT, 2) QMMA_ENTRY(fp8, FP8M, NT, 4)                      \
    QMMA_ENTRY(fp8, FP8M, NT, 8) QMMA_ENTRY(nvfp4, NVFP4M, NT, 1) QMMA_ENTRY(nvfp4, NVFP4M, NT, 2)              \
    QMMA_ENTRY(nvfp4, NVFP4M, NT, 4) QMMA_ENTRY(nvfp4, NVFP4M, NT, 8)
#if QL_NT(1)
QGEMV2_FAMILY_NT1(fp8, FP8S)
QGEMV2_FAMILY_NT1(nvfp4, NVFP4S)
QMMA_FAMILY(1)
#endif
#if QL_NT(4)
QGEMV2_FAMILY_NT4(fp8, FP8S)
QGEMV2_FAMILY_NT4(nvfp4, NVFP4S)
QMMA_FAMILY(4)
#endif
#if QL_NT(16)
QGEMV2_FAMILY_NT16(fp8, FP8S)
QGEMV2_FAMILY_NT16(nvfp4, NVFP4S)
QMMA_FAMILY(16)
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
    GRID_DEP_ENTRY();
    FP8_MAKE
    qgemm_body<FP8W>(ld, QCOMMON_PASS);
}

extern "C" __global__ void __launch_bounds__(256) qgemm_nvfp4(NVFP4_ARGS, QCOMMON_ARGS) {
    GRID_DEP_ENTRY();
    NVFP4_MAKE
    qgemm_body<NVFP4W>(ld, QCOMMON_PASS);
}

// Dequantise a whole (stacked) weight to float32 (tests, and the float32 view a caller may ask for).
extern "C" __global__ void qdequant_fp8(FP8_ARGS, int E, int N, int K, float* out) {
    GRID_DEP_ENTRY();
    FP8_MAKE
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)E * N * K;
    if (i >= total) return;
    long long e = i / ((long long)N * K);
    int n = (int)((i / K) % N), k = (int)(i % K);
    out[i] = ld.get(e, n, k, K);
}

extern "C" __global__ void qdequant_nvfp4(NVFP4_ARGS, int E, int N, int K, float* out) {
    GRID_DEP_ENTRY();
    NVFP4_MAKE
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)E * N * K;
    if (i >= total) return;
    long long e = i / ((long long)N * K);
    int n = (int)((i / K) % N), k = (int)(i % K);
    out[i] = ld.get(e, n, k, K);
}
#endif  // QL_BASE
