"""AsyncClient: the asyncio SDK, with the same methods as Client (awaitable ones where Client blocks).

    async with AsyncClient() as c:
        stream = c.generate("def fib(n):", max_tokens=64)
        async for chunk in stream:
            print(chunk.text, end="")
        print(stream.finished.reason)

One reader task receives every frame and sorts it into the queue of its request, so any number of
tasks may share one AsyncClient. It also reads the socket's monitor: as in Client, a broken connection
ends the requests in flight with DaemonUnavailable or ConnectionLost, after the frames that came before.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

import ember
from ember.client.errors import DaemonUnavailable, EmberError, EmberTimeout, UntrustedSocket
from ember.client.request_builder import (MONITOR_EVENTS, Chunk, HeldSlots, LogitsReader, Lost, PeerCheck, chunk_from,
                                          configure, daemon_address, encode, end_of_stream, expect, generate_message,
                                          lost_connection, message_limit, unreachable)
from ember.protocol.codec import Codec, ProtocolError
from ember.protocol.endpoint import client_socket_path
from ember.protocol.messages import (PROTOCOL_VERSION, Cancel, ChatMessage, Detokenize, Error, Finished, Health,
                                     HealthStatus, Hello, Hold, ListModels, ModelInfo, Models, Ping,
                                     ServerMessage, Stats, StatsReport, Text, TokenIds, Tokenize, Tokens, Welcome,
                                     Wire)


class AsyncClient:
    def __init__(self, socket_path: str | Path | None = None, *, timeout: float = 30.0,
                 connect_timeout: float = 5.0) -> None:
        """Nothing happens until `await client.connect()` or `async with client`."""
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._codec = Codec()
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[ServerMessage | Lost]] = {}
        self._pending: set[int] = set()  # requests sent whose last frame has not come
        self._heard = time.monotonic()
        self._max_message = message_limit(None)
        self._connected = False  # libzmq holds a connection that PeerCheck let through
        self._peer = PeerCheck(self.socket_path)
        self._address = ""
        self._changed: asyncio.Event | None = None  # set at each connection, refusal or failed connect
        self._unreachable: Lost | None = None  # nothing listens at the path (from a failed connect)
        self._later = 0  # sends waiting for a connection: later ones queue behind them, in order
        self._send_lock: asyncio.Lock | None = None
        self._reader = LogitsReader()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.server = ""
        self.welcome_models: tuple[ModelInfo, ...] = ()

    async def connect(self) -> AsyncClient:
        if self._sock is not None:
            return self
        address = self._address = daemon_address(self.socket_path)
        self._changed, self._send_lock = asyncio.Event(), asyncio.Lock()
        self._ctx = zmq.asyncio.Context()
        # every socket of it, the monitor's too, drops what it has not sent when closed: a client
        # collected unclosed must not make Context.term() wait on a daemon that is gone
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._sock = self._ctx.socket(zmq.DEALER)
        configure(self._sock, self.timeout)
        self._monitor = self._sock.get_monitor_socket(MONITOR_EVENTS)
        self._sock.connect(address)
        self._task = asyncio.create_task(self._read())
        try:
            await self._until_connected(self.connect_timeout)
            welcome = await self._call(Hello(self._next_id(), PROTOCOL_VERSION, f"ember-sdk/{ember.__version__}"),
                                       Welcome, self.connect_timeout)
        except EmberTimeout:
            await self.close()
            raise DaemonUnavailable(f"no answer from an ember daemon at {self.socket_path} "
                                    f"within {self.connect_timeout:g} s") from None
        except BaseException:
            await self.close()
            raise
        self.server, self.welcome_models = welcome.server, welcome.models
        self._max_message = message_limit(welcome)
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._sock.disable_monitor()
            assert self._monitor is not None
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = self._monitor = None
        self._reader.close()

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests ----------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **options: Any) -> AsyncStream:
        """Start a completion (sent now); iterate the stream with `async for`. Options as Client.generate."""
        return self._start(generate_message(self._next_id(), prompt, **options))

    def chat(self, messages: Sequence[Mapping[str, str] | ChatMessage], **options: Any) -> AsyncStream:
        return self._start(generate_message(self._next_id(), messages=messages, **options))

    async def tokenize(self, text: str, *, model: str | None = None, add_special: bool = True) -> list[int]:
        return list((await self._call(Tokenize(self._next_id(), text, model or "", add_special), TokenIds)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, model: str | None = None) -> str:
        return (await self._call(Detokenize(self._next_id(), tuple(int(t) for t in token_ids), model or ""), Text)).text

    async def models(self) -> list[ModelInfo]:
        return list((await self._call(ListModels(self._next_id()), Models)).models)

    async def health(self) -> HealthStatus:
        return await self._call(Health(self._next_id()), HealthStatus)

    async def stats(self) -> StatsReport:
        return await self._call(Stats(self._next_id()), StatsReport)

    # --- plumbing ----------------------------------------------------------------------------------
    def _next_id(self) -> int:
        return next(self._ids)

    def _start(self, message: Any) -> AsyncStream:
        return AsyncStream(self, message.id, self._send_request(message))

    async def _call(self, message: Any, kind: type[Any], timeout: float | None = None) -> Any:
        try:
            await self._send_request(message)
            return expect(await self._next_for(message.id, timeout), kind)
        finally:
            self._forget(message.id)

    def _send_request(self, message: Any) -> asyncio.Future[Any]:
        """Send a message that gets answers, with a queue for them (none if it could not be sent)."""
        payload = encode(self._codec, message, self._max_message)
        sent = self._send_payload(payload)
        self._queues[message.id] = asyncio.Queue()
        self._pending.add(message.id)
        return sent

    def _send(self, message: Wire) -> asyncio.Future[Any]:
        return self._send_payload(encode(self._codec, message, self._max_message))

    def _send_payload(self, payload: bytes) -> asyncio.Future[Any]:
        """Sends now when a checked connection takes it (pyzmq tries at once); the future says when it
        went. Without one, the send waits for it (_until_connected), and so do the sends after it."""
        if self._sock is None:
            raise EmberError("not connected: use `async with AsyncClient()` or `await client.connect()`")
        if self._peer.problem is not None:
            raise UntrustedSocket(self._peer.problem)
        if self._connected and not self._later and not self._events_waiting():
            future: asyncio.Future[Any] = self._sock.send(payload)  # type: ignore[assignment]
            return future
        self._later += 1
        return asyncio.ensure_future(self._send_later(payload))

    def _events_waiting(self) -> bool:
        """The monitor has news the reader task has not taken yet (a disconnection, a connection)."""
        assert self._monitor is not None
        return bool(self._monitor.get(zmq.EVENTS) & zmq.POLLIN)

    async def _send_later(self, payload: bytes) -> Any:
        try:
            assert self._send_lock is not None and self._sock is not None
            async with self._send_lock:  # tasks made in order take it in order
                waited = time.monotonic() + 1.0
                while self._events_waiting() and time.monotonic() < waited:  # the reader judges them first
                    await asyncio.sleep(0.001)
                await self._until_connected(self.timeout)
                return await self._sock.send(payload)
        finally:
            self._later -= 1

    async def _until_connected(self, timeout: float) -> None:
        """A connection PeerCheck let through: what libzmq queues while it has none would go to whatever
        listens at the path next. UntrustedSocket once one was refused, DaemonUnavailable when nothing
        listens, EmberTimeout after `timeout` seconds of neither."""
        assert self._changed is not None
        deadline = time.monotonic() + timeout
        while not self._connected:
            if self._peer.problem is not None:
                raise UntrustedSocket(self._peer.problem)
            if self._unreachable is not None:
                lost, self._unreachable = self._unreachable, None
                lost.raise_()
            self._changed.clear()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._changed.wait()
            except TimeoutError:
                raise EmberTimeout(f"no connection to the daemon at {self.socket_path} for {timeout:g} s") from None

    def _forget(self, request_id: int) -> None:
        self._queues.pop(request_id, None)
        self._pending.discard(request_id)

    async def _next_for(self, request_id: int, timeout: float | None = None) -> ServerMessage:
        timeout = self.timeout if timeout is None else timeout
        queue = self._queues[request_id]
        since = time.monotonic()
        while True:
            left = timeout - (time.monotonic() - max(since, self._heard))
            if left <= 0:
                raise EmberTimeout(f"nothing from the daemon at {self.socket_path} for {timeout:g} s")
            try:
                # not asyncio.wait_for: on Python 3.11 it returns a frame that came in the same loop pass
                # as a cancel and drops the cancel (a gateway handler cancelled by a vanished client
                # then ran on, its request never cancelled in the daemon)
                async with asyncio.timeout(left):
                    reply = await queue.get()
            except TimeoutError:
                continue  # silence for us, but maybe not from the daemon: re-check against _heard
            if isinstance(reply, Lost):
                queue.put_nowait(reply)  # left in place: every later read says the same
                reply.raise_()
            return reply

    async def _read(self) -> None:
        """The reader task: frames into their queues, monitor events into the requests' fate."""
        assert self._sock is not None and self._monitor is not None
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if self._sock in ready:
                self._read_available()
            if self._monitor in ready:
                await self._read_events()

    def _read_available(self) -> None:
        assert self._sock is not None
        while True:
            try:
                payload = self._sock.recv(zmq.NOBLOCK).result()  # pyzmq answers a NOBLOCK recv at once
            except zmq.Again:
                return
            self._heard = time.monotonic()
            try:
                message = self._codec.decode_server(payload)
            except ProtocolError:
                continue
            if isinstance(message, Ping) or message.id is None:
                continue
            queue = self._queues.get(message.id)
            if queue is not None:
                queue.put_nowait(message)
                if not isinstance(message, Tokens):
                    self._pending.discard(message.id)  # its last frame

    async def _read_events(self) -> None:
        """As Client._read_events; the socket probes run in a thread, the loop goes on."""
        assert self._monitor is not None
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK).result()
            except zmq.Again:
                return
            message = parse_monitor_message(frames)
            event = message["event"]
            # the requests in flight now: those sent while a probe runs are not judged by it
            in_flight = set(self._pending)
            assert self._changed is not None and self._sock is not None
            if event == zmq.EVENT_CONNECTED:
                problem = self._peer.connected(int(message["value"]))
                if problem is not None:
                    self._sock.disconnect(self._address)  # nothing more goes there
                    self._lose(Lost(UntrustedSocket, problem), in_flight)
                else:
                    self._connected, self._unreachable = True, None
                self._changed.set()
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._read_available()
                in_flight = set(self._pending)
                if in_flight:
                    self._lose(await asyncio.to_thread(lost_connection, self.socket_path), in_flight)
            elif event == zmq.EVENT_CONNECT_RETRIED and not self._connected:
                lost = await asyncio.to_thread(unreachable, self.socket_path)
                if lost is not None:
                    self._lose(lost, in_flight)
                    self._unreachable = lost  # for the sends (and a connect) waiting on a connection
                    self._changed.set()

    def _lose(self, lost: Lost, request_ids: set[int]) -> None:
        for request_id in request_ids & self._pending:  # not those whose last frame came meanwhile
            self._queues[request_id].put_nowait(lost)
            self._pending.discard(request_id)

    def _release(self, request_id: int, held: HeldSlots) -> None:
        if self._sock is not None:
            for release in self._reader.releases(request_id, held):
                self._send(release).add_done_callback(_quiet)

    def _finish_stream(self, request_id: int) -> None:
        self._forget(request_id)


class AsyncStream:
    """As client.Stream, for `async for`."""

    def __init__(self, client: AsyncClient, request_id: int, sent: asyncio.Future[Any]) -> None:
        self._client = client
        self.id = request_id
        self._sent: asyncio.Future[Any] | None = sent
        self.finished: Finished | None = None
        self._held = HeldSlots()
        self._done = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        self._client._release(self.id, self._held)
        self._held = HeldSlots()
        if self._sent is not None:
            sent, self._sent = self._sent, None
            await sent
        if self._done:
            raise StopAsyncIteration
        try:
            reply = await self._client._next_for(self.id)
        except DaemonUnavailable:  # the connection took the stream with it: nothing more will come
            self._done = True
            self._client._finish_stream(self.id)
            raise
        if isinstance(reply, Tokens):
            self._held = HeldSlots.of(reply)
            return chunk_from(reply, self._client._reader)
        self._done = True
        self._client._finish_stream(self.id)
        if isinstance(reply, Finished):
            self.finished = reply
        end_of_stream(reply if isinstance(reply, (Finished, Error)) else Error(self.id, "bad_message", repr(reply)))
        raise StopAsyncIteration

    async def text(self) -> str:
        return "".join([chunk.text async for chunk in self])

    def cancel(self) -> None:
        if not self._done and self._client._sock is not None:
            self._client._send(Cancel(self.id)).add_done_callback(_quiet)

    def hold(self, held: bool = True) -> None:
        """Tell the daemon that this stream's output cannot be taken now (held) or can again: it stops
        running the request, letting others have its place, and resumes it where it was."""
        if not self._done and self._client._sock is not None:
            self._client._send(Hold(self.id, held)).add_done_callback(_quiet)

    async def close(self) -> None:
        self.cancel()
        async for _ in self:
            pass


def _quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed fire-and-forget send is not worth a warning
