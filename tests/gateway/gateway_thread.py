"""A gateway served by a thread of the test process, on its own uvloop, on a free loopback port: starts in
milliseconds (no interpreter to boot), and `stop()` ends it as SIGTERM would."""
from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import uvloop

from ember.client.gateway.config import GatewayConfig
from ember.client.gateway.server import serve


class GatewayThread:
    def __init__(self, send_buffer: int | None = None, **config: Any) -> None:
        """send_buffer: SO_SNDBUF of the connections (accepted sockets inherit the listener's), to fill it soon."""
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if send_buffer is not None:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.config = GatewayConfig(port=self._sock.getsockname()[1], **config)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the gateway thread did not start")

    def _run(self) -> None:
        async def main() -> int:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            return await serve(self.config, self._sock, self._stop)

        self.exit_code = uvloop.run(main())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
