"""Channel: msgspec Structs over a Unix socketpair, one length-prefixed msgpack frame each — how the
daemon's own processes talk (the front and its engine process; the engine and its layer-split
stages). A write is one system call on the sending thread: nothing else wakes in the sender's
process (a ZeroMQ socket's send wakes its I/O thread, which on a machine whose cores the kernels
hold cost the engine 140-280 us a message). Nothing is pickled: each end decodes exactly its
Decoder's types.
"""
from __future__ import annotations

import select
import socket
import struct
from typing import Any

import msgspec

_LENGTH = struct.Struct("<I")
MAX_FRAME = 64 << 20  # the messages are KiBs (a long prompt's ids: MiBs); anything near this is a bug
_encoder = msgspec.msgpack.Encoder()


class ChannelClosed(ConnectionError):
    """The other end went away (its process died, or closed the channel)."""


class Channel:
    """One end of a socketpair; `decoder` says what may come in."""

    def __init__(self, sock: socket.socket, decoder: msgspec.msgpack.Decoder) -> None:
        self.sock = sock
        self._decoder = decoder

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Any) -> None:
        data = _encoder.encode(msg)
        try:
            self.sock.sendall(_LENGTH.pack(len(data)) + data)  # one call: a frame is never interleaved
        except OSError as e:
            raise ChannelClosed(f"send failed: {e}") from None

    def readable(self, timeout: float = 0.0) -> bool:
        """Whether a frame (or the other end's close) is waiting, after at most `timeout` seconds."""
        return bool(select.select([self.sock], [], [], max(0.0, timeout))[0])

    def recv(self) -> Any:
        (n,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        if n > MAX_FRAME:
            raise ChannelClosed(f"a frame of {n} bytes is over the channel's limit")
        return self._decoder.decode(self._exactly(n))

    def close(self) -> None:
        self.sock.close()

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            try:
                part = self.sock.recv(n - len(buf))
            except OSError as e:
                raise ChannelClosed(f"receive failed: {e}") from None
            if not part:
                raise ChannelClosed("the other end closed the channel")
            buf += part
        return bytes(buf)
