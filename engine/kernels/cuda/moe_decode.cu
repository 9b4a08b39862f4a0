// The MoE block of a decode step (1..16 tokens) in three launches (engine/kernels/moe.py, _moe_block_decode):
//
//   moe_router_<rf>_t<MT>          : router logits [T, E] (warps split K of a row, partials added in a fixed order)
//                                    and the shared expert's gate logit; the block that finishes last (a
//                                    self-resetting ticket: CUDA-graph safe) runs the top-k of every token
//                                    (moe_route.cuh's moe_topk_block, the whole block on one token after another:
//                                    router_topk's code and bits) and the item table: the distinct selected experts in ascending id, each
//                                    with its tokens (ascending) and their slots s = t * k + j.
//   moe_gate_up_<fr>_<fs>_t<MT>    : h = silu(gate . x) * (up . x) for every (item, token) and for the shared expert
//                                    (its blocks first), each expert's weight rows read once for all its tokens.
//   moe_down_<fr>_<fs>_t<MT>       : by output rows: a block owns 8 rows of every item and of the shared expert,
//                                    y = down . h for each (item, token) into shared memory, then writes
//                                    out[t, n] = sum_j w[t, j] * y[t * k + j, n] + sigmoid(g[t]) * ys[t, n]
//                                    (slots in order j, then the shared expert: the grouped chain's combine).
//
// rf: router weight format (f32, bf16); fr / fs: routed / shared expert format (bf16, fp8, nvfp4); MT: the token
// bound (1, 4, 16) the accumulators are sized for (count <= MT tokens per item). Every sum's order depends on the
// format and K only (a slot of G lanes, chunks q, q + CS, ...; a fixed xor butterfly; the combine in order j): never
// on the other tokens of the step, so a token's result is the same whatever else is in the batch. No float
// atomics; the router's ticket is an integer counter reset by the block that takes the last ticket.
//
// Weights: the stored formats' streaming loaders of gemv_quant2.cuh (FP8S, NVFP4S: decode8, exactly the reference
// reader's values) and the BF16 / float32 readers below; activations and accumulation float32. Requires K % 32 == 0
// for NVFP4, K % 16 == 0 and cb % 16 == 0 for FP8, K % 8 == 0 otherwise, 16-byte aligned weights and activations
// (the host checks and runs the grouped chain otherwise).
//
// Module split (NVRTC time): NVRTC builds one module per (fr, fs) pair with -DMOE_FR=<i> -DMOE_FS=<i> (that pair's
// gate_up and down entries) and one without (the router entries), each on first use (dense_common.py:
// kernel_module_options). nvcc (tests/engine/test_engine_nvcc.py) compiles everything.
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

// gemv_quant.cuh: u8 and common.cuh (e4m3_to_f32, e2m1_to_f32, dot8, block_sum); gemv_quant2.cuh: FP8S, NVFP4S,
// ld_stream16; gemv_dense.cuh: bf16_lo, bf16_hi; moe_route.cuh: moe_topk_block
#include "grid_dep.cuh"
#include "gemv_quant.cuh"
#include "gemv_quant2.cuh"
#include "gemv_dense.cuh"
#include "moe_route.cuh"

struct BF16S {  // BF16 streaming reader (chunk = 8 weights = 16 bytes)
    const unsigned short* Q;
    long long q_es;
    static constexpr int EPL = 8;
    struct Raw {
        uint4 v;
    };
    __device__ __forceinline__ float row_scale(long long, int) const { return 1.f; }
    __device__ __forceinline__ Raw raw(long long e, int n, int c, int K) const {
        Raw r;
        r.v = ld_stream16(Q + e * q_es + (long long)n * K + (long long)c * 8);
        return r;
    }
    __device__ __forceinline__ void decode8(const Raw& r, int, float, float* w) const {
        w[0] = bf16_lo(r.v.x); w[1] = bf16_hi(r.v.x); w[2] = bf16_lo(r.v.y); w[3] = bf16_hi(r.v.y);
        w[4] = bf16_lo(r.v.z); w[5] = bf16_hi(r.v.z); w[6] = bf16_lo(r.v.w); w[7] = bf16_hi(r.v.w);
    }
};

struct F32S {  // float32 streaming reader (chunk = 8 weights = 2 x 16 bytes): the float32 router
    const float* Q;
    static constexpr int EPL = 8;
    struct Raw {
        uint4 a, b;
    };
    __device__ __forceinline__ float row_scale(long long, int) const { return 1.f; }
    __device__ __forceinline__ Raw raw(long long, int n, int c, int K) const {
        Raw r;
        const float* p = Q + (long long)n * K + (long long)c * 8;
        r.a = ld_stream16(p);
        r.b = ld_stream16(p + 4);
        return r;
    }
    __device__ __forceinline__ void decode8(const Raw& r, int, float, float* w) const {
        w[0] = __uint_as_float(r.a.x); w[1] = __uint_as_float(r.a.y); w[2] = __uint_as_float(r.a.z);
        w[3] = __uint_as_float(r.a.w); w[4] = __uint_as_float(r.b.x); w[5] = __uint_as_float(r.b.y);
        w[6] = __uint_as_float(r.b.z); w[7] = __uint_as_float(r.b.w);
    }
};

// acc[r][t] = deq(W_e)[nr[r], :] . X[xo[t] :][:K] for t < count (xo: element offsets of the activation rows). The lane with index q (0 <= q < CS) of a group of CS
// lanes covering K takes chunks q, q + CS, q + 2 CS, ...; U chunks x RL rows are loaded before any is decoded (all
// in flight). The G lanes of a slot (lanes of one warp) are then added by an xor butterfly: every lane of the slot
// holds the slot's partial sum (CS > G: the caller adds the CS / G warps' partials in a fixed order).
template <typename LD, int MT, int G, int CS, int RL, int U>
__device__ __forceinline__ void moe_rows_dot(const LD& ld, long long e, const int (&nr)[RL], const float* __restrict__ X,
                                             const int (&xo)[MT], int count, int K, int q, float (&acc)[RL][MT]) {
    constexpr int EPL = LD::EPL;
    float g[RL];
#pragma unroll
    for (int r = 0; r < RL; ++r) {
        g[r] = ld.row_scale(e, nr[r]);
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] = 0.f;
    }
    const int KC = K / EPL;
    for (int c0 = q; c0 < KC; c0 += U * CS) {
        typename LD::Raw raw[U][RL];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c0 + u * CS < KC) {
#pragma unroll
                for (int r = 0; r < RL; ++r) raw[u][r] = ld.raw(e, nr[r], c0 + u * CS, K);
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + u * CS;
            if (c < KC) {
#pragma unroll
                for (int p = 0; p < EPL / 8; ++p) {
                    float w[RL][8];
#pragma unroll
                    for (int r = 0; r < RL; ++r) ld.decode8(raw[u][r], p, g[r], w[r]);
#pragma unroll
                    for (int t = 0; t < MT; ++t)
                        if (t < count) {
                            const float4* xp = reinterpret_cast<const float4*>(X + xo[t] + c * EPL + 8 * p);
                            const float4 xa = xp[0], xb = xp[1];
#pragma unroll
                            for (int r = 0; r < RL; ++r) acc[r][t] += dot8(w[r], xa, xb);
                        }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RL; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int off = G / 2; off > 0; off >>= 1) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], off);
}

// A block's ticket: true in the one block that arrives last of `expected` (after every block's writes are visible).
// The last block resets the counter, so the next launch (or graph replay) starts from zero.
__device__ __forceinline__ bool moe_last_block(unsigned int* counter, unsigned int expected) {
    __shared__ int last;
    __threadfence();  // this block's results, before its ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int t = atomicAdd(counter, 1u);
        last = t == expected - 1u;
        if (last) *counter = 0u;
    }
    __syncthreads();
    if (last) __threadfence();  // the other blocks' results, before this block reads them
    return last;
}

// ---------------------------------------------------------------------------------------------------------------
// Launch 1: router + shared gate + top-k + item table. Grid: ceil(E / 2) + 1 blocks of 256 threads (2 router rows per
// block, 4 warps split K of a row; the last block the shared gate logit); dynamic shared memory E floats.
constexpr int MOE_ROUTER_KS = 4;  // warps per router row

template <typename LD, int MT>
__device__ __forceinline__ void moe_router_body(const LD& ld, const float* __restrict__ x, int T, int E, int H, int k,
                                                int renorm, const void* sgate, int sgate_bf16,
                                                float* __restrict__ logits, float* __restrict__ sg_logit,
                                                int* __restrict__ ids, float* __restrict__ wts,
                                                int* __restrict__ n_items, int* __restrict__ item_expert,
                                                int* __restrict__ item_count, int* __restrict__ item_tok,
                                                int* __restrict__ item_slot, unsigned int* counter) {
    extern __shared__ float moe_dyn[];
    __shared__ float part[8][MT];
    __shared__ float red[33];
    __shared__ int sids[1024];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (blockIdx.x < gridDim.x - 1) {
        const int ks = warp % MOE_ROUTER_KS;
        const int n = blockIdx.x * (8 / MOE_ROUTER_KS) + warp / MOE_ROUTER_KS;
        const int nr[1] = {n < E ? n : E - 1};
        int xo[MT];
#pragma unroll
        for (int t = 0; t < MT; ++t) xo[t] = (t < T ? t : 0) * H;
        float acc[1][MT];
        moe_rows_dot<LD, MT, 32, 32 * MOE_ROUTER_KS, 1, 4>(ld, 0, nr, x, xo, T, H, ks * 32 + lane, acc);
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < MT; ++t) part[warp][t] = acc[0][t];
        }
        __syncthreads();
        if (ks == 0 && lane < T && n < E) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < MOE_ROUTER_KS; ++w) s += part[warp + w][lane < MT ? lane : 0];
            logits[(long long)lane * E + n] = s;
        }
    } else if (sgate != nullptr) {  // the shared expert's gate logit, g[t] = sgate . x[t]
        for (int t = 0; t < T; ++t) {
            float s = 0.f;
            for (int i = threadIdx.x; i < H; i += blockDim.x)
                s += (sgate_bf16 ? __uint_as_float(((unsigned int)((const unsigned short*)sgate)[i]) << 16)
                                 : ((const float*)sgate)[i]) * x[(long long)t * H + i];
            s = block_sum(s, red);
            if (threadIdx.x == 0) sg_logit[t] = s;
        }
    }
    if (!moe_last_block(counter, gridDim.x)) return;
    // top-k of every token (router_topk's semantics, bits for the same logits)
    __shared__ MoeTopkShared tk;
    for (int t = 0; t < T; ++t)  // ends with a barrier: moe_dyn is free after it
        moe_topk_block(logits + (long long)t * E, E, k, renorm, ids + (long long)t * k, wts + (long long)t * k, moe_dyn,
                       tk);
    // item table: distinct experts ascending, tokens ascending within an expert. Per slot s (s = t * k + j), from the
    // S selected ids alone (no pass over the E experts): s is its expert's first slot when no earlier slot chose it;
    // the expert's item is the number of distinct valid experts below it; its rank among the expert's tokens is the
    // number of earlier slots that chose it (an expert appears once per token)
    const int S = T * k;
    __shared__ int first[1024];  // S <= 1024 (the host's bound), as sids
    for (int s = threadIdx.x; s < S; s += blockDim.x) sids[s] = __ldcg(ids + s);
    __syncthreads();
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        const int e = sids[s];
        int f = e >= 0 && e < E;
        for (int q = 0; q < s && f; ++q) f = sids[q] != e;
        first[s] = f;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        const int e = sids[s];
        if (e < 0 || e >= E) continue;
        int it = 0, count = 0, rank = 0;
        for (int q = 0; q < S; ++q) {
            const int eq = sids[q];
            it += first[q] && eq < e;
            count += eq == e;
            rank += eq == e && q < s;
        }
        if (first[s]) {
            item_expert[it] = e;
            item_count[it] = count;
        }
        item_tok[it * MT + rank] = s / k;
        item_slot[it * MT + rank] = s;
    }
    if (threadIdx.x == 0) {
        int n = 0;
        for (int q = 0; q < S; ++q) n += first[q];
        *n_items = n;
    }
}

#define MOE_ROUTER_ARGS                                                                                          \
    const float *x, int T, int E, int H, int k, int renorm, const void *sgate, int sgate_bf16,                    \
        float *logits, float *sg_logit, int *ids, float *wts, int *n_items, int *item_expert, int *item_count,    \
        int *item_tok, int *item_slot, unsigned int *counter
#define MOE_ROUTER_PASS                                                                                          \
    x, T, E, H, k, renorm, sgate, sgate_bf16, logits, sg_logit, ids, wts, n_items, item_expert,                   \
        item_count, item_tok, item_slot, counter

#define MOE_ROUTER_ENTRY(MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) moe_router_f32_t##MT(const float* W, MOE_ROUTER_ARGS) { GRID_DEP_ENTRY();    \
        F32S ld{W};                                                                                              \
        moe_router_body<F32S, MT>(ld, MOE_ROUTER_PASS);                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) moe_router_bf16_t##MT(const unsigned short* W,            \
                                                                            MOE_ROUTER_ARGS) { GRID_DEP_ENTRY(); \
        BF16S ld{W, 0};                                                                                          \
        moe_router_body<BF16S, MT>(ld, MOE_ROUTER_PASS);                                                         \
    }

// ---------------------------------------------------------------------------------------------------------------
// Launch 2: gate_up + SwiGLU. 1-D grid of 256-thread blocks: the shared expert's blocks first (when present: its
// BF16 rows are the longest tasks), then ceil(I / SL) blocks per item slot (max_items of them). A block owns SL
// consecutive outputs n of one item (rows n and N + n of its stacked gate_up); its 8 warps split K (warp ks takes
// chunks ks * G + q + j * 8 G), and each warp is SL = 32 / G slots of G lanes, one output a slot. G per format
// (MoeGuShape: 16 BF16, 8 FP8, 4 NVFP4) so that a lane's activation loads of one instruction touch G / 2 .. 4 cache
// lines: with all 32 lanes on one row (the layout before) each x load touched 32 lines, and the L1 was the limit.
// The 8 warp partials of an output are added in shared memory in ks order, then SwiGLU.
template <typename LD>
struct MoeGuShape;
template <>
struct MoeGuShape<BF16S> {  // K = 2560: 320 chunks, 2.5 a lane
    static constexpr int G = 16, U = 3;
};
template <>
struct MoeGuShape<FP8S> {  // 160 chunks
    static constexpr int G = 8, U = 3;
};
template <>
struct MoeGuShape<NVFP4S> {  // 80 chunks
    static constexpr int G = 4, U = 3;
};
template <typename LD>
__host__ __device__ constexpr int moe_gu_slots() { return 32 / MoeGuShape<LD>::G; }

// The block's SL outputs n0 .. n0 + SL - 1 of expert e (loader ld; N its intermediate width) for the tokens tok[0 ..
// count) of x ([*, H]); h[out_row[t] * N + n] = silu(gate) * up. red: shared scratch of 8 * 8 * 2 * MT floats. Every
// thread of the block calls it (it has a barrier).
template <typename LD, int MT>
__device__ __forceinline__ void moe_gu_block(const LD& ld, long long e, int n0, int N, int H,
                                             const float* __restrict__ x, const int* tok, int count,
                                             float* __restrict__ out, const int* out_row, float* red) {
    constexpr int G = MoeGuShape<LD>::G, SL = 32 / G;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slot = lane / G, q = lane % G;
    const int n = n0 + slot;
    const int nc = n < N ? n : N - 1;  // clamped: loads stay in bounds, the result is not written
    const int nr[2] = {nc, N + nc};
    int xo[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) xo[t] = (t < count ? tok[t] : 0) * H;
    float acc[2][MT];
    moe_rows_dot<LD, MT, G, 8 * G, 2, MoeGuShape<LD>::U>(ld, e, nr, x, xo, count, H, warp * G + q, acc);
    if (q == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int t = 0; t < MT; ++t) red[((warp * SL + slot) * 2 + r) * MT + t] = acc[r][t];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < SL * MT; i += blockDim.x) {
        const int sl = i / MT, t = i % MT, no = n0 + sl;
        if (t >= count || no >= N) continue;
        float g = 0.f, u = 0.f;
#pragma unroll
        for (int w = 0; w < 8; ++w) {  // the K split's partials in order
            g += red[((w * SL + sl) * 2 + 0) * MT + t];
            u += red[((w * SL + sl) * 2 + 1) * MT + t];
        }
        out[(long long)out_row[t] * N + no] = (g / (1.f + expf(-g))) * u;  // dense_moe.cu moe_swiglu
    }
}

// The accumulators a block of an item with `count` tokens runs with: 1, 4 or MT (the entry's bound), chosen at run
// time, so that the common items of a 16-token step (one or two tokens each) run the light body; the order of every
// sum is the same in all three (batch invariance).
#define MOE_BY_COUNT(count, MT, CALL)                                                                             \
    do {                                                                                                         \
        if ((count) <= 1) {                                                                                      \
            constexpr int MC = 1;                                                                                \
            CALL;                                                                                                \
        } else if ((MT) > 4 && (count) <= 4) {                                                                   \
            constexpr int MC = (MT) > 4 ? 4 : (MT);                                                              \
            CALL;                                                                                                \
        } else {                                                                                                 \
            constexpr int MC = (MT);                                                                             \
            CALL;                                                                                                \
        }                                                                                                        \
    } while (0)

template <typename LR, typename LS, int MT>
__device__ __forceinline__ void moe_gate_up_body(const LR& lr, const LS& ls, int has_shared, const float* __restrict__ x,
                                                 int T, int H, int I, int Is, const int* __restrict__ n_items,
                                                 const int* __restrict__ item_expert,
                                                 const int* __restrict__ item_count, const int* __restrict__ item_tok,
                                                 const int* __restrict__ item_slot, float* __restrict__ h,
                                                 float* __restrict__ hs) {
    __shared__ float red[8 * 8 * 2 * MT];  // 8 warps x at most 8 slots x (gate, up) x tokens
    constexpr int SLR = moe_gu_slots<LR>(), SLS = moe_gu_slots<LS>();
    const int nbs = has_shared ? (Is + SLS - 1) / SLS : 0, nbr = (I + SLR - 1) / SLR;
    const int b = blockIdx.x;
    if (b < nbs) {
        int tok[MT];
#pragma unroll
        for (int t = 0; t < MT; ++t) tok[t] = t;
        MOE_BY_COUNT(T, MT, (moe_gu_block<LS, MC>(ls, 0, b * SLS, Is, H, x, tok, T, hs, tok, red)));
        return;
    }
    const int item = (b - nbs) / nbr, n0 = (b - nbs) % nbr * SLR;
    // the item's table entries are read beside n_items, not after it (one round trip: item < max_items, so every
    // entry is inside the tables; those of a missing item are never used)
    const int ni = *n_items, count = item_count[item];
    const long long e = item_expert[item];
    int tok[MT], slot[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int a = item_tok[item * MT + t], c = item_slot[item * MT + t];
        tok[t] = t < count ? a : 0;
        slot[t] = t < count ? c : 0;
    }
    if (item >= ni) return;  // the whole block
    MOE_BY_COUNT(count, MT, (moe_gu_block<LR, MC>(lr, e, n0, I, H, x, tok, count, h, slot, red)));
}

// ---------------------------------------------------------------------------------------------------------------
// Launch 3: down + combine, by output rows. Grid: ceil(H / 8) blocks of 256 threads; block b owns output rows
// [8 b, 8 b + 8) of every item and of the shared expert, so it holds every term of its outputs and writes
// out[t, n] itself: no tickets, no y in global memory. A warp task is one item (or the shared expert) over the block's
// 8 rows: the warp is 32 / G slots of G lanes, a slot owns RL = 8 G / 32 of the rows, and a row's G lanes cover K
// (G, U: the format's MoeDownShape, sized so that one pass of U chunks covers a real-width row of 640 for the 8- and
// 4-bit formats: every load of a lane in flight at once). Warp w takes tasks w, w + 8, ...; the results go to shared memory, then the block adds
// out[t, n] = sum_j w[t, j] * y[t * k + j, n] + sigmoid(g[t]) * ys[t, n] (slots in order j, then the shared expert:
// the grouped chain's combine). A slot no item wrote (a token whose top-k found no valid expert: NaN router logits)
// stays NaN, so the fault shows in the output.
constexpr int MOE_DOWN_ROWS = 8;

template <typename LD>
struct MoeDownShape;
template <>
struct MoeDownShape<BF16S> {  // 8 weights a chunk: 80 chunks of a 640 row, 16 lanes x 3 in two passes; 2 of a
    static constexpr int G = 16, U = 3, RP = 2;  // slot's 4 rows at a time (registers)
};
template <>
struct MoeDownShape<FP8S> {  // 16 weights a chunk: 40 chunks, 8 lanes x 5; a slot's 2 rows at once
    static constexpr int G = 8, U = 5, RP = 2;
};
template <>
struct MoeDownShape<NVFP4S> {  // 32 weights a chunk: 20 chunks, 4 lanes x 5; a slot's 1 row
    static constexpr int G = 4, U = 5, RP = 1;
};

// One warp task: rows n0 .. n0 + 7 of expert e (loader ld) against the activation rows rows[0 .. count) of hin
// ([*, K]; rows == nullptr: rows 0 .. count - 1); row r's result for token t goes to dst[rows[t] * 8 + r] (shared
// memory). A slot's RL rows are taken RP at a time: passes pass0 .. pass1 - 1 of them.
template <typename LD, int MT>
__device__ __forceinline__ void moe_down_task(const LD& ld, long long e, int n0, int H, int K,
                                              const float* __restrict__ hin, const int* rows, int count, float* dst,
                                              int pass0, int pass1) {
    constexpr int G = MoeDownShape<LD>::G, U = MoeDownShape<LD>::U, RP = MoeDownShape<LD>::RP;
    constexpr int RL = MOE_DOWN_ROWS * G / 32;
    static_assert(RL % RP == 0, "a slot's rows in whole passes");
    const int lane = threadIdx.x & 31, slot = lane / G;
    int xo[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int rt = rows != nullptr ? rows[t] : t;  // read whatever count is (inside the table): no wait on it
        xo[t] = (t < count ? rt : 0) * K;
    }
#pragma unroll 1
    for (int r0 = pass0 * RP; r0 < RL && r0 < pass1 * RP; r0 += RP) {
        int nr[RP];
#pragma unroll
        for (int r = 0; r < RP; ++r) {
            const int n = n0 + slot * RL + r0 + r;
            nr[r] = n < H ? n : H - 1;  // clamped: loads stay in bounds, the combine does not write it
        }
        float acc[RP][MT];
        moe_rows_dot<LD, MT, G, G, RP, U>(ld, e, nr, hin, xo, count, K, lane % G, acc);
        if (lane % G == 0) {
#pragma unroll
            for (int r = 0; r < RP; ++r)
#pragma unroll
                for (int t = 0; t < MT; ++t)
                    if (t < count)
                        dst[(rows != nullptr ? rows[t] : t) * MOE_DOWN_ROWS + slot * RL + r0 + r] = acc[r][t];
        }
    }
}

template <typename LR, typename LS, int MT>
__device__ __forceinline__ void moe_down_body(const LR& lr, const LS& ls, int has_shared, int T, int H, int I, int Is,
                                              int k, const int* __restrict__ n_items,
                                              const int* __restrict__ item_expert, const int* __restrict__ item_count,
                                              const int* __restrict__ item_slot, const float* __restrict__ h,
                                              const float* __restrict__ hs, const float* __restrict__ wts,
                                              const float* __restrict__ sg_logit, float* __restrict__ out) {
    extern __shared__ float moe_dyn[];
    float* ysh = moe_dyn;                              // [T * k][8]: the routed slots' rows
    float* ssh = moe_dyn + T * k * MOE_DOWN_ROWS;      // [T][8]: the shared expert's
    const int warp = threadIdx.x >> 5;
    const int n0 = blockIdx.x * MOE_DOWN_ROWS;
    for (int i = threadIdx.x; i < T * k * MOE_DOWN_ROWS; i += blockDim.x) ysh[i] = __int_as_float(0x7fc00000);
    __syncthreads();
    // the first task's entries beside n_items (the tables hold at least 8 items: entry `warp` exists)
    const int ni = *n_items, count0 = item_count[warp];
    const long long e0 = item_expert[warp];
    // warp-uniform tasks (the shuffles of moe_rows_dot see the whole warp): the routed items w, w + 8, ..., then the
    // shared expert (tokens 0 .. T - 1)
    for (int task = warp; task < ni; task += 8) {
        const int count = task == warp ? count0 : item_count[task];
        const long long e = task == warp ? e0 : item_expert[task];
        MOE_BY_COUNT(count, MT,
                     (moe_down_task<LR, MC>(lr, e, n0, H, I, h, item_slot + task * MT, count, ysh, 0, 8)));
    }
    if (has_shared) {  // pass i of the shared expert's rows on warp 7 - i (the last warps have the fewest items)
        constexpr int NP = MOE_DOWN_ROWS * MoeDownShape<LS>::G / 32 / MoeDownShape<LS>::RP;
        const int i = 7 - warp;
        if (i < NP) MOE_BY_COUNT(T, MT, (moe_down_task<LS, MC>(ls, 0, n0, H, Is, hs, nullptr, T, ssh, i, i + 1)));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < T * MOE_DOWN_ROWS; i += blockDim.x) {
        const int t = i / MOE_DOWN_ROWS, r = i % MOE_DOWN_ROWS, n = n0 + r;
        if (n >= H) continue;
        float acc = 0.f;  // dense_moe.cu moe_combine: slots in order j, then the gated shared expert
        for (int j = 0; j < k; ++j) acc += ysh[(t * k + j) * MOE_DOWN_ROWS + r] * wts[t * k + j];
        if (has_shared) {
            float g = sg_logit[t];
            acc += (1.f / (1.f + expf(-g))) * ssh[t * MOE_DOWN_ROWS + r];
        }
        out[(long long)t * H + n] = acc;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Entries. A format's loader arguments (the host passes them in this order; engine/kernels/moe.py _fmt_args):
//   bf16 : Q (u16), q_es; fp8 : Q, S, q_es, s_es, rb, cb, ncb; nvfp4 : Q, S, S2, q_es, s_es, s2_rows, s2_per_e.
#define MOE_bf16_ARGS(P) const unsigned short *P##Q, long long P##q_es
#define MOE_bf16_MAKE(P) BF16S P##ld{P##Q, P##q_es};
#define MOE_bf16_T BF16S
#define MOE_fp8_ARGS(P) \
    const u8 *P##Q, const float *P##S, long long P##q_es, long long P##s_es, int P##rb, int P##cb, int P##ncb
#define MOE_fp8_MAKE(P) FP8S P##ld{P##Q, P##S, P##q_es, P##s_es, P##rb, P##cb, P##ncb};
#define MOE_fp8_T FP8S
#define MOE_nvfp4_ARGS(P)                                                                                        \
    const u8 *P##Q, const u8 *P##S, const float *P##S2, long long P##q_es, long long P##s_es, int P##s2_rows,     \
        int P##s2_per_e
#define MOE_nvfp4_MAKE(P) NVFP4S P##ld{P##Q, P##S, P##S2, P##q_es, P##s_es, P##s2_rows, P##s2_per_e};
#define MOE_nvfp4_T NVFP4S

// Blocks per SM the register budget is sized for (streaming: occupancy keeps the loads in flight): 1 token <= 80
// registers, 4 and 16 tokens <= 128 (the 16-token body, run by items of 5+ tokens and the
// shared expert only, spills a little).
#define MOE_GU_MINB(MT) ((MT) == 1 ? 3 : 2)
#define MOE_DN_MINB(MT) ((MT) == 1 ? 3 : 2)

#define MOE_PAIR_ENTRIES(FR, FS, MT)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, MOE_GU_MINB(MT)) moe_gate_up_##FR##_##FS##_t##MT(                       \
        MOE_##FR##_ARGS(r_), MOE_##FS##_ARGS(s_), int has_shared, const float* x, int T, int H, int I, int Is,    \
        const int* n_items, const int* item_expert, const int* item_count, const int* item_tok,                   \
        const int* item_slot, float* h, float* hs) { GRID_DEP_ENTRY();                                           \
        MOE_##FR##_MAKE(r_) MOE_##FS##_MAKE(s_)                                                                  \
        moe_gate_up_body<MOE_##FR##_T, MOE_##FS##_T, MT>(r_ld, s_ld, has_shared, x, T, H, I, Is, n_items,         \
                                                         item_expert, item_count, item_tok, item_slot, h, hs);   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, MOE_DN_MINB(MT)) moe_down_##FR##_##FS##_t##MT(                          \
        MOE_##FR##_ARGS(r_), MOE_##FS##_ARGS(s_), int has_shared, int T, int H, int I, int Is, int k,             \
        const int* n_items, const int* item_expert, const int* item_count, const int* item_slot, const float* h,  \
        const float* hs, const float* wts, const float* sg_logit, float* out) { GRID_DEP_ENTRY();                 \
        MOE_##FR##_MAKE(r_) MOE_##FS##_MAKE(s_)                                                                  \
        moe_down_body<MOE_##FR##_T, MOE_##FS##_T, MT>(r_ld, s_ld, has_shared, T, H, I, Is, k, n_items,            \
                                                      item_expert, item_count, item_slot, h, hs, wts, sg_logit,  \
                                                      out);                                                      \
    }

#define MOE_PAIR(FR, FS) MOE_PAIR_ENTRIES(FR, FS, 1) MOE_PAIR_ENTRIES(FR, FS, 4) MOE_PAIR_ENTRIES(FR, FS, 16)

// format indices of -DMOE_FR / -DMOE_FS: 0 bf16, 1 fp8, 2 nvfp4 (engine/kernels/dense_common.py _MOE_FORMATS)
#if !defined(__CUDACC_RTC__) || !defined(MOE_FR)
MOE_ROUTER_ENTRY(1)
MOE_ROUTER_ENTRY(4)
MOE_ROUTER_ENTRY(16)
#endif
#if !defined(__CUDACC_RTC__)
#define MOE_SEL(a, b) 1
#elif defined(MOE_FR)
#define MOE_SEL(a, b) (MOE_FR == (a) && MOE_FS == (b))
#else
#define MOE_SEL(a, b) 0
#endif
#if MOE_SEL(0, 0)
MOE_PAIR(bf16, bf16)
#endif
#if MOE_SEL(0, 1)
MOE_PAIR(bf16, fp8)
#endif
#if MOE_SEL(0, 2)
MOE_PAIR(bf16, nvfp4)
#endif
#if MOE_SEL(1, 0)
MOE_PAIR(fp8, bf16)
#endif
#if MOE_SEL(1, 1)
MOE_PAIR(fp8, fp8)
#endif
#if MOE_SEL(1, 2)
MOE_PAIR(fp8, nvfp4)
#endif
#if MOE_SEL(2, 0)
MOE_PAIR(nvfp4, bf16)
#endif
#if MOE_SEL(2, 1)
MOE_PAIR(nvfp4, fp8)
#endif
#if MOE_SEL(2, 2)
MOE_PAIR(nvfp4, nvfp4)
#endif
