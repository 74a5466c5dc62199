"""OpenAI's Responses API (`POST /v1/responses`), the subset local clients use: openai's
`responses.create`, litellm's `responses`, LangChain's `use_responses_api`.

In: `input` as a string or a list of messages (`role` and `content`, a string or `input_text` parts),
`instructions` (this request's system message, not carried to the next), `previous_response_id` (the
conversation of an earlier response of this gateway's lifetime, answer included, goes first),
`max_output_tokens`, `temperature`, `top_p`, `stream`, `store`, `metadata`, and ember's extras (`top_k`,
`min_p`, `repetition_penalty`, `seed`). Out: a `response` object with one assistant message of
`output_text`, status `completed` (or `incomplete` with reason `max_output_tokens`), and usage; streamed
as Responses' typed server-sent events (`response.created`, `response.output_text.delta`, ...,
`response.completed`). `text.format` json_object and json_schema constrain the answer
(structured_output.py). Refused with a 400 naming the field: `tools`, `reasoning`, input items other
than messages (function calls, images, files). Stored responses (for
`previous_response_id`) live in the gateway's memory, the newest RESPONSES_KEPT of them.
"""
from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from typing import Any

import msgspec

from ember.client.gateway.errors import bad_request
from ember.client.gateway.openai_schema import ErrorBody, FunctionIn, ToolIn
from ember.client.gateway.request_translation import SEED_RANGE, Translated, tool_choice_of, tool_of
from ember.client.gateway.response_format import SSE_HEADERS, Choice, TokenScore
from ember.client.gateway.structured_output import responses_grammar
from ember.client.tool_calls import ParsedCall, ToolCallParser, parse_tool_calls
from ember.protocol.messages import ChatMessage, Finished, Tool, ToolCall, Usage

RESPONSES_KEPT = 256  # stored responses, for previous_response_id (the oldest go first)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_encode = msgspec.json.Encoder().encode


class InputPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    type: str = "message"  # message, function_call or function_call_output
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None  # function_call and function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | None = None  # function_call_output


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    text: Any = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, or {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    reasoning: Any = None
    # ember's extras (openai SDK: extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None


class ResponseStore:
    """The conversations of the newest responses, by id (previous_response_id)."""

    def __init__(self, kept: int = RESPONSES_KEPT) -> None:
        self.kept = kept
        self._conversations: OrderedDict[str, list[ChatMessage]] = OrderedDict()

    def put(self, response_id: str, conversation: list[ChatMessage]) -> None:
        self._conversations[response_id] = conversation
        while len(self._conversations) > self.kept:
            self._conversations.popitem(last=False)

    def get(self, response_id: str) -> list[ChatMessage]:
        try:
            return self._conversations[response_id]
        except KeyError:
            raise bad_request(f"previous_response_id {response_id!r}: no such response in this gateway (it keeps "
                              f"the newest {self.kept}, for its lifetime)", "previous_response_id") from None


def translate_responses(req: ResponsesRequest, store: ResponseStore) -> tuple[Translated, list[ChatMessage]]:
    """The Generate it asks for, and the conversation it continues (previous, then this input), which its
    answer extends in the store."""
    if req.reasoning is not None:
        raise bad_request("reasoning is not supported by ember", "reasoning")
    grammar = responses_grammar(req.text)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", "max_output_tokens")
    conversation = list(store.get(req.previous_response_id)) if req.previous_response_id else []
    conversation += _input_messages(req.input)
    messages = ([ChatMessage("system", req.instructions)] if req.instructions else []) + conversation
    options: dict[str, Any] = {
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": None if req.seed is None else req.seed % SEED_RANGE, "grammar": grammar,
    }
    tools = [_tool(i, t) for i, t in enumerate(req.tools or [])]
    if tools:
        choice, name = tool_choice_of(req.tool_choice, tools)
        options.update(tools=tools, tool_choice=choice, tool_name=name,
                       parallel_tool_calls=req.parallel_tool_calls is not False)
    elif req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools", "tool_choice")
    return Translated(req.model, None, messages, options, req.max_output_tokens, req.stream, False, None), conversation


def _input_messages(given: str | list[InputItem]) -> list[ChatMessage]:
    """The input as chat messages: a function_call joins the assistant's message before it (or makes one),
    a function_call_output is a tool message answering its call."""
    if isinstance(given, str):
        return [ChatMessage("user", given)]
    out: list[ChatMessage] = []
    names: dict[str, str] = {}  # call id -> function name
    for i, item in enumerate(given):
        if item.type == "function_call":
            if not item.call_id or not item.name:
                raise bad_request(f"input[{i}]: a function_call needs its call_id and name", f"input[{i}]")
            names[item.call_id] = item.name
            call = ToolCall(item.call_id, item.name, item.arguments or "{}")
            if out and out[-1].role == "assistant":
                out[-1] = msgspec.structs.replace(out[-1], tool_calls=(*out[-1].tool_calls, call))
            else:
                out.append(ChatMessage("assistant", "", (call,)))
            continue
        if item.type == "function_call_output":
            if not item.call_id:
                raise bad_request(f"input[{i}]: a function_call_output needs the call_id it answers", f"input[{i}]")
            out.append(ChatMessage("tool", item.output or "", tool_call_id=item.call_id,
                                   name=names.get(item.call_id, "")))
            continue
        role = _ROLES.get(item.role or "")
        if item.type != "message" or role is None:
            raise bad_request(f"input[{i}]: only messages (system, developer, user, assistant), function_call and "
                              f"function_call_output items are supported, got {item.type!r}"
                              + (f" of role {item.role!r}" if item.role else ""), f"input[{i}]")
        if isinstance(item.content, str) or item.content is None:
            out.append(ChatMessage(role, item.content or ""))
            continue
        texts = []
        for j, part in enumerate(item.content):
            if part.type not in ("input_text", "output_text", "text") or part.text is None:
                raise bad_request(f"input[{i}].content[{j}]: only text parts are supported, got {part.type!r}",
                                  f"input[{i}].content[{j}]")
            texts.append(part.text)
        out.append(ChatMessage(role, "\n".join(texts)))
    return out


def _tool(i: int, t: FunctionTool) -> Tool:
    """A Responses tool (flat) as chat's (nested) makes it."""
    return tool_of(i, ToolIn(type=t.type, function=FunctionIn(name=t.name, description=t.description,
                                                              parameters=t.parameters)))


class ResponsesFormat:
    """A response, whole or as Responses' server-sent events; once it is complete, its conversation
    goes to the store (unless `store: false`). With `tool_format` (the model's, where the request offered
    tools) its calls are function_call output items, after the message item that holds its text (which
    is left out when there is none)."""

    stream_headers = SSE_HEADERS

    def __init__(self, req: ResponsesRequest, conversation: list[ChatMessage], store: ResponseStore,
                 tool_format: str = "") -> None:
        self.req, self.conversation, self.store = req, conversation, store
        self.id, self.item_id = f"resp_{secrets.token_hex(24)}", f"msg_{secrets.token_hex(24)}"
        self.created = int(time.time())
        self._text: list[str] = []
        self._sequence = 0
        self._parser = ToolCallParser(tool_format) if tool_format else None
        self._message_at: int | None = None  # the message item's output index, once it is open
        self._items = 0  # output items opened

    def opening(self, index: int = 0) -> bytes:
        out = b"".join((self._event("response.created", response=self._response("in_progress", [])),
                        self._event("response.in_progress", response=self._response("in_progress", []))))
        return out if self._parser is not None else out + self._open_message()

    def delta(self, text: str, scores: list[TokenScore] | None, index: int = 0) -> bytes:
        calls: list[ParsedCall] = []
        if self._parser is not None:
            text, calls = self._parser.feed(text)
        return self._text_delta(text) + b"".join(self._call_events(c) for c in calls)

    def closing(self, finished: Finished, index: int = 0) -> bytes:
        out = b""
        if self._parser is not None:
            text, calls = self._parser.close()
            out = self._text_delta(text) + b"".join(self._call_events(c) for c in calls)
        text = "".join(self._text)
        response = self._finish(text, self._parser.calls if self._parser else [], finished)
        if self._message_at is not None:
            message = response["output"][0]
            out += b"".join((
                self._event("response.output_text.done", item_id=self.item_id, output_index=self._message_at,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.item_id, output_index=self._message_at,
                            content_index=0, part=_text_part(text)),
                self._event("response.output_item.done", output_index=self._message_at, item=message)))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=response)

    def usage(self, usage: Usage) -> bytes:
        return b""

    def end(self) -> bytes:
        return b""

    def error(self, body: ErrorBody) -> bytes:
        return self._event("error", code=body.error.code, message=body.error.message, param=body.error.param)

    def whole(self, choices: list[Choice], n: int = 1) -> bytes:
        text, _, finished = choices[0]
        calls: list[ParsedCall] = []
        if self._parser is not None:
            text, calls = parse_tool_calls(self._parser.fmt, text)
        return _encode(self._finish(text, calls, finished))

    def _open_message(self) -> bytes:
        self._message_at, self._items = self._items, self._items + 1
        item = {"type": "message", "id": self.item_id, "status": "in_progress", "role": "assistant", "content": []}
        return b"".join((
            self._event("response.output_item.added", output_index=self._message_at, item=item),
            self._event("response.content_part.added", item_id=self.item_id, output_index=self._message_at,
                        content_index=0, part=_text_part(""))))

    def _text_delta(self, text: str) -> bytes:
        if not text:
            return b""
        out = self._open_message() if self._message_at is None else b""
        self._text.append(text)
        return out + self._event("response.output_text.delta", item_id=self.item_id, output_index=self._message_at,
                                 content_index=0, delta=text, logprobs=[])

    def _call_events(self, call: ParsedCall) -> bytes:
        """A call's item, whole: added, its arguments in one delta, done."""
        at, self._items = self._items, self._items + 1
        item = _call_item(call)
        return b"".join((
            self._event("response.output_item.added", output_index=at, item={**item, "status": "in_progress",
                                                                              "arguments": ""}),
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                        delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                        arguments=call.arguments),
            self._event("response.output_item.done", output_index=at, item=item)))

    def _finish(self, text: str, calls: list[ParsedCall], finished: Finished) -> dict[str, Any]:
        """The completed response; its conversation stored."""
        if self.req.store is not False:
            said = tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)
            self.store.put(self.id, [*self.conversation, ChatMessage("assistant", text, said)])
        output: list[dict[str, Any]] = []
        if text or not calls:
            output.append({"type": "message", "id": self.item_id, "status": "completed", "role": "assistant",
                           "content": [_text_part(text)]})
        output += [_call_item(c) for c in calls]
        complete = finished.reason != "length"
        u = finished.usage
        usage = {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u.prompt_tokens + u.completion_tokens}
        return self._response("completed" if complete else "incomplete", output, usage,
                              None if complete else {"reason": "max_output_tokens"})

    def _response(self, status: str, output: list[Any], usage: dict[str, Any] | None = None,
                  incomplete: dict[str, str] | None = None) -> dict[str, Any]:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "model": r.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": r.store is not False, "temperature": r.temperature,
                "text": r.text or {"format": {"type": "text"}}, "tool_choice": r.tool_choice or "auto",
                "tools": [msgspec.to_builtins(t) for t in r.tools or []], "top_p": r.top_p, "truncation": "disabled",
                "usage": usage, "user": None, "metadata": r.metadata or {}}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = _encode({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ParsedCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}
