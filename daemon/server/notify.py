"""systemd's notify protocol (sd_notify) without libsystemd: datagrams to $NOTIFY_SOCKET.

READY=1 once models are loaded and warmed, STATUS=... while loading, WATCHDOG=1 from the engine loop,
STOPPING=1 on SIGTERM. Outside systemd (no NOTIFY_SOCKET) every call does nothing.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self._address = _address(env.get("NOTIFY_SOCKET", ""))
        self._socket: socket.socket | None = None
        if self._address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_interval = _watchdog_interval(env)
        self._last_watchdog = 0.0
        self._lock = threading.Lock()  # the engine thread and the I/O loop both notify
        self.on_status: Callable[[str], None] | None = None  # also told every status line (the socket's lock file)

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def ready(self, status: str = "") -> None:
        self._tell(status or "serving")
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        self._tell(text)
        self._send(f"STATUS={text}")

    def _tell(self, text: str) -> None:
        with self._lock:
            if self.on_status is not None:
                self.on_status(text)

    def stopping(self, status: str = "") -> None:
        self._send("STOPPING=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> None:
        """Pet the watchdog; cheap enough to call every engine step (sends at most twice per interval,
        as sd_watchdog_enabled(3) advises)."""
        if self.watchdog_interval is None:
            return
        now = time.monotonic()
        if now - self._last_watchdog >= self.watchdog_interval / 2:
            self._last_watchdog = now
            self._send("WATCHDOG=1")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _send(self, message: str) -> None:
        with self._lock:
            if self._socket is None or self._address is None:
                return
            try:
                self._socket.sendto(message.encode(), self._address)
            except OSError:
                pass  # systemd went away or never listened: the service must not die of it


def _address(value: str) -> str | None:
    if not value:
        return None
    if value.startswith("@"):  # abstract namespace
        return "\0" + value[1:]
    return value if value.startswith("/") else None  # vsock and others: not supported


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between pings systemd expects, or None when no watchdog is set for this process."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 1e6
