"""The device registry: device names ("cpu", "cuda:0") parsed in one place, and the backend of each
kind — its ops, the one-time preparation of a process that will use it, and the memory it offers.

Backends register here and nowhere else decides by device name: the runtime, the daemon and the
planner ask `backend_for(name)`. The cuda backend imports numba.cuda only when it is used, and says
in one line why it cannot run (numba-cuda missing, no GPU or driver, no such device index).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ember.kernels import get_ops
from ember.kernels.ops import Ops


@dataclass(frozen=True)
class DeviceName:
    kind: str  # "cpu" or "cuda"
    # cuda:N; cpu:N is a layer-split stage in a worker process of its own (bound to NUMA node N where
    # there is one); None for the plain CPU: the engine's own process
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> DeviceName:
        ray = re.fullmatch(r"ray:(\d+)(?:/cpu)?", text.strip())
        if ray is not None:  # a layer-split stage on the N-th node of a Ray cluster (runner/ray_pipeline.py)
            return cls("ray", int(ray.group(1)))
        m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", text.strip())
        if m is None:
            raise ValueError(f"not a device: {text!r} (cpu, cpu:N, cuda, cuda:N or ray:N/cpu)")
        if m.group(1) == "cuda":
            return cls("cuda", int(m.group(2) or 0))
        return cls("cpu", None if m.group(2) is None else int(m.group(2)))

    @property
    def in_process(self) -> bool:
        """Whether the engine's own process runs this device (plain `cpu`, or `cuda`; `cpu:N` is a
        worker process, `ray:N/cpu` an actor on a Ray node)."""
        return self.kind == "cuda" or (self.kind == "cpu" and self.index is None)

    def __str__(self) -> str:
        if self.kind == "ray":
            return f"ray:{self.index}/cpu"
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


class Backend(Protocol):
    kind: str

    def ops(self, device: DeviceName) -> Ops:
        """The kernels for `device`, one instance per loaded model."""

    def prepare(self, on_compile: Callable[[int, int], None] = lambda done, total: None,
                on_background: Callable[[str], None] = lambda line: None) -> None:
        """Whatever a process must do once before loading models on this kind (compile kernels...);
        reports a long compile's progress as on_compile(parts done, parts in all), (0, n) first. Work
        it leaves to the background (the CPU kernels' second tier) says how it went in lines for the
        log: on_background(line), from another thread."""

    def available_memory(self, device: DeviceName) -> int:
        """Bytes a plan may use on `device` when the user gives no budget."""

    def use_threads(self, threads: int) -> None:
        """Kernel threads for the kernels the calling thread runs (0: the backend's serving default)."""


class CpuBackend:
    kind = "cpu"

    def ops(self, device: DeviceName) -> Ops:
        return get_ops("cpu")

    def prepare(self, on_compile: Callable[[int, int], None] = lambda done, total: None,
                on_background: Callable[[str], None] = lambda line: None) -> None:
        # A first start serves once the first tier of kernels is cached: op by op, serial, the same
        # bits as every kernel gives (kernels/cpu/kernel_tiers.py); the rest follows in the background.
        from ember.daemon.runner.kernel_cache import complete_in_background, ensure_kernel_cache, kernel_cache_complete
        from ember.kernels.cpu import kernel_tiers

        ensure_kernel_cache(on_compile, whole=False)
        if kernel_cache_complete() or kernel_tiers.first_tier_only():  # complete, or being completed
            return
        kernel_tiers.use_first_tier()
        on_background("serving with the first tier of CPU kernels (op by op, serial) while the rest compiles "
                      "in the background, at the lowest CPU priority")

        def done() -> None:
            kernel_tiers.use_all()
            on_background("the CPU kernels are all compiled: fused layers and parallel kernels from the next step")

        complete_in_background(done, lambda error: on_background(f"compiling the rest of the CPU kernels failed "
                                                                 f"(serving on with the first tier): {error}"))

    def available_memory(self, device: DeviceName) -> int:
        from ember.daemon.planning.planner import available_ram

        return available_ram()

    def use_threads(self, threads: int) -> None:
        # numba's thread count is per calling thread: the engine sets its own. The engine has a process
        # of its own, so no I/O or text thread takes its GIL between kernels: one thread per core
        # serves a stream faster than leaving a core to the front and the clients (docs/daemon.md,
        # "Kernel threads").
        import numba

        cores = len(os.sched_getaffinity(0))
        numba.set_num_threads(min(threads or cores, numba.config.NUMBA_NUM_THREADS))


class CudaUnavailable(OSError):
    """A cuda device was asked for and this machine cannot run CUDA kernels; the message is one line
    (an OSError: what the machine lacks, which the command line prints as its one-line error)."""


class CudaBackend:
    kind = "cuda"

    def ops(self, device: DeviceName) -> Ops:
        self._check(device)
        from ember.kernels.cuda.backend import CudaOps

        return CudaOps(device.index or 0)

    def prepare(self, on_compile: Callable[[int, int], None] = lambda done, total: None,
                on_background: Callable[[str], None] = lambda line: None) -> None:
        self._check(DeviceName("cuda", 0))
        from ember.kernels.cuda.device import SIMULATOR

        if SIMULATOR:
            # The simulator runs every CUDA thread as a Python thread and its scheduler polls them:
            # a short GIL switch interval makes each syncthreads ~7x cheaper (64 blocks of 8 threads
            # with one syncthreads each: 1.3 s at the default 5 ms, 0.18 s at 0.1 ms, this VM).
            import sys

            sys.setswitchinterval(1e-4)

    def available_memory(self, device: DeviceName) -> int:
        self._check(device)
        from ember.kernels.cuda.device import SIMULATOR

        if SIMULATOR:  # the simulator's device memory is host memory
            from ember.daemon.planning.planner import available_ram

            return available_ram()
        from numba import cuda

        with cuda.gpus[device.index or 0]:
            free, _total = cuda.current_context().get_memory_info()
        return int(free)

    def use_threads(self, threads: int) -> None:
        pass  # GPU kernels take no host threads

    @staticmethod
    def _check(device: DeviceName) -> None:
        """CudaUnavailable, with the reason, unless this machine can run CUDA kernels on `device`."""
        try:
            from ember.kernels.cuda.device import unavailable_reason
        except ImportError as e:
            raise CudaUnavailable(f"{device}: CUDA needs numba-cuda (pip install 'ember[cuda]'): {e}") from None
        reason = unavailable_reason()
        if reason is not None:
            raise CudaUnavailable(f"{device}: no usable CUDA device ({reason}); "
                                  "NUMBA_ENABLE_CUDASIM=1 runs the CUDA kernels on numba's simulator instead")
        from numba import cuda

        if (device.index or 0) >= len(cuda.gpus):
            raise CudaUnavailable(f"{device}: no such device (this machine has {len(cuda.gpus)} CUDA device(s))")


class RayBackend(CpuBackend):
    """`ray:N/cpu`: a stage on a Ray node, which runs the CPU kernels there (runner/ray_pipeline.py).
    The engine's process needs Ray to reach it, and plans with this host's memory as each node's."""
    kind = "ray"

    def ops(self, device: DeviceName) -> Ops:
        self._check(device)
        return super().ops(device)

    def available_memory(self, device: DeviceName) -> int:
        self._check(device)
        return super().available_memory(device)

    @staticmethod
    def _check(device: DeviceName) -> None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise OSError(f"{device}: a layer split on Ray needs Ray (pip install 'ember[cluster]')")


BACKENDS: dict[str, Backend] = {"cpu": CpuBackend(), "cuda": CudaBackend(), "ray": RayBackend()}


def backend_for(device: str | DeviceName) -> Backend:
    name = device if isinstance(device, DeviceName) else DeviceName.parse(device)
    backend = BACKENDS.get(name.kind)
    if backend is None:
        raise ValueError(f"{name}: this build of ember has no {name.kind} backend yet "
                         f"(available: {', '.join(BACKENDS)})")
    return backend


def model_ops(device: DeviceName, prompt_act: str) -> Ops:
    """The kernels for one model on `device` (backend_for(device).ops), computing its prompt rows
    against quantized weights with `prompt_act` activations (kernels/convert.PROMPT_ACTIVATIONS)."""
    ops = backend_for(device).ops(device)
    ops.prompt_act = prompt_act
    return ops
