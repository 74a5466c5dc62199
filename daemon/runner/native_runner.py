"""NativeRunner: the engine's step API (runner/step_runner.py) over a NativeDecoder, so that a dense
model runs whole requests on the native CUDA kernels: prompt chunks through GEMMs, decode rows through
the static decode step.

A decode step whose rows all sample (no logits kept, no top alternatives, no grammar) runs the sampler
inside the step's captured graph, and only the choices come back. Other steps keep their logits on the
device, and the RowSampler samples them there through `DeviceSampling`: argmax rows, and the native
sampler (grammar masks, bias, penalties, temperature, top-k/p, min-p, the seeded draw) for the rest,
which draws the host sampler's tokens; logits rows come back only where a sequence asked to keep them.
Rows asking for top alternatives (logprobs > 0) are sampled on the host. Decode bursts of plain greedy
sequences (`greedy_steps`) stay on the device, each step replayed from its captured graph. A Model
loaded with cuda_kernels "native" builds one per engine (daemon/runtime.py).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.native_decoder import BUCKETS, NativeDecoder
from ember.daemon.runner.row_sampler import RowSampler, plain_greedy
from ember.daemon.runner.step_run import PendingStep, StepRun
from ember.daemon.step.lookup import Lookup
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels import get_ops
from ember.kernels.cuda.native_launch import SAMPLING_ENTRIES, NativeOps, SamplingBuffers, to_host
from ember.kernels.sampling import Choice, SampleRow
from ember.kernels.sampling_batch import SamplingBatch, sample_batch


class NativeRunner:
    lanes = 1  # steps the engine may keep in flight on this runner

    def __init__(self, decoder: NativeDecoder, config: ModelConfig, max_sequences: int = 64,
                 device_sampling: bool = True) -> None:
        """device_sampling False: every logits row comes to the host and the CPU's sampler takes it."""
        self.decoder, self.config, self.max_sequences = decoder, config, max_sequences
        self.capture: tuple[int, ...] = ()  # no hidden states handed back (no feature-conditioned draft)
        self.device_sampling = device_sampling
        self.sampler = RowSampler(DeviceSampling(decoder.ops) if device_sampling else get_ops("cpu"))

    def device_scope(self) -> AbstractContextManager[Any]:
        return self.decoder.ops.device_scope()

    @property
    def logits_on_device(self) -> bool:
        return self.decoder.graphs  # CuPy's arrays (the host harness computes into numpy)

    @property
    def stateful(self) -> bool:
        return False

    @property
    def prefix_reuse(self) -> bool:
        return True

    @property
    def step_alignment(self) -> int:
        return 1

    @property
    def block_size(self) -> int:
        return self.decoder.block_size

    @property
    def kv_blocks(self) -> int:
        return self.decoder.n_blocks

    def between_requests(self) -> None:
        """Nothing moves between requests: every weight is on the device."""

    def revive(self) -> bool:
        return False  # no worker process holds any of its state

    def execute(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> StepRun:
        return self.collect(self.submit(batch, samplers, keep))

    def submit(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> PendingStep:
        if self._samples_in_graph(batch, samplers, keep):  # run at collect(), which has a burst's pending tokens
            return PendingStep(batch, batch.n_logits, list(samplers), list(keep))
        return PendingStep(self.forward(batch), batch.n_logits, list(samplers), list(keep))

    def collect(self, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun:
        if isinstance(step.work, StepBatch):
            return self._sample_in_graph(step.work, step.samplers, pending)
        return self.sampler.finish(step.work, step, pending)

    def _samples_in_graph(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int]) -> bool:
        """A decode step whose every row samples, with no logits kept, no top alternatives and no grammar:
        the sampler runs inside the step's graph and only the choices come back."""
        return (self.device_sampling and not keep and _decode_rows(batch, samplers)
                and all(not s.params.logprobs and s.constraint is None for _, s in samplers))

    def _sample_in_graph(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]],
                         pending: Seq[Seq[Choice]]) -> StepRun:
        rows = SamplingBatch.of([SampleRow(k, s.params, s.rng, s.prompt,
                                           list(s.generated) + [c.token for c in pending[k]]
                                           if pending and pending[k] else s.generated, s.wants_logprob)
                                 for k, (_, s) in enumerate(samplers)])
        if rows.n_entries > SAMPLING_ENTRIES:  # more penalised tokens than the step's buffers hold
            logits = self.forward(batch)
            return StepRun(*_split(self.sampler.ops.sample_rows(logits, rows)))
        ids, positions, tables, slots = self._inputs(batch)
        return StepRun(*_split(self.decoder.sample_step(ids, positions, tables, rows, slots)))

    def greedy_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> np.ndarray | None:
        """A decode burst of up to 32 plain greedy sequences on the device (NativeDecoder.greedy_burst:
        the step replayed as a graph on a GPU, the argmax taken there), else None (the executor then
        steps the burst one step at a time)."""
        if not _decode_rows(batch, samplers) or not plain_greedy(samplers):
            return None
        ids, positions, tables, _ = self._inputs(batch)
        return self.decoder.greedy_burst(ids, positions, tables, steps, [frozenset(s.stop_ids) for _, s in samplers])

    def lookup_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], budget: int, lookup: Lookup) -> None:
        """None: n-gram proposals are verified a step at a time here."""
        return None

    def forward(self, batch: StepBatch) -> Any:
        """The logits [batch.n_logits, vocab] of the batch's logit rows: on the device, or on the host
        without device sampling."""
        if batch.attn_end is not None:
            raise ValueError("the native runner attends causally only (no DFlash draft on it)")
        if batch.n_logits == 0 and len(batch.ids) == 0:
            return np.zeros((0, self.config.vocab), np.float32)
        ids, positions, tables, slots = self._inputs(batch)
        logits = self.decoder.forward(ids, positions, tables, np.asarray(batch.logit_rows), slots)
        return logits if self.device_sampling else to_host(logits)

    def _inputs(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The decoder's per-row view of a step: ids, positions, each row's block table, its cache row."""
        tables = np.asarray(batch.tables)[np.asarray(batch.token_seq)]
        slots = np.asarray(batch.kv_blocks, np.int64) * self.block_size + np.asarray(batch.kv_offsets, np.int64)
        return np.asarray(batch.ids), np.asarray(batch.positions), tables, slots


def _decode_rows(batch: StepBatch, samplers: Seq[tuple[int, RowSampling]]) -> bool:
    """One token per sequence, causal, each row sampled and its logits wanted, in a bucket's size."""
    n = len(batch.ids)
    return (0 < n <= BUCKETS[-1] and batch.attn_end is None and [r for r, _ in samplers] == list(range(n))
            and np.array_equal(np.asarray(batch.logit_rows), np.arange(n)))


class DeviceSampling:
    """What RowSampler asks of a backend (argmax_rows, sample_rows, to_numpy), for logits on the
    native kernels' device: sampled with the native sampler over buffers kept per row count."""

    def __init__(self, ops: NativeOps) -> None:
        self.ops, self.xp = ops, ops.xp
        self._buffers: dict[tuple[int, int], SamplingBuffers] = {}

    def to_numpy(self, x: Any) -> np.ndarray:
        return to_host(x)

    def argmax_rows(self, logits: Any, rows: np.ndarray) -> Any:
        return self.xp.argmax(logits[self.xp.asarray(np.asarray(rows, np.int64))], axis=1)  # first of ties

    def sample_rows(self, logits: Any, batch: SamplingBatch) -> list[Choice | str]:
        # top alternatives (logprobs > 0): the host sampler gives them, from those rows' logits alone
        alternatives = np.flatnonzero(batch.top_n).tolist()
        out: list[Choice | str] = [""] * batch.size
        if alternatives:
            host = to_host(logits[self.xp.asarray(batch.rows[alternatives])])
            picked = sample_batch(host, batch.select(alternatives, rows=range(len(alternatives))))
            for k, choice in zip(alternatives, picked, strict=True):
                out[k] = choice
        on_device = np.flatnonzero(batch.top_n == 0).tolist()
        for k, choice in zip(on_device, self._sample(logits, batch.select(on_device)) if on_device else [],
                             strict=True):
            out[k] = choice
        return out

    def _sample(self, logits: Any, batch: SamplingBatch) -> list[Choice | str]:
        n, vocab = batch.size, int(logits.shape[1])
        work = logits[self.xp.asarray(batch.rows)]  # a copy: sampling changes it
        key = (1 << max(0, (n - 1).bit_length()), vocab)
        if key not in self._buffers:
            self._buffers[key] = SamplingBuffers.allocate(self.xp, key[0], vocab)
        buffers = self._buffers[key]
        if batch.n_entries > buffers.capacity[1]:  # more penalised tokens than its slots: a larger set, kept
            buffers = self._buffers[key] = SamplingBuffers.allocate(self.xp, key[0], vocab, 2 * batch.n_entries)
        buffers.fill(self.xp, batch)
        self.ops.sample(work, buffers)
        return buffers.choices(batch)


def _split(choices: Seq[Choice | str]) -> tuple[list[Choice | None], dict[int, str]]:
    """Choices and failures (by row) as a StepRun holds them."""
    return ([c if isinstance(c, Choice) else None for c in choices],
            {k: c for k, c in enumerate(choices) if isinstance(c, str)})
