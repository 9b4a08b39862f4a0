// Tensor-core decode GEMV over NVFP4 weights (qmma_nvfp4_*): Y[T, N] = X[T, K] @ deq(W)[N, K]^T for 1..16
// activation rows, on mma.m16n8k16 (BF16 in, float32 accumulators). Included by quant_linear.cu after
// gemv_quant2.cuh (ld_stream16, e4m3x2_to_f32x2) and common.cuh (split_pair, mma_bf16_16816, resolve_tile).
//
// Operands. A (16 weight rows x 16 k) holds code x block scale, exact in BF16: an E2M1 code has 2 significant bits,
// an E4M3 scale 4, so their product has at most 6 and lies in [2^-10, 2688] (or is +-0). The codes are built by
// bit moves as BF16 values code x 2^-126 (the E2M1 magnitude bits e1 e0 m at the BF16 bits 8:6, so the subnormal
// code 0.5 becomes a BF16 subnormal) and multiplied in BF16 by scale x 2^119 (exact in BF16); the product,
// code x scale x 2^-7 in [2^-17, 21], is exact and normal. B holds the activations split exactly into three BF16
// parts (common.cuh split3: x == hi + mid + lo): column c of B is part c % 3 of token c / 3, so one MMA serves
// 8 / 3 tokens' parts at once (1 token: 1 n-tile; 4: 2; 16: 6). Every product A x B is exact; the tensor core
// sums the 16 products of a step and the 8 chained steps of a 128-k group in float32 (its own internal
// truncation, as the prefill GEMMs of gemm_tc.cu); groups are then added with round-to-nearest float32 adds, the
// K-splitting warps in a fixed order, and a token's result is ((lo + mid) + hi) x (global scale x 2^7). So every
// weight enters with exactly the reference reader's code x scale, and the global scale is applied once per output
// (the reader applies it per weight: the two differ by float32 rounding, like the summation order). With a one-hot
// activation row the output is exactly the reader's dequantised weight (one rounding of code x scale x global).
//
// Work split: a block of 8 warps; KS warps split the 128-k groups of K (group i to warp i % KS), 8 / KS row groups
// of 16 rows. Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes (32 codes) of rows g and g + 8 per group, k
// 32 t .. 32 t + 31 of the group, and the two scale bytes of those codes. MMA step j (0..7) takes word j / 2 of
// the 16 bytes; its k slots 2t, 2t + 1 are the word's codes p, p + 4 and slots 2t + 8, 2t + 9 the codes p + 1,
// p + 5 (p = 2 (j % 2)): a permutation of K that B follows. The block stages B for a tile of groups in shared
// memory (split once per block, in the fragment order, one 8-byte load per lane and step); the next group's
// weights are loaded before the current one is multiplied, and a tile's first group before its staging barrier.
// Requires K % 128 == 0 and 16-byte aligned codes; sm_80+ (the host checks and runs qgemv2 otherwise).
#pragma once

#define QMMA_SMEM 36864  // bytes: the staged B tile (GT groups) and, after the K loop, the warps' partial sums

// E2M1 nibbles I (low half) and I + 4 (high half) of the word v as BF16 bits of code x 2^-126.
template <int I>
__device__ __forceinline__ unsigned int e2m1_pair_bf16(unsigned int v) {
    const unsigned int mag = (I == 0 ? v << 6 : (I == 1 ? v << 2 : (I == 2 ? v >> 2 : v >> 6))) & 0x01C001C0u;
    const unsigned int sgn = (I == 0 ? v << 12 : (I == 1 ? v << 8 : (I == 2 ? v << 4 : v))) & 0x80008000u;
    return mag | sgn;
}

// a x b in BF16 (both halves; round to nearest: exact for the products above). fma with -0: sm_80+.
__device__ __forceinline__ unsigned int bf16x2_mul(unsigned int a, unsigned int b) {
    unsigned int d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// f in both BF16 halves (round to nearest: exact for the scales x 2^119 used here)
__device__ __forceinline__ unsigned int bf16x2_splat(float f) {
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(f));
    return d;
}

struct NVFP4M {  // nvfp4 tensor-core reader (the layouts of quant_linear.cu's header)
    const u8* Q;
    const u8* S;
    const float* S2;
    long long q_es, s_es;
    int s2_rows, s2_per_e;
    struct Raw {
        uint4 v;         // 32 codes of the row: k 32 t .. 32 t + 31 of the group
        unsigned int s;  // their two E4M3 scale bytes (low byte: codes 0..15)
    };
    // the global scale of row n, x 2^7 (undoes the 2^-7 of the A operand)
    __device__ __forceinline__ float out_scale(long long e, int n) const { return S2[e * s2_per_e + n / s2_rows] * 128.f; }
    __device__ __forceinline__ Raw raw(long long e, int n, int kg, int t, int K) const {
        Raw r;
        r.v = ld_stream16(Q + e * q_es + (long long)n * (K >> 1) + (long long)kg * 64 + t * 16);
        r.s = *reinterpret_cast<const unsigned short*>(S + e * s_es + (long long)n * (K >> 4) + (long long)kg * 8 + t * 2);
        return r;
    }
};

// The A registers of MMA steps 2q + P / 2 (P = 0: even step, 2: odd) for one row: slots 2t.. (codes P, P + 4 of
// word q) and 2t + 8.. (codes P + 1, P + 5), times the word's scale (x 2^119).
template <int P>
__device__ __forceinline__ void qmma_frag(unsigned int w, unsigned int sc, unsigned int& lo, unsigned int& hi) {
    lo = bf16x2_mul(e2m1_pair_bf16<P>(w), sc);
    hi = bf16x2_mul(e2m1_pair_bf16<P + 1>(w), sc);
}

template <int NTILES, int NC, int P>
__device__ __forceinline__ void qmma_step(float (&c)[NTILES][4], unsigned int wa, unsigned int wb, unsigned int sa,
                                          unsigned int sb, const uint2* __restrict__ bstep, int g, int t) {
    unsigned int a0, a1, a2, a3;
    qmma_frag<P>(wa, sa, a0, a2);
    qmma_frag<P>(wb, sb, a1, a3);
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
        const int col = nt * 8 + g;
        uint2 b = make_uint2(0u, 0u);
        if (col < NC) b = bstep[col * 4 + t];
        mma_bf16_16816(c[nt], a0, a1, a2, a3, b.x, b.y);
    }
}

// One 128-k group of rows (g, g + 8): 8 MMA steps chained in fresh accumulators, then added to acc.
template <int NTILES, int NC>
__device__ __forceinline__ void qmma_group(float (&acc)[NTILES][4], const NVFP4M::Raw& ra, const NVFP4M::Raw& rb,
                                           const uint2* __restrict__ bgroup, int g, int t) {
    const float2 fa = e4m3x2_to_f32x2(ra.s), fb = e4m3x2_to_f32x2(rb.s);
    const float p119 = __int_as_float(0x7B000000);  // 2^119
    const unsigned int sa0 = bf16x2_splat(fa.x * p119), sa1 = bf16x2_splat(fa.y * p119);
    const unsigned int sb0 = bf16x2_splat(fb.x * p119), sb1 = bf16x2_splat(fb.y * p119);
    const unsigned int wa[4] = {ra.v.x, ra.v.y, ra.v.z, ra.v.w}, wb[4] = {rb.v.x, rb.v.y, rb.v.z, rb.v.w};
    float c[NTILES][4];
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const unsigned int sa = q < 2 ? sa0 : sa1, sb = q < 2 ? sb0 : sb1;
        qmma_step<NTILES, NC, 0>(c, wa[q], wb[q], sa, sb, bgroup + (2 * q) * NC * 4, g, t);
        qmma_step<NTILES, NC, 2>(c, wa[q], wb[q], sa, sb, bgroup + (2 * q + 1) * NC * 4, g, t);
    }
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] += c[nt][i];
}

template <int NT, int KS>
__device__ __forceinline__ void qmma_body(const NVFP4M& ld, const float* __restrict__ X,
                                          const int* __restrict__ row_index, float* __restrict__ Y,
                                          const int* tile_expert, const int* tile_start, const int* tile_count,
                                          const int* n_tiles, int M, int N, int K) {
    static_assert(8 % KS == 0, "KS divides 8");
    constexpr int NC = 3 * NT;                   // B columns: part c % 3 (hi, mid, lo) of token c / 3
    constexpr int NTILES = (NC + 7) / 8;
    constexpr int RG = 8 / KS;                   // row groups of 16 per block
    constexpr int GT = QMMA_SMEM / (256 * NC);   // 128-k groups per staged tile: [GT][8 steps][NC][4 t] uint2
    static_assert(GT >= 1 && 8 * 16 * NC * 4 <= QMMA_SMEM, "shared memory");
    __shared__ __align__(16) unsigned char qmma_smem[QMMA_SMEM];
    uint2* sB = reinterpret_cast<uint2*>(qmma_smem);
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / KS, ks = warp % KS;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = (blockIdx.x * RG + rg) * 16;
    const bool live = n0 < N;  // warps past N take part in the barriers only
    const int na = min(n0 + g, N - 1), nb = min(n0 + g + 8, N - 1);  // clamped: loads stay in bounds
    const int NG = K >> 7;
    float acc[NTILES][4];
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    for (int g0 = 0; g0 < NG; g0 += GT) {
        const int ng = min(GT, NG - g0);
        NVFP4M::Raw ca, cb;
        if (live && ks < ng) {
            ca = ld.raw(e, na, g0 + ks, t, K);
            cb = ld.raw(e, nb, g0 + ks, t, K);
        }
        __syncthreads();  // the previous tile's B is no longer read
        // stage B: item ((gl * 8 + j) * NT + tok) * 4 + tt -> sB[gl][j][3 tok + part][tt]
        for (int it = threadIdx.x; it < ng * 32 * NT; it += 256) {
            const int tt = it & 3, tok = (it >> 2) % NT, j = ((it >> 2) / NT) & 7, gl = (it >> 2) / NT >> 3;
            const int k0 = (g0 + gl) * 128 + 32 * tt + 8 * (j >> 1) + 2 * (j & 1);
            float2 xa = make_float2(0.f, 0.f), xb = make_float2(0.f, 0.f);
            if (tok < count) {
                const long long xrow = row_index != nullptr ? (long long)row_index[start + tok] : (long long)(start + tok);
                const float* xp = X + xrow * K + k0;
                xa = *reinterpret_cast<const float2*>(xp);      // k0, k0 + 1
                xb = *reinterpret_cast<const float2*>(xp + 4);  // k0 + 4, k0 + 5
            }
            unsigned int h0, m0, l0, h1, m1, l1;
            split_pair(xa.x, xb.x, h0, m0, l0);  // slots 2t, 2t + 1: codes p, p + 4
            split_pair(xa.y, xb.y, h1, m1, l1);  // slots 2t + 8, 2t + 9: codes p + 1, p + 5
            uint2* d = sB + ((gl * 8 + j) * NC + 3 * tok) * 4 + tt;
            d[0] = make_uint2(h0, h1);
            d[4] = make_uint2(m0, m1);
            d[8] = make_uint2(l0, l1);
        }
        __syncthreads();
        if (live) {
            for (int gl = ks; gl < ng; gl += KS) {
                NVFP4M::Raw xa_, xb_;
                const int gn = gl + KS;
                if (gn < ng) {
                    xa_ = ld.raw(e, na, g0 + gn, t, K);
                    xb_ = ld.raw(e, nb, g0 + gn, t, K);
                }
                qmma_group<NTILES, NC>(acc, ca, cb, sB + gl * 8 * NC * 4, g, t);
                ca = xa_;
                cb = xb_;
            }
        }
    }
    __syncthreads();  // B reads done: the shared memory now holds the partial sums [warp][16 rows][NC]
    float* red = reinterpret_cast<float*>(qmma_smem);
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int col = nt * 8 + 2 * t + (i & 1), row = g + 8 * (i >> 1);
            if (col < NC) red[(warp * 16 + row) * NC + col] = acc[nt][i];
        }
    __syncthreads();
    for (int i = threadIdx.x; i < RG * 16 * NT; i += 256) {
        const int tok = i % NT, row = (i / NT) % 16, grp = i / (NT * 16);
        const int n = (blockIdx.x * RG + grp) * 16 + row;
        if (n < N && tok < count) {
            float p[3];
#pragma unroll
            for (int q = 0; q < 3; ++q) {
                float s = 0.f;
#pragma unroll
                for (int k2 = 0; k2 < KS; ++k2) s += red[((grp * KS + k2) * 16 + row) * NC + 3 * tok + q];
                p[q] = s;
            }
            Y[(long long)(start + tok) * N + n] = ((p[2] + p[1]) + p[0]) * ld.out_scale(e, n);
        }
    }
}
