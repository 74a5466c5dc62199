"""Ollama's HTTP API on the gateway, for the many local tools that speak only it (the `ollama` Python
package, Open WebUI, editors' Ollama providers): point them at the gateway's address.

    GET  /                  "Ollama is running" (the probe those tools send first)
    GET  /api/version       {"version"}: ember's
    GET  /api/tags          the daemon's models
    POST /api/show          a model's details (architecture, context length, vocabulary)
    GET  /api/ps            the models loaded (all of them: the daemon keeps its models resident)
    POST /api/chat          chat, rendered with the model's chat template; NDJSON stream (the default) or whole
    POST /api/generate      a completion of `prompt`: as a one-turn chat where the model has a chat template
                            (as Ollama applies its template), the prompt itself with `raw` or without one

Requests become the same daemon Generate as OpenAI's (request_translation.Translated) and run through
the same loop (generation.carry), so every rule of sampling, limits, disconnects and metrics is shared.
Ollama's options map to ember's: num_predict (< 0: up to the context), temperature, top_k, top_p, min_p,
repeat_penalty, presence_penalty, frequency_penalty, seed, stop; the options that tune Ollama's own
runner (num_ctx, num_gpu, num_thread, ...) are the daemon's to decide and are ignored. An empty prompt or
message list is Ollama's "load the model" request: answered done at once (every model is loaded).
`format` ("json" or a JSON schema) constrains the answer (structured_output.py); `tools` are offered
to the model, whose calls come back as message.tool_calls (client/tool_calls.py), and a history may
hold calls and `tool` messages. What ember cannot honour is refused with a 400 naming it: `images`,
`suffix`, `context`. Errors are Ollama's `{"error": "..."}`,
streamed as such after the stream started. No embeddings: /api/embed is a 404.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import msgspec
from aiohttp import web

from ember.client.gateway.errors import ApiError, bad_request
from ember.client.gateway.openai_schema import ErrorBody, ToolIn
from ember.client.gateway.request_translation import SEED_RANGE, Translated, stop_strings, tool_of
from ember.client.gateway.response_format import Choice, TokenScore
from ember.client.gateway.structured_output import ollama_grammar
from ember.client.tool_calls import ParsedCall, ToolCallParser, parse_tool_calls
from ember.protocol.messages import ChatMessage, Finished, ModelInfo, ToolCall, Usage

NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PROBE_TEXT = "Ollama is running"  # what Ollama's clients look for at / (a protocol constant, not a claim)
_ROLES = ("system", "user", "assistant", "tool")
_encode = msgspec.json.Encoder().encode


class OllamaOptions(msgspec.Struct, kw_only=True):
    num_predict: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None


class OllamaFunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}


class OllamaToolCall(msgspec.Struct, kw_only=True):
    function: OllamaFunctionCall


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool message: the function that answered


class _OllamaBody(msgspec.Struct, kw_only=True):
    model: str
    options: OllamaOptions | None = None
    stream: bool = True  # Ollama streams unless asked not to
    format: Any = None
    keep_alive: Any = None
    think: Any = None


class OllamaChatRequest(_OllamaBody, kw_only=True):
    messages: list[OllamaMessage] = []
    tools: list[ToolIn] | None = None  # OpenAI's shape, as Ollama takes it


class OllamaGenerateRequest(_OllamaBody, kw_only=True):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[Any] | None = None
    context: list[int] | None = None
    template: str | None = None


class OllamaShowRequest(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # the older field


def translate_ollama_chat(req: OllamaChatRequest) -> Translated:
    """Ollama's chat; its tool calls carry no ids, so the history's get ones made from their place, and a
    tool result answers the newest call before it of the function it names (else the newest call)."""
    messages: list[ChatMessage] = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise bad_request(f"messages[{i}].role {m.role!r} is not supported ({', '.join(_ROLES)})", "messages")
        if m.images:
            raise bad_request(f"messages[{i}]: images are not supported by ember", "messages")
        calls = tuple(ToolCall(f"call_{i}_{k}", c.function.name, _encode(c.function.arguments).decode())
                      for k, c in enumerate(m.tool_calls or ()))
        answers = _answered(messages, m.tool_name) if m.role == "tool" else None
        messages.append(ChatMessage(m.role, m.content, calls, answers.id if answers else "",
                                    m.tool_name or (answers.name if answers else "")))
    t = _translated(req, None, messages)
    tools = [tool_of(k, tool) for k, tool in enumerate(req.tools or [])]
    return replace(t, options={**t.options, "tools": tools}) if tools else t


def _answered(history: list[ChatMessage], name: str | None) -> ToolCall | None:
    calls = [c for m in history for c in m.tool_calls]
    return next((c for c in reversed(calls) if c.name == name), calls[-1] if calls else None)


def translate_ollama_generate(req: OllamaGenerateRequest, chat_template: bool) -> Translated:
    """A template (chat_template: the model has one) wraps the prompt as Ollama's does, unless `raw`."""
    for value, name in ((req.suffix, "suffix"), (req.images, "images"), (req.context, "context"),
                        (req.template, "template")):
        if value:
            raise bad_request(f"{name} is not supported by ember", name)
    if chat_template and not req.raw:
        turns = ([ChatMessage("system", req.system)] if req.system else []) + [ChatMessage("user", req.prompt)]
        return _translated(req, None, turns)
    return _translated(req, (req.system + "\n\n" if req.system else "") + req.prompt, None)


def _translated(req: _OllamaBody, prompt: str | None, messages: list[ChatMessage] | None) -> Translated:
    o = req.options or OllamaOptions()
    if o.num_predict == 0:
        raise bad_request("num_predict must not be 0", "options.num_predict")
    options: dict[str, Any] = {
        "temperature": o.temperature, "top_k": o.top_k, "top_p": o.top_p, "min_p": o.min_p,
        "repetition_penalty": o.repeat_penalty, "presence_penalty": o.presence_penalty or 0.0,
        "frequency_penalty": o.frequency_penalty or 0.0, "seed": None if o.seed is None else o.seed % SEED_RANGE,
        "stop": stop_strings(o.stop), "grammar": ollama_grammar(req.format),
    }
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None  # < 0: the context
    return Translated(req.model, prompt, messages, options, max_tokens, req.stream, False, None)


class OllamaFormat:
    """Ollama's answer to /api/chat (chat=True) or /api/generate: one JSON object per line while it
    streams, the last with `done: true`, the reason and the counts and durations (nanoseconds)."""

    stream_headers = NDJSON_HEADERS

    def __init__(self, model: str, chat: bool, arrived: float, tool_format: str = "") -> None:
        """tool_format: the model's, where the chat offered tools (their calls come as message.tool_calls)."""
        self.model, self.chat, self.arrived = model, chat, arrived
        self._parser = ToolCallParser(tool_format) if tool_format else None

    def opening(self, index: int = 0) -> bytes:
        return b""

    def delta(self, text: str, scores: list[TokenScore] | None, index: int = 0) -> bytes:
        if self._parser is None:
            return _encode(self._piece(text, False)) + b"\n"
        text, calls = self._parser.feed(text)
        return _encode(self._piece(text, False, calls)) + b"\n" if text or calls else b""

    def closing(self, finished: Finished, index: int = 0) -> bytes:
        if self._parser is None:
            return _encode(self._last("", finished)) + b"\n"
        text, calls = self._parser.close()
        return _encode(self._last(text, finished, calls)) + b"\n"

    def usage(self, usage: Usage) -> bytes:
        return b""

    def end(self) -> bytes:
        return b""

    def error(self, body: ErrorBody) -> bytes:
        return _encode({"error": body.error.message}) + b"\n"

    def whole(self, choices: list[Choice], n: int = 1) -> bytes:
        text, _, finished = choices[0]  # Ollama's requests have one choice
        if self._parser is None:
            return _encode(self._last(text, finished))
        content, calls = parse_tool_calls(self._parser.fmt, text)
        return _encode(self._last(content, finished, calls))

    def _piece(self, text: str, done: bool, calls: Sequence[ParsedCall] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if calls:
                out["message"]["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                                for c in calls]
        else:
            out["response"] = text
        out["done"] = done
        return out

    def _last(self, text: str, finished: Finished, calls: Sequence[ParsedCall] = ()) -> dict[str, Any]:
        t = finished.timings
        return {**self._piece(text, True, calls), "done_reason": finished.reason,
                "total_duration": int((time.perf_counter() - self.arrived) * 1e9), "load_duration": 0,
                "prompt_eval_count": finished.usage.prompt_tokens, "prompt_eval_duration": int(t.prefill_ms * 1e6),
                "eval_count": finished.usage.completion_tokens, "eval_duration": int(t.decode_ms * 1e6)}

    def loaded(self) -> bytes:
        """The answer to a request with nothing to generate: Ollama's "load the model" call."""
        return _encode({**self._piece("", True), "done_reason": "load"})


def model_entry(m: ModelInfo, started: float) -> dict[str, Any]:
    """A model as /api/tags and /api/ps list it (what the daemon tells of it: no size or quantization)."""
    return {"name": m.name, "model": m.name, "modified_at": _iso(started), "size": 0,
            "digest": hashlib.sha256(m.name.encode()).hexdigest(), "details": details(m)}


def details(m: ModelInfo) -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": m.arch, "families": [m.arch], "parameter_size": "",
            "quantization_level": ""}


def show(m: ModelInfo) -> dict[str, Any]:
    return {"license": "", "modelfile": "", "parameters": "", "template": "", "details": details(m),
            "model_info": {"general.architecture": m.arch, f"{m.arch}.context_length": m.context_length,
                           f"{m.arch}.vocab_size": m.vocab},
            "capabilities": ["completion"]}


def error_response(error: ApiError) -> web.Response:
    """Ollama's error body: {"error": "..."} with the status."""
    return web.Response(body=_encode({"error": error.message}), status=error.status, content_type="application/json")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(when: float) -> str:
    return datetime.fromtimestamp(when, timezone.utc).isoformat().replace("+00:00", "Z")
