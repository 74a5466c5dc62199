"""The cluster's one HTTP endpoint: every request goes, through a Ray Serve handle, to a replica's
gateway (cluster/replica.py), chosen by prefix (cluster/prefix_router.py), and its answer streams back.

- The ingress reads the request whole (bounded by ingress.max_body_bytes), takes the text it is routed
  by from its JSON (`routing_text`), and checks the API key as the gateway does; the replicas'
  gateways listen on loopback and take no key.
- A replica that dies before its answer began (its head: status and headers) costs the client
  nothing: the request goes to another replica, `ingress.retries` times at most, then 503. One that
  dies after the answer began ends it with a clear error: an OpenAI error event in a server-sent event
  stream, Ollama's `{"error": ...}` line in an NDJSON stream, else a cut connection (a client can tell
  a truncated body from a whole one by its length or its JSON).
- A client that leaves cancels its stream at the replica, which cancels the request in its daemon.
- `GET /v1/cluster/replicas` (ember's own) lists the replicas, each with its node and its daemon's
  counters (prefix-cache hits among them), or an error for one that did not answer in STATS_TIMEOUT
  (one still starting): the requests ask each replica by name.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from ember.client.gateway.app import auth_middleware, error_reply, read_body, too_large
from ember.client.gateway.config import GatewayConfig
from ember.client.gateway.errors import RATE_LIMIT, SERVER_ERROR, UNAVAILABLE, ApiError
from ember.client.gateway.response_format import sse
from ember.cluster.replica import Forward, Head
from ember.daemon.logging_setup import get_logger

PASSED_HEADERS = frozenset({"content-type", "accept", "x-request-id", "user-agent"})
STATS_TIMEOUT = 5.0  # seconds /v1/cluster/replicas waits for a replica's counters
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Ingress:
    def __init__(self, handle: Any, config: GatewayConfig, retries: int, replica_ids: Callable[[], list[str]]) -> None:
        """handle: the replicas' DeploymentHandle; replica_ids: the live replicas' unique ids (blocking)."""
        self.handle, self.config, self.retries = handle, config, retries
        self.replica_ids = replica_ids
        self.in_flight = 0

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self.in_flight >= self.config.max_requests:
            raise ApiError(429, f"the ingress is carrying {self.in_flight} requests, its limit (ingress.max_requests): "
                                "retry later", RATE_LIMIT, code="ingress_busy")
        self.in_flight += 1
        try:
            body = await read_body(request, self.config.max_body_bytes)
            headers = [(str(k), v) for k, v in request.headers.items() if k.lower() in PASSED_HEADERS]
            payload = msgspec.msgpack.encode(Forward(request.method, request.path_qs, headers, body))
            return await self._answer(request, routing_text(body), payload)
        finally:
            self.in_flight -= 1

    async def replicas(self, request: web.Request) -> web.Response:
        ids = await asyncio.to_thread(self.replica_ids)
        reports = await asyncio.gather(*(self._stats(i) for i in ids), return_exceptions=True)
        data = [msgspec.json.decode(r) if isinstance(r, bytes) else {"replica": i, "error": _short(r) or "no answer"}
                for i, r in zip(ids, reports, strict=True)]
        return web.json_response({"object": "list", "data": data})

    async def _stats(self, replica: str) -> bytes:
        """One replica's counters; TimeoutError when it does not answer (one still starting, one dying)."""
        response = self.handle.stats.remote(replica=replica)
        try:
            async with asyncio.timeout(STATS_TIMEOUT):
                return await response
        except BaseException:
            response.cancel()
            raise

    async def _answer(self, request: web.Request, key: str, payload: bytes) -> web.StreamResponse:
        from ray.serve.exceptions import BackPressureError

        lost: BaseException | None = None
        for _ in range(self.retries + 1):
            stream = self.handle.options(stream=True).relay.remote(key, payload)
            try:
                head = msgspec.msgpack.decode(await stream.__anext__(), type=Head)
                break
            except BackPressureError:
                raise ApiError(429, "every replica is full (replicas.max_ongoing_requests): retry later", RATE_LIMIT,
                               code="replicas_busy") from None
            except replica_lost() as e:  # nothing sent yet: another replica may answer
                stream.cancel()
                lost = e
                get_logger().warning("replica lost before answering; routing again", error=_short(e))
            except BaseException:
                stream.cancel()
                raise
        else:
            raise ApiError(503, f"no replica answered ({self.retries + 1} tried): {_short(lost)}", UNAVAILABLE,
                           code="replica_unavailable")
        response = web.StreamResponse(status=head.status, headers=[*head.headers, ("x-ember-replica", head.replica)])
        try:
            await response.prepare(request)
            async for chunk in stream:
                await response.write(chunk)
        except replica_lost() as e:
            get_logger().warning("replica lost mid-answer", replica=head.replica, error=_short(e))
            tail = lost_tail(response.content_type, head.replica)
            if tail is None or response.content_length is not None:
                if request.transport is not None:
                    request.transport.close()  # the client sees a cut answer, not a whole one
                return response
            await _quietly(response.write(tail))
        except ConnectionError:  # the client left mid-answer: the replica stops generating for it
            stream.cancel()
            return response
        except BaseException:
            stream.cancel()  # cancelled (the client left) or a bug
            raise
        await _quietly(response.write_eof())
        return response


def replica_lost() -> tuple[type[BaseException], ...]:
    """What a handle raises when its replica died, or failed inside the relay (its gateway is gone)."""
    from ray.exceptions import RayActorError, RayTaskError

    return RayActorError, RayTaskError


def lost_tail(content_type: str, replica: str) -> bytes | None:
    """The last event of a stream whose replica died: the stream's own error form, None if it has none."""
    error = ApiError(502, f"the replica serving this request ({replica}) died mid-answer; the request did not "
                          "finish: retry it", SERVER_ERROR, code="replica_lost")
    if content_type == "text/event-stream":
        return sse(msgspec.json.encode(error.body()))
    if content_type == "application/x-ndjson":
        return msgspec.json.encode({"error": error.message}) + b"\n"
    return None


def routing_text(body: bytes) -> str:
    """The text a request's prefix is: its messages' roles and contents in order (chat, Ollama's chat,
    the Responses API's input), else its prompt; "" for what is no JSON object (routed by load alone)."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return ""
    if not isinstance(doc, dict):
        return ""
    parts: list[str] = []
    if isinstance(doc.get("instructions"), str):
        parts.append(doc["instructions"])
    for key in ("messages", "input", "prompt"):
        value = doc.get(key)
        if value is not None:
            _collect(value, parts)
            break
    return "\x1e".join(parts)


def _collect(value: object, parts: list[str]) -> None:
    if isinstance(value, str):
        parts.append(value)
    elif isinstance(value, list):
        for item in value:
            _collect(item, parts)
    elif isinstance(value, dict):
        if isinstance(value.get("role"), str):
            parts.append(value["role"])
        for key in ("content", "text"):
            if key in value:
                _collect(value[key], parts)


def build_ingress_app(ingress: Ingress) -> web.Application:
    app = web.Application(client_max_size=ingress.config.max_body_bytes,
                          middlewares=[_errors(ingress.config.max_body_bytes), auth_middleware(ingress.config.api_key)])
    app.router.add_get("/v1/cluster/replicas", ingress.replicas)
    app.router.add_route("*", "/{tail:.*}", ingress.forward)
    return app


def _errors(max_body_bytes: int) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return error_reply(request, e)
        except web.HTTPRequestEntityTooLarge:
            return error_reply(request, too_large(None, max_body_bytes))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except TimeoutError:
            return error_reply(request, ApiError(504, "the replicas did not answer in time", UNAVAILABLE))
        except Exception:  # noqa: BLE001 -- a bug here: say so in OpenAI's format, keep serving
            get_logger().exception("ingress error", method=request.method, path=request.path)
            return error_reply(request, ApiError(500, "internal error in the ember ingress (its log has the traceback)",
                                                 SERVER_ERROR))

    return errors


async def _quietly(write: Awaitable[None]) -> None:
    """A last write that a client gone meanwhile does not need."""
    try:
        await write
    except ConnectionError:
        pass


def _short(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
