"""The CPU's one-call expert FFN for decode steps (kernels/cpu/expert_ffn.py), and its one call for a
layer's router, routing and experts, compute what the ops API's defaults compute, bit for bit, so a
token's result never depends on which ran it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ember
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.cpu import expert_ffn, twin
from ember.kernels.ops import Ops, Routing

from tiny_models import FIXTURES

MOE = FIXTURES / "ember-demo-moe-q8_0.gguf"


def requantized_laguna(tmp: Path):  # type: ignore[no-untyped-def]
    """The tiny random Laguna (tiny_models; a dense lead layer, then routed experts with an ungated
    shared expert, sigmoid routing, sliding windows, an output gate) with every matrix but the routers
    in Q8_0, so that its layers take the integer kernels and the compiled stack."""
    from dataclasses import replace

    from ember.daemon.loader.model_file import open_model_file
    from ember.daemon.models.transformer import Transformer
    from ember.kernels import get_ops
    from ember.kernels.raw_tensor import RawTensor
    from ember.kernels.reference.quant import quantize
    from ember.kernels.tensor_types import TensorType
    from tiny_models import build_hf_model

    path, _ = build_hf_model("laguna", tmp / "laguna")
    mf = open_model_file(path)

    def q8_0(t: RawTensor) -> RawTensor:
        if len(t.shape) < 2 or t.name.endswith("ffn_gate_inp.weight"):
            return t
        data = quantize(TensorType.Q8_0, np.asarray(t.rows2d(), np.float32)).reshape(*t.shape[:-1], -1)
        return RawTensor(t.name, TensorType.Q8_0, t.shape, data)

    return Transformer(replace(mf, tensors={k: q8_0(t) for k, t in mf.tensors.items()}), get_ops("cpu"))


@pytest.fixture(scope="module", params=["qwen3moe", "laguna"])
def net(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The trained MoE demo; the tiny Laguna in Q8_0 (shared experts inside the compiled step)."""
    if request.param == "qwen3moe":
        return ember.load(MOE).net
    return requantized_laguna(tmp_path_factory.mktemp("laguna"))


def decode_states(net, steps: int = 3) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """Three sequences read prompts, then decode together: the last layer's output of each step."""
    cache = net.new_cache(12, 16)
    prompts, tables = ([5, 6, 7, 8, 9], [10, 11], [12, 13, 14]), ([0, 1], [2, 3], [4, 5])
    net.forward(StepBatch.build([(p, 0, t) for p, t in zip(prompts, tables)], 16), cache)
    out, tokens = [], [20, 21, 20]  # two sequences on the same token: an expert with several tokens
    for k in range(steps):
        batch = StepBatch.build([([tok], len(p) + k, t) for tok, p, t in zip(tokens, prompts, tables)], 16,
                                prompt_lengths=[len(p) for p in prompts])
        hidden = net.run_layers(net.embed_tokens(batch), batch, cache)
        out.append(np.array(hidden))
        tokens = [int(t) for t in np.argmax(net.head(hidden, batch), axis=1)]
    return out


@pytest.mark.parametrize("variant", [None, "serial", "parallel"])
def test_decode_steps_equal_the_default_expert_ffn(net, variant: str | None, monkeypatch) -> None:
    """Three ways through a decode step, the same bits and the same routing statistics: the whole
    stack in one backend call (each MoE layer finished by routed_finish), layer by layer (the compiled
    attention, then the FFN from Python through routed_ffn's one call), and the ops API's defaults."""
    monkeypatch.setattr(twin, "FORCE", variant)
    stats, manager = net.experts.stats, net.experts
    start, slots = stats.counts.copy(), int(manager.routed_slots[0])

    def run() -> tuple[list[np.ndarray], np.ndarray, int]:
        stats.counts[:] = start
        manager.routed_slots[0] = slots
        return decode_states(net), stats.counts.copy(), int(manager.routed_slots[0]) - slots

    finishes, calls = [], []
    whole = expert_ffn.routed_finish
    monkeypatch.setattr(expert_ffn, "routed_finish", lambda *a: finishes.append(1) or whole(*a))
    paths = [run()]
    moe = len(net.experts.ffns)  # the MoE layers (Laguna's first is dense)
    assert len(finishes) == 3 * moe  # every MoE layer of every step, no Python between layers
    fused = expert_ffn.routed_ffn
    monkeypatch.setattr(expert_ffn, "routed_ffn", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(net.stack, "whole", None)  # layer by layer
    paths.append(run())
    assert len(calls) == 3 * moe  # router to experts in one call
    monkeypatch.setattr(type(net.ops), "routed_ffn", Ops.routed_ffn)  # the API's default: router, route, experts
    monkeypatch.setattr(expert_ffn, "expert_ffn", lambda *a: None)  # and the experts through the default
    monkeypatch.setattr(net.stack, "fused", [None] * len(net.blocks))  # and the attention runs op by op
    paths.append(run())
    (states, counts, routed), *others = paths
    tokens = 5 + 2 + 3 + 3 * 3  # the prompts', then 3 steps of 3 sequences
    assert routed == tokens * net.config.n_experts_used * moe and not np.array_equal(counts, start)
    for other_states, other_counts, other_routed in others:
        for a, b in zip(states, other_states, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(counts, other_counts)
        assert routed == other_routed


def test_a_moe_layers_attention_is_fused_without_its_ffn(net) -> None:
    moe = set(net.experts.ffns)
    assert all(f is not None and (layer.weights.gate is None) == (i in moe)
               for i, (f, layer) in enumerate(zip(net.stack.fused, net.stack.layers)))


@pytest.mark.parametrize("gelu", [False, True])
def test_one_call_equals_the_default_on_the_same_pairs(net, gelu: bool, monkeypatch) -> None:
    """Ops.expert_ffn (the API's default, which the CPU falls back to) on the same arguments: experts
    with one and with several tokens, pairs in no particular order; gated by SiLU, and by GELU-tanh
    (gemma4's experts), which the one call runs too."""
    ffn = next(iter(net.experts.ffns.values()))
    hot = {e: w._replace(gelu=gelu) for e, w in ffn.hot.items()}
    x = np.random.default_rng(0).standard_normal((3, net.config.hidden)).astype(np.float32)
    token, expert = np.array([0, 0, 1, 1, 2, 2]), np.array([3, 7, 7, 1, 3, 0])
    weight = np.random.default_rng(1).random(6).astype(np.float32)
    want = Ops.expert_ffn(net.ops, x, hot, token, expert, weight, np.ones(3, bool))
    assert np.abs(want).min() > 0  # every token got its experts' outputs
    calls = []
    one_call = expert_ffn.expert_ffn
    monkeypatch.setattr(expert_ffn, "expert_ffn", lambda *a: calls.append(1) or one_call(*a))
    got = net.ops.expert_ffn(x, hot, token, expert, weight, np.ones(3, bool))
    assert calls and one_call(x, hot, token, expert, weight) is not None  # not the default's fallback
    np.testing.assert_array_equal(got, want)
    if gelu:  # the gating is not the same: the comparison can fail
        silu = Ops.expert_ffn(net.ops, x, ffn.hot, token, expert, weight, np.ones(3, bool))
        assert not np.array_equal(got, silu)


@pytest.mark.parametrize("router_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("routing", [Routing(2, True), Routing(3, True, "sigmoid", None, 3.0, 2.5),
                                     Routing(2, False, "sigmoid", "bias", 0.0, 1.0)], ids=["softmax", "capped", "biased"])
def test_one_call_routing_equals_the_default_routing(net, router_type: str, routing: Routing) -> None:
    """ops.routed_ffn in one compiled call (a float32 or integer router; softmax or Laguna's sigmoid
    gating, with a soft cap, a selection bias, a scale) against the API's default's three calls."""
    from ember.kernels.raw_tensor import RawTensor
    from ember.kernels.reference.quant import quantize
    from ember.kernels.tensor_types import TensorType

    ffn = next(iter(net.experts.ffns.values()))
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((ffn.n_experts, net.config.hidden)).astype(np.float32) * 0.2
    ttype = TensorType[router_type]
    data = logits if ttype == TensorType.F32 else quantize(ttype, logits).reshape(logits.shape[0], -1)
    router = net.ops.weight(RawTensor("router", ttype, logits.shape, data))
    if routing.bias is not None:
        routing = routing._replace(bias=(rng.standard_normal(ffn.n_experts) * 0.1).astype(np.float32))
    table = net.ops.expert_table(ffn.hot, ffn.n_experts)
    assert table.complete
    x = rng.standard_normal((5, net.config.hidden)).astype(np.float32)
    got, ids = net.ops.routed_ffn(x, router, table, routing, np.ones(5, bool))
    want, want_ids = Ops.routed_ffn(net.ops, x, router, dict(ffn.hot), routing, np.ones(5, bool))
    assert (ids == want_ids).all() and len(set(ids.reshape(-1))) > routing.k
    np.testing.assert_array_equal(got, want)
