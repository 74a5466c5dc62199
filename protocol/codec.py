"""Bytes <-> messages. The only place in ember that encodes or decodes what crosses the socket.

Decoding never raises anything but ProtocolError, whatever the bytes: msgspec validates types while it
decodes (no intermediate Python objects for hostile input to abuse), its own recursion guard stops
deep nesting, and nothing is ever unpickled. Besides its own errors msgspec lets through
UnicodeDecodeError (bad UTF-8 in a string) and RecursionError, so every Exception is caught.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from ember.protocol.messages import ClientMessage, ErrorCode, ServerMessage, Wire

_MAX_DETAIL = 200  # characters of a decoder's complaint echoed back to the peer


class ProtocolError(ValueError):
    """Bytes that are not a valid message. `request_id` is the message's id when at least the tag and
    id could be read (so the sender can match the Error to its request)."""

    def __init__(self, message: str, request_id: int | None = None, code: str = ErrorCode.BAD_MESSAGE) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code


def _heads(union: Any) -> Any:
    """For each tagged type of `union`, a type holding only its tag and `id`: decoding a broken message
    with these finds out which request it was meant to be."""
    heads = []
    for cls in union.__args__:
        if "id" in cls.__struct_fields__:
            heads.append(msgspec.defstruct(f"_{cls.__name__}Head", [("id", int)], bases=(Wire,),
                                           tag=cls.__struct_config__.tag))
    return Union[tuple(heads)]


class Codec:
    """Encoder and decoders, reused (msgspec's are fastest when kept)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._client = msgspec.msgpack.Decoder(ClientMessage)
        self._server = msgspec.msgpack.Decoder(ServerMessage)
        self._client_head = msgspec.msgpack.Decoder(_heads(ClientMessage))

    def encode(self, message: Wire) -> bytes:
        return self._encoder.encode(message)

    def decode_client(self, data: bytes | memoryview) -> ClientMessage:
        """A client's message, or ProtocolError (with the request id when one can be found)."""
        try:
            return self._client.decode(data)
        except Exception as e:  # see the module docstring
            raise ProtocolError(_detail(e), self._request_id(data)) from None

    def decode_server(self, data: bytes | memoryview) -> ServerMessage:
        try:
            return self._server.decode(data)
        except Exception as e:  # see the module docstring
            raise ProtocolError(_detail(e)) from None

    def _request_id(self, data: bytes | memoryview) -> int | None:
        try:
            return int(self._client_head.decode(data).id)
        except Exception:
            return None


def _detail(e: BaseException) -> str:
    text = str(e) if not isinstance(e, RecursionError) else "nested too deeply"
    return f"undecodable message: {text[:_MAX_DETAIL]}"
