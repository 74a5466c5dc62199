"""Peer: what the I/O loop knows about one client connection (a ZMQ routing identity) while it has work.

A peer exists while it has requests in flight, helper requests (tokenize, detokenize) running, a logits
ring, or frames waiting for its socket; then it is forgotten, so the table is bounded by live work,
not by every connection ever made.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Peer:
    identity: bytes
    requests: set[int] = field(default_factory=set)  # Generate ids admitted and not yet ended
    pid: int = -1  # its process (SO_PEERCRED), whose requests together have a share of the daemon
    helpers: int = 0  # tokenize / detokenize jobs running for it
    has_ring: bool = False  # the engine holds a logits ring for it (until it is dropped)
    backlog: deque[bytes] = field(default_factory=deque)  # encoded frames its socket would not take yet
    paused: bool = False  # its requests are paused until the backlog drains
    dead: bool = False  # found gone: frames to it are discarded, its requests are being cancelled
    last_sent: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.identity.hex()

    @property
    def idle(self) -> bool:
        """Nothing left to do for it: the table may forget it."""
        if self.dead:
            return not self.requests and not self.helpers
        return not self.requests and not self.helpers and not self.has_ring and not self.backlog

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self.helpers or self.has_ring)


class Peers:
    def __init__(self) -> None:
        self._by_identity: dict[bytes, Peer] = {}

    def __len__(self) -> int:
        return len(self._by_identity)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._by_identity.values()))  # a copy: callers may forget peers as they go

    def get(self, identity: bytes) -> Peer | None:
        return self._by_identity.get(identity)

    def get_or_add(self, identity: bytes) -> Peer:
        if identity not in self._by_identity:
            self._by_identity[identity] = Peer(identity)
        return self._by_identity[identity]

    def forget_if_idle(self, peer: Peer) -> None:
        if peer.idle and self._by_identity.get(peer.identity) is peer:
            del self._by_identity[peer.identity]
