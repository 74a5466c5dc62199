"""A hand-written ZMTP 3.0 client: what a hostile local user can send that no libzmq client would
(libzmq keeps an unfinished multi-part message in the sender until its last frame)."""
from __future__ import annotations

import socket
import struct
from pathlib import Path

MORE, LONG, COMMAND = 1, 2, 4
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def ready(**properties: bytes) -> bytes:
    """A READY command announcing a DEALER, with more metadata properties (name=value) after it."""
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    for name, value in properties.items():
        key = name.replace("_", "-").encode()
        body += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return frame(body, COMMAND)


def frame(body: bytes, flags: int = 0) -> bytes:
    """One ZMTP frame: flags, a short or a long size, the body."""
    if len(body) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_dealer(path: Path, **properties: bytes) -> socket.socket:
    """A ZMTP 3.0 connection announcing itself as a DEALER (NULL mechanism), ready for frames; the
    peer's greeting has been read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(GREETING)
    greeting = b""
    while len(greeting) < 64:
        chunk = sock.recv(64 - len(greeting))
        if not chunk:
            raise ConnectionError("closed during the greeting")
        greeting += chunk
    sock.sendall(ready(**properties))
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the peer closes the connection within `timeout` (what it sends meanwhile is read and dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True
