// QSA (indexed sparse attention) kernels over paged token pools.
// Sources: modeling_qwen4_exp.py Qwen4ExpTextQSAIndexer.forward (pooled raw keys -> k_layernorm -> RoPE at the
// block's first position; scores = sum_h relu(q_h . k_b) / sqrt(Di); block top-k; tail always visible),
// Qwen4ExpTextAttention.forward + eager_attention_forward (GQA softmax over the selected tokens).
// Slot of token p in table row r: bt[r * max_pages + p / page] * page + p % page (any page size).

#include "grid_dep.cuh"
#include "common.cuh"

#ifndef QSA_HEAD_DIM
#define QSA_HEAD_DIM 256   // attention head dim; the host compiles with -DQSA_HEAD_DIM=<D>
#endif
#define QSA_WARPS 4
#define QSA_DPL ((QSA_HEAD_DIM + 31) / 32)

__device__ __forceinline__ long long qsa_slot(const int* __restrict__ bt_row, long long p, int page) {
    return (long long)bt_row[p / page] * page + p % page;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ------------------------------------------------------------------------------------------ block keys
// grid T, block 32, dynamic smem Di floats. Only tokens that complete a block (pos+1) % ratio == 0 do work.
extern "C" __global__ void qsa_block_keys(const float* __restrict__ idx_k, float* __restrict__ blk_k,
                                          const int* __restrict__ bt, const long long* __restrict__ rows,
                                          const long long* __restrict__ pos, const float* __restrict__ w,
                                          const float* __restrict__ inv_freq, int Di, int rot, int ratio, int page,
                                          int max_pages, float eps) {
    GRID_DEP_ENTRY();
    extern __shared__ float sh[];
    const int t = blockIdx.x, lane = threadIdx.x;
    const long long p = pos[t];
    if ((p + 1) % ratio != 0) return;
    const int* btr = bt + rows[t] * (long long)max_pages;
    const long long start = p - (ratio - 1);
    float ss = 0.f;
    for (int d = lane; d < Di; d += 32) {
        float acc = 0.f;
        for (int j = 0; j < ratio; ++j) acc += idx_k[qsa_slot(btr, start + j, page) * Di + d];
        acc = acc / (float)ratio;
        sh[d] = acc;
        ss += acc * acc;
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)Di + eps);
    __syncwarp();
    for (int d = lane; d < Di; d += 32) sh[d] = (sh[d] * inv) * (1.0f + w[d]);
    __syncwarp();
    const long long so = qsa_slot(btr, p, page);
    const int half = rot / 2;
    for (int d = lane; d < Di; d += 32) {
        float o;
        if (d < half) {
            float ang = (float)start * inv_freq[d];
            o = sh[d] * cosf(ang) - sh[d + half] * sinf(ang);
        } else if (d < rot) {
            float ang = (float)start * inv_freq[d - half];
            o = sh[d] * cosf(ang) + sh[d - half] * sinf(ang);
        } else {
            o = sh[d];
        }
        blk_k[so * Di + d] = o;
    }
}

// ------------------------------------------------------------------------------------------ scores
// grid (T, ceil(NB / 8)), block 256: one warp per block key. dynamic smem Hi*Di floats (the query).
extern "C" __global__ void qsa_index_scores(const float* __restrict__ q, const float* __restrict__ blk_k,
                                            const int* __restrict__ bt, const long long* __restrict__ rows,
                                            const long long* __restrict__ n_visible, float* __restrict__ out,
                                            int Hi, int Di, long long NB, int ratio, int page, int max_pages,
                                            float sqrt_d) {
    GRID_DEP_ENTRY();
    extern __shared__ float sq[];
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < Hi * Di; i += blockDim.x) sq[i] = q[(long long)t * Hi * Di + i];
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long n = (long long)blockIdx.y * (blockDim.x / 32) + warp;
    if (n >= NB) return;
    const long long nc = n_visible[t] / ratio;
    if (n >= nc) {
        if (lane == 0) out[t * NB + n] = -__int_as_float(0x7f800000);  // -inf
        return;
    }
    const int* btr = bt + rows[t] * (long long)max_pages;
    const float* kp = blk_k + qsa_slot(btr, n * ratio + ratio - 1, page) * Di;
    float total = 0.f;
    for (int h = 0; h < Hi; ++h) {
        float acc = 0.f;
        for (int d = lane; d < Di; d += 32) acc += sq[h * Di + d] * kp[d];
        acc = warp_sum(acc);
        total += fmaxf(acc, 0.f);
    }
    if (lane == 0) out[t * NB + n] = total / sqrt_d;
}

// ------------------------------------------------------------------------------------------ sparse attention
// Split-KV ("flash decoding"): the query's token list (selected blocks' tokens, then the tail) is cut into
// n_split contiguous pieces of tps tokens. qsa_attn_partial: grid (T, Hq, n_split), block 32*QSA_WARPS; each warp
// runs an online softmax over a strided share of its piece for ONE query head (GQA: KV head h / group), the warps
// merge in shared memory and write (max, sum, unnormalised acc) for the piece. qsa_attn_combine: grid (T, Hq),
// merges the pieces in order (deterministic) and normalises.
__device__ __forceinline__ long long qsa_token(const int* __restrict__ sel_row, long long s, long long nsel,
                                               long long nc, int ratio) {
    return s < nsel ? (long long)sel_row[s / ratio] * ratio + s % ratio : nc * ratio + (s - nsel);
}

extern "C" __global__ void qsa_attn_partial(const float* __restrict__ q, const float* __restrict__ kv_k,
                                            const float* __restrict__ kv_v, const int* __restrict__ bt,
                                            const long long* __restrict__ rows,
                                            const long long* __restrict__ n_visible, const int* __restrict__ sel,
                                            float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc,
                                            int Hq, int Hkv, int ksel, int ratio, int page, int max_pages,
                                            long long tps, float scale) {
    GRID_DEP_ENTRY();
    __shared__ float sm_m[QSA_WARPS], sm_l[QSA_WARPS];
    __shared__ float sm_acc[QSA_WARPS][QSA_HEAD_DIM];
    const int t = blockIdx.x, h = blockIdx.y, sp = blockIdx.z, n_split = gridDim.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int hk = h / (Hq / Hkv);
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long nv = n_visible[t];
    const long long nc = nv / ratio;
    const int* sel_row = sel + (long long)t * ksel;
    // the selected blocks: the row's valid (>= 0) prefix, at most min(nc, ksel) entries (a selection hook may
    // pass a wider row than the complete blocks fill, -1 padded)
    const long long cap = nc < (long long)ksel ? nc : (long long)ksel;
    long long kk = 0;
    while (kk < cap && sel_row[kk] >= 0) ++kk;
    const long long nsel = kk * ratio;
    const long long total = nsel + (nv - nc * ratio);
    const long long lo = (long long)sp * tps;
    const long long hi = lo + tps < total ? lo + tps : total;
    const int* btr = bt + rows[t] * (long long)max_pages;
    float qr[QSA_DPL], acc[QSA_DPL], m = NEG_INF, l = 0.f;
#pragma unroll
    for (int i = 0; i < QSA_DPL; ++i) {
        int d = lane + 32 * i;
        qr[i] = d < QSA_HEAD_DIM ? q[((long long)t * Hq + h) * QSA_HEAD_DIM + d] : 0.f;
        acc[i] = 0.f;
    }
    for (long long s = lo + warp; s < hi; s += QSA_WARPS) {
        const long long p = qsa_token(sel_row, s, nsel, nc, ratio);
        const long long base = (qsa_slot(btr, p, page) * Hkv + hk) * QSA_HEAD_DIM;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < QSA_DPL; ++i) {
            int d = lane + 32 * i;
            if (d < QSA_HEAD_DIM) dot += qr[i] * kv_k[base + d];
        }
        dot = warp_sum(dot) * scale;
        const float mn = fmaxf(m, dot);
        const float corr = expf(m - mn);
        const float pe = expf(dot - mn);
        l = l * corr + pe;
#pragma unroll
        for (int i = 0; i < QSA_DPL; ++i) {
            int d = lane + 32 * i;
            if (d < QSA_HEAD_DIM) acc[i] = acc[i] * corr + pe * kv_v[base + d];
        }
        m = mn;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int i = 0; i < QSA_DPL; ++i) {
        int d = lane + 32 * i;
        if (d < QSA_HEAD_DIM) sm_acc[warp][d] = acc[i];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < QSA_WARPS; ++w) M = fmaxf(M, sm_m[w]);
    const long long o = ((long long)t * Hq + h) * n_split + sp;
    if (threadIdx.x == 0) {
        float L = 0.f;
        for (int w = 0; w < QSA_WARPS; ++w) if (sm_m[w] != NEG_INF) L += sm_l[w] * expf(sm_m[w] - M);
        pm[o] = M;
        pl[o] = L;
    }
    for (int d = threadIdx.x; d < QSA_HEAD_DIM; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < QSA_WARPS; ++w) if (sm_m[w] != NEG_INF) a += sm_acc[w][d] * expf(sm_m[w] - M);
        pacc[o * QSA_HEAD_DIM + d] = a;
    }
}

extern "C" __global__ void qsa_attn_combine(const float* __restrict__ pm, const float* __restrict__ pl,
                                            const float* __restrict__ pacc, float* __restrict__ out, int Hq,
                                            int n_split) {
    GRID_DEP_ENTRY();
    const int t = blockIdx.x, h = blockIdx.y;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long o = ((long long)t * Hq + h) * n_split;
    float M = NEG_INF;
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, pm[o + s]);
    float L = 0.f;
    for (int s = 0; s < n_split; ++s) if (pm[o + s] != NEG_INF) L += pl[o + s] * expf(pm[o + s] - M);
    const float inv = L > 0.f ? 1.0f / L : 0.f;
    for (int d = threadIdx.x; d < QSA_HEAD_DIM; d += blockDim.x) {
        float a = 0.f;
        for (int s = 0; s < n_split; ++s)
            if (pm[o + s] != NEG_INF) a += pacc[(o + s) * QSA_HEAD_DIM + d] * expf(pm[o + s] - M);
        out[((long long)t * Hq + h) * QSA_HEAD_DIM + d] = a * inv;
    }
}

// ============================================================================================ decode-oriented
// The kernels below serve decode and verify (and every top-k); the ones above serve prefill (more than
// engine.kernels.qsa.QSA_SPLIT_MAX_T queries) and wide indexer keys. Same selection semantics.

// ------------------------------------------------------------------------------------------ token write
// grid T, block >= 32 (a multiple of 32). For token t at pos[t] of table row rows[t]: slot = its pool slot;
// n_vis[t] = pos[t] + 1; idx_k[slot] = idx_src[t] (row stride idx_ld), kv_k[slot] = k_src[t] ([Hkv*D], row stride
// k_ld), kv_v[slot] = v_src[t] (row stride v_ld). A token without a page writes nothing. With fuse_bk != 0 (decode:
// one new token per table row, so every earlier raw key of its block is already in the pool) a token completing a
// block also writes the block key exactly as qsa_block_keys does (same operations, same order: bitwise equal).
extern "C" __global__ void qsa_write_tokens(const int* __restrict__ bt, const long long* __restrict__ rows,
                                            const long long* __restrict__ pos, long long* __restrict__ n_vis,
                                            const float* __restrict__ idx_src, long long idx_ld,
                                            const float* __restrict__ k_src, long long k_ld,
                                            const float* __restrict__ v_src, long long v_ld,
                                            float* idx_k, float* __restrict__ kv_k,
                                            float* __restrict__ kv_v, int Di, int KVW, int page, int max_pages,
                                            int fuse_bk, float* __restrict__ blk_k, const float* __restrict__ w,
                                            const float* __restrict__ inv_freq, int rot, int ratio, float eps) {
    GRID_DEP_ENTRY();
    __shared__ float sh[1024];
    __shared__ float red[33];
    const int t = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const long long p = pos[t];
    if (tid == 0) n_vis[t] = p + 1;
    const int* btr = bt + rows[t] * (long long)max_pages;
    const int pg = btr[p / page];
    if (pg < 0) return;
    const long long so = (long long)pg * page + p % page;
    for (int d = tid; d < Di; d += nt) idx_k[so * Di + d] = idx_src[t * idx_ld + d];
    for (int d = tid; d < KVW; d += nt) {
        kv_k[so * KVW + d] = k_src[t * k_ld + d];
        kv_v[so * KVW + d] = v_src[t * v_ld + d];
    }
    if (!fuse_bk || (p + 1) % ratio != 0) return;
    __syncthreads();  // this block's idx_k writes are visible to the whole block after the barrier
    const long long start = p - (ratio - 1);
    float ss = 0.f;
    // same per-lane partial sums + butterfly as qsa_block_keys (warp 0 only; Di <= 1024 checked by the host)
    if (tid < 32) {
        for (int d = tid; d < Di; d += 32) {
            float acc = 0.f;
            for (int j = 0; j < ratio; ++j) acc += idx_k[qsa_slot(btr, start + j, page) * Di + d];
            acc = acc / (float)ratio;
            sh[d] = acc;
            ss += acc * acc;
        }
        ss = warp_sum(ss);
        if (tid == 0) red[0] = ss;
    }
    __syncthreads();
    const float inv = 1.0f / sqrtf(red[0] / (float)Di + eps);
    for (int d = tid; d < Di; d += nt) sh[d] = (sh[d] * inv) * (1.0f + w[d]);
    __syncthreads();
    const int half = rot / 2;
    for (int d = tid; d < Di; d += nt) {
        float o;
        if (d < half) {
            float ang = (float)start * inv_freq[d];
            o = sh[d] * cosf(ang) - sh[d + half] * sinf(ang);
        } else if (d < rot) {
            float ang = (float)start * inv_freq[d - half];
            o = sh[d] * cosf(ang) + sh[d - half] * sinf(ang);
        } else {
            o = sh[d];
        }
        blk_k[so * Di + d] = o;
    }
}

// ------------------------------------------------------------------------------------------ block keys (split)
// grid T, block 32 * ceil(Di / 32) (Di <= 1024): thread d owns channel d, so the ratio raw-key loads of every
// channel are in flight at once (qsa_block_keys walks the channels with one warp). Same values up to the order of
// the sum of squares (a fixed-order block reduction instead of a warp's).
extern "C" __global__ void qsa_block_keys_split(const float* __restrict__ idx_k, float* __restrict__ blk_k,
                                                const int* __restrict__ bt, const long long* __restrict__ rows,
                                                const long long* __restrict__ pos, const float* __restrict__ w,
                                                const float* __restrict__ inv_freq, int Di, int rot, int ratio,
                                                int page, int max_pages, float eps) {
    GRID_DEP_ENTRY();
    __shared__ float sh[1024];
    __shared__ float red[33];
    const int t = blockIdx.x, d = threadIdx.x;
    const long long p = pos[t];
    if ((p + 1) % ratio != 0) return;
    const int* btr = bt + rows[t] * (long long)max_pages;
    const long long start = p - (ratio - 1);
    float acc = 0.f;
    if (d < Di) {
        for (int j = 0; j < ratio; ++j) acc += idx_k[qsa_slot(btr, start + j, page) * Di + d];
        acc = acc / (float)ratio;
        sh[d] = acc;
    }
    const float ss = block_sum(d < Di ? acc * acc : 0.f, red);  // ends with a barrier: sh is complete
    const float inv = 1.0f / sqrtf(ss / (float)Di + eps);
    float nv = 0.f;
    if (d < Di) nv = (sh[d] * inv) * (1.0f + w[d]);
    __syncthreads();
    if (d < Di) sh[d] = nv;
    __syncthreads();
    if (d >= Di) return;
    const int half = rot / 2;
    float o;
    if (d < half) {
        float ang = (float)start * inv_freq[d];
        o = sh[d] * cosf(ang) - sh[d + half] * sinf(ang);
    } else if (d < rot) {
        float ang = (float)start * inv_freq[d - half];
        o = sh[d] * cosf(ang) + sh[d - half] * sinf(ang);
    } else {
        o = sh[d];
    }
    blk_k[qsa_slot(btr, p, page) * Di + d] = o;
}

// ------------------------------------------------------------------------------------------ top-k (split)
// Same result as qsa_topk (the canonical order: score descending, block index ascending), no float atomics:
// 1. nc > k: radix-select on the 32-bit order-preserving score key (4 passes of 8 bits; per-warp histograms built
//    without atomics, summed in warp order) finds the k-th best score S and how many blocks
//    scoring exactly S are needed (need_eq); the bin is found by a parallel suffix scan (not one thread's loop).
// 2. Compaction in index order (block-wide ballot scans): every block scoring above S, and the first need_eq
//    blocks scoring S (lowest indices: the canonical tie rule). nc <= k: every complete block.
// 3. Bitonic sort of the kk composite keys (distinct) descending; exchanges of stride < 64 stay in one warp
//    (__syncwarp), wider ones use __syncthreads. Block of 1024 threads; dynamic smem max(p2 * 8, 32 KiB) bytes
//    (the 32 warps' histograms share it).
__device__ __forceinline__ unsigned qsa_key32(float s) {
    float c = s + 0.0f;  // -0 -> +0 so equal scores tie
    unsigned u = __float_as_uint(c);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// exclusive prefix of `flag` over the block in thread order, plus the block total; `ws` holds >= 33 ints.
__device__ __forceinline__ int qsa_block_scan(int flag, int* ws, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned bal = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(bal & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) ws[warp] = __popc(bal);
    __syncthreads();
    int before = 0, tot = 0;
    for (int w = 0; w < nw; ++w) {
        const int c = ws[w];
        if (w < warp) before += c;
        tot += c;
    }
    total = tot;
    return before + in_warp;
}

extern "C" __global__ void qsa_topk_split(const float* __restrict__ scores, const long long* __restrict__ n_visible,
                                          int* __restrict__ out, long long NB, int ratio, int k, int p2) {
    GRID_DEP_ENTRY();
    extern __shared__ unsigned long long buf[];
    __shared__ unsigned int hist[256];
    __shared__ unsigned int wtot[8];
    __shared__ int ws[33];
    __shared__ unsigned s_prefix, s_mask;
    __shared__ int s_need;
    const int t = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const float* row = scores + (long long)t * NB;
    long long nc = n_visible[t] / ratio;
    if (nc > NB) nc = NB;
    const int kk = nc < (long long)k ? (int)nc : k;
    if (kk == 0) {
        for (int i = tid; i < k; i += nt) out[(long long)t * k + i] = -1;
        return;
    }
    unsigned thr = 0u;      // blocks with key32 > thr are all taken ...
    int need_eq = kk;       // ... plus the first need_eq with key32 == thr (nc <= k: thr = 0, everything; see below)
    const bool select = nc > k;
    if (select) {
        if (tid == 0) { s_prefix = 0u; s_mask = 0u; s_need = kk; }
        // per-warp histograms (in the sort buffer, unused until the sort): lanes with equal digits are grouped by
        // __match_any_sync and their leader adds the group's size to its warp's bin (no two leaders share a bin), then
        // bin d sums the warps' counts in warp order: no atomics at all
        unsigned* hw = (unsigned*)buf;
        const int lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int i = tid; i < nw * 256; i += nt) hw[i] = 0u;
            __syncthreads();
            const unsigned prefix = s_prefix, mask = s_mask;
            const int need = s_need;
            for (long long c0 = 0; c0 < nc; c0 += nt) {
                const long long n = c0 + tid;
                const unsigned key = n < nc ? qsa_key32(row[n]) : 0u;
                const bool in = n < nc && (key & mask) == prefix;
                const unsigned digit = in ? (key >> shift) & 255u : 256u + (unsigned)lane;  // unique when not counted
                const unsigned grp = __match_any_sync(0xffffffffu, digit);
                if (in && lane == __ffs(grp) - 1) hw[warp * 256 + digit] += (unsigned)__popc(grp);
            }
            __syncthreads();
            for (int d = tid; d < 256; d += nt) {
                unsigned c = 0u;
                for (int w = 0; w < nw; ++w) c += hw[w * 256 + d];
                hist[d] = c;
            }
            __syncthreads();
            // suffix sums suf[d] = sum_{e >= d} hist[e]: per warp of 32 bins, then the warps above
            unsigned v = 0u;
            if (tid < 256) {
                const int lane = tid & 31;
                v = hist[tid];
                for (int o = 1; o < 32; o <<= 1) {
                    const unsigned u = __shfl_down_sync(0xffffffffu, v, o);
                    if (lane + o < 32) v += u;
                }
                if (lane == 0) wtot[tid >> 5] = v;
            }
            __syncthreads();
            if (tid < 256) {
                unsigned above = 0u;
                for (int w = (tid >> 5) + 1; w < 8; ++w) above += wtot[w];
                const unsigned suf = v + above, suf_next = suf - hist[tid];
                // the unique bin where the needed count is reached
                if (suf >= (unsigned)need && suf_next < (unsigned)need) {
                    s_prefix = prefix | ((unsigned)tid << shift);
                    s_mask = mask | (255u << shift);
                    s_need = need - (int)suf_next;
                }
            }
            __syncthreads();
        }
        thr = s_prefix;
        need_eq = s_need;
    }
    // compaction: taken blocks above the threshold first (index order), then the needed equal ones
    int n_eq_seen = 0;
    if (select) {
        int gt_base = 0;
        for (long long c0 = 0; c0 < nc; c0 += nt) {
            const long long n = c0 + tid;
            const unsigned key = n < nc ? qsa_key32(row[n]) : 0u;
            const int gt = n < nc && key > thr, eq = n < nc && key == thr;
            int tot_gt, tot_eq;
            const int pg = qsa_block_scan(gt, ws, tot_gt);
            const int pe = qsa_block_scan(eq, ws, tot_eq);
            if (gt) buf[gt_base + pg] = ((unsigned long long)key << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)n);
            // equal keys go after every gt key: their final count of gt keys is kk - need_eq
            if (eq && n_eq_seen + pe < need_eq)
                buf[(kk - need_eq) + n_eq_seen + pe] =
                    ((unsigned long long)key << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)n);
            gt_base += tot_gt;
            n_eq_seen += tot_eq;
        }
    } else {
        for (long long n = tid; n < nc; n += nt)
            buf[n] = ((unsigned long long)qsa_key32(row[n]) << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)n);
    }
    __syncthreads();
    for (int i = kk + tid; i < p2; i += nt) buf[i] = 0ull;
    __syncthreads();
    const int half = p2 >> 1;
    for (int size = 2; size <= p2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int pr = tid; pr < half; pr += nt) {
                const int i = (pr / stride) * 2 * stride + pr % stride, j = i + stride;
                const unsigned long long a = buf[i], b = buf[j];
                const bool desc = (i & size) == 0;
                if (desc ? (a < b) : (a > b)) { buf[i] = b; buf[j] = a; }
            }
            // a warp's 32 pairs of stride <= 32 lie in its own 64-entry window (when each thread has one pair)
            if (stride <= 32 && half <= nt) __syncwarp(); else __syncthreads();
        }
        __syncthreads();
    }
    for (int i = tid; i < k; i += nt)
        out[(long long)t * k + i] = i < kk ? (int)(0xFFFFFFFFu - (unsigned)(buf[i] & 0xFFFFFFFFull)) : -1;
}

// ------------------------------------------------------------------------------------------ sparse attention (split)
// GQA-shared split-KV decode attention. grid (T, Hkv, n_split), block QSA_GT threads; one CTA owns ONE KV head and
// all QSA_GROUP (= Hq / Hkv) query heads that read it, over the token range [sp*tps, (sp+1)*tps) of the query's
// token list (selected blocks' tokens in selection order, then the tail), tps a multiple of QSA_TILE. Per tile of
// QSA_TILE tokens: K and V rows are loaded as float4 into registers one tile AHEAD (the next tile's loads are in
// flight while this tile computes), parked in shared memory, scored against the group's queries (a warp per token),
// softmax-updated per head (a warp per head), and accumulated (a thread per channel). Token slots are resolved
// QSA_CHUNK at a time (one per thread). Writes (max, sum, unnormalised acc) per (t, h, split) in qsa_attn_partial's layout;
// qsa_attn_combine_split merges the splits in index order. Float32 throughout; vs qsa_attn_partial only the order
// of the softmax sums differs (per-tile online softmax instead of per-warp strided). Needs QSA_HEAD_DIM % 4 == 0.
#ifndef QSA_GROUP
#define QSA_GROUP 12       // query heads per KV head; the host compiles with -DQSA_GROUP=<Hq / Hkv>
#endif
#define QSA_TILE 16
#define QSA_GT 256
#define QSA_NWARP (QSA_GT / 32)
#define QSA_CHUNK QSA_GT
#define QSA_D4 (QSA_HEAD_DIM / 4)
#define QSA_TL4 ((QSA_TILE * QSA_D4 + QSA_GT - 1) / QSA_GT)
#define QSA_F4L ((QSA_D4 + 31) / 32)
#define QSA_DPT ((QSA_HEAD_DIM + QSA_GT - 1) / QSA_GT)

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

extern "C" __global__ void __launch_bounds__(QSA_GT)
qsa_attn_partial_split(const float* __restrict__ q, const float* __restrict__ kv_k, const float* __restrict__ kv_v,
                       const int* __restrict__ bt, const long long* __restrict__ rows,
                       const long long* __restrict__ n_visible, const int* __restrict__ sel, float* __restrict__ pm,
                       float* __restrict__ pl, float* __restrict__ pacc, int Hq, int Hkv, int ksel, int ratio,
                       int page, int max_pages, long long tps, float scale) {
    GRID_DEP_ENTRY();
    extern __shared__ float4 smem4[];
    float* sq = (float*)smem4;                        // [G][D] the group's queries
    float* sk = sq + QSA_GROUP * QSA_HEAD_DIM;        // [TILE][D]
    float* sv = sk + QSA_TILE * QSA_HEAD_DIM;         // [TILE][D]
    float* sp = sv + QSA_TILE * QSA_HEAD_DIM;         // [G][TILE] scores, then probabilities
    const float4* sq4 = (const float4*)sq;
    float4* sk4 = (float4*)sk;
    float4* sv4 = (float4*)sv;
    __shared__ long long sslot[QSA_CHUNK];
    __shared__ float s_m[QSA_GROUP], s_l[QSA_GROUP], s_corr[QSA_GROUP];
    __shared__ int s_first[QSA_NWARP];
    const int t = blockIdx.x, hk = blockIdx.y, spl = blockIdx.z, n_split = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long nv = n_visible[t];
    const long long nc = nv / ratio;
    const int* sel_row = sel + (long long)t * ksel;
    // the selected blocks: the row's valid (>= 0) prefix, at most min(nc, ksel) entries (as qsa_attn_partial)
    const long long cap = nc < (long long)ksel ? nc : (long long)ksel;
    int first = 0x7fffffff;
    for (long long i = tid; i < cap; i += QSA_GT)
        if (sel_row[i] < 0) { first = (int)i; break; }
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    if (lane == 0) s_first[warp] = first;
    for (int i = tid; i < QSA_GROUP * QSA_D4; i += QSA_GT) {
        const int g = i / QSA_D4, c = i % QSA_D4;
        ((float4*)sq)[i] = ((const float4*)(q + ((long long)t * Hq + hk * QSA_GROUP + g) * QSA_HEAD_DIM))[c];
    }
    if (tid < QSA_GROUP) { s_m[tid] = NEG_INF; s_l[tid] = 0.f; s_corr[tid] = 0.f; }
    __syncthreads();
    long long kk = cap;
    for (int w = 0; w < QSA_NWARP; ++w) kk = kk < (long long)s_first[w] ? kk : (long long)s_first[w];
    const long long nsel = kk * ratio;
    const long long total = nsel + (nv - nc * ratio);
    const long long lo = (long long)spl * tps;
    // the last split also takes any tokens past the host's bound (a bound that was too small costs time, not tokens)
    const long long hi = (lo + tps < total && spl + 1 < n_split) ? lo + tps : total;
    const long long o0 = ((long long)t * Hq + hk * QSA_GROUP) * n_split + spl;
    if (lo >= hi) {  // an empty split (the host sizes splits for the longest possible list): weight 0 in the combine
        if (tid < QSA_GROUP) {
            pm[o0 + (long long)tid * n_split] = NEG_INF;
            pl[o0 + (long long)tid * n_split] = 0.f;
        }
        return;
    }
    const int* btr = bt + rows[t] * (long long)max_pages;
    float acc[QSA_GROUP][QSA_DPT];
#pragma unroll
    for (int g = 0; g < QSA_GROUP; ++g)
#pragma unroll
        for (int i = 0; i < QSA_DPT; ++i) acc[g][i] = 0.f;
    float4 rk[QSA_TL4], rv[QSA_TL4];
    long long chunk0 = lo;  // token index of sslot[0]
    {
        const long long s = lo + tid;
        if (s < hi) sslot[tid] = qsa_slot(btr, qsa_token(sel_row, s, nsel, nc, ratio), page);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < QSA_TL4; ++r) {
            const int idx = tid + r * QSA_GT, j = idx / QSA_D4, c = idx % QSA_D4;
            if (j < QSA_TILE && lo + j < hi) {
                const long long b = (sslot[lo + j - chunk0] * Hkv + hk) * QSA_HEAD_DIM;
                rk[r] = ((const float4*)(kv_k + b))[c];
                rv[r] = ((const float4*)(kv_v + b))[c];
            }
        }
    }
    for (long long base = lo; base < hi; base += QSA_TILE) {
        const int n = hi - base < (long long)QSA_TILE ? (int)(hi - base) : QSA_TILE;
#pragma unroll
        for (int r = 0; r < QSA_TL4; ++r) {
            const int idx = tid + r * QSA_GT, j = idx / QSA_D4;
            if (j < n) { sk4[idx] = rk[r]; sv4[idx] = rv[r]; }
        }
        __syncthreads();  // tile in shared memory; every thread is done with this tile's slots
        const long long nb = base + QSA_TILE;
        if (nb < hi) {  // the next tile's loads go out now and land while this tile computes
            if (nb - chunk0 >= QSA_CHUNK) {
                chunk0 = nb;
                const long long s = nb + tid;
                if (s < hi) sslot[tid] = qsa_slot(btr, qsa_token(sel_row, s, nsel, nc, ratio), page);
                __syncthreads();
            }
#pragma unroll
            for (int r = 0; r < QSA_TL4; ++r) {
                const int idx = tid + r * QSA_GT, j = idx / QSA_D4, c = idx % QSA_D4;
                if (j < QSA_TILE && nb + j < hi) {
                    const long long b = (sslot[nb + j - chunk0] * Hkv + hk) * QSA_HEAD_DIM;
                    rk[r] = ((const float4*)(kv_k + b))[c];
                    rv[r] = ((const float4*)(kv_v + b))[c];
                }
            }
        }
        // scores: a warp per token, the group's heads in turn
        for (int j = warp; j < QSA_TILE; j += QSA_NWARP) {
            if (j < n) {
                float4 kf[QSA_F4L];
#pragma unroll
                for (int f = 0; f < QSA_F4L; ++f) {
                    const int c = lane + 32 * f;
                    kf[f] = c < QSA_D4 ? sk4[j * QSA_D4 + c] : float4{0.f, 0.f, 0.f, 0.f};
                }
#pragma unroll
                for (int g = 0; g < QSA_GROUP; ++g) {
                    float dot = 0.f;
#pragma unroll
                    for (int f = 0; f < QSA_F4L; ++f) {
                        const int c = lane + 32 * f;
                        if (c < QSA_D4) {
                            const float4 qv = sq4[g * QSA_D4 + c];
                            dot += qv.x * kf[f].x + qv.y * kf[f].y + qv.z * kf[f].z + qv.w * kf[f].w;
                        }
                    }
                    dot = warp_sum(dot);
                    if (lane == 0) sp[g * QSA_TILE + j] = dot * scale;
                }
            } else {
                for (int g = lane; g < QSA_GROUP; g += 32) sp[g * QSA_TILE + j] = NEG_INF;
            }
        }
        __syncthreads();
        // online softmax per head (a warp per head; QSA_TILE <= 32)
        for (int g = warp; g < QSA_GROUP; g += QSA_NWARP) {
            const float x = lane < QSA_TILE ? sp[g * QSA_TILE + lane] : NEG_INF;
            const float mo = s_m[g];
            const float mn = fmaxf(mo, warp_max(x));
            const float corr = expf(mo - mn);
            const float pe = lane < QSA_TILE ? expf(x - mn) : 0.f;
            const float ps = warp_sum(pe);
            if (lane < QSA_TILE) sp[g * QSA_TILE + lane] = pe;
            if (lane == 0) { s_l[g] = s_l[g] * corr + ps; s_m[g] = mn; s_corr[g] = corr; }
        }
        __syncthreads();
        // accumulate: a thread per channel
#pragma unroll
        for (int i = 0; i < QSA_DPT; ++i) {
            const int d = tid + i * QSA_GT;
            if (d < QSA_HEAD_DIM) {
#pragma unroll
                for (int g = 0; g < QSA_GROUP; ++g) acc[g][i] *= s_corr[g];
                for (int j = 0; j < n; ++j) {
                    const float v = sv[j * QSA_HEAD_DIM + d];
#pragma unroll
                    for (int g = 0; g < QSA_GROUP; ++g) acc[g][i] += sp[g * QSA_TILE + j] * v;
                }
            }
        }
        __syncthreads();  // before the next tile overwrites sk / sv / sp
    }
    if (tid < QSA_GROUP) {
        pm[o0 + (long long)tid * n_split] = s_m[tid];
        pl[o0 + (long long)tid * n_split] = s_l[tid];
    }
#pragma unroll
    for (int i = 0; i < QSA_DPT; ++i) {
        const int d = tid + i * QSA_GT;
        if (d < QSA_HEAD_DIM) {
#pragma unroll
            for (int g = 0; g < QSA_GROUP; ++g) pacc[(o0 + (long long)g * n_split) * QSA_HEAD_DIM + d] = acc[g][i];
        }
    }
}

// grid (T * Hq, ceil(D / blockDim.x)), block a multiple of 32; dynamic smem n_split floats. Merges the splits of
// one (t, h) in index order: M = max, weights exp(m_s - M) (0 for empty splits), L = fixed-tree sum of w_s * l_s,
// out = (sum_s w_s * acc_s) / L with the sum over s in ascending order. Deterministic; no atomics.
extern "C" __global__ void qsa_attn_combine_split(const float* __restrict__ pm, const float* __restrict__ pl,
                                                  const float* __restrict__ pacc, float* __restrict__ out,
                                                  int n_split) {
    GRID_DEP_ENTRY();
    extern __shared__ float wsp[];
    __shared__ float red[33];
    const long long th = blockIdx.x;
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long o = th * n_split;
    float m = NEG_INF;
    for (int s = tid; s < n_split; s += nt) m = fmaxf(m, pm[o + s]);
    m = warp_max(m);
    if (lane == 0) red[warp] = m;
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < (nt >> 5); ++w) M = fmaxf(M, red[w]);
    float lp = 0.f;
    for (int s = tid; s < n_split; s += nt) {
        const float ms = pm[o + s];
        const float w = ms != NEG_INF ? expf(ms - M) : 0.f;
        wsp[s] = w;
        lp += w * pl[o + s];
    }
    const float L = block_sum(lp, red);  // its barriers also publish wsp
    const float inv = L > 0.f ? 1.0f / L : 0.f;
    const int d = blockIdx.y * nt + tid;
    if (d >= QSA_HEAD_DIM) return;
    float a = 0.f;
    for (int s = 0; s < n_split; ++s) {
        const float w = wsp[s];
        if (w != 0.f) a += w * pacc[(o + s) * QSA_HEAD_DIM + d];
    }
    out[th * QSA_HEAD_DIM + d] = a * inv;
}

// ------------------------------------------------------------------------------------------ head prep (decode)
// The per-head zero-centred RMSNorm + RoPE of a QSA layer's three query/key sets in ONE launch (replacing two
// rms_norm_rows + ... + three rope_f32 launches and the copies of strided head slices): grid (T, Hi + Hq + Hkv),
// block 256. Row y < Hi: indexer query head y (Di channels of qk, row stride qk_ld); y < Hi + Hq: attention query
// head y - Hi (the first hd of the head's 2*hd q/gate channels of qg, row stride qg_ld); else key head y - Hi - Hq
// (hd channels of kl, row stride k_ld). Output rows are contiguous [T, heads, D]. The same operations in the same
// order as rms_norm_rows (with 256 threads: a 128-channel row's extra threads add exact zeros) followed by rope_f32,
// so the results are bitwise those of the unfused ops.
extern "C" __global__ void __launch_bounds__(256)
qsa_prep_heads(const float* __restrict__ qk, long long qk_ld, const float* __restrict__ qg, long long qg_ld,
               const float* __restrict__ kl, long long k_ld, const float* __restrict__ w_qi,
               const float* __restrict__ w_q, const float* __restrict__ w_k, const long long* __restrict__ pos,
               const float* __restrict__ inv_freq, int rot, int Hi, int Di, int Hq, int Hkv, int hd, float eps,
               float* __restrict__ q_idx, float* __restrict__ q_out, float* __restrict__ k_out) {
    GRID_DEP_ENTRY();
    __shared__ float red[33];
    __shared__ float sh[1024];
    const long long t = blockIdx.x;
    const int y = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const float* x;
    const float* w;
    float* dst;
    int D;
    if (y < Hi) {
        x = qk + t * qk_ld + (long long)y * Di; w = w_qi; D = Di; dst = q_idx + (t * Hi + y) * (long long)Di;
    } else if (y < Hi + Hq) {
        const int h = y - Hi;
        x = qg + t * qg_ld + (long long)h * 2 * hd; w = w_q; D = hd; dst = q_out + (t * Hq + h) * (long long)hd;
    } else {
        const int h = y - Hi - Hq;
        x = kl + t * k_ld + (long long)h * hd; w = w_k; D = hd; dst = k_out + (t * Hkv + h) * (long long)hd;
    }
    float ss = 0.f;
    for (int i = tid; i < D; i += nt) ss += x[i] * x[i];
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    for (int i = tid; i < D; i += nt) sh[i] = (x[i] * inv) * (1.f + w[i]);
    __syncthreads();
    const int half = rot / 2;
    const float p = (float)pos[t];
    for (int i = tid; i < D; i += nt) {
        if (i < half) {
            const float ang = p * inv_freq[i];
            const float c = cosf(ang), s = sinf(ang);
            dst[i] = sh[i] * c - sh[i + half] * s;
        } else if (i < rot) {
            const int j = i - half;
            const float ang = p * inv_freq[j];
            const float c = cosf(ang), s = sinf(ang);
            dst[i] = sh[i] * c + sh[j] * s;
        } else {
            dst[i] = sh[i];
        }
    }
}
