// Tensor-core multi-row GEMV for BF16 weights: Y[M, N] = X[M, K] @ W[N, K]^T for 2..16 activation rows
// per weight pass (decode at batch 2..16, MoE tiles of up to 16 slots), float32-equivalent accuracy.
//
// One warp owns 16 weight rows (output features); per step of 32 k it issues
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with
//   A = 16 weight rows x 16 k (BF16, exact), B = 16 k x 8 activation rows (tokens), C = 16 x 8 float32.
// Tokens 8..15 form a second n-tile (second accumulator set; skipped at run time when a tile has <= 8 rows).
//
// Exactness of the float32 activations: each x is split into three BF16 parts by truncation,
//   hi = x with the low 16 bits cleared, r = x - hi (exact), mid = r truncated likewise, lo = r - mid (exact),
// and lo has at most 8 significant bits, so it is itself a BF16 value: x == hi + mid + lo exactly. The
// three partial MMAs (lo, mid, hi) accumulate into the same float32 accumulator. A product of two BF16
// values is exact in float32, so the result is a float32 sum of the exact products x_k * w_k - a float32
// GEMV up to the order (and the tensor core's internal rounding) of the summation.
// (Truncation instead of round-to-nearest: the same exactness with integer/ALU ops only, no conversion
// unit, and no overflow for |x| near FLT_MAX.) Caveats: parts below 2^-126 are BF16 subnormals, which
// the tensor core may flush (absolute error <= ~2^-126 * sum|w|, far below float32 resolution of any
// normal result); a non-finite x gives NaN (inf - inf in the split) where a float32 GEMV gives +-inf/NaN.
//
// Coalesced loads via a k-permutation (the sum over k is order-free, A and B just need the same one):
// lane (g = lane >> 2, t = lane & 3) loads W[row g][k0 + 8t .. 8t+7] and W[row g+8][same] as 16 bytes
// each; elements {0,1} are its A k-pair "2t, 2t+1" of the first MMA and {2,3} its pair "2t+8, 2t+9";
// {4,5} and {6,7} the same pairs of the second MMA. The B fragment (token g) uses the same mapping on
// x[token g][k0 + 8t .. 8t+7] (two float4 through the read-only path). Weights are streamed with
// L1::no_allocate so L1 keeps the activations, which every warp of the block re-reads.
//
// Work split: 8 warps per block, each warp MT (1 or 2) tiles of 16 rows. KS = 1: a block covers 8 * 16 * MT
// rows; the _sx variant (dispatched) splits the activations once per block into shared memory (see
// mma_gemv_body_sx). KS = 8: the 8 warps of a block split K of one 16-row tile and reduce through shared
// memory (short, wide matrices). U = 4 / MT steps per group: 8 16-byte weight loads per lane, and the
// next group's loads are issued before the current group is multiplied. Partial products of each step
// are summed in a fresh register tile and added to the float32 accumulator with round-to-nearest adds
// (the tensor core's internal accumulation truncates; one long MMA chain would bias the sum by ~K/16
// truncations: measured 9e-6 relative at K = 2560 against 1e-7 with per-step tiles). Rows past N /
// tokens past the tile's count: load address clamped, result discarded. Grouped (MoE) operation via
// the tile table exactly as dense_linear.cu.
//
// Measured on an H200 (131072 x 2560 BF16, 671 MB; float32-FMA GEMV of dense_linear.cu in brackets):
// 2 rows 181 us (181), 4 rows 181 us (211), 8 rows 181 us (528), 16 rows 176 us (1092); 1 row: 166 us.
// Requirements (the host falls back to dense_linear.cu otherwise): K % 32 == 0, W and X 16-byte aligned.
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc (sm_80+).

#include "grid_dep.cuh"
#include "common.cuh"

#include "gemv_mma.cuh"

#define MMA_GEMV_SX_ENTRY(NAME, NT, MT, SPLITS)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                      \
        const float* X, const int* row_index, const bf16_bits_t* W, long long w_expert_stride, float* Y,         \
        const int* tile_expert, const int* tile_start, const int* tile_count, const int* n_tiles, int M, int N,  \
        int K) { GRID_DEP_ENTRY();                                                                               \
        mma_gemv_body_sx<NT, MT, SPLITS>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start,           \
                                         tile_count, n_tiles, M, N, K);                                          \
    }

#define MMA_GEMV_ENTRY(NAME, NT, KS, MT, SPLITS)                                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                      \
        const float* X, const int* row_index, const bf16_bits_t* W, long long w_expert_stride, float* Y,         \
        const int* tile_expert, const int* tile_start, const int* tile_count, const int* n_tiles, int M, int N,  \
        int K) { GRID_DEP_ENTRY();                                                                               \
        mma_gemv_body<NT, KS, MT, SPLITS>(X, row_index, W, w_expert_stride, Y, tile_expert, tile_start,          \
                                          tile_count, n_tiles, M, N, K);                                         \
    }

// Entry points: gemv_bf16_mma_nt{tokens per tile}_ks{warps splitting K}_mt{16-row m-tiles per warp}[_sx].
// Dispatched (engine/kernels/linear.py): _ks1_mt1_sx (shared-memory activation split) for matrices with
// enough 128-row blocks for the SMs, _ks8_mt1 (split-K) for short, wide ones.
MMA_GEMV_SX_ENTRY(gemv_bf16_mma_nt8_ks1_mt1_sx, 8, 1, 3)
MMA_GEMV_SX_ENTRY(gemv_bf16_mma_nt16_ks1_mt1_sx, 16, 1, 3)
MMA_GEMV_ENTRY(gemv_bf16_mma_nt8_ks8_mt1, 8, 8, 1, 3)
MMA_GEMV_ENTRY(gemv_bf16_mma_nt16_ks8_mt1, 16, 8, 1, 3)
// not dispatched: the per-lane split without split-K (kept as a tested reference variant)
MMA_GEMV_ENTRY(gemv_bf16_mma_nt16_ks1_mt1, 16, 1, 1, 3)
// debug / negative controls only: activations split in two parts (hi + mid, lo dropped): NOT float32-exact
MMA_GEMV_SX_ENTRY(gemv_bf16_mma_nt16_ks1_mt1_sx_split2, 16, 1, 2)
MMA_GEMV_ENTRY(gemv_bf16_mma_nt16_ks8_mt1_split2, 16, 8, 1, 2)
MMA_GEMV_ENTRY(gemv_bf16_mma_nt16_ks1_mt1_split2, 16, 1, 1, 2)
