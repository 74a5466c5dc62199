"""OpenAI's HTTP API as msgspec Structs: the request bodies the gateway accepts and the responses, chunks
and errors it sends (https://platform.openai.com/docs/api-reference/chat, .../completions).

Request bodies are decoded with these types, so a wrong type is refused while decoding, naming the field.
Fields OpenAI defines but ember cannot honour (functions, echo, ...) are declared so that the request
translation (request_translation.py) can refuse them by name; unknown fields are ignored, as clients send
vendor extras. Response fields that the spec has as `null` are encoded as null, not left out, except
`usage` on chunks, which is present only with `stream_options.include_usage` (UNSET: left out).
"""
from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class Body(msgspec.Struct, kw_only=True):
    """Base of the request bodies (decoded from JSON, never encoded)."""


# --- requests --------------------------------------------------------------------------------------
class ContentPart(Body, kw_only=True):
    type: str
    text: str | None = None


class FunctionCallIn(Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text (OpenAI's); an object is taken too


class ToolCallIn(Body, kw_only=True):
    id: str = ""
    type: str = "function"
    function: FunctionCallIn


class MessageIn(Body, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionIn(Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(Body, kw_only=True):
    type: str = "function"
    function: FunctionIn


class StreamOptions(Body, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(Body, kw_only=True):
    """response_format.json_schema."""

    name: str = "response"
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Body, kw_only=True):
    type: str = "text"  # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(Body, kw_only=True):
    """What both endpoints share: the model, the sampling options, streaming, and ember's own extras."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # ember's options, as extra body fields (openai SDK: extra_body={...})
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    # the grammar fields of llama.cpp's server (GBNF or Lark; a JSON schema) and vLLM's (structured_output.py)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatRequest(SamplingBody, kw_only=True):
    messages: list[MessageIn]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, or {"type": "function", "function": ...}
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None


class CompletionRequest(SamplingBody, kw_only=True):
    # a string, one string in a list, token ids, or one list of token ids
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# --- responses -------------------------------------------------------------------------------------
class Out(msgspec.Struct, kw_only=True):
    """Base of what the gateway encodes."""


class UsageOut(Out, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprobOut(Out, kw_only=True):
    token: str
    logprob: float
    token_bytes: list[int] | None = msgspec.field(default=None, name="bytes")


class TokenLogprobOut(Out, kw_only=True):
    token: str
    logprob: float
    token_bytes: list[int] | None = msgspec.field(default=None, name="bytes")
    top_logprobs: list[TopLogprobOut]


class ChatLogprobs(Out, kw_only=True):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class FunctionCallOut(Out, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(Out, kw_only=True):
    index: int | UnsetType = UNSET  # in a stream's deltas (each call whole in one)
    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatMessageOut(Out, kw_only=True):
    role: str = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


class ChatChoice(Out, kw_only=True):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str


class Envelope(Out, kw_only=True):
    """What every completion, whole or a chunk, opens with."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


class ChatCompletion(Envelope, kw_only=True):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageOut


class Delta(Out, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChunkChoice(Out, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Envelope, kw_only=True):
    object: str = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: UsageOut | None | UnsetType = UNSET


class CompletionLogprobs(Out, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Out, kw_only=True):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Envelope, kw_only=True):
    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageOut | None | UnsetType = UNSET


class ModelCard(Out, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "ember"
    context_length: int  # not OpenAI's: what the daemon serves for this model


class ModelList(Out, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class ErrorObject(Out, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(Out, kw_only=True):
    error: ErrorObject
