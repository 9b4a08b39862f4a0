// The MoE router's softmax + top-k of one token (the one implementation: dense_moe.cu's router_topk, one 64-thread
// block per token; moe_decode.cu's router launch, its last block, up to 4 tokens side by side). No host headers.
#pragma once

__device__ __forceinline__ bool moe_better(float pa, int ia, float pb, int ib) {
    // canonical order: higher probability first, then the lower expert id
    return pa > pb || (pa == pb && ia < ib);
}

// Threads per token: fixes every sum's order, so a token's bits never depend on how many tokens run beside it.
constexpr int MOE_TOPK_GROUP = 64;
constexpr int MOE_TOPK_GROUPS_MAX = 4;  // groups of a 256-thread block

// a block's scratch besides the E probabilities of each group (two buffers of warp partials: one barrier a step)
struct MoeTopkShared {
    float v[MOE_TOPK_GROUPS_MAX][2][MOE_TOPK_GROUP / 32];
    int i[MOE_TOPK_GROUPS_MAX][2][MOE_TOPK_GROUP / 32];
    float top_p[MOE_TOPK_GROUPS_MAX][64];
};

__device__ __forceinline__ void moe_argmax_warp(float& p, int& i) {
    for (int off = 16; off > 0; off >>= 1) {
        const float op = __shfl_xor_sync(0xffffffffu, p, off);
        const int oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (moe_better(op, oi, p, i)) { p = op; i = oi; }
    }
}

// the group's barrier (named barrier 1 + group: the other groups of the block run on)
__device__ __forceinline__ void moe_group_sync(int group) {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(MOE_TOPK_GROUP) : "memory");
}

// Softmax over the E logits l (read with ld.cg: another block of the same launch may have written them), then k
// rounds of arg-max in the canonical order, then the optional renormalisation: out_ids[j] / out_w[j] for j < k.
// Run by the MOE_TOPK_GROUP threads of group `group` (threads 64 group .. 64 group + 63 of the block). The sums'
// order is fixed by the group size alone: thread i of the group adds e = i, i + 64, ... in order, each warp reduces
// by an xor butterfly, then the two warp sums by the same butterfly (lanes past the warp count add 0), each warp
// redundantly; the maximum and the arg-max are exact in any order (moe_better is a total order). Each thread keeps
// the probabilities of its own entries (probs: the group's E floats of shared memory, only the owner reads or
// writes an entry), so a round takes one group barrier: the warp winners go to alternating buffers of sh and every
// warp reduces them. Ends with a group barrier (probs and the group's part of sh are free on return).
// Requires 1 <= k <= min(E, 64).
__device__ __forceinline__ void moe_topk_group(const float* l, int E, int k, int renorm, int* out_ids, float* out_w,
                                               float* probs, MoeTopkShared& sh, int group) {
    constexpr int G = MOE_TOPK_GROUP, NW = MOE_TOPK_GROUP / 32;
    const int tid = threadIdx.x - G * group, lane = threadIdx.x & 31, warp = tid >> 5;
    float m = __int_as_float(0xff800000);
    for (int e = tid; e < E; e += G) m = fmaxf(m, __ldcg(l + e));
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) sh.v[group][0][warp] = m;
    moe_group_sync(group);
    m = lane < NW ? sh.v[group][0][lane] : __int_as_float(0xff800000);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float s = 0.f;
    for (int e = tid; e < E; e += G) {
        const float x = expf(__ldcg(l + e) - m);
        probs[e] = x;
        s += x;
    }
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) sh.v[group][1][warp] = s;
    moe_group_sync(group);
    float total = lane < NW ? sh.v[group][1][lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    for (int e = tid; e < E; e += G) probs[e] = probs[e] / total;
    for (int j = 0; j < k; ++j) {
        const int b = j & 1;  // round j - 1 read the other buffer; round j - 2's readers of this one passed a barrier
        float bp = -2.f;
        int bi = 0x7fffffff;
        for (int e = tid; e < E; e += G) {
            const float p = probs[e];
            if (p >= 0.f && moe_better(p, e, bp, bi)) { bp = p; bi = e; }
        }
        moe_argmax_warp(bp, bi);
        if (lane == 0) { sh.v[group][b][warp] = bp; sh.i[group][b][warp] = bi; }
        moe_group_sync(group);
        bp = lane < NW ? sh.v[group][b][lane] : -2.f;
        bi = lane < NW ? sh.i[group][b][lane] : 0x7fffffff;
        moe_argmax_warp(bp, bi);
        if (tid == 0) { out_ids[j] = bi; sh.top_p[group][j] = bp; }
        if (bi >= 0 && bi < E && bi % G == tid) probs[bi] = -1.f;  // taken (its owner marks it)
    }
    if (tid == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) sum += sh.top_p[group][j];
        for (int j = 0; j < k; ++j) out_w[j] = renorm ? sh.top_p[group][j] / sum : sh.top_p[group][j];
    }
    moe_group_sync(group);
}
