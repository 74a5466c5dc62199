"""What serving costs over running the model in process, measured side by side in one run.

- in-process: `ember.load(model).generate(prompt, max_tokens=N)` greedy, tokens/s over the whole call,
  with numba's default threads (one per core) and again with the daemon's kernel threads
  (`engine.threads`, one per core unless --threads), which isolates what serving itself costs;
- daemon: the same request streamed from a real `ember serve` through the sync `Client`, tokens/s from
  the request to its Finished frame (the client shares the machine's cores with the daemon, as a local
  client does);
- the engine process alone: the daemon's engine process (engine_main) started by one thread that
  sends it the request and reads its reports, no front and no client: what the engine's own process
  costs, apart from the streaming path (front, socket, client) beside it;
- host time per step at batch 1: the in-process engine's decode steps timed whole, and the time spent
  inside kernels (every ops call timed), the difference being the Python around them;
- aggregate tokens/s of 8 concurrent streams over one stream (AsyncClient, one process).
Medians of `--repeats` runs, the single-stream paths alternating so drift hits them alike, each
after SETTLE seconds of quiet; and the median of each round's ratio of the daemon's run to the mean of
the two in-process runs beside it, which cancels drift slower than a round.

    python benchmarks/engine_overhead.py [--model PATH] [--tokens 256] [--repeats 3] [--streams 8] [--threads N]

Goals (issue: engine core): daemon / in-process >= 0.95, at most 0.1 ms more per token; 8 streams >= 4x
one. The 100M Q8_0 shape: `--model benchmarks/.cache/qwen3-100m-q8_0-llamacpp.gguf` (written by
`python benchmarks/cpu_decode.py`).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numba
import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))  # the test suite's daemon launcher

from daemon_process import DaemonProcess  # noqa: E402

import ember  # noqa: E402
from ember.client import AsyncClient, Client  # noqa: E402
from ember.daemon.channel import Channel  # noqa: E402
from ember.daemon.config import Config, EngineConfig, ModelSpec  # noqa: E402
from ember.daemon.loader.demo_model import DEMO_MODEL  # noqa: E402
from ember.daemon.server.engine_wire import (AddSequence, EngineLaunch, Ready, Shutdown, StepNews,  # noqa: E402
                                             report_decoder)
from ember.kernels.sampling import SamplingParams  # noqa: E402

PROMPT = "def fibonacci(n):"
SETTLE = 0.2  # seconds of quiet before each timed run


def in_process(model: ember.Model, tokens: int, threads: int | None = None) -> float:
    numba.set_num_threads(threads or numba.config.NUMBA_NUM_THREADS)
    t0 = time.perf_counter()
    n = sum(1 for _ in model.generate(PROMPT, max_tokens=tokens, ignore_eos=True))
    return n / (time.perf_counter() - t0)


def settled(run: Any, *args: Any) -> float:
    time.sleep(SETTLE)
    return run(*args)


def via_daemon(socket: Path, tokens: int) -> float:
    with Client(socket, timeout=600) as client:
        t0 = time.perf_counter()
        n = sum(len(chunk.token_ids) for chunk in client.generate(PROMPT, max_tokens=tokens, ignore_eos=True))
        return n / (time.perf_counter() - t0)


async def _stream(socket: Path, prompt: str, tokens: int) -> int:
    async with AsyncClient(socket, timeout=600) as client:
        return sum([len(c.token_ids) async for c in client.generate(prompt, max_tokens=tokens, ignore_eos=True)])


async def concurrent(socket: Path, n: int, tokens: int) -> float:
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(_stream(socket, f"{PROMPT}{' ' * i}", tokens) for i in range(n)))
    return sum(counts) / (time.perf_counter() - t0)


class EngineAlone:
    """The daemon's engine process with nothing beside it but this thread, which starts it over a
    socketpair, sends each request and reads the reports until the request's end."""

    def __init__(self, path: str, threads: int, max_active: int) -> None:
        config = Config(models=(ModelSpec(path, "m"),), engine=EngineConfig(max_active=max_active, ctx=2048,
                                                                             threads=threads))
        launch = EngineLaunch(config=config, kv_dtype="f32", act_dtype="f32", feature_dtypes={"m": "f32"},
                              shm_owner="00000000")
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen([sys.executable, "-m", "ember.daemon.server.engine_main", str(theirs.fileno())],
                                        stdin=subprocess.PIPE, pass_fds=[theirs.fileno()], stderr=subprocess.DEVNULL)
        theirs.close()
        assert self.process.stdin is not None
        self.process.stdin.write(msgspec.json.encode(launch))
        self.process.stdin.close()
        self.channel = Channel(ours, report_decoder)
        while not isinstance(self.channel.recv(), Ready):
            pass
        self._ids = 0

    def rate(self, prompt: list[int], tokens: int) -> float:
        self._ids += 1
        self.channel.send(AddSequence(self._ids, b"bench", self._ids, "m", prompt, tokens, SamplingParams(), None, []))
        t0, done = time.perf_counter(), False
        while not done:
            report = self.channel.recv()
            if isinstance(report, StepNews):
                done = any(p.seq_id == self._ids and p.finish is not None for p in report.progress)
        return tokens / (time.perf_counter() - t0)

    def close(self) -> None:
        self.channel.send(Shutdown(0.0))
        self.process.wait(30)
        self.channel.close()


class KernelClock:
    """Wraps a runner's ops so that every kernel call adds its wall time to `seconds`."""

    def __init__(self, ops: Any) -> None:
        self.seconds = 0.0
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def host_time_per_step(model: ember.Model, tokens: int) -> tuple[float, float]:
    """(ms per decode step, ms of it outside kernels) at batch 1, in process."""
    ops = model.net.ops
    clock = KernelClock(ops)
    model.net.ops = clock  # every kernel the runner and the model call now goes through the clock
    try:
        stream = model.generate(PROMPT, max_tokens=tokens + 1, ignore_eos=True)
        next(stream)  # the prompt's step, not a decode
        clock.seconds = 0.0
        t0 = time.perf_counter()
        n = sum(1 for _ in stream)
        wall = time.perf_counter() - t0
    finally:
        model.net.ops = ops
    return 1e3 * wall / n, 1e3 * (wall - clock.seconds) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or HF directory (default: the built-in demo model)")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="the daemon's engine.threads (0: its default)")
    args = parser.parse_args()
    path = args.model or str(DEMO_MODEL)
    threads = args.threads or len(os.sched_getaffinity(0))  # the daemon's default engine.threads
    config = (f"[engine]\nmax_active = {max(8, args.streams)}\nctx = 2048\nthreads = {threads}\n"
              "[limits]\nmax_requests_per_client = 64\n")
    daemon = DaemonProcess(config, args=("--model", path)).wait_ready(timeout=900)
    alone = EngineAlone(path, threads, max(8, args.streams))
    try:
        model = ember.load(path)
        prompt = model.tokenize(PROMPT)
        in_process(model, 16), via_daemon(daemon.socket, 16), alone.rate(prompt, 16)  # warm every path
        inproc, same, served, bare = [], [], [], []
        for _ in range(args.repeats):
            # each run starts on a quiet machine: the run before it may leave spinning kernel threads
            # and, in the daemon, the engine's heap trim 50 ms after it goes idle
            inproc.append(settled(in_process, model, args.tokens))
            same.append(settled(in_process, model, args.tokens, threads))
            served.append(settled(via_daemon, daemon.socket, args.tokens))
            bare.append(settled(alone.rate, prompt, args.tokens))
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        step_ms, host_ms = host_time_per_step(model, args.tokens)
        one = statistics.median(asyncio.run(concurrent(daemon.socket, 1, args.tokens)) for _ in range(args.repeats))
        many = statistics.median(asyncio.run(concurrent(daemon.socket, args.streams, args.tokens))
                                 for _ in range(args.repeats))
    finally:
        alone.close()
        daemon.stop()
    a, s, b, e = (statistics.median(x) for x in (inproc, same, served, bare))
    print(f"{Path(path).name}, {os.cpu_count()} CPUs, greedy, {args.tokens} tokens, medians of {args.repeats}")
    print(f"in-process, {numba.config.NUMBA_NUM_THREADS} threads  {a:8.1f} tok/s   (runs: {_runs(inproc)})")
    print(f"in-process, {threads} threads  {s:8.1f} tok/s   (runs: {_runs(same)})")
    print(f"daemon + Client       {b:8.1f} tok/s   (runs: {_runs(served)}; engine.threads {threads})")
    print(f"daemon / in-process   {b / a:8.3f}     (goal >= 0.95), {1e3 * (1 / b - 1 / a):.3f} ms more per token "
          f"(goal <= 0.1)")
    print(f"daemon / in-process at the daemon's threads {b / s:.3f}   (what serving costs)")
    # each round's daemon run against the in-process runs beside it: this VM's speed drifts by tens of
    # percent over minutes, which the medians of each path apart do not cancel and a round's ratio does
    paired = [2 * d / (i + t) for d, i, t in zip(served, inproc, same, strict=True)]
    print(f"daemon / in-process, round by round: median {statistics.median(paired):.3f} (rounds: "
          f"{', '.join(f'{r:.3f}' for r in paired)})")
    print(f"engine process alone  {e:8.1f} tok/s   (runs: {_runs(bare)}): {e / a:.3f} of in-process; the streaming "
          f"path beside it costs the rest")
    print(f"decode step, batch 1: {step_ms:.3f} ms, of which {host_ms:.3f} ms outside kernels "
          f"({100 * host_ms / step_ms:.0f}%)")
    print(f"1 stream {one:.1f} tok/s, {args.streams} streams {many:.1f} tok/s: {many / one:.2f}x (goal >= 4x)")


def _runs(values: list[float]) -> str:
    return ", ".join(f"{x:.0f}" for x in values)


if __name__ == "__main__":
    main()
