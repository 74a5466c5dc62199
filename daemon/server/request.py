"""Request: the daemon's own, mutable record of one Generate, built from a validated message.

The wire message is read once, here (cheap checks only: the I/O loop calls this); the prompt is
tokenized or rendered later by the text worker, which owns the fields below the line (the engine
thread reads `seq`, and the scheduler owns the sequence itself).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ember.daemon.logging_setup import get_logger
from ember.daemon.engine.sequence import Sequence
from ember.daemon.text.stop_strings import StopStrings
from ember.daemon.text.text_model import TextModel
from ember.daemon.text.tool_format import template_messages
from ember.daemon.text.tokenizer import StreamDecoder
from ember.kernels.sampling import SamplingParams
from ember.protocol.limits import Limits, LimitExceeded
from ember.protocol.messages import ErrorCode, Generate, Grammar, Tool, ToolChoice


class RequestError(ValueError):
    """A request the daemon refuses; `code` is the Error code the client gets."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class Request:
    client: bytes  # the ZMQ identity of the connection that sent it
    id: int  # the client's id for it
    model: TextModel
    model_name: str
    prompt_text: str | None
    prompt_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...]
    ignore_eos: bool
    return_logits: bool  # each token's logits go to the client (device_logits: in its CUDA IPC ring)
    logprobs: bool
    grammar: Grammar | None = None  # as the client wrote it (the text worker compiles it)
    tools: tuple[Tool, ...] = ()  # a chat's functions (its template renders them)
    tool_choice: str = ToolChoice.AUTO
    tool_name: str = ""
    parallel_tool_calls: bool = True
    device_logits: bool = False
    admitted: float = field(default_factory=time.perf_counter)
    # --- text worker only ---------------------------------------------------------------------------
    compiled_grammar: str | None = None  # llguidance's text of `grammar` (daemon/text/grammar.py)
    cache_salt: bytes = b""  # its prompt's KV blocks are shared with the requests of the same salt only
    user: int = -1  # its client's Unix user (SO_PEERCRED; -1: unknown)
    seq: Sequence | None = None  # once admitted to its model's scheduler
    done: bool = False  # its last frame (Finished or Error) is out
    text: StreamDecoder | None = None
    stops: StopStrings | None = None
    first_token: float | None = None
    completion_tokens: int = 0

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.client, self.id)

    @property
    def rid(self) -> str:
        """The request id in logs: the connection and the client's id."""
        return f"{self.client.hex()}:{self.id}"

    def __post_init__(self) -> None:
        self.log = get_logger(req=self.rid, model=self.model_name)


def resolve_model(name: str, models: Mapping[str, TextModel]) -> tuple[str, TextModel]:
    if name:
        if name not in models:
            raise RequestError(ErrorCode.UNKNOWN_MODEL, f"no model named {name!r} (loaded: {', '.join(models)})")
        return name, models[name]
    if len(models) != 1:
        raise RequestError(ErrorCode.UNKNOWN_MODEL, f"several models are loaded ({', '.join(models)}): name one")
    return next(iter(models.items()))


def request_from_generate(client: bytes, msg: Generate, models: Mapping[str, TextModel], limits: Limits) -> Request:
    """Validate `msg` and build its Request; RequestError says what is wrong."""
    try:
        limits.check_generate(msg)
    except LimitExceeded as e:
        raise RequestError(ErrorCode.LIMIT, str(e)) from None
    name, model = resolve_model(msg.model, models)
    given = [x is not None for x in (msg.prompt, msg.token_ids, msg.messages)]
    if sum(given) != 1:
        raise RequestError(ErrorCode.BAD_REQUEST, "give exactly one of prompt, token_ids and messages")
    if msg.messages is not None and not msg.messages:
        raise RequestError(ErrorCode.BAD_REQUEST, "messages is empty: a chat needs at least one message")
    if msg.tools and msg.messages is None:
        raise RequestError(ErrorCode.BAD_REQUEST, "tools are for chats (messages): a template renders them")
    if msg.tool_choice not in (ToolChoice.AUTO, ToolChoice.NONE, ToolChoice.REQUIRED):
        raise RequestError(ErrorCode.BAD_REQUEST,
                           f"tool_choice must be auto, none or required, got {msg.tool_choice!r}")
    if msg.tool_choice == ToolChoice.REQUIRED and not msg.tools:
        raise RequestError(ErrorCode.BAD_REQUEST, "tool_choice required needs tools")
    if msg.tool_name and msg.tool_choice != ToolChoice.REQUIRED:
        raise RequestError(ErrorCode.BAD_REQUEST, "tool_name goes with tool_choice required")
    if msg.max_tokens < 0:
        raise RequestError(ErrorCode.BAD_REQUEST, f"max_tokens must be >= 0, got {msg.max_tokens}")
    if msg.return_logits and msg.device_logits:
        raise RequestError(ErrorCode.BAD_REQUEST, "ask for return_logits (shared memory) or device_logits (the GPU), "
                                                  "not both")
    vocab = model.config.vocab
    for what, ids in (("token_ids", msg.token_ids or ()), ("stop_ids", msg.stop_ids), ("logit_bias", msg.logit_bias)):
        if any(not 0 <= int(i) < vocab for i in ids):
            raise RequestError(ErrorCode.BAD_REQUEST, f"{what}: token ids must be in [0, {vocab})")
    if msg.seed is not None and not 0 <= msg.seed < 2**64:
        raise RequestError(ErrorCode.BAD_REQUEST, f"seed must be in [0, 2**64), got {msg.seed}")
    try:
        params = SamplingParams(
            **model.sampling.filled(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p,
                                    repetition_penalty=msg.repetition_penalty),  # None: the model's recommendation
            frequency_penalty=msg.frequency_penalty,
            presence_penalty=msg.presence_penalty, logit_bias=dict(msg.logit_bias),
            logprobs=msg.top_logprobs,
        )
    except ValueError as e:
        raise RequestError(ErrorCode.BAD_REQUEST, str(e)) from None
    return Request(
        client=client, id=msg.id, model=model, model_name=name, prompt_text=msg.prompt,
        prompt_ids=list(msg.token_ids) if msg.token_ids is not None else None,
        messages=template_messages(msg.messages) if msg.messages is not None else None,
        max_tokens=msg.max_tokens, params=params, seed=msg.seed, stop=msg.stop, stop_ids=msg.stop_ids,
        ignore_eos=msg.ignore_eos, return_logits=msg.return_logits or msg.device_logits,
        device_logits=msg.device_logits, logprobs=msg.logprobs or msg.top_logprobs > 0,
        grammar=msg.grammar, tools=msg.tools, tool_choice=msg.tool_choice, tool_name=msg.tool_name,
        parallel_tool_calls=msg.parallel_tool_calls,
    )
