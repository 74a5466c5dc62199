"""Gemma 4's greedy decode burst in one compiled call (kernels/cpu/sandwich_stack.py) computes what the
per-step path computes, bit for bit: every step's tokens and the K/V it leaves, with sliding layers
going round their rings, KV-shared layers, per-layer inputs and the soft-capped head, in every
kernel variant; the model's bursts run through it, and it declines what it would compute otherwise."""
from __future__ import annotations

import numpy as np
import pytest

from ember.daemon.runner.kernel_cache import synthetic_gemma4
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.cpu import sandwich_stack, twin
from ember.kernels.tensor_types import TensorType as T
from test_decoder_layer import INT8_TYPES, NEWER_TYPES
from test_greedy_decode import restore, snapshot

PROMPTS = ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
TABLES = tuple(list(range(8 * i, 8 * i + 8)) for i in range(3))
BLOCK, STEPS = 4, 14  # rings of 2 blocks of 4 positions (a 3-key window, 5-position steps): gone round


def first_decode_step(net, kv_dtype: str):  # type: ignore[no-untyped-def]
    cache = net.new_cache(40, BLOCK, kv_dtype, max_sequences=4, step_tokens=5)
    assert cache.ring == 2
    for start in range(0, max(map(len, PROMPTS)), 5):  # the prompts in chunks of at most a step's 5 positions
        chunks = [(p[start:start + 5], start, t) for p, t in zip(PROMPTS, TABLES, strict=True) if p[start:]]
        net.forward(StepBatch.build(chunks, BLOCK, state_slots=[i for i, p in enumerate(PROMPTS) if p[start:]]),
                    cache)
    chunks = [([11 + i], len(p), t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))]
    return cache, StepBatch.build(chunks, BLOCK, prompt_lengths=[len(p) for p in PROMPTS])


def step_by_step(net, cache, batch: StepBatch, stops: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    ids, done, tokens = batch.ids.copy(), np.zeros(len(batch.ids), bool), []
    for step in range(STEPS):
        if step:
            batch = batch.following(ids, BLOCK)
        best = np.argmax(np.array(net.forward(batch, cache)), axis=1)
        tokens.append(best)
        ids = np.where(done, ids, best)
        done |= [b in row for b, row in zip(best, stops, strict=True)]
        if done.all():
            break
    return np.array(tokens)


def assert_bursts_equal_steps(net, kv_dtype: str = "f16") -> None:  # type: ignore[no-untyped-def]
    cache, batch = first_decode_step(net, kv_dtype)
    saved = snapshot(cache)
    free = step_by_step(net, cache, batch, np.full((3, 1), -1))
    stops = np.array([[free[9, 0], -1], [-1, free[3, 1]], [-1, -1]])  # rows 0 and 1 stop inside the burst
    for stop_table in (np.full((3, 1), -1), stops):
        restore(cache, saved)
        want = step_by_step(net, cache, batch, stop_table)
        after = snapshot(cache)
        restore(cache, saved)
        got = net.greedy_steps(batch, cache, STEPS, stop_table)
        assert got is not None, "the model's burst declined"
        np.testing.assert_array_equal(got, want)
        for a, b in zip(snapshot(cache), after, strict=True):  # the same K/V, rings included
            np.testing.assert_array_equal(a, b)
    assert len(set(free[:, 2].tolist())) > 1, "a burst of one repeated token proves little"


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("shared, per_layer_input", [(0, False), (2, True)])
def test_a_greedy_burst_equals_single_steps(variant: str, shared: int, per_layer_input: bool, monkeypatch) -> None:
    monkeypatch.setattr(twin, "FORCE", variant)
    runs = []
    burst = sandwich_stack.burst
    monkeypatch.setattr(sandwich_stack, "burst", lambda *a: runs.append(1) or burst(*a))
    assert_bursts_equal_steps(synthetic_gemma4(INT8_TYPES, shared, per_layer_input))
    assert len(runs) == 2


@pytest.mark.parametrize("kv_dtype", ["f32", "bf16", "q8_0"])
def test_a_greedy_burst_on_other_types_equals_single_steps(kv_dtype: str) -> None:
    assert_bursts_equal_steps(synthetic_gemma4(NEWER_TYPES[:6], 2, True), kv_dtype)


def test_a_burst_without_rings_equals_single_steps() -> None:
    net = synthetic_gemma4(INT8_TYPES, 1, True)
    cache = net.new_cache(40, BLOCK, "f16")  # no step size given: every layer paged over all positions
    assert cache.ring == 0
    net.forward(StepBatch.build([([1, 2, 3], 0, [0, 1, 2, 3, 4, 5])], BLOCK), cache)
    batch = StepBatch.build([([4], 3, [0, 1, 2, 3, 4, 5])], BLOCK, prompt_lengths=[3])
    saved = snapshot(cache)
    want = step_by_step(net, cache, batch, np.full((1, 1), -1))
    restore(cache, saved)
    np.testing.assert_array_equal(net.greedy_steps(batch, cache, STEPS, np.full((1, 1), -1)), want)


def test_steps_the_burst_would_compute_otherwise_are_declined() -> None:
    """A layer without integer kernels (it runs op by op)."""
    net = synthetic_gemma4([T.Q8_0, T.F16, T.Q4_K])
    cache, batch = first_decode_step(net, "f16")
    assert net.greedy_steps(batch, cache, 2, np.full((3, 1), -1)) is None
