"""What the CUDA kernels share: the simulator switch, the block width, launch shapes, and the one
reduction helper every kernel reduces through.

On a real GPU a block is one warp (32 threads) and a reduction is a butterfly of warp shuffles, with
no shared memory and no barrier. numba's CUDA simulator has no shuffles (`shfl_*_sync` raise
AttributeError there), and every simulated thread is a Python thread whose `syncthreads` costs
milliseconds: there the same helpers go through shared memory with two barriers, and blocks are 8
threads wide. Kernels are written for any block width up to 32 (grid- and block-stride loops), so a
tiny simulator launch runs exactly the code a GPU runs.
"""
from __future__ import annotations

import math
import sys
import threading
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from numba import config, cuda

SIMULATOR: bool = bool(config.ENABLE_CUDASIM)
WARP = 32
# Threads per block. The simulator runs each as a Python thread: 8 keep a test's launches quick.
THREADS = 8 if SIMULATOR else WARP
# Blocks per launch at most; kernels loop over the rest (grid-stride), so any size is correct.
MAX_BLOCKS = 64 if SIMULATOR else 65535
_FULL_MASK = 0xFFFFFFFF


def grid(tasks: int, threads: int = THREADS) -> tuple[int, int]:
    """(blocks, threads) for `tasks` independent units of `threads` lanes each: one block per task,
    capped (the kernels stride over the rest)."""
    return max(1, min(tasks, MAX_BLOCKS)), threads


def flat_grid(items: int) -> tuple[int, int]:
    """(blocks, threads) for `items` one-thread work items (elementwise kernels)."""
    return grid(-(-items // THREADS))


def unavailable_reason() -> str | None:
    """Why no CUDA device can run kernels here (None when one can): the line the runtime shows."""
    try:
        if cuda.is_available():
            return None
        len(cuda.gpus)  # numba keeps the driver's error; asking for the devices raises it
    except Exception as e:  # noqa: BLE001 - any driver/library failure is the answer itself
        return " ".join(str(e).split()).rstrip(" :") or type(e).__name__  # numba's message spans lines
    return "no CUDA GPU found"


def device_scope(index: int) -> AbstractContextManager[Any]:
    """The calling thread works on GPU `index` inside: numba (and CuPy, whose runtime calls use the same
    primary contexts) allocate and launch in the calling thread's current context, so an engine on
    cuda:N enters this around its loading and each of its steps. It pushes the device's primary
    context and pops it on exit: nesting, and any thread, work."""
    return cuda.gpus[index]


# --- the reduction helper ------------------------------------------------------------------------
# Each returns the block-wide result to every thread; `scratch` is a shared float32 [THREADS] array
# (float64 for float64 values; `iscratch` int64 for argmax) that the kernel allocates, since only kernels own shared memory.
if SIMULATOR:
    @cuda.jit(device=True)
    def block_sum(v, scratch):  # type: ignore[no-untyped-def]
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        total = scratch[0]  # in scratch's type: float32 or float64 sums alike
        for i in range(1, cuda.blockDim.x):  # one order for every thread: they all agree on the sum
            total += scratch[i]
        cuda.syncthreads()  # everyone has read scratch before anyone reuses it
        return total

    @cuda.jit(device=True)
    def block_max(v, scratch):  # type: ignore[no-untyped-def]
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        best = scratch[0]
        for i in range(1, cuda.blockDim.x):
            best = max(best, scratch[i])
        cuda.syncthreads()
        return best

    @cuda.jit(device=True)
    def block_argmax(v, idx, scratch, iscratch):  # type: ignore[no-untyped-def]
        t = cuda.threadIdx.x
        scratch[t] = v
        iscratch[t] = idx
        cuda.syncthreads()
        best, at = scratch[0], iscratch[0]
        for i in range(1, cuda.blockDim.x):
            if scratch[i] > best or (scratch[i] == best and iscratch[i] < at):
                best, at = scratch[i], iscratch[i]
        cuda.syncthreads()
        return best, at

    @cuda.jit(device=True)
    def block_broadcast(v, lane, scratch):  # type: ignore[no-untyped-def]
        t = cuda.threadIdx.x
        scratch[t] = v
        cuda.syncthreads()
        out = scratch[lane]
        cuda.syncthreads()
        return out
else:
    @cuda.jit(device=True)
    def block_sum(v, scratch):  # type: ignore[no-untyped-def]
        offset = WARP // 2
        while offset > 0:
            v += cuda.shfl_xor_sync(_FULL_MASK, v, offset)
            offset //= 2
        return v

    @cuda.jit(device=True)
    def block_max(v, scratch):  # type: ignore[no-untyped-def]
        offset = WARP // 2
        while offset > 0:
            v = max(v, cuda.shfl_xor_sync(_FULL_MASK, v, offset))
            offset //= 2
        return v

    @cuda.jit(device=True)
    def block_argmax(v, idx, scratch, iscratch):  # type: ignore[no-untyped-def]
        offset = WARP // 2
        while offset > 0:
            ov = cuda.shfl_xor_sync(_FULL_MASK, v, offset)
            oi = cuda.shfl_xor_sync(_FULL_MASK, idx, offset)
            if ov > v or (ov == v and oi < idx):
                v, idx = ov, oi
            offset //= 2
        return v, idx

    @cuda.jit(device=True)
    def block_broadcast(v, lane, scratch):  # type: ignore[no-untyped-def]
        return cuda.shfl_sync(_FULL_MASK, v, lane)


# --- the simulator's shared arrays ----------------------------------------------------------------
def _serialise_simulated_shared_arrays() -> None:
    """numba's simulator finds a block's shared array by the (file, line) that asks for it, in a dict it
    fills without a lock: two simulated threads of one block that reach `cuda.shared.array` at once can
    each allocate an array of their own, and a reduction through it then reads np.empty garbage. Seen:
    the daemon test's first token came from the wrong logits row, about one run in twenty (the race needs
    a thread switch inside the lookup, which other busy threads make likelier). Here the lookup and the
    allocation are one step under a lock, keyed as numba keys them: by the calling kernel line."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    if getattr(FakeCUDAShared, "_ember_serialised", False):
        return
    original = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):  # type: ignore[no-untyped-def]
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)  # dynamic shared memory (unused here); numba's refusal
        frame = sys._getframe(1)
        caller = frame.f_code.co_filename, frame.f_lineno
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                found = np.empty(shape, numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype)
                self._allocations[caller] = found
        return found

    FakeCUDAShared.array = array
    FakeCUDAShared._ember_serialised = True


if SIMULATOR:
    _serialise_simulated_shared_arrays()

NEG_INF = -math.inf
__all__ = ["SIMULATOR", "THREADS", "WARP", "block_argmax", "block_broadcast", "block_max", "block_sum", "flat_grid",
           "grid", "unavailable_reason"]
