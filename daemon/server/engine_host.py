"""EngineHost: the front process's handle on the engine process (engine_main.py) — starting it,
sending it commands, reading its reports, and starting it again when it dies.

It has the engine loop's interface (add, cancel, finish, drop_client, set_paused, release, shutdown,
stats), so the text worker drives it as it would drive the loop in process. They talk over a Unix
socketpair (ember.daemon.channel): commands may come from any thread (a lock keeps them whole, one
at a time); the reports are read by a thread of its own, which turns each step's news back into
Progress for the front's own Request objects.

An engine that dies (killed, out of memory, a crash) is seen at once, its end of the socketpair
closing: every request it held ends
with Finished{error} saying so, its logits segments are unlinked, and a new engine is started while
the daemon keeps its socket; requests admitted meanwhile wait for it. An engine that cannot start
again after a few tries ends serving (`crashed`: the daemon exits 1, systemd restarts it).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from ember.daemon.channel import Channel, ChannelClosed

from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.logging_setup import get_logger
from ember.daemon.server.engine_thread import EngineStats, Progress
from ember.daemon.server.engine_wire import (AddSequence, CancelRequest, DropClient, EngineLaunch, EngineReport,
                                             FinishSequence, Heartbeat, HoldRequest, PauseClient, Ready, ReleaseSlots, Shutdown,
                                             StartFailed, StartStatus, StatsUpdate, StepNews, Stopped, report_decoder)
from ember.daemon.server.notify import Notifier
from ember.protocol.messages import FinishReason
from ember.protocol.shm_ring import remove_dead_segments

if TYPE_CHECKING:
    from ember.daemon.server.request import Request

START_TIMEOUT = 1800.0  # seconds an engine may take to compile its kernels, load and warm up its models
RESTART_TRIES = 3  # engines in a row that may fail to start after a death before serving ends
_TICK = 0.05  # seconds between looks at a starting engine (and pets of the watchdog)
_STOP_TIMEOUT = 10.0  # seconds a stopping engine gets to exit before it is killed


class EngineStartFailed(RuntimeError):
    """The engine process could not load the models (the message says why) or did not start."""


class EngineHost:
    def __init__(self, launch: EngineLaunch, notifier: Notifier, start_timeout: float = START_TIMEOUT) -> None:
        """launch: what every engine is started with."""
        self._launch = launch
        self._notifier = notifier
        self._start_timeout = start_timeout
        self._lock = threading.Lock()  # _channel, _live, _pending and _paused: held briefly, never to send
        # one sender at a time, so frames stay whole; nobody holding _lock waits for it, so the link
        # thread reads reports while a big command waits for room (else both ends could block on
        # full buffers)
        self._send_lock = threading.Lock()
        self._channel: Channel | None = None  # to the engine serving now; None while none is
        self._pending: list[Any] = []  # commands for the next engine, while none is up
        self._live: dict[int, Request] = {}  # seq_id -> request, for every request the engine holds
        self._paused: set[bytes] = set()  # clients paused now: a new engine is told again
        self._process: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._progress: Callable[[list[Progress]], None] = lambda news: None
        self._on_stopped: Callable[[], None] = lambda: None
        self._thread = threading.Thread(target=self._read, name="ember-engine-link", daemon=True)
        self.stats = EngineStats()
        self.crashed = False  # serving ended because no engine could be started again
        self.restarts = 0
        self.pid = 0
        self.log = get_logger()

    # --- starting ----------------------------------------------------------------------------------
    def start_engine(self) -> None:
        """Start an engine and wait until its models are loaded and warm; EngineStartFailed (or the
        ModelFileError it reported) if it cannot."""
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen([sys.executable, "-m", "ember.daemon.server.engine_main", str(theirs.fileno())],
                                       stdin=subprocess.PIPE, pass_fds=[theirs.fileno()], env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the engine's end: when the engine dies, ours reads the end of the stream
        channel = Channel(ours, report_decoder)
        try:
            assert process.stdin is not None
            process.stdin.write(msgspec.json.encode(self._launch))
            process.stdin.close()
            self.pid = self._wait_ready(process, channel)
        except BaseException:
            channel.close()
            _kill(process)
            raise
        self._process = process
        with self._send_lock:  # what waited goes first: a command sent from now on queues behind it
            with self._lock:
                self._channel = channel
                # (none on the first start: no client is paused before serving begins)
                resend = [PauseClient(client, True) for client in self._paused]
                waiting, self._pending = resend + self._pending, []
            try:
                for message in waiting:
                    channel.send(message)
            except ChannelClosed:  # it died at once: the link thread sees its end and fails what it held
                pass

    def _wait_ready(self, process: subprocess.Popen[bytes], channel: Channel) -> int:
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            self._notifier.watchdog()  # loading is progress
            if channel.readable(_TICK):
                try:
                    report = channel.recv()
                except ChannelClosed:  # it died: its exit status says how
                    process.wait(_STOP_TIMEOUT)
                    raise EngineStartFailed(f"the engine process {_ended(process.returncode)} while starting") from None
                if isinstance(report, Ready):
                    return report.pid
                if isinstance(report, StartStatus):
                    self._notifier.status(report.text)
                elif isinstance(report, StartFailed):
                    process.wait(_STOP_TIMEOUT)
                    if report.path:
                        raise ModelFileError(report.path, report.reason)
                    raise EngineStartFailed(report.message)
        raise EngineStartFailed(f"the engine process did not become ready within {self._start_timeout:g} s")

    def bind(self, progress: Callable[[list[Progress]], None], on_stopped: Callable[[], None]) -> None:
        """Where the news of each step goes, and who hears that serving ended."""
        self._progress, self._on_stopped = progress, on_stopped

    def start(self) -> None:
        """Start reading the engine's reports (start_engine() first)."""
        self._thread.start()

    def close(self) -> None:
        """Stop the engine if it still runs (the daemon is exiting)."""
        if self._process is not None and self._process.poll() is None:
            _kill(self._process)
        self._drop_channel()

    def _drop_channel(self) -> None:
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            try:
                channel.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread still reading or writing it
            except OSError:
                pass
            channel.close()

    # --- commands (any thread) -----------------------------------------------------------------------
    def add(self, r: Request) -> None:
        seq = r.seq
        assert seq is not None
        message = AddSequence(seq.seq_id, r.client, r.id, r.model_name, seq.prompt, seq.max_tokens, seq.params,
                              seq.seed, sorted(seq.stop_ids), seq.wants_logits, seq.wants_logprob, seq.grammar,
                              seq.cache_salt, r.user, seq.device_logits)
        self._send(message, add=r)

    def cancel(self, client: bytes, request_id: int) -> None:
        self._send(CancelRequest(client, request_id))

    def finish(self, r: Request, reason: str) -> None:
        """The front ended `r` (a stop string); the engine answers with its end, after any news of it
        already on the way (whose logits slots the text worker then releases)."""
        assert r.seq is not None
        self._send(FinishSequence(r.seq.seq_id, reason))

    def drop_client(self, client: bytes) -> None:
        with self._lock:
            self._paused.discard(client)
        self._send(DropClient(client))

    def set_paused(self, client: bytes, paused: bool) -> None:
        with self._lock:
            (self._paused.add if paused else self._paused.discard)(client)
        self._send(PauseClient(client, paused))

    def hold(self, client: bytes, request_id: int, held: bool) -> None:
        self._send(HoldRequest(client, request_id, held))  # a new engine runs none of the old requests: no resend

    def release(self, client: bytes, slots: Iterable[int], device: bool = False) -> None:
        self._send(ReleaseSlots(client, list(slots), device))

    def shutdown(self, drain_timeout: float) -> None:
        self._stopping = True
        self._send(Shutdown(drain_timeout))

    def _send(self, message: Any, add: Request | None = None) -> None:
        with self._lock:
            if add is not None:
                assert add.seq is not None
                self._live[add.seq.seq_id] = add
            channel = self._channel
            if channel is None:
                self._pending.append(message)
                return
        with self._send_lock:
            try:
                channel.send(message)
            except ChannelClosed:  # the engine just died: the link thread ends what it held, `add` too
                pass

    # --- the reports (the link thread) ---------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                assert self._process is not None and self._channel is not None
                try:
                    report = self._channel.recv()
                except ChannelClosed:  # the engine died (or closed its end: it is exiting)
                    self._process.wait(_STOP_TIMEOUT)
                    if not self._engine_died():
                        return
                    continue
                if self._report(report):
                    self._process.wait(_STOP_TIMEOUT)
                    return
        except Exception:
            self.log.exception("engine link failed")
            self.crashed = True
        finally:
            self._on_stopped()

    def _report(self, report: EngineReport) -> bool:
        """Handle one report; True when the engine has stopped serving."""
        self._notifier.watchdog()  # it turns
        if isinstance(report, StepNews):
            if report.stats is not None:
                self.stats = report.stats
            self._news(report)
        elif isinstance(report, StatsUpdate):
            self.stats = report.stats
        elif isinstance(report, Stopped):
            if report.crashed and not self._stopping:
                return False  # the process's end restarts it
            self.crashed = report.crashed
            return True
        elif not isinstance(report, Heartbeat):
            self.log.warning("unexpected engine report", report=type(report).__name__)
        return False

    def _news(self, report: StepNews) -> None:
        news = []
        with self._lock:
            for p in report.progress:
                ended = p.finish is not None or p.error is not None
                r = self._live.pop(p.seq_id, None) if ended else self._live.get(p.seq_id)
                if r is None:  # an engine before this one held it
                    continue
                if p.started is not None and r.seq is not None:
                    r.seq.started = p.started
                news.append(Progress(r, p.tokens, p.choices, p.logits, p.finish, p.error, p.message, p.device_logits))
        if news:
            self._progress(news)

    def _engine_died(self) -> bool:
        """The engine exited unasked: end what it held, clean up after it, start another. False when
        serving ends instead (a shutdown was under way, or no engine would start)."""
        assert self._process is not None
        why = f"the engine process {_ended(self._process.returncode)}"
        self._drop_channel()
        with self._lock:
            lost, self._live = list(self._live.values()), {}
        self.log.error("engine process died", pid=self.pid, why=why, requests=len(lost))
        self._progress([Progress(r, finish=FinishReason.ERROR, message=f"{why}; the daemon is restarting it")
                        for r in lost])
        removed = remove_dead_segments(self._launch.shm_owner)
        if removed:
            self.log.info("removed the dead engine's logits segments", segments=len(removed))
        self.stats = EngineStats()
        if self._stopping:
            return False
        return self._restart()

    def _restart(self) -> bool:
        for attempt in range(1, RESTART_TRIES + 1):
            self._notifier.status(f"restarting the engine (try {attempt} of {RESTART_TRIES})")
            try:
                self.start_engine()
            except (EngineStartFailed, ModelFileError, OSError) as e:
                self.log.error("engine restart failed", attempt=attempt, error=str(e))
                time.sleep(min(5.0, 0.5 * attempt))
                continue
            self.restarts += 1
            self.log.info("engine restarted", pid=self.pid, restarts=self.restarts)
            self._notifier.status("serving")
            return True
        self.crashed = True
        with self._lock:
            lost, self._live, self._pending = list(self._live.values()), {}, []
        self._progress([Progress(r, finish=FinishReason.ERROR, message="the engine process could not be restarted")
                        for r in lost])
        return False


def _ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _kill(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    try:
        process.wait(_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
