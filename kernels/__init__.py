"""Numerical primitives behind one ops API (ops.py) with a numpy reference and per-device backends.

`get_ops("cpu")` returns the numba backend, `get_ops("cuda")` the numba.cuda one (kernels/cuda), imported
only when asked for, so CPU-only machines never touch numba.cuda or cupy.
"""
from __future__ import annotations

from ember.kernels.ops import Ops


def get_ops(device: str = "cpu") -> Ops:
    if device == "cpu":
        from ember.kernels.cpu.backend import CpuOps

        return CpuOps()
    if device == "cuda":
        from ember.kernels.cuda.backend import CudaOps

        return CudaOps()
    raise ValueError(f"unknown device {device!r}: this build supports 'cpu' and 'cuda'")
