// Activations into the GEMVs' input: q8_1 quantization (32 values a block: int8 quants, and the pair
// (scale, scale * sum of the quants)), fused with the RMS norm that precedes every matmul of a layer.
// One block per batch row; a warp quantizes one 32-value unit, lane i holding value i. The quants are
// ggml's quantize_row_q8_1_ref: d = amax / 127, q = roundf(x / d) as x * (1/d).
#pragma once
#include "kv_cache.cuh"

enum : int { NORM_THREADS = 256 };

#ifdef __CUDACC__
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if (threadIdx.x % WARP == 0) scratch[threadIdx.x / WARP] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < blockDim.x / WARP; ++w) total += scratch[w];
    __syncthreads();
    return total;
}

// x [B, K] -> xq [B, K], xd [B, K/32]; with NORM, each row is first RMS-normalised and scaled by
// `weight` [K], and the normalised floats also go to xf [B, K] when xf is not null (the input of
// float-weight GEMVs).
template <bool NORM>
__device__ __forceinline__ void norm_quantize(const float* x, const float* weight, float eps, int K, float* xf, i8* xq,
                                              float2* xd) {
    __shared__ float scratch[NORM_THREADS / WARP];
    const i64 b = blockIdx.x;
    const float* row = x + b * K;
    float scale = 1.0f;
    if constexpr (NORM) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < K; i += blockDim.x) ss += row[i] * row[i];
        scale = rsqrtf(block_sum(ss, scratch) / (float)K + eps);
    }
    const int lane = threadIdx.x % WARP, warps = blockDim.x / WARP;
    for (int u = threadIdx.x / WARP; u < K / UNIT; u += warps) {
        const int i = UNIT * u + lane;
        float v = row[i];
        if constexpr (NORM) v = v * scale * weight[i];
        if (xf) xf[b * K + i] = v;
        const float d = q8_0_scale(warp_max(fabsf(v)));
        const int q = q8_0_value(v, d);
        xq[b * K + i] = (i8)q;
        const float sum = warp_sum((float)q);  // exact: at most 32 * 127
        if (lane == 0) xd[b * (K / UNIT) + u] = make_float2(d, d * sum);
    }
}

#define EMBER_NORM_QUANTIZE(NAME, NORM)                                                                        \
    extern "C" __global__ void                                                                                 \
        NAME(const float* x, const float* weight, float eps, int K, float* xf, i8* xq, float2* xd) {           \
        norm_quantize<NORM>(x, weight, eps, K, xf, xq, xd);                                                     \
    }
#endif
