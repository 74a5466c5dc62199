"""Layer split against the unsplit model: decode tokens/s at 1 and 8 concurrent streams, the staging
bytes per token of each act_dtype, and how close f16/bf16 staging stays to f32.

    python benchmarks/layer_split.py [--model PATH] [--tokens 64] [--precision]

Two stages with one kernel thread each, in two worker processes (`cpu:0,cpu:1`) and in a worker and
the engine's own thread (`cpu:0,cpu`: the last stage runs where the engine samples), against the
unsplit model in process with the same total: two kernel threads (and, for reference, one); and each
split without pipelining (the engine keeps one step in flight instead of one per stage). Streams run
through the engine core as the daemon runs them (continuous batching, greedy, ignore_eos); a split
step is cut into micro-batches that the stages pipeline. Each configuration is timed `--repeats`
times, alternating, and the medians compared. Then, per split, a decode's micro-batches: each stage's
own time per micro-batch, the engine thread's share of a core, and the most any pipelining could give
the split: no faster than its busiest thread (a worker stage, or the engine's, which also runs the
last stage in `cpu:0,cpu`), nor than its CPU time spread over this machine's cores.
--precision [--decode-act q8_0|f32]: for f16 and bf16 staging, greedy 128 tokens on several prompts
against the unsplit model (identical or not, and where they first differ), and teacher-forced on the
unsplit tokens: top-1 agreement and the largest logit error relative to each row's logit range. With
q8_0 decode activations (the default) the int8 quantization of each matmul's input magnifies the
staging's rounding (a value that crosses a rounding boundary moves by 1/127 of its block's range):
near-ties among the top logits then go the other way; with f32 decode activations they do not.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np

import ember
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner.devices import backend_for
from ember.daemon.planning.staging_bytes import boundary_bytes
from ember.kernels.convert import storage_bytes

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
           "for i in range(10):\n    print(", "# read the config file\nwith open(", "x = [", "return self.",
           "    @property\n    def name(self) -> str:\n        "]


@dataclass
class Decoded:
    """A timed decode: the tokens generated after the prompts, the seconds they took, and the CPU
    seconds of the thread that drove the engine (for a split with a last stage in the engine, that
    stage's work too) over the same time."""
    tokens: int
    seconds: float
    engine_cpu: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def decode(model: ember.Model, streams: int, tokens: int, lanes: int | None = None) -> Decoded:
    """`streams` sequences decoded together (prompts first, untimed; a split's per-stage counters
    start over after them, so they count decode micro-batches only); lanes=1 keeps a split model's
    engine to one step at a time (no pipelining)."""
    engine = model.engine(streams * 256, max_running=streams)
    if lanes is not None:
        engine.runner.lanes = lanes
    seqs = [Sequence(model.tokenize(PROMPTS[i % len(PROMPTS)]), tokens) for i in range(streams)]
    for seq in seqs:
        engine.add(seq)
    while any(not s.generated for s in seqs):  # the prompts' steps
        engine.step()
    if model.pipeline is not None:
        p = model.pipeline
        p.run_seconds, p.runs = [0.0] * len(p.run_seconds), [0] * len(p.runs)
    done = sum(len(s.generated) for s in seqs)
    t0, cpu0 = time.perf_counter(), time.thread_time()
    while engine.has_work:
        engine.step()
    seconds, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    return Decoded(sum(len(s.generated) for s in seqs) - done, seconds, cpu)


def decode_rate(model: ember.Model, streams: int, tokens: int, lanes: int | None = None) -> float:
    """Generated tokens per second (decode())."""
    return decode(model, streams, tokens, lanes).rate


def stage_report(devices: str, split: ember.Model, run: Decoded, base: float, pipelined: bool) -> str:
    """What a stage's micro-batch costs, pipelined or not, and the rate the split's CPU time allows:
    each worker stage is a thread, the engine's is another (with the last stage's work where it runs
    it), and no pipelining beats the busiest of them, nor their CPU time spread over this machine's
    cores. Where that bound is below 0.9x of the unsplit model, the goal is out of reach on these cores."""
    p = split.pipeline
    per = ", ".join(f"stage {i}: {1e3 * r / max(n, 1):.2f} ms x {n} ({100 * r / run.seconds:.0f}% busy)"
                    for i, (r, n) in enumerate(zip(p.run_seconds, p.runs)))
    # each worker stage's own time, then the engine thread's CPU (which holds its own stage's time, if any)
    threads = [*p.run_seconds[:len(p.stages)], run.engine_cpu]
    cores = len(os.sched_getaffinity(0))
    spread, busiest = sum(threads) / cores, max(threads)
    bound = run.tokens / max(spread, busiest)
    why = f"its CPU time over {cores} cores" if spread >= busiest else "its busiest thread"
    return (f"  {devices} {'pipelined' if pipelined else 'not pipelined':14s} micro-batches {per}; the engine's "
            f"thread {100 * run.engine_cpu / run.seconds:.0f}% of a core\n"
            f"  {' ' * len(devices)} {'':14s} CPU per token {1e3 * sum(threads) / run.tokens:.3f} ms; at most "
            f"{bound:.0f} tok/s ({bound / base:.2f}x unsplit; bound by {why}), measured {run.rate:.0f}")


def throughput(args: argparse.Namespace) -> None:
    cpu = backend_for("cpu")
    whole = ember.load(args.model)
    splits = {devices: ember.load(args.model, devices=devices.split(","), split=args.split, act_dtype="f32",
                                  stage_threads=1) for devices in ("cpu:0,cpu:1", "cpu:0,cpu")}
    print(f"model {args.model}: {whole.config.n_layers} layers, hidden {whole.config.hidden}")
    for devices, split in splits.items():
        print(f"{devices}: " + "; ".join(split.pipeline.describe()))
    configs = {"unsplit, 2 threads": (whole, 2, None), "unsplit, 1 thread": (whole, 1, None)}
    for devices, split in splits.items():
        configs |= {f"{devices} x 1 thread": (split, 1, None), "  not pipelined" + " " * len(devices): (split, 1, 1)}
    for streams in (1, 8):
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for model in (whole, *splits.values()):
            decode_rate(model, streams, 8)  # warm
        for _ in range(args.repeats):
            for name, (model, threads, lanes) in configs.items():
                cpu.use_threads(threads)  # the engine thread's kernels (the split's only sample on it)
                rates[name].append(decode_rate(model, streams, args.tokens, lanes))
        base = statistics.median(rates["unsplit, 2 threads"])
        print(f"\n{streams} stream(s), {args.tokens} tokens each, median of {args.repeats}:")
        for name, r in rates.items():
            print(f"  {name:22s} {statistics.median(r):8.1f} tok/s   {statistics.median(r) / base:5.2f}x")
        for (devices, split), lanes in itertools.product(splits.items(), (None, 1)):
            print(stage_report(devices, split, decode(split, streams, args.tokens, lanes), base, lanes is None))
    for split in splits.values():
        split.close()


def staging_table(model_path: str) -> None:
    whole = ember.load(model_path)
    hidden = whole.config.hidden
    print(f"\nstaging per token per boundary (hidden {hidden}); allocated per boundary for 256-token steps, 2 stages "
          "(a slot per micro-batch in flight):")
    for dtype in ("f32", "f16", "bf16"):
        print(f"  {dtype:5s} {storage_bytes(dtype, hidden):6d} B/token   {boundary_bytes(hidden, 256, dtype, 2):9d} B")


def precision(model_path: str, decode_act: str) -> None:
    whole = ember.load(model_path, decode_act=decode_act)
    backend_for("cpu").use_threads(1)  # numerics do not depend on it; a shared machine's time does
    for dtype in ("f16", "bf16"):
        split = ember.load(model_path, devices=["cpu:0", "cpu:1"], act_dtype=dtype, decode_act=decode_act)
        same, agree, rows, worst = 0, 0, 0, 0.0
        firsts = []
        for text in PROMPTS:
            ids = whole.tokenize(text)
            want = list(whole.generate(ids, 128, ignore_eos=True))
            got = list(split.generate(ids, 128, ignore_eos=True))
            same += got == want
            firsts.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None))
            ref, out = whole.logits(ids + want), split.logits(ids + want)  # teacher-forced on the unsplit tokens
            agree += int((ref.argmax(1) == out.argmax(1)).sum())
            rows += len(ref)
            span = ref.max(1) - ref.min(1)
            worst = max(worst, float((np.abs(out - ref).max(1) / span).max()))
        split.close()
        print(f"\n{dtype} staging, decode_act {decode_act}, greedy 128 tokens x {len(PROMPTS)} prompts: {same}/{len(PROMPTS)} identical "
              f"(first difference at token {firsts}); teacher-forced top-1 agreement {agree}/{rows} "
              f"({100 * agree / rows:.2f}%), max logit error {100 * worst:.3f}% of the row's range")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--split", type=lambda v: [int(n) for n in v.split(",")], default=None,
                   help="layers per stage, e.g. 4,1 (default: by the stages' memory budgets)")
    p.add_argument("--precision", action="store_true", help="the f16/bf16 agreement report instead of the timings")
    p.add_argument("--decode-act", default="q8_0", choices=("q8_0", "f32"), help="with --precision: decode activations")
    args = p.parse_args()
    if args.precision:
        precision(args.model, args.decode_act)
    else:
        throughput(args)
    staging_table(args.model)


if __name__ == "__main__":
    main()
