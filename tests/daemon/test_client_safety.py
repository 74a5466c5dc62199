"""One client must never hurt another, the SDK's side: it sends nothing to a socket another user could
have planted, a daemon that dies or drops the connection ends every call at once with a clear error,
every failure is an EmberError, nothing over the daemon's frame limit is sent, and the CLI says what
went wrong in one line."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from daemon_process import DaemonProcess
from ember.client import AsyncClient, Client
from ember.client.errors import (BadRequest, ConnectionLost, DaemonUnavailable, EmberError, LimitExceeded,
                                 UntrustedSocket)
from ember.protocol.codec import Codec
from ember.protocol.messages import PROTOCOL_VERSION, Generate, Hello, Tokens, Welcome

pytestmark = pytest.mark.slow

NOBODY = 65534
CLI = [sys.executable, "-m", "ember.client.cli"]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory for sockets (a socket path must fit 107 bytes: pytest's tmp_path may not)."""
    d = Path(tempfile.mkdtemp(prefix="ember-c-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class FakeDaemon:
    """A ROUTER that greets clients and answers a Generate with one Tokens frame, then stays silent:
    a stand-in for a daemon that the test can close (gone) or close and bind again (still there)."""

    def __init__(self, path: Path) -> None:
        self.path, self.codec, self.ctx = path, Codec(), zmq.Context()
        self.generates = threading.Event()
        self._stop = threading.Event()
        self._sock = self._bind()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _bind(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self.path}")
        return sock

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            peer, payload = self._sock.recv_multipart()
            message = self.codec.decode_client(payload)
            if isinstance(message, Hello):
                self._sock.send_multipart([peer, self.codec.encode(Welcome(message.id, PROTOCOL_VERSION, "fake"))])
            elif isinstance(message, Generate):
                self._sock.send_multipart([peer, self.codec.encode(Tokens(message.id, (1,), "a"))])
                self.generates.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)

    def restart(self) -> None:
        """Close the ROUTER (its connections go) and bind a new one on the same path."""
        self.close()
        self._stop.clear()
        self._sock = self._bind()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()


# --- 1. a socket another user could have planted -------------------------------------------------
def _planted(directory: Path) -> zmq.Socket[bytes]:
    """A listener in `directory`, as another user's fake daemon would be."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{directory / 'ember.sock'}")
    return sock


@root_only
def test_someone_elses_socket_directory_is_refused_and_gets_nothing(short_dir: Path) -> None:
    d = short_dir / "ember-1000"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    listener = _planted(d)
    try:
        with pytest.raises(UntrustedSocket, match=rf"refusing to connect to {d}/ember.sock: {d} belongs to uid {NOBODY}"):
            Client(d / "ember.sock")
        with pytest.raises(UntrustedSocket, match=f"belongs to uid {NOBODY}"):
            asyncio.run(AsyncClient(d / "ember.sock").connect())
        assert not listener.poll(300)  # not even a Hello reached it
    finally:
        listener.close()


def test_a_socket_directory_others_may_write_is_refused(short_dir: Path) -> None:
    d = short_dir / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    listener = _planted(d)
    try:
        with pytest.raises(UntrustedSocket, match=r"is writable by others \(mode 0777\)"):
            Client(d / "ember.sock")
        os.chmod(d, 0o770)
        with pytest.raises(UntrustedSocket, match=r"is writable by its group \(mode 0770\)"):
            Client(d / "ember.sock")
        assert not listener.poll(300)
    finally:
        listener.close()


def test_a_symlinked_socket_directory_is_refused(short_dir: Path) -> None:
    (short_dir / "real").mkdir(mode=0o700)
    (short_dir / "link").symlink_to(short_dir / "real")
    with pytest.raises(UntrustedSocket, match="is a symbolic link"):
        Client(short_dir / "link" / "ember.sock")


def test_a_socket_directory_of_ones_own_is_used(short_dir: Path) -> None:
    (short_dir / "run").mkdir(mode=0o700)
    fake = FakeDaemon(short_dir / "run" / "ember.sock")
    try:
        with Client(fake.path, connect_timeout=5.0) as client:
            assert client.server == "fake"
    finally:
        fake.close()


# --- 4. every failure is an EmberError --------------------------------------------------------------
# run without the root's power to read anything (CAP_DAC_OVERRIDE), as a user the directory keeps out
UNREACHABLE = """
import os, sys
from ember.client import Client
from ember.client.errors import EmberError
try:
    Client(sys.argv[1] if len(sys.argv) > 1 else None)
except EmberError as e:
    print(type(e).__name__, isinstance(e.__cause__, PermissionError), e)
"""


@root_only
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root's capabilities")
def test_a_socket_directory_one_may_not_enter_is_a_daemon_unavailable(short_dir: Path) -> None:
    d = short_dir / "run"
    d.mkdir()
    _planted(d).close()
    os.chmod(d, 0o050)  # the owner (root, trusted) may not enter: only its group may
    drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    explicit = subprocess.run([*drop, sys.executable, "-c", UNREACHABLE, str(d / "ember.sock")], capture_output=True,
                              text=True, timeout=60, env=env)
    assert explicit.stdout.startswith("DaemonUnavailable True cannot reach the ember daemon at"), explicit
    assert "permission denied" in explicit.stdout and "Traceback" not in explicit.stderr
    # the default path: the first candidate (a service's RuntimeDirectory) cannot be looked into
    default = subprocess.run([*drop, sys.executable, "-c", UNREACHABLE], capture_output=True, text=True, timeout=60,
                             env={**env, "RUNTIME_DIRECTORY": str(d)})
    assert default.returncode == 0 and "Traceback" not in default.stderr, default
    assert default.stdout.split()[0] in ("DaemonUnavailable", "UntrustedSocket"), default


def test_a_lone_surrogate_is_a_bad_request(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        with pytest.raises(BadRequest, match="cannot encode the Generate request") as refused:
            client.generate("\ud800")
        assert isinstance(refused.value.__cause__, UnicodeEncodeError)
        with pytest.raises(BadRequest) as refused:
            client.tokenize("a\udcffb")
        assert isinstance(refused.value.__cause__, UnicodeEncodeError)
        with pytest.raises(BadRequest):
            client.generate("x", max_tokens=2**70)  # beyond msgpack's integers
        assert client.health().status == "ok"  # nothing was sent; the connection is fine


@pytest.mark.asyncio
async def test_a_lone_surrogate_is_a_bad_request_async(daemon) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(daemon.socket) as client:
        with pytest.raises(BadRequest) as refused:
            await client.generate("\ud800").text()
        assert isinstance(refused.value.__cause__, UnicodeEncodeError)
        assert (await client.health()).status == "ok"


# --- 5. nothing over the frame limit is sent ---------------------------------------------------------
def test_a_10mb_prompt_is_refused_naming_size_and_limit(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        t0 = time.monotonic()
        # the limit the daemon announced in its Welcome (the shared test daemon takes 1 MiB messages)
        with pytest.raises(LimitExceeded, match=r"is 100000\d\d bytes, over the daemon's limit of 1048576 bytes"):
            client.generate("x" * 10_000_000)
        assert time.monotonic() - t0 < 2.0
        assert client.health().status == "ok"  # the connection was never dropped


@pytest.mark.asyncio
async def test_a_10mb_prompt_is_refused_async(daemon) -> None:  # type: ignore[no-untyped-def]
    async with AsyncClient(daemon.socket) as client:
        with pytest.raises(LimitExceeded, match="over the daemon's limit"):
            await client.generate("x" * 10_000_000).text()
        assert (await client.health()).status == "ok"


def test_a_frame_over_a_lower_daemon_limit_fails_at_once(daemon) -> None:  # type: ignore[no-untyped-def]
    """The shared daemon takes 1 MiB frames and says so in its Welcome: the SDK refuses a 2 MiB prompt
    before sending it, and the connection stays up."""
    with Client(daemon.socket, timeout=30.0) as client:
        t0 = time.monotonic()
        with pytest.raises(LimitExceeded) as failed:
            client.generate("x" * (2 << 20), max_tokens=1).text()
        assert time.monotonic() - t0 < 5.0
        assert "max_message_bytes" in str(failed.value) and client.health().status == "ok"


# --- 2. a daemon that dies -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_killed_daemon_ends_streams_within_5s_and_new_clients_fail_fast() -> None:
    d = DaemonProcess().wait_ready()
    try:
        sync_client = Client(d.socket)
        sync_stream = sync_client.generate("x", max_tokens=30000, ignore_eos=True)
        next(sync_stream)
        outcome: dict[str, object] = {}

        def read_sync() -> None:
            try:
                for _ in sync_stream:
                    pass
            except EmberError as e:
                outcome["error"] = e
            outcome["at"] = time.monotonic()

        async with AsyncClient(d.socket) as async_client:
            async_stream = async_client.generate("y", max_tokens=30000, ignore_eos=True)
            await async_stream.__anext__()
            reader = threading.Thread(target=read_sync)
            reader.start()
            killed = time.monotonic()
            d.proc.kill()
            with pytest.raises(DaemonUnavailable, match="went away") as failed:
                async for _ in async_stream:
                    pass
            assert not isinstance(failed.value, ConnectionLost)
            assert time.monotonic() - killed < 5.0
            await asyncio.to_thread(reader.join, 30)
        sync_client.close()
        assert isinstance(outcome.get("error"), DaemonUnavailable) and "went away" in str(outcome["error"])
        assert float(outcome["at"]) - killed < 5.0  # type: ignore[arg-type]

        assert d.socket.exists()  # the dead daemon's socket file: stale
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="nothing listens on its socket file"):
            Client(d.socket, connect_timeout=30.0)
        with pytest.raises(DaemonUnavailable, match="nothing listens on its socket file"):
            await AsyncClient(d.socket, connect_timeout=30.0).connect()
        assert time.monotonic() - t0 < 5.0
    finally:
        d.stop()


def test_a_daemon_gone_and_a_connection_dropped_are_told_apart(short_dir: Path) -> None:
    (short_dir / "run").mkdir(mode=0o700)
    fake = FakeDaemon(short_dir / "run" / "ember.sock")
    try:
        with Client(fake.path) as client:
            stream = client.generate("x")
            assert next(stream).text == "a"  # the frame before the connection broke is delivered
            fake.restart()  # something listens again: this connection was dropped, its requests with it
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost, match="still running, cancelled this request"):
                next(stream)
            assert time.monotonic() - t0 < 5.0
            with pytest.raises(StopIteration):
                next(stream)  # the stream is over
            assert next(client.generate("y")).text == "a"  # the client reconnected by itself
            stream = client.generate("z")
            next(stream)
            fake.close()  # and now nothing listens
            with pytest.raises(DaemonUnavailable, match="went away") as failed:
                next(stream)
            assert not isinstance(failed.value, ConnectionLost)
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable, match="no ember daemon"):
                client.health()  # sent while nothing listens: fails at the next connect attempt
            assert time.monotonic() - t0 < 5.0
    finally:
        fake.close()


@pytest.mark.asyncio
async def test_a_daemon_gone_and_a_connection_dropped_are_told_apart_async(short_dir: Path) -> None:
    (short_dir / "run").mkdir(mode=0o700)
    fake = FakeDaemon(short_dir / "run" / "ember.sock")
    try:
        async with AsyncClient(fake.path) as client:
            stream = client.generate("x")
            assert (await stream.__anext__()).text == "a"
            await asyncio.to_thread(fake.restart)
            with pytest.raises(ConnectionLost, match="still running, cancelled this request"):
                await stream.__anext__()
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            stream = client.generate("z")
            await stream.__anext__()
            await asyncio.to_thread(fake.close)
            with pytest.raises(DaemonUnavailable, match="went away") as failed:
                await stream.__anext__()
            assert not isinstance(failed.value, ConnectionLost)
            with pytest.raises(DaemonUnavailable, match="no ember daemon"):
                await client.health()
    finally:
        fake.close()


# --- 3. a client stopped for a few seconds ---------------------------------------------------------------
STOPPED_CLIENT = """
import sys
from ember.client import Client
from ember.client.errors import EmberError
stream = Client(sys.argv[1]).generate("x", max_tokens=2000, ignore_eos=True)
next(stream)
print("streaming", flush=True)
try:
    for _ in stream:
        pass
    print("finished", flush=True)
except EmberError as e:
    print(type(e).__name__, flush=True)
"""


def test_a_client_stopped_for_4s_gets_a_clear_answer_at_once(daemon) -> None:  # type: ignore[no-untyped-def]
    """The daemon drops a connection that misses its heartbeats (3 s in daemon/server/server.py) and
    cancels its requests: the resumed client says so at once, never a generic timeout 30 s later.
    (With a daemon that waits longer for a stopped client, the stream simply finishes.)"""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_CLIENT, str(daemon.socket)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "streaming"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(4.0)
        proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        outcome = proc.stdout.readline().strip()
        assert outcome in ("ConnectionLost", "finished"), outcome
        assert time.monotonic() - resumed < 10.0 if outcome == "ConnectionLost" else True
    finally:
        proc.kill()
        proc.wait()


# --- 6. the CLI: one line per failure ---------------------------------------------------------------------
def _cli(*args: str | bytes, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _one_line(out: subprocess.CompletedProcess[str], starts: str) -> None:
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(f"ember: error: {starts}"), out.stderr


def test_cli_serve_with_a_missing_model_is_one_line(short_dir: Path) -> None:
    out = _cli("serve", "--model", "/nonexistent.gguf", "--socket", str(short_dir / "run" / "ember.sock"))
    _one_line(out, "cannot load model: /nonexistent.gguf: no such file or directory")


def test_cli_client_failures_are_one_line(short_dir: Path) -> None:
    _one_line(_cli("generate", "hi", "--socket", str(short_dir / "none" / "ember.sock")), "no ember daemon at")
    _one_line(_cli("status", "--socket", str(short_dir / "none" / "ember.sock")), "no ember daemon at")
    (short_dir / "open").mkdir()
    os.chmod(short_dir / "open", 0o777)
    _one_line(_cli("chat", "--socket", str(short_dir / "open" / "ember.sock"), "--wait", "5"), "refusing to connect")


def test_cli_generate_error_starts_on_its_own_line(daemon) -> None:  # type: ignore[no-untyped-def]
    # stdout and stderr into one pipe, as on a terminal
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    out = subprocess.run([*CLI, "generate", "hello", "--model", "no-such-model", "--socket", str(daemon.socket)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, env=env)
    assert out.returncode == 1
    assert out.stdout.startswith("hello\nember: error: ") and "no-such-model" in out.stdout, out.stdout
    assert "Traceback" not in out.stdout


def test_cli_generate_with_an_unencodable_prompt_is_one_line(daemon) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    out = subprocess.run([*CLI, "generate", b"\xff", "--socket", str(daemon.socket)], capture_output=True, text=True,
                         timeout=60, env=env)
    _one_line(out, "cannot encode the Generate request")


@pytest.mark.asyncio
async def test_a_reader_cancelled_as_its_frame_comes_stays_cancelled() -> None:
    # a gateway handler is cancelled when its HTTP client leaves; on Python 3.11 asyncio.wait_for
    # returned a frame that came in the same loop pass and dropped the cancel, so the handler read on and
    # its request was never cancelled in the daemon (seen under load in CI)
    client = AsyncClient("/nonexistent/ember.sock")
    client._queues[7] = queue = asyncio.Queue()
    reader = asyncio.create_task(client._next_for(7))
    await asyncio.sleep(0)  # the reader waits on its queue
    queue.put_nowait(Tokens(7, (1,), "a"))
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert queue.qsize() == 1  # the frame stays for whoever reads next


@root_only
@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_reconnection_to_an_impostor_is_refused_before_anything_is_sent() -> None:
    """Issue 38: after the daemon stops, another user puts a listener at the socket path (its directory
    made writable: the attacker's way in); the clients' reconnections reach it, and are refused before
    anything is sent (the directory fails the trust check again, and the listener is not the daemon's
    user): the next call raises UntrustedSocket, and the impostor receives not one frame."""
    daemon = DaemonProcess().wait_ready(300)  # its socket directory: the test's own
    path = daemon.socket
    sync_client, async_client = Client(path), await AsyncClient(path).connect()
    try:
        sync_client.stats()
        await async_client.stats()
        daemon.stop()
        for parent in path.parents[1:3]:
            parent.chmod(parent.stat().st_mode | 0o111)
        path.parent.chmod(0o777)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the impostor
            frames = 0
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                ctx = zmq.Context()
                sock = ctx.socket(zmq.ROUTER)
                sock.bind(f"ipc://{path}")
                os.write(write, b"bound")
                while sock.poll(4000):
                    frames += len(sock.recv_multipart())
            finally:
                os._exit(min(frames, 100))
        os.read(read, 5)
        with pytest.raises(UntrustedSocket, match="refusing the connection"):
            sync_client.stats()
        with pytest.raises(UntrustedSocket, match="refusing the connection"):
            await async_client.stats()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0  # not one frame reached it
    finally:
        sync_client.close()
        await async_client.close()


def test_a_reconnection_must_reach_the_daemons_user(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PeerCheck: the first connection's user is the daemon's; a later one to another user's listener,
    or into a directory that no longer passes the trust check, is refused, and so is every one after."""
    from ember.client import request_builder

    d = short_dir / "run"
    d.mkdir(mode=0o700)
    users = iter([os.geteuid(), os.geteuid(), NOBODY, os.geteuid()])
    monkeypatch.setattr(request_builder, "peer_uid", lambda fd: next(users))
    check = request_builder.PeerCheck(d / "ember.sock")
    assert check.connected(3) is None and check.connected(3) is None and check.uid == os.geteuid()
    assert f"runs as uid {NOBODY}, not as the daemon's uid {os.geteuid()}" in (check.connected(3) or "")
    assert check.problem is not None
    os.chmod(d, 0o777)
    assert "writable by others" in (request_builder.PeerCheck(d / "ember.sock").connected(3) or "")
