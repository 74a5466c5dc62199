"""The in-process API: `load(path, device)` -> Model, with tokenize, detokenize, logits and generate.

This is what the daemon's engine drives and what library users call directly.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.daemon.loader.model_file import ModelFile, open_model_file
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.text.chat_template import ChatTemplate, ChatTemplateError
from ember.daemon.runner.kernel_cache import ensure_kernel_cache
from ember.daemon.runner.kv_cache import PagedKVCache
from ember.daemon.models.transformer import Transformer
from ember.daemon.runner.step_batch import StepBatch
from ember.daemon.text.tokenizer import Tokenizer, TokenizerError
from ember.kernels import get_ops
from ember.kernels.cpu.paged_attention import KV_DTYPES
from ember.kernels.sampling import SamplingParams, sample

__all__ = ["Model", "ModelFileError", "load"]

PREFILL_CHUNK = 256  # tokens per forward pass while reading a prompt: bounds activation memory
KV_BLOCK = 16  # tokens per KV cache block


class Model:
    def __init__(self, mf: ModelFile, tokenizer: Tokenizer, device: str, kv_dtype: str = "f32") -> None:
        self.path = mf.path
        self.config = mf.config
        self.tokenizer = tokenizer
        self.device = device
        self.kv_dtype = kv_dtype
        self._chat: ChatTemplate | None = None
        self.file_bytes = mf.file_bytes
        self._net = Transformer(mf, get_ops(device))

    def __repr__(self) -> str:
        c = self.config
        return f"Model({str(self.path)!r}, arch={c.arch}, layers={c.n_layers}, hidden={c.hidden}, device={self.device})"

    # --- text <-> tokens ------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for chat `messages`, by the model's own chat template."""
        if self._chat is None:
            source = self.tokenizer.chat_template
            if source is None:
                raise ChatTemplateError(f"{self.path}: the model has no chat template")
            t = self.tokenizer
            name = lambda i: "" if i is None else t.decode([i])  # noqa: E731
            self._chat = ChatTemplate(source, name(t.bos_id), name(t.eos_id))
        return self._chat.render(messages, add_generation_prompt)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of the rendered chat (the template writes BOS itself where the model wants it)."""
        return self.tokenizer.encode(self.render_chat(messages), add_special=False)

    # --- the model ------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits of every position, float32 [len(token_ids), vocab]."""
        ids = self._check_ids(token_ids)
        cache, table = self._private_cache(len(ids))
        chunks = [self._step(ids[s : s + PREFILL_CHUNK], s, table, cache, all_logits=True)
                  for s in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate(chunks)

    @property
    def net(self) -> Transformer:
        """The model itself, for the engine, which runs batches of many sequences through it."""
        return self._net

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        **sampling: Any,
    ) -> Iterator[int]:
        """Yield generated token ids one at a time, as they are produced.

        Stops after max_tokens, at an end-of-sequence token (which is yielded) unless ignore_eos, at
        any of stop_ids (also yielded), or when the context is full. Other keyword arguments are
        SamplingParams fields (top_k, top_p, min_p, repetition_penalty, frequency_penalty,
        presence_penalty, logit_bias, ...); see kernels/sampling.py for their order.
        """
        params = SamplingParams(temperature=temperature, **sampling)  # validates before any work
        params.check_vocab(self.config.vocab)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self._check_ids(self.tokenize(prompt) if isinstance(prompt, str) else prompt)
        return self._generate(ids, max_tokens, params, np.random.default_rng(seed), set(stop_ids), ignore_eos)

    def _generate(self, ids: np.ndarray, max_tokens: int, params: SamplingParams, rng: np.random.Generator,
                  stop: set[int], ignore_eos: bool) -> Iterator[int]:
        capacity = min(len(ids) + max_tokens, self.config.context_length)
        cache, table = self._private_cache(capacity)
        if not ignore_eos:
            stop |= self.tokenizer.eos_ids
        for pos in range(0, len(ids), PREFILL_CHUNK):
            logits = self._step(ids[pos : pos + PREFILL_CHUNK], pos, table, cache)
        pos, prompt, generated = len(ids), ids.tolist(), []
        for _ in range(max_tokens):
            if pos >= capacity:
                return
            token = sample(logits[0], params, rng, prompt, generated).token
            generated.append(token)
            yield token
            if token in stop or pos + 1 >= capacity:
                return
            logits = self._step([token], pos, table, cache)
            pos += 1

    def _private_cache(self, capacity: int) -> tuple[PagedKVCache, list[int]]:
        """A KV cache for one sequence of `capacity` tokens, and its block table (all of it)."""
        n_blocks = -(-capacity // KV_BLOCK)
        return self._net.new_cache(n_blocks, KV_BLOCK, self.kv_dtype), list(range(n_blocks))

    def _step(self, tokens: Sequence[int], start: int, table: list[int], cache: PagedKVCache,
              all_logits: bool = False) -> np.ndarray:
        batch = StepBatch.build([(tokens, start, table)], KV_BLOCK, all_logits)
        return self._net.ops.to_numpy(self._net.forward(batch, cache))

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens: the prompt is empty")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab})")
        if ids.size > self.config.context_length:
            raise ValueError(f"prompt of {ids.size} tokens exceeds the context length {self.config.context_length}")
        return ids


def load(path: str | Path, device: str = "cpu", kv_dtype: str = "f32") -> Model:
    """Open a GGUF file or Hugging Face directory and place the model on `device` ("cpu"); its KV
    cache holds `kv_dtype` (f32, f16, bf16 or q8_0)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
    mf = open_model_file(path)
    if device == "cpu":
        ensure_kernel_cache()
    try:
        tokenizer = Tokenizer.from_gguf(mf.metadata) if mf.format == "gguf" else Tokenizer.from_hf_dir(mf.path)
    except TokenizerError as e:
        raise ModelFileError(str(mf.path), str(e)) from None
    return Model(mf, tokenizer, device, kv_dtype)
