// After the q/k/v projections of a decode step, in one launch: the projections' biases (Qwen2's, when
// given), the per-head RMS norm of q and k (Qwen3's q_norm/k_norm, when given), rotary embedding at
// each row's position, and k and v written into the paged cache at each row's slot, converted to the
// cache's dtype (bit for bit as kernels/convert.py). q is rotated in place. Positions and slots are
// read from device memory; a row whose slot is -1 is padding and is left alone.
// One warp per head (q heads, then k heads, then v heads), lane i holding values i*P .. i*P + P - 1; the
// rotation's partners come through the warp's shared row.
#pragma once
#include "kv_cache.cuh"

enum : int { ROPE_WARPS = 4 };

// Rotated value i of a head held in `row` (the first `rot` values rotate, the rest pass through), at
// a float64 angle: positions reach 1e5 and more, where a float32 angle loses the phase.
EMBER_HD float rope_value(const float* row, int i, int rot, bool interleaved, int position, const float* inv_freq) {
    if (i >= rot) return row[i];
    const int half = rot / 2;
    int pair, a, b;
    if (interleaved) {
        pair = i / 2;
        a = i & ~1;
        b = a + 1;
    } else {
        pair = i % half;
        a = pair;
        b = pair + half;
    }
    // sincospi: an argument in half turns needs no Payne-Hanek reduction, whose scratch array would put
    // the kernel in local memory; the half-turn count is exact to ~1e-16 of the phase
    const double turns = (double)position * ((double)inv_freq[pair] * 0.31830988618379067154);  // 1 / pi
    double s, c;
#ifdef __CUDA_ARCH__
    sincospi(turns, &s, &c);
#else
    s = sin(3.14159265358979323846 * turns);
    c = cos(3.14159265358979323846 * turns);
#endif
    const double u = row[a], v = row[b];  // in float64, as kernels/cuda/dense.py's _rope
    return (float)(i == a ? u * c - v * s : u * s + v * c);
}

#ifdef __CUDACC__
// One head: norm (when `norm`), rotate (q and k), then write back in place (q) or into the cache (k, v).
// Each of the three kinds of head is its own instantiation: choosing the pointers at run time made
// the compiler index a table of them in local memory.
template <int KVT, int P, bool ROTATE, bool CACHE>
__device__ __forceinline__ void qk_rope_kv_head(const float* src, float* dst, const float* bias, const float* norm, float eps,
                                                const float* inv_freq, int rot, int interleaved, int position,
                                                float* shared_row, i64 slot, int h, int kv_heads, KvView cache) {
    constexpr int D = 32 * P;
    const int lane = threadIdx.x % WARP;
    float x[P];
#pragma unroll
    for (int i = 0; i < P; ++i) x[i] = src[lane * P + i] + (bias ? bias[lane * P + i] : 0.0f);
    if (norm) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) ss += x[i] * x[i];
        const float scale = rsqrtf(warp_sum(ss) / (float)D + eps);
#pragma unroll
        for (int i = 0; i < P; ++i) x[i] = x[i] * scale * norm[lane * P + i];
    }
    if (ROTATE && rot > 0) {
#pragma unroll
        for (int i = 0; i < P; ++i) shared_row[lane * P + i] = x[i];
        __syncwarp();
#pragma unroll
        for (int i = 0; i < P; ++i) x[i] = rope_value(shared_row, lane * P + i, rot, interleaved, position, inv_freq);
    }
    if constexpr (!CACHE) {
#pragma unroll
        for (int i = 0; i < P; ++i) dst[lane * P + i] = x[i];
    } else {
        float amax = 0.0f;
        if constexpr (KVT == KV_Q8_0) {
#pragma unroll
            for (int i = 0; i < P; ++i) amax = fmaxf(amax, fabsf(x[i]));
            amax = group_max(amax, 32 / P);
        }
        kv_store<KVT, P>(cache, slot, h, kv_heads, lane, x, amax);
    }
}

template <int KVT, int P>
__device__ __forceinline__ void qk_rope_kv(float* q, const float* k, const float* v, const float* q_bias,
                                           const float* k_bias, const float* v_bias, const float* q_norm,
                                           const float* k_norm, float eps, const float* inv_freq, int rot,
                                           int interleaved, const int* positions, const i64* slots, int q_heads,
                                           int kv_heads, KvView k_cache, KvView v_cache) {
    constexpr int D = 32 * P;
    __shared__ float rows[ROPE_WARPS][D];
    const int b = blockIdx.y, warp = threadIdx.x / WARP;
    const int head = blockIdx.x * ROPE_WARPS + warp;
    const i64 slot = slots[b];
    if (slot < 0 || head >= q_heads + 2 * kv_heads) return;
    if (head < q_heads) {
        float* row = q + ((i64)b * q_heads + head) * D;
        qk_rope_kv_head<KVT, P, true, false>(row, row, q_bias ? q_bias + head * D : nullptr, q_norm, eps, inv_freq, rot,
                                             interleaved, positions[b], rows[warp], slot, head, kv_heads, k_cache);
    } else if (head < q_heads + kv_heads) {
        const int h = head - q_heads;
        qk_rope_kv_head<KVT, P, true, true>(k + ((i64)b * kv_heads + h) * D, nullptr, k_bias ? k_bias + h * D : nullptr,
                                            k_norm, eps, inv_freq, rot, interleaved, positions[b], rows[warp], slot, h,
                                            kv_heads, k_cache);
    } else {
        const int h = head - q_heads - kv_heads;
        qk_rope_kv_head<KVT, P, false, true>(v + ((i64)b * kv_heads + h) * D, nullptr, v_bias ? v_bias + h * D : nullptr,
                                             nullptr, eps, inv_freq, rot, interleaved, positions[b], rows[warp], slot, h,
                                             kv_heads, v_cache);
    }
}

#define EMBER_QK_ROPE_KV(NAME, KVT, P)                                                                         \
    extern "C" __global__ void                                                                                 \
        NAME(float* q, const float* k, const float* v, const float* q_bias, const float* k_bias,               \
             const float* v_bias, const float* q_norm, const float* k_norm, float eps, const float* inv_freq,  \
             int rot, int interleaved, const int* positions, const i64* slots, int q_heads, int kv_heads,      \
             void* k_data, u16* k_scales, void* v_data, u16* v_scales) {                                       \
        qk_rope_kv<KVT, P>(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, inv_freq, rot, interleaved,    \
                           positions, slots, q_heads, kv_heads, KvView{k_data, k_scales}, KvView{v_data, v_scales}); \
    }
#endif
