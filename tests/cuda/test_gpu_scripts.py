"""The scripts a lent GPU runs, checked where there is none, so its few minutes go to measuring: the
kernel and decode benchmarks' dry runs (every step but the device's, at toy shapes) and the shell
script's syntax."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NEEDS_DEVICE = False  # conftest.py: no device involved

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernel_benchmark_runs_dry(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_kernels.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert {r["type"] for r in result["gemv"]} == {"Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"}
    assert {(r["batch"], r["matrix"]) for r in result["gemv"]} == {(b, m) for b in (1, 8)
                                                                   for m in ("gate", "down", "lm_head")}
    assert {(r["kv"], r["context"]) for r in result["attention"]} == {(kv, c) for kv in ("f16", "q8_0")
                                                                      for c in result["contexts"]}
    assert {(r["sampler"], r["batch"]) for r in result["sampling"]} == {(s, b) for s in ("greedy", "top-k/p")
                                                                       for b in (1, 8)}
    assert len(result["verdicts"]) == 4 and "HBM" in done.stdout


def test_the_decode_benchmark_runs_dry(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_decode.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert set(result["quants"]) == {"Q8_0", "Q4_K_M"}
    assert all([r["batch"] for r in q["rows"]] == [1, 8, 32] and q["weight_bytes"] > 0
               for q in result["quants"].values())


def test_the_gpu_script_parses() -> None:
    done = subprocess.run(["bash", "-n", str(ROOT / "tests" / "cuda" / "on_gpu.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
