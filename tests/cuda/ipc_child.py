"""What a spawned process does in tests/cuda/test_device_logits.py: open another process's device ring
from its descriptors (CUDA refuses a process its own handles) and send back what it reads. A module of
its own, so that the child imports it by a plain name from the parent's sys.path."""
from __future__ import annotations

from typing import Any

import msgspec

from ember.protocol.device_ring import DeviceRingReader
from ember.protocol.messages import DeviceSlot


def read_in_child(slots: list[bytes], out: Any) -> None:
    """A spawned process: open the parent's ring from the descriptors and send back what it reads."""
    reader = DeviceRingReader()
    try:
        rows = [reader.view(msgspec.msgpack.decode(s, type=DeviceSlot)).get() for s in slots]
        out.put(("ok", [r.tolist() for r in rows]))
    except Exception as e:  # noqa: BLE001 - the parent reports it
        out.put(("error", repr(e)))
    finally:
        reader.close()
