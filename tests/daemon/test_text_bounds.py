"""One client must never hurt another through text or frames: a text too long for a prompt is refused by
its size before it is tokenized, big texts are tokenized in worker processes (never holding the GIL the
engine's step loop needs), and a huge multi-part message is cut off as it arrives. Bystander streams keep
their pace and the daemon's memory stays where it was."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tokenizers
import zmq
from daemon_process import DaemonProcess

from ember.client import Client
from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.server.request import request_from_generate
from ember.daemon.text import tokenize_pool
from ember.daemon.server.text_worker import Output, TextWorker
from ember.daemon.text.tokenize_pool import TokenizePool, TokenizerChanged
from ember.daemon.text.tokenizer import Tokenizer
from ember.protocol import messages as m
from ember.protocol.codec import Codec
from ember.protocol.limits import ContextLengthExceeded, LimitExceeded, Limits

sys.path.insert(0, str(Path(__file__).parent.parent))
from tokenizer_fixtures import byte_bpe_vocab, corpus, gguf_metadata, spm_vocab, write_vocab_gguf  # noqa: E402

pytestmark = pytest.mark.slow

codec = Codec()
WAIT = 60.0  # seconds: a bound for a hung daemon, never a pacing
MAX_GAP = 0.5  # seconds between a bystander's frames while another client attacks
TEXT = "All work and no play makes Jack a dull boy. def f(x): return x * 2\n"
# texts whose tokens per byte are as few as the vocabulary allows, beside ordinary ones
AWKWARD = [" " * 5000, "-" * 3000, "\n" * 999, "=" * 777 + "x", "😀" * 300, TEXT * 50, "ab" * 2000, "\t" * 1000]


# --- the size bound ------------------------------------------------------------------------------------
def assert_bounds_every_text(tok: Tokenizer) -> None:
    bound = tok.max_token_bytes
    assert bound is not None and bound >= 1
    for text in corpus(200, seed=7) + AWKWARD:
        assert len(tok.encode(text, add_special=False)) * bound >= len(text.encode()), text[:40]


def test_the_demo_models_longest_token_bounds_its_texts(demo_model) -> None:  # type: ignore[no-untyped-def]
    assert demo_model.tokenizer.max_token_bytes == 128  # its longest token: 128 spaces
    assert_bounds_every_text(demo_model.tokenizer)


def test_gguf_vocabularies_are_bounded_only_with_every_byte_a_token(tmp_path: Path) -> None:
    tokens, types, merges = byte_bpe_vocab()
    assert_bounds_every_text(Tokenizer.from_gguf(gguf_metadata(write_vocab_gguf(tmp_path / "b.gguf", "gpt2", tokens, types, merges=merges))))
    tokens, types, scores = spm_vocab()
    spm = Tokenizer.from_gguf(gguf_metadata(write_vocab_gguf(tmp_path / "s.gguf", "llama", tokens, types, scores=scores)))
    assert_bounds_every_text(spm)
    # without byte tokens a run of unknown characters is one (fused) unknown token: no bound
    keep = [i for i, t in enumerate(tokens) if not t.startswith("<0x")]
    no_bytes = write_vocab_gguf(tmp_path / "n.gguf", "llama", [tokens[i] for i in keep], [types[i] for i in keep],
                                scores=[scores[i] for i in keep])
    assert Tokenizer.from_gguf(gguf_metadata(no_bytes)).max_token_bytes is None


def hf_tokenizer(path: Path, core: tokenizers.Tokenizer) -> Tokenizer:
    path.mkdir()
    core.save(str(path / "tokenizer.json"))
    return Tokenizer.from_hf_dir(path)


def trained_bpe(normalizer: object = None, pre_tokenizer: object = None) -> tokenizers.Tokenizer:
    core = tokenizers.Tokenizer(tokenizers.models.BPE())
    core.normalizer = normalizer
    core.pre_tokenizer = pre_tokenizer or tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([TEXT, *AWKWARD, *corpus(100)], trainer)
    return core


def stripping_token(core: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    core.add_special_tokens([tokenizers.AddedToken("<|end|>", rstrip=True)])  # "<|end|>" + spaces: one token
    return core


def test_hugging_face_bounds_allow_for_normalizers_and_refuse_text_eaters(tmp_path: Path) -> None:
    n = tokenizers.normalizers
    plain = hf_tokenizer(tmp_path / "plain", trained_bpe())
    assert_bounds_every_text(plain)
    nfkc = hf_tokenizer(tmp_path / "nfkc", trained_bpe(n.Sequence([n.NFKC(), n.Lowercase()])))
    assert nfkc.max_token_bytes is not None
    # fullwidth letters, jamo, the Kelvin sign: 3x shorter; mathematical letters: 4x
    for text in ["Ａ" * 500, "\u1100\u1161\u11a8" * 300, "\u212a" * 400, "\U0001d400" * 300]:
        assert len(nfkc.encode(text, add_special=False)) * nfkc.max_token_bytes >= len(text.encode())
    assert_bounds_every_text(nfkc)
    for name, eater in [("strip", trained_bpe(n.Strip())), ("bert", trained_bpe(n.BertNormalizer())),
                        ("ws", trained_bpe(pre_tokenizer=tokenizers.pre_tokenizers.Whitespace())),
                        ("wordpiece", tokenizers.Tokenizer(tokenizers.models.WordPiece({"[UNK]": 0, "a": 1}))),
                        ("rstrip", stripping_token(trained_bpe()))]:
        assert hf_tokenizer(tmp_path / name, eater).max_token_bytes is None, name


def test_a_text_too_long_for_the_context_is_refused_by_its_size() -> None:
    limits = Limits(max_prompt_tokens=100)
    limits.check_prompt_bytes(1000, 10, context_length=4096)  # may be 100 tokens: tokenize and count
    with pytest.raises(LimitExceeded, match="at least 101 tokens"):
        limits.check_prompt_bytes(1001, 10, context_length=4096)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 51 tokens. However, your prompt "
                                                    "resulted in at least 51 tokens"):  # the context binds: OpenAI's words
        limits.check_prompt_bytes(501, 10, context_length=50)
    limits.check_prompt_bytes(10**9, None, context_length=50)  # no bound: only tokenizing tells
    limits.check_detokenize(100 + limits.max_tokens)
    with pytest.raises(LimitExceeded):
        limits.check_detokenize(101 + limits.max_tokens)


# --- the worker processes --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool() -> Iterator[TokenizePool]:
    p = TokenizePool(workers=1)
    yield p
    p.close()


def test_workers_tokenize_as_the_daemon_would(pool: TokenizePool, demo_model) -> None:  # type: ignore[no-untyped-def]
    tok = demo_model.tokenizer
    texts = [TEXT * 2000, "<|im_start|>user\nhi<|im_end|>" * 50, *AWKWARD]
    futures = [(t, s, pool.encode(demo_model.path, tok, t, s)) for t in texts for s in (True, False)]
    for text, add_special, future in futures:
        assert future.result(WAIT) == tok.encode(text, add_special=add_special)
    ids = tok.encode(TEXT * 300)
    assert pool.decode(demo_model.path, tok, ids).result(WAIT) == tok.decode(ids)


def test_a_worker_refuses_a_model_file_changed_on_disk(pool: TokenizePool, demo_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "model.gguf").symlink_to(DEMO_MODEL)  # a path the worker has not loaded yet
    vocab, probe = tokenize_pool.fingerprint(demo_model.tokenizer)
    future = pool._submit(tokenize_pool._encode, str(tmp_path / "model.gguf"), (vocab, probe[:-1]), "x", True)
    with pytest.raises(TokenizerChanged):
        future.result(WAIT)


class Worker:
    """A TextWorker in process whose prompts over `inline_bytes` go to its pool."""

    def __init__(self, model, inline_bytes: int) -> None:  # type: ignore[no-untyped-def]
        self.model, self.outputs = model, []  # type: ignore[var-annotated]
        self.cond = threading.Condition()
        self.stopped = threading.Event()
        core = model.engine(64 * KV_BLOCK, max_running=2)
        self.text = TextWorker(cores={"demo": core}, limits=Limits(), publish=self._publish, on_stopped=self.stopped.set,
                               new_ring=lambda user, device: None)
        self.text.tokenize_pool.inline_bytes = inline_bytes
        self.text.start()

    def _publish(self, outputs: list[Output]) -> None:
        with self.cond:
            self.outputs += outputs
            self.cond.notify_all()

    def submit(self, client: bytes, msg: m.Generate) -> None:
        self.text.submit(request_from_generate(client, msg, {"demo": self.model}, Limits()))

    def ended(self, client: bytes, request_id: int) -> list[object]:
        """The frames of a request, once its last one arrived."""
        def frames() -> list[object]:
            return [o for c, o in self.outputs if (c, getattr(o, "id", None)) == (client, request_id)]
        with self.cond:
            assert self.cond.wait_for(lambda: any(isinstance(f, (m.Finished, m.Error)) for f in frames()), WAIT)
            return frames()


@pytest.fixture
def worker(demo_model) -> Iterator[Worker]:  # type: ignore[no-untyped-def]
    w = Worker(demo_model, inline_bytes=16)
    yield w
    w.text.shutdown(0.0)
    assert w.stopped.wait(WAIT)


def test_a_prompt_tokenized_in_a_worker_streams_as_model_generate(worker: Worker, demo_model) -> None:  # type: ignore[no-untyped-def]
    prompt = "def fibonacci(n):\n    "  # over 16 bytes: to the pool
    worker.submit(b"a", m.Generate(1, prompt=prompt, max_tokens=12))
    worker.submit(b"a", m.Generate(3, prompt="x" * 600_000))  # over 4095 tokens of at most 128 bytes
    frames = worker.ended(b"a", 1)
    assert [t for f in frames if isinstance(f, m.Tokens) for t in f.token_ids] == list(demo_model.generate(prompt, max_tokens=12))
    refusal = worker.ended(b"a", 3)[-1]
    assert isinstance(refusal, m.Error) and refusal.code == m.ErrorCode.CONTEXT_LENGTH and "at least" in refusal.message


def test_cancels_and_dropped_clients_reach_prompts_being_tokenized(worker: Worker) -> None:
    long = TEXT * 20  # to the pool; the cancel is queued behind the Generate, before its ids can be
    worker.submit(b"c", m.Generate(1, prompt=long, max_tokens=4000, ignore_eos=True))
    worker.text.cancel(b"c", 1)
    worker.submit(b"d", m.Generate(1, prompt=long, max_tokens=4000, ignore_eos=True))
    worker.text.drop_client(b"d")
    for client in (b"c", b"d"):
        frames = worker.ended(client, 1)
        assert isinstance(frames[-1], m.Finished) and frames[-1].reason == m.FinishReason.CANCELLED
        assert not any(isinstance(f, m.Tokens) for f in frames)
    with worker.cond:
        worker.outputs.clear()
    worker.submit(b"c", m.Generate(1, prompt=long, max_tokens=2))  # the id is free again, and runs
    assert worker.ended(b"c", 1)[-1].reason == m.FinishReason.LENGTH


def test_the_shutdown_waits_for_prompts_being_tokenized(demo_model) -> None:  # type: ignore[no-untyped-def]
    w = Worker(demo_model, inline_bytes=16)
    w.submit(b"s", m.Generate(1, prompt=TEXT * 10, max_tokens=3))
    w.text.shutdown(30.0)
    frames = w.ended(b"s", 1)
    assert frames[-1].reason == m.FinishReason.LENGTH and len([f for f in frames if isinstance(f, m.Tokens)]) >= 1
    assert w.stopped.wait(WAIT)


# --- against a real daemon, beside a bystander stream ----------------------------------------------------
CONFIG = """
[server]
probe_interval = 0.2
[limits]
max_tokens = 4096
"""


@pytest.fixture(scope="module")
def daemon4() -> Iterator[DaemonProcess]:
    """A daemon with the default max_message_bytes (4 MiB)."""
    d = DaemonProcess(CONFIG).wait_ready()
    yield d
    d.stop()


class Bystander:
    """Streams completions back to back in a thread and notes when each frame arrives."""

    def __init__(self, socket: Path) -> None:
        self.times: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(socket,), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + WAIT
        while len(self.times) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self, socket: Path) -> None:
        try:
            with Client(socket) as client:
                while not self._stop.is_set():
                    for _ in client.generate("def fibonacci(n):", max_tokens=200, ignore_eos=True):
                        self.times.append(time.monotonic())
        except Exception as e:  # asserted by the tests
            self.failures.append(repr(e))

    def largest_gap(self, since: float, until: float) -> float:
        times = [since, *(t for t in self.times if since < t < until), until]
        return max(b - a for a, b in zip(times, times[1:]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)


@pytest.fixture
def bystander(daemon4: DaemonProcess) -> Iterator[Bystander]:
    b = Bystander(daemon4.socket)
    yield b
    b.stop()
    assert b.failures == []


@pytest.fixture
def attacker(daemon4: DaemonProcess) -> Iterator[zmq.Socket]:  # type: ignore[type-arg]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
    sock.connect(f"ipc://{daemon4.socket}")
    yield sock
    ctx.destroy(linger=0)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def replies(sock: zmq.Socket, count: int) -> list[m.Wire]:  # type: ignore[type-arg]
    out: list[m.Wire] = []
    while len(out) < count:
        reply = codec.decode_server(sock.recv())
        if not isinstance(reply, m.Ping):
            out.append(reply)
    return out


def test_huge_tokenize_requests_are_refused_by_size_and_stall_nobody(daemon4, bystander, attacker) -> None:  # type: ignore[no-untyped-def]
    pid = daemon4.proc.pid
    text = (TEXT * 50_000)[:3_000_000]
    before = rss_mib(pid)
    start = time.monotonic()
    for i in range(16):
        attacker.send(codec.encode(m.Tokenize(i, text)))
    got = replies(attacker, 16)
    end = time.monotonic()
    time.sleep(0.3)  # and the bystander goes on after
    growth = rss_mib(pid) - before
    print(f"16 x 3 MB Tokenize: answered in {end - start:.2f} s, bystander's largest gap "
          f"{bystander.largest_gap(start, end + 0.3) * 1000:.0f} ms, RSS {before:.0f} -> {before + growth:.0f} MiB")
    assert all(isinstance(r, m.Error) and r.code == m.ErrorCode.CONTEXT_LENGTH for r in got), got[:2]
    assert bystander.largest_gap(start, end + 0.3) < MAX_GAP
    assert growth < 300


def test_big_texts_within_the_bound_are_tokenized_off_the_gil(daemon4, bystander, attacker, demo_model) -> None:  # type: ignore[no-untyped-def]
    pid = daemon4.proc.pid
    text = (TEXT * 10_000)[:400_000]  # under 4095 tokens x 128 bytes: it must be tokenized to be judged
    expected = demo_model.tokenize(text)
    before = rss_mib(pid)
    start = time.monotonic()
    for i in range(16):
        attacker.send(codec.encode(m.Tokenize(i, text)))
    attacker.send(codec.encode(m.Generate(99, prompt=text)))  # ~90k tokens: over the context once counted
    got = replies(attacker, 17)
    end = time.monotonic()
    time.sleep(0.3)
    growth = rss_mib(pid) - before
    print(f"16 x 400 KB Tokenize + a 400 KB prompt: answered in {end - start:.2f} s, bystander's largest gap "
          f"{bystander.largest_gap(start, end + 0.3) * 1000:.0f} ms, RSS {before:.0f} -> {before + growth:.0f} MiB")
    ids = [r for r in got if isinstance(r, m.TokenIds)]
    assert len(ids) == 16 and all(list(r.token_ids) == expected for r in ids)
    refusal = next(r for r in got if isinstance(r, m.Error))
    assert (refusal.id, refusal.code) == (99, m.ErrorCode.CONTEXT_LENGTH)
    assert bystander.largest_gap(start, end + 0.3) < MAX_GAP
    assert growth < 300


def test_a_huge_multi_part_message_is_cut_off_as_it_arrives(daemon4, bystander, attacker) -> None:  # type: ignore[no-untyped-def]
    """128 frames of 4 MiB in one message: the relay on the public socket closes the connection once the
    message passes max_message_bytes (before it, libzmq took the whole 512 MiB into the daemon before
    the daemon saw a frame of it). The client's libzmq reconnects, dropping the rest of the message,
    and its next request is answered."""
    pid = daemon4.proc.pid
    before, peak_before = rss_mib(pid), rss_mib(pid, "VmHWM")
    frame = b"\0" * (4 << 20)  # each frame at max_message_bytes: libzmq alone let every one of them through
    start = time.monotonic()
    attacker.send_multipart([frame] * 128, copy=False)
    attacker.send(codec.encode(m.Health(1)))
    got = replies(attacker, 1)
    end = time.monotonic()
    time.sleep(0.3)
    growth, peak = rss_mib(pid) - before, rss_mib(pid, "VmHWM") - peak_before
    served = len([t for t in bystander.times if t > start])
    print(f"128 x 4 MiB message: cut off, next request answered in {end - start:.2f} s, RSS {before:.0f} -> "
          f"{before + growth:.0f} MiB (peak +{peak:.0f}), bystander's largest gap "
          f"{bystander.largest_gap(start, end + 0.3) * 1000:.0f} ms")
    assert isinstance(got[0], m.HealthStatus)
    assert growth < 32 and peak < 32  # the message was 512 MiB
    assert any("client stream refused" in str(e.get("event")) for e in daemon4.log_events())
    assert served > 0


def test_tokenizer_requests_are_bounded_per_client_and_in_all(daemon4) -> None:  # type: ignore[no-untyped-def]
    # each text keeps the worker busy ~0.2 s: every request is in before the first is answered
    payload = codec.encode(m.Tokenize(0, (TEXT * 5000)[:300_000]))
    ctx = zmq.Context()
    try:
        first, *others = socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
        for sock in socks:
            sock.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
            sock.connect(f"ipc://{daemon4.socket}")
        for _ in range(18):
            first.send(payload)
        over = replies(first, 2)  # at once: 16 in flight per client
        for sock in others:
            for _ in range(16):
                sock.send(payload)
        got = [replies(first, 16), *(replies(sock, 16) for sock in others)]
    finally:
        ctx.destroy(linger=0)
    assert [(r.code, r.message) for r in over] == [(m.ErrorCode.LIMIT, "too many tokenizer requests in flight")] * 2
    assert all(isinstance(r, m.TokenIds) for r in got[0])
    others_answered = [r for rs in got[1:] for r in rs if isinstance(r, m.TokenIds)]
    busy = [r for rs in got[1:] for r in rs if isinstance(r, m.Error) and r.code == m.ErrorCode.BUSY]
    assert (len(others_answered), len(busy)) == (4 + 32 - 16, 12)  # max_active + max_queued in all
