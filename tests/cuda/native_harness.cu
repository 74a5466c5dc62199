// The host harness of kernels/cuda/native: the kernels' per-thread arithmetic (the __host__ __device__
// functions of the headers) run on the CPU, lane by lane, with each warp reduction replayed in the
// device's butterfly order. tests/cuda/native_harness.py builds it with nvcc into a shared library and
// compares it with numpy; only the loops over lanes, warps and blocks are written here a second time.
#include "activations.cuh"
#include "attention.cuh"
#include "dequantize.cuh"
#include "gemv.cuh"
#include "qk_rope_kv.cuh"
#include "sample.cuh"

#include <cmath>
#include <vector>

namespace {

// __shfl_xor_sync butterflies over 32 lane values: after step s, lane l holds its value op lane l ^ s's.
void butterfly_sum(float* v, int width = WARP) {
    for (int s = width >> 1; s > 0; s >>= 1) {
        float next[WARP];
        for (int l = 0; l < WARP; ++l) next[l] = v[l] + v[l ^ s];
        for (int l = 0; l < WARP; ++l) v[l] = next[l];
    }
}

void butterfly_max(float* v, int width = WARP) {
    for (int s = width >> 1; s > 0; s >>= 1) {
        float next[WARP];
        for (int l = 0; l < WARP; ++l) next[l] = fmaxf(v[l], v[l ^ s]);
        for (int l = 0; l < WARP; ++l) v[l] = next[l];
    }
}

template <int T, int B, int EPI>
void gemv(WeightView w, WeightView w2, const i8* xq, const float2* xd, const float* xf, float* y, int N, int K) {
    constexpr bool TWO = EPI == EPI_SWIGLU;
    for (i64 row = 0; row < N; ++row) {
        float acc[WARP][B] = {}, acc2[WARP][B] = {};
        for (int lane = 0; lane < WARP; ++lane) gemv_lane<T, B, TWO>(w, w2, xq, xd, xf, row, lane, K, acc[lane], acc2[lane]);
        for (int b = 0; b < B; ++b) {
            float lanes[WARP], lanes2[WARP];
            for (int l = 0; l < WARP; ++l) {
                lanes[l] = acc[l][b];
                lanes2[l] = acc2[l][b];
            }
            butterfly_sum(lanes);
            butterfly_sum(lanes2);
            gemv_store<EPI>(y, (i64)b * N + row, lanes[b], TWO ? lanes2[b] : 0.0f);
        }
    }
}

template <int T, int B>
void gemv_epilogue(int epi, WeightView w, WeightView w2, const i8* xq, const float2* xd, const float* xf, float* y, int N,
                   int K) {
    if (epi == EPI_STORE) gemv<T, B, EPI_STORE>(w, w2, xq, xd, xf, y, N, K);
    else if (epi == EPI_ADD) gemv<T, B, EPI_ADD>(w, w2, xq, xd, xf, y, N, K);
    else gemv<T, B, EPI_SWIGLU>(w, w2, xq, xd, xf, y, N, K);
}

template <int T>
int gemv_batch(int batch, int epi, WeightView w, WeightView w2, const i8* xq, const float2* xd, const float* xf, float* y,
               int N, int K) {
    switch (batch) {
        case 1: gemv_epilogue<T, 1>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 2: gemv_epilogue<T, 2>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 3: gemv_epilogue<T, 3>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 4: gemv_epilogue<T, 4>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 5: gemv_epilogue<T, 5>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 6: gemv_epilogue<T, 6>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 7: gemv_epilogue<T, 7>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
        case 8: gemv_epilogue<T, 8>(epi, w, w2, xq, xd, xf, y, N, K); return 0;
    }
    return 1;
}

template <int T>
void unit_values_all(WeightView w, i64 row0, int rows, int K, float* out) {
    for (i64 r = 0; r < rows; ++r)
        for (int u = 0; u < K / UNIT; ++u) unit_values<T>(weight_row<T>(w, row0 + r, K), u, out + r * K + UNIT * u);
}

template <int KVT, int P, int HPB>
void attention(const float* q, KvView k, KvView v, const int* tables, const int* lengths, int table_width, int block_size,
               int q_heads, int kv_heads, float scale, int splits, int batch, float* part_acc, float2* part_ml) {
    constexpr int D = 32 * P;
    const int group = q_heads / kv_heads, hgroups = (group + HPB - 1) / HPB;
    for (int b = 0; b < batch; ++b) {
        const int length = lengths[b];
        for (int s = 0; s < splits; ++s) {
            int start, end;
            split_range(length, s, splits, start, end);
            if (start >= end) continue;
            for (int x = 0; x < kv_heads * hgroups; ++x) {  // one block
                const int kvh = x / hgroups, h0 = kvh * group + (x % hgroups) * HPB;
                const int nh = group - (x % hgroups) * HPB < HPB ? group - (x % hgroups) * HPB : HPB;
                static float sm_m[ATTN_WARPS][HPB], sm_l[ATTN_WARPS][HPB], sm_acc[ATTN_WARPS][HPB][D];
                for (int warp = 0; warp < ATTN_WARPS; ++warp) {
                    float qs[WARP][HPB][P], acc[WARP][HPB][P], m[WARP][HPB], l[WARP][HPB];
                    for (int lane = 0; lane < WARP; ++lane)
                        for (int h = 0; h < HPB; ++h) {
                            m[lane][h] = -INFINITY;
                            l[lane][h] = 0.0f;
                            for (int i = 0; i < P; ++i) {
                                qs[lane][h][i] = h < nh ? q[((i64)b * q_heads + h0 + h) * D + lane * P + i] * scale : 0.0f;
                                acc[lane][h][i] = 0.0f;
                            }
                        }
                    const int* table = tables + (i64)b * table_width;
                    constexpr int KEYS = P <= 4 ? 4 : (P == 8 ? 2 : 1);  // the kernel's keys in flight
                    for (int t0 = start + warp; t0 < end; t0 += ATTN_WARPS * KEYS) {
                        static float kf[KEYS][WARP][P], vf[KEYS][WARP][P];
                        for (int j = 0; j < KEYS; ++j) {
                            const int t = t0 + j * ATTN_WARPS;
                            if (t >= end) continue;
                            const i64 slot = (i64)table[t / block_size] * block_size + t % block_size;
                            for (int lane = 0; lane < WARP; ++lane) {
                                kv_load<KVT, P>(k, slot, kvh, kv_heads, lane, kf[j][lane]);
                                kv_load<KVT, P>(v, slot, kvh, kv_heads, lane, vf[j][lane]);
                            }
                        }
                        for (int j = 0; j < KEYS; ++j) {
                            if (t0 + j * ATTN_WARPS >= end) break;
                            for (int h = 0; h < HPB; ++h) {
                                float dots[WARP];
                                for (int lane = 0; lane < WARP; ++lane) {
                                    float dot = 0.0f;
                                    for (int i = 0; i < P; ++i) dot += qs[lane][h][i] * kf[j][lane][i];
                                    dots[lane] = dot;
                                }
                                butterfly_sum(dots);
                                if (h < nh)
                                    for (int lane = 0; lane < WARP; ++lane)
                                        softmax_step<P>(dots[lane], vf[j][lane], m[lane][h], l[lane][h], acc[lane][h]);
                            }
                        }
                    }
                    for (int h = 0; h < HPB; ++h) {
                        sm_m[warp][h] = m[0][h];
                        sm_l[warp][h] = l[0][h];
                        for (int lane = 0; lane < WARP; ++lane)
                            for (int i = 0; i < P; ++i) sm_acc[warp][h][lane * P + i] = acc[lane][h][i];
                    }
                }
                for (int item = 0; item < nh * D; ++item) {
                    const int h = item / D, j = item % D;
                    float top = -INFINITY;
                    for (int w = 0; w < ATTN_WARPS; ++w) top = fmaxf(top, sm_m[w][h]);
                    float sum = 0.0f, o = 0.0f;
                    for (int w = 0; w < ATTN_WARPS; ++w) {
                        const float weight = sm_l[w][h] > 0.0f ? expf(sm_m[w][h] - top) : 1.0f;
                        sum += sm_l[w][h] * weight;
                        o += sm_acc[w][h][j] * weight;
                    }
                    const i64 row = ((i64)b * q_heads + h0 + h) * splits + s;
                    part_acc[row * D + j] = o;
                    if (j == 0) part_ml[row] = make_float2(top, sum);
                }
            }
        }
    }
}

void attention_combine(const float* part_acc, const float2* part_ml, const int* lengths, int q_heads, int D, int splits,
                       int batch, float* out) {
    for (int b = 0; b < batch; ++b) {
        const int length = lengths[b];
        if (length <= 0) continue;
        const int chunk = (length + splits - 1) / splits, used = (length + chunk - 1) / chunk;
        for (int h = 0; h < q_heads; ++h) {
            const i64 row = ((i64)b * q_heads + h) * splits;
            float top = -INFINITY;
            for (int s = 0; s < used; ++s) top = fmaxf(top, part_ml[row + s].x);
            for (int j = 0; j < D; ++j) {
                float sum = 0.0f, acc = 0.0f;
                for (int s = 0; s < used; ++s) {
                    const float w = expf(part_ml[row + s].x - top);
                    sum += part_ml[row + s].y * w;
                    acc += part_acc[(row + s) * D + j] * w;
                }
                out[((i64)b * q_heads + h) * D + j] = acc / sum;
            }
        }
    }
}

template <int KVT, int P>
void qk_rope_kv(float* q, const float* k, const float* v, const float* q_bias, const float* k_bias, const float* v_bias,
                const float* q_norm, const float* k_norm, float eps, const float* inv_freq, int rot, int interleaved,
                const int* positions, const i64* slots, int q_heads, int kv_heads, int batch, KvView k_cache,
                KvView v_cache) {
    constexpr int D = 32 * P;
    for (int b = 0; b < batch; ++b) {
        const i64 slot = slots[b];
        if (slot < 0) continue;
        for (int head = 0; head < q_heads + 2 * kv_heads; ++head) {
            const int kind = head < q_heads ? 0 : (head < q_heads + kv_heads ? 1 : 2);
            const int h = kind == 0 ? head : (kind == 1 ? head - q_heads : head - q_heads - kv_heads);
            float* src = kind == 0 ? q + ((i64)b * q_heads + h) * D : (float*)(kind == 1 ? k : v) + ((i64)b * kv_heads + h) * D;
            const float* bias = kind == 0 ? q_bias : (kind == 1 ? k_bias : v_bias);
            float x[WARP][P];
            for (int lane = 0; lane < WARP; ++lane)
                for (int i = 0; i < P; ++i) x[lane][i] = src[lane * P + i] + (bias ? bias[h * D + lane * P + i] : 0.0f);
            const float* norm = kind == 0 ? q_norm : (kind == 1 ? k_norm : nullptr);
            if (norm) {
                float ss[WARP];
                for (int lane = 0; lane < WARP; ++lane) {
                    ss[lane] = 0.0f;
                    for (int i = 0; i < P; ++i) ss[lane] += x[lane][i] * x[lane][i];
                }
                butterfly_sum(ss);
                const float scale = 1.0f / sqrtf(ss[0] / (float)D + eps);  // the device's rsqrtf, within 2 ulp
                for (int lane = 0; lane < WARP; ++lane)
                    for (int i = 0; i < P; ++i) x[lane][i] = x[lane][i] * scale * norm[lane * P + i];
            }
            if (kind < 2 && rot > 0) {
                float row[D];
                for (int lane = 0; lane < WARP; ++lane)
                    for (int i = 0; i < P; ++i) row[lane * P + i] = x[lane][i];
                for (int lane = 0; lane < WARP; ++lane)
                    for (int i = 0; i < P; ++i)
                        x[lane][i] = rope_value(row, lane * P + i, rot, interleaved, positions[b], inv_freq);
            }
            if (kind == 0) {
                for (int lane = 0; lane < WARP; ++lane)
                    for (int i = 0; i < P; ++i) src[lane * P + i] = x[lane][i];
                continue;
            }
            float amax[WARP] = {};
            if (KVT == KV_Q8_0) {
                for (int lane = 0; lane < WARP; ++lane)
                    for (int i = 0; i < P; ++i) amax[lane] = fmaxf(amax[lane], fabsf(x[lane][i]));
                butterfly_max(amax, 32 / P);
            }
            for (int lane = 0; lane < WARP; ++lane)
                kv_store<KVT, P>(kind == 1 ? k_cache : v_cache, slot, h, kv_heads, lane, x[lane], amax[lane]);
        }
    }
}

// sample_row's arithmetic in one thread: the same digit walks, thresholds and draw, with sums in order
// (the device adds its histograms with atomics, in any order).
void sample_row_host(const float* x, int vocab, float temperature, int top_k, double top_p, double min_p, double u,
                     int* token, float* value, float* best_out, double* log_total) {
    float best = -INFINITY;
    int at = vocab;
    for (int i = 0; i < vocab; ++i)
        if (x[i] > best || (x[i] == best && i < at)) best = x[i], at = i;
    double lse = 0.0;
    for (int i = 0; i < vocab; ++i) lse += (double)expf(x[i] - best);
    *best_out = best;
    *log_total = log(lse);
    *value = best;
    if (temperature == 0.0f || top_k == 1 || best != best) {
        *token = best != best ? -1 : at;
        return;
    }
    const double t = temperature;
    double z = 0.0;
    for (int i = 0; i < vocab; ++i) z += weight(x[i], best, t);
    auto select = [&](bool sums, double target, int k) -> Prefix {
        u32 prefix = 0, mask = 0;
        int remaining = k, tied = 0;
        double above = 0.0;
        for (int shift = 24; shift >= 0; shift -= 8) {
            u32 counts[256] = {};
            double bins[256] = {};
            for (int i = 0; i < vocab; ++i) {
                const u32 key = order_key(x[i]);
                if ((key & mask) == prefix) {
                    counts[(key >> shift) & 255] += 1;
                    if (sums) bins[(key >> shift) & 255] += weight(x[i], best, t);
                }
            }
            const int digit = sums ? sum_digit(bins, target, above) : count_digit(counts, remaining);
            if (digit < 0) return Prefix{0, 0, true};
            tied = (int)counts[digit];
            prefix |= (u32)digit << shift;
            mask |= 255u << shift;
        }
        if (!sums) return Prefix{prefix, remaining, false};
        return Prefix{prefix, ties_needed(target, above, weight(key_value(prefix), best, t), tied), false};
    };
    Prefix kept{0, 0, true};
    if (top_k > 0 && top_k < vocab) kept = select(false, 0.0, top_k);
    if (top_p < 1.0) kept = shorter(kept, select(true, top_p * z, 0));
    int cutoff = vocab, seen = 0;
    if (!kept.all)
        for (int i = 0; i < vocab; ++i)
            if (order_key(x[i]) == kept.key && ++seen == kept.ties) {
                cutoff = i + 1;
                break;
            }
    double total = 0.0;
    int last = -1;
    for (int i = 0; i < vocab; ++i) {
        const double w = weight(x[i], best, t);
        if (kept_token(order_key(x[i]), i, w, kept, cutoff, z, min_p)) total += w, last = i;
    }
    const double target = u * total;
    double acc = 0.0;
    *token = last;
    if (last >= 0) *value = x[last];
    for (int i = 0; i < vocab; ++i) {
        const double w = weight(x[i], best, t);
        if (kept_token(order_key(x[i]), i, w, kept, cutoff, z, min_p) && (acc += w) > target) {
            *token = i;
            *value = x[i];
            return;
        }
    }
}

}  // namespace

extern "C" {

int harness_gemv(int type, int batch, int epi, const void* q, const void* hi, const void* sc, const void* d, const void* q2,
                 const void* hi2, const void* sc2, const void* d2, const i8* xq, const float2* xd, const float* xf, float* y,
                 int N, int K) {
    const WeightView w{q, hi, sc, d}, w2{q2, hi2, sc2, d2};
    switch (type) {
        case W_F16: return gemv_batch<W_F16>(batch, epi, w, w2, xq, xd, xf, y, N, K);
        case W_BF16: return gemv_batch<W_BF16>(batch, epi, w, w2, xq, xd, xf, y, N, K);
        case W_Q8_0: return gemv_batch<W_Q8_0>(batch, epi, w, w2, xq, xd, xf, y, N, K);
        case W_Q4_K: return gemv_batch<W_Q4_K>(batch, epi, w, w2, xq, xd, xf, y, N, K);
        case W_Q5_K: return gemv_batch<W_Q5_K>(batch, epi, w, w2, xq, xd, xf, y, N, K);
        case W_Q6_K: return gemv_batch<W_Q6_K>(batch, epi, w, w2, xq, xd, xf, y, N, K);
    }
    return 1;
}

int harness_unit_values(int type, const void* q, const void* hi, const void* sc, const void* d, int N, int K, float* out) {
    const WeightView w{q, hi, sc, d};
    switch (type) {
        case W_F16: unit_values_all<W_F16>(w, 0, N, K, out); return 0;
        case W_BF16: unit_values_all<W_BF16>(w, 0, N, K, out); return 0;
        case W_Q8_0: unit_values_all<W_Q8_0>(w, 0, N, K, out); return 0;
        case W_Q4_K: unit_values_all<W_Q4_K>(w, 0, N, K, out); return 0;
        case W_Q5_K: unit_values_all<W_Q5_K>(w, 0, N, K, out); return 0;
        case W_Q6_K: unit_values_all<W_Q6_K>(w, 0, N, K, out); return 0;
    }
    return 1;
}

// norm_quantize's arithmetic: the RMS scale (the device's rsqrtf within 2 ulp), then per unit the amax,
// the scale and the quants exactly as the device computes them.
void harness_norm_quantize(int norm, int batch, const float* x, const float* weight, float eps, int K, float* xf, i8* xq,
                           float2* xd) {
    for (i64 b = 0; b < batch; ++b) {
        const float* row = x + b * K;
        float scale = 1.0f;
        if (norm) {
            float ss = 0.0f;
            for (int i = 0; i < K; ++i) ss += row[i] * row[i];
            scale = 1.0f / sqrtf(ss / (float)K + eps);
        }
        for (int u = 0; u < K / UNIT; ++u) {
            float v[WARP], mag[WARP], qsum[WARP];
            for (int lane = 0; lane < WARP; ++lane) {
                const int i = UNIT * u + lane;
                v[lane] = norm ? row[i] * scale * weight[i] : row[i];
                if (xf) xf[b * K + i] = v[lane];
                mag[lane] = fabsf(v[lane]);
            }
            butterfly_max(mag);
            const float dscale = q8_0_scale(mag[0]);
            for (int lane = 0; lane < WARP; ++lane) {
                const int q = q8_0_value(v[lane], dscale);
                xq[b * K + UNIT * u + lane] = (i8)q;
                qsum[lane] = (float)q;
            }
            butterfly_sum(qsum);
            xd[b * (K / UNIT) + u] = make_float2(dscale, dscale * qsum[0]);
        }
    }
}

#define ATTN_CASE(KVT, P, HPB)                                                                                           \
    if (kvt == KVT && p == P && hpb == HPB) {                                                                            \
        attention<KVT, P, HPB>(q, k, v, tables, lengths, table_width, block_size, q_heads, kv_heads, scale, splits, batch, \
                               part_acc, part_ml);                                                                       \
        return 0;                                                                                                        \
    }
#define ATTN_KV(KVT) ATTN_CASE(KVT, 2, 1) ATTN_CASE(KVT, 2, 2) ATTN_CASE(KVT, 2, 4) ATTN_CASE(KVT, 2, 8) \
    ATTN_CASE(KVT, 4, 1) ATTN_CASE(KVT, 4, 2) ATTN_CASE(KVT, 4, 4) ATTN_CASE(KVT, 4, 8)                    \
    ATTN_CASE(KVT, 8, 1) ATTN_CASE(KVT, 8, 2) ATTN_CASE(KVT, 8, 4) ATTN_CASE(KVT, 16, 1) ATTN_CASE(KVT, 16, 2)

int harness_attention(int kvt, int p, int hpb, int splits, int batch, const float* q, void* k_data, u16* k_scales,
                      void* v_data, u16* v_scales, const int* tables, const int* lengths, int table_width, int block_size,
                      int q_heads, int kv_heads, float scale, float* part_acc, float2* part_ml) {
    const KvView k{k_data, k_scales}, v{v_data, v_scales};
    ATTN_KV(KV_F32) ATTN_KV(KV_F16) ATTN_KV(KV_BF16) ATTN_KV(KV_Q8_0)
    return 1;
}

void harness_attention_combine(int batch, const float* part_acc, const float2* part_ml, const int* lengths, int q_heads,
                               int head_dim, int splits, float* out) {
    attention_combine(part_acc, part_ml, lengths, q_heads, head_dim, splits, batch, out);
}

#define ROPE_CASE(KVT, P)                                                                                              \
    if (kvt == KVT && p == P) {                                                                                        \
        qk_rope_kv<KVT, P>(q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, inv_freq, rot, interleaved, positions, \
                           slots, q_heads, kv_heads, batch, kc, vc);                                                   \
        return 0;                                                                                                      \
    }
#define ROPE_KV(KVT) ROPE_CASE(KVT, 2) ROPE_CASE(KVT, 4) ROPE_CASE(KVT, 8) ROPE_CASE(KVT, 16)

int harness_qk_rope_kv(int kvt, int p, int batch, float* q, const float* k, const float* v, const float* q_bias,
                       const float* k_bias, const float* v_bias, const float* q_norm, const float* k_norm, float eps,
                       const float* inv_freq, int rot, int interleaved, const int* positions, const i64* slots, int q_heads,
                       int kv_heads, void* k_data, u16* k_scales, void* v_data, u16* v_scales) {
    const KvView kc{k_data, k_scales}, vc{v_data, v_scales};
    ROPE_KV(KV_F32) ROPE_KV(KV_F16) ROPE_KV(KV_BF16) ROPE_KV(KV_Q8_0)
    return 1;
}

int harness_dequantize_f16(int type, const void* q, const void* hi, const void* sc, const void* d, i64 row0, int rows,
                           int K, u16* out) {
    std::vector<float> values((size_t)rows * K);
    const WeightView w{q, hi, sc, d};
    switch (type) {
        case W_F16: unit_values_all<W_F16>(w, row0, rows, K, values.data()); break;
        case W_BF16: unit_values_all<W_BF16>(w, row0, rows, K, values.data()); break;
        case W_Q8_0: unit_values_all<W_Q8_0>(w, row0, rows, K, values.data()); break;
        case W_Q4_K: unit_values_all<W_Q4_K>(w, row0, rows, K, values.data()); break;
        case W_Q5_K: unit_values_all<W_Q5_K>(w, row0, rows, K, values.data()); break;
        case W_Q6_K: unit_values_all<W_Q6_K>(w, row0, rows, K, values.data()); break;
        default: return 1;
    }
    for (size_t i = 0; i < values.size(); ++i) out[i] = f32_to_f16_fast(values[i]);
    return 0;
}

void harness_sample(int rows, const float* logits, int vocab, const float* temperature, const int* top_k,
                    const double* top_p, const double* min_p, const double* uniform, int* tokens, float* values,
                    float* best, double* log_total) {
    for (int r = 0; r < rows; ++r)
        sample_row_host(logits + (i64)r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r], uniform[r],
                        tokens + r, values + r, best + r, log_total + r);
}

void harness_mask(float* logits, int rows, int vocab, const u32* words, int n_words) {
    for (i64 e = 0; e < (i64)rows * vocab; ++e)
        if (!allowed(words + (e / vocab) * n_words, n_words, (int)(e % vocab))) logits[e] = -INFINITY;
}

void harness_adjust(float* logits, int vocab, const int* entry_row, const int* ids, const float* bias, const u8* repeated,
                    const float* penalty, const double* sub, int entries) {
    for (int e = 0; e < entries; ++e) {
        const int r = entry_row[e];
        if (r < 0) continue;
        float* at = logits + (i64)r * vocab + ids[e];
        *at = adjusted(*at, bias[e], repeated[e] != 0, penalty[r], sub[e]);
    }
}

int harness_embed(int type, const void* q, const void* hi, const void* sc, const void* d, const int* ids, int batch, int K,
                  float* out) {
    const WeightView w{q, hi, sc, d};
    for (int b = 0; b < batch; ++b) {
        switch (type) {
            case W_F16: unit_values_all<W_F16>(w, ids[b], 1, K, out + (i64)b * K); break;
            case W_BF16: unit_values_all<W_BF16>(w, ids[b], 1, K, out + (i64)b * K); break;
            case W_Q8_0: unit_values_all<W_Q8_0>(w, ids[b], 1, K, out + (i64)b * K); break;
            case W_Q4_K: unit_values_all<W_Q4_K>(w, ids[b], 1, K, out + (i64)b * K); break;
            case W_Q5_K: unit_values_all<W_Q5_K>(w, ids[b], 1, K, out + (i64)b * K); break;
            case W_Q6_K: unit_values_all<W_Q6_K>(w, ids[b], 1, K, out + (i64)b * K); break;
            default: return 1;
        }
    }
    return 0;
}

void harness_dp4a_vsub4(const int* a, const int* b, int n, int* dots, int* diffs) {
    for (int i = 0; i < n; ++i) {
        dots[i] = dp4a(a[i], b[i], 0);
        diffs[i] = vsub4(a[i], b[i]);
    }
}

void harness_f16(const float* x, int n, u16* f16, u16* bf16, float* back) {
    for (int i = 0; i < n; ++i) {
        f16[i] = f32_to_f16(x[i]);
        bf16[i] = f32_to_bf16(x[i]);
        back[i] = f16_to_f32(f16[i]);
    }
}
}
