"""SplitRunner: the runner the engine drives over a layer split (runner/pipeline.py).

It is a ModelRunner whose forward pass runs in the pipeline's stages, with a KV cache of its own in
each: the last stage returns the logits rows, and sampling is the single-device path's own code, run
where the single-device path runs it (the engine's process, on the host). Its `lanes` let the
engine keep a step in flight per stage (engine_core.py): that is what keeps every stage busy.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from dataclasses import replace

import numpy as np

from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.runner.model_runner import ModelRunner, PendingStep, check_decode_act
from ember.daemon.runner.pipeline import Pipeline
from ember.daemon.runner.stage_process import CacheSpec
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.ops import Array


class SplitRunner(ModelRunner):
    stateful = False  # Pipeline refuses hybrid models
    capture: tuple[int, ...] = ()  # no hidden states go to a draft (load refuses a draft with a split)

    def __init__(self, pipeline: Pipeline, kv_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 decode_act: str = "q8_0") -> None:
        check_decode_act(decode_act)
        self.pipeline, self.config, self.decode_act = pipeline, pipeline.config, decode_act
        self.lanes = pipeline.lanes
        host = DeviceName("cpu")
        self.ops = backend_for(host).ops(host)  # sampling runs on the host, as on the CPU path
        self.spec = CacheSpec(kv_blocks, block_size, kv_dtype)
        self.cache_id = pipeline.new_cache(self.spec)
        weakref.finalize(self, pipeline.drop_cache, self.cache_id)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def kv_blocks(self) -> int:
        return self.spec.blocks

    def between_requests(self) -> None:
        """Nothing to do: a split model's stages keep every MoE expert hot."""

    def submit(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> PendingStep:
        """Start the step in the stages and return at once: the pipeline's ticket is what collect() waits on."""
        return PendingStep(self.pipeline.submit(self._host(batch), self.cache_id), batch.n_logits, list(samplers),
                           list(keep))

    def forward(self, batch: StepBatch) -> Array:
        return self.pipeline.forward(self._host(batch), self.cache_id)

    def _greedy_burst(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> None:
        """None: no compiled loop spans the stages' processes, so a burst (one lane: a single stage, or
        a split kept to one step in flight) goes through them step by step."""
        return None

    def _logits_of(self, step: PendingStep) -> Array:
        return self.pipeline.collect(step.work)

    def _host(self, batch: StepBatch) -> StepBatch:
        if self.decode_act == "f32":  # as ModelRunner.prepare: generated tokens computed like prompt ones
            batch = replace(batch, decode_rows=np.zeros_like(batch.decode_rows))
        return batch
