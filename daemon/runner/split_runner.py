"""A model's layers split into stages, each a worker process (`cpu:N`), and the runner the engine
drives over them.

Pipeline owns the stages and the shared memory between them: per boundary a staging segment of two
slots (runner/staging.py), and the logits segment the last stage writes to. A step's tokens are cut
into micro-batches along sequence boundaries (a sequence's tokens never span two: attention reads
its own KV only), and the micro-batches flow through the stages in order — while micro-batch m runs
on stage 2, micro-batch m+1 runs on stage 1. The engine's thread only relays: it starts a
micro-batch on a stage when the stage is idle, its input is ready, and the slot it will write is
free (the stage after has finished the micro-batch that used it before), and it sleeps on every
stage's socket at once in between. The last stage returns the logits rows; SplitRunner is a
ModelRunner, so sampling is the single-device path's own code, where the single-device path runs it.

The Stage protocol is what a device must offer to be a stage: `cpu:N` is a ProcessStage; a CUDA
device plugs in as another implementation over the same Setup / Run / Done messages.

A stage that dies: the micro-batches in flight elsewhere are drained, the dead stage is restarted
with empty KV caches, and the step raises KVStateLost — the engine fails the sequences that had
state in this pipeline and goes on (every other runner over the pipeline learns it at its next step).
"""
from __future__ import annotations

import select
import threading
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.runner.model_runner import KVStateLost, ModelRunner, check_decode_act
from ember.daemon.runner.stage_channel import Done, Failed, Message, Run, Setup, pack_batch
from ember.daemon.runner.split_spec import StageSpec
from ember.daemon.runner.stage_process import CacheSpec, ProcessStage, StageDied
from ember.daemon.runner.staging import Boundary, LogitsRows, Segment
from ember.daemon.runner.step_batch import StepBatch
from ember.kernels.ops import Array


class Stage(Protocol):
    device: DeviceName
    setup: Setup
    pid: int  # of the process that runs it (the engine's own for an in-process stage)
    binding: str  # where it runs, in words (NUMA node, GPU)
    restarts: int

    @property
    def name(self) -> str: ...
    def spawn(self) -> None: ...
    def wait_ready(self) -> None: ...
    def restart(self) -> None: ...
    def new_cache(self, cache: int, spec: CacheSpec) -> None: ...
    def drop_cache(self, cache: int) -> None: ...
    def alive(self) -> bool: ...
    def fileno(self) -> int: ...
    def start(self, run: Run) -> None: ...
    def result(self) -> Done | Failed: ...
    def send(self, msg: Message) -> None: ...
    def close(self) -> None: ...


class Pipeline:
    def __init__(self, model_path: str, config: ModelConfig, stages: Sequence[StageSpec], act_dtype: str,
                 max_tokens: int, threads: int = 1, micro_batches: int | None = None) -> None:
        """Start a worker per stage (they load in parallel); `max_tokens`: tokens per step at most (the
        engines' max_step_tokens); `micro_batches`: a step is cut into this many at most (default: one
        per stage)."""
        if config.linear is not None:  # stages would each need the sequences' recurrent state slots
            raise ValueError(f"{model_path}: a layer split of a hybrid model ({config.arch}) is not supported")
        self.config, self.act_dtype, self.max_tokens = config, act_dtype, max_tokens
        self.micro_batches = micro_batches or len(stages)
        self.specs = tuple(stages)
        self.boundaries = [Boundary.create(config.hidden, max_tokens, act_dtype) for _ in stages[1:]]
        self.logits = LogitsRows.create(config.vocab, max_tokens)
        self.stages: list[Stage] = []
        for i, s in enumerate(stages):
            inbox = self.boundaries[i - 1].segment.name if i else ""
            outbox = self.boundaries[i].segment.name if i < len(stages) - 1 else self.logits.segment.name
            setup = Setup(model_path, s.first, s.end, s.device.index or 0, threads, act_dtype, max_tokens, inbox, outbox)
            self.stages.append(_stage_for(s.device, setup))
        self._segments = [b.segment for b in self.boundaries] + [self.logits.segment]
        self._closer = weakref.finalize(self, _close, self.stages, self._segments)
        try:
            for stage in self.stages:
                stage.spawn()
            for stage in self.stages:
                stage.wait_ready()
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()  # one step at a time: the daemon's engine thread, or a Model call
        self._caches = 0
        self._dropped: list[int] = []  # finalized runners' caches, dropped at the next step
        self._lost: set[int] = set()  # caches a restart emptied whose runner has not been told yet

    @property
    def staging_bytes(self) -> list[int]:
        """Per stage, the staging memory it receives hidden states in (0 for the first): the planner's
        DevicePlan.staging for the same split, act_dtype and step tokens."""
        return [0] + [b.segment.nbytes for b in self.boundaries]

    def describe(self) -> list[str]:
        return [f"{s.name}: pid {s.pid}, {s.binding}" for s in self.stages]

    def new_cache(self, spec: CacheSpec) -> int:
        with self._lock:
            self._drop_finalized()
            self._caches += 1
            for stage in self.stages:
                stage.new_cache(self._caches, spec)
            return self._caches

    def drop_cache(self, cache: int) -> None:
        """Forget a runner's KV cache (any thread, a finalizer too: sent before the next step)."""
        self._dropped.append(cache)

    def forward(self, batch: StepBatch, cache: int) -> np.ndarray:
        """Logits [batch.n_logits, vocab] f32 of the host batch, run through every stage."""
        if len(batch.ids) > self.max_tokens:
            raise ValueError(f"a step of {len(batch.ids)} tokens is over the split's {self.max_tokens} (max_step_tokens)")
        with self._lock:
            self._drop_finalized()
            if cache in self._lost:
                self._lost.discard(cache)
                raise KVStateLost("a layer-split stage died and was restarted since the last step: its KV cache is lost")
            try:
                self._run(split_micro_batches(batch, self.micro_batches), cache)
            except StageDied as e:
                self._recover()
                self._lost.discard(cache)
                raise KVStateLost(f"{e}; restarted, the sequences it held are lost") from None
            return self.logits.rows(0, batch.n_logits).copy()

    def close(self) -> None:
        self._closer()

    def _run(self, micro: list[tuple[StepBatch, int]], cache: int) -> None:
        """Every micro-batch through every stage, each stage as soon as its input and output are free."""
        n, last = len(micro), len(self.stages) - 1
        packed = [pack_batch(b) for b, _ in micro]
        started, done = [0] * len(self.stages), [0] * len(self.stages)
        failure: str | None = None
        died: StageDied | None = None
        while done[last] < n:
            for s, stage in enumerate(self.stages):
                m = started[s]
                idle = started[s] == done[s] and m < n
                # input ready; the outbox slot free: the stage after has finished slot m % 2's last user, m - 2
                if idle and failure is None and died is None and (s == 0 or done[s - 1] > m) \
                        and (s == last or done[s + 1] >= m - 1):
                    out = micro[m][1] if s == last else m % 2
                    try:
                        stage.start(Run(m, cache, packed[m], -1 if s == 0 else m % 2, out))
                    except StageDied as e:
                        died = died or e
                        continue
                    started[s] += 1
            busy = [stage for s, stage in enumerate(self.stages) if started[s] > done[s]]
            if not busy:
                break  # a failure stopped the flow and everything in flight has come back
            ready, _, _ = select.select(busy, [], [])
            for stage in ready:
                s = self.stages.index(stage)
                try:
                    reply = stage.result()
                except StageDied as e:
                    died, started[s] = died or e, done[s]  # nothing more will come from it
                    continue
                done[s] += 1
                if isinstance(reply, Failed):
                    failure = failure or f"{stage.name}: {reply.error}"
        if died is not None:
            raise died
        if failure is not None:
            raise RuntimeError(failure)

    def _recover(self) -> None:
        """Restart every dead stage (their KV caches come back empty) and mark every cache as lost."""
        for stage in self.stages:
            if not stage.alive():
                stage.restart()
        self._lost = set(range(1, self._caches + 1)) - set(self._dropped)

    def _drop_finalized(self) -> None:
        while self._dropped:
            cache = self._dropped.pop()
            self._lost.discard(cache)
            for stage in self.stages:
                try:
                    stage.drop_cache(cache)
                except StageDied:
                    pass  # found and restarted at the next step


class SplitRunner(ModelRunner):
    """A ModelRunner whose forward pass runs in a Pipeline's stages, with a KV cache of its own there."""

    stateful = False  # Pipeline refuses hybrid models

    def __init__(self, pipeline: Pipeline, kv_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 decode_act: str = "q8_0") -> None:
        check_decode_act(decode_act)
        self.pipeline, self.config, self.decode_act = pipeline, pipeline.config, decode_act
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

    def forward(self, batch: StepBatch) -> Array:
        if self.decode_act == "f32":
            batch = replace(batch, decode_rows=np.zeros_like(batch.decode_rows))
        return self.pipeline.forward(batch, self.cache_id)


def split_micro_batches(batch: StepBatch, parts: int) -> list[tuple[StepBatch, int]]:
    """`batch` cut into at most `parts` batches of whole sequences with about equal token counts, each
    with the index of its first logits row in the whole batch's (rows keep their order)."""
    seqs = int(batch.tables.shape[0])
    rows = np.asarray(batch.logit_rows)
    if parts <= 1 or seqs < 2 or np.any(np.diff(rows) <= 0):
        return [(batch, 0)]
    seq = np.asarray(batch.token_seq)
    # the first token of each sequence (tokens are laid out sequence by sequence)
    starts = np.searchsorted(seq, np.arange(seqs + 1))
    n = len(seq)
    cuts = sorted({int(starts[np.searchsorted(starts, n * k / parts)]) for k in range(1, parts)} - {0, n})
    bounds = [0, *cuts, n]
    out = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        s0, s1 = int(seq[a]), int(seq[b - 1]) + 1
        keep = (rows >= a) & (rows < b)
        out.append((StepBatch(
            ids=batch.ids[a:b], positions=batch.positions[a:b], token_seq=seq[a:b] - s0,
            kv_blocks=batch.kv_blocks[a:b], kv_offsets=batch.kv_offsets[a:b], tables=batch.tables[s0:s1],
            logit_rows=rows[keep] - a, decode_rows=batch.decode_rows[a:b]), int(np.count_nonzero(rows < a))))
    return out


def _stage_for(device: DeviceName, setup: Setup) -> Stage:
    if device.kind == "cpu" and device.index is not None:
        return ProcessStage(device, setup)
    backend_for(device)  # a kind without a backend says so
    raise ValueError(f"{device} cannot be a layer-split stage yet: stages are cpu:N worker processes in this build")


def _close(stages: list[Stage], segments: list[Segment]) -> None:
    for stage in stages:
        stage.close()
    for segment in segments:
        segment.close()
