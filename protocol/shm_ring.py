"""Shared-memory rings: how big arrays (a step's logits) reach a client without travelling in a message.

The daemon creates one POSIX shared-memory segment per client (mode 0600: only the daemon's user, the
only user that can reach a 0700 socket directory, can map it), cut into fixed-size slots. It writes an
array into a free slot and sends the slot's descriptor (messages.ShmSlot) in a Tokens frame; the client
maps the segment read-only, reads the array in place, and sends Release for the slot when done. A ring
with no free slot pauses the request that needs one: data is never dropped or overwritten unread.

Ordering needs no flags in the segment: the daemon writes the slot before the send that announces it,
and reuses it only after the Release arrives; both are socket system calls, which order memory.

A segment is named `ember-<pid>-<owner><random>`: the creating process, 8 hex digits derived from the
daemon's socket path (owner_id) and 8 random ones. A daemon that is killed cannot unlink its segments;
the next daemon on the same socket finds them by name and removes those whose creator is gone
(remove_dead_segments). The format still matches what older clients accept (`ember-<pid>-<16 hex>`).

Python's multiprocessing.shared_memory is not used: before 3.13 it registers even segments it merely
attaches to with a resource tracker that unlinks them when the *client* exits.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

import _posixshmem
import numpy as np

from ember.protocol.messages import ShmSlot
from ember.protocol.ring_slots import RingSlots

_NAME = re.compile(r"ember-[0-9]+-[0-9a-f]{16}")  # what a reader maps: nothing but a segment named so
_OWNED = re.compile(r"ember-(?P<pid>[1-9][0-9]{0,9})-(?P<owner>[0-9a-f]{8})[0-9a-f]{8}")
SHM_DIR = Path("/dev/shm")  # where Linux shows POSIX shared memory (POSIX itself cannot list segments)
_DTYPES = {"f32": np.dtype("<f4")}  # wire name -> numpy dtype; the only kinds a descriptor may name


class ShmRing(RingSlots):
    """The daemon's side: owns the segment, hands out slots (RingSlots), writes arrays, unlinks at close."""

    def __init__(self, name: str, buffer: mmap.mmap, n_slots: int, slot_bytes: int,
                 on_close: Callable[[], None] | None = None) -> None:
        super().__init__(n_slots, slot_bytes)
        self.name = name
        self._buffer = buffer
        self._on_close = on_close

    @staticmethod
    def bytes_for(n_slots: int, slot_bytes: int) -> int:
        """The segment's size for a ring of `n_slots` slots of `slot_bytes` (each rounded to a cache line)."""
        return n_slots * _aligned(slot_bytes)

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, mode: int = 0o600, group: int | None = None,
               owner: str | None = None, on_close: Callable[[], None] | None = None) -> ShmRing:
        """A new segment. owner: owner_id() of the daemon's socket (None: a random one, so that no
        daemon ever takes the segment for its own); on_close runs once, when the ring is closed."""
        if n_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots and bytes, got {n_slots} x {slot_bytes}")
        if owner is not None and not re.fullmatch(r"[0-9a-f]{8}", owner):
            raise ValueError(f"a ring's owner is 8 hex digits (owner_id), got {owner!r}")
        slot_bytes = _aligned(slot_bytes)
        name, fd = _open_new(owner or secrets.token_hex(4), mode)
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
        return cls(name, buffer, n_slots, slot_bytes, on_close)

    def write(self, slot: int, array: np.ndarray) -> ShmSlot:
        """Copy `array` (float32) into a held slot; returns its descriptor."""
        self._check_held(slot, self.name)
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
        if self._on_close is not None:
            self._on_close()  # the memory is given back (to the daemon's bound on rings, say)


def owner_id(socket_path: str | os.PathLike[str]) -> str:
    """8 hex digits naming the daemon of `socket_path` in its segments' names (symlinks resolved, so every
    spelling of one socket gives one id)."""
    return hashlib.sha256(os.fsencode(os.path.realpath(socket_path))).hexdigest()[:8]


def remove_dead_segments(owner: str, shm_dir: Path = SHM_DIR) -> list[tuple[str, int]]:
    """Unlink the segments of `owner` (owner_id of a socket) left by daemons that died; returns
    (name, bytes) of each one removed.

    Call it holding the socket's lock and before this process makes rings: then no live daemon serves
    that socket, so a segment named with this process's own pid is a predecessor's whose pid came round
    again (a container's daemon often gets the same pid each start). A segment whose creator is alive,
    one of another owner or user, and anything not named by ShmRing.create are left alone."""
    removed: list[tuple[str, int]] = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:  # no /dev/shm (not Linux): nothing to find
        return removed
    for entry in entries:
        match = _OWNED.fullmatch(entry.name)
        if match is None or match["owner"] != owner or _alive(int(match["pid"])):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_file(follow_symlinks=False) or st.st_uid != os.geteuid():
                continue
            _posixshmem.shm_unlink("/" + entry.name)
        except (FileNotFoundError, PermissionError):  # gone meanwhile, or not ours to remove
            continue
        removed.append((entry.name, st.st_size))
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # see remove_dead_segments: only a predecessor can have used our pid and socket
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except OverflowError:  # not a pid this system can have: leave the segment alone
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """It has exited and waits to be reaped (an engine whose daemon was killed waits for an init that
    may never reap it): its segments are garbage too."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it is gone meanwhile
        return False


def _aligned(slot_bytes: int) -> int:
    return -(-slot_bytes // 64) * 64  # each slot cache-line aligned


def _open_new(owner: str, mode: int) -> tuple[str, int]:
    """A new segment's name and descriptor; a name taken already (8 random hex digits can repeat) is
    drawn again."""
    for _ in range(8):
        name = f"ember-{os.getpid()}-{owner}{secrets.token_hex(4)}"
        try:
            return name, _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free shared-memory name for ember-{os.getpid()}-{owner}...")


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
