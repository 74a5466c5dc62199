"""RingSlots: the slot discipline every logits ring keeps, the base of both (shared memory,
protocol/shm_ring.py; a GPU's CUDA IPC allocation, protocol/device_ring.py). A ring is n_slots slots of
slot_bytes; a slot is free or held. The daemon takes a free one for each block of logits it hands out
and gets it back only when the client sends Release for it, so a slot is never written while a
client may still read it."""
from __future__ import annotations


class RingSlots:
    def __init__(self, n_slots: int, slot_bytes: int) -> None:
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        self._free = list(range(n_slots - 1, -1, -1))  # a stack: the most recently released slot is warm
        self._held: set[int] = set()

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot, now held until released; None when every slot is held."""
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

    def _check_held(self, slot: int, ring: str) -> None:
        if slot not in self._held:
            raise ValueError(f"slot {slot} of {ring} is not held")
