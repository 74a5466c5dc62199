"""Every CUDA kernel compiles for a real device (sm_90 PTX), where the CUDA toolkit's NVVM and NVRTC
are present, GPU or not: the simulator runs kernels as Python and never types them as numba.cuda does
for a GPU. Skipped where the toolkit is missing (CI); tests/cuda on a GPU compile them anyway."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

NEEDS_DEVICE = False  # conftest.py: this compiles, it runs nothing

_PROBE = ("from numba import cuda, float32\n"
          "def k(x):\n    x[0] = 1\n"
          "cuda.compile_ptx(k, (float32[:],), cc=(9, 0))\n")


def test_every_kernel_compiles_for_sm90() -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300)
    if probe.returncode != 0:
        pytest.skip(f"no CUDA compiler toolchain here: {probe.stderr.strip().splitlines()[-1:]}")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("ptx_check.py"))], capture_output=True,
                         text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok ") >= 20
