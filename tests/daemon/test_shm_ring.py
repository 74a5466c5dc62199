"""The shared-memory logits ring, both sides, in one process."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from ember.protocol.messages import ShmSlot
from ember.protocol.shm_ring import ShmRing, ShmRingReader


@pytest.fixture
def ring():  # type: ignore[no-untyped-def]
    r = ShmRing.create(3, 100 * 4)
    yield r
    r.close()


def test_segment_is_private_and_gone_after_close() -> None:
    r = ShmRing.create(2, 64)
    path = f"/dev/shm/{r.name}"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    r.close()
    r.close()  # twice is harmless
    assert not os.path.exists(path)


def test_reader_sees_exact_bytes_read_only(ring: ShmRing) -> None:
    data = np.random.default_rng(0).standard_normal((1, 100)).astype(np.float32)
    data[0, :3] = [np.nan, np.inf, -0.0]
    desc = ring.write(ring.acquire(), data)
    reader = ShmRingReader()
    view = reader.view(desc)
    assert view.shape == (1, 100) and view.dtype == np.float32
    assert view.tobytes() == data.tobytes()
    with pytest.raises(ValueError):
        view[0, 0] = 1.0
    reader.close()


def test_slots_are_handed_out_once_and_come_back(ring: ShmRing) -> None:
    slots = [ring.acquire() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and ring.acquire() is None and ring.free_slots == 0
    assert ring.release(slots[1]) and not ring.release(slots[1])  # a repeat is ignored
    assert not ring.release(99)
    assert ring.acquire() == slots[1]


def test_write_checks_slot_and_size(ring: ShmRing) -> None:
    with pytest.raises(ValueError, match="not held"):
        ring.write(0, np.zeros((1, 10), np.float32))
    slot = ring.acquire()
    with pytest.raises(ValueError, match="do not fit"):
        ring.write(slot, np.zeros((1, ring.slot_bytes // 4 + 1), np.float32))
    desc = ring.write(slot, np.arange(7, dtype=np.float64)[::2])  # non-contiguous, other dtype: converted
    assert ShmRingReader().view(desc).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_reader_refuses_bad_descriptors(ring: ShmRing) -> None:
    reader = ShmRingReader()
    with pytest.raises(ValueError, match="not an ember"):
        reader.view(ShmSlot("../etc/passwd", 0, 0, (1,)))
    with pytest.raises(ValueError, match="dtype"):
        reader.view(ShmSlot(ring.name, 0, 0, (1,), "object"))
    with pytest.raises(ValueError):
        reader.view(ShmSlot(ring.name, 0, ring.slot_bytes * 3 - 4, (1, 100)))  # past the end
    with pytest.raises(ValueError):
        reader.view(ShmSlot(ring.name, 0, -4, (1,)))
