"""Client SDK and the `ember` command line.

`ember.client.Client` (sync) and `ember.client.AsyncClient` talk to a running daemon (`ember serve`);
the exceptions they raise are in ember.client.errors. Imported lazily, so the CLI starts fast.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Client", "AsyncClient", "Stream", "AsyncStream", "Chunk"]

if TYPE_CHECKING:
    from ember.client.async_client import AsyncClient, AsyncStream
    from ember.client.client import Client, Stream
    from ember.client.request_builder import Chunk


def __getattr__(name: str) -> Any:
    if name in ("Client", "Stream"):
        from ember.client import client

        return getattr(client, name)
    if name in ("AsyncClient", "AsyncStream"):
        from ember.client import async_client

        return getattr(async_client, name)
    if name == "Chunk":
        from ember.client.request_builder import Chunk

        return Chunk
    raise AttributeError(f"module 'ember.client' has no attribute {name!r}")
