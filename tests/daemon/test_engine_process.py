"""The engine in a process of its own (daemon/server/engine_host.py): the front sees it die, every
request it held ends with a clear error within 2 s, a new engine serves the next request while the
daemon keeps its socket, and nothing the dead engine held — its children, its logits segments — is
left behind. The MoE model's cold-expert workers, the engine's children, are test_moe_daemon.py's."""
from __future__ import annotations

import glob
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ember.client import Client
from ember.client.errors import GenerationFailed
from ember.protocol.shm_ring import SHM_DIR, owner_id

from daemon_process import DaemonProcess, alive, children

PROMPT = "def fibonacci(n):"
CONFIG = """
[server]
probe_interval = 0.2
logits_slots = 4
[engine]
max_active = 4
[limits]
max_tokens = 4000
"""

pytestmark = pytest.mark.slow


def segments(pid: int, socket: Path) -> list[str]:
    return glob.glob(f"{SHM_DIR}/ember-{pid}-{owner_id(socket)}*")



def test_a_killed_engine_fails_every_stream_within_2s_and_the_next_request_is_served(demo_model) -> None:  # type: ignore[no-untyped-def]
    d = DaemonProcess(CONFIG).wait_ready()
    try:
        first = d.engine_pid
        assert first != d.proc.pid and first in children(d.proc.pid)
        ended: dict[int, tuple[str, float]] = {}
        streaming = threading.Barrier(5)

        def stream(i: int) -> None:
            with Client(d.socket, timeout=30) as client:  # one of them with a logits ring
                s = client.generate(PROMPT, max_tokens=4000, ignore_eos=True, return_logits=i == 0, seed=i,
                                    temperature=0.0 if i % 2 else 0.8)
                next(s)
                streaming.wait(60)
                try:
                    list(s)
                    ended[i] = (f"finished: {s.finished.reason if s.finished else None}", time.monotonic())
                except GenerationFailed as e:
                    ended[i] = (str(e), time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        streaming.wait(60)
        assert len(segments(first, d.socket)) == 1
        killed = time.monotonic()
        os.kill(first, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert sorted(ended) == [0, 1, 2, 3]
        for why, when in ended.values():
            assert "the engine process was killed by SIGKILL" in why
            assert when - killed < 2.0
        with Client(d.socket, timeout=120) as client:  # the same socket, a new engine
            assert client.health().status == "ok"
            assert client.stats().errors_total == 4  # the failed generations are counted (ember status, /metrics)
            tokens = [t for c in client.generate(PROMPT, max_tokens=16) for t in c.token_ids]
        assert tokens == list(demo_model.generate(PROMPT, max_tokens=16))
        assert d.engine_pid != first and not alive(first)
        assert segments(first, d.socket) == []  # the dead engine's ring, unlinked by the front
        assert any(e["event"] == "engine process died" and e["requests"] == 4 for e in d.log_events())
    finally:
        rc = d.stop()
    assert rc == 0
    assert not any(alive(pid) for pid in d.engine_pids())
    assert not any(segments(pid, d.socket) for pid in d.engine_pids())

