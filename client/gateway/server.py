"""The gateway process: listen, serve until SIGTERM or SIGINT, stop gracefully.

Runs on uvloop, as the daemon's I/O loop. It listens on its own address, or on a socket it was handed
already bound (`ember serve --http` binds it, so a port in use fails the start at once, and passes it
on). aiohttp's handler cancellation is on: a client that disconnects cancels its handler, which cancels
its request in the daemon. On SIGTERM it stops accepting, lets requests in flight finish for
shutdown_timeout seconds (the daemon, stopping beside it, drains them too), cancels the rest, and exits 0.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Callable

import uvloop
from aiohttp import web

from ember.client.gateway.app import Gateway, build_app
from ember.client.gateway.config import GatewayConfig
from ember.daemon.logging_setup import configure_logging, get_logger


class ListenError(OSError):
    """The gateway cannot listen where it was asked to."""


def run_gateway(config: GatewayConfig, sock: socket.socket | None = None, log_format: str = "auto") -> int:
    """Serve until SIGTERM or SIGINT; 0 on a clean stop. ListenError when the address cannot be bound."""
    configure_logging(log_format)
    return uvloop.run(serve(config, sock))


async def serve(config: GatewayConfig, sock: socket.socket | None = None,
                stop: asyncio.Event | None = None) -> int:
    """The gateway on this loop, until `stop` is set (default: SIGTERM or SIGINT)."""
    log = get_logger()
    gateway = Gateway(config)
    try:
        await serve_app(build_app(gateway), config, sock, stop,
                        lambda url: log.info("gateway listening", url=url, daemon_socket=str(config.socket or "default"),
                                             api_key=config.api_key is not None),
                        lambda: log.info("gateway stopping", in_flight=gateway.pool.in_flight))
    finally:
        await gateway.close()
    log.info("gateway exit")
    return 0


async def serve_app(app: web.Application, config: GatewayConfig, sock: socket.socket | None,
                    stop: asyncio.Event | None, listening: Callable[[str], None],
                    stopping: Callable[[], None]) -> None:
    """`app` on `sock` (or config's address) until `stop` is set (default: SIGTERM or SIGINT), with the
    gateway's timeouts and its graceful stop; `listening(url)` once it listens, `stopping()` when told
    to stop. ListenError when the address cannot be bound. (The cluster's ingress serves this way too.)"""
    # aiohttp closes a connection that has not sent a whole request's headers keepalive_timeout seconds
    # after it opened or its last answer ended (its own default is an hour): the header timeout
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=config.shutdown_timeout,
                           access_log=None, keepalive_timeout=config.header_timeout)
    await runner.setup()
    try:
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(runner, sock)
        else:
            site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
        try:
            await site.start()
        except OSError as e:
            why = os.strerror(e.errno).lower() if e.errno else str(e)
            raise ListenError(f"cannot listen on {config.host}:{config.port}: {why}") from None
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop.set)
        listening(listen_url(runner, config))
        await stop.wait()
        stopping()
    finally:
        await runner.cleanup()


def listen_url(runner: web.AppRunner, config: GatewayConfig) -> str:
    """The address actually bound (port 0 picks a free one)."""
    for address in runner.addresses:
        if isinstance(address, tuple):
            host, port = address[0], address[1]
            return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return config.url
