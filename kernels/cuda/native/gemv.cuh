// Decode GEMV: y[b, n] = sum_k W[n, k] x[b, k] for a batch of B <= 8 rows, the weights read once for
// the whole batch. One warp per output row; each lane walks the row 32 values at a time (16-byte
// loads, two units in flight), dotting quantized weights with q8_1 activations by dp4a and float
// weights with float activations. Epilogues fuse what follows the matmul in a layer:
//   STORE   y = W x
//   ADD     y += W x          (out-proj and down into the residual stream)
//   SWIGLU  y = silu(G x) * (U x), G and U two weights of one shape (the FFN's gate and up)
#pragma once
#include "weights.cuh"

enum Epilogue { EPI_STORE = 0, EPI_ADD = 1, EPI_SWIGLU = 2 };

// Rows per block of 128 threads. No kernel declares __launch_bounds__: with one, ptxas aimed at a
// register count for occupancy and spilled, or outlined shuffles into calls that save registers in local
// memory (tests/cuda/test_native_kernels.py checks both on every architecture).
enum : int { GEMV_WARPS = 4 };
__host__ __device__ constexpr bool is_quantized(int t) { return t != W_F16 && t != W_BF16; }

// Lane `lane`'s partial sums for row `row`: acc[b] for W, acc2[b] for the second weight when TWO.
// Quantized types read xq [B, K] int8 and xd [B, K/32] (scale, scale * sum); float types read xf [B, K].
template <int T, int B, bool TWO>
EMBER_HD void gemv_lane(const WeightView& w, const WeightView& w2, const i8* xq, const float2* xd, const float* xf,
                        i64 row, int lane, int K, float acc[B], float acc2[B]) {
    const int units = K / UNIT;
    const WeightRow r = weight_row<T>(w, row, K), r2 = weight_row<T>(w2, row, K);
    // Two units in flight while the batch is small; past that the batch's own loads keep the memory
    // busy, and a second unit's registers would spill.
    constexpr int IN_FLIGHT = B * (TWO ? 2 : 1) <= 4 ? 2 : 1;
#pragma unroll IN_FLIGHT
    for (int u = lane; u < units; u += WARP) {
        if constexpr (is_quantized(T)) {
            const Unit q = load_unit<T>(r, u);
            Unit q2;
            if constexpr (TWO) q2 = load_unit<T>(r2, u);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const i8* a = xq + b * K + UNIT * u;
                const int4 a0 = load16(a), a1 = load16(a + 16);
                const float2 s = xd[b * units + u];
                acc[b] += unit_dot(q, a0, a1, s);
                if constexpr (TWO) acc2[b] += unit_dot(q2, a0, a1, s);
            }
        } else {
            const FloatUnit f = load_float_unit(r, u);
            FloatUnit f2;
            if constexpr (TWO) f2 = load_float_unit(r2, u);
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const float* x = xf + b * K + UNIT * u;
                acc[b] += float_unit_dot<T>(f, x);
                if constexpr (TWO) acc2[b] += float_unit_dot<T>(f2, x);
            }
        }
    }
}

// What lane b writes for batch row b once the warp has its totals.
template <int EPI>
EMBER_HD void gemv_store(float* y, i64 at, float total, float total2) {
    if constexpr (EPI == EPI_STORE) y[at] = total;
    else if constexpr (EPI == EPI_ADD) y[at] += total;
    else y[at] = silu(total) * total2;
}

#ifdef __CUDACC__
template <int T, int B, int EPI>
__device__ __forceinline__ void gemv_kernel(const void* q, const void* hi, const void* sc, const void* d, const void* q2,
                                            const void* hi2, const void* sc2, const void* d2, const i8* xq,
                                            const float2* xd, const float* xf, float* y, int N, int K) {
    const int lane = threadIdx.x % WARP;
    const i64 row = (i64)blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    if (row >= N) return;
    constexpr bool TWO = EPI == EPI_SWIGLU;
    float acc[B], acc2[B];
#pragma unroll
    for (int b = 0; b < B; ++b) acc[b] = acc2[b] = 0.0f;
    gemv_lane<T, B, TWO>(WeightView{q, hi, sc, d}, WeightView{q2, hi2, sc2, d2}, xq, xd, xf, row, lane, K, acc, acc2);
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const float total = warp_sum(acc[b]), total2 = TWO ? warp_sum(acc2[b]) : 0.0f;
        if (lane == b) gemv_store<EPI>(y, (i64)b * N + row, total, total2);
    }
}

#define EMBER_GEMV(NAME, T, B, EPI)                                                                            \
    extern "C" __global__ void                                                                                 \
        NAME(const void* q, const void* hi, const void* sc, const void* d, const void* q2, const void* hi2,    \
             const void* sc2, const void* d2, const i8* xq, const float2* xd, const float* xf, float* y, int N, \
             int K) {                                                                                          \
        gemv_kernel<T, B, EPI>(q, hi, sc, d, q2, hi2, sc2, d2, xq, xd, xf, y, N, K);                           \
    }
#endif
