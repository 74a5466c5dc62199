"""The gateway's HTTP application (aiohttp): its routes, the API key check, the body size bound, errors
in OpenAI's format, and the request counter.

    GET  /v1/models, /v1/models/{id}    the daemon's models
    POST /v1/chat/completions           chat, whole or streamed (generation.py)
    POST /v1/completions                text completion, whole or streamed
    POST /v1/responses                  the Responses API's subset local clients use (responses_api.py)
    GET  /health                        200 when the daemon serves, 503 when it drains or is gone (no key)
    GET  /metrics                       Prometheus text format (metrics.py)
    OPTIONS any of them                 204 with `Allow` (a CORS preflight: no key)
    /, /api/...                         Ollama's API (ollama_api.py)

A trailing slash is the same path. Every error, aiohttp's own included (404 path, 405 method with its
`Allow`, 413 body), leaves as OpenAI's error object. With `cors_origins` (--cors-origin), responses to
those browser origins carry CORS headers.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

import ember

from ember.client.errors import EmberError
from ember.client.gateway.config import GatewayConfig
from ember.client.gateway.connection_pool import ConnectionPool
from ember.client.gateway.errors import AUTHENTICATION, SERVER_ERROR, ApiError, bad_request, from_ember
from ember.client.gateway.generation import CLIENT_GONE, STREAM_STATUS, Carrier, carry
from ember.client.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from ember.client.gateway.ollama_api import (PROBE_TEXT, OllamaChatRequest, OllamaFormat, OllamaGenerateRequest,
                                             OllamaShowRequest, error_response, model_entry, show,
                                             translate_ollama_chat, translate_ollama_generate)
from ember.client.gateway.openai_schema import ChatRequest, CompletionRequest, ModelCard, ModelList
from ember.client.gateway.request_translation import Translated, decode_body, translate_chat, translate_completion
from ember.client.gateway.response_format import ChatFormat, TextFormat
from ember.client.gateway.responses_api import ResponsesFormat, ResponsesRequest, ResponseStore, translate_responses
from ember.client.gateway.token_texts import TokenTexts
from ember.daemon.logging_setup import get_logger
from ember.protocol.messages import ModelInfo, StatsReport

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_encode = msgspec.json.Encoder().encode
STATS_TIMEOUT = 2.0  # seconds /metrics and /health wait for the daemon before saying it is down
OPEN_PATHS = frozenset({"/health", "/", "/api/version"})  # answered without the API key: probes carry none


class Gateway:
    """The state behind the routes: the daemon connections, the token texts, the metrics."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.pool = ConnectionPool(config.socket, per_connection=config.per_connection,
                                   max_requests=config.max_requests)
        self.metrics = GatewayMetrics(lambda: self.pool.in_flight)
        self.carrier = Carrier(self.pool, TokenTexts(self._detokenize), self.metrics, config.default_max_tokens,
                               config.stall_timeout)
        self.started = int(time.time())
        self.responses = ResponseStore()  # /v1/responses' conversations, for previous_response_id

    async def _detokenize(self, ids: list[int], model: str) -> str:
        return await (await self.pool.any()).detokenize(ids, model=model)

    async def close(self) -> None:
        """After the HTTP server stopped: let cancelled requests' last frames come, then disconnect."""
        if self.carrier.drains:
            await asyncio.wait(set(self.carrier.drains), timeout=5.0)
        await self.pool.close()


GATEWAY = web.AppKey("gateway", Gateway)


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes,
                          middlewares=[_errors_middleware(gateway), _options_middleware,
                                       auth_middleware(gateway.config.api_key)])
    app[GATEWAY] = gateway
    for path, method, handler in (("/v1/models", "GET", _models), ("/v1/chat/completions", "POST", _chat),
                                  ("/v1/completions", "POST", _completions), ("/v1/responses", "POST", _responses),
                                  ("/health", "GET", _health), ("/metrics", "GET", _metrics)):
        app.router.add_route(method, path, handler)
        app.router.add_route(method, path + "/", handler)  # a trailing slash is the same path
    app.router.add_get("/v1/models/{model:.+}", _model)  # names may hold slashes (org/model)
    for path, method, handler in (("/", "GET", _ollama_probe), ("/api/version", "GET", _ollama_version),
                                  ("/api/tags", "GET", _ollama_tags), ("/api/ps", "GET", _ollama_ps),
                                  ("/api/show", "POST", _ollama_show), ("/api/chat", "POST", _ollama_chat),
                                  ("/api/generate", "POST", _ollama_generate)):
        app.router.add_route(method, path, handler)
    if gateway.config.cors_origins:
        app.on_response_prepare.append(_cors_headers(gateway.config.cors_origins))
    return app


def _gateway(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


# --- routes ----------------------------------------------------------------------------------------
async def _chat(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    t = translate_chat(decode_body(await _body(request), ChatRequest))  # type: ignore[arg-type]
    tool_format = await _tool_format(_gateway(request), t)
    return await carry(request, _gateway(request).carrier, t, ChatFormat(t.model, t.include_usage, tool_format),
                       arrived)


async def _completions(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    t = translate_completion(decode_body(await _body(request), CompletionRequest))  # type: ignore[arg-type]
    return await carry(request, _gateway(request).carrier, t, TextFormat(t.model, t.include_usage), arrived)


# --- Ollama's API (ollama_api.py) ---------------------------------------------------------------------
async def _ollama_probe(request: web.Request) -> web.Response:
    return web.Response(text=PROBE_TEXT)


async def _ollama_version(request: web.Request) -> web.Response:
    return web.json_response({"version": ember.__version__})  # what the daemon's Welcome names


async def _ollama_tags(request: web.Request) -> web.Response:
    gateway = _gateway(request)
    return web.json_response({"models": [model_entry(m, gateway.started) for m in await _model_infos(gateway)]})


async def _ollama_ps(request: web.Request) -> web.Response:
    gateway = _gateway(request)
    return web.json_response({"models": [
        {**model_entry(m, gateway.started), "expires_at": "2999-01-01T00:00:00Z", "size_vram": 0,
         "context_length": m.context_length} for m in await _model_infos(gateway)]})


async def _ollama_show(request: web.Request) -> web.Response:
    req = decode_body(await _body(request), OllamaShowRequest)
    return web.json_response(show(await _ollama_model(_gateway(request), req.model or req.name)))


async def _ollama_chat(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    gateway = _gateway(request)
    req = decode_body(await _body(request), OllamaChatRequest)
    model = await _ollama_model(gateway, req.model)
    req.model = model.name
    if not req.messages:  # Ollama's "load the model": every model is loaded
        return web.Response(body=OllamaFormat(req.model, True, arrived).loaded(), content_type="application/json")
    t = translate_ollama_chat(req)
    return await carry(request, gateway.carrier, t, OllamaFormat(req.model, True, arrived,
                                                                 await _tool_format(gateway, t, model)), arrived)


async def _ollama_generate(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    gateway = _gateway(request)
    req = decode_body(await _body(request), OllamaGenerateRequest)
    model = await _ollama_model(gateway, req.model)
    req.model = model.name
    fmt = OllamaFormat(req.model, False, arrived)
    if not req.prompt and not req.system:
        return web.Response(body=fmt.loaded(), content_type="application/json")
    return await carry(request, gateway.carrier, translate_ollama_generate(req, model.chat_template), fmt, arrived)


async def _model_infos(gateway: Gateway) -> list[ModelInfo]:
    try:
        return list(await (await gateway.pool.any()).models())
    except EmberError as e:
        raise from_ember(e) from None


async def _tool_format(gateway: Gateway, t: Translated, model: ModelInfo | None = None) -> str:
    """The format the answer's tool calls come in, where the request offers tools ("" where it does not);
    400 naming `tools` where the model's chat template renders none. model: t's, where the caller has
    looked it up already."""
    if not t.options.get("tools") or t.options.get("tool_choice") == "none":
        return ""
    model = model or await _model_info(gateway, t.model)
    if not model.tool_format:
        raise bad_request(f"model {model.name!r} cannot call tools: its chat template renders none", "tools")
    return model.tool_format


async def _model_info(gateway: Gateway, name: str) -> ModelInfo:
    """The loaded model `name` means (the only one where the name is ""); 404 if none."""
    models = await _model_infos(gateway)
    for m in models:
        if name == m.name or (not name and len(models) == 1):
            return m
    raise ApiError(404, f"no model named {name!r} is loaded", code="model_not_found")


async def _ollama_model(gateway: Gateway, name: str) -> ModelInfo:
    """The model an Ollama name means: the name itself, or without Ollama's default tag ":latest"."""
    models = await _model_infos(gateway)
    for m in models:
        if name in (m.name, f"{m.name}:latest"):
            return m
    raise ApiError(404, f"model {name!r} not found (loaded: {', '.join(m.name for m in models)})",
                   code="model_not_found")


async def _responses(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    gateway = _gateway(request)
    req = decode_body(await _body(request), ResponsesRequest)
    t, conversation = translate_responses(req, gateway.responses)
    tool_format = await _tool_format(gateway, t)
    return await carry(request, gateway.carrier, t, ResponsesFormat(req, conversation, gateway.responses, tool_format),
                       arrived)


async def _models(request: web.Request) -> web.Response:
    return _json(ModelList(data=await _model_cards(_gateway(request))))


async def _model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    for card in await _model_cards(_gateway(request)):
        if card.id == name:
            return _json(card)
    raise ApiError(404, f"no model named {name!r} is loaded", code="model_not_found")


async def _health(request: web.Request) -> web.Response:
    try:
        client = await _gateway(request).pool.any()
        async with asyncio.timeout(STATS_TIMEOUT):  # not wait_for: see AsyncClient._next_for
            health = await client.health()
    except (EmberError, TimeoutError) as e:
        return web.json_response({"status": "unavailable", "reason": str(e) or "the daemon did not answer"},
                                 status=503)
    return web.json_response({"status": health.status, "uptime_s": health.uptime_s},
                             status=200 if health.status == "ok" else 503)


async def _metrics(request: web.Request) -> web.Response:
    gateway = _gateway(request)
    report: StatsReport | None
    try:
        client = await gateway.pool.any()
        async with asyncio.timeout(STATS_TIMEOUT):
            report = await client.stats()
    except (EmberError, TimeoutError):
        report = None
    return web.Response(body=gateway.metrics.render(report), headers={"Content-Type": CONTENT_TYPE})


async def _model_cards(gateway: Gateway) -> list[ModelCard]:
    try:
        models = await (await gateway.pool.any()).models()
    except EmberError as e:
        raise from_ember(e) from None
    return [ModelCard(id=m.name, created=gateway.started, context_length=m.context_length) for m in models]


async def _body(request: web.Request) -> bytes:
    return await read_body(request, _gateway(request).config.max_body_bytes)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, or 413 before reading more than `limit` bytes of it."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(request.content_length, limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(None, limit) from None


def too_large(size: int | None, limit: int) -> ApiError:
    what = f"{size} bytes" if size is not None else "over the limit"
    return ApiError(413, f"the request body is {what}: the gateway takes at most {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def error_reply(request: web.Request, error: ApiError) -> web.Response:
    """OpenAI's error object, or Ollama's {"error": "..."} on its paths."""
    return error_response(error) if request.path.startswith("/api/") else _json(error.body(), error.status)


def _json(value: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(body=_encode(value), status=status, content_type="application/json")


# --- middlewares -----------------------------------------------------------------------------------
@web.middleware
async def _options_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """OPTIONS (a browser's CORS preflight, which carries no API key): 204 with the path's methods in
    `Allow`; the CORS headers, where origins are allowed, come with every response (_cors_headers)."""
    if request.method != "OPTIONS":
        return await handler(request)
    refused = getattr(request.match_info, "http_exception", None)
    if not isinstance(refused, web.HTTPMethodNotAllowed):
        return await handler(request)  # an unknown path: its 404
    return web.Response(status=204, headers={"Allow": ", ".join(sorted({*refused.allowed_methods, "OPTIONS"}))})


def _cors_headers(origins: tuple[str, ...]) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """Each response (a stream's too, before its headers go) allows an allowed Origin to read it, and a
    preflight names the methods and headers the browser asked for."""
    any_origin = "*" in origins

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not (any_origin or origin in origins):
            return
        response.headers["Access-Control-Allow-Origin"] = "*" if any_origin else origin
        if not any_origin:
            response.headers["Vary"] = "Origin"
        if request.method == "OPTIONS":
            response.headers["Access-Control-Allow-Methods"] = response.headers.get("Allow", "GET, POST, OPTIONS")
            response.headers["Access-Control-Allow-Headers"] = request.headers.get(
                "Access-Control-Request-Headers", "Authorization, Content-Type")
            response.headers["Access-Control-Max-Age"] = "600"

    return add


def auth_middleware(api_key: str | None) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: the key is not guessable bytewise
                raise ApiError(401, "Incorrect API key provided: send it as 'Authorization: Bearer KEY'"
                               if given else "No API key provided: send it as 'Authorization: Bearer KEY'",
                               AUTHENTICATION, code="invalid_api_key")
        return await handler(request)

    return auth


def _errors_middleware(gateway: Gateway) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    counter = gateway.metrics.requests

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
        status = CLIENT_GONE  # unless the handler returns or fails: cancelled because the client left
        reset = STREAM_STATUS.set(None)  # requests on one keep-alive connection share a task and its context
        try:
            response = await handler(request)
            status = STREAM_STATUS.get() or response.status
            return response
        except ApiError as e:
            status = e.status
            return error_reply(request, e)
        except web.HTTPException as e:  # aiohttp's own: unknown path, wrong method, body too large
            status = e.status
            if e.status == 413:
                error = too_large(None, gateway.config.max_body_bytes)
            else:
                error = ApiError(e.status, f"{request.method} {request.path}: {e.reason}",
                                 code="not_found" if e.status == 404 else None)
            response = error_reply(request, error)
            if "Allow" in e.headers:  # 405 names the methods the path takes
                response.headers["Allow"] = e.headers["Allow"]
            return response
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client left: nothing to answer
        except Exception:  # noqa: BLE001 -- a bug in the gateway: say so in OpenAI's format, keep serving
            status = 500
            get_logger().exception("gateway error", method=request.method, path=request.path)
            error = ApiError(500, "internal error in the ember gateway (its log has the traceback)", SERVER_ERROR)
            return error_reply(request, error)
        finally:
            STREAM_STATUS.reset(reset)
            counter.labels(endpoint, str(status)).inc()

    return errors
