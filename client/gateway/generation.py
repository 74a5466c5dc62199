"""One chat or text completion carried through the daemon: a slot from the pool, the Generate, its frames
turned into OpenAI's answer (whole, or as server-sent events), and its end — in every case.

- Errors before the first token (busy, unknown model, a bad value, no daemon) are HTTP errors: the
  gateway waits for the stream's first frame before it sends a status line.
- After that, a failure becomes the stream's last event (OpenAI's `data: {"error": ...}`, no [DONE]).
- A client that goes away (aiohttp cancels the handler: handler_cancellation) or reads nothing for
  `stall_timeout` seconds has its request cancelled in the daemon at once; the pool slot comes back
  when the daemon confirms (a background drain), so the daemon's per-connection count stays right.
- Finish reasons: the daemon's `stop` and `length` are OpenAI's; `cancelled`, which this gateway did not
  ask for, means the daemon is shutting down or dropped the connection: a 503.
"""
from __future__ import annotations

import asyncio
import socket
import time
from contextvars import ContextVar
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from ember.client.async_client import AsyncClient, AsyncStream
from ember.client.errors import EmberError, EmberTimeout
from ember.client.gateway.connection_pool import ConnectionPool, Lease
from ember.client.gateway.errors import UNAVAILABLE, ApiError, from_ember
from ember.client.gateway.metrics import GatewayMetrics
from ember.client.gateway.request_translation import Translated
from ember.client.gateway.response_format import AnswerFormat, Choice, TokenScore, total_usage
from ember.client.gateway.token_texts import TokenTexts
from ember.client.request_builder import Chunk
from ember.protocol.messages import Finished, FinishReason

# bytes queued in the kernel and the transport beyond which the next write may wait on the client
WRITE_HIGH_WATER = 64 * 1024
SEND_BUFFER = 64 * 1024  # an HTTP stream's socket send buffer (the kernel doubles it)
HOLD_BYTES = 16 * 1024  # unsent beyond it, a stream is held in the daemon until the client reads
HOLD_POLL = 0.02  # seconds between looks at a held stream's unsent bytes
DRAIN_TIMEOUT = 30.0  # seconds a cancelled request's last frame may take to come (then the slot is freed)
CLIENT_GONE = 499  # the metrics' status for a request whose client left first (nginx's convention)
# how a streamed request really ended, when its status line (200) no longer can say: read by the request
# counter (app.py), which runs in the same task (each request's handler has a context of its own)
STREAM_STATUS: ContextVar[int | None] = ContextVar("ember_gateway_stream_status", default=None)


T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client closed its connection, or read nothing for stall_timeout seconds."""


@dataclass
class Carrier:
    """What every generation shares: the pool, the token texts, the metrics, the settings."""

    pool: ConnectionPool
    texts: TokenTexts
    metrics: GatewayMetrics
    default_max_tokens: int
    stall_timeout: float
    drains: set[asyncio.Task[None]] = field(default_factory=set)  # cancelled streams awaiting their end


class DaemonStream:
    """An AsyncStream that remembers whether its last frame came (then nothing is left to cancel)."""

    def __init__(self, stream: AsyncStream) -> None:
        self.stream, self.ended = stream, False

    async def next(self) -> Chunk | None:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            self.ended = True
            return None
        except EmberTimeout:
            raise  # the daemon said nothing for a while: the request may still be alive there
        except EmberError:
            self.ended = True  # an Error frame, a failed generation, or the connection gone
            raise


async def carry(request: web.Request, carrier: Carrier, t: Translated, fmt: AnswerFormat,
                arrived: float) -> web.StreamResponse:
    """Answer one generation request, its t.n choices each a Generate of its own (raises ApiError for an
    HTTP error before anything was sent: any choice's refusal refuses the request)."""
    leases: list[Lease] = []
    streams: list[DaemonStream] = []
    try:
        # each prompt's first choice, then (once its first token is out, so that its prompt's KV blocks
        # are in the daemon's prefix cache) the prompt's other choices, which reuse them
        order = sorted(range(t.choices), key=lambda i: i % t.n != 0)
        started: dict[int, DaemonStream] = {}
        firsts_of: dict[int, Chunk | None] = {}
        for phase in (order[: len(order) // t.n], order[len(order) // t.n:]):
            for i in phase:
                leases.append(await _acquire(carrier.pool))
                started[i] = DaemonStream(_start(leases[-1].client, t, i, carrier.default_max_tokens))
                streams.append(started[i])
            for i in phase:
                firsts_of[i] = await _first(started[i])
        ordered = [started[i] for i in range(t.choices)]  # `streams` stays in start order, beside `leases`
        firsts = [firsts_of[i] for i in range(t.choices)]
        if any(first is not None for first in firsts):
            carrier.metrics.ttft.observe(time.perf_counter() - arrived)
        if t.stream:
            return await _stream(request, carrier, t, fmt, ordered, firsts)
        return await _whole(carrier, t, fmt, ordered, firsts)
    finally:
        for i, lease in enumerate(leases):
            _settle(carrier, lease, streams[i] if i < len(streams) else None)
        carrier.metrics.duration.observe(time.perf_counter() - arrived)


async def _acquire(pool: ConnectionPool) -> Lease:
    try:
        return await pool.acquire()
    except EmberError as e:
        raise from_ember(e) from None


def _start(client: AsyncClient, t: Translated, i: int, default_max_tokens: int) -> AsyncStream:
    """Choice i's Generate."""
    max_tokens = t.max_tokens
    if max_tokens is None:  # OpenAI's default: as many as fit; the daemon ends at the context ("length")
        contexts = [m.context_length for m in client.welcome_models if m.name == t.model]
        max_tokens = min([default_max_tokens, *contexts])
    try:
        if t.messages is not None:
            return client.chat(t.messages, model=t.model, max_tokens=max_tokens, **t.choice(i))
        prompt = t.prompt_of(i)
        return client.generate(prompt if prompt is not None else "", model=t.model, max_tokens=max_tokens,
                               **t.choice(i))
    except EmberError as e:  # refused before sending: cannot encode, over the message size
        raise from_ember(e) from None


async def _first(stream: DaemonStream) -> Chunk | None:
    try:
        return await stream.next()
    except EmberError as e:
        raise from_ember(e) from None


async def _whole(carrier: Carrier, t: Translated, fmt: AnswerFormat, streams: list[DaemonStream],
                 firsts: list[Chunk | None]) -> web.Response:
    try:
        choices = await _together([_collect(carrier, t, stream, first) for stream, first in zip(streams, firsts)])
    except EmberError as e:
        raise from_ember(e) from None
    carrier.metrics.prompt_tokens.inc(total_usage([c[2] for c in choices], t.n).prompt_tokens)
    return web.Response(body=fmt.whole(choices, t.n), content_type="application/json")


async def _collect(carrier: Carrier, t: Translated, stream: DaemonStream, chunk: Chunk | None) -> Choice:
    """One choice whole: its text, its tokens' scores (if asked), how it finished."""
    texts: list[str] = []
    scores: list[TokenScore] | None = [] if t.logprobs is not None else None
    last = time.perf_counter()
    while chunk is not None:
        carrier.metrics.generation_tokens.inc(len(chunk.token_ids))
        texts.append(chunk.text)
        if scores is not None:
            scores.extend(await _scores(carrier.texts, t.model, chunk))
        chunk = await stream.next()
        last = _observe_gap(carrier.metrics, last, chunk)
    return "".join(texts), scores, _finished(stream.stream.finished)


async def _stream(request: web.Request, carrier: Carrier, t: Translated, fmt: AnswerFormat,
                  streams: list[DaemonStream], firsts: list[Chunk | None]) -> web.StreamResponse:
    response = web.StreamResponse(headers=fmt.stream_headers)
    await response.prepare(request)
    write = _Writer(request, response, carrier.stall_timeout, streams)
    try:
        try:
            finished = await _together([_events(carrier, t, fmt, i, stream, first, write)
                                        for i, (stream, first) in enumerate(zip(streams, firsts))])
            carrier.metrics.prompt_tokens.inc(total_usage(finished, t.n).prompt_tokens)
            if t.include_usage:
                await write(fmt.usage(total_usage(finished, t.n)))
            await write(fmt.end())
        except (EmberError, ApiError) as e:
            error = e if isinstance(e, ApiError) else from_ember(e)
            STREAM_STATUS.set(error.status)  # for the metrics: it failed, though its status line said 200
            await write(fmt.error(error.body()))
        await response.write_eof()
    except ClientGone:
        STREAM_STATUS.set(CLIENT_GONE)  # _settle cancels the requests in the daemon
    finally:
        write.close()
    return response


async def _events(carrier: Carrier, t: Translated, fmt: AnswerFormat, index: int, stream: DaemonStream,
                  chunk: Chunk | None, write: _Writer) -> Finished:
    """Choice `index` as it comes, to the end of its own events -> how it finished."""
    opening = fmt.opening(index)
    if opening:
        await write(opening)
    last = time.perf_counter()
    while chunk is not None:
        carrier.metrics.generation_tokens.inc(len(chunk.token_ids))
        if chunk.text or t.logprobs is not None:  # a frame whose text is held back and no logprobs: nothing
            scores = await _scores(carrier.texts, t.model, chunk) if t.logprobs is not None else None
            await write(fmt.delta(chunk.text, scores, index))
        chunk = await stream.next()
        last = _observe_gap(carrier.metrics, last, chunk)
    finished = _finished(stream.stream.finished)
    await write(fmt.closing(finished, index))
    return finished


async def _together(work: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The choices' coroutines side by side -> their results in order; the first to fail cancels the
    others and its exception is raised (one choice alone runs in this task)."""
    if len(work) == 1:
        return [await work[0]]
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _observe_gap(metrics: GatewayMetrics, last: float, chunk: Chunk | None) -> float:
    """The inter-token latency of `chunk` (one observation per token); returns now."""
    now = time.perf_counter()
    if chunk is not None and chunk.token_ids:
        gap = (now - last) / len(chunk.token_ids)
        for _ in chunk.token_ids:
            metrics.itl.observe(gap)
    return now


def _finished(finished: Finished | None) -> Finished:
    if finished is None or finished.reason not in (FinishReason.STOP, FinishReason.LENGTH):
        why = finished.message if finished is not None and finished.message else "it is shutting down or dropped " \
                                                                                  "the gateway's connection"
        raise ApiError(503, f"the ember daemon cancelled the request: {why}", UNAVAILABLE, code="cancelled")
    return finished


async def _scores(texts: TokenTexts, model: str, chunk: Chunk) -> list[TokenScore]:
    """The chunk's tokens with their log-probabilities and alternatives, named by text."""
    logprobs = chunk.logprobs or [0.0] * len(chunk.token_ids)
    tops = chunk.top_logprobs or [[] for _ in chunk.token_ids]
    ids = set(chunk.token_ids)
    for alternatives in tops:
        ids.update(token for token, _ in alternatives)
    try:
        names = await texts.texts(model, ids)
    except EmberError as e:
        raise from_ember(e) from None
    return [TokenScore(names[token], logprob, [(names[a], lp) for a, lp in top])
            for token, logprob, top in zip(chunk.token_ids, logprobs, tops)]


class _Writer:
    """Writes to the HTTP client; ClientGone when it left or reads nothing for `stall` seconds.

    A client that stops reading must not keep others from running: its socket's send buffer is kept
    small (SEND_BUFFER, where the kernel would grow it to megabytes), and once HOLD_BYTES wait unsent
    the request's streams are held in the daemon (protocol Hold: they give their places to others and
    keep what they have) until the client has read them; held for `stall` seconds, the connection is
    dropped and the requests cancelled."""

    def __init__(self, request: web.Request, response: web.StreamResponse, stall: float,
                 streams: list[DaemonStream]) -> None:
        self.request, self.response, self.stall, self.streams = request, response, stall, streams
        self._lock = asyncio.Lock()  # the choices of one request write in turn, each event whole
        self._watch: asyncio.Task[None] | None = None  # while the streams are held
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)

    async def __call__(self, data: bytes) -> None:
        async with self._lock:
            await self._write(data)
            transport = self.request.transport
            if self._watch is None and transport is not None and transport.get_write_buffer_size() >= HOLD_BYTES:
                self._hold(True)
                self._watch = asyncio.create_task(self._until_read(transport))

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    def _hold(self, held: bool) -> None:
        for stream in self.streams:
            if not stream.ended:
                stream.stream.hold(held)

    async def _until_read(self, transport: asyncio.BaseTransport) -> None:
        """Held: resume once the client has read what waits; drop it after `stall` seconds of not."""
        deadline = time.monotonic() + self.stall
        while not transport.is_closing():
            if transport.get_write_buffer_size() < HOLD_BYTES // 4:  # type: ignore[attr-defined]
                self._watch = None
                self._hold(False)
                return
            if time.monotonic() > deadline:
                transport.abort()  # the handler is cancelled, and _settle cancels the requests
                return
            await asyncio.sleep(HOLD_POLL)

    async def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone("the client closed the connection")
        try:
            if transport.get_write_buffer_size() < WRITE_HIGH_WATER:
                await self.response.write(data)  # cannot wait on the client: no timer needed
            else:
                async with asyncio.timeout(self.stall):  # not wait_for: see AsyncClient._next_for
                    await self.response.write(data)
        except TimeoutError:
            transport.abort()  # not close(): that would wait to flush what the client does not read
            raise ClientGone(f"the client read nothing for {self.stall:g} s") from None
        except ConnectionError as e:
            raise ClientGone(f"the client closed the connection ({e})") from None


def _settle(carrier: Carrier, lease: Lease, stream: DaemonStream | None) -> None:
    """Give the pool slot back: now if the daemon is done with the request, else after cancelling it and
    reading its last frame (in the background: the handler may be cancelled)."""
    if stream is None or stream.ended:
        carrier.pool.release(lease)
        return
    stream.stream.cancel()

    async def drain() -> None:
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT):
                await stream.stream.close()
        except (EmberError, TimeoutError):
            pass  # gone or silent: its slot is free either way
        finally:
            carrier.pool.release(lease)

    task = asyncio.get_running_loop().create_task(drain())
    carrier.drains.add(task)
    task.add_done_callback(carrier.drains.discard)
