"""The in-process API: `load(path, device)` -> Model, with tokenize, detokenize, logits and generate.

This is what the daemon's engine drives and what library users call directly.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ember.daemon.model_file import ModelFile, open_model_file
from ember.daemon.model_file_error import ModelFileError
from ember.daemon.models.transformer import Transformer
from ember.daemon.tokenizer import Tokenizer, TokenizerError
from ember.kernels import get_ops
from ember.kernels.sampling import SamplingParams, sample

__all__ = ["Model", "ModelFileError", "load"]

PREFILL_CHUNK = 256  # tokens per forward pass while reading a prompt: bounds activation memory


class Model:
    def __init__(self, mf: ModelFile, tokenizer: Tokenizer, device: str) -> None:
        self.path = mf.path
        self.config = mf.config
        self.tokenizer = tokenizer
        self.device = device
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

    # --- the model ------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits of every position, float32 [len(token_ids), vocab]."""
        ids = self._check_ids(token_ids)
        cache = self._net.new_cache(len(ids))
        chunks = [self._net.forward(ids[s : s + PREFILL_CHUNK], cache, s, all_logits=True) for s in range(0, len(ids), PREFILL_CHUNK)]
        return np.concatenate([self._net.ops.to_numpy(c) for c in chunks])

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
        cache = self._net.new_cache(capacity)
        if not ignore_eos:
            stop |= self.tokenizer.eos_ids
        pos = 0
        for pos in range(0, len(ids), PREFILL_CHUNK):
            logits = self._net.forward(ids[pos : pos + PREFILL_CHUNK], cache, pos)
        pos, prompt, generated = len(ids), ids.tolist(), []
        for _ in range(max_tokens):
            if pos >= capacity:
                return
            token = sample(self._net.ops.to_numpy(logits)[0], params, rng, prompt, generated).token
            generated.append(token)
            yield token
            if token in stop or pos + 1 >= capacity:
                return
            logits = self._net.forward(np.array([token]), cache, pos)
            pos += 1

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens: the prompt is empty")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab})")
        if ids.size > self.config.context_length:
            raise ValueError(f"prompt of {ids.size} tokens exceeds the context length {self.config.context_length}")
        return ids


def load(path: str | Path, device: str = "cpu") -> Model:
    """Open a GGUF file or Hugging Face directory and place the model on `device` ("cpu")."""
    mf = open_model_file(path)
    try:
        tokenizer = Tokenizer.from_gguf(mf.metadata) if mf.format == "gguf" else Tokenizer.from_hf_dir(mf.path)
    except TokenizerError as e:
        raise ModelFileError(str(mf.path), str(e)) from None
    return Model(mf, tokenizer, device)
