"""A real `ember serve` in a child process, for tests: a short temporary socket path, a config file, a
fake systemd NOTIFY_SOCKET that tells the test when the daemon is READY (no sleeping), and the
daemon's JSON log in a file."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def wait_until(condition, timeout: float, every: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    """Poll another process's state (there is no event to await across processes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def alive(pid: int) -> bool:
    """The process runs: it exists and is no zombie (one that exited and nobody has reaped yet, as
    happens to a killed daemon's engine where init does not reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def exited(pid: int) -> bool:
    """The process has exited whole, and its parent can reap it: gone, or a zombie with no thread left
    but its first (a killed process's main thread turns zombie while its other threads still die, and
    until they have, its parent's waitpid reports nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and len(list(Path(f"/proc/{pid}/task").iterdir())) <= 1
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """The processes `pid` started (every thread's children)."""
    try:
        return [int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()]
    except FileNotFoundError:
        return []


class NotifyListener:
    """A datagram socket playing systemd's part of sd_notify: collects messages, lets tests wait."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(4096)
            except OSError:
                return
            with self._cond:
                self.messages.append(data.decode())
                self._cond.notify_all()

    def wait_for(self, line: str, timeout: float) -> bool:
        """Wait until a message with `line` (e.g. "READY=1") arrives."""
        with self._cond:
            return self._cond.wait_for(lambda: any(line in m.split("\n") for m in self.messages), timeout)

    def close(self) -> None:
        self._sock.close()


class DaemonProcess:
    def __init__(self, config: str = "", env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ember-t-"))  # short: a socket path must fit 107 bytes
        self.socket = self.dir / "run" / "ember.sock"
        self.log_path = self.dir / "daemon.log"
        (self.dir / "ember.toml").write_text(config)
        self.notify = NotifyListener(self.dir / "notify")
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
        child_env.update(NOTIFY_SOCKET=str(self.notify.path), **(env or {}))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.client.cli", "serve", "--socket", str(self.socket),
             "--config", str(self.dir / "ember.toml"), "--log-format", "json", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=child_env,
        )

    def wait_ready(self, timeout: float = 60.0) -> DaemonProcess:
        if not self.notify.wait_for("READY=1", timeout):
            self.stop()
            raise RuntimeError(f"the daemon did not become ready:\n{self.log_path.read_text()}")
        return self

    def log_events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return out

    def engine_pids(self) -> list[int]:
        """The pid of every engine process the daemon started, in order (a killed one is restarted)."""
        return [e["pid"] for e in self.log_events() if e.get("event") in ("engine process ready", "engine restarted")]

    @property
    def engine_pid(self) -> int:
        """The engine process serving now: it runs the models and makes the logits segments."""
        return self.engine_pids()[-1]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        self.notify.close()
        return rc
