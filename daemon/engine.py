"""Engine: the one worker thread that runs models. It never awaits; the I/O loop never runs model code.

They meet in two places: the engine's inbox (a thread-safe queue of commands: submit, cancel, drop a
client, pause a client, release logits slots, shut down) and `publish`, which the server wires to
`loop.call_soon_threadsafe`. Each loop turn: apply every command that arrived, start queued requests
while there is room, run one step of the next runnable request (round robin), publish its frames.
Commands are applied between steps, so a Cancel stops a request within one step.

A request is runnable unless its client is paused (its socket backlog is full) or its logits ring has
no free slot: those wait, nothing is dropped. Continuous batching (daemon/batch_engine.py) will replace
the round robin over SoloDecodes; the commands and the frames stay the same.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from ember.daemon.chat_template import ChatTemplateError
from ember.daemon.logging_setup import get_logger
from ember.daemon.request import Request
from ember.daemon.solo_decode import SoloDecode, Step
from ember.daemon.stop_strings import StopStrings
from ember.protocol.limits import Limits, LimitExceeded
from ember.protocol.messages import (Error, ErrorCode, Finished, FinishReason, ServerMessage, Timings, Tokens,
                                     TopLogprob, Usage)
from ember.protocol.shm_ring import ShmRing

Output = tuple[bytes, ServerMessage]  # (client identity, message)
Command = Callable[[], None]

_IDLE_WAKE = 1.0  # seconds an idle engine sleeps between watchdog pings when systemd sets none


class Engine:
    def __init__(self, *, max_active: int, limits: Limits, publish: Callable[[list[Output]], None],
                 on_stopped: Callable[[], None], new_ring: Callable[[], ShmRing],
                 heartbeat: Callable[[], None] = lambda: None, heartbeat_interval: float | None = None) -> None:
        self._max_active = max_active
        self._limits = limits
        self._publish = publish
        self._on_stopped = on_stopped
        self._new_ring = new_ring
        self._heartbeat = heartbeat
        self._idle_wake = heartbeat_interval / 2 if heartbeat_interval else _IDLE_WAKE
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._pending: deque[Request] = deque()
        self._active: deque[Request] = deque()
        self._paused: set[bytes] = set()
        self._rings: dict[bytes, ShmRing] = {}
        self._deadline: float | None = None  # set by shutdown(): cancel what is left at this time
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self.log = get_logger()
        self.active_count = 0  # read by the I/O loop for Stats (a plain int: a stale value is harmless)

    # --- commands (any thread) -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._inbox.put(lambda: self._prepare(request))

    def cancel(self, client: bytes, request_id: int) -> None:
        self._inbox.put(lambda: self._cancel(lambda r: r.key == (client, request_id)))

    def drop_client(self, client: bytes) -> None:
        """The client is gone: cancel its requests (queued ones never run) and free its ring."""
        self._inbox.put(lambda: self._drop_client(client))

    def set_paused(self, client: bytes, paused: bool) -> None:
        self._inbox.put(lambda: (self._paused.add if paused else self._paused.discard)(client))

    def release(self, client: bytes, slots: Iterable[int]) -> None:
        slots = list(slots)
        self._inbox.put(lambda: self._release(client, slots))

    def shutdown(self, drain_timeout: float) -> None:
        """Stop after in-flight requests finish; whatever still runs after `drain_timeout` is cancelled."""
        deadline = time.monotonic() + drain_timeout
        self._inbox.put(lambda: setattr(self, "_deadline", deadline))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # --- the loop (engine thread) ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._apply(block=False)
                if self._deadline is not None:
                    if time.monotonic() >= self._deadline:
                        self._cancel(lambda r: True)
                    if not self._active and not self._pending:
                        break
                self._start_queued()
                request = self._next_runnable()
                if request is None:
                    self._apply(block=True)
                else:
                    self._step(request)
                self._heartbeat()
        except Exception:  # a bug in the engine itself: say so loudly, then stop (systemd restarts us)
            self.log.exception("engine loop failed")
        finally:
            for ring in self._rings.values():
                ring.close()
            self._rings.clear()
            self._on_stopped()

    def _apply(self, block: bool) -> None:
        """Run queued commands; when `block`, first wait for one (bounded, to keep petting the watchdog)."""
        if block:
            timeout = self._idle_wake
            if self._deadline is not None:
                timeout = max(0.0, min(timeout, self._deadline - time.monotonic()))
            try:
                self._inbox.get(timeout=timeout)()
            except queue.Empty:
                return
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            command()

    def _next_runnable(self) -> Request | None:
        for _ in range(len(self._active)):
            request = self._active[0]
            self._active.rotate(-1)
            if request.client in self._paused:
                continue
            if request.return_logits and self._ring(request.client).free_slots == 0:
                continue
            return request
        return None

    # --- request lifecycle (engine thread) --------------------------------------------------------
    def _prepare(self, r: Request) -> None:
        """Tokenize or render the prompt and queue the request, or answer an Error."""
        try:
            if r.prompt_ids is None:
                r.prompt_ids = r.model.chat_ids(r.messages) if r.messages is not None else r.model.tokenize(r.prompt_text or "")
            if not r.prompt_ids:
                raise ValueError("the prompt is empty")
            self._limits.check_prompt(len(r.prompt_ids), r.model.config.context_length)
            if r.return_logits:
                self._ring(r.client)
        except LimitExceeded as e:
            return self._reject(r, ErrorCode.LIMIT, str(e))
        except (ValueError, ChatTemplateError) as e:  # TokenizerError is a ValueError
            return self._reject(r, ErrorCode.BAD_REQUEST, str(e))
        except OSError as e:  # no shared memory left for the ring
            return self._reject(r, ErrorCode.INTERNAL, f"cannot create the logits ring: {e}")
        self._pending.append(r)
        self._count()

    def _start_queued(self) -> None:
        while self._pending and len(self._active) < self._max_active:
            r = self._pending.popleft()
            assert r.prompt_ids is not None
            try:
                r.decode = SoloDecode(r.model, r.prompt_ids, r.max_tokens, r.params, r.seed, r.stop_ids, r.ignore_eos)
            except MemoryError:
                self._finish(r, FinishReason.ERROR, "out of memory for the KV cache")
                continue
            r.text = r.model.tokenizer.stream_decoder(context=r.prompt_ids)
            r.stops = StopStrings(r.stop)
            r.log.info("request started", prompt_tokens=len(r.prompt_ids), max_tokens=r.max_tokens)
            if r.decode.done:  # no room for a single token
                self._finish(r, FinishReason.LENGTH)
                continue
            self._active.append(r)
        self._count()

    def _step(self, r: Request) -> None:
        assert r.decode is not None
        if r.started is None:
            r.started = time.perf_counter()
        try:
            step = r.decode.step()
        except Exception as e:
            r.log.exception("step failed")
            return self._finish(r, FinishReason.ERROR, f"{type(e).__name__}: {e}")
        if step is not None:
            self._emit(r, step)

    def _emit(self, r: Request, step: Step) -> None:
        assert r.text is not None and r.stops is not None
        r.completion_tokens += 1
        if r.first_token is None:
            r.first_token = time.perf_counter()
        text = r.stops.feed(r.text.feed(step.token))
        finish = FinishReason.STOP if r.stops.stopped else step.finish
        if finish is not None:
            text += r.stops.feed(r.text.flush()) + r.stops.flush()
        logits = None
        if r.return_logits:
            ring = self._ring(r.client)
            slot = ring.acquire()
            assert slot is not None  # runnable only with a free slot
            logits = (ring.write(slot, step.logits[None, :]),)
        top = None
        if r.params.logprobs:
            top = (tuple(TopLogprob(t, lp) for t, lp in step.choice.top),)
        self._publish([(r.client, Tokens(r.id, (step.token,), text, (step.choice.logprob,) if r.logprobs else None,
                                         top, logits))])
        if finish is not None:
            self._finish(r, finish)

    def _finish(self, r: Request, reason: str, message: str = "") -> None:
        """End a request (queued, running or just done): free its cache, send its last frames."""
        outputs: list[Output] = []
        if r.decode is not None:
            r.decode.close()
        if reason in (FinishReason.CANCELLED, FinishReason.ERROR) and r.text is not None and r.stops is not None:
            tail = r.stops.feed(r.text.flush()) + r.stops.flush()  # text held back for a partial character
            if tail:
                outputs.append((r.client, Tokens(r.id, (), tail)))
            r.text = None
        for q in (self._active, self._pending):
            if r in q:
                q.remove(r)
        now = time.perf_counter()
        started = r.started or now
        first = r.first_token or now
        timings = Timings(queued_ms=_ms(started - r.admitted), prefill_ms=_ms(first - started),
                          decode_ms=_ms(now - first), total_ms=_ms(now - r.admitted))
        usage = Usage(len(r.prompt_ids or ()), r.completion_tokens)
        outputs.append((r.client, Finished(r.id, reason, usage, timings, message)))
        self._publish(outputs)
        self._count()
        r.log.info("request finished", reason=reason, completion_tokens=r.completion_tokens,
                   total_ms=round(timings.total_ms, 1), **({"error": message} if message else {}))

    def _reject(self, r: Request, code: str, message: str) -> None:
        r.log.info("request refused", code=code, error=message)
        self._publish([(r.client, Error(r.id, code, message))])

    def _cancel(self, which: Callable[[Request], bool]) -> None:
        for r in [r for q in (self._active, self._pending) for r in q if which(r)]:
            self._finish(r, FinishReason.CANCELLED)

    def _drop_client(self, client: bytes) -> None:
        self._cancel(lambda r: r.client == client)
        self._paused.discard(client)
        ring = self._rings.pop(client, None)
        if ring is not None:
            ring.close()

    def _release(self, client: bytes, slots: list[int]) -> None:
        ring = self._rings.get(client)
        if ring is not None:
            for slot in slots:
                ring.release(slot)

    def _ring(self, client: bytes) -> ShmRing:
        if client not in self._rings:
            self._rings[client] = self._new_ring()
        return self._rings[client]

    def _count(self) -> None:
        self.active_count = len(self._active)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
