"""The full sampler on the GPU: kernels/sampling.py's steps on logits that stay on the device, so only
token ids (and logprobs when asked) come back.

It reads a SamplingBatch (kernels/sampling_batch.py): each row's parameters, its sparse logit
adjustments (bias, repetition penalty, frequency/presence penalty, merged per token id), its grammar's
mask and the one uniform number drawn from the request's own generator, which is exactly what numpy's
`Generator.choice(p=...)` draws; the device does the rest in float64 where the host sampler does:
  0. mask       a grammar's (constrained decoding): -inf where its bit is clear
  1. penalize   copy the rows, apply the adjustments in the host sampler's order and precisions
  2. sample     per row: max and log-sum-exp (for logprobs), first argmax (greedy), or softmax at the
                temperature, a stable descending sort (bitonic, in global scratch), the top-k / top-p
                cut and min-p, renormalisation, and the inverse-CDF draw numpy's choice makes
  3. top-n      the alternatives logprobs report, by repeated argmax
So a seeded request draws the same tokens as on the CPU (up to the last bits of a float64 sum).
The sort and the CDF walk are one block (and partly one thread) per row: correct, not fast.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int64

from ember.kernels.cuda.device import THREADS, block_argmax, block_sum, flat_grid, grid
from ember.kernels.cuda.device_array import DeviceArray, empty, gather_rows
from ember.kernels.sampling import Choice
from ember.kernels.sampling_batch import SamplingBatch


@cuda.jit
def _mask(out, words):  # type: ignore[no-untyped-def]
    # bit t % 32 of words[k, t // 32] clear: token t may not come next in row k (allowed_tokens' layout)
    vocab = out.shape[1]
    for e in range(cuda.grid(1), out.shape[0] * vocab, cuda.gridsize(1)):
        k, t = e // vocab, e % vocab
        w = t // 32
        if w >= words.shape[1] or (words[k, w] >> (t % 32)) & 1 == 0:
            out[k, t] = float32(-math.inf)


@cuda.jit
def _adjust(out, entry_row, ids, bias, rep, penalty, sub):  # type: ignore[no-untyped-def]
    # one entry = one (row, token id), ids unique per row: bias, then repetition, then frequency and
    # presence, each rounded as penalized_logits rounds it
    for e in range(cuda.grid(1), ids.shape[0], cuda.gridsize(1)):
        k, t = entry_row[e], ids[e]
        v = float32(out[k, t] + bias[e])
        if rep[e]:
            v = float32(v / penalty[k]) if v > 0 else float32(v * penalty[k])
        out[k, t] = float32(float64(v) - sub[e])


@cuda.jit(device=True)
def _before(ka, ia, kb, ib):  # type: ignore[no-untyped-def]
    """Whether (ka, ia) sorts before (kb, ib): larger probability first, then smaller id (argsort's
    stable order of -probs)."""
    return ka > kb or (ka == kb and ia < ib)


@cuda.jit(device=True)
def _bitonic_sort(keys, ids, k):  # type: ignore[no-untyped-def]
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    n = keys.shape[1]  # a power of two
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            for i in range(t, n, width):
                other = i ^ stride
                if other > i:
                    first = _before(keys[k, i], ids[k, i], keys[k, other], ids[k, other])
                    if first != ((i & size) == 0):  # out of this half's order: swap
                        keys[k, i], keys[k, other] = keys[k, other], keys[k, i]
                        ids[k, i], ids[k, other] = ids[k, other], ids[k, i]
            cuda.syncthreads()
            stride //= 2
        size *= 2


@cuda.jit
def _sample(x, greedy, temperature, top_k, top_p, min_p, uniform, probs, keys, ids,  # type: ignore[no-untyped-def]
            token, token_value, best_out, log_total):
    f32s = cuda.shared.array(THREADS, float32)
    f64s = cuda.shared.array(THREADS, float64)
    i64s = cuda.shared.array(THREADS, int64)
    keep = cuda.shared.array(1, int64)
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    vocab = x.shape[1]
    for k in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        best, at = float32(-math.inf), int64(vocab)
        for j in range(t, vocab, width):
            if x[k, j] > best or at == vocab:
                best, at = x[k, j], int64(j)
        best, at = block_argmax(best, at, f32s, i64s)
        total = float64(0)  # log-sum-exp as _choice: exp in float32, summed in float64
        for j in range(t, vocab, width):
            total += float64(float32(math.exp(float32(x[k, j] - best))))
        total = block_sum(total, f64s)
        if t == 0:
            best_out[k], log_total[k] = best, math.log(total)
        if greedy[k]:
            if t == 0:
                token[k], token_value[k] = at, x[k, at]
            continue
        # final_distribution: softmax at the temperature in float64, shifted by the max
        z = float64(0)
        for j in range(t, vocab, width):
            p = math.exp((float64(x[k, j]) - float64(best)) / temperature[k])
            probs[k, j] = p
            z += p
        z = block_sum(z, f64s)
        for i in range(t, keys.shape[1], width):
            keys[k, i] = probs[k, i] / z if i < vocab else float64(-1)  # padding sorts last
            ids[k, i] = i
        cuda.syncthreads()
        for j in range(t, vocab, width):
            probs[k, j] = keys[k, j]
        cuda.syncthreads()  # every lane has copied its keys before the sort moves them
        _bitonic_sort(keys, ids, k)
        if t == 0:  # how many of the sorted tokens top_k and top_p keep
            n = vocab
            if 0 < top_k[k] < vocab:
                n = top_k[k]
            if top_p[k] < 1.0:
                c = float64(0)
                for i in range(vocab):
                    c += keys[k, i]
                    if c >= top_p[k]:  # np.searchsorted(cumsum, top_p) is this i
                        n = min(n, i + 1)
                        break
            keep[0] = n
        cuda.syncthreads()
        floor = min_p[k] * keys[k, 0]
        for i in range(t, vocab, width):
            if i >= keep[0]:
                probs[k, ids[k, i]] = float64(0)
        cuda.syncthreads()
        z = float64(0)
        for j in range(t, vocab, width):
            if min_p[k] > 0 and probs[k, j] < floor:
                probs[k, j] = float64(0)
            z += probs[k, j]
        z = block_sum(z, f64s)
        if t == 0:  # Generator.choice(p=probs / z): the first index whose normalised CDF passes u
            last = float64(0)
            for j in range(vocab):
                last += probs[k, j] / z
            chosen, c = int64(-1), float64(0)  # -1: no valid distribution (NaN logits)
            if z > 0 and last > 0 and not math.isinf(z):
                for j in range(vocab):
                    c += probs[k, j] / z
                    if c / last > uniform[k]:
                        chosen = j
                        break
            token[k] = chosen
            token_value[k] = x[k, max(chosen, 0)]
        cuda.syncthreads()


@cuda.jit
def _top_n(x, n, out_ids, out_values):  # type: ignore[no-untyped-def]
    f32s = cuda.shared.array(THREADS, float32)
    i64s = cuda.shared.array(THREADS, int64)
    t, width = cuda.threadIdx.x, cuda.blockDim.x
    vocab = x.shape[1]
    for k in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        prev_v, prev_i = float32(math.inf), int64(-1)
        for r in range(n):  # the next best after (prev_v, prev_i) in (value desc, id asc) order
            best, at = float32(-math.inf), int64(vocab)
            for j in range(t, vocab, width):
                v = x[k, j]
                if (v < prev_v or (v == prev_v and j > prev_i)) and (v > best or at == vocab):
                    best, at = v, int64(j)
            best, at = block_argmax(best, at, f32s, i64s)
            if t == 0:
                out_ids[k, r], out_values[k, r] = at, best
            prev_v, prev_i = best, at


def _up(x: np.ndarray) -> DeviceArray:
    return DeviceArray(cuda.to_device(np.ascontiguousarray(x)))


def sample_rows(logits: DeviceArray, batch: SamplingBatch) -> list[Choice | str]:
    """kernels/sampling_batch.sample_batch on device logits [n, vocab], on the device."""
    if not batch.size:
        return []
    m, vocab = batch.size, logits.shape[1]
    ruled_out = _ruled_out(batch, vocab)
    if ruled_out:
        kept = [k for k in range(m) if k not in ruled_out]
        sampled = iter(sample_rows(logits, batch.select(kept)))
        return [ruled_out[k] if k in ruled_out else next(sampled) for k in range(m)]
    pen = gather_rows(logits, _up(batch.rows))  # a copy: adjusted in place below
    if batch.words is not None:
        _mask[flat_grid(m * vocab)](pen.raw, _up(batch.mask_words(-(-vocab // 32)).view(np.int32)).raw)
    if batch.n_entries:
        _adjust[flat_grid(batch.n_entries)](pen.raw, _up(batch.entry_row).raw, _up(batch.ids).raw,
                                            _up(batch.bias).raw, _up(batch.repeated).raw, _up(batch.penalty).raw,
                                            _up(batch.sub).raw)
    width = 1 << max(1, (vocab - 1).bit_length())
    sorting = int(not batch.greedy.all())  # scratch only when some row samples
    probs = empty((m, vocab) if sorting else (1, 1), np.float64)
    keys, order = empty((m, width) if sorting else (1, 1), np.float64), empty((m, width) if sorting else (1, 1), np.int64)
    token, value = empty((m,), np.int64), empty((m,))
    best, log_total = empty((m,)), empty((m,), np.float64)
    _sample[grid(m)](pen.raw, _up(batch.greedy).raw, _up(np.where(batch.greedy, 1.0, batch.temperature)).raw,
                     _up(batch.top_k).raw, _up(batch.top_p).raw, _up(batch.min_p).raw, _up(batch.uniform).raw,
                     probs.raw, keys.raw, order.raw, token.raw, value.raw, best.raw, log_total.raw)
    top_n = int(batch.top_n.max())
    tops = None
    if top_n:
        top_ids, top_values = empty((m, top_n), np.int64), empty((m, top_n))
        _top_n[grid(m)](pen.raw, top_n, top_ids.raw, top_values.raw)
        tops = (top_ids.to_host(), top_values.to_host())
    host = token.to_host(), value.to_host(), best.to_host(), log_total.to_host()
    return [_choice(k, batch, *host, tops) for k in range(m)]


def _ruled_out(batch: SamplingBatch, vocab: int) -> dict[int, str]:
    """The rows whose grammar allows no token at all, and why (the host sampler's failure)."""
    out = {}
    for k in np.flatnonzero(batch.constrained).tolist():
        try:
            batch.masked(k, np.zeros(vocab, np.float32))
        except ValueError as e:
            out[k] = f"sampling failed: ValueError: {e}"
    return out


def _choice(k: int, batch: SamplingBatch, token: np.ndarray, value: np.ndarray, best: np.ndarray,
            log_total: np.ndarray, tops: tuple[np.ndarray, np.ndarray] | None) -> Choice | str:
    if token[k] < 0:
        return "sampling failed: ValueError: probabilities contain NaN"
    top_n = int(batch.top_n[k])
    if not batch.logprob[k] and not top_n:  # nobody reads it: NaN, as the host sampler gives
        return Choice(int(token[k]), math.nan)
    base = float(best[k]) + float(log_total[k])
    top = () if tops is None else tuple((int(t), float(v) - base) for t, v in  # -inf: ruled out by a grammar
                                        zip(tops[0][k, :top_n], tops[1][k, :top_n], strict=True) if v > -math.inf)
    return Choice(int(token[k]), float(value[k]) - base, top)
