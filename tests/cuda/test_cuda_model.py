"""The micro model on cuda:0 against the same file on the CPU: logits within float32 noise, the same
greedy tokens, every weight type read."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import ember

sys.path.insert(0, str(Path(__file__).parent))

from micro_model import WEIGHT_TYPES, write_micro_model  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [1, 17, 300, 45, 9]


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_micro_model(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="module")
def pair(micro: Path) -> tuple[ember.Model, ember.Model]:
    # f32 decode and prompt activations on the CPU: the CUDA backend computes every row in float32
    return (ember.load(micro, decode_act="f32", prompt_act="f32", kv_dtype="f32"),
            ember.load(micro, device="cuda:0", kv_dtype="f32"))


def test_the_micro_model_holds_every_weight_type(micro: Path) -> None:
    from ember.daemon.loader.model_file import open_model_file

    assert {t.ttype for t in open_model_file(micro).tensors.values()} == WEIGHT_TYPES


def test_cuda_logits_equal_cpu_logits(pair: tuple[ember.Model, ember.Model]) -> None:
    cpu, gpu = pair
    assert gpu.device == "cuda:0"
    want, got = cpu.logits(PROMPT), gpu.logits(PROMPT)
    assert got.shape == want.shape == (len(PROMPT), 512)
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())


def test_cuda_greedy_tokens_equal_cpu_tokens(pair: tuple[ember.Model, ember.Model]) -> None:
    cpu, gpu = pair
    want = list(cpu.generate(PROMPT[:3], max_tokens=3, ignore_eos=True))
    assert list(gpu.generate(PROMPT[:3], max_tokens=3, ignore_eos=True)) == want


def test_cuda_seeded_sampling_equals_cpu(pair: tuple[ember.Model, ember.Model]) -> None:
    """The full sampler on the device (penalties, temperature, top-k/p) draws from the request's
    generator as the host sampler does: the same seeded tokens on both devices."""
    cpu, gpu = pair
    options = dict(max_tokens=2, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2, seed=7)
    assert list(gpu.generate(PROMPT[:3], **options)) == list(cpu.generate(PROMPT[:3], **options))


def test_a_hybrid_moe_model_on_cuda_equals_cpu(tmp_path: Path) -> None:
    """qwen35moe: gated attention (a strided [q | gate] split, partial rotary), Gated DeltaNet layers
    (their recurrence through the ops API's host defaults, on the device's arrays), routed experts and
    a sigmoid-gated shared expert (array broadcasting in model code)."""
    from tiny_models import QWEN35, build_hf_model

    moe = dict(QWEN35, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
               shared_expert_intermediate_size=96, vocab_size=512)
    path, _ = build_hf_model("qwen35moe", tmp_path / "hybrid", **moe)
    want = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32").logits(PROMPT[:3])
    got = ember.load(path, device="cuda:0", kv_dtype="f32").logits(PROMPT[:3])
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())


def test_laguna_on_cuda_equals_cpu(tmp_path: Path) -> None:
    """laguna: sliding-window layers (the window passed: 10 tokens, a window of 8), per-layer heads,
    the softplus output gate, sigmoid routing with a selection bias and soft cap, an ungated shared
    expert, through the device's kernels and the ops API's defaults."""
    from tiny_models import build_hf_model

    path, _ = build_hf_model("laguna", tmp_path / "laguna", vocab_size=512)
    prompt = PROMPT * 2
    want = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32").logits(prompt)
    got = ember.load(path, device="cuda:0", kv_dtype="f32").logits(prompt)
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())
