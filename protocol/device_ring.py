"""Device rings: how a step's logits reach a local client without leaving the GPU (CUDA IPC).

The engine allocates one CUDA buffer per client that asks for device logits (Generate.device_logits),
cut into slots as a shared-memory ring is (protocol/shm_ring.py, the same discipline:
ring_slots.RingSlots), and one interprocess event per slot. It copies a block of logits into a free
slot on its current stream, records the slot's event behind the copy, and sends the slot's descriptor
(messages.DeviceSlot) in the Tokens frame: the allocation's IPC handle, the offset, the event's handle.
The client opens the allocation once and each slot's event once, makes its current stream wait on the
event (no host synchronization) and reads a CuPy view in place. Before it sends Release (device=True)
it waits for its stream's work (which may still read the slot) to finish, and it closes every handle
when it disconnects. A ring with no free slot holds
the request that needs one, as for shared memory: nothing is overwritten unread.

The buffer comes from cudaMalloc itself, not from CuPy's memory pool: an IPC handle names a whole
allocation, and the other process maps it from its base, so a pool's sub-block would be read at the
wrong address. CUDA refuses to open a handle in the process that made it, so a client and its daemon
are always two processes; the engine runs in a process of its own anyway (daemon/server/engine_main.py).

CUDA's calls are behind IpcRuntime: CupyIpc (CuPy, imported only when a ring is made or read) is the
one ember ships; tests/cuda stand a host fake behind it to check the discipline where no GPU is.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ember.protocol.messages import DeviceSlot
from ember.protocol.ring_slots import RingSlots

_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
_ALIGN = 256  # each slot starts where CUDA's own allocations would (and any vector load can)


class IpcRuntime(Protocol):
    # the daemon's side
    def allocate(self, nbytes: int) -> Any: ...
    def memory_handle(self, memory: Any) -> bytes: ...
    def bus_id(self, memory: Any) -> str: ...
    def new_event(self) -> Any: ...
    def event_handle(self, event: Any) -> bytes: ...
    def write(self, memory: Any, offset: int, array: Any) -> tuple[int, ...]:
        """Copy `array` (float32, on the device) to `offset` bytes into `memory`, on the current stream;
        -> its shape."""
        ...
    def record(self, event: Any) -> None: ...
    # the client's side
    def open_memory(self, handle: bytes, bus_id: str, nbytes: int) -> Any: ...
    def close_memory(self, mapped: Any) -> None: ...
    def open_event(self, handle: bytes) -> Any: ...
    def close_event(self, event: Any) -> None: ...
    def view(self, mapped: Any, offset: int, shape: tuple[int, ...], event: Any) -> Any:
        """The array at `offset` of an opened allocation, once the current stream has waited for `event`."""
        ...
    def finish(self) -> None:
        """Wait until the current stream's work is done."""
        ...


class DeviceRing(RingSlots):
    """The engine's side: owns the allocation and its events, hands out slots (RingSlots), writes logits."""

    def __init__(self, runtime: IpcRuntime, n_slots: int, slot_bytes: int,
                 on_close: Callable[[], None] | None = None) -> None:
        """A ring of `n_slots` slots of `slot_bytes` on the current device; on_close runs once, at close()."""
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots and bytes, got {n_slots} x {slot_bytes}")
        super().__init__(n_slots, _aligned(slot_bytes))
        self._runtime = runtime
        self._memory = runtime.allocate(self.nbytes)
        self._handle = runtime.memory_handle(self._memory)
        self._bus_id = runtime.bus_id(self._memory)
        self._events = [runtime.new_event() for _ in range(n_slots)]
        self._event_handles = [runtime.event_handle(e) for e in self._events]
        self._on_close = on_close
        self.name = f"device ring {self._handle[:8].hex()}"

    def write(self, slot: int, array: Any) -> DeviceSlot:
        """Copy `array` (float32 logits on this ring's device) into a held slot, behind whatever the
        current stream has queued, and record the slot's event after it; -> the slot's descriptor."""
        self._check_held(slot, self.name)
        if int(array.size) * 4 > self.slot_bytes:
            raise ValueError(f"{int(array.size) * 4} bytes do not fit a {self.slot_bytes}-byte slot")
        offset = slot * self.slot_bytes
        shape = self._runtime.write(self._memory, offset, array)
        self._runtime.record(self._events[slot])
        return DeviceSlot(self._handle, self.nbytes, self._bus_id, slot, offset, tuple(shape),
                          self._event_handles[slot])

    def close(self) -> None:
        """Let the allocation and its events go (CUDA frees them once no client has them open)."""
        if self._memory is None:
            return
        self._memory, self._events = None, []
        if self._on_close is not None:
            self._on_close()


class DeviceRingReader:
    """The client's side: each allocation and event opened once, on first use; all closed at close()."""

    def __init__(self, runtime: IpcRuntime | None = None) -> None:
        self._runtime = runtime
        self._memory: dict[bytes, Any] = {}
        self._events: dict[bytes, Any] = {}

    def view(self, slot: DeviceSlot) -> Any:
        """The logits `slot` describes, as an array on the device (CuPy's), valid until the slot is released."""
        if slot.dtype != "f32":
            raise ValueError(f"unknown array dtype {slot.dtype!r} in a logits descriptor")
        if len(slot.memory) != _HANDLE_BYTES or len(slot.event) != _HANDLE_BYTES:
            raise ValueError("a device logits descriptor's handles are 64 bytes each")
        count = 1
        for n in slot.shape:
            if n < 0:
                raise ValueError(f"bad logits descriptor shape {slot.shape}")
            count *= n
        if slot.offset < 0 or slot.offset + 4 * count > slot.ring_bytes:
            raise ValueError(f"a device logits descriptor beyond its ring ({slot.offset} + {4 * count} bytes "
                             f"of {slot.ring_bytes})")
        runtime = self._runtime_()
        if slot.memory not in self._memory:
            self._memory[slot.memory] = runtime.open_memory(slot.memory, slot.bus_id, slot.ring_bytes)
        if slot.event not in self._events:
            self._events[slot.event] = runtime.open_event(slot.event)
        return runtime.view(self._memory[slot.memory], slot.offset, tuple(slot.shape), self._events[slot.event])

    def finish(self) -> None:
        """Before the slots read so far are released: the work queued on the current stream, which may
        still read them, is done (the daemon writes a released slot again)."""
        if self._memory:
            self._runtime_().finish()

    def close(self) -> None:
        """Close every handle this reader opened (views of them must not be used after)."""
        if self._runtime is None:
            return
        memory, events, self._memory, self._events = self._memory, self._events, {}, {}
        for mapped in memory.values():
            self._runtime.close_memory(mapped)
        for event in events.values():
            self._runtime.close_event(event)

    def _runtime_(self) -> IpcRuntime:
        if self._runtime is None:
            self._runtime = CupyIpc()
        return self._runtime


class CupyIpc:
    """IpcRuntime through CuPy: cudaMalloc'd memory, interprocess events, views as CuPy arrays."""

    def __init__(self) -> None:
        try:
            import cupy  # noqa: PLC0415 - only a process that uses device logits needs CuPy
        except ImportError as e:
            raise RuntimeError(f"device logits need CuPy (pip install 'ember[cuda]'): {e}") from None
        self._cp = cupy
        self._rt = cupy.cuda.runtime

    def allocate(self, nbytes: int) -> Any:
        return self._cp.cuda.Memory(nbytes)  # cudaMalloc, on the current device

    def memory_handle(self, memory: Any) -> bytes:
        return bytes(self._rt.ipcGetMemHandle(memory.ptr))

    def bus_id(self, memory: Any) -> str:
        return str(self._rt.deviceGetPCIBusId(memory.device_id))

    def new_event(self) -> Any:
        return self._cp.cuda.Event(block=False, disable_timing=True, interprocess=True)

    def event_handle(self, event: Any) -> bytes:
        return bytes(self._rt.ipcGetEventHandle(event.ptr))

    def write(self, memory: Any, offset: int, array: Any) -> tuple[int, ...]:
        cp = self._cp
        source = cp.asarray(array, dtype=cp.float32)  # a numba array too, through __cuda_array_interface__
        target = cp.ndarray(source.shape, cp.float32, cp.cuda.MemoryPointer(memory, offset))
        target[...] = source
        return tuple(source.shape)

    def record(self, event: Any) -> None:
        event.record()

    def open_memory(self, handle: bytes, bus_id: str, nbytes: int) -> Any:
        device = self._rt.deviceGetByPCIBusId(bus_id)  # this process may number the GPUs otherwise
        with self._cp.cuda.Device(device):
            pointer = self._rt.ipcOpenMemHandle(handle)
        return self._cp.cuda.UnownedMemory(pointer, nbytes, None, device)

    def close_memory(self, mapped: Any) -> None:
        with self._cp.cuda.Device(mapped.device_id):
            self._rt.ipcCloseMemHandle(mapped.ptr)

    def open_event(self, handle: bytes) -> Any:
        return self._rt.ipcOpenEventHandle(handle)

    def close_event(self, event: Any) -> None:
        self._rt.eventDestroy(event)

    def view(self, mapped: Any, offset: int, shape: tuple[int, ...], event: Any) -> Any:
        cp = self._cp
        with cp.cuda.Device(mapped.device_id):
            self._rt.streamWaitEvent(cp.cuda.get_current_stream().ptr, event, 0)
            return cp.ndarray(shape, cp.float32, cp.cuda.MemoryPointer(mapped, offset))

    def finish(self) -> None:
        self._cp.cuda.get_current_stream().synchronize()


def _aligned(slot_bytes: int) -> int:
    return -(-slot_bytes // _ALIGN) * _ALIGN
