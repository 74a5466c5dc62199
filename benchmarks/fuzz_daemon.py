"""Fuzz a live daemon: many generated hostile frames from one connection while a bystander streams.

Starts a real `ember serve` (the built-in demo model unless --model), then sends `--frames` frames
from a raw ZMQ DEALER: random bytes, truncated and bit-flipped valid messages, msgpack arrays with
unknown tags and wrong types, multi-part messages, and well-formed Generates whose numbers are drawn
from extremes (NaN, infinities, subnormals, huge values, negative ids). Every 1,000 frames a Health
probe must be answered within 10 s. Beside it a bystander client runs greedy 16-token completions and
checks each against in-process generation. Prints crashes (the daemon died or stopped answering: must
be 0), the bystander's completions (served, wrong or failed) and rate, and the daemon's RSS before
and after.

    python benchmarks/fuzz_daemon.py [--frames 100000] [--seed 0] [--model PATH]
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import msgspec
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))  # the test suite's daemon launcher

from daemon_process import DaemonProcess  # noqa: E402

import ember  # noqa: E402
from ember.client import Client  # noqa: E402
from ember.daemon.loader.demo_model import DEMO_MODEL  # noqa: E402
from ember.protocol import messages as m  # noqa: E402
from ember.protocol.codec import Codec  # noqa: E402

PROMPT = "def fibonacci(n):"
PROBE_ID = 2**62
FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-310, 5e-324, 7e-322, 1e308, -6.5e91, 1.0, 0.5, 2.0]
INTS = [0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 8191, 8192, 10**9]
codec = Codec()


class Generator:
    """Hostile frames, reproducible from a seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.valid = [codec.encode(x) for x in (
            m.Generate(1, prompt="def f(x):", max_tokens=3), m.Tokenize(2, "hello"), m.Hello(3, 1, "x"),
            m.Generate(4, token_ids=(1, 2, 3), stop=("a",), logit_bias={1: 2.0}), m.Release(5, (1, 2)), m.Cancel(6),
            m.Stats(7), m.Detokenize(8, (1, 2, 3)))]
        self.tags = [cls.__struct_config__.tag for cls in m.ClientMessage.__args__] + ["bogus", ""]

    def frames(self) -> list[bytes]:
        kind = self.rng.randrange(7)
        if kind == 6:  # a multi-part message
            return [self._one(self.rng.randrange(6)) for _ in range(self.rng.randint(2, 4))]
        return [self._one(kind)]

    def _one(self, kind: int) -> bytes:
        r = self.rng
        if kind == 0:
            return r.randbytes(r.randrange(200))
        if kind == 1:
            v = r.choice(self.valid)
            return v[: r.randrange(len(v) + 1)]
        if kind == 2:
            v = bytearray(r.choice(self.valid))
            for _ in range(r.randint(1, 4)):
                v[r.randrange(len(v))] ^= 1 << r.randrange(8)
            return bytes(v)
        if kind == 3:
            return msgspec.msgpack.encode([r.choice(self.tags), *(self._value() for _ in range(r.randrange(6)))])
        return self._generate()

    def _value(self) -> object:
        r = self.rng
        return r.choice([None, True, r.choice(INTS), r.choice(FLOATS), r.randbytes(4), "x" * r.randrange(8),
                         [r.choice(INTS)], {r.randrange(9): r.choice(FLOATS)}])

    def _generate(self) -> bytes:
        """A well-formed Generate with extreme numbers (short: max_tokens <= 8, so valid ones finish)."""
        r = self.rng

        def num() -> float:
            return r.choice(FLOATS) if r.random() < 0.7 else r.uniform(-3, 3) * 10 ** r.randint(-320, 300)

        options = dict(temperature=num(), top_p=num(), min_p=num(), repetition_penalty=num(),
                       frequency_penalty=num(), presence_penalty=num())
        chosen = {k: v for k, v in options.items() if r.random() < 0.5}
        return codec.encode(m.Generate(r.randrange(1, 10**6), prompt="def f(x):", max_tokens=r.randrange(9),
                                       top_k=r.choice([0, 1, 5, 2**31]), seed=r.choice([None, 0, 7]),
                                       logit_bias={r.choice(INTS) % 9000: r.choice(FLOATS)} if r.random() < 0.2 else {},
                                       **chosen))


class Bystander(threading.Thread):
    def __init__(self, socket: Path, expected: list[int]) -> None:
        super().__init__(daemon=True)
        self.socket, self.expected = socket, expected
        self.served = self.wrong = self.failed = 0
        self.errors: Counter[str] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with Client(self.socket, timeout=30) as client:
                    while not self.stop.is_set():
                        got = [t for c in client.generate(PROMPT, max_tokens=16) for t in c.token_ids]
                        self.served += 1
                        self.wrong += got != self.expected
            except Exception as e:
                self.failed += 1
                self.errors[type(e).__name__] += 1


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def probe(sock: zmq.Socket) -> bool:  # type: ignore[type-arg]
    sock.send(codec.encode(m.Health(PROBE_ID)))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if sock.poll(100):
            reply = codec.decode_server(sock.recv())
            if isinstance(reply, m.HealthStatus) and reply.id == PROBE_ID:
                return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="GGUF file or HF directory (default: the built-in demo model)")
    args = parser.parse_args()
    path = args.model or str(DEMO_MODEL)
    daemon = DaemonProcess("", args=("--model", path)).wait_ready(900)  # the default configuration
    ctx = zmq.Context()
    try:
        expected = list(ember.load(path).generate(PROMPT, max_tokens=16))
        rss_before = rss_mib(daemon.proc.pid)
        bystander = Bystander(daemon.socket, expected)
        bystander.start()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{daemon.socket}")
        frames, crashes, t0 = Generator(args.seed), 0, time.perf_counter()
        for i in range(1, args.frames + 1):
            sock.send_multipart(frames.frames())
            while sock.poll(0):  # read what came back: a fuzzer that never reads tests backpressure only
                sock.recv()
            if i % 1000 == 0 and (daemon.proc.poll() is not None or not probe(sock)):
                crashes += 1
                break
        seconds = time.perf_counter() - t0
        bystander.stop.set()
        bystander.join(60)
        alive = daemon.proc.poll() is None
        rss_after = rss_mib(daemon.proc.pid) if alive else float("nan")
        sock.close()
    finally:
        daemon.stop()
        ctx.term()
    print(f"{i} frames in {seconds:.1f} s ({i / seconds:.0f}/s), seed {args.seed}, {Path(path).name}")
    print(f"crashes: {crashes + (not alive)} (daemon {'alive' if alive else 'DEAD'} at the end)")
    print(f"bystander: {bystander.served} completions ({bystander.served / seconds:.1f}/s), "
          f"{bystander.wrong} wrong, {bystander.failed} failed {dict(bystander.errors)}")
    print(f"daemon RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after")


if __name__ == "__main__":
    main()
