"""AsyncClient: the asyncio SDK, with the same methods as Client (awaitable ones where Client blocks).

    async with AsyncClient() as c:
        stream = c.generate("def fib(n):", max_tokens=64)
        async for chunk in stream:
            print(chunk.text, end="")
        print(stream.finished.reason)

One reader task receives every frame and sorts it into the queue of its request, so any number of
tasks may share one AsyncClient.
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

import ember
from ember.client.errors import DaemonUnavailable, EmberError, EmberTimeout
from ember.client.request_builder import Chunk, chunk_from, end_of_stream, expect, generate_message
from ember.protocol.codec import Codec, ProtocolError
from ember.protocol.endpoint import client_socket_path, ipc_address
from ember.protocol.messages import (PROTOCOL_VERSION, Cancel, ChatMessage, Detokenize, Error, Finished, Health,
                                     HealthStatus, Hello, ListModels, ModelInfo, Models, Ping, Release, ServerMessage,
                                     Stats, StatsReport, Text, TokenIds, Tokenize, Tokens, Welcome, Wire)
from ember.protocol.shm_ring import ShmRingReader


class AsyncClient:
    def __init__(self, socket_path: str | Path | None = None, *, timeout: float = 30.0,
                 connect_timeout: float = 5.0) -> None:
        """Nothing happens until `await client.connect()` or `async with client`."""
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._codec = Codec()
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[ServerMessage]] = {}
        self._heard = time.monotonic()
        self._reader = ShmRingReader()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.server = ""
        self.welcome_models: tuple[ModelInfo, ...] = ()

    async def connect(self) -> AsyncClient:
        if self._sock is not None:
            return self
        if not self.socket_path.exists():
            raise DaemonUnavailable(f"no ember daemon at {self.socket_path} (start one with `ember serve`)")
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # no ZMQ_IMMEDIATE: with it, libzmq discards frames not yet read when the daemon
        # disconnects, and a daemon that shuts down sends its last Finished frames just before that
        self._sock.connect(ipc_address(self.socket_path))
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
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = None
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
        self._queues[message.id] = asyncio.Queue()
        return AsyncStream(self, message.id, self._send(message))

    async def _call(self, message: Any, kind: type[Any], timeout: float | None = None) -> Any:
        self._queues[message.id] = asyncio.Queue()
        try:
            await self._send(message)
            return expect(await self._next_for(message.id, timeout), kind)
        finally:
            self._queues.pop(message.id, None)

    def _send(self, message: Wire) -> asyncio.Future[Any]:
        """Sends now when the socket takes it (pyzmq tries at once); the future says when it went."""
        if self._sock is None:
            raise EmberError("not connected: use `async with AsyncClient()` or `await client.connect()`")
        future: asyncio.Future[Any] = self._sock.send(self._codec.encode(message))  # type: ignore[assignment]
        return future

    async def _next_for(self, request_id: int, timeout: float | None = None) -> ServerMessage:
        timeout = self.timeout if timeout is None else timeout
        queue = self._queues[request_id]
        since = time.monotonic()
        while True:
            left = timeout - (time.monotonic() - max(since, self._heard))
            if left <= 0:
                raise EmberTimeout(f"nothing from the daemon at {self.socket_path} for {timeout:g} s")
            try:
                return await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                continue  # silence for us, but maybe not from the daemon: re-check against _heard

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            payload = await self._sock.recv()
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

    def _release(self, request_id: int, slots: list[int]) -> None:
        if slots and self._sock is not None:
            self._send(Release(request_id, tuple(slots))).add_done_callback(_quiet)

    def _finish_stream(self, request_id: int) -> None:
        self._queues.pop(request_id, None)


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
        reply = await self._client._next_for(self.id)
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

    async def close(self) -> None:
        self.cancel()
        async for _ in self:
            pass


def _quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed fire-and-forget send is not worth a warning
