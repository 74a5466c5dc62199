"""Shared-memory rings: how big arrays (a step's logits) reach a client without travelling in a message.

The daemon creates one POSIX shared-memory segment per client (mode 0600: only the daemon's user, the
only user that can reach a 0700 socket directory, can map it), cut into fixed-size slots. It writes an
array into a free slot and sends the slot's descriptor (messages.ShmSlot) in a Tokens frame; the client
maps the segment read-only, reads the array in place, and sends Release for the slot when done. A ring
with no free slot pauses the request that needs one: data is never dropped or overwritten unread.

Ordering needs no flags in the segment: the daemon writes the slot before the send that announces it,
and reuses it only after the Release arrives; both are socket system calls, which order memory.

Python's multiprocessing.shared_memory is not used: before 3.13 it registers even segments it merely
attaches to with a resource tracker that unlinks them when the *client* exits.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets

import _posixshmem
import numpy as np

from ember.protocol.messages import ShmSlot

_NAME = re.compile(r"ember-[0-9]+-[0-9a-f]{16}")
_DTYPES = {"f32": np.dtype("<f4")}  # wire name -> numpy dtype; the only kinds a descriptor may name


class ShmRing:
    """The daemon's side: owns the segment, hands out slots, writes arrays, unlinks at close."""

    def __init__(self, name: str, buffer: mmap.mmap, n_slots: int, slot_bytes: int) -> None:
        self.name, self.n_slots, self.slot_bytes = name, n_slots, slot_bytes
        self._buffer = buffer
        self._free = list(range(n_slots - 1, -1, -1))  # a stack: the most recently released slot is warm
        self._held: set[int] = set()

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, mode: int = 0o600, group: int | None = None) -> ShmRing:
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots and bytes, got {n_slots} x {slot_bytes}")
        slot_bytes = -(-slot_bytes // 64) * 64  # each slot cache-line aligned
        name = f"ember-{os.getpid()}-{secrets.token_hex(8)}"
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
            if group is not None:
                os.fchown(fd, -1, group)
            os.ftruncate(fd, n_slots * slot_bytes)
            buffer = mmap.mmap(fd, n_slots * slot_bytes)
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        return cls(name, buffer, n_slots, slot_bytes)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot, now held until released; None when the ring is full."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> bool:
        """Give a slot back. A slot that is not held (a client's mistake or a repeat) is ignored."""
        if slot not in self._held:
            return False
        self._held.remove(slot)
        self._free.append(slot)
        return True

    def write(self, slot: int, array: np.ndarray) -> ShmSlot:
        """Copy `array` (float32) into a held slot; returns its descriptor."""
        if slot not in self._held:
            raise ValueError(f"slot {slot} of {self.name} is not held")
        data = np.ascontiguousarray(array, dtype=_DTYPES["f32"])
        if data.nbytes > self.slot_bytes:
            raise ValueError(f"{data.nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        offset = slot * self.slot_bytes
        target = np.frombuffer(self._buffer, dtype=data.dtype, count=data.size, offset=offset)
        target[:] = data.reshape(-1)
        return ShmSlot(self.name, slot, offset, tuple(data.shape), "f32")

    def close(self) -> None:
        """Unmap and unlink; a client that still has it mapped keeps its mapping until it lets go."""
        if self._buffer.closed:
            return
        self._buffer.close()
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass


class ShmRingReader:
    """The client's side: read-only mappings of the daemon's segments, opened on first use."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def view(self, slot: ShmSlot) -> np.ndarray:
        """A read-only numpy view of the array `slot` describes (valid until the slot is released)."""
        if slot.dtype not in _DTYPES:
            raise ValueError(f"unknown array dtype {slot.dtype!r} in a logits descriptor")
        dtype = _DTYPES[slot.dtype]
        if any(n < 0 for n in slot.shape) or slot.offset < 0:
            raise ValueError(f"bad logits descriptor {slot}")
        count = int(np.prod(slot.shape, dtype=np.int64))
        array = np.frombuffer(self._map(slot.segment), dtype=dtype, count=count, offset=slot.offset)
        return array.reshape(slot.shape)  # frombuffer of a read-only mapping is read-only

    def _map(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            if not _NAME.fullmatch(name):
                raise ValueError(f"not an ember shared-memory segment: {name!r}")
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
            try:
                self._maps[name] = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        return self._maps[name]

    def forget(self, name: str) -> None:
        """Drop a mapping (numpy views of it keep it alive until they go)."""
        m = self._maps.pop(name, None)
        if m is not None:
            _close_quietly(m)

    def close(self) -> None:
        for name in list(self._maps):
            self.forget(name)


def _close_quietly(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:  # a numpy view still uses it: the mapping goes with the last view
        pass
