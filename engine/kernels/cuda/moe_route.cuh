// MoE routing device function of moe_decode.cu (the decode block's router kernel): softmax + top-k of one token
// per warp, bit-identical to dense_moe.cu's router_topk (256 threads) for the same logits. No host headers.
#pragma once

__device__ __forceinline__ bool moe_better(float pa, int ia, float pb, int ib) {
    // canonical order: higher probability first, then the lower expert id (dense_moe.cu's `better`)
    return pa > pb || (pa == pb && ia < ib);
}

// One warp: softmax + top-k of one token, bit-identical to dense_moe.cu's router_topk launched with 256 threads.
// router_topk's thread i (warp i / 32) sums e = i, i + 256, ... in order; its warps reduce by an xor butterfly
// and warp 0 reduces the 8 warp sums (lanes >= 8 contribute 0) by the same butterfly. Lane L here plays the 8
// threads 32 v + L (v = 0..7) and runs the same butterflies, so every sum is formed in the same order. Max and
// arg-max are exact in any order (the arg-max order `moe_better` is total). probs: this warp's E floats.
__device__ __forceinline__ void moe_topk_warp(const float* l, int E, int k, int renorm, int* out_ids, float* out_w,
                                              float* probs) {
    constexpr int VT = 8;  // warps of router_topk's 256-thread block
    const int lane = threadIdx.x & 31;
    float m = __int_as_float(0xff800000);
    for (int e = lane; e < E; e += 32) m = fmaxf(m, __ldcg(l + e));
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float ws[VT];
#pragma unroll
    for (int v = 0; v < VT; ++v) {
        float s = 0.f;
        for (int e = 32 * v + lane; e < E; e += 32 * VT) {
            float x = expf(__ldcg(l + e) - m);
            probs[e] = x;
            s += x;
        }
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        ws[v] = s;
    }
    float total = 0.f;
#pragma unroll
    for (int v = 0; v < VT; ++v)
        if (lane == v) total = ws[v];
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    for (int e = lane; e < E; e += 32) probs[e] = probs[e] / total;  // the entries this lane wrote
    __syncwarp();
    for (int j = 0; j < k; ++j) {
        float bp = -2.f;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            float p = probs[e];
            if (p >= 0.f && moe_better(p, e, bp, bi)) { bp = p; bi = e; }
        }
        for (int off = 16; off > 0; off >>= 1) {
            float op = __shfl_xor_sync(0xffffffffu, bp, off);
            int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (moe_better(op, oi, bp, bi)) { bp = op; bi = oi; }
        }
        if (lane == 0) {
            out_ids[j] = bi;
            out_w[j] = bp;  // the selected probability; renormalised below
            if (bi >= 0 && bi < E) probs[bi] = -1.f;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sum = 0.f;
        for (int j = 0; j < k; ++j) sum += out_w[j];
        for (int j = 0; j < k; ++j) out_w[j] = renorm ? out_w[j] / sum : out_w[j];
    }
}
