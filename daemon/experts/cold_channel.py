"""The channel between the engine and one cold-expert worker: a bounded shared-memory segment and a
socket pair, defined once for both sides.

The segment (created 0600 under /dev/shm and unlinked at once: both sides hold it by file
descriptor, so nothing is left behind if either dies) has room for `capacity` (token, expert) pairs:

    x       float32 [capacity, hidden]   the routed activations, one row per pair
    expert  int32   [capacity]           which expert each pair goes to
    weight  float32 [capacity]           its routing weight
    decode  uint8   [capacity]           1 where the token is a generated one (ops.matmul's decode rows)
    out     float32 [capacity, hidden]   weight * expert(x), written by the worker

Messages are fixed-size structs on the socket (no pickle): a Job (sequence number, layer, pairs), and
a Reply (sequence number, status, seconds spent computing). A blocking recv is the signal, so neither side polls.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass

import numpy as np

JOB = struct.Struct("<IIi")  # seq, layer, pairs
REPLY = struct.Struct("<IIf")  # seq, status, seconds the worker computed
OK, FAILED = 0, 1
READY = b"R"  # the worker's first byte: model mapped, kernels loaded


@dataclass
class ColdSlots:
    x: np.ndarray
    expert: np.ndarray
    weight: np.ndarray
    decode: np.ndarray
    out: np.ndarray

    @staticmethod
    def nbytes(capacity: int, hidden: int) -> int:
        return capacity * (2 * 4 * hidden + 4 + 4 + 1)

    @classmethod
    def over(cls, buf: mmap.mmap, capacity: int, hidden: int) -> ColdSlots:
        arrays, offset = [], 0
        for dtype, shape in ((np.float32, (capacity, hidden)), (np.int32, (capacity,)), (np.float32, (capacity,)),
                             (np.uint8, (capacity,)), (np.float32, (capacity, hidden))):
            a = np.frombuffer(buf, dtype, int(np.prod(shape)), offset).reshape(shape)
            arrays.append(a)
            offset += a.nbytes
        return cls(*arrays)


def create_segment(nbytes: int) -> int:
    """A 0600 shared-memory segment of nbytes, already unlinked: its file descriptor (inheritable, to
    pass to the worker)."""
    import _posixshmem

    name = f"/ember-cold-{os.getpid()}-{secrets.token_hex(6)}"
    fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    _posixshmem.shm_unlink(name)
    os.ftruncate(fd, nbytes)
    return fd


def map_segment(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def recv_exact(sock, n: int) -> bytes:
    """n bytes from the socket; b"" if the other side closed it (a worker that died)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return b""
        data += chunk
    return data
