"""The relay on the daemon's public socket (daemon/server/zmtp_relay.py): libzmq clients and the ROUTER
talk through it unchanged, the ROUTER learns each client's SO_PEERCRED from it, and a stream that
breaks a rule (an unfinished multi-part message past the limit, too many frames, a foreign greeting,
forged credentials) is cut off as it arrives. Issue 38, item 2: 4 x 100 unfinished 4 MiB frames held
1.6 GB of the front process until their connections closed."""
from __future__ import annotations

import os
import random
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from concurrent_streams import PacedStream
from daemon_process import DaemonProcess
from raw_zmtp import COMMAND, GREETING, MORE, closed_by_peer, frame, ready, zmtp_dealer

from ember.client import Client
from ember.protocol.endpoint import MAX_PATH_BYTES
from ember.daemon.server.zmtp_relay import (MAX_FRAMES, PEER_PROPERTY, RelayRefused, ZmtpChecker, ZmtpRelay,
                                            private_router_dir, router_path)

LIMIT = 1 << 20  # max_message_bytes of these relays
ME = f"{os.getuid()}:{os.getgid()}:{os.getpid()}"


class Relayed:
    """A relay (on its own thread) in front of a ROUTER this test reads."""

    def __init__(self, directory: Path, rcvhwm: int = 1000) -> None:
        self.public = directory / "ember.sock"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, rcvhwm)
        self.router.setsockopt(zmq.RCVTIMEO, 10_000)
        private_router_dir(self.public)
        self.router.bind(f"ipc://{router_path(self.public)}")
        self.relay = ZmtpRelay(self.public, router_path(self.public), LIMIT)
        self.relay.start()

    def dealer(self) -> zmq.Socket:  # type: ignore[type-arg]
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.public}")
        return sock

    def close(self) -> None:
        self.relay.close(1.0)
        self.ctx.destroy(linger=0)


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[Relayed]:
    r = Relayed(tmp_path)
    yield r
    r.close()


def test_messages_pass_both_ways_and_the_router_learns_the_client(relayed: Relayed) -> None:
    dealer = relayed.dealer()
    for body in (b"hello", os.urandom(LIMIT - 100)):
        dealer.send(body)
        identity, got = relayed.router.recv_multipart(copy=False)
        assert got.bytes == body
        assert got.get(PEER_PROPERTY) == ME  # SO_PEERCRED of this process's connection to the relay
        relayed.router.send_multipart([identity.bytes, b"re:" + body])
        assert dealer.recv() == b"re:" + body
    dealer.close()


def test_a_small_multipart_message_passes(relayed: Relayed) -> None:
    """The daemon answers it with an Error of its own: the relay only bounds it."""
    dealer = relayed.dealer()
    dealer.send_multipart([b"a", b"b", b"c"])
    assert [f for f in relayed.router.recv_multipart()[1:]] == [b"a", b"b", b"c"]
    dealer.close()


def test_forged_credentials_are_replaced(relayed: Relayed) -> None:
    sock = zmtp_dealer(relayed.public, X_Ember_Peer=b"4242:4242:1", x_ember_peer=b"4243:0:1")
    sock.sendall(frame(b"forged?"))
    _, got = relayed.router.recv_multipart(copy=False)
    assert got.bytes == b"forged?" and got.get(PEER_PROPERTY) == ME
    sock.close()


def test_an_unfinished_message_is_cut_off_at_the_limit(relayed: Relayed) -> None:
    sock = zmtp_dealer(relayed.public)
    part, sent = frame(b"x" * (256 << 10), MORE), 0
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(400):  # 100 MiB, if nothing stopped it
            sock.sendall(part)
            sent += len(part)
    assert sent < 32 << 20  # the limit, and what the socket buffers held before the relay's verdict
    assert relayed.relay.refused == 1
    sock.close()
    # the ROUTER got none of it, and serves the next client
    dealer = relayed.dealer()
    dealer.send(b"next")
    assert relayed.router.recv_multipart()[1:] == [b"next"]


@pytest.mark.parametrize("stream", [
    b"".join(frame(b"", MORE) for _ in range(MAX_FRAMES + 1)),  # 2 million empty frames: +129 MiB
    frame(b"ping" * 300, COMMAND),  # a command far larger than any ZMTP command
    bytes([0x08, 1, 0]),  # a reserved flag bit
])
def test_a_stream_that_breaks_a_rule_is_closed(relayed: Relayed, stream: bytes) -> None:
    sock = zmtp_dealer(relayed.public)
    sock.sendall(stream)
    assert closed_by_peer(sock)
    assert relayed.relay.refused == 1


@pytest.mark.parametrize("greeting", [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 64,
                                      GREETING[:10] + b"\x02\x00" + GREETING[12:],  # ZMTP 2
                                      GREETING[:12] + b"PLAIN".ljust(20, b"\x00") + GREETING[32:]])
def test_a_foreign_greeting_is_closed(relayed: Relayed, greeting: bytes) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(relayed.public))
    sock.sendall(greeting)
    assert closed_by_peer(sock)
    sock.close()


def test_the_router_listens_in_a_private_directory(relayed: Relayed, tmp_path: Path) -> None:
    """The public socket's directory may let a group in; the ROUTER's must not (a client there could
    claim any credentials), whatever the umask, and however long the public socket's path."""
    private = router_path(relayed.public)
    assert private.is_socket() and stat.S_IMODE(os.stat(private.parent).st_mode) == 0o700
    assert private.parent.parent == relayed.public.parent
    long_name = tmp_path / ("e" * (MAX_PATH_BYTES - len(os.fsencode(tmp_path)) - 1))
    assert len(os.fsencode(router_path(long_name))) <= MAX_PATH_BYTES


def test_the_checker_passes_any_split_of_a_stream_the_same() -> None:
    """Headers and READY cut across reads anywhere: the same bytes go on, READY with the peer added."""
    stream = (GREETING + ready(Identity=b"me") + frame(b"short") + frame(b"m" * 300, MORE) + frame(b"end")
              + frame(b"\x04PING\x00\x00", COMMAND) + frame(b"z" * 70_000))
    whole = b"".join(ZmtpChecker("1:2:3", LIMIT).feed(stream))
    rng = random.Random(0)
    for _ in range(50):
        checker, out, at = ZmtpChecker("1:2:3", LIMIT), [], 0
        while at < len(stream):
            step = rng.choice([1, 2, 3, 7, 64, 1000, 50_000])
            out += checker.feed(stream[at:at + step])
            at += step
        assert b"".join(out) == whole
    sent_ready = ready(Identity=b"me", X_Ember_Peer=b"1:2:3")
    assert whole == stream.replace(ready(Identity=b"me"), sent_ready)


def test_the_checker_counts_a_message_across_its_frames() -> None:
    checker = ZmtpChecker("1:2:3", LIMIT)
    checker.feed(GREETING + ready())
    for _ in range(3):  # whole messages of LIMIT bytes, one after another
        checker.feed(frame(b"a" * (LIMIT // 2), MORE) + frame(b"b" * (LIMIT // 2)))
    checker.feed(frame(b"a" * (LIMIT // 2), MORE) + frame(b"b" * (LIMIT // 2), MORE))
    with pytest.raises(RelayRefused, match="over"):
        checker.feed(frame(b"c"))


def test_a_client_that_leaves_is_dropped_by_the_router_once_it_reads(tmp_path: Path) -> None:
    """The relay only shuts its ROUTER connection for writing when a client leaves (a hang-up while
    the ROUTER's input is stopped can abort libzmq: zmtp_relay.half_close): the ROUTER still reads what
    the client sent and then drops the connection, with input stopped (RCVHWM 1) when the client left."""
    relayed = Relayed(tmp_path, rcvhwm=1)
    monitor = relayed.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    monitor.setsockopt(zmq.RCVTIMEO, 10_000)
    try:
        sock = zmtp_dealer(relayed.public)
        sock.sendall(b"".join(frame(b"%d" % i) for i in range(2000)))
        assert relayed.router.recv_multipart()[1:] == [b"0"]  # the ROUTER connection is up, its pipe full
        sock.close()
        got = [relayed.router.recv_multipart()[1] for _ in range(1999)]
        assert got == [b"%d" % i for i in range(1, 2000)]  # nothing the client sent is lost
        assert monitor.recv_multipart()  # EVENT_DISCONNECTED: libzmq read the end and closed
        deadline = time.monotonic() + 10
        while relayed.relay.links and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not relayed.relay.links
    finally:
        monitor.close()
        relayed.close()


@pytest.mark.slow
def test_a_flood_that_leaves_at_once_does_not_abort_the_daemon() -> None:
    """400,000 junk messages, the connection closed half a second later, while the ROUTER's input was
    stopped: libzmq aborted the daemon (`Assertion failed: !_io_error`) at its next heartbeat, every
    time, until the relay half-closed its ROUTER connections."""
    daemon = DaemonProcess().wait_ready(300)
    ctx = zmq.Context()
    try:
        for _ in range(2):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(f"ipc://{daemon.socket}")
            for _ in range(400_000):
                sock.send(b"\xff junk")
            time.sleep(0.5)
            sock.close()
            time.sleep(2.5)  # past the ROUTER's next heartbeat (1 s)
            assert daemon.proc.poll() is None, daemon.log_path.read_text()[-2000:]
        with Client(daemon.socket) as client:
            assert client.health().status == "ok"
    finally:
        ctx.destroy(linger=0)
        daemon.stop()


@pytest.mark.slow
def test_unfinished_messages_hold_no_memory_in_the_daemon() -> None:
    """The red-team's attack: 4 connections send ~500 MiB each as one message of 4 MiB frames that
    never ends. Each is closed at the daemon's limit (4 MiB), the front's RSS grows by less than
    100 MiB, and a stream beside them keeps its pace."""
    daemon = DaemonProcess().wait_ready(300)
    try:
        stream = PacedStream(daemon.socket, 3000)
        before = _rss_mib(daemon.proc.pid)
        part, most = frame(b"x" * ((4 << 20) - 64), MORE), 0
        senders = [zmtp_dealer(daemon.socket) for _ in range(4)]
        for sock in senders:
            sent = 0
            try:
                for _ in range(127):
                    sock.sendall(part)
                    sent += len(part)
            except (BrokenPipeError, ConnectionResetError):
                pass
            most = max(most, sent)
        grown = _rss_mib(daemon.proc.pid) - before
        largest = stream.finish()
        for sock in senders:
            sock.close()
        assert most < 64 << 20, f"a sender got {most >> 20} MiB through"
        assert grown < 100, f"the front grew by {grown} MiB"
        assert largest < 2.0, f"largest gap {largest:.2f} s"
    finally:
        daemon.stop()


def _rss_mib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024
