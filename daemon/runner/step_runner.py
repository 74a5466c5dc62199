"""StepRunner: what an executor needs of a runner — ModelRunner on one device, SplitRunner over a
layer split's stages. Step data in (StepBatch, each sampled row's RowSampling), StepRun out."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.step_run import PendingStep, StepRun
from ember.daemon.step.lookup import Lookup
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.sampling import Choice


class StepRunner(Protocol):
    config: ModelConfig
    lanes: int  # steps it may hold in flight at once
    max_sequences: int
    capture: tuple[int, ...]

    @property
    def stateful(self) -> bool: ...

    @property
    def prefix_reuse(self) -> bool:
        """Whether cached prefix blocks may stand for a sequence's first tokens (ModelRunner.prefix_reuse)."""
        ...

    @property
    def step_alignment(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def kv_blocks(self) -> int: ...

    @property
    def logits_on_device(self) -> bool:
        """Its logits rows live in GPU memory: a sequence may keep them there (RowSampling.device_logits)."""
        ...

    def device_scope(self) -> AbstractContextManager[Any]:
        """Entered around each step: the calling thread then launches on the runner's device (Ops.device_scope)."""
        ...

    def between_requests(self) -> None: ...

    def revive(self) -> bool:
        """With no step in flight and no sequence running: restart the worker processes that died since
        the last step (cold-expert workers, layer-split stages), so that the next request does not find
        them dead -> whether this runner's KV cache was emptied doing so (its cached prefixes are gone)."""
        ...

    def execute(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> StepRun: ...

    def submit(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> PendingStep: ...

    def collect(self, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun: ...

    def greedy_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> np.ndarray | None: ...

    def lookup_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], budget: int, lookup: Lookup
                     ) -> tuple[np.ndarray, int, int, int] | None: ...
