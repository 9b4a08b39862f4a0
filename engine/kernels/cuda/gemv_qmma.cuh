// Tensor-core decode GEMV over NVFP4 and FP8 weights (qmma_nvfp4_*, qmma_fp8_*): Y[T, N] = X[T, K] @ deq(W)[N, K]^T for 1..16
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
// FP8 (reader FP8M): the same body with 64-k groups of 4 MMA steps; A holds the E4M3 codes (hardware conversion,
// exact in BF16) and the group's float32 block scale multiplies the group's float32 sum (K % 64 == 0, scale
// blocks of whole 16-row x 64-column tiles).
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

// float32 pair -> BF16x2 (low half = a; round to nearest: exact for the E4M3 values used here)
__device__ __forceinline__ unsigned int bf16x2_pack(float a, float b) {
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));
    return d;
}

template <int NTILES>
__device__ __forceinline__ void qmma_zero(float (&c)[NTILES][4]) {
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[nt][i] = 0.f;
}

template <int NTILES, int NC>
__device__ __forceinline__ void qmma_mma(float (&c)[NTILES][4], unsigned int a0, unsigned int a1, unsigned int a2,
                                         unsigned int a3, const uint2* __restrict__ bstep, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < NTILES; ++nt) {
        const int col = nt * 8 + g;
        uint2 b = make_uint2(0u, 0u);
        if (col < NC) b = bstep[col * 4 + t];
        mma_bf16_16816(c[nt], a0, a1, a2, a3, b.x, b.y);
    }
}

struct NVFP4M {  // nvfp4 tensor-core reader (the layouts of quant_linear.cu's header)
    const u8* Q;
    const u8* S;
    const float* S2;
    long long q_es, s_es;
    int s2_rows, s2_per_e;
    static constexpr int KG = 128;  // k per group: 4 lanes x 16 bytes (32 codes) of a row
    static constexpr int STEPS = 8;  // MMA steps per group
    // step j's k slots 2t, 2t + 1, 2t + 8, 2t + 9 hold the lane's codes k0 + {0, 4, 1, 5}, k0 = 8 (j / 2) + 2 (j % 2)
    __device__ __forceinline__ static int k_off(int j) { return 8 * (j >> 1) + 2 * (j & 1); }
    static constexpr int D1 = 4, D2 = 1, D3 = 5;
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
    // One group of rows (g, g + 8): 8 MMA steps chained in fresh accumulators, then added to acc. Step 2q + P / 2
    // (P = 0, 2) takes word q, code pairs (P, P + 4) and (P + 1, P + 5), times the word's scale (x 2^119).
    template <int NTILES, int NC>
    __device__ __forceinline__ void group(float (&acc)[NTILES][4], const Raw& ra, const Raw& rb,
                                          const uint2* __restrict__ bgroup, int g, int t) const {
        const float2 fa = e4m3x2_to_f32x2(ra.s), fb = e4m3x2_to_f32x2(rb.s);
        const float p119 = __int_as_float(0x7B000000);  // 2^119
        const unsigned int sa0 = bf16x2_splat(fa.x * p119), sa1 = bf16x2_splat(fa.y * p119);
        const unsigned int sb0 = bf16x2_splat(fb.x * p119), sb1 = bf16x2_splat(fb.y * p119);
        const unsigned int wa[4] = {ra.v.x, ra.v.y, ra.v.z, ra.v.w}, wb[4] = {rb.v.x, rb.v.y, rb.v.z, rb.v.w};
        float c[NTILES][4];
        qmma_zero(c);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const unsigned int sa = q < 2 ? sa0 : sa1, sb = q < 2 ? sb0 : sb1;
            qmma_mma<NTILES, NC>(c, bf16x2_mul(e2m1_pair_bf16<0>(wa[q]), sa), bf16x2_mul(e2m1_pair_bf16<0>(wb[q]), sb),
                                 bf16x2_mul(e2m1_pair_bf16<1>(wa[q]), sa), bf16x2_mul(e2m1_pair_bf16<1>(wb[q]), sb),
                                 bgroup + (2 * q) * NC * 4, g, t);
            qmma_mma<NTILES, NC>(c, bf16x2_mul(e2m1_pair_bf16<2>(wa[q]), sa), bf16x2_mul(e2m1_pair_bf16<2>(wb[q]), sb),
                                 bf16x2_mul(e2m1_pair_bf16<3>(wa[q]), sa), bf16x2_mul(e2m1_pair_bf16<3>(wb[q]), sb),
                                 bgroup + (2 * q + 1) * NC * 4, g, t);
        }
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] += c[nt][i];
    }
};

struct FP8M {  // fp8 tensor-core reader: E4M3 codes exact in BF16, the float32 block scale after each group
    const u8* Q;
    const float* S;
    long long q_es, s_es;
    int rb, cb, ncb;
    static constexpr int KG = 64;    // k per group: 4 lanes x 16 bytes (16 codes) of a row
    static constexpr int STEPS = 4;  // MMA steps per group
    // step j's k slots 2t, 2t + 1, 2t + 8, 2t + 9 hold the lane's codes k0 + {0, 1, 2, 3}, k0 = 4 j
    __device__ __forceinline__ static int k_off(int j) { return 4 * j; }
    static constexpr int D1 = 1, D2 = 2, D3 = 3;
    struct Raw {
        uint4 v;  // 16 codes of the row: k 16 t .. 16 t + 15 of the group
        float s;  // the block scale of the group (one per 16-row tile: rb % 16 == 0, cb % 64 == 0)
    };
    __device__ __forceinline__ float out_scale(long long, int) const { return 1.f; }
    __device__ __forceinline__ Raw raw(long long e, int n, int kg, int t, int K) const {
        Raw r;
        r.v = ld_stream16(Q + e * q_es + (long long)n * K + (long long)kg * 64 + t * 16);
        r.s = S[e * s_es + (long long)(n / rb) * ncb + (kg * 64) / cb];
        return r;
    }
    // two E4M3 codes (bytes 0, 1 of b) -> BF16x2, exactly (hardware E4M3 -> f16 -> f32 -> BF16, sm_89+; the bit
    // decode of e4m3_to_f32 before; NaN codes stay NaN)
    __device__ __forceinline__ static unsigned int pair(unsigned int b) {
        const float2 f = e4m3x2_to_f32x2(b);
        return bf16x2_pack(f.x, f.y);
    }
    // One group of rows (g, g + 8): 4 MMA steps (word j: codes (0, 1) at slots 2t.., (2, 3) at 2t + 8..) chained in
    // fresh accumulators, then acc += c x block scale (the tile's 16 rows share it).
    template <int NTILES, int NC>
    __device__ __forceinline__ void group(float (&acc)[NTILES][4], const Raw& ra, const Raw& rb_,
                                          const uint2* __restrict__ bgroup, int g, int t) const {
        const unsigned int wa[4] = {ra.v.x, ra.v.y, ra.v.z, ra.v.w}, wb[4] = {rb_.v.x, rb_.v.y, rb_.v.z, rb_.v.w};
        float c[NTILES][4];
        qmma_zero(c);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            qmma_mma<NTILES, NC>(c, pair(wa[j]), pair(wb[j]), pair(wa[j] >> 16), pair(wb[j] >> 16),
                                 bgroup + j * NC * 4, g, t);
#pragma unroll
        for (int nt = 0; nt < NTILES; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[nt][i] = fmaf(c[nt][i], ra.s, acc[nt][i]);
    }
};

template <typename LD, int NT, int KS>
__device__ __forceinline__ void qmma_body(const LD& ld, const float* __restrict__ X,
                                          const int* __restrict__ row_index, float* __restrict__ Y,
                                          const int* tile_expert, const int* tile_start, const int* tile_count,
                                          const int* n_tiles, int M, int N, int K) {
    static_assert(8 % KS == 0, "KS divides 8");
    constexpr int NC = 3 * NT;                   // B columns: part c % 3 (hi, mid, lo) of token c / 3
    constexpr int NTILES = (NC + 7) / 8;
    constexpr int RG = 8 / KS;                   // row groups of 16 per block
    constexpr int ST = LD::STEPS;
    constexpr int GT = QMMA_SMEM / (32 * ST * NC);  // groups per staged tile: [GT][ST steps][NC][4 t] uint2
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
    const int NG = K / LD::KG;
    float acc[NTILES][4];
    qmma_zero(acc);
    for (int g0 = 0; g0 < NG; g0 += GT) {
        const int ng = min(GT, NG - g0);
        typename LD::Raw ca, cb;
        if (live && ks < ng) {
            ca = ld.raw(e, na, g0 + ks, t, K);
            cb = ld.raw(e, nb, g0 + ks, t, K);
        }
        __syncthreads();  // the previous tile's B is no longer read
        // stage B: item ((gl * ST + j) * NT + tok) * 4 + tt -> sB[gl][j][3 tok + part][tt]; step j's slots
        // 2t, 2t + 1, 2t + 8, 2t + 9 of lane t take x[k0], x[k0 + D1], x[k0 + D2], x[k0 + D3] (the loader's order)
        for (int it = threadIdx.x; it < ng * ST * 4 * NT; it += 256) {
            const int tt = it & 3, tok = (it >> 2) % NT, j = ((it >> 2) / NT) % ST, gl = (it >> 2) / NT / ST;
            const int k0 = (g0 + gl) * LD::KG + (LD::KG / 4) * tt + LD::k_off(j);
            float x0 = 0.f, x1 = 0.f, x2 = 0.f, x3 = 0.f;
            if (tok < count) {
                const long long xrow = row_index != nullptr ? (long long)row_index[start + tok] : (long long)(start + tok);
                const float* xp = X + xrow * K + k0;
                x0 = xp[0];
                x1 = xp[LD::D1];
                x2 = xp[LD::D2];
                x3 = xp[LD::D3];
            }
            unsigned int h0, m0, l0, h1, m1, l1;
            split_pair(x0, x1, h0, m0, l0);  // slots 2t, 2t + 1
            split_pair(x2, x3, h1, m1, l1);  // slots 2t + 8, 2t + 9
            uint2* d = sB + ((gl * ST + j) * NC + 3 * tok) * 4 + tt;
            d[0] = make_uint2(h0, h1);
            d[4] = make_uint2(m0, m1);
            d[8] = make_uint2(l0, l1);
        }
        __syncthreads();
        if (live) {
            for (int gl = ks; gl < ng; gl += KS) {
                typename LD::Raw xa_, xb_;
                const int gn = gl + KS;
                if (gn < ng) {
                    xa_ = ld.raw(e, na, g0 + gn, t, K);
                    xb_ = ld.raw(e, nb, g0 + gn, t, K);
                }
                ld.template group<NTILES, NC>(acc, ca, cb, sB + gl * ST * NC * 4, g, t);
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
