"""Hard limits on what one client may ask of the daemon, and the checks that enforce them.

Every size or count a client controls is bounded here, so no message can make the daemon allocate
without bound. The daemon's configuration may change the values (`[limits]` in ember.toml); the
checks run on every Generate before anything is queued, and on a prompt's or Tokenize's text before it
is tokenized (its size in bytes bounds its tokens from below). A frame over `max_message_bytes` never
reaches Python: libzmq drops the connection that sent it (ZMQ_MAXMSGSIZE, which bounds each frame,
not a message: the daemon discards the frames of a multi-frame message one by one as it reads them).
"""
from __future__ import annotations

import msgspec

from ember.protocol.messages import ErrorCode, Generate


class LimitExceeded(ValueError):
    """A request over a hard limit (answered with Error{code: "limit"})."""

    code = ErrorCode.LIMIT


class ContextLengthExceeded(LimitExceeded):
    """A prompt longer than the model's context, said as OpenAI says it ("This model's maximum context
    length is ..."): the wording and code tools such as litellm and LangChain look for."""

    code = ErrorCode.CONTEXT_LENGTH

    def __init__(self, context_length: int, tokens: str) -> None:
        super().__init__(f"This model's maximum context length is {context_length + 1} tokens. However, your "
                         f"prompt resulted in {tokens} tokens (at most {context_length}, to leave one to "
                         "generate). Please reduce the length of the prompt or messages.")


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_message_bytes: int = 4 << 20  # one frame; a 128k-token prompt as ids is ~640 KiB
    max_prompt_tokens: int = 131072  # also never more than the model's context length
    max_tokens: int = 32768  # per Generate
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_stop_ids: int = 64
    max_chat_messages: int = 1024
    max_logit_bias: int = 1024  # entries
    max_top_logprobs: int = 20
    max_grammar_bytes: int = 256 << 10  # a Generate's grammar text (JSON schemas of many tools fit)
    max_tools: int = 128  # functions a Generate offers
    max_tool_bytes: int = 256 << 10  # their names, descriptions and schemas together
    max_requests_per_client: int = 16  # Generates in flight per connection, and as many Tokenize/Detokenize

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_message_bytes > 256 << 20:
            raise ValueError(f"limits.max_message_bytes must be <= 256 MiB, got {self.max_message_bytes}")

    def check_generate(self, msg: Generate) -> None:
        """Raise LimitExceeded naming the first limit `msg` is over (prompt tokens are checked once the
        prompt is tokenized, by the daemon)."""
        _within("max_tokens", msg.max_tokens, self.max_tokens)
        _within("stop strings", len(msg.stop), self.max_stop_strings)
        for s in msg.stop:
            _within("stop string length", len(s), self.max_stop_chars)
        _within("stop_ids", len(msg.stop_ids), self.max_stop_ids)
        _within("logit_bias entries", len(msg.logit_bias), self.max_logit_bias)
        _within("top_logprobs", msg.top_logprobs, self.max_top_logprobs)
        if msg.grammar is not None:
            _within("grammar bytes", len(msg.grammar.text.encode()), self.max_grammar_bytes)
        _within("tools", len(msg.tools), self.max_tools)
        tool_bytes = sum(len(t.name) + len(t.description.encode()) + len(t.parameters.encode()) for t in msg.tools)
        _within("tool bytes", tool_bytes, self.max_tool_bytes)
        if msg.token_ids is not None:
            _within("prompt tokens", len(msg.token_ids), self.max_prompt_tokens)
        if msg.messages is not None:
            _within("chat messages", len(msg.messages), self.max_chat_messages)

    def check_prompt(self, n_tokens: int, context_length: int) -> None:
        """context_length: the prompt tokens the model's context leaves room for."""
        if context_length < self.max_prompt_tokens and n_tokens > context_length:
            raise ContextLengthExceeded(context_length, str(n_tokens))
        _within("prompt tokens", n_tokens, self.max_prompt_tokens)

    def check_prompt_bytes(self, n_bytes: int, max_token_bytes: int | None, context_length: int) -> None:
        """Refuse, before it is tokenized, a text too long to be a prompt: no token stands for more than
        `max_token_bytes` bytes of text (the tokenizer's bound, None if it has none), so `n_bytes` of
        text are at least n_bytes / max_token_bytes tokens."""
        limit = min(self.max_prompt_tokens, context_length)
        if max_token_bytes is not None and n_bytes > limit * max_token_bytes:
            at_least = -(-n_bytes // max_token_bytes)
            if context_length < self.max_prompt_tokens:
                raise ContextLengthExceeded(context_length, f"at least {at_least}")
            raise LimitExceeded(f"prompt tokens: a text of {n_bytes} bytes is at least {at_least} tokens (at most "
                                f"{max_token_bytes} bytes per token), over the limit of {limit}")

    def check_detokenize(self, n_ids: int) -> None:
        """A Detokenize: at most the ids of the longest sequence the daemon serves."""
        _within("token ids", n_ids, self.max_prompt_tokens + self.max_tokens)


def _within(what: str, value: int, limit: int) -> None:
    if value > limit:
        raise LimitExceeded(f"{what}: {value} is over the limit of {limit}")
