"""Kernels compiled twice, serial and parallel, and the choice between them by the work at hand.

numba's on-disk cache names an entry by the function's qualified name, line and bytecode, not by its
compile options: compiling one Python function both ways with `cache=True` gave both variants a
single cache entry, so a process that found the cache warm ran whichever variant was written last —
different code, and different rounding, from a process that compiled afresh. The parallel twin is
therefore compiled from a copy of the function under its own name.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numba
from numba import njit
from numba.np.ufunc import parallel as _numba_parallel

from ember.kernels.cpu import kernel_tiers

JIT = dict(fastmath=True, cache=True, nogil=True)

# Below this many multiply-adds a kernel runs on the calling thread: waking the thread pool costs
# more than a decode step's rmsnorm or rope (and much more when other processes hold the cores).
PARALLEL_MIN_WORK = 1 << 16
# None: each twin picks by its work; "serial" / "parallel": every twin takes that variant (the kernel
# cache compiles both this way; tests run both)
FORCE: str | None = None


# Starts the thread pool: cached compiled code that calls a parallel kernel (decoder_layer.py) jumps
# into the pool without starting it. From then on the calling thread's count reads cheaply (0.09 us
# against numba.get_num_threads's 0.7: it is read at every pick).
numba.get_num_threads()
_threads = getattr(_numba_parallel, "_get_num_threads", numba.get_num_threads)


def threads() -> int:
    """The number of threads the calling thread's parallel kernels run on."""
    return _threads()


def one_thread() -> bool:
    """The calling thread runs kernels on one thread (numba's count is per calling thread: a stage
    worker's, the daemon's on a 2-core machine). The serial variants then run: the parallel ones on one
    thread are slower (8192 x 384 Q8_0 decode matvec: 121 us against the serial variant's 117, the
    parallel region's own cost; 224 against 182 before both variants shared one compiled row loop)."""
    return _threads() == 1


def force_code() -> int:
    """FORCE as compiled code that picks variants itself takes it: 0 by the work, 1 serial, 2 parallel
    (1 also when this thread runs kernels on one thread, or the process the first tier alone)."""
    if FORCE is None:
        return 1 if one_thread() or kernel_tiers.first_tier_only() else 0
    return 1 if FORCE == "serial" else 2


class Twin:
    def __init__(self, core: Callable[..., Any], min_work: int | None = None, **options: Any) -> None:
        """options override JIT's (fastmath=False for kernels whose float order must not change);
        min_work overrides PARALLEL_MIN_WORK for this kernel."""
        jit = {**JIT, **options}
        self.serial = njit(**jit)(core)
        self.parallel = njit(parallel=True, **jit)(_renamed(core, "_parallel"))
        self.min_work = min_work

    def pick(self, work: int) -> Any:
        """The variant for `work` multiply-adds (or a comparable count)."""
        if FORCE is not None:
            return self.parallel if FORCE == "parallel" else self.serial
        if (work < (PARALLEL_MIN_WORK if self.min_work is None else self.min_work) or one_thread()
                or kernel_tiers.first_tier_only()):
            return self.serial
        return self.parallel


def _renamed(fn: Callable[..., Any], suffix: str) -> Callable[..., Any]:
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    copy.__module__ = fn.__module__
    return copy
