"""protocol/device_ring.py's discipline over a host stand-in for CUDA (tests/fake_ipc.py): slots held
until released, each write followed by its slot's event, a reader that opens each handle once, waits
on the slot's event before it reads, and closes everything; hostile descriptors refused before any
handle is opened. The same code over CuPy runs in tests/cuda/test_device_logits.py on a GPU."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from ember.client.request_builder import HeldSlots, LogitsReader
from ember.protocol.codec import Codec
from ember.protocol.device_ring import DeviceRing, DeviceRingReader
from ember.protocol.messages import DeviceSlot, Release, Tokens
from tests.fake_ipc import HostIpc

VOCAB = 100


def test_slots_are_written_behind_their_events_and_never_twice_unread() -> None:
    ipc, closed = HostIpc(), []
    ring = DeviceRing(ipc, 2, VOCAB * 4, on_close=lambda: closed.append(1))
    a, b = ring.acquire(), ring.acquire()
    assert ring.acquire() is None and ring.free_slots == 0  # both held: a third block waits
    rows = np.arange(2 * VOCAB, dtype=np.float32).reshape(2, VOCAB)
    slot_a = ring.write(a, rows[:1])
    slot_b = ring.write(b, rows[1:])
    assert [what for what, _ in ipc.log] == ["write", "record", "write", "record"]
    assert slot_a.shape == (1, VOCAB) and slot_a.offset != slot_b.offset and slot_a.event != slot_b.event
    assert slot_a.offset % 256 == 0 and slot_b.offset % 256 == 0
    assert ring.release(a) and not ring.release(a)  # a repeat is ignored
    with pytest.raises(ValueError, match="not held"):
        ring.write(a, rows[:1])
    with pytest.raises(ValueError, match="do not fit"):
        ring.write(ring.acquire(), np.zeros((2, VOCAB), np.float32))
    ring.close()
    ring.close()
    assert closed == [1]


def test_a_reader_opens_each_handle_once_reads_after_the_event_and_closes_all() -> None:
    ipc = HostIpc()
    ring = DeviceRing(ipc, 3, VOCAB * 4)
    reader = DeviceRingReader(ipc)
    rng = np.random.default_rng(0)
    for held in (3, 1):  # every slot, then one of them again after their release
        slots = [ring.acquire() for _ in range(held)]
        for slot in slots:
            row = rng.standard_normal((1, VOCAB)).astype(np.float32)
            descriptor = msgspec.msgpack.decode(msgspec.msgpack.encode(ring.write(slot, row)), type=DeviceSlot)
            view = reader.view(descriptor)
            assert ipc.log[-1] == ("wait", descriptor.event)  # the reader's stream waited on the slot's event
            assert np.array_equal(view, row)
        for slot in slots:
            ring.release(slot)
    assert ipc.opened("memory") == 1 and ipc.opened("event") == 3
    reader.close()
    assert not ipc.open
    reader.close()  # twice is harmless


@pytest.mark.parametrize("bad", [dict(offset=10**9), dict(offset=-4), dict(shape=(1, -3)), dict(dtype="f16"),
                                 dict(memory=b"short"), dict(event=b"\0" * 63), dict(shape=(1, 10**6))])
def test_a_hostile_descriptor_is_refused_before_any_handle_is_opened(bad: dict[str, object]) -> None:
    ipc = HostIpc()
    ring = DeviceRing(ipc, 1, VOCAB * 4)
    good = ring.write(ring.acquire(), np.zeros((1, VOCAB), np.float32))
    with pytest.raises(ValueError):
        DeviceRingReader(ipc).view(msgspec.structs.replace(good, **bad))
    assert ipc.opened("memory") == ipc.opened("event") == 0


def test_the_sdk_releases_device_slots_after_its_stream_is_done_with_them() -> None:
    """A chunk's device logits come as the reader's view; the Release of its slots (device=True) is made
    only after the client's stream has finished (the daemon writes a released slot again)."""
    ipc = HostIpc()
    ring = DeviceRing(ipc, 2, VOCAB * 4)
    rows = [ring.write(ring.acquire(), np.full((1, VOCAB), k, np.float32)) for k in (1, 2)]
    tokens = Codec().decode_server(Codec().encode(Tokens(7, (5, 6), "ab", device_logits=tuple(rows))))
    reader = LogitsReader()
    reader.device = DeviceRingReader(ipc)
    got = reader.logits(msgspec.structs.replace(tokens, device_logits=tokens.device_logits[:1]))
    assert np.array_equal(got, np.ones((1, VOCAB), np.float32))
    releases = reader.releases(7, HeldSlots.of(tokens))
    assert releases == [Release(7, (0, 1), True)]
    assert ipc.log[-1] == ("finish", None)
    assert reader.releases(7, HeldSlots()) == []
    reader.close()
    assert not ipc.open
