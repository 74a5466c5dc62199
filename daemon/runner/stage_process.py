"""ProcessStage: the engine's handle on one `cpu:N` or `cuda:N` stage worker (stage_worker.py) — starting it,
killing it, and the commands and replies of its control channel.

The worker is a fresh interpreter (`python -m`, not multiprocessing: nothing is pickled, not even its
arguments) that inherits one end of its control socketpair and its ends of the links to its
neighbouring stages (stage_channel.py). It loads in parallel with the other stages: `spawn` returns
at once and `wait_ready` collects the Ready. A worker that dies shows as a closed channel; spawned
again (runner/pipeline.py restarts every stage), it holds the KV caches the runners asked for, empty.
"""
from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ember.daemon.runner.devices import DeviceName
from ember.daemon.channel import Channel, ChannelClosed
from ember.daemon.runner.stage_channel import (DECODER, Done, DropCache, Failed, Message, NewCache, Ready, Run, Setup,
                                               Stop)

READY_TIMEOUT = 600.0  # seconds a worker may take to map the model and load its layers
READY_TICK = 1.0  # seconds between the `tick` calls of a caller waiting for a worker to load
STOP_TIMEOUT = 5.0


class StageDied(RuntimeError):
    """A stage worker exited (killed, out of memory, crashed); the message says which and how."""


@dataclass(frozen=True)
class CacheSpec:
    blocks: int
    block_size: int
    dtype: str


def visible_gpu(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for a worker that must see cuda:`index` of this process alone: that
    GPU's entry of this process's own CUDA_VISIBLE_DEVICES where it has one (cuda:N counts the GPUs
    this process sees), else N."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise StageDied(f"cuda:{index}: CUDA_VISIBLE_DEVICES={visible} shows {len(entries)} GPU(s)")
    return entries[index]


class ProcessStage:
    def __init__(self, device: DeviceName, setup: Setup) -> None:
        self.device, self.setup = device, setup
        self.caches: dict[int, CacheSpec] = {}  # what a restarted worker must hold again
        self.process: subprocess.Popen[bytes] | None = None
        self.channel: Channel | None = None
        self.pid = 0  # the worker's, from its Ready
        self.binding = ""  # how its NUMA binding went, in words
        self.restarts = 0

    @property
    def name(self) -> str:
        return f"stage {self.device} (layers {self.setup.first}-{self.setup.end - 1})"

    def spawn(self, upstream: socket.socket | None, downstream: socket.socket | None) -> None:
        """Start the worker with its ends of the links to the stages before and after it (None: it is
        the first / the last), and send its Setup; it loads while the caller starts the other stages.
        The caller closes its copies of the links: a worker's ends then close when it dies."""
        env = dict(os.environ, NUMBA_NUM_THREADS=str(self.setup.threads))
        if self.device.kind == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = visible_gpu(self.device.index or 0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno()] + [-1 if end is None else end.fileno() for end in (upstream, downstream)]
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "ember.daemon.runner.stage_worker", *map(str, fds)],
                                            pass_fds=[fd for fd in fds if fd >= 0], env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.channel = Channel(ours, DECODER)
        self.send(self.setup)

    def wait_ready(self, deadline: float, tick: Callable[[], None] = lambda: None) -> None:
        """Collect the worker's Ready by `deadline` (time.monotonic(); one deadline for all the stages
        that load together, so N stages wait READY_TIMEOUT in all, not N times it), calling `tick` every
        READY_TICK seconds meanwhile (the daemon pets systemd's watchdog with it: a big model's stage
        may load for longer than WatchdogSec)."""
        assert self.channel is not None
        try:
            while not select.select([self.channel.sock], [], [], READY_TICK)[0]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no Ready in {READY_TIMEOUT:g} s")
                tick()
            # the frame follows its first byte at once
            self.channel.sock.settimeout(max(deadline - time.monotonic(), READY_TICK))
            reply = self.channel.recv()
        except (ChannelClosed, TimeoutError) as e:
            raise StageDied(f"{self.name} did not start: {self._exit_status()} ({e})") from None
        finally:
            self.channel.sock.settimeout(None)
        if isinstance(reply, Failed):
            self.kill()
            raise StageDied(f"{self.name} could not load: {reply.error}")
        if not isinstance(reply, Ready):
            raise StageDied(f"{self.name} answered {type(reply).__name__} to its setup")
        self.pid, self.binding = reply.pid, reply.numa
        for cache, spec in self.caches.items():
            self.send(NewCache(cache, spec.blocks, spec.block_size, spec.dtype))

    def new_cache(self, cache: int, spec: CacheSpec) -> None:
        self.caches[cache] = spec
        self.send(NewCache(cache, spec.blocks, spec.block_size, spec.dtype))

    def drop_cache(self, cache: int) -> None:
        if self.caches.pop(cache, None) is not None:
            self.send(DropCache(cache))

    def alive(self) -> bool:
        return self.channel is not None and self.process is not None and self.process.poll() is None

    def fileno(self) -> int:
        assert self.channel is not None
        return self.channel.fileno()

    def start(self, run: Run) -> None:
        self.send(run)

    def result(self) -> Done | Failed:
        """The reply to the oldest Run (blocks until it comes): only the last stage replies."""
        reply = self._recv()
        if not isinstance(reply, Done | Failed):
            raise StageDied(f"{self.name} answered {type(reply).__name__} to a micro-batch")
        return reply

    def send(self, msg: Message) -> None:
        """The channel stays open when the send fails: the worker's death then also shows where the
        pipeline waits (its end of the channel reads as closed)."""
        if self.channel is None:
            raise StageDied(f"{self.name} is not running")
        try:
            self.channel.send(msg)
        except ChannelClosed:
            raise StageDied(f"{self.name} died: {self._exit_status()}") from None

    def close(self) -> None:
        """Stop the worker (it finishes nothing: call between steps)."""
        if self.process is None:
            return
        try:
            self.send(Stop())
            self.process.wait(STOP_TIMEOUT)
        except (StageDied, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the worker and reap it; one stuck in the kernel (uninterruptible I/O) is left to
        Popen's later reaping rather than hanging the engine thread."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _recv(self) -> Message:
        assert self.channel is not None
        try:
            return self.channel.recv()
        except ChannelClosed:
            self.channel.close()
            self.channel = None
            raise StageDied(f"{self.name} died: {self._exit_status()}") from None

    def _exit_status(self) -> str:
        if self.process is None:
            return "not started"
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return "its channel closed while it still runs"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
