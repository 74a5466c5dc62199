"""Typed exceptions of the client SDK, one per daemon error code (protocol/messages.py ErrorCode)."""
from __future__ import annotations

from ember.protocol.messages import Error, ErrorCode


class EmberError(Exception):
    """Base of every error the SDK raises. `code` is the daemon's error code (or the SDK's own)."""

    code = "error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class DaemonUnavailable(EmberError, ConnectionError):
    """No daemon at the socket, or it went away (the message says which)."""

    code = "unavailable"


class UntrustedSocket(DaemonUnavailable):
    """The socket's directory could have been made by another user (protocol/endpoint.py says what is
    trusted): the SDK sends nothing there."""

    code = "untrusted_socket"


class ConnectionLost(DaemonUnavailable):
    """The connection broke while requests were in flight, and the daemon, still listening, dropped them
    (it drops a connection that misses its heartbeats or sends a frame over its size limit)."""

    code = "connection_lost"


class EmberTimeout(EmberError, TimeoutError):
    """The daemon sent nothing at all for `timeout` seconds."""

    code = "timeout"


class BadMessage(EmberError):
    code = ErrorCode.BAD_MESSAGE


class BadRequest(EmberError, ValueError):
    code = ErrorCode.BAD_REQUEST


class LimitExceeded(EmberError, ValueError):
    code = ErrorCode.LIMIT


class ContextLengthExceeded(LimitExceeded):
    """A prompt longer than the model's context."""

    code = ErrorCode.CONTEXT_LENGTH


class Busy(EmberError):
    """The daemon's queue is full; retrying later may succeed."""

    code = ErrorCode.BUSY


class UnknownModel(EmberError, LookupError):
    code = ErrorCode.UNKNOWN_MODEL


class DuplicateId(EmberError):
    code = ErrorCode.DUPLICATE_ID


class VersionMismatch(EmberError):
    code = ErrorCode.VERSION


class ShuttingDown(EmberError):
    code = ErrorCode.SHUTTING_DOWN


class InternalError(EmberError):
    code = ErrorCode.INTERNAL


class GenerationFailed(EmberError):
    """A generation that started ended with Finished(reason="error")."""

    code = "generation_failed"


_BY_CODE: dict[str, type[EmberError]] = {
    cls.code: cls for cls in (BadMessage, BadRequest, LimitExceeded, ContextLengthExceeded, Busy, UnknownModel, DuplicateId,
                              VersionMismatch, ShuttingDown, InternalError)
}


def error_from(message: Error) -> EmberError:
    """The exception for a daemon's Error (a code this SDK does not know becomes a plain EmberError)."""
    return _BY_CODE.get(message.code, EmberError)(message.message, message.code)
