"""A layer split across the nodes of a Ray cluster: each stage a Ray actor on a node of its own, the
hidden states between them through Ray's object store (`--devices ray:0/cpu,ray:1/cpu`).

It is what SplitRunner drives, as it drives the local Pipeline (runner/pipeline.py): new_cache,
submit, collect, revive, drop_cache, close; sampling stays the engine's own (full sampling, as on one
machine). The differences are where things run and how the hidden states travel:

- Placement: `ray:K` is the K-th bundle of a placement group made for the split, STRICT_SPREAD: one
  node each, none shared, each bundle `threads` CPUs (default: the fewest CPUs of a node of the
  cluster). A cluster with fewer nodes than the split names leaves the group pending, and the load is
  refused after READY_TIMEOUT with what it asked for.
- Transport: the engine submits a micro-batch to every stage at once, each call taking the object
  the stage before returns (an ObjectRef): Ray moves the hidden states from that stage's node to the
  next one's directly, through the object store, and the engine fetches only the last stage's
  logits. The hidden states cross in `act_dtype` (f32, or f16 / bf16 bit patterns, kernels/convert.py),
  widened back to f32 by the stage that reads them, as the local staging does.
- Pipelining: an actor runs its calls in the order they came, so with `lanes` (one per stage)
  micro-batches in flight, stage 0 runs micro-batch m + 1 while stage 1 runs m, as locally.
- Faults: a stage actor that dies fails the micro-batches in flight with KVStateLost (the engine ends
  their sequences with the reason and goes on), and Ray restarts it (max_restarts), reloading its
  layers; every runner's KV cache in every stage is then created afresh, and runners learn that
  theirs was emptied as they do locally (at their next submit, or at revive). A Python error inside a
  stage fails only its micro-batch.

What crosses: the step's metadata as msgpack bytes (stage_channel.Batch), the hidden states and
logits as numpy arrays, by Ray's own serialization inside the cluster (a trusted domain: nothing a
client sends is unpickled). Needs the `cluster` extra (Ray); the daemon's other paths never import it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.runner.split_spec import SplitSpecError, StageSpec
from ember.daemon.runner.stage_channel import Batch, pack_batch, unpack_batch
from ember.daemon.runner.stage_process import CacheSpec
from ember.daemon.runner.step_run import KVStateLost
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.convert import DEFAULT_PROMPT_ACT, decode_rows, encode_rows

log = logging.getLogger(__name__)
READY_TIMEOUT = 600.0  # seconds for the placement and every stage's load
_encode = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(Batch).decode


class RayStage:
    """The actor behind one stage: its layers' weights, one KV cache per runner, and its micro-batches."""

    def __init__(self, model_path: str, first: int, end: int, threads: int, act_dtype: str, prompt_act: str) -> None:
        import numba

        from ember.daemon.loader.model_file import open_model_file
        from ember.daemon.models.transformer import Transformer
        from ember.daemon.runner.devices import CpuBackend, DeviceName, model_ops

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        backend = CpuBackend()
        backend.prepare()
        self.net = Transformer(open_model_file(model_path), model_ops(DeviceName("cpu"), prompt_act), range(first, end))
        self.act_dtype = act_dtype
        self.caches: dict[int, Any] = {}

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def new_cache(self, cache: int, blocks: int, block_size: int, dtype: str) -> None:
        self.caches[cache] = self.net.new_cache(blocks, block_size, dtype)

    def drop_cache(self, cache: int) -> None:
        self.caches.pop(cache, None)

    def run(self, cache: int, packed: bytes, before: tuple[np.ndarray, list[float]] | None) -> tuple[np.ndarray, list[float]]:
        """This stage's layers on a micro-batch, after what the stage before returned (None: the first
        stage): hidden states (in act_dtype) out, or the last stage's logits rows (f32), with every
        stage's own seconds on it so far (one object a call: each is a message to the engine)."""
        start = time.perf_counter()
        batch = unpack_batch(_decode_batch(packed)).on(self.net.ops)
        hidden = None if before is None else decode_rows(before[0], self.act_dtype, self.net.config.hidden)
        out = self.net.run_stage(hidden, batch, self.caches[cache])
        if not self.net.runs_last:
            out = encode_rows(out, self.act_dtype)
        return out, [*(before[1] if before else []), time.perf_counter() - start]


@dataclass
class RayStageHandle:
    """A stage as the engine's process sees it (what engine_main logs of each stage)."""
    spec: StageSpec
    actor: Any
    node: str = ""
    pid: int = 0
    restarts: int = 0

    @property
    def name(self) -> str:
        return f"stage {self.spec.device} (layers {self.spec.first}-{self.spec.end - 1})"

    @property
    def binding(self) -> str:
        return f"Ray actor on node {self.node[:12]}"


@dataclass
class RayTicket:
    micro_batch: int
    cache: int
    epoch: int  # the stages' deaths seen before it was submitted
    ref: Any  # the last stage's (logits, every stage's seconds)


class RayPipeline:
    engine_stage = None  # every stage is an actor: the engine's own thread runs none

    def __init__(self, model_path: str, config: ModelConfig, stages: Sequence[StageSpec], act_dtype: str,
                 max_tokens: int, threads: int = 0, prompt_act: str = DEFAULT_PROMPT_ACT) -> None:
        """Place the stages (threads: kernel threads and CPUs per stage; 0: the fewest CPUs of a node;
        prompt_act: their prompt activations)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if config.linear is not None or config.layer_input_dim or config.kv_shared_layers:
            raise ValueError(f"{model_path}: a layer split of this architecture ({config.arch}) is not supported")
        indexes = [s.device.index or 0 for s in stages]
        if sorted(indexes) != list(range(len(stages))):
            raise SplitSpecError(f"devices {','.join(str(s.device) for s in stages)}: a split on Ray names its "
                                 f"nodes ray:0 to ray:{len(stages) - 1}, one stage each")
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        self.config, self.act_dtype, self.max_tokens = config, act_dtype, max_tokens
        self.specs = tuple(stages)
        self.lanes = len(stages)
        self.threads = threads or _fewest_node_cpus()
        self.heartbeat: Callable[[], None] = lambda: None
        self._group = placement_group([{"CPU": self.threads} for _ in stages], strategy="STRICT_SPREAD")
        self._lock = threading.RLock()
        try:
            ray.get(self._group.ready(), timeout=READY_TIMEOUT)
        except Exception as e:
            ray.util.remove_placement_group(self._group)
            raise SplitSpecError(f"devices {','.join(str(s.device) for s in stages)}: the Ray cluster has no "
                                 f"{len(stages)} nodes with {self.threads} CPU(s) free each for the split "
                                 f"({type(e).__name__}); add nodes, or give --stage-threads") from None
        actor = ray.remote(RayStage)
        self.stages = [RayStageHandle(s, actor.options(
            num_cpus=self.threads, max_restarts=-1, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=s.device.index or 0),
        ).remote(model_path, s.first, s.end, self.threads, act_dtype, prompt_act))
            for s in stages]
        try:
            self._locate(READY_TIMEOUT)
        except BaseException:
            self.close()
            raise
        self._caches: dict[int, CacheSpec] = {}  # live runners' caches
        self._next_cache = 0
        self._lost: set[int] = set()  # caches a stage's death emptied whose runner has not been told
        self._next = 0
        self._epoch = 0  # stage deaths handled so far
        self._why = ""  # the last one's reason
        self.run_seconds = [0.0] * len(stages)
        self.runs = [0] * len(stages)

    @property
    def staging_bytes(self) -> list[int]:
        """No shared-memory staging: the hidden states travel through Ray's object store."""
        return [0] * len(self.specs)

    def describe(self) -> list[str]:
        return [f"{s.name}: pid {s.pid}, {s.binding}" for s in self.stages]

    def new_cache(self, spec: CacheSpec) -> int:
        with self._lock:
            self._next_cache += 1
            self._caches[self._next_cache] = spec
            for s in self.stages:
                s.actor.new_cache.remote(self._next_cache, spec.blocks, spec.block_size, spec.dtype)
            return self._next_cache

    def drop_cache(self, cache: int) -> None:
        with self._lock:
            if self._caches.pop(cache, None) is not None:
                for s in self.stages:
                    s.actor.drop_cache.remote(cache)
            self._lost.discard(cache)

    def revive(self, cache: int) -> bool:
        """Whether `cache` was emptied by a stage's death since its runner last heard (nothing to
        restart here: Ray restarts a dead actor itself)."""
        with self._lock:
            if cache in self._lost:
                self._lost.discard(cache)
                return True
            return False

    def submit(self, batch: StepBatch, cache: int) -> RayTicket:
        if len(batch.ids) > self.max_tokens:
            raise ValueError(f"a step of {len(batch.ids)} tokens is over the split's {self.max_tokens} (max_step_tokens)")
        with self._lock:
            if cache in self._lost:
                self._lost.discard(cache)
                raise KVStateLost("a layer-split stage on Ray died and was restarted: this runner's KV cache is lost")
            packed = _encode(pack_batch(batch))
            out = None
            for s in self.stages:
                out = s.actor.run.remote(cache, packed, out)
            self._next += 1
            return RayTicket(self._next, cache, self._epoch, out)

    def collect(self, ticket: RayTicket) -> np.ndarray:
        """The logits [n_logits, vocab] f32 of a submitted micro-batch (waits for it)."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            logits, seconds = ray.get(ticket.ref)
        except RayActorError as e:
            raise KVStateLost(self._stage_died(e, ticket)) from None
        except RayTaskError as e:
            if isinstance(e.cause, RayActorError):
                raise KVStateLost(self._stage_died(e.cause, ticket)) from None
            raise RuntimeError(f"{self._stage_named(e)}: {type(e.cause).__name__}: {e.cause}") from None
        for i, t in enumerate(seconds):
            self.run_seconds[i] += t
            self.runs[i] += 1
        return np.asarray(logits)

    def close(self) -> None:
        import ray

        for s in getattr(self, "stages", []):
            ray.kill(s.actor, no_restart=True)
        ray.util.remove_placement_group(self._group)
        self.stages = []

    # --- faults ----------------------------------------------------------------------------------------
    def _stage_died(self, error: BaseException, ticket: RayTicket) -> str:
        """A stage's actor died under `ticket`: every live cache is lost, and the stages (the restarted
        one among them) get each again, empty. The first ticket to see a death handles it; the others
        in flight with it fail with the same reason; every other runner is told once, later."""
        with self._lock:
            if ticket.epoch == self._epoch:
                self._epoch += 1
                self._why = (f"{self._stage_named(error)} died ({type(error).__name__}); Ray restarted it, the "
                             "sequences it held are lost")
                self._lost = set(self._caches)
                for s in self.stages:
                    for cache, spec in self._caches.items():
                        s.actor.new_cache.remote(cache, spec.blocks, spec.block_size, spec.dtype)
                try:
                    self._locate(READY_TIMEOUT)
                except Exception as e:  # noqa: BLE001 -- the next step fails the same way and says so
                    log.error("layer-split stages on Ray did not come back: %s", e)
            self._lost.discard(ticket.cache)  # its runner is being told now
            return self._why

    def _stage_named(self, error: BaseException) -> str:
        text = str(error)
        for s in self.stages:
            if s.actor._actor_id.hex() in text:
                return s.name
        return "a layer-split stage on Ray"

    def _locate(self, timeout: float) -> None:
        """Wait for every stage to be up (loaded) and learn where it runs."""
        import ray

        deadline = time.monotonic() + timeout
        pending = {s.actor.where.remote(): s for s in self.stages}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            self.heartbeat()
            for ref in done:
                s = pending.pop(ref)
                try:
                    node, pid = ray.get(ref)
                except ray.exceptions.ActorUnavailableError:  # still restarting: the call may not have run
                    time.sleep(0.1)
                    pending[s.actor.where.remote()] = s  # ask again, until the deadline
                    continue
                s.restarts += s.pid not in (0, pid)
                s.node, s.pid = node, pid
            if pending and time.monotonic() >= deadline:
                raise TimeoutError(f"layer-split stages on Ray not up after {timeout:.0f} s: "
                                   f"{', '.join(s.name for s in pending.values())}")


def _fewest_node_cpus() -> int:
    """The fewest CPUs any alive node of the cluster has (at least 1)."""
    import ray

    counts = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return max(1, min(counts or [1]))
