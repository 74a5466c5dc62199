"""The daemon's life: one per socket, clients that die, SIGTERM, and what systemd is told."""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_process import DaemonProcess, wait_until
from ember.client import AsyncClient, Client
from ember.client.errors import ShuttingDown

pytestmark = pytest.mark.slow

# A client in its own process, so it can be SIGKILLed. It prints "streaming" once tokens flow.
STREAMING_CLIENT = """
import sys, time
from ember.client import Client
c = Client(sys.argv[1])
s = c.generate("x", max_tokens=4000, ignore_eos=True, return_logits=True)
next(s)
print("streaming", flush=True)
time.sleep(600)
"""

# A raw client with a known routing id whose two requests are queued behind busy slots when it dies.
QUEUED_CLIENT = """
import sys, time, zmq
from ember.protocol.codec import Codec
from ember.protocol.messages import Generate, Health
codec, sock = Codec(), zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.ROUTING_ID, b"doomed")
sock.connect("ipc://" + sys.argv[1])
for i in (1, 2):
    sock.send(codec.encode(Generate(i, prompt="y", max_tokens=4000, ignore_eos=True)))
sock.send(codec.encode(Health(3)))
while codec.decode_server(sock.recv()).__class__.__name__ != "HealthStatus":
    pass
print("queued", flush=True)
time.sleep(600)
"""


def client_process(script: str, socket: Path, ready: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", script, str(socket)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == ready
    return proc



def test_second_daemon_on_the_same_socket_fails_clearly(daemon) -> None:  # type: ignore[no-untyped-def]
    second = subprocess.run([sys.executable, "-m", "ember.client.cli", "serve", "--socket", str(daemon.socket)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert f"another ember daemon (pid {daemon.proc.pid}) is already serving {daemon.socket}" in second.stderr
    assert "Traceback" not in second.stderr
    with Client(daemon.socket) as client:
        assert client.health().status == "ok"  # the first one keeps its socket


def test_killed_client_is_cancelled_and_freed_within_2s(daemon) -> None:  # type: ignore[no-untyped-def]
    rings = f"/dev/shm/ember-{daemon.engine_pid}-*"
    with Client(daemon.socket) as observer:
        cancelled = observer.stats().cancelled_total
        proc = client_process(STREAMING_CLIENT, daemon.socket, "streaming")
        assert observer.stats().active == 1 and len(glob.glob(rings)) == 1
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        assert wait_until(lambda: observer.stats().active == 0 and not glob.glob(rings), 2.0)
        freed_after = time.monotonic() - t0
        stats = observer.stats()
    assert stats.cancelled_total == cancelled + 1 and stats.clients == 0, (stats, freed_after)


def test_queued_work_of_a_dead_client_never_runs(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as busy:
        streams = [busy.generate("x", max_tokens=4000, ignore_eos=True) for _ in range(3)]  # every engine slot
        for s in streams:
            next(s)
        proc = client_process(QUEUED_CLIENT, daemon.socket, "queued")
        assert busy.stats().queued == 2
        proc.kill()
        proc.wait()
        assert wait_until(lambda: busy.stats().queued == 0, 2.0)
        for s in streams:
            s.close()
    doomed = [e for e in daemon.log_events() if str(e.get("req", "")).startswith(b"doomed".hex())]
    assert {e["event"] for e in doomed} == {"request admitted", "request finished"}  # never "request started"
    assert [e["reason"] for e in doomed if e["event"] == "request finished"] == ["cancelled", "cancelled"]


@pytest.mark.asyncio
async def test_sigterm_during_streaming_ends_every_stream_and_exits_0() -> None:
    d = DaemonProcess("[server]\ndrain_timeout = 1.0\n").wait_ready()
    try:
        assert d.notify.messages.index(next(m for m in d.notify.messages if m.startswith("STATUS=loading"))) < \
            d.notify.messages.index(next(m for m in d.notify.messages if m.startswith("READY=1")))
        async with AsyncClient(d.socket) as client:
            streams = [client.generate(f"x{i}", max_tokens=4000, ignore_eos=True) for i in range(3)]
            for s in streams:
                await s.__anext__()
            d.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(d.notify.wait_for, "STOPPING=1", 30.0)
            with pytest.raises(ShuttingDown):
                await client.generate("late", max_tokens=1).text()
            assert (await client.health()).status == "draining"
            for s in streams:
                async for _ in s:
                    pass
                assert s.finished is not None and s.finished.reason == "cancelled"
        rc = await asyncio.to_thread(d.proc.wait, 30)
        assert rc == 0
        assert not d.socket.exists()
        assert not any(glob.glob(f"/dev/shm/ember-{pid}-*") for pid in (d.proc.pid, *d.engine_pids()))
    finally:
        d.stop()


def test_daemon_refuses_a_bad_config_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[engine]\nmax_active = 0\n")
    out = subprocess.run([sys.executable, "-m", "ember.client.cli", "serve", "--config", str(tmp_path / "bad.toml"),
                          "--socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("EMBER_")})
    assert out.returncode == 1
    assert out.stderr.strip() == ("ember: error: invalid configuration: engine.max_active: max_active must be >= 1, "
                                  f"got 0 (set by config file {tmp_path / 'bad.toml'})")


def test_memory_plan_is_logged_before_the_model_loads(daemon) -> None:  # type: ignore[no-untyped-def]
    events = [e["event"] for e in daemon.log_events()]
    assert events.index("memory plan") < events.index("model ready")
    plan = next(e for e in daemon.log_events() if e["event"] == "memory plan")
    assert plan["fits"] is True and plan["device"] == "cpu" and plan["seqs"] == 3 and plan["ctx"] == 4096


def test_a_model_that_does_not_fit_is_refused_with_what_to_change(tmp_path: Path) -> None:
    # 100000 sequences of 4096 tokens: a KV cache of about 2 TB for the demo model
    (tmp_path / "big.toml").write_text("[engine]\nmax_active = 100000\n")
    out = subprocess.run([sys.executable, "-m", "ember.client.cli", "serve", "--config", str(tmp_path / "big.toml"),
                          "--socket", str(tmp_path / "s.sock"), "--log-format", "json"], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("EMBER_")})
    assert out.returncode == 1
    message = out.stderr.strip().splitlines()[-3:]  # the CLI's error: the verdict, the fixes, the knobs
    assert message[0].startswith("ember: error: ember-demo-dense-q8_0.gguf does not fit cpu") and "KV cache" in message[0]
    assert message[1].startswith("To make it fit:") and "--seqs" in message[1]
    assert "--seqs is engine.max_active" in message[2]
    assert "model ready" not in out.stderr and not (tmp_path / "s.sock").exists()
