"""RingBudget: the shared memory all clients' logits rings may hold together (server.max_logits_bytes),
and the share of it one user's may hold (server.max_logits_bytes_per_user): a user with many connections
cannot leave the others none."""
from __future__ import annotations

import threading

from ember.protocol.limits import LimitExceeded


class RingBudget:
    """One ring per client is bounded by logits_slots, but the number of clients is not. A ring gives
    its bytes back when it is closed (its client went away, or the engine stopped)."""

    def __init__(self, limit: int, per_user: int | None = None) -> None:
        self.limit = limit
        self.per_user = limit if per_user is None else per_user
        self.used = 0
        self.rings = 0
        self._by_user: dict[int, int] = {}  # bytes each user's rings hold
        self._lock = threading.Lock()  # rings are made and closed on the engine thread; cheap insurance

    def take(self, nbytes: int, user: int = -1) -> None:
        """Count a ring of `nbytes` of `user`'s in, or raise LimitExceeded (the client gets Error{limit})."""
        with self._lock:
            if self.used + nbytes > self.limit:
                raise LimitExceeded(
                    f"server.max_logits_bytes: {self.rings} clients' logits rings hold {self.used} bytes; one more of "
                    f"{nbytes} bytes is over the limit of {self.limit} (retry when a client with logits disconnects)")
            mine = self._by_user.get(user, 0)
            if mine + nbytes > self.per_user:
                raise LimitExceeded(
                    f"server.max_logits_bytes_per_user: this user's logits rings hold {mine} bytes; one more of "
                    f"{nbytes} bytes is over the limit of {self.per_user} (close a connection with logits first)")
            self.used += nbytes
            self.rings += 1
            self._by_user[user] = mine + nbytes

    def give(self, nbytes: int, user: int = -1) -> None:
        with self._lock:
            self.used -= nbytes
            self.rings -= 1
            self._by_user[user] -= nbytes
            if not self._by_user[user]:
                del self._by_user[user]
