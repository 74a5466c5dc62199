"""TextWorker: the text side of serving, in a thread of its own so that the step loop never waits for
it — and the daemon's front for the engine: the I/O loop gives it every engine command.

In, through one queue (so that a Cancel never overtakes the Generate it cancels):
- requests from the I/O loop: render the prompt, refuse it by its size in bytes if it cannot fit the
  context, tokenize it (here when small; a big one in a worker process of the TokenizePool, whose ids
  come back through the queue: the GIL is never held for a big encode), check it against the limits,
  build the sequence, hand it to the engine thread (or answer an Error);
- cancels, dropped clients and the shutdown, forwarded to the engine in that order (a request still
  being tokenized is ended here: Finished{cancelled}; the shutdown waits for those being tokenized);
- after each engine step of an engine in process, its progress: detokenize, find stop strings, build
  the Tokens / Finished frames of every request the step touched, and publish them together (one
  wake-up of the I/O loop per step, not per request).
The daemon's engine process hands its steps' progress to the front's link thread (EngineHost), which
turns it into frames itself (`_frames`, the same work): one thread fewer wakes per step, and nothing
the engine waits for. `_frames` touches only requests the engine holds, which nothing else here
touches once they are handed over.
A stop string is found here: the request's Finished goes out at once and the engine is told to free
the sequence (engine/scheduler.py decides every other end). Pause and logits-slot releases go straight
to the engine: they carry no order with admissions.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import msgspec

from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence
from ember.daemon.logging_setup import get_logger
from ember.daemon.server.engine_host import EngineHost
from ember.daemon.server.engine_thread import EngineStats, EngineThread, Progress
from ember.daemon.server.request import Request
from ember.daemon.text.chat_template import ChatTemplateError
from ember.daemon.text.grammar import compile_grammar
from ember.daemon.text.tool_format import call_grammar, template_tools
from ember.daemon.text.stop_strings import StopStrings
from ember.daemon.text.tokenize_pool import TokenizePool
from ember.daemon.text.tokenizer import Tokenizer
from ember.protocol.limits import LimitExceeded, Limits
from ember.protocol.messages import (Error, ErrorCode, Finished, FinishReason, ServerMessage, Timings, ToolChoice,
                                     Tokens, TopLogprob, Usage)

Output = tuple[bytes, ServerMessage]  # (client identity, message)
_Item = Callable[[], None]


class TextWorker:
    def __init__(self, *, limits: Limits, publish: Callable[[list[Output]], None], on_stopped: Callable[[], None],
                 engine: EngineHost | None = None, contexts: Mapping[str, int] | None = None,
                 cores: Mapping[str, EngineCore] | None = None, **engine_options: Any) -> None:
        """The engine: `engine`, the daemon's engine process, whose models take prompts of up to
        `contexts` tokens (per model name); or, in process, an EngineThread made here over `cores`,
        each model's engine core (engine_options: its new_ring, heartbeat, heartbeat_interval,
        setup). Frames go to `publish`; `on_stopped` runs once the engine has stopped and its last
        frames are published."""
        self._limits = limits
        self._publish = publish
        self._on_stopped = on_stopped
        self._crashed = False
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self.tokenize_pool = TokenizePool()  # the server's Tokenize and Detokenize use it too
        self._tokenizing: dict[tuple[bytes, int], Request] = {}  # prompts in the pool's workers
        self._stopping: float | None = None  # the shutdown's deadline, until it is forwarded to the engine
        self._thread = threading.Thread(target=self._run, name="ember-text", daemon=True)
        self.engine: EngineThread | EngineHost
        if engine is not None:
            assert contexts is not None
            self._contexts = dict(contexts)
            engine.bind(self._frames, self.engine_stopped)
            self.engine = engine
        else:
            assert cores is not None
            self._contexts = {name: core.scheduler.max_context for name, core in cores.items()}
            self.engine = EngineThread(cores=cores, progress=self.progress, on_stopped=self.engine_stopped,
                                       **engine_options)
        self.log = get_logger()

    # --- the I/O loop's commands (any thread) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self.engine.start()

    def submit(self, request: Request) -> None:
        self._queue.put(lambda: self._admit(request))

    def cancel(self, client: bytes, request_id: int) -> None:
        self._queue.put(lambda: self._cancel(client, request_id))

    def drop_client(self, client: bytes) -> None:
        self._queue.put(lambda: self._drop_client(client))

    def shutdown(self, drain_timeout: float) -> None:
        deadline = time.monotonic() + drain_timeout
        self._queue.put(lambda: self._shutdown(deadline))

    def check_text_size(self, model_name: str, tokenizer: Tokenizer, text: str) -> int:
        """`text`'s size in bytes, or LimitExceeded if its size alone shows that it has more tokens than
        a prompt for `model_name` may: it is then refused without being tokenized. Any thread (the I/O
        loop checks a Tokenize's text with it)."""
        size = _utf8_len(text)
        self._limits.check_prompt_bytes(size, tokenizer.max_token_bytes, self._contexts[model_name] - 1)
        return size

    def set_paused(self, client: bytes, paused: bool) -> None:
        self.engine.set_paused(client, paused)

    def hold(self, client: bytes, request_id: int, held: bool) -> None:
        self.engine.hold(client, request_id, held)

    def release(self, client: bytes, slots: Iterable[int], device: bool = False) -> None:
        self.engine.release(client, slots, device)

    @property
    def crashed(self) -> bool:
        """The text thread or the engine ended on an internal error, not on a shutdown."""
        return self._crashed or self.engine.crashed

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    # --- the engine's reports (engine thread) --------------------------------------------------------
    def progress(self, news: list[Progress]) -> None:
        self._queue.put(lambda: self._frames(news))

    def engine_stopped(self) -> None:
        """The engine thread ended: publish what its last steps produced, then stop."""
        self._queue.put(None)

    # --- the worker thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                item()
        except Exception:  # a bug here: say so, and stop the daemon with a failure (systemd restarts it)
            self.log.exception("text worker failed")
            self._crashed = True
        finally:
            self.tokenize_pool.close()
            self._on_stopped()

    def _admit(self, r: Request) -> None:
        """Check its grammar; render the prompt and refuse it by its size if it cannot fit; tokenize it
        here if it is small, in a worker process if not (its ids come back through the queue), then
        _start it."""
        try:
            if r.grammar is not None:
                r.compiled_grammar = compile_grammar(r.grammar.kind, r.grammar.text)
            tools = self._tools(r)
            if r.prompt_ids is None:
                text = r.model.render_chat(r.messages, tools=tools) if r.messages is not None else r.prompt_text or ""
                if self.check_text_size(r.model_name, r.model.tokenizer, text) > self.tokenize_pool.inline_bytes:
                    return self._offload(r, text)
                # a chat template writes its own special tokens (Model.chat_ids)
                r.prompt_ids = r.model.tokenize(text, add_special=r.messages is None)
        except LimitExceeded as e:
            return self._reject(r, e.code, str(e))
        except (ValueError, ChatTemplateError) as e:  # TokenizerError is a ValueError
            return self._reject(r, ErrorCode.BAD_REQUEST, str(e))
        self._start(r)

    @staticmethod
    def _tools(r: Request) -> list[dict[str, Any]] | None:
        """The tools its template renders (none with tool_choice none), and where a call is required,
        the grammar that makes it one; ValueError says what is wrong."""
        if not r.tools or r.tool_choice == ToolChoice.NONE:
            return None
        fmt = r.model.tool_format
        if not fmt:
            raise ValueError(f"model {r.model_name!r} cannot call tools: its chat template renders none")
        tools = template_tools(r.tools)
        if r.tool_choice == ToolChoice.REQUIRED:
            if r.compiled_grammar is not None:
                raise ValueError("a required tool call and a grammar of its own: give one of them")
            r.compiled_grammar = compile_grammar("lark", call_grammar(fmt, r.tools, r.tool_name, r.parallel_tool_calls))
        return tools

    def _offload(self, r: Request, text: str) -> None:
        try:
            future = self.tokenize_pool.encode(r.model.path, r.model.tokenizer, text, add_special=r.messages is None)
        except (OSError, RuntimeError) as e:  # no process could be started, or the pool is closing
            return self._reject(r, ErrorCode.INTERNAL, f"cannot tokenize the prompt: {e}")
        self._tokenizing[r.key] = r
        future.add_done_callback(lambda f: self._queue.put(lambda: self._tokenized(r, f)))

    def _tokenized(self, r: Request, future: Future[list[int]]) -> None:
        """A worker's ids for `r`'s prompt (r.done: it was cancelled meanwhile, and answered)."""
        if self._tokenizing.get(r.key) is r:
            del self._tokenizing[r.key]
        if not r.done:
            try:
                r.prompt_ids = future.result()
            except ValueError as e:  # TokenizerError
                self._reject(r, ErrorCode.BAD_REQUEST, str(e))
            except Exception as e:  # a worker died, or the model file changed on disk
                r.log.error("tokenizing in a worker failed", error=f"{type(e).__name__}: {e}")
                self._reject(r, ErrorCode.INTERNAL, f"cannot tokenize the prompt: {type(e).__name__}")
            else:
                self._start(r)
        self._forward_shutdown()

    def _start(self, r: Request) -> None:
        """Check the tokenized prompt and hand the sequence to the engine, or answer an Error."""
        assert r.prompt_ids is not None
        try:
            if not r.prompt_ids:
                raise ValueError("the prompt is empty")
            self._limits.check_prompt(len(r.prompt_ids), self._contexts[r.model_name] - 1)
        except LimitExceeded as e:
            return self._reject(r, e.code, str(e))
        except ValueError as e:
            return self._reject(r, ErrorCode.BAD_REQUEST, str(e))
        if r.max_tokens == 0:  # nothing to generate: the usage is known without running the prompt
            return self._end_here(r, FinishReason.LENGTH)
        r.text = r.model.tokenizer.stream_decoder(context=r.prompt_ids)
        r.stops = StopStrings(r.stop)
        stop_ids = frozenset(r.stop_ids) | (frozenset() if r.ignore_eos else frozenset(r.model.tokenizer.eos_ids))
        r.seq = Sequence(r.prompt_ids, r.max_tokens, r.params, r.seed, stop_ids, client=r.client,
                         wants_logits=r.return_logits, wants_logprob=r.logprobs or r.params.logprobs > 0,
                         grammar=r.compiled_grammar, cache_salt=r.cache_salt, device_logits=r.device_logits)
        self.engine.add(r)

    # --- commands that may meet a prompt still being tokenized ---------------------------------------
    def _cancel(self, client: bytes, request_id: int) -> None:
        r = self._tokenizing.pop((client, request_id), None)
        if r is None:
            return self.engine.cancel(client, request_id)
        self._end_here(r, FinishReason.CANCELLED)  # its ids, when they come, go nowhere

    def _drop_client(self, client: bytes) -> None:
        for key in [key for key in self._tokenizing if key[0] == client]:
            self._cancel(*key)
        self.engine.drop_client(client)

    def _shutdown(self, deadline: float) -> None:
        """Drain: the engine stops once it has nothing left, so the prompts being tokenized reach it
        first; any still in a worker at the deadline are cancelled."""
        self._stopping = deadline
        if self._tokenizing:
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), lambda: self._queue.put(self._deadline))
            timer.daemon = True
            timer.start()
        self._forward_shutdown()

    def _deadline(self) -> None:
        for key in list(self._tokenizing):
            self._cancel(*key)
        self._forward_shutdown()

    def _forward_shutdown(self) -> None:
        if self._stopping is not None and not self._tokenizing:
            self.engine.shutdown(max(0.0, self._stopping - time.monotonic()))
            self._stopping = None

    def _frames(self, news: list[Progress]) -> None:
        frames: list[Output] = []
        for p in news:
            r = p.request
            if r.done:  # ended here already (a stop string): the engine's late news goes nowhere
                for slots, device in ((p.logits, False), (p.device_logits, True)):
                    if slots:  # nobody will read them
                        self.engine.release(r.client, [slot.slot for slot in slots], device)
                continue
            if p.error is not None:
                frames.append(self._refusal(r, p.error, p.message))
                continue
            frames += self._request_frames(r, p)
        if frames:
            self._publish(frames)

    def _request_frames(self, r: Request, p: Progress) -> list[Output]:
        assert r.text is not None and r.stops is not None
        if p.tokens and r.first_token is None:
            r.first_token = time.perf_counter()
        shown = p.tokens
        if p.finish == FinishReason.STOP and shown and r.seq is not None and shown[-1] in r.seq.stop_ids:
            shown = shown[:-1]  # an end token's text (<|endoftext|>) never reaches the user; its id does
        pieces = []
        for i, t in enumerate(shown):
            pieces.append(r.stops.feed(r.text.feed(t)))
            if r.stops.stopped and i + 1 < len(p.tokens):
                p = _cut(p, i + 1)  # the ids (and usage) end with the token that completed the stop string
                break
        text = "".join(pieces)
        r.completion_tokens += len(p.tokens)
        finish = FinishReason.STOP if r.stops.stopped else p.finish
        if finish is not None:
            text += r.stops.feed(r.text.flush()) + r.stops.flush()  # text held back for a partial character
            if r.stops.stopped and finish == FinishReason.LENGTH:  # the held text ended in a stop string
                finish = FinishReason.STOP
        frames: list[Output] = []
        if p.tokens or text:
            frames.append((r.client, self._tokens(r, p, text)))
        if finish is not None:
            r.done = True
            if p.finish is None:  # the engine still runs it: free the sequence
                self.engine.finish(r, finish)
            frames.append((r.client, self._finished(r, finish, p.message)))
        return frames

    @staticmethod
    def _tokens(r: Request, p: Progress, text: str) -> Tokens:
        if not p.tokens:
            return Tokens(r.id, (), text)
        top = tuple(tuple(TopLogprob(t, lp) for t, lp in c.top) for c in p.choices) if r.params.logprobs else None
        return Tokens(r.id, tuple(p.tokens), text, tuple(c.logprob for c in p.choices) if r.logprobs else None,
                      top, p.logits, p.device_logits)

    @staticmethod
    def _finished(r: Request, reason: str, message: str) -> Finished:
        now = time.perf_counter()
        started = (r.seq.started if r.seq is not None else None) or now
        first = r.first_token or now
        timings = Timings(queued_ms=_ms(started - r.admitted), prefill_ms=_ms(first - started),
                          decode_ms=_ms(now - first), total_ms=_ms(now - r.admitted))
        r.log.info("request finished", reason=reason, completion_tokens=r.completion_tokens,
                   total_ms=round(timings.total_ms, 1), **({"error": message} if message else {}))
        return Finished(r.id, reason, Usage(len(r.prompt_ids or ()), r.completion_tokens), timings, message)

    def _end_here(self, r: Request, reason: str) -> None:
        """End a request the engine never got: its Finished goes out now."""
        r.done = True
        self._publish([(r.client, self._finished(r, reason, ""))])

    def _reject(self, r: Request, code: str, message: str) -> None:
        self._publish([self._refusal(r, code, message)])

    @staticmethod
    def _refusal(r: Request, code: str, message: str) -> Output:
        r.done = True
        r.log.info("request refused", code=code, error=message)
        return (r.client, Error(r.id, code, message))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _cut(p: Progress, n: int) -> Progress:
    """p's first n tokens: the engine ran on past a stop string within its step or burst, and how far
    depends on the batch, not on the request."""
    def first_rows(slots: Any) -> Any:  # the slots' first n rows (the client still releases them)
        return None if slots is None else tuple(
            msgspec.structs.replace(s, shape=(min(n, s.shape[0]), *s.shape[1:])) for s in slots)

    return dataclasses.replace(p, tokens=p.tokens[:n], choices=p.choices[:n], logits=first_rows(p.logits),
                               device_logits=first_rows(p.device_logits))


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
