// QSA (indexed sparse attention) kernels over paged token pools.
// Sources: modeling_qwen4_exp.py Qwen4ExpTextQSAIndexer.forward (pooled raw keys -> k_layernorm -> RoPE at the
// block's first position; scores = sum_h relu(q_h . k_b) / sqrt(Di); block top-k; tail always visible),
// Qwen4ExpTextAttention.forward + eager_attention_forward (GQA softmax over the selected tokens).
// Slot of token p in table row r: bt[r * max_pages + p / page] * page + p % page (any page size).

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

// ------------------------------------------------------------------------------------------ top-k
// Composite key: order-preserving score bits (high 32) | (0xFFFFFFFF - block) (low 32): a larger key is a better
// block (higher score, then lower index), all keys distinct. Radix-select the kk-th largest key (8 passes of 8
// bits), gather the kk keys >= it, bitonic-sort them descending in shared memory (p2 = pow2 >= k entries).
__device__ __forceinline__ unsigned long long qsa_key(float s, long long n) {
    float c = s + 0.0f;  // -0 -> +0 so equal scores tie
    unsigned u = __float_as_uint(c);
    unsigned hi = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)hi << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned)n);
}

extern "C" __global__ void qsa_topk(const float* __restrict__ scores, const long long* __restrict__ n_visible,
                                    int* __restrict__ out, long long NB, int ratio, int k, int p2) {
    extern __shared__ unsigned long long buf[];
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long s_prefix, s_mask;
    __shared__ long long s_remaining;
    __shared__ int s_count;
    const int t = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
    const float* row = scores + (long long)t * NB;
    long long nc = n_visible[t] / ratio;
    if (nc > NB) nc = NB;
    const int kk = nc < (long long)k ? (int)nc : k;
    if (kk == 0) {
        for (int i = tid; i < k; i += nt) out[(long long)t * k + i] = -1;
        return;
    }
    if (tid == 0) { s_prefix = 0ull; s_mask = 0ull; s_remaining = kk; s_count = 0; }
    __syncthreads();
    if (nc > k) {
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int i = tid; i < 256; i += nt) hist[i] = 0u;
            __syncthreads();
            const unsigned long long prefix = s_prefix, mask = s_mask;
            for (long long n = tid; n < nc; n += nt) {
                unsigned long long key = qsa_key(row[n], n);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255ull], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                long long cum = 0;
                for (int d = 255; d >= 0; --d) {
                    if (cum + (long long)hist[d] >= s_remaining) {
                        s_prefix |= ((unsigned long long)d) << shift;
                        s_mask |= 255ull << shift;
                        s_remaining -= cum;
                        break;
                    }
                    cum += hist[d];
                }
            }
            __syncthreads();
        }
    }
    const unsigned long long thr = (nc > k) ? s_prefix : 0ull;
    for (long long n = tid; n < nc; n += nt) {
        unsigned long long key = qsa_key(row[n], n);
        if (key >= thr) buf[atomicAdd(&s_count, 1)] = key;
    }
    __syncthreads();
    for (int i = kk + tid; i < p2; i += nt) buf[i] = 0ull;
    __syncthreads();
    for (int size = 2; size <= p2; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < p2; i += nt) {
                int j = i ^ stride;
                if (j > i) {
                    unsigned long long a = buf[i], b = buf[j];
                    bool desc = (i & size) == 0;
                    if (desc ? (a < b) : (a > b)) { buf[i] = b; buf[j] = a; }
                }
            }
            __syncthreads();
        }
    }
    for (int i = tid; i < k; i += nt)
        out[(long long)t * k + i] = i < kk ? (int)(0xFFFFFFFFu - (unsigned)(buf[i] & 0xFFFFFFFFull)) : -1;
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
