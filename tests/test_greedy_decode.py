"""A greedy decode burst in one compiled call (kernels/cpu/greedy_decode.py) computes what the per-step
path computes, bit for bit: every step's logits, over every integer weight type, architecture and
kernel variant, for sequences at different positions and a stop id inside the burst; it declines the
steps it would not compute the same way; and the engine's greedy bursts run through it."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.model_file import open_model_file
from ember.daemon.models.transformer import Transformer
from ember.daemon.runner.kernel_cache import synthetic_model
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.step.step_batch import StepBatch
from ember.kernels import get_ops
from ember.kernels.cpu import greedy_decode, twin
from ember.kernels.cpu.quant_matmul import pack
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.sampling import SamplingParams
from ember.kernels.tensor_types import TensorType as T
from tiny_models import FIXTURES

INT8_TYPES = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
NEWER_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.Q2_K, T.Q3_K, T.IQ4_XS]
PROMPTS = ([1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25])
TABLES = ([0, 1], [2, 3], [4, 5])
STEPS = 6


def first_decode_step(net: Transformer, kv_dtype: str = "f32") -> tuple[object, StepBatch]:
    """A cache holding three prompts (read op by op), and the decode step of their first generated tokens."""
    cache = net.new_cache(8, 16, kv_dtype)
    net.forward(StepBatch.build([(p, 0, t) for p, t in zip(PROMPTS, TABLES, strict=True)], 16), cache)
    chunks = [([11 + i], len(p), t) for i, (p, t) in enumerate(zip(PROMPTS, TABLES, strict=True))]
    return cache, StepBatch.build(chunks, 16, prompt_lengths=[len(p) for p in PROMPTS])


def step_by_step(net: Transformer, cache, batch: StepBatch, stops: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:  # type: ignore[no-untyped-def]
    """What a burst's Python loop does (executor/burst.py): forward, argmax, the next step from the tokens
    (a row that met a stop id keeps it as its input)."""
    ids, done, tokens, logits = batch.ids.copy(), np.zeros(len(batch.ids), bool), [], []
    for step in range(STEPS):
        if step:
            batch = batch.following(ids, 16)
        out = np.array(net.forward(batch, cache))
        best = np.argmax(out, axis=1)
        tokens.append(best)
        logits.append(out)
        ids = np.where(done, ids, best)
        done |= [b in row for b, row in zip(best, stops, strict=True)]
        if done.all():
            break
    return np.array(tokens), logits


def snapshot(cache):  # type: ignore[no-untyped-def]
    return [a.copy() for s in (*cache.k, *cache.v) for a in (s.f32, s.u16, s.i8, s.scales)]


def restore(cache, saved) -> None:  # type: ignore[no-untyped-def]
    arrays = [a for s in (*cache.k, *cache.v) for a in (s.f32, s.u16, s.i8, s.scales)]
    for array, data in zip(arrays, saved, strict=True):
        array[...] = data


def assert_bursts_equal_steps(net: Transformer, kv_dtype: str = "f32") -> None:
    cache, batch = first_decode_step(net, kv_dtype)
    saved = snapshot(cache)
    free, _ = step_by_step(net, cache, batch, np.full((3, 1), -1))
    # row 1 stops at its third token, row 0 at its fifth, row 2 runs on: the burst ends with the steps
    stops = np.array([[free[4, 0], -1], [-1, free[2, 1]], [-1, -1]])
    counts = net.experts.stats.counts if net.experts is not None else np.zeros(0)  # a MoE model's routing
    start = counts.copy()
    for stop_table in (np.full((3, 1), -1), stops):
        restore(cache, saved)
        counts[:] = start
        want, want_logits = step_by_step(net, cache, batch, stop_table)
        want_counts = counts.copy()
        restore(cache, saved)
        counts[:] = start
        routed = net.stack.routed_now()
        plan = greedy_decode.plan(net.stack.whole, net.embed, net.norm, net.config.norm_eps, net.output, cache.k, cache.v,
                                  routed)
        logits = np.zeros((STEPS, 3, net.config.vocab), np.float32)
        got = greedy_decode.burst(plan, STEPS, batch.ids, batch.positions, batch.kv_blocks, batch.kv_offsets,
                                  batch.tables, batch.token_seq, 16, stop_table, logits)
        np.testing.assert_array_equal(got, want)
        for step, expected in enumerate(want_logits):
            np.testing.assert_array_equal(logits[step], expected)  # bit for bit
        np.testing.assert_array_equal(counts, want_counts)  # the routing recorded as single steps record it


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "laguna"])
def test_a_greedy_burst_equals_single_steps(arch: str, variant: str, monkeypatch) -> None:
    monkeypatch.setattr(twin, "FORCE", variant)
    net = synthetic_model(INT8_TYPES, arch)
    assert net.stack.whole is not None
    assert_bursts_equal_steps(net)


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("model", ["qwen3moe", "laguna"])
def test_a_greedy_burst_of_a_moe_model_equals_single_steps(model: str, variant: str, monkeypatch, tmp_path) -> None:
    """The trained MoE demo and the tiny Laguna in Q8_0 (its shared experts), every expert hot: each
    MoE layer's router, routing and experts inside the burst (expert_ffn.routed_finish), its routing
    statistics as single steps leave them."""
    from test_expert_ffn import requantized_laguna

    monkeypatch.setattr(twin, "FORCE", variant)
    net = ember.load(FIXTURES / "ember-demo-moe-q8_0.gguf").net if model == "qwen3moe" else requantized_laguna(tmp_path)
    assert net.stack.whole is not None and net.stack.routed_now() is not None
    assert_bursts_equal_steps(net)


@pytest.mark.parametrize("variant", ["serial", "parallel"])
def test_a_greedy_burst_on_the_newer_block_types_equals_single_steps(variant: str, monkeypatch) -> None:
    monkeypatch.setattr(twin, "FORCE", variant)
    net = synthetic_model(NEWER_TYPES)
    assert net.stack.whole is not None
    assert_bursts_equal_steps(net)


@pytest.mark.parametrize("variant", ["serial", "parallel"])
@pytest.mark.parametrize("kv_dtype", ["f16", "bf16", "q8_0"])
def test_a_greedy_burst_over_a_converting_kv_cache_equals_single_steps(kv_dtype: str, variant: str,
                                                                       monkeypatch) -> None:
    """The burst stores f16, bf16 and q8_0 rows in compiled code, as the per-step path's fused layers do."""
    monkeypatch.setattr(twin, "FORCE", variant)
    assert_bursts_equal_steps(synthetic_model(INT8_TYPES), kv_dtype)
    assert_bursts_equal_steps(Transformer(open_model_file(DEMO_MODEL), get_ops("cpu")), kv_dtype)


def test_an_f32_embedding_takes_the_same_compiled_burst() -> None:
    net = synthetic_model(INT8_TYPES)
    rows = np.random.default_rng(2).standard_normal((net.config.vocab, net.config.hidden)).astype(np.float32)
    net.embed = pack(RawTensor("token_embd.weight", T.F32, rows.shape, rows))  # the output projection stays Q8_0
    assert_bursts_equal_steps(net)
    assert len(greedy_decode._burst.signatures) == 1  # the quantized embeddings' signature: in the kernel cache


def test_a_greedy_burst_of_the_trained_demo_model_equals_single_steps() -> None:
    net = Transformer(open_model_file(DEMO_MODEL), get_ops("cpu"))
    assert_bursts_equal_steps(net)


def test_steps_the_burst_would_compute_otherwise_are_declined() -> None:
    net = synthetic_model(INT8_TYPES)
    none = np.full((3, 1), -1)
    cache, batch = first_decode_step(net)
    prompt_rows = StepBatch.build([([11], len(PROMPTS[0]), TABLES[0])], 16)  # no prompt lengths: not decode rows
    assert net.greedy_steps(prompt_rows, cache, 2, none[:1]) is None
    some_logits = StepBatch.build([([11], 5, TABLES[0]), ([12], 3, TABLES[1])], 16, prompt_lengths=[5, 3],
                                  wants_logits=[False, True])
    assert net.greedy_steps(some_logits, cache, 2, none[:2]) is None
    assert net.greedy_steps(batch, cache, 2, none) is not None
    head = np.random.default_rng(1).standard_normal((net.config.vocab, net.config.hidden)).astype(np.float16)
    net.output = pack(RawTensor("output.weight", T.F16, head.shape, head))  # no integer decode kernel
    assert net.greedy_steps(batch, net.new_cache(8, 16, "f32"), 2, none) is None


@pytest.mark.parametrize("sampling", [{}, {"repetition_penalty": 1.3}])
def test_the_engines_greedy_bursts_run_in_one_call(sampling: dict, monkeypatch) -> None:
    """Plain greedy sequences burst through Transformer.greedy_steps and get the tokens of the Python
    steps; a penalty (which needs the logits in Python) keeps the per-step path."""
    net = Transformer(open_model_file(DEMO_MODEL), get_ops("cpu"))
    greedy_steps, calls = Transformer.greedy_steps, []

    def counted(self, *args):  # type: ignore[no-untyped-def]
        tokens = greedy_steps(self, *args)
        calls.append(0 if tokens is None else len(tokens))
        return tokens

    def generated() -> list[list[int]]:
        engine = EngineCore(ModelRunner(net, 32, 16), decode_burst=math.inf, max_burst=4)
        seqs = [Sequence([100 + i, 200, 300 + i], max_tokens=10 + i, params=SamplingParams(**sampling)) for i in range(3)]
        for seq in seqs:
            engine.add(seq)
        while engine.has_work:
            engine.step()
        return [s.generated for s in seqs]

    monkeypatch.setattr(Transformer, "greedy_steps", lambda *args: None)
    python_steps = generated()
    monkeypatch.setattr(Transformer, "greedy_steps", counted)
    assert generated() == python_steps and [len(g) for g in python_steps] == [10, 11, 12]
    assert (max(calls, default=0) == 4) == (not sampling)
