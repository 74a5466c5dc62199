"""`ember serve --http HOST:PORT`: the gateway as a child process of the daemon.

Why a child process and not a task in the daemon: the gateway must never share the daemon's GIL (its
JSON work per token would stall the engine thread) nor import its kernels; and why not a thread of its
own loop: the same GIL. Why the child and not only a second systemd unit: one command for a desktop or a
container; under systemd a second unit is the better choice (docs/gateway.md), as the daemon's unit
refuses network sockets.

The parent binds the address itself before the daemon loads anything, so a refused exposure (no API key
on a non-loopback address) or a port in use stops `ember serve` at once with one line; the child
inherits the bound socket. The child gets SIGTERM when the parent dies, however it dies
(PR_SET_PDEATHSIG), and `stop()` when the daemon exits: SIGTERM, then SIGKILL after a grace period. A
child that dies on its own is logged; the daemon keeps serving its socket.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from ember.client.gateway.config import API_KEY_ENV, GatewayConfig, GatewayConfigError, parse_listen
from ember.daemon.logging_setup import get_logger

PR_SET_PDEATHSIG = 1
STOP_GRACE = 35.0  # seconds: the gateway's shutdown_timeout (30) and its last frames


class GatewayChild:
    def __init__(self, listen: str, socket_path: Path, log_format: str = "auto", cors_origins: tuple[str, ...] = ()) -> None:
        """Bind `listen` and start the gateway on it (GatewayConfigError, OSError: nothing started)."""
        host, port = parse_listen(listen)
        GatewayConfig(host=host, port=port, api_key=os.environ.get(API_KEY_ENV) or None)  # refuses exposure
        sock = _bind(host, port)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ember.client.cli", "gateway", "--listen", listen, "--socket", str(socket_path),
                 "--listen-fd", str(sock.fileno()), "--log-format", log_format,
                 *(arg for origin in cors_origins for arg in ("--cors-origin", origin))],
                pass_fds=(sock.fileno(),), stdin=subprocess.DEVNULL,
                preexec_fn=_exit_with_parent)  # noqa: PLW1509 -- `ember serve` has started no thread yet
        finally:
            sock.close()  # the child has its own copy
        self._stopping = False
        threading.Thread(target=self._watch, name="ember-gateway-watch", daemon=True).start()

    def stop(self) -> int:
        """SIGTERM, wait for it to finish its requests, SIGKILL past the grace period; its exit status."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def _watch(self) -> None:
        status = self.proc.wait()
        if not self._stopping:
            get_logger().error("the HTTP gateway exited; the daemon keeps serving its socket", pid=self.proc.pid,
                               status=status)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise GatewayConfigError(f"--http {host}:{port}: cannot listen there: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _exit_with_parent() -> None:
    """In the child, before exec: SIGTERM when the daemon dies, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
