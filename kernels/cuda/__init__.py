"""The CUDA backend: numba.cuda kernels behind the ops API (backend.CudaOps).

Nothing here is imported unless a `cuda` device is asked for (kernels.get_ops, runner/devices.py), so
CPU-only machines never import numba.cuda, let alone cupy. Every kernel is plain numba.cuda, so numba's
CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs the same code on any machine: the tests in tests/cuda
check it there against the numpy references, and unchanged on a real GPU (docs/cuda.md).
"""
