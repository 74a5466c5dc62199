"""Prefix-aware routing for Ray Serve: a request goes to the replica that already holds its prompt's
prefix in its KV cache, unless that replica is much busier than the least loaded one.

Serve asks `choose_replicas` for ranked groups of replicas and sends the request to the least loaded
replica of the first group that has room (its queue below max_ongoing_requests). This router puts the
replica with the longest remembered prefix (cluster/prefix_index.py) alone in the first group when it
matches at least `min_match` of the prompt's blocks and carries at most `max_imbalance` requests more
than the least loaded; every other replica follows, as one group. A new prompt, or one whose replica
is swamped, goes to the least loaded replica, and among equally loaded ones to the one that holds the
fewest prefixes (as Ray's own PrefixCacheAffinityRouter picks its "smallest tenant"): new prefixes
spread over the replicas' caches. A prompt's blocks are remembered on the replica chosen first, at
once (requests that arrive together are chosen for before any is routed), and on the one that took
it when Serve reports the routing (`on_request_routed`).

A request may also name its replica (keyword `replica=`, a replica's unique id): the ingress asks each
replica for its counters that way. A named replica that is gone gets the request nowhere, and the
caller's timeout ends it.

Each ingress process has its own router and its own memory of prefixes. With one ingress (what
`ember cluster serve` runs) that is the whole truth; several ingresses would each route their own
share consistently, but two could send the same prefix to two replicas.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from ember.cluster.prefix_index import PrefixIndex


class PrefixRouter(RequestRouter):
    def initialize_state(self, block_chars: int = 64, min_match: float = 0.1, max_imbalance: int = 8,
                         max_blocks: int = 1 << 16, **_: Any) -> None:
        self.index = PrefixIndex(block_chars, max_blocks)
        self.min_match, self.max_imbalance = min_match, max_imbalance

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
        loads = await self._loads(candidate_replicas)
        if blocks:
            matches = self.index.matches(blocks, list(by_id))
            best = max(by_id, key=lambda r: (matches[r], -loads[r]))
            if matches[best] >= max(1.0, self.min_match * len(blocks)) and \
                    loads[best] - min(loads.values()) <= self.max_imbalance:
                self.index.insert(best, blocks)
                return [[by_id[best]], [r for r in candidate_replicas if r is not by_id[best]]]
        # the least loaded first; among equals, the one holding the fewest prefixes, so that new ones
        # spread over the replicas' caches (Serve takes the first rank with room)
        ranked = sorted(by_id, key=lambda r: (loads[r], self.index.size(r)))
        # remembered now, not only once routed: requests that arrive together are chosen for together,
        # before any is routed, and the second of a new prefix must find where the first goes
        self.index.insert(ranked[0], blocks)
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        if pending_request.kwargs.get("replica") is None:
            self.index.insert(replica_id.unique_id, self.index.blocks(_routing_text(pending_request)))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only({r.replica_id.unique_id for r in replicas})

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Requests each replica carries: Serve's cached queue lengths, probed where it has none."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id.unique_id: cache.get(r.replica_id) for r in replicas}
        unknown = [r for r in replicas if loads[r.replica_id.unique_id] is None]
        if unknown:
            for r, n in await self._probe_queue_lens(unknown, 0):
                loads[r.replica_id.unique_id] = n
        # a replica that did not answer the probe counts as full: it is least preferred, not dropped
        return {k: v if v is not None else 1 << 30 for k, v in loads.items()}


def _routing_text(pending_request: PendingRequest | None) -> str:
    """The text a request is routed by: the first argument of EmberReplica.relay."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], str):
        return ""
    return pending_request.args[0]
