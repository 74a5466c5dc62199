"""The fused decode layer (kernels/cpu/decoder_layer.py) computes what the ops compute one by one, bit
for bit: a decode row's logits must not depend on whether its step ran fused (every row a decode row)
or op by op (a step with prompt rows), in any weight type, KV dtype, architecture or kernel variant."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from ember.daemon.runner.kernel_cache import synthetic_model
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.cpu import twin
from ember.kernels.layer_stack import LayerStack
from ember.kernels.tensor_types import TensorType as T

INT8_TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
NEWER_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q2_K, T.Q3_K, T.IQ4_XS]


def decode_states(net, kv_dtype: str, steps: int = 3) -> list[np.ndarray]:
    """Two sequences read prompts (op by op: prompt rows), then decode `steps` tokens together: the
    last layer's output of each step (the residual stream keeps every last bit; logits come after
    the head's int8 quantization of the activations, which hides most of them)."""
    cache = net.new_cache(8, 16, kv_dtype)
    prompts = ([1, 2, 3, 4, 5], [6, 7, 8])
    tables = ([0, 1], [2, 3])
    net.forward(StepBatch.build([(p, 0, t) for p, t in zip(prompts, tables)], 16), cache)
    out, tokens = [], [9, 10]
    for k in range(steps):
        chunks = [([tok], len(p) + k, t) for tok, p, t in zip(tokens, prompts, tables)]
        batch = StepBatch.build(chunks, 16, prompt_lengths=[len(p) for p in prompts])
        hidden = net.run_layers(net.embed_tokens(batch), batch, cache)
        out.append(np.array(hidden))
        logits = net.head(hidden, batch)
        tokens = [int(t) % 64 for t in np.argmax(logits, axis=1)]
    return out


def without_fusion(net):  # type: ignore[no-untyped-def]
    """Every layer op by op: the stack of a backend without compiled layers."""
    fused = net.stack.fused
    net.stack = LayerStack(net.ops, net.stack.layers, [None] * len(fused))
    return fused


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "laguna"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "bf16", "q8_0"])
def test_fused_decode_steps_equal_the_ops(arch: str, kv_dtype: str) -> None:
    """laguna: an output gate (by head and by element), a sliding window the decode steps pass,
    layers with different head counts."""
    net = synthetic_model(INT8_TYPES, arch)
    assert all(f is not None for f in net.stack.fused)
    fused = decode_states(net, kv_dtype)
    without_fusion(net)
    for a, b in zip(fused, decode_states(net, kv_dtype), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_fused_decode_steps_equal_the_ops_on_the_newer_block_types(kv_dtype: str) -> None:
    """A layer each of Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K and IQ4_XS."""
    net = synthetic_model(NEWER_TYPES)
    assert all(f is not None for f in net.stack.fused)
    fused = decode_states(net, kv_dtype)
    without_fusion(net)
    for a, b in zip(fused, decode_states(net, kv_dtype), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_a_decode_step_runs_every_fused_layer_in_one_backend_call(kv_dtype: str, monkeypatch) -> None:
    """A model whose layers are all fused with their FFNs hands a decode step's layers to the backend
    at once (no Python between them); what they compute is what each layer's own fused call does."""
    from ember.kernels.cpu import backend, decoder_layer

    net = synthetic_model(INT8_TYPES)
    assert isinstance(net.ops, backend.CpuOps)
    assert net.stack.whole is not None and len(net.stack.whole) == len(net.blocks)
    stacks, single = [], []
    stack, run = decoder_layer.run_stack, decoder_layer.run
    monkeypatch.setattr(decoder_layer, "run_stack", lambda layers, *a: stacks.append(len(layers)) or stack(layers, *a))
    monkeypatch.setattr(decoder_layer, "run", lambda *a: single.append(1) or run(*a))
    whole = decode_states(net, kv_dtype)
    assert stacks == [len(net.blocks)] * 3 and not single  # three decode steps, each one call
    net.stack.whole = None  # each layer's own fused call
    for a, b in zip(whole, decode_states(net, kv_dtype), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(single) == 3 * len(net.blocks)


@pytest.mark.parametrize("arch", ["qwen3", "laguna"])
@pytest.mark.parametrize("variant", ["serial", "parallel"])
def test_fused_steps_equal_the_ops_in_each_kernel_variant(variant: str, arch: str, monkeypatch) -> None:
    net = synthetic_model(INT8_TYPES, arch)
    monkeypatch.setattr(twin, "FORCE", variant)
    fused = decode_states(net, "f32")
    without_fusion(net)
    for a, b in zip(fused, decode_states(net, "f32"), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch", ["qwen3", "laguna"])
@pytest.mark.parametrize("members", [1, 2, 3])
def test_the_thread_team_computes_what_the_ops_do_with_any_number_of_members(members: int, arch: str,
                                                                            monkeypatch) -> None:
    """The layer on its thread team (one parallel region, kernels/cpu/team.py) with as many members
    as threads, fewer, or more than numba has (members then share a thread)."""
    from ember.kernels.cpu import decoder_layer

    team, runs = decoder_layer._layer_team, []
    monkeypatch.setattr(decoder_layer, "_layer_team", lambda threads, *args: runs.append(threads) or team(threads, *args))
    monkeypatch.setattr(twin, "FORCE", "parallel")
    monkeypatch.setattr(twin, "threads", lambda: members)
    net = synthetic_model(INT8_TYPES, arch)
    fused = decode_states(net, "f32")
    assert runs and set(runs) == {members}
    without_fusion(net)
    for a, b in zip(fused, decode_states(net, "f32"), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_decode_row_beside_a_prompt_chunk_runs_op_by_op_and_equals_it_alone() -> None:
    """The step's rows decide: with a prompt chunk beside it the decode row runs op by op, alone it
    runs fused, and its hidden state is the same."""
    net = synthetic_model(INT8_TYPES)
    hidden = []
    for company in ([], [([11, 12, 13], 0, [2])]):
        cache = net.new_cache(4, 16, "f32")
        net.forward(StepBatch.build([([1, 2, 3, 4, 5], 0, [0, 1])], 16), cache)
        step = StepBatch.build([([9], 5, [0, 1]), *company], 16, prompt_lengths=[5] + [3] * len(company))
        hidden.append(np.array(net.run_layers(net.embed_tokens(step), step, cache)[0]))
    np.testing.assert_array_equal(hidden[0], hidden[1])


def test_layers_without_integer_kernels_are_not_fused() -> None:
    net = synthetic_model([T.Q8_0, T.F16, T.BF16, T.F32])
    assert [f is not None for f in net.stack.fused] == [True, False, False, False]


@pytest.mark.slow
def test_a_fresh_process_can_start_with_a_fused_step() -> None:
    """The fused functions loaded from numba's cache call parallel kernels; a process whose first
    kernel was one of them crashed until the module started the thread pool itself."""
    code = ("import numpy as np\n"
            "from ember.daemon.runner.kernel_cache import synthetic_model\n"
            "from ember.daemon.step.step_batch import StepBatch\n"
            "from ember.kernels.cpu import twin\n"
            "net = synthetic_model([8, 8])\n"  # Q8_0 layers
            "batch = StepBatch.build([([3], 0, [0])], 16, prompt_lengths=[0])\n"
            "twin.FORCE = 'serial'\n"  # no parallel kernel before the fused step
            "x = net.embed_tokens(batch)\n"
            "twin.FORCE = 'parallel'\n"
            "print(np.isfinite(net.run_layers(x, batch, net.new_cache(1, 16))).all())\n")
    for _ in range(2):  # the second process loads what the first compiled
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_a_block_that_sees_past_its_positions_runs_fused_as_op_by_op() -> None:
    """StepBatch.attn_end (a DFlash noise block: every token sees the whole block) reaches the fused
    attention as it reaches paged_attention."""
    net = synthetic_model(INT8_TYPES)
    hidden = []
    for fused in (True, False):
        if not fused:
            without_fusion(net)
        cache = net.new_cache(4, 16, "f32")
        net.forward(StepBatch.build([([1, 2, 3, 4, 5], 0, [0, 1])], 16), cache)
        step = StepBatch.build([([9, 10, 11], 5, [0, 1])], 16, prompt_lengths=[5], logit_tails=[3])
        step = replace(step, attn_end=np.full(3, 7, np.int64))
        hidden.append(np.array(net.run_layers(net.embed_tokens(step), step, cache)))
    np.testing.assert_array_equal(hidden[0], hidden[1])
