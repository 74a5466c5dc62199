"""Client: the synchronous SDK. One ZMQ DEALER connection to the daemon; many streams may be open on it
at once (frames are sorted by request id as they arrive). Like a ZMQ socket, a Client belongs to one
thread: use one per thread, or AsyncClient.

    with Client() as c:                            # the default socket (protocol/endpoint.py)
        stream = c.generate("def fib(n):", max_tokens=64)
        for chunk in stream:
            print(chunk.text, end="")
        print(stream.finished.reason)

Every failure is an EmberError (ember.client.errors). A socket monitor watches the connection: when it
breaks, the requests in flight end at once with DaemonUnavailable (the daemon is gone) or ConnectionLost
(it still listens and dropped this connection), after the frames that came before.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

import ember
from ember.client.errors import DaemonUnavailable, EmberTimeout, UntrustedSocket
from ember.client.request_builder import (MONITOR_EVENTS, Chunk, HeldSlots, LogitsReader, Lost, PeerCheck, chunk_from,
                                          configure, daemon_address, encode, end_of_stream, expect, generate_message,
                                          lost_connection, message_limit, unreachable)
from ember.protocol.codec import Codec, ProtocolError
from ember.protocol.endpoint import client_socket_path
from ember.protocol.messages import (PROTOCOL_VERSION, Cancel, ChatMessage, Detokenize, Error, Finished, Health,
                                     HealthStatus, Hello, Hold, ListModels, ModelInfo, Models, Ping,
                                     ServerMessage, Stats, StatsReport, Text, TokenIds, Tokenize, Tokens, Welcome,
                                     Wire)


class Client:
    def __init__(self, socket_path: str | Path | None = None, *, timeout: float = 30.0,
                 connect_timeout: float = 5.0) -> None:
        """Connect and greet the daemon. `timeout`: seconds of silence from the daemon after which a
        call raises EmberTimeout (a daemon with work for us pings us, so a slow request is not silence)."""
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self.timeout = timeout
        address = daemon_address(self.socket_path)
        self._codec = Codec()
        self._ids = itertools.count(1)
        self._inbox: dict[int, deque[ServerMessage | Lost]] = {}
        self._pending: set[int] = set()  # requests sent whose last frame has not come
        self._abandoned: list[tuple[int, HeldSlots]] = []  # streams dropped unfinished: cancel them
        self._heard = time.monotonic()
        self._max_message = message_limit(None)
        self._connected = False  # libzmq holds a connection that PeerCheck let through
        self._peer = PeerCheck(self.socket_path)
        self._retried = False  # a connect failed since the last connection (libzmq retries it)
        self._address = address
        self._reader = LogitsReader()
        self._ctx = zmq.Context()
        # every socket of it, the monitor's too, drops what it has not sent when closed: a client
        # collected unclosed must not make Context.term() wait on a daemon that is gone
        self._ctx.setsockopt(zmq.LINGER, 0)
        self._sock = self._ctx.socket(zmq.DEALER)
        configure(self._sock, timeout)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self._monitor = self._sock.get_monitor_socket(MONITOR_EVENTS)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._sock.connect(address)
        try:
            self._until_connected(connect_timeout)
            welcome = self._call(Hello(self._next_id(), PROTOCOL_VERSION, f"ember-sdk/{ember.__version__}"),
                                 Welcome, connect_timeout)
        except EmberTimeout:
            self.close()
            raise DaemonUnavailable(f"no answer from an ember daemon at {self.socket_path} "
                                    f"within {connect_timeout:g} s") from None
        except BaseException:
            self.close()
            raise
        self.server: str = welcome.server
        self.welcome_models: tuple[ModelInfo, ...] = welcome.models
        self._max_message = message_limit(welcome)

    # --- requests ----------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], **options: Any) -> Stream:
        """Start a completion of `prompt` (text or token ids); options as request_builder.generate_message
        (model, max_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_ids, return_logits, ...)."""
        return self._start(generate_message(self._next_id(), prompt, **options), options.get("return_logits", False))

    def chat(self, messages: Sequence[Mapping[str, str] | ChatMessage], **options: Any) -> Stream:
        """Start the assistant's reply to `messages` ([{"role": ..., "content": ...}]), rendered by the
        model's chat template."""
        return self._start(generate_message(self._next_id(), messages=messages, **options),
                           options.get("return_logits", False))

    def tokenize(self, text: str, *, model: str | None = None, add_special: bool = True) -> list[int]:
        return list(self._call(Tokenize(self._next_id(), text, model or "", add_special), TokenIds).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, model: str | None = None) -> str:
        return self._call(Detokenize(self._next_id(), tuple(int(t) for t in token_ids), model or ""), Text).text

    def models(self) -> list[ModelInfo]:
        return list(self._call(ListModels(self._next_id()), Models).models)

    def health(self) -> HealthStatus:
        return self._call(Health(self._next_id()), HealthStatus)

    def stats(self) -> StatsReport:
        return self._call(Stats(self._next_id()), StatsReport)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
        self._reader.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ----------------------------------------------------------------------------------
    def _next_id(self) -> int:
        return next(self._ids)

    def _start(self, message: Any, return_logits: bool) -> Stream:
        self._send_request(message)
        return Stream(self, message.id)

    def _call(self, message: Any, kind: type[Any], timeout: float | None = None) -> Any:
        try:
            self._send_request(message)
            return expect(self._next_for(message.id, timeout), kind)
        finally:
            self._forget(message.id)

    def _send_request(self, message: Any) -> None:
        """Send a message that gets answers, with a queue for them (none if it could not be sent)."""
        payload = encode(self._codec, message, self._max_message)
        self._inbox[message.id] = deque()
        self._pending.add(message.id)
        try:
            self._send_payload(payload)
        except BaseException:
            self._forget(message.id)
            raise

    def _send(self, message: Wire) -> None:
        self._send_payload(encode(self._codec, message, self._max_message))

    def _send_payload(self, payload: bytes) -> None:
        self._cancel_abandoned()
        self._until_connected()
        try:
            self._sock.send(payload)
        except zmq.Again:
            raise EmberTimeout(f"the daemon at {self.socket_path} takes no messages") from None
        except zmq.ZMQError as e:
            raise DaemonUnavailable(f"cannot send to the daemon at {self.socket_path}: {e}") from e

    def _forget(self, request_id: int) -> None:
        self._inbox.pop(request_id, None)
        self._pending.discard(request_id)

    def _next_for(self, request_id: int, timeout: float | None = None) -> ServerMessage:
        """The next frame for `request_id`, reading (and sorting) whatever arrives meanwhile."""
        timeout = self.timeout if timeout is None else timeout
        queue = self._inbox[request_id]
        since = time.monotonic()
        while not queue:
            left = timeout - (time.monotonic() - max(since, self._heard))
            if left <= 0:
                raise EmberTimeout(f"nothing from the daemon at {self.socket_path} for {timeout:g} s")
            ready = dict(self._poller.poll(left * 1000))
            if self._sock in ready:
                self._read_available()
            if self._monitor in ready:
                self._read_events()
        if isinstance(queue[0], Lost):
            queue[0].raise_()  # left in place: every later read says the same
        return queue.popleft()  # type: ignore[return-value]

    def _read_available(self) -> None:
        while True:
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._heard = time.monotonic()
            try:
                message = self._codec.decode_server(payload)
            except ProtocolError:
                continue  # a newer daemon's message type: not for us
            if isinstance(message, Ping):
                continue
            queue = self._inbox.get(message.id) if message.id is not None else None
            if queue is not None:
                queue.append(message)
                if not isinstance(message, Tokens):
                    self._pending.discard(message.id)  # its last frame

    def _until_connected(self, timeout: float | None = None) -> None:
        """Wait for a connection PeerCheck lets through before anything is sent: what libzmq queues while
        it has none would go to whatever listens at the path next. UntrustedSocket once one was refused,
        DaemonUnavailable when nothing listens, EmberTimeout after `timeout` seconds of neither."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._read_events()
        while not self._connected:
            if self._peer.problem is not None:
                raise UntrustedSocket(self._peer.problem)
            if self._retried:  # a connect failed: is anything there at all?
                self._retried = False
                lost = unreachable(self.socket_path)
                if lost is not None:
                    lost.raise_()
            left = deadline - time.monotonic()
            if left <= 0:
                raise EmberTimeout(f"no connection to the daemon at {self.socket_path} for {timeout:g} s")
            if self._monitor.poll(min(left, 0.1) * 1000):
                self._read_events()
        if self._peer.problem is not None:
            raise UntrustedSocket(self._peer.problem)

    def _read_events(self) -> None:
        """What the monitor saw. A connection is checked (PeerCheck): one it refuses is dropped, and
        every request in flight ends with UntrustedSocket. A lost connection ends every request in
        flight (after the frames that came before it); a failed connect ends those waiting on a
        daemon that is not there."""
        while True:
            try:
                message = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            event = message["event"]
            if event == zmq.EVENT_CONNECTED:
                problem = self._peer.connected(int(message["value"]))
                if problem is not None:
                    self._sock.disconnect(self._address)  # nothing more goes there
                    self._lose(Lost(UntrustedSocket, problem))
                    continue
                self._connected, self._retried = True, False
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._read_available()
                if self._pending:
                    self._lose(lost_connection(self.socket_path))
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._retried = True
            if event == zmq.EVENT_CONNECT_RETRIED and self._pending and not self._connected:
                lost = unreachable(self.socket_path)  # None: something listens, libzmq's retry may get it
                if lost is not None:
                    self._lose(lost)

    def _lose(self, lost: Lost) -> None:
        for request_id in self._pending:
            self._inbox[request_id].append(lost)
        self._pending.clear()

    def _finish_stream(self, request_id: int) -> None:
        self._forget(request_id)

    def _release(self, request_id: int, held: HeldSlots) -> None:
        if not self._sock.closed:
            for release in self._reader.releases(request_id, held):
                self._send(release)

    def _abandon(self, request_id: int, held: HeldSlots) -> None:
        """A Stream was dropped unfinished (from __del__: no socket calls here)."""
        self._abandoned.append((request_id, held))

    def _cancel_abandoned(self) -> None:
        while self._abandoned:
            request_id, held = self._abandoned.pop()
            self._forget(request_id)
            self._sock.send(self._codec.encode(Cancel(request_id)))
            for release in self._reader.releases(request_id, held):
                self._sock.send(self._codec.encode(release))


class Stream:
    """Chunks of one generation, as they are produced. After the last, `finished` is the Finished
    message (reason, usage, timings). Iterating raises the typed error if the daemon refused the
    request, and GenerationFailed if it failed midway."""

    def __init__(self, client: Client, request_id: int) -> None:
        self._client = client
        self.id = request_id
        self.finished: Finished | None = None
        self._held = HeldSlots()  # logits slots of the chunk handed out last
        self._done = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        self._release_held()
        if self._done:
            raise StopIteration
        try:
            reply = self._client._next_for(self.id)
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
        raise StopIteration

    def text(self) -> str:
        """Read the rest of the stream; return its text."""
        return "".join(chunk.text for chunk in self)

    def cancel(self) -> None:
        """Ask the daemon to stop; the stream then ends with Finished(reason="cancelled") (or the reason
        it reached first). Harmless after the end."""
        if not self._done:
            self._client._send(Cancel(self.id))

    def hold(self, held: bool = True) -> None:
        """Tell the daemon that this stream's output cannot be taken now (held) or can again: it stops
        running the request, letting others have its place, and resumes it where it was."""
        if not self._done:
            self._client._send(Hold(self.id, held))

    def close(self) -> None:
        """Cancel and read to the end, so nothing of this stream is left in flight."""
        self.cancel()
        for _ in self:
            pass

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._client._abandon(self.id, self._held)

    def _release_held(self) -> None:
        held, self._held = self._held, HeldSlots()
        self._client._release(self.id, held)
