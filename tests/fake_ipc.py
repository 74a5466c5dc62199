"""HostIpc: protocol/device_ring.py's IpcRuntime over host memory, for checking the device rings'
discipline where no GPU is. An allocation is a numpy buffer named by a random 64-byte "handle" in a
registry both sides share (one process stands for two); every call is logged, so a test can see that
each write is followed by its slot's event, that a reader opens each handle once, and closes them."""
from __future__ import annotations

import secrets
from typing import Any

import numpy as np


class HostIpc:
    def __init__(self, device_arrays: bool = False) -> None:
        """device_arrays: every array written must be a device array (a DeviceArray of the CUDA
        backend, the simulator's too), never host memory."""
        self.device_arrays = device_arrays
        self.memory: dict[bytes, np.ndarray] = {}  # handle -> the allocation's bytes
        self.events: dict[bytes, list[int]] = {}  # handle -> [times recorded]
        self.log: list[tuple[str, Any]] = []
        self.open: set[bytes] = set()  # handles a reader holds open

    # --- the daemon's side
    def allocate(self, nbytes: int) -> bytes:
        handle = secrets.token_bytes(64)
        self.memory[handle] = np.zeros(nbytes, np.uint8)
        return handle

    def memory_handle(self, memory: bytes) -> bytes:
        return memory

    def bus_id(self, memory: bytes) -> str:
        return "0000:00:00.0"

    def new_event(self) -> bytes:
        handle = secrets.token_bytes(64)
        self.events[handle] = [0]
        return handle

    def event_handle(self, event: bytes) -> bytes:
        return event

    def write(self, memory: bytes, offset: int, array: Any) -> tuple[int, ...]:
        if self.device_arrays and not hasattr(array, "to_host"):
            raise AssertionError(f"host logits ({type(array).__name__}) written into a device ring")
        rows = np.asarray(array.to_host() if hasattr(array, "to_host") else array, np.float32)  # a DeviceArray too
        self.memory[memory][offset : offset + rows.nbytes] = rows.reshape(-1).view(np.uint8)
        self.log.append(("write", offset))
        return rows.shape

    def record(self, event: bytes) -> None:
        self.events[event][0] += 1
        self.log.append(("record", event))

    # --- the client's side
    def open_memory(self, handle: bytes, bus_id: str, nbytes: int) -> bytes:
        if handle not in self.memory or self.memory[handle].nbytes != nbytes:
            raise ValueError("no such allocation")
        return self._open("memory", handle)

    def close_memory(self, mapped: bytes) -> None:
        self._close("memory", mapped)

    def open_event(self, handle: bytes) -> bytes:
        return self._open("event", handle)

    def close_event(self, event: bytes) -> None:
        self._close("event", event)

    def _open(self, kind: str, handle: bytes) -> bytes:
        self.log.append((f"open {kind}", handle))
        self.open.add(handle)
        return handle

    def _close(self, kind: str, handle: bytes) -> None:
        self.log.append((f"close {kind}", handle))
        self.open.remove(handle)

    def view(self, mapped: bytes, offset: int, shape: tuple[int, ...], event: bytes) -> np.ndarray:
        if not self.events[event][0]:
            raise AssertionError("a view of a slot whose event was never recorded")
        self.log.append(("wait", event))
        count = int(np.prod(shape))
        return self.memory[mapped][offset : offset + 4 * count].view(np.float32).reshape(shape)

    def finish(self) -> None:
        self.log.append(("finish", None))

    def opened(self, kind: str) -> int:
        return sum(1 for what, _ in self.log if what == f"open {kind}")
