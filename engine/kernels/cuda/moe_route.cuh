// MoE routing device functions of moe_route.cu (the decode chain's route kernel):
// softmax + top-k of one token per warp, bit-identical to dense_moe.cu's router_topk (256 threads), and the route
// tables of dense_moe.cu's moe_tables for one block. No host headers.
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

// Route tables for S = T * k slots (one block of any multiple of 32 threads up to 512, cnt: E ints of shared
// memory): dense_moe.cu moe_tables' counts, offsets and tile table, with the sorted position of a slot its rank
// among the earlier slots of its expert (deterministic; the results do not depend on the order anyway).
__device__ __forceinline__ void moe_tables_block(const int* ids, int S, int k, int E, int TM, int* cnt,
                                                 int* __restrict__ offsets, int* __restrict__ sorted_token,
                                                 int* __restrict__ slot_pos, int* __restrict__ tile_expert,
                                                 int* __restrict__ tile_start, int* __restrict__ tile_count,
                                                 int* __restrict__ n_tiles) {
    __shared__ int tsum[512];
    __shared__ int ttil[512];
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int e = tid; e < E; e += nt) cnt[e] = 0;
    __syncthreads();
    for (int s = tid; s < S; s += nt) {
        int e = ids[s];
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    const int chunk = (E + nt - 1) / nt;
    const int e0 = min(E, tid * chunk), e1 = min(E, e0 + chunk);
    int cs = 0, ct = 0;
    for (int e = e0; e < e1; ++e) { cs += cnt[e]; ct += (cnt[e] + TM - 1) / TM; }
    tsum[tid] = cs;
    ttil[tid] = ct;
    __syncthreads();
    for (int d = 1; d < nt; d <<= 1) {  // inclusive Hillis-Steele scan
        int a = tid >= d ? tsum[tid - d] : 0;
        int b = tid >= d ? ttil[tid - d] : 0;
        __syncthreads();
        tsum[tid] += a;
        ttil[tid] += b;
        __syncthreads();
    }
    int off = tsum[tid] - cs, toff = ttil[tid] - ct;
    for (int e = e0; e < e1; ++e) {
        int c = cnt[e];
        offsets[e] = off;
        for (int q = 0; q * TM < c; ++q) {
            tile_expert[toff] = e;
            tile_start[toff] = off + q * TM;
            tile_count[toff] = min(TM, c - q * TM);
            ++toff;
        }
        cnt[e] = off;  // the expert's first sorted position
        off += c;
    }
    if (tid == nt - 1) {
        offsets[E] = tsum[nt - 1];
        *n_tiles = ttil[nt - 1];
    }
    __syncthreads();
    for (int s = tid; s < S; s += nt) {
        int e = ids[s];
        int pos = -1;
        if (e >= 0 && e < E) {
            pos = cnt[e];
            for (int q = 0; q < s; ++q) pos += ids[q] == e;
        }
        slot_pos[s] = pos;
        if (pos >= 0) sorted_token[pos] = s / k;
    }
}
