"""A dense model on the native CUDA kernels (kernels/cuda/native_launch.py): its weights, repacked at load,
a KV cache, and the steps NativeRunner (native_runner.py) runs.

The decode step is a fixed sequence of launches over buffers allocated once per bucket (1 to 32 rows):
the token ids, positions, KV slots, context lengths and block tables are filled in place before each
step (slot -1 and length 0 mark padding rows, which leave every real row untouched), and nothing is
allocated, synchronised or copied to the host inside it. On a GPU each bucket's step runs on a stream
of its own and is captured as a CUDA graph at its first run, then replayed. Per layer: RMS norm + q8_1,
the q/k/v GEMVs, biases + q/k norm + rope + KV write, split-K attention, the output GEMV added into the
residual, RMS norm + q8_1, gate/up with SwiGLU, the down GEMV added into the residual; then the final
norm, the output GEMV into the logits, and, where a step asks, the sampler (`sample_step`,
`greedy_burst`), so that only token ids leave the device. Longer steps (prompt chunks) run eagerly,
their matmuls GEMMs over f16 tiles of the weights (`prefill`).

Architectures with standard attention and dense FFNs (llama, qwen2, qwen3) are supported; anything
else is refused, with the reason, at construction.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.daemon.loader.model_file import ModelFile
from ember.daemon.models.architectures import architecture
from ember.kernels.cuda.native_launch import (Activations, AttentionScratch, NativeKv, NativeOps, NativeWeight,
                                              SamplingBuffers, to_host)
from ember.kernels.cuda.native_kernels import HEAD_DIMS
from ember.kernels.cuda.repack import NATIVE_TYPES, repack
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.reference.quant import dequantize
from ember.kernels.sampling import Choice, SampleRow, SamplingParams
from ember.kernels.sampling_batch import SamplingBatch
from ember.kernels.tensor_types import TensorType

FLOAT_WEIGHTS = (TensorType.F16, TensorType.BF16)
GREEDY = SamplingParams()
BUCKETS = (1, 2, 4, 8, 16, 32)  # decode batch sizes with buffers (and a graph) of their own; a batch pads up


class NativeDecoderUnsupported(ValueError):
    """The model cannot run on the native decode step (and why)."""


@dataclass(frozen=True)
class NativeLayer:
    attn_norm: Any
    wq: NativeWeight
    wk: NativeWeight
    wv: NativeWeight
    wo: NativeWeight
    biases: tuple[Any, Any, Any]
    q_norm: Any
    k_norm: Any
    ffn_norm: Any
    gate: NativeWeight
    up: NativeWeight
    down: NativeWeight


@dataclass(frozen=True)
class StepBuffers:
    """One batch size's static buffers: the step's inputs (filled before each step) and every
    intermediate, so a captured graph's pointers stay valid."""
    batch: int
    ids: Any  # int32 [batch]
    positions: Any  # int32 [batch]
    slots: Any  # int64 [batch]: cache row of the new token (block * block_size + offset), -1 padding
    lengths: Any  # int32 [batch]: tokens the row attends to (its position + 1), 0 padding
    tables: Any  # int32 [batch, table width]
    x: Any  # float32 [batch, hidden]: the residual stream
    hidden: Activations
    attn: Activations
    ffn: Activations
    q: Any  # float32 [batch, q_heads, head_dim]
    k: Any  # float32 [batch, kv_heads, head_dim]
    v: Any
    attn_out: Any  # float32 [batch, q_heads, head_dim]
    h: Any  # float32 [batch, ffn]
    scratch: AttentionScratch
    logits: Any  # float32 [batch, vocab]
    sampling: SamplingBuffers


@dataclass(frozen=True)
class DecoderShape:
    """What a decode step's buffers and launches depend on."""
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm_eps: float
    inv_freq: np.ndarray  # float32 [rotary dims / 2]
    interleaved: bool


class NativeDecoder:
    def __init__(self, shape: DecoderShape, ops: NativeOps, embedding: NativeWeight, layers: list[NativeLayer],
                 norm: Any, output: NativeWeight, n_blocks: int, block_size: int = 16, kv_dtype: str = "f16",
                 max_context: int = 4096) -> None:
        """The step of a model whose weights are already on the device (from_file, random); its KV
        cache of n_blocks blocks of block_size in kv_dtype."""
        _check_head_dim(shape.head_dim)
        self.ops, self.xp, self.config = ops, ops.xp, shape
        self.embedding, self.layers, self.norm, self.output = embedding, layers, norm, output
        self.block_size, self.table_width = block_size, -(-max_context // block_size)
        self.inv_freq, self.interleaved = self.xp.asarray(np.asarray(shape.inv_freq, np.float32)), shape.interleaved
        self.n_blocks = n_blocks
        self.k = [NativeKv.allocate(self.xp, kv_dtype, n_blocks, block_size, shape.n_kv_heads, shape.head_dim)
                  for _ in range(shape.n_layers)]
        self.v = [NativeKv.allocate(self.xp, kv_dtype, n_blocks, block_size, shape.n_kv_heads, shape.head_dim)
                  for _ in range(shape.n_layers)]
        self._buckets: dict[int, StepBuffers] = {}  # forward()'s static buffers, one per bucket
        # on a GPU (CuPy) every step runs on a stream of its own, each bucket's step captured once as a
        # graph and replayed; elsewhere (numpy: the tests' host harness) eagerly
        self.graphs = hasattr(self.xp, "cuda")
        self._stream = self.xp.cuda.Stream(non_blocking=True) if self.graphs else None
        self._captured: dict[tuple[int, bool], Any] = {}
        if self.graphs:  # the weights' and caches' initialisation ran on the default stream, which a
            self.xp.cuda.Device().synchronize()  # non-blocking stream does not wait for

    @classmethod
    def from_file(cls, mf: ModelFile, ops: NativeOps, n_blocks: int, block_size: int = 16, kv_dtype: str = "f16",
                  max_context: int = 4096) -> NativeDecoder:
        """The model of a GGUF file or HF directory, its weights repacked onto the device."""
        c = mf.config
        spec = architecture(c.arch, str(mf.path))
        if (c.linear is not None or c.n_experts or c.sliding_window or c.layer_heads or spec.output_gate
                or c.rope_attn_factor != 1.0 or c.arch == "gemma4"):
            raise NativeDecoderUnsupported(f"{c.arch}: the native decode step runs dense attention models only "
                                           "(every layer alike, no sliding window, no output gate, no yarn)")
        _check_head_dim(c.head_dim)  # before any weight goes to the device
        factors = mf.tensors.get("rope_freqs.weight")
        inv_freq = c.inv_freq(None if factors is None else dequantize(factors.ttype, factors.rows2d(),
                                                                     factors.cols).reshape(-1))
        xp = ops.xp
        embedding = _weight(mf.tensor("token_embd.weight"), xp)
        output = embedding if "output.weight" not in mf.tensors else _weight(mf.tensor("output.weight"), xp)
        layers = [_layer(mf, i, spec.qkv_bias, spec.qk_norm, xp) for i in range(c.n_layers)]
        shape = DecoderShape(c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, layers[0].down.cols,
                             output.rows, c.norm_eps, np.asarray(inv_freq, np.float32), mf.rope_interleaved)
        return cls(shape, ops, embedding, layers, _vector(mf.tensor("output_norm.weight"), xp), output, n_blocks,
                   block_size, kv_dtype, max_context)

    @classmethod
    def random(cls, shape: DecoderShape, ops: NativeOps, types: dict[str, TensorType], n_blocks: int,
               block_size: int = 16, kv_dtype: str = "f16", max_context: int = 4096, seed: int = 0) -> NativeDecoder:
        """Random weights of `shape`, built on the device (a benchmark's model: nothing to carry there);
        types: each matrix's type by role (embedding, q, k, v, o, gate, up, down, output)."""
        xp, s = ops.xp, shape
        ones, head_ones = xp.ones(s.hidden, xp.float32), xp.ones(s.head_dim, xp.float32)

        def w(role: str, rows: int, cols: int, n: int) -> NativeWeight:
            return NativeWeight.random(xp, types[role], rows, cols, seed + n)

        layers = [NativeLayer(ones, w("q", s.n_heads * s.head_dim, s.hidden, 8 * i),
                              w("k", s.n_kv_heads * s.head_dim, s.hidden, 8 * i + 1),
                              w("v", s.n_kv_heads * s.head_dim, s.hidden, 8 * i + 2),
                              w("o", s.hidden, s.n_heads * s.head_dim, 8 * i + 3), (None, None, None), head_ones,
                              head_ones, ones, w("gate", s.ffn, s.hidden, 8 * i + 4),
                              w("up", s.ffn, s.hidden, 8 * i + 5), w("down", s.hidden, s.ffn, 8 * i + 6))
                  for i in range(s.n_layers)]
        return cls(shape, ops, w("embedding", s.vocab, s.hidden, -1), layers, ones, w("output", s.vocab, s.hidden, -2),
                   n_blocks, block_size, kv_dtype, max_context)

    def with_cache(self, n_blocks: int, block_size: int, kv_dtype: str, max_context: int) -> NativeDecoder:
        """A decoder over the same weights with a KV cache of its own (an engine's)."""
        return NativeDecoder(self.config, self.ops, self.embedding, self.layers, self.norm, self.output, n_blocks,
                             block_size, kv_dtype, max_context)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights one decode step reads: every layer's matrices and the output."""
        return self.output.nbytes + sum(w.nbytes for layer in self.layers for w in (
            layer.wq, layer.wk, layer.wv, layer.wo, layer.gate, layer.up, layer.down))

    # --- a step ----------------------------------------------------------------------------------
    def buffers(self, batch: int, static: bool = True) -> StepBuffers:
        """A step's buffers for `batch` rows; static ones (the decode step's, up to 32 rows) are what a
        graph replays, others serve one eager prefill."""
        if static and not 1 <= batch <= BUCKETS[-1]:
            raise ValueError(f"the native decode step takes 1 to {BUCKETS[-1]} rows, not {batch}")
        xp, c = self.xp, self.config
        z = xp.zeros
        return StepBuffers(
            batch, z(batch, xp.int32), z(batch, xp.int32), xp.full(batch, -1, xp.int64), z(batch, xp.int32),
            z((batch, self.table_width), xp.int32), z((batch, c.hidden), xp.float32),
            Activations.allocate(xp, batch, c.hidden), Activations.allocate(xp, batch, c.n_heads * c.head_dim),
            Activations.allocate(xp, batch, c.ffn),
            z((batch, c.n_heads, c.head_dim), xp.float32), z((batch, c.n_kv_heads, c.head_dim), xp.float32),
            z((batch, c.n_kv_heads, c.head_dim), xp.float32), z((batch, c.n_heads, c.head_dim), xp.float32),
            z((batch, c.ffn), xp.float32),
            AttentionScratch.allocate(xp, batch, c.n_heads, c.head_dim),
            z((batch if static else 1, self.output.rows), xp.float32),
            SamplingBuffers.allocate(xp, batch if static else 1, self.output.rows))

    def fill(self, bufs: StepBuffers, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray,
             slots: np.ndarray | None = None) -> None:
        """The step's inputs for len(ids) <= bufs.batch rows (the rest padding): each row's token at its
        position, its sequence's block table (block ids, [rows, <= table width]), and the cache row its
        K/V goes to (default: its position's in the table)."""
        n = len(ids)
        if n > bufs.batch:
            raise ValueError(f"{n} rows for buffers of {bufs.batch}")
        width = self.table_width
        positions = np.asarray(positions, np.int64)
        if n and positions.max() >= width * self.block_size:
            raise ValueError(f"position {positions.max()} past the decode step's context of {width * self.block_size}")
        # only the columns the rows reach are copied: attention reads no block past a row's length, so
        # the rest of a static table may keep an earlier step's entries
        used = max(1, min(width, int(positions.max()) // self.block_size + 1 if n else 1))
        given_tables = np.asarray(tables)[:, :used]
        table = np.zeros((bufs.batch, used), np.int32)
        table[:n, :given_tables.shape[1]] = given_tables
        given = slots
        slots = np.full(bufs.batch, -1, np.int64)
        slots[:n] = table[np.arange(n), positions // self.block_size].astype(np.int64) * self.block_size + \
            positions % self.block_size if given is None else given
        padded = np.zeros(bufs.batch, np.int64)
        padded[:n] = positions
        xp = self.xp
        bufs.ids[...] = xp.asarray(np.concatenate([np.asarray(ids, np.int32), np.zeros(bufs.batch - n, np.int32)]))
        bufs.positions[...] = xp.asarray(padded.astype(np.int32))
        bufs.slots[...] = xp.asarray(slots)
        bufs.lengths[...] = xp.asarray(np.where(np.arange(bufs.batch) < n, padded + 1, 0).astype(np.int32))
        bufs.tables[:, :used] = xp.asarray(table)

    def step(self, bufs: StepBuffers, sample: bool = False) -> None:
        """One decode step of bufs.batch rows into bufs.logits (and, with `sample`, bufs.sampling's
        tokens from its last fill): launches only."""
        ops, c, b = self.ops, self.config, bufs.batch
        ops.embed(self.embedding, bufs.ids, bufs.x)
        for i, layer in enumerate(self.layers):
            self._attention(layer, i, bufs)
            ops.quantize(bufs.x, bufs.hidden, norm_weight=layer.ffn_norm, eps=c.norm_eps,
                         floats=layer.gate.ttype in FLOAT_WEIGHTS)
            ops.gemv(layer.gate, bufs.hidden, bufs.h, b, "swiglu", w2=layer.up)
            ops.quantize(bufs.h, bufs.ffn, floats=layer.down.ttype in FLOAT_WEIGHTS)
            ops.gemv(layer.down, bufs.ffn, bufs.x, b, "add")
        ops.quantize(bufs.x, bufs.hidden, norm_weight=self.norm, eps=c.norm_eps,
                     floats=self.output.ttype in FLOAT_WEIGHTS)
        ops.gemv(self.output, bufs.hidden, bufs.logits, b)
        if sample:
            ops.sample(bufs.logits, bufs.sampling)

    def forward(self, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray, logit_rows: np.ndarray,
                slots: np.ndarray | None = None) -> Any:
        """Any step's tokens (each at its position, with its sequence's block table [n, width]) -> the
        logits [len(logit_rows), vocab] of the rows asked for, where the decoder keeps them: up to 32
        rows through a bucket's static buffers (the step a graph replays), more eagerly (`prefill`)."""
        n = len(ids)
        if n > BUCKETS[-1]:
            return self.prefill(ids, positions, tables, logit_rows, slots)
        with self._on_stream():  # buffers allocated, filled and run on the step's stream alike
            bufs = self._bucket(n)
            self.fill(bufs, ids, positions, tables, slots)
            self.run(bufs)
            out = bufs.logits[self.xp.asarray(np.asarray(logit_rows, np.int64))]
            self._synchronize()
        return out

    def sample_step(self, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray, rows: SamplingBatch,
                    slots: np.ndarray | None = None) -> list[Choice | str]:
        """One decode step of len(ids) <= 32 rows, row k sampled as the batch's k-th row asks (at most
        native_launch.SAMPLING_ENTRIES adjustments), inside the step (the graph on a GPU): the
        choices, or why a row's sampling failed."""
        with self._on_stream():
            bufs = self._bucket(len(ids))
            self.fill(bufs, ids, positions, tables, slots)
            bufs.sampling.fill(self.xp, rows)
            self.run(bufs, sample=True)
            return bufs.sampling.choices(rows)

    def greedy_burst(self, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray, steps: int,
                     stops: Sequence[frozenset[int]]) -> np.ndarray:
        """Up to `steps` greedy decode steps of one token per sequence (row i its sequence's token at
        positions[i], in the blocks of tables[i], which hold every position the burst reaches), each
        row's argmax its next input, chosen on the device, until every row has met one of its stop ids
        (a row that has keeps its stop token as its input) -> host tokens [steps taken, n]."""
        n = len(ids)
        cur, positions = np.asarray(ids, np.int64).copy(), np.asarray(positions, np.int64)
        done = np.zeros(n, bool)
        out = []
        with self._on_stream():
            bufs = self._bucket(n)
            bufs.sampling.fill(self.xp, SamplingBatch.of([SampleRow(k, GREEDY, None) for k in range(n)]))  # type: ignore[arg-type]
            for j in range(steps):
                self.fill(bufs, cur, positions + j, tables)
                self.run(bufs, sample=True)
                tokens = to_host(bufs.sampling.tokens)[:n].astype(np.int64)
                out.append(tokens)
                cur = np.where(done, cur, tokens)
                done |= np.array([int(t) in stop for t, stop in zip(tokens, stops, strict=True)])
                if done.all():
                    break
        return np.array(out)

    def run(self, bufs: StepBuffers, sample: bool = False) -> None:
        """bufs' step from its last fill: on a GPU replayed from its graph (captured at its first run,
        after an eager step has compiled and loaded every kernel), eagerly elsewhere."""
        key = (id(bufs), sample)
        if not self.graphs or key not in self._captured:
            self.step(bufs, sample)
            if self.graphs:
                self._stream.begin_capture()
                self.step(bufs, sample)
                self._captured[key] = self._stream.end_capture()
            return
        self._captured[key].launch(self._stream)

    def _bucket(self, n: int) -> StepBuffers:
        bucket = next(b for b in BUCKETS if b >= n)
        if bucket not in self._buckets:
            self._buckets[bucket] = self.buffers(bucket)
        return self._buckets[bucket]

    def _on_stream(self) -> Any:
        return self._stream if self.graphs else contextlib.nullcontext()

    def _synchronize(self) -> None:
        if self.graphs:
            self._stream.synchronize()

    def prefill(self, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray, logit_rows: np.ndarray,
                slots: np.ndarray | None = None) -> Any:
        """Any number of rows eagerly, each matmul a GEMM over f16 tiles of the weight (cuBLAS on a GPU);
        the kernels of the decode step everywhere else. Allocates its buffers."""
        with self._on_stream():
            out = self._prefill(ids, positions, tables, logit_rows, slots)
            self._synchronize()
        return out

    def _prefill(self, ids: np.ndarray, positions: np.ndarray, tables: np.ndarray, logit_rows: np.ndarray,
                 slots: np.ndarray | None) -> Any:
        ops, xp, c = self.ops, self.xp, self.config
        n = len(ids)
        rows = self.buffers(n, static=False)
        self.fill(rows, ids, positions, tables, slots)
        ops.embed(self.embedding, rows.ids, rows.x)
        x, acts = rows.x, rows.hidden
        for i, layer in enumerate(self.layers):
            ops.quantize(x, acts, norm_weight=layer.attn_norm, eps=c.norm_eps, floats=True)
            q, k, v = (ops.prefill_matmul(acts.xf, w) for w in (layer.wq, layer.wk, layer.wv))
            q, k, v = (a.reshape(n, -1, c.head_dim) for a in (q, k, v))
            ops.qk_rope_kv(q, k, v, self.k[i], self.v[i], rows.positions, rows.slots, self.inv_freq,
                           self.interleaved, layer.q_norm, layer.k_norm, c.norm_eps, layer.biases)
            ops.attention(q, self.k[i], self.v[i], rows.tables, rows.lengths, c.head_dim ** -0.5, rows.scratch,
                          rows.attn_out)
            x += ops.prefill_matmul(rows.attn_out.reshape(n, -1), layer.wo)
            ops.quantize(x, acts, norm_weight=layer.ffn_norm, eps=c.norm_eps, floats=True)
            g, u = ops.prefill_matmul(acts.xf, layer.gate), ops.prefill_matmul(acts.xf, layer.up)
            # silu(g) * u; a gate far below zero is clamped where exp(-g) would overflow (silu is ~0 there)
            x += ops.prefill_matmul(g / (1 + xp.exp(-xp.maximum(g, -80.0))) * u, layer.down)
        if len(logit_rows) == 0:  # prompt chunks only: their K/V is all this step produces
            return xp.zeros((0, self.output.rows), xp.float32)
        wanted = xp.ascontiguousarray(x[xp.asarray(np.asarray(logit_rows, np.int64))])
        out = Activations.allocate(xp, len(logit_rows), c.hidden)
        ops.quantize(wanted, out, norm_weight=self.norm, eps=c.norm_eps, floats=True)
        return ops.prefill_matmul(out.xf, self.output)

    def _attention(self, layer: NativeLayer, i: int, bufs: StepBuffers) -> None:
        ops, c, b = self.ops, self.config, bufs.batch
        floats = any(w.ttype in FLOAT_WEIGHTS for w in (layer.wq, layer.wk, layer.wv))
        ops.quantize(bufs.x, bufs.hidden, norm_weight=layer.attn_norm, eps=c.norm_eps, floats=floats)
        for w, out in ((layer.wq, bufs.q), (layer.wk, bufs.k), (layer.wv, bufs.v)):
            ops.gemv(w, bufs.hidden, out.reshape(b, -1), b)
        ops.qk_rope_kv(bufs.q, bufs.k, bufs.v, self.k[i], self.v[i], bufs.positions, bufs.slots, self.inv_freq,
                       self.interleaved, layer.q_norm, layer.k_norm, c.norm_eps, layer.biases)
        ops.attention(bufs.q, self.k[i], self.v[i], bufs.tables, bufs.lengths, c.head_dim ** -0.5, bufs.scratch,
                      bufs.attn_out)
        ops.quantize(bufs.attn_out.reshape(b, -1), bufs.attn, floats=layer.wo.ttype in FLOAT_WEIGHTS)
        ops.gemv(layer.wo, bufs.attn, bufs.x, b, "add")


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise NativeDecoderUnsupported(f"head_dim {head_dim}: the native attention takes "
                                       f"{', '.join(map(str, HEAD_DIMS))}")


# --- loading a file --------------------------------------------------------------------------------
def _weight(t: RawTensor, xp: Any) -> NativeWeight:
    if t.ttype not in NATIVE_TYPES:
        raise NativeDecoderUnsupported(f"{t.name} is {t.ttype.name}: the native GEMVs read "
                                       f"{', '.join(x.name for x in NATIVE_TYPES)}")
    return NativeWeight.upload(repack(t.ttype, t.rows2d(), t.rows, t.cols), xp)


def _vector(t: RawTensor, xp: Any) -> Any:
    return xp.asarray(np.ascontiguousarray(dequantize(t.ttype, t.rows2d(), t.cols).reshape(-1), np.float32))


def _layer(mf: ModelFile, i: int, bias: bool, qk_norm: bool, xp: Any) -> NativeLayer:
    def w(name: str) -> NativeWeight:
        return _weight(mf.tensor(f"blk.{i}.{name}.weight"), xp)

    def vec(name: str) -> Any:
        return _vector(mf.tensor(f"blk.{i}.{name}"), xp)

    gate, up = w("ffn_gate"), w("ffn_up")
    if gate.ttype != up.ttype:
        raise NativeDecoderUnsupported(f"layer {i}: gate ({gate.ttype.name}) and up ({up.ttype.name}) differ")
    return NativeLayer(vec("attn_norm.weight"), w("attn_q"), w("attn_k"), w("attn_v"), w("attn_output"),
                       tuple(vec(f"attn_{p}.bias") for p in "qkv") if bias else (None, None, None),
                       vec("attn_q_norm.weight") if qk_norm else None,
                       vec("attn_k_norm.weight") if qk_norm else None, vec("ffn_norm.weight"), gate, up,
                       w("ffn_down"))
