"""Outbox: every frame the daemon sends goes through here, and here vanished clients are found.

The ROUTER socket has ZMQ_ROUTER_MANDATORY set, so a send never blocks and never drops silently:
- it goes out;
- EAGAIN: that client's pipe is full (it does not read). The frame waits in the peer's backlog, the
  engine pauses the peer's requests once the backlog reaches `high_water`, and resumes them when it is
  empty again. Stream frames are never dropped; other replies beyond `hard_cap` are (a client that
  floods requests without reading their answers gets no more answers, and no more memory);
- EHOSTUNREACH: the connection is gone. The peer is dead: `on_dead` cancels its requests.
A vanished client with nothing being sent to it is found by probing: a Ping to each quiet peer with work
every probe interval, and at once when the socket monitor reports a disconnection (libzmq ends the pipe
of a dead process immediately on ipc://, and after the ZMTP heartbeat timeout if it hangs).
"""
from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from ember.daemon.logging_setup import get_logger
from ember.daemon.server.peers import Peer, Peers
from ember.protocol.codec import Codec
from ember.protocol.messages import Ping, ServerMessage

_FLUSH_FIRST, _FLUSH_MAX = 0.002, 0.05  # seconds between retries of a full pipe (backing off)


class _Sent(enum.Enum):
    OK = 1
    FULL = 2
    GONE = 3


class Outbox:
    def __init__(self, sock: zmq.asyncio.Socket, codec: Codec, peers: Peers, *,
                 on_dead: Callable[[Peer], None], set_paused: Callable[[bytes, bool], None],
                 high_water: int = 64, hard_cap: int = 1024) -> None:
        self._sock, self._codec, self._peers = sock, codec, peers
        self._on_dead, self._set_paused = on_dead, set_paused
        self._high_water, self._hard_cap = high_water, hard_cap
        self._flush_handle: asyncio.TimerHandle | None = None
        self._flush_delay = _FLUSH_FIRST
        self._ping = codec.encode(Ping())
        self.dropped = 0  # non-stream replies dropped at hard_cap
        self.log = get_logger()

    def send(self, identity: bytes, message: ServerMessage, stream: bool) -> None:
        """Send now or queue; `stream` frames (Tokens, Finished, a Generate's Error) are never dropped."""
        payload = self._codec.encode(message)
        peer = self._peers.get(identity)
        if peer is None:  # a one-off reply to a connection we keep nothing for
            self._try(identity, payload)
            return
        if peer.dead:
            return
        if peer.backlog:
            self._queue(peer, payload, stream)
            return
        result = self._try(identity, payload)
        if result is _Sent.OK:
            peer.last_sent = time.monotonic()
        elif result is _Sent.FULL:
            self._queue(peer, payload, stream)
        else:
            self._died(peer)

    @property
    def backlogged(self) -> bool:
        return any(p.backlog for p in self._peers if not p.dead)

    def probe(self, quiet_for: float = 0.0) -> None:
        """Ping every live peer with work that nothing was sent to for `quiet_for` seconds."""
        now = time.monotonic()
        for peer in self._peers:
            if peer.dead or peer.backlog or not peer.has_work or now - peer.last_sent < quiet_for:
                continue
            result = self._try(peer.identity, self._ping)
            if result is _Sent.GONE:
                self._died(peer)
            elif result is _Sent.OK:
                peer.last_sent = now

    def flush(self) -> None:
        """Retry backlogs (called on a timer while any exists)."""
        self._flush_handle = None
        for peer in self._peers:
            while peer.backlog and not peer.dead:
                result = self._try(peer.identity, peer.backlog[0])
                if result is _Sent.FULL:
                    break
                if result is _Sent.GONE:
                    self._died(peer)
                    break
                peer.backlog.popleft()
                peer.last_sent = time.monotonic()
            if not peer.backlog and peer.paused and not peer.dead:  # a dead peer's requests are being dropped
                peer.paused = False
                self._set_paused(peer.identity, False)
            self._peers.forget_if_idle(peer)
        if self.backlogged:
            self._flush_delay = min(self._flush_delay * 2, _FLUSH_MAX)
            self._schedule_flush()
        else:
            self._flush_delay = _FLUSH_FIRST

    def close(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None

    def _queue(self, peer: Peer, payload: bytes, stream: bool) -> None:
        if not stream and len(peer.backlog) >= self._hard_cap:
            self.dropped += 1
            return
        peer.backlog.append(payload)
        if len(peer.backlog) >= self._high_water and not peer.paused:
            peer.paused = True
            self._set_paused(peer.identity, True)
            self.log.info("client not reading: its requests are paused", client=peer.name)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(self._flush_delay, self.flush)

    def _died(self, peer: Peer) -> None:
        if not peer.dead:
            peer.dead = True
            peer.backlog.clear()
            self._on_dead(peer)

    def _try(self, identity: bytes, payload: bytes) -> _Sent:
        # DONTWAIT: pyzmq's async socket then sends synchronously and returns a finished future
        future = self._sock.send_multipart([identity, payload], flags=zmq.DONTWAIT)
        error = future.exception() if future.done() else None
        if error is None:
            return _Sent.OK
        if isinstance(error, zmq.Again):
            return _Sent.FULL
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            return _Sent.GONE
        raise error
