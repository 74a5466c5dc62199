"""One client process cannot fill the daemon (issue 38: 3 connections x 16 streams filled its 36 places,
and every other client got Busy for 40 s): a process holds at most engine.max_per_process requests in
flight, whatever its connections (by default all places but an eighth), so another process still gets
in. The daemon tells processes apart by SO_PEERCRED (the relay's X-Ember-Peer)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from daemon_process import DaemonProcess

from ember.client import Client
from ember.client.errors import Busy

pytestmark = pytest.mark.slow

CONFIG = "[engine]\nmax_active = 2\nmax_queued = 6\n"  # 8 places: one process may hold 7
OTHER_PROCESS = """
import sys
from ember.client import Client
with Client(sys.argv[1]) as client:
    print(sum(len(c.token_ids) for c in client.generate("def f(x):", max_tokens=4, ignore_eos=True)))
"""


def test_one_process_leaves_room_for_another() -> None:
    daemon = DaemonProcess(CONFIG).wait_ready(300)
    try:
        clients = [Client(daemon.socket) for _ in range(4)]
        streams = [clients[i % 3].generate("def fibonacci(n):", max_tokens=4000, ignore_eos=True) for i in range(7)]
        deadline = time.monotonic() + 30
        while (stats := clients[3].stats()).active + stats.queued < 7:  # all admitted: running, or queued
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        with pytest.raises(Busy, match=r"this process has 7 requests in flight.*engine.max_per_process"):
            next(clients[0].generate("x", max_tokens=2))
        other = subprocess.run([sys.executable, "-c", OTHER_PROCESS, str(daemon.socket)], capture_output=True,
                               text=True, timeout=120)
        assert other.returncode == 0 and other.stdout.strip() == "4", other.stderr[-2000:]
        for stream in streams:
            stream.close()
        for client in clients:
            client.close()
    finally:
        daemon.stop()
