// QSA (indexed sparse attention) kernels over paged token pools.
// Sources: modeling_qwen4_exp.py Qwen4ExpTextQSAIndexer.forward (pooled raw keys -> k_layernorm -> RoPE at the
// block's first position; scores = sum_h relu(q_h . k_b) / sqrt(Di); block top-k; tail always visible),
// Qwen4ExpTextAttention.forward + eager_attention_forward (GQA softmax over the selected tokens).
// Slot of token p in table row r: bt[r * max_pages + p / page] * page + p % page (any page size).

#ifndef QSA_HEAD_DIM
#define QSA_HEAD_DIM 256   // attention head dim; the host compiles with -DQSA_HEAD_DIM=<D>
#endif
#ifndef QSA_GROUP
#define QSA_GROUP 12       // query heads per KV head; the host compiles with -DQSA_GROUP=<Hq/Hkv>
#endif
#define QSA_WARPS 8
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
// grid (ceil(NB / 8), T), block 256: one warp per block key. dynamic smem Hi*Di floats (the query).
extern "C" __global__ void qsa_index_scores(const float* __restrict__ q, const float* __restrict__ blk_k,
                                            const int* __restrict__ bt, const long long* __restrict__ rows,
                                            const long long* __restrict__ n_visible, float* __restrict__ out,
                                            int Hi, int Di, long long NB, int ratio, int page, int max_pages,
                                            float sqrt_d) {
    extern __shared__ float sq[];
    const int t = blockIdx.y;
    for (int i = threadIdx.x; i < Hi * Di; i += blockDim.x) sq[i] = q[(long long)t * Hi * Di + i];
    __syncthreads();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long n = (long long)blockIdx.x * (blockDim.x / 32) + warp;
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
// grid (Hkv, T), block 32*QSA_WARPS. Each warp runs an online softmax over a strided share of the query's tokens
// (selected blocks' tokens, then the tail) for the QSA_GROUP query heads of one KV head; warps merge in order.
extern "C" __global__ void qsa_sparse_attention(const float* __restrict__ q, const float* __restrict__ kv_k,
                                                const float* __restrict__ kv_v, const int* __restrict__ bt,
                                                const long long* __restrict__ rows,
                                                const long long* __restrict__ n_visible,
                                                const int* __restrict__ sel, float* __restrict__ out, int Hkv,
                                                int ksel, int ratio, int page, int max_pages, float scale) {
    __shared__ float sm_m[QSA_WARPS][QSA_GROUP];
    __shared__ float sm_l[QSA_WARPS][QSA_GROUP];
    __shared__ float sm_acc[QSA_GROUP][QSA_HEAD_DIM];
    const int h = blockIdx.x, t = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int Hq = Hkv * QSA_GROUP;
    const float NEG_INF = -__int_as_float(0x7f800000);
    float qr[QSA_GROUP][QSA_DPL], acc[QSA_GROUP][QSA_DPL], m[QSA_GROUP], l[QSA_GROUP];
#pragma unroll
    for (int g = 0; g < QSA_GROUP; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int i = 0; i < QSA_DPL; ++i) {
            int d = lane + 32 * i;
            qr[g][i] = d < QSA_HEAD_DIM ? q[((long long)t * Hq + h * QSA_GROUP + g) * QSA_HEAD_DIM + d] : 0.f;
            acc[g][i] = 0.f;
        }
    }
    const long long nv = n_visible[t];
    const long long nc = nv / ratio;
    const long long kk = nc < (long long)ksel ? nc : (long long)ksel;
    const long long nsel = kk * ratio;
    const long long total = nsel + (nv - nc * ratio);
    const int* btr = bt + rows[t] * (long long)max_pages;
    for (long long s = warp; s < total; s += QSA_WARPS) {
        long long p = s < nsel ? (long long)sel[(long long)t * ksel + s / ratio] * ratio + s % ratio
                               : nc * ratio + (s - nsel);
        const long long base = (qsa_slot(btr, p, page) * Hkv + h) * QSA_HEAD_DIM;
        float kr[QSA_DPL], vr[QSA_DPL];
#pragma unroll
        for (int i = 0; i < QSA_DPL; ++i) {
            int d = lane + 32 * i;
            kr[i] = d < QSA_HEAD_DIM ? kv_k[base + d] : 0.f;
            vr[i] = d < QSA_HEAD_DIM ? kv_v[base + d] : 0.f;
        }
#pragma unroll
        for (int g = 0; g < QSA_GROUP; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < QSA_DPL; ++i) dot += qr[g][i] * kr[i];
            dot = warp_sum(dot) * scale;
            float mn = fmaxf(m[g], dot);
            float corr = expf(m[g] - mn);
            float pe = expf(dot - mn);
            l[g] = l[g] * corr + pe;
#pragma unroll
            for (int i = 0; i < QSA_DPL; ++i) acc[g][i] = acc[g][i] * corr + pe * vr[i];
            m[g] = mn;
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < QSA_GROUP; ++g) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
    }
    for (int i = threadIdx.x; i < QSA_GROUP * QSA_HEAD_DIM; i += blockDim.x) (&sm_acc[0][0])[i] = 0.f;
    __syncthreads();
    float f[QSA_GROUP];
#pragma unroll
    for (int g = 0; g < QSA_GROUP; ++g) {
        float M = NEG_INF;
        for (int w = 0; w < QSA_WARPS; ++w) M = fmaxf(M, sm_m[w][g]);
        float L = 0.f;
        for (int w = 0; w < QSA_WARPS; ++w) if (sm_m[w][g] != NEG_INF) L += sm_l[w][g] * expf(sm_m[w][g] - M);
        f[g] = (m[g] == NEG_INF || L == 0.f) ? 0.f : expf(m[g] - M) / L;
    }
    for (int w = 0; w < QSA_WARPS; ++w) {
        if (warp == w) {
#pragma unroll
            for (int g = 0; g < QSA_GROUP; ++g)
#pragma unroll
                for (int i = 0; i < QSA_DPL; ++i) {
                    int d = lane + 32 * i;
                    if (d < QSA_HEAD_DIM) sm_acc[g][d] += acc[g][i] * f[g];
                }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < QSA_GROUP * QSA_HEAD_DIM; i += blockDim.x) {
        int g = i / QSA_HEAD_DIM, d = i % QSA_HEAD_DIM;
        out[((long long)t * Hq + h * QSA_GROUP + g) * QSA_HEAD_DIM + d] = sm_acc[g][d];
    }
}
