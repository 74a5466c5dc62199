// The paged KV cache as the native kernels see it: kernels/cuda/paged_attention.py's layout, per layer
// [n_blocks, block_size, kv_heads, head_dim] in f32, f16 or bf16 bits, or q8_0 (int8 values with one
// f16 scale per 32 values of a head, in a second array [n_blocks, block_size, kv_heads, head_dim/32]).
// A lane holds P = head_dim/32 consecutive values of a head: values lane*P .. lane*P + P - 1.
#pragma once
#include "common.cuh"

struct KvView {
    void* data;  // the values, in the store's dtype
    u16* scales;  // q8_0 only
};

// Element index of value `lane * P` of kv head h at cache row `slot` (block * block_size + offset).
EMBER_HD i64 kv_index(i64 slot, int h, int kv_heads, int lane, int P) { return (slot * kv_heads + h) * (32 * P) + lane * P; }

template <int BYTES>
EMBER_HD void load_words(const void* p, u32* w) {
    if constexpr (BYTES >= 16) {
#pragma unroll
        for (int c = 0; c < BYTES / 16; ++c) {
            const int4 v = load16((const u8*)p + 16 * c);
            w[4 * c] = (u32)v.x; w[4 * c + 1] = (u32)v.y; w[4 * c + 2] = (u32)v.z; w[4 * c + 3] = (u32)v.w;
        }
    } else if constexpr (BYTES == 8) {
        const uint2 v = load8(p);
        w[0] = v.x; w[1] = v.y;
    } else if constexpr (BYTES == 4) {
        w[0] = *(const u32*)p;
    } else {
        static_assert(BYTES == 2, "load_words: 2, 4, 8 or a multiple of 16 bytes");
        w[0] = *(const u16*)p;
    }
}

// A lane's P values of one cached head, as floats.
template <int KVT, int P>
EMBER_HD void kv_load(const KvView& kv, i64 slot, int h, int kv_heads, int lane, float out[P]) {
    const i64 at = kv_index(slot, h, kv_heads, lane, P);
    if constexpr (KVT == KV_F32) {
        u32 w[P];
        load_words<4 * P>((const float*)kv.data + at, w);
#pragma unroll
        for (int i = 0; i < P; ++i) out[i] = as_float(w[i]);
    } else if constexpr (KVT == KV_F16 || KVT == KV_BF16) {
        u32 w[(P + 1) / 2];
        load_words<2 * P>((const u16*)kv.data + at, w);
#pragma unroll
        for (int i = 0; i < P; ++i) {
            const u16 bits = (u16)(w[i / 2] >> (16 * (i % 2)));
            out[i] = KVT == KV_F16 ? f16_to_f32(bits) : bf16_to_f32(bits);
        }
    } else {
        static_assert(KVT == KV_Q8_0, "kv_load: a KV dtype");
        u32 w[(P + 3) / 4];
        load_words<P>((const i8*)kv.data + at, w);
        const float d = f16_to_f32(kv.scales[at / 32]);
#pragma unroll
        for (int i = 0; i < P; ++i) out[i] = d * (float)(i8)(w[i / 4] >> (8 * (i % 4)));
    }
}

// q8_0 of one value given its group's absolute maximum, as ggml's quantize_row_q8_0_ref (and
// kernels/convert.py): d = amax / 127, q = roundf(x * (1 / d)), a non-finite product stored as 0.
EMBER_HD float q8_0_scale(float amax) { return amax / 127.0f; }

EMBER_HD int q8_0_value(float x, float d) {
    const float id = d != 0.0f ? 1.0f / d : 0.0f, v = x * id;
    return (v - v == 0.0f) ? (int)roundf(v) : 0;  // v - v is NaN for inf and NaN
}

// Store a lane's P values of one head; for q8_0, amax is the maximum |value| over the lane's 32-value
// group (the caller reduces it over 32 / P lanes) and the group's first lane writes the scale.
template <int KVT, int P>
EMBER_HD void kv_store(const KvView& kv, i64 slot, int h, int kv_heads, int lane, const float v[P], float amax) {
    const i64 at = kv_index(slot, h, kv_heads, lane, P);
    if constexpr (KVT == KV_F32) {
#pragma unroll
        for (int i = 0; i < P; ++i) ((float*)kv.data)[at + i] = v[i];
    } else if constexpr (KVT == KV_F16 || KVT == KV_BF16) {
#pragma unroll
        for (int i = 0; i < P; ++i) ((u16*)kv.data)[at + i] = KVT == KV_F16 ? f32_to_f16(v[i]) : f32_to_bf16(v[i]);
    } else {
        const float d = q8_0_scale(amax);
#pragma unroll
        for (int i = 0; i < P; ++i) ((i8*)kv.data)[at + i] = (i8)q8_0_value(v[i], d);
        if (at % 32 == 0) kv.scales[at / 32] = f32_to_f16(d);
    }
}
