// The sampler on the device: kernels/sampling.py's steps 0-3 (a grammar's mask; logit bias and the
// repetition, frequency and presence penalties, as sparse entries the host prepares) in place on the
// logits, then steps 4-9, one block per row, so that only a token id (with the row's max and
// log-sum-exp, for logprobs) leaves the GPU.
//
// The draw is numpy's Generator.choice(p=...) given the one uniform number the host draws from the
// request's own generator: the first token, in id order, whose cumulative kept probability passes u.
// Which tokens are kept is decided without sorting. Top-k and top-p each keep a prefix of the stable
// descending order (probability, then id), so each is a threshold key and a count of the tokens tied at
// it, found by radix select over the logits' order-preserving bits: four passes of 8 bits, a histogram
// of counts (top-k) or of probability sums (top-p) of the tokens still in play. The shorter of the two
// prefixes is kept, then min-p. Probabilities are float64, as the host's.
#pragma once
#include "common.cuh"

enum : int { SAMPLE_THREADS = 1024 };

// float bits -> a key whose unsigned order is the floats' order (-inf lowest)
EMBER_HD u32 order_key(float x) {
    const u32 b = as_bits(x);
    return b ^ ((b >> 31) ? 0xffffffffu : 0x80000000u);
}

EMBER_HD float key_value(u32 key) { return as_float(key ^ ((key >> 31) ? 0x80000000u : 0xffffffffu)); }

// The host's unnormalised probability: exp((x - max) / T) in float64.
EMBER_HD double weight(float x, float best, double temperature) { return exp(((double)x - (double)best) / temperature); }

// A prefix of the stable descending order: every token whose key is above `key`, and the first `ties`
// (by id) of those at `key`. all: the whole vocabulary.
struct Prefix {
    u32 key;
    int ties;
    bool all;
};

EMBER_HD Prefix shorter(Prefix a, Prefix b) {
    if (a.all) return b;
    if (b.all) return a;
    if (a.key != b.key) return a.key > b.key ? a : b;
    return a.ties <= b.ties ? a : b;
}

// One radix digit of the top-k select: walking the histogram's bins from the top, the bin holding the
// `remaining`-th largest key; `remaining` becomes its rank inside that bin.
EMBER_HD int count_digit(const u32* counts, int& remaining) {
    int above = 0;
    for (int d = 255; d > 0; --d) {
        if (above + (int)counts[d] >= remaining) {
            remaining -= above;
            return d;
        }
        above += (int)counts[d];
    }
    remaining -= above;
    return 0;
}

// One radix digit of the top-p select: the bin where the running sum (from `above`) first reaches
// target; `above` gains the bins before it. -1 where no bin does (the float64 total fell short of it).
EMBER_HD int sum_digit(const double* sums, double target, double& above) {
    for (int d = 255; d >= 0; --d) {
        if (above + sums[d] >= target) return d;
        above += sums[d];
    }
    return -1;
}

// How many of the `count` tokens tied at the threshold (each weighing w) top-p needs past `above`.
EMBER_HD int ties_needed(double target, double above, double w, int count) {
    if (!(w > 0.0)) return count;
    double r = ceil((target - above) / w);
    if (r < 1.0) r = 1.0;
    return r >= (double)count ? count : (int)r;
}

EMBER_HD bool min_p_keeps(double w, double total, double min_p) { return w / total >= min_p * (1.0 / total); }

// Whether token i (its key and weight w) survives top-k/top-p (`prefix`, ties below id `cutoff`) and min-p.
EMBER_HD bool kept_token(u32 key, int i, double w, Prefix prefix, int cutoff, double total, double min_p) {
    const bool in_prefix = prefix.all || key > prefix.key || (key == prefix.key && i < cutoff);
    return in_prefix && w > 0.0 && min_p_keeps(w, total, min_p);
}

// Step 0: token t is allowed next iff bit t % 32 of words[t / 32] is set.
EMBER_HD bool allowed(const u32* words, int n_words, int t) { return t / 32 < n_words && ((words[t / 32] >> (t % 32)) & 1u); }

// Steps 1-3 for one (row, token) entry, rounded as kernels/sampling.py's penalized_logits rounds them.
EMBER_HD float adjusted(float logit, float bias, bool repeated, float penalty, double sub) {
    float v = logit + bias;
    if (repeated) v = v > 0.0f ? v / penalty : v * penalty;
    return (float)((double)v - sub);
}

#ifdef __CUDACC__
struct SampleShared {
    u32 counts[256];
    double sums[256];
    double scan[SAMPLE_THREADS];
    float warp_best[SAMPLE_THREADS / WARP];
    int warp_at[SAMPLE_THREADS / WARP];
    float best;
    int best_at;
    int digit;
    int remaining;
    double above;
    int cutoff;
    int token;
};

__device__ __forceinline__ double block_sum_double(double v, SampleShared& s) {
    s.scan[threadIdx.x] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if ((int)threadIdx.x < stride) s.scan[threadIdx.x] += s.scan[threadIdx.x + stride];
        __syncthreads();
    }
    const double total = s.scan[0];
    __syncthreads();
    return total;
}

// exclusive prefix sums of the threads' values, in thread order (Hillis-Steele over shared memory)
__device__ __forceinline__ double block_exclusive_scan(double v, SampleShared& s, double& total) {
    s.scan[threadIdx.x] = v;
    __syncthreads();
    for (int stride = 1; stride < (int)blockDim.x; stride <<= 1) {
        const double add = (int)threadIdx.x >= stride ? s.scan[threadIdx.x - stride] : 0.0;
        __syncthreads();
        s.scan[threadIdx.x] += add;
        __syncthreads();
    }
    total = s.scan[blockDim.x - 1];
    const double inclusive = s.scan[threadIdx.x];
    __syncthreads();
    return inclusive - v;
}

// Radix select over the row: with SUMS, the top-p threshold for `target`; else the top-k one for rank
// `k`. Returns the prefix.
template <bool SUMS>
__device__ Prefix radix_select(const float* x, int vocab, float best, double temperature, double target, int k,
                               SampleShared& s) {
    u32 prefix = 0, mask = 0;
    int remaining = k;
    double above = 0.0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            s.counts[d] = 0;
            s.sums[d] = 0.0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const u32 key = order_key(x[i]);
            if ((key & mask) == prefix) {
                const int d = (key >> shift) & 255;
                atomicAdd(&s.counts[d], 1u);
                if (SUMS) atomicAdd(&s.sums[d], weight(x[i], best, temperature));
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            s.digit = SUMS ? sum_digit(s.sums, target, above) : count_digit(s.counts, remaining);
            s.remaining = s.digit < 0 ? 0 : (int)s.counts[s.digit];  // the tokens tied so far
            s.above = above;
        }
        __syncthreads();
        if (s.digit < 0) return Prefix{0, 0, true};  // top-p: the whole row does not reach p (rounding)
        above = s.above;
        prefix |= (u32)s.digit << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    const int tied = s.remaining;
    if (!SUMS) return Prefix{prefix, remaining, false};
    return Prefix{prefix, ties_needed(target, above, weight(key_value(prefix), best, temperature), tied), false};
}

// The id below which the first `ties` tokens at `key` lie (ids in order); vocab when all of them are kept.
__device__ int tie_cutoff(const float* x, int vocab, Prefix p, SampleShared& s) {
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk;
    const int hi = lo + chunk < vocab ? lo + chunk : vocab;
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += order_key(x[i]) == p.key;
    double total;
    const int before = (int)block_exclusive_scan((double)mine, s, total);
    if (threadIdx.x == 0) s.cutoff = vocab;
    __syncthreads();
    if ((int)total > p.ties && before < p.ties && before + mine >= p.ties) {
        int seen = before;
        for (int i = lo; i < hi; ++i)
            if (order_key(x[i]) == p.key && ++seen == p.ties) s.cutoff = i + 1;
    }
    __syncthreads();
    return s.cutoff;
}

__device__ __forceinline__ void sample_row(const float* x, int vocab, float temperature, int top_k, double top_p,
                                           double min_p, double u, int* token, float* value, float* best_out,
                                           double* log_total) {
    __shared__ SampleShared s;
    // the max (first index on ties: argmax's) and the log-sum-exp the logprobs need
    float best = as_float(0xff800000u);
    int at = vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (x[i] > best || (x[i] == best && i < at)) best = x[i], at = i;
    for (int w = 16; w > 0; w >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, w);
        const int oa = __shfl_xor_sync(0xffffffffu, at, w);
        if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
    }
    if (threadIdx.x % WARP == 0) {
        s.warp_best[threadIdx.x / WARP] = best;
        s.warp_at[threadIdx.x / WARP] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        s.best = s.warp_best[0];
        s.best_at = s.warp_at[0];
        for (int w = 1; w < (int)(blockDim.x / WARP); ++w)
            if (s.warp_best[w] > s.best || (s.warp_best[w] == s.best && s.warp_at[w] < s.best_at))
                s.best = s.warp_best[w], s.best_at = s.warp_at[w];
    }
    __syncthreads();
    best = s.best;
    double lse = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) lse += (double)expf(x[i] - best);
    lse = block_sum_double(lse, s);
    if (threadIdx.x == 0) {
        *best_out = best;
        *log_total = log(lse);
    }
    const bool greedy = temperature == 0.0f || top_k == 1;
    if (greedy || best != best) {  // a NaN max: the host's "probabilities contain NaN"
        if (threadIdx.x == 0) {
            *token = best != best ? -1 : s.best_at;
            *value = best;
        }
        return;
    }
    const double t = temperature;
    double z = 0.0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) z += weight(x[i], best, t);
    z = block_sum_double(z, s);
    Prefix kept{0, 0, true};
    if (top_k > 0 && top_k < vocab) kept = radix_select<false>(x, vocab, best, t, 0.0, top_k, s);
    if (top_p < 1.0) kept = shorter(kept, radix_select<true>(x, vocab, best, t, top_p * z, 0, s));
    const int cutoff = kept.all ? vocab : tie_cutoff(x, vocab, kept, s);
    // the draw: per thread, its chunk of ids' kept weight; the scan finds whose chunk u falls in
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * chunk;
    const int hi = lo + chunk < vocab ? lo + chunk : vocab;
    double mine = 0.0;
    int last = -1;
    for (int i = lo; i < hi; ++i) {
        const double w = weight(x[i], best, t);
        if (kept_token(order_key(x[i]), i, w, kept, cutoff, z, min_p)) {
            mine += w;
            last = i;
        }
    }
    double total;
    const double before = block_exclusive_scan(mine, s, total);
    if (threadIdx.x == 0) s.token = -1;
    __syncthreads();
    const double target = u * total;
    if (mine > 0.0 && before <= target && target < before + mine) {
        double acc = before;
        int found = last;  // the chunk's last kept token, should its own sum round short of the target
        for (int i = lo; i < hi; ++i) {
            const double w = weight(x[i], best, t);
            if (kept_token(order_key(x[i]), i, w, kept, cutoff, z, min_p)) {
                acc += w;
                if (acc > target) {
                    found = i;
                    break;
                }
            }
        }
        s.token = found;
    }
    __syncthreads();
    // rounding left u past every sum: the last kept token, as numpy's choice would take
    if (s.token < 0 && last >= 0) atomicMax(&s.token, last);
    __syncthreads();
    if (threadIdx.x == 0) {
        *token = s.token;
        *value = s.token >= 0 ? x[s.token] : best;
    }
}

// words [rows, n_words]; a row whose first word is all ones and n_words covers the vocabulary is
// unconstrained, which is what the host sends for rows without a grammar.
#define EMBER_MASK(NAME)                                                                                        \
    extern "C" __global__ void NAME(float* logits, int rows, int vocab, const u32* words, int n_words) {        \
        for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < (i64)rows * vocab;                         \
             e += (i64)gridDim.x * blockDim.x) {                                                                \
            const int r = (int)(e / vocab), t = (int)(e % vocab);                                               \
            if (!allowed(words + (i64)r * n_words, n_words, t)) logits[e] = as_float(0xff800000u);              \
        }                                                                                                       \
    }

// entries (row, id) unique per row; a row of -1 is an unused slot of the fixed-size arrays
#define EMBER_ADJUST(NAME)                                                                                      \
    extern "C" __global__ void NAME(float* logits, int vocab, const int* entry_row, const int* ids,             \
                                    const float* bias, const u8* repeated, const float* penalty,                \
                                    const double* sub, int entries) {                                           \
        for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < entries; e += gridDim.x * blockDim.x) {         \
            const int r = entry_row[e];                                                                         \
            if (r < 0) continue;                                                                                \
            float* at = logits + (i64)r * vocab + ids[e];                                                       \
            *at = adjusted(*at, bias[e], repeated[e] != 0, penalty[r], sub[e]);                                  \
        }                                                                                                       \
    }

#define EMBER_SAMPLE(NAME)                                                                                      \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                                \
        NAME(const float* logits, int vocab, const float* temperature, const int* top_k,                        \
                                    const double* top_p, const double* min_p, const double* uniform, int* tokens, \
                                    float* values, float* best, double* log_total) {                            \
        const int r = blockIdx.x;                                                                               \
        sample_row(logits + (i64)r * vocab, vocab, temperature[r], top_k[r], top_p[r], min_p[r], uniform[r],    \
                   tokens + r, values + r, best + r, log_total + r);                                            \
    }
#endif
