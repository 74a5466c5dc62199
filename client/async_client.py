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
from ember.client.errors import DaemonUnavailable, EmberError, EmberTimeout
from ember.client.request_builder import (MONITOR_EVENTS, Chunk, Lost, chunk_from, configure, daemon_address, encode,
                                          end_of_stream, expect, generate_message, lost_connection, message_limit,
                                          unreachable)
from ember.protocol.codec import Codec, ProtocolError
from ember.protocol.endpoint import client_socket_path
from ember.protocol.messages import (PROTOCOL_VERSION, Cancel, ChatMessage, Detokenize, Error, Finished, Health,
                                     HealthStatus, Hello, Hold, ListModels, ModelInfo, Models, Ping, Release,
                                     ServerMessage, Stats, StatsReport, Text, TokenIds, Tokenize, Tokens, Welcome,
                                     Wire)
from ember.protocol.shm_ring import ShmRingReader


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
        self._connected = False
        self._reader = ShmRingReader()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.server = ""
        self.welcome_models: tuple[ModelInfo, ...] = ()

    async def connect(self) -> AsyncClient:
        if self._sock is not None:
            return self
        address = daemon_address(self.socket_path)
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
        """Sends now when the socket takes it (pyzmq tries at once); the future says when it went."""
        if self._sock is None:
            raise EmberError("not connected: use `async with AsyncClient()` or `await client.connect()`")
        future: asyncio.Future[Any] = self._sock.send(payload)  # type: ignore[assignment]
        return future

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
            event = parse_monitor_message(frames)["event"]
            # the requests in flight now: those sent while a probe runs are not judged by it
            in_flight = set(self._pending)
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._read_available()
                in_flight = set(self._pending)
                if in_flight:
                    self._lose(await asyncio.to_thread(lost_connection, self.socket_path), in_flight)
            elif event == zmq.EVENT_CONNECT_RETRIED and in_flight and not self._connected:
                lost = await asyncio.to_thread(unreachable, self.socket_path)
                if lost is not None:
                    self._lose(lost, in_flight)

    def _lose(self, lost: Lost, request_ids: set[int]) -> None:
        for request_id in request_ids & self._pending:  # not those whose last frame came meanwhile
            self._queues[request_id].put_nowait(lost)
            self._pending.discard(request_id)

    def _release(self, request_id: int, slots: list[int]) -> None:
        if slots and self._sock is not None:
            self._send(Release(request_id, tuple(slots))).add_done_callback(_quiet)

    def _finish_stream(self, request_id: int) -> None:
        self._forget(request_id)


class AsyncStream:
    """As client.Stream, for `async for`."""

    def __init__(self, client: AsyncClient, request_id: int, sent: asyncio.Future[Any]) -> None:
        self._client = client
        self.id = request_id
        self._sent: asyncio.Future[Any] | None = sent
        self.finished: Finished | None = None
        self._held: list[int] = []
        self._done = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        self._client._release(self.id, self._held)
        self._held = []
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
            self._held = [slot.slot for slot in reply.logits or ()]
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
