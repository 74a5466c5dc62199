"""ember's logits and greedy tokens against Hugging Face transformers on tiny random models."""
from __future__ import annotations

import numpy as np
import pytest

import ember
from tiny_models import LLAMA3

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.oracle

ARCH_CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", LLAMA3),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
}


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("case", ARCH_CASES)
def test_logits_and_greedy_match_transformers(hf_model, case: str) -> None:
    arch, extra = ARCH_CASES[case]
    path, ref = hf_model(arch, **extra)
    model = ember.load(path)
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 33, 64):
        ids = rng.integers(1, model.config.vocab, n).tolist()
        expected = hf_logits(ref, ids)
        got = model.logits(ids)
        assert got.shape == expected.shape and got.dtype == np.float32
        span = expected.max() - expected.min()
        assert np.abs(got - expected).max() <= 1e-4 * span, f"{case}: {n} tokens"
    prompt = rng.integers(1, model.config.vocab, 9).tolist()
    assert list(model.generate(prompt, max_tokens=32, ignore_eos=True)) == hf_greedy(ref, prompt, 32)


def test_text_prompt_generation_matches_transformers(hf_model) -> None:
    path, ref = hf_model("qwen3")
    model = ember.load(path)
    ids = model.tokenize("def fibonacci(n):")
    assert list(model.generate("def fibonacci(n):", max_tokens=8, ignore_eos=True)) == hf_greedy(ref, ids, 8)
