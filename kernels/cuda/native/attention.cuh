// Decode attention over the paged KV cache, split-K over the context (flash-decoding).
//
// attention_split: one block of 4 warps per (kv head, group of up to HPB query heads, split, batch
// row). The split's keys are dealt to the warps; each warp scores a key for all its query heads at once
// (so a K/V row is read once per group), keeping an online softmax per head, and the four warps merge
// in shared memory into one partial (max, sum, unnormalised output) per head and split.
// attention_combine merges the splits. The split count is the grid's and fixed; lengths and block
// tables come from device memory, so a captured graph replays at any context length. A batch row of
// length 0 (padding) exits at once and its output is left as it was.
#pragma once
#include "kv_cache.cuh"

enum : int { ATTN_WARPS = 4 };
#define NEG_INF as_float(0xff800000u)

// Online-softmax update of one head with one key's score and value slice.
template <int P>
EMBER_HD void softmax_step(float score, const float v[P], float& m, float& l, float acc[P]) {
    const float m_new = fmaxf(m, score), corr = expf(m - m_new), p = expf(score - m_new);
    l = l * corr + p;
#pragma unroll
    for (int i = 0; i < P; ++i) acc[i] = acc[i] * corr + p * v[i];
    m = m_new;
}

// The keys of split s: [start, end), from the row's length and the split count.
EMBER_HD void split_range(int length, int s, int splits, int& start, int& end) {
    const int chunk = (length + splits - 1) / splits;
    start = s * chunk;
    end = start + chunk < length ? start + chunk : length;
}

#ifdef __CUDACC__
template <int KVT, int P, int HPB>
__device__ __forceinline__ void attention_split(const float* q, KvView k, KvView v, const int* tables,
                                                const int* lengths, int table_width, int block_size, int q_heads,
                                                int kv_heads, float scale, float* part_acc, float2* part_ml) {
    constexpr int D = 32 * P;
    const int b = blockIdx.z, s = blockIdx.y, splits = gridDim.y;
    const int length = lengths[b];
    int start, end;
    split_range(length, s, splits, start, end);
    if (start >= end) return;  // padding, or a split past the end: the combine skips it too
    const int group = q_heads / kv_heads, hgroups = (group + HPB - 1) / HPB;
    const int kvh = blockIdx.x / hgroups, h0 = kvh * group + (blockIdx.x % hgroups) * HPB;
    const int nh = group - (blockIdx.x % hgroups) * HPB < HPB ? group - (blockIdx.x % hgroups) * HPB : HPB;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;

    float qs[HPB][P], acc[HPB][P], m[HPB], l[HPB];
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            qs[h][i] = h < nh ? q[((i64)b * q_heads + h0 + h) * D + lane * P + i] * scale : 0.0f;
            acc[h][i] = 0.0f;
        }
    }
    const int* table = tables + (i64)b * table_width;
    // A warp's keys are t, t + 4, t + 8, ... (ATTN_WARPS apart); KEYS of them are loaded before any is
    // used, so that many rows are in flight at once, and then taken in order: the same arithmetic as one
    // key at a time, bit for bit.
    constexpr int KEYS = P <= 4 ? 4 : (P == 8 ? 2 : 1);
    for (int t0 = start + warp; t0 < end; t0 += ATTN_WARPS * KEYS) {
        float kf[KEYS][P], vf[KEYS][P];
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const int t = t0 + j * ATTN_WARPS;
            if (t < end) {
                const i64 slot = (i64)table[t / block_size] * block_size + t % block_size;
                kv_load<KVT, P>(k, slot, kvh, kv_heads, lane, kf[j]);
                kv_load<KVT, P>(v, slot, kvh, kv_heads, lane, vf[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            if (t0 + j * ATTN_WARPS >= end) break;  // the same for every lane of the warp
#pragma unroll
            for (int h = 0; h < HPB; ++h) {
                float dot = 0.0f;
#pragma unroll
                for (int i = 0; i < P; ++i) dot += qs[h][i] * kf[j][i];
                const float score = warp_sum(dot);
                if (h < nh) softmax_step<P>(score, vf[j], m[h], l[h], acc[h]);
            }
        }
    }
    __shared__ float sm_m[ATTN_WARPS][HPB], sm_l[ATTN_WARPS][HPB], sm_acc[ATTN_WARPS][HPB][D];
#pragma unroll
    for (int h = 0; h < HPB; ++h) {
        if (lane == 0) {
            sm_m[warp][h] = m[h];
            sm_l[warp][h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < P; ++i) sm_acc[warp][h][lane * P + i] = acc[h][i];
    }
    __syncthreads();
    for (int item = threadIdx.x; item < nh * D; item += blockDim.x) {
        const int h = item / D, j = item % D;
        float top = NEG_INF;
        for (int w = 0; w < ATTN_WARPS; ++w) top = fmaxf(top, sm_m[w][h]);
        float sum = 0.0f, out = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            const float weight = sm_l[w][h] > 0.0f ? expf(sm_m[w][h] - top) : 0.0f;  // an idle warp has l = 0
            sum += sm_l[w][h] * weight;
            out += sm_acc[w][h][j] * weight;
        }
        const i64 row = ((i64)b * q_heads + h0 + h) * splits + s;
        part_acc[row * D + j] = out;
        if (j == 0) part_ml[row] = make_float2(top, sum);
    }
}

// One block of D threads per (query head, batch row): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s.
__device__ __forceinline__ void attention_combine(const float* part_acc, const float2* part_ml, const int* lengths,
                                                  int q_heads, int head_dim, int splits, float* out) {
    const int h = blockIdx.x, b = blockIdx.y, j = threadIdx.x;
    const int length = lengths[b];
    if (length <= 0 || j >= head_dim) return;
    const int chunk = (length + splits - 1) / splits, used = (length + chunk - 1) / chunk;
    const i64 row = ((i64)b * q_heads + h) * splits;
    float top = NEG_INF;
    for (int s = 0; s < used; ++s) top = fmaxf(top, part_ml[row + s].x);
    float sum = 0.0f, acc = 0.0f;
    for (int s = 0; s < used; ++s) {
        const float w = expf(part_ml[row + s].x - top);
        sum += part_ml[row + s].y * w;
        acc += part_acc[(row + s) * head_dim + j] * w;
    }
    out[((i64)b * q_heads + h) * head_dim + j] = acc / sum;
}

#define EMBER_ATTENTION(NAME, KVT, P, HPB)                                                                      \
    extern "C" __global__ void                                                                                  \
        NAME(const float* q, void* k, u16* k_scales, void* v, u16* v_scales, const int* tables,                 \
             const int* lengths, int table_width, int block_size, int q_heads, int kv_heads, float scale,       \
             float* part_acc, float2* part_ml) {                                                                \
        attention_split<KVT, P, HPB>(q, KvView{k, k_scales}, KvView{v, v_scales}, tables, lengths, table_width, \
                                     block_size, q_heads, kv_heads, scale, part_acc, part_ml);                  \
    }

#define EMBER_ATTENTION_COMBINE(NAME)                                                                           \
    extern "C" __global__ void NAME(const float* part_acc, const float2* part_ml, const int* lengths,          \
                                    int q_heads, int head_dim, int splits, float* out) {                        \
        attention_combine(part_acc, part_ml, lengths, q_heads, head_dim, splits, out);                          \
    }
#endif
