"""Staging segments: the shared memory a layer split's hidden states cross a boundary in, and the one
the last stage writes its logits rows to.

A boundary's segment holds a slot per micro-batch in flight, which is one per stage (two stages:
double-buffered, the stage before writes micro-batch m+1 into one slot while the stage after still
reads micro-batch m from the other), each of `max_tokens` rows of `hidden` values in the precision
policy's `act_dtype` (f32, or f16 / bf16 bit patterns as uint16, kernels/convert.py). Its size is
exactly the planner's staging figure for the receiving device (`boundary_bytes`,
planning/staging_bytes.py: the one formula both use). Rows are widened back to f32 as they are read,
so the next layer's norm and everything after it compute in f32.

The engine's process creates every segment (mode 0600, named like protocol/shm_ring.py's) and is
the only one that unlinks them; workers map them by name. A micro-batch keeps its slot (its lane,
runner/pipeline.py) from submit to collect, so a slot has one writer and one reader at a time.
"""
from __future__ import annotations

import mmap
import os
import secrets

import _posixshmem
import numpy as np

from ember.daemon.planning.staging_bytes import boundary_bytes
from ember.kernels.convert import decode_rows, encode_rows, storage_bytes
from ember.protocol.shm_ring import _open_new


class Segment:
    """A POSIX shared-memory segment: created (and later unlinked) by its owner, or attached by name."""

    def __init__(self, name: str, buffer: mmap.mmap, owner: bool) -> None:
        self.name, self._buffer, self._owner = name, buffer, owner

    @classmethod
    def create(cls, nbytes: int, owner: str | None = None) -> Segment:
        """owner: the daemon's socket's owner_id (protocol/shm_ring.py), so that the next daemon on the
        socket removes what a killed one left; None: a random one."""
        name, fd = _open_new(owner or secrets.token_hex(4), 0o600)
        try:
            os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
            os.ftruncate(fd, max(nbytes, 1))
            buffer = mmap.mmap(fd, max(nbytes, 1))
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        return cls(name, buffer, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
        try:
            buffer = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, buffer, owner=False)

    @property
    def nbytes(self) -> int:
        return len(self._buffer)

    @staticmethod
    def unlink(name: str) -> None:
        """Remove a segment by name (gone already: nothing to do). For an attached segment whose owner
        died without unlinking it: its memory goes once every mapping of it goes."""
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            pass

    def array(self, dtype: np.dtype | type, count: int, offset: int = 0) -> np.ndarray:
        return np.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)

    def close(self) -> None:
        if self._buffer.closed:
            return
        try:
            self._buffer.close()
        except BufferError:  # a numpy view still uses the mapping: it goes with the last view
            pass
        if self._owner:
            Segment.unlink(self.name)


class Boundary:
    """The hidden states crossing one boundary: slots of max_tokens x hidden rows, as many as the
    segment holds."""

    def __init__(self, segment: Segment, hidden: int, max_tokens: int, act_dtype: str) -> None:
        self.segment, self.hidden, self.max_tokens, self.act_dtype = segment, hidden, max_tokens, act_dtype
        self.row_bytes = storage_bytes(act_dtype, hidden)
        self.slot_bytes = max_tokens * self.row_bytes
        self.slots = segment.nbytes // self.slot_bytes
        self._storage = np.float32 if act_dtype == "f32" else np.uint16

    @classmethod
    def create(cls, hidden: int, max_tokens: int, act_dtype: str, stages: int, owner: str | None = None) -> Boundary:
        segment = Segment.create(boundary_bytes(hidden, max_tokens, act_dtype, stages), owner)
        return cls(segment, hidden, max_tokens, act_dtype)

    def write(self, slot: int, x: np.ndarray) -> None:
        """Rows x [n, hidden] (f32) into `slot`, in the staging dtype."""
        self._slot(slot, x.shape[0])[:] = encode_rows(x, self.act_dtype)

    def read(self, slot: int, n: int) -> np.ndarray:
        """The n rows of `slot` as float32 [n, hidden] (a copy: the slot may be reused at once)."""
        return decode_rows(self._slot(slot, n), self.act_dtype, self.hidden)

    def _slot(self, slot: int, n: int) -> np.ndarray:
        if not 0 <= slot < self.slots or n > self.max_tokens:
            raise ValueError(f"staging slot {slot} with {n} rows (slots 0-{self.slots - 1}, {self.max_tokens} rows each)")
        width = self.row_bytes // np.dtype(self._storage).itemsize
        return self.segment.array(self._storage, n * width, slot * self.slot_bytes).reshape(n, width)


class LogitsRows:
    """Where the last stage leaves the logits rows of a step: max_rows x vocab float32."""

    def __init__(self, segment: Segment, vocab: int, max_rows: int) -> None:
        self.segment, self.vocab, self.max_rows = segment, vocab, max_rows

    @classmethod
    def create(cls, vocab: int, max_rows: int, owner: str | None = None) -> LogitsRows:
        return cls(Segment.create(max_rows * vocab * 4, owner), vocab, max_rows)

    def rows(self, first: int, n: int) -> np.ndarray:
        if first < 0 or first + n > self.max_rows:
            raise ValueError(f"logits rows {first}-{first + n - 1} of {self.max_rows}")
        return self.segment.array(np.float32, n * self.vocab, first * self.vocab * 4).reshape(n, self.vocab)
