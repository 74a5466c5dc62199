// ember's CUDA C++ basics, shared by NVRTC (CuPy RawModule at first use), nvcc (the cubin and SASS
// checks) and the host harness (tests/cuda: the same per-thread arithmetic run on the CPU, lane by lane).
// NVRTC has no standard headers, so nothing here includes one; every helper whose arithmetic a test
// must see is __host__ __device__, with the device instruction under __CUDA_ARCH__ and its exact
// scalar meaning beside it for the host.
#pragma once

#define EMBER_HD __host__ __device__ __forceinline__

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// Weight storage types. The numbers are kernels/cuda/quant_matmul.py's format codes.
enum WType { W_F16 = 1, W_BF16 = 2, W_Q8_0 = 3, W_Q4_K = 4, W_Q5_K = 5, W_Q6_K = 6 };
// KV-cache dtypes, in kernels/convert.py's KV_DTYPES order.
enum KvType { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3 };

enum : int {
    WARP = 32,
    UNIT = 32,  // values a lane takes from a weight row at a time: one q8_0 block, one K-quant sub-block
};

EMBER_HD float as_float(u32 u) {
#ifdef __CUDA_ARCH__
    return __int_as_float((int)u);
#else
    union { u32 u; float f; } c;
    c.u = u;
    return c.f;
#endif
}

EMBER_HD u32 as_bits(float f) {
#ifdef __CUDA_ARCH__
    return (u32)__float_as_int(f);
#else
    union { u32 u; float f; } c;
    c.f = f;
    return c.u;
#endif
}

EMBER_HD float f16_to_f32(u16 h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const u32 sign = (u32)(h & 0x8000) << 16;
    u32 e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return as_float(sign | 0x7f800000 | (m << 13));
    if (e == 0) {
        if (m == 0) return as_float(sign);
        e = 113;  // a subnormal: normalise the mantissa
        while (!(m & 0x400)) { m <<= 1; --e; }
        return as_float(sign | (e << 23) | ((m & 0x3ff) << 13));
    }
    return as_float(sign | ((e + 112) << 23) | (m << 13));
#endif
}

EMBER_HD float bf16_to_f32(u16 h) { return as_float((u32)h << 16); }

EMBER_HD u32 round_shift(u32 m, int shift) {  // m >> shift, to nearest, ties to even
    const u32 out = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return out + ((rem > half || (rem == half && (out & 1))) ? 1 : 0);
}

// float32 -> IEEE half bits, to nearest even: kernels/convert.py's f32_to_f16_bits, bit for bit, NaN
// payloads included (cvt.rn.f16.f32 would canonicalise them). Integer work, the same on host and device.
EMBER_HD u16 f32_to_f16(float f) {
    const u32 u = as_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffff;
    if (a > 0x7f800000) return (u16)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000) return (u16)(sign | 0x7c00);
    if (a >= 0x38800000) return (u16)(sign | round_shift(a - 0x38000000, 13));
    if (a <= 0x33000000) return (u16)sign;
    const u32 e = a >> 23;
    return (u16)(sign | round_shift((a & 0x7fffff) | 0x800000, 126 - (int)e));
}

// float32 -> bfloat16 bits as ggml_compute_fp32_to_bf16 (NaN kept quiet, else to nearest even).
EMBER_HD u16 f32_to_bf16(float f) {
    const u32 u = as_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (u16)((u >> 16) | 0x40);
    return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// The dot product of four signed bytes, accumulated into c: one IDP.4A on the device.
EMBER_HD int dp4a(int a, int b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; ++i) c += (int)(i8)(a >> (8 * i)) * (int)(i8)(b >> (8 * i));
    return c;
#endif
}

// Bytewise a - b, each byte wrapping on its own (no borrow between bytes).
EMBER_HD int vsub4(int a, int b) {
#ifdef __CUDA_ARCH__
    return (int)__vsub4((unsigned)a, (unsigned)b);
#else
    u32 out = 0;
    for (int i = 0; i < 4; ++i) out |= (((u32)a >> (8 * i)) - ((u32)b >> (8 * i)) & 0xffu) << (8 * i);
    return (int)out;
#endif
}

// One 16-byte load (LDG.E.128 through the read-only path on the device); p must be 16-byte aligned.
EMBER_HD int4 load16(const void* p) {
#ifdef __CUDA_ARCH__
    return __ldg(reinterpret_cast<const int4*>(p));
#else
    return *reinterpret_cast<const int4*>(p);
#endif
}

EMBER_HD uint2 load8(const void* p) {
#ifdef __CUDA_ARCH__
    return __ldg(reinterpret_cast<const uint2*>(p));
#else
    return *reinterpret_cast<const uint2*>(p);
#endif
}

EMBER_HD float silu(float x) { return x / (1.0f + expf(-x)); }

#ifdef __CUDACC__
// Butterfly sums over the lanes of a warp (every lane gets the total). The host harness adds in the same
// order: lane l's value after step s is its own plus lane l ^ s's.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
    return v;
}

// Over groups of `width` lanes (a power of two up to 32): every lane gets its group's total.
__device__ __forceinline__ float group_max(float v, int width) {
    for (int s = width >> 1; s > 0; s >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, s));
    return v;
}
#endif
