"""HTTP clients that never read their streams must not keep others from running (issue 38, item 1): the
gateway holds their requests in the daemon once a little of their output waits unsent (protocol Hold),
the daemon gives their places to others, and a native bystander then streams at full pace; a non-reader
that starts reading again gets the rest of its answer. Before holds, the bystander waited until the
non-readers reached max_tokens (51.9 s with four)."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_process import DaemonProcess
from gateway_setup import MODEL
from gateway_thread import GatewayThread

from ember.client.gateway import generation

pytestmark = pytest.mark.slow

LONG = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 8000, "ignore_eos": True, "temperature": 0,
        "stream": True}


@pytest.fixture(scope="module", params=[4, 8], ids=["4-nonreaders", "8-nonreaders"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[int, DaemonProcess, GatewayThread]]:
    """A daemon whose running slots the non-readers fill (max_active = their number), a gateway before it
    whose streams' send buffers are small: a non-reader's backlog then reaches the gateway, which holds
    it, after about 150 tokens rather than 700, so that a slow or busy machine too gets every stream
    held long before the demo model's context would end it (a stream that ends is never held). Its
    streams may wait on their clients for longer than its default minute: on a slow machine, the first
    non-reader is held long before the last."""
    n = request.param
    config = f"[engine]\nmax_active = {n}\nmax_queued = 8\n[limits]\nmax_tokens = 8192\n"
    daemon = DaemonProcess(config).wait_ready(300)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generation, "SEND_BUFFER", 8 << 10)  # the gateway runs in this process
        gateway = GatewayThread(socket=daemon.socket, stall_timeout=600)  # held early, not dropped before the last
        yield n, daemon, gateway
        gateway.stop()
    daemon.stop()


def nonreader(url: str) -> socket.socket:
    """An HTTP client that asks for a long stream and reads nothing of it. Its receive buffer is small,
    so its output backs up well before the demo model's context ends the stream: with the kernel's
    default buffers a fast engine finished some of these streams (4096 tokens, about 900 kB) before
    their backlog reached the gateway, and such a stream, done, never gets held."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(LONG).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 10)  # before connect: it sets the window
    sock.connect((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def read_to_the_end(sock: socket.socket, timeout: float) -> bytes:
    """A non-reader that starts reading: everything up to the stream's last event."""
    sock.settimeout(1.0)
    got, deadline = bytearray(), time.monotonic() + timeout
    while b"data: [DONE]" not in got[-64:]:
        assert time.monotonic() < deadline, f"the stream did not end within {timeout} s ({len(got)} bytes)"
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        assert data, "the gateway closed the connection"
        got += data
    return bytes(got)


def wait_for(what: str, check: Any, timeout: float) -> None:
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def all_held(native: Any, n: int) -> None:
    """Wait until the daemon holds all n non-readers' requests. However slow the machine, each is held
    after some 150 tokens; what fails is a request that ends before it is held, or no progress at all."""
    wait_for("the non-readers' requests reach the daemon", lambda: (s := native.stats()).active + s.queued == n, 60)
    t0, stats = time.monotonic(), native.stats()
    while stats.held < n:
        assert stats.active + stats.queued == n, f"a non-reader's request ended unheld: {stats}"
        assert time.monotonic() - t0 < 600, f"not all {n} non-readers' requests held within 600 s: {stats}"
        time.sleep(0.05)
        stats = native.stats()


def test_a_bystander_streams_beside_clients_that_never_read(setup: tuple[int, DaemonProcess, GatewayThread]) -> None:
    from ember.client import Client

    n, daemon, gateway = setup
    with Client(daemon.socket) as native:
        sockets = [nonreader(gateway.url) for _ in range(n)]
        try:
            all_held(native, n)
            assert native.stats().active <= n  # held, they gave their places up (or will, once someone waits)
            arrived, t0 = [], time.perf_counter()
            for chunk in native.generate("import os", max_tokens=64, ignore_eos=True, temperature=0.0):
                arrived.append(time.perf_counter())
            gaps = [b - a for a, b in zip([t0, *arrived], arrived)]
            assert arrived and max(gaps) <= 2.0, f"first token after {gaps[0]:.2f} s, largest gap {max(gaps):.2f} s"
            assert native.stats().held == n  # still held: nobody read
            assert b'"finish_reason":"length"' in read_to_the_end(sockets[0], 120)  # it resumes, to max_tokens
        finally:
            for s in sockets:
                s.close()
        wait_for("the gateway's requests end in the daemon",
                 lambda: (stats := native.stats()).active + stats.queued == 0, 30)
