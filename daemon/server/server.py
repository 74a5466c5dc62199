"""Server: the daemon's I/O loop (asyncio on uvloop) around a ZMQ ROUTER socket on a Unix socket.

It reads one message per frame, validates it, answers small requests itself, hands Generates to the
engine and streams the engine's frames back through the Outbox. It never runs model code (tokenize
and detokenize go to a helper thread, or for big texts to the text worker's TokenizePool processes,
after a text too long for a prompt is refused by its size) and it answers every bad message with an
Error, whatever the bytes. Admission is decided here, at once: a full queue is Error{code: "busy"},
never a wait; tokenizer requests are bounded per client and in all the same way.

Clients reach the ROUTER through the relay on the public socket (zmtp_relay.py), which bounds a
message's frames and bytes as they arrive: libzmq bounds each frame (ZMQ_MAXMSGSIZE), not the frames
of a message, and hands a multi-part message over only once all of it has arrived. The frames after the
first are dropped as they are read, so the daemon's own code never holds more than one frame of it.

Shutdown (SIGTERM/SIGINT): STOPPING=1, new Generates are refused with "shutting_down", the engine
drains in-flight requests for `drain_timeout` and cancels the rest (every stream gets its Finished),
the backlogs are flushed, the socket is closed and unlinked, and run() returns.
"""
from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

import ember
from ember.daemon.config import Config
from ember.daemon.logging_setup import get_logger
from ember.daemon.server.notify import Notifier
from ember.daemon.server.outbox import Outbox
from ember.daemon.server.peers import Peer, Peers
from ember.daemon.server.request import RequestError, request_from_generate, resolve_model
from ember.daemon.server.text_worker import Output, TextWorker
from ember.daemon.server.zmtp_relay import PEER_PROPERTY, ZmtpRelay, private_router_dir, router_path
from ember.daemon.text.text_model import TextModel
from ember.daemon.text.tokenize_pool import fingerprint
from ember.protocol.codec import Codec, ProtocolError
from ember.protocol.limits import LimitExceeded
from ember.protocol.endpoint import ipc_address
from ember.protocol.messages import (PROTOCOL_VERSION, Cancel, Detokenize, Error, ErrorCode, Finished, Hold,
                                     FinishReason, Generate, Health, HealthStatus, Hello, ListModels, ModelInfo,
                                     Models, Release, ServerMessage, Stats, StatsReport, Text, TokenIds, Tokenize,
                                     Tokens, Welcome)

_FLUSH_GRACE = 2.0  # seconds at shutdown to deliver what clients have not read yet
_LINGER_MS = 1000
_RECEIVE_TURN = 64  # messages read in a row before the loop lets the other tasks (the token forwarding) run


class Server:
    def __init__(self, config: Config, models: Mapping[str, TextModel], socket_path: Path, notifier: Notifier,
                 make_engine: Callable[[Callable[[list[Output]], None], Callable[[], None]], TextWorker]) -> None:
        self._config, self._models, self._path, self._notifier = config, models, socket_path, notifier
        self._limits = config.limits
        self._make_engine = make_engine
        self._codec = Codec()
        self._peers = Peers()
        self._helpers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-tokenize")
        self._started = time.monotonic()
        # the user and process of the Generate being handled (its IPC connection's SO_PEERCRED)
        self._sender_uid, self._sender_pid = -1, -1
        self._per_process: Counter[int] = Counter()  # requests in flight of each client process
        self._draining = False
        self._in_flight = 0
        self._helpers_in_flight = 0  # Tokenize / Detokenize being worked on
        self._counters = dict(requests=0, tokens=0, cancelled=0, busy=0, errors=0)
        self._model_infos = tuple(_model_info(name, m) for name, m in models.items())
        for m in models.values():  # computed once per model, now rather than on a client's time
            m.tokenizer.max_token_bytes, fingerprint(m.tokenizer)
        self._handlers: dict[type, Callable[[bytes, Any], None]] = {
            Hello: self._hello, Generate: self._generate, Cancel: self._cancel, Hold: self._hold, Release: self._release,
            Tokenize: self._tokenize, Detokenize: self._detokenize, ListModels: self._list_models,
            Health: self._health, Stats: self._stats,
        }
        self.log = get_logger()

    # --- lifecycle ---------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        engine_stopped = asyncio.Event()
        self._engine = self._make_engine(lambda outs: _call_soon(loop, self._on_outputs, outs),
                                         lambda: _call_soon(loop, engine_stopped.set))
        ctx = zmq.asyncio.Context()
        self._sock = self._bind(ctx)
        relay = ZmtpRelay(self._path, router_path(self._path), self._limits.max_message_bytes)
        relay.start()
        self._share_with_group()
        self._outbox = Outbox(self._sock, self._codec, self._peers, on_dead=self._peer_died,
                              set_paused=self._engine.set_paused)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown)
        self._engine.start()
        tasks = [asyncio.create_task(c) for c in (self._receive(), self._probe(), self._watch(monitor))]
        self._notifier.ready(f"serving {', '.join(self._models)} on {self._path}")
        self.log.info("serving", socket=str(self._path), models=list(self._models), pid=os.getpid())
        try:
            await engine_stopped.wait()
            await self._flush_backlogs()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._outbox.close()
            self._sock.disable_monitor()
            monitor.close(linger=0)
            self._sock.close(linger=_LINGER_MS)
            await loop.run_in_executor(None, ctx.term)  # the relay keeps forwarding what lingers
            await loop.run_in_executor(None, relay.close, _FLUSH_GRACE)
            self._helpers.shutdown(wait=False, cancel_futures=True)
            self._unlink_socket()
            self.log.info("stopped")

    @property
    def failed(self) -> bool:
        """Whether serving ended because a worker thread failed, not because of a shutdown."""
        return self._engine.crashed

    def shutdown(self) -> None:
        """SIGTERM: finish or cancel in-flight work, then stop (run() returns)."""
        if self._draining:
            return
        self._draining = True
        drain = self._config.server.drain_timeout
        self._notifier.stopping(f"draining {self._in_flight} requests (at most {drain:g} s)")
        self.log.info("shutting down", in_flight=self._in_flight, drain_timeout=drain)
        self._engine.shutdown(drain)

    def _bind(self, ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, full -> EAGAIN: never a silent drop
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)  # bigger: libzmq drops the connection
        sock.setsockopt(zmq.RCVHWM, 100)  # bounds what one connection can queue towards us
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # a peer that hangs without closing is dropped by libzmq
        # a killed client is seen at once (its socket closes); heartbeats only find frozen ones, and a
        # shorter timeout would cancel the streams of a client stopped for a few seconds (Ctrl-Z)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30000)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        private_router_dir(self._path)  # the relay's alone: a PEER_PROPERTY from anyone else would be believed
        sock.bind(ipc_address(router_path(self._path)))
        return sock

    def _share_with_group(self) -> None:
        if self._config.server.socket_group:  # the directory lets the group in; the socket must too (the
            os.chmod(self._path, 0o660)      # socket file gets the daemon's own group, not the directory's)
            os.chown(self._path, -1, os.stat(self._path.parent).st_gid)

    async def _flush_backlogs(self) -> None:
        deadline = time.monotonic() + _FLUSH_GRACE
        while self._outbox.backlogged and time.monotonic() < deadline:
            self._outbox.flush()
            await asyncio.sleep(0.01)

    def _unlink_socket(self) -> None:
        """The ROUTER's socket and its directory (the relay unlinks the public socket, its own)."""
        private = router_path(self._path)
        try:
            private.unlink()
        except FileNotFoundError:
            pass  # libzmq removed it when the socket closed
        try:
            private.parent.rmdir()
        except OSError:
            pass

    # --- receiving -------------------------------------------------------------------------------
    async def _receive(self) -> None:
        handled = 0
        while True:
            handled += 1
            if handled % _RECEIVE_TURN == 0:  # a flood arrives all at once: the other tasks get their turn
                await asyncio.sleep(0)
            identity, body, frames = await self._next_message()
            try:
                self._dispatch(identity, body, frames)
            except Exception:  # a bug in a handler must not take the daemon down
                self.log.exception("handler failed")
                self._reply(identity, Error(None, ErrorCode.INTERNAL, "internal error"))

    async def _next_message(self) -> tuple[bytes, zmq.Frame | None, int]:
        """(the sender's identity, the message's first frame, how many frames it had). Frames after the
        first are dropped as they are read (libzmq holds the whole message until then: see the module
        docstring); memory freed in bulk that way goes back to the system."""
        identity = await self._sock.recv()
        first: zmq.Frame | None = None
        frames = dropped = 0
        while self._sock.get(zmq.RCVMORE):
            frame = await self._sock.recv(copy=False)  # here already: the await returns at once
            frames += 1
            if frames == 1:
                first = frame
            else:
                dropped += len(frame)
        if dropped > self._limits.max_message_bytes:
            _trim_heap()
        return identity, first, frames

    def _dispatch(self, identity: bytes, body: zmq.Frame | None, frames: int) -> None:
        if body is None or frames != 1:
            return self._reply(identity, Error(None, ErrorCode.BAD_MESSAGE, f"one message per frame, got {frames} frames"))
        try:
            message = self._codec.decode_client(body.buffer)
        except ProtocolError as e:
            return self._reply(identity, Error(e.request_id, e.code, str(e)))
        if isinstance(message, Generate):
            self._sender_uid, self._sender_pid = peer_credentials(body)
        self._handlers[type(message)](identity, message)

    def _reply(self, identity: bytes, message: ServerMessage) -> None:
        if isinstance(message, Error):
            self._counters["errors"] += 1
        self._outbox.send(identity, message, stream=False)

    # --- handlers ----------------------------------------------------------------------------------
    def _hello(self, identity: bytes, msg: Hello) -> None:
        if msg.protocol != PROTOCOL_VERSION:
            return self._reply(identity, Error(msg.id, ErrorCode.VERSION,
                                               f"this daemon speaks protocol {PROTOCOL_VERSION}, the client {msg.protocol}"))
        self.log.debug("hello", client=identity.hex(), name=msg.client[:100])
        self._reply(identity, Welcome(msg.id, PROTOCOL_VERSION, f"ember/{ember.__version__}", self._model_infos,
                                      self._limits.max_message_bytes))

    def _generate(self, identity: bytes, msg: Generate) -> None:
        peer = self._peers.get(identity)
        refusal = self._admission(peer, msg)
        if refusal is None:
            try:
                request = request_from_generate(identity, msg, self._models, self._limits)
            except RequestError as e:
                refusal = Error(msg.id, e.code, str(e))
        if refusal is not None:
            return self._reply(identity, refusal)
        peer = self._peers.get_or_add(identity)
        peer.requests.add(msg.id)
        peer.pid = self._sender_pid
        self._per_process[peer.pid] += 1
        self._in_flight += 1
        self._counters["requests"] += 1
        request.user = self._sender_uid
        if self._config.engine.prefix_sharing == "user":  # another user's prompts are not reused: no timing tells
            request.cache_salt = b"uid:%d" % self._sender_uid
        request.log.info("request admitted", client=peer.name, in_flight=self._in_flight)
        self._engine.submit(request)

    def _admission(self, peer: Peer | None, msg: Generate) -> Error | None:
        if self._draining:
            return Error(msg.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if peer is not None and msg.id in peer.requests:
            return Error(msg.id, ErrorCode.DUPLICATE_ID, f"request {msg.id} is still running")
        if peer is not None and len(peer.requests) >= self._limits.max_requests_per_client:
            return Error(msg.id, ErrorCode.LIMIT,
                         f"at most {self._limits.max_requests_per_client} requests in flight per client")
        if self._in_flight >= self._config.engine.max_active + self._config.engine.max_queued:
            self._counters["busy"] += 1
            return Error(msg.id, ErrorCode.BUSY, f"the queue is full ({self._in_flight} requests): retry later")
        share = self._config.engine.process_share
        if share and self._per_process[self._sender_pid] >= share:  # whatever its connections
            self._counters["busy"] += 1
            return Error(msg.id, ErrorCode.BUSY, f"this process has {share} requests in flight, its share of the "
                                                 f"daemon's {self._in_flight}: retry later (engine.max_per_process)")
        return None

    def _cancel(self, identity: bytes, msg: Cancel) -> None:
        peer = self._peers.get(identity)
        if peer is not None and msg.id in peer.requests:
            self._engine.cancel(identity, msg.id)

    def _hold(self, identity: bytes, msg: Hold) -> None:
        peer = self._peers.get(identity)
        if peer is not None and msg.id in peer.requests:
            self._engine.hold(identity, msg.id, msg.held)

    def _release(self, identity: bytes, msg: Release) -> None:
        peer = self._peers.get(identity)
        if peer is not None and peer.has_ring and len(msg.slots) <= self._config.server.logits_slots:
            self._engine.release(identity, msg.slots, msg.device)

    def _tokenize(self, identity: bytes, msg: Tokenize) -> None:
        found = self._model_for(identity, msg.id, msg.model)
        if found is None:
            return
        name, model = found
        try:  # bounded like a prompt: a text too long for one is refused by its size, untokenized
            size = self._engine.check_text_size(name, model.tokenizer, msg.text)
        except LimitExceeded as e:
            return self._reply(identity, Error(msg.id, e.code, str(e)))
        pool = self._engine.tokenize_pool
        if size > pool.inline_bytes:  # in a worker process: a big encode holds the GIL throughout
            start = lambda: asyncio.wrap_future(pool.encode(model.path, model.tokenizer, msg.text, msg.add_special))
        else:
            start = lambda: self._in_thread(lambda: model.tokenize(msg.text, add_special=msg.add_special))
        self._helper(identity, msg.id, start, lambda ids: TokenIds(msg.id, tuple(ids)))

    def _detokenize(self, identity: bytes, msg: Detokenize) -> None:
        found = self._model_for(identity, msg.id, msg.model)
        if found is None:
            return
        model = found[1]
        try:
            self._limits.check_detokenize(len(msg.token_ids))
        except LimitExceeded as e:
            return self._reply(identity, Error(msg.id, ErrorCode.LIMIT, str(e)))
        if any(not 0 <= t < model.config.vocab for t in msg.token_ids):
            return self._reply(identity, Error(msg.id, ErrorCode.BAD_REQUEST, f"token ids must be in [0, {model.config.vocab})"))
        pool = self._engine.tokenize_pool
        if len(msg.token_ids) > pool.inline_ids:
            start = lambda: asyncio.wrap_future(pool.decode(model.path, model.tokenizer, msg.token_ids))
        else:
            start = lambda: self._in_thread(lambda: model.detokenize(msg.token_ids))
        self._helper(identity, msg.id, start, lambda text: Text(msg.id, text))

    def _model_for(self, identity: bytes, request_id: int, name: str) -> tuple[str, TextModel] | None:
        """The named model, or None after answering the Error (at once: only the tokenizer's work is
        worth a helper thread)."""
        try:
            return resolve_model(name, self._models)
        except RequestError as e:
            self._reply(identity, Error(request_id, e.code, str(e)))
            return None

    def _helper(self, identity: bytes, request_id: int, start: Callable[[], asyncio.Future[Any]],
                reply: Callable[[Any], ServerMessage]) -> None:
        """Start tokenizer work off the loop (`start`) and answer with `reply(its result)`; bounded per
        client like Generates, and in all like the engine's queue (then: busy)."""
        peer = self._peers.get_or_add(identity)
        refusal = self._helper_admission(request_id, peer)
        if refusal is None:
            try:
                future = start()
            except (OSError, RuntimeError) as e:  # no worker process could be started, or shutting down
                refusal = Error(request_id, ErrorCode.INTERNAL, f"cannot tokenize: {e}")
        if refusal is not None:
            self._peers.forget_if_idle(peer)
            return self._reply(identity, refusal)
        peer.helpers += 1
        self._helpers_in_flight += 1

        def done(future: asyncio.Future[Any]) -> None:
            peer.helpers -= 1
            self._helpers_in_flight -= 1
            try:
                message = reply(future.result())
            except asyncio.CancelledError:  # the pools stop with the daemon
                message = Error(request_id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            except ValueError as e:  # TokenizerError
                message = Error(request_id, ErrorCode.BAD_REQUEST, str(e))
            except Exception as e:  # a worker process died, or the model file changed on disk
                self.log.error("tokenizer request failed", client=peer.name, error=f"{type(e).__name__}: {e}")
                message = Error(request_id, ErrorCode.INTERNAL, f"tokenizing failed: {type(e).__name__}")
            self._reply(identity, message)
            self._peers.forget_if_idle(peer)

        future.add_done_callback(done)

    def _helper_admission(self, request_id: int, peer: Peer) -> Error | None:
        if peer.helpers >= self._limits.max_requests_per_client:
            return Error(request_id, ErrorCode.LIMIT, "too many tokenizer requests in flight")
        if self._helpers_in_flight >= self._config.engine.max_active + self._config.engine.max_queued:
            self._counters["busy"] += 1
            return Error(request_id, ErrorCode.BUSY, f"{self._helpers_in_flight} tokenizer requests in flight: retry later")
        return None

    def _in_thread(self, work: Callable[[], Any]) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._helpers, work)

    def _list_models(self, identity: bytes, msg: ListModels) -> None:
        self._reply(identity, Models(msg.id, self._model_infos))

    def _health(self, identity: bytes, msg: Health) -> None:
        self._reply(identity, HealthStatus(msg.id, "draining" if self._draining else "ok", self._uptime()))

    def _stats(self, identity: bytes, msg: Stats) -> None:
        c, e = self._counters, self._engine.stats  # admitted and not running: queued, here or in the engine
        self._reply(identity, StatsReport(
            msg.id, self._uptime(), clients=len(self._peers), active=e.running,
            queued=max(0, self._in_flight - e.running), requests_total=c["requests"], tokens_total=c["tokens"],
            cancelled_total=c["cancelled"], busy_total=c["busy"], errors_total=c["errors"],
            kv_blocks_used=e.kv_blocks_used, kv_blocks_free=e.kv_blocks_free,
            prefix_hit_rate=round(e.prefix_hit_rate, 4), preemptions=e.preemptions,
            tokens_per_s=round(e.tokens_per_s, 2), **self._expert_stats(),
            spec_acceptance_rate=round(e.spec.acceptance_rate, 4),
            spec_mean_accepted_length=round(e.spec.mean_accepted_length, 3), spec_plain_tokens=e.spec.plain_tokens,
            spec_saved_s_per_token=round(e.spec.saved_s_per_token, 7), prefix_hits=e.prefix_hits,
            held=e.held, spec_mean_proposals=round(e.spec.mean_proposals, 3)))

    def _expert_stats(self) -> dict[str, Any]:
        """The MoE models' expert counters, summed by the engine."""
        x = self._engine.stats.experts
        return dict(hot_experts=x.hot_experts, total_experts=x.total_experts, cold_share=x.cold_share,
                    expert_swaps=x.swaps, cold_worker_restarts=x.worker_restarts)

    # --- engine output and peers -------------------------------------------------------------------
    def _on_outputs(self, outputs: list[Output]) -> None:
        for identity, message in outputs:
            peer = self._peers.get(identity)
            if isinstance(message, Tokens):
                self._counters["tokens"] += len(message.token_ids)
                if (message.logits or message.device_logits) and peer is not None:
                    peer.has_ring = True
            elif isinstance(message, (Finished, Error)):
                self._in_flight -= 1
                if isinstance(message, Error) or message.reason == FinishReason.ERROR:  # refused, or failed running
                    self._counters["errors"] += 1
                elif message.reason == FinishReason.CANCELLED:
                    self._counters["cancelled"] += 1
                if peer is not None and message.id in peer.requests:
                    peer.requests.discard(message.id)
                    self._per_process[peer.pid] -= 1
                    if not self._per_process[peer.pid]:
                        del self._per_process[peer.pid]
            self._outbox.send(identity, message, stream=True)
            if peer is not None:
                self._peers.forget_if_idle(peer)

    def _peer_died(self, peer: Peer) -> None:
        self.log.info("client gone: cancelling its requests", client=peer.name, requests=len(peer.requests))
        self._engine.drop_client(peer.identity)
        peer.has_ring = False
        self._peers.forget_if_idle(peer)

    async def _probe(self) -> None:
        interval = self._config.server.probe_interval
        while True:
            await asyncio.sleep(interval)
            self._outbox.probe(quiet_for=interval)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """A disconnection: probe every peer now, and again shortly (libzmq may still be tearing the
        pipe down when the event arrives, and a probe into a dying pipe succeeds)."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._outbox.probe()
                for delay in (0.05, 0.25):
                    asyncio.get_running_loop().call_later(delay, self._outbox.probe)

    def _uptime(self) -> float:
        return round(time.monotonic() - self._started, 3)


def _model_info(name: str, model: TextModel) -> ModelInfo:
    c = model.config
    return ModelInfo(name, c.arch, c.vocab, c.context_length, model.tokenizer.chat_template is not None,
                     model.tool_format)


def _trim_heap() -> None:
    """Give memory freed in bulk back to the system: glibc keeps freed chunks for reuse, so a burst of
    discarded frames would otherwise stay in the daemon's RSS (ctypes releases the GIL meanwhile)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is left to tell
        pass


def peer_credentials(frame: zmq.Frame) -> tuple[int, int]:
    """(Unix user, process id) of the client that sent `frame`: SO_PEERCRED of its connection, which
    the relay announces as PEER_PROPERTY ("<uid>:<gid>:<pid>"), or for a connection straight to the
    ROUTER (the daemon's own user only), libzmq's ("Peer-Address": "<host>:<uid>:<gid>:<pid>"); -1 for
    each where the transport has none."""
    for name in (PEER_PROPERTY, "Peer-Address"):
        try:
            uid, _, pid = frame.get(name).rsplit(":", 3)[-3:]
            return int(uid), int(pid)
        except (zmq.ZMQError, ValueError):
            continue
    return -1, -1
