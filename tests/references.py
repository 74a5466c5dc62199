"""The oracles' side of a comparison: transformers' logits and greedy tokens, a model's weights as
numpy, llama.cpp's logits. Each imports its oracle when called (a test without it skips alone), so a
test module that imports these never skips as a whole."""
from __future__ import annotations

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
