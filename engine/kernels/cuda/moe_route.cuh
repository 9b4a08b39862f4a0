// The MoE router's softmax + top-k of one token (the one implementation: dense_moe.cu's router_topk, one block per
// token; moe_decode.cu's router launch, its last block token after token). No host headers.
#pragma once

__device__ __forceinline__ bool moe_better(float pa, int ia, float pb, int ib) {
    // canonical order: higher probability first, then the lower expert id
    return pa > pb || (pa == pb && ia < ib);
}

// the block's shared scratch besides the E probabilities (two buffers of warp partials: one barrier per step)
struct MoeTopkShared {
    float v[2][32];
    int i[2][32];
    float top_p[64];
};

__device__ __forceinline__ void moe_argmax_warp(float& p, int& i) {
    for (int off = 16; off > 0; off >>= 1) {
        const float op = __shfl_xor_sync(0xffffffffu, p, off);
        const int oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (moe_better(op, oi, p, i)) { p = op; i = oi; }
    }
}

// Softmax over the E logits l (read with ld.cg: another block of the same launch may have written them), then k
// rounds of arg-max in the canonical order, then the optional renormalisation; out_ids[j] / out_w[j] for j < k.
// Every thread of the block calls it (any multiple of 32 threads up to 1024; the launches use 256). The sums' order
// is fixed by the block size alone: thread i adds e = i, i + blockDim, ... in order, each warp reduces by an xor
// butterfly, then the warp sums by the same butterfly (lanes past the warp count add 0), each warp redundantly; the
// maximum and the arg-max are exact in any order (moe_better is a total order). Each thread keeps the
// probabilities of its own entries (probs: E floats of shared memory, only the owner reads or writes an entry), so a
// round takes one barrier: the warp winners go to alternating buffers of sh and every warp reduces them. Ends with a
// barrier (probs and sh are free on return). Requires 1 <= k <= min(E, 64).
__device__ __forceinline__ void moe_topk_block(const float* l, int E, int k, int renorm, int* out_ids, float* out_w,
                                               float* probs, MoeTopkShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float m = __int_as_float(0xff800000);
    for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, __ldcg(l + e));
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) sh.v[0][warp] = m;
    __syncthreads();
    m = lane < nw ? sh.v[0][lane] : __int_as_float(0xff800000);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float s = 0.f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float x = expf(__ldcg(l + e) - m);
        probs[e] = x;
        s += x;
    }
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) sh.v[1][warp] = s;
    __syncthreads();
    float total = lane < nw ? sh.v[1][lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    for (int e = threadIdx.x; e < E; e += blockDim.x) probs[e] = probs[e] / total;
    for (int j = 0; j < k; ++j) {
        const int b = j & 1;  // round j - 1 read the other buffer; round j - 2's readers of this one passed a barrier
        float bp = -2.f;
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            const float p = probs[e];
            if (p >= 0.f && moe_better(p, e, bp, bi)) { bp = p; bi = e; }
        }
        moe_argmax_warp(bp, bi);
        if (lane == 0) { sh.v[b][warp] = bp; sh.i[b][warp] = bi; }
        __syncthreads();
        bp = lane < nw ? sh.v[b][lane] : -2.f;
        bi = lane < nw ? sh.i[b][lane] : 0x7fffffff;
        moe_argmax_warp(bp, bi);
        if (threadIdx.x == 0) { out_ids[j] = bi; sh.top_p[j] = bp; }
        if (bi >= 0 && bi < E && bi % blockDim.x == threadIdx.x) probs[bi] = -1.f;  // taken (its owner marks it)
    }
    if (threadIdx.x == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) sum += sh.top_p[j];
        for (int j = 0; j < k; ++j) out_w[j] = renorm ? sh.top_p[j] / sum : sh.top_p[j];
    }
    __syncthreads();
}
