"""The device registry: device names ("cpu", "cuda:0") parsed in one place, and the backend of each
kind — its ops, the one-time preparation of a process that will use it, and the memory it offers.

Backends register here and nowhere else decides by device name: the runtime, the daemon and the
planner ask `backend_for(name)`. A kind this build has no backend for (cuda, until kernels/cuda/
exists) is refused with a message that says so.
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
        m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", text.strip())
        if m is None:
            raise ValueError(f"not a device: {text!r} (cpu, cpu:N, cuda or cuda:N)")
        if m.group(1) == "cuda":
            return cls("cuda", int(m.group(2) or 0))
        return cls("cpu", None if m.group(2) is None else int(m.group(2)))

    @property
    def in_process(self) -> bool:
        """Whether the engine's own process runs this device (plain `cpu`; `cpu:N` is a worker)."""
        return self.kind != "cpu" or self.index is None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


class Backend(Protocol):
    kind: str

    def ops(self, device: DeviceName) -> Ops:
        """The kernels for `device`, one instance per loaded model."""

    def prepare(self, on_compile: Callable[[], None] = lambda: None) -> None:
        """Whatever a process must do once before loading models on this kind (compile kernels...);
        calls on_compile first if that will take long."""

    def available_memory(self, device: DeviceName) -> int:
        """Bytes a plan may use on `device` when the user gives no budget."""

    def use_threads(self, threads: int) -> None:
        """Kernel threads for the kernels the calling thread runs (0: the backend's serving default)."""


class CpuBackend:
    kind = "cpu"

    def ops(self, device: DeviceName) -> Ops:
        return get_ops("cpu")

    def prepare(self, on_compile: Callable[[], None] = lambda: None) -> None:
        from ember.daemon.runner.kernel_cache import ensure_kernel_cache

        ensure_kernel_cache(on_compile)

    def available_memory(self, device: DeviceName) -> int:
        from ember.daemon.planning.planner import available_ram

        return available_ram()

    def use_threads(self, threads: int) -> None:
        # numba's thread count is per calling thread: the engine thread sets its own. Serving leaves a
        # core to the I/O loop and the clients: on the 2-core dev VM the 2-thread kernels' fork-join
        # barriers, interrupted by the daemon's other threads and a local client, ran a stream at 170
        # tok/s where one kernel thread ran it at 310 (docs/daemon.md, "Kernel threads").
        import numba

        cores = len(os.sched_getaffinity(0))
        numba.set_num_threads(min(threads or max(1, cores - 1), numba.config.NUMBA_NUM_THREADS))


BACKENDS: dict[str, Backend] = {"cpu": CpuBackend()}


def backend_for(device: str | DeviceName) -> Backend:
    name = device if isinstance(device, DeviceName) else DeviceName.parse(device)
    backend = BACKENDS.get(name.kind)
    if backend is None:
        raise ValueError(f"{name}: this build of ember has no {name.kind} backend yet "
                         f"(available: {', '.join(BACKENDS)})")
    return backend
