"""What the sync and async clients share: building request messages from keyword arguments, reading
replies, and turning Tokens frames into Chunks. No I/O here."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ember.client.errors import EmberError, GenerationFailed, error_from
from ember.protocol.messages import ChatMessage, Error, Finished, FinishReason, Generate, ServerMessage, Tokens
from ember.protocol.shm_ring import ShmRingReader

T = TypeVar("T")


@dataclass(frozen=True)
class Chunk:
    """What one Tokens frame brought: new token ids, the text they add, and when asked for, their
    log-probabilities and logits. `logits` ([n, vocab] float32) is a read-only view of shared memory,
    valid until the stream advances: copy it to keep it."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    logits: np.ndarray | None = None


def generate_message(request_id: int, prompt: str | Sequence[int] | None = None, *,
                     messages: Sequence[Mapping[str, str] | ChatMessage] | None = None, model: str | None = None,
                     max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
                     presence_penalty: float = 0.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                     stop_ids: Sequence[int] | None = None, ignore_eos: bool = False, return_logits: bool = False,
                     logprobs: bool = False, top_logprobs: int = 0,
                     logit_bias: Mapping[int, float] | None = None) -> Generate:
    text = prompt if isinstance(prompt, str) else None
    ids = tuple(int(t) for t in prompt) if prompt is not None and not isinstance(prompt, str) else None
    chat = tuple(_chat_message(m) for m in messages) if messages is not None else None
    return Generate(
        request_id, model or "", text, ids, chat, max_tokens, float(temperature), top_k, float(top_p), float(min_p),
        float(repetition_penalty), float(frequency_penalty), float(presence_penalty), seed,
        (stop,) if isinstance(stop, str) else tuple(stop or ()), tuple(stop_ids or ()), ignore_eos, return_logits,
        logprobs, top_logprobs, {int(k): float(v) for k, v in (logit_bias or {}).items()},
    )


def _chat_message(m: Mapping[str, str] | ChatMessage) -> ChatMessage:
    return m if isinstance(m, ChatMessage) else ChatMessage(str(m["role"]), str(m["content"]))


def expect(reply: ServerMessage, kind: type[T]) -> T:
    """The reply if it is a `kind`; the mapped exception if it is an Error."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Error):
        raise error_from(reply)
    raise EmberError(f"unexpected reply {type(reply).__name__} (wanted {kind.__name__})")


def chunk_from(tokens: Tokens, reader: ShmRingReader) -> Chunk:
    logits = None
    if tokens.logits:
        views = [reader.view(slot) for slot in tokens.logits]
        logits = views[0] if len(views) == 1 else np.concatenate(views)
    top = None
    if tokens.top_logprobs is not None:
        top = [[(t.token, t.logprob) for t in alternatives] for alternatives in tokens.top_logprobs]
    return Chunk(list(tokens.token_ids), tokens.text, list(tokens.logprobs) if tokens.logprobs is not None else None,
                 top, logits)


def end_of_stream(reply: Finished | Error) -> Finished:
    """The Finished of a stream, or the exception that ends it instead."""
    if isinstance(reply, Error):
        raise error_from(reply)
    if reply.reason == FinishReason.ERROR:
        raise GenerationFailed(reply.message or "the generation failed")
    return reply
