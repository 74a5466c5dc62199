"""Launching the native kernels (kernels/cuda/native_kernels.py): grids, blocks and arguments, the
buffers each kernel reads and writes, and CuPy's compile-on-first-use.

`NativeOps` is written against an array module (`xp`: CuPy on a GPU) and a `Launcher` that runs one
kernel. On a GPU the launcher is `CupyLauncher`, which compiles each kernel's source with NVRTC the first
time it is launched (CuPy caches the binary on disk). The tests run the same class with numpy arrays and
a launcher that executes each launch in the host harness, so the grids, argument order and buffer
shapes are checked on the CPU before any GPU sees them. Arguments go by name, in the order of the C
signature read from the kernel's header: a call site cannot transpose two of them.

Every per-step value a kernel needs (positions, slots, lengths, block tables) is read from device memory,
and nothing here allocates inside a launch sequence except where a method says so: the buffers are the
caller's, so a captured graph can replay them.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ember.kernels.cuda import native_kernels as nk
from ember.kernels.cuda.repack import Repacked
from ember.kernels.sampling import Choice
from ember.kernels.sampling_batch import ALL_TOKENS, SamplingBatch
from ember.kernels.tensor_types import TensorType

GEMV_BLOCK = 128  # 4 warps, a row each (kernels/cuda/native/gemv.cuh)
NORM_BLOCK = 256
ATTENTION_BLOCK = 128
ROPE_BLOCK = 128
DEQUANTIZE_BLOCK = 256
SPLITS = 32  # attention splits of the context: fixed, so a captured graph holds at any length
SAMPLE_BLOCK = 1024  # one block per row (kernels/cuda/native/sample.cuh)
ELEMENTWISE_BLOCK = 256
SAMPLING_ENTRIES = 4096  # logit adjustments (penalised or biased tokens) SamplingBuffers hold by default
_INT32 = (-2**31, 2**31 - 1)


class Launcher(Protocol):
    def __call__(self, kernel: nk.Kernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: tuple[Any, ...]) -> None: ...


class CupyLauncher:
    """Launches on the current CuPy stream, compiling each kernel with NVRTC the first time."""

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415 - only a GPU process has CuPy

        self._cupy = cupy
        self._functions: dict[str, Any] = {}

    def function(self, kernel: nk.Kernel) -> Any:
        if kernel.name not in self._functions:
            module = self._cupy.RawModule(code=kernel.source(), options=nk.NVRTC_OPTIONS)
            self._functions[kernel.name] = module.get_function(kernel.name)
        return self._functions[kernel.name]

    def __call__(self, kernel: nk.Kernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: tuple[Any, ...]) -> None:
        self.function(kernel)(grid, block, args)


def address(a: Any) -> int:
    """The device (CuPy) or host (numpy) address of an array's first byte."""
    return int(a.data.ptr) if hasattr(a.data, "ptr") else int(a.ctypes.data)


def _argument(param: nk.Param, value: Any) -> Any:
    if param.kind == "ptr":
        if value is None or value.size == 0:
            return np.uint64(0)  # a null pointer: 8 bytes, as the parameter
        if address(value) % 16:
            raise ValueError(f"{param.name}: the native kernels read 16-byte aligned buffers")
        return value
    if param.kind == "float":
        return np.float32(value)
    if param.kind == "i64":
        return np.int64(value)
    if not _INT32[0] <= int(value) <= _INT32[1]:
        raise ValueError(f"{param.name}={value} does not fit the kernel's int")
    return np.int32(value)


@dataclass(frozen=True)
class NativeWeight:
    """A repacked weight on the device (kernels/cuda/repack.py's arrays; empty ones are None)."""
    ttype: TensorType
    rows: int
    cols: int
    q: Any
    hi: Any
    sc: Any
    d: Any

    @classmethod
    def upload(cls, w: Repacked, xp: Any) -> NativeWeight:
        q, hi, sc, d = (xp.asarray(a) if a.size else None for a in w.arrays)
        return cls(w.ttype, w.rows, w.cols, q, hi, sc, d)

    @classmethod
    def random(cls, xp: Any, ttype: TensorType, rows: int, cols: int, seed: int) -> NativeWeight:
        """Random quants (or values) and f16 scales in (-0.01, 0.01), built where xp allocates: a
        benchmark's weights of real shapes, made on the device (none has to be carried there)."""
        rs = xp.random.RandomState(seed % 2**32)

        def u8(*shape: int) -> Any:
            return rs.randint(0, 256, size=shape, dtype=xp.int32).astype(xp.uint8)

        def f16(*shape: int) -> Any:
            return rs.uniform(-0.01, 0.01, size=shape).astype(xp.float16).view(xp.uint16)

        q = hi = sc = d = None
        if ttype in (TensorType.F16, TensorType.BF16):
            values = rs.standard_normal((rows, cols)).astype(xp.float32) * xp.float32(0.02)
            q = values.astype(xp.float16).view(xp.uint16) if ttype == TensorType.F16 else \
                (values.view(xp.uint32) >> 16).astype(xp.uint16)
        elif ttype == TensorType.Q8_0:
            q, sc = u8(rows, cols).view(xp.int8), f16(rows, cols // 32)
        elif ttype in (TensorType.Q4_K, TensorType.Q5_K, TensorType.Q6_K):
            q = u8(rows, cols // 2)
            if ttype == TensorType.Q6_K:
                hi, sc, d = u8(rows, cols // 4), u8(rows, cols // 16).view(xp.int8), f16(rows, cols // 256)
            else:
                heads = u8(rows, cols // 256, 16)
                heads.view(xp.uint16)[..., :2] = f16(rows, cols // 256, 2)  # d and dmin
                sc = heads.reshape(rows, -1)
                hi = u8(rows, cols // 32 * 4).view(xp.uint32) if ttype == TensorType.Q5_K else None
        else:
            raise ValueError(f"no native layout for {ttype.name}")
        return cls(ttype, rows, cols, q, hi, sc, d)

    @property
    def arrays(self) -> dict[str, Any]:
        return {"q": self.q, "hi": self.hi, "sc": self.sc, "d": self.d}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values() if a is not None)


@dataclass(frozen=True)
class Activations:
    """The GEMVs' input for up to `batch` rows of `cols` values: q8_1 quants and (scale, scale * sum)
    per 32, and the floats (what F16/BF16 weights read)."""
    xq: Any  # int8 [batch, cols]
    xd: Any  # float32 [batch, cols / 32, 2]
    xf: Any  # float32 [batch, cols]

    @classmethod
    def allocate(cls, xp: Any, batch: int, cols: int) -> Activations:
        if cols % 32:
            raise ValueError(f"native activations need a multiple of 32 values, got {cols}")
        return cls(xp.zeros((batch, cols), xp.int8), xp.zeros((batch, cols // 32, 2), xp.float32),
                   xp.zeros((batch, cols), xp.float32))

    @property
    def cols(self) -> int:
        return int(self.xq.shape[1])


@dataclass(frozen=True)
class NativeKv:
    """One layer's paged K or V store: data [n_blocks, block_size, kv_heads, head_dim] in its dtype's
    storage (float32, uint16 bits, int8) and q8_0's f16 scales [.., head_dim / 32] (None otherwise)."""
    dtype: str
    data: Any
    scales: Any

    @classmethod
    def allocate(cls, xp: Any, dtype: str, n_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int) -> NativeKv:
        storage = {"f32": xp.float32, "f16": xp.uint16, "bf16": xp.uint16, "q8_0": xp.int8}
        if dtype not in storage:
            raise ValueError(f"unknown KV dtype {dtype!r} (choose from {', '.join(storage)})")
        shape = (n_blocks, block_size, kv_heads, head_dim)
        scales = xp.zeros(shape[:3] + (head_dim // 32,), xp.uint16) if dtype == "q8_0" else None
        return cls(dtype, xp.zeros(shape, storage[dtype]), scales)

    @property
    def block_size(self) -> int:
        return int(self.data.shape[1])

    @property
    def kv_heads(self) -> int:
        return int(self.data.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.data.shape[3])


@dataclass(frozen=True)
class AttentionScratch:
    """The split partials for `batch` rows of `q_heads` heads (static, so a graph can replay them)."""
    acc: Any  # float32 [batch, q_heads, splits, head_dim]
    ml: Any  # float32 [batch, q_heads, splits, 2]: each split's max and sum

    @classmethod
    def allocate(cls, xp: Any, batch: int, q_heads: int, head_dim: int, splits: int = SPLITS) -> AttentionScratch:
        return cls(xp.zeros((batch, q_heads, splits, head_dim), xp.float32),
                   xp.zeros((batch, q_heads, splits, 2), xp.float32))

    @property
    def splits(self) -> int:
        return int(self.acc.shape[2])


@dataclass(frozen=True)
class SamplingBuffers:
    """A batch's sampling inputs and outputs on the device, at fixed sizes, refilled before each step:
    the grammar words per row (all ones: no grammar), the sparse logit adjustments (a row of -1 marks an
    unused slot), each row's parameters and its one uniform number, and what comes back."""
    words: Any  # uint32 [rows, ceil(vocab / 32)]
    entry_row: Any  # int32 [entries]
    ids: Any  # int32 [entries]
    bias: Any  # float32 [entries]
    repeated: Any  # uint8 [entries]
    sub: Any  # float64 [entries]
    penalty: Any  # float32 [rows]
    temperature: Any  # float32 [rows]
    top_k: Any  # int32 [rows]
    top_p: Any  # float64 [rows]
    min_p: Any  # float64 [rows]
    uniform: Any  # float64 [rows]
    tokens: Any  # int32 [rows]
    values: Any  # float32 [rows]: the chosen token's penalised logit
    best: Any  # float32 [rows]
    log_total: Any  # float64 [rows]

    @classmethod
    def allocate(cls, xp: Any, rows: int, vocab: int, entries: int = SAMPLING_ENTRIES) -> SamplingBuffers:
        def z(n: int | tuple[int, ...], dtype: Any) -> Any:
            return xp.zeros(n, dtype)

        return cls(z((rows, -(-vocab // 32)), xp.uint32), z(entries, xp.int32), z(entries, xp.int32),
                   z(entries, xp.float32), z(entries, xp.uint8), z(entries, xp.float64), z(rows, xp.float32),
                   z(rows, xp.float32), z(rows, xp.int32), z(rows, xp.float64), z(rows, xp.float64),
                   z(rows, xp.float64), z(rows, xp.int32), z(rows, xp.float32), z(rows, xp.float32),
                   z(rows, xp.float64))

    @property
    def capacity(self) -> tuple[int, int]:
        return int(self.words.shape[0]), int(self.ids.shape[0])

    def fill(self, xp: Any, batch: SamplingBatch) -> None:
        """The batch's rows (row k of the buffers is the batch's k-th) into the buffers."""
        most_rows, most_entries = self.capacity
        if batch.size > most_rows:
            raise ValueError(f"{batch.size} rows to sample, the buffers hold {most_rows}")
        if batch.top_n.any():
            raise ValueError("the native sampler returns no top alternatives (logprobs > 0)")
        if batch.n_entries > most_entries:
            raise ValueError(f"{batch.n_entries} logit adjustments, the buffers hold {most_entries}")
        n_words = int(self.words.shape[1])
        words = np.full((most_rows, n_words), ALL_TOKENS, np.uint32)  # rows past the batch's: every token
        words[: batch.size] = batch.mask_words(n_words)
        pad = most_entries - batch.n_entries
        self.words[...] = xp.asarray(words)
        self.entry_row[...] = xp.asarray(np.concatenate([batch.entry_row, np.full(pad, -1)]).astype(np.int32))
        self.ids[...] = xp.asarray(np.concatenate([batch.ids, np.zeros(pad, np.int64)]).astype(np.int32))
        self.bias[...] = xp.asarray(np.concatenate([batch.bias, np.zeros(pad, np.float32)]))
        self.repeated[...] = xp.asarray(np.concatenate([batch.repeated, np.zeros(pad, bool)]).astype(np.uint8))
        self.sub[...] = xp.asarray(np.concatenate([batch.sub, np.zeros(pad)]))

        def per_row(values: np.ndarray, dtype: Any) -> Any:
            return xp.asarray(np.concatenate([values, np.zeros(most_rows - len(values))]).astype(dtype))

        self.penalty[...] = per_row(batch.penalty, np.float32)
        self.temperature[...] = per_row(batch.temperature, np.float32)
        self.top_k[...] = per_row(batch.top_k, np.int32)
        self.top_p[...] = per_row(batch.top_p, np.float64)
        self.min_p[...] = per_row(batch.min_p, np.float64)
        self.uniform[...] = per_row(batch.uniform, np.float64)

    def choices(self, batch: SamplingBatch) -> list[Choice | str]:
        """What the last sample gave the batch's rows, as the host sampler's Choice (or its failure)."""
        n = batch.size
        tokens, values, best, log_total = (to_host(a)[:n] for a in (self.tokens, self.values, self.best,
                                                                   self.log_total))
        out: list[Choice | str] = []
        for k in range(n):
            if tokens[k] < 0:
                out.append("sampling failed: ValueError: probabilities contain NaN")
            elif not batch.logprob[k]:
                out.append(Choice(int(tokens[k]), math.nan))
            else:
                out.append(Choice(int(tokens[k]), float(values[k]) - float(best[k]) - float(log_total[k])))
        return out


def to_host(a: Any) -> np.ndarray:
    """A device (CuPy) array's contents on the host; a numpy array as it is."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))


class NativeOps:
    """The native kernels, each launched over the caller's buffers."""

    def __init__(self, xp: Any, launcher: Launcher,
                 scope: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        """scope: enters the device these kernels run on, for the calling thread (device_scope)."""
        self.xp = xp
        self.launcher = launcher
        self._scope = scope

    @classmethod
    def on_gpu(cls, index: int = 0) -> NativeOps:
        """CuPy's kernels on GPU `index`."""
        import cupy  # noqa: PLC0415 - only a GPU process has CuPy

        return cls(cupy, CupyLauncher(), lambda: cupy.cuda.Device(index))

    def device_scope(self) -> AbstractContextManager[Any]:
        """Inside it the calling thread allocates, compiles and launches on this ops' device: CuPy keeps a
        current device per thread, and a module or a captured graph belongs to the device it was made on."""
        return self._scope()

    def launch(self, kernel: nk.Kernel, grid: tuple[int, ...], block: tuple[int, ...], **args: Any) -> None:
        names = [p.name for p in kernel.params]
        if set(args) != set(names):
            raise TypeError(f"{kernel.name}: missing {sorted(set(names) - set(args))}, "
                            f"unknown {sorted(set(args) - set(names))}")
        values = tuple(_argument(p, args[p.name]) for p in kernel.params)
        self.launcher(kernel, (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3], values)

    def quantize(self, x: Any, out: Activations, norm_weight: Any = None, eps: float = 1e-6,
                 floats: bool = False) -> None:
        """q8_1 of x [batch, cols] into `out` (RMS-normed by norm_weight when given); `floats` also
        keeps the (normed) floats in out.xf, for F16/BF16 weights."""
        batch, cols = x.shape
        if cols != out.cols or batch > out.xq.shape[0]:
            raise ValueError(f"quantize: {batch} x {cols} does not fit activations {tuple(out.xq.shape)}")
        self.launch(nk.norm_quantize(norm_weight is not None), (batch,), (NORM_BLOCK,), x=x, weight=norm_weight,
                    eps=eps, K=cols, xf=out.xf if floats else None, xq=out.xq, xd=out.xd)

    def gemv(self, w: NativeWeight, x: Activations, y: Any, batch: int, epilogue: str = "store",
             w2: NativeWeight | None = None) -> None:
        """y [batch, w.rows] = (or +=, or silu(.) * w2 of) w times the first `batch` rows of x (any batch:
        the kernels take up to 8 rows a launch)."""
        if x.cols != w.cols:
            raise ValueError(f"gemv: activations of {x.cols} values against a weight of {w.cols} columns")
        if (epilogue == "swiglu") != (w2 is not None):
            raise ValueError("gemv: swiglu takes the up weight as w2, and only swiglu does")
        if w2 is not None and (w2.ttype, w2.rows, w2.cols) != (w.ttype, w.rows, w.cols):
            raise ValueError("gemv: gate and up weights differ in type or shape")
        if tuple(y.shape) != (batch, w.rows):
            raise ValueError(f"gemv: output {tuple(y.shape)}, expected {(batch, w.rows)}")
        second = (w2 or w).arrays
        # past the kernels' 8 rows, one launch per 8 (the weight is read once per launch): the row
        # slices are views, so a captured graph holds them as it holds everything else
        for first in range(0, batch, nk.MAX_BATCH):
            rows = slice(first, min(batch, first + nk.MAX_BATCH))
            self.launch(nk.gemv(w.ttype, rows.stop - first, epilogue), (_blocks(w.rows, GEMV_BLOCK // 32),),
                        (GEMV_BLOCK,), **w.arrays, q2=second["q"], hi2=second["hi"], sc2=second["sc"],
                        d2=second["d"], xq=x.xq[rows], xd=x.xd[rows], xf=x.xf[rows], y=y[rows], N=w.rows, K=w.cols)

    def attention(self, q: Any, k: NativeKv, v: NativeKv, tables: Any, lengths: Any, scale: float,
                  scratch: AttentionScratch, out: Any) -> None:
        """Decode attention of q [batch, q_heads, head_dim] over the rows' first lengths[b] cached
        positions (tables [batch, width] int32 block ids, lengths [batch] int32; 0 is padding, left
        untouched in out)."""
        batch, q_heads, head_dim = q.shape
        if head_dim != k.head_dim or q_heads % k.kv_heads:
            raise ValueError(f"attention: {q_heads} heads of {head_dim} against a cache of {k.kv_heads} x "
                             f"{k.head_dim}")
        group = q_heads // k.kv_heads
        heads = nk.heads_per_block(head_dim, group)
        self.launch(nk.attention(k.dtype, head_dim, heads), (k.kv_heads * _blocks(group, heads), scratch.splits, batch),
                    (ATTENTION_BLOCK,), q=q, k=k.data, k_scales=k.scales, v=v.data, v_scales=v.scales, tables=tables,
                    lengths=lengths, table_width=tables.shape[1], block_size=k.block_size, q_heads=q_heads,
                    kv_heads=k.kv_heads, scale=scale, part_acc=scratch.acc, part_ml=scratch.ml)
        self.launch(nk.attention_combine(), (q_heads, batch), (head_dim,), part_acc=scratch.acc, part_ml=scratch.ml,
                    lengths=lengths, q_heads=q_heads, head_dim=head_dim, splits=scratch.splits, out=out)

    def qk_rope_kv(self, q: Any, k: Any, v: Any, k_cache: NativeKv, v_cache: NativeKv, positions: Any, slots: Any,
                   inv_freq: Any, interleaved: bool, q_norm: Any = None, k_norm: Any = None, eps: float = 1e-6,
                   biases: tuple[Any, Any, Any] = (None, None, None)) -> None:
        """q [batch, q_heads, D] (plus its bias) normed and rotated in place; k, v [batch, kv_heads, D]
        (plus theirs; k normed and rotated) written into the caches at slots [batch] int64 (-1: padding);
        positions [batch] int32."""
        batch, q_heads, head_dim = q.shape
        heads = q_heads + 2 * k_cache.kv_heads
        self.launch(nk.qk_rope_kv(k_cache.dtype, head_dim), (_blocks(heads, ROPE_BLOCK // 32), batch), (ROPE_BLOCK,),
                    q=q, k=k, v=v, q_bias=biases[0], k_bias=biases[1], v_bias=biases[2], q_norm=q_norm,
                    k_norm=k_norm, eps=eps, inv_freq=inv_freq,
                    rot=2 * int(inv_freq.shape[0]), interleaved=int(interleaved), positions=positions, slots=slots,
                    q_heads=q_heads, kv_heads=k_cache.kv_heads, k_data=k_cache.data, k_scales=k_cache.scales,
                    v_data=v_cache.data, v_scales=v_cache.scales)

    def sample(self, logits: Any, buffers: SamplingBuffers) -> None:
        """Steps 0-9 of kernels/sampling.py on logits [rows, vocab] (changed in place: pass a copy where
        the raw logits are still wanted), from the buffers' last fill; the results stay in `buffers`."""
        rows, vocab = logits.shape
        if rows > buffers.capacity[0]:
            raise ValueError(f"sample: {rows} rows, the buffers hold {buffers.capacity[0]}")
        self.launch(nk.mask(), (min(_blocks(rows * vocab, ELEMENTWISE_BLOCK), 65535),), (ELEMENTWISE_BLOCK,),
                    logits=logits, rows=rows, vocab=vocab, words=buffers.words, n_words=buffers.words.shape[1])
        self.launch(nk.adjust(), (_blocks(buffers.capacity[1], ELEMENTWISE_BLOCK),), (ELEMENTWISE_BLOCK,),
                    logits=logits, vocab=vocab, entry_row=buffers.entry_row, ids=buffers.ids, bias=buffers.bias,
                    repeated=buffers.repeated, penalty=buffers.penalty, sub=buffers.sub,
                    entries=buffers.capacity[1])
        self.launch(nk.sample(), (rows,), (SAMPLE_BLOCK,), logits=logits, vocab=vocab,
                    temperature=buffers.temperature, top_k=buffers.top_k, top_p=buffers.top_p,
                    min_p=buffers.min_p, uniform=buffers.uniform, tokens=buffers.tokens, values=buffers.values,
                    best=buffers.best, log_total=buffers.log_total)

    def embed(self, w: NativeWeight, ids: Any, out: Any) -> None:
        """Rows ids [batch] int32 (device memory) of w, as float32, into out [batch, w.cols]."""
        batch = int(ids.shape[0])
        self.launch(nk.embed(w.ttype), (min(_blocks(batch * (w.cols // 32), DEQUANTIZE_BLOCK), 65535),),
                    (DEQUANTIZE_BLOCK,), **w.arrays, ids=ids, batch=batch, K=w.cols, out=out)

    def dequantize_f16(self, w: NativeWeight, row0: int, out: Any) -> None:
        """Rows row0.. of w as f16 bits into out [rows, w.cols] uint16 (a tile for prefill's GEMM)."""
        rows = int(out.shape[0])
        units = rows * (w.cols // 32)
        self.launch(nk.dequantize_f16(w.ttype), (min(_blocks(units, DEQUANTIZE_BLOCK), 65535),), (DEQUANTIZE_BLOCK,),
                    **w.arrays, row0=row0, rows=rows, K=w.cols, out=out)

    def prefill_matmul(self, x: Any, w: NativeWeight, tile_rows: int = 4096) -> Any:
        """x [n, cols] float32 times w^T -> [n, w.rows] float32 for long prompts: each tile of the weight
        is dequantized to f16 and multiplied by cuBLAS (through the array module's matmul), in float32
        accumulation. Allocates its output and one tile."""
        xp = self.xp
        x16 = x.astype(xp.float16)
        out = xp.empty((x.shape[0], w.rows), xp.float32)
        tile = xp.empty((min(tile_rows, w.rows), w.cols), xp.uint16)
        for row0 in range(0, w.rows, tile_rows):
            rows = min(tile_rows, w.rows - row0)
            self.dequantize_f16(w, row0, tile[:rows])
            out[:, row0:row0 + rows] = xp.matmul(x16, tile[:rows].view(xp.float16).T).astype(xp.float32)
        return out
