"""Gemma 4's fused decode layer (kernels/cpu/sandwich_layer.py), alone and as a stack in one call
(kernels/cpu/sandwich_stack.py), computes what the ops compute one by one, bit for bit: sliding layers (through their rings, past the window and round the ring), full
layers with values from the keys' projection, KV-shared layers, per-layer inputs and layer scalars,
in every integer weight type, KV dtype and kernel variant."""
from __future__ import annotations

import numpy as np
import pytest

from ember.daemon.runner.kernel_cache import synthetic_gemma4
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.cpu import sandwich_layer, sandwich_stack, twin
from ember.kernels.layer_stack import LayerStack
from ember.kernels.tensor_types import TensorType as T
from test_decoder_layer import INT8_TYPES, NEWER_TYPES

PROMPTS, TABLES, BLOCK = ([1, 2, 3, 4, 5], [6, 7, 8]), ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]), 4


def decode_states(net, kv_dtype: str, steps: int = 12) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """Two sequences read their prompts (op by op: prompt rows), then decode `steps` tokens together:
    each step's last layer output. The sliding layers keep rings of 2 blocks of 4 positions (the
    window is 3 keys, a step 5 positions at most), which the decode steps go round."""
    cache = net.new_cache(32, BLOCK, kv_dtype, max_sequences=4, step_tokens=5)
    assert cache.ring == 2
    batch = StepBatch.build([(p, 0, t) for p, t in zip(PROMPTS, TABLES)], BLOCK)
    batch = net.prepared(batch, cache)
    net.run_layers(net.embed_tokens(batch), batch, cache)
    out, tokens = [], [9, 10]
    for k in range(steps):
        chunks = [([tok], len(p) + k, t) for tok, p, t in zip(tokens, PROMPTS, TABLES)]
        batch = net.prepared(StepBatch.build(chunks, BLOCK, prompt_lengths=[len(p) for p in PROMPTS]), cache)
        hidden = net.run_layers(net.embed_tokens(batch), batch, cache)
        out.append(np.array(hidden))
        tokens = [int(t) % 64 for t in np.argmax(net.head(hidden, batch), axis=1)]
    return out


def fused_and_ops(net, kv_dtype: str, monkeypatch, whole: bool = True  # type: ignore[no-untyped-def]
                  ) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """The decode states with the fused layers (in one call for the stack, or one a layer where not
    `whole`), then op by op, and how many layer runs were fused."""
    runs = []
    run, run_stack = sandwich_layer.run, sandwich_stack.run_stack

    def counted(*args):  # type: ignore[no-untyped-def]
        out = run(*args)
        runs.append(out is not None)
        return out

    def counted_stack(fused, *args):  # type: ignore[no-untyped-def]
        out = run_stack(fused, *args)
        runs.extend([out is not None] * len(fused))
        return out

    monkeypatch.setattr(sandwich_layer, "run", counted)
    monkeypatch.setattr(sandwich_stack, "run_stack", counted_stack)
    if not whole:
        net.stack.whole = None
    fused = decode_states(net, kv_dtype)
    net.stack = LayerStack(net.ops, net.stack.layers, [None] * len(net.stack.layers))
    return fused, decode_states(net, kv_dtype), sum(runs)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("shared, per_layer_input", [(0, False), (2, True)])
@pytest.mark.parametrize("whole", [True, False])
def test_fused_decode_steps_equal_the_ops(kv_dtype: str, shared: int, per_layer_input: bool, whole: bool,
                                          monkeypatch) -> None:
    """Every layer fused, each decode step's every layer run so, the stack in one call
    (sandwich_stack.run_stack) or a call a layer, the same bits as op by op."""
    net = synthetic_gemma4(INT8_TYPES, shared, per_layer_input)
    assert all(f is not None for f in net.stack.fused)
    fused, ops, runs = fused_and_ops(net, kv_dtype, monkeypatch, whole)
    assert runs == 12 * len(INT8_TYPES)
    for a, b in zip(fused, ops, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("variant", ["serial", "parallel"])
def test_fused_steps_equal_the_ops_in_each_kernel_variant(variant: str, monkeypatch) -> None:
    monkeypatch.setattr(twin, "FORCE", variant)
    fused, ops, runs = fused_and_ops(synthetic_gemma4(INT8_TYPES, 2, True), "f16", monkeypatch)
    assert runs == 12 * len(INT8_TYPES)
    for a, b in zip(fused, ops, strict=True):
        np.testing.assert_array_equal(a, b)


def test_fused_steps_equal_the_ops_on_the_newer_block_types(monkeypatch) -> None:
    fused, ops, runs = fused_and_ops(synthetic_gemma4(NEWER_TYPES, 3, True), "bf16", monkeypatch)
    assert runs == 12 * len(NEWER_TYPES)
    for a, b in zip(fused, ops, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_fused_layer_is_not_the_identity(monkeypatch) -> None:
    """The comparison above can fail: a fused layer that drops its per-layer input differs."""
    net = synthetic_gemma4(INT8_TYPES, 0, True)
    layer = net.stack.fused[1]
    ffn = list(layer.ffn)
    ffn[10] = np.int64(-1)  # its per-layer input's column: none
    fused = list(net.stack.fused)
    fused[1] = sandwich_layer.SandwichLayer(layer.attn, tuple(ffn), layer.window, False)
    net.stack = LayerStack(net.ops, net.stack.layers, fused)
    fused, ops, _ = fused_and_ops(net, "f32", monkeypatch)
    assert not np.array_equal(fused[0], ops[0])


def test_layers_without_integer_kernels_are_not_fused() -> None:
    net = synthetic_gemma4([T.Q8_0, T.F16, T.Q4_K])
    assert [f is not None for f in net.stack.fused] == [True, False, True]
