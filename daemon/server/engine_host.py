"""EngineHost: the front process's handle on the engine process (engine_main.py) — starting it,
sending it commands, reading its reports, and starting it again when it dies.

It has the engine loop's interface (add, cancel, finish, drop_client, set_paused, release, shutdown,
stats), so the text worker drives it as it would drive the loop in process. Commands may come from
any thread (a lock keeps the command socket to one at a time); the reports are read by a thread of
its own, which turns each step's news back into Progress for the front's own Request objects.

An engine that dies (killed, out of memory, a crash) is seen at once: every request it held ends
with Finished{error} saying so, its logits segments are unlinked, and a new engine is started while
the daemon keeps its socket; requests admitted meanwhile wait for it. An engine that cannot start
again after a few tries ends serving (`crashed`: the daemon exits 1, systemd restarts it).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.logging_setup import get_logger
from ember.daemon.server.engine_thread import EngineStats, Progress
from ember.daemon.server.engine_wire import (AddSequence, CancelRequest, DropClient, EngineLaunch, EngineReport,
                                             FinishSequence, Heartbeat, PauseClient, Ready, ReleaseSlots, Shutdown,
                                             StartFailed, StartStatus, StatsUpdate, StepNews, Stopped, command_encoder,
                                             report_decoder)
from ember.daemon.server.notify import Notifier
from ember.protocol.messages import FinishReason
from ember.protocol.shm_ring import remove_dead_segments

if TYPE_CHECKING:
    from ember.daemon.server.request import Request

START_TIMEOUT = 1800.0  # seconds an engine may take to compile its kernels, load and warm up its models
RESTART_TRIES = 3  # engines in a row that may fail to start after a death before serving ends
_POLL_MS = 50  # how often the report reader looks at the process between reports
_STOP_TIMEOUT = 10.0  # seconds a stopping engine gets to exit before it is killed


class EngineStartFailed(RuntimeError):
    """The engine process could not load the models (the message says why) or did not start."""


class EngineHost:
    def __init__(self, launch: EngineLaunch, notifier: Notifier, start_timeout: float = START_TIMEOUT) -> None:
        """launch: what every engine is started with; its `commands` / `reports` addresses are
        replaced by fresh ones in a private directory for each engine started."""
        self._launch = launch
        self._notifier = notifier
        self._start_timeout = start_timeout
        self._dir = Path(tempfile.mkdtemp(prefix="ember-engine-"))  # 0700: only this user reaches the sockets
        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # the command socket, _live and _pending
        self._commands: zmq.Socket | None = None  # None while no engine is up
        self._reports: zmq.Socket | None = None
        self._pending: list[bytes] = []  # commands for the next engine, while none is up
        self._live: dict[int, Request] = {}  # seq_id -> request, for every request the engine holds
        self._paused: set[bytes] = set()  # clients paused now: a new engine is told again
        self._process: subprocess.Popen[bytes] | None = None
        self._generation = 0
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
        self._generation += 1
        prefix = self._dir / str(self._generation)
        launch = msgspec.structs.replace(self._launch, commands=f"ipc://{prefix}.cmd", reports=f"ipc://{prefix}.out")
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        process = subprocess.Popen([sys.executable, "-m", "ember.daemon.server.engine_main"], stdin=subprocess.PIPE,
                                   env=env)
        try:
            assert process.stdin is not None
            process.stdin.write(msgspec.json.encode(launch))
            process.stdin.close()
            reports = self._ctx.socket(zmq.PULL)
            reports.connect(launch.reports)
            commands = self._ctx.socket(zmq.PUSH)
            commands.setsockopt(zmq.SNDHWM, 0)  # commands are few, bounded by admission: never block on them
            commands.connect(launch.commands)
            try:
                self.pid = self._wait_ready(process, reports)
            except BaseException:
                reports.close(linger=0)
                commands.close(linger=0)
                raise
        except BaseException:
            _kill(process)
            raise
        self._process, self._reports = process, reports
        with self._lock:
            self._commands = commands
            for client in self._paused if self._generation > 1 else ():
                commands.send(command_encoder.encode(PauseClient(client, True)))
            for frame in self._pending:
                commands.send(frame)
            self._pending.clear()

    def _wait_ready(self, process: subprocess.Popen[bytes], reports: zmq.Socket) -> int:
        deadline = time.monotonic() + self._start_timeout
        while time.monotonic() < deadline:
            self._notifier.watchdog()  # loading is progress
            if reports.poll(_POLL_MS):
                report = report_decoder.decode(reports.recv())
                if isinstance(report, Ready):
                    return report.pid
                if isinstance(report, StartStatus):
                    self._notifier.status(report.text)
                elif isinstance(report, StartFailed):
                    process.wait(_STOP_TIMEOUT)
                    if report.path:
                        raise ModelFileError(report.path, report.reason)
                    raise EngineStartFailed(report.message)
            elif process.poll() is not None:
                raise EngineStartFailed(f"the engine process {_ended(process.returncode)} while starting")
        raise EngineStartFailed(f"the engine process did not become ready within {self._start_timeout:g} s")

    def bind(self, progress: Callable[[list[Progress]], None], on_stopped: Callable[[], None]) -> None:
        """Where the news of each step goes, and who hears that serving ended."""
        self._progress, self._on_stopped = progress, on_stopped

    def start(self) -> None:
        """Start reading the engine's reports (start_engine() first)."""
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        """Stop the engine if it still runs (the daemon is exiting) and remove the sockets' directory."""
        if self._process is not None and self._process.poll() is None:
            _kill(self._process)
        with self._lock:
            for sock in (self._commands, self._reports):
                if sock is not None:
                    sock.close(linger=0)
            self._commands = self._reports = None
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- commands (any thread) -----------------------------------------------------------------------
    def add(self, r: Request) -> None:
        seq = r.seq
        assert seq is not None
        message = AddSequence(seq.seq_id, r.client, r.id, r.model_name, seq.prompt, seq.max_tokens, seq.params,
                              seq.seed, sorted(seq.stop_ids), seq.wants_logits, seq.wants_logprob)
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

    def release(self, client: bytes, slots: Iterable[int]) -> None:
        self._send(ReleaseSlots(client, list(slots)))

    def shutdown(self, drain_timeout: float) -> None:
        self._stopping = True
        self._send(Shutdown(drain_timeout))

    def _send(self, message: Any, add: Request | None = None) -> None:
        frame = command_encoder.encode(message)
        with self._lock:
            if add is not None:
                assert add.seq is not None
                self._live[add.seq.seq_id] = add
            if self._commands is None:
                self._pending.append(frame)
            else:
                self._commands.send(frame)

    # --- the reports (the link thread) ---------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                assert self._process is not None and self._reports is not None
                if self._reports.poll(_POLL_MS):
                    if self._report(report_decoder.decode(self._reports.recv())):
                        self._process.wait(_STOP_TIMEOUT)
                        return
                elif self._process.poll() is not None and not self._engine_died():
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
                news.append(Progress(r, p.tokens, p.choices, p.logits, p.finish, p.error, p.message))
        if news:
            self._progress(news)

    def _engine_died(self) -> bool:
        """The engine exited unasked: end what it held, clean up after it, start another. False when
        serving ends instead (a shutdown was under way, or no engine would start)."""
        assert self._process is not None
        why = f"the engine process {_ended(self._process.returncode)}"
        with self._lock:
            lost, self._live = list(self._live.values()), {}
            if self._commands is not None:
                self._commands.close(linger=0)
            self._commands = None
        if self._reports is not None:
            self._reports.close(linger=0)
            self._reports = None
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
