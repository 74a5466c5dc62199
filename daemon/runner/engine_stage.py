"""EngineStage: a layer split's last stage run by the engine's own thread (`--devices cpu:0,cpu`).

Plain `cpu` as a split's last device keeps that stage in the engine's process: the stage before it
writes its hidden states to the staging slot and replies to the engine (stage_worker.py), and the
engine's thread, collecting the micro-batch, runs the last layers and the output head itself and
samples the logits where they are (runner/pipeline.py). While it does, the stages before run the
next micro-batch. On a machine with a core per stage and none spare, a worker for the last stage
left three busy threads (two stages and the engine's, which relays and samples every micro-batch)
to share the cores; this way there are as many as there are stages, and the logits rows are not
copied through shared memory.

It keeps a KV cache per runner like a worker does. A restart of the worker stages empties them too:
the caches of one stage are of no use without the others' share.
"""
from __future__ import annotations

import time

import numba
import numpy as np

from ember.daemon.loader.model_file import open_model_file
from ember.daemon.models.transformer import Transformer
from ember.daemon.runner.devices import backend_for, model_ops
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.runner.split_spec import StageSpec
from ember.daemon.runner.stage_process import CacheSpec
from ember.daemon.runner.staging import Boundary
from ember.daemon.step.step_batch import StepBatch


class EngineStage:
    def __init__(self, model_path: str, spec: StageSpec, inbox: Boundary, threads: int, prompt_act: str) -> None:
        """`inbox`: the boundary the stage before writes this stage's hidden states to; `threads`: its
        kernels' threads, on the engine's thread (numba's count is per calling thread). The thread is
        not pinned: pinned to the CPU the workers leave it while it ran the stage, the demo model's
        8 streams decoded at the same rate (1521 vs 1524 tok/s, medians of 8, 2-core VM)."""
        backend = backend_for(spec.device)
        backend.prepare()
        self.spec, self.inbox, self.threads = spec, inbox, min(threads, numba.config.NUMBA_NUM_THREADS)
        self.net = Transformer(open_model_file(model_path), model_ops(spec.device, prompt_act), range(spec.first, spec.end))
        self.caches: dict[int, PagedKVCache] = {}
        self._specs: dict[int, CacheSpec] = {}

    @property
    def name(self) -> str:
        return f"stage {self.spec.device} (layers {self.spec.first}-{self.spec.end - 1})"

    def new_cache(self, cache: int, spec: CacheSpec) -> None:
        self._specs[cache] = spec
        self.caches[cache] = self.net.new_cache(spec.blocks, spec.block_size, spec.dtype)

    def drop_cache(self, cache: int) -> None:
        self._specs.pop(cache, None)
        self.caches.pop(cache, None)

    def empty(self) -> None:
        """Every cache as new (the worker stages were restarted with theirs empty)."""
        for cache, spec in self._specs.items():
            self.new_cache(cache, spec)

    def run(self, lane: int, batch: StepBatch, cache: int) -> tuple[np.ndarray, float]:
        """The logits rows [n_logits, vocab] of a micro-batch whose hidden states wait in `lane`'s slot,
        and the seconds it took."""
        start = time.perf_counter()
        outer = numba.get_num_threads()
        numba.set_num_threads(self.threads)
        try:
            hidden = self.inbox.read(lane, len(batch.ids))
            logits = self.net.run_stage(hidden, batch.on(self.net.ops), self.caches[cache])
        finally:
            numba.set_num_threads(outer)
        return logits, time.perf_counter() - start
