"""The daemon's public socket: a relay in front of the ROUTER that checks each connection's ZMTP
stream as it arrives.

libzmq takes every frame of a multi-part message into the connection's pipe and hands the message
over only once its last frame has come: ZMQ_MAXMSGSIZE bounds one frame and RCVHWM counts whole
messages, so 127 frames of 4 MiB that never end held 504 MiB of the daemon's memory for as long as the
connection lived (issue 38). No socket option bounds that. So clients never reach libzmq directly: the
front listens on the public socket itself, reads each client's bytes header by header as they arrive,
and passes them on to the ROUTER, which listens on a private socket beside it (`router_path`, in a
0700 directory).
Bytes go through as they come; the relay holds no message, only what its transports buffer.

Client to daemon, what it checks (ZMTP 3.0/3.1, https://rfc.zeromq.org/spec/37/):
- the greeting: ZMTP 3 or later, the NULL mechanism (the ROUTER's);
- the READY command: at most READY_BYTES; a PEER_PROPERTY the client sent is dropped and the relay
  adds its own, the client's "uid:gid:pid" from SO_PEERCRED (the ROUTER's Peer-Address would name the
  relay: server.peer_credentials reads this instead);
- every later frame: no reserved flag bit, a command at most COMMAND_BYTES, a message (frames joined
  by "more") at most max_message_bytes and MAX_FRAMES frames in all, counted as its headers arrive.
A connection that breaks one is closed on both sides: to the daemon, the client has left.
Daemon to client is passed through unread.

Flow control: writes to one side past HIGH_WATER pause reading from the other; reads from the ROUTER
are of CHUNK bytes at most, and the relay's sockets have small send buffers. A client that does not
read backs up into libzmq's pipe (SNDHWM), where the Outbox sees it, about as soon as it did without
the relay; a client that writes faster than the daemon reads waits in its own socket buffer.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import resource
import socket
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import uvloop

from ember.daemon.logging_setup import get_logger
from ember.protocol.endpoint import MAX_PATH_BYTES

__all__ = ["PEER_PROPERTY", "MAX_FRAMES", "ZmtpRelay", "ZmtpChecker", "RelayRefused", "router_path",
           "private_router_dir"]

PEER_PROPERTY = "X-Ember-Peer"  # "uid:gid:pid" of the client behind the relay, in its READY
MAX_FRAMES = 64  # frames of one message: ember's messages are one frame each, an Error answers a few
READY_BYTES = 8192  # the READY command (Socket-Type, Identity and the client's own metadata)
COMMAND_BYTES = 1024  # any later command (PING, PONG, ERROR: tens of bytes)
# What the relay may hold of a connection's bytes: a read of at most CHUNK, HIGH_WATER waiting to be
# written before the other side's reads pause, and its sockets' kernel send buffers. Small, so that it
# adds little to the buffers between a client and the ROUTER: the ROUTER's own pipe and socket buffer
# are what the Outbox's backpressure counts on (a client that stopped reading had its requests paused
# after ~2000 tokens; with 256 KiB here they ran on to their 4000).
CHUNK = 8 << 10  # a read from the ROUTER; from a client (whose bytes only the ROUTER's pipe holds up) CLIENT_CHUNK
CLIENT_CHUNK = 64 << 10
HIGH_WATER = 8 << 10
SEND_BUFFER = 8 << 10

_GREETING = 64  # signature (10), version (2), mechanism (20), as-server (1), filler (31)
_MORE, _LONG, _COMMAND = 1, 2, 4
_NULL = b"NULL".ljust(20, b"\x00")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RelayRefused(Exception):
    """A client's stream broke a rule: the connection is closed."""


def router_path(socket_path: Path) -> Path:
    """Where the ROUTER listens behind the relay: `r` in a hidden directory beside the public socket,
    named after it (libzmq's bind replaces a socket that a killed daemon left)."""
    directory = socket_path.with_name(f".{socket_path.name}.d")
    if len(os.fsencode(directory / "r")) > MAX_PATH_BYTES:
        directory = socket_path.with_name("." + hashlib.sha1(os.fsencode(socket_path.name)).hexdigest()[:8])
    return directory / "r"


def private_router_dir(socket_path: Path) -> Path:
    """router_path's directory, made (or found) 0700 and this user's: the public socket's directory may
    let a group in (0750), and a client that reached the ROUTER directly could claim any PEER_PROPERTY.
    A directory rather than the socket's mode: libzmq creates the socket with the umask, a moment
    before anyone could chmod it."""
    directory = router_path(socket_path).parent
    directory.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{directory} is not a directory of this user's: "
                              "refusing to put the ROUTER's socket there")
    os.chmod(directory, 0o700)
    return directory


class ZmtpChecker:
    """One client's ZMTP stream, checked incrementally: feed() the bytes as they arrive, get back the
    bytes to pass on (the same, but for the READY command, rewritten), or RelayRefused. After READY
    only frame headers are read, in place."""

    def __init__(self, peer: str, max_message_bytes: int) -> None:
        """peer: the PEER_PROPERTY value to announce for this client."""
        self._peer = peer.encode()
        self._max_message = max_message_bytes
        self._greeting = bytearray()
        self._ready = False  # READY has been passed on
        self._pending = bytearray()  # an unfinished frame header (or READY command)
        self._body_left = 0  # bytes of the current frame still to pass on
        self._frames = 0  # frames of the current message so far
        self._message_bytes = 0

    def feed(self, data: bytes) -> list[bytes | memoryview]:
        if self._ready:  # from here on what passes is what came: only the headers are read
            self._scan(data, 0)
            return [data]
        out: list[bytes | memoryview] = []
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end and not self._ready:
            if len(self._greeting) < _GREETING:
                # passed on byte by byte as it comes: libzmq sends its signature, then waits for the peer's
                take = view[pos:pos + _GREETING - len(self._greeting)]
                self._greeting += take
                pos += len(take)
                self._check_greeting()
                out.append(take)
            else:
                pos = self._header(view, pos, end, out)
        if pos < end:
            self._scan(data, pos)
            out.append(view[pos:])
        return out

    def _scan(self, data: bytes, pos: int) -> None:
        """Check every frame header in data[pos:] (the frames' bodies are skipped)."""
        end = len(data)
        while pos < end:
            if self._body_left:
                take = min(self._body_left, end - pos)
                pos += take
                self._body_left -= take
            elif self._pending or end - pos < 9:  # a header that may be cut short: byte by byte
                pos = self._header(memoryview(data), pos, end, None)
            else:
                flags = data[pos]
                if flags & _LONG:
                    size, pos = int.from_bytes(data[pos + 1:pos + 9], "big"), pos + 9
                else:
                    size, pos = data[pos + 1], pos + 2
                self._frame(flags, size)

    def _check_greeting(self) -> None:
        g = self._greeting
        if g[0] != 0xFF or (len(g) >= 10 and g[9] & 1 == 0):
            raise RelayRefused("not a ZMTP 3 greeting")
        if len(g) >= 11 and g[10] < 3:
            raise RelayRefused(f"ZMTP {g[10]} is not spoken here (3 or later)")
        if len(g) >= 32 and bytes(g[12:32]) != _NULL:
            raise RelayRefused("only the NULL security mechanism is spoken here")

    def _header(self, view: memoryview, pos: int, end: int, out: list[bytes | memoryview] | None) -> int:
        """Read a frame header from view[pos:end] (with what an earlier call left in _pending) and check
        it -> the new position; a header cut short waits in _pending. Before READY it is READY's."""
        have = self._pending
        need = 1 if not have else (9 if have[0] & _LONG else 2)
        while len(have) < need and pos < end:
            have.append(view[pos])
            pos += 1
            if len(have) == 1:
                need = 9 if have[0] & _LONG else 2
        if len(have) < need:
            return pos
        flags = have[0]
        size = int.from_bytes(have[1:need], "big")
        if not self._ready:
            assert out is not None
            if flags & ~(_MORE | _LONG | _COMMAND):
                raise RelayRefused(f"reserved frame flags set ({flags:#x})")
            return self._ready_command(view, pos, end, flags, size, out)
        self._pending = bytearray()
        self._frame(flags, size)
        return pos

    def _frame(self, flags: int, size: int) -> None:
        """A frame's header, after READY: its rules, and its body's size to skip."""
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise RelayRefused(f"reserved frame flags set ({flags:#x})")
        if flags & _COMMAND:
            if flags & _MORE or size > COMMAND_BYTES:
                raise RelayRefused(f"a command of {size} bytes" + (" marked 'more'" if flags & _MORE else ""))
        else:
            self._frames += 1
            self._message_bytes += size
            if self._message_bytes > self._max_message:
                raise RelayRefused(f"a message over {self._max_message} bytes")
            if self._frames > MAX_FRAMES:
                raise RelayRefused(f"a message of more than {MAX_FRAMES} frames")
            if not flags & _MORE:
                self._frames = self._message_bytes = 0
        self._body_left = size

    def _ready_command(self, view: memoryview, pos: int, end: int, flags: int, size: int,
                       out: list[bytes | memoryview]) -> int:
        """The first command after the greeting, READY, taken whole into _pending and passed on with
        this client's PEER_PROPERTY in place of any it sent."""
        if not flags & _COMMAND or flags & _MORE or size > READY_BYTES:
            raise RelayRefused("the greeting must be followed by a READY command")
        head = 9 if flags & _LONG else 2
        take = min(head + size - len(self._pending), end - pos)
        self._pending += view[pos:pos + take]
        pos += take
        if len(self._pending) < head + size:
            return pos
        out.append(self._ready_frame(bytes(self._pending[head:])))
        self._pending = bytearray()
        self._ready = True
        return pos

    def _ready_frame(self, body: bytes) -> bytes:
        if body[:6] != b"\x05READY":
            raise RelayRefused("the greeting must be followed by a READY command")
        kept = [body[:6]]
        at = 6
        while at < len(body):
            name_size = body[at]
            if at + 1 + name_size + 4 > len(body):
                raise RelayRefused("a malformed READY command")
            name = body[at + 1:at + 1 + name_size]
            value_size = int.from_bytes(body[at + 1 + name_size:at + 5 + name_size], "big")
            stop = at + 5 + name_size + value_size
            if stop > len(body):
                raise RelayRefused("a malformed READY command")
            if name.lower() != PEER_PROPERTY.lower().encode():
                kept.append(body[at:stop])
            at = stop
        name = PEER_PROPERTY.encode()
        kept.append(bytes([len(name)]) + name + struct.pack(">I", len(self._peer)) + self._peer)
        ready = b"".join(kept)
        if len(ready) <= 255:
            return bytes([_COMMAND, len(ready)]) + ready
        return bytes([_COMMAND | _LONG]) + struct.pack(">Q", len(ready)) + ready


class _Side(asyncio.BufferedProtocol):
    """One end of a relayed connection: what it receives goes to the other end, `chunk` bytes a read."""

    def __init__(self, link: _Link, receive: Callable[[bytes], None], chunk: int) -> None:
        self._link, self._receive = link, receive
        self._buffer = bytearray(chunk)
        self.transport: asyncio.Transport | None = None
        self.lost = False  # closed, what it had buffered written or dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's are no asyncio.Transport)
        transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[attr-defined]
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        if self is self._link.client:
            self._link.relay.opening(self._link)

    def get_buffer(self, sizehint: int) -> bytearray:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._receive(bytes(memoryview(self._buffer)[:nbytes]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._link.side_lost(self)

    def pause_writing(self) -> None:  # this end's writes are backed up: stop reading the other
        self._link.other(self).pause()

    def resume_writing(self) -> None:
        self._link.other(self).resume()

    def pause(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def write(self, chunks: list[bytes | memoryview]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(chunks)


class _Link:
    """A client's connection and the relay's connection to the ROUTER for it."""

    def __init__(self, relay: ZmtpRelay) -> None:
        self.relay = relay
        self.client = _Side(self, self._from_client, CLIENT_CHUNK)
        self.router = _Side(self, self._from_router, CHUNK)
        self.checker: ZmtpChecker | None = None
        # the client's bytes before its ROUTER connection is up (reading stops once open() runs; uvloop
        # may read before that even where connection_made pauses it)
        self.early: list[bytes] = []
        self.closed = False

    def other(self, side: _Side) -> _Side:
        return self.router if side is self.client else self.client

    async def open(self) -> None:
        """Called once the client is accepted: learn who it is, then connect to the ROUTER for it."""
        transport = self.client.transport
        assert transport is not None
        try:
            pid, uid, gid = _peer_credentials(transport)
            self.checker = ZmtpChecker(f"{uid}:{gid}:{pid}", self.relay.max_message_bytes)
            transport.pause_reading()
            await asyncio.get_running_loop().create_unix_connection(lambda: self.router, str(self.relay.router))
        except OSError as e:
            self.relay.log.warning("relay: cannot reach the router", error=str(e))
            self.close()
            return
        if self.closed:  # the client left while the ROUTER connection was made
            self.router.transport.close()  # type: ignore[union-attr]
            return
        early, self.early = self.early, []
        for data in early:
            self._from_client(data)
        self.client.resume()

    def _from_client(self, data: bytes) -> None:
        if self.closed:
            return
        if self.checker is None or self.router.transport is None:
            self.early.append(data)
            return
        try:
            chunks = self.checker.feed(data)
        except RelayRefused as e:
            self.relay.log.info("client stream refused: connection closed", reason=str(e))
            self.relay.refused += 1
            self.close()
            return
        self.router.write(chunks)

    def _from_router(self, data: bytes) -> None:
        if not self.closed:
            self.client.write([data])

    def close(self) -> None:
        """The client left or broke a rule: nothing more of it goes to the ROUTER. The client's end
        closes; the ROUTER's is only shut for writing, and closes once libzmq has read that end (half_close)."""
        if self.closed:
            return
        self.closed = True
        if self.client.transport is not None:
            self.client.transport.close()
        if self.router.transport is None or self.router.lost:
            self.relay.links.discard(self)
        else:
            half_close(self.router.transport)

    def side_lost(self, side: _Side) -> None:
        self.close()  # the ROUTER's end lost first (libzmq dropped it): so goes the client
        if side is self.router:  # the link's last end
            self.relay.links.discard(self)


def half_close(transport: asyncio.Transport) -> None:
    """Shut a ROUTER connection for writing (after what waits to be written), reading on until libzmq
    closes it.

    Closing it outright can abort the daemon: libzmq 4.3.5 (and master, 2026) asserts `!_io_error` in
    stream_engine_base.cpp's out_event when a peer hangs up while the connection's input is stopped (its
    pipe full: RCVHWM) and the next heartbeat PING is due. The hang-up marks the engine's I/O error to
    be dealt with once input restarts; the heartbeat timer writes before that. 400,000 junk messages
    and a close half a second later aborted the daemon each time. A write shutdown raises no hang-up,
    only end-of-file, which libzmq reads once its input runs again (or its heartbeat timeout ends the
    connection), and then it closes the connection as for any client that left."""
    transport.resume_reading()  # to see libzmq's close; what it still sends is dropped
    if transport.can_write_eof():
        transport.write_eof()
    else:  # not a stream socket: no half-close to be had
        transport.close()


def _more_descriptors() -> None:
    """Each client costs the front two descriptors (its connection and the relay's to the ROUTER), where
    it cost libzmq one: the soft limit goes up to the hard one (1024, a common default, held ~500)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):  # above the kernel's nr_open: keep what there is
            pass


def _peer_credentials(transport: asyncio.Transport) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket transport (SO_PEERCRED)."""
    fd = transport.get_extra_info("socket").fileno()
    with socket.socket(fileno=os.dup(fd)) as sock:
        return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


class ZmtpRelay:
    """The public socket's listener: one _Link per client, to the ROUTER at `router`, on an event loop
    of its own in a thread of its own. On the front's loop, every relayed frame waited for whatever that
    loop was doing: beside a flood of 100,000 fuzzed frames a bystander completed 1.0 requests a second
    instead of 5.6 (benchmarks/fuzz_daemon.py)."""

    def __init__(self, public: Path, router: Path, max_message_bytes: int) -> None:
        self.public, self.router, self.max_message_bytes = public, router, max_message_bytes
        self.links: set[_Link] = set()
        self.refused = 0  # connections closed for a broken rule
        self.log = get_logger()
        self._server: asyncio.AbstractServer | None = None
        self._opening: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen on the public socket (made by the time this returns), relaying in the thread."""
        _more_descriptors()
        ready, failed = threading.Event(), []

        def run() -> None:
            loop = self._loop = uvloop.new_event_loop()
            try:
                self._server = loop.run_until_complete(loop.create_unix_server(self._accept, str(self.public)))
            except BaseException as e:  # noqa: BLE001  (raised again in start's thread)
                failed.append(e)
                loop.close()
                return
            finally:
                ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="ember-relay", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def _accept(self) -> asyncio.Protocol:
        link = _Link(self)
        self.links.add(link)
        return link.client

    def opening(self, link: _Link) -> None:
        """A client's transport is up: connect to the ROUTER for it."""
        task = asyncio.get_running_loop().create_task(link.open())
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    def close(self, grace: float) -> None:
        """Stop accepting, close every connection (what they have buffered is written first, for at most
        `grace` seconds), unlink the public socket and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._close(grace), loop).result(grace + 10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    async def _close(self, grace: float) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._opening):
            task.cancel()
        sides = [s for link in list(self.links) for s in (link.client, link.router) if s.transport is not None]
        for link in list(self.links):
            link.close()
        deadline = asyncio.get_running_loop().time() + grace
        while not all(s.lost for s in sides) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for s in sides:
            if not s.lost:
                s.transport.abort()  # type: ignore[union-attr]
        try:
            self.public.unlink()
        except FileNotFoundError:
            pass
