"""A layer-split stage worker: the process behind a `cpu:N` or a `cuda:N` stage.

Started by runner/stage_process.py as `python -m ember.daemon.runner.stage_worker CONTROL UP DOWN`: its
ends of the control channel and of the links to the stages before and after it (-1: none), all
inherited file descriptors (stage_channel.py). A cpu:N stage binds itself to NUMA node N's CPUs where
the machine has that node; a cuda:N stage sees GPU N alone (as its cuda:0). It maps the model file
itself (pages shared with every other process mapping it), loads only its layers' weights (the
embedding if it runs the first layer, the output head if the last), and keeps one KV cache per
engine over those weights. Then it runs micro-batches until told to stop, or until the control
channel closes (the engine's process went away): each comes from the engine (the first stage) or
from the stage before, as that stage finishes it; hidden states in from the inbox slot (or token ids
embedded), its layers, hidden states out to the outbox slot (or logits rows out); then it goes on to
the stage after, or, from the last stage, back to the engine as Done.

A failure inside a micro-batch travels on with it to the last stage, which replies Failed, and the
worker goes on; a failure to set up is reported and the worker exits 1. A link that closes means a
neighbour died: the worker stops using it and waits to be killed (the engine restarts every stage).
"""
from __future__ import annotations

import os
import select
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ember.daemon.runner.devices import DeviceName, backend_for, model_ops
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.channel import Channel, ChannelClosed
from ember.daemon.runner.stage_channel import (DECODER, Done, DropCache, Failed, NewCache, Ready, Run, Setup, Stop,
                                               unpack_batch)
from ember.daemon.runner.staging import Boundary, LogitsRows, Segment

NODE_DIR = Path("/sys/devices/system/node")


def node_cpulist(node: int) -> str | None:
    """NUMA node `node`'s CPUs in the kernel's cpulist format, or None where the machine has no such node."""
    try:
        return (NODE_DIR / f"node{node}" / "cpulist").read_text().strip()
    except OSError:
        return None


def bind_to_numa_node(node: int) -> str:
    """Run on node `node`'s CPUs (memory this process touches first is then allocated there by the
    kernel's first-touch policy). A machine without that node leaves the process unbound."""
    cpulist = node_cpulist(node)
    if cpulist is None:
        return f"unbound: this machine has no NUMA node {node}"
    cpus = parse_cpulist(cpulist)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        return f"unbound: binding to node {node}'s CPUs {cpulist} failed ({e.strerror})"
    return f"bound to NUMA node {node} (CPUs {cpulist})"


def pin_to_cpus(cpus: Sequence[int]) -> str:
    """Run on `cpus` only; where that is refused (a cpuset that excludes them), stay as bound."""
    listed = ",".join(map(str, cpus))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        return f"not pinned: pinning to CPUs {listed} failed ({e.strerror})"
    return f"pinned to CPU{'s' if len(cpus) > 1 else ''} {listed}"


def cpu_pool(node: int) -> set[int]:
    """The CPUs a stage on NUMA node `node` may run on: the node's (those this process may use), or
    every CPU this process may use where the machine has no such node."""
    allowed = os.sched_getaffinity(0)
    cpulist = node_cpulist(node)
    return allowed if cpulist is None else parse_cpulist(cpulist) & allowed or allowed


def stage_cpus(nodes: Sequence[int], threads: int, pool_of: Callable[[int], set[int]] = cpu_pool) -> list[list[int]]:
    """Per stage (given by its NUMA node), the CPUs to pin it to: stages that share a pool of CPUs (one
    node, or the whole machine where their nodes do not exist) take disjoint groups of `threads` CPUs
    of it, so that the OS never runs two stages on one core while another core idles (it did: placed
    by the scheduler, a stage's micro-batch took 1.2x its time alone); [] (the node's binding alone)
    where the pool has too few CPUs for a group each."""
    pools = [sorted(pool_of(node)) for node in nodes]
    cpus = []
    for i, pool in enumerate(pools):
        sharing = [j for j, other in enumerate(pools) if other == pool]
        k = sharing.index(i)
        cpus.append(pool[k * threads:(k + 1) * threads] if len(sharing) * threads <= len(pool) else [])
    return cpus


def gpu_binding() -> str:
    """Which GPU a cuda stage runs on, in words."""
    from ember.kernels.cuda.device import SIMULATOR

    if SIMULATOR:
        return "on numba's CUDA simulator"
    return f"on GPU {os.environ.get('CUDA_VISIBLE_DEVICES', '0')} (its only visible device, cuda:0 inside the stage)"


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


@dataclass
class Links:
    """A worker's channels: to the engine, and to the stages before and after it (None: there is none,
    or it died)."""
    control: Channel
    upstream: Channel | None
    downstream: Channel | None
    # whether it hands its micro-batches back to the engine: the last worker (with the logits rows,
    # or with hidden states for the last stage, which the engine's own process runs: engine_stage.py)
    replies: bool = False


class StageWorker:
    def __init__(self, setup: Setup) -> None:
        import numba

        from ember.daemon.loader.model_file import open_model_file
        from ember.daemon.models.transformer import Transformer

        numba.set_num_threads(min(setup.threads, numba.config.NUMBA_NUM_THREADS))
        device = DeviceName.parse(setup.device)
        backend = backend_for(device)
        backend.prepare()
        self.net = Transformer(open_model_file(setup.model), model_ops(device, setup.prompt_act),
                               range(setup.first, setup.end))
        self.max_tokens = setup.max_tokens
        cfg = self.net.config
        self.inbox = None if not setup.inbox else Boundary(Segment.attach(setup.inbox), cfg.hidden, setup.max_tokens,
                                                             setup.act_dtype)
        out = Segment.attach(setup.outbox)
        if self.net.runs_last:
            # a region of max_tokens rows per step in flight (Pipeline.lanes)
            self.logits: LogitsRows | None = LogitsRows(out, cfg.vocab, out.nbytes // (cfg.vocab * 4))
            self.outbox: Boundary | None = None
        else:
            self.logits, self.outbox = None, Boundary(out, cfg.hidden, setup.max_tokens, setup.act_dtype)
        self.caches: dict[int, PagedKVCache] = {}

    def run(self, msg: Run) -> None:
        batch = unpack_batch(msg.batch).on(self.net.ops)
        hidden = None if self.inbox is None else self.inbox.read(msg.lane, len(batch.ids))
        out = self.net.run_stage(hidden, batch, self.caches[msg.cache])
        if self.logits is not None:
            self.logits.rows(msg.lane * self.max_tokens, batch.n_logits)[:] = out
        else:
            assert self.outbox is not None
            self.outbox.write(msg.lane, out)

    def step(self, msg: Run) -> Run:
        """Run a micro-batch unless a stage before failed it; what goes on to the next stage."""
        if msg.error:
            return msg
        start = time.perf_counter()
        try:
            self.run(msg)
        except Exception as e:  # the micro-batch's failure, not the worker's
            return msgspec.structs.replace(msg, error=f"{type(e).__name__}: {e}", failed_at=len(msg.seconds))
        return msgspec.structs.replace(msg, seconds=[*msg.seconds, time.perf_counter() - start])

    def serve(self, links: Links) -> None:
        while True:
            sources = [links.control] if links.upstream is None else [links.control, links.upstream]
            ready, _, _ = select.select(sources, [], [])
            # the control channel first: the engine sends a NewCache to every stage before it submits
            # a step that uses the cache, so it is here by the time that step comes from upstream
            if links.control in ready:
                msg = links.control.recv()
                if isinstance(msg, Run):  # the first stage's micro-batches come from the engine
                    self.pass_on(self.step(msg), links)
                elif isinstance(msg, NewCache):
                    self.caches[msg.cache] = self.net.new_cache(msg.blocks, msg.block_size, msg.dtype)
                elif isinstance(msg, DropCache):
                    self.caches.pop(msg.cache, None)
                elif isinstance(msg, Stop):
                    return
                continue
            assert links.upstream is not None
            try:
                msg = links.upstream.recv()
            except ChannelClosed:  # the stage before died
                links.upstream = None
                continue
            if isinstance(msg, Run):
                self.pass_on(self.step(msg), links)

    def pass_on(self, msg: Run, links: Links) -> None:
        """To the stage after this one, or, from the last worker, the engine's reply."""
        if links.replies:
            links.control.send(Failed(msg.micro_batch, msg.error, msg.failed_at) if msg.error
                               else Done(msg.micro_batch, msg.seconds))
        elif links.downstream is not None:
            try:
                links.downstream.send(msg)
            except ChannelClosed:  # the stage after died
                links.downstream = None


def main(argv: list[str]) -> int:
    engine = os.getppid()  # the engine's process, which owns the staging segments
    channel, upstream, downstream = (Channel(socket.socket(fileno=fd), DECODER) if fd >= 0 else None for fd in map(int, argv[1:4]))
    assert channel is not None
    try:
        setup = channel.recv()
        if not isinstance(setup, Setup):
            raise ValueError(f"expected Setup first, got {type(setup).__name__}")
        if setup.device == "cpu":
            numa = bind_to_numa_node(setup.numa_node)
            if setup.cpus:
                numa += "; " + pin_to_cpus(setup.cpus)
        else:
            numa = gpu_binding()
        worker = StageWorker(setup)
    except ChannelClosed:
        return 1
    except Exception as e:
        channel.send(Failed(-1, f"{type(e).__name__}: {e}"))
        return 1
    channel.send(Ready(os.getpid(), numa))
    try:
        worker.serve(Links(channel, upstream, downstream, replies=downstream is None))
    except ChannelClosed:  # the engine's process is gone: nothing left to serve
        if _orphaned(engine):  # it died (SIGKILL) without unlinking its segments: what this stage can
            for name in (setup.inbox, setup.outbox):  # (a stopped or restarting engine kills its stages first)
                if name:
                    Segment.unlink(name)
        return 0
    return 0


def _orphaned(parent: int, wait: float = 1.0) -> bool:
    """Whether this process's parent died: it has another now. A dying process closes its files before
    its children are handed on, so the closed channel can come first: wait a little for the rest."""
    deadline = time.monotonic() + wait
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getppid() != parent


if __name__ == "__main__":
    sys.exit(main(sys.argv))
