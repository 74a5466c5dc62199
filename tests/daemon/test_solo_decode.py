"""SoloDecode computes what Model.generate computes, one forward pass per step."""
from __future__ import annotations

import numpy as np
import pytest

from ember.daemon.solo_decode import SoloDecode
from ember.kernels.sampling import SamplingParams

PROMPT = "def fibonacci(n):"


def run(decode: SoloDecode) -> tuple[list[int], list[np.ndarray], int]:
    tokens, logits, steps = [], [], 0
    while not decode.done:
        steps += 1
        step = decode.step()
        if step is not None:
            tokens.append(step.token)
            logits.append(step.logits.copy())
    return tokens, logits, steps


@pytest.mark.parametrize("options, seed", [
    ({}, None),
    ({"temperature": 0.9, "top_p": 0.9}, 7),
    ({"temperature": 1.3, "top_k": 30, "repetition_penalty": 1.3, "frequency_penalty": 0.5}, 3),
])
def test_same_tokens_as_model_generate(demo_model, options, seed) -> None:  # type: ignore[no-untyped-def]
    ids = demo_model.tokenize(PROMPT)
    expected = list(demo_model.generate(ids, max_tokens=40, seed=seed, **options))
    tokens, _, steps = run(SoloDecode(demo_model, ids, 40, SamplingParams(**options), seed))
    assert tokens == expected
    assert steps == len(tokens)  # a short prompt is one chunk: every step yields a token


def test_logits_are_the_models_logits_of_the_same_tokens(demo_model) -> None:  # type: ignore[no-untyped-def]
    ids = demo_model.tokenize(PROMPT)
    tokens, logits, _ = run(SoloDecode(demo_model, ids, 12, SamplingParams()))
    reference = demo_model.logits(ids + tokens[:-1])[len(ids) - 1 :]
    # one token at a time vs the whole sequence at once: the same math, summed in another order
    np.testing.assert_allclose(np.stack(logits), reference, rtol=0, atol=1e-4)
    assert [int(np.argmax(row)) for row in logits] == tokens  # greedy


def test_long_prompt_is_read_in_chunks_one_per_step(demo_model) -> None:  # type: ignore[no-untyped-def]
    ids = demo_model.tokenize("x = 1\n" * 200)
    assert len(ids) > 512
    decode = SoloDecode(demo_model, ids, 3, SamplingParams())
    firsts = [decode.step() for _ in range(-(-len(ids) // 256) - 1)]
    assert firsts == [None] * len(firsts) and decode.prefilling
    tokens, _, _ = run(decode)
    assert tokens == list(demo_model.generate(ids, max_tokens=3))


def test_no_room_means_no_token_and_no_work(demo_model) -> None:  # type: ignore[no-untyped-def]
    decode = SoloDecode(demo_model, [1, 2, 3], 0, SamplingParams())
    assert decode.done and decode.finish == "length"
    full = SoloDecode(demo_model, [1] * demo_model.config.context_length, 5, SamplingParams())
    assert full.done and full.finish == "length"


def test_finish_reasons_and_close(demo_model) -> None:  # type: ignore[no-untyped-def]
    ids = demo_model.tokenize(PROMPT)
    first = list(demo_model.generate(ids, max_tokens=3))
    stop = SoloDecode(demo_model, ids, 10, SamplingParams(), stop_ids=[first[1]])
    tokens, _, _ = run(stop)
    assert tokens == first[:2] and stop.finish == "stop"
    cancelled = SoloDecode(demo_model, ids, 10, SamplingParams())
    cancelled.step()
    cancelled.close()
    assert cancelled.done and cancelled.finish == "cancelled" and cancelled._cache is None
    with pytest.raises(RuntimeError):
        cancelled.step()
