"""sd_notify against a fake NOTIFY_SOCKET datagram listener."""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from ember.daemon.server.notify import Notifier


def listener(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(5)
    return s


def test_ready_status_stopping_reach_the_socket(tmp_path: Path) -> None:
    sock = listener(str(tmp_path / "notify"))
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert n.enabled
    n.status("loading demo (1/1)")
    n.ready("serving demo")
    n.stopping()
    assert sock.recv(4096) == b"STATUS=loading demo (1/1)"
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving demo"
    assert sock.recv(4096) == b"STOPPING=1"
    n.close()


def test_abstract_socket_address() -> None:
    name = f"ember-test-{uuid.uuid4().hex}"
    sock = listener("\0" + name)
    Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
    assert sock.recv(4096) == b"READY=1"


def test_watchdog_pings_at_most_twice_per_interval(tmp_path: Path) -> None:
    sock = listener(str(tmp_path / "notify"))
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "60000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval == 60.0
    for _ in range(100):
        n.watchdog()
    n.status("end")
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert sock.recv(4096) == b"STATUS=end"  # the 99 other calls sent nothing


def test_watchdog_for_another_pid_or_none_is_off(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    assert Notifier(env).watchdog_interval is None
    assert Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")}).watchdog_interval is None


def test_without_systemd_everything_is_a_no_op(tmp_path: Path) -> None:
    n = Notifier({})
    assert not n.enabled
    n.ready(), n.status("x"), n.watchdog(), n.stopping(), n.close()
    # a listener that went away must not hurt the daemon either
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing")})
    gone.ready()
