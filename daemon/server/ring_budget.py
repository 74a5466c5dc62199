"""RingBudget: the shared memory all clients' logits rings may hold together (server.max_logits_bytes)."""
from __future__ import annotations

import threading

from ember.protocol.limits import LimitExceeded


class RingBudget:
    """One ring per client is bounded by logits_slots, but the number of clients is not. A ring gives
    its bytes back when it is closed (its client went away, or the engine stopped)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.rings = 0
        self._lock = threading.Lock()  # rings are made and closed on the engine thread; cheap insurance

    def take(self, nbytes: int) -> None:
        """Count a ring of `nbytes` in, or raise LimitExceeded (the client gets Error{limit})."""
        with self._lock:
            if self.used + nbytes > self.limit:
                raise LimitExceeded(
                    f"server.max_logits_bytes: {self.rings} clients' logits rings hold {self.used} bytes; one more of "
                    f"{nbytes} bytes is over the limit of {self.limit} (retry when a client with logits disconnects)")
            self.used += nbytes
            self.rings += 1

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            self.rings -= 1
