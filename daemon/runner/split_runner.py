"""SplitRunner: the runner the engine drives over a layer split (runner/pipeline.py).

It has ModelRunner's step API (submit, collect, execute) over the pipeline's stages, with a KV cache
of its own in each: the last stage returns the logits rows, and sampling is the single-device path's
own RowSampler, run where the single-device path runs it (the engine's process, on the host). Its
`lanes` let the engine's executor keep a step in flight per stage (executor/pipeline_executor.py):
that is what keeps every stage busy.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.runner.model_runner import check_decode_act
from ember.daemon.runner.pipeline import Pipeline
from ember.daemon.runner.row_sampler import RowSampler
from ember.daemon.runner.stage_process import CacheSpec
from ember.daemon.runner.step_run import PendingStep, StepRun
from ember.daemon.step.lookup import Lookup
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.convert import DEFAULT_KV_DTYPE
from ember.kernels.sampling import Choice


class SplitRunner:
    stateful = False  # Pipeline refuses hybrid models
    prefix_reuse = True
    step_alignment = 1
    capture: tuple[int, ...] = ()  # hidden states stay in the stages: no feature-conditioned draft reads them

    def __init__(self, pipeline: Pipeline, kv_blocks: int, block_size: int = 16, kv_dtype: str = DEFAULT_KV_DTYPE,
                 decode_act: str = "q8_0") -> None:
        check_decode_act(decode_act)
        self.pipeline, self.decode_act = pipeline, decode_act
        self.config: ModelConfig = pipeline.config
        self.lanes = pipeline.lanes
        self.max_sequences = 1 << 30  # no recurrent state slots to run out of
        host = DeviceName("cpu")
        self.sampler = RowSampler(backend_for(host).ops(host))  # on the host, as on the CPU path
        self.spec = CacheSpec(kv_blocks, block_size, kv_dtype)
        self.cache_id = pipeline.new_cache(self.spec)
        weakref.finalize(self, pipeline.drop_cache, self.cache_id)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def kv_blocks(self) -> int:
        return self.spec.blocks

    logits_on_device = False  # the last stage hands its logits to the engine's host

    def device_scope(self) -> AbstractContextManager[Any]:
        return nullcontext()  # the engine's part (sampling) runs on the host; each stage binds its own GPU

    def between_requests(self) -> None:
        """Nothing to do: a split model's stages keep every MoE expert hot."""

    def revive(self) -> bool:
        return self.pipeline.revive(self.cache_id)

    def execute(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> StepRun:
        return self.collect(self.submit(batch, samplers, keep))

    def submit(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> PendingStep:
        """Start the step in the stages and return at once: the pipeline's ticket is what collect() waits on."""
        return PendingStep(self.pipeline.submit(self._host(batch), self.cache_id), batch.n_logits, list(samplers),
                           list(keep))

    def collect(self, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun:
        return self.sampler.finish(self.pipeline.collect(step.work), step, pending)

    def greedy_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> None:
        """None: no compiled loop spans the stages' processes, so a burst goes through them step by step."""
        return None

    def lookup_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], budget: int, lookup: Lookup) -> None:
        """None: n-gram proposals are verified a step at a time here."""
        return None

    def _host(self, batch: StepBatch) -> StepBatch:
        if self.decode_act == "f32":  # as ModelRunner.prepare: generated tokens computed like prompt ones
            batch = replace(batch, decode_rows=np.zeros_like(batch.decode_rows))
        return batch
