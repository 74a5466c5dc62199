"""The oracles' side of a comparison: transformers' logits and greedy tokens, a model's weights as
numpy, llama.cpp's logits and its CPU GELU. Each imports its oracle when called (a test without it skips alone), so a
test module that imports these never skips as a whole."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def hf_logits(model: Any, ids: list[int]) -> np.ndarray:
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def state_dict(model: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, type_k=0, type_v=0,
                          n_threads=2, verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float32)
    llm.close()
    return out


def ggml_gelu(x: np.ndarray) -> np.ndarray:
    """GELU as llama.cpp computes it on the CPU (ggml-cpu vec.h with GGML_GELU_FP16): the input rounded
    to float16, looked up in a table of float16 results (tanhf in float32), 0 at or below -10 and x at
    or above 10 — about 1e-3 of each value off the exact function."""
    x = np.asarray(x, np.float32)
    g = _ggml_gelu_table()[x.astype(np.float16).view(np.uint16)].astype(np.float32)
    return np.where(x <= -10, 0, np.where(x >= 10, x, g)).astype(np.float32)


@functools.cache
def _ggml_gelu_table() -> np.ndarray:
    f = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    with np.errstate(all="ignore"):  # inf and nan entries, as ggml's
        inner = np.float32(0.7978845608028654) * f * (np.float32(1) + np.float32(0.044715) * f * f)
        tanh = np.tanh(inner.astype(np.float64)).astype(np.float32)  # tanhf, correctly rounded
        return (np.float32(0.5) * f * (np.float32(1) + tanh)).astype(np.float16)
