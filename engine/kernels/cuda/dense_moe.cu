// MoE dispatch kernels of the qwen4exp engine (no host synchronisation anywhere).
//
//   router_topk   : per token, softmax over the router logits (float32), top-k in the canonical order
//                   (higher probability first, then lower expert id), optional renormalisation (moe_route.cuh).
//   moe_tables    : one block: per-expert counts, offsets, the sorted slot order (token of each sorted
//                   slot, sorted position of each original slot) and the tile table for grouped GEMMs.
//   moe_swiglu    : h[s, i] = silu(gu[s, i]) * gu[s, I + i]
//   moe_combine   : out[t, :] = sum_j w[t, j] * Y[pos[t, j], :] (+ sigmoid(g[t]) * shared[t, :])
//
// Self-contained (no host headers): compiles with NVRTC (cupy.RawModule) and nvcc.

// moe_route.cuh: moe_topk_block
#include "grid_dep.cuh"
#include "moe_route.cuh"

// One block of 256 threads per token (moe_route.cuh's moe_topk_block: the router's one implementation); dynamic
// shared memory E floats.
extern "C" __global__ void __launch_bounds__(256) router_topk(const float* __restrict__ logits, int T, int E, int k,
                                                              int renorm, int* __restrict__ out_ids,
                                                              float* __restrict__ out_w) {
    GRID_DEP_ENTRY();
    extern __shared__ float probs[];  // E floats
    __shared__ MoeTopkShared sh;
    const int t = blockIdx.x;
    if (t >= T) return;
    moe_topk_block(logits + (long long)t * E, E, k, renorm, out_ids + (long long)t * k, out_w + (long long)t * k,
                   probs, sh);
}

// Launch with one block of 1024 threads and (E * sizeof(int)) bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(1024) moe_tables(const int* __restrict__ ids, int S, int k, int E,
                                                              int TM, int* __restrict__ offsets,
                                                              int* __restrict__ sorted_token,
                                                              int* __restrict__ slot_pos,
                                                              int* __restrict__ tile_expert,
                                                              int* __restrict__ tile_start,
                                                              int* __restrict__ tile_count,
                                                              int* __restrict__ n_tiles) {
    GRID_DEP_ENTRY();
    extern __shared__ int cnt[];  // E
    __shared__ int tsum[1024];
    __shared__ int ttil[1024];
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
        cnt[e] = off;  // becomes the insertion cursor
        off += c;
    }
    if (tid == nt - 1) {
        offsets[E] = tsum[nt - 1];
        *n_tiles = ttil[nt - 1];
    }
    __syncthreads();
    for (int s = tid; s < S; s += nt) {
        int e = ids[s];
        int pos = (e >= 0 && e < E) ? atomicAdd(&cnt[e], 1) : -1;
        slot_pos[s] = pos;
        if (pos >= 0) sorted_token[pos] = s / k;
    }
}

extern "C" __global__ void moe_swiglu(const float* __restrict__ gu, float* __restrict__ h, long long S, int I) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S * I) return;
    long long s = i / I;
    int c = (int)(i % I);
    float g = gu[s * 2 * I + c], u = gu[s * 2 * I + I + c];
    h[i] = (g / (1.f + expf(-g))) * u;
}

extern "C" __global__ void moe_combine(const float* __restrict__ Y, const int* __restrict__ slot_pos,
                                       const float* __restrict__ w, const float* __restrict__ shared,
                                       const float* __restrict__ shared_gate, float* __restrict__ out, int T, int k,
                                       int H) {
    GRID_DEP_ENTRY();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * H) return;
    long long t = i / H;
    int h = (int)(i % H);
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
        int p = slot_pos[t * k + j];
        if (p >= 0) acc += Y[(long long)p * H + h] * w[t * k + j];
    }
    if (shared != nullptr) {
        float g = shared_gate[t];
        acc += (1.f / (1.f + expf(-g))) * shared[i];
    }
    out[i] = acc;
}
