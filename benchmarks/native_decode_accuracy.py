"""How close the native CUDA decode step comes to the CPU model, on the host harness (no GPU needed;
nvcc builds the harness): the trained demo model decoding two code prompts side by side, per KV dtype,
and a prompt chunk through the prefill GEMMs.

    python benchmarks/native_decode_accuracy.py

Prints, per case, the largest and mean relative L2 error of the logits rows against ember's CPU model
and the share of positions with the same argmax (tests/cuda/test_native_decoder.py asserts bounds on
the same quantities).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))  # the repository root is the package `ember`; tests.* beside it
sys.path.insert(0, str(ROOT))

import ember  # noqa: E402
from ember.daemon.loader.model_file import open_model_file  # noqa: E402
from ember.daemon.runner.native_decoder import NativeDecoder  # noqa: E402
from ember.kernels.cuda.native_launch import NativeOps  # noqa: E402
from tests.cuda import native_toolchain  # noqa: E402
from tests.cuda.native_fake_device import HarnessLauncher  # noqa: E402
from tests.cuda.test_native_decoder import DEMO, TEXTS, _decode  # noqa: E402


def report(name: str, got: np.ndarray, expected: np.ndarray) -> None:
    errors = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
    same = np.mean(got.argmax(axis=1) == expected.argmax(axis=1))
    print(f"{name:34} max {errors.max():.2%}  mean {errors.mean():.2%}  argmax {same:.0%}")


def main() -> None:
    cpu = ember.load(str(DEMO))
    prompts = [list(cpu.tokenize(text)) for text in TEXTS]
    lib = native_toolchain.build_harness()
    for kv in ("f32", "f16", "q8_0"):
        decoder = NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, HarnessLauncher(lib)), n_blocks=8,
                                          kv_dtype=kv, max_context=64)
        for s, (prompt, got) in enumerate(zip(prompts, _decode(decoder, prompts, 4), strict=True)):
            report(f"decode step, {kv} cache, prompt {s} ({len(prompt)})", got, cpu.logits(prompt))
    decoder = NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, HarnessLauncher(lib)), n_blocks=8,
                                      kv_dtype="f16", max_context=128)
    prompt = prompts[0]
    table = np.arange(8)[None]
    chunk = decoder.forward(np.array(prompt[:30]), np.arange(30), np.repeat(table, 30, 0), np.arange(30))
    report("prefill GEMMs, a 30-token chunk", np.asarray(chunk), cpu.logits(prompt)[:30])


if __name__ == "__main__":
    main()
