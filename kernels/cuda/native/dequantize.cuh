// Weights to floats: f16 tiles for prefill (more than 8 rows go through cuBLAS GEMM on f16 tiles of the
// weight) and float32 embedding rows of the step's token ids, one 32-value unit per thread (the GEMVs'
// own unit loads, so all read one layout).
#pragma once
#include "weights.cuh"

// float32 -> half bits on the hardware's converter (rounding to nearest even as f32_to_f16; only a NaN's
// payload may differ, and weights hold none).
EMBER_HD u16 f32_to_f16_fast(float f) {
#ifdef __CUDA_ARCH__
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    return f32_to_f16(f);
#endif
}

#ifdef __CUDACC__
// w [rows row0.., K] -> out [rows, K] f16 bits, for `rows` rows from row0 (a tile of the weight).
template <int T>
__device__ __forceinline__ void dequantize_f16(const void* q, const void* hi, const void* sc, const void* d, i64 row0,
                                               int rows, int K, u16* out) {
    const WeightView w{q, hi, sc, d};
    const i64 units = (i64)rows * (K / UNIT);
    for (i64 task = (i64)blockIdx.x * blockDim.x + threadIdx.x; task < units; task += (i64)gridDim.x * blockDim.x) {
        const i64 r = task / (K / UNIT);
        const int u = (int)(task % (K / UNIT));
        float v[UNIT];
        unit_values<T>(weight_row<T>(w, row0 + r, K), u, v);
        u32 packed[UNIT / 2];
#pragma unroll
        for (int i = 0; i < UNIT / 2; ++i) packed[i] = f32_to_f16_fast(v[2 * i]) | ((u32)f32_to_f16_fast(v[2 * i + 1]) << 16);
        int4* dst = reinterpret_cast<int4*>(out + r * K + UNIT * u);
#pragma unroll
        for (int c = 0; c < UNIT / 8; ++c)
            dst[c] = make_int4((int)packed[4 * c], (int)packed[4 * c + 1], (int)packed[4 * c + 2], (int)packed[4 * c + 3]);
    }
}

#define EMBER_DEQUANTIZE_F16(NAME, T)                                                                           \
    extern "C" __global__ void NAME(const void* q, const void* hi, const void* sc, const void* d, long long row0, \
                                    int rows, int K, u16* out) {                                                \
        dequantize_f16<T>(q, hi, sc, d, row0, rows, K, out);                                                    \
    }
#endif

#ifdef __CUDACC__
// Rows ids[b] of w -> out [batch, K] float32; the ids come from device memory (a captured step's input).
template <int T>
__device__ __forceinline__ void embed_rows(const void* q, const void* hi, const void* sc, const void* d, const int* ids,
                                           int batch, int K, float* out) {
    const WeightView w{q, hi, sc, d};
    const i64 units = (i64)batch * (K / UNIT);
    for (i64 task = (i64)blockIdx.x * blockDim.x + threadIdx.x; task < units; task += (i64)gridDim.x * blockDim.x) {
        const int b = (int)(task / (K / UNIT)), u = (int)(task % (K / UNIT));
        float v[UNIT];
        unit_values<T>(weight_row<T>(w, ids[b], K), u, v);
        int4* dst = reinterpret_cast<int4*>(out + (i64)b * K + UNIT * u);
#pragma unroll
        for (int c = 0; c < UNIT / 4; ++c)
            dst[c] = make_int4((int)as_bits(v[4 * c]), (int)as_bits(v[4 * c + 1]), (int)as_bits(v[4 * c + 2]),
                               (int)as_bits(v[4 * c + 3]));
    }
}

#define EMBER_EMBED(NAME, T)                                                                                    \
    extern "C" __global__ void NAME(const void* q, const void* hi, const void* sc, const void* d, const int* ids, \
                                    int batch, int K, float* out) {                                             \
        embed_rows<T>(q, hi, sc, d, ids, batch, K, out);                                                        \
    }
#endif
