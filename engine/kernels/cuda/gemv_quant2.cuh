// Streaming decode GEMV over stored-format weights (qgemv2_*): the loaders FP8S / NVFP4S and qgemv2_body, shared by
// quant_linear.cu (the entries) and any kernel that fuses an epilogue after the same body.
// Include after the definitions of u8, e4m3_to_f32, e2m1_to_f32, dot8 (quant_linear.cu) and resolve_tile
// (common.cuh). Self-contained otherwise (no host headers; NVRTC gets it inlined, engine/backend.py).
#pragma once

// The decode GEMV for FP8 / NVFP4 (every launch with 16-byte chunks; the scalar qgemv_*_s kernels serve the rest).
//
// Work split: a block of 8 warps; KS warps split K (their partial sums are added in shared memory in a fixed
// order: deterministic, no atomics), 8 / KS warp row groups. A warp is 32 / G slots of G lanes; a slot owns RL
// weight rows, its G lanes read G consecutive 16-byte chunks of each row (G * 16 contiguous bytes per row per
// load: whole sectors). Lane chunk j is ks * G + q + j * G * KS; U chunks x RL rows (codes and scales) are
// loaded before any is decoded, so with U * G * KS >= chunks per row every load of a lane is in flight at once.
// Weights are read with ld.global.nc.L1::no_allocate (streamed once); activations through L1 (every slot
// reads the same activation chunk: G distinct addresses per load instruction).
//
// Decode (exactly the reference reader's value per element, as the scalar get() of FP8W / NVFP4W):
//   fp8  : cvt.rn.f16x2.e4m3x2 (E4M3 -> f16 is exact), f16 -> f32 (exact), times the block scale (one f32
//          product, as the reference).
//   nvfp4: each E2M1 nibble s.ee.m is rewritten as the E4M3 byte s.0ee.m00 (value = E2M1 * 2^-6 exactly, the
//          subnormal E2M1 0.5 included), two at a time converted to f16x2 (exact) and multiplied in f16 by the
//          per-16 scale times 2^6 (E4M3 * 64 is exact in f16: 2^-3 .. 28672). The product code * scale has at
//          most 6 significant bits and lies in [2^-10, 2688] (or is +-0): exact in f16, hence equal to the
//          reference's exact f32 product; then f32 (exact) times the global scale (the one rounding, as the
//          reference).
// Requires K % EPL == 0, 16-byte aligned rows and activations (fp8 also cb % 16 == 0); the host falls back to
// qgemv_*_s otherwise. sm_89+ (hardware E4M3 conversion); older GPUs use the bit decode of e4m3_to_f32.

// Blocks per SM the register budget of an entry is sized for (its __launch_bounds__ minimum): 1 row <= 64 registers
// (32 warps / SM), 4 rows <= 128, 16 rows <= 255.
#define QGEMV2_MINB(NT) ((NT) == 1 ? 4 : ((NT) == 4 ? 2 : 1))

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Two E4M3 bytes (low 16 bits of b: byte 0 -> .x, byte 1 -> .y) -> two exact float32.
__device__ __forceinline__ float2 e4m3x2_to_f32x2(unsigned int b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
    unsigned int h2;
    asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(h2) : "r"(b));
    float lo, hi;
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
    float2 r;
    r.x = lo;
    r.y = hi;
    return r;
#else
    float2 r;
    r.x = e4m3_to_f32(b & 0xffu);
    r.y = e4m3_to_f32((b >> 8) & 0xffu);
    return r;
#endif
}

// Two E4M3 bytes (low 16 bits of b) -> f16x2 (exact; byte 0 in the low half). sm_89+ only (callers check).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2(unsigned int b) {
    unsigned int h2;
    asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(h2) : "r"(b));
    return h2;
}
#endif

// f16x2 product (exact for the operands used here) then both halves to float32.
__device__ __forceinline__ float2 f16x2_mul_to_f32x2(unsigned int a, unsigned int b) {
    unsigned int p;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p) : "r"(a), "r"(b));
    float lo, hi;
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(p));
    float2 r;
    r.x = lo;
    r.y = hi;
    return r;
}

struct FP8S {  // fp8 streaming reader (chunk = 16 weights = 16 bytes)
    const u8* Q;
    const float* S;
    long long q_es, s_es;
    int rb, cb, ncb;
    static constexpr int EPL = 16;
    struct Raw {
        uint4 v;
        float s;
    };
    __device__ __forceinline__ float row_scale(long long, int) const { return 1.f; }
    __device__ __forceinline__ Raw raw(long long e, int n, int c, int K) const {
        Raw r;
        r.v = ld_stream16(Q + e * q_es + (long long)n * K + (long long)c * 16);
        r.s = S[e * s_es + (long long)(n / rb) * ncb + (c * 16) / cb];
        return r;
    }
    // weights 8p .. 8p + 7 of the chunk, natural order
    __device__ __forceinline__ void decode8(const Raw& r, int p, float, float* w) const {
        const unsigned int lo = p == 0 ? r.v.x : r.v.z, hi = p == 0 ? r.v.y : r.v.w;
        float2 a = e4m3x2_to_f32x2(lo), b = e4m3x2_to_f32x2(lo >> 16);
        float2 c = e4m3x2_to_f32x2(hi), d = e4m3x2_to_f32x2(hi >> 16);
        w[0] = a.x * r.s; w[1] = a.y * r.s; w[2] = b.x * r.s; w[3] = b.y * r.s;
        w[4] = c.x * r.s; w[5] = c.y * r.s; w[6] = d.x * r.s; w[7] = d.y * r.s;
    }
};

struct NVFP4S {  // nvfp4 streaming reader (chunk = 32 weights = 16 bytes + 2 scale bytes)
    const u8* Q;
    const u8* S;
    const float* S2;
    long long q_es, s_es;
    int s2_rows, s2_per_e;
    static constexpr int EPL = 32;
    struct Raw {
        uint4 v;
        unsigned int s;  // the two E4M3 scale bytes of the chunk (low byte: elements 0..15)
    };
    __device__ __forceinline__ float row_scale(long long e, int n) const { return S2[e * s2_per_e + n / s2_rows]; }
    __device__ __forceinline__ Raw raw(long long e, int n, int c, int K) const {
        Raw r;
        r.v = ld_stream16(Q + e * q_es + (long long)n * (K >> 1) + (long long)c * 16);
        r.s = *reinterpret_cast<const unsigned short*>(S + e * s_es + (long long)n * (K >> 4) + (long long)c * 2);
        return r;
    }
    __device__ __forceinline__ void decode8(const Raw& r, int p, float g, float* w) const {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
        const unsigned int u = p == 0 ? r.v.x : (p == 1 ? r.v.y : (p == 2 ? r.v.z : r.v.w));
        // scale * 2^6 in both f16 halves (E4M3 -> f16 exact; * 64 exact in f16)
        const unsigned int sb = p < 2 ? (r.s & 0xffu) : ((r.s >> 8) & 0xffu);
        unsigned int sc2 = e4m3x2_to_f16x2(sb | (sb << 8));
        asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(sc2) : "r"(0x54005400u));  // 0x5400 = 64.0 in f16
        // nibble s.ee.m -> E4M3 byte s.0ee.m00: even elements (low nibbles) in A, odd (high nibbles) in B
        const unsigned int A = ((u << 2) & 0x1C1C1C1Cu) | ((u << 4) & 0x80808080u);  // elements 0, 2, 4, 6
        const unsigned int B = ((u >> 2) & 0x1C1C1C1Cu) | (u & 0x80808080u);        // elements 1, 3, 5, 7
        const float2 a0 = f16x2_mul_to_f32x2(e4m3x2_to_f16x2(A), sc2);        // e0, e2
        const float2 a1 = f16x2_mul_to_f32x2(e4m3x2_to_f16x2(A >> 16), sc2);  // e4, e6
        const float2 b0 = f16x2_mul_to_f32x2(e4m3x2_to_f16x2(B), sc2);        // e1, e3
        const float2 b1 = f16x2_mul_to_f32x2(e4m3x2_to_f16x2(B >> 16), sc2);  // e5, e7
        w[0] = a0.x * g; w[2] = a0.y * g; w[4] = a1.x * g; w[6] = a1.y * g;
        w[1] = b0.x * g; w[3] = b0.y * g; w[5] = b1.x * g; w[7] = b1.y * g;
#else
        const unsigned int u = p == 0 ? r.v.x : (p == 1 ? r.v.y : (p == 2 ? r.v.z : r.v.w));
        const float sc = e4m3_to_f32(p < 2 ? (r.s & 0xffu) : ((r.s >> 8) & 0xffu));
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = (e2m1_to_f32((u >> (4 * j)) & 15u) * sc) * g;
#endif
    }
};

template <typename LD, int NT, int G, int RL, int KS, int U>
__device__ __forceinline__ void qgemv2_body(const LD& ld, const float* __restrict__ X,
                                            const int* __restrict__ row_index,
                                            float* __restrict__ Y, const int* tile_expert, const int* tile_start,
                                            const int* tile_count, const int* n_tiles, int M, int N, int K) {
    static_assert(32 % G == 0 && 8 % KS == 0, "G divides 32, KS divides 8");
    constexpr int RG = 8 / KS;         // warp row groups per block
    constexpr int SL = 32 / G;         // slots per warp
    constexpr int RW = SL * RL;        // weight rows per warp
    constexpr int EPL = LD::EPL;
    constexpr int CSTEP = G * KS;      // chunk stride between a lane's consecutive chunks
    __shared__ float red[(KS > 1) ? 8 * RW * NT : 1];
    int start, count;
    long long e;
    if (!resolve_tile(blockIdx.y, NT, M, tile_expert, tile_start, tile_count, n_tiles, start, count, e)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rg = warp / KS, ks = warp % KS;
    const int slot = lane / G, q = lane % G;
    const int nw0 = (blockIdx.x * RG + rg) * RW;  // first row of this warp
    const int n0 = nw0 + slot * RL;               // first row of this slot
    int nr[RL];
    float g[RL];
#pragma unroll
    for (int r = 0; r < RL; ++r) {
        nr[r] = n0 + r < N ? n0 + r : N - 1;  // clamped (loads stay in bounds; the result is not written)
        g[r] = ld.row_scale(e, nr[r]);
    }
    const float* xr[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int rr = start + (t < count ? t : 0);
        const long long xrow = row_index != nullptr ? (long long)row_index[rr] : (long long)rr;
        xr[t] = X + xrow * K;
    }
    float acc[RL][NT];
#pragma unroll
    for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
    const int KC = K / EPL;
    if (nw0 < N) {
        for (int c0 = ks * G + q; c0 < KC; c0 += U * CSTEP) {
            typename LD::Raw raw[U][RL];
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (c0 + u * CSTEP < KC) {
#pragma unroll
                    for (int r = 0; r < RL; ++r) raw[u][r] = ld.raw(e, nr[r], c0 + u * CSTEP, K);
                }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + u * CSTEP;
                if (c < KC) {
#pragma unroll
                    for (int p = 0; p < EPL / 8; ++p) {
                        float w[RL][8];
#pragma unroll
                        for (int r = 0; r < RL; ++r) ld.decode8(raw[u][r], p, g[r], w[r]);
#pragma unroll
                        for (int t = 0; t < NT; ++t)
                            if (t < count) {
                                const float4* xp = reinterpret_cast<const float4*>(xr[t] + c * EPL + 8 * p);
                                const float4 xa = xp[0], xb = xp[1];
#pragma unroll
                                for (int r = 0; r < RL; ++r) acc[r][t] += dot8(w[r], xa, xb);
                            }
                    }
                }
            }
        }
    }
    // the G lanes of a slot: fixed butterfly order
#pragma unroll
    for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int off = G / 2; off > 0; off >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], off);
    if (KS == 1) {
        if (q == 0) {
#pragma unroll
            for (int r = 0; r < RL; ++r)
                if (n0 + r < N) {
#pragma unroll
                    for (int t = 0; t < NT; ++t)
                        if (t < count) Y[(long long)(start + t) * N + n0 + r] = acc[r][t];
                }
        }
    } else {
        if (q == 0) {
#pragma unroll
            for (int r = 0; r < RL; ++r)
#pragma unroll
                for (int t = 0; t < NT; ++t) red[(warp * RW + slot * RL + r) * NT + t] = acc[r][t];
        }
        __syncthreads();
        // RG * RW * NT outputs; the KS partials of each added in ks order
        for (int i = threadIdx.x; i < RG * RW * NT; i += 256) {
            const int t = i % NT, row = (i / NT) % RW, grp = i / (NT * RW);
            const int n = (blockIdx.x * RG + grp) * RW + row;
            if (n < N && t < count) {
                float sum = 0.f;
#pragma unroll
                for (int k2 = 0; k2 < KS; ++k2) sum += red[((grp * KS + k2) * RW + row) * NT + t];
                Y[(long long)(start + t) * N + n] = sum;
            }
        }
    }
}
