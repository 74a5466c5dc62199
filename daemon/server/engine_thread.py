"""EngineThread: the engine loop that runs models — on the engine process's main thread in the daemon
(engine_main.py), or on a thread of its own in process (start()). It never awaits, and it does no
text work (daemon/server/text_worker.py does, in the front).

Commands reach it through its inbox (in process a thread-safe queue; in the engine process its
command socket: add a tokenized request, cancel, finish one that hit a stop string, drop a client,
pause a client, release logits slots, shut down). Each turn: apply every command that arrived, then
run one continuous-batching step (engine/engine_core.py) of the next model with runnable work —
every running sequence of that model advances together, prompts are read in chunks beside them —
and hand the step's progress, all requests at once, to the front. Commands are applied between
steps, so a Cancel stops a request within one step.

A sequence is held (not scheduled, keeping its KV blocks and its place) while its client is paused
(its socket backlog is full), while its client holds it (protocol Hold: the gateway's HTTP client
reads nothing of it) or, asking for logits, while its client's logits ring has no free slot
for it: nothing is ever dropped. Logits go into the ring here, where the step produced them: a
client's shared-memory ring (return_logits), or its CUDA IPC ring on the model's GPU (device_logits,
protocol/device_ring.py), made by new_ring inside the model's device scope.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ember.daemon.engine.engine_core import EngineCore, StepOutput
from ember.daemon.heap import release_free_heap
from ember.daemon.engine.sequence import Status
from ember.daemon.engine.sequence import Sequence
from ember.daemon.logging_setup import get_logger
from ember.daemon.speculative.spec_stats import SpecStats
from ember.kernels.sampling import Choice
from ember.protocol.limits import LimitExceeded
from ember.protocol.device_ring import DeviceRing
from ember.protocol.messages import DeviceSlot, ErrorCode, FinishReason, ShmSlot
from ember.protocol.shm_ring import ShmRing

Ring = ShmRing | DeviceRing

Command = Callable[[], None]

_IDLE_WAKE = 1.0  # seconds an idle engine sleeps between watchdog pings when systemd sets none
# seconds the engine stays idle before it trims the heap (~3 ms of malloc_trim): not at once, when the
# front is delivering the spell's last tokens and a client's next request may be on its way
_TRIM_AFTER = 0.05
_RATE_WINDOW = 10.0  # seconds of recent steps behind EngineStats.tokens_per_s


class EngineRequest(Protocol):
    """What the engine loop knows of a request: the front's Request (daemon/server/request.py) in
    process, the engine process's own record of it (engine_main.py) there."""
    client: bytes
    model_name: str
    return_logits: bool  # each token's logits through the client's ring
    device_logits: bool  # ... its CUDA IPC ring (else its shared-memory one)
    max_tokens: int
    log: Any
    user: int  # the client's Unix user (-1: unknown)

    @property
    def seq(self) -> Sequence | None: ...

    @property
    def key(self) -> tuple[bytes, int]: ...


class Inbox(Protocol):
    """Where commands wait for the engine loop: a thread-safe queue in process; in the engine process,
    its command socket (engine_main.py)."""

    def put(self, command: Command) -> None: ...

    def get(self, timeout: float) -> Command: ...  # queue.Empty after `timeout` seconds without one

    def get_nowait(self) -> Command: ...  # queue.Empty when none is waiting


@dataclass(frozen=True, slots=True)
class Progress:
    """What happened to one request: new tokens, and its end if it ended (reason, or an error code)."""
    request: Any  # an EngineRequest; the front's Request once the news reaches the text worker
    tokens: list[int] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    logits: tuple[ShmSlot, ...] | None = None
    finish: str | None = None  # a FinishReason, once it ended
    error: str | None = None  # an ErrorCode: refused before it ran (the client gets an Error, not Finished)
    message: str = ""
    device_logits: tuple[DeviceSlot, ...] | None = None  # logits in the client's CUDA IPC ring


@dataclass(frozen=True)
class ExpertTotals:
    """The MoE models' expert counters, summed (zeros without one)."""
    hot_experts: int = 0
    total_experts: int = 0
    cold_share: float = 0.0  # of (token, expert) slots routed, the share computed cold
    swaps: int = 0
    worker_restarts: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for the Stats reply, replaced whole after each step (the I/O loop only reads it)."""
    running: int = 0  # sequences being generated (prompt or tokens)
    waiting: int = 0  # accepted, waiting for KV blocks or a running slot
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_hit_rate: float = 0.0  # of full prompt blocks looked up, the share found cached
    prefix_hits: int = 0  # those found
    held: int = 0  # requests held because their clients take no output now (paused, Hold, a full ring)
    preemptions: int = 0
    tokens_per_s: float = 0.0  # generated tokens over the last _RATE_WINDOW seconds
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding, all models together
    experts: ExpertTotals = field(default_factory=ExpertTotals)  # MoE models, all together


class EngineThread:
    def __init__(self, *, cores: Mapping[str, EngineCore], progress: Callable[[list[Progress]], None],
                 on_stopped: Callable[[], None], new_ring: Callable[[int, bool], Ring],
                 heartbeat: Callable[[], None] = lambda: None, heartbeat_interval: float | None = None,
                 setup: Callable[[], None] = lambda: None, stall_timeout: float = 300.0,
                 inbox: Inbox | None = None, on_idle: Callable[[], None] = lambda: None) -> None:
        """setup: run first on the engine thread (its kernel threads, say). stall_timeout: seconds a
        request may stay held because its client does not read before it ends with an error. inbox:
        where commands come from (default: a queue the methods below fill, from any thread). on_idle:
        run before the loop waits for a command with nothing to step. new_ring(user, device): a client's
        logits ring, in shared memory or (device) on the GPU whose device scope it is called in."""
        self._cores = dict(cores)  # model name -> its engine core
        self._order = deque(self._cores)  # round robin over models with work
        self._progress = progress
        self._on_stopped = on_stopped
        self._setup = setup
        self._new_ring = new_ring
        self._heartbeat = heartbeat
        self._on_idle = on_idle
        self._idle_wake = heartbeat_interval / 2 if heartbeat_interval else _IDLE_WAKE
        self._inbox: Inbox = inbox if inbox is not None else queue.SimpleQueue()
        self._live: dict[int, EngineRequest] = {}  # seq_id -> request, for every request with a sequence
        self._paused: set[bytes] = set()
        self._held: set[tuple[bytes, int]] = set()  # requests their clients hold (protocol Hold)
        self._holding = False  # some sequence is held now
        self._held_since: dict[int, float] = {}  # seq_id -> when it became held
        self._stall_timeout = stall_timeout
        self._rings: dict[tuple[bytes, bool], Ring] = {}  # (client, on the device) -> its logits ring
        self._device_ring_model: dict[bytes, str] = {}  # client -> the model its device ring serves
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) of recent steps
        self._recent_tokens = 0  # their tokens, less the oldest step's (the rate counts from its time on)
        self._deadline: float | None = None  # set by shutdown(): cancel what is left at this time
        self._thread = threading.Thread(target=self.run, name="ember-engine", daemon=True)
        self.log = get_logger()
        self.stats = EngineStats()
        self.crashed = False  # the loop ended on an internal error

    # --- commands (any thread) -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add(self, request: EngineRequest) -> None:
        """A request whose prompt is tokenized and checked (request.seq is set): schedule it."""
        self._inbox.put(lambda: self._add(request))

    def cancel(self, client: bytes, request_id: int) -> None:
        self._inbox.put(lambda: self._end(lambda r: r.key == (client, request_id)))

    def finish(self, request: EngineRequest, reason: str) -> None:
        """The text worker saw the request end (a stop string): free its sequence, report nothing."""
        assert request.seq is not None
        self.finish_sequence(request.seq.seq_id, reason)

    def finish_sequence(self, seq_id: int, reason: str) -> None:
        """finish(), by the request's sequence id."""
        self._inbox.put(lambda: self._abort_id(seq_id, reason))

    def drop_client(self, client: bytes) -> None:
        """The client is gone: cancel its requests and free its ring."""
        self._inbox.put(lambda: self._drop_client(client))

    def set_paused(self, client: bytes, paused: bool) -> None:
        self._inbox.put(lambda: (self._paused.add if paused else self._paused.discard)(client))

    def hold(self, client: bytes, request_id: int, held: bool) -> None:
        """The client cannot take (held) or can take again one request's output (protocol Hold)."""
        self._inbox.put(lambda: (self._held.add if held else self._held.discard)((client, request_id)))

    def release(self, client: bytes, slots: Iterable[int], device: bool = False) -> None:
        slots = list(slots)
        self._inbox.put(lambda: self._release(client, slots, device))

    def shutdown(self, drain_timeout: float) -> None:
        """Stop after in-flight requests finish; whatever still runs after `drain_timeout` is cancelled."""
        deadline = time.monotonic() + drain_timeout
        self._inbox.put(lambda: setattr(self, "_deadline", deadline))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # --- the loop (engine thread) ------------------------------------------------------------------
    def run(self) -> None:
        """The loop, on the calling thread (start() runs it on a thread of its own)."""
        try:
            self._setup()
            trim_at: float | None = None  # when to give a busy spell's prompt buffers back to the system
            while True:
                self._apply(block=False)
                if self._deadline is not None:
                    if time.monotonic() >= self._deadline:
                        self._end(lambda r: True)
                    if not self._live:
                        break
                if self._step_next_model():
                    trim_at = -1.0  # due once the engine has been idle for _TRIM_AFTER
                else:
                    now = time.monotonic()
                    if trim_at == -1.0:
                        trim_at = now + _TRIM_AFTER
                    elif trim_at is not None and now >= trim_at:
                        release_free_heap()
                        trim_at = None
                    self._on_idle()
                    self._apply(block=True, until=trim_at)
                self._heartbeat()
        except Exception:  # a bug in the engine itself: say so loudly, then stop (systemd restarts us)
            self.log.exception("engine loop failed")
            self.crashed = True
        finally:
            for ring in self._rings.values():
                ring.close()
            self._rings.clear()
            self._on_stopped()

    def _apply(self, block: bool, until: float | None = None) -> None:
        """Run queued commands; when `block`, first wait for one (bounded, to keep petting the watchdog,
        and by `until`, a monotonic time)."""
        if block:
            timeout = self._idle_wake
            for end in (self._deadline, until):
                if end is not None:
                    timeout = max(0.0, min(timeout, end - time.monotonic()))
            try:
                self._inbox.get(timeout=timeout)()
            except queue.Empty:
                return
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _step_next_model(self) -> bool:
        """One batched step of the next model that has runnable work; False if none had any."""
        self._mark_held()
        for _ in range(len(self._order)):
            name = self._order[0]
            self._order.rotate(-1)
            core = self._cores[name]
            if not core.has_work:
                continue
            try:
                result = core.step()
            except Exception as e:  # the model failed mid-step: its requests end, the daemon goes on
                self.log.exception("step failed", model=name)
                self._end(lambda r: r.model_name == name, FinishReason.ERROR, f"{type(e).__name__}: {e}")
                return True
            if result.tokens == 0:
                continue  # everything it has is held
            for seq in result.started:
                r = self._live[seq.seq_id]
                r.log.info("request started", prompt_tokens=len(seq.prompt), max_tokens=r.max_tokens)
            news = [self._news(out) for out in result.outputs]
            for seq, why in result.failed:  # its own error: the rest of the batch went on without it
                r = self._live.pop(seq.seq_id)
                r.log.warning("request failed", error=why)
                news.append(Progress(r, finish=FinishReason.ERROR, message=why))
            self._account(sum(len(o.new_tokens) for o in result.outputs))  # first: the news may carry the stats
            self._progress(news)
            return True
        self._account(0)
        return False

    def _news(self, out: StepOutput) -> Progress:
        r = self._live[out.seq.seq_id]
        if out.finished:
            del self._live[out.seq.seq_id]
        logits = device_logits = None
        if out.logits is not None:
            ring = self._rings[(r.client, r.device_logits)]
            slot = ring.acquire()
            assert slot is not None  # _mark_held ran it only with a free slot
            if r.device_logits:
                with self._cores[r.model_name].runner.device_scope():
                    device_logits = (ring.write(slot, out.logits),)
            else:
                logits = (ring.write(slot, out.logits),)
        choices = out.seq.choices[len(out.seq.choices) - len(out.new_tokens):]
        return Progress(r, out.new_tokens, choices, logits, out.seq.finish_reason if out.finished else None,
                        device_logits=device_logits)

    def _mark_held(self) -> None:
        """Hold the sequences whose clients cannot take a frame now: paused clients, requests their
        clients hold, and logits requests beyond the free slots of their client's ring (a step fills
        one slot per sequence)."""
        if not (self._paused or self._held or self._rings or self._holding):
            return  # nobody can be held: skip the scan of every live request
        free = {key: ring.free_slots for key, ring in self._rings.items()}
        now, stalled = time.monotonic(), []
        self._holding = False
        for r in self._live.values():
            assert r.seq is not None
            held = r.client in self._paused or r.key in self._held
            if r.return_logits and not held:
                key = (r.client, r.device_logits)
                held = free[key] == 0
                free[key] -= not held
            r.seq.held = held
            self._holding |= held
            if not held:
                self._held_since.pop(r.seq.seq_id, None)
            elif now - self._held_since.setdefault(r.seq.seq_id, now) > self._stall_timeout:
                stalled.append(r)
        if self._held:  # the holds of requests that ended go with them
            self._held &= {r.key for r in self._live.values()}
        if stalled:  # their frames wait in their clients' backlogs; the Finished joins them
            self._end(lambda r: r in stalled, FinishReason.ERROR,
                      f"the client read nothing of this stream for {self._stall_timeout:g} s")

    # --- request lifecycle (engine thread) --------------------------------------------------------
    def _add(self, r: EngineRequest) -> None:
        assert r.seq is not None
        if r.return_logits:
            try:
                self._ring(r)
            except LimitExceeded as e:  # new_ring refuses rings beyond the daemon's shared-memory bounds
                self._progress([Progress(r, error=ErrorCode.LIMIT, message=str(e))])
                return
            except ValueError as e:  # device logits where they cannot be (the reason)
                self._progress([Progress(r, error=ErrorCode.BAD_REQUEST, message=str(e))])
                return
            except (OSError, RuntimeError) as e:  # no shared (or device) memory left; no CuPy; a CUDA error
                self._progress([Progress(r, error=ErrorCode.INTERNAL, message=f"cannot create the logits ring: {e}")])
                return
        try:
            self._cores[r.model_name].add(r.seq)
        except ValueError as e:  # its grammar: llguidance refused it with the model's vocabulary
            self._progress([Progress(r, error=ErrorCode.BAD_REQUEST, message=str(e))])
            return
        self._live[r.seq.seq_id] = r

    def _abort_id(self, seq_id: int, reason: str) -> None:
        r = self._live.get(seq_id)
        if r is not None:
            self._abort(r, reason)

    def _abort(self, r: EngineRequest, reason: str) -> None:
        """End a request's sequence (waiting or running) and free its KV blocks."""
        seq = r.seq
        if seq is not None:
            self._held_since.pop(seq.seq_id, None)
        if seq is not None and self._live.pop(seq.seq_id, None) is not None and seq.status != Status.FINISHED:
            self._cores[r.model_name].abort(seq, reason)

    def _end(self, which: Callable[[EngineRequest], bool], reason: str = FinishReason.CANCELLED, message: str = "") -> None:
        ended = [r for r in self._live.values() if which(r)]
        for r in ended:
            self._abort(r, reason)
        if ended:
            self._progress([Progress(r, finish=reason, message=message) for r in ended])

    def _drop_client(self, client: bytes) -> None:
        self._end(lambda r: r.client == client)
        self._paused.discard(client)
        self._held = {key for key in self._held if key[0] != client}
        self._device_ring_model.pop(client, None)
        for device in (False, True):
            ring = self._rings.pop((client, device), None)
            if ring is not None:
                ring.close()

    def _release(self, client: bytes, slots: list[int], device: bool = False) -> None:
        ring = self._rings.get((client, device))
        if ring is not None:
            for slot in slots:
                ring.release(slot)

    def _ring(self, r: EngineRequest) -> Ring:
        """The logits ring of r's client for r (made on its first logits request, within its user's
        share): in shared memory, or on r's model's GPU for device logits. ValueError when r cannot
        have device logits (its model's logits are not on a GPU; the client's device ring serves
        another model)."""
        key = (r.client, r.device_logits)
        if r.device_logits:
            runner = self._cores[r.model_name].runner
            if not runner.logits_on_device:
                raise ValueError(f"device_logits needs a model whose logits are on a GPU; {r.model_name!r} computes "
                                 "them on the host (return_logits shares them through shared memory)")
            serving = self._device_ring_model.setdefault(r.client, r.model_name)
            if serving != r.model_name:
                raise ValueError(f"this connection's device logits ring serves model {serving!r}: device logits "
                                 f"of {r.model_name!r} need a connection of their own")
            if key not in self._rings:
                try:
                    with runner.device_scope():
                        self._rings[key] = self._new_ring(r.user, True)
                except BaseException:
                    del self._device_ring_model[r.client]
                    raise
        elif key not in self._rings:
            self._rings[key] = self._new_ring(r.user, False)
        return self._rings[key]

    def _account(self, generated: int) -> None:
        """Refresh the stats snapshot after a step that generated `generated` tokens."""
        now = time.monotonic()
        if generated:
            self._recent_tokens += generated if self._recent else 0
            self._recent.append((now, generated))
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW:
            self._recent.popleft()
            self._recent_tokens -= self._recent[0][1] if self._recent else self._recent_tokens
        parts = [c.stats() for c in self._cores.values()]
        queries = sum(p.prefix_queries for p in parts)
        span = now - self._recent[0][0] if len(self._recent) > 1 else 0.0
        self.stats = EngineStats(
            running=sum(p.running for p in parts), waiting=sum(p.waiting for p in parts),
            kv_blocks_used=sum(p.kv_blocks_used for p in parts), kv_blocks_free=sum(p.kv_blocks_free for p in parts),
            prefix_hit_rate=sum(p.prefix_hits for p in parts) / queries if queries else 0.0,
            prefix_hits=sum(p.prefix_hits for p in parts),
            held=sum(r.seq is not None and r.seq.held for r in self._live.values()) if self._holding else 0,
            preemptions=sum(p.preemptions for p in parts),
            tokens_per_s=self._recent_tokens / span if span > 0 else 0.0,
            spec=_spec_of(parts),
        )


def _spec_of(parts: list[Any]) -> SpecStats:
    """The models' speculative decoding together: counts summed; the per-token costs those of the
    model that measured them (the first, where several did)."""
    measured = next((p.spec for p in parts if p.spec.spec_s_per_token and p.spec.plain_s_per_token), SpecStats())
    return SpecStats(sum(p.spec.proposed for p in parts), sum(p.spec.accepted for p in parts),
                     sum(p.spec.steps for p in parts), sum(p.spec.plain_tokens for p in parts),
                     measured.spec_s_per_token, measured.plain_s_per_token)
