"""Serving throughput through the daemon on the CPU: continuous batching under 1..16 concurrent streams.

Starts a real `ember serve` (max_active = the largest stream count) on a temporary socket, then, from
one asyncio client process:
- for each stream count N: N streams started together, each a different prompt, greedy, `--tokens`
  tokens with ignore_eos; aggregate tokens/s (all tokens / wall time from the first request to the
  last Finished), and p50/p99 inter-token latency (gaps between consecutive tokens of a stream);
- time to first token of a prompt of `--prefix-tokens` tokens, alone, once with a prefix the daemon
  has never seen and once with the same prefix just served (its KV blocks come from the prefix cache),
  medians of `--repeats` different prefixes.
Prints the aggregate speed-up of each N over one stream (goal: >= 4x at 8 streams).

    python benchmarks/throughput.py [--model PATH] [--streams 1,2,4,8,16] [--tokens 64] [--prefix-tokens 1024]

Without --model it serves the built-in demo model. The client shares the machine's cores with the
daemon, as a local client does; the figures include that.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))  # the test suite's daemon launcher

from daemon_process import DaemonProcess  # noqa: E402

from ember.client import AsyncClient  # noqa: E402

SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print(", "# read the config file\nwith open(", "x = [", "return self.",
            "    @property\n    def name(self) -> str:\n", "try:\n    import numpy as np\nexcept ImportError:",
            "async def fetch(session, url):", "with open(path) as f:\n    for line in f:", "if __name__ == '__main__':",
            "def __repr__(self):\n    return", "@dataclass\nclass Point:", "raise ValueError(", "lambda x: x +"]


async def stream_times(socket: Path, prompt: str, tokens: int) -> list[float]:
    """Arrival time of every token of one greedy stream."""
    times: list[float] = []
    async with AsyncClient(socket, timeout=600) as client:
        async for chunk in client.generate(prompt, max_tokens=tokens, ignore_eos=True):
            now = time.perf_counter()
            times += [now] * len(chunk.token_ids)
    return times


async def concurrent(socket: Path, n: int, tokens: int) -> tuple[float, list[float]]:
    """(aggregate tokens/s, inter-token gaps in s) of n streams started together."""
    t0 = time.perf_counter()
    streams = await asyncio.gather(*(stream_times(socket, SNIPPETS[i % len(SNIPPETS)] + " " * (i // len(SNIPPETS)), tokens)
                                     for i in range(n)))
    wall = max(s[-1] for s in streams) - t0
    gaps = [b - a for s in streams for a, b in zip(s, s[1:])]
    return sum(len(s) for s in streams) / wall, gaps


async def first_token(socket: Path, prompt: str) -> float:
    async with AsyncClient(socket, timeout=600) as client:
        t0 = time.perf_counter()
        async for _ in client.generate(prompt, max_tokens=1):
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def long_prompt(seed: int, n_tokens: int) -> str:
    """About n_tokens of code-like text that no other prompt shares (a unique first line)."""
    lines = [f"# module {seed}: generated for the prefix benchmark"]
    i = 0
    while len(lines) * 9 < n_tokens:  # ~9 tokens per line with the demo tokenizer
        lines.append(f"value_{seed}_{i} = compute(value_{seed}_{i - 1}, {i})")
        i += 1
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace, socket: Path) -> None:
    counts = [int(n) for n in args.streams.split(",")]
    await concurrent(socket, 2, 8)  # warm the client path
    base = None
    print(f"{'streams':>7} {'tok/s':>9} {'x one':>6} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for n in counts:
        rate, gaps = await concurrent(socket, n, args.tokens)
        gaps.sort()
        base = base or rate
        print(f"{n:>7} {rate:>9.1f} {rate / base:>6.2f} {1e3 * gaps[len(gaps) // 2]:>11.1f} "
              f"{1e3 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]:>11.1f}")
    cold, warm = [], []
    for r in range(args.repeats):
        prefix = long_prompt(r, args.prefix_tokens)
        cold.append(await first_token(socket, prefix + "def first():"))
        warm.append(await first_token(socket, prefix + "def second():"))  # shares every full block of prefix
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"\ntime to first token, prompt of ~{args.prefix_tokens} tokens: new prefix {1e3 * c:.0f} ms, "
          f"cached prefix {1e3 * w:.0f} ms ({c / w:.1f}x faster), medians of {args.repeats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or HF directory (default: the built-in demo model)")
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    most = max(int(n) for n in args.streams.split(","))
    config = f"[engine]\nmax_active = {most}\nmax_queued = 64\nctx = 2048\n[limits]\nmax_requests_per_client = 64\n"
    daemon = DaemonProcess(config, args=("--model", args.model) if args.model else ()).wait_ready(timeout=900)
    try:
        print(f"ember serve, {args.model or 'the built-in demo model'}, {os.cpu_count()} CPUs, "
              f"{args.tokens} tokens per stream, greedy")
        asyncio.run(main_async(args, daemon.socket))
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
