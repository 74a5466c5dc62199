"""The gateway's connections to the daemon: AsyncClients shared by all HTTP requests, and the bound on
how many requests the gateway carries at once.

Why a pool and not one connection: the daemon bounds the Generates in flight per connection
(limits.max_requests_per_client, 16 by default) and answers the next with Error{limit}; the gateway
serves many HTTP clients, so it opens another connection when each open one carries `per_connection`
streams. Why not one connection per HTTP request: a connection costs a ZMQ context, a reader task and a
Hello round trip, and the daemon a peer. Connections are opened on demand and kept; a daemon that
restarts is found again by libzmq's reconnect.

A slot is held from the Generate's sending to its last frame (Finished or Error), as the daemon counts
it: a stream cancelled by a vanished HTTP client gives its slot back only once the daemon confirms.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from ember.client.async_client import AsyncClient
from ember.client.gateway.errors import RATE_LIMIT, ApiError


@dataclass(eq=False)
class Lease:
    """One request's slot on one connection; give it back with ConnectionPool.release (once)."""

    client: AsyncClient
    released: bool = False


class ConnectionPool:
    def __init__(self, socket_path: Path | None, *, per_connection: int, max_requests: int,
                 timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self.per_connection, self.max_requests, self.timeout = per_connection, max_requests, timeout
        self._streams: dict[AsyncClient, int] = {}  # open connection -> its requests in flight
        self._opening = asyncio.Lock()  # one connection opened at a time: a burst opens only what it needs
        self.in_flight = 0

    async def acquire(self) -> Lease:
        """A slot for one Generate: 429 when the gateway carries max_requests already, DaemonUnavailable
        (an EmberError) when no daemon answers."""
        if self.in_flight >= self.max_requests:
            raise ApiError(429, f"the gateway is carrying {self.in_flight} requests, its limit (--max-requests): "
                                "retry later", RATE_LIMIT, code="gateway_busy")
        self.in_flight += 1
        try:
            client = self._free() or await self._open_for_stream()
        except BaseException:
            self.in_flight -= 1
            raise
        self._streams[client] += 1
        return Lease(client)

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self.in_flight -= 1
        if lease.client in self._streams:
            self._streams[lease.client] -= 1

    async def any(self) -> AsyncClient:
        """A connection for small calls (models, stats, health, detokenize): the first, opened if none is."""
        if self._streams:
            return next(iter(self._streams))
        async with self._opening:
            if not self._streams:
                await self._open()
        return next(iter(self._streams))

    async def close(self) -> None:
        clients, self._streams = list(self._streams), {}
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    def _free(self) -> AsyncClient | None:
        for client, n in self._streams.items():
            if n < self.per_connection:
                return client
        return None

    async def _open_for_stream(self) -> AsyncClient:
        async with self._opening:
            return self._free() or await self._open()  # another request may have opened one meanwhile

    async def _open(self) -> AsyncClient:
        client = await AsyncClient(self.socket_path, timeout=self.timeout).connect()
        self._streams[client] = 0
        return client
