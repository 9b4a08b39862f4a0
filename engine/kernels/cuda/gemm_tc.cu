// Helper kernels of the tensor-core prefill GEMM (engine/kernels/gemm_tc.py): the GEMMs themselves are cuBLAS
// (BF16 x BF16 products, float32 accumulation, float32 output); these kernels prepare their operands and finish
// their outputs, all on the device (no host synchronisation; CUDA-graph capturable).
//
//   split3_rows     : float32 activations -> three BF16 parts (hi, mid, lo; hi + mid + lo == x exactly, split3 of
//                     common.cuh), dense rows or gathered into the tile-padded layout of a grouped (MoE) launch.
//                     nparts < 3 zeroes lo (and mid for 1): negative controls only.
//   nvfp4_to_bf16   : NVFP4 codes x E4M3 scales -> BF16 (exact: <= 6 significant bits, exponents 2^-10..2^12);
//                     the float32 global scale (weight_scale_2) is applied to the GEMM's output instead.
//   scale_rows_s2   : C[r, n] *= scale_2[expert(r) * per + n / s2_rows] (that output scale).
//   fp8_to_bf16x3   : FP8 block-scaled weights -> the three BF16 parts of each float32 dequantised weight (the
//                     reader's value): nine part-by-part GEMMs give the float32 sum of the exact products. One
//                     matrix, or the experts of a stack named by a slot table (the MoE's window of tiles).
//   swiglu_split3   : h = silu(g) * u of a padded gate/up output (moe_swiglu's formula; g, u = the sum of their three
//                     part products, then the optional scale_2 of each half), written directly as the three BF16
//                     parts of the down projection's input.
//   reduce3_rows    : y = (lo + mid) + hi of the three part products (+ optional scale_2), the down output.
//   pad_of_sorted   : padded row of every sorted MoE slot; slot_pad: the padded row of every original slot.
//   tile_ptrs       : the per-tile pointer arrays of cublasGemmBatchedEx (weights of the tile's expert, or of its
//                     slot in a scratch of dequantised experts, one array per weight part; the tile's activation
//                     rows, its output rows), over a window of the tile table, and that window's slot table.
//
// Tile-padded layout (grouped launches): tile t of the tile table (engine.kernels.linear.GroupTiles, TM rows per
// tile) owns padded rows [t * TM, (t + 1) * TM); its row j < count[t] is sorted slot start[t] + j, rows
// j >= count[t] are zero inputs (their outputs are never read); tiles t >= n_tiles (the launch is sized by the
// worst case) are skipped by these kernels and computed but never read by the GEMM. The three parts of a tile are
// stored one after the other (part-interleaved: part p of padded row r = t * TM + j is buffer row
// (3 t + p) TM + j), so one GEMM of 3 TM columns per tile reads the expert's weights once for all three parts; the
// three products are summed afterwards ((lo + mid) + hi, round-to-nearest float32 adds). Dense buffers keep the
// parts apart (part p of row r at p * rows + r: three GEMMs accumulate into one output).
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

#include "grid_dep.cuh"
#include "common.cuh"

typedef unsigned short bf16_bits_t;

// Source row of padded row r (-1: zero row, -2: tile past n_tiles, skip) or, dense (tile_start null), r itself.
__device__ __forceinline__ long long padded_source(long long r, int TM, const int* row_index, const int* tile_start,
                                                   const int* tile_count, const int* n_tiles) {
    if (tile_start == nullptr) return row_index != nullptr ? (long long)row_index[r] : r;
    const long long t = r / TM;
    if (t >= *n_tiles) return -2;
    const int j = (int)(r - t * TM);
    if (j >= tile_count[t]) return -1;
    const long long s = tile_start[t] + j;
    return row_index != nullptr ? (long long)row_index[s] : s;
}

// Buffer row of part p of padded row r (see the layout above).
__device__ __forceinline__ long long part_row(long long r, int p, int TM, long long rows, int interleave) {
    if (!interleave) return p * rows + r;
    const long long t = r / TM;
    return (3 * t + p) * TM + (r - t * TM);
}

// One block per padded row r of rows. vec4: K % 4 == 0 and X 16-byte aligned (then every row is).
extern "C" __global__ void split3_rows(const float* __restrict__ X, const int* __restrict__ row_index,
                                       bf16_bits_t* __restrict__ P, const int* __restrict__ tile_start,
                                       const int* __restrict__ tile_count, const int* __restrict__ n_tiles, int TM,
                                       long long rows, int K, int interleave, int nparts, int vec4) {
    GRID_DEP_ENTRY();
    const long long r = blockIdx.x;
    const long long src = padded_source(r, TM, row_index, tile_start, tile_count, n_tiles);
    if (src == -2) return;
    bf16_bits_t* ph = P + part_row(r, 0, TM, rows, interleave) * K;
    bf16_bits_t* pm = P + part_row(r, 1, TM, rows, interleave) * K;
    bf16_bits_t* pl = P + part_row(r, 2, TM, rows, interleave) * K;
    const unsigned int keep_m = nparts >= 2 ? 0xffffffffu : 0u, keep_l = nparts >= 3 ? 0xffffffffu : 0u;
    if (vec4) {
        const int K4 = K >> 2;
        const float4* x4 = reinterpret_cast<const float4*>(X + (src < 0 ? 0 : src) * K);
        for (int i = threadIdx.x; i < K4; i += blockDim.x) {
            uint2 h = make_uint2(0u, 0u), m = h, l = h;
            if (src >= 0) {
                const float4 v = __ldg(x4 + i);
                split_pair(v.x, v.y, h.x, m.x, l.x);
                split_pair(v.z, v.w, h.y, m.y, l.y);
            }
            reinterpret_cast<uint2*>(ph)[i] = h;
            reinterpret_cast<uint2*>(pm)[i] = make_uint2(m.x & keep_m, m.y & keep_m);
            reinterpret_cast<uint2*>(pl)[i] = make_uint2(l.x & keep_l, l.y & keep_l);
        }
        return;
    }
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        unsigned int h = 0u, m = 0u, l = 0u;
        if (src >= 0) split3(X[src * K + k], h, m, l);
        ph[k] = (bf16_bits_t)(h >> 16);
        pm[k] = (bf16_bits_t)((m & keep_m) >> 16);
        pl[k] = (bf16_bits_t)((l & keep_l) >> 16);
    }
}

// n16 = (number of weights) / 16; weights flattened over [E?, N, K] with K % 16 == 0, so element i's code is
// nibble (i & 1) of byte i / 2 (low nibble first) and its E4M3 scale is byte i / 16. One thread per 16 weights.
extern "C" __global__ void nvfp4_to_bf16(const unsigned char* __restrict__ Q, const unsigned char* __restrict__ S,
                                         bf16_bits_t* __restrict__ out, long long n16) {
    GRID_DEP_ENTRY();
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n16) return;
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(Q) + g);  // 8 bytes = 16 codes (Q 8-byte aligned)
    const float s = e4m3_to_f32(S[g]);
    unsigned int w[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        const unsigned int byte = ((p < 4 ? q.x : q.y) >> (8 * (p & 3))) & 0xffu;
        // code * scale is exact in float32 and in BF16 (<= 2 x 4 significant bits): its upper 16 bits
        const unsigned int lo = __float_as_uint(e2m1_to_f32(byte & 0xfu) * s) >> 16;
        const unsigned int hi = __float_as_uint(e2m1_to_f32(byte >> 4) * s) >> 16;
        w[p] = lo | (hi << 16);
    }
    uint4* o = reinterpret_cast<uint4*>(out) + 2 * g;
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

// FP8 (E4M3 codes, float32 block scales) -> the three BF16 parts of each dequantised weight
// w = float(code) * scale[n / rb][k / cb] (quant_linear.cu's and the reader's float32 product, so w is the
// reference's weight bit for bit), split exactly by split3. Q [E, N, K] codes and S [E, ceil(N / rb), ncb] scales of
// a stack (E = 1: one matrix); slot s = blockIdx.y of the output holds expert slot_expert[s] (slot_expert null: expert s; -1: the
// slot is unused and skipped), part p of it at out + (p * pslots + s) * N * K (hi, mid, lo). Grid-stride over the
// N * K weights of a slot; vec4 (K % 4 == 0, Q 4-byte aligned): four weights of one row per step.
extern "C" __global__ void fp8_to_bf16x3(const unsigned char* __restrict__ Q, const float* __restrict__ S,
                                         const int* __restrict__ slot_expert, int pslots,
                                         bf16_bits_t* __restrict__ out, int N, int K, int rb, int cb, int ncb,
                                         int vec4) {
    GRID_DEP_ENTRY();
    const int s = blockIdx.y;
    const long long e = slot_expert != nullptr ? (long long)slot_expert[s] : (long long)s;
    if (e < 0) return;
    const long long nk = (long long)N * K;
    const unsigned char* q = Q + e * nk;
    const float* sc = S + e * ((long long)((N + rb - 1) / rb) * ncb);
    bf16_bits_t* o = out + (long long)s * nk;
    const long long ps = (long long)pslots * nk;
    const long long step = (long long)gridDim.x * blockDim.x;
    if (vec4) {
        for (long long i4 = (long long)blockIdx.x * blockDim.x + threadIdx.x; 4 * i4 < nk; i4 += step) {
            const long long i = 4 * i4;
            const int n = (int)(i / K), k = (int)(i - (long long)n * K);
            const unsigned int c = __ldg(reinterpret_cast<const unsigned int*>(q) + i4);
            const float* sr = sc + (long long)(n / rb) * ncb;
            float w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = e4m3_to_f32((c >> (8 * j)) & 0xffu) * sr[(k + j) / cb];
            uint2 h, m, l;
            split_pair(w[0], w[1], h.x, m.x, l.x);
            split_pair(w[2], w[3], h.y, m.y, l.y);
            reinterpret_cast<uint2*>(o)[i4] = h;
            reinterpret_cast<uint2*>(o + ps)[i4] = m;
            reinterpret_cast<uint2*>(o + 2 * ps)[i4] = l;
        }
        return;
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nk; i += step) {
        const int n = (int)(i / K), k = (int)(i - (long long)n * K);
        const float w = e4m3_to_f32(q[i]) * sc[(long long)(n / rb) * ncb + k / cb];
        unsigned int h, m, l;
        split3(w, h, m, l);
        o[i] = (bf16_bits_t)(h >> 16);
        o[i + ps] = (bf16_bits_t)(m >> 16);
        o[i + 2 * ps] = (bf16_bits_t)(l >> 16);
    }
}

// C [rows, N] float32: C[r, n] *= S2[e * per + n / s2_rows], e = tile_expert[r / TM] (grouped; rows of tiles past
// n_tiles untouched) or 0 (tile_expert null).
extern "C" __global__ void scale_rows_s2(float* __restrict__ C, const float* __restrict__ S2, int per, int s2_rows,
                                         const int* __restrict__ tile_expert, const int* __restrict__ n_tiles, int TM,
                                         long long rows, int N) {
    GRID_DEP_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * N) return;
    const long long r = i / N;
    const int n = (int)(i - r * N);
    long long e = 0;
    if (tile_expert != nullptr) {
        const long long t = r / TM;
        if (t >= *n_tiles) return;
        e = tile_expert[t];
    }
    C[i] *= S2[e * per + n / s2_rows];
}

// Sum of the three part products of padded row r, column n of a part-interleaved output [3 * rows, N]:
// (lo + mid) + hi, the order of the dense path's beta accumulation.
__device__ __forceinline__ float sum3(const float* __restrict__ C3, long long r, int n, int TM, int N) {
    const long long t = r / TM, j = r - t * TM;
    const float* c = C3 + ((3 * t) * TM + j) * N + n;
    const long long ps = (long long)TM * N;
    return (c[2 * ps] + c[ps]) + c[0];
}

// GU3 part-interleaved gate/up products [3 * rows, 2I] -> the three BF16 parts of h [rows, I], part-interleaved too.
// h = (g / (1 + exp(-g))) * u exactly as moe_swiglu (dense_moe.cu); with S2 (NVFP4) g and u are first multiplied by
// their half's global scale (the GEMM ran on the unscaled codes x scales).
extern "C" __global__ void swiglu_split3(const float* __restrict__ GU3, bf16_bits_t* __restrict__ P,
                                         const float* __restrict__ S2, int per, int s2_rows,
                                         const int* __restrict__ tile_expert, const int* __restrict__ tile_count,
                                         const int* __restrict__ n_tiles, int TM, long long rows, int I, int nparts) {
    GRID_DEP_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * I) return;
    const long long r = i / I;
    const int c = (int)(i - r * I);
    const long long t = r / TM;
    if (t >= *n_tiles) return;
    unsigned int h = 0u, m = 0u, l = 0u;
    if ((int)(r - t * TM) < tile_count[t]) {
        float g = sum3(GU3, r, c, TM, 2 * I), u = sum3(GU3, r, I + c, TM, 2 * I);
        if (S2 != nullptr) {
            const long long e = tile_expert[t];
            g *= S2[e * per + c / s2_rows];
            u *= S2[e * per + (I + c) / s2_rows];
        }
        split3((g / (1.f + expf(-g))) * u, h, m, l);
        if (nparts < 3) l = 0u;
        if (nparts < 2) m = 0u;
    }
    P[part_row(r, 0, TM, rows, 1) * I + c] = (bf16_bits_t)(h >> 16);
    P[part_row(r, 1, TM, rows, 1) * I + c] = (bf16_bits_t)(m >> 16);
    P[part_row(r, 2, TM, rows, 1) * I + c] = (bf16_bits_t)(l >> 16);
}

// Y [rows, N] = sum3 of the part-interleaved products Y3 [3 * rows, N] (times S2[e * per + n / s2_rows] with S2).
// Rows of tiles past n_tiles are left unwritten (never read).
extern "C" __global__ void reduce3_rows(const float* __restrict__ Y3, float* __restrict__ Y,
                                        const float* __restrict__ S2, int per, int s2_rows,
                                        const int* __restrict__ tile_expert, const int* __restrict__ n_tiles, int TM,
                                        long long rows, int N) {
    GRID_DEP_ENTRY();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * N) return;
    const long long r = i / N;
    const int n = (int)(i - r * N);
    const long long t = r / TM;
    if (t >= *n_tiles) return;
    float v = sum3(Y3, r, n, TM, N);
    if (S2 != nullptr) v *= S2[(long long)tile_expert[t] * per + n / s2_rows];
    Y[i] = v;
}

// pad[start[t] + j] = t * TM + j for every valid tile t and j < count[t] (one thread per padded row).
extern "C" __global__ void pad_of_sorted(const int* __restrict__ tile_start, const int* __restrict__ tile_count,
                                         const int* __restrict__ n_tiles, int TM, long long rows,
                                         int* __restrict__ pad) {
    GRID_DEP_ENTRY();
    const long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const long long t = r / TM;
    if (t >= *n_tiles) return;
    const int j = (int)(r - t * TM);
    if (j < tile_count[t]) pad[tile_start[t] + j] = (int)r;
}

// slot_pad[s] = pad[slot_pos[s]] (-1 stays -1): the padded row of each original slot (moe_combine's slot_pos).
extern "C" __global__ void slot_pad(const int* __restrict__ slot_pos, const int* __restrict__ pad, int S,
                                    int* __restrict__ out) {
    GRID_DEP_ENTRY();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= S) return;
    const int p = slot_pos[s];
    out[s] = p >= 0 ? pad[p] : -1;
}

// ptrs [nw + 2][count] (device addresses) of the cublasGemmBatchedEx calls over tiles t0 .. t0 + count - 1 of the
// tile table (i = t - t0): A_j = W + j * a_part + slot(t) * a_stride (j < nw: the weight parts), B = B + t * b_tile,
// C = C + t * c_tile (bytes; b_tile / c_tile cover a tile's three activation parts). windowed == 0: slot(t) =
// tile_expert[t] (W is the whole stack). windowed: W is a scratch of nslots dequantised experts; slot(t) = the number
// of expert changes among tiles t0 .. t (tiles are sorted by expert, so a window of count tiles uses at most
// min(count, E) = nslots slots) and slot_expert[slot] = that expert (-1: unused slot). Tiles past n_tiles use slot 0
// (computed, never read). One block.
extern "C" __global__ void tile_ptrs(const int* __restrict__ tile_expert, const int* __restrict__ n_tiles, int t0,
                                     int count, int windowed, int* __restrict__ slot_expert, int nslots,
                                     unsigned long long W, long long a_stride, long long a_part, int nw,
                                     unsigned long long B, long long b_tile, unsigned long long C, long long c_tile,
                                     unsigned long long* __restrict__ ptrs) {
    GRID_DEP_ENTRY();
    const int nt = *n_tiles;
    if (windowed) {
        for (int s = threadIdx.x; s < nslots; s += blockDim.x) slot_expert[s] = -1;
        __syncthreads();
    }
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int t = t0 + i;
        long long slot = 0;
        if (t < nt) {
            if (windowed) {
                int d = 0;
                for (int u = t0 + 1; u <= t; ++u) d += tile_expert[u] != tile_expert[u - 1];
                if (i == 0 || tile_expert[t] != tile_expert[t - 1]) slot_expert[d] = tile_expert[t];
                slot = d;
            } else {
                slot = tile_expert[t];
            }
        }
        for (int j = 0; j < nw; ++j)
            ptrs[(long long)j * count + i] = W + (unsigned long long)(j * a_part + slot * a_stride);
        ptrs[(long long)nw * count + i] = B + (unsigned long long)(t * (long long)b_tile);
        ptrs[(long long)(nw + 1) * count + i] = C + (unsigned long long)(t * (long long)c_tile);
    }
}
