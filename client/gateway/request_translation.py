"""An OpenAI request body -> the ember Generate it asks for (`Translated`), or a 400 naming the field.

One home for each rule: the shape of OpenAI's fields (a stop string or a list, logit_bias keys as token-id
strings, content parts, prompts, n, which fields ember cannot honour) is checked here; the ranges of
the sampling values and every size limit are the daemon's (its Error{bad_request | limit} comes back as a
400 with its message), so the gateway and the daemon can never disagree on them.

A sampling field the request leaves out goes to the daemon as None: the model's recommended sampling
(its file's, else llama.cpp's defaults; daemon/text/sampling_defaults.py), as Ollama does, rather than
OpenAI's temperature 1 or ember's SDK's greedy. max_tokens: up to the context (bounded by the
gateway's default_max_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec

from ember.client.gateway.errors import bad_request
from ember.client.gateway.openai_schema import ChatRequest, CompletionRequest, MessageIn, SamplingBody, ToolIn
from ember.client.gateway.structured_output import openai_grammar
from ember.protocol.messages import ChatMessage, Grammar, Tool, ToolCall

T = TypeVar("T")
SEED_RANGE = 2**64  # ember's seeds are unsigned 64-bit; OpenAI's are signed: taken modulo, still reproducible
MAX_CHOICES = 16  # n: choices per request (each one a request in the daemon and a slot of the gateway's)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_NO_PARAMETERS = {"type": "object", "properties": {}}
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}  # per request body type, made at its first use


@dataclass(frozen=True)
class Translated:
    """What a request asks of the daemon, and how the answer is to be shaped."""

    model: str
    prompt: str | list[int] | None  # a completion's prompt (text or token ids): the first of `prompts`
    messages: list[ChatMessage] | None  # a chat's
    options: dict[str, Any]  # keyword arguments of AsyncClient.generate / chat, max_tokens aside
    max_tokens: int | None  # None: as many as the context allows (Admission decides)
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: not asked; else the chosen token's log-probability and this many alternatives
    n: int = 1  # choices per prompt: each a Generate of its own, seeded seed + j where a seed is given
    prompts: list[str | list[int]] | None = None  # a completion's prompts (OpenAI's list of prompts): n choices each

    @property
    def choices(self) -> int:
        return self.n * len(self.prompts or [None])

    def choice(self, i: int) -> dict[str, Any]:
        """The options of choice i's Generate (choice i: prompt i // n, its sample i % n)."""
        seed = self.options.get("seed")
        j = i % self.n
        return self.options if j == 0 or seed is None else {**self.options, "seed": (seed + j) % SEED_RANGE}

    def prompt_of(self, i: int) -> str | list[int] | None:
        return self.prompts[i // self.n] if self.prompts else self.prompt


def decode_body(body: bytes, kind: type[T]) -> T:
    """The body as `kind` (a msgspec Struct: OpenAI's, Ollama's, the Responses API's request); 400 naming
    the field when it is not JSON (or not UTF-8) or a field has the wrong type."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in text else None
        raise bad_request(f"invalid request body: {text}", param) from None
    except msgspec.DecodeError as e:
        try:  # msgspec 0.23 reports a string that is not UTF-8 as a DecodeError: say which it was
            body.decode("utf-8")
        except UnicodeDecodeError as u:
            raise bad_request(f"the request body is not valid UTF-8: {u.reason} at byte {u.start}") from None
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:  # what msgspec before 0.23 raised for a string that is not UTF-8
        raise bad_request(f"the request body is not valid UTF-8: {e.reason} at byte {e.start} of a string") from None


def translate_chat(req: ChatRequest) -> Translated:
    _refuse(req.functions, "functions", "functions (the legacy function calling) are not supported by ember: use tools")
    if req.function_call not in (None, "none"):
        raise bad_request("function_call (the legacy function calling) is not supported by ember: use tool_choice",
                          "function_call")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    t = _translated(req, None, messages, max_tokens, logprobs, openai_grammar(req, req.response_format))
    tools = [tool_of(i, tool) for i, tool in enumerate(req.tools or [])]
    if tools:
        choice, name = tool_choice_of(req.tool_choice, tools)
        t = replace(t, options={**t.options, "tools": tools, "tool_choice": choice, "tool_name": name,
                                "parallel_tool_calls": req.parallel_tool_calls is not False})
    elif req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    return t


def translate_completion(req: CompletionRequest) -> Translated:
    if req.echo:
        raise bad_request("echo is not supported by ember", "echo")
    if req.suffix:
        raise bad_request("suffix (insertion) is not supported by ember", "suffix")
    if req.best_of not in (None, 1):
        raise bad_request("best_of must be 1: ember returns one completion per request", "best_of")
    if req.logprobs is not None and req.logprobs < 0:
        raise bad_request(f"logprobs must be >= 0, got {req.logprobs}", "logprobs")
    prompts = _prompts(req.prompt)
    t = _translated(req, prompts[0], None, req.max_tokens, req.logprobs, openai_grammar(req))
    if len(prompts) * t.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n={t.n} is {len(prompts) * t.n} completions, over the limit of "
                          f"{MAX_CHOICES} a request", "prompt")
    return replace(t, prompts=prompts) if len(prompts) > 1 else t


def _translated(req: SamplingBody, prompt: str | list[int] | None, messages: list[ChatMessage] | None,
                max_tokens: int | None, logprobs: int | None, grammar: Grammar | None = None) -> Translated:
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    options: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "seed": req.seed % SEED_RANGE if req.seed is not None else None,
        "stop": stop_strings(req.stop),
        "logit_bias": _logit_bias(req.logit_bias),
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": bool(req.ignore_eos),
        "logprobs": logprobs is not None,
        "top_logprobs": logprobs or 0,
        "grammar": grammar,
    }
    include_usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
    return Translated(req.model, prompt, messages, options, max_tokens, bool(req.stream), include_usage, logprobs,
                      req.n or 1)


def _refuse(value: object, param: str, message: str) -> None:
    if value:
        raise bad_request(message, param)


def _message(i: int, m: MessageIn) -> ChatMessage:
    role = _ROLES.get(m.role)
    if role is None:
        raise bad_request(f"messages[{i}].role {m.role!r} is not supported (system, developer, user, assistant, "
                          "tool)", f"messages[{i}].role")
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments if isinstance(c.function.arguments, str)
                           else msgspec.json.encode(c.function.arguments).decode()) for c in m.tool_calls or ())
    if calls and role != "assistant":
        raise bad_request(f"messages[{i}]: only an assistant's message has tool_calls", f"messages[{i}].tool_calls")
    if role == "tool" and not m.tool_call_id:
        raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id it answers",
                          f"messages[{i}].tool_call_id")
    extra = {"tool_calls": calls, "tool_call_id": m.tool_call_id or "", "name": m.name or ""}
    if m.content is None:
        if role != "assistant":
            raise bad_request(f"messages[{i}].content is missing", f"messages[{i}].content")
        return ChatMessage(role, "", **extra)
    if isinstance(m.content, str):
        return ChatMessage(role, m.content, **extra)
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                              f"messages[{i}].content[{j}]")
        texts.append(part.text)
    return ChatMessage(role, "\n".join(texts), **extra)


def tool_of(i: int, tool: ToolIn) -> Tool:
    """tools[i] of an OpenAI (or Ollama) request as ember's Tool."""
    if tool.type != "function":
        raise bad_request(f"tools[{i}].type must be function, got {tool.type!r}", f"tools[{i}].type")
    f = tool.function
    return Tool(f.name, f.description or "", msgspec.json.encode(f.parameters or _NO_PARAMETERS).decode())


def tool_choice_of(choice: str | dict[str, Any] | None, tools: list[Tool]) -> tuple[str, str]:
    """OpenAI's tool_choice (chat's {"type": "function", "function": {"name"}} or the Responses API's
    {"type": "function", "name"}) as (ember's tool_choice, the function it names)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", ""
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        return "required", name
    raise bad_request(f"tool_choice must be auto, none, required or a function, got {choice!r}", "tool_choice")


def _prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt: a string, token ids, or a list of strings or of token-id lists (each completed)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [[int(p) for p in prompt]]  # type: ignore[arg-type]
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [p if isinstance(p, str) else list(p) for p in prompt]  # type: ignore[misc]
    raise bad_request("prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
                      "prompt")


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                              "logit_bias") from None
    return out

