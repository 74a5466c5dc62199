"""The shape of an answer: OpenAI's chat or text completion, whole or as server-sent events.

`ChatFormat` and `TextFormat` (and Ollama's, ollama_api.py) have the same methods, so the generation loop
(generation.py) is written once: `opening()` (chat's first chunk names the role), `delta()` for each piece
of text, `closing()` with how it finished, `usage()` for stream_options.include_usage, `end()` after the
last, `error()` for a failure after the stream started, `whole()` for a non-streamed answer, and the
stream's `stream_headers`. Each returns bytes ready to send, JSON encoded once by msgspec: this runs for
every streamed token.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import msgspec
from msgspec import UNSET, UnsetType

from ember.client.gateway.openai_schema import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessageOut,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    ErrorBody,
    FunctionCallOut,
    TokenLogprobOut,
    ToolCallOut,
    TopLogprobOut,
    UsageOut,
)
from ember.client.gateway.token_texts import token_bytes
from ember.client.tool_calls import ParsedCall, ToolCallParser, parse_tool_calls
from ember.protocol.messages import Finished, Usage

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class TokenScore:
    """One generated token's log-probability and its alternatives', each named by its text."""

    text: str
    logprob: float
    top: list[tuple[str, float]]


Choice = tuple[str, "list[TokenScore] | None", Finished]  # one choice whole: its text, scores, end


def total_usage(finished: list[Finished], n: int = 1) -> Usage:
    """The usage of a request's choices together (n a prompt): each prompt once, every choice's completion."""
    return Usage(sum(f.usage.prompt_tokens for f in finished[::n]), sum(f.usage.completion_tokens for f in finished))


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def error_event(body: ErrorBody) -> bytes:
    """A stream's last event when it fails after it started (the openai SDK raises APIError on it)."""
    return sse(_encode(body))


def usage_out(usage: Usage) -> UsageOut:
    return UsageOut(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.prompt_tokens + usage.completion_tokens)


class _ServerSentEvents:
    """OpenAI's streams: server-sent events, `data: [DONE]` last, a failure as an error event."""

    stream_headers = SSE_HEADERS

    def end(self) -> bytes:
        return DONE

    def error(self, body: ErrorBody) -> bytes:
        return error_event(body)


class ChatFormat(_ServerSentEvents):
    """A chat's answers; with `tool_format` (the model's, where the request offered tools) the calls in
    them come out as OpenAI's tool_calls, streamed as one delta per call once it is complete, and the
    answer then finishes with "tool_calls"."""

    endpoint = "/v1/chat/completions"

    def __init__(self, model: str, include_usage: bool = False, tool_format: str = "") -> None:
        self.id, self.model, self.created = f"chatcmpl-{secrets.token_hex(12)}", model, int(time.time())
        # with include_usage every chunk has "usage": null and one last chunk the counts; else no "usage"
        self._usage: None | UnsetType = None if include_usage else UNSET
        self.tool_format = tool_format
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, with tools

    def opening(self, index: int = 0) -> bytes:
        return self._chunk(ChunkChoice(index=index, delta=Delta(role="assistant", content="")))

    def delta(self, text: str, scores: list[TokenScore] | None, index: int = 0) -> bytes:
        if not self.tool_format:
            return self._chunk(ChunkChoice(index=index, delta=Delta(content=text), logprobs=_chat_logprobs(scores)))
        parser = self._parsers.setdefault(index, ToolCallParser(self.tool_format))
        return self._tool_chunks(index, parser, *parser.feed(text), scores)

    def closing(self, finished: Finished, index: int = 0) -> bytes:
        out, reason = b"", finished.reason
        parser = self._parsers.pop(index, None)
        if parser is not None:
            out = self._tool_chunks(index, parser, *parser.close(), None)
            reason = _with_calls(reason, parser.calls)
        return out + self._chunk(ChunkChoice(index=index, delta=Delta(), finish_reason=reason))

    def _tool_chunks(self, index: int, parser: ToolCallParser, text: str, calls: list[ParsedCall],
                     scores: list[TokenScore] | None) -> bytes:
        """The text that may go out (with the tokens' logprobs), then each call completed now."""
        out = b""
        if text or scores:
            out = self._chunk(ChunkChoice(index=index, delta=Delta(content=text), logprobs=_chat_logprobs(scores)))
        first = len(parser.calls) - len(calls)
        for k, call in enumerate(calls):
            out += self._chunk(ChunkChoice(index=index, delta=Delta(tool_calls=[_call_out(call, first + k)])))
        return out

    def usage(self, usage: Usage) -> bytes:
        return sse(_encode(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                               usage=usage_out(usage))))

    def whole(self, choices: list[Choice], n: int = 1) -> bytes:
        out = []
        for i, (text, scores, finished) in enumerate(choices):
            message, reason = ChatMessageOut(content=text), finished.reason
            if self.tool_format:
                content, calls = parse_tool_calls(self.tool_format, text)
                if calls:
                    message = ChatMessageOut(content=content if content.strip() else None,
                                             tool_calls=[_call_out(c) for c in calls])
                    reason = _with_calls(reason, calls)
            out.append(ChatChoice(index=i, message=message, logprobs=_chat_logprobs(scores), finish_reason=reason))
        return _encode(ChatCompletion(id=self.id, created=self.created, model=self.model, choices=out,
                                      usage=usage_out(total_usage([c[2] for c in choices], n))))

    def _chunk(self, choice: ChunkChoice) -> bytes:
        return sse(_encode(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                               usage=self._usage)))


class TextFormat(_ServerSentEvents):
    endpoint = "/v1/completions"

    def __init__(self, model: str, include_usage: bool = False) -> None:
        self.id, self.model, self.created = f"cmpl-{secrets.token_hex(12)}", model, int(time.time())
        self._usage: None | UnsetType = None if include_usage else UNSET
        self._offsets: dict[int, int] = {}  # per choice: characters of its text before its next token (text_offset)

    def opening(self, index: int = 0) -> bytes:
        return b""  # a text completion's first chunk already carries text

    def delta(self, text: str, scores: list[TokenScore] | None, index: int = 0) -> bytes:
        return self._chunk(CompletionChoice(text=text, index=index, logprobs=self._logprobs(scores, index),
                                            finish_reason=None))

    def closing(self, finished: Finished, index: int = 0) -> bytes:
        return self._chunk(CompletionChoice(text="", index=index, logprobs=None, finish_reason=finished.reason))

    def usage(self, usage: Usage) -> bytes:
        return sse(_encode(Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                      usage=usage_out(usage))))

    def whole(self, choices: list[Choice], n: int = 1) -> bytes:
        out = [CompletionChoice(text=text, index=i, logprobs=self._logprobs(scores, i), finish_reason=finished.reason)
               for i, (text, scores, finished) in enumerate(choices)]
        return _encode(Completion(id=self.id, created=self.created, model=self.model, choices=out,
                                  usage=usage_out(total_usage([c[2] for c in choices], n))))

    def _chunk(self, choice: CompletionChoice) -> bytes:
        return sse(_encode(Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=self._usage)))

    def _logprobs(self, scores: list[TokenScore] | None, index: int) -> CompletionLogprobs | None:
        if scores is None:
            return None
        offsets = []
        for s in scores:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(s.text)
        return CompletionLogprobs(tokens=[s.text for s in scores], token_logprobs=[s.logprob for s in scores],
                                  top_logprobs=[dict(s.top) for s in scores], text_offset=offsets)


def _call_out(call: ParsedCall, index: int | UnsetType = UNSET) -> ToolCallOut:
    """OpenAI's tool call (`index`: its place in a streamed answer's calls)."""
    return ToolCallOut(index=index, id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def _with_calls(reason: str, calls: list[ParsedCall]) -> str:
    """An answer that ended by itself with calls in it finished to call them."""
    return "tool_calls" if calls and reason == "stop" else reason


def _chat_logprobs(scores: list[TokenScore] | None) -> ChatLogprobs | None:
    if scores is None:
        return None
    return ChatLogprobs(content=[
        TokenLogprobOut(token=s.text, logprob=s.logprob, token_bytes=token_bytes(s.text),
                        top_logprobs=[TopLogprobOut(token=t, logprob=lp, token_bytes=token_bytes(t)) for t, lp in s.top])
        for s in scores])


AnswerFormat = ChatFormat | TextFormat
