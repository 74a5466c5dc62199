"""The gateway's errors in OpenAI's format: `ApiError` (an HTTP status and OpenAI's error object), and the
one mapping from the SDK's exceptions (ember.client.errors) to it.

OpenAI's body is `{"error": {"message", "type", "param", "code"}}`; the openai SDK raises its exception by
the status (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429 RateLimitError, >= 500
InternalServerError, else APIStatusError) and reads the rest from the body. The daemon's reason is
always the message: a client must be able to tell why without the gateway's log.
"""
from __future__ import annotations

from ember.client.errors import (
    BadMessage,
    BadRequest,
    Busy,
    ContextLengthExceeded,
    DaemonUnavailable,
    EmberError,
    EmberTimeout,
    GenerationFailed,
    LimitExceeded,
    ShuttingDown,
    UnknownModel,
)
from ember.client.gateway.openai_schema import ErrorBody, ErrorObject

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable"


class ApiError(Exception):
    """An HTTP error answered in OpenAI's format (before a stream started) or sent as a stream's last
    event (after)."""

    def __init__(self, status: int, message: str, type_: str = INVALID_REQUEST, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorObject(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


# checked in order: subclasses before their bases (ShuttingDown and the DaemonUnavailable family are
# "come back later", Busy is "slow down")
_BY_ERROR: tuple[tuple[type[EmberError], int, str, str], ...] = (
    (UnknownModel, 404, INVALID_REQUEST, "model_not_found"),
    (ContextLengthExceeded, 400, INVALID_REQUEST, "context_length_exceeded"),  # litellm, LangChain look for it
    (LimitExceeded, 400, INVALID_REQUEST, "limit_exceeded"),
    (BadRequest, 400, INVALID_REQUEST, "invalid_value"),
    (BadMessage, 400, INVALID_REQUEST, "invalid_value"),
    (Busy, 429, RATE_LIMIT, "busy"),
    (ShuttingDown, 503, UNAVAILABLE, "shutting_down"),
    (DaemonUnavailable, 503, UNAVAILABLE, "daemon_unavailable"),
    (EmberTimeout, 503, UNAVAILABLE, "daemon_timeout"),
    (GenerationFailed, 500, SERVER_ERROR, "generation_failed"),
)


# the request field each of the daemon's limits bounds (protocol/limits.py names the limit first)
_LIMIT_PARAMS = {"max_tokens": "max_tokens", "stop strings": "stop", "stop string length": "stop",
                 "logit_bias entries": "logit_bias", "top_logprobs": "top_logprobs", "chat messages": "messages",
                 "grammar bytes": "response_format", "tools": "tools", "tool bytes": "tools"}


def from_ember(error: EmberError) -> ApiError:
    """The HTTP error for an SDK exception: the daemon's message, a status the openai SDK maps to the
    right exception type, and for a limit the field it bounds."""
    for kind, status, type_, code in _BY_ERROR:
        if isinstance(error, kind):
            param = _LIMIT_PARAMS.get(str(error).split(":", 1)[0]) if isinstance(error, LimitExceeded) else None
            return ApiError(status, str(error), type_, param=param, code=code)
    return ApiError(500, f"the ember daemon failed: {error} ({error.code})", SERVER_ERROR, code=error.code)
