"""Engine: the one worker thread that runs models. It never awaits; the I/O loop never runs model code.

They meet in two places: the engine's inbox (a thread-safe queue of commands: submit, cancel, drop a
client, pause a client, release logits slots, shut down) and `publish`, which the server wires to
`loop.call_soon_threadsafe`. Each loop turn: apply every command that arrived, then run one
continuous-batching step (daemon/engine/batch_engine.py) of the next model with runnable work — every running
sequence of that model advances together, prompts are read in chunks beside them — and publish the
frames. Commands are applied between steps, so a Cancel stops a request within one step.

A sequence is held (not scheduled, keeping its KV blocks and its place) while its client is paused
(its socket backlog is full) or, asking for logits, while its client's logits ring has no free slot
for it: nothing is ever dropped.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ember.daemon.engine.batch_engine import BatchEngine, StepOutput
from ember.daemon.text.chat_template import ChatTemplateError
from ember.daemon.logging_setup import get_logger
from ember.daemon.server.request import Request
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.text.stop_strings import StopStrings
from ember.protocol.limits import Limits, LimitExceeded
from ember.protocol.messages import (Error, ErrorCode, Finished, FinishReason, ServerMessage, Timings, Tokens,
                                     TopLogprob, Usage)
from ember.protocol.shm_ring import ShmRing

Output = tuple[bytes, ServerMessage]  # (client identity, message)
Command = Callable[[], None]

_IDLE_WAKE = 1.0  # seconds an idle engine sleeps between watchdog pings when systemd sets none
_RATE_WINDOW = 10.0  # seconds of recent steps behind EngineStats.tokens_per_s


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for the Stats reply, replaced whole after each step (the I/O loop only reads it)."""
    running: int = 0  # sequences being generated (prompt or tokens)
    waiting: int = 0  # accepted, waiting for KV blocks or a running slot
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_hit_rate: float = 0.0  # of full prompt blocks looked up, the share found cached
    preemptions: int = 0
    tokens_per_s: float = 0.0  # generated tokens over the last _RATE_WINDOW seconds


class Engine:
    def __init__(self, *, batches: Mapping[str, BatchEngine], limits: Limits,
                 publish: Callable[[list[Output]], None], on_stopped: Callable[[], None],
                 new_ring: Callable[[], ShmRing], heartbeat: Callable[[], None] = lambda: None,
                 heartbeat_interval: float | None = None) -> None:
        self._batches = dict(batches)  # model name -> its continuous-batching engine
        self._order = deque(self._batches)  # round robin over models with work
        self._limits = limits
        self._publish = publish
        self._on_stopped = on_stopped
        self._new_ring = new_ring
        self._heartbeat = heartbeat
        self._idle_wake = heartbeat_interval / 2 if heartbeat_interval else _IDLE_WAKE
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._live: dict[int, Request] = {}  # seq_id -> request, for every request with a sequence
        self._paused: set[bytes] = set()
        self._rings: dict[bytes, ShmRing] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated) of recent steps
        self._deadline: float | None = None  # set by shutdown(): cancel what is left at this time
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        self.log = get_logger()
        self.stats = EngineStats()

    # --- commands (any thread) -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._inbox.put(lambda: self._admit(request))

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
                    if not self._live:
                        break
                if not self._step_next_model():
                    self._apply(block=True)
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

    def _step_next_model(self) -> bool:
        """One batched step of the next model that has runnable work; False if none had any."""
        self._mark_held()
        for _ in range(len(self._order)):
            name = self._order[0]
            self._order.rotate(-1)
            batch = self._batches[name]
            if not batch.has_work:
                continue
            unstarted = [r for r in self._live.values() if r.model_name == name and r.seq.started is None]  # type: ignore[union-attr]
            try:
                result = batch.step()
            except Exception as e:  # the model failed mid-step: its requests end, the daemon goes on
                self.log.exception("step failed", model=name)
                self._cancel(lambda r: r.model_name == name, FinishReason.ERROR, f"{type(e).__name__}: {e}")
                return True
            if result.tokens == 0:
                continue  # everything it has is held
            for r in unstarted:
                if r.seq is not None and r.seq.started is not None:
                    r.log.info("request started", prompt_tokens=len(r.seq.prompt), max_tokens=r.max_tokens)
            for out in result.outputs:
                self._emit(self._live[out.seq.seq_id], out)
            self._account(sum(len(o.new_tokens) for o in result.outputs))
            return True
        self._account(0)
        return False

    def _mark_held(self) -> None:
        """Hold the sequences whose clients cannot take a frame now: paused clients, and logits
        requests beyond the free slots of their client's ring (a step fills one slot per sequence)."""
        free = {client: ring.free_slots for client, ring in self._rings.items()}
        for r in self._live.values():
            assert r.seq is not None
            held = r.client in self._paused
            if r.return_logits and not held:
                held = free[r.client] == 0
                free[r.client] -= not held
            r.seq.held = held

    # --- request lifecycle (engine thread) --------------------------------------------------------
    def _admit(self, r: Request) -> None:
        """Tokenize or render the prompt and hand the sequence to its model's scheduler, or answer an Error."""
        batch = self._batches[r.model_name]
        try:
            if r.prompt_ids is None:
                r.prompt_ids = r.model.chat_ids(r.messages) if r.messages is not None else r.model.tokenize(r.prompt_text or "")
            if not r.prompt_ids:
                raise ValueError("the prompt is empty")
            # a prompt must leave room for one token in the sequence's context
            self._limits.check_prompt(len(r.prompt_ids), batch.scheduler.max_context - 1)
            if r.return_logits:
                self._ring(r.client)
        except LimitExceeded as e:
            return self._reject(r, ErrorCode.LIMIT, str(e))
        except (ValueError, ChatTemplateError) as e:  # TokenizerError is a ValueError
            return self._reject(r, ErrorCode.BAD_REQUEST, str(e))
        except OSError as e:  # no shared memory left for the ring
            return self._reject(r, ErrorCode.INTERNAL, f"cannot create the logits ring: {e}")
        r.text = r.model.tokenizer.stream_decoder(context=r.prompt_ids)
        r.stops = StopStrings(r.stop)
        if r.max_tokens == 0:
            return self._finish(r, FinishReason.LENGTH)
        stop_ids = set(r.stop_ids) | (set() if r.ignore_eos else set(r.model.tokenizer.eos_ids))
        r.seq = Sequence(r.prompt_ids, r.max_tokens, r.params, r.seed, frozenset(stop_ids), client=r.client,
                         wants_logits=r.return_logits)
        batch.add(r.seq)
        self._live[r.seq.seq_id] = r

    def _emit(self, r: Request, out: StepOutput) -> None:
        assert r.text is not None and r.stops is not None and r.seq is not None
        if r.first_token is None:
            r.first_token = time.perf_counter()
        text = "".join(r.stops.feed(r.text.feed(t)) for t in out.new_tokens)
        r.completion_tokens += len(out.new_tokens)
        finish = FinishReason.STOP if r.stops.stopped else (r.seq.finish_reason if out.finished else None)
        if finish is not None:
            text += r.stops.feed(r.text.flush()) + r.stops.flush()
        if out.new_tokens:
            self._publish([(r.client, self._tokens_frame(r, out, text))])
        elif text:
            self._publish([(r.client, Tokens(r.id, (), text))])
        if finish is not None:
            self._finish(r, finish)

    def _tokens_frame(self, r: Request, out: StepOutput, text: str) -> Tokens:
        assert r.seq is not None
        choices = r.seq.choices[len(r.seq.choices) - len(out.new_tokens):]
        logits = None
        if out.logits is not None:
            ring = self._ring(r.client)
            slot = ring.acquire()
            assert slot is not None  # _mark_held ran it only with a free slot
            logits = (ring.write(slot, out.logits[None, :]),)
        top = tuple(tuple(TopLogprob(t, lp) for t, lp in c.top) for c in choices) if r.params.logprobs else None
        return Tokens(r.id, tuple(out.new_tokens), text, tuple(c.logprob for c in choices) if r.logprobs else None,
                      top, logits)

    def _finish(self, r: Request, reason: str, message: str = "") -> None:
        """End a request (waiting, running or just done): free its KV blocks, send its last frames."""
        outputs: list[Output] = []
        seq = r.seq
        if seq is not None:
            if seq.status != Status.FINISHED:
                self._batches[r.model_name].abort(seq, reason)
            self._live.pop(seq.seq_id, None)
        if reason in (FinishReason.CANCELLED, FinishReason.ERROR) and r.text is not None and r.stops is not None:
            tail = r.stops.feed(r.text.flush()) + r.stops.flush()  # text held back for a partial character
            if tail:
                outputs.append((r.client, Tokens(r.id, (), tail)))
        r.text = None
        now = time.perf_counter()
        started = (seq.started if seq is not None else None) or now
        first = r.first_token or now
        timings = Timings(queued_ms=_ms(started - r.admitted), prefill_ms=_ms(first - started),
                          decode_ms=_ms(now - first), total_ms=_ms(now - r.admitted))
        usage = Usage(len(r.prompt_ids or ()), r.completion_tokens)
        outputs.append((r.client, Finished(r.id, reason, usage, timings, message)))
        self._publish(outputs)
        r.log.info("request finished", reason=reason, completion_tokens=r.completion_tokens,
                   total_ms=round(timings.total_ms, 1), **({"error": message} if message else {}))

    def _reject(self, r: Request, code: str, message: str) -> None:
        r.log.info("request refused", code=code, error=message)
        self._publish([(r.client, Error(r.id, code, message))])

    def _cancel(self, which: Callable[[Request], bool], reason: str = FinishReason.CANCELLED, message: str = "") -> None:
        for r in [r for r in self._live.values() if which(r)]:
            self._finish(r, reason, message)

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

    def _account(self, generated: int) -> None:
        """Refresh the stats snapshot after a step that generated `generated` tokens."""
        now = time.monotonic()
        if generated:
            self._recent.append((now, generated))
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW:
            self._recent.popleft()
        parts = [b.stats() for b in self._batches.values()]
        queries = sum(p.prefix_queries for p in parts)
        span = now - self._recent[0][0] if len(self._recent) > 1 else 0.0
        self.stats = EngineStats(
            running=sum(p.running for p in parts), waiting=sum(p.waiting for p in parts),
            kv_blocks_used=sum(p.kv_blocks_used for p in parts), kv_blocks_free=sum(p.kv_blocks_free for p in parts),
            prefix_hit_rate=sum(p.prefix_hits for p in parts) / queries if queries else 0.0,
            preemptions=sum(p.preemptions for p in parts),
            tokens_per_s=sum(n for _, n in list(self._recent)[1:]) / span if span > 0 else 0.0,
        )


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
