"""Pipeline: a model's layers in stages, each a worker process (`cpu:N`, `cuda:N`), and the flow of
micro-batches through them.

It owns the stages and the shared memory between them: per boundary a staging segment with a slot
per micro-batch in flight (runner/staging.py), and the logits segment the last stage writes to (a
region each). A micro-batch is one engine step's batch (`submit`); up to `lanes` (one per stage) may
be in flight, each in a lane of its own, and they pass every stage in the order they were
submitted, so while micro-batch m runs on stage 2, micro-batch m+1 runs on stage 1 (the engine keeps
`lanes` steps in flight, each on its own sequences: engine_core.py).

The engine's thread hands a micro-batch to the first stage and hears back from the last; in between,
each stage hands it straight to the next over a link of their own as it finishes (stage_channel.py),
so no hop waits for the engine's thread to be scheduled. On a machine whose cores are all running
stages, relaying every hop through that thread cost a context switch each way and left the next
stage idle until the engine's Python had run.

The Stage protocol is what a device must offer to be a stage: `cpu:N` and `cuda:N` are both a
ProcessStage (a worker process running that backend's ops over the same Setup / Run / Done messages).
Plain `cpu` as the last device is the engine's own thread (runner/engine_stage.py): the last worker
then replies with hidden states in a staging slot, and collect() runs the last layers and the head.

A stage that dies: every stage is restarted, with empty KV caches, every micro-batch in flight is
lost and every cache is marked lost: the runner that collects (or submits next) gets KVStateLost,
once per cache, and its engine fails the sequences it held. The live stages are restarted too
because their links to the dead one are gone and their queues hold the lost micro-batches; what
they held in their KV caches is of no use without the dead stage's share.
"""
from __future__ import annotations

import logging
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.runner.engine_stage import EngineStage
from ember.daemon.runner.step_run import KVStateLost
from ember.daemon.runner.split_spec import StageSpec, in_engine
from ember.daemon.runner.stage_channel import Done, Failed, Message, Run, Setup, pack_batch
from ember.daemon.runner.stage_process import READY_TIMEOUT, CacheSpec, ProcessStage, StageDied
from ember.daemon.runner.stage_worker import stage_cpus
from ember.daemon.runner.staging import Boundary, LogitsRows, Segment
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.convert import DEFAULT_PROMPT_ACT

log = logging.getLogger("ember.pipeline")


class Stage(Protocol):
    device: DeviceName
    setup: Setup
    pid: int  # of the process that runs it
    binding: str  # where it runs, in words (NUMA node, GPU)
    restarts: int

    @property
    def name(self) -> str: ...
    def spawn(self, upstream: socket.socket | None, downstream: socket.socket | None) -> None: ...
    def wait_ready(self, deadline: float, tick: Callable[[], None] = ...) -> None: ...
    def kill(self) -> None: ...
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
    micro_batch: int
    cache: int
    n_logits: int
    lane: int  # its staging slots and logits region
    batch: StepBatch | None = None  # for the engine's own stage to run at collect()
    done: bool = False
    failure: str | None = None  # a stage's error
    lost: str | None = None  # a stage died while it was in flight


class Pipeline:
    def __init__(self, model_path: str, config: ModelConfig, stages: Sequence[StageSpec], act_dtype: str,
                 max_tokens: int, threads: int = 1, shm_owner: str | None = None,
                 prompt_act: str = DEFAULT_PROMPT_ACT) -> None:
        """Start a worker per stage (they load in parallel); `max_tokens`: tokens per step at most (the
        engines' max_step_tokens); `threads`: kernel threads per stage; shm_owner: names the segments
        after the daemon's socket (staging.Segment.create); prompt_act: the stages' prompt activations."""
        if config.linear is not None:  # stages would each need the sequences' recurrent state slots
            raise ValueError(f"{model_path}: a layer split of a hybrid model ({config.arch}) is not supported")
        if config.layer_input_dim or config.kv_shared_layers:  # later stages would need the first one's inputs, K/V
            raise ValueError(f"{model_path}: a layer split of a model with per-layer embeddings or shared K/V "
                             f"({config.arch}) is not supported")
        self.config, self.act_dtype, self.max_tokens = config, act_dtype, max_tokens
        self.specs = tuple(stages)
        self.lanes = len(stages)  # micro-batches in flight at most: one per stage keeps every stage busy
        self.boundaries = [Boundary.create(config.hidden, max_tokens, act_dtype, self.lanes, shm_owner)
                           for _ in stages[1:]]
        local = in_engine(stages[-1].device)
        # the logits rows come back through shared memory from a last stage in a worker process
        self.logits = None if local else LogitsRows.create(config.vocab, self.lanes * max_tokens, shm_owner)
        self._segments = [b.segment for b in self.boundaries] + ([] if self.logits is None else [self.logits.segment])
        self.stages: list[Stage] = []  # the worker processes, in order
        self.engine_stage: EngineStage | None = None
        # the engine's own stage counts too: the workers are pinned to CPUs apart from one group it is left
        on_cpu = [s for s in stages if s.device.kind == "cpu"]
        pins = dict(zip(on_cpu, stage_cpus([s.device.index or 0 for s in on_cpu], threads), strict=True))
        names = [segment.name for segment in self._segments]  # worker i reads boundary i - 1, writes the next
        for i, s in enumerate(stages[:-1] if local else stages):
            inbox, outbox = names[i - 1] if i else "", names[i]
            if s.device.kind == "cpu":
                setup = Setup(model_path, s.first, s.end, s.device.index or 0, threads, act_dtype, max_tokens, inbox,
                              outbox, pins[s], prompt_act=prompt_act)
            else:  # its kernels take no host threads; it sees its GPU alone, as cuda:0 (ProcessStage.spawn)
                setup = Setup(model_path, s.first, s.end, 0, 1, act_dtype, max_tokens, inbox, outbox, device="cuda:0",
                              prompt_act=prompt_act)
            self.stages.append(_stage_for(s.device, setup))
        self._closer = weakref.finalize(self, _close, self.stages, self._segments)
        # called every few seconds while stages restart (the step that found a death waits for them):
        # the daemon pets systemd's watchdog with it
        self.heartbeat: Callable[[], None] = lambda: None
        try:
            if local:
                self.engine_stage = EngineStage(model_path, stages[-1], self.boundaries[-1], threads, prompt_act)
            self._start_stages()
        except BaseException:
            self.close()
            raise
        self._lock = threading.RLock()  # one thread at a time moves the flow
        self._caches = 0  # the last cache id handed out
        self._live: set[int] = set()  # cache ids whose runners have not been finalized
        self._dropped: list[int] = []  # finalized runners' caches, dropped at the next submit
        self._lost: set[int] = set()  # caches a restart emptied whose runner has not been told yet
        self._in_flight: deque[Ticket] = deque()  # in submission order: the last stage replies in it
        self._next = 0  # the next micro-batch's number
        self._held: dict[int, Ticket] = {}  # by lane: submitted, not yet collected (nor lost); the rest are free
        self._down: str | None = None  # why the stages are down: a restart failed (the next submit tries again)
        # per stage, its own time on its micro-batches (as it reports them) and their count: for benchmarks
        self.run_seconds = [0.0] * len(stages)
        self.runs = [0] * len(stages)

    @property
    def staging_bytes(self) -> list[int]:
        """Per stage, the staging memory it receives hidden states in (0 for the first), the last one's
        with the logits segment it writes if it is a worker: the planner's DevicePlan.staging for the
        same split, act_dtype and step tokens."""
        sizes = [0] + [b.segment.nbytes for b in self.boundaries]
        sizes[-1] += 0 if self.logits is None else self.logits.segment.nbytes
        return sizes

    def describe(self) -> list[str]:
        mine = [] if self.engine_stage is None else [f"{self.engine_stage.name}: the engine's own thread"]
        return [f"{s.name}: pid {s.pid}, {s.binding}" for s in self.stages] + mine

    def new_cache(self, spec: CacheSpec) -> int:
        with self._lock:
            self._caches += 1
            self._live.add(self._caches)
            for stage in self.stages:
                try:
                    stage.new_cache(self._caches, spec)
                except StageDied:
                    pass  # recorded: a restart creates it; the dead stage is found at the next step
            if self.engine_stage is not None:
                self.engine_stage.new_cache(self._caches, spec)
            return self._caches

    def revive(self, cache: int) -> bool:
        """With nothing in flight: restart every stage if one died since the last step -> whether the
        caller's cache (`cache`) was emptied, by this restart or an earlier one it was not told of. The
        other runners' caches learn it at their next submit (KVStateLost). KVStateLost where the stages
        cannot be restarted."""
        with self._lock:
            if self._in_flight:
                return False
            if all(stage.alive() for stage in self.stages) and self._down is None:
                if cache in self._lost:
                    self._lost.discard(cache)
                    return True
                return False
            dead = [stage.name for stage in self.stages if not stage.alive()]
            log.error("layer-split stage(s) %s died between steps; restarting every stage", ", ".join(dead))
            self._restart()
            self._lost = self._live - set(self._dropped) - {cache}
            return True

    def drop_cache(self, cache: int) -> None:
        """Forget a runner's KV cache (any thread, a finalizer too: sent before the next submit)."""
        self._dropped.append(cache)

    def submit(self, batch: StepBatch, cache: int) -> Ticket:
        """Start `batch` (host arrays) through the stages with KV cache `cache`; collect() its logits."""
        if len(batch.ids) > self.max_tokens:
            raise ValueError(f"a step of {len(batch.ids)} tokens is over the split's {self.max_tokens} (max_step_tokens)")
        with self._lock:
            if self._down is not None:
                self._restart()
            self._drop_finalized()
            if cache in self._lost:
                self._lost.discard(cache)
                raise KVStateLost("a layer-split stage died and was restarted: this runner's KV cache is lost")
            lane = next((lane for lane in range(self.lanes) if lane not in self._held), None)
            if lane is None:
                raise RuntimeError(f"{self.lanes} micro-batches are in flight already: collect one first")
            ticket = Ticket(self._next, cache, batch.n_logits, lane, None if self.engine_stage is None else batch)
            self._next += 1
            self._in_flight.append(ticket)
            self._held[lane] = ticket
            try:
                self.stages[0].start(Run(ticket.micro_batch, cache, pack_batch(batch), ticket.lane))
            except StageDied as e:
                self._recover(e)
            return ticket

    def collect(self, ticket: Ticket) -> np.ndarray:
        """The logits [n_logits, vocab] f32 of a submitted micro-batch (waits for it)."""
        with self._lock:
            while not ticket.done:
                self._wait()
            if ticket.lost is not None:
                self._lost.discard(ticket.cache)
                raise KVStateLost(ticket.lost)
            try:
                if ticket.failure is not None:
                    raise RuntimeError(ticket.failure)
                if self.logits is not None:
                    return self.logits.rows(ticket.lane * self.max_tokens, ticket.n_logits).copy()
                return self._run_engine_stage(ticket)
            finally:
                self._release(ticket)

    def forward(self, batch: StepBatch, cache: int) -> np.ndarray:
        return self.collect(self.submit(batch, cache))

    def close(self) -> None:
        self._closer()

    # --- the flow -----------------------------------------------------------------------------------
    def _run_engine_stage(self, ticket: Ticket) -> np.ndarray:
        """The last stage's layers and head on this thread, from the hidden states the last worker left
        in the ticket's slot (while the workers run the next micro-batch)."""
        assert self.engine_stage is not None and ticket.batch is not None
        try:
            logits, seconds = self.engine_stage.run(ticket.lane, ticket.batch, ticket.cache)
        except Exception as e:  # the micro-batch's failure, as a worker stage's would be
            raise RuntimeError(f"{self.engine_stage.name}: {type(e).__name__}: {e}") from e
        self.run_seconds[-1] += seconds
        self.runs[-1] += 1
        return logits

    def _start_stages(self) -> None:
        """Spawn every stage with fresh links between neighbours, then wait for them all (they load in parallel)."""
        links = [socket.socketpair() for _ in self.stages[1:]]
        try:
            for s, stage in enumerate(self.stages):
                stage.spawn(links[s - 1][1] if s else None, links[s][0] if s < len(links) else None)
        finally:
            for ends in links:  # the workers hold them now: a link closes when a stage at its end dies
                for end in ends:
                    end.close()
        deadline = time.monotonic() + READY_TIMEOUT  # for them all: they load at the same time
        for stage in self.stages:
            stage.wait_ready(deadline, self.heartbeat)

    def _wait(self) -> None:
        """Sleep until the last stage replies or a stage dies; account the reply."""
        if not self._in_flight:
            raise RuntimeError("the pipeline is stalled: nothing is in flight (a bug)")
        last = self.stages[-1]
        # a dead stage's channel reads as closed: its death wakes this, also one a failed send found
        ready, _, _ = select.select(self.stages, [], [])
        for stage in sorted(ready, key=lambda stage: stage is last):  # a death first: a reply after it is void
            try:
                reply = stage.result()
            except StageDied as e:
                self._recover(e)
                return
            ticket = self._in_flight.popleft()
            if stage is not last or reply.micro_batch != ticket.micro_batch:
                raise RuntimeError(f"{stage.name} replied for micro-batch {reply.micro_batch} while "
                                   f"{ticket.micro_batch} was due from {last.name} (a bug)")
            if isinstance(reply, Failed):
                at = self.stages[reply.stage] if 0 <= reply.stage < len(self.stages) else last
                ticket.failure = f"{at.name}: {reply.error}"
            for s, seconds in enumerate(reply.seconds if isinstance(reply, Done) else []):
                self.run_seconds[s] += seconds
                self.runs[s] += 1
            ticket.done = True

    def _recover(self, died: StageDied) -> None:
        """A stage died: restart every stage (empty KV caches), lose every step not yet collected
        (those whose reply came too: their runners' caches are gone, and a runner that learns it at
        its next submit drops its steps without collecting them)."""
        try:
            self._restart()
            why = f"{died}; restarted, the sequences it held are lost"
        except KVStateLost as e:
            why = f"{died}; {e}"
        for ticket in list(self._held.values()):
            ticket.done, ticket.lost = True, why
            self._release(ticket)  # no logits to read: the lane is free at once
        self._in_flight.clear()
        self._lost = self._live - set(self._dropped)

    def _restart(self) -> None:
        """Kill every stage and start them again; where that fails, they stay down (KVStateLost says
        why) and the next submit tries again."""
        for stage in self.stages:
            stage.kill()
            stage.restarts += 1
        try:
            self._start_stages()
        except Exception as e:
            for stage in self.stages:
                stage.kill()
            self._down = f"{type(e).__name__}: {e}"
            raise KVStateLost(f"the layer-split stages could not be restarted ({self._down}); the next step "
                              "tries again") from None
        finally:
            if self.engine_stage is not None:
                self.engine_stage.empty()
        self._down = None

    def _release(self, ticket: Ticket) -> None:
        del self._held[ticket.lane]

    def _drop_finalized(self) -> None:
        """Drop the caches of finalized runners. A step of theirs still in flight is waited for first:
        the stages after the first take the DropCache on their control channel, which may overtake
        the step coming down the links. Nobody will collect such a step: its lane is freed."""
        while self._dropped:
            cache = self._dropped[-1]
            while any(t.cache == cache for t in self._in_flight):
                self._wait()
            for ticket in [t for t in self._held.values() if t.cache == cache]:
                self._release(ticket)
            self._lost.discard(cache)
            self._live.discard(cache)
            for stage in self.stages:
                try:
                    stage.drop_cache(cache)
                except StageDied:
                    pass  # found and restarted at the next step
            if self.engine_stage is not None:
                self.engine_stage.drop_cache(cache)
            self._dropped.remove(cache)


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
