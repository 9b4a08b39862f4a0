// The MoE router's softmax + top-k of one token (the one implementation: dense_moe.cu's router_topk, one block per
// token; moe_decode.cu's router launch, its last block token after token). No host headers.
#pragma once

__device__ __forceinline__ bool moe_better(float pa, int ia, float pb, int ib) {
    // canonical order: higher probability first, then the lower expert id
    return pa > pb || (pa == pb && ia < ib);
}

// Blocks of at most MOE_TOPK_WARPS warps (the launches use 256 threads).
constexpr int MOE_TOPK_WARPS = 8;

// the block's shared scratch besides the E probabilities: the softmax's warp partials, each warp's k candidates
struct MoeTopkShared {
    float v[2][32];
    float cand_p[MOE_TOPK_WARPS * 64];
    int cand_i[MOE_TOPK_WARPS * 64];
    float top_p[64];
};

// A probability as the selection ranks it: NaN (an invalid router logit) below every probability
__device__ __forceinline__ float moe_rank_key(float p) { return p >= 0.f ? p : -1.f; }

// Softmax over the E logits l (read with ld.cg: another block of the same launch may have written them), then the
// top k in the canonical order, then the optional renormalisation; out_ids[j] / out_w[j] for j < k. Every thread of
// the block calls it (blockDim a multiple of 32, at most 32 * MOE_TOPK_WARPS). The sums' order is fixed by the block
// size alone: thread i adds e = i, i + blockDim, ... in order, each warp reduces by an xor butterfly, then the warp
// sums by the same butterfly (lanes past the warp count add 0), each warp redundantly. The selection ranks instead of
// taking k arg-maxes one after another (a chain of 2k reductions): moe_better is a total order, so each entry's rank
// (the entries better than it) is unique. Each warp ranks its own entries among themselves (thread i owns e = i,
// i + blockDim, ...: the warp's entries are read from shared memory, no barrier); those of rank < k are the warp's
// candidates (the block's top k are among the warps' candidates, as a warp holds at most k of them); after one
// barrier each candidate's rank among all candidates is its position j. A position whose entry has no valid
// probability (fewer than k valid entries) gets id 0x7fffffff and probability -2. Ends with a barrier (probs and sh
// are free on return). Requires 1 <= k <= min(E, 64).
__device__ __forceinline__ void moe_topk_block(const float* l, int E, int k, int renorm, int* out_ids, float* out_w,
                                               float* probs, MoeTopkShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float m = __int_as_float(0xff800000);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {  // the logits are read once (the owner keeps them in probs)
        const float x = __ldcg(l + e);
        probs[e] = x;
        m = fmaxf(m, x);
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) sh.v[0][warp] = m;
    __syncthreads();
    m = lane < nw ? sh.v[0][lane] : __int_as_float(0xff800000);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float s = 0.f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float x = expf(probs[e] - m);
        probs[e] = x;
        s += x;
    }
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) sh.v[1][warp] = s;
    __syncthreads();
    float total = lane < nw ? sh.v[1][lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    for (int e = threadIdx.x; e < E; e += blockDim.x) probs[e] = moe_rank_key(probs[e] / total);
    // the warp's candidate slots start empty (a warp may own fewer than k entries)
    for (int j = lane; j < k; j += 32) {
        sh.cand_p[warp * k + j] = -2.f;
        sh.cand_i[warp * k + j] = 0x7fffffff;
    }
    __syncwarp();
    // rank of each own entry among the warp's entries: e' = warp * 32 + q + a * blockDim for lanes q, rows a
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float p = probs[e];
        int rank = 0;
        for (int b = warp * 32; b < E; b += blockDim.x) {
            const int n = min(32, E - b);
            for (int q = 0; q < n; ++q) rank += moe_better(probs[b + q], b + q, p, e);
        }
        if (rank < k) {
            sh.cand_p[warp * k + rank] = p;
            sh.cand_i[warp * k + rank] = e;
        }
    }
    __syncthreads();
    // rank of each candidate among all candidates: its position
    const int nc = nw * k;
    for (int c = threadIdx.x; c < nc; c += blockDim.x) {
        const float p = sh.cand_p[c];
        const int i = sh.cand_i[c];
        int rank = 0;
        for (int d = 0; d < nc; ++d) rank += moe_better(sh.cand_p[d], sh.cand_i[d], p, i);
        if (rank < k) {
            const bool valid = p >= 0.f;
            out_ids[rank] = valid ? i : 0x7fffffff;
            sh.top_p[rank] = valid ? p : -2.f;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) sum += sh.top_p[j];
        for (int j = 0; j < k; ++j) out_w[j] = renorm ? sh.top_p[j] / sum : sh.top_p[j];
    }
    __syncthreads();
}
