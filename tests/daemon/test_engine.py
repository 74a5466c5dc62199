"""The engine thread behind its text worker, in process: fed by commands, observed through what it publishes."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.server.text_worker import Output, TextWorker
from ember.daemon.server.request import Request, RequestError, request_from_generate
from ember.protocol.limits import Limits
from ember.protocol.messages import Error, Finished, Generate, Tokens
from ember.protocol.shm_ring import ShmRing, ShmRingReader

pytestmark = pytest.mark.slow

WAIT = 30.0  # seconds: a bound for a hung engine, never a pacing


class Harness:
    def __init__(self, model, max_active: int = 2, slots: int = 2, kv_blocks: int = 64,  # type: ignore[no-untyped-def]
                 stall_timeout: float = 300.0, **options: object) -> None:
        self.model = model
        self.outputs: queue.Queue[Output] = queue.Queue()
        self.stopped = threading.Event()
        self.rings: list[ShmRing] = []

        def new_ring(user: int, device: bool) -> ShmRing:
            self.rings.append(ShmRing.create(slots, model.config.vocab * 4))
            return self.rings[-1]

        core = model.engine(kv_blocks * KV_BLOCK, max_running=max_active, prefix_caching=True, **options)
        self.engine = TextWorker(cores={"demo": core}, limits=Limits(max_prompt_tokens=64), publish=self._publish,
                                 on_stopped=self.stopped.set, new_ring=new_ring, stall_timeout=stall_timeout)
        self.engine.start()

    def _publish(self, outputs: list[Output]) -> None:
        for o in outputs:
            self.outputs.put(o)

    def request(self, client: bytes, msg: Generate) -> Request:
        r = request_from_generate(client, msg, {"demo": self.model}, Limits())
        self.engine.submit(r)
        return r

    def next(self) -> Output:
        return self.outputs.get(timeout=WAIT)

    def until_finished(self, count: int) -> dict[tuple[bytes, int], list[object]]:
        frames: dict[tuple[bytes, int], list[object]] = {}
        done = 0
        while done < count:
            client, message = self.next()
            frames.setdefault((client, message.id), []).append(message)
            done += isinstance(message, (Finished, Error))
        return frames

    def stop(self) -> None:
        self.engine.shutdown(0.0)
        assert self.stopped.wait(WAIT)


@pytest.fixture
def harness(demo_model) -> Iterator[Harness]:  # type: ignore[no-untyped-def]
    h = Harness(demo_model)
    yield h
    h.stop()


def tokens_of(frames: list[object]) -> list[int]:
    return [t for f in frames if isinstance(f, Tokens) for t in f.token_ids]


def test_interleaved_requests_each_equal_model_generate(harness: Harness, demo_model) -> None:  # type: ignore[no-untyped-def]
    prompts = ["def f(x):", "import numpy as np\n", "class A:"]
    for i, p in enumerate(prompts):
        harness.request(b"c", Generate(i, prompt=p, max_tokens=15, temperature=0.8, seed=i))
    frames = harness.until_finished(3)
    for i, p in enumerate(prompts):
        expected = list(demo_model.generate(p, max_tokens=15, temperature=0.8, seed=i))
        got = frames[(b"c", i)]
        assert tokens_of(got) == expected
        assert "".join(f.text for f in got if isinstance(f, Tokens)) == demo_model.detokenize(expected)
        assert isinstance(got[-1], Finished) and got[-1].usage.completion_tokens == len(expected)


def test_cancel_stops_within_a_step_and_queued_requests_never_run(demo_model) -> None:  # type: ignore[no-untyped-def]
    # one token a step: a decode burst is one step of up to MAX_BURST tokens, and the model's burst clock,
    # warmed by earlier tests, may size the first burst past two tokens
    h = Harness(demo_model, max_active=1, decode_burst=0.0)
    h.request(b"a", Generate(1, prompt="x", max_tokens=4000, ignore_eos=True))
    h.request(b"b", Generate(2, prompt="y", max_tokens=4000, ignore_eos=True))  # queued behind a:1
    client, first = h.next()
    assert (client, first.id) == (b"a", 1) and isinstance(first, Tokens)
    h.engine.drop_client(b"b")  # gone before it started
    h.engine.cancel(b"a", 1)
    frames = h.until_finished(2)
    assert frames[(b"b", 2)] == [frames[(b"b", 2)][0]] and frames[(b"b", 2)][0].reason == "cancelled"
    a = frames[(b"a", 1)]
    assert a[-1].reason == "cancelled" and len(tokens_of(a)) <= 2  # the step in progress, at most
    h.stop()


def test_paused_client_waits_and_resumes(harness: Harness) -> None:
    harness.engine.set_paused(b"p", True)
    harness.request(b"p", Generate(1, prompt="x", max_tokens=5, ignore_eos=True))
    harness.request(b"q", Generate(2, prompt="x", max_tokens=5, ignore_eos=True))
    frames = harness.until_finished(1)
    assert list(frames) == [(b"q", 2)]  # p's request made no progress meanwhile
    harness.engine.set_paused(b"p", False)
    assert len(tokens_of(harness.until_finished(1)[(b"p", 1)])) == 5


def test_full_logits_ring_pauses_until_release(harness: Harness, demo_model) -> None:  # type: ignore[no-untyped-def]
    harness.request(b"r", Generate(1, prompt="def f(x):", max_tokens=6, return_logits=True))
    reader, got, rows = ShmRingReader(), [], []
    while not got or not isinstance(got[-1][1], Finished):
        try:
            got.append(harness.outputs.get(timeout=0.5 if len(got) >= 2 else WAIT))
        except queue.Empty:  # two slots held: the engine must be waiting for us
            assert len(got) == 2 and harness.rings[0].free_slots == 0
            for _, t in got:
                rows.append(reader.view(t.logits[0]).copy())
                harness.engine.release(b"r", [t.logits[0].slot])
            got.clear()
            continue
        if isinstance(got[-1][1], Tokens) and len(got) > 2:
            pytest.fail("a third frame while two slots were held")
    rows += [reader.view(t.logits[0]).copy() for _, t in got if isinstance(t, Tokens)]
    tokens = list(demo_model.generate("def f(x):", max_tokens=6))
    assert [int(np.argmax(r)) for r in rows] == tokens


def test_bad_prompts_are_errors_not_crashes(harness: Harness) -> None:
    harness.request(b"e", Generate(1, token_ids=tuple(range(65))))  # over max_prompt_tokens
    harness.request(b"e", Generate(2, prompt=""))
    with pytest.raises(RequestError, match="messages is empty"):  # refused before it reaches the engine
        harness.request(b"e", Generate(3, messages=()))
    frames = harness.until_finished(2)
    assert [frames[(b"e", i)][0].code for i in (1, 2)] == ["limit", "bad_request"]
    harness.request(b"e", Generate(4, prompt="x", max_tokens=2))  # and the engine goes on
    assert isinstance(harness.until_finished(1)[(b"e", 4)][-1], Finished)


def test_stop_string_cuts_text_and_finishes(harness: Harness, demo_model) -> None:  # type: ignore[no-untyped-def]
    full = demo_model.detokenize(list(demo_model.generate("def fibonacci(n):", max_tokens=30)))
    stop = full[12:16]
    harness.request(b"s", Generate(1, prompt="def fibonacci(n):", max_tokens=30, stop=(stop,), logprobs=True, top_logprobs=2))
    frames = harness.until_finished(1)[(b"s", 1)]
    assert "".join(f.text for f in frames if isinstance(f, Tokens)) == full[: full.index(stop)]
    assert frames[-1].reason == "stop"
    t = next(f for f in frames if isinstance(f, Tokens))
    assert len(t.logprobs) == 1 and len(t.top_logprobs[0]) == 2 and t.top_logprobs[0][0].token == t.token_ids[0]


def test_ids_and_usage_end_where_a_stop_string_ends_the_text(demo_model) -> None:  # type: ignore[no-untyped-def]
    """The engine runs on past a stop string within a step's burst, as far as the batch takes it; the
    ids, their logprobs and usage still end with the token that completed the stop string, whatever ran
    beside the request (it once gave 16, 17 or 18 ids)."""
    options = dict(max_tokens=40, temperature=0.9, seed=7, repetition_penalty=1.1, presence_penalty=0.5)
    free = list(demo_model.generate("def fibonacci(n):", **options))
    text = demo_model.detokenize(free)
    for k in (10, 11, 12):  # bursts grow 1, 1, 2, 2, 3, 4 ...: some of these ends fall inside one
        stop = demo_model.detokenize(free[:k])[-3:]
        end = next(k for k in range(1, len(free) + 1) if stop in demo_model.detokenize(free[:k]))
        _check_stop(demo_model, options, stop, text, free[:end])


def _check_stop(demo_model, options, stop: str, text: str, want: list[int]) -> None:  # type: ignore[no-untyped-def]
    runs = []
    for beside in (0, 3):  # alone, and in a batch of four
        h = Harness(demo_model, slots=64)
        for j in range(beside):
            h.request(b"o", Generate(j, prompt="import os\n", max_tokens=40, ignore_eos=True))
        h.request(b"s", Generate(9, prompt="def fibonacci(n):", stop=(stop,), logprobs=True, **options))
        frames = h.until_finished(1 + beside)[(b"s", 9)]
        h.stop()
        tokens = [f for f in frames if isinstance(f, Tokens)]
        ids = [t for f in tokens for t in f.token_ids]
        assert len(ids) == sum(len(f.logprobs) for f in tokens)
        assert frames[-1].reason == "stop" and frames[-1].usage.completion_tokens == len(ids)
        assert "".join(f.text for f in tokens) == text[: text.index(stop)]
        runs.append(ids)
    assert runs[0] == runs[1] == want


def test_shutdown_drains_then_cancels_at_the_deadline(demo_model) -> None:  # type: ignore[no-untyped-def]
    h = Harness(demo_model)
    h.request(b"d", Generate(1, prompt="x", max_tokens=3))
    h.request(b"d", Generate(2, prompt="x", max_tokens=4000, ignore_eos=True))
    h.next()
    h.engine.shutdown(0.3)
    frames = h.until_finished(2)
    assert frames[(b"d", 1)][-1].reason == "length"  # finished within the drain
    assert frames[(b"d", 2)][-1].reason == "cancelled"  # cut at the deadline
    assert h.stopped.wait(WAIT)


def test_requests_share_steps_and_kv_exhaustion_loses_nothing(demo_model) -> None:  # type: ignore[no-untyped-def]
    # 6 requests at once in a pool of 6 blocks of 16 tokens, each wanting ~40: the scheduler must
    # preempt and recompute; every stream still equals Model.generate and the pool ends empty
    h = Harness(demo_model, max_active=6, kv_blocks=6)
    prompts = ["def f(x):", "import numpy as np\n", "class A:", "for i in range(3):", "x = [1,", "with open("]
    for i, p in enumerate(prompts):
        h.request(b"k", Generate(i, prompt=p, max_tokens=32, ignore_eos=True))
    frames = h.until_finished(len(prompts))
    for i, p in enumerate(prompts):
        assert tokens_of(frames[(b"k", i)]) == list(demo_model.generate(p, max_tokens=32, ignore_eos=True)), p
    deadline = time.monotonic() + WAIT  # the snapshot is refreshed just after the step's frames go out
    while h.engine.stats.running and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = h.engine.stats
    assert stats.preemptions > 0 and stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0
    h.stop()


def test_a_cancel_right_behind_its_generate_is_not_lost(harness: Harness) -> None:
    # the Generate is tokenized on the text thread and the Cancel follows it there, so the engine
    # always sees the request before its cancel (a cancel that overtook it would be dropped, and the
    # request would run its 4000 tokens)
    for i in range(5):
        harness.request(b"c", Generate(i, prompt="def f(x):" * (i + 1), max_tokens=4000, ignore_eos=True))
        harness.engine.cancel(b"c", i)
    frames = harness.until_finished(5)
    for i in range(5):
        assert frames[(b"c", i)][-1].reason == "cancelled" and len(tokens_of(frames[(b"c", i)])) <= 2


def test_logits_of_steps_after_a_stop_string_are_not_left_in_the_ring(demo_model) -> None:  # type: ignore[no-untyped-def]
    tokens = list(demo_model.generate("def fibonacci(n):", max_tokens=12))
    stop = demo_model.detokenize(tokens[:4])[-2:]  # found at the 4th token; the engine may run a step or two ahead
    h = Harness(demo_model, slots=8)
    h.request(b"l", Generate(1, prompt="def fibonacci(n):", max_tokens=12, stop=(stop,), return_logits=True))
    frames = h.until_finished(1)[(b"l", 1)]
    assert frames[-1].reason == "stop"
    h.engine.release(b"l", [s.slot for f in frames if isinstance(f, Tokens) and f.logits for s in f.logits])
    deadline = time.monotonic() + WAIT
    while h.rings[0].free_slots != 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.rings[0].free_slots == 8
    h.stop()


def test_non_reading_clients_neither_starve_others_nor_wait_forever(demo_model) -> None:  # type: ignore[no-untyped-def]
    h = Harness(demo_model, max_active=4, stall_timeout=1.0)
    for i in range(4):  # four streams fill every running slot ...
        h.request(b"slow", Generate(i, prompt="x", max_tokens=4000, ignore_eos=True))
    h.next()
    h.engine.set_paused(b"slow", True)  # ... and their client stops reading (the Outbox pauses it)
    h.request(b"fast", Generate(9, prompt="def f(x):", max_tokens=16))
    frames = h.until_finished(1)
    fast = frames[(b"fast", 9)]  # it ran although the stalled requests filled the slots
    assert isinstance(fast[-1], Finished) and fast[-1].reason != "error"
    assert tokens_of(fast) == list(demo_model.generate("def f(x):", max_tokens=16))
    stalled = h.until_finished(4)  # then the stall limit ends them, with a reason
    for i in range(4):
        last = stalled[(b"slow", i)][-1]
        assert last.reason == "error" and "read nothing" in last.message
    h.stop()


def test_a_failing_text_thread_stops_serving_as_a_crash(demo_model, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    h = Harness(demo_model)

    def broken(news: object) -> None:
        raise RuntimeError("a bug in the text thread")

    monkeypatch.setattr(h.engine, "_frames", broken)
    h.request(b"x", Generate(1, prompt="x", max_tokens=3))
    assert h.stopped.wait(WAIT)  # the server is told to stop ...
    assert h.engine.crashed  # ... and that it was a failure: `ember serve` exits 1, systemd restarts it


def test_device_logits_of_a_cpu_model_are_refused_with_the_reason(harness: Harness) -> None:
    """device_logits needs a model whose logits are on a GPU: on the CPU the request ends with an Error
    saying so (return_logits is the way there), asking for both is refused at once, and the engine goes on."""
    harness.request(b"d", Generate(1, prompt="x", max_tokens=2, device_logits=True))
    error = harness.until_finished(1)[(b"d", 1)][-1]
    assert isinstance(error, Error) and error.code == "bad_request"
    assert "device_logits needs a model whose logits are on a GPU" in error.message
    assert not harness.rings  # no ring was made for it
    with pytest.raises(RequestError, match="not both"):
        harness.request(b"d", Generate(2, prompt="x", return_logits=True, device_logits=True))
    harness.request(b"d", Generate(3, prompt="x", max_tokens=2))
    assert isinstance(harness.until_finished(1)[(b"d", 3)][-1], Finished)
