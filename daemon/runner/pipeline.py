"""Pipeline: a model's layers in stages, each a worker process (`cpu:N`, `cuda:N`), and the flow of
micro-batches through them.

It owns the stages and the shared memory between them: per boundary a staging segment of two slots
(runner/staging.py), and the logits segment the last stage writes to (one region per lane). A
micro-batch is one engine step's batch (`submit`); several may be in flight, and they pass every
stage in the order they were submitted, so while micro-batch m runs on stage 2, micro-batch m+1 runs
on stage 1 (the engine keeps `lanes` steps in flight, each on its own sequences: engine_core.py).
The calling thread only relays: it starts a micro-batch on a stage when the stage is idle, its
input is ready, and the slot it will write is free (the stage after has finished m - 2, the slot's
last user); in between it sleeps on every stage's socket at once (`collect`).

The Stage protocol is what a device must offer to be a stage: `cpu:N` and `cuda:N` are both a
ProcessStage (a worker process running that backend's ops over the same Setup / Run / Done messages).

A stage that dies: what is in flight elsewhere is drained, the dead stage is restarted with empty KV
caches, every micro-batch in flight is lost and every cache is marked lost: the runner that collects
(or submits next) gets KVStateLost, once per cache, and its engine fails the sequences it held.
"""
from __future__ import annotations

import select
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.runner.model_runner import KVStateLost
from ember.daemon.runner.split_spec import StageSpec
from ember.daemon.runner.stage_channel import Batch, Done, Failed, Message, Run, Setup, pack_batch
from ember.daemon.runner.stage_process import CacheSpec, ProcessStage, StageDied
from ember.daemon.runner.stage_worker import stage_cpus
from ember.daemon.runner.staging import Boundary, LogitsRows, Segment
from ember.daemon.runner.step_batch import StepBatch


class Stage(Protocol):
    device: DeviceName
    setup: Setup
    pid: int  # of the process that runs it
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


@dataclass
class Ticket:
    """One submitted micro-batch, until collected."""
    cache: int
    n_logits: int
    lane: int  # its logits region
    done: bool = False
    failure: str | None = None  # a stage's error
    lost: str | None = None  # a stage died while it was in flight


@dataclass
class _Micro:
    ticket: Ticket
    batch: Batch


class Pipeline:
    def __init__(self, model_path: str, config: ModelConfig, stages: Sequence[StageSpec], act_dtype: str,
                 max_tokens: int, threads: int = 1, shm_owner: str | None = None) -> None:
        """Start a worker per stage (they load in parallel); `max_tokens`: tokens per step at most (the
        engines' max_step_tokens); `threads`: kernel threads per stage; shm_owner: names the segments
        after the daemon's socket (staging.Segment.create)."""
        if config.linear is not None:  # stages would each need the sequences' recurrent state slots
            raise ValueError(f"{model_path}: a layer split of a hybrid model ({config.arch}) is not supported")
        self.config, self.act_dtype, self.max_tokens = config, act_dtype, max_tokens
        self.specs = tuple(stages)
        self.lanes = len(stages)  # micro-batches in flight at most: one per stage keeps every stage busy
        self.boundaries = [Boundary.create(config.hidden, max_tokens, act_dtype, shm_owner) for _ in stages[1:]]
        self.logits = LogitsRows.create(config.vocab, self.lanes * max_tokens, shm_owner)
        self.stages: list[Stage] = []
        on_cpu = [s for s in stages if s.device.kind == "cpu"]
        pins = dict(zip(on_cpu, stage_cpus([s.device.index or 0 for s in on_cpu], threads), strict=True))
        for i, s in enumerate(stages):
            inbox = self.boundaries[i - 1].segment.name if i else ""
            outbox = self.boundaries[i].segment.name if i < len(stages) - 1 else self.logits.segment.name
            if s.device.kind == "cpu":
                setup = Setup(model_path, s.first, s.end, s.device.index or 0, threads, act_dtype, max_tokens, inbox,
                              outbox, pins[s])
            else:  # its kernels take no host threads; it sees its GPU alone, as cuda:0 (ProcessStage.spawn)
                setup = Setup(model_path, s.first, s.end, 0, 1, act_dtype, max_tokens, inbox, outbox, device="cuda:0")
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
        self._lock = threading.RLock()  # one thread at a time moves the flow
        self._caches = 0
        self._dropped: list[int] = []  # finalized runners' caches, dropped at the next submit
        self._lost: set[int] = set()  # caches a restart emptied whose runner has not been told yet
        self._micro: dict[int, _Micro] = {}  # in flight, by number (submission order)
        self._next = 0  # the next micro-batch's number
        self._started = [0] * len(stages)  # per stage: micro-batches started (all before this number)
        self._done = [0] * len(stages)  # and finished
        self._free_lanes = list(range(self.lanes))
        # per stage, as the engine's process sees it (start sent -> reply read), and the stage's own
        # time on its micro-batches (what it reports): for benchmarks
        self.busy_seconds = [0.0] * len(stages)
        self.run_seconds = [0.0] * len(stages)
        self.runs = [0] * len(stages)
        self._since = [0.0] * len(stages)

    @property
    def staging_bytes(self) -> list[int]:
        """Per stage, the staging memory it receives hidden states in (0 for the first), the last one's
        with the logits segment it writes: the planner's DevicePlan.staging for the same split,
        act_dtype and step tokens."""
        sizes = [0] + [b.segment.nbytes for b in self.boundaries]
        sizes[-1] += self.logits.segment.nbytes
        return sizes

    def describe(self) -> list[str]:
        return [f"{s.name}: pid {s.pid}, {s.binding}" for s in self.stages]

    def new_cache(self, spec: CacheSpec) -> int:
        with self._lock:
            self._caches += 1
            for stage in self.stages:
                try:
                    stage.new_cache(self._caches, spec)
                except StageDied:
                    pass  # recorded: a restart creates it; the dead stage is found at the next step
            return self._caches

    def drop_cache(self, cache: int) -> None:
        """Forget a runner's KV cache (any thread, a finalizer too: sent before the next submit)."""
        self._dropped.append(cache)

    def submit(self, batch: StepBatch, cache: int) -> Ticket:
        """Start `batch` (host arrays) through the stages with KV cache `cache`; collect() its logits."""
        if len(batch.ids) > self.max_tokens:
            raise ValueError(f"a step of {len(batch.ids)} tokens is over the split's {self.max_tokens} (max_step_tokens)")
        with self._lock:
            self._drop_finalized()
            if cache in self._lost:
                self._lost.discard(cache)
                raise KVStateLost("a layer-split stage died and was restarted: this runner's KV cache is lost")
            if not self._free_lanes:
                raise RuntimeError(f"{self.lanes} micro-batches are in flight already: collect one first")
            ticket = Ticket(cache, batch.n_logits, self._free_lanes.pop())
            self._micro[self._next] = _Micro(ticket, pack_batch(batch))
            self._next += 1
            self._flow()
            return ticket

    def collect(self, ticket: Ticket) -> np.ndarray:
        """The logits [n_logits, vocab] f32 of a submitted micro-batch (waits for it)."""
        with self._lock:
            while not ticket.done:
                self._wait()
                self._flow()
            if ticket.lost is not None:
                self._lost.discard(ticket.cache)
                raise KVStateLost(ticket.lost)
            self._free_lanes.append(ticket.lane)
            if ticket.failure is not None:
                raise RuntimeError(ticket.failure)
            return self.logits.rows(ticket.lane * self.max_tokens, ticket.n_logits).copy()

    def forward(self, batch: StepBatch, cache: int) -> np.ndarray:
        return self.collect(self.submit(batch, cache))

    def close(self) -> None:
        self._closer()

    # --- the flow -----------------------------------------------------------------------------------
    def _flow(self) -> None:
        """Start every micro-batch that can start now."""
        last = len(self.stages) - 1
        progress = True
        while progress:
            progress = False
            for s, stage in enumerate(self.stages):
                m = self._started[s]
                # idle, something to do, its input ready, and its outbox slot's last user (m - 2) read
                if self._started[s] != self._done[s] or m >= self._next or (s and self._done[s - 1] <= m) \
                        or (s < last and self._done[s + 1] < m - 1):
                    continue
                micro = self._micro[m]
                self._started[s] += 1
                progress = True
                if micro.ticket.failure is not None:  # failed at an earlier stage: passes through untouched
                    self._finished(s, m)
                    continue
                out = micro.ticket.lane * self.max_tokens if s == last else m % 2
                try:
                    stage.start(Run(m, micro.ticket.cache, micro.batch, -1 if s == 0 else (m % 2), out))
                except StageDied as e:
                    self._recover(e)
                    return
                self._since[s] = time.perf_counter()

    def _wait(self) -> None:
        """Sleep until a busy stage answers; account its reply."""
        busy = [stage for s, stage in enumerate(self.stages) if self._started[s] > self._done[s]]
        if not busy:
            raise RuntimeError("the pipeline is stalled: nothing in flight can move (a bug)")
        ready, _, _ = select.select(busy, [], [])
        for stage in ready:
            s = self.stages.index(stage)
            try:
                reply = stage.result()
            except StageDied as e:
                self._recover(e)
                return
            m = self._done[s]
            self.busy_seconds[s] += time.perf_counter() - self._since[s]
            self.run_seconds[s] += reply.seconds if isinstance(reply, Done) else 0.0
            self.runs[s] += 1
            if isinstance(reply, Failed) and self._micro[m].ticket.failure is None:
                self._micro[m].ticket.failure = f"{stage.name}: {reply.error}"
            self._finished(s, m)

    def _finished(self, s: int, m: int) -> None:
        self._done[s] += 1
        if s == len(self.stages) - 1:
            self._micro.pop(m).ticket.done = True

    def _recover(self, died: StageDied) -> None:
        """A stage died: drain the live ones, restart the dead (empty KV caches), lose what was in flight."""
        for s, stage in enumerate(self.stages):
            if self._started[s] > self._done[s] and stage.alive():
                try:
                    stage.result()
                except StageDied:
                    pass
        for stage in self.stages:
            if not stage.alive():
                stage.restart()
        why = f"{died}; restarted, the sequences it held are lost"
        for micro in self._micro.values():
            micro.ticket.done, micro.ticket.lost = True, why
            self._free_lanes.append(micro.ticket.lane)
        self._micro.clear()
        self._started = [self._next] * len(self.stages)
        self._done = [self._next] * len(self.stages)
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


def _stage_for(device: DeviceName, setup: Setup) -> Stage:
    if device.kind == "cuda" or device.index is not None:
        return ProcessStage(device, setup)
    backend_for(device)  # a kind without a backend says so
    raise ValueError(f"{device} cannot be a layer-split stage: stages are cpu:N and cuda:N worker processes")


def _close(stages: list[Stage], segments: list[Segment]) -> None:
    for stage in stages:
        stage.close()
    for segment in segments:
        segment.close()
