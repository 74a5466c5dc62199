"""One replica of a cluster deployment: an ember daemon and its gateway on one Ray node, and the relay
that carries the ingress's HTTP requests to that gateway.

What runs where: Ray Serve places the replica's actor on a node with the CPUs (and GPUs) it asks for.
The actor starts `ember serve` (the daemon, its socket in a private directory) and `ember gateway` on a
loopback port it bound itself, both as children that end when it does (cluster/daemon_child.py). The
ingress's requests reach `relay`, which sends them to that gateway and streams the answer back: its
head (status and headers) first, then the body as the gateway writes it. So every API the gateway
speaks (OpenAI, Responses, Ollama) works through the cluster as it does on one machine, and nothing
but loopback ever reaches the daemon.

A replica whose daemon or gateway exits fails its health check, and Serve replaces it; a replica
stopped by Serve (scaling down, a redeploy) stops its children, which drain what they carry, and
removes its directory. A SIGKILLed one cannot: the next replica to start on its node sweeps it.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import NoReturn
from pathlib import Path

import aiohttp
import msgspec

from ember.client.async_client import AsyncClient
from ember.protocol.endpoint import lock_path

# headers that describe one HTTP connection, not the answer: never relayed
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "date", "server",
                         "upgrade", "proxy-connection", "te", "trailer"})
STOP_GRACE = 35.0  # seconds the children may drain after SIGTERM (the gateway's shutdown_timeout and more)
HEALTH_TIMEOUT = 5.0
DIR_PREFIX, SOCKET_NAME = "ember-replica-", "ember.sock"
STALE_AFTER = 3600.0  # seconds: a replica directory with no daemon lock yet is a start that died
COALESCE = 0.05  # seconds between a relayed answer's pieces at least (Ray Serve LLM batches its streams by 50 ms too)


class Forward(msgspec.Struct, frozen=True):
    """One HTTP request, as the ingress hands it to a replica."""

    method: str
    path: str  # with its query string
    headers: list[tuple[str, str]]
    body: bytes


class Head(msgspec.Struct, frozen=True):
    """The first item of a relayed answer: the gateway's status and headers, and who answered."""

    status: int
    headers: list[tuple[str, str]]
    replica: str


class ReplicaStats(msgspec.Struct, frozen=True):
    replica: str
    node: str
    pid: int  # the replica's actor
    daemon_pid: int
    stats: dict[str, object]  # the daemon's StatsReport


class ReplicaStartError(RuntimeError):
    """The replica's daemon or gateway did not start; the message has the end of its log."""


class EmberReplica:
    def __init__(self, daemon_args: list[str], daemon_config: str = "", threads: int = 1,
                 start_timeout: float = 600.0) -> None:
        self.replica = _replica_id()
        sweep_stale_dirs(Path(tempfile.gettempdir()))
        self._dir = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))  # 0700: the daemon's socket directory
        self.socket = self._dir / SOCKET_NAME
        self._log = open(self._dir / "children.log", "ab")  # noqa: SIM115 -- the children write to it for life
        config = ["--config", daemon_config] if daemon_config else []
        self._daemon = self._start("serve", "--socket", str(self.socket), "--threads", str(threads),
                                   "--log-format", "json", *config, *daemon_args)
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._gateway = self._start("gateway", "--socket", str(self.socket), "--listen-fd", str(listener.fileno()),
                                    "--log-format", "json", pass_fds=(listener.fileno(),))
        listener.close()  # the gateway holds it now
        self._session: aiohttp.ClientSession | None = None
        self._wait_ready(start_timeout)

    # --- the requests ------------------------------------------------------------------------------
    async def relay(self, key: str, payload: bytes) -> AsyncIterator[bytes]:
        """The gateway's answer to one request (`key`: its routing text, read by the router alone):
        an encoded Head, then the body's bytes as they come. A vanished ingress cancels this, which
        closes the connection to the gateway, which cancels the request in the daemon."""
        request = msgspec.msgpack.decode(payload, type=Forward)
        async with self._client().request(request.method, self.url + request.path, data=request.body,
                                          headers=request.headers, allow_redirects=False) as response:
            headers = [(str(k), v) for k, v in response.headers.items() if k.lower() not in HOP_HEADERS]
            yield msgspec.msgpack.encode(Head(response.status, headers, self.replica))
            async for chunk in coalesced(response.content, COALESCE):
                yield chunk

    async def stats(self, replica: str | None = None) -> bytes:
        """This replica's daemon's counters (`replica`: the router's pin, see prefix_router.py)."""
        async with AsyncClient(self.socket, timeout=HEALTH_TIMEOUT) as client:
            report = await client.stats()
        counters = {k: v for k, v in msgspec.structs.asdict(report).items() if k != "id"}
        return msgspec.json.encode(ReplicaStats(self.replica, _node_id(), os.getpid(), self._daemon.pid, counters))

    async def check_health(self) -> None:
        """Serve's health check: a child that exited, or a gateway that says the daemon is down, fails it
        (and Serve replaces the replica)."""
        exited = self._exited()
        if exited is not None:
            raise RuntimeError(exited)
        async with self._client().get(self.url + "/health", timeout=aiohttp.ClientTimeout(HEALTH_TIMEOUT)) as r:
            if r.status != 200:
                raise RuntimeError(f"the replica's gateway answers /health with {r.status}: {await r.text()}")

    def __del__(self) -> None:
        """Serve stops the replica: its children drain and exit (SIGKILL past the grace period)."""
        children = [p for p in (getattr(self, "_gateway", None), getattr(self, "_daemon", None)) if p is not None]
        for p in children:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for p in children:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if hasattr(self, "_dir"):
            shutil.rmtree(self._dir, ignore_errors=True)  # the socket's directory and the children's log

    # --- the children ------------------------------------------------------------------------------
    def _start(self, *args: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.pop("EMBER_API_KEY", None)  # the replica's gateway listens on loopback for the relay alone
        return subprocess.Popen([sys.executable, "-m", "ember.cluster.daemon_child", *args], stdin=subprocess.DEVNULL,
                                stdout=self._log, stderr=subprocess.STDOUT, pass_fds=pass_fds, env=env)

    def _wait_ready(self, timeout: float) -> None:
        """Until the gateway says the daemon is ok; ReplicaStartError if a child exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self._exited()
            if exited is not None:
                self._fail(exited)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=HEALTH_TIMEOUT) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not yet listening, or 503 while the daemon loads
            time.sleep(0.1)
        self._fail(f"the replica's daemon was not ready after {timeout:.0f} s")

    def _exited(self) -> str | None:
        """Which child exited, and how (None: both run)."""
        for name, proc in (("daemon", self._daemon), ("gateway", self._gateway)):
            if proc.poll() is not None:
                return f"the replica's {name} exited with status {proc.returncode}"
        return None

    def _fail(self, why: str, tail: int = 4000) -> NoReturn:
        """Stop the children and raise ReplicaStartError with the end of their log (read first: the
        stop removes it)."""
        log = (self._dir / "children.log").read_bytes()[-tail:].decode(errors="replace")
        self.__del__()
        raise ReplicaStartError(f"{why}:\n{log}")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no total timeout: a stream lasts as long as it generates; the gateway bounds stalls
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10.0),
                                                  auto_decompress=False)
        return self._session


async def coalesced(content: aiohttp.StreamReader, window: float) -> AsyncIterator[bytes]:
    """`content`'s bytes, at most one piece per `window` seconds: what arrives sooner waits for the
    window's end and goes with what follows it. A token after a quiet spell (the first one, say) goes
    at once. Each piece a replica yields is a Ray object and a message to the ingress, ~0.4 ms of CPU
    between them: on the 2-core VM two replicas of the demo model made 0.62-0.73x one daemon's tokens/s
    with a piece per token (10 ms windows), 0.98-1.06x with 50 ms ones (benchmarks/cluster.py)."""
    loop = asyncio.get_running_loop()
    pending, last = b"", -window
    while True:
        timeout = max(0.0, last + window - loop.time()) if pending else None
        try:
            chunk = await asyncio.wait_for(content.readany(), timeout)
        except TimeoutError:  # the window ended: what waited goes now
            yield pending
            pending, last = b"", loop.time()
            continue
        if not chunk:
            break
        pending += chunk
        if loop.time() >= last + window:
            yield pending
            pending, last = b"", loop.time()
    if pending:
        yield pending


def sweep_stale_dirs(parent: Path) -> list[Path]:
    """Remove the directories of this user's replicas that died without stopping (SIGKILLed: nothing ran
    their __del__): those whose daemon's socket lock nobody holds. A directory without a lock yet is
    a replica starting now, left alone unless STALE_AFTER seconds old. What was removed."""
    removed = []
    for d in parent.glob(DIR_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.geteuid():
                continue
            lock = lock_path(d / SOCKET_NAME)
            if lock.exists():
                with open(lock, "a") as f:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live daemon holds it
            elif time.time() - d.stat().st_mtime < STALE_AFTER:
                continue
        except (BlockingIOError, FileNotFoundError, PermissionError):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 -- outside Serve (made directly, as a test does): the process names it
        return f"pid{os.getpid()}"


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
