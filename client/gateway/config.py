"""The gateway's configuration: where it listens, which daemon it fronts, its key and its bounds.

Exposure is checked here, once, before anything listens: the default bind is loopback, and a bind that
other machines could reach (any address that is not loopback, a host name other than localhost) needs
an API key (`--api-key` or EMBER_API_KEY), else `GatewayConfigError` says so in one line.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:8000"
API_KEY_ENV = "EMBER_API_KEY"


class GatewayConfigError(ValueError):
    """The gateway cannot start with this configuration; the message says why and what to change."""


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    socket: Path | None = None  # the daemon's socket; None: where clients look by default
    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set
    max_body_bytes: int = 4 << 20  # a request body over this is refused with 413 before it is read
    max_requests: int = 256  # generation requests carried at once; beyond, 429 at once
    per_connection: int = 16  # streams per daemon connection: at most the daemon's max_requests_per_client
    default_max_tokens: int = 4096  # a request that sets no max_tokens (also bounded by the model's context)
    stall_timeout: float = 60.0  # seconds a stream may wait on an HTTP client that reads nothing
    # seconds a connection may take to send a request's headers, from its opening or its last answer
    # (a slowloris client trickling header bytes is closed then; so is an idle keep-alive connection)
    header_timeout: float = 15.0
    shutdown_timeout: float = 30.0  # seconds requests in flight may finish after SIGTERM
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none: no CORS

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, f"the port must be in [0, 65535], got {self.port}")
        _check(self.api_key is None or len(self.api_key) >= 1, "the API key must not be empty")
        for name in ("max_body_bytes", "max_requests", "per_connection", "default_max_tokens"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.stall_timeout > 0 and self.header_timeout > 0 and self.shutdown_timeout >= 0,
               "the timeouts must be positive")
        if self.api_key is None and not is_loopback(self.host):
            raise GatewayConfigError(
                f"refusing to listen on {self.host}:{self.port} without an API key: other machines could use the "
                f"daemon; set --api-key KEY or {API_KEY_ENV}, or listen on 127.0.0.1")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def parse_listen(listen: str) -> tuple[str, int]:
    """"HOST:PORT" (IPv6 as "[::1]:8000") -> (host, port); GatewayConfigError if it is not that."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise GatewayConfigError(f"--listen wants HOST:PORT (e.g. {DEFAULT_LISTEN}), got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise GatewayConfigError(message)
