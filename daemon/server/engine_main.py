"""The engine process: `python -m ember.daemon.server.engine_main FD`, started by the daemon's front
(engine_host.py), which writes its EngineLaunch to its standard input; FD is its end of the
socketpair they talk over (ember.daemon.channel).

It loads and warms the models, then runs the engine loop (engine_thread.py) on its main thread: no
other Python thread shares its GIL. Commands come in on the channel and are read between steps; each
step's news, the stats, heartbeats and its end go out on it. Logits rows go straight into
the clients' shared-memory rings, made here. Cold-expert workers and layer-split stages are this
process's children. It ignores SIGINT and SIGTERM (the front drains it with a Shutdown message) and
dies with the front (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from ember.daemon.channel import Channel, ChannelClosed
from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.logging_setup import configure_logging, get_logger
from ember.daemon.runner.devices import backend_for
from ember.daemon.runtime import Model, load
from ember.daemon.server.engine_thread import Command, EngineStats, EngineThread, ExpertTotals, Progress
from ember.daemon.server.engine_wire import (AddSequence, CancelRequest, DropClient, EngineCommand, EngineLaunch,
                                             FinishSequence, Heartbeat, HoldRequest, PauseClient, Ready, ReleaseSlots, SeqProgress,
                                             Shutdown, StartFailed, StartStatus, StatsUpdate, StepNews, Stopped,
                                             command_decoder)
from ember.daemon.server.ring_budget import RingBudget
from ember.protocol.device_ring import CupyIpc, DeviceRing
from ember.protocol.shm_ring import ShmRing

_STATS_EVERY = 0.1  # seconds between stats reports while steps run (and one when the engine goes idle)
_PR_SET_PDEATHSIG = 1


@dataclass(eq=False)
class Admitted:
    """The engine process's record of a request (engine_thread.EngineRequest)."""
    client: bytes
    id: int
    model_name: str
    return_logits: bool
    device_logits: bool
    max_tokens: int
    seq: Sequence
    log: Any = field(repr=False)
    user: int = -1  # the client's Unix user (its logits ring counts toward that user's share)

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.client, self.id)


class Reports:
    """The engine's side of its report socket: every message the front reads."""

    def __init__(self, channel: Channel, heartbeat_interval: float | None, news_every: float) -> None:
        """news_every: seconds a step's news may wait for the next steps' (engine.decode_burst_ms: a
        decode burst's tokens wait as long)."""
        self._channel = channel
        self._news_every = news_every
        self._beat_every = heartbeat_interval / 4 if heartbeat_interval else None
        self._last_beat = 0.0
        self._last_stats = 0.0
        self._sent_stats: object = None
        self._counts: tuple[int, ...] = ()
        self._news: list[SeqProgress] = []  # steps' news not sent yet
        self._last_news = 0.0
        self.engine: EngineThread | None = None
        self.models: dict[str, Model] = {}

    def send(self, message: Any) -> None:
        try:
            self._channel.send(message)
        except ChannelClosed:  # the front is gone: the inbox sees it too, and the loop ends
            pass

    def status(self, text: str) -> None:
        self.send(StartStatus(text))

    def progress(self, news: list[Progress]) -> None:
        """A step's news. It goes out with the next steps' for up to news_every (as a decode burst's
        tokens do: every message wakes the front, whose threads then take the kernels' cores), at
        once when it starts or ends a request."""
        self._news += (_wire_progress(p) for p in news)
        if any(p.finish is not None or p.error is not None or _first(p) for p in news):
            self.flush()

    def end(self, seq_id: int, reason: str) -> None:
        """The front ended the sequence: its end goes out after any news of it."""
        self._news.append(SeqProgress(seq_id, finish=reason))
        self.flush()

    def flush(self) -> None:
        """The news so far, with the stats when they are due: one message, one wake-up of the front."""
        if self._news:
            self._last_news = time.monotonic()
            self.send(StepNews(self._news, self._due_stats()))
            self._news = []

    def heartbeat(self) -> None:
        """After every turn of the loop: news that waited long enough, stats that are due and went out
        with no news, and a heartbeat now and then."""
        now = time.monotonic()
        if self._news and now - self._last_news >= self._news_every:
            self.flush()
        if (stats := self._due_stats()) is not None:
            self.send(StatsUpdate(stats))
        self.beat()

    def beat(self) -> None:
        """A heartbeat, if one is due: the front pets systemd's watchdog on it."""
        now = time.monotonic()
        if self._beat_every is not None and now - self._last_beat >= self._beat_every:
            self._last_beat = now
            self.send(Heartbeat())

    def idle(self) -> None:
        """The engine has nothing to step: what waited goes out, and the stats if they changed."""
        self.flush()
        if (stats := self._due_stats(force=True)) is not None:
            self.send(StatsUpdate(stats))

    def _due_stats(self, force: bool = False) -> EngineStats | None:
        """The stats to send now, if any: changed, and either what a client must see at once
        (_counts) changed or _STATS_EVERY passed."""
        assert self.engine is not None
        stats, now = self.engine.stats, time.monotonic()
        if stats is self._sent_stats:
            return None
        if not force and now - self._last_stats < _STATS_EVERY and _counts(stats) == self._counts:
            return None
        self._sent_stats, self._counts, self._last_stats = stats, _counts(stats), now
        return replace(stats, experts=_expert_totals(self.models))

    def stopped(self) -> None:
        assert self.engine is not None
        self.flush()
        self.send(Stopped(self.engine.crashed))


class CommandInbox:
    """The engine loop's inbox (engine_thread.Inbox) in this process: the front's commands from the
    channel, each turned into a call of the engine's own command methods, whose work then waits
    here, in order, for the loop to run it. A closed channel (the front died) is a shutdown now."""

    def __init__(self, channel: Channel, reports: Reports) -> None:
        self._channel = channel
        self._reports = reports
        self._local: deque[Command] = deque()
        self.engine: EngineThread | None = None

    def put(self, command: Command) -> None:
        self._local.append(command)

    def get_nowait(self) -> Command:
        if self._local:
            return self._local.popleft()
        if not self._channel.readable():
            raise queue.Empty
        try:
            message = self._channel.recv()
        except ChannelClosed:
            return lambda: self._dispatch(Shutdown(0.0))
        return lambda: self._dispatch(message)

    def get(self, timeout: float) -> Command:
        if not self._local and not self._channel.readable(timeout):
            raise queue.Empty
        return self.get_nowait()

    def _dispatch(self, m: EngineCommand) -> None:
        engine = self.engine
        assert engine is not None
        if isinstance(m, AddSequence):
            seq = Sequence(m.prompt, m.max_tokens, m.params, m.seed, frozenset(m.stop_ids), client=m.client,
                           seq_id=m.seq_id, wants_logits=m.wants_logits, wants_logprob=m.wants_logprob,
                           grammar=m.grammar, cache_salt=m.cache_salt, device_logits=m.device_logits)
            log = get_logger(req=f"{m.client.hex()}:{m.request_id}", model=m.model)
            engine.add(Admitted(m.client, m.request_id, m.model, m.wants_logits, m.device_logits, m.max_tokens, seq,
                                log, m.user))
        elif isinstance(m, CancelRequest):
            engine.cancel(m.client, m.request_id)
        elif isinstance(m, FinishSequence):  # its end, after any news of it sent before: the front forgets it
            engine.finish_sequence(m.seq_id, m.reason)
            self._reports.end(m.seq_id, m.reason)
        elif isinstance(m, DropClient):
            engine.drop_client(m.client)
        elif isinstance(m, PauseClient):
            engine.set_paused(m.client, m.paused)
        elif isinstance(m, HoldRequest):
            engine.hold(m.client, m.request_id, m.held)
        elif isinstance(m, ReleaseSlots):
            engine.release(m.client, m.slots, m.device)
        elif isinstance(m, Shutdown):
            engine.shutdown(m.drain_timeout)


def _counts(stats: Any) -> tuple[int, ...]:
    """What a client reading the stats must see at once: the rate alone may wait _STATS_EVERY."""
    return (stats.running, stats.waiting, stats.kv_blocks_used, stats.preemptions)


def _first(p: Progress) -> bool:
    """The request's first tokens (its time to first token waits for no other step)."""
    return bool(p.tokens) and len(p.request.seq.generated) == len(p.tokens)


def _wire_progress(p: Progress) -> SeqProgress:
    seq = p.request.seq
    return SeqProgress(seq.seq_id, p.tokens, p.choices, p.logits, p.finish, p.error, p.message, seq.started,
                       p.device_logits)


def _expert_totals(models: dict[str, Model]) -> ExpertTotals:
    stats = [s for m in models.values() if (s := m.expert_stats()) is not None]
    if not stats:
        return ExpertTotals()
    routed = sum(s.routed_slots for s in stats)
    return ExpertTotals(hot_experts=sum(s.hot_experts for s in stats), total_experts=sum(s.total_experts for s in stats),
                        cold_share=round(sum(s.cold_slots for s in stats) / routed, 4) if routed else 0.0,
                        swaps=sum(s.swaps for s in stats), worker_restarts=sum(s.worker_restarts for s in stats))


def load_models(launch: EngineLaunch, reports: Reports) -> dict[str, Model]:
    """Every model of the configuration, loaded and (engine.warmup) warmed up; the reports say how far
    it got."""
    status = reports.status
    config, log = launch.config, get_logger()
    e = config.engine
    models: dict[str, Model] = {}
    for i, spec in enumerate(config.models, 1):
        name = spec.display_name
        status(f"loading {name} ({i}/{len(config.models)})")
        t0 = time.perf_counter()
        model = load(spec.path, device=e.device, kv_dtype=launch.kv_dtype, decode_act=e.decode_act,
                     prompt_act=e.prompt_act or None,
                     cuda_kernels=e.cuda_kernels,
                     devices=e.devices or None, split=e.split or None, act_dtype=launch.act_dtype,
                     max_step_tokens=e.max_step_tokens, stage_threads=e.stage_threads, shm_owner=launch.shm_owner,
                     draft=spec.draft or None, draft_tokens=spec.draft_tokens,
                     feature_dtype=launch.feature_dtypes[name], env=_cache_env(launch),
                     on_layer=_loading(reports, name), **spec.experts)
        model.adaptive_draft = spec.adaptive_draft
        models[name] = model
        if model.pipeline is not None:
            model.pipeline.heartbeat = reports.beat  # while its stages restart, on the engine's thread
        _log_stages(name, model)
        if e.warmup:
            status(f"warming up {name}")
            # a short prompt, a few sampled tokens and a greedy burst: every kernel a request uses is
            # loaded, so the first client does not pay for it and READY means ready
            list(model.generate(list(range(1, 9)), max_tokens=3, temperature=0.5, top_k=5, seed=0, ignore_eos=True))
            list(model.generate(list(range(1, 9)), max_tokens=4, ignore_eos=True))
        log.info("model ready", model=name, path=spec.path, seconds=round(time.perf_counter() - t0, 2))
    return models


def _cache_env(launch: EngineLaunch) -> dict[str, str]:
    """The one variable load() would read for the engine: the cache directory the front resolved
    (the precision came resolved too, as arguments)."""
    return {"EMBER_CACHE_DIR": launch.cache_dir} if launch.cache_dir else {}


def _loading(reports: Reports, name: str) -> Callable[[int, int], None]:
    """A model's load as it goes: the status line per layer placed (`ember status`, systemd), a log line
    at most every 5 s (a big model's upload to a GPU)."""
    last = time.monotonic()

    def on_layer(done: int, total: int) -> None:
        nonlocal last
        reports.status(f"loading {name}: {done} of {total} layers")
        if time.monotonic() - last >= 5.0:
            last = time.monotonic()
            get_logger().info("loading", model=name, layers_done=done, layers=total)

    return on_layer


def _compiling(reports: Reports, done: int, total: int) -> None:
    """The first start's compile, as it goes: a status line (`ember status`, systemd) and a log line per part."""
    reports.status(f"compiling the CPU kernels: {done} of {total} parts (first start; later starts load them)")
    if done == 0:
        get_logger().info("compiling the CPU kernels in child processes (first start after an install or upgrade)",
                          parts=total)
    else:
        get_logger().info("compiled CPU kernels", parts_done=done, parts=total)


def _log_stages(name: str, model: Model) -> None:
    if model.pipeline is None:
        return
    log = get_logger()
    for stage in model.pipeline.stages:
        log.info("layer-split stage ready", model=name, stage=stage.name, pid=stage.pid, binding=stage.binding,
                 act_dtype=model.pipeline.act_dtype)
    if model.pipeline.engine_stage is not None:
        log.info("layer-split stage ready", model=name, stage=model.pipeline.engine_stage.name, pid=os.getpid(),
                 binding="the engine's own thread", act_dtype=model.pipeline.act_dtype)


def engine_cores(launch: EngineLaunch, models: dict[str, Model]) -> dict[str, EngineCore]:
    """Each model's engine core over the KV pool the plan counted: max_active sequences of ctx tokens."""
    e = launch.config.engine
    cores = {}
    for name, model in models.items():
        context = e.context_for(model.config.context_length)
        cores[name] = model.engine(e.max_active * -(-context // KV_BLOCK) * KV_BLOCK, max_running=e.max_active,
                                   max_context=context, prefix_caching=e.prefix_caching,
                                   max_step_tokens=e.max_step_tokens, decode_burst=e.decode_burst_ms / 1000)
    return cores


def ring_maker(launch: EngineLaunch, vocab: int) -> Any:
    """new_ring for the engine loop: a client's logits ring, within server.max_logits_bytes in all and
    server.max_logits_bytes_per_user for its user's."""
    server = launch.config.server
    ring_bytes = ShmRing.bytes_for(server.logits_slots, vocab * 4)
    budget = RingBudget(server.max_logits_bytes, server.logits_bytes_per_user)
    if ring_bytes > budget.limit:
        get_logger().warning("one logits ring is bigger than server.max_logits_bytes: every return_logits request "
                             "will be refused with Error{limit}; raise the bound or lower server.logits_slots",
                             ring_bytes=ring_bytes, max_logits_bytes=budget.limit)

    def new_ring(user: int, device: bool) -> ShmRing | DeviceRing:
        """device: a CUDA IPC ring on the current device (engine_thread calls it in the model's device
        scope); the same bounds count it, GPU memory being no less finite."""
        budget.take(ring_bytes, user)
        try:
            if device:
                return DeviceRing(CupyIpc(), server.logits_slots, vocab * 4, on_close=lambda: budget.give(ring_bytes, user))
            return ShmRing.create(server.logits_slots, vocab * 4, mode=launch.ring_mode, group=launch.ring_group,
                                  owner=launch.shm_owner, on_close=lambda: budget.give(ring_bytes, user))
        except BaseException:
            budget.give(ring_bytes, user)
            raise

    return new_ring


def _die_with_parent() -> None:
    """SIGKILL when the front process dies, however it dies (its children's channels then close too)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the front's sockets closing still ends serving
        pass
    if os.getppid() == 1:  # the front died before the prctl took effect
        os._exit(1)


def serve_engine(launch: EngineLaunch, channel: Channel) -> int:
    config = launch.config
    configure_logging(config.server.log_format, config.server.log_level)
    log = get_logger(process="engine")
    reports = Reports(channel, launch.heartbeat_interval, config.engine.decode_burst_ms / 1000)
    models: dict[str, Model] = {}
    try:
        try:
            e = config.engine
            backend = backend_for(e.device)
            backend.prepare(on_compile=lambda done, total: _compiling(reports, done, total),
                            on_background=lambda line: log.info(line))
            models = load_models(launch, reports)
        except ModelFileError as err:
            reports.send(StartFailed(str(err), err.path, err.reason))
            return 1
        except (OSError, ValueError) as err:  # a bad option or file: one line says it
            reports.send(StartFailed(str(err)))
            return 1
        except Exception as err:  # a bug, or a worker that would not start: the log has the traceback
            log.exception("loading the models failed")
            reports.send(StartFailed(f"loading the models failed: {type(err).__name__}: {err}"))
            return 1
        cores = engine_cores(launch, models)
        inbox = CommandInbox(channel, reports)
        engine = EngineThread(cores=cores, progress=reports.progress, on_stopped=reports.stopped,
                              new_ring=ring_maker(launch, max(m.config.vocab for m in models.values())),
                              heartbeat=reports.heartbeat, heartbeat_interval=launch.heartbeat_interval,
                              setup=lambda: backend.use_threads(e.threads), stall_timeout=config.server.stall_timeout,
                              inbox=inbox, on_idle=reports.idle)
        inbox.engine = reports.engine = engine
        reports.models = models
        reports.send(Ready(os.getpid()))
        log.info("engine ready", pid=os.getpid())
        engine.run()
        return 1 if engine.crashed else 0
    finally:
        for model in models.values():  # stage and cold-expert workers; MoE routing statistics saved
            model.close()
        channel.close()


def main() -> int:
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the front decides when serving ends
        signal.signal(sig, signal.SIG_IGN)
    launch = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineLaunch)
    return serve_engine(launch, Channel(socket.socket(fileno=int(sys.argv[1])), command_decoder))


if __name__ == "__main__":
    sys.exit(main())
