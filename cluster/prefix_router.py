"""Prefix-aware routing for Ray Serve: a request goes to the replica that already holds its prompt's
prefix in its KV cache, unless that replica is much busier than the least loaded one.

Serve asks `choose_replicas` for ranked groups of replicas and sends the request to the least loaded
replica of the first group that has room (its queue below max_ongoing_requests). This router puts the
replica with the longest remembered prefix (cluster/prefix_index.py) alone in the first group when it
matches at least `min_match` of the prompt's blocks and carries at most `max_imbalance` requests more
than the least loaded; every other replica follows, as one group. A new prompt, or one whose replica
is swamped, goes to the least loaded replica; among equally loaded ones, to the one that holds the
fewest prefixes (as Ray's own PrefixCacheAffinityRouter picks its "smallest tenant"), then to each in
turn. So new prefixes spread over the replicas' caches, and short prompts (no whole block) over the
replicas.

A prompt's blocks, and its load, count on the replica chosen first, at once: requests that arrive
together are all chosen for before any is sent, and Serve's queue-length cache counts a request only
once sent (and its expired entries cost a probe, a round trip). The load lasts until Serve reports
the request completed.

A request may also name its replica (keyword `replica=`, a replica's unique id): the ingress asks each
replica for its counters that way. A named replica that is gone gets the request nowhere, and the
caller's timeout ends it.

Each ingress process has its own router and its own memory of prefixes. With one ingress (what
`ember cluster serve` runs) that is the whole truth; several ingresses would each route their own
share consistently, but two could send the same prefix to two replicas.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ember.cluster.prefix_index import PrefixIndex

MAX_CARRIED = 4096  # requests tracked before the oldest are looked at
FORGET_AFTER = 3600.0  # seconds after which a request never reported completed is forgotten


class PrefixRouter(RequestRouter):
    def initialize_state(self, block_chars: int = 64, min_match: float = 0.1, max_imbalance: int = 8,
                         max_blocks: int = 1 << 16, **_: Any) -> None:
        self.index = PrefixIndex(block_chars, max_blocks)
        self.min_match, self.max_imbalance = min_match, max_imbalance
        self.turn = 0
        # request (Serve's internal id) -> the replica chosen for it and when, until Serve reports it
        # completed: the loads routing compares. Serve's own queue-length cache lags (it counts a
        # request once sent, and its entries expire into probes, a round trip each): requests that
        # arrived together all saw equal loads and went to one replica.
        self.carried: dict[str, tuple[str, float]] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # every candidate is considered at once: when none takes the request, Serve must back off
            # before asking again (without this flag it asks again at once, spinning a core)
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not by_id:
            return []
        pinned = pending_request.kwargs.get("replica") if pending_request is not None else None
        if pinned is not None:
            return [[by_id[pinned]]] if pinned in by_id else []
        blocks = self.index.blocks(_routing_text(pending_request))
        loads = self.loads(list(by_id))
        if blocks:
            matches = self.index.matches(blocks, list(by_id))
            best = max(by_id, key=lambda r: (matches[r], -loads[r]))
            if matches[best] >= max(1.0, self.min_match * len(blocks)) and \
                    loads[best] - min(loads.values()) <= self.max_imbalance:
                self._chose(pending_request, best, blocks)
                return [[by_id[best]], [r for r in candidate_replicas if r is not by_id[best]]]
        # the least loaded first; among equals, the one holding the fewest prefixes, so that new ones
        # spread over the replicas' caches, then each in turn (Serve takes the first rank with room)
        self.turn += 1
        order = {r: (i - self.turn) % len(by_id) for i, r in enumerate(sorted(by_id))}
        ranked = sorted(by_id, key=lambda r: (loads[r], self.index.size(r), order[r]))
        self._chose(pending_request, ranked[0], blocks)
        return [[by_id[r]] for r in ranked]

    def loads(self, replicas: list[str]) -> dict[str, int]:
        """Requests each replica was chosen for and has not completed."""
        counts = Counter(r for r, _ in self.carried.values())
        return {r: counts[r] for r in replicas}

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.carried.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id.unique_id)
        self.carried = {k: v for k, v in self.carried.items() if v[0] != replica_id.unique_id}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only({r.replica_id.unique_id for r in replicas})

    def _chose(self, pending_request: PendingRequest | None, replica: str, blocks: list[bytes]) -> None:
        """Remembered at once, not once routed: requests that arrive together are chosen for together,
        and the second of a new prefix must find where the first went, and its load."""
        self.index.insert(replica, blocks)
        if pending_request is None:
            return
        now = time.monotonic()
        if len(self.carried) > MAX_CARRIED:  # requests cancelled before they were sent never complete
            self.carried = {k: v for k, v in self.carried.items() if now - v[1] < FORGET_AFTER}
        self.carried[pending_request.metadata.internal_request_id] = (replica, now)


def _routing_text(pending_request: PendingRequest | None) -> str:
    """The text a request is routed by: the first argument of EmberReplica.relay."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], str):
        return ""
    return pending_request.args[0]
