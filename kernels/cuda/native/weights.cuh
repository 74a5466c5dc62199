// One lane's view of a weight row: the repacked layouts of kernels/cuda/repack.py, read 32 values (a
// "unit") at a time with 16-byte loads, and the unit's dot product with q8_1 activations by dp4a.
//
// Layouts (N rows of K values; every array 16-byte aligned, rows contiguous):
//   F16 / BF16  q: u16 bits [N, K]
//   Q8_0        q: int8 [N, K]                  sc: f16 [N, K/32]
//   Q4_K        q: u8 [N, K/2], unit u in bytes 16u..16u+15, byte i = value i | value 16+i << 4
//               sc: the 16-byte head of each ggml super-block (d, dmin, 12 bytes of 6-bit scales/mins)
//   Q5_K        as Q4_K, and hi: u32 [N, K/32], bit i = bit 4 of the unit's value i
//   Q6_K        q: as Q4_K (the low 4 bits)    hi: u8 [N, K/4], unit u in bytes 8u..8u+7, byte k bits
//               2f..2f+1 = the high 2 bits of value 4k+f      sc: int8 [N, K/16]    d: f16 [N, K/256]
#pragma once
#include "common.cuh"

struct WeightView {
    const void* q;
    const void* hi;
    const void* sc;
    const void* d;
};

// One row of a weight: its arrays' row starts, computed once per row so that unit loads add 32-bit
// offsets only.
struct WeightRow {
    const u8* q;
    const u8* hi;
    const u8* sc;
    const u16* d;
};

template <int T>
EMBER_HD WeightRow weight_row(const WeightView& w, i64 row, int K) {
    WeightRow r;
    if constexpr (T == W_F16 || T == W_BF16) {
        r.q = (const u8*)w.q + row * K * 2;
        r.hi = r.sc = nullptr;
        r.d = nullptr;
    } else if constexpr (T == W_Q8_0) {
        r.q = (const u8*)w.q + row * K;
        r.sc = (const u8*)w.sc + row * (K / UNIT) * 2;
        r.hi = nullptr;
        r.d = nullptr;
    } else {
        r.q = (const u8*)w.q + row * (K / 2);
        r.hi = T == W_Q5_K ? (const u8*)w.hi + row * (K / UNIT) * 4 : (const u8*)w.hi + row * (K / 4);
        r.sc = T == W_Q6_K ? (const u8*)w.sc + row * (K / 16) : (const u8*)w.sc + row * (K / 256) * 16;
        r.d = T == W_Q6_K ? (const u16*)w.d + row * (K / 256) : nullptr;
    }
    return r;
}

// A unit as signed bytes: value v of the unit is a*q[v] - m for v < 16 and b*q[v] - m for v >= 16,
// q[k] holding values 4k..4k+3 (q[4 + k]: 16 + 4k..).
struct Unit {
    int q[8];
    float a, b, m;
};

// 4 bits (values 4k..4k+3's bit) to bit 4 of each byte
EMBER_HD int spread4(u32 n) { return (int)(((n * 0x00204081u) & 0x01010101u) << 4); }

// 4 two-bit fields of a byte to bits 4-5 of each byte
EMBER_HD int spread2(u32 b) { return (int)(((b << 4) | (b << 10) | (b << 16) | (b << 22)) & 0x30303030u); }

// ggml's get_scale_min_k4 for sub-block j, from the 12 scale bytes held in words y, z, w
EMBER_HD void scale_min_k4(int j, u32 y, u32 z, u32 w, int& sc, int& m) {
    const int shift = 8 * (j & 3);
    const u32 by = (y >> shift) & 0xff, bz = (z >> shift) & 0xff, bw = (w >> shift) & 0xff;
    if (j < 4) {
        sc = (int)(by & 63);
        m = (int)(bz & 63);
    } else {
        sc = (int)((bw & 0xf) | ((by >> 6) << 4));
        m = (int)((bw >> 4) | ((bz >> 6) << 4));
    }
}

EMBER_HD void split_nibbles(int4 v, Unit& u) {
    const int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u.q[k] = w[k] & 0x0f0f0f0f;
        u.q[4 + k] = (w[k] >> 4) & 0x0f0f0f0f;
    }
}

EMBER_HD void k_quant_head(const WeightRow& w, int u, Unit& out) {
    const int4 h = load16(w.sc + (u / 8) * 16);
    int sc, m;
    scale_min_k4(u & 7, (u32)h.y, (u32)h.z, (u32)h.w, sc, m);
    const float d = f16_to_f32((u16)((u32)h.x & 0xffff)), dmin = f16_to_f32((u16)((u32)h.x >> 16));
    out.a = out.b = d * (float)sc;
    out.m = dmin * (float)m;
}

template <int T>
EMBER_HD Unit load_unit(const WeightRow& w, int u) {
    Unit out;
    if constexpr (T == W_Q8_0) {
        const int4 v0 = load16(w.q + UNIT * u), v1 = load16(w.q + UNIT * u + 16);
        out.q[0] = v0.x; out.q[1] = v0.y; out.q[2] = v0.z; out.q[3] = v0.w;
        out.q[4] = v1.x; out.q[5] = v1.y; out.q[6] = v1.z; out.q[7] = v1.w;
        out.a = out.b = f16_to_f32(((const u16*)w.sc)[u]);
        out.m = 0.0f;
    } else if constexpr (T == W_Q4_K || T == W_Q5_K) {
        split_nibbles(load16(w.q + 16 * u), out);
        if constexpr (T == W_Q5_K) {
            const u32 h = ((const u32*)w.hi)[u];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                out.q[k] |= spread4((h >> (4 * k)) & 0xf);
                out.q[4 + k] |= spread4((h >> (16 + 4 * k)) & 0xf);
            }
        }
        k_quant_head(w, u, out);
    } else {  // W_Q6_K
        static_assert(T == W_Q6_K, "load_unit: a quantized type");
        split_nibbles(load16(w.q + 16 * u), out);
        const uint2 h = load8(w.hi + 8 * u);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            out.q[k] = vsub4(out.q[k] | spread2((h.x >> (8 * k)) & 0xff), 0x20202020);
            out.q[4 + k] = vsub4(out.q[4 + k] | spread2((h.y >> (8 * k)) & 0xff), 0x20202020);
        }
        const u16 s = ((const u16*)w.sc)[u];
        const float d = f16_to_f32(w.d[u / 8]);
        out.a = d * (float)(i8)(s & 0xff);
        out.b = d * (float)(i8)(s >> 8);
        out.m = 0.0f;
    }
    return out;
}

// The unit's dot product with one activation unit: q8_1 quants a0 (values 0-15), a1 (16-31) and
// xd = (scale, scale * sum of the quants).
EMBER_HD float unit_dot(const Unit& u, int4 a0, int4 a1, float2 xd) {
    int lo = dp4a(u.q[0], a0.x, 0);
    lo = dp4a(u.q[1], a0.y, lo);
    lo = dp4a(u.q[2], a0.z, lo);
    lo = dp4a(u.q[3], a0.w, lo);
    int hi = dp4a(u.q[4], a1.x, 0);
    hi = dp4a(u.q[5], a1.y, hi);
    hi = dp4a(u.q[6], a1.z, hi);
    hi = dp4a(u.q[7], a1.w, hi);
    return xd.x * (u.a * (float)lo + u.b * (float)hi) - u.m * xd.y;
}

// A float unit: 32 weights as 16 words of f16 or bf16 bits, converted as they are used.
struct FloatUnit {
    u32 w[16];
};

EMBER_HD FloatUnit load_float_unit(const WeightRow& w, int u) {
    FloatUnit out;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const int4 v = load16(w.q + 64 * u + 16 * c);
        out.w[4 * c] = (u32)v.x; out.w[4 * c + 1] = (u32)v.y; out.w[4 * c + 2] = (u32)v.z; out.w[4 * c + 3] = (u32)v.w;
    }
    return out;
}

template <int T>
EMBER_HD float float_value(const FloatUnit& f, int i) {
    const u16 bits = (u16)(f.w[i / 2] >> (16 * (i % 2)));
    return T == W_F16 ? f16_to_f32(bits) : bf16_to_f32(bits);
}

template <int T>
EMBER_HD float float_unit_dot(const FloatUnit& f, const float* x) {
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < UNIT / 4; ++c) {
        const int4 v = load16(x + 4 * c);
        acc += float_value<T>(f, 4 * c) * as_float((u32)v.x) + float_value<T>(f, 4 * c + 1) * as_float((u32)v.y) +
               float_value<T>(f, 4 * c + 2) * as_float((u32)v.z) + float_value<T>(f, 4 * c + 3) * as_float((u32)v.w);
    }
    return acc;
}

// Unit u of a row as floats (for the prefill dequantization and the tests).
template <int T>
EMBER_HD void unit_values(const WeightRow& w, int u, float out[UNIT]) {
    if constexpr (T == W_F16 || T == W_BF16) {
        const FloatUnit f = load_float_unit(w, u);
#pragma unroll
        for (int i = 0; i < UNIT; ++i) out[i] = float_value<T>(f, i);
    } else {
        const Unit q = load_unit<T>(w, u);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
#pragma unroll
            for (int byte = 0; byte < 4; ++byte) {
                const int v = (int)(i8)(q.q[k] >> (8 * byte));
                out[4 * k + byte] = (k < 4 ? q.a : q.b) * (float)v - q.m;
            }
        }
    }
}
