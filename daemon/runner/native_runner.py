"""NativeRunner: the engine's step API (runner/step_runner.py) over a NativeDecoder, so that a dense
model runs whole requests on the native CUDA kernels: prompt chunks through GEMMs, decode rows through
the static decode step.

A step's logits rows are brought to the host and sampled there (the host RowSampler over the CPU's
ops), so every sampling option behaves exactly as on the CPU. Decode bursts of plain greedy
sequences (`greedy_steps`) stay on the device: each step is replayed from its captured graph and its
argmax taken there, so only token ids come back. It is not yet chosen by the device registry:
docs/cuda.md says what it lacks.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.native_decoder import BUCKETS, NativeDecoder
from ember.daemon.runner.row_sampler import RowSampler, plain_greedy
from ember.daemon.runner.step_run import PendingStep, StepRun
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels import get_ops
from ember.kernels.sampling import Choice


class NativeRunner:
    lanes = 1  # steps the engine may keep in flight on this runner

    def __init__(self, decoder: NativeDecoder, config: ModelConfig, max_sequences: int = 64) -> None:
        self.decoder, self.config, self.max_sequences = decoder, config, max_sequences
        self.capture: tuple[int, ...] = ()  # no hidden states handed back (no feature-conditioned draft)
        self.sampler = RowSampler(get_ops("cpu"))

    @property
    def stateful(self) -> bool:
        return False

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
        return PendingStep(self.forward(batch), batch.n_logits, list(samplers), list(keep))

    def collect(self, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun:
        return self.sampler.finish(step.work, step, pending)

    def greedy_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> np.ndarray | None:
        """A decode burst of up to 32 plain greedy sequences on the device (NativeDecoder.greedy_burst:
        the step replayed as a graph on a GPU, the argmax taken there), else None (the executor then
        steps the burst one step at a time)."""
        n = len(batch.ids)
        if (n > BUCKETS[-1] or batch.attn_end is not None or [r for r, _ in samplers] != list(range(n))
                or not np.array_equal(np.asarray(batch.logit_rows), np.arange(n)) or not plain_greedy(samplers)):
            return None
        tables = np.asarray(batch.tables)[np.asarray(batch.token_seq)]
        return self.decoder.greedy_burst(np.asarray(batch.ids), np.asarray(batch.positions), tables, steps,
                                         [frozenset(s.stop_ids) for _, s in samplers])

    def forward(self, batch: StepBatch) -> np.ndarray:
        """The host logits [batch.n_logits, vocab] of the batch's logit rows."""
        if batch.attn_end is not None:
            raise ValueError("the native runner attends causally only (no DFlash draft on it)")
        if batch.n_logits == 0 and len(batch.ids) == 0:
            return np.zeros((0, self.config.vocab), np.float32)
        tables = np.asarray(batch.tables)[np.asarray(batch.token_seq)]
        slots = np.asarray(batch.kv_blocks, np.int64) * self.block_size + np.asarray(batch.kv_offsets, np.int64)
        logits = self.decoder.forward(np.asarray(batch.ids), np.asarray(batch.positions), tables,
                                      np.asarray(batch.logit_rows), slots)
        return _host(logits)


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)
